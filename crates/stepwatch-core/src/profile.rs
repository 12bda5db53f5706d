//! Per-step, per-phase profiles: what one step did, phase kind by phase kind,
//! with the micro-batches of gradient accumulation folded together.
//!
//! # Allocator peak of a phase
//!
//! Markers carry `torch.cuda.memory_stats()` only at phase boundaries. Its
//! peak counters (`allocated_bytes.all.peak`, …) are high-water marks *since
//! the process started* or since `torch.cuda.reset_peak_memory_stats()`.
//! The Python client resets them at each step's begin from step 2 on
//! (`exact_step_peaks`, its default), just before that marker's read; step 1
//! and a client that opts out keep since-start counters. So the peak of one
//! phase instance is reconstructed from the figures at its start and end, as
//! bounds ([`PeakBounds`]):
//!
//! * it is at least `max(allocated at start, allocated at end)`;
//! * when `allocated_peak_bytes` at the end is above its value at the start,
//!   the high-water mark rose inside the phase, so the end's
//!   `allocated_peak_bytes` *is* the phase's peak (exact);
//! * when the counter did not move, the phase stayed under an earlier
//!   high-water mark: its peak is at least the boundary figures and at most
//!   that mark. Since-start counters pin a phase's peak only in the phase that
//!   raises the mark: in step 1 that is the phase that sets each new maximum,
//!   and in a steady state usually step 2 alone (steps 3.. repeat it exactly
//!   and so never move the counter);
//! * when the counter went down, it was reset inside the phase (or at the
//!   marker, by a client that resets it at every marker): the end's figure
//!   counts towards the lower bound, and nothing bounds the peak from above.
//!   (A reset inside a phase followed by a rise above the old mark reads as
//!   a rise: the counters cannot tell them apart.)
//!
//! After a reset at the step's begin the step's phases run from that marker
//! on, so the phase in which the counter last rose pins it, and the step's
//! peak (the highest of its phases' bounds) is exact: the rule needs nothing
//! more from such a client.
//!
//! A phase that is still open has only its start figure, and no upper bound.
//! Reserved memory follows the same rule with `reserved_bytes` /
//! `reserved_peak_bytes`. The lower bounds are what [`phase_allocator_peaks`]
//! gives and what the profiles and the prediction use as the figure; the
//! upper bounds say how far a figure may be off (`*_at_most_bytes`), and fill
//! in the steady profile (see [`SteadyProfile`]).

use serde::{Deserialize, Serialize};

use crate::marker::{AllocatorStats, PhaseKind};
use crate::timeline::{PhaseRecord, StepOutcome, StepRecord};

/// What allocator counters at phase boundaries say about a peak: it was at
/// least `at_least` and at most `at_most` (None: nothing bounds it from
/// above). Exact when the two are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakBounds {
    /// Lower bound, bytes.
    pub at_least: u64,
    /// Upper bound, bytes; None when unbounded (an open phase, a counter
    /// reset inside the phase, a figure missing at one boundary).
    pub at_most: Option<u64>,
}

impl PeakBounds {
    /// A figure known exactly.
    pub fn exact(bytes: u64) -> Self {
        Self {
            at_least: bytes,
            at_most: Some(bytes),
        }
    }

    /// Whether the bounds pin the figure.
    pub fn is_exact(&self) -> bool {
        self.at_most == Some(self.at_least)
    }

    /// Bounds of the larger of two figures.
    pub fn max(self, other: Self) -> Self {
        Self {
            at_least: self.at_least.max(other.at_least),
            at_most: self.at_most.zip(other.at_most).map(|(a, b)| a.max(b)),
        }
    }

    /// Bounds of the figure plus `bytes` (saturating).
    pub fn plus(self, bytes: u64) -> Self {
        Self {
            at_least: self.at_least.saturating_add(bytes),
            at_most: self.at_most.map(|m| m.saturating_add(bytes)),
        }
    }

    /// Bounds from a figure and its upper bound, as the profiles hold them.
    fn from_parts(at_least: Option<u64>, at_most: Option<u64>) -> Option<Self> {
        at_least.map(|at_least| Self { at_least, at_most })
    }
}

