//! Property tests: the step-1 prediction (and the whole rank analysis) does
//! not depend on the arrival order of samples versus markers; the allocator
//! peaks it reads are bounded soundly whether the client leaves the peak
//! counters running since process start (the Python client) or resets them at
//! every marker, and give the same prediction whenever step 1's forward and
//! backward raise the high-water mark; divergence does not depend on rank
//! order and is 0 when all ranks are equal.

use std::collections::VecDeque;

use proptest::prelude::*;
use stepwatch_core::*;
use stepwatch_testkit as kit;

const GPU: &str = "GPU-a";

fn facts_strategy() -> impl Strategy<Value = ModelFacts> {
    (
        prop::option::of(1u64..1_000_000),
        prop_oneof![
            Just(OptimizerKind::Unknown),
            Just(OptimizerKind::Adam),
            Just(OptimizerKind::SgdMomentum),
            Just(OptimizerKind::Sgd),
        ],
        prop::option::of(1u32..8),
        prop::option::of(any::<bool>()),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(count, optimizer, shard, pre, none)| ModelFacts {
            parameter_count: count,
            optimizer,
            sharding_factor: shard,
            state_precreated: pre,
            grads_set_to_none: none,
            ..Default::default()
        })
}

/// A rank's run as the properties draw it: `steps` steps of `micro`
/// micro-batches, marker gaps and allocator levels taken in turn, and NVML
/// samples at `(ns after 900, used bytes)` points.
#[derive(Debug, Clone)]
struct Run {
    steps: u64,
    micro: u32,
    gaps: Vec<u64>,
    levels: Vec<u64>,
    sample_points: Vec<(u64, u64)>,
}

impl Run {
    /// [`kit::markers_spaced`], with allocator figures drawn from `levels`
    /// when `with_alloc`.
    fn markers(&self, with_alloc: bool) -> Vec<Marker> {
        let levels = &self.levels;
        let (mut peak, mut reserved) = (0u64, 0u64);
        kit::markers_spaced(self.steps, self.micro, &self.gaps)
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let allocated = levels[i % levels.len()];
                peak = peak.max(allocated + levels[(i + 1) % levels.len()] / 2);
                reserved = reserved.max(peak + peak / 8);
                Marker {
                    allocator: with_alloc.then(|| kit::alloc_bytes(allocated, peak, reserved)),
                    ..m
                }
            })
            .collect()
    }

    fn samples(&self) -> Vec<GpuSample> {
        samples_at(&self.sample_points)
    }
}

/// Runs of `steps` steps and `micro` micro-batches, with up to
/// `max_samples` samples within `sample_span` ns.
fn run_strategy(
    steps: std::ops::Range<u64>,
    micro: std::ops::Range<u32>,
    sample_span: u64,
    max_samples: usize,
) -> impl Strategy<Value = Run> {
    (
        steps,
        micro,
        prop::collection::vec(1u64..60, 1..8),
        prop::collection::vec(0u64..50_000_000, 1..12),
        prop::collection::vec((0..sample_span, 0u64..60_000_000), 0..max_samples),
    )
        .prop_map(|(steps, micro, gaps, levels, sample_points)| Run {
            steps,
            micro,
            gaps,
            levels,
            sample_points,
        })
}

/// A rank's allocator history: `levels[k]` is the allocated bytes at marker
/// `k`, `peaks[k]` the true peak between markers `k` and `k + 1` (a phase, or
/// the gap between one step's end and the next one's begin), and `before`
/// the process's high-water mark when the first marker is taken.
struct History {
    kinds: Vec<(MarkerKind, u64, u32)>,
    levels: Vec<u64>,
    peaks: Vec<u64>,
    before: u64,
}

