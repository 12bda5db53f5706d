"""Command line and set-up helpers the training jobs share."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import stepwatch
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch.utils.data import Dataset

from models import GPT, GPTConfig

OPTIMIZERS = (
    "adamw",
    "adamw-fused",
    "adamw-loop",
    "sgd",
    "sgd-momentum",
    "sgd-nesterov",
    "adam-amsgrad",
    "adagrad",
    "rmsprop",
    "adafactor",
    "lion",
)
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


def gpt_parser(description: str, **sizes: Any) -> argparse.ArgumentParser:
    """The flags of the jobs that train the shared GPT: ``parser``'s, the size knobs
    (``sizes``: other defaults) and ``--optimizer``."""
    p = parser(description)
    add_gpt_args(p, **sizes)
    add_optimizer_arg(p)
    return p


def add_gpt_args(
    p: argparse.ArgumentParser,
    *,
    layers: int = 12,
    hidden: int = 768,
    heads: Optional[int] = 12,
    seq_len: int = 512,
    batch: int = 4,
    vocab: int = 50304,
) -> None:
    """Size knobs of a language model (defaults: GPT-2 small, 124M parameters);
    ``heads=None``: a model without attention, no ``--heads``."""
    p.add_argument("--layers", type=int, default=layers, help="blocks (layers)")
    p.add_argument("--hidden", type=int, default=hidden, help="model width")
    if heads is not None:
        p.add_argument("--heads", type=int, default=heads, help="attention heads")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=batch, help="sequences per micro-batch")
    p.add_argument("--vocab", type=int, default=vocab, help="vocabulary size")


def add_image_args(
    p: argparse.ArgumentParser,
    *,
    batch: int,
    image_size: int,
    width: int,
    classes: Optional[int] = None,
    image_size_help: str = "height and width",
) -> None:
    """Size knobs of the convolution jobs; ``classes=None``: no ``--classes``."""
    p.add_argument("--batch", type=int, default=batch, help="images per step")
    p.add_argument("--image-size", type=int, default=image_size, help=image_size_help)
    if classes is not None:
        p.add_argument("--classes", type=int, default=classes, help="output classes")
    p.add_argument("--width", type=int, default=width, help="channels of the first stage")


def add_optimizer_arg(
    p: argparse.ArgumentParser, default: str = "adamw", choices: Sequence[str] = OPTIMIZERS
) -> None:
    p.add_argument(
        "--optimizer",
        choices=list(choices),
        default=default,
        help="adamw: torch's default (foreach on CUDA); adamw-fused: fused=True; adamw-loop:"
        " foreach=False; adagrad: state made in its constructor; adafactor: torch.optim's;"
        " lion: a hand-written Lion (one state tensor per parameter)",
    )


def add_precision_arg(p: argparse.ArgumentParser, default: str = "fp32") -> None:
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default=default,
        help="bf16-autocast: fp32 weights, forward under torch.autocast(bfloat16)",
    )


def add_mixed_precision_arg(p: argparse.ArgumentParser, policy: str) -> None:
    """The sharded jobs' ``--precision fp32|bf16-mixed``; ``policy``: what bf16-mixed sets."""
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16-mixed"],
        default="bf16-mixed",
        help=f"bf16-mixed: {policy}",
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """At least 1 for every integer size knob present; hidden a multiple of heads."""
    for name in ("steps", "layers", "hidden", "heads", "seq_len", "batch", "vocab", "grad_accum"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if getattr(args, "heads", None) and args.hidden % args.heads:
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


def gpt_model(args: argparse.Namespace, device: torch.device, **extra: Any) -> GPT:
    """The GPT of the size flags, seeded with ``args.seed`` and built directly on ``device``."""
    torch.manual_seed(args.seed)
    with device:
        return GPT(gpt_config(args, **extra))


def setup_device(name: str, index: Optional[int] = None) -> torch.device:
    """The device to train on; on CUDA also made current, and cuDNN attention turned off."""
    if name != "cuda":
        return torch.device(name)
    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    torch.cuda.set_device(device)
    # The fake CUDA stack has no working cuDNN: keep SDPA on flash / memory-efficient.
    torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def init_distributed(device_name: str) -> tuple[int, int, torch.device]:
    """torchrun's process group: NCCL on CUDA (one GPU per local rank), gloo on CPU.

    Returns (rank, world size, device).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = setup_device(device_name, local_rank if device_name == "cuda" else None)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), written
    the way a user writes an optimizer: one state tensor per parameter (the momentum),
    made lazily in the first ``step()``, a plain loop over the parameters."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def make_optimizer(name: str, params: Any, lr: Optional[float] = None) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (parameters or parameter groups)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr or 3e-4, weight_decay=0.1)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr or 3e-4, weight_decay=0.1, fused=True)
    if name == "adamw-loop":
        return torch.optim.AdamW(params, lr=lr or 3e-4, weight_decay=0.1, foreach=False)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr or 1e-2, momentum=0.9)
    if name == "sgd-nesterov":
        return torch.optim.SGD(params, lr=lr or 1e-2, momentum=0.9, nesterov=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 1e-2)
    if name == "adam-amsgrad":
        return torch.optim.Adam(params, lr=lr or 3e-4, amsgrad=True)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr or 1e-2)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr or 1e-3, alpha=0.99)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr or 1e-2)
    if name == "lion":
        return Lion(params, lr=lr or 1e-4, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}")


def build_model(
    name: str,
    args: argparse.Namespace,
    device: torch.device,
    make_model: Any,
    detail: str,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The job's model, built on ``device`` from ``args.seed``, and its optimizer
    (``args.optimizer``, ``args.lr``); prints one line saying what was built."""
    torch.manual_seed(args.seed)
    with device:
        model = make_model()
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n_params / 1e6:.1f}M parameters, {detail} on {device}", flush=True)
    return model, optimizer


