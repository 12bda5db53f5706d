//! Evaluation passes and checkpoint saves: their peaks and their own
//! headroom, apart from the training steps'.
//!
//! A pass has a memory shape of its own (no gradients, often a larger
//! batch; a checkpoint's copies to the host), so the timeline keeps passes
//! apart from steps and nothing here feeds the steady profile, the trend or
//! the step-2 prediction. Per pass kind: the latest pass that ended and the
//! highest of the retained ones, each with its device peak: the NVML peak
//! within it, or its reserved peak plus what NVML shows beyond the
//! allocator on the steps (passes of a few ms fall between the sampler's
//! ticks), whichever is higher.

use serde::Serialize;

use crate::batch::{device_peak_bytes, BeyondAllocator};
use crate::marker::PassKind;
use crate::profile::allocator_peak_bounds;
use crate::timeline::{PassOutcome, PassRecord, RankTimeline};

/// One pass's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PassFigures {
    /// The last training step begun before it.
    pub after_step: u64,
    /// How it ended.
    pub outcome: PassOutcome,
    /// Its duration, ns.
    pub duration_ns: Option<u64>,
    /// NVML samples within it.
    pub nvml_samples: u64,
    /// Highest NVML sample within it, bytes.
    pub nvml_peak_bytes: Option<u64>,
    /// Highest allocated bytes: exact from a client that resets the peak
    /// counters at the pass's begin (its default after step 1), else a
    /// lower bound (as for phases, see `profile`).
    pub allocated_peak_bytes: Option<u64>,
    /// Highest reserved bytes, by the same rule.
    pub reserved_peak_bytes: Option<u64>,
    /// The device memory it needed: the higher of its NVML peak and its
    /// reserved peak plus what NVML shows beyond the allocator.
    pub device_peak_bytes: Option<u64>,
}

impl PassFigures {
    /// The figures of `pass`; `outside_bytes` is what NVML shows beyond the
    /// reserved pool on the rank's steps (see `MemoryTrend`).
    pub fn of(pass: &PassRecord, outside_bytes: Option<u64>) -> Self {
        let bounds = allocator_peak_bounds(pass.allocator_at_start, pass.allocator_at_end);
        let (allocated, reserved) =
            bounds.map_or((None, None), |(a, r)| (Some(a.at_least), Some(r.at_least)));
        let nvml = (pass.nvml.samples > 0).then_some(pass.nvml.peak_bytes);
        let beyond = BeyondAllocator {
            over_reserved_bytes: outside_bytes,
            over_allocated_bytes: None,
        };
        Self {
            after_step: pass.after_step,
            outcome: pass.outcome,
            duration_ns: pass.duration_ns(),
            nvml_samples: pass.nvml.samples,
            nvml_peak_bytes: nvml,
            allocated_peak_bytes: allocated,
            reserved_peak_bytes: reserved,
            device_peak_bytes: device_peak_bytes(nvml, reserved, None, beyond),
        }
    }

    /// What it is ranked by: its device peak, else its reserved, else its
    /// allocated peak.
    fn rank_bytes(&self) -> (u64, u64, u64) {
        (
            self.device_peak_bytes.unwrap_or(0),
            self.reserved_peak_bytes.unwrap_or(0),
            self.allocated_peak_bytes.unwrap_or(0),
        )
    }
}

/// The passes of one kind a rank ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PassPeaks {
    /// Evaluation or checkpoint.
    pub kind: PassKind,
    /// Passes of the kind begun so far.
    pub begun: u64,
    /// Retained passes of the kind that ended.
    pub ended: usize,
    /// The latest of them.
    pub latest: PassFigures,
    /// The highest of them (by device peak).
    pub highest: PassFigures,
    /// Capacity minus the highest one's device peak, bytes; None without
    /// capacity or device peak.
    pub headroom_bytes: Option<i64>,
}

/// Per kind with an ended pass retained, in [`PassKind::ALL`] order.
pub fn pass_peaks(
    timeline: &RankTimeline,
    capacity_bytes: u64,
    outside_bytes: Option<u64>,
) -> Vec<PassPeaks> {
    PassKind::ALL
        .into_iter()
        .filter_map(|kind| {
            let ended: Vec<PassFigures> = timeline
                .passes()
                .filter(|p| p.kind == kind && p.outcome != PassOutcome::Running)
                .map(|p| PassFigures::of(p, outside_bytes))
                .collect();
            let latest = *ended.last()?;
            let highest = *ended.iter().max_by_key(|f| f.rank_bytes())?;
            Some(PassPeaks {
                kind,
                begun: timeline.passes_begun(kind),
                ended: ended.len(),
                latest,
                highest,
                headroom_bytes: highest
                    .device_peak_bytes
                    .filter(|_| capacity_bytes > 0)
                    .map(|d| capacity_bytes as i64 - d as i64),
            })
        })
        .collect()
}
