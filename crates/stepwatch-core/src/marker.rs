//! Markers (phase events from a training rank) and the phases they bound.

use serde::{Deserialize, Serialize};

use crate::allocator::SegmentLayout;

/// The event a marker records. The order of the variants is the order in
/// which they occur within one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MarkerKind {
    /// A step starts; opens the prologue.
    StepBegin,
    /// A forward pass (one per micro-batch) starts.
    ForwardBegin,
    /// A backward pass starts; gradients appear from here on.
    BackwardBegin,
    /// `optimizer.step()` starts; lazily created state appears in this phase.
    OptimizerBegin,
    /// `optimizer.step()` has returned; opens the epilogue.
    OptimizerEnd,
    /// The step finished normally; closes it.
    StepEnd,
    /// The step died with a CUDA out-of-memory error; ends the step.
    Oom,
    /// An evaluation pass begins between steps (see [`PassKind`]).
    EvalBegin,
    /// The evaluation pass ends.
    EvalEnd,
    /// A checkpoint save begins between steps.
    CheckpointBegin,
    /// The checkpoint save ends.
    CheckpointEnd,
}

impl MarkerKind {
    /// The markers of one step with one micro-batch, in the order a
    /// training loop sends them (no `Oom`: it ends a step instead of
    /// `StepEnd`). One list for the tests, the simulator's checks and the
    /// load generators that drive a rank step by step.
    pub const STEP_ORDER: [MarkerKind; 6] = [
        MarkerKind::StepBegin,
        MarkerKind::ForwardBegin,
        MarkerKind::BackwardBegin,
        MarkerKind::OptimizerBegin,
        MarkerKind::OptimizerEnd,
        MarkerKind::StepEnd,
    ];

    /// The phase this marker opens, if any. `StepEnd` and `Oom` close a step
    /// and open nothing.
    pub fn opens(self) -> Option<PhaseKind> {
        match self {
            MarkerKind::StepBegin => Some(PhaseKind::Prologue),
            MarkerKind::ForwardBegin => Some(PhaseKind::Forward),
            MarkerKind::BackwardBegin => Some(PhaseKind::Backward),
            MarkerKind::OptimizerBegin => Some(PhaseKind::Optimizer),
            MarkerKind::OptimizerEnd => Some(PhaseKind::Epilogue),
            MarkerKind::StepEnd
            | MarkerKind::Oom
            | MarkerKind::EvalBegin
            | MarkerKind::EvalEnd
            | MarkerKind::CheckpointBegin
            | MarkerKind::CheckpointEnd => None,
        }
    }

    /// The pass this marker begins or ends, as (kind, begins); None for a
    /// step's markers.
    pub fn pass(self) -> Option<(PassKind, bool)> {
        match self {
            MarkerKind::EvalBegin => Some((PassKind::Evaluation, true)),
            MarkerKind::EvalEnd => Some((PassKind::Evaluation, false)),
            MarkerKind::CheckpointBegin => Some((PassKind::Checkpoint, true)),
            MarkerKind::CheckpointEnd => Some((PassKind::Checkpoint, false)),
            _ => None,
        }
    }

    /// Stable snake_case name, used in logs and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            MarkerKind::StepBegin => "step_begin",
            MarkerKind::ForwardBegin => "forward_begin",
            MarkerKind::BackwardBegin => "backward_begin",
            MarkerKind::OptimizerBegin => "optimizer_begin",
            MarkerKind::OptimizerEnd => "optimizer_end",
            MarkerKind::StepEnd => "step_end",
            MarkerKind::Oom => "oom",
            MarkerKind::EvalBegin => "eval_begin",
            MarkerKind::EvalEnd => "eval_end",
            MarkerKind::CheckpointBegin => "checkpoint_begin",
            MarkerKind::CheckpointEnd => "checkpoint_end",
        }
    }
}

/// Work between training steps that is not a step: its memory has a shape
/// of its own (no gradients or optimizer, often a larger batch), so its
/// peaks are kept apart from the steps' and feed no step figure, trend or
/// prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PassKind {
    /// An evaluation (validation) pass: forwards without gradients.
    Evaluation,
    /// A checkpoint save.
    Checkpoint,
}

impl PassKind {
    /// Every pass kind, in the order metrics list them.
    pub const ALL: [PassKind; 2] = [PassKind::Evaluation, PassKind::Checkpoint];

    /// Stable label value for metrics and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            PassKind::Evaluation => "evaluation",
            PassKind::Checkpoint => "checkpoint",
        }
    }
}

/// A phase is the interval between two consecutive markers of one step,
/// named after the marker that opens it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseKind {
    /// Step begin to the first forward: data loading, zero_grad.
    Prologue,
    /// Forward pass of one micro-batch: activations build up.
    Forward,
    /// Backward pass of one micro-batch: activations are freed, gradients made.
    Backward,
    /// `optimizer.step()`: where step 1 creates optimizer state.
    Optimizer,
    /// Optimizer end to step end: logging, LR schedulers.
    Epilogue,
}

