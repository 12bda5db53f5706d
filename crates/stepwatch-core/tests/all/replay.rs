//! Step 2 replayed from a step-1 allocator trace: the fragmentation case it
//! exists for, gradients freed or kept, the tracker's use of it, and bad
//! traces refused.

use stepwatch_core::allocator::{BlockLayout, CachingAllocator, Pool, SegmentLayout};
use stepwatch_core::MAX_TRACE_EVENTS;
use stepwatch_core::*;
use stepwatch_testkit as kit;

const MIB: u64 = 1 << 20;

/// Records a step on a [`CachingAllocator`] the way a client's trace would.
struct Recorder {
    alloc: CachingAllocator,
    events: Vec<AllocatorEvent>,
    phase: PhaseKind,
    /// The stream the next allocations are made on.
    stream: u64,
}

impl Recorder {
    /// Records on `alloc`, from step 1's prologue on the default stream.
    fn on(alloc: CachingAllocator) -> Self {
        Self {
            alloc,
            events: Vec::new(),
            phase: PhaseKind::Prologue,
            stream: 0,
        }
    }

    /// With `bytes` allocated before the trace begins (weights, a bucket),
    /// and so not in it.
    fn holding(mut self, bytes: u64) -> Self {
        self.alloc.malloc(bytes, u64::MAX).unwrap();
        self
    }

    fn malloc(&mut self, bytes: u64) -> allocator::AllocId {
        let id = self.alloc.malloc_on(bytes, self.stream, u64::MAX).unwrap();
        self.events.push(AllocatorEvent {
            action: AllocatorAction::Alloc,
            address: self.alloc.address_of(id).unwrap(),
            size: bytes,
            phase: self.phase,
            stream: self.stream,
        });
        id
    }

    /// Backward begins, freeing forward's `activations`, the newest first.
    fn backward_freeing<const N: usize>(&mut self, activations: [allocator::AllocId; N]) {
        self.phase = PhaseKind::Backward;
        for id in activations.into_iter().rev() {
            self.free(id);
        }
    }

    /// The optimizer phase makes `state` bytes of state; step 1's trace.
    fn optimizer_then_trace(&mut self, state: u64) -> AllocatorTrace {
        self.phase = PhaseKind::Optimizer;
        self.malloc(state);
        self.trace()
    }

    /// Allocates `bytes` and frees them at once: a temporary.
    fn temporary(&mut self, bytes: u64) {
        let id = self.malloc(bytes);
        self.free(id);
    }

    fn free(&mut self, id: allocator::AllocId) {
        self.events.push(AllocatorEvent {
            action: AllocatorAction::Free,
            address: self.alloc.address_of(id).unwrap(),
            size: self.alloc.block_size(id).unwrap(),
            phase: self.phase,
            stream: self.stream,
        });
        self.alloc.free(id);
    }

    /// `torch.cuda.empty_cache()`: a segment_free event per released segment.
    fn empty_cache(&mut self) {
        let before = self.alloc.layout();
        self.alloc.release_free_segments();
        let after: Vec<u64> = self.alloc.layout().iter().map(|s| s.address).collect();
        for s in before.iter().filter(|s| !after.contains(&s.address)) {
            self.events.push(AllocatorEvent {
                action: AllocatorAction::SegmentFree,
                address: s.address,
                size: s.size(),
                phase: self.phase,
                stream: s.stream,
            });
        }
    }

    fn trace(&self) -> AllocatorTrace {
        AllocatorTrace {
            step: 1,
            segments: self.alloc.layout(),
            events: self.events.clone(),
            settings: None,
            forward_returns: Vec::new(),
            torch_version: String::new(),
        }
    }
}

/// Weights, then step 1: two 40 MiB activations, backward frees them and
/// makes `grad` bytes of gradients, the optimizer makes `state` bytes.
fn step_one(grad: u64, state: u64) -> (Recorder, u64) {
    let mut r = in_forward_after_weights();
    let a = r.malloc(40 * MIB);
    let b = r.malloc(40 * MIB);
    r.backward_freeing([a, b]);
    if grad > 0 {
        r.malloc(grad);
    }
    r.phase = PhaseKind::Optimizer;
    if state > 0 {
        r.malloc(state);
    }
    let reserved_peak = r.alloc.peaks().total.reserved;
    (r, reserved_peak)
}

