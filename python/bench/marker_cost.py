"""Cost of stepwatch on the training thread.

    python python/bench/marker_cost.py [--markers 200000] [--runs 7] [--steps 200]

1. Per-marker cost: ``Client.mark`` (the enqueue) and a full hook-driven phase
   event (tracker + enqueue), median ns over repeated rounds, with the endpoint
   dead (no agent) and with an in-process agent being fed (its gRPC server
   shares our GIL, so this is a pessimistic figure).
2. Training time of a small CPU model with ``stepwatch.watch`` pointed at a dead
   endpoint vs no client at all: median of several alternating runs, and the ratio.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markers", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--hidden", type=int, default=128, help="MLP width: larger makes a more realistic step"
    )
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    print(
        f"python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, stepwatch {stepwatch.__version__}"
    )
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
