"""watch(hold_step2_for_prediction=, raise_on_predicted_oom=): step 2 waits
for step 1's prediction (bounded, never for an absent agent), and a predicted
step-2 OOM is raised into training at the next step boundary instead of
letting step 2 die. First with the in-process fake agent, then with the real
agent on fake GPUs (real PyTorch on crates/fake-cuda, fake NVML), where a GAN
with two optimizers also gets its prediction."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import KIND, STEP, summary
from fake_gpu_agent import FakeGpuAgent, fake_gpu_agent

import stepwatch
from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

torch = pytest.importorskip("torch")

GB = 10**9


def step1_advice(kind: int, severity: int, message: str, peak: int) -> dict:
    """The fields of an advisory on step 1's prediction for an 80 GB GPU."""
    capacity = 80 * GB
    return dict(
        kind=kind,
        severity=severity,
        message=message,
        step=1,
        predicted_peak_bytes=peak,
        capacity_bytes=capacity,
        predicted_headroom_bytes=capacity - peak,
    )


OOM_ADVICE = step1_advice(
    pb.ADVISORY_KIND_STEP2_OOM_PREDICTED,
    pb.SEVERITY_CRITICAL,
    "predicted steady-state peak 81.20 GB exceeds capacity 80.00 GB by 1.20 GB; "
    "step 2 will likely run out of GPU memory; predicted to fit: a micro-batch of 4 instead of 8",
    peak=int(81.2 * GB),
)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def one_step(model, opt):
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def advise_after_step_1(agent, delay: float = 0.0) -> None:
    """The fake agent answers step 1's STEP_END with a step-2 OOM advisory,
    ``delay`` seconds later (as the real one does once it has predicted)."""

    def on_marker(rec, m):
        if m.kind == pb.STEP_END and m.step == 1:
            threading.Timer(delay, lambda: agent.advise(**OOM_ADVICE)).start()

    agent.on_marker = on_marker


def test_a_predicted_oom_is_raised_at_the_next_step_boundary(agent):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    advise_after_step_1(agent)
    stepwatch.watch(model, opt, raise_on_predicted_oom=True)
    one_step(model, opt)
    assert agent.wait_for(lambda: stepwatch.last_prediction() is not None)
    with pytest.raises(stepwatch.PredictedOutOfMemoryError) as raised:
        model(torch.randn(4, 8))  # step 2's first forward: the boundary
    e = raised.value
    assert isinstance(e, stepwatch.StepwatchError)
    assert (e.predicted_peak_bytes, e.capacity_bytes, e.predicted_headroom_bytes) == (
        int(81.2 * GB),
        80 * GB,
        -int(1.2 * GB),
    )
    assert e.advice == OOM_ADVICE["message"]
    assert e.prediction.kind == "ADVISORY_KIND_STEP2_OOM_PREDICTED"
    text = str(e)
    assert "step 2 is predicted to run out of GPU memory" in text
    assert "a micro-batch of 4 instead of 8" in text and "81.2 GB" in text
    # Step 2 did not begin for the agent.
    assert stepwatch.flush(10)
    assert summary(agent.all_markers()) == [(k, 1, 0) for k in STEP]
    # Raised once: a script that catches it and goes on is watched on.
    one_step(model, opt)
    ms = agent.wait_markers(12)
    assert summary(ms)[6:] == [(k, 2, 0) for k in STEP]


def test_without_the_option_a_predicted_oom_raises_nothing(agent):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    advise_after_step_1(agent)
    stepwatch.watch(model, opt)
    one_step(model, opt)
    assert agent.wait_for(lambda: stepwatch.last_prediction() is not None)
    one_step(model, opt)
    agent.wait_markers(12)


