//! A CSI node plugin inside the agent, for pods that may not mount hostPath.
//!
//! Namespaces under the Pod Security `baseline` (or `restricted`) level
//! cannot mount `/run/stepwatch`, but may use CSI ephemeral inline volumes.
//! With `--csi-socket` the agent serves the CSI Identity and Node services
//! there (the kubelet finds them through the node-driver-registrar). For
//! each pod that asks for a volume of this driver, NodePublishVolume creates
//! the volume's directory and, inside it, a Unix socket served by the same
//! ingest service as the shared socket, but bound to that pod: the kubelet
//! named the pod in the request (the CSIDriver's `podInfoOnMount` writes
//! `csi.storage.k8s.io/pod.*` over anything the pod's author put in the
//! volume attributes), and only that pod's containers mount the directory.
//! So the identity needs no PID lookup (it holds where the agent cannot see
//! the client's PID namespace), and the pod-resources API still gives the
//! GPUs the pod holds.
//!
//! Datadog's and SPIFFE's CSI drivers bind-mount one shared agent socket
//! into every pod; one socket per pod is what makes the pod structural
//! here. The agent mounts nothing: it only creates a directory and a socket
//! inside the kubelet's target path, so it needs neither privilege nor
//! Bidirectional mount propagation. Published volumes are written to a state
//! file next to the CSI socket and reopened when the agent restarts (the
//! kubelet does not publish a mounted volume again).

use crate::metrics;
use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use prometheus::{IntCounterVec, IntGauge, Registry};
use stepwatch_proto::csi::v1 as csi;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::ingest::{IngestService, VolumeBinding};
use crate::workload::VolumePod;

/// Name of the ingest socket inside each volume: mount the volume at
/// `/run/stepwatch` and clients find it at the default path.
pub const VOLUME_SOCKET: &str = "stepwatch.sock";

/// Connections one volume's socket holds at once: a pod runs one client
/// process per rank (8 on an 8-GPU node); with `--csi-max-volumes` this
/// bounds the descriptors all volumes can take.
const MAX_CONNECTIONS_PER_VOLUME: usize = 64;

/// Volume context keys the kubelet sets for an inline volume of a driver
/// whose CSIDriver has `podInfoOnMount: true`.
const EPHEMERAL: &str = "csi.storage.k8s.io/ephemeral";
const POD_NAME: &str = "csi.storage.k8s.io/pod.name";
const POD_NAMESPACE: &str = "csi.storage.k8s.io/pod.namespace";
const POD_UID: &str = "csi.storage.k8s.io/pod.uid";
const SERVICE_ACCOUNT: &str = "csi.storage.k8s.io/serviceAccount.name";

/// How the plugin runs (flags `--csi-*`).
#[derive(Debug, Clone)]
pub struct CsiConfig {
    /// `--csi-driver-name`: the name the CSIDriver object and pods use.
    pub driver_name: String,
    /// NodeGetInfo's node ID: the node's name.
    pub node_id: String,
    /// `--csi-max-volumes`: volumes published at once; more are refused
    /// with RESOURCE_EXHAUSTED (the kubelet retries).
    pub max_volumes: usize,
    /// Where published volumes are recorded, to reopen them at restart.
    pub state_file: PathBuf,
    /// The bounds of the volumes' ingest connections.
    pub connections: crate::listen::IngestConnections,
    /// HTTP/2 streams per connection (`--max-streams-per-connection`).
    pub streams_per_connection: Option<u32>,
}

/// The plugin: the CSI Identity and Node services over the published volumes.
#[derive(Clone)]
pub struct CsiPlugin(Arc<Inner>);

struct Inner {
    config: CsiConfig,
    ingest: IngestService,
    /// The agent's stop signal: every volume's listener stops with it.
    stop: watch::Receiver<bool>,
    volumes: Mutex<HashMap<String, Published>>,
    published: IntGauge,
    refusals: IntCounterVec,
}

/// One published volume: its socket's listener, and the switch that ends it.
struct Published {
    target: PathBuf,
    pod: Arc<VolumePod>,
    gone: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

/// A line of the state file.
#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    volume_id: String,
    target_path: PathBuf,
    pod: VolumePod,
}

/// What NodePublishVolume asks for, once checked.
#[derive(Debug, PartialEq, Eq)]
struct VolumeRequest {
    volume_id: String,
    target: PathBuf,
    pod: VolumePod,
}

