//! `stepwatch replay-record`: replays an agent's `--record` file through the
//! step model and prints, per rank, the prediction frozen before step 2
//! against the steady-state peak measured after it.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;
use stepwatch_core::{RankKey, RecordEntry, Replayer, TrackerConfig};

#[derive(Debug, Clone, clap::Args)]
pub struct ReplayRecordArgs {
    /// A record written by `stepwatch agent --record`.
    pub file: PathBuf,
    /// Print the checks as JSON (one object per rank) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also print how each rank's prediction changed during step 1: after
    /// every marker batch or allocator trace that changed it, the record
    /// line, the open phase, the basis, the predicted peak, the headroom and
    /// the prediction's explanation; last, the prediction frozen when step 2
    /// began.
    #[arg(long)]
    pub timeline: bool,
}

/// Reads and applies a record; errors name the line. `after_rank_entry` is
/// called with the line number and rank after each marker batch or trace.
pub fn replay_file(
    path: &std::path::Path,
    mut after_rank_entry: impl FnMut(usize, &RankKey, &Replayer),
) -> anyhow::Result<Replayer> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open the record {}", path.display()))?;
    let mut replayer = Replayer::new(TrackerConfig::default());
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("cannot read {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let entry: RecordEntry = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a record entry", path.display(), i + 1))?;
        let key = match &entry {
            RecordEntry::Markers { .. } | RecordEntry::AllocatorTrace { .. } => {
                entry.key().cloned()
            }
            _ => None,
        };
        replayer
            .apply(entry)
            .with_context(|| format!("{}:{}", path.display(), i + 1))?;
        if let Some(key) = key {
            after_rank_entry(i + 1, &key, &replayer);
        }
    }
    Ok(replayer)
}

/// Prints a rank's prediction when it differs from the last one printed.
fn print_change(
    line: usize,
    key: &RankKey,
    replayer: &Replayer,
    last: &mut HashMap<RankKey, (u64, bool, bool)>,
) {
    let tracker = replayer.tracker();
    let Some(rank) = tracker.rank(key) else {
        return;
    };
    // Once step 2 began, the prediction frozen then, printed once: a batch
    // often holds step 1's last markers and step 2's first, so the figure
    // that ended step 1 was never printed as a live one.
    let frozen = rank.prediction_before_step2.is_some();
    let live;
    let p = match &rank.prediction_before_step2 {
        Some(p) => p,
        None => match tracker.rank_analysis(key).and_then(|a| a.prediction) {
            Some(p) => {
                live = p;
                &live
            }
            None => return,
        },
    };
    let now = (p.predicted_peak_bytes, p.provisional, frozen);
    if last.get(key) == Some(&now) {
        return;
    }
    last.insert(key.clone(), now);
    println!(
        "line {line}: {} rank {}: open phase {}, basis {}, predicted peak {:.3} GB, headroom {}{}",
        key.job,
        key.rank,
        p.inputs
            .open_phase
            .map_or("none".to_string(), |ph| snake(&ph)),
        snake(&p.inputs.basis),
        p.predicted_peak_bytes as f64 / 1e9,
        p.headroom_bytes.map_or("unknown".to_string(), |h| format!(
            "{:.3} GB",
            h as f64 / 1e9
        )),
        if frozen {
            " (frozen before step 2)"
        } else if p.provisional {
            " (provisional)"
        } else {
            ""
        },
    );
    println!("    {}", p.explanation);
}

/// The serde (snake_case) name of an enum value.
fn snake(value: &impl serde::Serialize) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

pub fn run(args: ReplayRecordArgs) -> anyhow::Result<()> {
    let mut last = HashMap::new();
    let replayer = replay_file(&args.file, |line, key, replayer| {
        if args.timeline {
            print_change(line, key, replayer, &mut last);
        }
    })?;
    if args.timeline {
        println!();
    }
    let checks = replayer.prediction_checks();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
        return Ok(());
    }
    let gb = |b: Option<u64>| b.map_or("-".to_string(), |b| format!("{:.3}", b as f64 / 1e9));
    println!(
        "| job | rank | basis | predicted peak GB (before step 2) | steady peak GB (steps) | error | capacity GB | advisories |"
    );
    println!("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |");
    for c in &checks {
        println!(
            "| {} | {} | {} | {} | {} ({}) | {} | {:.1} | {} |",
            c.key.job,
            c.key.rank,
            c.basis.map_or("-".to_string(), |b| snake(&b)),
            gb(c.predicted_peak_bytes),
            gb(c.steady_peak_bytes),
            c.steady_steps,
            c.error_ratio
                .map_or("-".to_string(), |e| format!("{:+.2}%", e * 100.0)),
            c.capacity_bytes as f64 / 1e9,
            if c.advisories.is_empty() {
                "none".to_string()
            } else {
                c.advisories
                    .iter()
                    .map(snake)
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        );
    }
    Ok(())
}
