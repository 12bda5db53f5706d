//! The stepwatch step model.
//!
//! Feed it hellos, markers and GPU samples; read step timelines, profiles and
//! predictions back. It is pure and deterministic: no clock (time is always
//! an argument), no I/O, no threads, so every result can be reproduced in a
//! test from the same inputs.

#![warn(missing_docs)]

// Two modules are public as namespaces of their own: the allocator model
// (the simulator and the wire conversion build on it) and the input path
// (`feed`: every caller describes its inputs the same way). The rest is
// re-exported below, item by item.
mod advisory;
pub mod allocator;
mod analysis;
mod batch;
pub mod clock;
mod divergence;
mod downsample;
mod error;
pub mod feed;
mod fit;
mod growth;
mod identity;
mod layout;
mod marker;
mod overhead;
mod pass;
mod postmortem;
mod predict;
mod profile;
mod record;
mod replay;
mod sample;
mod slope;
mod timeline;
mod tracker;
mod units;

pub use advisory::{
    due, growth_due, observed_headroom_due, retries_due, retry_growth, Advisory, AdvisoryKind,
    ObservedPeak, RetryGrowth, FIRST_RETRY_STEP, WORSENED_FRACTION,
};
pub use analysis::{
    activation_plateau, analyze_rank, steady_nvml_peak, steady_profile, steady_state,
    ActivationPlateau, AnalysisConfig, FirstStepAnomaly, OptimizerJumps, RankAnalysis, RankInputs,
    SteadyNvmlPeak, SteadyState,
};
pub use batch::{
    outlook, BatchOutlook, BatchPoint, BatchRelation, BatchSize, BatchUnit, BeyondAllocator,
    LargestBatch, StepBatches,
};
pub use divergence::{
    activation_peak_bytes, divergence, ActivationPeak, Divergence, DivergenceFigure, NamedOutlier,
    Outlier, PeakSource, RankFigures, Spread,
};
pub use downsample::{bucket_width_ns, downsample_min_max, MinMaxBucket};
pub use error::{HelloError, MarkerError};
pub use feed::{RecordEntry, RecordError};
pub use fit::{BindingTerm, WhatWouldFit};
pub use growth::{
    forecast, grows, GrowthConfig, GrowthForecast, GrowthSource, MemoryTrend, StepFigures,
    TrailingPeaks, RECHECK_STEPS,
};
pub use identity::{
    DdpBucketRebuild, ModelFacts, OptimizerImplementation, OptimizerKind, Precision, RankInfo,
    RankKey,
};
pub use layout::{
    step2_new_segments, step2_new_segments_with, LayoutContext, LayoutEstimate, MAX_LAYOUT_BLOCKS,
};
pub use marker::{
    AllocatorStats, BatchFacts, DeviceMemory, Marker, MarkerKind, PassKind, PhaseKind,
    MAX_BATCH_DIMS, MAX_PLAUSIBLE_BYTES,
};
pub use pass::{pass_peaks, PassFigures, PassPeaks};
pub use postmortem::{
    post_mortem, AllocatorAtOom, BatchAtOom, Died, GrowthAtOom, OomCause, OomReport,
    OomReportError, OomSegment, OutsideAllocator, PassAtOom, PeaksBefore, PostMortem,
    PostMortemInputs, MAX_OOM_MESSAGE_BYTES, MAX_OOM_SEGMENTS,
};
pub use predict::{
    predict, BasisLimit, GradInputs, GradsSource, LayoutInputs, LayoutSetAside, LiveStep,
    OverheadInputs, OverheadSource, PredictConfig, PredictFrom, Prediction, PredictionBasis,
    PredictionInputs, ReservedInputs, StateInputs, StateSource, StepOneExtras, StepOnePeaks,
    WarningRevision,
};
pub use profile::{
    median_f64, median_u64, phase_allocator_peak_bounds, phase_allocator_peaks, AllocatorPeaks,
    PeakBounds, PhaseProfile, SteadyPhaseProfile, SteadyProfile, StepProfile,
};
pub use record::{PredictionCheck, Replayer};
pub use replay::{
    replay_optimizer_layouts, replay_step2, replay_step2_with, replay_step2_within,
    AllocatorAction, AllocatorEvent, AllocatorTrace, Gradients, LimitedReplay, OptimizerBoundary,
    ReplayedBucketRebuild, ReplayedStepLayouts, Step2Replay, TraceError, TraceSettings,
    MAX_EVENT_BYTES, MAX_TRACE_BLOCKS, MAX_TRACE_EVENTS, REPLAYED_STEPS,
};
pub use sample::GpuSample;
pub use slope::{seasonal_theil_sen, theil_sen, Slope};
pub use timeline::{
    PassOutcome, PassRecord, PhaseRecord, RankTimeline, SampleEdges, SampleStats, StepOutcome,
    StepRecord, BEFORE_BEGIN_WINDOW_NS, MAX_PHASES_PER_STEP, MAX_RETAINED_PASSES,
};
pub use tracker::{
    Journal, LayoutCounts, OpenError, Opened, RankState, Tracker, TrackerConfig, MAX_ENDED_RUNS,
};
pub use units::gb;
