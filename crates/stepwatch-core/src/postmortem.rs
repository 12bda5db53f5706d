//! The post-mortem of a rank that died of a CUDA out-of-memory error: what
//! the step needed against what the job needed before and what was
//! predicted, which cause the figures point to, and what would fit.
//!
//! Inputs are the rank's timeline (the step that ended with the OOM marker,
//! or the evaluation pass or checkpoint save after it that did), the
//! [`OomReport`] the client sent right after that marker (the caching
//! allocator at the error: the request that failed, allocated and reserved
//! bytes, the largest free block, the device's free memory), the steady
//! profile, the prediction made before step 2, the memory trend after step 2
//! and the largest batch of the steps before. Causes are tried in the order
//! in which one excludes the next:
//!
//! 1. **Another process**: the memory outside this process's allocator
//!    (device used − reserved) grew since step 1 by more than the request.
//! 2. **Growth** of live memory: allocated bytes at step end grew step
//!    after step, and the growth since the steady steps used at least half
//!    of the headroom those steps left.
//! 3. **Fragmentation**: the allocator held enough free bytes in its
//!    segments (reserved − allocated, plus the device's free memory) for the
//!    request, but no free block as large as it; also a cache that ratchets
//!    up while allocated memory stays flat.
//! 4. **Growth** of reserved or device memory that used half the headroom.
//! 5. **An evaluation pass or a checkpoint save** died: its own peak, against
//!    the training steps' and its kind's before it.
//! 6. **The first steps**: the job died before its steady steps; the
//!    step-2 prediction says why.
//! 7. **A larger batch**: the step's batch was larger than the largest the
//!    steps fitted before; by the relation of their peaks to their batches,
//!    what it needs and the largest batch that fits.
//! 8. **A step unlike the others** without batch facts that say why: this
//!    step needed more than the steady peak, without growth before it.
//!
//! Nothing here reads a clock; the report is computed on read.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::batch::{outlook, BatchOutlook, BatchUnit, BeyondAllocator, LargestBatch};
use crate::growth::{grows, GrowthConfig, GrowthSource, MemoryTrend};
use crate::marker::{
    AllocatorStats, BatchFacts, DeviceMemory, PassKind, PhaseKind, MAX_PLAUSIBLE_BYTES,
};
use crate::pass::PassFigures;
use crate::predict::Prediction;
use crate::profile::{SteadyProfile, StepProfile};
use crate::slope::Slope;
use crate::timeline::{PassOutcome, PassRecord, RankTimeline, StepOutcome, StepRecord};
use crate::units::gb;

/// Most segments an [`OomReport`] carries.
pub const MAX_OOM_SEGMENTS: usize = 8;
/// Longest error message an [`OomReport`] carries, bytes.
pub const MAX_OOM_MESSAGE_BYTES: usize = 1024;

/// One segment of the caching allocator at an OOM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OomSegment {
    /// Bytes reserved for it from the driver.
    pub size_bytes: u64,
    /// Bytes of it held by live tensors.
    pub allocated_bytes: u64,
    /// Its largest free block, bytes.
    pub largest_free_block_bytes: u64,
    /// A segment of the small pool (requests of 1 MiB or less).
    pub small_pool: bool,
}

/// What the caching allocator knew at a CUDA OOM, as the client sent it.
/// A figure of 0 is unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OomReport {
    /// The step that died.
    pub step: u64,
    /// Bytes of the allocation that failed (from the error's message).
    pub requested_bytes: u64,
    /// `torch.cuda.memory_stats()` at the error.
    pub allocator: Option<AllocatorStats>,
    /// Free bytes in segments that also hold live blocks.
    pub inactive_split_bytes: u64,
    /// Segments reserved from the driver.
    pub segment_count: u64,
    /// The largest free block of any segment, bytes.
    pub largest_free_block_bytes: u64,
    /// The largest segments, largest first.
    pub largest_segments: Vec<OomSegment>,
    /// `cudaMemGetInfo` at the error.
    pub device_memory: Option<DeviceMemory>,
    /// The start of the error's message.
    pub message: String,
}

/// Why an [`OomReport`] is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OomReportError {
    /// More segments or a longer message than the contract allows.
    #[error("{field} has {len}; at most {max} are allowed")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// Its size.
        len: usize,
        /// Its bound.
        max: usize,
    },
    /// A figure no GPU can have.
    #[error("{0} is {1}, which no GPU has")]
    Implausible(&'static str, u64),
    /// The rank has no step of that number that died of OOM.
    #[error("step {0} of this rank did not end with an OOM marker")]
    NoOomStep(u64),
}

