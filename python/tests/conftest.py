"""Shared fixtures: an in-process fake agent (a real gRPC server built from the stubs)."""

from __future__ import annotations

import os
import queue
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Optional

import grpc
import pytest

import stepwatch
from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb
from stepwatch._proto.stepwatch.v1 import ingest_pb2_grpc as pb_grpc

KIND = {v: k for k, v in pb.MarkerKind.items()}
#: How long a test waits for the client to deliver what it queued. flush()
#: returns as soon as the queue is empty, so an idle machine never waits this
#: long; a busy one may need seconds for a connect or a TLS handshake.
FLUSH_S = 60.0

REPO = Path(__file__).resolve().parents[2]
# The real agent on fake GPUs (fake_gpu_agent), shared with the fake CUDA tests.
sys.path.insert(0, str(REPO / "crates" / "fake-cuda" / "tests"))

# One optimizer step's markers, in order.
STEP = [
    "STEP_BEGIN",
    "FORWARD_BEGIN",
    "BACKWARD_BEGIN",
    "OPTIMIZER_BEGIN",
    "OPTIMIZER_END",
    "STEP_END",
]


def wait_until(pred: Callable[[], Any], timeout: float = 5.0) -> bool:
    """Polls ``pred`` every 10 ms until it is true or ``timeout`` seconds have passed;
    whether it came true (the test's own assertions say what it needed)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def mark_steps(n: int, start: int = 1) -> None:
    """Marks steps start..start+n-1 with stepwatch's module API, each with its
    forward, backward and optimizer phases (no work inside)."""
    for i in range(start, start + n):
        with stepwatch.step(i):
            with stepwatch.phase("forward"):
                pass
            with stepwatch.phase("backward"):
                pass
            with stepwatch.phase("optimizer"):
                pass


def expected(steps: int, micro: int = 1) -> list[tuple]:
    """summary() of ``steps`` steps of ``micro`` forward/backward pairs each."""
    out: list[tuple] = []
    for s in range(1, steps + 1):
        out.append(("STEP_BEGIN", s, 0))
        for m in range(micro):
            out += [("FORWARD_BEGIN", s, m), ("BACKWARD_BEGIN", s, m)]
        out += [
            ("OPTIMIZER_BEGIN", s, micro - 1),
            ("OPTIMIZER_END", s, micro - 1),
            ("STEP_END", s, micro - 1),
        ]
    return out


def small_model() -> Any:
    """MLP 8-16-1, seeded."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def tiny_lightning_module():
    """A LightningModule class: one linear layer on (x, y) batches, AdamW."""
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def validation_step(self, batch, batch_idx):
            self.log("val", self.training_step(batch, batch_idx))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Tiny


def fit_tiny_lightning(root: Path, callback: Any, **trainer_args: Any) -> None:
    """``lightning.Trainer(**trainer_args).fit`` of ``tiny_lightning_module()`` on 24
    random samples in batches of 4, on the CPU, with ``callback``; the logger,
    checkpoints, progress bar and model summary off."""
    import lightning as L  # noqa: N812 (the usual spelling)
    import torch

    ds = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    trainer = L.Trainer(
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=root,
        **trainer_args,
    )
    trainer.fit(tiny_lightning_module()(), torch.utils.data.DataLoader(ds, batch_size=4))


