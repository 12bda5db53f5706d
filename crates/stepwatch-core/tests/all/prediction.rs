//! The prediction rules, each against figures computed by hand.
//!
//! Unit: M = 1 MiB. The base scenario (one micro-batch, Adam, lazy state):
//!
//! | marker          | t   | allocated | alloc peak | reserved | NVML sample (t, used)    |
//! |-----------------|-----|-----------|------------|----------|--------------------------|
//! | step_begin      | 100 | 1000      | 1000       | 1200     | 150: 1700                |
//! | forward_begin   | 200 | 1000      | 1000       | 1200     | 250: 3500                |
//! | backward_begin  | 300 | 5000      | 5000       | 6250     | 350: 7000                |
//! | optimizer_begin | 400 | 1400      | 6000       | 7500     | 450: 8000                |
//! | optimizer_end   | 500 | 2200      | 6000       | 7500     | 550: 8000                |
//! | step_end        | 600 | 2200      | 6000       | 7500     |                          |
//!
//! NVML = reserved + 500 (CUDA context 200 + another process 300).
//!
//! Lazily created state adds the layout allowance to reserved: 1/16 of the
//! state that can have landed in the cache backward freed. Here the state is
//! 800 and the cache when the optimizer began was 7500 − 1400 = 6100, so the
//! allowance is 800 / 16 = 50.

use stepwatch_core::*;
use stepwatch_testkit::{self as kit, samples_mib as samples, MIB as M};

const GPU: &str = "GPU-0";
const PID: u32 = 4242;
const OTHER_PID: u32 = 77;

type Alloc = Option<(u64, u64, u64)>;

fn stats(a: Alloc) -> Option<AllocatorStats> {
    a.map(|(allocated, peak, reserved)| kit::alloc_mib(allocated, peak, reserved))
}

fn marker(kind: MarkerKind, step: u64, t: u64, mb: u32, a: Alloc) -> Marker {
    Marker {
        micro_batch: mb,
        allocator: stats(a),
        ..kit::marker(kind, step, t)
    }
}

fn base_markers(with_alloc: bool) -> Vec<Marker> {
    kit::base::step1_markers(100, with_alloc)
}

const BASE_SAMPLES: [(u64, u64); 5] = [
    (150, 1700),
    (250, 3500),
    (350, 7000),
    (450, 8000),
    (550, 8000),
];

/// The scenarios' rank: alone on [`GPU`] as process [`PID`].
fn the_rank() -> RankInfo {
    RankInfo {
        pid: PID,
        ..kit::solo_rank("job", GPU)
    }
}

fn tracker(model: ModelFacts) -> (Tracker, RankKey) {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = kit::open(
        &mut t,
        RankInfo {
            model,
            ..the_rank()
        },
    );
    t.set_gpu_processes(GPU, &[(PID, 7000 * M), (OTHER_PID, 300 * M)]);
    (t, key)
}

/// [`run_with`] without model facts.
fn run(markers: &[Marker], points: &[(u64, u64)], capacity: u64) -> Prediction {
    run_with(ModelFacts::default(), markers, points, capacity)
}

/// Runs the scenario and returns the prediction of the rank analysis.
fn run_with(
    facts: ModelFacts,
    markers: &[Marker],
    points: &[(u64, u64)],
    capacity: u64,
) -> Prediction {
    let (mut t, key) = tracker(facts);
    t.gpu_samples(GPU, &samples(points, capacity));
    t.markers(&key, markers, 0).unwrap();
    t.rank_analysis(&key).unwrap().prediction.unwrap()
}

/// The base scenario's step 1 with `facts`, on a GPU of 10,000 M.
fn base(facts: ModelFacts) -> Prediction {
    run_with(facts, &base_markers(true), &BASE_SAMPLES, 10_000)
}

/// The base scenario while step 1's backward runs (its first three markers
/// and samples), with `facts`.
fn base_in_backward(facts: ModelFacts) -> Prediction {
    run_with(facts, &base_markers(true)[..3], &BASE_SAMPLES[..3], 10_000)
}

/// The base scenario with nothing made across the optimizer phase, with
/// `facts`.
fn base_without_jump(facts: ModelFacts) -> Prediction {
    run_with(facts, &no_jump_markers(), &BASE_SAMPLES, 10_000)
}

/// Facts that say gradients are kept between steps (zeroed, not set to
/// None), and nothing else.
fn keep_grads() -> ModelFacts {
    ModelFacts {
        grads_set_to_none: Some(false),
        ..Default::default()
    }
}

/// The gradients `p` counts, and where their figure came from.
fn grads(p: &Prediction) -> (u64, GradsSource) {
    (p.inputs.grads.grad_bytes, p.inputs.grads.grads_source)
}

/// The optimizer state `p` counts, and where its figure came from.
fn state(p: &Prediction) -> (u64, StateSource) {
    (p.inputs.state.state_bytes, p.inputs.state.state_source)
}

/// The layout rule's figures of `p`, which both layouts reached.
fn layout_snapshots(p: &Prediction) -> LayoutEstimate {
    p.inputs
        .layout
        .layout_snapshots
        .expect("both layouts arrived")
}

fn adam(params: u64) -> ModelFacts {
    ModelFacts {
        parameter_count: Some(params),
        optimizer: OptimizerKind::Adam,
        ..Default::default()
    }
}

#[test]
fn adam_lazy_state_measured_across_the_optimizer_phase() {
    let p = base(ModelFacts::default());
    let i = &p.inputs;
    assert_eq!(i.basis, PredictionBasis::Allocator);
    assert_eq!(i.peaks.first_micro_batch_peak_bytes, 6000 * M);
    assert_eq!(i.peaks.later_micro_batches_peak_bytes, None);
    assert_eq!(i.peaks.optimizer_phase_peak_bytes, Some(2200 * M));
    assert_eq!(i.state.measured_jump_bytes, Some(800 * M as i64));
    assert_eq!(state(&p), (800 * M, StateSource::MeasuredJump));
    assert_eq!(i.grads.grads_source, GradsSource::NotPersistent);
    // max(6000 + 800, 2200, 6000) = 6800 allocated.
    assert_eq!(
        (i.basis_peak_bytes, i.binding),
        (6800 * M, BindingTerm::FirstMicroBatch)
    );
    // The peak counters run since process start: the optimizer phase stayed
    // under backward's 6000, so its own peak is only known to lie in
    // 2200..=6000, which cannot raise the max. Nothing is hidden.
    assert_eq!(i.basis_peak_at_most_bytes, Some(6800 * M));
    assert!(!p.explanation.contains("at most"), "{}", p.explanation);
    // reserved/allocated = 7500 / 6000 = 1.25 → 8500, + allowance 50.
    assert_eq!(i.reserved.reserved_ratio, Some(1.25));
    assert_eq!(i.reserved.cache_at_optimizer_begin_bytes, Some(6100 * M));
    assert_eq!(i.reserved.state_from_cache_bytes, 800 * M);
    assert_eq!(i.layout.layout_allowance_bytes, 50 * M);
    assert_eq!(i.predicted_reserved_bytes, Some(8550 * M));
    // overhead = min(1700−1200, 3500−1200, 7000−6250, 8000−7500, 8000−7500) = 500.
    assert_eq!(i.overhead.overhead_bytes, Some(500 * M));
    assert_eq!(i.step1_nvml_peak_bytes, Some(8000 * M));
    // device = max(8550 + 500, 8000) = 9050; own share 9050 − 300.
    assert_eq!(p.predicted_peak_bytes, 9050 * M);
    assert_eq!(p.predicted_rank_peak_bytes, 8750 * M);
    assert_eq!(i.other_process_bytes, 300 * M);
    // headroom = 10000 − 8750 − 300.
    assert_eq!(p.headroom_bytes, Some(950 * M as i64));
    assert!(!p.oom_risk && !p.low_headroom && !p.provisional);
    assert!(
        p.explanation.contains("predicted device peak"),
        "{}",
        p.explanation
    );

    let tight = run(&base_markers(true), &BASE_SAMPLES, 9_400);
    assert_eq!(tight.headroom_bytes, Some(350 * M as i64));
    assert!(tight.low_headroom && !tight.oom_risk, "350 < 5% of 9400");
    let over = run(&base_markers(true), &BASE_SAMPLES, 8_800);
    assert_eq!(over.headroom_bytes, Some(-(250 * M as i64)));
    assert!(over.oom_risk && over.low_headroom);
}

#[test]
fn adam_state_from_model_facts_while_backward_runs() {
    // 100 Mi parameters × 8 bytes = 800 M of state, before the optimizer runs.
    let markers = &base_markers(true)[..3];
    let p = run_with(adam(100 * M), markers, &BASE_SAMPLES[..3], 10_000);
    let i = &p.inputs;
    assert!(p.provisional);
    assert_eq!(i.open_phase, Some(PhaseKind::Backward));
    assert!(!i.optimizer_phase_closed);
    // Forward closed at 5000; the open backward has only its start figure.
    assert_eq!(i.peaks.first_micro_batch_peak_bytes, 5000 * M);
    assert_eq!(state(&p), (800 * M, StateSource::ModelFacts));
    assert_eq!(i.basis_peak_bytes, 5800 * M);
    // 6250 / 5000 = 1.25 → 7250, + allowance 800 / 16 = 50 (the cache at
    // optimizer begin is not known yet: the whole state counts);
    // overhead min(500, 2300, 7000−6250 live) = 500.
    assert_eq!(i.reserved.cache_at_optimizer_begin_bytes, None);
    assert_eq!(i.layout.layout_allowance_bytes, 50 * M);
    assert_eq!(i.predicted_reserved_bytes, Some(7300 * M));
    assert_eq!(i.overhead.overhead_bytes, Some(500 * M));
    // The floor is the NVML peak of closed phases: the open backward's live
    // sample (7000) is left out, since with lagging markers it may be of step 2.
    assert_eq!(i.step1_nvml_peak_bytes, Some(3500 * M));
    assert_eq!(p.predicted_peak_bytes, 7800 * M);

    // Without facts the state is unknown until the optimizer phase ends.
    let p = run(markers, &BASE_SAMPLES[..3], 10_000);
    assert_eq!(p.inputs.state.state_source, StateSource::Unknown);
    // max(6250 + 500, the closed phases' NVML peak 3500).
    assert_eq!(p.inputs.predicted_reserved_bytes, Some(6250 * M));
    assert_eq!(p.predicted_peak_bytes, 6750 * M);
}

