//! Prints the accuracy of the step-2 prediction over every built-in scenario
//! as a markdown table. `cargo run -p stepwatch-sim --example accuracy`
//! (`-- --explain` adds each prediction's explanation; `--markers-only`
//! leaves out the step-1 allocator trace, as for a client that cannot
//! record it).

use stepwatch_sim::accuracy::{evaluate_all_with, render_table};

fn main() {
    let markers_only = std::env::args().any(|a| a == "--markers-only");
    let rows = evaluate_all_with(!markers_only);
    print!("{}", render_table(&rows));
    if std::env::args().any(|a| a == "--explain") {
        println!();
        for r in &rows {
            println!(
                "- {}/{}: {}",
                r.scenario,
                r.rank,
                r.prediction
                    .as_ref()
                    .map_or("no prediction", |p| &p.explanation)
            );
        }
    }
}
