//! The steady-state peak predicted from step 1, before step 2 begins.
//!
//! # Formula
//!
//! Step 1's phases are split positionally: the *first micro-batch group* is
//! every forward/backward phase up to and including the first backward phase
//! (no gradients exist yet while it runs); the *later micro-batches* are the
//! forward/backward phases after it (gradient accumulation: their gradients
//! already exist). Each figure below is taken in the units of the basis:
//! allocated bytes ([`PredictionBasis::Allocator`], when step 1's
//! forward/backward markers carry allocator figures) or device used bytes
//! ([`PredictionBasis::NvmlOnly`]).
//!
//! ```text
//! basis_peak = max( first_group_peak + state + grads,
//!                   later_peak       + state,
//!                   max(optimizer_phase_peak, optimizer_estimate),
//!                   step1_peak )                       // any phase of step 1
//! ```
//!
//! * Gradients freed only just before backward ([`Gradients::FreedBeforeBackward`]:
//!   Lightning's closure) live through step 2's forward: one more term,
//!   `first forward's peak + state + gradients` (measured as for `grads`).
//! * `optimizer_estimate` — allocator basis, only until step 1's optimizer
//!   phase has closed (then its measured peak holds the same): allocated at
//!   the phase's begin (before it begins: at the first forward + the
//!   gradients, measured or `parameter_bytes`) + the state it will create
//!   (model facts) + its temporaries (`optimizer_temporaries`: foreach
//!   Adam, PyTorch's default on CUDA, holds one parameter-sized list, half
//!   its state). Step 2's optimizer phase reaches the same figure: the state
//!   exists at its begin and the temporaries are made again.
//!
//! * `state` — optimizer state, see [`StateSource`]: 0 when declared
//!   pre-created; else, once the step-1 optimizer phase has closed, the jump
//!   across it (allocated at optimizer end − at optimizer begin; for NVML
//!   only, the level just after the phase minus the level just before it);
//!   before that, `parameter_count × state_bytes_per_parameter /
//!   sharding_factor` (defaults 8 Adam, 4 SGD momentum, 0 SGD). A jump below
//!   [`PredictConfig::zero_jump_bytes`] with a stateful optimizer means the
//!   state was pre-created (allocator basis). On the NVML basis a zero or
//!   small jump proves nothing — the caching allocator may serve the state
//!   from blocks freed by backward — so there the state is
//!   `max(jump, model-facts state)`, and with no facts to size it the source
//!   is [`StateSource::UnseenOnNvml`], not a measurement
//!   ([`PredictionInputs::basis_limits`] says what the basis cannot see).
//!   Without a parameter count, the facts state is the optimizer kind's
//!   state tensors (Adam 2, SGD with momentum 1) × `parameter_bytes`.
//! * allocator figures are the lower bounds of `profile`: with
//!   since-start peak counters (what the Python client sends) a phase that
//!   stayed under an earlier high-water mark is known only to lie between its
//!   boundary figures and that mark. When the mark was set by step 1's
//!   forward/backward phases that loses nothing: a later phase under it
//!   (another micro-batch, the optimizer) peaked at most at a figure a term
//!   at least as large already holds. A mark set before step 1 (a checkpoint
//!   loaded onto the GPU) or by its prologue can hide a group's peak;
//!   `basis_peak_at_most_bytes` is the max over the upper bounds, equal to
//!   `basis_peak` when nothing is hidden.
//! * `grads` — only when `grads_set_to_none == Some(false)` (gradients
//!   persist into step 2's forward): allocated at the end of the first
//!   backward − allocated at the start of the first forward, else
//!   `parameter_bytes` (or `parameter_count` × 2 for bf16, × 4 otherwise).
//!   Unknown (`None`) is read as PyTorch's default, set to None.
//!
//! Allocator basis, to device bytes:
//!
//! ```text
//! ratio     = max(1, step1 reserved peak / step1 allocated peak)
//! cached    = min(state, reserved − allocated when the optimizer phase began)
//! allowance = round(layout_allowance_fraction × cached)
//! reserved  = max(ceil((basis_peak − fresh) × ratio) + fresh + allowance,
//!                 step1 reserved peak)
//! fresh     = state + temporaries of the optimizer-phase estimate when that
//!             estimate binds (before the phase is measured), else 0
//! overhead  = max over step 1's markers of (total − free) − reserved, when
//!             the markers carry the device's memory (`cudaMemGetInfo`,
//!             exact at each marker; see `client_overhead`); else NVML −
//!             reserved next to step 1's markers: the best lower bound,
//!             capped by the best upper one (see `overhead_estimate`)
//! device    = max(reserved + overhead, NVML peak of step 1's closed phases)
//! ```
//!
//! `allowance` is the *layout allowance* for lazily created state (state
//! source `MeasuredJump` or `ModelFacts`, allocator basis only). State made
//! inside step 1's optimizer phase is served first from the blocks backward
//! freed (the activations' cache), and stays there. In step 2 the
//! activations come back at their old sizes, but the blocks they used are now
//! split around state tensors, so the caching allocator reserves new segments
//! although the allocated peak fits: reserved − allocated grows after the
//! first optimizer step (PyTorch shows the same). `cached` is the part of the
//! state that can have landed in that cache (the free cache when the
//! optimizer phase began; the whole state while that is unknown); what share
//! of it strands step-2 blocks depends on tensor sizes that allocator figures
//! at phase boundaries do not show, so it is taken as a configurable
//! fraction ([`PredictConfig::layout_allowance_fraction`]).
//!
//! With step 1's segment snapshots at its optimizer begin and end (clients
//! that send no allocator trace send them on those two markers), the layout
//! is no longer guessed: `allowance` is the bytes `layout` finds
//! step 2 must reserve anew for the cached blocks the state split
//! ([`PredictionInputs::layout_snapshots`]), and the fraction is not used.
//!
//! `overhead` is the device's view minus the allocator's (CUDA context, NCCL
//! and cuBLAS workspaces) *and other processes on the GPU*, because both
//! NVML samples and `cudaMemGetInfo` are device-wide: the other processes
//! are counted as they were at step 1's markers, not from NVML's process
//! list, which is read seconds apart and may be stale. The list only splits
//! the overhead into the process's own share
//! (`process_overhead_bytes = overhead − other_process_bytes`) and the rest.
//! [`OverheadSource`] says where it came from. Without either it is
//! unknown; then `device = reserved + assumed_overhead_bytes +
//! other_process_bytes`.
//!
//! NVML-only basis: `device = basis_peak`; device samples already include
//! other processes.
//!
//! # Headroom, without double counting
//!
//! `predicted_peak_bytes` is the device-used figure NVML will show, other
//! processes included. The rank's own share is
//! `predicted_rank_peak_bytes = predicted_peak_bytes − other_process_bytes`,
//! and
//!
//! ```text
//! headroom = capacity − predicted_rank_peak − other_process_bytes
//!          = capacity − predicted_peak
//! ```
//!
//! so other processes are subtracted exactly once (this assumes they used
//! about the same memory during step 1 as now).
//!
//! # Revising a warning
//!
//! A rank already warned of a step-2 OOM keeps `oom_risk` when a later
//! revision says it fits on estimates alone; only one resting on a
//! measurement of step 1's optimizer phase withdraws it
//! ([`Prediction::revise_after_warning`]).

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::divergence::activation_peak_bytes;
use crate::fit::{what_would_fit, BindingTerm, FitInputs, WhatWouldFit};
use crate::identity::{ModelFacts, OptimizerImplementation, OptimizerKind, Precision};
use crate::layout::LayoutEstimate;
use crate::marker::{AllocatorStats, PhaseKind};
use crate::profile::{max_opt, phase_allocator_peak_bounds, phase_allocator_peaks, PeakBounds};
use crate::replay::{Gradients, Step2Replay};
use crate::sample::GpuSample;
use crate::timeline::{PhaseRecord, SampleEdges, SampleStats, StepOutcome, StepRecord};
use crate::units::gb;

