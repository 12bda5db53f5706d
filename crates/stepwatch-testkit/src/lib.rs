//! Builders for the tests of stepwatch's step model: ranks, markers, whole
//! steps and GPU samples. A test names what differs from a plain rank and
//! nothing else, and a field added to a marker or a rank is added here once.
//!
//! Figures are in MiB ([`MIB`]) and times in nanoseconds on one clock (the
//! wall clock reads the same as the monotonic one), as in the hand-made
//! scenarios of `stepwatch-core/tests`.

use stepwatch_core::{
    AllocatorStats, BatchFacts, GpuSample, Marker, MarkerKind, RankInfo, RankKey, Tracker,
};

/// One MiB, the unit of the kit's byte figures.
pub const MIB: u64 = 1 << 20;

/// A marker at `t` ns on both clocks, first micro-batch, no allocator figures.
pub fn marker(kind: MarkerKind, step: u64, t: u64) -> Marker {
    Marker::at(kind, step, t, t)
}

/// Allocator figures in bytes: allocated now, its peak, and reserved (now
/// and peak alike, as after a step's growth has settled).
pub fn alloc_bytes(allocated: u64, peak: u64, reserved: u64) -> AllocatorStats {
    AllocatorStats {
        allocated_bytes: allocated,
        allocated_peak_bytes: peak,
        reserved_bytes: reserved,
        reserved_peak_bytes: reserved,
        ..Default::default()
    }
}

/// [`alloc_bytes`] in MiB.
pub fn alloc_mib(allocated: u64, peak: u64, reserved: u64) -> AllocatorStats {
    alloc_bytes(allocated * MIB, peak * MIB, reserved * MIB)
}

/// A marker with allocator figures `(allocated, peak, reserved)` in MiB.
pub fn marker_mib(
    kind: MarkerKind,
    step: u64,
    t: u64,
    (allocated, peak, reserved): (u64, u64, u64),
) -> Marker {
    Marker {
        allocator: Some(alloc_mib(allocated, peak, reserved)),
        ..marker(kind, step, t)
    }
}

/// `markers` with each forward-begin marker saying its micro-batch had
/// `samples` samples, as a client that sees the forward's inputs sends them.
pub fn with_batch_samples(markers: Vec<Marker>, samples: u64) -> Vec<Marker> {
    markers
        .into_iter()
        .map(|m| match m.kind {
            MarkerKind::ForwardBegin => Marker {
                batch: Some(BatchFacts {
                    samples: Some(samples),
                    ..Default::default()
                }),
                ..m
            },
            _ => m,
        })
        .collect()
}

/// The kinds of one step's markers with `micro_batches` forward/backward
/// pairs, in the order a training loop sends them.
pub fn step_kinds(micro_batches: u32) -> Vec<(MarkerKind, u32)> {
    let mut kinds = vec![(MarkerKind::StepBegin, 0)];
    for micro in 0..micro_batches {
        kinds.push((MarkerKind::ForwardBegin, micro));
        kinds.push((MarkerKind::BackwardBegin, micro));
    }
    let last = micro_batches.saturating_sub(1);
    kinds.extend([
        (MarkerKind::OptimizerBegin, last),
        (MarkerKind::OptimizerEnd, last),
        (MarkerKind::StepEnd, last),
    ]);
    kinds
}

/// The markers of step `step` with `micro_batches` forward/backward pairs,
/// the first at `t0` and each next one `gap` ns later, without allocator
/// figures.
pub fn step_markers(step: u64, micro_batches: u32, t0: u64, gap: u64) -> Vec<Marker> {
    step_kinds(micro_batches)
        .into_iter()
        .zip(0u64..)
        .map(|((kind, micro), i)| Marker {
            micro_batch: micro,
            ..marker(kind, step, t0 + i * gap)
        })
        .collect()
}

/// GPU samples from `(t ns, used MiB)` points on a GPU of `capacity_mib`.
pub fn samples_mib(points: &[(u64, u64)], capacity_mib: u64) -> Vec<GpuSample> {
    points
        .iter()
        .map(|&(t, used)| GpuSample {
            monotonic_ns: t,
            used_bytes: used * MIB,
            capacity_bytes: capacity_mib * MIB,
        })
        .collect()
}

