//! `stepwatch demo`: the agent on fake NVML with simulated training ranks,
//! all local, no GPU needed. It shows what a user sees on a real node.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_nvml::{FakeNvml, GpuSpec};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

use stepwatch::http_get;

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Where the demo agent serves HTTP (the page at /, /metrics, /api/v1/jobs).
    #[arg(long, default_value = "127.0.0.1:19447")]
    pub http_listen: SocketAddr,
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Seconds between live status lines.
    #[arg(long, default_value_t = 2)]
    pub every: u64,
}

/// Child processes, stopped (SIGTERM, then SIGKILL) when dropped. Each
/// runs in its own process group, so a terminal's Ctrl-C reaches only the
/// demo, which stops them in this order instead of finding them gone.
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

/// One simulated job the demo keeps running.
struct DemoJob {
    label: &'static str,
    scenario: &'static str,
    gpu: u32,
    speed: f64,
    steps: Option<u64>,
    run: u32,
    child: Option<Child>,
    /// When the last run ended, to restart after a pause.
    ended: Option<Instant>,
}

impl DemoJob {
    fn job_id(&self) -> String {
        format!("{}-{}", self.label, self.run)
    }

    fn start(&mut self, exe: &Path, endpoint: &str, dir: &Path) -> anyhow::Result<()> {
        self.run += 1;
        let mut cmd = crate::sim::command(exe, self.scenario, self.gpu, self.speed, endpoint, dir);
        cmd.args(["--job", &self.job_id()]);
        if let Some(steps) = self.steps {
            cmd.args(["--steps", &steps.to_string()]);
        }
        cmd.process_group(0);
        self.child = Some(cmd.spawn().context("cannot start a simulated job")?);
        self.ended = None;
        Ok(())
    }
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    // Ctrl-C, SIGTERM and a closed terminal (SIGHUP) end the loop below,
    // which stops the children: they are in their own process groups and
    // hear none of these themselves.
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM, SIGHUP] {
        signal_hook::flag::register(signal, Arc::clone(&interrupted))
            .context("cannot handle Ctrl-C")?;
    }
    let exe = std::env::current_exe().context("cannot find the stepwatch binary")?;
    let lib = fake_nvml::find_cdylib().context(
        "the fake NVML library (libfake_nvml.so) was not found next to this binary; \
         build the workspace with `cargo build` first",
    )?;
    // Removed when the demo ends (the agent log is kept elsewhere).
    let temp = tempfile::Builder::new()
        .prefix("stepwatch-demo-")
        .tempdir()
        .context("cannot create the demo's temp dir")?;
    let dir = temp.path().to_owned();
    // A 24 GB card for the healthy job, a 48 GB card for the doomed one,
    // named as cards of that size are (an L4 and an L40S).
    let cards = [
        ("NVIDIA L4", 24_146_608_128u64),
        ("NVIDIA L40S", 48_305_799_168),
    ];
    let gpus: Vec<GpuSpec> = cards
        .iter()
        .enumerate()
        .map(|(i, &(name, total_bytes))| GpuSpec {
            name: name.into(),
            total_bytes,
            ..GpuSpec::h100_80gb(i as u32)
        })
        .collect();
    let fake = FakeNvml::create(&dir, &gpus)?;
    let socket = dir.join("stepwatch.sock");
    // Kept after the demo (the rest of `dir` is removed): it is where to
    // look when something went wrong, and the demo says where it is.
    let log_path =
        std::env::temp_dir().join(format!("stepwatch-demo-{}-agent.log", std::process::id()));
    let ready_path = dir.join("agent-ready.json");

    let mut children = Children(Vec::new());
    let agent = Command::new(&exe)
        .arg("agent")
        .arg("--socket")
        .arg(&socket)
        .args([
            "--socket-mode",
            "0600",
            "--node-name",
            "demo-node",
            // The rank URL printed below names the doomed job's first run,
            // which ends within two minutes: keep ended ranks for an hour so
            // that it keeps answering (each run is a new job id).
            "--retention",
            "1h",
        ])
        .arg("--http-listen")
        .arg(args.http_listen.to_string())
        .arg("--ready-file")
        .arg(&ready_path)
        .arg("--nvml-lib")
        .arg(&lib)
        .env(fake_nvml::STATE_DIR_ENV, &dir)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .process_group(0)
        .spawn()
        .context("cannot start the agent")?;
    children.0.push(("agent".into(), agent));
    // The bound address comes from the agent, so `--http-listen` may say port 0.
    let http = wait_ready(&ready_path, &log_path, &mut children)?;

    let endpoint = format!("unix://{}", socket.display());
    let mut jobs = [
        DemoJob {
            label: "healthy-llm",
            scenario: "demo-small",
            gpu: 0,
            speed: 1.0,
            steps: Some(1_000_000),
            run: 0,
            child: None,
            ended: None,
        },
        DemoJob {
            label: "doomed-llm",
            scenario: "adam-step2-oom",
            gpu: 1,
            speed: 0.05,
            steps: None,
            run: 0,
            child: None,
            ended: None,
        },
    ];
    for job in &mut jobs {
        job.start(&exe, &endpoint, &dir)?;
    }

    let base = format!("http://{http}");
    println!("stepwatch demo: the agent on 2 simulated GPUs (fake NVML), with two simulated PyTorch jobs:");
    println!("  healthy-llm  GPT-2 small with AdamW on a 24 GB GPU: fits");
    println!("  doomed-llm   GPT 1.3B with AdamW on a 48 GB GPU: step 1 fits, step 2 will not (the optimizer");
    println!("               state is created inside step 1's optimizer.step()); stepwatch predicts it during step 1");
    println!();
    println!("  the page:  open {base}/ in a browser (GPUs, jobs, each rank's step anatomy; live)");
    println!("  metrics:   curl {base}/metrics");
    println!("  jobs:      curl {base}/api/v1/jobs");
    println!("  a rank:    curl '{base}/api/v1/jobs/doomed-llm-1/ranks/0?steps=3'");
    println!("  agent log: {}", log_path.display());
    println!("  Ctrl-C to stop.\n");

    let started = Instant::now();
    let deadline = args.seconds.map(|s| started + Duration::from_secs(s));
    let mut next_print = started;
    while !interrupted.load(Ordering::SeqCst) && deadline.is_none_or(|d| Instant::now() < d) {
        std::thread::sleep(Duration::from_millis(100));
        if let Ok(Some(status)) = children.0[0].1.try_wait() {
            anyhow::bail!(
                "the agent exited unexpectedly ({status}); see {}",
                log_path.display()
            );
        }
        for job in &mut jobs {
            if let Some(child) = &mut job.child {
                if let Ok(Some(status)) = child.try_wait() {
                    job.child = None;
                    job.ended = Some(Instant::now());
                    if status.code() == Some(crate::sim::OOM_EXIT_CODE) {
                        println!(
                            ">> {} died: CUDA out of memory in step 2, as stepwatch predicted during step 1. Restarting it in 10 s.",
                            job.job_id()
                        );
                    } else {
                        println!(
                            ">> {} ended ({status}); restarting it in 10 s.",
                            job.job_id()
                        );
                    }
                }
            } else if job
                .ended
                .is_some_and(|t| t.elapsed() > Duration::from_secs(10))
            {
                job.start(&exe, &endpoint, &dir)?;
            }
        }
        if Instant::now() >= next_print {
            next_print += Duration::from_secs(args.every.max(1));
            match http_get::get(http, "/metrics") {
                Ok((200, body)) => print_status(started.elapsed(), &body, &jobs),
                Ok((code, _)) => println!("/metrics answered {code}"),
                Err(e) => println!("/metrics unreachable: {e}"),
            }
        }
    }
    for job in &mut jobs {
        if let Some(child) = job.child.take() {
            children.0.push((job.job_id(), child));
        }
    }
    drop(children);
    drop(fake);
    println!(
        "demo stopped; the agent log is kept at {}",
        log_path.display()
    );
    Ok(())
}

