"""The client's CUDA paths for real: unmodified PyTorch on fake GPUs (crates/fake-cuda).

Each test trains in a subprocess under ``fake-cuda run`` against the in-process
fake agent and checks what reached it: identity from the device, allocator
figures on every marker, step 1's allocator trace, the OOM marker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List

import pytest
from conftest import KIND, REPO, STEP, summary

from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

pytest.importorskip("torch")

FAKE_CUDA = REPO / "crates" / "fake-cuda" / "fake-cuda"
MIB = 1 << 20

TRAIN = r"""
import sys, torch, stepwatch
width, layers, batch, steps = (int(a) for a in sys.argv[1:5])
with torch.device("cuda"):
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters())
stepwatch.watch(model, opt)
for step in range(1, steps + 1):
    model(torch.randn(batch, width, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} done", flush=True)
print("params", sum(p.numel() for p in model.parameters()), flush=True)
"""
SIZES = ["1024", "8", "4096"]


def on_fake_gpu(agent, args: List[str], steps: int, job: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, STEPWATCH_ENDPOINT=agent.endpoint, STEPWATCH_JOB_ID=job)
    if not FAKE_CUDA.exists():
        pytest.fail(f"{FAKE_CUDA} is missing")
    return subprocess.run(
        [sys.executable, str(FAKE_CUDA), "run", "--quiet", "--python", sys.executable, *args]
        + ["--", sys.executable, "-c", TRAIN, *SIZES, str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_watch_on_cuda_sends_device_identity_allocator_figures_and_the_step1_trace(agent):
    proc = on_fake_gpu(agent, [], 3, "fake-gpu-client")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    markers = agent.wait_markers(18)
    assert summary(markers) == [(k, s, 0) for s in (1, 2, 3) for k in STEP]
    (stream,) = agent.streams
    # Identity: the fake-nvml GPU's UUID, read from get_device_properties().uuid.
    assert stream.hello.gpu_uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert stream.hello.identity.job_id == "fake-gpu-client"
    assert stream.hello.model.optimizer == pb.OPTIMIZER_KIND_ADAM
    # AdamW() on CUDA parameters runs foreach, PyTorch's default there.
    assert stream.hello.model.optimizer_implementation == pb.OPTIMIZER_IMPLEMENTATION_FOREACH
    params = int(proc.stdout.split("params ")[1])
    assert stream.hello.model.parameter_count == params

    # Every marker carries the caching allocator's figures.
    for m in markers:
        a = m.allocator
        assert a.allocated_bytes > 0 and a.reserved_bytes >= a.allocated_bytes, m
        assert a.allocated_peak_bytes >= a.allocated_bytes
        assert a.reserved_peak_bytes >= a.reserved_bytes
    by = {(KIND[m.kind], m.step): m.allocator for m in markers}
    # AdamW's state is made in step 1's optimizer step: 8 bytes per parameter
    # (every weight and bias here is a multiple of the allocator's 512-byte
    # rounding, so nothing is added), and never again.
    jump1 = by[("OPTIMIZER_END", 1)].allocated_bytes - by[("OPTIMIZER_BEGIN", 1)].allocated_bytes
    assert jump1 == 8 * params
    jump2 = by[("OPTIMIZER_END", 2)].allocated_bytes - by[("OPTIMIZER_BEGIN", 2)].allocated_bytes
    assert jump2 == 0
    # Peaks are since process start (the client never resets them): they never fall.
    peaks = [m.allocator.allocated_peak_bytes for m in markers]
    assert peaks == sorted(peaks)
    # Step 2 stands higher than step 1 in reserved memory: the first-step anomaly.
    assert by[("STEP_END", 2)].reserved_bytes > by[("STEP_END", 1)].reserved_bytes

    # Step 1's allocator trace: sent once, after step 1's optimizer phase, before step 2.
    assert agent.wait_for(lambda: any(t.last for t in stream.traces))
    first_trace = stream.order.index(("trace", False if len(stream.traces) > 1 else True))
    before = [o for o in stream.order[:first_trace] if o[0] == "marker"]
    assert before[-1][2] == 1 and KIND[before[-1][1]] in ("OPTIMIZER_END", "STEP_END")
    assert all(o[2] == 1 for o in before)
    assert sum(1 for t in stream.traces if t.last) == 1
    assert all(t.step == 1 for t in stream.traces)
    segments = [s for t in stream.traces for s in t.segments]
    events = [e for t in stream.traces for e in t.events]
    assert segments and events
    # The layout is what the allocator reserved at that moment.
    layout_bytes = sum(b.size for s in segments for b in s.blocks)
    assert layout_bytes == by[("OPTIMIZER_END", 1)].reserved_bytes


def test_without_the_trace_the_markers_still_carry_allocator_figures(agent, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ALLOCATOR_TRACE", "0")
    proc = on_fake_gpu(agent, [], 2, "fake-gpu-no-trace")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    markers = agent.wait_markers(12)
    assert all(m.allocator.reserved_bytes > 0 for m in markers)
    assert agent.streams[0].traces == []


def test_an_out_of_memory_in_step_2_is_reported_as_an_oom_marker(agent, tmp_path):
    # Calibrate: what step 1 reserves on this torch, from the markers.
    proc = on_fake_gpu(agent, [], 2, "fake-gpu-calibrate")
    assert proc.returncode == 0, proc.stderr
    markers = agent.wait_markers(12)
    by = {(KIND[m.kind], m.step): m.allocator for m in markers}
    step1 = by[("STEP_END", 1)].reserved_peak_bytes
    step2 = by[("STEP_END", 2)].reserved_peak_bytes
    assert step2 > step1 + 8 * MIB
    # A GPU with room for step 1 (context, driver reserve, 8 MiB spare), not step 2.
    capacity = 512 * MIB + 512 * MIB + step1 + 8 * MIB
    proc = on_fake_gpu(agent, ["--gpu-capacity", str(capacity)], 3, "fake-gpu-oom")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "torch.OutOfMemoryError" in proc.stderr
    assert "step 1 done" in proc.stdout and "step 2 done" not in proc.stdout
    assert agent.wait_for(lambda: any(m.kind == pb.OOM for m in agent.streams[-1].markers))
    (oom,) = [m for m in agent.streams[-1].markers if m.kind == pb.OOM]
    assert oom.step == 2
    assert oom.allocator.reserved_bytes > 0
