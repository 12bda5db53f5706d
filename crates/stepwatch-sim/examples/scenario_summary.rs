//! Prints each built-in scenario's simulated peaks and outcome per rank.
//! `cargo run -p stepwatch-sim --example scenario_summary`

use stepwatch_sim::{builtin_scenarios, simulate_shared, RankSim};

fn gb(b: u64) -> String {
    format!("{:.2}", b as f64 / 1e9)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let all = builtin_scenarios()?;
    for s in &all {
        let reports = if let Some(other) = &s.colocated_with {
            let o = all.iter().find(|x| &x.name == other).ok_or("no partner")?;
            let mut sims = vec![RankSim::new(s, 0)?, RankSim::new(o, 0)?];
            simulate_shared(&mut sims);
            vec![sims[0].report().clone()]
        } else {
            let mut v = Vec::new();
            for r in 0..s.ranks.count {
                let mut sim = RankSim::new(s, r)?;
                sim.run_to_end();
                v.push(sim.report().clone());
            }
            v
        };
        for r in reports {
            let steps: Vec<String> = r
                .steps
                .iter()
                .map(|st| {
                    format!(
                        "s{} a{} n{}",
                        st.step,
                        gb(st.allocated_peak),
                        gb(st.nvml_peak)
                    )
                })
                .collect();
            println!(
                "{:<18} r{} cap {} init {} peak_gpu {} headroom {:.4} {:?} | {}",
                s.name,
                r.rank,
                gb(r.capacity_bytes),
                gb(r.at_step1_begin.allocated),
                gb(r.peak_gpu_used_bytes),
                r.headroom_fraction(),
                r.outcome,
                steps.join(", ")
            );
        }
    }
    Ok(())
}