/// The base scenario's step 1 with the allocator's peak counter reading
/// `peaks` (M) at its markers.
fn with_peaks(peaks: [u64; 6]) -> Vec<Marker> {
    let mut ms = base_markers(true);
    for (m, peak) in ms.iter_mut().zip(peaks) {
        m.allocator.as_mut().unwrap().allocated_peak_bytes = peak * M;
    }
    ms
}

/// A checkpoint loaded onto the GPU before step 1 left the since-start peak
/// counter at 9000: step 1's forward and backward never raise it, so their
/// peaks are known only to lie between their boundary figures and 9000.
#[test]
fn a_high_water_mark_from_before_step_one_bounds_what_it_hides() {
    let markers = with_peaks([9000; 6]);
    let p = run(&markers, &BASE_SAMPLES, 10_000);
    let i = &p.inputs;
    // The boundary figures: forward and backward at least 5000, + state 800.
    assert_eq!(i.peaks.first_micro_batch_peak_bytes, 5000 * M);
    assert_eq!(i.state.state_bytes, 800 * M);
    assert_eq!(i.basis_peak_bytes, 5800 * M);
    // At most the old mark, + state.
    assert_eq!(i.basis_peak_at_most_bytes, Some(9800 * M));
    assert!(
        p.explanation.contains("at most 10.28 GB"), // 9800 MiB
        "{}",
        p.explanation
    );
    // Same figures with the counters reset at every marker: each phase's
    // own peak is pinned, 6000 in backward, and nothing is hidden.
    let reset = with_peaks([9000, 1000, 5000, 6000, 2200, 2200]);
    let r = run(&reset, &BASE_SAMPLES, 10_000);
    assert_eq!(r.inputs.basis_peak_bytes, 6800 * M);
    assert!(r.inputs.basis_peak_bytes <= i.basis_peak_at_most_bytes.unwrap());
}

fn no_jump_markers() -> Vec<Marker> {
    let mut ms = base_markers(true);
    ms[4].allocator = stats(Some((1400, 6000, 7500)));
    ms[5].allocator = stats(Some((1400, 6000, 7500)));
    ms
}

#[test]
fn sgd_keeps_no_state() {
    let sgd = ModelFacts {
        parameter_count: Some(100 * M),
        optimizer: OptimizerKind::Sgd,
        ..Default::default()
    };
    let p = base_without_jump(sgd.clone());
    assert_eq!(state(&p), (0, StateSource::Stateless));
    // max(6000, 1400, 6000) = 6000 → reserved max(7500, 7500) → + 500.
    assert_eq!(p.inputs.basis_peak_bytes, 6000 * M);
    assert_eq!(p.predicted_peak_bytes, 8000 * M);
    // Before the optimizer phase: the facts already say stateless.
    let early = base_in_backward(sgd);
    assert_eq!(early.inputs.state.state_source, StateSource::Stateless);
    assert_eq!(early.inputs.state.state_bytes, 0);
}

#[test]
fn pre_created_state_declared_or_detected() {
    let declared = ModelFacts {
        state_precreated: Some(true),
        ..adam(100 * M)
    };
    // Declared: no state even before the optimizer phase.
    let p = base_in_backward(declared);
    assert_eq!(state(&p), (0, StateSource::DeclaredPrecreated));
    // max(6250 + 500, the closed phases' NVML peak 3500).
    assert_eq!(p.predicted_peak_bytes, 6750 * M);

    // Detected: Adam, but nothing appeared across the optimizer phase.
    let p = base_without_jump(adam(100 * M));
    assert_eq!(p.inputs.state.measured_jump_bytes, Some(0));
    assert_eq!(state(&p), (0, StateSource::DetectedPrecreated));
    assert_eq!(p.predicted_peak_bytes, 8000 * M);

    // No facts: stateless and pre-created look alike; 0 either way.
    let p = base_without_jump(ModelFacts::default());
    assert_eq!(p.inputs.state.state_source, StateSource::NoJump);
}

#[test]
fn sharded_state_from_facts_and_inferred_from_the_jump() {
    // 400 Mi parameters × 8 bytes / 4 shards = 800 M per rank.
    let facts = ModelFacts {
        sharding_factor: Some(4),
        ..adam(400 * M)
    };
    let early = base_in_backward(facts.clone());
    assert_eq!(early.inputs.state.facts_state_bytes, Some(800 * M));
    assert_eq!(early.inputs.state.sharding_factor, 4);
    assert_eq!(early.predicted_peak_bytes, 7800 * M);

    // Unsharded facts, but the measured jump is a quarter of the facts state.
    let p = base(adam(400 * M));
    assert_eq!(p.inputs.state.state_source, StateSource::MeasuredJump);
    assert_eq!(p.inputs.state.inferred_sharding_factor, Some(4));
    assert_eq!(p.predicted_peak_bytes, 9050 * M);
}

#[test]
fn persistent_grads_are_added_unless_set_to_none() {
    let keep = keep_grads();
    let p = base(keep);
    // grads = allocated after the first backward 1400 − before the first forward 1000.
    assert_eq!(grads(&p), (400 * M, GradsSource::Measured));
    // max(6000 + 800 + 400, …) = 7200 → × 1.25 = 9000 → + 50 → + 500.
    assert_eq!(p.inputs.basis_peak_bytes, 7200 * M);
    assert_eq!(p.predicted_peak_bytes, 9550 * M);

    let none = ModelFacts {
        grads_set_to_none: Some(true),
        ..Default::default()
    };
    let p = base(none);
    assert_eq!(grads(&p), (0, GradsSource::NotPersistent));
    assert_eq!(p.predicted_peak_bytes, 9050 * M);
}

/// Two micro-batches, the first as in the base scenario; the second
/// forward/backward runs with the gradients of the first already allocated
/// (400).
fn accumulation_markers() -> Vec<Marker> {
    use MarkerKind::*;
    let mut ms = base_markers(true);
    ms.truncate(3);
    ms.extend([
        marker(ForwardBegin, 1, 400, 1, Some((1400, 6000, 7500))),
        marker(BackwardBegin, 1, 500, 1, Some((5400, 6000, 7500))),
        marker(OptimizerBegin, 1, 600, 0, Some((1400, 6400, 8000))),
        marker(OptimizerEnd, 1, 700, 0, Some((2200, 6400, 8000))),
        marker(StepEnd, 1, 800, 0, Some((2200, 6400, 8000))),
    ]);
    ms
}

const ACC_SAMPLES: [(u64, u64); 4] = [(150, 1700), (350, 7000), (550, 8500), (750, 8500)];

#[test]
fn accumulation_adds_grads_only_to_the_first_micro_batch() {
    let p = run(&accumulation_markers(), &ACC_SAMPLES, 12_000);
    let i = &p.inputs;
    assert_eq!(i.peaks.first_micro_batch_peak_bytes, 6000 * M);
    // Forward 1: max(1400, 5400), high-water mark unmoved; backward 1: 6400.
    assert_eq!(i.peaks.later_micro_batches_peak_bytes, Some(6400 * M));
    // max(6000 + 800, 6400 + 800) = 7200 → × 8000/6400 = 9000 → + 50
    // (cache at optimizer begin 8000 − 1400 ≥ state) → + 500.
    assert_eq!(
        (i.basis_peak_bytes, i.binding),
        (7200 * M, BindingTerm::LaterMicroBatches)
    );
    assert_eq!(p.predicted_peak_bytes, 9550 * M);
    assert_eq!(
        t_profile(&accumulation_markers()).micro_batches,
        2,
        "two forward phases"
    );

    let keep = keep_grads();
    let p = run_with(keep, &accumulation_markers(), &ACC_SAMPLES, 12_000);
    // First: 6000 + 800 + 400 = 7200; later micro-batches already hold their
    // grads: 6400 + 800 = 7200, not 6400 + 800 + 400.
    assert_eq!(p.inputs.basis_peak_bytes, 7200 * M);
    assert_eq!(p.predicted_peak_bytes, 9550 * M);
}

fn t_profile(markers: &[Marker]) -> StepProfile {
    let (mut t, key) = tracker(ModelFacts::default());
    t.markers(&key, markers, 0).unwrap();
    t.rank_analysis(&key).unwrap().first_step.unwrap()
}

/// NVML only: backward peaks at 7100, the cache absorbs part of the state.
const NVML_SAMPLES: [(u64, u64); 8] = [
    (150, 2000),
    (250, 5000),
    (350, 7100),
    (390, 7000),
    (450, 7200),
    (490, 7500),
    (550, 7600),
    (590, 7600),
];

