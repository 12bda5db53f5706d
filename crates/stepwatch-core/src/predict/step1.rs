//! Reading step 1: its phases' peaks, the optimizer state (measured or from
//! the model's facts), gradients that persist, and the terms of the max.

use super::*;

/// Step 1's phases as the prediction reads them: the basis its figures are
/// taken in, and the split into the first micro-batch group (up to and
/// including the first backward) and the later micro-batches.
pub(super) struct Step1View<'a> {
    pub(super) phases: &'a [PhaseRecord],
    pub(super) basis: PredictionBasis,
    pub(super) first_backward: Option<usize>,
}

/// A predicate over step 1's phases, by position and record.
type PhaseFilter<'f> = &'f dyn Fn(usize, &PhaseRecord) -> bool;

impl<'a> Step1View<'a> {
    /// The allocator basis when a forward or backward phase has allocator
    /// figures, else NVML when one has samples; None when neither has any.
    pub(super) fn of(phases: &'a [PhaseRecord]) -> Option<Self> {
        let forward_backward = || phases.iter().filter(|p| is_forward_backward(p));
        let basis = if forward_backward().any(|p| allocator_peak(p).is_some()) {
            PredictionBasis::Allocator
        } else if forward_backward().any(|p| nvml_peak(p).is_some()) {
            PredictionBasis::NvmlOnly
        } else {
            return None;
        };
        Some(Self {
            phases,
            basis,
            first_backward: phases.iter().position(|p| p.phase == PhaseKind::Backward),
        })
    }

    pub(super) fn in_first_group(&self, i: usize) -> bool {
        self.first_backward.is_none_or(|b| i <= b)
    }

    pub(super) fn is_first_group_forward_backward(&self, i: usize, p: &PhaseRecord) -> bool {
        is_forward_backward(p) && self.in_first_group(i)
    }

    pub(super) fn is_later_forward_backward(&self, i: usize, p: &PhaseRecord) -> bool {
        is_forward_backward(p) && !self.in_first_group(i)
    }

    pub(super) fn is_first_forward(&self, i: usize, p: &PhaseRecord) -> bool {
        p.phase == PhaseKind::Forward && self.in_first_group(i)
    }

    /// A phase's peak in basis units.
    pub(super) fn figure(&self, p: &PhaseRecord) -> Option<u64> {
        match self.basis {
            PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => allocator_peak(p),
            PredictionBasis::NvmlOnly => nvml_peak(p),
        }
    }

    /// The highest figure of the phases `keep` selects.
    pub(super) fn max_where(&self, keep: PhaseFilter<'_>) -> Option<u64> {
        self.phases
            .iter()
            .enumerate()
            .filter(|(i, p)| keep(*i, p))
            .map(|(_, p)| self.figure(p))
            .fold(None, max_opt)
    }

    /// How high the same maximum can be, on the allocator basis: the
    /// figures are lower bounds, which since-start peak counters pin only in
    /// the phases that raise the high-water mark (see `crate::profile`).
    pub(super) fn bounds_where(&self, keep: PhaseFilter<'_>) -> Option<PeakBounds> {
        self.phases
            .iter()
            .enumerate()
            .filter(|(i, p)| keep(*i, p))
            .filter_map(|(_, p)| phase_allocator_peak_bounds(p).map(|(a, _)| a))
            .reduce(PeakBounds::max)
    }

    pub(super) fn peaks(&self) -> StepOnePeaks {
        StepOnePeaks {
            first_micro_batch_peak_bytes: self
                .max_where(&|i, p| self.is_first_group_forward_backward(i, p))
                .unwrap_or(0),
            later_micro_batches_peak_bytes: self
                .max_where(&|i, p| self.is_later_forward_backward(i, p)),
            optimizer_phase_peak_bytes: self.max_where(&|_, p| p.phase == PhaseKind::Optimizer),
            step1_peak_bytes: self.max_where(&|_, _| true).unwrap_or(0),
        }
    }

