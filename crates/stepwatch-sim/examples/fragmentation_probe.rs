//! Does a `torch.cuda.memory_stats()` figure at step 1's optimizer boundaries
//! explain step 2's extra reservation (allocator fragmentation)?
//!
//! For every rank the accuracy benchmark evaluates, prints what the markers-only
//! prediction (no allocator trace) lacked before its layout allowance (`shortfall` = actual −
//! predicted + allowance, device bytes) next to the candidates, computed in
//! the allocator model exactly as PyTorch defines them: `inactive_split_bytes`
//! / `inactive_split` (free blocks of split segments; large pool ≈ all here,
//! the small pool holds about 1 MB), `segment` and the state created from the
//! cache. A figure that explained the shortfall would keep a steady ratio to
//! it across scenarios.
//!
//! ```text
//! cargo run --release -p stepwatch-sim --example fragmentation_probe
//! ```

use stepwatch_core::MarkerKind;
use stepwatch_sim::accuracy::{evaluate_with, ranks_to_evaluate};
use stepwatch_sim::{builtin_scenarios, RankSim, SimEvent};

#[derive(Debug, Default, Clone, Copy)]
struct Boundary {
    allocated: u64,
    inactive_split_bytes: u64,
    inactive_split: u64,
    segments: u64,
}

fn gb(b: i128) -> f64 {
    b as f64 / 1e9
}

fn ratio(a: i128, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.2}", a as f64 / b as f64)
    }
}

fn main() {
    let all = builtin_scenarios().expect("built-in scenarios parse");
    println!(
        "| scenario | rank | error | shortfall GB | state from cache GB | inactive_split_bytes GB \
         opt begin → end | inactive_split end | segments Δ | shortfall / from cache | \
         shortfall / inactive_split_bytes end |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for s in &all {
        for rank in ranks_to_evaluate(s) {
            let row = evaluate_with(s, rank, &all, false).expect("built-in scenario simulates");
            let (Some(prediction), Some(actual)) = (&row.prediction, row.actual.peak_bytes) else {
                continue;
            };
            let pred = prediction.predicted_peak_bytes;
            let allowance = i128::from(prediction.inputs.layout.layout_allowance_bytes);
            let from_cache = i128::from(prediction.inputs.reserved.state_from_cache_bytes);
            let shortfall = i128::from(actual) - i128::from(pred) + allowance;

            // The same rank alone on twice the memory, so that it runs to the end.
            let mut sc = s.clone();
            sc.gpu.capacity_bytes = sc.gpu.capacity_bytes.saturating_mul(2);
            let mut sim = RankSim::new(&sc, rank).expect("valid rank");
            let (mut begin, mut end) = (Boundary::default(), Boundary::default());
            while let Some(e) = sim.next_event() {
                let SimEvent::Marker(m) = e else { continue };
                if m.step != 1 {
                    continue;
                }
                let a = sim.allocator();
                let (bytes, blocks) = a.inactive_split(None);
                let b = Boundary {
                    allocated: a.allocated(),
                    inactive_split_bytes: bytes,
                    inactive_split: blocks,
                    segments: a.segments_in(None),
                };
                match m.kind {
                    MarkerKind::OptimizerBegin => begin = b,
                    MarkerKind::OptimizerEnd => end = b,
                    _ => {}
                }
            }
            debug_assert!(end.allocated >= begin.allocated);
            println!(
                "| {} | {rank} | {:+.2}% | {:.3} | {:.3} | {:.3} → {:.3} | {} | {:+} | {} | {} |",
                s.name,
                row.error_pct.unwrap_or(f64::NAN),
                gb(shortfall),
                gb(from_cache),
                gb(i128::from(begin.inactive_split_bytes)),
                gb(i128::from(end.inactive_split_bytes)),
                end.inactive_split,
                i128::from(end.segments) - i128::from(begin.segments),
                ratio(shortfall, u64::try_from(from_cache).unwrap_or(0)),
                ratio(shortfall, end.inactive_split_bytes),
            );
        }
    }
}
