"""Training loops whose memory after step 2 has a shape of its own, watched by
stepwatch as a user would (``stepwatch.watch``, ``stepwatch.checkpoint``):

    python batch_pass_loops.py varlen     # variable-length batches, one long one late
    python batch_pass_loops.py passes     # an evaluation every 5 steps, then a checkpoint
    python batch_pass_loops.py warmup     # step 1 a smaller warm-up batch than the rest

``varlen`` with ``$VARLEN_HOLD_BEFORE_LONG`` set to a path: before the long
step, flush stepwatch's markers, print ``holding`` and wait (at most 120 s)
until that path exists, so that a test can read what the agent says then;
``$VARLEN_LONG_LENGTH``: the long batch's length instead of 1024.

Prints ``step N done <CLOCK_MONOTONIC ns>`` after each step, and
``eval begin|end <ns>`` / ``checkpoint begin|end <ns>`` around each pass, for
the test to read fake CUDA's usage log by; ``warmup`` also prints ``step N
backward <ns>`` before each backward and ``advisory <kind> <ns> <predicted
peak bytes>`` when an advisory reaches the process.
"""

from __future__ import annotations

import io
import os
import random
import sys
import time

import stepwatch
import torch

STEPS = 40
BATCH = 8  # samples per training step
LONG_STEP, LONG_LENGTH = 30, 1024  # varlen: the loader's longest batch, late
EVERY, EVAL_BATCH = 5, 16384  # passes: an evaluation every 5 steps, on 16384 samples

WARMUP_STEPS, WARMUP_BATCH, FULL_BATCH = 4, 256, 4096  # warmup: step 1's batch, the rest's

mode = sys.argv[1]
assert mode in ("varlen", "passes", "warmup"), mode


def now() -> int:
    return time.monotonic_ns()


torch.manual_seed(0)
if mode == "varlen":
    # A language model on padded batches of 64-256 tokens per sequence;
    # step LONG_STEP draws one of LONG_LENGTH (the loader's longest).
    vocab, width = 8192, 256
    with torch.device("cuda"):
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab))
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(
        model,
        opt,
        largest_batch=dict(samples=BATCH, tokens=BATCH * LONG_LENGTH),
    )
    lengths = random.Random(0)
    hold = os.environ.get("VARLEN_HOLD_BEFORE_LONG")
    for step in range(1, STEPS + 1):
        if step == LONG_STEP and hold:
            stepwatch.flush(10)
            print("holding", flush=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.05)
        long = int(os.environ.get("VARLEN_LONG_LENGTH", LONG_LENGTH))
        n = long if step == LONG_STEP else lengths.randint(64, 256)
        ids = torch.randint(0, vocab, (BATCH, n), device="cuda")
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} done {now()} tokens {ids.numel()}", flush=True)
elif mode == "warmup":
    # An MLP whose step 1 is a warm-up on WARMUP_BATCH samples, the steps
    # after it on FULL_BATCH; each logs its loss after the forward (which
    # waits for the forward's kernels), as loops do, before its backward.
    width = 1024
    with torch.device("cuda"):
        model = torch.nn.Sequential(
            *[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
        )
    opt = torch.optim.AdamW(model.parameters(), foreach=True)

    def told(p: stepwatch.Prediction) -> None:
        print(f"advisory {p.kind} {now()} {p.predicted_peak_bytes}", flush=True)

    stepwatch.watch(model, opt, on_advisory=told)
    for step in range(1, WARMUP_STEPS + 1):
        x = torch.randn(WARMUP_BATCH if step == 1 else FULL_BATCH, width, device="cuda")
        loss = torch.nn.functional.mse_loss(model(x), x)
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        print(f"step {step} backward {now()}", flush=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} done {now()}", flush=True)
else:
    # An MLP; before step 1 and after every EVERY steps an evaluation on a
    # large batch (EVAL_BATCH) under torch.no_grad(), then a checkpoint of a
    # device copy of the model and optimizer state.
    width = 1024
    with torch.device("cuda"):
        model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
        )
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(model, opt)
    x_eval = torch.randn(EVAL_BATCH, width, device="cuda")

    def evaluate() -> None:
        print(f"eval begin {now()}", flush=True)
        model.eval()
        with torch.no_grad():
            model(x_eval).square().mean().item()
        model.train()
        print(f"eval end {now()}", flush=True)

    def save() -> None:
        print(f"checkpoint begin {now()}", flush=True)
        with stepwatch.checkpoint():
            state = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "opt": opt.state_dict(),
            }
            torch.save(state, io.BytesIO())
            del state
        print(f"checkpoint end {now()}", flush=True)

    evaluate()  # a sanity check before training
    for step in range(1, STEPS + 1):
        x = torch.randn(BATCH, width, device="cuda")
        torch.nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} done {now()}", flush=True)
        if step % EVERY == 0:
            evaluate()
            save()
