//! The post-mortem of a rank that died of OOM: each cause from its
//! figures, the report's bounds, and a rank whose client sent no report.
//!
//! Unit M = 1 MiB. The GPU has 10000 M; a step holds `held` M between
//! steps and 3000 M more in backward, reserves `held + 3500` M and NVML
//! shows `held + 4000` M at its peak (500 M of context).

use stepwatch_core::*;
use stepwatch_testkit as kit;

use kit::leaking::{GPU, PERIOD};

const M: u64 = 1 << 20;
const CAPACITY: u64 = kit::leaking::CAPACITY_MIB * M;
const CONTEXT: u64 = 500;

fn open(t: &mut Tracker) -> RankKey {
    kit::open(t, kit::solo_rank("job", GPU))
}

/// The device as the driver sees it with `reserved` M in the allocator and
/// `outside` M beyond it.
fn device(reserved: u64, outside: u64) -> DeviceMemory {
    DeviceMemory {
        free_bytes: CAPACITY - (reserved + outside) * M,
        total_bytes: CAPACITY,
    }
}

/// Step `n`, completed, holding `held` M between steps. Step 1's markers
/// carry the driver's figures (500 M of context), as the client sends them.
fn step(t: &mut Tracker, key: &RankKey, n: u64, held: u64) {
    kit::leaking::step(t, key, (n, held, 0), |m| Marker {
        device_memory: (n == 1).then(|| device(held + 3_500, CONTEXT)),
        ..m
    });
}

/// Step `n` dies in its forward with `allocated` and `reserved` M in the
/// allocator; the OOM marker carries them.
fn die(t: &mut Tracker, key: &RankKey, n: u64, allocated: u64, reserved: u64) {
    t.markers(key, &die_markers(n, allocated, reserved), n * PERIOD)
        .unwrap();
}

/// The markers of [`die`].
fn die_markers(n: u64, allocated: u64, reserved: u64) -> Vec<Marker> {
    use MarkerKind::*;
    let t0 = n * PERIOD;
    [(StepBegin, 0), (ForwardBegin, 1), (Oom, 2)]
        .into_iter()
        .map(|(kind, i)| {
            kit::marker_mib(
                kind,
                n,
                t0 + i * PERIOD / 8,
                (allocated, allocated, reserved),
            )
        })
        .collect()
}

/// What the client sends after the OOM marker.
fn report(step: u64, requested: u64, allocated: u64, reserved: u64, outside: u64) -> OomReport {
    OomReport {
        step,
        requested_bytes: requested * M,
        allocator: Some(kit::alloc_mib(allocated, allocated, reserved)),
        segment_count: 3,
        largest_free_block_bytes: (reserved - allocated).min(requested / 2) * M,
        device_memory: Some(device(reserved, outside)),
        message: "CUDA out of memory. Tried to allocate ...".into(),
        ..Default::default()
    }
}

/// Held memory of a job that keeps 40 M more every step from step 2 on.
fn leaked(n: u64) -> u64 {
    2_000 + 40 * n.saturating_sub(1)
}

/// Steps of the leaking job until its NVML peak would pass capacity;
/// returns the step that will die.
fn leak_until_full(t: &mut Tracker, key: &RankKey) -> u64 {
    let mut n = 1;
    while leaked(n) + 4_000 <= 10_000 {
        step(t, key, n, leaked(n));
        n += 1;
    }
    n
}

fn flat(t: &mut Tracker, key: &RankKey, steps: u64) {
    for n in 1..=steps {
        step(t, key, n, 2_000);
    }
}

