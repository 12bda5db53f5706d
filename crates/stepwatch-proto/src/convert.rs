//! The wire's messages in the step model's terms, and back: the one place
//! where `stepwatch.v1` meets `stepwatch_core`.
//!
//! One pair of functions per message, `<message>_to_wire` and
//! `<message>_from_wire`, side by side. Each names every field of what it
//! reads and of what it builds, once (`fields!`: a destructuring without
//! `..` and a struct literal, from one list), so a field added to the contract
//! or to the core type does not compile until both functions of its message
//! take it, and the round-trip test in `tests/convert.rs` then checks that
//! they agree. The agent reads with the `_from_wire` half; `stepwatch sim`
//! and the tests write with the `_to_wire` half.
//!
//! Reading is strict where a value the step model needs has no meaning: a
//! marker or trace event with an unspecified or unknown kind, action or
//! phase is a [`WireError`] that names it. It is lenient where the value is
//! optional: an unknown optimizer, precision or implementation in the model
//! facts reads as unknown, so a newer client's enum value does not lock it
//! out of an older agent.

use stepwatch_core::allocator::{BlockLayout, Pool, SegmentLayout};
use stepwatch_core::TraceSettings;
use stepwatch_core::{
    Advisory, AdvisoryKind, AllocatorAction, AllocatorEvent, AllocatorStats, AllocatorTrace,
    BatchFacts, DdpBucketRebuild, DeviceMemory, Marker, MarkerKind, ModelFacts, OomReport,
    OomSegment, OptimizerImplementation, OptimizerKind, PhaseKind, Precision, RankInfo,
};

use crate::v1 as pb;

/// `$to` from `$value` (a `$from`), each side's fields named in full: a
/// field added to either and not taken here fails to compile. The fields
/// listed first move across as they are; then, each section optional and
/// in this order, `map: f => expr` converts field `f` (the expression reads
/// it by its name), `read: f` binds a source field for the expressions
/// only, `drop: f` leaves one out, and `set: f = expr` (or `set: f`, a
/// variable of that name) fills a target field the source lacks.
/// `fields!(let $from { ... } = $value)` only binds the source's fields.
macro_rules! fields {
    (let $from:path { $($bound:ident),* $(,)? $(; drop: $($dropped:ident),+ $(,)?)? } = $value:expr) => {
        let $from { $($bound,)* $($($dropped: _,)+)? } = $value;
    };
    ($value:expr, $from:path => $to:path {
        $($moved:ident),* $(,)?
        $(; map: $($mapped:ident => $conv:expr),+ $(,)?)?
        $(; read: $($read:ident),+ $(,)?)?
        $(; drop: $($dropped:ident),+ $(,)?)?
        $(; set: $($set:ident $(= $val:expr)?),+ $(,)?)?
    }) => {{
        let $from { $($moved,)* $($($mapped,)+)? $($($read,)+)? $($($dropped: _,)+)? } = $value;
        $to { $($moved,)* $($($mapped: $conv,)+)? $($($set $(: $val)?,)+)? }
    }};
}

/// Both directions of a one-to-one enum mapping, from one list of
/// `core <=> wire` variant pairs: `$to` (total: the match names every core
/// variant) and `$from`, which gives None for a wire value not listed (an
/// unspecified one where no core variant stands for it, or one from a newer
/// contract).
macro_rules! enum_pairs {
    ($to:ident, $from:ident, $core:ty => $wire:ty { $($c:ident <=> $w:ident),+ $(,)? }) => {
        #[doc = concat!("The wire's `", stringify!($wire), "` for a core `", stringify!($core), "`.")]
        pub fn $to(value: $core) -> $wire {
            type Core = $core;
            type Wire = $wire;
            match value {
                $(Core::$c => Wire::$w),+
            }
        }

        #[doc = concat!("The core `", stringify!($core), "` for a wire value; None when the pairs do not list it.")]
        pub fn $from(value: i32) -> Option<$core> {
            type Core = $core;
            type Wire = $wire;
            match Wire::try_from(value) {
                $(Ok(Wire::$w) => Some(Core::$c),)+
                _ => None,
            }
        }
    };
}

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
    fields!(info.clone(), RankInfo => pb::Hello {
        gpu_uuid, pid, framework, framework_version, torch_version, run_id;
        map: model => Some(model_facts_to_wire(&model));
        read: job, rank, local_rank, world_size, node_name, pod, namespace;
        drop: container, attested, tcp_identity;
        set: client_version = client_version.to_owned(),
            identity = Some(pb::Identity {
                job_id: job, rank, local_rank, world_size, node_name, pod, namespace,
            })
    })
}

