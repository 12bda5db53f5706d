"""A GPT-2 from a config trained in an ``accelerate`` loop, one GPU (or the CPU).

``Accelerator(mixed_precision=...)``, a ``DataLoader`` of random token
sequences, ``model, optimizer, loader, scheduler = accelerator.prepare(...)``,
then per step ``out = model(**batch)``, ``accelerator.backward(out.loss)``,
``accelerator.clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``,
``optimizer.zero_grad()``. stepwatch watches the prepared model and the
``AcceleratedOptimizer``. With bf16, accelerate runs the forward under
autocast and converts the outputs to fp32. Prints ``step N done`` after each
optimizer step.
"""

from __future__ import annotations

from typing import Optional

import stepwatch
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

import common
import hf_models


def main(argv: Optional[list[str]] = None) -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    common.add_gpt_args(p, layers=8, batch=8, vocab=50257)
    p.add_argument(
        "--mixed-precision", choices=["no", "bf16"], default="bf16", help="Accelerator's"
    )
    args = p.parse_args(argv)
    common.check_args(p, args)

    if args.device == "cuda":
        # The fake CUDA stack has no working cuDNN: keep SDPA on flash / memory-efficient.
        torch.backends.cuda.enable_cudnn_sdp(False)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=args.device == "cpu")
    torch.manual_seed(args.seed)
    with accelerator.device:
        model = hf_models.gpt2(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-4, weight_decay=0.01)
    loader = DataLoader(
        common.RandomTokens(args.steps * args.batch, args.seq_len, args.vocab, attention_mask=True),
        batch_size=args.batch,
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, 1, args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"accelerate_loop: gpt2 {n_params / 1e6:.1f}M parameters, AdamW,"
        f" mixed precision {args.mixed_precision}, batch {args.batch} x {args.seq_len}"
        f" on {accelerator.device}",
        flush=True,
    )

    stepwatch.watch(model, optimizer)

    model.train()
    for step, batch in enumerate(loader, start=1):
        out = model(**batch)
        accelerator.backward(out.loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        print(f"step {step} done", flush=True)


if __name__ == "__main__":
    main()