/// `total_loss += loss`: 40 M more held every step until the step dies.
/// The cause is growth of allocated memory, with its rate.
#[test]
fn a_leak_is_named_growth_with_its_rate() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    let n = leak_until_full(&mut t, &key);
    let allocated = leaked(n) + 2_900;
    let reserved = allocated + 100;
    die(&mut t, &key, n, allocated, reserved);
    t.record_oom_report(&key, report(n, 400, allocated, reserved, CONTEXT), 0)
        .unwrap();
    let pm = t.post_mortem(&key).expect("a post-mortem");
    assert_eq!((pm.step, pm.cause), (n, OomCause::Growth), "{}", pm.message);
    assert_eq!(pm.growth.growth_source, Some(GrowthSource::Allocated));
    assert_eq!(pm.growth.growth_bytes_per_step, Some((40 * M) as f64));
    assert_eq!(pm.phase, Some(PhaseKind::Forward));
    kit::assert_says(
        &pm.message,
        &[
            &format!("in step {n} (forward)"),
            "0.42 GB",
            "41.9 MB per step",
            "What would fit",
        ],
    );
}

/// The post-mortem of a rank flat for 30 steps that dies in step 31 with
/// `allocated` and `reserved` M, its client reporting a request of
/// `requested` M and `outside` M beyond the allocator.
fn dies_after_30_flat(requested: u64, allocated: u64, reserved: u64, outside: u64) -> PostMortem {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    flat(&mut t, &key, 30);
    die(&mut t, &key, 31, allocated, reserved);
    let report = report(31, requested, allocated, reserved, outside);
    t.record_oom_report(&key, report, 0).unwrap();
    t.post_mortem(&key).unwrap()
}

/// Flat, then a request that 4000 M of free cache could hold in total but
/// in no block: fragmentation, and expandable segments in what would fit.
#[test]
fn free_cache_in_no_block_large_enough_is_fragmentation() {
    let pm = dies_after_30_flat(1_000, 5_000, 9_000, CONTEXT);
    assert_eq!(pm.cause, OomCause::Fragmentation, "{}", pm.message);
    assert_eq!(pm.allocator.cached_free_bytes, Some(4_000 * M));
    assert_eq!(pm.allocator.largest_free_block_bytes, Some(500 * M));
    assert!(pm.what_would_fit.contains("expandable_segments:True"));
}

/// Memory outside the allocator grew by 2500 M since step 1's 500 M: another
/// process, though the allocator also held some free cache.
#[test]
fn memory_outside_the_allocator_that_grew_is_another_process() {
    let pm = dies_after_30_flat(1_000, 5_000, 5_500, 3_000);
    assert_eq!(pm.cause, OomCause::OtherProcess, "{}", pm.message);
    assert_eq!(pm.outside.outside_growth_bytes, Some((2_500 * M) as i64));
    assert!(pm.message.contains("another process"), "{}", pm.message);
}

/// A flat job whose last step needed 2000 M more than any before, with no
/// free cache to speak of: a step of another shape.
#[test]
fn a_step_that_needs_more_than_the_steady_ones_is_a_larger_step() {
    let allocated = 2_000 + 3_000 + 2_000;
    let pm = dies_after_30_flat(2_500, allocated, allocated + 100, CONTEXT);
    assert_eq!(pm.cause, OomCause::LargerStep, "{}", pm.message);
    assert_eq!(
        pm.allocator.needed_allocated_bytes,
        Some((allocated + 2_500) * M)
    );
    assert!(pm.message.contains("larger batch"), "{}", pm.message);
}

/// Step 2 dies: the job never reached its steady steps.
#[test]
fn a_death_in_step_two_points_to_the_first_steps() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    step(&mut t, &key, 1, 2_000);
    die(&mut t, &key, 2, 6_000, 6_100);
    let pm = t.post_mortem(&key).unwrap();
    assert_eq!(pm.cause, OomCause::FirstSteps, "{}", pm.message);
    assert!(
        pm.message.contains("before its steady steps"),
        "{}",
        pm.message
    );
}

