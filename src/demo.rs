//! `stepwatch demo`: the agent on fake NVML with simulated training ranks,
//! all local, no GPU needed. It shows what a user sees on a real node.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_nvml::{FakeNvml, GpuSpec};

use crate::http_get;

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Where the demo agent serves HTTP (/metrics, /api/v1/jobs).
    #[arg(long, default_value = "127.0.0.1:9400")]
    pub http_listen: SocketAddr,
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Seconds between live status lines.
    #[arg(long, default_value_t = 2)]
    pub every: u64,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Child processes, stopped (SIGTERM, then SIGKILL) when dropped.
struct Children(Vec<(String, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            // SAFETY: plain kill(2) on a PID we spawned.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (name, child) in &mut self.0 {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if child.try_wait().ok().flatten().is_none() {
                eprintln!("{name} did not stop on SIGTERM; killing it");
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as usize);
        libc::signal(libc::SIGTERM, on_signal as *const () as usize);
    }
    let exe = std::env::current_exe().context("cannot find the stepwatch binary")?;
    let lib = fake_nvml::find_cdylib().context(
        "the fake NVML library (libfake_nvml.so) was not found next to this binary; \
         build it with `cargo build` (scripts/demo does this)",
    )?;
    let dir = std::env::temp_dir().join(format!("stepwatch-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let _cleanup = RemoveOnDrop(dir.clone());
    let gpus: Vec<GpuSpec> = (0..2).map(GpuSpec::h100_80gb).collect();
    let fake = FakeNvml::create(&dir, &gpus)?;
    let socket = dir.join("stepwatch.sock");
    let log_path = dir.join("agent.log");

    let mut children = Children(Vec::new());
    let agent = Command::new(&exe)
        .arg("agent")
        .arg("--socket")
        .arg(&socket)
        .args(["--socket-mode", "0600", "--node-name", "demo-node"])
        .arg("--http-listen")
        .arg(args.http_listen.to_string())
        .arg("--nvml-lib")
        .arg(&lib)
        .env(fake_nvml::STATE_DIR_ENV, &dir)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()
        .context("cannot start the agent")?;
    children.0.push(("agent".into(), agent));
    wait_ready(args.http_listen, &log_path, &mut children)?;

    let endpoint = format!("unix://{}", socket.display());
    for rank in 0..2u32 {
        let sim = Command::new(&exe)
            .args([
                "sim",
                "--job",
                "demo-llm",
                "--world-size",
                "2",
                "--steps",
                "0",
            ])
            .args(["--rank", &rank.to_string(), "--gpu", &rank.to_string()])
            .args(["--step-ms", "800"])
            .arg("--endpoint")
            .arg(&endpoint)
            .arg("--fake-nvml-dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start a simulated rank")?;
        children.0.push((format!("rank {rank}"), sim));
    }

    let base = format!("http://{}", args.http_listen);
    println!(
        "stepwatch demo: agent on 2 simulated H100 GPUs (fake NVML), job \"demo-llm\" with 2 ranks"
    );
    println!("  metrics:  curl {base}/metrics");
    println!("  jobs:     curl {base}/api/v1/jobs");
    println!("  timeline: curl {base}/api/v1/jobs/demo-llm/ranks/0?steps=3");
    println!("  agent log: {}", log_path.display());
    println!("  Ctrl-C to stop.\n");

    let started = Instant::now();
    let deadline = args.seconds.map(|s| started + Duration::from_secs(s));
    while !INTERRUPTED.load(Ordering::SeqCst) && deadline.is_none_or(|d| Instant::now() < d) {
        std::thread::sleep(Duration::from_millis(200));
        if started.elapsed().as_secs() % args.every.max(1) != 0
            || started.elapsed().subsec_millis() >= 200
        {
            continue;
        }
        for (name, child) in &mut children.0 {
            if let Ok(Some(status)) = child.try_wait() {
                anyhow::bail!(
                    "{name} exited unexpectedly ({status}); see {}",
                    log_path.display()
                );
            }
        }
        match http_get::get(args.http_listen, "/metrics") {
            Ok((200, body)) => print_status(started.elapsed(), &body),
            Ok((code, _)) => println!("/metrics answered {code}"),
            Err(e) => println!("/metrics unreachable: {e}"),
        }
    }
    drop(children);
    drop(fake);
    println!("demo stopped");
    Ok(())
}

fn wait_ready(addr: SocketAddr, log: &Path, children: &mut Children) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok((200, _)) = http_get::get(addr, "/readyz") {
            return Ok(());
        }
        if let Some((_, agent)) = children.0.first_mut() {
            if let Ok(Some(status)) = agent.try_wait() {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                anyhow::bail!("the agent exited ({status}) before it was ready:\n{text}");
            }
        }
        if Instant::now() > deadline {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            anyhow::bail!("the agent was not ready within 15 s on {addr}:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One line per GPU and per rank, read from the exposition like Prometheus would.
fn print_status(elapsed: Duration, metrics: &str) {
    let value = |name: &str, labels: &[(&str, &str)]| -> Option<f64> {
        metrics.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?;
            if !rest.starts_with('{') {
                return None;
            }
            let (lbl, val) = rest.rsplit_once(' ')?;
            labels
                .iter()
                .all(|(k, v)| lbl.contains(&format!("{k}=\"{v}\"")))
                .then(|| val.parse().ok())?
        })
    };
    let gib = |b: f64| b / (1u64 << 30) as f64;
    println!("t={:>4}s", elapsed.as_secs());
    for gpu in ["0", "1"] {
        let used = value("stepwatch_gpu_memory_used_bytes", &[("gpu", gpu)]);
        let max = value("stepwatch_gpu_memory_used_max_bytes", &[("gpu", gpu)]);
        let total = value("stepwatch_gpu_memory_total_bytes", &[("gpu", gpu)]);
        if let (Some(used), Some(total)) = (used, total) {
            println!(
                "  gpu {gpu}: used {:6.2} GiB (15s max {:6.2}) of {:5.1} GiB",
                gib(used),
                gib(max.unwrap_or(used)),
                gib(total)
            );
        }
    }
    for rank in ["0", "1"] {
        let labels = [("job", "demo-llm"), ("rank", rank)];
        if let Some(steps) = value("stepwatch_rank_steps_completed_total", &labels) {
            let dur = value("stepwatch_rank_step_duration_seconds", &labels).unwrap_or(0.0);
            println!(
                "  demo-llm rank {rank}: {steps:.0} steps, last {:.0} ms",
                dur * 1e3
            );
        }
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
