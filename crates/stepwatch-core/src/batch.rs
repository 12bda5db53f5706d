//! What a step's batch was, and how a rank's step peaks follow it.
//!
//! With variable-length sequences, dynamic resolution or packing, the peak
//! of a step depends on its batch: the job dies on the first long batch, not
//! at step 2. Clients that see the batch say so on the marker that begins a
//! micro-batch ([`BatchFacts`]); a step keeps the largest its markers
//! carried. The trailing window (`growth`) then relates each step's
//! allocated peak to its batch ([`BatchRelation`]). Those peaks are exact
//! when the client resets PyTorch's peak counters at each step's begin (its
//! default from step 2 on); from a client that does not, they are lower
//! bounds, and so is what is figured from them ([`BatchOutlook::at_least`]).
//! From the relation: the largest batch seen
//! and the peak it needed, and, from the peaks' rise per unit of batch (a
//! Theil–Sen slope, as for growth), what the largest batch the loader can
//! produce would need ([`BatchOutlook`]). Activation memory is linear in
//! the batch's samples and tokens (quadratic in sequence length only for
//! attention that materialises its scores, which the line then
//! underestimates past the longest batch seen: say so where it is shown).

use serde::{Deserialize, Serialize};

use crate::marker::{BatchFacts, MAX_PLAUSIBLE_BYTES};
use crate::slope::theil_sen;

// BatchFacts rides on markers and is declared in `marker`; its measure in
// this module's terms is kept here, beside BatchSize.
impl BatchFacts {
    /// Its measures (checked figures: see [`BatchFacts::implausible`]).
    pub fn size(&self) -> BatchSize {
        BatchSize {
            samples: self.samples,
            tokens: self.tokens,
            elements: (!self.shape.is_empty()).then(|| self.shape.iter().product()),
        }
    }
}

/// The measures batches are compared by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchSize {
    /// Samples.
    pub samples: Option<u64>,
    /// Tokens.
    pub tokens: Option<u64>,
    /// Elements of the shape (its product).
    pub elements: Option<u64>,
}

/// Which measure batches are compared by: the first that every batch
/// compared has, in this order (tokens are what activation memory follows
/// for sequences; a shape's elements for images; samples otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchUnit {
    /// Tokens.
    Tokens,
    /// Elements of the input's shape.
    Elements,
    /// Samples.
    Samples,
}

impl BatchUnit {
    const ALL: [BatchUnit; 3] = [BatchUnit::Tokens, BatchUnit::Elements, BatchUnit::Samples];

    /// Stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            BatchUnit::Tokens => "tokens",
            BatchUnit::Elements => "elements",
            BatchUnit::Samples => "samples",
        }
    }

    /// The first unit all of `sizes` have; None when they share none (or
    /// there are none).
    pub fn common<'a>(sizes: impl Iterator<Item = &'a BatchSize> + Clone) -> Option<Self> {
        let mut any = sizes.clone().peekable();
        any.peek()?;
        Self::ALL
            .into_iter()
            .find(|u| sizes.clone().all(|s| s.measure(*u).is_some()))
    }
}

impl BatchSize {
    /// The measure in `unit`, if the batch has it.
    pub fn measure(&self, unit: BatchUnit) -> Option<u64> {
        match unit {
            BatchUnit::Tokens => self.tokens,
            BatchUnit::Elements => self.elements,
            BatchUnit::Samples => self.samples,
        }
    }

    /// Whether it is larger than `other`, compared in the first unit both
    /// have.
    pub fn larger_than(&self, other: &BatchSize) -> bool {
        BatchUnit::ALL
            .into_iter()
            .find_map(|u| Some((self.measure(u)?, other.measure(u)?)))
            .is_some_and(|(a, b)| a > b)
    }
}

/// One step's batch and peaks, as the relation uses them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BatchPoint {
    /// Step number.
    pub step: u64,
    /// The batch's measure in the relation's unit.
    pub size: u64,
    /// The step's allocated peak, bytes.
    pub allocated_peak_bytes: u64,
    /// Whether that peak is exact (else a lower bound, see `profile`).
    pub exact: bool,
}

/// How the window's step peaks follow their batches.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchRelation {
    /// The unit batches are compared in.
    pub unit: BatchUnit,
    /// Steps of the window with both a batch and an allocated peak.
    pub steps: usize,
    /// Distinct batch sizes among them.
    pub distinct_sizes: usize,
    /// Smallest and largest batch of them, in `unit`.
    pub smallest: u64,
    /// Largest batch of the window, in `unit`.
    pub largest: u64,
    /// The allocated peak's rise per unit of batch (Theil–Sen over the
    /// steps); None under two distinct sizes.
    pub bytes_per_unit: Option<f64>,
    /// Whether every step's peak was exact; else some are lower bounds.
    pub exact_peaks: bool,
}

