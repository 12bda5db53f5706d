//! What the agent tells people: the explanation's words and units, the
//! advisory that follows a worsening prediction, and what would fit.
//!
//! The scenario is the base one of `prediction.rs` (unit M = 1 MiB): step 1
//! begins with 1000 allocated, its first forward/backward peaks at 6000,
//! the optimizer makes 800 of state, and the predicted device peak is 9050
//! (allocated 6800 × 1.25 + 50 layout allowance + 500 overhead).

use stepwatch_core::*;
use stepwatch_core::{due, gb, WORSENED_FRACTION};
use stepwatch_testkit::{self as kit, MIB as M};

const GPU: &str = "GPU-0";

/// The prediction of the base scenario on a GPU of `capacity` M.
fn predict_base(facts: ModelFacts, capacity: u64) -> Prediction {
    predict_with_batch(facts, capacity, None)
}

/// [`predict_base`], step 1's forward markers saying their batch's samples.
fn predict_with_batch(facts: ModelFacts, capacity: u64, samples: Option<u64>) -> Prediction {
    let mut t = Tracker::new(TrackerConfig::default());
    let info = RankInfo {
        model: facts,
        ..kit::solo_rank("job", GPU)
    };
    let key = kit::open(&mut t, info);
    t.gpu_samples(GPU, &kit::base::step1_samples(100, capacity));
    let mut markers = kit::base::step1_markers(100, true);
    if let Some(n) = samples {
        markers = kit::with_batch_samples(markers, n);
    }
    t.markers(&key, &markers, 0).unwrap();
    t.rank_analysis(&key).unwrap().prediction.unwrap()
}

#[test]
fn the_explanation_is_in_gb_and_words_not_bytes_and_enum_names() {
    let p = predict_base(ModelFacts::default(), 10_000);
    assert_eq!(p.predicted_peak_bytes, 9050 * M);
    let e = &p.explanation;
    // 800 MiB = 0.84 GB of state; 9050 MiB = 9.49 GB; headroom 950 MiB = 1.00 GB.
    assert!(
        e.contains("optimizer state 0.84 GB (the jump measured across step 1's optimizer phase)"),
        "{e}"
    );
    assert!(e.contains("predicted device peak 9.49 GB"), "{e}");
    assert!(e.contains("= 1.00 GB"), "{e}");
    for name in [
        "MeasuredJump",
        "NotPersistent",
        "FirstMicroBatch",
        "Step1Peak",
        "ModelFacts",
    ] {
        assert!(!e.contains(name), "{name} in {e}");
    }
    // No raw byte counts: no run of 5 or more digits.
    let longest_digits = e
        .split(|c: char| !c.is_ascii_digit())
        .map(str::len)
        .max()
        .unwrap_or(0);
    assert!(longest_digits < 5, "{e}");
}

#[test]
fn the_advisory_is_sent_again_when_the_prediction_worsens_by_1_percent_of_capacity() {
    // 8000 M of capacity: 1050 M over.
    let capacity = 8000 * M;
    let p = predict_base(ModelFacts::default(), 8000);
    assert!(p.oom_risk);
    let first = due(&p, capacity, 1, 10, &[]);
    assert_eq!(first.len(), 1);
    assert!(
        first[0]
            .message
            .starts_with("predicted steady-state peak 9.49 GB exceeds capacity 8.39 GB by 1.10 GB"),
        "{}",
        first[0].message
    );
    // The margin: 1% of 8000 M = 80 M.
    assert_eq!(WORSENED_FRACTION * capacity as f64, 80.0 * M as f64);
    let mut worse = p.clone();
    worse.predicted_peak_bytes += 79 * M;
    assert!(due(&worse, capacity, 1, 20, &first).is_empty());
    worse.predicted_peak_bytes += M;
    let again = due(&worse, capacity, 1, 30, &first);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].predicted_peak_bytes, 9130 * M);
    assert!(
        again[0].message.contains(&gb((9130 * M) as f64)),
        "{}",
        again[0].message
    );
    // Measured from the latest advisory of the kind, not the first.
    let issued = [first, again].concat();
    let mut same = worse.clone();
    same.predicted_peak_bytes += 40 * M;
    assert!(due(&same, capacity, 1, 40, &issued).is_empty());
    // A better prediction sends nothing.
    assert!(due(&p, capacity, 1, 50, &issued).is_empty());
}