#[test]
fn state_carved_from_cached_activations_forces_new_segments_in_step_2() {
    // 30 MiB of state lands in one of the two free 40 MiB activation blocks.
    let (r, step1_reserved) = step_one(0, 30 * MIB);
    assert_eq!(step1_reserved, 144 * MIB, "weights + two 40 MiB segments");
    let replay = replay_step2(&r.trace(), false).unwrap();
    assert_eq!(replay.reserved_at_step1_end_bytes, 144 * MIB);
    assert_eq!(replay.state_bytes, 30 * MIB);
    // Step 2's second activation no longer fits the split block: a new segment.
    assert_eq!(replay.new_segment_bytes, 40 * MIB);
    assert_eq!(replay.reserved_peak_bytes, 184 * MIB);
    assert_eq!(replay.allocated_peak_bytes, (64 + 30 + 80) * MIB);

    // The same step without state needs nothing new.
    let (r, _) = step_one(0, 0);
    let replay = replay_step2(&r.trace(), false).unwrap();
    assert_eq!(replay.new_segment_bytes, 0);
    assert_eq!(replay.state_bytes, 0);
}

#[test]
fn within_the_gpus_limit_releasing_the_cache_can_make_step_2_fit() {
    // Forward also makes a 20 MiB temporary in a segment of its own, free by
    // the end of step 1. State (30 MiB) splits activation A's block.
    let mut r = in_forward_after_weights();
    let a = r.malloc(40 * MIB);
    r.temporary(20 * MIB);
    let b = r.malloc(40 * MIB);
    r.backward_freeing([a, b]);
    let trace = r.optimizer_then_trace(30 * MIB);

    // Unlimited, step 2 adds a 40 MiB segment: 164 + 40.
    let free = replay_step2(&trace, false).unwrap();
    assert_eq!(free.reserved_peak_bytes, 204 * MIB);
    assert_eq!(free.within_limit, None);

    // Within 190 MiB, PyTorch releases the wholly free 20 MiB segment and
    // retries: step 2 fits, peaking at 184 MiB.
    let tight = replay_step2_within(&trace, false, Some(190 * MIB)).unwrap();
    assert_eq!(tight.reserved_peak_bytes, 204 * MIB, "what it would need");
    assert_eq!(
        tight.within_limit,
        Some(LimitedReplay {
            fits: true,
            reserved_peak_bytes: 184 * MIB,
            steady_reserved_peak_bytes: 184 * MIB,
            alloc_retries: 1,
        })
    );
    assert_eq!(tight.expected_reserved_peak_bytes(), 184 * MIB);

    // Within 180 MiB not even that is enough.
    let short = replay_step2_within(&trace, false, Some(180 * MIB)).unwrap();
    assert!(short
        .within_limit
        .is_some_and(|w| !w.fits && w.alloc_retries == 1));
    assert_eq!(short.expected_reserved_peak_bytes(), 204 * MIB);
}

#[test]
fn a_cache_released_every_step_peaks_in_turns_and_the_steady_peak_is_the_highest() {
    // Step 1: forward makes A (40 MiB, the loop's variable: alive until
    // step 2's A is made and its statement is done) and a 30 MiB temporary
    // B; backward a 50 MiB temporary G and a 20 MiB gradient H (set to None
    // between steps); the optimizer two 40 MiB tensors of state. Step 1's
    // layout: weights 64, A 40, [H 20 | 10 free], [state 40 | 10 free] (the
    // state took G's freed segment), state 40: 224 MiB.
    let mut r = in_forward_after_weights();
    let _a = r.malloc(40 * MIB);
    r.temporary(30 * MIB);
    r.phase = PhaseKind::Backward;
    let g = r.malloc(50 * MIB);
    let _h = r.malloc(20 * MIB);
    r.free(g);
    r.phase = PhaseKind::Optimizer;
    r.malloc(40 * MIB);
    r.malloc(40 * MIB);
    let trace = r.trace();
    assert_eq!(r.alloc.reserved(), 224 * MIB);

    // Within 294 MiB, by hand (free blocks before each step: step 2: H's
    // 30 and a 10; step 3: 10, H's 20 and G's 50; step 4: 10, 10, 20, 50):
    // - step 2: A takes a new 40 (264); G finds no 50 and would need 314,
    //   so the cache goes (B's 30, step 1's A's 40: 194) and G and H take
    //   new 50 and 20 (264). Peak 264, one release.
    // - step 3: A splits G's 50, B takes a new 30 (294); G would need
    //   344: H's 20, B's 30 and step 2's A's 40 go (204); new G 50, H 20
    //   (274). Peak 294, one release.
    // - step 4: A splits G's 50; B would need 304: H's 20 goes (254), a
    //   new 30 (284); step 3's A frees a whole 50 that G takes, H splits
    //   B's 30. Peak 284, one release.
    // The cache never settles within these steps; the last step's 284 is
    // not what the GPU must hold in steady state: step 3 reached 294.
    let tight = replay_step2_within(&trace, false, Some(294 * MIB)).unwrap();
    assert_eq!(
        tight.within_limit,
        Some(LimitedReplay {
            fits: true,
            reserved_peak_bytes: 264 * MIB,
            steady_reserved_peak_bytes: 294 * MIB,
            alloc_retries: 3,
        })
    );
    assert_eq!(tight.expected_reserved_peak_bytes(), 294 * MIB);
}

