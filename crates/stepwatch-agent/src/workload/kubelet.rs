//! Pod attestation through the kubelet (the `workload` feature): the
//! cgroup and pod-log-directory lookups and the pod-resources client.

use super::*;
use crate::metrics;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use prometheus::{IntCounter, IntCounterVec, Registry};
use stepwatch_proto::podresources::v1::{
    pod_resources_lister_client::PodResourcesListerClient, ListPodResourcesRequest, PodResources,
};

/// Most bytes one `List` answer may hold: a node of 250 pods with a few
/// devices each is well under 1 MiB.
const MAX_LIST_BYTES: usize = 16 << 20;

/// A process's pod and container, as its cgroup path names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupIdentity {
    /// The pod's UID, with dashes (systemd slices write underscores).
    pub pod_uid: String,
    /// The runtime's container ID (64 hex digits), when the path has one.
    pub container_id: Option<String>,
}

/// The pod and container of a process found in `/proc/<pid>/cgroup`, or
/// None for a process in no Kubernetes pod. Reads cgroup v2 (`0::/path`)
/// and v1 (one line per hierarchy) files; the systemd driver's
/// `kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope`,
/// the cgroupfs driver's `kubepods/burstable/pod<uid>/<id>`, CRI-O's
/// `crio-<id>.scope`, cri-dockerd's `docker-<id>.scope`, and containerd's
/// `…slice:cri-containerd:<id>` under kind.
pub fn parse_cgroup(text: &str) -> Option<CgroupIdentity> {
    let mut best: Option<CgroupIdentity> = None;
    for line in text.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        let Some(found) = parse_cgroup_path(path) else {
            continue;
        };
        if found.container_id.is_some() {
            return Some(found);
        }
        best.get_or_insert(found);
    }
    best
}

/// The UID of the pod process `pid` runs in, from its cgroup under
/// `proc_root`; None for a process in no pod, or one gone or unreadable.
pub fn pod_uid_of(proc_root: &Path, pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    parse_cgroup(&text).map(|c| c.pod_uid)
}

fn parse_cgroup_path(path: &str) -> Option<CgroupIdentity> {
    if !path.contains("kubepods") {
        return None;
    }
    let segments: Vec<&str> = path.split('/').collect();
    let (at, pod_uid) = segments
        .iter()
        .enumerate()
        .find_map(|(i, s)| pod_uid_in(s).map(|uid| (i, uid)))?;
    // The container is named after the pod: in a later segment, or after
    // the pod slice's `:` (containerd's systemd form under kind).
    let container_id = segments[at..].iter().rev().find_map(|s| container_id_in(s));
    Some(CgroupIdentity {
        pod_uid,
        container_id,
    })
}

/// The UID in a segment like `pod<uid>`, `kubepods-besteffort-pod<uid>.slice`.
fn pod_uid_in(segment: &str) -> Option<String> {
    let mut from = 0;
    while let Some(i) = segment[from..].find("pod") {
        let start = from + i + 3;
        let rest = &segment[start..];
        let uid: String = rest
            .chars()
            .take_while(|c| c.is_ascii_hexdigit() || *c == '-' || *c == '_')
            .collect();
        let uid = uid.replace('_', "-");
        if is_uid(&uid) {
            return Some(uid);
        }
        from = start;
    }
    None
}

/// A pod UID: 8-4-4-4-12 hex digits, or the 32 hex digits of a static pod.
fn is_uid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    let lens: Vec<usize> = groups.iter().map(|g| g.len()).collect();
    (lens == [8, 4, 4, 4, 12] || lens == [32])
        && groups
            .iter()
            .all(|g| g.chars().all(|c| c.is_ascii_hexdigit()))
}

/// The 64-hex container ID in `cri-containerd-<id>.scope`, `crio-<id>.scope`,
/// `docker-<id>.scope`, `<slice>:cri-containerd:<id>` or a bare `<id>`.
fn container_id_in(segment: &str) -> Option<String> {
    let s = segment.strip_suffix(".scope").unwrap_or(segment);
    let s = s.rsplit([':', '-']).next()?;
    (s.len() == 64 && s.chars().all(|c| c.is_ascii_hexdigit())).then(|| s.to_owned())
}

