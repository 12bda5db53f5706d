//! What would fit when step 2 will not: the largest micro-batch, or the
//! optimizer-state sharding factor, that brings the predicted peak under
//! capacity. No other tool says this; the agent can, because step 1 showed
//! it how much memory the activations of one micro-batch take.
//!
//! # Rules
//!
//! When the predicted peak exceeds capacity (device bytes), the remedies
//! aim for the headroom below which the agent warns (`target`, 5% of
//! capacity by default, [`crate::PredictConfig::low_headroom_fraction`]):
//! `need = predicted peak − (capacity − target)`. The margin is there
//! because the figure under the advice is itself a prediction, and because
//! a smaller micro-batch changes the caching allocator's layout. On real
//! PyTorch (`bench/fit-advice.sh`, figures in BENCHMARKS.md) activations are
//! linear in the micro-batch, but the reserved peak need not fall with them
//! and the prediction under the advice can be low: read the micro-batch as
//! an upper bound to try first, not a guarantee.
//!
//! * **Micro-batch.** `activation` is step 1's forward/backward peak above
//!   the memory at step begin ([`crate::divergence::activation_peak_bytes`],
//!   in the prediction's basis units); per sample it is
//!   `floor(activation / micro_batch_size)`. The micro-batch size is the
//!   one the client stated, else the samples of step 1's largest
//!   micro-batch as its forward markers carried them
//!   ([`micro_batch_size`]: a plain `watch(model, optimizer)` loop states
//!   none). Activation memory is linear in the micro-batch, so
//!   `k = ceil(need / per_sample)` fewer samples remove at least `need`:
//!   `fits_with_micro_batch_size = micro_batch_size − k` when that is at
//!   least 1. Only when the binding term of the prediction is a
//!   forward/backward one, and only when the optimizer-phase peak (which a
//!   smaller micro-batch does not lower) fits: `optimizer_phase_peak +
//!   (predicted peak − basis peak) ≤ capacity − target`. Allocator bytes are
//!   taken as device bytes one for one, which may err large (the allocator
//!   may keep the reserved peak where it was, see above). The activation
//!   peak includes gradients backward has made by then, which errs small.
//! * **Sharding.** State `S` sharded over `f0` ranks today (the reported or
//!   inferred factor, else 1) becomes `S × f0 / f` over `f` ranks, saving
//!   `S − S × f0 / f`. The smallest `f > f0` with a saving of at least
//!   `need` is `ceil(S × f0 / (S − need))`, when `S > need` and the binding
//!   term holds the state (a forward/backward term).

use serde::{Deserialize, Serialize};

use crate::marker::BatchFacts;

/// The term of the max that set the prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BindingTerm {
    /// First micro-batch peak + state + grads: step 2's first forward on top of
    /// the new state.
    FirstMicroBatch,
    /// Later micro-batches' peak + state (gradient accumulation).
    LaterMicroBatches,
    /// Step 1's optimizer-phase peak.
    OptimizerPhase,
    /// Step 1's own peak: step 2 was predicted to need no more.
    Step1Peak,
    /// The first forward's peak + state + step 1's gradients, which live
    /// through step 2's forward when they are freed just before backward
    /// (Lightning's closure).
    FirstForwardBesideGradients,
}

/// What the prediction knew about fitting, and what would fit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhatWouldFit {
    /// The micro-batch size (samples per forward) the client stated, else
    /// step 1's as its markers said (`micro_batch_size`).
    pub micro_batch_size: Option<u32>,
    /// Step 1's forward/backward peak above the memory at step begin, in the
    /// prediction's basis units.
    pub activation_bytes: Option<u64>,
    /// `activation_bytes / micro_batch_size`, rounded down.
    pub activation_bytes_per_sample: Option<u64>,
    /// Predicted peak − capacity when step 2 will not fit, device bytes.
    pub over_capacity_bytes: Option<u64>,
    /// The headroom the remedies aim to leave, bytes.
    pub target_headroom_bytes: u64,
    /// The largest micro-batch predicted to fit; None when it fits already,
    /// or when no micro-batch of at least 1 would (or it cannot be told).
    pub fits_with_micro_batch_size: Option<u32>,
    /// The smallest optimizer-state sharding factor predicted to fit.
    pub fits_with_sharding_factor: Option<u32>,
}

