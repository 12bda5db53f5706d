"""Train a GPT-like model with Lightning's Trainer on random tokens, one GPU (or the CPU).

A ``LightningModule`` around the shared GPT model, a ``DataLoader`` of random
token sequences, ``Trainer(max_steps=--steps)``; stepwatch comes in as
Lightning's ``StepwatchCallback``. The model is built under
``trainer.init_module()``, directly on the device. Prints ``step N done``
after each optimizer step.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import lightning as L  # noqa: N812 (the usual spelling)
import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from stepwatch.lightning import StepwatchCallback
from torch.utils.data import DataLoader, Dataset

import common
from models import GPT


class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(self.vocab, (self.seq_len + 1,))
        return t[:-1], t[1:]


class LitGPT(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = GPT(common.gpt_config(args))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return common.make_optimizer(self.args.optimizer, self.parameters(), self.args.lr)


class PrintSteps(L.Callback):
    """``step N done`` after each optimizer step (global_step counts them)."""

    def __init__(self) -> None:
        self.last = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.last:
            self.last = trainer.global_step
            print(f"step {self.last} done", flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    p = common.gpt_parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--precision", choices=["32-true", "bf16-mixed"], default="bf16-mixed", help="Trainer"
    )
    p.add_argument("--grad-accum", type=int, default=1, help="accumulate_grad_batches")
    args = p.parse_args(argv)
    common.check_args(p, args)

    if args.device == "cuda":
        # The fake CUDA stack has no working cuDNN: keep SDPA on flash / memory-efficient.
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.set_float32_matmul_precision("high")
    L.seed_everything(args.seed, verbose=False)
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        precision=args.precision,
        max_steps=args.steps,
        accumulate_grad_batches=args.grad_accum,
        callbacks=[StepwatchCallback(), PrintSteps()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module():
        module = LitGPT(args)
    data = DataLoader(
        RandomTokens(args.steps * args.grad_accum * args.batch, args.seq_len, args.vocab),
        batch_size=args.batch,
        num_workers=0,
    )
    n_params = sum(p.numel() for p in module.parameters())
    print(
        f"lightning_gpt: {n_params / 1e6:.1f}M parameters, {args.optimizer}, {args.precision}, "
        f"{args.grad_accum} x {args.batch} x {args.seq_len} tokens per step",
        flush=True,
    )
    trainer.fit(module, data)


if __name__ == "__main__":
    main()
