//! The stepwatch step model.
//!
//! Feed it hellos, markers and GPU samples; read step timelines, profiles and
//! predictions back. It is pure and deterministic: no clock (time is always
//! an argument), no I/O, no threads, so every result can be reproduced in a
//! test from the same inputs.

#![warn(missing_docs)]

pub mod advisory;
pub mod allocator;
pub mod analysis;
pub mod divergence;
pub mod downsample;
pub mod error;
pub mod feed;
pub mod fit;
pub mod identity;
pub mod layout;
pub mod marker;
pub mod predict;
pub mod profile;
pub mod record;
pub mod replay;
pub mod sample;
pub mod timeline;
pub mod tracker;

pub use advisory::{Advisory, AdvisoryKind};
pub use analysis::{
    activation_plateau, analyze_rank, steady_nvml_peak, steady_profile, steady_state,
    ActivationPlateau, AnalysisConfig, FirstStepAnomaly, RankAnalysis, RankInputs, SteadyNvmlPeak,
    SteadyState, StepOneExtras,
};
pub use divergence::{
    activation_peak_bytes, divergence, ActivationPeak, Divergence, DivergenceFigure, NamedOutlier,
    Outlier, PeakSource, RankFigures, Spread,
};
pub use downsample::{bucket_width_ns, downsample_min_max, MinMaxBucket};
pub use error::{HelloError, MarkerError};
pub use identity::{
    DdpBucketRebuild, ModelFacts, OptimizerImplementation, OptimizerKind, Precision, RankInfo,
    RankKey,
};
pub use layout::{
    step2_new_segments, step2_new_segments_with, LayoutContext, LayoutEstimate, MAX_LAYOUT_BLOCKS,
};
pub use marker::{AllocatorStats, DeviceMemory, Marker, MarkerKind, PhaseKind};
pub use predict::{
    predict, predict_with, predict_with_layout, BasisLimit, BindingTerm, GradsSource,
    LayoutSetAside, LiveStep, OverheadSource, PredictConfig, Prediction, PredictionBasis,
    PredictionInputs, StateSource, WarningRevision,
};
pub use profile::{
    median_f64, median_u64, phase_allocator_peak_bounds, phase_allocator_peaks, PeakBounds,
    PhaseProfile, SteadyPhaseProfile, SteadyProfile, StepProfile,
};
pub use record::{PredictionCheck, RecordEntry, RecordError, Replayer};
pub use replay::{
    replay_optimizer_layouts, replay_step2, replay_step2_with, replay_step2_within,
    AllocatorAction, AllocatorEvent, AllocatorTrace, Gradients, LimitedReplay, OptimizerBoundary,
    ReplayedBucketRebuild, ReplayedStepLayouts, Step2Replay, TraceError, TraceSettings,
};
pub use sample::GpuSample;
pub use timeline::{PhaseRecord, RankTimeline, SampleEdges, SampleStats, StepOutcome, StepRecord};
pub use tracker::{
    Journal, LayoutCounts, OpenError, Opened, RankState, Tracker, TrackerConfig, MAX_ENDED_RUNS,
};