def start_job(
    name: str, args: argparse.Namespace, make_model: Any, detail: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.device]:
    """What a one-GPU job does before its loop: the device (``args.device``), the
    model and optimizer of ``build_model`` on it, and ``stepwatch.watch`` on both."""
    device = setup_device(args.device)
    model, optimizer = build_model(name, args, device, make_model, detail)
    stepwatch.watch(model, optimizer)
    return model, optimizer, device


def steps(n: int, rank: int = 0) -> Iterator[int]:
    """Step numbers 1..n for the training loop; after each step's body, rank 0 prints
    ``step N done`` (the line the harness counts)."""
    for step in range(1, n + 1):
        yield step
        if rank == 0:
            print(f"step {step} done", flush=True)


def train_sharded_gpt(
    name: str,
    args: argparse.Namespace,
    model: torch.nn.Module,
    rank: int,
    world: int,
    device: torch.device,
    *,
    local_shards: bool,
) -> None:
    """What the sharded GPT jobs do once their model is wrapped: the optimizer over its
    (sharded) parameters, one line from rank 0 saying what runs, ``stepwatch.watch``, the
    loop on random tokens, and the process group's end. ``local_shards``: the parameters
    are this rank's shards (FSDP v1's flat ones), so the line counts ``world`` times them."""
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        size = f"about {n_params * world / 1e6:.1f}M" if local_shards else f"{n_params / 1e6:.1f}M"
        print(
            f"{name}: {world} ranks, {size} parameters, {args.optimizer}, "
            f"{args.precision}, batch {args.batch} x {args.seq_len} per rank",
            flush=True,
        )

    stepwatch.watch(model, optimizer)

    model.train()
    for _ in steps(args.steps, rank):
        x, y = random_tokens(args.batch, args.seq_len, args.vocab, device)
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    dist.destroy_process_group()


def train_on_images(
    args: argparse.Namespace,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    per_pixel: bool = False,
) -> None:
    """The image jobs' loop: random images with a label per image (or per pixel), the
    cross-entropy of the model's output under ``--precision``'s autocast."""
    amp = autocast(device, args.precision)
    model.train()
    for _ in steps(args.steps):
        images, labels = random_images(
            args.batch, args.image_size, args.classes, device, per_pixel=per_pixel
        )
        with amp:
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """bf16 autocast for ``bf16-autocast``, a disabled one for ``fp32``."""
    return torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16-autocast"
    )


def random_tokens(
    batch: int, seq_len: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random token ids and its next-token targets."""
    t = torch.randint(vocab, (batch, seq_len + 1), device=device)
    return t[:, :-1], t[:, 1:]


def random_images(
    batch: int, size: int, classes: int, device: torch.device, *, per_pixel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and class labels (one per image, or one per pixel), made on the
    host and copied to ``device``, as a data loader hands them over."""
    images = torch.randn(batch, 3, size, size)
    labels = torch.randint(classes, (batch, size, size) if per_pixel else (batch,))
    return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


class RandomTokens(Dataset):
    """``n`` random token sequences as Hugging Face batches: ``input_ids``, ``labels``
    (the same ids) and, with ``attention_mask``, a mask of ones."""

    def __init__(self, n: int, seq_len: int, vocab: int, *, attention_mask: bool = False) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab
        self.attention_mask = attention_mask

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(self.vocab, (self.seq_len,))
        if self.attention_mask:
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        return {"input_ids": ids, "labels": ids}
