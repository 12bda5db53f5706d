//! After step 2: the trailing window of a rank's steps, and whether memory
//! grows from step to step.
//!
//! The steady profile (`analysis`) is taken over the first steps after the
//! first; what happens after them is seen here. Each rank keeps the figures
//! of its latest [`GrowthConfig::window_steps`] completed steps from the
//! third on (step 1 makes the optimizer state, step 2 fragments the cache
//! around it: both grow for reasons of their own):
//!
//! * **Trailing peaks**: the highest NVML, allocated and reserved step peak
//!   of the window, so that alerts see the job's whole life, not steps 2–11.
//! * **Growth**: per figure taken at the same point of every step
//!   (allocated at step end, reserved at step end, the step's NVML peak),
//!   the Theil–Sen slope: the median of the slopes between every pair of
//!   steps in the window. One outlier step moves at most `n − 1` of the
//!   `n(n − 1)/2` pair slopes, so it cannot move the median of a window of
//!   more than four steps. With it, Sen's confidence interval (from the
//!   ranks of the pair slopes, as in the Mann–Kendall test, without the
//!   correction for ties, which only widens it). Nothing is said before
//!   [`GrowthConfig::min_steps`] steps.
//! * **Batches that ratchet up** (curriculum, variable lengths): a step
//!   larger than every earlier one of the window grows the allocator's
//!   cache for good, which a slope over the window would read as a leak.
//!   Steps are therefore blocked by their running-max batch (a step
//!   without batch facts stays in the block before it), and pair slopes
//!   are taken only within a block: a seasonal Sen slope, whose interval
//!   sums the blocks' Mann–Kendall variances. The level is fitted on the
//!   last block, the batch the job runs at now. Without batch facts the
//!   window is one block.
//! * **Forecast** ([`forecast`]): growth counts when the interval's lower
//!   end is above 0 *and* the slope adds at least
//!   [`GrowthConfig::min_window_growth_fraction`] of the GPU's capacity over
//!   the window. The first keeps noise out; the second bounds it for good: a
//!   flat series whose steps stay within ±b of a level never has a median
//!   pair slope above about 7b/n, so noise under a seventh of the threshold
//!   never counts, whatever the confidence. Of the figures that grow, the
//!   fastest sets the rate; the level is the fitted NVML peak of the latest
//!   step (device memory, what capacity is compared with), else the reserved
//!   and then the allocated peak. The step at which the level reaches
//!   capacity, and the time from the step period (the median time between
//!   the window's step ends), follow.
//!
//! Kept incrementally ([`TrendMemo`]): a marker batch or a credited sample
//! visits only the steps that completed since, and the last
//! [`RECHECK_STEPS`] kept ones (late samples raise their NVML peaks); the
//! slopes are recomputed only when a kept figure changed, which is about
//! once per step. A window of 64 steps is 2,016 pair slopes per figure.

use std::collections::VecDeque;

use serde::Serialize;

use crate::batch::{
    BatchPoint, BatchRelation, BatchSize, BatchUnit, BeyondAllocator, LargestBatch,
};
use crate::marker::BatchFacts;
use crate::profile::{phase_allocator_peak_bounds, PeakBounds};
use crate::slope::{seasonal_theil_sen, Slope};
use crate::timeline::{RankTimeline, StepOutcome, StepRecord};

/// Tunables of the growth estimate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GrowthConfig {
    /// Completed steps the trailing window keeps (from the third step on).
    pub window_steps: usize,
    /// Steps in a figure's window before its slope is computed.
    pub min_steps: usize,
    /// Normal quantile of Sen's interval (3.29: two-sided 99.9%).
    pub confidence_z: f64,
    /// Growth counts only when its slope adds at least this fraction of
    /// the GPU's capacity over the window's span.
    pub min_window_growth_fraction: f64,
}

impl Default for GrowthConfig {
    fn default() -> Self {
        Self {
            window_steps: 64,
            min_steps: 16,
            confidence_z: 3.29,
            min_window_growth_fraction: 0.01,
        }
    }
}

/// The kept steps of the window that are visited again on each refresh:
/// samples arrive after the markers that closed their phase (the sampler
/// hands them over every 100 ms), so the NVML peaks of the last few
/// completed steps may still rise.
pub const RECHECK_STEPS: u64 = 8;

