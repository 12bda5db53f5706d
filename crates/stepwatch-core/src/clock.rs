//! A client's monotonic clock against the agent's, per rank.
//!
//! GPU samples are matched to phases by CLOCK_MONOTONIC, which a client on
//! the agent's host shares. Two faults broke that silently: one marker an
//! hour ahead (every later marker was then "older" and refused until a new
//! run), and a client whose clock is far from the agent's (another host, a
//! time namespace), whose phases never got a sample. Here the offset of each
//! batch (its latest marker minus the caller's clock when it is applied) is
//! compared with the rank's: a batch far ahead of it is a jump, refused
//! alone, and an offset that is large from the start is reported.

use serde::{Deserialize, Serialize};

use crate::advisory::{Advisory, AdvisoryKind};
use crate::marker::Marker;

/// How far a batch may run ahead of the rank's usual offset before it is a
/// jump, and how far the usual offset may be from the agent's clock before
/// it is reported. A marker reaches the agent after it is made, so on one
/// host the offset only goes negative (by the delivery delay); GPU samples
/// are kept about this long, so a larger offset leaves phases without them.
pub const CLOCK_TOLERANCE_NS: u64 = 60_000_000_000;

/// Batches in a row with about the same new offset after which it is taken
/// as the rank's (the client's clock really moved, or its first batches
/// came late) rather than refused for good.
pub const JUMPS_TO_ACCEPT: u8 = 3;

/// A rank's clock offset as learnt from its batches.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientClock {
    /// The largest offset (marker − agent, ns) seen within tolerance: the
    /// batch delivered fastest, the closest to the clocks' true offset.
    offset_ns: Option<i64>,
    /// Batches in a row that jumped, and the offset of the last of them.
    jumped: u8,
    jumped_offset_ns: i64,
}

/// What [`ClientClock::check`] decided about a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockVerdict {
    /// Within tolerance of the rank's offset.
    Ok,
    /// The first batch, or a new offset taken after [`JUMPS_TO_ACCEPT`]
    /// jumps; `offset_ns` is the rank's offset from now on.
    New {
        /// The offset (marker − caller's clock), ns.
        offset_ns: i64,
    },
    /// Ahead of the rank's offset by `ahead_ns`: refuse the batch.
    Jumped {
        /// How far ahead of the rank's offset, ns.
        ahead_ns: u64,
    },
}

impl ClientClock {
    /// Judges a batch applied at `now_ns` (the caller's clock) and learns
    /// from it; a jump changes nothing but the count of jumps.
    pub fn check(&mut self, markers: &[Marker], now_ns: u64) -> ClockVerdict {
        let Some(latest) = markers.iter().map(|m| m.monotonic_ns).max() else {
            return ClockVerdict::Ok;
        };
        let offset = latest as i64 - now_ns as i64;
        let tolerance = CLOCK_TOLERANCE_NS as i64;
        let Some(known) = self.offset_ns else {
            self.offset_ns = Some(offset);
            return ClockVerdict::New { offset_ns: offset };
        };
        if offset <= known.saturating_add(tolerance) {
            self.offset_ns = Some(known.max(offset));
            self.jumped = 0;
            return ClockVerdict::Ok;
        }
        if self.jumped > 0 && offset.abs_diff(self.jumped_offset_ns) <= CLOCK_TOLERANCE_NS {
            self.jumped += 1;
        } else {
            self.jumped = 1;
        }
        self.jumped_offset_ns = offset;
        if self.jumped >= JUMPS_TO_ACCEPT {
            self.offset_ns = Some(offset);
            self.jumped = 0;
            return ClockVerdict::New { offset_ns: offset };
        }
        ClockVerdict::Jumped {
            ahead_ns: offset.abs_diff(known),
        }
    }
}

/// Whether an offset is far enough from the agent's clock that GPU samples
/// cannot be matched to the rank's phases.
pub fn offset_is_far(offset_ns: i64) -> bool {
    offset_ns.unsigned_abs() > CLOCK_TOLERANCE_NS
}

/// The advisory for a rank whose clock is `offset_ns` from the agent's.
pub fn offset_advisory(step: u64, now_ns: u64, offset_ns: i64) -> Advisory {
    let secs = offset_ns.unsigned_abs() as f64 / 1e9;
    let way = if offset_ns < 0 { "behind" } else { "ahead of" };
    clock_advisory(
        step,
        now_ns,
        format!(
            "this process's markers carry a CLOCK_MONOTONIC {secs:.0} s {way} the agent's: GPU \
             samples cannot be matched to its phases, so its per-phase GPU figures stay empty \
             (a client on another host, or in another time namespace, than the agent)"
        ),
    )
}

/// The advisory for a batch refused because it jumped `ahead_ns` ahead.
pub fn jump_advisory(step: u64, now_ns: u64, ahead_ns: u64) -> Advisory {
    let secs = ahead_ns as f64 / 1e9;
    clock_advisory(
        step,
        now_ns,
        format!(
            "a marker batch of step {step} was {secs:.0} s ahead of this process's clock as the \
             agent knows it and was refused (clock_jumped); later markers are taken as usual"
        ),
    )
}

fn clock_advisory(step: u64, now_ns: u64, message: String) -> Advisory {
    Advisory::observation(AdvisoryKind::ClientClock, step, now_ns, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::marker::MarkerKind;

    fn at(ns: u64) -> Vec<Marker> {
        vec![Marker::at(MarkerKind::ForwardBegin, 1, ns, ns)]
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn one_batch_an_hour_ahead_is_a_jump_and_the_next_ones_are_not() {
        let mut c = ClientClock::default();
        let now = 10_000 * S;
        assert_eq!(
            c.check(&at(now - S / 100), now),
            ClockVerdict::New {
                offset_ns: -(S as i64) / 100
            }
        );
        assert_eq!(c.check(&at(now + S), now + S), ClockVerdict::Ok);
        let ClockVerdict::Jumped { ahead_ns } = c.check(&at(now + 3602 * S), now + 2 * S) else {
            panic!("an hour ahead is a jump")
        };
        assert!(ahead_ns >= 3600 * S);
        assert_eq!(c.check(&at(now + 3 * S), now + 3 * S), ClockVerdict::Ok);
    }

    #[test]
    fn a_late_first_batch_or_a_moved_clock_is_taken_after_a_few_batches() {
        // The first batch came 5 minutes late (buffered while the agent was
        // down); fresh batches then look ahead of it.
        let mut c = ClientClock::default();
        let now = 10_000 * S;
        c.check(&at(now - 300 * S), now);
        for i in 1..JUMPS_TO_ACCEPT {
            let t = now + u64::from(i) * S;
            assert!(matches!(c.check(&at(t), t), ClockVerdict::Jumped { .. }));
        }
        let t = now + 10 * S;
        assert!(matches!(c.check(&at(t), t), ClockVerdict::New { .. }));
        assert_eq!(c.check(&at(t + S), t + S), ClockVerdict::Ok);
    }

    #[test]
    fn a_far_offset_is_reported_and_a_near_one_is_not() {
        assert!(!offset_is_far(-(CLOCK_TOLERANCE_NS as i64)));
        assert!(offset_is_far(-(CLOCK_TOLERANCE_NS as i64) - 1));
        assert!(offset_is_far(i64::MAX));
        let a = offset_advisory(1, 0, -3_600 * S as i64);
        assert!(a.message.contains("3600 s behind"), "{}", a.message);
    }
}