#[test]
fn nvml_only_uses_the_level_jump_across_the_optimizer() {
    let p = run(&base_markers(false), &NVML_SAMPLES, 8_000);
    let i = &p.inputs;
    assert_eq!(i.basis, PredictionBasis::NvmlOnly);
    assert_eq!(i.peaks.first_micro_batch_peak_bytes, 7100 * M);
    // After (epilogue's first sample 7600) − before (backward's last 7000).
    assert_eq!(i.state.measured_jump_bytes, Some(600 * M as i64));
    assert_eq!(i.peaks.optimizer_phase_peak_bytes, Some(7500 * M));
    assert_eq!(i.peaks.step1_peak_bytes, 7600 * M);
    // max(7100 + 600, 7500, 7600) = 7700; device samples include the other 300.
    assert_eq!(p.predicted_peak_bytes, 7700 * M);
    assert_eq!(p.predicted_rank_peak_bytes, 7400 * M);
    assert_eq!(i.predicted_reserved_bytes, None);
    assert_eq!(p.headroom_bytes, Some(300 * M as i64));
    assert!(p.low_headroom && !p.oom_risk);

    // Facts say Adam with 1000 M of state: the 600 M jump was partly served
    // from the cache, so the facts win.
    let p = run_with(adam(125 * M), &base_markers(false), &NVML_SAMPLES, 8_000);
    assert_eq!(state(&p), (1000 * M, StateSource::ModelFacts));
    assert_eq!(p.predicted_peak_bytes, 8100 * M);
    assert!(p.oom_risk);

    // Persistent grads from parameter_bytes.
    let keep = ModelFacts {
        parameter_bytes: Some(200 * M),
        ..keep_grads()
    };
    let p = run_with(keep, &base_markers(false), &NVML_SAMPLES, 8_000);
    assert_eq!(grads(&p), (200 * M, GradsSource::ModelFacts));
    assert_eq!(p.predicted_peak_bytes, 7900 * M);
}

#[test]
fn no_figures_no_prediction() {
    let p = predict(
        &StepRecord {
            step: 1,
            begin_monotonic_ns: 0,
            begin_wall_ns: 0,
            end_monotonic_ns: None,
            end_wall_ns: None,
            outcome: StepOutcome::Running,
            phases: vec![],
            nvml_before_begin: None,
            device_at_end: None,
            batch: None,
        },
        PredictFrom {
            facts: &ModelFacts::default(),
            capacity_bytes: 0,
            other_process_bytes: 0,
            extras: StepOneExtras::default(),
            config: &PredictConfig::default(),
        },
    );
    assert!(p.is_none());
}

/// Steps 2.. with NVML step peaks as given (no allocator figures).
fn steps_with_peaks(peaks: &[u64]) -> (Vec<Marker>, Vec<GpuSample>) {
    let mut ms = Vec::new();
    let mut ss = Vec::new();
    for (i, &peak) in peaks.iter().enumerate() {
        let step = i as u64 + 1;
        let t0 = step * 1000;
        for (k, kind) in MarkerKind::STEP_ORDER.into_iter().enumerate() {
            ms.push(marker(kind, step, t0 + 100 * k as u64, 0, None));
        }
        ss.extend(samples(
            &[(t0 + 50, 1000), (t0 + 150, peak), (t0 + 250, peak - 100)],
            20_000,
        ));
    }
    (ms, ss)
}

#[test]
fn first_step_anomaly_steady_profile_and_steady_state() {
    let (ms, ss) = steps_with_peaks(&[6000, 8000, 8300, 8100, 8100, 8100]);
    let (mut t, key) = tracker(ModelFacts::default());
    t.markers(&key, &ms, 0).unwrap();
    t.gpu_samples(GPU, &ss);
    let a = t.rank_analysis(&key).unwrap();
    assert_eq!(
        a.first_step.as_ref().unwrap().nvml_peak_bytes,
        Some(6000 * M)
    );
    let steady = a.steady.as_ref().unwrap();
    assert_eq!(steady.steps, [2, 3, 4, 5, 6]);
    assert_eq!(steady.nvml_peak_bytes, Some(8100 * M));
    assert_eq!(steady.duration_ns, Some(500));
    assert_eq!(
        steady.phase(PhaseKind::Forward).unwrap().nvml_peak_bytes,
        Some(8100 * M)
    );
    assert_eq!(a.anomaly_ratio, Some(8100.0 / 6000.0));
    // 8000→8300 and 8300→8100 differ by more than 2%; 8100, 8100, 8100 agree.
    assert_eq!(
        a.steady_state,
        SteadyState {
            reached: true,
            since_step: Some(4),
            source: Some(PeakSource::Nvml)
        }
    );
    let anomaly = a.anomaly.unwrap();
    // Neither the optimizer phase nor the epilogue has a sample: no level
    // after the optimizer, so no NVML jump; no allocator figures either.
    assert_eq!(anomaly.optimizer.optimizer_nvml_jump_bytes, None);
    assert_eq!(anomaly.optimizer.optimizer_allocated_jump_bytes, None);

    // Two completed steps after the first make a steady profile, not a steady state.
    let (ms, ss) = steps_with_peaks(&[6000, 8000, 8100]);
    let (mut t, key) = tracker(ModelFacts::default());
    t.markers(&key, &ms, 0).unwrap();
    t.gpu_samples(GPU, &ss);
    let a = t.rank_analysis(&key).unwrap();
    assert_eq!(a.steady.unwrap().nvml_peak_bytes, Some(8050 * M));
    assert!(!a.steady_state.reached);
}

#[test]
fn optimizer_jumps_and_activation_plateau_of_step_one() {
    let (mut t, key) = tracker(ModelFacts::default());
    t.markers(&key, &base_markers(true), 0).unwrap();
    // Forward peaks at 5000 (t 280); within 5% (≥ 4750) from t 250; backward
    // drops below 4750 at t 360.
    t.gpu_samples(
        GPU,
        &samples(
            &[
                (210, 2000),
                (250, 4800),
                (280, 5000),
                (320, 4900),
                (360, 4600),
                (450, 5200),
                (550, 5300),
            ],
            10_000,
        ),
    );
    let anomaly = t.rank_analysis(&key).unwrap().anomaly.unwrap();
    assert_eq!(
        anomaly.optimizer.optimizer_allocated_jump_bytes,
        Some(800 * M as i64)
    );
    // 5300 (epilogue's first) − 4600 (backward's last).
    assert_eq!(
        anomaly.optimizer.optimizer_nvml_jump_bytes,
        Some(700 * M as i64)
    );
    // Serialized flat into the anomaly, as the HTTP API shows it.
    let json = serde_json::to_value(&anomaly).unwrap();
    assert_eq!(json["optimizer_nvml_jump_bytes"], 700 * M);
    // Optimizer-phase peak 5200 − backward peak 4900.
    assert_eq!(
        anomaly.optimizer.optimizer_nvml_peak_over_backward_bytes,
        Some(300 * M as i64)
    );
    assert_eq!(
        anomaly.activation_plateau,
        Some(ActivationPlateau {
            forward_peak_bytes: 5000 * M,
            start_ns: 250,
            end_ns: 360,
            duration_ns: 110,
            cleared: true
        })
    );

    // NVML that never drops (the reserved pool): the plateau lasts to backward's end.
    let (mut t, key) = tracker(ModelFacts::default());
    t.markers(&key, &base_markers(true), 0).unwrap();
    t.gpu_samples(
        GPU,
        &samples(&[(250, 4800), (280, 5000), (320, 5000)], 10_000),
    );
    let plateau = t
        .rank_analysis(&key)
        .unwrap()
        .anomaly
        .unwrap()
        .activation_plateau
        .unwrap();
    assert_eq!(
        (plateau.start_ns, plateau.end_ns, plateau.cleared),
        (250, 400, false)
    );
}

#[test]
fn job_divergence_names_the_outlier_rank() {
    let mut t = Tracker::new(TrackerConfig::default());
    let peaks = [7000, 7000, 9100];
    for (rank, &peak) in peaks.iter().enumerate() {
        let gpu = format!("GPU-{rank}");
        let key = kit::open(&mut t, kit::rank_of("job", rank as u32, 3));
        let mut ms = base_markers(false);
        // Rank 1's step takes 660 ns, the others 500.
        if rank == 1 {
            ms[5].monotonic_ns = 760;
        }
        t.markers(&key, &ms, 0).unwrap();
        t.gpu_samples(&gpu, &samples(&[(350, peak)], 10_000));
    }
    // Another job on the node does not count.
    t.open(
        RankInfo {
            job: "other".into(),
            world_size: 1,
            ..Default::default()
        },
        0,
    )
    .unwrap();
    let d = t.job_divergence("", "job").unwrap();
    assert_eq!(d.ranks, [0, 1, 2]);
    let p = d.peak.unwrap();
    // (9100 − 7000) / 7000 = 0.3; rank 2 is 30% above the median.
    assert!((p.spread - 0.3).abs() < 1e-12);
    assert_eq!(p.outliers.iter().map(|o| o.rank).collect::<Vec<_>>(), [2]);
    let dur = d.duration.unwrap();
    // durations 500, 660, 500: (660 − 500) / 500 = 0.32.
    assert!((dur.spread - 0.32).abs() < 1e-12);
    assert_eq!(dur.outliers.iter().map(|o| o.rank).collect::<Vec<_>>(), [1]);
    assert!(t.job_divergence("", "nobody").is_none());
}

#[test]
fn samples_are_credited_when_one_batch_closes_a_step_and_opens_the_next() {
    // Regression: the crediting walk used to stop at the new step (its only
    // phase still open) and never reach the step the same batch closed.
    let (mut t, key) = tracker(ModelFacts::default());
    t.gpu_samples(GPU, &samples(&BASE_SAMPLES, 10_000));
    let mut ms = base_markers(true);
    ms.push(marker(MarkerKind::StepBegin, 2, 700, 0, None));
    t.markers(&key, &ms, 0).unwrap();
    let first = t.rank(&key).unwrap().timeline.steps().next().unwrap();
    assert_eq!(first.nvml_peak_bytes(), Some(8000 * M));
    let credited: u64 = first.phases.iter().map(|p| p.nvml.samples).sum();
    assert_eq!(credited, 5);
}

