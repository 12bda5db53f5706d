//! Advisories: what the agent tells a training process about itself.
//!
//! The important one is raised during step 1: "the predicted steady-state
//! peak exceeds capacity; step 2 will likely run out of memory". Deciding
//! when an advisory is due is part of the model (pure and testable); sending
//! it is the ingest adapter's job.

use serde::{Deserialize, Serialize};

use crate::predict::Prediction;

/// What an advisory is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvisoryKind {
    /// The predicted steady-state peak does not fit on the GPU.
    Step2OomPredicted,
    /// It fits, with less than the low-headroom fraction to spare.
    LowHeadroom,
}

/// One advisory, as issued.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Advisory {
    /// Decides the wording and whether it is already issued (one per kind).
    pub kind: AdvisoryKind,
    /// The step during which it was issued.
    pub step: u64,
    /// When it was issued (the caller's clock, CLOCK_MONOTONIC in the agent).
    pub issued_monotonic_ns: u64,
    /// Predicted steady-state peak as NVML will see it, bytes.
    pub predicted_peak_bytes: u64,
    /// GPU capacity the peak was compared with, bytes.
    pub capacity_bytes: u64,
    /// Capacity minus predicted peak, bytes; negative means step 2 will not fit.
    pub predicted_headroom_bytes: i64,
    /// A sentence a person understands.
    pub message: String,
}

/// The advisories `prediction` calls for that are not in `issued` yet.
/// Each kind is issued once per rank timeline, and only while the rank is
/// still in its first step: after that, the steps speak for themselves.
pub fn due(
    prediction: &Prediction,
    capacity_bytes: u64,
    step: u64,
    now_ns: u64,
    issued: &[Advisory],
) -> Vec<Advisory> {
    let Some(headroom) = prediction.headroom_bytes else {
        return Vec::new();
    };
    let kind = if prediction.oom_risk {
        AdvisoryKind::Step2OomPredicted
    } else if prediction.low_headroom {
        AdvisoryKind::LowHeadroom
    } else {
        return Vec::new();
    };
    if issued.iter().any(|a| a.kind == kind) {
        return Vec::new();
    }
    let gb = |b: f64| b / 1e9;
    let message = match kind {
        AdvisoryKind::Step2OomPredicted => format!(
            "predicted steady-state peak {:.2} GB exceeds capacity {:.2} GB by {:.2} GB; \
             step 2 will likely run out of GPU memory (lower the micro-batch, enable activation \
             recomputation, or shard optimizer state)",
            gb(prediction.predicted_peak_bytes as f64),
            gb(capacity_bytes as f64),
            gb(-headroom as f64),
        ),
        AdvisoryKind::LowHeadroom => format!(
            "predicted steady-state peak {:.2} GB leaves only {:.2} GB ({:.1}%) of {:.2} GB free; \
             step 2 may run out of memory if anything else allocates",
            gb(prediction.predicted_peak_bytes as f64),
            gb(headroom as f64),
            100.0 * headroom as f64 / capacity_bytes.max(1) as f64,
            gb(capacity_bytes as f64),
        ),
    };
    vec![Advisory {
        kind,
        step,
        issued_monotonic_ns: now_ns,
        predicted_peak_bytes: prediction.predicted_peak_bytes,
        capacity_bytes,
        predicted_headroom_bytes: headroom,
        message,
    }]
}