/// A profile's allocated and reserved peaks, each a lower bound with the
/// most it can have been ([`PeakBounds`] as the profiles hold them).
/// Serialized flat into the profile that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct AllocatorPeaks {
    /// Highest allocated bytes, a lower bound (see [`phase_allocator_peaks`]).
    pub allocated_peak_bytes: Option<u64>,
    /// The most the allocated peak can have been; equal to
    /// `allocated_peak_bytes` when the counters pin it, None when nothing
    /// bounds it.
    pub allocated_peak_at_most_bytes: Option<u64>,
    /// Highest reserved (caching pool) bytes, by the same rule.
    pub reserved_peak_bytes: Option<u64>,
    /// The most the reserved peak can have been, by the same rule.
    pub reserved_peak_at_most_bytes: Option<u64>,
}

impl AllocatorPeaks {
    /// The peaks of the given bounds.
    pub fn of(allocated: Option<PeakBounds>, reserved: Option<PeakBounds>) -> Self {
        Self {
            allocated_peak_bytes: allocated.map(|b| b.at_least),
            allocated_peak_at_most_bytes: allocated.and_then(|b| b.at_most),
            reserved_peak_bytes: reserved.map(|b| b.at_least),
            reserved_peak_at_most_bytes: reserved.and_then(|b| b.at_most),
        }
    }

    /// Bounds of the allocated peak; None without allocator figures.
    pub fn allocated_bounds(&self) -> Option<PeakBounds> {
        PeakBounds::from_parts(self.allocated_peak_bytes, self.allocated_peak_at_most_bytes)
    }

    /// Bounds of the reserved peak; None without allocator figures.
    pub fn reserved_bounds(&self) -> Option<PeakBounds> {
        PeakBounds::from_parts(self.reserved_peak_bytes, self.reserved_peak_at_most_bytes)
    }

    /// The steady figures of each peak over the given bounds (see
    /// [`SteadyProfile`]).
    fn steady<T>(items: &[T], peaks: impl Fn(&T) -> &AllocatorPeaks) -> Self {
        let steady = |f: fn(&AllocatorPeaks) -> Option<PeakBounds>| {
            steady_peak(&items.iter().filter_map(|i| f(peaks(i))).collect::<Vec<_>>())
        };
        let ((allocated, allocated_most), (reserved, reserved_most)) = (
            steady(AllocatorPeaks::allocated_bounds),
            steady(AllocatorPeaks::reserved_bounds),
        );
        Self {
            allocated_peak_bytes: allocated,
            allocated_peak_at_most_bytes: allocated_most,
            reserved_peak_bytes: reserved,
            reserved_peak_at_most_bytes: reserved_most,
        }
    }
}

fn max_bounds(a: Option<PeakBounds>, b: Option<PeakBounds>) -> Option<PeakBounds> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// Bounds of the allocated and reserved peaks of one phase instance, by the
/// rule in the module documentation. `None` without allocator figures.
pub fn phase_allocator_peak_bounds(phase: &PhaseRecord) -> Option<(PeakBounds, PeakBounds)> {
    allocator_peak_bounds(phase.allocator_at_start, phase.allocator_at_end)
}

/// Bounds of the allocated and reserved peaks between two markers' allocator
/// figures (a phase's, a pass's), by the rule in the module documentation.
/// `None` without figures.
pub fn allocator_peak_bounds(
    start: Option<AllocatorStats>,
    end: Option<AllocatorStats>,
) -> Option<(PeakBounds, PeakBounds)> {
    let bounds = |current: fn(&AllocatorStats) -> u64, peak: fn(&AllocatorStats) -> u64| {
        match (start, end) {
            (Some(s), Some(e)) => {
                let boundary = current(&s).max(current(&e));
                let (p0, p1) = (peak(&s), peak(&e));
                let at_least = if p1 != p0 { boundary.max(p1) } else { boundary };
                // Counters below the current figure (a malformed client) are
                // read as the current figure.
                let at_most = (p1 >= p0).then_some(p1.max(at_least));
                Some(PeakBounds { at_least, at_most })
            }
            (Some(x), None) | (None, Some(x)) => Some(PeakBounds {
                at_least: current(&x),
                at_most: None,
            }),
            (None, None) => None,
        }
    };
    let allocated = bounds(|s| s.allocated_bytes, |s| s.allocated_peak_bytes)?;
    let reserved = bounds(|s| s.reserved_bytes, |s| s.reserved_peak_bytes)?;
    Some((allocated, reserved))
}

