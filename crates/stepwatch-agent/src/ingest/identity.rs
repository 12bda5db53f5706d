//! Who a hello comes from: the peer's PID and what the kubelet or Slurm
//! attest of it, folded into the rank's identity.

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
