"""Training loops that run out of GPU memory long after step 2, each for its own
reason, watched by stepwatch as a user would (``stepwatch.watch``):

    python oom_loops.py leak     # a running loss summed as a tensor (total_loss += loss)
    python oom_loops.py list     # predictions kept in a Python list of device tensors
    python oom_loops.py ratchet  # a growing buffer beside a small tensor kept each step
    python oom_loops.py steady   # none of it: the control
    python oom_loops.py evalbatch  # an evaluation on a larger batch before step 16 does not fit

``--steps`` bounds the loop (default: until it dies). Prints ``step N done
<CLOCK_MONOTONIC ns>`` after each step; nothing catches the OOM.
"""

from __future__ import annotations

import argparse
import time

import stepwatch
import torch

MIB = 1 << 20
EVAL_BATCH = 65536  # evalbatch: the whole validation set in one batch

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["leak", "list", "ratchet", "steady", "evalbatch"])
p.add_argument("--steps", type=int, default=1_000_000)
p.add_argument("--width", type=int, default=1024)
p.add_argument("--batch", type=int, default=256)
p.add_argument("--ratchet-base-mib", type=int, default=32)
p.add_argument("--eval-before-step", type=int, default=16)
args = p.parse_args()

torch.manual_seed(0)
w = args.width
with torch.device("cuda"):
    model = torch.nn.Sequential(
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU()
    )
opt = torch.optim.AdamW(model.parameters(), foreach=True)
stepwatch.watch(model, opt)
loss_fn = torch.nn.MSELoss()
x_val = torch.randn(args.batch, w, device="cuda")
total_loss = torch.zeros((), device="cuda")
kept = []
pins = []
x_eval = torch.randn(EVAL_BATCH, w, device="cuda") if args.mode == "evalbatch" else None
for step in range(1, args.steps + 1):
    if x_eval is not None and step == args.eval_before_step:
        # The whole validation set in one batch under torch.no_grad(): its
        # activations do not fit beside the training state.
        print(f"eval begin {time.monotonic_ns()}", flush=True)
        model.eval()
        with torch.no_grad():
            model(x_eval).square().mean().item()
        model.train()
    x = torch.randn(args.batch, w, device="cuda")
    if args.mode == "leak":
        # The validation loss for the log, summed as a tensor (no .item(), no
        # torch.no_grad()): each step's graph, with the activations it saved,
        # stays alive in total_loss.
        total_loss += loss_fn(model(x_val), x_val)
    out = model(x)
    if args.mode == "list":
        kept.append(out.detach())  # predictions kept for an epoch metric
    if args.mode == "ratchet":
        # A buffer sized by the step's data (it grows, as sequence lengths
        # may): it fits no cached block, so it takes a new segment; a small
        # tensor made after it is carved from that segment's end and kept,
        # so no segment is ever free to give back.
        n = (args.ratchet_base_mib + 2 * step) * MIB
        buf = torch.empty(n + 2 * MIB, dtype=torch.uint8, device="cuda")
        del buf
        buf = torch.empty(n, dtype=torch.uint8, device="cuda")
        pins.append(torch.empty(2 * MIB, dtype=torch.uint8, device="cuda"))
        del buf
    loss_fn(out, x).backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} done {time.monotonic_ns()}", flush=True)