/// Allocated and reserved peaks of one phase instance: the lower bounds of
/// [`phase_allocator_peak_bounds`]. `None` without allocator figures.
pub fn phase_allocator_peaks(phase: &PhaseRecord) -> Option<(u64, u64)> {
    phase_allocator_peak_bounds(phase).map(|(a, r)| (a.at_least, r.at_least))
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
    /// Highest allocated and reserved bytes over its instances, with their
    /// upper bounds.
    #[serde(flatten)]
    pub peaks: AllocatorPeaks,
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
    /// The step's device peak, bytes: its highest NVML sample or, when
    /// higher, its reserved peak plus what the device holds beside the
    /// allocator (CUDA context, workspaces, other processes: the client's
    /// figures at its markers, else the samples next to them). Samples miss
    /// short peaks (at 2 Hz, identical ranks'
    /// highest step-1 samples lay 10% and more apart); the allocator's peak
    /// counters miss none. The NVML peak without allocator figures.
    pub device_peak_bytes: Option<u64>,
    /// Highest allocated and reserved bytes over all phases, with their
    /// upper bounds.
    #[serde(flatten)]
    pub peaks: AllocatorPeaks,
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
                peaks: AllocatorPeaks::default(),
            };
            let (mut allocated, mut reserved) = (None, None);
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
                if let Some((a, r)) = phase_allocator_peak_bounds(p) {
                    allocated = max_bounds(allocated, Some(a));
                    reserved = max_bounds(reserved, Some(r));
                }
            }
            if prof.count == 0 {
                continue;
            }
            prof.peaks = AllocatorPeaks::of(allocated, reserved);
            if prof.nvml_samples > 0 {
                prof.nvml_mean_bytes = Some((sum / u128::from(prof.nvml_samples)) as u64);
            }
            phases.push(prof);
        }
        let fold = |f: fn(&PhaseProfile) -> Option<u64>| phases.iter().map(f).fold(None, max_opt);
        let fold_bounds = |f: fn(&PhaseProfile) -> Option<PeakBounds>| {
            phases.iter().map(f).fold(None, max_bounds)
        };
        let allocated = fold_bounds(|p| p.peaks.allocated_bounds());
        let reserved = fold_bounds(|p| p.peaks.reserved_bounds());
        let nvml_peak_bytes = fold(|p| p.nvml_peak_bytes);
        let bounded = reserved
            .zip(crate::overhead::step_overhead(step))
            .map(|(r, overhead)| r.at_least.saturating_add(overhead));
        StepProfile {
            step: step.step,
            outcome: step.outcome,
            duration_ns: step.duration_ns(),
            nvml_peak_bytes,
            device_peak_bytes: max_opt(nvml_peak_bytes, bounded),
            peaks: AllocatorPeaks::of(allocated, reserved),
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

/// Median of a list of reals (the mean of the two middle values for an
/// even count); `None` for an empty list. NaN sorts last (`total_cmp`).
/// The one definition of a median in stepwatch, with [`median_u64`].
pub fn median_f64(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}

/// Median of the figures that are present.
fn median_of<T>(items: &[T], f: impl Fn(&T) -> Option<u64>) -> Option<u64> {
    let mut v: Vec<u64> = items.iter().filter_map(f).collect();
    median_u64(&mut v)
}

/// The steady figure of one allocator peak over the steps that have it, and
/// the most it can be: `(figure, at most)`.
///
/// Steady steps repeat one another, and since-start counters pin a figure
/// only in the step that raised the high-water mark (usually step 2; see the
/// module documentation). So a step whose counters only bound the figure is
/// taken at the median of the steps whose counters pin it, as far as its own
/// bounds allow; without a pinned step, at its lower bound. The figure is
/// the median of these, and lies between the medians of the lower and upper
/// bounds; `at most` is the median of the upper bounds (None when a step has
/// none). With counters that pin every step (a client that resets them at
/// each marker) this is the plain median.
fn steady_peak(bounds: &[PeakBounds]) -> (Option<u64>, Option<u64>) {
    let mut pinned: Vec<u64> = bounds
        .iter()
        .filter(|b| b.is_exact())
        .map(|b| b.at_least)
        .collect();
    let reference = median_u64(&mut pinned);
    let mut figures: Vec<u64> = bounds
        .iter()
        .map(|b| match (reference, b.at_most) {
            (Some(r), Some(most)) => r.min(most).max(b.at_least),
            _ => b.at_least,
        })
        .collect();
    let mut most: Option<Vec<u64>> = bounds.iter().map(|b| b.at_most).collect();
    (
        median_u64(&mut figures),
        most.as_mut().and_then(|m| median_u64(m)),
    )
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
    /// Medians of the phase's allocated and reserved peaks, with steps whose
    /// counters only bound them filled in from those that pin them (see
    /// [`SteadyProfile`]), and the most each median can be (median of the
    /// upper bounds).
    #[serde(flatten)]
    pub peaks: AllocatorPeaks,
}

/// The steady-state profile: the median of each figure over the completed
/// steps after the first (steps 2..k).
///
/// Allocator peaks: since-start counters pin a steady step's peak only when
/// it raised the process's high-water mark, which in a steady state
/// usually only step 2 does; the later steps' counters bound their peaks
/// between their boundary figures and that mark. Each such step is taken at
/// the median of the steps that pin the figure, within its own bounds
/// (steady steps repeat one another), or at its lower bound when no step
/// pins it; `*_at_most_bytes` says how much higher the median can be.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SteadyProfile {
    /// Step numbers the medians were taken over.
    pub steps: Vec<u64>,
    /// Median step duration, ns.
    pub duration_ns: Option<u64>,
    /// Median step NVML peak, bytes; what step 1 is compared against.
    pub nvml_peak_bytes: Option<u64>,
    /// Median step allocated and reserved peaks (see above), and the most
    /// each median can be.
    #[serde(flatten)]
    pub peaks: AllocatorPeaks,
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
                    peaks: AllocatorPeaks::steady(&ps, |p| &p.peaks),
                })
            })
            .collect();
        Some(SteadyProfile {
            steps: profiles.iter().map(|p| p.step).collect(),
            duration_ns: median_of(profiles, |p| p.duration_ns),
            nvml_peak_bytes: median_of(profiles, |p| p.nvml_peak_bytes),
            peaks: AllocatorPeaks::steady(profiles, |p| &p.peaks),
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
            device_at_start: None,
            nvml: Default::default(),
            nvml_edges: Default::default(),
            credited: false,
        }
    }

    fn allocated(p: &PhaseRecord) -> Option<PeakBounds> {
        phase_allocator_peak_bounds(p).map(|(a, _)| a)
    }

    fn bounds(at_least: u64, at_most: Option<u64>) -> PeakBounds {
        PeakBounds { at_least, at_most }
    }

    #[test]
    fn a_rising_high_water_mark_is_this_phases_peak() {
        let p = phase(Some(stats(100, 150)), Some(stats(120, 400)));
        assert_eq!(phase_allocator_peaks(&p), Some((400, 800)));
        assert_eq!(allocated(&p), Some(PeakBounds::exact(400)));
    }

    #[test]
    fn an_unmoved_high_water_mark_bounds_the_peak() {
        let p = phase(Some(stats(100, 900)), Some(stats(120, 900)));
        assert_eq!(phase_allocator_peaks(&p), Some((120, 240)));
        assert_eq!(allocated(&p), Some(bounds(120, Some(900))));
        // At the mark at a boundary, the bounds meet.
        let p = phase(Some(stats(900, 900)), Some(stats(120, 900)));
        assert_eq!(allocated(&p), Some(PeakBounds::exact(900)));
    }

    #[test]
    fn a_reset_inside_the_phase_counts_but_leaves_no_upper_bound() {
        let p = phase(Some(stats(100, 900)), Some(stats(120, 300)));
        assert_eq!(phase_allocator_peaks(&p), Some((300, 600)));
        assert_eq!(allocated(&p), Some(bounds(300, None)));
    }

    #[test]
    fn an_open_phase_has_its_start_figures() {
        let p = phase(Some(stats(100, 900)), None);
        assert_eq!(phase_allocator_peaks(&p), Some((100, 200)));
        assert_eq!(allocated(&p), Some(bounds(100, None)));
        assert_eq!(phase_allocator_peaks(&phase(None, None)), None);
    }

    #[test]
    fn bounds_combine_as_their_max_and_sum() {
        let a = bounds(10, Some(50));
        assert_eq!(a.max(bounds(30, Some(40))), bounds(30, Some(50)));
        assert_eq!(a.max(bounds(5, None)), bounds(10, None));
        assert_eq!(a.plus(7), bounds(17, Some(57)));
        assert!(!a.is_exact() && PeakBounds::exact(3).is_exact());
    }

    #[test]
    fn steady_steps_bounded_by_the_mark_take_the_steps_that_pin_it() {
        // Step 2 raised the mark to 500 (pinned); steps 3-5 repeat it under
        // the mark, their boundary figures 400.
        let steps = [
            PeakBounds::exact(500),
            bounds(400, Some(500)),
            bounds(400, Some(500)),
            bounds(400, Some(500)),
        ];
        assert_eq!(steady_peak(&steps), (Some(500), Some(500)));
        // Within each step's own bounds: a step that cannot reach 500.
        let steps = [PeakBounds::exact(500), bounds(400, Some(450))];
        assert_eq!(steady_peak(&steps), (Some(475), Some(475)));
        // No step pins it: the lower bounds, and how far above they may be.
        let steps = [bounds(400, Some(900)), bounds(410, Some(900))];
        assert_eq!(steady_peak(&steps), (Some(405), Some(900)));
        // Unbounded steps keep their lower bound; the median has no upper one.
        let steps = [PeakBounds::exact(500), bounds(300, None), bounds(300, None)];
        assert_eq!(steady_peak(&steps), (Some(300), None));
        assert_eq!(steady_peak(&[]), (None, None));
    }

    #[test]
    fn allocator_peaks_serialize_flat_in_their_profile() {
        let profile = PhaseProfile {
            phase: PhaseKind::Forward,
            count: 1,
            duration_ns: 10,
            open: false,
            nvml_samples: 0,
            nvml_peak_bytes: None,
            nvml_mean_bytes: None,
            peaks: AllocatorPeaks::of(Some(bounds(100, Some(150))), Some(bounds(200, None))),
        };
        let json = serde_json::to_string(&profile).unwrap();
        assert!(
            json.ends_with(
                r#""nvml_mean_bytes":null,"allocated_peak_bytes":100,"allocated_peak_at_most_bytes":150,"reserved_peak_bytes":200,"reserved_peak_at_most_bytes":null}"#
            ),
            "{json}"
        );
        assert_eq!(
            profile.peaks.allocated_bounds(),
            Some(bounds(100, Some(150)))
        );
        assert_eq!(profile.peaks.reserved_bounds(), Some(bounds(200, None)));
    }

    #[test]
    fn median_f64_is_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median_f64(&mut []), None);
        assert_eq!(median_f64(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median_f64(&mut [4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn median_rounds_down_between_the_middle_values() {
        assert_eq!(median_u64(&mut []), None);
        assert_eq!(median_u64(&mut [3, 1, 2]), Some(2));
        assert_eq!(median_u64(&mut [4, 1, 2, 9]), Some(3));
        assert_eq!(median_u64(&mut [u64::MAX, u64::MAX]), Some(u64::MAX));
    }
}
