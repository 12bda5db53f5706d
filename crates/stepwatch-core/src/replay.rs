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
//! [`CachingAllocator`] from that layout, frees the gradients if they are set
//! to None between steps, and replays step 1's events, skipping the
//! allocations that are still alive at the end of step 1's optimizer phase
//! (the state, and the gradients when they persist). The reserved peak it
//! reaches is step 2's.
//!
//! The replay is exact when the model follows PyTorch's allocator and step 2
//! repeats step 1; it does not see allocations that happen only from step 2
//! on (for example a second gradient buffer when gradients persist).

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::allocator::{round_size, AllocId, CachingAllocator, LayoutError, SegmentLayout, Usage};
use crate::marker::PhaseKind;

/// Steps replayed after step 1 (steps 2..=1 + this): enough for the cache to
/// settle when step 2 had to release it.
pub const REPLAYED_STEPS: usize = 3;

/// Most events a trace may hold; bounds the agent's memory and replay time.
pub const MAX_TRACE_EVENTS: usize = 262_144;
/// Most blocks, over all segments, a trace may hold.
pub const MAX_TRACE_BLOCKS: usize = 262_144;

/// What an allocator event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocatorAction {
    /// A block was handed out.
    Alloc,
    /// A block went back to the cache.
    Free,
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
}

/// Step 1's allocator history, as a client sends it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorTrace {
    /// The step the events come from.
    pub step: u64,
    /// Segments when the trace ends, after step 1's optimizer phase.
    pub segments: Vec<SegmentLayout>,
    /// The step's allocations and frees, oldest first.
    pub events: Vec<AllocatorEvent>,
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
        Ok(())
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
    /// Whether gradients were kept into step 2 (else freed first, as
    /// `zero_grad(set_to_none=True)` does, and made again in backward).
    pub grads_persistent: bool,
    /// Events replayed (in step 2).
    pub events_replayed: u64,
    /// Highest reserved bytes of the last replayed step (step
    /// 1 + [`REPLAYED_STEPS`]): the steady state, where a step leaves the
    /// cache as it found it. Usually step 2's figure; lower when step 2 only
    /// fitted by releasing the cache, which rearranges it.
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
    /// Highest reserved bytes of the last replayed step, when all fit.
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
    trace.check_bounds()?;
    let (mut alloc, live) = CachingAllocator::from_layout(&trace.segments)?;
    let reserved_at_end = alloc.reserved();

    // Pair allocations with their frees; what stays open is alive at the end.
    let mut open: HashMap<u64, usize> = HashMap::new();
    // Free event → the allocation it frees.
    let mut frees: HashMap<usize, usize> = HashMap::new();
    for (index, e) in trace.events.iter().enumerate() {
        if e.size == 0 && e.action == AllocatorAction::Alloc {
            return Err(TraceError::ZeroSize { index });
        }
        match e.action {
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
        }
    }
    let live: HashMap<u64, AllocId> = live.into_iter().collect();
    // Alive at the end: state (optimizer phase), gradients (backward) or
    // other (made again in step 2 on top of the old, which stays).
    let mut keep: HashSet<usize> = HashSet::new();
    let (mut state_bytes, mut grad_bytes) = (0u64, 0u64);
    let mut free_first = Vec::new();
    for (&address, &index) in &open {
        let e = &trace.events[index];
        let size = round_size(e.size);
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
                    keep.insert(index);
                } else {
                    free_first.push(id);
                }
            }
            _ => {}
        }
    }
    for id in free_first {
        alloc.free(id);
    }
    alloc.reset_step_peak();

    let plan = Plan {
        trace,
        keep: &keep,
        frees: &frees,
    };
    let limited = reserved_limit.map(|limit| plan.run_steps(alloc.clone(), limit));
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
        _ => plan.run_steps(alloc, u64::MAX),
    };
    let within_limit = limited.map(|runs| {
        let fits = runs.iter().all(|r| !r.out_of_memory);
        LimitedReplay {
            fits,
            reserved_peak_bytes: runs[0].peak.reserved,
            steady_reserved_peak_bytes: if fits {
                runs.last().map_or(0, |r| r.peak.reserved)
            } else {
                0
            },
            alloc_retries: runs.iter().map(|r| r.alloc_retries).sum(),
        }
    });
    let step2 = &unlimited[0];
    Ok(Step2Replay {
        reserved_at_step1_end_bytes: reserved_at_end,
        reserved_peak_bytes: step2.peak.reserved,
        allocated_peak_bytes: step2.peak.allocated,
        new_segment_bytes: step2.peak.reserved.saturating_sub(reserved_at_end),
        state_bytes,
        grad_bytes,
        grads_persistent,
        events_replayed: step2.events_replayed,
        steady_reserved_peak_bytes: unlimited.last().map_or(0, |r| r.peak.reserved),
        reserved_limit_bytes: reserved_limit,
        within_limit,
    })
}

/// What to replay: the events, those whose allocation step 2 does not make
/// again, and which allocation each free undoes.
struct Plan<'a> {
    trace: &'a AllocatorTrace,
    keep: &'a HashSet<usize>,
    frees: &'a HashMap<usize, usize>,
}

#[derive(Clone)]
struct Run {
    peak: Usage,
    events_replayed: u64,
    alloc_retries: u64,
    out_of_memory: bool,
}

impl Plan<'_> {
    /// Replays steps 2..=1 + [`REPLAYED_STEPS`] on `alloc`, which may reserve
    /// up to `limit`, stopping at the first that runs out. Each step after the
    /// first starts by freeing what the one before made and kept (gradients
    /// set to None, tensors replaced every step such as the loss).
    fn run_steps(&self, mut alloc: CachingAllocator, limit: u64) -> Vec<Run> {
        let mut runs = Vec::with_capacity(REPLAYED_STEPS);
        let mut carried: Vec<AllocId> = Vec::new();
        for _ in 0..REPLAYED_STEPS {
            for id in carried.drain(..) {
                alloc.free(id);
            }
            alloc.reset_step_peak();
            let (run, left) = self.run(&mut alloc, limit);
            carried = left;
            let out_of_memory = run.out_of_memory;
            runs.push(run);
            if out_of_memory {
                break;
            }
        }
        runs
    }

    /// Replays the events once; returns the step's figures and the replayed
    /// allocations it left alive.
    fn run(&self, alloc: &mut CachingAllocator, limit: u64) -> (Run, Vec<AllocId>) {
        let retries_before = alloc.num_alloc_retries();
        let mut replayed: HashMap<usize, AllocId> = HashMap::new();
        let mut events_replayed = 0;
        let mut out_of_memory = false;
        for (index, e) in self.trace.events.iter().enumerate() {
            match e.action {
                AllocatorAction::Alloc if !self.keep.contains(&index) => {
                    match alloc.malloc(e.size, limit) {
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
                AllocatorAction::Alloc => {}
                AllocatorAction::Free => {
                    if let Some(id) = self.frees.get(&index).and_then(|a| replayed.remove(a)) {
                        alloc.free(id);
                        events_replayed += 1;
                    }
                }
            }
        }
        let run = Run {
            peak: alloc.peaks().step,
            events_replayed,
            alloc_retries: alloc.num_alloc_retries() - retries_before,
            out_of_memory,
        };
        (run, replayed.into_values().collect())
    }
}
