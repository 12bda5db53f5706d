//! A client clock that jumps, or that is far from the agent's, is detected
//! and reported (a refusal reason, the advisory channel), never a silent
//! refusal of everything after it.

mod common;

use std::time::Duration;

use common::wire::*;
use common::*;
use stepwatch_proto::clock::monotonic_ns;

const HOUR_NS: u64 = 3_600_000_000_000;

/// Sends rank 0 of `job` with one batch per entry of `batches` on one
/// stream, which must end well; the client-clock advisories it was told.
fn clock_advisories_of(
    agent: &Agent,
    job: &str,
    batches: Vec<Vec<stepwatch_proto::v1::Marker>>,
) -> Vec<stepwatch_proto::v1::Advisory> {
    let messages = std::iter::once(hello(job, 0, 1))
        .chain(batches.into_iter().map(batch))
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let got = rt
        .block_on(exchange_collect(&agent.endpoint(), messages))
        .expect("the stream ends well");
    clock_advisories(got)
}

#[test]
fn one_batch_an_hour_ahead_is_refused_alone_and_the_next_steps_are_taken() {
    let agent = Agent::start("clock-jump", 1);
    let t0 = monotonic_ns();
    let mut jumped = step(2, t0 + 10_000_000);
    // Its last marker (step 2's end) an hour ahead: before, every later
    // marker was "older" than it and refused until a new run. The stream
    // goes on after it.
    jumped.last_mut().unwrap().monotonic_ns += HOUR_NS;
    let told = clock_advisories_of(
        &agent,
        "jumpy",
        vec![
            step(1, t0),
            jumped,
            step(3, t0 + 20_000_000),
            step(4, t0 + 30_000_000),
        ],
    );
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(told[0].message.contains("clock_jumped"), "{told:?}");
    let job = [("training_job", "jumpy")];
    agent.wait_metrics("steps 1, 3 and 4 taken", Duration::from_secs(10), |m| {
        m.get("stepwatch_rank_steps_completed_total", &job) == Some(3.0)
            && m.rejected("clock_jumped") == Some(6.0)
            && m.get(
                "stepwatch_advisories_sent_total",
                &[("kind", "ADVISORY_KIND_CLIENT_CLOCK")],
            ) == Some(1.0)
    });
}

#[test]
fn a_client_clock_far_behind_the_agents_is_told_once() {
    let agent = Agent::start("clock-behind", 1);
    // An hour behind the agent: no GPU sample can fall in its phases.
    // Markers far behind are taken.
    let t0 = monotonic_ns().saturating_sub(HOUR_NS).max(1_000);
    let told = clock_advisories_of(
        &agent,
        "behind",
        vec![step(1, t0), step(2, t0 + 10_000_000)],
    );
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(told[0].message.contains("behind the agent's"), "{told:?}");
    let m = Metrics(agent.metrics());
    assert_eq!(m.steps_completed("behind"), Some(2.0));
}
