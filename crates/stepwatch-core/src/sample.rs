//! What the step model is fed from the device side: one GPU memory reading.
//!
//! It has its own module so that the tracker, the prediction and the
//! analysis all import it from here, not from each other.

use serde::{Deserialize, Serialize};

/// One reading of one GPU's device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSample {
    /// CLOCK_MONOTONIC ns when the reading was taken.
    pub monotonic_ns: u64,
    /// Device memory in use (NVML memory info v2 `used`).
    pub used_bytes: u64,
    /// Device capacity processes can use: NVML's `total` minus the memory
    /// the driver reserves (`reserved` of memory info v2), which no
    /// allocation can get; headroom is measured against it. Records written
    /// before it was named so call it `total_bytes`.
    #[serde(alias = "total_bytes")]
    pub capacity_bytes: u64,
}