/// Checks a NodePublishVolume request: a mount (not block) ephemeral inline
/// volume with its pod named. INVALID_ARGUMENT says what is missing.
fn volume_request(req: &csi::NodePublishVolumeRequest) -> Result<VolumeRequest, Status> {
    if req.volume_id.is_empty() {
        return Err(Status::invalid_argument("volume_id is required"));
    }
    let target = PathBuf::from(&req.target_path);
    if req.target_path.is_empty() || !target.is_absolute() {
        return Err(Status::invalid_argument(format!(
            "target_path must be an absolute path (got {:?})",
            req.target_path
        )));
    }
    if target
        .components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(Status::invalid_argument("target_path may not contain .."));
    }
    match req.volume_capability.as_ref().map(|c| &c.access_type) {
        Some(Some(csi::volume_capability::AccessType::Mount(_))) => {}
        Some(Some(csi::volume_capability::AccessType::Block(_))) => {
            return Err(Status::invalid_argument(
                "block volumes are not supported; this driver publishes a directory",
            ))
        }
        _ => {
            return Err(Status::invalid_argument(
                "volume_capability with a mount access type is required",
            ))
        }
    }
    let ctx = &req.volume_context;
    if ctx.get(EPHEMERAL).map(String::as_str) != Some("true") {
        return Err(Status::invalid_argument(format!(
            "only CSI ephemeral inline volumes are supported ({EPHEMERAL} must be \"true\"; \
             use a `csi:` volume in the pod spec, not a PersistentVolume)"
        )));
    }
    let field = |key: &str| -> Result<String, Status> {
        let value = ctx.get(key).map(String::as_str).unwrap_or("");
        // Names and UIDs are DNS subdomains/labels or UUIDs; anything else
        // did not come from the kubelet.
        let sane = !value.is_empty()
            && value.len() <= 253
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.'));
        if sane {
            Ok(value.to_owned())
        } else {
            Err(Status::invalid_argument(format!(
                "volume_context {key} is missing or not a Kubernetes name ({value:?}); \
                 the CSIDriver object must set podInfoOnMount: true"
            )))
        }
    };
    Ok(VolumeRequest {
        volume_id: req.volume_id.clone(),
        target,
        pod: VolumePod {
            namespace: field(POD_NAMESPACE)?,
            pod: field(POD_NAME)?,
            pod_uid: field(POD_UID)?,
            service_account: ctx.get(SERVICE_ACCOUNT).cloned().unwrap_or_default(),
        },
    })
}

impl CsiPlugin {
    /// A plugin serving `ingest` in each volume; registers its metrics.
    pub fn new(
        config: CsiConfig,
        ingest: IngestService,
        stop: watch::Receiver<bool>,
        registry: &Registry,
    ) -> prometheus::Result<Self> {
        let published = IntGauge::new(metrics::CSI_VOLUMES.name, metrics::CSI_VOLUMES.help)?;
        let refusals = IntCounterVec::new(metrics::CSI_PUBLISH_REFUSALS_TOTAL.opts(), &["reason"])?;
        for reason in [
            "invalid_argument",
            "too_many_volumes",
            "conflict",
            "io_error",
        ] {
            refusals.with_label_values(&[reason]);
        }
        registry.register(Box::new(published.clone()))?;
        registry.register(Box::new(refusals.clone()))?;
        Ok(Self(Arc::new(Inner {
            config,
            ingest,
            stop,
            volumes: Mutex::new(HashMap::new()),
            published,
            refusals,
        })))
    }

