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
    assert_eq!(view.peaks().first, 400);

    let nvml_only = [
        phase(PhaseKind::Forward, None, Some(900)),
        // An optimizer phase's figures do not make the basis.
        phase(PhaseKind::Optimizer, Some((0, 50)), None),
    ];
    let view = Step1View::of(&nvml_only).unwrap();
    assert_eq!(view.basis, PredictionBasis::NvmlOnly);
    assert_eq!(view.peaks().first, 900);

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
    assert_eq!(peaks.first, 600);
    assert_eq!(peaks.later, Some(800));
    assert_eq!(peaks.optimizer, Some(650));
    assert_eq!(peaks.step1, 800);
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
