//! Offline, deterministic accuracy evaluation of the step-2 prediction.
//!
//! For each built-in scenario (and each rank whose memory or expectation
//! differs from rank 0's), the simulated events are fed into a
//! [`stepwatch_core::Tracker`] through the step model's input path
//! ([`stepwatch_core::feed::apply`], which the agent and the record
//! replayer use too):
//!
//! * a hello when the rank starts, [`RankSim::rank_info`] (what `stepwatch
//!   sim` sends);
//! * markers in batches (consecutive markers of one rank at one simulated
//!   time; a `StepBegin` always starts a new batch), each followed by
//!   [`Tracker::advise`], as the ingest path does;
//! * device samples at 100 Hz (every 10 ms of simulated time): the latest
//!   NVML-visible use of every process on the GPU, other processes included,
//!   with the scenario's capacity as `total_bytes`;
//! * when the GPU has other processes (a scenario's `other_process_bytes`, or
//!   a co-located job), the process list every second, as the agent polls it.
//!
//! The prediction is read ([`Tracker::rank_analysis`]) just before the
//! step-2 `StepBegin` marker is applied. It is compared with the **actual
//! steady-state peak**: the median over steps 2..k (k ≤ 11) of each step's
//! highest device use (this rank plus other processes), from the run as it
//! happened when the rank completed it, or from a run with the capacity
//! raised ×2 (so that it runs to the end) when the rank did not. True
//! headroom is `(capacity − actual peak) / capacity` at the real capacity.
//!
//! * step 1's allocator trace, replayed under the rank's
//!   [`stepwatch_core::feed::ReplayPlan`] and handed to the tracker when the
//!   rank sends one (the default; [`evaluate_with`] can leave it out, as for
//!   a client that cannot record the allocator's history).
//!
//! Nothing of the simulator's internals reaches the tracker: only markers
//! (with allocator figures, their peak counters running since the process
//! started, as the Python client sends them; [`evaluate_as`] can reset them
//! at every marker instead), device samples, process lists, model facts and
//! the allocator trace a client would record.

use std::borrow::Cow;
use std::fmt::Write as _;

use stepwatch_core::feed::{self, Applied, ReplayPlan};
use stepwatch_core::{
    Advisory, AdvisoryKind, Marker, MarkerKind, Prediction, RankKey, RecordEntry, Tracker,
    TrackerConfig,
};

use crate::rank::{PeakMode, RankSim, SimEvent, SimOutcome};
use crate::scenario::{builtin_scenarios, OutcomeKind, Scenario, ScenarioError};
use crate::simulate_shared;

/// Period of the simulated NVML sampler (100 Hz).
pub const SAMPLE_PERIOD_NS: u64 = 10_000_000;
/// Period of the simulated process-list poll (the agent's default, 1 s).
pub const PROCESS_PERIOD_NS: u64 = 1_000_000_000;
/// Most steps after the first that the actual steady peak uses (steps 2..=11).
pub const STEADY_WINDOW: usize = 10;
/// Factor on capacity for the run that measures the actual steady peak of
/// ranks that run out of memory.
pub const RAISED_CAPACITY_FACTOR: u64 = 2;
/// True headroom at or above which any warning is a false alarm.
pub const FALSE_ALARM_HEADROOM: f64 = 0.05;

/// PID of the process holding a scenario's `other_process_bytes`.
const OTHER_PID: u32 = 1;
/// PID of simulated rank `i` on the GPU.
const RANK_PID_BASE: u32 = 1000;

/// Where the actual steady peak was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActualSource {
    /// The run as it happened (the rank completed every step).
    RealRun,
    /// The run with capacity × [`RAISED_CAPACITY_FACTOR`] (the rank did not
    /// complete at the real capacity).
    RaisedCapacity,
}

/// The steady peak a rank actually reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActualPeak {
    /// Median of the per-step device peaks over steps 2..k.
    pub peak_bytes: Option<u64>,
    /// Whether it comes from the real run or a raised-capacity rerun.
    pub source: ActualSource,
    /// Steps it is the median of.
    pub steps: usize,
}

