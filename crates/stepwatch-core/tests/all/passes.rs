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

// ---- The tracker: passes kept apart from the prediction and the steps ----

use stepwatch_testkit as kit;

const GPU: &str = "GPU-0";
/// Each step of the pass scenario starts `STEP_NS` after the one before.
const STEP_NS: u64 = 1_000;

/// The base scenario's step `n` from `(n − 1) × STEP_NS` (markers with
/// allocator figures, then its samples), and, when `passes`, an evaluation
/// pass after steps 1 and 6 that needs more than any step (NVML 9,900 of
/// 10,000 M; allocated 9,000 and reserved 9,400 M at its peak), the same
/// pass before step 1 (a sanity check, its sample 1 µs before step 1), and a
/// checkpoint after step 8 that the next step ends. Returns the tracker,
/// the rank and every advisory issued.
fn pass_scenario(passes: bool, steps: u64) -> (Tracker, RankKey, Vec<Advisory>) {
    use MarkerKind::*;
    let mut t = Tracker::new(TrackerConfig::default());
    let key = kit::open(&mut t, kit::solo_rank("job", GPU));
    let mut told = Vec::new();
    let eval = |after: u64, t0: u64| {
        vec![
            kit::marker_mib(EvalBegin, after, t0, (2_200, 2_200, 7_500)),
            kit::marker_mib(EvalEnd, after, t0 + 200, (2_200, 9_000, 9_400)),
        ]
    };
    if passes {
        t.gpu_samples(GPU, &kit::samples_mib(&[(2, 9_900)], 10_000));
        told.extend(t.markers(&key, &eval(0, 1), 1).unwrap());
    }
    for n in 1..=steps {
        let t0 = 1_000 + (n - 1) * STEP_NS;
        let markers: Vec<Marker> = kit::base::step1_markers(t0, true)
            .into_iter()
            .map(|m| Marker { step: n, ..m })
            .collect();
        told.extend(t.markers(&key, &markers, t0).unwrap());
        t.gpu_samples(GPU, &kit::base::step1_samples(t0, 10_000));
        let after = t0 + 600;
        if passes && (n == 1 || n == 6) {
            t.gpu_samples(
                GPU,
                &kit::samples_mib(&[(after + 50, 9_900), (after + 150, 9_900)], 10_000),
            );
            told.extend(t.markers(&key, &eval(n, after), after).unwrap());
        }
        if passes && n == 8 {
            let begin = kit::marker_mib(CheckpointBegin, n, after, (2_200, 2_200, 7_500));
            told.extend(t.markers(&key, &[begin], after).unwrap());
        }
    }
    (t, key, told)
}

/// The step-2 prediction, the steady profile, the trend and the advisories
/// are those of the same job without its passes, although every pass
/// needed more than any step: the passes are reported apart, with their
/// own headroom.
#[test]
fn passes_move_no_step_figure_and_warn_of_nothing() {
    let (with, key, told_with) = pass_scenario(true, 30);
    let (without, key_without, told_without) = pass_scenario(false, 30);
    let rank = |t: &Tracker, k: &RankKey| t.rank(k).unwrap().prediction_before_step2.clone();
    assert!(rank(&with, &key).is_some());
    assert_eq!(rank(&with, &key), rank(&without, &key_without));
    let analysis = with.rank_analysis(&key).unwrap();
    let analysis_without = without.rank_analysis(&key_without).unwrap();
    assert_eq!(analysis.prediction, analysis_without.prediction);
    assert_eq!(analysis.steady, analysis_without.steady);
    assert_eq!(with.memory_trend(&key), without.memory_trend(&key_without));
    let kinds = |told: &[Advisory]| told.iter().map(|a| a.kind).collect::<Vec<_>>();
    assert_eq!(kinds(&told_with), kinds(&told_without));
    assert!(
        !kinds(&told_with).contains(&AdvisoryKind::Step2OomPredicted),
        "{told_with:?}"
    );

    let peaks = with.pass_peaks(&key);
    assert!(without.pass_peaks(&key_without).is_empty());
    let kinds: Vec<PassKind> = peaks.iter().map(|p| p.kind).collect();
    assert_eq!(kinds, [PassKind::Evaluation, PassKind::Checkpoint]);
    let eval = &peaks[0];
    assert_eq!((eval.begun, eval.ended), (3, 3));
    assert_eq!(eval.latest.after_step, 6);
    assert_eq!(eval.highest.nvml_peak_bytes, Some(9_900 * M));
    assert_eq!(eval.highest.allocated_peak_bytes, Some(9_000 * M));
    assert_eq!(eval.highest.device_peak_bytes, Some(9_900 * M));
    assert_eq!(eval.headroom_bytes, Some(100 * M as i64));
    // The checkpoint the next step ended: no sample and no end figures;
    // its device peak is its reserved peak plus what NVML shows beyond
    // the allocator on the steps (8,000 − 7,500 M).
    let checkpoint = &peaks[1];
    assert_eq!(checkpoint.latest.after_step, 8);
    assert_eq!(checkpoint.latest.nvml_peak_bytes, None);
    assert_eq!(checkpoint.latest.device_peak_bytes, Some(8_000 * M));
    assert_eq!(checkpoint.headroom_bytes, Some(2_000 * M as i64));
}
