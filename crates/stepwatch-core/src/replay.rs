//! Step 2 replayed from step 1's caching-allocator trace.
//!
//! Allocator figures at phase boundaries say how much memory step 2 will
//! *allocate*, not how much it will *reserve*: the optimizer state made in
//! step 1's optimizer phase is carved out of the blocks backward freed, so in
//! step 2 the activations may no longer fit the cache and the allocator takes
//! new segments although allocated memory fits (fragmentation). Which
//! activations stop fitting depends on block sizes and addresses.
//!
//! A client that can record step 1's allocator history sends an
//! [`AllocatorTrace`]: the segment layout after step 1's optimizer phase and
//! step 1's allocations and frees, each tagged with its phase. Step 2 does
//! what step 1 did, minus creating the state, so [`replay_step2`] starts a
//! [`CachingAllocator`] from that layout and replays step 1's events. What is
//! alive at the end of step 1's optimizer phase is, by the phase that made it:
//!
//! - optimizer: the state. Kept; step 2 does not make it again.
//! - backward: the gradients ([`Gradients`]). Set to None between steps
//!   (PyTorch's default), they are freed before step 2, or just before its
//!   backward under Lightning, and made again in backward. Kept
//!   (`zero_grad(set_to_none=False)`), step 2's backward still makes each one
//!   and `AccumulateGrad` adds it into the kept one and drops it.
//! - forward (or another phase): the training loop's variables, such as the
//!   logits and the loss. They live into step 2 until the statement that
//!   makes their new value rebinds them (`logits = model(x)`), and are freed
//!   then.
//!
//! Where those frees fall among the events is read off the trace (see
//! `release_points`).
//!
//! One thing step 2 does that step 1 did not, the replay is told of:
//! DistributedDataParallel (`find_unused_parameters=False`) rebuilds its
//! gradient buckets at step 2's first forward. It frees the one bucket of
//! all gradients it made when constructed (alive since before the trace)
//! and allocates buckets of about 25 MiB. Given the rebuild (the
//! `ddp_bucket_rebuild` argument of [`replay_step2_with`]: the client's model
//! facts, through [`crate::feed::ReplayPlan`]) the replay frees the old buckets' blocks, found by size among the blocks
//! alive since before the trace, and allocates the new ones there, in step
//! 2 only. Checked against real PyTorch on fake CUDA
//! (`tests/fixtures/torch-fake-cuda/`), the GPT, CNN, DDP, Lightning and
//! Hugging Face Trainer jobs of `bench/torch-jobs` replay to PyTorch's
//! reserved peaks to the byte (kept gradients: when the client says so).
//!
//! The replay is exact when the model follows PyTorch's allocator and step 2
//! repeats step 1; it does not see what happens only from step 2 on, nor
//! the allocations made between the end of step 1's optimizer phase and
//! step 2's first marker (such as the next batch's inputs), and it must be
//! told what becomes of the gradients: the trace ends before `zero_grad`.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::allocator::{
    AllocId, AllocatorSettings, CachingAllocator, FreeBlockOrder, LayoutError, SegmentLayout,
    Usage, LARGE_BUFFER, ROUNDUP_INTERVALS, SMALL_SIZE,
};
use crate::identity::{DdpBucketRebuild, RankInfo};
use crate::marker::PhaseKind;

/// Steps replayed after step 1 (steps 2..=1 + this): enough for the cache to
/// settle when step 2 had to release it.
pub const REPLAYED_STEPS: usize = 3;

/// Most events a trace may hold; bounds the agent's memory and replay time.
pub const MAX_TRACE_EVENTS: usize = 262_144;
/// Most blocks, over all segments, a trace may hold.
pub const MAX_TRACE_BLOCKS: usize = 262_144;
/// Largest event a trace may hold (1 PiB): far above any GPU, and low enough
/// that sums of sizes cannot overflow.
pub const MAX_EVENT_BYTES: u64 = 1 << 50;

/// What an allocator event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocatorAction {
    /// A block was handed out.
    Alloc,
    /// A block went back to the cache.
    Free,
    /// A segment was obtained from the driver (`cudaMalloc`). The replay
    /// decides its own segments; the event only says where one was.
    SegmentAlloc,
    /// A segment was given back to the driver: `torch.cuda.empty_cache()`,
    /// or a release to retry a failed `cudaMalloc`. The replay releases its
    /// free unsplit segments there, once per run of such events.
    SegmentFree,
    /// Pages were mapped into an expandable segment; like
    /// [`AllocatorAction::SegmentAlloc`], only says where.
    SegmentMap,
    /// Pages of an expandable segment were unmapped (`empty_cache()`); the
    /// replay releases there, as for [`AllocatorAction::SegmentFree`].
    SegmentUnmap,
}

impl AllocatorAction {
    /// Memory given back to the driver: where step 1 released its cache.
    fn releases(self) -> bool {
        matches!(
            self,
            AllocatorAction::SegmentFree | AllocatorAction::SegmentUnmap
        )
    }
}

/// One allocation or free of the traced step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorEvent {
    /// Alloc or free.
    pub action: AllocatorAction,
    /// Device address of the block.
    pub address: u64,
    /// Requested bytes (the allocator rounds them as it would).
    pub size: u64,
    /// The phase it happened in.
    pub phase: PhaseKind,
    /// The stream it was made on (the snapshot's `stream`; 0: the default
    /// stream, and what clients that send no streams mean).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stream: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The allocator settings the traced process ran with (the snapshot's
