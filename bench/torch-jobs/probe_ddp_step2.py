"""Show what step 2 allocates that step 1 did not, per phase, on DDP rank 0.

    fake-cuda run --gpus 2 -- python -m torch.distributed.run --standalone \
        --nproc-per-node 2 probe_ddp_step2.py --uneven --batch 2

Not a job of the manifest and not a stepwatch client: it trains `ddp.py`'s model
for three steps with PyTorch's own memory history on, then prints, for rank 0,
each phase's allocations and new segments, and the allocation sizes that only
step 1 or only step 2 made in each phase. It is how `ddp-uneven`'s step-2
prediction error was traced to DDP's bucket rebuild (BENCHMARKS.md).
"""

from __future__ import annotations

import collections
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import common

PHASES = ["begin", "fwd", "bwd", "opt", "zero"]


def main(argv: Optional[list[str]] = None) -> None:
    p = common.gpt_parser(__doc__.split("\n\n")[0])
    common.add_precision_arg(p)
    p.add_argument("--uneven", action="store_true", help="the last rank's batch is twice --batch")
    args = p.parse_args(argv)
    common.check_args(p, args)
    rank, world, device = common.init_distributed(args.device)
    batch = args.batch * 2 if (args.uneven and rank == world - 1) else args.batch
    model = common.gpt_model(args, device)
    model = DDP(model, device_ids=[device.index])
    optimizer = common.make_optimizer(args.optimizer, model.parameters(), args.lr)
    amp = common.autocast(device, args.precision)

    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=1_000_000
    )
    marks: list[tuple[str, int, int]] = []

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        events = len(torch.cuda.memory._snapshot()["device_traces"][device.index])
        marks.append((name, events, torch.cuda.memory_reserved()))

    for step in range(1, 4):
        mark(f"s{step}.begin")
        x, y = common.random_tokens(batch, args.seq_len, args.vocab, device)
        mark(f"s{step}.fwd")
        with amp:
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        mark(f"s{step}.bwd")
        loss.backward()
        mark(f"s{step}.opt")
        optimizer.step()
        mark(f"s{step}.zero")
        optimizer.zero_grad(set_to_none=True)
    mark("end")
    trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
    if rank == 0:
        spans: dict[str, list[dict]] = {}
        for (name, start, reserved), (_, end, _) in zip(marks, marks[1:]):
            events = trace[start:end]
            spans[name] = events
            allocs = [e["size"] for e in events if e["action"] == "alloc"]
            segments = [e["size"] for e in events if e["action"] == "segment_alloc"]
            print(
                f"{name}: reserved {reserved / 2**20:.1f} MiB at its start; {len(allocs)} allocs "
                f"({sum(allocs) / 2**20:.1f} MiB); new segments (MiB): "
                f"{[round(s / 2**20, 1) for s in segments]}"
            )

        def sizes(step: int, phase: str) -> collections.Counter:
            return collections.Counter(
                e["size"] for e in spans[f"s{step}.{phase}"] if e["action"] == "alloc"
            )

        for phase in PHASES:
            only_2 = sorted((sizes(2, phase) - sizes(1, phase)).items())
            only_1 = sorted((sizes(1, phase) - sizes(2, phase)).items())
            print(f"{phase}: (size, count) only in step 2: {only_2}; only in step 1: {only_1}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