#[test]
fn layout_allowance_covers_only_lazily_created_state_from_the_cache() {
    // A small cache when the optimizer began: 1700 − 1400 = 300 of the
    // 800 of state can have landed in it; the rest got segments of its own.
    let mut ms = base_markers(true);
    ms[3].allocator = stats(Some((1400, 6000, 1700)));
    let p = run(&ms, &BASE_SAMPLES, 10_000);
    let i = &p.inputs;
    assert_eq!(i.reserved.cache_at_optimizer_begin_bytes, Some(300 * M));
    assert_eq!(i.reserved.state_from_cache_bytes, 300 * M);
    // round(300 / 16) M, in bytes.
    assert_eq!(i.layout.layout_allowance_bytes, 300 * M / 16);
    assert!(
        p.explanation.contains("layout allowance"),
        "{}",
        p.explanation
    );

    // Pre-created or absent state strands nothing.
    let p = base_without_jump(adam(100 * M));
    assert_eq!(p.inputs.state.state_source, StateSource::DetectedPrecreated);
    assert_eq!(
        (
            p.inputs.reserved.state_from_cache_bytes,
            p.inputs.layout.layout_allowance_bytes
        ),
        (0, 0)
    );

    // The fraction is a tunable: 0 gives the plain ratio rule.
    let (mut t, key) = tracker(ModelFacts::default());
    t.set_analysis_config(AnalysisConfig {
        predict: PredictConfig {
            layout_allowance_fraction: 0.0,
            ..Default::default()
        },
        ..Default::default()
    });
    t.gpu_samples(GPU, &samples(&BASE_SAMPLES, 10_000));
    t.markers(&key, &base_markers(true), 0).unwrap();
    let p = t.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(p.inputs.layout.layout_allowance_bytes, 0);
    assert_eq!(p.predicted_peak_bytes, 9000 * M);

    // NVML only: no cache figure, no allowance.
    let p = run(&base_markers(false), &BASE_SAMPLES, 10_000);
    assert_eq!(p.inputs.basis, PredictionBasis::NvmlOnly);
    assert_eq!(p.inputs.layout.layout_allowance_bytes, 0);
}

#[test]
fn overhead_comes_from_the_tightest_bounds_not_a_late_first_sample() {
    // The base scenario, but step 1 starts right after a sample (idle
    // allocator: 1700 = 1200 reserved + 500) and forward reserves fast: its
    // only sample, late in the phase, sees 6700 while reserved was 1200 at
    // its start and 6250 at its end.
    let markers = &base_markers(true)[..3];
    let points = [(90, 1700), (290, 6700)];
    let p = run_with(adam(100 * M), markers, &points, 10_000);
    // Bounds: lower max(1700 − 1200, 6700 − 6250) = 500; upper 6700 − 1200.
    assert_eq!(
        p.inputs.overhead.overhead_bytes,
        Some(500 * M),
        "{}",
        p.explanation
    );

    // Without the sample before the step, the forward's own lower bound.
    let p = run_with(adam(100 * M), markers, &points[1..], 10_000);
    assert_eq!(
        p.inputs.overhead.overhead_bytes,
        Some(450 * M),
        "{}",
        p.explanation
    );
}

/// A model whose parameters outweigh its activations (units M), step 1 up
/// to its optimizer's begin; reserved = the allocated peak (ratio 1), NVML
/// = reserved + 500:
///
/// | marker          | t   | allocated | alloc peak | reserved | NVML sample |
/// |-----------------|-----|-----------|------------|----------|-------------|
/// | step_begin      | 100 | 4000      | 4000       | 4000     | 150: 4500   |
/// | forward_begin   | 200 | 4000      | 4000       | 4000     | 250: 5500   |
/// | backward_begin  | 300 | 5000      | 5000       | 5000     | 350: 10100  |
/// | optimizer_begin | 400 | 8000      | 9600       | 9600     |             |
///
/// Adam over 1000 Mi fp32 parameters (4000 M): state 8000 M, made in the
/// optimizer phase; foreach Adam's `_foreach_sqrt(exp_avg_sq)` holds one
/// more parameter-sized list, 4000 M (on PyTorch 2.15, fake CUDA, the
/// step-1 optimizer peak was 3.0 × parameter bytes above its begin).
fn big_model_markers() -> Vec<Marker> {
    use MarkerKind::*;
    vec![
        marker(StepBegin, 1, 100, 0, Some((4000, 4000, 4000))),
        marker(ForwardBegin, 1, 200, 0, Some((4000, 4000, 4000))),
        marker(BackwardBegin, 1, 300, 0, Some((5000, 5000, 5000))),
        marker(OptimizerBegin, 1, 400, 0, Some((8000, 9600, 9600))),
    ]
}

const BIG_MODEL_SAMPLES: [(u64, u64); 3] = [(150, 4500), (250, 5500), (350, 10100)];

fn big_adam(implementation: OptimizerImplementation) -> ModelFacts {
    ModelFacts {
        parameter_count: Some(1000 * M),
        parameter_bytes: Some(4000 * M),
        optimizer: OptimizerKind::Adam,
        optimizer_implementation: implementation,
        ..Default::default()
    }
}

#[test]
fn foreach_adams_temporaries_count_in_the_estimate_from_model_facts() {
    let p = run_with(
        big_adam(OptimizerImplementation::Foreach),
        &big_model_markers(),
        &BIG_MODEL_SAMPLES,
        20_000,
    );
    let i = &p.inputs;
    assert_eq!(i.open_phase, Some(PhaseKind::Optimizer));
    assert_eq!(state(&p), (8000 * M, StateSource::ModelFacts));
    assert_eq!(i.optimizer_temporaries_bytes, 4000 * M);
    // Allocated at the optimizer's begin 8000 + state 8000 + temporaries 4000.
    assert_eq!(i.optimizer_phase_estimate_bytes, Some(20_000 * M));
    // max(first micro-batch 9600 + 8000, optimizer 20000) = 20000.
    assert_eq!(
        (i.basis_peak_bytes, i.binding),
        (20_000 * M, BindingTerm::OptimizerPhase)
    );
    // Ratio 1; the cache when the optimizer began, 9600 − 8000 = 1600, caps
    // the state from cache: allowance 1600 / 16 = 100; overhead 500.
    assert_eq!(i.layout.layout_allowance_bytes, 100 * M);
    assert_eq!(i.overhead.overhead_bytes, Some(500 * M));
    assert_eq!(p.predicted_peak_bytes, 20_600 * M, "{}", p.explanation);
    assert_eq!(p.headroom_bytes, Some(-600 * M as i64));
    assert!(p.oom_risk);

    // Unreported implementation: PyTorch's default on CUDA, foreach.
    let p = run_with(
        big_adam(OptimizerImplementation::Unknown),
        &big_model_markers(),
        &BIG_MODEL_SAMPLES,
        20_000,
    );
    assert_eq!(p.predicted_peak_bytes, 20_600 * M);

    // Fused Adam holds no temporaries: 8000 + 8000 = 16000 < 17600, the
    // first micro-batch binds: 17600 + 100 + 500 = 18200, it fits.
    let p = run_with(
        big_adam(OptimizerImplementation::Fused),
        &big_model_markers(),
        &BIG_MODEL_SAMPLES,
        20_000,
    );
    assert_eq!(p.inputs.optimizer_temporaries_bytes, 0);
    assert_eq!(p.inputs.optimizer_phase_estimate_bytes, Some(16_000 * M));
    assert_eq!(p.inputs.binding, BindingTerm::FirstMicroBatch);
    assert_eq!(p.predicted_peak_bytes, 18_200 * M);
    assert!(!p.oom_risk);

    // Before the optimizer begins, its begin is estimated as allocated at
    // the first forward + the gradients (parameter bytes): 4000 + 4000 +
    // 8000 + 4000 = 20000 again.
    let p = run_with(
        big_adam(OptimizerImplementation::Foreach),
        &big_model_markers()[..3],
        &BIG_MODEL_SAMPLES[..2],
        20_000,
    );
    assert_eq!(p.inputs.optimizer_phase_estimate_bytes, Some(20_000 * M));
    assert_eq!(p.inputs.binding, BindingTerm::OptimizerPhase);

    // Once the phase has been measured, the measurement replaces the
    // estimate: its peak already holds step 1's temporaries.
    let mut markers = big_model_markers();
    markers.push(marker(
        MarkerKind::OptimizerEnd,
        1,
        500,
        0,
        Some((16_000, 20_000, 20_000)),
    ));
    let mut points = BIG_MODEL_SAMPLES.to_vec();
    points.push((450, 20_500));
    let p = run_with(
        big_adam(OptimizerImplementation::Foreach),
        &markers,
        &points,
        20_000,
    );
    assert_eq!(p.inputs.optimizer_phase_estimate_bytes, None);
    assert_eq!(p.inputs.peaks.optimizer_phase_peak_bytes, Some(20_000 * M));
    assert_eq!(p.inputs.state.state_source, StateSource::MeasuredJump);
}