/// An older client sends no report: the post-mortem reads the OOM marker's
/// figures (no request size), and still names the leak.
#[test]
fn without_a_report_the_oom_markers_figures_are_used() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    let n = leak_until_full(&mut t, &key);
    die(&mut t, &key, n, leaked(n) + 2_900, leaked(n) + 3_000);
    let pm = t.post_mortem(&key).unwrap();
    assert_eq!(pm.cause, OomCause::Growth, "{}", pm.message);
    assert_eq!(pm.allocator.requested_bytes, None);
    assert_eq!(pm.allocator.allocated_bytes, Some((leaked(n) + 2_900) * M));
}

/// A rank alive, or one whose step completed, has no post-mortem; a
/// report for a step that did not die, or over its bounds, is refused and
/// changes nothing.
#[test]
fn reports_out_of_place_or_bounds_are_refused() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    flat(&mut t, &key, 3);
    assert!(t.post_mortem(&key).is_none());
    assert_eq!(
        t.record_oom_report(&key, report(3, 10, 10, 20, CONTEXT), 0),
        Err(OomReportError::NoOomStep(3))
    );
    die(&mut t, &key, 4, 5_000, 5_500);
    assert_eq!(
        t.record_oom_report(&key, report(5, 10, 10, 20, CONTEXT), 0),
        Err(OomReportError::NoOomStep(5))
    );
    let mut big = report(4, 10, 10, 20, CONTEXT);
    big.largest_segments = vec![OomSegment::default(); MAX_OOM_SEGMENTS + 1];
    assert!(matches!(
        t.record_oom_report(&key, big, 0),
        Err(OomReportError::TooLarge {
            field: "largest_segments",
            ..
        })
    ));
    let mut long = report(4, 10, 10, 20, CONTEXT);
    long.message = "x".repeat(MAX_OOM_MESSAGE_BYTES + 1);
    assert!(t.record_oom_report(&key, long, 0).is_err());
    let mut odd = report(4, 10, 10, 20, CONTEXT);
    odd.largest_segments = vec![OomSegment {
        size_bytes: M,
        allocated_bytes: 2 * M,
        ..Default::default()
    }];
    assert!(matches!(
        t.record_oom_report(&key, odd, 0),
        Err(OomReportError::Implausible(..))
    ));
    assert!(t.rank(&key).unwrap().oom_report.is_none());
    // The right one is kept, and survives the journal.
    t.record_oom_report(&key, report(4, 1_000, 5_000, 5_500, CONTEXT), 0)
        .unwrap();
    let before = t.post_mortem(&key).unwrap();
    let mut back = Tracker::new(TrackerConfig::default());
    back.restore(t.journal(100), 0);
    back.gpu_samples(
        GPU,
        &[GpuSample {
            monotonic_ns: 10 * PERIOD,
            used_bytes: 0,
            capacity_bytes: CAPACITY,
        }],
    );
    let after = back.post_mortem(&key).unwrap();
    assert_eq!(
        after.allocator.requested_bytes,
        before.allocator.requested_bytes
    );
    assert_eq!(after.cause, before.cause);
}

/// Step `n` of a job whose activations follow its batch: 2000 M held,
/// 2 M per token in backward, the cache 500 M above, NVML 500 M above that
/// (one sample in backward). The forward's marker says the batch.
fn batch_step(t: &mut Tracker, key: &RankKey, n: u64, tokens: u64) {
    use MarkerKind::*;
    let (held, act) = (2_000, 2 * tokens);
    let reserved = held + act + 500;
    let t0 = n * PERIOD;
    t.gpu_samples(
        GPU,
        &kit::samples_mib(
            &[(t0 + 2 * PERIOD / 8 + 10, reserved + CONTEXT)],
            kit::leaking::CAPACITY_MIB,
        ),
    );
    let markers: Vec<Marker> = [
        (StepBegin, held),
        (ForwardBegin, held),
        (BackwardBegin, held + act),
        (OptimizerBegin, held + 500),
        (OptimizerEnd, held),
        (StepEnd, held),
    ]
    .into_iter()
    .zip(0u64..)
    .map(|((kind, allocated), i)| Marker {
        batch: (kind == ForwardBegin).then(|| tokens_batch(tokens)),
        device_memory: (n == 1).then(|| device(reserved, CONTEXT)),
        ..kit::marker_mib(
            kind,
            n,
            t0 + i * PERIOD / 8,
            (allocated, allocated, reserved),
        )
    })
    .collect();
    t.markers(key, &markers, t0).unwrap();
}