/// Namespace and pod name of the pod with `uid`, from the names of the
/// kubelet's pod log directories (`<namespace>_<pod>_<uid>`). Namespaces
/// and pod names are DNS labels/subdomains, so they hold no `_`.
pub fn pod_of_log_dir<'a>(
    mut names: impl Iterator<Item = &'a str>,
    uid: &str,
) -> Option<(String, String)> {
    names.find_map(|name| {
        let rest = name.strip_suffix(uid)?.strip_suffix('_')?;
        let (namespace, pod) = rest.split_once('_')?;
        (!namespace.is_empty() && !pod.is_empty()).then(|| (namespace.to_owned(), pod.to_owned()))
    })
}

/// The container a process runs in, from `/proc/<pid>/mountinfo`: the
/// kubelet bind-mounts each container's termination-log file from
/// `…/pods/<uid>/containers/<name>/…`, and the mount's root (field 4) is
/// the kernel's record of that source, which the container cannot rewrite.
/// None when no such mount is there (e.g. `terminationMessagePath` unset).
pub fn container_of_mountinfo(text: &str, uid: &str) -> Option<String> {
    let marker = format!("/pods/{uid}/containers/");
    text.lines().find_map(|line| {
        let root = line.split_whitespace().nth(3)?;
        let rest = &root[root.find(&marker)? + marker.len()..];
        let name = rest.split('/').next()?;
        (!name.is_empty()).then(|| name.to_owned())
    })
}

/// The GPUs one container holds, from the pod-resources answer: NVIDIA
/// device-plugin devices (`nvidia.com/gpu`, `nvidia.com/mig-…`) whose IDs
/// are UUIDs. None when they cannot be compared with a UUID: index IDs
/// (`DEVICE_ID_STRATEGY=index`) or MIG devices (the client may name the
/// parent GPU). Time-slicing replicas (`GPU-…::3`) count as their GPU.
fn container_gpus(
    devices: &[stepwatch_proto::podresources::v1::ContainerDevices],
) -> Option<Vec<String>> {
    let mut gpus = Vec::new();
    for d in devices
        .iter()
        .filter(|d| d.resource_name.starts_with("nvidia.com/"))
    {
        for id in &d.device_ids {
            let id = id.split("::").next().unwrap_or(id);
            if !id.starts_with("GPU-") {
                return None;
            }
            gpus.push(id.to_owned());
        }
    }
    Some(gpus)
}

/// Device ID → the one container holding it, from a `List` answer. The
/// key is what the NVIDIA device plugin reports: the GPU's UUID, or its
/// index under `DEVICE_ID_STRATEGY=index`; time-slicing replicas
/// (`GPU-…::3`) count as their GPU. A GPU that several containers share
/// (time-slicing) has no single holder and is left out: its series carry
/// no pod rather than one of its pods.
pub fn gpu_holders(pods: &[PodResources]) -> HashMap<String, GpuHolder> {
    let mut seen: HashMap<String, Option<GpuHolder>> = HashMap::new();
    for pod in pods {
        for c in &pod.containers {
            for d in c
                .devices
                .iter()
                .filter(|d| d.resource_name.starts_with("nvidia.com/"))
            {
                for id in &d.device_ids {
                    let id = id.split("::").next().unwrap_or(id);
                    let holder = GpuHolder {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: c.name.clone(),
                    };
                    seen.entry(id.to_owned())
                        .and_modify(|h| {
                            if h.as_ref() != Some(&holder) {
                                *h = None;
                            }
                        })
                        .or_insert(Some(holder));
                }
            }
        }
    }
    seen.into_iter()
        .filter_map(|(id, h)| Some((id, h?)))
        .collect()
}

/// Resolves peers to pods; one per agent, shared by the ingest listeners.
pub struct WorkloadResolver {
    config: WorkloadConfig,
    enabled: bool,
    /// The kubelet's pod-resources socket is there: GPUs are checked.
    pod_resources: bool,
    /// The latest `List` answer and when it came; one at a time.
    cache: tokio::sync::Mutex<Option<(Instant, Arc<Vec<PodResources>>)>>,
    /// Failure reasons already logged (each is logged once, counted always).
    told: Mutex<HashSet<&'static str>>,
    failures: IntCounterVec,
    attestations: IntCounterVec,
    mismatches: IntCounterVec,
    holders: GpuHolders,
    holder_errors: IntCounter,
}

