"""Cost of stepwatch on the training thread.

    python python/bench/marker_cost.py [--markers 200000] [--runs 7] [--steps 200]
    python python/bench/marker_cost.py --hooks [--runs 15] [--iters 2000]
    python python/bench/marker_cost.py --trace [--runs 3]

1. Per-marker cost: ``Client.mark`` (the enqueue) and a full hook-driven phase
   event (tracker + enqueue), median ns over repeated rounds, with the endpoint
   dead (no agent) and with an in-process agent being fed (its gRPC server
   shares our GIL, so this is a pessimistic figure).
2. Training time of a small CPU model with ``stepwatch.watch`` pointed at a dead
   endpoint vs no client at all: median of several alternating runs, and the ratio.
3. ``--hooks``: the hooks ``watch()`` installs, through real ``model(x)`` and
   ``backward()`` calls on a tiny model (Linear 4-1, batch 1, 1 torch thread),
   dead endpoint: per iteration of forward+backward (2 markers: FORWARD_BEGIN,
   BACKWARD_BEGIN) and per full step with ``SGD.step()`` (6 markers), watched
   minus plain, median of alternating runs.
4. ``--trace``: step 1's allocator trace at its limits (262,000 events, 25,600
   blocks in 1,600 segments, synthetic snapshot): ``trace_from_snapshot``
   (training thread) and encoding the chunks (sender thread: building the
   messages, and serializing them as grpc does), median of ``--runs``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import stepwatch  # noqa: E402
from stepwatch._client import FORWARD_BEGIN, Client  # noqa: E402
from stepwatch._runtime import RT  # noqa: E402


def per_mark_ns(fn, n: int, rounds: int = 9) -> float:
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        per.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(per)


def bench_markers(n: int, endpoint: str, label: str) -> None:
    c = Client(endpoint, RT.hello, queue_size=16384)
    c.start()
    mark = c.mark
    raw = per_mark_ns(lambda: mark(FORWARD_BEGIN, 1, 0, None), n)
    c.close(0.5)

    os.environ["STEPWATCH_ENDPOINT"] = endpoint
    stepwatch.reset()
    tr = RT.tracker

    def phase_pair() -> None:  # two markers: FORWARD_BEGIN, BACKWARD_BEGIN
        tr.forward()
        tr.backward()

    RT.get_client().start()
    tr.begin_step()
    hooked = per_mark_ns(phase_pair, n // 2) / 2
    stepwatch.reset()
    print(f"  {label:<28} Client.mark: {raw:7.0f} ns   tracker+mark: {hooked:7.0f} ns per marker")


def bench_training(runs: int, steps: int, dead: str, hidden: int = 128, batch: int = 32) -> None:
    import torch

    torch.set_num_threads(1)

    def run(with_client: bool) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(batch, 64), torch.randn(batch, 1)
        h = None
        if with_client:
            os.environ["STEPWATCH_ENDPOINT"] = dead
            stepwatch.reset()
            h = stepwatch.watch(model, opt)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        dt = time.perf_counter() - t0
        if h is not None:
            h.remove()
            stepwatch.reset()
        return dt

    run(False), run(True)  # warm up
    base, watched = [], []
    for _ in range(runs):
        base.append(run(False))
        watched.append(run(True))
    b, w = statistics.median(base), statistics.median(watched)
    print(
        f"  training {steps} steps (MLP 64-{hidden}-1, batch {batch}, AdamW, 1 torch thread), "
        f"median of {runs}:"
    )
    print(f"    no client:            {b * 1e3:8.1f} ms  ({b / steps * 1e6:.0f} us/step)")
    print(f"    watch(), dead agent:  {w * 1e3:8.1f} ms  ({w / steps * 1e6:.0f} us/step)")
    print(f"    ratio watched/plain:  {w / b:.3f}")


def bench_hooks(runs: int, iters: int) -> None:
    import torch

    torch.set_num_threads(1)

    def run(with_client: bool, full_step: bool) -> float:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(1, 4)
        h = None
        if with_client:
            stepwatch.reset()
            h = stepwatch.watch(model, opt if full_step else None, oom_excepthook=False)
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            model(x).sum().backward()
            if full_step:
                opt.step()
                opt.zero_grad()
        dt = (time.perf_counter_ns() - t0) / iters
        if h is not None:
            h.remove()
            stepwatch.reset()
        return dt

    print(
        f"hooks of watch() through real model(x)/backward() (Linear 4-1, batch 1, "
        f"1 torch thread, dead endpoint), median of {runs} alternating runs of {iters}:"
    )
    for full_step, markers, what in ((False, 2, "forward+backward"), (True, 6, "full step")):
        run(False, full_step), run(True, full_step)  # warm up
        base, watched = [], []
        for _ in range(runs):
            base.append(run(False, full_step))
            watched.append(run(True, full_step))
        b, w = statistics.median(base), statistics.median(watched)
        d = w - b
        print(
            f"  {what:<17} plain {b / 1e3:6.1f} us  watched {w / 1e3:6.1f} us  "
            f"added {d / 1e3:5.1f} us per iteration = {d / markers / 1e3:4.1f} us "
            f"per marker ({markers} markers)"
        )


def bench_trace(runs: int) -> None:
    from stepwatch import _alloctrace as at
    from stepwatch._client import (
        BACKWARD_BEGIN,
        OPTIMIZER_BEGIN,
        OPTIMIZER_END,
        STEP_BEGIN,
    )
    from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

    n_events, n_segments, per_segment = 262_000, 1_600, 16
    segments = []
    addr = 0x7F00_0000_0000
    for i in range(n_segments):
        blocks = [
            {"address": addr + j * 131072, "size": 131072, "state": "active_allocated"}
            if j % 2
            else {"address": addr + j * 131072, "size": 131072, "state": "inactive"}
            for j in range(per_segment)
        ]
        segments.append(
            {
                "device": 0,
                "address": addr,
                "segment_type": "large" if i % 2 else "small",
                "blocks": blocks,
            }
        )
        addr += per_segment * 131072 + (1 << 20)
    entries = []
    for k in range(n_events // 2):
        a = 0x7F00_0000_0000 + (k % 4096) * 512
        entries.append({"action": "alloc", "addr": a, "size": 512 + k % 1000})
        entries.append({"action": "free_completed", "addr": a, "size": 512 + k % 1000})
    snapshot = {"segments": segments, "device_traces": [entries]}
    q = n_events // 2 // 4
    marks = [
        (STEP_BEGIN, 0, 0),
        (FORWARD_BEGIN, q, q),
        (BACKWARD_BEGIN, 2 * q, 2 * q),
        (OPTIMIZER_BEGIN, 3 * q, 3 * q),
        (OPTIMIZER_END, 4 * q, 4 * q),
    ]
    end = (n_events // 2, n_events // 2)
    conv, build, ser = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        trace = at.trace_from_snapshot(snapshot, 0, marks, end_counters=end)
        t1 = time.perf_counter()
        msgs = list(trace.messages(pb))
        t2 = time.perf_counter()
        size = sum(len(m.SerializeToString()) for m in msgs)
        t3 = time.perf_counter()
        conv.append(t1 - t0)
        build.append(t2 - t1)
        ser.append(t3 - t2)
    print(
        f"allocator trace, {trace.num_events} events, {trace.num_blocks} blocks in "
        f"{len(trace.segments)} segments, median of {runs}:"
    )
    print(f"  conversion (trace_from_snapshot, training thread): {statistics.median(conv):.3f} s")
    print(
        f"  encoding (sender thread): messages {statistics.median(build):.3f} s + serialize "
        f"{statistics.median(ser):.3f} s; {len(msgs)} chunks, {size} bytes"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markers", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--hidden", type=int, default=128, help="MLP width: larger makes a more realistic step"
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hooks", action="store_true", help="only: watch()'s hooks per step")
    ap.add_argument("--iters", type=int, default=2000, help="--hooks: iterations per run")
    ap.add_argument("--trace", action="store_true", help="only: step 1's allocator trace")
    args = ap.parse_args()
    print(
        f"python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, stepwatch {stepwatch.__version__}"
    )
    if args.trace:
        bench_trace(args.runs)
        return
    if args.hooks:
        with tempfile.TemporaryDirectory(prefix="swb-") as d:
            os.environ["STEPWATCH_ENDPOINT"] = f"unix://{d}/no-agent.sock"
            bench_hooks(args.runs, args.iters)
        return
    with tempfile.TemporaryDirectory(prefix="swb-") as d:
        dead = f"unix://{d}/no-agent.sock"
        print("per-marker cost on the training thread (median):")
        bench_markers(args.markers, dead, "dead endpoint:")
        from conftest import FakeAgent

        agent = FakeAgent(f"{d}/agent.sock").start()
        try:
            bench_markers(args.markers, agent.endpoint, "in-process agent (shared GIL):")
        finally:
            agent.stop()
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch not installed: training benchmark skipped")
            return
        bench_training(args.runs, args.steps, dead, args.hidden, args.batch)


if __name__ == "__main__":
    main()
