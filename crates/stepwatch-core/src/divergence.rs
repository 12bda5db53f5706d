//! Divergence of step-1 figures across the ranks of one job on this node.
//!
//! For each figure (peak bytes, duration) over the ranks that have it:
//! `spread = (max − min) / median`, and a rank is an outlier when
//! `|value − median| / median > threshold` (default 10%). The median of an
//! even count is the mean of the two middle values. A median of 0 would
//! divide by zero: then the spread is 0 when all values are 0, and the
//! deviations are taken relative to the maximum instead.
//!
//! Ranks differ for real reasons (rank 0 logging, pipeline stages, uneven
//! shards), so outliers are named, not judged.

use serde::Serialize;

/// Default outlier threshold: 10% from the median.
pub const DEFAULT_OUTLIER_THRESHOLD: f64 = 0.10;

/// Which peak figure the peak spread compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeakSource {
    /// NVML device used bytes.
    Nvml,
    /// Allocator allocated bytes.
    Allocated,
}

/// Step-1 figures of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RankFigures {
    /// Global rank the figures belong to.
    pub rank: u32,
    /// Highest NVML sample of step 1, bytes.
    pub nvml_peak_bytes: Option<u64>,
    /// Highest allocated bytes of step 1; stands in when NVML peaks are missing.
    pub allocated_peak_bytes: Option<u64>,
    /// Duration of step 1, ns.
    pub duration_ns: Option<u64>,
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

/// Divergence of one job's step-1 figures across its ranks on this node.
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
    /// Spread of step-1 durations (ns); None when no rank finished step 1.
    pub duration: Option<Spread>,
}

/// Computes the divergence; None without any rank. The peak figure is NVML
/// when every rank has it, else allocated when every rank has that, else
/// NVML over the ranks that have it. Independent of the order of `figures`.
pub fn divergence(job: &str, figures: &[RankFigures], threshold: f64) -> Option<Divergence> {
    if figures.is_empty() {
        return None;
    }
    let mut figures = figures.to_vec();
    figures.sort_by_key(|f| {
        (
            f.rank,
            f.nvml_peak_bytes,
            f.allocated_peak_bytes,
            f.duration_ns,
        )
    });
    let all = |f: fn(&RankFigures) -> Option<u64>| figures.iter().all(|r| f(r).is_some());
    let peak_of: fn(&RankFigures) -> Option<u64> =
        if !all(|r| r.nvml_peak_bytes) && all(|r| r.allocated_peak_bytes) {
            |r| r.allocated_peak_bytes
        } else {
            |r| r.nvml_peak_bytes
        };
    let peak = spread(&figures, peak_of, threshold);
    let peak_source = peak.as_ref().map(|_| {
        if !all(|r| r.nvml_peak_bytes) && all(|r| r.allocated_peak_bytes) {
            PeakSource::Allocated
        } else {
            PeakSource::Nvml
        }
    });
    Some(Divergence {
        job: job.to_owned(),
        ranks: figures.iter().map(|f| f.rank).collect(),
        threshold,
        peak_source,
        peak,
        duration: spread(&figures, |r| r.duration_ns, threshold),
    })
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
    let median = if n % 2 == 1 {
        sorted[n / 2] as f64
    } else {
        (sorted[n / 2 - 1] as f64 + sorted[n / 2] as f64) / 2.0
    };
    let (min, max) = (sorted[0], sorted[n - 1]);
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
        }
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
    fn zero_median_does_not_divide_by_zero() {
        let d = divergence("j", &[fig(0, 0, 0), fig(1, 0, 0), fig(2, 8, 0)], 0.1).unwrap();
        let p = d.peak.unwrap();
        assert_eq!(p.spread, 1.0);
        assert_eq!(d.duration.unwrap().spread, 0.0);
        assert!(divergence("j", &[], 0.1).is_none());
    }
}