/// What growth is measured on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GrowthSource {
    /// Allocated bytes at the step-end marker: what stays alive from one
    /// step to the next (a leak shows here first and most clearly).
    Allocated,
    /// Reserved bytes at the step-end marker: the caching allocator's pool
    /// (fragmentation shows here without allocated growth).
    Reserved,
    /// The step's NVML peak: device memory, what runs out.
    Nvml,
}

impl GrowthSource {
    /// Every source, in the order the metrics list them.
    pub const ALL: [GrowthSource; 3] = [
        GrowthSource::Allocated,
        GrowthSource::Reserved,
        GrowthSource::Nvml,
    ];

    /// Stable label value.
    pub fn as_str(self) -> &'static str {
        match self {
            GrowthSource::Allocated => "allocated",
            GrowthSource::Reserved => "reserved",
            GrowthSource::Nvml => "nvml",
        }
    }

    /// How a person reads it.
    pub fn describe(self) -> &'static str {
        match self {
            GrowthSource::Allocated => "allocated memory at step end",
            GrowthSource::Reserved => "reserved (cached) memory at step end",
            GrowthSource::Nvml => "the step's device-memory peak (NVML)",
        }
    }
}

/// One completed step as the window keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StepFigures {
    /// Step number.
    pub step: u64,
    /// CLOCK_MONOTONIC ns of its end.
    pub end_monotonic_ns: u64,
    /// Wall-clock ns of its end (0 when the marker had none).
    pub end_wall_ns: u64,
    /// Highest NVML sample of the step; None without samples.
    pub nvml_peak_bytes: Option<u64>,
    /// Highest allocated bytes: exact when the client resets the peak
    /// counters at each step's begin (`allocated_peak_exact`), else a lower
    /// bound (see `profile`).
    pub allocated_peak_bytes: Option<u64>,
    /// Whether the counters pinned `allocated_peak_bytes`.
    pub allocated_peak_exact: bool,
    /// Highest reserved bytes, by the same rule.
    pub reserved_peak_bytes: Option<u64>,
    /// Allocated bytes at the step-end marker.
    pub allocated_at_end_bytes: Option<u64>,
    /// Reserved bytes at the step-end marker.
    pub reserved_at_end_bytes: Option<u64>,
    /// The step's largest batch, when the client said it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchSize>,
}

impl StepFigures {
    /// The figures of a completed step; None for any other.
    pub fn of(step: &StepRecord) -> Option<Self> {
        if step.outcome != StepOutcome::Completed {
            return None;
        }
        let peaks = step.phases.iter().filter_map(phase_allocator_peak_bounds);
        let (allocated_peak, reserved_peak) = peaks.fold((None, None), |(a, r), (pa, pr)| {
            (
                Some(a.map_or(pa, |a: PeakBounds| a.max(pa))),
                Some(r.map_or(pr, |r: PeakBounds| r.max(pr))),
            )
        });
        let at_end = step.phases.last().and_then(|p| p.allocator_at_end);
        Some(Self {
            step: step.step,
            end_monotonic_ns: step.end_monotonic_ns?,
            end_wall_ns: step.end_wall_ns.unwrap_or(0),
            nvml_peak_bytes: step.nvml_peak_bytes(),
            allocated_peak_bytes: allocated_peak.map(|b| b.at_least),
            allocated_peak_exact: allocated_peak.is_some_and(|b| b.is_exact()),
            reserved_peak_bytes: reserved_peak.map(|b| b.at_least),
            allocated_at_end_bytes: at_end.map(|a| a.allocated_bytes),
            reserved_at_end_bytes: at_end.map(|a| a.reserved_bytes),
            batch: step.batch.as_ref().map(|b| b.size()),
        })
    }

    /// The figure growth is measured on for `source`.
    pub fn growth_figure(&self, source: GrowthSource) -> Option<u64> {
        match source {
            GrowthSource::Allocated => self.allocated_at_end_bytes,
            GrowthSource::Reserved => self.reserved_at_end_bytes,
            GrowthSource::Nvml => self.nvml_peak_bytes,
        }
    }
}