impl BatchRelation {
    /// The relation of `points` (in step order); None without any.
    pub fn of(unit: BatchUnit, points: &[BatchPoint]) -> Option<Self> {
        let smallest = points.iter().map(|p| p.size).min()?;
        let largest = points.iter().map(|p| p.size).max()?;
        let mut sizes: Vec<u64> = points.iter().map(|p| p.size).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut by_size: Vec<(u64, u64)> = points
            .iter()
            .map(|p| (p.size, p.allocated_peak_bytes))
            .collect();
        by_size.sort_unstable();
        // A repeated size keeps its highest peak (the tightest where they
        // are lower bounds).
        let mut per_size: Vec<(u64, u64)> = Vec::with_capacity(sizes.len());
        for (size, peak) in by_size {
            match per_size.last_mut() {
                Some(last) if last.0 == size => last.1 = last.1.max(peak),
                _ => per_size.push((size, peak)),
            }
        }
        let bytes_per_unit = (per_size.len() >= 2)
            .then(|| theil_sen(&per_size, 0.0).map(|s| s.bytes_per_step))
            .flatten();
        Some(Self {
            unit,
            steps: points.len(),
            distinct_sizes: sizes.len(),
            smallest,
            largest,
            bytes_per_unit,
            exact_peaks: points.iter().all(|p| p.exact),
        })
    }
}

/// The largest batch of the run so far and what its step needed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LargestBatch {
    /// Its step.
    pub step: u64,
    /// The batch as the client described it.
    pub batch: BatchFacts,
    /// Its step's allocated peak, bytes.
    pub allocated_peak_bytes: Option<u64>,
    /// Whether that peak is exact (else a lower bound, see `profile`).
    pub allocated_peak_exact: bool,
    /// Its step's reserved peak, bytes (by the same rule).
    pub reserved_peak_bytes: Option<u64>,
    /// Its step's device-memory peak (NVML), bytes.
    pub nvml_peak_bytes: Option<u64>,
}

/// What the device holds beyond the allocator on a rank's steps (medians
/// over the trailing window, `MemoryTrend`): the figures that turn an
/// allocator peak into a device peak when NVML missed the moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BeyondAllocator {
    /// NVML above the reserved peak (CUDA context, other libraries).
    pub over_reserved_bytes: Option<u64>,
    /// NVML above the allocated peak (the above plus the cache).
    pub over_allocated_bytes: Option<u64>,
}

/// The device memory a step or pass needed: the higher of its NVML peak and
/// its reserved peak plus what NVML shows beyond the pool, since a short
/// step can fall between NVML samples; with neither, its allocated peak
/// plus what the device needs beyond that.
pub fn device_peak_bytes(
    nvml_peak: Option<u64>,
    reserved_peak: Option<u64>,
    allocated_peak: Option<u64>,
    beyond: BeyondAllocator,
) -> Option<u64> {
    let from_reserved = reserved_peak
        .zip(beyond.over_reserved_bytes)
        .map(|(r, o)| r.saturating_add(o));
    nvml_peak
        .into_iter()
        .chain(from_reserved)
        .max()
        .or_else(|| {
            allocated_peak
                .zip(beyond.over_allocated_bytes)
                .map(|(a, o)| a.saturating_add(o))
        })
}

impl LargestBatch {
    /// The device memory its step needed (see `device_peak_bytes`).
    pub fn device_peak_bytes(&self, beyond: BeyondAllocator) -> Option<u64> {
        device_peak_bytes(
            self.nvml_peak_bytes,
            self.reserved_peak_bytes,
            self.allocated_peak_bytes,
            beyond,
        )
    }

    /// The device memory a step of allocated peak `allocated` needs to run
    /// on this rank: `allocated` plus what the device holds beyond the
    /// allocator (CUDA context, other libraries). The allocator's cache is
    /// left out: PyTorch frees it and retries before it raises out of
    /// memory, so a step that fits only without it still runs (slower:
    /// `num_alloc_retries`). Without that figure, plus all that this
    /// largest batch's step held beyond its allocated peak, cache included.
    pub fn device_need_bytes(&self, allocated: u64, beyond: BeyondAllocator) -> Option<u64> {
        let outside = beyond.over_reserved_bytes.or_else(|| {
            let device = self.device_peak_bytes(beyond)?;
            Some(device.saturating_sub(self.allocated_peak_bytes?))
        })?;
        Some(allocated.saturating_add(outside))
    }
}

