"""The Python client over TLS to the real agent's TCP ingest (``--grpc-listen``).

Certificates are made with the openssl CLI, as in the Rust ``tests/tls_ingest.rs``.
The agent binary is found as in ``test_agent_integration.py`` (same fail/skip rules).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import FLUSH_S

import stepwatch
from stepwatch._tls import load_tls, resolve_tls

# --------------------------------------------------------------- unit: settings


def test_plaintext_endpoints_stay_plaintext():
    env = {"STEPWATCH_TLS_CA": "/ca.pem"}
    assert resolve_tls("unix:///tmp/s.sock", env=env) is None
    assert resolve_tls("/tmp/s.sock", env=env) is None
    assert resolve_tls("http://127.0.0.1:7070", env=env) is None
    assert resolve_tls("127.0.0.1:7070", env={}) is None
    assert resolve_tls(env={}) is None  # the default unix socket


def test_tls_endpoints():
    s = resolve_tls("https://127.0.0.1:7070", env={})
    assert s is not None and s.ca is None  # system roots
    s = resolve_tls("127.0.0.1:7070", env={"STEPWATCH_TLS_CA": "/ca.pem"})
    assert s is not None and s.ca == "/ca.pem" and s.ca_from == "STEPWATCH_TLS_CA"
    s = resolve_tls(
        "https://h:1",
        tls_ca="/a.pem",
        env={
            "STEPWATCH_TLS_CA": "/b.pem",
            "STEPWATCH_TLS_CERT": "/c.pem",
            "STEPWATCH_TLS_KEY": "/k.pem",
        },
    )
    assert s is not None and (s.ca, s.cert, s.key) == ("/a.pem", "/c.pem", "/k.pem")
    assert s.ca_from == "tls_ca="
    assert stepwatch._identity.endpoint_target("https://h:1", env={}) == "h:1"


def test_unreadable_files_are_reported_not_raised(tmp_path):
    m = load_tls(resolve_tls("https://h:1", tls_ca=str(tmp_path / "nope.pem"), env={}))
    assert m.error and "cannot read the TLS CA file" in m.error and "nope.pem" in m.error
    not_pem = tmp_path / "x.pem"
    not_pem.write_text("hello")
    m = load_tls(resolve_tls("https://h:1", tls_ca=str(not_pem), env={}))
    assert m.error and "no PEM block" in m.error
    m = load_tls(resolve_tls("https://h:1", tls_cert="/c.pem", env={}))
    assert m.error and "without its key" in m.error


def test_unix_endpoint_ignores_tls_variables(agent, monkeypatch):
    # `agent` is the in-process fake agent on a Unix socket (conftest.py).
    monkeypatch.setenv("STEPWATCH_TLS_CA", "/nonexistent/ca.pem")
    monkeypatch.setenv("STEPWATCH_TLS_CERT", "/nonexistent/client.pem")
    monkeypatch.setenv("STEPWATCH_TLS_KEY", "/nonexistent/client.key")
    stepwatch.configure(job_id="unix-tls-vars")
    with stepwatch.step(1):
        pass
    agent.wait_markers(2)
    assert stepwatch.stats()["tls"] is False


# ------------------------------------------------------- against the real agent


# Shared with the Rust TLS tests (tests/tls_ingest.rs).
_MAKE_CERTS = Path(__file__).resolve().parents[2] / "tests" / "make-test-certs.sh"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """ca.pem/ca.key, server.pem/.key (127.0.0.1, localhost), client.pem/.key."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI makes the test certificates (scripts/test installs it)")
    d = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(_MAKE_CERTS), str(d)], check=True, capture_output=True)
    return d


class _TlsAgent:
    def __init__(self, agent) -> None:
        self.agent = agent

    @property
    def https(self) -> str:
        return f"https://{self.agent.grpc}"

    @property
    def host_port(self) -> str:
        return self.agent.grpc


def _start_tls_agent(sock_dir: str, tmp_path: Path, args: list[str]):
    from conftest import agent_binary
    from test_agent_integration import _Agent

    binary = agent_binary()
    agent = _Agent(binary, sock_dir, tmp_path, ["--grpc-listen", "127.0.0.1:0", *args])
    agent.start()  # returns once the ready file names the bound TCP ingest address
    assert agent.grpc, agent.log.read_text()
    return _TlsAgent(agent)


def _wait_refused_twice(timeout: float = 30.0) -> None:
    """Waits until the client tried the agent at least twice and failed each
    time: a refusal, not a client that never called."""
    deadline = time.monotonic() + timeout
    while True:
        st = stepwatch.stats()
        if st["connect_failures"] + st["stream_errors"] >= 2:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the client did not try twice in {timeout} s: {st}")
        time.sleep(0.05)


def _tls_agent(certs: Path, sock_dir: str, tmp_path: Path, extra: list[str]):
    """The agent with the server certificate and ``extra`` flags; stopped after the test."""
    tls = [
        "--grpc-tls-cert",
        str(certs / "server.pem"),
        "--grpc-tls-key",
        str(certs / "server.key"),
    ]
    a = _start_tls_agent(sock_dir, tmp_path, tls + extra)
    yield a
    stepwatch.reset()
    a.agent.stop()


@pytest.fixture
def tls_agent(certs, sock_dir, tmp_path):
    yield from _tls_agent(certs, sock_dir, tmp_path, [])