fn tokens_batch(tokens: u64) -> BatchFacts {
    BatchFacts {
        samples: Some(8),
        tokens: Some(tokens),
        shape: vec![8, tokens / 8],
    }
}

/// Step 31 of a job whose 30 steps took 1000 and 1500 tokens dies in its
/// forward on a batch of `tokens`, with 7000 M allocated and 3000 M requested.
fn dies_on_a_batch(tokens: u64) -> PostMortem {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    for n in 1..=30 {
        batch_step(&mut t, &key, n, if n % 2 == 0 { 1_500 } else { 1_000 });
    }
    let markers: Vec<Marker> = die_markers(31, 7_000, 7_100)
        .into_iter()
        .map(|m| Marker {
            batch: (m.kind == MarkerKind::ForwardBegin).then(|| tokens_batch(tokens)),
            ..m
        })
        .collect();
    t.markers(&key, &markers, 31 * PERIOD).unwrap();
    t.record_oom_report(&key, report(31, 3_000, 7_000, 7_100, CONTEXT), 0)
        .unwrap();
    t.post_mortem(&key).unwrap()
}

/// A batch of 4000 tokens after steps of at most 1500: a larger batch, with
/// the largest before it, what it needs by the steps' 2 M per token (5000 M
/// at 1500 tokens + 2500 × 2 M = 10000 M allocated, plus the 500 M of
/// context beyond the allocator; not the 500 M of cache, which PyTorch frees
/// before it gives up), and the largest batch that can fit (1500 + (10000 −
/// 5500) / 2).
#[test]
fn a_batch_larger_than_the_steps_before_is_named_with_what_it_needs() {
    let pm = dies_on_a_batch(4_000);
    assert_eq!(pm.cause, OomCause::LargerBatch, "{}", pm.message);
    let b = pm.batch.as_ref().expect("the step's batch");
    let before = b.largest_before.as_ref().expect("the largest before");
    assert_eq!(before.batch.tokens, Some(1_500));
    assert_eq!(before.allocated_peak_bytes, Some(5_000 * M));
    let needs = b.needs.as_ref().expect("what it needs");
    assert_eq!(needs.allocated_peak_bytes, 10_000 * M);
    assert_eq!(needs.device_peak_bytes, Some(10_500 * M));
    assert_eq!(b.largest_that_can_fit, Some(3_750));
    assert_eq!(b.unit, Some(BatchUnit::Tokens));
    kit::assert_says(
        &pm.message,
        &[
            "on a batch of 8 samples, 4000 tokens",
            "2.7× the largest",
            "1500 tokens, shape 8×187 at step 4",
            "needs at least 10.49 GB allocated, 11.01 GB of the device",
        ],
    );
    assert!(
        pm.what_would_fit.contains(
            "up to the largest the steps fitted (8 samples, 1500 tokens, shape 8×187 at step 4) \
             fit, and none above 3750 tokens can"
        ),
        "{}",
        pm.what_would_fit
    );
}

/// The same death on a batch no larger than the steps': the batch does not
/// explain it, and the generic cause stays.
#[test]
fn a_step_that_needs_more_on_a_batch_seen_before_is_a_larger_step() {
    let pm = dies_on_a_batch(1_500);
    assert_eq!(pm.cause, OomCause::LargerStep, "{}", pm.message);
    assert!(pm.batch.is_some());
}

