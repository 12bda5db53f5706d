//! Advisories: what the agent tells a training process about itself.
//!
//! The important one is raised during step 1: "the predicted steady-state
//! peak exceeds capacity; step 2 will likely run out of memory". Deciding
//! when an advisory is due is part of the model (pure and testable); sending
//! it is the ingest adapter's job.
//!
//! Rules:
//! * step-2 OOM predicted / low headroom: once per kind while the rank is in
//!   its first step, and again whenever the predicted peak has grown by at
//!   least [`WORSENED_FRACTION`] of capacity (1%) since the last advisory of
//!   that kind, so the message a person reads follows the prediction;
//! * rank divergence: once per figure ([`DivergenceFigure`]) per rank
//!   timeline, to the outlier rank itself, when it is named (see
//!   `divergence`);
//! * allocator retries: once per rank and run, at the first marker of a
//!   step ≥ 2 whose `num_alloc_retries` grew (see [`retries_due`]);
//! * low observed headroom: once per rank and run, after the first marker
//!   batch where the measured steady peak leaves under the low-headroom fraction
//!   of capacity, unless the run was already told LOW_HEADROOM or
//!   STEP2_OOM_PREDICTED (see [`observed_headroom_due`]);
//! * memory growth: once per rank and run, after the first marker batch
//!   where a figure taken at the same point of every step grows (see
//!   `growth`), with the step and time at which the GPU will be full (see
//!   [`growth_due`]).
//!
//! Sizes are written in decimal GB (10^9 bytes), with two decimals, as in
//! the proto's example.

use serde::{Deserialize, Serialize};

use crate::analysis::SteadyNvmlPeak;
use crate::divergence::{Divergence, DivergenceFigure, NamedOutlier, PeakSource};
use crate::growth::{GrowthForecast, GrowthSource, MemoryTrend};
use crate::marker::{Marker, MarkerKind};
use crate::predict::{Prediction, PredictionBasis};
use crate::units::gb;

/// An advisory is sent again when the predicted peak grew by this fraction
/// of capacity since the last one of its kind: small refinements of a
/// provisional prediction do not repeat it, a real change does.
pub const WORSENED_FRACTION: f64 = 0.01;

/// What an advisory is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvisoryKind {
    /// The predicted steady-state peak does not fit on the GPU.
    Step2OomPredicted,
    /// It fits, with less than the low-headroom fraction to spare.
    LowHeadroom,
    /// The rank's memory figure is far from its peers' on this node.
    RankDivergence,
    /// After step 1, PyTorch's caching allocator had to free its cache and
    /// retry a `cudaMalloc`: the job runs at the GPU's limit.
    AllocatorRetries,
    /// The steps after the first, as measured (the steady NVML peak), leave
    /// less than the low-headroom fraction of capacity: the job runs closer
    /// to the limit than step 1 showed.
    LowObservedHeadroom,
    /// Memory at the same point of every step grows after step 2, at a
    /// rate that reaches the GPU's capacity: a leak, a cache, or
    /// fragmentation that ratchets up.
    MemoryGrowth,
    /// The client's monotonic clock disagrees with the agent's (see
    /// `clock`): far from it, or one batch jumped ahead and was refused.
    ClientClock,
    /// Step 1 has ended: its prediction is final (informational; a client
    /// holding step 2 for the prediction stops waiting).
    PredictionFinal,
}

/// One advisory, as issued.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Advisory {
    /// Decides the wording and whether it is already issued (one per kind).
    pub kind: AdvisoryKind,
    /// The step during which it was issued.
    pub step: u64,
    /// When it was issued (the caller's clock, CLOCK_MONOTONIC in the agent).
    pub issued_monotonic_ns: u64,
    /// Predicted steady-state peak as NVML will see it, bytes.
    pub predicted_peak_bytes: u64,
    /// GPU capacity the peak was compared with, bytes.
    pub capacity_bytes: u64,
    /// Capacity minus predicted peak, bytes; negative means step 2 will not fit.
    pub predicted_headroom_bytes: i64,
    /// A sentence a person understands.
    pub message: String,
    /// For a rank-divergence advisory: the figure the rank is named for.
    #[serde(default)]
    pub divergence: Option<NamedOutlier>,
}

