"""Train an LSTM language model on random tokens, one GPU (or the CPU).

The classic word-level model (an embedding, a multi-layer ``nn.LSTM``,
dropout, a linear decoder tied to the embedding), trained with truncated
backpropagation through time: the hidden state is carried from batch to batch
and detached at each step. SGD with Nesterov momentum and
``clip_grad_norm_`` by default. cuDNN is off (the fake CUDA stack has none):
PyTorch's native LSTM cells. Prints ``step N done`` after each optimizer step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch import nn

import common


class LSTMLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, dropout=dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(hidden, vocab)
        self.decoder.weight = self.embed.weight  # tied

    def forward(
        self, idx: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        y, state = self.lstm(self.drop(self.embed(idx)), state)
        return self.decoder(self.drop(y)), state


def main(argv: Optional[list[str]] = None) -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    # --seq-len: the BPTT length; --vocab: WikiText-2's (WikiText-103's is 267k).
    common.add_gpt_args(p, layers=2, hidden=1024, heads=None, seq_len=128, batch=32, vocab=33278)
    p.add_argument("--clip", type=float, default=0.25, help="clip_grad_norm_ (0: none)")
    common.add_optimizer_arg(p, default="sgd-nesterov")
    args = p.parse_args(argv)
    common.check_args(p, args)

    torch.backends.cudnn.enabled = False
    detail = f"{args.optimizer}, batch {args.batch} x {args.seq_len}"
    model, optimizer, device = common.start_job(
        "lstm_lm", args, lambda: LSTMLM(args.vocab, args.hidden, args.layers), detail
    )

    zeros = torch.zeros(args.layers, args.batch, args.hidden, device=device)
    state = (zeros, zeros.clone())
    model.train()
    for _ in common.steps(args.steps):
        t = torch.randint(args.vocab, (args.batch, args.seq_len + 1)).to(device)
        state = (state[0].detach(), state[1].detach())
        logits, state = model(t[:, :-1], state)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), t[:, 1:].reshape(-1))
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