#[test]
fn step_2_that_does_not_fit_names_the_micro_batch_and_the_sharding_that_would() {
    let facts = ModelFacts {
        micro_batch_size: Some(4),
        ..Default::default()
    };
    // 7550 M: 1500 M over; the remedies aim for 5% of capacity to spare,
    // so 1500 + 377.5 = 1877.5 M to shed. Activations 6000 − 1000 = 5000 M
    // over 4 samples: 1250 M each; ceil(1877.5 / 1250) = 2 fewer → 2. The
    // 800 M of state cannot free that: no sharding is enough.
    let p = predict_base(facts.clone(), 7550);
    let f = p.what_would_fit.unwrap();
    assert_eq!(f.activation_bytes, Some(5000 * M));
    assert_eq!(f.activation_bytes_per_sample, Some(1250 * M));
    assert_eq!(f.over_capacity_bytes, Some(1500 * M));
    assert_eq!(f.target_headroom_bytes, 7550 * M / 20);
    assert_eq!(f.fits_with_micro_batch_size, Some(2));
    assert_eq!(f.fits_with_sharding_factor, None);
    let a = due(&p, 7550 * M, 1, 0, &[]);
    assert!(
        a[0].message
            .ends_with("; predicted to fit: a micro-batch of 2 instead of 4"),
        "{}",
        a[0].message
    );
    // 8850 M: 200 M over, 200 + 442.5 = 642.5 M to shed → 1 fewer → 3; or
    // the state over ceil(800 / (800 − 642.5)) = ceil(5.08) = 6 ranks.
    let p = predict_base(facts, 8850);
    let f = p.what_would_fit.unwrap();
    assert_eq!(
        (f.fits_with_micro_batch_size, f.fits_with_sharding_factor),
        (Some(3), Some(6))
    );
    let a = due(&p, 8850 * M, 1, 0, &[]);
    assert!(
        a[0].message.ends_with(
            "; predicted to fit: a micro-batch of 3 instead of 4, or optimizer state sharded \
             over 6 ranks (ZeRO-1 / FSDP)"
        ),
        "{}",
        a[0].message
    );
    // Without the micro-batch size: the per-sample figure is unknown.
    let p = predict_base(ModelFacts::default(), 7550);
    let f = p.what_would_fit.unwrap();
    assert_eq!(f.activation_bytes_per_sample, None);
    assert!(due(&p, 7550 * M, 1, 0, &[])[0]
        .message
        .contains("lower the micro-batch"));
}

#[test]
fn step_1s_batch_names_the_micro_batch_when_the_client_stated_none() {
    // A plain `watch(model, optimizer)` loop: the 4 samples come from the
    // forward's inputs, not the hello. The advice is the one a stated 4 gets.
    let stated = |n| ModelFacts {
        micro_batch_size: Some(n),
        ..Default::default()
    };
    let seen = predict_with_batch(ModelFacts::default(), 7550, Some(4));
    let told = predict_base(stated(4), 7550);
    assert_eq!(seen.what_would_fit, told.what_would_fit);
    assert_eq!(
        seen.what_would_fit.unwrap().fits_with_micro_batch_size,
        Some(2)
    );
    let message = |p: &Prediction| due(p, 7550 * M, 1, 0, &[])[0].message.clone();
    assert!(message(&seen).ends_with("a micro-batch of 2 instead of 4"));
    assert_eq!(message(&seen), message(&told));
    // What the client states wins over what it saw (8 samples of 625 M).
    let f = predict_with_batch(stated(8), 7550, Some(4))
        .what_would_fit
        .unwrap();
    assert_eq!(
        (f.micro_batch_size, f.activation_bytes_per_sample),
        (Some(8), Some(625 * M))
    );
}