/// `allocator_settings`), as a client sends them. The replay follows
/// `max_split_size` and `roundup_power2_divisions` and refuses a trace made
/// under a setting it does not model ([`TraceSettings::model`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceSettings {
    /// `max_split_size_mb` in bytes; 0: unlimited (the default).
    #[serde(default)]
    pub max_split_size_bytes: u64,
    /// `roundup_power2_divisions`, one per power-of-two interval from 1 MiB
    /// up ([`ROUNDUP_INTERVALS`]); empty: none.
    #[serde(default)]
    pub roundup_power2_divisions: Vec<u32>,
    /// `garbage_collection_threshold`; 0: off (the default).
    #[serde(default)]
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`.
    #[serde(default)]
    pub expandable_segments: bool,
    /// The `PYTORCH_CUDA_ALLOC_CONF` string the allocator parsed, for the
    /// settings no field above carries.
    #[serde(default)]
    pub alloc_conf: String,
}

/// Keys of `PYTORCH_CUDA_ALLOC_CONF` that leave the device allocator's
/// decisions as the model makes them, or that a field of [`TraceSettings`]
/// carries (and is checked there).
const MODELLED_CONF_KEYS: &[&str] = &[
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
];

impl TraceSettings {
    /// The settings for the model, or why the replay would not be faithful.
    pub fn model(&self) -> Result<AllocatorSettings, TraceError> {
        let refuse = |why: String| Err(TraceError::UnmodelledSetting(why));
        if self.garbage_collection_threshold != 0.0 {
            return refuse(format!(
                "garbage_collection_threshold:{}",
                self.garbage_collection_threshold
            ));
        }
        for item in self.alloc_conf.split(',') {
            let (key, value) = item.split_once(':').unwrap_or((item, ""));
            let key = key.trim();
            let value = value.trim();
            let harmless = key.is_empty()
                || MODELLED_CONF_KEYS.contains(&key)
                || (key == "backend" && value == "native");
            if !harmless {
                return refuse(format!("{key}:{value}"));
            }
        }
        let mut divisions = [0u32; ROUNDUP_INTERVALS];
        match self.roundup_power2_divisions.len() {
            0 => {}
            ROUNDUP_INTERVALS => divisions.copy_from_slice(&self.roundup_power2_divisions),
            n => {
                return refuse(format!(
                    "roundup_power2_divisions with {n} intervals (PyTorch has \
                     {ROUNDUP_INTERVALS})"
                ))
            }
        }
        Ok(AllocatorSettings {
            max_split_size: (self.max_split_size_bytes != 0).then_some(self.max_split_size_bytes),
            roundup_power2_divisions: divisions,
            expandable_segments: self.expandable_segments,
            free_block_order: FreeBlockOrder::default(),
        })
    }
}

/// Step 1's allocator history, as a client sends it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AllocatorTrace {
    /// The step the events come from.
    pub step: u64,
    /// Segments when the trace ends, after step 1's optimizer phase.
    pub segments: Vec<SegmentLayout>,
    /// The step's allocations and frees, oldest first.
    pub events: Vec<AllocatorEvent>,
    /// The allocator settings in force; None: the client did not say (older
    /// clients), PyTorch's defaults are assumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<TraceSettings>,
    /// Where the watched model's forward returned during the step, as
    /// positions in `events` (the count of events before it), ascending;
    /// empty when the client did not say (see `release_points`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forward_returns: Vec<u64>,
    /// The traced process's PyTorch version (`torch.__version__`), which
    /// decides how its allocator breaks ties ([`FreeBlockOrder`]); the
    /// agent fills it from the rank's hello
    /// ([`crate::feed::ReplayPlan::torch_version`]). Empty: not known, the
    /// newest rule is assumed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub torch_version: String,
}

/// A trace that cannot be replayed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// Only step 1's trace predicts step 2.
    #[error("an allocator trace must come from step 1, not step {0}")]
    NotStepOne(u64),
    /// More than [`MAX_TRACE_EVENTS`] events.
    #[error("the allocator trace holds more than {MAX_TRACE_EVENTS} events")]
    TooManyEvents,
    /// More than [`MAX_TRACE_BLOCKS`] blocks.
    #[error("the allocator trace holds more than {MAX_TRACE_BLOCKS} blocks")]
    TooManyBlocks,
    /// The segment layout is inconsistent.
    #[error("allocator trace layout: {0}")]
    Layout(#[from] LayoutError),
    /// An event of 0 bytes.
    #[error("allocator trace event {index} has size 0")]
    ZeroSize {
        /// Position in the trace.
        index: usize,
    },
    /// An address allocated again before it was freed.
    #[error("allocator trace event {index} allocates {address:#x}, which is already allocated")]
    DoubleAlloc {
        /// Position in the trace.
        index: usize,
        /// The address.
        address: u64,
    },
    /// A forward return out of order or past the events' end.
    #[error(
        "allocator trace forward return {index} is at {at}, not ascending within the {events} events"
    )]
    ForwardReturn {
        /// Position in `forward_returns`.
        index: usize,
        /// Its value.
        at: u64,
        /// The trace's events.
        events: usize,
    },
    /// An event larger than [`MAX_EVENT_BYTES`].
    #[error("allocator trace event {index} has {size} bytes, more than {MAX_EVENT_BYTES}")]
    TooLarge {
        /// Position in the trace.
        index: usize,
        /// Its size.
        size: u64,
    },
    /// The traced allocator ran with a setting the model does not follow.
    #[error("the allocator ran with {0}, which the replay does not model")]
    UnmodelledSetting(String),
    /// The trace leaves an allocation alive that the layout does not hold.
    #[error(
        "allocator trace event {index} leaves {address:#x} allocated, but the layout has no \
         allocated block of at least {size} bytes there"
    )]
    LayoutMismatch {
        /// Position of the allocation in the trace.
        index: usize,
        /// The address.
        address: u64,
        /// Its size, rounded.
        size: u64,
    },
}

impl AllocatorTrace {
    /// Checks the bounds that do not need a replay: the step and the sizes.
    pub fn check_bounds(&self) -> Result<(), TraceError> {
        if self.step != 1 {
            return Err(TraceError::NotStepOne(self.step));
        }
        if self.events.len() > MAX_TRACE_EVENTS {
            return Err(TraceError::TooManyEvents);
        }
        if self.segments.iter().map(|s| s.blocks.len()).sum::<usize>() > MAX_TRACE_BLOCKS {
            return Err(TraceError::TooManyBlocks);
        }
        let mut previous = 0;
        for (index, &at) in self.forward_returns.iter().enumerate() {
            if at < previous || at > self.events.len() as u64 {
                return Err(TraceError::ForwardReturn {
                    index,
                    at,
                    events: self.events.len(),
                });
            }
            previous = at;
        }
        for (index, e) in self.events.iter().enumerate() {
            if e.size > MAX_EVENT_BYTES {
                return Err(TraceError::TooLarge {
                    index,
                    size: e.size,
                });
            }
        }
        Ok(())
    }

    /// The model's settings for this trace, or why it cannot be replayed
    /// faithfully (an unmodelled setting, expandable segments).
    pub fn model_settings(&self) -> Result<AllocatorSettings, TraceError> {
        let free_block_order =
            FreeBlockOrder::of_torch_version(&self.torch_version).unwrap_or_default();
        let expandable = self.segments.iter().any(|s| s.expandable);
        let settings = match &self.settings {
            None => Ok(AllocatorSettings {
                expandable_segments: expandable,
                ..AllocatorSettings::default()
            }),
            // Expandable segments made before the setting was turned off:
            // PyTorch then serves only from the others, which is not modelled.
            Some(s) if expandable && !s.expandable_segments => Err(TraceError::UnmodelledSetting(
                "expandable_segments turned off while in use".into(),
            )),
            Some(s) => s.model(),
        }?;
        Ok(AllocatorSettings {
            free_block_order,
            ..settings
        })
    }
}

/// What becomes of step 1's gradients (what its backward made and left
/// alive) between steps. The trace ends at step 1's optimizer phase, before
/// `zero_grad`, so this comes from what the client says
/// ([`Gradients::of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gradients {
    /// Set to None before step 2's forward (`zero_grad()` at a step's end or
    /// before its forward; PyTorch's default): freed, then made again in
    /// backward.
    #[default]
    FreedBeforeStep,
    /// Set to None between forward and backward: alive through step 2's
    /// forward. Lightning's automatic optimization calls `zero_grad()` in its
    /// closure after `training_step`, just before backward (as loops written
    /// `loss = ...; opt.zero_grad(); loss.backward()` do).
    FreedBeforeBackward,
    /// Kept (`zero_grad(set_to_none=False)`): step 2's backward still makes
    /// each gradient, and `AccumulateGrad` adds it into the kept one and
    /// drops it.
    Kept,
}