/// The base scenario, but backward reuses forward's cache: reserved stays at
/// 6250 while allocated peaks at 6000, so the reserved ratio falls from
/// 6250 / 5000 = 1.25 (known at backward's begin) to 6250 / 6000 once
/// backward has closed. Fused Adam (no temporaries), 100 Mi parameters:
/// state 800 M from facts.
fn cache_reuse_markers() -> Vec<Marker> {
    let mut ms = base_markers(true);
    ms.truncate(5);
    for m in &mut ms[3..] {
        let a = m.allocator.as_mut().unwrap();
        (a.reserved_bytes, a.reserved_peak_bytes) = (6250 * M, 6250 * M);
    }
    ms
}

#[test]
fn a_step2_oom_warning_is_withdrawn_only_on_a_measurement() {
    let facts = ModelFacts {
        optimizer_implementation: OptimizerImplementation::Fused,
        ..adam(100 * M)
    };
    let (mut t, key) = tracker(facts);
    let markers = cache_reuse_markers();
    let points = [
        (150, 1700),
        (250, 3500),
        (350, 6750),
        (450, 6750),
        (550, 6750),
    ];
    let feed = |t: &mut Tracker, m: std::ops::Range<usize>, s: std::ops::Range<usize>| {
        t.gpu_samples(GPU, &samples(&points[s], 7_700));
        let advisories = t.markers(&key, &markers[m], 0).unwrap();
        (
            advisories,
            t.rank_analysis(&key).unwrap().prediction.unwrap(),
        )
    };

    // Backward's begin: (5000 + 800) × 1.25 = 7250, + allowance 800 / 16
    // = 50, + overhead 500 = 7800 > 7700: warned.
    let (advisories, p) = feed(&mut t, 0..3, 0..2);
    assert_eq!(p.predicted_peak_bytes, 7800 * M, "{}", p.explanation);
    assert_eq!(advisories.len(), 1);
    assert_eq!(advisories[0].kind, AdvisoryKind::Step2OomPredicted);
    assert_eq!(p.warning_revision, None);

    // The optimizer's begin: (6000 + 800) × 6250 / 6000 ≈ 7083.3, + 50 +
    // 500 ≈ 7633.3 < 7700. The state is still the facts' estimate, so the
    // warning stands.
    let (advisories, p) = feed(&mut t, 3..4, 2..4);
    assert!(advisories.is_empty());
    assert!(p.headroom_bytes.unwrap() > 0, "{}", p.explanation);
    assert!(!p.rests_on_measurement());
    assert!(p.oom_risk, "{}", p.explanation);
    assert_eq!(
        p.warning_revision,
        Some(WarningRevision::UpheldUntilMeasured)
    );
    assert!(p.explanation.contains("warning given earlier stands"));

    // The optimizer's end: the state is the measured jump, 800; the same
    // figure now withdraws the warning, and says so.
    let (_, p) = feed(&mut t, 4..5, 4..5);
    assert_eq!(p.inputs.state.state_source, StateSource::MeasuredJump);
    assert!(p.rests_on_measurement());
    assert!(!p.oom_risk, "{}", p.explanation);
    assert_eq!(
        p.warning_revision,
        Some(WarningRevision::WithdrawnOnMeasurement)
    );
    assert!(p.explanation.contains("withdraws the step-2 OOM warning"));

    // Never warned: no revision to speak of.
    let (mut t2, key2) = tracker(adam(100 * M));
    t2.gpu_samples(GPU, &samples(&points, 20_000));
    t2.markers(&key2, &markers, 0).unwrap();
    let p = t2.rank_analysis(&key2).unwrap().prediction.unwrap();
    assert_eq!(p.warning_revision, None);
}

/// NVML only, and the level does not move across the optimizer phase
/// (from 400): the caching allocator served the state from blocks
/// backward freed.
fn nvml_flat_samples() -> [(u64, u64); 8] {
    NVML_SAMPLES.map(|(t, used)| (t, if t > 400 { 7000 } else { used }))
}

#[test]
fn nvml_only_says_it_cannot_see_cache_reuse_and_sizes_state_from_the_optimizer_kind() {
    // No facts: no jump proves nothing; state 0, but not as a measurement.
    let p = run(&base_markers(false), &nvml_flat_samples(), 8_000);
    let i = &p.inputs;
    assert_eq!(i.basis, PredictionBasis::NvmlOnly);
    assert_eq!(i.state.measured_jump_bytes, Some(0));
    assert_eq!(state(&p), (0, StateSource::UnseenOnNvml));
    assert_eq!(
        i.basis_limits,
        vec![
            BasisLimit::NvmlOnlyCannotSeeCacheReuse,
            BasisLimit::OptimizerStateUnsized
        ]
    );
    // max(7100 + 0, 7000, 7100).
    assert_eq!(p.predicted_peak_bytes, 7100 * M);

    // The hello says Adam over 500 M of parameters (no count): two state
    // tensors of the parameters' size, 1000 M; max(7100 + 1000, ...) = 8100.
    let facts = ModelFacts {
        parameter_bytes: Some(500 * M),
        optimizer: OptimizerKind::Adam,
        ..Default::default()
    };
    let p = run_with(facts, &base_markers(false), &nvml_flat_samples(), 8_000);
    let i = &p.inputs;
    assert_eq!(state(&p), (1000 * M, StateSource::ModelFacts));
    assert_eq!(
        i.basis_limits,
        vec![BasisLimit::NvmlOnlyCannotSeeCacheReuse]
    );
    assert_eq!(p.predicted_peak_bytes, 8100 * M);
    assert!(p.oom_risk);

    // Plain SGD keeps no state: nothing unsized.
    let sgd = ModelFacts {
        optimizer: OptimizerKind::Sgd,
        ..Default::default()
    };
    let p = run_with(sgd, &base_markers(false), &nvml_flat_samples(), 8_000);
    assert_eq!(p.inputs.state.state_source, StateSource::Stateless);
    assert_eq!(
        p.inputs.basis_limits,
        vec![BasisLimit::NvmlOnlyCannotSeeCacheReuse]
    );

    // The allocator basis sees what the cache hands out, but not which
    // cached blocks the lazily made state split (the layout allowance
    // guesses at it).
    let p = base(ModelFacts::default());
    assert_eq!(
        p.inputs.basis_limits,
        vec![BasisLimit::AllocatorFiguresCannotSeeLayout]
    );
    // No state made in step 1: nothing to guess.
    let p = base_without_jump(ModelFacts::default());
    assert!(p.inputs.basis_limits.is_empty(), "{:?}", p.inputs);
}

#[test]
fn metric_labels_are_the_json_names() {
    for l in BasisLimit::ALL {
        assert_eq!(
            serde_json::to_value(l).unwrap(),
            serde_json::Value::from(l.as_str())
        );
    }
    for b in [
        PredictionBasis::Allocator,
        PredictionBasis::NvmlOnly,
        PredictionBasis::AllocatorReplay,
    ] {
        assert_eq!(
            serde_json::to_value(b).unwrap(),
            serde_json::Value::from(b.as_str())
        );
    }
}

/// Lightning's closure sets the gradients to None after `training_step`,
/// just before backward: step 2's forward runs beside step 1's gradients
/// and the state. (On PyTorch 2.15, fake CUDA, `lightning-gpt` markers
/// only: step 2's allocated peak 3776 MB came in its forward; step 1's
/// forward peak 2279.6 + state 1005.0 + gradients 499.8 = 3784.4, where
/// the first micro-batch term gave 3491.7.)
#[test]
fn gradients_freed_before_backward_are_alive_in_step_2s_forward() {
    // The base scenario, but the forward peaks at 5800 (the since-start
    // peak at backward's begin) and backward at 6000.
    let mut markers = base_markers(true);
    markers[2] = marker(
        MarkerKind::BackwardBegin,
        1,
        300,
        0,
        Some((5000, 5800, 6250)),
    );
    let run_as = |framework: &str| {
        let mut t = Tracker::new(TrackerConfig::default());
        let framework = framework.into();
        let key = kit::open(
            &mut t,
            RankInfo {
                framework,
                ..the_rank()
            },
        );
        t.gpu_samples(GPU, &samples(&BASE_SAMPLES, 10_000));
        t.markers(&key, &markers, 0).unwrap();
        t.rank_analysis(&key).unwrap().prediction.unwrap()
    };

    // PyTorch's default: max(first micro-batch 6000 + 800, ...) = 6800;
    // × 7500 / 6000 = 8500, + allowance 50 + overhead 500.
    let p = run_as("pytorch");
    assert_eq!(p.inputs.gradients, Gradients::FreedBeforeStep);
    assert_eq!(p.inputs.forward_grad_bytes, 0);
    assert_eq!(p.inputs.basis_peak_bytes, 6800 * M);
    assert_eq!(p.predicted_peak_bytes, 9050 * M);

    // Lightning: the forward's 5800 + state 800 + gradients 400 (allocated
    // after the first backward 1400 − before the first forward 1000) = 7000.
    let p = run_as("lightning");
    let i = &p.inputs;
    assert_eq!(i.gradients, Gradients::FreedBeforeBackward);
    assert_eq!(i.forward_grad_bytes, 400 * M);
    assert_eq!(
        (i.basis_peak_bytes, i.binding),
        (7000 * M, BindingTerm::FirstForwardBesideGradients)
    );
    // 7000 × 1.25 = 8750, + 50 + 500.
    assert_eq!(p.predicted_peak_bytes, 9300 * M, "{}", p.explanation);
}

