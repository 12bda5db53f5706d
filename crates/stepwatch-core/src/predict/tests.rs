use super::*;

use crate::timeline::{SampleEdges, SampleStats};

fn phase(kind: PhaseKind, allocated: Option<(u64, u64)>, nvml_peak: Option<u64>) -> PhaseRecord {
    let stats = |current: u64, peak: u64| AllocatorStats {
        allocated_bytes: current,
        allocated_peak_bytes: peak,
        reserved_bytes: peak,
        reserved_peak_bytes: peak,
        active_bytes: current,
        active_peak_bytes: peak,
        num_alloc_retries: 0,
    };
    let mut nvml = SampleStats::default();
    let mut edges = SampleEdges::default();
    if let Some(used) = nvml_peak {
        nvml.add(used);
        edges.add(1, used);
    }
    PhaseRecord {
        phase: kind,
        micro_batch: 0,
        start_monotonic_ns: 0,
        end_monotonic_ns: Some(1),
        allocator_at_start: allocated.map(|(start, _)| stats(start, start)),
        allocator_at_end: allocated.map(|(end, peak)| stats(end, peak)),
        device_at_start: None,
        nvml,
        nvml_edges: edges,
        credited: true,
    }
}

#[test]
fn the_basis_is_the_allocator_when_forward_or_backward_has_its_figures() {
    let with_allocator = [
        phase(PhaseKind::Forward, Some((100, 300)), Some(900)),
        phase(PhaseKind::Backward, Some((300, 400)), None),
    ];
    let view = Step1View::of(&with_allocator).unwrap();
    assert_eq!(view.basis, PredictionBasis::Allocator);
    assert_eq!(view.peaks().first_micro_batch_peak_bytes, 400);

    let nvml_only = [
        phase(PhaseKind::Forward, None, Some(900)),
        // An optimizer phase's figures do not make the basis.
        phase(PhaseKind::Optimizer, Some((0, 50)), None),
    ];
    let view = Step1View::of(&nvml_only).unwrap();
    assert_eq!(view.basis, PredictionBasis::NvmlOnly);
    assert_eq!(view.peaks().first_micro_batch_peak_bytes, 900);

    let nothing = [phase(PhaseKind::Optimizer, Some((0, 50)), Some(70))];
    assert!(Step1View::of(&nothing).is_none());
}

#[test]
fn micro_batches_after_the_first_backward_are_the_later_group() {
    // Two micro-batches: forward 500, backward 600, then forward 800,
    // backward 700, then the optimizer at 650.
    let phases = [
        phase(PhaseKind::Forward, Some((100, 500)), None),
        phase(PhaseKind::Backward, Some((500, 600)), None),
        phase(PhaseKind::Forward, Some((200, 800)), None),
        phase(PhaseKind::Backward, Some((800, 700)), None),
        phase(PhaseKind::Optimizer, Some((300, 650)), None),
    ];
    let peaks = Step1View::of(&phases).unwrap().peaks();
    assert_eq!(peaks.first_micro_batch_peak_bytes, 600);
    assert_eq!(peaks.later_micro_batches_peak_bytes, Some(800));
    assert_eq!(peaks.optimizer_phase_peak_bytes, Some(650));
    assert_eq!(peaks.step1_peak_bytes, 800);
}

fn adam(parameters: u64, sharding: u32) -> ModelFacts {
    ModelFacts {
        optimizer: OptimizerKind::Adam,
        parameter_count: Some(parameters),
        sharding_factor: Some(sharding),
        ..ModelFacts::default()
    }
}

#[test]
fn state_is_the_measured_jump_and_names_the_sharding_it_implies() {
    let config = PredictConfig::default();
    // 1 M parameters × 8 B = 8 MB unsharded; a jump of 2 MB is a
    // sharding of 4 that the facts did not report.
    let state = optimizer_state(
        &adam(1_000_000, 1),
        PredictionBasis::Allocator,
        Some(2_000_000),
        &config,
    );
    assert_eq!(state.bytes, 2_000_000);
    assert_eq!(state.source, StateSource::MeasuredJump);
    assert_eq!(state.facts, Some(8_000_000));
    assert_eq!(state.inferred_sharding_factor, Some(4));
    // Foreach Adam's temporaries: half the facts state.
    assert_eq!(state.temporaries, 4_000_000);
}

