//! First-step analysis of one rank: the first step's profile against the
//! steady state, the anomaly between them, whether steady state has been
//! reached, and the prediction.
//!
//! * **First step**: the first step the rank's timeline holds (step 1 of the
//!   process; the timeline always keeps it).
//! * **Steady profile**: the median of each figure over the first
//!   [`AnalysisConfig::steady_window`] completed steps after the first (steps
//!   2..k), once at least [`AnalysisConfig::min_steady_steps`] (k ≥ 3) have
//!   completed. When retention dropped those steps, the earliest retained ones
//!   stand in.
//! * **Steady state reached**: among the completed steps after the first, in
//!   order, [`AnalysisConfig::steady_agreements`] consecutive pairs of step
//!   peaks agree within [`AnalysisConfig::steady_tolerance`] of the larger
//!   (default: 3 steps in a row within 2%). Peaks are NVML peaks when every
//!   such step has one, else allocated peaks.
//! * **Activation plateau**: from the device samples of step 1, for the
//!   forward phase with the highest NVML peak `P`: from the first sample in
//!   that forward at or above `P × (1 − plateau_tolerance)` to the first later
//!   sample below it, searched up to the end of the backward phase that
//!   follows. NVML shows the allocator's reserved pool, which does not shrink
//!   when backward frees activations into the cache, so the plateau often
//!   lasts to the end of backward: then `cleared` is false and the plateau
//!   ends with backward. It needs the samples, which the tracker keeps only for
//!   a bounded window (60 s at 100 Hz by default): after that it is None.
//! * **Optimizer jump**: allocated at optimizer end − at optimizer begin; and
//!   for NVML, the level just after the optimizer phase − just before it, and
//!   the optimizer-phase NVML peak − the backward NVML peak.

use serde::Serialize;

use crate::divergence::{PeakSource, DEFAULT_OUTLIER_THRESHOLD};
use crate::growth::GrowthConfig;
use crate::identity::ModelFacts;
use crate::marker::PhaseKind;
use crate::predict::{
    jump_across, predict, PredictConfig, PredictFrom, Prediction, PredictionBasis, StepOneExtras,
};
use crate::profile::{median_u64, phase_allocator_peaks, SteadyProfile, StepProfile};

use crate::sample::GpuSample;
use crate::timeline::{RankTimeline, StepOutcome, StepRecord};

/// Tunables of the analysis.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AnalysisConfig {
    /// Completed steps after the first that the steady profile uses, at most.
    pub steady_window: usize,
    /// Completed steps after the first needed for a steady profile (k − 1).
    pub min_steady_steps: usize,
    /// Relative tolerance within which consecutive step peaks agree.
    pub steady_tolerance: f64,
    /// Consecutive agreeing pairs that make a steady state.
    pub steady_agreements: usize,
    /// Relative distance from the forward peak that counts as the plateau.
    pub plateau_tolerance: f64,
    /// Divergence outlier threshold, relative to the median.
    pub divergence_threshold: f64,
    /// Tunables of the step-2 prediction made from step 1.
    pub predict: PredictConfig,
    /// Tunables of the trailing window and growth after step 2.
    pub growth: GrowthConfig,
}

impl Default for AnalysisConfig {
    fn default() -> Self {
        Self {
            steady_window: 10,
            min_steady_steps: 2,
            steady_tolerance: 0.02,
            steady_agreements: 2,
            plateau_tolerance: 0.05,
            divergence_threshold: DEFAULT_OUTLIER_THRESHOLD,
            predict: PredictConfig::default(),
            growth: GrowthConfig::default(),
        }
    }
}

/// How long memory stayed near its forward peak in step 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ActivationPlateau {
    /// Highest NVML sample of the forward phase the plateau starts in, bytes.
    pub forward_peak_bytes: u64,
    /// CLOCK_MONOTONIC ns of the first sample at plateau height.
    pub start_ns: u64,
    /// CLOCK_MONOTONIC ns of the first sample below it, or the end of the
    /// following backward when memory never dropped (see `cleared`).
    pub end_ns: u64,
    /// `end_ns − start_ns`: how long activations held the peak, in ns.
    pub duration_ns: u64,
    /// Whether samples showed memory falling below the plateau before the
    /// backward phase ended.
    pub cleared: bool,
}

