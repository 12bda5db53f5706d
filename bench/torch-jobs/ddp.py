"""Train a GPT-like model with DistributedDataParallel, one GPU per rank (torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 2 ddp.py [flags]

NCCL on CUDA, gloo with ``--device cpu``. ``--uneven`` gives the last rank a
batch twice as large as the others (gradients are still averaged), so the
ranks' memory differs. ``--zero`` shards the optimizer state with
``torch.distributed.optim.ZeroRedundancyOptimizer``; ``--no-sync N`` accumulates
N micro-batches per step, all but the last under ``model.no_sync()`` (no
all-reduce). Rank 0 prints ``step N done`` after each optimizer step.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import stepwatch
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import common


def main(argv: Optional[list[str]] = None) -> None:
    p = common.gpt_parser(__doc__.split("\n\n")[0])
    common.add_precision_arg(p)
    p.add_argument("--uneven", action="store_true", help="the last rank's batch is twice --batch")
    p.add_argument(
        "--zero",
        action="store_true",
        help="ZeroRedundancyOptimizer(optimizer_class=AdamW) instead of --optimizer",
    )
    p.add_argument(
        "--no-sync",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per step, all but the last under model.no_sync()",
    )
    args = p.parse_args(argv)
    if args.no_sync < 1:
        p.error("--no-sync must be at least 1")
    common.check_args(p, args)

    rank, world, device = common.init_distributed(args.device)
    last_batch = args.batch * 2 if args.uneven else args.batch
    batch = last_batch if rank == world - 1 else args.batch
    model = common.gpt_model(args, device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.zero:
        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=args.lr or 3e-4,
            weight_decay=0.1,
        )
    else:
        optimizer = common.make_optimizer(args.optimizer, model.parameters(), args.lr)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"ddp: {world} ranks, {n_params / 1e6:.1f}M parameters, {args.optimizer}, "
            f"{args.precision}, batch {args.batch} x {args.seq_len}"
            + (f" ({last_batch} on rank {world - 1})" if args.uneven else "")
            + (", ZeroRedundancyOptimizer" if args.zero else "")
            + (f", {args.no_sync} micro-batches (no_sync)" if args.no_sync > 1 else ""),
            flush=True,
        )

    stepwatch.watch(model, optimizer)

    amp = common.autocast(device, args.precision)
    model.train()
    for _ in common.steps(args.steps, rank):
        for micro in range(args.no_sync):
            last = micro == args.no_sync - 1
            with contextlib.nullcontext() if last else model.no_sync():
                x, y = common.random_tokens(batch, args.seq_len, args.vocab, device)
                with amp:
                    logits = model(x)
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
                (loss / args.no_sync).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
