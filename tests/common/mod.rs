//! Harness for end-to-end tests: the real `stepwatch` binary as an agent on
//! fake NVML, plus simulated ranks as separate processes.

#![allow(dead_code)]

pub mod kubelet;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use fake_nvml::{FakeNvml, GpuSpec, MigSpec};

pub mod wire;

pub const BIN: &str = env!("CARGO_BIN_EXE_stepwatch");

/// A fresh temp dir (tempfile's: a unique name, removed on drop), its
/// path at `.0` for the tests' convenience.
pub struct TempDir(pub PathBuf, tempfile::TempDir);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("stepwatch-e2e-{tag}-"))
            .tempdir()
            .expect("a temp dir");
        Self(dir.path().to_owned(), dir)
    }
}

pub fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Waits for an agent's `--ready-file`; fails the test, with the log, if
/// the agent exits first or takes more than 30 s.
pub fn wait_ready_file(
    path: &std::path::Path,
    child: &mut Child,
    log: &std::path::Path,
) -> serde_json::Value {
    let log = || std::fs::read_to_string(log).unwrap_or_default();
    poll_or(
        Duration::from_millis(20),
        Duration::from_secs(30),
        || {
            if let Ok(text) = std::fs::read_to_string(path) {
                return Some(serde_json::from_str(&text).expect("the ready file is JSON"));
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "the agent exited ({status}) before it was ready; log:\n{}",
                    log()
                );
            }
            None
        },
        || format!("the agent wrote no ready file within 30 s; log:\n{}", log()),
    )
}

/// An agent process on its own fake NVML state.
pub struct Agent {
    pub dir: TempDir,
    pub fake: FakeNvml,
    pub http: SocketAddr,
    /// The TCP ingest address, when the agent was started with `--grpc-listen`.
    pub grpc: Option<SocketAddr>,
    /// The probes' own address, when started with `--probe-listen`.
    pub probe: Option<SocketAddr>,
    pub socket: PathBuf,
    pub child: Option<Child>,
}

impl Agent {
    /// Creates `gpus` fake GPUs, lets `prepare` set faults, then starts the agent.
    pub fn start_with(
        tag: &str,
        gpus: u32,
        extra_args: &[&str],
        prepare: impl FnOnce(&FakeNvml),
    ) -> Self {
        Self::start_full(tag, gpus, None, extra_args, prepare)
    }

    /// One fake GPU, the agent started with `extra_args` (not waiting for
    /// NVML, unlike [`Agent::start`]).
    pub fn start_args(tag: &str, extra_args: &[&str]) -> Self {
        Self::start_with(tag, 1, extra_args, |_| {})
    }

    /// Like `start_with`, with the marker socket at a chosen path.
    pub fn start_full(
        tag: &str,
        gpus: u32,
        socket: Option<PathBuf>,
        extra_args: &[&str],
        prepare: impl FnOnce(&FakeNvml),
    ) -> Self {
        let specs: Vec<GpuSpec> = (0..gpus).map(GpuSpec::h100_80gb).collect();
        Self::start_node(tag, "test-node", &specs, socket, extra_args, prepare)
    }

    /// Like `start_full`, with chosen fake GPUs and `--node-name`.
    pub fn start_node(
        tag: &str,
        node_name: &str,
        specs: &[GpuSpec],
        socket: Option<PathBuf>,
        extra_args: &[&str],
        prepare: impl FnOnce(&FakeNvml),
    ) -> Self {
        Self::spawn(
            tag,
            node_name,
            specs,
            &[],
            socket,
            extra_args,
            prepare,
            None,
        )
    }

    /// Like `start_node`, with GPUs cut into MIG slices.
    pub fn start_mig(
        tag: &str,
        specs: &[GpuSpec],
        migs: &[MigSpec],
        extra_args: &[&str],
        prepare: impl FnOnce(&FakeNvml),
    ) -> Self {
        Self::spawn(
            tag,
            "test-node",
            specs,
            migs,
            None,
            extra_args,
            prepare,
            None,
        )
    }