/// The step-2 memory warnings a rank got, and when.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Warnings {
    /// The first warning advise returned during step 1, if any.
    pub first: Option<AdvisoryKind>,
    /// Simulated ms from that warning to step 2's begin (≥ 0 when before).
    pub lead_ms: Option<f64>,
    /// Simulated ms from the first step-2 OOM advisory to step 2's begin.
    pub oom_lead_ms: Option<f64>,
    /// A step-2 OOM advisory was issued before step 2 began.
    pub oom_before_step2: bool,
    /// Warned although the true headroom is at least 5%.
    pub false_alarm: bool,
}

/// One evaluated rank.
#[derive(Debug, Clone, PartialEq)]
pub struct AccuracyRow {
    /// Scenario name, for locating a bad row.
    pub scenario: String,
    /// Rank within the scenario.
    pub rank: u32,
    /// GPU capacity of the real run, bytes.
    pub capacity_bytes: u64,
    /// The prediction just before step 2 began, with its inputs and
    /// explanation for reading a bad row (None: step 2 never began, or the
    /// tracker could not predict).
    pub prediction: Option<Prediction>,
    /// The steady peak the rank reached.
    pub actual: ActualPeak,
    /// 100 × (predicted − actual) / actual.
    pub error_pct: Option<f64>,
    /// 100 × (capacity − actual) / capacity.
    pub true_headroom_pct: Option<f64>,
    /// Outcome the scenario file expects for this rank.
    pub expected: OutcomeKind,
    /// Step it is expected to run out of memory in, when it does.
    pub expected_oom_step: Option<u64>,
    /// How the real run ended.
    pub outcome: SimOutcome,
    /// The warnings it got before step 2.
    pub warnings: Warnings,
}

impl AccuracyRow {
    /// An OOM rank without a step-2 OOM advisory before step 2 began.
    pub fn missed(&self) -> bool {
        self.expected == OutcomeKind::Oom && !self.warnings.oom_before_step2
    }

    /// The predicted device peak, bytes.
    pub fn predicted_peak_bytes(&self) -> Option<u64> {
        self.prediction.as_ref().map(|p| p.predicted_peak_bytes)
    }

    /// The prediction's explanation; empty without a prediction.
    pub fn explanation(&self) -> &str {
        self.prediction.as_ref().map_or("", |p| &p.explanation)
    }
}

/// Aggregate figures over rows.
#[derive(Debug, Clone, PartialEq)]
pub struct AccuracySummary {
    /// Rows evaluated.
    pub rows: usize,
    /// Rows with both a prediction and an actual peak.
    pub compared: usize,
    /// Median of |error_pct| over the compared rows: the headline accuracy.
    pub median_abs_error_pct: f64,
    /// Worst |error_pct| over the compared rows.
    pub max_abs_error_pct: f64,
    /// `scenario/rank` of the largest error.
    pub max_error_at: Option<String>,
    /// OOM rows not warned (step-2 OOM advisory) before step 2.
    pub misses: Vec<String>,
    /// Rows warned although their true headroom is ≥ 5%.
    pub false_alarms: Vec<String>,
}

/// Evaluates every built-in scenario. Panics if a built-in scenario is
/// invalid (the scenario tests catch that first).
pub fn evaluate_all() -> Vec<AccuracyRow> {
    evaluate_all_with(true)
}

/// [`evaluate_all`], with or without the step-1 allocator trace.
pub fn evaluate_all_with(allocator_trace: bool) -> Vec<AccuracyRow> {
    evaluate_all_as(allocator_trace, PeakMode::default())
}

