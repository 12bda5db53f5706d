"""Step 1's CUDA caching-allocator history, sent once to the agent (AllocatorTraceChunk).

During step 1 the caching allocator records its alloc/free history (no stack
capture). After step 1's OPTIMIZER_END marker one ``torch.cuda.memory._snapshot()``
gives the segment layout at that moment and the history; :func:`trace_from_snapshot`
turns them into an :class:`AllocatorTrace` (segments, and the step's allocations
and frees tagged with the phase they happened in), which the client sends as one
unit of its queue, right after that marker. The agent replays the events through
its model of the caching allocator to predict step 2's reserved memory.

Phase tagging. Each step-1 marker's one read of the allocator's stats (the
same read that gives its allocator figures) holds the cumulative counters
``active.all.allocated`` and ``active.all.freed`` (see
:func:`stepwatch._torch.allocator_event_counters`): they count exactly the
trace's ``alloc`` and ``free_completed`` entries, so the k-th allocation of the
trace happened after a marker iff ``k > allocated(marker) - allocated(start)``
(same for frees). This places every marker exactly between two events,
whichever thread allocated (backward runs on autograd's device thread); the
entries' ``time_us`` come from an approximate TSC clock converted to wall time
and would need a tolerance around each marker. The counters also let the
client check the trace is whole: it must hold at least the events counted by
step 1's OPTIMIZER_END and at most those counted when the snapshot returned.

Nothing here imports torch; the recorder calls it through ``_torch``.
"""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import (
    Any,
    Callable,
    Optional,
)

from . import _torch
from ._client import (
    BACKWARD_BEGIN,
    FORWARD_BEGIN,
    MAX_BATCH_BYTES,
    OOM,
    OPTIMIZER_BEGIN,
    OPTIMIZER_END,
    STEP_BEGIN,
)

log = logging.getLogger("stepwatch")

# The agent's limits (proto/stepwatch/v1/ingest.proto).
MAX_TRACE_EVENTS = 262_144
MAX_TRACE_BLOCKS = 262_144
# Most forward returns a trace carries (one per micro-batch; more are not noted).
MAX_FORWARD_RETURNS = 1024
# Ring buffer of the allocator's history: bounds host memory (a c10 TraceEntry
# is of the order of 100 bytes; the snapshot's dict per entry a few hundred).
HISTORY_MAX_ENTRIES = 262_144
# Encoded ClientMessage bound per chunk; the agent refuses messages over 64 KiB.
CHUNK_BYTES = MAX_BATCH_BYTES

# stepwatch.v1.AllocatorAction
ACTION_ALLOC = 1
ACTION_FREE = 2
ACTION_SEGMENT_ALLOC = 3
ACTION_SEGMENT_FREE = 4
ACTION_SEGMENT_MAP = 5
ACTION_SEGMENT_UNMAP = 6
# The history's counted events: the trace's action code, and which of the
# allocator's counters (0: allocations, 1: frees) counts them.
_COUNTED_ACTIONS = {"alloc": (ACTION_ALLOC, 0), "free_completed": (ACTION_FREE, 1)}
_SEGMENT_ACTIONS = {
    "segment_alloc": ACTION_SEGMENT_ALLOC,
    "segment_free": ACTION_SEGMENT_FREE,
    "segment_map": ACTION_SEGMENT_MAP,
    "segment_unmap": ACTION_SEGMENT_UNMAP,
}
# roundup_power2_divisions intervals: [1 MiB, 2 MiB) ... [32 GiB, ...)
ROUNDUP_INTERVALS = 16

PHASE_KINDS = (STEP_BEGIN, FORWARD_BEGIN, BACKWARD_BEGIN, OPTIMIZER_BEGIN, OPTIMIZER_END)

# (marker kind, active.all.allocated, active.all.freed) at a step-1 marker
Mark = tuple[int, int, int]


class TraceRefused(Exception):
    """The trace cannot be sent as it is (incomplete, too large); the reason says why."""


def _vlen(v: int) -> int:
    """Bytes of ``v`` as a protobuf varint (v >= 0)."""
    return (max(v.bit_length(), 1) + 6) // 7


