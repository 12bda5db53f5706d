//! Step 2's first forward with a larger batch than step 1's (a smaller
//! warm-up step 1): the prediction made from step 1 is revised before step
//! 2's backward, with step 1's activations scaled by the extra batch.
//!
//! ```text
//! unit        = the first of tokens, elements, samples that both batches have
//! activation  = step 1's first forward's peak − allocated at its begin
//!               (NVML basis: − the last sample before it)
//! extra       = ceil(activation × (step 2's size − step 1's) / step 1's size)
//! device      = unrevised device peak + ceil(extra × reserved ratio)
//! ```
//!
//! Weights, gradients and optimizer state do not follow the batch, so only
//! the activation part grows. The forward alone is taken: backward's
//! transients in step 1 are mostly of the parameters' size (on fake CUDA
//! an MLP's backward held 33 MB above its forward at 256 samples and 36 MB
//! at 4096, while its forward grew 16-fold). A buffer made lazily in the
//! first forward (cuBLAS's workspace on a GPU) is counted as activation:
//! the safe side. Tokens come first: with variable-length sequences the
//! samples stay the same while the tokens grow. The figure is linear in the
//! unit; attention that materialises its scores grows with the square of
//! the sequence length, which it then underestimates. Nothing is revised
//! when either batch is unknown, they share no unit, or step 2's is not
//! larger.

use serde::{Deserialize, Serialize};

use crate::batch::BatchUnit;
use crate::marker::BatchFacts;

/// How the prediction was revised for step 2's larger batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchRevision {
    /// The unit the batches were compared in.
    pub unit: BatchUnit,
    /// Step 1's batch (its largest micro-batch), as the client said it.
    pub step1_batch: BatchFacts,
    /// Step 2's first forward's batch.
    pub step2_batch: BatchFacts,
    /// Step 1's batch in `unit`.
    pub step1_size: u64,
    /// Step 2's batch in `unit`.
    pub step2_size: u64,
    /// Step 1's activations (its first forward's peak above its begin),
    /// basis units.
    pub step1_activation_bytes: u64,
    /// What step 2's extra batch adds to the basis peak, basis units.
    pub extra_basis_bytes: u64,
    /// What it adds to the device peak (× step 1's reserved / allocated
    /// ratio on the allocator bases), bytes.
    pub extra_device_bytes: u64,
    /// The device peak predicted from step 1 before the revision, bytes.
    pub unrevised_peak_bytes: u64,
}

/// The revision for `step2` against `step1` (see the module
/// documentation); None when there is nothing to revise.
pub fn revise_for_batch(
    step1: &BatchFacts,
    step2: &BatchFacts,
    step1_activation_bytes: u64,
    reserved_ratio: f64,
    unrevised_peak_bytes: u64,
) -> Option<BatchRevision> {
    let sizes = [step1.size(), step2.size()];
    let unit = BatchUnit::common(sizes.iter())?;
    let step1_size = sizes[0].measure(unit).filter(|&n| n > 0)?;
    let step2_size = sizes[1].measure(unit).filter(|&n| n > step1_size)?;
    let extra = u128::from(step1_activation_bytes) * u128::from(step2_size - step1_size);
    let extra_basis_bytes = u64::try_from(extra.div_ceil(u128::from(step1_size))).ok()?;
    let ratio = if reserved_ratio.is_finite() {
        reserved_ratio.max(1.0)
    } else {
        1.0
    };
    let extra_device_bytes = (extra_basis_bytes as f64 * ratio)
        .ceil()
        .min(u64::MAX as f64) as u64;
    Some(BatchRevision {
        unit,
        step1_batch: step1.clone(),
        step2_batch: step2.clone(),
        step1_size,
        step2_size,
        step1_activation_bytes,
        extra_basis_bytes,
        extra_device_bytes,
        unrevised_peak_bytes,
    })
}

impl BatchRevision {
    /// The revision in words, for the prediction's explanation.
    pub fn describe(&self) -> String {
        use crate::units::gb;
        let unit = self.unit.as_str();
        format!(
            "revised for step 2's larger batch: its first forward took {} where step 1 took \
             {}, so step 1's activations ({}) scaled by the {} extra {unit} \
             add {} ({} on the device); weights, gradients and optimizer state do not grow \
             with the batch. The prediction made from step 1 alone was {}. This is linear in \
             {unit}: attention that materialises its scores grows with the square of the \
             sequence length, and a step 2 whose larger tensors find no cached block of step \
             1's size reserves more. For a prediction during step 1, make step 1 as large as \
             the steps after it",
            self.step2_batch.describe(),
            self.step1_batch.describe(),
            gb(self.step1_activation_bytes as f64),
            self.step2_size - self.step1_size,
            gb(self.extra_basis_bytes as f64),
            gb(self.extra_device_bytes as f64),
            gb(self.unrevised_peak_bytes as f64),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(n: u64) -> BatchFacts {
        BatchFacts {
            samples: Some(n),
            ..Default::default()
        }
    }

    #[test]
    fn the_activations_scale_by_the_extra_samples() {
        // 4 samples needed 1000 bytes of activations; 16 need 3000 more,
        // 3750 on the device at a reserved ratio of 1.25.
        let r = revise_for_batch(&samples(4), &samples(16), 1000, 1.25, 50_000).unwrap();
        assert_eq!(
            (r.unit, r.step1_size, r.step2_size),
            (BatchUnit::Samples, 4, 16)
        );
        assert_eq!(r.extra_basis_bytes, 3000);
        assert_eq!(r.extra_device_bytes, 3750);
        assert!(
            r.describe().contains("12 extra samples"),
            "{}",
            r.describe()
        );
    }

    #[test]
    fn same_samples_and_more_tokens_are_a_larger_batch() {
        let short = BatchFacts {
            samples: Some(8),
            tokens: Some(8 * 128),
            shape: vec![8, 128],
        };
        let long = BatchFacts {
            samples: Some(8),
            tokens: Some(8 * 512),
            shape: vec![8, 512],
        };
        let r = revise_for_batch(&short, &long, 1024, 1.0, 0).unwrap();
        assert_eq!(r.unit, BatchUnit::Tokens);
        assert_eq!(r.extra_basis_bytes, 3072);
        // The other way round, or the same batch: nothing to revise.
        assert!(revise_for_batch(&long, &short, 1024, 1.0, 0).is_none());
        assert!(revise_for_batch(&long, &long, 1024, 1.0, 0).is_none());
    }

    #[test]
    fn batches_without_a_common_unit_or_a_size_revise_nothing() {
        let tokens = BatchFacts {
            tokens: Some(4096),
            ..Default::default()
        };
        assert!(revise_for_batch(&samples(4), &tokens, 1000, 1.0, 0).is_none());
        assert!(revise_for_batch(&samples(0), &samples(4), 1000, 1.0, 0).is_none());
        assert!(revise_for_batch(&BatchFacts::default(), &samples(4), 1000, 1.0, 0).is_none());
    }
}
