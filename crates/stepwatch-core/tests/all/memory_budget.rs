//! The tracker's memory budget: the retained steps of all ranks together stay
//! within it, step 1 and each rank's current step are never given up, and
//! when nothing is left to give, growth is refused rather than allowed.

use proptest::prelude::*;
use stepwatch_core::*;
use stepwatch_testkit as kit;

fn info(job: &str) -> RankInfo {
    RankInfo {
        job: job.into(),
        rank: 0,
        world_size: 1,
        gpu_uuid: "GPU-a".into(),
        pid: 1,
        ..Default::default()
    }
}

/// One step with `micro_batches` forward/backward pairs, from `t`.
fn step(n: u64, micro_batches: u32, t: &mut u64) -> Vec<Marker> {
    let markers = kit::step_markers(n, micro_batches, *t + 1_000, 1_000);
    *t = markers.last().map_or(*t, |m| m.monotonic_ns);
    markers
}

/// Bytes of one retained step of `micro_batches` (as `approx_bytes` counts).
fn step_bytes(micro_batches: u32) -> u64 {
    let mut timeline = RankTimeline::new(10);
    let mut t = 0;
    timeline
        .apply_batch(&step(1, micro_batches, &mut t))
        .unwrap();
    timeline.approx_bytes()
}

/// A tracker that may hold `bytes` of steps.
fn budgeted(bytes: u64) -> Tracker {
    Tracker::new(TrackerConfig {
        memory_budget_bytes: bytes,
        ..Default::default()
    })
}

fn sum_of_ranks(tracker: &Tracker) -> u64 {
    tracker
        .ranks()
        .map(|(_, r)| r.timeline.approx_bytes())
        .sum()
}

#[test]
fn the_rank_holding_most_gives_up_its_oldest_steps_first() {
    let one = step_bytes(1);
    let mut tracker = budgeted(10 * one);
    let big = tracker.open(info("big"), 0).unwrap();
    let small = tracker.open(info("small"), 0).unwrap();
    let mut t = 0;
    for n in 1..=3 {
        tracker.markers(&small, &step(n, 1, &mut t), t).unwrap();
    }
    for n in 1..=20 {
        tracker.markers(&big, &step(n, 1, &mut t), t).unwrap();
    }
    // 10 steps fit: small keeps its 3, big keeps 7 of its 20.
    assert_eq!(tracker.retained_bytes(), 10 * one);
    assert_eq!(tracker.retained_bytes(), sum_of_ranks(&tracker));
    assert_eq!(tracker.steps_trimmed_total(), 13);
    assert_eq!(kit::step_numbers(&tracker, &small), vec![1, 2, 3]);
    assert_eq!(
        kit::step_numbers(&tracker, &big),
        vec![1, 15, 16, 17, 18, 19, 20]
    );
}

#[test]
fn with_nothing_left_to_give_batches_that_add_phases_are_refused() {
    let mut tracker = budgeted(3 * step_bytes(2));
    let key = tracker.open(info("wide"), 0).unwrap();
    let mut t = 0;
    tracker.markers(&key, &step(1, 2, &mut t), t).unwrap();
    // Step 2 grows without end: it cannot be trimmed, nor can step 1.
    let mut refused = None;
    let mut markers = vec![kit::marker(MarkerKind::StepBegin, 2, t + 1)];
    t += 1;
    for i in 0..1000u32 {
        t += 1_000;
        let kind = if i % 2 == 0 {
            MarkerKind::ForwardBegin
        } else {
            MarkerKind::BackwardBegin
        };
        markers.push(Marker {
            micro_batch: i / 2,
            ..kit::marker(kind, 2, t)
        });
        if let Err(e) = tracker.markers(&key, &markers, t) {
            refused = Some(e);
            break;
        }
        markers.clear();
    }
    let e = refused.expect("growth past the budget is refused");
    assert_eq!(e.reason(), "memory_budget");
    assert!(tracker.retained_bytes() <= 3 * step_bytes(2) + step_bytes(0));
    // Ending the step is still allowed: it adds no phase.
    t += 1_000;
    let end = kit::marker(MarkerKind::StepEnd, 2, t);
    tracker.markers(&key, &[end], t).unwrap();
}

/// Rank `rank` of `job` in `namespace`, one per process.
fn tenant_rank(namespace: &str, job: &str, rank: u32) -> RankInfo {
    RankInfo {
        namespace: namespace.into(),
        rank,
        world_size: 1024,
        pid: 100 + rank,
        ..info(job)
    }
}