@pytest.fixture
def mtls_agent(certs, sock_dir, tmp_path):
    yield from _tls_agent(
        certs, sock_dir, tmp_path, ["--grpc-tls-client-ca", str(certs / "ca.pem")]
    )


def _train(steps: int, **watch_opts) -> float:
    """``steps`` optimizer steps of a tiny real model under ``stepwatch.watch``; seconds taken."""
    from test_agent_integration import _train as train

    t0 = time.monotonic()
    train(steps, 1, **watch_opts)
    return time.monotonic() - t0


def _job() -> str:
    return f"pytest-tls-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("form", ["https-endpoint+tls_ca", "host:port+STEPWATCH_TLS_CA"])
def test_tls_steps_arrive(tls_agent, certs, monkeypatch, form):
    job = _job()
    if form.startswith("https"):
        _train(2, job_id=job, endpoint=tls_agent.https, tls_ca=certs / "ca.pem")
    else:
        monkeypatch.setenv("STEPWATCH_ENDPOINT", tls_agent.host_port)
        monkeypatch.setenv("STEPWATCH_TLS_CA", str(certs / "ca.pem"))
        _train(2, job_id=job)
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = tls_agent.agent.rank_report(job, 0, 2)
    assert report["steps_completed"] == 2
    st = stepwatch.stats()
    assert st["tls"] is True and st["endpoint"] == tls_agent.host_port
    assert st["dropped"] == 0 and st["rejections"] == 0, st


def test_plaintext_client_gets_nothing_into_a_tls_agent(tls_agent, monkeypatch):
    job = _job()
    monkeypatch.setenv("STEPWATCH_ENDPOINT", tls_agent.host_port)  # no CA: plaintext
    assert _train(2, job_id=job) < 30
    _wait_refused_twice()
    assert stepwatch.stats()["tls"] is False
    assert stepwatch.stats()["sent"] == 0
    assert tls_agent.agent.get(f"/api/v1/jobs/{job}/ranks/0") is None


def test_mutual_tls_with_client_certificate(mtls_agent, certs, monkeypatch):
    job = _job()
    monkeypatch.setenv("STEPWATCH_ENDPOINT", mtls_agent.https)
    monkeypatch.setenv("STEPWATCH_TLS_CA", str(certs / "ca.pem"))
    monkeypatch.setenv("STEPWATCH_TLS_CERT", str(certs / "client.pem"))
    monkeypatch.setenv("STEPWATCH_TLS_KEY", str(certs / "client.key"))
    _train(2, job_id=job)
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = mtls_agent.agent.rank_report(job, 0, 2)
    assert report["steps_completed"] == 2
    assert stepwatch.stats()["rejections"] == 0


def test_mutual_tls_without_client_certificate_gets_nothing(mtls_agent, certs):
    job = _job()
    elapsed = _train(2, job_id=job, endpoint=mtls_agent.https, tls_ca=certs / "ca.pem")
    assert elapsed < 30
    _wait_refused_twice()
    assert mtls_agent.agent.get(f"/api/v1/jobs/{job}/ranks/0") is None
    st = stepwatch.stats()
    assert st["tls"] is True and st["enqueued"] >= 6, st
    # And a client that does present one still gets in afterwards.
    stepwatch.reset()
    job2 = _job()
    _train(
        2,
        job_id=job2,
        endpoint=mtls_agent.https,
        tls_ca=certs / "ca.pem",
        tls_cert=certs / "client.pem",
        tls_key=certs / "client.key",
    )
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    assert mtls_agent.agent.rank_report(job2, 0, 2)["steps_completed"] == 2


def test_missing_ca_file_is_logged_and_training_completes(tls_agent, tmp_path, caplog):
    job = _job()
    missing = tmp_path / "no-such-ca.pem"
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        elapsed = _train(2, job_id=job, endpoint=tls_agent.https, tls_ca=missing)
        assert not stepwatch.flush(1)
        stepwatch.shutdown(1)
    assert elapsed < 30
    lines = [r.getMessage() for r in caplog.records if r.name == "stepwatch"]
    assert any(
        "cannot read the TLS CA file" in m and str(missing) in m and "tls_ca=" in m for m in lines
    ), lines
    assert tls_agent.agent.get(f"/api/v1/jobs/{job}/ranks/0") is None


def test_missing_ca_file_env_is_logged(tls_agent, tmp_path, monkeypatch, caplog):
    missing = tmp_path / "absent" / "ca.pem"
    monkeypatch.setenv("STEPWATCH_ENDPOINT", tls_agent.host_port)
    monkeypatch.setenv("STEPWATCH_TLS_CA", str(missing))
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        assert _train(2, job_id=_job()) < 30
        assert not stepwatch.flush(1)  # returns at once: the sender gave up
    st = stepwatch.stats()
    assert st["sent"] == 0 and st["connected"] is False and st["connect_failures"] == 1, st
    assert any(
        "STEPWATCH_TLS_CA" in r.getMessage() and str(missing) in r.getMessage()
        for r in caplog.records
    )


def test_missing_ca_file_raises_only_when_strict(tls_agent, tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(stepwatch.StepwatchError, match="cannot read the TLS CA file"):
        stepwatch.watch(
            model, opt, endpoint=tls_agent.https, tls_ca=tmp_path / "nope.pem", strict=True
        )
