//! The allocator-retries advisory: PyTorch's `num_alloc_retries` (sent on
//! every marker's allocator figures) growing after step 1 means the job runs
//! at the GPU's limit. Seen on real PyTorch (fake CUDA): `lightning-gpt` on
//! a tight GPU went 0→1 in step 2, 1→2 in step 3, and died of an OOM in
//! step 4 with no warning after step 1. The figures below are hand-made.

use proptest::prelude::*;
use stepwatch_core::*;
use stepwatch_core::{retries_due, retry_growth, RetryGrowth, FIRST_RETRY_STEP};
use stepwatch_testkit as kit;

const M: u64 = 1 << 20;
const GPU: &str = "GPU-0";

/// A marker of `step` whose allocator figures show `retries` (None: no figures).
fn marker(kind: MarkerKind, step: u64, t: u64, retries: Option<u64>) -> Marker {
    Marker {
        allocator: retries.map(|n| AllocatorStats {
            num_alloc_retries: n,
            ..kit::alloc_mib(1000, 1000, 1200)
        }),
        ..kit::marker(kind, step, t)
    }
}

/// The markers of a step, in order.
const STEP_KINDS: [MarkerKind; 5] = [
    MarkerKind::StepBegin,
    MarkerKind::ForwardBegin,
    MarkerKind::OptimizerBegin,
    MarkerKind::OptimizerEnd,
    MarkerKind::StepEnd,
];

/// A step's markers (begin, forward begin, optimizer begin, optimizer end)
/// at `retries` each, from time `t`; its end at the last figure.
fn step(step: u64, t: u64, retries: [u64; 4]) -> Vec<Marker> {
    STEP_KINDS
        .into_iter()
        .zip(retries.into_iter().chain([retries[3]]))
        .enumerate()
        .map(|(i, (kind, n))| marker(kind, step, t + 10 * i as u64, Some(n)))
        .collect()
}

fn open(t: &mut Tracker, run_id: &str) -> RankKey {
    let info = RankInfo {
        run_id: run_id.into(),
        ..kit::solo_rank("job", GPU)
    };
    kit::open(t, info)
}

fn kinds(advisories: &[Advisory]) -> Vec<AdvisoryKind> {
    advisories.iter().map(|a| a.kind).collect()
}

/// Retries grown in `step`: `retries` more, `total` since the process
/// started.
fn grew(step: u64, retries: u64, total: u64) -> Option<RetryGrowth> {
    Some(RetryGrowth {
        step,
        retries,
        total,
    })
}

#[test]
fn growth_is_counted_from_step_2_on_in_the_step_of_its_marker() {
    use MarkerKind::*;
    assert_eq!(FIRST_RETRY_STEP, 2);
    // Step 1's own retries (0→1→3) are a baseline, not growth.
    let step1 = step(1, 0, [0, 1, 3, 3]);
    assert_eq!(retry_growth(None, &step1), (Some(3), None));
    // 3 → 3, 4, (no figures), 6: step 2 added 1 + 2 = 3, the count is 6.
    let batch = [
        marker(StepBegin, 2, 100, Some(3)),
        marker(ForwardBegin, 2, 110, Some(4)),
        marker(BackwardBegin, 2, 120, None),
        marker(OptimizerBegin, 2, 130, Some(6)),
    ];
    assert_eq!(retry_growth(Some(3), &batch), (Some(6), grew(2, 3, 6)));
    // Step 1's end and step 2's begin in one batch: 0 → 1 between them is
    // step 2's (it happened after step 1 ended).
    let across = [
        marker(StepEnd, 1, 50, Some(0)),
        marker(StepBegin, 2, 60, Some(1)),
    ];
    assert_eq!(retry_growth(None, &across).1, grew(2, 1, 1));
    // The first count seen (a late client) is a baseline, even at step 7.
    assert_eq!(
        retry_growth(None, &step(7, 0, [5, 5, 5, 5])),
        (Some(5), None)
    );
    // A reset of PyTorch's counters (5 → 0) starts afresh; 0 → 2 is growth.
    assert_eq!(
        retry_growth(Some(5), &step(3, 0, [0, 0, 2, 2])).1,
        grew(3, 2, 2)
    );
    // An OOM marker's retry is the failed allocation's: the figure follows,
    // but it is not growth; growth before it in the step still is.
    let dying = [
        marker(ForwardBegin, 2, 0, Some(0)),
        marker(Oom, 2, 10, Some(1)),
    ];
    assert_eq!(retry_growth(Some(0), &dying), (Some(1), None));
    let warned = [
        marker(ForwardBegin, 2, 0, Some(1)),
        marker(Oom, 2, 10, Some(2)),
    ];
    assert_eq!(retry_growth(Some(0), &warned).1, grew(2, 1, 2));
    // Markers without allocator figures change nothing.
    let bare = [marker(StepBegin, 4, 0, None), marker(StepEnd, 4, 10, None)];
    assert_eq!(retry_growth(Some(2), &bare), (Some(2), None));
}