#[test]
fn gradients_set_to_none_are_freed_first_and_kept_gradients_stay() {
    // 30 MiB of gradients take part of an activation block in backward.
    let (r, _) = step_one(30 * MIB, 0);
    let freed = replay_step2(&r.trace(), false).unwrap();
    assert_eq!(freed.grad_bytes, 30 * MIB);
    assert!(!freed.grads_persistent);
    assert_eq!(
        freed.new_segment_bytes, 0,
        "freed at zero_grad, the block is whole again for the activations"
    );
    let kept = replay_step2(&r.trace(), true).unwrap();
    assert!(kept.grads_persistent);
    assert_eq!(
        kept.new_segment_bytes,
        40 * MIB,
        "kept gradients split an activation block"
    );
}

#[test]
fn a_variable_alive_at_step_1s_end_is_freed_once_step_2_rebinds_it() {
    // `logits = head(x)` makes the logits (L, 100 MiB) and a matmul workspace
    // (W, 30 MiB, freed at once); the loss (B, 100 MiB) comes next. Step 1's
    // logits stay alive past the trace; the state takes W's segment.
    let mut r = in_forward_after_weights();
    let a = r.malloc(40 * MIB);
    let _logits = r.malloc(100 * MIB);
    r.temporary(30 * MIB);
    let b = r.malloc(100 * MIB);
    r.backward_freeing([a, b]);
    r.phase = PhaseKind::Optimizer;
    r.malloc(30 * MIB);
    assert_eq!(r.alloc.reserved(), 334 * MIB);

    let replay = replay_step2(&r.trace(), false).unwrap();
    // Step 2's logits take B's block; its workspace finds no free block, as
    // step 1's logits are freed only once the statement is done (a new 30 MiB
    // segment), and B then takes their block. Freed at once, they would have
    // held the workspace (no new segment); kept, B would need 100 MiB more.
    assert_eq!(replay.new_segment_bytes, 30 * MIB);
    assert_eq!(replay.reserved_peak_bytes, 364 * MIB);
    assert_eq!(replay.steady_reserved_peak_bytes, 364 * MIB);
    // Weights, state, A, both logits and the workspace.
    assert_eq!(
        replay.allocated_peak_bytes,
        (64 + 30 + 40 + 100 + 100 + 30) * MIB
    );

    // The model itself computed the loss and returned only then (`out =
    // model(x)`, the client's forward return after B): the loop's variable
    // holds step 1's logits until there, beside step 2's logits and loss.
    let mut t = r.trace();
    let after_loss = t.events.iter().position(|e| e.size == 100 * MIB).unwrap() as u64 + 4;
    t.forward_returns = vec![after_loss];
    let replay = replay_step2(&t, false).unwrap();
    assert_eq!(
        replay.allocated_peak_bytes,
        (64 + 30 + 40 + 100 + 100 + 100) * MIB
    );
}

#[test]
fn kept_gradients_are_made_again_in_step_2_and_added_in() {
    // Backward makes a 30 MiB gradient (its own segment) before it frees the
    // activation.
    let mut r = in_forward_after_weights();
    let a = r.malloc(40 * MIB);
    r.phase = PhaseKind::Backward;
    r.malloc(30 * MIB);
    r.free(a);
    let trace = r.trace();

    // Kept, the gradient stays, and step 2 makes a second one while the
    // activation lives (`AccumulateGrad` adds it in, then drops it).
    let kept = replay_step2(&trace, true).unwrap();
    assert_eq!(kept.grad_bytes, 30 * MIB);
    assert_eq!(kept.new_segment_bytes, 30 * MIB);
    assert_eq!(kept.allocated_peak_bytes, (64 + 40 + 30 + 30) * MIB);
    assert_eq!(kept.steady_reserved_peak_bytes, 164 * MIB);
    // Set to None, it is made again in its own segment.
    let freed = replay_step2(&trace, false).unwrap();
    assert_eq!(freed.new_segment_bytes, 0);
    assert_eq!(freed.allocated_peak_bytes, (64 + 40 + 30) * MIB);
}