/// Where each step of `window` starts a new running-max batch block: a
/// step whose batch is larger than every earlier one of the window.
fn batch_block_starts(window: &[StepFigures]) -> Vec<bool> {
    let mut largest: Option<BatchSize> = None;
    window
        .iter()
        .map(|s| match (s.batch, largest) {
            (Some(b), None) => {
                largest = Some(b);
                false
            }
            (Some(b), Some(l)) if b.larger_than(&l) => {
                largest = Some(b);
                true
            }
            _ => false,
        })
        .collect()
}

/// The highest step peaks of the trailing window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TrailingPeaks {
    /// Steps in the window.
    pub steps: usize,
    /// Its first step.
    pub first_step: u64,
    /// Its last step.
    pub last_step: u64,
    /// Highest NVML step peak, bytes.
    pub nvml_max_bytes: Option<u64>,
    /// Highest allocated step peak (see [`StepFigures`]), bytes.
    pub allocated_max_bytes: Option<u64>,
    /// Highest reserved step peak, bytes.
    pub reserved_max_bytes: Option<u64>,
    /// Lowest NVML step peak, bytes: with the highest, the spread of the
    /// step peaks (batches that vary).
    pub nvml_min_bytes: Option<u64>,
    /// Lowest allocated step peak, bytes.
    pub allocated_min_bytes: Option<u64>,
    /// Lowest reserved step peak, bytes.
    pub reserved_min_bytes: Option<u64>,
}

/// What the trailing window says: its peaks, and each figure's slope.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryTrend {
    /// The window's highest peaks.
    pub trailing: TrailingPeaks,
    /// Allocated at step end, reserved at step end, the NVML step peak
    /// ([`GrowthSource::ALL`] order); None under
    /// [`GrowthConfig::min_steps`] steps with the figure.
    pub slopes: [Option<Slope>; 3],
    /// Median time from one step's end to the next's, per step, ns.
    pub step_period_ns: Option<u64>,
    /// Median of NVML peak − reserved peak over the window's steps that
    /// have both: the device memory outside the allocator (context,
    /// workspaces, other processes), to put an allocator level in NVML
    /// terms when too few steps had a sample for an NVML slope (steps of a
    /// few ms, between the sampler's ticks).
    pub nvml_over_reserved_bytes: Option<u64>,
    /// Median of NVML peak − allocated peak, likewise: what a step's
    /// allocated peak needs of the device besides itself.
    pub nvml_over_allocated_bytes: Option<u64>,
    /// Device memory outside the allocator at step 1, by the driver's
    /// figures the client sent (see `RankTimeline::outside_allocator_at_step1`):
    /// stands in for `nvml_over_reserved_bytes` when NVML sampled none of the
    /// window's steps (short steps on a busy node).
    pub outside_at_step1_bytes: Option<u64>,
    /// How the window's step peaks follow their batches; None without
    /// batch facts in a unit all of them share.
    pub batches: Option<BatchRelation>,
    /// The window's latest step.
    pub last: StepFigures,
}

impl MemoryTrend {
    /// What the device holds beyond the allocator's reserved bytes: the
    /// window's NVML figure, else step 1's driver figure (NVML sampled none
    /// of the window's short steps).
    pub fn beyond_reserved_bytes(&self) -> Option<u64> {
        self.nvml_over_reserved_bytes
            .or(self.outside_at_step1_bytes)
    }

    /// What the device holds beyond the allocator's peaks, as the batch and
    /// pass figures take it: beyond the reserved peak by
    /// [`Self::beyond_reserved_bytes`], beyond the allocated peak by the
    /// window's NVML figure.
    pub fn beyond_allocator(&self) -> BeyondAllocator {
        BeyondAllocator {
            over_reserved_bytes: self.beyond_reserved_bytes(),
            over_allocated_bytes: self.nvml_over_allocated_bytes,
        }
    }