    pub(super) fn optimizer_indices(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.phases.len()).filter(|&i| self.phases[i].phase == PhaseKind::Optimizer)
    }

    /// Step 1 has an optimizer phase and every one has closed.
    pub(super) fn optimizer_phase_closed(&self) -> bool {
        self.optimizer_indices().next().is_some()
            && self
                .optimizer_indices()
                .all(|i| self.phases[i].end_monotonic_ns.is_some())
    }

    /// The jump across step 1's optimizer phases, summed.
    pub(super) fn measured_jump(&self) -> Option<i64> {
        self.optimizer_indices()
            .map(|i| jump_across(self.phases, i, self.basis))
            .sum()
    }

    pub(super) fn first_forward(&self) -> Option<&'a PhaseRecord> {
        self.phases.iter().find(|p| p.phase == PhaseKind::Forward)
    }

    /// What step 1's first forward made (its peak above its begin), in
    /// basis units: the activations step 2's batch scales (see
    /// `larger_batch`). On NVML, above the last sample before it (of the
    /// phase before, else `nvml_before_begin`: (ns, used bytes)).
    pub(super) fn first_forward_growth(
        &self,
        nvml_before_begin: Option<(u64, u64)>,
    ) -> Option<u64> {
        let i = self
            .phases
            .iter()
            .position(|p| p.phase == PhaseKind::Forward)?;
        let forward = &self.phases[i];
        let before = match self.basis {
            PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => {
                forward.allocator_at_start?.allocated_bytes
            }
            PredictionBasis::NvmlOnly => i
                .checked_sub(1)
                .and_then(|j| self.phases[j].nvml_edges.last_bytes())
                .or(nvml_before_begin.map(|(_, used)| used))?,
        };
        Some(self.figure(forward)?.saturating_sub(before))
    }

    /// Allocator figures when step 1's first optimizer phase began.
    pub(super) fn allocator_at_optimizer_begin(&self) -> Option<AllocatorStats> {
        self.optimizer_indices()
            .next()
            .and_then(|i| self.phases[i].allocator_at_start)
    }

    /// Allocator figures when step 1's (last) optimizer phase ended.
    pub(super) fn allocator_at_optimizer_end(&self) -> Option<AllocatorStats> {
        self.optimizer_indices()
            .last()
            .and_then(|i| self.phases[i].allocator_at_end)
    }
}

pub(super) fn is_forward_backward(p: &PhaseRecord) -> bool {
    matches!(p.phase, PhaseKind::Forward | PhaseKind::Backward)
}

pub(super) fn allocator_peak(p: &PhaseRecord) -> Option<u64> {
    phase_allocator_peaks(p).map(|(allocated, _)| allocated)
}

pub(super) fn nvml_peak(p: &PhaseRecord) -> Option<u64> {
    (p.nvml.samples > 0).then_some(p.nvml.peak_bytes)
}

/// The optimizer state and the figures it was chosen from.
pub(super) struct StateFigures {
    pub(super) bytes: u64,
    pub(super) source: StateSource,
    /// From model facts, sharded.
    pub(super) facts: Option<u64>,
    pub(super) bytes_per_parameter: Option<u32>,
    pub(super) sharding: u32,
    pub(super) inferred_sharding_factor: Option<u32>,
    /// The optimizer's temporaries at its peak (see [`optimizer_temporaries`]).
    pub(super) temporaries: u64,
}

/// The optimizer state step 2 adds to step 1's forward/backward peaks (see
/// the module documentation's `state`).
pub(super) fn optimizer_state(
    facts: &ModelFacts,
    basis: PredictionBasis,
    measured_jump: Option<i64>,
    config: &PredictConfig,
) -> StateFigures {
    let bytes_per_parameter = facts
        .state_bytes_per_parameter
        .or_else(|| default_state_bytes_per_parameter(facts.optimizer));
    let sharding = facts.sharding_factor.unwrap_or(1).max(1);
    let unsharded = facts
        .parameter_count
        .zip(bytes_per_parameter)
        .map(|(n, b)| u128::from(n) * u128::from(b));
    // Without a parameter count, the family's state tensors per parameter
    // times the parameters' bytes (Adam: exp_avg and exp_avg_sq, each in
    // the parameter's dtype), when no explicit bytes per parameter say more.
    let unsharded = unsharded.or_else(|| {
        let tensors = match facts.optimizer {
            _ if facts.state_bytes_per_parameter.is_some() => None,
            OptimizerKind::Adam => Some(2),
            OptimizerKind::SgdMomentum => Some(1),
            _ => None,
        }?;
        facts.parameter_bytes.map(|b| u128::from(b) * tensors)
    });
    let facts_state = unsharded.map(|u| sat_u64(u.div_ceil(u128::from(sharding))));
    let stateful = bytes_per_parameter.map(|b| b > 0);
    let (bytes, source) = if facts.state_precreated == Some(true) {
        (0, StateSource::DeclaredPrecreated)
    } else if let Some(jump) = measured_jump {
        let jump_u = u64::try_from(jump.max(0)).unwrap_or(0);
        match basis {
            PredictionBasis::NvmlOnly if facts_state.is_some_and(|f| f > jump_u) => {
                (facts_state.unwrap_or(0), StateSource::ModelFacts)
            }
            _ if jump_u >= config.zero_jump_bytes => (jump_u, StateSource::MeasuredJump),
            PredictionBasis::NvmlOnly if stateful == Some(false) => (0, StateSource::Stateless),
            PredictionBasis::NvmlOnly => (jump_u, StateSource::UnseenOnNvml),
            PredictionBasis::Allocator | PredictionBasis::AllocatorReplay => match stateful {
                Some(true) => (0, StateSource::DetectedPrecreated),
                Some(false) => (0, StateSource::Stateless),
                None => (0, StateSource::NoJump),
            },
        }
    } else if stateful == Some(false) {
        (0, StateSource::Stateless)
    } else if let Some(f) = facts_state {
        (f, StateSource::ModelFacts)
    } else {
        (0, StateSource::Unknown)
    };
    let inferred_sharding_factor = match (source, unsharded) {
        (StateSource::MeasuredJump, Some(u)) if bytes > 0 => {
            let r = (u as f64 / bytes as f64).round();
            (r >= 2.0).then_some(r.min(f64::from(u32::MAX)) as u32)
        }
        _ => None,
    };
    StateFigures {
        bytes,
        source,
        facts: facts_state,
        bytes_per_parameter,
        sharding,
        inferred_sharding_factor,
        temporaries: optimizer_temporaries(facts, facts_state),
    }
}

