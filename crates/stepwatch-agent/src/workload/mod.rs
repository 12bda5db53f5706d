//! Who is on the other end of the socket, as the kubelet knows it.
//!
//! The chain, after SPIRE's Kubernetes workload attestor and dcgm-exporter's
//! pod attribution: the peer's PID (SO_PEERCRED) → `/proc/<pid>/cgroup` →
//! the pod UID and container ID the runtime put in the cgroup path → the
//! kubelet's pod log directory `/var/log/pods/<namespace>_<pod>_<uid>` →
//! the kubelet's pod-resources API (`List`) → the GPUs the pod's containers
//! hold. Every link is written by the kubelet or the kernel, none by the
//! client. The pod-resources API names pods, not UIDs; the log directory is
//! the kubelet's own UID → name map on the node (log collectors read it the
//! same way).
//!
//! The pod (namespace, name, UID, container) needs only the first links,
//! which an unprivileged agent with hostPID and a read-only view of the pod
//! log directories can read; the pod-resources API (root's socket) adds
//! which GPUs the pod holds, so that a GPU it does not hold is refused, and
//! the pod labels of GPU series. Outside Kubernetes (neither the pod log
//! directories nor the socket) attestation is off and hellos are taken as
//! they come; logged once at start.
//!
//! This file holds what the rest of the agent sees (a peer's attestation,
//! GPU holders); the lookups are in `kubelet.rs`, behind the `workload`
//! cargo feature. A build without it has `off.rs`'s resolver, which attests
//! nobody.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

#[cfg(feature = "workload")]
mod kubelet;
#[cfg(feature = "workload")]
pub use kubelet::*;
#[cfg(not(feature = "workload"))]
mod off;
#[cfg(not(feature = "workload"))]
pub use off::{pod_uid_of, WorkloadResolver};

/// The container holding a GPU, as the kubelet's pod-resources `List`
/// says: the `namespace`, `pod` and `container` labels of that GPU's
/// series (dcgm-exporter's pod attribution).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHolder {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container the device plugin gave the GPU to.
    pub container: String,
}

/// Who holds each GPU, shared between the resolver (which refreshes it)
/// and the exporter (which labels GPU series with it). Empty outside
/// Kubernetes. An answer older than its `max_age` is not used, so that a
/// kubelet gone silent leaves GPU series without pod labels rather than
/// naming pods that may have left.
#[derive(Clone)]
pub struct GpuHolders {
    max_age: Duration,
    latest: Arc<RwLock<Option<(Instant, HolderMap)>>>,
}

/// Device ID → holder, as [`gpu_holders`] makes it.
type HolderMap = Arc<HashMap<String, GpuHolder>>;

impl GpuHolders {
    /// Holders that answers refreshed every `refresh` keep up to date: an
    /// answer counts for four refreshes, and at least a minute.
    pub fn new(refresh: Duration) -> Self {
        Self {
            max_age: (refresh * 4).max(Duration::from_secs(60)),
            latest: Arc::default(),
        }
    }

    /// How long an answer labels GPU series without a newer one.
    #[cfg_attr(not(feature = "workload"), allow(dead_code))]
    pub fn max_age(&self) -> Duration {
        self.max_age
    }

    #[cfg_attr(not(feature = "workload"), allow(dead_code))]
    fn set(&self, map: HashMap<String, GpuHolder>) {
        *self.latest.write().expect("not poisoned") = Some((Instant::now(), Arc::new(map)));
    }

    /// The holder of the GPU with `uuid` and NVML `index`, when the latest
    /// answer is fresh and names one.
    pub fn holder(&self, uuid: &str, index: u32) -> Option<GpuHolder> {
        let guard = self.latest.read().expect("not poisoned");
        let (at, map) = guard.as_ref()?;
        if at.elapsed() >= self.max_age {
            return None;
        }
        map.get(uuid)
            .or_else(|| map.get(&index.to_string()))
            .cloned()
    }
}