impl OomReport {
    /// Checks the report's bounds and figures (not its step: the tracker does).
    pub fn check(&self) -> Result<(), OomReportError> {
        if self.largest_segments.len() > MAX_OOM_SEGMENTS {
            return Err(OomReportError::TooLarge {
                field: "largest_segments",
                len: self.largest_segments.len(),
                max: MAX_OOM_SEGMENTS,
            });
        }
        if self.message.len() > MAX_OOM_MESSAGE_BYTES {
            return Err(OomReportError::TooLarge {
                field: "message",
                len: self.message.len(),
                max: MAX_OOM_MESSAGE_BYTES,
            });
        }
        let figures = [
            ("requested_bytes", self.requested_bytes),
            ("inactive_split_bytes", self.inactive_split_bytes),
            ("largest_free_block_bytes", self.largest_free_block_bytes),
        ];
        if let Some((name, v)) = figures.into_iter().find(|&(_, v)| v > MAX_PLAUSIBLE_BYTES) {
            return Err(OomReportError::Implausible(name, v));
        }
        if let Some((name, v)) = self.allocator.as_ref().and_then(|a| a.implausible()) {
            return Err(OomReportError::Implausible(name, v));
        }
        if let Some((name, v, _)) = self.device_memory.as_ref().and_then(|d| d.implausible()) {
            return Err(OomReportError::Implausible(name, v));
        }
        for s in &self.largest_segments {
            if s.size_bytes > MAX_PLAUSIBLE_BYTES {
                return Err(OomReportError::Implausible(
                    "segment size_bytes",
                    s.size_bytes,
                ));
            }
            if s.allocated_bytes > s.size_bytes {
                return Err(OomReportError::Implausible(
                    "segment allocated_bytes (above its size)",
                    s.allocated_bytes,
                ));
            }
            if s.largest_free_block_bytes > s.size_bytes - s.allocated_bytes {
                return Err(OomReportError::Implausible(
                    "segment largest_free_block_bytes (above its free bytes)",
                    s.largest_free_block_bytes,
                ));
            }
        }
        Ok(())
    }
}

/// What the post-mortem names as the reason a rank ran out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OomCause {
    /// Memory outside this process's allocator grew: another process, or
    /// this process's non-PyTorch memory (NCCL, cuBLAS workspaces).
    OtherProcess,
    /// Memory grew from step to step until it reached capacity.
    Growth,
    /// The allocator had the bytes but not in one block.
    Fragmentation,
    /// The rank died before its steady steps: what step 2 needs does not fit.
    FirstSteps,
    /// The step's batch was larger than any the rank's steps had fitted.
    LargerBatch,
    /// An evaluation pass needed more than the memory the steps left.
    Evaluation,
    /// A checkpoint save needed more than the memory the steps left.
    Checkpoint,
    /// One step needed more than the steady ones, and no batch facts say
    /// why (a larger batch the client did not describe, another code path).
    LargerStep,
    /// The figures name none of the above (e.g. no allocator figures).
    Unknown,
}

impl OomCause {
    /// Stable name for JSON, logs and the runbook.
    pub fn as_str(self) -> &'static str {
        match self {
            OomCause::OtherProcess => "other_process",
            OomCause::Growth => "growth",
            OomCause::Fragmentation => "fragmentation",
            OomCause::FirstSteps => "first_steps",
            OomCause::LargerBatch => "larger_batch",
            OomCause::Evaluation => "evaluation",
            OomCause::Checkpoint => "checkpoint",
            OomCause::LargerStep => "larger_step",
            OomCause::Unknown => "unknown",
        }
    }
}

/// The caching allocator at the error, as the report (or the OOM marker)
/// gave it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct AllocatorAtOom {
    /// Bytes of the allocation that failed; None when unknown.
    pub requested_bytes: Option<u64>,
    /// Allocated bytes at the error.
    pub allocated_bytes: Option<u64>,
    /// Reserved bytes at the error.
    pub reserved_bytes: Option<u64>,
    /// Allocated + requested: the least the step needed at that moment.
    pub needed_allocated_bytes: Option<u64>,
    /// Reserved − allocated at the error: free bytes the cache kept.
    pub cached_free_bytes: Option<u64>,
    /// The largest free block of the cache at the error.
    pub largest_free_block_bytes: Option<u64>,
}

