"""Prediction accuracy of the step-2 predictor on real PyTorch jobs, on fake GPUs.

Run through ``bench/torch-accuracy.sh`` (which finds the agent and the Python);
``--help`` lists the flags. Standard library only.

For each job of ``bench/torch-jobs/jobs.json`` it runs unmodified PyTorch on
fake CUDA (``crates/fake-cuda/fake-cuda run``) against a real agent on fake
NVML (``stepwatch agent --record``), at several GPU capacities around the
job's true steady-state peak, each twice: with step 1's allocator trace (the
client's default; variant ``trace``) and with markers only
(``STEPWATCH_ALLOCATOR_TRACE=0``; variant ``markers``).

1. A calibration run on roomy GPUs (``--calibration-gib``, 80 GiB) gives per
   rank the true steady peak P (the fake GPU's NVML figure over steps 2..k),
   step 1's peak S1, and from the agent's report the steady allocated and
   reserved peaks A and R (so the context and anything else outside the
   allocator is P - R). It is also the ``roomy`` case of the ``trace`` variant
   (the ``markers`` variant has no roomy run: ``fit-10%`` covers a headroom
   of 5% or more).
2. Capacities, as usable bytes (GPU total minus the 512 MiB fake-nvml keeps
   for the driver; every GPU of a run gets the same, planned on the rank with
   the highest P): ``fit-2%``, ``fit-5%``, ``fit-10%`` = P x 1.015, 1.04, 1.09
   (fit with under 2%, 5%, 10% to spare); ``step2-oom`` midway between S1 and
   A + P - R (step 1 fits, step 2's allocated memory does not);
   ``fragmentation`` midway between A + P - R and P (allocated memory fits,
   reserved does not). When A + P - R is not inside (S1, P), both go a third
   and two thirds of the way from S1 to P; when S1 is within 1% of P neither
   is run (step 2 cannot fail where step 1 fits). Skips are said. The label
   is the plan; the row's outcome is what happened. Runs go ``--parallel`` at
   a time (default 2), each with its own agent and fake GPUs. Kernels take
   ``--kernel-time`` each (default 50us, fake-cuda's queue model), so that
   step 1's phases last long enough for the agent's 100 Hz sampler to see
   them, as on a GPU; with 0 they take no time and a step lasts milliseconds.
3. Truth is what happened. The fake CUDA layer logs every change of each
   process's device usage with CLOCK_MONOTONIC times (``--usage-log``); the
   step markers in the agent's record carry the same clock. A run that fits:
   the peak of the GPU's NVML figure (the sum over the processes on it) from
   step 2's begin marker to the last step's end marker. A run that dies: the
   step of the client's OOM marker (the job raised ``torch.OutOfMemoryError``;
   without the marker, the step the rank was in when its stderr showed it). A
   rank of a multi-rank job stopped by the launcher because another rank died
   is ``aborted`` and not judged. ``actual_rank_peak_bytes`` is the rank's own
   process alone, for when another process also uses its GPU.
4. From the agent: the prediction frozen before step 2
   (``prediction_before_step2``) and its basis, and the advisories. An
   advisory's ``issued_monotonic_ns`` is the ``at_ns`` of the record entry
   (marker batch or allocator trace) it was judged on, which gives the last
   marker the agent had applied when it sent it (``warning_at``).

5. Sets. Every job of ``jobs.json`` is in the tuning or the held-out set
   (``"set"``, fixed by ``bench/torch-jobs/split.py``); ``--set`` runs one of
   them. Each row carries its job's set, and everything below is reported per
   set: the per-variant summary, the targets, and a table of median and max
   |error|, step-2 OOMs warned and false alarms per set and estimator, also
   written to ``<out>-summary.json`` (``target/torch-accuracy-summary.json``).
6. Peers (unless ``--no-peers``). Each job runs once more on a roomy GPU, two
   steps, with ``bench/peers/sitecustomize.py`` loaded: at the job's
   ``watch()`` (or callback) it starts PyTorch's
   ``torch.distributed._tools.mem_tracker.MemTracker`` (its peak over steps 1
   and 2) and computes ``accelerate estimate-memory``'s training estimate for
   the model (``accelerate.commands.estimate``: float32 row, or the bfloat16
   row when step 1's forward runs under autocast). Neither knows the capacity,
   so each estimate is judged on every trace row of its job and rank like a
   prediction: ``error`` where the run fit, ``warned`` when the estimate
   exceeds the usable memory (an OOM caught, or a false alarm at >= 5% true
   headroom). Rows get ``peers``. A peer that fails on a job (MemTracker cannot
   hook frozen parameters) has no estimate there.

Definitions (per rank and run):

- ``capacity_bytes``: the fake GPU's NVML total; ``usable_bytes`` = total minus
  the driver-reserved 512 MiB, what the processes on it can allocate.
  ``agent_capacity_bytes``: what the agent measured headroom against.
- ``error`` = (predicted - actual) / actual, for runs that fit.
- ``true_headroom`` = (usable - actual) / usable, for runs that fit.
- ``warned_before_step2``: a ``step2_oom_predicted`` advisory was issued while
  the rank was in step 1 in the agent's order of events (before it applied
  step 2's first marker). ``warning_lead_ms`` is step 2's begin marker time
  minus the issue time: negative when the training process had already begun
  step 2 (the client sends markers in batches from a background thread and
  the training loop runs ahead of the GPU, so step 1's end and step 2's begin
  often arrive in one batch). ``advisories`` lists every advisory with the
  same ``at`` and lead. ``step1_ms``: step 1's wall time, from its begin
  marker to its end marker (``--kernel-time`` stretches it).
- ``warned_at_step2_forward``: the ``step2_oom_predicted`` advisory was issued
  in step 2, from the prediction revised at step 2's first forward for a larger
  batch than step 1's (``batch_revision``; the agent judges it before step 2's
  backward in its order of events). A step-2 OOM warned either way counts as
  warned; the summary says how many were warned at step 2's first forward.
- ``false_alarm``: such an advisory, and the run fit with a true headroom of
  5% or more.

Targets (reported, made an error only with ``--check``): trace median |error|
<= 1%, max <= 3%; markers median <= 2%, max <= 5%; every rank that dies in
step 2 warned before step 2, in both variants; no false alarm.

Exit status: 0; 1 on a harness error (a job failed for a reason other than an
OOM, the agent did not come up, truth could not be read); 2 on bad usage; 3
with ``--check`` when a target is missed (and no harness error).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

MIB = 1 << 20
GIB = 1 << 30
# fake-nvml's DEFAULT_RESERVED_BYTES: NVML v2 `reserved`, outside `used` and `free`.
DRIVER_RESERVED_BYTES = 512 * MIB
VARIANTS = ("trace", "markers")
# The fixed split of bench/torch-jobs/jobs.json (bench/torch-jobs/split.py); each set is
# reported apart.
SETS = ("tuning", "held_out")
# Peer estimators, run once per job on a roomy GPU (bench/peers/sitecustomize.py).
PEERS = {
    "memtracker": "torch MemTracker (2 steps)",
    "accelerate": "accelerate estimate-memory",
}
# variant -> (median |error| target, max |error| target)
ERROR_TARGETS = {"trace": (0.01, 0.03), "markers": (0.02, 0.05)}
FALSE_ALARM_HEADROOM = 0.05
FIT_CASES = (("fit-2%", 1.015), ("fit-5%", 1.04), ("fit-10%", 1.09))
ALL_CASES = ("roomy", "fit-2%", "fit-5%", "fit-10%", "step2-oom", "fragmentation")
OOM_ADVISORY = "step2_oom_predicted"
OOM_WORDS = ("OutOfMemoryError", "CUDA out of memory")

T0 = time.monotonic()


class HarnessError(Exception):
    """Something other than the prediction went wrong: the suite cannot judge this run."""


class Interrupted(Exception):
    pass


def log(msg: str) -> None:
    print(f"[+{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def gib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / GIB:.3f}"


def pct(x: Optional[float], signed: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.2f}%" if signed else f"{100 * x:.2f}%"


# ------------------------------------------------------------------ jobs ----
@dataclass
class Job:
    name: str
    script: Path
    args: list[str]
    nproc: int
    env: dict[str, str]
    steps: int
    covers: str
    set: Optional[str] = None  # "tuning" | "held_out" (bench/torch-jobs/split.py); None: unsplit
    family: str = ""

    @staticmethod
    def load(path: Path, repo: Path) -> list[Job]:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise HarnessError(f"cannot read the jobs file {path}: {e}") from e
        if not isinstance(raw, list):
            raise HarnessError(f"{path}: expected a JSON list of jobs")
        jobs = []
        for i, j in enumerate(raw):
            try:
                script = Path(j["script"])
                if not script.is_absolute():
                    cand = path.parent / script
                    script = cand if cand.exists() else repo / script
                covers = j.get("covers", "")
                if isinstance(covers, list):
                    covers = ", ".join(str(c) for c in covers)
                job_set = j.get("set")
                if job_set is not None and job_set not in SETS:
                    raise ValueError(f"set {job_set!r} is none of {', '.join(SETS)}")
                jobs.append(
                    Job(
                        name=str(j["name"]),
                        script=script,
                        args=[str(a) for a in j.get("args", [])],
                        nproc=int(j.get("nproc", 1)),
                        env={str(k): str(v) for k, v in (j.get("env") or {}).items()},
                        steps=int(j["steps"]),
                        covers=str(covers),
                        set=job_set,
                        family=str(j.get("family", "")),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise HarnessError(f"{path}: job #{i} is malformed ({e!r}): {j!r}") from e
        return jobs


# ----------------------------------------------------------- subprocesses ----
LIVE: dict[int, tuple[subprocess.Popen, bool]] = {}  # pid -> (process, own process group)
LIVE_LOCK = threading.Lock()


STOPPING = threading.Event()  # set on the way out: start nothing more, wait for nothing


def start(cmd: list[str], group: bool, **kw: Any) -> subprocess.Popen:
    with LIVE_LOCK:
        if STOPPING.is_set():
            raise HarnessError("stopping")
        p = subprocess.Popen(cmd, start_new_session=group, **kw)
        LIVE[p.pid] = (p, group)
    return p


def stop(p: subprocess.Popen, grace: float = 10.0) -> Optional[int]:
    """SIGTERM (to its process group when it has its own), then SIGKILL after `grace` s."""
    _, group = LIVE.get(p.pid, (p, False))

    def signal_it(sig: int) -> None:
        try:
            if group:
                os.killpg(p.pid, sig)  # the group this script created for it
            else:
                p.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    if p.poll() is None:
        signal_it(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            signal_it(signal.SIGKILL)
            p.wait(5)
    elif group:
        signal_it(signal.SIGKILL)  # leftovers of a group whose leader is gone
    LIVE.pop(p.pid, None)
    return p.returncode


def stop_all() -> None:
    with LIVE_LOCK:
        STOPPING.set()
        live = list(LIVE.values())
    for p, _ in live:
        try:
            stop(p, grace=3.0)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def on_signal(signum: int, _frame: Any) -> None:
    raise Interrupted(f"signal {signum}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return 0, str(e).encode()


def tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(none)"
    return "\n".join("    " + line for line in lines[-n:])


# ----------------------------------------------------------------- agent ----
class Agent:
    """One `stepwatch agent` on a fresh fake NVML state, with --record."""

    def __init__(self, h: Harness, rundir: Path, nvml_dir: Path) -> None:
        self.h = h
        self.sock = rundir / "a.sock"
        self.record = rundir / "record.jsonl"
        self.log = rundir / "agent.log"
        self.nvml_dir = nvml_dir
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        last = ""
        for _attempt in range(2):  # a second port if the first was taken meanwhile
            self.port = free_port()
            env = dict(os.environ, STEPWATCH_FAKE_NVML_DIR=str(self.nvml_dir))
            env.setdefault("RUST_LOG", "info")
            cmd = [
                str(self.h.bin),
                "agent",
                "--nvml-lib",
                str(self.h.nvml_lib),
                "--socket",
                str(self.sock),
                "--http-listen",
                f"127.0.0.1:{self.port}",
                "--node-name",
                "torch-accuracy",
                "--process-interval",
                "250ms",
                "--record",
                str(self.record),
            ]
            with open(self.log, "wb") as out:
                self.proc = start(cmd, group=False, stdout=out, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + self.h.opts.agent_timeout
            while time.monotonic() < deadline:
                code, body = http_get(self.port, "/readyz", timeout=2)
                # /readyz is 200 without NVML too; its body says whether NVML is up,
                # which the accuracy runs need (the fake GPU's samples).
                if code == 200 and b"nvml: up" in body.splitlines():
                    return
                last = body.decode(errors="replace")[:200]
                if self.proc.poll() is not None or STOPPING.is_set():
                    break
                time.sleep(0.1)
            stop(self.proc)
            self.proc = None
        raise HarnessError(
            f"the agent did not come up (last /readyz: {last!r}); its log:\n{tail(self.log)}"
        )

    def get_json(self, path: str) -> Optional[Any]:
        code, body = http_get(self.port, path)
        if code != 200:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return None

    def stop(self) -> None:
        if self.proc is not None:
            rc = stop(self.proc)
            self.proc = None
            if rc not in (0, -signal.SIGTERM, 143):
                log(f"  note: the agent exited with status {rc}")


# ---------------------------------------------------------------- record ----
@dataclass
class RankRecord:
    """A rank's inputs to the agent, from its --record file."""

    pid: Optional[int] = None
    gpu_uuid: str = ""
    local_rank: int = 0
    # (at_ns, "markers" | "allocator_trace" | "model_facts", markers)
    entries: list[tuple[int, str, list[dict[str, Any]]]] = field(default_factory=list)

    def markers(self) -> Iterable[dict[str, Any]]:
        for _, _, ms in self.entries:
            yield from ms

    def marker_ns(self, kind: str, step: int) -> Optional[int]:
        for m in self.markers():
            if m["kind"] == kind and m["step"] == step:
                return int(m["monotonic_ns"])
        return None

    def oom_step(self) -> Optional[int]:
        for m in self.markers():
            if m["kind"] == "oom":
                return int(m["step"])
        return None

    def last_step_end(self) -> tuple[Optional[int], Optional[int]]:
        last = (None, None)
        for m in self.markers():
            if m["kind"] == "step_end":
                last = (int(m["step"]), int(m["monotonic_ns"]))
        return last

    def last_step_begun(self) -> Optional[int]:
        steps = [int(m["step"]) for m in self.markers() if m["kind"] == "step_begin"]
        return max(steps) if steps else None

    def applied_before(self, at_ns: int, step: int) -> Optional[str]:
        """What the agent had applied when it judged the entry at `at_ns`: its last
        marker of step <= `step` (and whether that entry was an allocator trace or
        a model-facts update)."""
        last: Optional[dict[str, Any]] = None
        for at, kind, ms in self.entries:
            if at > at_ns:
                break
            for m in ms:
                if at < at_ns or m["step"] <= step:
                    last = m
            if at == at_ns:
                name = fmt_marker(last) if last else "hello"
                if kind == "allocator_trace":
                    return f"allocator trace (after {name})"
                if kind == "model_facts":
                    return f"model facts update (after {name})"
                return name
        return None