/// Step 1 against the steady state.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FirstStepAnomaly {
    /// Step number of the first step, normally 1.
    pub first_step: u64,
    /// steady peak / first-step peak.
    pub nvml_peak_ratio: Option<f64>,
    /// Steady allocated peak / first-step allocated peak; tells allocator growth
    /// apart from NVML-only effects (context, caching).
    pub allocated_peak_ratio: Option<f64>,
    /// Steady reserved peak / first-step reserved peak; shows cache fragmentation
    /// that only appears after step 1.
    pub reserved_peak_ratio: Option<f64>,
    /// What step 1's optimizer phase did to memory.
    #[serde(flatten)]
    pub optimizer: OptimizerJumps,
    /// How long memory sat near the forward peak in step 1; None once the
    /// samples have left the tracker's window.
    pub activation_plateau: Option<ActivationPlateau>,
}

/// What step 1's optimizer phase did to memory: the state it created shows
/// as a jump across it, its temporaries as a peak above backward's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OptimizerJumps {
    /// Allocated at optimizer end − at optimizer begin, summed over the
    /// step's closed optimizer phases.
    pub optimizer_allocated_jump_bytes: Option<i64>,
    /// NVML level just after the optimizer phase − just before it.
    pub optimizer_nvml_jump_bytes: Option<i64>,
    /// NVML optimizer-phase peak − backward peak.
    pub optimizer_nvml_peak_over_backward_bytes: Option<i64>,
}

impl OptimizerJumps {
    /// The jumps of `step`, whose profile is `profile`; None each until
    /// its optimizer phases have closed (or without the figure).
    fn of(step: &StepRecord, profile: &StepProfile) -> Self {
        let jump = |basis| {
            let idx: Vec<usize> = (0..step.phases.len())
                .filter(|&i| step.phases[i].phase == PhaseKind::Optimizer)
                .collect();
            let closed = !idx.is_empty()
                && idx
                    .iter()
                    .all(|&i| step.phases[i].end_monotonic_ns.is_some());
            if !closed {
                return None;
            }
            idx.iter()
                .map(|&i| jump_across(&step.phases, i, basis))
                .sum::<Option<i64>>()
        };
        let nvml_peak = |k| profile.phase(k).and_then(|p| p.nvml_peak_bytes);
        Self {
            optimizer_allocated_jump_bytes: jump(PredictionBasis::Allocator),
            optimizer_nvml_jump_bytes: jump(PredictionBasis::NvmlOnly),
            optimizer_nvml_peak_over_backward_bytes: nvml_peak(PhaseKind::Optimizer)
                .zip(nvml_peak(PhaseKind::Backward))
                .map(|(o, b)| (i128::from(o) - i128::from(b)) as i64),
        }
    }
}

/// Whether step peaks have settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SteadyState {
    /// Whether the step peaks have settled; until then the steady profile may
    /// still move.
    pub reached: bool,
    /// First step of the first agreeing run.
    pub since_step: Option<u64>,
    /// Which peak figure was compared (NVML or allocated); None without steps.
    pub source: Option<PeakSource>,
}

/// Everything the first-step analysis says about one rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankAnalysis {
    /// Profile of the first step, the one the prediction is made from.
    pub first_step: Option<StepProfile>,
    /// Median profile of the steps after the first; None until enough completed.
    pub steady: Option<SteadyProfile>,
    /// How step 1 differed from the steady state; needs both profiles.
    pub anomaly: Option<FirstStepAnomaly>,
    /// steady / first-step peak: NVML when both have it, else allocated.
    pub anomaly_ratio: Option<f64>,
    /// Whether later steps have settled, so the steady figures can be trusted.
    pub steady_state: SteadyState,
    /// From step 1, complete or running.
    pub prediction: Option<Prediction>,
    /// GPU capacity from its latest sample, bytes; 0 when unknown.
    pub capacity_bytes: u64,
    /// Bytes other processes hold on the rank's GPU; subtracted from headroom.
    pub other_process_bytes: u64,
}

/// The rank an analysis is of: its timeline and facts, and what the node
/// knows of its GPU.
#[derive(Debug, Clone)]
pub struct RankInputs<'a> {
    /// The rank's step history.
    pub timeline: &'a RankTimeline,
    /// What the client said about the model.
    pub facts: &'a ModelFacts,
    /// GPU capacity, bytes; 0 when unknown.
    pub capacity_bytes: u64,
    /// Bytes other processes hold on the GPU.
    pub other_process_bytes: u64,
    /// The steady profile when the caller keeps it (the tracker's memo);
    /// None: computed from the timeline.
    pub steady: Option<Option<SteadyProfile>>,
}