/// What the largest batch the loader can produce would need, from the
/// largest seen and the peaks' rise per unit of batch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchOutlook {
    /// The loader's largest batch, as the client said it.
    pub batch: BatchFacts,
    /// Its measure in the relation's unit.
    pub size: u64,
    /// The allocated peak it would need, bytes.
    pub allocated_peak_bytes: u64,
    /// The device memory it would need to run: the allocated peak plus
    /// what the device holds beyond the allocator (see
    /// [`LargestBatch::device_need_bytes`]), bytes.
    pub device_peak_bytes: Option<u64>,
    /// Capacity minus that; None without capacity or device figure.
    pub headroom_bytes: Option<i64>,
    /// Whether the figures are lower bounds: some step peaks they come from
    /// were (a client without exact step peaks). Else they are estimates
    /// from exact peaks, as good as the line through them.
    pub at_least: bool,
}

/// What `loader_largest` would need, from the largest batch seen and the
/// relation (None when the client did not say it, the relation has no
/// slope, or the two batches share no unit). `beyond` turns the largest
/// step's allocator peaks into its device peak.
pub fn outlook(
    relation: &BatchRelation,
    largest: &LargestBatch,
    loader_largest: &BatchFacts,
    capacity_bytes: u64,
    beyond: BeyondAllocator,
) -> Option<BatchOutlook> {
    let rate = relation.bytes_per_unit?;
    let unit = relation.unit;
    let size = loader_largest.size().measure(unit)?;
    let seen = largest.batch.size().measure(unit)?;
    let base = largest.allocated_peak_bytes?;
    let extra = (size as f64 - seen as f64) * rate.max(0.0);
    let allocated = (base as f64 + extra)
        .max(0.0)
        .min(MAX_PLAUSIBLE_BYTES as f64) as u64;
    let device = largest.device_need_bytes(allocated, beyond);
    Some(BatchOutlook {
        batch: loader_largest.clone(),
        size,
        allocated_peak_bytes: allocated,
        device_peak_bytes: device,
        headroom_bytes: device
            .filter(|_| capacity_bytes > 0)
            .map(|d| capacity_bytes as i64 - d as i64),
        at_least: !(relation.exact_peaks && largest.allocated_peak_exact),
    })
}

/// What a rank's steps say about their batches (see the module
/// documentation); the report's `batches`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepBatches {
    /// How the trailing window's step peaks follow their batches.
    pub relation: Option<BatchRelation>,
    /// The largest batch of the run's steps from the third on.
    pub largest: Option<LargestBatch>,
    /// The largest batch the loader can produce, when the client said it.
    pub loader_largest: Option<BatchFacts>,
    /// What that batch would need.
    pub outlook: Option<BatchOutlook>,
    /// The device peak of the largest batch's step (see
    /// `device_peak_bytes`), bytes.
    pub largest_device_peak_bytes: Option<u64>,
    /// Capacity minus that, bytes.
    pub largest_headroom_bytes: Option<i64>,
}

