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

fn sum_of_ranks(tracker: &Tracker) -> u64 {
    tracker
        .ranks()
        .map(|(_, r)| r.timeline.approx_bytes())
        .sum()
}

#[test]
fn the_rank_holding_most_gives_up_its_oldest_steps_first() {
    let one = step_bytes(1);
    let mut tracker = Tracker::new(TrackerConfig {
        memory_budget_bytes: 10 * one,
        ..Default::default()
    });
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
    let steps = |key| -> Vec<u64> {
        tracker
            .rank(key)
            .unwrap()
            .timeline
            .steps()
            .map(|s| s.step)
            .collect()
    };
    assert_eq!(steps(&small), vec![1, 2, 3]);
    assert_eq!(steps(&big), vec![1, 15, 16, 17, 18, 19, 20]);
}

#[test]
fn with_nothing_left_to_give_batches_that_add_phases_are_refused() {
    let mut tracker = Tracker::new(TrackerConfig {
        memory_budget_bytes: 3 * step_bytes(2),
        ..Default::default()
    });
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