/// Analyses one rank. `samples` are the GPU's samples from step 1 on
/// (time-ordered), for the activation plateau.
pub fn analyze_rank<'a>(
    rank: RankInputs<'_>,
    extras: StepOneExtras<'_>,
    samples: impl IntoIterator<Item = &'a GpuSample>,
    config: &AnalysisConfig,
) -> RankAnalysis {
    let RankInputs {
        timeline,
        facts,
        capacity_bytes,
        other_process_bytes,
        steady,
    } = rank;
    let first = timeline.steps().next();
    let steady = steady.unwrap_or_else(|| steady_profile(timeline, config));
    let first_profile = first.map(StepProfile::of);
    let ratio = |s: Option<u64>, f: Option<u64>| match (s, f) {
        (Some(s), Some(f)) if f > 0 => Some(s as f64 / f as f64),
        _ => None,
    };
    let anomaly = first.zip(first_profile.as_ref()).map(|(step, fp)| {
        let st = steady.as_ref();
        FirstStepAnomaly {
            first_step: step.step,
            nvml_peak_ratio: ratio(st.and_then(|s| s.nvml_peak_bytes), fp.nvml_peak_bytes),
            allocated_peak_ratio: ratio(
                st.and_then(|s| s.peaks.allocated_peak_bytes),
                fp.peaks.allocated_peak_bytes,
            ),
            reserved_peak_ratio: ratio(
                st.and_then(|s| s.peaks.reserved_peak_bytes),
                fp.peaks.reserved_peak_bytes,
            ),
            optimizer: OptimizerJumps::of(step, fp),
            activation_plateau: activation_plateau(step, samples, config.plateau_tolerance),
        }
    });
    let anomaly_ratio = anomaly
        .as_ref()
        .and_then(|a| a.nvml_peak_ratio.or(a.allocated_peak_ratio));
    // Live samples are of step 1's open phase: only while it runs.
    let extras = StepOneExtras {
        live: extras
            .live
            .filter(|_| first.is_some_and(|s| s.outcome == StepOutcome::Running)),
        ..extras
    };
    let prediction = first.and_then(|s| {
        predict(
            s,
            PredictFrom {
                facts,
                capacity_bytes,
                other_process_bytes,
                extras,
                config: &config.predict,
            },
        )
    });
    RankAnalysis {
        first_step: first_profile,
        steady,
        anomaly,
        anomaly_ratio,
        steady_state: steady_state(later_completed(timeline), config),
        prediction,
        capacity_bytes,
        other_process_bytes,
    }
}

/// Completed steps after the first, in order.
fn later_completed(timeline: &RankTimeline) -> impl Iterator<Item = &StepRecord> + Clone {
    timeline
        .steps()
        .skip(1)
        .filter(|s| s.outcome == StepOutcome::Completed)
}

/// The steady profile of a rank (see the module documentation); None until
/// enough steps after the first have completed. Shared by the analysis and
/// the cross-rank divergence, so both mean the same steady peak.
pub fn steady_profile(timeline: &RankTimeline, config: &AnalysisConfig) -> Option<SteadyProfile> {
    let window: Vec<StepProfile> = steady_window(timeline, config)
        .map(StepProfile::of)
        .collect();
    SteadyProfile::of(&window, config.min_steady_steps.max(1))
}

/// A rank's [`steady_profile`], kept between reads. Divergence reads every
/// rank's steady profile at each step boundary of any rank of the job:
/// computed afresh each time, ingest cost grew with ranks squared. The memo
/// is keyed on the timeline's [`RankTimeline::revision`] (one comparison);
/// when that moved, on a cheap key of each window step (its number,
/// outcome, phases, closed phases and credited samples, which every change
/// to a step moves), and only a changed window is profiled again.
#[derive(Debug, Clone, Default)]
pub(crate) struct SteadyMemo {
    revision: Option<u64>,
    window: Vec<WindowStepKey>,
    profile: Option<SteadyProfile>,
    /// The config the profile was computed under.
    sized_for: Option<(usize, usize)>,
}

/// What [`SteadyMemo`] compares a window step by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WindowStepKey {
    step: u64,
    outcome: StepOutcome,
    phases: usize,
    closed_phases: usize,
    samples: u64,
}

