"""The client's CUDA paths for real: unmodified PyTorch on fake GPUs (crates/fake-cuda).

Each test trains in a subprocess under ``fake-cuda run`` against the in-process
fake agent and checks what reached it: identity from the device, allocator
figures on every marker, step 1's allocator trace, the OOM marker.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def on_fake_gpu(agent, args: list[str], steps: int, job: str) -> subprocess.CompletedProcess:
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


def printed_by(agent, job: str, script: str, tag: str, *args: str) -> Any:
    """Runs ``script`` (``python -c``) under fake-cuda against the agent as job
    ``job``; the JSON it printed after ``tag``."""
    env = dict(os.environ, STEPWATCH_ENDPOINT=agent.endpoint, STEPWATCH_JOB_ID=job)
    proc = subprocess.run(
        [sys.executable, str(FAKE_CUDA), "run", "--quiet", "--python", sys.executable]
        + ["--", sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.split(f"{tag} ")[1])


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
    # Step 1's peaks are since process start: they never fall. From step 2 on
    # the client resets them at each step's begin (exact_step_peaks): they
    # start at the step's allocated bytes and never fall within the step.
    peaks = [m.allocator.allocated_peak_bytes for m in markers if m.step == 1]
    assert peaks == sorted(peaks)
    for step in (2, 3):
        begin = by[("STEP_BEGIN", step)]
        assert begin.allocated_peak_bytes == begin.allocated_bytes
        assert begin.reserved_peak_bytes == begin.reserved_bytes
        peaks = [m.allocator.allocated_peak_bytes for m in markers if m.step == step]
        assert peaks == sorted(peaks)
    # Step 2 stands higher than step 1 in reserved memory: the first-step anomaly.
    assert by[("STEP_END", 2)].reserved_bytes > by[("STEP_END", 1)].reserved_bytes

    # The device's memory (cudaMemGetInfo) at step 1's six markers only: on fake
    # CUDA's default 80 GiB GPU, total is NVML's less the 512 MiB driver reserve,
    # and total - free is this process's context + what its allocator reserved.
    for m in markers:
        assert m.HasField("device_memory") == (m.step == 1), m
    for m in markers[:6]:
        d = m.device_memory
        assert d.total_bytes == (80 << 30) - 512 * MIB
        assert d.total_bytes - d.free_bytes == 512 * MIB + m.allocator.reserved_bytes, m

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


# Steps of varying batches, reading the peaks as a script does at each step's
# end. "truth" resets them itself before each step's forward (no stepwatch);
# the others do not, except a reset of the script's own before step 5's forward
# and one inside step 7 ("none": no stepwatch).
USER_PEAKS = r"""
import json, sys, torch
mode = sys.argv[1]
width = 512
with torch.device("cuda"):
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )
opt = torch.optim.AdamW(model.parameters())
if mode in ("watch", "optout"):
    import stepwatch
    stepwatch.watch(model, opt, exact_step_peaks=mode == "watch")
seen = []
for step, batch in enumerate([256, 2048, 512, 4096, 1024, 256, 3072, 128], 1):
    x = torch.randn(batch, width, device="cuda")
    if mode == "truth" or step == 5:
        torch.cuda.reset_peak_memory_stats()
    y = model(x)
    if step == 7 and mode != "truth":
        torch.cuda.reset_max_memory_allocated()
    y.square().mean().backward()
    opt.step()
    opt.zero_grad()
    s = torch.cuda.memory_stats()
    nested = torch.cuda.memory_stats_as_nested_dict()
    seen.append([
        torch.cuda.max_memory_allocated(),
        torch.cuda.max_memory_reserved(),
        s["active_bytes.all.peak"],
        nested["allocated_bytes"]["large_pool"]["peak"],
        torch.accelerator.max_memory_allocated(),
    ])
    del x, y
