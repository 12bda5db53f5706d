//! Growth after step 2: the robust slope, the forecast, the trailing
//! window the tracker keeps, and the MEMORY_GROWTH advisory.
//!
//! Unit M = 1 MiB. The GPU of the tracker tests has 10000 M usable.

use proptest::prelude::*;
use stepwatch_core::*;
use stepwatch_testkit as kit;

use kit::leaking::GPU;

const M: u64 = 1 << 20;
const CAPACITY: u64 = kit::leaking::CAPACITY_MIB * M;

/// The window of steps `3..3 + values.len()`, each figure (allocated and
/// reserved at step end, the NVML peak) from `values`, a step every second.
fn window(values: &[(u64, u64, u64)]) -> Vec<StepFigures> {
    (3u64..)
        .zip(values)
        .map(|(step, &(a, r, n))| StepFigures {
            step,
            end_monotonic_ns: step * 1_000_000_000,
            end_wall_ns: 1_700_000_000_000_000_000 + step * 1_000_000_000,
            nvml_peak_bytes: Some(n),
            allocated_peak_bytes: Some(a + 2_000 * M),
            allocated_peak_exact: true,
            reserved_peak_bytes: Some(r),
            allocated_at_end_bytes: Some(a),
            reserved_at_end_bytes: Some(r),
            batch: None,
        })
        .collect()
}

/// [`window`] with each step's batch (tokens) from `tokens`.
fn window_with_batches(values: &[(u64, u64, u64)], tokens: &[u64]) -> Vec<StepFigures> {
    let mut steps = window(values);
    for (s, &t) in steps.iter_mut().zip(tokens) {
        s.batch = Some(BatchSize {
            tokens: Some(t),
            ..Default::default()
        });
    }
    steps
}

/// What a batch schedule's running maximum raises the cache by: `jumps[k]`
/// M more for each new largest batch, cumulated, per step.
fn ratchet(tokens: &[u64], jumps: &[u64]) -> Vec<u64> {
    let mut largest = 0;
    let mut raised = 0;
    let mut records = 0;
    tokens
        .iter()
        .map(|&t| {
            if t > largest {
                if largest > 0 {
                    raised += jumps[records % jumps.len()] * M;
                    records += 1;
                }
                largest = t;
            }
            raised
        })
        .collect()
}

/// A deterministic noise sequence in [-1, 1] (an LCG), so that the tests
/// with noise far above the materiality bound cannot flake.
fn noise(seed: u64, n: usize) -> Vec<f64> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