/// Early in step 1 the reserved/allocated ratio is mostly cache kept from
/// initialisation (FSDP: the unsharded model, freed after sharding). The
/// optimizer estimate's new tensors reuse that cache; multiplying them by
/// the ratio once warned a job with 8% to spare (fsdp2-4 on real PyTorch).
#[test]
fn the_optimizer_estimate_takes_its_new_tensors_at_their_own_size() {
    use MarkerKind::*;
    // Allocated 1000, reserved 3000: a ratio of 3 at step 1's first forward.
    let markers = vec![
        marker(StepBegin, 1, 100, 0, Some((1000, 1000, 3000))),
        marker(ForwardBegin, 1, 200, 0, Some((1000, 1000, 3000))),
    ];
    let facts = ModelFacts {
        parameter_count: Some(250 * M),
        parameter_bytes: Some(1000 * M),
        optimizer: OptimizerKind::Adam,
        optimizer_implementation: OptimizerImplementation::Foreach,
        ..Default::default()
    };
    let p = run_with(facts, &markers, &[(150, 3500)], 20_000);
    let i = &p.inputs;
    // State 250 M × 8 = 2000, temporaries half of it = 1000; the estimate:
    // allocated at the first forward 1000 + gradients 1000 + 2000 + 1000.
    assert_eq!(i.optimizer_phase_estimate_bytes, Some(5000 * M));
    assert_eq!(i.binding, BindingTerm::OptimizerPhase);
    assert_eq!(i.reserved.reserved_ratio, Some(3.0));
    // What step 1 had allocated (1000 + gradients 1000) at the ratio, the new
    // state and temporaries (3000) as they are, + allowance 2000 / 16 = 125:
    // 6000 + 3000 + 125, not 5000 × 3 + 125.
    assert_eq!(
        i.predicted_reserved_bytes,
        Some(9125 * M),
        "{}",
        p.explanation
    );
}

#[test]
fn facts_learnt_after_the_hello_revise_the_prediction_until_step_2() {
    // The hello said nothing of the gradients; step 1 ran as in the base
    // scenario (9050 predicted: fits a 9300 GPU). Then the client saw
    // `zero_grad(set_to_none=False)`: the gradients persist, 400 more →
    // 9550 (as in `persistent_grads_are_added_unless_set_to_none`), which
    // does not fit.
    let (mut t, key) = tracker(ModelFacts::default());
    t.gpu_samples(GPU, &samples(&BASE_SAMPLES, 9300));
    let first = t.markers(&key, &base_markers(true), 0).unwrap();
    assert!(
        !first
            .iter()
            .any(|a| a.kind == AdvisoryKind::Step2OomPredicted),
        "9050 fits 9300: {first:?}"
    );
    let before = t.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(before.predicted_peak_bytes, 9050 * M);

    // A bad update is refused whole and changes nothing.
    let bad = ModelFacts {
        sharding_factor: Some(0),
        ..keep_grads()
    };
    assert!(t.update_model_facts(&key, &bad, 650).is_err());
    assert_eq!(t.rank(&key).unwrap().info.model.grads_set_to_none, None);

    let keep = keep_grads();
    let due = t.update_model_facts(&key, &keep, 650).unwrap().unwrap();
    assert_eq!(
        due.iter().map(|a| a.kind).collect::<Vec<_>>(),
        [AdvisoryKind::Step2OomPredicted]
    );
    assert_eq!(due[0].predicted_peak_bytes, 9550 * M);
    let after = t.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(
        (
            after.inputs.grads.grad_bytes,
            after.inputs.grads.grads_source
        ),
        (400 * M, GradsSource::Measured)
    );

    // Once step 2 began the prediction made before it stands.
    t.markers(&key, &[marker(MarkerKind::StepBegin, 2, 700, 0, None)], 700)
        .unwrap();
    let freed = ModelFacts {
        grads_set_to_none: Some(true),
        ..Default::default()
    };
    assert_eq!(t.update_model_facts(&key, &freed, 800), Ok(None));
    let frozen = t
        .rank(&key)
        .unwrap()
        .prediction_before_step2
        .clone()
        .unwrap();
    assert_eq!(frozen.predicted_peak_bytes, 9550 * M);
}

#[test]
fn kept_gradients_are_no_larger_than_the_parameters() {
    // Backward left 400 more allocated than before the first forward, but
    // the parameters are 300: the other 100 are the loop's variables (the
    // logits), which step 2 rebinds. max(6000 + 800 + 300, …) = 7100 →
    // × 1.25 = 8875 → + 50 → + 500.
    let keep = ModelFacts {
        parameter_bytes: Some(300 * M),
        ..keep_grads()
    };
    let p = base(keep);
    assert_eq!(grads(&p), (300 * M, GradsSource::ModelFacts));
    assert_eq!(p.inputs.basis_peak_bytes, 7100 * M);
    assert_eq!(p.predicted_peak_bytes, 9425 * M);

    // Parameters larger than the measurement leave it alone.
    let keep = ModelFacts {
        parameter_bytes: Some(500 * M),
        ..keep_grads()
    };
    let p = base(keep);
    assert_eq!(grads(&p), (400 * M, GradsSource::Measured));
}

/// A large-pool segment at `address` (in M) with blocks (size in M, allocated).
fn seg(address: u64, blocks: &[(u64, bool)]) -> allocator::SegmentLayout {
    allocator::SegmentLayout::new(
        address * M,
        allocator::Pool::Large,
        blocks
            .iter()
            .map(|&(size, allocated)| allocator::BlockLayout {
                size: size * M,
                allocated,
                gradient: false,
            })
            .collect(),
    )
}

/// The base scenario's markers, its optimizer begin and end carrying segment
/// layouts that match their figures: at the begin 1400 allocated (weights,
/// gradients) and backward's cache, free blocks of 4000 and 2100 (7500
/// reserved); at the end the 800 of state carved out of the block `split`.
fn markers_with_layouts(split: u64) -> Vec<Marker> {
    let begin = vec![
        seg(0, &[(1400, true)]),
        seg(10_000, &[(4000, false)]),
        seg(20_000, &[(2100, false)]),
    ];
    let end = begin
        .iter()
        .map(|s| match s.blocks[0].size / M {
            n if n == split => seg(s.address / M, &[(400, true), (400, true), (n - 800, false)]),
            _ => s.clone(),
        })
        .collect();
    let mut ms = base_markers(true);
    ms[3].layout_segments = begin;
    ms[4].layout_segments = end;
    ms
}

#[test]
fn segment_layouts_replace_the_guessed_layout_allowance() {
    // Best fit puts the state in the 2100 block (the smallest that holds
    // 400), leaving 1300. Step 2 wants back 4000 (its own block) and 2100
    // (no free block that large): one new segment of 2100. Reserved = 7500
    // at the optimizer's end + 2100 = 9600, above the ratio figure (8500:
    // the device peak was 9000 at allowance 0, see
    // `layout_allowance_covers_only_lazily_created_state_from_the_cache`);
    // + 500 overhead. Without layouts the allowance was 800 / 16 = 50 and
    // the device peak 9050.
    let p = run(&markers_with_layouts(2100), &BASE_SAMPLES, 10_000);
    let i = &p.inputs;
    assert_eq!(i.basis, PredictionBasis::Allocator);
    assert_eq!(i.layout.layout_allowance_bytes, 2100 * M);
    let l = layout_snapshots(&p);
    assert_eq!(l.new_segment_bytes, 2100 * M);
    assert_eq!(l.cached_at_begin_bytes, 6100 * M);
    assert_eq!(l.blocks_needing_new_segments, 1);
    assert_eq!(l.reserved_at_end_bytes, 7500 * M);
    assert_eq!(i.layout.reserved_at_optimizer_end_bytes, Some(7500 * M));
    assert_eq!(i.predicted_reserved_bytes, Some(9600 * M));
    assert_eq!(p.predicted_peak_bytes, 10_100 * M, "{}", p.explanation);
    assert!(
        !i.basis_limits
            .contains(&BasisLimit::AllocatorFiguresCannotSeeLayout),
        "{:?}",
        i.basis_limits
    );
    assert!(
        p.explanation.contains("2.20 GB of new segments")
            && p.explanation.contains("segment snapshots"),
        "{}",
        p.explanation
    );

    // Had the state split the 4000 block instead, its 3200 rest would take
    // the 2100 request and only 4000 would be new: which block, not how
    // much state, decides.
    let p = run(&markers_with_layouts(4000), &BASE_SAMPLES, 10_000);
    assert_eq!(p.inputs.layout.layout_allowance_bytes, 4000 * M);
    assert_eq!(p.predicted_peak_bytes, (7500 + 4000 + 500) * M);

    // The state in a segment of its own: nothing new, and the ratio figure
    // (8500 reserved) is the floor over 7500 + 0.
    let mut ms = markers_with_layouts(2100);
    ms[4].layout_segments = ms[3].layout_segments.clone();
    ms[4].layout_segments.push(seg(30_000, &[(800, true)]));
    let p = run(&ms, &BASE_SAMPLES, 10_000);
    assert_eq!(p.inputs.layout.layout_allowance_bytes, 0);
    assert_eq!(p.predicted_peak_bytes, 9000 * M);
}

