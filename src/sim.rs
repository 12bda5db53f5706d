//! `stepwatch sim` (one simulated training rank, as its own process) and
//! `stepwatch fake-gpu` (manage a fake NVML state directory).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use fake_nvml::{FakeNvml, GpuSpec, MigSpec};
use stepwatch_client::{Client, ClientOptions, DEFAULT_ENDPOINT};
use stepwatch_core::{AllocatorTrace, Marker, MarkerKind};
use stepwatch_proto::convert;
use stepwatch_sim::{RankSim, Scenario, Sink};

const GIB: u64 = 1 << 30;

/// Exit code of a rank that ran out of (simulated) GPU memory.
pub const OOM_EXIT_CODE: i32 = 3;

/// `stepwatch sim` as a process of its own, quiet: `scenario` on fake GPU
/// `gpu` at `speed`, its markers to `endpoint`, its memory written into the
/// fake NVML state in `fake_nvml_dir`. The caller adds its own arguments.
pub fn command(
    exe: &Path,
    scenario: &str,
    gpu: u32,
    speed: f64,
    endpoint: &str,
    fake_nvml_dir: &Path,
) -> Command {
    let mut command = Command::new(exe);
    command
        .args(["sim", "--scenario", scenario])
        .args(["--gpu", &gpu.to_string(), "--speed", &speed.to_string()])
        .arg("--endpoint")
        .arg(endpoint)
        .arg("--fake-nvml-dir")
        .arg(fake_nvml_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Scenario: a built-in name (see --list) or a path to a scenario JSON file.
    #[arg(long, default_value = "demo-small")]
    pub scenario: String,
    /// List the built-in scenarios and exit.
    #[arg(long)]
    pub list: bool,
    /// Rank of the scenario to run.
    #[arg(long, default_value_t = 0)]
    pub rank: u32,
    /// Job id sent to the agent (default: the scenario name).
    #[arg(long)]
    pub job: Option<String>,
    /// Steps to run (default: the scenario's).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Time scale: 2 runs twice as fast as the scenario's timings, 0.1 ten times slower.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Agent endpoint: unix:///path or host:port.
    #[arg(long, env = "STEPWATCH_ENDPOINT", default_value = DEFAULT_ENDPOINT)]
    pub endpoint: String,
    /// Fake NVML state directory the rank writes its GPU memory to.
    #[arg(long, env = fake_nvml::STATE_DIR_ENV)]
    pub fake_nvml_dir: Option<PathBuf>,
    /// Index of the fake GPU this rank runs on (default: the rank, modulo the GPU count);
    /// MIG slices are numbered after the GPUs (`fake-gpu show` lists them).
    #[arg(long)]
    pub gpu: Option<u32>,
    /// Do not send step 1's allocator trace (as a client that cannot record
    /// the allocator's history): the agent predicts from markers alone.
    #[arg(long)]
    pub no_allocator_trace: bool,
    /// Before this step begins, wait until --release-file exists (a test
    /// checks what the agent said about the steps before; the rank resumes
    /// at the scenario's pace).
    #[arg(long, requires = "release_file")]
    pub hold_before_step: Option<u64>,
    /// The file whose creation releases a rank held by --hold-before-step.
    #[arg(long, requires = "hold_before_step")]
    pub release_file: Option<PathBuf>,
}

/// Writes the rank's memory into the fake NVML state under this PID, sends
/// markers through the real client, and reads co-located processes' memory.
struct LiveRank<'a> {
    fake: &'a FakeNvml,
    gpu: u32,
    pid: u32,
    client: &'a Client,
    oom_step: Option<u64>,
    /// Step to hold before, and the file that releases it.
    hold: Option<(u64, PathBuf)>,
}

impl Sink for LiveRank<'_> {
    fn memory(&mut self, nvml_used_bytes: u64) {
        if let Err(e) = self
            .fake
            .set_process_memory(self.gpu, self.pid, nvml_used_bytes)
        {
            tracing::warn!(error = %e, "cannot write fake GPU memory");
        }
    }

    fn marker(&mut self, m: Marker) {
        if m.kind == MarkerKind::Oom {
            self.oom_step = Some(m.step);
        }
        self.client.mark(convert::marker_to_wire(&m));
    }

    fn allocator_trace(&mut self, trace: &AllocatorTrace) {
        let chunks = convert::allocator_trace_to_wire(trace);
        tracing::debug!(
            events = trace.events.len(),
            chunks = chunks.len(),
            "sending step 1's allocator trace"
        );
        self.client.send_allocator_trace(chunks);
    }

    fn before_marker(&mut self, m: &Marker) {
        let Some((step, release)) = &self.hold else {
            return;
        };
        if m.kind != MarkerKind::StepBegin || m.step != *step {
            return;
        }
        // Sent markers first: what the holder checks must have reached the agent.
        self.client.flush(Duration::from_secs(5));
        tracing::info!(step, release = %release.display(), "holding before the step");
        while !release.exists() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn other_process_bytes(&mut self) -> Option<u64> {
        let others = self
            .fake
            .processes(self.gpu)
            .into_iter()
            .filter(|(pid, _)| *pid != self.pid)
            .map(|(_, bytes)| bytes)
            .sum();
        Some(others)
    }
}