/// Waits until the agent has written its ready file and answers `/readyz`
/// with NVML up;
/// returns its HTTP address.
fn wait_ready(ready: &Path, log: &Path, children: &mut Children) -> anyhow::Result<SocketAddr> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let addr = std::fs::read_to_string(ready)
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .and_then(|v| {
                v["http"]
                    .as_str()
                    .and_then(|a| a.parse::<SocketAddr>().ok())
            });
        if let Some(addr) = addr {
            // The demo's GPU is fake NVML: wait until it answers too
            // (/readyz is 200 without NVML; its body says how NVML is).
            if let Ok((200, body)) = http_get::get(addr, "/readyz") {
                if body.lines().any(|l| l == "nvml: up") {
                    return Ok(addr);
                }
            }
        }
        if let Some((_, agent)) = children.0.first_mut() {
            if let Ok(Some(status)) = agent.try_wait() {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                anyhow::bail!("the agent exited ({status}) before it was ready:\n{text}");
            }
        }
        if Instant::now() > deadline {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            anyhow::bail!("the agent was not ready within 15 s:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One line per GPU and per job, read from the exposition like Prometheus would.
fn print_status(elapsed: Duration, metrics: &str, jobs: &[DemoJob]) {
    let value = |name: &str, labels: &[(&str, &str)]| http_get::metric_value(metrics, name, labels);
    let gb = |b: f64| b / 1e9;
    let mut line = format!("t={:>4}s ", elapsed.as_secs());
    for gpu in ["0", "1"] {
        let used = value("stepwatch_gpu_memory_used_bytes", &[("gpu", gpu)]);
        let max = value("stepwatch_gpu_memory_used_max_bytes", &[("gpu", gpu)]);
        let total = value("stepwatch_gpu_memory_total_bytes", &[("gpu", gpu)]);
        if let (Some(used), Some(total)) = (used, total) {
            line += &format!(
                " | gpu{gpu} {:5.2} GB used (15 s max {:5.2}) of {:5.2}",
                gb(used),
                gb(max.unwrap_or(used)),
                gb(total)
            );
        }
    }
    println!("{line}");
    for job in jobs {
        let id = job.job_id();
        let rank = [("training_job", id.as_str()), ("rank", "0")];
        let Some(step) = value("stepwatch_rank_last_step", &rank) else {
            println!("  {id:14} starting");
            continue;
        };
        let mut text = format!("  {id:14} step {step:<4}");
        if let Some(peak) = value("stepwatch_rank_first_step_peak_bytes", &rank) {
            text += &format!(" step-1 peak {:5.2} GB", gb(peak));
        }
        match (
            value("stepwatch_rank_predicted_peak_bytes", &rank),
            value("stepwatch_rank_predicted_headroom_bytes", &rank),
            value("stepwatch_rank_gpu_capacity_bytes", &rank),
        ) {
            (Some(peak), Some(headroom), Some(cap)) => {
                let provisional =
                    value("stepwatch_rank_prediction_provisional", &rank) == Some(1.0);
                text += &format!(
                    " | predicted step-2 peak {:5.2} GB of {:5.2}, headroom {:+6.2} GB{}",
                    gb(peak),
                    gb(cap),
                    gb(headroom),
                    if provisional { " (provisional)" } else { "" }
                );
                if value("stepwatch_rank_oom_risk", &rank) == Some(1.0) {
                    text += "  << STEP-2 OOM PREDICTED";
                }
            }
            _ => text += " | predicting...",
        }
        if value("stepwatch_rank_ooms_total", &rank).unwrap_or(0.0) > 0.0 {
            text += "  [died: CUDA OOM]";
        }
        println!("{text}");
    }
}
