//! The prediction in words: the formula with its figures.

use super::*;

pub(super) fn sat_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

pub(super) fn sat_i64(v: i128) -> i64 {
    v.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// Where the state figure came from, in words.
pub(super) fn state_words(source: StateSource) -> &'static str {
    match source {
        StateSource::MeasuredJump => "the jump measured across step 1's optimizer phase",
        StateSource::ModelFacts => {
            "parameters × state bytes per parameter ÷ sharding factor, from the model facts"
        }
        StateSource::DeclaredPrecreated => "none added: the client declared it made before step 1",
        StateSource::DetectedPrecreated => {
            "none added: no jump across step 1's optimizer phase, so it existed before step 1"
        }
        StateSource::Stateless => "none: the optimizer keeps no state",
        StateSource::NoJump => "none: no jump across step 1's optimizer phase",
        StateSource::Unknown => "unknown until step 1's optimizer phase ends",
        StateSource::UnseenOnNvml => {
            "not seen: device memory barely moved across step 1's optimizer phase, and it cannot \
             tell state served from the allocator's cache from no state"
        }
    }
}

/// Where the gradient figure came from, in words.
pub(super) fn grads_words(source: GradsSource) -> &'static str {
    match source {
        GradsSource::NotPersistent => "none kept: gradients are set to None between steps",
        GradsSource::Measured => "kept between steps, measured across step 1's first backward",
        GradsSource::ModelFacts => "kept between steps, sized from the model facts",
        GradsSource::Unknown => "kept between steps, size unknown",
    }
}

/// Which term set the prediction, in words.
pub(super) fn binding_words(term: BindingTerm) -> &'static str {
    match term {
        BindingTerm::FirstMicroBatch => "set by step 2's first micro-batch on top of the state",
        BindingTerm::LaterMicroBatches => {
            "set by the later micro-batches (gradient accumulation) on top of the state"
        }
        BindingTerm::OptimizerPhase => "set by step 1's optimizer phase",
        BindingTerm::Step1Peak => "set by step 1's own peak",
        BindingTerm::FirstForwardBesideGradients => {
            "set by step 2's first forward beside step 1's gradients, which the framework frees \
             only before backward"
        }
    }
}

