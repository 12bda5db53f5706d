//! Pod attribution end to end: the real agent, a fake kubelet serving the
//! real pod-resources v1 API on a Unix socket, fixture `/proc/<pid>/cgroup`
//! files (tests/fixtures/cgroup, one per runtime and cgroup layout) and
//! pod log directories, and clients that are separate processes (this test
//! binary run again as `client_process`), so that each has its own PID for
//! SO_PEERCRED.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};

use std::time::Duration;

use common::kubelet::FakeKubelet;
use common::{Agent, Metrics};
use serde_json::Value;
use stepwatch_proto::podresources::v1::{
    pod_resources_lister_server::PodResourcesListerServer, ContainerDevices, ContainerResources,
    PodResources,
};

const WAIT: Duration = Duration::from_secs(30);
const CONTAINER_ID: &str = "3f4e1b2c9a8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";

fn gpu(index: u32) -> String {
    fake_nvml::GpuSpec::h100_80gb(index).uuid
}

/// A node: /proc and /var/log/pods fixtures, a fake kubelet, and an agent
/// pointed at them.
struct Node {
    root: common::TempDir,
    kubelet: FakeKubelet,
    agent: Agent,
}

impl Node {
    fn start(tag: &str) -> Self {
        Self::start_with_socket(tag, true, &[])
    }

    /// A node whose one pod, team-a/trainer-0 (UID_A), has a container
    /// `trainer` holding GPU 0.
    fn with_trainer(tag: &str) -> Self {
        let node = Self::start(tag);
        node.add_pod("team-a", "trainer-0", UID_A, &[("trainer", &[gpu(0)])]);
        node
    }

    /// The chart's default install: the agent runs unprivileged, so the
    /// kubelet's pod-resources socket (root's) is not mounted; it has /proc
    /// (hostPID) and the pod log directories.
    fn start_unprivileged(tag: &str) -> Self {
        Self::start_with_socket(tag, false, &[])
    }

