//! The wire conversions round-trip: core -> wire -> core gives back what
//! went in, and so does wire -> core -> wire for every valid wire value;
//! invalid wire values are refused with an error that names them.

use proptest::prelude::*;
use stepwatch_core::allocator::{BlockLayout, Pool, SegmentLayout};
use stepwatch_core::TraceSettings;
use stepwatch_core::{
    Advisory, AllocatorEvent, AllocatorStats, AllocatorTrace, BatchFacts, DdpBucketRebuild,
    DeviceMemory, Marker, ModelFacts, OomReport, OomSegment, OptimizerImplementation,
    OptimizerKind, PhaseKind, Precision, RankInfo,
};
use stepwatch_proto::convert::*;
use stepwatch_proto::v1 as pb;

// ---- core values ------------------------------------------------------------

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9._/-]{0,12}"
}

/// Every value of a wire enum, drawn by its wire value (the exhaustive
/// test below checks each maps to a core value and back).
fn by_wire_value<T: std::fmt::Debug>(
    values: std::ops::RangeInclusive<i32>,
    from_wire: fn(i32) -> Option<T>,
) -> impl Strategy<Value = T> {
    values.prop_map(move |v| from_wire(v).expect("a value of the contract"))
}

prop_compose! {
    fn model_facts()(
        parameter_count in any::<Option<u64>>(),
        parameter_bytes in any::<Option<u64>>(),
        optimizer in by_wire_value(0..=4, optimizer_from_wire),
        state_bytes_per_parameter in any::<Option<u32>>(),
        precision in by_wire_value(0..=4, precision_from_wire),
        (sharding_factor, grad_accumulation_steps) in any::<(Option<u32>, Option<u32>)>(),
        (state_precreated, grads_set_to_none) in any::<(Option<bool>, Option<bool>)>(),
        micro_batch_size in any::<Option<u32>>(),
        optimizer_implementation in by_wire_value(0..=3, optimizer_implementation_from_wire),
        ddp_bucket_rebuild in prop::option::of(ddp_bucket_rebuild()),
        largest_batch in prop::option::of(batch()),
    ) -> ModelFacts {
        ModelFacts {
            parameter_count, parameter_bytes, optimizer, state_bytes_per_parameter, precision,
            sharding_factor, grad_accumulation_steps, state_precreated, grads_set_to_none,
            micro_batch_size, optimizer_implementation, ddp_bucket_rebuild, largest_batch,
        }
    }
}

prop_compose! {
    fn ddp_bucket_rebuild()(
        old_bucket_bytes in prop::collection::vec(any::<u64>(), 0..20),
        new_bucket_bytes in prop::collection::vec(any::<u64>(), 0..20),
    ) -> DdpBucketRebuild {
        DdpBucketRebuild { old_bucket_bytes, new_bucket_bytes }
    }
}

prop_compose! {
    fn batch_facts()(
        samples in any::<Option<u64>>(),
        tokens in any::<Option<u64>>(),
        shape in prop::collection::vec(any::<u64>(), 0..10),
    ) -> BatchFacts {
        BatchFacts { samples, tokens, shape }
    }
}

/// A batch that says something (an empty one reads back as none).
fn batch() -> impl Strategy<Value = BatchFacts> {
    batch_facts().prop_filter("says something", |b| !b.is_empty())
}

prop_compose! {
    /// What a hello can say: the agent's own findings (container, attested,
    /// the TCP peer) are not on the wire.
    fn rank_info()(
        (job, node_name, gpu_uuid) in (text(), text(), text()),
        (rank, local_rank, world_size, pid) in any::<(u32, u32, u32, u32)>(),
        (pod, namespace) in (text(), text()),
        (framework, framework_version, torch_version) in (text(), text(), text()),
        model in model_facts(),
        run_id in text(),
    ) -> RankInfo {
        RankInfo {
            job, rank, local_rank, world_size, node_name, pod, namespace, gpu_uuid, pid,
            framework, framework_version, torch_version, model, run_id,
            container: String::new(), attested: false, tcp_identity: None,
        }
    }
}

fn allocator_stats() -> impl Strategy<Value = AllocatorStats> {
    any::<[u64; 7]>().prop_map(|v| AllocatorStats {
        allocated_bytes: v[0],
        allocated_peak_bytes: v[1],
        reserved_bytes: v[2],
        reserved_peak_bytes: v[3],
        active_bytes: v[4],
        active_peak_bytes: v[5],
        num_alloc_retries: v[6],
    })
}