#[test]
fn the_tracker_predicts_from_the_replay_until_step_2_begins() {
    const GB: u64 = 1_000_000_000;
    let mut tracker = Tracker::new(TrackerConfig::default());
    let info = RankInfo {
        pid: 7,
        ..kit::solo_rank("j", "GPU-a")
    };
    let key = kit::open(&mut tracker, info);
    let stats = |allocated: u64, reserved: u64| kit::alloc_bytes(allocated, allocated, reserved);
    let marker = |kind, step, t, a| Marker {
        allocator: Some(a),
        ..stepwatch_testkit::marker(kind, step, t)
    };
    tracker.gpu_samples(
        "GPU-a",
        &[GpuSample {
            monotonic_ns: 1,
            used_bytes: GB,
            capacity_bytes: 80 * GB,
        }],
    );
    let step1 = [
        marker(MarkerKind::StepBegin, 1, 10, stats(2 * GB, 2 * GB)),
        marker(MarkerKind::ForwardBegin, 1, 20, stats(2 * GB, 2 * GB)),
        marker(MarkerKind::BackwardBegin, 1, 30, stats(6 * GB, 6 * GB)),
        marker(MarkerKind::OptimizerBegin, 1, 40, stats(3 * GB, 6 * GB)),
        marker(MarkerKind::OptimizerEnd, 1, 50, stats(4 * GB, 6 * GB)),
    ];
    tracker.markers(&key, &step1, 50).unwrap();
    let before = tracker.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(before.inputs.basis, PredictionBasis::Allocator);

    let replay = Step2Replay {
        reserved_at_step1_end_bytes: 6 * GB,
        reserved_peak_bytes: 9 * GB,
        allocated_peak_bytes: 7 * GB,
        new_segment_bytes: 3 * GB,
        state_bytes: GB,
        grad_bytes: 0,
        grads_persistent: false,
        grads_freed_before_backward: false,
        events_replayed: 10,
        steady_reserved_peak_bytes: 9 * GB,
        reserved_limit_bytes: None,
        within_limit: None,
        ddp_bucket_rebuild: None,
        loop_variable_bytes: GB / 2,
        forward_returns_known: true,
    };
    assert!(tracker.allocator_replay(&key, replay, 55).is_some());
    let p = tracker.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(p.inputs.basis, PredictionBasis::AllocatorReplay);
    assert_eq!(p.inputs.allocator_replay, Some(replay));
    assert_eq!(p.inputs.predicted_reserved_bytes, Some(9 * GB));
    assert_eq!(p.inputs.layout.layout_allowance_bytes, 0);
    assert!(p.explanation.contains("replayed"), "{}", p.explanation);
    assert!(
        p.explanation
            .contains("once step 2's model call has returned")
            && p.explanation.contains("up to 0.50 GB higher"),
        "{}",
        p.explanation
    );

    // Within the GPU's limit the steps fit only by releasing the cache, at a
    // lower steady peak: that is the reserved figure, and the text says so.
    let tight = Step2Replay {
        reserved_limit_bytes: Some(10 * GB),
        within_limit: Some(LimitedReplay {
            fits: true,
            reserved_peak_bytes: 9 * GB,
            steady_reserved_peak_bytes: 8 * GB,
            alloc_retries: 1,
        }),
        ..replay
    };
    assert!(tracker.allocator_replay(&key, tight, 56).is_some());
    let p = tracker.rank_analysis(&key).unwrap().prediction.unwrap();
    assert_eq!(p.inputs.predicted_reserved_bytes, Some(8 * GB));
    let said = "within the GPU's 10.00 GB they fit after 1 cache release(s), steady state 8.00 GB";
    assert!(p.explanation.contains(said), "{}", p.explanation);
    assert!(
        p.explanation
            .contains("at least the step-1 reserved peak: 8.00 GB"),
        "{}",
        p.explanation
    );
    // A DDP bucket rebuild in the replay is said, and so is one left out.
    let mut rebuilt = ReplayedBucketRebuild {
        modelled: true,
        old_bucket_bytes: GB / 2,
        new_bucket_bytes: GB / 2,
        new_buckets: 13,
    };
    let ddp = Step2Replay {
        ddp_bucket_rebuild: Some(rebuilt),
        ..replay
    };
    assert!(tracker.allocator_replay(&key, ddp, 57).is_some());
    let p = tracker.rank_analysis(&key).unwrap().prediction.unwrap();
    let said = "DDP rebuilds its gradient buckets at step 2's first forward (replayed: 0.50 GB \
                of old buckets freed, 13 buckets of 0.50 GB in all made)";
    assert!(p.explanation.contains(said), "{}", p.explanation);
    rebuilt.modelled = false;
    let ddp = Step2Replay {
        ddp_bucket_rebuild: Some(rebuilt),
        ..replay
    };
    assert!(tracker.allocator_replay(&key, ddp, 57).is_some());
    let p = tracker.rank_analysis(&key).unwrap().prediction.unwrap();
    assert!(
        p.explanation.contains("the replay leaves the rebuild out"),
        "{}",
        p.explanation
    );
    assert!(tracker.allocator_replay(&key, replay, 57).is_some());

    // Step 2 begins: the frozen prediction is the replay's; later replays are ignored.
    let step2 = [
        marker(MarkerKind::StepEnd, 1, 60, stats(3 * GB, 6 * GB)),
        marker(MarkerKind::StepBegin, 2, 70, stats(3 * GB, 6 * GB)),
    ];
    tracker.markers(&key, &step2, 70).unwrap();
    let frozen = tracker.rank(&key).unwrap().prediction_before_step2.clone();
    assert_eq!(
        frozen.map(|p| p.inputs.basis),
        Some(PredictionBasis::AllocatorReplay)
    );
    assert!(tracker.allocator_replay(&key, replay, 75).is_none());
}