/// What the rank's steps needed before, and what was predicted, to hold
/// the step that died against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PeaksBefore {
    /// The dying step's (or pass's) NVML peak before it died.
    pub step_nvml_peak_bytes: Option<u64>,
    /// The steady steps' NVML peak (median).
    pub steady_nvml_peak_bytes: Option<u64>,
    /// The steady steps' allocated peak (median).
    pub steady_allocated_peak_bytes: Option<u64>,
    /// The prediction made before step 2 (NVML terms).
    pub predicted_peak_bytes: Option<u64>,
    /// The GPU's capacity (NVML), bytes; 0 when unknown.
    pub capacity_bytes: u64,
}

/// Device memory beyond this process's allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct OutsideAllocator {
    /// Memory outside the allocator (context, other processes) at the error.
    pub outside_bytes: Option<u64>,
    /// Its growth since step 1.
    pub outside_growth_bytes: Option<i64>,
}

/// The growth the trend measured, when it explains the OOM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GrowthAtOom {
    /// Per-step growth (the fastest figure); None without growth.
    pub growth_bytes_per_step: Option<f64>,
    /// The figure it was measured on.
    pub growth_source: Option<GrowthSource>,
}

/// The batch of the step that died, against the largest the rank's steps
/// fitted before it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchAtOom {
    /// The step's batch, as the client described it.
    pub batch: BatchFacts,
    /// The largest batch of the completed steps, with its step's peaks.
    pub largest_before: Option<LargestBatch>,
    /// How many times the largest before it this batch is, in the first
    /// unit both have.
    pub times_largest_before: Option<f64>,
    /// What this batch needs by the relation of the steps' allocated peaks
    /// to their batches (see `batch::outlook`): allocated and device peak,
    /// headroom. From exact step peaks an estimate along their line; a lower
    /// bound (`at_least`) where some were lower bounds (a client without
    /// exact step peaks).
    pub needs: Option<BatchOutlook>,
    /// The largest batch, in the relation's unit, that can fit by the same
    /// relation: from lower-bound peaks an upper bound (a batch above it
    /// does not fit); from exact ones, an estimate.
    pub largest_that_can_fit: Option<u64>,
    /// The relation's unit.
    pub unit: Option<BatchUnit>,
}

/// The evaluation pass or checkpoint save that died.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PassAtOom {
    /// Evaluation or checkpoint.
    pub kind: PassKind,
    /// The last training step begun before it.
    pub after_step: u64,
    /// Allocated bytes when it began: what the training state held.
    pub allocated_at_begin_bytes: Option<u64>,
    /// The training steps' allocated peak: the highest of the trailing
    /// window's, else the steady one.
    pub steps_allocated_peak_bytes: Option<u64>,
    /// The highest pass of its kind that ended before it, if any.
    pub highest_before: Option<PassFigures>,
}

/// The post-mortem of a rank's OOM.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PostMortem {
    /// The step that died (for a pass: the last step begun before it).
    pub step: u64,
    /// The phase it died in (the phase its last marker opened); None for a
    /// pass, or a step that died before its first forward.
    pub phase: Option<PhaseKind>,
    /// Its micro-batch.
    pub micro_batch: u32,
    /// What the figures point to.
    pub cause: OomCause,
    /// The allocator at the error.
    #[serde(flatten)]
    pub allocator: AllocatorAtOom,
    /// What the steps needed before, and the prediction.
    #[serde(flatten)]
    pub before: PeaksBefore,
    /// Device memory beyond the allocator.
    #[serde(flatten)]
    pub outside: OutsideAllocator,
    /// The growth that explains it, if growth does.
    #[serde(flatten)]
    pub growth: GrowthAtOom,
    /// The dying step's batch against the largest before it; None when the
    /// client described no batch of the step.
    pub batch: Option<BatchAtOom>,
    /// The pass that died, when it was not a training step.
    #[serde(rename = "pass")]
    pub died_in_pass: Option<PassAtOom>,
    /// The figures in words, cause and what would fit included.
    pub message: String,
    /// What would have fit, in words.
    pub what_would_fit: String,
}

