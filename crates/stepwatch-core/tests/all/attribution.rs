//! Property tests: attribution of GPU samples to phases never loses or
//! double-counts a sample, and does not depend on arrival order.

use proptest::prelude::*;
use stepwatch_core::*;
use stepwatch_testkit as kit;

fn info(job: &str, rank: u32, gpu: &str) -> RankInfo {
    RankInfo {
        job: job.into(),
        rank,
        world_size: 2,
        local_rank: rank,
        gpu_uuid: gpu.into(),
        pid: 100 + rank,
        ..Default::default()
    }
}

/// A tracker with `config` and rank 0 of job `j` open on GPU-a.
fn one_rank(config: TrackerConfig) -> (Tracker, RankKey) {
    let mut tracker = Tracker::new(config);
    let key = kit::open(&mut tracker, info("j", 0, "GPU-a"));
    (tracker, key)
}

fn config() -> TrackerConfig {
    TrackerConfig {
        max_samples_per_gpu: 100_000,
        ..Default::default()
    }
}

/// (rank, step, phase index) → (samples, peak, sum) for every closed phase.
fn phase_stats(tracker: &Tracker) -> Vec<(u32, u64, usize, SampleStats)> {
    let mut out = Vec::new();
    for (key, state) in tracker.ranks() {
        for step in state.timeline.steps() {
            for (i, p) in step.phases.iter().enumerate() {
                if p.end_monotonic_ns.is_some() {
                    out.push((key.rank, step.step, i, p.nvml));
                }
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
enum Event {
    Markers(u32, Vec<Marker>),
    Samples(String, Vec<GpuSample>),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn attribution_is_exact_and_order_independent(
        steps in 1u64..4,
        micro in 1u32..3,
        gaps in prop::collection::vec(1u64..50, 1..8),
        sample_times in prop::collection::vec(0u64..2_000, 0..200),
        marker_chunk in 1usize..6,
        sample_chunk in 1usize..20,
        shuffle_seed in any::<u64>(),
        same_gpu in any::<bool>(),
    ) {
        let gpus = ["GPU-a", if same_gpu { "GPU-a" } else { "GPU-b" }];
        let rank_markers: Vec<Vec<Marker>> = (0..2)
            .map(|r| kit::markers_spaced(steps, micro, &gaps.iter().map(|g| g + r as u64).collect::<Vec<_>>()))
            .collect();
        let samples: Vec<(String, GpuSample)> = sample_times
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let gpu = gpus[i % 2].to_string();
                (gpu, GpuSample { monotonic_ns: 1_000 + t, used_bytes: (t * 7919) % 1_000_003, capacity_bytes: 1 << 40 })
            })
            .collect();

        // Build the event list: per-rank marker batches stay in order; sample
        // batches go anywhere.
        let mut events = Vec::new();
        for (r, ms) in rank_markers.iter().enumerate() {
            for chunk in ms.chunks(marker_chunk) {
                events.push(Event::Markers(r as u32, chunk.to_vec()));
            }
        }
        for chunk in samples.chunks(sample_chunk) {
            for gpu in gpus.iter().collect::<std::collections::BTreeSet<_>>() {
                let batch: Vec<GpuSample> = chunk.iter().filter(|(g, _)| g == *gpu).map(|(_, s)| *s).collect();
                events.push(Event::Samples(gpu.to_string(), batch));
            }
        }
        // Deterministic shuffle that keeps each rank's marker batches in order.
        let mut rng = shuffle_seed;
        let mut next = || { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; rng };
        let mut queues: Vec<std::collections::VecDeque<Event>> = vec![Default::default(); 3];
        for e in events {
            let q = match &e { Event::Markers(r, _) => *r as usize, Event::Samples(..) => 2 };
            queues[q].push_back(e);
        }
        let mut shuffled = Vec::new();
        while queues.iter().any(|q| !q.is_empty()) {
            let live: Vec<usize> = (0..3).filter(|&i| !queues[i].is_empty()).collect();
            let pick = live[(next() % live.len() as u64) as usize];
            shuffled.push(queues[pick].pop_front().unwrap());
        }

        let mut tracker = Tracker::new(config());
        for (r, gpu) in gpus.iter().enumerate() {
            tracker.open(info("job", r as u32, gpu), 0).unwrap();
        }
        for e in &shuffled {
            match e {
                Event::Markers(r, ms) => {
                    tracker.markers(&RankKey::new("", "job", *r), ms, 0).unwrap();
                }
                Event::Samples(gpu, ss) => tracker.gpu_samples(gpu, ss),
            }
        }

        // Oracle: every closed phase holds exactly the samples of its GPU
        // whose time falls in [start, end).
        for (key, state) in tracker.ranks() {
            let gpu = gpus[key.rank as usize];
            let mut credited = 0;
            for step in state.timeline.steps() {
                for p in step.phases.iter().filter(|p| p.end_monotonic_ns.is_some()) {
                    let mut want = SampleStats::default();
                    for (_, s) in samples.iter().filter(|(g, s)| g == gpu && p.contains(s.monotonic_ns)) {
                        want.add(s.used_bytes);
                    }
                    prop_assert_eq!(p.nvml, want, "rank {} step {} phase {:?}", key.rank, step.step, p.phase);
                    credited += p.nvml.samples;
                }
            }
            // Never double-counts: no more credits than samples of that GPU.
            prop_assert!(credited <= samples.iter().filter(|(g, _)| g == gpu).count() as u64);
        }

        // Same result as markers-first, samples-after.
        let mut ordered = Tracker::new(config());
        for (r, gpu) in gpus.iter().enumerate() {
            ordered.open(info("job", r as u32, gpu), 0).unwrap();
        }
        for (r, ms) in rank_markers.iter().enumerate() {
            ordered.markers(&RankKey::new("", "job", r as u32), ms, 0).unwrap();
        }
        for (gpu, s) in &samples {
            ordered.gpu_samples(gpu, &[*s]);
        }
        prop_assert_eq!(phase_stats(&tracker), phase_stats(&ordered));
    }
}

#[test]
fn step_and_phase_durations_follow_markers() {
    let (mut tracker, key) = one_rank(TrackerConfig::default());
    let ms = kit::markers_spaced(3, 2, &[10]);
    tracker.markers(&key, &ms, 0).unwrap();
    let tl = &tracker.rank(&key).unwrap().timeline;
    assert_eq!(tl.steps_completed(), 3);
    let last = tl.last_completed().unwrap();
    assert_eq!(last.step, 3);
    // step begin .. step end spans 7 gaps of 10 ns (2 micro-batches).
    assert_eq!(last.duration_ns(), Some(70));
    assert_eq!(last.phase_duration_ns(PhaseKind::Forward), Some(20));
    assert_eq!(last.phase_duration_ns(PhaseKind::Backward), Some(20));
    assert_eq!(last.phase_duration_ns(PhaseKind::Optimizer), Some(10));
}

#[test]
fn a_bad_marker_rejects_its_whole_batch_and_changes_nothing() {
    let (mut tracker, key) = one_rank(TrackerConfig::default());
    let mut ms = kit::markers_spaced(2, 1, &[10]);
    tracker.markers(&key, &ms[..6], 0).unwrap();
    // A backward that follows a step begin is out of order.
    ms[7].kind = MarkerKind::BackwardBegin;
    let err = tracker.markers(&key, &ms[6..], 0).unwrap_err();
    assert_eq!(err.reason(), "out_of_order");
    let tl = &tracker.rank(&key).unwrap().timeline;
    assert_eq!(tl.steps_completed(), 1);
    assert_eq!(tl.steps().count(), 1);

    // Steps never go backwards.
    let err = tracker.markers(&key, &ms[..1], 0).unwrap_err();
    assert!(matches!(err, MarkerError::StepRegressed { .. }), "{err}");
    // Clocks never go backwards.
    let mut early = ms[6].clone();
    early.monotonic_ns = 1;
    assert_eq!(
        tracker.markers(&key, &[early], 0).unwrap_err().reason(),
        "clock_regressed"
    );
}

#[test]
fn lost_markers_do_not_lock_a_rank_out() {
    let (mut tracker, key) = one_rank(TrackerConfig::default());
    let ms = kit::markers_spaced(3, 1, &[10]);
    // Step 1 loses its step end, step 2 loses its step begin.
    let kept: Vec<Marker> = ms
        .into_iter()
        .filter(|m| !(m.step == 1 && m.kind == MarkerKind::StepEnd))
        .filter(|m| !(m.step == 2 && m.kind == MarkerKind::StepBegin))
        .collect();
    tracker.markers(&key, &kept, 0).unwrap();
    let tl = &tracker.rank(&key).unwrap().timeline;
    let outcomes: Vec<StepOutcome> = tl.steps().map(|s| s.outcome).collect();
    assert_eq!(
        outcomes,
        [
            StepOutcome::Abandoned,
            StepOutcome::Completed,
            StepOutcome::Completed
        ]
    );
}

#[test]
fn retention_keeps_step_one_and_the_newest_steps() {
    let (mut tracker, key) = one_rank(TrackerConfig {
        max_retained_steps: 5,
        ..Default::default()
    });
    tracker
        .markers(&key, &kit::markers_spaced(20, 1, &[10]), 0)
        .unwrap();
    let steps = kit::step_numbers(&tracker, &key);
    assert_eq!(steps, [1, 17, 18, 19, 20]);
}

#[test]
fn idle_ranks_are_evicted_after_retention() {
    let (mut tracker, key) = one_rank(TrackerConfig::default());
    assert_eq!(tracker.evict_idle(1_000, 10), 0, "a connected rank stays");
    tracker.close(&key, 1_000);
    assert_eq!(tracker.evict_idle(1_005, 10), 0);
    assert_eq!(tracker.evict_idle(1_010, 10), 1);
    assert_eq!(tracker.rank_count(), 0);
}

#[test]
fn rank_limit_is_enforced() {
    let mut tracker = Tracker::new(TrackerConfig {
        max_ranks: 1,
        ..Default::default()
    });
    tracker.open(info("j", 0, "GPU-a"), 0).unwrap();
    assert_eq!(
        tracker.open(info("j", 1, "GPU-a"), 0),
        Err(OpenError::TooManyRanks(1))
    );
}

#[test]
fn a_full_table_evicts_the_rank_that_finished_longest_ago_and_refuses_only_when_all_are_live() {
    let mut tracker = Tracker::new(TrackerConfig {
        max_ranks: 3,
        ..Default::default()
    });
    let a = tracker.open(info("a", 0, "GPU-a"), 0).unwrap();
    let b = tracker.open(info("b", 0, "GPU-a"), 0).unwrap();
    let c = tracker.open(info("c", 0, "GPU-a"), 0).unwrap();
    // b finished first, then a; c is live.
    tracker.close(&b, 100);
    tracker.close(&a, 200);
    let opened = tracker.open_evicting(info("d", 0, "GPU-a"), 300).unwrap();
    let d = opened.key;
    assert_eq!(opened.evicted, Some(b.clone()));
    assert!(tracker.rank(&b).is_none() && tracker.rank(&a).is_some());
    let opened = tracker.open_evicting(info("e", 0, "GPU-a"), 400).unwrap();
    assert_eq!(opened.evicted, Some(a));
    // c, d, e are all connected: nothing gives way.
    assert_eq!(
        tracker.open(info("f", 0, "GPU-a"), 500),
        Err(OpenError::TooManyRanks(3))
    );
    assert!(tracker.rank(&c).is_some() && tracker.rank(&d).is_some());
    assert_eq!(tracker.rank_count(), 3);
}