/// A process's pod as the kubelet knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// Its UID.
    pub pod_uid: String,
    /// The runtime's container ID from the cgroup, when it had one.
    pub container_id: Option<String>,
    /// The process's container, from its mounts (`kubelet::container_of_mountinfo`).
    pub container: Option<String>,
    /// The pod's containers as `List` gave them, with the GPUs each holds
    /// (None: not comparable, see `kubelet::container_gpus`).
    pub containers: Vec<(String, Option<Vec<String>>)>,
}

impl Workload {
    /// Whether the process may run on `gpu_uuid`: the GPUs of its
    /// container when that is known and listed, else of the whole pod.
    /// Some(false) only when those GPUs are known, some are held, and none
    /// is this one (a container given no GPU by the device plugin may still
    /// see some by other means, so it is not refused).
    pub fn holds_gpu(&self, gpu_uuid: &str) -> Option<bool> {
        let mut held = HashSet::new();
        let own = self
            .containers
            .iter()
            .filter(|(name, _)| self.container.as_deref() == Some(name.as_str()))
            .collect::<Vec<_>>();
        let scope = if own.is_empty() {
            self.containers.iter().collect()
        } else {
            own
        };
        for (_, gpus) in scope {
            held.extend(gpus.as_ref()?.iter().map(String::as_str));
        }
        if held.is_empty() {
            return None;
        }
        Some(held.contains(gpu_uuid))
    }

    /// The container the rank runs in: from its mounts, else the one
    /// holding its GPU, else the pod's only container; "" when that cannot
    /// be told.
    pub fn container_for(&self, gpu_uuid: &str) -> &str {
        if let Some(name) = &self.container {
            return name;
        }
        let holding: Vec<&str> = self
            .containers
            .iter()
            .filter(|(_, g)| g.as_ref().is_some_and(|g| g.iter().any(|u| u == gpu_uuid)))
            .map(|(n, _)| n.as_str())
            .collect();
        match (holding.as_slice(), self.containers.as_slice()) {
            ([one], _) => one,
            (_, [(only, _)]) => only,
            _ => "",
        }
    }
}

/// The pod a CSI ephemeral volume was published for, as the kubelet named
/// it in NodePublishVolume (the CSIDriver's `podInfoOnMount`). Connections on
/// that volume's socket are this pod's by construction: only its containers
/// mount the volume, so no PID lookup is needed, and it works when the
/// agent cannot see the client's PID namespace.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumePod {
    /// `csi.storage.k8s.io/pod.namespace`.
    pub namespace: String,
    /// `csi.storage.k8s.io/pod.name`.
    pub pod: String,
    /// `csi.storage.k8s.io/pod.uid`.
    pub pod_uid: String,
    /// `csi.storage.k8s.io/serviceAccount.name` (logged, not used as a label).
    pub service_account: String,
}

/// What the agent could learn of a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attestation {
    /// No kubelet view: attestation is off, the peer is in no pod, there is
    /// no peer PID (TCP), or a lookup failed (counted). The hello's claims
    /// stand, unattested.
    Unattested(&'static str),
    /// The peer's pod, from the kubelet (never, without the `workload`
    /// feature).
    #[cfg_attr(not(feature = "workload"), allow(dead_code))]
    Pod(Workload),
}

/// Where to look (flags of the same names); unread without the
/// `workload` feature.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "workload"), allow(dead_code))]
pub struct WorkloadConfig {
    /// `--proc-root`: the host's /proc (the agent runs with hostPID).
    pub proc_root: PathBuf,
    /// `--pod-resources-socket`: the kubelet's pod-resources API.
    pub pod_resources_socket: PathBuf,
    /// `--pod-logs-dir`: the kubelet's pod log directories.
    pub pod_logs_dir: PathBuf,
    /// Deadline of one `List` call, connection included.
    pub timeout: Duration,
    /// How long a `List` answer is used before it is asked again.
    pub cache_ttl: Duration,
    /// `--pod-resources-refresh`: how often GPU holders are asked for.
    pub holders_refresh: Duration,
}