def train(
    model: Any,
    opt: Any,
    steps: int,
    accumulate: int = 1,
    batch: int = 4,
    on_step_end: Optional[Callable[[], None]] = None,
) -> None:
    """``steps`` optimizer steps of ``model`` (a Sequential whose first layer is a Linear) on
    random regression batches: ``accumulate`` micro-batches of ``batch`` rows each, MSE loss
    divided by ``accumulate``; ``opt.zero_grad()`` after each step, then ``on_step_end``."""
    import torch

    inputs = model[0].in_features
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = torch.randn(batch, inputs), torch.randn(batch, 1)
            (torch.nn.functional.mse_loss(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
        if on_step_end is not None:
            on_step_end()


def agent_binary() -> Path:
    """The real agent (``$STEPWATCH_BIN`` or ``target/debug/stepwatch``); skips the
    test when STEPWATCH_SKIP_AGENT_TESTS=1, fails it when the binary is missing."""
    if os.environ.get("STEPWATCH_SKIP_AGENT_TESTS") == "1":
        pytest.skip("STEPWATCH_SKIP_AGENT_TESTS=1")
    binary = Path(os.environ.get("STEPWATCH_BIN") or REPO / "target" / "debug" / "stepwatch")
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        pytest.fail(
            f"stepwatch agent binary not found at {binary}: build it with "
            "`cargo build -p stepwatch` (or set STEPWATCH_BIN), or set "
            "STEPWATCH_SKIP_AGENT_TESTS=1 to skip the agent integration tests"
        )
    return binary


class RecordedStream:
    def __init__(self) -> None:
        self.hello: Optional[pb.Hello] = None
        self.messages: list[pb.ClientMessage] = []
        self.markers: list[pb.Marker] = []
        # Allocator-trace chunks, as received.
        self.traces: list[pb.AllocatorTraceChunk] = []
        # ModelFacts updates, as received.
        self.model_updates: list[pb.ModelFacts] = []
        # OOM reports, as received.
        self.oom_reports: list[pb.OomReport] = []
        # The stream's content in order: ("marker", kind, step) / ("trace", last) /
        # ("model_update",) / ("oom_report", step).
        self.order: list[tuple] = []
        self.sizes: list[int] = []
        self.ended = False  # the client half-closed
        self.outbox: queue.Queue[Optional[pb.AgentMessage]] = queue.Queue()


class FakeAgent(pb_grpc.IngestServicer):
    """Records every stream; can reject streams and push advisories."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.endpoint = "unix://" + path
        self.streams: list[RecordedStream] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        # (code, details) to abort the next N streams with, after their Hello.
        self.reject: list[Any] = []
        self.on_marker: Optional[Callable[[RecordedStream, pb.Marker], None]] = None
        self.server: Any = None

    # grpc servicer
    def Stream(self, request_iterator, context):  # noqa: N802 (grpc naming)
        rec = RecordedStream()
        with self.lock:
            self.streams.append(rec)
            reject = self.reject.pop(0) if self.reject else None
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be a Hello")
        with self.lock:
            rec.hello = first.hello
            rec.messages.append(first)
            self.changed.notify_all()
        if reject is not None:
            context.abort(reject[0], reject[1])

        def reader() -> None:
            try:
                for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "allocator_trace":
                        with self.lock:
                            rec.sizes.append(msg.ByteSize())
                            rec.traces.append(msg.allocator_trace)
                            rec.order.append(("trace", msg.allocator_trace.last))
                            self.changed.notify_all()
                        continue
                    if kind == "model_update":
                        with self.lock:
                            rec.model_updates.append(msg.model_update)
                            rec.order.append(("model_update",))
                            self.changed.notify_all()
                        continue
                    if kind == "oom_report":
                        with self.lock:
                            rec.oom_reports.append(msg.oom_report)
                            rec.order.append(("oom_report", msg.oom_report.step))
                            self.changed.notify_all()
                        continue
                    if kind != "markers":
                        continue
                    with self.lock:
                        rec.messages.append(msg)
                        rec.sizes.append(msg.ByteSize())
                        rec.markers.extend(msg.markers.markers)
                        rec.order.extend(("marker", m.kind, m.step) for m in msg.markers.markers)
                        self.changed.notify_all()
                    cb = self.on_marker
                    if cb is not None:
                        for m in msg.markers.markers:
                            cb(rec, m)
            except Exception:
                pass
            finally:
                with self.lock:
                    rec.ended = True
                    self.changed.notify_all()
                rec.outbox.put(None)

        threading.Thread(target=reader, daemon=True).start()
        while True:
            item = rec.outbox.get()
            if item is None:
                return
            yield item

    # helpers
    def start(self) -> FakeAgent:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_IngestServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix:" + self.path)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            for s in list(self.streams):
                s.outbox.put(None)
            self.server.stop(grace=0).wait(5)
            self.server = None
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def all_markers(self) -> list[pb.Marker]:
        with self.lock:
            return [m for s in self.streams for m in s.markers]

    # Waits end as soon as the condition holds; the bound only matters on a
    # busy machine, where a reconnect after backoff can take many seconds.
    def wait_for(self, pred: Callable[[], bool], timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 0.05))
        return True

    def wait_markers(self, n: int, timeout: float = 60.0) -> list[pb.Marker]:
        ok = self.wait_for(lambda: sum(len(s.markers) for s in self.streams) >= n, timeout)
        got = self.all_markers()
        assert ok, f"expected {n} markers, got {len(got)}: {summary(got)}"
        return got

    def advise(self, **fields: Any) -> None:
        msg = pb.AgentMessage(advisory=pb.Advisory(**fields))
        with self.lock:
            streams = [s for s in self.streams if not s.ended]
        for s in streams:
            s.outbox.put(msg)


def summary(markers: list[pb.Marker]) -> list[tuple]:
    """Markers as (KIND, step, micro_batch) for readable asserts."""
    return [(KIND[m.kind], m.step, m.micro_batch) for m in markers]


@pytest.fixture
def sock_dir():
    # Unix socket paths are limited to ~100 bytes: keep them short.
    with tempfile.TemporaryDirectory(prefix="sw-") as d:
        yield d


@pytest.fixture
def agent(sock_dir, monkeypatch):
    a = FakeAgent(os.path.join(sock_dir, "agent.sock")).start()
    monkeypatch.setenv("STEPWATCH_ENDPOINT", a.endpoint)
    yield a
    stepwatch.reset()
    a.stop()


@pytest.fixture(autouse=True)
def clean_stepwatch(monkeypatch):
    """Fresh client state per test; fast reconnects; no launcher variables leaking in."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_", "STEPWATCH_")) or name in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            if name != "STEPWATCH_SKIP_AGENT_TESTS" and name != "STEPWATCH_BIN":
                monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STEPWATCH_BACKOFF_MAX", "0.3")
    monkeypatch.setenv("STEPWATCH_CONNECT_TIMEOUT", "0.5")
    stepwatch.reset()
    yield
    stepwatch.reset()


@pytest.fixture
def gloo_group():
    """A one-rank gloo process group (DDP on CPU), torn down after the test."""
    import torch

    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch without distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()