impl Gradients {
    /// What a rank's hello says: kept when `grads_set_to_none` is false,
    /// freed before backward under Lightning (framework "lightning"), else
    /// freed before the step.
    pub fn of(info: &RankInfo) -> Self {
        if info.model.grads_set_to_none == Some(false) {
            Gradients::Kept
        } else if info.framework.eq_ignore_ascii_case("lightning") {
            Gradients::FreedBeforeBackward
        } else {
            Gradients::FreedBeforeStep
        }
    }

    /// Kept when `persistent`, else freed before the step.
    pub fn from_persistent(persistent: bool) -> Self {
        if persistent {
            Gradients::Kept
        } else {
            Gradients::FreedBeforeStep
        }
    }
}

/// What the replay of step 2 found; part of a prediction's inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step2Replay {
    /// Reserved bytes when the trace ended (after step 1's optimizer phase).
    pub reserved_at_step1_end_bytes: u64,
    /// Highest reserved bytes during the replayed step 2.
    pub reserved_peak_bytes: u64,
    /// Highest allocated bytes during the replayed step 2.
    pub allocated_peak_bytes: u64,
    /// Segments step 2 adds: reserved peak − reserved at step 1's end.
    pub new_segment_bytes: u64,
    /// Allocations made in step 1's optimizer phase and still alive at its
    /// end (the optimizer state): kept, not made again.
    pub state_bytes: u64,
    /// Allocations made in step 1's backward and still alive (the gradients).
    pub grad_bytes: u64,
    /// Whether gradients were kept into step 2 (step 2's backward makes each
    /// again, adds it in and drops it), else freed first, as
    /// `zero_grad(set_to_none=True)` does, and made again in backward.
    pub grads_persistent: bool,
    /// Whether gradients set to None were freed only before step 2's
    /// backward ([`Gradients::FreedBeforeBackward`]).
    #[serde(default)]
    pub grads_freed_before_backward: bool,
    /// Events replayed (in step 2).
    pub events_replayed: u64,
    /// Highest reserved bytes of the replayed steps after step 2 (3 to
    /// 1 + [`REPLAYED_STEPS`]): the steady state, where steps repeat.
    /// Usually step 2's figure; lower when step 2 only fitted by releasing
    /// the cache, which rearranges it (see `steady_peak`).
    #[serde(default)]
    pub steady_reserved_peak_bytes: u64,
    /// The most the allocator may reserve on the GPU (capacity − what NVML
    /// shows beyond the allocator, other processes included), when it was
    /// known as the trace arrived.
    #[serde(default)]
    pub reserved_limit_bytes: Option<u64>,
    /// Step 2 replayed again within that limit; None without one.
    #[serde(default)]
    pub within_limit: Option<LimitedReplay>,
    /// DDP's bucket rebuild at step 2's first forward, when the rank's facts
    /// announced one (null otherwise: the API always has the key).
    #[serde(default)]
    pub ddp_bucket_rebuild: Option<ReplayedBucketRebuild>,
    /// Allocations step 1 made outside backward and its optimizer phase and
    /// left alive (the training loop's variables: the model's output, the
    /// logits, the loss), which step 2 frees when it rebinds them. When that
    /// is the client cannot know (a Python variable's life); see
    /// `forward_returns_known`.
    #[serde(default)]
    pub loop_variable_bytes: u64,
    /// Whether the trace said where the model's forward returned: the loop's
    /// variables made by the model are then kept until step 2's forward has
    /// returned, else freed where the events alone place it.
    #[serde(default)]
    pub forward_returns_known: bool,
}

/// What the replay made of DDP's bucket rebuild (the `ddp_bucket_rebuild`
/// argument of [`replay_step2_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayedBucketRebuild {
    /// Whether step 2 was replayed with it: false when a block holding one
    /// of the old buckets could not be found among those alive since before
    /// the trace, so freeing them cannot be placed.
    pub modelled: bool,
    /// Old buckets' bytes (as the client said).
    pub old_bucket_bytes: u64,
    /// New buckets' bytes (as the client said).
    pub new_bucket_bytes: u64,
    /// New buckets allocated.
    pub new_buckets: u32,
}

