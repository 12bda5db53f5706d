"""Turns allocator snapshots recorded on real GPUs
(`torch.cuda.memory._dump_snapshot` pickles, the files memory_viz opens) into
the JSON that `cargo run -p stepwatch-core --example snapshot_check` replays
through the allocator model.

A snapshot holds the segments when it was dumped and the history of events
that led there (`device_traces`), but not the segments when the history began.
Those are found by undoing the history from the end, newest event first:
an allocation becomes free again, a completed free becomes allocated, a segment
made during the history disappears, and one released during it comes back.

Pickles are read with an unpickler that refuses every class: a snapshot holds
only dicts, lists, strings and numbers, and a file that needs more is refused
rather than run.

    python3 bench/alloc_snapshots.py OUT_DIR SNAPSHOT.pickle...
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any, Optional

SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_BLOCK = 512


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the snapshot asks for {module}.{name}: refused")


def load(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        data = _DataOnly(f).load()
    if not isinstance(data, dict) or "segments" not in data:
        raise ValueError("not an allocator snapshot (no 'segments')")
    return data


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else (n + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


def format_hint(data: dict[str, Any], trace: list[dict[str, Any]]) -> str:
    """The PyTorch versions a snapshot's format allows (its keys appeared in
    these releases); the file does not name its version."""
    if "external_annotations" in data:
        return "2.7+"
    if "allocator_settings" in data:
        return "2.5+"
    if trace and "time_us" in trace[0]:
        return "2.2+"
    return "2.1"


class Layout:
    """Segments by address; each a list of [offset, size, used] tiling it."""

    def __init__(self) -> None:
        self.segs: dict[int, dict[str, Any]] = {}

    def find(self, addr: int) -> Optional[tuple[int, int]]:
        for base, s in self.segs.items():
            if base <= addr < base + s["size"]:
                off = addr - base
                for i, (o, n, _) in enumerate(s["blocks"]):
                    if o <= off < o + n:
                        return base, i
        return None

    def merge(self, base: int) -> None:
        out: list[list[int]] = []
        for b in self.segs[base]["blocks"]:
            if out and not out[-1][2] and not b[2]:
                out[-1][1] += b[1]
            else:
                out.append(list(b))
        self.segs[base]["blocks"] = out

    def undo_alloc(self, addr: int) -> None:
        hit = self.find(addr)
        if hit is None:
            raise ValueError(f"alloc of {addr:#x} outside every segment")
        base, i = hit
        b = self.segs[base]["blocks"][i]
        if b[0] != addr - base or not b[2]:
            raise ValueError(f"alloc of {addr:#x} is not an allocated block at the end")
        b[2] = False
        self.merge(base)

    def undo_free(self, addr: int, size: int) -> None:
        hit = self.find(addr)
        if hit is None:
            raise ValueError(f"free of {addr:#x} outside every segment")
        base, i = hit
        seg = self.segs[base]
        o, n, used = seg["blocks"][i]
        if used:
            raise ValueError(f"free of {addr:#x} inside an allocated block")
        off = addr - base
        want = round_size(size)
        end = off + want
        # A large-pool rest of 1 MiB or less is never split off: the block
        # held it (and no free large-pool block is that small).
        if seg["pool"] == "large" and 0 < o + n - end <= SMALL_SIZE:
            end = o + n
        if end > o + n:
            raise ValueError(f"free of {addr:#x} larger than the free space there")
        pieces = []
        if off > o:
            pieces.append([o, off - o, False])
        pieces.append([off, end - off, True])
        if o + n > end:
            pieces.append([end, o + n - end, False])
        seg["blocks"][i : i + 1] = pieces

    def undo_segment_alloc(self, addr: int) -> None:
        seg = self.segs.pop(addr, None)
        if seg is None or any(b[2] for b in seg["blocks"]):
            raise ValueError(f"segment {addr:#x} not there or not free where it was made")

    def undo_segment_free(self, addr: int, size: int, stream: int) -> None:
        pool = "small" if size == SMALL_BUFFER else "large"
        self.segs[addr] = {
            "size": size,
            "pool": pool,
            "stream": stream,
            "blocks": [[0, size, False]],
        }

    def to_json(self) -> list[dict[str, Any]]:
        out = []
        for base in sorted(self.segs):
            s = self.segs[base]
            seg: dict[str, Any] = {
                "address": base,
                "pool": s["pool"],
                "blocks": [{"size": n, "allocated": bool(u)} for _, n, u in s["blocks"]],
            }
            if s["stream"]:
                seg["stream"] = s["stream"]
            out.append(seg)
        return out


def extract(data: dict[str, Any]) -> dict[str, Any]:
    traces = data.get("device_traces") or []
    if not traces or not any(traces):
        raise ValueError("no allocator history (record_memory_history was off)")
    device = max(range(len(traces)), key=lambda d: len(traces[d]))
    trace = traces[device]
    settings = data.get("allocator_settings") or {}
    if settings.get("expandable_segments"):
        raise ValueError("expandable segments: not checked by this tool")
    if int(settings.get("max_split_size", -1) or -1) > 0 or any(
        (settings.get("roundup_power2_divisions") or {}).values()
    ):
        raise ValueError("non-default max_split_size or roundup_power2_divisions")
    layout = Layout()
    for s in data["segments"]:
        if s.get("device", device) != device:
            continue
        if s.get("is_expandable") or tuple(s.get("segment_pool_id") or (0, 0)) != (0, 0):
            raise ValueError("expandable segments or private pools: not checked")
        blocks, off = [], 0
        for b in s["blocks"]:
            used = b["state"] != "inactive"
            blocks.append([off, int(b["size"]), used])
            off += int(b["size"])
        layout.segs[int(s["address"])] = {
            "size": int(s["total_size"]),
            "pool": s["segment_type"],
            "stream": int(s.get("stream") or 0),
            "blocks": blocks,
        }
        layout.merge(int(s["address"]))
    events = []
    for e in trace:
        a = e["action"]
        if a == "free_completed":
            a = "free"
        if a in ("alloc", "free", "segment_alloc", "segment_free"):
            events.append(
                {
                    "action": a,
                    "address": int(e["addr"]),
                    "size": int(e["size"]),
                    "stream": int(e.get("stream") or 0),
                }
            )
        elif a in ("oom", "segment_map", "segment_unmap"):
            raise ValueError(f"the history holds {a}: not checked by this tool")
    for e in reversed(events):
        a = e["action"]
        if a == "alloc":
            layout.undo_alloc(e["address"])
        elif a == "free":
            layout.undo_free(e["address"], e["size"])
        elif a == "segment_alloc":
            layout.undo_segment_alloc(e["address"])
        else:
            layout.undo_segment_free(e["address"], e["size"], e["stream"])
    return {
        "versions": format_hint(data, trace),
        "start": layout.to_json(),
        "events": events,
    }


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for p in map(Path, argv[2:]):
        try:
            extracted = extract(load(p))
        except (ValueError, pickle.UnpicklingError, KeyError, EOFError) as err:
            print(f"{p}: skipped: {err}", file=sys.stderr)
            failed += 1
            continue
        extracted["name"] = p.stem
        (out / f"{p.stem}.json").write_text(json.dumps(extracted))
        print(f"{p}: {len(extracted['events'])} events, {extracted['versions']}")
    return 1 if failed == len(argv) - 2 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