/// Tunables of the prediction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PredictConfig {
    /// `low_headroom` below this fraction of capacity.
    pub low_headroom_fraction: f64,
    /// A jump across the optimizer phase below this is "no jump".
    pub zero_jump_bytes: u64,
    /// Non-allocator device memory assumed when no NVML sample measured it.
    pub assumed_overhead_bytes: u64,
    /// Share of lazily created state that lands in cached blocks and strands
    /// step-2 blocks (the layout allowance; see the module documentation).
    pub layout_allowance_fraction: f64,
}

impl Default for PredictConfig {
    fn default() -> Self {
        Self {
            low_headroom_fraction: 0.05,
            zero_jump_bytes: 1 << 20,
            assumed_overhead_bytes: 0,
            layout_allowance_fraction: DEFAULT_LAYOUT_ALLOWANCE_FRACTION,
        }
    }
}

/// Default [`PredictConfig::layout_allowance_fraction`]: 1/16. An empirical
/// figure: over the simulator's scenario suite the share of state-from-cache
/// that became extra step-2 reservation ranged from about 1% to 77%,
/// depending on how tensor sizes happen to fit cached blocks.
pub const DEFAULT_LAYOUT_ALLOWANCE_FRACTION: f64 = 0.0625;

/// NVML samples of the phase that is still open, which the tracker has not
/// credited yet (see [`crate::Tracker::samples_since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveStep {
    /// Stats of the uncredited samples, as if credited to the open phase.
    pub nvml: SampleStats,
    /// Their earliest and latest samples, for boundary levels.
    pub nvml_edges: SampleEdges,
}

impl LiveStep {
    /// Folds the samples taken since the open phase began.
    pub fn from_samples<'a>(samples: impl IntoIterator<Item = &'a GpuSample>) -> Self {
        let mut live = LiveStep::default();
        for s in samples {
            live.nvml.add(s.used_bytes);
            live.nvml_edges.add(s.monotonic_ns, s.used_bytes);
        }
        live
    }
}

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
    /// snapshots arrived ([`PredictionInputs::layout_snapshots`]).
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
    /// Peaks of step 1 in basis units (allocated or device bytes).
    pub first_micro_batch_peak_bytes: u64,
    /// Peak of the forward/backward phases after the first backward, basis
    /// units; None without gradient accumulation.
    pub later_micro_batches_peak_bytes: Option<u64>,
    /// Peak of step 1's optimizer phase(s), basis units.
    pub optimizer_phase_peak_bytes: Option<u64>,
    /// Peak over all of step 1's phases, basis units; the floor of the prediction.
    pub step1_peak_bytes: u64,
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
    /// Whether gradients were taken to survive into step 2
    /// (`grads_set_to_none == Some(false)`).
    pub grads_persistent: bool,
    /// Persistent gradient bytes added to the first micro-batch term; 0 when not
    /// persistent.
    pub grad_bytes: u64,
    /// Where `grad_bytes` came from.
    pub grads_source: GradsSource,
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
    /// Predicted reserved (caching pool) bytes at the peak; allocator basis only.
    pub predicted_reserved_bytes: Option<u64>,
    /// The replay of step 2 from step 1's allocator trace, when the client
    /// sent one; it sets the reserved figure.
    pub allocator_replay: Option<Step2Replay>,
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
                    i.state_source,
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

/// Default optimizer-state bytes per parameter of an optimizer family.
pub fn default_state_bytes_per_parameter(kind: OptimizerKind) -> Option<u32> {
    match kind {
        OptimizerKind::Adam => Some(8),
        OptimizerKind::SgdMomentum => Some(4),
        OptimizerKind::Sgd => Some(0),
        OptimizerKind::Unknown | OptimizerKind::Other => None,
    }
}

/// What a step-2 prediction is made from besides step 1's record.
#[derive(Debug, Clone, Copy)]
pub struct PredictFrom<'a> {
    /// What the client said about the model.
    pub facts: &'a ModelFacts,
    /// GPU capacity, bytes; 0 when unknown.
    pub capacity_bytes: u64,
    /// Bytes other processes hold on the GPU.
    pub other_process_bytes: u64,
    /// What the rank showed of step 1 beyond its record.
    pub extras: StepOneExtras<'a>,
    /// The prediction's tunables.
    pub config: &'a PredictConfig,
}

/// What the prediction can use of step 1 beyond the rank's timeline.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepOneExtras<'a> {
    /// Samples of step 1's open phase while step 1 is still running.
    pub live: Option<&'a LiveStep>,
    /// Step 2 replayed from the allocator trace the client sent.
    pub replay: Option<&'a Step2Replay>,
    /// What step 1's segment snapshots at its optimizer begin and end showed
    /// (clients without a trace send them); on the allocator basis without
    /// a replay it replaces the guessed layout allowance.
    pub layout: Option<&'a LayoutEstimate>,
    /// What becomes of step 1's gradients between steps ([`Gradients::of`]).
    pub gradients: Gradients,
}