    /// The trend of a window (steps in order); None when it is empty.
    pub fn of(window: &[StepFigures], config: &GrowthConfig) -> Option<Self> {
        let (first, last) = (window.first()?, *window.last()?);
        let max_of = |f: fn(&StepFigures) -> Option<u64>| window.iter().filter_map(f).max();
        let min_of = |f: fn(&StepFigures) -> Option<u64>| window.iter().filter_map(f).min();
        let starts = batch_block_starts(window);
        let slopes = GrowthSource::ALL.map(|source| {
            let mut blocks: Vec<Vec<(u64, u64)>> = vec![Vec::new()];
            for (s, &new_block) in window.iter().zip(&starts) {
                if new_block {
                    blocks.push(Vec::new());
                }
                if let Some(b) = s.growth_figure(source) {
                    blocks
                        .last_mut()
                        .expect("one block at least")
                        .push((s.step, b));
                }
            }
            if blocks.iter().map(Vec::len).sum::<usize>() < config.min_steps.max(2) {
                return None;
            }
            let blocks: Vec<&[(u64, u64)]> = blocks.iter().map(Vec::as_slice).collect();
            seasonal_theil_sen(&blocks, config.confidence_z)
        });
        let mut periods: Vec<u64> = window
            .windows(2)
            .filter(|w| w[1].step > w[0].step)
            .map(|w| {
                w[1].end_monotonic_ns.saturating_sub(w[0].end_monotonic_ns)
                    / (w[1].step - w[0].step)
            })
            .collect();
        let median_over = |f: fn(&StepFigures) -> Option<u64>| {
            let mut over: Vec<u64> = window
                .iter()
                .filter_map(|s| Some(s.nvml_peak_bytes?.saturating_sub(f(s)?)))
                .collect();
            crate::profile::median_u64(&mut over)
        };
        Some(Self {
            nvml_over_reserved_bytes: median_over(|s| s.reserved_peak_bytes),
            nvml_over_allocated_bytes: median_over(|s| s.allocated_peak_bytes),
            outside_at_step1_bytes: None,
            batches: batch_relation(window),
            trailing: TrailingPeaks {
                steps: window.len(),
                first_step: first.step,
                last_step: last.step,
                nvml_max_bytes: max_of(|s| s.nvml_peak_bytes),
                allocated_max_bytes: max_of(|s| s.allocated_peak_bytes),
                reserved_max_bytes: max_of(|s| s.reserved_peak_bytes),
                nvml_min_bytes: min_of(|s| s.nvml_peak_bytes),
                allocated_min_bytes: min_of(|s| s.allocated_peak_bytes),
                reserved_min_bytes: min_of(|s| s.reserved_peak_bytes),
            },
            slopes,
            step_period_ns: crate::profile::median_u64(&mut periods),
            last,
        })
    }

    /// The slope of `source`, if computed.
    pub fn slope(&self, source: GrowthSource) -> Option<&Slope> {
        let i = GrowthSource::ALL.iter().position(|s| *s == source)?;
        self.slopes[i].as_ref()
    }
}

/// The relation of the window's allocated step peaks to their batches, in
/// the first unit every step with a batch has.
fn batch_relation(window: &[StepFigures]) -> Option<BatchRelation> {
    let with_batch = window.iter().filter_map(|s| s.batch.as_ref());
    let unit = BatchUnit::common(with_batch)?;
    let points: Vec<BatchPoint> = window
        .iter()
        .filter_map(|s| {
            Some(BatchPoint {
                step: s.step,
                size: s.batch?.measure(unit)?,
                allocated_peak_bytes: s.allocated_peak_bytes?,
                exact: s.allocated_peak_exact,
            })
        })
        .collect();
    BatchRelation::of(unit, &points)
}

/// When memory that grows will reach the GPU's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GrowthForecast {
    /// The figure that grows fastest, whose slope is the rate.
    pub source: GrowthSource,
    /// Its slope, bytes per step.
    pub bytes_per_step: f64,
    /// The steps and span it was measured over.
    pub steps: usize,
    /// First step of them.
    pub first_step: u64,
    /// Last step of them (the window's latest step).
    pub last_step: u64,
    /// The step peak now (fitted, at `last_step`), bytes.
    pub level_bytes: u64,
    /// What processes can use on the GPU, bytes.
    pub capacity_bytes: u64,
    /// The step at which the peak reaches capacity at this rate
    /// (`last_step` when it already has).
    pub oom_step: u64,
    /// Seconds from `last_step`'s end to then; None without a step period.
    pub seconds_to_oom: Option<f64>,
    /// Wall-clock ns of then; None without a step period or wall clock.
    pub oom_wall_ns: Option<u64>,
}

