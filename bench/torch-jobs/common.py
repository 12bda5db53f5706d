"""Command line and set-up helpers the training jobs share."""

from __future__ import annotations

import argparse
import os
from typing import Any, Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from models import GPTConfig

OPTIMIZERS = ("adamw", "adamw-fused", "sgd", "sgd-momentum")
PRECISIONS = ("fp32", "bf16-autocast")


def parser(description: str, *, steps: int = 6) -> argparse.ArgumentParser:
    """The flags every job has: --steps, --device, --lr, --seed."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps to run")
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: for a smoke test"
    )
    p.add_argument(
        "--lr", type=float, default=None, help="learning rate; unset: 3e-4 (AdamW), 1e-2 (SGD)"
    )
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed")
    return p


def add_gpt_args(
    p: argparse.ArgumentParser,
    *,
    layers: int = 12,
    hidden: int = 768,
    heads: int = 12,
    seq_len: int = 512,
    batch: int = 4,
    vocab: int = 50304,
) -> None:
    """Size knobs of the GPT-like model (defaults: GPT-2 small, 124M parameters)."""
    p.add_argument("--layers", type=int, default=layers, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=hidden, help="model width")
    p.add_argument("--heads", type=int, default=heads, help="attention heads")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=batch, help="sequences per micro-batch")
    p.add_argument("--vocab", type=int, default=vocab, help="vocabulary size")


def add_optimizer_arg(
    p: argparse.ArgumentParser, default: str = "adamw", choices: Sequence[str] = OPTIMIZERS
) -> None:
    p.add_argument(
        "--optimizer",
        choices=list(choices),
        default=default,
        help="adamw: torch's default (foreach on CUDA); adamw-fused: fused=True",
    )


def add_precision_arg(p: argparse.ArgumentParser, default: str = "fp32") -> None:
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default=default,
        help="bf16-autocast: fp32 weights, forward under torch.autocast(bfloat16)",
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """At least 1 for every integer size knob present; hidden a multiple of heads."""
    for name in ("steps", "layers", "hidden", "heads", "seq_len", "batch", "vocab", "grad_accum"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if hasattr(args, "heads") and args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")


def gpt_config(args: argparse.Namespace, **extra: Any) -> GPTConfig:
    return GPTConfig(
        vocab=args.vocab,
        seq_len=args.seq_len,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        **extra,
    )


def setup_device(name: str, index: Optional[int] = None) -> torch.device:
    """The device to train on; on CUDA also made current, and cuDNN attention turned off."""
    if name != "cuda":
        return torch.device(name)
    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    torch.cuda.set_device(device)
    # The fake CUDA stack has no working cuDNN: keep SDPA on flash / memory-efficient.
    torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def init_distributed(device_name: str) -> Tuple[int, int, torch.device]:
    """torchrun's process group: NCCL on CUDA (one GPU per local rank), gloo on CPU.

    Returns (rank, world size, device).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = setup_device(device_name, local_rank if device_name == "cuda" else None)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def make_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], lr: Optional[float] = None
) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr or 3e-4, weight_decay=0.1)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr or 3e-4, weight_decay=0.1, fused=True)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr or 1e-2, momentum=0.9)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 1e-2)
    raise ValueError(f"unknown optimizer {name!r}")


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """bf16 autocast for ``bf16-autocast``, a disabled one for ``fp32``."""
    return torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16-autocast"
    )


def random_tokens(
    batch: int, seq_len: int, vocab: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A batch of random token ids and its next-token targets."""
    t = torch.randint(vocab, (batch, seq_len + 1), device=device)
    return t[:, :-1], t[:, 1:]
