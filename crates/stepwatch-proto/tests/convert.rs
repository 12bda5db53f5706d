//! The wire conversions round-trip: core -> wire -> core gives back what
//! went in, and so does wire -> core -> wire for every valid wire value;
//! invalid wire values are refused with an error that names them.

use proptest::prelude::*;
use stepwatch_core::allocator::{BlockLayout, Pool, SegmentLayout};
use stepwatch_core::TraceSettings;
use stepwatch_core::{
    Advisory, AdvisoryKind, AllocatorEvent, AllocatorStats, AllocatorTrace, BatchFacts,
    DdpBucketRebuild, DeviceMemory, Marker, MarkerKind, ModelFacts, OomReport, OomSegment,
    OptimizerImplementation, OptimizerKind, PhaseKind, Precision, RankInfo,
};
use stepwatch_proto::convert::*;
use stepwatch_proto::v1 as pb;

// ---- core values ------------------------------------------------------------

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9._/-]{0,12}"
}

fn model_facts() -> impl Strategy<Value = ModelFacts> {
    (
        (
            any::<Option<u64>>(),
            any::<Option<u64>>(),
            prop::sample::select(vec![
                OptimizerKind::Unknown,
                OptimizerKind::Adam,
                OptimizerKind::SgdMomentum,
                OptimizerKind::Sgd,
                OptimizerKind::Other,
            ]),
            any::<Option<u32>>(),
            prop::sample::select(vec![
                Precision::Unknown,
                Precision::Fp32,
                Precision::MixedBf16,
                Precision::MixedFp16,
                Precision::Bf16,
            ]),
            any::<Option<u32>>(),
        ),
        (
            any::<Option<u32>>(),
            any::<Option<bool>>(),
            any::<Option<bool>>(),
            any::<Option<u32>>(),
            prop::sample::select(vec![
                OptimizerImplementation::Unknown,
                OptimizerImplementation::Foreach,
                OptimizerImplementation::Fused,
                OptimizerImplementation::ForLoop,
            ]),
            prop::option::of((
                prop::collection::vec(any::<u64>(), 0..20),
                prop::collection::vec(any::<u64>(), 0..20),
            )),
        ),
        prop::option::of(batch()),
    )
        .prop_map(
            |((count, bytes, opt, state, precision, shard), rest, largest)| {
                let (accum, precreated, to_none, micro, implementation, rebuild) = rest;
                ModelFacts {
                    parameter_count: count,
                    parameter_bytes: bytes,
                    optimizer: opt,
                    state_bytes_per_parameter: state,
                    precision,
                    sharding_factor: shard,
                    grad_accumulation_steps: accum,
                    state_precreated: precreated,
                    grads_set_to_none: to_none,
                    micro_batch_size: micro,
                    optimizer_implementation: implementation,
                    ddp_bucket_rebuild: rebuild.map(|(old, new)| DdpBucketRebuild {
                        old_bucket_bytes: old,
                        new_bucket_bytes: new,
                    }),
                    largest_batch: largest,
                }
            },
        )
}

/// A batch that says something (an empty one reads back as none).
fn batch() -> impl Strategy<Value = BatchFacts> {
    (
        any::<Option<u64>>(),
        any::<Option<u64>>(),
        prop::collection::vec(any::<u64>(), 0..10),
    )
        .prop_map(|(samples, tokens, shape)| BatchFacts {
            samples,
            tokens,
            shape,
        })
        .prop_filter("says something", |b| !b.is_empty())
}

/// What a hello can say: the agent's own findings (container, attested)
/// are not on the wire.
fn rank_info() -> impl Strategy<Value = RankInfo> {
    (
        (text(), any::<u32>(), any::<u32>(), any::<u32>(), text()),
        (text(), text(), text(), any::<u32>(), text(), text()),
        model_facts(),
        (text(), text()),
    )
        .prop_map(
            |((job, rank, local_rank, world_size, node_name), rest, model, versions)| {
                let (run_id, torch_version) = versions;
                let (pod, namespace, gpu_uuid, pid, framework, framework_version) = rest;
                RankInfo {
                    job,
                    rank,
                    local_rank,
                    world_size,
                    node_name,
                    pod,
                    namespace,
                    container: String::new(),
                    attested: false,
                    gpu_uuid,
                    pid,
                    framework,
                    framework_version,
                    torch_version,
                    model,
                    run_id,
                    tcp_identity: None,
                }
            },
        )
}

