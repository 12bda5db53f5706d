//! Bad input on the wire gets a gRPC status that names the problem, is
//! counted, and changes nothing else; the agent keeps serving.

mod common;

use std::time::Duration;

use common::wire::*;
use common::*;
use stepwatch_proto::v1::{
    client_message::Kind, AllocatorAction, AllocatorBlock, AllocatorEvent, AllocatorSegment,
    AllocatorTraceChunk, ClientMessage, Marker, MarkerKind,
};
use tonic::Code;

#[test]
fn malformed_and_out_of_range_input_is_refused_and_counted() {
    let agent = Agent::start("validation", 1);
    for (messages, code, says) in [
        (
            vec![hello("j", 5, 2)],
            Code::InvalidArgument,
            "rank 5 is not below world_size 2",
        ),
        (
            vec![hello("bad job!", 0, 1)],
            Code::InvalidArgument,
            "job_id",
        ),
        (vec![batch(step(1, 1))], Code::FailedPrecondition, "Hello"),
    ] {
        agent.refuses(messages, code, says);
    }

    // A good rank with 3 steps, then batches it must refuse.
    let steps = [(1, 1_000), (2, 10_000), (3, 20_000)].map(|(n, t0)| batch(step(n, t0)));
    agent.accepts(
        "valid markers",
        [vec![hello("j", 0, 1)], steps.to_vec()].concat(),
    );
    let mut unspecified = step(4, 40_000);
    unspecified[2].kind = 0;
    let mut out_of_order = step(4, 40_000);
    out_of_order.swap(1, 2);
    // Numbers no client sends: a step near 2^64 (it once ended the real
    // rank's stream), a size no GPU has.
    let mut far_step = step(4, 40_000);
    for m in &mut far_step {
        m.step = u64::MAX;
    }
    let mut huge_size = step(4, 40_000);
    huge_size[1].allocator = Some(stepwatch_proto::v1::AllocatorStats {
        allocated_bytes: u64::MAX - 7,
        ..Default::default()
    });
    let huge: Vec<Marker> = (0..1025)
        .map(|i| marker(MarkerKind::ForwardBegin, 4, 50_000 + i))
        .collect();
    for (markers, says) in [
        (step(2, 30_000), "step 2 does not follow step 3"),
        (unspecified, "unspecified"),
        (out_of_order, "backward_begin cannot follow step_begin"),
        (
            far_step,
            "step = 18446744073709551615 is beyond what any client sends",
        ),
        (huge_size, "allocated_bytes"),
        (huge, "at most 1024"),
    ] {
        let messages = vec![hello("j", 0, 1), batch(markers)];
        agent.refuses(messages, Code::InvalidArgument, says);
    }

    let m = agent.metrics();
    let m = Metrics(m);
    let rejected = |reason| m.rejected(reason).unwrap_or(0.0);
    assert_eq!(rejected("rank_out_of_range"), 1.0);
    assert_eq!(rejected("bad_identity"), 1.0);
    assert_eq!(rejected("no_hello"), 1.0);
    assert_eq!(
        rejected("step_regressed"),
        6.0,
        "the whole batch of 6 counts"
    );
    assert_eq!(rejected("unspecified_kind"), 6.0);
    assert_eq!(rejected("out_of_order"), 6.0);
    assert_eq!(rejected("batch_too_large"), 1025.0);
    assert_eq!(rejected("implausible_value"), 12.0);
    // Rejected batches changed nothing.
    assert_eq!(m.get("stepwatch_markers_received_total", &[]), Some(18.0));
    assert_eq!(
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", "j"), ("rank", "0")]
        ),
        Some(3.0)
    );
    assert_eq!(
        m.get(
            "stepwatch_rank_last_step",
            &[("training_job", "j"), ("rank", "0")]
        ),
        Some(3.0)
    );

    // And the agent keeps serving: the same rank continues with step 4.
    agent.accepts("step 4", vec![hello("j", 0, 1), batch(step(4, 60_000))]);
    agent.wait_metrics("step 4 counted", Duration::from_secs(5), |m| {
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", "j"), ("rank", "0")],
        ) == Some(4.0)
    });
    assert_eq!(agent.get("/readyz").0, 200);
}