impl WindowStepKey {
    fn of(step: &StepRecord) -> Self {
        Self {
            step: step.step,
            outcome: step.outcome,
            phases: step.phases.len(),
            closed_phases: step
                .phases
                .iter()
                .filter(|p| p.end_monotonic_ns.is_some())
                .count(),
            samples: step.phases.iter().map(|p| p.nvml.samples).sum(),
        }
    }
}

impl SteadyMemo {
    fn sized_for(config: &AnalysisConfig) -> Option<(usize, usize)> {
        Some((config.steady_window, config.min_steady_steps))
    }

    fn window_unchanged(&self, timeline: &RankTimeline, config: &AnalysisConfig) -> bool {
        self.sized_for == Self::sized_for(config)
            && steady_window(timeline, config)
                .map(WindowStepKey::of)
                .eq(self.window.iter().copied())
    }

    /// Calls `f` with the rank's steady profile: the memo's when still
    /// fresh, else one computed now (and not kept: a reader holds `&self`).
    pub(crate) fn with<R>(
        &self,
        timeline: &RankTimeline,
        config: &AnalysisConfig,
        f: impl FnOnce(Option<&SteadyProfile>) -> R,
    ) -> R {
        let fresh = self.sized_for == Self::sized_for(config)
            && self.revision == Some(timeline.revision())
            || self.window_unchanged(timeline, config);
        if fresh {
            f(self.profile.as_ref())
        } else {
            f(steady_profile(timeline, config).as_ref())
        }
    }

    /// Brings the memo up to date after the timeline changed.
    pub(crate) fn refresh(&mut self, timeline: &RankTimeline, config: &AnalysisConfig) {
        if self.revision == Some(timeline.revision()) && self.sized_for == Self::sized_for(config) {
            return;
        }
        if !self.window_unchanged(timeline, config) {
            self.window = steady_window(timeline, config)
                .map(WindowStepKey::of)
                .collect();
            self.profile = steady_profile(timeline, config);
            self.sized_for = Self::sized_for(config);
        }
        self.revision = Some(timeline.revision());
    }
}

/// The steps the steady profile is over: the first `steady_window`
/// completed steps after the first. Only the window is visited: ingest
/// computes this for every rank of a job at each step boundary
/// (divergence), and collecting all of a rank's retained steps first made
/// that O(ranks x retained steps).
fn steady_window<'a>(
    timeline: &'a RankTimeline,
    config: &AnalysisConfig,
) -> impl Iterator<Item = &'a StepRecord> {
    timeline
        .steps()
        .skip(1)
        .filter(|s| s.outcome == StepOutcome::Completed)
        .take(config.steady_window.max(1))
}

/// [`steady_profile`]'s NVML peak alone, from the steps' peaks (no
/// profiles): cheap enough for every marker batch, where the
/// low-observed-headroom advisory reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SteadyNvmlPeak {
    /// The median NVML peak of the window's steps that have samples (what
    /// `stepwatch_rank_steady_step_peak_bytes` exports), bytes.
    pub peak_bytes: u64,
    /// The window's first and last steps.
    pub first_step: u64,
    /// See `first_step`.
    pub last_step: u64,
    /// How many steps the window holds.
    pub steps: usize,
    /// The NVML peak of `first_step` alone; None when it had no samples.
    pub first_step_peak_bytes: Option<u64>,
}

/// See [`SteadyNvmlPeak`]; None where [`steady_profile`] is None or has no
/// NVML peak.
pub fn steady_nvml_peak(
    timeline: &RankTimeline,
    config: &AnalysisConfig,
) -> Option<SteadyNvmlPeak> {
    let mut peaks = Vec::with_capacity(config.steady_window.max(1));
    let (mut first, mut last, mut steps) = (None, 0, 0);
    for s in steady_window(timeline, config) {
        let peak = s.nvml_peak_bytes();
        first.get_or_insert((s.step, peak));
        last = s.step;
        steps += 1;
        peaks.extend(peak);
    }
    let (first_step, first_step_peak_bytes) = first?;
    if steps < config.min_steady_steps.max(1) {
        return None;
    }
    Some(SteadyNvmlPeak {
        peak_bytes: median_u64(&mut peaks)?,
        first_step,
        last_step: last,
        steps,
        first_step_peak_bytes,
    })
}