/// Step 2 replayed within the GPU's limit. When `cudaMalloc` fails, PyTorch
/// releases the cached segments that are wholly free and tries once more
/// (`num_alloc_retries`); a step whose unlimited replay needs more than the
/// GPU has may still fit that way, at a lower reserved peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitedReplay {
    /// Whether every allocation of every replayed step succeeded.
    pub fits: bool,
    /// Highest reserved bytes of step 2 (up to the failure when it does not fit).
    pub reserved_peak_bytes: u64,
    /// Highest reserved bytes of the replayed steps after step 2, when all
    /// fit: a cache that keeps being released need not settle, and its
    /// steps peak in turns. Pages an expandable segment's failed growth
    /// held for an instant count ([`Usage::device`]).
    #[serde(default)]
    pub steady_reserved_peak_bytes: u64,
    /// Cache releases the replayed steps needed.
    pub alloc_retries: u64,
}

impl Step2Replay {
    /// The steady-state reserved peak: within the limit when the steps fit
    /// there, else what they would need without one.
    pub fn expected_reserved_peak_bytes(&self) -> u64 {
        match self.within_limit {
            Some(w) if w.fits => w.steady_reserved_peak_bytes,
            _ => self.steady_reserved_peak_bytes,
        }
    }
}

/// Replays step 2 from step 1's trace, with no limit on reserved memory; see
/// the module documentation.
pub fn replay_step2(
    trace: &AllocatorTrace,
    grads_persistent: bool,
) -> Result<Step2Replay, TraceError> {
    replay_step2_within(trace, grads_persistent, None)
}

/// [`replay_step2`], and again within `reserved_limit` when given
/// ([`Step2Replay::within_limit`]).
pub fn replay_step2_within(
    trace: &AllocatorTrace,
    grads_persistent: bool,
    reserved_limit: Option<u64>,
) -> Result<Step2Replay, TraceError> {
    replay_step2_with(
        trace,
        Gradients::from_persistent(grads_persistent),
        reserved_limit,
        None,
    )
}

/// [`replay_step2_within`], with the gradients' fate between steps said in
/// full and DDP's bucket rebuild at step 2's first forward, if the rank's
/// facts announced one ([`crate::ModelFacts::ddp_bucket_rebuild`]; the
/// trace's chunks do not carry it, so it comes with the plan:
/// [`crate::feed::ReplayPlan`]).
pub fn replay_step2_with(
    trace: &AllocatorTrace,
    gradients: Gradients,
    reserved_limit: Option<u64>,
    ddp_bucket_rebuild: Option<&DdpBucketRebuild>,
) -> Result<Step2Replay, TraceError> {
    let p = prepare(trace, gradients, ddp_bucket_rebuild)?;
    let grads_persistent = gradients == Gradients::Kept;
    let limited = reserved_limit.map(|limit| {
        p.plan.run_steps(
            p.alloc.clone(),
            p.previous.clone(),
            p.grads.clone(),
            limit,
            REPLAYED_STEPS,
            &mut |_, _, _, _| {},
        )
    });
    // Within the limit with no cache release, every allocation took the path
    // it takes without one: the same runs.
    let unlimited = match &limited {
        Some(runs)
            if runs
                .iter()
                .all(|r| !r.out_of_memory && r.alloc_retries == 0) =>
        {
            runs.clone()
        }
        _ => p.plan.run_steps(
            p.alloc,
            p.previous,
            p.grads,
            u64::MAX,
            REPLAYED_STEPS,
            &mut |_, _, _, _| {},
        ),
    };
    let within_limit = limited.map(|runs| {
        let fits = runs.iter().all(|r| !r.out_of_memory);
        LimitedReplay {
            fits,
            reserved_peak_bytes: runs[0].peak.reserved,
            steady_reserved_peak_bytes: if fits { steady_peak(&runs) } else { 0 },
            alloc_retries: runs.iter().map(|r| r.alloc_retries).sum(),
        }
    });
    let step2 = &unlimited[0];
    Ok(Step2Replay {
        reserved_at_step1_end_bytes: p.reserved_at_end,
        reserved_peak_bytes: step2.peak.reserved,
        allocated_peak_bytes: step2.peak.allocated,
        new_segment_bytes: step2.peak.reserved.saturating_sub(p.reserved_at_end),
        state_bytes: p.state_bytes,
        grad_bytes: p.grad_bytes,
        grads_persistent,
        grads_freed_before_backward: gradients == Gradients::FreedBeforeBackward,
        events_replayed: step2.events_replayed,
        steady_reserved_peak_bytes: steady_peak(&unlimited),
        reserved_limit_bytes: reserved_limit,
        within_limit,
        ddp_bucket_rebuild: p.rebuild_summary,
        loop_variable_bytes: p.loop_bytes,
        forward_returns_known: !trace.forward_returns.is_empty(),
    })
}

/// Where in a replayed step [`replay_optimizer_layouts`] shows the layout:
/// where a client without a trace sends its snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerBoundary {
    /// Before the optimizer phase's first allocator event, after what the
    /// replay lets go of just before it.
    Begin,
    /// After the step's last event (the trace ends with the optimizer).
    End,
}

/// A replayed step's layouts at its optimizer begin and end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayedStepLayouts {
    /// The step (2 for the first replayed).
    pub step: usize,
    /// The layout before the optimizer phase (empty when the trace has
    /// none).
    pub optimizer_begin: Vec<SegmentLayout>,
    /// The layout at the step's end.
    pub optimizer_end: Vec<SegmentLayout>,
    /// Where the step's gradients (allocations its backward made, alive at
    /// its end) start in `optimizer_end`, ascending: what a client's
    /// per-block gradient flag would mark.
    pub gradients_at_end: Vec<u64>,
    /// Highest reserved bytes during the step.
    pub reserved_peak_bytes: u64,
}

