"""`stepwatch preflight` on jobs of bench/torch-jobs, judged against fake CUDA's truth.

Each job runs through preflight on a roomy GPU (it fits), then at a capacity
between its step-1 peak and its steady peak (step 2 must die) and, for one,
just above its steady peak (under 5% to spare). The step-2 OOM is checked
without preflight too: the same script under plain `fake-cuda run` at the same
capacity prints "step 1 done" and dies of torch.OutOfMemoryError in step 2.
Run with the test venv (scripts/test does); needs `target/debug/stepwatch`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
FAKE_CUDA = HERE.parent / "fake-cuda"
REPO = HERE.parents[2]
JOBS = REPO / "bench" / "torch-jobs"
MIB = 1 << 20
DRIVER_RESERVED = 512 * MIB  # what preflight's --gpu-capacity adds, as fake-cuda does

pytest.importorskip("torch")


def binary() -> Path:
    b = Path(os.environ.get("STEPWATCH_BIN") or REPO / "target" / "debug" / "stepwatch")
    if not (b.is_file() and os.access(b, os.X_OK)):
        pytest.fail(f"no stepwatch binary at {b}: cargo build -p stepwatch (or set STEPWATCH_BIN)")
    return b


def env() -> dict[str, str]:
    e = dict(os.environ)
    for name in list(e):
        if name.startswith("STEPWATCH_") and name != "STEPWATCH_BIN":
            del e[name]
    # The client of this tree, and this venv's python and torchrun first on PATH.
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "python"), e.get("PYTHONPATH")]))
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")])
    return e


ROOMY: dict[tuple[str, ...], tuple[int, dict[str, Any], str]] = {}


def roomy(cmd: list[str]) -> tuple[int, dict[str, Any], str]:
    """preflight on an H100 80GB, once per command for the whole module."""
    if tuple(cmd) not in ROOMY:
        ROOMY[tuple(cmd)] = preflight(["--gpu", "h100-80gb"], cmd)
    return ROOMY[tuple(cmd)]


def preflight(capacity: list[str], cmd: list[str]) -> tuple[int, dict[str, Any], str]:
    p = subprocess.run(
        [str(binary()), "preflight", *capacity, "--json", "--", *cmd],
        env=env(),
        cwd=str(JOBS),
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        report = json.loads(p.stdout)
    except ValueError:
        pytest.fail(f"preflight printed no JSON (exit {p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.returncode, report, p.stderr


def plain_run(
    usable: int, cmd: list[str], gpus: int = 1, steps: int = 3
) -> subprocess.CompletedProcess:
    """The script under fake-cuda alone (no agent, no preflight) at `usable` bytes."""
    e = env()
    e["STEPWATCH_ENDPOINT"] = "unix:///nonexistent/stepwatch.sock"
    return subprocess.run(
        [sys.executable, str(FAKE_CUDA), "run", "--quiet", "--python", sys.executable]
        + ["--gpus", str(gpus), "--gpu-capacity", str(usable + DRIVER_RESERVED), "--"]
        + cmd
        + ["--steps", str(steps)],
        env=e,
        cwd=str(JOBS),
        capture_output=True,
        text=True,
        timeout=300,
    )


PY = sys.executable
# (name in jobs.json, command): small jobs of the accuracy corpus. lightning-gpt (the
# Lightning callback) passes too, but adds ~45 s on the 2-core machine.
TORCHRUN = str(Path(PY).parent / "torchrun")
CASES = [
    ("gpt-adamw", [PY, "gpt.py"]),
    ("ddp-2", [TORCHRUN, "--standalone", "--nproc-per-node", "2", "ddp.py"]),
]


def test_the_jobs_are_the_manifests():
    manifest = {j["name"]: j for j in json.loads((JOBS / "jobs.json").read_text())}
    for name, cmd in CASES:
        script = cmd.index(manifest[name]["script"])
        assert cmd[script + 1 :] == manifest[name]["args"]
        assert manifest[name]["nproc"] == (2 if cmd[0] == TORCHRUN else 1)


@pytest.mark.parametrize("name,cmd", CASES, ids=[c[0] for c in CASES])
def test_verdicts_match_fake_cudas_truth(name, cmd):
    # Roomy: fits, and the prediction made in step 1 is the steady peak.
    ranks = 2 if cmd[0] == TORCHRUN else 1
    rc, fits, err = roomy(cmd)
    assert rc == 0, (fits, err)
    assert fits["fits"] is True and fits["gpu"]["count"] == ranks
    assert fits["gpu"]["usable_bytes"] == fits["gpu"]["total_bytes"] - fits["gpu"]["reserved_bytes"]
    assert [r["rank"] for r in fits["ranks"]] == list(range(ranks))
    for r in fits["ranks"]:
        assert r["verdict"] == "fits" and r["steps_completed"] == 3, r
        assert 0 < r["step1_peak_bytes"] < r["steady_peak_bytes"], r  # step 2 needs more
        assert abs(r["prediction_error"]) < 0.03, r
    assert len(fits["cannot_see"]) >= 4
    s1 = max(r["step1_peak_bytes"] for r in fits["ranks"])
    steady = min(r["steady_peak_bytes"] for r in fits["ranks"])

    # Between the step-1 peak and the steady peak: step 1 fits, step 2 dies.
    usable = s1 + (steady - s1) // 4
    rc, oom, err = preflight(["--gpu-capacity", str(usable)], cmd)
    assert rc == 1, (oom, err)
    assert oom["fits"] is False
    died = [r for r in oom["ranks"] if r["verdict"] == "step2_oom"]
    assert died, oom["ranks"]
    for r in died:
        assert r["oom_step"] == 2, r
        assert r["predicted_oom"], r  # and the agent said so during step 1
    assert all(r["verdict"] in ("step2_oom", "aborted") for r in oom["ranks"]), oom["ranks"]
    truth = plain_run(usable, cmd, gpus=ranks)
    assert truth.returncode != 0, truth.stdout
    assert "step 1 done" in truth.stdout and "step 2 done" not in truth.stdout, truth.stdout
    assert "OutOfMemoryError" in truth.stderr, truth.stderr[-2000:]


def test_under_5_percent_to_spare_is_not_a_fit():
    cmd = CASES[0][1]
    rc, fits, _ = roomy(cmd)
    assert rc == 0
    steady = fits["ranks"][0]["steady_peak_bytes"]
    rc, tight, err = preflight(["--gpu-capacity", str(int(steady * 1.02))], cmd)
    assert rc == 1, (tight, err)
    (r,) = tight["ranks"]
    assert r["verdict"] == "under_5_percent", r
    assert 0 < r["headroom_fraction"] < 0.05, r
    # The truth: it runs every step at that capacity.
    truth = plain_run(int(steady * 1.02), cmd)
    assert truth.returncode == 0 and "step 3 done" in truth.stdout, truth.stderr[-2000:]


def test_the_advised_micro_batch_fits_when_verified():
    # gpt.py is a plain `stepwatch.watch(model, optimizer)` loop: the client reads the
    # micro-batch (4, gpt.py's default --batch) from the forward's inputs.
    rc, fits, _ = roomy(CASES[0][1])
    assert rc == 0
    (r,) = fits["ranks"]
    assert r["what_would_fit"]["micro_batch_size"] == 4, r["what_would_fit"]
    usable = r["step1_peak_bytes"] + (r["steady_peak_bytes"] - r["step1_peak_bytes"]) // 4
    cmd = [PY, "gpt.py", "--batch", "4"]
    rc, oom, err = preflight(
        ["--gpu-capacity", str(usable), "--verify-advice", "--batch-arg", "--batch"], cmd
    )
    assert rc == 1, (oom, err)  # the command as given still does not fit
    (r,) = oom["ranks"]
    assert r["verdict"] == "step2_oom", r
    fit = r["what_would_fit"]
    n = fit["fits_with_micro_batch_size"]
    assert fit["micro_batch_size"] == 4 and 1 <= n < 4, fit
    advised = [m["message"] for m in r["advisories"] if m["kind"] == "step2_oom_predicted"]
    assert advised and f"a micro-batch of {n} instead of 4" in advised[-1], advised
    v = oom["verify_advice"]
    assert v["ran"] is True and v["micro_batch_size"] == n, v
    assert v["command"] == [PY, "gpt.py", "--batch", str(n)], v
    assert v["fits"] is True, v
    (checked,) = v["ranks"]
    assert checked["verdict"] in ("fits", "under_5_percent") and checked["oom_step"] is None
    assert checked["steady_peak_bytes"] < usable, checked
    # The truth without preflight: at that micro-batch the script runs every step.
    truth = plain_run(usable, v["command"])
    assert truth.returncode == 0 and "step 3 done" in truth.stdout, truth.stderr[-2000:]


def test_verify_advice_says_at_once_when_it_cannot_set_the_micro_batch():
    cmd = [PY, "gpt.py"]
    rc, report, err = preflight(["--gpu", "h100-80gb", "--verify-advice"], cmd)
    assert rc == 2 and "--batch-arg NAME" in report["error"], (report, err)
    rc, report, err = preflight(
        ["--gpu", "h100-80gb", "--verify-advice", "--batch-arg", "--batch"], cmd
    )
    assert rc == 2, (report, err)
    assert "the command has no `--batch N` or `--batch=N` to rewrite" in report["error"]
    assert " fake " not in err  # nothing ran


def test_a_script_without_stepwatch_is_a_failed_preflight(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nprint(torch.zeros(4, device='cuda').sum().item())\n")
    rc, report, err = preflight(["--gpu", "h100-80gb"], [PY, str(script)])
    assert rc == 2, (report, err)
    assert "stepwatch.watch(model, optimizer)" in report["error"], report
    assert "stepwatch.watch(model, optimizer)" in err
