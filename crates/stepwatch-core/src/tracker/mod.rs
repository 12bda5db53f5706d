//! The node-wide step tracker: every rank's timeline, the GPU samples of
//! every GPU, and the attribution of samples to phases.
//!
//! Attribution is order-independent: a sample is credited to a phase only
//! once that phase has closed, either when the closing marker arrives (by
//! scanning the GPU's sample window) or when a late sample arrives for an
//! already closed phase. Either way each sample lands in exactly one phase of
//! each rank on its GPU.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

mod checks;

use crate::advisory::{self, Advisory, AdvisoryKind};
use crate::allocator::SegmentLayout;
use crate::analysis::{analyze_rank, AnalysisConfig, RankAnalysis};
use crate::analysis::{RankInputs, SteadyMemo};
use crate::batch::{BeyondAllocator, StepBatches};
use crate::divergence::{divergence, Divergence, RankFigures};
use crate::error::{HelloError, MarkerError};
use crate::growth::{forecast, GrowthForecast, MemoryTrend, TrendMemo};
use crate::identity::{ModelFacts, RankInfo, RankKey};
use crate::layout::{step2_new_segments_with, LayoutContext, LayoutEstimate, MAX_LAYOUT_BLOCKS};
use crate::marker::{BatchFacts, Marker, MarkerKind};
use crate::pass::{pass_peaks, PassPeaks};
use crate::postmortem::{
    post_mortem, Died, OomReport, OomReportError, PostMortem, PostMortemInputs,
};
use crate::predict::StepOneExtras;
use crate::predict::{LiveStep, Prediction};
use crate::replay::{Gradients, Step2Replay};
use crate::sample::GpuSample;
use crate::timeline::{RankTimeline, StepOutcome};
use crate::AllocatorStats;

/// Most processes remembered per GPU (see [`Tracker::set_gpu_processes`]).
pub const MAX_PROCESSES_PER_GPU: usize = 1024;

/// Bounds of the tracker. Every map and queue in it is bounded by these.
#[derive(Debug, Clone, Copy)]
pub struct TrackerConfig {
    /// Most ranks tracked at once; further hellos are refused.
    pub max_ranks: usize,
    /// Steps kept per rank (step 1 is always kept on top).
    pub max_retained_steps: usize,
    /// GPU samples kept per GPU for attribution to phases that are still open.
    pub max_samples_per_gpu: usize,
    /// Most GPUs sampled.
    pub max_gpus: usize,
    /// Bytes the ranks' retained steps may hold in all (see
    /// [`RankTimeline::approx_bytes`]). Past it, finished ranks (no open
    /// stream) give way first, the one that finished longest ago first;
    /// then the namespace holding the most gives up its largest rank's
    /// oldest step (step 1 and the current step are always kept); when
    /// nothing is left to give, batches that add phases are refused for
    /// ranks whose namespace holds its share of the budget or more (the
    /// budget over the namespaces tracked), so that one tenant cannot
    /// lock the others out. Without it, retention is a product of limits
    /// (ranks × steps × phases) far beyond any container's memory.
    pub memory_budget_bytes: u64,
    /// Whether markers' clocks are checked against the caller's (the
    /// agent's CLOCK_MONOTONIC; see `clock`): a batch far ahead of the
    /// rank's usual offset is refused (`clock_jumped`), and a rank whose
    /// clock is far from the caller's is advised of it. Off where the
    /// caller's clock is not the markers' (tests and harnesses that pass
    /// made-up times).
    pub check_client_clock: bool,
    /// How long a rank whose stream broke stays its process's: within it,
    /// another claimant's hello is refused (`RankHeld`), so that the rank is
    /// not taken (and its history reset) while its process reconnects. A
    /// stream that ended cleanly holds nothing.
    pub reconnect_window_ns: u64,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self {
            max_ranks: 256,
            max_retained_steps: 1000,
            // 60 s at 100 Hz.
            max_samples_per_gpu: 6000,
            max_gpus: 64,
            memory_budget_bytes: u64::MAX,
            check_client_clock: false,
            reconnect_window_ns: 0,
        }
    }
}

/// Refusal of a hello.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// The hello broke the contract.
    #[error(transparent)]
    Invalid(#[from] HelloError),
    /// [`TrackerConfig::max_ranks`] ranks are tracked and every one is
    /// connected (finished ranks give way); keeps memory bounded.
    #[error("the agent already tracks {0} connected ranks, its limit (--max-ranks)")]
    TooManyRanks(usize),
    /// Someone else holds the rank: a hello from a different process or
    /// pod for a rank with an open stream, one whose pod the kubelet did
    /// not vouch for, for a rank whose pod it did, or one naming a run its
    /// process has since left for a newer one. Refused so that no process
    /// (and no stale stream of an earlier run) can take over, or reset,
    /// the rank; the holder is untouched.
    #[error(
        "rank {rank} of job {job:?} is held ({why}); \
         a restarted run can take it once the old process's stream has closed"
    )]
    RankHeld {
        /// The job id of the hello.
        job: String,
        /// The rank it claimed.
        rank: u32,
        /// Which rule refused it, for the log and the client.
        why: String,
        /// The hello names a run its process has since left for a newer
        /// one: that run can never take the rank again, so its client
        /// should stop rather than retry (see [`OpenError::refuses_the_run`]).
        run_left: bool,
    },
}

impl OpenError {
    /// The `stepwatch_markers_rejected_total` reason of this refusal.
    pub fn reason(&self) -> &'static str {
        match self {
            OpenError::Invalid(e) => e.reason(),
            OpenError::TooManyRanks(_) => "too_many_ranks",
            OpenError::RankHeld { .. } => "rank_held",
        }
    }

    /// Whether the refusal is of the hello's run itself: the run has
    /// ended on the rank, so no stream naming it will be accepted again.
    /// The agent tells the client, which then stops reconnecting for that
    /// run instead of retrying for good; every other refusal may pass on
    /// a later try (the holder's stream closes, a rank slot frees up).
    pub fn refuses_the_run(&self) -> bool {
        matches!(self, OpenError::RankHeld { run_left: true, .. })
    }
}

/// What [`Tracker::open_evicting`] did besides opening the rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    /// The key the rank is tracked under.
    pub key: RankKey,
    /// A finished rank dropped because the table was full.
    pub evicted: Option<RankKey>,
    /// Ranks of an earlier run of the same job that this hello replaced
    /// (see [`Tracker::open_evicting`]).
    pub superseded: Vec<RankKey>,
}