/// Loads a built-in scenario by name, or a scenario file by path.
pub fn load_scenario(name_or_path: &str) -> anyhow::Result<Scenario> {
    if let Some(s) = stepwatch_sim::builtin_scenario(name_or_path) {
        return Ok(s);
    }
    let path = std::path::Path::new(name_or_path);
    if path.exists() {
        return Scenario::load(path).map_err(Into::into);
    }
    let names: Vec<&str> = stepwatch_sim::scenario::BUILTIN
        .iter()
        .map(|(n, _)| *n)
        .collect();
    anyhow::bail!(
        "no scenario {name_or_path:?}: neither a built-in ({}) nor a file",
        names.join(", ")
    )
}

/// Runs one rank of a scenario in real time. Exits with OOM_EXIT_CODE when
/// the rank runs out of memory, as a training process dies on a CUDA OOM.
pub fn run(args: SimArgs) -> anyhow::Result<()> {
    if args.list {
        for scenario in stepwatch_sim::builtin_scenarios()? {
            println!("{:18} {}", scenario.name, scenario.description);
        }
        return Ok(());
    }
    let mut scenario = load_scenario(&args.scenario)?;
    let dir = args.fake_nvml_dir.clone().context(
        "--fake-nvml-dir (or STEPWATCH_FAKE_NVML_DIR) is required: the simulated GPUs live there",
    )?;
    let fake = FakeNvml::open(&dir)
        .with_context(|| format!("cannot open fake NVML state in {}", dir.display()))?;
    let gpu = args.gpu.unwrap_or(args.rank % fake.gpu_count().max(1));
    anyhow::ensure!(
        gpu < fake.device_count(),
        "--gpu {gpu} does not exist; the fake state has {} GPU(s) and {} MIG slice(s)",
        fake.gpu_count(),
        fake.device_count() - fake.gpu_count()
    );
    // The simulated GPU is the one the agent sees.
    // What a process can use, as on a real GPU: the driver keeps `reserved`.
    scenario.gpu.capacity_bytes = fake.total_bytes(gpu) - fake.reserved_bytes(gpu);
    if let Some(steps) = args.steps {
        scenario.training.steps = steps;
    }
    let mut rank = RankSim::new(&scenario, args.rank)?;
    rank.set_allocator_trace(!args.no_allocator_trace);
    let pid = std::process::id();
    let job = args.job.clone().unwrap_or_else(|| scenario.name.clone());
    let hello = convert::hello_to_wire(
        &rank.rank_info(&job, &fake.gpu_uuid(gpu), pid),
        env!("CARGO_PKG_VERSION"),
    );
    let client = Client::start(ClientOptions::new(&args.endpoint, hello));
    tracing::info!(scenario = %scenario.name, job = %job, rank = args.rank, gpu, pid, "simulated rank starting");

    let mut sink = LiveRank {
        fake: &fake,
        gpu,
        pid,
        client: &client,
        oom_step: None,
        hold: args.hold_before_step.zip(args.release_file.clone()),
    };
    stepwatch_sim::run_realtime(
        &mut rank,
        &mut sink,
        &stepwatch_proto::clock::monotonic_ns,
        args.speed,
    );
    let oom_step = sink.oom_step;
    let stats = client.close(Duration::from_secs(5));
    fake.remove_process(gpu, pid);
    tracing::info!(?stats, "simulated rank finished");
    if let Some(step) = oom_step {
        eprintln!(
            "torch.OutOfMemoryError: CUDA out of memory (simulated): job {job} rank {} died in step {step}",
            args.rank
        );
        std::process::exit(OOM_EXIT_CODE);
    }
    Ok(())
}