/// The formula with its figures, in decimal GB (see [`crate::units::gb`]).
pub(super) fn explain(i: &PredictionInputs, device: u64, headroom: Option<i64>) -> String {
    let g = |b: u64| gb(b as f64);
    let unit = match i.basis {
        PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => "allocated",
        PredictionBasis::NvmlOnly => "device",
    };
    let mut s = format!(
        "{unit} peak = max(first micro-batch {} + optimizer state {} ({}) + gradients {} ({})",
        g(i.peaks.first_micro_batch_peak_bytes),
        g(i.state.state_bytes),
        state_words(i.state.state_source),
        g(i.grads.grad_bytes),
        grads_words(i.grads.grads_source),
    );
    if let Some(l) = i.peaks.later_micro_batches_peak_bytes {
        let _ = write!(s, ", later micro-batches {} + state", g(l));
    }
    if let Some(o) = i.peaks.optimizer_phase_peak_bytes {
        let _ = write!(s, ", optimizer phase {}", g(o));
    }
    let _ = write!(
        s,
        ", step-1 peak {}) = {}, {}",
        g(i.peaks.step1_peak_bytes),
        g(i.basis_peak_bytes),
        binding_words(i.binding)
    );
    if let Some(most) = i
        .basis_peak_at_most_bytes
        .filter(|&m| m > i.basis_peak_bytes)
    {
        let _ = write!(
            s,
            ", at most {}: step 1 stayed under an earlier high-water mark of the \
             allocator's peak counters, which bound its phases' peaks but do not give them",
            g(most)
        );
    }
    if let (Some(ratio), Some(res)) = (i.reserved.reserved_ratio, i.predicted_reserved_bytes) {
        match &i.allocator_replay {
            Some(r) => {
                let _ = write!(
                    s,
                    "; reserved = steps 2-4 replayed from step 1's allocator trace: {} at step \
                     1's end, step 2 adds {} in new segments (state {} kept, gradients {} {}), \
                     steady state {}",
                    g(r.reserved_at_step1_end_bytes),
                    g(r.new_segment_bytes),
                    g(r.state_bytes),
                    g(r.grad_bytes),
                    if r.grads_persistent {
                        "kept"
                    } else {
                        "freed and made again"
                    },
                    g(r.steady_reserved_peak_bytes),
                );
                if r.loop_variable_bytes > 0 {
                    let _ = write!(
                        s,
                        "; step 1's loop variables still alive at its end ({}: the model's \
                         output, logits, loss) are taken as freed when step 2 rebinds them, {}; \
                         a loop that keeps them longer (in a list, or returned from a function \
                         after more work) makes step 2 peak up to {} higher",
                        g(r.loop_variable_bytes),
                        if r.forward_returns_known {
                            "at the earliest once step 2's model call has returned"
                        } else {
                            "where step 2's allocations place that (the client did not say \
                             where the model's forward returned)"
                        },
                        g(r.loop_variable_bytes),
                    );
                }
                match r.ddp_bucket_rebuild {
                    Some(b) if b.modelled => {
                        let _ = write!(
                            s,
                            "; DDP rebuilds its gradient buckets at step 2's first forward \
                             (replayed: {} of old buckets freed, {} buckets of {} in all made)",
                            g(b.old_bucket_bytes),
                            b.new_buckets,
                            g(b.new_bucket_bytes),
                        );
                    }
                    Some(b) => {
                        let _ = write!(
                            s,
                            "; DDP rebuilds its gradient buckets at step 2's first forward, \
                             but its old buckets ({}) were not found among the blocks alive \
                             since before step 1, so the replay leaves the rebuild out",
                            g(b.old_bucket_bytes),
                        );
                    }
                    None => {}
                }
                if let (Some(limit), Some(w)) = (r.reserved_limit_bytes, r.within_limit) {
                    if w.fits {
                        let _ = write!(
                            s,
                            "; within the GPU's {} they fit after {} cache release(s), \
                             steady state {}",
                            g(limit),
                            w.alloc_retries,
                            g(w.steady_reserved_peak_bytes)
                        );
                    } else {
                        let _ = write!(
                            s,
                            "; within the GPU's {} they do not fit even after releasing the cache",
                            g(limit)
                        );
                    }
                }
                let _ = write!(s, "; at least the step-1 reserved peak: {}", g(res));
            }
            None => match &i.layout.layout_snapshots {
                Some(l) => {
                    let _ = write!(
                        s,
                        "; reserved = max({} reserved when step 1's optimizer ended + {} of \
                         new segments for the cached blocks the optimizer state split ({} of \
                         the {} step 2 asks for again find no free block large enough, from \
                         the allocator's segment snapshots at step 1's optimizer begin and \
                         end{}), × {ratio:.4} (step 1's reserved / allocated), step-1 reserved \
                         peak) = {}",
                        g(i.layout.reserved_at_optimizer_end_bytes.unwrap_or(0)),
                        g(i.layout.layout_allowance_bytes),
                        match l.blocks_needing_new_segments {
                            1 => "1 block".to_string(),
                            n => format!("{n} blocks"),
                        },
                        g(l.cached_at_begin_bytes),
                        if l.capped_at_reserved_limit {
                            "; cut to the reserved limit, past which the allocator releases \
                             its cache and retries before it fails: whether that frees enough \
                             the snapshots cannot show, so step 2 is at risk of running out"
                        } else {
                            ""
                        },
                        g(res)
                    );
                }
                None => {
                    let _ = write!(
                        s,
                        "; reserved = max(× {ratio:.4} (step 1's reserved / allocated) + layout \
                         allowance {} ({:.1}% of the state made from cached blocks, {}), step-1 \
                         reserved peak) = {}",
                        g(i.layout.layout_allowance_bytes),
                        100.0 * i.layout.layout_allowance_fraction,
                        g(i.reserved.state_from_cache_bytes),
                        g(res)
                    );
                    if let Some(why) = i.layout.layout_snapshots_set_aside {
                        let _ = write!(
                            s,
                            " (the allocator's segment snapshots were set aside: {})",
                            match why {
                                LayoutSetAside::GradientAccumulation => {
                                    "with gradient accumulation step 2's micro-batches take \
                                     turns with the cache"
                                }
                                LayoutSetAside::DdpBucketRebuild => {
                                    "DDP's bucket rebuild in step 2 frees a block they cannot \
                                     show"
                                }
                            }
                        );
                    }
                }
            },
        }
        match (i.overhead.overhead_bytes, i.overhead.overhead_source) {
            (Some(oh), Some(OverheadSource::ClientDeviceMemory)) => {
                let _ = write!(
                    s,
                    "; + overhead {} (device used − reserved at step 1's markers, from the \
                     CUDA driver's free and total memory: this process's CUDA context and \
                     workspaces {}, other processes {} by NVML's process list), at least the step-1 NVML peak",
                    g(oh),
                    g(oh.saturating_sub(i.other_process_bytes)),
                    g(i.other_process_bytes.min(oh)),
                );
            }
            (Some(oh), _) => {
                let _ = write!(
                    s,
                    "; + overhead {} (NVML − reserved, bounded from NVML samples next to step \
                     1's markers: CUDA context, workspaces, other processes), at least the \
                     step-1 NVML peak",
                    g(oh)
                );
            }
            (None, _) => {
                let _ = write!(
                    s,
                    "; + assumed overhead + other processes {}",
                    g(i.other_process_bytes)
                );
            }
        }
    }
    if let Some(r) = &i.batch_revision {
        let _ = write!(s, "; {}", r.describe());
    }
    let _ = write!(s, "; predicted device peak {}", g(device));
    if let Some(h) = headroom {
        let sign = if h < 0 { "−" } else { "" };
        let _ = write!(
            s,
            "; headroom = capacity {} − predicted peak = {sign}{}",
            g(i.capacity_bytes),
            g(h.unsigned_abs())
        );
    }
    s
}
