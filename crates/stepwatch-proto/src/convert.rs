//! The wire's messages in the step model's terms, and back: the one place
//! where `stepwatch.v1` meets `stepwatch_core`.
//!
//! One pair of functions per message, `<message>_to_wire` and
//! `<message>_from_wire`, side by side, so a field added to the contract is
//! added to both here (and the round-trip test in `tests/convert.rs` fails
//! until it is). The agent reads with the `_from_wire` half; the simulator's
//! client and the tests write with the `_to_wire` half.
//!
//! Reading is strict where a value the step model needs has no meaning: a
//! marker or trace event with an unspecified or unknown kind, action or
//! phase is a [`WireError`] that names it. It is lenient where the value is
//! optional: an unknown optimizer, precision or implementation in the model
//! facts reads as unknown, so a newer client's enum value does not lock it
//! out of an older agent.

use stepwatch_core::allocator::{BlockLayout, Pool, SegmentLayout};
use stepwatch_core::replay::TraceSettings;
use stepwatch_core::{
    Advisory, AdvisoryKind, AllocatorAction, AllocatorEvent, AllocatorStats, AllocatorTrace,
    Marker, MarkerKind, ModelFacts, OptimizerImplementation, OptimizerKind, PhaseKind, Precision,
    RankInfo,
};

use crate::v1 as pb;

/// A wire value the step model cannot take, with the
/// `stepwatch_markers_rejected_total` reason it is counted under.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A marker whose kind is unspecified or not in the contract.
    #[error("marker kind is unspecified or unknown ({0})")]
    MarkerKind(i32),
    /// An allocator trace chunk of another step than step 1.
    #[error("an allocator trace must come from step 1, not step {0}")]
    TraceNotStepOne(u64),
    /// A trace event whose action is unspecified or not in the contract.
    #[error("allocator trace event {index} has an unspecified or unknown action ({value})")]
    EventAction {
        /// Position of the event in the whole trace.
        index: usize,
        /// The value sent.
        value: i32,
    },
    /// A trace event whose phase is not a marker that opens a phase.
    #[error(
        "allocator trace event {index} names no phase (STEP_BEGIN, FORWARD_BEGIN, \
         BACKWARD_BEGIN, OPTIMIZER_BEGIN or OPTIMIZER_END): {value}"
    )]
    EventPhase {
        /// Position of the event in the whole trace.
        index: usize,
        /// The value sent.
        value: i32,
    },
    /// An advisory whose kind is unspecified or not in the contract.
    #[error("advisory kind is unspecified or unknown ({0})")]
    AdvisoryKind(i32),
}

impl WireError {
    /// The `stepwatch_markers_rejected_total` reason of this refusal.
    pub fn reason(&self) -> &'static str {
        match self {
            WireError::MarkerKind(_) | WireError::AdvisoryKind(_) => "unspecified_kind",
            WireError::TraceNotStepOne(_) => "allocator_trace_not_step_one",
            WireError::EventAction { .. } | WireError::EventPhase { .. } => {
                "allocator_trace_bad_event"
            }
        }
    }
}

// ---- Hello ------------------------------------------------------------------

/// A rank's hello. The agent's own findings (`container`, `attested`) are
/// not on the wire, and a client's version is not in [`RankInfo`].
pub fn hello_to_wire(info: &RankInfo, client_version: &str) -> pb::Hello {
    pb::Hello {
        identity: Some(pb::Identity {
            job_id: info.job.clone(),
            rank: info.rank,
            local_rank: info.local_rank,
            world_size: info.world_size,
            node_name: info.node_name.clone(),
            pod: info.pod.clone(),
            namespace: info.namespace.clone(),
        }),
        gpu_uuid: info.gpu_uuid.clone(),
        pid: info.pid,
        framework: info.framework.clone(),
        framework_version: info.framework_version.clone(),
        model: Some(model_facts_to_wire(&info.model)),
        client_version: client_version.to_owned(),
    }
}

/// The rank a hello claims to be, as sent: the PID is the hello's (the
/// agent puts the socket's peer PID in its place where it has one), and it
/// is neither attested nor placed in a container yet. Content is checked by
/// the tracker ([`RankInfo::validate`]), not here.
pub fn hello_from_wire(hello: pb::Hello) -> RankInfo {
    let id = hello.identity.unwrap_or_default();
    RankInfo {
        job: id.job_id,
        rank: id.rank,
        local_rank: id.local_rank,
        world_size: id.world_size,
        node_name: id.node_name,
        pod: id.pod,
        namespace: id.namespace,
        container: String::new(),
        attested: false,
        gpu_uuid: hello.gpu_uuid,
        pid: hello.pid,
        framework: hello.framework,
        framework_version: hello.framework_version,
        model: model_facts_from_wire(hello.model.unwrap_or_default()),
    }
}

