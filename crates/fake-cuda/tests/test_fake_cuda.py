"""fake-cuda with the installed PyTorch: what a training job relies on.

Each test runs real PyTorch in a subprocess under `fake-cuda run` (the preload
cannot be added to this process, whose torch is already loaded). Run with the
test venv: `python -m pytest crates/fake-cuda/tests` (scripts/test does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

HERE = Path(__file__).resolve().parent
FAKE_CUDA = HERE.parent / "fake-cuda"
REPO = HERE.parents[2]
MIB = 1 << 20
CONTEXT = 512 * MIB
DRIVER_RESERVED = 512 * MIB  # fake-nvml's default driver-reserved memory

pytest.importorskip("torch")

# A job whose step 2 needs more than step 1: AdamW's state (8 B/param) is made in
# step 1's optimizer step, and step 2's activations come on top of it.
TRAIN = r"""
import json, os, sys, torch
width, layers, batch, steps = (int(a) for a in sys.argv[1:5])
with torch.device("cuda"):
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters(), foreach=True)
out = {"params": sum(p.numel() for p in model.parameters()), "steps": []}
for step in range(1, steps + 1):
    model(torch.randn(batch, width, device="cuda")).square().mean().backward()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    opt.step()
    after = torch.cuda.memory_stats()["requested_bytes.all.current"]
    opt.zero_grad()
    out["steps"].append({"optimizer_jump": after - before,
                         "max_reserved": torch.cuda.max_memory_reserved()})
    print(f"step {step} done", flush=True)
props = torch.cuda.get_device_properties(0)
out.update(uuid=str(props.uuid), total=props.total_memory, name=props.name,
           mem_get_info=list(torch.cuda.mem_get_info()), reserved=torch.cuda.memory_reserved(),
           retries=torch.cuda.memory_stats()["num_alloc_retries"], pid=os.getpid())
print("RESULT " + json.dumps(out), flush=True)
"""
SIZES = ["1024", "8", "4096"]


KNOWN_EXIT_ABORT = "terminate called without an active exception"


def retry_known_exit_abort(
    run: Callable[[Path], subprocess.CompletedProcess], tmp_path: Path, ok: int
) -> tuple[subprocess.CompletedProcess, Path]:
    """Known flake, not yet understood: after a script on fake CUDA has done
    its work (results printed, or the expected OOM raised), PyTorch may abort
    at interpreter exit with "terminate called without an active exception"
    (exit 134): about one DDP run in six, and once the single-process OOM
    test under load 10. Reruns once, in a fresh folder, on exactly that;
    any other exit code, or the abort twice, is the test's to judge."""
    proc = run(tmp_path)
    if proc.returncode != ok and KNOWN_EXIT_ABORT in proc.stderr:
        tmp_path = tmp_path / "retry"
        tmp_path.mkdir()
        proc = run(tmp_path)
    return proc, tmp_path


def fake_cuda(args: list[str], cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(FAKE_CUDA),
            "run",
            "--quiet",
            "--python",
            sys.executable,
            *args,
            "--",
            *cmd,
        ],
        capture_output=True,
        text=True,
        timeout=kw.pop("timeout", 300),
        **kw,
    )


