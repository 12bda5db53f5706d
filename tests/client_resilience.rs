//! The Rust client never blocks or fails its caller: with the agent absent
//! it buffers up to a bound, drops and counts the rest, and delivers once
//! the agent (re)appears.

mod common;

use std::time::Duration;

use common::*;
use stepwatch_client::{Client, ClientOptions};

fn mark_step(client: &Client, step: u64) -> usize {
    stepwatch_core::MarkerKind::STEP_ORDER
        .map(stepwatch_proto::convert::marker_kind_to_wire)
        .into_iter()
        .filter(|k| client.mark_now(*k, step, 0))
        .count()
}

#[test]
fn markers_survive_an_absent_then_restarted_agent() {
    let dir = TempDir::new("client");
    let socket = dir.0.join("late.sock");
    let mut options = ClientOptions::new(
        format!("unix://{}", socket.display()),
        wire::solo_hello("resilient"),
    );
    options.queue_capacity = 60;
    options.reconnect_max = Duration::from_millis(300);
    let client = Client::start(options);

    // No agent: 10 steps fit the queue, the next 10 are dropped and counted.
    let queued: usize = (1..=10).map(|s| mark_step(&client, s)).sum();
    assert_eq!(queued, 60);
    let queued_late: usize = (11..=20).map(|s| mark_step(&client, s)).sum();
    assert_eq!(queued_late, 0);
    let stats = client.stats();
    assert_eq!(stats.dropped, 60);
    assert!(!client.connected());
    // It keeps trying (a second attempt counts as a reconnect); start the
    // agent only then, or a slow client thread meets it on its first try.
    wait_until("a retry", Duration::from_secs(10), || {
        client.stats().reconnects >= 1
    });

    // The agent appears: the buffered steps arrive.
    let mut agent = Agent::start_full("client-late", 1, Some(socket.clone()), &[], |_| {});
    agent.wait_metrics("buffered steps delivered", Duration::from_secs(15), |m| {
        m.steps_completed("resilient") == Some(10.0)
    });
    assert!(client.flush(Duration::from_secs(5)));

    // The agent restarts; the client reconnects and goes on.
    assert!(agent.terminate().success());
    drop(agent);
    for s in 21..=22 {
        mark_step(&client, s);
    }
    let agent = Agent::start_full("client-restart", 1, Some(socket), &[], |_| {});
    for s in 23..=24 {
        mark_step(&client, s);
    }
    agent.wait_metrics("steps after the restart", Duration::from_secs(15), |m| {
        m.steps_completed("resilient") == Some(4.0)
    });
    let stats = client.close(Duration::from_secs(5));
    assert_eq!(stats.sent, stats.enqueued, "{stats:?}");
    assert_eq!(stats.rejected_streams, 0, "{stats:?}");
}

/// Two clients for one rank in one process: the second one's run takes the
/// rank, and the first one's next batch is refused as `run_ended`. No retry
/// can pass (a reconnect naming the left run is refused as `rank_held`), so
/// the first client stops instead of reconnecting for the rest of training.
#[test]
fn a_client_whose_run_another_client_in_the_process_replaced_stops_for_good() {
    use stepwatch_proto::v1::MarkerKind;

    let agent = Agent::start("client-replaced", 1);
    let start = || {
        let mut options = ClientOptions::new(agent.endpoint(), wire::solo_hello("replaced"));
        options.reconnect_max = Duration::from_millis(300);
        Client::start(options)
    };
    let run_of_rank = || {
        let (_, body) = agent.get("/api/v1/jobs/replaced/ranks/0");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let steps = v["steps"].as_array().map_or(0, Vec::len);
        (v["info"]["run_id"].as_str().unwrap_or("").to_owned(), steps)
    };
    let first = start();
    first.mark_now(MarkerKind::StepBegin, 1, 0);
    first.mark_now(MarkerKind::ForwardBegin, 1, 0);
    assert!(first.flush(Duration::from_secs(30)));
    wait_until("the first run's step 1", Duration::from_secs(30), || {
        run_of_rank() == (first.run_id().to_owned(), 1)
    });
    let second = start();
    second.mark_now(MarkerKind::StepBegin, 1, 0);
    assert!(second.flush(Duration::from_secs(30)));
    wait_until(
        "the second run takes the rank",
        Duration::from_secs(30),
        || run_of_rank().0 == second.run_id(),
    );
    first.mark_now(MarkerKind::BackwardBegin, 1, 0);
    wait_until("the first client stops", Duration::from_secs(30), || {
        first.stats().stopped
    });
    assert!(!first.mark_now(MarkerKind::OptimizerBegin, 1, 0), "dropped");
    assert!(
        !first.flush(Duration::from_secs(30)),
        "nothing will be sent"
    );
    // Closing joins the sender: after it, no reconnect can still come.
    let stats = first.close(Duration::from_secs(1));
    assert_eq!(
        (stats.reconnects, stats.rejected_streams),
        (0, 1),
        "{stats:?}"
    );
    assert_eq!(stats.dropped, 1, "{stats:?}");
    let m = Metrics(agent.metrics());
    assert_eq!(m.rejected("run_ended"), Some(1.0));
    assert_eq!(m.rejected("rank_held"), Some(0.0));
    let stats = second.close(Duration::from_secs(5));
    assert!(!stats.stopped && stats.rejected_streams == 0, "{stats:?}");
}