def _field(n: int) -> int:
    """Bytes of a length-delimited field whose payload is ``n`` bytes (1-byte tag)."""
    return 1 + _vlen(n) + n


def _block_bytes(size: int, allocated: bool, gradient: bool = False) -> int:
    return _field(
        (1 + _vlen(size) if size else 0) + (2 if allocated else 0) + (2 if gradient else 0)
    )


def _add_segment(
    repeated: Any,
    address: int,
    small: bool,
    blocks: Sequence[tuple[Any, ...]],
    home: tuple[int, int, bool],
) -> None:
    """Appends one segment and its blocks to a repeated ``AllocatorSegment``
    field: a trace chunk's segments or a marker's layout. A block is (size,
    allocated) or, in a layout, (size, allocated, gradient)."""
    stream, pool_id, expandable = home
    seg = repeated.add(
        address=address,
        small_pool=small,
        stream=stream,
        pool_id=pool_id,
        expandable=expandable,
    )
    add_block = seg.blocks.add
    for block in blocks:
        if len(block) > 2 and block[2]:
            add_block(size=block[0], allocated=block[1], gradient=True)
        else:
            add_block(size=block[0], allocated=block[1])


def _segment_bytes(
    address: int,
    small: bool,
    blocks: Sequence[tuple[Any, ...]],
    home: tuple[int, int, bool] = (0, 0, False),
) -> int:
    stream, pool_id, expandable = home
    n = (1 + _vlen(address) if address else 0) + (2 if small else 0)
    n += (1 + _vlen(stream) if stream else 0) + (1 + _vlen(pool_id) if pool_id else 0)
    n += 2 if expandable else 0
    for block in blocks:
        n += _block_bytes(*block)
    return _field(n)


def _event_bytes(action: int, address: int, size: int, phase: int, stream: int = 0) -> int:
    return _field(
        (2 if action else 0)
        + (1 + _vlen(address) if address else 0)
        + (1 + _vlen(size) if size else 0)
        + (2 if phase else 0)
        + (1 + _vlen(stream) if stream else 0)
    )


# A chunk's fields besides segments/events: step (varint field) and last
# (bool), plus the ClientMessage's own tag and length (a 64 KiB payload needs
# a 3-byte length).
_CHUNK_OVERHEAD = (1 + 10) + 2 + (1 + 3)