    /// `extra` are more agent flags.
    fn start_with_socket(tag: &str, pod_resources: bool, extra: &[&str]) -> Self {
        let root = common::TempDir::new(&format!("{tag}-node"));
        for dir in ["proc", "pods"] {
            std::fs::create_dir_all(root.0.join(dir)).unwrap();
        }
        let kubelet = FakeKubelet::default();
        let socket = root.0.join("kubelet.sock");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let server = kubelet.clone();
        let path = socket.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::UnixListener::bind(&path).unwrap();
                ready_tx.send(()).unwrap();
                tonic::transport::Server::builder()
                    .add_service(PodResourcesListerServer::new(server))
                    .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
                    .await
                    .unwrap();
            });
        });
        ready_rx.recv().unwrap();
        let proc_root = root.0.join("proc");
        let pods = root.0.join("pods");
        let socket = if pod_resources {
            socket
        } else {
            root.0.join("not-mounted").join("kubelet.sock")
        };
        let args = [
            "--proc-root".to_string(),
            proc_root.display().to_string(),
            "--pod-resources-socket".to_string(),
            socket.display().to_string(),
            "--pod-logs-dir".to_string(),
            pods.display().to_string(),
            // GPU holders are asked for every 200 ms, so tests wait little.
            "--pod-resources-refresh".to_string(),
            "200ms".to_string(),
        ];
        let args: Vec<&str> = args
            .iter()
            .map(String::as_str)
            .chain(extra.iter().copied())
            .collect();
        let agent = Agent::start_with(tag, 2, &args, |_| {});
        Node {
            root,
            kubelet,
            agent,
        }
    }

    /// A pod the kubelet knows: its log directory and its `List` entry, with
    /// `containers` as (name, GPU UUIDs).
    fn add_pod(&self, namespace: &str, name: &str, uid: &str, containers: &[(&str, &[String])]) {
        std::fs::create_dir_all(
            self.root
                .0
                .join("pods")
                .join(format!("{namespace}_{name}_{uid}")),
        )
        .unwrap();
        self.kubelet.pods.lock().unwrap().push(PodResources {
            name: name.into(),
            namespace: namespace.into(),
            containers: containers
                .iter()
                .map(|(c, gpus)| ContainerResources {
                    name: (*c).into(),
                    devices: vec![ContainerDevices {
                        resource_name: "nvidia.com/gpu".into(),
                        device_ids: gpus.to_vec(),
                        topology: None,
                    }],
                    ..Default::default()
                })
                .collect(),
        });
    }

    /// Puts process `pid` in pod `uid`, with the cgroup file of `layout`
    /// (a file of tests/fixtures/cgroup).
    fn place(&self, pid: u32, uid: &str, layout: &str) {
        let template = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/cgroup")
                .join(format!("{layout}.txt")),
        )
        .unwrap();
        let text = template
            .replace("{uid_}", &uid.replace('-', "_"))
            .replace("{uid}", uid)
            .replace("{id}", CONTAINER_ID);
        let dir = self.root.0.join("proc").join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup"), text).unwrap();
    }

    /// [`Node::place`], and the mounts of container `container`, with the
    /// termination-log bind mount the kubelet makes for each container.
    /// A client of `claim` in pod `uid` (cgroup `layout`), connected.
    fn client(&self, claim: &Claim, uid: &str, layout: &str) -> Client {
        let mut client = Client::spawn(&self.agent, claim);
        self.place(client.pid(), uid, layout);
        client.go();
        client
    }

    /// [`Node::client`] in the pod's `container`.
    fn client_in(&self, claim: &Claim, uid: &str, layout: &str, container: &str) -> Client {
        let mut client = Client::spawn(&self.agent, claim);
        self.place_in(client.pid(), uid, layout, container);
        client.go();
        client
    }

    fn place_in(&self, pid: u32, uid: &str, layout: &str, container: &str) {
        self.place(pid, uid, layout);
        let mountinfo = format!(
            "1201 1200 0:512 / / rw,relatime - overlay overlay rw\n\
             1210 1200 259:1 /var/lib/kubelet/pods/{uid}/etc-hosts /etc/hosts rw,relatime - ext4 /dev/nvme0n1p1 rw\n\
             1211 1200 259:1 /var/lib/kubelet/pods/{uid}/containers/{container}/6a1b2c3d /dev/termination-log rw,relatime - ext4 /dev/nvme0n1p1 rw\n"
        );
        let dir = self.root.0.join("proc").join(pid.to_string());
        std::fs::write(dir.join("mountinfo"), mountinfo).unwrap();
    }

    fn api(&self, path: &str) -> (u16, Value) {
        let (code, body) = self.agent.get(path);
        (code, serde_json::from_str(&body).unwrap_or(Value::Null))
    }
}

/// What a client process sends.
#[derive(Clone)]
struct Claim {
    namespace: &'static str,
    pod: &'static str,
    job: &'static str,
    rank: u32,
    world: u32,
    gpu: String,
    steps: u64,
}

impl Claim {
    fn new(job: &'static str, rank: u32, gpu: String) -> Self {
        Claim {
            namespace: "",
            pod: "",
            job,
            rank,
            world: 2,
            gpu,
            steps: 2,
        }
    }
}

/// A client in its own process; it connects on `go` and holds its stream
/// open until `close`.
struct Client {
    child: Child,
    stdin: ChildStdin,
    /// The child's stdout lines, read on a thread so that waiting is bounded.
    out: std::sync::mpsc::Receiver<String>,
}

impl Client {
    fn spawn(agent: &Agent, claim: &Claim) -> Self {
        let spec = serde_json::json!({
            "endpoint": agent.endpoint(),
            "namespace": claim.namespace,
            "pod": claim.pod,
            "job": claim.job,
            "rank": claim.rank,
            "world": claim.world,
            "gpu": claim.gpu,
            "steps": claim.steps,
        });
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "client_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CLIENT_ENV, spec.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let (tx, out) = std::sync::mpsc::channel();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Client { child, stdin, out }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn go(&mut self) {
        writeln!(self.stdin, "go").unwrap();
    }

    /// Ends the stream (if still open) and returns how it ended: "Ok" or
    /// the gRPC code.
    fn finish(mut self) -> String {
        let _ = writeln!(self.stdin, "close");
        let result = self.result();
        let _ = self.child.wait();
        result
    }