/// Steady-state detection over completed steps after the first, in order.
/// Cheap: step peaks only, no profiles, so it can run on every scrape.
pub fn steady_state<'a>(
    later: impl Iterator<Item = &'a StepRecord> + Clone,
    config: &AnalysisConfig,
) -> SteadyState {
    let Some(first) = later.clone().next() else {
        return SteadyState {
            reached: false,
            since_step: None,
            source: None,
        };
    };
    let allocated = |s: &StepRecord| {
        s.phases
            .iter()
            .filter_map(|p| phase_allocator_peaks(p).map(|(a, _)| a))
            .max()
    };
    let nvml = |s: &StepRecord| s.nvml_peak_bytes();
    let all_nvml = later.clone().all(|s| nvml(s).is_some());
    let source = if !all_nvml && later.clone().all(|s| allocated(s).is_some()) {
        PeakSource::Allocated
    } else {
        PeakSource::Nvml
    };
    let peak = |s: &StepRecord| match source {
        PeakSource::Allocated => allocated(s),
        PeakSource::Nvml => nvml(s),
    };
    let need = config.steady_agreements.max(1);
    let mut run = 0;
    let (mut prev_step, mut prev) = (first.step, peak(first));
    let mut run_start = first.step;
    for step in later.skip(1) {
        let cur = peak(step);
        let agree = match (prev, cur) {
            (Some(a), Some(b)) => a.abs_diff(b) as f64 <= config.steady_tolerance * a.max(b) as f64,
            _ => false,
        };
        if agree && run == 0 {
            run_start = prev_step;
        }
        (prev_step, prev) = (step.step, cur);
        run = if agree { run + 1 } else { 0 };
        if run >= need {
            return SteadyState {
                reached: true,
                since_step: Some(run_start),
                source: Some(source),
            };
        }
    }
    SteadyState {
        reached: false,
        since_step: None,
        source: Some(source),
    }
}

/// The activation plateau of a step, from its GPU's samples (any order).
/// See the module documentation.
pub fn activation_plateau<'a>(
    step: &StepRecord,
    samples: impl IntoIterator<Item = &'a GpuSample>,
    tolerance: f64,
) -> Option<ActivationPlateau> {
    let begin = step.begin_monotonic_ns;
    let end = step.end_monotonic_ns.unwrap_or(u64::MAX);
    let mut s: Vec<(u64, u64)> = samples
        .into_iter()
        .filter(|x| x.monotonic_ns >= begin && x.monotonic_ns < end)
        .map(|x| (x.monotonic_ns, x.used_bytes))
        .collect();
    s.sort_unstable();
    let in_range = |from: u64, to: Option<u64>| {
        let lo = s.partition_point(|&(t, _)| t < from);
        let hi = to.map_or(s.len(), |to| s.partition_point(|&(t, _)| t < to));
        &s[lo..hi.max(lo)]
    };
    // The forward phase with the highest sampled peak, and the backward after it.
    let mut best: Option<(u64, usize, usize)> = None;
    for (fi, f) in step.phases.iter().enumerate() {
        if f.phase != PhaseKind::Forward {
            continue;
        }
        let Some(bi) =
            (fi + 1..step.phases.len()).find(|&j| step.phases[j].phase == PhaseKind::Backward)
        else {
            continue;
        };
        let Some(peak) = in_range(f.start_monotonic_ns, f.end_monotonic_ns)
            .iter()
            .map(|&(_, b)| b)
            .max()
        else {
            continue;
        };
        if best.is_none_or(|(p, _, _)| peak > p) {
            best = Some((peak, fi, bi));
        }
    }
    let (peak, fi, bi) = best?;
    let threshold = peak as f64 * (1.0 - tolerance);
    let fwd = &step.phases[fi];
    let bwd = &step.phases[bi];
    let &(start, _) = in_range(fwd.start_monotonic_ns, fwd.end_monotonic_ns)
        .iter()
        .find(|&&(_, b)| b as f64 >= threshold)?;
    let search = in_range(start, bwd.end_monotonic_ns);
    let (end_ns, cleared) = match search.iter().find(|&&(_, b)| (b as f64) < threshold) {
        Some(&(t, _)) => (t, true),
        None => (
            bwd.end_monotonic_ns
                .unwrap_or_else(|| search.last().map_or(start, |&(t, _)| t)),
            false,
        ),
    };
    Some(ActivationPlateau {
        forward_peak_bytes: peak,
        start_ns: start,
        end_ns,
        duration_ns: end_ns.saturating_sub(start),
        cleared,
    })
}