#[test]
fn the_message_says_which_step_how_many_what_it_means_and_what_to_do() {
    let growth = grew(3, 2, 5).unwrap();
    let a = retries_due(growth, None, 42, &[]).unwrap();
    assert_eq!(a.kind, AdvisoryKind::AllocatorRetries);
    assert_eq!((a.step, a.issued_monotonic_ns), (3, 42));
    assert_eq!(
        (
            a.predicted_peak_bytes,
            a.capacity_bytes,
            a.predicted_headroom_bytes
        ),
        (0, 0, 0)
    );
    let m = &a.message;
    kit::assert_says(
        m,
        &[
            "in step 3",
            "retry 2 times (5 since the process started)",
            "at the GPU's memory limit",
            "full cache flush",
            "out-of-memory",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            "smaller micro-batch",
        ],
    );
    // One retry is "1 time"; no prediction, none quoted.
    let one = grew(2, 1, 1).unwrap();
    let m = retries_due(one, None, 0, &[]).unwrap().message;
    assert!(m.contains("retry 1 time (1 since"), "{m}");
    assert!(!m.contains("predicted"), "{m}");
    // Issued once: an advisory of the kind already issued stops the next.
    let first = retries_due(one, None, 0, &[]).unwrap();
    assert_eq!(retries_due(growth, None, 1, &[first]), None);
}

#[test]
fn the_tracker_advises_once_per_run_when_retries_grow_after_step_1() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t, "run-a");
    // Step 1 retries twice (0 → 2): no retries advisory (step 1's are the
    // prediction's business).
    let a = t.markers(&key, &step(1, 100, [0, 1, 2, 2]), 1).unwrap();
    assert!(
        !kinds(&a).contains(&AdvisoryKind::AllocatorRetries),
        "{a:?}"
    );
    assert_eq!(t.rank(&key).unwrap().allocator_retries, Some(2));
    // Step 2 flat: nothing.
    let a = t.markers(&key, &step(2, 200, [2, 2, 2, 2]), 2).unwrap();
    assert!(
        !kinds(&a).contains(&AdvisoryKind::AllocatorRetries),
        "{a:?}"
    );
    // Step 3: 2 → 3 at its optimizer begin: advised, in step 3, 1 retry.
    let a = t.markers(&key, &step(3, 300, [2, 2, 3, 3]), 3).unwrap();
    kit::the_advisory(
        &a,
        AdvisoryKind::AllocatorRetries,
        3,
        "retry 1 time (3 since the process started)",
    );
    // Step 4 grows again (3 → 5): not again for this run; the figure follows.
    let a = t.markers(&key, &step(4, 400, [4, 5, 5, 5]), 4).unwrap();
    assert!(
        !kinds(&a).contains(&AdvisoryKind::AllocatorRetries),
        "{a:?}"
    );
    let state = t.rank(&key).unwrap();
    assert_eq!(state.allocator_retries, Some(5));
    assert_eq!(kit::issued(&t, &key, AdvisoryKind::AllocatorRetries), 1);
    // A new run of the same process (a second fit()): the count is the
    // process's, so the new run starts from a baseline and is advised anew.
    t.close(&key, 5);
    let key = open(&mut t, "run-b");
    assert_eq!(t.rank(&key).unwrap().allocator_retries, None);
    let a = t.markers(&key, &step(1, 500, [5, 5, 5, 5]), 6).unwrap();
    assert!(
        !kinds(&a).contains(&AdvisoryKind::AllocatorRetries),
        "{a:?}"
    );
    let a = t.markers(&key, &step(2, 600, [5, 6, 6, 6]), 7).unwrap();
    assert_eq!(
        kinds(&a)
            .iter()
            .filter(|k| **k == AdvisoryKind::AllocatorRetries)
            .count(),
        1,
        "{a:?}"
    );
}

