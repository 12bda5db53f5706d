//! The memory model's behaviour: the first-step anomaly and its variants.

mod common;

use common::{allocated_at, marker, run, scenario};
use stepwatch_core::{Marker, MarkerKind, ModelFacts, OptimizerKind, Precision};
use stepwatch_sim::allocator::{round_size, segment_size};
use stepwatch_sim::{
    run_realtime, simulate, PeakMode, RankSim, Scenario, ScenarioError, SimEvent, SimOutcome, Sink,
};

use MarkerKind::*;

/// Optimizer state bytes this rank holds, from the model facts.
fn state_bytes(name: &str) -> u64 {
    let s = scenario(name);
    let f = RankSim::new(&s, 0).unwrap().model_facts();
    s.parameter_count() * u64::from(f.state_bytes_per_parameter.unwrap())
        / u64::from(f.sharding_factor.unwrap())
}

fn within(x: u64, target: u64, tolerance: f64) -> bool {
    (x as f64 - target as f64).abs() <= target as f64 * tolerance
}

#[test]
fn allocator_rounding_rules() {
    const MIB: u64 = 1 << 20;
    assert_eq!(round_size(1), 512);
    assert_eq!(round_size(1025), 1536);
    assert_eq!(segment_size(4096), 2 * MIB);
    assert_eq!(segment_size(MIB), 2 * MIB);
    assert_eq!(segment_size(2 * MIB), 20 * MIB);
    assert_eq!(segment_size(9 * MIB), 20 * MIB);
    assert_eq!(segment_size(100 * MIB + 3), 102 * MIB);
}

#[test]
fn adam_state_appears_exactly_in_the_step1_optimizer_phase() {
    let (ev, report, _) = run("adam-fits", 0);
    let state = state_bytes("adam-fits");
    // Nothing of it before: step 1 begins with weights and master weights only.
    let s = scenario("adam-fits");
    let p = s.parameter_count();
    assert!(within(report.at_step1_begin.allocated, p * (2 + 4), 0.001));
    // The jump across the step-1 optimizer phase is the state.
    let jump = allocated_at(&ev, 1, OptimizerEnd) - allocated_at(&ev, 1, OptimizerBegin);
    assert!(within(jump, state, 0.001), "jump {jump} vs state {state}");
    // Grads (set to None) and state are all that remain across step 1.
    let grads = p * 2;
    let step1_end = allocated_at(&ev, 1, StepEnd);
    assert!(within(
        step1_end - report.at_step1_begin.allocated,
        state + grads,
        0.001
    ));
    // No further jump in later optimizer phases, and every later step
    // begins where step 2 began.
    for step in 2..=s.training.steps {
        assert_eq!(
            allocated_at(&ev, step, OptimizerEnd),
            allocated_at(&ev, step, OptimizerBegin),
            "step {step}"
        );
        // Equal up to which cached blocks the allocator happened to reuse
        // (an unsplit remainder under 1 MiB counts as allocated).
        assert!(within(
            allocated_at(&ev, step, StepBegin),
            allocated_at(&ev, 2, StepBegin),
            0.001
        ));
    }
    // The state was created inside the phase: Memory events between the
    // two markers climb past the begin figure.
    let (b, e) = (
        marker(&ev, 1, OptimizerBegin).monotonic_ns,
        marker(&ev, 1, OptimizerEnd).monotonic_ns,
    );
    let inside = common::max_allocated_between(&ev, b, e);
    assert!(inside >= allocated_at(&ev, 1, OptimizerBegin) + state);
}

#[test]
fn lazy_adam_step2_peak_exceeds_step1_peak() {
    for name in ["adam-fits", "adam-step2-oom", "fp32-adam", "thin-margin"] {
        let (_, report, _) = run(name, 0);
        let s1 = report.step(1).unwrap();
        let s2 = report.step(2).unwrap();
        assert!(s1.completed, "{name}");
        assert!(s2.nvml_peak > s1.nvml_peak || !s2.completed, "{name}");
        if s2.completed {
            // The first-step anomaly: roughly the state more.
            assert!(
                s2.allocated_peak >= s1.allocated_peak + state_bytes(name) * 9 / 10,
                "{name}: {} vs {}",
                s2.allocated_peak,
                s1.allocated_peak
            );
        }
    }
    // Megatron-LM#640 saw 17.5 GB then 24.5 GB; ours is of that kind.
    let (_, r, _) = run("adam-fits", 0);
    let ratio = r.step(2).unwrap().allocated_peak as f64 / r.step(1).unwrap().allocated_peak as f64;
    assert!((1.2..1.6).contains(&ratio), "{ratio}");
}

