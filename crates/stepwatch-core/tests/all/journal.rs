//! A journal written by one tracker and restored into another gives back the
//! same ranks, timelines and analysis: an agent restart loses no step history.

use stepwatch_core::*;
use stepwatch_testkit as kit;

fn info(rank: u32) -> RankInfo {
    RankInfo {
        job: "j".into(),
        rank,
        world_size: 2,
        local_rank: rank,
        gpu_uuid: "GPU-a".into(),
        pid: 40 + rank,
        ..Default::default()
    }
}

fn steps(n: u64, t0: u64) -> Vec<Marker> {
    let mut out = Vec::new();
    let mut t = t0;
    for step in 1..=n {
        for kind in MarkerKind::STEP_ORDER {
            t += 10_000_000;
            let allocated = match kind {
                MarkerKind::BackwardBegin => 6_000_000_000,
                _ if step > 1 || kind >= MarkerKind::OptimizerEnd => 3_000_000_000,
                _ => 2_000_000_000,
            };
            out.push(Marker {
                allocator: Some(kit::alloc_bytes(allocated, allocated, 7_000_000_000)),
                ..kit::marker(kind, step, t)
            });
        }
    }
    out
}

fn tracker_with_history() -> Tracker {
    let mut tracker = Tracker::new(TrackerConfig::default());
    let samples: Vec<GpuSample> = (0..2_000)
        .map(|i| GpuSample {
            monotonic_ns: 1_000_000 * i,
            used_bytes: 7_500_000_000 + (i % 7) * 1_000_000,
            capacity_bytes: 80_000_000_000,
        })
        .collect();
    tracker.gpu_samples("GPU-a", &samples);
    for rank in 0..2 {
        let key = tracker.open(info(rank), 0).unwrap();
        tracker.markers(&key, &steps(12, 0), 0).unwrap();
        tracker.close(&key, 1);
    }
    tracker
}

#[test]
fn a_restored_journal_gives_back_timelines_and_analysis() {
    let before = tracker_with_history();
    let text = serde_json::to_string(&before.journal(1_000)).unwrap();
    let journal: Journal = serde_json::from_str(&text).unwrap();

    let mut after = Tracker::new(TrackerConfig::default());
    assert_eq!(after.restore(journal, 5), 2);
    for rank in 0..2 {
        let key = RankKey::new("", "j", rank);
        let (b, a) = (before.rank(&key).unwrap(), after.rank(&key).unwrap());
        assert_eq!(a.info, b.info);
        assert_eq!(a.timeline.steps_completed(), 12);
        let steps = |s: &RankState| {
            s.timeline
                .steps()
                .map(|x| (x.step, x.nvml_peak_bytes()))
                .collect::<Vec<_>>()
        };
        assert_eq!(steps(a), steps(b), "per-step NVML peaks survive");
        assert_eq!(a.prediction_before_step2, b.prediction_before_step2);
        assert_eq!(a.connected_streams, 0);
        // The analysis that needs no live samples is the same.
        let (ab, aa) = (
            before.rank_analysis(&key).unwrap(),
            after.rank_analysis(&key).unwrap(),
        );
        assert_eq!(aa.first_step, ab.first_step);
        assert_eq!(aa.steady, ab.steady);
        assert_eq!(aa.steady_state, ab.steady_state);
    }
    // The restored process can reconnect and go on with step 13.
    let key = after.open(info(0), 10).unwrap();
    let next: Vec<Marker> = steps(13, 0).into_iter().filter(|m| m.step == 13).collect();
    after.markers(&key, &next, 11).unwrap();
    assert_eq!(after.rank(&key).unwrap().timeline.steps_completed(), 13);
}

#[test]
fn the_journal_keeps_step_one_and_the_latest_steps_only() {
    let tracker = tracker_with_history();
    let journal = tracker.journal(3);
    let kept: Vec<u64> = journal.ranks[0].timeline.steps().map(|s| s.step).collect();
    assert_eq!(kept, [1, 10, 11, 12]);
    assert_eq!(journal.ranks[0].timeline.steps_completed(), 12);
}

#[test]
fn a_journal_of_another_version_or_a_known_rank_is_not_restored() {
    let tracker = tracker_with_history();
    let mut journal = tracker.journal(10);
    journal.version += 1;
    let mut after = Tracker::new(TrackerConfig::default());
    assert_eq!(after.restore(journal, 0), 0);

    let mut after = Tracker::new(TrackerConfig::default());
    after.open(info(1), 0).unwrap();
    assert_eq!(
        after.restore(tracker.journal(10), 0),
        1,
        "rank 1 is live already"
    );
}

#[test]
fn a_journal_rank_with_an_identity_no_hello_could_carry_is_skipped() {
    let tracker = tracker_with_history();
    let mut journal = tracker.journal(10);
    let listed = journal.ranks.len();
    assert!(listed >= 2, "{listed}");
    journal.ranks[0].info.job = "bad job id with spaces".into();
    journal.ranks[1].info.world_size = 0;
    let mut after = Tracker::new(TrackerConfig::default());
    assert_eq!(after.restore(journal, 0), listed - 2);
}
