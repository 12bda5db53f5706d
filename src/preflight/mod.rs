//! `stepwatch preflight`: will this training script run out of GPU memory on
//! that GPU? Answered on any Linux machine, before the job is queued.
//!
//! It starts an agent on fake NVML GPUs of the named model's usable capacity
//! ([`gpus`]), runs the user's unmodified command under fake CUDA
//! (`crates/fake-cuda/fake-cuda run`: PyTorch's real caching allocator, kernels
//! that do nothing) with the stepwatch client pointed at that agent and told to
//! end the process after N optimizer steps (`STEPWATCH_STOP_AFTER_STEP`), then
//! judges each rank from fake CUDA's usage log ([`truth`]) and the agent's
//! report: step-1 peak, the prediction made during step 1, the steady peak,
//! headroom, the verdict and the advice ([`report`]).
//!
//! Exit status: 0 fits (with 5% to spare), 1 runs out of memory or fits with
//! under 5% to spare, 2 preflight itself failed.
//!
//! Fake CUDA's launcher and C sources ship in the Python package
//! (`stepwatch.fake_cuda`, which builds them for the installed torch on first
//! use); the fake NVML library ships beside the binary.

mod gpus;
mod report;
mod truth;
mod verify;

use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_nvml::GpuSpec;
use serde_json::Value;

use crate::fake_agent::{self, FakeAgent};
use report::{RankResult, Report, Verification};
use stepwatch::http_get;
use verify::BatchSetting;

#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example: stepwatch preflight --gpu h100-80gb -- python train.py --batch 8\n\
                  Exit status: 0 fits, 1 runs out of memory (or under 5% to spare), 2 preflight failed."
)]
pub struct PreflightArgs {
    /// The GPU model to check against (`--list-gpus` shows them).
    #[arg(long, required_unless_present_any = ["gpu_capacity", "list_gpus"])]
    pub gpu: Option<String>,
    /// Usable memory of the GPU instead of a model: what PyTorch calls its total
    /// capacity (e.g. 79.19GiB, 80GB).
    #[arg(long, value_parser = gpus::parse_size, conflicts_with = "gpu")]
    pub gpu_capacity: Option<u64>,
    /// GPUs on the node (default: torchrun's --nproc-per-node, else 1).
    #[arg(long)]
    pub gpus: Option<u32>,
    /// Optimizer steps to run (at least 2: step 2 is where the memory grows).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(2..=100))]
    pub steps: u64,
    /// Print the report as JSON on stdout (for CI).
    #[arg(long)]
    pub json: bool,
    /// Device bytes each NCCL communicator takes outside PyTorch's allocator
    /// (fake CUDA's --nccl-bytes; default 0).
    #[arg(long, value_parser = gpus::parse_size)]
    pub nccl_bytes: Option<u64>,
    /// Give up after this many seconds (the run, not fake CUDA's first build).
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// The Python whose torch fake CUDA builds for (default: the command's own
    /// python, or the one next to its torchrun).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// fake CUDA's launcher (default: $STEPWATCH_FAKE_CUDA, else
    /// crates/fake-cuda/fake-cuda of the checkout this binary was built in,
    /// else `python -m stepwatch.fake_cuda` of the installed Python package).
    #[arg(long, env = "STEPWATCH_FAKE_CUDA")]
    pub fake_cuda: Option<PathBuf>,
    /// When the verdict is step-2 OOM and the agent names a micro-batch that
    /// would fit, run the command again at that micro-batch and report
    /// whether it fits. Needs --batch-arg or --batch-env.
    #[arg(long)]
    pub verify_advice: bool,
    /// How --verify-advice sets the micro-batch: the command's argument that
    /// holds it, rewritten in place (`--batch` for `--batch 8` or
    /// `--batch=8`; `data.batch_size` for a `data.batch_size=8` override).
    /// Its value must be the samples per forward on each rank.
    #[arg(
        long,
        value_name = "NAME",
        allow_hyphen_values = true,
        conflicts_with = "batch_env",
        requires = "verify_advice"
    )]
    pub batch_arg: Option<String>,
    /// How --verify-advice sets the micro-batch: an environment variable the
    /// script reads it from, set for the second run.
    #[arg(long, value_name = "NAME", requires = "verify_advice")]
    pub batch_env: Option<String>,
    /// List the GPU models and exit.
    #[arg(long)]
    pub list_gpus: bool,
    /// The training command, after `--` (e.g. `-- python train.py`,
    /// `-- torchrun --nproc-per-node 4 train.py`).
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// Runs preflight; returns the exit status (errors are printed, status 2).
pub fn main(args: PreflightArgs) -> i32 {
    match run(&args) {
        Ok(status) => status,
        Err(e) => {
            if args.json {
                let v = serde_json::json!({"exit_status": 2, "error": format!("{e:#}")});
                println!("{v:#}");
            }
            eprintln!("stepwatch preflight: error: {e:#}");
            2
        }
    }
}

