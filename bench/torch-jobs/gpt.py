"""Train a GPT-like model on random tokens, one GPU (or the CPU).

A plain PyTorch loop: forward under autocast (or not), cross-entropy loss,
backward, ``optimizer.step()``, ``optimizer.zero_grad()``. The flags choose the
optimizer, the precision, gradient accumulation, how gradients are zeroed and
whether the optimizer state exists before step 1; and loop shapes people add:
parameter groups with and without weight decay, an LR scheduler,
``clip_grad_norm_``, frozen layers, an evaluation pass every k steps, a
checkpoint copied to the host after step 1, a smaller warm-up batch in step 1.
Prints ``step N done`` after each optimizer step.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import stepwatch
import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)

import common


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


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """nanoGPT's split: weight decay on matrices (and embeddings), none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def cosine_with_warmup(
    optimizer: torch.optim.Optimizer, warmup: int, total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (i - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def checkpoint_to_host(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and the optimizer's state_dict, every tensor copied to the host, as a
    checkpoint writer does before it serialises."""

    def to_host(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.detach().to("cpu")
        if isinstance(obj, dict):
            return {k: to_host(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(to_host(v) for v in obj)
        return obj

    return {"model": to_host(model.state_dict()), "optimizer": to_host(optimizer.state_dict())}


class LossInModel(torch.nn.Module):
    """The GPT with the loss inside its forward, as Hugging Face causal LMs and
    nanoGPT write it: logits shifted by one token, upcast to float32, cross-entropy;
    returns a dict the loop keeps in ``out`` until the next step's forward returns."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.gpt(idx)
        shifted = logits[:, :-1, :].contiguous().float()
        labels = targets[:, 1:].contiguous()
        loss = F.cross_entropy(shifted.view(-1, shifted.size(-1)), labels.view(-1))
        return {"logits": logits, "loss": loss}


def main(argv: Optional[list[str]] = None) -> None:
    p = common.gpt_parser(__doc__.split("\n\n")[0])
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
    p.add_argument(
        "--param-groups",
        action="store_true",
        help="two parameter groups: weight decay on matrices, none on biases and norms",
    )
    p.add_argument(
        "--scheduler", action="store_true", help="LambdaLR: linear warm-up, cosine decay"
    )
    p.add_argument(
        "--clip", type=float, default=None, help="torch.nn.utils.clip_grad_norm_ to this norm"
    )
    p.add_argument(
        "--freeze-layers",
        type=int,
        default=0,
        help="freeze the embeddings (and so the tied head) and the first N blocks",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="after every K-th step, an evaluation batch under model.eval() and no_grad()",
    )
    p.add_argument(
        "--checkpoint-after-step1",
        action="store_true",
        help="after step 1, copy model and optimizer state_dict() to the host",
    )
    p.add_argument(
        "--loss-in-model",
        action="store_true",
        help="the loss computed inside the model's forward (shifted, float32), its output"
        " dict kept in `out` until the next step's forward returns",
    )
    p.add_argument(
        "--warmup-batch",
        type=int,
        default=0,
        help="step 1 runs this many sequences (a warm-up), later steps --batch",
    )
    args = p.parse_args(argv)
    common.check_args(p, args)

    device = common.setup_device(args.device)
    model = common.gpt_model(args, device, activation_checkpointing=args.activation_checkpointing)
    if args.precision == "bf16":
        model.to(torch.bfloat16)
    if args.freeze_layers:
        model.tok.requires_grad_(False)
        model.pos.requires_grad_(False)
        for block in model.blocks[: args.freeze_layers]:
            block.requires_grad_(False)
    if args.param_groups:
        params: Any = param_groups(model)
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    optimizer = common.make_optimizer(args.optimizer, params, args.lr)
    scheduler = cosine_with_warmup(optimizer, 2, args.steps) if args.scheduler else None
    if args.precreate_state:
        precreate_optimizer_state(optimizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"gpt: {n_params / 1e6:.1f}M parameters, {args.optimizer}, {args.precision}, "
        f"{args.grad_accum} x {args.batch} x {args.seq_len} tokens per step on {device}",
        flush=True,
    )

    loss_model = LossInModel(model) if args.loss_in_model else model
    stepwatch.watch(loss_model, optimizer)

    # bf16 weights need no autocast; "bf16-autocast" runs fp32 weights under it.
    amp = common.autocast(device, args.precision)
    model.train()
    for step in common.steps(args.steps):
        batch = args.warmup_batch if step == 1 and args.warmup_batch else args.batch
        for _ in range(args.grad_accum):
            x, y = common.random_tokens(batch, args.seq_len, args.vocab, device)
            with amp:
                if args.loss_in_model:
                    out = loss_model(x, y)
                    loss = out["loss"]
                else:
                    logits = model(x)
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            (loss / args.grad_accum).backward()
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=not args.zero_grad_keep)
        if step == 1 and args.checkpoint_after_step1:
            ckpt = checkpoint_to_host(model, optimizer)
            print(f"checkpoint: {len(ckpt['model'])} model tensors on the host", flush=True)
            del ckpt
        if args.eval_every and step % args.eval_every == 0:
            model.eval()
            with torch.no_grad(), amp:
                x, y = common.random_tokens(args.batch, args.seq_len, args.vocab, device)
                logits = model(x)
                val = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            print(f"eval after step {step}: loss {val.item():.3f}", flush=True)
            model.train()


if __name__ == "__main__":
    main()
