"""The training job of the predicted-OOM tests (test_predicted_oom.py, and
deploy/slurm/test_slurm.py as a Slurm job), run on fake CUDA: ``layers``
square Linear layers, three steps, watched with ``hold_step2_for_prediction``
and ``raise_on_predicted_oom``. It prints ``step N done reserved BYTES`` after
each step; on stepwatch's PredictedOutOfMemoryError a line ``PREDICTED_OOM
peak=.. capacity=.. headroom=.. advice=..`` and exits 3, or, given
``--wait-for PATH``, waits until PATH exists (at most 300 s), prints
``released`` and exits 0."""

import argparse
import logging
import os
import sys
import time

import torch

import stepwatch

p = argparse.ArgumentParser()
p.add_argument("--hold", type=float, default=0.0, help="hold_step2_for_prediction (s)")
p.add_argument("--fail-fast", action="store_true", help="raise_on_predicted_oom")
p.add_argument("--width", type=int, default=1024)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--batch", type=int, default=4096)
p.add_argument("--no-bias", action="store_true")
p.add_argument("--sgd-momentum", action="store_true", help="SGD with momentum, else AdamW")
p.add_argument("--wait-for", help="a file whose creation ends the job")
a = p.parse_args()

logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
with torch.device("cuda"):
    model = torch.nn.Sequential(
        *[torch.nn.Linear(a.width, a.width, bias=not a.no_bias) for _ in range(a.layers)]
    )
if a.sgd_momentum:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
else:
    opt = torch.optim.AdamW(model.parameters())
stepwatch.watch(model, opt, hold_step2_for_prediction=a.hold, raise_on_predicted_oom=a.fail_fast)
try:
    for step in (1, 2, 3):
        model(torch.randn(a.batch, a.width, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} done reserved {torch.cuda.max_memory_reserved()}", flush=True)
except stepwatch.PredictedOutOfMemoryError as e:
    print(
        f"PREDICTED_OOM peak={e.predicted_peak_bytes} capacity={e.capacity_bytes} "
        f"headroom={e.predicted_headroom_bytes} advice={e.advice!r}",
        flush=True,
    )
    if not a.wait_for:
        sys.exit(3)
if a.wait_for:
    deadline = time.monotonic() + 300
    while not os.path.exists(a.wait_for) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("released", flush=True)