/// A tracked rank: what it said about itself and what it did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankState {
    /// What the rank said about itself in its hello.
    pub info: RankInfo,
    /// Its bounded step history.
    pub timeline: RankTimeline,
    /// Streams currently open for this rank (normally 0 or 1).
    pub connected_streams: u32,
    /// Caller-supplied time of the last hello, marker or disconnect; drives eviction.
    pub last_activity_ns: u64,
    /// Advisories issued to this rank: per kind once, and again when the
    /// prediction worsened (see `advisory`); rank divergence once
    /// per figure.
    pub advisories: Vec<Advisory>,
    /// The prediction as it stood just before the second step began: what
    /// the step-2 warning was based on, kept to measure how good it was.
    pub prediction_before_step2: Option<Prediction>,
    /// Step 2 replayed from the allocator trace the client sent during step 1.
    #[serde(default)]
    pub allocator_replay: Option<Step2Replay>,
    /// The batch of the second step's first forward that carried one
    /// (kept here: the timeline may trim that step later). A larger one
    /// than step 1's revises the prediction and `prediction_before_step2`
    /// (see `predict`'s `larger_batch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step2_batch: Option<BatchFacts>,
    /// Step 1's segment layout at its optimizer begin (clients without a
    /// trace send it on that marker), kept until the one at its end arrives.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub optimizer_begin_layout: Vec<SegmentLayout>,
    /// The allocator's figures on that marker, kept with its layout: step
    /// 1's allocated peak before the optimizer and what it held then bound
    /// what step 2 holds at once ([`LayoutContext::live_limit`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_begin_allocator: Option<AllocatorStats>,
    /// What step 1's layouts at its optimizer begin and end showed
    /// (`layout`); it replaces the guessed layout allowance.
    #[serde(default)]
    pub layout_estimate: Option<LayoutEstimate>,
    /// Run ids this process has left for a newer run, newest last (at most
    /// [`MAX_ENDED_RUNS`]). A hello naming one is refused: a client that
    /// kept an earlier run's stream would otherwise reset the newer run's
    /// step 1 each time it reconnected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ended_runs: Vec<String>,
    /// The client's `num_alloc_retries` at the run's latest marker with
    /// allocator figures (None before one): PyTorch's count of allocations
    /// that needed the cache freed and `cudaMalloc` retried. Exported as a
    /// counter; its growth after step 1 is advised of once
    /// ([`crate::advisory::retries_due`]).
    #[serde(default)]
    pub allocator_retries: Option<u64>,
    /// What the client sent with the run's OOM marker (see `postmortem`);
    /// the first one of the run is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_report: Option<OomReport>,
    /// Until when (the tracker's ns) the rank is held for its process
    /// after its stream broke ([`TrackerConfig::reconnect_window_ns`]).
    #[serde(default)]
    pub reconnect_until_ns: u64,
    /// What other processes held on the rank's GPU when its last stream
    /// closed (None while one is open): a rank whose process is gone keeps
    /// this figure, so that what runs on the GPU after it (its job's
    /// restarted run) is not counted against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub other_process_bytes_at_close: Option<u64>,
    /// The steady profile, kept between reads (see [`SteadyMemo`]).
    #[serde(skip)]
    pub(crate) steady: SteadyMemo,
    /// The trailing window and its growth, kept between batches (see
    /// `growth`).
    #[serde(skip)]
    pub(crate) trend: TrendMemo,
    /// The client's clock against the caller's, learnt from its batches.
    #[serde(skip)]
    pub(crate) clock: crate::clock::ClientClock,
}

/// How many of a process's earlier run ids a rank remembers
/// ([`RankState::ended_runs`]); a process that starts more runs than this
/// while an old one still reconnects is not protected from the oldest.
pub const MAX_ENDED_RUNS: usize = 8;

impl RankState {
    /// Brings the figures kept between reads (steady profile, memory trend)
    /// up to date after the timeline or the tunables changed.
    fn refresh_memos(&mut self, config: &AnalysisConfig) {
        self.steady.refresh(&self.timeline, config);
        self.trend.refresh(&self.timeline, &config.growth);
    }

    /// Whether the rank has not gone past its first step: its prediction is
    /// not frozen yet and no later step has begun. What step-1 work keys on
    /// (fresh samples before a batch, the freeze, the allocator replay).
    pub fn in_first_step(&self) -> bool {
        self.prediction_before_step2.is_none() && self.timeline.steps().len() <= 1
    }
}

/// What became of the segment layouts markers carried, since the tracker
/// started (`stepwatch_layout_snapshots_total{result}`): a layout that is
/// not used leaves the prediction guessing the layout, and the count says
/// why.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LayoutCounts {
    /// Kept: step 1's optimizer begin, or its end once the begin's is in.
    pub kept: u64,
    /// On another marker or step, an end without a begin, or a second
    /// pair: ignored.
    pub misplaced: u64,
    /// Over [`MAX_LAYOUT_BLOCKS`] blocks: ignored.
    pub too_many_blocks: u64,
    /// An end whose pair the allocator model cannot take (overlapping
    /// segments, empty blocks): both ignored.
    pub unmodelled: u64,
}

/// Keeps the segment layouts of step 1's optimizer begin and end from a
/// checked batch, and once both are in, what they show. Layouts on other
/// markers, later steps, or over [`MAX_LAYOUT_BLOCKS`] blocks are ignored,
/// as is a pair the allocator model cannot take (overlapping segments,
/// empty blocks): the prediction then guesses the layout as without them.
/// Each layout is counted in `counts` by what became of it. `reserved_limit`
/// is the rank's ([`Tracker::reserved_limit`]) before the batch.
fn take_optimizer_layouts(
    state: &mut RankState,
    markers: &[Marker],
    in_first_step: bool,
    reserved_limit: Option<u64>,
    counts: &mut LayoutCounts,
) {
    for m in markers.iter().filter(|m| !m.layout_segments.is_empty()) {
        let blocks: usize = m.layout_segments.iter().map(|s| s.blocks.len()).sum();
        if blocks > MAX_LAYOUT_BLOCKS {
            counts.too_many_blocks += 1;
            continue;
        }
        if !in_first_step || m.step != 1 {
            counts.misplaced += 1;
            continue;
        }
        match m.kind {
            MarkerKind::OptimizerBegin if state.layout_estimate.is_none() => {
                state.optimizer_begin_layout = m.layout_segments.clone();
                state.optimizer_begin_allocator = m.allocator;
                counts.kept += 1;
            }
            MarkerKind::OptimizerEnd if !state.optimizer_begin_layout.is_empty() => {
                let begin = std::mem::take(&mut state.optimizer_begin_layout);
                let begin_allocator = state.optimizer_begin_allocator.take();
                // The layouts hold the large pool only: the rest of what the
                // allocator reserved stays beside them.
                let in_layout: u64 = m.layout_segments.iter().map(|s| s.size()).sum();
                let left_out = m
                    .allocator
                    .map_or(0, |a| a.reserved_bytes.saturating_sub(in_layout));
                let context = LayoutContext {
                    gradient_bytes: state.info.model.parameter_bytes,
                    reserved_limit: reserved_limit.map(|l| l.saturating_sub(left_out)),
                    gradients_alive_in_forward: Gradients::of(&state.info)
                        != Gradients::FreedBeforeStep,
                    live_limit: live_limit(begin_allocator, m.allocator, &m.layout_segments),
                };
                match step2_new_segments_with(&begin, &m.layout_segments, &context) {
                    Ok(estimate) => {
                        state.layout_estimate = Some(estimate);
                        counts.kept += 1;
                    }
                    Err(_) => counts.unmodelled += 1,
                }
            }
            _ => counts.misplaced += 1,
        }
    }
}

/// [`LayoutContext::live_limit`] from the allocator's figures at step 1's
/// optimizer begin and end and the end layout: the allocated peak before the
/// optimizer plus the state it made, less what the pools the layout leaves
/// out (the small pool) hold at the end. None without both figures.
fn live_limit(
    begin: Option<AllocatorStats>,
    end: Option<AllocatorStats>,
    end_layout: &[SegmentLayout],
) -> Option<u64> {
    let (begin, end) = (begin?, end?);
    let state = end.allocated_bytes.saturating_sub(begin.allocated_bytes);
    let in_layout: u64 = end_layout
        .iter()
        .flat_map(|s| s.blocks.iter().filter(|b| b.allocated))
        .map(|b| b.size)
        .sum();
    let left_out = end.allocated_bytes.saturating_sub(in_layout);
    Some(
        begin
            .allocated_peak_bytes
            .max(begin.allocated_bytes)
            .saturating_add(state)
            .saturating_sub(left_out),
    )
}

