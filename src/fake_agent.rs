//! An agent of this binary on fresh fake NVML GPUs, in a temp dir of its own:
//! what `bench` and `preflight` start (the demo keeps its own, with a fixed port).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_nvml::{FakeNvml, GpuSpec};

use stepwatch::http_get;

/// A child process, killed and reaped when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running agent on its own fake GPUs; stopped and its dir removed when dropped.
pub struct FakeAgent {
    /// The agent process (the benchmarks read its RSS; preflight only holds it).
    #[cfg_attr(not(feature = "dev-tools"), allow(dead_code))]
    pub child: Killed,
    pub http: SocketAddr,
    /// `unix://` + the marker socket, for `STEPWATCH_ENDPOINT`.
    pub endpoint: String,
    /// The fake NVML state (what `STEPWATCH_FAKE_NVML_DIR` names), the socket and `agent.log`.
    pub dir: PathBuf,
    _temp: tempfile::TempDir,
}

/// How to start a [`FakeAgent`]. `Default` is this binary, no record, no more flags.
#[derive(Default)]
pub struct Options<'a> {
    /// `--record` file.
    pub record: Option<&'a Path>,
    /// Run this agent binary instead of this one (to compare builds).
    pub agent_bin: Option<&'a Path>,
    /// More agent flags.
    pub extra: &'a [String],
    /// `--node-name` (default `bench`).
    pub node_name: Option<&'a str>,
    /// Driver-reserved bytes of every GPU (NVML v2 `reserved`; default fake-nvml's 512 MiB).
    pub reserved_bytes: Option<u64>,
}

impl FakeAgent {
    /// Creates `specs` as fake GPUs in a new temp dir (`stepwatch-<tag>-…`),
    /// starts the agent on them and waits until it is ready with NVML up.
    pub fn start(tag: &str, specs: &[GpuSpec], opts: &Options) -> anyhow::Result<Self> {
        let exe = match opts.agent_bin {
            Some(bin) => bin.to_path_buf(),
            None => std::env::current_exe().context("cannot find the stepwatch binary")?,
        };
        let lib = fake_nvml::find_cdylib().context(
            "the fake NVML library (libfake_nvml.so) was not found next to the stepwatch \
             binary; build the workspace with `cargo build`",
        )?;
        let temp = tempfile::Builder::new()
            .prefix(&format!("stepwatch-{tag}-"))
            .tempdir()
            .context("cannot create a temp dir for the agent")?;
        let dir = temp.path().to_owned();
        let fake = FakeNvml::create(&dir, specs)?;
        if let Some(reserved) = opts.reserved_bytes {
            for gpu in 0..specs.len() as u32 {
                fake.set_reserved_bytes(gpu, reserved);
            }
        }
        let http: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let socket = dir.join("agent.sock");
        let log = dir.join("agent.log");
        let mut child = Killed(
            Command::new(&exe)
                .arg("agent")
                .arg("--socket")
                .arg(&socket)
                .arg("--http-listen")
                .arg(http.to_string())
                .arg("--nvml-lib")
                .arg(&lib)
                .args(["--process-interval", "200ms", "--node-name"])
                .arg(opts.node_name.unwrap_or("bench"))
                .args(opts.extra)
                .args(opts.record.map(|r| {
                    let mut a = std::ffi::OsString::from("--record=");
                    a.push(r);
                    a
                }))
                .env(fake_nvml::STATE_DIR_ENV, &dir)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log)?)
                .spawn()
                .with_context(|| format!("cannot start the agent ({})", exe.display()))?,
        );
        wait_ready(http, &log, &mut child.0)?;
        Ok(FakeAgent {
            child,
            http,
            endpoint: format!("unix://{}", socket.display()),
            dir,
            _temp: temp,
        })
    }
}

/// Until `/readyz` says NVML is up (it is 200 without NVML too); fails with
/// the log when the agent exits first or takes more than 20 s.
fn wait_ready(addr: SocketAddr, log: &Path, child: &mut Child) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok((200, body)) = http_get::get(addr, "/readyz") {
            if body.lines().any(|l| l == "nvml: up") {
                return Ok(());
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            anyhow::bail!(
                "the agent exited ({status}) before it was ready: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    anyhow::bail!(
        "agent not ready: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    )
}