impl Advisory {
    /// An advisory that reports what was seen, not a prediction: its
    /// prediction fields stay 0.
    pub(crate) fn observation(kind: AdvisoryKind, step: u64, now_ns: u64, message: String) -> Self {
        Self {
            kind,
            step,
            issued_monotonic_ns: now_ns,
            predicted_peak_bytes: 0,
            capacity_bytes: 0,
            predicted_headroom_bytes: 0,
            message,
            divergence: None,
        }
    }
}

/// The advisories `prediction` calls for that are not in `issued` yet.
/// The caller calls this only while the rank is in its first step: after
/// that, the steps speak for themselves. Each kind is issued once, and again
/// when the predicted peak has grown by [`WORSENED_FRACTION`] of capacity
/// since the last advisory of that kind.
pub fn due(
    prediction: &Prediction,
    capacity_bytes: u64,
    step: u64,
    now_ns: u64,
    issued: &[Advisory],
) -> Vec<Advisory> {
    let Some(headroom) = prediction.headroom_bytes else {
        return Vec::new();
    };
    let kind = if prediction.oom_risk {
        AdvisoryKind::Step2OomPredicted
    } else if prediction.low_headroom {
        AdvisoryKind::LowHeadroom
    } else {
        return Vec::new();
    };
    let margin = WORSENED_FRACTION * capacity_bytes as f64;
    if let Some(last) = issued.iter().rev().find(|a| a.kind == kind) {
        let grew = prediction.predicted_peak_bytes as f64 - last.predicted_peak_bytes as f64;
        if grew < margin {
            return Vec::new();
        }
    }
    let peak = prediction.predicted_peak_bytes as f64;
    let capacity = capacity_bytes as f64;
    let message = match kind {
        // A reserved need cut to the limit warns at headroom ≥ 0 (see
        // `predict_with_layout`): say why, not that the peak exceeds capacity.
        AdvisoryKind::Step2OomPredicted
            if headroom >= 0
                && prediction
                    .inputs
                    .layout
                    .layout_snapshots
                    .is_some_and(|l| l.capped_at_reserved_limit) =>
        {
            let mut m = format!(
                "step 2 needs more cached GPU memory than {} leaves (new segments for the \
                 blocks step 1's optimizer state took, cut at the limit, predicted peak {}); \
                 PyTorch will free its cache and retry, and step 2 may still run out of GPU \
                 memory",
                gb(capacity),
                gb(peak),
            );
            m.push_str(&what_would_fit_words(prediction));
            m
        }
        AdvisoryKind::Step2OomPredicted => {
            let mut m = format!(
                "predicted steady-state peak {} exceeds capacity {} by {}; step 2 will likely \
                 run out of GPU memory",
                gb(peak),
                gb(capacity),
                gb(-(headroom as f64)),
            );
            m.push_str(&what_would_fit_words(prediction));
            m
        }
        AdvisoryKind::LowHeadroom => format!(
            "predicted steady-state peak {} leaves only {} ({:.1}%) of {} free; step 2 may run \
             out of memory if anything else allocates",
            gb(peak),
            gb(headroom as f64),
            100.0 * headroom as f64 / capacity_bytes.max(1) as f64,
            gb(capacity),
        ),
        AdvisoryKind::RankDivergence
        | AdvisoryKind::AllocatorRetries
        | AdvisoryKind::LowObservedHeadroom
        | AdvisoryKind::MemoryGrowth
        | AdvisoryKind::ClientClock
        | AdvisoryKind::PredictionFinal => {
            unreachable!("not a prediction advisory")
        }
    };
    let message = match &prediction.inputs.batch_revision {
        Some(r) => format!(
            "{message} (revised at step 2's first forward: {} {unit} where step 1 took {}, \
             a smaller warm-up batch)",
            r.step2_size,
            r.step1_size,
            unit = r.unit.as_str(),
        ),
        None => message,
    };
    vec![Advisory {
        kind,
        step,
        issued_monotonic_ns: now_ns,
        predicted_peak_bytes: prediction.predicted_peak_bytes,
        capacity_bytes,
        predicted_headroom_bytes: headroom,
        message,
        divergence: None,
    }]
}