#[test]
fn a_marker_flood_on_one_stream_is_refused_with_resource_exhausted() {
    let agent = Agent::start_args("flood", &["--max-marker-rate", "100"]);
    let mut messages = vec![hello("flood", 0, 1)];
    messages.extend((1..=40u64).map(|s| batch(step(s, s * 10_000))));
    agent.refuses(messages, Code::ResourceExhausted, "markers/s");
    let m = Metrics(agent.metrics());
    assert!(m.rejected("rate_limited").unwrap() > 0.0);
    let accepted = m.get("stepwatch_markers_received_total", &[]).unwrap();
    // The burst (100 markers) admits 16 batches of 6, 17 if the bucket
    // refilled a little meanwhile; the rest was refused.
    assert!(
        (96.0..=102.0).contains(&accepted),
        "the burst and no more got in: {accepted}"
    );
}

/// A block of a traced segment, not a gradient.
fn block(size: u64, allocated: bool) -> AllocatorBlock {
    AllocatorBlock {
        size,
        allocated,
        gradient: false,
    }
}

/// Step 1's whole trace in one chunk: one segment at 4 GiB of `blocks`
/// (MiB, allocated), where backward made an 8 MiB gradient `gradient_at`
/// MiB into it and the optimizer 16 MiB of state `state_at` MiB into it.
fn one_segment_trace(
    blocks: &[(u64, bool)],
    gradient_at: u64,
    state_at: u64,
) -> AllocatorTraceChunk {
    const MIB: u64 = 1 << 20;
    let base = 1u64 << 32;
    AllocatorTraceChunk {
        step: 1,
        segments: vec![AllocatorSegment {
            address: base,
            blocks: blocks
                .iter()
                .map(|&(mib, allocated)| block(mib * MIB, allocated))
                .collect(),
            ..Default::default()
        }],
        events: vec![
            alloc(base + gradient_at * MIB, 8 * MIB, MarkerKind::BackwardBegin),
            alloc(base + state_at * MIB, 16 * MIB, MarkerKind::OptimizerBegin),
        ],
        last: true,
        settings: None,
        forward_returns: Vec::new(),
    }
}

/// An allocation of `size` bytes at `address` in the phase `phase` opens.
fn alloc(address: u64, size: u64, phase: MarkerKind) -> AllocatorEvent {
    AllocatorEvent {
        action: AllocatorAction::Alloc as i32,
        address,
        size,
        phase: phase as i32,
        ..Default::default()
    }
}

/// One 64 MiB segment whose first 16 MiB block holds the state allocated in
/// step 1's optimizer phase, as a client would send it.
fn trace_chunk(step: u64, last: bool) -> AllocatorTraceChunk {
    const MIB: u64 = 1 << 20;
    AllocatorTraceChunk {
        step,
        segments: vec![AllocatorSegment {
            address: 1 << 32,
            small_pool: false,
            blocks: vec![block(16 * MIB, true), block(48 * MIB, false)],
            ..Default::default()
        }],
        events: vec![alloc(1 << 32, 16 * MIB, MarkerKind::OptimizerBegin)],
        last,
        settings: None,
        forward_returns: Vec::new(),
    }
}

fn trace(chunk: AllocatorTraceChunk) -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::AllocatorTrace(chunk)),
    }
}

/// Step 1 up to its optimizer end, with allocator figures to predict from.
fn step1_to_optimizer_end(t0: u64) -> Vec<Marker> {
    let mut s = step(1, t0);
    s.pop();
    for (i, m) in s.iter_mut().enumerate() {
        let allocated = [1u64, 1, 3, 2, 2][i] << 30;
        m.allocator = Some(stepwatch_proto::v1::AllocatorStats {
            allocated_bytes: allocated,
            allocated_peak_bytes: allocated,
            reserved_bytes: 3 << 30,
            reserved_peak_bytes: 3 << 30,
            ..Default::default()
        });
    }
    s
}