class AllocatorTrace:
    """Step 1's trace in compact form; :meth:`messages` encodes it in chunks."""

    __slots__ = (
        "step",
        "segments",
        "segment_homes",
        "settings",
        "ev_action",
        "ev_address",
        "ev_size",
        "ev_phase",
        "ev_stream",
        "forward_returns",
    )

    def __init__(self, step: int = 1) -> None:
        self.step = step
        # (address, small pool, [(size, allocated), ...] in address order)
        self.segments: list[tuple[int, bool, list[tuple[int, bool]]]] = []
        # per segment: (stream, private pool id (0: default pool), expandable)
        self.segment_homes: list[tuple[int, int, bool]] = []
        # AllocatorSettings fields from the snapshot's allocator_settings, or None
        self.settings: Optional[dict[str, Any]] = None
        self.ev_action = array("B")
        self.ev_address = array("Q")
        self.ev_size = array("Q")
        self.ev_phase = array("B")
        self.ev_stream = array("Q")
        # positions in the events where the watched model's forward returned
        self.forward_returns: list[int] = []

    @property
    def num_events(self) -> int:
        return len(self.ev_action)

    @property
    def num_blocks(self) -> int:
        return sum(len(s[2]) for s in self.segments)

    def add_event(self, action: int, address: int, size: int, phase: int, stream: int = 0) -> None:
        self.ev_action.append(action)
        self.ev_address.append(address)
        self.ev_size.append(size)
        self.ev_phase.append(phase)
        self.ev_stream.append(stream)

    def events(self) -> Iterator[tuple[int, int, int, int]]:
        return zip(self.ev_action, self.ev_address, self.ev_size, self.ev_phase)

    def homes(self) -> list[tuple[int, int, bool]]:
        """Each segment's (stream, pool id, expandable); the default one when not set."""
        if len(self.segment_homes) == len(self.segments):
            return self.segment_homes
        return [(0, 0, False)] * len(self.segments)

    def check(self, budget: int = CHUNK_BYTES) -> None:
        """Refuse what the agent would refuse, or what cannot be chunked."""
        if self.num_events > MAX_TRACE_EVENTS:
            raise TraceRefused(
                f"step 1 made {self.num_events} allocator events (allocations, frees, "
                f"segments); the agent takes at most {MAX_TRACE_EVENTS}"
            )
        if self.num_blocks > MAX_TRACE_BLOCKS:
            raise TraceRefused(
                f"the allocator holds {self.num_blocks} blocks; the agent takes at most "
                f"{MAX_TRACE_BLOCKS}"
            )
        room = budget - _CHUNK_OVERHEAD - self._settings_bytes() - self._returns_bytes()
        for (address, small, blocks), home in zip(self.segments, self.homes()):
            if _segment_bytes(address, small, blocks, home) > room:
                raise TraceRefused(
                    f"the segment at {address:#x} has {len(blocks)} blocks, more than one "
                    f"message of {budget} bytes can describe"
                )

    def messages(self, pb: Any, budget: int = CHUNK_BYTES) -> Iterator[Any]:
        """ClientMessages (``allocator_trace``), each encoding to at most ``budget`` bytes.

        Segments, then events, in order; ``last`` is set on the final chunk only.
        A segment is never split (its blocks must tile it), see :meth:`check`.
        """
        out = _Chunks(pb, self.step, budget - _CHUNK_OVERHEAD)
        if self.settings is not None:
            # In the first chunk, ahead of everything.
            out.used = self._settings_bytes()
            out.chunk.settings.SetInParent()
            for key, value in self.settings.items():
                if key == "roundup_power2_divisions":
                    out.chunk.settings.roundup_power2_divisions.extend(value)
                else:
                    setattr(out.chunk.settings, key, value)
        if self.forward_returns:
            # In the first chunk too (at most MAX_FORWARD_RETURNS: under 11 KiB).
            out.used += self._returns_bytes()
            out.chunk.forward_returns.extend(self.forward_returns)
        for (address, small, blocks), home in zip(self.segments, self.homes()):
            full = out.fit(_segment_bytes(address, small, blocks, home))
            if full is not None:
                yield full
            _add_segment(out.chunk.segments, address, small, blocks, home)
        for action, address, size, phase, stream in zip(
            self.ev_action, self.ev_address, self.ev_size, self.ev_phase, self.ev_stream
        ):
            full = out.fit(_event_bytes(action, address, size, phase, stream))
            if full is not None:
                yield full
            out.chunk.events.add(
                action=action, address=address, size=size, phase=phase, stream=stream
            )
        out.chunk.last = True
        yield out.msg

    def _returns_bytes(self) -> int:
        """Bytes of the packed forward_returns field, 0 without any."""
        if not self.forward_returns:
            return 0
        return _field(sum(_vlen(r) for r in self.forward_returns))

    def _settings_bytes(self) -> int:
        """Bytes of the settings field (an upper bound), 0 without settings."""
        if self.settings is None:
            return 0
        s = self.settings
        n = 1 + 10  # max_split_size_bytes
        divisions = s.get("roundup_power2_divisions") or []
        if divisions:
            packed = sum(_vlen(d) for d in divisions)
            n += 1 + _vlen(packed) + packed
        n += 1 + 8 + 2  # garbage_collection_threshold, expandable_segments
        conf = len(s.get("alloc_conf", "").encode())
        n += 1 + _vlen(conf) + conf
        return _field(n)


class _Chunks:
    """The chunk being filled; :meth:`fit` starts the next one when an item would
    not fit in ``room`` bytes (an item alone in a chunk always goes in)."""

    __slots__ = ("pb", "step", "room", "used", "msg", "chunk")

    def __init__(self, pb: Any, step: int, room: int) -> None:
        self.pb = pb
        self.step = step
        self.room = room
        self._new()

    def _new(self) -> None:
        self.msg = self.pb.ClientMessage()
        self.chunk = self.msg.allocator_trace
        self.chunk.step = self.step
        self.used = 0

    def fit(self, n: int) -> Any:
        """Make room for an item of ``n`` bytes; returns the full message to send
        first, or None."""
        used = self.used
        if used and used + n > self.room:
            full = self.msg
            self._new()
            self.used = n
            return full
        self.used = used + n
        return None


