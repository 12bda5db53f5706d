//! Validation errors. Each has a short `reason()` used as the
//! `stepwatch_markers_rejected_total{reason}` label value, and a Display text
//! that is sent back to the client in the gRPC status.

use thiserror::Error;

use crate::marker::MarkerKind;

/// A hello that breaks the contract.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HelloError {
    /// A required identifier (named here) is empty; the rank could not be keyed.
    #[error("{0} must not be empty")]
    Empty(&'static str),
    /// An identifier is too long to be a sane Prometheus label value.
    #[error("{field} is {len} bytes; at most {max} are allowed")]
    TooLong {
        /// The offending hello field.
        field: &'static str,
        /// Its length, in bytes.
        len: usize,
        /// The field's bound: 128, or 253 for a pod or node name.
        max: usize,
    },
    /// An identifier has a character that labels and JSON should not carry.
    #[error("{field} contains {bad:?}; allowed are ASCII letters, digits and ._:/@+-")]
    Charset {
        /// The offending hello field.
        field: &'static str,
        /// The first disallowed character.
        bad: char,
    },
    /// `world_size` is 0 or absurdly large; it bounds the ranks checked next.
    #[error("world_size {0} is outside 1..=65536")]
    WorldSize(u32),
    /// A rank that cannot exist in a job of this size.
    #[error("{field} {value} is not below world_size {world_size}")]
    RankOutOfRange {
        /// `rank` or `local_rank`.
        field: &'static str,
        /// The value reported.
        value: u32,
        /// The job's reported world size.
        world_size: u32,
    },
    /// Model facts that contradict themselves; they would mislead the
    /// predictor, so the hello is refused rather than trusted.
    #[error("model facts: {0}")]
    Model(&'static str),
}

impl HelloError {
    /// Label value for the rejection counter.
    pub fn reason(&self) -> &'static str {
        match self {
            HelloError::RankOutOfRange { .. } | HelloError::WorldSize(_) => "rank_out_of_range",
            _ => "bad_identity",
        }
    }
}

/// A marker that breaks the contract for its rank.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MarkerError {
    /// The client sent the protobuf default kind, which means nothing.
    #[error("marker kind is unspecified")]
    UnspecifiedKind,
    /// Step 0 was sent; steps count from 1, so step-1 logic would misfire.
    #[error("step must be at least 1, got 0")]
    StepZero,
    /// A step number at or below one already seen for this rank.
    #[error("step {got} does not follow step {last}; steps must increase per rank")]
    StepRegressed {
        /// The latest step seen so far.
        last: u64,
        /// The step number received.
        got: u64,
    },
    /// A marker kind that cannot come after the previous one in a step.
    #[error("{kind} cannot follow {after} within a step")]
    OutOfOrder {
        /// The marker received.
        kind: &'static str,
        /// The marker it followed.
        after: &'static str,
    },
    /// A phase marker with no open step to attach it to.
    #[error("{kind} for step {step} arrived before its step_begin")]
    NoOpenStep {
        /// The marker received.
        kind: &'static str,
        /// The step it named.
        step: u64,
    },
    /// A marker older than the previous one; phases would get negative
    /// durations and wrong GPU samples.
    #[error("monotonic clock went backwards: {got} ns after {last} ns")]
    ClockRegressed {
        /// The previous marker's monotonic time, ns.
        last: u64,
        /// This marker's monotonic time, ns.
        got: u64,
    },
    /// The batch's markers are far ahead of the process's clock as the
    /// rank's earlier batches showed it (see `clock`): one jumped marker
    /// would otherwise make every later one "older" and refused.
    #[error("the batch is {ahead_ns} ns ahead of this process's monotonic clock as its earlier batches showed it (a clock jump); it is refused and later batches are taken")]
    ClockJumped {
        /// How far ahead, ns.
        ahead_ns: u64,
        /// The step of the batch's first marker.
        step: u64,
    },
    /// An evaluation or checkpoint marker where none can be: a pass
    /// begun inside an open step, or naming a step other than the last
    /// begun, or an end without its begin.
    #[error("{kind} for step {step}: {why}")]
    PassMisplaced {
        /// The marker received.
        kind: &'static str,
        /// The step it named.
        step: u64,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A step kept opening phases past the bound that keeps memory finite.
    #[error("step {step} has more than {limit} phases")]
    TooManyPhases {
        /// The step that overflowed.
        step: u64,
        /// The per-step phase limit.
        limit: usize,
    },
    /// A number no real client sends (a step, a clock reading or a size
    /// past the plausibility limits in `marker`); refused before
    /// it can overflow anything downstream.
    #[error("{field} = {value} is beyond what any client sends (at most {limit})")]
    Implausible {
        /// The marker field.
        field: &'static str,
        /// The value received.
        value: u64,
        /// The limit it broke.
        limit: u64,
    },
    /// The agent's memory budget is spent, no rank has a step left to
    /// give up (each keeps step 1 and its current step), no finished rank
    /// is left to give way, and the rank's namespace holds its share.
    #[error("the agent's step-history budget ({budget_bytes} bytes) is spent and namespace {namespace:?} holds its share ({share_bytes} bytes) or more; markers that add phases are refused until ranks finish")]
    MemoryBudget {
        /// The budget, bytes.
        budget_bytes: u64,
        /// The namespace of the refused rank.
        namespace: String,
        /// Its share of the budget, bytes.
        share_bytes: u64,
    },
    /// The batch came on a stream of a run its process has since left for
    /// a newer one on the same rank (a second `fit()` while the first
    /// run's stream was still open): applied, it would land in the newer
    /// run's step 1. See [`crate::Tracker::run_markers`].
    #[error(
        "run {stream_run:?} of this stream has ended: run {rank_run:?} of the same process \
         has since started on the rank, so this stream's markers, facts and traces are refused"
    )]
    RunEnded {
        /// The run the stream's hello named.
        stream_run: String,
        /// The rank's current run.
        rank_run: String,
    },
}

impl MarkerError {
    /// Label value for the rejection counter.
    pub fn reason(&self) -> &'static str {
        match self {
            MarkerError::UnspecifiedKind => "unspecified_kind",
            MarkerError::StepZero | MarkerError::StepRegressed { .. } => "step_regressed",
            MarkerError::NoOpenStep { .. } => "no_open_step",
            MarkerError::OutOfOrder { .. } | MarkerError::PassMisplaced { .. } => "out_of_order",
            MarkerError::ClockRegressed { .. } => "clock_regressed",
            MarkerError::ClockJumped { .. } => "clock_jumped",
            MarkerError::TooManyPhases { .. } => "too_many_phases",
            MarkerError::MemoryBudget { .. } => "memory_budget",
            MarkerError::Implausible { .. } => "implausible_value",
            MarkerError::RunEnded { .. } => "run_ended",
        }
    }

    /// Whether the refusal is of the stream's run itself
    /// ([`MarkerError::RunEnded`]): nothing that run sends will be
    /// accepted again, so its client should stop rather than reconnect
    /// (as [`crate::OpenError::refuses_the_run`] for a hello).
    pub fn refuses_the_run(&self) -> bool {
        matches!(self, MarkerError::RunEnded { .. })
    }
}

/// Convenience for messages that name a marker kind.
pub(crate) fn kind_name(kind: MarkerKind) -> &'static str {
    kind.as_str()
}
