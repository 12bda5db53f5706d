"""The Python client against the real Rust agent (``stepwatch agent``).

The agent binary is ``$STEPWATCH_BIN`` or ``<repo>/target/debug/stepwatch``
(build it with ``cargo build -p stepwatch``). When it is missing these tests
FAIL; set ``STEPWATCH_SKIP_AGENT_TESTS=1`` to skip them on purpose.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import pytest
from conftest import (
    FLUSH_S,
    agent_binary,
    fit_tiny_lightning,
    mark_steps,
    train,
)

import stepwatch

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
PHASES = ["prologue", "forward", "backward", "optimizer", "epilogue"]


@pytest.fixture
def real_agent(sock_dir, monkeypatch, tmp_path):
    binary = agent_binary()
    agent = _Agent(binary, sock_dir, tmp_path)
    agent.start()
    monkeypatch.setenv("STEPWATCH_ENDPOINT", "unix://" + agent.socket)
    yield agent
    stepwatch.reset()
    agent.stop()


class _Agent:
    def __init__(
        self, binary: Path, sock_dir: str, tmp_path: Path, extra_args: Sequence[str] = ()
    ) -> None:
        self.binary = binary
        self.extra_args = list(extra_args)
        self.socket = os.path.join(sock_dir, "stepwatch.sock")
        self.log = tmp_path / "agent.log"
        # The agent binds port 0 and names what it bound here: no free-port race.
        self.ready_file = tmp_path / "agent-ready.json"
        self.http = ""  # host:port, once started
        self.grpc: Optional[str] = None  # host:port of --grpc-listen, if given
        self.proc = None

    def start(self) -> None:
        cmd = [
            str(self.binary),
            "agent",
            "--socket",
            self.socket,
            "--http-listen",
            "127.0.0.1:0",
            "--ready-file",
            str(self.ready_file),
            "--nvml-lib",
            "/nonexistent",
            *self.extra_args,
        ]
        if self.ready_file.exists():
            self.ready_file.unlink()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"agent exited with {self.proc.returncode}: {self.log.read_text()}")
            if self.ready_file.exists():  # written atomically once every listener is up
                ready = json.loads(self.ready_file.read_text())
                self.http, self.grpc = ready["http"], ready.get("grpc")
                return
            time.sleep(0.05)
        pytest.fail(f"agent wrote no ready file in 30 s: {self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def get(self, path: str, raw: bool = False):
        url = f"http://{self.http}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise
        return body if raw else json.loads(body)

    def rank_report(self, job: str, rank: int, steps: int, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        report = None
        while time.monotonic() < deadline:
            report = self.get(f"/api/v1/jobs/{job}/ranks/{rank}")
            if report and report.get("steps_completed", 0) >= steps:
                return report
            time.sleep(0.1)
        pytest.fail(
            f"agent reported {report!r} for {job}/{rank} (wanted {steps} steps); "
            f"client stats {stepwatch.stats()}; agent log:\n{self.log.read_text()[-4000:]}"
        )


def _train(steps: int, accumulate: int, **watch_opts) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = stepwatch.watch(model, opt, grad_accumulation_steps=accumulate, **watch_opts)
    try:
        train(model, opt, steps, accumulate, batch=8)
    finally:
        handle.remove()


def _expected_phases(accumulate: int):
    out = [("prologue", 0)]
    for m in range(accumulate):
        out += [("forward", m), ("backward", m)]
    return out + [("optimizer", None), ("epilogue", None)]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_agent_reports_steps_and_phases(real_agent, accumulate):
    job = f"pytest-{uuid.uuid4().hex[:8]}"
    _train(5, accumulate, job_id=job)
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = real_agent.rank_report(job, 0, 5)
    jobs = real_agent.get("/api/v1/jobs")
    assert {"job": job, "namespace": "", "ranks": [0]} in jobs["jobs"]
    assert report["job"] == job and report["rank"] == 0
    assert report["steps_completed"] == 5
    steps = report["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    for s in steps:
        assert s["complete"] is True, s
        assert s["duration_seconds"] >= 0
        got = [(p["phase"], p["micro_batch"]) for p in s["phases"]]
        want = _expected_phases(accumulate)
        assert [g[0] for g in got] == [w[0] for w in want], s
        assert [g[1] for g, w in zip(got, want) if w[1] is not None] == [
            w[1] for w in want if w[1] is not None
        ], s
        starts = [p["start_monotonic_ns"] for p in s["phases"]]
        assert starts == sorted(starts)
        # The agent shares CLOCK_MONOTONIC with us.
        assert starts[0] <= time.monotonic_ns()
    st = stepwatch.stats()
    assert st["dropped"] == 0 and st["rejections"] == 0, st


def test_training_completes_with_agent_stopped(real_agent):
    job = f"pytest-{uuid.uuid4().hex[:8]}"
    _train(2, 1, job_id=job)
    assert stepwatch.flush(FLUSH_S)
    real_agent.rank_report(job, 0, 2)
    real_agent.stop()
    t0 = time.monotonic()
    _train(5, 2, job_id=job)  # same training, agent gone
    assert time.monotonic() - t0 < 30
    st = stepwatch.stats()
    assert st["enqueued"] >= 2 * 6 + 5 * 8


def test_training_completes_with_no_agent_at_all(sock_dir, monkeypatch):
    if os.environ.get("STEPWATCH_SKIP_AGENT_TESTS") == "1":
        pytest.skip("STEPWATCH_SKIP_AGENT_TESTS=1")
    monkeypatch.setenv("STEPWATCH_ENDPOINT", f"unix://{sock_dir}/absent.sock")
    t0 = time.monotonic()
    _train(5, 2)
    assert time.monotonic() - t0 < 30
    assert stepwatch.stats()["sent"] == 0


def test_allocator_trace_gives_a_replayed_prediction(real_agent, monkeypatch):
    """Step 1's allocator trace, recorded by watch() (torch.cuda's history functions
    replaced by a fake caching allocator: CPU torch cannot record one), reaches the
    agent between step 1's OPTIMIZER_END and step 2's STEP_BEGIN, and the prediction
    frozen before step 2 comes from replaying it."""
    from fake_cuda import FakeCuda, FakeWorkload

    fake = FakeCuda().install(monkeypatch, torch)
    job = f"pytest-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    work = FakeWorkload(fake, model, opt)
    handle = stepwatch.watch(model, opt, job_id=job, grads_set_to_none=True)
    work.install_optimizer_hooks()
    try:
        for _ in range(3):
            x, y = torch.randn(8, 16), torch.randn(8, 1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            work.zero_grad()
    finally:
        handle.remove()
        work.remove()
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = real_agent.rank_report(job, 0, 3)
    st = stepwatch.stats()
    assert st["allocator_traces_sent"] == 1 and st["allocator_traces_refused"] == 0, st
    assert st["rejections"] == 0 and st["reconnects"] == 0, (
        st,
        real_agent.log.read_text()[-4000:],
    )
    assert fake.snapshots == 1
    pred = report.get("prediction_before_step2")
    assert pred, report
    assert pred["inputs"]["basis"] == "allocator_replay", (
        pred,
        real_agent.log.read_text()[-4000:],
    )
    assert "replayed from the step-1 allocator trace" in real_agent.log.read_text()


@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_tells_the_agent_when_gradients_are_kept(real_agent, set_to_none):
    """``zero_grad(set_to_none=False)`` after step 1's optimizer (after the hello,
    before step 2) reaches the agent before step 2's first marker, so step 2's
    prediction counts the kept gradients; PyTorch's default sends nothing."""
    job = f"pytest-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    handle = stepwatch.watch(model, opt, job_id=job)
    try:
        for _ in range(3):
            x, y = torch.randn(8, 16), torch.randn(8, 1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        # Kept gradients really are kept (the wrapper called through).
        assert all((p.grad is None) == set_to_none for p in model.parameters())
    finally:
        handle.remove()
    assert "zero_grad" not in opt.__dict__ and "zero_grad" not in model.__dict__
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = real_agent.rank_report(job, 0, 3)
    st = stepwatch.stats()
    assert st["rejections"] == 0, (st, real_agent.log.read_text()[-4000:])
    assert st["model_updates_sent"] == (0 if set_to_none else 1), st
    facts = report["info"]["model"]
    assert facts["grads_set_to_none"] == (None if set_to_none else False), report["info"]


def _wait_report(agent: _Agent, job: str, done, what: str, timeout: float = 15.0):
    """The rank's report once ``done(report)`` holds (the agent applies a stream's
    messages after the client has written them)."""
    deadline = time.monotonic() + timeout
    report = None
    while time.monotonic() < deadline:
        report = agent.get(f"/api/v1/jobs/{job}/ranks/0")
        if report and done(report):
            return report
        time.sleep(0.05)
    pytest.fail(
        f"{what}: the agent reported {report!r}; client stats {stepwatch.stats()}; "
        f"agent log:\n{agent.log.read_text()[-4000:]}"
    )


def test_a_second_training_loop_under_watch_is_a_new_run_from_step_1(real_agent):
    """Two training loops in one process, each under its own ``watch()``: the
    second is a run of its own (a new run id in a new hello, after the first
    run's markers), so the agent shows its steps from 1, not steps 4 and 5 of
    the first run (which, before run ids, it got and kept)."""
    job = f"pytest-{uuid.uuid4().hex[:8]}"
    _train(3, 1, job_id=job)
    first_run = stepwatch._runtime.RT.run_id
    _wait_report(real_agent, job, lambda r: r["steps_completed"] == 3, "the first run's 3 steps")
    _train(2, 1, job_id=job)
    second_run = stepwatch._runtime.RT.run_id
    assert second_run != first_run
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = _wait_report(
        real_agent,
        job,
        lambda r: r["info"]["run_id"] == second_run and r["steps_completed"] == 2,
        "the second run's 2 steps",
    )
    assert [s["step"] for s in report["steps"]] == [1, 2], report["steps"]
    assert all(s["complete"] for s in report["steps"]), report["steps"]
    st = stepwatch.stats()
    assert st["runs"] == 1 and st["rejections"] == 0 and st["reconnects"] == 0, st


def test_a_second_lightning_fit_is_a_new_run_from_step_1(real_agent, tmp_path):
    """``trainer.fit()`` twice in one process (e.g. a sweep, or fit after a
    learning-rate finder): the agent reports the second fit from its step 1."""
    pytest.importorskip("lightning")

    from stepwatch.lightning import StepwatchCallback

    job = f"pytest-{uuid.uuid4().hex[:8]}"
    callback = StepwatchCallback(job_id=job)
    runs = []
    for steps in (3, 2):
        fit_tiny_lightning(tmp_path, callback, max_steps=steps)
        runs.append(stepwatch._runtime.RT.run_id)
    assert runs[0] != runs[1]
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = _wait_report(
        real_agent,
        job,
        lambda r: r["info"]["run_id"] == runs[1] and r["steps_completed"] == 2,
        "the second fit's 2 steps",
    )
    assert [s["step"] for s in report["steps"]] == [1, 2], report["steps"]
    assert report["info"]["framework"] == "lightning"
    st = stepwatch.stats()
    assert st["runs"] == 1 and st["rejections"] == 0, st


def _metric(agent: _Agent, name: str, labels: str) -> float:
    """One series of the agent's /metrics, e.g. ``_metric(a, "x_total", 'reason="y"')``."""
    text = agent.get("/metrics", raw=True).decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} is not exported")