    /// Reopens the volumes of the state file whose directories are still
    /// there (the kubelet does not publish a mounted volume again after an
    /// agent restart); the others were unpublished while the agent was down.
    pub fn restore(&self) {
        let text = match std::fs::read_to_string(&self.0.config.state_file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(path = %self.0.config.state_file.display(), error = %e, "cannot read the CSI volume state; published volumes' sockets are not reopened until the kubelet publishes them again");
                return;
            }
        };
        let mut reopened = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(record) = serde_json::from_str::<Record>(line) else {
                tracing::warn!(line, "skipping an unreadable line of the CSI volume state");
                continue;
            };
            if !record.target_path.is_dir() {
                continue;
            }
            let mut volumes = self.0.volumes.lock().expect("not poisoned");
            match self.open(&record.target_path, Arc::new(record.pod)) {
                Ok(p) => {
                    volumes.insert(record.volume_id, p);
                    reopened += 1;
                }
                Err(status) => {
                    tracing::warn!(volume = %record.volume_id, target = %record.target_path.display(), error = status.message(), "cannot reopen a published CSI volume's socket")
                }
            }
        }
        let volumes = self.0.volumes.lock().expect("not poisoned");
        self.0.published.set(volumes.len() as i64);
        self.save(&volumes);
        tracing::info!(volumes = reopened, "reopened published CSI volumes");
    }

    fn refuse(&self, reason: &str, status: Status) -> Status {
        self.0.refusals.with_label_values(&[reason]).inc();
        tracing::warn!(
            reason,
            code = ?status.code(),
            "refused NodePublishVolume: {}",
            status.message()
        );
        status
    }

    fn publish(&self, req: &csi::NodePublishVolumeRequest) -> Result<(), Status> {
        let want = volume_request(req).map_err(|s| self.refuse("invalid_argument", s))?;
        let mut volumes = self.0.volumes.lock().expect("not poisoned");
        if let Some(p) = volumes.get(&want.volume_id) {
            if p.target != want.target || *p.pod != want.pod {
                return Err(self.refuse(
                    "conflict",
                    Status::already_exists(format!(
                        "volume {} is already published at {} for pod {}/{}",
                        want.volume_id,
                        p.target.display(),
                        p.pod.namespace,
                        p.pod.pod
                    )),
                ));
            }
            // Published already (a retry, or a republish): idempotent, but a
            // listener that ended, or a socket someone removed, is renewed.
            if !p.server.is_finished() && p.target.join(VOLUME_SOCKET).exists() {
                return Ok(());
            }
            let old = volumes.remove(&want.volume_id).expect("just found");
            let _ = old.gone.send(true);
        } else if volumes.len() >= self.0.config.max_volumes {
            return Err(self.refuse(
                "too_many_volumes",
                Status::resource_exhausted(format!(
                    "{} stepwatch volumes are published on this node already (--csi-max-volumes)",
                    volumes.len()
                )),
            ));
        }
        let pod = Arc::new(want.pod);
        let published = self
            .open(&want.target, pod.clone())
            .map_err(|s| self.refuse("io_error", s))?;
        volumes.insert(want.volume_id.clone(), published);
        self.0.published.set(volumes.len() as i64);
        self.save(&volumes);
        tracing::info!(volume = %want.volume_id, namespace = %pod.namespace, pod = %pod.pod, service_account = %pod.service_account, target = %want.target.display(), readonly = req.readonly, "published a stepwatch volume: its socket's clients are this pod's");
        Ok(())
    }

    /// Creates `target` and the ingest socket in it, and serves it.
    fn open(&self, target: &Path, pod: Arc<VolumePod>) -> Result<Published, Status> {
        let io = |what: &str, e: &dyn std::fmt::Display| {
            Status::internal(format!("cannot {what} {}: {e}", target.display()))
        };
        std::fs::create_dir_all(target).map_err(|e| io("create", &e))?;
        // Readable and searchable by the pod's users, whatever their UID;
        // writable by the agent only. Clients need write permission on the
        // socket (0666), not on the directory or the mount: a read-only
        // volume works.
        std::fs::set_permissions(target, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| io("set the mode of", &e))?;
        // The kubelet's target path (`/var/lib/kubelet/pods/<uid>/volumes/
        // kubernetes.io~csi/<name>/mount`) with the socket's name is longer
        // than a socket address holds (107 bytes); bind through the
        // directory's descriptor instead. Clients connect at their own,
        // short, mount path.
        let dir = std::fs::File::open(target).map_err(|e| io("open", &e))?;
        let socket = socket_path(target, &dir);
        let listener =
            crate::bind_socket(&socket, 0o666).map_err(|e| io("listen in", &format!("{e:#}")))?;
        drop(dir);
        let (gone, gone_rx) = watch::channel(false);
        let service = self.0.ingest.bound_to(VolumeBinding {
            pod: pod.clone(),
            gone: gone_rx.clone(),
        });
        let (mut stop, mut unpublished) = (self.0.stop.clone(), gone_rx);
        let shutdown = async move {
            tokio::select! {
                _ = stop.changed() => {}
                _ = unpublished.wait_for(|g| *g) => {}
            }
        };
        let incoming = (self.0.config.connections)
            .limit(listener, MAX_CONNECTIONS_PER_VOLUME, "ingest_volume")
            .into_incoming();
        let server = crate::grpc_server(self.0.config.streams_per_connection)
            .add_service(crate::ingest_server(service))
            .serve_with_incoming_shutdown(incoming, shutdown);
        let server = tokio::spawn(async move {
            if let Err(e) = server.await {
                tracing::warn!(error = %e, "a CSI volume's ingest listener failed");
            }
        });
        Ok(Published {
            target: target.to_owned(),
            pod,
            gone,
            server,
        })
    }

    fn unpublish(&self, req: &csi::NodeUnpublishVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if req.target_path.is_empty() {
            return Err(Status::invalid_argument("target_path is required"));
        }
        let mut volumes = self.0.volumes.lock().expect("not poisoned");
        let requested = PathBuf::from(&req.target_path);
        let target = match volumes.remove(&req.volume_id) {
            Some(p) => {
                // Ends the listener and every stream on it.
                let _ = p.gone.send(true);
                self.0.published.set(volumes.len() as i64);
                self.save(&volumes);
                tracing::info!(volume = %req.volume_id, namespace = %p.pod.namespace, pod = %p.pod.pod, "unpublished a stepwatch volume");
                if p.target != requested {
                    tracing::warn!(volume = %req.volume_id, published = %p.target.display(), asked = %requested.display(), "NodeUnpublishVolume named another target path than the one published; cleaning the published one");
                }
                p.target
            }
            // Unknown (already unpublished, or lost with the state file):
            // success, after cleaning what may be ours, so that the kubelet
            // can finish tearing the pod down (an error would be retried
            // for ever).
            None => requested,
        };
        remove_volume_dir(&target)
            .map_err(|e| Status::internal(format!("cannot clean up {}: {e}", target.display())))
    }

    /// Writes the published volumes, one JSON line each, atomically; a
    /// failure is logged (the volumes work, only a restart loses them).
    fn save(&self, volumes: &HashMap<String, Published>) {
        let mut records: Vec<Record> = volumes
            .iter()
            .map(|(id, p)| Record {
                volume_id: id.clone(),
                target_path: p.target.clone(),
                pod: (*p.pod).clone(),
            })
            .collect();
        records.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
        let mut text = String::new();
        for r in &records {
            text.push_str(&serde_json::to_string(r).expect("plain strings serialise"));
            text.push('\n');
        }
        if let Err(e) = crate::write_atomically(&self.0.config.state_file, text.as_bytes()) {
            tracing::warn!(path = %self.0.config.state_file.display(), error = %e, "cannot write the CSI volume state; an agent restart will not reopen the published volumes");
        }
    }
}

