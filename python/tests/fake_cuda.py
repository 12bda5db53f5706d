"""A fake CUDA caching allocator for the allocator-trace tests (CPU torch cannot record).

It hands out addresses from 2 MiB small-pool and 20 MiB large-pool segments with
best-fit splitting and merging, keeps the counters ``torch.cuda.memory_stats()``
has (as the nested dict of ``torch._C._cuda_memoryStats``), records the history
``torch.cuda.memory._record_memory_history()`` would, and returns
``torch.cuda.memory._snapshot()`` dicts in the format of the installed torch
(the ``_snapshot`` docstring in torch/cuda/memory.py: Snapshot, Segment,
Block, TraceEntry; block states as torch/csrc/cuda/Module.cpp writes
them, "active_pending_free" where the docstring says "active_awaiting_free").
"""

from __future__ import annotations

import collections
from typing import Any, Optional

SMALL = 1 << 20  # requests up to 1 MiB go to the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20


def round_size(n: int) -> int:
    return max(512, (n + 511) // 512 * 512)


class FakeCuda:
    def __init__(self, base: int = 0x7F00_0000_0000) -> None:
        self.next_segment = base
        # address -> {"small", "size", "blocks": [[offset, size, allocated, requested]]}
        self.segments: dict[int, dict[str, Any]] = {}
        self.live: dict[int, int] = {}  # address -> segment address
        self.recording = False
        self.max_entries = 1 << 62
        self.skip: set = set()
        self.trace: collections.deque = collections.deque()
        self.history_calls: list[dict[str, Any]] = []
        self.snapshots = 0
        # include_traces of each torch.cuda.memory_snapshot() call (step 1's layouts).
        self.layout_snapshots: list[bool] = []
        self.time_us = 1_700_000_000_000_000
        self.c = collections.Counter()  # allocated/freed counters and byte figures
        self.reserved_peak = 0
        self.allocated_peak = 0
        self.active_peak = 0
        # Freed blocks still awaiting their streams' events (active, not allocated),
        # and allocation retries: set by tests so every figure differs.
        self.pending_bytes = 0
        self.retries = 0
        # (action, address, requested, label, recording at the time)
        self.log: list[tuple] = []

    # ------------------------------------------------------------ history
    def _record(self, action: str, addr: int, size: int) -> None:
        if not self.recording or action in self.skip:
            return
        self.time_us += 3
        self.trace.append(
            {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": self.time_us}
        )
        while len(self.trace) > self.max_entries:
            self.trace.popleft()

    def record_memory_history(
        self,
        enabled: Optional[str] = "all",
        context: Optional[str] = "all",
        stacks: str = "all",
        max_entries: int = 1 << 62,
        device: Any = None,
        clear_history: bool = False,
        compile_context: bool = False,
        global_record_annotations: bool = False,
        skip_actions: Optional[list[str]] = None,
        record_pinned_host_memory: bool = False,
        record_cuda: bool = True,
    ) -> None:
        self.history_calls.append(
            dict(
                enabled=enabled,
                context=context,
                stacks=stacks,
                max_entries=max_entries,
                clear_history=clear_history,
                skip_actions=skip_actions,
            )
        )
        self.recording = enabled is not None
        self.max_entries = max_entries if enabled == "all" else 1
        self.skip = set(skip_actions or ())
        if clear_history:
            self.trace.clear()

    def is_history_enabled(self) -> bool:
        return self.recording

    # ---------------------------------------------------------- allocator
    def _new_segment(self, small: bool, rounded: int) -> int:
        size = (
            SMALL_SEGMENT
            if small
            else max(LARGE_SEGMENT, (rounded + (2 << 20) - 1) // (2 << 20) * (2 << 20))
        )
        addr = self.next_segment
        self.next_segment += size + (256 << 20)
        self.segments[addr] = {"small": small, "size": size, "blocks": [[0, size, False, 0]]}
        self.c["reserved"] += size
        self.reserved_peak = max(self.reserved_peak, self.c["reserved"])
        self._record("segment_alloc", addr, size)
        self.log.append(("segment_alloc", addr, size, None, self.recording))
        return addr

    def alloc(self, size: int, label: str = "") -> int:
        # First fit, newest segment and highest block first: cheap for the
        # allocate-then-free patterns of the tests (this is not torch's best fit).
        small = size <= SMALL
        rounded = round_size(size)
        best = None
        for saddr in reversed(list(self.segments)):
            seg = self.segments[saddr]
            if seg["small"] != small:
                continue
            blocks = seg["blocks"]
            for i in range(len(blocks) - 1, -1, -1):
                off, bsize, used, _ = blocks[i]
                if not used and bsize >= rounded:
                    best = (saddr, i, bsize)
                    break
            if best is not None:
                break
        if best is None:
            saddr = self._new_segment(small, rounded)
            best = (saddr, 0, self.segments[saddr]["size"])
        saddr, i, bsize = best
        blocks = self.segments[saddr]["blocks"]
        off = blocks[i][0]
        blocks[i] = [off, rounded, True, size]
        if bsize > rounded:
            blocks.insert(i + 1, [off + rounded, bsize - rounded, False, 0])
        addr = saddr + off
        self.live[addr] = saddr
        self.c["allocated"] += 1
        self.c["allocated_bytes"] += rounded
        self.allocated_peak = max(self.allocated_peak, self.c["allocated_bytes"])
        self.active_peak = max(self.active_peak, self.c["allocated_bytes"] + self.pending_bytes)
        self._record("alloc", addr, size)
        self.log.append(("alloc", addr, size, label, self.recording))
        return addr

    def free(self, addr: int, label: str = "") -> None:
        saddr = self.live.pop(addr)
        blocks = self.segments[saddr]["blocks"]
        i = next(j for j in range(len(blocks) - 1, -1, -1) if saddr + blocks[j][0] == addr)
        _, bsize, _, requested = blocks[i]
        self.c["freed_requested"] += 1
        self._record("free_requested", addr, requested)
        self._record("free_completed", addr, requested)
        self.c["freed"] += 1
        self.c["allocated_bytes"] -= bsize
        blocks[i][2] = False
        blocks[i][3] = 0
        # merge with free neighbours
        if i + 1 < len(blocks) and not blocks[i + 1][2]:
            blocks[i][1] += blocks.pop(i + 1)[1]
        if i > 0 and not blocks[i - 1][2]:
            blocks[i - 1][1] += blocks.pop(i)[1]
        self.log.append(("free", addr, requested, label, self.recording))

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release the segments that hold no block."""
        for saddr in list(self.segments):
            seg = self.segments[saddr]
            if not any(b[2] for b in seg["blocks"]):
                del self.segments[saddr]
                self.c["reserved"] -= seg["size"]
                self._record("segment_free", saddr, seg["size"])
                self.log.append(("segment_free", saddr, seg["size"], None, self.recording))

    def oom(self, size: int) -> None:
        if self.recording:
            self.time_us += 3
            self.trace.append(
                {
                    "action": "oom",
                    "device_free": 0,
                    "size": size,
                    "stream": 0,
                    "time_us": self.time_us,
                }
            )

    # ------------------------------------------------------------- torch API
    def memory_stats_nested(self, device: Any = None) -> dict[str, Any]:
        """What ``torch._C._cuda_memoryStats(device)`` returns (the dict
        ``torch.cuda.memory_stats_as_nested_dict`` passes on): each stat is
        ``{"all"|"small_pool"|"large_pool": {"current", "peak", "allocated",
        "freed"}}``; ``num_alloc_retries`` and the like are plain ints. Only the
        "all" pools and the stats stepwatch or the tests read are filled in."""
        c = self.c
        active_bytes = c["allocated_bytes"] + self.pending_bytes
        self.active_peak = max(self.active_peak, active_bytes)

        def stat(current: int, peak: int, allocated: int = 0, freed: int = 0) -> dict[str, Any]:
            return {
                "all": {"current": current, "peak": peak, "allocated": allocated, "freed": freed}
            }

        return {
            "active": stat(c["allocated"] - c["freed"], 0, c["allocated"], c["freed"]),
            "allocation": stat(
                c["allocated"] - c["freed_requested"], 0, c["allocated"], c["freed_requested"]
            ),
            "allocated_bytes": stat(c["allocated_bytes"], self.allocated_peak),
            "active_bytes": stat(active_bytes, self.active_peak),
            "reserved_bytes": stat(c["reserved"], self.reserved_peak),
            "num_alloc_retries": self.retries,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """``torch._C._cuda_resetPeakMemoryStats``: each peak down to its current figure."""
        self.allocated_peak = self.c["allocated_bytes"]
        self.reserved_peak = self.c["reserved"]
        self.active_peak = self.c["allocated_bytes"] + self.pending_bytes

    def memory_stats(self, device: Any = None) -> collections.OrderedDict[str, int]:
        """``torch.cuda.memory_stats``: the nested dict flattened with "."."""
        flat = []

        def walk(prefix: str, d: dict[str, Any]) -> None:
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(f"{prefix}{k}.", v)
                else:
                    flat.append((f"{prefix}{k}", v))

        walk("", self.memory_stats_nested(device))
        return collections.OrderedDict(sorted(flat))

    def snapshot(self, device: Any = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
        self.snapshots += 1
        segments = []
        for saddr in sorted(self.segments):
            seg = self.segments[saddr]
            blocks = [
                {
                    "address": saddr + off,
                    "size": size,
                    "requested_size": req,
                    "state": "active_allocated" if used else "inactive",
                    "frames": [],
                }
                for off, size, used, req in seg["blocks"]
            ]
            segments.append(
                {
                    "device": 0,
                    "address": saddr,
                    "total_size": seg["size"],
                    "allocated_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                    "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                    "requested_size": sum(b["requested_size"] for b in blocks),
                    "stream": 0,
                    "segment_type": "small" if seg["small"] else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": blocks,
                }
            )
        return {
            "segments": segments,
            "device_traces": [list(self.trace)],
            "allocator_settings": {},
            "external_annotations": [],
        }

    def memory_snapshot(self, mempool_id: Any = None, include_traces: bool = True) -> Any:
        """torch.cuda.memory_snapshot(): the segments only, counted apart from
        :meth:`snapshot` (which the allocator trace takes)."""
        self.layout_snapshots.append(include_traces)
        segments = self.snapshot()["segments"]
        self.snapshots -= 1
        return segments

    def install(self, monkeypatch: Any, torch: Any) -> FakeCuda:
        """Make a CPU torch look like CUDA to stepwatch (device 0, this allocator)."""
        import stepwatch._torch as st

        # Not torch.cuda.is_available itself: torch's own code (the optimizer's
        # graph-capture check) would then try to initialise CUDA.
        monkeypatch.setattr(st, "cuda_available", lambda: True)
        # What stepwatch reads at each marker (torch.cuda.memory_stats wraps it).
        monkeypatch.setattr(torch._C, "_cuda_memoryStats", self.memory_stats_nested, raising=False)
        monkeypatch.setattr(
            torch._C, "_cuda_resetPeakMemoryStats", self.reset_peak_memory_stats, raising=False
        )
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record_memory_history)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.snapshot)
        monkeypatch.setattr(torch.cuda.memory, "memory_snapshot", self.memory_snapshot)
        monkeypatch.setattr(
            torch._C, "_cuda_isHistoryEnabled", self.is_history_enabled, raising=False
        )
        monkeypatch.setattr(st, "model_cuda_device", lambda model: 0)
        monkeypatch.setattr(st, "active_cuda_device", lambda: 0)
        monkeypatch.setattr(st, "gpu_uuid_for", lambda model: "")
        # cudaMemGetInfo: an 80 GiB device that holds this allocator's segments
        # and a 512 MiB context.
        monkeypatch.setattr(st, "device_memory", self.device_memory)
        return self

    def device_memory(self, device: int) -> tuple[int, int]:
        total = 80 << 30
        return total - (512 << 20) - self.c["reserved"], total


class FakeWorkload:
    """Allocations a small training step makes, hooked into a real CPU training loop.

    Forward (a forward hook on the model): activations. Backward (a gradient
    hook on the first parameter, so after stepwatch's BACKWARD_BEGIN): the
    gradients, and the activations die. Optimizer (a step pre-hook registered
    after ``watch()``, so after OPTIMIZER_BEGIN): state on the first step, a
    temporary. Gradients are freed at ``zero_grad``.
    """

    def __init__(self, fake: FakeCuda, model: Any, opt: Any) -> None:
        self.fake = fake
        self.acts: list[int] = []
        self.grads: list[int] = []
        self.state: list[int] = []
        self.hooks = [model.register_forward_hook(self.forward)]
        self.param = next(iter(model.parameters()))
        self.hooks.append(self.param.register_hook(self.backward))
        self.opt = opt

    def install_optimizer_hooks(self) -> None:
        """Call after stepwatch.watch(): hooks run in the order they were registered."""
        self.hooks.append(self.opt.register_step_pre_hook(self.optimizer))

    def forward(self, module: Any, args: Any, out: Any) -> None:
        if not module.training:
            return
        for n in (4096, 40_000, 1_500_000, 700):
            self.acts.append(self.fake.alloc(n, "forward"))

    def backward(self, grad: Any) -> None:
        for n in (4096, 3_000_000):
            self.grads.append(self.fake.alloc(n, "backward"))
        while self.acts:
            self.fake.free(self.acts.pop(), "backward")
        return None

    def optimizer(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self.state:
            for n in (4096, 3_000_000, 4096, 3_000_000):
                self.state.append(self.fake.alloc(n, "optimizer"))
        tmp = self.fake.alloc(8192, "optimizer")
        self.fake.free(tmp, "optimizer")

    def zero_grad(self) -> None:
        while self.grads:
            self.fake.free(self.grads.pop(), "zero_grad")

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
