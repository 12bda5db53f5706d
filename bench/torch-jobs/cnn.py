"""Train a ResNet-18-style CNN with BatchNorm on random images, one GPU (or the CPU).

Images are made on the host and copied to the device each step, as a data
loader would hand them over; SGD with momentum by default. cuDNN is turned off
(``torch.backends.cudnn.enabled = False``): the fake CUDA stack has no working
cuDNN, so convolutions use PyTorch's native kernels. Prints ``step N done``
after each optimizer step.
"""

from __future__ import annotations

from typing import Optional

import torch

import common
from models import ResNet


def main(argv: Optional[list[str]] = None) -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    common.add_image_args(p, batch=128, image_size=224, classes=1000, width=64)
    p.add_argument("--blocks", default="2,2,2,2", help="BasicBlocks per stage (2,2,2,2: ResNet-18)")
    common.add_optimizer_arg(p, default="sgd-momentum")
    common.add_precision_arg(p)
    args = p.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    if min([args.steps, args.batch, args.image_size, args.classes, args.width, *blocks]) < 1:
        p.error("sizes must be at least 1")

    torch.backends.cudnn.enabled = False
    detail = f"{args.optimizer}, {args.precision}, batch {args.batch} x 3 x {args.image_size}^2"
    model, optimizer, device = common.start_job(
        "cnn", args, lambda: ResNet(classes=args.classes, width=args.width, blocks=blocks), detail
    )

    common.train_on_images(args, model, optimizer, device)


if __name__ == "__main__":
    main()
