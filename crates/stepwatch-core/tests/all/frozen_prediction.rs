//! The prediction is frozen just before step 2 begins, whatever the batching.

use stepwatch_core::*;
use stepwatch_testkit as kit;

fn info() -> RankInfo {
    RankInfo {
        pid: 7,
        ..kit::solo_rank("j", "GPU-a")
    }
}

/// Two steps of one rank whose optimizer phase allocates 1 GB of state.
fn markers() -> Vec<Marker> {
    const GB: u64 = 1_000_000_000;
    let alloc = |allocated: u64| AllocatorStats {
        allocated_bytes: allocated,
        allocated_peak_bytes: allocated,
        reserved_bytes: allocated,
        reserved_peak_bytes: allocated,
        ..Default::default()
    };
    let mut out = Vec::new();
    let mut t = 1_000_000;
    for step in 1..=2 {
        let state = if step == 1 { 0 } else { GB };
        for (kind, allocated) in [
            (MarkerKind::StepBegin, 2 * GB + state),
            (MarkerKind::ForwardBegin, 2 * GB + state),
            (MarkerKind::BackwardBegin, 6 * GB + state),
            (MarkerKind::OptimizerBegin, 3 * GB + state),
            (MarkerKind::OptimizerEnd, 3 * GB + GB),
            (MarkerKind::StepEnd, 2 * GB + GB),
        ] {
            t += 10_000_000;
            out.push(Marker {
                allocator: Some(alloc(allocated)),
                ..kit::marker(kind, step, t)
            });
        }
    }
    out
}

fn samples() -> Vec<GpuSample> {
    (0..200)
        .map(|i| GpuSample {
            monotonic_ns: 1_000_000 + i * 1_000_000,
            used_bytes: 7_000_000_000,
            capacity_bytes: 80_000_000_000,
        })
        .collect()
}

fn run(batches: &[&[Marker]]) -> (Option<Prediction>, Option<Prediction>) {
    let mut tracker = Tracker::new(TrackerConfig::default());
    let key = tracker.open(info(), 0).unwrap();
    tracker.gpu_samples("GPU-a", &samples());
    let mut after_step1 = None;
    for batch in batches {
        tracker.markers(&key, batch, 0).unwrap();
        if tracker.rank(&key).unwrap().timeline.steps().len() == 1 {
            after_step1 = tracker.rank_analysis(&key).and_then(|a| a.prediction);
        }
    }
    (
        after_step1,
        tracker.rank(&key).unwrap().prediction_before_step2.clone(),
    )
}

#[test]
fn prediction_is_frozen_at_the_first_marker_of_step_2() {
    let all = markers();
    let (seen_after_step1, frozen_split) = run(&[&all[..6], &all[6..]]);
    let seen = seen_after_step1.expect("a prediction after step 1");
    let frozen_split = frozen_split.expect("frozen when step 2 began");
    assert_eq!(frozen_split, seen);
    // One batch holding both steps freezes the same figure.
    let (_, frozen_whole) = run(&[&all]);
    assert_eq!(frozen_whole, Some(seen));
}

#[test]
fn a_rejected_batch_freezes_nothing() {
    let mut all = markers();
    let mut tracker = Tracker::new(TrackerConfig::default());
    let key = tracker.open(info(), 0).unwrap();
    all[8].kind = MarkerKind::OptimizerEnd; // out of order in step 2
    assert!(tracker.markers(&key, &all, 0).is_err());
    let state = tracker.rank(&key).unwrap();
    assert!(state.prediction_before_step2.is_none());
    assert_eq!(state.timeline.steps().len(), 0);
}

#[test]
fn a_batch_holding_step_2s_begin_still_gets_the_step_2_warning() {
    let mut tracker = Tracker::new(TrackerConfig::default());
    let key = tracker.open(info(), 0).unwrap();
    // A GPU too small for step 2 (7.5 GB, 7 GB in use during step 1).
    let small: Vec<GpuSample> = samples()
        .into_iter()
        .map(|s| GpuSample {
            capacity_bytes: 7_500_000_000,
            ..s
        })
        .collect();
    tracker.gpu_samples("GPU-a", &small);
    let all = markers();
    // Step 1 up to its optimizer end, then step end + all of step 2 in one batch.
    assert!(
        tracker.markers(&key, &all[..4], 0).unwrap().is_empty(),
        "no state yet, no warning"
    );
    let due = tracker.markers(&key, &all[4..], 1).unwrap();
    assert_eq!(due.len(), 2, "{due:?}");
    assert_eq!(due[0].kind, AdvisoryKind::Step2OomPredicted);
    assert_eq!(due[0].step, 1);
    assert!(due[0].predicted_headroom_bytes < 0);
    // Then, step 1 having ended, word that its prediction is final.
    assert_eq!(due[1].kind, AdvisoryKind::PredictionFinal);
    assert_eq!(due[1].predicted_peak_bytes, due[0].predicted_peak_bytes);
    assert!(
        due[1].message.contains("will likely run out"),
        "{}",
        due[1].message
    );
    let state = tracker.rank(&key).unwrap();
    assert_eq!(state.advisories, due);
    assert!(state.prediction_before_step2.as_ref().unwrap().oom_risk);
}

#[test]
fn step_1s_end_makes_the_prediction_final_once_also_when_step_2_fits() {
    let mut tracker = Tracker::new(TrackerConfig::default());
    let key = tracker.open(info(), 0).unwrap();
    tracker.gpu_samples("GPU-a", &samples());
    let all = markers();
    // Up to step 1's optimizer end: predicted, not final yet.
    assert!(tracker.markers(&key, &all[..4], 0).unwrap().is_empty());
    let end = all
        .iter()
        .position(|m| m.kind == MarkerKind::StepEnd)
        .unwrap();
    assert_eq!(all[end].step, 1);
    assert!(tracker.markers(&key, &all[4..end], 1).unwrap().is_empty());
    let due = tracker.markers(&key, &all[end..=end], 2).unwrap();
    assert_eq!(due.len(), 1, "{due:?}");
    let f = &due[0];
    assert_eq!(f.kind, AdvisoryKind::PredictionFinal);
    assert_eq!(f.step, 1);
    let p = tracker.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(f.predicted_peak_bytes, p.predicted_peak_bytes);
    assert!(f.message.contains("predicted to fit"), "{}", f.message);
    // Once: the rest of the run adds none.
    let rest = tracker.markers(&key, &all[end + 1..], 3).unwrap();
    assert!(rest.iter().all(|a| a.kind != AdvisoryKind::PredictionFinal));
}

#[test]
fn the_frozen_prediction_is_the_one_made_before_step_2s_first_marker() {
    // Step 1 never sends its StepEnd: the first marker of step 2 abandons it.
    // The frozen prediction is still step 1's running one, not a prediction
    // made after step 2's marker was applied.
    let all = markers();
    let mut tracker = Tracker::new(TrackerConfig::default());
    let key = tracker.open(info(), 0).unwrap();
    tracker.gpu_samples("GPU-a", &samples());
    tracker.markers(&key, &all[..5], 0).unwrap();
    let before = tracker.rank_analysis(&key).and_then(|a| a.prediction);
    tracker.markers(&key, &all[6..7], 0).unwrap();
    let frozen = tracker.rank(&key).unwrap().prediction_before_step2.clone();
    let frozen = frozen.expect("frozen at step 2's begin");
    assert!(frozen.provisional, "{frozen:?}");
    assert_eq!(frozen.inputs.step_outcome, StepOutcome::Running);
    assert_eq!(Some(frozen), before);
}
