//! `stepwatch bench accuracy`: every scenario through the real agent, fake
//! NVML and simulated ranks as processes, and how well the step-2
//! prediction did.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use fake_nvml::GpuSpec;
use serde_json::Value;
use stepwatch_sim::Scenario;

use stepwatch::http_get;

use crate::fake_agent::{self, FakeAgent};

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub kind: BenchKind,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum BenchKind {
    /// Prediction accuracy and step-2 OOM warnings over the scenario suite.
    Accuracy(AccuracyArgs),
    /// Marker ingest throughput over the Unix socket, marker-to-report
    /// latency, /metrics latency and agent RSS with 8 GPUs and 8 ranks.
    Ingest(IngestArgs),
    /// `/metrics`, the rank API, `/healthz` and marker-to-report latency
    /// with 256 ranks x 1,000 retained steps while every rank keeps stepping.
    Scrape(ScrapeArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct ScrapeArgs {
    /// Ranks (one stream each), filled with --steps steps before measuring.
    #[arg(long, default_value_t = 256)]
    pub ranks: u32,
    /// Steps each rank holds when measuring starts (1,000: the retention).
    #[arg(long, default_value_t = 1000)]
    pub steps: u64,
    /// How long to measure while ingest runs.
    #[arg(long, default_value_t = 30)]
    pub seconds: u64,
    /// Each rank's step period while measuring, ms.
    #[arg(long, default_value_t = 100)]
    pub step_ms: u64,
    /// The agent's --memory-budget-mib: large enough by default to keep
    /// every step of every rank (about 2 MiB per 1,000 steps of a rank).
    #[arg(long, default_value_t = 1024)]
    pub memory_budget_mib: u64,
    /// Pause between `/metrics` scrapes, ms (0: back to back).
    #[arg(long, default_value_t = 1000)]
    pub metrics_every_ms: u64,
    /// Pause between rank reports, ms (0: back to back).
    #[arg(long, default_value_t = 100)]
    pub api_every_ms: u64,
    /// Run this agent binary instead of this one (to measure another build).
    #[arg(long)]
    pub agent_bin: Option<PathBuf>,
}

#[derive(Debug, Clone, clap::Args)]
pub struct IngestArgs {
    /// Concurrent ranks (one stream each).
    #[arg(long, default_value_t = 8)]
    pub ranks: u32,
    /// Steps each rank pushes (6 markers per step); 1,000 fill the agent's retention.
    #[arg(long, default_value_t = 2000)]
    pub steps: u64,
    /// Round trips measured for marker-to-report latency.
    #[arg(long, default_value_t = 200)]
    pub latency_samples: u32,
}

#[derive(Debug, Clone, clap::Args)]
pub struct AccuracyArgs {
    /// Scenarios to run (default: every built-in one). Repeatable.
    #[arg(long = "scenario")]
    pub scenarios: Vec<String>,
    /// Time scale of the simulated jobs (2 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Target: median absolute error of the step-2 prediction, in percent.
    #[arg(long, default_value_t = 2.0)]
    pub max_median_error: f64,
    /// Target: maximum absolute error of the step-2 prediction, in percent.
    #[arg(long, default_value_t = 5.0)]
    pub max_error: f64,
    /// Simulated clients send no step-1 allocator trace: measures the
    /// prediction from markers alone.
    #[arg(long)]
    pub no_allocator_trace: bool,
    /// Keep each agent's `--record` here (`<first scenario>-x<scale>.jsonl`),
    /// to replay a surprising row with `stepwatch replay-record --timeline`.
    #[arg(long)]
    pub record_dir: Option<PathBuf>,
}

/// One rank of one scenario, measured.
#[derive(Debug, Clone)]
struct Row {
    scenario: String,
    rank: u32,
    expected_oom: bool,
    died_in_step: Option<u64>,
    predicted: Option<u64>,
    /// What the prediction was computed from (allocator_replay, allocator, nvml_only).
    basis: Option<String>,
    actual: Option<u64>,
    capacity: u64,
    /// Warning kind and its lead over step 2's begin (ms; None: step 2 never began).
    warning: Option<(String, Option<f64>)>,
}

impl Row {
    fn error(&self) -> Option<f64> {
        match (self.predicted, self.actual) {
            (Some(p), Some(a)) if a > 0 => Some((p as f64 - a as f64) / a as f64),
            _ => None,
        }
    }

    fn true_headroom(&self) -> Option<f64> {
        self.actual
            .map(|a| (self.capacity as f64 - a as f64) / self.capacity.max(1) as f64)
    }

    fn warned_in_time(&self) -> bool {
        matches!(&self.warning, Some((kind, lead)) if kind == "step2_oom_predicted" && lead.is_none_or(|ms| ms > 0.0))
    }

    fn false_alarm(&self) -> bool {
        self.warning.is_some() && self.true_headroom().is_some_and(|h| h >= 0.05)
    }
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.kind {
        BenchKind::Accuracy(args) => accuracy(args),
        BenchKind::Ingest(args) => ingest(args),
        BenchKind::Scrape(args) => scrape(args),
    }
}

/// A fresh agent on fake GPUs in its own temp dir.
type BenchAgent = FakeAgent;

fn start_agent(
    tag: &str,
    specs: &[GpuSpec],
    record: Option<&Path>,
) -> anyhow::Result<(BenchAgent, PathBuf)> {
    start_agent_with(tag, specs, record, None, &[])
}

/// [`start_agent`] with another agent binary (to compare builds) and more flags.
fn start_agent_with(
    tag: &str,
    specs: &[GpuSpec],
    record: Option<&Path>,
    agent_bin: Option<&Path>,
    extra: &[String],
) -> anyhow::Result<(BenchAgent, PathBuf)> {
    let opts = fake_agent::Options {
        record,
        agent_bin,
        extra,
        ..Default::default()
    };
    let agent = FakeAgent::start(&format!("bench-{tag}"), specs, &opts)?;
    let dir = agent.dir.clone();
    Ok((agent, dir))
}

/// The markers of one step with one micro-batch, in order, as the wire
/// names them.
fn step_kinds() -> [stepwatch_proto::v1::MarkerKind; 6] {
    stepwatch_core::MarkerKind::STEP_ORDER.map(stepwatch_proto::convert::marker_kind_to_wire)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ingest(args: IngestArgs) -> anyhow::Result<()> {
    use stepwatch_client::{Client, ClientOptions};
    use stepwatch_proto::v1::{Hello, Identity, MarkerKind};

    let specs: Vec<GpuSpec> = (0..8).map(GpuSpec::h100_80gb).collect();
    let (agent, _dir) = start_agent("ingest", &specs, None)?;
    let kinds = step_kinds();
    let client_for = |rank: u32| {
        let hello = Hello {
            identity: Some(Identity {
                job_id: "bench".into(),
                rank,
                local_rank: rank,
                world_size: args.ranks.max(1) + 1,
                ..Default::default()
            }),
            gpu_uuid: GpuSpec::h100_80gb(rank % 8).uuid,
            pid: std::process::id(),
            ..Default::default()
        };
        Client::start(ClientOptions::new(&agent.endpoint, hello))
    };

    // Throughput: every rank pushes its steps as fast as the queue takes them.
    let total = u64::from(args.ranks) * args.steps * kinds.len() as u64;
    eprintln!(
        "bench: {} ranks x {} steps = {total} markers over the Unix socket",
        args.ranks, args.steps
    );
    let started = Instant::now();
    let threads: Vec<_> = (0..args.ranks)
        .map(|rank| {
            let client = client_for(rank);
            let steps = args.steps;
            std::thread::spawn(move || {
                for step in 1..=steps {
                    for kind in kinds {
                        while !client.mark_now(kind, step, 0) {
                            std::thread::yield_now();
                        }
                    }
                }
                client.close(Duration::from_secs(30))
            })
        })
        .collect();
    let mut dropped = 0;
    for t in threads {
        dropped += t.join().expect("load thread").dropped;
    }
    loop {
        let (_, body) = http_get::get(agent.http, "/metrics")?;
        let received = http_get::metric_value(&body, "stepwatch_markers_received_total", &[]);
        if received.unwrap_or(0.0) as u64 >= total {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "the agent did not take all markers in 120 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let elapsed = started.elapsed().as_secs_f64();

    // Marker-to-report latency: one more step end, then poll the rank report.
    let probe = client_for(args.ranks);
    let mut latencies = Vec::new();
    for step in 1..=u64::from(args.latency_samples) {
        for kind in &kinds[..5] {
            probe.mark_now(*kind, step, 0);
        }
        probe.flush(Duration::from_secs(5));
        let t0 = Instant::now();
        probe.mark_now(MarkerKind::StepEnd, step, 0);
        let path = format!("/api/v1/jobs/bench/ranks/{}?steps=1", args.ranks);
        loop {
            let (_, body) = http_get::get(agent.http, &path)?;
            let report: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            if report["steps_completed"].as_u64() == Some(step) {
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(5),
                "step {step} never showed up"
            );
        }
        latencies.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    probe.close(Duration::from_secs(5));
    latencies.sort_by(|a, b| a.total_cmp(b));

    // /metrics with 8 GPUs, the ranks and their retained steps.
    let mut scrapes = Vec::new();
    let mut series = 0;
    for _ in 0..50 {
        let t0 = Instant::now();
        let (_, body) = http_get::get(agent.http, "/metrics")?;
        scrapes.push(t0.elapsed().as_secs_f64() * 1e3);
        series = body.lines().filter(|l| !l.starts_with('#')).count();
    }
    scrapes.sort_by(|a, b| a.total_cmp(b));
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.child.0.id()))?;
    let rss = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    println!(
        "markers: {total} in {elapsed:.2} s = {:.0} markers/s ({dropped} dropped by clients)",
        total as f64 / elapsed
    );
    println!(
        "marker to report (step end -> /api/v1 shows it): p50 {:.2} ms, p99 {:.2} ms over {} round trips",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.len()
    );
    println!(
        "/metrics ({series} series, {} ranks x {} retained steps + 1 probe rank x {}, 8 GPUs): median {:.2} ms, p99 {:.2} ms",
        args.ranks,
        args.steps.min(stepwatch_core::TrackerConfig::default().max_retained_steps as u64),
        args.latency_samples,
        percentile(&scrapes, 0.5),
        percentile(&scrapes, 0.99)
    );
    println!(
        "agent RSS {:.1} MiB (peak {:.1} MiB)",
        rss("VmRSS:"),
        rss("VmHWM:")
    );
    Ok(())
}

/// Latencies of one kind of request, ms, and how many failed.
#[derive(Default)]
struct Latencies {
    ms: Vec<f64>,
    failed: u64,
}

impl Latencies {
    fn time<T>(&mut self, f: impl FnOnce() -> anyhow::Result<T>) -> Option<T> {
        let t0 = Instant::now();
        let out = f();
        self.ms.push(t0.elapsed().as_secs_f64() * 1e3);
        match out {
            Ok(v) => Some(v),
            Err(_) => {
                self.failed += 1;
                None
            }
        }
    }

    fn line(mut self, what: &str) -> String {
        self.ms.sort_by(|a, b| a.total_cmp(b));
        format!(
            "{what}: median {:.2} ms, p99 {:.2} ms, max {:.2} ms over {} requests ({} failed)",
            percentile(&self.ms, 0.5),
            percentile(&self.ms, 0.99),
            self.ms.last().copied().unwrap_or(0.0),
            self.ms.len(),
            self.failed
        )
    }
}

fn scrape(args: ScrapeArgs) -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use stepwatch_client::{Client, ClientOptions};
    use stepwatch_proto::v1::{Hello, Identity, MarkerKind};

    let specs: Vec<GpuSpec> = (0..8).map(GpuSpec::h100_80gb).collect();
    let extra = [
        "--memory-budget-mib".to_string(),
        args.memory_budget_mib.to_string(),
        "--max-ranks".to_string(),
        (args.ranks + 1).to_string(),
        // One connection per rank here (a process per rank in real jobs).
        "--max-connections".to_string(),
        (args.ranks + 16).to_string(),
    ];
    let (agent, _dir) =
        start_agent_with("scrape", &specs, None, args.agent_bin.as_deref(), &extra)?;
    let kinds = step_kinds();
    let endpoint = agent.endpoint.clone();
    let world = args.ranks + 1;
    let client_for = move |rank: u32| {
        let hello = Hello {
            identity: Some(Identity {
                job_id: "bench".into(),
                rank,
                local_rank: rank,
                world_size: world,
                ..Default::default()
            }),
            gpu_uuid: GpuSpec::h100_80gb(rank % 8).uuid,
            pid: std::process::id(),
            ..Default::default()
        };
        Client::start(ClientOptions::new(&endpoint, hello))
    };

    // Fill every rank with its steps as fast as the agent takes them, then
    // go on at one step per --step-ms until told to stop.
    let fill = u64::from(args.ranks) * args.steps * kinds.len() as u64;
    eprintln!(
        "bench: filling {} ranks x {} steps = {fill} markers",
        args.ranks, args.steps
    );
    let stop = Arc::new(AtomicBool::new(false));
    let filled = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let started = Instant::now();
    // Connect every rank first, 16 at a time: 256 connecting at once to a
    // busy agent made some clients time out and retry for minutes.
    // The probe rank (marker to report) connects last, with the others.
    let mut clients = Vec::new();
    for rank in 0..=args.ranks {
        clients.push(client_for(rank));
        if clients.len() % 16 == 0 || rank == args.ranks {
            let want = clients.len() as f64;
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let (_, body) = http_get::get(agent.http, "/metrics")?;
                let open = http_get::metric_value(&body, "stepwatch_ingest_streams_active", &[]);
                if open.unwrap_or(0.0) >= want {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "only {open:?} of {want} ranks connected in 120 s"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    eprintln!(
        "bench: {} ranks connected in {:.1} s",
        args.ranks,
        started.elapsed().as_secs_f64()
    );
    let probe = clients.pop().expect("the probe rank");
    let load: Vec<_> = clients
        .into_iter()
        .map(|client| {
            let (steps, period, stop, filled) = (
                args.steps,
                Duration::from_millis(args.step_ms),
                stop.clone(),
                filled.clone(),
            );
            std::thread::spawn(move || {
                let mut step = 0;
                while step < steps {
                    step += 1;
                    for kind in kinds {
                        // 256 threads spinning on full queues would starve
                        // the agent of the 2 cores; wait a little instead.
                        while !client.mark_now(kind, step, 0) {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                }
                client.flush(Duration::from_secs(600));
                filled.fetch_add(1, Ordering::Relaxed);
                let mut next = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    next += period;
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                    step += 1;
                    for kind in kinds {
                        client.mark_now(kind, step, 0);
                    }
                }
                client.close(Duration::from_secs(30))
            })
        })
        .collect();
    let received = |agent: &BenchAgent| -> anyhow::Result<u64> {
        let (_, body) = http_get::get(agent.http, "/metrics")?;
        Ok(
            http_get::metric_value(&body, "stepwatch_markers_received_total", &[]).unwrap_or(0.0)
                as u64,
        )
    };
    // Every rank has sent its fill (so the markers counted are the fill's
    // at least), and the agent has taken it.
    while filled.load(Ordering::Relaxed) < args.ranks || received(&agent)? < fill {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "the agent did not take the fill in 600 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let fill_s = started.elapsed().as_secs_f64();
    eprintln!(
        "bench: filled in {fill_s:.1} s; measuring for {} s",
        args.seconds
    );

    let until = Instant::now() + Duration::from_secs(args.seconds);
    let http = agent.http;
    let markers_before = received(&agent)?;
    let measure_start = Instant::now();
    let metrics_every = Duration::from_millis(args.metrics_every_ms);
    let api_every = Duration::from_millis(args.api_every_ms);
    let metrics = std::thread::spawn(move || {
        let mut l = Latencies::default();
        let mut series = 0;
        while Instant::now() < until {
            if let Some(body) = l.time(|| {
                let (code, body) = http_get::get(http, "/metrics")?;
                anyhow::ensure!(code == 200, "status {code}");
                Ok(body)
            }) {
                series = body.lines().filter(|l| !l.starts_with('#')).count();
            }
            std::thread::sleep(metrics_every);
        }
        (l, series)
    });
    let ranks = args.ranks;
    let steps = args.steps;
    let api = std::thread::spawn(move || {
        let mut l = Latencies::default();
        let mut bytes = 0;
        let mut rank = 0;
        while Instant::now() < until {
            let path = format!("/api/v1/jobs/bench/ranks/{rank}?steps={steps}");
            if let Some(n) = l.time(|| {
                let (code, body) = http_get::get(http, &path)?;
                anyhow::ensure!(code == 200, "status {code}");
                Ok(body.len())
            }) {
                bytes = n;
            }
            rank = (rank + 1) % ranks;
            std::thread::sleep(api_every);
        }
        (l, bytes)
    });
    let health = std::thread::spawn(move || {
        let mut l = Latencies::default();
        while Instant::now() < until {
            l.time(|| {
                let (code, _) = http_get::get(http, "/healthz")?;
                anyhow::ensure!(code == 200, "status {code}");
                Ok(())
            });
            std::thread::sleep(Duration::from_millis(10));
        }
        l
    });
    // Marker to report: one more rank's step end until its report shows it.
    let mut marker_to_report = Latencies::default();
    let mut step = 0;
    while Instant::now() < until {
        step += 1;
        for kind in &kinds[..5] {
            probe.mark_now(*kind, step, 0);
        }
        probe.flush(Duration::from_secs(5));
        let path = format!("/api/v1/jobs/bench/ranks/{}?steps=1", args.ranks);
        marker_to_report.time(|| {
            probe.mark_now(MarkerKind::StepEnd, step, 0);
            let t0 = Instant::now();
            loop {
                let (_, body) = http_get::get(http, &path)?;
                let report: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                if report["steps_completed"].as_u64() == Some(step) {
                    return Ok(());
                }
                anyhow::ensure!(
                    t0.elapsed() < Duration::from_secs(30),
                    "step {step} never showed up"
                );
            }
        });
    }
    let (metrics, series) = metrics.join().expect("metrics thread");
    let (api, report_bytes) = api.join().expect("api thread");
    let health = health.join().expect("healthz thread");
    let measured_s = measure_start.elapsed().as_secs_f64();
    let markers_during = received(&agent)?.saturating_sub(markers_before);
    let (_, body) = http_get::get(http, "/metrics")?;
    let dropped =
        http_get::metric_value(&body, "stepwatch_markers_rejected_total", &[]).unwrap_or(0.0);
    let retained = http_get::metric_value(&body, "stepwatch_retained_bytes", &[]).unwrap_or(0.0);
    let trimmed =
        http_get::metric_value(&body, "stepwatch_steps_trimmed_total", &[]).unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.child.0.id()))?;
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0);
    println!(
        "{} ranks x {} steps filled in {fill_s:.1} s; then {measured_s:.1} s with every rank stepping every {} ms, /metrics every {} ms, a rank report every {} ms ({:.0} markers/s taken, {dropped} refused)",
        args.ranks,
        args.steps,
        args.step_ms,
        args.metrics_every_ms,
        args.api_every_ms,
        markers_during as f64 / measured_s
    );
    println!("{} ({series} series)", metrics.line("/metrics"));
    println!(
        "{} ({report_bytes} bytes per report)",
        api.line(&format!("/api/v1 rank report ?steps={}", args.steps))
    );
    println!("{}", health.line("/healthz (every 10 ms)"));
    println!(
        "{}",
        marker_to_report.line("marker to report (probe rank: step end -> its report shows it)")
    );
    println!(
        "retained {:.0} MiB, {trimmed} steps trimmed for the budget; agent peak RSS {hwm:.0} MiB",
        retained / (1 << 20) as f64
    );
    // Closing drains what the clients still queue; not part of the figures.
    stop.store(true, Ordering::Relaxed);
    drop(probe);
    drop(load);
    Ok(())
}

fn accuracy(args: AccuracyArgs) -> anyhow::Result<()> {
    let all = stepwatch_sim::builtin_scenarios()?;
    let chosen: Vec<Scenario> = if args.scenarios.is_empty() {
        all
    } else {
        args.scenarios
            .iter()
            .map(|name| crate::sim::load_scenario(name))
            .collect::<anyhow::Result<_>>()?
    };
    // Co-located scenarios run together on one GPU.
    let mut groups: Vec<Vec<Scenario>> = Vec::new();
    for s in chosen {
        if let Some(group) = groups.iter_mut().find(|g| {
            g.iter()
                .any(|o| o.colocated_with.as_deref() == Some(&s.name))
        }) {
            group.push(s);
        } else {
            groups.push(vec![s]);
        }
    }
    let mut rows = Vec::new();
    for group in &groups {
        let names: Vec<&str> = group.iter().map(|s| s.name.as_str()).collect();
        eprintln!("bench: running {} at capacity ...", names.join(" + "));
        let record = |scale: f64| {
            args.record_dir
                .as_ref()
                .map(|d| d.join(format!("{}-x{scale}.jsonl", group[0].name)))
        };
        let real = run_group(
            group,
            1.0,
            args.speed,
            !args.no_allocator_trace,
            record(1.0),
        )?;
        let needs_unbounded = real.iter().any(|r| r.died_in_step.is_some());
        let unbounded = if needs_unbounded {
            eprintln!(
                "bench: running {} on 2x capacity to measure the steady peak OOM cut short",
                names.join(" + ")
            );
            Some(run_group(
                group,
                2.0,
                args.speed,
                !args.no_allocator_trace,
                record(2.0),
            )?)
        } else {
            None
        };
        for mut row in real {
            if row.died_in_step.is_some() {
                row.actual = unbounded
                    .as_ref()
                    .and_then(|u| {
                        u.iter()
                            .find(|o| o.scenario == row.scenario && o.rank == row.rank)
                    })
                    .and_then(|o| o.actual);
            }
            rows.push(row);
        }
    }
    println!("{}", render(&rows));
    // Ranks that behave alike (same skew, same expectation) count once, so a
    // scenario with 8 identical ranks does not weigh 8 times.
    let counted: Vec<&Row> = rows
        .iter()
        .filter(|r| {
            groups
                .iter()
                .flatten()
                .find(|s| s.name == r.scenario)
                .is_some_and(|s| stepwatch_sim::accuracy::ranks_to_evaluate(s).contains(&r.rank))
        })
        .collect();
    let errors: Vec<f64> = counted
        .iter()
        .filter_map(|r| r.error())
        .map(f64::abs)
        .collect();
    let median = median(&errors) * 100.0;
    let max = errors.iter().copied().fold(0.0, f64::max) * 100.0;
    let ooms: Vec<&&Row> = counted
        .iter()
        .filter(|r| r.died_in_step == Some(2))
        .collect();
    let warned = ooms.iter().filter(|r| r.warned_in_time()).count();
    let false_alarms = rows.iter().filter(|r| r.false_alarm()).count();
    println!(
        "\nover {} distinct ranks: median |error| {median:.2}% (target ≤ {:.1}%), max |error| {max:.2}% (target ≤ {:.1}%), \
         step-2 OOMs warned before step 2: {warned}/{}, false alarms at ≥5% true headroom: {false_alarms}",
        counted.len(),
        args.max_median_error,
        args.max_error,
        ooms.len()
    );
    let unexpected: Vec<String> = rows
        .iter()
        .filter(|r| r.expected_oom != r.died_in_step.is_some())
        .map(|r| format!("{} rank {}", r.scenario, r.rank))
        .collect();
    let pass = median <= args.max_median_error
        && max <= args.max_error
        && warned == ooms.len()
        && false_alarms == 0
        && unexpected.is_empty()
        && errors.len() == counted.len();
    if !unexpected.is_empty() {
        println!(
            "outcome differs from the scenario's expectation: {}",
            unexpected.join(", ")
        );
    }
    if errors.len() != counted.len() {
        println!(
            "{} rank(s) had no prediction or no measured steady peak",
            counted.len() - errors.len()
        );
    }
    println!(
        "{}",
        if pass {
            "accuracy: PASS"
        } else {
            "accuracy: FAIL"
        }
    );
    if !pass {
        std::process::exit(1);
    }
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    stepwatch_core::median_f64(&mut values.to_vec()).unwrap_or(0.0)
}

fn render(rows: &[Row]) -> String {
    let gb = |b: Option<u64>| b.map_or("-".to_string(), |b| format!("{:.2}", b as f64 / 1e9));
    let mut out = String::from(
        "| scenario | rank | outcome | predicted peak GB (before step 2) | basis | actual steady peak GB | error | true headroom | warning | lead before step 2 |\n\
         | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | --- | ---: |\n",
    );
    for r in rows {
        let outcome = match r.died_in_step {
            Some(step) => format!("OOM in step {step}"),
            None => "fits".into(),
        };
        let (warning, lead) = match &r.warning {
            Some((kind, Some(ms))) => (kind.clone(), format!("{ms:.0} ms")),
            Some((kind, None)) => (kind.clone(), "-".into()),
            None => ("none".into(), "-".into()),
        };
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.scenario,
            r.rank,
            outcome,
            gb(r.predicted),
            r.basis.as_deref().unwrap_or("-"),
            gb(r.actual),
            r.error()
                .map_or("-".into(), |e| format!("{:+.2}%", e * 100.0)),
            r.true_headroom()
                .map_or("-".into(), |h| format!("{:.1}%", h * 100.0)),
            warning,
            lead,
        );
    }
    out
}

/// Runs the scenarios of one group (one, or co-located ones sharing GPU 0)
/// against a fresh agent with GPUs of `scale` × the scenario's capacity.
fn run_group(
    group: &[Scenario],
    scale: f64,
    speed: f64,
    allocator_trace: bool,
    record: Option<PathBuf>,
) -> anyhow::Result<Vec<Row>> {
    let exe = std::env::current_exe()?;
    let colocated = group.len() > 1;
    let gpu_count = if colocated {
        1
    } else {
        group[0].ranks.count.max(1)
    };
    let capacity = (group[0].gpu.capacity_bytes as f64 * scale) as u64;
    // The scenario's capacity is what its processes can use; NVML's total
    // also holds what the driver reserves.
    let specs: Vec<GpuSpec> = (0..gpu_count)
        .map(|i| GpuSpec {
            total_bytes: capacity + fake_nvml::DEFAULT_RESERVED_BYTES,
            ..GpuSpec::h100_80gb(i)
        })
        .collect();
    let (agent, dir) = start_agent(&group[0].name, &specs, record.as_deref())?;
    let http = agent.http;
    let endpoint = agent.endpoint.clone();
    let mut sims: Vec<(String, u32, Child)> = Vec::new();
    for (i, scenario) in group.iter().enumerate() {
        if i > 0 {
            // Co-located jobs start in their scenario order, offset in time.
            let offset = (scenario.start_offset_ms - group[i - 1].start_offset_ms).max(0.0);
            std::thread::sleep(Duration::from_secs_f64(offset / 1000.0 / speed));
        }
        for rank in 0..scenario.ranks.count.max(1) {
            let gpu = if colocated { 0 } else { rank };
            let spec = SimSpec {
                scenario: &scenario.name,
                rank,
                gpu,
                speed,
                allocator_trace,
            };
            let child = spawn_sim(&exe, &spec, &endpoint, &dir)?;
            sims.push((scenario.name.clone(), rank, child));
        }
    }
    let mut died = Vec::new();
    for (name, rank, mut child) in sims {
        let status = child.wait()?;
        let oom = status.code() == Some(crate::sim::OOM_EXIT_CODE);
        anyhow::ensure!(
            oom || status.success(),
            "sim {name} rank {rank} failed: {status}"
        );
        died.push((name, rank, oom));
    }
    // Let the agent attribute the last samples.
    std::thread::sleep(Duration::from_millis(400));

    let mut rows = Vec::new();
    for (name, rank, oom) in died {
        let scenario = group
            .iter()
            .find(|s| s.name == name)
            .expect("scenario of the group");
        let (code, body) = http_get::get(http, &format!("/api/v1/jobs/{name}/ranks/{rank}"))?;
        anyhow::ensure!(code == 200, "no report for {name} rank {rank}: {body}");
        let report: Value = serde_json::from_str(&body)?;
        let steps = report["steps"].as_array().cloned().unwrap_or_default();
        let step2_begin = steps.get(1).and_then(|s| s["begin_monotonic_ns"].as_u64());
        let died_in_step = oom.then(|| {
            steps
                .iter()
                .find(|s| s["outcome"] == "oom")
                .and_then(|s| s["step"].as_u64())
                .unwrap_or(0)
        });
        // The most severe advisory: an OOM prediction may follow a low-headroom
        // one. Only these two judge step 2: rank divergence is about peers,
        // allocator retries come after step 1.
        let advisories: Vec<serde_json::Value> = report["advisories"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["kind"] == "step2_oom_predicted" || a["kind"] == "low_headroom")
            .cloned()
            .collect();
        let severe = advisories
            .iter()
            .find(|a| a["kind"] == "step2_oom_predicted")
            .or(advisories.first());
        let warning = severe.map(|a| {
            let kind = a["kind"].as_str().unwrap_or("?").to_string();
            let issued = a["issued_monotonic_ns"].as_u64().unwrap_or(0);
            (kind, step2_begin.map(|b| (b as f64 - issued as f64) / 1e6))
        });
        let expected_oom =
            scenario.expected.for_rank(rank).outcome == stepwatch_sim::scenario::OutcomeKind::Oom;
        rows.push(Row {
            scenario: name.clone(),
            rank,
            expected_oom,
            died_in_step,
            predicted: report["prediction_before_step2"]["predicted_peak_bytes"].as_u64(),
            basis: report["prediction_before_step2"]["inputs"]["basis"]
                .as_str()
                .map(str::to_owned),
            actual: report["analysis"]["steady"]["nvml_peak_bytes"].as_u64(),
            capacity: scenario.gpu.capacity_bytes,
            warning,
        });
    }
    drop(agent);
    Ok(rows)
}

/// One `stepwatch sim` rank process.
struct SimSpec<'a> {
    scenario: &'a str,
    rank: u32,
    gpu: u32,
    speed: f64,
    allocator_trace: bool,
}

fn spawn_sim(exe: &Path, spec: &SimSpec, endpoint: &str, dir: &Path) -> anyhow::Result<Child> {
    let mut command = crate::sim::command(exe, spec.scenario, spec.gpu, spec.speed, endpoint, dir);
    command.args(["--rank", &spec.rank.to_string()]);
    if !spec.allocator_trace {
        command.arg("--no-allocator-trace");
    }
    Ok(command.spawn()?)
}
