//! The CSI ephemeral inline volume end to end: the real agent with
//! `--csi-socket`, this test playing the kubelet (a client of the CSI
//! Identity and Node services, from the same generated code) and its
//! pod-resources API (a fake server from the real v1 proto), and clients
//! connecting through the socket in the published volume.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::kubelet::FakeKubelet;
use common::{Agent, Metrics, TempDir};
use serde_json::Value;
use stepwatch_proto::csi::v1::{
    identity_client::IdentityClient, node_client::NodeClient, volume_capability,
    GetPluginCapabilitiesRequest, GetPluginInfoRequest, NodeGetCapabilitiesRequest,
    NodeGetInfoRequest, NodePublishVolumeRequest, NodeStageVolumeRequest,
    NodeUnpublishVolumeRequest, ProbeRequest, VolumeCapability,
};
use stepwatch_proto::podresources::v1::{
    pod_resources_lister_server::PodResourcesListerServer, ContainerDevices, ContainerResources,
    PodResources,
};
use stepwatch_proto::v1::{
    client_message::Kind, ingest_client::IngestClient, AgentMessage, ClientMessage, Hello, Identity,
};
use tonic::transport::Channel;
use tonic::{Code, Response, Status, Streaming};

const WAIT: Duration = Duration::from_secs(30);
const UID_A: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
const UID_B: &str = "1a2b3c4d-5e6f-7081-92a3-b4c5d6e7f809";

fn gpu(index: u32) -> String {
    fake_nvml::GpuSpec::h100_80gb(index).uuid
}

/// The pod-resources API: pod team-a/trainer-0 holds GPU 0.
fn team_a_kubelet() -> FakeKubelet {
    FakeKubelet::with_pods(vec![PodResources {
        name: "trainer-0".into(),
        namespace: "team-a".into(),
        containers: vec![ContainerResources {
            name: "trainer".into(),
            devices: vec![ContainerDevices {
                resource_name: "nvidia.com/gpu".into(),
                device_ids: vec![gpu(0)],
                topology: None,
            }],
            ..Default::default()
        }],
    }])
}

/// A node: the kubelet's directories, its pod-resources API, and the agent
/// serving CSI on a socket that outlives it (for the restart test).
struct Node {
    root: TempDir,
    rt: tokio::runtime::Runtime,
    agent: Agent,
    args: Vec<String>,
}

impl Node {
    fn start(tag: &str, extra: &[&str]) -> Self {
        let root = TempDir::new(&format!("{tag}-node"));
        for dir in ["proc", "logs", "plugins/csi.stepwatch.dev"] {
            std::fs::create_dir_all(root.0.join(dir)).unwrap();
        }
        let rt = tokio::runtime::Runtime::new().unwrap();
        let kubelet = root.0.join("kubelet.sock");
        let listener = rt.block_on(async { tokio::net::UnixListener::bind(&kubelet).unwrap() });
        rt.spawn(
            tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(team_a_kubelet()))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
        );
        let mut args: Vec<String> = [
            "--csi-socket",
            &root
                .0
                .join("plugins/csi.stepwatch.dev/csi.sock")
                .display()
                .to_string(),
            "--pod-resources-socket",
            &kubelet.display().to_string(),
            "--proc-root",
            &root.0.join("proc").display().to_string(),
            "--pod-logs-dir",
            &root.0.join("logs").display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let agent = start_agent(tag, &args);
        Node {
            root,
            rt,
            agent,
            args,
        }
    }

    /// The kubelet's side of the CSI socket.
    fn csi(&self) -> (IdentityClient<Channel>, NodeClient<Channel>) {
        let path = self.root.0.join("plugins/csi.stepwatch.dev/csi.sock");
        let channel = self.rt.block_on(async {
            tonic::transport::Endpoint::from_shared(format!("unix://{}", path.display()))
                .unwrap()
                .connect()
                .await
                .unwrap()
        });
        (
            IdentityClient::new(channel.clone()),
            NodeClient::new(channel),
        )
    }

    /// The target path the kubelet would pass for pod `uid`'s volume
    /// `stepwatch`; like the kubelet, the test makes its parent.
    fn target(&self, uid: &str) -> PathBuf {
        let target = self
            .root
            .0
            .join("kubelet/pods")
            .join(uid)
            .join("volumes/kubernetes.io~csi/stepwatch/mount");
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        target
    }