def test_step_2_is_held_until_the_prediction_arrives(agent, caplog):
    """The advisory comes 0.5 s after step 1's end: step 2's first marker
    waits for it (not for the 30 s bound), and the raise then comes before
    step 2 begins."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    advise_after_step_1(agent, delay=0.5)
    stepwatch.watch(model, opt, hold_step2_for_prediction=30, raise_on_predicted_oom=True)
    assert stepwatch._runtime.RT.client.wait_connected(10)
    caplog.set_level(logging.INFO, logger="stepwatch")
    one_step(model, opt)
    t0 = time.monotonic()
    with pytest.raises(stepwatch.PredictedOutOfMemoryError):
        one_step(model, opt)
    held = time.monotonic() - t0
    assert 0.4 < held < 10, held
    assert any("until step 1's prediction arrived" in r.getMessage() for r in caplog.records)


def test_the_hold_runs_to_its_bound_when_no_advisory_comes_once_per_run(agent, caplog):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(model, opt, hold_step2_for_prediction=0.5)
    assert stepwatch._runtime.RT.client.wait_connected(10)
    caplog.set_level(logging.INFO, logger="stepwatch")
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        one_step(model, opt)
        times.append(time.monotonic() - t0)
    assert times[1] >= 0.5 and times[2] < 0.4, times
    assert any("prediction did not arrive" in r.getMessage() for r in caplog.records)
    # The held step 2 marked after the hold: its STEP_BEGIN ≥ 0.5 s after step 1's end.
    ms = agent.wait_markers(18)
    by = {(KIND[m.kind], m.step): m.monotonic_ns for m in ms}
    assert by[("STEP_BEGIN", 2)] - by[("STEP_END", 1)] >= 0.5e9


FINAL_ADVICE = step1_advice(
    pb.ADVISORY_KIND_PREDICTION_FINAL,
    pb.SEVERITY_INFO,
    "step 1's prediction is final: steady-state peak 40.00 GB of 80.00 GB, headroom "
    "40.00 GB; step 2 is predicted to fit",
    peak=40 * GB,
)


@pytest.mark.parametrize("from_env", [False, True])
def test_the_hold_ends_when_the_prediction_is_final_and_step_2_fits(
    agent, caplog, monkeypatch, from_env
):
    """The agent says step 1's prediction is final (step 2 fits) 0.3 s after
    step 1's end: step 2 waits that long, not its 30 s bound, and nothing is
    raised. The bound may come from $STEPWATCH_HOLD_STEP2_FOR_PREDICTION."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())

    def on_marker(rec, m):
        if m.kind == pb.STEP_END and m.step == 1:
            threading.Timer(0.3, lambda: agent.advise(**FINAL_ADVICE)).start()

    agent.on_marker = on_marker
    if from_env:
        monkeypatch.setenv("STEPWATCH_HOLD_STEP2_FOR_PREDICTION", "30")
        stepwatch.watch(model, opt, raise_on_predicted_oom=True)
    else:
        stepwatch.watch(model, opt, hold_step2_for_prediction=30, raise_on_predicted_oom=True)
    assert stepwatch._runtime.RT.client.wait_connected(10)
    caplog.set_level(logging.INFO, logger="stepwatch")
    one_step(model, opt)
    t0 = time.monotonic()
    one_step(model, opt)  # no PredictedOutOfMemoryError: step 2 fits
    held = time.monotonic() - t0
    assert 0.25 < held < 10, held
    assert any("until step 1's prediction arrived" in r.getMessage() for r in caplog.records)
    assert stepwatch.last_prediction() is None  # not a step-2 warning


