//! The advisory checks: one struct per check behind [`Check`], run in one
//! loop by the tracker ([`Tracker::run_checks`](super::Tracker)). Each
//! decides what became due for a rank from the tracker's state; the loop
//! records it as issued. When a check is due and what it says is decided
//! by the pure functions of `advisory`.

use super::RankState;
use super::Tracker;
use crate::advisory::{self, Advisory, RetryGrowth};
use crate::analysis::steady_nvml_peak;
use crate::identity::RankKey;
use crate::marker::Marker;
use crate::timeline::{StepOutcome, StepRecord};

/// What a check may look at besides the tracker: the batch just applied.
#[derive(Debug, Clone, Copy)]
pub(super) struct Batch<'a> {
    /// The markers applied (empty outside a marker batch).
    pub markers: &'a [Marker],
    /// Whether the batch holds a step boundary (step begin or end, OOM).
    pub boundary: bool,
    /// How the client's allocator retry count grew in the batch.
    pub retry_growth: Option<RetryGrowth>,
    /// The caller's clock.
    pub now_ns: u64,
}

/// One advisory check.
pub(super) trait Check {
    /// The advisories due for `key` now; the caller records them as issued.
    /// None where the check does not apply yet (no such rank, no step, no
    /// prediction): the same as nothing due, written with `?`.
    fn due(&self, tracker: &Tracker, key: &RankKey, batch: &Batch<'_>) -> Option<Vec<Advisory>>;
}

/// Checks that judge step 1: run after step 1's part of a batch, before
/// step 2's first marker is applied, and when a trace replay or later
/// facts change the prediction.
pub(super) const STEP_ONE: &[&dyn Check] = &[&Step2Prediction, &PredictionFinal];

/// Checks run after the whole batch.
pub(super) const AFTER_BATCH: &[&dyn Check] = &[
    &RankDivergence,
    &AllocatorRetries,
    &ObservedHeadroom,
    &MemoryGrowth,
];

/// The rank and its first step, while that is its latest step.
fn first_step_is_latest<'t>(
    tracker: &'t Tracker,
    key: &RankKey,
) -> Option<(&'t RankState, &'t StepRecord)> {
    let state = tracker.ranks.get(key)?;
    let first = state.timeline.steps().next()?;
    (state.timeline.current()?.step == first.step).then_some((state, first))
}

/// The rank and the step of the batch's last marker; None outside a
/// marker batch.
fn rank_at_last_marker<'t>(
    tracker: &'t Tracker,
    key: &RankKey,
    batch: &Batch<'_>,
) -> Option<(&'t RankState, u64)> {
    let step = batch.markers.last()?.step;
    Some((tracker.ranks.get(key)?, step))
}

/// Step-2 OOM predicted, or low headroom: only while the rank's first step
/// is its latest step, since the point is to warn before step 2 begins.
pub(super) struct Step2Prediction;

impl Check for Step2Prediction {
    fn due(&self, tracker: &Tracker, key: &RankKey, batch: &Batch<'_>) -> Option<Vec<Advisory>> {
        let (state, first) = first_step_is_latest(tracker, key)?;
        let analysis = tracker.rank_analysis(key)?;
        let prediction = analysis.prediction?;
        Some(advisory::due(
            &prediction,
            analysis.capacity_bytes,
            first.step,
            batch.now_ns,
            &state.advisories,
        ))
    }
}

/// Step-2 OOM predicted, or low headroom, from the prediction revised for
/// step 2's larger batch (see `predict`'s `larger_batch`): run once, just
/// after step 2's first forward that said its batch, while the rank's
/// second step is its latest; through the same rules as the prediction
/// made from step 1 (once per kind, again when it worsened).
pub(super) struct Step2LargerBatch;

impl Check for Step2LargerBatch {
    fn due(&self, tracker: &Tracker, key: &RankKey, batch: &Batch<'_>) -> Option<Vec<Advisory>> {
        let state = tracker.ranks.get(key)?;
        let prediction = state
            .prediction_before_step2
            .as_ref()
            .filter(|p| p.inputs.batch_revision.is_some())?;
        let second = state.timeline.steps().nth(1).map(|s| s.step)?;
        if state.timeline.current().map(|s| s.step) != Some(second) {
            return None;
        }
        Some(advisory::due(
            prediction,
            prediction.inputs.capacity_bytes,
            second,
            batch.now_ns,
            &state.advisories,
        ))
    }
}

/// Prediction final: once the rank's first step has ended (its step-end
/// marker applied) and before its next step's first marker, after the
/// step-2 prediction's own advisories; once per rank and run.
pub(super) struct PredictionFinal;