/// [`evaluate_all_with`], with the markers' peak counters measured as
/// `peak_mode` says (the default, [`PeakMode::SinceStart`], is what the
/// Python client sends).
pub fn evaluate_all_as(allocator_trace: bool, peak_mode: PeakMode) -> Vec<AccuracyRow> {
    let all = builtin_scenarios().expect("built-in scenarios parse");
    let mut rows = Vec::new();
    for s in &all {
        for rank in ranks_to_evaluate(s) {
            rows.push(
                evaluate_as(s, rank, &all, allocator_trace, peak_mode)
                    .expect("built-in scenario simulates"),
            );
        }
    }
    rows
}

/// Rank 0, plus the first rank of every other distinct (memory skew,
/// expectation) combination: ranks that share both behave alike.
pub fn ranks_to_evaluate(s: &Scenario) -> Vec<u32> {
    if s.colocated_with.is_some() {
        return vec![0];
    }
    let mut seen: Vec<(u64, String)> = Vec::new();
    let mut out = Vec::new();
    for r in 0..s.ranks.count {
        let sig = (
            s.memory_skew(r).to_bits(),
            format!("{:?}", s.expected.for_rank(r)),
        );
        if !seen.contains(&sig) {
            seen.push(sig);
            out.push(r);
        }
    }
    out
}

/// The simulated processes on the evaluated rank's GPU: the rank itself
/// first, then a co-located job's rank 0 if any.
fn gpu_sims(
    s: &Scenario,
    rank: u32,
    all: &[Scenario],
    capacity_factor: u64,
    allocator_trace: bool,
    peak_mode: PeakMode,
) -> Result<Vec<RankSim>, ScenarioError> {
    let raise = |sc: &Scenario| {
        let mut sc = sc.clone();
        sc.gpu.capacity_bytes = sc.gpu.capacity_bytes.saturating_mul(capacity_factor);
        sc
    };
    let mut sims = vec![RankSim::new(&raise(s), rank)?];
    sims[0].set_allocator_trace(allocator_trace);
    sims[0].set_peak_mode(peak_mode);
    if let Some(other) = s.colocated_with.as_deref().filter(|_| rank == 0) {
        let o = all
            .iter()
            .find(|x| x.name == other)
            .ok_or_else(|| ScenarioError::Invalid {
                name: s.name.clone(),
                reason: format!("colocated_with names unknown scenario {other:?}"),
            })?;
        let mut other = RankSim::new(&raise(o), 0)?;
        other.set_allocator_trace(allocator_trace);
        other.set_peak_mode(peak_mode);
        sims.push(other);
    }
    Ok(sims)
}

fn run_sims(sims: &mut [RankSim]) -> Vec<Vec<SimEvent>> {
    if sims.len() == 1 {
        vec![sims[0].run_to_end()]
    } else {
        simulate_shared(sims)
    }
}

/// (time, process, index) of every process's events, earliest first (ties
/// by process, then index).
fn in_time_order(events: &[Vec<SimEvent>]) -> Vec<(u64, usize, usize)> {
    let mut order: Vec<(u64, usize, usize)> = events
        .iter()
        .enumerate()
        .flat_map(|(p, ev)| ev.iter().enumerate().map(move |(i, e)| (e.at_ns(), p, i)))
        .collect();
    order.sort();
    order
}

/// Device use over time on one GPU: at each event of any process, the sum
/// of every running process's latest NVML figure plus `base` other bytes.
/// A process holds nothing before its first and after its last event.
fn device_timeline(events: &[Vec<SimEvent>], base: u64) -> Vec<(u64, u64)> {
    let all = in_time_order(events);
    let mut latest = vec![0u64; events.len()];
    let mut out = Vec::with_capacity(all.len());
    for (t, p, i) in all {
        match &events[p][i] {
            SimEvent::Memory {
                nvml_used_bytes, ..
            } => latest[p] = *nvml_used_bytes,
            SimEvent::Marker(_) | SimEvent::AllocatorTrace { .. } => {}
        }
        if i + 1 == events[p].len() {
            latest[p] = 0;
        }
        let used = latest.iter().sum::<u64>() + base;
        out.push((t, used));
    }
    out
}

