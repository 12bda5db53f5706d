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
//!
//! The rule that a segment the optimizer left alone serves only its own
//! request leans on the gradients: step 2 frees them before its forward, on
//! the stream that made them, and the requests the state displaced land
//! there. Where the gradients live on another stream (FSDP2 reduce-scatters
//! them on its own), nothing frees room on the default stream: the
//! displaced requests take, best fit, the free blocks of segments the
//! optimizer left alone, whose own requests then take the next larger ones,
//! until the last and largest requests of the forward (the logits) find
//! their segments split. [`step2_new_segments_with`] models that when told
//! the gradients' bytes: the displaced requests first, largest first, then
//! the left-alone segments' free blocks, smallest first, all served from
//! the whole end layout. FSDP2 on 4 ranks (real PyTorch 2.15 on fake CUDA,
//! `bench/torch-accuracy.sh --jobs fsdp2-4 --variants markers`): step 2
//! reserved three new 394 MiB logits segments (1239 MB); the rule above
//! found 795 MB (−5.86% on the device peak), this one 1239 MB.
//!
//! Given the most the allocator may reserve, the new segments stop at it:
//! past it PyTorch releases its free cached segments and retries before it
//! fails, and what that recovers the layouts cannot show (the requests are
//! served as if all alive at once, which they are not). Whether step 2 fits
//! is then left to the allocated figures. FSDP2's fragmentation run (same
//! source): 1239 MB uncapped would put the prediction 8.5% over the device
//! peak, which fitted after the allocator released its cache.

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
    /// Whether the new segments were cut to the reserved limit: they would
    /// take the allocator past it, and PyTorch releases cached segments and
    /// retries before it fails (what that recovers, layouts cannot show).
    #[serde(default)]
    pub capped_at_reserved_limit: bool,
}

/// The segments step 2 adds because step 1's optimizer split the cache (see
/// the module documentation), with PyTorch's default allocator settings,
/// the gradients' stream unknown and no reserved limit.
pub fn step2_new_segments(
    begin: &[SegmentLayout],
    end: &[SegmentLayout],
) -> Result<LayoutEstimate, LayoutError> {
    step2_new_segments_with(begin, end, &LayoutContext::default())
}

/// What [`step2_new_segments_with`] is told beside the two layouts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayoutContext {
    /// The gradients' bytes (the model facts' parameter bytes): when blocks
    /// allocated on streams other than the default at optimizer begin hold
    /// at least this much, the gradients live there (FSDP2) and free no room
    /// for the default stream's requests in step 2. None: unknown, taken to
    /// share the default stream.
    pub gradient_bytes: Option<u64>,
    /// The most the allocator may reserve in all (the rank's reserved limit
    /// less what the layouts leave out, the small pool): the new segments
    /// stop there. None: no limit.
    pub reserved_limit: Option<u64>,
}