/// Gradients that survive into step 2's forward, and both ways to size them.
pub(super) struct GradFigures {
    /// `grads_set_to_none == Some(false)`.
    pub(super) persistent: bool,
    /// Added to the first micro-batch term; 0 when not persistent.
    pub(super) bytes: u64,
    pub(super) source: GradsSource,
    /// Allocator basis: allocated after the first backward − before the
    /// first forward.
    pub(super) measured: Option<u64>,
    /// parameter_bytes, or parameter_count × dtype bytes.
    pub(super) facts: Option<u64>,
}

pub(super) fn persistent_gradients(view: &Step1View<'_>, facts: &ModelFacts) -> GradFigures {
    let persistent = facts.grads_set_to_none == Some(false);
    let measured = (view.basis == PredictionBasis::Allocator)
        .then(|| {
            let before = view.first_forward()?.allocator_at_start?.allocated_bytes;
            let after = view.phases[view.first_backward?]
                .allocator_at_end?
                .allocated_bytes;
            Some(after.saturating_sub(before))
        })
        .flatten();
    let from_facts = facts.parameter_bytes.or_else(|| {
        let per = if facts.precision == Precision::Bf16 {
            2
        } else {
            4
        };
        facts.parameter_count.map(|n| n.saturating_mul(per))
    });
    let (bytes, source) = if !persistent {
        (0, GradsSource::NotPersistent)
    } else if let Some(g) = measured {
        // What backward left allocated also holds the loop's variables still
        // alive then (the logits, the loss); gradients are never larger than
        // the parameters (same dtype), so the facts bound the measurement.
        match from_facts {
            Some(f) if f < g => (f, GradsSource::ModelFacts),
            _ => (g, GradsSource::Measured),
        }
    } else if let Some(g) = from_facts {
        (g, GradsSource::ModelFacts)
    } else {
        (0, GradsSource::Unknown)
    };
    GradFigures {
        persistent,
        bytes,
        source,
        measured,
        facts: from_facts,
    }
}

/// Step 1's optimizer phase, estimated until it has been measured.
pub(super) struct OptimizerEstimate {
    /// Allocated at the phase's begin + state made in it + temporaries.
    pub(super) estimate: Option<u64>,
    /// What the estimate adds that step 1 has not allocated yet.
    pub(super) new_bytes: u64,
}

/// Allocator basis only (NVML cannot see what the cache serves), until the
/// phase has closed: allocated when it begins (before that: at the first
/// forward + the gradients) + the state it will create + its temporaries.
pub(super) fn optimizer_phase_estimate(
    view: &Step1View<'_>,
    state: &StateFigures,
    grads: &GradFigures,
    optimizer_phase_closed: bool,
) -> OptimizerEstimate {
    let new_state = if state.source == StateSource::ModelFacts {
        state.bytes
    } else {
        0
    };
    let new_bytes = new_state.saturating_add(state.temporaries);
    let estimate =
        (view.basis == PredictionBasis::Allocator && !optimizer_phase_closed && new_bytes > 0)
            .then(|| {
                let at_begin = match view.optimizer_indices().next() {
                    Some(i) => view.phases[i].allocator_at_start?.allocated_bytes,
                    None => view
                        .first_forward()?
                        .allocator_at_start?
                        .allocated_bytes
                        .saturating_add(grads.measured.or(grads.facts)?),
                };
                Some(at_begin.saturating_add(new_bytes))
            })
            .flatten();
    OptimizerEstimate {
        estimate,
        new_bytes,
    }
}