/// The layouts the unlimited replay of steps 2..=1 + `steps` passes
/// through at each step's optimizer begin and end, with each step's
/// reserved peak: what a client without a trace would snapshot in those
/// steps, for diagnostics that test the markers-only layout rule
/// (`layout`) on later steps than step 1. Stops after a step that
/// ran out.
pub fn replay_optimizer_layouts(
    trace: &AllocatorTrace,
    gradients: Gradients,
    ddp_bucket_rebuild: Option<&DdpBucketRebuild>,
    steps: usize,
) -> Result<Vec<ReplayedStepLayouts>, TraceError> {
    let p = prepare(trace, gradients, ddp_bucket_rebuild)?;
    let mut layouts: Vec<ReplayedStepLayouts> = Vec::with_capacity(steps);
    let runs = p.plan.run_steps(
        p.alloc,
        p.previous,
        p.grads,
        u64::MAX,
        steps,
        &mut |step, at, alloc, gradients| {
            if layouts.len() == step {
                layouts.push(ReplayedStepLayouts {
                    step: step + 2,
                    optimizer_begin: Vec::new(),
                    optimizer_end: Vec::new(),
                    gradients_at_end: Vec::new(),
                    reserved_peak_bytes: 0,
                });
            }
            match at {
                OptimizerBoundary::Begin => layouts[step].optimizer_begin = alloc.layout(),
                OptimizerBoundary::End => {
                    layouts[step].optimizer_end = alloc.layout();
                    layouts[step].gradients_at_end = gradients.to_vec();
                }
            }
        },
    );
    layouts.truncate(runs.len());
    for (l, r) in layouts.iter_mut().zip(&runs) {
        l.reserved_peak_bytes = r.peak.reserved;
    }
    Ok(layouts)
}

/// Shown the allocator at a replayed step's optimizer boundary: the step
/// (0 for step 2), the boundary, the allocator, and the addresses of the
/// step's gradients alive there.
type StepObserver<'o> = dyn FnMut(usize, OptimizerBoundary, &CachingAllocator, &[u64]) + 'o;

/// What the replay starts from: the plan, the allocator at step 1's end,
/// and what step 1 left alive for step 2 to free.
struct Prepared<'a> {
    plan: Plan<'a>,
    alloc: CachingAllocator,
    previous: HashMap<usize, AllocId>,
    grads: Vec<AllocId>,
    reserved_at_end: u64,
    state_bytes: u64,
    grad_bytes: u64,
    loop_bytes: u64,
    rebuild_summary: Option<ReplayedBucketRebuild>,
}

/// The allocator at step 1's end and the plan to replay the steps after
/// it (see [`replay_step2_with`]).
fn prepare<'a>(
    trace: &'a AllocatorTrace,
    gradients: Gradients,
    ddp_bucket_rebuild: Option<&DdpBucketRebuild>,
) -> Result<Prepared<'a>, TraceError> {
    let grads_persistent = gradients == Gradients::Kept;
    trace.check_bounds()?;
    let settings = trace.model_settings()?;
    // Segments step 1 made are the newest, in the order it made them (best
    // fit prefers the oldest among equal blocks).
    let made_in_step1: Vec<u64> = trace
        .events
        .iter()
        .filter(|e| e.action == AllocatorAction::SegmentAlloc)
        .map(|e| e.address)
        .collect();
    let (mut alloc, live) =
        CachingAllocator::from_layout_aged(&trace.segments, settings, &made_in_step1)?;
    let reserved_at_end = alloc.reserved();
    // Segments step 1 released are address space CUDA may hand out again.
    for e in &trace.events {
        if e.action == AllocatorAction::SegmentFree {
            alloc.add_address_hole(e.address, e.size);
        }
    }
    // Allocations in a private pool (a CUDA graph's, a MemPool's) are not
    // replayed: they neither take from nor give to the ordinary pools.
    let private: BTreeMap<u64, u64> = trace
        .segments
        .iter()
        .filter(|s| s.pool_id != 0)
        .map(|s| (s.address, s.address.saturating_add(s.size())))
        .collect();
    let in_private = |address: u64| {
        private
            .range(..=address)
            .next_back()
            .is_some_and(|(_, &end)| address < end)
    };
    let mut private_events = Vec::new();

    // Pair allocations with their frees; what stays open is alive at the end.
    let mut open: HashMap<u64, usize> = HashMap::new();
    // Free event → the allocation it frees.
    let mut frees: HashMap<usize, usize> = HashMap::new();
    for (index, e) in trace.events.iter().enumerate() {
        if e.size == 0 && e.action == AllocatorAction::Alloc {
            return Err(TraceError::ZeroSize { index });
        }
        match e.action {
            AllocatorAction::Alloc if in_private(e.address) => private_events.push(index),
            AllocatorAction::Alloc => {
                if open.insert(e.address, index).is_some() {
                    return Err(TraceError::DoubleAlloc {
                        index,
                        address: e.address,
                    });
                }
            }
            AllocatorAction::Free => {
                // A free of something allocated before the trace began has no
                // counterpart in step 2.
                if let Some(a) = open.remove(&e.address) {
                    frees.insert(index, a);
                }
            }
            AllocatorAction::SegmentAlloc
            | AllocatorAction::SegmentFree
            | AllocatorAction::SegmentMap
            | AllocatorAction::SegmentUnmap => {}
        }
    }
    let live: HashMap<u64, AllocId> = live.into_iter().collect();
    // Alive at the end: state (optimizer phase), gradients (backward) or
    // replaced (the training loop's variables, such as the logits and the
    // loss: step 2 makes them again and frees step 1's then).
    let mut keep: HashSet<usize> = HashSet::new();
    let (mut state_bytes, mut grad_bytes, mut loop_bytes) = (0u64, 0u64, 0u64);
    let mut grads = Vec::new();
    let mut replaced: Vec<(usize, AllocId)> = Vec::new();
    let mut accumulated: Vec<usize> = Vec::new();
    let mut open: Vec<(u64, usize)> = open.into_iter().collect();
    open.sort_unstable_by_key(|&(_, index)| index);
    for &(address, index) in &open {
        let e = &trace.events[index];
        let size = settings.round_size(e.size);
        let Some(&id) = live
            .get(&address)
            .filter(|&&id| alloc.block_size(id).is_some_and(|b| b >= size))
        else {
            return Err(TraceError::LayoutMismatch {
                index,
                address,
                size,
            });
        };
        match e.phase {
            PhaseKind::Optimizer => {
                state_bytes += size;
                keep.insert(index);
            }
            PhaseKind::Backward => {
                grad_bytes += size;
                if grads_persistent {
                    accumulated.push(index);
                } else {
                    grads.push(id);
                }
            }
            _ => {
                loop_bytes += size;
                replaced.push((index, id));
            }
        }
    }
    keep.extend(private_events);
    alloc.reset_step_peak();
    let rebuild = ddp_bucket_rebuild.map(|r| {
        let open: HashSet<u64> = open.iter().map(|&(address, _)| address).collect();
        let before_trace: Vec<(u64, AllocId)> = live
            .iter()
            .filter(|(address, _)| !open.contains(address) && !in_private(**address))
            .map(|(&address, &id)| (address, id))
            .collect();
        let old = old_bucket_blocks(&alloc, &before_trace, &r.old_bucket_bytes, &settings);
        let summary = ReplayedBucketRebuild {
            modelled: old.is_some(),
            old_bucket_bytes: r.old_bucket_bytes.iter().sum(),
            new_bucket_bytes: r.new_bucket_bytes.iter().sum(),
            new_buckets: u32::try_from(r.new_bucket_bytes.len()).unwrap_or(u32::MAX),
        };
        // DDP rebuilds at the start of its forward, before the model's.
        let at = trace
            .events
            .iter()
            .position(|e| e.phase == PhaseKind::Forward)
            .unwrap_or(0);
        let plan = old.map(|old| RebuildPlan {
            at,
            old,
            new_bucket_bytes: r.new_bucket_bytes.clone(),
        });
        (summary, plan)
    });
    let (rebuild_summary, rebuild_plan) = rebuild.unzip();

    let replaced_events: Vec<usize> = replaced.iter().map(|&(index, _)| index).collect();
    let grads_freed_at = match gradients {
        // Before the step's first backward event (the first micro-batch's).
        Gradients::FreedBeforeBackward => trace
            .events
            .iter()
            .position(|e| e.phase == PhaseKind::Backward)
            .unwrap_or(0),
        _ => 0,
    };
    let plan = Plan::new(
        trace,
        keep,
        frees,
        &replaced_events,
        &accumulated,
        grads_freed_at,
        rebuild_plan.flatten(),
    );
    Ok(Prepared {
        plan,
        alloc,
        previous: replaced.into_iter().collect(),
        grads,
        reserved_at_end,
        state_bytes,
        grad_bytes,
        loop_bytes,
        rebuild_summary,
    })
}

