//! Restarting the agent loses no job's step history: it comes back from the
//! journal. A journal that cannot be read never stops the agent.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn step_history_survives_an_agent_restart() {
    let keep = TempDir::new("journal");
    let journal = keep.0.join("journal.json");
    let args = [
        "--journal",
        journal.to_str().unwrap(),
        "--journal-interval",
        "1h",
    ];
    let mut first = Agent::start_args("journal-1", &args);
    wait_ok(first.sim("rank0-skew", "kept", 1, 0, 3, 4.0, &[]), "sim");
    first.wait_metrics("3 steps", Duration::from_secs(10), |m| {
        m.steps_completed("kept") == Some(3.0)
    });
    let (_, before) = first.get("/api/v1/jobs/kept/ranks/1");
    assert!(first.terminate().success());
    assert!(first.log().contains("journal written"), "{}", first.log());
    drop(first);

    let second = Agent::start_args("journal-2", &args);
    assert!(
        second
            .log()
            .contains("restored step history from the journal"),
        "{}",
        second.log()
    );
    let m = Metrics(second.metrics());
    assert_eq!(
        m.get("stepwatch_journal_restored_ranks_total", &[]),
        Some(1.0)
    );
    assert_eq!(m.steps_completed("kept"), Some(3.0));
    assert_eq!(
        m.get("stepwatch_rank_connected", &[("training_job", "kept")]),
        Some(0.0)
    );
    assert!(m
        .get(
            "stepwatch_rank_first_step_peak_bytes",
            &[("training_job", "kept")]
        )
        .is_some());
    let (code, after) = second.get("/api/v1/jobs/kept/ranks/1");
    assert_eq!(code, 200, "{after}");
    let steps = |body: &str| {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        v["steps"].clone()
    };
    assert_eq!(
        steps(&after),
        steps(&before),
        "the timeline came back unchanged"
    );
}

#[test]
fn an_unreadable_journal_is_moved_aside_and_the_agent_starts() {
    let keep = TempDir::new("journal-bad");
    let journal = keep.0.join("journal.json");
    std::fs::write(&journal, "{ not json").unwrap();
    let agent = Agent::start_args("journal-bad", &["--journal", journal.to_str().unwrap()]);
    assert_eq!(agent.get("/healthz").0, 200);
    assert!(
        agent.log().contains("the journal is unreadable"),
        "{}",
        agent.log()
    );
    assert!(keep.0.join("journal.corrupt").exists());
}

#[test]
fn a_journal_not_in_utf8_or_of_another_version_is_moved_aside_not_overwritten() {
    let keep = TempDir::new("journal-aside");
    let not_utf8 = keep.0.join("a.json");
    let bytes = b"{\"version\": 1, \"ranks\": [\xff\xfe]}".to_vec();
    std::fs::write(&not_utf8, &bytes).unwrap();
    let other_version = keep.0.join("b.json");
    std::fs::write(&other_version, r#"{"version": 7, "ranks": []}"#).unwrap();
    for (tag, path, aside) in [
        ("journal-utf8", &not_utf8, keep.0.join("a.corrupt")),
        ("journal-version", &other_version, keep.0.join("b.v7")),
    ] {
        let original = std::fs::read(path).unwrap();
        let mut agent = Agent::start_args(tag, &["--journal", path.to_str().unwrap()]);
        assert!(agent.terminate().success(), "{}", agent.log());
        assert!(
            agent.log().contains("the journal is unreadable"),
            "{}",
            agent.log()
        );
        assert_eq!(
            std::fs::read(&aside).unwrap(),
            original,
            "{tag}: kept as it was"
        );
        // The agent's own journal replaced it at shutdown.
        let written = std::fs::read_to_string(path).unwrap();
        assert!(written.contains("\"version\":1"), "{written}");
    }
}
