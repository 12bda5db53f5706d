//! A client clock that jumps, or that is far from the agent's, is detected
//! and reported (a refusal reason, the advisory channel), never a silent
//! refusal of everything after it.

mod common;

use std::time::Duration;

use common::wire::*;
use common::*;
use stepwatch_proto::clock::monotonic_ns;

const HOUR_NS: u64 = 3_600_000_000_000;

#[test]
fn one_batch_an_hour_ahead_is_refused_alone_and_the_next_steps_are_taken() {
    let agent = Agent::start("clock-jump", 1);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let t0 = monotonic_ns();
    let mut jumped = step(2, t0 + 10_000_000);
    // Its last marker (step 2's end) an hour ahead: before, every later
    // marker was "older" than it and refused until a new run.
    jumped.last_mut().unwrap().monotonic_ns += HOUR_NS;
    let got = rt
        .block_on(exchange_collect(
            &agent.endpoint(),
            vec![
                hello("jumpy", 0, 1),
                batch(step(1, t0)),
                batch(jumped),
                batch(step(3, t0 + 20_000_000)),
                batch(step(4, t0 + 30_000_000)),
            ],
        ))
        .expect("the stream goes on after the jumped batch");
    let told = clock_advisories(got);
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
    let rt = tokio::runtime::Runtime::new().unwrap();
    // An hour behind the agent: no GPU sample can fall in its phases.
    let t0 = monotonic_ns().saturating_sub(HOUR_NS).max(1_000);
    let got = rt
        .block_on(exchange_collect(
            &agent.endpoint(),
            vec![
                hello("behind", 0, 1),
                batch(step(1, t0)),
                batch(step(2, t0 + 10_000_000)),
            ],
        ))
        .expect("markers far behind are taken");
    let told = clock_advisories(got);
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(told[0].message.contains("behind the agent's"), "{told:?}");
    let m = Metrics(agent.metrics());
    assert_eq!(m.steps_completed("behind"), Some(2.0));
}
