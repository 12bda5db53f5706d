//! What a prediction says: the figures it used and where they came from,
//! and the result a user and the alerts read.

use super::*;

/// Which figures the prediction was computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PredictionBasis {
    /// Allocator figures from the markers, scaled to device bytes.
    Allocator,
    /// Device-used NVML samples alone.
    NvmlOnly,
    /// Allocator figures, with the reserved peak from replaying step 1's
    /// allocator trace (see `replay`) instead of the ratio and the
    /// layout allowance.
    AllocatorReplay,
}

impl PredictionBasis {
    /// The name in JSON, also the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            PredictionBasis::Allocator => "allocator",
            PredictionBasis::NvmlOnly => "nvml_only",
            PredictionBasis::AllocatorReplay => "allocator_replay",
        }
    }
}

/// Where the optimizer-state figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateSource {
    /// The jump across step 1's optimizer phase.
    MeasuredJump,
    /// parameter_count × state_bytes_per_parameter / sharding_factor.
    ModelFacts,
    /// The client said the state exists before step 1 (`state_precreated`).
    DeclaredPrecreated,
    /// No jump across the optimizer phase although the optimizer keeps state.
    DetectedPrecreated,
    /// The optimizer keeps no state (plain SGD).
    Stateless,
    /// No jump, and no facts to tell stateless from pre-created; 0 either way.
    NoJump,
    /// The optimizer phase has not closed and there are no facts: 0 for now.
    Unknown,
    /// NVML basis: the level barely moved across the optimizer phase, and no
    /// facts size the state. Device memory cannot tell state served from the
    /// allocator's cache from no state at all, so the jump (≤ the no-jump
    /// threshold) is taken, and the prediction says it may lack the state.
    UnseenOnNvml,
}

/// Something the prediction's basis cannot see, so a user knows how far to
/// trust it (exported as `stepwatch_rank_prediction_basis_limited`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BasisLimit {
    /// NVML only: device memory shows what the caching allocator reserves,
    /// not what it hands out, so state or temporaries served from cached
    /// blocks (backward frees gigabytes before the optimizer runs) do not
    /// move it. The state is then taken from model facts where they exist.
    NvmlOnlyCannotSeeCacheReuse,
    /// The optimizer may keep state, but neither a measured jump nor model
    /// facts size it: the prediction may lack it entirely.
    OptimizerStateUnsized,
    /// Allocator figures without a trace, and state created lazily from the
    /// cache: which cached blocks the state splits is not in phase-boundary
    /// figures. PyTorch places each state tensor in the smallest free block
    /// that holds it; when that is a block an activation used in step 1 (the
    /// logits, say), step 2 reserves a new segment of that block's size
    /// (seen in the traces of `tests/fixtures/torch-fake-cuda`). The layout
    /// allowance is a guess at that. Not set when step 1's segment
    /// snapshots arrived ([`LayoutInputs::layout_snapshots`]).
    AllocatorFiguresCannotSeeLayout,
}

impl BasisLimit {
    /// Every limit, so that a metric can say 0 for the ones that do not apply.
    pub const ALL: [BasisLimit; 3] = [
        BasisLimit::NvmlOnlyCannotSeeCacheReuse,
        BasisLimit::OptimizerStateUnsized,
        BasisLimit::AllocatorFiguresCannotSeeLayout,
    ];

    /// The name in JSON, also the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            BasisLimit::NvmlOnlyCannotSeeCacheReuse => "nvml_only_cannot_see_cache_reuse",
            BasisLimit::OptimizerStateUnsized => "optimizer_state_unsized",
            BasisLimit::AllocatorFiguresCannotSeeLayout => "allocator_figures_cannot_see_layout",
        }
    }
}