prop_compose! {
    fn marker()(
        kind in by_wire_value(1..=11, marker_kind_of_wire),
        (step, monotonic_ns, wall_ns) in any::<(u64, u64, u64)>(),
        micro_batch in any::<u32>(),
        allocator in prop::option::of(allocator_stats()),
        layout_segments in prop::collection::vec(segment(), 0..3),
        device_memory in prop::option::of(device_memory()),
        batch in prop::option::of(batch()),
    ) -> Marker {
        Marker {
            kind, step, monotonic_ns, wall_ns, micro_batch, allocator, layout_segments,
            device_memory, batch,
        }
    }
}

fn device_memory() -> impl Strategy<Value = DeviceMemory> {
    any::<[u64; 2]>().prop_map(|v| DeviceMemory {
        free_bytes: v[0],
        total_bytes: v[1],
    })
}

fn oom_report() -> impl Strategy<Value = OomReport> {
    (
        any::<[u64; 5]>(),
        prop::option::of(allocator_stats()),
        prop::collection::vec((any::<[u64; 3]>(), any::<bool>()), 0..9),
        prop::option::of(device_memory()),
        text(),
    )
        .prop_map(
            |(v, allocator, segments, device_memory, message)| OomReport {
                step: v[0],
                requested_bytes: v[1],
                inactive_split_bytes: v[2],
                segment_count: v[3],
                largest_free_block_bytes: v[4],
                allocator,
                largest_segments: segments
                    .into_iter()
                    .map(|(s, small_pool)| OomSegment {
                        size_bytes: s[0],
                        allocated_bytes: s[1],
                        largest_free_block_bytes: s[2],
                        small_pool,
                    })
                    .collect(),
                device_memory,
                message,
            },
        )
}

prop_compose! {
    fn segment()(
        address in any::<u64>(),
        small in any::<bool>(),
        blocks in prop::collection::vec(any::<(u64, bool, bool)>(), 0..4),
        (stream, pool_id) in any::<(u64, u64)>(),
        expandable in any::<bool>(),
    ) -> SegmentLayout {
        let blocks = blocks
            .into_iter()
            .map(|(size, allocated, gradient)| BlockLayout { size, allocated, gradient })
            .collect();
        let pool = if small { Pool::Small } else { Pool::Large };
        SegmentLayout { address, pool, blocks, stream, pool_id, expandable }
    }
}

prop_compose! {
    /// Every action, in every phase, drawn by its wire value.
    fn event()(
        action in 1..=6i32,
        (address, size, stream) in any::<(u64, u64, u64)>(),
        phase in prop::sample::select(PhaseKind::ALL.to_vec()),
    ) -> AllocatorEvent {
        let phase = phase_to_wire(phase) as i32;
        let wire = pb::AllocatorEvent { action, address, size, phase, stream };
        event_from_wire(wire, 0).expect("an action of the contract")
    }
}

prop_compose! {
    fn trace_settings()(
        max_split_size_bytes in any::<u64>(),
        roundup_power2_divisions in prop::collection::vec(any::<u32>(), 0..5),
        // Finite: NaN is equal to nothing, itself included.
        garbage_collection_threshold in -1e6f64..1e6,
        expandable_segments in any::<bool>(),
        alloc_conf in "[a-z_:,0-9]{0,30}",
    ) -> TraceSettings {
        TraceSettings {
            max_split_size_bytes, roundup_power2_divisions, garbage_collection_threshold,
            expandable_segments, alloc_conf,
        }
    }
}

prop_compose! {
    /// Step 1's trace (the only step the wire carries), large enough at
    /// times to need several chunks.
    fn trace()(
        segments in prop::collection::vec(segment(), 0..40),
        events in prop::collection::vec(event(), 0..3000),
        settings in prop::option::of(trace_settings()),
        mut forward_returns in prop::collection::vec(0u64..4000, 0..64),
    ) -> AllocatorTrace {
        forward_returns.sort_unstable();
        // The torch version is not on the wire: the agent takes it from the hello.
        let torch_version = String::new();
        AllocatorTrace { step: 1, segments, events, settings, forward_returns, torch_version }
    }
}

prop_compose! {
    /// An advisory as the wire carries it: the agent's bookkeeping (when it
    /// was issued, the divergence figure) stays in the agent.
    fn advisory()(
        kind in by_wire_value(1..=8, advisory_kind_of_wire),
        (step, predicted_peak_bytes, capacity_bytes) in any::<(u64, u64, u64)>(),
        predicted_headroom_bytes in any::<i64>(),
        message in text(),
    ) -> Advisory {
        Advisory {
            kind, step, predicted_peak_bytes, capacity_bytes, predicted_headroom_bytes, message,
            issued_monotonic_ns: 0, divergence: None,
        }
    }
}

