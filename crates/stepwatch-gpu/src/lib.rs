//! GPU sources for stepwatch: the NVML sampler.
//!
//! The sampler runs on its own OS thread, never on the async runtime, so a
//! slow driver call can delay samples but never requests. It reads device
//! memory at a high rate and process lists at a low one, because process
//! lists take the driver's global lock (see NVML-NOTES.md) and would stall
//! the GPU's own work if polled often. Everything it keeps is bounded.
//!
//! Readers (the exporter, the step tracker) see only [`SamplerHandle`]:
//! snapshots for `/metrics` and a drain of fresh samples for attribution.
//! Nothing outside this crate calls NVML.

#![warn(missing_docs)]

mod ring;
mod sampler;

pub use ring::TimedRing;
pub use sampler::{
    mig_profile_of_name, GpuSnapshot, MigSlice, NvmlCall, ProcessUsage, Sample, SamplerConfig,
    SamplerHandle, SamplerSnapshot, LAG_BUCKETS_SECONDS,
};