    fn publish(&self, request: NodePublishVolumeRequest) -> Result<(), Code> {
        let (_, mut node) = self.csi();
        self.rt
            .block_on(node.node_publish_volume(request))
            .map(drop)
            .map_err(|s| s.code())
    }

    fn unpublish(&self, volume_id: &str, target: &Path) -> Result<(), Code> {
        let (_, mut node) = self.csi();
        self.rt
            .block_on(node.node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: volume_id.into(),
                target_path: target.display().to_string(),
            }))
            .map(drop)
            .map_err(|s| s.code())
    }

    fn api(&self, path: &str) -> (u16, Value) {
        let (code, body) = self.agent.get(path);
        (code, serde_json::from_str(&body).unwrap_or(Value::Null))
    }
}

fn start_agent(tag: &str, args: &[String]) -> Agent {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Agent::start_with(tag, 2, &args, |_| {})
}

/// NodePublishVolume as the kubelet sends it for an inline volume of a
/// driver with `podInfoOnMount: true`.
fn publish_request(volume_id: &str, target: &Path, uid: &str) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.display().to_string(),
        volume_capability: Some(VolumeCapability {
            access_mode: None,
            access_type: Some(volume_capability::AccessType::Mount(Default::default())),
        }),
        readonly: true,
        volume_context: [
            ("csi.storage.k8s.io/ephemeral", "true"),
            ("csi.storage.k8s.io/pod.namespace", "team-a"),
            ("csi.storage.k8s.io/pod.name", "trainer-0"),
            ("csi.storage.k8s.io/pod.uid", uid),
            ("csi.storage.k8s.io/serviceAccount.name", "default"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        ..Default::default()
    }
}

/// A client in the pod: a stream through the volume's socket, with a hello
/// claiming `namespace`/`pod` and two steps, held open while the sender lives.
struct Rank {
    _dir: std::fs::File,
    tx: Option<tokio::sync::mpsc::Sender<ClientMessage>>,
    inbound: Result<Streaming<AgentMessage>, Status>,
}

impl Rank {
    fn open(node: &Node, target: &Path, claim: (&str, &str), job: &str, gpu: String) -> Self {
        // The pod connects at its short mount path; the test reaches the
        // long host path through the directory's descriptor.
        let dir = std::fs::File::open(target).unwrap();
        let endpoint = format!(
            "unix:///proc/self/fd/{}/stepwatch.sock",
            std::os::fd::AsRawFd::as_raw_fd(&dir)
        );
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let inbound = node.rt.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(endpoint)
                .unwrap()
                .connect()
                .await
                .unwrap();
            tx.send(ClientMessage {
                kind: Some(Kind::Hello(Hello {
                    identity: Some(Identity {
                        job_id: job.into(),
                        rank: 0,
                        world_size: 1,
                        namespace: claim.0.into(),
                        pod: claim.1.into(),
                        ..Default::default()
                    }),
                    gpu_uuid: gpu,
                    pid: 1,
                    ..Default::default()
                })),
            })
            .await
            .unwrap();
            let t0 = stepwatch_proto::clock::monotonic_ns();
            for step in 1..=2 {
                tx.send(common::wire::batch(common::wire::step(
                    step,
                    t0 + step * 1_000_000,
                )))
                .await
                .unwrap();
            }
            IngestClient::new(channel)
                .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .map(Response::into_inner)
        });
        Rank {
            _dir: dir,
            tx: Some(tx),
            inbound,
        }
    }

    /// How the stream ended: "Ok" or the gRPC code; "still open" after [`WAIT`].
    fn ended(&mut self, node: &Node) -> String {
        let inbound = match &mut self.inbound {
            Ok(inbound) => inbound,
            Err(status) => return format!("{:?}", status.code()),
        };
        node.rt.block_on(async {
            let wait = async {
                loop {
                    match inbound.message().await {
                        Ok(Some(_)) => continue,
                        Ok(None) => return "Ok".to_string(),
                        Err(status) => return format!("{:?}", status.code()),
                    }
                }
            };
            tokio::time::timeout(WAIT, wait)
                .await
                .unwrap_or_else(|_| "still open".into())
        })
    }

    /// Half-closes; the agent then ends the stream.
    fn close(&mut self, node: &Node) -> String {
        drop(self.tx.take());
        self.ended(node)
    }
}