/// Why step 1's segment snapshots were not used: cases where step 2 reuses
/// cache in a way the two layouts cannot show, found on real PyTorch traces
/// (`tests/replay_torch.rs`), in which the snapshots' rule over-predicts
/// step 2's new segments (+18% and +24% reserved) while the guessed
/// allowance was within a few percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutSetAside {
    /// Gradient accumulation: step 1's micro-batches took turns with the
    /// cache, so not every block free at the optimizer's begin is wanted at
    /// once in step 2.
    GradientAccumulation,
    /// DDP rebuilds its buckets at step 2's first forward: the old bucket's
    /// block, freed then, serves step 2's activations. Playing the rebuild
    /// inside the rule (old bucket freed, new buckets allocated before the
    /// requests) does not rescue it: on kept markers runs
    /// (real PyTorch 2.15 on fake CUDA, `stepwatch replay-record`) it gives
    /// +0.5% on `ddp-2` and on `ddp-uneven`'s larger rank but +25% on the
    /// smaller one (1,416 MiB of new segments where PyTorch made 396; +21%
    /// without the rebuild). The rule asks again for whole segments made
    /// before step 1 (218, 258 and 148 MiB there), and it serves from a
    /// layout that still holds the gradients, which `zero_grad` frees
    /// before the rebuild: the new buckets then fill the old bucket's block
    /// instead of the gradients' holes. The guessed allowance is -2.66% and
    /// -2.84% there.
    DdpBucketRebuild,
}

/// Where the overhead (device memory outside the rank's caching allocator:
/// CUDA context, workspaces, NCCL buffers, other processes) came from, so a
/// user knows whether it was measured or bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverheadSource {
    /// The device's memory the client read at step 1's markers
    /// (`cudaMemGetInfo`) minus the reserved bytes at the same markers:
    /// exact at each marker, whatever NVML's sampler caught.
    ClientDeviceMemory,
    /// NVML samples next to step 1's markers: a lower bound from the last
    /// sample of a phase, capped by an upper one (see `overhead_estimate`).
    /// Phases of a few milliseconds may have no sample, and the bound then
    /// falls back to one taken before the allocator's last segments.
    NvmlSamples,
    /// Neither: [`PredictConfig::assumed_overhead_bytes`] plus other
    /// processes.
    Assumed,
}

impl OverheadSource {
    /// The name in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            OverheadSource::ClientDeviceMemory => "client_device_memory",
            OverheadSource::NvmlSamples => "nvml_samples",
            OverheadSource::Assumed => "assumed",
        }
    }
}

/// What became of a step-2 OOM warning the rank was already given, when a
/// later prediction of step 1 says step 2 fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WarningRevision {
    /// The revision rests on estimates only (the state or the optimizer's
    /// temporaries from model facts, before step 1's optimizer phase was
    /// measured): the warning stands and `oom_risk` stays set.
    UpheldUntilMeasured,
    /// The revision rests on a measurement (step 1's optimizer phase closed
    /// with its jump measured, or the allocator replay): the warning is
    /// withdrawn.
    WithdrawnOnMeasurement,
}

/// Where the persistent-gradient figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradsSource {
    /// Gradients are set to None between steps (or unknown: PyTorch's default).
    NotPersistent,
    /// Allocated after the first backward minus before the first forward.
    Measured,
    /// parameter_bytes, or parameter_count × dtype bytes.
    ModelFacts,
    /// Persistent, but nothing to size them with: 0.
    Unknown,
}

