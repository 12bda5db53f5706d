//! What the device holds beside the allocator in a step (the CUDA context,
//! cuBLAS and NCCL workspaces, other processes): from the device memory the
//! client read at its markers when it sent it, else bounded from NVML
//! samples. The prediction adds it to reserved bytes; a step's profile to
//! its reserved peak.

use crate::timeline::StepRecord;

/// The overhead from the device's memory the client read at step 1's
/// markers, and the device total it read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientOverhead {
    /// Max over the markers of (total − free) − reserved.
    pub(super) overhead_bytes: u64,
    /// The total at the latest of those markers.
    pub(super) total_bytes: u64,
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
pub(crate) fn client_overhead(step: &StepRecord) -> Option<ClientOverhead> {
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

/// What the device held beside the allocator in `step`: the client's exact
/// figures at its markers ([`client_overhead`]), else NVML's estimate
/// ([`overhead_estimate`]).
pub(crate) fn step_overhead(step: &StepRecord) -> Option<u64> {
    client_overhead(step)
        .map(|c| c.overhead_bytes)
        .or_else(|| overhead_estimate(step))
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
pub(crate) fn overhead_estimate(step: &StepRecord) -> Option<u64> {
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
