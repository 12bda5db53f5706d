//! Step 1 a smaller warm-up batch, step 2's first forward a larger one: the
//! prediction is revised at that forward, before step 2's backward, and
//! warns through the same advisories when the revised figure does not fit.

use stepwatch_core::*;
use stepwatch_testkit as kit;

const GB: u64 = 1_000_000_000;
/// Weights (and what else does not follow the batch) before each forward.
const WEIGHTS: u64 = 2 * GB;
/// Activations per sample.
const PER_SAMPLE: u64 = GB / 4;
/// Optimizer state made in step 1's optimizer phase.
const STATE: u64 = GB;

fn samples(n: u64) -> BatchFacts {
    BatchFacts {
        samples: Some(n),
        ..Default::default()
    }
}

/// One step's markers up to its forward's begin (the batch on it), and the
/// rest; the allocator's figures those of a model whose activations are
/// `PER_SAMPLE` per sample. `batch` None: the client said nothing of it.
fn step(step: u64, size: u64, batch: Option<BatchFacts>, t: &mut u64) -> [Vec<Marker>; 2] {
    let state = if step == 1 { 0 } else { STATE };
    let activations = size * PER_SAMPLE;
    let mut at = |kind, allocated| {
        *t += 10_000_000;
        Marker {
            allocator: Some(kit::alloc_bytes(allocated, allocated, allocated)),
            ..kit::marker(kind, step, *t)
        }
    };
    let head = vec![
        at(MarkerKind::StepBegin, WEIGHTS + state),
        Marker {
            batch: batch.clone(),
            ..at(MarkerKind::ForwardBegin, WEIGHTS + state)
        },
    ];
    let tail = vec![
        at(MarkerKind::BackwardBegin, WEIGHTS + state + activations),
        at(MarkerKind::OptimizerBegin, WEIGHTS + state),
        at(MarkerKind::OptimizerEnd, WEIGHTS + STATE),
        at(MarkerKind::StepEnd, WEIGHTS + STATE),
    ];
    [head, tail]
}

struct Run {
    tracker: Tracker,
    key: RankKey,
    /// Advisories due at each batch: step 1 whole, step 2's begin and
    /// first forward, step 2's rest.
    due: Vec<Vec<Advisory>>,
}

fn run(step1: (u64, bool), step2: (u64, bool), capacity: u64) -> Run {
    run_batched(step1, step2, capacity, false)
}

/// `one_batch`: every marker of both steps in one batch (a client that
/// flushes late); else step 1, step 2's begin and forward, step 2's rest.
fn run_batched(step1: (u64, bool), step2: (u64, bool), capacity: u64, one_batch: bool) -> Run {
    run_with(TrackerConfig::default(), step1, step2, capacity, one_batch)
}

fn run_with(
    config: TrackerConfig,
    step1: (u64, bool),
    step2: (u64, bool),
    capacity: u64,
    one_batch: bool,
) -> Run {
    let mut tracker = Tracker::new(config);
    let key = tracker
        .open(
            RankInfo {
                pid: 7,
                ..kit::solo_rank("warmup", "GPU-a")
            },
            0,
        )
        .unwrap();
    // The device holds the allocator's reserved bytes plus 0.5 GB.
    let nvml: Vec<GpuSample> = (0..400)
        .map(|i| GpuSample {
            monotonic_ns: 1_000_000 + i * 1_000_000,
            used_bytes: WEIGHTS + step1.0 * PER_SAMPLE + GB / 2,
            capacity_bytes: capacity,
        })
        .collect();
    tracker.gpu_samples("GPU-a", &nvml);
    let mut t = 1_000_000;
    let [h1, t1] = step(1, step1.0, step1.1.then(|| samples(step1.0)), &mut t);
    let [h2, t2] = step(2, step2.0, step2.1.then(|| samples(step2.0)), &mut t);
    let due = if one_batch {
        vec![tracker
            .markers(&key, &[h1, t1, h2, t2].concat(), 1)
            .unwrap()]
    } else {
        vec![
            tracker.markers(&key, &[h1, t1].concat(), 1).unwrap(),
            tracker.markers(&key, &h2, 2).unwrap(),
            tracker.markers(&key, &t2, 3).unwrap(),
        ]
    };
    Run { tracker, key, due }
}

/// The prediction step 1 alone gives (step 2's batch unknown).
fn from_step1(size: u64, capacity: u64) -> Prediction {
    frozen(&run((size, true), (size, false), capacity))
}

fn frozen(r: &Run) -> Prediction {
    r.tracker
        .rank(&r.key)
        .unwrap()
        .prediction_before_step2
        .clone()
        .expect("a prediction")
}