/// Every figure the prediction used, so a user can see why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictionInputs {
    /// Whether figures are allocator bytes or NVML device bytes; every
    /// "basis units" field below is in this unit.
    pub basis: PredictionBasis,
    /// The step the prediction was made from.
    pub step: u64,
    /// How that step stood (running, completed, OOM); running means provisional.
    pub step_outcome: StepOutcome,
    /// The phase still open when the prediction was made.
    pub open_phase: Option<PhaseKind>,
    /// Whether step 1's optimizer phase has closed, i.e. the state jump was
    /// measured rather than estimated.
    pub optimizer_phase_closed: bool,
    /// Step 1's peaks by phase group, in basis units.
    #[serde(flatten)]
    pub peaks: StepOnePeaks,
    /// The optimizer state added to the forward/backward peaks, and the figures it was chosen from.
    #[serde(flatten)]
    pub state: StateInputs,
    /// Gradients that survive into step 2's forward.
    #[serde(flatten)]
    pub grads: GradInputs,
    /// Which term of the max set the prediction: the phase to shrink to fit.
    pub binding: BindingTerm,
    /// The max above, in basis units.
    pub basis_peak_bytes: u64,
    /// Allocator basis: the most `basis_peak_bytes` can be, from the upper
    /// bounds of step 1's allocator peaks; equal to it when the counters pin
    /// it. Since-start peak counters (what `torch.cuda.memory_stats()`
    /// reports) pin a phase's peak only when it raised the process's
    /// high-water mark (see `profile`); a higher mark set before
    /// step 1 (a checkpoint loaded onto the GPU, say) can hide how high step
    /// 1's phases went. None on the NVML basis, while a phase of step 1 is
    /// still open, or when a counter was reset inside a phase.
    #[serde(default)]
    pub basis_peak_at_most_bytes: Option<u64>,
    /// What sets the reserved (caching pool) figure on the allocator basis.
    #[serde(flatten)]
    pub reserved: ReservedInputs,
    /// The allowance for the cached blocks the state split, and the segment snapshots behind it.
    #[serde(flatten)]
    pub layout: LayoutInputs,
    /// Predicted reserved (caching pool) bytes at the peak; allocator basis only.
    pub predicted_reserved_bytes: Option<u64>,
    /// The replay of step 2 from step 1's allocator trace, when the client
    /// sent one; it sets the reserved figure.
    pub allocator_replay: Option<Step2Replay>,
    /// The memory the device holds beside the allocator, and how it was measured.
    #[serde(flatten)]
    pub overhead: OverheadInputs,
    /// Highest NVML sample of step 1, bytes; a floor for the device prediction.
    pub step1_nvml_peak_bytes: Option<u64>,
    /// GPU capacity, bytes (0 when unknown: no headroom then).
    pub capacity_bytes: u64,
    /// Bytes other processes hold on the GPU, subtracted once from headroom.
    pub other_process_bytes: u64,
    /// The optimizer's temporaries at its peak, from model facts (foreach
    /// Adam: one parameter-sized list, state / 2; fused, for-loop and SGD:
    /// 0), in the estimate of the optimizer phase.
    #[serde(default)]
    pub optimizer_temporaries_bytes: u64,
    /// Allocator basis, until step 1's optimizer phase has closed: allocated
    /// when it begins (estimated before that as allocated at the first
    /// forward + the gradients) + state created in it + its temporaries.
    /// Step 2's optimizer phase reaches the same figure (state kept,
    /// temporaries made again). A term of the max.
    #[serde(default)]
    pub optimizer_phase_estimate_bytes: Option<u64>,
    /// What the basis cannot see; empty when nothing is known to be missing.
    #[serde(default)]
    pub basis_limits: Vec<BasisLimit>,
    /// What becomes of step 1's gradients between steps (from the hello).
    #[serde(default)]
    pub gradients: Gradients,
    /// Gradients alive through step 2's forward when they are freed just
    /// before backward (measured as for `grad_bytes`, else model facts),
    /// added to the first forward's peak; 0 otherwise.
    #[serde(default)]
    pub forward_grad_bytes: u64,
    /// Set when step 2's first forward took a larger batch than step 1's:
    /// what its extra batch adds (see `larger_batch`); the prediction's
    /// peak and headroom include it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_revision: Option<BatchRevision>,
}

/// Step 1's peaks by phase group, in basis units. Part of [`PredictionInputs`], serialized flat
/// into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepOnePeaks {
    /// Peak of the first micro-batch group's forward/backward phases (up to
    /// and including the first backward), basis units (allocated or device
    /// bytes); 0 without a figure.
    pub first_micro_batch_peak_bytes: u64,
    /// Peak of the forward/backward phases after the first backward, basis
    /// units; None without gradient accumulation.
    pub later_micro_batches_peak_bytes: Option<u64>,
    /// Peak of step 1's optimizer phase(s), basis units.
    pub optimizer_phase_peak_bytes: Option<u64>,
    /// Peak over all of step 1's phases, basis units; the floor of the prediction.
    pub step1_peak_bytes: u64,
}