/// Longest path a Unix socket address holds (108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The path to bind the volume's socket at: the real one when it fits a
/// socket address, else one through `/proc/self/fd/<dir>` (as long as `dir`
/// stays open).
fn socket_path(target: &Path, dir: &std::fs::File) -> PathBuf {
    use std::os::fd::AsRawFd;
    let real = target.join(VOLUME_SOCKET);
    if real.as_os_str().len() <= MAX_SOCKET_PATH {
        return real;
    }
    PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(VOLUME_SOCKET)
}

/// Removes the volume's socket and then its directory; what is already gone
/// is fine. Only a socket is removed: anything else in the directory is
/// someone else's, and the directory is then left (logged).
fn remove_volume_dir(target: &Path) -> std::io::Result<()> {
    let socket = target.join(VOLUME_SOCKET);
    match std::fs::symlink_metadata(&socket) {
        Ok(meta) if meta.file_type().is_socket() => match std::fs::remove_file(&socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        },
        _ => {}
    }
    match std::fs::remove_dir(target) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
            tracing::warn!(target = %target.display(), "a stepwatch volume's directory holds files that are not its socket; left in place");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

#[tonic::async_trait]
impl csi::identity_server::Identity for CsiPlugin {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: self.0.config.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    /// No capability: no Controller service (volumes are ephemeral and
    /// node-local), no topology.
    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::GetPluginCapabilitiesResponse::default()))
    }

    async fn probe(
        &self,
        _: Request<csi::ProbeRequest>,
    ) -> Result<Response<csi::ProbeResponse>, Status> {
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}

/// What a call needing a capability this driver does not offer gets.
fn not_offered<T>(capability: &str) -> Result<T, Status> {
    Err(Status::unimplemented(format!(
        "{capability} is not a capability of this driver"
    )))
}

#[tonic::async_trait]
impl csi::node_server::Node for CsiPlugin {
    async fn node_stage_volume(
        &self,
        _: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        not_offered("STAGE_UNSTAGE_VOLUME")
    }