print("seen", json.dumps(seen), flush=True)
"""


def test_exact_step_peaks_from_step_2_and_the_scripts_peaks_as_without_stepwatch(agent):
    """From step 2 on each step's last marker carries its exact allocator peak
    (the script's own per-step readings say what it was), and what the script
    reads of the peaks (torch.cuda, torch.accelerator; with its own resets) is
    what it reads without stepwatch; with exact_step_peaks=False too."""
    truth = printed_by(agent, "peaks-truth", USER_PEAKS, "seen", "truth")
    without = printed_by(agent, "peaks-none", USER_PEAKS, "seen", "none")
    assert printed_by(agent, "peaks-watch", USER_PEAKS, "seen", "watch") == without
    markers = agent.wait_markers(8 * 6)
    ends = {m.step: m.allocator for m in markers if m.kind == pb.STEP_END}
    for step in range(2, 9):
        # The script's reset inside step 7 does not cut the step's figure short.
        assert ends[step].allocated_peak_bytes == truth[step - 1][0], step
        assert ends[step].reserved_peak_bytes == truth[step - 1][1], step
    # Without resets step 3 (512 samples) never shows its own peak under step
    # 2's (2048); the test proves less if it did.
    assert without[2][0] == without[1][0] > truth[2][0]
    # exact_step_peaks=False: torch untouched, the counters never reset by the
    # client (step 3 begins under step 2's peak).
    assert printed_by(agent, "peaks-optout", USER_PEAKS, "seen", "optout") == without
    agent.wait_markers(2 * 8 * 6)
    (optout,) = [s for s in agent.streams if s.hello.identity.job_id == "peaks-optout"]
    begin3 = next(m.allocator for m in optout.markers if (m.kind, m.step) == (pb.STEP_BEGIN, 3))
    assert begin3.allocated_peak_bytes > begin3.allocated_bytes


# The Hugging Face Trainer's own memory metrics (skip_memory_metrics=False:
# it resets the peaks at train begin and reads max_memory_allocated() at its
# end), on one sequence a step whose longest comes in step 2.
HF_MEMORY = r"""
import json, sys, torch
from transformers import Trainer, TrainingArguments
mode, out = sys.argv[1:3]
lengths = [64, 2048, 128, 256, 64, 128]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 512)

    def forward(self, x, labels=None):
        y = self.b(torch.relu(self.a(x)))
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return len(lengths)

    def __getitem__(self, i):
        x = torch.randn(lengths[i], 512, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x}


class InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


callbacks = []
if mode == "watch":
    from stepwatch.transformers import StepwatchCallback

    callbacks = [StepwatchCallback()]
args = TrainingArguments(
    output_dir=out, max_steps=len(lengths), per_device_train_batch_size=1, report_to=[],
    save_strategy="no", logging_strategy="no", disable_tqdm=True,
    dataloader_num_workers=0, skip_memory_metrics=False,
)
trainer = InOrder(model=Model(), args=args, train_dataset=Data(), callbacks=callbacks)
metrics = trainer.train().metrics
print("metrics", json.dumps({k: v for k, v in metrics.items() if "gpu" in k}), flush=True)
"""


def test_the_hf_trainers_memory_metrics_are_as_without_stepwatch(agent, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    without = printed_by(agent, "hf-none", HF_MEMORY, "metrics", "none", str(tmp_path / "none"))
    assert without["train_mem_gpu_peaked_delta"] > 0, without
    watched = printed_by(agent, "hf-watch", HF_MEMORY, "metrics", "watch", str(tmp_path / "watch"))
    assert watched == without
    # The client did reset the counters (step 3 begins under step 2's peak).
    markers = agent.wait_markers(6 * 6)
    begin3 = next(m.allocator for m in markers if (m.kind, m.step) == (pb.STEP_BEGIN, 3))
    assert begin3.allocated_peak_bytes == begin3.allocated_bytes


# Lightning's DeviceStatsMonitor logs torch.cuda.memory_stats() at each
# batch's start and end; stepwatch's callback (listed first, so its resets
# come before the monitor's reads) must leave every figure as it was.
LIGHTNING_STATS = r"""
import json, sys, torch
import lightning as L
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers.logger import Logger
mode = sys.argv[1]
sizes = [8, 256, 16, 64, 8, 32]


class Recorder(Logger):
    rows = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return "0"

    def log_metrics(self, metrics, step=None):
        self.rows.append({k: v for k, v in metrics.items() if "bytes" in k})

    def log_hyperparams(self, *args, **kwargs):
        pass


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 512)

    def training_step(self, x, i):
        return self.b(torch.relu(self.a(x))).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


batches = [torch.randn(n, 512, generator=torch.Generator().manual_seed(n)) for n in sizes]
callbacks = [DeviceStatsMonitor(cpu_stats=False)]
if mode == "watch":
    from stepwatch.lightning import StepwatchCallback

    callbacks.insert(0, StepwatchCallback())