/// The advice part of a step-2 OOM message: what would fit, when the
/// prediction knows it, else the generic remedies.
fn what_would_fit_words(prediction: &Prediction) -> String {
    let fit = prediction.what_would_fit.as_ref();
    let mut options = Vec::new();
    if let Some(f) = fit {
        if let (Some(m), Some(current)) = (f.fits_with_micro_batch_size, f.micro_batch_size) {
            options.push(format!("a micro-batch of {m} instead of {current}"));
        }
        if let Some(s) = f.fits_with_sharding_factor {
            options.push(format!(
                "optimizer state sharded over {s} ranks (ZeRO-1 / FSDP)"
            ));
        }
    }
    if options.is_empty() {
        let mut m = String::from(
            " (lower the micro-batch, enable activation recomputation, or shard optimizer state)",
        );
        if let Some(f) = fit {
            if f.micro_batch_size.is_some() && f.fits_with_micro_batch_size.is_none() {
                m.push_str("; even a micro-batch of 1 is predicted not to fit");
            }
        }
        return m;
    }
    format!("; predicted to fit: {}", options.join(", or "))
}

/// Whether `issued` holds an advisory of `kind`: the ones given once per
/// rank and run.
pub(crate) fn already_issued(issued: &[Advisory], kind: AdvisoryKind) -> bool {
    issued.iter().any(|a| a.kind == kind)
}

/// An observation of `kind` with the message `message` makes, unless
/// `issued` holds one: once per rank and run.
fn observed_once(
    kind: AdvisoryKind,
    step: u64,
    now_ns: u64,
    issued: &[Advisory],
    message: impl FnOnce() -> String,
) -> Option<Advisory> {
    (!already_issued(issued, kind)).then(|| Advisory::observation(kind, step, now_ns, message()))
}

/// The prediction-final advisory, once per rank and run, when step 1 has
/// ended (the caller checks that, before step 2's first marker is applied):
/// the prediction as it stands then, after any step-2 OOM or low-headroom
/// advisory it called for, or word that step 1 left nothing to predict from
/// (figures 0).
pub fn final_due(
    prediction: Option<&Prediction>,
    capacity_bytes: u64,
    step: u64,
    now_ns: u64,
    issued: &[Advisory],
) -> Option<Advisory> {
    if already_issued(issued, AdvisoryKind::PredictionFinal) {
        return None;
    }
    let (peak, headroom, message) = match prediction {
        Some(p) => {
            let verdict = if p.oom_risk {
                "step 2 will likely run out of GPU memory"
            } else if p.headroom_bytes.is_none() {
                "the GPU's capacity is unknown"
            } else if p.low_headroom {
                "step 2 is predicted to fit, with little to spare"
            } else {
                "step 2 is predicted to fit"
            };
            let mut m = format!(
                "step {step}'s prediction is final: steady-state peak {}",
                gb(p.predicted_peak_bytes as f64)
            );
            if let Some(h) = p.headroom_bytes {
                let _ = std::fmt::Write::write_fmt(
                    &mut m,
                    format_args!(
                        " of {}, headroom {}",
                        gb(capacity_bytes as f64),
                        gb(h as f64)
                    ),
                );
            }
            m.push_str("; ");
            m.push_str(verdict);
            (p.predicted_peak_bytes, p.headroom_bytes.unwrap_or(0), m)
        }
        None => (
            0,
            0,
            format!(
                "step {step} ended without what a prediction needs (a forward or backward \
                 with allocator figures or GPU samples); no step-2 prediction for this run"
            ),
        ),
    };
    Some(Advisory {
        kind: AdvisoryKind::PredictionFinal,
        step,
        issued_monotonic_ns: now_ns,
        predicted_peak_bytes: peak,
        capacity_bytes,
        predicted_headroom_bytes: headroom,
        message,
        divergence: None,
    })
}

/// The rank-divergence advisories due to `rank` from its job's divergence:
/// one per figure the rank is named for and has not been advised of yet.
/// Severity is a warning: ranks differ for real reasons too.
pub fn divergence_due(
    divergence: &Divergence,
    rank: u32,
    step: u64,
    now_ns: u64,
    issued: &[Advisory],
) -> Vec<Advisory> {
    divergence
        .named
        .iter()
        .filter(|n| n.rank == rank)
        .filter(|n| {
            !issued.iter().any(|a| {
                a.kind == AdvisoryKind::RankDivergence
                    && a.divergence.as_ref().map(|d| d.figure) == Some(n.figure)
            })
        })
        .map(|n| Advisory {
            divergence: Some(n.clone()),
            ..Advisory::observation(
                AdvisoryKind::RankDivergence,
                step,
                now_ns,
                divergence_message(n),
            )
        })
        .collect()
}