/// Median over steps 2..=1+[`STEADY_WINDOW`] of each completed step's
/// highest device use, from the rank's markers and the device timeline.
fn steady_device_peak(rank_events: &[SimEvent], timeline: &[(u64, u64)]) -> (Option<u64>, usize) {
    let mut peaks = Vec::new();
    let mut begin: Option<u64> = None;
    for m in rank_events.iter().filter_map(SimEvent::as_marker) {
        match m.kind {
            MarkerKind::StepBegin if m.step >= 2 => begin = Some(m.monotonic_ns),
            MarkerKind::StepEnd if m.step >= 2 => {
                if let Some(b) = begin.take() {
                    let level_at_begin = timeline
                        .iter()
                        .take_while(|(t, _)| *t <= b)
                        .last()
                        .map_or(0, |&(_, u)| u);
                    let peak = timeline
                        .iter()
                        .filter(|(t, _)| *t >= b && *t <= m.monotonic_ns)
                        .map(|&(_, u)| u)
                        .fold(level_at_begin, u64::max);
                    peaks.push(peak);
                }
            }
            MarkerKind::Oom => begin = None,
            _ => {}
        }
        if peaks.len() >= STEADY_WINDOW {
            break;
        }
    }
    let n = peaks.len();
    (stepwatch_core::median_u64(&mut peaks), n)
}

/// What the tracker said during the replay of the real run.
struct Replay {
    prediction: Option<Prediction>,
    step2_begin_ns: Option<u64>,
    first_warning: Option<(AdvisoryKind, u64)>,
    first_oom_warning_ns: Option<u64>,
    oom_warned_before_step2: bool,
}

/// Applies one simulated input; the simulator makes only valid ones.
fn feed(tracker: &mut Tracker, input: RecordEntry<'_>) -> Applied {
    feed::apply(tracker, &input).expect("the simulator's inputs are valid")
}