/// Whether `slope` is growth worth a word against `capacity_bytes` (see
/// the module documentation).
pub fn grows(slope: &Slope, capacity_bytes: u64, config: &GrowthConfig) -> bool {
    let span = slope.last_step.saturating_sub(slope.first_step) as f64;
    slope.low_bytes_per_step > 0.0
        && slope.bytes_per_step * span >= config.min_window_growth_fraction * capacity_bytes as f64
}

/// The forecast from `trend` against `capacity_bytes` (what processes can
/// use, 0 when unknown); None when capacity is unknown or no figure grows.
pub fn forecast(
    trend: &MemoryTrend,
    capacity_bytes: u64,
    config: &GrowthConfig,
) -> Option<GrowthForecast> {
    if capacity_bytes == 0 {
        return None;
    }
    let (source, rate) = GrowthSource::ALL
        .into_iter()
        .filter_map(|s| trend.slope(s).map(|sl| (s, sl)))
        .filter(|(_, sl)| grows(sl, capacity_bytes, config))
        .max_by(|a, b| a.1.bytes_per_step.total_cmp(&b.1.bytes_per_step))?;
    // Without an NVML slope, the reserved level plus what NVML shows
    // beyond the allocator: the latest step's NVML peak alone may be
    // missing or short of the level (a step between two samples). When
    // NVML sampled none of the window's steps, what the driver showed
    // beyond the allocator at step 1: the reserved level alone leaves out
    // the CUDA context, and the forecast comes far too late.
    let outside = trend.beyond_reserved_bytes();
    let reserved_in_nvml_terms = outside.and_then(|outside| {
        let reserved = trend
            .slope(GrowthSource::Reserved)
            .map(|s| s.level_bytes.max(0.0) as u64)
            .or(trend.last.reserved_peak_bytes)?;
        Some(reserved.saturating_add(outside))
    });
    // The higher of the two where both exist: NVML's samples lag a busy
    // node's steps, and a level read low puts the forecast late (the safe
    // side is the earlier step).
    let nvml_level = trend
        .slope(GrowthSource::Nvml)
        .map(|s| s.level_bytes.max(0.0) as u64);
    let level = nvml_level
        .into_iter()
        .chain(reserved_in_nvml_terms)
        .max()
        .or(trend.last.nvml_peak_bytes)
        .or(trend.last.reserved_peak_bytes)
        .or(trend.last.allocated_peak_bytes)?;
    let last_step = trend.last.step;
    let left = capacity_bytes.saturating_sub(level) as f64;
    let steps_to_oom = (left / rate.bytes_per_step).ceil();
    // Bounded: a forecast past any plausible step is no forecast.
    let steps_to_oom = steps_to_oom.min(crate::marker::MAX_PLAUSIBLE_STEP as f64);
    let seconds = trend.step_period_ns.map(|p| steps_to_oom * p as f64 / 1e9);
    Some(GrowthForecast {
        source,
        bytes_per_step: rate.bytes_per_step,
        steps: rate.steps,
        first_step: rate.first_step,
        last_step,
        level_bytes: level,
        capacity_bytes,
        oom_step: last_step.saturating_add(steps_to_oom as u64),
        seconds_to_oom: seconds,
        oom_wall_ns: seconds.filter(|_| trend.last.end_wall_ns > 0).map(|s| {
            trend
                .last
                .end_wall_ns
                .saturating_add((s * 1e9).min(u64::MAX as f64) as u64)
        }),
    })
}

/// A rank's trailing window and its trend, kept between batches (see the
/// module documentation).
#[derive(Debug, Clone, Default)]
pub(crate) struct TrendMemo {
    revision: Option<u64>,
    sized_for: Option<(usize, usize, u64, u64)>,
    window: VecDeque<StepFigures>,
    trend: Option<MemoryTrend>,
    /// The largest batch of the run's steps from the third on.
    largest_batch: Option<LargestBatch>,
}

