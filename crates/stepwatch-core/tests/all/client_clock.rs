//! The tracker's check of client clocks (`clock`): a batch that jumps far
//! ahead is refused alone, and a clock far from the caller's is advised of
//! once per run.

use stepwatch_core::*;
use stepwatch_testkit::{solo_rank, step_markers};

const S: u64 = 1_000_000_000;

fn tracker() -> Tracker {
    Tracker::new(TrackerConfig {
        check_client_clock: true,
        ..Default::default()
    })
}

fn info() -> RankInfo {
    solo_rank("clock", "GPU-a")
}

/// Step `n`'s markers, 1 ms apart from `t`.
fn step(n: u64, t: u64) -> Vec<Marker> {
    step_markers(n, 1, t, 1_000_000)
}

#[test]
fn a_jumped_batch_is_refused_and_the_rank_goes_on() {
    let mut t = tracker();
    let key = t.open(info(), 0).unwrap();
    let now = 10_000 * S;
    t.markers(&key, &step(1, now), now + S / 10).unwrap();
    let mut jumped = step(2, now + S);
    jumped.last_mut().unwrap().monotonic_ns += 3_600 * S;
    let e = t.markers(&key, &jumped, now + 2 * S).unwrap_err();
    assert_eq!(e.reason(), "clock_jumped");
    assert!(
        matches!(e, MarkerError::ClockJumped { ahead_ns, step: 2 } if ahead_ns > 3_599 * S),
        "{e:?}"
    );
    t.markers(&key, &step(3, now + 3 * S), now + 4 * S)
        .expect("the next step is taken");
    let steps = stepwatch_testkit::step_numbers(&t, &key);
    assert_eq!(steps, [1, 3]);
}

#[test]
fn a_clock_far_behind_is_advised_of_once() {
    let mut t = tracker();
    let key = t.open(info(), 0).unwrap();
    let now = 10_000 * S;
    let behind = now - 3_600 * S;
    let first = t.markers(&key, &step(1, behind), now).unwrap();
    let clock: Vec<_> = first
        .iter()
        .filter(|a| a.kind == AdvisoryKind::ClientClock)
        .collect();
    assert_eq!(clock.len(), 1, "{first:?}");
    assert!(
        clock[0].message.contains("3600 s behind"),
        "{}",
        clock[0].message
    );
    let later = t.markers(&key, &step(2, behind + S), now + S).unwrap();
    assert!(later.iter().all(|a| a.kind != AdvisoryKind::ClientClock));
}

#[test]
fn with_the_check_off_times_are_taken_as_they_come() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = t.open(info(), 0).unwrap();
    t.markers(&key, &step(1, 1_000), 0).unwrap();
    let mut jumped = step(2, 10 * S);
    jumped.last_mut().unwrap().monotonic_ns += 3_600 * S;
    let advised = t.markers(&key, &jumped, 0).unwrap();
    assert!(advised.iter().all(|a| a.kind != AdvisoryKind::ClientClock));
}
