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

import sys
from typing import Dict, List, Optional

import stepwatch
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from common import parser


class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = torch.randint(self.vocab, (self.seq_len,))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main(argv: Optional[List[str]] = None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=768, help="model width")
    p.add_argument("--heads", type=int, default=12, help="attention heads")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size")
    p.add_argument(
        "--mixed-precision", choices=["no", "bf16"], default="bf16", help="Accelerator's"
    )
    args = p.parse_args(argv)
    if min(args.steps, args.layers, args.hidden, args.batch) < 1 or args.hidden % args.heads:
        p.error("sizes must be at least 1, --hidden a multiple of --heads")

    if args.device == "cuda":
        # The fake CUDA stack has no working cuDNN: keep SDPA on flash / memory-efficient.
        torch.backends.cuda.enable_cudnn_sdp(False)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=args.device == "cpu")
    torch.manual_seed(args.seed)
    with accelerator.device:
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=args.vocab,
                n_positions=args.seq_len,
                n_embd=args.hidden,
                n_layer=args.layers,
                n_head=args.heads,
                attn_implementation="sdpa",
            )
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-4, weight_decay=0.01)
    loader = DataLoader(
        RandomTokens(args.steps * args.batch, args.seq_len, args.vocab), batch_size=args.batch
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
