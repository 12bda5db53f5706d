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

use crate::allocator::{round_size, AllocId, CachingAllocator, LayoutError, SegmentLayout};
use crate::marker::PhaseKind;

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
    /// Events replayed.
    pub events_replayed: u64,
}

/// Replays step 2 from step 1's trace; see the module documentation.
pub fn replay_step2(
    trace: &AllocatorTrace,
    grads_persistent: bool,
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
    let layout_sizes: HashMap<u64, u64> = trace
        .segments
        .iter()
        .flat_map(|s| {
            let mut at = s.address;
            s.blocks.iter().map(move |b| {
                let here = at;
                at += b.size;
                (here, if b.allocated { b.size } else { 0 })
            })
        })
        .collect();

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
            .filter(|_| layout_sizes.get(&address).is_some_and(|&b| b >= size))
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

    let mut replayed: HashMap<usize, AllocId> = HashMap::new();
    let mut events_replayed = 0;
    for (index, e) in trace.events.iter().enumerate() {
        match e.action {
            AllocatorAction::Alloc if !keep.contains(&index) => {
                let id = alloc
                    .malloc(e.size, u64::MAX)
                    .expect("an unlimited allocator never runs out");
                replayed.insert(index, id);
                events_replayed += 1;
            }
            AllocatorAction::Alloc => {}
            AllocatorAction::Free => {
                if let Some(id) = frees.get(&index).and_then(|a| replayed.remove(a)) {
                    alloc.free(id);
                    events_replayed += 1;
                }
            }
        }
    }
    let peak = alloc.peaks().step;
    Ok(Step2Replay {
        reserved_at_step1_end_bytes: reserved_at_end,
        reserved_peak_bytes: peak.reserved,
        allocated_peak_bytes: peak.allocated,
        new_segment_bytes: peak.reserved.saturating_sub(reserved_at_end),
        state_bytes,
        grad_bytes,
        grads_persistent,
        events_replayed,
    })
}