def _hello_of(job: str, pid: Optional[int] = None):
    """A hello factory for a Client made by hand: rank 0 of ``job``."""
    from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

    def hello():
        return pb.Hello(
            identity=pb.Identity(job_id=job, rank=0, world_size=1),
            pid=os.getpid() if pid is None else pid,
            framework="pytorch",
        )

    return hello


def _sender_ends(client, what: str) -> None:
    """Waits until the client's sender thread has ended: a thread that has ended
    cannot reconnect, so this is how a test sees that no reconnect will come."""
    thread = client._thread
    assert thread is not None, client.stats()
    thread.join(FLUSH_S)
    assert not thread.is_alive(), f"{what}: the sender still runs: {client.stats()}"


def test_a_client_whose_run_another_client_in_the_process_replaced_stops_for_good(
    real_agent, caplog
):
    """Two clients in one process for the same rank: the second one's run takes
    the rank, the first one's next batch is refused as ``run_ended``. No retry
    can cure that (a reconnect naming the left run is refused as ``rank_held``),
    so the first client says once what happened and stops, instead of
    reconnecting every 10 s for the rest of training."""
    from stepwatch._client import BACKWARD_BEGIN, FORWARD_BEGIN, STEP_BEGIN, Client
    from stepwatch._identity import endpoint_target

    job = f"pytest-{uuid.uuid4().hex[:8]}"
    target = endpoint_target()
    first = Client(target, _hello_of(job), run_id="fit-1")
    second = Client(target, _hello_of(job), run_id="fit-2")
    try:
        first.mark(STEP_BEGIN, 1)
        first.mark(FORWARD_BEGIN, 1)
        assert first.flush(FLUSH_S), first.stats()
        # fit-1's markers applied before fit-2 opens (else they are what is refused).
        _wait_report(
            real_agent,
            job,
            lambda r: r["info"]["run_id"] == "fit-1" and len(r["steps"]) == 1,
            "fit-1's step 1 begins",
        )
        second.mark(STEP_BEGIN, 1)
        assert second.flush(FLUSH_S), second.stats()
        _wait_report(real_agent, job, lambda r: r["info"]["run_id"] == "fit-2", "fit-2 opens")
        with caplog.at_level(logging.WARNING, logger="stepwatch"):
            first.mark(BACKWARD_BEGIN, 1)  # fit-1's stream is still open: refused
            _sender_ends(first, "refused as run_ended")
        st = first.stats()
        assert st["stopped"] == "run_ended", st
        assert (st["connects"], st["reconnects"], st["rejections"]) == (1, 0, 1), st
        assert _metric(real_agent, "stepwatch_markers_rejected_total", 'reason="run_ended"') == 1
        assert _metric(real_agent, "stepwatch_markers_rejected_total", 'reason="rank_held"') == 0
        said = [r.getMessage() for r in caplog.records if r.name == "stepwatch"]
        assert len(said) == 1, said
        assert "run_ended" in said[0] and "fit-2" in said[0] and "one stepwatch" in said[0], said
        # Marking goes on, never blocks, and sends nothing (counted as dropped);
        # flush says so at once.
        dropped = first.stats()["dropped"]
        first.mark(STEP_BEGIN, 2)
        assert first.flush(FLUSH_S) is False
        assert first.stats()["dropped"] == dropped + 1, first.stats()
        # The run that holds the rank goes on undisturbed.
        second.mark(FORWARD_BEGIN, 1)
        assert second.flush(FLUSH_S), second.stats()
        report = _wait_report(
            real_agent,
            job,
            lambda r: [p["phase"] for p in r["steps"][0]["phases"]] == ["prologue", "forward"],
            "fit-2's forward",
        )
        assert report["info"]["run_id"] == "fit-2" and len(report["steps"]) == 1, report
        assert second.stats()["stopped"] is None and second.stats()["rejections"] == 0
    finally:
        first.close(0.2)
        second.close(0.2)