impl Check for PredictionFinal {
    fn due(&self, tracker: &Tracker, key: &RankKey, batch: &Batch<'_>) -> Option<Vec<Advisory>> {
        let (state, first) = first_step_is_latest(tracker, key)?;
        if first.outcome != StepOutcome::Completed
            || advisory::already_issued(&state.advisories, advisory::AdvisoryKind::PredictionFinal)
        {
            return None;
        }
        let analysis = tracker.rank_analysis(key);
        let capacity = analysis.as_ref().map_or(0, |a| a.capacity_bytes);
        let prediction = analysis.and_then(|a| a.prediction);
        advisory::final_due(
            prediction.as_ref(),
            capacity,
            first.step,
            batch.now_ns,
            &state.advisories,
        )
        .map(|advisory| vec![advisory])
    }
}

/// Rank divergence: once per figure the rank is named for in its job's
/// divergence. Checked on batches that hold a step boundary, so the cost
/// is one divergence per step and the outlier hears of it at its next
/// boundary after its peers have the figure too.
pub(super) struct RankDivergence;

impl Check for RankDivergence {
    fn due(&self, tracker: &Tracker, key: &RankKey, batch: &Batch<'_>) -> Option<Vec<Advisory>> {
        if !batch.boundary {
            return None;
        }
        let state = tracker.ranks.get(key)?;
        let step = state.timeline.current().map(|s| s.step)?;
        let div = tracker.job_divergence(&key.namespace, &key.job)?;
        Some(advisory::divergence_due(
            &div,
            key.rank,
            step,
            batch.now_ns,
            &state.advisories,
        ))
    }
}

/// Allocator retries: when the client's retry count grew in a step ≥ 2 and
/// none was issued to this run yet (see [`advisory::retry_growth`] for why
/// not step 1).
pub(super) struct AllocatorRetries;

impl Check for AllocatorRetries {
    fn due(&self, tracker: &Tracker, key: &RankKey, batch: &Batch<'_>) -> Option<Vec<Advisory>> {
        let growth = batch.retry_growth?;
        let state = tracker.ranks.get(key)?;
        advisory::retries_due(
            growth,
            state.prediction_before_step2.as_ref(),
            batch.now_ns,
            &state.advisories,
        )
        .map(|advisory| vec![advisory])
    }
}

/// Low observed headroom: when the rank's steady peak (the figure
/// `stepwatch_rank_steady_step_peak_bytes` exports) leaves less than the
/// prediction's low-headroom fraction of the GPU's capacity. Checked on
/// every batch, not only at step ends: the sampler hands its samples over
/// after the markers that closed their step, so a step's peak is complete
/// only a batch or more later. Only while the run may still get it, and
/// once two steps after the first have ended.
pub(super) struct ObservedHeadroom;

impl Check for ObservedHeadroom {
    fn due(&self, tracker: &Tracker, key: &RankKey, batch: &Batch<'_>) -> Option<Vec<Advisory>> {
        let (state, step) = rank_at_last_marker(tracker, key, batch)?;
        if !advisory::observed_headroom_open(&state.advisories) {
            return None;
        }
        let capacity = tracker
            .latest_sample(&state.info.gpu_uuid)
            .map_or(0, |s| s.capacity_bytes);
        if capacity == 0 {
            return None;
        }
        let steady = steady_nvml_peak(&state.timeline, &tracker.analysis)?;
        let observed = advisory::ObservedPeak {
            step,
            steady,
            capacity_bytes: capacity,
        };
        advisory::observed_headroom_due(
            observed,
            tracker.analysis.predict.low_headroom_fraction,
            state.prediction_before_step2.as_ref(),
            batch.now_ns,
            &state.advisories,
        )
        .map(|advisory| vec![advisory])
    }
}

/// Memory growth: when a figure taken at the same point of every step
/// grows after step 2 at a rate that will fill the GPU (see `growth`).
/// Reads the rank's kept trend, so the check costs a forecast (a few
/// comparisons) per batch; checked on every batch for the same reason as
/// [`ObservedHeadroom`]. Once per rank and run.
pub(super) struct MemoryGrowth;

impl Check for MemoryGrowth {
    fn due(&self, tracker: &Tracker, key: &RankKey, batch: &Batch<'_>) -> Option<Vec<Advisory>> {
        let (state, step) = rank_at_last_marker(tracker, key, batch)?;
        if advisory::already_issued(&state.advisories, advisory::AdvisoryKind::MemoryGrowth) {
            return None;
        }
        let trend = state.trend.trend()?;
        let forecast = tracker.memory_growth(key)?;
        advisory::growth_due(&forecast, trend, step, batch.now_ns, &state.advisories)
            .map(|advisory| vec![advisory])
    }
}
