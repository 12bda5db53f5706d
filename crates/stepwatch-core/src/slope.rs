//! A robust line through (step, bytes) points: the Theil–Sen slope with
//! Sen's interval. Memory growth and the batch relation both fit one; the
//! median of pair slopes shrugs off the odd step (a checkpoint, an eval) that
//! a least-squares fit would follow.

use serde::Serialize;

/// A robust slope of one figure over a window of steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slope {
    /// The Theil–Sen slope: median of the pair slopes, bytes per step.
    pub bytes_per_step: f64,
    /// Lower end of Sen's interval, bytes per step.
    pub low_bytes_per_step: f64,
    /// Upper end of Sen's interval, bytes per step.
    pub high_bytes_per_step: f64,
    /// The fitted figure at `last_step` (median intercept of the last
    /// block), bytes.
    pub level_bytes: f64,
    /// Steps the slope is over.
    pub steps: usize,
    /// Blocks of steps pairs were taken within (running-max batches; 1
    /// without batch facts).
    pub blocks: usize,
    /// First step of them.
    pub first_step: u64,
    /// Last step of them.
    pub last_step: u64,
}

/// The Theil–Sen slope of `points` (step, bytes; in step order, steps
/// distinct) with Sen's interval at normal quantile `z`; None under two
/// points.
pub fn theil_sen(points: &[(u64, u64)], z: f64) -> Option<Slope> {
    seasonal_theil_sen(&[points], z)
}

/// The Theil–Sen slope over `blocks` (each as [`theil_sen`] takes it, in
/// step order), pair slopes taken within each block only and pooled, with
/// Sen's interval from the blocks' summed Mann–Kendall variances; the
/// level is the last non-empty block's. None without a pair of distinct
/// steps in any block.
pub fn seasonal_theil_sen(blocks: &[&[(u64, u64)]], z: f64) -> Option<Slope> {
    let blocks: Vec<&[(u64, u64)]> = blocks.iter().copied().filter(|b| !b.is_empty()).collect();
    let (first, last) = (*blocks.first()?.first()?, *blocks.last()?.last()?);
    let x0 = first.0;
    let xy = |b: &[(u64, u64)]| -> Vec<(f64, f64)> {
        b.iter()
            .map(|&(x, y)| ((x - x0) as f64, y as f64))
            .collect()
    };
    let mut slopes = Vec::new();
    let mut variance = 0.0;
    for block in &blocks {
        let points = xy(block);
        for (i, &(xi, yi)) in points.iter().enumerate() {
            for &(xj, yj) in &points[i + 1..] {
                if xj != xi {
                    slopes.push((yj - yi) / (xj - xi));
                }
            }
        }
        let nf = points.len() as f64;
        variance += nf * (nf - 1.0) * (2.0 * nf + 5.0) / 18.0;
    }
    if slopes.is_empty() {
        return None;
    }
    slopes.sort_unstable_by(f64::total_cmp);
    let count = slopes.len();
    let median = |v: &[f64]| {
        let m = v.len() / 2;
        if v.len() % 2 == 1 {
            v[m]
        } else {
            (v[m - 1] + v[m]) / 2.0
        }
    };
    let slope = median(&slopes);
    // Sen (1968): the interval's ends are the pair slopes of ranks
    // (N − C)/2 and (N + C)/2 + 1 (1-based), C = z·sqrt(Var S).
    let c = z * variance.sqrt();
    let lo_rank = ((count as f64 - c) / 2.0).floor();
    let hi_rank = ((count as f64 + c) / 2.0).ceil() + 1.0;
    let low = if lo_rank >= 1.0 {
        slopes[(lo_rank as usize - 1).min(count - 1)]
    } else {
        f64::NEG_INFINITY
    };
    let high = if hi_rank <= count as f64 {
        slopes[(hi_rank as usize - 1).min(count - 1)]
    } else {
        f64::INFINITY
    };
    let current = xy(blocks.last()?);
    let mut intercepts: Vec<f64> = current.iter().map(|&(x, y)| y - slope * x).collect();
    intercepts.sort_unstable_by(f64::total_cmp);
    let last_x = (last.0 - x0) as f64;
    Some(Slope {
        bytes_per_step: slope,
        low_bytes_per_step: low,
        high_bytes_per_step: high,
        level_bytes: median(&intercepts) + slope * last_x,
        steps: blocks.iter().map(|b| b.len()).sum(),
        blocks: blocks.len(),
        first_step: first.0,
        last_step: last.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_line_gives_its_slope_and_level() {
        let points: Vec<(u64, u64)> = (3..=30).map(|s| (s, 1_000_000 + 5_000 * s)).collect();
        let s = theil_sen(&points, 3.29).unwrap();
        assert_eq!(s.bytes_per_step, 5_000.0);
        assert_eq!(s.low_bytes_per_step, 5_000.0);
        assert_eq!(s.level_bytes, 1_150_000.0);
        assert_eq!((s.first_step, s.last_step, s.steps), (3, 30, 28));
    }

    #[test]
    fn a_flat_series_has_no_growth() {
        let points: Vec<(u64, u64)> = (3..=30).map(|s| (s, 7_000)).collect();
        let s = theil_sen(&points, 3.29).unwrap();
        assert_eq!(s.bytes_per_step, 0.0);
        assert!(s.low_bytes_per_step <= 0.0);
    }

    #[test]
    fn a_step_change_halfway_is_not_significant_growth() {
        let points: Vec<(u64, u64)> = (3..=34)
            .map(|s| (s, if s < 19 { 1_000 } else { 2_000 }))
            .collect();
        let s = theil_sen(&points, 3.29).unwrap();
        assert!(s.low_bytes_per_step <= 0.0, "{s:?}");
    }
}