/// DDP's bucket rebuild as step 2 makes it: before event `at` (its first
/// forward's), the old buckets' blocks are freed, then the new buckets are
/// allocated in order (PyTorch's `Reducer::initialize_buckets` clears the
/// old buckets before it allocates).
#[derive(Debug, Clone)]
struct RebuildPlan {
    at: usize,
    old: Vec<AllocId>,
    new_bucket_bytes: Vec<u64>,
}

/// The blocks holding DDP's old buckets: for each, among the blocks alive
/// since before the trace (DDP allocates its buckets when it is
/// constructed), the smallest that a request of its size may have been
/// given (the rounded size, plus the remainder the allocator leaves unsplit:
/// up to 1 MiB in the large pool, up to 20 MiB for an oversize block under
/// `max_split_size_mb`). Largest buckets first, each block once. None when
/// one has no such block.
fn old_bucket_blocks(
    alloc: &CachingAllocator,
    before_trace: &[(u64, AllocId)],
    old_bucket_bytes: &[u64],
    settings: &AllocatorSettings,
) -> Option<Vec<AllocId>> {
    let slack = if settings.max_split_size.is_some() {
        LARGE_BUFFER
    } else {
        SMALL_SIZE
    };
    // (size, address, id), so the smallest fit comes first, ties by address.
    let mut candidates: Vec<(u64, u64, AllocId)> = before_trace
        .iter()
        .filter_map(|&(address, id)| alloc.block_size(id).map(|size| (size, address, id)))
        .collect();
    candidates.sort_unstable();
    let mut buckets: Vec<u64> = old_bucket_bytes.to_vec();
    buckets.sort_unstable_by(|a, b| b.cmp(a));
    let mut found = Vec::with_capacity(buckets.len());
    for bytes in buckets {
        let size = settings.round_size(bytes);
        let at = candidates
            .iter()
            .position(|&(block, _, _)| block >= size && block <= size.saturating_add(slack))?;
        found.push(candidates.remove(at).2);
    }
    Some(found)
}

/// The steady-state reserved peak of replayed steps 2, 3, …: the highest
/// peak of the steps after step 2. Step 2 starts from the layout step 1
/// left, which no later step sees again; the steps after it repeat. Where
/// nothing releases the cache (no retry, no `empty_cache()` in the trace)
/// reserved memory never shrinks, so that is the last step's peak. With
/// retries the cache need not settle: each step may fill
/// the GPU, release and rearrange again, and the steps' peaks take turns
/// (`fsdp2-4` on real PyTorch at its fragmentation capacity: steps 3–6
/// peaked at 4,802, 4,676, 4,802 and 4,804 MiB reserved, each after cache
/// releases, as the replay's do), so the last step's peak may be the
/// lowest of the cycle. The highest is what the GPU must hold, counting
/// the pages a failed expandable growth held for an instant
/// ([`Usage::device`]).
fn steady_peak(runs: &[Run]) -> u64 {
    runs.iter()
        .skip(1)
        .map(|r| r.peak.device)
        .max()
        .or_else(|| runs.first().map(|r| r.peak.device))
        .unwrap_or(0)
}

/// When step 2 frees what it does not keep of step 1's allocations that
/// are alive at the trace's end, besides the gradients set to None.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    /// The gradient this allocation event makes, which step 2 adds into the
    /// kept one (`AccumulateGrad`) and drops.
    Accumulated(usize),
    /// The previous step's copy of what this allocation event makes (a
    /// training loop's variable, rebound to the new one).
    Replaced(usize),
}

/// For each allocation alive at the trace's end that the next step makes
/// again (`replaced`: a training loop's variables, such as the logits and
/// the loss), the allocation of the next step that makes its new value: the
/// one at the same place (the same count of allocations into the phase) in
/// the step's first run of that phase. With gradient accumulation the last
/// micro-batch's logits live until the next step's first micro-batch makes
/// its own. When that allocation is not of the same size, the allocation
/// itself. Returns (replaced, its replacement) pairs.
fn replacements(events: &[AllocatorEvent], replaced: &[usize]) -> Vec<(usize, usize)> {
    // Per event: the allocations before it in its phase run (a maximal
    // stretch of events of one phase).
    let mut offsets: Vec<usize> = Vec::with_capacity(events.len());
    let mut runs_seen: HashSet<PhaseKind> = HashSet::new();
    let mut first_run: HashMap<PhaseKind, Vec<usize>> = HashMap::new();
    let (mut in_first_run, mut allocs_in_run) = (false, 0);
    for (index, e) in events.iter().enumerate() {
        if index == 0 || events[index - 1].phase != e.phase {
            in_first_run = runs_seen.insert(e.phase);
            allocs_in_run = 0;
        }
        offsets.push(allocs_in_run);
        if e.action == AllocatorAction::Alloc {
            allocs_in_run += 1;
            if in_first_run {
                first_run.entry(e.phase).or_default().push(index);
            }
        }
    }
    replaced
        .iter()
        .map(|&index| {
            let e = &events[index];
            let by = first_run
                .get(&e.phase)
                .and_then(|allocs| allocs.get(offsets[index]))
                .copied()
                .filter(|&i| events[i].size == e.size)
                .unwrap_or(index);
            (index, by)
        })
        .collect()
}

