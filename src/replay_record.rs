//! `stepwatch replay-record`: replays an agent's `--record` file through the
//! step model and prints, per rank, the prediction frozen before step 2
//! against the steady-state peak measured after it.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;
use stepwatch_core::{RecordEntry, Replayer, TrackerConfig};

#[derive(Debug, Clone, clap::Args)]
pub struct ReplayRecordArgs {
    /// A record written by `stepwatch agent --record`.
    pub file: PathBuf,
    /// Print the checks as JSON (one object per rank) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Reads and applies a record; errors name the line.
pub fn replay_file(path: &std::path::Path) -> anyhow::Result<Replayer> {
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
        replayer
            .apply(entry)
            .with_context(|| format!("{}:{}", path.display(), i + 1))?;
    }
    Ok(replayer)
}

pub fn run(args: ReplayRecordArgs) -> anyhow::Result<()> {
    let replayer = replay_file(&args.file)?;
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
            c.basis
                .and_then(|b| serde_json::to_value(b).ok())
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_else(|| "-".into()),
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
                    .filter_map(|a| serde_json::to_value(a).ok())
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        );
    }
    Ok(())
}