#[test]
fn bad_traces_are_refused_with_a_reason() {
    let (r, _) = step_one(0, 30 * MIB);
    let good = r.trace();

    let mut t = good.clone();
    t.step = 2;
    assert_eq!(replay_step2(&t, false), Err(TraceError::NotStepOne(2)));

    // Forward returns out of order, or past the events.
    for returns in [vec![2, 1], vec![good.events.len() as u64 + 1]] {
        let mut t = good.clone();
        t.forward_returns = returns;
        assert!(matches!(
            replay_step2(&t, false),
            Err(TraceError::ForwardReturn { .. })
        ));
    }

    let mut t = good.clone();
    t.events = vec![good.events[0]; MAX_TRACE_EVENTS + 1];
    assert_eq!(replay_step2(&t, false), Err(TraceError::TooManyEvents));

    // The same address allocated twice without a free.
    let mut t = good.clone();
    t.events.insert(1, good.events[0]);
    assert!(matches!(
        replay_step2(&t, false),
        Err(TraceError::DoubleAlloc { index: 1, .. })
    ));

    // The state's allocation has no allocated block in the layout.
    let mut t = good.clone();
    for s in &mut t.segments {
        for b in &mut s.blocks {
            b.allocated = false;
        }
    }
    assert!(matches!(
        replay_step2(&t, false),
        Err(TraceError::LayoutMismatch { .. })
    ));

    // Overlapping segments.
    let mut t = good.clone();
    let first = t.segments[0].clone();
    t.segments.push(SegmentLayout {
        address: first.address + MIB,
        ..first
    });
    assert!(matches!(
        replay_step2(&t, false),
        Err(TraceError::Layout(allocator::LayoutError::Overlap { .. }))
    ));

    let mut t = good;
    t.segments.push(SegmentLayout::new(
        1,
        Pool::Small,
        vec![BlockLayout {
            size: 0,
            allocated: false,
            gradient: false,
        }],
    ));
    assert!(matches!(
        replay_step2(&t, false),
        Err(TraceError::Layout(allocator::LayoutError::EmptyBlock {
            address: 1
        }))
    ));
}

#[test]
fn a_layout_round_trips_through_from_layout() {
    let (r, _) = step_one(10 * MIB, 30 * MIB);
    let layout = r.alloc.layout();
    let (copy, live) = CachingAllocator::from_layout(&layout).unwrap();
    assert_eq!(copy.layout(), layout);
    assert_eq!(copy.usage(), r.alloc.usage());
    assert_eq!(live.len(), r.alloc.live_allocations());
    copy.check_invariants();
}

#[test]
fn the_hello_says_what_becomes_of_the_gradients() {
    let mut info = RankInfo {
        framework: "pytorch".into(),
        ..Default::default()
    };
    assert_eq!(Gradients::of(&info), Gradients::FreedBeforeStep);
    info.framework = "lightning".into();
    assert_eq!(Gradients::of(&info), Gradients::FreedBeforeBackward);
    info.model.grads_set_to_none = Some(false);
    assert_eq!(Gradients::of(&info), Gradients::Kept);
    info.framework = "pytorch".into();
    assert_eq!(Gradients::of(&info), Gradients::Kept);
    assert_eq!(Gradients::from_persistent(true), Gradients::Kept);
    assert_eq!(
        Gradients::from_persistent(false),
        Gradients::FreedBeforeStep
    );
}

/// 64 MiB of weights allocated before the trace begins, then step 1's
/// forward begins.
fn in_forward_after_weights() -> Recorder {
    let mut r = Recorder::on(CachingAllocator::new()).holding(64 * MIB);
    r.phase = PhaseKind::Forward;
    r
}

