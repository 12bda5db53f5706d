//! Replays allocator histories recorded on real GPUs (extracted from
//! `torch.cuda.memory._dump_snapshot` pickles by `bench/alloc_snapshots.py`)
//! through the allocator model under each rule for equal free blocks
//! ([`FreeBlockOrder`]) and prints, as a Markdown table, how well each
//! matches the real allocator ([`History::check`]). `bench/alloc-snapshots.sh`
//! runs it.
//!
//!     snapshot_check EXTRACT.json...

use std::path::PathBuf;

use serde::Deserialize;
use stepwatch_core::allocator::{AllocatorSettings, FreeBlockOrder, History, HistoryCheck};

#[derive(Deserialize)]
struct Extract {
    name: String,
    /// The PyTorch versions the snapshot's format allows.
    versions: String,
    #[serde(flatten)]
    history: History,
}

const RULES: [(&str, FreeBlockOrder); 2] = [
    ("address", FreeBlockOrder::Address),
    ("segment age", FreeBlockOrder::SegmentAge),
];

fn main() {
    let paths: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    if paths.is_empty() {
        eprintln!("usage: snapshot_check EXTRACT.json...");
        std::process::exit(2);
    }
    let mut totals = [(0u64, 0u64, 0u64); 2];
    let (mut checked_files, mut unreadable) = (0usize, 0usize);
    println!(
        "| snapshot | format | allocations | placed right, address rule | placed right, segment-age rule | reserved peak / end (recorded) | reserved exact, address rule | reserved exact, segment-age rule |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for path in &paths {
        let x: Extract = match std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        {
            Ok(x) => x,
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                unreadable += 1;
                continue;
            }
        };
        let checks: Result<Vec<HistoryCheck>, _> = RULES
            .iter()
            .map(|&(_, order)| {
                x.history.check(AllocatorSettings {
                    free_block_order: order,
                    ..AllocatorSettings::default()
                })
            })
            .collect();
        let checks = match checks {
            Ok(c) => c,
            Err(e) => {
                // Events lost from a full ring buffer: not checkable.
                println!(
                    "| `{}` | {} | skipped: the history is incomplete ({e}) | | | | | |",
                    x.name, x.versions
                );
                continue;
            }
        };
        checked_files += 1;
        for (t, c) in totals.iter_mut().zip(&checks) {
            t.0 += c.allocations;
            t.1 += c.placed_right;
            t.2 += u64::from(c.reserved_exact());
        }
        let c = checks[0];
        println!(
            "| `{}` | {} | {} | {} | {} | {} / {} MiB | {} | {} |",
            x.name,
            x.versions,
            c.allocations,
            placed(&checks[0]),
            placed(&checks[1]),
            c.real_peak >> 20,
            c.real_end >> 20,
            yes(checks[0].reserved_exact()),
            yes(checks[1].reserved_exact()),
        );
    }
    println!();
    for ((name, _), (n, right, exact)) in RULES.iter().zip(totals) {
        println!(
            "{name} rule: {right} of {n} allocations placed right ({:.1}%); reserved peak and end exact on {exact} of {checked_files} histories",
            pct(right, n),
        );
    }
    if unreadable > 0 {
        std::process::exit(1);
    }
}

fn placed(c: &HistoryCheck) -> String {
    format!(
        "{} ({:.1}%)",
        c.placed_right,
        pct(c.placed_right, c.allocations)
    )
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        100.0
    } else {
        100.0 * a as f64 / b as f64
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}