#[test]
fn sgd_without_state_has_no_jump() {
    let (ev, report, _) = run("sgd-no-state", 0);
    for step in 1..=4 {
        assert_eq!(
            allocated_at(&ev, step, OptimizerEnd),
            allocated_at(&ev, step, OptimizerBegin)
        );
    }
    let s1 = report.step(1).unwrap();
    let s2 = report.step(2).unwrap();
    assert_eq!(s1.allocated_peak, s2.allocated_peak);
    assert_eq!(s1.nvml_peak, s2.nvml_peak);
}

#[test]
fn sgd_momentum_creates_half_of_adams_state() {
    let (ev, _, _) = run("sgd-momentum", 0);
    let jump = allocated_at(&ev, 1, OptimizerEnd) - allocated_at(&ev, 1, OptimizerBegin);
    assert!(within(jump, state_bytes("sgd-momentum"), 0.001));
    assert_eq!(
        state_bytes("sgd-momentum") * 2,
        state_bytes("adam-step2-oom")
    );
}

#[test]
fn precreated_state_shows_at_init_not_in_step1() {
    let (ev, report, sim) = run("precreated-state", 0);
    let p = scenario("precreated-state").parameter_count();
    assert_eq!(sim.model_facts().state_precreated, Some(true));
    assert!(within(
        report.at_step1_begin.allocated,
        p * (2 + 4) + state_bytes("precreated-state"),
        0.001
    ));
    assert_eq!(
        allocated_at(&ev, 1, OptimizerEnd),
        allocated_at(&ev, 1, OptimizerBegin)
    );
    let (s1, s2) = (report.step(1).unwrap(), report.step(2).unwrap());
    assert_eq!(s1.allocated_peak, s2.allocated_peak);
    assert_eq!(
        s1.nvml_peak, s2.nvml_peak,
        "step 1 already has the steady shape"
    );
    // The lazy twin of the same job peaks at the same height, one step later.
    let (_, lazy, _) = run("adam-step2-oom", 0);
    assert_eq!(lazy.step(1).unwrap().step, 1);
    assert!(lazy.step(1).unwrap().allocated_peak < s1.allocated_peak);
}

