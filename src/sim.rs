//! `stepwatch sim` (one simulated training rank) and `stepwatch fake-gpu`
//! (manage a fake NVML state directory).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use fake_nvml::{FakeNvml, GpuSpec};
use stepwatch_client::{Client, ClientOptions, DEFAULT_ENDPOINT};
use stepwatch_proto::v1::{Hello, Identity, MarkerKind};

const GIB: u64 = 1 << 30;

#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Agent endpoint: unix:///path or host:port.
    #[arg(long, env = "STEPWATCH_ENDPOINT", default_value = DEFAULT_ENDPOINT)]
    pub endpoint: String,
    /// Fake NVML state directory the rank writes its GPU memory to.
    #[arg(long, env = fake_nvml::STATE_DIR_ENV)]
    pub fake_nvml_dir: PathBuf,
    /// Index of the fake GPU this rank runs on.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    #[arg(long, default_value = "sim-job")]
    pub job: String,
    #[arg(long, default_value_t = 0)]
    pub rank: u32,
    #[arg(long, default_value_t = 1)]
    pub world_size: u32,
    /// Steps to run; 0 runs until killed.
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Wall time of one step, in milliseconds.
    #[arg(long, default_value_t = 400)]
    pub step_ms: u64,
    /// Weights in GiB; grads match them and Adam state is twice them.
    #[arg(long, default_value_t = 4.0)]
    pub weights_gib: f64,
    /// Peak activations in GiB.
    #[arg(long, default_value_t = 8.0)]
    pub activations_gib: f64,
}

/// Runs one rank of a crude Adam training job: weights, activations that
/// rise through forward and fall through backward, grads, and optimizer
/// state created in the first step. Memory goes to the fake NVML state under
/// this process's PID; markers go to the agent through the real client.
pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let fake = FakeNvml::open(&args.fake_nvml_dir).with_context(|| {
        format!(
            "cannot open fake NVML state in {}",
            args.fake_nvml_dir.display()
        )
    })?;
    anyhow::ensure!(
        args.gpu < fake.gpu_count(),
        "--gpu {} does not exist; the fake state has {} GPU(s)",
        args.gpu,
        fake.gpu_count()
    );
    let pid = std::process::id();
    let hello = Hello {
        identity: Some(Identity {
            job_id: args.job.clone(),
            rank: args.rank,
            local_rank: args.rank,
            world_size: args.world_size,
            node_name: "sim".into(),
            ..Default::default()
        }),
        gpu_uuid: fake.gpu_uuid(args.gpu),
        pid,
        framework: "stepwatch-sim".into(),
        framework_version: env!("CARGO_PKG_VERSION").into(),
        client_version: env!("CARGO_PKG_VERSION").into(),
        model: None,
    };
    let client = Client::start(ClientOptions::new(&args.endpoint, hello));

    let weights = (args.weights_gib * GIB as f64) as u64;
    let activations = (args.activations_gib * GIB as f64) as u64;
    let context = 512 << 20;
    let mut state_bytes = 0;
    let phase = Duration::from_millis(args.step_ms / 4);
    let ticks = 8u64;
    let set = |bytes: u64| {
        if let Err(e) = fake.set_process_memory(args.gpu, pid, context + bytes) {
            tracing::warn!(error = %e, "cannot write fake GPU memory");
        }
    };
    set(weights);
    let mut step = 1;
    while args.steps == 0 || step <= args.steps {
        client.mark_now(MarkerKind::StepBegin, step, 0);
        client.mark_now(MarkerKind::ForwardBegin, step, 0);
        for i in 1..=ticks {
            set(weights + state_bytes + activations * i / ticks);
            std::thread::sleep(phase / ticks as u32);
        }
        client.mark_now(MarkerKind::BackwardBegin, step, 0);
        for i in 1..=ticks {
            set(weights + state_bytes + activations * (ticks - i) / ticks + weights * i / ticks);
            std::thread::sleep(phase / ticks as u32);
        }
        client.mark_now(MarkerKind::OptimizerBegin, step, 0);
        state_bytes = 2 * weights;
        set(weights * 2 + state_bytes);
        std::thread::sleep(phase);
        client.mark_now(MarkerKind::OptimizerEnd, step, 0);
        set(weights + state_bytes);
        std::thread::sleep(phase);
        client.mark_now(MarkerKind::StepEnd, step, 0);
        step += 1;
    }
    let stats = client.close(Duration::from_secs(5));
    fake.remove_process(args.gpu, pid);
    tracing::info!(?stats, "simulated rank finished");
    Ok(())
}

#[derive(Debug, Clone, clap::Args)]
pub struct FakeGpuArgs {
    /// The state directory (what STEPWATCH_FAKE_NVML_DIR names for the library).
    #[arg(long, env = fake_nvml::STATE_DIR_ENV)]
    pub dir: PathBuf,
    #[command(subcommand)]
    pub action: FakeGpuAction,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum FakeGpuAction {
    /// Create the state with N H100-80GB-like GPUs (replaces an existing one).
    Init {
        #[arg(long, default_value_t = 2)]
        gpus: u32,
        /// Capacity of each GPU in GiB.
        #[arg(long)]
        total_gib: Option<f64>,
    },
    /// Make NVML unavailable (init fails, calls fail) or available again.
    Unavailable {
        #[arg(action = clap::ArgAction::Set)]
        on: bool,
    },
    /// Mark one GPU lost or found.
    Lost {
        gpu: u32,
        #[arg(action = clap::ArgAction::Set)]
        on: bool,
    },
    /// Print the GPUs and their processes.
    Show,
    /// Print the path of the fake libnvidia-ml built next to this binary.
    LibPath,
}

pub fn fake_gpu(args: FakeGpuArgs) -> anyhow::Result<()> {
    let open = || {
        FakeNvml::open(&args.dir).with_context(|| {
            format!(
                "no fake NVML state in {}; run `stepwatch fake-gpu --dir {} init` first",
                args.dir.display(),
                args.dir.display()
            )
        })
    };
    match args.action {
        FakeGpuAction::Init { gpus, total_gib } => {
            anyhow::ensure!((1..=16).contains(&gpus), "--gpus must be 1..=16");
            let specs: Vec<GpuSpec> = (0..gpus)
                .map(|i| {
                    let mut spec = GpuSpec::h100_80gb(i);
                    if let Some(gib) = total_gib {
                        spec.total_bytes = (gib * GIB as f64) as u64;
                    }
                    spec
                })
                .collect();
            FakeNvml::create(&args.dir, &specs)?;
            println!("created {} fake GPU(s) in {}", gpus, args.dir.display());
        }
        FakeGpuAction::Unavailable { on } => open()?.set_unavailable(on),
        FakeGpuAction::Lost { gpu, on } => {
            let fake = open()?;
            anyhow::ensure!(gpu < fake.gpu_count(), "GPU {gpu} does not exist");
            fake.set_gpu_lost(gpu, on);
        }
        FakeGpuAction::Show => {
            let fake = open()?;
            for gpu in 0..fake.gpu_count() {
                println!(
                    "gpu {gpu} {} used {} / {} bytes, processes {:?}",
                    fake.gpu_uuid(gpu),
                    fake.device_used_bytes(gpu),
                    fake.total_bytes(gpu),
                    fake.processes(gpu)
                );
            }
        }
        FakeGpuAction::LibPath => {
            let lib = fake_nvml::find_cdylib().context(
                "the fake libnvidia-ml was not built next to this binary; run `cargo build`",
            )?;
            println!("{}", lib.display());
        }
    }
    Ok(())
}