/// A rank of `job` alone on `gpu` (world size 1, rank 0, pid 1): the rank
/// most tests need; struct update syntax changes the rest.
pub fn solo_rank(job: &str, gpu: &str) -> RankInfo {
    RankInfo {
        job: job.into(),
        world_size: 1,
        gpu_uuid: gpu.into(),
        pid: 1,
        ..Default::default()
    }
}

/// Rank `rank` of a job of `world_size` ranks, on its own GPU
/// `GPU-<rank>` with pid `100 + rank`.
pub fn rank_of(job: &str, rank: u32, world_size: u32) -> RankInfo {
    RankInfo {
        job: job.into(),
        rank,
        local_rank: rank,
        world_size,
        gpu_uuid: format!("GPU-{rank}"),
        pid: 100 + rank,
        ..Default::default()
    }
}

/// Opens `info` in `tracker` at time 0; panics with the refusal, which a
/// test that means to open a rank never expects.
pub fn open(tracker: &mut Tracker, info: RankInfo) -> RankKey {
    match tracker.open(info, 0) {
        Ok(key) => key,
        Err(refusal) => panic!("the tracker refused a test rank: {refusal:?}"),
    }
}

/// The base scenario's step 1, the one the step model's tests share: a
/// rank on a GPU of 10,000 MiB whose step 1 peaks at 6,000 MiB allocated
/// and 7,500 MiB reserved, with markers only (no allocator trace).
pub mod base {
    use super::*;

    /// Allocator figures `(allocated, peak, reserved)` in MiB at step 1's
    /// markers, in [`stepwatch_core::MarkerKind::STEP_ORDER`].
    pub const STEP1_ALLOCATOR: [(u64, u64, u64); 6] = [
        (1000, 1000, 1200),
        (1000, 1000, 1200),
        (5000, 5000, 6250),
        (1400, 6000, 7500),
        (2200, 6000, 7500),
        (2200, 6000, 7500),
    ];

    /// NVML's used MiB in step 1, as `(ns after the step began, MiB)`: the
    /// device peak is 8,000 MiB, 800 MiB above the allocator's.
    pub const STEP1_SAMPLES: [(u64, u64); 5] = [
        (50, 1700),
        (150, 3500),
        (250, 7000),
        (350, 8000),
        (450, 8000),
    ];

    /// Step 1's markers from `t0`, one every 100 ns, with the allocator
    /// figures when `with_allocator`.
    pub fn step1_markers(t0: u64, with_allocator: bool) -> Vec<Marker> {
        MarkerKind::STEP_ORDER
            .into_iter()
            .zip(STEP1_ALLOCATOR)
            .zip(0u64..)
            .map(|((kind, figures), i)| {
                let t = t0 + 100 * i;
                if with_allocator {
                    marker_mib(kind, 1, t, figures)
                } else {
                    marker(kind, 1, t)
                }
            })
            .collect()
    }

    /// Step 1's samples from `t0` on a GPU of `capacity_mib`.
    pub fn step1_samples(t0: u64, capacity_mib: u64) -> Vec<GpuSample> {
        let points: Vec<(u64, u64)> = STEP1_SAMPLES
            .iter()
            .map(|&(dt, used)| (t0 + dt, used))
            .collect();
        samples_mib(&points, capacity_mib)
    }
}

/// NVML samples of step `n` of a rank whose steps start every `period` ns
/// (step `n` at `n × period`) and that holds `held` MiB between steps: one
/// sample per phase after the first, the highest `held + 4000` MiB in
/// backward. The growth and post-mortem tests' leaking rank.
pub fn leaking_step_samples(n: u64, period: u64, held: u64, capacity_mib: u64) -> Vec<GpuSample> {
    let t0 = n * period;
    let points: Vec<(u64, u64)> = [held + 1_000, held + 4_000, held + 3_800, held + 3_600]
        .into_iter()
        .zip(1u64..)
        .map(|(used, i)| (t0 + i * period / 8 + 10, used))
        .collect();
    samples_mib(&points, capacity_mib)
}
