//! From allocator bytes to what NVML will show: the overhead outside the
//! allocator, the layout allowance, and the basis's limits.

use super::*;
use crate::overhead::{client_overhead, overhead_estimate};

/// What [`device_figures`] converts to device bytes, and from what.
pub(super) struct DeviceInputs<'a> {
    /// Step 1 as recorded, without the live samples.
    pub(super) step1: &'a StepRecord,
    /// Step 1 with the live samples credited to its open phase.
    pub(super) step: &'a StepRecord,
    pub(super) view: &'a Step1View<'a>,
    pub(super) step1_peak: u64,
    pub(super) basis_peak: u64,
    pub(super) binding: BindingTerm,
    pub(super) state: &'a StateFigures,
    pub(super) optimizer: &'a OptimizerEstimate,
    /// Allocator basis only.
    pub(super) replay: Option<&'a Step2Replay>,
    /// Allocator basis without a replay, step 1's optimizer phase closed.
    pub(super) layout: Option<&'a LayoutEstimate>,
    pub(super) other_process_bytes: u64,
    pub(super) config: &'a PredictConfig,
}

/// The basis peak in device bytes, and the figures on the way.
pub(super) struct DeviceFigures {
    pub(super) device_bytes: u64,
    pub(super) reserved_ratio: Option<f64>,
    pub(super) step1_reserved_peak: Option<u64>,
    pub(super) predicted_reserved: Option<u64>,
    pub(super) overhead: Option<u64>,
    pub(super) overhead_source: Option<OverheadSource>,
    pub(super) nvml_overhead: Option<u64>,
    pub(super) device_total: Option<u64>,
    pub(super) step1_nvml_peak: Option<u64>,
    pub(super) cache_at_optimizer_begin: Option<u64>,
    pub(super) state_from_cache: u64,
    pub(super) layout_allowance: u64,
    pub(super) reserved_at_optimizer_end: Option<u64>,
}

/// The basis peak in device bytes (see the module documentation, "Allocator
/// basis, to device bytes"); on the NVML basis it already is.
pub(super) fn device_figures(d: DeviceInputs<'_>) -> DeviceFigures {
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
pub(super) fn optimizer_temporaries(facts: &ModelFacts, facts_state: Option<u64>) -> u64 {
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
pub(super) fn basis_limits(
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

/// The step with the live samples credited to its open phase.
pub(super) fn with_live<'a>(step: &'a StepRecord, live: Option<&LiveStep>) -> Cow<'a, StepRecord> {
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