#[test]
fn a_side_stream_does_not_reuse_the_default_streams_blocks() {
    // Step 1: forward frees a 40 MiB activation; backward's side stream
    // (an NCCL bucket) cannot take its block and gets a 48 MiB segment of its
    // own; the optimizer's 40 MiB of state takes the activation's block.
    // Step 2's activation then finds no free block on the default stream (the
    // side stream's does not count): a new 40 MiB segment, which the side
    // stream's 48 MiB cannot use in turn. Blind to streams, a replay reuses
    // the side stream's block and predicts no growth; blind to the events'
    // streams, it puts the 48 MiB on the default stream and grows twice.
    let mut r = in_forward_after_weights();
    r.temporary(40 * MIB);
    r.phase = PhaseKind::Backward;
    r.stream = 5;
    r.temporary(48 * MIB);
    r.stream = 0;
    let t = r.optimizer_then_trace(40 * MIB);
    assert_eq!(r.alloc.reserved(), 152 * MIB);
    let replay = replay_step2(&t, false).unwrap();
    assert_eq!(replay.reserved_at_step1_end_bytes, 152 * MIB);
    assert_eq!(replay.reserved_peak_bytes, 192 * MIB);
    assert_eq!(replay.steady_reserved_peak_bytes, 192 * MIB);
}

#[test]
fn empty_cache_in_step_one_is_replayed_where_it_happened() {
    // Step 1's forward: an 80 MiB temporary, empty_cache(), a 100 MiB one;
    // the optimizer's 100 MiB of state takes the latter's segment. In step 2
    // the 80 MiB segment is released again before the 100 MiB request, so
    // reserved peaks at 64 + 100 + 100 MiB (264), not 64 + 100 + 80 + 100.
    let mut r = in_forward_after_weights();
    r.temporary(80 * MIB);
    r.empty_cache();
    r.temporary(100 * MIB);
    let t = r.optimizer_then_trace(100 * MIB);
    assert_eq!(r.alloc.reserved(), 164 * MIB);
    let replay = replay_step2(&t, false).unwrap();
    assert_eq!(replay.reserved_peak_bytes, 264 * MIB);
    assert_eq!(replay.steady_reserved_peak_bytes, 264 * MIB);
}

#[test]
fn a_private_pool_serves_no_replayed_allocation() {
    // A CUDA graph's private pool: a 40 MiB segment (pool id 7) holding its
    // 12 MiB static output, 28 MiB free. Step 1's 8 MiB temporary had a
    // 20 MiB segment of its own, released by empty_cache(). In step 2 it
    // cannot use the private pool's 28 MiB: a new 20 MiB segment (104 + 20).
    // The static output is not made again in the ordinary pool.
    let w = 1u64 << 36;
    let p = w - 40 * MIB;
    let s = p - 20 * MIB;
    let block = |size, allocated| BlockLayout {
        size,
        allocated,
        gradient: false,
    };
    let mut private = SegmentLayout::new(
        p,
        Pool::Large,
        vec![block(12 * MIB, true), block(28 * MIB, false)],
    );
    private.pool_id = 7;
    let event = |action, address, size| AllocatorEvent {
        action,
        address,
        size,
        phase: PhaseKind::Forward,
        stream: 0,
    };
    let t = AllocatorTrace {
        step: 1,
        segments: vec![
            SegmentLayout::new(w, Pool::Large, vec![block(64 * MIB, true)]),
            private,
        ],
        events: vec![
            event(AllocatorAction::Alloc, p, 12 * MIB),
            event(AllocatorAction::Alloc, s, 8 * MIB),
            event(AllocatorAction::Free, s, 8 * MIB),
            event(AllocatorAction::SegmentFree, s, 20 * MIB),
        ],
        settings: None,
        forward_returns: Vec::new(),
        torch_version: String::new(),
    };
    let replay = replay_step2(&t, false).unwrap();
    assert_eq!(replay.reserved_at_step1_end_bytes, 104 * MIB);
    assert_eq!(replay.reserved_peak_bytes, 124 * MIB);
}

