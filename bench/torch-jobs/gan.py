"""Train a DCGAN-style GAN on random images, one GPU (or the CPU): two models, two optimizers.

A generator (transposed convolutions with BatchNorm, from a latent vector to a
``--image-size`` image) and a discriminator (strided convolutions with
BatchNorm), each with its own Adam (betas 0.5, 0.999). Each step: the
discriminator on a real batch and on a detached fake batch, its optimizer
step; then the generator through the discriminator, its optimizer step. Both
models sit in one ``nn.ModuleDict`` that stepwatch watches with both optimizers
(``stepwatch.watch(gan, [opt_d, opt_g])``). cuDNN is off (the fake CUDA stack
has none). Prints ``step N done`` after each generator step.
"""

from __future__ import annotations

from typing import Optional

import stepwatch
import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch import nn

import common


def generator(latent: int, width: int, size: int) -> nn.Sequential:
    ups = size.bit_length() - 3  # 4x4 -> size x size
    layers: list[nn.Module] = [
        nn.ConvTranspose2d(latent, width * 2 ** (ups - 1), 4, 1, 0, bias=False),
        nn.BatchNorm2d(width * 2 ** (ups - 1)),
        nn.ReLU(True),
    ]
    for i in range(ups - 1, 0, -1):
        layers += [
            nn.ConvTranspose2d(width * 2**i, width * 2 ** (i - 1), 4, 2, 1, bias=False),
            nn.BatchNorm2d(width * 2 ** (i - 1)),
            nn.ReLU(True),
        ]
    layers += [nn.ConvTranspose2d(width, 3, 4, 2, 1, bias=False), nn.Tanh()]
    return nn.Sequential(*layers)


def discriminator(width: int, size: int) -> nn.Sequential:
    downs = size.bit_length() - 3
    layers: list[nn.Module] = [nn.Conv2d(3, width, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True)]
    for i in range(downs - 1):
        layers += [
            nn.Conv2d(width * 2**i, width * 2 ** (i + 1), 4, 2, 1, bias=False),
            nn.BatchNorm2d(width * 2 ** (i + 1)),
            nn.LeakyReLU(0.2, True),
        ]
    layers += [nn.Conv2d(width * 2 ** (downs - 1), 1, 4, 1, 0, bias=False), nn.Flatten()]
    return nn.Sequential(*layers)


def main(argv: Optional[list[str]] = None) -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    common.add_image_args(
        p, batch=64, image_size=128, width=64, image_size_help="a power of 2, at least 16"
    )
    p.add_argument("--latent", type=int, default=128, help="latent vector size")
    args = p.parse_args(argv)
    s = args.image_size
    if s < 16 or s & (s - 1) or min(args.steps, args.batch, args.latent, args.width) < 1:
        p.error("--image-size must be a power of 2 >= 16, sizes at least 1")

    torch.backends.cudnn.enabled = False
    device = common.setup_device(args.device)
    torch.manual_seed(args.seed)
    with device:
        gan = nn.ModuleDict(
            {"g": generator(args.latent, args.width, s), "d": discriminator(args.width, s)}
        )
    lr = args.lr or 2e-4
    opt_d = torch.optim.Adam(gan["d"].parameters(), lr=lr, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gan["g"].parameters(), lr=lr, betas=(0.5, 0.999))
    n_g = sum(p.numel() for p in gan["g"].parameters())
    n_d = sum(p.numel() for p in gan["d"].parameters())
    print(
        f"gan: G {n_g / 1e6:.1f}M, D {n_d / 1e6:.1f}M parameters, two Adam, "
        f"batch {args.batch} x 3 x {s}^2 on {device}",
        flush=True,
    )

    stepwatch.watch(gan, [opt_d, opt_g])

    g, d = gan["g"], gan["d"]
    gan.train()
    for _ in common.steps(args.steps):
        real = torch.randn(args.batch, 3, s, s).to(device, non_blocking=True)
        ones = torch.ones(args.batch, 1, device=device)
        zeros = torch.zeros(args.batch, 1, device=device)
        fake = g(torch.randn(args.batch, args.latent, 1, 1, device=device))
        # Discriminator: real as real, fake (detached) as fake.
        loss_d = F.binary_cross_entropy_with_logits(d(real), ones)
        loss_d = loss_d + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros)
        opt_d.zero_grad(set_to_none=True)
        loss_d.backward()
        opt_d.step()
        # Generator: fake as real, through the updated discriminator.
        loss_g = F.binary_cross_entropy_with_logits(d(fake), ones)
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()


if __name__ == "__main__":
    main()