def trace_from_snapshot(
    snapshot: Any,
    device: int,
    marks: Sequence[Mark],
    *,
    end_counters: Optional[tuple[int, int]] = None,
    max_entries: Optional[int] = HISTORY_MAX_ENTRIES,
    step: int = 1,
    forward_returns: Sequence[tuple[int, int]] = (),
) -> AllocatorTrace:
    """Build step 1's trace from a ``torch.cuda.memory._snapshot()`` dict.

    ``marks`` are the step's markers in order, each with the allocator's
    counters read at it; the first is STEP_BEGIN, read just after recording
    began (the history then starts empty, so its first entries are the first
    events after that point). ``end_counters`` are the counters read right
    after the snapshot. ``forward_returns`` are the counters read each time the
    watched model's forward returned; each becomes the position in the trace's
    events of the first event after it (``AllocatorTrace.forward_returns``).
    Raises :class:`TraceRefused` when the history is incomplete or too large.

    Snapshot fields used (torch/cuda/memory.py, ``_snapshot`` docstring):
    ``Snapshot.segments`` / ``Snapshot.device_traces``; ``Segment.device``,
    ``.address``, ``.segment_type`` ("small"/"large"), ``.blocks``, ``.stream``,
    ``.segment_pool_id`` (a pair; (0, 0) is the default pool), ``.is_expandable``;
    ``Block.size``, ``.state`` ("inactive" is free; "active_allocated" and
    "active_pending_free" / "active_awaiting_free" hold memory);
    ``TraceEntry.action`` ("alloc", "free_completed", "segment_alloc",
    "segment_free", "segment_map", "segment_unmap", "oom"), ``.addr``, ``.size``
    (the requested bytes), ``.stream``; ``Snapshot.allocator_settings``
    (:func:`settings_from_snapshot`).
    """
    if not marks or marks[0][0] != STEP_BEGIN:
        raise ValueError("the first mark must be STEP_BEGIN")
    traces = snapshot.get("device_traces") or []
    entries = traces[device] if 0 <= device < len(traces) else []
    if max_entries and len(entries) >= max_entries:
        raise TraceRefused(
            f"the allocator's history filled its ring buffer ({len(entries)} entries): "
            "the start of step 1 was overwritten"
        )
    # Counters relative to the start; they never go back unless someone calls
    # torch.cuda.reset_accumulated_memory_stats() during the step.
    a0, f0 = marks[0][1], marks[0][2]
    rel: list[Mark] = []
    pa = pf = 0
    for kind, a, f in marks:
        ra, rf = a - a0, f - f0
        if ra < pa or rf < pf:
            raise TraceRefused(
                "the allocator's counters went back during step 1 "
                "(torch.cuda.reset_accumulated_memory_stats?)"
            )
        rel.append((kind, ra, rf))
        pa, pf = ra, rf

    trace = AllocatorTrace(step)
    add = trace.add_event
    # Forward returns relative to the start, in order; each is placed before the
    # first counted event after it (an allocation or free past its counters).
    returns = sorted((a - a0, f - f0) for a, f in forward_returns)
    kr = 0

    def place(allocs: int, frees: int) -> None:
        nonlocal kr
        while kr < len(returns) and (allocs > returns[kr][0] or frees > returns[kr][1]):
            trace.forward_returns.append(trace.num_events)
            kr += 1

    last = len(rel) - 1
    # Per counted kind (0: allocations, 1: frees): the mark the next event of the
    # kind follows, and the events of the kind seen so far.
    at = [0, 0]
    seen = [0, 0]

    def mark_before(kind: int) -> int:
        """The mark the next event of ``kind`` follows (its counter, rel[.][1 + kind])."""
        i = at[kind]
        while i < last and rel[i + 1][1 + kind] <= seen[kind]:
            i += 1
        at[kind] = i
        return i

    # Segment events are not counted: a segment_alloc takes the phase of the
    # allocation it is made for (the next), a segment_free that of the latest event
    # (empty_cache() between events; a release before an allocation rarely changes
    # phase). So neither starts a phase run of its own.
    phase = rel[0][0]
    for e in entries:
        action = e.get("action")
        counted = _COUNTED_ACTIONS.get(action)
        if counted is not None:
            code, kind = counted
            i = mark_before(kind)
            seen[kind] += 1
            place(seen[0], seen[1])
            phase = rel[i][0]
            add(code, int(e["addr"]), int(e["size"]), phase, _stream(e.get("stream")))
        elif action in _SEGMENT_ACTIONS:
            if action in ("segment_alloc", "segment_map"):
                phase = rel[mark_before(0)][0]
            add(
                _SEGMENT_ACTIONS[action],
                int(e["addr"]),
                int(e["size"]),
                phase,
                _stream(e.get("stream")),
            )
        # "oom": a cudaMalloc the allocator could not serve even after freeing
        # its cache (a caught OutOfMemoryError). It changes no block; what the
        # allocator did to try (segment_free of the cached segments) is in the
        # history as its own entries, so the replay follows it without it.
    # Returns after the last event (none in a step that ends with the optimizer).
    na, nf = seen
    while kr < len(returns) and returns[kr][0] <= na and returns[kr][1] <= nf:
        trace.forward_returns.append(trace.num_events)
        kr += 1
    need_a, need_f = rel[-1][1], rel[-1][2]
    if na < need_a or nf < need_f:
        raise TraceRefused(
            f"the history holds {na} allocations and {nf} frees, but the allocator counted "
            f"{need_a} and {need_f} by the end of step 1's optimizer phase"
        )
    if end_counters is not None:
        ea, ef = end_counters[0] - a0, end_counters[1] - f0
        if na > ea or nf > ef:
            raise TraceRefused(
                f"the history holds {na} allocations and {nf} frees, more than the "
                f"{ea} and {ef} the allocator counted since recording began"
            )

    segments = _segments_of(snapshot.get("segments") or [], device)
    trace.segments = [s[:3] for s in segments]
    trace.segment_homes = [s[3] for s in segments]
    trace.settings = settings_from_snapshot(snapshot)
    trace.check()
    return trace