/// Marker kinds of `steps` steps with `micro` forward/backward pairs; levels
/// and in-phase excursions drawn from `levels` and `extras`. With `repeat`,
/// steps 3.. do exactly what step 2 did, and steps 2.. end at the level they
/// began (a steady state); without, consecutive peaks differ, so counters
/// reset at every marker pin each phase's peak.
fn history(
    steps: u64,
    micro: u32,
    levels: &[u64],
    extras: &[u64],
    before_extra: u64,
    repeat: bool,
) -> History {
    use MarkerKind::*;
    let mut kinds = Vec::new();
    for step in 1..=steps {
        kinds.push((StepBegin, step, 0));
        for mb in 0..micro {
            kinds.push((ForwardBegin, step, mb));
            kinds.push((BackwardBegin, step, mb));
        }
        kinds.push((OptimizerBegin, step, 0));
        kinds.push((OptimizerEnd, step, 0));
        kinds.push((StepEnd, step, 0));
    }
    let per_step = kinds.len() / steps as usize;
    // Index into the drawn figures: steps 3.. reuse step 2's with `repeat`.
    let draw = |k: usize| {
        if repeat && k >= 2 * per_step {
            per_step + k % per_step
        } else {
            k
        }
    };
    let mut lv: Vec<u64> = Vec::new();
    for (k, &(kind, step, _)) in kinds.iter().enumerate() {
        let level = match (kind, lv.last()) {
            // The gap between steps allocates nothing.
            (StepBegin, Some(&prev)) => prev,
            (StepEnd, _) if repeat && step >= 2 => lv[per_step - 1],
            _ => levels[draw(k) % levels.len()],
        };
        lv.push(level);
    }
    let mut peaks: Vec<u64> = Vec::new();
    let before = lv[0] + before_extra;
    for k in 0..lv.len() - 1 {
        let gap = kinds[k + 1].0 == StepBegin;
        let extra = if gap {
            0
        } else {
            extras[draw(k) % extras.len()]
        };
        let mut peak = lv[k].max(lv[k + 1]) + extra;
        if !repeat && peak == peaks.last().copied().unwrap_or(before) {
            peak += 1;
        }
        peaks.push(peak);
    }
    History {
        kinds,
        levels: lv,
        peaks,
        before,
    }
}

impl History {
    /// The markers a client sends, with the peak counters running since
    /// process start or reset at every marker.
    fn markers(&self, since_start: bool) -> Vec<Marker> {
        let mut high = self.before;
        let mut reserved = self.before;
        (0..self.kinds.len())
            .map(|k| {
                let (kind, step, mb) = self.kinds[k];
                let peak = match k.checked_sub(1).map(|j| self.peaks[j]) {
                    None => self.before,
                    Some(p) if since_start => {
                        high = high.max(p);
                        high
                    }
                    Some(p) => p,
                };
                // The cache never shrinks: reserved counters read the same
                // either way.
                reserved = reserved.max(peak + peak / 8);
                Marker {
                    micro_batch: mb,
                    allocator: Some(kit::alloc_bytes(self.levels[k], peak, reserved)),
                    ..kit::marker(kind, step, 1_000 + 100 * k as u64)
                }
            })
            .collect()
    }

    /// True peak of each step (its phases, not the gap before it).
    fn step_peaks(&self) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::new();
        for k in 0..self.peaks.len() {
            let (kind, step, _) = self.kinds[k];
            if kind == MarkerKind::StepEnd {
                continue;
            }
            if out.len() < step as usize {
                out.push(0);
            }
            out[step as usize - 1] = out[step as usize - 1].max(self.peaks[k]);
        }
        out
    }
}

#[derive(Debug, Clone)]
enum Event {
    Markers(Vec<Marker>),
    Samples(Vec<GpuSample>),
}

fn analyse(facts: &ModelFacts, events: &[Event]) -> RankAnalysis {
    let mut tracker = Tracker::new(TrackerConfig {
        max_samples_per_gpu: 100_000,
        ..Default::default()
    });
    let key = tracker
        .open(
            RankInfo {
                job: "job".into(),
                world_size: 1,
                gpu_uuid: GPU.into(),
                pid: 1,
                model: facts.clone(),
                ..Default::default()
            },
            0,
        )
        .unwrap();
    tracker.set_gpu_processes(GPU, &[(1, 10), (2, 1_000)]);
    for e in events {
        match e {
            Event::Markers(ms) => {
                tracker.markers(&key, ms, 0).unwrap();
            }
            Event::Samples(ss) => tracker.gpu_samples(GPU, ss),
        }
    }
    tracker.rank_analysis(&key).unwrap()
}

fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// The analysis as it would be had no warning been given before: an upheld
/// warning's flags and sentence are taken back out (the only part of a
/// prediction that depends on the advisories' history).
fn without_upheld_warning(mut analysis: RankAnalysis) -> RankAnalysis {
    if let Some(p) = analysis.prediction.as_mut() {
        match p.warning_revision.take() {
            Some(WarningRevision::UpheldUntilMeasured) => {
                let h = p.headroom_bytes.unwrap_or(0);
                p.oom_risk = h < 0;
                p.low_headroom = (h as f64) < 0.05 * p.inputs.capacity_bytes as f64;
                if let Some(at) = p
                    .explanation
                    .find("; the step-2 OOM warning given earlier stands")
                {
                    p.explanation.truncate(at);
                }
            }
            Some(WarningRevision::WithdrawnOnMeasurement) => {
                if let Some(at) = p.explanation.find("; withdraws the step-2 OOM warning") {
                    p.explanation.truncate(at);
                }
            }
            None => {}
        }
    }
    analysis
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn prediction_does_not_depend_on_arrival_order(
        run in run_strategy(1..3, 1..4, 1_500, 120),
        with_alloc in any::<bool>(),
        cut_frac in 0.1f64..1.0,
        marker_chunk in 1usize..5,
        sample_chunk in 1usize..16,
        seed in any::<u64>(),
        facts in facts_strategy(),
    ) {
        let all = run.markers(with_alloc);
        // Cut the stream anywhere: step 1 may still be running.
        let cut = ((all.len() as f64 * cut_frac).ceil() as usize).clamp(1, all.len());
        let ms = &all[..cut];
        let mut next = xorshift(seed);
        let mut samples = run.samples();
        // Samples may arrive in any order, in any batches.
        for i in (1..samples.len()).rev() {
            let j = (next() % (i as u64 + 1)) as usize;
            samples.swap(i, j);
        }
        let mut queues: [VecDeque<Event>; 2] = [
            ms.chunks(marker_chunk).map(|c| Event::Markers(c.to_vec())).collect(),
            samples.chunks(sample_chunk).map(|c| Event::Samples(c.to_vec())).collect(),
        ];
        let mut shuffled = Vec::new();
        while queues.iter().any(|q| !q.is_empty()) {
            let live: Vec<usize> = (0..2).filter(|&i| !queues[i].is_empty()).collect();
            let pick = live[(next() % live.len() as u64) as usize];
            shuffled.push(queues[pick].pop_front().unwrap());
        }
        let markers_first = [Event::Markers(ms.to_vec()), Event::Samples(samples.clone())];
        let samples_first = [Event::Samples(samples.clone()), Event::Markers(ms.to_vec())];

        let a = analyse(&facts, &shuffled);
        let b = analyse(&facts, &markers_first);
        let c = analyse(&facts, &samples_first);
        // The figures never depend on the order. Whether a step-2 OOM
        // warning still stands may: a warning given on an early estimate is
        // upheld until a measurement withdraws it (#10 item 4), and which
        // estimates were seen depends on how markers and samples interleaved.
        let (a, b, c) = (without_upheld_warning(a), without_upheld_warning(b), without_upheld_warning(c));
        prop_assert_eq!(&a.prediction, &b.prediction);
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(&b, &c);
        // Other processes are subtracted once: headroom is capacity minus the
        // device peak, which includes them, as documented.
        if let Some(p) = &a.prediction {
            prop_assert_eq!(p.inputs.other_process_bytes, 1_000);
            prop_assert_eq!(
                p.predicted_rank_peak_bytes,
                p.predicted_peak_bytes.saturating_sub(1_000)
            );
            if let Some(h) = p.headroom_bytes {
                prop_assert_eq!(h, 80_000_000 - p.predicted_peak_bytes as i64);
                prop_assert_eq!(p.oom_risk, h < 0);
                prop_assert_eq!(p.warning_revision, None);
            }
        }
    }

    #[test]
    fn since_start_peak_counters_bound_the_peaks_and_give_the_same_prediction(
        micro in 1u32..4,
        levels in prop::collection::vec(1_000u64..50_000_000, 2..16),
        extras in prop::collection::vec(0u64..20_000_000, 1..16),
        before_extra in prop_oneof![Just(0u64), 0u64..60_000_000],
        capacity in 10_000_000u64..120_000_000,
        facts in facts_strategy(),
    ) {
        let h = history(1, micro, &levels, &extras, before_extra, false);
        let sample = GpuSample { monotonic_ns: 900, used_bytes: h.before, capacity_bytes: capacity };
        let run = |since_start: bool| {
            analyse(&facts, &[
                Event::Samples(vec![sample]),
                Event::Markers(h.markers(since_start)),
            ])
        };
        let (since, reset) = (run(true), run(false));
        // Each phase's true peak lies within the since-start bounds.
        let first = since.first_step.as_ref().unwrap();
        for kind in PhaseKind::ALL {
            let truth = (0..h.peaks.len())
                .filter(|&k| h.kinds[k].0.opens() == Some(kind))
                .map(|k| h.peaks[k])
                .max();
            let Some(truth) = truth else { continue };
            let b = first.phase(kind).unwrap().peaks.allocated_bounds().unwrap();
            prop_assert!(b.at_least <= truth, "{:?}: {:?} vs {}", kind, b, truth);
            prop_assert!(b.at_most.is_none_or(|m| truth <= m), "{:?}: {:?} vs {}", kind, b, truth);
        }
        // Counters reset at every marker pin every peak: the prediction from
        // them is the true one, and since-start counters bound it.
        let (p, q) = (reset.prediction.unwrap(), since.prediction.unwrap());
        prop_assert!(q.inputs.basis_peak_bytes <= p.inputs.basis_peak_bytes);
        let most = q.inputs.basis_peak_at_most_bytes.unwrap();
        prop_assert!(p.inputs.basis_peak_bytes <= most);
        // When step 1's first forward/backward peaks above every mark set
        // before it (before the step, or by its prologue), nothing is hidden.
        let first_group = h.peaks[1].max(h.peaks[2]);
        let tight = most == q.inputs.basis_peak_bytes;
        if first_group > h.before.max(h.peaks[0]) {
            prop_assert!(tight, "{}", q.explanation);
        }
        if tight {
            prop_assert_eq!(q.inputs.basis_peak_bytes, p.inputs.basis_peak_bytes);
            prop_assert_eq!(q.predicted_peak_bytes, p.predicted_peak_bytes);
            prop_assert_eq!(q.headroom_bytes, p.headroom_bytes);
            prop_assert_eq!((q.oom_risk, q.low_headroom), (p.oom_risk, p.low_headroom));
        } else {
            prop_assert!(q.explanation.contains(&format!("at most {}", stepwatch_core::gb(most as f64))), "{}", q.explanation);
        }
    }

    #[test]
    fn since_start_peak_counters_give_the_steady_peak_of_repeated_steps(
        steps in 3u64..7,
        micro in 1u32..3,
        levels in prop::collection::vec(1_000u64..50_000_000, 2..16),
        extras in prop::collection::vec(0u64..20_000_000, 1..16),
        before_extra in prop_oneof![Just(0u64), 0u64..60_000_000],
    ) {
        let h = history(steps, micro, &levels, &extras, before_extra, true);
        let since = analyse(&ModelFacts::default(), &[Event::Markers(h.markers(true))]);
        let s = since.steady.unwrap();
        let peaks = h.step_peaks();
        // Steps 2.. repeat, so the true steady peak is step 2's. Since-start
        // counters bound it, and give it when step 2 raised the process's
        // high-water mark (the optimizer state of step 1 on top of step 1's
        // activations, say).
        prop_assert!(peaks[1..].iter().all(|&p| p == peaks[1]));
        let most = s.peaks.allocated_peak_at_most_bytes.unwrap();
        let figure = s.peaks.allocated_peak_bytes.unwrap();
        prop_assert!(peaks[1] <= most && figure <= most);
        if peaks[1] > h.before.max(peaks[0]) {
            prop_assert_eq!((figure, most), (peaks[1], peaks[1]));
        }
        // Per phase kind, the true peak is within the bounds too.
        for sp in &s.phases {
            let truth = (0..h.peaks.len())
                .filter(|&k| h.kinds[k].1 == 2 && h.kinds[k].0.opens() == Some(sp.phase))
                .map(|k| h.peaks[k])
                .max()
                .unwrap();
            prop_assert!(truth <= sp.peaks.allocated_peak_at_most_bytes.unwrap());
            prop_assert!(sp.peaks.allocated_peak_bytes.unwrap() <= sp.peaks.allocated_peak_at_most_bytes.unwrap());
        }
    }

    #[test]
    fn divergence_is_invariant_to_rank_order(
        values in prop::collection::vec(
            (prop::option::of(0u64..1_000_000), prop::option::of(0u64..1_000_000), prop::option::of(1u64..10_000)),
            1..10,
        ),
        seed in any::<u64>(),
        threshold in 0.0f64..0.5,
    ) {
        let figures: Vec<RankFigures> = values
            .iter()
            .enumerate()
            .map(|(rank, &(nvml, alloc, dur))| RankFigures {
                rank: rank as u32,
                nvml_peak_bytes: nvml,
                allocated_peak_bytes: alloc,
                duration_ns: dur,
                ..Default::default()
            })
            .collect();
        let mut shuffled = figures.clone();
        let mut next = xorshift(seed);
        for i in (1..shuffled.len()).rev() {
            let j = (next() % (i as u64 + 1)) as usize;
            shuffled.swap(i, j);
        }
        let d = divergence("job", &figures, threshold).unwrap();
        prop_assert_eq!(&d, &divergence("job", &shuffled, threshold).unwrap());

        // Reassigning the figures to other ranks keeps the spread.
        let relabelled: Vec<RankFigures> = shuffled
            .iter()
            .enumerate()
            .map(|(rank, f)| RankFigures { rank: rank as u32, ..*f })
            .collect();
        let r = divergence("job", &relabelled, threshold).unwrap();
        for (x, y) in [(&d.peak, &r.peak), (&d.duration, &r.duration)] {
            prop_assert_eq!(x.is_some(), y.is_some());
            if let (Some(x), Some(y)) = (x, y) {
                prop_assert_eq!((x.ranks, x.min, x.max), (y.ranks, y.min, y.max));
                prop_assert_eq!(x.median, y.median);
                prop_assert_eq!(x.spread, y.spread);
                prop_assert_eq!(x.outliers.len(), y.outliers.len());
                prop_assert!(x.spread >= 0.0);
            }
        }
    }

    #[test]
    fn divergence_is_zero_when_ranks_are_equal(
        ranks in 1usize..10,
        peak in 0u64..1_000_000_000,
        dur in 0u64..1_000_000,
        threshold in 0.0f64..0.5,
    ) {
        let figures: Vec<RankFigures> = (0..ranks)
            .map(|r| RankFigures {
                rank: r as u32,
                nvml_peak_bytes: Some(peak),
                allocated_peak_bytes: None,
                duration_ns: Some(dur),
                ..Default::default()
            })
            .collect();
        let d = divergence("job", &figures, threshold).unwrap();
        for s in [d.peak.unwrap(), d.duration.unwrap()] {
            prop_assert_eq!(s.spread, 0.0);
            prop_assert!(s.outliers.is_empty());
            prop_assert_eq!(s.ranks, ranks);
        }
    }
}