/// Where the memory an allocation event stands for is let go of, for each of
/// `anchors` (event indices, ascending), as (anchor, index of the event it
/// is freed just before; the events' count for the end): just before the
/// first allocation, not an anchor, that follows a free made since the
/// latest anchor. Anchors with no such point between them are freed there
/// together. That is where a node of the autograd graph, or a statement of
/// the training loop, has ended: it has freed its temporaries or released
/// what it saved, and the next one allocates.
///
/// - `AccumulateGrad`, which adds a gradient into a kept one and drops it,
///   runs right after the node that made the gradient, once that node has
///   released what it saved; a node's gradients come together, with its
///   other allocations between them.
/// - A variable of the training loop (`logits = model(x)`) is rebound once
///   the statement that makes its new value is done, after the temporaries
///   made after that value (a matmul's workspace) are freed.
fn release_points(events: &[AllocatorEvent], anchors: &[usize]) -> Vec<(usize, usize)> {
    let mut points = Vec::with_capacity(anchors.len());
    let mut pending: Vec<usize> = Vec::new();
    let mut freed_since = false;
    let mut next = anchors.iter().copied().peekable();
    for (index, e) in events.iter().enumerate() {
        match e.action {
            AllocatorAction::Alloc if next.peek() == Some(&index) => {
                next.next();
                pending.push(index);
                freed_since = false;
            }
            AllocatorAction::Alloc => {
                if freed_since {
                    points.extend(pending.drain(..).map(|a| (a, index)));
                }
            }
            AllocatorAction::Free => freed_since = !pending.is_empty(),
            AllocatorAction::SegmentAlloc
            | AllocatorAction::SegmentFree
            | AllocatorAction::SegmentMap
            | AllocatorAction::SegmentUnmap => {}
        }
    }
    points.extend(pending.into_iter().map(|a| (a, events.len())));
    points
}

/// Where a training loop's variable made by allocation `by` can be rebound at
/// the earliest, when `by` is made inside the watched model's forward: once
/// the forward has returned (the first of the trace's `forward_returns` after
/// `by`, in its run of forward events). `out = model(**batch)` keeps step
/// 1's whole output (logits, loss, a cache) alive until then, while the
/// model goes on allocating after the logits (the loss, label shifting),
/// where `release_points` alone would free them. 0 (no constraint) for an
/// allocation the loop made after the model returned, and when the client
/// sent no forward returns.
fn model_returned_after(trace: &AllocatorTrace, by: usize) -> usize {
    let events = &trace.events;
    if events[by].phase != PhaseKind::Forward {
        return 0;
    }
    let run_end = (by..events.len())
        .find(|&i| events[i].phase != PhaseKind::Forward)
        .unwrap_or(events.len());
    trace
        .forward_returns
        .iter()
        .map(|&r| usize::try_from(r).unwrap_or(usize::MAX))
        .find(|&r| r > by)
        .filter(|&r| r <= run_end)
        .unwrap_or(0)
}

/// What to replay: the events, those whose allocation step 2 does not make
/// again, which allocation each free undoes, and where step 2 frees what is
/// neither freed in the trace nor kept.
struct Plan<'a> {
    trace: &'a AllocatorTrace,
    keep: HashSet<usize>,
    frees: HashMap<usize, usize>,
    /// Event index → what is freed just before it (the events' count: at
    /// the end).
    releases: HashMap<usize, Vec<Release>>,
    /// Allocations a step leaves alive for the next to replace.
    replaced: HashSet<usize>,
    /// Event index before which the previous step's gradients set to None
    /// are freed (0: before the step).
    grads_freed_at: usize,
    /// DDP's bucket rebuild, made in step 2 only.
    rebuild: Option<RebuildPlan>,
    /// The optimizer phase's first event, if any.
    optimizer_at: Option<usize>,
}

#[derive(Clone)]
struct Run {
    peak: Usage,
    events_replayed: u64,
    alloc_retries: u64,
    out_of_memory: bool,
}

impl<'a> Plan<'a> {
    /// `replaced`: allocations alive at the trace's end that step 2 makes
    /// again; `accumulated`: gradients alive at the end that step 2 adds into
    /// (both event indices, ascending).
    fn new(
        trace: &'a AllocatorTrace,
        keep: HashSet<usize>,
        frees: HashMap<usize, usize>,
        replaced: &[usize],
        accumulated: &[usize],
        grads_freed_at: usize,
        rebuild: Option<RebuildPlan>,
    ) -> Self {
        let events = &trace.events;
        let mut releases: HashMap<usize, Vec<Release>> = HashMap::new();
        for (grad, at) in release_points(events, accumulated) {
            releases
                .entry(at)
                .or_default()
                .push(Release::Accumulated(grad));
        }
        let pairs = replacements(events, replaced);
        let mut by: Vec<usize> = pairs.iter().map(|&(_, by)| by).collect();
        by.sort_unstable();
        by.dedup();
        let at: HashMap<usize, usize> = release_points(events, &by).into_iter().collect();
        for (old, by) in pairs {
            releases
                .entry(at[&by].max(model_returned_after(trace, by)))
                .or_default()
                .push(Release::Replaced(old));
        }
        Plan {
            trace,
            keep,
            frees,
            releases,
            replaced: replaced.iter().copied().collect(),
            grads_freed_at,
            rebuild,
            optimizer_at: events.iter().position(|e| e.phase == PhaseKind::Optimizer),
        }
    }