impl WorkloadResolver {
    /// A resolver; attestation is on when the pod log directories or the
    /// pod-resources socket exist, GPU checks when the socket does. Every
    /// fresh `List` answer updates `holders`.
    pub fn new(
        config: WorkloadConfig,
        registry: &Registry,
        holders: GpuHolders,
    ) -> prometheus::Result<Self> {
        let failures =
            IntCounterVec::new(metrics::WORKLOAD_LOOKUP_FAILURES_TOTAL.opts(), &["reason"])?;
        let attestations =
            IntCounterVec::new(metrics::WORKLOAD_ATTESTATIONS_TOTAL.opts(), &["result"])?;
        let mismatches = IntCounterVec::new(
            metrics::WORKLOAD_IDENTITY_MISMATCHES_TOTAL.opts(),
            &["field"],
        )?;
        // Every label value exported from the start, at 0: a rate() over a
        // series that appears only at its first increment misses that one.
        for reason in [
            "proc_unreadable",
            "pod_logs_missing",
            "pod_resources_error",
            "pod_not_listed",
        ] {
            failures.with_label_values(&[reason]);
        }
        for result in [
            "kubelet",
            "pod_logs",
            "csi_volume",
            "off",
            "no_peer_pid",
            "not_in_pod",
            "lookup_failed",
        ] {
            attestations.with_label_values(&[result]);
        }
        for field in ["namespace", "pod"] {
            mismatches.with_label_values(&[field]);
        }
        registry.register(Box::new(failures.clone()))?;
        registry.register(Box::new(attestations.clone()))?;
        registry.register(Box::new(mismatches.clone()))?;
        let holder_errors = IntCounter::new(
            metrics::WORKLOAD_GPU_HOLDERS_REFRESH_ERRORS_TOTAL.name,
            metrics::WORKLOAD_GPU_HOLDERS_REFRESH_ERRORS_TOTAL.help,
        )?;
        registry.register(Box::new(holder_errors.clone()))?;
        let pod_resources = config.pod_resources_socket.exists();
        let enabled = pod_resources || config.pod_logs_dir.is_dir();
        if pod_resources {
            tracing::info!(socket = %config.pod_resources_socket.display(), proc_root = %config.proc_root.display(), "pod attribution on: clients' pods and namespaces come from the kubelet, and a GPU a pod does not hold is refused");
        } else if enabled {
            tracing::info!(pod_logs = %config.pod_logs_dir.display(), proc_root = %config.proc_root.display(), socket = %config.pod_resources_socket.display(), "pod attribution on: clients' pods and namespaces come from their cgroups and the kubelet's pod log directories; no pod-resources socket, so the GPUs clients name are not checked and GPU series carry no pod");
        } else {
            tracing::warn!(socket = %config.pod_resources_socket.display(), pod_logs = %config.pod_logs_dir.display(), "pod attribution off: no kubelet pod log directories or pod-resources socket (outside Kubernetes?); pods and namespaces are as clients claim");
        }
        Ok(Self {
            config,
            enabled,
            pod_resources,
            cache: tokio::sync::Mutex::new(None),
            told: Mutex::new(HashSet::new()),
            failures,
            attestations,
            mismatches,
            holders,
            holder_errors,
        })
    }

    /// Where the agent reads processes (`--proc-root`).
    pub fn proc_root(&self) -> &std::path::Path {
        &self.config.proc_root
    }

    /// Whether the pod-resources API is there to ask: GPU checks and GPU
    /// holder labels.
    pub fn pod_resources(&self) -> bool {
        self.pod_resources
    }