/// The rank a hello claims to be, as sent: the PID is the hello's (the
/// agent puts the socket's peer PID in its place where it has one), and it
/// is neither attested nor placed in a container yet. Content is checked by
/// the tracker ([`RankInfo::validate`]), not here.
pub fn hello_from_wire(mut hello: pb::Hello) -> RankInfo {
    fields!(let pb::Identity {
        job_id, rank, local_rank, world_size, node_name, pod, namespace
    } = hello.identity.take().unwrap_or_default());
    fields!(hello, pb::Hello => RankInfo {
        gpu_uuid, pid, framework, framework_version, torch_version, run_id;
        map: model => model_facts_from_wire(model.unwrap_or_default());
        drop: identity, client_version;
        set: job = job_id, rank, local_rank, world_size, node_name, pod, namespace,
            container = String::new(), attested = false,
            // The transport's finding, not the hello's.
            tcp_identity = None
    })
}

// ---- ModelFacts -------------------------------------------------------------

/// A hello's model facts, or a later update's.
pub fn model_facts_to_wire(f: &ModelFacts) -> pb::ModelFacts {
    fields!(f.clone(), ModelFacts => pb::ModelFacts {
        parameter_count, parameter_bytes, state_bytes_per_parameter, sharding_factor,
        grad_accumulation_steps, state_precreated, grads_set_to_none, micro_batch_size;
        map: optimizer => optimizer_to_wire(optimizer) as i32,
            precision => precision_to_wire(precision) as i32,
            optimizer_implementation =>
                optimizer_implementation_to_wire(optimizer_implementation) as i32,
            ddp_bucket_rebuild => ddp_bucket_rebuild.map(ddp_bucket_rebuild_to_wire),
            largest_batch => largest_batch.as_ref().map(batch_to_wire)
    })
}

/// DDP's bucket rebuild, as the client learnt it in step 1.
pub fn ddp_bucket_rebuild_to_wire(r: DdpBucketRebuild) -> pb::DdpBucketRebuild {
    fields!(r, DdpBucketRebuild => pb::DdpBucketRebuild { old_bucket_bytes, new_bucket_bytes })
}

/// DDP's bucket rebuild as sent; checked by the tracker
/// ([`DdpBucketRebuild::validate`] through the facts), not here.
pub fn ddp_bucket_rebuild_from_wire(r: pb::DdpBucketRebuild) -> DdpBucketRebuild {
    fields!(r, pb::DdpBucketRebuild => DdpBucketRebuild { old_bucket_bytes, new_bucket_bytes })
}

/// Model facts as sent; unknown enum values read as unknown (see the
/// module's note).
pub fn model_facts_from_wire(f: pb::ModelFacts) -> ModelFacts {
    fields!(f, pb::ModelFacts => ModelFacts {
        parameter_count, parameter_bytes, state_bytes_per_parameter, sharding_factor,
        grad_accumulation_steps, state_precreated, grads_set_to_none, micro_batch_size;
        map: optimizer => optimizer_from_wire(optimizer).unwrap_or_default(),
            precision => precision_from_wire(precision).unwrap_or_default(),
            optimizer_implementation =>
                optimizer_implementation_from_wire(optimizer_implementation).unwrap_or_default(),
            ddp_bucket_rebuild => ddp_bucket_rebuild.map(ddp_bucket_rebuild_from_wire),
            largest_batch => largest_batch.and_then(batch_from_wire)
    })
}