/// What died of the OOM: the rank's latest step, or the evaluation pass or
/// checkpoint save that ran after it.
#[derive(Debug, Clone, Copy)]
pub enum Died<'a> {
    /// A training step (its OOM marker ended it).
    Step(&'a StepRecord),
    /// A pass between steps (its OOM marker ended it).
    Pass(&'a PassRecord),
}

impl<'a> Died<'a> {
    /// The latest OOM of the timeline, if nothing began after it.
    pub fn of(timeline: &'a RankTimeline) -> Option<Self> {
        let step = timeline.current();
        let pass = timeline
            .passes()
            .next_back()
            .filter(|p| p.outcome == PassOutcome::Oom);
        if let Some(p) = pass {
            let after_the_step = step.is_none_or(|s| {
                s.step == p.after_step
                    && s.outcome != StepOutcome::Running
                    && s.end_monotonic_ns
                        .is_none_or(|end| end <= p.begin_monotonic_ns)
            });
            if after_the_step {
                return Some(Died::Pass(p));
            }
        }
        step.filter(|s| s.outcome == StepOutcome::Oom)
            .map(Died::Step)
    }

    /// The step an OOM report names: the step, or for a pass the last step
    /// begun before it.
    pub fn step(&self) -> u64 {
        match self {
            Died::Step(s) => s.step,
            Died::Pass(p) => p.after_step,
        }
    }
}

/// What [`post_mortem`] reads.
#[derive(Debug, Clone, Copy)]
pub struct PostMortemInputs<'a> {
    /// The rank's steps and passes.
    pub timeline: &'a RankTimeline,
    /// What the client sent with the OOM, if anything.
    pub report: Option<&'a OomReport>,
    /// The steady profile.
    pub steady: Option<&'a SteadyProfile>,
    /// The prediction made before step 2 (else the current one).
    pub prediction: Option<&'a Prediction>,
    /// The trailing window's trend.
    pub trend: Option<&'a MemoryTrend>,
    /// The largest batch of the rank's completed steps from the third on.
    pub largest_batch: Option<&'a LargestBatch>,
    /// The GPU's capacity, bytes; 0 when unknown.
    pub capacity_bytes: u64,
    /// Bytes other processes hold on the GPU now (NVML's process list).
    pub other_process_bytes: u64,
    /// Growth tunables.
    pub growth: &'a GrowthConfig,
}