impl PhaseKind {
    /// Every phase kind, in step order; metric exporters iterate this.
    pub const ALL: [PhaseKind; 5] = [
        PhaseKind::Prologue,
        PhaseKind::Forward,
        PhaseKind::Backward,
        PhaseKind::Optimizer,
        PhaseKind::Epilogue,
    ];

    /// The marker that opens this phase: the inverse of [`MarkerKind::opens`]
    /// (how the wire names an allocator event's phase, and which marker a
    /// step's open phase began with).
    pub fn opened_by(self) -> MarkerKind {
        match self {
            PhaseKind::Prologue => MarkerKind::StepBegin,
            PhaseKind::Forward => MarkerKind::ForwardBegin,
            PhaseKind::Backward => MarkerKind::BackwardBegin,
            PhaseKind::Optimizer => MarkerKind::OptimizerBegin,
            PhaseKind::Epilogue => MarkerKind::OptimizerEnd,
        }
    }

    /// Stable label value for metrics and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            PhaseKind::Prologue => "prologue",
            PhaseKind::Forward => "forward",
            PhaseKind::Backward => "backward",
            PhaseKind::Optimizer => "optimizer",
            PhaseKind::Epilogue => "epilogue",
        }
    }
}

/// Figures from `torch.cuda.memory_stats()` carried by a marker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorStats {
    /// `allocated_bytes.all.current`: bytes live in tensors now.
    pub allocated_bytes: u64,
    /// `allocated_bytes.all.peak` since the last peak reset; lets a phase's
    /// peak be recovered from its boundaries.
    pub allocated_peak_bytes: u64,
    /// `reserved_bytes.all.current`: bytes the caching allocator holds from
    /// CUDA, which is what NVML sees.
    pub reserved_bytes: u64,
    /// `reserved_bytes.all.peak` since the last peak reset.
    pub reserved_peak_bytes: u64,
    /// `active_bytes.all.current`: allocated plus blocks awaiting stream sync.
    pub active_bytes: u64,
    /// `active_bytes.all.peak` since the last peak reset.
    pub active_peak_bytes: u64,
    /// `num_alloc_retries`: allocations that needed a cache flush and retry;
    /// a rise is an early sign of memory pressure.
    pub num_alloc_retries: u64,
}

/// Largest byte figure a client may report: 1 PiB, beyond any GPU's (or
/// node's) memory. Client numbers flow into sums and products; bounding
/// them at the edge keeps every one of those far from overflow.
pub const MAX_PLAUSIBLE_BYTES: u64 = 1 << 50;
/// Largest step number: 2^48, a step a second for eight million years.
pub const MAX_PLAUSIBLE_STEP: u64 = 1 << 48;
/// Largest CLOCK_MONOTONIC reading, ns: 2^62, about 146 years of uptime.
pub const MAX_PLAUSIBLE_MONOTONIC_NS: u64 = 1 << 62;

/// Most dimensions a batch's shape may have.
pub const MAX_BATCH_DIMS: usize = 8;

/// A batch's size as the client knows it; every field optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchFacts {
    /// Samples (sequences, images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u64>,
    /// Tokens (samples times padded sequence length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// The shape of the batch's main input tensor.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shape: Vec<u64>,
}

impl BatchFacts {
    /// Whether it says nothing (what an empty message on the wire is).
    pub fn is_empty(&self) -> bool {
        self.samples.is_none() && self.tokens.is_none() && self.shape.is_empty()
    }

    /// The first figure that cannot be right, as (field, value, limit): a
    /// count above 2^48, more than [`MAX_BATCH_DIMS`] dimensions, or a
    /// shape of more than 2^50 elements.
    pub fn implausible(&self) -> Option<(&'static str, u64, u64)> {
        for (field, value) in [
            ("batch.samples", self.samples),
            ("batch.tokens", self.tokens),
        ] {
            if let Some(v) = value.filter(|&v| v > MAX_PLAUSIBLE_STEP) {
                return Some((field, v, MAX_PLAUSIBLE_STEP));
            }
        }
        if self.shape.len() > MAX_BATCH_DIMS {
            return Some((
                "batch.shape (dimensions)",
                self.shape.len() as u64,
                MAX_BATCH_DIMS as u64,
            ));
        }
        let elements = self
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX);
        (elements > MAX_PLAUSIBLE_BYTES).then_some((
            "batch.shape (elements)",
            elements,
            MAX_PLAUSIBLE_BYTES,
        ))
    }

    /// How a person reads it, e.g. "8 samples, 16384 tokens, shape 8×2048".
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(n) = self.samples {
            parts.push(format!("{n} samples"));
        }
        if let Some(n) = self.tokens {
            parts.push(format!("{n} tokens"));
        }
        if !self.shape.is_empty() {
            let dims: Vec<String> = self.shape.iter().map(u64::to_string).collect();
            parts.push(format!("shape {}", dims.join("×")));
        }
        parts.join(", ")
    }
}