// Unknown values read as unknown (see the module's note).
enum_pairs!(optimizer_to_wire, optimizer_from_wire, OptimizerKind => pb::OptimizerKind {
    Unknown <=> Unspecified,
    Adam <=> Adam,
    SgdMomentum <=> SgdMomentum,
    Sgd <=> Sgd,
    Other <=> Other,
});
enum_pairs!(precision_to_wire, precision_from_wire, Precision => pb::Precision {
    Unknown <=> Unspecified,
    Fp32 <=> Fp32,
    MixedBf16 <=> MixedBf16,
    MixedFp16 <=> MixedFp16,
    Bf16 <=> Bf16,
});
enum_pairs!(
    optimizer_implementation_to_wire,
    optimizer_implementation_from_wire,
    OptimizerImplementation => pb::OptimizerImplementation {
        Unknown <=> Unspecified,
        Foreach <=> Foreach,
        Fused <=> Fused,
        ForLoop <=> ForLoop,
    }
);

// ---- MarkerKind -------------------------------------------------------------

// No core kind stands for MARKER_KIND_UNSPECIFIED: a marker must say what it is.
enum_pairs!(marker_kind_to_wire, marker_kind_of_wire, MarkerKind => pb::MarkerKind {
    StepBegin <=> StepBegin,
    ForwardBegin <=> ForwardBegin,
    BackwardBegin <=> BackwardBegin,
    OptimizerBegin <=> OptimizerBegin,
    OptimizerEnd <=> OptimizerEnd,
    StepEnd <=> StepEnd,
    Oom <=> Oom,
    EvalBegin <=> EvalBegin,
    EvalEnd <=> EvalEnd,
    CheckpointBegin <=> CheckpointBegin,
    CheckpointEnd <=> CheckpointEnd,
});

/// A marker kind as sent; unspecified and unknown values are refused.
pub fn marker_kind_from_wire(value: i32) -> Result<MarkerKind, WireError> {
    marker_kind_of_wire(value).ok_or(WireError::MarkerKind(value))
}

// ---- Marker, AllocatorStats, DeviceMemory ---------------------------------

/// A marker, with its allocator figures when it has them.
pub fn marker_to_wire(m: &Marker) -> pb::Marker {
    fields!(m.clone(), Marker => pb::Marker {
        step, monotonic_ns, wall_ns, micro_batch;
        map: kind => marker_kind_to_wire(kind) as i32,
            allocator => allocator.as_ref().map(allocator_stats_to_wire),
            layout_segments => layout_segments.iter().map(segment_to_wire).collect(),
            device_memory => device_memory.as_ref().map(device_memory_to_wire),
            batch => batch.as_ref().map(batch_to_wire)
    })
}

/// A marker as sent; its plausibility is the timeline's to check.
pub fn marker_from_wire(m: pb::Marker) -> Result<Marker, WireError> {
    Ok(fields!(m, pb::Marker => Marker {
        step, monotonic_ns, wall_ns, micro_batch;
        map: kind => marker_kind_from_wire(kind)?,
            allocator => allocator.map(allocator_stats_from_wire),
            layout_segments => layout_segments.into_iter().map(segment_from_wire).collect(),
            device_memory => device_memory.map(device_memory_from_wire),
            batch => batch.and_then(batch_from_wire)
    }))
}

/// A batch's size, as the client described it.
pub fn batch_to_wire(b: &BatchFacts) -> pb::BatchFacts {
    fields!(b.clone(), BatchFacts => pb::BatchFacts { samples, tokens, shape })
}

/// A batch as sent; an empty one says nothing (None). Its plausibility is
/// the timeline's (or the facts') to check.
pub fn batch_from_wire(b: pb::BatchFacts) -> Option<BatchFacts> {
    let b = fields!(b, pb::BatchFacts => BatchFacts { samples, tokens, shape });
    (!b.is_empty()).then_some(b)
}

/// What the client sent with an OOM marker.
pub fn oom_report_to_wire(r: &OomReport) -> pb::OomReport {
    fields!(r.clone(), OomReport => pb::OomReport {
        step, requested_bytes, inactive_split_bytes, segment_count, largest_free_block_bytes,
        message;
        map: allocator => allocator.as_ref().map(allocator_stats_to_wire),
            largest_segments => largest_segments
                .into_iter()
                .map(|s| {
                    fields!(s, OomSegment => pb::OomSegment {
                        size_bytes, allocated_bytes, largest_free_block_bytes, small_pool,
                    })
                })
                .collect(),
            device_memory => device_memory.as_ref().map(device_memory_to_wire)
    })
}

