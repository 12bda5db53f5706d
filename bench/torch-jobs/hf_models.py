"""Hugging Face language models the jobs make from a config (no download), with SDPA
attention, sized by the jobs' ``--layers --hidden --heads --seq-len --vocab``."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def gpt2(args: argparse.Namespace, **config: Any) -> GPT2LMHeadModel:
    """A GPT-2; ``config``: more ``GPT2Config`` fields."""
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=args.vocab,
            n_positions=args.seq_len,
            n_embd=args.hidden,
            n_layer=args.layers,
            n_head=args.heads,
            attn_implementation="sdpa",
            **config,
        )
    )


def llama(args: argparse.Namespace, intermediate: Optional[int] = None) -> LlamaForCausalLM:
    """A Llama with multi-head attention; its MLP ``intermediate`` wide, by default about
    8/3 of ``--hidden`` rounded up to a multiple of 64."""
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=intermediate or (8 * args.hidden // 3 + 63) // 64 * 64,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
            max_position_embeddings=args.seq_len,
            attn_implementation="sdpa",
        )
    )