#[test]
fn allocator_traces_are_checked_counted_and_used_only_during_step_1() {
    let agent = Agent::start("trace-validation", 1);
    // Unusable traces are counted and logged; the stream goes on, so the
    // markers behind them still count. Each goes on a stream of its own
    // (a second trace on one stream is refused), with a marker after it.
    let mut no_phase = trace_chunk(1, false);
    no_phase.events[0].phase = MarkerKind::StepEnd as i32;
    let mut rest = trace_chunk(1, true);
    rest.segments.clear();
    let mut no_action = trace_chunk(1, true);
    no_action.events[0].action = 0;
    // The event says 16 MiB stayed allocated where the layout has a free block.
    let mut mismatch = trace_chunk(1, true);
    mismatch.segments[0].blocks[0].allocated = false;
    // Made under a setting the model does not follow (from the snapshot).
    let mut unmodelled = trace_chunk(1, true);
    unmodelled.settings = Some(stepwatch_proto::v1::AllocatorSettings {
        garbage_collection_threshold: 0.6,
        ..Default::default()
    });
    let unusable = [
        vec![trace(trace_chunk(2, true))],
        // Refused in its first chunk; the second is skipped.
        vec![trace(no_phase), trace(rest)],
        vec![trace(no_action)],
        vec![trace(mismatch)],
        vec![trace(unmodelled)],
    ];
    for (i, traces) in unusable.into_iter().enumerate() {
        let job = format!("u{i}");
        let mut messages = vec![hello(&job, 0, 1), batch(step1_to_optimizer_end(1_000))];
        messages.extend(traces);
        messages.push(batch(vec![marker(MarkerKind::StepEnd, 1, 9_000)]));
        agent.accepts(&format!("the stream of unusable trace {i}"), messages);
    }
    // 70 chunks of 4000 events: over the 262144-event bound.
    let mut big = vec![hello("t", 0, 1)];
    for _ in 0..70 {
        let mut chunk = trace_chunk(1, false);
        chunk.segments.clear();
        chunk.events = vec![chunk_event(); 4000];
        big.push(trace(chunk));
    }
    agent.refuses(big, Code::ResourceExhausted, "at most 262144 events");

    // A good trace during step 1, split over two chunks, is replayed once.
    let mut first = trace_chunk(1, false);
    let events = std::mem::take(&mut first.events);
    let mut second = trace_chunk(1, true);
    second.segments.clear();
    second.events = events;
    let mut messages = vec![hello("t", 0, 1), batch(step1_to_optimizer_end(1_000))];
    messages.extend([trace(first), trace(second.clone())]);
    let twice = [messages.clone(), vec![trace(second.clone())]].concat();
    agent.refuses(twice, Code::FailedPrecondition, "once per stream");
    let m = Metrics(agent.metrics());
    let rejected = |reason| m.rejected(reason).unwrap_or(0.0);
    assert_eq!(rejected("allocator_trace_not_step_one"), 1.0);
    assert_eq!(rejected("allocator_trace_bad_event"), 2.0);
    assert_eq!(rejected("allocator_trace_invalid"), 1.0);
    assert_eq!(rejected("allocator_trace_unmodelled_setting"), 1.0);
    assert_eq!(rejected("allocator_trace_too_large"), 1.0);
    assert_eq!(rejected("duplicate_allocator_trace"), 1.0);
    assert_eq!(
        m.get(
            "stepwatch_allocator_traces_total",
            &[("result", "rejected")]
        ),
        Some(5.0)
    );
    for i in 0..5 {
        let rank = [("training_job", format!("u{i}")), ("rank", "0".to_string())];
        let rank: Vec<(&str, &str)> = rank.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            m.get("stepwatch_rank_steps_completed_total", &rank),
            Some(1.0),
            "the marker after unusable trace {i} counted"
        );
        let (_, body) = agent.get(&format!("/api/v1/jobs/u{i}/ranks/0"));
        let report: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            report["analysis"]["prediction"]["inputs"]["basis"], "allocator",
            "unusable trace {i}: the prediction keeps to the markers"
        );
    }
    assert_eq!(
        m.get(
            "stepwatch_allocator_traces_total",
            &[("result", "replayed")]
        ),
        Some(1.0),
        "the trace before the duplicate was replayed"
    );
    let (code, body) = agent.get("/api/v1/jobs/t/ranks/0");
    assert_eq!(code, 200, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    let inputs = &report["analysis"]["prediction"]["inputs"];
    assert_eq!(inputs["basis"], "allocator_replay", "{report:#}");
    assert_eq!(
        inputs["allocator_replay"]["state_bytes"],
        16 << 20,
        "{report:#}"
    );

    // Once step 2 has begun a trace is counted as late and changes nothing.
    let late = vec![
        hello("t", 0, 1),
        batch(vec![marker(MarkerKind::StepEnd, 1, 9_000)]),
        batch(step(2, 10_000)),
        trace(trace_chunk(1, true)),
        batch(step(3, 20_000)),
    ];
    agent.accepts("a stream with a late trace", late);
    agent.wait_metrics("late trace counted", Duration::from_secs(5), |m| {
        m.get("stepwatch_allocator_traces_total", &[("result", "late")]) == Some(1.0)
            && m.get(
                "stepwatch_rank_last_step",
                &[("training_job", "t"), ("rank", "0")],
            ) == Some(3.0)
    });
}

