"""Slurm on a real slurmctld and slurmd (deploy/slurm/test.sh runs this as root).

A one-node cluster (munge, slurmctld, slurmd with proctrack/cgroup) declares two fake
GPUs as GRES; the prolog and epilog of deploy/slurm/ keep the GPU<->job mapping; the
agent runs on fake NVML with --slurm-job-mapping-dir. An sbatch job trains unmodified
PyTorch on fake CUDA with the Python client. The test checks that the job's prediction
series, its rank's identity and the agent's Step-2 alert carry its Slurm job id, that
another user's process claiming that job is refused (outside any job, and from a job of
its own), and that the epilog removes the mapping. Every wait is on a condition.
"""

from __future__ import annotations

import http.server
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "deploy" / "slurm"
BIN = Path(os.environ.get("STEPWATCH_BIN") or REPO / "target" / "debug" / "stepwatch")
FAKE_CUDA = REPO / "crates" / "fake-cuda" / "fake-cuda"
PY = sys.executable
# A second Unix user, created once (a system user without a home or a shell).
OTHER_USER = "stepwatch-slurm-test"
MIB = 1 << 20

# python/tests/test_predicted_oom.py's job and GPU: step 1 reserves 282 MiB on fake CUDA
# (that test asserts it for the venv's torch); a GPU with 24 MiB to spare beyond step 1
# (context 512 MiB, driver reserve 512 MiB) cannot run step 2, and the agent says so
# during step 1. Here the job then waits to be released, so that it is still running
# while another user claims its id.
TIGHT = 512 * MIB + 512 * MIB + 282 * MIB + 24 * MIB
JOB = REPO / "python" / "tests" / "predicted_oom_job.py"


