//! Every shipped scenario: parses, behaves as it declares, emits valid markers.

mod common;

use std::collections::BTreeSet;

use stepwatch_core::{MarkerKind, RankTimeline};
use stepwatch_sim::scenario::BUILTIN;
use stepwatch_sim::{
    builtin_scenarios, simulate, simulate_shared, OutcomeKind, RankReport, RankSim, Scenario,
    SimEvent, SimOutcome,
};

fn all() -> Vec<Scenario> {
    builtin_scenarios().expect("built-in scenarios parse")
}

/// Runs every rank of every scenario (co-located ones together) and
/// returns (scenario, rank, events, report).
fn run_all() -> Vec<(Scenario, u32, Vec<SimEvent>, RankReport)> {
    let scenarios = all();
    let mut out = Vec::new();
    for s in &scenarios {
        if let Some(partner) = &s.colocated_with {
            let p = scenarios
                .iter()
                .find(|x| &x.name == partner)
                .unwrap_or_else(|| panic!("{}: partner {partner} missing", s.name));
            assert_eq!(
                p.colocated_with.as_deref(),
                Some(s.name.as_str()),
                "{}: co-location must be mutual",
                s.name
            );
            assert_eq!(p.gpu.capacity_bytes, s.gpu.capacity_bytes);
            let mut sims = vec![RankSim::new(s, 0).unwrap(), RankSim::new(p, 0).unwrap()];
            let mut events = simulate_shared(&mut sims);
            out.push((
                s.clone(),
                0,
                events.swap_remove(0),
                sims[0].report().clone(),
            ));
            continue;
        }
        for rank in 0..s.ranks.count {
            let mut sim = RankSim::new(s, rank).unwrap();
            let events = sim.run_to_end();
            out.push((s.clone(), rank, events, sim.report().clone()));
        }
    }
    out
}

#[test]
fn shipped_files_and_builtin_list_agree() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios");
    let on_disk: BTreeSet<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    let builtin: BTreeSet<String> = BUILTIN.iter().map(|(f, _)| f.to_string()).collect();
    assert_eq!(on_disk, builtin);
    let loaded = Scenario::load_dir(dir).unwrap();
    assert_eq!(loaded.len(), on_disk.len());
    assert!(loaded.len() >= 12);
    let names: BTreeSet<&str> = loaded.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), loaded.len(), "names are unique");
    for (file, _) in BUILTIN {
        let s = Scenario::load(format!("{dir}/{file}")).unwrap();
        assert_eq!(
            format!("{}.json", s.name),
            *file,
            "file is named after the scenario"
        );
        assert!(!s.description.is_empty(), "{file} says what it models");
    }
}

#[test]
fn every_scenario_has_its_declared_outcome() {
    for (s, rank, _, report) in run_all() {
        let want = s.expected.for_rank(rank);
        let ctx = format!(
            "{} rank {rank}: {:?}, headroom {:.4}",
            s.name,
            report.outcome,
            report.headroom_fraction()
        );
        match want.outcome {
            OutcomeKind::Fits => {
                assert_eq!(
                    report.outcome,
                    SimOutcome::Completed {
                        steps: s.training.steps
                    },
                    "{ctx}"
                );
                let h = report.headroom_fraction();
                assert!(h > 0.0, "{ctx}");
                if let Some(min) = want.headroom_min {
                    assert!(h >= min, "{ctx}: below {min}");
                }
                if let Some(max) = want.headroom_max {
                    assert!(h <= max, "{ctx}: above {max}");
                }
            }
            OutcomeKind::Oom => {
                let SimOutcome::Oom { step, .. } = report.outcome else {
                    panic!("{ctx}: expected an OOM");
                };
                assert_eq!(Some(step), want.oom_step, "{ctx}");
                // Everything before the OOM step completed.
                let done: Vec<u64> = report
                    .steps
                    .iter()
                    .filter(|st| st.completed)
                    .map(|st| st.step)
                    .collect();
                assert_eq!(done, (1..step).collect::<Vec<_>>(), "{ctx}");
                assert!(report.peak_gpu_used_bytes <= s.gpu.capacity_bytes, "{ctx}");
            }
        }
    }
}

