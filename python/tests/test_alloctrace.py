"""Step 1's allocator trace: snapshot -> chunks, phase tagging, limits, and the recorder
in a real watch() loop (CPU torch with torch.cuda's functions replaced by a fake
caching allocator, see fake_cuda.py: CPU torch cannot record CUDA history)."""

from __future__ import annotations

import logging
import os
from array import array

import pytest
from conftest import FLUSH_S, small_model, summary, train
from fake_cuda import FakeCuda, FakeWorkload

import stepwatch
from stepwatch import _alloctrace as at
from stepwatch import _torch
from stepwatch._client import (
    BACKWARD_BEGIN,
    FORWARD_BEGIN,
    OPTIMIZER_BEGIN,
    OPTIMIZER_END,
    STEP_BEGIN,
    STEP_END,
    Client,
    _StreamState,
)
from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

try:
    import torch
except ImportError:  # pragma: no cover - run-tests.sh installs it
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")

LIMIT = 64 * 1024  # the agent's per-message limit
START = dict(
    enabled="all",
    context=None,
    stacks="python",
    max_entries=at.HISTORY_MAX_ENTRIES,
    clear_history=True,
    skip_actions=["free_requested"],
)


def counters(fake):
    s = fake.memory_stats(0)
    return s["active.all.allocated"], s["active.all.freed"]


def start(fake):
    fake.record_memory_history(**START)
    return [(STEP_BEGIN, *counters(fake))]


def expected_events(fake, phase_of=lambda label: label):
    """(action, address, size, phase) of what the fake did while recording; the
    segment events (uncounted by the allocator's counters) take the phase of the
    allocation after them (segment_alloc) or of the event before them
    (segment_free). ``phase_of`` maps the tests' labels to phases."""
    actions = {
        "alloc": at.ACTION_ALLOC,
        "free": at.ACTION_FREE,
        "segment_alloc": at.ACTION_SEGMENT_ALLOC,
        "segment_free": at.ACTION_SEGMENT_FREE,
    }
    log = [entry for entry in fake.log if entry[4]]
    out = []
    phase = STEP_BEGIN
    for i, (a, addr, size, label, _) in enumerate(log):
        if a == "segment_alloc":
            label = next(e[3] for e in log[i:] if e[0] == "alloc")
        if label is not None:
            phase = phase_of(label)
        out.append((actions[a], addr, size, phase))
    return out


def decode(chunks):
    segs = [s for c in chunks for s in c.segments]
    evs = [(e.action, e.address, e.size, e.phase) for c in chunks for e in c.events]
    return segs, evs


def chunks_of(trace, **kw):
    msgs = list(trace.messages(pb, **kw))
    for m in msgs:
        assert m.WhichOneof("kind") == "allocator_trace"
    return msgs


# ------------------------------------------------------------ snapshot format
@needs_torch
def test_snapshot_format_is_the_installed_torchs():
    """The fields trace_from_snapshot reads are those torch documents (and the
    counters those memory_stats documents), so a torch that renames them fails here."""
    doc = torch.cuda.memory._snapshot.__doc__ or ""
    for word in (
        "segments: List[Segment]",
        "device_traces: List[List[TraceEntry]]",
        "address: int",
        "segment_type",
        "blocks: List[Block]",
        "size: int",
        "state:",
        '"inactive"',
        '"active_allocated"',
        "action:",
        '"free_completed"',
        '"oom"',
        "addr: int",
    ):
        assert word in doc, word
    stats_doc = torch.cuda.memory_stats.__doc__ or ""
    assert '"active.{all,large_pool,small_pool}.{current,peak,allocated,freed}"' in stats_doc
    import inspect

    # stepwatch reads the nested dict memory_stats flattens, from the function
    # memory_stats_as_nested_dict calls (tests/fake_cuda.py stands in for it).
    nested = inspect.getsource(torch.cuda.memory.memory_stats_as_nested_dict)
    assert "torch._C._cuda_memoryStats(device)" in nested
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    for name in ("enabled", "context", "stacks", "max_entries"):
        assert name in params, name


@needs_torch
def test_cuda_available_is_torchs(monkeypatch):
    from stepwatch import _torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _torch.cuda_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not _torch.cuda_available()


# --------------------------------------------------------------- conversion
def test_segments_blocks_and_events():
    fake = FakeCuda()
    weights = [fake.alloc(n) for n in (4096, 5_000_000)]  # before step 1: not in the trace
    marks = start(fake)
    marks.append((FORWARD_BEGIN, *counters(fake)))
    a = fake.alloc(1000, FORWARD_BEGIN)
    b = fake.alloc(2_500_000, FORWARD_BEGIN)
    marks.append((BACKWARD_BEGIN, *counters(fake)))
    fake.free(a, BACKWARD_BEGIN)
    fake.free(weights[0], BACKWARD_BEGIN)  # a free of something older than the trace
    marks.append((OPTIMIZER_BEGIN, *counters(fake)))
    marks.append((OPTIMIZER_END, *counters(fake)))
    snap = fake.snapshot()
    trace = at.trace_from_snapshot(snap, 0, marks, end_counters=counters(fake))

    # free_requested and segment_alloc entries are left out; sizes are the requested ones
    assert list(trace.events()) == expected_events(fake)
    assert list(trace.events()) == [
        (at.ACTION_ALLOC, a, 1000, FORWARD_BEGIN),
        (at.ACTION_ALLOC, b, 2_500_000, FORWARD_BEGIN),
        (at.ACTION_FREE, a, 1000, BACKWARD_BEGIN),
        (at.ACTION_FREE, weights[0], 4096, BACKWARD_BEGIN),
    ]
    # segments: address order, pool, blocks tiling total_size, allocated = not "inactive"
    want = [
        (
            s["address"],
            s["segment_type"] == "small",
            [(blk["size"], blk["state"] != "inactive") for blk in s["blocks"]],
        )
        for s in snap["segments"]
    ]
    assert trace.segments == want
    assert [s[0] for s in trace.segments] == sorted(s[0] for s in trace.segments)
    for (_, _, blocks), s in zip(trace.segments, snap["segments"]):
        assert sum(size for size, _ in blocks) == s["total_size"]
    assert any(small for _, small, _ in trace.segments)
    assert any(not small for _, small, _ in trace.segments)
    live = {addr for addr in fake.live}
    allocated = {
        seg_addr + sum(sz for sz, _ in blocks[:i])
        for seg_addr, _, blocks in trace.segments
        for i, (_, used) in enumerate(blocks)
        if used
    }
    assert allocated == live

    (msg,) = chunks_of(trace)
    c = msg.allocator_trace
    assert c.step == 1 and c.last
    assert [(s.address, s.small_pool) for s in c.segments] == [(s[0], s[1]) for s in want]
    assert [[(b.size, b.allocated) for b in s.blocks] for s in c.segments] == [s[2] for s in want]
    assert decode([c])[1] == list(trace.events())


