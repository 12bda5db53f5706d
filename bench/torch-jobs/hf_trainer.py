"""Train a small Llama (or GPT-2) from a config with Hugging Face's Trainer, one GPU (or the CPU).

The model is made from a ``LlamaConfig`` / ``GPT2Config`` in code (no
download), directly on the device, with SDPA attention; the data are random
token sequences. ``Trainer(max_steps=--steps)`` with its defaults otherwise
(fused AdamW, gradient clipping at 1.0, linear schedule), no saving, no
reporting, ``dataloader_num_workers=0``; stepwatch comes in as the Trainer
callback ``stepwatch.transformers.StepwatchCallback``. Prints ``step N done``
after each optimizer step.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any, Optional

import torch
from stepwatch.transformers import StepwatchCallback
from transformers import (
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import common
import hf_models


class PrintSteps(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"step {state.global_step} done", flush=True)


def make_model(args: argparse.Namespace) -> PreTrainedModel:
    if args.model == "gpt2":
        return hf_models.gpt2(args, bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)
    return hf_models.llama(args, args.intermediate)


def main(argv: Optional[list[str]] = None) -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama", help="architecture")
    p.add_argument("--layers", type=int, default=8, help="decoder layers")
    p.add_argument("--hidden", type=int, default=512, help="model width")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--intermediate", type=int, default=None, help="Llama MLP; default ~8/3 x")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: bf16=True")
    p.add_argument("--optim", default="adamw_torch_fused", help="TrainingArguments.optim")
    args = p.parse_args(argv)
    common.check_args(p, args)

    device = torch.device(args.device)
    if device.type == "cuda":
        # The fake CUDA stack has no working cuDNN: keep SDPA on flash / memory-efficient.
        torch.backends.cuda.enable_cudnn_sdp(False)
        device = torch.device("cuda", 0)
    torch.manual_seed(args.seed)
    with device:
        model = make_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"hf_trainer: {args.model} {n_params / 1e6:.1f}M parameters, {args.optim}, "
        f"{args.precision}, {args.grad_accum} x {args.batch} x {args.seq_len} tokens per step",
        flush=True,
    )

    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as out:
        training_args = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=args.lr or 3e-4,
            optim=args.optim,
            bf16=args.precision == "bf16",
            use_cpu=device.type == "cpu",
            seed=args.seed,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=common.RandomTokens(
                args.steps * args.grad_accum * args.batch, args.seq_len, args.vocab
            ),
            callbacks=[StepwatchCallback(), PrintSteps()],
        )
        trainer.train()


if __name__ == "__main__":
    main()
