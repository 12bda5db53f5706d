"""Train a ResNet-18-style CNN with BatchNorm on random images, one GPU (or the CPU).

Images are made on the host and copied to the device each step, as a data
loader would hand them over; SGD with momentum by default. cuDNN is turned off
(``torch.backends.cudnn.enabled = False``): the fake CUDA stack has no working
cuDNN, so convolutions use PyTorch's native kernels. Prints ``step N done``
after each optimizer step.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import stepwatch
import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)

from common import (
    add_optimizer_arg,
    add_precision_arg,
    autocast,
    build_model,
    parser,
    setup_device,
)
from models import ResNet


def main(argv: Optional[List[str]] = None) -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=128, help="images per step")
    p.add_argument("--image-size", type=int, default=224, help="height and width")
    p.add_argument("--classes", type=int, default=1000, help="output classes")
    p.add_argument("--width", type=int, default=64, help="channels of the first stage")
    p.add_argument("--blocks", default="2,2,2,2", help="BasicBlocks per stage (2,2,2,2: ResNet-18)")
    add_optimizer_arg(p, default="sgd-momentum")
    add_precision_arg(p)
    args = p.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    if min([args.steps, args.batch, args.image_size, args.classes, args.width, *blocks]) < 1:
        p.error("sizes must be at least 1")

    torch.backends.cudnn.enabled = False
    device = setup_device(args.device)
    model, optimizer = build_model(
        "cnn",
        args,
        device,
        lambda: ResNet(classes=args.classes, width=args.width, blocks=blocks),
        f"{args.optimizer}, {args.precision}, batch {args.batch} x 3 x {args.image_size}^2",
    )

    stepwatch.watch(model, optimizer)

    amp = autocast(device, args.precision)
    model.train()
    for step in range(1, args.steps + 1):
        images = torch.randn(args.batch, 3, args.image_size, args.image_size)
        labels = torch.randint(args.classes, (args.batch,))
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with amp:
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
