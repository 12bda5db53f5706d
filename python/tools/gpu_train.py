"""A small GPT-style training loop watched by stepwatch, for capturing real-GPU fixtures.

    python python/tools/gpu_train.py [--optimizer adamw|sgd|sgd-momentum] [--steps 12]
        [--layers 24] [--hidden 1024] [--heads 16] [--seq-len 1024] [--batch 8]
        [--vocab 50304] [--device cuda|cpu] [--dtype bf16|fp32] [--job-id ID]
        [--endpoint unix:///run/stepwatch/stepwatch.sock]

The model is the accuracy jobs' GPT (bench/torch-jobs/models.py: token and
position embeddings, pre-norm transformer blocks with causal self-attention
and a 4x GELU MLP, a final norm and an LM head tied to the token embedding);
the data are random tokens. The
defaults (~355M parameters, 8 x 1024 tokens, bf16 autocast, AdamW) take a
few seconds for 12 steps on an H200 and about 20 GB of GPU memory, enough for
the optimizer state made in step 1 and the caching allocator's fragmentation
to show. It uses the client exactly as a training script would:
``stepwatch.watch(model, optimizer, ...)``; the endpoint is ``--endpoint`` or
``STEPWATCH_ENDPOINT``.

Prints one line per step (time, loss, and on CUDA the allocator's current and
peak allocated / reserved memory), then ``stepwatch.stats()``, the last
advisory if any, and a ``summary: {json}`` line. Exits non-zero only on a real
error (an exception in training, an OOM, bad flags); an absent agent is only
reported. On CPU, pass tiny sizes, e.g. ``--layers 2 --hidden 64 --heads 4
--seq-len 32 --batch 2 --vocab 256``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

try:
    import stepwatch
except ImportError:  # run from a checkout without `pip install ./python`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import stepwatch

import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)

# The accuracy jobs' GPT and optimizers (bench/torch-jobs), which travel with the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "torch-jobs"))
from common import make_optimizer  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402

GIB = 1024**3


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=["adamw", "sgd", "sgd-momentum"], default="adamw")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16: autocast")
    p.add_argument("--lr", type=float, default=None, help="default: 3e-4 (AdamW), 1e-2 (SGD)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--job-id", default=None, help="default: STEPWATCH_JOB_ID, launcher, host-pid")
    p.add_argument("--endpoint", default=None, help="default: STEPWATCH_ENDPOINT or the socket")
    p.add_argument(
        "--flush-timeout", type=float, default=5.0, help="s to wait for markers to reach the agent"
    )
    args = p.parse_args(argv)
    for name in ("steps", "layers", "hidden", "heads", "seq_len", "batch", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")
    return args


def memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
    }


def fmt_memory(m: dict[str, int]) -> str:
    if not m:
        return ""
    return (
        f"  alloc {m['allocated'] / GIB:7.3f} GiB (max {m['max_allocated'] / GIB:7.3f})"
        f"  reserved {m['reserved'] / GIB:7.3f} GiB (max {m['max_reserved'] / GIB:7.3f})"
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # The client's warnings and the agent's advisories go to the `stepwatch` logger.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)

    with device:  # parameters made (and initialised) on the device
        model = GPT(GPTConfig(args.vocab, args.seq_len, args.layers, args.hidden, args.heads))
    model.train()
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    precision = "bf16-mixed" if args.dtype == "bf16" else "fp32"
    print(
        f"gpu_train: {n_params / 1e6:.1f}M parameters, {args.layers} layers, hidden "
        f"{args.hidden}, {args.heads} heads, vocab {args.vocab}, batch {args.batch} x "
        f"{args.seq_len}, {args.dtype}, {args.optimizer}, {args.steps} steps on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        flush=True,
    )

    handle = stepwatch.watch(
        model,
        optimizer,
        job_id=args.job_id,
        endpoint=args.endpoint,
        precision=precision,
    )
    ident = stepwatch.resolve_identity(job_id=args.job_id)
    print(
        f"gpu_train: stepwatch job {ident.job_id} rank {ident.rank}, endpoint "
        f"{stepwatch.stats()['endpoint']}",
        flush=True,
    )

    autocast = torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"
    )
    steps: list[dict[str, Any]] = []
    for step in range(1, args.steps + 1):
        sync(device)
        t0 = time.perf_counter()
        x = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
        y = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), y.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        del logits, loss, x, y
        sync(device)
        dt = time.perf_counter() - t0
        mem = memory(device)
        steps.append({"step": step, "seconds": round(dt, 6), "loss": loss_value, **mem})
        print(f"step {step:3d}  {dt:8.3f} s  loss {loss_value:8.4f}{fmt_memory(mem)}", flush=True)

    flushed = stepwatch.flush(args.flush_timeout)
    stats = stepwatch.stats()
    print(f"stepwatch.flush({args.flush_timeout}) -> {flushed}")
    print("stepwatch.stats(): " + json.dumps(stats, sort_keys=True, default=str))
    pred = stepwatch.last_prediction()
    if pred is None:
        print("stepwatch.last_prediction(): none")
    else:
        print(f"stepwatch.last_prediction(): {pred}")
    if not stats.get("connects"):
        print(
            "gpu_train: WARNING: the client never reached the agent at "
            f"{stats.get('endpoint')}; no markers were delivered",
            file=sys.stderr,
        )
    summary = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": n_params,
        "args": vars(args),
        "job_id": ident.job_id,
        "rank": ident.rank,
        "pid": os.getpid(),
        "steps": steps,
        "flushed": flushed,
        "stats": stats,
        "last_prediction": None if pred is None else vars(pred),
    }
    print("summary: " + json.dumps(summary, sort_keys=True, default=str), flush=True)
    handle.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