/// Predicts the steady-state peak from step 1, complete or running. None
/// when step 1 has no forward/backward phase with a figure yet.
pub fn predict(step1: &StepRecord, from: PredictFrom<'_>) -> Option<Prediction> {
    let PredictFrom {
        facts,
        capacity_bytes,
        other_process_bytes,
        extras:
            StepOneExtras {
                live,
                replay,
                layout,
                gradients,
            },
        config,
    } = from;
    let step = with_live(step1, live);
    let view = Step1View::of(&step.phases)?;
    let basis = view.basis;
    let peaks = view.peaks();
    let optimizer_phase_closed = view.optimizer_phase_closed();
    let measured_jump = optimizer_phase_closed
        .then(|| view.measured_jump())
        .flatten();
    let state = optimizer_state(facts, basis, measured_jump, config);
    let grads = persistent_gradients(&view, facts);
    let optimizer = optimizer_phase_estimate(&view, &state, &grads, optimizer_phase_closed);
    let forward_grads = if gradients == Gradients::FreedBeforeBackward && !grads.persistent {
        grads.measured.or(grads.facts).unwrap_or(0)
    } else {
        0
    };
    let terms = Terms::of(&view, &peaks, &state, &grads, &optimizer, forward_grads);
    let (basis_peak, binding) = terms.binding_max();
    let basis_peak_at_most = terms
        .upper_bound(&view, &state, &grads, forward_grads)
        .map(|m| m.max(basis_peak));
    // A replay needs allocator figures to sit on (the overhead is NVML minus
    // reserved at phase starts).
    let replay = replay.filter(|_| basis == PredictionBasis::Allocator);
    // The snapshots stand in for the trace's layout, and show the optimizer
    // phase as it ran: only once it closed, and only without a replay.
    let layout_usable =
        basis == PredictionBasis::Allocator && replay.is_none() && optimizer_phase_closed;
    let layout_set_aside = layout.filter(|_| layout_usable).and_then(|_| {
        if facts.ddp_bucket_rebuild.is_some() {
            Some(LayoutSetAside::DdpBucketRebuild)
        } else if peaks.later.is_some() {
            Some(LayoutSetAside::GradientAccumulation)
        } else {
            None
        }
    });
    let layout = layout.filter(|_| layout_usable && layout_set_aside.is_none());
    let device = device_figures(DeviceInputs {
        step1,
        step: &step,
        view: &view,
        step1_peak: peaks.step1,
        basis_peak,
        binding,
        state: &state,
        optimizer: &optimizer,
        replay,
        layout,
        other_process_bytes,
        config,
    });
    let predicted = device.device_bytes;
    let rank_peak = predicted.saturating_sub(other_process_bytes);
    // capacity − rank's share − other processes, i.e. capacity − device peak
    // (also when the device figure is below what other processes hold).
    let headroom = (capacity_bytes > 0).then(|| i128::from(capacity_bytes) - i128::from(predicted));
    let headroom = headroom.map(|h| h.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64);
    // New segments past the reserved limit were cut to it: step 2 then fits
    // only if PyTorch's cache release and retry frees enough, which the
    // layouts cannot show. A risk, not a fit (`gpt-activation-checkpointing`
    // on real PyTorch died in step 2 at headroom 0 from the cut figure).
    let past_reserved_limit = layout.is_some_and(|l| l.capped_at_reserved_limit);
    let oom_risk = headroom.is_some_and(|h| h < 0 || past_reserved_limit);
    let low_headroom = oom_risk
        || headroom
            .is_some_and(|h| (h as f64) < config.low_headroom_fraction * capacity_bytes as f64);

    let layout_added = basis == PredictionBasis::Allocator && replay.is_none();
    let inputs = PredictionInputs {
        basis: if replay.is_some() {
            PredictionBasis::AllocatorReplay
        } else {
            basis
        },
        step: step.step,
        step_outcome: step.outcome,
        open_phase: step
            .phases
            .last()
            .filter(|p| p.end_monotonic_ns.is_none())
            .map(|p| p.phase),
        optimizer_phase_closed,
        first_micro_batch_peak_bytes: peaks.first,
        later_micro_batches_peak_bytes: peaks.later,
        optimizer_phase_peak_bytes: peaks.optimizer,
        step1_peak_bytes: peaks.step1,
        state_bytes: state.bytes,
        state_source: state.source,
        measured_jump_bytes: measured_jump,
        facts_state_bytes: state.facts,
        state_bytes_per_parameter: state.bytes_per_parameter,
        sharding_factor: state.sharding,
        inferred_sharding_factor: state.inferred_sharding_factor,
        grads_persistent: grads.persistent,
        grad_bytes: grads.bytes,
        grads_source: grads.source,
        binding,
        basis_peak_bytes: basis_peak,
        basis_peak_at_most_bytes: basis_peak_at_most,
        reserved_ratio: device.reserved_ratio,
        step1_reserved_peak_bytes: device.step1_reserved_peak,
        cache_at_optimizer_begin_bytes: device.cache_at_optimizer_begin,
        state_from_cache_bytes: device.state_from_cache,
        layout_allowance_fraction: config.layout_allowance_fraction,
        layout_allowance_bytes: if layout_added {
            device.layout_allowance
        } else {
            0
        },
        layout_snapshots: layout.copied(),
        layout_snapshots_set_aside: layout_set_aside,
        reserved_at_optimizer_end_bytes: device.reserved_at_optimizer_end,
        predicted_reserved_bytes: device.predicted_reserved,
        allocator_replay: replay.copied(),
        overhead_bytes: device.overhead,
        overhead_source: device.overhead_source,
        process_overhead_bytes: device
            .overhead
            .map(|o| o.saturating_sub(other_process_bytes)),
        nvml_overhead_bytes: device.nvml_overhead,
        device_total_bytes: device.device_total,
        step1_nvml_peak_bytes: device.step1_nvml_peak,
        capacity_bytes,
        other_process_bytes,
        optimizer_temporaries_bytes: state.temporaries,
        optimizer_phase_estimate_bytes: optimizer.estimate,
        basis_limits: basis_limits(
            basis,
            state.source,
            replay.is_none() && layout.is_none() && device.state_from_cache > 0,
        ),
        gradients,
        forward_grad_bytes: forward_grads,
    };
    let what_would_fit = what_would_fit(&FitInputs {
        binding,
        basis_peak_bytes: basis_peak,
        optimizer_phase_peak_bytes: peaks.optimizer,
        predicted_peak_bytes: predicted,
        capacity_bytes,
        target_headroom_bytes: (config.low_headroom_fraction.max(0.0) * capacity_bytes as f64)
            .ceil() as u64,
        state_bytes: state.bytes,
        sharding_factor: state.inferred_sharding_factor.unwrap_or(state.sharding),
        activation_bytes: {
            let a = activation_peak_bytes(&step);
            match basis {
                PredictionBasis::NvmlOnly => a.nvml_bytes,
                _ => a.allocated_bytes,
            }
        },
        micro_batch_size: facts.micro_batch_size,
    });
    Some(Prediction {
        what_would_fit: Some(what_would_fit),
        predicted_peak_bytes: predicted,
        predicted_rank_peak_bytes: rank_peak,
        headroom_bytes: headroom,
        oom_risk,
        low_headroom,
        provisional: step.outcome == StepOutcome::Running,
        explanation: explain(&inputs, predicted, headroom),
        inputs,
        warning_revision: None,
    })
}

/// Step 1's phases as the prediction reads them: the basis its figures are
/// taken in, and the split into the first micro-batch group (up to and
/// including the first backward) and the later micro-batches.
struct Step1View<'a> {
    phases: &'a [PhaseRecord],
    basis: PredictionBasis,
    first_backward: Option<usize>,
}

/// A predicate over step 1's phases, by position and record.
type PhaseFilter<'f> = &'f dyn Fn(usize, &PhaseRecord) -> bool;

impl<'a> Step1View<'a> {
    /// The allocator basis when a forward or backward phase has allocator
    /// figures, else NVML when one has samples; None when neither has any.
    fn of(phases: &'a [PhaseRecord]) -> Option<Self> {
        let forward_backward = || phases.iter().filter(|p| is_forward_backward(p));
        let basis = if forward_backward().any(|p| allocator_peak(p).is_some()) {
            PredictionBasis::Allocator
        } else if forward_backward().any(|p| nvml_peak(p).is_some()) {
            PredictionBasis::NvmlOnly
        } else {
            return None;
        };
        Some(Self {
            phases,
            basis,
            first_backward: phases.iter().position(|p| p.phase == PhaseKind::Backward),
        })
    }

    fn in_first_group(&self, i: usize) -> bool {
        self.first_backward.is_none_or(|b| i <= b)
    }

    fn is_first_group_forward_backward(&self, i: usize, p: &PhaseRecord) -> bool {
        is_forward_backward(p) && self.in_first_group(i)
    }

    fn is_later_forward_backward(&self, i: usize, p: &PhaseRecord) -> bool {
        is_forward_backward(p) && !self.in_first_group(i)
    }

    fn is_first_forward(&self, i: usize, p: &PhaseRecord) -> bool {
        p.phase == PhaseKind::Forward && self.in_first_group(i)
    }

    /// A phase's peak in basis units.
    fn figure(&self, p: &PhaseRecord) -> Option<u64> {
        match self.basis {
            PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => allocator_peak(p),
            PredictionBasis::NvmlOnly => nvml_peak(p),
        }
    }

    /// The highest figure of the phases `keep` selects.
    fn max_where(&self, keep: PhaseFilter<'_>) -> Option<u64> {
        self.phases
            .iter()
            .enumerate()
            .filter(|(i, p)| keep(*i, p))
            .map(|(_, p)| self.figure(p))
            .fold(None, max_opt)
    }

    /// How high the same maximum can be, on the allocator basis: the
    /// figures are lower bounds, which since-start peak counters pin only in
    /// the phases that raise the high-water mark (see `crate::profile`).
    fn bounds_where(&self, keep: PhaseFilter<'_>) -> Option<PeakBounds> {
        self.phases
            .iter()
            .enumerate()
            .filter(|(i, p)| keep(*i, p))
            .filter_map(|(_, p)| phase_allocator_peak_bounds(p).map(|(a, _)| a))
            .reduce(PeakBounds::max)
    }

    fn peaks(&self) -> Step1Peaks {
        Step1Peaks {
            first: self
                .max_where(&|i, p| self.is_first_group_forward_backward(i, p))
                .unwrap_or(0),
            later: self.max_where(&|i, p| self.is_later_forward_backward(i, p)),
            optimizer: self.max_where(&|_, p| p.phase == PhaseKind::Optimizer),
            step1: self.max_where(&|_, _| true).unwrap_or(0),
        }
    }

    fn optimizer_indices(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.phases.len()).filter(|&i| self.phases[i].phase == PhaseKind::Optimizer)
    }

    /// Step 1 has an optimizer phase and every one has closed.
    fn optimizer_phase_closed(&self) -> bool {
        self.optimizer_indices().next().is_some()
            && self
                .optimizer_indices()
                .all(|i| self.phases[i].end_monotonic_ns.is_some())
    }

    /// The jump across step 1's optimizer phases, summed.
    fn measured_jump(&self) -> Option<i64> {
        self.optimizer_indices()
            .map(|i| jump_across(self.phases, i, self.basis))
            .sum()
    }

    fn first_forward(&self) -> Option<&'a PhaseRecord> {
        self.phases.iter().find(|p| p.phase == PhaseKind::Forward)
    }

    /// Allocator figures when step 1's first optimizer phase began.
    fn allocator_at_optimizer_begin(&self) -> Option<AllocatorStats> {
        self.optimizer_indices()
            .next()
            .and_then(|i| self.phases[i].allocator_at_start)
    }

    /// Allocator figures when step 1's (last) optimizer phase ended.
    fn allocator_at_optimizer_end(&self) -> Option<AllocatorStats> {
        self.optimizer_indices()
            .last()
            .and_then(|i| self.phases[i].allocator_at_end)
    }
}

