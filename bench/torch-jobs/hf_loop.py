"""A Hugging Face model from a config in a custom training loop, one GPU (or the CPU).

The loop most fine-tuning scripts have: a batch dict moved to the device,
``out = model(**batch)`` (a ``ModelOutput`` with the loss, kept in ``out`` until
the next step's forward returns), ``out.loss.backward()``, optional
``clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``,
``optimizer.zero_grad(set_to_none=True)``. ``--model`` picks the architecture,
each made from a small config with random weights (no download): ``gpt2``,
``llama`` (causal LM), ``t5`` (encoder-decoder), ``bert-mlm``, ``bert-cls``
(encoder: masked LM, sequence classification), ``vit`` (image classification).
``--lora R`` freezes the whole base model and trains hand-written LoRA adapters
(rank R) on the attention projections, as PEFT does; ``--freeze-embeddings``
freezes the embeddings only; ``--param-groups`` splits weight decay from biases
and norms; ``--optimizer adafactor-hf`` is ``transformers.optimization.Adafactor``
with its T5 defaults; ``--eval-every K`` runs an evaluation batch under
``model.eval()`` and ``torch.no_grad()`` after every K-th step. cuDNN is off
(the fake CUDA stack has none). Prints ``step N done`` after each optimizer step.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Optional

import stepwatch
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
    get_linear_schedule_with_warmup,
)
from transformers.optimization import Adafactor

import common
import hf_models

MODELS = ("gpt2", "llama", "t5", "bert-mlm", "bert-cls", "vit")
# The projections LoRA adapts, per architecture (PEFT's default target modules).
LORA_TARGETS = {
    "gpt2": ("c_attn",),
    "llama": ("q_proj", "v_proj"),
    "t5": ("q", "v"),
    "bert-mlm": ("query", "value"),
    "bert-cls": ("query", "value"),
    "vit": ("q_proj", "v_proj", "query", "value"),
}


class LoRALinear(nn.Module):
    """``base(x) + B(A(dropout(x))) * alpha / r`` with the base frozen, B zero at the start."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.05) -> None:
        super().__init__()
        # nn.Linear, or GPT-2's Conv1D (weight stored as in x out).
        out_f, in_f = base.weight.shape
        if type(base).__name__ == "Conv1D":
            in_f, out_f = out_f, in_f
        self.base = base
        self.dropout = nn.Dropout(dropout)
        self.lora_a = nn.Linear(in_f, r, bias=False)
        self.lora_b = nn.Linear(r, out_f, bias=False)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scale


def add_lora(model: nn.Module, targets: tuple, r: int) -> int:
    """Freeze every parameter of ``model``, then wrap each target projection in a
    ``LoRALinear`` (trainable). Returns how many projections were wrapped."""
    model.requires_grad_(False)
    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and hasattr(child, "weight"):
                lora = LoRALinear(child, r, alpha=2.0 * r)
                lora.to(device=child.weight.device)
                setattr(module, name, lora)
                n += 1
    return n


def make_model(args: argparse.Namespace) -> PreTrainedModel:
    attn = {"attn_implementation": "sdpa"}
    if args.model == "gpt2":
        return hf_models.gpt2(args)
    if args.model == "llama":
        return hf_models.llama(args)
    if args.model == "t5":
        return T5ForConditionalGeneration(
            T5Config(
                vocab_size=args.vocab,
                d_model=args.hidden,
                d_kv=args.hidden // args.heads,
                d_ff=4 * args.hidden,
                num_layers=args.layers,
                num_decoder_layers=args.layers,
                num_heads=args.heads,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        )
    if args.model in ("bert-mlm", "bert-cls"):
        cfg = BertConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=max(512, args.seq_len),
            num_labels=2,
            **attn,
        )
        cls = BertForMaskedLM if args.model == "bert-mlm" else BertForSequenceClassification
        return cls(cfg)
    return ViTForImageClassification(
        ViTConfig(
            image_size=args.image_size,
            patch_size=16,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            intermediate_size=4 * args.hidden,
            num_labels=1000,
            **attn,
        )
    )


