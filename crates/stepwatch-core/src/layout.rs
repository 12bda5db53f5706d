//! What step 1's optimizer did to the allocator's cache, from two segment
//! snapshots: at its optimizer begin and end.
//!
//! Without an allocator trace the prediction sees only phase-boundary
//! figures, which cannot show where the optimizer state landed. PyTorch's
//! caching allocator serves new state from the cached blocks backward freed
//! (best fit), splitting them; in step 2 the activations come back at their
//! old sizes and no longer fit there, so the allocator reserves new
//! segments although the allocated peak fits. Two snapshots show it:
//!
//! ```text
//! requests = per large-pool segment (default pool) with a free block at
//!            optimizer begin: the whole segment when it is not a 20 MiB
//!            one, else each of its free blocks; largest first
//! new      = reserved after serving them from the layout at optimizer end
//!            (the caching allocator's model: best fit, splitting, rounding)
//!            − reserved at optimizer end
//! ```
//!
//! PyTorch gives a request over 10 MiB a segment of its own size (rounded
//! to 2 MiB) and one of 1 to 10 MiB a 20 MiB segment (`kLargeBuffer`). So a
//! segment of another size was made for one request of about its size,
//! which step 2 makes again: its free part at optimizer begin may be less
//! (a gradient, freed before step 2, took the rest in step 1's backward).
//! A 20 MiB segment served several smaller requests; its free blocks, as
//! backward left them coalesced, stand for them (one request each: the
//! conservative reading). A segment the optimizer left alone serves its own
//! request; one the state was carved out of needs a new segment unless
//! another free block (a temporary the optimizer freed, the rest of a split
//! one) is large enough. Expandable segments (one per pool, grown in place)
//! count by their free blocks. Small-pool blocks (2 MiB segments) are left
//! out: their requests are small and the model could not tell them from
//! large ones by size.
//!
//! Checked on real PyTorch 2.15 on fake CUDA (`bench/torch-accuracy.sh
//! --variants markers`, roomy runs, reserved growth in step 2 over step 1's
//! end): GPT + AdamW 1208 MiB predicted, 1182 MiB real; SGD with momentum
//! 720 / 788; Lightning 1271 / 1472; with each free block as one request
//! instead, 1030, 523 and 1001. Lightning's shortfall is activations that
//! step 1's forward put where its gradients went later: step 2's forward
//! runs beside those gradients, and a layout cannot tell a gradient block
//! from a parameter one. What grows after step 2 (Lightning and expandable
//! segments: one logits-sized block in step 3) depends on where step 2's
//! own blocks went, which step 1's layouts do not show.

use serde::{Deserialize, Serialize};

use crate::allocator::{CachingAllocator, LayoutError, Pool, SegmentLayout, LARGE_BUFFER};

/// The most blocks one layout may hold for the tracker to keep it: a rank
/// holds one until the other arrives. A client's 64 KiB message cap allows
/// a few thousand.
pub const MAX_LAYOUT_BLOCKS: usize = 16_384;

/// What [`step2_new_segments`] found; part of a prediction's inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutEstimate {
    /// Bytes the allocator reserves anew in step 2 for the cache that the
    /// optimizer state split: added to the reserved prediction.
    pub new_segment_bytes: u64,
    /// What step 2's forward and backward are taken to ask for again (the
    /// requests above), bytes.
    pub cached_at_begin_bytes: u64,
    /// Requests the end layout could not serve without a new segment.
    pub blocks_needing_new_segments: u32,
    /// Reserved bytes (all pools) in the end layout.
    pub reserved_at_end_bytes: u64,
}