fn is_forward_backward(p: &PhaseRecord) -> bool {
    matches!(p.phase, PhaseKind::Forward | PhaseKind::Backward)
}

fn allocator_peak(p: &PhaseRecord) -> Option<u64> {
    phase_allocator_peaks(p).map(|(allocated, _)| allocated)
}

fn nvml_peak(p: &PhaseRecord) -> Option<u64> {
    (p.nvml.samples > 0).then_some(p.nvml.peak_bytes)
}

/// Step 1's peaks by phase group, in basis units.
struct Step1Peaks {
    /// The first micro-batch group's forward/backward phases; 0 without a figure.
    first: u64,
    /// The forward/backward phases after the first backward.
    later: Option<u64>,
    /// The optimizer phases.
    optimizer: Option<u64>,
    /// Every phase; 0 without a figure.
    step1: u64,
}

/// The optimizer state and the figures it was chosen from.
struct StateFigures {
    bytes: u64,
    source: StateSource,
    /// From model facts, sharded.
    facts: Option<u64>,
    bytes_per_parameter: Option<u32>,
    sharding: u32,
    inferred_sharding_factor: Option<u32>,
    /// The optimizer's temporaries at its peak (see [`optimizer_temporaries`]).
    temporaries: u64,
}

/// The optimizer state step 2 adds to step 1's forward/backward peaks (see
/// the module documentation's `state`).
fn optimizer_state(
    facts: &ModelFacts,
    basis: PredictionBasis,
    measured_jump: Option<i64>,
    config: &PredictConfig,
) -> StateFigures {
    let bytes_per_parameter = facts
        .state_bytes_per_parameter
        .or_else(|| default_state_bytes_per_parameter(facts.optimizer));
    let sharding = facts.sharding_factor.unwrap_or(1).max(1);
    let unsharded = facts
        .parameter_count
        .zip(bytes_per_parameter)
        .map(|(n, b)| u128::from(n) * u128::from(b));
    // Without a parameter count, the family's state tensors per parameter
    // times the parameters' bytes (Adam: exp_avg and exp_avg_sq, each in
    // the parameter's dtype), when no explicit bytes per parameter say more.
    let unsharded = unsharded.or_else(|| {
        let tensors = match facts.optimizer {
            _ if facts.state_bytes_per_parameter.is_some() => None,
            OptimizerKind::Adam => Some(2),
            OptimizerKind::SgdMomentum => Some(1),
            _ => None,
        }?;
        facts.parameter_bytes.map(|b| u128::from(b) * tensors)
    });
    let facts_state = unsharded.map(|u| sat_u64(u.div_ceil(u128::from(sharding))));
    let stateful = bytes_per_parameter.map(|b| b > 0);
    let (bytes, source) = if facts.state_precreated == Some(true) {
        (0, StateSource::DeclaredPrecreated)
    } else if let Some(jump) = measured_jump {
        let jump_u = u64::try_from(jump.max(0)).unwrap_or(0);
        match basis {
            PredictionBasis::NvmlOnly if facts_state.is_some_and(|f| f > jump_u) => {
                (facts_state.unwrap_or(0), StateSource::ModelFacts)
            }
            _ if jump_u >= config.zero_jump_bytes => (jump_u, StateSource::MeasuredJump),
            PredictionBasis::NvmlOnly if stateful == Some(false) => (0, StateSource::Stateless),
            PredictionBasis::NvmlOnly => (jump_u, StateSource::UnseenOnNvml),
            PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => match stateful {
                Some(true) => (0, StateSource::DetectedPrecreated),
                Some(false) => (0, StateSource::Stateless),
                None => (0, StateSource::NoJump),
            },
        }
    } else if stateful == Some(false) {
        (0, StateSource::Stateless)
    } else if let Some(f) = facts_state {
        (f, StateSource::ModelFacts)
    } else {
        (0, StateSource::Unknown)
    };
    let inferred_sharding_factor = match (source, unsharded) {
        (StateSource::MeasuredJump, Some(u)) if bytes > 0 => {
            let r = (u as f64 / bytes as f64).round();
            (r >= 2.0).then_some(r.min(f64::from(u32::MAX)) as u32)
        }
        _ => None,
    };
    StateFigures {
        bytes,
        source,
        facts: facts_state,
        bytes_per_parameter,
        sharding,
        inferred_sharding_factor,
        temporaries: optimizer_temporaries(facts, facts_state),
    }
}

/// Gradients that survive into step 2's forward, and both ways to size them.
struct GradFigures {
    /// `grads_set_to_none == Some(false)`.
    persistent: bool,
    /// Added to the first micro-batch term; 0 when not persistent.
    bytes: u64,
    source: GradsSource,
    /// Allocator basis: allocated after the first backward − before the
    /// first forward.
    measured: Option<u64>,
    /// parameter_bytes, or parameter_count × dtype bytes.
    facts: Option<u64>,
}

fn persistent_gradients(view: &Step1View<'_>, facts: &ModelFacts) -> GradFigures {
    let persistent = facts.grads_set_to_none == Some(false);
    let measured = (view.basis == PredictionBasis::Allocator)
        .then(|| {
            let before = view.first_forward()?.allocator_at_start?.allocated_bytes;
            let after = view.phases[view.first_backward?]
                .allocator_at_end?
                .allocated_bytes;
            Some(after.saturating_sub(before))
        })
        .flatten();
    let from_facts = facts.parameter_bytes.or_else(|| {
        let per = if facts.precision == Precision::Bf16 {
            2
        } else {
            4
        };
        facts.parameter_count.map(|n| n.saturating_mul(per))
    });
    let (bytes, source) = if !persistent {
        (0, GradsSource::NotPersistent)
    } else if let Some(g) = measured {
        // What backward left allocated also holds the loop's variables still
        // alive then (the logits, the loss); gradients are never larger than
        // the parameters (same dtype), so the facts bound the measurement.
        match from_facts {
            Some(f) if f < g => (f, GradsSource::ModelFacts),
            _ => (g, GradsSource::Measured),
        }
    } else if let Some(g) = from_facts {
        (g, GradsSource::ModelFacts)
    } else {
        (0, GradsSource::Unknown)
    };
    GradFigures {
        persistent,
        bytes,
        source,
        measured,
        facts: from_facts,
    }
}

/// Step 1's optimizer phase, estimated until it has been measured.
struct OptimizerEstimate {
    /// Allocated at the phase's begin + state made in it + temporaries.
    estimate: Option<u64>,
    /// What the estimate adds that step 1 has not allocated yet.
    new_bytes: u64,
}

/// Allocator basis only (NVML cannot see what the cache serves), until the
/// phase has closed: allocated when it begins (before that: at the first
/// forward + the gradients) + the state it will create + its temporaries.
fn optimizer_phase_estimate(
    view: &Step1View<'_>,
    state: &StateFigures,
    grads: &GradFigures,
    optimizer_phase_closed: bool,
) -> OptimizerEstimate {
    let new_state = if state.source == StateSource::ModelFacts {
        state.bytes
    } else {
        0
    };
    let new_bytes = new_state.saturating_add(state.temporaries);
    let estimate =
        (view.basis == PredictionBasis::Allocator && !optimizer_phase_closed && new_bytes > 0)
            .then(|| {
                let at_begin = match view.optimizer_indices().next() {
                    Some(i) => view.phases[i].allocator_at_start?.allocated_bytes,
                    None => view
                        .first_forward()?
                        .allocator_at_start?
                        .allocated_bytes
                        .saturating_add(grads.measured.or(grads.facts)?),
                };
                Some(at_begin.saturating_add(new_bytes))
            })
            .flatten();
    OptimizerEstimate {
        estimate,
        new_bytes,
    }
}

