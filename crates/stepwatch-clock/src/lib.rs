//! The two clocks every marker and GPU sample carries, read the way the
//! wire contract defines them. A crate of its own so that the sampler and
//! the client read the same clock as the agent without compiling the wire
//! bindings or the step model.

/// CLOCK_MONOTONIC in ns. The agent's GPU samples and the client's markers
/// use this same clock, which is what lets samples be attributed to phases.
pub fn monotonic_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC)
}

/// CLOCK_REALTIME in ns since the Unix epoch.
pub fn wall_ns() -> u64 {
    read(libc::CLOCK_REALTIME)
}

fn read(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; both clocks exist on Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monotonic_clock_never_goes_back_and_the_wall_clock_is_past_2024() {
        let (a, b) = (monotonic_ns(), monotonic_ns());
        assert!(b >= a);
        // 2024-01-01 in ns since the epoch: a wall clock read as something
        // else (seconds, or the monotonic clock) would be far below it.
        assert!(wall_ns() > 1_704_067_200_000_000_000);
    }
}