fn divergence_message(n: &NamedOutlier) -> String {
    let source = match n.source {
        PeakSource::Nvml => "device memory (NVML)",
        PeakSource::Allocated => "allocated memory",
    };
    let hint = match n.figure {
        DivergenceFigure::ActivationPeak => {
            "; a different micro-batch, sequence length or model shard on this rank?"
        }
        _ => "; a pipeline stage, uneven shard or another process on this GPU?",
    };
    format!(
        "rank {}: its {} of {} is {:.1}% {} the median {} of the job's {} ranks on this node, \
         in {source}{hint}",
        n.rank,
        n.figure.describe(),
        gb(n.value_bytes as f64),
        100.0 * n.deviation.abs(),
        if n.deviation >= 0.0 { "above" } else { "below" },
        gb(n.median_bytes),
        n.ranks,
    )
}

/// The first step whose allocator retries are advised of. Step 1's are
/// not: step 1 builds the allocator's cache, and a flush there already
/// shapes what the step-2 prediction rests on (its reserved figures are
/// measured after the flush, the allocator replay models the same release
/// within the GPU's limit), so a step 1 at the limit is told by the
/// step-2 OOM or low-headroom advisory. After step 1 nothing else watches:
/// the prediction is frozen, and a job whose memory creeps up or fragments
/// reaches the limit unannounced.
pub const FIRST_RETRY_STEP: u64 = 2;

/// Growth of the client's `num_alloc_retries` seen in one batch of markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryGrowth {
    /// The step of the first marker (from [`FIRST_RETRY_STEP`] on) whose
    /// count grew.
    pub step: u64,
    /// Retries the batch's markers of steps ≥ [`FIRST_RETRY_STEP`] added.
    pub retries: u64,
    /// The client's count at the batch's last marker with allocator figures.
    pub total: u64,
}

/// Follows the client's `num_alloc_retries` through a batch. `seen` is the
/// count at the rank's last marker with allocator figures (None before
/// the first); returns the count after the batch and the growth in steps
/// ≥ [`FIRST_RETRY_STEP`], if any. A marker's growth is counted in its
/// own step (retries between step 1's end and step 2's begin are step
/// 2's). Growth shown first by an OOM marker is not counted: PyTorch
/// retries the allocation that then fails, so every OOM carries one, and
/// the OOM speaks for itself (on real PyTorch, fake CUDA: every kept
/// step-2 OOM run). The count is PyTorch's since the process started: a drop
/// (`torch.cuda.reset_accumulated_memory_stats`) starts it afresh, and
/// the first count seen is a baseline, never growth (a client that
/// connects late, or a rank restored without its count).
pub fn retry_growth(seen: Option<u64>, markers: &[Marker]) -> (Option<u64>, Option<RetryGrowth>) {
    let mut last = seen;
    let mut growth: Option<RetryGrowth> = None;
    for m in markers {
        let Some(now) = m.allocator.map(|a| a.num_alloc_retries) else {
            continue;
        };
        let added = last.map_or(0, |l| now.saturating_sub(l));
        last = Some(now);
        if added == 0 || m.step < FIRST_RETRY_STEP || m.kind == MarkerKind::Oom {
            continue;
        }
        let g = growth.get_or_insert(RetryGrowth {
            step: m.step,
            retries: 0,
            total: 0,
        });
        g.retries += added;
    }
    if let Some(g) = growth.as_mut() {
        g.total = last.unwrap_or(0);
    }
    (last, growth)
}

/// The allocator-retries advisory due for `growth`: once per rank and run
/// (none when `issued` holds one), a warning. `frozen` is the prediction
/// made before step 2, quoted so the person can compare. The prediction
/// fields stay 0: it is an observation, not a prediction.
pub fn retries_due(
    growth: RetryGrowth,
    frozen: Option<&Prediction>,
    now_ns: u64,
    issued: &[Advisory],
) -> Option<Advisory> {
    observed_once(
        AdvisoryKind::AllocatorRetries,
        growth.step,
        now_ns,
        issued,
        || retries_message(growth, frozen),
    )
}

