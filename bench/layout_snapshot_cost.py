"""What step 1's segment snapshot costs the training thread (the Python client's
``LayoutSnapshots.take``), on unmodified PyTorch on fake CUDA:

    bench/layout-snapshot-cost.sh [--repeats N] [--layers L] ...

It trains one step of the GPT-2-small job (``bench/torch-jobs``, AdamW, so the
layout at the optimizer's end is the one the client sends), then times, N times
each at that point:

- ``snapshot``: ``torch.cuda.memory_snapshot(include_traces=False)``;
- ``gradients``: where the parameters' gradients start
  (``_torch.gradient_addresses``, for the layout's gradient flags);
- ``convert``: the gradients' addresses, the snapshot and its conversion to the
  client's ``Layout`` (what ``LayoutSnapshots.take`` does on the training
  thread, twice per run);
- ``encode``: filling a ``Marker`` with that layout (on the sender thread).

It prints the median and the 90th percentile of each in milliseconds, with the
layout's size (segments, blocks, bytes on the wire). No agent is needed. On fake
CUDA the allocator is PyTorch's own and only the device calls are faked, so the
figures are the client's and PyTorch's CPU cost; a real GPU's allocator holds
the same segments.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "torch-jobs"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402,N812
from common import add_gpt_args, check_args, gpt_config, random_tokens, setup_device  # noqa: E402
from models import GPT  # noqa: E402
from stepwatch import _alloctrace, _torch  # noqa: E402
from stepwatch._client import load_wire  # noqa: E402


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_gpt_args(p)
    p.add_argument("--repeats", type=int, default=200, help="timings of each operation")
    args = p.parse_args()
    check_args(p, args)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if not torch.cuda.is_available():
        p.error("no CUDA device: run under crates/fake-cuda/fake-cuda (see the .sh wrapper)")
    device = setup_device("cuda")
    model = GPT(gpt_config(args)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = random_tokens(args.batch, args.seq_len, args.vocab, device)
    logits = model(x)
    F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).backward()
    del logits
    opt.step()  # the optimizer's end: the layout the client sends second

    index = device.index or 0

    def convert() -> _alloctrace.Layout:
        # As the client: the gradients' blocks flagged.
        grads = _torch.gradient_addresses(model.parameters())
        return _alloctrace.layout_from_segments(_torch.memory_layout(), index, grads)

    layout = convert()
    _, pb, _ = load_wire()

    def encode() -> None:
        layout.fill(pb.Marker())

    results: dict[str, list[float]] = {
        "snapshot": timed(_torch.memory_layout, args.repeats),
        "gradients": timed(lambda: _torch.gradient_addresses(model.parameters()), args.repeats),
        "convert": timed(convert, args.repeats),
        "encode": timed(encode, args.repeats),
    }
    blocks = sum(len(s[2]) for s in layout.segments)
    flagged = sum(1 for s in layout.segments for b in s[2] if len(b) > 2 and b[2])
    print(
        f"layout at step 1's optimizer end: {len(layout.segments)} large-pool segments, "
        f"{blocks} blocks ({flagged} gradients), {layout.nbytes} bytes on the wire; "
        f"torch {torch.__version__}"
    )
    print(f"{'operation':<10} {'median ms':>10} {'p90 ms':>8}  ({args.repeats} timings each)")
    for name, ms in results.items():
        p90 = statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]
        print(f"{name:<10} {statistics.median(ms):>10.3f} {p90:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