#[derive(Debug, Clone, clap::Args)]
pub struct FakeGpuArgs {
    /// The state directory (what STEPWATCH_FAKE_NVML_DIR names for the
    /// library); every action but `lib-path` needs it.
    #[arg(long, env = fake_nvml::STATE_DIR_ENV)]
    pub dir: Option<PathBuf>,
    #[command(subcommand)]
    pub action: FakeGpuAction,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum FakeGpuAction {
    /// Create the state with N H100-80GB-like GPUs (replaces an existing one).
    Init {
        /// How many GPUs (1 to 16).
        #[arg(long, default_value_t = 2)]
        gpus: u32,
        /// Capacity of each GPU in GiB (default: 80 GB H100).
        #[arg(long, conflicts_with = "total_bytes")]
        total_gib: Option<f64>,
        /// Capacity of each GPU in bytes, exactly (NVML's `total`; the driver
        /// reserves 512 MiB of it, as `fake-gpu show` and NVML report).
        #[arg(long)]
        total_bytes: Option<u64>,
        /// Put every GPU in MIG mode with this many 1g.10gb slices (1 to 7), GPU
        /// instance ids 7, 8, ...; slices are device numbers after the GPUs.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=7))]
        mig_slices: Option<u32>,
    },
    /// Make NVML unavailable (init fails, calls fail) or available again.
    Unavailable {
        /// true: NVML is unavailable; false: available again.
        #[arg(action = clap::ArgAction::Set)]
        on: bool,
    },
    /// Mark one GPU lost or found.
    Lost {
        /// Index of the GPU.
        gpu: u32,
        /// true: lost (NVML says GPU_IS_LOST); false: found again.
        #[arg(action = clap::ArgAction::Set)]
        on: bool,
    },
    /// Print the GPUs and their processes.
    Show,
    /// Print the path of the fake libnvidia-ml built next to this binary
    /// (needs no --dir).
    LibPath,
}

pub fn fake_gpu(args: FakeGpuArgs) -> anyhow::Result<()> {
    if let FakeGpuAction::LibPath = args.action {
        let lib = fake_nvml::find_cdylib().context(
            "the fake libnvidia-ml was not built next to this binary; run `cargo build`",
        )?;
        println!("{}", lib.display());
        return Ok(());
    }
    let dir = args.dir.context(
        "--dir (or STEPWATCH_FAKE_NVML_DIR) is required: the fake GPUs' state directory",
    )?;
    let open = || {
        FakeNvml::open(&dir).with_context(|| {
            format!(
                "no fake NVML state in {0}; run `stepwatch fake-gpu --dir {0} init` first",
                dir.display()
            )
        })
    };
    match args.action {
        FakeGpuAction::Init {
            gpus,
            total_gib,
            total_bytes,
            mig_slices,
        } => {
            anyhow::ensure!((1..=16).contains(&gpus), "--gpus must be 1..=16");
            let specs: Vec<GpuSpec> = (0..gpus)
                .map(|i| {
                    let mut spec = GpuSpec::h100_80gb(i);
                    if let Some(gib) = total_gib {
                        spec.total_bytes = (gib * GIB as f64) as u64;
                    }
                    if let Some(bytes) = total_bytes {
                        spec.total_bytes = bytes;
                    }
                    spec
                })
                .collect();
            let migs: Vec<MigSpec> = (0..gpus)
                .flat_map(|g| {
                    (0..mig_slices.unwrap_or(0)).map(move |i| MigSpec::h100_1g_10gb(g, 7 + i))
                })
                .collect();
            FakeNvml::create_with_mig(&dir, &specs, &migs)?;
            println!(
                "created {} fake GPU(s) and {} MIG slice(s) in {}",
                gpus,
                migs.len(),
                dir.display()
            );
        }
        FakeGpuAction::Unavailable { on } => open()?.set_unavailable(on),
        FakeGpuAction::Lost { gpu, on } => {
            let fake = open()?;
            anyhow::ensure!(gpu < fake.gpu_count(), "GPU {gpu} does not exist");
            fake.set_gpu_lost(gpu, on);
        }
        FakeGpuAction::Show => {
            let fake = open()?;
            for gpu in 0..fake.device_count() {
                println!(
                    "gpu {gpu} {} used {} / {} bytes, processes {:?}",
                    fake.gpu_uuid(gpu),
                    fake.device_used_bytes(gpu),
                    fake.total_bytes(gpu),
                    fake.processes(gpu)
                );
            }
        }
        FakeGpuAction::LibPath => unreachable!("answered above"),
    }
    Ok(())
}
