//! Per-step, per-phase profiles: what one step did, phase kind by phase kind,
//! with the micro-batches of gradient accumulation folded together.
//!
//! # Allocator peak of a phase
//!
//! Markers carry `torch.cuda.memory_stats()` only at phase boundaries, so the
//! allocator peak of one phase instance is reconstructed from the figures at
//! its start and end:
//!
//! * it is at least `max(allocated at start, allocated at end)`;
//! * when `allocated_peak_bytes` at the end differs from its value at the
//!   start, the high-water mark moved inside the phase (it rose, or a
//!   `reset_peak_memory_stats()` inside the phase restarted it), so the end's
//!   `allocated_peak_bytes` was reached inside this phase and counts too.
//!
//! When the counter did not move, the phase stayed below an earlier high-water
//! mark and the figure is the lower bound `max(start, end)`. A phase that is
//! still open has only its start figure. Reserved memory follows the same rule
//! with `reserved_bytes` / `reserved_peak_bytes`.

use serde::Serialize;

use crate::marker::{AllocatorStats, PhaseKind};
use crate::timeline::{PhaseRecord, StepOutcome, StepRecord};

/// Allocated and reserved peaks of one phase instance, by the rule in the
/// module documentation. `None` without allocator figures.
pub fn phase_allocator_peaks(phase: &PhaseRecord) -> Option<(u64, u64)> {
    let start = phase.allocator_at_start;
    let end = phase.allocator_at_end;
    let pick = |f: fn(&AllocatorStats) -> u64, peak: fn(&AllocatorStats) -> u64| {
        let mut v: Option<u64> = None;
        for s in [start, end].iter().flatten() {
            v = Some(v.unwrap_or(0).max(f(s)));
        }
        if let (Some(s), Some(e)) = (start, end) {
            if peak(&e) != peak(&s) {
                v = Some(v.unwrap_or(0).max(peak(&e)));
            }
        }
        v
    };
    let allocated = pick(|s| s.allocated_bytes, |s| s.allocated_peak_bytes)?;
    let reserved = pick(|s| s.reserved_bytes, |s| s.reserved_peak_bytes)?;
    Some((allocated, reserved))
}

/// One phase kind within one step, all its instances (micro-batches) together.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhaseProfile {
    /// Which phase kind this folds.
    pub phase: PhaseKind,
    /// Instances of this kind in the step (micro-batches for forward/backward).
    pub count: u32,
    /// Sum of the durations of the closed instances.
    pub duration_ns: u64,
    /// Whether one instance is still open (its duration is not counted yet).
    pub open: bool,
    /// NVML samples credited to these instances.
    pub nvml_samples: u64,
    /// Highest NVML sample (device used bytes) in these instances.
    pub nvml_peak_bytes: Option<u64>,
    /// Mean over all their samples (sample-weighted across instances).
    pub nvml_mean_bytes: Option<u64>,
    /// Highest allocator figures, see [`phase_allocator_peaks`].
    pub allocated_peak_bytes: Option<u64>,
    /// Highest reserved (caching pool) bytes, by the same rule.
    pub reserved_peak_bytes: Option<u64>,
}

/// One step, phase kind by phase kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepProfile {
    /// Step number.
    pub step: u64,
    /// How the step ended; an OOM or abandoned step is not a fair steady sample.
    pub outcome: StepOutcome,
    /// Step duration in ns; None while running.
    pub duration_ns: Option<u64>,
    /// Highest NVML sample over all phases, bytes.
    pub nvml_peak_bytes: Option<u64>,
    /// Highest allocated bytes over all phases.
    pub allocated_peak_bytes: Option<u64>,
    /// Highest reserved bytes over all phases.
    pub reserved_peak_bytes: Option<u64>,
    /// Micro-batches seen (forward phases).
    pub micro_batches: u32,
    /// The phase kinds present, in step order.
    pub phases: Vec<PhaseProfile>,
}

