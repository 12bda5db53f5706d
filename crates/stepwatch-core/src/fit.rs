//! What would fit when step 2 will not: the largest micro-batch, or the
//! optimizer-state sharding factor, that brings the predicted peak under
//! capacity. No other tool says this; the agent can, because step 1 showed
//! it how much memory the activations of one micro-batch take.
//!
//! # Rules
//!
//! With `over = predicted peak − capacity > 0` (device bytes):
//!
//! * **Micro-batch.** `activation` is step 1's forward/backward peak above
//!   the memory at step begin ([`crate::divergence::activation_peak_bytes`],
//!   in the prediction's basis units); per sample it is
//!   `floor(activation / micro_batch_size)` (the client reports the
//!   micro-batch size). Activation memory is linear in the micro-batch, so
//!   `k = ceil(over / per_sample)` fewer samples remove at least `over`:
//!   `fits_with_micro_batch_size = micro_batch_size − k` when that is at
//!   least 1. Only when the binding term of the prediction is a
//!   forward/backward one, and only when the optimizer-phase peak (which a
//!   smaller micro-batch does not lower) fits: `optimizer_phase_peak +
//!   (predicted peak − basis peak) ≤ capacity`. Allocator bytes are taken as
//!   device bytes one for one, which errs small (the caching allocator
//!   reserves at least as much as it hands out, so the saving is at least
//!   the allocated one). The activation peak includes gradients backward has
//!   made by then, which also errs small.
//! * **Sharding.** State `S` sharded over `f0` ranks today (the reported or
//!   inferred factor, else 1) becomes `S × f0 / f` over `f` ranks, saving
//!   `S − S × f0 / f`. The smallest `f > f0` with a saving of at least
//!   `over` is `ceil(S × f0 / (S − over))`, when `S > over` and the binding
//!   term holds the state (a forward/backward term).

use serde::{Deserialize, Serialize};

use crate::predict::BindingTerm;

/// What the prediction knew about fitting, and what would fit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhatWouldFit {
    /// The micro-batch size the client reported (samples per forward).
    pub micro_batch_size: Option<u32>,
    /// Step 1's forward/backward peak above the memory at step begin, in the
    /// prediction's basis units.
    pub activation_bytes: Option<u64>,
    /// `activation_bytes / micro_batch_size`, rounded down.
    pub activation_bytes_per_sample: Option<u64>,
    /// Predicted peak − capacity when step 2 will not fit, device bytes.
    pub over_capacity_bytes: Option<u64>,
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
    /// Optimizer state in the prediction, basis units.
    pub state_bytes: u64,
    /// Sharding factor the state already has (1 = none).
    pub sharding_factor: u32,
    /// Step 1's activation peak, basis units.
    pub activation_bytes: Option<u64>,
    /// Reported micro-batch size.
    pub micro_batch_size: Option<u32>,
}

/// Applies the rules of the module documentation.
pub fn what_would_fit(i: &FitInputs) -> WhatWouldFit {
    let per_sample = i
        .activation_bytes
        .zip(i.micro_batch_size.filter(|&m| m > 0))
        .map(|(a, m)| a / u64::from(m));
    let over = (i.capacity_bytes > 0 && i.predicted_peak_bytes > i.capacity_bytes)
        .then(|| i.predicted_peak_bytes - i.capacity_bytes);
    let forward_backward = matches!(
        i.binding,
        BindingTerm::FirstMicroBatch | BindingTerm::LaterMicroBatches
    );
    let to_device = i.predicted_peak_bytes.saturating_sub(i.basis_peak_bytes);
    let optimizer_fits = i
        .optimizer_phase_peak_bytes
        .is_none_or(|o| o.saturating_add(to_device) <= i.capacity_bytes);
    let micro_batch = over
        .zip(per_sample.filter(|&p| p > 0))
        .zip(i.micro_batch_size)
        .filter(|_| forward_backward && optimizer_fits)
        .and_then(|((over, per), mbs)| {
            let fewer = over.div_ceil(per);
            u64::from(mbs)
                .checked_sub(fewer)
                .filter(|&m| m >= 1)
                .map(|m| m as u32)
        });
    let f0 = u64::from(i.sharding_factor.max(1));
    let sharding = over
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
            state_bytes: 32 * GB,
            sharding_factor: 1,
            activation_bytes: Some(32 * GB),
            micro_batch_size: Some(8),
        }
    }

    #[test]
    fn over_by_6_gb_at_4_gb_per_sample_fits_with_6_samples_or_sharding_over_2() {
        let f = what_would_fit(&base());
        assert_eq!(f.over_capacity_bytes, Some(6 * GB));
        assert_eq!(f.activation_bytes_per_sample, Some(4 * GB));
        // ceil(6 / 4) = 2 samples fewer: 8 − 2 = 6.
        assert_eq!(f.fits_with_micro_batch_size, Some(6));
        // ceil(32 × 1 / (32 − 6)) = ceil(1.23) = 2: 16 GB of state saved.
        assert_eq!(f.fits_with_sharding_factor, Some(2));
    }

    #[test]
    fn sharding_already_in_place_needs_a_larger_factor() {
        // 2 GB of state per rank over 4 ranks today, 1.5 GB over: 2 × 4 / 0.5 = 16.
        let f = what_would_fit(&FitInputs {
            state_bytes: 2 * GB,
            sharding_factor: 4,
            predicted_peak_bytes: 80 * GB + 3 * GB / 2,
            ..base()
        });
        assert_eq!(f.fits_with_sharding_factor, Some(16));
        // State smaller than the excess: no sharding is enough.
        let f = what_would_fit(&FitInputs {
            state_bytes: 5 * GB,
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
        // 30 GB over at 4 GB/sample: 8 fewer than 8 leaves none.
        let f = what_would_fit(&FitInputs {
            predicted_peak_bytes: 110 * GB,
            basis_peak_bytes: 108 * GB,
            ..base()
        });
        assert_eq!(f.fits_with_micro_batch_size, None);
        // The optimizer phase (79 + 2 GB) does not shrink with the micro-batch.
        let f = what_would_fit(&FitInputs {
            optimizer_phase_peak_bytes: Some(79 * GB),
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