/// [`step2_new_segments`], told where the gradients live and the reserved
/// limit (see the module documentation).
pub fn step2_new_segments_with(
    begin: &[SegmentLayout],
    end: &[SegmentLayout],
    context: &LayoutContext,
) -> Result<LayoutEstimate, LayoutError> {
    let ordinary = |s: &&SegmentLayout| s.pool == Pool::Large && s.pool_id == 0;
    let grads_elsewhere = context.gradient_bytes.is_some_and(|g| {
        let on_side_streams: u64 = begin
            .iter()
            .filter(ordinary)
            .filter(|s| s.stream != 0)
            .flat_map(|s| s.blocks.iter().filter(|b| b.allocated))
            .map(|b| b.size)
            .sum();
        g > 0 && on_side_streams >= g
    });
    // A segment the optimizer left alone (the same blocks at its end) serves
    // its own request in step 2 as it did in step 1: it makes no request,
    // and its free blocks serve no other (they are its request's). Served
    // from the end layout instead, its request would meet the gradients
    // still there, which step 2 frees before its forward: plain SGD, no
    // state, came out 413 MB (one logits block) over on real PyTorch. With
    // the gradients on another stream its free blocks are requests, served
    // after the displaced ones (`grads_elsewhere`).
    let untouched = |s: &SegmentLayout| !s.expandable && end.iter().any(|e| e == s);
    let mut displaced: Vec<(u64, u64)> = Vec::new();
    let mut left_alone: Vec<(u64, u64)> = Vec::new();
    let mut self_served_bytes = 0;
    for s in begin.iter().filter(ordinary) {
        let free = s.blocks.iter().filter(|b| !b.allocated).map(|b| b.size);
        if s.blocks.iter().all(|b| b.allocated) {
            continue;
        }
        if untouched(s) && grads_elsewhere {
            left_alone.extend(free.map(|size| (size, s.stream)));
        } else if untouched(s) {
            self_served_bytes += if s.size() == LARGE_BUFFER {
                free.sum()
            } else {
                s.size()
            };
        } else if s.expandable || s.size() == LARGE_BUFFER {
            displaced.extend(free.map(|size| (size, s.stream)));
        } else {
            displaced.push((s.size(), s.stream));
        }
    }
    // Displaced largest first; left-alone smallest first (the forward's
    // last requests are its largest); a stable order for equal sizes.
    displaced.sort_by(|a, b| b.cmp(a));
    left_alone.sort();
    let requests: Vec<(u64, u64)> = displaced.into_iter().chain(left_alone).collect();
    let reserved_at_end = CachingAllocator::from_layout(end)?.0.reserved();
    let serving: Vec<SegmentLayout> = end
        .iter()
        .filter(|e| grads_elsewhere || !begin.iter().any(|s| s == *e && untouched(s)))
        .cloned()
        .collect();
    let (alloc, _) = CachingAllocator::from_layout(&serving)?;
    let reserved_before = alloc.reserved();
    // No limit: the figure is what step 2 would reserve without one.
    let (peak, blocks_needing_new_segments) = serve(alloc, &requests);
    // The segments left out of `serving` stay reserved beside it.
    let serving_limit = context.reserved_limit.map(|l| {
        l.saturating_sub(reserved_at_end - reserved_before)
            .max(reserved_before)
    });
    let capped = serving_limit.filter(|&l| peak > l);
    Ok(LayoutEstimate {
        new_segment_bytes: capped.unwrap_or(peak).saturating_sub(reserved_before),
        capped_at_reserved_limit: capped.is_some(),
        cached_at_begin_bytes: self_served_bytes + requests.iter().map(|r| r.0).sum::<u64>(),
        blocks_needing_new_segments,
        reserved_at_end_bytes: reserved_at_end,
    })
}

