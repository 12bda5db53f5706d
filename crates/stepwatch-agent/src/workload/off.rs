//! The resolver of a build without the `workload` feature: it attests
//! nobody, so hellos are taken as they claim, as outside Kubernetes. Such
//! a build refuses to start where the kubelet's pod log directories or
//! pod-resources socket exist (`crate::refuse_unbuilt_components`), so a
//! Kubernetes node never trusts its tenants' claims by accident.

use super::{Attestation, GpuHolders, VolumePod, WorkloadConfig};
use prometheus::Registry;

/// Resolves no peer.
pub struct WorkloadResolver {
    proc_root: std::path::PathBuf,
}

impl WorkloadResolver {
    /// The same signature as the kubelet resolver's; registers nothing.
    pub fn new(
        config: WorkloadConfig,
        _registry: &Registry,
        _holders: GpuHolders,
    ) -> prometheus::Result<Self> {
        tracing::info!("pod attribution off: this build has no workload attestation (cargo feature `workload`); pods and namespaces are as clients claim");
        Ok(Self {
            proc_root: config.proc_root,
        })
    }

    /// Where the agent reads processes (`--proc-root`).
    pub fn proc_root(&self) -> &std::path::Path {
        &self.proc_root
    }

    /// No pod-resources API: no GPU checks, no GPU holder labels.
    pub fn pod_resources(&self) -> bool {
        false
    }

    /// Never called: [`Self::pod_resources`] is false.
    pub async fn refresh_holders(&self) {}

    /// Never called: no hello is attested.
    pub fn count_mismatch(&self, _field: &str) {}

    /// Every peer is unattested.
    pub async fn attest(&self, _pid: Option<u32>) -> Attestation {
        Attestation::Unattested("off")
    }

    /// Never called: the CSI plugin needs the `workload` feature.
    pub async fn attest_volume(&self, _volume: &VolumePod, _pid: Option<u32>) -> Attestation {
        Attestation::Unattested("off")
    }
}

/// No pod is known without the `workload` feature (such a build runs only
/// where there is no kubelet): peers are told apart by uid.
pub fn pod_uid_of(_proc_root: &std::path::Path, _pid: u32) -> Option<String> {
    None
}
