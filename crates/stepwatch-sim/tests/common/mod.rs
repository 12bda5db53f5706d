#![allow(dead_code)]

use stepwatch_core::{Marker, MarkerKind};
use stepwatch_sim::{builtin_scenario, RankReport, RankSim, Scenario, SimEvent};

pub fn scenario(name: &str) -> Scenario {
    builtin_scenario(name).unwrap_or_else(|| panic!("no built-in scenario {name}"))
}

pub fn run(name: &str, rank: u32) -> (Vec<SimEvent>, RankReport, RankSim) {
    let mut sim = RankSim::new(&scenario(name), rank).expect("valid scenario");
    let events = sim.run_to_end();
    (events, sim.report().clone(), sim)
}

pub fn markers(events: &[SimEvent]) -> Vec<Marker> {
    events
        .iter()
        .filter_map(|e| e.as_marker().cloned())
        .collect()
}

/// The first marker of `kind` in `step`.
pub fn marker(events: &[SimEvent], step: u64, kind: MarkerKind) -> Marker {
    markers(events)
        .into_iter()
        .find(|m| m.step == step && m.kind == kind)
        .unwrap_or_else(|| panic!("no {kind:?} in step {step}"))
}

pub fn allocated_at(events: &[SimEvent], step: u64, kind: MarkerKind) -> u64 {
    marker(events, step, kind)
        .allocator
        .unwrap()
        .allocated_bytes
}

/// Highest allocated figure among Memory events between two times.
pub fn max_allocated_between(events: &[SimEvent], from: u64, to: u64) -> u64 {
    events
        .iter()
        .filter_map(|e| match e {
            SimEvent::Memory {
                at_ns, allocated, ..
            } if *at_ns > from && *at_ns <= to => Some(*allocated),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}