fn steps_done(node: &Node, job: &str) -> bool {
    let (code, rank) = node.api(&format!("/api/v1/jobs/{job}/ranks/0?namespace=team-a"));
    code == 200 && rank["steps_completed"] == 2
}

#[test]
fn a_pods_volume_socket_carries_the_pod_the_kubelet_named() {
    let node = Node::start("csi-identity", &[]);
    let (mut identity, mut csi_node) = node.csi();
    let (info, caps, probe, node_caps, node_info) = node.rt.block_on(async {
        (
            identity
                .get_plugin_info(GetPluginInfoRequest {})
                .await
                .unwrap()
                .into_inner(),
            identity
                .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
                .await
                .unwrap()
                .into_inner(),
            identity.probe(ProbeRequest {}).await.unwrap().into_inner(),
            csi_node
                .node_get_capabilities(NodeGetCapabilitiesRequest {})
                .await
                .unwrap()
                .into_inner(),
            csi_node
                .node_get_info(NodeGetInfoRequest {})
                .await
                .unwrap()
                .into_inner(),
        )
    });
    assert_eq!(info.name, "csi.stepwatch.dev");
    assert!(!info.vendor_version.is_empty());
    // No Controller service, no stage/unstage: the kubelet publishes directly.
    assert!(caps.capabilities.is_empty(), "{caps:?}");
    assert_eq!(probe.ready, Some(true));
    assert!(node_caps.capabilities.is_empty(), "{node_caps:?}");
    assert_eq!(node_info.node_id, "test-node");

    let target = node.target(UID_A);
    // A read-only volume: the agent mounts nothing, and connect(2) needs
    // write permission on the socket (0666), not on the mount.
    node.publish(publish_request("csi-a", &target, UID_A))
        .unwrap();
    let socket = target.join("stepwatch.sock");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&socket), 0o666);
    assert_eq!(mode(&target), 0o755);
    // The kubelet may repeat a publish: the same answer, the same socket.
    node.publish(publish_request("csi-a", &target, UID_A))
        .unwrap();

    // A GPU the pod does not hold is refused on its own socket too.
    let mut spoof = Rank::open(&node, &target, ("", ""), "spoof", gpu(1));
    assert_eq!(spoof.ended(&node), "PermissionDenied");

    // A hello claiming another namespace and pod: the volume's pod is used.
    let mut rank = Rank::open(&node, &target, ("team-b", "intruder"), "j", gpu(0));
    common::wait_until("rank 0's two steps", WAIT, || steps_done(&node, "j"));
    let (_, body) = node.api("/api/v1/jobs/j/ranks/0?namespace=team-a");
    assert_eq!(body["info"]["pod"], "trainer-0", "{body}");
    assert_eq!(body["info"]["attested"], true, "{body}");
    assert_eq!(body["info"]["container"], "trainer", "{body}");
    assert_eq!(body["connected"], true, "{body}");
    let (code, _) = node.api("/api/v1/jobs/j?namespace=team-b");
    assert_eq!(code, 404);
    let m = Metrics(node.agent.metrics());
    for field in ["namespace", "pod"] {
        assert_eq!(
            m.get(
                "stepwatch_workload_identity_mismatches_total",
                &[("field", field)]
            ),
            Some(1.0),
            "{field}"
        );
    }
    assert_eq!(
        m.get(
            "stepwatch_workload_attestations_total",
            &[("result", "csi_volume")]
        ),
        Some(2.0)
    );
    assert_eq!(m.get("stepwatch_csi_volumes", &[]), Some(1.0));

    // Unpublished: the stream ends, the socket and directory go, the rank
    // is disconnected; a second unpublish is fine.
    node.unpublish("csi-a", &target).unwrap();
    assert_eq!(rank.ended(&node), "Unavailable");
    assert!(!target.exists(), "{} is left", target.display());
    common::wait_until("the rank to disconnect", WAIT, || {
        node.api("/api/v1/jobs/j/ranks/0?namespace=team-a").1["connected"] == false
    });
    node.unpublish("csi-a", &target).unwrap();
    let m = Metrics(node.agent.metrics());
    assert_eq!(m.get("stepwatch_csi_volumes", &[]), Some(0.0));
}

