//! Driving a simulated rank in real time, for demos and end-to-end tests.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use stepwatch_core::{AllocatorTrace, Marker};

use crate::rank::{RankSim, SimEvent};

/// Where a real-time run delivers what the rank does. The lead's
/// implementation writes the fake-NVML state and sends markers through the
/// client.
pub trait Sink {
    /// The process's NVML-visible memory changed.
    fn memory(&mut self, nvml_used_bytes: u64);
    /// A marker, stamped with the real clocks.
    fn marker(&mut self, marker: Marker);
    /// Step 1's allocator trace, right after step 1's optimizer-end marker.
    /// Ignored by default, as by a client that cannot record it.
    fn allocator_trace(&mut self, trace: &AllocatorTrace) {
        let _ = trace;
    }
    /// Memory other processes hold on this GPU now, read before each event
    /// so that co-located jobs see each other live; None keeps the
    /// scenario's figure.
    fn other_process_bytes(&mut self) -> Option<u64> {
        None
    }
    /// Called before each marker is stamped and sent; may block, as a test
    /// holding the rank at a step boundary until it has checked something.
    /// The run resumes from there at its pace: time spent here is added to
    /// every later event's due time, so the phases keep their lengths.
    fn before_marker(&mut self, marker: &Marker) {
        let _ = marker;
    }
}

/// Plays `rank`'s events into `sink`, sleeping so that they follow the
/// scenario's timings divided by `speed` (2.0 runs twice as fast). Each gap
/// between events is at least the scenario's: lateness delays what follows
/// rather than shortening it, so phase durations hold on a loaded machine. A `speed`
/// that is not a positive finite number runs without sleeping.
///
/// Markers are re-stamped: `monotonic_ns` from `clock` (a monotonic ns
/// clock, e.g. `CLOCK_MONOTONIC`) and `wall_ns` from the system clock. The
/// run ends when the rank does (after its last step or its OOM marker).
pub fn run_realtime(rank: &mut RankSim, sink: &mut dyn Sink, clock: &dyn Fn() -> u64, speed: f64) {
    let paced = speed.is_finite() && speed > 0.0;
    let mut real_start = clock();
    let sim_start = rank.now_ns();
    let mut last_stamp = 0;
    loop {
        if let Some(other) = sink.other_process_bytes() {
            rank.set_other_process_bytes(other);
        }
        let Some(event) = rank.next_event() else {
            break;
        };
        if paced {
            let offset = (event.at_ns().saturating_sub(sim_start) as f64 / speed) as u64;
            let target = real_start.saturating_add(offset);
            let now = clock();
            if target > now {
                std::thread::sleep(Duration::from_nanos(target - now));
            }
            // A late wake-up (a busy machine, a slow sink) moves every later
            // event by as much, so the next phase keeps its length instead of
            // being squeezed to catch up.
            real_start = real_start.saturating_add(clock().saturating_sub(target));
        }
        match event {
            SimEvent::Memory {
                nvml_used_bytes, ..
            } => sink.memory(nvml_used_bytes),
            SimEvent::Marker(mut m) => {
                let held_from = clock();
                sink.before_marker(&m);
                real_start = real_start.saturating_add(clock().saturating_sub(held_from));
                // Never let a marker go back in time, even with a coarse clock.
                last_stamp = clock().max(last_stamp);
                m.monotonic_ns = last_stamp;
                m.wall_ns = wall_now_ns();
                sink.marker(m);
            }
            SimEvent::AllocatorTrace { trace, .. } => sink.allocator_trace(&trace),
        }
    }
}

fn wall_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::time::Instant;

    use super::*;

    struct Stamps(Vec<Marker>);

    impl Sink for Stamps {
        fn memory(&mut self, _nvml_used_bytes: u64) {}
        fn marker(&mut self, marker: Marker) {
            self.0.push(marker);
        }
    }

    /// The scenario's gaps between consecutive markers, and the ones a run
    /// whose clock jumps by `jump_ns` at its `jump_at`-th reading stamped.
    fn gaps(speed: f64, jump_at: u32, jump_ns: u64) -> (Vec<u64>, Vec<u64>) {
        let mut scenario = crate::builtin_scenario("rank0-skew").expect("a built-in scenario");
        scenario.training.steps = 3;
        let mut planned = RankSim::new(&scenario, 1).unwrap();
        let mut planned_at = Vec::new();
        while let Some(event) = planned.next_event() {
            if let SimEvent::Marker(_) = event {
                planned_at.push(event.at_ns());
            }
        }
        let start = Instant::now();
        let readings = Cell::new(0u32);
        // As if the process were descheduled for `jump_ns` once, mid-run.
        let clock = || {
            readings.set(readings.get() + 1);
            let skipped = if readings.get() >= jump_at {
                jump_ns
            } else {
                0
            };
            start.elapsed().as_nanos() as u64 + skipped
        };
        let mut rank = RankSim::new(&scenario, 1).unwrap();
        let mut sink = Stamps(Vec::new());
        run_realtime(&mut rank, &mut sink, &clock, speed);
        let stamped = sink.0.iter().map(|m| m.monotonic_ns).collect::<Vec<_>>();
        let diff = |v: &[u64]| v.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>();
        (diff(&planned_at), diff(&stamped))
    }

    #[test]
    fn a_late_wake_up_delays_later_markers_instead_of_squeezing_their_phases() {
        let speed = 20.0;
        let (planned, stamped) = gaps(speed, 40, 5_000_000_000);
        assert_eq!(planned.len(), stamped.len());
        assert!(planned.len() >= 15, "{planned:?}");
        for (i, (p, s)) in planned.iter().zip(&stamped).enumerate() {
            let scaled = (*p as f64 / speed) as u64;
            // A gap may grow (sleeps overrun, the jump lands in it); it
            // never shrinks below the scenario's, less a clock tick.
            assert!(
                *s + 1_000 >= scaled,
                "gap {i} was {s} ns, the scenario's is {scaled} ns; planned {planned:?} stamped {stamped:?}"
            );
        }
    }
}