#[test]
fn activations_rise_through_forward_and_fall_through_backward() {
    let (ev, _, _) = run("adam-fits", 0);
    let layers = scenario("adam-fits").model.layers as usize;
    let window = |from: MarkerKind, to: MarkerKind, step| {
        let (a, b) = (
            marker(&ev, step, from).monotonic_ns,
            marker(&ev, step, to).monotonic_ns,
        );
        ev.iter()
            .filter_map(|e| match *e {
                SimEvent::Memory {
                    at_ns, allocated, ..
                } if at_ns > a && at_ns <= b => Some(allocated),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let fwd = window(ForwardBegin, BackwardBegin, 2);
    assert!(fwd.len() >= layers);
    assert!(
        fwd.windows(2).all(|w| w[1] > w[0]),
        "forward climbs layer by layer"
    );
    // Backward: the loss/logits event, one event per layer, then the
    // embedding's grads.
    let bwd = window(BackwardBegin, OptimizerBegin, 2);
    assert_eq!(bwd.len(), layers + 2);
    let per_layer = &bwd[..=layers];
    assert!(
        per_layer.windows(2).all(|w| w[1] < w[0]),
        "backward frees in reverse"
    );
    // Grads appear layer by layer while activations go: each layer frees
    // less than its activations.
    let fwd_rise = fwd[layers - 1] - fwd[0];
    let bwd_fall = per_layer[0] - per_layer[layers];
    assert!(bwd_fall < fwd_rise);
    let grads = scenario("adam-fits").parameter_count() * 2;
    assert!(
        bwd[layers + 1] > per_layer[layers],
        "embedding grads come last"
    );
    assert!(within(
        allocated_at(&ev, 2, OptimizerBegin) - allocated_at(&ev, 2, ForwardBegin),
        grads,
        0.001
    ));
}

#[test]
fn accumulation_runs_four_pairs_and_allocates_grads_once() {
    let (ev, report, _) = run("accumulation-4", 0);
    let ms = common::markers(&ev);
    let fwd: Vec<u32> = ms
        .iter()
        .filter(|m| m.step == 1 && m.kind == ForwardBegin)
        .map(|m| m.micro_batch)
        .collect();
    assert_eq!(fwd, vec![0, 1, 2, 3]);
    let at = |kind, mb| {
        ms.iter()
            .find(|m| m.step == 1 && m.kind == kind && m.micro_batch == mb)
            .unwrap()
            .allocator
            .unwrap()
            .allocated_bytes
    };
    let grads = scenario("accumulation-4").parameter_count() * 2;
    // After micro-batch 0 the grads exist; later micro-batches add nothing.
    assert!(within(
        at(ForwardBegin, 1) - at(ForwardBegin, 0),
        grads,
        0.001
    ));
    assert_eq!(at(ForwardBegin, 2), at(ForwardBegin, 1));
    assert_eq!(at(ForwardBegin, 3), at(ForwardBegin, 1));
    assert!(report.outcome == SimOutcome::Completed { steps: 4 });
    // Same tokens as adam-step2-oom in one micro-batch, a far lower peak.
    let (_, big, _) = run("adam-step2-oom", 0);
    assert!(report.step(1).unwrap().allocated_peak < big.step(1).unwrap().allocated_peak);
}

#[test]
fn grads_zeroed_in_place_stay_allocated() {
    let (kept, rk, _) = run("grads-kept", 0);
    let (none, rn, _) = run("adam-fits", 0);
    let p = scenario("grads-kept").parameter_count();
    let d_kept = allocated_at(&kept, 2, ForwardBegin) - rk.at_step1_begin.allocated;
    let d_none = allocated_at(&none, 2, ForwardBegin) - rn.at_step1_begin.allocated;
    assert!(within(d_kept, state_bytes("grads-kept") + 2 * p, 0.001));
    assert!(within(d_none, state_bytes("adam-fits"), 0.001));
}

#[test]
fn zero_sharding_divides_state_by_ranks() {
    let (ev, _, sim) = run("zero-sharded-8", 3);
    assert_eq!(sim.model_facts().sharding_factor, Some(8));
    let jump = allocated_at(&ev, 1, OptimizerEnd) - allocated_at(&ev, 1, OptimizerBegin);
    let p = scenario("zero-sharded-8").parameter_count();
    assert!(within(jump, p * 8 / 8, 0.001), "{jump}");
}

/// The model facts rank 0 of scenario `name` says in its hello.
fn facts(name: &str) -> ModelFacts {
    RankSim::new(&scenario(name), 0).unwrap().model_facts()
}

#[test]
fn precision_sets_bytes_per_parameter() {
    for (name, precision, state) in [
        ("fp32-adam", Precision::Fp32, 8),
        ("bf16-adam", Precision::Bf16, 4),
        ("adam-fits", Precision::MixedBf16, 8),
    ] {
        let f = facts(name);
        assert_eq!(
            (f.precision, f.state_bytes_per_parameter),
            (precision, Some(state)),
            "{name}"
        );
    }
    let (f32, b16) = (facts("fp32-adam"), facts("bf16-adam"));
    assert_eq!(f32.parameter_count, b16.parameter_count);
    assert_eq!(
        f32.parameter_bytes.unwrap(),
        2 * b16.parameter_bytes.unwrap()
    );
    let (_, r32, _) = run("fp32-adam", 0);
    let (_, r16, _) = run("bf16-adam", 0);
    assert!(r32.step(1).unwrap().allocated_peak > r16.step(1).unwrap().allocated_peak * 3 / 2);
}

#[test]
fn model_facts_describe_the_scenario() {
    let s = scenario("accumulation-4");
    let f = RankSim::new(&s, 0).unwrap().model_facts();
    assert_eq!(f.parameter_count, Some(s.parameter_count()));
    assert_eq!(f.optimizer, OptimizerKind::Adam);
    assert_eq!(f.grad_accumulation_steps, Some(4));
    assert_eq!(f.grads_set_to_none, Some(true));
    assert_eq!(f.state_precreated, Some(false));
    let info = stepwatch_core::RankInfo {
        job: s.name.clone(),
        rank: 0,
        local_rank: 0,
        world_size: 1,
        model: f,
        ..Default::default()
    };
    assert_eq!(
        info.validate(),
        Ok(()),
        "the hello the lead builds is valid"
    );
    let sgd = facts("sgd-no-state");
    assert_eq!(
        (sgd.optimizer, sgd.state_bytes_per_parameter),
        (OptimizerKind::Sgd, Some(0))
    );
}

#[test]
fn oom_marker_ends_the_step_that_ran_out() {
    let (ev, report, sim) = run("adam-step2-oom", 0);
    let SimOutcome::Oom {
        step: 2,
        phase,
        requested_bytes,
    } = report.outcome
    else {
        panic!("{:?}", report.outcome);
    };
    assert!(phase.is_some() && requested_bytes > 0);
    let last = ev.last().unwrap().as_marker().unwrap();
    assert_eq!((last.kind, last.step), (Oom, 2));
    let cap = scenario("adam-step2-oom").gpu.capacity_bytes;
    assert!(report.peak_gpu_used_bytes <= cap);
    assert!(sim.is_finished());
    assert_eq!(sim.nvml_used_bytes(), 0, "the process is gone");
}

#[test]
fn timing_follows_the_scenario_and_start() {
    let s = scenario("demo-small");
    let mut sim = RankSim::new(&s, 0)
        .unwrap()
        .with_start(5_000, 1_700_000_000_000_000_000);
    let ev = sim.run_to_end();
    assert_eq!(ev[0].at_ns(), 5_000);
    let ms = common::markers(&ev);
    let step = |k, n| marker(&ev, n, k).monotonic_ns;
    let t = &s.timing;
    let dur = (t.prologue_ms + t.forward_ms + t.backward_ms + t.optimizer_ms + t.epilogue_ms) * 1e6;
    assert_eq!((step(StepEnd, 3) - step(StepBegin, 3)) as f64, dur);
    assert_eq!(
        (step(BackwardBegin, 3) - step(ForwardBegin, 3)) as f64,
        t.forward_ms * 1e6
    );
    assert_eq!(step(StepBegin, 1) - 5_000, (t.init_ms * 1e6) as u64);
    for m in &ms {
        assert_eq!(
            m.wall_ns - 1_700_000_000_000_000_000,
            m.monotonic_ns - 5_000
        );
    }
}

#[test]
fn peak_modes() {
    let s = scenario("adam-fits");
    let mut sim = RankSim::new(&s, 0).unwrap();
    sim.set_peak_mode(PeakMode::PerPhase);
    let per_phase = sim.run_to_end();
    // Since-start counters, as the Python client sends them, by default.
    let since_start = simulate(&s, 0).unwrap();
    let mut sim = RankSim::new(&s, 0).unwrap();
    sim.set_peak_mode(PeakMode::SinceStart);
    assert_eq!(sim.run_to_end(), since_start);
    // A per-phase peak at BackwardBegin is the forward's peak; since-start
    // peaks never decrease.
    let fwd_peak = marker(&per_phase, 2, BackwardBegin)
        .allocator
        .unwrap()
        .allocated_peak_bytes;
    assert_eq!(fwd_peak, allocated_at(&per_phase, 2, BackwardBegin));
    let prologue_peak = marker(&per_phase, 2, ForwardBegin)
        .allocator
        .unwrap()
        .allocated_peak_bytes;
    assert!(prologue_peak < fwd_peak);
    let peaks: Vec<u64> = common::markers(&since_start)
        .iter()
        .map(|m| m.allocator.unwrap().allocated_peak_bytes)
        .collect();
    assert!(peaks.windows(2).all(|w| w[1] >= w[0]));
}

#[test]
fn timing_a_scenario_leaves_out_takes_the_defaults() {
    let good = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scenarios/demo-small.json"
    ))
    .unwrap();
    let s = Scenario::from_json(&good.replacen("\"init_ms\": 500,", "", 1), "x").unwrap();
    assert_eq!(s.timing.init_ms, 200.0);
    assert_eq!(s.timing.forward_ms, 150.0);
}

#[test]
fn bad_scenarios_get_clear_errors() {
    let good = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scenarios/demo-small.json"
    ))
    .unwrap();
    assert!(Scenario::from_json(&good, "x").is_ok());
    let edit = |from: &str, to: &str| {
        assert!(good.contains(from), "{from}");
        Scenario::from_json(&good.replacen(from, to, 1), "x")
            .unwrap_err()
            .to_string()
    };
    assert!(edit("\"layers\"", "\"layerz\"").contains("unknown field"));
    // The default expectation's keys stand at `expected`'s top level.
    assert!(edit("\"outcome\": \"fits\"", "\"outcom\": \"fits\"").contains("outcome"));
    assert!(
        edit("\"outcome\": \"fits\"", "\"outcome\": \"fits\", \"oom\": 2")
            .contains("unknown field `oom`")
    );
    assert!(edit("\"optimizer\": \"adam\"", "\"optimizer\": \"lion\"").contains("unknown variant"));
    assert!(edit("\"steps\": 30", "\"steps\": 0").contains("training.steps must be at least 1"));
    assert!(edit("\"outcome\": \"fits\"", "\"outcome\": \"oom\"").contains("oom needs oom_step"));
    assert!(edit("\"name\": \"demo-small\"", "\"name\": \"a b\"").contains("name"));
    assert!(matches!(
        RankSim::new(&scenario("demo-small"), 1),
        Err(ScenarioError::NoSuchRank {
            rank: 1,
            count: 1,
            ..
        })
    ));
    assert!(matches!(
        Scenario::load("/nonexistent/x.json"),
        Err(ScenarioError::Io { .. })
    ));
    let mut s = scenario("rank0-skew");
    s.ranks.memory_skew.insert(9, 1.0);
    assert!(s.validate().unwrap_err().to_string().contains("rank 9"));
    let mut s = scenario("rank0-skew");
    s.ranks.memory_skew.insert(1, f64::NAN);
    assert!(s.validate().is_err());
}

