//! Evaluation passes and checkpoint saves between steps, and batch facts
//! on markers: what the timeline accepts, refuses and keeps.

use stepwatch_core::*;

use stepwatch_testkit::{marker, marker_mib, MIB as M};

fn full_step(n: u64, t0: u64) -> Vec<Marker> {
    MarkerKind::STEP_ORDER
        .iter()
        .enumerate()
        .map(|(i, &k)| marker(k, n, t0 + i as u64 * 10))
        .collect()
}

#[test]
fn a_pass_between_steps_is_kept_apart_from_the_steps() {
    use MarkerKind::*;
    let mut tl = RankTimeline::new(100);
    tl.apply_batch(&full_step(1, 0)).unwrap();
    tl.apply_batch(&[
        marker_mib(EvalBegin, 1, 100, (500, 800, 800)),
        marker_mib(EvalEnd, 1, 150, (500, 1_300, 1_300)),
    ])
    .unwrap();
    tl.apply_batch(&full_step(2, 200)).unwrap();
    // A checkpoint the client did not end: the next step ends it.
    tl.apply_batch(&[marker(CheckpointBegin, 2, 300)]).unwrap();
    tl.apply_batch(&full_step(3, 400)).unwrap();

    assert_eq!(tl.steps().len(), 3);
    assert_eq!(tl.steps_completed(), 3);
    let passes: Vec<&PassRecord> = tl.passes().collect();
    assert_eq!(passes.len(), 2);
    assert_eq!(
        (passes[0].kind, passes[0].after_step, passes[0].outcome),
        (PassKind::Evaluation, 1, PassOutcome::Completed)
    );
    assert_eq!(passes[0].duration_ns(), Some(50));
    assert_eq!(
        passes[0].allocator_at_end.map(|a| a.allocated_peak_bytes),
        Some(1_300 * M)
    );
    assert_eq!(
        (
            passes[1].kind,
            passes[1].after_step,
            passes[1].end_monotonic_ns
        ),
        (PassKind::Checkpoint, 2, Some(400))
    );
    assert_eq!(tl.passes_begun(PassKind::Evaluation), 1);
    assert_eq!(tl.passes_begun(PassKind::Checkpoint), 1);
}

#[test]
fn a_pass_before_the_first_step_names_step_0() {
    use MarkerKind::*;
    let mut tl = RankTimeline::new(100);
    // Lightning's sanity check runs validation before training.
    tl.apply_batch(&[marker(EvalBegin, 0, 1), marker(EvalEnd, 0, 2)])
        .unwrap();
    tl.apply_batch(&full_step(1, 10)).unwrap();
    assert_eq!(tl.steps().next().map(|s| s.step), Some(1));
    assert_eq!(tl.passes().next().map(|p| p.after_step), Some(0));
}

#[test]
fn misplaced_pass_markers_are_refused_and_change_nothing() {
    use MarkerKind::*;
    let mut tl = RankTimeline::new(100);
    tl.apply_batch(&full_step(1, 0)).unwrap();
    tl.apply_batch(&[marker(StepBegin, 2, 100)]).unwrap();
    let refused = [
        // Inside an open step.
        vec![marker(EvalBegin, 2, 110)],
        // An end with no pass running.
        vec![marker(EvalEnd, 1, 110)],
    ];
    for batch in refused {
        let e = tl.apply_batch(&batch).unwrap_err();
        assert_eq!(e.reason(), "out_of_order", "{e}");
    }
    tl.apply_batch(&[marker(StepEnd, 2, 120)]).unwrap();
    let refused = [
        // A step other than the last begun.
        vec![marker(EvalBegin, 1, 130)],
        vec![marker(EvalBegin, 3, 130)],
        // The end of another kind of pass.
        vec![marker(EvalBegin, 2, 130), marker(CheckpointEnd, 2, 140)],
    ];
    for batch in refused {
        let e = tl.apply_batch(&batch).unwrap_err();
        assert!(matches!(e, MarkerError::PassMisplaced { .. }), "{e}");
    }
    assert_eq!(tl.passes().len(), 0);
    assert_eq!(tl.steps().len(), 2);
}

#[test]
fn an_oom_in_a_pass_ends_the_pass_not_a_step() {
    use MarkerKind::*;
    let mut tl = RankTimeline::new(100);
    tl.apply_batch(&full_step(1, 0)).unwrap();
    tl.apply_batch(&[marker(EvalBegin, 1, 100), marker(Oom, 1, 120)])
        .unwrap();
    assert_eq!(tl.ooms(), 1);
    assert_eq!(
        tl.passes().next().map(|p| p.outcome),
        Some(PassOutcome::Oom)
    );
    assert_eq!(tl.steps().len(), 1);
    assert_eq!(
        tl.last_completed().map(|s| s.outcome),
        Some(StepOutcome::Completed)
    );
}

#[test]
fn a_step_keeps_the_largest_batch_of_its_micro_batches() {
    use MarkerKind::*;
    let batch = |tokens: u64| BatchFacts {
        samples: Some(4),
        tokens: Some(tokens),
        shape: vec![4, tokens / 4],
    };
    let mut markers: Vec<Marker> = [
        StepBegin,
        ForwardBegin,
        BackwardBegin,
        ForwardBegin,
        BackwardBegin,
        ForwardBegin,
        BackwardBegin,
        OptimizerBegin,
        OptimizerEnd,
        StepEnd,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, k)| marker(k, 1, i as u64))
    .collect();
    markers[1].batch = Some(batch(2048));
    markers[3].batch = Some(batch(8192));
    markers[5].batch = Some(batch(4096));
    let mut tl = RankTimeline::new(100);
    tl.apply_batch(&markers).unwrap();
    let step = tl.steps().next().unwrap();
    assert_eq!(step.batch.as_ref().and_then(|b| b.tokens), Some(8192));
}

#[test]
fn an_implausible_batch_is_refused() {
    let mut m = marker(MarkerKind::StepBegin, 1, 0);
    m.batch = Some(BatchFacts {
        shape: vec![2; 9],
        ..Default::default()
    });
    let mut tl = RankTimeline::new(100);
    let e = tl.apply_batch(&[m]).unwrap_err();
    assert_eq!(e.reason(), "implausible_value");
    assert!(e.to_string().contains("batch.shape"), "{e}");
    assert_eq!(tl.steps().len(), 0);
}