// ---- ModelFacts -------------------------------------------------------------

/// A hello's model facts, or a later update's.
pub fn model_facts_to_wire(f: &ModelFacts) -> pb::ModelFacts {
    pb::ModelFacts {
        parameter_count: f.parameter_count,
        parameter_bytes: f.parameter_bytes,
        optimizer: match f.optimizer {
            OptimizerKind::Unknown => pb::OptimizerKind::Unspecified,
            OptimizerKind::Adam => pb::OptimizerKind::Adam,
            OptimizerKind::SgdMomentum => pb::OptimizerKind::SgdMomentum,
            OptimizerKind::Sgd => pb::OptimizerKind::Sgd,
            OptimizerKind::Other => pb::OptimizerKind::Other,
        } as i32,
        state_bytes_per_parameter: f.state_bytes_per_parameter,
        precision: match f.precision {
            Precision::Unknown => pb::Precision::Unspecified,
            Precision::Fp32 => pb::Precision::Fp32,
            Precision::MixedBf16 => pb::Precision::MixedBf16,
            Precision::MixedFp16 => pb::Precision::MixedFp16,
            Precision::Bf16 => pb::Precision::Bf16,
        } as i32,
        sharding_factor: f.sharding_factor,
        grad_accumulation_steps: f.grad_accumulation_steps,
        state_precreated: f.state_precreated,
        grads_set_to_none: f.grads_set_to_none,
        micro_batch_size: f.micro_batch_size,
        optimizer_implementation: match f.optimizer_implementation {
            OptimizerImplementation::Unknown => pb::OptimizerImplementation::Unspecified,
            OptimizerImplementation::Foreach => pb::OptimizerImplementation::Foreach,
            OptimizerImplementation::Fused => pb::OptimizerImplementation::Fused,
            OptimizerImplementation::ForLoop => pb::OptimizerImplementation::ForLoop,
        } as i32,
    }
}

/// Model facts as sent; unknown enum values read as unknown (see the
/// module's note).
pub fn model_facts_from_wire(f: pb::ModelFacts) -> ModelFacts {
    ModelFacts {
        parameter_count: f.parameter_count,
        parameter_bytes: f.parameter_bytes,
        optimizer: match pb::OptimizerKind::try_from(f.optimizer) {
            Ok(pb::OptimizerKind::Adam) => OptimizerKind::Adam,
            Ok(pb::OptimizerKind::SgdMomentum) => OptimizerKind::SgdMomentum,
            Ok(pb::OptimizerKind::Sgd) => OptimizerKind::Sgd,
            Ok(pb::OptimizerKind::Other) => OptimizerKind::Other,
            Ok(pb::OptimizerKind::Unspecified) | Err(_) => OptimizerKind::Unknown,
        },
        state_bytes_per_parameter: f.state_bytes_per_parameter,
        precision: match pb::Precision::try_from(f.precision) {
            Ok(pb::Precision::Fp32) => Precision::Fp32,
            Ok(pb::Precision::MixedBf16) => Precision::MixedBf16,
            Ok(pb::Precision::MixedFp16) => Precision::MixedFp16,
            Ok(pb::Precision::Bf16) => Precision::Bf16,
            Ok(pb::Precision::Unspecified) | Err(_) => Precision::Unknown,
        },
        sharding_factor: f.sharding_factor,
        grad_accumulation_steps: f.grad_accumulation_steps,
        state_precreated: f.state_precreated,
        grads_set_to_none: f.grads_set_to_none,
        micro_batch_size: f.micro_batch_size,
        optimizer_implementation: match pb::OptimizerImplementation::try_from(
            f.optimizer_implementation,
        ) {
            Ok(pb::OptimizerImplementation::Foreach) => OptimizerImplementation::Foreach,
            Ok(pb::OptimizerImplementation::Fused) => OptimizerImplementation::Fused,
            Ok(pb::OptimizerImplementation::ForLoop) => OptimizerImplementation::ForLoop,
            Ok(pb::OptimizerImplementation::Unspecified) | Err(_) => {
                OptimizerImplementation::Unknown
            }
        },
    }
}