#[test]
fn a_larger_step_2_batch_warns_at_step_2s_first_forward_before_its_backward() {
    // Step 1 (4 samples) fits 7 GB with room (4.5 GB predicted); step 2
    // takes 16 samples: 12 × 0.25 GB more activations, which do not fit.
    let capacity = 7 * GB;
    let unrevised = from_step1(4, capacity);
    assert!(
        !unrevised.oom_risk && !unrevised.low_headroom,
        "{}",
        unrevised.explanation
    );
    let r = run((4, true), (16, true), capacity);
    assert!(
        r.due[0]
            .iter()
            .all(|a| a.kind == AdvisoryKind::PredictionFinal),
        "{:?}",
        r.due[0]
    );
    // At step 2's begin and first forward, before its backward arrived.
    let warned: Vec<&Advisory> = r.due[1]
        .iter()
        .filter(|a| a.kind == AdvisoryKind::Step2OomPredicted)
        .collect();
    assert_eq!(warned.len(), 1, "{:?}", r.due[1]);
    assert_eq!(warned[0].step, 2);
    assert!(
        warned[0].message.contains("16 samples where step 1 took 4"),
        "{}",
        warned[0].message
    );
    let p = frozen(&r);
    let revision = p.inputs.batch_revision.as_ref().expect("revised");
    assert_eq!((revision.step1_size, revision.step2_size), (4, 16));
    assert_eq!(revision.step1_activation_bytes, 4 * PER_SAMPLE);
    assert_eq!(revision.extra_basis_bytes, 12 * PER_SAMPLE);
    assert_eq!(
        revision.unrevised_peak_bytes,
        unrevised.predicted_peak_bytes
    );
    assert_eq!(
        p.predicted_peak_bytes,
        unrevised.predicted_peak_bytes + revision.extra_device_bytes
    );
    assert!(p.oom_risk && p.headroom_bytes.unwrap() < 0);
    assert_eq!(warned[0].predicted_peak_bytes, p.predicted_peak_bytes);
    assert!(
        p.explanation.contains("revised for step 2's larger batch"),
        "{}",
        p.explanation
    );
    // One figure: the analysis the report and metrics read says the same.
    let analysed = r.tracker.rank_analysis(&r.key).unwrap().prediction.unwrap();
    assert_eq!(analysed.predicted_peak_bytes, p.predicted_peak_bytes);
    // Not again in step 2's later markers.
    assert!(r.due[2].is_empty(), "{:?}", r.due[2]);
}

#[test]
fn one_batch_holding_both_steps_gets_the_same_revision_and_warning() {
    let capacity = 7 * GB;
    let apart = run((4, true), (16, true), capacity);
    let together = run_batched((4, true), (16, true), capacity, true);
    assert_eq!(frozen(&together), frozen(&apart));
    let kinds: Vec<(AdvisoryKind, u64)> =
        together.due[0].iter().map(|a| (a.kind, a.step)).collect();
    assert_eq!(
        kinds,
        [
            (AdvisoryKind::PredictionFinal, 1),
            (AdvisoryKind::Step2OomPredicted, 2)
        ]
    );
}

#[test]
fn the_same_or_a_smaller_batch_or_unknown_batches_change_nothing() {
    let capacity = 7 * GB;
    let unrevised = from_step1(8, capacity);
    for (step1, step2) in [
        ((8, true), (8, true)),
        ((8, true), (2, true)),
        ((8, false), (16, true)),
    ] {
        let r = run(step1, step2, capacity);
        let p = frozen(&r);
        assert!(p.inputs.batch_revision.is_none(), "{step1:?} {step2:?}");
        assert_eq!(p.predicted_peak_bytes, unrevised.predicted_peak_bytes);
        assert!(r.due[1].is_empty() && r.due[2].is_empty(), "{:?}", r.due);
    }
}

/// Never a fit that the scaled activations contradict, never a change when
/// step 2's batch is not larger: over a grid of batches and capacities.
#[test]
fn the_revised_prediction_covers_the_scaled_activations() {
    for s1 in [1, 2, 3, 5, 8, 13, 21] {
        for capacity in [4, 6, 9, 14, 20].map(|c| c * GB) {
            let unrevised = from_step1(s1, capacity);
            for s2 in (1..=40).step_by(3) {
                let r = run((s1, true), (s2, true), capacity);
                let p = frozen(&r);
                let case = format!("{s1} then {s2} samples on {capacity} B");
                if s2 <= s1 {
                    assert_eq!(p, unrevised, "{case}");
                    assert!(r.due[1].is_empty(), "{case}");
                    continue;
                }
                let scaled = unrevised.predicted_peak_bytes + (s2 - s1) * PER_SAMPLE;
                assert!(p.predicted_peak_bytes >= scaled, "{case}");
                if scaled > capacity {
                    assert!(p.oom_risk, "{case}");
                    let told = r.due[..2]
                        .iter()
                        .flatten()
                        .any(|a| a.kind == AdvisoryKind::Step2OomPredicted);
                    assert!(told, "{case}: {:?}", r.due);
                }
            }
        }
    }
}

/// Step 2 said no batch; once the history is trimmed to step 1 and the
/// step at hand, a later step's larger batch is not step 2's: the frozen
/// step-2 prediction stays as it was and no step-2 warning comes then.
#[test]
fn a_later_steps_batch_never_revises_step_2_after_the_history_is_trimmed() {
    let capacity = 7 * GB;
    let config = TrackerConfig {
        max_retained_steps: 2,
        ..TrackerConfig::default()
    };
    let mut r = run_with(config, (4, true), (4, false), capacity, false);
    let before = frozen(&r);
    let mut t = 10_000_000_000;
    for n in 3..6 {
        let [head, tail] = step(n, 4, None, &mut t);
        r.tracker
            .markers(&r.key, &[head, tail].concat(), n)
            .unwrap();
    }
    // Its begin and its forward in batches of their own.
    let [head, tail] = step(6, 16, Some(samples(16)), &mut t);
    let mut due = r.tracker.markers(&r.key, &head[..1], 6).unwrap();
    due.extend(r.tracker.markers(&r.key, &head[1..], 7).unwrap());
    r.tracker.markers(&r.key, &tail, 8).unwrap();
    assert_eq!(frozen(&r), before);
    assert!(
        !due.iter()
            .any(|a| a.kind == AdvisoryKind::Step2OomPredicted),
        "{due:?}"
    );
}