def _segments_of(snapshot_segments: Any, device: int) -> list[tuple[Any, ...]]:
    """``device``'s segments of a snapshot, by address: (address, small, [(size,
    allocated)], (stream, pool_id, expandable))."""
    segments = []
    for seg in snapshot_segments:
        if seg.get("device", device) != device:
            continue
        blocks = seg.get("blocks") or []
        if not blocks:
            continue
        if "address" in blocks[0]:
            blocks = sorted(blocks, key=lambda b: b["address"])
        segments.append(
            (
                int(seg["address"]),
                seg.get("segment_type") == "small",
                [(int(b["size"]), b.get("state") != "inactive") for b in blocks],
                (
                    _stream(seg.get("stream")),
                    _pool_id(seg.get("segment_pool_id")),
                    bool(seg.get("is_expandable", False)),
                ),
            )
        )
    segments.sort(key=lambda s: s[0])
    return segments


# A layout rides on one marker in one MarkerBatch; the marker's other fields
# and the batch's framing take well under 1 KiB.
LAYOUT_MAX_BYTES = MAX_BATCH_BYTES - 1024


class Layout:
    """The large-pool segments of one device at one marker (``Marker.layout_segments``)."""

    __slots__ = ("segments", "nbytes")

    def __init__(self, segments: list[tuple[Any, ...]]) -> None:
        self.segments = segments
        # Encoded size of the repeated field (1-byte tag, as for a trace's segments).
        self.nbytes = sum(_segment_bytes(*s) for s in segments)

    def fill(self, marker: Any) -> None:
        """Adds the segments to a ``pb.Marker``."""
        for address, small, blocks, home in self.segments:
            _add_segment(marker.layout_segments, address, small, blocks, home)