/// An OOM report as sent; its bounds are the tracker's to check.
pub fn oom_report_from_wire(r: pb::OomReport) -> OomReport {
    fields!(r, pb::OomReport => OomReport {
        step, requested_bytes, inactive_split_bytes, segment_count, largest_free_block_bytes,
        message;
        map: allocator => allocator.map(allocator_stats_from_wire),
            largest_segments => largest_segments
                .into_iter()
                .map(|s| {
                    fields!(s, pb::OomSegment => OomSegment {
                        size_bytes, allocated_bytes, largest_free_block_bytes, small_pool,
                    })
                })
                .collect(),
            device_memory => device_memory.map(device_memory_from_wire)
    })
}

/// `cudaMemGetInfo` at a marker.
pub fn device_memory_to_wire(d: &DeviceMemory) -> pb::DeviceMemory {
    fields!(*d, DeviceMemory => pb::DeviceMemory { free_bytes, total_bytes })
}

/// The device's memory as sent; its plausibility is the timeline's to check.
pub fn device_memory_from_wire(d: pb::DeviceMemory) -> DeviceMemory {
    fields!(d, pb::DeviceMemory => DeviceMemory { free_bytes, total_bytes })
}

/// `torch.cuda.memory_stats()` figures at a marker.
pub fn allocator_stats_to_wire(a: &AllocatorStats) -> pb::AllocatorStats {
    fields!(*a, AllocatorStats => pb::AllocatorStats {
        allocated_bytes, allocated_peak_bytes, reserved_bytes, reserved_peak_bytes,
        active_bytes, active_peak_bytes, num_alloc_retries,
    })
}

/// Allocator figures as sent.
pub fn allocator_stats_from_wire(a: pb::AllocatorStats) -> AllocatorStats {
    fields!(a, pb::AllocatorStats => AllocatorStats {
        allocated_bytes, allocated_peak_bytes, reserved_bytes, reserved_peak_bytes,
        active_bytes, active_peak_bytes, num_alloc_retries,
    })
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
        trace.forward_returns.clone(),
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
    trace.forward_returns.extend(chunk.forward_returns);
    let first = trace.events.len();
    trace.events.reserve(chunk.events.len());
    for (i, e) in chunk.events.into_iter().enumerate() {
        trace.events.push(event_from_wire(e, first + i)?);
    }
    Ok(())
}

/// The allocator settings the traced process ran with.
pub fn trace_settings_to_wire(s: &TraceSettings) -> pb::AllocatorSettings {
    fields!(s.clone(), TraceSettings => pb::AllocatorSettings {
        max_split_size_bytes, roundup_power2_divisions, garbage_collection_threshold,
        expandable_segments, alloc_conf,
    })
}

/// Allocator settings as sent; whether the replay models them is
/// [`TraceSettings::model`]'s to say.
pub fn trace_settings_from_wire(s: pb::AllocatorSettings) -> TraceSettings {
    fields!(s, pb::AllocatorSettings => TraceSettings {
        max_split_size_bytes, roundup_power2_divisions, garbage_collection_threshold,
        expandable_segments, alloc_conf,
    })
}

/// A segment of the layout after step 1's optimizer phase.
pub fn segment_to_wire(s: &SegmentLayout) -> pb::AllocatorSegment {
    fields!(s.clone(), SegmentLayout => pb::AllocatorSegment {
        address, stream, pool_id, expandable;
        map: blocks => blocks
            .into_iter()
            .map(|b| fields!(b, BlockLayout => pb::AllocatorBlock { size, allocated, gradient }))
            .collect();
        read: pool;
        set: small_pool = pool == Pool::Small
    })
}

/// A segment as sent; its consistency is the replay's to check.
pub fn segment_from_wire(s: pb::AllocatorSegment) -> SegmentLayout {
    fields!(s, pb::AllocatorSegment => SegmentLayout {
        address, stream, pool_id, expandable;
        map: blocks => blocks
            .into_iter()
            .map(|b| fields!(b, pb::AllocatorBlock => BlockLayout { size, allocated, gradient }))
            .collect();
        read: small_pool;
        set: pool = if small_pool { Pool::Small } else { Pool::Large }
    })
}