#[test]
fn the_traced_settings_are_followed_or_the_trace_refused() {
    // Recorded under roundup_power2_divisions:4: a 30 MiB request takes a
    // 32 MiB block, and the replay must round it so too.
    let settings = TraceSettings {
        roundup_power2_divisions: vec![4; allocator::ROUNDUP_INTERVALS],
        alloc_conf: "roundup_power2_divisions:4".into(),
        ..TraceSettings::default()
    };
    let alloc = CachingAllocator::with_settings(settings.model().unwrap());
    let mut r = Recorder::on(alloc).holding(64 * MIB);
    r.phase = PhaseKind::Forward;
    r.temporary(30 * MIB);
    let mut t = r.trace();
    t.settings = Some(settings.clone());
    let replay = replay_step2(&t, false).unwrap();
    assert_eq!(replay.allocated_peak_bytes, 96 * MIB);

    for bad in [
        TraceSettings {
            garbage_collection_threshold: 0.6,
            ..settings.clone()
        },
        TraceSettings {
            alloc_conf: "max_non_split_rounding_mb:40".into(),
            ..settings.clone()
        },
        TraceSettings {
            roundup_power2_divisions: vec![4; 3],
            ..settings.clone()
        },
    ] {
        t.settings = Some(bad);
        assert!(matches!(
            replay_step2(&t, false),
            Err(TraceError::UnmodelledSetting(_))
        ));
    }
    // Expandable segments in the layout with the setting off: PyTorch then
    // serves only from the other segments, which the model does not follow.
    t.settings = Some(settings);
    t.segments[0].expandable = true;
    assert!(matches!(
        replay_step2(&t, false),
        Err(TraceError::UnmodelledSetting(_))
    ));
}

#[test]
fn hostile_traces_are_replayed_or_refused_never_a_panic() {
    // Random layouts and events (streams, pools, expandable runs, segment
    // events, odd sizes and addresses, settings): the replay answers Ok or
    // Err for each, within its bounds.
    let mut x: u64 = 0xD1B5_4A32_D192_ED03;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let actions = [
        AllocatorAction::Alloc,
        AllocatorAction::Free,
        AllocatorAction::SegmentAlloc,
        AllocatorAction::SegmentFree,
        AllocatorAction::SegmentMap,
        AllocatorAction::SegmentUnmap,
    ];
    let phases = [
        PhaseKind::Prologue,
        PhaseKind::Forward,
        PhaseKind::Backward,
        PhaseKind::Optimizer,
        PhaseKind::Epilogue,
    ];
    let (mut replayed, mut refused) = (0, 0);
    for _ in 0..4000 {
        let base = (1u64 << 36) + (next() % 64) * (2 * MIB);
        let mut address = base;
        let mut segments = Vec::new();
        let mut allocated = Vec::new();
        for _ in 0..next() % 6 {
            let blocks: Vec<BlockLayout> = (0..1 + next() % 4)
                .map(|_| BlockLayout {
                    size: 512 * (1 + next() % 40_000),
                    allocated: next() % 2 == 0,
                    gradient: false,
                })
                .collect();
            let mut offset = address;
            for b in &blocks {
                if b.allocated {
                    allocated.push((offset, b.size));
                }
                offset += b.size;
            }
            let mut s = SegmentLayout::new(
                address,
                if next() % 3 == 0 {
                    Pool::Small
                } else {
                    Pool::Large
                },
                blocks,
            );
            s.stream = next() % 2;
            s.pool_id = u64::from(next() % 5 == 0);
            s.expandable = next() % 4 == 0;
            address = offset + (next() % 3) * (2 * MIB);
            segments.push(s);
        }
        let mut events = Vec::new();
        for _ in 0..next() % 60 {
            let pick = next();
            let (address, size) = match allocated.get((pick % 8) as usize) {
                Some(&(a, s)) if pick % 3 == 0 => (a, s),
                _ => (
                    base - 64 * MIB + (next() % 512) * 512 * 1024,
                    1 + next() % (64 * MIB),
                ),
            };
            events.push(AllocatorEvent {
                action: actions[(next() % 6) as usize],
                address,
                size,
                phase: phases[(next() % 5) as usize],
                stream: next() % 2,
            });
        }
        let settings = (next() % 2 == 0).then(|| TraceSettings {
            max_split_size_bytes: (next() % 3) * 32 * MIB,
            roundup_power2_divisions: if next() % 2 == 0 {
                vec![(next() % 8) as u32; allocator::ROUNDUP_INTERVALS]
            } else {
                Vec::new()
            },
            expandable_segments: next() % 2 == 0,
            ..TraceSettings::default()
        });
        let t = AllocatorTrace {
            step: 1,
            segments,
            events,
            settings,
            forward_returns: Vec::new(),
            torch_version: String::new(),
        };
        for gradients in [Gradients::FreedBeforeStep, Gradients::Kept] {
            let limit = Some(next() % (1 << 32));
            match replay_step2_with(&t, gradients, limit, None) {
                Ok(_) => replayed += 1,
                Err(_) => refused += 1,
            }
        }
    }
    // Both paths are exercised.
    assert!(
        replayed > 500 && refused > 500,
        "{replayed} replayed, {refused} refused"
    );
}