fn trace_from_chunks(chunks: Vec<pb::AllocatorTraceChunk>) -> Result<AllocatorTrace, WireError> {
    let mut trace = AllocatorTrace::default();
    for chunk in chunks {
        allocator_trace_chunk_from_wire(&mut trace, chunk)?;
    }
    Ok(trace)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn core_to_wire_to_core_gives_back_what_went_in(
        info in rank_info(),
        m in marker(),
        t in trace(),
        a in advisory(),
        oom in oom_report(),
    ) {
        prop_assert_eq!(oom_report_from_wire(oom_report_to_wire(&oom)), oom);
        prop_assert_eq!(hello_from_wire(hello_to_wire(&info, "v")), info.clone());
        prop_assert_eq!(model_facts_from_wire(model_facts_to_wire(&info.model)), info.model);
        prop_assert_eq!(marker_from_wire(marker_to_wire(&m)), Ok(m));
        let chunks = allocator_trace_to_wire(&t);
        prop_assert!(chunks.last().is_some_and(|c| c.last));
        prop_assert_eq!(trace_from_chunks(chunks), Ok(t));
        prop_assert_eq!(advisory_from_wire(advisory_to_wire(&a)), Ok(a));
    }

    #[test]
    fn valid_wire_values_survive_wire_to_core_to_wire(
        info in rank_info(),
        m in marker(),
        t in trace(),
        a in advisory(),
        version in text(),
    ) {
        // Wire values built from core values are exactly the valid ones:
        // known enum values, a phase that a marker opens.
        let hello = hello_to_wire(&info, &version);
        prop_assert_eq!(hello_to_wire(&hello_from_wire(hello.clone()), &version), hello);
        let wire = marker_to_wire(&m);
        prop_assert_eq!(marker_to_wire(&marker_from_wire(wire.clone()).unwrap()), wire);
        for (i, e) in t.events.iter().map(event_to_wire).enumerate() {
            prop_assert_eq!(event_to_wire(&event_from_wire(e, i).unwrap()), e);
        }
        for s in t.segments.iter().map(segment_to_wire) {
            prop_assert_eq!(segment_to_wire(&segment_from_wire(s.clone())), s);
        }
        if let Some(s) = t.settings.as_ref().map(trace_settings_to_wire) {
            prop_assert_eq!(trace_settings_to_wire(&trace_settings_from_wire(s.clone())), s);
        }
        let chunks = allocator_trace_to_wire(&t);
        prop_assert_eq!(allocator_trace_to_wire(&trace_from_chunks(chunks.clone()).unwrap()), chunks);
        let wire = advisory_to_wire(&a);
        prop_assert_eq!(advisory_to_wire(&advisory_from_wire(wire.clone()).unwrap()), wire);
    }
}

#[test]
fn every_wire_enum_value_maps_to_a_core_value_and_back() {
    // The proptest draws core values; this walks the wire's enums, so a
    // value added to the contract without a core counterpart fails here.
    for kind in 1..=11 {
        let core = marker_kind_from_wire(kind).unwrap();
        assert_eq!(marker_kind_to_wire(core) as i32, kind);
    }
    for action in 1..=6 {
        let e = pb::AllocatorEvent {
            action,
            phase: pb::MarkerKind::ForwardBegin as i32,
            ..Default::default()
        };
        assert_eq!(event_to_wire(&event_from_wire(e, 0).unwrap()), e);
    }
    for kind in 1..=8 {
        assert_eq!(
            advisory_kind_to_wire(advisory_kind_from_wire(kind).unwrap()) as i32,
            kind
        );
    }
    for value in 0..=4 {
        let facts = pb::ModelFacts {
            optimizer: value,
            precision: value,
            optimizer_implementation: value.min(3),
            ..Default::default()
        };
        assert_eq!(
            model_facts_to_wire(&model_facts_from_wire(facts.clone())),
            facts
        );
    }
    // The first value past each enum's last: a new one needs a core value.
    for (past_the_last, what) in [
        (pb::MarkerKind::try_from(12).is_err(), "marker kind"),
        (
            pb::AllocatorAction::try_from(7).is_err(),
            "allocator action",
        ),
        (pb::AdvisoryKind::try_from(9).is_err(), "advisory kind"),
        (pb::OptimizerKind::try_from(5).is_err(), "optimizer"),
        (pb::Precision::try_from(5).is_err(), "precision"),
        (
            pb::OptimizerImplementation::try_from(4).is_err(),
            "optimizer implementation",
        ),
    ] {
        assert!(past_the_last, "a new {what} needs a core one");
    }
}

