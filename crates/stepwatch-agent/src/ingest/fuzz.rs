//! Fuzzing the ingest path in-process: bytes and hostile messages through
//! the wire decoder, the wire→core conversions, the tracker and the
//! allocator-trace replay, exactly as a stream's messages go. The property
//! is that nothing panics and the tracker's bounds hold; every refusal is a
//! value, not a crash.
//!
//! `scripts/test` runs a short pass (500 streams, about 4,000 inputs);
//! `bench/fuzz.sh` runs more than ten million inputs (`STEPWATCH_FUZZ_CASES`
//! streams of 1–15 inputs each).

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use prost::Message;
use stepwatch_core::{GpuSample, Marker, Tracker, TrackerConfig};

use super::*;

/// Streams per run: `STEPWATCH_FUZZ_CASES`, default 500 (a short pass in
/// debug builds).
fn cases() -> u32 {
    std::env::var("STEPWATCH_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500)
}

/// Numbers where bugs live: 0, 1, powers of two, the edges of the types.
fn edgy_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0u64..4096,
        2 => any::<u64>(),
        1 => Just(u64::MAX),
        1 => Just(u64::MAX - 1),
        1 => (0u32..64).prop_map(|b| 1u64 << b),
        1 => (0u32..64).prop_map(|b| (1u64 << b).wrapping_sub(1)),
    ]
}

fn edgy_u32() -> impl Strategy<Value = u32> {
    prop_oneof![3 => 0u32..8, 1 => any::<u32>(), 1 => Just(u32::MAX)]
}

fn identifier() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop_oneof![Just("job-a"), Just("job-b"), Just("")].prop_map(String::from),
        // Any characters, past the 128-byte limit too (cheaper than a regex).
        1 => prop::collection::vec(any::<char>(), 0..140).prop_map(String::from_iter),
    ]
}

fn facts() -> impl Strategy<Value = pb::ModelFacts> {
    (
        proptest::option::of(edgy_u64()),
        proptest::option::of(edgy_u64()),
        0i32..7,
        proptest::option::of(edgy_u32()),
        0i32..7,
        proptest::option::of(edgy_u32()),
        proptest::option::of(edgy_u32()),
        proptest::option::of(edgy_u32()),
        proptest::option::of(any::<bool>()),
    )
        .prop_map(|m| pb::ModelFacts {
            parameter_count: m.0,
            parameter_bytes: m.1,
            optimizer: m.2,
            state_bytes_per_parameter: m.3,
            precision: m.4,
            sharding_factor: m.5,
            grad_accumulation_steps: m.6,
            micro_batch_size: m.7,
            grads_set_to_none: m.8,
            ..Default::default()
        })
}

fn hello() -> impl Strategy<Value = pb::ClientMessage> {
    (
        (
            identifier(),
            edgy_u32(),
            edgy_u32(),
            edgy_u32(),
            identifier(),
        ),
        (any::<u32>(), identifier()),
        facts(),
    )
        .prop_map(
            |((job, rank, local_rank, world, node), (pid, framework), model)| pb::ClientMessage {
                kind: Some(Kind::Hello(pb::Hello {
                    identity: Some(pb::Identity {
                        job_id: job,
                        rank,
                        local_rank,
                        world_size: world,
                        node_name: node,
                        ..Default::default()
                    }),
                    gpu_uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
                    pid,
                    framework,
                    model: Some(model),
                    ..Default::default()
                })),
            },
        )
}

fn allocator_stats() -> impl Strategy<Value = Option<pb::AllocatorStats>> {
    proptest::option::of(
        (edgy_u64(), edgy_u64(), edgy_u64(), edgy_u64(), edgy_u64()).prop_map(
            |(a, ap, r, rp, n)| pb::AllocatorStats {
                allocated_bytes: a,
                allocated_peak_bytes: ap,
                reserved_bytes: r,
                reserved_peak_bytes: rp,
                active_bytes: a,
                active_peak_bytes: ap,
                num_alloc_retries: n,
            },
        ),
    )
}

fn device_memory() -> impl Strategy<Value = Option<pb::DeviceMemory>> {
    proptest::option::of(
        (edgy_u64(), edgy_u64()).prop_map(|(free_bytes, total_bytes)| pb::DeviceMemory {
            free_bytes,
            total_bytes,
        }),
    )
}

fn markers() -> impl Strategy<Value = pb::ClientMessage> {
    prop::collection::vec(
        (
            0i32..9,
            prop_oneof![3 => 1u64..4, 1 => edgy_u64()],
            edgy_u64(),
            allocator_stats(),
            edgy_u32(),
            device_memory(),
        ),
        0..24,
    )
    .prop_map(|ms| {
        let mut t = 0u64;
        let markers = ms
            .into_iter()
            .map(|(kind, step, dt, allocator, micro_batch, device_memory)| {
                // Mostly increasing clocks, sometimes anything.
                t = if dt > 1 << 40 {
                    dt
                } else {
                    t.saturating_add(dt)
                };
                pb::Marker {
                    kind,
                    step,
                    monotonic_ns: t,
                    wall_ns: t,
                    allocator,
                    micro_batch,
                    layout_segments: Vec::new(),
                    device_memory,
                    batch: None,
                }
            })
            .collect();
        pb::ClientMessage {
            kind: Some(Kind::Markers(pb::MarkerBatch { markers })),
        }
    })
}