/// The terms of the max (see the module documentation's `basis_peak`), in
/// basis units; a term that does not apply is None.
struct Terms {
    first_micro_batch: u64,
    later_micro_batches: Option<u64>,
    optimizer_phase: Option<u64>,
    step1_peak: u64,
    first_forward_beside_gradients: Option<u64>,
    /// The optimizer-phase estimate alone, for the upper bound.
    optimizer_estimate: Option<u64>,
}

impl Terms {
    fn of(
        view: &Step1View<'_>,
        peaks: &Step1Peaks,
        state: &StateFigures,
        grads: &GradFigures,
        optimizer: &OptimizerEstimate,
        forward_grads: u64,
    ) -> Self {
        // Gradients freed only just before backward live through step 2's
        // forward, on top of its activations and the state.
        let first_forward_beside_gradients = (forward_grads > 0)
            .then(|| view.max_where(&|i, p| view.is_first_forward(i, p)))
            .flatten()
            .map(|f| f.saturating_add(state.bytes).saturating_add(forward_grads));
        Self {
            first_micro_batch: peaks
                .first
                .saturating_add(state.bytes)
                .saturating_add(grads.bytes),
            later_micro_batches: peaks.later.map(|p| p.saturating_add(state.bytes)),
            optimizer_phase: max_opt(peaks.optimizer, optimizer.estimate),
            step1_peak: peaks.step1,
            first_forward_beside_gradients,
            optimizer_estimate: optimizer.estimate,
        }
    }

    /// The largest term and which it is; ties go to the earlier term.
    fn binding_max(&self) -> (u64, BindingTerm) {
        let terms = [
            (Some(self.first_micro_batch), BindingTerm::FirstMicroBatch),
            (self.later_micro_batches, BindingTerm::LaterMicroBatches),
            (self.optimizer_phase, BindingTerm::OptimizerPhase),
            (Some(self.step1_peak), BindingTerm::Step1Peak),
            (
                self.first_forward_beside_gradients,
                BindingTerm::FirstForwardBesideGradients,
            ),
        ];
        terms.iter().filter_map(|(v, t)| v.map(|v| (v, *t))).fold(
            (0, BindingTerm::FirstMicroBatch),
            |best, (v, t)| if v > best.0 { (v, t) } else { best },
        )
    }

    /// The same max over the terms' upper bounds, on the allocator basis
    /// (NVML samples bound nothing: what happened between them is unseen).
    /// A group with no figure (first micro-batch, step 1) counts as
    /// unbounded, as in the max it counts 0.
    fn upper_bound(
        &self,
        view: &Step1View<'_>,
        state: &StateFigures,
        grads: &GradFigures,
        forward_grads: u64,
    ) -> Option<u64> {
        if view.basis != PredictionBasis::Allocator {
            return None;
        }
        let unbounded = PeakBounds {
            at_least: 0,
            at_most: None,
        };
        let first = view
            .bounds_where(&|i, p| view.is_first_group_forward_backward(i, p))
            .unwrap_or(unbounded);
        let bounds = [
            Some(first.plus(state.bytes.saturating_add(grads.bytes))),
            view.bounds_where(&|i, p| view.is_later_forward_backward(i, p))
                .map(|b| b.plus(state.bytes)),
            view.bounds_where(&|_, p| p.phase == PhaseKind::Optimizer),
            self.optimizer_estimate.map(|e| PeakBounds {
                at_least: e,
                at_most: Some(e),
            }),
            Some(view.bounds_where(&|_, _| true).unwrap_or(unbounded)),
            self.first_forward_beside_gradients.and_then(|_| {
                view.bounds_where(&|i, p| view.is_first_forward(i, p))
                    .map(|b| b.plus(state.bytes.saturating_add(forward_grads)))
            }),
        ];
        bounds
            .iter()
            .flatten()
            .map(|b| b.at_most)
            .collect::<Option<Vec<u64>>>()
            .and_then(|m| m.into_iter().max())
    }
}

/// What [`device_figures`] converts to device bytes, and from what.
struct DeviceInputs<'a> {
    /// Step 1 as recorded, without the live samples.
    step1: &'a StepRecord,
    /// Step 1 with the live samples credited to its open phase.
    step: &'a StepRecord,
    view: &'a Step1View<'a>,
    step1_peak: u64,
    basis_peak: u64,
    binding: BindingTerm,
    state: &'a StateFigures,
    optimizer: &'a OptimizerEstimate,
    /// Allocator basis only.
    replay: Option<&'a Step2Replay>,
    /// Allocator basis without a replay, step 1's optimizer phase closed.
    layout: Option<&'a LayoutEstimate>,
    other_process_bytes: u64,
    config: &'a PredictConfig,
}

/// The basis peak in device bytes, and the figures on the way.
struct DeviceFigures {
    device_bytes: u64,
    reserved_ratio: Option<f64>,
    step1_reserved_peak: Option<u64>,
    predicted_reserved: Option<u64>,
    overhead: Option<u64>,
    overhead_source: Option<OverheadSource>,
    nvml_overhead: Option<u64>,
    device_total: Option<u64>,
    step1_nvml_peak: Option<u64>,
    cache_at_optimizer_begin: Option<u64>,
    state_from_cache: u64,
    layout_allowance: u64,
    reserved_at_optimizer_end: Option<u64>,
}

/// The basis peak in device bytes (see the module documentation, "Allocator
/// basis, to device bytes"); on the NVML basis it already is.
fn device_figures(d: DeviceInputs<'_>) -> DeviceFigures {
    let view = d.view;
    let basis = view.basis;
    // On the allocator basis the floor is the NVML peak of step 1's closed
    // phases: samples credited to the open phase are those taken since its
    // marker, and when the client's markers lag (a busy host, a slow replay)
    // they may already be of step 2.
    let floor_phases = match basis {
        PredictionBasis::NvmlOnly => view.phases,
        _ => &d.step1.phases,
    };
    let step1_nvml_peak = floor_phases.iter().map(nvml_peak).fold(None, max_opt);
    let cache_at_optimizer_begin = match basis {
        PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => view
            .allocator_at_optimizer_begin()
            .map(|a| a.reserved_bytes.saturating_sub(a.allocated_bytes)),
        PredictionBasis::NvmlOnly => None,
    };
    let lazily_created = matches!(
        d.state.source,
        StateSource::MeasuredJump | StateSource::ModelFacts
    );
    let state_from_cache =
        if basis == PredictionBasis::Allocator && lazily_created && d.replay.is_none() {
            cache_at_optimizer_begin.map_or(d.state.bytes, |c| d.state.bytes.min(c))
        } else {
            0
        };
    let allowance = (state_from_cache as f64 * d.config.layout_allowance_fraction.max(0.0)).round();
    let layout_allowance = match d.layout {
        Some(l) => l.new_segment_bytes,
        None if allowance.is_finite() => allowance.min(u64::MAX as f64) as u64,
        None => 0,
    };
    let mut figures = DeviceFigures {
        device_bytes: d.basis_peak,
        reserved_ratio: None,
        step1_reserved_peak: None,
        predicted_reserved: None,
        overhead: None,
        overhead_source: None,
        nvml_overhead: None,
        device_total: None,
        step1_nvml_peak,
        cache_at_optimizer_begin,
        state_from_cache,
        layout_allowance,
        reserved_at_optimizer_end: None,
    };
    if basis == PredictionBasis::NvmlOnly {
        return figures;
    }
    let reserved_peak = view
        .phases
        .iter()
        .filter_map(|p| phase_allocator_peaks(p).map(|(_, r)| r))
        .max();
    let ratio = match reserved_peak {
        Some(r) if d.step1_peak > 0 => (r as f64 / d.step1_peak as f64).max(1.0),
        _ => 1.0,
    };
    // When the estimate of step 1's optimizer phase binds, its new tensors
    // (state, temporaries) are taken at their own size: the ratio measures
    // the cache around what step 1 has allocated so far, and early in step 1
    // that cache is mostly what was kept from initialisation (FSDP: the
    // unsharded model), which the new tensors will reuse, not multiply.
    let fresh = match d.optimizer.estimate {
        Some(e) if e == d.basis_peak && d.binding == BindingTerm::OptimizerPhase => {
            d.optimizer.new_bytes.min(d.basis_peak)
        }
        _ => 0,
    };
    let by_ratio = (((d.basis_peak - fresh) as f64 * ratio).ceil() as u64).saturating_add(fresh);
    // With the snapshots, step 2's reserved peak is what step 1's optimizer
    // left reserved plus the segments step 2 must add: reserved memory does
    // not shrink between steps. The ratio figure stays a floor (it holds
    // what the snapshots' requests leave out, e.g. gradients alive beside
    // step 2's forward).
    let by_layout = d.layout.map(|l| {
        view.allocator_at_optimizer_end()
            .map_or(0, |a| a.reserved_bytes)
            .saturating_add(l.new_segment_bytes)
    });
    figures.reserved_at_optimizer_end = d
        .layout
        .and(view.allocator_at_optimizer_end())
        .map(|a| a.reserved_bytes);
    let reserved = match (d.replay, by_layout) {
        (Some(r), _) => r.expected_reserved_peak_bytes(),
        (None, Some(l)) => l.max(by_ratio),
        (None, None) => by_ratio.saturating_add(layout_allowance),
    }
    .max(reserved_peak.unwrap_or(0));
    // The client's figures at step 1's markers are exact where NVML's
    // samples only bound; they are taken from the step as recorded (the
    // live samples add nothing to them).
    let client = client_overhead(d.step1);
    let nvml_overhead = overhead_estimate(d.step);
    let (overhead, source) = match (client, nvml_overhead) {
        (Some(c), _) => (Some(c.overhead_bytes), OverheadSource::ClientDeviceMemory),
        (None, Some(n)) => (Some(n), OverheadSource::NvmlSamples),
        (None, None) => (None, OverheadSource::Assumed),
    };
    figures.reserved_ratio = Some(ratio);
    figures.step1_reserved_peak = reserved_peak;
    figures.predicted_reserved = Some(reserved);
    figures.overhead = overhead;
    figures.overhead_source = Some(source);
    figures.nvml_overhead = nvml_overhead;
    figures.device_total = client.map(|c| c.total_bytes);
    figures.device_bytes = match overhead {
        Some(oh) => reserved
            .saturating_add(oh)
            .max(step1_nvml_peak.unwrap_or(0)),
        None => reserved
            .saturating_add(d.config.assumed_overhead_bytes)
            .saturating_add(d.other_process_bytes),
    };
    figures
}