proptest! {
    /// A flat job whose figures stay within ±0.1% of capacity of their
    /// level (a seventh of the 1% the slope must add over the window)
    /// never reports growth, whatever the noise does.
    #[test]
    fn a_flat_job_with_bounded_noise_never_grows(
        steps in 16usize..=64,
        level in 2_000u64..9_000,
        amplitude in 0u64..=10,
        seed in any::<u64>(),
    ) {
        let e = noise(seed, steps * 3);
        let jitter = |i: usize| (e[i] * amplitude as f64 * M as f64) as i64;
        let values: Vec<(u64, u64, u64)> = (0..steps)
            .map(|i| {
                let base = (level * M) as i64;
                (
                    (base / 2 + jitter(3 * i)) as u64,
                    (base * 3 / 4 + jitter(3 * i + 1)) as u64,
                    (base + jitter(3 * i + 2)) as u64,
                )
            })
            .collect();
        let trend = MemoryTrend::of(&window(&values), &GrowthConfig::default()).unwrap();
        prop_assert!(forecast(&trend, CAPACITY, &GrowthConfig::default()).is_none(), "{trend:?}");
    }

    /// A linear leak of 0.1% to 2% of capacity per step, with noise of up
    /// to a fifth of the leak per step, is found: the slope within 10%,
    /// the forecast step within 10% of the true one (counted from the
    /// window's last step).
    #[test]
    fn a_linear_leak_is_found_with_its_slope(
        steps in 16usize..=64,
        leak in 10u64..=200,
        seed in any::<u64>(),
    ) {
        let e = noise(seed, steps);
        let level = 4_000 * M;
        let leak_bytes = leak * M;
        let values: Vec<(u64, u64, u64)> = (0..steps)
            .map(|i| {
                let grown = level + i as u64 * leak_bytes;
                let n = (grown as f64 + e[i] * leak_bytes as f64 / 5.0) as u64;
                (grown / 2, grown * 3 / 4, n)
            })
            .collect();
        let config = GrowthConfig::default();
        let trend = MemoryTrend::of(&window(&values), &config).unwrap();
        let f = forecast(&trend, CAPACITY, &config).expect("a leak is found");
        let nvml = trend.slope(GrowthSource::Nvml).unwrap();
        prop_assert!((nvml.bytes_per_step - leak_bytes as f64).abs() <= 0.1 * leak_bytes as f64);
        prop_assert_eq!(f.source, GrowthSource::Nvml);
        let last = 3 + steps as u64 - 1;
        let peak_now = level + (steps as u64 - 1) * leak_bytes;
        let truth = CAPACITY.saturating_sub(peak_now).div_ceil(leak_bytes);
        let found = f.oom_step - last;
        prop_assert!(
            (found as f64 - truth as f64).abs() <= (0.1 * truth as f64).max(1.0),
            "forecast {found} steps, truth {truth}"
        );
        // A step a second: the time is the steps.
        prop_assert!((f.seconds_to_oom.unwrap() - found as f64).abs() < 1e-6);
    }

    /// One step far off the line, up or down, at any place of the window,
    /// does not move the slope at all.
    #[test]
    fn one_spike_does_not_move_the_slope(
        steps in 16usize..=64,
        leak in 0u64..=100,
        at in any::<prop::sample::Index>(),
        spike in -3_000i64..=3_000,
    ) {
        let at = at.index(steps);
        let points: Vec<(u64, u64)> = (0..steps as u64)
            .map(|i| {
                let y = (5_000 + leak * i) as i64 * M as i64;
                let y = if i as usize == at { y + spike * M as i64 } else { y };
                (3 + i, y as u64)
            })
            .collect();
        let s = theil_sen(&points, 3.29).unwrap();
        prop_assert_eq!(s.bytes_per_step, (leak * M) as f64);
    }
}

proptest! {
    /// Batches that ratchet up (any schedule of sizes, each new largest
    /// one growing the cache by up to 30% of capacity for good) with
    /// nothing leaking: the slope is taken within running-max batch
    /// blocks, so no growth is read, and the level is the current block's.
    #[test]
    fn a_ratcheting_batch_is_not_read_as_growth(
        tokens in prop::collection::vec(1u64..=8, 16..=64),
        jumps in prop::collection::vec(1u64..=3_000, 1..8),
    ) {
        let raised = ratchet(&tokens, &jumps);
        let values: Vec<(u64, u64, u64)> = raised
            .iter()
            .map(|&r| (2_000 * M, 3_000 * M + r, 4_000 * M + r))
            .collect();
        let config = GrowthConfig::default();
        let trend = MemoryTrend::of(&window_with_batches(&values, &tokens), &config).unwrap();
        prop_assert!(forecast(&trend, CAPACITY, &config).is_none(), "{trend:?}");
        if let Some(nvml) = trend.slope(GrowthSource::Nvml) {
            prop_assert_eq!(nvml.bytes_per_step, 0.0);
            prop_assert_eq!(nvml.level_bytes, (4_000 * M + raised[raised.len() - 1]) as f64);
        }
    }

    /// A leak of 0.1% to 2% of capacity per step under the same
    /// ratcheting batches, with noise of up to a twentieth of the leak, is
    /// found with its slope within 10%, whenever some block holds two
    /// steps.
    #[test]
    fn a_leak_under_ratcheting_batches_is_found(
        tokens in prop::collection::vec(1u64..=4, 16..=64),
        jumps in prop::collection::vec(1u64..=1_000, 1..4),
        leak in 10u64..=200,
        seed in any::<u64>(),
    ) {
        let e = noise(seed, tokens.len());
        let raised = ratchet(&tokens, &jumps);
        let leak_bytes = leak * M;
        let values: Vec<(u64, u64, u64)> = raised
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let held = 2_000 * M + i as u64 * leak_bytes;
                let n = (held as f64 + (2_000 * M + r) as f64 + e[i] * leak_bytes as f64 / 20.0) as u64;
                (held, held + 1_000 * M + r, n)
            })
            .collect();
        let config = GrowthConfig::default();
        let trend = MemoryTrend::of(&window_with_batches(&values, &tokens), &config).unwrap();
        let f = forecast(&trend, CAPACITY, &config);
        let records = raised.windows(2).filter(|w| w[1] > w[0]).count();
        prop_assume!(records + 1 < tokens.len());
        let f = f.expect("a leak is found");
        prop_assert!((f.bytes_per_step - leak_bytes as f64).abs() <= 0.1 * leak_bytes as f64, "{f:?}");
    }
}