/// Feeds the events of every process on one GPU into a tracker the way the
/// agent does and watches process 0 (the evaluated rank).
fn replay(s: &Scenario, sims: &[RankSim], events: &[Vec<SimEvent>]) -> Replay {
    const GPU: &str = "GPU-accuracy-0";
    let capacity = s.gpu.capacity_bytes;
    let base = s.gpu.other_process_bytes;
    let shared = events.len() > 1 || base > 0;
    let mut tracker = Tracker::new(TrackerConfig::default());
    let keys: Vec<RankKey> = sims
        .iter()
        .map(|sim| RankKey::new("", &sim.scenario().name, sim.rank()))
        .collect();
    let order = in_time_order(events);
    let mut latest = vec![0u64; events.len()];
    let mut opened = vec![false; events.len()];
    let mut ended = vec![false; events.len()];
    let mut next_sample = 0u64;
    let mut next_processes = 0u64;
    let mut out = Replay {
        prediction: None,
        step2_begin_ns: None,
        first_warning: None,
        first_oom_warning_ns: None,
        oom_warned_before_step2: false,
    };
    let mut batch: Vec<Marker> = Vec::new();
    let mut batch_owner = 0usize;

    let mut k = 0;
    while k < order.len() {
        let (t, p, i) = order[k];
        // Samples strictly before this event's time (a sample at t is taken
        // once every event at t has happened).
        while next_sample < t {
            let used = latest.iter().sum::<u64>() + base;
            if shared && next_sample >= next_processes {
                let mut procs: Vec<(u32, u64)> = (0..events.len())
                    .filter(|&q| opened[q] && !ended[q])
                    .map(|q| (RANK_PID_BASE + q as u32, latest[q]))
                    .collect();
                if base > 0 {
                    procs.push((OTHER_PID, base));
                }
                let processes = RecordEntry::GpuProcesses {
                    gpu: GPU.into(),
                    processes: procs,
                };
                feed(&mut tracker, processes);
                next_processes = next_sample + PROCESS_PERIOD_NS;
            }
            let sample = stepwatch_core::GpuSample {
                monotonic_ns: next_sample,
                used_bytes: used,
                capacity_bytes: capacity,
            };
            let samples = RecordEntry::GpuSamples {
                gpu: GPU.into(),
                samples: vec![sample],
            };
            feed(&mut tracker, samples);
            next_sample += SAMPLE_PERIOD_NS;
        }
        if !opened[p] {
            opened[p] = true;
            let info = sims[p].rank_info(&keys[p].job, GPU, RANK_PID_BASE + p as u32);
            feed(&mut tracker, RecordEntry::Open { at_ns: t, info });
        }
        // One batch: consecutive markers of this process at this time, a
        // StepBegin starting a new batch.
        let mut due: Vec<Advisory> = Vec::new();
        match &events[p][i] {
            SimEvent::Memory {
                nvml_used_bytes, ..
            } => latest[p] = *nvml_used_bytes,
            SimEvent::AllocatorTrace { trace, .. } => {
                // The agent replays a trace as it arrives (before the next marker).
                let plan = ReplayPlan::for_rank(&tracker, &keys[p]);
                let applied = feed(
                    &mut tracker,
                    plan.entry(t, keys[p].clone(), String::new(), (**trace).clone()),
                );
                if p == 0 {
                    due = applied.advisories;
                }
            }
            SimEvent::Marker(m) => {
                batch.clear();
                batch.push(m.clone());
                batch_owner = p;
                while k + 1 < order.len() {
                    let (t2, p2, i2) = order[k + 1];
                    match &events[p2][i2] {
                        SimEvent::Marker(m2)
                            if t2 == t && p2 == p && m2.kind != MarkerKind::StepBegin =>
                        {
                            batch.push(m2.clone());
                            k += 1;
                        }
                        _ => break,
                    }
                }
            }
        }
        let (_, _, last_i) = order[k];
        let mut step2_opened = false;
        if !batch.is_empty() {
            let key = &keys[batch_owner];
            let opens_step2 =
                batch_owner == 0 && batch[0].kind == MarkerKind::StepBegin && batch[0].step == 2;
            step2_opened = opens_step2;
            if opens_step2 {
                out.prediction = tracker.rank_analysis(key).and_then(|a| a.prediction);
            }
            // The tracker checks advisories after each batch, and before the
            // first marker of step 2 is applied.
            let markers = std::mem::take(&mut batch);
            let from_batch = feed(
                &mut tracker,
                RecordEntry::Markers {
                    at_ns: t,
                    key: Cow::Borrowed(key),
                    markers: markers.into(),
                    run_id: Cow::Borrowed(""),
                },
            );
            if batch_owner == 0 {
                due.extend(from_batch.advisories);
            }
        }
        // Only the step-2 memory warnings are judged here; a rank-divergence
        // advisory says nothing about step 2 fitting, and the allocator-retries
        // and low-observed-headroom ones come only once step 2 runs.
        for a in due.into_iter().filter(|a| {
            matches!(
                a.kind,
                AdvisoryKind::Step2OomPredicted | AdvisoryKind::LowHeadroom
            )
        }) {
            if out.first_warning.is_none() {
                out.first_warning = Some((a.kind, t));
            }
            if a.kind == AdvisoryKind::Step2OomPredicted {
                out.first_oom_warning_ns.get_or_insert(t);
                if out.step2_begin_ns.is_none() {
                    out.oom_warned_before_step2 = true;
                }
            }
        }
        if step2_opened {
            out.step2_begin_ns = Some(t);
        }
        if last_i + 1 == events[p].len() {
            ended[p] = true;
            latest[p] = 0;
            let close = RecordEntry::Close {
                at_ns: t,
                key: keys[p].clone(),
                broken: false,
            };
            feed(&mut tracker, close);
        }
        k += 1;
    }
    out
}

/// Evaluates one rank of one scenario, with the allocator trace the client
/// sends by default; `all` resolves `colocated_with`.
pub fn evaluate(s: &Scenario, rank: u32, all: &[Scenario]) -> Result<AccuracyRow, ScenarioError> {
    evaluate_with(s, rank, all, true)
}