#[test]
fn ranks_that_finished_give_way_before_anyone_is_refused() {
    // 91 one-step ranks that disconnect filled the budget and every other
    // rank's markers were refused until they aged out (an hour).
    let wide = step_bytes(200);
    let mut tracker = budgeted(90 * wide);
    let mut t = 0;
    for r in 0..91 {
        let key = tracker.open(tenant_rank("", "burst", r), t).unwrap();
        tracker.markers(&key, &step(1, 200, &mut t), t).unwrap();
        tracker.close(&key, t);
    }
    let polite = tracker.open(tenant_rank("", "polite", 0), t).unwrap();
    for n in 1..=5 {
        tracker
            .markers(&polite, &step(n, 1, &mut t), t)
            .expect("a connected rank is served while finished ranks hold the budget");
    }
    assert!(tracker.retained_bytes() <= 90 * wide);
    assert!(tracker.ranks_evicted_for_memory_total() >= 1);
    // The ones that finished longest ago went first.
    let burst = |r| tracker.rank(&tenant_rank("", "burst", r).key()).is_some();
    assert!(!burst(0));
    assert!(burst(90));
}

#[test]
fn one_namespace_cannot_lock_the_others_out() {
    // Namespace "greedy" holds the whole budget with connected ranks that
    // have nothing to give (each only a wide step 1).
    let wide = step_bytes(200);
    let budget = 8 * wide;
    let mut tracker = budgeted(budget);
    let mut t = 0;
    let mut refused = None;
    for r in 0..20 {
        let key = tracker.open(tenant_rank("greedy", "hog", r), t).unwrap();
        if let Err(e) = tracker.markers(&key, &step(1, 200, &mut t), t) {
            refused = Some(e);
            break;
        }
    }
    let e = refused.expect("the greedy namespace is refused past the budget");
    assert!(e.to_string().contains("\"greedy\""), "{e}");
    // Another namespace is served, up to its share.
    let polite = tracker.open(tenant_rank("polite", "job", 0), t).unwrap();
    for n in 1..=20 {
        tracker
            .markers(&polite, &step(n, 1, &mut t), t)
            .expect("a polite namespace under its share is served");
    }
    // Its growth takes its own oldest steps once over its share, not more.
    let polite_bytes = tracker.rank(&polite).unwrap().timeline.approx_bytes();
    assert!(polite_bytes <= budget / 2 + step_bytes(1), "{polite_bytes}");
    // The greedy namespace stays refused while it holds its share.
    let late = tracker.open(tenant_rank("greedy", "hog", 99), t).unwrap();
    let e = tracker.markers(&late, &step(1, 1, &mut t), t).unwrap_err();
    assert_eq!(e.reason(), "memory_budget");
}

proptest! {
    /// Any mix of ranks, step lengths and budgets: the running count equals
    /// the ranks' own figures, it stays within the budget whenever some rank
    /// still has a step to give, and every rank keeps its step 1.
    #[test]
    fn retained_bytes_are_exact_and_within_the_budget(
        budget_steps in 2u64..40,
        plan in prop::collection::vec((0usize..4, 0u32..6), 1..120),
    ) {
        let budget = budget_steps * step_bytes(1);
        let mut tracker = Tracker::new(TrackerConfig {
            memory_budget_bytes: budget,
            max_retained_steps: 50,
            ..Default::default()
        });
        let keys: Vec<RankKey> = (0..4)
            .map(|r| tracker.open(info(&format!("job-{r}")), 0).unwrap())
            .collect();
        let mut next_step = [1u64; 4];
        let mut t = 0;
        for (rank, micro_batches) in plan {
            let n = next_step[rank];
            if tracker.markers(&keys[rank], &step(n, micro_batches, &mut t), t).is_ok() {
                next_step[rank] += 1;
            }
            prop_assert_eq!(tracker.retained_bytes(), sum_of_ranks(&tracker));
            let can_give = tracker.ranks().any(|(_, r)| r.timeline.steps().len() > 2);
            prop_assert!(!can_give || tracker.retained_bytes() <= budget);
            for (_, r) in tracker.ranks() {
                prop_assert!(r.timeline.steps().next().is_none_or(|s| s.step == 1));
            }
        }
    }
}