    /// How the stream ended; "still open" when it has not within [`WAIT`].
    fn result(&mut self) -> String {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.out.recv_timeout(left) {
                // libtest may have written "test client_process ... " before it.
                Ok(line) => {
                    if let Some(r) = line.trim().split("RESULT ").nth(1) {
                        return r.to_owned();
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return "still open".into(),
                Err(_) => return "no result".into(),
            }
        }
    }
}

const CLIENT_ENV: &str = "STEPWATCH_POD_ATTRIBUTION_CLIENT";

/// The client side, run in a child process by [`Client::spawn`]; a no-op
/// when run as a test of its own.
#[test]
fn client_process() {
    let Ok(spec) = std::env::var(CLIENT_ENV) else {
        return;
    };
    let spec: Value = serde_json::from_str(&spec).unwrap();
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let result = rt.block_on(async move {
        use stepwatch_proto::v1::{
            client_message::Kind, ingest_client::IngestClient, ClientMessage, Hello, Identity,
        };
        while lines.recv().await.as_deref() != Some("go") {}
        let s = |k: &str| spec[k].as_str().unwrap().to_string();
        let n = |k: &str| spec[k].as_u64().unwrap();
        let channel = tonic::transport::Endpoint::from_shared(s("endpoint"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tx.send(ClientMessage {
            kind: Some(Kind::Hello(Hello {
                identity: Some(Identity {
                    job_id: s("job"),
                    rank: n("rank") as u32,
                    local_rank: n("rank") as u32,
                    world_size: n("world") as u32,
                    pod: s("pod"),
                    namespace: s("namespace"),
                    ..Default::default()
                }),
                gpu_uuid: s("gpu"),
                pid: 1,
                ..Default::default()
            })),
        })
        .await
        .unwrap();
        let t0 = stepwatch_proto::clock::monotonic_ns();
        for step in 1..=n("steps") {
            tx.send(common::wire::batch(common::wire::step(
                step,
                t0 + step * 1_000_000,
            )))
            .await
            .unwrap();
        }
        let mut client = IngestClient::new(channel);
        let mut inbound = match client
            .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(status) => return format!("{:?}", status.code()),
        };
        let mut tx = Some(tx);
        loop {
            tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(_)) => continue,
                    Ok(None) => return "Ok".to_string(),
                    Err(status) => return format!("{:?}", status.code()),
                },
                // "close" or the end of stdin: half-close, and the agent ends the stream.
                _ = lines.recv(), if tx.is_some() => drop(tx.take()),
            }
        }
    });
    println!("RESULT {result}");
}

/// The attestations of `result` the agent has counted.
fn attestations(m: &Metrics, result: &str) -> Option<f64> {
    m.get(
        "stepwatch_workload_attestations_total",
        &[("result", result)],
    )
}

/// A process on the host, in no pod, that claims to be the one rank of
/// `hostjob` in namespace `claimed`.
fn host_claim() -> Claim {
    Claim {
        namespace: "claimed",
        world: 1,
        ..Claim::new("hostjob", 0, gpu(0))
    }
}

fn connected(m: &Metrics, namespace: &str, job: &str, rank: &str) -> bool {
    let mut labels = vec![("training_job", job), ("rank", rank)];
    if !namespace.is_empty() {
        labels.push(("namespace", namespace));
    }
    m.get("stepwatch_rank_connected", &labels) == Some(1.0)
}

const UID_A: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
const UID_B: &str = "1a2b3c4d-5e6f-7081-92a3-b4c5d6e7f809";