def test_other_devices_are_left_out():
    fake = FakeCuda()
    marks = start(fake)
    x = fake.alloc(1000, STEP_BEGIN)
    marks.append((OPTIMIZER_END, *counters(fake)))
    snap = fake.snapshot()
    other = dict(snap["segments"][0], device=1, address=0x100000)
    snap["segments"].append(other)
    snap["device_traces"].append([{"action": "alloc", "addr": 1, "size": 8, "stream": 0}])
    trace = at.trace_from_snapshot(snap, 0, marks)
    assert [s[0] for s in trace.segments] == [s["address"] for s in snap["segments"][:-1]]
    seg = snap["segments"][0]["address"]
    assert list(trace.events()) == [
        (at.ACTION_SEGMENT_ALLOC, seg, 2 << 20, STEP_BEGIN),
        (at.ACTION_ALLOC, x, 1000, STEP_BEGIN),
    ]
    # a device without history: nothing to tag, and the markers' counts are missing
    with pytest.raises(at.TraceRefused, match="counted"):
        at.trace_from_snapshot(snap, 3, marks)


# allocator_settings as torch 2.15's _snapshot() gives them (read on fake CUDA with
# PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:4,max_split_size_mb:64)
TORCH_SETTINGS = {
    "PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:4,max_split_size_mb:64",
    "max_split_size": 64 << 20,
    "garbage_collection_threshold": 0.0,
    "expandable_segments": False,
    "pinned_num_register_threads": 1,
    "release_lock_on_cudamalloc": False,
    "pinned_use_cuda_host_register": False,
    "graph_capture_record_stream_reuse": False,
    "max_round_threshold": -1,
    "max_cached_size": -1,
    "roundup_power2_divisions": {str(1 << i): 4 for i in reversed(range(16))},
}


def test_settings_from_snapshot():
    assert at.settings_from_snapshot({}) is None
    assert at.settings_from_snapshot({"allocator_settings": TORCH_SETTINGS}) == {
        "max_split_size_bytes": 64 << 20,
        "roundup_power2_divisions": [4] * at.ROUNDUP_INTERVALS,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": False,
        "alloc_conf": "roundup_power2_divisions:4,max_split_size_mb:64",
    }
    # defaults: -1 is unlimited, no divisions
    default = dict(
        TORCH_SETTINGS,
        PYTORCH_CUDA_ALLOC_CONF="",
        max_split_size=-1,
        roundup_power2_divisions={str(1 << i): 0 for i in range(16)},
    )
    got = at.settings_from_snapshot({"allocator_settings": default})
    assert got["max_split_size_bytes"] == 0 and "roundup_power2_divisions" not in got
    # intervals ordered by size, not by the dict's order
    mixed = dict(TORCH_SETTINGS, roundup_power2_divisions={"2": 8, "1": 2, "4": 0})
    assert at.settings_from_snapshot({"allocator_settings": mixed})["roundup_power2_divisions"] == [
        2,
        8,
        0,
    ]


def test_streams_pools_expandable_and_settings_go_on_the_wire():
    fake = FakeCuda()
    marks = start(fake)
    x = fake.alloc(3 << 20, FORWARD_BEGIN)
    fake.free(x, FORWARD_BEGIN)
    fake.empty_cache()
    y = fake.alloc(1000, FORWARD_BEGIN)
    marks.append((OPTIMIZER_END, *counters(fake)))
    snap = fake.snapshot()
    side = 94169048541728  # a cudaStream_t, as the snapshot gives it
    for e in snap["device_traces"][0]:
        e["stream"] = side
    seg = snap["segments"][0]
    seg.update(stream=side, segment_pool_id=(1, 3), is_expandable=True)
    snap["allocator_settings"] = TORCH_SETTINGS
    trace = at.trace_from_snapshot(snap, 0, marks, end_counters=counters(fake))
    assert [e[0] for e in trace.events()] == [
        at.ACTION_SEGMENT_ALLOC,
        at.ACTION_ALLOC,
        at.ACTION_FREE,
        at.ACTION_SEGMENT_FREE,
        at.ACTION_SEGMENT_ALLOC,
        at.ACTION_ALLOC,
    ]
    assert list(trace.ev_stream) == [side] * 6
    assert trace.segment_homes == [(side, (1 << 32) | 3, True)]
    for budget in (LIMIT, 200):
        msgs = chunks_of(trace, budget=budget)
        assert all(m.ByteSize() <= budget for m in msgs)
        first = msgs[0].allocator_trace
        assert first.HasField("settings")
        assert not any(m.allocator_trace.HasField("settings") for m in msgs[1:])
        assert first.settings.max_split_size_bytes == 64 << 20
        assert list(first.settings.roundup_power2_divisions) == [4] * 16
        assert first.settings.alloc_conf == TORCH_SETTINGS["PYTORCH_CUDA_ALLOC_CONF"]
        segs = [s for m in msgs for s in m.allocator_trace.segments]
        assert [(s.address, s.stream, s.pool_id, s.expandable) for s in segs] == [
            (seg["address"], side, (1 << 32) | 3, True)
        ]
        evs = [e for m in msgs for e in m.allocator_trace.events]
        assert [(e.action, e.address, e.stream) for e in evs] == [
            (a, addr, side) for a, addr, _, _ in trace.events()
        ]
    assert y in fake.live