/// A staircase (a batch that grows every 8 steps) is one block per stair:
/// no pair crosses a stair, so the slope is 0 and the interval holds it.
#[test]
fn the_slope_is_taken_within_batch_blocks() {
    let tokens: Vec<u64> = (0..48u64).map(|i| 1_024 * (1 + i / 8)).collect();
    let values: Vec<(u64, u64, u64)> = tokens
        .iter()
        .map(|&t| (2_000 * M, 2_000 * M + t * M / 8, 3_000 * M + t * M / 8))
        .collect();
    let config = GrowthConfig::default();
    let blocked = MemoryTrend::of(&window_with_batches(&values, &tokens), &config).unwrap();
    let nvml = blocked.slope(GrowthSource::Nvml).unwrap();
    assert_eq!((nvml.bytes_per_step, nvml.blocks, nvml.steps), (0.0, 6, 48));
    assert!(nvml.low_bytes_per_step <= 0.0 && nvml.high_bytes_per_step >= 0.0);
    assert_eq!(nvml.level_bytes, (3_000 + 6 * 128) as f64 * M as f64);
    // The same steps without batch facts are one block, read as growth.
    let unblocked = MemoryTrend::of(&window(&values), &config).unwrap();
    assert_eq!(unblocked.slope(GrowthSource::Nvml).unwrap().blocks, 1);
    assert!(forecast(&unblocked, CAPACITY, &config).is_some());
    assert!(forecast(&blocked, CAPACITY, &config).is_none());
}

/// Noise of ±5% of capacity (varying batches), 50 times the materiality
/// bound: Sen's interval keeps it silent, on every one of 200 fixed seeds
/// and every window length.
#[test]
fn a_noisy_flat_job_stays_silent() {
    let config = GrowthConfig::default();
    for seed in 0..200 {
        let e = noise(seed, 64 * 3);
        for steps in [16, 32, 64] {
            let values: Vec<(u64, u64, u64)> = (0..steps)
                .map(|i| {
                    let j = |k: usize| (e[3 * i + k] * 500.0 * M as f64) as i64;
                    (
                        (3_000 * M as i64 + j(0)) as u64,
                        (6_000 * M as i64 + j(1)) as u64,
                        (7_000 * M as i64 + j(2)) as u64,
                    )
                })
                .collect();
            let trend = MemoryTrend::of(&window(&values), &config).unwrap();
            assert!(
                forecast(&trend, CAPACITY, &config).is_none(),
                "seed {seed}, {steps} steps: {trend:?}"
            );
        }
    }
}

#[test]
fn nothing_is_said_before_the_minimum_of_steps() {
    let config = GrowthConfig::default();
    let values: Vec<(u64, u64, u64)> = (0..config.min_steps as u64 - 1)
        .map(|i| (i * 100 * M, i * 100 * M, 4_000 * M + i * 100 * M))
        .collect();
    let trend = MemoryTrend::of(&window(&values), &config).unwrap();
    assert!(trend.slopes.iter().all(Option::is_none));
    assert!(forecast(&trend, CAPACITY, &config).is_none());
}

// ---- The tracker: the kept window, the advisory ---------------------------

fn open(t: &mut Tracker) -> RankKey {
    kit::open(t, kit::solo_rank("job", GPU))
}

/// M a leaking rank's steps add to what it holds.
const LEAK: u64 = 8;

/// What a rank leaking [`LEAK`] M a step from step 2 on holds between
/// steps.
fn leaking_held(n: u64) -> u64 {
    2_000 + LEAK * n.saturating_sub(1)
}

/// Step `n` of the leaking rank (see `kit::leaking`), allocating `held` M
/// between steps (what a leak adds to).
fn step(t: &mut Tracker, key: &RankKey, n: u64, held: u64) -> Vec<Advisory> {
    batch_step(t, key, n, held, None)
}

