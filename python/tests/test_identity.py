from stepwatch._identity import DEFAULT_ENDPOINT, endpoint_target, resolve_identity, sanitize_id


def ident(env, **kw):
    return resolve_identity(env, hostname="node-a", pid=42, **kw)


def test_default_is_single_rank_job_named_after_host_and_pid():
    i = ident({})
    assert (i.job_id, i.rank, i.local_rank, i.world_size, i.node_name) == (
        "node-a-42",
        0,
        0,
        1,
        "node-a",
    )
    assert (i.pod, i.namespace) == ("", "")


def test_torchrun():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "run-7"}
    i = ident(env)
    assert (i.job_id, i.rank, i.local_rank, i.world_size, i.source) == (
        "run-7",
        3,
        1,
        8,
        "torchrun",
    )


def test_torchrun_without_rendezvous_id_uses_master_address():
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "none",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert ident(env).job_id == "torchrun-10.0.0.1-29500"


def test_slurm():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "991"}
    i = ident(env)
    assert (i.job_id, i.rank, i.local_rank, i.world_size, i.source) == ("991", 5, 1, 16, "slurm")


def test_kubernetes_pod_and_namespace():
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": "train-0", "POD_NAMESPACE": "ml"}
    i = ident(env)
    assert (i.pod, i.namespace) == ("train-0", "ml")
    i = ident({"POD_NAME": "p-1", "POD_NAMESPACE": "ns", "NODE_NAME": "gpu-node-3"})
    assert (i.pod, i.namespace, i.node_name) == ("p-1", "ns", "gpu-node-3")


def test_explicit_overrides_beat_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "TORCHELASTIC_RUN_ID": "run-7",
        "STEPWATCH_JOB_ID": "env-job",
    }
    assert ident(env).job_id == "env-job"
    i = ident(env, job_id="mine", rank=5)
    assert (i.job_id, i.rank, i.world_size) == ("mine", 5, 8)


def test_inconsistent_rank_widens_world_instead_of_being_rejected():
    i = ident({"RANK": "4", "WORLD_SIZE": "2"})
    assert i.rank == 4 and i.world_size == 5


def test_identifiers_fit_the_agent_charset():
    assert sanitize_id("my job #1 (ü)") == "my_job__1____"
    assert len(ident({}, job_id="x" * 300).job_id) == 128


def test_a_long_kubernetes_pod_name_is_sent_whole():
    # A generated pod name (JobSet, Kubeflow) may pass 128 bytes; Kubernetes allows 253, and
    # the agent compares the claim with the kubelet's name, so a cut claim would only differ.
    pod = "trainer-" + "a" * 192
    i = ident({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "POD_NAME": pod, "NODE_NAME": "n" * 250})
    assert i.pod == pod
    assert i.node_name == "n" * 250
    assert len(ident({"POD_NAME": "p" * 300}).pod) == 253


def test_endpoint_forms():
    assert endpoint_target(env={}) == DEFAULT_ENDPOINT
    assert endpoint_target(env={"STEPWATCH_ENDPOINT": "unix:///tmp/s.sock"}) == "unix:///tmp/s.sock"
    assert endpoint_target(env={"STEPWATCH_ENDPOINT": "127.0.0.1:7070"}) == "127.0.0.1:7070"
    assert endpoint_target(env={"STEPWATCH_ENDPOINT": "/tmp/s.sock"}) == "unix:///tmp/s.sock"
    assert endpoint_target("tcp://h:1", env={}) == "h:1"


def _proc(tmp_path, pid, ticks, comm="python3 (worker)"):
    d = tmp_path / str(pid)
    d.mkdir()
    # Fields after the command: state, ppid, ... field 22 (starttime) is the 20th.
    rest = ["S", "1"] + [str(i) for i in range(5, 22)] + [str(ticks), "0", "0"]
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(rest) + "\n")


def _single_node_torchrun(port="29500"):
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "none",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }


def test_two_single_node_torchrun_runs_without_rendezvous_id_do_not_share_a_job():
    # The old fallback gave both "torchrun-127.0.0.1-29500", and the agent merged them.
    env = _single_node_torchrun()
    a = resolve_identity(env, hostname="pod-a", pid=100, ppid=7, proc_root="/nonexistent")
    b = resolve_identity(env, hostname="pod-b", pid=100, ppid=7, proc_root="/nonexistent")
    assert a.job_id != b.job_id
    assert a.job_id == "torchrun-pod-a-7"


def test_a_new_launcher_is_a_new_run_even_with_a_reused_pid(tmp_path):
    env = _single_node_torchrun()
    _proc(tmp_path, 7, ticks=1000)
    first = resolve_identity(env, hostname="h", pid=100, ppid=7, proc_root=str(tmp_path))
    assert first.job_id == "torchrun-h-7-1000"
    # Every local rank of the run (same launcher) shares it.
    env1 = dict(env, RANK="1", LOCAL_RANK="1")
    rank1 = resolve_identity(env1, hostname="h", pid=101, ppid=7, proc_root=str(tmp_path))
    assert rank1.job_id == first.job_id
    # The launcher pid reused by a later run: another start time.
    (tmp_path / "7" / "stat").unlink()
    (tmp_path / "7").rmdir()
    _proc(tmp_path, 7, ticks=5000)
    again = resolve_identity(env, hostname="h", pid=100, ppid=7, proc_root=str(tmp_path))
    assert again.job_id == "torchrun-h-7-5000"


def test_a_multi_node_torchrun_without_rendezvous_id_keeps_the_shared_master_address():
    env = dict(_single_node_torchrun(), WORLD_SIZE="16", LOCAL_WORLD_SIZE="8")
    i = resolve_identity(env, hostname="h", pid=1, ppid=7, proc_root="/nonexistent")
    assert i.job_id == "torchrun-127.0.0.1-29500"


def test_the_start_time_is_read_past_a_command_with_spaces_and_parentheses(tmp_path):
    _proc(tmp_path, 9, ticks=4242, comm="a) (b c")
    env = _single_node_torchrun()
    i = resolve_identity(env, hostname="h", pid=1, ppid=9, proc_root=str(tmp_path))
    assert i.job_id == "torchrun-h-9-4242"