#[derive(Default)]
struct Recorder {
    memory: Vec<u64>,
    markers: Vec<Marker>,
}

impl Sink for Recorder {
    fn memory(&mut self, nvml_used_bytes: u64) {
        self.memory.push(nvml_used_bytes);
    }
    fn marker(&mut self, marker: Marker) {
        self.markers.push(marker);
    }
}

#[test]
fn realtime_run_restamps_markers_with_the_real_clock() {
    let s = scenario("demo-small");
    let expected = simulate(&s, 0).unwrap();
    let mut sim = RankSim::new(&s, 0).unwrap();
    let origin = std::time::Instant::now();
    let clock = move || 1_000_000 + origin.elapsed().as_nanos() as u64;
    let mut sink = Recorder::default();
    // The demo runs ~15 s of simulated time; at 200x that is ~75 ms.
    let started = std::time::Instant::now();
    run_realtime(&mut sim, &mut sink, &clock, 200.0);
    let took = started.elapsed().as_secs_f64();
    let sim_span = expected.last().unwrap().at_ns() as f64 / 1e9;
    assert!(
        took >= sim_span / 200.0 * 0.9,
        "paced: {took} s for {sim_span} s"
    );
    let want: Vec<(MarkerKind, u64, u32)> = common::markers(&expected)
        .iter()
        .map(|m| (m.kind, m.step, m.micro_batch))
        .collect();
    let got: Vec<(MarkerKind, u64, u32)> = sink
        .markers
        .iter()
        .map(|m| (m.kind, m.step, m.micro_batch))
        .collect();
    assert_eq!(got, want);
    let mem: Vec<u64> = expected
        .iter()
        .filter_map(|e| match e {
            SimEvent::Memory {
                nvml_used_bytes, ..
            } => Some(*nvml_used_bytes),
            _ => None,
        })
        .collect();
    assert_eq!(sink.memory, mem);
    assert!(sink.markers.iter().all(|m| m.monotonic_ns >= 1_000_000));
    assert!(sink
        .markers
        .windows(2)
        .all(|w| w[1].monotonic_ns >= w[0].monotonic_ns));
    // Marker times follow the scenario's pace, scaled.
    let span = sink.markers.last().unwrap().monotonic_ns - sink.markers[0].monotonic_ns;
    let sim_markers = common::markers(&expected);
    let sim_span = sim_markers.last().unwrap().monotonic_ns - sim_markers[0].monotonic_ns;
    assert!(span as f64 >= sim_span as f64 / 200.0 * 0.9);
    assert!(
        sink.markers[0].wall_ns > 1_600_000_000_000_000_000,
        "wall clock is real"
    );
    // Allocator figures pass through unchanged.
    assert_eq!(sink.markers[5].allocator, sim_markers[5].allocator);
}