/// A step's batch in [`batch_step`].
#[derive(Debug, Clone, Copy)]
struct Batch {
    /// Its tokens, said on the forward marker.
    tokens: u64,
    /// M the largest batch so far has grown the cache (reserved and NVML)
    /// by, for good.
    cache: u64,
    /// M its activations add to the allocated peak.
    activations: u64,
}

/// [`step`] with a batch on its forward marker.
fn batch_step(
    t: &mut Tracker,
    key: &RankKey,
    n: u64,
    held: u64,
    batch: Option<Batch>,
) -> Vec<Advisory> {
    let cache = batch.map_or(0, |b| b.cache);
    kit::leaking::step(t, key, (n, held, cache), |m| with_batch(m, batch))
}

/// A marker of [`kit::leaking::markers`] with `batch`'s activations in its
/// allocator figures and its tokens on the forward marker.
fn with_batch(m: Marker, batch: Option<Batch>) -> Marker {
    let activations = batch.map_or(0, |b| b.activations) * M;
    let allocator = m.allocator.map(|a| AllocatorStats {
        allocated_bytes: a.allocated_bytes
            + if m.kind == MarkerKind::BackwardBegin {
                activations
            } else {
                0
            },
        allocated_peak_bytes: a.allocated_peak_bytes + activations,
        ..a
    });
    Marker {
        wall_ns: 1_700_000_000_000_000_000 + m.monotonic_ns,
        allocator,
        batch: batch
            .filter(|_| m.kind == MarkerKind::ForwardBegin)
            .map(|b| BatchFacts {
                tokens: Some(b.tokens),
                ..Default::default()
            }),
        ..m
    }
}

/// A rank whose client says its loader's largest batch is 4096 tokens.
fn open_with_loader_of_4096_tokens(t: &mut Tracker) -> RankKey {
    let mut info = kit::solo_rank("job", GPU);
    info.model.largest_batch = Some(BatchFacts {
        tokens: Some(4_096),
        ..Default::default()
    });
    kit::open(t, info)
}

/// Step `n`'s tokens in the batch tests: 512 to 2048.
fn varying_tokens(n: u64) -> u64 {
    [512, 1_024, 2_048, 1_024, 512][n as usize % 5]
}

fn growth(advisories: &[Advisory]) -> Vec<&Advisory> {
    advisories
        .iter()
        .filter(|a| a.kind == AdvisoryKind::MemoryGrowth)
        .collect()
}

/// `total_loss += loss`: 8 M more held every step from step 2 on. The
/// advisory comes once, when the 16th step of the window (step 18) has
/// ended, with the slope and the forecast OOM step; the true OOM step is
/// where the NVML peak (held + 4000 M) passes 10000 M.
#[test]
fn a_leaking_job_is_told_once_with_its_forecast() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    let (leak, held) = (LEAK, leaking_held);
    let mut told = Vec::new();
    for n in 1..=200 {
        for a in step(&mut t, &key, n, held(n)) {
            told.push((n, a));
        }
        if held(n) + 4_000 > 10_000 {
            break;
        }
    }
    let kinds: Vec<_> = told.iter().map(|(n, a)| (*n, a.kind)).collect();
    let grown: Vec<_> = told
        .iter()
        .filter(|(_, a)| a.kind == AdvisoryKind::MemoryGrowth)
        .collect();
    assert_eq!(grown.len(), 1, "{kinds:?}");
    let (at, advisory) = grown[0];
    // Samples come with their step: the window of 16 steps 3..18 is
    // complete at step 18's end.
    assert_eq!(*at, 18, "{}", advisory.message);
    let f = t.memory_growth(&key).expect("still growing");
    assert_eq!(f.bytes_per_step, (leak * M) as f64);
    let true_oom = (1..).find(|&n| held(n) + 4_000 > 10_000).unwrap();
    let err = (f.oom_step as f64 - true_oom as f64).abs() / true_oom as f64;
    println!(
        "leak {} B/step, found {} B/step; forecast OOM step {} at step {}, true {true_oom}",
        leak * M,
        f.bytes_per_step,
        f.oom_step,
        f.last_step
    );
    assert!(err <= 0.1, "forecast {} vs {true_oom}", f.oom_step);
    kit::assert_says(
        &advisory.message,
        &["8.4 MB per step", "total_loss += loss", "at about step"],
    );
    // The trailing window's NVML max is the latest step's peak.
    let trend = t.memory_trend(&key).unwrap();
    assert_eq!(
        trend.trailing.nvml_max_bytes,
        Some((held(trend.last.step) + 4_000) * M)
    );
}