/// The optimizer's temporaries at its peak, beyond its state: what PyTorch
/// 2.15 allocates, measured on fake CUDA (AdamW over 8 linear layers: the
/// peak above the phase's begin was 3.0 × parameter bytes in step 1 and 1.0
/// × in step 2 for foreach and the default, 2.0 and 0 for fused). Foreach
/// Adam's `_foreach_sqrt(exp_avg_sq)` is one parameter-sized list (half of
/// Adam's state, a third with amsgrad, taken as half); fused Adam keeps
/// none; the for-loop one parameter's worth at a time (unknown here, 0);
/// SGD with momentum updates in place (weight decay or Nesterov would add a
/// list, not reported: 0).
fn optimizer_temporaries(facts: &ModelFacts, facts_state: Option<u64>) -> u64 {
    match (facts.optimizer, facts.optimizer_implementation) {
        (
            OptimizerKind::Adam,
            OptimizerImplementation::Foreach | OptimizerImplementation::Unknown,
        ) => facts_state.map_or(0, |s| s.div_ceil(2)),
        _ => 0,
    }
}

/// What the prediction's basis cannot see (see [`BasisLimit`]);
/// `layout_guessed`: the layout allowance was added as a guessed fraction
/// (no trace, no snapshots).
fn basis_limits(
    basis: PredictionBasis,
    state_source: StateSource,
    layout_guessed: bool,
) -> Vec<BasisLimit> {
    let mut limits = Vec::new();
    if basis == PredictionBasis::NvmlOnly {
        limits.push(BasisLimit::NvmlOnlyCannotSeeCacheReuse);
    }
    if matches!(
        state_source,
        StateSource::UnseenOnNvml | StateSource::Unknown
    ) {
        limits.push(BasisLimit::OptimizerStateUnsized);
    }
    if layout_guessed {
        limits.push(BasisLimit::AllocatorFiguresCannotSeeLayout);
    }
    limits
}

/// The overhead from the device's memory the client read at step 1's
/// markers, and the device total it read.
#[derive(Debug, Clone, Copy)]
struct ClientOverhead {
    /// Max over the markers of (total − free) − reserved.
    overhead_bytes: u64,
    /// The total at the latest of those markers.
    total_bytes: u64,
}

/// The device's used memory (total − free, `cudaMemGetInfo`) minus the
/// allocator's reserved bytes at each of the step's markers that carry
/// both, the highest of them; None when no marker does.
///
/// Both figures are read at the same instant, on the training thread, so
/// each difference is exact: the CUDA context, the workspaces and NCCL
/// buffers made so far, and what other processes held on the device then.
/// The highest is taken because that memory is made lazily (cuBLAS at the
/// first matmul, NCCL at the first collective) and is rarely given back;
/// other processes count at their highest level seen at a marker, the
/// cautious side for a peak.
fn client_overhead(step: &StepRecord) -> Option<ClientOverhead> {
    let at_starts = step
        .phases
        .iter()
        .map(|p| (p.device_at_start, p.allocator_at_start));
    // The step-end or OOM marker closes the last phase.
    let at_end = step
        .device_at_end
        .zip(step.phases.last().and_then(|p| p.allocator_at_end));
    let readings: Vec<(u64, u64)> = at_starts
        .filter_map(|(d, a)| Some((d?, a?)))
        .chain(at_end)
        .map(|(d, a)| {
            (
                d.used_bytes().saturating_sub(a.reserved_bytes),
                d.total_bytes,
            )
        })
        .collect();
    Some(ClientOverhead {
        overhead_bytes: readings.iter().map(|&(o, _)| o).max()?,
        total_bytes: readings.last()?.1,
    })
}

/// NVML's device figure minus the allocator's reserved bytes (CUDA context,
/// workspaces, other processes), from samples next to step 1's markers.
///
/// At a marker the reserved bytes are known exactly; NVML is sampled only
/// between markers, and reserved memory only grows within a step. So a
/// sample minus the reserved bytes at the end of its phase is a lower bound,
/// and a sample minus the reserved bytes at the start of its phase an upper
/// bound; in a phase that reserves nothing the two meet. The estimate is the
/// best lower bound, capped by the best upper one. The last sample before
/// the step began gives a tight lower bound, as the allocator is usually
/// idle then; upper bounds from phases that reserve fast are loose by
/// however much was reserved before their first sample (gigabytes in a
/// forward pass sampled at 100 Hz), which made early provisional predictions
/// too high when they were used alone. Without a lower bound, the best upper.
fn overhead_estimate(step: &StepRecord) -> Option<u64> {
    let phases = &step.phases;
    let before_begin = step.nvml_before_begin.map(|(_, used)| used).zip(
        phases
            .first()
            .and_then(|p| p.allocator_at_start)
            .map(|a| a.reserved_bytes),
    );
    let lower = before_begin
        .into_iter()
        .chain(phases.iter().filter_map(|p| {
            Some((
                p.nvml_edges.last_bytes()?,
                p.allocator_at_end?.reserved_bytes,
            ))
        }))
        .map(|(nvml, reserved)| nvml.saturating_sub(reserved))
        .max();
    let upper = phases
        .iter()
        .filter_map(|p| {
            let first = p.nvml_edges.first_bytes()?;
            Some(first.saturating_sub(p.allocator_at_start?.reserved_bytes))
        })
        .min();
    match (lower, upper) {
        (Some(l), Some(u)) => Some(l.min(u)),
        (l, u) => l.or(u),
    }
}

