//! Divergence of one job's figures across its ranks on this node.
//!
//! For each figure over the ranks that have it:
//! `spread = (max − min) / median`, and a rank is an outlier when
//! `|value − median| / median > threshold` (default 10%). The median of an
//! even count is the mean of the two middle values. A median of 0 would
//! divide by zero: then the spread is 0 when all values are 0, and the
//! deviations are taken relative to the maximum instead.
//!
//! The figures, per [`DivergenceFigure`]:
//! * the step-1 peak (allocated, else NVML: see [`divergence`]);
//! * the step-1 **activation peak**: the forward/backward peak minus what
//!   was allocated (or what NVML showed) when step 1 began. Every rank
//!   creates the same optimizer state inside step 1, and that state sets
//!   the step-1 peak, so a rank whose activations are much heavier can sit
//!   within the threshold at the step-1 peak; its activation peak shows it;
//! * the **steady peak**: the median peak of the steps after the first,
//!   once a rank has enough of them (see `analysis`);
//! * the step-1 duration.
//!
//! Ranks differ for real reasons (rank 0 logging, pipeline stages, uneven
//! shards), so outliers are named, not judged. A rank is *named*
//! ([`Divergence::named`], and the RANK_DIVERGENCE advisory) only for a memory
//! figure that every rank of the job here has, and with at least
//! [`MIN_RANKS_TO_NAME`] ranks: with two ranks, or before the others have
//! the figure, there is no telling which one is odd. And only for the
//! allocator's figures: NVML's are the highest of samples, which miss short
//! peaks at random (at 2 Hz identical ranks' step-1 samples lay 10% and more
//! apart), so they give a spread but name no rank.

use serde::{Deserialize, Serialize};

use crate::marker::PhaseKind;
use crate::profile::{phase_allocator_peaks, SteadyProfile};
use crate::timeline::{StepOutcome, StepRecord};

/// Default outlier threshold: 10% from the median.
pub const DEFAULT_OUTLIER_THRESHOLD: f64 = 0.10;

/// Fewest ranks with a figure for an outlier to be named (see the module
/// documentation).
pub const MIN_RANKS_TO_NAME: usize = 3;

/// Which peak figure the peak spread compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeakSource {
    /// NVML device used bytes.
    Nvml,
    /// Allocator allocated bytes.
    Allocated,
}

/// A figure compared across ranks; its name is the `figure` label of
/// `stepwatch_job_rank_outlier` and of the advisory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DivergenceFigure {
    /// Highest figure of step 1 (optimizer state included).
    Step1Peak,
    /// Step 1's forward/backward peak above what was there at step begin.
    ActivationPeak,
    /// Median peak of the steps after the first.
    SteadyPeak,
    /// Duration of step 1.
    Step1Duration,
}

impl DivergenceFigure {
    /// The snake_case name used in labels and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            DivergenceFigure::Step1Peak => "step1_peak",
            DivergenceFigure::ActivationPeak => "activation_peak",
            DivergenceFigure::SteadyPeak => "steady_peak",
            DivergenceFigure::Step1Duration => "step1_duration",
        }
    }

    /// Words a person reads, e.g. in an advisory.
    pub fn describe(self) -> &'static str {
        match self {
            DivergenceFigure::Step1Peak => "step-1 memory peak",
            DivergenceFigure::ActivationPeak => {
                "step-1 activation peak (forward/backward peak above the memory at step begin)"
            }
            DivergenceFigure::SteadyPeak => "steady-state memory peak (steps after the first)",
            DivergenceFigure::Step1Duration => "step-1 duration",
        }
    }
}

/// The figures of one rank compared across ranks. Each peak comes from
/// NVML and from the allocator; a spread uses the allocator's unless more
/// ranks have NVML's (see [`divergence`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct RankFigures {
    /// Global rank the figures belong to.
    pub rank: u32,
    /// Highest NVML sample of step 1, bytes.
    pub nvml_peak_bytes: Option<u64>,
    /// Highest allocated bytes of step 1; stands in when NVML peaks are missing.
    pub allocated_peak_bytes: Option<u64>,
    /// Duration of step 1, ns.
    pub duration_ns: Option<u64>,
    /// Step 1's forward/backward NVML peak minus the NVML sample just before
    /// step 1 began, bytes.
    pub activation_nvml_bytes: Option<u64>,
    /// Step 1's forward/backward allocated peak minus allocated at step begin.
    pub activation_allocated_bytes: Option<u64>,
    /// Steady-state NVML peak, bytes; None until the rank has one.
    pub steady_nvml_peak_bytes: Option<u64>,
    /// Steady-state allocated peak, bytes.
    pub steady_allocated_peak_bytes: Option<u64>,
}