#[test]
fn publish_requests_the_driver_cannot_serve_get_their_codes() {
    let node = Node::start("csi-errors", &["--csi-max-volumes", "1"]);
    let target = node.target(UID_A);
    let with = |f: &dyn Fn(&mut NodePublishVolumeRequest)| {
        let mut r = publish_request("csi-a", &target, UID_A);
        f(&mut r);
        node.publish(r)
    };
    // No target path.
    assert_eq!(with(&|r| r.target_path.clear()), Err(Code::InvalidArgument));
    // A PersistentVolume of this driver, not an inline ephemeral volume.
    assert_eq!(
        with(&|r| {
            r.volume_context
                .insert("csi.storage.k8s.io/ephemeral".into(), "false".into());
        }),
        Err(Code::InvalidArgument)
    );
    // No pod info (a CSIDriver without podInfoOnMount).
    assert_eq!(
        with(&|r| r.volume_context.retain(|k, _| k.ends_with("ephemeral"))),
        Err(Code::InvalidArgument)
    );
    // A block volume.
    assert_eq!(
        with(&|r| {
            r.volume_capability = Some(VolumeCapability {
                access_mode: None,
                access_type: Some(volume_capability::AccessType::Block(Default::default())),
            })
        }),
        Err(Code::InvalidArgument)
    );
    assert!(
        !target.exists(),
        "a refused publish made {}",
        target.display()
    );
    node.publish(publish_request("csi-a", &target, UID_A))
        .unwrap();
    // The same volume at another path; a second volume past --csi-max-volumes.
    let other = node.target(UID_B);
    assert_eq!(
        node.publish(publish_request("csi-a", &other, UID_A)),
        Err(Code::AlreadyExists)
    );
    assert_eq!(
        node.publish(publish_request("csi-b", &other, UID_B)),
        Err(Code::ResourceExhausted)
    );
    // Unpublish needs its volume and path; staging is not a capability.
    assert_eq!(node.unpublish("", &target), Err(Code::InvalidArgument));
    let (_, mut csi_node) = node.csi();
    let stage = node
        .rt
        .block_on(csi_node.node_stage_volume(NodeStageVolumeRequest::default()));
    assert_eq!(stage.unwrap_err().code(), Code::Unimplemented);
    let m = Metrics(node.agent.metrics());
    for (reason, n) in [
        ("invalid_argument", 4.0),
        ("conflict", 1.0),
        ("too_many_volumes", 1.0),
        ("io_error", 0.0),
    ] {
        assert_eq!(
            m.get(
                "stepwatch_csi_publish_refusals_total",
                &[("reason", reason)]
            ),
            Some(n),
            "{reason}"
        );
    }
    // Once one is unpublished, there is room again.
    node.unpublish("csi-a", &target).unwrap();
    node.publish(publish_request("csi-b", &other, UID_B))
        .unwrap();
}

#[test]
fn published_volumes_are_reopened_when_the_agent_restarts() {
    let mut node = Node::start("csi-restart", &[]);
    let target = node.target(UID_A);
    node.publish(publish_request("csi-a", &target, UID_A))
        .unwrap();
    assert_eq!(node.agent.terminate().code(), Some(0));
    // The kubelet does not publish a mounted volume again; the new agent
    // reopens it from its state file.
    node.agent = start_agent("csi-restart-2", &node.args);
    let mut rank = Rank::open(&node, &target, ("", ""), "after", gpu(0));
    common::wait_until("the rank's two steps", WAIT, || steps_done(&node, "after"));
    let (_, body) = node.api("/api/v1/jobs/after/ranks/0?namespace=team-a");
    assert_eq!(body["info"]["pod"], "trainer-0", "{body}");
    assert_eq!(rank.close(&node), "Ok");
    node.unpublish("csi-a", &target).unwrap();
    assert!(!target.exists());
}