/// What survives an agent restart: every rank's identity, timeline (step 1
/// and the latest steps), advisories and frozen prediction. GPU samples are
/// not kept; the phases they were credited to keep their statistics.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Journal {
    /// Format version; a journal of another version is not restored.
    pub version: u32,
    /// The ranks, as they stood when the journal was written.
    pub ranks: Vec<RankState>,
}

impl Journal {
    /// The format this build writes and reads.
    pub const VERSION: u32 = 1;
}

/// All ranks and GPUs on this node.
#[derive(Debug, Default)]
pub struct Tracker {
    config: TrackerConfig,
    ranks: BTreeMap<RankKey, RankState>,
    samples: HashMap<String, VecDeque<GpuSample>>,
    /// Per GPU: (pid, used bytes) of the processes NVML lists on it.
    processes: HashMap<String, Vec<(u32, u64)>>,
    analysis: AnalysisConfig,
    /// Sum of the ranks' [`RankTimeline::approx_bytes`].
    retained_bytes: u64,
    /// Steps dropped to stay within the memory budget.
    steps_trimmed_total: u64,
    /// Finished ranks dropped to stay within the memory budget.
    ranks_evicted_for_memory_total: u64,
    /// What became of the markers' segment layouts.
    layout_counts: LayoutCounts,
}

impl Tracker {
    /// An empty tracker bounded by `config`, with default analysis tunables.
    pub fn new(config: TrackerConfig) -> Self {
        Self {
            config,
            ranks: BTreeMap::new(),
            samples: HashMap::new(),
            processes: HashMap::new(),
            analysis: AnalysisConfig::default(),
            retained_bytes: 0,
            steps_trimmed_total: 0,
            ranks_evicted_for_memory_total: 0,
            layout_counts: LayoutCounts::default(),
        }
    }

    /// Replaces the tunables of [`Tracker::rank_analysis`] and
    /// [`Tracker::job_divergence`].
    pub fn set_analysis_config(&mut self, config: AnalysisConfig) {
        self.analysis = config;
        for state in self.ranks.values_mut() {
            state.refresh_memos(&self.analysis);
        }
    }

    /// The rank's trailing window after step 2 and each figure's growth
    /// (see `growth`), as kept; None for an unknown rank or before a step
    /// from the third on has completed.
    pub fn memory_trend(&self, key: &RankKey) -> Option<&MemoryTrend> {
        self.ranks.get(key)?.trend.trend()
    }

    /// When the rank's growing memory reaches its GPU's capacity (from the
    /// GPU's latest sample); None for an unknown rank, an unknown capacity,
    /// or memory that does not grow (see [`crate::forecast`]).
    pub fn memory_growth(&self, key: &RankKey) -> Option<GrowthForecast> {
        let state = self.ranks.get(key)?;
        forecast(
            state.trend.trend()?,
            self.capacity_of(state),
            &self.analysis.growth,
        )
    }

    /// The rank's evaluation passes and checkpoint saves, per kind: their
    /// peaks and own headroom (see `pass`); empty for an unknown rank or
    /// one that ran none.
    pub fn pass_peaks(&self, key: &RankKey) -> Vec<PassPeaks> {
        let Some(state) = self.ranks.get(key) else {
            return Vec::new();
        };
        let outside = state
            .trend
            .trend()
            .and_then(MemoryTrend::beyond_reserved_bytes);
        pass_peaks(&state.timeline, self.capacity_of(state), outside)
    }

    /// What the rank's steps say about their batches, and what the largest
    /// batch its loader can produce would need (see `batch`); None for an
    /// unknown rank or one that said nothing of batches.
    pub fn step_batches(&self, key: &RankKey) -> Option<StepBatches> {
        let state = self.ranks.get(key)?;
        let trend = state.trend.trend();
        StepBatches::of(
            trend.and_then(|t| t.batches.as_ref()),
            state.trend.largest_batch(),
            state.info.model.largest_batch.as_ref(),
            self.capacity_of(state),
            trend.map_or_else(BeyondAllocator::default, MemoryTrend::beyond_allocator),
        )
    }

    /// The capacity of the rank's GPU from its latest sample (0 without).
    fn capacity_of(&self, state: &RankState) -> u64 {
        self.latest_sample(&state.info.gpu_uuid)
            .map_or(0, |s| s.capacity_bytes)
    }

    /// Keeps what the client sent with its OOM marker for the post-mortem.
    /// Refused when the report breaks its bounds or the rank's latest OOM
    /// (see [`Died`]) is not in step `report.step` or a pass after it; a
    /// second report for the run is ignored. An unknown rank: ignored.
    pub fn record_oom_report(
        &mut self,
        key: &RankKey,
        report: OomReport,
        now_ns: u64,
    ) -> Result<(), OomReportError> {
        report.check()?;
        let Some(state) = self.ranks.get_mut(key) else {
            return Ok(());
        };
        let died = Died::of(&state.timeline).is_some_and(|d| d.step() == report.step);
        if !died {
            return Err(OomReportError::NoOomStep(report.step));
        }
        state.last_activity_ns = now_ns;
        if state.oom_report.is_none() {
            state.oom_report = Some(report);
        }
        Ok(())
    }

    /// The post-mortem of the rank's OOM (see `postmortem`); None for an
    /// unknown rank or one whose latest step did not die of OOM.
    pub fn post_mortem(&self, key: &RankKey) -> Option<PostMortem> {
        let state = self.ranks.get(key)?;
        let analysis = self.rank_analysis(key)?;
        let prediction = state
            .prediction_before_step2
            .as_ref()
            .or(analysis.prediction.as_ref());
        post_mortem(&PostMortemInputs {
            timeline: &state.timeline,
            report: state.oom_report.as_ref(),
            steady: analysis.steady.as_ref(),
            prediction,
            trend: state.trend.trend(),
            largest_batch: state.trend.largest_batch(),
            capacity_bytes: analysis.capacity_bytes,
            other_process_bytes: analysis.other_process_bytes,
            growth: &self.analysis.growth,
        })
    }

    /// The analysis tunables in use, for display.
    pub fn analysis_config(&self) -> &AnalysisConfig {
        &self.analysis
    }

    /// Records the processes NVML lists on a GPU, as (pid, used bytes); the
    /// latest list replaces the previous one. Used to tell each rank how much
    /// of its GPU other processes hold. Bounded like the sample windows.
    pub fn set_gpu_processes(&mut self, gpu_uuid: &str, processes: &[(u32, u64)]) {
        if !self.processes.contains_key(gpu_uuid) && self.processes.len() >= self.config.max_gpus {
            return;
        }
        let list = self.processes.entry(gpu_uuid.to_owned()).or_default();
        list.clear();
        list.extend(processes.iter().take(MAX_PROCESSES_PER_GPU).copied());
    }

    /// Bytes held on the rank's GPU by processes other than the rank's own
    /// PID, from the latest [`Tracker::set_gpu_processes`] list (0 without one);
    /// for a rank with no stream open, as they were when its last one closed
    /// ([`RankState::other_process_bytes_at_close`]).
    pub fn other_process_bytes(&self, key: &RankKey) -> u64 {
        let Some(state) = self.ranks.get(key) else {
            return 0;
        };
        if let Some(at_close) = state
            .other_process_bytes_at_close
            .filter(|_| state.connected_streams == 0)
        {
            return at_close;
        }
        self.live_other_process_bytes(state)
    }