/// The prediction's figures [`what_would_fit`] works from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FitInputs {
    /// Which term of the prediction's max set it.
    pub binding: BindingTerm,
    /// The max, basis units.
    pub basis_peak_bytes: u64,
    /// Step 1's optimizer-phase peak, basis units.
    pub optimizer_phase_peak_bytes: Option<u64>,
    /// Predicted device peak, bytes.
    pub predicted_peak_bytes: u64,
    /// GPU capacity, bytes; 0 when unknown.
    pub capacity_bytes: u64,
    /// Headroom the remedies aim to leave, bytes (see the module documentation).
    pub target_headroom_bytes: u64,
    /// Optimizer state in the prediction, basis units.
    pub state_bytes: u64,
    /// Sharding factor the state already has (1 = none).
    pub sharding_factor: u32,
    /// Step 1's activation peak, basis units.
    pub activation_bytes: Option<u64>,
    /// Micro-batch size ([`micro_batch_size`]).
    pub micro_batch_size: Option<u32>,
}

/// The micro-batch size the advice works from: the client's statement,
/// else the samples of step 1's batch (the largest of its micro-batches).
pub fn micro_batch_size(stated: Option<u32>, step1_batch: Option<&BatchFacts>) -> Option<u32> {
    stated.or_else(|| {
        step1_batch
            .and_then(|b| b.samples)
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| n > 0)
    })
}