// ---- MarkerKind -------------------------------------------------------------

/// A marker's kind.
pub fn marker_kind_to_wire(kind: MarkerKind) -> pb::MarkerKind {
    match kind {
        MarkerKind::StepBegin => pb::MarkerKind::StepBegin,
        MarkerKind::ForwardBegin => pb::MarkerKind::ForwardBegin,
        MarkerKind::BackwardBegin => pb::MarkerKind::BackwardBegin,
        MarkerKind::OptimizerBegin => pb::MarkerKind::OptimizerBegin,
        MarkerKind::OptimizerEnd => pb::MarkerKind::OptimizerEnd,
        MarkerKind::StepEnd => pb::MarkerKind::StepEnd,
        MarkerKind::Oom => pb::MarkerKind::Oom,
    }
}

/// A marker kind as sent; unspecified and unknown values are refused.
pub fn marker_kind_from_wire(value: i32) -> Result<MarkerKind, WireError> {
    Ok(match pb::MarkerKind::try_from(value) {
        Ok(pb::MarkerKind::StepBegin) => MarkerKind::StepBegin,
        Ok(pb::MarkerKind::ForwardBegin) => MarkerKind::ForwardBegin,
        Ok(pb::MarkerKind::BackwardBegin) => MarkerKind::BackwardBegin,
        Ok(pb::MarkerKind::OptimizerBegin) => MarkerKind::OptimizerBegin,
        Ok(pb::MarkerKind::OptimizerEnd) => MarkerKind::OptimizerEnd,
        Ok(pb::MarkerKind::StepEnd) => MarkerKind::StepEnd,
        Ok(pb::MarkerKind::Oom) => MarkerKind::Oom,
        Ok(pb::MarkerKind::Unspecified) | Err(_) => return Err(WireError::MarkerKind(value)),
    })
}

// ---- Marker, AllocatorStats -------------------------------------------------

/// A marker, with its allocator figures when it has them.
pub fn marker_to_wire(m: &Marker) -> pb::Marker {
    pb::Marker {
        kind: marker_kind_to_wire(m.kind) as i32,
        step: m.step,
        monotonic_ns: m.monotonic_ns,
        wall_ns: m.wall_ns,
        micro_batch: m.micro_batch,
        allocator: m.allocator.as_ref().map(allocator_stats_to_wire),
    }
}

/// A marker as sent; its plausibility is the timeline's to check.
pub fn marker_from_wire(m: pb::Marker) -> Result<Marker, WireError> {
    Ok(Marker {
        kind: marker_kind_from_wire(m.kind)?,
        step: m.step,
        monotonic_ns: m.monotonic_ns,
        wall_ns: m.wall_ns,
        micro_batch: m.micro_batch,
        allocator: m.allocator.map(allocator_stats_from_wire),
    })
}

/// `torch.cuda.memory_stats()` figures at a marker.
pub fn allocator_stats_to_wire(a: &AllocatorStats) -> pb::AllocatorStats {
    pb::AllocatorStats {
        allocated_bytes: a.allocated_bytes,
        allocated_peak_bytes: a.allocated_peak_bytes,
        reserved_bytes: a.reserved_bytes,
        reserved_peak_bytes: a.reserved_peak_bytes,
        active_bytes: a.active_bytes,
        active_peak_bytes: a.active_peak_bytes,
        num_alloc_retries: a.num_alloc_retries,
    }
}

/// Allocator figures as sent.
pub fn allocator_stats_from_wire(a: pb::AllocatorStats) -> AllocatorStats {
    AllocatorStats {
        allocated_bytes: a.allocated_bytes,
        allocated_peak_bytes: a.allocated_peak_bytes,
        reserved_bytes: a.reserved_bytes,
        reserved_peak_bytes: a.reserved_peak_bytes,
        active_bytes: a.active_bytes,
        active_peak_bytes: a.active_peak_bytes,
        num_alloc_retries: a.num_alloc_retries,
    }
}

// ---- AllocatorTraceChunk and its parts --------------------------------------

/// Step 1's allocator trace in chunks under the message limit, its
/// settings in the first ([`crate::chunk_allocator_trace`]).
pub fn allocator_trace_to_wire(trace: &AllocatorTrace) -> Vec<pb::AllocatorTraceChunk> {
    crate::chunk_allocator_trace(
        trace.step,
        trace.settings.as_ref().map(trace_settings_to_wire),
        trace.segments.iter().map(segment_to_wire).collect(),
        trace.events.iter().map(event_to_wire).collect(),
    )
}