/// The step with the live samples credited to its open phase.
fn with_live<'a>(step: &'a StepRecord, live: Option<&LiveStep>) -> Cow<'a, StepRecord> {
    match (live, step.phases.last()) {
        (Some(live), Some(last)) if last.end_monotonic_ns.is_none() && live.nvml.samples > 0 => {
            let mut owned = step.clone();
            let open = owned.phases.last_mut().expect("checked above");
            open.nvml = live.nvml;
            open.nvml_edges = live.nvml_edges;
            Cow::Owned(owned)
        }
        _ => Cow::Borrowed(step),
    }
}

/// The jump across the optimizer phase at `i`: allocated at its end minus at
/// its start, or for NVML the nearest sample after it (the next phase's
/// first, else its own last) minus the nearest before it (the previous
/// phase's last, else its own first).
pub(crate) fn jump_across(phases: &[PhaseRecord], i: usize, basis: PredictionBasis) -> Option<i64> {
    let p = &phases[i];
    let (before, after) = match basis {
        PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => (
            p.allocator_at_start?.allocated_bytes,
            p.allocator_at_end?.allocated_bytes,
        ),
        PredictionBasis::NvmlOnly => (
            i.checked_sub(1)
                .and_then(|j| phases[j].nvml_edges.last_bytes())
                .or(p.nvml_edges.first_bytes())?,
            phases
                .get(i + 1)
                .and_then(|n| n.nvml_edges.first_bytes())
                .or(p.nvml_edges.last_bytes())?,
        ),
    };
    Some(sat_i64(i128::from(after) - i128::from(before)))
}

fn sat_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

fn sat_i64(v: i128) -> i64 {
    v.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// Where the state figure came from, in words.
fn state_words(source: StateSource) -> &'static str {
    match source {
        StateSource::MeasuredJump => "the jump measured across step 1's optimizer phase",
        StateSource::ModelFacts => {
            "parameters × state bytes per parameter ÷ sharding factor, from the model facts"
        }
        StateSource::DeclaredPrecreated => "none added: the client declared it made before step 1",
        StateSource::DetectedPrecreated => {
            "none added: no jump across step 1's optimizer phase, so it existed before step 1"
        }
        StateSource::Stateless => "none: the optimizer keeps no state",
        StateSource::NoJump => "none: no jump across step 1's optimizer phase",
        StateSource::Unknown => "unknown until step 1's optimizer phase ends",
        StateSource::UnseenOnNvml => {
            "not seen: device memory barely moved across step 1's optimizer phase, and it cannot \
             tell state served from the allocator's cache from no state"
        }
    }
}

/// Where the gradient figure came from, in words.
fn grads_words(source: GradsSource) -> &'static str {
    match source {
        GradsSource::NotPersistent => "none kept: gradients are set to None between steps",
        GradsSource::Measured => "kept between steps, measured across step 1's first backward",
        GradsSource::ModelFacts => "kept between steps, sized from the model facts",
        GradsSource::Unknown => "kept between steps, size unknown",
    }
}

/// Which term set the prediction, in words.
fn binding_words(term: BindingTerm) -> &'static str {
    match term {
        BindingTerm::FirstMicroBatch => "set by step 2's first micro-batch on top of the state",
        BindingTerm::LaterMicroBatches => {
            "set by the later micro-batches (gradient accumulation) on top of the state"
        }
        BindingTerm::OptimizerPhase => "set by step 1's optimizer phase",
        BindingTerm::Step1Peak => "set by step 1's own peak",
        BindingTerm::FirstForwardBesideGradients => {
            "set by step 2's first forward beside step 1's gradients, which the framework frees \
             only before backward"
        }
    }
}

/// The formula with its figures, in decimal GB (see [`crate::advisory::gb`]).
fn explain(i: &PredictionInputs, device: u64, headroom: Option<i64>) -> String {
    let g = |b: u64| gb(b as f64);
    let unit = match i.basis {
        PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => "allocated",
        PredictionBasis::NvmlOnly => "device",
    };
    let mut s = format!(
        "{unit} peak = max(first micro-batch {} + optimizer state {} ({}) + gradients {} ({})",
        g(i.first_micro_batch_peak_bytes),
        g(i.state_bytes),
        state_words(i.state_source),
        g(i.grad_bytes),
        grads_words(i.grads_source),
    );
    if let Some(l) = i.later_micro_batches_peak_bytes {
        let _ = write!(s, ", later micro-batches {} + state", g(l));
    }
    if let Some(o) = i.optimizer_phase_peak_bytes {
        let _ = write!(s, ", optimizer phase {}", g(o));
    }
    let _ = write!(
        s,
        ", step-1 peak {}) = {}, {}",
        g(i.step1_peak_bytes),
        g(i.basis_peak_bytes),
        binding_words(i.binding)
    );
    if let Some(most) = i
        .basis_peak_at_most_bytes
        .filter(|&m| m > i.basis_peak_bytes)
    {
        let _ = write!(
            s,
            ", at most {}: step 1 stayed under an earlier high-water mark of the \
             allocator's peak counters, which bound its phases' peaks but do not give them",
            g(most)
        );
    }
    if let (Some(ratio), Some(res)) = (i.reserved_ratio, i.predicted_reserved_bytes) {
        match &i.allocator_replay {
            Some(r) => {
                let _ = write!(
                    s,
                    "; reserved = steps 2-4 replayed from step 1's allocator trace: {} at step \
                     1's end, step 2 adds {} in new segments (state {} kept, gradients {} {}), \
                     steady state {}",
                    g(r.reserved_at_step1_end_bytes),
                    g(r.new_segment_bytes),
                    g(r.state_bytes),
                    g(r.grad_bytes),
                    if r.grads_persistent {
                        "kept"
                    } else {
                        "freed and made again"
                    },
                    g(r.steady_reserved_peak_bytes),
                );
                match r.ddp_bucket_rebuild {
                    Some(b) if b.modelled => {
                        let _ = write!(
                            s,
                            "; DDP rebuilds its gradient buckets at step 2's first forward \
                             (replayed: {} of old buckets freed, {} buckets of {} in all made)",
                            g(b.old_bucket_bytes),
                            b.new_buckets,
                            g(b.new_bucket_bytes),
                        );
                    }
                    Some(b) => {
                        let _ = write!(
                            s,
                            "; DDP rebuilds its gradient buckets at step 2's first forward, \
                             but its old buckets ({}) were not found among the blocks alive \
                             since before step 1, so the replay leaves the rebuild out",
                            g(b.old_bucket_bytes),
                        );
                    }
                    None => {}
                }
                if let (Some(limit), Some(w)) = (r.reserved_limit_bytes, r.within_limit) {
                    if w.fits {
                        let _ = write!(
                            s,
                            "; within the GPU's {} they fit after {} cache release(s), \
                             steady state {}",
                            g(limit),
                            w.alloc_retries,
                            g(w.steady_reserved_peak_bytes)
                        );
                    } else {
                        let _ = write!(
                            s,
                            "; within the GPU's {} they do not fit even after releasing the cache",
                            g(limit)
                        );
                    }
                }
                let _ = write!(s, "; at least the step-1 reserved peak: {}", g(res));
            }
            None => match &i.layout_snapshots {
                Some(l) => {
                    let _ = write!(
                        s,
                        "; reserved = max({} reserved when step 1's optimizer ended + {} of \
                         new segments for the cached blocks the optimizer state split ({} of \
                         the {} step 2 asks for again find no free block large enough, from \
                         the allocator's segment snapshots at step 1's optimizer begin and \
                         end{}), × {ratio:.4} (step 1's reserved / allocated), step-1 reserved \
                         peak) = {}",
                        g(i.reserved_at_optimizer_end_bytes.unwrap_or(0)),
                        g(i.layout_allowance_bytes),
                        match l.blocks_needing_new_segments {
                            1 => "1 block".to_string(),
                            n => format!("{n} blocks"),
                        },
                        g(l.cached_at_begin_bytes),
                        if l.capped_at_reserved_limit {
                            "; cut to the reserved limit, past which the allocator releases \
                             its cache and retries before it fails: whether that frees enough \
                             the snapshots cannot show, so step 2 is at risk of running out"
                        } else {
                            ""
                        },
                        g(res)
                    );
                }
                None => {
                    let _ = write!(
                        s,
                        "; reserved = max(× {ratio:.4} (step 1's reserved / allocated) + layout \
                         allowance {} ({:.1}% of the state made from cached blocks, {}), step-1 \
                         reserved peak) = {}",
                        g(i.layout_allowance_bytes),
                        100.0 * i.layout_allowance_fraction,
                        g(i.state_from_cache_bytes),
                        g(res)
                    );
                    if let Some(why) = i.layout_snapshots_set_aside {
                        let _ = write!(
                            s,
                            " (the allocator's segment snapshots were set aside: {})",
                            match why {
                                LayoutSetAside::GradientAccumulation => {
                                    "with gradient accumulation step 2's micro-batches take \
                                     turns with the cache"
                                }
                                LayoutSetAside::DdpBucketRebuild => {
                                    "DDP's bucket rebuild in step 2 frees a block they cannot \
                                     show"
                                }
                            }
                        );
                    }
                }
            },
        }
        match (i.overhead_bytes, i.overhead_source) {
            (Some(oh), Some(OverheadSource::ClientDeviceMemory)) => {
                let _ = write!(
                    s,
                    "; + overhead {} (device used − reserved at step 1's markers, from the \
                     CUDA driver's free and total memory: this process's CUDA context and \
                     workspaces {}, other processes {} by NVML's process list), at least the step-1 NVML peak",
                    g(oh),
                    g(oh.saturating_sub(i.other_process_bytes)),
                    g(i.other_process_bytes.min(oh)),
                );
            }
            (Some(oh), _) => {
                let _ = write!(
                    s,
                    "; + overhead {} (NVML − reserved, bounded from NVML samples next to step \
                     1's markers: CUDA context, workspaces, other processes), at least the \
                     step-1 NVML peak",
                    g(oh)
                );
            }
            (None, _) => {
                let _ = write!(
                    s,
                    "; + assumed overhead + other processes {}",
                    g(i.other_process_bytes)
                );
            }
        }
    }
    let _ = write!(s, "; predicted device peak {}", g(device));
    if let Some(h) = headroom {
        let sign = if h < 0 { "−" } else { "" };
        let _ = write!(
            s,
            "; headroom = capacity {} − predicted peak = {sign}{}",
            g(i.capacity_bytes),
            g(h.unsigned_abs())
        );
    }
    s
}