/// The same job without the leak: 300 steps, no advisory, no forecast.
#[test]
fn a_flat_job_is_never_told() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    for n in 1..=300 {
        // A little jitter of the held memory: ±2 M.
        let held = 2_000 + (n * 7919 % 5);
        let told = step(&mut t, &key, n, held);
        assert!(growth(&told).is_empty(), "step {n}: {told:?}");
    }
    assert!(t.memory_growth(&key).is_none());
    let trend = t.memory_trend(&key).unwrap();
    assert_eq!(trend.trailing.steps, 64);
    assert_eq!(trend.trailing.last_step, 300);
}

/// A curriculum: the sequence length grows every 10 steps, and each new
/// longest batch grows the cache by 100 M for good. Nothing leaks: no
/// advisory, no forecast over 200 steps (read as a leak when the slope
/// ignored batches).
#[test]
fn a_ratcheting_batch_without_a_leak_is_never_told() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    for n in 1..=200 {
        let stair = n / 10;
        let told = batch_step(
            &mut t,
            &key,
            n,
            2_000,
            Some(Batch {
                tokens: 512 * (1 + stair),
                cache: 100 * stair,
                activations: 0,
            }),
        );
        assert!(growth(&told).is_empty(), "step {n}: {told:?}");
    }
    assert!(t.memory_growth(&key).is_none());
    let nvml = *t
        .memory_trend(&key)
        .unwrap()
        .slope(GrowthSource::Nvml)
        .unwrap();
    assert_eq!(nvml.bytes_per_step, 0.0);
    assert!(nvml.blocks > 1, "{nvml:?}");
}

/// A leak of 8 M per step under batches that vary (short, long, the
/// longest now and then, which grew the cache by 600 M the first time):
/// told once, with the leak's slope and the forecast within 10% of the
/// true OOM step.
#[test]
fn a_leak_under_varying_batches_is_still_told() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    let held = leaking_held;
    let tokens = |n: u64| [1_024, 2_048, 1_024, 512, 4_096, 1_024, 2_048][n as usize % 7];
    let mut largest = 0;
    let mut cache = |n: u64| {
        largest = largest.max(tokens(n));
        match largest {
            4_096 => 600,
            2_048 => 200,
            _ => 0,
        }
    };
    let mut told = Vec::new();
    let mut true_oom = 0;
    for n in 1..=1_000 {
        let c = cache(n);
        if held(n) + c + 4_000 > 10_000 {
            true_oom = n;
            break;
        }
        let batch = Batch {
            tokens: tokens(n),
            cache: c,
            activations: 0,
        };
        let advisories = batch_step(&mut t, &key, n, held(n), Some(batch));
        told.extend(growth(&advisories).into_iter().cloned());
    }
    assert_eq!(told.len(), 1, "{told:?}");
    let f = t.memory_growth(&key).expect("still growing");
    assert_eq!(f.bytes_per_step, (LEAK * M) as f64);
    let err = (f.oom_step as f64 - true_oom as f64).abs() / true_oom as f64;
    assert!(err <= 0.1, "forecast {} vs {true_oom}", f.oom_step);
}