prop_compose! {
    /// A segment of mostly plausible addresses and block sizes.
    fn segment()(
        address in prop_oneof![3 => (1u64..16).prop_map(|k| k << 21), 1 => edgy_u64()],
        small_pool in any::<bool>(),
        blocks in prop::collection::vec(block(), 0..5),
        stream in 0u64..3,
        pool_id in prop_oneof![3 => Just(0u64), 1 => edgy_u64()],
        expandable in any::<bool>(),
    ) -> pb::AllocatorSegment {
        pb::AllocatorSegment { address, small_pool, blocks, stream, pool_id, expandable }
    }
}

prop_compose! {
    fn block()(
        size in prop_oneof![3 => (1u64..8).prop_map(|k| k * 512), 1 => edgy_u64()],
        (allocated, gradient) in any::<(bool, bool)>(),
    ) -> pb::AllocatorBlock {
        pb::AllocatorBlock { size, allocated, gradient }
    }
}

fn trace_chunk() -> impl Strategy<Value = pb::ClientMessage> {
    let event = (
        0i32..8,
        prop_oneof![3 => (1u64..16).prop_map(|k| k << 21), 1 => edgy_u64()],
        prop_oneof![3 => (1u64..8).prop_map(|k| k * 512), 1 => edgy_u64()],
        0i32..8,
        0u64..3,
    )
        .prop_map(
            |(action, address, size, phase, stream)| pb::AllocatorEvent {
                action,
                address,
                size,
                phase,
                stream,
            },
        );
    let settings = proptest::option::of(
        (
            edgy_u64(),
            prop::collection::vec(edgy_u32(), 0..4),
            any::<f64>(),
            any::<bool>(),
            ".{0,40}",
        )
            .prop_map(
                |(max_split, roundup, gc, expandable, conf)| pb::AllocatorSettings {
                    max_split_size_bytes: max_split,
                    roundup_power2_divisions: roundup,
                    garbage_collection_threshold: gc,
                    expandable_segments: expandable,
                    alloc_conf: conf,
                },
            ),
    );
    (
        prop_oneof![4 => Just(1u64), 1 => edgy_u64()],
        prop::collection::vec(segment(), 0..6),
        prop::collection::vec(event, 0..30),
        any::<bool>(),
        settings,
        prop::collection::vec(edgy_u64(), 0..4),
    )
        .prop_map(
            |(step, segments, events, last, settings, forward_returns)| pb::ClientMessage {
                kind: Some(Kind::AllocatorTrace(pb::AllocatorTraceChunk {
                    step,
                    segments,
                    events,
                    last,
                    settings,
                    forward_returns,
                })),
            },
        )
}

/// An OOM report with figures from the edges, for the step of a short stream.
fn oom_report() -> impl Strategy<Value = pb::OomReport> {
    (
        0u64..6,
        edgy_u64(),
        edgy_u64(),
        prop::collection::vec((edgy_u64(), edgy_u64(), edgy_u64()), 0..10),
        prop::option::of((edgy_u64(), edgy_u64())),
    )
        .prop_map(
            |(step, requested, largest, segments, device)| pb::OomReport {
                step,
                requested_bytes: requested,
                largest_free_block_bytes: largest,
                segment_count: segments.len() as u64,
                largest_segments: segments
                    .into_iter()
                    .map(|(size, allocated, free)| pb::OomSegment {
                        size_bytes: size,
                        allocated_bytes: allocated,
                        largest_free_block_bytes: free,
                        small_pool: false,
                    })
                    .collect(),
                device_memory: device.map(|(free, total)| pb::DeviceMemory {
                    free_bytes: free,
                    total_bytes: total,
                }),
                ..pb::OomReport::default()
            },
        )
}

/// What a stream might carry: messages, or bytes that may not decode.
#[derive(Debug, Clone)]
enum Input {
    Message(Box<pb::ClientMessage>),
    Bytes(Vec<u8>),
    Samples(Vec<(u64, u64)>),
}

fn input() -> impl Strategy<Value = Input> {
    prop_oneof![
        2 => hello().prop_map(|m| Input::Message(Box::new(m))),
        4 => markers().prop_map(|m| Input::Message(Box::new(m))),
        2 => trace_chunk().prop_map(|m| Input::Message(Box::new(m))),
        1 => facts().prop_map(|m| Input::Message(Box::new(pb::ClientMessage {
            kind: Some(Kind::ModelUpdate(m)),
        }))),
        1 => oom_report().prop_map(|m| Input::Message(Box::new(pb::ClientMessage {
            kind: Some(Kind::OomReport(m)),
        }))),
        1 => prop::collection::vec(any::<u8>(), 0..200).prop_map(Input::Bytes),
        // A valid message with bytes flipped.
        1 => (markers(), prop::collection::vec((any::<usize>(), any::<u8>()), 1..6)).prop_map(|(m, flips)| {
            let mut bytes = m.encode_to_vec();
            for (at, b) in flips {
                if !bytes.is_empty() {
                    let i = at % bytes.len();
                    bytes[i] ^= b;
                }
            }
            Input::Bytes(bytes)
        }),
        1 => prop::collection::vec((edgy_u64(), edgy_u64()), 0..20).prop_map(Input::Samples),
    ]
}