    async fn node_unstage_volume(
        &self,
        _: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        not_offered("STAGE_UNSTAGE_VOLUME")
    }

    async fn node_publish_volume(
        &self,
        request: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        self.publish(request.get_ref())?;
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        self.unpublish(request.get_ref())?;
        Ok(Response::new(csi::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        not_offered("GET_VOLUME_STATS")
    }

    /// No capability: publish and unpublish only.
    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(csi::NodeGetCapabilitiesResponse::default()))
    }

    /// The node's name; no volume limit for the scheduler (the agent
    /// bounds volumes itself) and no topology.
    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.0.config.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(context: &[(&str, &str)]) -> csi::NodePublishVolumeRequest {
        csi::NodePublishVolumeRequest {
            volume_id: "csi-0123abcd".into(),
            target_path: "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/stepwatch/mount".into(),
            volume_capability: Some(csi::VolumeCapability {
                access_mode: None,
                access_type: Some(csi::volume_capability::AccessType::Mount(Default::default())),
            }),
            volume_context: context
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    const POD_INFO: [(&str, &str); 5] = [
        (EPHEMERAL, "true"),
        (POD_NAMESPACE, "team-a"),
        (POD_NAME, "trainer-0"),
        (POD_UID, "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"),
        (SERVICE_ACCOUNT, "default"),
    ];

    #[test]
    fn an_ephemeral_volume_names_its_pod() {
        let got = volume_request(&request(&POD_INFO)).unwrap();
        assert_eq!(
            got.pod,
            VolumePod {
                namespace: "team-a".into(),
                pod: "trainer-0".into(),
                pod_uid: "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0".into(),
                service_account: "default".into(),
            }
        );
        assert_eq!(got.volume_id, "csi-0123abcd");
    }

    #[test]
    fn requests_the_driver_cannot_serve_are_invalid() {
        let code = |r: csi::NodePublishVolumeRequest| volume_request(&r).unwrap_err().code();
        // A PersistentVolume of this driver, or a driver without podInfoOnMount.
        let mut not_ephemeral = POD_INFO;
        not_ephemeral[0].1 = "false";
        assert_eq!(code(request(&not_ephemeral)), tonic::Code::InvalidArgument);
        assert_eq!(code(request(&POD_INFO[1..])), tonic::Code::InvalidArgument);
        for missing in 1..4 {
            let mut ctx = POD_INFO.to_vec();
            ctx.remove(missing);
            assert_eq!(code(request(&ctx)), tonic::Code::InvalidArgument);
        }
        // A name no kubelet would send.
        let mut odd = POD_INFO;
        odd[2].1 = "../../etc";
        assert_eq!(code(request(&odd)), tonic::Code::InvalidArgument);
        let mut r = request(&POD_INFO);
        r.target_path = "relative/path".into();
        assert_eq!(code(r), tonic::Code::InvalidArgument);
        let mut r = request(&POD_INFO);
        r.target_path = "/var/lib/kubelet/pods/../../etc".into();
        assert_eq!(code(r), tonic::Code::InvalidArgument);
        let mut r = request(&POD_INFO);
        r.volume_id.clear();
        assert_eq!(code(r), tonic::Code::InvalidArgument);
        let mut r = request(&POD_INFO);
        r.volume_capability = None;
        assert_eq!(code(r), tonic::Code::InvalidArgument);
        let mut r = request(&POD_INFO);
        r.volume_capability = Some(csi::VolumeCapability {
            access_mode: None,
            access_type: Some(csi::volume_capability::AccessType::Block(Default::default())),
        });
        assert_eq!(code(r), tonic::Code::InvalidArgument);
    }

    #[test]
    fn cleaning_up_leaves_what_is_not_ours() {
        let dir = std::env::temp_dir().join(format!("stepwatch-csi-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // Nothing there: fine (idempotent).
        remove_volume_dir(&dir).unwrap();
        // Our socket: removed with the directory.
        std::fs::create_dir_all(&dir).unwrap();
        let listener = std::os::unix::net::UnixListener::bind(dir.join(VOLUME_SOCKET)).unwrap();
        remove_volume_dir(&dir).unwrap();
        assert!(!dir.exists());
        drop(listener);
        // A regular file of that name is someone else's: kept, and the directory too.
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(VOLUME_SOCKET), b"not a socket").unwrap();
        remove_volume_dir(&dir).unwrap();
        assert!(dir.join(VOLUME_SOCKET).is_file());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