@pytest.mark.parametrize("as_kwargs", [False, True])
def test_a_larger_step_2_batch_than_step_1s_is_told_before_step_2_begins(agent, caplog, as_kwargs):
    """A warm-up step 1 of 1 sample, then 4: at step 2's first forward, before
    step 2 is marked, the client says step 1's prediction does not cover it
    (inputs as `model(x)` or, as Hugging Face loops call, `model(**batch)`)."""

    class KwModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.net(input_ids)

    model = KwModel()
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(model, opt)
    caplog.set_level(logging.INFO, logger="stepwatch")
    seen_at = []
    for batch in (1, 4, 4):
        x = torch.randn(batch, 8)
        out = model(input_ids=x) if as_kwargs else model(x)
        seen_at.append(stepwatch.stats()["step2_inputs_larger"])
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert seen_at == [False, True, True]
    told = [r for r in caplog.records if "larger inputs than step 1's" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.WARNING
    assert "32 elements, shapes [(4, 8)]; step 1: 8, shapes [(1, 8)]" in told[0].getMessage()
    assert "does not cover this batch" in told[0].getMessage()


def test_the_same_batch_every_step_is_not_told(agent, caplog):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(model, opt)
    caplog.set_level(logging.INFO, logger="stepwatch")
    for _ in range(3):
        one_step(model, opt)
    assert not stepwatch.stats()["step2_inputs_larger"]
    assert not any("larger inputs" in r.getMessage() for r in caplog.records)


def test_the_hold_never_waits_for_an_absent_agent(sock_dir, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ENDPOINT", "unix://" + os.path.join(sock_dir, "none.sock"))
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(model, opt, hold_step2_for_prediction=60, raise_on_predicted_oom=True)
    t0 = time.monotonic()
    for _ in range(3):
        one_step(model, opt)
    assert time.monotonic() - t0 < 5
    assert stepwatch.stats()["sent"] == 0


# ------------------------------------------------- the real agent, fake GPUs
MIB = 1 << 20

# The job (one file, shared with the Slurm test): 8 layers of 1024, AdamW.
JOB = str(Path(__file__).with_name("predicted_oom_job.py"))


def train(agent: FakeGpuAgent, hold: float, fail_fast: bool) -> subprocess.CompletedProcess:
    """JOB on ``agent``'s fake GPU."""
    args = ["--hold", str(hold), *(["--fail-fast"] if fail_fast else [])]
    return agent.run([JOB, *args], f"pytest-{uuid.uuid4().hex[:8]}")


def run(
    agent: FakeGpuAgent, script: str, args=(), job: str = "", device: str = ""
) -> subprocess.CompletedProcess:
    """``python -c script args`` on the fake GPU, reporting to the agent; on
    ``device`` (CUDA_VISIBLE_DEVICES) when given."""
    return agent.run(["-c", script, *args], job or f"pytest-{uuid.uuid4().hex[:8]}", device=device)


# What this job reserves in step 1 on fake CUDA (PyTorch 2.15): 282 MiB; step 2
# reserves about 48 MiB more. A GPU with room for step 1 and 24 MiB to spare
# (context 512 MiB, driver reserve 512 MiB) cannot run step 2.
STEP1_RESERVED = 282 * MIB
TIGHT = 512 * MIB + 512 * MIB + STEP1_RESERVED + 24 * MIB


@pytest.fixture
def tight_gpu_agent(tmp_path):
    with fake_gpu_agent(tmp_path, TIGHT) as a:
        yield a


def test_the_real_agents_oom_prediction_stops_the_job_before_step_2(tight_gpu_agent):
    """Held for step 1's prediction, the job gets the agent's step-2 OOM
    advisory before step 2 and stops with PredictedOutOfMemoryError (its
    figures and advice) instead of dying of a CUDA OOM in step 2."""
    proc = train(tight_gpu_agent, hold=60, fail_fast=True)
    out = proc.stdout + proc.stderr
    assert f"step 1 done reserved {STEP1_RESERVED}" in proc.stdout, out
    assert proc.returncode == 3, out
    assert "step 2 done" not in proc.stdout and "OutOfMemoryError: CUDA" not in out, out
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PREDICTED_OOM"))
    figures = dict(f.split("=", 1) for f in line.split()[1:4])
    assert int(figures["peak"]) > int(figures["capacity"]) == TIGHT - 512 * MIB
    assert int(figures["headroom"]) < 0
    assert "step 2 will likely run out of GPU memory" in line
    assert "until step 1's prediction arrived" in proc.stderr, proc.stderr


def test_the_real_agent_ends_the_hold_when_step_2_fits(tmp_path):
    """On a roomy GPU the same job, held up to 60 s, waits only until the
    agent's PREDICTION_FINAL (step 1's end reached it): before, the hold ran
    to its bound whenever step 2 fit."""
    with fake_gpu_agent(tmp_path, 80 << 30) as a:
        proc = train(a, hold=60, fail_fast=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "step 3 done" in proc.stdout, out
    held = re.search(r"step 2 held ([0-9.]+) s until step 1's prediction arrived", proc.stderr)
    assert held and float(held.group(1)) < 30, out
    assert "prediction is final" in proc.stderr and "predicted to fit" in proc.stderr, out


def test_without_the_options_step_2_dies_of_the_oom_the_agent_predicted(tight_gpu_agent):
    """The same job without them: the advisory comes (logged), but step 2
    dies of a CUDA OOM, as predicted."""
    proc = train(tight_gpu_agent, hold=0, fail_fast=False)
    out = proc.stdout + proc.stderr
    assert "step 1 done" in proc.stdout and "step 2 done" not in proc.stdout, out
    assert proc.returncode == 1 and "OutOfMemoryError" in out, out


GAN = r"""
import torch, stepwatch
class Gan(torch.nn.Module):  # no forward of its own: the loop calls each part
    def __init__(self):
        super().__init__()
        self.generator = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
        self.discriminator = torch.nn.Sequential(
            torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
with torch.device("cuda"):
    gan = Gan()
opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-4)
opt_g = torch.optim.Adam(gan.generator.parameters(), lr=2e-4)
stepwatch.watch(gan, [opt_d, opt_g])
bce = torch.nn.functional.binary_cross_entropy_with_logits
for step in (1, 2, 3, 4):
    real = torch.randn(512, 1024, device="cuda")
    fake = gan.generator(torch.randn(512, 256, device="cuda"))
    opt_d.zero_grad()
    d_real, d_fake = gan.discriminator(real), gan.discriminator(fake.detach())
    (bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))).backward()
    opt_d.step()
    opt_g.zero_grad()
    d_fake = gan.discriminator(fake)
    bce(d_fake, torch.ones_like(d_fake)).backward()
    opt_g.step()
print("steady reserved", torch.cuda.max_memory_reserved(), flush=True)
assert stepwatch.flush(60)
"""


@pytest.fixture
def roomy_gpu_agent(tmp_path):
    with fake_gpu_agent(tmp_path, 80 << 30) as a:
        yield a


def test_a_gan_with_two_optimizers_gets_a_prediction_from_the_real_agent(roomy_gpu_agent):
    """watch(gan, [opt_d, opt_g]) on a fake GPU: the agent predicts step 2 from
    step 1's trace, and the prediction is the steady reserved peak (plus the
    CUDA context). Before, the client sent no forward and split the steps, and
    the rank's report had no prediction."""
    job = f"pytest-gan-{uuid.uuid4().hex[:8]}"
    proc = run(roomy_gpu_agent, GAN, job=job)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steady = int(proc.stdout.split("steady reserved ")[1].split()[0])
    deadline = time.monotonic() + 30
    while True:
        report = roomy_gpu_agent.rank_report(job)
        if report.get("steps_completed", 0) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    pred = report.get("prediction_before_step2")
    assert pred, report
    assert pred["inputs"]["basis"] == "allocator_replay", pred
    context = 512 * MIB  # fake CUDA's default context
    assert pred["predicted_peak_bytes"] >= steady + context, (pred, steady)
    assert pred["predicted_peak_bytes"] <= (steady + context) * 1.03, (pred, steady)


# On a 1g.10gb slice (9,984 MiB of its own) this job's step 1 reserves about
# 7.7 GiB and its step 2 does not fit (SGD's momentum is made in step 1's
# optimizer step); the whole 80 GB GPU holds it many times over.
SLICED = [JOB, "--width", "8192", "--no-bias", "--sgd-momentum", "--batch", "12288"]
SLICED += ["--hold", "60", "--fail-fast"]
SLICE_UUID = "MIG-00000000-0000-0000-0000-000000000009"


@pytest.fixture
def mig_gpu_agent(tmp_path):
    with fake_gpu_agent(tmp_path, 81559 * MIB, mig_slices=7) as a:
        yield a


def test_a_job_on_a_mig_slice_is_stopped_before_step_2_by_the_slices_prediction(mig_gpu_agent):
    """Real PyTorch on fake CUDA placed on a 1g.10gb slice: PyTorch names the
    device without a prefix, the client sends GPU-<slice>, the agent matches it
    to the slice and predicts against the slice's 9,984 MiB, and the job stops
    before step 2 instead of dying in it."""
    job = f"pytest-mig-{uuid.uuid4().hex[:8]}"
    proc = mig_gpu_agent.run(SLICED, job, device=SLICE_UUID)
    out = proc.stdout + proc.stderr
    assert "step 1 done" in proc.stdout and "step 2 done" not in proc.stdout, out
    assert proc.returncode == 3, out
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PREDICTED_OOM"))
    figures = dict(f.split("=", 1) for f in line.split()[1:4])
    assert int(figures["capacity"]) == 9984 * MIB, line
    assert int(figures["peak"]) > int(figures["capacity"]), line
    report = mig_gpu_agent.rank_report(job)
    assert report["info"]["gpu_uuid"] == SLICE_UUID, report["info"]