/// Adds one chunk to the trace gathered so far: its segments and events
/// after those of the chunks before, and its settings when no earlier chunk
/// had any. Whether the chunk is the last, and the bounds on a trace, are
/// the receiver's to check.
pub fn allocator_trace_chunk_from_wire(
    trace: &mut AllocatorTrace,
    chunk: pb::AllocatorTraceChunk,
) -> Result<(), WireError> {
    if chunk.step != 1 {
        return Err(WireError::TraceNotStepOne(chunk.step));
    }
    trace.step = chunk.step;
    if trace.settings.is_none() {
        trace.settings = chunk.settings.map(trace_settings_from_wire);
    }
    trace
        .segments
        .extend(chunk.segments.into_iter().map(segment_from_wire));
    let first = trace.events.len();
    trace.events.reserve(chunk.events.len());
    for (i, e) in chunk.events.into_iter().enumerate() {
        trace.events.push(event_from_wire(e, first + i)?);
    }
    Ok(())
}

/// The allocator settings the traced process ran with.
pub fn trace_settings_to_wire(s: &TraceSettings) -> pb::AllocatorSettings {
    pb::AllocatorSettings {
        max_split_size_bytes: s.max_split_size_bytes,
        roundup_power2_divisions: s.roundup_power2_divisions.clone(),
        garbage_collection_threshold: s.garbage_collection_threshold,
        expandable_segments: s.expandable_segments,
        alloc_conf: s.alloc_conf.clone(),
    }
}

/// Allocator settings as sent; whether the replay models them is
/// [`TraceSettings::model`]'s to say.
pub fn trace_settings_from_wire(s: pb::AllocatorSettings) -> TraceSettings {
    TraceSettings {
        max_split_size_bytes: s.max_split_size_bytes,
        roundup_power2_divisions: s.roundup_power2_divisions,
        garbage_collection_threshold: s.garbage_collection_threshold,
        expandable_segments: s.expandable_segments,
        alloc_conf: s.alloc_conf,
    }
}

/// A segment of the layout after step 1's optimizer phase.
pub fn segment_to_wire(s: &SegmentLayout) -> pb::AllocatorSegment {
    pb::AllocatorSegment {
        address: s.address,
        small_pool: s.pool == Pool::Small,
        blocks: s
            .blocks
            .iter()
            .map(|b| pb::AllocatorBlock {
                size: b.size,
                allocated: b.allocated,
            })
            .collect(),
        stream: s.stream,
        pool_id: s.pool_id,
        expandable: s.expandable,
    }
}

/// A segment as sent; its consistency is the replay's to check.
pub fn segment_from_wire(s: pb::AllocatorSegment) -> SegmentLayout {
    SegmentLayout {
        address: s.address,
        pool: if s.small_pool {
            Pool::Small
        } else {
            Pool::Large
        },
        blocks: s
            .blocks
            .into_iter()
            .map(|b| BlockLayout {
                size: b.size,
                allocated: b.allocated,
            })
            .collect(),
        stream: s.stream,
        pool_id: s.pool_id,
        expandable: s.expandable,
    }
}

/// The marker that opens a phase: how the wire names an event's phase.
pub fn phase_to_wire(phase: PhaseKind) -> pb::MarkerKind {
    marker_kind_to_wire(match phase {
        PhaseKind::Prologue => MarkerKind::StepBegin,
        PhaseKind::Forward => MarkerKind::ForwardBegin,
        PhaseKind::Backward => MarkerKind::BackwardBegin,
        PhaseKind::Optimizer => MarkerKind::OptimizerBegin,
        PhaseKind::Epilogue => MarkerKind::OptimizerEnd,
    })
}

/// One allocation, free or segment event of the traced step.
pub fn event_to_wire(e: &AllocatorEvent) -> pb::AllocatorEvent {
    pb::AllocatorEvent {
        action: match e.action {
            AllocatorAction::Alloc => pb::AllocatorAction::Alloc,
            AllocatorAction::Free => pb::AllocatorAction::Free,
            AllocatorAction::SegmentAlloc => pb::AllocatorAction::SegmentAlloc,
            AllocatorAction::SegmentFree => pb::AllocatorAction::SegmentFree,
            AllocatorAction::SegmentMap => pb::AllocatorAction::SegmentMap,
            AllocatorAction::SegmentUnmap => pb::AllocatorAction::SegmentUnmap,
        } as i32,
        address: e.address,
        size: e.size,
        phase: phase_to_wire(e.phase) as i32,
        stream: e.stream,
    }
}