fn run(args: &PreflightArgs) -> anyhow::Result<i32> {
    if args.list_gpus {
        print!("{}", gpus::table_text());
        return Ok(0);
    }
    anyhow::ensure!(
        !args.command.is_empty(),
        "nothing to run: stepwatch preflight --gpu MODEL -- python train.py ..."
    );
    let setting = BatchSetting::from_args(args.batch_arg.as_deref(), args.batch_env.as_deref())?;
    anyhow::ensure!(
        !args.verify_advice || setting.is_some(),
        "--verify-advice needs to know how the micro-batch size reaches the script:          --batch-arg NAME (the command's `--NAME N` or `NAME=N`) or --batch-env NAME"
    );
    // Checked now, not after the first run.
    let current = match &setting {
        Some(s) => s.current(&args.command)?,
        None => None,
    };
    let setup = Setup::new(args)?;
    let started = Instant::now();
    say(&format!(
        "preflight: {} on {} fake {} ({} usable), {} steps",
        args.command.join(" "),
        setup.count,
        setup.gpu.name,
        gpus::gib(setup.gpu.usable_bytes()),
        args.steps
    ));
    let run = setup.measure(args, &args.command, None)?;
    let verification = setting.map(|s| verify(args, &setup, &run.ranks, &s, current));
    anyhow::ensure!(!setup.interrupted.load(Ordering::Relaxed), "interrupted");
    let report = Report {
        command: &args.command,
        gpu: &setup.gpu,
        gpus: setup.count,
        steps: args.steps,
        seconds: started.elapsed().as_secs_f64(),
        ranks: &run.ranks,
        verification: verification.as_ref(),
    };
    if args.json {
        println!("{:#}", report.json());
    } else {
        print!("{}", report.text());
        if run.ranks.iter().any(|r| r.oom_step.is_some()) {
            println!("\nthe command's last lines:\n{}", run.last_lines);
        }
    }
    std::io::stdout().flush()?;
    Ok(report.exit_status())
}

/// `--verify-advice`: the command again at the advised micro-batch, when
/// there is one to verify.
fn verify(
    args: &PreflightArgs,
    setup: &Setup,
    ranks: &[RankResult],
    setting: &BatchSetting,
    current: Option<u64>,
) -> Verification {
    let advice = match verify::advised(ranks, setup.gpu.usable_bytes(), current) {
        Ok(advice) => advice,
        Err(reason) => return Verification::NotRun(reason),
    };
    let described = setting.describe(advice.micro_batch_size);
    say(&format!("preflight: verifying the advice, {described}"));
    let started = Instant::now();
    let run = setting
        .apply(&args.command, advice.micro_batch_size)
        .and_then(|applied| {
            let run = setup.measure(args, &applied.command, applied.env.as_ref())?;
            Ok((applied, run))
        });
    match run {
        Ok((applied, run)) => Verification::Ran {
            advice,
            setting: described,
            applied,
            ranks: run.ranks,
            seconds: started.elapsed().as_secs_f64(),
        },
        Err(e) => Verification::NotRun(format!("the run with {described} failed: {e:#}")),
    }
}

/// What every run of a preflight shares: the GPUs, and how to run the command.
struct Setup {
    gpu: gpus::GpuModel,
    count: u32,
    python: Option<PathBuf>,
    runner: PathBuf,
    fake_cuda: Launcher,
    nvml_lib: PathBuf,
    interrupted: Arc<AtomicBool>,
}

/// One run of the command, judged.
struct Run {
    ranks: Vec<RankResult>,
    /// The command's last lines, indented.
    last_lines: String,
}

