"""The marker queue and the background sender that owns the gRPC stream.

The training thread only ever appends a tuple to a bounded deque. A daemon
thread drains it, turns tuples into protobuf messages and writes them to the
agent's bidirectional ``Ingest.Stream``; it reconnects with exponential backoff
(sending a fresh Hello each time) and hands advisories to the logger and to the
user's callback. Nothing here blocks or raises into training unless the client
was made ``strict``.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import random
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from ._tls import TlsMaterial

log = logging.getLogger("stepwatch")

# Marker kinds, as in stepwatch.v1.MarkerKind.
STEP_BEGIN = 1
FORWARD_BEGIN = 2
BACKWARD_BEGIN = 3
OPTIMIZER_BEGIN = 4
OPTIMIZER_END = 5
STEP_END = 6
OOM = 7
EVAL_BEGIN = 8
EVAL_END = 9
CHECKPOINT_BEGIN = 10
CHECKPOINT_END = 11

# stats() counters, in the order they are listed (see Client._reset_state).
COUNTER_NAMES = (
    "enqueued",  # markers handed to mark()
    "sent",  # markers written to a stream
    "dropped",  # markers lost because the queue was full
    "batches",  # MarkerBatch messages written
    "connects",  # streams opened (Hello sent)
    "reconnects",  # streams opened after the first one
    "connect_failures",  # attempts that found no agent
    "stream_errors",  # streams that ended with an error status
    "rejections",  # streams the agent refused (bad input / rate limit)
    "advisories",  # advisories received
    "hook_errors",  # internal errors swallowed in hooks
    "allocator_traces_sent",  # step-1 allocator traces written whole to a stream
    "allocator_traces_refused",  # traces not sent: incomplete, too large, failed
    "model_updates_sent",  # facts learnt after the hello (zero_grad) sent to the agent
    "oom_reports_sent",  # what the allocator knew at an OOM, sent after its marker
    "runs",  # new runs begun after the first (a second watch() or fit): a new stream each
    "layout_snapshots_sent",  # step 1's segment layouts queued on its optimizer markers
)

MAX_MARKERS_PER_BATCH = 1024  # the agent's limit
MAX_BATCH_BYTES = 60 * 1024  # the agent refuses messages over 64 KiB

# Trailing metadata of a stream the agent refused (see ingest.proto): the
# refusal's reason, and "never" when no reconnect can pass (the client's run
# has ended on the rank, or its hello breaks the contract and every reconnect
# would send the same one), so reconnecting is futile.
REFUSAL_METADATA = "stepwatch-refusal"
RETRY_METADATA = "stepwatch-retry"
# The refusals "never" marks when the client's run is over on the rank (a newer
# run of the process holds it); the others it marks are of the hello itself.
RUN_OVER_REFUSALS = ("run_ended", "rank_held")
# Client.stats()["stopped"] of a client in a child forked after stepwatch used
# gRPC in the parent (see _after_fork_in_child).
STOPPED_FORKED = "forked"

# (kind, step, monotonic_ns, wall_ns, micro_batch, allocator 7-tuple or None,
#  device memory (free, total) or None, batch facts or None), and on step 1's
# optimizer markers without a trace a 9th item: the segment layout
# (_alloctrace.Layout).
MarkerTuple = tuple[Any, ...]
# BatchFacts as the client queues them: (samples or None, tokens or None,
# shape as a tuple of ints, possibly empty).
Batch = tuple[Optional[int], Optional[int], tuple[int, ...]]

_monotonic_ns = time.monotonic_ns
_time_ns = time.time_ns


class StepwatchError(RuntimeError):
    """Raised into training only by a client made with ``strict=True``."""


@dataclass
class Prediction:
    """An advisory from the agent (``stepwatch.last_prediction()`` returns the latest)."""

    kind: str
    severity: str
    message: str
    step: int
    predicted_peak_bytes: int
    capacity_bytes: int
    predicted_headroom_bytes: int
    received_wall_ns: int = field(default_factory=time.time_ns)


class PredictedOutOfMemoryError(StepwatchError):
    """Raised into training, with ``watch(raise_on_predicted_oom=True)``, at the
    first step boundary after the agent predicted that step 2 will run out of
    GPU memory (its ``ADVISORY_KIND_STEP2_OOM_PREDICTED`` advisory): the job
    stops before step 2 allocates instead of dying in it.

    ``prediction`` is the advisory; ``predicted_peak_bytes``,
    ``capacity_bytes`` and ``predicted_headroom_bytes`` its figures and
    ``advice`` the agent's sentence (by how much, and what would fit)."""

    def __init__(self, prediction: Prediction, rank: Optional[int] = None) -> None:
        self.prediction = prediction
        self.predicted_peak_bytes = prediction.predicted_peak_bytes
        self.capacity_bytes = prediction.capacity_bytes
        self.predicted_headroom_bytes = prediction.predicted_headroom_bytes
        self.advice = prediction.message
        super().__init__(
            advisory_text(prediction, rank).replace(
                "stepwatch advisory", "stepwatch: step 2 is predicted to run out of GPU memory", 1
            )
            + "; stopped before step 2 began (watch(raise_on_predicted_oom=True))"
        )


