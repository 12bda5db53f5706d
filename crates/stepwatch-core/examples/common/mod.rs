//! What the diagnostic example `step3_probe` and the test
//! `tests/replay_torch.rs` share:
//! step 1's layout at a phase boundary, rebuilt from an allocator trace by
//! undoing the later phases' events on the trace's end layout (what a
//! markers-only client would have snapshotted there).
use stepwatch_core::allocator::{self, BlockLayout, SegmentLayout};
use stepwatch_core::{AllocatorAction, AllocatorTrace, PhaseKind};

/// Step 1's layout at its optimizer begin: the trace's end layout with the
/// optimizer phase's events undone (latest first).
pub fn layout_at_optimizer_begin(trace: &AllocatorTrace) -> Vec<SegmentLayout> {
    layout_before(trace, &[PhaseKind::Optimizer])
}

/// The trace's end layout with the events of `phases` undone, latest first.
pub fn layout_before(trace: &AllocatorTrace, phases: &[PhaseKind]) -> Vec<SegmentLayout> {
    let mut segments = trace.segments.clone();
    for e in trace
        .events
        .iter()
        .rev()
        .filter(|e| phases.contains(&e.phase))
    {
        match e.action {
            AllocatorAction::Alloc => mark(&mut segments, e.address, None),
            AllocatorAction::Free => mark(
                &mut segments,
                e.address,
                Some(allocator::round_size(e.size)),
            ),
            AllocatorAction::SegmentAlloc => segments.retain(|s| s.address != e.address),
            _ => {}
        }
    }
    segments
}

/// Undoes one event on the block at `address`: an allocation (`None`)
/// frees it, a free (`Some(size)`) allocates `size` bytes there again.
pub fn mark(segments: &mut [SegmentLayout], address: u64, size: Option<u64>) {
    let s = segments
        .iter_mut()
        .find(|s| s.address <= address && address < s.address + s.size())
        .expect("the event's address is in a segment of the layout");
    let mut blocks = Vec::new();
    let mut start = s.address;
    for b in &s.blocks {
        let end = start + b.size;
        match size {
            None if start == address => blocks.push(BlockLayout {
                size: b.size,
                allocated: false,
                gradient: false,
            }),
            Some(n) if !b.allocated && start <= address && address < end => {
                let n = n.min(end - address);
                for (len, allocated) in [
                    (address - start, false),
                    (n, true),
                    (end - address - n, false),
                ] {
                    if len > 0 {
                        blocks.push(BlockLayout {
                            size: len,
                            allocated,
                            gradient: false,
                        });
                    }
                }
            }
            _ => blocks.push(*b),
        }
        start = end;
    }
    let mut merged: Vec<BlockLayout> = Vec::new();
    for b in blocks {
        match merged.last_mut() {
            Some(last) if !last.allocated && !b.allocated => last.size += b.size,
            _ => merged.push(b),
        }
    }
    s.blocks = merged;
}
