"""Train a GPT-like model sharded with FSDP (v1, ``FullyShardedDataParallel``), one GPU per rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 fsdp1.py [flags]

The classic wrapper: ``FullyShardedDataParallel(model, auto_wrap_policy=...)``
with each transformer block its own FSDP unit (``ModuleWrapPolicy``), FULL_SHARD,
flat parameters (``use_orig_params=False``), ``device_id`` set, and with
``--precision bf16-mixed`` ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``.
The optimizer is made after wrapping, over the sharded flat parameters. NCCL on
CUDA, gloo with ``--device cpu``. Rank 0 prints ``step N done`` after each
optimizer step.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import common
from models import Block


def main(argv: Optional[list[str]] = None) -> None:
    p = common.gpt_parser(__doc__.split("\n\n")[0], layers=8, hidden=768)
    common.add_mixed_precision_arg(
        p, "MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=bf16)"
    )
    args = p.parse_args(argv)
    common.check_args(p, args)
    # FSDP v1 is deprecated in favour of fully_shard; the job is here because it is
    # still what many scripts run.
    warnings.filterwarnings("ignore", category=FutureWarning)

    rank, world, device = common.init_distributed(args.device)
    model = common.gpt_model(args, device)
    mp = None
    if args.precision == "bf16-mixed":
        mp = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
        )
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=mp,
        device_id=device,
    )
    common.train_sharded_gpt("fsdp1", args, model, rank, world, device, local_shards=True)


if __name__ == "__main__":
    main()
