//! `stepwatch agent --record` writes every input of the step model, and
//! `stepwatch replay-record` rebuilds from it exactly what the agent
//! reported: the same frozen prediction, the same steady-state peak. This is
//! what makes a record from a real GPU a fixture of the predictor.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn a_record_replays_to_the_agents_own_prediction_and_steady_peak() {
    let records = TempDir::new("record-out");
    let path = records.0.join("run.jsonl");
    let mut agent = Agent::start_with("record", 2, &["--record", path.to_str().unwrap()], |_| {});
    agent.wait_ready_with_nvml();
    // Two ranks of a 4-rank job that fits, 4 steps each, with allocator traces.
    let ranks: Vec<_> = (0..2)
        .map(|r| agent.sim("rank0-skew", "rec", r + 1, r, 4, 2.0, &[]))
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        wait_ok(child, &format!("sim rank {r}"));
    }
    agent.wait_metrics("4 steps on both ranks", Duration::from_secs(10), |m| {
        (1..=2).all(|r| {
            m.get(
                "stepwatch_rank_steps_completed_total",
                &[("training_job", "rec"), ("rank", &r.to_string())],
            ) == Some(4.0)
        })
    });
    // Every sample of the last steps reached the tracker once the sampler
    // has taken two more on each GPU (the first of them may have been read
    // before the step ended; the second was read after) and a report drains
    // them in.
    let taken = |m: &Metrics, gpu: &str| {
        m.get("stepwatch_gpu_samples_total", &[("gpu", gpu)])
            .unwrap_or(0.0)
    };
    let now = Metrics(agent.metrics());
    let before = [taken(&now, "0"), taken(&now, "1")];
    agent.wait_metrics(
        "two more samples on each GPU",
        Duration::from_secs(10),
        |m| taken(m, "0") >= before[0] + 2.0 && taken(m, "1") >= before[1] + 2.0,
    );
    let reports: Vec<serde_json::Value> = (1..=2)
        .map(|r| {
            let (code, body) = agent.get(&format!("/api/v1/jobs/rec/ranks/{r}"));
            assert_eq!(code, 200, "{body}");
            serde_json::from_str(&body).unwrap()
        })
        .collect();
    let m = Metrics(agent.metrics());
    assert!(m
        .get("stepwatch_record_entries_total", &[("result", "written")])
        .is_some_and(|n| n > 20.0));
    assert_eq!(
        m.get("stepwatch_record_entries_total", &[("result", "dropped")]),
        None
    );
    assert!(agent.terminate().success());

    let stdout = stdout_of(
        Command::new(BIN)
            .args(["replay-record", "--json"])
            .arg(&path),
        "replay-record --json",
    );
    let checks: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    assert_eq!(checks.len(), 2, "{stdout}");
    for (check, (rank, report)) in checks.iter().zip((1..=2).zip(&reports)) {
        assert_eq!(check["key"]["rank"], rank, "{check}");
        let frozen = &report["prediction_before_step2"];
        assert_eq!(check["basis"], "allocator_replay", "{check}");
        assert_eq!(
            check["predicted_peak_bytes"], frozen["predicted_peak_bytes"],
            "{check}\n{frozen}"
        );
        assert_eq!(
            check["steady_peak_bytes"], report["analysis"]["steady"]["nvml_peak_bytes"],
            "{check}\n{report}"
        );
        assert!(
            check["error_ratio"].as_f64().unwrap().abs() < 0.05,
            "{check}"
        );
    }

    // The table form names the file's ranks; a broken line names its number.
    let table = stdout_of(
        Command::new(BIN).arg("replay-record").arg(&path),
        "replay-record",
    );
    assert!(table.contains("| rec | 1 | allocator_replay |"), "{table}");
    let broken = records.0.join("broken.jsonl");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("{\"not\": \"an entry\"}\n");
    let lines = text.lines().count();
    std::fs::write(&broken, text).unwrap();
    let stderr = stderr_of_failure(Command::new(BIN).arg("replay-record").arg(&broken));
    assert!(
        stderr.contains(&format!("broken.jsonl:{lines}: not a record entry")),
        "{stderr}"
    );
}

/// The timeline ends with the prediction the agent froze when step 2 began,
/// also when step 1's last markers and step 2's first came in one batch (a
/// real PyTorch run on fake CUDA, markers only; the figures are the
/// fixture's, from `replay-record --json`).
#[test]
fn the_timeline_ends_with_the_frozen_prediction() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/torch-gpt-fp32-markers-fit2pct.jsonl"
    );
    let stdout = stdout_of(
        Command::new(BIN).args(["replay-record", "--timeline", fixture]),
        "replay-record --timeline",
    );
    let timeline: Vec<&str> = stdout.lines().filter(|l| l.starts_with("line ")).collect();
    let last = timeline.last().expect("a timeline");
    assert!(
        last.contains("predicted peak 4.375 GB") && last.ends_with("(frozen before step 2)"),
        "{stdout}"
    );
    // The live figure before it was step 1's optimizer's, not the last.
    assert!(timeline.len() >= 2, "{stdout}");
    assert!(
        timeline[timeline.len() - 2].contains("(provisional)"),
        "{stdout}"
    );
}