fn retries_message(growth: RetryGrowth, frozen: Option<&Prediction>) -> String {
    let RetryGrowth {
        step,
        retries,
        total,
    } = growth;
    let times = if retries == 1 { "time" } else { "times" };
    let mut m = format!(
        "in step {step} PyTorch's caching allocator ran out of GPU memory and had to free its \
         cache and retry {retries} {times} ({total} since the process started): the job is \
         running at the GPU's memory limit; each retry costs a full cache flush (slow), and \
         the next larger allocation may fail with an out-of-memory error. Set \
         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation) or use a \
         smaller micro-batch"
    );
    match frozen {
        Some(p) if p.inputs.capacity_bytes > 0 => m.push_str(&format!(
            "; before step 2 stepwatch predicted a steady peak of {} of the GPU's {}",
            gb(p.predicted_peak_bytes as f64),
            gb(p.inputs.capacity_bytes as f64),
        )),
        _ => {}
    }
    m
}

/// The steady peak as measured after step 1, for [`observed_headroom_due`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObservedPeak {
    /// The step of the batch that made the check; the advisory's step.
    pub step: u64,
    /// The steady NVML peak (`stepwatch_rank_steady_step_peak_bytes`:
    /// device memory, other processes included), the steps it is the
    /// median of (normally from step 2), and the first one's own peak, to
    /// say whether memory grew after it.
    pub steady: SteadyNvmlPeak,
    /// What processes can use on the GPU (total less the driver's reserve),
    /// as the prediction uses it, bytes; 0 when unknown.
    pub capacity_bytes: u64,
}

/// Whether a run with `issued` advisories may still get the low observed
/// headroom advisory: not once it has one, nor after LOW_HEADROOM or
/// STEP2_OOM_PREDICTED (the person was warned already). The tracker asks
/// this before it computes the steady profile.
pub fn observed_headroom_open(issued: &[Advisory]) -> bool {
    !issued.iter().any(|a| {
        matches!(
            a.kind,
            AdvisoryKind::LowObservedHeadroom
                | AdvisoryKind::LowHeadroom
                | AdvisoryKind::Step2OomPredicted
        )
    })
}

/// The low-observed-headroom advisory due for `observed`: when capacity is
/// known and the steady peak leaves less than `low_headroom_fraction` of it
/// (the prediction's threshold, so both advisories mean the same "low"),
/// once per rank and run (`observed_headroom_open`), a warning. `frozen`
/// is the prediction made before step 2, quoted so the person sees what
/// step 1 could not show. The prediction fields stay 0: it is an
/// observation, not a prediction.
pub fn observed_headroom_due(
    observed: ObservedPeak,
    low_headroom_fraction: f64,
    frozen: Option<&Prediction>,
    now_ns: u64,
    issued: &[Advisory],
) -> Option<Advisory> {
    let capacity = observed.capacity_bytes;
    if capacity == 0 || !observed_headroom_open(issued) {
        return None;
    }
    let spare = capacity as f64 - observed.steady.peak_bytes as f64;
    if spare >= low_headroom_fraction * capacity as f64 {
        return None;
    }
    Some(Advisory::observation(
        AdvisoryKind::LowObservedHeadroom,
        observed.step,
        now_ns,
        observed_headroom_message(observed, frozen),
    ))
}

/// "(1.5% to spare)" of `capacity` at `peak`; "(nothing to spare)" at or
/// past it.
fn to_spare(peak: f64, capacity: f64) -> String {
    let pct = 100.0 * (capacity - peak) / capacity.max(1.0);
    if pct > 0.0 {
        format!("({pct:.1}% to spare)")
    } else {
        "(nothing to spare)".to_string()
    }
}