#[test]
fn required_situations_are_covered() {
    let s = all();
    let has = |f: &dyn Fn(&Scenario) -> bool| s.iter().any(f);
    use stepwatch_sim::{SimOptimizer::*, SimPrecision::*};
    let oom2 = |x: &Scenario| x.expected.default.oom_step == Some(2);
    assert!(has(&|x| x.training.optimizer == Adam && oom2(x)));
    assert!(has(
        &|x| x.training.optimizer == Sgd && x.expected.default.outcome == OutcomeKind::Fits
    ));
    assert!(has(&|x| x.training.state_precreated));
    assert!(has(&|x| x.training.grad_accumulation_steps == 4));
    assert!(has(
        &|x| x.training.sharding_factor == 8 && x.ranks.count == 8
    ));
    assert!(has(&|x| x.ranks.memory_skew.get(&0) == Some(&1.15)));
    assert!(has(&|x| x.training.precision == Fp32));
    assert!(has(&|x| x.training.precision == Bf16));
    assert!(has(&|x| x.colocated_with.is_some()));
    assert!(has(&|x| x
        .expected
        .default
        .headroom_min
        .is_some_and(|h| h <= 0.10)
        && x.expected.default.headroom_max.is_some_and(|h| h >= 0.10)));
}

#[test]
fn markers_are_in_valid_order_with_monotonic_times() {
    for (s, rank, events, report) in run_all() {
        let ctx = format!("{} rank {rank}", s.name);
        // Times never go back, markers or memory.
        for w in events.windows(2) {
            assert!(w[0].at_ns() <= w[1].at_ns(), "{ctx}: time went back");
        }
        let ms = common::markers(&events);
        // The core's own validator accepts the whole run as one batch.
        let mut tl = RankTimeline::new(1000);
        tl.apply_batch(&ms)
            .unwrap_or_else(|e| panic!("{ctx}: core rejected markers: {e}"));
        // And the exact shape: per step StepBegin, (Forward, Backward) per
        // micro-batch, OptimizerBegin, OptimizerEnd, StepEnd; or an Oom last.
        let a = s.training.grad_accumulation_steps;
        let mut expected = Vec::new();
        for step in 1..=s.training.steps {
            expected.push((MarkerKind::StepBegin, step, 0));
            for mb in 0..a {
                expected.push((MarkerKind::ForwardBegin, step, mb));
                expected.push((MarkerKind::BackwardBegin, step, mb));
            }
            expected.push((MarkerKind::OptimizerBegin, step, 0));
            expected.push((MarkerKind::OptimizerEnd, step, 0));
            expected.push((MarkerKind::StepEnd, step, 0));
        }
        let got: Vec<_> = ms.iter().map(|m| (m.kind, m.step, m.micro_batch)).collect();
        match report.outcome {
            SimOutcome::Completed { .. } => assert_eq!(got, expected, "{ctx}"),
            SimOutcome::Oom { step, .. } => {
                let (last, before) = got.split_last().unwrap();
                assert_eq!(last.0, MarkerKind::Oom, "{ctx}");
                assert_eq!(last.1, step, "{ctx}");
                assert_eq!(before, &expected[..before.len()], "{ctx}");
                assert_eq!(tl.ooms(), 1);
                assert!(
                    matches!(events.last(), Some(SimEvent::Marker(_))),
                    "{ctx}: Oom ends the run"
                );
            }
            SimOutcome::Running => panic!("{ctx}: still running"),
        }
        // Every marker carries consistent allocator figures.
        for m in &ms {
            let a = m.allocator.expect("allocator stats");
            assert!(a.reserved_bytes >= a.allocated_bytes, "{ctx}");
            assert!(a.allocated_peak_bytes >= a.allocated_bytes, "{ctx}");
            assert!(a.reserved_peak_bytes >= a.reserved_bytes, "{ctx}");
            assert_eq!(a.active_bytes, a.allocated_bytes);
        }
    }
}

