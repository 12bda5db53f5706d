//! `stepwatch`: the per-node agent and its tools, in one binary.

// Development tools (feature `dev-tools`, on by default; the agent image
// is built without them).
#[cfg(feature = "dev-tools")]
mod bench;
#[cfg(feature = "dev-tools")]
mod demo;
#[cfg(feature = "preflight")]
mod fake_agent;
#[cfg(feature = "preflight")]
mod preflight;
mod replay_record;
#[cfg(feature = "dev-tools")]
mod sim;

use clap::{Parser, Subcommand};

/// GPU memory monitoring that knows what a training step is.
///
/// The agent samples every GPU through NVML, takes step markers from
/// training processes over gRPC, and joins the two into per-step, per-phase
/// memory profiles exported to Prometheus.
#[derive(Parser)]
#[command(name = "stepwatch", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once at start-up; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Run the per-node agent (one per GPU node, e.g. as a DaemonSet).
    Agent(stepwatch_agent::AgentConfig),
    #[cfg(feature = "dev-tools")]
    /// Run a self-contained demo: the agent on 2 simulated GPUs (fake NVML)
    /// with simulated training jobs. Needs no GPU.
    Demo(demo::DemoArgs),
    #[cfg(feature = "dev-tools")]
    /// Run one simulated training rank against an agent (for tests and demos).
    Sim(sim::SimArgs),
    #[cfg(feature = "dev-tools")]
    /// Create or change a fake NVML state directory (simulated GPUs and faults).
    FakeGpu(sim::FakeGpuArgs),
    #[cfg(feature = "dev-tools")]
    /// Benchmarks that need the whole system (e.g. `bench accuracy`).
    Bench(bench::BenchArgs),
    #[cfg(feature = "preflight")]
    /// Will this training script run out of GPU memory on that GPU? Runs it
    /// for a few steps on fake GPUs of that model (fake CUDA, an agent) and
    /// says, before the job is queued. Needs no GPU.
    Preflight(preflight::PreflightArgs),
    /// Replay an agent's `--record` file through the step model: each rank's
    /// prediction made before step 2 against the steady-state peak after it.
    ReplayRecord(replay_record::ReplayRecordArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Agent(config) => {
            stepwatch_agent::init_logging(config.log_format);
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(stepwatch_agent::run(config))
        }
        #[cfg(feature = "dev-tools")]
        Command::Demo(args) => demo::run(args),
        #[cfg(feature = "dev-tools")]
        Command::Sim(args) => {
            stepwatch_agent::init_logging(stepwatch_agent::LogFormat::Text);
            sim::run(args)
        }
        #[cfg(feature = "dev-tools")]
        Command::FakeGpu(args) => sim::fake_gpu(args),
        #[cfg(feature = "dev-tools")]
        Command::Bench(args) => bench::run(args),
        #[cfg(feature = "preflight")]
        Command::Preflight(args) => std::process::exit(preflight::main(args)),
        Command::ReplayRecord(args) => replay_record::run(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every argument of every subcommand says what it is in `--help`.
    #[test]
    fn every_argument_has_help_text() {
        fn missing(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    out.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                missing(sub, &format!("{path} {}", sub.get_name()), out);
            }
        }
        let mut out = Vec::new();
        missing(&Cli::command(), "stepwatch", &mut out);
        assert!(out.is_empty(), "arguments without help: {out:#?}");
    }
}