/// A tracker with one rank on GPU, keeping every sample, under `config`.
fn one_rank_tracker(config: AnalysisConfig) -> (Tracker, RankKey) {
    let mut tracker = Tracker::new(TrackerConfig {
        max_samples_per_gpu: 100_000,
        ..Default::default()
    });
    tracker.set_analysis_config(config);
    let key = kit::open(&mut tracker, kit::solo_rank("job", GPU));
    (tracker, key)
}

/// Samples of GPU at (time after 900 ns, used bytes), on an 80 MB GPU.
fn samples_at(points: &[(u64, u64)]) -> Vec<GpuSample> {
    points
        .iter()
        .map(|&(t, used)| GpuSample {
            monotonic_ns: 900 + t,
            used_bytes: used,
            capacity_bytes: 80_000_000,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// The low-observed-headroom advisory reads the steady NVML peak on
    /// every marker batch through `steady_nvml_peak` (step peaks only); the
    /// metric and the alert read `steady_profile`. They must be one figure,
    /// over one window, for any window, minimum, steps and samples.
    #[test]
    fn the_cheap_steady_nvml_peak_is_the_steady_profiles(
        run in run_strategy(1..15, 1..3, 7_000, 200),
        steady_window in 1usize..12,
        min_steady_steps in 1usize..4,
    ) {
        let (mut tracker, key) = one_rank_tracker(AnalysisConfig::default());
        tracker.gpu_samples(GPU, &run.samples());
        tracker.markers(&key, &run.markers(true), 0).unwrap();
        let config = AnalysisConfig { steady_window, min_steady_steps, ..Default::default() };
        let timeline = &tracker.rank(&key).unwrap().timeline;
        let full = steady_profile(timeline, &config);
        let cheap = steady_nvml_peak(timeline, &config);
        prop_assert_eq!(cheap.map(|c| c.peak_bytes), full.as_ref().and_then(|f| f.nvml_peak_bytes));
        if let (Some(c), Some(f)) = (cheap, full) {
            prop_assert_eq!(c.steps, f.steps.len());
            prop_assert_eq!(Some(c.first_step), f.steps.first().copied());
            prop_assert_eq!(Some(c.last_step), f.steps.last().copied());
            let first = timeline.steps().find(|s| s.step == c.first_step).unwrap();
            prop_assert_eq!(c.first_step_peak_bytes, StepProfile::of(first).nvml_peak_bytes);
        }
    }

    /// The tracker keeps each rank's steady profile between reads; whatever
    /// order markers and samples (late ones included) arrive in, the kept
    /// profile is the one computed afresh from the timeline.
    #[test]
    fn the_kept_steady_profile_is_the_fresh_one(
        run in run_strategy(1..16, 1..3, 9_000, 200),
        batch in 1usize..9,
        steady_window in 1usize..12,
    ) {
        let config = AnalysisConfig { steady_window, ..Default::default() };
        let (mut tracker, key) = one_rank_tracker(config);
        let samples = run.samples();
        let all = run.markers(true);
        let mut fed = 0;
        for chunk in all.chunks(batch) {
            tracker.markers(&key, chunk, 0).unwrap();
            // The samples up to the latest marker, some after it (late).
            let until = chunk.last().unwrap().monotonic_ns;
            let due: Vec<GpuSample> = samples[fed..].iter().take_while(|s| s.monotonic_ns <= until).copied().collect();
            fed += due.len();
            tracker.gpu_samples(GPU, &due);
            let kept = tracker.rank_analysis(&key).unwrap().steady;
            let fresh = steady_profile(&tracker.rank(&key).unwrap().timeline, &config);
            prop_assert_eq!(kept, fresh);
        }
        tracker.gpu_samples(GPU, &samples[fed..]);
        let kept = tracker.rank_analysis(&key).unwrap().steady;
        let fresh = steady_profile(&tracker.rank(&key).unwrap().timeline, &config);
        prop_assert_eq!(kept, fresh);
    }
}
