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
    use MarkerKind::*;
    let t0 = n * PERIOD;
    let markers: Vec<Marker> = [(StepBegin, 0), (ForwardBegin, 1), (Oom, 2)]
        .into_iter()
        .map(|(kind, i)| {
            kit::marker_mib(
                kind,
                n,
                t0 + i * PERIOD / 8,
                (allocated, allocated, reserved),
            )
        })
        .collect();
    t.markers(key, &markers, t0).unwrap();
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
    assert_eq!(pm.growth_source, Some(GrowthSource::Allocated));
    assert_eq!(pm.growth_bytes_per_step, Some((40 * M) as f64));
    assert_eq!(pm.phase, Some(PhaseKind::Forward));
    for words in [
        &format!("in step {n} (forward)"),
        "0.42 GB",
        "41.9 MB per step",
        "What would fit",
    ] {
        assert!(pm.message.contains(words), "{words:?} in {}", pm.message);
    }
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
    assert_eq!(pm.cached_free_bytes, Some(4_000 * M));
    assert_eq!(pm.largest_free_block_bytes, Some(500 * M));
    assert!(pm.what_would_fit.contains("expandable_segments:True"));
}

/// Memory outside the allocator grew by 2500 M since step 1's 500 M: another
/// process, though the allocator also held some free cache.
#[test]
fn memory_outside_the_allocator_that_grew_is_another_process() {
    let pm = dies_after_30_flat(1_000, 5_000, 5_500, 3_000);
    assert_eq!(pm.cause, OomCause::OtherProcess, "{}", pm.message);
    assert_eq!(pm.outside_growth_bytes, Some((2_500 * M) as i64));
    assert!(pm.message.contains("another process"), "{}", pm.message);
}

/// A flat job whose last step needed 2000 M more than any before, with no
/// free cache to speak of: a step of another shape.
#[test]
fn a_step_that_needs_more_than_the_steady_ones_is_a_larger_step() {
    let allocated = 2_000 + 3_000 + 2_000;
    let pm = dies_after_30_flat(2_500, allocated, allocated + 100, CONTEXT);
    assert_eq!(pm.cause, OomCause::LargerStep, "{}", pm.message);
    assert_eq!(pm.needed_allocated_bytes, Some((allocated + 2_500) * M));
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
    assert_eq!(pm.requested_bytes, None);
    assert_eq!(pm.allocated_bytes, Some((leaked(n) + 2_900) * M));
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
    assert_eq!(after.requested_bytes, before.requested_bytes);
    assert_eq!(after.cause, before.cause);
}
