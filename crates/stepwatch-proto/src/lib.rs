//! Rust bindings for stepwatch's wire contract, `proto/stepwatch/v1`.
//!
//! The code under `src/generated/` is produced from the `.proto` files and
//! checked in, so a fresh machine builds without `protoc`. The test
//! `tests/bootstrap.rs` regenerates it and fails when the checked-in copy is
//! stale.

/// Version 1 of the contract: one bidirectional stream per training rank.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    include!("generated/stepwatch.v1.rs");
}

/// Upper bound on markers in one `MarkerBatch`; larger batches are rejected.
pub const MAX_MARKERS_PER_BATCH: usize = 1024;

/// Upper bound on one encoded message, client or agent side.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// The two clocks every marker carries, read the way the contract defines them.
pub mod clock {
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
}
