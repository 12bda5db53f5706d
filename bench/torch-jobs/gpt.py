"""Train a GPT-like model on random tokens, one GPU (or the CPU).

A plain PyTorch loop: forward under autocast (or not), cross-entropy loss,
backward, ``optimizer.step()``, ``optimizer.zero_grad()``. The flags choose the
optimizer, the precision, gradient accumulation, how gradients are zeroed and
whether the optimizer state exists before step 1. Prints ``step N done`` after
each optimizer step.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import stepwatch
import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)

from common import (
    add_gpt_args,
    add_optimizer_arg,
    autocast,
    check_args,
    gpt_config,
    make_optimizer,
    parser,
    random_tokens,
    setup_device,
)
from models import GPT


def precreate_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's state now, before step 1, as torchtitan does before loading a
    checkpoint (``torch.distributed.checkpoint.state_dict._init_optim_state``): zero
    gradients, one ``step()`` with the learning rate at 0, gradients dropped again."""
    if optimizer.state:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    add_gpt_args(p)
    add_optimizer_arg(p)
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16-autocast", "bf16"],
        default="fp32",
        help="bf16: the model's weights (and so gradients and optimizer state) in bf16",
    )
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument(
        "--zero-grad-keep",
        action="store_true",
        help="optimizer.zero_grad(set_to_none=False): gradients stay allocated",
    )
    p.add_argument(
        "--precreate-state",
        action="store_true",
        help="create the optimizer state before step 1 (torchtitan-style)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block in backward (torch.utils.checkpoint)",
    )
    args = p.parse_args(argv)
    check_args(p, args)

    device = setup_device(args.device)
    torch.manual_seed(args.seed)
    cfg = gpt_config(args, activation_checkpointing=args.activation_checkpointing)
    with device:
        model = GPT(cfg)
    if args.precision == "bf16":
        model.to(torch.bfloat16)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    if args.precreate_state:
        precreate_optimizer_state(optimizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"gpt: {n_params / 1e6:.1f}M parameters, {args.optimizer}, {args.precision}, "
        f"{args.grad_accum} x {args.batch} x {args.seq_len} tokens per step on {device}",
        flush=True,
    )

    stepwatch.watch(model, optimizer)

    # bf16 weights need no autocast; "bf16-autocast" runs fp32 weights under it.
    amp = autocast(device, args.precision)
    model.train()
    for step in range(1, args.steps + 1):
        for _ in range(args.grad_accum):
            x, y = random_tokens(args.batch, args.seq_len, args.vocab, device)
            with amp:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            (loss / args.grad_accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not args.zero_grad_keep)
        print(f"step {step} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