def test_phase_tagging_from_counters():
    """Each event gets the marker that opened its phase, placed by the counters at the
    markers, not by time: the trace's time_us are scrambled here."""
    fake = FakeCuda()
    old = fake.alloc(3000)
    marks = start(fake)
    p = fake.alloc(600, STEP_BEGIN)  # prologue (e.g. the batch moved to the GPU)
    for micro in range(2):  # gradient accumulation: FORWARD/BACKWARD twice
        marks.append((FORWARD_BEGIN, *counters(fake)))
        acts = [fake.alloc(n, FORWARD_BEGIN) for n in (512, 70_000, 1_200_000)]
        marks.append((BACKWARD_BEGIN, *counters(fake)))
        for x in acts:
            fake.free(x, BACKWARD_BEGIN)
        fake.alloc(4096 + micro, BACKWARD_BEGIN)
    fake.free(p, BACKWARD_BEGIN)
    marks.append((OPTIMIZER_BEGIN, *counters(fake)))
    fake.alloc(2_000_000, OPTIMIZER_BEGIN)  # state
    fake.free(old, OPTIMIZER_BEGIN)
    marks.append((OPTIMIZER_END, *counters(fake)))
    # after OPTIMIZER_END, before the snapshot (another thread): the epilogue
    e = fake.alloc(100, OPTIMIZER_END)
    fake.free(e, OPTIMIZER_END)
    snap = fake.snapshot()
    for i, entry in enumerate(snap["device_traces"][0]):
        entry["time_us"] = (i * 7919) % 101
    trace = at.trace_from_snapshot(snap, 0, marks, end_counters=counters(fake))
    got = list(trace.events())
    assert got == expected_events(fake)
    assert {ph for *_, ph in got} == {
        STEP_BEGIN,
        FORWARD_BEGIN,
        BACKWARD_BEGIN,
        OPTIMIZER_BEGIN,
        OPTIMIZER_END,
    }


def test_forward_returns_become_event_positions_and_go_in_the_first_chunk():
    """Where the model's forward returned (its counters) is the position of the
    first event after it: the loss the loop computes after the model comes later."""
    fake = FakeCuda()
    marks = start(fake)
    returns = []
    for _ in range(2):  # two micro-batches
        marks.append((FORWARD_BEGIN, *counters(fake)))
        x = fake.alloc(512, FORWARD_BEGIN)
        logits = fake.alloc(70_000, FORWARD_BEGIN)
        fake.free(x, FORWARD_BEGIN)
        returns.append(counters(fake))  # model(...) returned here
        loss = fake.alloc(512, FORWARD_BEGIN)
        marks.append((BACKWARD_BEGIN, *counters(fake)))
        fake.free(logits, BACKWARD_BEGIN)
        fake.free(loss, BACKWARD_BEGIN)
    marks.append((OPTIMIZER_BEGIN, *counters(fake)))
    marks.append((OPTIMIZER_END, *counters(fake)))
    trace = at.trace_from_snapshot(
        fake.snapshot(), 0, marks, end_counters=counters(fake), forward_returns=returns
    )
    sizes = [size for _, _, size, _ in trace.events()]
    # each return sits right before its micro-batch's loss (512 B after the free)
    assert [sizes[r] for r in trace.forward_returns] == [512, 512]
    assert [trace.ev_action[r - 1] for r in trace.forward_returns] == [at.ACTION_FREE] * 2
    assert trace.forward_returns[0] < trace.forward_returns[1] <= trace.num_events
    msgs = chunks_of(trace)
    assert list(msgs[0].allocator_trace.forward_returns) == trace.forward_returns
    assert all(not m.allocator_trace.forward_returns for m in msgs[1:])
    assert all(m.ByteSize() <= LIMIT for m in msgs)


def test_a_phase_without_events_and_frees_counted_apart():
    """Markers with equal counters (an empty phase) hand their events to the later one;
    allocations and frees are placed by their own counters."""
    fake = FakeCuda()
    x = fake.alloc(1000)
    marks = start(fake)
    marks.append((FORWARD_BEGIN, *counters(fake)))
    marks.append((BACKWARD_BEGIN, *counters(fake)))  # forward allocated nothing
    fake.free(x, BACKWARD_BEGIN)
    marks.append((OPTIMIZER_BEGIN, *counters(fake)))
    y = fake.alloc(2000, OPTIMIZER_BEGIN)
    marks.append((OPTIMIZER_END, *counters(fake)))
    trace = at.trace_from_snapshot(fake.snapshot(), 0, marks)
    assert list(trace.events()) == [
        (at.ACTION_FREE, x, 1000, BACKWARD_BEGIN),
        (at.ACTION_ALLOC, y, 2000, OPTIMIZER_BEGIN),
    ]