def oom_warned(row: dict[str, Any]) -> bool:
    """A step-2 OOM advisory before step 2, or at step 2's first forward from the
    prediction revised for its larger batch (see the definitions above)."""
    return bool(row["warned_before_step2"] or row.get("warned_at_step2_forward"))


def fmt_marker(m: dict[str, Any]) -> str:
    mb = m.get("micro_batch") or 0
    return f"step{m['step']}.{m['kind']}" + (f"[mb{mb}]" if mb else "")


def read_record(path: Path, job_id: str) -> dict[int, RankRecord]:
    ranks: dict[int, RankRecord] = {}
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise HarnessError(f"the agent wrote no record at {path}: {e}") from e
    with f:
        for line in f:
            head = line[:24]
            if head.startswith(('{"gpu_samples"', '{"gpu_processes"', '{"evict"', '{"close"')):
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a last line cut short by a kill
            (kind, v), *_ = obj.items()
            if kind == "open":
                info = v["info"]
                if info.get("job") == job_id:
                    r = ranks.setdefault(int(info["rank"]), RankRecord())
                    r.pid = info.get("pid")
                    r.gpu_uuid = info.get("gpu_uuid") or ""
                    r.local_rank = int(info.get("local_rank") or 0)
            elif kind in ("markers", "allocator_trace", "model_facts"):
                key = v["key"]
                if key["job"] != job_id:
                    continue
                r = ranks.setdefault(int(key["rank"]), RankRecord())
                r.entries.append((int(v["at_ns"]), kind, v.get("markers") or []))
    return ranks