trainer = L.Trainer(
    accelerator="gpu", devices=1, max_steps=len(sizes), callbacks=callbacks,
    logger=Recorder(), log_every_n_steps=1, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Model(), torch.utils.data.DataLoader(batches, batch_size=None))
print("rows", json.dumps(Recorder.rows), flush=True)
"""


def test_lightnings_device_stats_monitor_logs_as_without_stepwatch(agent):
    pytest.importorskip("lightning")
    without = printed_by(agent, "pl-none", LIGHTNING_STATS, "rows", "none")
    peaks = [v for row in without for k, v in row.items() if k.endswith("allocated_bytes.all.peak")]
    # One row per hook and step, and peaks that change over the run.
    assert len(without) == 2 * 6 and len(set(peaks)) > 1, without
    assert printed_by(agent, "pl-watch", LIGHTNING_STATS, "rows", "watch") == without
    # The client did reset the counters (step 3 begins under step 2's peak).
    markers = agent.wait_markers(6 * 6)
    begin3 = next(m.allocator for m in markers if (m.kind, m.step) == (pb.STEP_BEGIN, 3))
    assert begin3.allocated_peak_bytes == begin3.allocated_bytes


def test_without_the_trace_the_markers_still_carry_allocator_figures(agent, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ALLOCATOR_TRACE", "0")
    proc = on_fake_gpu(agent, [], 2, "fake-gpu-no-trace")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    markers = agent.wait_markers(12)
    assert all(m.allocator.reserved_bytes > 0 for m in markers)
    assert agent.streams[0].traces == []
    # Instead, real torch.cuda.memory_snapshot() layouts on step 1's optimizer
    # markers only: large-pool segments, within what the allocator reserved.
    with_layout = [m for m in markers if len(m.layout_segments)]
    assert [(KIND[m.kind], m.step) for m in with_layout] == [
        ("OPTIMIZER_BEGIN", 1),
        ("OPTIMIZER_END", 1),
    ]
    for m in with_layout:
        assert not any(s.small_pool for s in m.layout_segments)
        large = sum(b.size for s in m.layout_segments for b in s.blocks)
        assert 0 < large <= m.allocator.reserved_bytes
        live = sum(b.size for s in m.layout_segments for b in s.blocks if b.allocated)
        assert live <= m.allocator.allocated_bytes


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
    # The OOM marker carries the device's memory too (step 2's others do not).
    d = oom.device_memory
    assert d.total_bytes == capacity - 512 * MIB
    assert d.total_bytes - d.free_bytes == 512 * MIB + oom.allocator.reserved_bytes
    step2 = [m for m in agent.streams[-1].markers if m.step == 2 and m.kind != pb.OOM]
    assert step2 and not any(m.HasField("device_memory") for m in step2)
    # Right after the OOM marker: what the allocator knew at the error.
    stream = agent.streams[-1]
    assert agent.wait_for(lambda: stream.oom_reports)
    (report,) = stream.oom_reports
    assert stream.order[-1] == ("oom_report", 2)
    assert stream.order[-2] == ("marker", pb.OOM, 2)
    # The request PyTorch could not serve, from its message, to its two decimals.
    m = re.search(r"Tried to allocate ([0-9.]+) MiB", proc.stderr)
    assert m and report.requested_bytes == int(float(m.group(1)) * MIB)
    assert report.message.startswith("CUDA out of memory. Tried to allocate")
    assert report.allocator.reserved_bytes > 0
    assert report.device_memory.total_bytes == d.total_bytes
    assert 0 < len(report.largest_segments) <= 8 and report.segment_count >= 1
    sizes = [s.size_bytes for s in report.largest_segments]
    assert sizes == sorted(sizes, reverse=True)
    assert report.largest_free_block_bytes == max(
        s.largest_free_block_bytes for s in report.largest_segments
    ) or report.segment_count > len(report.largest_segments)


# DDP over two ranks (NCCL on fake GPUs): 8 layers of 1024 x 1024, one 32 MiB
# bucket at construction. Each rank records PyTorch's own allocator history
# over step 2's forward (as bench/torch-jobs/probe_ddp_step2.py does) and
# writes what was freed and allocated there, and DDP's own rebuilt sizes.
DDP_TRAIN = r"""
import json, os, sys, torch, torch.distributed as dist, stepwatch
from torch.nn.parallel import DistributedDataParallel as DDP
find_unused = sys.argv[1] == "1"
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
with torch.device("cuda"):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
model = DDP(model, device_ids=[local], find_unused_parameters=find_unused)
opt = torch.optim.AdamW(model.parameters())
stepwatch.watch(model, opt)
for step in (1, 2, 3):
    x = torch.randn(64, 1024, device="cuda")
    if step == 2:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
    out = model(x)
    if step == 2:
        trace = torch.cuda.memory._snapshot()["device_traces"][local]
        torch.cuda.memory._record_memory_history(enabled=None)
    out.square().mean().backward()
    opt.step()
    opt.zero_grad()