#[test]
fn the_kubelets_pod_and_namespace_label_the_rank_for_every_runtime_and_cgroup_layout() {
    let node = Node::with_trainer("podattr-labels");
    for (i, layout) in [
        "v2-systemd-containerd",
        "v2-cgroupfs-containerd",
        "v2-systemd-crio",
        "v1-cgroupfs-multi-line",
        "v1-systemd-docker",
    ]
    .into_iter()
    .enumerate()
    {
        // A claim the kubelet contradicts: the kubelet's view wins.
        let mut claim = Claim::new("llm", 0, gpu(0));
        claim.namespace = "default";
        claim.pod = "somebody-else";
        claim.job = ["llm-0", "llm-1", "llm-2", "llm-3", "llm-4"][i];
        claim.world = 1;
        let client = node.client(&claim, UID_A, layout);
        // Connected shows at the hello; the client's two steps follow it.
        let m = node.agent.wait_metrics(layout, WAIT, |m| {
            connected(m, "team-a", claim.job, "0")
                && m.get(
                    "stepwatch_rank_steps_completed_total",
                    &[("training_job", claim.job), ("rank", "0")],
                ) == Some(2.0)
        });
        assert_eq!(
            m.get(
                "stepwatch_rank_info",
                &[
                    ("namespace", "team-a"),
                    ("training_job", claim.job),
                    ("pod", "trainer-0"),
                    ("container", "trainer"),
                    ("attested", "true"),
                ],
            ),
            Some(1.0),
            "{layout}:\n{}",
            m.0
        );
        // Every rank series names the tenant's pod and container, so
        // alerts route and read without a join on stepwatch_rank_info.
        assert_eq!(
            m.get(
                "stepwatch_rank_steps_completed_total",
                &[
                    ("namespace", "team-a"),
                    ("training_job", claim.job),
                    ("rank", "0"),
                    ("pod", "trainer-0"),
                    ("container", "trainer"),
                ],
            ),
            Some(2.0),
            "{layout}:\n{}",
            m.0
        );
        let (code, body) = node.api(&format!(
            "/api/v1/jobs/{}/ranks/0?namespace=team-a",
            claim.job
        ));
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["info"]["pod"], "trainer-0");
        assert_eq!(body["info"]["pid"], client.pid());
        // Without the namespace, there is no such job: it is not "default".
        let (code, _) = node.api(&format!("/api/v1/jobs/{}?namespace=default", claim.job));
        assert_eq!(code, 404);
        assert_eq!(client.finish(), "Ok", "{layout}");
    }
    let m = Metrics(node.agent.metrics());
    assert_eq!(
        m.get(
            "stepwatch_workload_identity_mismatches_total",
            &[("field", "namespace")]
        ),
        Some(5.0)
    );
    assert_eq!(
        m.get(
            "stepwatch_workload_identity_mismatches_total",
            &[("field", "pod")]
        ),
        Some(5.0)
    );
    assert_eq!(attestations(&m, "kubelet"), Some(5.0));
}

#[test]
fn unprivileged_a_client_that_names_no_namespace_gets_its_pods_from_the_node() {
    // A hardened training pod: no POD_NAMESPACE, so the hello's namespace
    // and pod are empty. Its cgroup and the pod log directories still say
    // whose it is, and its series (and alerts) carry the tenant's namespace.
    let node = Node::start_unprivileged("podattr-unpriv");
    node.add_pod("team-a", "trainer-0", UID_A, &[("trainer", &[gpu(0)])]);
    let mut claim = Claim::new("hardened", 0, gpu(1));
    claim.world = 1;
    let client = node.client_in(&claim, UID_A, "v2-systemd-containerd", "trainer");
    let m = node
        .agent
        .wait_metrics("the rank in its pod's namespace", WAIT, |m| {
            connected(m, "team-a", "hardened", "0") && attestations(m, "pod_logs") == Some(1.0)
        });
    assert_eq!(
        m.get(
            "stepwatch_rank_info",
            &[
                ("namespace", "team-a"),
                ("pod", "trainer-0"),
                ("container", "trainer"),
                ("attested", "true"),
            ]
        ),
        Some(1.0)
    );
    // Without the pod-resources API the GPU it names is not checked (GPU 1
    // is not the pod's), and the kubelet is never asked.
    assert_eq!(
        m.get(
            "stepwatch_workload_lookup_failures_total",
            &[("reason", "pod_resources_error")]
        ),
        Some(0.0)
    );
    assert_eq!(client.finish(), "Ok");
    // A process in no pod keeps its claim, unattested, as with the socket.
    let client = node.client(&host_claim(), UID_A, "not-kubernetes");
    node.agent
        .wait_metrics("the host process's rank", WAIT, |m| {
            connected(m, "claimed", "hostjob", "0") && attestations(m, "not_in_pod") == Some(1.0)
        });
    assert_eq!(client.finish(), "Ok");
}