# ----------------------------------------------------------------- usage ----
class Usage:
    """The fake CUDA layer's usage log: per process, each change of its device usage."""

    def __init__(self, usage_dir: Path) -> None:
        # uuid -> sorted [(ns, pid, bytes)]; device index by (pid, uuid)
        self.by_gpu: dict[str, list[tuple[int, int, int]]] = {}
        self.index: dict[str, int] = {}
        for f in sorted(usage_dir.glob("*.tsv")):
            try:
                pid = int(f.stem)
            except ValueError:
                continue
            for line in f.read_text(errors="replace").splitlines():
                parts = line.split("\t")
                if len(parts) != 4:
                    continue
                try:
                    ns, dev, uuid, used = int(parts[0]), int(parts[1]), parts[2], int(parts[3])
                except ValueError:
                    continue
                self.by_gpu.setdefault(uuid, []).append((ns, pid, used))
                self.index[uuid] = dev
        for ev in self.by_gpu.values():
            ev.sort()

    def uuid_for(self, gpu_uuid: str, device_index: int) -> Optional[str]:
        if gpu_uuid and gpu_uuid in self.by_gpu:
            return gpu_uuid
        for uuid, dev in self.index.items():
            if dev == device_index:
                return uuid
        return None

    def peak(self, uuid: str, t0: int, t1: int, pid: Optional[int] = None) -> Optional[int]:
        """Max over [t0, t1] of the GPU's used bytes: the sum over the processes on it
        (or only `pid`), including the value it held when the window opened."""
        cur: dict[int, int] = {}
        best: Optional[int] = None
        opened = False
        for ns, p, used in self.by_gpu.get(uuid, []):
            if pid is not None and p != pid:
                continue
            if ns > t1:
                break
            if ns >= t0 and not opened:
                opened = True
                if cur:
                    best = sum(cur.values())
            cur[p] = used
            if ns >= t0:
                total = sum(cur.values())
                best = total if best is None else max(best, total)
        if not opened and cur:
            best = sum(cur.values())
        return best


# ------------------------------------------------------------------ runs ----
@dataclass
class Plan:
    case: str
    usable: int  # bytes the processes on each GPU may use (total - driver reserve)
    why: str