/// The marker that opens a phase: how the wire names an event's phase.
pub fn phase_to_wire(phase: PhaseKind) -> pb::MarkerKind {
    marker_kind_to_wire(phase.opened_by())
}

enum_pairs!(action_to_wire, action_from_wire, AllocatorAction => pb::AllocatorAction {
    Alloc <=> Alloc,
    Free <=> Free,
    SegmentAlloc <=> SegmentAlloc,
    SegmentFree <=> SegmentFree,
    SegmentMap <=> SegmentMap,
    SegmentUnmap <=> SegmentUnmap,
});

/// One allocation, free or segment event of the traced step.
pub fn event_to_wire(e: &AllocatorEvent) -> pb::AllocatorEvent {
    fields!(*e, AllocatorEvent => pb::AllocatorEvent {
        address, size, stream;
        map: action => action_to_wire(action) as i32,
            phase => phase_to_wire(phase) as i32
    })
}

/// An event as sent, `index` being its place in the whole trace (for the
/// error); an unknown action or a phase no marker opens is refused.
pub fn event_from_wire(e: pb::AllocatorEvent, index: usize) -> Result<AllocatorEvent, WireError> {
    Ok(fields!(e, pb::AllocatorEvent => AllocatorEvent {
        address, size, stream;
        map: action => action_from_wire(action)
                .ok_or(WireError::EventAction { index, value: action })?,
            phase => marker_kind_from_wire(phase)
                .ok()
                .and_then(MarkerKind::opens)
                .ok_or(WireError::EventPhase { index, value: phase })?
    }))
}

// ---- Advisory ---------------------------------------------------------------

enum_pairs!(advisory_kind_to_wire, advisory_kind_of_wire, AdvisoryKind => pb::AdvisoryKind {
    Step2OomPredicted <=> Step2OomPredicted,
    LowHeadroom <=> LowHeadroom,
    RankDivergence <=> RankDivergence,
    AllocatorRetries <=> AllocatorRetries,
    LowObservedHeadroom <=> LowObservedHeadroom,
    MemoryGrowth <=> MemoryGrowth,
    ClientClock <=> ClientClock,
    PredictionFinal <=> PredictionFinal,
});

/// An advisory kind as sent; unspecified and unknown values are refused.
pub fn advisory_kind_from_wire(value: i32) -> Result<AdvisoryKind, WireError> {
    advisory_kind_of_wire(value).ok_or(WireError::AdvisoryKind(value))
}

/// An advisory for the rank's stream; its severity follows from its kind
/// (a predicted step-2 OOM is critical, a client clock is information,
/// the rest are warnings). When it was
/// issued and which divergence figure named the rank stay in the agent.
pub fn advisory_to_wire(a: &Advisory) -> pb::Advisory {
    let severity = match a.kind {
        AdvisoryKind::Step2OomPredicted => pb::Severity::Critical,
        AdvisoryKind::PredictionFinal => pb::Severity::Info,
        AdvisoryKind::LowHeadroom
        | AdvisoryKind::RankDivergence
        | AdvisoryKind::AllocatorRetries
        | AdvisoryKind::LowObservedHeadroom
        | AdvisoryKind::MemoryGrowth => pb::Severity::Warning,
        AdvisoryKind::ClientClock => pb::Severity::Info,
    };
    fields!(a.clone(), Advisory => pb::Advisory {
        step, predicted_peak_bytes, capacity_bytes, predicted_headroom_bytes, message;
        map: kind => advisory_kind_to_wire(kind) as i32;
        drop: issued_monotonic_ns, divergence;
        set: severity = severity as i32
    })
}

/// An advisory as a client receives it. The agent's own bookkeeping reads
/// as 0 and None; the severity is implied by the kind.
pub fn advisory_from_wire(a: pb::Advisory) -> Result<Advisory, WireError> {
    Ok(fields!(a, pb::Advisory => Advisory {
        step, predicted_peak_bytes, capacity_bytes, predicted_headroom_bytes, message;
        map: kind => advisory_kind_from_wire(kind)?;
        drop: severity;
        set: issued_monotonic_ns = 0, divergence = None
    }))
}
