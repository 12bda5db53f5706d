"""Train an embedding-heavy recommender (DLRM-style) on random interactions, one GPU (or the CPU).

Categorical features look up rows of large embedding tables
(``nn.EmbeddingBag``, sum over a few ids per feature), dense features go
through a bottom MLP, the pairwise dot products of all feature vectors go
through a top MLP to one click logit (binary cross-entropy). Most parameters
are embedding rows, and their gradients are dense. Adagrad by default, whose
state (one accumulator per parameter) is made in its constructor, before step
1. Prints ``step N done`` after each optimizer step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch import nn

import common


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int, dense: int) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables)
        )
        self.bottom = mlp([dense, 512, 256, dim])
        n = tables + 1
        self.top = mlp([dim + n * (n - 1) // 2, 1024, 1024, 512, 256, 1])

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # ids: (batch, tables, ids per feature)
        x = self.bottom(dense)
        feats = [x] + [emb(ids[:, i]) for i, emb in enumerate(self.embeddings)]
        z = torch.stack(feats, dim=1)  # (batch, n, dim)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1, device=z.device)
        return self.top(torch.cat([x, inter[:, i, j]], dim=1)).squeeze(1)


def main(argv: Optional[list[str]] = None) -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8, help="categorical features (tables)")
    p.add_argument("--rows", type=int, default=400_000, help="rows per embedding table")
    p.add_argument("--dim", type=int, default=128, help="embedding width")
    p.add_argument("--dense", type=int, default=13, help="dense features")
    p.add_argument("--ids", type=int, default=4, help="ids per categorical feature")
    p.add_argument("--batch", type=int, default=8192, help="interactions per step")
    common.add_optimizer_arg(p, default="adagrad")
    args = p.parse_args(argv)
    if min(args.steps, args.tables, args.rows, args.dim, args.dense, args.ids, args.batch) < 1:
        p.error("sizes must be at least 1")

    detail = f"{args.tables} tables of {args.rows} rows, {args.optimizer}, batch {args.batch}"
    model, optimizer, device = common.start_job(
        "recsys", args, lambda: DLRM(args.tables, args.rows, args.dim, args.dense), detail
    )

    model.train()
    for _ in common.steps(args.steps):
        dense = torch.randn(args.batch, args.dense).to(device, non_blocking=True)
        ids = torch.randint(args.rows, (args.batch, args.tables, args.ids)).to(device)
        clicks = torch.randint(2, (args.batch,)).float().to(device)
        loss = F.binary_cross_entropy_with_logits(model(dense, ids), clicks)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