/// A pass of `kind` after step 25 that fits (4000 M allocated at its end),
/// then one after step 30 that dies with 7000 M allocated requesting 3000 M.
fn dies_in_a_pass(begin: MarkerKind, end: MarkerKind) -> (Tracker, RankKey) {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    let pass = |t: &mut Tracker, after: u64, last: (MarkerKind, u64, u64)| {
        let t0 = after * PERIOD + PERIOD * 7 / 8;
        let markers = [
            kit::marker_mib(begin, after, t0, (2_000, 2_000, 5_500)),
            kit::marker_mib(last.0, after, t0 + 10, (last.1, last.1, last.2)),
        ];
        t.markers(&key, &markers, t0).unwrap();
    };
    for n in 1..=30 {
        step(&mut t, &key, n, 2_000);
        if n == 25 {
            pass(&mut t, n, (end, 4_000, 5_500));
        }
    }
    pass(&mut t, 30, (MarkerKind::Oom, 7_000, 7_100));
    (t, key)
}

/// An evaluation after step 30 dies: its report names step 30 and is kept;
/// the cause is the evaluation, with its need against the steps' peak, the
/// evaluation before it, and the share of its batch that fits: (7100 M
/// reserved + 2400 M free − 2000 M held) / (10000 M − 2000 M held) = 93%.
#[test]
fn a_death_in_an_evaluation_pass_is_named_evaluation() {
    let (mut t, key) = dies_in_a_pass(MarkerKind::EvalBegin, MarkerKind::EvalEnd);
    t.record_oom_report(&key, report(30, 3_000, 7_000, 7_100, CONTEXT), 0)
        .unwrap();
    let pm = t.post_mortem(&key).expect("a post-mortem of the pass");
    assert_eq!(
        (pm.step, pm.cause),
        (30, OomCause::Evaluation),
        "{}",
        pm.message
    );
    assert_eq!(pm.phase, None);
    let pass = pm.died_in_pass.expect("the pass");
    assert_eq!((pass.kind, pass.after_step), (PassKind::Evaluation, 30));
    assert_eq!(pass.steps_allocated_peak_bytes, Some(5_000 * M));
    assert_eq!(pass.allocated_at_begin_bytes, Some(2_000 * M));
    let before = pass.highest_before.expect("the evaluation before it");
    assert_eq!(before.after_step, 25);
    kit::assert_says(&pm.message, &[
        "in an evaluation pass after step 30",
        "needed at least 10.49 GB of allocator memory against the training steps' allocated peak 5.24 GB",
        "the highest evaluation before it (after step 25)",
    ]);
    assert!(
        pm.what_would_fit
            .contains("an evaluation batch of at most 93% of this one's"),
        "{}",
        pm.what_would_fit
    );
}

/// A checkpoint save that dies is named as one, with what a save can do.
#[test]
fn a_death_in_a_checkpoint_save_is_named_checkpoint() {
    let (mut t, key) = dies_in_a_pass(MarkerKind::CheckpointBegin, MarkerKind::CheckpointEnd);
    t.record_oom_report(&key, report(30, 3_000, 7_000, 7_100, CONTEXT), 0)
        .unwrap();
    let pm = t.post_mortem(&key).unwrap();
    assert_eq!(pm.cause, OomCause::Checkpoint, "{}", pm.message);
    assert!(pm.message.contains("in a checkpoint save after step 30"));
    assert!(
        pm.what_would_fit.contains("state_dict"),
        "{}",
        pm.what_would_fit
    );
    // A step after the save is a new life: the pass's OOM is no longer the
    // latest, and neither is there a post-mortem.
    step(&mut t, &key, 31, 2_000);
    assert!(t.post_mortem(&key).is_none());
}