impl StepProfile {
    /// Builds the profile of a step from its record.
    pub fn of(step: &StepRecord) -> Self {
        let mut phases: Vec<PhaseProfile> = Vec::new();
        for kind in PhaseKind::ALL {
            let mut prof = PhaseProfile {
                phase: kind,
                count: 0,
                duration_ns: 0,
                open: false,
                nvml_samples: 0,
                nvml_peak_bytes: None,
                nvml_mean_bytes: None,
                allocated_peak_bytes: None,
                reserved_peak_bytes: None,
            };
            let mut sum: u128 = 0;
            for p in step.phases.iter().filter(|p| p.phase == kind) {
                prof.count += 1;
                match p.duration_ns() {
                    Some(d) => prof.duration_ns += d,
                    None => prof.open = true,
                }
                if p.nvml.samples > 0 {
                    prof.nvml_samples += p.nvml.samples;
                    sum += p.nvml.sum_bytes;
                    prof.nvml_peak_bytes = max_opt(prof.nvml_peak_bytes, Some(p.nvml.peak_bytes));
                }
                if let Some((a, r)) = phase_allocator_peaks(p) {
                    prof.allocated_peak_bytes = max_opt(prof.allocated_peak_bytes, Some(a));
                    prof.reserved_peak_bytes = max_opt(prof.reserved_peak_bytes, Some(r));
                }
            }
            if prof.count == 0 {
                continue;
            }
            if prof.nvml_samples > 0 {
                prof.nvml_mean_bytes = Some((sum / u128::from(prof.nvml_samples)) as u64);
            }
            phases.push(prof);
        }
        let fold = |f: fn(&PhaseProfile) -> Option<u64>| phases.iter().map(f).fold(None, max_opt);
        StepProfile {
            step: step.step,
            outcome: step.outcome,
            duration_ns: step.duration_ns(),
            nvml_peak_bytes: fold(|p| p.nvml_peak_bytes),
            allocated_peak_bytes: fold(|p| p.allocated_peak_bytes),
            reserved_peak_bytes: fold(|p| p.reserved_peak_bytes),
            micro_batches: phases
                .iter()
                .find(|p| p.phase == PhaseKind::Forward)
                .map_or(0, |p| p.count),
            phases,
        }
    }

    /// The profile of one phase kind, if the step had it.
    pub fn phase(&self, kind: PhaseKind) -> Option<&PhaseProfile> {
        self.phases.iter().find(|p| p.phase == kind)
    }
}

/// Median of a list (the mean of the two middle values for an even count,
/// rounded down); `None` for an empty list.
pub fn median_u64(values: &mut [u64]) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        let (a, b) = (values[n / 2 - 1], values[n / 2]);
        a / 2 + b / 2 + (a % 2 + b % 2) / 2
    })
}

/// Median of the figures that are present.
fn median_of<T>(items: &[T], f: impl Fn(&T) -> Option<u64>) -> Option<u64> {
    let mut v: Vec<u64> = items.iter().filter_map(f).collect();
    median_u64(&mut v)
}

/// One phase kind in the steady state: medians over the steady steps that
/// had the phase.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SteadyPhaseProfile {
    /// Which phase kind.
    pub phase: PhaseKind,
    /// Median summed duration of the phase per step, ns.
    pub duration_ns: Option<u64>,
    /// Median of the phase's NVML peak, bytes.
    pub nvml_peak_bytes: Option<u64>,
    /// Median of the phase's NVML mean, bytes.
    pub nvml_mean_bytes: Option<u64>,
    /// Median of the phase's allocated peak, bytes.
    pub allocated_peak_bytes: Option<u64>,
    /// Median of the phase's reserved peak, bytes.
    pub reserved_peak_bytes: Option<u64>,
}

/// The steady-state profile: the median of each figure over the completed
/// steps after the first (steps 2..k).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SteadyProfile {
    /// Step numbers the medians were taken over.
    pub steps: Vec<u64>,
    /// Median step duration, ns.
    pub duration_ns: Option<u64>,
    /// Median step NVML peak, bytes; what step 1 is compared against.
    pub nvml_peak_bytes: Option<u64>,
    /// Median step allocated peak, bytes.
    pub allocated_peak_bytes: Option<u64>,
    /// Median step reserved peak, bytes.
    pub reserved_peak_bytes: Option<u64>,
    /// Per phase kind, in step order.
    pub phases: Vec<SteadyPhaseProfile>,
}