/// The post-mortem of the rank's latest step or pass, when it died of OOM.
pub fn post_mortem(i: &PostMortemInputs<'_>) -> Option<PostMortem> {
    let died = Died::of(i.timeline)?;
    let step_number = died.step();
    let report = i.report.filter(|r| r.step == step_number);
    let (step, pass) = match died {
        Died::Step(s) => (Some(s), None),
        Died::Pass(p) => (None, Some(p)),
    };
    let last_phase = step.and_then(|s| s.phases.last());
    let nvml_peak = match died {
        Died::Step(s) => StepProfile::of(s).nvml_peak_bytes,
        Died::Pass(p) => (p.nvml.samples > 0).then_some(p.nvml.peak_bytes),
    };
    let at_oom = report.and_then(|r| r.allocator).or_else(|| match died {
        Died::Step(_) => last_phase.and_then(|p| p.allocator_at_end),
        Died::Pass(p) => p.allocator_at_end,
    });
    let device = report
        .and_then(|r| r.device_memory)
        .or(step.and_then(|s| s.device_at_end));
    let requested = report.map(|r| r.requested_bytes).filter(|&b| b > 0);
    let allocated = at_oom.map(|a| a.allocated_bytes);
    let reserved = at_oom.map(|a| a.reserved_bytes);
    let needed = allocated.map(|a| a + requested.unwrap_or(0));
    let cached_free = at_oom.map(|a| a.reserved_bytes.saturating_sub(a.allocated_bytes));
    let largest_free = report
        .filter(|r| r.segment_count > 0 || r.largest_free_block_bytes > 0)
        .map(|r| r.largest_free_block_bytes);
    let outside = device
        .zip(reserved)
        .map(|(d, r)| d.used_bytes().saturating_sub(r));
    let outside_at_start = i.timeline.outside_allocator_at_step1();
    let outside_growth = match (outside, outside_at_start) {
        (Some(now), Some(then)) => Some(now as i64 - then as i64),
        // Without the driver's figures: NVML's other processes now, against
        // those the prediction counted.
        _ => i.prediction.map(|p| {
            let then = p
                .predicted_peak_bytes
                .saturating_sub(p.predicted_rank_peak_bytes);
            i.other_process_bytes as i64 - then as i64
        }),
    };
    let steady_nvml = i.steady.and_then(|s| s.nvml_peak_bytes);
    let steady_alloc = i.steady.and_then(|s| s.peaks.allocated_peak_bytes);
    let steady_last_step = i.steady.and_then(|s| s.steps.last().copied());
    let capacity = i.capacity_bytes;
    let growing = |source| {
        i.trend
            .and_then(|t| t.slope(source))
            .filter(|s| capacity > 0 && grows(s, capacity, i.growth))
    };
    // Headroom the steady steps left, and how much of it growth used by
    // the step that died.
    // The steady steps' device peak: NVML's, else (NVML sampled none of
    // those short steps) their reserved peak plus what the device holds
    // beyond the allocator.
    let beyond_reserved = i
        .trend
        .and_then(MemoryTrend::beyond_reserved_bytes)
        .or(outside_at_start);
    let steady_device = steady_nvml.or_else(|| {
        let reserved = i.steady.and_then(|s| s.peaks.reserved_peak_bytes)?;
        Some(reserved + beyond_reserved?)
    });
    let steady_headroom = steady_device.map(|p| capacity.saturating_sub(p));
    let growth_used = |source| {
        let slope = growing(source)?;
        let from = steady_last_step.unwrap_or(slope.first_step);
        let used = slope.bytes_per_step * step_number.saturating_sub(from) as f64;
        Some((slope, used))
    };
    let used_half = |source| {
        growth_used(source)
            .filter(|(_, used)| steady_headroom.is_some_and(|h| h > 0 && *used >= 0.5 * h as f64))
    };
    let min_figure = (capacity / 100).max(1);
    // Room the allocator had at the error: what it held plus the device's free memory.
    let room = reserved
        .zip(device)
        .map(|(r, d)| r + d.free_bytes)
        .filter(|&r| r > 0);
    let beyond = BeyondAllocator {
        over_reserved_bytes: beyond_reserved,
        ..i.trend
            .map_or_else(BeyondAllocator::default, MemoryTrend::beyond_allocator)
    };
    let batch = step
        .and_then(|s| s.batch.as_ref())
        .map(|b| batch_at_oom(b, i, beyond));
    let died_in_pass = pass.map(|p| PassAtOom {
        kind: p.kind,
        after_step: p.after_step,
        allocated_at_begin_bytes: p.allocator_at_start.map(|a| a.allocated_bytes),
        steps_allocated_peak_bytes: i
            .trend
            .and_then(|t| t.trailing.allocated_max_bytes)
            .or(steady_alloc),
        highest_before: i
            .timeline
            .passes()
            .filter(|q| q.kind == p.kind && q.outcome == PassOutcome::Completed)
            .map(|q| PassFigures::of(q, beyond.over_reserved_bytes))
            .max_by_key(|f| (f.device_peak_bytes, f.allocated_peak_bytes)),
    });

    let mut words = Vec::new();
    let mut fit = String::new();
    let cause;
    let mut growth_rate = None;
    if let Some(g) =
        outside_growth.filter(|&g| g > 0 && g as u64 >= requested.unwrap_or(0).max(min_figure))
    {
        cause = OomCause::OtherProcess;
        words.push(format!(
            "memory outside this process's PyTorch allocator grew by {} since step 1{}: another \
             process on the GPU (or this process's non-PyTorch memory: NCCL, cuBLAS workspaces)",
            gb(g as f64),
            outside.map_or(String::new(), |o| format!(", to {}", gb(o as f64))),
        ));
        fit = format!(
            "without those {} the step fits as before; keep other processes off this GPU, or \
             count them in the job's memory budget",
            gb(g as f64)
        );
    } else if let Some((slope, used)) = used_half(GrowthSource::Allocated) {
        cause = OomCause::Growth;
        growth_rate = Some((slope.bytes_per_step, GrowthSource::Allocated));
        words.push(growth_words(
            slope,
            GrowthSource::Allocated,
            used,
            steady_headroom,
        ));
        fit = format!(
            "without the growth the step peak stays near the steady {}; find what keeps tensors \
             alive from step to step (a loss summed without .item(), outputs kept in a list, a \
             cache that grows)",
            steady_device.map_or("peak".into(), |p| gb(p as f64))
        );
    } else if let Some((free, req)) = cached_free.zip(requested).filter(|&(free, req)| {
        free + device.map_or(0, |d| d.free_bytes) >= req
            && free >= req / 2
            && largest_free.is_none_or(|l| l < req)
    }) {
        cause = OomCause::Fragmentation;
        words.push(format!(
            "fragmentation: the allocator held {} free in its segments (reserved {}, allocated \
             {}), but {} no block of the {} requested",
            gb(free as f64),
            gb(reserved.unwrap_or(0) as f64),
            gb(allocated.unwrap_or(0) as f64),
            largest_free.map_or("had".to_string(), |l| format!(
                "its largest free block was {}:",
                gb(l as f64)
            )),
            gb(req as f64),
        ));
        if let Some(s) = growing(GrowthSource::Reserved) {
            if growing(GrowthSource::Allocated)
                .is_none_or(|a| a.bytes_per_step < s.bytes_per_step / 2.0)
            {
                growth_rate = Some((s.bytes_per_step, GrowthSource::Reserved));
                words.push(format!(
                    "the cache ratcheted up by {:.1} MB per step (measured over steps {}–{}) while \
                     allocated memory grew less than half as fast",
                    s.bytes_per_step / 1e6,
                    s.first_step,
                    s.last_step
                ));
            }
        }
        fit = format!(
            "allocated memory and the request ({}) fit; PYTORCH_CUDA_ALLOC_CONF=\
             expandable_segments:True lets freed memory serve larger requests (or free the \
             cache with torch.cuda.empty_cache() where request sizes change)",
            gb((allocated.unwrap_or(0) + req) as f64)
        );
    } else if let Some((source, (slope, used))) = [GrowthSource::Reserved, GrowthSource::Nvml]
        .into_iter()
        .find_map(|s| used_half(s).map(|g| (s, g)))
    {
        cause = OomCause::Growth;
        growth_rate = Some((slope.bytes_per_step, source));
        words.push(growth_words(slope, source, used, steady_headroom));
        fit = format!(
            "without the growth the step peak stays near the steady {}",
            steady_device.map_or("peak".into(), |p| gb(p as f64))
        );
    } else if let Some(p) = &died_in_pass {
        let (w, f) = pass_words(p, needed, room);
        cause = match p.kind {
            PassKind::Evaluation => OomCause::Evaluation,
            PassKind::Checkpoint => OomCause::Checkpoint,
        };
        words.push(w);
        fit = f;
    } else if i.steady.is_none() || step_number <= 2 {
        cause = OomCause::FirstSteps;
        match i.prediction {
            Some(p) => {
                words.push(format!(
                    "the job died before its steady steps; step 1's prediction was {} of {}{}",
                    gb(p.predicted_peak_bytes as f64),
                    gb(capacity as f64),
                    if p.oom_risk {
                        ": the OOM was predicted"
                    } else {
                        ""
                    },
                ));
                fit = first_steps_fit(p);
            }
            None => {
                words.push("the job died before its steady steps, without a prediction".into());
                fit = needed.map_or(String::new(), |n| {
                    format!("at least {} for the allocator at this step", gb(n as f64))
                });
            }
        }
    } else if let Some(b) = batch
        .as_ref()
        .filter(|b| b.times_largest_before > Some(1.0))
    {
        cause = OomCause::LargerBatch;
        let (w, f) = larger_batch_words(b, capacity);
        words.push(w);
        fit = f;
    } else if let Some((need, base)) = needed.zip(steady_alloc).filter(|&(n, b)| n > b + b / 20) {
        cause = OomCause::LargerStep;
        words.push(format!(
            "this step needed at least {} (allocated {} + the {} requested), {} more than the \
             steady steps' allocated peak {}, without growth before it and without a batch \
             larger than the steps' before it that the client described: a step of another \
             shape (a larger batch, another code path)",
            gb(need as f64),
            gb(allocated.unwrap_or(0) as f64),
            gb(requested.unwrap_or(0) as f64),
            gb((need - base) as f64),
            gb(base as f64),
        ));
        fit = match room {
            Some(room) => format!(
                "steps that need at most {} of allocator memory fit ({:.0}% of this one): bound \
                 the largest batch (stepwatch.batch() or the integrations name each step's \
                 batch, which tells a larger batch apart)",
                gb(room as f64),
                100.0 * room as f64 / need as f64,
            ),
            None => "bound the largest batch".into(),
        };
    } else {
        cause = OomCause::Unknown;
        words.push("the figures point to no single cause".into());
    }

    let mut message = match died {
        Died::Step(s) => {
            let mut head = format!("died of a CUDA out-of-memory error in step {}", s.step);
            match last_phase {
                Some(p) => {
                    head.push_str(&format!(" ({}", p.phase.as_str()));
                    if p.micro_batch > 0 {
                        head.push_str(&format!(", micro-batch {}", p.micro_batch));
                    }
                    head.push(')');
                }
                None => head.push_str(" (before its first forward, between steps)"),
            }
            head
        }
        Died::Pass(p) => format!(
            "died of a CUDA out-of-memory error in {} after step {}",
            match p.kind {
                PassKind::Evaluation => "an evaluation pass",
                PassKind::Checkpoint => "a checkpoint save",
            },
            p.after_step
        ),
    };
    if let Some(b) = &batch {
        message.push_str(&format!(" on a batch of {}", b.batch.describe()));
    }
    if let Some(r) = requested {
        message.push_str(&format!(" requesting {}", gb(r as f64)));
    }
    if let (Some(a), Some(r)) = (allocated, reserved) {
        message.push_str(&format!(
            " with {} allocated and {} reserved",
            gb(a as f64),
            gb(r as f64)
        ));
    }
    let mut figures = Vec::new();
    if let Some(p) = nvml_peak {
        figures.push(format!(
            "the {}'s device peak {}",
            if pass.is_some() { "pass" } else { "step" },
            gb(p as f64)
        ));
    }
    if let Some(s) = steady_device {
        figures.push(format!("the steady peak {}", gb(s as f64)));
    }
    if let Some(p) = i.prediction {
        figures.push(format!("predicted {}", gb(p.predicted_peak_bytes as f64)));
    }
    if capacity > 0 {
        figures.push(format!("capacity {}", gb(capacity as f64)));
    }
    if !figures.is_empty() {
        message.push_str(&format!("; {}", figures.join(", ")));
    }
    message.push_str(&format!(". Cause: {}.", words.join("; ")));
    if !fit.is_empty() {
        message.push_str(&format!(" What would fit: {fit}."));
    }
    Some(PostMortem {
        step: step_number,
        phase: last_phase.map(|p| p.phase),
        micro_batch: last_phase.map_or(0, |p| p.micro_batch),
        cause,
        allocator: AllocatorAtOom {
            requested_bytes: requested,
            allocated_bytes: allocated,
            reserved_bytes: reserved,
            needed_allocated_bytes: needed,
            cached_free_bytes: cached_free,
            largest_free_block_bytes: largest_free,
        },
        before: PeaksBefore {
            step_nvml_peak_bytes: nvml_peak,
            steady_nvml_peak_bytes: steady_nvml,
            steady_allocated_peak_bytes: steady_alloc,
            predicted_peak_bytes: i.prediction.map(|p| p.predicted_peak_bytes),
            capacity_bytes: capacity,
        },
        outside: OutsideAllocator {
            outside_bytes: outside,
            outside_growth_bytes: outside_growth,
        },
        growth: GrowthAtOom {
            growth_bytes_per_step: growth_rate.map(|g| g.0),
            growth_source: growth_rate.map(|g| g.1),
        },
        batch,
        died_in_pass,
        message,
        what_would_fit: fit,
    })
}

