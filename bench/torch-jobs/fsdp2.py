"""Train a GPT-like model sharded with FSDP2 (``fully_shard``), one GPU per rank (torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 4 fsdp2.py [flags]

Each transformer block is its own FSDP group, the root (embeddings, final
norm, tied LM head) another, as torchtitan does; parameters, gradients and
optimizer state are sharded over all ranks. ``--precision bf16-mixed``
gathers parameters in bf16 and reduces gradients in fp32
(``MixedPrecisionPolicy``). NCCL on CUDA, gloo with ``--device cpu``. Rank 0
prints ``step N done`` after each optimizer step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import common


def main(argv: Optional[list[str]] = None) -> None:
    p = common.gpt_parser(__doc__.split("\n\n")[0])
    common.add_mixed_precision_arg(p, "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    p.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="keep each block's gathered parameters from forward to backward",
    )
    args = p.parse_args(argv)
    common.check_args(p, args)

    rank, world, device = common.init_distributed(args.device)
    mesh = init_device_mesh(device.type, (world,))
    model = common.gpt_model(args, device)
    if args.precision == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    reshard = not args.no_reshard_after_forward
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    common.train_sharded_gpt("fsdp2", args, model, rank, world, device, local_shards=False)


if __name__ == "__main__":
    main()