#[test]
fn layout_new_segments_stop_at_the_reserved_limit_known_before_the_optimizer_ends() {
    // `segment_layouts_replace_the_guessed_layout_allowance`'s first case,
    // its markers in two batches as a client sends them: when the end
    // layout arrives the rank's reserved limit is known, capacity 10000 −
    // overhead 500 = 9500 (the layouts hold all 7500 reserved: nothing
    // left out). 7500 + 2100 new would pass it; past it PyTorch releases
    // its cache and retries: 2000 new. Reserved max(9500, ratio 8500) +
    // 500 = the capacity. Whether the release frees enough the layouts
    // cannot show: a step-2 OOM risk, as when the same markers arrive in
    // one batch (no limit known yet, 2100 new, headroom −100). Warning at
    // headroom 0 from the cut figure missed `gpt-activation-checkpointing`'s
    // step-2 OOM on real PyTorch, where the batches fell the other way.
    let ms = markers_with_layouts(2100);
    let (mut t, key) = tracker(ModelFacts::default());
    t.gpu_samples(GPU, &samples(&BASE_SAMPLES, 10_000));
    t.markers(&key, &ms[..4], 0).unwrap();
    t.markers(&key, &ms[4..], 0).unwrap();
    let p = t.rank_analysis(&key).unwrap().prediction.unwrap();
    let l = layout_snapshots(&p);
    assert_eq!(l.new_segment_bytes, 2000 * M);
    assert!(l.capped_at_reserved_limit);
    assert_eq!(p.inputs.predicted_reserved_bytes, Some(9500 * M));
    assert_eq!(p.predicted_peak_bytes, 10_000 * M, "{}", p.explanation);
    assert!(p.oom_risk && p.low_headroom);
    assert!(
        p.explanation.contains("cut to the reserved limit"),
        "{}",
        p.explanation
    );
    let advised = stepwatch_core::due(&p, 10_000 * M, 1, 0, &[]);
    assert_eq!(advised.len(), 1);
    assert_eq!(advised[0].kind, AdvisoryKind::Step2OomPredicted);
    assert!(
        advised[0].message.contains("may still run out"),
        "{}",
        advised[0].message
    );
    // One batch: the limit is not known when the end layout arrives.
    let p = run(&ms, &BASE_SAMPLES, 10_000);
    assert!(!layout_snapshots(&p).capped_at_reserved_limit);
    assert!(p.oom_risk, "{}", p.explanation);
}

#[test]
fn layouts_with_the_gradients_on_a_side_stream_cascade_to_the_largest_request() {
    // The base layouts with the 1400 allocated at optimizer begin split:
    // 1000 of weights on the default stream, the 400 of gradients on a
    // side stream (FSDP2's reduce-scatter stream), as the facts' 400 of
    // parameter bytes. The state splits the 2100 block. Step 2's 2100
    // request takes the 4000 block the optimizer left alone (best fit over
    // the 1300 rest), whose own request then finds 1900 and 1300: 4000
    // new, not 2100. One batch: no reserved limit yet. Reserved 7500 +
    // 4000, + 500 overhead.
    let mut ms = markers_with_layouts(2100);
    for layout in [3, 4] {
        let mut grads = seg(5_000, &[(400, true)]);
        grads.stream = 7;
        ms[layout].layout_segments[0] = seg(0, &[(1000, true)]);
        ms[layout].layout_segments.push(grads);
    }
    let facts = ModelFacts {
        parameter_bytes: Some(400 * M),
        ..Default::default()
    };
    let p = run_with(facts, &ms, &BASE_SAMPLES, 20_000);
    let l = layout_snapshots(&p);
    assert_eq!(l.new_segment_bytes, 4000 * M);
    assert_eq!(l.blocks_needing_new_segments, 1);
    assert_eq!(p.predicted_peak_bytes, 12_000 * M, "{}", p.explanation);
    // Gradients larger than what the side stream holds share the default
    // stream: the rule for them, 2100 new.
    let facts = ModelFacts {
        parameter_bytes: Some(500 * M),
        ..Default::default()
    };
    let p = run_with(facts, &ms, &BASE_SAMPLES, 20_000);
    assert_eq!(p.inputs.layout.layout_allowance_bytes, 2100 * M);
}

#[test]
fn flagged_gradients_are_freed_and_requests_stay_within_step_1s_peak_plus_state() {
    // The base layouts with the 1400 allocated at optimizer begin split into
    // 1000 of weights and a 400 gradient the client flagged; gradients set
    // to None between steps. Served from the whole end layout less the
    // gradient, oldest segment (highest address) first: the 2100 request
    // takes the 4000 block (the 1300 rest and the freed 400 are too small),
    // 1900 left. The 4000 request would make 1800 (weights, state) + 2100 +
    // 4000 = 7900 held at once, past step 1's allocated peak before its
    // optimizer (6000) plus the state (800): the 2100 request is gone by
    // then and the 4000 block serves its own request. Nothing new, where
    // the rule without flags finds 2100
    // (`segment_layouts_replace_the_guessed_layout_allowance`).
    let flagged = |begin_peak: u64| {
        let mut ms = markers_with_layouts(2100);
        for layout in [3, 4] {
            let mut weights_and_gradient = seg(0, &[(1000, true), (400, true)]);
            weights_and_gradient.blocks[1].gradient = true;
            ms[layout].layout_segments[0] = weights_and_gradient;
        }
        ms[3].allocator.as_mut().unwrap().allocated_peak_bytes = begin_peak * M;
        ms
    };
    let p = run(&flagged(6000), &BASE_SAMPLES, 20_000);
    let l = layout_snapshots(&p);
    assert_eq!(l.new_segment_bytes, 0);
    assert_eq!(l.cached_at_begin_bytes, 6100 * M);
    // Had step 1 held 8000 at once, both fit under 8800: the 4000 request
    // finds its block split, one new 4000 segment.
    let p = run(&flagged(8000), &BASE_SAMPLES, 20_000);
    let l = layout_snapshots(&p);
    assert_eq!(l.new_segment_bytes, 4000 * M);
    assert_eq!(l.blocks_needing_new_segments, 1);
}

#[test]
fn layouts_count_only_on_step_1s_optimizer_begin_and_end() {
    let guessed = 9050 * M;
    // The end without the begin: nothing to compare, the guess stands.
    let mut ms = markers_with_layouts(2100);
    ms[3].layout_segments.clear();
    let p = run(&ms, &BASE_SAMPLES, 10_000);
    assert_eq!(p.inputs.layout.layout_snapshots, None);
    assert_eq!(p.predicted_peak_bytes, guessed);
    assert!(p
        .inputs
        .basis_limits
        .contains(&BasisLimit::AllocatorFiguresCannotSeeLayout));

    // On other markers they are ignored.
    let mut ms = markers_with_layouts(2100);
    ms[2].layout_segments = std::mem::take(&mut ms[3].layout_segments);
    let p = run(&ms, &BASE_SAMPLES, 10_000);
    assert_eq!(
        (p.inputs.layout.layout_snapshots, p.predicted_peak_bytes),
        (None, guessed)
    );

    // A layout the model cannot take (overlapping segments): ignored.
    let mut ms = markers_with_layouts(2100);
    ms[4].layout_segments.push(seg(10_001, &[(10, true)]));
    let p = run(&ms, &BASE_SAMPLES, 10_000);
    assert_eq!(
        (p.inputs.layout.layout_snapshots, p.predicted_peak_bytes),
        (None, guessed)
    );

    // Before step 1's optimizer phase closes the begin alone changes nothing.
    let ms = markers_with_layouts(2100);
    let p = run(&ms[..4], &BASE_SAMPLES, 10_000);
    assert_eq!(p.inputs.layout.layout_snapshots, None);
}

#[test]
fn what_became_of_each_layout_is_counted() {
    let counts = |ms: &[Marker]| {
        let (mut t, key) = tracker(ModelFacts::default());
        t.gpu_samples(GPU, &samples(&BASE_SAMPLES, 10_000));
        t.markers(&key, ms, 0).unwrap();
        t.layout_counts()
    };
    let of = |kept, misplaced, too_many_blocks, unmodelled| LayoutCounts {
        kept,
        misplaced,
        too_many_blocks,
        unmodelled,
    };
    assert_eq!(counts(&markers_with_layouts(2100)), of(2, 0, 0, 0));
    // An end without its begin; a layout on backward's begin.
    let mut ms = markers_with_layouts(2100);
    ms[2].layout_segments = std::mem::take(&mut ms[3].layout_segments);
    assert_eq!(counts(&ms), of(0, 2, 0, 0));
    // Overlapping segments at the end: the begin was kept, the pair is not.
    let mut ms = markers_with_layouts(2100);
    ms[4].layout_segments.push(seg(10_001, &[(10, true)]));
    assert_eq!(counts(&ms), of(1, 0, 0, 1));
    // More blocks than a rank may hold.
    let mut ms = markers_with_layouts(2100);
    ms[3].layout_segments = vec![seg(0, &vec![(1, true); MAX_LAYOUT_BLOCKS + 1])];
    assert_eq!(counts(&ms), of(0, 1, 1, 0));
    // Step 2's markers carrying layouts (a client that never stops).
    let mut ms = markers_with_layouts(2100);
    let mut step2: Vec<Marker> = ms.clone();
    let after = ms.last().unwrap().monotonic_ns;
    for m in &mut step2 {
        m.step = 2;
        m.monotonic_ns += after;
        m.wall_ns += after;
    }
    ms.extend(step2);
    assert_eq!(counts(&ms), of(2, 2, 0, 0));
}

#[test]
fn a_replay_wins_over_layouts() {
    // The trace shows the layout and every request: its replay sets reserved
    // and the snapshots' figure is not added.
    let trace = AllocatorTrace {
        step: 1,
        segments: vec![seg(0, &[(1400, true)])],
        ..Default::default()
    };
    let replay = replay_step2(&trace, false).unwrap();
    let (mut t, key) = tracker(ModelFacts::default());
    t.gpu_samples(GPU, &samples(&BASE_SAMPLES, 10_000));
    t.markers(&key, &markers_with_layouts(2100)[..1], 0)
        .unwrap();
    t.allocator_replay(&key, replay, 0).unwrap();
    t.markers(&key, &markers_with_layouts(2100)[1..], 0)
        .unwrap();
    let p = t.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(p.inputs.basis, PredictionBasis::AllocatorReplay);
    assert_eq!(
        (
            p.inputs.layout.layout_snapshots,
            p.inputs.layout.layout_allowance_bytes
        ),
        (None, 0)
    );
}