def wait_for(what: str, cond: Callable[[], object], timeout: float = 60) -> object:
    """Polls ``cond`` until it returns something true; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeAlertmanager:
    """Alertmanager's v2 API, as far as the agent's fast path uses it."""

    def __init__(self) -> None:
        self.alerts: list[dict] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/api/v2/alerts":
                    owner.alerts.extend(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


class Cluster:
    """munged, slurmctld, slurmd and the agent, in one temporary directory."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="stepwatch-slurm-", dir="/tmp"))
        self.dir.chmod(0o755)  # the other user reaches the socket and slurm.conf
        self.procs: dict[str, subprocess.Popen] = {}
        self.node = socket.gethostname().split(".")[0]
        self.map = self.dir / "job-map"
        self.nvml = self.dir / "nvml"
        self.socket = self.dir / "agent" / "stepwatch.sock"
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "STEPWATCH_"))
        }
        self.env["SLURM_CONF"] = str(self.dir / "slurm.conf")

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log", "dev"):
            (d / sub).mkdir()
        # gres/gpu needs character devices; /dev/null stands in (the index is the name's).
        for i in (0, 1):
            os.symlink("/dev/null", d / "dev" / f"nvidia{i}")
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(
            ["/usr/sbin/munged", "--force", f"--socket={d}/munge.sock", f"--key-file={key}"]
            + [f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log"]
            + [f"--seed-file={d}/munge.seed"],
            check=True,
            timeout=30,
        )
        wait_for("munged's socket", lambda: (d / "munge.sock").exists(), 10)
        # slurmd passes no environment of its own to the prolog: a wrapper names the directory.
        for kind in ("prolog", "epilog"):
            wrapper = d / f"{kind}.sh"
            wrapper.write_text(
                "#!/bin/sh\n"
                f"STEPWATCH_SLURM_JOB_MAPPING_DIR={self.map} exec {HERE / (kind + '.sh')}\n"
            )
            wrapper.chmod(0o755)
        ctld, slurmd = free_port(), free_port()
        (d / "slurm.conf").write_text(
            f"""ClusterName=stepwatch-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType={os.environ.get("STEPWATCH_SLURM_PROCTRACK", "proctrack/cgroup")}
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PrologFlags=Alloc
Prolog={d}/prolog.sh
Epilog={d}/epilog.sh
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )
        (d / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={d}/dev/nvidia[0-1]\n")
        (d / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
        for f in ("slurm.conf", "gres.conf", "cgroup.conf"):
            (d / f).chmod(0o644)
        for name, argv in (
            ("slurmctld", ["/usr/sbin/slurmctld", "-D", "-c"]),
            ("slurmd", ["/usr/sbin/slurmd", "-D"]),
        ):
            self.procs[name] = subprocess.Popen(
                argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        wait_for(
            "the node to be idle in sinfo (see the logs in " + str(d / "log") + ")",
            lambda: self.slurm("sinfo", "-h", "-o", "%t").strip() == "idle",
            60,
        )
        self.start_agent()

    def start_agent(self) -> None:
        init = [str(BIN), "fake-gpu", "--dir", str(self.nvml), "init", "--gpus", "2"]
        init += ["--total-gib", repr(TIGHT / (1 << 30))]
        subprocess.run(init, check=True, capture_output=True, timeout=60)
        lib = subprocess.run(
            [str(BIN), "fake-gpu", "lib-path"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
        self.alertmanager = FakeAlertmanager()
        ready = self.dir / "ready.json"
        self.agent_log = self.dir / "log" / "agent.log"
        self.procs["agent"] = subprocess.Popen(
            [str(BIN), "agent", "--nvml-lib", lib, "--socket", str(self.socket)]
            + ["--socket-mode", "0666", "--http-listen", "127.0.0.1:0", "--ready-file", str(ready)]
            + ["--slurm-job-mapping-dir", str(self.map), "--node-name", self.node]
            + ["--alertmanager-url", self.alertmanager.url],
            env=dict(self.env, STEPWATCH_FAKE_NVML_DIR=str(self.nvml)),
            stdout=subprocess.DEVNULL,
            stderr=open(self.agent_log, "wb"),
        )
        wait_for(
            "the agent's ready file",
            lambda: ready.exists() or self.procs["agent"].poll() is not None,
            30,
        )
        assert self.procs["agent"].poll() is None, self.agent_log.read_text()
        self.http = json.loads(ready.read_text())["http"]
        wait_for("NVML up in the agent", lambda: b"nvml: up" in self.get("/readyz"), 30)
        (self.dir / "agent").chmod(0o755)

    # ------------------------------------------------------------------ use
    def slurm(self, *argv: str, user: Optional[str] = None) -> str:
        cmd = list(argv) if user is None else ["runuser", "-u", user, "--", *argv]
        p = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=60, cwd="/tmp"
        )
        assert p.returncode == 0, f"{cmd}: {p.stdout}{p.stderr}"
        return p.stdout

    def get(self, path: str) -> bytes:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=5) as r:
                return r.read()
        except OSError:
            return b""

    def metrics(self, name: str) -> list[tuple]:
        """(labels, value) of each series of ``name`` on /metrics."""
        out = []
        for line in self.get("/metrics").decode().splitlines():
            m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
                out.append((labels, float(m.group(2))))
        return out

    def rejected(self, reason: str) -> float:
        return sum(
            v
            for labels, v in self.metrics("stepwatch_markers_rejected_total")
            if labels.get("reason") == reason
        )

    def mapped_jobs(self) -> dict[str, list[str]]:
        if not self.map.is_dir():
            return {}
        return {
            f.name: f.read_text().split() for f in self.map.iterdir() if not f.name.startswith(".")
        }

    # ------------------------------------------------------------------ teardown
    def stop(self) -> None:
        if "slurmctld" in self.procs:
            subprocess.run(
                ["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30
            )
            subprocess.run(
                ["scancel", "-u", OTHER_USER], env=self.env, capture_output=True, timeout=30
            )
        for name in ("agent", "slurmd", "slurmctld"):
            p = self.procs.get(name)
            if p and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        pid_file = self.dir / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (ValueError, ProcessLookupError):
                pass
        if hasattr(self, "alertmanager"):
            self.alertmanager.stop()
        # proctrack/cgroup's empty hierarchy (cgroup v1: freezer/slurm_<node>/uid_*).
        root = Path("/sys/fs/cgroup/freezer") / f"slurm_{self.node}"
        if root.is_dir():
            for sub in [*sorted(root.rglob("*"), key=lambda p: -len(p.parts)), root]:
                if sub.is_dir():
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
        if os.environ.get("STEPWATCH_KEEP_SLURM_DIR") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.fail("the Slurm test runs slurmd, which must be root: run deploy/slurm/test.sh")
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True,
        )
    c = Cluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_a_slurm_job_is_attributed_refused_to_others_and_unmapped_after_its_epilog(cluster):
    c = cluster
    script = c.dir / "train.py"
    script.write_text(JOB.read_text())
    release = c.dir / "release"
    batch = c.dir / "job.sh"
    train = f"{PY} {script} --hold 120 --fail-fast --wait-for {release}"
    batch.write_text(f"#!/bin/sh\nexec {PY} {FAKE_CUDA} run --quiet --python {PY} -- {train}\n")
    job_env = dict(
        c.env,
        STEPWATCH_ENDPOINT=f"unix://{c.socket}",
        STEPWATCH_FAKE_NVML_DIR=str(c.nvml),
    )
    out = c.dir / "job.out"
    submit = subprocess.run(
        ["sbatch", "--parsable", "--gres=gpu:1", "-o", str(out), str(batch)],
        env=job_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job = submit.stdout.strip().split(";")[0]
    assert job.isdigit(), submit.stdout

    def job_out() -> str:
        return out.read_text() if out.exists() else ""

    # The prolog mapped the job to the GPU Slurm gave it.
    mapped = wait_for(
        f"job {job} in the mapping directory",
        lambda: [g for g, js in c.mapped_jobs().items() if job in js],
        30,
    )
    (gpu,) = mapped

    # The agent's step-2 prediction reached the job before step 2.
    wait_for(
        f"the job's predicted OOM (job output: {out})", lambda: "PREDICTED_OOM" in job_out(), 180
    )
    assert "step 2 done" not in job_out(), job_out()

    # Its series carry the Slurm job id, and its identity is verified.
    (info,) = [
        labels
        for labels, _ in c.metrics("stepwatch_rank_info")
        if labels.get("training_job") == job
    ]
    assert info["attested"] == "true", info
    headroom = [
        v
        for labels, v in c.metrics("stepwatch_rank_predicted_headroom_bytes")
        if labels.get("training_job") == job
    ]
    assert headroom and headroom[0] < 0, headroom
    report = json.loads(c.get(f"/api/v1/jobs/{job}/ranks/0"))
    assert report["info"]["attested"], report["info"]
    oom = [a for a in report["advisories"] if a["kind"] == "step2_oom_predicted"]
    assert oom and oom[0]["predicted_headroom_bytes"] < 0, report["advisories"]
    # GPU series name the job holding the GPU, as dcgm-exporter does (hpc_job).
    used = {labels["gpu"]: labels for labels, _ in c.metrics("stepwatch_gpu_memory_used_bytes")}
    assert used[gpu].get("hpc_job") == job, used
    assert all("hpc_job" not in labels for g, labels in used.items() if g != gpu), used
    # So does the alert the agent posted to Alertmanager.
    alerts = wait_for(
        "StepwatchStep2OOMPredicted at the fake Alertmanager",
        lambda: [
            a
            for a in c.alertmanager.alerts
            if a["labels"]["alertname"] == "StepwatchStep2OOMPredicted"
        ],
        30,
    )
    assert alerts[0]["labels"]["training_job"] == job, alerts[0]
    verified = [
        v
        for labels, v in c.metrics("stepwatch_slurm_attestations_total")
        if labels["result"] == "verified"
    ]
    assert verified == [1.0], verified

    # Another user's process, outside any job, claims the running job: refused.
    # (The simulated rank's GPU memory lives in fake-NVML files of its own.)
    other_nvml = c.dir / "other-nvml"
    init = [str(BIN), "fake-gpu", "--dir", str(other_nvml), "init", "--gpus", "2"]
    subprocess.run(init, check=True, capture_output=True, timeout=60)
    shutil.chown(other_nvml, OTHER_USER)
    for f in other_nvml.rglob("*"):
        shutil.chown(f, OTHER_USER)
    other = [str(BIN), "sim", "--scenario", "rank0-skew", "--rank", "1", "--job", job]
    other += ["--fake-nvml-dir", str(other_nvml)]
    other += ["--steps", "2", "--speed", "20", "--endpoint", f"unix://{c.socket}"]
    before = c.rejected("slurm_job_not_yours")
    outsider = subprocess.run(
        ["runuser", "-u", OTHER_USER, "--", *other],
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=60,
    )
    wait_for(
        f"the outsider's refusal ({outsider})",
        lambda: c.rejected("slurm_job_not_yours") >= before + 1,
        10,
    )
    # The same user in a job of its own, claiming the first job's id: refused (its cgroup says
    # which job it is in).
    subprocess.run(
        ["runuser", "-u", OTHER_USER, "--", "srun", "-n1", *other],
        env=c.env,
        cwd="/tmp",
        capture_output=True,
        timeout=60,
    )
    wait_for("the other job's refusal", lambda: c.rejected("slurm_job_not_yours") >= before + 2, 10)
    ranks = [
        labels
        for labels, _ in c.metrics("stepwatch_rank_info")
        if labels.get("training_job") == job
    ]
    assert [r["rank"] for r in ranks] == ["0"], ranks
    log = c.agent_log.read_text()
    assert (
        f"the hello names Slurm job {job}, which runs on this node, but the process is in no" in log
    )
    assert re.search(rf"the hello names Slurm job {job}, but the process runs in job \d+", log), log

    # Prometheus finds the agents from sinfo: file-sd.sh names the node with GPUs.
    sd = json.loads(c.slurm(str(HERE / "file-sd.sh"), "--cluster", "test"))
    assert sd == [{"targets": [f"{c.node}:19447"], "labels": {"cluster": "test"}}], sd
    if shutil.which("promtool"):
        sd_file = c.dir / "stepwatch.json"
        sd_file.write_text(json.dumps(sd))
        config = (HERE / "prometheus-file-sd.yml").read_text()
        config = config.replace("/etc/prometheus/file_sd/stepwatch.json", str(sd_file))
        (c.dir / "prometheus.yml").write_text(config)
        shutil.copy(REPO / "deploy" / "prometheus" / "stepwatch-rules.yml", c.dir)
        c.slurm("promtool", "check", "config", str(c.dir / "prometheus.yml"))

    # The job ends; its epilog removes the mapping, and the GPU's series lose the label.
    release.touch()
    wait_for(
        f"job {job} to leave the queue",
        lambda: job not in c.slurm("squeue", "-h", "-o", "%i").split(),
        60,
    )
    wait_for(
        "the mapping to be gone", lambda: not any(job in js for js in c.mapped_jobs().values()), 30
    )
    assert "released" in job_out(), job_out()
    used = {labels["gpu"]: labels for labels, _ in c.metrics("stepwatch_gpu_memory_used_bytes")}
    assert "hpc_job" not in used[gpu], used