def test_a_client_whose_run_the_process_has_left_is_refused_once_and_stops(real_agent, caplog):
    """A client that opens its first stream with a run its process has since
    left (the rank runs a newer one): the hello is refused as ``rank_held`` for
    good, and the client stops after that one try."""
    from stepwatch._client import STEP_BEGIN, Client
    from stepwatch._identity import endpoint_target

    job = f"pytest-{uuid.uuid4().hex[:8]}"
    target = endpoint_target()
    old = Client(target, _hello_of(job), run_id="fit-1")
    old.mark(STEP_BEGIN, 1)
    assert old.flush(FLUSH_S), old.stats()
    old.close(FLUSH_S)
    new = Client(target, _hello_of(job), run_id="fit-2")
    late = Client(target, _hello_of(job), run_id="fit-1")
    try:
        new.mark(STEP_BEGIN, 1)
        assert new.flush(FLUSH_S), new.stats()
        _wait_report(real_agent, job, lambda r: r["info"]["run_id"] == "fit-2", "fit-2 opens")
        with caplog.at_level(logging.WARNING, logger="stepwatch"):
            late.mark(STEP_BEGIN, 1)
            _sender_ends(late, "refused as rank_held for a left run")
        st = late.stats()
        assert st["stopped"] == "rank_held" and st["connects"] == 1, st
        assert _metric(real_agent, "stepwatch_markers_rejected_total", 'reason="rank_held"') == 1
        said = [r.getMessage() for r in caplog.records if r.name == "stepwatch"]
        assert len(said) == 1 and "rank_held" in said[0], said
    finally:
        late.close(0.2)
        new.close(0.2)