#[test]
fn no_jump_means_precreated_state_on_the_allocator_and_unseen_state_on_nvml() {
    let config = PredictConfig::default();
    let facts = adam(1_000_000, 2);
    let allocator = optimizer_state(&facts, PredictionBasis::Allocator, Some(0), &config);
    assert_eq!(
        (allocator.bytes, allocator.source),
        (0, StateSource::DetectedPrecreated)
    );
    // On NVML a zero jump proves nothing: the facts' 4 MB (8 MB / 2) hold.
    let nvml = optimizer_state(&facts, PredictionBasis::NvmlOnly, Some(0), &config);
    assert_eq!(
        (nvml.bytes, nvml.source),
        (4_000_000, StateSource::ModelFacts)
    );
    // Without facts to size it, NVML says what it could not see.
    let unsized_state = optimizer_state(
        &ModelFacts::default(),
        PredictionBasis::NvmlOnly,
        Some(0),
        &config,
    );
    assert_eq!(unsized_state.source, StateSource::UnseenOnNvml);
}

#[test]
fn the_binding_term_is_the_largest_and_ties_go_to_the_earlier_one() {
    let terms = Terms {
        first_micro_batch: 700,
        later_micro_batches: None,
        optimizer_phase: Some(700),
        step1_peak: 650,
        first_forward_beside_gradients: Some(699),
        optimizer_estimate: None,
    };
    assert_eq!(terms.binding_max(), (700, BindingTerm::FirstMicroBatch));
    let terms = Terms {
        later_micro_batches: Some(701),
        ..terms
    };
    assert_eq!(terms.binding_max(), (701, BindingTerm::LaterMicroBatches));
}

#[test]
fn the_inputs_serialize_flat_in_their_order_and_read_back() {
    let step1 = StepRecord {
        step: 1,
        begin_monotonic_ns: 0,
        begin_wall_ns: 0,
        end_monotonic_ns: Some(10),
        end_wall_ns: None,
        outcome: StepOutcome::Completed,
        phases: vec![
            phase(PhaseKind::Forward, Some((100, 300)), Some(900)),
            phase(PhaseKind::Backward, Some((300, 400)), None),
            phase(PhaseKind::Optimizer, Some((400, 450)), None),
        ],
        nvml_before_begin: None,
        device_at_end: None,
        batch: None,
    };
    let from = PredictFrom {
        facts: &ModelFacts::default(),
        capacity_bytes: 10_000,
        other_process_bytes: 0,
        extras: StepOneExtras::default(),
        config: &PredictConfig::default(),
    };
    let prediction = predict(&step1, from).unwrap();
    let json = serde_json::to_string(&prediction.inputs).unwrap();
    // The HTTP API's `inputs`: one flat object, in this order.
    let keys = [
        "basis",
        "step",
        "step_outcome",
        "open_phase",
        "optimizer_phase_closed",
        "first_micro_batch_peak_bytes",
        "later_micro_batches_peak_bytes",
        "optimizer_phase_peak_bytes",
        "step1_peak_bytes",
        "state_bytes",
        "state_source",
        "measured_jump_bytes",
        "facts_state_bytes",
        "state_bytes_per_parameter",
        "sharding_factor",
        "inferred_sharding_factor",
        "grads_persistent",
        "grad_bytes",
        "grads_source",
        "binding",
        "basis_peak_bytes",
        "basis_peak_at_most_bytes",
        "reserved_ratio",
        "step1_reserved_peak_bytes",
        "cache_at_optimizer_begin_bytes",
        "state_from_cache_bytes",
        "layout_allowance_fraction",
        "layout_allowance_bytes",
        "layout_snapshots",
        "reserved_at_optimizer_end_bytes",
        "layout_snapshots_set_aside",
        "predicted_reserved_bytes",
        "allocator_replay",
        "overhead_bytes",
        "overhead_source",
        "process_overhead_bytes",
        "nvml_overhead_bytes",
        "device_total_bytes",
        "step1_nvml_peak_bytes",
        "capacity_bytes",
        "other_process_bytes",
        "optimizer_temporaries_bytes",
        "optimizer_phase_estimate_bytes",
        "basis_limits",
        "gradients",
        "forward_grad_bytes",
    ];
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value.as_object().unwrap().len(), keys.len(), "{json}");
    let mut at = 0;
    for key in keys {
        let found = json[at..].find(&format!("\"{key}\":"));
        at += found.unwrap_or_else(|| panic!("{key} out of order in {json}")) + 1;
    }
    let back: PredictionInputs = serde_json::from_str(&json).unwrap();
    assert_eq!(back, prediction.inputs);
}
