//! The agent's lifecycle on disk and under signals: one agent per socket
//! path, a restart that cannot orphan the socket, SIGHUP.

mod common;

use std::time::Duration;

use common::*;

/// Sends `signal` to the agent without waiting for anything.
fn signal(agent: &Agent, signal: i32) {
    let pid = agent.child.as_ref().expect("agent running").id();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid as i32, signal) };
}

#[test]
fn an_agent_started_while_the_old_one_shuts_down_keeps_its_socket() {
    let shared = TempDir::new("restart-socket");
    let socket = shared.0.join("agent.sock");
    let mut old = Agent::start_full("restart-old", 1, Some(socket.clone()), &[], |_| {});
    old.wait_ready_with_nvml();
    // A connected trainer keeps the old agent draining for seconds after
    // SIGTERM, its listener already closed: the window a restart fell in.
    let mut rank = old.sim("demo-small", "held", 0, 0, 1000, 0.2, &[]);
    old.wait_metrics("the rank connected", Duration::from_secs(30), |m| {
        m.get("stepwatch_rank_connected", &[("training_job", "held")]) == Some(1.0)
    });
    signal(&old, libc::SIGTERM);
    wait_until("the old agent shuts down", Duration::from_secs(10), || {
        old.log().contains("shutting down")
    });
    let new = Agent::start_full("restart-new", 1, Some(socket.clone()), &[], |_| {});
    assert!(old.terminate().success(), "{}", old.log());
    assert!(
        new.log()
            .contains("another agent holds the socket's lock; waiting"),
        "{}",
        new.log()
    );
    assert!(socket.exists(), "the new agent's socket was unlinked");
    // The trainer reconnects to the new agent.
    new.wait_metrics("the rank reconnected", Duration::from_secs(60), |m| {
        m.get("stepwatch_rank_connected", &[("training_job", "held")]) == Some(1.0)
    });
    let _ = rank.kill();
    let _ = rank.wait();
}

#[test]
fn sighup_writes_the_journal_and_the_agent_keeps_running() {
    let keep = TempDir::new("sighup");
    let journal = keep.0.join("journal.json");
    let agent = Agent::start_args(
        "sighup",
        &[
            "--journal",
            journal.to_str().unwrap(),
            "--journal-interval",
            "1h",
        ],
    );
    wait_ok(agent.sim("rank0-skew", "hup", 0, 0, 2, 4.0, &[]), "sim");
    signal(&agent, libc::SIGHUP);
    wait_until(
        "the journal written on SIGHUP",
        Duration::from_secs(10),
        || std::fs::read_to_string(&journal).is_ok_and(|j| j.contains("\"hup\"")),
    );
    wait_until("the SIGHUP log line", Duration::from_secs(10), || {
        agent.log().contains("SIGHUP: flags are not reloaded")
    });
    assert_eq!(agent.get("/healthz").0, 200, "{}", agent.log());
}