#[test]
fn realtime_without_pacing_does_not_sleep() {
    let mut sim = RankSim::new(&scenario("adam-step2-oom"), 0).unwrap();
    let ticks = std::cell::Cell::new(0u64);
    let clock = || {
        ticks.set(ticks.get() + 1);
        ticks.get()
    };
    let mut sink = Recorder::default();
    let started = std::time::Instant::now();
    run_realtime(&mut sim, &mut sink, &clock, 0.0);
    assert!(started.elapsed().as_secs() < 5);
    assert_eq!(sink.markers.last().unwrap().kind, Oom);
    assert!(sink
        .markers
        .windows(2)
        .all(|w| w[1].monotonic_ns > w[0].monotonic_ns));
}

/// Holds the rank before step 2's first marker by moving its clock on
/// `hold_ns`, as a real wait would.
struct HoldBeforeStep2<'a> {
    recorder: Recorder,
    held_ns: &'a std::cell::Cell<u64>,
    hold_ns: u64,
}

impl Sink for HoldBeforeStep2<'_> {
    fn memory(&mut self, nvml_used_bytes: u64) {
        self.recorder.memory(nvml_used_bytes);
    }
    fn marker(&mut self, marker: Marker) {
        self.recorder.marker(marker);
    }
    fn before_marker(&mut self, marker: &Marker) {
        if marker.kind == StepBegin && marker.step == 2 {
            self.held_ns.set(self.held_ns.get() + self.hold_ns);
        }
    }
}