#[test]
fn a_process_outside_any_pod_keeps_its_claim_unattested() {
    let node = Node::start("podattr-host");
    let client = node.client(&host_claim(), UID_A, "not-kubernetes");
    // A scrape gathers the agent's counters before it copies the ranks, so
    // it can show the rank connected and the attestation (counted just
    // before the rank opened) not yet: wait for both.
    let m = node.agent.wait_metrics(
        "the host process's rank, counted as not in a pod",
        WAIT,
        |m| connected(m, "claimed", "hostjob", "0") && attestations(m, "not_in_pod") == Some(1.0),
    );
    assert_eq!(
        m.get(
            "stepwatch_rank_info",
            &[("namespace", "claimed"), ("attested", "false")]
        ),
        Some(1.0)
    );
    assert_eq!(client.finish(), "Ok");
}

#[test]
fn a_spoofed_gpu_uuid_is_refused() {
    let node = Node::with_trainer("podattr-gpu");
    // GPU 1 belongs to no container of this pod.
    let mut client = node.client(&Claim::new("j", 0, gpu(1)), UID_A, "v2-systemd-containerd");
    assert_eq!(client.result(), "PermissionDenied");
    let m = Metrics(node.agent.metrics());
    assert_eq!(m.rejected("gpu_not_allocated"), Some(1.0));
    assert_eq!(m.count("stepwatch_rank_info"), 0, "{}", m.0);
    let _ = client.finish();
}

#[test]
fn a_gpu_of_a_sibling_container_is_refused_once_the_container_is_known() {
    let node = Node::start("podattr-sibling");
    node.add_pod(
        "team-a",
        "trainer-0",
        UID_A,
        &[("trainer", &[gpu(0)]), ("helper", &[gpu(1)])],
    );
    let mut client = node.client_in(
        &Claim::new("j", 0, gpu(1)),
        UID_A,
        "v2-systemd-containerd",
        "trainer",
    );
    assert_eq!(client.result(), "PermissionDenied");
    let _ = client.finish();
    // Its own GPU is fine, and the container is named from its mounts.
    let client = node.client_in(
        &Claim::new("j", 0, gpu(0)),
        UID_A,
        "v2-systemd-containerd",
        "trainer",
    );
    let m = node.agent.wait_metrics("the trainer's rank", WAIT, |m| {
        connected(m, "team-a", "j", "0")
    });
    assert_eq!(
        m.get(
            "stepwatch_rank_info",
            &[("container", "trainer"), ("gpu_uuid", gpu(0).as_str())]
        ),
        Some(1.0)
    );
    assert_eq!(client.finish(), "Ok");
}

#[test]
fn a_second_process_claiming_a_live_rank_is_refused_and_the_first_keeps_its_history() {
    let node = Node::with_trainer("podattr-held");
    node.add_pod("team-a", "intruder", UID_B, &[("x", &[gpu(1)])]);
    let first = Claim::new("j", 0, gpu(0));
    let a = node.client(&first, UID_A, "v2-systemd-containerd");
    node.agent.wait_metrics("rank 0's two steps", WAIT, |m| {
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[
                ("namespace", "team-a"),
                ("training_job", "j"),
                ("rank", "0"),
            ],
        ) == Some(2.0)
    });
    // Another process in the same pod, then one from another pod.
    let mut b = Client::spawn(
        &node.agent,
        &Claim {
            steps: 0,
            ..first.clone()
        },
    );
    node.place(b.pid(), UID_A, "v2-systemd-containerd");
    b.go();
    assert_eq!(b.result(), "AlreadyExists");
    let _ = b.finish();
    let mut c = Client::spawn(
        &node.agent,
        &Claim {
            steps: 0,
            ..Claim::new("j", 0, gpu(1))
        },
    );
    node.place(c.pid(), UID_B, "v2-cgroupfs-containerd");
    c.go();
    assert_eq!(c.result(), "AlreadyExists");
    let _ = c.finish();
    let (code, rank) = node.api("/api/v1/jobs/j/ranks/0?namespace=team-a");
    assert_eq!(code, 200);
    assert_eq!(rank["info"]["pid"], a.pid());
    assert_eq!(rank["steps_completed"], 2);
    assert_eq!(rank["connected"], true);
    let m = Metrics(node.agent.metrics());
    assert_eq!(m.rejected("rank_held"), Some(2.0));
    assert_eq!(a.finish(), "Ok");
}

