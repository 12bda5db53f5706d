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