#[test]
fn reserved_never_shrinks_and_covers_allocated() {
    for (s, rank, events, report) in run_all() {
        let ctx = format!("{} rank {rank}", s.name);
        let mem: Vec<(u64, u64, u64)> = events
            .iter()
            .filter_map(|e| match *e {
                SimEvent::Memory {
                    nvml_used_bytes,
                    allocated,
                    reserved,
                    ..
                } => Some((nvml_used_bytes, allocated, reserved)),
                _ => None,
            })
            .collect();
        assert!(mem.len() > 10, "{ctx}");
        let overhead = s.gpu.cuda_context_bytes + s.gpu.workspace_bytes;
        assert_eq!(
            mem[0],
            (overhead, 0, 0),
            "{ctx}: starts with the CUDA context alone"
        );
        for &(nvml, alloc, res) in &mem {
            assert!(res >= alloc, "{ctx}");
            assert_eq!(nvml, res + overhead, "{ctx}");
        }
        // Only an OOM retry releases cached segments, and a rank that
        // completes needed one only where the scenario is about that.
        let shrinks = mem.windows(2).filter(|w| w[1].2 < w[0].2).count() as u64;
        assert!(
            shrinks <= report.num_alloc_retries,
            "{ctx}: reserved shrank"
        );
        let completed = matches!(report.outcome, SimOutcome::Completed { .. });
        if completed && s.name != "zero-sharded-retry" {
            assert_eq!(report.num_alloc_retries, 0, "{ctx}");
            assert_eq!(shrinks, 0, "{ctx}");
        }
        if s.name == "zero-sharded-retry" {
            assert!(completed && report.num_alloc_retries > 0, "{ctx}");
        }
        let checked = match report.outcome {
            SimOutcome::Oom { .. } => &mem[..mem.len() - 1],
            _ => &mem[..],
        };
        // Reserved sits plausibly above allocated at its peak: the cache
        // holds something, but not absurdly much.
        let peak_alloc = checked.iter().map(|m| m.1).max().unwrap();
        let peak_res = checked.iter().map(|m| m.2).max().unwrap();
        let ratio = peak_res as f64 / peak_alloc.max(1) as f64;
        assert!(
            (1.0..1.5).contains(&ratio),
            "{ctx}: reserved/allocated {ratio}"
        );
    }
}

#[test]
fn simulation_is_deterministic() {
    for s in all() {
        assert_eq!(
            simulate(&s, 0).unwrap(),
            simulate(&s, 0).unwrap(),
            "{}",
            s.name
        );
    }
}

#[test]
fn thin_margin_fits_step1_within_one_percent() {
    let (_, report, _) = common::run("thin-margin", 0);
    let cap = report.capacity_bytes as f64;
    let s1 = report.step(1).unwrap();
    assert!(s1.completed);
    let spare = 1.0 - s1.nvml_peak as f64 / cap;
    assert!(spare > 0.0 && spare < 0.01, "step 1 spare {spare}");
    assert!(matches!(report.outcome, SimOutcome::Oom { step: 2, .. }));
}

#[test]
fn colocated_job_fits_alone_but_not_beside_its_neighbour() {
    let (_, alone, _) = common::run("colocated-b", 0);
    assert!(matches!(alone.outcome, SimOutcome::Completed { .. }));
    let (_, alone_a, _) = common::run("colocated-a", 0);
    assert!(matches!(alone_a.outcome, SimOutcome::Completed { .. }));
    let mut sims = vec![
        RankSim::new(&common::scenario("colocated-a"), 0).unwrap(),
        RankSim::new(&common::scenario("colocated-b"), 0).unwrap(),
    ];
    let events = simulate_shared(&mut sims);
    assert!(matches!(
        sims[0].report().outcome,
        SimOutcome::Completed { .. }
    ));
    assert!(matches!(
        sims[1].report().outcome,
        SimOutcome::Oom { step: 2, .. }
    ));
    // B starts at its offset, after A.
    assert_eq!(events[1][0].at_ns(), 1_000_000_000);
    assert_eq!(events[0][0].at_ns(), 0);
    // While both ran, their sum never passed the capacity.
    assert!(sims[1].report().peak_gpu_used_bytes <= sims[1].report().capacity_bytes);
}

#[test]
fn rank_skew_raises_rank0_memory_and_time() {
    let (e0, r0, _) = common::run("rank0-skew", 0);
    let (e1, r1, _) = common::run("rank0-skew", 1);
    let s0 = r0.step(1).unwrap().allocated_peak;
    let s1 = r1.step(1).unwrap().allocated_peak;
    assert!(s0 > s1, "rank 0 holds more");
    let d = |e: &[SimEvent]| {
        common::marker(e, 1, MarkerKind::StepEnd).monotonic_ns
            - common::marker(e, 1, MarkerKind::StepBegin).monotonic_ns
    };
    let ratio = d(&e0) as f64 / d(&e1) as f64;
    assert!((ratio - 1.1).abs() < 1e-6, "time skew {ratio}");
}