/// The dying step's batch against the largest of the steps before it, and
/// what it needs by their relation.
fn batch_at_oom(
    batch: &BatchFacts,
    i: &PostMortemInputs<'_>,
    beyond: BeyondAllocator,
) -> BatchAtOom {
    let largest = i.largest_batch;
    let relation = i.trend.and_then(|t| t.batches.as_ref());
    let size = batch.size();
    let times = largest.and_then(|l| {
        let before = l.batch.size();
        let unit = BatchUnit::common([size, before].iter())?;
        let (now, then) = (size.measure(unit)?, before.measure(unit)?);
        (then > 0).then(|| now as f64 / then as f64)
    });
    let needs = relation
        .zip(largest)
        .and_then(|(r, l)| outlook(r, l, batch, i.capacity_bytes, beyond));
    let largest_that_can_fit = relation.zip(largest).and_then(|(r, l)| {
        let rate = r.bytes_per_unit.filter(|&b| b > 0.0)?;
        let seen = l.batch.size().measure(r.unit)?;
        let device = l.device_need_bytes(l.allocated_peak_bytes?, beyond)?;
        let units = seen as f64 + (i.capacity_bytes as f64 - device as f64) / rate;
        (i.capacity_bytes > 0 && units >= 0.0).then_some(units as u64)
    });
    BatchAtOom {
        batch: batch.clone(),
        largest_before: largest.cloned(),
        times_largest_before: times,
        needs,
        largest_that_can_fit,
        unit: relation.map(|r| r.unit),
    }
}