impl RankFigures {
    /// A rank's figures from its first step and steady profile. Step-1 peaks
    /// count once step 1 has ended (completed or OOM), its duration once it
    /// has completed: a running step's figures are still growing.
    pub fn of(rank: u32, first: Option<&StepRecord>, steady: Option<&SteadyProfile>) -> Self {
        let ended = first.filter(|s| s.outcome != StepOutcome::Running);
        let activation = ended.map(activation_peak_bytes);
        RankFigures {
            rank,
            nvml_peak_bytes: ended.and_then(|s| s.nvml_peak_bytes()),
            allocated_peak_bytes: ended.and_then(|s| {
                s.phases
                    .iter()
                    .filter_map(|p| phase_allocator_peaks(p).map(|(a, _)| a))
                    .max()
            }),
            duration_ns: first
                .filter(|s| s.outcome == StepOutcome::Completed)
                .and_then(|s| s.duration_ns()),
            activation_nvml_bytes: activation.and_then(|a| a.nvml_bytes),
            activation_allocated_bytes: activation.and_then(|a| a.allocated_bytes),
            steady_nvml_peak_bytes: steady.and_then(|s| s.nvml_peak_bytes),
            steady_allocated_peak_bytes: steady.and_then(|s| s.peaks.allocated_peak_bytes),
        }
    }
}

/// A step's activation peak: its forward/backward peak above the memory at
/// step begin, from the allocator and from NVML.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivationPeak {
    /// Allocated forward/backward peak − allocated at the step-begin marker.
    pub allocated_bytes: Option<u64>,
    /// NVML forward/backward peak − the last NVML sample before step begin.
    pub nvml_bytes: Option<u64>,
}

/// The activation peak of a step (see [`ActivationPeak`]). It includes the
/// gradients backward has made by the time of the peak, which is right for
/// comparing ranks and errs on the large side for sizing a micro-batch.
pub fn activation_peak_bytes(step: &StepRecord) -> ActivationPeak {
    let fb = || {
        step.phases
            .iter()
            .filter(|p| matches!(p.phase, PhaseKind::Forward | PhaseKind::Backward))
    };
    let begin_allocated = step
        .phases
        .first()
        .and_then(|p| p.allocator_at_start)
        .map(|a| a.allocated_bytes);
    let allocated_peak = fb()
        .filter_map(|p| phase_allocator_peaks(p).map(|(a, _)| a))
        .max();
    let nvml_peak = fb()
        .filter(|p| p.nvml.samples > 0)
        .map(|p| p.nvml.peak_bytes)
        .max();
    ActivationPeak {
        allocated_bytes: allocated_peak
            .zip(begin_allocated)
            .map(|(p, b)| p.saturating_sub(b)),
        nvml_bytes: nvml_peak
            .zip(step.nvml_before_begin.map(|(_, used)| used))
            .map(|(p, b)| p.saturating_sub(b)),
    }
}

/// A rank that deviates from the median by more than the threshold.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outlier {
    /// The deviating rank.
    pub rank: u32,
    /// Its figure, in the figure's unit (bytes or ns).
    pub value: u64,
    /// (value − median) / median, signed.
    pub deviation: f64,
}

/// A rank named as an outlier of a memory figure (see the module
/// documentation for when a rank is named).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedOutlier {
    /// The deviating rank.
    pub rank: u32,
    /// Which figure it deviates in.
    pub figure: DivergenceFigure,
    /// Whether the figure is NVML or allocated bytes.
    pub source: PeakSource,
    /// Its figure, bytes.
    pub value_bytes: u64,
    /// The median over the job's ranks here, bytes.
    pub median_bytes: f64,
    /// (value − median) / median, signed.
    pub deviation: f64,
    /// How many ranks the median is over.
    pub ranks: usize,
}