impl SteadyProfile {
    /// Medians over the given step profiles; `None` for fewer than
    /// `min_steps` of them.
    pub fn of(profiles: &[StepProfile], min_steps: usize) -> Option<Self> {
        if profiles.is_empty() || profiles.len() < min_steps {
            return None;
        }
        let phases = PhaseKind::ALL
            .iter()
            .filter_map(|&kind| {
                let ps: Vec<&PhaseProfile> =
                    profiles.iter().filter_map(|s| s.phase(kind)).collect();
                (!ps.is_empty()).then(|| SteadyPhaseProfile {
                    phase: kind,
                    duration_ns: median_of(&ps, |p| (!p.open).then_some(p.duration_ns)),
                    nvml_peak_bytes: median_of(&ps, |p| p.nvml_peak_bytes),
                    nvml_mean_bytes: median_of(&ps, |p| p.nvml_mean_bytes),
                    allocated_peak_bytes: median_of(&ps, |p| p.allocated_peak_bytes),
                    reserved_peak_bytes: median_of(&ps, |p| p.reserved_peak_bytes),
                })
            })
            .collect();
        Some(SteadyProfile {
            steps: profiles.iter().map(|p| p.step).collect(),
            duration_ns: median_of(profiles, |p| p.duration_ns),
            nvml_peak_bytes: median_of(profiles, |p| p.nvml_peak_bytes),
            allocated_peak_bytes: median_of(profiles, |p| p.allocated_peak_bytes),
            reserved_peak_bytes: median_of(profiles, |p| p.reserved_peak_bytes),
            phases,
        })
    }

    /// The steady profile of one phase kind.
    pub fn phase(&self, kind: PhaseKind) -> Option<&SteadyPhaseProfile> {
        self.phases.iter().find(|p| p.phase == kind)
    }
}

pub(crate) fn max_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(allocated: u64, allocated_peak: u64) -> AllocatorStats {
        AllocatorStats {
            allocated_bytes: allocated,
            allocated_peak_bytes: allocated_peak,
            reserved_bytes: allocated * 2,
            reserved_peak_bytes: allocated_peak * 2,
            ..Default::default()
        }
    }

    fn phase(start: Option<AllocatorStats>, end: Option<AllocatorStats>) -> PhaseRecord {
        PhaseRecord {
            phase: PhaseKind::Forward,
            micro_batch: 0,
            start_monotonic_ns: 0,
            end_monotonic_ns: end.map(|_| 10),
            allocator_at_start: start,
            allocator_at_end: end,
            nvml: Default::default(),
            nvml_edges: Default::default(),
            credited: false,
        }
    }

    #[test]
    fn a_rising_high_water_mark_is_this_phases_peak() {
        let p = phase(Some(stats(100, 150)), Some(stats(120, 400)));
        assert_eq!(phase_allocator_peaks(&p), Some((400, 800)));
    }

    #[test]
    fn an_unmoved_high_water_mark_leaves_the_boundary_figures() {
        let p = phase(Some(stats(100, 900)), Some(stats(120, 900)));
        assert_eq!(phase_allocator_peaks(&p), Some((120, 240)));
    }

    #[test]
    fn a_reset_inside_the_phase_counts_as_moved() {
        let p = phase(Some(stats(100, 900)), Some(stats(120, 300)));
        assert_eq!(phase_allocator_peaks(&p), Some((300, 600)));
    }

    #[test]
    fn an_open_phase_has_its_start_figures() {
        let p = phase(Some(stats(100, 900)), None);
        assert_eq!(phase_allocator_peaks(&p), Some((100, 200)));
        assert_eq!(phase_allocator_peaks(&phase(None, None)), None);
    }

    #[test]
    fn median_rounds_down_between_the_middle_values() {
        assert_eq!(median_u64(&mut []), None);
        assert_eq!(median_u64(&mut [3, 1, 2]), Some(2));
        assert_eq!(median_u64(&mut [4, 1, 2, 9]), Some(3));
        assert_eq!(median_u64(&mut [u64::MAX, u64::MAX]), Some(u64::MAX));
    }
}