/// Every marker kind, drawn by its wire value (the exhaustive test below
/// checks each wire value maps to a kind and back).
fn marker_kind() -> impl Strategy<Value = MarkerKind> {
    (1..=11i32).prop_map(|k| marker_kind_from_wire(k).expect("a kind of the contract"))
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

fn marker() -> impl Strategy<Value = Marker> {
    (
        marker_kind(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        prop::option::of(allocator_stats()),
        prop::collection::vec(segment(), 0..3),
        prop::option::of(device_memory()),
        prop::option::of(batch()),
    )
        .prop_map(
            |(
                kind,
                step,
                monotonic_ns,
                wall_ns,
                micro_batch,
                allocator,
                layout_segments,
                device_memory,
                batch,
            )| Marker {
                kind,
                step,
                monotonic_ns,
                wall_ns,
                micro_batch,
                allocator,
                layout_segments,
                device_memory,
                batch,
            },
        )
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

fn segment() -> impl Strategy<Value = SegmentLayout> {
    (
        any::<u64>(),
        any::<bool>(),
        prop::collection::vec((any::<u64>(), any::<bool>(), any::<bool>()), 0..4),
        any::<u64>(),
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(
            |(address, small, blocks, stream, pool_id, expandable)| SegmentLayout {
                address,
                pool: if small { Pool::Small } else { Pool::Large },
                blocks: blocks
                    .into_iter()
                    .map(|(size, allocated, gradient)| BlockLayout {
                        size,
                        allocated,
                        gradient,
                    })
                    .collect(),
                stream,
                pool_id,
                expandable,
            },
        )
}

/// Every action, in every phase, drawn by its wire value.
fn event() -> impl Strategy<Value = AllocatorEvent> {
    (
        1..=6i32,
        any::<u64>(),
        any::<u64>(),
        prop::sample::select(PhaseKind::ALL.to_vec()),
        any::<u64>(),
    )
        .prop_map(|(action, address, size, phase, stream)| {
            let wire = pb::AllocatorEvent {
                action,
                address,
                size,
                phase: phase_to_wire(phase) as i32,
                stream,
            };
            event_from_wire(wire, 0).expect("an action of the contract")
        })
}

fn trace_settings() -> impl Strategy<Value = TraceSettings> {
    (
        any::<u64>(),
        prop::collection::vec(any::<u32>(), 0..5),
        // Finite: NaN is equal to nothing, itself included.
        -1e6f64..1e6,
        any::<bool>(),
        "[a-z_:,0-9]{0,30}",
    )
        .prop_map(|(split, divisions, gc, expandable, conf)| TraceSettings {
            max_split_size_bytes: split,
            roundup_power2_divisions: divisions,
            garbage_collection_threshold: gc,
            expandable_segments: expandable,
            alloc_conf: conf,
        })
}

/// Step 1's trace (the only step the wire carries), large enough at times
/// to need several chunks.
fn trace() -> impl Strategy<Value = AllocatorTrace> {
    (
        prop::collection::vec(segment(), 0..40),
        prop::collection::vec(event(), 0..3000),
        prop::option::of(trace_settings()),
        prop::collection::vec(0u64..4000, 0..64),
    )
        .prop_map(|(segments, events, settings, mut forward_returns)| {
            forward_returns.sort_unstable();
            AllocatorTrace {
                step: 1,
                segments,
                events,
                settings,
                forward_returns,
                // Not on the wire: the agent takes it from the hello.
                torch_version: String::new(),
            }
        })
}

/// An advisory as the wire carries it: the agent's bookkeeping (when it
/// was issued, the divergence figure) stays in the agent.
fn advisory() -> impl Strategy<Value = Advisory> {
    (
        prop::sample::select(vec![
            AdvisoryKind::Step2OomPredicted,
            AdvisoryKind::LowHeadroom,
            AdvisoryKind::RankDivergence,
            AdvisoryKind::AllocatorRetries,
            AdvisoryKind::LowObservedHeadroom,
            AdvisoryKind::MemoryGrowth,
            AdvisoryKind::ClientClock,
            AdvisoryKind::PredictionFinal,
        ]),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<i64>(),
        text(),
    )
        .prop_map(|(kind, step, peak, capacity, headroom, message)| Advisory {
            kind,
            step,
            issued_monotonic_ns: 0,
            predicted_peak_bytes: peak,
            capacity_bytes: capacity,
            predicted_headroom_bytes: headroom,
            message,
            divergence: None,
        })
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