/// The optimizer state added to the forward/backward peaks, and the figures it was chosen from.
/// Part of [`PredictionInputs`], serialized flat into it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateInputs {
    /// Optimizer state added to the forward/backward peaks.
    pub state_bytes: u64,
    /// Where `state_bytes` came from; says how much to trust it.
    pub state_source: StateSource,
    /// Jump across the optimizer phase(s), basis units; None until closed.
    pub measured_jump_bytes: Option<i64>,
    /// State computed from model facts, when they allow it.
    pub facts_state_bytes: Option<u64>,
    /// Bytes per parameter used for the facts estimate: reported or the
    /// optimizer's default.
    pub state_bytes_per_parameter: Option<u32>,
    /// Sharding factor used (1 when not reported).
    pub sharding_factor: u32,
    /// round(unsharded facts state / measured jump) when that is 2 or more.
    pub inferred_sharding_factor: Option<u32>,
}

/// Gradients that survive into step 2's forward. Part of [`PredictionInputs`], serialized flat into
/// it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GradInputs {
    /// Whether gradients were taken to survive into step 2
    /// (`grads_set_to_none == Some(false)`).
    pub grads_persistent: bool,
    /// Persistent gradient bytes added to the first micro-batch term; 0 when not
    /// persistent.
    pub grad_bytes: u64,
    /// Where `grad_bytes` came from.
    pub grads_source: GradsSource,
}

/// What sets the reserved (caching pool) figure on the allocator basis. Part of
/// [`PredictionInputs`], serialized flat into it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReservedInputs {
    /// Allocator basis only.
    pub reserved_ratio: Option<f64>,
    /// Allocator reserved peak of step 1, bytes; a floor for the reserved figure.
    pub step1_reserved_peak_bytes: Option<u64>,
    /// Reserved − allocated when step 1's optimizer phase began (the cache
    /// backward freed); None before that phase or without allocator figures.
    pub cache_at_optimizer_begin_bytes: Option<u64>,
    /// Lazily created state that can have landed in that cache:
    /// min(state, cache), or the state while the cache is unknown; 0 when
    /// the state is not created lazily (or on the NVML basis).
    pub state_from_cache_bytes: u64,
}

/// The allowance for the cached blocks the state split, and the segment snapshots behind it. Part
/// of [`PredictionInputs`], serialized flat into it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayoutInputs {
    /// [`PredictConfig::layout_allowance_fraction`] as used.
    pub layout_allowance_fraction: f64,
    /// Added for the cached blocks the state split: from step 1's segment
    /// snapshots when they arrived (`layout_snapshots`; added to
    /// `reserved_at_optimizer_end_bytes`), else layout_allowance_fraction ×
    /// state_from_cache (added to the ratio figure).
    pub layout_allowance_bytes: u64,
    /// What step 1's segment snapshots at its optimizer begin and end showed
    /// (see `layout`); set when both arrived and the prediction
    /// used them (allocator basis, no replay). None: the layout allowance,
    /// if any, is the guessed fraction.
    #[serde(default)]
    pub layout_snapshots: Option<LayoutEstimate>,
    /// With `layout_snapshots`: reserved bytes when step 1's optimizer phase
    /// ended, to which the layout allowance is added (reserved memory does
    /// not shrink between steps); the ratio figure is then only a floor.
    #[serde(default)]
    pub reserved_at_optimizer_end_bytes: Option<u64>,
    /// Why step 1's segment snapshots arrived but were not used (the
    /// layout allowance is then the guessed fraction); None otherwise.
    #[serde(default)]
    pub layout_snapshots_set_aside: Option<LayoutSetAside>,
}