def layout_from_segments(
    snapshot_segments: Any, device: int, gradient_addresses: Iterable[int] = ()
) -> Layout:
    """The :class:`Layout` of ``torch.cuda.memory_snapshot()``'s segments on ``device``.
    Small-pool segments (2 MiB each, requests of 1 MiB or less) are left out: the
    agent asks only where large requests fit, and they are most of the blocks.
    An allocated block that starts at one of ``gradient_addresses`` (the
    parameters' gradients, :func:`_torch.gradient_addresses`) is flagged
    ``AllocatorBlock.gradient``: the agent frees it before step 2's forward when
    the gradients are set to None between steps."""
    grads = frozenset(gradient_addresses)
    out = []
    for address, small, blocks, home in _segments_of(snapshot_segments, device):
        if small:
            continue
        if grads:
            flagged = []
            at = address
            for size, allocated in blocks:  # blocks tile their segment, by address
                flagged.append((size, allocated, allocated and at in grads))
                at += size
            blocks = flagged
        out.append((address, small, blocks, home))
    return Layout(out)


class LayoutSnapshots:
    """Step 1's segment layouts at its OPTIMIZER_BEGIN and OPTIMIZER_END, once per run,
    for the agent's prediction when no allocator trace is sent (``_Runtime._emit``
    asks only then): they show which cached blocks the optimizer state was carved
    out of, which step 2's activations will need anew. ``torch.cuda.memory_snapshot()``
    without history; a layout over :data:`LAYOUT_MAX_BYTES` is not sent (debug log),
    and any failure turns the feature off for the run with one warning."""

    def __init__(self) -> None:
        self.begin_sent = False
        self.done = False

    def take(
        self,
        client: Any,
        kind: int,
        device: int,
        parameters: Callable[[], Iterable[Any]] = lambda: (),
    ) -> Optional[Layout]:
        """The layout to send on step 1's marker ``kind``, or None; the blocks of
        the gradients of ``parameters()`` (the watched model's) flagged."""
        if self.done or kind not in (OPTIMIZER_BEGIN, OPTIMIZER_END):
            return None
        if kind == OPTIMIZER_BEGIN and self.begin_sent:
            return None
        if kind == OPTIMIZER_END and not self.begin_sent:
            self.done = True  # one without the other tells the agent nothing
            return None
        try:
            layout = layout_from_segments(
                _torch.memory_layout(), device, _torch.gradient_addresses(parameters())
            )
        except Exception as e:
            self.done = True
            log.warning(
                "stepwatch: could not take the allocator's segment snapshot (%r); step 1's "
                "layout is not sent (the agent guesses it; training goes on)",
                e,
            )
            return None
        if layout.nbytes > LAYOUT_MAX_BYTES:
            self.done = True
            log.debug(
                "stepwatch: step 1's segment layout takes %d bytes, more than the %d one marker "
                "may carry; not sent (the agent guesses the layout)",
                layout.nbytes,
                LAYOUT_MAX_BYTES,
            )
            return None
        if kind == OPTIMIZER_BEGIN:
            self.begin_sent = True
        else:
            self.done = True
        client.counters["layout_snapshots_sent"] += 1
        return layout


_U64 = (1 << 64) - 1


def _stream(value: Any) -> int:
    """A snapshot's stream (a cudaStream_t as an int; 0: the default stream)."""
    try:
        return int(value or 0) & _U64
    except (TypeError, ValueError):
        return 0


def _pool_id(value: Any) -> int:
    """A snapshot's ``segment_pool_id`` (a pair; (0, 0): the default pool) as one
    number, 0 for the default pool. Both halves go in, so distinct pools stay apart."""
    if not value:
        return 0
    try:
        first, second = (int(v) for v in value)
    except (TypeError, ValueError):
        return 0
    return ((first & 0xFFFFFFFF) << 32 | (second & 0xFFFFFFFF)) & _U64


