//! Builders for the tests of stepwatch's step model: ranks, markers, whole
//! steps and GPU samples. A test names what differs from a plain rank and
//! nothing else, and a field added to a marker or a rank is added here once.
//!
//! Figures are in MiB ([`MIB`]) and times in nanoseconds on one clock (the
//! wall clock reads the same as the monotonic one), as in the hand-made
//! scenarios of `stepwatch-core/tests`.

use stepwatch_core::{
    Advisory, AdvisoryKind, AllocatorStats, BatchFacts, GpuSample, Marker, MarkerKind, RankInfo,
    RankKey, Tracker,
};

/// One MiB, the unit of the kit's byte figures.
pub const MIB: u64 = 1 << 20;

/// Asserts that `text` says each of `words`, naming the first it lacks.
#[track_caller]
pub fn assert_says(text: &str, words: &[&str]) {
    for w in words {
        assert!(text.contains(w), "{w:?} not in {text}");
    }
}

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

/// The markers of steps 1 to `steps`, each with `micro_batches`
/// forward/backward pairs, the first at 1,000 ns plus the first gap and
/// each next one a gap later, the gaps (ns) taken from `gaps` in turn: the
/// runs the property tests draw.
pub fn markers_spaced(steps: u64, micro_batches: u32, gaps: &[u64]) -> Vec<Marker> {
    let mut gap = gaps.iter().cycle();
    let mut t = 1_000;
    (1..=steps)
        .flat_map(|step| {
            step_kinds(micro_batches)
                .into_iter()
                .map(move |k| (step, k))
        })
        .map(|(step, (kind, micro))| {
            t += gap.next().expect("at least one gap");
            Marker {
                micro_batch: micro,
                ..marker(kind, step, t)
            }
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

/// The growth and post-mortem tests' leaking rank: alone on [`leaking::GPU`]
/// of [`leaking::CAPACITY_MIB`], step `n` from `n ×` [`leaking::PERIOD`] ns. A
/// step holds `held` MiB allocated between steps and 3000 MiB more in
/// backward, reserves `held + 3500` MiB, and NVML shows one sample per phase
/// after the first, the highest `held + 4000` MiB in backward. A cache
/// grown beyond that for good (by a larger batch) adds `cached` MiB to the
/// reserved figures and the samples.
pub mod leaking {
    use super::*;

    /// The rank's GPU.
    pub const GPU: &str = "GPU-0";
    /// The GPU's memory, MiB.
    pub const CAPACITY_MIB: u64 = 10_000;
    /// Nanoseconds from one step's begin to the next's: 1 ms.
    pub const PERIOD: u64 = 1_000_000;

    /// Feeds step `n`: its samples, then its markers (one every
    /// `PERIOD / 8` ns) as `edit` makes them; the tracker's advisories.
    pub fn step(
        tracker: &mut Tracker,
        key: &RankKey,
        (n, held, cached): (u64, u64, u64),
        edit: impl Fn(Marker) -> Marker,
    ) -> Vec<Advisory> {
        let t0 = n * PERIOD;
        let sampled = held + cached;
        let points: Vec<(u64, u64)> = [1_000, 4_000, 3_800, 3_600]
            .map(|above| sampled + above)
            .into_iter()
            .zip(1u64..)
            .map(|(used, i)| (t0 + i * PERIOD / 8 + 10, used))
            .collect();
        tracker.gpu_samples(GPU, &samples_mib(&points, CAPACITY_MIB));
        match tracker.markers(key, &markers(n, held, cached, edit), t0) {
            Ok(advisories) => advisories,
            Err(refusal) => panic!("the tracker refused step {n}: {refusal:?}"),
        }
    }

    /// The markers of [`step`], without its samples: a step NVML did not
    /// see (shorter than the sampler's period).
    pub fn markers(n: u64, held: u64, cached: u64, edit: impl Fn(Marker) -> Marker) -> Vec<Marker> {
        use MarkerKind::*;
        let t0 = n * PERIOD;
        [
            (StepBegin, held),
            (ForwardBegin, held),
            (BackwardBegin, held + 3_000),
            (OptimizerBegin, held + 500),
            (OptimizerEnd, held),
            (StepEnd, held),
        ]
        .into_iter()
        .zip(0u64..)
        .map(|((kind, allocated), i)| {
            let figures = (allocated, held + 3_000, held + cached + 3_500);
            edit(marker_mib(kind, n, t0 + i * PERIOD / 8, figures))
        })
        .collect()
    }
}

/// Step 1 of a rank from `t0`, in MB (10^6 bytes): 10 000 allocated at
/// step begin, `act` of activations in forward, 2 000 of gradients left
/// after backward, 8 000 of optimizer state made in the optimizer phase
/// (peak 20 000). Ranks that differ only in `act` diverge in activations,
/// not in their step-1 peak.
pub fn activation_step1(act: u64, t0: u64) -> Vec<Marker> {
    use MarkerKind::*;
    const MB: u64 = 1_000_000;
    let m = |kind, t: u64, allocated: u64, peak: u64| Marker {
        allocator: Some(alloc_bytes(allocated * MB, peak * MB, peak * MB)),
        ..marker(kind, 1, t0 + t)
    };
    let fb = 10_000 + act;
    vec![
        m(StepBegin, 100, 10_000, 10_000),
        m(ForwardBegin, 200, 10_000, 10_000),
        m(BackwardBegin, 300, fb, fb),
        m(OptimizerBegin, 400, 12_000, fb),
        m(OptimizerEnd, 500, 20_000, 20_000),
        m(StepEnd, 600, 20_000, 20_000),
    ]
}

/// The one advisory of `kind` among `advisories`, which must be about
/// `step` and say `says`; panics with what came otherwise.
pub fn the_advisory<'a>(
    advisories: &'a [Advisory],
    kind: AdvisoryKind,
    step: u64,
    says: &str,
) -> &'a Advisory {
    let of_kind: Vec<&Advisory> = advisories.iter().filter(|a| a.kind == kind).collect();
    match of_kind[..] {
        [one] if one.step == step && one.message.contains(says) => one,
        _ => panic!("not one {kind:?} advisory at step {step} saying {says:?}: {advisories:#?}"),
    }
}

/// How many advisories of `kind` the tracker has issued to `key`'s rank.
pub fn issued(tracker: &Tracker, key: &RankKey, kind: AdvisoryKind) -> usize {
    let rank = tracker.rank(key).expect("the rank is tracked");
    rank.advisories.iter().filter(|a| a.kind == kind).count()
}

/// The step numbers `key`'s timeline holds, oldest first.
pub fn step_numbers(tracker: &Tracker, key: &RankKey) -> Vec<u64> {
    let rank = tracker.rank(key).expect("the rank is tracked");
    rank.timeline.steps().map(|s| s.step).collect()
}
