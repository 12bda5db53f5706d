"""tools/gpu_train.py (the real-GPU fixture trainer) on CPU, tiny sizes, against the fake agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, STEP, agent_binary, summary

from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

pytest.importorskip("torch")

SCRIPT = REPO / "python" / "tools" / "gpu_train.py"
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--batch", "2"]
TINY += ["--vocab", "64", "--device", "cpu", "--steps", "3", "--flush-timeout", "5"]


@pytest.mark.parametrize(
    "optimizer,kind",
    [
        ("adamw", pb.OPTIMIZER_KIND_ADAM),
        ("sgd", pb.OPTIMIZER_KIND_SGD),
        ("sgd-momentum", pb.OPTIMIZER_KIND_SGD_MOMENTUM),
    ],
)
def test_gpu_train_on_cpu(agent, optimizer, kind):
    job = f"gpu-train-test-{optimizer}"
    env = dict(os.environ, STEPWATCH_ENDPOINT=agent.endpoint, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--optimizer", optimizer, "--job-id", job, *TINY],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ms = agent.wait_markers(18)
    assert summary(ms) == [(k, s, 0) for s in (1, 2, 3) for k in STEP]
    hello = agent.streams[0].hello
    assert hello.identity.job_id == job
    assert hello.model.optimizer == kind
    assert hello.model.precision == pb.PRECISION_MIXED_BF16
    assert hello.model.parameter_count > 0

    lines = proc.stdout.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("step ")] == ["1", "2", "3"]
    (last,) = [ln for ln in lines if ln.startswith("summary: ")]
    report = json.loads(last[len("summary: ") :])
    assert report["job_id"] == job
    assert report["parameters"] == hello.model.parameter_count
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert report["flushed"] is True
    assert report["stats"]["sent"] == 18 and report["stats"]["dropped"] == 0


def test_gpu_train_without_agent_exits_zero(sock_dir):
    env = dict(os.environ, STEPWATCH_ENDPOINT=f"unix://{sock_dir}/none.sock")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--steps", "2", "--flush-timeout", "0.2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "never reached the agent" in proc.stderr


def test_gpu_train_rejects_bad_sizes():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--hidden", "30", "--heads", "4", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "multiple of --heads" in proc.stderr


def test_gpu_capture_fake_mode(tmp_path):
    """bench/gpu-capture.sh --fake: the whole capture path on fake NVML and CPU training."""
    binary = agent_binary()
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        PYTHON=sys.executable,
        STEPWATCH_BIN=str(binary),
        GPU_TRAIN_ARGS="--steps 3",
    )
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu-capture.sh"), "--fake"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = (out / "capture.log").read_text()
    assert proc.returncode == 0, log + proc.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    for run in ("adamw", "sgd"):
        report = json.loads((out / f"{run}-report.json").read_text())
        assert report["job"] == f"gpu-capture-{run}"
        assert report["steps_completed"] == 3
    summary_txt = (out / "summary.txt").read_text()
    assert "## adamw" in summary_txt and "## sgd" in summary_txt
    assert "# ===== run sgd" in (out / "metrics.txt").read_text()
    assert "exit status 0" in log
    assert "agent --record: yes; replay-record: yes" in log  # this checkout's agent has both
    for run in ("adamw", "sgd"):
        lines = (out / f"{run}.jsonl").read_text().splitlines()
        assert any('"markers"' in line for line in lines), run