#[cfg(test)]
mod tests {
    //! The parts of the prediction alone; `tests/prediction.rs` drives the
    //! whole through the tracker.

    use super::*;
    use crate::timeline::{SampleEdges, SampleStats};

    fn phase(
        kind: PhaseKind,
        allocated: Option<(u64, u64)>,
        nvml_peak: Option<u64>,
    ) -> PhaseRecord {
        let stats = |current: u64, peak: u64| AllocatorStats {
            allocated_bytes: current,
            allocated_peak_bytes: peak,
            reserved_bytes: peak,
            reserved_peak_bytes: peak,
            active_bytes: current,
            active_peak_bytes: peak,
            num_alloc_retries: 0,
        };
        let mut nvml = SampleStats::default();
        let mut edges = SampleEdges::default();
        if let Some(used) = nvml_peak {
            nvml.add(used);
            edges.add(1, used);
        }
        PhaseRecord {
            phase: kind,
            micro_batch: 0,
            start_monotonic_ns: 0,
            end_monotonic_ns: Some(1),
            allocator_at_start: allocated.map(|(start, _)| stats(start, start)),
            allocator_at_end: allocated.map(|(end, peak)| stats(end, peak)),
            device_at_start: None,
            nvml,
            nvml_edges: edges,
            credited: true,
        }
    }

    #[test]
    fn the_basis_is_the_allocator_when_forward_or_backward_has_its_figures() {
        let with_allocator = [
            phase(PhaseKind::Forward, Some((100, 300)), Some(900)),
            phase(PhaseKind::Backward, Some((300, 400)), None),
        ];
        let view = Step1View::of(&with_allocator).unwrap();
        assert_eq!(view.basis, PredictionBasis::Allocator);
        assert_eq!(view.peaks().first, 400);

        let nvml_only = [
            phase(PhaseKind::Forward, None, Some(900)),
            // An optimizer phase's figures do not make the basis.
            phase(PhaseKind::Optimizer, Some((0, 50)), None),
        ];
        let view = Step1View::of(&nvml_only).unwrap();
        assert_eq!(view.basis, PredictionBasis::NvmlOnly);
        assert_eq!(view.peaks().first, 900);

        let nothing = [phase(PhaseKind::Optimizer, Some((0, 50)), Some(70))];
        assert!(Step1View::of(&nothing).is_none());
    }

    #[test]
    fn micro_batches_after_the_first_backward_are_the_later_group() {
        // Two micro-batches: forward 500, backward 600, then forward 800,
        // backward 700, then the optimizer at 650.
        let phases = [
            phase(PhaseKind::Forward, Some((100, 500)), None),
            phase(PhaseKind::Backward, Some((500, 600)), None),
            phase(PhaseKind::Forward, Some((200, 800)), None),
            phase(PhaseKind::Backward, Some((800, 700)), None),
            phase(PhaseKind::Optimizer, Some((300, 650)), None),
        ];
        let peaks = Step1View::of(&phases).unwrap().peaks();
        assert_eq!(peaks.first, 600);
        assert_eq!(peaks.later, Some(800));
        assert_eq!(peaks.optimizer, Some(650));
        assert_eq!(peaks.step1, 800);
    }

    fn adam(parameters: u64, sharding: u32) -> ModelFacts {
        ModelFacts {
            optimizer: OptimizerKind::Adam,
            parameter_count: Some(parameters),
            sharding_factor: Some(sharding),
            ..ModelFacts::default()
        }
    }

    #[test]
    fn state_is_the_measured_jump_and_names_the_sharding_it_implies() {
        let config = PredictConfig::default();
        // 1 M parameters × 8 B = 8 MB unsharded; a jump of 2 MB is a
        // sharding of 4 that the facts did not report.
        let state = optimizer_state(
            &adam(1_000_000, 1),
            PredictionBasis::Allocator,
            Some(2_000_000),
            &config,
        );
        assert_eq!(state.bytes, 2_000_000);
        assert_eq!(state.source, StateSource::MeasuredJump);
        assert_eq!(state.facts, Some(8_000_000));
        assert_eq!(state.inferred_sharding_factor, Some(4));
        // Foreach Adam's temporaries: half the facts state.
        assert_eq!(state.temporaries, 4_000_000);
    }

    #[test]
    fn no_jump_means_precreated_state_on_the_allocator_and_unseen_state_on_nvml() {
        let config = PredictConfig::default();
        let facts = adam(1_000_000, 2);
        let allocator = optimizer_state(&facts, PredictionBasis::Allocator, Some(0), &config);
        assert_eq!(
            (allocator.bytes, allocator.source),
            (0, StateSource::DetectedPrecreated)
        );
        // On NVML a zero jump proves nothing: the facts' 4 MB (8 MB / 2) hold.
        let nvml = optimizer_state(&facts, PredictionBasis::NvmlOnly, Some(0), &config);
        assert_eq!(
            (nvml.bytes, nvml.source),
            (4_000_000, StateSource::ModelFacts)
        );
        // Without facts to size it, NVML says what it could not see.
        let unsized_state = optimizer_state(
            &ModelFacts::default(),
            PredictionBasis::NvmlOnly,
            Some(0),
            &config,
        );
        assert_eq!(unsized_state.source, StateSource::UnseenOnNvml);
    }

    #[test]
    fn the_binding_term_is_the_largest_and_ties_go_to_the_earlier_one() {
        let terms = Terms {
            first_micro_batch: 700,
            later_micro_batches: None,
            optimizer_phase: Some(700),
            step1_peak: 650,
            first_forward_beside_gradients: Some(699),
            optimizer_estimate: None,
        };
        assert_eq!(terms.binding_max(), (700, BindingTerm::FirstMicroBatch));
        let terms = Terms {
            later_micro_batches: Some(701),
            ..terms
        };
        assert_eq!(terms.binding_max(), (701, BindingTerm::LaterMicroBatches));
    }
}
