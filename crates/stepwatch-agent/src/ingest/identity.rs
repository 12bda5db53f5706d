//! Who a hello comes from: the peer's PID and what the kubelet or Slurm
//! attest of it, folded into the rank's identity.

use std::path::Path;

use super::*;

/// Puts the kubelet's view of the peer into the hello: its pod and
/// namespace replace the claimed ones (a difference is logged and counted),
/// and a GPU the pod does not hold is refused (PERMISSION_DENIED).
pub(super) fn apply_attestation(
    state: &AgentState,
    workload: &WorkloadResolver,
    info: &mut RankInfo,
    attestation: Attestation,
) -> Result<(), Status> {
    let Attestation::Pod(w) = attestation else {
        info.attested = false;
        return Ok(());
    };
    if !info.gpu_uuid.is_empty() && w.holds_gpu(&info.gpu_uuid) == Some(false) {
        tracing::warn!(namespace = %w.namespace, pod = %w.pod, pid = info.pid, gpu = %info.gpu_uuid, "refused a hello naming a GPU its pod does not hold");
        // Not for good: the answer rests on the kubelet's view and on which
        // container the agent could place the peer in, not on the hello alone.
        return Err(refuse(
            state,
            "gpu_not_allocated",
            1,
            Status::permission_denied(format!(
                "GPU {} is not allocated to pod {}/{} (the kubelet's pod-resources API says so)",
                info.gpu_uuid, w.namespace, w.pod
            )),
        ));
    }
    for (field, claimed, actual) in [
        ("namespace", &info.namespace, &w.namespace),
        ("pod", &info.pod, &w.pod),
    ] {
        if !claimed.is_empty() && claimed != actual {
            workload.count_mismatch(field);
            tracing::warn!(field, claimed = %claimed, kubelet = %actual, pid = info.pid, "a hello's {field} differs from the kubelet's; the kubelet's is used");
        }
    }
    info.container = w.container_for(&info.gpu_uuid).to_owned();
    info.namespace = w.namespace;
    info.pod = w.pod;
    info.attested = true;
    Ok(())
}

/// The peer's PID from SO_PEERCRED, when it means something here. The kernel
/// reports 0 for a peer outside the agent's PID namespace (an agent without
/// `hostPID`); that must not override the PID the hello claims, and the
/// operator is told once.
pub(super) fn usable_peer_pid(pid: i32) -> Option<u32> {
    static TOLD: std::sync::Once = std::sync::Once::new();
    match u32::try_from(pid) {
        Ok(0) => {
            TOLD.call_once(|| {
                tracing::warn!(
                    "a client's peer credentials carry PID 0: the agent runs outside the clients' PID \
                     namespace, so it uses the PID each hello claims; run the agent with hostPID \
                     (the chart does) to tell ranks' memory from other processes' reliably"
                )
            });
            None
        }
        Ok(pid) => Some(pid),
        Err(_) => None,
    }
}

/// The rank a hello claims to be, with the socket's peer PID in place of
/// the claimed one where the agent has it.
pub(super) fn rank_info(hello: pb::Hello, peer_pid: Option<u32>) -> RankInfo {
    let mut info = convert::hello_from_wire(hello);
    info.pid = peer_pid.unwrap_or(info.pid);
    info
}

/// Over TCP, the rank's claimant is who the TLS handshake proved
/// (`identity`; empty without a client certificate), never the PID the
/// hello claims: that PID still names the rank's GPU process, but a hello
/// claiming another's PID must not resume, or join, its rank.
pub(super) fn tcp_claimant(info: &mut RankInfo, identity: &str) {
    info.tcp_identity = Some(identity.to_owned());
}

/// Ends the reconnect window of the rank `info` asks for when the process
/// it is held for is gone (it died, or exited without closing its stream):
/// the window is for a process that can still come back, and a restarted
/// worker (a new process) must get its rank, and its step-1 prediction, at
/// once. Only a PID from the kernel is checked (a TCP holder's is a claim).
pub(super) fn release_if_holder_gone(state: &AgentState, proc_root: &Path, info: &RankInfo) {
    let key = info.key();
    let now = stepwatch_proto::clock::monotonic_ns();
    let holder = state.read_tracker(|t| {
        let r = t.rank(&key)?;
        let held = r.connected_streams == 0 && now < r.reconnect_until_ns;
        (held && r.info.tcp_identity.is_none() && r.info.pid != 0 && !r.info.same_claimant(info))
            .then_some(r.info.pid)
    });
    if let Some(pid) = holder.filter(|&pid| !process_alive(proc_root, pid)) {
        tracing::info!(namespace = %key.namespace, job = %key.job, rank = key.rank, pid, "the process a rank was kept for is gone; another may take the rank");
        state.close_rank(&key, false);
    }
}

/// Whether `pid` is a live process: listed under `proc_root` and not a
/// zombie (a dead child its parent has not reaped yet).
fn process_alive(proc_root: &Path, pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")) else {
        return false;
    };
    // The state follows the command name, which may hold spaces and ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_is_alive_and_a_zombie_or_a_missing_one_is_not() {
        let proc_root = Path::new("/proc");
        assert!(process_alive(proc_root, std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Exited and not reaped: a zombie until the wait below.
        let stat = proc_root.join(pid.to_string()).join("stat");
        while !std::fs::read_to_string(&stat).is_ok_and(|s| s.contains(") Z")) {
            std::thread::yield_now();
        }
        assert!(!process_alive(proc_root, pid));
        child.wait().unwrap();
        assert!(!process_alive(proc_root, pid));
    }
}