/// The words and what would fit for a step whose batch was larger than any
/// before it.
fn larger_batch_words(b: &BatchAtOom, capacity: u64) -> (String, String) {
    let mut w = format!(
        "a larger batch: this step's batch ({}) is {:.1}× the largest the steps fitted before it",
        b.batch.describe(),
        b.times_largest_before.unwrap_or(0.0),
    );
    if let Some(l) = &b.largest_before {
        w.push_str(&format!(" ({} at step {}", l.batch.describe(), l.step));
        if let Some(p) = l.allocated_peak_bytes {
            w.push_str(&format!(", allocated peak {}", gb(p as f64)));
        }
        w.push(')');
    }
    if let (Some(n), Some(unit)) = (&b.needs, b.unit) {
        w.push_str(&format!(
            "; by the steps' allocated peaks against their batches, this one needs {}{} \
             allocated",
            if n.at_least { "at least " } else { "about " },
            gb(n.allocated_peak_bytes as f64)
        ));
        if let Some(d) = n.device_peak_bytes {
            w.push_str(&format!(", {} of the device", gb(d as f64)));
        }
        if capacity > 0 {
            w.push_str(&format!(" against a capacity of {}", gb(capacity as f64)));
        }
        w.push_str(&format!(" ({} {})", n.size, unit.as_str()));
    }
    let mut fit = String::new();
    if let Some(l) = &b.largest_before {
        fit.push_str(&format!(
            "batches up to the largest the steps fitted ({} at step {}) fit",
            l.batch.describe(),
            l.step
        ));
        if let (Some(n), Some(unit)) = (b.largest_that_can_fit, b.unit) {
            fit.push_str(&format!(
                ", and none above {n} {} can by the same relation",
                unit.as_str()
            ));
        }
        fit.push_str("; ");
    }
    fit.push_str(
        "bound the loader's largest batch (a maximum length, batches bucketed by length or by \
         tokens), or split long batches into micro-batches; stepwatch.watch(largest_batch=...) \
         has the agent say during the run what the loader's largest batch needs",
    );
    (w, fit)
}

