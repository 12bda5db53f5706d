//! Downsampling a GPU's memory series for a screen: a 100 Hz window of
//! minutes is thousands of samples, a chart is a few hundred pixels wide.
//!
//! Each bucket keeps its minimum and its maximum, not a mean: the point of
//! the series is the peak (a 40 ms spike in a backward pass is what runs a
//! GPU out of memory), and an average would hide it.

use serde::Serialize;

use crate::sample::GpuSample;

/// One time bucket of a downsampled series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MinMaxBucket {
    /// Start of the bucket, CLOCK_MONOTONIC ns; the bucket is
    /// `[start_ns, start_ns + width)`.
    pub start_ns: u64,
    /// Least `used_bytes` of the bucket's samples.
    pub min_bytes: u64,
    /// Greatest `used_bytes` of the bucket's samples: the peak, kept.
    pub max_bytes: u64,
    /// Samples that fell in the bucket (at least 1: empty buckets are left
    /// out, so a gap in sampling stays a gap on the chart).
    pub samples: u32,
}

/// The width of each of `buckets` equal buckets covering `[from_ns, to_ns)`:
/// rounded up so that the buckets cover the whole range, and at least 1 ns.
pub fn bucket_width_ns(from_ns: u64, to_ns: u64, buckets: usize) -> u64 {
    let span = to_ns.saturating_sub(from_ns);
    let n = buckets.max(1) as u64;
    span.div_ceil(n).max(1)
}

/// The samples in `[from_ns, to_ns)` in at most `buckets` equal time
/// buckets (see [`bucket_width_ns`]), each with its min and max, in time
/// order; samples outside the range are ignored and need not be sorted.
/// The greatest `max_bytes` is the greatest sample in range, whatever the
/// bucket count.
pub fn downsample_min_max(
    samples: &[GpuSample],
    from_ns: u64,
    to_ns: u64,
    buckets: usize,
) -> Vec<MinMaxBucket> {
    let width = bucket_width_ns(from_ns, to_ns, buckets);
    let mut out: Vec<Option<MinMaxBucket>> = vec![None; buckets.max(1)];
    for s in samples {
        if s.monotonic_ns < from_ns || s.monotonic_ns >= to_ns {
            continue;
        }
        // Below `buckets` by the rounding up of `width`.
        let i = ((s.monotonic_ns - from_ns) / width) as usize;
        let b = out[i].get_or_insert(MinMaxBucket {
            start_ns: from_ns + i as u64 * width,
            min_bytes: s.used_bytes,
            max_bytes: s.used_bytes,
            samples: 0,
        });
        b.min_bytes = b.min_bytes.min(s.used_bytes);
        b.max_bytes = b.max_bytes.max(s.used_bytes);
        b.samples = b.samples.saturating_add(1);
    }
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(monotonic_ns: u64, used_bytes: u64) -> GpuSample {
        GpuSample {
            monotonic_ns,
            used_bytes,
            capacity_bytes: 100,
        }
    }

    #[test]
    fn a_one_sample_spike_survives_in_its_bucket() {
        // 10 samples over [0, 100) in 2 buckets of 50 ns: the spike of 90 at
        // t=30 is the first bucket's max, the dip of 1 at t=70 the second's min.
        let series: Vec<_> = (0..10)
            .map(|i| {
                let t = i * 10;
                let v = match t {
                    30 => 90,
                    70 => 1,
                    _ => 10,
                };
                s(t, v)
            })
            .collect();
        let got = downsample_min_max(&series, 0, 100, 2);
        assert_eq!(
            got,
            vec![
                MinMaxBucket {
                    start_ns: 0,
                    min_bytes: 10,
                    max_bytes: 90,
                    samples: 5
                },
                MinMaxBucket {
                    start_ns: 50,
                    min_bytes: 1,
                    max_bytes: 10,
                    samples: 5
                },
            ]
        );
    }

    #[test]
    fn the_range_is_half_open_and_empty_buckets_are_left_out() {
        // [10, 40) in 3 buckets of 10: t=10 in the first, nothing in
        // [20, 30), t=39 in the last; t=5 and t=40 are out of range.
        let series = [s(5, 7), s(10, 1), s(39, 3), s(40, 9)];
        let got = downsample_min_max(&series, 10, 40, 3);
        let starts: Vec<u64> = got.iter().map(|b| b.start_ns).collect();
        assert_eq!(starts, vec![10, 30]);
        assert_eq!((got[0].max_bytes, got[1].max_bytes), (1, 3));
    }

    #[test]
    fn width_rounds_up_so_the_last_sample_has_a_bucket() {
        // 10 ns in 3 buckets: 4 ns each (3 would leave [9, 10) uncovered).
        assert_eq!(bucket_width_ns(0, 10, 3), 4);
        let got = downsample_min_max(&[s(9, 5)], 0, 10, 3);
        assert_eq!(got[0].start_ns, 8);
        // An empty range or no buckets asked: width 1, no panic.
        assert_eq!(bucket_width_ns(5, 5, 0), 1);
        assert!(downsample_min_max(&[s(5, 1)], 5, 5, 0).is_empty());
    }

    proptest! {
        #[test]
        fn peaks_counts_and_bounds_are_kept(
            raw in prop::collection::vec((0u64..10_000, 0u64..1_000_000), 0..400),
            from in 0u64..5_000,
            span in 0u64..8_000,
            buckets in 1usize..300,
        ) {
            let series: Vec<_> = raw.iter().map(|&(t, v)| s(t, v)).collect();
            let to = from + span;
            let got = downsample_min_max(&series, from, to, buckets);
            let in_range: Vec<_> = series
                .iter()
                .filter(|x| x.monotonic_ns >= from && x.monotonic_ns < to)
                .collect();
            prop_assert!(got.len() <= buckets);
            prop_assert_eq!(
                got.iter().map(|b| b.samples as usize).sum::<usize>(),
                in_range.len()
            );
            prop_assert_eq!(
                got.iter().map(|b| b.max_bytes).max(),
                in_range.iter().map(|x| x.used_bytes).max()
            );
            prop_assert_eq!(
                got.iter().map(|b| b.min_bytes).min(),
                in_range.iter().map(|x| x.used_bytes).min()
            );
            let width = bucket_width_ns(from, to, buckets);
            prop_assert!(got.windows(2).all(|w| w[0].start_ns < w[1].start_ns));
            for x in in_range {
                let b = got
                    .iter()
                    .find(|b| b.start_ns <= x.monotonic_ns && x.monotonic_ns < b.start_ns + width)
                    .expect("every sample in range lies in a bucket");
                prop_assert!(b.min_bytes <= x.used_bytes && x.used_bytes <= b.max_bytes);
            }
        }
    }
}