impl StepBatches {
    /// The batches of a rank; None when neither its steps nor its client
    /// said anything of batches.
    pub fn of(
        relation: Option<&BatchRelation>,
        largest: Option<&LargestBatch>,
        loader_largest: Option<&BatchFacts>,
        capacity_bytes: u64,
        beyond: BeyondAllocator,
    ) -> Option<Self> {
        if relation.is_none() && largest.is_none() && loader_largest.is_none() {
            return None;
        }
        let outlook = relation
            .zip(largest)
            .zip(loader_largest)
            .and_then(|((r, l), loader)| outlook(r, l, loader, capacity_bytes, beyond));
        let largest_device = largest.and_then(|l| l.device_peak_bytes(beyond));
        Some(Self {
            relation: relation.cloned(),
            largest: largest.cloned(),
            loader_largest: loader_largest.cloned(),
            outlook,
            largest_device_peak_bytes: largest_device,
            largest_headroom_bytes: largest_device
                .filter(|_| capacity_bytes > 0)
                .map(|d| capacity_bytes as i64 - d as i64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: u64, size: u64, peak: u64) -> BatchPoint {
        BatchPoint {
            step,
            size,
            allocated_peak_bytes: peak,
            exact: true,
        }
    }

    #[test]
    fn tokens_are_compared_first_then_elements_then_samples() {
        let a = BatchFacts {
            samples: Some(8),
            tokens: Some(4096),
            shape: vec![8, 512],
        }
        .size();
        let b = BatchFacts {
            samples: Some(8),
            tokens: None,
            shape: vec![8, 1024],
        }
        .size();
        assert_eq!(BatchUnit::common([a, b].iter()), Some(BatchUnit::Elements));
        assert!(b.larger_than(&a));
        assert_eq!(BatchUnit::common([a].iter()), Some(BatchUnit::Tokens));
    }

    #[test]
    fn implausible_batches_are_named() {
        let too_deep = BatchFacts {
            shape: vec![1; 9],
            ..Default::default()
        };
        assert_eq!(
            too_deep.implausible().map(|i| i.0),
            Some("batch.shape (dimensions)")
        );
        let too_big = BatchFacts {
            shape: vec![1 << 30, 1 << 30],
            ..Default::default()
        };
        assert_eq!(
            too_big.implausible().map(|i| i.0),
            Some("batch.shape (elements)")
        );
    }

    #[test]
    fn the_relation_and_the_outlook_by_hand() {
        // Peaks 1000 + 2 bytes per token: 512 tokens need 2024, 1024 need
        // 3048, 2048 need 5096 (seen once, at step 9).
        let points = [
            point(3, 512, 2024),
            point(4, 1024, 3048),
            point(5, 512, 2024),
            point(9, 2048, 5096),
        ];
        let r = BatchRelation::of(BatchUnit::Tokens, &points).unwrap();
        assert_eq!((r.smallest, r.largest, r.distinct_sizes), (512, 2048, 3));
        assert_eq!(r.bytes_per_unit, Some(2.0));
        let largest = LargestBatch {
            step: 9,
            batch: BatchFacts {
                tokens: Some(2048),
                ..Default::default()
            },
            allocated_peak_bytes: Some(5096),
            allocated_peak_exact: true,
            reserved_peak_bytes: Some(5200),
            nvml_peak_bytes: Some(6000),
        };
        let loader = BatchFacts {
            tokens: Some(4096),
            ..Default::default()
        };
        let beyond = BeyondAllocator {
            over_reserved_bytes: Some(500),
            over_allocated_bytes: Some(700),
        };
        let o = outlook(&r, &largest, &loader, 10_000, beyond).unwrap();
        // 5096 + 2·2048 = 9192 allocated; plus the 500 beyond the
        // allocator (the cache is not needed): 9692, 308 under capacity.
        assert_eq!(o.allocated_peak_bytes, 9192);
        assert_eq!(o.device_peak_bytes, Some(9_692));
        assert_eq!(o.headroom_bytes, Some(308));
        // Without that figure: plus all that step 9 held beyond its
        // allocated peak (904), cache included.
        let no_outside = BeyondAllocator {
            over_reserved_bytes: None,
            ..beyond
        };
        let o2 = outlook(&r, &largest, &loader, 10_000, no_outside).unwrap();
        assert_eq!(o2.device_peak_bytes, Some(10_096));
        assert!(!o.at_least);
        // A lower-bound peak among them: so is the outlook.
        let mut points = points;
        points[1].exact = false;
        let r = BatchRelation::of(BatchUnit::Tokens, &points).unwrap();
        assert!(
            outlook(&r, &largest, &loader, 10_000, beyond)
                .unwrap()
                .at_least
        );
    }

    #[test]
    fn a_step_that_nvml_sampled_low_is_judged_by_its_pool() {
        // NVML's highest sample of a short step (4000) is below its reserved
        // peak plus what NVML shows beyond the pool on the other steps.
        let beyond = BeyondAllocator {
            over_reserved_bytes: Some(500),
            over_allocated_bytes: Some(700),
        };
        assert_eq!(
            device_peak_bytes(Some(4000), Some(5200), Some(5096), beyond),
            Some(5700)
        );
        // A sample above that wins; without NVML or reserved figures, the
        // allocated peak plus what the device needs beyond it.
        assert_eq!(
            device_peak_bytes(Some(6000), Some(5200), Some(5096), beyond),
            Some(6000)
        );
        assert_eq!(
            device_peak_bytes(None, None, Some(5096), beyond),
            Some(5796)
        );
        assert_eq!(device_peak_bytes(None, None, None, beyond), None);
    }
}