    /// Asks the kubelet who holds which GPU, unless an answer younger than
    /// `--pod-resources-refresh` is at hand (a hello may just have asked).
    /// A failure is counted and logged once; the last answer stays until
    /// it is stale. Call every `--pod-resources-refresh`.
    pub async fn refresh_holders(&self) {
        if !self.pod_resources {
            return;
        }
        let mut cache = self.cache.lock().await;
        if cache
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < self.config.holders_refresh)
        {
            return;
        }
        match self.fetch(&mut cache).await {
            Ok(_) => {}
            Err(why) => {
                self.holder_errors.inc();
                if self
                    .told
                    .lock()
                    .expect("not poisoned")
                    .insert("holders_refresh")
                {
                    tracing::warn!("cannot ask the kubelet which pod holds which GPU ({why}); GPU series keep their last pod labels for {:?}, then lose them (logged once, counted in stepwatch_workload_gpu_holders_refresh_errors_total)", self.holders.max_age());
                }
            }
        }
    }

    /// Counts a claimed identity field that differs from the kubelet's.
    pub fn count_mismatch(&self, field: &str) {
        self.mismatches.with_label_values(&[field]).inc();
    }

    /// The pod of the process `pid` (None: no peer PID, e.g. TCP).
    pub async fn attest(&self, pid: Option<u32>) -> Attestation {
        let result = self.attest_inner(pid).await;
        let label = match &result {
            Attestation::Pod(_) if self.pod_resources => "kubelet",
            Attestation::Pod(_) => "pod_logs",
            Attestation::Unattested(why) => why,
        };
        self.attestations.with_label_values(&[label]).inc();
        result
    }

    /// The pod a CSI volume socket belongs to: its identity is the one the
    /// kubelet gave at NodePublishVolume; the pod-resources API adds the GPUs
    /// its containers hold where it answers (else the GPU goes unchecked,
    /// the failure counted), and the peer's mounts its container where the
    /// peer PID is visible.
    pub async fn attest_volume(&self, volume: &VolumePod, pid: Option<u32>) -> Attestation {
        let containers = if self.pod_resources {
            match self.list(&volume.namespace, &volume.pod).await {
                Ok(list) => match list
                    .iter()
                    .find(|p| p.namespace == volume.namespace && p.name == volume.pod)
                {
                    Some(entry) => entry
                        .containers
                        .iter()
                        .map(|c| (c.name.clone(), container_gpus(&c.devices)))
                        .collect(),
                    None => {
                        let why = format!(
                            "the kubelet's List has no pod {}/{}",
                            volume.namespace, volume.pod
                        );
                        self.failed("pod_not_listed", &why);
                        Vec::new()
                    }
                },
                Err(why) => {
                    self.failed("pod_resources_error", &why);
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        let container = match pid {
            Some(pid) => {
                let path = self
                    .config
                    .proc_root
                    .join(pid.to_string())
                    .join("mountinfo");
                let uid = volume.pod_uid.clone();
                tokio::task::spawn_blocking(move || {
                    let text = std::fs::read_to_string(path).ok()?;
                    container_of_mountinfo(&text, &uid)
                })
                .await
                .ok()
                .flatten()
            }
            None => None,
        };
        self.attestations.with_label_values(&["csi_volume"]).inc();
        Attestation::Pod(Workload {
            namespace: volume.namespace.clone(),
            pod: volume.pod.clone(),
            pod_uid: volume.pod_uid.clone(),
            container_id: None,
            container,
            containers,
        })
    }

    async fn attest_inner(&self, pid: Option<u32>) -> Attestation {
        if !self.enabled {
            return Attestation::Unattested("off");
        }
        let Some(pid) = pid else {
            return Attestation::Unattested("no_peer_pid");
        };
        let (proc_root, logs) = (
            self.config.proc_root.clone(),
            self.config.pod_logs_dir.clone(),
        );
        let local = tokio::task::spawn_blocking(move || local_lookup(&proc_root, &logs, pid))
            .await
            .unwrap_or(Err(LookupFailure::Proc("lookup task failed".into())));
        let (cgroup, container, namespace, pod) = match local {
            Ok(Some(found)) => found,
            Ok(None) => return Attestation::Unattested("not_in_pod"),
            Err(e) => return self.failed(e.reason(), &e.to_string()),
        };
        if !self.pod_resources {
            // The pod without its GPUs: no GPU is refused (holds_gpu: None).
            return Attestation::Pod(Workload {
                namespace,
                pod,
                pod_uid: cgroup.pod_uid,
                container_id: cgroup.container_id,
                container,
                containers: Vec::new(),
            });
        }
        let list = match self.list(&namespace, &pod).await {
            Ok(list) => list,
            Err(why) => return self.failed("pod_resources_error", &why),
        };
        let Some(entry) = list
            .iter()
            .find(|p| p.namespace == namespace && p.name == pod)
        else {
            return self.failed(
                "pod_not_listed",
                &format!("the kubelet's List has no pod {namespace}/{pod}"),
            );
        };
        Attestation::Pod(Workload {
            namespace,
            pod,
            pod_uid: cgroup.pod_uid,
            container_id: cgroup.container_id,
            container,
            containers: entry
                .containers
                .iter()
                .map(|c| (c.name.clone(), container_gpus(&c.devices)))
                .collect(),
        })
    }

    fn failed(&self, reason: &'static str, why: &str) -> Attestation {
        self.failures.with_label_values(&[reason]).inc();
        if self.told.lock().expect("not poisoned").insert(reason) {
            tracing::warn!(reason, "cannot tell a client's pod ({why}); its hello counts as unattested (logged once per reason, counted in stepwatch_workload_lookup_failures_total)");
        }
        Attestation::Unattested("lookup_failed")
    }

    /// The kubelet's `List`, from the cache when fresh and holding the pod;
    /// a pod not in it triggers one refresh (it may have just started).
    async fn list(&self, namespace: &str, pod: &str) -> Result<Arc<Vec<PodResources>>, String> {
        let mut cache = self.cache.lock().await;
        if let Some((at, list)) = cache.as_ref() {
            let has = list
                .iter()
                .any(|p| p.namespace == namespace && p.name == pod);
            if at.elapsed() < self.config.cache_ttl && has {
                return Ok(list.clone());
            }
        }
        self.fetch(&mut cache).await
    }

    /// One `List` call under the cache lock; a fresh answer replaces the
    /// cache and the GPU holders.
    async fn fetch(
        &self,
        cache: &mut Option<(Instant, Arc<Vec<PodResources>>)>,
    ) -> Result<Arc<Vec<PodResources>>, String> {
        let fresh = Arc::new(
            tokio::time::timeout(self.config.timeout, self.call_list())
                .await
                .map_err(|_| format!("List took over {:?}", self.config.timeout))??,
        );
        self.holders.set(gpu_holders(&fresh));
        *cache = Some((Instant::now(), fresh.clone()));
        Ok(fresh)
    }

    async fn call_list(&self) -> Result<Vec<PodResources>, String> {
        let uri = format!("unix://{}", self.config.pod_resources_socket.display());
        let channel = tonic::transport::Endpoint::from_shared(uri)
            .map_err(|e| e.to_string())?
            .connect_timeout(self.config.timeout)
            .timeout(self.config.timeout)
            .connect()
            .await
            .map_err(|e| format!("cannot connect to the kubelet: {e}"))?;
        let mut client =
            PodResourcesListerClient::new(channel).max_decoding_message_size(MAX_LIST_BYTES);
        let answer = client
            .list(ListPodResourcesRequest {})
            .await
            .map_err(|s| format!("List failed: {:?} {}", s.code(), s.message()))?;
        Ok(answer.into_inner().pod_resources)
    }
}

/// Why the local part of a lookup failed.
#[derive(Debug)]
enum LookupFailure {
    Proc(String),
    PodLogs(String),
}

impl LookupFailure {
    fn reason(&self) -> &'static str {
        match self {
            LookupFailure::Proc(_) => "proc_unreadable",
            LookupFailure::PodLogs(_) => "pod_logs_missing",
        }
    }
}

impl std::fmt::Display for LookupFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LookupFailure::Proc(s) | LookupFailure::PodLogs(s) => f.write_str(s),
        }
    }
}

