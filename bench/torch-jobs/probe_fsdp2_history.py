"""Record PyTorch's own allocator history of an FSDP2 job, steps 1..N, to JSON.

    fake-cuda run --gpus 4 --gpu-capacity BYTES --kernel-time 50us -- \
        python -m torch.distributed.run --standalone --nproc-per-node 4 \
        probe_fsdp2_history.py --layers 24 --hidden 1024 --heads 16 --batch 4 --out DIR

Not a job of the manifest and not a stepwatch client: it trains `fsdp2.py`'s
model as that job does, with `torch.cuda.memory._record_memory_history` on
from step 1's begin to the last step's end, and writes for each rank
`DIR/history-<rank>.json`: the history (action, address, size, stream of each
entry), the event count, reserved bytes and `num_alloc_retries` at every phase
boundary, and the segment snapshot at the end of step 1's optimizer phase;
rank 0 prints each step's reserved peak and cache releases. It is how the
allocator's steps under a tight GPU were compared with stepwatch's replay of
step 1's trace (BENCHMARKS.md, `fsdp2-4`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the usual spelling)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import common


def step_peaks(marks: list[dict[str, Any]], events: list[list[Any]]) -> list[str]:
    """Per step: the reserved peak (from the segment events) and the cache releases."""
    starts = [(m["name"].split(".")[0], m["events"]) for m in marks if m["name"].endswith(".begin")]
    ends = [e for _, e in starts[1:]] + [marks[-1]["events"]]
    reserved = marks[0]["reserved"]
    lines = []
    for (step, start), end in zip(starts, ends):
        peak, releases, previous = reserved, 0, None
        for action, _, size, _ in events[start:end]:
            if action == "segment_alloc":
                reserved += size
            elif action == "segment_free":
                reserved -= size
                releases += previous != "segment_free"
            peak = max(peak, reserved)
            previous = action
        lines.append(
            f"{step}: reserved peak {peak} B ({peak / 2**20:.0f} MiB), {releases} cache release(s)"
        )
    return lines


def main(argv: Optional[list[str]] = None) -> None:
    p = common.gpt_parser(__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for history-<rank>.json")
    args = p.parse_args(argv)
    common.check_args(p, args)
    rank, world, device = common.init_distributed(args.device)
    mesh = init_device_mesh(device.type, (world,))
    model = common.gpt_model(args, device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    optimizer = common.make_optimizer(args.optimizer, model.parameters(), args.lr)

    marks: list[dict[str, Any]] = []
    segments_after_step1: list[Any] = []

    def mark(name: str) -> None:
        # No synchronisation: the job itself does none between phases.
        events = len(torch.cuda.memory._snapshot()["device_traces"][device.index])
        stats = torch.cuda.memory_stats()
        marks.append(
            {
                "name": name,
                "events": events,
                "reserved": stats.get("reserved_bytes.all.current", 0),
                "allocated": stats.get("allocated_bytes.all.current", 0),
                "retries": stats.get("num_alloc_retries", 0),
            }
        )

    model.train()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=2_000_000
    )
    for step in range(1, args.steps + 1):
        mark(f"s{step}.begin")
        x, y = common.random_tokens(args.batch, args.seq_len, args.vocab, device)
        mark(f"s{step}.fwd")
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        mark(f"s{step}.bwd")
        loss.backward()
        mark(f"s{step}.opt")
        optimizer.step()
        mark(f"s{step}.zero")
        if step == 1:
            segments_after_step1 = torch.cuda.memory._snapshot()["segments"]
        optimizer.zero_grad(set_to_none=True)
    mark("end")
    trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
    out = {
        "rank": rank,
        "marks": marks,
        "events": [
            [e["action"], int(e["addr"]), int(e["size"]), int(e.get("stream") or 0)] for e in trace
        ],
        "segments_after_step1": [
            {
                "address": int(s["address"]),
                "total_size": int(s["total_size"]),
                "stream": int(s.get("stream") or 0),
                "segment_type": s.get("segment_type"),
                "blocks": [[int(b["size"]), b["state"]] for b in s["blocks"]],
            }
            for s in segments_after_step1
        ],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"history-{rank}.json"), "w") as f:
        json.dump(out, f)
    if rank == 0:
        for line in step_peaks(marks, out["events"]):
            print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