def make_batch(args: argparse.Namespace, batch: int, device: torch.device) -> dict[str, Any]:
    """A random batch as a collator makes it, on the host, then moved to the device."""
    b, t, v = batch, args.seq_len, args.vocab
    if args.model in ("gpt2", "llama"):
        ids = torch.randint(v, (b, t))
        out = {"input_ids": ids, "attention_mask": torch.ones(b, t, dtype=torch.long)}
        out["labels"] = ids.clone()
    elif args.model == "t5":
        out = {
            "input_ids": torch.randint(1, v, (b, t)),
            "attention_mask": torch.ones(b, t, dtype=torch.long),
            "labels": torch.randint(1, v, (b, args.target_len)),
        }
    elif args.model == "bert-mlm":
        ids = torch.randint(v, (b, t))
        labels = torch.full((b, t), -100, dtype=torch.long)
        masked = torch.rand(b, t) < 0.15
        labels[masked] = ids[masked]
        ids[masked] = 103  # [MASK]
        out = {"input_ids": ids, "attention_mask": torch.ones(b, t, dtype=torch.long)}
        out["labels"] = labels
    elif args.model == "bert-cls":
        out = {
            "input_ids": torch.randint(v, (b, t)),
            "attention_mask": torch.ones(b, t, dtype=torch.long),
            "labels": torch.randint(2, (b,)),
        }
    else:
        s = args.image_size
        out = {"pixel_values": torch.randn(b, 3, s, s), "labels": torch.randint(1000, (b,))}
    return {k: t.to(device, non_blocking=True) for k, t in out.items()}


def evaluate(model: nn.Module, args: argparse.Namespace, device: torch.device, amp: Any) -> float:
    model.eval()
    with torch.no_grad(), amp:
        out = model(**make_batch(args, args.batch, device))
    model.train()
    return float(out.loss)


def main(argv: Optional[list[str]] = None) -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="gpt2", help="architecture")
    # --layers: t5 has that many in each of encoder and decoder; --batch: vit's are images.
    common.add_gpt_args(p, layers=6, batch=8, vocab=50257)
    p.add_argument("--target-len", type=int, default=128, help="t5: label tokens")
    p.add_argument("--image-size", type=int, default=224, help="vit: height and width")
    p.add_argument(
        "--optimizer",
        choices=[*common.OPTIMIZERS, "adafactor-hf"],
        default="adamw",
        help="as the other jobs; adafactor-hf: transformers' Adafactor (relative step)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16-autocast"],
        default="fp32",
        help="bf16-autocast: fp32 weights, forward under torch.autocast(bfloat16)",
    )
    p.add_argument("--lora", type=int, default=0, metavar="R", help="frozen base, LoRA rank R")
    p.add_argument("--freeze-embeddings", action="store_true", help="embeddings frozen")
    p.add_argument(
        "--param-groups", action="store_true", help="no weight decay on biases and LayerNorms"
    )
    p.add_argument(
        "--scheduler", action="store_true", help="get_linear_schedule_with_warmup (1 step)"
    )
    p.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ to this norm")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate after every K-th step")
    args = p.parse_args(argv)
    common.check_args(p, args)

    # The fake CUDA stack has no working cuDNN (ViT's patch embedding is a convolution).
    torch.backends.cudnn.enabled = False
    device = common.setup_device(args.device)
    torch.manual_seed(args.seed)
    with device:
        model = make_model(args)
    if args.lora:
        wrapped = add_lora(model, LORA_TARGETS[args.model], args.lora)
        if not wrapped:
            p.error(f"no LoRA target in {args.model}")
    if args.freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
        for name, module in model.named_modules():
            if name.endswith("embeddings") or name.endswith("wpe"):
                module.requires_grad_(False)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if args.param_groups:
        no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "ln_", "norm")
        params: Any = [
            {
                "params": [p for n, p in trainable if not any(k in n for k in no_decay)],
                "weight_decay": 0.01,
            },
            {
                "params": [p for n, p in trainable if any(k in n for k in no_decay)],
                "weight_decay": 0.0,
            },
        ]
    else:
        params = [p for _, p in trainable]
    if args.optimizer == "adafactor-hf":
        optimizer: torch.optim.Optimizer = Adafactor(
            params, lr=None, scale_parameter=True, relative_step=True, warmup_init=False
        )
    else:
        optimizer = common.make_optimizer(args.optimizer, params, args.lr)
    scheduler = None
    if args.scheduler:
        scheduler = get_linear_schedule_with_warmup(optimizer, 1, args.steps)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for _, p in trainable)
    print(
        f"hf_loop: {args.model} {n_params / 1e6:.1f}M parameters ({n_train / 1e6:.2f}M trained),"
        f" {args.optimizer}, {args.precision}, batch {args.batch} on {device}",
        flush=True,
    )

    stepwatch.watch(model, optimizer)

    amp = common.autocast(device, args.precision)
    model.train()
    for step in common.steps(args.steps):
        batch = make_batch(args, args.batch, device)
        with amp:
            out = model(**batch)
        out.loss.backward()
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if args.eval_every and step % args.eval_every == 0:
            print(f"eval after step {step}: loss {evaluate(model, args, device, amp):.3f}")


if __name__ == "__main__":
    main()