    /// Like `start_with`, with the agent's open-file limit (soft and hard)
    /// set to `nofile`, as a small container might have.
    pub fn start_with_nofile(tag: &str, nofile: u64, extra_args: &[&str]) -> Self {
        let specs = [GpuSpec::h100_80gb(0)];
        Self::spawn(
            tag,
            "test-node",
            &specs,
            &[],
            None,
            extra_args,
            |_| {},
            Some(nofile),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn spawn(
        tag: &str,
        node_name: &str,
        specs: &[GpuSpec],
        migs: &[MigSpec],
        socket: Option<PathBuf>,
        extra_args: &[&str],
        prepare: impl FnOnce(&FakeNvml),
        nofile: Option<u64>,
    ) -> Self {
        let dir = TempDir::new(tag);
        let fake = FakeNvml::create_with_mig(&dir.0, specs, migs).unwrap();
        prepare(&fake);
        let lib = fake_nvml::find_cdylib()
            .expect("libfake_nvml.so is built as a dependency of stepwatch");
        let ready_file = dir.0.join("ready.json");
        let socket = socket.unwrap_or_else(|| dir.0.join("agent.sock"));
        let log = std::fs::File::create(dir.0.join("agent.log")).unwrap();
        let mut command = Command::new(BIN);
        if let Some(n) = nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs here.
            unsafe {
                command.pre_exec(move || {
                    let limit = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = command
            .arg("agent")
            .arg("--socket")
            .arg(&socket)
            // Port 0 and the ready file: no race for a free port.
            .args(["--http-listen", "127.0.0.1:0"])
            .arg("--ready-file")
            .arg(&ready_file)
            .arg("--nvml-lib")
            .arg(&lib)
            .args(["--node-name", node_name, "--process-interval", "200ms"])
            .args(extra_args)
            .env(fake_nvml::STATE_DIR_ENV, &dir.0)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the agent");
        let mut child = child;
        let ready = wait_ready_file(&ready_file, &mut child, &dir.0.join("agent.log"));
        let http = ready["http"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .expect("the ready file names the HTTP address");
        let grpc = ready["grpc"].as_str().and_then(|a| a.parse().ok());
        let probe = ready["probe"].as_str().and_then(|a| a.parse().ok());
        let agent = Self {
            dir,
            fake,
            http,
            grpc,
            probe,
            socket,
            child: Some(child),
        };
        agent.wait_for("/healthz", 200, Duration::from_secs(20));
        agent
    }

    pub fn start(tag: &str, gpus: u32) -> Self {
        let agent = Self::start_with(tag, gpus, &[], |_| {});
        agent.wait_ready_with_nvml();
        agent
    }

    /// Waits until the agent is ready (ingest listening) and NVML answers:
    /// `/readyz` no longer waits for NVML, and most tests need GPU samples.
    pub fn wait_ready_with_nvml(&self) {
        poll_or(
            Duration::from_millis(100),
            Duration::from_secs(20),
            || {
                let ready = http_get(self.http, "/readyz");
                matches!(ready, Ok((200, body)) if body.lines().any(|l| l == "nvml: up"))
                    .then_some(())
            },
            || {
                format!(
                    "not ready with NVML up within 20 s; agent log:\n{}",
                    self.log()
                )
            },
        )
    }

    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("agent.log")).unwrap_or_default()
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        http_get(self.http, path)
            .unwrap_or_else(|e| panic!("GET {path}: {e}\nagent log:\n{}", self.log()))
    }

    pub fn metrics(&self) -> String {
        let (code, body) = self.get("/metrics");
        assert_eq!(code, 200);
        body
    }

    /// Polls `path` until it answers `code`.
    pub fn wait_for(&self, path: &str, code: u16, timeout: Duration) -> String {
        poll_or(
            Duration::from_millis(100),
            timeout,
            || match http_get(self.http, path) {
                Ok((c, body)) if c == code => Some(body),
                _ => None,
            },
            || format!("{path} never answered {code}; agent log:\n{}", self.log()),
        )
    }

    /// Polls /metrics until `pred` holds.
    pub fn wait_metrics(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Metrics) -> bool,
    ) -> Metrics {
        let last = std::cell::RefCell::new(String::new());
        poll_or(
            Duration::from_millis(100),
            timeout,
            || {
                let m = Metrics(self.metrics());
                if pred(&m) {
                    return Some(m);
                }
                *last.borrow_mut() = m.0;
                None
            },
            || {
                format!(
                    "timed out waiting for {what}; last /metrics:\n{}\nagent log:\n{}",
                    last.borrow(),
                    self.log()
                )
            },
        )
    }

    /// Starts one rank of a simulated scenario as its own process, with
    /// `extra_args` for `stepwatch sim`.
    #[allow(clippy::too_many_arguments)]
    pub fn sim(
        &self,
        scenario: &str,
        job: &str,
        rank: u32,
        gpu: u32,
        steps: u64,
        speed: f64,
        extra_args: &[&str],
    ) -> SimRank {
        let child = Command::new(BIN)
            .args(["sim", "--scenario", scenario, "--job", job])
            .args(["--rank", &rank.to_string(), "--gpu", &gpu.to_string()])
            .args(["--steps", &steps.to_string(), "--speed", &speed.to_string()])
            .arg("--endpoint")
            .arg(self.endpoint())
            .arg("--fake-nvml-dir")
            .arg(&self.dir.0)
            .args(extra_args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a simulated rank");
        SimRank(Some(child))
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("agent running");
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!(
                    "agent did not exit within 10 s of SIGTERM; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A simulated rank's process, killed when dropped: a test that fails
/// half-way must not leave it running on a shared CI machine.
pub struct SimRank(Option<Child>);

impl SimRank {
    /// Waits for the rank to exit and collects its output, as
    /// `Child::wait_with_output`.
    pub fn wait_with_output(mut self) -> std::io::Result<std::process::Output> {
        self.0.take().expect("a rank's process").wait_with_output()
    }

    /// Waits for the rank to die of its simulated OOM (`stepwatch sim`
    /// exits with 3 then) and returns its log; fails the test, naming
    /// `what`, when it ends otherwise.
    pub fn wait_oom(self, what: &str) -> String {
        let out = self.wait_with_output().expect("wait for a rank");
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(3), "{what}:\n{log}");
        log
    }
}

impl std::ops::Deref for SimRank {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.0.as_ref().expect("a rank's process")
    }
}

impl std::ops::DerefMut for SimRank {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("a rank's process")
    }
}

impl Drop for SimRank {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// `stepwatch sim`'s arguments that hold a rank before its step 2 until
/// the file `release` exists.
pub fn hold_before_step_2(release: &std::path::Path) -> [&str; 4] {
    [
        "--hold-before-step",
        "2",
        "--release-file",
        release.to_str().unwrap(),
    ]
}

/// Agents of several nodes, the Prometheus servers over them and the ranks
/// they run: the ranks are killed when it is dropped, and every log is
/// printed when the test fails.
#[derive(Default)]
pub struct Cluster {
    pub agents: Vec<(&'static str, Agent)>,
    /// The servers, each under the name its log is printed with.
    pub proms: Vec<(String, Prometheus)>,
    pub sims: Vec<(u32, SimRank)>,
}

impl Cluster {
    /// The agent of `node`.
    pub fn agent(&self, node: &str) -> &Agent {
        &self.agents.iter().find(|(n, _)| *n == node).unwrap().1
    }

    /// The server named `name`.
    pub fn prom(&self, name: &str) -> &Prometheus {
        &self.proms.iter().find(|(n, _)| n == name).unwrap().1
    }

    /// Each agent's HTTP address, the scrape target, with its node.
    pub fn targets(&self) -> Vec<(String, &'static str)> {
        self.agents
            .iter()
            .map(|(node, agent)| (agent.http.to_string(), *node))
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Each rank's process is killed as it is dropped.
        self.sims.clear();
        if !std::thread::panicking() {
            return;
        }
        for (name, prom) in &self.proms {
            eprintln!("===== prometheus {name} log =====\n{}", prom.log());
        }
        for (node, agent) in &self.agents {
            eprintln!("===== agent {node} log =====\n{}", agent.log());
        }
    }
}

/// Runs `command` to its end and returns its stdout; fails the test,
/// naming `what` and showing both outputs, when it fails.
pub fn stdout_of(command: &mut Command, what: &str) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs `command`, which must fail, and returns what it said on stderr.
pub fn stderr_of_failure(command: &mut Command) -> String {
    let out = command.output().expect("run the command");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "it did not fail:\n{stderr}");
    stderr
}

/// Polls `f` until it holds, failing the test after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    poll_every(Duration::from_millis(20), what, timeout, || {
        f().then_some(())
    })
}

/// Waits for a child and asserts it succeeded.
pub fn wait_ok(mut child: SimRank, what: &str) {
    let status = child.wait().unwrap();
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        panic!("{what} failed ({status}):\n{err}");
    }
}

pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    stepwatch::http_get::get(addr, path)
}