fn chunk_event() -> AllocatorEvent {
    AllocatorEvent {
        action: AllocatorAction::Free as i32,
        address: 1,
        size: 512,
        phase: MarkerKind::ForwardBegin as i32,
        ..Default::default()
    }
}

/// An agent whose unfinished traces may hold 1 MiB for 1 s.
fn small_trace_budget_agent(tag: &str) -> Agent {
    Agent::start_args(
        tag,
        &[
            "--max-partial-trace-mib",
            "1",
            "--partial-trace-timeout",
            "1s",
        ],
    )
}

/// A chunk of 5,000 events (within 64 KiB on the wire), not the last: a
/// few of them hold the whole 1 MiB budget.
fn big_chunk() -> ClientMessage {
    let mut c = trace_chunk(1, false);
    c.events = vec![chunk_event(); 5_000];
    trace(c)
}

/// Unfinished traces are bounded in bytes across streams and in time; a
/// trace past either is dropped and counted, and the stream goes on.
#[test]
fn unfinished_allocator_traces_are_bounded_in_bytes_and_time() {
    let agent = small_trace_budget_agent("trace-budget");
    let mut step1 = step(1, 1_000);
    step1.pop();
    let mut messages = vec![hello("hoarder", 0, 1), batch(step1.clone())];
    messages.extend((0..12).map(|_| big_chunk()));
    // The stream goes on: step 1 ends normally after the dropped trace.
    messages.push(batch(vec![marker(MarkerKind::StepEnd, 1, 9_000)]));
    agent.accepts("a stream whose trace is over the budget", messages);
    agent.wait_metrics("the budget refusal", Duration::from_secs(5), |m| {
        m.rejected("allocator_trace_over_budget") == Some(1.0)
            && m.steps_completed("hoarder") == Some(1.0)
    });

    // A trace begun and never finished is dropped after the timeout while
    // its stream goes on.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (tx, _inbound) = open_stream(&agent.endpoint()).await;
        tx.send(hello("slow-trace", 0, 1)).await.unwrap();
        tx.send(batch(step1.clone())).await.unwrap();
        tx.send(trace(trace_chunk(1, false))).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            // Empty batches: the stream is alive, the trace is not moving.
            tx.send(batch(Vec::new())).await.unwrap();
            let m = Metrics(agent.metrics());
            let reason = [("reason", "allocator_trace_timeout")];
            if m.get("stepwatch_markers_rejected_total", &reason) == Some(1.0) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no timeout counted");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// Streams that sent part of a trace and then nothing once held the trace
/// budget for good: the timeout fired only when the holder sent again, and
/// every other rank's trace was dropped meanwhile. The timeout runs on the
/// agent's clock.
#[test]
fn a_silent_stream_gives_its_unfinished_trace_back_on_the_agents_clock() {
    let agent = small_trace_budget_agent("trace-silent");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut step1 = step(1, 1_000);
    step1.pop();
    // 4 big chunks hold most of the budget.
    let (_silent, _inbound) = rt.block_on(async {
        let (tx, inbound) = open_stream(&agent.endpoint()).await;
        tx.send(hello("silent", 0, 1)).await.unwrap();
        tx.send(batch(step1.clone())).await.unwrap();
        for _ in 0..4 {
            tx.send(big_chunk()).await.unwrap();
        }
        (tx, inbound)
    });
    // Nothing more comes on that stream, which stays open.
    agent.wait_metrics(
        "the timeout, with no message",
        Duration::from_secs(20),
        |m| m.rejected("allocator_trace_timeout") == Some(1.0),
    );
    // The budget is free again: another rank's trace of the same size fits.
    let mut messages = vec![hello("polite", 0, 1), batch(step1.clone())];
    messages.extend((0..4).map(|_| big_chunk()));
    agent.accepts("another rank's trace", messages);
    let m = Metrics(agent.metrics());
    assert_eq!(m.rejected("allocator_trace_over_budget"), Some(0.0));
}

#[test]
fn facts_sent_after_the_hello_replay_step_1_again_and_bad_ones_are_refused() {
    const MIB: u64 = 1 << 20;
    let agent = Agent::start("model-update", 1);
    // Step 1 to its optimizer end, then its trace: backward made an 8 MiB
    // gradient, the optimizer 16 MiB of state.
    let step1 = step1_to_optimizer_end(1_000);
    let chunk = one_segment_trace(&[(16, true), (8, true), (40, false)], 16, 0);
    let replay = |job: &str| {
        let (code, body) = agent.get(&format!("/api/v1/jobs/{job}/ranks/0"));
        assert_eq!(code, 200, "{body}");
        let report: serde_json::Value = serde_json::from_str(&body).unwrap();
        report["analysis"]["prediction"]["inputs"]["allocator_replay"].clone()
    };
    let step1_then = |job, facts| {
        let update = ClientMessage {
            kind: Some(Kind::ModelUpdate(facts)),
        };
        vec![
            hello(job, 0, 1),
            batch(step1.clone()),
            trace(chunk.clone()),
            update,
        ]
    };
    // What `zero_grad(set_to_none=False)` tells the client.
    let kept = stepwatch_proto::v1::ModelFacts {
        grads_set_to_none: Some(false),
        ..Default::default()
    };
    agent.accepts("a facts update", step1_then("kept", kept.clone()));
    agent.wait_metrics("both replays counted", Duration::from_secs(10), |m| {
        m.get(
            "stepwatch_allocator_traces_total",
            &[("result", "replayed")],
        ) == Some(2.0)
    });
    let r = replay("kept");
    assert_eq!(r["grads_persistent"], true, "{r:#}");
    assert_eq!(r["state_bytes"], 16 * MIB, "{r:#}");

    // Out of bounds: refused, counted, and the facts stay as they were.
    let unsharded = stepwatch_proto::v1::ModelFacts {
        sharding_factor: Some(0),
        ..kept
    };
    let says = "sharding_factor must be at least 1";
    agent.refuses(step1_then("bad", unsharded), Code::InvalidArgument, says);
    let m = Metrics(agent.metrics());
    assert_eq!(m.rejected("invalid_model_update"), Some(1.0));
    assert_eq!(replay("bad")["grads_persistent"], false);
}

#[test]
fn a_ddp_bucket_rebuild_in_the_facts_is_replayed_whether_it_comes_before_or_after_the_trace() {
    const MIB: u64 = 1 << 20;
    let records = TempDir::new("ddp-rebuild-record");
    let record = records.0.join("run.jsonl");
    let mut agent = Agent::start_args("ddp-rebuild", &["--record", record.to_str().unwrap()]);
    agent.wait_ready_with_nvml();
    let step1 = step1_to_optimizer_end(1_000);
    // One segment: DDP's 32 MiB bucket (made before the trace), the 8 MiB
    // gradient backward made, 16 MiB of optimizer state, 8 MiB free.
    let chunk = one_segment_trace(&[(32, true), (8, true), (16, true), (8, false)], 32, 40);
    let rebuild = |old: Vec<u64>, new: Vec<u64>| ClientMessage {
        kind: Some(Kind::ModelUpdate(stepwatch_proto::v1::ModelFacts {
            ddp_bucket_rebuild: Some(stepwatch_proto::v1::DdpBucketRebuild {
                old_bucket_bytes: old,
                new_bucket_bytes: new,
            }),
            ..Default::default()
        })),
    };
    let replayed = |job: &str| {
        let (code, body) = agent.get(&format!("/api/v1/jobs/{job}/ranks/0"));
        assert_eq!(code, 200, "{body}");
        let report: serde_json::Value = serde_json::from_str(&body).unwrap();
        let p = &report["analysis"]["prediction"];
        let explanation = p["explanation"].as_str().unwrap_or_default().to_owned();
        (
            p["inputs"]["allocator_replay"]["ddp_bucket_rebuild"].clone(),
            explanation,
        )
    };
    let new = vec![8 * MIB, 24 * MIB];
    for (job, facts_first) in [("before", true), ("after", false), ("twice", false)] {
        let mut messages = vec![hello(job, 0, 1), batch(step1.clone())];
        let update = || rebuild(vec![32 * MIB], new.clone());
        if facts_first {
            messages.extend([update(), trace(chunk.clone())]);
        } else {
            messages.extend([trace(chunk.clone()), update()]);
        }
        if job == "twice" {
            messages.push(update());
        }
        agent.accepts(job, messages);
    }
    // "before": one replay, with the rebuild; "after": one without, then
    // one with it once the facts came; "twice": the same, the second update
    // leaving the plan as it was. The replays ran before each stream ended.
    let replays = |m: &Metrics| {
        m.get(
            "stepwatch_allocator_traces_total",
            &[("result", "replayed")],
        )
    };
    assert_eq!(replays(&Metrics(agent.metrics())), Some(5.0));
    for job in ["before", "after", "twice"] {
        let (r, explanation) = replayed(job);
        assert_eq!(r["modelled"], true, "{job}: {r:#}");
        assert_eq!(r["old_bucket_bytes"], 32 * MIB, "{job}: {r:#}");
        assert_eq!(r["new_bucket_bytes"], 32 * MIB, "{job}: {r:#}");
        assert_eq!(r["new_buckets"], 2, "{job}: {r:#}");
        assert!(
            explanation.contains("DDP rebuilds its gradient buckets at step 2's first forward"),
            "{job}: {explanation}"
        );
    }

    // No new buckets: refused and counted.
    let no_new_buckets = vec![
        hello("bad-rebuild", 0, 1),
        batch(step1.clone()),
        rebuild(vec![32 * MIB], Vec::new()),
    ];
    let says = "ddp_bucket_rebuild has no new buckets";
    agent.refuses(no_new_buckets, Code::InvalidArgument, says);
    let m = Metrics(agent.metrics());
    assert_eq!(m.rejected("invalid_model_update"), Some(1.0));

    // The record holds each replay's plan: the rebuild next to the trace.
    assert!(agent.terminate().success());
    let text = std::fs::read_to_string(&record).unwrap();
    let plans: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|e| e.get("allocator_trace").cloned())
        .filter(|e| e["key"]["job"] == "after")
        .collect();
    assert_eq!(plans.len(), 2, "{plans:#?}");
    assert!(
        plans[0].get("ddp_bucket_rebuild").is_none(),
        "{:#}",
        plans[0]
    );
    assert_eq!(
        plans[1]["ddp_bucket_rebuild"]["new_bucket_bytes"],
        serde_json::json!(new)
    );
    assert!(plans
        .iter()
        .all(|p| p["trace"].get("ddp_bucket_rebuild").is_none()));
}