def test_a_client_whose_hello_the_agent_finds_invalid_is_refused_once_and_stops(real_agent, caplog):
    """A hello that breaks the contract (a world of 100000 ranks, beyond the
    agent's 65536, as WORLD_SIZE=100000 gives) is the same on every reconnect, so
    the agent refuses it for good: the client says once what to fix and stops,
    instead of reconnecting every 10 s for the rest of training."""
    from stepwatch._client import FORWARD_BEGIN, STEP_BEGIN, Client
    from stepwatch._identity import endpoint_target
    from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

    job = f"pytest-{uuid.uuid4().hex[:8]}"

    def hello():
        return pb.Hello(
            identity=pb.Identity(job_id=job, rank=0, world_size=100_000),
            pid=os.getpid(),
            framework="pytorch",
        )

    client = Client(endpoint_target(), hello, run_id="fit-1")
    try:
        with caplog.at_level(logging.WARNING, logger="stepwatch"):
            client.mark(STEP_BEGIN, 1)
            _sender_ends(client, "refused as rank_out_of_range")
        st = client.stats()
        assert st["stopped"] == "rank_out_of_range", st
        assert (st["connects"], st["reconnects"], st["rejections"]) == (1, 0, 1), st
        assert (
            _metric(real_agent, "stepwatch_markers_rejected_total", 'reason="rank_out_of_range"')
            == 1
        )
        said = [r.getMessage() for r in caplog.records if r.name == "stepwatch"]
        assert len(said) == 1, said
        assert "rank_out_of_range" in said[0] and "world_size 100000" in said[0], said
        assert "WORLD_SIZE" in said[0] and "another stepwatch client" not in said[0], said
        # Marking goes on, never blocks and sends nothing; flush says so at once.
        client.mark(FORWARD_BEGIN, 1)
        assert client.flush(FLUSH_S) is False
    finally:
        client.close(0.2)