    fn live_other_process_bytes(&self, state: &RankState) -> u64 {
        self.processes.get(&state.info.gpu_uuid).map_or(0, |list| {
            list.iter()
                .filter(|(pid, _)| *pid != state.info.pid)
                .fold(0u64, |acc, (_, b)| acc.saturating_add(*b))
        })
    }

    /// The first-step analysis of a rank: first-step and steady profiles,
    /// anomaly, steady state and the prediction from step 1 (running or
    /// complete; a running step's open phase is read from the sample
    /// window). Capacity comes from the GPU's latest sample (0 when none),
    /// other processes from [`Tracker::other_process_bytes`]. A step-2 OOM
    /// warning already given stands until a revision resting on a
    /// measurement withdraws it ([`Prediction::revise_after_warning`]). None
    /// for an unknown rank.
    pub fn rank_analysis(&self, key: &RankKey) -> Option<RankAnalysis> {
        let state = self.ranks.get(key)?;
        let gpu = state.info.gpu_uuid.as_str();
        let first = state.timeline.steps().next();
        let live = first
            .filter(|s| s.outcome == StepOutcome::Running)
            .and_then(|s| s.phases.last())
            .filter(|p| p.end_monotonic_ns.is_none())
            .map(|p| LiveStep::from_samples(self.samples_since(gpu, p.start_monotonic_ns)));
        let samples = first.into_iter().flat_map(|s| {
            let end = s.end_monotonic_ns.unwrap_or(u64::MAX);
            self.samples_since(gpu, s.begin_monotonic_ns)
                .take_while(move |x| x.monotonic_ns < end)
        });
        let mut analysis = analyze_rank(
            RankInputs {
                timeline: &state.timeline,
                facts: &state.info.model,
                capacity_bytes: self.latest_sample(gpu).map_or(0, |s| s.capacity_bytes),
                other_process_bytes: self.other_process_bytes(key),
                steady: Some(
                    state
                        .steady
                        .with(&state.timeline, &self.analysis, |s| s.cloned()),
                ),
            },
            StepOneExtras {
                live: live.as_ref(),
                replay: state.allocator_replay.as_ref(),
                layout: state.layout_estimate.as_ref(),
                gradients: Gradients::of(&state.info),
                step2_batch: state.step2_batch.as_ref(),
            },
            samples,
            &self.analysis,
        );
        // A step-2 OOM warning already given is withdrawn only on a measurement.
        let warned = advisory::already_issued(&state.advisories, AdvisoryKind::Step2OomPredicted);
        if let Some(p) = analysis.prediction.as_mut() {
            p.revise_after_warning(warned);
        }
        Some(analysis)
    }

    /// Advisories that have become due for `key` outside a marker batch
    /// (a trace replay, facts learnt later): the step-1 checks, recorded
    /// as issued.
    pub fn advise(&mut self, key: &RankKey, now_ns: u64) -> Vec<Advisory> {
        let batch = checks::Batch {
            markers: &[],
            boundary: false,
            retry_growth: None,
            now_ns,
        };
        self.run_checks(checks::STEP_ONE, key, &batch)
    }

    /// Runs `checks` for `key` and records what they found due as issued.
    fn run_checks(
        &mut self,
        checks: &[&dyn checks::Check],
        key: &RankKey,
        batch: &checks::Batch<'_>,
    ) -> Vec<Advisory> {
        let mut due = Vec::new();
        for check in checks {
            let found = check.due(self, key, batch).unwrap_or_default();
            if let Some(state) = self.ranks.get_mut(key) {
                state.advisories.extend(found.iter().cloned());
            }
            due.extend(found);
        }
        due
    }

    /// Divergence of the ranks of `job` in `namespace` on this node (see
    /// [`RankFigures::of`] for when a rank's figures count). None when the
    /// job has no rank here. Jobs are told apart by namespace as well as id.
    pub fn job_divergence(&self, namespace: &str, job: &str) -> Option<Divergence> {
        let figures: Vec<RankFigures> = self
            .job_ranks(namespace, job)
            .map(|(key, state)| {
                state
                    .steady
                    .with(&state.timeline, &self.analysis, |steady| {
                        RankFigures::of(key.rank, state.timeline.steps().next(), steady)
                    })
            })
            .collect();
        divergence(job, &figures, self.analysis.divergence_threshold)
    }

