//! Simulated PyTorch training jobs for stepwatch's tests, demo and the
//! accuracy benchmark of the OOM predictor.
//!
//! A [`Scenario`] (a JSON file under `scenarios/`) describes a job: model
//! shape, precision, optimizer, accumulation, sharding, ranks, GPU and
//! timings, and the outcome it is expected to have. A [`RankSim`] turns one
//! rank of it into a deterministic stream of [`SimEvent`]s (markers with
//! allocator figures, and NVML-visible memory after each modelled event) on
//! a simulated clock. [`simulate`] collects them at once; [`run_realtime`]
//! plays them into a [`Sink`] at the scenario's pace.
//!
//! See `README.md` for the memory model and its sources.

#![warn(missing_docs)]

pub mod accuracy;
/// The caching-allocator model, shared with the predictor's replay.
pub use stepwatch_core::allocator;
pub mod rank;
pub mod realtime;
pub mod scenario;

pub use allocator::CachingAllocator;
pub use rank::{PeakMode, RankReport, RankSim, SimEvent, SimOutcome, StepStats};
pub use realtime::{run_realtime, Sink};
pub use scenario::{
    builtin_scenario, builtin_scenarios, Expectation, Expected, Gpu, ModelShape, OutcomeKind,
    Ranks, Scenario, ScenarioError, SimOptimizer, SimPrecision, Timing, Training,
};

/// Every event of one rank of `scenario`, simulated instantly from time 0.
pub fn simulate(scenario: &Scenario, rank: u32) -> Result<Vec<SimEvent>, ScenarioError> {
    Ok(RankSim::new(scenario, rank)?.run_to_end())
}

/// Runs several ranks on one GPU: each sees the others' NVML-visible memory
/// (plus its own scenario's `other_process_bytes`) as other processes. The
/// rank whose clock is furthest behind moves next, so events interleave in
/// time order. A rank that has ended holds no memory. Returns each rank's
/// events; read outcomes from [`RankSim::report`].
pub fn simulate_shared(sims: &mut [RankSim]) -> Vec<Vec<SimEvent>> {
    let base: Vec<u64> = sims
        .iter()
        .map(|s| s.scenario().gpu.other_process_bytes)
        .collect();
    let mut events = vec![Vec::new(); sims.len()];
    loop {
        let next = sims
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_finished())
            .min_by_key(|(i, s)| (s.now_ns(), *i))
            .map(|(i, _)| i);
        let Some(i) = next else { break };
        let others: u64 = sims
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, s)| s.nvml_used_bytes())
            .sum();
        sims[i].set_other_process_bytes(base[i] + others);
        match sims[i].next_event() {
            Some(e) => events[i].push(e),
            None => continue,
        }
    }
    events
}
