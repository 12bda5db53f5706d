//! Prints the accuracy of the step-2 prediction over every built-in scenario
//! as a markdown table. `cargo run -p stepwatch-sim --example accuracy`
//! (`-- --explain` adds each prediction's explanation).

use stepwatch_sim::accuracy::{evaluate_all, render_table};

fn main() {
    let rows = evaluate_all();
    print!("{}", render_table(&rows));
    if std::env::args().any(|a| a == "--explain") {
        println!();
        for r in &rows {
            println!(
                "- {}/{}: {}",
                r.scenario,
                r.rank,
                r.explanation.as_deref().unwrap_or("no prediction")
            );
        }
    }
}