/// [`evaluate`], with or without the step-1 allocator trace (without: the
/// prediction from markers alone, as for a client that cannot record it).
pub fn evaluate_with(
    s: &Scenario,
    rank: u32,
    all: &[Scenario],
    allocator_trace: bool,
) -> Result<AccuracyRow, ScenarioError> {
    evaluate_as(s, rank, all, allocator_trace, PeakMode::default())
}

/// [`evaluate_with`], with the markers' peak counters measured as
/// `peak_mode` says.
pub fn evaluate_as(
    s: &Scenario,
    rank: u32,
    all: &[Scenario],
    allocator_trace: bool,
    peak_mode: PeakMode,
) -> Result<AccuracyRow, ScenarioError> {
    let capacity = s.gpu.capacity_bytes;
    let base = s.gpu.other_process_bytes;

    let mut real = gpu_sims(s, rank, all, 1, allocator_trace, peak_mode)?;
    let real_events = run_sims(&mut real);
    let outcome = real[0].report().outcome;
    let seen = replay(s, &real, &real_events);

    let completed = matches!(outcome, SimOutcome::Completed { .. });
    let (source, (actual, actual_steps)) = if completed {
        let timeline = device_timeline(&real_events, base);
        (
            ActualSource::RealRun,
            steady_device_peak(&real_events[0], &timeline),
        )
    } else {
        let mut raised = gpu_sims(
            s,
            rank,
            all,
            RAISED_CAPACITY_FACTOR,
            allocator_trace,
            peak_mode,
        )?;
        let raised_events = run_sims(&mut raised);
        let timeline = device_timeline(&raised_events, base);
        (
            ActualSource::RaisedCapacity,
            steady_device_peak(&raised_events[0], &timeline),
        )
    };

    let predicted = seen.prediction.as_ref().map(|p| p.predicted_peak_bytes);
    let error_pct = predicted
        .zip(actual)
        .filter(|(_, a)| *a > 0)
        .map(|(p, a)| 100.0 * (p as f64 - a as f64) / a as f64);
    let true_headroom_pct =
        actual.map(|a| 100.0 * (capacity as f64 - a as f64) / capacity.max(1) as f64);
    let expectation = s.expected.for_rank(rank);
    let lead_ms = seen
        .first_warning
        .zip(seen.step2_begin_ns)
        .map(|((_, at), b)| (b as f64 - at as f64) / 1e6);
    let oom_lead_ms = seen
        .first_oom_warning_ns
        .zip(seen.step2_begin_ns)
        .map(|(at, b)| (b as f64 - at as f64) / 1e6);
    let warned = seen.first_warning.map(|(k, _)| k);
    let false_alarm =
        warned.is_some() && true_headroom_pct.is_some_and(|h| h >= 100.0 * FALSE_ALARM_HEADROOM);
    Ok(AccuracyRow {
        scenario: s.name.clone(),
        rank,
        capacity_bytes: capacity,
        prediction: seen.prediction,
        actual: ActualPeak {
            peak_bytes: actual,
            source,
            steps: actual_steps,
        },
        error_pct,
        true_headroom_pct,
        expected: expectation.outcome,
        expected_oom_step: expectation.oom_step,
        outcome,
        warnings: Warnings {
            first: warned,
            lead_ms,
            oom_lead_ms,
            oom_before_step2: seen.oom_warned_before_step2,
            false_alarm,
        },
    })
}

