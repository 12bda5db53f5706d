"""The real agent on a fake GPU (fake NVML), and training scripts run under
fake CUDA on that GPU, reporting to it: what the tests of stepwatch on real
PyTorch share (crates/fake-cuda/tests, and python/tests, which imports it
from here). Needs `target/debug/stepwatch` (or $STEPWATCH_BIN).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

HERE = Path(__file__).resolve().parent
FAKE_CUDA = HERE.parent / "fake-cuda"
REPO = HERE.parents[2]
MIB = 1 << 20
GIB = 1 << 30
DRIVER_RESERVED = 512 * MIB  # fake-nvml's default driver-reserved memory


def agent_binary() -> Path:
    b = Path(os.environ.get("STEPWATCH_BIN") or REPO / "target" / "debug" / "stepwatch")
    if not (b.is_file() and os.access(b, os.X_OK)):
        pytest.fail(f"no stepwatch binary at {b}: cargo build -p stepwatch (or set STEPWATCH_BIN)")
    return b


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 30) -> Any:
    """``fn()`` once it is true, polled; fails the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            assert v, f"timed out waiting for {what}"
            return v
        time.sleep(0.1)


class FakeGpuAgent:
    """``stepwatch agent`` on one fresh fake GPU of ``total_bytes`` (NVML's
    total: CUDA sees it less the driver's reserve, DRIVER_RESERVED), or on
    ``mig_slices`` MIG slices of it; ``agent_args`` are added to its flags."""

    def __init__(
        self,
        tmp: Path,
        total_bytes: int,
        *,
        mig_slices: int = 0,
        agent_args: Sequence[str] = (),
    ) -> None:
        self.binary = agent_binary()
        self.nvml = tmp / "nvml"
        self.log = tmp / "agent.log"
        # Unix socket paths are limited to ~100 bytes: not under tmp_path.
        self.sock_dir = tempfile.mkdtemp(prefix="sw-")
        self.socket = os.path.join(self.sock_dir, "a.sock")
        init = subprocess.run(
            [str(self.binary), "fake-gpu", "--dir", str(self.nvml), "init", "--gpus", "1"]
            + ["--total-bytes", str(total_bytes)]
            + (["--mig-slices", str(mig_slices)] if mig_slices else []),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert init.returncode == 0, init.stderr
        lib = subprocess.run(
            [str(self.binary), "fake-gpu", "lib-path"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
        ready = tmp / "ready.json"
        env = dict(os.environ, STEPWATCH_FAKE_NVML_DIR=str(self.nvml), RUST_LOG="info")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(self.binary), "agent", "--nvml-lib", lib, "--socket", self.socket]
                + ["--http-listen", "127.0.0.1:0", "--ready-file", str(ready)]
                + list(agent_args),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        self.http = json.loads(ready.read_text())["http"]
        while b"nvml: up" not in self.get("/readyz"):
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{self.http}{path}", timeout=10) as r:
            return bytes(r.read())

    def rank_report(self, job: str, steps: Optional[int] = None) -> dict[str, Any]:
        query = f"?steps={steps}" if steps is not None else ""
        return dict(json.loads(self.get(f"/api/v1/jobs/{job}/ranks/0{query}")))

    def run(
        self,
        argv: list[str],
        job: str,
        *,
        usage_log: Optional[Path] = None,
        cwd: Optional[Path] = None,
        device: str = "",
        env: Optional[dict[str, str]] = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess:
        """``python *argv`` under fake CUDA on this GPU, reporting to the agent
        as ``job``; fake CUDA's usage log in ``usage_log`` when given, on
        ``device`` (CUDA_VISIBLE_DEVICES) when given. The caller's STEPWATCH_
        settings and allocator configuration are not passed on (only the
        binary and fake CUDA's cache), ``env`` is added."""
        clean = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("STEPWATCH_") or k in ("STEPWATCH_BIN", "STEPWATCH_FAKE_CUDA_CACHE")
        }
        clean.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        clean.update(
            STEPWATCH_ENDPOINT=f"unix://{self.socket}",
            STEPWATCH_JOB_ID=job,
            STEPWATCH_FAKE_NVML_DIR=str(self.nvml),
        )
        if device:
            clean["CUDA_VISIBLE_DEVICES"] = device
        clean.update(env or {})
        usage = ["--usage-log", str(usage_log)] if usage_log is not None else []
        return subprocess.run(
            [sys.executable, str(FAKE_CUDA), "run", "--quiet", "--python", sys.executable]
            + usage
            + ["--", sys.executable, *argv],
            capture_output=True,
            text=True,
            env=clean,
            cwd=str(cwd) if cwd is not None else None,
            timeout=timeout,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


@contextlib.contextmanager
def fake_gpu_agent(tmp: Path, total_bytes: int, **kwargs: Any) -> Iterator[FakeGpuAgent]:
    """A :class:`FakeGpuAgent`, stopped at the end of the block."""
    a = FakeGpuAgent(tmp, total_bytes, **kwargs)
    try:
        yield a
    finally:
        a.stop()
