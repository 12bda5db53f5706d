"""Train a UNet-like convolution/upsampling network on random images, one GPU (or the CPU).

An encoder of double 3x3 convolutions with BatchNorm and max-pooling, a
bottleneck, and a decoder that upsamples with ``ConvTranspose2d`` and
concatenates the encoder's feature map at each level (skip connections), as in
a segmentation or diffusion UNet; per-pixel cross-entropy over ``--classes``
classes. Images and masks are made on the host and copied each step; Adam by
default. cuDNN is off (the fake CUDA stack has none): PyTorch's native
convolution kernels. Prints ``step N done`` after each optimizer step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch import nn

import common


def double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, classes: int, width: int, depth: int) -> None:
        super().__init__()
        chans = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        cin = 3
        for c in chans[:-1]:
            self.down.append(double_conv(cin, c))
            cin = c
        self.bottom = double_conv(chans[-2], chans[-1])
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for c_hi, c_lo in zip(reversed(chans[1:]), reversed(chans[:-1])):
            self.up.append(nn.ConvTranspose2d(c_hi, c_lo, 2, stride=2))
            self.dec.append(double_conv(2 * c_lo, c_lo))
        self.head = nn.Conv2d(chans[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def main(argv: Optional[list[str]] = None) -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    common.add_image_args(p, batch=8, image_size=256, classes=21, width=32)
    p.add_argument("--depth", type=int, default=4, help="down-sampling levels")
    common.add_optimizer_arg(p, default="adamw")
    common.add_precision_arg(p)
    args = p.parse_args(argv)
    if min(args.steps, args.batch, args.classes, args.width, args.depth) < 1:
        p.error("sizes must be at least 1")
    if args.image_size % 2**args.depth:
        p.error("--image-size must be a multiple of 2**--depth")

    torch.backends.cudnn.enabled = False
    detail = f"{args.optimizer}, {args.precision}, batch {args.batch} x 3 x {args.image_size}^2"
    model, optimizer, device = common.start_job(
        "unet", args, lambda: UNet(args.classes, args.width, args.depth), detail
    )

    common.train_on_images(args, model, optimizer, device, per_pixel=True)


if __name__ == "__main__":
    main()