/// The terms of the max (see the module documentation's `basis_peak`), in
/// basis units; a term that does not apply is None.
pub(super) struct Terms {
    pub(super) first_micro_batch: u64,
    pub(super) later_micro_batches: Option<u64>,
    pub(super) optimizer_phase: Option<u64>,
    pub(super) step1_peak: u64,
    pub(super) first_forward_beside_gradients: Option<u64>,
    /// The optimizer-phase estimate alone, for the upper bound.
    pub(super) optimizer_estimate: Option<u64>,
}

impl Terms {
    pub(super) fn of(
        view: &Step1View<'_>,
        peaks: &StepOnePeaks,
        state: &StateFigures,
        grads: &GradFigures,
        optimizer: &OptimizerEstimate,
        forward_grads: u64,
    ) -> Self {
        // Gradients freed only just before backward live through step 2's
        // forward, on top of its activations and the state.
        let first_forward_beside_gradients = (forward_grads > 0)
            .then(|| view.max_where(&|i, p| view.is_first_forward(i, p)))
            .flatten()
            .map(|f| f.saturating_add(state.bytes).saturating_add(forward_grads));
        Self {
            first_micro_batch: peaks
                .first_micro_batch_peak_bytes
                .saturating_add(state.bytes)
                .saturating_add(grads.bytes),
            later_micro_batches: peaks
                .later_micro_batches_peak_bytes
                .map(|p| p.saturating_add(state.bytes)),
            optimizer_phase: max_opt(peaks.optimizer_phase_peak_bytes, optimizer.estimate),
            step1_peak: peaks.step1_peak_bytes,
            first_forward_beside_gradients,
            optimizer_estimate: optimizer.estimate,
        }
    }

    /// The largest term and which it is; ties go to the earlier term.
    pub(super) fn binding_max(&self) -> (u64, BindingTerm) {
        let terms = [
            (Some(self.first_micro_batch), BindingTerm::FirstMicroBatch),
            (self.later_micro_batches, BindingTerm::LaterMicroBatches),
            (self.optimizer_phase, BindingTerm::OptimizerPhase),
            (Some(self.step1_peak), BindingTerm::Step1Peak),
            (
                self.first_forward_beside_gradients,
                BindingTerm::FirstForwardBesideGradients,
            ),
        ];
        terms.iter().filter_map(|(v, t)| v.map(|v| (v, *t))).fold(
            (0, BindingTerm::FirstMicroBatch),
            |best, (v, t)| if v > best.0 { (v, t) } else { best },
        )
    }

    /// The same max over the terms' upper bounds, on the allocator basis
    /// (NVML samples bound nothing: what happened between them is unseen).
    /// A group with no figure (first micro-batch, step 1) counts as
    /// unbounded, as in the max it counts 0.
    pub(super) fn upper_bound(
        &self,
        view: &Step1View<'_>,
        state: &StateFigures,
        grads: &GradFigures,
        forward_grads: u64,
    ) -> Option<u64> {
        if view.basis != PredictionBasis::Allocator {
            return None;
        }
        let unbounded = PeakBounds {
            at_least: 0,
            at_most: None,
        };
        let first = view
            .bounds_where(&|i, p| view.is_first_group_forward_backward(i, p))
            .unwrap_or(unbounded);
        let bounds = [
            Some(first.plus(state.bytes.saturating_add(grads.bytes))),
            view.bounds_where(&|i, p| view.is_later_forward_backward(i, p))
                .map(|b| b.plus(state.bytes)),
            view.bounds_where(&|_, p| p.phase == PhaseKind::Optimizer),
            self.optimizer_estimate.map(|e| PeakBounds {
                at_least: e,
                at_most: Some(e),
            }),
            Some(view.bounds_where(&|_, _| true).unwrap_or(unbounded)),
            self.first_forward_beside_gradients.and_then(|_| {
                view.bounds_where(&|i, p| view.is_first_forward(i, p))
                    .map(|b| b.plus(state.bytes.saturating_add(forward_grads)))
            }),
        ];
        bounds
            .iter()
            .flatten()
            .map(|b| b.at_most)
            .collect::<Option<Vec<u64>>>()
            .and_then(|m| m.into_iter().max())
    }
}