impl AllocatorStats {
    /// The first field above [`MAX_PLAUSIBLE_BYTES`], as (name, value).
    pub fn implausible(&self) -> Option<(&'static str, u64)> {
        [
            ("allocated_bytes", self.allocated_bytes),
            ("allocated_peak_bytes", self.allocated_peak_bytes),
            ("reserved_bytes", self.reserved_bytes),
            ("reserved_peak_bytes", self.reserved_peak_bytes),
            ("active_bytes", self.active_bytes),
            ("active_peak_bytes", self.active_peak_bytes),
            ("num_alloc_retries", self.num_alloc_retries),
        ]
        .into_iter()
        .find(|&(_, v)| v > MAX_PLAUSIBLE_BYTES)
    }
}

/// The device's memory as the CUDA driver reports it at a marker
/// (`cudaMemGetInfo`, `torch.cuda.mem_get_info()`), on the process's current
/// device. Exact at the marker's instant, where NVML is only sampled between
/// markers; with the marker's allocator figures it gives the memory outside
/// the process's caching allocator exactly (see `predict`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// Free device memory, bytes.
    pub free_bytes: u64,
    /// Memory processes can use, bytes (the driver's reserved memory is not
    /// in it on NVIDIA GPUs: about NVML's total minus reserved).
    pub total_bytes: u64,
}

impl DeviceMemory {
    /// What every process holds on the device: total − free.
    pub fn used_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.free_bytes)
    }

    /// The first figure that cannot be right, as (name, value, limit): a
    /// byte figure above [`MAX_PLAUSIBLE_BYTES`], or more free than total.
    pub fn implausible(&self) -> Option<(&'static str, u64, u64)> {
        if self.total_bytes > MAX_PLAUSIBLE_BYTES {
            return Some((
                "device_memory.total_bytes",
                self.total_bytes,
                MAX_PLAUSIBLE_BYTES,
            ));
        }
        (self.free_bytes > self.total_bytes).then_some((
            "device_memory.free_bytes",
            self.free_bytes,
            self.total_bytes,
        ))
    }
}

/// One phase event of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// Which event this is; decides the phase it opens or closes.
    pub kind: MarkerKind,
    /// Optimizer step number; the first step is 1.
    pub step: u64,
    /// CLOCK_MONOTONIC ns, shared with the agent's GPU samples.
    pub monotonic_ns: u64,
    /// Wall clock ns since the Unix epoch, for display and stall detection.
    pub wall_ns: u64,
    /// Micro-batch index within the step (gradient accumulation).
    pub micro_batch: u32,
    /// Allocator figures at this moment; None without CUDA. Needed for the
    /// allocator-basis prediction.
    pub allocator: Option<AllocatorStats>,
    /// The allocator's segments at this moment, sent by clients without an
    /// allocator trace on step 1's optimizer begin and end only: what the
    /// optimizer state was carved out of (see `layout`). Empty
    /// otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layout_segments: Vec<SegmentLayout>,
    /// The device's memory at this moment (`cudaMemGetInfo`); the Python
    /// client sends it at step 1's markers and at OOM markers only. With
    /// `allocator`, it measures the memory outside the allocator exactly.
    #[serde(default)]
    pub device_memory: Option<DeviceMemory>,
    /// The micro-batch this marker begins, when the client saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchFacts>,
}

impl Marker {
    /// A marker with its kind, step and clocks, and nothing else (first
    /// micro-batch, no allocator figures). Builders start here and fill the
    /// rest with struct update syntax, so a new optional field is added in
    /// one place.
    pub fn at(kind: MarkerKind, step: u64, monotonic_ns: u64, wall_ns: u64) -> Marker {
        Marker {
            kind,
            step,
            monotonic_ns,
            wall_ns,
            micro_batch: 0,
            allocator: None,
            layout_segments: Vec::new(),
            device_memory: None,
            batch: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_in_order_opens_every_phase_once_then_ends() {
        let opened: Vec<PhaseKind> = MarkerKind::STEP_ORDER
            .iter()
            .filter_map(|k| k.opens())
            .collect();
        assert_eq!(opened, PhaseKind::ALL);
        assert_eq!(MarkerKind::STEP_ORDER.last(), Some(&MarkerKind::StepEnd));
    }

    #[test]
    fn each_phase_is_opened_by_the_marker_that_opens_it() {
        for phase in PhaseKind::ALL {
            assert_eq!(phase.opened_by().opens(), Some(phase));
        }
    }
}