data = model._get_ddp_logging_data()
seen = [(e["action"], e["size"]) for e in trace if e["action"] in ("alloc", "free_completed")]
with open(os.path.join(sys.argv[2], f"result-{dist.get_rank()}.json"), "w") as f:
    json.dump({"seen": seen, "rebuilt": data.get("rebuilt_bucket_sizes", "")}, f)
stepwatch.flush(60)
dist.destroy_process_group()
"""


def ddp_on_fake_gpu(agent, tmp_path: Path, find_unused: bool) -> dict[int, Any]:
    """Runs DDP_TRAIN on two fake GPUs; returns each rank's RESULT."""
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_TRAIN)
    env = dict(os.environ, STEPWATCH_ENDPOINT=agent.endpoint, STEPWATCH_JOB_ID="fake-gpu-ddp")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [sys.executable, str(FAKE_CUDA), "run", "--quiet", "--python", sys.executable]
        + ["--gpus", "2", "--"]
        + torchrun
        + ["--nproc-per-node=2", str(script), "1" if find_unused else "0", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = [tmp_path / f"result-{rank}.json" for rank in (0, 1)]
    # Known fake-CUDA flake (crates/fake-cuda/tests): a rank that finished may
    # abort at exit with "terminate called without an active exception".
    at_exit = "terminate called without an active exception" in proc.stderr
    ok = proc.returncode == 0 or (at_exit and all(r.exists() for r in results))
    assert ok, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {rank: json.loads(r.read_text()) for rank, r in enumerate(results)}


def round512(n: int) -> int:
    return max(512, (n + 511) // 512 * 512)


def rebuilds(agent) -> dict[int, Any]:
    """Each rank's DdpBucketRebuild, once both streams have sent step 1's trace."""
    assert agent.wait_for(
        lambda: (
            len(agent.streams) == 2 and all(any(t.last for t in s.traces) for s in agent.streams)
        )
    )
    out = {}
    for s in agent.streams:
        updates = [u for u in s.model_updates if u.HasField("ddp_bucket_rebuild")]
        if updates:
            (u,) = updates
            out[s.hello.identity.rank] = (s, u.ddp_bucket_rebuild)
    return out


def test_ddp_sends_the_buckets_it_will_rebuild_at_step_2s_first_forward(agent, tmp_path):
    results = ddp_on_fake_gpu(agent, tmp_path, False)
    sent = rebuilds(agent)
    assert sorted(sent) == [0, 1]
    layer = (1024 * 1024 + 1024) * 4
    for rank, (stream, rebuild) in sent.items():
        seen = [tuple(e) for e in results[rank]["seen"]]
        # The one bucket DDP made at construction.
        assert list(rebuild.old_bucket_bytes) == [8 * layer]
        # What PyTorch did at step 2's first forward: freed that bucket, then
        # allocated the new ones, in this order, before anything else.
        at = seen.index(("free_completed", round512(8 * layer)))
        new = list(rebuild.new_bucket_bytes)
        assert seen[at + 1 : at + 1 + len(new)] == [("alloc", round512(n)) for n in new], seen
        # Gradients are ready last layer first: its ~4 MiB closes the 1 MiB
        # first bucket, the other seven fill the 25 MiB one past its cap.
        assert new == [layer, 7 * layer]
        # DDP's own account of its rebuilt buckets says the same.
        assert [int(b) for b in results[rank]["rebuilt"].split(",")] == new
        # Sent once step 1's backward is done, before its optimizer phase and trace.
        at = stream.order.index(("model_update",))
        assert stream.order[at - 1] == ("marker", pb.BACKWARD_BEGIN, 1)
        assert stream.order[at + 1] == ("marker", pb.OPTIMIZER_BEGIN, 1)
        assert stream.order.index(("trace", True)) > at


def test_ddp_that_finds_unused_parameters_never_rebuilds_and_sends_nothing(agent, tmp_path):
    ddp_on_fake_gpu(agent, tmp_path, True)
    assert rebuilds(agent) == {}