    /// The ranks of `job` in `namespace`, in rank order.
    pub fn job_ranks<'a>(
        &'a self,
        namespace: &str,
        job: &str,
    ) -> impl Iterator<Item = (&'a RankKey, &'a RankState)> + 'a {
        let lo = RankKey::new(namespace, job, 0);
        let hi = RankKey::new(namespace, job, u32::MAX);
        self.ranks.range(lo..=hi)
    }

    /// Registers a stream's hello. See [`Tracker::open_evicting`].
    pub fn open(&mut self, info: RankInfo, now_ns: u64) -> Result<RankKey, OpenError> {
        self.open_evicting(info, now_ns).map(|opened| opened.key)
    }

    /// Registers a stream's hello:
    ///
    /// | the rank is …                       | the hello is from …          | then                    |
    /// |-------------------------------------|------------------------------|-------------------------|
    /// | tracked, any                        | the same process, same run   | resume its timeline     |
    /// | tracked, any                        | the same process, a new run  | start it afresh         |
    /// | connected                           | another process or pod       | refused, `RankHeld`     |
    /// | its stream broke within the reconnect window | another process or pod | refused, `RankHeld` |
    /// | attested by the kubelet             | an unattested claimant       | refused, `RankHeld`     |
    /// | tracked, disconnected               | another process              | a new run (below)       |
    /// | unknown                             | anyone                       | a new rank              |
    ///
    /// A hello's run is new when its run id is set and differs from the
    /// rank's ([`RankInfo::run_id`]): a second `fit()` in one process. The
    /// rank then starts afresh, like a rank taken over by a new process:
    /// step 1 again, no advisories, no frozen prediction or replay. An
    /// empty run id (older clients) never starts one.
    ///
    /// A new run: when a new process opens a tracked rank of a job none of
    /// whose ranks is connected, the job was resubmitted under the same id,
    /// and the earlier run's ranks are dropped (listed in
    /// [`Opened::superseded`]); otherwise a job resubmitted with another
    /// world size would count both runs' ranks until they aged out. (A rank
    /// never seen before is no such sign: ranks of one run may start late.)
    ///
    /// When the table is full, the rank whose process left longest ago
    /// gives way (finished ranks would otherwise hold their slots for the
    /// whole retention window and lock new jobs out); only when every rank
    /// is connected is the hello refused.
    pub fn open_evicting(&mut self, info: RankInfo, now_ns: u64) -> Result<Opened, OpenError> {
        info.validate()?;
        let key = info.key();
        let retained = self.config.max_retained_steps;
        let held = |why: &str, run_left: bool| OpenError::RankHeld {
            job: key.job.clone(),
            rank: key.rank,
            why: why.to_string(),
            run_left,
        };
        let (known, resumes) = match self.ranks.get(&key) {
            Some(state) => {
                let same = state.info.same_claimant(&info);
                if state.connected_streams > 0 && !same {
                    return Err(held(
                        "its stream is open, from another process or pod",
                        false,
                    ));
                }
                if now_ns < state.reconnect_until_ns && !same {
                    return Err(held(
                        "its process's stream broke moments ago and the rank is kept for it to reconnect (--reconnect-window)",
                        false,
                    ));
                }
                if same && !info.run_id.is_empty() && state.ended_runs.contains(&info.run_id) {
                    return Err(held(
                        &format!(
                            "by run {:?} of the same process, which started after run {:?} of this hello",
                            state.info.run_id, info.run_id
                        ),
                        true,
                    ));
                }
                if state.info.attested && !info.attested {
                    return Err(held(
                        "the kubelet vouched for its pod, and not for this hello's",
                        false,
                    ));
                }
                let new_run = !info.run_id.is_empty() && info.run_id != state.info.run_id;
                (true, same && !new_run)
            }
            None => (false, false),
        };
        let mut superseded = Vec::new();
        let job_idle = self
            .job_ranks(&key.namespace, &key.job)
            .all(|(_, r)| r.connected_streams == 0);
        if known && !resumes && job_idle {
            superseded = self
                .job_ranks(&key.namespace, &key.job)
                .map(|(k, _)| k.clone())
                .filter(|k| *k != key)
                .collect();
            for gone in &superseded {
                self.ranks.remove(gone);
            }
        }
        if let Some(state) = self.ranks.get_mut(&key) {
            if !resumes {
                if state.info.same_claimant(&info) {
                    if !state.info.run_id.is_empty() {
                        let ended = std::mem::take(&mut state.info.run_id);
                        state.ended_runs.push(ended);
                        let over = state.ended_runs.len().saturating_sub(MAX_ENDED_RUNS);
                        state.ended_runs.drain(..over);
                    }
                } else {
                    state.ended_runs.clear();
                }
                state.timeline = RankTimeline::new(retained);
                state.advisories.clear();
                state.prediction_before_step2 = None;
                state.allocator_replay = None;
                state.step2_batch = None;
                state.optimizer_begin_layout.clear();
                state.optimizer_begin_allocator = None;
                state.layout_estimate = None;
                state.allocator_retries = None;
                state.steady = SteadyMemo::default();
                state.trend = TrendMemo::default();
                state.clock = Default::default();
            }
            state.info = info;
            state.connected_streams += 1;
            state.other_process_bytes_at_close = None;
            state.last_activity_ns = now_ns;
            state.reconnect_until_ns = 0;
            self.recount_retained();
            return Ok(Opened {
                key,
                evicted: None,
                superseded,
            });
        }
        if !superseded.is_empty() {
            self.recount_retained();
        }
        let mut evicted = None;
        if self.ranks.len() >= self.config.max_ranks {
            let Some(gone) = self.longest_finished() else {
                return Err(OpenError::TooManyRanks(self.config.max_ranks));
            };
            self.ranks.remove(&gone);
            self.recount_retained();
            evicted = Some(gone);
        }
        self.ranks.insert(
            key.clone(),
            RankState {
                info,
                timeline: RankTimeline::new(retained),
                connected_streams: 1,
                last_activity_ns: now_ns,
                advisories: Vec::new(),
                prediction_before_step2: None,
                allocator_replay: None,
                step2_batch: None,
                optimizer_begin_layout: Vec::new(),
                optimizer_begin_allocator: None,
                layout_estimate: None,
                ended_runs: Vec::new(),
                allocator_retries: None,
                oom_report: None,
                reconnect_until_ns: 0,
                other_process_bytes_at_close: None,
                steady: SteadyMemo::default(),
                trend: TrendMemo::default(),
                clock: Default::default(),
            },
        );
        Ok(Opened {
            key,
            evicted,
            superseded,
        })
    }

    /// A journal of every rank, with at most `keep_last` steps after step 1
    /// per rank.
    pub fn journal(&self, keep_last: usize) -> Journal {
        Journal {
            version: Journal::VERSION,
            ranks: self
                .ranks
                .keys()
                .filter_map(|key| self.journal_rank(key, keep_last))
                .collect(),
        }
    }

    /// One rank as [`Tracker::journal`] keeps it; None for an unknown rank.
    /// Lets a caller that shares the tracker build the journal a rank at a
    /// time instead of holding it for every rank.
    pub fn journal_rank(&self, key: &RankKey, keep_last: usize) -> Option<RankState> {
        let r = self.ranks.get(key)?;
        Some(RankState {
            info: r.info.clone(),
            timeline: r.timeline.trimmed(keep_last),
            connected_streams: r.connected_streams,
            last_activity_ns: r.last_activity_ns,
            advisories: r.advisories.clone(),
            prediction_before_step2: r.prediction_before_step2.clone(),
            allocator_replay: r.allocator_replay,
            step2_batch: r.step2_batch.clone(),
            optimizer_begin_layout: r.optimizer_begin_layout.clone(),
            optimizer_begin_allocator: r.optimizer_begin_allocator,
            layout_estimate: r.layout_estimate,
            ended_runs: r.ended_runs.clone(),
            allocator_retries: r.allocator_retries,
            oom_report: r.oom_report.clone(),
            reconnect_until_ns: r.reconnect_until_ns,
            other_process_bytes_at_close: r.other_process_bytes_at_close,
            steady: SteadyMemo::default(),
            trend: TrendMemo::default(),
            clock: Default::default(),
        })
    }

    /// The keys of every tracked rank, in order (namespace, job, rank).
    pub fn rank_keys(&self) -> Vec<RankKey> {
        self.ranks.keys().cloned().collect()
    }

    /// Restores ranks from a journal written by an earlier agent. Restored
    /// ranks count as disconnected since `now_ns`, so they are evicted after
    /// the retention window unless their process reconnects (its hello
    /// resumes the timeline). Ranks already tracked, beyond the rank limit,
    /// or whose identity a hello could not have carried (the journal is a
    /// file anyone with access may have edited) are skipped. Returns how
    /// many were restored.
    pub fn restore(&mut self, journal: Journal, now_ns: u64) -> usize {
        if journal.version != Journal::VERSION {
            return 0;
        }
        let mut restored = 0;
        for mut state in journal.ranks {
            let key = state.info.key();
            if state.info.validate().is_err()
                || self.ranks.contains_key(&key)
                || self.ranks.len() >= self.config.max_ranks
            {
                continue;
            }
            // A rank connected when the journal was written is its process's
            // while it reconnects to this agent.
            state.reconnect_until_ns = if state.connected_streams > 0 && state.info.identifiable() {
                now_ns.saturating_add(self.config.reconnect_window_ns)
            } else {
                0
            };
            state.connected_streams = 0;
            state.last_activity_ns = now_ns;
            state
                .timeline
                .set_max_retained_steps(self.config.max_retained_steps);
            state.refresh_memos(&self.analysis);
            self.ranks.insert(key, state);
            restored += 1;
        }
        self.recount_retained();
        restored
    }

    /// Marks one stream of the rank closed; a clean close ends any
    /// reconnect window (also how a caller ends the window of a process it
    /// knows is gone). With the last one, keeps what other processes held on
    /// its GPU then.
    pub fn close(&mut self, key: &RankKey, now_ns: u64) {
        let others = self.other_process_bytes(key);
        if let Some(state) = self.ranks.get_mut(key) {
            state.connected_streams = state.connected_streams.saturating_sub(1);
            state.last_activity_ns = now_ns;
            state.reconnect_until_ns = 0;
            if state.connected_streams == 0 {
                state.other_process_bytes_at_close = Some(others);
            }
        }
    }

    /// Marks one stream of the rank broken (it ended without the client
    /// closing it): when it was the last, the rank stays its process's for
    /// [`TrackerConfig::reconnect_window_ns`].
    pub fn disconnect(&mut self, key: &RankKey, now_ns: u64) {
        self.close(key, now_ns);
        let window = self.config.reconnect_window_ns;
        if let Some(state) = self.ranks.get_mut(key) {
            // A claimant nothing identifies (TCP without a client
            // certificate) could not take it back: holding it would only
            // lock its own reconnect out.
            if state.connected_streams == 0 && state.info.identifiable() {
                state.reconnect_until_ns = now_ns.saturating_add(window);
            }
        }
    }

    /// [`Tracker::markers`] for a batch from a stream whose hello named run
    /// `run_id`: refused ([`MarkerError::RunEnded`], nothing changes) when
    /// the rank has since started another run. A process that starts a
    /// second run (a second `fit()`) opens a new stream while the old run's
    /// may still be open (its last batches in flight, or a second client);
    /// the rank's state is the new run's, and the old run's markers would
    /// rewrite its step 1 (timeline, layouts, prediction). When either run
    /// id is empty (older clients), the batch is applied as before.
    pub fn run_markers(
        &mut self,
        key: &RankKey,
        run_id: &str,
        markers: &[Marker],
        now_ns: u64,
    ) -> Result<Vec<Advisory>, MarkerError> {
        self.check_run(key, run_id)?;
        self.markers(key, markers, now_ns)
    }

    /// Whether a stream whose hello named run `run_id` may still feed the
    /// rank: [`MarkerError::RunEnded`] once the rank has started another
    /// run (see [`Tracker::run_markers`]); also checked before a stream's
    /// facts update or allocator trace ([`crate::feed::apply`]), which would
    /// otherwise change the newer run's facts or step-2 replay. Ok when
    /// either run id is empty, or the rank is not tracked.
    pub fn check_run(&self, key: &RankKey, run_id: &str) -> Result<(), MarkerError> {
        let Some(state) = self.ranks.get(key) else {
            return Ok(());
        };
        let rank_run = &state.info.run_id;
        if !run_id.is_empty() && !rank_run.is_empty() && run_id != rank_run {
            return Err(MarkerError::RunEnded {
                stream_run: run_id.to_string(),
                rank_run: rank_run.clone(),
            });
        }
        Ok(())
    }

    /// Applies a batch of markers for an open rank, all or nothing, credits
    /// GPU samples to the phases it closed, and returns the advisories that
    /// became due. While the rank is in its first step, advisories are
    /// checked after the batch, and also just before the first marker of the
    /// second step when the same batch holds it (a client may send step 1's
    /// end and step 2's begin together): that is the last moment a step-2
    /// warning can be given, and the moment the prediction is frozen.
    pub fn markers(
        &mut self,
        key: &RankKey,
        markers: &[Marker],
        now_ns: u64,
    ) -> Result<Vec<Advisory>, MarkerError> {
        let Some(state) = self.ranks.get(key) else {
            return Ok(Vec::new());
        };
        state.timeline.check_batch(markers)?;
        if markers.iter().any(|m| m.kind.opens().is_some()) {
            self.check_budget(&key.namespace)?;
        }
        let Some(state) = self.ranks.get_mut(key) else {
            return Ok(Vec::new());
        };
        let clock_advisory = if self.config.check_client_clock {
            check_clock(state, markers, now_ns)?
        } else {
            None
        };
        state.last_activity_ns = now_ns;
        let in_first_step = state.in_first_step();
        let ends_layouts = markers
            .iter()
            .any(|m| m.kind == MarkerKind::OptimizerEnd && !m.layout_segments.is_empty());
        let reserved_limit = ends_layouts.then(|| self.reserved_limit(key)).flatten();
        let Some(state) = self.ranks.get_mut(key) else {
            return Ok(Vec::new());
        };
        take_optimizer_layouts(
            state,
            markers,
            in_first_step,
            reserved_limit,
            &mut self.layout_counts,
        );
        let split = if state.in_first_step() {
            let first = state
                .timeline
                .steps()
                .next()
                .map(|s| s.step)
                .or(markers.first().map(|m| m.step));
            markers.iter().position(|m| Some(m.step) > first)
        } else {
            None
        };
        let boundary = split.is_some()
            || markers.iter().any(|m| {
                matches!(
                    m.kind,
                    MarkerKind::StepBegin | MarkerKind::StepEnd | MarkerKind::Oom
                )
            });
        // Step 2's first forward that says its batch: applied on its own
        // after what precedes it, so that a warning from the prediction
        // revised for a larger batch comes before step 2's backward in the
        // agent's order, whatever the batching.
        let forward2 = self.step2_forward(key, markers, split);
        let mut at = split.unwrap_or(forward2.map_or(markers.len(), |f| f + 1));
        self.apply_and_credit(key, &markers[..at]);
        let batch = checks::Batch {
            markers,
            boundary,
            retry_growth: None,
            now_ns,
        };
        // The prediction step 2's warning is judged on, frozen before step
        // 2's first marker when the batch holds it (before the warning it
        // may give is recorded, as the check judged it).
        let frozen = split.map(|_| self.rank_analysis(key).and_then(|a| a.prediction));
        let mut advisories = self.run_checks(checks::STEP_ONE, key, &batch);
        if let Some(frozen) = frozen {
            if let Some(state) = self.ranks.get_mut(key) {
                state.prediction_before_step2 = frozen;
            }
            let upto = forward2.map_or(markers.len(), |f| f + 1);
            self.apply_and_credit(key, &markers[at..upto]);
            at = upto;
        }
        if let Some(f) = forward2 {
            self.take_step2_batch(key, &markers[f]);
            advisories.extend(self.run_checks(&[&checks::Step2LargerBatch], key, &batch));
        }
        self.apply_and_credit(key, &markers[at..]);
        let retry_growth = self.ranks.get_mut(key).and_then(|state| {
            let (seen, growth) = advisory::retry_growth(state.allocator_retries, markers);
            state.allocator_retries = seen;
            growth
        });
        let batch = checks::Batch {
            retry_growth,
            ..batch
        };
        advisories.extend(self.run_checks(checks::AFTER_BATCH, key, &batch));
        if let Some(a) = clock_advisory {
            if let Some(state) = self.ranks.get_mut(key) {
                state.advisories.push(a.clone());
            }
            advisories.push(a);
        }
        Ok(advisories)
    }

    /// Where in `markers` the rank's second step's first forward that
    /// says its batch is, while none was taken yet and the second step has
    /// not ended (the retained steps' second is a later step once the
    /// history is trimmed); `split`: where the second step begins in
    /// `markers`, when it does.
    fn step2_forward(
        &self,
        key: &RankKey,
        markers: &[Marker],
        split: Option<usize>,
    ) -> Option<usize> {
        let state = self.ranks.get(key)?;
        if state.step2_batch.is_some() || state.timeline.steps_completed() > 1 {
            return None;
        }
        let second = match split {
            Some(i) => markers[i].step,
            None => state.timeline.steps().nth(1)?.step,
        };
        markers.iter().position(|m| {
            m.step == second
                && m.kind == MarkerKind::ForwardBegin
                && m.batch.as_ref().is_some_and(|b| !b.is_empty())
        })
    }

    /// Keeps the batch `forward` (the rank's second step's first forward
    /// that said one, applied) carried ([`RankState::step2_batch`]); when
    /// it is larger than step 1's, the prediction step 2 is judged on
    /// becomes the one revised for it.
    fn take_step2_batch(&mut self, key: &RankKey, forward: &Marker) {
        let Some(state) = self.ranks.get_mut(key) else {
            return;
        };
        state.step2_batch = forward.batch.clone();
        if state.prediction_before_step2.is_none() {
            return;
        }
        let revised = self
            .rank_analysis(key)
            .and_then(|a| a.prediction)
            .filter(|p| p.inputs.batch_revision.is_some());
        if let (Some(p), Some(state)) = (revised, self.ranks.get_mut(key)) {
            state.prediction_before_step2 = Some(p);
        }
    }

    /// The most the rank's allocator may reserve on its GPU, for replaying
    /// its allocator trace within it: capacity minus what NVML shows beyond
    /// the allocator (CUDA context, workspaces, other processes), as the
    /// rank's current prediction measured it. None while either is unknown.
    pub fn reserved_limit(&self, key: &RankKey) -> Option<u64> {
        let p = self.rank_analysis(key)?.prediction?;
        let overhead = p.inputs.overhead.overhead_bytes?;
        (p.inputs.capacity_bytes > 0).then(|| p.inputs.capacity_bytes.saturating_sub(overhead))
    }

    /// Takes step 2's replay from the rank's step-1 allocator trace (see
    /// `replay`; the caller runs the replay, outside any lock) and
    /// returns the advisories that became due with it. None, and nothing
    /// changes, when the rank is unknown or is no longer in its first step:
    /// a replay only counts before step 2 begins.
    pub fn allocator_replay(
        &mut self,
        key: &RankKey,
        replay: Step2Replay,
        now_ns: u64,
    ) -> Option<Vec<Advisory>> {
        let state = self.ranks.get_mut(key)?;
        // The trace is of step 1, which must have begun.
        let in_step1 =
            state.in_first_step() && state.timeline.current().is_some_and(|s| s.step == 1);
        if !in_step1 {
            return None;
        }
        state.allocator_replay = Some(replay);
        state.last_activity_ns = now_ns;
        Some(self.advise(key, now_ns))
    }

    /// Takes facts a rank learnt after its hello (see [`ModelFacts::merge`])
    /// and returns the advisories that became due with them. The merged
    /// facts are checked as a hello's are; refused, nothing changes. After
    /// step 2 began they are kept for what follows but the prediction made
    /// before it stands: `Ok(None)`, as for a late allocator replay.
    pub fn update_model_facts(
        &mut self,
        key: &RankKey,
        update: &ModelFacts,
        now_ns: u64,
    ) -> Result<Option<Vec<Advisory>>, HelloError> {
        let Some(state) = self.ranks.get_mut(key) else {
            return Ok(None);
        };
        let mut info = state.info.clone();
        info.model.merge(update);
        info.validate()?;
        state.info = info;
        state.last_activity_ns = now_ns;
        if !state.in_first_step() {
            return Ok(None);
        }
        Ok(Some(self.advise(key, now_ns)))
    }

    /// Applies an already checked batch and credits samples to the phases it
    /// closed; then keeps the ranks within the memory budget.
    fn apply_and_credit(&mut self, key: &RankKey, markers: &[Marker]) {
        let Some(state) = self.ranks.get_mut(key) else {
            return;
        };
        let before = state.timeline.approx_bytes();
        state
            .timeline
            .apply_batch(markers)
            .expect("the batch was checked as a whole");
        let after = state.timeline.approx_bytes();
        let empty = VecDeque::new();
        let window = self.samples.get(&state.info.gpu_uuid).unwrap_or(&empty);
        credit_newly_closed(&mut state.timeline, window);
        state.refresh_memos(&self.analysis);
        self.retained_bytes = (self.retained_bytes + after).saturating_sub(before);
        self.enforce_budget();
    }

    /// Whether a batch of a rank of `namespace` may add phases: yes within
    /// the budget (after finished ranks gave way); past it, only while the
    /// namespace holds less than its share (see
    /// [`TrackerConfig::memory_budget_bytes`]).
    fn check_budget(&mut self, namespace: &str) -> Result<(), MarkerError> {
        let budget = self.config.memory_budget_bytes;
        if self.retained_bytes <= budget {
            return Ok(());
        }
        // Streams closed since the last batch: their ranks give way now.
        self.enforce_budget();
        if self.retained_bytes <= budget {
            return Ok(());
        }
        let held = self.namespace_bytes();
        let share = budget / held.len().max(1) as u64;
        let holds = held.get(namespace).copied().unwrap_or(0);
        if holds < share {
            return Ok(());
        }
        Err(MarkerError::MemoryBudget {
            budget_bytes: budget,
            namespace: namespace.to_string(),
            share_bytes: share,
        })
    }

    /// Bytes each namespace's ranks retain.
    fn namespace_bytes(&self) -> HashMap<&str, u64> {
        let mut held = HashMap::new();
        for (key, rank) in &self.ranks {
            *held.entry(key.namespace.as_str()).or_default() += rank.timeline.approx_bytes();
        }
        held
    }

    /// The rank with no stream left that was active longest ago: the
    /// first to give way.
    fn longest_finished(&self) -> Option<RankKey> {
        self.ranks
            .iter()
            .filter(|(_, r)| r.connected_streams == 0)
            .min_by_key(|(_, r)| r.last_activity_ns)
            .map(|(k, _)| k.clone())
    }

    /// Frees retained steps until they fit the budget: finished ranks go
    /// first, the one that finished longest ago first; then the namespace
    /// holding the most (among those with a step to give) drops its
    /// largest rank's oldest step; until nothing is left to give.
    fn enforce_budget(&mut self) {
        while self.retained_bytes > self.config.memory_budget_bytes {
            if let Some(key) = self.longest_finished() {
                if let Some(gone) = self.ranks.remove(&key) {
                    let freed = gone.timeline.approx_bytes();
                    self.retained_bytes = self.retained_bytes.saturating_sub(freed);
                    self.ranks_evicted_for_memory_total += 1;
                }
                continue;
            }
            let held = self.namespace_bytes();
            let largest = self
                .ranks
                .iter()
                .filter(|(_, r)| r.timeline.steps().len() > 2)
                .max_by_key(|(k, r)| (held[k.namespace.as_str()], r.timeline.approx_bytes()))
                .map(|(k, _)| k.clone());
            let Some(rank) = largest.and_then(|k| self.ranks.get_mut(&k)) else {
                return;
            };
            let before = rank.timeline.approx_bytes();
            rank.timeline.trim_oldest();
            let freed = before - rank.timeline.approx_bytes();
            self.retained_bytes = self.retained_bytes.saturating_sub(freed);
            self.steps_trimmed_total += 1;
        }
    }

    /// Finished ranks dropped to stay within the memory budget.
    pub fn ranks_evicted_for_memory_total(&self) -> u64 {
        self.ranks_evicted_for_memory_total
    }

    /// Recounts [`Tracker::retained_bytes`] after ranks came or went.
    fn recount_retained(&mut self) {
        self.retained_bytes = self.ranks.values().map(|r| r.timeline.approx_bytes()).sum();
        self.enforce_budget();
    }

    /// Bytes the ranks' retained steps hold (approximately); compare with
    /// [`TrackerConfig::memory_budget_bytes`].
    pub fn retained_bytes(&self) -> u64 {
        self.retained_bytes
    }

    /// Steps dropped before their time to stay within the memory budget.
    pub fn steps_trimmed_total(&self) -> u64 {
        self.steps_trimmed_total
    }

    /// What became of the segment layouts markers carried, so far.
    pub fn layout_counts(&self) -> LayoutCounts {
        self.layout_counts
    }

    /// Adds GPU samples (any order, any batch size) and credits those that
    /// fall in already closed phases of the ranks on that GPU.
    pub fn gpu_samples(&mut self, gpu_uuid: &str, samples: &[GpuSample]) {
        if samples.is_empty() {
            return;
        }
        if !self.samples.contains_key(gpu_uuid) && self.samples.len() >= self.config.max_gpus {
            return;
        }
        let window = self.samples.entry(gpu_uuid.to_owned()).or_default();
        for s in samples {
            // Samples normally arrive in time order; keep the window sorted
            // anyway, by time then bytes so that ties do not depend on order.
            let at = window.partition_point(|w| {
                (w.monotonic_ns, w.used_bytes) <= (s.monotonic_ns, s.used_bytes)
            });
            window.insert(at, *s);
        }
        while window.len() > self.config.max_samples_per_gpu {
            window.pop_front();
        }
        for state in self
            .ranks
            .values_mut()
            .filter(|r| r.info.gpu_uuid == gpu_uuid)
        {
            // Mutable access only for a sample that lands, so that the
            // timeline's revision moves only when its steps change.
            for s in samples {
                if let Some((step, phase)) = closed_phase_at(&state.timeline, s.monotonic_ns) {
                    if let Some(step) = state.timeline.steps_mut().nth(step) {
                        step.phases[phase].add_sample(s.monotonic_ns, s.used_bytes);
                    }
                }
                let pass = state
                    .timeline
                    .passes()
                    .rposition(|p| p.credited && p.contains(s.monotonic_ns));
                if let Some(pass) = pass {
                    if let Some(p) = state.timeline.passes_mut().nth(pass) {
                        p.nvml.add(s.used_bytes);
                    }
                }
                let first = state.timeline.steps().next();
                if first.is_some_and(|f| f.takes_before_begin(s.monotonic_ns, s.used_bytes))
                    && !in_a_pass(&state.timeline, s.monotonic_ns)
                {
                    if let Some(first) = state.timeline.steps_mut().next() {
                        first.offer_before_begin(s.monotonic_ns, s.used_bytes);
                    }
                }
            }
            state.refresh_memos(&self.analysis);
        }
    }

    /// Samples of a GPU from `from_ns` on (for phases that are still open).
    pub fn samples_since(&self, gpu_uuid: &str, from_ns: u64) -> impl Iterator<Item = &GpuSample> {
        self.samples.get(gpu_uuid).into_iter().flat_map(move |w| {
            let start = w.partition_point(|s| s.monotonic_ns < from_ns);
            w.range(start..)
        })
    }

    /// Latest sample of a GPU.
    pub fn latest_sample(&self, gpu_uuid: &str) -> Option<&GpuSample> {
        self.samples.get(gpu_uuid).and_then(|w| w.back())
    }

    /// Drops ranks with no open stream and no activity for `retention_ns`.
    /// Returns how many were evicted.
    pub fn evict_idle(&mut self, now_ns: u64, retention_ns: u64) -> usize {
        let before = self.ranks.len();
        self.ranks.retain(|_, r| {
            r.connected_streams > 0 || now_ns.saturating_sub(r.last_activity_ns) < retention_ns
        });
        let evicted = before - self.ranks.len();
        if evicted > 0 {
            self.recount_retained();
        }
        evicted
    }

    /// A tracked rank, or None when unknown or evicted.
    pub fn rank(&self, key: &RankKey) -> Option<&RankState> {
        self.ranks.get(key)
    }

    /// All ranks, ordered by job then rank.
    pub fn ranks(&self) -> impl Iterator<Item = (&RankKey, &RankState)> {
        self.ranks.iter()
    }

    /// Number of tracked ranks; exported as a gauge.
    pub fn rank_count(&self) -> usize {
        self.ranks.len()
    }
}