impl Setup {
    fn new(args: &PreflightArgs) -> anyhow::Result<Self> {
        let gpu = match (args.gpu_capacity, &args.gpu) {
            (Some(bytes), _) => gpus::with_capacity(bytes),
            (None, Some(key)) => gpus::lookup(key)?,
            (None, None) => unreachable!("clap requires --gpu or --gpu-capacity"),
        };
        let count = args
            .gpus
            .unwrap_or_else(|| nproc_per_node(&args.command).unwrap_or(1));
        anyhow::ensure!((1..=16).contains(&count), "--gpus must be 1 to 16");
        let python = args
            .python
            .clone()
            .or_else(|| command_python(&args.command));
        let runner = python.clone().unwrap_or_else(|| PathBuf::from("python3"));
        let fake_cuda = find_fake_cuda(args.fake_cuda.as_deref(), &runner)?;
        let nvml_lib = fake_nvml::find_cdylib().context(
            "the fake NVML library (libfake_nvml.so) was not found next to the stepwatch binary \
             (the release tarball ships it beside the binary, the .deb in /usr/lib/stepwatch)",
        )?;
        // Ctrl-C and SIGTERM stop the run (its process group) and end with status 2.
        let interrupted = Arc::new(AtomicBool::new(false));
        for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register(signal, Arc::clone(&interrupted))
                .context("cannot handle Ctrl-C")?;
        }
        Ok(Setup {
            gpu,
            count,
            python,
            runner,
            fake_cuda,
            nvml_lib,
            interrupted,
        })
    }

    /// Runs `command` (with `env` set) on fresh fake GPUs and an agent of
    /// their own, and judges each rank.
    fn measure(
        &self,
        args: &PreflightArgs,
        command: &[String],
        env: Option<&(String, String)>,
    ) -> anyhow::Result<Run> {
        let specs: Vec<GpuSpec> = (0..self.count)
            .map(|i| GpuSpec {
                name: self.gpu.name.clone(),
                total_bytes: self.gpu.total_bytes,
                ..GpuSpec::h100_80gb(i)
            })
            .collect();
        let agent = FakeAgent::start(
            "preflight",
            &specs,
            &fake_agent::Options {
                node_name: Some("preflight"),
                reserved_bytes: Some(self.gpu.reserved_bytes),
                ..Default::default()
            },
        )
        .context("cannot start the agent on fake GPUs")?;
        let usage_dir = agent.dir.join("usage");
        std::fs::create_dir(&usage_dir)?;
        let output = agent.dir.join("job.log");
        let job_id = format!("preflight-{}", std::process::id());

        let mut cmd = Command::new(&self.runner);
        cmd.args(self.fake_cuda.args())
            .args(["run", "--quiet", "--usage-log"])
            .arg(&usage_dir);
        if let Some(py) = &self.python {
            cmd.arg("--python").arg(py);
        }
        if let Some(n) = args.nccl_bytes {
            cmd.args(["--nccl-bytes", &n.to_string()]);
        }
        if let Some((name, value)) = env {
            cmd.env(name, value);
        }
        let log_file = std::fs::File::create(&output)?;
        cmd.arg("--")
            .args(command)
            .env(fake_nvml::STATE_DIR_ENV, &agent.dir)
            .env("STEPWATCH_ENDPOINT", &agent.endpoint)
            .env("STEPWATCH_JOB_ID", &job_id)
            .env("STEPWATCH_STOP_AFTER_STEP", args.steps.to_string())
            .env("STEPWATCH_BIN", std::env::current_exe()?)
            .env("STEPWATCH_FAKE_NVML_LIB", &self.nvml_lib)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            // Its own process group: a timeout or Ctrl-C stops torchrun's workers too.
            .process_group(0);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot run fake CUDA's launcher ({:?})", self.fake_cuda))?;
        let deadline = Instant::now() + Duration::from_secs(args.timeout);
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            let why = if self.interrupted.load(Ordering::Relaxed) {
                Some("interrupted".to_string())
            } else if Instant::now() > deadline {
                Some(format!(
                    "the run took more than --timeout {} s",
                    args.timeout
                ))
            } else {
                None
            };
            if let Some(why) = why {
                // SAFETY: kill(2) on the process group this function created.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                anyhow::bail!("{why}; its output:\n{}", tail(&output, 30));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let text = std::fs::read_to_string(&output).unwrap_or_default();
        let said_oom = text.contains("OutOfMemoryError") || text.contains("CUDA out of memory");
        if !status.success() && !said_oom {
            anyhow::bail!(
                "the command failed ({status}) without running out of memory; its output:\n{}",
                tail(&output, 30)
            );
        }

        let reports = rank_reports(&agent, &job_id, args.steps)?;
        let usage = truth::Usage::read(&usage_dir)?;
        anyhow::ensure!(
            reports.is_empty() || !usage.is_empty(),
            "fake CUDA wrote no usage log (in {}): is the command's torch the one fake CUDA \
             built for? Its output:\n{}",
            usage_dir.display(),
            tail(&output, 30)
        );
        let mut ranks: Vec<RankResult> = reports.iter().map(|r| judge(r, &usage)).collect();
        if ranks.is_empty() {
            anyhow::ensure!(
                said_oom,
                "no stepwatch client reached the agent: does the script call \
                 stepwatch.watch(model, optimizer) (or use the Lightning / Hugging Face \
                 callback), and is stepwatch installed for its Python? Its output:\n{}",
                tail(&output, 30)
            );
            // Out of memory before the client said hello (building the model).
            ranks.push(RankResult {
                oom_step: Some(0),
                ..Default::default()
            });
        }
        let any_oom = ranks.iter().any(|r| r.oom_step.is_some());
        for r in &mut ranks {
            if r.oom_step.is_none() && r.steps_completed < args.steps {
                anyhow::ensure!(
                    any_oom,
                    "rank {} ended after {} step(s), before step {}: run the script for more \
                     steps, or lower --steps (at least 2)",
                    r.rank,
                    r.steps_completed,
                    args.steps
                );
                r.aborted = true;
            }
        }
        if said_oom && !any_oom {
            anyhow::bail!(
                "the command ran out of memory but no rank's client reported it; its output:\n{}",
                tail(&output, 30)
            );
        }
        Ok(Run {
            ranks,
            last_lines: tail(&output, 8),
        })
    }
}