/// Serves `requests` (size, stream) in order from `alloc`, with no reserved
/// limit: the reserved peak and the requests that took a new segment.
fn serve(mut alloc: CachingAllocator, requests: &[(u64, u64)]) -> (u64, u32) {
    alloc.reset_step_peak();
    let mut new_segments = 0;
    for &(size, stream) in requests {
        let before = alloc.reserved();
        // Without a limit a request always fits.
        if alloc.malloc_on(size, stream, u64::MAX).is_ok() && alloc.reserved() > before {
            new_segments += 1;
        }
    }
    (alloc.peaks().step.reserved, new_segments)
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

    /// Begin: a 400 MiB activation segment, wholly free, and a 100 MiB
    /// segment holding the weights. End: 64 MiB of state carved from the
    /// front of the activation block.
    fn state_carved_from_a_cached_block() -> ([SegmentLayout; 2], [SegmentLayout; 2]) {
        let begin = [
            seg(0, &[(400 * M, false)]),
            seg(1 << 32, &[(100 * M, true)]),
        ];
        let end = [
            seg(0, &[(64 * M, true), (336 * M, false)]),
            seg(1 << 32, &[(100 * M, true)]),
        ];
        (begin, end)
    }

    #[test]
    fn a_cached_block_the_state_split_is_reserved_again() {
        // Step 2's 400 MiB request fits nowhere (336 MiB free is the
        // largest): one new 400 MiB segment.
        let (begin, end) = state_carved_from_a_cached_block();
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

    /// The FSDP2 case in small: on the default stream a 400 MiB logits
    /// segment and a 20 MiB one, both free at optimizer begin and left alone,
    /// and a 16 MiB activation segment the state (2 × 8 MiB) took; the
    /// gradients (64 MiB) sit on another stream.
    fn gradients_on_a_side_stream() -> (Vec<SegmentLayout>, Vec<SegmentLayout>) {
        let mut grads = seg(3 << 32, &[(64 * M, true)]);
        grads.stream = 7;
        let begin = vec![
            seg(0, &[(400 * M, false)]),
            seg(1 << 32, &[(16 * M, false)]),
            seg(2 << 32, &[(20 * M, false)]),
            grads.clone(),
        ];
        let mut end = begin.clone();
        end[1] = seg(1 << 32, &[(8 * M, true), (8 * M, true)]);
        (begin, end)
    }

    #[test]
    fn requests_the_state_displaced_take_left_alone_blocks_when_gradients_are_elsewhere() {
        let (begin, end) = gradients_on_a_side_stream();
        // Gradients on the default stream (or unknown): step 2 frees them
        // and the 16 MiB request lands there; the left-alone segments serve
        // their own requests. Nothing free holds 16 MiB: one 16 MiB segment.
        for gradient_bytes in [None, Some(128 * M)] {
            let context = LayoutContext {
                gradient_bytes,
                reserved_limit: None,
            };
            let e = step2_new_segments_with(&begin, &end, &context).unwrap();
            assert_eq!(e.new_segment_bytes, 16 * M, "{gradient_bytes:?}");
            assert_eq!(e.cached_at_begin_bytes, 436 * M);
            assert_eq!(e.blocks_needing_new_segments, 1);
        }
        // The side stream holds all 64 MiB of gradients: nothing frees room
        // on the default stream. The 16 MiB request takes the 20 MiB block
        // (best fit, 4 MiB left), the 20 MiB request then the 400 MiB block
        // (380 left), and the 400 MiB request, last, finds no block: one new
        // 400 MiB segment, as step 2's logits on real PyTorch.
        let context = LayoutContext {
            gradient_bytes: Some(64 * M),
            reserved_limit: None,
        };
        let e = step2_new_segments_with(&begin, &end, &context).unwrap();
        assert_eq!(e.new_segment_bytes, 400 * M);
        assert_eq!(e.cached_at_begin_bytes, 436 * M);
        assert_eq!(e.blocks_needing_new_segments, 1);
        assert_eq!(e.reserved_at_end_bytes, 500 * M);
        assert!(!e.capped_at_reserved_limit);
    }

    #[test]
    fn new_segments_stop_at_the_reserved_limit() {
        // 500 MiB reserved at the end, and 400 MiB new without a limit.
        let (begin, end) = state_carved_from_a_cached_block();
        let with_limit = |limit: u64| {
            let context = LayoutContext {
                gradient_bytes: None,
                reserved_limit: Some(limit),
            };
            step2_new_segments_with(&begin, &end, &context).unwrap()
        };
        // 500 + 400 = 900 fits 1000: as without a limit.
        let e = with_limit(1000 * M);
        assert_eq!(e.new_segment_bytes, 400 * M);
        assert!(!e.capped_at_reserved_limit);
        // 900 over 700: 200 new, up to the limit.
        let e = with_limit(700 * M);
        assert_eq!(e.new_segment_bytes, 200 * M);
        assert!(e.capped_at_reserved_limit);
        assert_eq!(e.blocks_needing_new_segments, 1);
        // A limit under what is reserved already: nothing new.
        let e = with_limit(450 * M);
        assert_eq!(e.new_segment_bytes, 0);
        assert!(e.capped_at_reserved_limit);
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