#[test]
fn every_refusal_reason_and_known_result_exists_at_zero_from_the_start() {
    // An alert on increase() misses the first burst of a series born at its
    // first refusal; each known reason is exported at 0 before any.
    let agent = Agent::start("zero-reasons", 1);
    let m = Metrics(agent.metrics());
    for reason in stepwatch_agent::REJECT_REASONS {
        assert_eq!(m.rejected(reason), Some(0.0), "{reason}");
    }
    assert_eq!(
        m.count("stepwatch_markers_rejected_total"),
        stepwatch_agent::REJECT_REASONS.len()
    );
    for result in ["replayed", "late", "rejected"] {
        assert_eq!(
            m.get("stepwatch_allocator_traces_total", &[("result", result)]),
            Some(0.0),
            "{result}"
        );
    }
    assert_eq!(
        m.get(
            "stepwatch_advisories_sent_total",
            &[("kind", "ADVISORY_KIND_STEP2_OOM_PREDICTED")]
        ),
        Some(0.0)
    );
}

/// A step-1 trace sent on a still-open stream of a run its process has left
/// for a newer one (a second client in the process) is refused with the
/// stream, and counted with the traces the prediction did not use.
#[test]
fn a_trace_of_a_run_the_process_left_is_refused_and_counted_as_a_rejected_trace() {
    let agent = Agent::start("trace-run-ended", 1);
    let hello_of = |run_id: &str| hello_of_run("left", run_id);
    let steps_of = || {
        let v = rank_report(&agent, "left", 0).unwrap_or_default();
        (
            v["info"]["run_id"].as_str().map(str::to_owned),
            v["steps"].as_array().map(Vec::len),
        )
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let refusal = rt.block_on(async {
        let (old, mut old_inbound) = open_stream(&agent.endpoint()).await;
        old.send(hello_of("fit-1")).await.unwrap();
        old.send(batch(step1_to_optimizer_end(1_000)))
            .await
            .unwrap();
        wait_until("fit-1's step 1 began", Duration::from_secs(10), || {
            steps_of() == (Some("fit-1".into()), Some(1))
        });
        exchange(
            &agent.endpoint(),
            vec![hello_of("fit-2"), batch(step1_to_optimizer_end(1_000))],
        )
        .await
        .expect("the second run starts");
        old.send(trace(trace_chunk(1, true))).await.unwrap();
        refusal(&mut old_inbound, "fit-1's trace").await
    });
    assert_eq!(refusal.code(), Code::FailedPrecondition, "{refusal:?}");
    assert!(refusal.message().contains("\"fit-1\""), "{refusal:?}");
    let m = Metrics(agent.metrics());
    assert_eq!(
        m.get(
            "stepwatch_allocator_traces_total",
            &[("result", "rejected")]
        ),
        Some(1.0),
        "the refused trace is counted"
    );
    assert_eq!(
        m.get(
            "stepwatch_allocator_traces_total",
            &[("result", "replayed")]
        ),
        Some(0.0)
    );
    assert_eq!(m.rejected("run_ended"), Some(1.0));
    assert_eq!(steps_of().0.as_deref(), Some("fit-2"), "fit-2's rank still");
}

#[test]
fn an_oom_report_makes_the_post_mortem_and_a_bad_one_is_counted_not_fatal() {
    use stepwatch_proto::v1::{AllocatorStats, OomReport};
    const MIB: u64 = 1 << 20;
    let agent = Agent::start("oom-report", 1);
    let report = |step, segments| ClientMessage {
        kind: Some(Kind::OomReport(OomReport {
            step,
            requested_bytes: 600 * MIB,
            allocator: Some(AllocatorStats {
                allocated_bytes: 1_000 * MIB,
                reserved_bytes: 3_000 * MIB,
                ..Default::default()
            }),
            largest_free_block_bytes: 300 * MIB,
            segment_count: 4,
            largest_segments: vec![Default::default(); segments],
            message: "CUDA out of memory. Tried to allocate 600.00 MiB".into(),
            ..Default::default()
        })),
    };
    let mut markers = step(1, 1_000);
    markers.extend([
        marker(MarkerKind::StepBegin, 2, 10_000),
        marker(MarkerKind::ForwardBegin, 2, 11_000),
        marker(MarkerKind::Oom, 2, 12_000),
    ]);
    // Over its bounds, then for a step that did not die, then the real one:
    // the first two are counted and the stream goes on.
    let reports = [report(2, 9), report(1, 0), report(2, 0)];
    let messages = [vec![hello("died", 0, 1), batch(markers)], reports.to_vec()].concat();
    agent.accepts("the stream with OOM reports", messages);
    let m = Metrics(agent.metrics());
    assert_eq!(m.rejected("invalid_oom_report"), Some(2.0));
    let (code, body) = agent.get("/api/v1/jobs/died/ranks/0");
    assert_eq!(code, 200, "{body}");
    let r: serde_json::Value = serde_json::from_str(&body).unwrap();
    let pm = &r["post_mortem"];
    assert_eq!(pm["step"], 2, "{pm:#}");
    assert_eq!(pm["phase"], "forward", "{pm:#}");
    assert_eq!(pm["requested_bytes"], 600 * MIB, "{pm:#}");
    assert_eq!(pm["cached_free_bytes"], 2_000 * MIB, "{pm:#}");
    let message = pm["message"].as_str().unwrap();
    assert!(
        message.starts_with("died of a CUDA out-of-memory error in step 2 (forward)"),
        "{message}"
    );
}
