"""Train a GPT-like model with DistributedDataParallel, one GPU per rank (torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 2 ddp.py [flags]

NCCL on CUDA, gloo with ``--device cpu``. ``--uneven`` gives the last rank a
batch twice as large as the others (gradients are still averaged), so the
ranks' memory differs. Rank 0 prints ``step N done`` after each optimizer step.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import stepwatch
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from common import (
    add_gpt_args,
    add_optimizer_arg,
    add_precision_arg,
    autocast,
    check_args,
    gpt_config,
    init_distributed,
    make_optimizer,
    parser,
    random_tokens,
)
from models import GPT


def main(argv: Optional[List[str]] = None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    add_gpt_args(p)
    add_optimizer_arg(p)
    add_precision_arg(p)
    p.add_argument("--uneven", action="store_true", help="the last rank's batch is twice --batch")
    args = p.parse_args(argv)
    check_args(p, args)

    rank, world, device = init_distributed(args.device)
    last_batch = args.batch * 2 if args.uneven else args.batch
    batch = last_batch if rank == world - 1 else args.batch
    torch.manual_seed(args.seed)
    with device:
        model = GPT(gpt_config(args))
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"ddp: {world} ranks, {n_params / 1e6:.1f}M parameters, {args.optimizer}, "
            f"{args.precision}, batch {args.batch} x {args.seq_len}"
            + (f" ({last_batch} on rank {world - 1})" if args.uneven else ""),
            flush=True,
        )

    stepwatch.watch(model, optimizer)

    amp = autocast(device, args.precision)
    model.train()
    for step in range(1, args.steps + 1):
        x, y = random_tokens(batch, args.seq_len, args.vocab, device)
        with amp:
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} done", flush=True)

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
