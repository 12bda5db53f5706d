//! The stepwatch step model.
//!
//! Feed it hellos, markers and GPU samples; read step timelines, profiles and
//! predictions back. It is pure and deterministic: no clock (time is always
//! an argument), no I/O, no threads, so every result can be reproduced in a
//! test from the same inputs.

pub mod error;
pub mod identity;
pub mod marker;
pub mod timeline;
pub mod tracker;

pub use error::{HelloError, MarkerError};
pub use identity::{ModelFacts, OptimizerKind, Precision, RankInfo, RankKey};
pub use marker::{AllocatorStats, Marker, MarkerKind, PhaseKind};
pub use timeline::{PhaseRecord, RankTimeline, SampleStats, StepOutcome, StepRecord};
pub use tracker::{GpuSample, OpenError, RankState, Tracker, TrackerConfig};