impl TrendMemo {
    fn sized_for(config: &GrowthConfig) -> (usize, usize, u64, u64) {
        (
            config.window_steps,
            config.min_steps,
            config.confidence_z.to_bits(),
            config.min_window_growth_fraction.to_bits(),
        )
    }

    /// The trend as of the last refresh.
    pub(crate) fn trend(&self) -> Option<&MemoryTrend> {
        self.trend.as_ref()
    }

    /// The largest batch of the run's steps from the third on, with its
    /// step's peaks, as of the last refresh.
    pub(crate) fn largest_batch(&self) -> Option<&LargestBatch> {
        self.largest_batch.as_ref()
    }

    /// Keeps `step` as the largest batch if it is larger than the kept one
    /// (or as large, with a higher allocated peak), or is the kept one with
    /// figures that changed.
    fn offer_largest(&mut self, batch: Option<&BatchFacts>, f: &StepFigures) {
        let Some(batch) = batch else {
            return;
        };
        let replace = match &self.largest_batch {
            None => true,
            Some(kept) if kept.step == f.step => {
                kept.allocated_peak_bytes != f.allocated_peak_bytes
                    || kept.allocated_peak_exact != f.allocated_peak_exact
                    || kept.reserved_peak_bytes != f.reserved_peak_bytes
                    || kept.nvml_peak_bytes != f.nvml_peak_bytes
            }
            Some(kept) => {
                let (new, old) = (batch.size(), kept.batch.size());
                new.larger_than(&old)
                    || (!old.larger_than(&new)
                        && f.allocated_peak_bytes > kept.allocated_peak_bytes)
            }
        };
        if replace {
            self.largest_batch = Some(LargestBatch {
                step: f.step,
                batch: batch.clone(),
                allocated_peak_bytes: f.allocated_peak_bytes,
                allocated_peak_exact: f.allocated_peak_exact,
                reserved_peak_bytes: f.reserved_peak_bytes,
                nvml_peak_bytes: f.nvml_peak_bytes,
            });
        }
    }

    /// Brings the window up to date with the timeline: visits the steps
    /// completed since the last refresh and the last [`RECHECK_STEPS`]
    /// kept, never the whole history.
    pub(crate) fn refresh(&mut self, timeline: &RankTimeline, config: &GrowthConfig) {
        let sized = Self::sized_for(config);
        if self.revision == Some(timeline.revision()) && self.sized_for == Some(sized) {
            return;
        }
        let latest = timeline.current().map_or(0, |s| s.step);
        let mut changed = false;
        if self.sized_for != Some(sized) || self.window.back().is_some_and(|f| f.step > latest) {
            // New tunables, or a new run on the rank: start again.
            self.window.clear();
            self.trend = None;
            self.largest_batch = None;
            self.sized_for = Some(sized);
            changed = true;
        }
        let window_steps = config.window_steps.max(2);
        let Some(first) = timeline.steps().next().map(|s| s.step) else {
            self.window.clear();
            self.trend = None;
            self.largest_batch = None;
            self.revision = Some(timeline.revision());
            return;
        };
        let from_step = first.saturating_add(2);
        let newest = self.window.back().map_or(0, |f| f.step);
        let recheck_from = newest.saturating_sub(RECHECK_STEPS);
        let mut fresh = Vec::new();
        for s in timeline.steps().rev() {
            if s.step < from_step || s.step <= recheck_from || fresh.len() >= window_steps {
                break;
            }
            let Some(f) = StepFigures::of(s) else {
                continue;
            };
            self.offer_largest(s.batch.as_ref(), &f);
            if f.step > newest {
                fresh.push(f);
            } else if let Some(kept) = self.window.iter_mut().rev().find(|k| k.step == f.step) {
                if *kept != f {
                    *kept = f;
                    changed = true;
                }
            }
        }
        changed |= !fresh.is_empty();
        for f in fresh.into_iter().rev() {
            self.window.push_back(f);
            if self.window.len() > window_steps {
                self.window.pop_front();
            }
        }
        if changed {
            self.trend =
                MemoryTrend::of(self.window.make_contiguous(), config).map(|t| MemoryTrend {
                    outside_at_step1_bytes: timeline.outside_allocator_at_step1(),
                    ..t
                });
        }
        self.revision = Some(timeline.revision());
    }
}