/// A progress line on stderr (never on stdout: `--json` owns it).
fn say(line: &str) {
    eprintln!("{line}");
}

/// One rank from its report and the usage log.
fn judge(rep: &Value, usage: &truth::Usage) -> RankResult {
    let uuid = rep["info"]["gpu_uuid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let steps: Vec<(u64, u64, u64)> = rep["steps"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| {
                    let begin = s["begin_monotonic_ns"].as_u64()?;
                    let dur = s["duration_seconds"].as_f64().unwrap_or(0.0);
                    Some((s["step"].as_u64()?, begin, begin + (dur * 1e9) as u64))
                })
                .collect()
        })
        .unwrap_or_default();
    let window = |from: u64, to: u64| {
        let begin = steps.iter().find(|s| s.0 == from)?.1;
        let end = steps.iter().filter(|s| s.0 <= to).map(|s| s.2).max()?;
        usage.peak(&uuid, begin, end)
    };
    let completed = rep["steps_completed"].as_u64().unwrap_or(0);
    let oom_step =
        (rep["ooms"].as_u64().unwrap_or(0) > 0).then(|| rep["last_step"].as_u64().unwrap_or(0));
    RankResult {
        rank: rep["rank"].as_u64().unwrap_or(0) as u32,
        gpu_uuid: uuid.clone(),
        steps_completed: completed,
        oom_step,
        aborted: false,
        step1_peak_bytes: window(1, 1),
        steady_peak_bytes: if oom_step.is_none() && completed >= 2 {
            window(2, completed)
        } else {
            None
        },
        prediction: rep["prediction_before_step2"].clone(),
        advisories: rep["advisories"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| {
                        (
                            x["kind"].as_str().unwrap_or("?").to_string(),
                            x["message"].as_str().unwrap_or_default().to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// Every rank's report, once its stream has closed (the agent has applied all of it).
fn rank_reports(agent: &FakeAgent, job: &str, steps: u64) -> anyhow::Result<Vec<Value>> {
    let get = |path: &str| -> Option<Value> {
        match http_get::get(agent.http, path) {
            Ok((200, body)) => serde_json::from_str(&body).ok(),
            _ => None,
        }
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let listing = get(&format!("/api/v1/jobs/{job}")).unwrap_or(Value::Null);
        let mut ranks: Vec<u64> = listing["ranks"]
            .as_array()
            .map(|a| a.iter().filter_map(|r| r["rank"].as_u64()).collect())
            .unwrap_or_default();
        ranks.sort_unstable();
        let reports: Vec<Value> = ranks
            .iter()
            .filter_map(|r| get(&format!("/api/v1/jobs/{job}/ranks/{r}?steps={}", steps + 1)))
            .collect();
        let closed = reports.iter().all(|r| r["connected"] == false);
        if (reports.len() == ranks.len() && closed) || Instant::now() > deadline {
            return Ok(reports);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// torchrun's `--nproc-per-node N` (or `--nproc_per_node=N`) in the command.
fn nproc_per_node(command: &[String]) -> Option<u32> {
    let mut it = command.iter();
    while let Some(a) = it.next() {
        for flag in ["--nproc-per-node", "--nproc_per_node"] {
            if a == flag {
                return it.next()?.parse().ok();
            }
            if let Some(v) = a.strip_prefix(flag).and_then(|v| v.strip_prefix('=')) {
                return v.parse().ok();
            }
        }
    }
    None
}

/// The Python that runs the command: its own first word when that is a Python,
/// or the `python` next to its `torchrun` / `accelerate` / `lightning` launcher.
fn command_python(command: &[String]) -> Option<PathBuf> {
    let first = Path::new(command.first()?);
    let resolved = if first.components().count() > 1 {
        first.to_path_buf()
    } else {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(first))
                .find(|p| p.is_file())
        })?
    };
    let name = resolved.file_name()?.to_str()?;
    if name.starts_with("python") {
        return Some(resolved);
    }
    let sibling = resolved.parent()?.join("python");
    sibling.is_file().then_some(sibling)
}

/// How fake CUDA's launcher is run: a script (the flag, $STEPWATCH_FAKE_CUDA,
/// or the checkout's `crates/fake-cuda/fake-cuda`), or the installed Python
/// package's module (`python -m stepwatch.fake_cuda`).
#[derive(Debug, Clone, PartialEq)]
enum Launcher {
    Script(PathBuf),
    Module,
}

impl Launcher {
    /// The arguments that follow the Python.
    fn args(&self) -> Vec<std::ffi::OsString> {
        match self {
            Launcher::Script(path) => vec![path.into()],
            Launcher::Module => vec!["-m".into(), "stepwatch.fake_cuda".into()],
        }
    }
}

/// The flag or $STEPWATCH_FAKE_CUDA, else the checkout's launcher, else the
/// module of the stepwatch package installed for `python` (checked here, so
/// that its absence is said plainly).
fn find_fake_cuda(given: Option<&Path>, python: &Path) -> anyhow::Result<Launcher> {
    if let Some(p) = given {
        anyhow::ensure!(p.is_file(), "no fake CUDA launcher at {}", p.display());
        return Ok(Launcher::Script(p.to_path_buf()));
    }
    let exe = std::env::current_exe().ok();
    // A dev build also knows the checkout it was built in; a release binary
    // goes by where it is.
    let built_in = cfg!(feature = "dev-tools").then(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    let checkout = exe
        .iter()
        .flat_map(|e| e.ancestors().skip(1).take(4))
        .map(Path::to_path_buf)
        .chain(built_in)
        .map(|d| d.join("crates/fake-cuda/fake-cuda"))
        .find(|c| c.is_file());
    if let Some(script) = checkout {
        return Ok(Launcher::Script(script));
    }
    let found = Command::new(python)
        .args(["-c", "import stepwatch.fake_cuda"])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {}", python.display()))?;
    anyhow::ensure!(
        found.status.success(),
        "the stepwatch Python package (with its fake CUDA) is not installed for {}: \
         `{} -m pip install stepwatch`, or name another Python with --python\n{}",
        python.display(),
        python.display(),
        String::from_utf8_lossy(&found.stderr).trim()
    );
    Ok(Launcher::Module)
}

/// The last `n` lines of a file, indented.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| format!("    {l}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn gpus_default_to_torchruns_processes() {
        assert_eq!(
            nproc_per_node(&words("torchrun --nproc-per-node 4 t.py")),
            Some(4)
        );
        assert_eq!(
            nproc_per_node(&words("torchrun --nproc_per_node=2 t.py")),
            Some(2)
        );
        assert_eq!(nproc_per_node(&words("python t.py")), None);
    }

    #[test]
    fn the_commands_python_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let py = dir.path().join("python");
        let torchrun = dir.path().join("torchrun");
        std::fs::write(&py, "").unwrap();
        std::fs::write(&torchrun, "").unwrap();
        let cmd = |first: &Path| vec![first.display().to_string(), "t.py".into()];
        assert_eq!(command_python(&cmd(&py)), Some(py.clone()));
        assert_eq!(command_python(&cmd(&torchrun)), Some(py.clone()));
        std::fs::remove_file(&py).unwrap();
        assert_eq!(command_python(&cmd(&torchrun)), None);
    }
}