def settings_from_snapshot(snapshot: Any) -> Optional[dict[str, Any]]:
    """The AllocatorSettings fields from a snapshot's ``allocator_settings`` (torch
    2.5 and later), or None when it has none (the agent then assumes PyTorch's
    defaults). What the allocator really runs with, whatever set it (the
    environment, ``torch.cuda.memory._set_allocator_settings``)."""
    raw = snapshot.get("allocator_settings") if isinstance(snapshot, dict) else None
    if not raw:
        return None
    out: dict[str, Any] = {}
    max_split = int(raw.get("max_split_size", -1) or -1)
    out["max_split_size_bytes"] = max_split if max_split > 0 else 0
    divisions = raw.get("roundup_power2_divisions") or {}
    if isinstance(divisions, dict):
        ordered = [int(v) for _, v in sorted(divisions.items(), key=lambda kv: int(kv[0]))]
    else:
        ordered = [int(v) for v in divisions]
    if any(ordered):
        out["roundup_power2_divisions"] = [max(0, min(d, 1 << 20)) for d in ordered]
    out["garbage_collection_threshold"] = float(raw.get("garbage_collection_threshold", 0.0))
    out["expandable_segments"] = bool(raw.get("expandable_segments", False))
    out["alloc_conf"] = str(raw.get("PYTORCH_CUDA_ALLOC_CONF", "") or "")[:1024]
    return out


# ------------------------------------------------------------------ allocator settings
# The agent's allocator model follows PyTorch's caching allocator with
# max_split_size_mb, roundup_power2_divisions and expandable_segments (read from
# the snapshot's allocator_settings and sent with the trace). These change how
# blocks are released in ways it does not model, so the history is not even
# recorded under them; the agent also refuses a trace whose settings (from the
# snapshot, whatever set them) show one.
_UNMODELLED_SETTINGS: dict[str, Callable[[str], bool]] = {
    "garbage_collection_threshold": lambda v: True,
    "backend": lambda v: v.strip() != "native",
}


def unmodelled_allocator_settings(env: Optional[dict[str, str]] = None) -> list[str]:
    """Settings in ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` that the
    agent's allocator model does not follow, as ``key:value`` strings."""
    source: Mapping[str, str] = os.environ if env is None else env
    found = []
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in source.get(var, "").split(","):
            key, _, value = item.partition(":")
            key = key.strip()
            if key in _UNMODELLED_SETTINGS and _UNMODELLED_SETTINGS[key](value):
                found.append(f"{key}:{value.strip()}")
    return found


# ------------------------------------------------------------------ recorder
_IDLE, _RECORDING, _DONE = 0, 1, 2