/// Spread of one figure across ranks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Spread {
    /// Ranks that had the figure.
    pub ranks: usize,
    /// Lowest value across the ranks.
    pub min: u64,
    /// Highest value across the ranks.
    pub max: u64,
    /// Median value; the reference outliers are measured against.
    pub median: f64,
    /// (max − min) / median.
    pub spread: f64,
    /// Lowest rank holding the minimum / maximum.
    pub min_rank: u32,
    /// Lowest rank holding the maximum: where to look first.
    pub max_rank: u32,
    /// Ordered by rank.
    pub outliers: Vec<Outlier>,
}

/// Divergence of one job's figures across its ranks on this node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    /// Job the ranks belong to.
    pub job: String,
    /// Ranks considered, ascending.
    pub ranks: Vec<u32>,
    /// Outlier threshold used, relative to the median (0.10 = 10%).
    pub threshold: f64,
    /// Which peak figure `peak` compares; None without a peak spread.
    pub peak_source: Option<PeakSource>,
    /// Spread of step-1 peak bytes; None when no rank has a peak.
    pub peak: Option<Spread>,
    /// Which figure `activation` compares.
    pub activation_source: Option<PeakSource>,
    /// Spread of step-1 activation peaks (forward/backward peak above the
    /// memory at step begin), bytes.
    pub activation: Option<Spread>,
    /// Which figure `steady` compares.
    pub steady_source: Option<PeakSource>,
    /// Spread of steady-state peaks, bytes; None until a rank has one.
    pub steady: Option<Spread>,
    /// Spread of step-1 durations (ns); None when no rank finished step 1.
    pub duration: Option<Spread>,
    /// Ranks named as outliers of a memory figure, by figure then rank.
    pub named: Vec<NamedOutlier>,
}

impl Divergence {
    /// The spread of one figure, with its source (None for durations).
    pub fn figure(&self, figure: DivergenceFigure) -> Option<(&Spread, Option<PeakSource>)> {
        match figure {
            DivergenceFigure::Step1Peak => self.peak.as_ref().map(|s| (s, self.peak_source)),
            DivergenceFigure::ActivationPeak => self
                .activation
                .as_ref()
                .map(|s| (s, self.activation_source)),
            DivergenceFigure::SteadyPeak => self.steady.as_ref().map(|s| (s, self.steady_source)),
            DivergenceFigure::Step1Duration => self.duration.as_ref().map(|s| (s, None)),
        }
    }
}

/// Computes the divergence; None without any rank. Each peak figure is the
/// allocated one unless more ranks have the NVML one. Allocator figures come
/// with the markers and are exact; NVML peaks are samples, which miss short
/// peaks at random: on real PyTorch (fake CUDA, 4 DDP ranks with equal
/// allocated activation peaks but one) the NVML activation peaks of the
/// equal ranks spread by 0.34 – 0.47 GB and named one of them. Independent
/// of the order of `figures`.
pub fn divergence(job: &str, figures: &[RankFigures], threshold: f64) -> Option<Divergence> {
    if figures.is_empty() {
        return None;
    }
    let mut figures = figures.to_vec();
    figures.sort();
    let pick = |nvml: fn(&RankFigures) -> Option<u64>, alloc: fn(&RankFigures) -> Option<u64>| {
        let count =
            |f: fn(&RankFigures) -> Option<u64>| figures.iter().filter(|r| f(r).is_some()).count();
        let (source, f) = if count(alloc) > 0 && count(alloc) >= count(nvml) {
            (PeakSource::Allocated, alloc)
        } else {
            (PeakSource::Nvml, nvml)
        };
        let s = spread(&figures, f, threshold);
        (s.as_ref().map(|_| source), s)
    };
    let (peak_source, peak) = pick(|r| r.nvml_peak_bytes, |r| r.allocated_peak_bytes);
    let (activation_source, activation) = pick(
        |r| r.activation_nvml_bytes,
        |r| r.activation_allocated_bytes,
    );
    let (steady_source, steady) = pick(
        |r| r.steady_nvml_peak_bytes,
        |r| r.steady_allocated_peak_bytes,
    );
    let mut d = Divergence {
        job: job.to_owned(),
        ranks: figures.iter().map(|f| f.rank).collect(),
        threshold,
        peak_source,
        peak,
        activation_source,
        activation,
        steady_source,
        steady,
        duration: spread(&figures, |r| r.duration_ns, threshold),
        named: Vec::new(),
    };
    let mut named = Vec::new();
    for figure in [
        DivergenceFigure::Step1Peak,
        DivergenceFigure::ActivationPeak,
        DivergenceFigure::SteadyPeak,
    ] {
        let Some((s, Some(source))) = d.figure(figure) else {
            continue;
        };
        // NVML figures are samples' highest, which miss short peaks at
        // random: a spread, but no rank named from them alone.
        if s.ranks < figures.len() || s.ranks < MIN_RANKS_TO_NAME || source == PeakSource::Nvml {
            continue;
        }
        named.extend(s.outliers.iter().map(|o| NamedOutlier {
            rank: o.rank,
            figure,
            source,
            value_bytes: o.value,
            median_bytes: s.median,
            deviation: o.deviation,
            ranks: s.ranks,
        }));
    }
    d.named = named;
    Some(d)
}