    /// Replays steps 2..=1 + `steps` on `alloc`, which may reserve up to
    /// `limit`, stopping at the first that runs out. `previous` are the
    /// allocations step 1 left alive that step 2 replaces, by event index;
    /// `grads` its gradients set to None. Each step frees the other
    /// allocations the one before made and kept (its gradients) where
    /// gradients are freed. `observe` is shown the allocator at each step's
    /// optimizer begin and end (the step counted from 0 for step 2).
    fn run_steps(
        &self,
        mut alloc: CachingAllocator,
        mut previous: HashMap<usize, AllocId>,
        mut grads: Vec<AllocId>,
        limit: u64,
        steps: usize,
        observe: &mut StepObserver<'_>,
    ) -> Vec<Run> {
        let mut runs = Vec::with_capacity(steps);
        for step in 0..steps {
            if self.grads_freed_at == 0 {
                for id in grads.drain(..) {
                    alloc.free(id);
                }
            }
            alloc.reset_step_peak();
            let rebuild = self.rebuild.as_ref().filter(|_| step == 0);
            let (run, left) = self.run(
                &mut alloc,
                limit,
                &mut previous,
                &mut grads,
                rebuild,
                &mut |at, alloc, gradients| observe(step, at, alloc, gradients),
            );
            // What the step did not get to free (it ran out) goes first.
            for id in grads.drain(..).chain(previous.drain().map(|(_, id)| id)) {
                alloc.free(id);
            }
            for (index, id) in left {
                if self.replaced.contains(&index) {
                    previous.insert(index, id);
                } else {
                    grads.push(id);
                }
            }
            let out_of_memory = run.out_of_memory;
            runs.push(run);
            if out_of_memory {
                break;
            }
        }
        runs
    }

    /// Replays the events once, freeing each of `previous` when the step
    /// replaces it and `grads` where gradients are freed, and making
    /// `rebuild` where it falls; returns the step's figures and the replayed
    /// allocations it left alive, by event index. `observe` is shown the
    /// allocator at the optimizer's first event and at the end.
    fn run(
        &self,
        alloc: &mut CachingAllocator,
        limit: u64,
        previous: &mut HashMap<usize, AllocId>,
        grads: &mut Vec<AllocId>,
        rebuild: Option<&RebuildPlan>,
        observe: &mut dyn FnMut(OptimizerBoundary, &CachingAllocator, &[u64]),
    ) -> (Run, Vec<(usize, AllocId)>) {
        let retries_before = alloc.num_alloc_retries();
        let mut replayed: HashMap<usize, AllocId> = HashMap::new();
        let mut events_replayed = 0;
        let mut out_of_memory = false;
        // The new buckets live on; nothing of the replay frees them.
        let rebuild_buckets = |alloc: &mut CachingAllocator, r: &RebuildPlan| {
            for &id in &r.old {
                alloc.free(id);
            }
            r.new_bucket_bytes
                .iter()
                .all(|&bytes| alloc.malloc_on(bytes, 0, limit).is_ok())
        };
        for (index, e) in self.trace.events.iter().enumerate() {
            if index == self.grads_freed_at {
                for id in grads.drain(..) {
                    alloc.free(id);
                }
            }
            if let Some(r) = rebuild.filter(|r| r.at == index) {
                if !rebuild_buckets(alloc, r) {
                    out_of_memory = true;
                    break;
                }
            }
            self.release(alloc, index, &mut replayed, previous);
            // What is let go of before the optimizer's first event (a
            // gradient `AccumulateGrad` dropped) went in backward.
            if Some(index) == self.optimizer_at {
                observe(
                    OptimizerBoundary::Begin,
                    alloc,
                    &self.gradient_addresses(alloc, &replayed),
                );
            }
            match e.action {
                AllocatorAction::Alloc if !self.keep.contains(&index) => {
                    match alloc.malloc_on(e.size, e.stream, limit) {
                        Ok(id) => {
                            replayed.insert(index, id);
                            events_replayed += 1;
                        }
                        Err(_) => {
                            out_of_memory = true;
                            break;
                        }
                    }
                }
                AllocatorAction::Alloc
                | AllocatorAction::SegmentAlloc
                | AllocatorAction::SegmentMap => {}
                AllocatorAction::SegmentFree | AllocatorAction::SegmentUnmap => {
                    let first = index == 0 || !self.trace.events[index - 1].action.releases();
                    if first {
                        alloc.release_free_segments();
                    }
                }
                AllocatorAction::Free => {
                    if let Some(id) = self.frees.get(&index).and_then(|a| replayed.remove(a)) {
                        alloc.free(id);
                        events_replayed += 1;
                    }
                }
            }
        }
        if !out_of_memory {
            let end = self.trace.events.len();
            self.release(alloc, end, &mut replayed, previous);
            let gradients = self.gradient_addresses(alloc, &replayed);
            observe(OptimizerBoundary::End, alloc, &gradients);
        }
        let run = Run {
            peak: alloc.peaks().step,
            events_replayed,
            alloc_retries: alloc.num_alloc_retries() - retries_before,
            out_of_memory,
        };
        let mut left: Vec<(usize, AllocId)> = replayed.into_iter().collect();
        left.sort_unstable();
        (run, left)
    }

    /// The addresses of the allocations this step made in backward that are
    /// still alive (its gradients), ascending.
    fn gradient_addresses(
        &self,
        alloc: &CachingAllocator,
        replayed: &HashMap<usize, AllocId>,
    ) -> Vec<u64> {
        let mut addresses: Vec<u64> = replayed
            .iter()
            .filter(|(&index, _)| self.trace.events[index].phase == PhaseKind::Backward)
            .filter_map(|(_, &id)| alloc.address_of(id))
            .collect();
        addresses.sort_unstable();
        addresses
    }

    /// Frees what is let go of just before event `index`.
    fn release(
        &self,
        alloc: &mut CachingAllocator,
        index: usize,
        replayed: &mut HashMap<usize, AllocId>,
        previous: &mut HashMap<usize, AllocId>,
    ) {
        for r in self.releases.get(&index).into_iter().flatten() {
            let id = match *r {
                Release::Accumulated(grad) => replayed.remove(&grad),
                Release::Replaced(old) => previous.remove(&old),
            };
            if let Some(id) = id {
                alloc.free(id);
            }
        }
    }
}
