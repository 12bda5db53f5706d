//! The Rust client never blocks or fails its caller: with the agent absent
//! it buffers up to a bound, drops and counts the rest, and delivers once
//! the agent (re)appears.

mod common;

use std::time::Duration;

use common::*;
use stepwatch_client::{Client, ClientOptions};
use stepwatch_proto::v1::{Hello, Identity};

fn hello(job: &str) -> Hello {
    Hello {
        identity: Some(Identity {
            job_id: job.into(),
            rank: 0,
            world_size: 1,
            ..Default::default()
        }),
        pid: std::process::id(),
        ..Default::default()
    }
}

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
    let mut options =
        ClientOptions::new(format!("unix://{}", socket.display()), hello("resilient"));
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
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", "resilient")],
        ) == Some(10.0)
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
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", "resilient")],
        ) == Some(4.0)
    });
    let stats = client.close(Duration::from_secs(5));
    assert_eq!(stats.sent, stats.enqueued, "{stats:?}");
    assert_eq!(stats.rejected_streams, 0, "{stats:?}");
}