/// Applies the rules of the module documentation.
pub fn what_would_fit(i: &FitInputs) -> WhatWouldFit {
    let per_sample = i
        .activation_bytes
        .zip(i.micro_batch_size.filter(|&m| m > 0))
        .map(|(a, m)| a / u64::from(m));
    let over = (i.capacity_bytes > 0 && i.predicted_peak_bytes > i.capacity_bytes)
        .then(|| i.predicted_peak_bytes - i.capacity_bytes);
    let room = i.capacity_bytes.saturating_sub(i.target_headroom_bytes);
    let need = over.map(|_| i.predicted_peak_bytes.saturating_sub(room));
    let forward_backward = matches!(
        i.binding,
        BindingTerm::FirstMicroBatch | BindingTerm::LaterMicroBatches
    );
    let to_device = i.predicted_peak_bytes.saturating_sub(i.basis_peak_bytes);
    let optimizer_fits = i
        .optimizer_phase_peak_bytes
        .is_none_or(|o| o.saturating_add(to_device) <= room);
    let micro_batch = need
        .zip(per_sample.filter(|&p| p > 0))
        .zip(i.micro_batch_size)
        .filter(|_| forward_backward && optimizer_fits)
        .and_then(|((need, per), mbs)| {
            let fewer = need.div_ceil(per);
            u64::from(mbs)
                .checked_sub(fewer)
                .filter(|&m| m >= 1)
                .map(|m| m as u32)
        });
    let f0 = u64::from(i.sharding_factor.max(1));
    let sharding = need
        .filter(|&o| forward_backward && i.state_bytes > o)
        .and_then(|o| {
            let f = (u128::from(i.state_bytes) * u128::from(f0))
                .div_ceil(u128::from(i.state_bytes - o));
            u32::try_from(f.max(u128::from(f0) + 1)).ok()
        });
    WhatWouldFit {
        micro_batch_size: i.micro_batch_size,
        activation_bytes: i.activation_bytes,
        activation_bytes_per_sample: per_sample,
        over_capacity_bytes: over,
        target_headroom_bytes: i.target_headroom_bytes,
        fits_with_micro_batch_size: micro_batch,
        fits_with_sharding_factor: sharding,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn base() -> FitInputs {
        // An 80 GB GPU; step 2 predicted at 86 GB (basis 84 GB + 2 GB of
        // context): first micro-batch 40 GB + 32 GB state + 12 GB grads.
        // Step 1's activations were 32 GB for a micro-batch of 8: 4 GB/sample.
        FitInputs {
            binding: BindingTerm::FirstMicroBatch,
            basis_peak_bytes: 84 * GB,
            optimizer_phase_peak_bytes: Some(60 * GB),
            predicted_peak_bytes: 86 * GB,
            capacity_bytes: 80 * GB,
            target_headroom_bytes: 4 * GB,
            state_bytes: 32 * GB,
            sharding_factor: 1,
            activation_bytes: Some(32 * GB),
            micro_batch_size: Some(8),
        }
    }

    #[test]
    fn over_by_6_gb_at_4_gb_per_sample_fits_with_5_samples_or_sharding_over_2() {
        let f = what_would_fit(&base());
        assert_eq!(f.over_capacity_bytes, Some(6 * GB));
        assert_eq!(f.activation_bytes_per_sample, Some(4 * GB));
        // Down to 80 − 4 = 76 GB: 10 GB to shed. ceil(10 / 4) = 3 samples
        // fewer: 8 − 3 = 5.
        assert_eq!(f.fits_with_micro_batch_size, Some(5));
        // ceil(32 × 1 / (32 − 10)) = ceil(1.45) = 2: 16 GB of state saved.
        assert_eq!(f.fits_with_sharding_factor, Some(2));
        // Without a margin: ceil(6 / 4) = 2 fewer.
        let f = what_would_fit(&FitInputs {
            target_headroom_bytes: 0,
            ..base()
        });
        assert_eq!(f.fits_with_micro_batch_size, Some(6));
    }

    #[test]
    fn the_stated_micro_batch_wins_else_step_1s_samples() {
        let batch = |samples| BatchFacts {
            samples,
            tokens: Some(4096),
            shape: vec![8, 512],
        };
        assert_eq!(micro_batch_size(Some(4), Some(&batch(Some(8)))), Some(4));
        assert_eq!(micro_batch_size(None, Some(&batch(Some(8)))), Some(8));
        // Tokens and a shape alone do not say the samples.
        assert_eq!(micro_batch_size(None, Some(&batch(None))), None);
        assert_eq!(micro_batch_size(None, Some(&batch(Some(0)))), None);
        assert_eq!(micro_batch_size(None, Some(&batch(Some(1 << 40)))), None);
        assert_eq!(micro_batch_size(None, None), None);
    }

    #[test]
    fn sharding_already_in_place_needs_a_larger_factor() {
        // 2 GB of state per rank over 4 ranks today, 1.5 GB to shed:
        // 2 × 4 / 0.5 = 16.
        let f = what_would_fit(&FitInputs {
            state_bytes: 2 * GB,
            sharding_factor: 4,
            predicted_peak_bytes: 80 * GB + GB / 2,
            target_headroom_bytes: GB,
            ..base()
        });
        assert_eq!(f.fits_with_sharding_factor, Some(16));
        // State smaller than what is to shed: no sharding is enough.
        let f = what_would_fit(&FitInputs {
            state_bytes: 10 * GB,
            ..base()
        });
        assert_eq!(f.fits_with_sharding_factor, None);
    }

    #[test]
    fn nothing_is_offered_when_it_fits_or_a_micro_batch_cannot_help() {
        let fits = what_would_fit(&FitInputs {
            predicted_peak_bytes: 79 * GB,
            ..base()
        });
        assert_eq!(fits.over_capacity_bytes, None);
        assert_eq!(
            (
                fits.fits_with_micro_batch_size,
                fits.fits_with_sharding_factor
            ),
            (None, None)
        );
        assert_eq!(fits.activation_bytes_per_sample, Some(4 * GB));
        // 30 GB to shed at 4 GB/sample: 8 fewer than 8 leaves none.
        let f = what_would_fit(&FitInputs {
            predicted_peak_bytes: 106 * GB,
            basis_peak_bytes: 104 * GB,
            ..base()
        });
        assert_eq!(f.fits_with_micro_batch_size, None);
        // The optimizer phase (75 + 2 GB, over 76) does not shrink with the
        // micro-batch.
        let f = what_would_fit(&FitInputs {
            optimizer_phase_peak_bytes: Some(75 * GB),
            ..base()
        });
        assert_eq!(f.fits_with_micro_batch_size, None);
        // Bound by the optimizer phase: neither remedy is computed.
        let f = what_would_fit(&FitInputs {
            binding: BindingTerm::OptimizerPhase,
            ..base()
        });
        assert_eq!(
            (f.fits_with_micro_batch_size, f.fits_with_sharding_factor),
            (None, None)
        );
        // Without the micro-batch size, no per-sample figure.
        let f = what_would_fit(&FitInputs {
            micro_batch_size: None,
            ..base()
        });
        assert_eq!(
            (f.activation_bytes_per_sample, f.fits_with_micro_batch_size),
            (None, None)
        );
    }
}