def test_a_rank_another_process_holds_is_retried_until_its_stream_closes(
    sock_dir, monkeypatch, tmp_path
):
    """``rank_held`` by another process is no refusal for good: a restarted
    process takes the rank once the old one's stream has closed, so the client
    keeps reconnecting (with backoff) until then."""
    from stepwatch._client import STEP_BEGIN, Client
    from stepwatch._identity import endpoint_target

    # Over TCP the agent takes the PID from the hello: another "process".
    agent = _Agent(agent_binary(), sock_dir, tmp_path, ["--grpc-listen", "127.0.0.1:0"])
    agent.start()
    job = f"pytest-{uuid.uuid4().hex[:8]}"
    holder = Client(endpoint_target("unix://" + agent.socket), _hello_of(job), run_id="a")
    other = Client(agent.grpc or "", _hello_of(job, pid=1), run_id="b")
    try:
        holder.mark(STEP_BEGIN, 1)
        assert holder.flush(FLUSH_S), holder.stats()
        _wait_report(agent, job, lambda r: r["info"]["run_id"] == "a", "the holder opens")
        other.mark(STEP_BEGIN, 1)
        deadline = time.monotonic() + FLUSH_S
        while _metric(agent, "stepwatch_markers_rejected_total", 'reason="rank_held"') < 2:
            assert time.monotonic() < deadline, other.stats()
            time.sleep(0.05)
        assert other.stats()["stopped"] is None, other.stats()
        holder.close(FLUSH_S)
        report = _wait_report(agent, job, lambda r: r["info"]["run_id"] == "b", "the rank is taken")
        assert report["info"]["pid"] == 1, report["info"]
        st = other.stats()
        assert st["stopped"] is None and st["reconnects"] >= 2, st
    finally:
        other.close(0.2)
        holder.close(0.2)
        agent.stop()