#[test]
fn the_advisory_quotes_the_prediction_frozen_before_step_2() {
    // A GPU sample gives the capacity (10000 M); step 1's figures give a
    // prediction, frozen when step 2 begins.
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t, "");
    t.gpu_samples(
        GPU,
        &[GpuSample {
            monotonic_ns: 150,
            used_bytes: 1700 * M,
            capacity_bytes: 10_000 * M,
        }],
    );
    t.markers(&key, &step(1, 100, [0, 0, 0, 0]), 1).unwrap();
    let a = t.markers(&key, &step(2, 200, [0, 1, 1, 1]), 2).unwrap();
    let frozen = t
        .rank(&key)
        .unwrap()
        .prediction_before_step2
        .clone()
        .expect("a prediction was frozen");
    let retries = a
        .iter()
        .find(|a| a.kind == AdvisoryKind::AllocatorRetries)
        .expect("advised in step 2");
    // 10000 MiB = 10.49 GB.
    let quoted = format!(
        "before step 2 stepwatch predicted a steady peak of {} of the GPU's 10.49 GB",
        gb(frozen.predicted_peak_bytes as f64)
    );
    assert!(retries.message.contains(&quoted), "{}", retries.message);
}

#[test]
fn the_count_survives_the_journal() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t, "");
    t.markers(&key, &step(1, 100, [0, 0, 4, 4]), 1).unwrap();
    let journal: Journal =
        serde_json::from_str(&serde_json::to_string(&t.journal(10)).unwrap()).unwrap();
    let mut restored = Tracker::new(TrackerConfig::default());
    assert_eq!(restored.restore(journal, 2), 1);
    assert_eq!(restored.rank(&key).unwrap().allocator_retries, Some(4));
}

proptest! {
    /// Whatever the batches: at most one retries advisory per run, and one
    /// exactly when some marker of a step ≥ 2 shows more retries than the
    /// marker with figures before it; the figure kept is the last one sent.
    #[test]
    fn one_advisory_exactly_when_the_count_grew_after_step_1(
        counts in prop::collection::vec(prop::option::of(0u64..4), 1..30),
        batch in 1usize..5,
    ) {
        let mut t = Tracker::new(TrackerConfig::default());
        let key = open(&mut t, "");
        // Five markers a step, steps 1, 2, ...; a None sends no figures.
        let markers: Vec<Marker> = counts
            .iter()
            .enumerate()
            .map(|(i, n)| marker(STEP_KINDS[i % 5], 1 + i as u64 / 5, 100 + 10 * i as u64, *n))
            .collect();
        let mut advised = 0;
        for chunk in markers.chunks(batch) {
            let a = t.markers(&key, chunk, 0).unwrap();
            advised += a.iter().filter(|a| a.kind == AdvisoryKind::AllocatorRetries).count();
        }
        // Hand rule: walk the figures in order.
        let mut last: Option<u64> = None;
        let mut grew = false;
        for m in &markers {
            if let Some(n) = m.allocator.map(|a| a.num_alloc_retries) {
                if m.step >= 2 && m.kind != MarkerKind::Oom && last.is_some_and(|l| n > l) {
                    grew = true;
                }
                last = Some(n);
            }
        }
        prop_assert_eq!(advised, usize::from(grew));
        prop_assert_eq!(t.rank(&key).unwrap().allocator_retries, last);
    }
}
