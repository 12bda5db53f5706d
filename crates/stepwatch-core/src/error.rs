//! Validation errors. Each has a short `reason()` used as the
//! `stepwatch_markers_rejected_total{reason}` label value, and a Display text
//! that is sent back to the client in the gRPC status.

use thiserror::Error;

use crate::marker::MarkerKind;

/// A hello that breaks the contract.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HelloError {
    #[error("{0} must not be empty")]
    Empty(&'static str),
    #[error("{field} is {len} bytes; at most 128 are allowed")]
    TooLong { field: &'static str, len: usize },
    #[error("{field} contains {bad:?}; allowed are ASCII letters, digits and ._:/@+-")]
    Charset { field: &'static str, bad: char },
    #[error("world_size {0} is outside 1..=65536")]
    WorldSize(u32),
    #[error("{field} {value} is not below world_size {world_size}")]
    RankOutOfRange {
        field: &'static str,
        value: u32,
        world_size: u32,
    },
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
    #[error("marker kind is unspecified")]
    UnspecifiedKind,
    #[error("step must be at least 1, got 0")]
    StepZero,
    #[error("step {got} does not follow step {last}; steps must increase per rank")]
    StepRegressed { last: u64, got: u64 },
    #[error("{kind} cannot follow {after} within a step")]
    OutOfOrder {
        kind: &'static str,
        after: &'static str,
    },
    #[error("{kind} for step {step} arrived before its step_begin")]
    NoOpenStep { kind: &'static str, step: u64 },
    #[error("monotonic clock went backwards: {got} ns after {last} ns")]
    ClockRegressed { last: u64, got: u64 },
    #[error("step {step} has more than {limit} phases")]
    TooManyPhases { step: u64, limit: usize },
}

impl MarkerError {
    /// Label value for the rejection counter.
    pub fn reason(&self) -> &'static str {
        match self {
            MarkerError::UnspecifiedKind => "unspecified_kind",
            MarkerError::StepZero | MarkerError::StepRegressed { .. } => "step_regressed",
            MarkerError::NoOpenStep { .. } => "no_open_step",
            MarkerError::OutOfOrder { .. } => "out_of_order",
            MarkerError::ClockRegressed { .. } => "clock_regressed",
            MarkerError::TooManyPhases { .. } => "too_many_phases",
        }
    }
}

/// Convenience for messages that name a marker kind.
pub(crate) fn kind_name(kind: MarkerKind) -> &'static str {
    kind.as_str()
}