#[test]
fn an_unspecified_or_unknown_marker_kind_is_refused_by_name() {
    for kind in [0, 12, -1] {
        let m = pb::Marker {
            kind,
            step: 1,
            ..Default::default()
        };
        let e = marker_from_wire(m).unwrap_err();
        assert_eq!(e, WireError::MarkerKind(kind));
        assert_eq!(e.reason(), "unspecified_kind");
        assert_eq!(
            e.to_string(),
            format!("marker kind is unspecified or unknown ({kind})")
        );
    }
}

#[test]
fn a_trace_event_without_a_known_action_or_an_opening_phase_is_refused_with_its_place() {
    let chunk = |events: Vec<pb::AllocatorEvent>| pb::AllocatorTraceChunk {
        step: 1,
        events,
        ..Default::default()
    };
    let good = pb::AllocatorEvent {
        action: pb::AllocatorAction::Alloc as i32,
        size: 512,
        phase: pb::MarkerKind::ForwardBegin as i32,
        ..Default::default()
    };
    // The index counts events of earlier chunks too.
    let mut trace = AllocatorTrace::default();
    allocator_trace_chunk_from_wire(&mut trace, chunk(vec![good, good])).unwrap();
    let bad_action = pb::AllocatorEvent { action: 0, ..good };
    let e = allocator_trace_chunk_from_wire(&mut trace, chunk(vec![good, bad_action])).unwrap_err();
    assert_eq!(e, WireError::EventAction { index: 3, value: 0 });
    assert_eq!(e.reason(), "allocator_trace_bad_event");
    assert_eq!(
        e.to_string(),
        "allocator trace event 3 has an unspecified or unknown action (0)"
    );
    // STEP_END and OOM open no phase.
    for phase in [
        pb::MarkerKind::StepEnd as i32,
        pb::MarkerKind::Oom as i32,
        0,
        42,
    ] {
        let e = event_from_wire(pb::AllocatorEvent { phase, ..good }, 7).unwrap_err();
        assert_eq!(
            e,
            WireError::EventPhase {
                index: 7,
                value: phase
            }
        );
        assert_eq!(e.reason(), "allocator_trace_bad_event");
        assert!(e
            .to_string()
            .starts_with("allocator trace event 7 names no phase"));
    }
}

#[test]
fn a_trace_chunk_of_another_step_is_refused() {
    let mut trace = AllocatorTrace::default();
    let e = allocator_trace_chunk_from_wire(
        &mut trace,
        pb::AllocatorTraceChunk {
            step: 2,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(e, WireError::TraceNotStepOne(2));
    assert_eq!(e.reason(), "allocator_trace_not_step_one");
    assert_eq!(
        e.to_string(),
        "an allocator trace must come from step 1, not step 2"
    );
}

#[test]
fn only_the_first_settings_sent_count() {
    let settings = |split| pb::AllocatorSettings {
        max_split_size_bytes: split,
        ..Default::default()
    };
    let trace = trace_from_chunks(vec![
        pb::AllocatorTraceChunk {
            step: 1,
            settings: Some(settings(1 << 20)),
            ..Default::default()
        },
        pb::AllocatorTraceChunk {
            step: 1,
            settings: Some(settings(2 << 20)),
            last: true,
            ..Default::default()
        },
    ])
    .unwrap();
    assert_eq!(
        trace.settings.map(|s| s.max_split_size_bytes),
        Some(1 << 20)
    );
}

#[test]
fn an_unknown_model_fact_enum_reads_as_unknown_not_as_an_error() {
    // A newer client's optimizer must not lock it out of an older agent.
    let facts = model_facts_from_wire(pb::ModelFacts {
        optimizer: 99,
        precision: 99,
        optimizer_implementation: 99,
        parameter_count: Some(7),
        ..Default::default()
    });
    assert_eq!(facts.optimizer, OptimizerKind::Unknown);
    assert_eq!(facts.precision, Precision::Unknown);
    assert_eq!(
        facts.optimizer_implementation,
        OptimizerImplementation::Unknown
    );
    assert_eq!(facts.parameter_count, Some(7));
}

#[test]
fn an_advisory_of_unknown_kind_is_refused() {
    let e = advisory_from_wire(pb::Advisory::default()).unwrap_err();
    assert_eq!(e, WireError::AdvisoryKind(0));
}

#[test]
fn a_hello_without_identity_or_facts_reads_as_empty_ones() {
    let info = hello_from_wire(pb::Hello {
        pid: 9,
        ..Default::default()
    });
    assert_eq!(
        info,
        RankInfo {
            pid: 9,
            ..RankInfo::default()
        }
    );
}