/// A parsed exposition, queried by name and label subset.
pub struct Metrics(pub String);

impl Metrics {
    /// Value of the first series of `name` whose labels include all of `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        stepwatch::http_get::metric_value(&self.0, name, labels)
    }

    /// Value of a series the test expects: [`Metrics::get`], panicking with
    /// the series named when there is none.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no series {name} with labels {labels:?}"))
    }

    /// Markers and streams refused for `reason`.
    pub fn rejected(&self, reason: &str) -> Option<f64> {
        self.get("stepwatch_markers_rejected_total", &[("reason", reason)])
    }

    /// Steps completed by the ranks of `job` (the first rank's series).
    pub fn steps_completed(&self, job: &str) -> Option<f64> {
        self.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", job)],
        )
    }

    pub fn count(&self, name: &str) -> usize {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name))
            .count()
    }
}

/// Runs `promtool check metrics` on an exposition.
pub fn promtool_check_metrics(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is needed (Debian package `prometheus`; scripts/test installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A real Prometheus server (Debian package `prometheus`) on a temp TSDB,
/// listening on 127.0.0.1; killed on drop.
pub struct Prometheus {
    pub dir: TempDir,
    pub addr: SocketAddr,
    child: Option<Child>,
}

/// What a test's Prometheus is: sharded setups run agents that scrape and
/// remote-write to a server that stores and evaluates the rules.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum PrometheusRole {
    /// A plain server: scrapes, stores, evaluates rules.
    Server,
    /// A server that also accepts remote writes (`/api/v1/write`).
    RemoteWriteReceiver,
    /// Agent mode: scrapes and remote-writes only; no queries, no rules.
    Agent,
}

/// Panics with what to install when `binary` is not on PATH: tests that
/// run a real server fail without it rather than skip.
pub fn require_binary(binary: &str, what: &str, package: &str) {
    if Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        panic!(
            "`{binary}` is not on PATH: this test runs {what}. \
             Install Debian's package `{package}` (scripts/test installs it)."
        );
    }
}