#[test]
fn a_hold_before_a_marker_delays_the_rest_of_the_run_without_squashing_it() {
    let s = scenario("demo-small");
    let expected = common::markers(&simulate(&s, 0).unwrap());
    let mut sim = RankSim::new(&s, 0).unwrap();
    let held_ns = std::cell::Cell::new(0);
    let origin = std::time::Instant::now();
    let clock = || 1_000_000 + origin.elapsed().as_nanos() as u64 + held_ns.get();
    let hold_ns = 10_000_000_000;
    let mut sink = HoldBeforeStep2 {
        recorder: Recorder::default(),
        held_ns: &held_ns,
        hold_ns,
    };
    run_realtime(&mut sim, &mut sink, &clock, 200.0);
    let got = &sink.recorder.markers;
    let step2 = got
        .iter()
        .position(|m| m.kind == StepBegin && m.step == 2)
        .unwrap();
    assert!(got[step2].monotonic_ns - got[step2 - 1].monotonic_ns >= hold_ns);
    // After the hold the run keeps the scenario's pace (scaled), rather than
    // catching up on the time held.
    let span = got.last().unwrap().monotonic_ns - got[step2].monotonic_ns;
    let sim_span = expected.last().unwrap().monotonic_ns - expected[step2].monotonic_ns;
    assert!(
        span as f64 >= sim_span as f64 / 200.0 * 0.9,
        "{span} ns after the hold for {sim_span} simulated ns"
    );
}