def _fmt_bytes(n: int) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{n} B"


def advisory_text(p: Prediction, rank: Optional[int] = None) -> str:
    """The log line for an advisory, e.g. for a person reading training logs."""
    who = f"rank {rank}, " if rank is not None else ""
    text = f"stepwatch advisory ({who}step {p.step}): {p.message or p.kind}"
    figures = []
    if p.predicted_peak_bytes:
        figures.append(f"predicted peak {_fmt_bytes(p.predicted_peak_bytes)}")
    if p.capacity_bytes:
        figures.append(f"GPU capacity {_fmt_bytes(p.capacity_bytes)}")
    if p.predicted_peak_bytes or p.capacity_bytes:
        figures.append(f"headroom {_fmt_bytes(p.predicted_headroom_bytes)}")
    if figures:
        text += " [" + ", ".join(figures) + "]"
    return text


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


_all_clients: weakref.WeakSet[Client] = weakref.WeakSet()

# grpc and the stubs (ingest_pb2, ingest_pb2_grpc), once load_wire imported them.
_wire: Optional[tuple[Any, Any, Any]] = None

# What the stubs and the client are tested on (tests/test_protobuf_compat.py).
SUPPORTED_RUNTIMES = "grpcio >= 1.51.3 and protobuf >= 4.21.6, < 8"


# gRPC reads it once, when it is first imported.
_GRPC_FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"


def _import_grpc_without_fork_support() -> None:
    """Import grpc with its fork support off, unless the process imported it
    already or its environment chose. With it on, grpcio's fork handlers
    restart gRPC's threads in every forked child (each DataLoader worker), and
    they run the parent's pending gRPC work on the child's copy of gRPC, which
    a fork taken while a thread was inside gRPC left broken: the worker aborts
    in ev_epoll1 ("next_worker->state == KICKED") or crashes. Off, a forked
    child's gRPC stays idle, which is what stepwatch needs there (a forked
    child sends nothing). The variable is set only for the import, so that
    the processes this one starts do not inherit it."""
    if "grpc" in sys.modules or _GRPC_FORK_SUPPORT in os.environ:
        return
    os.environ[_GRPC_FORK_SUPPORT] = "false"
    try:
        import grpc  # noqa: F401 (imported for its side effect: gRPC reads the setting)
    finally:
        os.environ.pop(_GRPC_FORK_SUPPORT, None)


def load_wire() -> tuple[Any, Any, Any]:
    """grpc, ingest_pb2 and ingest_pb2_grpc, imported once. An environment whose
    grpcio or protobuf the stubs cannot use (e.g. protobuf 3.20, pinned by old
    TensorFlow) raises :class:`StepwatchError` naming it and what is supported:
    the client logs it once and acts as if no agent answered; ``strict=True``
    raises it from ``watch()``/``configure()``."""
    global _wire
    if _wire is None:
        try:
            _import_grpc_without_fork_support()
            import grpc

            from ._proto.stepwatch.v1 import ingest_pb2, ingest_pb2_grpc
        except Exception as e:
            raise StepwatchError(
                f"cannot load grpcio/protobuf ({e}); stepwatch needs {SUPPORTED_RUNTIMES}"
            ) from e
        _wire = (grpc, ingest_pb2, ingest_pb2_grpc)
    return _wire