#[test]
fn the_rank_heavier_in_forward_is_advised_once_on_its_own_stream() {
    let mut t = Tracker::new(TrackerConfig::default());
    let keys: Vec<RankKey> = (0..4)
        .map(|rank| {
            t.open(
                RankInfo {
                    job: "job".into(),
                    rank,
                    world_size: 4,
                    gpu_uuid: format!("GPU-{rank}"),
                    pid: 100 + rank,
                    ..Default::default()
                },
                0,
            )
            .unwrap()
        })
        .collect();
    // Ranks 0-2 end step 1 first: nothing to compare with yet.
    for (rank, key) in keys.iter().enumerate().take(3) {
        let due = t
            .markers(key, &kit::activation_step1(5_000, 0), rank as u64)
            .unwrap();
        assert_eq!(
            due.iter().map(|a| a.kind).collect::<Vec<_>>(),
            [AdvisoryKind::PredictionFinal]
        );
    }
    // Rank 3, 24% heavier in forward, ends step 1: it is named and told
    // (besides its prediction being final).
    let due: Vec<Advisory> = t
        .markers(&keys[3], &kit::activation_step1(6_200, 0), 10)
        .unwrap()
        .into_iter()
        .filter(|a| a.kind != AdvisoryKind::PredictionFinal)
        .collect();
    assert_eq!(due.len(), 1, "{due:?}");
    let a = &due[0];
    assert_eq!(a.kind, AdvisoryKind::RankDivergence);
    assert_eq!(
        a.divergence.as_ref().map(|d| (d.rank, d.figure)),
        Some((3, DivergenceFigure::ActivationPeak))
    );
    assert!(
        a.message.starts_with(
            "rank 3: its step-1 activation peak (forward/backward peak above the memory at \
             step begin) of 6.20 GB is 24.0% above the median 5.00 GB of the job's 4 ranks"
        ),
        "{}",
        a.message
    );
    // Its next step boundary does not repeat it; the other ranks get none.
    let mut step2 = kit::activation_step1(6_200, 1_000);
    for m in &mut step2 {
        m.step = 2;
    }
    assert!(t.markers(&keys[3], &step2[..1], 20).unwrap().is_empty());
    assert!(t.markers(&keys[0], &step2[..1], 21).unwrap().is_empty());
    assert_eq!(t.rank(&keys[3]).unwrap().advisories.len(), 2);
}

#[test]
fn a_rank_heavier_in_forward_is_named_although_its_step1_peak_is_not_off() {
    const MB: u64 = 1_000_000;
    // Activations 5 000, 5 000, 5 000 and 6 200 MB (rank 3 is 24% heavier);
    // every rank's step-1 peak is its 20 000 MB after the optimizer made
    // its state, so the step-1 peaks do not diverge at all.
    let timelines: Vec<RankTimeline> = [5_000, 5_000, 5_000, 6_200]
        .into_iter()
        .map(|act| {
            let mut t = RankTimeline::new(10);
            t.apply_batch(&kit::activation_step1(act, 0)).unwrap();
            t
        })
        .collect();
    let figures: Vec<RankFigures> = timelines
        .iter()
        .enumerate()
        .map(|(r, t)| RankFigures::of(r as u32, t.steps().next(), None))
        .collect();
    assert_eq!(figures[3].activation_allocated_bytes, Some(6_200 * MB));
    let d = divergence("j", &figures, 0.10).unwrap();
    let peak = d.peak.as_ref().unwrap();
    assert_eq!(d.peak_source, Some(PeakSource::Allocated));
    assert_eq!(
        (peak.min, peak.max, peak.spread),
        (20_000 * MB, 20_000 * MB, 0.0)
    );
    assert!(peak.outliers.is_empty());
    // Activation: median 5 000, rank 3 at (6 200 − 5 000) / 5 000 = +24%.
    let act = d.activation.as_ref().unwrap();
    assert_eq!(act.median, 5_000.0 * MB as f64);
    assert!((act.spread - 0.24).abs() < 1e-12);
    assert_eq!(
        d.named,
        [NamedOutlier {
            rank: 3,
            figure: DivergenceFigure::ActivationPeak,
            source: PeakSource::Allocated,
            value_bytes: 6_200 * MB,
            median_bytes: 5_000.0 * MB as f64,
            deviation: 1_200.0 / 5_000.0,
            ranks: 4,
        }]
    );
}