fn observed_headroom_message(o: ObservedPeak, frozen: Option<&Prediction>) -> String {
    let capacity = o.capacity_bytes as f64;
    let o = o.steady;
    let peak = o.peak_bytes as f64;
    let steps = if o.last_step == o.first_step {
        format!("step {}", o.first_step)
    } else if o.last_step - o.first_step + 1 == o.steps as u64 {
        format!("steps {}–{}", o.first_step, o.last_step)
    } else {
        format!("{} steps from {} to {}", o.steps, o.first_step, o.last_step)
    };
    let mut m = format!(
        "{steps} peak at {} of {} usable on the GPU {}",
        gb(peak),
        gb(capacity),
        to_spare(peak, capacity),
    );
    // Growth after the first of them is what step 1 could not show; under
    // 1% of capacity it is noise between samples, not worth a clause.
    if let Some(first) = o.first_step_peak_bytes.filter(|_| o.steps > 1) {
        if peak - first as f64 >= WORSENED_FRACTION * capacity {
            m.push_str(&format!(
                "; memory grew after step {}, which peaked at {}",
                o.first_step,
                gb(first as f64)
            ));
        }
    }
    let frozen = frozen.filter(|p| p.inputs.capacity_bytes > 0);
    if let Some(p) = frozen {
        m.push_str(&format!(
            "; the prediction made during step 1 was {} {}",
            gb(p.predicted_peak_bytes as f64),
            to_spare(
                p.predicted_peak_bytes as f64,
                p.inputs.capacity_bytes as f64
            ),
        ));
    }
    m.push_str(
        ". The next longer batch or an evaluation pass may run out of GPU memory: use a \
         smaller micro-batch (or shorter sequences), set \
         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation), or enable \
         activation recomputation",
    );
    // Markers only: the allocator figures without step 1's trace, so the
    // prediction could not replay what step 2 does to the cache.
    if frozen.is_some_and(|p| p.inputs.basis == PredictionBasis::Allocator) {
        m.push_str(
            ". That prediction had no allocator trace of step 1 (markers only): with the \
             trace on (unset STEPWATCH_ALLOCATOR_TRACE=0) it sees what step 2 does to \
             PyTorch's cache",
        );
    }
    m
}

/// The memory-growth advisory due for `forecast` (from [`crate::forecast`]:
/// a figure grows, and capacity is known): once per rank and run, a
/// warning, at `step`. `trend` says which other figures grow, for the
/// likely cause. The prediction fields stay 0: it is an observation.
pub fn growth_due(
    forecast: &GrowthForecast,
    trend: &MemoryTrend,
    step: u64,
    now_ns: u64,
    issued: &[Advisory],
) -> Option<Advisory> {
    observed_once(AdvisoryKind::MemoryGrowth, step, now_ns, issued, || {
        growth_message(forecast, trend)
    })
}

/// "2 h 15 min", "40 min", "35 s".
fn duration_words(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min", s / 60),
        3600..=172_799 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} days", s / 86_400),
    }
}

fn growth_message(f: &GrowthForecast, trend: &MemoryTrend) -> String {
    let mut m = format!(
        "memory grows by {:.1} MB per step ({}, steps {}–{})",
        f.bytes_per_step / 1e6,
        f.source.describe(),
        f.first_step,
        f.last_step,
    );
    if f.oom_step <= f.last_step {
        m.push_str(&format!(
            ": the step peak, {}, has reached the GPU's {} usable",
            gb(f.level_bytes as f64),
            gb(f.capacity_bytes as f64)
        ));
    } else {
        m.push_str(&format!(
            ": at this rate the step peak, now {}, reaches the GPU's {} usable at about step {}",
            gb(f.level_bytes as f64),
            gb(f.capacity_bytes as f64),
            f.oom_step,
        ));
        if let Some(s) = f.seconds_to_oom {
            m.push_str(&format!(", in about {}", duration_words(s)));
        }
        m.push_str(", and the job will run out of GPU memory there");
    }
    let allocated_grows = trend
        .slope(GrowthSource::Allocated)
        .is_some_and(|s| s.low_bytes_per_step > 0.0);
    if allocated_grows || f.source == GrowthSource::Allocated {
        m.push_str(
            ". Tensors stay alive from one step to the next: usually a running total of a loss \
             tensor (`total_loss += loss`; use `loss.item()`), a list that keeps device tensors \
             (logits or predictions kept for a metric; `.detach().cpu()` them), or a cache that \
             grows (a dict of tensors keyed by input shape)",
        );
    } else {
        m.push_str(
            ". Allocated memory does not grow, the cache does: usually fragmentation from \
             batches of varying shapes (set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), \
             or a cache of tensors the allocator keeps for a growing set of shapes",
        );
    }
    m
}