/// The words and what would fit for a pass that died.
fn pass_words(p: &PassAtOom, needed: Option<u64>, room: Option<u64>) -> (String, String) {
    let (what, name) = match p.kind {
        PassKind::Evaluation => ("an evaluation pass", "evaluation"),
        PassKind::Checkpoint => ("a checkpoint save", "checkpoint save"),
    };
    let mut w = format!("{what} after step {}", p.after_step);
    if let Some(n) = needed {
        w.push_str(&format!(
            " needed at least {} of allocator memory",
            gb(n as f64)
        ));
        if let Some(s) = p.steps_allocated_peak_bytes {
            w.push_str(&format!(
                " against the training steps' allocated peak {}",
                gb(s as f64)
            ));
        }
    }
    if let Some(h) = &p.highest_before {
        w.push_str(&format!(
            "; the highest {name} before it (after step {}) {}",
            h.after_step,
            h.allocated_peak_bytes.map_or("fitted".into(), |a| format!(
                "fitted with an allocated peak of {}",
                gb(a as f64)
            )),
        ));
    }
    // The pass's own share: what it needed beyond the training state it
    // began with, and how much of that the room left fits.
    let share = needed
        .zip(p.allocated_at_begin_bytes)
        .zip(room)
        .filter(|&((n, held), _)| n > held)
        .map(|((n, held), room)| {
            let fits = room.saturating_sub(held) as f64 / (n - held) as f64;
            (fits, room)
        });
    let fit = match (p.kind, share) {
        (PassKind::Evaluation, Some((fits, room))) => format!(
            "an evaluation that needs at most {} of allocator memory fits: an evaluation batch of \
             at most {:.0}% of this one's, less where the pass needs more after the allocation \
             that failed (under torch.no_grad(), activations grow with the batch)",
            gb(room as f64),
            (100.0 * fits).floor().min(100.0)
        ),
        (PassKind::Evaluation, None) => {
            "evaluate with a smaller batch, under torch.no_grad()".into()
        }
        (PassKind::Checkpoint, share) => format!(
            "{}save from the state as it is (torch.save(model.state_dict())), or copy tensors to \
             the host one at a time rather than cloning the state on the device",
            share.map_or(String::new(), |(_, room)| format!(
                "a save that needs at most {} of allocator memory fits: ",
                gb(room as f64)
            ))
        ),
    };
    (w, fit)
}

fn growth_words(
    slope: &Slope,
    source: GrowthSource,
    used: f64,
    steady_headroom: Option<u64>,
) -> String {
    let mut w = format!(
        "growth: {} grew by {:.1} MB per step (measured over steps {}–{})",
        source.describe(),
        slope.bytes_per_step / 1e6,
        slope.first_step,
        slope.last_step,
    );
    if let Some(h) = steady_headroom {
        w.push_str(&format!(
            ", using {} of the {} of headroom the steady steps left",
            gb(used.min(h as f64)),
            gb(h as f64)
        ));
    }
    w
}

/// What would fit, from the prediction's own remedies.
fn first_steps_fit(p: &Prediction) -> String {
    let mut ways = vec![format!(
        "a GPU with at least {} for this rank",
        gb(p.predicted_rank_peak_bytes as f64)
    )];
    if let Some(w) = &p.what_would_fit {
        if let Some(m) = w.fits_with_micro_batch_size {
            ways.push(format!("a micro-batch of at most {m}"));
        }
        if let Some(f) = w.fits_with_sharding_factor {
            ways.push(format!("optimizer state sharded {f} ways"));
        }
    }
    ways.join(", or ")
}