/// Variable lengths: a step's activations are 250 M per 512 tokens, the
/// cache holds the largest batch's, nothing leaks. The report relates the
/// peaks to the batches, names the largest batch seen with its peaks, and
/// says what the loader's largest batch (4096 tokens, twice the longest
/// seen) would need: 2048 tokens × 250/512 M more allocated, plus what
/// NVML shows beyond the reserved pool (the cache is not needed).
#[test]
fn the_batches_the_loader_may_give_are_foreseen() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open_with_loader_of_4096_tokens(&mut t);
    let tokens = varying_tokens;
    let mut largest = 0;
    for n in 1..=40 {
        largest = largest.max(tokens(n));
        let batch = Batch {
            tokens: tokens(n),
            cache: largest / 512 * 250,
            activations: tokens(n) / 512 * 250,
        };
        let told = batch_step(&mut t, &key, n, 2_000, Some(batch));
        assert!(growth(&told).is_empty(), "step {n}: {told:?}");
    }
    let b = t.step_batches(&key).expect("batches were said");
    let relation = b.relation.as_ref().unwrap();
    assert_eq!(relation.unit, BatchUnit::Tokens);
    assert_eq!((relation.smallest, relation.largest), (512, 2_048));
    assert_eq!(relation.bytes_per_unit, Some(250.0 * M as f64 / 512.0));
    let seen = b.largest.as_ref().unwrap();
    assert_eq!(seen.batch.tokens, Some(2_048));
    // held 2000 + 3000 + 1000 of activations; NVML: held + cache + 4000.
    assert_eq!(seen.allocated_peak_bytes, Some(6_000 * M));
    assert_eq!(seen.nvml_peak_bytes, Some(7_000 * M));
    assert_eq!(b.largest_headroom_bytes, Some(3_000 * M as i64));
    let o = b.outlook.as_ref().unwrap();
    assert_eq!(o.allocated_peak_bytes, 7_000 * M);
    assert_eq!(o.device_peak_bytes, Some(7_500 * M));
    assert_eq!(o.headroom_bytes, Some(2_500 * M as i64));
    assert!(!o.at_least, "the steps' peaks are pinned");
    // The spread of the step peaks: allocated 5,250 to 6,000 M.
    let trailing = t.memory_trend(&key).unwrap().trailing;
    assert_eq!(trailing.allocated_min_bytes, Some(5_250 * M));
    assert_eq!(trailing.allocated_max_bytes, Some(6_000 * M));
}

/// A rank whose client says nothing of batches has no batch report.
#[test]
fn without_batch_facts_there_is_no_batch_report() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open(&mut t);
    for n in 1..=20 {
        step(&mut t, &key, n, 2_000);
    }
    assert_eq!(t.step_batches(&key), None);
}

/// The kept window is the window a scan of the retained steps gives:
/// the last 64 completed steps from step 3 on, whatever the retention.
#[test]
fn the_kept_window_is_the_scanned_one() {
    for retained in [10, 70, 1000] {
        let mut t = Tracker::new(TrackerConfig {
            max_retained_steps: retained,
            ..TrackerConfig::default()
        });
        let key = open(&mut t);
        for n in 1..=150 {
            step(&mut t, &key, n, 2_000 + (n % 3) * n);
            let rank = t.rank(&key).unwrap();
            let mut scanned: Vec<StepFigures> = rank
                .timeline
                .steps()
                .filter(|s| s.step >= 3)
                .filter_map(StepFigures::of)
                .collect();
            let kept = t.memory_trend(&key);
            if scanned.is_empty() {
                assert!(kept.is_none());
                continue;
            }
            let from = scanned.len().saturating_sub(64);
            let scanned = scanned.split_off(from);
            let config = GrowthConfig::default();
            let expected = MemoryTrend::of(&scanned, &config).unwrap();
            let kept = kept.unwrap();
            // A short retention keeps fewer steps than the window does.
            if retained >= 70 {
                assert_eq!(kept, &expected, "step {n}");
            } else {
                assert_eq!(kept.last, expected.last, "step {n}");
            }
        }
    }
}

/// Steps of a few ms fall between the sampler's ticks: only every 8th has
/// an NVML peak, too few for an NVML slope. The forecast's level is then
/// the reserved level plus what NVML shows beyond the allocator (the
/// context), not the reserved figure alone, so the OOM step stays within
/// 10% of the true one.
#[test]
fn without_an_nvml_slope_the_level_counts_what_nvml_shows_beyond_the_allocator() {
    let config = GrowthConfig::default();
    let context = 2_000 * M;
    let leak = 20 * M;
    let mut steps = window(
        &(0..40u64)
            .map(|i| {
                let r = 1_000 * M + i * leak;
                (r - 100 * M, r, r + context)
            })
            .collect::<Vec<_>>(),
    );
    for (i, s) in steps.iter_mut().enumerate() {
        s.reserved_peak_bytes = s.reserved_at_end_bytes;
        if i % 8 != 0 {
            s.nvml_peak_bytes = None;
        }
    }
    let trend = MemoryTrend::of(&steps, &config).unwrap();
    assert!(trend.slope(GrowthSource::Nvml).is_none());
    assert_eq!(trend.nvml_over_reserved_bytes, Some(context));
    let f = forecast(&trend, CAPACITY, &config).unwrap();
    let last = trend.last.step;
    let peak_now = 1_000 * M + 39 * leak + context;
    assert_eq!(f.level_bytes, peak_now);
    let truth = last + (CAPACITY - peak_now).div_ceil(leak);
    assert!(
        (f.oom_step as f64 - truth as f64).abs() <= 0.1 * truth as f64,
        "{f:?}"
    );
}