class Client:
    """One rank's connection to the agent. Cheap to create; starts its thread lazily.

    ``hello_factory`` returns the Hello message to open each stream with; it is
    called on the sender thread at every (re)connect, so identity and model facts
    set after construction are picked up by the next stream.
    """

    def __init__(
        self,
        target: str,
        hello_factory: Callable[[], Any],
        *,
        queue_size: Optional[int] = None,
        on_advisory: Optional[Callable[[Prediction], None]] = None,
        strict: bool = False,
        connect_timeout: Optional[float] = None,
        backoff_initial: float = 0.1,
        backoff_max: Optional[float] = None,
        flush_interval: Optional[float] = None,
        rank_for_logs: Optional[int] = None,
        tls: Optional[TlsMaterial] = None,
        run_id: str = "",
    ) -> None:
        self.target = target
        # The run of the oldest item still queued: what the next stream's hello
        # says (a new run's markers queue behind a NewRun; see new_run).
        self._run_id = run_id
        # None: plaintext. Otherwise the PEM files, read once by the caller; when
        # they could not be read (tls.error) the client never connects, as if no
        # agent answered.
        self.tls = tls
        if tls is not None and tls.error is not None:
            log.error(
                "stepwatch: TLS for %s is unusable: %s; markers will not reach the agent "
                "(training goes on)",
                target,
                tls.error,
            )
        self.hello_factory = hello_factory
        self._queue_size = queue_size or _env_int("STEPWATCH_QUEUE_SIZE", 16384)
        self.on_advisory = on_advisory
        self.strict = strict
        self.connect_timeout = (
            connect_timeout
            if connect_timeout is not None
            else _env_float("STEPWATCH_CONNECT_TIMEOUT", 2.0)
        )
        self.backoff_initial = backoff_initial
        self.backoff_max = (
            backoff_max if backoff_max is not None else _env_float("STEPWATCH_BACKOFF_MAX", 10.0)
        )
        self.flush_interval = (
            flush_interval
            if flush_interval is not None
            else _env_float("STEPWATCH_FLUSH_INTERVAL_MS", 10.0) / 1000.0
        )
        self.rank_for_logs = rank_for_logs
        self._last_prediction: Optional[Prediction] = None
        self._strict_error: Optional[BaseException] = None
        self._reset_state()
        _all_clients.add(self)

    # ----------------------------------------------------------------- state
    def _reset_state(self) -> None:
        """Fresh queue, counters and thread state (also used in a forked child)."""
        # MarkerTuples, and at most one _alloctrace.AllocatorTrace (step 1's).
        # maxlen: the queue's bound as `mark` reads it (0 once stopped).
        self.maxlen = self._queue_size
        self._q: collections.deque[Any] = collections.deque(maxlen=self.maxlen)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._channel: Any = None
        self._call: Any = None  # the open stream, for _after_fork_in_child
        self._connected = False
        self._agent_absent = False
        self._in_flight = 0
        self._pid = os.getpid()
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._warned: dict[str, float] = {}
        # Why the client sends nothing for the rest of its life (None while it
        # does): the agent refused its run for good, or it lives in a child
        # forked from a process that used gRPC. Its markers are discarded.
        self._stopped: Optional[str] = None
        if _forked_from is not None:
            self._stop_sending(STOPPED_FORKED)

    def _stop_sending(self, why: str) -> None:
        """Send nothing from now on: the queue discards what it is given (and what
        it held), so a stopped client costs no memory and no thread. What it
        discards counts as dropped."""
        self._stopped = why
        # A bound of 0: `mark` counts each marker it is given as dropped (as
        # the Rust client does) at no cost on its path.
        self.maxlen = 0
        self._q = collections.deque(maxlen=0)

    def _after_fork_in_child(self) -> None:
        # The parent's thread and channel do not exist in the child; its queued
        # markers belong to the parent. Start over, lazily. The parent's gRPC
        # objects are kept, never finalized here: that would run gRPC code on
        # the child's copy of gRPC (see the module's _after_fork_in_child).
        _PARENT_GRPC_OBJECTS.append((self._channel, self._call))
        self._reset_state()

    def send_allocator_trace(self, trace: Any) -> None:
        """Queue step 1's allocator trace (an ``_alloctrace.AllocatorTrace``) after the
        markers queued so far. Never blocks; it is one unit of the queue: the sender
        writes all its chunks on one stream, and a trace that does not make it (no
        agent, queue overflow, stream lost midway) is dropped, never resent."""
        self._enqueue(trace)

    def new_run(self, run_id: str) -> None:
        """Begin another training run (a second ``watch()`` or ``fit()``): what is
        queued so far still goes out on the current stream, then the sender ends
        it, waits for the agent to finish it, and opens a new stream whose hello
        carries ``run_id``, so the agent starts the rank at step 1 again. Never
        blocks."""
        self._enqueue(NewRun(run_id))

    def send_model_update(self, facts: dict[str, Any]) -> None:
        """Queue facts learnt after the hello (ModelFacts fields by name) after
        the markers queued so far; the agent merges them into the hello's."""
        self._enqueue(QueuedMessage("model_update", facts, "model_updates_sent"))

    def send_oom_report(self, report: dict[str, Any]) -> None:
        """Queue what the allocator knew at an OOM (OomReport fields by name)
        after the markers queued so far: the OOM marker comes first."""
        self._enqueue(QueuedMessage("oom_report", report, "oom_reports_sent"))

    # --------------------------------------------------------- training side
    def _enqueue(self, item: Any) -> None:
        """Queue an item (what `mark` does inline for markers)."""
        q = self._q
        if len(q) >= self.maxlen:
            self._dropping_oldest()
        q.append(item)
        if self._thread is None:
            self._start()

    def mark(
        self,
        kind: int,
        step: int,
        micro_batch: int = 0,
        allocator: Optional[tuple[int, ...]] = None,
        device: Optional[tuple[int, int]] = None,
        layout: Any = None,
        batch: Optional[Batch] = None,
    ) -> None:
        """Queue one marker. Never blocks; counts a drop when the queue is full.
        ``device`` is (free, total) from cudaMemGetInfo, sent at step 1's
        markers; ``layout`` (an ``_alloctrace.Layout``) step 1's segment
        layout, on its optimizer markers; ``batch`` the micro-batch's size."""
        # _enqueue inlined: this is the training thread's per-marker path, and
        # the extra call costs about a quarter of it.
        q = self._q
        if len(q) >= self.maxlen:
            self._dropping_oldest()
        t = (kind, step, _monotonic_ns(), _time_ns(), micro_batch, allocator, device, batch)
        q.append(t if layout is None else t + (layout,))
        if self._thread is None:
            self._start()
        self.counters["enqueued"] += 1
        if self._strict_error is not None and self.strict:
            err, self._strict_error = self._strict_error, None
            raise StepwatchError(str(err)) from err

    def _dropping_oldest(self) -> None:
        """The queue is full: the deque discards its oldest item on the next append.
        Counted; a NewRun discarded so takes effect (the items of its run that
        remain are what the next stream carries)."""
        self.counters["dropped"] += 1
        try:
            head = self._q[0]
        except IndexError:  # the sender took it meanwhile
            return
        if type(head) is NewRun:
            self._run_id = head.run_id

    def _start(self) -> None:
        if self._stopped is not None:
            if self._stopped == STOPPED_FORKED:
                _tell_forked_once()
            return
        with self._lock:
            if self._thread is not None or self._closed.is_set():
                return
            t = threading.Thread(target=self._run, name="stepwatch-sender", daemon=True)
            self._thread = t
            t.start()

    def start(self) -> None:
        """Start the sender now instead of at the first marker."""
        if self._thread is None:
            self._start()

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.counters)
        s["queued"] = len(self._q)
        s["connected"] = self._connected
        s["endpoint"] = self.target
        s["tls"] = self.tls is not None
        s["stopped"] = self._stopped
        return s

    def last_prediction(self) -> Optional[Prediction]:
        return self._last_prediction

    def agent_may_answer(self) -> bool:
        """Whether an agent may answer soon: the client still sends, its stream is
        open or being opened, its last connect attempt did not come back empty,
        and (for a Unix socket) the socket exists."""
        if self._stopped is not None or self._agent_absent or self._closed.is_set():
            return False
        if self._connected:
            return True
        path = _unix_socket_path(self.target)
        return path is None or os.path.exists(path)

    def wait_connected(self, timeout: float) -> bool:
        """Start the sender and wait until a stream is open (for strict mode and tests)."""
        self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._connected:
                return True
            if self._stopped is not None:
                return False
            time.sleep(0.01)
        return self._connected

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait (at most ``timeout`` s) until everything queued has been written.
        False at once when the client has stopped sending (``stats()["stopped"]``)."""
        if self._stopped is not None:
            return False
        if self._thread is None:
            return not self._q
        deadline = time.monotonic() + timeout
        self._wake.set()
        while time.monotonic() < deadline:
            if not self._q and self._in_flight == 0:
                return True
            if self._agent_absent or self._stopped is not None:
                return False
            time.sleep(0.002)
            self._wake.set()
        return not self._q and self._in_flight == 0

    def close(self, timeout: float = 1.0) -> None:
        """Flush for at most ``timeout`` seconds, end the stream, stop the thread."""
        if os.getpid() != self._pid:
            self._reset_state()
        # Wait for delivery while a stream is open or still being opened; not when
        # the last attempt found no agent (exit must stay quick then).
        if self._thread is not None and (self._connected or not self._agent_absent):
            self.flush(timeout)
        self._closed.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(max(0.05, min(timeout, 0.5)))
        ch = self._channel
        if ch is not None:
            try:
                ch.close()
            except Exception:  # pragma: no cover - best effort at shutdown
                pass

    # ----------------------------------------------------------- sender side
    def _warn(self, key: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
        """Log at most once a minute per key (an absent agent: once), then at DEBUG."""
        now = time.monotonic()
        last = self._warned.get(key)
        if last is None or (now - last > 60.0 and key != "absent"):
            self._warned[key] = now
            log.log(level, msg, *args)
        else:
            log.debug(msg, *args)

    def _run(self) -> None:
        try:
            grpc, _, ingest_pb2_grpc = load_wire()
        except StepwatchError as e:
            # Logged once; then as with an absent agent (queued, dropped, counted).
            self.counters["connect_failures"] += 1
            self._agent_absent = True
            log.error("stepwatch: %s; markers will not reach the agent (training goes on)", e)
            if self.strict:
                self._strict_error = e
            return
        credentials = None
        tls = self.tls
        if tls is not None:
            if tls.error is not None:
                # Logged when the client was made; behave as with an absent agent.
                self.counters["connect_failures"] += 1
                self._agent_absent = True
                if self.strict:
                    self._strict_error = StepwatchError(f"TLS is unusable: {tls.error}")
                return
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.root_certificates,
                private_key=tls.private_key,
                certificate_chain=tls.certificate_chain,
            )
        over = " over TLS" if tls is not None else ""
        # Shown in the "no agent" warning: a failed handshake looks the same.
        absent_hint = (
            " (or the TLS handshake failed: check the agent's TLS port, the CA and, "
            "for mutual TLS, the client certificate)"
            if tls is not None
            else ""
        )
        backoff = self.backoff_initial
        first = True
        while not self._closed.is_set():
            options: list[tuple[str, Union[int, str]]] = [
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ]
            if self.target.startswith("unix"):
                # grpc-core would send the socket path, percent-encoded, as
                # :authority; the agent's HTTP/2 stack (hyper) resets such
                # streams with PROTOCOL_ERROR.
                options.append(("grpc.default_authority", "localhost"))
            if credentials is not None:
                channel = grpc.secure_channel(self.target, credentials, options=options)
            else:
                channel = grpc.insecure_channel(self.target, options=options)
            self._channel = channel
            healthy = False
            new_run = False
            stop: Optional[str] = None
            try:
                if not self._wait_ready(grpc, channel):
                    if self._closed.is_set():
                        break
                    self.counters["connect_failures"] += 1
                    self._agent_absent = True
                    self._warn(
                        "absent",
                        "stepwatch: no agent at %s%s%s; training goes on, markers are "
                        "kept (up to %d) and then dropped; retrying",
                        self.target,
                        over,
                        absent_hint,
                        self.maxlen,
                    )
                    continue
                if self._agent_absent:
                    log.info("stepwatch: connected to the agent at %s%s", self.target, over)
                self._agent_absent = False
                if self._closed.is_set():
                    break
                stub = ingest_pb2_grpc.IngestStub(channel)
                stream = _StreamState()
                call = stub.Stream(self._requests(stream))
                self._call = call
                self.counters["connects"] += 1
                if not first:
                    self.counters["reconnects"] += 1
                first = False
                try:
                    for msg in call:
                        healthy = True
                        self._on_agent_message(msg)
                    healthy = healthy or stream.hello_sent
                    if stream.new_run:
                        # We ended it for a new run; the agent has finished it.
                        self.counters["runs"] += 1
                        first = True  # the new run's stream is no reconnect
                        new_run = True
                    elif not self._closed.is_set():
                        self._warn("ended", "stepwatch: the agent closed the stream; reconnecting")
                except grpc.RpcError as e:
                    healthy = healthy or stream.batches > 0
                    stop = self._on_rpc_error(e)
                finally:
                    stream.closed = True
                    self._call = None
                    self._connected = False
                    self._in_flight = 0
            except Exception as e:  # never let the sender die
                self.counters["stream_errors"] += 1
                self._warn("internal", "stepwatch: sender error: %r", e)
            finally:
                self._connected = False
                try:
                    channel.close()
                except Exception:
                    pass
                self._channel = None
            if stop is not None:
                self._stop_sending(stop)
                break
            if self._closed.is_set():
                break
            if new_run:
                backoff = self.backoff_initial
                continue  # no wait: the new run's stream opens at once
            if healthy:
                backoff = self.backoff_initial
            delay = backoff * (0.5 + random.random() / 2)
            backoff = min(backoff * 2, self.backoff_max)
            self._closed.wait(delay)

    def _wait_ready(self, grpc: Any, channel: Any) -> bool:
        """Wait for the channel to connect; give up on timeout or close()."""
        fut = grpc.channel_ready_future(channel)
        deadline = time.monotonic() + self.connect_timeout
        try:
            while not self._closed.is_set():
                try:
                    fut.result(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
                    return True
                except grpc.FutureTimeoutError:
                    if time.monotonic() >= deadline:
                        return False
            return False
        finally:
            fut.cancel()

    def _on_rpc_error(self, e: Any) -> Optional[str]:
        """Counts and logs how a stream ended; returns the refusal's reason when the
        agent refused the client for good (``stepwatch-retry: never``: its run is
        over on the rank, or its hello breaks the contract), which no reconnect can
        cure: the caller then stops sending."""
        import grpc

        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        if self._closed.is_set() and code == grpc.StatusCode.CANCELLED:
            return None
        self.counters["stream_errors"] += 1
        name = code.name if code is not None else "UNKNOWN"
        reason, for_good = _refusal_of(e)
        if for_good:
            self.counters["rejections"] += 1
            if reason in RUN_OVER_REFUSALS:
                log.warning(
                    "stepwatch: the agent refused this client's stream for good (%s: %s). "
                    "Its run %r has ended on the rank: another stepwatch client in this "
                    "process began a newer run there, and the agent follows that one. This "
                    "client stops sending: its markers are not sent (training goes on). "
                    "Report each rank from one stepwatch client per process (one "
                    "stepwatch.watch() or callback per training loop)",
                    reason or name,
                    details,
                    self._run_id,
                )
            else:
                log.warning(
                    "stepwatch: the agent refused this client's hello for good (%s: %s). "
                    "Every reconnect would send the same hello, so this client stops "
                    "sending: its markers are not sent (training goes on). Fix what the "
                    "agent names: the rank's identity (STEPWATCH_JOB_ID, RANK, WORLD_SIZE "
                    "or the arguments of stepwatch.configure()) or its model facts",
                    reason or name,
                    details,
                )
            if self.strict:
                self._strict_error = StepwatchError(
                    f"agent refused the stream for good: {reason or name}: {details}"
                )
            return reason or name
        if code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.OUT_OF_RANGE,
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED,
        ):
            self.counters["rejections"] += 1
            self._warn(
                f"reject-{name}",
                "stepwatch: the agent rejected the stream (%s: %s); reconnecting",
                name,
                details,
            )
            if self.strict:
                self._strict_error = StepwatchError(f"agent rejected the stream: {name}: {details}")
        else:
            self._warn(
                f"err-{name}", "stepwatch: stream to the agent ended (%s: %s)", name, details
            )
        return None

    def _on_agent_message(self, msg: Any) -> None:
        if msg.WhichOneof("kind") != "advisory":
            return
        a = msg.advisory
        from ._proto.stepwatch.v1 import ingest_pb2 as pb

        p = Prediction(
            kind=pb.AdvisoryKind.Name(a.kind)
            if a.kind in pb.AdvisoryKind.values()
            else str(a.kind),
            severity=pb.Severity.Name(a.severity)
            if a.severity in pb.Severity.values()
            else str(a.severity),
            message=a.message,
            step=a.step,
            predicted_peak_bytes=a.predicted_peak_bytes,
            capacity_bytes=a.capacity_bytes,
            predicted_headroom_bytes=a.predicted_headroom_bytes,
        )
        # Only the step-2 prediction's advisories replace last_prediction():
        # rank divergence (about the rank's peers), allocator retries and low
        # observed headroom (observations after step 1) and kinds newer than
        # this client are not predictions; they are logged and passed to
        # on_advisory all the same.
        if a.kind in (pb.ADVISORY_KIND_STEP2_OOM_PREDICTED, pb.ADVISORY_KIND_LOW_HEADROOM):
            self._last_prediction = p
        self.counters["advisories"] += 1
        level = logging.INFO if a.severity == pb.SEVERITY_INFO else logging.WARNING
        log.log(level, "%s", advisory_text(p, self.rank_for_logs))
        cb = self.on_advisory
        if cb is not None:
            try:
                cb(p)
            except Exception:
                log.exception("stepwatch: on_advisory callback raised")

    def _requests(self, stream: _StreamState) -> Iterator[Any]:
        from ._proto.stepwatch.v1 import ingest_pb2 as pb

        q = self._q
        # NewRuns at the head (nothing of the old run left to send) only
        # change the run this stream's hello names.
        while q and type(q[0]) is NewRun:
            try:
                self._run_id = q.popleft().run_id
            except IndexError:
                break
        hello = self.hello_factory()
        if self._run_id:
            hello.run_id = self._run_id
        yield pb.ClientMessage(hello=hello)
        stream.hello_sent = True
        self._connected = True
        interval = self.flush_interval
        while not stream.closed:
            trace = stream.trace
            if trace is not None:
                stream.trace = None
                if isinstance(trace, NewRun):
                    # Half-close: the agent applies what this stream carried and
                    # ends it; _run then opens the new run's stream at once.
                    self._run_id = trace.run_id
                    stream.new_run = True
                    self._in_flight = 0
                    return
                self._in_flight = 1
                if isinstance(trace, QueuedMessage):
                    yield trace.message(pb)
                    self.counters[trace.counter] += 1
                else:
                    yield from self._trace_messages(pb, trace)
                self._in_flight = 0
                continue
            if q or stream.held is not None:
                items: list[MarkerTuple] = []
                size = 0
                if stream.held is not None:
                    items.append(stream.held)
                    size = _tuple_bytes(stream.held)
                    stream.held = None
                while q and len(items) < MAX_MARKERS_PER_BATCH and size < MAX_BATCH_BYTES:
                    try:
                        t = q.popleft()
                    except IndexError:
                        break
                    if type(t) is not tuple:
                        # An allocator trace, a facts update or a new run:
                        # handled after this batch, on its own.
                        stream.trace = t
                        break
                    t_bytes = _tuple_bytes(t)
                    if items and size + t_bytes > MAX_BATCH_BYTES:
                        stream.held = t  # a marker with a layout: the next batch's first
                        break
                    items.append(t)
                    size += t_bytes
                n = len(items)
                if n == 0:
                    continue
                after = (stream.trace is not None) + (stream.held is not None)
                self._in_flight = n + after
                msg = pb.ClientMessage(
                    markers=pb.MarkerBatch(markers=[_to_pb(pb, t) for t in items])
                )
                stream.batches += 1
                self.counters["sent"] += n
                self.counters["batches"] += 1
                yield msg
                # grpc asks for the next message once this one went out.
                self._in_flight = after
                continue
            if self._closed.is_set():
                return  # half-close: the agent sees the end of our stream
            self._wake.wait(interval)
            self._wake.clear()

    def _trace_messages(self, pb: Any, trace: Any) -> Iterator[Any]:
        """The trace's chunks, in order, on this stream. If the stream ends midway
        the rest is dropped: a new stream must not get chunks without their start."""
        it = iter(trace.messages(pb))
        while True:
            try:
                msg = next(it)
            except StopIteration:
                return
            except Exception as e:  # a bug in encoding: drop the trace, keep the stream
                self.counters["allocator_traces_refused"] += 1
                log.warning("stepwatch: could not encode step 1's allocator trace: %r", e)
                return
            if msg.allocator_trace.last:
                self.counters["allocator_traces_sent"] += 1
                log.debug("stepwatch: step 1's allocator trace sent (%d events)", trace.num_events)
            yield msg


class QueuedMessage:
    """A ClientMessage other than markers (facts learnt after the hello, an OOM
    report), queued in order with the markers: ``kind`` is its field of
    ClientMessage, ``fields`` fills it by name, ``counter`` counts it sent."""

    __slots__ = ("kind", "fields", "counter")

    def __init__(self, kind: str, fields: dict[str, Any], counter: str) -> None:
        self.kind = kind
        self.fields = dict(fields)
        self.counter = counter

    def message(self, pb: Any) -> Any:
        msg = pb.ClientMessage()
        m = getattr(msg, self.kind)
        m.SetInParent()
        _FILL[self.kind](m, self.fields)
        return msg


def _fill_oom_report(m: Any, r: dict[str, Any]) -> None:
    for key in (
        "step",
        "requested_bytes",
        "inactive_split_bytes",
        "segment_count",
        "largest_free_block_bytes",
        "message",
    ):
        if r.get(key) is not None:
            setattr(m, key, r[key])
    alloc = r.get("allocator")
    if alloc is not None:
        _fill_allocator(m.allocator, alloc)
    device = r.get("device_memory")
    if device is not None:
        m.device_memory.free_bytes, m.device_memory.total_bytes = device
    for size, allocated, largest_free, small in r.get("largest_segments") or ():
        m.largest_segments.add(
            size_bytes=size,
            allocated_bytes=allocated,
            largest_free_block_bytes=largest_free,
            small_pool=small,
        )


def _fill_allocator(a: Any, alloc: tuple[int, ...]) -> None:
    """AllocatorStats from the 7-tuple of ``_torch.allocator_figures``."""
    (
        a.allocated_bytes,
        a.allocated_peak_bytes,
        a.reserved_bytes,
        a.reserved_peak_bytes,
        a.active_bytes,
        a.active_peak_bytes,
        a.num_alloc_retries,
    ) = alloc


def set_model_facts(m: Any, facts: dict[str, Any]) -> None:
    """Fill a ModelFacts message from facts by field name (None: left unset); a
    dict fills a nested message (its lists the repeated fields)."""
    for key, value in facts.items():
        if value is None:
            continue
        if isinstance(value, dict):
            sub = getattr(m, key)
            sub.SetInParent()
            for k, v in value.items():
                if isinstance(v, (list, tuple)):
                    getattr(sub, k).extend(v)
                elif v is not None:
                    setattr(sub, k, v)
        else:
            setattr(m, key, value)


_FILL: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "model_update": set_model_facts,
    "oom_report": _fill_oom_report,
}


class NewRun:
    """A run boundary in the queue (see :meth:`Client.new_run`)."""

    __slots__ = ("run_id",)

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id


class _StreamState:
    __slots__ = ("closed", "hello_sent", "batches", "trace", "new_run", "held")

    def __init__(self) -> None:
        self.new_run = False  # ended by us for a new run
        self.closed = False
        self.hello_sent = False
        self.batches = 0
        # An allocator trace taken off the queue, to write after the current batch.
        self.trace: Any = None
        # A marker taken off the queue that did not fit the batch (a layout's).
        self.held: Any = None


def _unix_socket_path(target: str) -> Optional[str]:
    """The file of a ``unix:`` target (``unix:///path``, ``unix:path``), else None."""
    if target.startswith("unix://"):
        return target[len("unix://") :] or None
    if target.startswith("unix:"):
        return target[len("unix:") :] or None
    return None


def _refusal_of(e: Any) -> tuple[str, bool]:
    """The reason an agent named in a refused stream's trailing metadata ("" from
    agents before it, or when the stream ended otherwise), and whether the
    refusal is for good (no stream of this run will be accepted again)."""
    try:
        metadata = e.trailing_metadata() or ()
    except Exception:  # not a call's error (e.g. raised before the call began)
        return "", False
    named = {key: value for key, value in metadata}
    reason = named.get(REFUSAL_METADATA, "")
    return (reason if isinstance(reason, str) else ""), named.get(RETRY_METADATA) == "never"


def _tuple_bytes(t: MarkerTuple) -> int:
    """An upper bound on a queued marker's encoded bytes."""
    n = (40 if t[5] is None else 120) + (0 if t[6] is None else 30)
    if t[7] is not None:
        n += 30 + 10 * len(t[7][2])
    return n if len(t) == 8 else n + t[8].nbytes


def _to_pb(pb: Any, t: MarkerTuple) -> Any:
    kind, step, mono, wall, micro, alloc, device, batch = t[:8]
    m = pb.Marker(kind=kind, step=step, monotonic_ns=mono, wall_ns=wall, micro_batch=micro)
    if device is not None:
        m.device_memory.free_bytes, m.device_memory.total_bytes = device
    if batch is not None:
        b = m.batch
        b.SetInParent()
        samples, tokens, shape = batch
        if samples is not None:
            b.samples = samples
        if tokens is not None:
            b.tokens = tokens
        b.shape.extend(shape)
    if len(t) > 8:
        t[8].fill(m)
    if alloc is not None:
        _fill_allocator(m.allocator, alloc)
    return m


# gRPC objects a forked child inherited from its parent's clients: held for the
# child's lifetime so that it never finalizes them (see _after_fork_in_child).
_PARENT_GRPC_OBJECTS: list[tuple[Any, Any]] = []

# In a child forked after stepwatch had used gRPC (in this process or an
# ancestor): the PID of the process it was forked from; every client here
# then stops sending (see _after_fork_in_child).
_forked_from: Optional[int] = None
_forked_told = False


def stopped_before_start() -> Optional[str]:
    """``stats()["stopped"]`` of a client not made yet: "forked" in a child whose
    clients send nothing (see _after_fork_in_child), else None."""
    return STOPPED_FORKED if _forked_from is not None else None


def _tell_forked_once() -> None:
    """The one warning of a forked child whose clients send nothing (at its first
    marker: DataLoader workers, which mark nothing, stay silent)."""
    global _forked_told
    if _forked_told:
        return
    _forked_told = True
    log.warning(
        "stepwatch: this process (pid %d) was forked from pid %s after stepwatch "
        "had used gRPC there; gRPC cannot be used safely in such a child, so "
        "its markers are not sent (training goes on). To report a process of "
        "its own, start it with the 'spawn' or 'forkserver' start method, or "
        "fork before stepwatch marks a step",
        os.getpid(),
        _forked_from,
    )


def _after_fork_in_child() -> None:
    global _forked_from, _forked_told
    if _wire is not None:
        # A child that marks steps itself (DataLoader workers never do) would
        # need a channel of its own on that copy of gRPC: its clients send
        # nothing instead, and say so once, at their first marker.
        _forked_from = os.getppid()
        _forked_told = False
        # gRPC was in use here. A fork while any thread (ours, or a gRPC
        # server's) is inside gRPC skips gRPC's fork handlers, and the child's
        # copy of gRPC is then unusable: when the child's garbage collector
        # frees an inherited gRPC object in a reference cycle (a closed
        # channel, a finished call), gRPC starts threads on that copy and the
        # child hangs or aborts in ev_epoll1 ("next_worker->state == KICKED"),
        # seen in DataLoader workers. Freezing moves every inherited object out
        # of the collector's reach; it is what Python's gc docs advise for
        # fork without exec, and it also spares the child copy-on-write of the
        # parent's pages. Only the child's own objects are collected.
        gc.freeze()
    for c in list(_all_clients):
        try:
            c._after_fork_in_child()
        except Exception:  # pragma: no cover
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