class Recorder:
    """Records step 1's allocator history once per process; see the module docstring.

    In ``_Runtime._emit``, for each marker: :meth:`on_marker` (may start or stop
    recording), then the marker's one read of the allocator's stats, then
    :meth:`note` with that read while recording; when it returns True (step 1's
    OPTIMIZER_END), :meth:`finish` runs once the marker is queued.
    Any failure turns the feature off for the process with one warning.
    """

    def __init__(self, max_entries: int = HISTORY_MAX_ENTRIES) -> None:
        self.state = _IDLE
        self.max_entries = max_entries
        self.device = 0
        self.marks: list[Mark] = []
        # (active.all.allocated, active.all.freed) each time the watched model's
        # forward returned during step 1
        self.returns: list[tuple[int, int]] = []

    @property
    def done(self) -> bool:
        return self.state == _DONE

    def forward_returned(self) -> None:
        """The watched model's forward has returned (its forward hook): note where,
        in the allocator's counters. Only while step 1 is recording, and at most
        :data:`MAX_FORWARD_RETURNS` times; a failed read notes nothing."""
        if self.state != _RECORDING or len(self.returns) >= MAX_FORWARD_RETURNS:
            return
        stats = _torch.allocator_stats(self.device)
        if stats is not None:
            self.returns.append(_torch.allocator_event_counters(stats))

    def on_marker(
        self,
        client: Any,
        kind: int,
        step: int,
        device: Optional[int],
        enabled: Callable[[], bool],
    ) -> bool:
        """Before a marker reads the allocator's stats: start recording at step 1's
        STEP_BEGIN (``enabled()`` is asked then, once), stop when step 1 ends or
        dies before its optimizer phase.

        Returns True when this marker belongs to the recording: pass the stats it
        reads (after this call) to :meth:`note`.
        """
        state = self.state
        if state == _DONE:
            return False
        if state == _IDLE:
            if kind != STEP_BEGIN:
                return False
            if step != 1 or device is None or not enabled() or not _torch.cuda_available():
                self.state = _DONE
                return False
            self._start(client, device)
            return self.state == _RECORDING
        # Recording: a step-1 phase marker, else step 1 ended or died first.
        if step != 1 or kind == STEP_BEGIN or kind not in PHASE_KINDS:
            why = "died" if kind == OOM else "ended without an optimizer phase"
            log.debug("stepwatch: step 1 %s; no allocator trace", why)
            self._stop_quietly()
            return False
        return True

    def note(self, client: Any, kind: int, stats: Optional[dict[str, Any]]) -> bool:
        """The marker's one read of the allocator's stats (:func:`_torch.allocator_stats`,
        None when it failed): note its event counters.

        Returns True at step 1's OPTIMIZER_END: call :meth:`finish` once the
        marker is queued.
        """
        if self.state != _RECORDING:
            return False
        try:
            if stats is None:
                raise RuntimeError("torch._C._cuda_memoryStats failed")
            self.marks.append((kind, *_torch.allocator_event_counters(stats)))
        except Exception as e:
            self._fail(client, "could not read the allocator's counters", e)
            return False
        return kind == OPTIMIZER_END

    def _start(self, client: Any, device: int) -> None:
        self.state = _DONE
        try:
            if not _torch.memory_history_supported():
                log.warning(
                    "stepwatch: this PyTorch has no torch.cuda.memory._record_memory_history/"
                    "_snapshot; step 1's allocator trace is off (the agent predicts without it)"
                )
                return
            unmodelled = unmodelled_allocator_settings()
            if unmodelled:
                log.info(
                    "stepwatch: the CUDA allocator runs with %s, which the agent's allocator "
                    "model does not follow; no allocator trace is sent (the agent predicts "
                    "step 2 from the markers)",
                    ", ".join(unmodelled),
                )
                return
            if _torch.memory_history_enabled():
                log.info(
                    "stepwatch: CUDA memory history is already being recorded (by the training "
                    "script?); stepwatch leaves it alone and sends no allocator trace"
                )
                return
            _torch.start_memory_history(self.max_entries)
            self.state = _RECORDING
            self.device = device
            self.marks = []  # STEP_BEGIN's counters come next, through note()
            self.returns = []
        except Exception as e:
            self._fail(client, "could not start recording the allocator's history", e)

    def finish(self, client: Any) -> None:
        """After step 1's OPTIMIZER_END: snapshot, stop recording, queue the trace."""
        if self.state != _RECORDING:
            return
        marks, self.marks = self.marks, []
        returns, self.returns = self.returns, []
        try:
            snapshot = _torch.memory_snapshot()
            stats = _torch.allocator_stats(self.device)
            if stats is None:
                raise RuntimeError("torch._C._cuda_memoryStats failed")
            end = _torch.allocator_event_counters(stats)
        except Exception as e:
            self._fail(client, "could not take the allocator snapshot", e)
            return
        self._stop_quietly()
        try:
            trace = trace_from_snapshot(
                snapshot,
                self.device,
                marks,
                end_counters=end,
                max_entries=self.max_entries,
                forward_returns=returns,
            )
        except TraceRefused as e:
            client.counters["allocator_traces_refused"] += 1
            log.warning(
                "stepwatch: step 1's allocator trace is not sent: %s; the agent predicts "
                "step 2 without it (training goes on)",
                e,
            )
            return
        except Exception as e:
            self._fail(client, "could not read the allocator snapshot", e)
            return
        if trace.num_events == 0:
            log.debug("stepwatch: step 1 made no CUDA allocations; no allocator trace")
            return
        client.send_allocator_trace(trace)

    def abandon(self) -> None:
        """A new run begins: stop recording (if this run's step 1 still was) and
        send nothing; the new run gets a recorder of its own."""
        self._stop_quietly()

    def _stop_quietly(self) -> None:
        was_recording = self.state == _RECORDING
        self.state = _DONE
        self.marks = []
        self.returns = []
        if not was_recording:
            return
        try:
            _torch.stop_memory_history()
        except Exception as e:
            log.debug("stepwatch: could not stop recording the allocator's history: %r", e)

    def _fail(self, client: Any, what: str, e: BaseException) -> None:
        self._stop_quietly()
        client.counters["allocator_traces_refused"] += 1
        log.warning(
            "stepwatch: %s (%r); step 1's allocator trace is off (training goes on)", what, e
        )