/// The client sends an OOM between steps (the next step's batch moved to
/// the device, code before its first forward) as that step's only marker:
/// the step died before its first forward, and is post-mortemed.
#[test]
fn an_oom_between_steps_is_the_next_steps_before_its_first_forward() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    flat(&mut t, &key, 30);
    let oom = kit::marker_mib(MarkerKind::Oom, 31, 31 * PERIOD, (7_000, 7_000, 7_100));
    t.markers(&key, &[oom], 31 * PERIOD).unwrap();
    t.record_oom_report(&key, report(31, 3_000, 7_000, 7_100, CONTEXT), 0)
        .unwrap();
    let pm = t.post_mortem(&key).unwrap();
    assert_eq!((pm.step, pm.phase), (31, None));
    assert_eq!(pm.cause, OomCause::LargerStep, "{}", pm.message);
    assert!(
        pm.message
            .contains("in step 31 (before its first forward, between steps)"),
        "{}",
        pm.message
    );
}

/// The report's JSON keeps its flat figures (the sub-structs are flattened)
/// and adds `batch` and `pass`.
#[test]
fn the_json_keeps_its_flat_figures() {
    let pm = dies_on_a_batch(4_000);
    let json = serde_json::to_value(&pm).unwrap();
    for key in [
        "step",
        "phase",
        "micro_batch",
        "cause",
        "requested_bytes",
        "allocated_bytes",
        "reserved_bytes",
        "needed_allocated_bytes",
        "step_nvml_peak_bytes",
        "steady_nvml_peak_bytes",
        "steady_allocated_peak_bytes",
        "predicted_peak_bytes",
        "capacity_bytes",
        "outside_bytes",
        "outside_growth_bytes",
        "cached_free_bytes",
        "largest_free_block_bytes",
        "growth_bytes_per_step",
        "growth_source",
        "batch",
        "pass",
        "message",
        "what_would_fit",
    ] {
        assert!(json.get(key).is_some(), "{key} in {json}");
    }
    assert_eq!(json["cause"], "larger_batch");
    assert_eq!(json["requested_bytes"], 3_000 * M);
    assert_eq!(json["batch"]["needs"]["allocated_peak_bytes"], 10_000 * M);
    assert!(json["pass"].is_null());
}

/// A leak of 40 M per step whose steps NVML never sampled (steps shorter
/// than the sampler's period, on a busy node), with 2000 M outside the
/// allocator by the driver's figures at step 1: each step reserves
/// `held + 3500` M, so the device is full once `held + 5500` M pass
/// 10000 M, at step 64. The forecast counts the 2000 M (the reserved level
/// alone put it 50 steps late), and the post-mortem names the growth
/// against the steady steps' reserved peak plus those 2000 M.
#[test]
fn a_leak_nvml_never_sampled_is_forecast_and_named_by_step_1s_driver_figures() {
    const OUTSIDE: u64 = 2_000;
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    // One sample, before step 1: the GPU's capacity, and no step's peak.
    t.gpu_samples(
        GPU,
        &kit::samples_mib(&[(PERIOD / 2, OUTSIDE)], kit::leaking::CAPACITY_MIB),
    );
    let dies_at = (1..)
        .find(|&n| leaked(n) + 3_500 + OUTSIDE > 10_000)
        .unwrap();
    assert_eq!(dies_at, 64);
    for n in 1..dies_at {
        let markers = kit::leaking::markers(n, leaked(n), 0, |m| Marker {
            device_memory: (n == 1).then(|| device(leaked(1) + 3_500, OUTSIDE)),
            ..m
        });
        t.markers(&key, &markers, n * PERIOD).unwrap();
        if n == 30 {
            let f = t.memory_growth(&key).expect("a forecast by step 30");
            assert!(f.oom_step.abs_diff(dies_at) <= 2, "{f:?}");
        }
    }
    let allocated = leaked(dies_at) + 2_900;
    die(&mut t, &key, dies_at, allocated, allocated + 100);
    t.record_oom_report(
        &key,
        report(dies_at, 400, allocated, allocated + 100, OUTSIDE),
        0,
    )
    .unwrap();
    let pm = t.post_mortem(&key).unwrap();
    assert_eq!(pm.before.steady_nvml_peak_bytes, None);
    assert_eq!(pm.cause, OomCause::Growth, "{}", pm.message);
}