/// The memory the device holds beside the allocator, and how it was measured. Part of
/// [`PredictionInputs`], serialized flat into it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OverheadInputs {
    /// Device used minus reserved (includes other processes); None when
    /// unmeasured. See `overhead_source` for how it was measured.
    pub overhead_bytes: Option<u64>,
    /// Where `overhead_bytes` came from; None on the NVML-only basis (no
    /// conversion to device bytes) and in predictions made before it was
    /// recorded.
    #[serde(default)]
    pub overhead_source: Option<OverheadSource>,
    /// The rank's own share of the overhead (its CUDA context, workspaces,
    /// NCCL buffers): `overhead_bytes − other_process_bytes`, floored at 0.
    /// Only as right as NVML's process list, which is read seconds apart;
    /// the device prediction does not depend on it.
    #[serde(default)]
    pub process_overhead_bytes: Option<u64>,
    /// The NVML-sample estimate of the overhead, also when the client's
    /// device figures set `overhead_bytes`, to compare the two.
    #[serde(default)]
    pub nvml_overhead_bytes: Option<u64>,
    /// The device's total as the CUDA driver reported it at step 1's latest
    /// marker that carried it (`cudaMemGetInfo`: what processes can use, the
    /// driver's reserved memory excluded). Shown next to `capacity_bytes`
    /// (NVML total − reserved), which it should match; not used for headroom.
    #[serde(default)]
    pub device_total_bytes: Option<u64>,
}

/// The predicted steady-state peak and headroom.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Device used bytes NVML will show at the steady-state peak, other
    /// processes included.
    pub predicted_peak_bytes: u64,
    /// This rank's share: predicted_peak_bytes − other_process_bytes.
    pub predicted_rank_peak_bytes: u64,
    /// capacity − predicted_rank_peak − other; None when capacity is unknown (0).
    pub headroom_bytes: Option<i64>,
    /// Headroom is negative: step 2 will likely OOM. Triggers the advisory.
    pub oom_risk: bool,
    /// Headroom is below `low_headroom_fraction` of capacity (also set with
    /// `oom_risk`).
    pub low_headroom: bool,
    /// Step 1 was still running: later phases may refine the figure.
    pub provisional: bool,
    /// The figures behind the prediction, so a user can check it.
    pub inputs: PredictionInputs,
    /// The formula with its figures, for humans.
    pub explanation: String,
    /// Step 1's activation memory, and when step 2 will not fit, the
    /// micro-batch or optimizer-state sharding that would (see `fit`).
    #[serde(default)]
    pub what_would_fit: Option<WhatWouldFit>,
    /// Set when the rank was already warned of a step-2 OOM and this
    /// prediction alone would say step 2 fits (see [`Prediction::revise_after_warning`]).
    #[serde(default)]
    pub warning_revision: Option<WarningRevision>,
}

impl Prediction {
    /// Whether the figures rest on a measurement of step 1's optimizer
    /// phase (its jump, or the allocator replay) rather than on model facts.
    pub fn rests_on_measurement(&self) -> bool {
        let i = &self.inputs;
        i.basis == PredictionBasis::AllocatorReplay
            || (i.optimizer_phase_closed
                && !matches!(
                    i.state.state_source,
                    StateSource::ModelFacts | StateSource::Unknown | StateSource::UnseenOnNvml
                ))
    }

    /// Applies the rule for revising a warning already given
    /// (`warned_step2_oom`: a `Step2OomPredicted` advisory was issued): a
    /// revision that says step 2 fits withdraws the warning only when it
    /// rests on a measurement; one that rests on estimates keeps `oom_risk`
    /// set. Estimates move as step 1's markers arrive (the cache figure at
    /// the optimizer's begin, say) while what they leave out does not, so an
    /// estimate that no longer warns is no evidence that the first was
    /// wrong. Either way the explanation says so.
    pub fn revise_after_warning(&mut self, warned_step2_oom: bool) {
        if !warned_step2_oom || self.oom_risk {
            return;
        }
        let h = self.headroom_bytes.unwrap_or(0);
        if self.rests_on_measurement() {
            self.warning_revision = Some(WarningRevision::WithdrawnOnMeasurement);
            let _ = write!(
                self.explanation,
                "; withdraws the step-2 OOM warning given earlier: headroom {} rests on step 1's \
                 measured optimizer phase",
                gb(h as f64)
            );
        } else {
            self.warning_revision = Some(WarningRevision::UpheldUntilMeasured);
            self.oom_risk = true;
            self.low_headroom = true;
            let _ = write!(
                self.explanation,
                "; the step-2 OOM warning given earlier stands: this revision (headroom {}) \
                 rests on estimates, and only a measurement of step 1's optimizer phase may \
                 withdraw it",
                gb(h as f64)
            );
        }
    }
}