/// Median and maximum absolute error, misses and false alarms.
pub fn summarize(rows: &[AccuracyRow]) -> AccuracySummary {
    let mut errs: Vec<(f64, String)> = rows
        .iter()
        .filter_map(|r| {
            r.error_pct
                .map(|e| (e.abs(), format!("{}/{}", r.scenario, r.rank)))
        })
        .collect();
    errs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let n = errs.len();
    let mut abs: Vec<f64> = errs.iter().map(|e| e.0).collect();
    let median = stepwatch_core::median_f64(&mut abs).unwrap_or(0.0);
    let label = |r: &AccuracyRow| format!("{}/{}", r.scenario, r.rank);
    AccuracySummary {
        rows: rows.len(),
        compared: n,
        median_abs_error_pct: median,
        max_abs_error_pct: errs.last().map_or(0.0, |e| e.0),
        max_error_at: errs.last().map(|e| e.1.clone()),
        misses: rows.iter().filter(|r| r.missed()).map(label).collect(),
        false_alarms: rows
            .iter()
            .filter(|r| r.warnings.false_alarm)
            .map(label)
            .collect(),
    }
}

/// The rows as a markdown table, followed by the summary.
pub fn render_table(rows: &[AccuracyRow]) -> String {
    let gb = |b: Option<u64>| b.map_or("—".to_string(), |b| format!("{:.2}", b as f64 / 1e9));
    let pct = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:+.2}"));
    let mut s = String::new();
    s.push_str(
        "| scenario | rank | predicted GB | actual GB | error % | true headroom % | expected | first warning (lead ms) | oom_risk lead ms | false alarm |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- |\n",
    );
    for r in rows {
        let expected = match (r.expected, r.expected_oom_step) {
            (OutcomeKind::Oom, Some(st)) => format!("oom@{st}"),
            (OutcomeKind::Oom, None) => "oom".into(),
            (OutcomeKind::Fits, _) => "fits".into(),
        };
        let warned = match (r.warnings.first, r.warnings.lead_ms) {
            (Some(AdvisoryKind::Step2OomPredicted), l) => format!("oom_risk ({})", ms(l)),
            (Some(AdvisoryKind::LowHeadroom), l) => format!("low_headroom ({})", ms(l)),
            (Some(AdvisoryKind::RankDivergence), l) => format!("rank_divergence ({})", ms(l)),
            (Some(AdvisoryKind::AllocatorRetries), l) => format!("allocator_retries ({})", ms(l)),
            (Some(AdvisoryKind::LowObservedHeadroom), l) => {
                format!("low_observed_headroom ({})", ms(l))
            }
            (Some(AdvisoryKind::MemoryGrowth), l) => format!("memory_growth ({})", ms(l)),
            (Some(AdvisoryKind::ClientClock), l) => format!("client_clock ({})", ms(l)),
            (Some(AdvisoryKind::PredictionFinal), l) => format!("prediction_final ({})", ms(l)),
            (None, _) => "—".into(),
        };
        let actual = match r.actual.source {
            ActualSource::RealRun => gb(r.actual.peak_bytes),
            ActualSource::RaisedCapacity => format!("{}*", gb(r.actual.peak_bytes)),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.scenario,
            r.rank,
            gb(r.predicted_peak_bytes()),
            actual,
            pct(r.error_pct),
            r.true_headroom_pct
                .map_or("—".into(), |h| format!("{h:.2}")),
            expected,
            warned,
            ms(r.warnings.oom_lead_ms),
            if r.warnings.false_alarm { "yes" } else { "no" },
        );
    }
    let sum = summarize(rows);
    let _ = writeln!(
        s,
        "\n`*` measured with capacity ×{RAISED_CAPACITY_FACTOR} (the rank does not complete at its real capacity).\n\n\
         {} rows, {} compared: median |error| {:.2}%, max |error| {:.2}% ({}); \
         OOM ranks not warned before step 2: {}; false alarms (true headroom ≥ {:.0}%): {}.",
        sum.rows,
        sum.compared,
        sum.median_abs_error_pct,
        sum.max_abs_error_pct,
        sum.max_error_at.as_deref().unwrap_or("—"),
        list(&sum.misses),
        100.0 * FALSE_ALARM_HEADROOM,
        list(&sum.false_alarms),
    );
    s
}

fn ms(v: Option<f64>) -> String {
    v.map_or("—".into(), |l| format!("{l:.0}"))
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}