/// An event as sent, `index` being its place in the whole trace (for the
/// error); an unknown action or a phase no marker opens is refused.
pub fn event_from_wire(e: pb::AllocatorEvent, index: usize) -> Result<AllocatorEvent, WireError> {
    let action = match pb::AllocatorAction::try_from(e.action) {
        Ok(pb::AllocatorAction::Alloc) => AllocatorAction::Alloc,
        Ok(pb::AllocatorAction::Free) => AllocatorAction::Free,
        Ok(pb::AllocatorAction::SegmentAlloc) => AllocatorAction::SegmentAlloc,
        Ok(pb::AllocatorAction::SegmentFree) => AllocatorAction::SegmentFree,
        Ok(pb::AllocatorAction::SegmentMap) => AllocatorAction::SegmentMap,
        Ok(pb::AllocatorAction::SegmentUnmap) => AllocatorAction::SegmentUnmap,
        Ok(pb::AllocatorAction::Unspecified) | Err(_) => {
            return Err(WireError::EventAction {
                index,
                value: e.action,
            })
        }
    };
    let phase = marker_kind_from_wire(e.phase)
        .ok()
        .and_then(MarkerKind::opens)
        .ok_or(WireError::EventPhase {
            index,
            value: e.phase,
        })?;
    Ok(AllocatorEvent {
        action,
        address: e.address,
        size: e.size,
        phase,
        stream: e.stream,
    })
}

// ---- Advisory ---------------------------------------------------------------

/// An advisory's kind.
pub fn advisory_kind_to_wire(kind: AdvisoryKind) -> pb::AdvisoryKind {
    match kind {
        AdvisoryKind::Step2OomPredicted => pb::AdvisoryKind::Step2OomPredicted,
        AdvisoryKind::LowHeadroom => pb::AdvisoryKind::LowHeadroom,
        AdvisoryKind::RankDivergence => pb::AdvisoryKind::RankDivergence,
    }
}

/// An advisory kind as sent; unspecified and unknown values are refused.
pub fn advisory_kind_from_wire(value: i32) -> Result<AdvisoryKind, WireError> {
    Ok(match pb::AdvisoryKind::try_from(value) {
        Ok(pb::AdvisoryKind::Step2OomPredicted) => AdvisoryKind::Step2OomPredicted,
        Ok(pb::AdvisoryKind::LowHeadroom) => AdvisoryKind::LowHeadroom,
        Ok(pb::AdvisoryKind::RankDivergence) => AdvisoryKind::RankDivergence,
        Ok(pb::AdvisoryKind::Unspecified) | Err(_) => return Err(WireError::AdvisoryKind(value)),
    })
}

/// An advisory for the rank's stream; its severity follows from its kind
/// (a predicted step-2 OOM is critical, the rest are warnings).
pub fn advisory_to_wire(a: &Advisory) -> pb::Advisory {
    let severity = match a.kind {
        AdvisoryKind::Step2OomPredicted => pb::Severity::Critical,
        AdvisoryKind::LowHeadroom | AdvisoryKind::RankDivergence => pb::Severity::Warning,
    };
    pb::Advisory {
        kind: advisory_kind_to_wire(a.kind) as i32,
        severity: severity as i32,
        message: a.message.clone(),
        step: a.step,
        predicted_peak_bytes: a.predicted_peak_bytes,
        capacity_bytes: a.capacity_bytes,
        predicted_headroom_bytes: a.predicted_headroom_bytes,
    }
}

/// An advisory as a client receives it. The agent's own bookkeeping (when
/// it was issued, which divergence figure named the rank) is not on the
/// wire and reads as 0 and None; the severity is implied by the kind.
pub fn advisory_from_wire(a: pb::Advisory) -> Result<Advisory, WireError> {
    Ok(Advisory {
        kind: advisory_kind_from_wire(a.kind)?,
        step: a.step,
        issued_monotonic_ns: 0,
        predicted_peak_bytes: a.predicted_peak_bytes,
        capacity_bytes: a.capacity_bytes,
        predicted_headroom_bytes: a.predicted_headroom_bytes,
        message: a.message,
        divergence: None,
    })
}