impl Prometheus {
    /// Panics with what to install when `prometheus` is not on PATH.
    pub fn require() {
        require_binary("prometheus", "a real Prometheus server", "prometheus");
    }

    /// Writes `config` (prometheus.yml text) to a temp dir and starts the
    /// server on it; returns once /-/ready answers 200.
    pub fn start(tag: &str, config: &str) -> Self {
        Self::start_as(tag, config, PrometheusRole::Server)
    }

    /// Like `start`, in the given role (a central server receiving remote
    /// writes, or an agent-mode shard).
    pub fn start_as(tag: &str, config: &str, role: PrometheusRole) -> Self {
        Self::require();
        let dir = TempDir::new(tag);
        let config_path = dir.0.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        // Prometheus cannot report a port it chose, so a free one is picked
        // here; if another process takes it first, try another.
        let mut dir = Some(dir);
        for _attempt in 0..5 {
            let addr = free_port();
            let d = dir.take().expect("kept between attempts");
            let log = std::fs::File::create(d.0.join("prometheus.log")).unwrap();
            let data = d.0.join("data");
            // Agent mode refuses the server's storage flags, and the reverse.
            let role_args = match role {
                PrometheusRole::Server => vec![format!("--storage.tsdb.path={}", data.display())],
                PrometheusRole::RemoteWriteReceiver => vec![
                    format!("--storage.tsdb.path={}", data.display()),
                    "--web.enable-remote-write-receiver".to_owned(),
                ],
                PrometheusRole::Agent => vec![
                    "--enable-feature=agent".to_owned(),
                    format!("--storage.agent.path={}", data.display()),
                ],
            };
            let child = Command::new("prometheus")
                .arg(format!("--config.file={}", config_path.display()))
                .args(role_args)
                .arg(format!("--web.listen-address={addr}"))
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start prometheus");
            let mut prom = Self {
                dir: d,
                addr,
                child: Some(child),
            };
            let log_path = prom.dir.0.join("prometheus.log");
            let ours = poll_or(
                Duration::from_millis(100),
                Duration::from_secs(30),
                || {
                    if let Ok((200, _)) = http_get(addr, "/-/ready") {
                        // Ready may come from another test's Prometheus that took
                        // the port between free_port() and our bind: only ours
                        // runs our config file.
                        let flags = prom.api("/api/v1/status/flags").unwrap_or_default();
                        return Some(flags["config.file"] == config_path.display().to_string());
                    }
                    let status = prom.child.as_mut().unwrap().try_wait().unwrap()?;
                    let log = prom.log();
                    assert!(
                        log.contains("address already in use"),
                        "prometheus exited ({status}); log:\n{log}"
                    );
                    Some(false)
                },
                || {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    format!("prometheus not ready within 30 s; log:\n{log}")
                },
            );
            if ours {
                return prom;
            }
            let child = prom.child.as_mut().unwrap();
            let _ = child.kill();
            let _ = child.wait();
            prom.child = None;
            // Prometheus is Drop, so its dir is swapped out (for a new, empty one).
            dir = Some(std::mem::replace(&mut prom.dir, TempDir::new(tag)));
        }
        panic!("prometheus found no free port in 5 attempts");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("prometheus.log")).unwrap_or_default()
    }

    /// GET an API path (query string already encoded); the JSON `data` of a
    /// successful answer, else "errorType: error".
    pub fn api(&self, path: &str) -> Result<serde_json::Value, String> {
        let (code, body) = http_get(self.addr, path).map_err(|e| format!("GET {path}: {e}"))?;
        let v: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| format!("GET {path}: HTTP {code}, not JSON ({e}): {body}"))?;
        if v["status"] == "success" {
            Ok(v["data"].clone())
        } else {
            Err(format!("{}: {}", v["errorType"], v["error"]))
        }
    }

    /// Instant query at the current time: the `data` object (resultType, result).
    pub fn query(&self, expr: &str) -> Result<serde_json::Value, String> {
        self.api(&format!("/api/v1/query?query={}", url_encode(expr)))
    }

    /// Range query from `start` to now (Unix seconds), `step` seconds apart.
    pub fn query_range(
        &self,
        expr: &str,
        start: f64,
        step: f64,
    ) -> Result<serde_json::Value, String> {
        let end = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        self.api(&format!(
            "/api/v1/query_range?query={}&start={start:.3}&end={end:.3}&step={step}",
            url_encode(expr)
        ))
    }

    /// The result vector of an instant query, panicking with the log on error.
    pub fn vector(&self, expr: &str) -> Vec<serde_json::Value> {
        match self.query(expr) {
            Ok(data) => data["result"].as_array().cloned().unwrap_or_default(),
            Err(e) => panic!("query {expr}: {e}"),
        }
    }

    /// The value of an instant query that must answer one series.
    pub fn single(&self, expr: &str) -> f64 {
        let v = self.vector(expr);
        assert_eq!(v.len(), 1, "one series of {expr}: {v:?}");
        sample(&v[0])
    }

    /// The `(rank, node)` labels of each series an instant query answers.
    pub fn ranks_and_nodes(&self, expr: &str) -> Vec<(String, String)> {
        self.vector(expr)
            .iter()
            .map(|s| (label(s, "rank").to_owned(), label(s, "node").to_owned()))
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A label of a series in a Prometheus query result ("" when it has none).
pub fn label<'a>(series: &'a serde_json::Value, name: &str) -> &'a str {
    series["metric"][name].as_str().unwrap_or("")
}