#[test]
fn two_torchrun_jobs_with_the_same_job_id_in_two_namespaces_stay_apart() {
    // The client's old fallback job id, which two single-node torchrun jobs
    // shared; the namespace now keeps tenants apart (the client's run-unique
    // fallback keeps jobs of one namespace apart: python/tests).
    let node = Node::start("podattr-apart");
    let job = "torchrun-127.0.0.1-29500";
    node.add_pod("team-a", "a-0", UID_A, &[("trainer", &[gpu(0)])]);
    node.add_pod("team-b", "b-0", UID_B, &[("trainer", &[gpu(1)])]);
    let mut a = Client::spawn(&node.agent, &Claim::new(job, 0, gpu(0)));
    let mut b = Client::spawn(&node.agent, &Claim::new(job, 0, gpu(1)));
    node.place(a.pid(), UID_A, "v2-systemd-containerd");
    node.place(b.pid(), UID_B, "v2-systemd-containerd");
    a.go();
    b.go();
    node.agent.wait_metrics("both ranks 0", WAIT, |m| {
        connected(m, "team-a", job, "0") && connected(m, "team-b", job, "0")
    });
    let (_, jobs) = node.api("/api/v1/jobs");
    let listed: Vec<(String, Vec<Value>)> = jobs["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            (
                j["namespace"].as_str().unwrap().to_owned(),
                j["ranks"].as_array().unwrap().clone(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        vec![
            ("team-a".to_owned(), vec![Value::from(0)]),
            ("team-b".to_owned(), vec![Value::from(0)])
        ]
    );
    assert_eq!(a.finish(), "Ok");
    assert_eq!(b.finish(), "Ok");
}

#[test]
fn a_resubmitted_job_does_not_double_its_ranks() {
    let node = Node::start("podattr-resubmit");
    node.add_pod("team-a", "run-1", UID_A, &[("trainer", &[gpu(0), gpu(1)])]);
    // Run 1: two ranks, finished.
    for rank in 0..2 {
        let r = node.client(
            &Claim::new("nightly", rank, gpu(rank)),
            UID_A,
            "v2-systemd-containerd",
        );
        node.agent.wait_metrics("run 1's rank", WAIT, |m| {
            m.get(
                "stepwatch_rank_steps_completed_total",
                &[("training_job", "nightly"), ("rank", &rank.to_string())],
            ) == Some(2.0)
        });
        assert_eq!(r.finish(), "Ok");
    }
    // Run 2 under the same id, one rank, in a new pod.
    node.add_pod("team-a", "run-2", UID_B, &[("trainer", &[gpu(0)])]);
    let mut again = Claim::new("nightly", 0, gpu(0));
    again.world = 1;
    let r = node.client(&again, UID_B, "v2-systemd-containerd");
    let m = node.agent.wait_metrics("run 2's rank", WAIT, |m| {
        connected(m, "team-a", "nightly", "0")
    });
    assert_eq!(m.count("stepwatch_rank_info"), 1, "{}", m.0);
    let (_, job) = node.api("/api/v1/jobs/nightly?namespace=team-a");
    let ranks = job["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 1, "{job}");
    assert_eq!(ranks[0]["info"]["pod"], "run-2");
    assert_eq!(r.finish(), "Ok");
}

/// The labels of `name`'s series for the GPU with `uuid` (None: no such series).
fn gpu_series_labels(m: &Metrics, name: &str, uuid: &str) -> Option<String> {
    let needle = format!("gpu_uuid=\"{uuid}\"");
    m.0.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(&needle))
        .map(|l| l[..l.rfind('}').unwrap() + 1].to_owned())
}

#[test]
fn gpu_series_name_the_pod_and_container_holding_the_gpu() {
    let node = Node::start("podattr-holders");
    node.add_pod(
        "team-a",
        "trainer-0",
        UID_A,
        &[("trainer", &[gpu(0)]), ("sidecar", &[])],
    );
    let holds_gpu0 = |m: &Metrics, pod: &str| {
        m.get(
            "stepwatch_gpu_memory_used_bytes",
            &[
                ("gpu", "0"),
                ("gpu_uuid", gpu(0).as_str()),
                ("namespace", "team-a"),
                ("pod", pod),
                ("container", "trainer"),
            ],
        )
        .is_some()
    };
    // No hello is needed: the agent asks the kubelet on its own.
    let m = node.agent.wait_metrics("GPU 0's holder labels", WAIT, |m| {
        holds_gpu0(m, "trainer-0")
    });
    for family in [
        "stepwatch_gpu_info",
        "stepwatch_gpu_up",
        "stepwatch_gpu_memory_total_bytes",
        "stepwatch_gpu_samples_total",
    ] {
        let labels = gpu_series_labels(&m, family, &gpu(0)).unwrap_or_default();
        assert!(
            labels.contains(r#"namespace="team-a""#)
                && labels.contains(r#"pod="trainer-0""#)
                && labels.contains(r#"container="trainer""#),
            "{family}: {labels}"
        );
        // GPU 1 is held by no pod: no pod labels, not empty ones.
        let idle = gpu_series_labels(&m, family, &gpu(1)).expect("GPU 1's series");
        assert!(
            !idle.contains("namespace=") && !idle.contains("pod=") && !idle.contains("container="),
            "{family}: {idle}"
        );
    }
    // The pod leaves and another takes the GPU: the labels follow.
    {
        let mut pods = node.kubelet.pods.lock().unwrap();
        pods.clear();
    }
    node.add_pod("team-a", "trainer-1", UID_B, &[("trainer", &[gpu(0)])]);
    let m = node
        .agent
        .wait_metrics("GPU 0's new holder", WAIT, |m| holds_gpu0(m, "trainer-1"));
    assert!(!holds_gpu0(&m, "trainer-0"), "{}", m.0);
    assert_eq!(
        m.get("stepwatch_workload_gpu_holders_refresh_errors_total", &[]),
        Some(0.0)
    );
    // The kubelet stops answering: counted, and the last answer keeps
    // labelling the GPU (for a minute) instead of churning its series.
    node.kubelet
        .down
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let m = node
        .agent
        .wait_metrics("failed refreshes counted", WAIT, |m| {
            m.get("stepwatch_workload_gpu_holders_refresh_errors_total", &[])
                .is_some_and(|n| n >= 2.0)
        });
    assert!(holds_gpu0(&m, "trainer-1"), "{}", m.0);
    assert!(
        node.agent
            .log()
            .contains("cannot ask the kubelet which pod holds which GPU"),
        "{}",
        node.agent.log()
    );
}

/// Pods that run as one uid (root, in many clusters) each hold their own
/// share of the Unix socket's per-peer caps: one pod at its share leaves
/// every other pod theirs, and is itself still held to it.
#[test]
fn pods_of_one_uid_each_get_their_own_share_of_the_per_peer_caps() {
    let node = Node::start_with_socket("podattr-quota", true, &["--max-streams-per-peer", "1"]);
    node.add_pod("team-a", "trainer-a", UID_A, &[("trainer", &[gpu(0)])]);
    node.add_pod("team-b", "trainer-b", UID_B, &[("trainer", &[gpu(1)])]);
    let layout = "v2-systemd-containerd";
    let a = node.client(&Claim::new("quota-a", 0, gpu(0)), UID_A, layout);
    node.agent.wait_metrics("pod A's rank", WAIT, |m| {
        connected(m, "team-a", "quota-a", "0")
    });
    // Another pod, the same uid as pod A's process (this test's).
    let b = node.client(&Claim::new("quota-b", 0, gpu(1)), UID_B, layout);
    node.agent
        .wait_metrics("pod B's rank beside pod A's", WAIT, |m| {
            connected(m, "team-b", "quota-b", "0")
        });
    // A second process of pod A is past its pod's share.
    let a2 = node.client(&Claim::new("quota-a", 1, gpu(0)), UID_A, layout);
    let m = node.agent.wait_metrics("the refusal counted", WAIT, |m| {
        m.rejected("peer_stream_limit") == Some(1.0)
    });
    assert!(connected(&m, "team-a", "quota-a", "0") && connected(&m, "team-b", "quota-b", "0"));
    assert_eq!(a2.finish(), "ResourceExhausted");
    assert_eq!(a.finish(), "Ok");
    assert_eq!(b.finish(), "Ok");
}
