"""The sender against an in-process fake agent: Hello, batching, outages, rejections,
advisories, fork and shutdown."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import textwrap
import time
from typing import Optional

import grpc
import pytest
from conftest import FakeAgent, expected, mark_steps, summary, wait_until

import stepwatch
from stepwatch._client import MAX_MARKERS_PER_BATCH, OPTIMIZER_BEGIN, STEP_BEGIN, STEP_END, Client
from stepwatch._runtime import RT


def test_hello_first_then_markers_in_order(agent):
    stepwatch.configure(job_id="job-1", rank=1, world_size=2)
    mark_steps(2)
    ms = agent.wait_markers(12)
    s = agent.streams[0]
    assert s.messages[0].WhichOneof("kind") == "hello"
    assert (s.hello.identity.job_id, s.hello.identity.rank, s.hello.identity.world_size) == (
        "job-1",
        1,
        2,
    )
    assert s.hello.pid == os.getpid() and s.hello.client_version == stepwatch.__version__
    assert summary(ms) == expected(2)
    monos = [m.monotonic_ns for m in ms]
    assert monos == sorted(monos) and monos[0] <= time.monotonic_ns()
    assert abs(ms[0].wall_ns - time.time_ns()) < 60e9
    assert not ms[0].HasField("allocator")  # CPU: no allocator figures


def test_batches_respect_agent_limits(agent):
    c = RT.get_client()
    assert c.wait_connected(5)
    n = 5000
    for i in range(n):
        c.mark(STEP_BEGIN, i + 1, 0, (10**12,) * 7)  # allocator figures: biggest markers
    ms = agent.wait_markers(n)
    assert [m.step for m in ms] == list(range(1, n + 1))
    batches = agent.streams[0].messages[1:]
    assert all(len(b.markers.markers) <= MAX_MARKERS_PER_BATCH for b in batches)
    assert max(agent.streams[0].sizes) <= 64 * 1024
    assert stepwatch.stats()["sent"] == n


def test_agent_absent_never_blocks_and_counts_drops(sock_dir, monkeypatch):
    path = os.path.join(sock_dir, "late.sock")
    monkeypatch.setenv("STEPWATCH_ENDPOINT", "unix://" + path)
    stepwatch.configure(queue_size=100)
    t0 = time.perf_counter()
    mark_steps(50)  # 300 markers into a queue of 100
    elapsed = time.perf_counter() - t0
    # Marking that waited on the connection would take one connect timeout
    # per marker (minutes for 300); 10 s is slack for a busy machine.
    assert elapsed < 10.0, f"marking took {elapsed:.3f}s with no agent"
    st = stepwatch.stats()
    assert st["dropped"] == 200 and st["queued"] == 100 and st["sent"] == 0
    # At least one connect attempt fails before the agent appears.
    deadline = time.monotonic() + 30
    while stepwatch.stats()["connect_failures"] < 1:
        assert time.monotonic() < deadline, f"no connect attempt in 30 s: {stepwatch.stats()}"
        time.sleep(0.01)
    # The agent appears: the buffered (newest) markers arrive after a Hello.
    late = FakeAgent(path).start()
    try:
        ms = late.wait_markers(100)
        assert late.streams[0].hello.identity.job_id
        assert [m.step for m in ms][-1] == 50
        assert stepwatch.stats()["connect_failures"] >= 1
    finally:
        stepwatch.reset()
        late.stop()


def test_agent_restart_reconnects_with_new_hello(agent):
    mark_steps(1)
    agent.wait_markers(6)
    agent.stop()
    mark_steps(1, start=2)  # while the agent is gone
    again = FakeAgent(agent.path).start()
    try:
        mark_steps(1, start=3)
        ms = again.wait_markers(6)
        assert again.streams[0].hello is not None
        assert ms[-1].step == 3 and ms[-1].kind == STEP_END
        st = stepwatch.stats()
        assert st["reconnects"] >= 1 and st["connects"] >= 2
    finally:
        stepwatch.reset()
        again.stop()


def test_rejection_is_logged_and_retried(agent, caplog):
    agent.reject = [(grpc.StatusCode.INVALID_ARGUMENT, "job_id: bad character")]
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch.configure()
        RT.get_client().start()
        assert agent.wait_for(lambda: len(agent.streams) >= 2, 10)
        mark_steps(1)
        agent.wait_markers(6)
    assert stepwatch.stats()["rejections"] == 1
    assert any(
        "rejected" in r.getMessage() and "bad character" in r.getMessage() for r in caplog.records
    )


def test_strict_raises_when_agent_rejects(agent):
    agent.reject = [(grpc.StatusCode.INVALID_ARGUMENT, "rank 9 >= world_size 2")] * 50
    stepwatch.configure(strict=True)
    c = RT.get_client()
    c.start()
    assert agent.wait_for(lambda: len(agent.streams) >= 1, 10)
    deadline = time.monotonic() + 5
    with pytest.raises(stepwatch.StepwatchError, match="rank 9"):
        while time.monotonic() < deadline:
            c.mark(STEP_BEGIN, 1)
            time.sleep(0.01)


@pytest.fixture
def got(agent):
    """What on_advisory receives, as rank 3 of 4 whose step 1 the agent has seen."""
    got = []
    stepwatch.configure(on_advisory=got.append, rank=3, world_size=4)
    mark_steps(1)
    agent.wait_markers(6)
    return got


def test_not_strict_never_raises(sock_dir, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ENDPOINT", "unix://" + os.path.join(sock_dir, "none.sock"))
    mark_steps(3)
    with pytest.raises(ZeroDivisionError):  # training errors still propagate untouched
        with stepwatch.step():
            raise ZeroDivisionError
    assert stepwatch.stats()["enqueued"] == 19


def test_advisory_logged_callback_and_last_prediction(agent, got, caplog):
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        agent.advise(
            kind=1,
            severity=3,
            step=1,
            message="predicted steady-state peak 81.2 GB exceeds capacity 80.0 GB; "
            "step 2 will likely run out of memory",
            predicted_peak_bytes=81_200_000_000,
            capacity_bytes=80_000_000_000,
            predicted_headroom_bytes=-1_200_000_000,
        )
        wait_until(lambda: got)
    assert got and got[0].kind == "ADVISORY_KIND_STEP2_OOM_PREDICTED"
    p = stepwatch.last_prediction()
    assert p is got[0] and p.predicted_headroom_bytes == -1_200_000_000
    text = [r.getMessage() for r in caplog.records if r.name == "stepwatch"]
    assert any("step 2 will likely run out of memory" in t and "rank 3" in t for t in text)
    assert stepwatch.stats()["advisories"] == 1


def test_rank_divergence_is_logged_but_last_prediction_keeps_the_step2_one(agent, got, caplog):
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        agent.advise(kind=1, severity=3, step=1, message="step 2 will not fit")
        agent.advise(kind=3, severity=2, step=1, message="rank 3: its activation peak is off")
        wait_until(lambda: len(got) >= 2)
    assert [p.kind for p in got] == [
        "ADVISORY_KIND_STEP2_OOM_PREDICTED",
        "ADVISORY_KIND_RANK_DIVERGENCE",
    ]
    assert stepwatch.last_prediction() is got[0]
    text = [r.getMessage() for r in caplog.records if r.name == "stepwatch"]
    assert any("activation peak is off" in t for t in text)


def test_observations_after_step_1_and_unknown_kinds_are_logged_but_keep_the_step2_prediction(
    agent, got, caplog
):
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        agent.advise(kind=2, severity=2, step=1, message="leaves only 0.50 GB free")
        agent.advise(
            kind=4,
            severity=2,
            step=3,
            message="in step 3 PyTorch's caching allocator ran out of GPU memory and had to "
            "free its cache and retry 2 times",
        )
        agent.advise(
            kind=5,
            severity=2,
            step=4,
            message="steps 2–4 peak at 5.27 GB of 5.35 GB usable on the GPU (1.5% to spare)",
        )
        agent.advise(
            kind=6,
            severity=2,
            step=18,
            message="memory grows by 8.4 MB per step (allocated memory at step end, steps 3–18)",
        )
        # A kind newer than this client: logged with its number, not dropped.
        agent.advise(kind=99, severity=2, step=4, message="something new")
        wait_until(lambda: len(got) >= 5)
    assert [p.kind for p in got] == [
        "ADVISORY_KIND_LOW_HEADROOM",
        "ADVISORY_KIND_ALLOCATOR_RETRIES",
        "ADVISORY_KIND_LOW_OBSERVED_HEADROOM",
        "ADVISORY_KIND_MEMORY_GROWTH",
        "99",
    ]
    assert [p.severity for p in got] == ["SEVERITY_WARNING"] * 5
    # Observations after step 1 are no step-2 prediction.
    assert stepwatch.last_prediction() is got[0]
    text = [r.getMessage() for r in caplog.records if r.name == "stepwatch"]
    assert any("step 3): in step 3" in t and "retry 2 times" in t for t in text), text
    assert any("step 4): steps 2–4 peak at 5.27 GB" in t for t in text), text
    assert any("step 4): something new" in t for t in text), text
    assert any("step 18): memory grows by 8.4 MB per step" in t for t in text), text
    # No prediction figures: no bracket of GB figures after the message.
    assert not any("retry 2 times [" in t for t in text), text


def test_failing_callback_does_not_break_the_stream(agent, caplog):
    calls = []

    def boom(p):
        calls.append(p)
        raise RuntimeError("user bug")

    caplog.set_level(logging.ERROR, logger="stepwatch")
    stepwatch.configure(on_advisory=boom)
    mark_steps(1)
    agent.wait_markers(6)
    agent.advise(kind=2, severity=1, message="low headroom", step=1)
    wait_until(lambda: stepwatch.stats()["advisories"] >= 1)
    mark_steps(1, start=2)
    agent.wait_markers(12)
    assert len(calls) == 1 and calls[0].message == "low headroom"
    st = stepwatch.stats()
    assert st["advisories"] == 1
    assert st["stream_errors"] == 0 and st["reconnects"] == 0 and st["connects"] == 1
    assert len(agent.streams) == 1
    raised = [r for r in caplog.records if "on_advisory callback raised" in r.getMessage()]
    assert len(raised) == 1 and raised[0].exc_info[1].args == ("user bug",)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_child_gets_fresh_sender(agent):
    mark_steps(1)
    agent.wait_markers(6)
    parent_channel = RT.get_client()._channel
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: marking must not block, state must be fresh
        try:
            st = stepwatch.stats()
            t0 = time.perf_counter()
            RT.get_client().mark(OPTIMIZER_BEGIN, 2)
            # The parent's open channel is held, never closed (finalized) in
            # the child: that would run gRPC core code here.
            from stepwatch import _client

            held = [o for pair in _client._PARENT_GRPC_OBJECTS for o in pair]
            if st["enqueued"] != 0:
                verdict = b"q"  # the parent's queue leaked into the child
            elif parent_channel is not None and not any(o is parent_channel for o in held):
                verdict = b"h"  # the parent's channel was dropped
            elif time.perf_counter() - t0 >= 10:
                verdict = b"t"  # marking blocked (a lock the fork copied held)
            else:
                verdict = b"1"
            os.write(w, verdict)
        finally:
            os._exit(0)
    os.close(w)
    # A child stuck for good on a lock would never answer: wait a bounded time.
    ready, _, _ = select.select([r], [], [], 120)
    assert ready, "the forked child did not answer in 120 s: marking blocked"
    assert os.read(r, 1) == b"1", "q: queue leaked, h: channel dropped, t: marking blocked"
    os.waitpid(pid, 0)
    mark_steps(1, start=2)  # the parent's stream still works
    ms = agent.wait_markers(12)
    assert ms[-1].step == 2


# A training script as users write it: the agent is another process, and the
# script uses no gRPC of its own before stepwatch does. Each DataLoader worker
# checks that no thread runs in it besides Python's own (gRPC's fork handlers
# would restart gRPC's threads there, which then run the parent's gRPC work
# on the child's broken copy of gRPC: the ev_epoll1 abort), then runs the
# collector over gRPC garbage it inherited (a channel with a call on it, in a
# cycle), which stepwatch's gc.freeze() in the child keeps it from freeing.
DATALOADER_SCRIPT = textwrap.dedent("""
    import gc, os, sys, threading
    import torch
    import stepwatch
    from stepwatch._runtime import RT

    def check_worker(worker_id):
        python_threads = {t.native_id for t in threading.enumerate()}
        others = [
            open(f"/proc/self/task/{tid}/comm").read().strip()
            for tid in os.listdir("/proc/self/task")
            if int(tid) not in python_threads
        ]
        assert not others, f"threads besides Python's in a forked worker: {others}"
        gc.collect()

    class Cycle:
        pass

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))

    def train_step(x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    train_step(*ds[:8])
    assert RT.get_client().wait_connected(60), "no stream to the agent in 60 s"
    import grpc  # after stepwatch imported it

    gc.disable()
    for _ in range(int(sys.argv[1])):
        garbage = Cycle()
        garbage.self = garbage
        garbage.channel = grpc.insecure_channel(os.environ["STEPWATCH_ENDPOINT"])
        garbage.call = garbage.channel.unary_unary("/no.Such/Method").future(b"")
        del garbage
        dl = torch.utils.data.DataLoader(
            ds,
            batch_size=8,
            num_workers=2,
            multiprocessing_context="fork",
            worker_init_fn=check_worker,
            timeout=120,  # a hung worker fails the script instead of hanging it
        )
        for x, y in dl:
            train_step(x, y)
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads from /proc")
def test_dataloader_workers_run_no_grpc(agent):
    pytest.importorskip("torch")
    epochs = 10
    env = dict(os.environ, STEPWATCH_ENDPOINT=agent.endpoint, STEPWATCH_EXIT_FLUSH_S="60")
    env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    out = subprocess.run(
        [sys.executable, "-c", DATALOADER_SCRIPT, str(epochs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    steps = 1 + 4 * epochs
    assert agent.wait_markers(6 * steps)[-1].step == steps


# The script reports how long its interpreter exit took, measured inside the
# process: an atexit handler registered before stepwatch is imported runs
# after stepwatch's own (atexit runs handlers last-in, first-out). Timing the
# whole subprocess would also count interpreter start and imports, which a
# busy machine stretches to many seconds.
SCRIPT = textwrap.dedent("""
    import atexit, time
    ended = []
    atexit.register(lambda: print("exit took", time.monotonic() - ended[0], flush=True))
    import stepwatch
    for i in range(1, 4):
        with stepwatch.step(i):
            with stepwatch.phase("forward"):
                pass
    print("done", flush=True)
    ended.append(time.monotonic())
""")

#: The client's default exit-flush bound: what a process with no agent waits.
EXIT_FLUSH_S = 1.0
#: Scheduling slack on a machine whose cores are busy. A client that ignored
#: the bound would wait for gRPC's own timeouts (tens of seconds) or forever.
EXIT_SLACK_S = 4.0


def _run_script(
    endpoint: str, exit_flush_s: float, connect_timeout_s: Optional[float] = None
) -> float:
    """Runs SCRIPT; the client's own connect timeout unless one is given."""
    env = dict(os.environ, STEPWATCH_ENDPOINT=endpoint, STEPWATCH_EXIT_FLUSH_S=str(exit_flush_s))
    env.pop("STEPWATCH_CONNECT_TIMEOUT", None)
    if connect_timeout_s is not None:
        env["STEPWATCH_CONNECT_TIMEOUT"] = str(connect_timeout_s)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    took = [line for line in out.stdout.splitlines() if line.startswith("exit took ")]
    assert len(took) == 1, out.stdout
    return float(took[0].split()[-1])


def test_exit_flushes_within_bound(agent):
    # Generous bounds: on a busy machine (load 4 once) connecting to this
    # in-process agent and sending can take more than the defaults (2 s to
    # connect, 1 s to flush), and a client that missed them drops its
    # markers by design. The exit ends as soon as they are delivered; that
    # the bounds are kept is test_exit_with_no_agent_is_quick's.
    bound = 60.0
    exit_s = _run_script(agent.endpoint, bound, connect_timeout_s=bound)
    assert exit_s < bound, f"exit took {exit_s:.2f}s"
    ms = agent.wait_markers(9)
    assert [m.kind for m in ms].count(STEP_END) == 3
    assert agent.wait_for(lambda: agent.streams[-1].ended, 5)  # clean half-close


def test_exit_with_no_agent_is_quick(sock_dir):
    exit_s = _run_script("unix://" + os.path.join(sock_dir, "x.sock"), EXIT_FLUSH_S)
    assert exit_s < EXIT_FLUSH_S + EXIT_SLACK_S, f"exit took {exit_s:.2f}s"


def test_client_without_thread_flush_is_noop():
    c = Client("unix:///nonexistent", lambda: None)
    assert c.flush(0.1) is True
    c.close(0.1)


def _break_the_stubs(monkeypatch):
    """As in an environment whose protobuf the stubs refuse (e.g. 3.20): the
    message module cannot be imported."""
    from stepwatch import _client
    from stepwatch._proto.stepwatch import v1

    monkeypatch.setattr(_client, "_wire", None)
    monkeypatch.delattr(v1, "ingest_pb2", raising=False)
    monkeypatch.setitem(sys.modules, "stepwatch._proto.stepwatch.v1.ingest_pb2", None)


def test_an_unusable_protobuf_is_logged_once_and_training_goes_on(sock_dir, monkeypatch, caplog):
    monkeypatch.setenv("STEPWATCH_ENDPOINT", "unix://" + os.path.join(sock_dir, "none.sock"))
    _break_the_stubs(monkeypatch)
    caplog.set_level(logging.ERROR, logger="stepwatch")
    mark_steps(3)  # never raises
    wait_until(lambda: caplog.records, 10)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "stepwatch needs grpcio >= 1.51.3 and protobuf >= 4.21.6, < 8" in errors[0]
    assert "training goes on" in errors[0]
    assert stepwatch.flush(1) is False
    st = stepwatch.stats()
    assert st["connect_failures"] == 1 and st["sent"] == 0 and st["enqueued"] == 18, st


def test_strict_raises_an_unusable_protobuf_at_setup(sock_dir, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ENDPOINT", "unix://" + os.path.join(sock_dir, "none.sock"))
    _break_the_stubs(monkeypatch)
    with pytest.raises(stepwatch.StepwatchError, match=r"protobuf >= 4\.21\.6"):
        stepwatch.configure(strict=True)


def test_a_new_run_dropped_from_a_full_queue_still_names_the_next_hello():
    """With no agent the queue overflows; a run boundary pushed out of it with
    the old run's markers still takes effect: what remains is the new run's,
    so the next hello must carry the new run id."""
    from stepwatch._client import NewRun

    c = Client("unix:///nonexistent/stepwatch.sock", lambda: None, queue_size=4, run_id="run-1")
    c._thread = object()  # no sender: the test drives the queue alone
    c.mark(STEP_BEGIN, 7)
    c.new_run("run-2")
    for _ in range(4):
        c.mark(STEP_BEGIN, 1)
    assert not any(type(x) is NewRun for x in c._q)
    assert c._run_id == "run-2"
    assert c.counters["dropped"] == 2