/// The value of a series in an instant query's result.
pub fn sample(series: &serde_json::Value) -> f64 {
    series["value"][1].as_str().unwrap().parse().unwrap()
}

/// The repository's root, where the shipped files are.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Percent-encodes a query-string value.
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Polls `f` every 200 ms until it returns Some, or panics with `what`.
pub fn poll<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    poll_every(Duration::from_millis(200), what, timeout, f)
}

/// [`poll_or`], panicking with a message naming `what`.
fn poll_every<T>(
    interval: Duration,
    what: &str,
    timeout: Duration,
    f: impl FnMut() -> Option<T>,
) -> T {
    poll_or(interval, timeout, f, || {
        format!("timed out after {timeout:?} waiting for {what}")
    })
}

/// The one wait loop of the tests: `f` every `interval` until it returns
/// Some, or a panic with `failure()` after `timeout`.
fn poll_or<T>(
    interval: Duration,
    timeout: Duration,
    mut f: impl FnMut() -> Option<T>,
    failure: impl FnOnce() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("{}", failure());
        }
        std::thread::sleep(interval);
    }
}

/// Seconds since the Unix epoch, the unit of Prometheus's and Alertmanager's times.
pub fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// One rank's step report from its agent (`/api/v1/jobs/{job}/ranks/{rank}`).
pub fn rank_report(agent: &Agent, job: &str, rank: u32) -> Option<serde_json::Value> {
    let (code, body) = http_get(agent.http, &format!("/api/v1/jobs/{job}/ranks/{rank}")).ok()?;
    (code == 200).then(|| serde_json::from_str(&body).unwrap())
}