/// Step 2's figures from a client that resets the peak counters at the
/// step's begin (`reset`) or one that never does; step 1 raised the
/// process's high-water mark to 900 M. Step 2 peaks at 500 M in its
/// backward, which no marker sees as a current figure.
fn step2_figures(reset: bool) -> StepFigures {
    use MarkerKind::*;
    let peak = |p: u64| if reset { p } else { 900 };
    let step1 = [
        (StepBegin, 50, 50),
        (ForwardBegin, 50, 50),
        (BackwardBegin, 600, 900),
        (OptimizerBegin, 100, 900),
        (OptimizerEnd, 100, 900),
        (StepEnd, 100, 900),
    ];
    let step2 = [
        (StepBegin, 100, peak(100)),
        (ForwardBegin, 100, peak(100)),
        (BackwardBegin, 400, peak(450)),
        (OptimizerBegin, 150, peak(500)),
        (OptimizerEnd, 150, peak(500)),
        (StepEnd, 120, peak(500)),
    ];
    let markers: Vec<Marker> = (step1.iter().map(|m| (1, m)))
        .chain(step2.iter().map(|m| (2, m)))
        .enumerate()
        .map(|(i, (step, &(kind, allocated, peak)))| {
            kit::marker_mib(kind, step, 1_000 + i as u64, (allocated, peak, 1_000))
        })
        .collect();
    let mut timeline = RankTimeline::new(10);
    timeline.apply_batch(&markers).unwrap();
    let step2 = timeline.steps().find(|s| s.step == 2).unwrap();
    StepFigures::of(step2).unwrap()
}

/// With the counters reset at the step's begin the rule of `profile` pins
/// the step's peak; with since-start counters it stays a lower bound.
#[test]
fn a_step_whose_counters_were_reset_at_its_begin_has_its_exact_peak() {
    let exact = step2_figures(true);
    assert_eq!(exact.allocated_peak_bytes, Some(500 * M));
    assert!(exact.allocated_peak_exact);
    let bound = step2_figures(false);
    assert_eq!(bound.allocated_peak_bytes, Some(400 * M));
    assert!(!bound.allocated_peak_exact);
}

/// Batches that vary on steps NVML never sampled (shorter than the
/// sampler's period), with 2000 M outside the allocator by the driver's
/// figures at step 1: the largest batch's device peak and the loader's
/// outlook count those 2000 M, as the forecast does (with no NVML figure
/// beyond the pool they had none).
#[test]
fn the_batch_figures_of_steps_nvml_never_sampled_count_step_1s_driver_figures() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = open_with_loader_of_4096_tokens(&mut t);
    // Step 1's reserved 5500 M and 2000 M beside it.
    let driver = DeviceMemory {
        free_bytes: CAPACITY - 7_500 * M,
        total_bytes: CAPACITY,
    };
    for n in 1..=30 {
        let batch = Batch {
            tokens: varying_tokens(n),
            cache: 0,
            activations: varying_tokens(n) / 512 * 250,
        };
        let markers = kit::leaking::markers(n, 2_000, 0, |m| Marker {
            device_memory: (n == 1).then_some(driver),
            ..with_batch(m, Some(batch))
        });
        t.markers(&key, &markers, n * kit::leaking::PERIOD).unwrap();
    }
    let b = t.step_batches(&key).expect("batches were said");
    // The largest seen, 2048 tokens: 5000 + 1000 M allocated, 5500 M reserved.
    assert_eq!(b.largest_device_peak_bytes, Some(7_500 * M));
    let o = b.outlook.expect("the loader's largest batch");
    assert_eq!(o.allocated_peak_bytes, 7_000 * M);
    assert_eq!(o.device_peak_bytes, Some(9_000 * M));
}