/// Inputs (messages, byte strings, sample batches) fed so far.
static FED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Feeds one stream's worth of inputs through the ingest path: the wire
/// conversions, then the step model's input path as the agent calls it.
fn run(inputs: Vec<Input>) {
    use stepwatch_core::feed::{self, ReplayPlan};
    use stepwatch_core::RecordEntry;
    FED.fetch_add(inputs.len() as u64, std::sync::atomic::Ordering::Relaxed);
    let mut tracker = Tracker::new(TrackerConfig {
        max_ranks: 4,
        max_retained_steps: 8,
        memory_budget_bytes: 64 << 10,
        ..TrackerConfig::default()
    });
    let mut key = None;
    let mut trace = TraceAssembly::default();
    let mut now = 0u64;
    for input in inputs {
        now += 1_000;
        let message = match input {
            Input::Message(m) => pb::ClientMessage::decode(m.encode_to_vec().as_slice())
                .expect("what prost encodes, it decodes"),
            Input::Bytes(bytes) => match pb::ClientMessage::decode(bytes.as_slice()) {
                Ok(m) => m,
                Err(_) => continue,
            },
            Input::Samples(samples) => {
                let samples: Vec<GpuSample> = samples
                    .into_iter()
                    .map(|(t, used)| GpuSample {
                        monotonic_ns: t,
                        used_bytes: used,
                        capacity_bytes: 80 << 30,
                    })
                    .collect();
                let gpu = "GPU-00000000-0000-0000-0000-000000000000".into();
                let _ = feed::apply(&mut tracker, &RecordEntry::GpuSamples { gpu, samples });
                continue;
            }
        };
        match message.kind {
            Some(Kind::Hello(h)) => {
                let info = rank_info(h, None);
                let open = RecordEntry::Open { at_ns: now, info };
                key = feed::apply(&mut tracker, &open)
                    .ok()
                    .and_then(|a| a.opened)
                    .map(|o| o.key);
            }
            Some(Kind::Markers(batch)) => {
                let Some(key) = &key else { continue };
                let converted: Result<Vec<Marker>, _> = batch
                    .markers
                    .into_iter()
                    .map(convert::marker_from_wire)
                    .collect();
                if let Ok(markers) = converted {
                    let batch = RecordEntry::Markers {
                        at_ns: now,
                        key: std::borrow::Cow::Borrowed(key),
                        markers: markers.into(),
                        run_id: "".into(),
                    };
                    let _ = feed::apply(&mut tracker, &batch);
                }
            }
            Some(Kind::AllocatorTrace(chunk)) => {
                let Some(key) = &key else { continue };
                if let Ok(Some(complete)) = trace.add(chunk) {
                    let plan = ReplayPlan::for_rank(&tracker, key);
                    if let Ok(replay) = plan.replay(&complete) {
                        let _ = feed::apply_replay(&mut tracker, key, "", replay, now);
                    }
                }
            }
            Some(kind @ (Kind::ModelUpdate(_) | Kind::OomReport(_))) => {
                let Some(key) = key.clone() else { continue };
                let (at_ns, run_id) = (now, String::new());
                let entry = match kind {
                    Kind::ModelUpdate(update) => RecordEntry::ModelFacts {
                        update: convert::model_facts_from_wire(update),
                        at_ns,
                        key,
                        run_id,
                    },
                    Kind::OomReport(report) => RecordEntry::OomReport {
                        report: convert::oom_report_from_wire(report),
                        at_ns,
                        key,
                        run_id,
                    },
                    _ => unreachable!("the arm takes model updates and OOM reports"),
                };
                let _ = feed::apply(&mut tracker, &entry);
            }
            None => {}
        }
    }
    // Reading every report must not panic either.
    let keys: Vec<RankKey> = tracker.ranks().map(|(k, _)| k.clone()).collect();
    for k in &keys {
        let _ = tracker.rank_analysis(k);
        let _ = tracker.post_mortem(k);
        let _ = tracker.job_divergence(&k.namespace, &k.job);
    }
    let journal = tracker.journal(4);
    let text = serde_json::to_string(&journal).expect("a journal serialises");
    let _: stepwatch_core::Journal = serde_json::from_str(&text).expect("and reads back");
    assert!(tracker.rank_count() <= 4);
}

#[test]
fn the_ingest_path_survives_hostile_streams() {
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&prop::collection::vec(input(), 1..16), |inputs| {
            run(inputs);
            Ok(())
        })
        .unwrap();
    println!(
        "fuzz: {} streams, {} inputs through the ingest path, 0 panics",
        cases(),
        FED.load(std::sync::atomic::Ordering::Relaxed)
    );
}