#[test]
fn layouts_are_set_aside_under_gradient_accumulation_and_ddps_bucket_rebuild() {
    // The same layouts as `segment_layouts_replace_the_guessed_layout_allowance`
    // (2100 new), on cases where step 2 reuses cache the two layouts cannot
    // show: the guessed allowance stays, and the prediction says why.
    let layouts = markers_with_layouts(2100);
    let mut ms = accumulation_markers();
    ms[5].layout_segments = layouts[3].layout_segments.clone();
    ms[6].layout_segments = layouts[4].layout_segments.clone();
    let with = run(&ms, &ACC_SAMPLES, 10_000);
    for m in &mut ms {
        m.layout_segments.clear();
    }
    let without = run(&ms, &ACC_SAMPLES, 10_000);
    assert_eq!(
        with.inputs.layout.layout_snapshots_set_aside,
        Some(LayoutSetAside::GradientAccumulation)
    );
    assert_eq!(with.inputs.layout.layout_snapshots, None);
    assert_eq!(with.predicted_peak_bytes, without.predicted_peak_bytes);
    assert!(with
        .inputs
        .basis_limits
        .contains(&BasisLimit::AllocatorFiguresCannotSeeLayout));
    assert!(
        with.explanation
            .contains("segment snapshots were set aside"),
        "{}",
        with.explanation
    );
    assert_eq!(without.inputs.layout.layout_snapshots_set_aside, None);

    let ddp = ModelFacts {
        ddp_bucket_rebuild: Some(DdpBucketRebuild {
            old_bucket_bytes: vec![100 * M],
            new_bucket_bytes: vec![60 * M, 40 * M],
        }),
        ..Default::default()
    };
    let p = run_with(ddp, &layouts, &BASE_SAMPLES, 10_000);
    assert_eq!(
        p.inputs.layout.layout_snapshots_set_aside,
        Some(LayoutSetAside::DdpBucketRebuild)
    );
    assert_eq!(p.predicted_peak_bytes, 9050 * M);
}

/// The overhead measured at step 1's markers (`cudaMemGetInfo`), against
/// the NVML bounds when the one sample that would pin it is missed.
///
/// Unit M. Memory outside the rank's allocator: its CUDA context 512, and
/// another process's 300. State made before step 1 (no jump):
///
/// | marker          | t   | allocated | alloc peak | reserved | device used = 812 + reserved |
/// |-----------------|-----|-----------|------------|----------|------------------------------|
/// | step_begin      | 100 | 1000      | 1000       | 1200     | 2012                         |
/// | forward_begin   | 200 | 1000      | 1000       | 1200     | 2012                         |
/// | backward_begin  | 300 | 5000      | 5000       | 6250     | 7062                         |
/// | optimizer_begin | 400 | 1400      | 6000       | 7500     | 8312                         |
/// | optimizer_end   | 500 | 1400      | 6000       | 7500     | 8312                         |
/// | step_end        | 600 | 1400      | 6000       | 7500     | 8312                         |
///
/// NVML caught one sample, at 250 in forward, before forward's last 500 M
/// segment: 812 + 5750 = 6562. Its lower bound is 6562 − 6250 (reserved at
/// forward's end) = 312, its upper 6562 − 1200 = 5362: the NVML estimate is
/// 312, the context missed (on real PyTorch on fake CUDA,
/// gpt-precreated-state once gave 2 MiB for a 512 MiB context so).
/// The client's figures give max(used − reserved) = 812 at every marker.
///
/// Reserved: basis peak max(6000 + 0, 1400, 6000) = 6000, × 7500 / 6000 =
/// 7500, no allowance (no state made). Device = 7500 + overhead, at least
/// the NVML peak 6562.
fn precreated_markers(device: bool) -> Vec<Marker> {
    let mut markers = base_markers(true);
    for m in &mut markers[3..] {
        m.allocator = stats(Some((1400, 6000, 7500)));
    }
    if device {
        for m in &mut markers {
            let reserved = m.allocator.unwrap().reserved_bytes;
            m.device_memory = Some(DeviceMemory {
                free_bytes: 10_000 * M - 812 * M - reserved,
                total_bytes: 10_000 * M,
            });
        }
    }
    markers
}

#[test]
fn the_client_device_memory_pins_the_overhead_an_nvml_sample_missed() {
    let nvml = run(&precreated_markers(false), &[(250, 6562)], 10_000);
    let i = &nvml.inputs;
    assert_eq!(i.predicted_reserved_bytes, Some(7500 * M));
    assert_eq!(
        i.overhead.overhead_source,
        Some(OverheadSource::NvmlSamples)
    );
    assert_eq!(
        i.overhead.overhead_bytes,
        Some(312 * M),
        "{}",
        nvml.explanation
    );
    assert_eq!(i.overhead.nvml_overhead_bytes, Some(312 * M));
    assert_eq!(i.overhead.device_total_bytes, None);
    // 7500 + 312: the context is lost.
    assert_eq!(nvml.predicted_peak_bytes, 7812 * M);

    let p = run(&precreated_markers(true), &[(250, 6562)], 10_000);
    let i = &p.inputs;
    assert_eq!(
        i.overhead.overhead_source,
        Some(OverheadSource::ClientDeviceMemory)
    );
    assert_eq!(
        i.overhead.overhead_bytes,
        Some(812 * M),
        "{}",
        p.explanation
    );
    // The rank's own: 812 − the other process's 300 (NVML's process list).
    assert_eq!(i.overhead.process_overhead_bytes, Some(512 * M));
    assert_eq!(i.other_process_bytes, 300 * M);
    // The NVML estimate is still shown, to compare.
    assert_eq!(i.overhead.nvml_overhead_bytes, Some(312 * M));
    assert_eq!(i.overhead.device_total_bytes, Some(10_000 * M));
    // 7500 + 812 = 8312; the rank's share 8312 − 300; headroom 10000 − 8312.
    assert_eq!(p.predicted_peak_bytes, 8312 * M);
    assert_eq!(p.predicted_rank_peak_bytes, 8012 * M);
    assert_eq!(p.headroom_bytes, Some(1688 * M as i64));
    assert!(
        p.explanation
            .contains("CUDA driver's free and total memory"),
        "{}",
        p.explanation
    );
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["inputs"]["overhead_source"], "client_device_memory");
    assert_eq!(
        serde_json::to_value(i.overhead.overhead_source).unwrap(),
        OverheadSource::ClientDeviceMemory.as_str()
    );
}

/// The device prediction does not rest on NVML's process list, which is
/// read seconds apart: the other processes count as the device showed them
/// at the markers. A stale list (the other process not in it yet) only
/// moves the split between the rank's own share and the rest.
#[test]
fn a_stale_process_list_changes_the_split_not_the_device_prediction() {
    let (mut t, key) = tracker(ModelFacts::default());
    t.set_gpu_processes(GPU, &[(PID, 7000 * M)]);
    t.gpu_samples(GPU, &samples(&[(250, 6562)], 10_000));
    t.markers(&key, &precreated_markers(true), 0).unwrap();
    let p = t.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(p.predicted_peak_bytes, 8312 * M);
    assert_eq!(p.inputs.other_process_bytes, 0);
    assert_eq!(p.inputs.overhead.process_overhead_bytes, Some(812 * M));
}

/// Memory outside the allocator made during step 1 (cuBLAS workspaces,
/// NCCL buffers at the first collective) counts at its highest: the step-end
/// marker's figures count too. Here the device shows 200 M more from
/// backward on (overhead 812 → 1012); no NVML sample at all.
#[test]
fn the_overhead_is_the_highest_at_any_marker_the_step_end_included() {
    let mut markers = precreated_markers(true);
    for m in &mut markers[2..] {
        let d = m.device_memory.as_mut().unwrap();
        d.free_bytes -= 200 * M;
    }
    let p = run(&markers, &[], 10_000);
    assert_eq!(
        p.inputs.overhead.overhead_bytes,
        Some(1012 * M),
        "{}",
        p.explanation
    );
    assert_eq!(p.predicted_peak_bytes, 8512 * M);

    // Only the step-end marker carries the higher figure: still counted,
    // against the last phase's closing reserved bytes (7500).
    let mut markers = precreated_markers(true);
    markers[5].device_memory.as_mut().unwrap().free_bytes -= 200 * M;
    let p = run(&markers, &[], 10_000);
    assert_eq!(p.inputs.overhead.overhead_bytes, Some(1012 * M));

    // Markers without allocator figures give no reading: the overhead is
    // then NVML's, or assumed.
    let mut markers = precreated_markers(true);
    for m in &mut markers[..3] {
        m.device_memory = None;
    }
    for m in &mut markers[3..] {
        m.allocator = None;
    }
    let p = run(&markers, &[], 10_000);
    assert_eq!(
        p.inputs.overhead.overhead_source,
        Some(OverheadSource::Assumed)
    );
    assert_eq!(p.inputs.overhead.overhead_bytes, None);
}

#[test]
fn device_memory_with_more_free_than_total_is_refused() {
    let (mut t, key) = tracker(ModelFacts::default());
    let mut markers = precreated_markers(true);
    markers[1].device_memory = Some(DeviceMemory {
        free_bytes: 11 * M,
        total_bytes: 10 * M,
    });
    let err = t.markers(&key, &markers, 0).unwrap_err();
    assert!(
        err.to_string().contains("device_memory.free_bytes"),
        "{err}"
    );
    assert!(t.rank_analysis(&key).unwrap().prediction.is_none());
}