def result(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULT ") :])


def usage(log_dir: Path) -> dict[int, list[tuple]]:
    """pid -> [(ns, device, uuid, bytes)] from --usage-log."""
    out: dict[int, list[tuple]] = {}
    for f in log_dir.glob("*.tsv"):
        rows = [ln.split("\t") for ln in f.read_text().splitlines()]
        out[int(f.stem)] = [(int(t), int(d), u, int(b)) for t, d, u, b in rows]
    return out


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> dict[str, Any]:
    """Three steps at 80 GiB: what the job needs, as PyTorch and NVML see it."""
    log = tmp_path_factory.mktemp("usage")
    proc = fake_cuda(["--usage-log", str(log)], [sys.executable, "-c", TRAIN, *SIZES, "3"])
    assert proc.returncode == 0, proc.stderr
    return {"result": result(proc), "usage": usage(log), "stderr": proc.stderr}


def test_training_runs_with_pytorchs_allocator_and_nvml_sees_what_it_reserved(calibration):
    r = calibration["result"]
    steps = r["steps"]
    # AdamW's state appears in step 1's optimizer step: exactly 8 bytes per parameter.
    assert steps[0]["optimizer_jump"] == 8 * r["params"]
    assert [s["optimizer_jump"] for s in steps[1:]] == [0, 0]
    # Step 2 needs more than step 1: the anomaly stepwatch predicts.
    assert steps[1]["max_reserved"] > steps[0]["max_reserved"]
    # The device is fake-nvml's GPU 0, and its memory figures agree.
    assert r["uuid"] == "00000000-0000-0000-0000-000000000000"
    # CUDA's total is what processes can use: NVML's total less the driver's reserve.
    assert r["total"] == (80 << 30) - DRIVER_RESERVED
    assert r["name"] == "NVIDIA H100 80GB HBM3"
    # What NVML shows for the process, at its last change: context + reserved.
    (rows,) = calibration["usage"].values()
    assert rows[0][3] == CONTEXT, "the context comes first"
    assert {row[2] for row in rows} == {"GPU-00000000-0000-0000-0000-000000000000"}
    assert rows[-1][3] == CONTEXT + r["reserved"]
    free, total = r["mem_get_info"]
    assert total == (80 << 30) - DRIVER_RESERVED
    assert free == total - CONTEXT - r["reserved"]
    assert [t for t, *_ in rows] == sorted(t for t, *_ in rows)


def test_step_two_runs_out_of_memory_as_on_a_gpu(calibration, tmp_path):
    steps = calibration["result"]["steps"]
    # Room for step 1 and a little more, not for step 2.
    usable = CONTEXT + steps[0]["max_reserved"] + 8 * MIB
    assert usable < CONTEXT + steps[1]["max_reserved"]

    def run(log: Path) -> subprocess.CompletedProcess:
        return fake_cuda(
            ["--gpu-capacity", str(usable + DRIVER_RESERVED), "--usage-log", str(log)],
            [sys.executable, "-c", TRAIN, *SIZES, "3"],
        )

    proc, tmp_path = retry_known_exit_abort(run, tmp_path, ok=1)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step 1 done" in proc.stdout and "step 2 done" not in proc.stdout
    assert "torch.OutOfMemoryError: CUDA out of memory." in proc.stderr
    # PyTorch's own message, with NVML's view of this process.
    assert "this process has" in proc.stderr and "memory in use" in proc.stderr
    (rows,) = usage(tmp_path).values()
    assert max(b for *_, b in rows) <= usable


def test_expandable_segments_are_charged_like_cudamalloc(tmp_path):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    proc = fake_cuda(
        ["--usage-log", str(tmp_path)], [sys.executable, "-c", TRAIN, *SIZES, "2"], env=env
    )
    assert proc.returncode == 0, proc.stderr
    r = result(proc)
    (rows,) = usage(tmp_path).values()
    assert rows[-1][3] == CONTEXT + r["reserved"]
    # Physical memory is mapped in 2 MiB pages (cuMemCreate), each charged.
    assert len(rows) > 3
    assert all(b % (2 * MIB) == 0 for *_, b in rows)


PLACEMENT = r"""
import json, torch
MIB = 1 << 20
def seg(n):
    return torch.empty(n * MIB, dtype=torch.uint8, device="cuda")
a, b, c = seg(12), seg(12), seg(30)
pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()
del b
torch.cuda.empty_cache()  # b's segment goes back: a 12 MiB hole below a
d, e = seg(10), seg(40)
print("RESULT " + json.dumps({
    "b": (pa - pb) // MIB, "c": (pb - pc) // MIB,
    "d": (pa - d.data_ptr()) // MIB, "e": (pc - e.data_ptr()) // MIB,
}))
"""


def test_new_segments_land_below_or_at_the_top_of_the_highest_hole():
    """Each cudaMalloc lands just below the lowest range so far, or at the top of the
    highest hole a cudaFree left that fits (README: where allocations land)."""
    proc = fake_cuda([], [sys.executable, "-c", PLACEMENT])
    assert proc.returncode == 0, proc.stderr
    # b just below a, c just below b; d (10 MiB) in b's 12 MiB hole, at its top;
    # e (40 MiB) fits no hole: just below c
    assert result(proc) == {"b": 12, "c": 30, "d": 10, "e": 40}


TIE = r"""
import json, torch
MIB = 1 << 20
def seg(n):
    return torch.empty(n * MIB, dtype=torch.uint8, device="cuda")
def trial(free_order):
    t = [seg(394) for _ in range(3)]  # three segments, each below the one before
    ptr = [x.data_ptr() for x in t]
    t[0] = None
    torch.cuda.empty_cache()  # t0's segment goes back; a new one takes its place
    t[0] = seg(394)
    top = t[0].data_ptr()
    for i in free_order:
        t[i] = None
    x = seg(12)
    out = {"oldest": x.data_ptr() == ptr[1], "highest": x.data_ptr() == top,
           "lowest": x.data_ptr() == ptr[2]}
    del x
    torch.cuda.empty_cache()
    return out
print("RESULT " + json.dumps([trial([0, 2, 1]), trial([1, 2, 0])]))
"""


def test_best_fit_among_equal_free_blocks_takes_the_oldest_segments():
    """PyTorch 2.15 orders free blocks by size, then the age of their segment
    (`BlockComparatorSizeCounterAddress`), then address: of three free 394 MiB
    segments a 12 MiB request takes the oldest, not the lowest or the highest, in
    whatever order they were freed. The
    allocator model follows it (stepwatch-core `allocator.rs`)."""
    proc = fake_cuda([], [sys.executable, "-c", TIE])
    assert proc.returncode == 0, proc.stderr
    # Freed youngest first, then oldest first: the same block serves.
    assert result(proc) == [{"oldest": True, "highest": False, "lowest": False}] * 2


def test_a_process_that_exits_leaves_no_memory_on_the_gpu(tmp_path):
    state = tmp_path / "state"
    binary = os.environ.get("STEPWATCH_BIN") or str(REPO / "target/debug/stepwatch")
    subprocess.run([binary, "fake-gpu", "--dir", str(state), "init", "--gpus", "1"], check=True)
    proc = fake_cuda(["--state-dir", str(state)], [sys.executable, "-c", TRAIN, *SIZES, "1"])
    assert proc.returncode == 0, proc.stderr
    show = subprocess.run(
        [binary, "fake-gpu", "--dir", str(state), "show"], capture_output=True, text=True
    )
    assert "used 0 /" in show.stdout and "processes []" in show.stdout, show.stdout


# Two processes on one GPU: the parent reads cudaMemGetInfo while a child holds memory.
SHARED = r"""
import json, subprocess, sys, torch
child = subprocess.Popen(
    [sys.executable, "-c", "import sys, torch; x = torch.empty(100 << 20, dtype=torch.uint8, "
     "device='cuda'); print('held', flush=True); sys.stdin.read()"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "held"
x = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
free, total = torch.cuda.mem_get_info()
out = dict(free=free, total=total, reserved=torch.cuda.memory_reserved())
child.communicate("")
free_after, _ = torch.cuda.mem_get_info()
out["free_after_child"] = free_after
print("RESULT " + json.dumps(out), flush=True)
"""


def test_mem_get_info_counts_every_process_on_the_gpu_within_the_usable_total():
    proc = fake_cuda(["--gpu-capacity", "8GiB"], [sys.executable, "-c", SHARED])
    assert proc.returncode == 0, proc.stderr
    r = result(proc)
    # Total: what processes can use (NVML's total less the driver's reserve).
    assert r["total"] == (8 << 30) - DRIVER_RESERVED
    # Used = both contexts + the child's 100 MiB (its cache holds exactly that
    # segment) + what this process's allocator reserved.
    assert r["reserved"] == 300 * MIB
    assert r["total"] - r["free"] == 2 * CONTEXT + 100 * MIB + 300 * MIB
    # Once the child exits, its context and memory are free again.
    assert r["total"] - r["free_after_child"] == CONTEXT + 300 * MIB


MIG = r"""
import json, os, torch
props = torch.cuda.get_device_properties(0)
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
out = {"count": torch.cuda.device_count(), "total": props.total_memory, "uuid": str(props.uuid),
       "name": props.name, "mem_get_info": list(torch.cuda.mem_get_info())}
try:
    torch.empty(12 << 30, dtype=torch.uint8, device="cuda")
    out["oom"] = False
except torch.OutOfMemoryError:
    out["oom"] = True
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_process_placed_on_a_mig_slice_sees_the_slices_memory(tmp_path):
    # One H100 in seven 1g.10gb slices (9,984 MiB each, none driver-reserved);
    # the process asks for slice 3 by its UUID, as the device plugin does.
    state = tmp_path / "gpus"
    binary = os.environ.get("STEPWATCH_BIN", str(REPO / "target" / "debug" / "stepwatch"))
    init = [binary, "fake-gpu", "--dir", str(state), "init", "--gpus", "1", "--mig-slices", "7"]
    subprocess.run(init, check=True, capture_output=True)
    slice_uuid = "MIG-00000000-0000-0000-0000-00000000000a"
    log = tmp_path / "usage"
    proc = fake_cuda(
        ["--state-dir", str(state), "--usage-log", str(log)],
        [sys.executable, "-c", MIG],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": slice_uuid},
    )
    assert proc.returncode == 0, proc.stderr
    r = result(proc)
    assert r["count"] == 1
    assert r["total"] == 9984 * MIB
    assert r["name"] == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    # PyTorch prints the UUID without its prefix.
    assert r["uuid"] == slice_uuid[len("MIG-") :]
    free, total = r["mem_get_info"]
    assert total == 9984 * MIB and total - free == CONTEXT + (1 << 30)
    # 12 GiB fits the 80 GB GPU, not the slice.
    assert r["oom"] is True
    # The slice's usage went to the slice in fake-nvml, under its UUID.
    rows = [row for rows in usage(log).values() for row in rows]
    assert rows and {u for _, _, u, _ in rows} == {slice_uuid}
    assert max(b for _, _, _, b in rows) == CONTEXT + (1 << 30)


# Two optimizer steps of ``model`` (four 512-wide layers) on random batches.
TWO_STEPS = """opt = torch.optim.AdamW(model.parameters())
for step in range(2):
    model(torch.randn(64, 512, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()"""

DDP = (
    r"""
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
# Small collectives exchange real data: ranks agree on a value only one of them has.
t = torch.tensor([dist.get_rank() + 1], device="cuda")
dist.all_reduce(t)
g = [torch.zeros(1, dtype=torch.long, device="cuda") for _ in range(dist.get_world_size())]
dist.all_gather(g, torch.tensor([10 * (dist.get_rank() + 1)], device="cuda"))
model = DDP(model, device_ids=[local])
"""
    + TWO_STEPS
    + r"""
print(f"RANK {dist.get_rank()} sum={t.item()} gathered={[int(x.item()) for x in g]}", flush=True)
dist.destroy_process_group()
"""
)

FSDP2 = (
    r"""
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
with torch.device("cuda"):
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
"""
    + TWO_STEPS
    + r"""
print(f"RANK {dist.get_rank()} done", flush=True)
dist.destroy_process_group()
"""
)


def torchrun(n: int, script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "job.py"
    path.write_text(script)
    return fake_cuda(
        ["--gpus", str(n), "--usage-log", str(tmp_path / "usage")],
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            str(path),
        ],
        timeout=600,
    )


def test_ddp_over_two_ranks_with_nccl(tmp_path):
    proc, tmp_path = retry_known_exit_abort(lambda p: torchrun(2, DDP, p), tmp_path, ok=0)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"RANK {rank} sum=3 gathered=[10, 20]" in proc.stdout
    # One GPU per rank, each charged by its own process only: no rank makes a
    # context on another rank's GPU (PyTorch asks the driver before it switches).
    devices = sorted(
        tuple(sorted({row[2] for row in rows})) for rows in usage(tmp_path / "usage").values()
    )
    assert devices == [(f"GPU-00000000-0000-0000-0000-00000000000{i}",) for i in (0, 1)]


def test_fsdp2_over_four_ranks(tmp_path):
    proc = torchrun(4, FSDP2, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(4):  # the ranks' lines may interleave
        assert f"RANK {rank} done" in proc.stdout


def test_bad_sizes_and_missing_command_are_clear_errors():
    proc = fake_cuda(["--gpu-capacity", "12XB"], ["true"])
    assert proc.returncode == 2
    assert "'12XB' is not a size" in proc.stderr
    proc = subprocess.run(
        [sys.executable, str(FAKE_CUDA), "run", "--python", sys.executable],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "nothing to run" in proc.stderr
    proc = fake_cuda([], ["/nonexistent/python"])
    assert proc.returncode == 2
    assert "cannot run '/nonexistent/python'" in proc.stderr


KERNELS = r"""
import time, torch
x = torch.ones(16, device="cuda")
torch.cuda.synchronize()
t0 = time.monotonic()
for _ in range(40):
    x = x * 2  # one kernel each
launched = time.monotonic() - t0
torch.cuda.synchronize()
print(f"RESULT {{\"launched\": {launched}, \"synced\": {time.monotonic() - t0}}}", flush=True)
"""


def test_kernel_time_makes_synchronisation_wait_for_the_queued_kernels():
    proc = fake_cuda(["--kernel-time", "5ms"], [sys.executable, "-c", KERNELS])
    assert proc.returncode == 0, proc.stderr
    r = result(proc)
    # 40 kernels of 5 ms each: launching returns at once (the queue is deep),
    # the synchronisation waits for all of them (a lower bound: sleeps only
    # get longer on a busy machine).
    assert r["synced"] >= 0.2
    assert r["launched"] < r["synced"]
