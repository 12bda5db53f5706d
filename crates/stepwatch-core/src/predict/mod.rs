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
//! ([`LayoutInputs::layout_snapshots`]), and the fraction is not used.
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
//! # A larger batch in step 2
//!
//! A prediction made during step 1 cannot know that step 2's batch is
//! larger (a smaller warm-up step 1, variable-length sequences). Once step
//! 2's first forward has said its batch ([`StepOneExtras::step2_batch`]),
//! a larger one than step 1's adds step 1's activations scaled by the
//! extra batch to the device peak, before step 2's backward; the
//! explanation says so and by how much ([`BatchRevision`]).
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
use crate::fit::{micro_batch_size, what_would_fit, BindingTerm, FitInputs, WhatWouldFit};
use crate::identity::{ModelFacts, OptimizerImplementation, OptimizerKind, Precision};
use crate::layout::LayoutEstimate;
use crate::marker::{AllocatorStats, BatchFacts, PhaseKind};
use crate::profile::{max_opt, phase_allocator_peak_bounds, phase_allocator_peaks, PeakBounds};
use crate::replay::{Gradients, Step2Replay};
use crate::sample::GpuSample;
use crate::timeline::{PhaseRecord, SampleEdges, SampleStats, StepOutcome, StepRecord};
use crate::units::gb;

mod device;
mod explain;
mod larger_batch;
mod outcome;
mod step1;

pub(crate) use device::jump_across;
use device::*;
use explain::*;
pub use larger_batch::{revise_for_batch, BatchRevision};
pub use outcome::*;
use step1::*;

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
    /// Step 2's first forward's batch, once it began: a larger one than
    /// step 1's revises the prediction (see `larger_batch`).
    pub step2_batch: Option<&'a BatchFacts>,
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
                step2_batch,
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
        } else if peaks.later_micro_batches_peak_bytes.is_some() {
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
        step1_peak: peaks.step1_peak_bytes,
        basis_peak,
        binding,
        state: &state,
        optimizer: &optimizer,
        replay,
        layout,
        other_process_bytes,
        config,
    });
    let activation = {
        let a = activation_peak_bytes(&step);
        match basis {
            PredictionBasis::NvmlOnly => a.nvml_bytes,
            _ => a.allocated_bytes,
        }
    };
    let batch_revision = step2_batch
        .zip(step1.batch.as_ref())
        .zip(view.first_forward_growth(step.nvml_before_begin))
        .and_then(|((step2, step1), a)| {
            revise_for_batch(
                step1,
                step2,
                a,
                device.reserved_ratio.unwrap_or(1.0),
                device.device_bytes,
            )
        });
    let predicted = device
        .device_bytes
        .saturating_add(batch_revision.as_ref().map_or(0, |r| r.extra_device_bytes));
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
        peaks,
        state: StateInputs {
            state_bytes: state.bytes,
            state_source: state.source,
            measured_jump_bytes: measured_jump,
            facts_state_bytes: state.facts,
            state_bytes_per_parameter: state.bytes_per_parameter,
            sharding_factor: state.sharding,
            inferred_sharding_factor: state.inferred_sharding_factor,
        },
        grads: GradInputs {
            grads_persistent: grads.persistent,
            grad_bytes: grads.bytes,
            grads_source: grads.source,
        },
        binding,
        basis_peak_bytes: basis_peak,
        basis_peak_at_most_bytes: basis_peak_at_most,
        reserved: ReservedInputs {
            reserved_ratio: device.reserved_ratio,
            step1_reserved_peak_bytes: device.step1_reserved_peak,
            cache_at_optimizer_begin_bytes: device.cache_at_optimizer_begin,
            state_from_cache_bytes: device.state_from_cache,
        },
        layout: LayoutInputs {
            layout_allowance_fraction: config.layout_allowance_fraction,
            layout_allowance_bytes: if layout_added {
                device.layout_allowance
            } else {
                0
            },
            layout_snapshots: layout.copied(),
            layout_snapshots_set_aside: layout_set_aside,
            reserved_at_optimizer_end_bytes: device.reserved_at_optimizer_end,
        },
        predicted_reserved_bytes: device.predicted_reserved,
        allocator_replay: replay.copied(),
        overhead: OverheadInputs {
            overhead_bytes: device.overhead,
            overhead_source: device.overhead_source,
            process_overhead_bytes: device
                .overhead
                .map(|o| o.saturating_sub(other_process_bytes)),
            nvml_overhead_bytes: device.nvml_overhead,
            device_total_bytes: device.device_total,
        },
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
        batch_revision: batch_revision.clone(),
    };
    let what_would_fit = what_would_fit(&FitInputs {
        binding,
        basis_peak_bytes: basis_peak,
        optimizer_phase_peak_bytes: peaks.optimizer_phase_peak_bytes,
        predicted_peak_bytes: predicted,
        capacity_bytes,
        target_headroom_bytes: (config.low_headroom_fraction.max(0.0) * capacity_bytes as f64)
            .ceil() as u64,
        state_bytes: state.bytes,
        sharding_factor: state.inferred_sharding_factor.unwrap_or(state.sharding),
        // Revised for step 2's larger batch: its activations and batch.
        activation_bytes: activation
            .map(|a| a.saturating_add(batch_revision.as_ref().map_or(0, |r| r.extra_basis_bytes))),
        micro_batch_size: micro_batch_size(
            facts.micro_batch_size,
            batch_revision
                .as_ref()
                .map(|r| &r.step2_batch)
                .or(step1.batch.as_ref()),
        ),
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

#[cfg(test)]
mod tests;