/// Spread of one figure over the ranks (sorted by rank) that have it.
pub fn spread(
    figures: &[RankFigures],
    f: impl Fn(&RankFigures) -> Option<u64>,
    threshold: f64,
) -> Option<Spread> {
    let vals: Vec<(u32, u64)> = figures
        .iter()
        .filter_map(|r| f(r).map(|v| (r.rank, v)))
        .collect();
    if vals.is_empty() {
        return None;
    }
    let mut sorted: Vec<u64> = vals.iter().map(|&(_, v)| v).collect();
    sorted.sort_unstable();
    let n = sorted.len();
    let (min, max) = (sorted[0], sorted[n - 1]);
    let mut reals: Vec<f64> = sorted.iter().map(|&v| v as f64).collect();
    let median = crate::profile::median_f64(&mut reals).expect("not empty");
    let denom = if median > 0.0 { median } else { max as f64 };
    let rel = |x: f64| if denom > 0.0 { x / denom } else { 0.0 };
    let rank_of = |target: u64| {
        vals.iter()
            .filter(|&&(_, v)| v == target)
            .map(|&(r, _)| r)
            .min()
            .unwrap_or(0)
    };
    let mut outliers: Vec<Outlier> = vals
        .iter()
        .map(|&(rank, value)| Outlier {
            rank,
            value,
            deviation: rel(value as f64 - median),
        })
        .filter(|o| o.deviation.abs() > threshold)
        .collect();
    outliers.sort_by_key(|o| o.rank);
    Some(Spread {
        ranks: n,
        min,
        max,
        median,
        spread: rel((max - min) as f64),
        min_rank: rank_of(min),
        max_rank: rank_of(max),
        outliers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fig(rank: u32, peak: u64, dur: u64) -> RankFigures {
        RankFigures {
            rank,
            nvml_peak_bytes: Some(peak),
            allocated_peak_bytes: None,
            duration_ns: Some(dur),
            ..Default::default()
        }
    }

    #[test]
    fn no_rank_is_named_with_two_ranks_or_before_every_rank_has_the_figure() {
        let with_act = |rank, act| RankFigures {
            rank,
            activation_allocated_bytes: Some(act),
            ..Default::default()
        };
        // Two ranks: both are 10% off their mean; which one is odd is unknown.
        let d = divergence("j", &[with_act(0, 100), with_act(1, 150)], 0.1).unwrap();
        assert_eq!(d.activation.unwrap().outliers.len(), 2);
        assert!(d.named.is_empty());
        // Three of four ranks have the figure: the median may still move.
        let figures = [
            with_act(0, 100),
            with_act(1, 100),
            with_act(2, 150),
            RankFigures {
                rank: 3,
                ..Default::default()
            },
        ];
        let d = divergence("j", &figures, 0.1).unwrap();
        assert_eq!(d.activation.unwrap().outliers.len(), 1);
        assert!(d.named.is_empty());
        // Steady peaks, once known, are compared the same way.
        let steady = |rank, p| RankFigures {
            rank,
            steady_allocated_peak_bytes: Some(p),
            ..Default::default()
        };
        let d = divergence("j", &[steady(0, 100), steady(1, 100), steady(2, 80)], 0.1).unwrap();
        assert_eq!(d.named.len(), 1);
        assert_eq!(
            (d.named[0].rank, d.named[0].figure, d.named[0].source),
            (2, DivergenceFigure::SteadyPeak, PeakSource::Allocated)
        );
        assert!((d.named[0].deviation + 0.2).abs() < 1e-12);
        // NVML's sampled peaks give the spread, and name no rank.
        let steady = |rank, p| RankFigures {
            rank,
            steady_nvml_peak_bytes: Some(p),
            ..Default::default()
        };
        let d = divergence("j", &[steady(0, 100), steady(1, 100), steady(2, 80)], 0.1).unwrap();
        assert_eq!(d.steady.as_ref().unwrap().outliers.len(), 1);
        assert!(d.named.is_empty());
    }

    #[test]
    fn spread_and_outliers_by_hand() {
        // peaks 100, 100, 110, 150: median 105, spread 50/105, outlier 150 (+42.9%).
        let d = divergence(
            "j",
            &[
                fig(3, 150, 10),
                fig(0, 100, 10),
                fig(1, 100, 10),
                fig(2, 110, 12),
            ],
            0.10,
        )
        .unwrap();
        assert_eq!(d.ranks, [0, 1, 2, 3]);
        let p = d.peak.unwrap();
        assert_eq!((p.min, p.max, p.median), (100, 150, 105.0));
        assert!((p.spread - 50.0 / 105.0).abs() < 1e-12);
        assert_eq!((p.min_rank, p.max_rank), (0, 3));
        assert_eq!(p.outliers.len(), 1);
        assert_eq!(p.outliers[0].rank, 3);
        // durations 10, 10, 10, 12: median 10, spread 0.2, rank 2 at +20%.
        let t = d.duration.unwrap();
        assert!((t.spread - 0.2).abs() < 1e-12);
        assert_eq!(t.outliers.iter().map(|o| o.rank).collect::<Vec<_>>(), [2]);
        assert_eq!(d.peak_source, Some(PeakSource::Nvml));
    }

    #[test]
    fn allocated_peaks_stand_in_when_nvml_is_missing() {
        let mut a = fig(0, 0, 1);
        a.nvml_peak_bytes = None;
        a.allocated_peak_bytes = Some(10);
        let mut b = a;
        b.rank = 1;
        b.allocated_peak_bytes = Some(30);
        let d = divergence("j", &[a, b], 0.1).unwrap();
        assert_eq!(d.peak_source, Some(PeakSource::Allocated));
        let p = d.peak.unwrap();
        assert_eq!(p.median, 20.0);
        assert!((p.spread - 1.0).abs() < 1e-12);
    }

    #[test]
    fn exact_allocated_figures_win_over_sampled_nvml_ones() {
        // Allocated activation peaks 100, 100, 100, 124 (rank 3 +24%); NVML
        // samples caught 90, 60, 100, 120: they would name rank 1 (−25%) too.
        let f = |rank, alloc, nvml| RankFigures {
            rank,
            activation_allocated_bytes: Some(alloc),
            activation_nvml_bytes: Some(nvml),
            ..Default::default()
        };
        let d = divergence(
            "j",
            &[f(0, 100, 90), f(1, 100, 60), f(2, 100, 100), f(3, 124, 120)],
            0.1,
        )
        .unwrap();
        assert_eq!(d.activation_source, Some(PeakSource::Allocated));
        assert_eq!(
            d.named.iter().map(|n| n.rank).collect::<Vec<_>>(),
            [3],
            "{:?}",
            d.named
        );
    }

    #[test]
    fn zero_median_does_not_divide_by_zero() {
        let d = divergence("j", &[fig(0, 0, 0), fig(1, 0, 0), fig(2, 8, 0)], 0.1).unwrap();
        let p = d.peak.unwrap();
        assert_eq!(p.spread, 1.0);
        assert_eq!(d.duration.unwrap().spread, 0.0);
        assert!(divergence("j", &[], 0.1).is_none());
    }
}