class Harness:
    def __init__(self, opts: argparse.Namespace, repo: Path) -> None:
        self.opts = opts
        self.repo = repo
        self.python = Path(opts.python)
        self.work = Path(tempfile.mkdtemp(prefix="tacc.", dir="/tmp"))
        self.rows: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.runs_done = 0
        self.lock = threading.Lock()
        self.phase_totals: dict[str, float] = {}
        # job -> rank -> what each peer estimator said (peer_run)
        self.peers: dict[str, dict[int, dict[str, Any]]] = {}
        self.fake_cuda = Path(opts.fake_cuda)
        try:
            self.bin, self.nvml_lib = self._agent_binary(Path(opts.bin))
            if opts.launcher == "fake-cuda":
                self._build_fake_cuda()
        except BaseException:
            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def _build_fake_cuda(self) -> None:
        """Build fake CUDA's libraries once, up front: a build error is one clear error."""
        try:
            b = subprocess.run(
                [str(self.fake_cuda), "build", "--python", str(self.python)],
                capture_output=True,
                text=True,
                timeout=900,
            )
        except subprocess.TimeoutExpired as e:
            raise HarnessError("fake-cuda build took more than 900 s") from e
        if b.returncode != 0:
            lines = (b.stdout + b.stderr).strip().splitlines()
            raise HarnessError(
                f"fake-cuda build failed (exit status {b.returncode}):\n"
                + "\n".join("    " + x for x in lines[-20:])
            )

    def _agent_binary(self, src: Path) -> tuple[Path, Path]:
        """A private copy of the agent and the fake NVML library: others rebuild target/."""
        if not os.access(src, os.X_OK):
            raise HarnessError(f"no agent binary at {src} (cargo build -p stepwatch)")
        out = subprocess.run(
            [str(src), "fake-gpu", "--dir", str(self.work / "probe"), "lib-path"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lib = Path(out.stdout.strip())
        if out.returncode != 0 or not lib.is_file():
            raise HarnessError(f"no fake NVML library next to {src}: {out.stderr.strip()}")
        dst = self.work / "bin"
        dst.mkdir()
        shutil.copy2(src, dst / "stepwatch")
        shutil.copy2(lib, dst / lib.name)
        return dst / "stepwatch", dst / lib.name

    def init_fake_gpus(self, nvml_dir: Path, gpus: int, total: int) -> None:
        """``gpus`` fake-NVML GPUs of ``total`` bytes each in ``nvml_dir``."""
        # --total-gib is parsed as f64 and multiplied by 2^30: exact in bytes.
        init = subprocess.run(
            [str(self.bin), "fake-gpu", "--dir", str(nvml_dir), "init"]
            + ["--gpus", str(gpus), "--total-gib", repr(total / GIB)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if init.returncode != 0:
            raise HarnessError(f"fake-gpu init failed: {init.stderr.strip()}")

    def run(self, job: Job, variant: str, plan: Plan, label: str) -> list[dict[str, Any]]:
        """One run: a fresh agent on fresh fake GPUs; the job under fake CUDA. Rows per rank."""
        with self.lock:
            self.runs_done += 1
            n = self.runs_done
        tag = f"{job.name}-{variant}-{plan.case}".replace("%", "pct")
        job_id = re.sub(r"[^a-z0-9-]", "-", f"tacc-{tag}-{os.getpid()}-{n}".lower())
        rundir = self.work / f"r{n:03d}"
        rundir.mkdir()
        nvml_dir = rundir / "nvml"
        usage_dir = rundir / "usage"
        usage_dir.mkdir()
        total = plan.usable + DRIVER_RESERVED_BYTES
        self.init_fake_gpus(nvml_dir, job.nproc, total)
        t_run = time.monotonic()
        agent = Agent(self, rundir, nvml_dir)
        phases: dict[str, float] = {}
        try:
            agent.start()
            phases["agent_up"] = time.monotonic() - t_run
            rc, timed_out = self._train(job, variant, job_id, agent, nvml_dir, usage_dir, rundir)
            phases["job"] = time.monotonic() - t_run - phases["agent_up"]
            reports = self._reports(agent, job, job_id)
        finally:
            agent.stop()
        seconds = time.monotonic() - t_run
        phases["after"] = seconds - sum(phases.values())
        with self.lock:
            for k, v in phases.items():
                self.phase_totals[k] = self.phase_totals.get(k, 0.0) + v
        out, err = rundir / "job.out", rundir / "job.err"
        output = out.read_text(errors="replace") + err.read_text(errors="replace")
        said_oom = any(w in output for w in OOM_WORDS)
        # torchrun prefixes each worker's stderr lines with "[rankN]:".
        oom_ranks = {0} if said_oom and job.nproc == 1 else set()
        for m in re.finditer(r"^\[rank(\d+)\]:(.*)$", output, re.M):
            if any(w in m.group(2) for w in OOM_WORDS):
                oom_ranks.add(int(m.group(1)))
        if timed_out:
            raise HarnessError(
                f"{tag}: the job ran past --run-timeout {self.opts.run_timeout:.0f} s;"
                f" stderr:\n{tail(err)}"
            )
        if rc != 0 and not said_oom:
            raise HarnessError(
                f"{tag}: the job failed (exit status {rc}) without an OutOfMemoryError;"
                f" stdout:\n{tail(out, 10)}\n  stderr:\n{tail(err)}"
            )
        records = read_record(agent.record, job_id)
        usage = Usage(usage_dir) if self.opts.launcher == "fake-cuda" else None
        if usage is not None and not usage.by_gpu:
            raise HarnessError(f"{tag}: fake CUDA wrote no usage log in {usage_dir}")
        rows = []
        for rank in range(job.nproc):
            rows.append(
                self._row(
                    job,
                    variant,
                    plan,
                    rank,
                    total,
                    job_id,
                    rc,
                    said_oom,
                    rank in oom_ranks,
                    seconds,
                    reports.get(rank),
                    records.get(rank),
                    usage,
                )
            )
        what = f"run {n}" + (" (calibration)" if label == "calibration" else "")
        for row in rows:
            log(f"  {what}: {progress_line(row)}")
        return rows

    def _train(
        self,
        job: Job,
        variant: str,
        job_id: str,
        agent: Agent,
        nvml_dir: Path,
        usage_dir: Path,
        rundir: Path,
    ) -> tuple[int, bool]:
        env = self.agent_env(
            job, job_id, agent, nvml_dir, STEPWATCH_FAKE_CUDA_USAGE_LOG=str(usage_dir)
        )
        if variant == "markers":
            env["STEPWATCH_ALLOCATOR_TRACE"] = "0"
        cmd = self.job_command(job)
        if self.opts.launcher == "fake-cuda":
            cmd = self.on_fake_cuda(cmd, job.nproc, usage_dir)
        rc, timed_out = self.run_logged(rundir, cmd, env)
        return (rc if rc is not None else -1), timed_out

    def agent_env(
        self, job: Job, job_id: str, agent: Agent, nvml_dir: Path, **settings: str
    ) -> dict[str, str]:
        """A job's environment (`job_env`) reporting to ``agent`` as ``job_id``, on the
        fake GPUs of ``nvml_dir``."""
        return self.job_env(
            job,
            [self.repo / "python"],
            STEPWATCH_ENDPOINT=f"unix://{agent.sock}",
            STEPWATCH_JOB_ID=job_id,
            STEPWATCH_FAKE_NVML_DIR=str(nvml_dir),
            **settings,
        )

    def job_env(self, job: Job, paths: list[Path], **settings: str) -> dict[str, str]:
        """This process's environment for a job: without the allocator settings (the job's
        own env decides them), ``paths`` first on PYTHONPATH, unbuffered, ``settings``,
        then the job's env."""
        env = dict(os.environ)
        for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "STEPWATCH_ALLOCATOR_TRACE"):
            env.pop(v, None)
        pythonpath = os.pathsep.join(str(p) for p in paths)
        if env.get("PYTHONPATH"):
            pythonpath += os.pathsep + env["PYTHONPATH"]
        env.update(PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1", **settings)
        env.update(job.env)
        return env

    def job_command(self, job: Job, *extra: str) -> list[str]:
        """The job's command line (under torchrun when it has several ranks), ``extra``
        flags last."""
        cmd = [str(self.python)]
        if job.nproc > 1:
            cmd += ["-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc-per-node", str(job.nproc)]
        return cmd + [str(job.script)] + job.args + list(extra)

    def on_fake_cuda(
        self, cmd: list[str], gpus: int, usage_dir: Optional[Path] = None
    ) -> list[str]:
        """``cmd`` under ``fake-cuda run`` on ``gpus`` GPUs, its usage log in ``usage_dir``."""
        wrap = [str(self.fake_cuda), "run", "--python", str(self.python), "--gpus", str(gpus)]
        if usage_dir is not None:
            wrap += ["--usage-log", str(usage_dir)]
        wrap += ["--quiet"]
        if self.opts.kernel_time != "0":
            wrap += ["--kernel-time", self.opts.kernel_time]
        return wrap + ["--"] + cmd

    def run_logged(
        self, rundir: Path, cmd: list[str], env: dict[str, str]
    ) -> tuple[Optional[int], bool]:
        """Runs ``cmd`` (written to ``rundir``/cmd; its output to job.out and job.err) until
        it ends or --run-timeout passes; its exit status and whether it timed out."""
        (rundir / "cmd").write_text(" ".join(cmd) + "\n")
        with open(rundir / "job.out", "wb") as out, open(rundir / "job.err", "wb") as err:
            p = start(cmd, group=True, stdout=out, stderr=err, env=env, cwd=str(self.repo))
            try:
                p.wait(self.opts.run_timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            return stop(p), timed_out

    def peer_run(self, job: Job) -> dict[int, dict[str, Any]]:
        """The peer estimators on one run of the job on a roomy fake GPU, without an agent
        (bench/peers/sitecustomize.py, 2 steps): per rank, what each estimated."""
        with self.lock:
            self.runs_done += 1
            n = self.runs_done
        rundir = self.work / f"r{n:03d}-peers"
        rundir.mkdir()
        nvml_dir = rundir / "nvml"
        out_dir = rundir / "peers"
        out_dir.mkdir()
        self.init_fake_gpus(
            nvml_dir, job.nproc, int(self.opts.calibration_gib * GIB) + DRIVER_RESERVED_BYTES
        )
        env = self.job_env(
            job,
            [self.repo / "bench/peers", self.repo / "python"],
            STEPWATCH_ENDPOINT=f"unix://{rundir / 'no-agent.sock'}",
            STEPWATCH_ALLOCATOR_TRACE="0",
            STEPWATCH_FAKE_NVML_DIR=str(nvml_dir),
            STEPWATCH_PEER_OUT=str(out_dir),
        )
        cmd = self.on_fake_cuda(self.job_command(job, "--steps", "2"), job.nproc)
        t0 = time.monotonic()
        rc, timed_out = self.run_logged(rundir, cmd, env)
        seconds = time.monotonic() - t0
        with self.lock:
            self.phase_totals["peers"] = self.phase_totals.get("peers", 0.0) + seconds
        results: dict[int, dict[str, Any]] = {}
        for rank in range(job.nproc):
            f = out_dir / f"peer-{rank}.json"
            try:
                results[rank] = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
        if timed_out or rc != 0 or len(results) < job.nproc:
            raise HarnessError(
                f"{job.name} peers: the job ended with status {rc}"
                + (" (timed out)" if timed_out else "")
                + f", {len(results)} of {job.nproc} ranks wrote estimates; stderr:\n"
                + tail(rundir / "job.err")
            )
        for rank, r in sorted(results.items()):
            parts = []
            for key, name in PEERS.items():
                pred = (r.get(key) or {}).get("predicted_peak_bytes")
                failed = r.get(f"{key}_failed")
                parts.append(f"{name} {gib(pred)} GiB" + (f" (failed: {failed})" if failed else ""))
            log(f"  run {n} (peers): {job.name} rank {rank}: {'; '.join(parts)} [{seconds:.1f} s]")
        return results

    def _reports(self, agent: Agent, job: Job, job_id: str) -> dict[int, dict[str, Any]]:
        """Each rank's report, once its stream has closed (the agent has applied all of it)."""
        reports: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.opts.report_timeout
        while True:
            listing = agent.get_json(f"/api/v1/jobs/{job_id}") or {}
            ranks = sorted(
                {int(r["rank"]) for r in listing.get("ranks", []) if isinstance(r, dict)}
                | set(range(job.nproc))
            )
            for rank in ranks:
                rep = agent.get_json(f"/api/v1/jobs/{job_id}/ranks/{rank}")
                if rep is not None:
                    reports[rank] = rep
            done = len(reports) >= job.nproc and all(
                not r.get("connected", False) for r in reports.values()
            )
            if done or time.monotonic() >= deadline or STOPPING.is_set():
                for rank, rep in reports.items():  # for a look afterwards (--keep)
                    (agent.record.parent / f"report-{rank}.json").write_text(json.dumps(rep))
                return reports
            time.sleep(0.1)

    def _row(
        self,
        job: Job,
        variant: str,
        plan: Plan,
        rank: int,
        total: int,
        job_id: str,
        rc: int,
        said_oom: bool,
        rank_said_oom: bool,
        seconds: float,
        rep: Optional[dict[str, Any]],
        rec: Optional[RankRecord],
        usage: Optional[Usage],
    ) -> dict[str, Any]:
        row: dict[str, Any] = {
            "job": job.name,
            "set": job.set,
            "family": job.family,
            "variant": variant,
            "case": plan.case,
            "planned_as": plan.why,
            "capacity_bytes": total,
            "usable_bytes": plan.usable,
            "rank": rank,
            "world_size": job.nproc,
            "job_id": job_id,
            "basis": None,
            "predicted_peak_bytes": None,
            "actual_peak_bytes": None,
            "actual_rank_peak_bytes": None,
            "oom_step": None,
            "outcome": None,
            "error": None,
            "true_headroom": None,
            "warned_before_step2": False,
            "warned_at_step2_forward": False,
            "warning_at": None,
            "warning_lead_ms": None,
            "false_alarm": False,
            "low_headroom_warned": False,
            "advisories": [],
            "step1_peak_bytes": None,
            "step1_ms": None,
            "agent_capacity_bytes": None,
            "agent_steady_allocated_peak_bytes": None,
            "agent_steady_reserved_peak_bytes": None,
            "agent_steady_nvml_peak_bytes": None,
            "exit_status": rc,
            "seconds": round(seconds, 2),
        }
        if rep is None or rec is None:
            if rc == 0 or not said_oom:
                raise HarnessError(
                    f"{job_id}: no report or record for rank {rank} (did the client connect?)"
                )
            # Died before the client's hello (while building the model).
            row.update(outcome="oom", oom_step=0)
            return row
        pred = rep.get("prediction_before_step2") or {}
        row["basis"] = (pred.get("inputs") or {}).get("basis")
        row["predicted_peak_bytes"] = pred.get("predicted_peak_bytes")
        # What the agent measured headroom against (NVML's total).
        row["agent_capacity_bytes"] = (pred.get("inputs") or {}).get("capacity_bytes")
        steady = (rep.get("analysis") or {}).get("steady") or {}
        row["agent_steady_allocated_peak_bytes"] = steady.get("allocated_peak_bytes")
        row["agent_steady_reserved_peak_bytes"] = steady.get("reserved_peak_bytes")
        row["agent_steady_nvml_peak_bytes"] = steady.get("nvml_peak_bytes")

        # Outcome: the client's OOM marker, else what the process said.
        oom_step = rec.oom_step()
        if oom_step is None:
            for s in rep.get("steps") or []:
                if s.get("outcome") == "oom":
                    oom_step = int(s["step"])
                    break
        last_step, last_end = rec.last_step_end()
        if oom_step is not None:
            row.update(outcome="oom", oom_step=oom_step)
        elif rc == 0:
            if last_step is None or last_step < job.steps:
                raise HarnessError(
                    f"{job_id}: the job exited 0 but the agent saw rank {rank} end step"
                    f" {last_step} of {job.steps}"
                )
            row["outcome"] = "fit"
        elif rank_said_oom:
            # The OOM is on stderr but no OOM marker came (the client's hook did not run):
            # the step the rank was in.
            row.update(outcome="oom", oom_step=rec.last_step_begun() or 0)
        else:
            # Another rank died; this one was stopped by the launcher.
            row["outcome"] = "aborted"

        # Advisories.
        step2_begin = rec.marker_ns("step_begin", 2)
        s1_begin = rec.marker_ns("step_begin", 1)
        s1_end = rec.marker_ns("step_end", 1)
        if s1_begin is not None and s1_end is not None:
            row["step1_ms"] = round((s1_end - s1_begin) / 1e6, 1)
        for a in rep.get("advisories") or []:
            issued = int(a["issued_monotonic_ns"])
            at = rec.applied_before(issued, int(a.get("step", 1))) or (
                f"step{a.get('step')} (no record entry at {issued})"
            )
            lead = None if step2_begin is None else round((step2_begin - issued) / 1e6, 3)
            row["advisories"].append(
                {
                    "kind": a.get("kind"),
                    "at": at,
                    "lead_ms": lead,
                    "predicted_peak_bytes": a.get("predicted_peak_bytes"),
                    "capacity_bytes": a.get("capacity_bytes"),
                }
            )
            if a.get("kind") == "low_headroom":
                row["low_headroom_warned"] = True
            if a.get("kind") != OOM_ADVISORY or row["warning_at"] is not None:
                continue
            row["warned_before_step2"] = int(a.get("step", 0)) <= 1
            row["warned_at_step2_forward"] = int(a.get("step", 0)) == 2 and bool(
                (pred.get("inputs") or {}).get("batch_revision")
            )
            row["warning_at"] = at
            row["warning_lead_ms"] = lead

        # Truth from the fake GPU.
        if usage is not None:
            uuid = usage.uuid_for(rec.gpu_uuid, rec.local_rank)
            if uuid is None:
                raise HarnessError(
                    f"{job_id}: rank {rank}'s GPU ({rec.gpu_uuid or 'no UUID'}, device"
                    f" {rec.local_rank}) is not in the usage log"
                )
            if s1_begin is not None and s1_end is not None:
                row["step1_peak_bytes"] = usage.peak(uuid, s1_begin, s1_end)
            if row["outcome"] == "fit":
                if step2_begin is None or last_end is None:
                    raise HarnessError(f"{job_id}: rank {rank} has no step 2 in the record")
                actual = usage.peak(uuid, step2_begin, last_end)
                if actual is None:
                    raise HarnessError(f"{job_id}: no usage for rank {rank} during steps 2..")
                row["actual_peak_bytes"] = actual
                # This rank's process alone (differs when another process uses its GPU).
                row["actual_rank_peak_bytes"] = usage.peak(uuid, step2_begin, last_end, rec.pid)
                row["true_headroom"] = (plan.usable - actual) / plan.usable
                if row["predicted_peak_bytes"] is not None:
                    row["error"] = (row["predicted_peak_bytes"] - actual) / actual
        row["false_alarm"] = bool(
            row["warning_at"] is not None
            and row["outcome"] == "fit"
            and row["true_headroom"] is not None
            and row["true_headroom"] >= FALSE_ALARM_HEADROOM
        )
        return row


def progress_line(row: dict[str, Any]) -> str:
    if row["outcome"] == "fit":
        what = (
            f"fit, pred {gib(row['predicted_peak_bytes'])} actual {gib(row['actual_peak_bytes'])}"
            f" GiB, err {pct(row['error'])}, headroom {pct(row['true_headroom'], False)}"
        )
    elif row["outcome"] == "oom":
        what = f"OOM in step {row['oom_step']}, pred {gib(row['predicted_peak_bytes'])} GiB"
    else:
        what = str(row["outcome"])
    warn = f"warned at {row['warning_at']}" if row["warning_at"] else "no OOM warning"
    flags = " FALSE ALARM" if row["false_alarm"] else ""
    if row["outcome"] == "oom" and row["oom_step"] == 2 and not oom_warned(row):
        flags += " UNWARNED OOM"
    return (
        f"{row['job']} {row['variant']} {row['case']} rank {row['rank']}"
        f" (usable {gib(row['usable_bytes'])} GiB): {what}; {row['basis'] or 'no prediction'};"
        f" {warn}{flags} [{row['seconds']:.1f} s]"
    )


# ------------------------------------------------------------------ plan ----
def round_mib(b: float) -> int:
    return int(math.ceil(b / MIB)) * MIB


def plan_cases(calib: list[dict[str, Any]], cases: list[str]) -> tuple[list[Plan], list[str]]:
    """Capacities around the calibration run's truth (the rank with the highest steady peak)."""
    fits = [r for r in calib if r["outcome"] == "fit" and r["actual_peak_bytes"]]
    if not fits:
        raise HarnessError("the calibration run has no rank that fit with a measured peak")
    top = max(fits, key=lambda r: r["actual_peak_bytes"])
    p = top["actual_peak_bytes"]
    s1 = top["step1_peak_bytes"]
    alloc = top["agent_steady_allocated_peak_bytes"]
    reserved = top["agent_steady_reserved_peak_bytes"]
    notes = [
        f"calibration (rank {top['rank']}): steady peak P {gib(p)} GiB, step-1 peak S1"
        f" {gib(s1)} GiB, steady allocated A {gib(alloc)} GiB, reserved R {gib(reserved)} GiB"
    ]
    plans: list[Plan] = []
    for case, f in FIT_CASES:
        if case in cases:
            plans.append(Plan(case, round_mib(p * f), f"P x {f}"))
    # Allocated memory (plus what NVML shows beyond the allocator) at its steady peak.
    need_alloc = alloc + (p - reserved) if alloc and reserved and reserved <= p else None
    min_band = max(8 * MIB, 0.01 * p)
    oom_plans: list[Plan] = []
    if s1 is None or p - s1 < min_band:
        notes.append(
            f"step2-oom, fragmentation skipped: step 1's peak {gib(s1)} GiB is within"
            f" {gib(min_band)} GiB of the steady peak"
        )
    elif need_alloc is not None and need_alloc - s1 >= min_band and p - need_alloc >= min_band:
        # Two bands: allocated memory does not fit; it fits but reserved does not.
        oom_plans.append(
            Plan("step2-oom", round_mib((s1 + need_alloc) / 2), "midway S1 .. A + P - R")
        )
        oom_plans.append(
            Plan("fragmentation", round_mib((need_alloc + p) / 2), "midway A + P - R .. P")
        )
    else:
        # Steady allocated memory fits wherever step 1 does (or it is unknown): both
        # cases lie between step 1's peak and P, a third and two thirds of the way.
        why = (
            "allocator figures unknown"
            if need_alloc is None
            else f"A + P - R = {gib(need_alloc)} GiB is not between S1 and P"
        )
        oom_plans.append(
            Plan("step2-oom", round_mib(s1 + (p - s1) / 3), f"S1 + (P - S1)/3 ({why})")
        )
        if need_alloc is not None and need_alloc <= s1 + min_band:
            oom_plans.append(
                Plan("fragmentation", round_mib(s1 + 2 * (p - s1) / 3), "S1 + 2(P - S1)/3")
            )
        else:
            notes.append(f"fragmentation skipped: {why}")
    plans += [pl for pl in oom_plans if pl.case in cases]
    return plans, notes


# --------------------------------------------------------------- summary ----
def summarize(rows: list[dict[str, Any]], variants: list[str]) -> tuple[list[str], list[str]]:
    lines: list[str] = []
    missed: list[str] = []
    for v in variants:
        vr = [r for r in rows if r["variant"] == v]
        if not vr:
            continue
        med_t, max_t = ERROR_TARGETS[v]
        fits = [r for r in vr if r["outcome"] == "fit"]
        errs = [abs(r["error"]) for r in fits if r["error"] is not None]
        no_pred = [r for r in fits if r["error"] is None]
        lines.append(f"{v}: {len(vr)} rank-runs, {len(fits)} fit")
        if errs:
            med, mx = statistics.median(errs), max(errs)
            ok_med, ok_max = med <= med_t, mx <= max_t
            lines.append(
                f"  |error| over {len(errs)} that fit: median {pct(med, False)}"
                f" (target <= {med_t:.0%}: {'met' if ok_med else 'MISSED'}),"
                f" max {pct(mx, False)} (target <= {max_t:.0%}: {'met' if ok_max else 'MISSED'})"
            )
            if not ok_med:
                missed.append(f"{v}: median |error| {pct(med, False)} > {med_t:.0%}")
            if not ok_max:
                worst = max(fits, key=lambda r: abs(r["error"] or 0))
                missed.append(
                    f"{v}: max |error| {pct(mx, False)} > {max_t:.0%}"
                    f" ({worst['job']} {worst['case']} rank {worst['rank']})"
                )
        else:
            lines.append("  |error|: no run that fit had a prediction")
        if no_pred:
            lines.append(f"  runs that fit without a prediction before step 2: {len(no_pred)}")
            missed.append(f"{v}: {len(no_pred)} run(s) that fit had no prediction before step 2")
        ooms2 = [r for r in vr if r["outcome"] == "oom" and r["oom_step"] == 2]
        warned = [r for r in ooms2 if oom_warned(r)]
        at_forward = [r for r in warned if not r["warned_before_step2"]]
        late = [r for r in warned if r["warned_before_step2"] and (r["warning_lead_ms"] or 0) < 0]
        step1_ms = [
            r["step1_ms"] for r in warned if r["warned_before_step2"] and r["step1_ms"] is not None
        ]
        lines.append(
            f"  step-2 OOMs warned before step 2: {len(warned)}/{len(ooms2)}"
            f" (target all: {'met' if len(warned) == len(ooms2) else 'MISSED'})"
            + (
                f"; {len(at_forward)} of them at step 2's first forward (a larger batch"
                " than step 1's), before step 2's backward"
                if at_forward
                else ""
            )
            + (
                f"; {len(warned) - len(at_forward) - len(late)} sent before the process began"
                f" step 2 by the wall clock (step 1 lasted median"
                f" {statistics.median(step1_ms):.0f} ms, min {min(step1_ms):.0f})"
                if step1_ms
                else ""
            )
        )
        if len(warned) != len(ooms2):
            names = ", ".join(
                f"{r['job']} {r['case']} rank {r['rank']}" for r in ooms2 if r not in warned
            )
            missed.append(f"{v}: step-2 OOM not warned: {names}")
        other_ooms = [r for r in vr if r["outcome"] == "oom" and r["oom_step"] != 2]
        if other_ooms:
            lines.append(
                "  OOMs outside step 2 (not judged): "
                + ", ".join(f"{r['job']} {r['case']} step {r['oom_step']}" for r in other_ooms)
            )
        aborted = [r for r in vr if r["outcome"] == "aborted"]
        if aborted:
            lines.append(f"  ranks stopped when another rank died (not judged): {len(aborted)}")
        shared = [
            r
            for r in fits
            if r["actual_rank_peak_bytes"] is not None
            and r["actual_rank_peak_bytes"] != r["actual_peak_bytes"]
        ]
        if shared:
            lines.append(
                f"  runs whose GPU peak includes other processes' memory: {len(shared)} ("
                + ", ".join(f"{r['job']} {r['case']} rank {r['rank']}" for r in shared[:6])
                + (", ..." if len(shared) > 6 else "")
                + ")"
            )
        fa = [r for r in vr if r["false_alarm"]]
        lines.append(
            f"  false alarms (OOM warning, fit with >= {FALSE_ALARM_HEADROOM:.0%} headroom):"
            f" {len(fa)} (target 0: {'met' if not fa else 'MISSED'})"
        )
        if fa:
            missed.append(
                f"{v}: false alarms: "
                + ", ".join(f"{r['job']} {r['case']} rank {r['rank']}" for r in fa)
            )
        tight = [r for r in fits if r["warning_at"] and not r["false_alarm"]]
        if tight:
            lines.append(
                f"  OOM warnings on runs that fit with < {FALSE_ALARM_HEADROOM:.0%} headroom"
                f" (allowed): {len(tight)}"
            )
    return lines, missed


def annotate_peers(rows: list[dict[str, Any]], peers: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Each row gets ``peers``: per peer estimator, its estimate for the row's job and rank
    (made once, on a roomy GPU), judged against the row's capacity and outcome like ours:
    ``error`` for runs that fit, ``warned`` when the estimate exceeds the usable memory."""
    for row in rows:
        got = peers.get(row["job"], {}).get(row["rank"])
        if got is None:
            row.pop("peers", None)
            continue
        out: dict[str, Any] = {}
        for key in PEERS:
            pred = (got.get(key) or {}).get("predicted_peak_bytes")
            entry: dict[str, Any] = {"predicted_peak_bytes": pred, "error": None, "warned": False}
            if got.get(f"{key}_failed"):
                entry["failed"] = got[f"{key}_failed"]
            if key == "accelerate" and got.get(key):
                entry["row"] = got[key].get("row")
            if key == "memtracker" and got.get(key):
                entry["step1_peak_bytes"] = got[key].get("step1_peak_bytes")
            if pred is not None:
                entry["warned"] = pred > row["usable_bytes"]
                if row["outcome"] == "fit" and row["actual_peak_bytes"]:
                    entry["error"] = (pred - row["actual_peak_bytes"]) / row["actual_peak_bytes"]
            out[key] = entry
        row["peers"] = out


def estimator_stats(rows: list[dict[str, Any]], who: str) -> dict[str, Any]:
    """Median and max |error| over the runs that fit, step-2 OOMs warned before step 2
    (ours) or caught (a peer's estimate above the usable memory), false alarms (warned,
    and the run fit with >= 5% true headroom). ``who``: a variant (ours) or a peer key;
    a peer is judged on the trace variant's rows (one per job, case and rank)."""
    if who in VARIANTS:
        vr = [r for r in rows if r["variant"] == who]

        def pred(r: dict[str, Any]) -> Optional[int]:
            return r["predicted_peak_bytes"]

        def err(r: dict[str, Any]) -> Optional[float]:
            return r["error"]

        def warned(r: dict[str, Any]) -> bool:
            return oom_warned(r)

        def alarm(r: dict[str, Any]) -> bool:
            return bool(r["false_alarm"])
    else:
        vr = [r for r in rows if r["variant"] == "trace" and "peers" in r]

        def pred(r: dict[str, Any]) -> Optional[int]:
            return r["peers"][who]["predicted_peak_bytes"]

        def err(r: dict[str, Any]) -> Optional[float]:
            return r["peers"][who]["error"]

        def warned(r: dict[str, Any]) -> bool:
            return bool(r["peers"][who]["warned"])

        def alarm(r: dict[str, Any]) -> bool:
            return (
                warned(r)
                and r["outcome"] == "fit"
                and (r["true_headroom"] or 0) >= FALSE_ALARM_HEADROOM
            )

    fits = [r for r in vr if r["outcome"] == "fit"]
    errs = [err(r) for r in fits if err(r) is not None]
    ooms2 = [r for r in vr if r["outcome"] == "oom" and r["oom_step"] == 2]
    worst = max(fits, key=lambda r: abs(err(r) or 0)) if errs else None
    return {
        "rank_runs": len(vr),
        "jobs": len({r["job"] for r in vr}),
        "fit": len(fits),
        "fit_without_estimate": sum(1 for r in fits if pred(r) is None),
        "median_abs_error": statistics.median(abs(e) for e in errs) if errs else None,
        "max_abs_error": max(abs(e) for e in errs) if errs else None,
        "median_error": statistics.median(errs) if errs else None,
        "worst": None if worst is None else f"{worst['job']} {worst['case']} rank {worst['rank']}",
        "step2_ooms": len(ooms2),
        "step2_ooms_warned": sum(1 for r in ooms2 if warned(r)),
        "step2_oom_unwarned": [
            f"{r['job']} {r['case']} rank {r['rank']}" for r in ooms2 if not warned(r)
        ],
        "false_alarms": sum(1 for r in vr if alarm(r)),
        "false_alarm_runs": [f"{r['job']} {r['case']} rank {r['rank']}" for r in vr if alarm(r)],
    }


def set_label(s: Optional[str]) -> str:
    return s if s is not None else "unsplit"


def sets_of(rows: list[dict[str, Any]]) -> list[Optional[str]]:
    present = {r.get("set") for r in rows}
    return [s for s in (*SETS, None) if s in present]


def summary_by_set(
    rows: list[dict[str, Any]], variants: list[str], peers: bool
) -> dict[str, dict[str, Any]]:
    """Per set, per estimator (our variants, then the peers): estimator_stats."""
    out: dict[str, dict[str, Any]] = {}
    whos = list(variants) + (list(PEERS) if peers else [])
    for st in sets_of(rows):
        srows = [r for r in rows if r.get("set") == st]
        out[set_label(st)] = {w: estimator_stats(srows, w) for w in whos}
    return out


def set_table(summary: dict[str, dict[str, Any]]) -> str:
    """One line per set and estimator: the figures the targets are judged on."""
    names = {"trace": "stepwatch, trace", "markers": "stepwatch, markers only", **PEERS}
    head = [
        "set",
        "estimator",
        "jobs",
        "runs fit",
        "median |error|",
        "max |error|",
        "step-2 OOMs warned",
        "false alarms (>= 5%)",
    ]
    body = []
    for st, by in summary.items():
        for who, x in by.items():
            no_est = f" ({x['fit_without_estimate']} without)" if x["fit_without_estimate"] else ""
            body.append(
                [
                    st,
                    names.get(who, who),
                    str(x["jobs"]),
                    f"{x['fit']}{no_est}",
                    pct(x["median_abs_error"], False),
                    pct(x["max_abs_error"], False),
                    f"{x['step2_ooms_warned']}/{x['step2_ooms']}",
                    str(x["false_alarms"]),
                ]
            )
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(out)


def job_table(rows: list[dict[str, Any]], variants: list[str], peers: bool) -> str:
    """One line per job: its set, our error range and warned step-2 OOMs per variant,
    each peer's error range and caught step-2 OOMs."""
    whos = list(variants) + (list(PEERS) if peers else [])
    head = ["job", "set"]
    for w in whos:
        head += [f"{w} error", f"{w} OOMs"]
    body = []
    for job in dict.fromkeys(r["job"] for r in rows):
        jr = [r for r in rows if r["job"] == job]
        line = [job, set_label(jr[0].get("set"))]
        for w in whos:
            x = estimator_stats(jr, w)
            if w in VARIANTS:
                errs = [r["error"] for r in jr if r["variant"] == w and r["error"] is not None]
            else:
                errs = [
                    r["peers"][w]["error"]
                    for r in jr
                    if r["variant"] == "trace"
                    and "peers" in r
                    and r["peers"][w]["error"] is not None
                ]
            if not errs:
                rng = "-"
            elif abs(max(errs) - min(errs)) < 5e-5:
                rng = pct(errs[0])
            else:
                rng = f"{pct(min(errs))}..{pct(max(errs))}"
            line += [rng, f"{x['step2_ooms_warned']}/{x['step2_ooms']}" if x["step2_ooms"] else "-"]
        body.append(line)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(out)


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "job",
        "set",
        "variant",
        "case",
        "rank",
        "usable GiB",
        "outcome",
        "predicted GiB",
        "actual GiB",
        "error",
        "headroom",
        "basis",
        "OOM warning at",
        "lead ms",
        "flags",
    ]
    body = []
    for r in rows:
        outcome = r["outcome"] if r["outcome"] != "oom" else f"OOM step {r['oom_step']}"
        flags = []
        if r["false_alarm"]:
            flags.append("FALSE-ALARM")
        if r["outcome"] == "oom" and r["oom_step"] == 2 and not oom_warned(r):
            flags.append("UNWARNED")
        if r["low_headroom_warned"]:
            flags.append("low-headroom")
        body.append(
            [
                r["job"],
                set_label(r.get("set")),
                r["variant"],
                r["case"],
                str(r["rank"]),
                gib(r["usable_bytes"]),
                outcome,
                gib(r["predicted_peak_bytes"]),
                gib(r["actual_peak_bytes"]),
                pct(r["error"]),
                pct(r["true_headroom"], False),
                r["basis"] or "-",
                r["warning_at"] or "-",
                "-" if r["warning_lead_ms"] is None else f"{r['warning_lead_ms']:.1f}",
                ",".join(flags) or "-",
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(out)


# ------------------------------------------------------------------ main ----
def add_harness_args(ap: argparse.ArgumentParser, repo: Path, out: str) -> None:
    """The flags of what the jobs run with (shared with bench/steady_growth.py);
    the results in target/``out``.json."""
    ap.add_argument(
        "--jobs-file", default=str(repo / "bench/torch-jobs/jobs.json"), help="%(default)s"
    )
    ap.add_argument("--out", default=str(repo / f"target/{out}.json"), help="%(default)s")
    ap.add_argument(
        "--bin",
        default=os.environ.get("STEPWATCH_BIN") or str(repo / "target/debug/stepwatch"),
        help="the agent (default: $STEPWATCH_BIN, else %(default)s)",
    )
    ap.add_argument(
        "--fake-cuda",
        default=os.environ.get("FAKE_CUDA") or str(repo / "crates/fake-cuda/fake-cuda"),
        help="the fake CUDA launcher (default: $FAKE_CUDA, else %(default)s)",
    )
    ap.add_argument("--python", default=sys.executable, help="Python of the jobs (%(default)s)")


def parse_args(argv: Optional[list[str]], repo: Path) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/torch-accuracy.sh",
        description="Step-2 prediction accuracy on real PyTorch jobs on fake GPUs: each job at"
        " several capacities around its true steady-state peak, with and without step 1's"
        " allocator trace. Prints a table and a summary against the targets and writes"
        " target/torch-accuracy.json (one object per rank and run).",
        epilog="Exit status: 0; 1 on a harness error (a job failed other than by OOM, the agent"
        " did not come up); 2 on bad usage; 3 with --check when a target is missed.",
    )
    ap.add_argument("--jobs", help="comma-separated job names (default: all in the jobs file)")
    ap.add_argument(
        "--set",
        help="comma-separated: tuning, held_out (the split in the jobs file;"
        " bench/torch-jobs/split.py): only jobs of these sets (with --jobs: of both)",
    )
    ap.add_argument(
        "--no-peers",
        action="store_true",
        help="skip the peer estimators (torch MemTracker, accelerate estimate-memory): one"
        " roomy run per job fewer",
    )
    ap.add_argument("--list", action="store_true", help="list the jobs and exit")
    ap.add_argument(
        "--check", action="store_true", help="exit 3 when a target is missed (default: report)"
    )
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated: trace (step 1's allocator trace, the client's default),"
        " markers (STEPWATCH_ALLOCATOR_TRACE=0)",
    )
    ap.add_argument(
        "--cases",
        default=",".join(ALL_CASES),
        help="comma-separated subset of " + ",".join(ALL_CASES).replace("%", "%%"),
    )
    add_harness_args(ap, repo, "torch-accuracy")
    ap.add_argument(
        "--calibration-gib",
        type=float,
        default=80.0,
        help="usable GiB per GPU of the calibration (roomy) run (%(default)s)",
    )
    ap.add_argument(
        "--run-timeout", type=float, default=240.0, help="seconds per run (%(default)s)"
    )
    ap.add_argument(
        "--agent-timeout",
        type=float,
        default=30.0,
        help="seconds for the agent's /readyz (%(default)s)",
    )
    ap.add_argument(
        "--report-timeout",
        type=float,
        default=15.0,
        help="seconds to wait for the agent to have every rank's stream closed (%(default)s)",
    )
    ap.add_argument(
        "--kernel-time",
        default="50us",
        help="fake-cuda run --kernel-time: how long each kernel takes, so that step 1's"
        " phases last long enough for the agent's 100 Hz sampler to see them; 0: none"
        " (%(default)s)",
    )
    ap.add_argument(
        "--parallel",
        type=int,
        default=2,
        help="runs at a time, each with its own agent and fake GPUs (%(default)s)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work folder (kept on errors)")
    ap.add_argument(
        "--launcher",
        choices=["fake-cuda", "direct"],
        default="fake-cuda",
        help=argparse.SUPPRESS,  # direct: debugging the harness on CPU jobs, no truth
    )
    opts = ap.parse_args(argv)
    opts.variants = [v for v in opts.variants.split(",") if v]
    opts.cases = [c for c in opts.cases.split(",") if c]
    opts.sets = [x for x in (opts.set or "").split(",") if x]
    bad_sets = [x for x in opts.sets if x not in SETS]
    if bad_sets:
        ap.error(f"unknown set(s): {', '.join(bad_sets)} (sets: {', '.join(SETS)})")
    bad = [v for v in opts.variants if v not in VARIANTS] + [
        c for c in opts.cases if c not in ALL_CASES
    ]
    if bad:
        ap.error(f"unknown variant(s) or case(s): {', '.join(bad)}")
    return opts


@dataclass
class Task:
    job_index: int
    job: Job
    variant: str
    plan: Plan
    calibration: bool = False
    peers: bool = False


def run_suite(h: Harness, jobs: list[Job], out: Path) -> None:
    """Calibrations first, each job's planned runs as soon as its calibration is in;
    `--parallel` runs at a time (each with its own agent and fake GPUs)."""
    opts = h.opts
    calib_variant = "trace" if "trace" in opts.variants else opts.variants[0]
    peers_on = not opts.no_peers and opts.launcher == "fake-cuda"
    roomy = Plan("roomy", int(opts.calibration_gib * GIB), "calibration")
    queue: deque[Task] = deque(
        Task(i, job, calib_variant, roomy, calibration=True) for i, job in enumerate(jobs)
    )
    left = {job.name: 1 for job in jobs}  # runs not finished, per job
    started = {job.name: 0.0 for job in jobs}
    running: dict[Future, Task] = {}
    case_order = {c: i for i, c in enumerate(ALL_CASES)}

    def sort_key(r: dict[str, Any]) -> tuple[int, int, int, int]:
        ji = next(i for i, j in enumerate(jobs) if j.name == r["job"])
        return (ji, case_order.get(r["case"], 99), VARIANTS.index(r["variant"]), r["rank"])

    with ThreadPoolExecutor(max_workers=opts.parallel) as pool:
        try:
            while queue or running:
                while queue and len(running) < opts.parallel:
                    t = queue.popleft()
                    if t.calibration:
                        started[t.job.name] = time.monotonic()
                        log(
                            f"=== job {t.job_index + 1}/{len(jobs)} {t.job.name}"
                            f" (nproc {t.job.nproc}): {t.job.covers}"
                        )
                    label = "calibration" if t.calibration else t.plan.case
                    if t.peers:
                        running[pool.submit(h.peer_run, t.job)] = t
                    else:
                        running[pool.submit(h.run, t.job, t.variant, t.plan, label)] = t
                done, _ = wait(list(running), timeout=0.5, return_when=FIRST_COMPLETED)
                for f in done:
                    t = running.pop(f)
                    left[t.job.name] -= 1
                    if t.peers:
                        try:
                            h.peers[t.job.name] = f.result()
                        except HarnessError as e:
                            h.errors.append(f"{t.job.name} peers: {e}")
                            log(f"  HARNESS ERROR ({t.job.name} peers): {e}")
                        if left[t.job.name] == 0:
                            log(
                                f"  {t.job.name}: done in"
                                f" {time.monotonic() - started[t.job.name]:.0f} s"
                            )
                        continue
                    try:
                        rows = f.result()
                    except HarnessError as e:
                        what = "calibration" if t.calibration else f"{t.variant} {t.plan.case}"
                        h.errors.append(f"{t.job.name} {what}: {e}")
                        log(f"  HARNESS ERROR ({t.job.name} {what}): {e}")
                        rows = None
                    if rows is not None and (not t.calibration or "roomy" in opts.cases):
                        h.rows += rows
                    if rows is not None and t.calibration:
                        plans: list[Plan] = []
                        notes = ["no truth without fake CUDA: no capacity plan"]
                        if opts.launcher == "fake-cuda":
                            try:
                                plans, notes = plan_cases(rows, opts.cases)
                            except HarnessError as e:
                                h.errors.append(f"{t.job.name} plan: {e}")
                                notes = [f"HARNESS ERROR: {e}"]
                        for n in notes:
                            log(f"  {t.job.name}: {n}")
                        runs = [
                            Task(t.job_index, t.job, v, p) for p in plans for v in opts.variants
                        ]
                        if peers_on:
                            runs.append(Task(t.job_index, t.job, t.variant, roomy, peers=True))
                        what = [f"{p.case} {gib(p.usable)} GiB" for p in plans]
                        if peers_on:
                            what.append("the peer estimators")
                        log(f"  {t.job.name}: {len(runs)} more runs: {', '.join(what)}")
                        left[t.job.name] += len(runs)
                        queue.extendleft(reversed(runs))  # finish this job first
                    if left[t.job.name] == 0:
                        log(
                            f"  {t.job.name}: done in"
                            f" {time.monotonic() - started[t.job.name]:.0f} s"
                        )
                    h.rows.sort(key=sort_key)
                    write_json(out, h.rows)
        finally:
            queue.clear()
            if running:
                stop_all()  # the runs in flight end at once (their threads see it)
                wait(list(running), timeout=60)


def write_json(path: Path, rows: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    tmp.replace(path)


def main(argv: Optional[list[str]] = None) -> int:
    repo = Path(__file__).resolve().parent.parent
    opts = parse_args(argv, repo)
    try:
        jobs = Job.load(Path(opts.jobs_file), repo)
    except HarnessError as e:
        print(f"torch-accuracy: {e}", file=sys.stderr)
        return 1
    if opts.list:
        for j in jobs:
            if opts.sets and j.set not in opts.sets:
                continue
            print(
                f"{j.name:28s} {set_label(j.set):8s} nproc {j.nproc}, {j.steps} steps: {j.covers}"
            )
        return 0
    if opts.jobs:
        want = [n for n in opts.jobs.split(",") if n]
        unknown = [n for n in want if n not in {j.name for j in jobs}]
        if unknown:
            print(
                f"torch-accuracy: unknown job(s) {', '.join(unknown)}; jobs:"
                f" {', '.join(j.name for j in jobs)}",
                file=sys.stderr,
            )
            return 2
        jobs = [j for j in jobs if j.name in want]
    if opts.sets:
        jobs = [j for j in jobs if j.set in opts.sets]
        if not jobs:
            print(f"torch-accuracy: no job of set(s) {opts.set} selected", file=sys.stderr)
            return 2
    if opts.launcher == "fake-cuda" and not os.access(opts.fake_cuda, os.X_OK):
        print(f"torch-accuracy: no fake CUDA launcher at {opts.fake_cuda}", file=sys.stderr)
        return 1

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    h: Optional[Harness] = None
    out = Path(opts.out)
    try:
        h = Harness(opts, repo)
        log(
            f"torch-accuracy: {len(jobs)} job(s), variants {','.join(opts.variants)},"
            f" {opts.parallel} run(s) at a time; agent {opts.bin}, python {opts.python},"
            f" work {h.work}"
        )
        run_suite(h, jobs, out)
    except Interrupted as e:
        log(f"interrupted ({e})")
        if h is not None:
            h.errors.append("interrupted")
    except HarnessError as e:
        log(f"HARNESS ERROR: {e}")
        if h is not None:
            h.errors.append(str(e))
        else:
            return 1
    finally:
        stop_all()
    assert h is not None
    peers_on = not opts.no_peers and opts.launcher == "fake-cuda"
    annotate_peers(h.rows, h.peers)
    write_json(out, h.rows)
    by_set = summary_by_set(h.rows, opts.variants, peers_on)
    summary_path = out.with_name(out.stem + "-summary.json")
    write_json(summary_path, by_set)

    print()
    print(table(h.rows))
    print()
    print(job_table(h.rows, opts.variants, peers_on))
    print()
    missed: list[str] = []
    for st in sets_of(h.rows):
        srows = [r for r in h.rows if r.get("set") == st]
        label = set_label(st)
        print(f"== set {label}: {len({r['job'] for r in srows})} job(s) ==")
        lines, set_missed = summarize(srows, opts.variants)
        for line in lines:
            print(line)
        missed += [f"{label}: {m}" for m in set_missed]
        print()
    if peers_on:
        print("Peers (one estimate per job and rank, on a roomy GPU; judged on the trace rows):")
    print(set_table(by_set))
    print(f"(per set and estimator in {summary_path})")
    print()
    if missed:
        print("TARGETS MISSED:")
        for m in missed:
            print(f"  - {m}")
    elif h.rows:
        print("All targets met.")
    if h.errors:
        print(f"HARNESS ERRORS ({len(h.errors)}):")
        for e in h.errors:
            print(f"  - {e.splitlines()[0]}")
    spent = ", ".join(f"{k} {v:.0f} s" for k, v in h.phase_totals.items())
    print(
        f"{len(h.rows)} rows in {out}; {h.runs_done} runs in {time.monotonic() - T0:.0f} s"
        + (f" ({spent})" if spent else "")
    )
    if h.errors or opts.keep:
        print(f"work folder kept: {h.work}")
    else:
        shutil.rmtree(h.work, ignore_errors=True)
    if h.errors:
        return 1
    if opts.check and missed:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