def big_trace(fake, n_pairs=12_000, keep_every=7):
    marks = start(fake)
    marks.append((FORWARD_BEGIN, *counters(fake)))
    kept = []
    for i in range(n_pairs):
        a = fake.alloc(512 * (1 + i % 37) + i % 3, FORWARD_BEGIN)
        if i % keep_every == 0:
            kept.append(a)
        else:
            fake.free(a, FORWARD_BEGIN)
    marks.append((BACKWARD_BEGIN, *counters(fake)))
    for i in range(n_pairs // 10):
        fake.alloc(1_100_000 + 4096 * i, BACKWARD_BEGIN)
    marks.append((OPTIMIZER_BEGIN, *counters(fake)))
    marks.append((OPTIMIZER_END, *counters(fake)))
    return at.trace_from_snapshot(fake.snapshot(), 0, marks, end_counters=counters(fake))


def test_chunks_fit_the_message_limit_in_order_with_last_on_the_final_one():
    fake = FakeCuda()
    trace = big_trace(fake)
    assert trace.num_events > 20_000 and len(trace.segments) > 10
    msgs = chunks_of(trace)
    assert len(msgs) > 5
    sizes = [m.ByteSize() for m in msgs]
    assert max(sizes) <= at.CHUNK_BYTES <= LIMIT
    assert min(sizes[:-1]) > at.CHUNK_BYTES - 200  # chunks are filled, not wasted
    chunks = [m.allocator_trace for m in msgs]
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert {c.step for c in chunks} == {1}
    segs, evs = decode(chunks)
    assert [(s.address, s.small_pool, [(b.size, b.allocated) for b in s.blocks]) for s in segs] == [
        (a, small, blocks) for a, small, blocks in trace.segments
    ]
    assert evs == list(trace.events()) == expected_events(fake)
    # segments come before events: no chunk has segments after one that had events
    first_event_chunk = next(i for i, c in enumerate(chunks) if c.events)
    assert not any(c.segments for c in chunks[first_event_chunk + 1 :])


@pytest.mark.parametrize("budget", [200, 1000, 5000])
def test_chunks_fit_small_budgets_exactly(budget):
    trace = at.AllocatorTrace()
    trace.segments = [
        (0x7F0000000000 + i * (2 << 20), i % 2 == 0, [(2 << 20, False)]) for i in range(50)
    ]
    for i in range(3000):
        trace.add_event(1 + i % 2, (1 << 47) + 512 * i, 1 + i * 4099, 1 + i % 5)
    trace.check(budget)
    msgs = chunks_of(trace, budget=budget)
    assert max(m.ByteSize() for m in msgs) <= budget
    segs, evs = decode([m.allocator_trace for m in msgs])
    assert len(segs) == 50 and evs == list(trace.events())
    assert [m.allocator_trace.last for m in msgs].count(True) == 1 and msgs[-1].allocator_trace.last


def test_empty_trace_is_one_last_chunk():
    (msg,) = chunks_of(at.AllocatorTrace())
    assert msg.allocator_trace.last and msg.allocator_trace.step == 1


# ------------------------------------------------------------------- limits
def test_limits_on_events_and_blocks():
    t = at.AllocatorTrace()
    n = at.MAX_TRACE_EVENTS
    t.ev_action = array("B", [1]) * n
    t.ev_address = array("Q", [1 << 40]) * n
    t.ev_size = array("Q", [512]) * n
    t.ev_phase = array("B", [2]) * n
    t.check()  # exactly the limit is fine
    t.add_event(2, 1 << 40, 512, 3)
    with pytest.raises(at.TraceRefused, match="262144"):
        t.check()

    t = at.AllocatorTrace()
    per = 4096  # 2 MiB small segments of 512-byte blocks: about 32 KiB each, fits a chunk
    nseg = at.MAX_TRACE_BLOCKS // per
    t.segments = [(i << 30, True, [(512, i % 2 == 0)] * per) for i in range(1, nseg + 1)]
    t.check()
    t.segments.append((1 << 50, True, [(512, True)]))
    with pytest.raises(at.TraceRefused, match="blocks"):
        t.check()


def test_a_segment_that_cannot_fit_one_message_is_refused():
    t = at.AllocatorTrace()
    t.segments = [(1 << 40, False, [(2 << 20, True), (2 << 20, False)] * 4000)]
    with pytest.raises(at.TraceRefused, match="more than one message"):
        t.check()


def test_limits_through_trace_from_snapshot():
    fake = FakeCuda()
    fake.record_memory_history(**dict(START, max_entries=1 << 30))
    marks = [(STEP_BEGIN, *counters(fake))]
    for _ in range(at.MAX_TRACE_EVENTS // 2 + 1):
        fake.free(fake.alloc(512, STEP_BEGIN), STEP_BEGIN)
    marks.append((OPTIMIZER_END, *counters(fake)))
    with pytest.raises(at.TraceRefused, match="262147 allocator events"):
        at.trace_from_snapshot(fake.snapshot(), 0, marks, max_entries=None)


# --------------------------------------------------------- incomplete traces
def small_step(fake):
    marks = start(fake)
    marks.append((FORWARD_BEGIN, *counters(fake)))
    xs = [fake.alloc(n, FORWARD_BEGIN) for n in (512, 1024, 4096)]
    marks.append((BACKWARD_BEGIN, *counters(fake)))
    fake.free(xs[0], BACKWARD_BEGIN)
    marks.append((OPTIMIZER_BEGIN, *counters(fake)))
    marks.append((OPTIMIZER_END, *counters(fake)))
    return marks


def test_ring_buffer_full_is_refused():
    fake = FakeCuda()
    marks = small_step(fake)
    snap = fake.snapshot()
    n = len(snap["device_traces"][0])
    at.trace_from_snapshot(snap, 0, marks, max_entries=n + 1)
    with pytest.raises(at.TraceRefused, match="ring buffer"):
        at.trace_from_snapshot(snap, 0, marks, max_entries=n)


def test_an_oom_in_the_history_is_left_out_and_the_trace_kept():
    """A caught OutOfMemoryError during step 1 leaves an "oom" entry in the
    history. It changed no block (the cache release before it has entries of
    its own), so the trace is the same as without it; it used to be refused."""
    fake = FakeCuda()
    marks = start(fake)
    fake.alloc(512)
    fake.oom(80 << 30)
    fake.alloc(4096)
    marks.append((OPTIMIZER_END, *counters(fake)))
    snap = fake.snapshot()
    assert "oom" in [e["action"] for e in snap["device_traces"][0]]
    trace = at.trace_from_snapshot(snap, 0, marks)
    kept = [e for e in snap["device_traces"][0] if e["action"] != "oom"]
    plain = at.trace_from_snapshot(dict(snap, device_traces=[kept]), 0, marks)
    assert trace.num_events == plain.num_events == len(kept)
    chunks = [m.allocator_trace for m in trace.messages(pb)]
    assert decode(chunks) == decode([m.allocator_trace for m in plain.messages(pb)])
    assert [e[0] for e in decode(chunks)[1]].count(at.ACTION_ALLOC) == 2


def test_lost_entries_are_refused():
    fake = FakeCuda()
    marks = small_step(fake)
    snap = fake.snapshot()
    entries = snap["device_traces"][0]
    first_alloc = next(i for i, e in enumerate(entries) if e["action"] == "alloc")
    del entries[first_alloc]  # e.g. overwritten in a ring buffer torch did not report full
    with pytest.raises(at.TraceRefused, match="counted"):
        at.trace_from_snapshot(snap, 0, marks)


def test_history_older_than_the_step_is_refused():
    """More events than the counters say happened since recording began: the history
    was not cleared, and the markers cannot be placed."""
    fake = FakeCuda()
    fake.record_memory_history("all", context=None, stacks="python")
    fake.free(fake.alloc(512), "before")
    marks = start(fake)
    fake.trace.extendleft([{"action": "alloc", "addr": 5, "size": 512, "stream": 0, "time_us": 1}])
    marks.append((FORWARD_BEGIN, *counters(fake)))
    fake.alloc(1000, FORWARD_BEGIN)
    marks.append((OPTIMIZER_END, *counters(fake)))
    snap = fake.snapshot()
    at.trace_from_snapshot(snap, 0, marks)  # without the end counters it cannot tell
    with pytest.raises(at.TraceRefused, match="more than"):
        at.trace_from_snapshot(snap, 0, marks, end_counters=counters(fake))


def test_counters_going_back_are_refused():
    fake = FakeCuda()
    marks = small_step(fake)
    marks[2] = (marks[2][0], marks[2][1] - 5, marks[2][2])  # reset_accumulated_memory_stats
    with pytest.raises(at.TraceRefused, match="went back"):
        at.trace_from_snapshot(fake.snapshot(), 0, marks)


# ------------------------------------------------- the recorder in watch()
def run(monkeypatch, steps=3, accumulate=1, fake=None, **watch_opts):
    """Train a small CPU model under watch(); ``fake`` (else a new one) must be installed."""
    if fake is None:
        fake = FakeCuda().install(monkeypatch, torch)
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    work = FakeWorkload(fake, model, opt)
    handle = stepwatch.watch(model, opt, grad_accumulation_steps=accumulate, **watch_opts)
    work.install_optimizer_hooks()
    try:
        train(model, opt, steps, accumulate, on_step_end=work.zero_grad)
    finally:
        handle.remove()
        work.remove()
    return fake


PHASE_OF_LABEL = {
    "forward": FORWARD_BEGIN,
    "backward": BACKWARD_BEGIN,
    "optimizer": OPTIMIZER_BEGIN,
}


@needs_torch
@pytest.mark.parametrize("accumulate", [1, 2])
def test_trace_sent_once_after_step1_optimizer_end(agent, monkeypatch, accumulate):
    fake = run(monkeypatch, steps=3, accumulate=accumulate)
    per_step = 4 + 2 * accumulate
    ms = agent.wait_markers(3 * per_step)
    assert stepwatch.flush(FLUSH_S)
    assert len(agent.streams) == 1
    s = agent.streams[0]
    order = s.order
    opt_end_1 = order.index(("marker", OPTIMIZER_END, 1))
    step_begin_2 = order.index(("marker", STEP_BEGIN, 2))
    where = [i for i, o in enumerate(order) if o[0] == "trace"]
    assert where, order
    assert where == list(range(opt_end_1 + 1, opt_end_1 + 1 + len(where)))  # one run
    assert where[-1] < step_begin_2
    assert [order[i][1] for i in where] == [False] * (len(where) - 1) + [True]  # sent once
    assert order[where[-1] + 1] == ("marker", STEP_END, 1)
    assert all(size <= LIMIT for size in s.sizes)

    # what the fake allocator did during step 1, tagged with the phase it did it in
    segs, evs = decode(s.traces)
    want = expected_events(fake, PHASE_OF_LABEL.__getitem__)
    assert evs == want
    assert {e[3] for e in evs} == {FORWARD_BEGIN, BACKWARD_BEGIN, OPTIMIZER_BEGIN}
    assert segs and all(sum(b.size for b in seg.blocks) > 0 for seg in segs)
    assert fake.snapshots == 1
    stop = dict(
        enabled=None,
        context=None,
        stacks="python",
        max_entries=1 << 62,  # the fake's default: stepwatch passes none
        clear_history=True,
        skip_actions=None,
    )
    assert fake.history_calls == [START, stop] and not fake.recording
    st = stepwatch.stats()
    assert st["allocator_traces_sent"] == 1 and st["allocator_traces_refused"] == 0, st
    assert st["rejections"] == 0 and st["dropped"] == 0
    assert all(m.HasField("allocator") for m in ms)  # the fake's figures went along
    assert summary(ms)[: 4 + 2 * accumulate][-2:] == [
        ("OPTIMIZER_END", 1, accumulate - 1),
        ("STEP_END", 1, accumulate - 1),
    ]


def opt_out(monkeypatch, how, env, option):
    """Turns a recorder off: by ``env=0`` when ``how`` is "env", else by the watch()
    option ``option=False`` (returned as watch()'s options)."""
    if how == "env":
        monkeypatch.setenv(env, "0")
        return {}
    return {option: False}


@needs_torch
@pytest.mark.parametrize("how", ["kwarg", "env"])
def test_opt_out(agent, monkeypatch, how):
    opts = opt_out(monkeypatch, how, "STEPWATCH_ALLOCATOR_TRACE", "allocator_trace")
    fake = run(monkeypatch, steps=2, **opts)
    agent.wait_markers(12)
    assert stepwatch.flush(FLUSH_S)
    assert fake.history_calls == [] and fake.snapshots == 0
    assert all(not s.traces for s in agent.streams)
    assert stepwatch.stats()["allocator_traces_sent"] == 0


def test_unmodelled_allocator_settings_are_named():
    assert at.unmodelled_allocator_settings({}) == []
    assert (
        at.unmodelled_allocator_settings(
            {
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False,"
                "pinned_use_cuda_host_register:True"
            }
        )
        == []
    )
    # max_split_size_mb, roundup_power2_divisions and expandable segments are
    # modelled (sent with the trace)
    assert at.unmodelled_allocator_settings(
        {
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, max_split_size_mb:128,"
            "roundup_power2_divisions:4,garbage_collection_threshold:0.6"
        }
    ) == ["garbage_collection_threshold:0.6"]
    assert at.unmodelled_allocator_settings({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}) == [
        "backend:cudaMallocAsync"
    ]


@needs_torch
def test_unmodelled_allocator_settings_send_no_trace(agent, monkeypatch, caplog):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    caplog.set_level(logging.INFO, logger="stepwatch")
    fake = run(monkeypatch, steps=2)
    agent.wait_markers(12)
    assert stepwatch.flush(FLUSH_S)
    assert fake.history_calls == [] and fake.snapshots == 0
    assert stepwatch.stats()["allocator_traces_sent"] == 0
    assert any("garbage_collection_threshold:0.6" in r.getMessage() for r in caplog.records)


@needs_torch
def test_keyword_wins_over_the_environment(agent, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ALLOCATOR_TRACE", "0")
    run(monkeypatch, steps=2, allocator_trace=True)
    agent.wait_markers(12)
    assert stepwatch.flush(FLUSH_S)
    assert stepwatch.stats()["allocator_traces_sent"] == 1


@needs_torch
def test_allocator_stats_off_means_no_trace(agent, monkeypatch):
    fake = run(monkeypatch, steps=2, allocator_stats=False)
    agent.wait_markers(12)
    assert fake.history_calls == []


@needs_torch
def test_snapshot_failure_turns_it_off_with_one_warning(agent, monkeypatch, caplog):
    fake = FakeCuda().install(monkeypatch, torch)

    def broken(*a, **k):
        raise RuntimeError("snapshot exploded")

    caplog.set_level(logging.WARNING, logger="stepwatch")
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", broken)
    run(monkeypatch, steps=3, fake=fake)
    ms = agent.wait_markers(18)
    assert summary(ms)[-1] == ("STEP_END", 3, 0)  # training went on, every marker arrived
    warnings = [r for r in caplog.records if "allocator trace is off" in r.getMessage()]
    assert len(warnings) == 1 and "snapshot exploded" in warnings[0].getMessage()
    assert fake.history_calls[-1]["enabled"] is None and not fake.recording  # stopped
    assert all(not s.traces for s in agent.streams)
    st = stepwatch.stats()
    assert st["allocator_traces_refused"] == 1 and st["allocator_traces_sent"] == 0
    assert st["hook_errors"] == 0


@needs_torch
def test_a_caught_oom_in_step_1_does_not_keep_its_trace_from_the_agent(agent, monkeypatch, caplog):
    """An OOM entry (an OOM caught during step 1, here in its optimizer phase):
    the trace is sent all the same, without a warning (it used to be refused)."""
    fake = FakeCuda().install(monkeypatch, torch)
    real_alloc = fake.alloc
    ooms = []

    def alloc(size, label=""):
        if label == "optimizer" and fake.recording:
            fake.oom(1 << 40)
            ooms.append(size)
        return real_alloc(size, label)

    fake.alloc = alloc
    caplog.set_level(logging.WARNING, logger="stepwatch")
    run(monkeypatch, steps=2, fake=fake)
    agent.wait_markers(12)
    assert stepwatch.flush(FLUSH_S)
    assert ooms
    msgs = [r.getMessage() for r in caplog.records if "allocator trace" in r.getMessage()]
    assert msgs == []
    st = stepwatch.stats()
    assert st["allocator_traces_refused"] == 0 and st["allocator_traces_sent"] == 1, st
    assert any(t.last for s in agent.streams for t in s.traces)


@needs_torch
def test_torch_without_the_history_api_warns_once(agent, monkeypatch, caplog):
    fake = FakeCuda().install(monkeypatch, torch)
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    caplog.set_level(logging.WARNING, logger="stepwatch")
    run(monkeypatch, steps=3, fake=fake)
    agent.wait_markers(18)
    msgs = [r.getMessage() for r in caplog.records if "allocator trace" in r.getMessage()]
    assert len(msgs) == 1 and "_record_memory_history" in msgs[0]
    assert fake.snapshots == 0


@needs_torch
def test_history_recorded_by_the_script_is_left_alone(agent, monkeypatch, caplog):
    fake = FakeCuda().install(monkeypatch, torch)
    fake.record_memory_history("all")  # the user's own recording, with stacks
    calls = list(fake.history_calls)
    caplog.set_level(logging.INFO, logger="stepwatch")
    run(monkeypatch, steps=2, fake=fake)
    agent.wait_markers(12)
    assert fake.history_calls == calls and fake.recording and fake.snapshots == 0
    assert any("already being recorded" in r.getMessage() for r in caplog.records)


@needs_torch
def test_oom_in_step1_stops_recording_and_sends_nothing(agent, monkeypatch):
    fake = FakeCuda().install(monkeypatch, torch)
    stepwatch.configure()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with stepwatch.step():
            with stepwatch.phase("forward"):
                fake.alloc(4096)
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
    with stepwatch.step():
        with stepwatch.phase("forward"):
            pass
    ms = agent.wait_markers(6)
    assert [k for k, _, _ in summary(ms)][:3] == ["STEP_BEGIN", "FORWARD_BEGIN", "OOM"]
    assert len(fake.history_calls) == 2 and not fake.recording and fake.snapshots == 0
    assert all(not s.traces for s in agent.streams)


@needs_torch
def test_manual_marking_tags_the_prologue(agent, monkeypatch):
    fake = FakeCuda().install(monkeypatch, torch)
    stepwatch.configure()
    for i in (1, 2):
        with stepwatch.step(i):
            x = fake.alloc(2048, "prologue")
            with stepwatch.phase("forward"):
                y = fake.alloc(4096, "forward")
            with stepwatch.phase("backward"):
                fake.free(y, "backward")
            with stepwatch.phase("optimizer"):
                fake.free(x, "optimizer")
    agent.wait_markers(12)
    assert stepwatch.flush(FLUSH_S)
    _, evs = decode(agent.streams[0].traces)
    assert [(e[0], e[3]) for e in evs] == [
        (at.ACTION_SEGMENT_ALLOC, STEP_BEGIN),
        (at.ACTION_ALLOC, STEP_BEGIN),
        (at.ACTION_ALLOC, FORWARD_BEGIN),
        (at.ACTION_FREE, BACKWARD_BEGIN),
        (at.ACTION_FREE, OPTIMIZER_BEGIN),
    ]


@needs_torch
def test_markers_carry_the_allocators_exact_figures(agent, monkeypatch):
    """Each marker's AllocatorStats are the fake allocator's figures at that marker
    (every figure distinct, so a wrong key in the nested stats fails here)."""
    fake = FakeCuda().install(monkeypatch, torch)
    fake.pending_bytes = 512  # active = allocated + 512
    fake.retries = 3
    stepwatch.configure()

    def figures():
        s = fake.memory_stats(0)  # the flattened form, as torch.cuda.memory_stats gives it
        return (
            s["allocated_bytes.all.current"],
            s["allocated_bytes.all.peak"],
            s["reserved_bytes.all.current"],
            s["reserved_bytes.all.peak"],
            s["active_bytes.all.current"],
            s["active_bytes.all.peak"],
            s["num_alloc_retries"],
        )

    want = []
    big = fake.alloc(5_000_000, "before")
    fake.alloc(4096, "before")
    fake.free(big)
    fake.empty_cache()  # peaks above currents from here on
    want.append(figures())  # STEP_BEGIN
    with stepwatch.step(1):
        x = fake.alloc(3_000_000, "prologue")
        want.append(figures())  # FORWARD_BEGIN
        with stepwatch.phase("forward"):
            y = fake.alloc(700_000, "forward")
        want.append(figures())  # BACKWARD_BEGIN
        with stepwatch.phase("backward"):
            fake.free(y, "backward")
        want.append(figures())  # OPTIMIZER_BEGIN
        with stepwatch.phase("optimizer"):
            fake.free(x, "optimizer")
            fake.retries = 4
            want.append(figures())  # OPTIMIZER_END
        want.append(figures())  # STEP_END
    ms = agent.wait_markers(6)
    got = [
        (
            m.allocator.allocated_bytes,
            m.allocator.allocated_peak_bytes,
            m.allocator.reserved_bytes,
            m.allocator.reserved_peak_bytes,
            m.allocator.active_bytes,
            m.allocator.active_peak_bytes,
            m.allocator.num_alloc_retries,
        )
        for m in ms
    ]
    assert got == want
    cur, peak, res, res_peak, act, act_peak, _ = want[0]
    assert len({cur, peak, res, res_peak, act, act_peak}) == 6, want[0]
    assert len(set(want)) >= 4


@needs_torch
def test_no_agent_training_goes_on(sock_dir, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ENDPOINT", f"unix://{os.path.join(sock_dir, 'absent.sock')}")
    fake = run(monkeypatch, steps=3)
    assert fake.snapshots == 1 and not fake.recording
    st = stepwatch.stats()
    assert st["sent"] == 0 and st["allocator_traces_sent"] == 0
    assert st["queued"] == 18 + 1  # the markers and the trace wait for an agent


def test_a_trace_is_not_resent_on_a_new_stream():
    """A stream lost midway through a trace: the next stream gets the markers after it,
    not the rest of the trace (chunks without their start)."""
    fake = FakeCuda()
    trace = big_trace(fake, n_pairs=6000)
    c = Client("unix:///nonexistent/stepwatch.sock", lambda: pb.Hello())
    c._q.append((OPTIMIZER_END, 1, 1, 1, 0, None, None, None))
    c._q.append(trace)
    c._q.append((STEP_END, 1, 2, 2, 0, None, None, None))
    c._q.append((STEP_BEGIN, 2, 3, 3, 0, None, None, None))
    stream = _StreamState()
    gen = c._requests(stream)
    assert next(gen).WhichOneof("kind") == "hello"
    first = next(gen)
    assert [m.kind for m in first.markers.markers] == [OPTIMIZER_END]
    assert c._in_flight == 2  # the batch, and the trace behind it
    chunk = next(gen)
    assert chunk.allocator_trace.segments and not chunk.allocator_trace.last
    assert c._in_flight == 1 and len(c._q) == 2
    stream.closed = True  # the stream broke here
    gen.close()

    gen2 = c._requests(_StreamState())
    assert next(gen2).WhichOneof("kind") == "hello"
    nxt = next(gen2)
    assert nxt.WhichOneof("kind") == "markers"
    assert [m.kind for m in nxt.markers.markers] == [STEP_END, STEP_BEGIN]
    assert c.stats()["allocator_traces_sent"] == 0
    gen2.close()


def test_trace_written_whole_when_the_stream_stays(agent):
    fake = FakeCuda()
    trace = big_trace(fake, n_pairs=6000)
    stepwatch.configure()
    c = stepwatch._runtime.RT.get_client()
    c.mark(STEP_BEGIN, 1)
    c.send_allocator_trace(trace)
    c.mark(STEP_END, 1)
    agent.wait_markers(2)
    assert c.flush(FLUSH_S)
    s = agent.streams[0]
    assert s.order[0] == ("marker", STEP_BEGIN, 1) and s.order[-1] == ("marker", STEP_END, 1)
    assert len(s.traces) > 1 and s.traces[-1].last
    assert decode(s.traces)[1] == list(trace.events())
    assert c.stats()["allocator_traces_sent"] == 1


# ------------------------------------------- step 1's layouts, without a trace
def capture_layouts(fake):
    """Wraps the fake's memory_snapshot(): the large-pool segments each call saw,
    as (address, [(size, allocated)]), in call order."""
    seen = []
    inner = fake.memory_snapshot

    def wrapped(*a, **k):
        segments = inner(*a, **k)
        seen.append(
            [
                (s["address"], [(b["size"], b["state"] != "inactive") for b in s["blocks"]])
                for s in segments
                if s["segment_type"] == "large"
            ]
        )
        return segments

    fake.memory_snapshot = wrapped
    return seen


def layouts_sent(ms):
    """(kind, step, [(address, [(size, allocated)])]) of each marker with a layout."""
    return [
        (
            KIND_NAME[m.kind],
            m.step,
            [(s.address, [(b.size, b.allocated) for b in s.blocks]) for s in m.layout_segments],
        )
        for m in ms
        if len(m.layout_segments)
    ]


KIND_NAME = {OPTIMIZER_BEGIN: "OPTIMIZER_BEGIN", OPTIMIZER_END: "OPTIMIZER_END"}


@needs_torch
def test_layouts_ride_on_step1_optimizer_markers_without_a_trace(agent, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ALLOCATOR_TRACE", "0")
    fake = FakeCuda().install(monkeypatch, torch)
    seen = capture_layouts(fake)
    monkeypatch.setattr(torch.cuda.memory, "memory_snapshot", fake.memory_snapshot)
    run(monkeypatch, steps=3, fake=fake)
    ms = agent.wait_markers(18)
    assert stepwatch.flush(5)
    assert fake.history_calls == [] and fake.snapshots == 0  # no history, no trace
    assert fake.layout_snapshots == [False, False]  # without traces, twice
    sent = layouts_sent(ms)
    assert [(k, s) for k, s, _ in sent] == [("OPTIMIZER_BEGIN", 1), ("OPTIMIZER_END", 1)]
    # Exactly the allocator's large-pool segments at each moment: at the begin
    # the activations backward freed sit free; by the end the state is made.
    assert [layout for _, _, layout in sent] == seen
    assert all(len(layout) > 0 for layout in seen)
    begin, end = seen
    assert any(not allocated for _, blocks in begin for _, allocated in blocks)
    assert sum(sz for _, b in end for sz, a in b if a) > sum(
        sz for _, b in begin for sz, a in b if a
    )
    st = stepwatch.stats()
    assert st["layout_snapshots_sent"] == 2 and st["allocator_traces_sent"] == 0
    assert st["rejections"] == 0 and st["hook_errors"] == 0


@needs_torch
def test_layouts_flag_the_blocks_of_the_models_gradients(agent, monkeypatch):
    """The blocks that start where a watched parameter's gradient does are flagged
    on both layouts; no other block is. (CPU tensors do not live in the fake's
    segments, so the gradients' addresses are given: the first allocated large
    block at each snapshot.)"""
    monkeypatch.setenv("STEPWATCH_ALLOCATOR_TRACE", "0")
    fake = FakeCuda().install(monkeypatch, torch)
    seen = capture_layouts(fake)
    monkeypatch.setattr(torch.cuda.memory, "memory_snapshot", fake.memory_snapshot)
    asked = []

    def gradient_addresses(parameters):
        asked.append([tuple(p.shape) for p in parameters])
        layout = fake.memory_snapshot()
        seen.pop()  # this call is ours, not a layout's
        for seg in layout:
            if seg["segment_type"] == "large":
                for b in seg["blocks"]:
                    if b["state"] != "inactive":
                        return {b["address"]}
        return set()

    monkeypatch.setattr(_torch, "gradient_addresses", gradient_addresses)
    run(monkeypatch, steps=2, fake=fake)
    ms = agent.wait_markers(12)
    assert stepwatch.flush(5)
    # The watched model's parameters, at each of the two snapshots.
    assert asked == [[tuple(p.shape) for p in small_model().parameters()]] * 2
    flagged = [
        [b.gradient for s in m.layout_segments for b in s.blocks]
        for m in ms
        if len(m.layout_segments)
    ]
    assert len(flagged) == 2
    for flags, layout in zip(flagged, seen):
        allocated = [a for _, blocks in layout for _, a in blocks]
        assert flags == [a and i == allocated.index(True) for i, a in enumerate(allocated)]


def test_a_layout_flags_blocks_starting_at_a_gradient_and_counts_their_bytes():
    """Only an allocated block that starts at a gradient's address is flagged (its
    free neighbour and a block the address falls inside are not); the flag's two
    bytes count in the layout's encoded size."""
    seg = {
        "device": 0,
        "address": 1 << 30,
        "segment_type": "large",
        "blocks": [
            {"address": (1 << 30), "size": 4 << 20, "state": "active_allocated"},
            {"address": (1 << 30) + (4 << 20), "size": 4 << 20, "state": "inactive"},
            {"address": (1 << 30) + (8 << 20), "size": 12 << 20, "state": "active_allocated"},
        ],
    }
    grads = {1 << 30, (1 << 30) + (4 << 20), (1 << 30) + (9 << 20)}
    layout = at.layout_from_segments([seg], 0, grads)
    blocks = layout.segments[0][2]
    assert [b[2] for b in blocks] == [True, False, False]
    marker = pb.Marker()
    layout.fill(marker)
    assert [b.gradient for b in marker.layout_segments[0].blocks] == [True, False, False]
    assert layout.nbytes == marker.ByteSize()
    assert layout.nbytes == at.layout_from_segments([seg], 0).nbytes + 2


@needs_torch
def test_gradient_addresses_are_those_of_gradients_that_own_their_storage():
    """A gradient set to None frees its block only when it owns it: a view into a
    shared buffer (DDP's gradient_as_bucket_view) is left out, as is no gradient."""
    own, viewed, none = (torch.nn.Parameter(torch.zeros(4)) for _ in range(3))
    own.grad = torch.ones(4)
    bucket = torch.zeros(8)
    viewed.grad = bucket[4:]
    assert _torch.gradient_addresses([own, viewed, none]) == {own.grad.data_ptr()}
    first = torch.nn.Parameter(torch.zeros(4))
    first.grad = bucket[:4]  # at the buffer's start, still not its own
    assert _torch.gradient_addresses([first]) == set()


@needs_torch
def test_no_layouts_while_the_trace_is_recorded(agent, monkeypatch):
    fake = run(monkeypatch, steps=2)
    ms = agent.wait_markers(12)
    assert stepwatch.flush(5)
    assert stepwatch.stats()["allocator_traces_sent"] == 1
    assert fake.layout_snapshots == [] and layouts_sent(ms) == []


@needs_torch
@pytest.mark.parametrize("how", ["env", "allocator_stats"])
def test_layouts_opt_out(agent, monkeypatch, how):
    monkeypatch.setenv("STEPWATCH_ALLOCATOR_TRACE", "0")
    opts = opt_out(monkeypatch, how, "STEPWATCH_LAYOUT_SNAPSHOTS", "allocator_stats")
    fake = run(monkeypatch, steps=2, **opts)
    ms = agent.wait_markers(12)
    assert stepwatch.flush(5)
    assert fake.layout_snapshots == [] and layouts_sent(ms) == []


@needs_torch
def test_a_layout_over_the_message_budget_is_not_sent(agent, monkeypatch, caplog):
    monkeypatch.setenv("STEPWATCH_ALLOCATOR_TRACE", "0")
    monkeypatch.setattr(at, "LAYOUT_MAX_BYTES", 8)
    caplog.set_level(logging.DEBUG, logger="stepwatch")
    fake = run(monkeypatch, steps=2)
    ms = agent.wait_markers(12)
    assert stepwatch.flush(5)
    assert fake.layout_snapshots == [False]  # tried once, then off for the run
    assert layouts_sent(ms) == []
    assert any("more than the 8" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@needs_torch
def test_a_layout_failure_turns_it_off_with_one_warning(agent, monkeypatch, caplog):
    monkeypatch.setenv("STEPWATCH_ALLOCATOR_TRACE", "0")
    fake = FakeCuda().install(monkeypatch, torch)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("layout exploded")

    monkeypatch.setattr(torch.cuda.memory, "memory_snapshot", broken)
    caplog.set_level(logging.WARNING, logger="stepwatch")
    run(monkeypatch, steps=3, fake=fake)
    ms = agent.wait_markers(18)
    assert summary(ms)[-1] == ("STEP_END", 3, 0)  # training went on
    assert len(calls) == 1 and layouts_sent(ms) == []
    warnings = [r for r in caplog.records if "segment snapshot" in r.getMessage()]
    assert len(warnings) == 1 and "layout exploded" in warnings[0].getMessage()
    assert stepwatch.stats()["hook_errors"] == 0


def test_a_marker_with_a_layout_gets_a_batch_of_its_own_when_it_would_overflow():
    """Markers queued before a large layout go in one batch, the layout's marker in
    the next: no message over the agent's limit."""
    big = at.Layout([(1 << 40, False, [(2 << 20, False)] * 6000, (0, 0, False))])
    assert 40_000 < big.nbytes <= at.LAYOUT_MAX_BYTES
    c = Client("unix:///nonexistent", hello_factory=lambda: pb.Hello())
    for i in range(1000):
        c.mark(STEP_BEGIN, i + 1)
    c.mark(OPTIMIZER_BEGIN, 1, 0, None, None, big)
    c.mark(STEP_END, 1)
    stream = _StreamState()
    msgs = []
    it = c._requests(stream)
    next(it)  # the hello
    while len(msgs) < 2:
        msgs.append(next(it))
    assert all(m.ByteSize() <= LIMIT for m in msgs)
    first, second = (list(m.markers.markers) for m in msgs)
    assert len(first) == 1000 and not any(len(m.layout_segments) for m in first)
    assert len(second[0].layout_segments) == 1 and len(second[0].layout_segments[0].blocks) == 6000
    assert [m.kind for m in second] == [OPTIMIZER_BEGIN, STEP_END]
    c.close()