/// The segments step 2 adds because step 1's optimizer split the cache (see
/// the module documentation), with PyTorch's default allocator settings.
pub fn step2_new_segments(
    begin: &[SegmentLayout],
    end: &[SegmentLayout],
) -> Result<LayoutEstimate, LayoutError> {
    // A segment the optimizer left alone (the same blocks at its end) serves
    // its own request in step 2 as it did in step 1: it makes no request,
    // and its free blocks serve no other (they are its request's). Served
    // from the end layout instead, its request would meet the gradients
    // still there, which step 2 frees before its forward: plain SGD, no
    // state, came out 413 MB (one logits block) over on real PyTorch.
    let untouched = |s: &SegmentLayout| !s.expandable && end.iter().any(|e| e == s);
    let mut requests: Vec<(u64, u64)> = Vec::new();
    let mut self_served_bytes = 0;
    for s in begin
        .iter()
        .filter(|s| s.pool == Pool::Large && s.pool_id == 0)
    {
        let free = s.blocks.iter().filter(|b| !b.allocated).map(|b| b.size);
        if s.blocks.iter().all(|b| b.allocated) {
            continue;
        }
        if untouched(s) {
            self_served_bytes += if s.size() == LARGE_BUFFER {
                free.sum()
            } else {
                s.size()
            };
        } else if s.expandable || s.size() == LARGE_BUFFER {
            requests.extend(free.map(|size| (size, s.stream)));
        } else {
            requests.push((s.size(), s.stream));
        }
    }
    // Largest first; a stable order for equal sizes.
    requests.sort_by(|a, b| b.cmp(a));
    let reserved_at_end = CachingAllocator::from_layout(end)?.0.reserved();
    let serving: Vec<SegmentLayout> = end
        .iter()
        .filter(|e| !begin.iter().any(|s| s == *e && untouched(s)))
        .cloned()
        .collect();
    let (mut alloc, _) = CachingAllocator::from_layout(&serving)?;
    let reserved_before = alloc.reserved();
    let mut blocks_needing_new_segments = 0;
    for &(size, stream) in &requests {
        let before = alloc.reserved();
        // No limit: the figure is what step 2 would reserve.
        if alloc.malloc_on(size, stream, u64::MAX).is_ok() && alloc.reserved() > before {
            blocks_needing_new_segments += 1;
        }
    }
    Ok(LayoutEstimate {
        new_segment_bytes: alloc.reserved().saturating_sub(reserved_before),
        cached_at_begin_bytes: self_served_bytes + requests.iter().map(|r| r.0).sum::<u64>(),
        blocks_needing_new_segments,
        reserved_at_end_bytes: reserved_at_end,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::BlockLayout;

    const M: u64 = 1 << 20;

    fn seg(address: u64, blocks: &[(u64, bool)]) -> SegmentLayout {
        SegmentLayout::new(
            address,
            Pool::Large,
            blocks
                .iter()
                .map(|&(size, allocated)| BlockLayout { size, allocated })
                .collect(),
        )
    }

    #[test]
    fn a_cached_block_the_state_split_is_reserved_again() {
        // Begin: a 400 MiB activation segment, wholly free, and a 100 MiB
        // segment holding the weights. End: 64 MiB of state carved from the
        // front of the activation block. Step 2's 400 MiB request fits
        // nowhere (336 MiB free is the largest): one new 400 MiB segment.
        let begin = [
            seg(0, &[(400 * M, false)]),
            seg(1 << 32, &[(100 * M, true)]),
        ];
        let end = [
            seg(0, &[(64 * M, true), (336 * M, false)]),
            seg(1 << 32, &[(100 * M, true)]),
        ];
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(e.new_segment_bytes, 400 * M);
        assert_eq!(e.cached_at_begin_bytes, 400 * M);
        assert_eq!(e.blocks_needing_new_segments, 1);
        assert_eq!(e.reserved_at_end_bytes, 500 * M);
    }

    #[test]
    fn a_cached_block_the_optimizer_left_alone_costs_nothing() {
        // The state got its own new segment: the activation block is whole.
        let begin = [seg(0, &[(400 * M, false)])];
        let end = [seg(0, &[(400 * M, false)]), seg(1 << 32, &[(64 * M, true)])];
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(e.new_segment_bytes, 0);
        assert_eq!(e.blocks_needing_new_segments, 0);
    }

    #[test]
    fn the_rest_of_a_split_block_still_serves_a_smaller_cached_block() {
        // Two cached blocks, 400 and 200 MiB; the state (64 MiB) split the
        // 200 MiB one, leaving 136 MiB, while a 150 MiB temporary the
        // optimizer freed sits in a new segment. Largest first: 400 takes
        // its own block, 200 fits neither 136 nor 150: 200 MiB new. Had the
        // state split the 400 MiB block, its 336 MiB rest would serve the
        // 200 MiB request and only 400 MiB would be new, so which block the
        // state took matters, which no fraction of the state can say.
        let begin = [
            seg(0, &[(400 * M, false)]),
            seg(1 << 32, &[(200 * M, false)]),
        ];
        let end = [
            seg(0, &[(400 * M, false)]),
            seg(1 << 32, &[(64 * M, true), (136 * M, false)]),
            seg(1 << 33, &[(150 * M, false)]),
        ];
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(e.new_segment_bytes, 200 * M);
        assert_eq!(e.blocks_needing_new_segments, 1);
        assert_eq!(e.cached_at_begin_bytes, 600 * M);
    }

    #[test]
    fn a_segment_the_optimizer_left_alone_serves_its_own_request() {
        // Plain SGD (no state): the 394 MiB logits segment holds a 147 MiB
        // gradient beside its free rest at both ends of the optimizer. Step
        // 2 frees the gradient and the segment serves its 394 MiB request
        // as in step 1: nothing new (served from the end layout, where the
        // gradient still sits, it had cost a whole new segment). Its free
        // block serves no other request: the 300 MiB segment the state was
        // carved from needs a new one.
        let begin = [
            seg(0, &[(147 * M, true), (247 * M, false)]),
            seg(1 << 32, &[(300 * M, false)]),
        ];
        let end = [
            seg(0, &[(147 * M, true), (247 * M, false)]),
            seg(1 << 32, &[(64 * M, true), (236 * M, false)]),
        ];
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(e.new_segment_bytes, 300 * M);
        assert_eq!(e.blocks_needing_new_segments, 1);
        assert_eq!(e.cached_at_begin_bytes, 694 * M);
        assert_eq!(e.reserved_at_end_bytes, 694 * M);
        let alone = step2_new_segments(&begin[..1], &end[..1]).unwrap();
        assert_eq!(alone.new_segment_bytes, 0);
    }

    #[test]
    fn a_segment_made_for_one_request_is_asked_for_whole() {
        // A 394 MiB segment (made for one request, the logits) held a
        // gradient of 147 MiB at optimizer begin, the rest free; the state
        // took 147 MiB of that rest. Step 2 frees the gradient first and
        // asks for 394 MiB again: no free block is that large. A 20 MiB
        // segment (several smaller requests) counts by its free block: the
        // 11 MiB is still there at the end.
        let begin = [
            seg(0, &[(147 * M, true), (247 * M, false)]),
            seg(1 << 32, &[(9 * M, true), (11 * M, false)]),
        ];
        let end = [
            seg(0, &[(147 * M, true), (147 * M, true), (100 * M, false)]),
            seg(1 << 32, &[(9 * M, true), (11 * M, false)]),
        ];
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(e.cached_at_begin_bytes, 405 * M);
        assert_eq!(e.new_segment_bytes, 394 * M);
        assert_eq!(e.blocks_needing_new_segments, 1);
    }

    #[test]
    fn small_pool_blocks_are_not_requested() {
        let small = SegmentLayout::new(
            0,
            Pool::Small,
            vec![BlockLayout {
                size: 2 * M,
                allocated: false,
            }],
        );
        let mut small_end = small.clone();
        small_end.blocks = vec![
            BlockLayout {
                size: M,
                allocated: true,
            },
            BlockLayout {
                size: M,
                allocated: false,
            },
        ];
        let e = step2_new_segments(&[small], &[small_end]).unwrap();
        assert_eq!(e.new_segment_bytes, 0);
        assert_eq!(e.cached_at_begin_bytes, 0);
    }
}