/// Checks a batch's clock (see `clock`): Err when it jumped ahead; the
/// advisory due, once per rank and run, when the rank's clock turns out
/// far from the caller's.
fn check_clock(
    state: &mut RankState,
    markers: &[Marker],
    now_ns: u64,
) -> Result<Option<Advisory>, MarkerError> {
    use crate::clock::{offset_advisory, offset_is_far, ClockVerdict};
    let step = markers.first().map_or(0, |m| m.step);
    match state.clock.check(markers, now_ns) {
        ClockVerdict::Ok => Ok(None),
        ClockVerdict::Jumped { ahead_ns } => Err(MarkerError::ClockJumped { ahead_ns, step }),
        ClockVerdict::New { offset_ns } => {
            let told = advisory::already_issued(&state.advisories, AdvisoryKind::ClientClock);
            Ok((offset_is_far(offset_ns) && !told)
                .then(|| offset_advisory(step, now_ns, offset_ns)))
        }
    }
}

/// Credits window samples to every phase that has closed but not yet been
/// scanned. Phases are credited in the order they close, so a step with a
/// phase credited by an earlier call has only settled steps before it: the
/// walk stops there. (It must not stop at a step that merely has nothing new,
/// such as a just-opened step whose only phase is still open: the same batch
/// may have closed the step before it.)
fn credit_newly_closed(timeline: &mut RankTimeline, window: &VecDeque<GpuSample>) {
    // The first step's sample before it began (the prediction uses it; later
    // steps' would be unused), outside any pass (a sanity-check evaluation
    // before step 1 is no measure of what step 1 starts from). Late samples
    // are offered in `gpu_samples`.
    let first_begin = timeline.steps().next().map(|f| f.begin_monotonic_ns);
    if let Some(begin) = first_begin {
        let before = window.partition_point(|s| s.monotonic_ns < begin);
        let quiet = window
            .range(..before)
            .rev()
            .take_while(|s| begin - s.monotonic_ns <= crate::timeline::BEFORE_BEGIN_WINDOW_NS)
            .find(|s| !in_a_pass(timeline, s.monotonic_ns))
            .copied();
        if let (Some(s), Some(first)) = (quiet, timeline.steps_mut().next()) {
            first.offer_before_begin(s.monotonic_ns, s.used_bytes);
        }
    }
    let uncredited = |p: &crate::PassRecord| p.end_monotonic_ns.is_some() && !p.credited;
    if timeline.passes().any(uncredited) {
        for pass in timeline.passes_mut().filter(|p| uncredited(p)) {
            let start = window.partition_point(|s| s.monotonic_ns < pass.begin_monotonic_ns);
            let end = pass.end_monotonic_ns.unwrap_or(u64::MAX);
            for s in window.range(start..).take_while(|s| s.monotonic_ns < end) {
                pass.nvml.add(s.used_bytes);
            }
            pass.credited = true;
        }
    }
    for step in timeline.steps_mut().rev() {
        let settled = step.phases.iter().any(|p| p.credited);
        for phase in step
            .phases
            .iter_mut()
            .filter(|p| p.end_monotonic_ns.is_some() && !p.credited)
        {
            let start = window.partition_point(|s| s.monotonic_ns < phase.start_monotonic_ns);
            let end = phase.end_monotonic_ns.unwrap_or(u64::MAX);
            for s in window.range(start..).take_while(|s| s.monotonic_ns < end) {
                phase.add_sample(s.monotonic_ns, s.used_bytes);
            }
            phase.credited = true;
        }
        if settled {
            break;
        }
    }
}

/// Whether time `t` falls in one of the timeline's passes.
fn in_a_pass(timeline: &RankTimeline, t: u64) -> bool {
    timeline.passes().any(|p| p.contains(t))
}

/// The closed, already scanned phase holding time `t`, if any, as (step,
/// phase) indices into the retained steps.
fn closed_phase_at(timeline: &RankTimeline, t: u64) -> Option<(usize, usize)> {
    let (index, step) = timeline
        .steps()
        .enumerate()
        .rev()
        .find(|(_, s)| s.begin_monotonic_ns <= t)?;
    let phase = step.phases.iter().position(|p| p.contains(t))?;
    step.phases[phase].credited.then_some((index, phase))
}