_CHILD_SCRIPT_DONE = b"\n"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_that_marks_steps_sends_nothing_says_so_once_and_never_hangs(real_agent):
    """``os.fork()`` after the client connected, then the child marks steps
    itself. The child is another process with the parent's rank, on a copy of
    gRPC the fork left unusable (the sender was inside gRPC): it must not open
    a channel there (it could hang or abort, and the agent would refuse it as
    ``rank_held`` while the parent holds the rank, over and over). Its client
    sends nothing, logs one warning that says what to do, and marking, flush
    and exit stay quick; the parent's rank and stream are untouched."""
    job = f"pytest-{uuid.uuid4().hex[:8]}"
    stepwatch.configure(job_id=job)
    mark_steps(1, start=1)
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    real_agent.rank_report(job, 0, 1)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what happened through the pipe, then exit
        try:
            said: list = []

            class Keep(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    said.append(record.getMessage())

            logging.getLogger("stepwatch").addHandler(Keep(logging.WARNING))
            t0 = time.monotonic()
            mark_steps(3, start=2)
            flushed = stepwatch.flush(5)
            first = stepwatch.stats()
            stepwatch.shutdown(timeout=5)
            mark_steps(1, start=5)  # a new client after shutdown: still nothing sent
            took = time.monotonic() - t0
            out = dict(stats=[first, stepwatch.stats()], flushed=flushed, said=said, took=took)
            os.write(w, json.dumps(out).encode() + _CHILD_SCRIPT_DONE)
        finally:
            os._exit(0)
    os.close(w)
    got = b""
    deadline = time.monotonic() + 120
    while not got.endswith(_CHILD_SCRIPT_DONE):
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, 9)
            pytest.fail("the forked child did not answer in 120 s: it hung")
        chunk = os.read(r, 65536)
        if not chunk:
            break
        got += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child ended with {status}"
    child = json.loads(got)
    for st in child["stats"]:  # the inherited client, then one made after shutdown()
        assert st["sent"] == 0 and st["connects"] == 0 and st["queued"] == 0, st
        assert st.get("stopped") == "forked", st
    assert child["flushed"] is False and child["took"] < 30, child
    assert len(child["said"]) == 1, child["said"]
    assert f"forked from pid {os.getpid()}" in child["said"][0], child["said"]
    assert "'spawn'" in child["said"][0], child["said"]
    # The agent never heard from the child; the parent goes on on its stream.
    assert _metric(real_agent, "stepwatch_markers_rejected_total", 'reason="rank_held"') == 0
    mark_steps(1, start=2)
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = real_agent.rank_report(job, 0, 2)
    assert report["info"]["pid"] == os.getpid() and report["steps_completed"] == 2, report
    st = stepwatch.stats()
    assert st["stopped"] is None and st["connects"] == 1 and st["reconnects"] == 0, st