/// What the node's files say of a process: its cgroup identity, container
/// name (when its mounts tell), namespace and pod.
type LocalView = (CgroupIdentity, Option<String>, String, String);

/// cgroup → pod UID → (namespace, pod), and the container from the
/// process's mounts; Ok(None) for a process in no pod.
fn local_lookup(
    proc_root: &Path,
    pod_logs: &Path,
    pid: u32,
) -> Result<Option<LocalView>, LookupFailure> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| LookupFailure::Proc(format!("{}: {e}", path.display())))?;
    let Some(cgroup) = parse_cgroup(&text) else {
        return Ok(None);
    };
    let dir = std::fs::read_dir(pod_logs)
        .map_err(|e| LookupFailure::PodLogs(format!("{}: {e}", pod_logs.display())))?;
    let names: Vec<String> = dir
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    let (namespace, pod) = pod_of_log_dir(names.iter().map(String::as_str), &cgroup.pod_uid)
        .ok_or_else(|| {
            LookupFailure::PodLogs(format!(
                "no directory of pod {} in {}",
                cgroup.pod_uid,
                pod_logs.display()
            ))
        })?;
    let container = std::fs::read_to_string(proc_root.join(pid.to_string()).join("mountinfo"))
        .ok()
        .and_then(|text| container_of_mountinfo(&text, &cgroup.pod_uid));
    Ok(Some((cgroup, container, namespace, pod)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f4e1b2c9a8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";
    const UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

    fn uid_underscored() -> String {
        UID.replace('-', "_")
    }

    fn found(container: Option<&str>) -> Option<CgroupIdentity> {
        Some(CgroupIdentity {
            pod_uid: UID.into(),
            container_id: container.map(str::to_owned),
        })
    }

    #[test]
    fn each_cgroup_driver_and_runtime_names_pod_and_container() {
        let uid = uid_underscored();
        for line in [
            // cgroup v2, systemd driver, containerd.
            format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/cri-containerd-{ID}.scope\n"),
            // Guaranteed QoS has no QoS slice.
            format!("0::/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{ID}.scope"),
            // The cgroupfs driver.
            format!("0::/kubepods/burstable/pod{UID}/{ID}"),
            format!("0::/kubepods/pod{UID}/{ID}"),
            // CRI-O and Docker scopes.
            format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid}.slice/crio-{ID}.scope"),
            format!("0::/kubepods/besteffort/pod{UID}/crio-{ID}"),
            format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/docker-{ID}.scope"),
            // containerd's systemd form, as under kind.
            format!("0::/system.slice/containerd.service/kubepods-burstable-pod{uid}.slice:cri-containerd:{ID}"),
        ] {
            assert_eq!(parse_cgroup(&line), found(Some(ID)), "{line}");
        }
    }

    #[test]
    fn cgroup_v1_multi_line() {
        let text = format!(
            "12:pids:/kubepods/burstable/pod{UID}/{ID}\n\
             11:memory:/kubepods/burstable/pod{UID}/{ID}\n\
             10:cpu,cpuacct:/kubepods/burstable/pod{UID}/{ID}\n\
             1:name=systemd:/kubepods/burstable/pod{UID}/{ID}\n\
             0::/\n"
        );
        assert_eq!(parse_cgroup(&text), found(Some(ID)));
        // systemd driver on v1: the same slices, one line per controller.
        let text = format!(
            "5:devices:/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{ID}.scope\n\
             4:memory:/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{ID}.scope\n",
            u = uid_underscored()
        );
        assert_eq!(parse_cgroup(&text), found(Some(ID)));
    }

    #[test]
    fn static_pods_have_hash_uids() {
        let hash = "4f2a6c1e8b9d0a7c3e5f1b2d4a6c8e0f";
        let line = format!("0::/kubepods/burstable/pod{hash}/{ID}");
        assert_eq!(
            parse_cgroup(&line).map(|c| c.pod_uid),
            Some(hash.to_owned())
        );
    }

    #[test]
    fn processes_outside_kubernetes_have_no_pod() {
        for text in [
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            "0::/\n",
            &format!("0::/system.slice/docker-{ID}.scope\n"),
            "12:pids:/user.slice\n11:memory:/user.slice\n",
            "",
            "garbage without colons",
            // "pod" in a path that is not under kubepods.
            &format!("0::/system.slice/pod{UID}.scope"),
        ] {
            assert_eq!(parse_cgroup(text), None, "{text:?}");
        }
    }

    #[test]
    fn a_pod_level_cgroup_has_no_container() {
        let line = format!("0::/kubepods/burstable/pod{UID}");
        assert_eq!(parse_cgroup(&line), found(None));
    }

    #[test]
    fn pod_log_directories_name_namespace_and_pod() {
        let names = [
            "kube-system_coredns-5d78c9869d-abcde_11111111-2222-3333-4444-555555555555".to_string(),
            format!("team-a_trainer-0_{UID}"),
        ];
        assert_eq!(
            pod_of_log_dir(names.iter().map(String::as_str), UID),
            Some(("team-a".into(), "trainer-0".into()))
        );
        assert_eq!(
            pod_of_log_dir(names.iter().map(String::as_str), "nope"),
            None
        );
        assert_eq!(
            pod_of_log_dir([format!("_x_{UID}")].iter().map(String::as_str), UID),
            None
        );
    }

    fn devices(
        resource: &str,
        ids: &[&str],
    ) -> stepwatch_proto::podresources::v1::ContainerDevices {
        stepwatch_proto::podresources::v1::ContainerDevices {
            resource_name: resource.into(),
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
            topology: None,
        }
    }

    #[test]
    fn the_container_comes_from_the_termination_log_mount() {
        let text = format!(
            "1201 1200 0:512 / / rw,relatime - overlay overlay rw\n\
             1210 1200 259:1 /var/lib/kubelet/pods/{UID}/etc-hosts /etc/hosts rw,relatime - ext4 /dev/nvme0n1p1 rw\n\
             1211 1200 259:1 /var/lib/kubelet/pods/{UID}/containers/trainer/6a1b2c3d /dev/termination-log rw,relatime - ext4 /dev/nvme0n1p1 rw\n"
        );
        assert_eq!(container_of_mountinfo(&text, UID), Some("trainer".into()));
        // /var/lib/kubelet on its own filesystem: the root is relative to it.
        let text = format!(
            "1211 1200 259:3 /pods/{UID}/containers/helper/0b1c /dev/termination-log rw - xfs /dev/sdb rw\n"
        );
        assert_eq!(container_of_mountinfo(&text, UID), Some("helper".into()));
        // Another pod's path, or none at all.
        assert_eq!(container_of_mountinfo(&text, "other-uid"), None);
        assert_eq!(
            container_of_mountinfo("1 0 0:1 / / rw - overlay overlay rw\n", UID),
            None
        );
    }

    #[test]
    fn gpus_of_a_container() {
        assert_eq!(
            container_gpus(&[devices("nvidia.com/gpu", &["GPU-a", "GPU-b::2"])]),
            Some(vec!["GPU-a".into(), "GPU-b".into()])
        );
        // Index IDs and MIG devices cannot be compared with the hello's UUID.
        assert_eq!(container_gpus(&[devices("nvidia.com/gpu", &["0"])]), None);
        assert_eq!(
            container_gpus(&[devices("nvidia.com/mig-1g.10gb", &["MIG-x"])]),
            None
        );
        // Other resources are not GPUs.
        assert_eq!(
            container_gpus(&[devices("example.com/nic", &["eth1"])]),
            Some(vec![])
        );
    }

    #[test]
    fn a_pod_holds_a_gpu_only_when_known() {
        let w = |containers: Vec<(&str, Option<Vec<&str>>)>| Workload {
            namespace: "ns".into(),
            pod: "p".into(),
            pod_uid: UID.into(),
            container_id: None,
            container: None,
            containers: containers
                .into_iter()
                .map(|(n, g)| {
                    (
                        n.into(),
                        g.map(|g| g.into_iter().map(String::from).collect()),
                    )
                })
                .collect(),
        };
        let two = w(vec![
            ("trainer", Some(vec!["GPU-a"])),
            ("sidecar", Some(vec![])),
        ]);
        assert_eq!(two.holds_gpu("GPU-a"), Some(true));
        assert_eq!(two.holds_gpu("GPU-z"), Some(false));
        assert_eq!(two.container_for("GPU-a"), "trainer");
        assert_eq!(two.container_for("GPU-z"), "");
        // No GPUs through the device plugin, or not comparable: unknown.
        assert_eq!(w(vec![("c", Some(vec![]))]).holds_gpu("GPU-a"), None);
        assert_eq!(w(vec![("c", None)]).holds_gpu("GPU-a"), None);
        assert_eq!(w(vec![("c", None)]).container_for("GPU-a"), "c");
        // With its container known, a sibling's GPU is not the process's.
        let mut known = w(vec![
            ("trainer", Some(vec!["GPU-a"])),
            ("helper", Some(vec!["GPU-b"])),
        ]);
        assert_eq!(known.holds_gpu("GPU-b"), Some(true));
        known.container = Some("trainer".into());
        assert_eq!(known.holds_gpu("GPU-b"), Some(false));
        assert_eq!(known.holds_gpu("GPU-a"), Some(true));
        assert_eq!(known.container_for("GPU-b"), "trainer");
    }

    fn pod(namespace: &str, name: &str, containers: &[(&str, &[&str])]) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: namespace.into(),
            containers: containers
                .iter()
                .map(
                    |(c, ids)| stepwatch_proto::podresources::v1::ContainerResources {
                        name: (*c).into(),
                        devices: vec![devices("nvidia.com/gpu", ids)],
                        ..Default::default()
                    },
                )
                .collect(),
        }
    }

    #[test]
    fn each_gpu_has_the_one_container_holding_it() {
        let holder = |ns: &str, p: &str, c: &str| GpuHolder {
            namespace: ns.into(),
            pod: p.into(),
            container: c.into(),
        };
        let map = gpu_holders(&[
            pod(
                "team-a",
                "trainer-0",
                &[("trainer", &["GPU-a", "GPU-b"]), ("sidecar", &[])],
            ),
            // Index IDs (DEVICE_ID_STRATEGY=index) are kept as they are.
            pod("team-b", "eval", &[("eval", &["3"])]),
            // Time-slicing: two pods share GPU-c, so it has no one holder;
            // GPU-d's two replicas are both one container's.
            pod(
                "team-c",
                "x",
                &[("x", &["GPU-c::0", "GPU-d::0", "GPU-d::1"])],
            ),
            pod("team-d", "y", &[("y", &["GPU-c::1"])]),
        ]);
        assert_eq!(
            map.get("GPU-a"),
            Some(&holder("team-a", "trainer-0", "trainer"))
        );
        assert_eq!(
            map.get("GPU-b"),
            Some(&holder("team-a", "trainer-0", "trainer"))
        );
        assert_eq!(map.get("3"), Some(&holder("team-b", "eval", "eval")));
        assert_eq!(map.get("GPU-c"), None);
        assert_eq!(map.get("GPU-d"), Some(&holder("team-c", "x", "x")));
        assert_eq!(map.len(), 4);
        // Other resources are not GPUs.
        let nic = PodResources {
            containers: vec![stepwatch_proto::podresources::v1::ContainerResources {
                name: "c".into(),
                devices: vec![devices("example.com/nic", &["eth1"])],
                ..Default::default()
            }],
            ..pod("n", "p", &[])
        };
        assert!(gpu_holders(&[nic]).is_empty());
    }

    #[test]
    fn gpu_holders_are_found_by_uuid_or_index_while_fresh() {
        let holders = GpuHolders::new(Duration::from_secs(1));
        assert_eq!(holders.max_age(), Duration::from_secs(60));
        assert_eq!(holders.holder("GPU-a", 0), None);
        holders.set(gpu_holders(&[pod("ns", "p", &[("c", &["GPU-a", "1"])])]));
        assert_eq!(holders.holder("GPU-a", 0).map(|h| h.pod), Some("p".into()));
        assert_eq!(
            holders.holder("GPU-z", 1).map(|h| h.container),
            Some("c".into())
        );
        assert_eq!(holders.holder("GPU-z", 2), None);
        // An answer past its age labels nothing.
        let stale = GpuHolders {
            max_age: Duration::ZERO,
            ..holders.clone()
        };
        assert_eq!(stale.holder("GPU-a", 0), None);
        assert_eq!(
            GpuHolders::new(Duration::from_secs(30)).max_age(),
            Duration::from_secs(120)
        );
    }
}