/// DDP with its one 40 MiB bucket (made before step 1, in a segment of its
/// own), then step 1: forward makes a 10 MiB activation, backward frees it
/// and makes a 40 MiB gradient (set to None before step 2); with the
/// rebuild of `old` into `new` bucket sizes the rank's facts announce.
fn ddp_step_one(old: &[u64], new: &[u64]) -> (AllocatorTrace, DdpBucketRebuild) {
    let mut r = Recorder::on(CachingAllocator::new()).holding(40 * MIB);
    r.phase = PhaseKind::Forward;
    let a = r.malloc(10 * MIB);
    r.phase = PhaseKind::Backward;
    r.free(a);
    r.malloc(40 * MIB);
    let rebuild = DdpBucketRebuild {
        old_bucket_bytes: old.to_vec(),
        new_bucket_bytes: new.to_vec(),
    };
    (r.trace(), rebuild)
}

/// Step 2 replayed from `t` with DDP's `rebuild` (gradients set to None),
/// within `limit` when given.
fn replay_rebuilding(
    t: &AllocatorTrace,
    rebuild: &DdpBucketRebuild,
    limit: Option<u64>,
) -> Step2Replay {
    replay_step2_with(t, Gradients::FreedBeforeStep, limit, Some(rebuild)).unwrap()
}

#[test]
fn ddp_rebuilding_its_buckets_at_step_2s_first_forward_is_replayed() {
    // Step 1 ends with bucket B (40 MiB), C (10 MiB, free) and the gradient's
    // D (40 MiB): 90 MiB. The new buckets' sizes add up to the old one's but
    // are not multiples of 512 B: 20 MiB and 20 MiB + 512 B once rounded.
    let (t, rebuild) = ddp_step_one(&[40 * MIB], &[20 * MIB - 256, 20 * MIB + 256]);
    // Without it step 2 repeats step 1: the activation in C, the gradient in D.
    let plain = replay_step2(&t, false).unwrap();
    assert_eq!(plain.reserved_peak_bytes, 90 * MIB);
    assert_eq!(plain.ddp_bucket_rebuild, None);

    // With it, before the activation: B is freed (D is free too, the
    // gradient set to None); the first bucket splits one 40 MiB block, the
    // second the other, so the gradient finds no 40 MiB block and takes a
    // new 40 MiB segment: 130 MiB. Steps 3 and 4 do not rebuild again.
    let rebuilt = replay_rebuilding(&t, &rebuild, None);
    assert_eq!(rebuilt.reserved_at_step1_end_bytes, 90 * MIB);
    assert_eq!(rebuilt.reserved_peak_bytes, 130 * MIB);
    assert_eq!(rebuilt.new_segment_bytes, 40 * MIB);
    assert_eq!(rebuilt.steady_reserved_peak_bytes, 130 * MIB);
    assert_eq!(
        rebuilt.ddp_bucket_rebuild,
        Some(ReplayedBucketRebuild {
            modelled: true,
            old_bucket_bytes: 40 * MIB,
            new_bucket_bytes: 40 * MIB,
            new_buckets: 2,
        })
    );

    // Within 100 MiB, releasing the free C (10 MiB) leaves 80 + 40: no fit.
    let tight = replay_rebuilding(&t, &rebuild, Some(100 * MIB));
    assert!(!tight.within_limit.unwrap().fits);
    // Within 120 MiB it fits after that one release.
    let w = replay_rebuilding(&t, &rebuild, Some(120 * MIB))
        .within_limit
        .unwrap();
    assert!(w.fits);
    assert_eq!(w.reserved_peak_bytes, 120 * MIB);
    assert_eq!(w.alloc_retries, 1);
}

#[test]
fn a_ddp_rebuild_whose_old_buckets_are_not_in_the_layout_is_left_out() {
    // No block alive since before the trace can hold a 30 MiB bucket (B is
    // 40 MiB: more than the 1 MiB the allocator leaves unsplit), and the
    // trace's own 40 MiB gradient is never taken for a bucket.
    let (t, rebuild) = ddp_step_one(&[30 * MIB], &[30 * MIB]);
    let r = replay_rebuilding(&t, &rebuild, None);
    assert_eq!(r.reserved_peak_bytes, 90 * MIB);
    assert_eq!(r.ddp_bucket_rebuild.map(|b| b.modelled), Some(false));
    let (t, rebuild) = ddp_step_one(&[40 * MIB, 40 * MIB], &[80 * MIB]);
    let r = replay_rebuilding(&t, &rebuild, None);
    assert_eq!(r.reserved_peak_bytes, 90 * MIB);
    assert_eq!(r.ddp_bucket_rebuild.map(|b| b.modelled), Some(false));
}
