"""Who this process is: rank, job, node, pod — from the launcher's environment."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

DEFAULT_ENDPOINT = "unix:///run/stepwatch/stepwatch.sock"
_K8S_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_BAD_CHARS = re.compile(r"[^A-Za-z0-9._:/@+\-]")
MAX_ID_LEN = 128
# Pod and node names: Kubernetes allows a DNS subdomain (253 bytes), and the agent takes the
# kubelet's pod name whole, so a truncated claim would only differ from it.
MAX_K8S_NAME_LEN = 253


def sanitize_id(value: str, max_len: int = MAX_ID_LEN) -> str:
    """Fit a string to the agent's identifier rules: 1..=max_len (128; 253 for pod and node
    names) of [A-Za-z0-9._:/@+-]."""
    return _BAD_CHARS.sub("_", value)[:max_len]


@dataclass
class Identity:
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    node_name: str
    pod: str = ""
    namespace: str = ""
    source: str = "default"  # which launcher the figures came from, for logs


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            return int(raw.strip())
        except ValueError:
            continue
    return None


def _start_ticks(pid: int, proc_root: str) -> Optional[int]:
    """A process's start time (clock ticks since boot, /proc/<pid>/stat field 22):
    with the pid, it names one process of this boot, even once the pid is reused."""
    try:
        with open(f"{proc_root}/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields
    # after it start past the last ")".
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _launcher_run_id(hostname: str, ppid: int, proc_root: str) -> str:
    """An id all local ranks of one torchrun share, and no other run does: the
    launcher (the ranks' parent) by host, pid and start time. The host is the
    pod name in Kubernetes, so pods with the same MASTER_ADDR:MASTER_PORT
    (127.0.0.1:29500 in each) stay apart, and a new run has a new launcher."""
    ticks = _start_ticks(ppid, proc_root)
    return f"{hostname}-{ppid}" + (f"-{ticks}" if ticks is not None else "")


def resolve_identity(
    env: Optional[Mapping[str, str]] = None,
    *,
    job_id: Optional[str] = None,
    rank: Optional[int] = None,
    local_rank: Optional[int] = None,
    world_size: Optional[int] = None,
    node_name: Optional[str] = None,
    pod: Optional[str] = None,
    namespace: Optional[str] = None,
    hostname: Optional[str] = None,
    pid: Optional[int] = None,
    ppid: Optional[int] = None,
    proc_root: str = "/proc",
) -> Identity:
    """Work out the rank's identity.

    Precedence: explicit arguments, then STEPWATCH_* variables, then torchrun /
    torch elastic (RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID), then Slurm
    (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_ID), then a single-rank
    default whose job id is "<host>-<pid>".

    torchrun without a rendezvous id (TORCHELASTIC_RUN_ID "none") gives no id
    unique to the run. When every rank runs on this node (WORLD_SIZE at most
    LOCAL_WORLD_SIZE) the job id names the launcher: "torchrun-<host>-<launcher
    pid>-<its start time>", so two unrelated runs on one node never share one.
    A run across nodes keeps "torchrun-<MASTER_ADDR>-<MASTER_PORT>", which all
    its nodes share (set STEPWATCH_JOB_ID or --rdzv-id to choose it).
    """
    env = os.environ if env is None else env
    hostname = hostname or socket.gethostname() or "localhost"
    pid = os.getpid() if pid is None else pid

    source = "default"
    if env.get("RANK") is not None or env.get("TORCHELASTIC_RUN_ID") is not None:
        source = "torchrun"
        env_rank = _int(env, "STEPWATCH_RANK", "RANK")
        env_local = _int(env, "STEPWATCH_LOCAL_RANK", "LOCAL_RANK")
        env_world = _int(env, "STEPWATCH_WORLD_SIZE", "WORLD_SIZE")
    elif env.get("SLURM_PROCID") is not None:
        source = "slurm"
        env_rank = _int(env, "STEPWATCH_RANK", "SLURM_PROCID")
        env_local = _int(env, "STEPWATCH_LOCAL_RANK", "SLURM_LOCALID")
        env_world = _int(env, "STEPWATCH_WORLD_SIZE", "SLURM_NTASKS", "SLURM_NPROCS")
    else:
        env_rank = _int(env, "STEPWATCH_RANK")
        env_local = _int(env, "STEPWATCH_LOCAL_RANK")
        env_world = _int(env, "STEPWATCH_WORLD_SIZE")

    r = rank if rank is not None else (env_rank if env_rank is not None else 0)
    lr = local_rank if local_rank is not None else (env_local if env_local is not None else 0)
    ws = world_size if world_size is not None else (env_world if env_world is not None else 1)
    r, lr, ws = max(0, int(r)), max(0, int(lr)), max(1, int(ws))
    # The agent rejects rank >= world_size; an inconsistent environment must not
    # cost the whole stream, so widen the world rather than lie about the rank.
    ws = max(ws, r + 1, lr + 1)

    job = job_id or env.get("STEPWATCH_JOB_ID")
    if not job:
        run_id = env.get("TORCHELASTIC_RUN_ID")
        if run_id and run_id != "none":
            job = run_id
    if not job and env.get("SLURM_JOB_ID"):
        job = env["SLURM_JOB_ID"]
        if env.get("SLURM_STEP_ID"):
            job = f"{job}.{env['SLURM_STEP_ID']}"
    local_world = _int(env, "LOCAL_WORLD_SIZE")
    if not job and source == "torchrun" and local_world is not None and ws <= local_world:
        # Single-node torchrun without a rendezvous id: the master address
        # (127.0.0.1:29500 in every pod) is shared by strangers; the launcher is not.
        parent = os.getppid() if ppid is None else ppid
        job = f"torchrun-{_launcher_run_id(hostname, parent, proc_root)}"
    if not job and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        # torchrun across nodes without a rendezvous id: ranks share the master address.
        job = f"torchrun-{env['MASTER_ADDR']}-{env['MASTER_PORT']}"
    if not job and env.get("JOB_NAME"):
        job = env["JOB_NAME"]
    if not job:
        job = f"{hostname}-{pid}"

    in_k8s = bool(env.get("KUBERNETES_SERVICE_HOST"))
    pod_name = (
        pod
        if pod is not None
        else env.get("POD_NAME") or (env.get("HOSTNAME", "") if in_k8s else "")
    )
    ns = namespace if namespace is not None else env.get("POD_NAMESPACE", "")
    if not ns and in_k8s:
        try:
            with open(_K8S_NAMESPACE_FILE) as f:
                ns = f.read().strip()
        except OSError:
            ns = ""
    node = node_name or env.get("STEPWATCH_NODE_NAME") or env.get("NODE_NAME") or hostname

    return Identity(
        job_id=sanitize_id(job) or "job",
        rank=r,
        local_rank=lr,
        world_size=ws,
        node_name=sanitize_id(node, MAX_K8S_NAME_LEN) or "localhost",
        pod=sanitize_id(pod_name, MAX_K8S_NAME_LEN) if pod_name else "",
        namespace=sanitize_id(ns) if ns else "",
        source=source,
    )


def endpoint_target(endpoint: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> str:
    """Turn STEPWATCH_ENDPOINT (``unix:///path``, ``host:port``, ``https://host:port``)
    into a gRPC target (whether to use TLS is decided by ``_tls.resolve_tls``)."""
    env = os.environ if env is None else env
    ep = (endpoint or env.get("STEPWATCH_ENDPOINT") or DEFAULT_ENDPOINT).strip()
    for prefix in ("tcp://", "http://", "https://", "grpc://"):
        if ep.startswith(prefix):
            return ep[len(prefix) :]
    if ep.startswith("/"):
        return "unix://" + ep
    return ep
