//! What step 1's optimizer did to the allocator's cache, from two segment
//! snapshots: at its optimizer begin and end.
//!
//! Without an allocator trace the prediction sees only phase-boundary
//! figures, which cannot show where the optimizer state landed. PyTorch's
//! caching allocator serves new state from the cached blocks backward freed
//! (best fit, splitting them); in step 2 the activations come back at their
//! old sizes and no longer fit there, so the allocator reserves new segments
//! although the allocated peak fits. The two snapshots show it:
//!
//! ```text
//! requests = per large-pool segment with a free block at optimizer begin:
//!            the whole segment unless it is a 20 MiB one, else each of its
//!            free blocks; largest first
//! new      = reserved after serving them from the end layout (the caching
//!            allocator's model: best fit, splitting, rounding)
//!            − reserved at optimizer end
//! ```
//!
//! Decisions, each checked against exact step-2 replays of real PyTorch on
//! fake CUDA (the figures are in the book's prediction page and BENCHMARKS):
//!
//! * A segment of another size than 20 MiB was made for one request of
//!   about its size, which step 2 makes again; a 20 MiB segment's free
//!   blocks stand for the smaller requests it served (the conservative
//!   reading). Small-pool blocks are left out.
//! * When nothing frees room on the default stream before step 2's forward
//!   (FSDP2's gradients on their own stream, gradients kept alive through
//!   the forward), the displaced requests chain through the left-alone
//!   segments' free blocks ([`step2_new_segments_with`]).
//! * Where the client flags gradient blocks and step 2 frees them first, the
//!   end layout less the gradients serves every segment's request in the
//!   order step 1 made the segments, within what step 1 held at once
//!   ([`LayoutContext`]): serving all as if alive together over-counts
//!   wherever a forward frees as it goes.
//! * Given the most the allocator may reserve, new segments stop there:
//!   past it PyTorch releases its cache and retries, which the layouts
//!   cannot show, so whether step 2 fits is left to the allocated figures.

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
    /// Step 1's gradients stay alive through step 2's forward: set to None
    /// only just before backward (Lightning's closure) or kept
    /// (`zero_grad(set_to_none=False)`), [`crate::replay::Gradients`]. As
    /// with gradients on another stream, nothing frees room for the
    /// forward's requests.
    pub gradients_alive_in_forward: bool,
    /// The most the layouts' pool may hold allocated at once in step 2:
    /// step 1's allocated peak before its optimizer, plus the state the
    /// optimizer made, less the small pool's allocated bytes at its end.
    /// Used where the client flagged the gradients' blocks
    /// ([`crate::allocator::BlockLayout::gradient`]): requests beyond it
    /// free the oldest ones first. None: no limit.
    pub live_limit: Option<u64>,
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
    // Nothing frees room for step 2's forward before it runs: the gradients
    // live on another stream or through the forward.
    let nothing_freed = grads_elsewhere || context.gradients_alive_in_forward;
    let gradients_flagged = end
        .iter()
        .filter(ordinary)
        .any(|s| s.blocks.iter().any(|b| b.allocated && b.gradient));
    if gradients_flagged && !nothing_freed {
        return with_gradients_freed(begin, end, context);
    }
    // A segment the optimizer left alone (the same blocks at its end) serves
    // its own request in step 2 as it did in step 1: it makes no request,
    // and its free blocks serve no other (they are its request's). Served
    // from the end layout instead, its request would meet the gradients
    // still there, which step 2 frees before its forward: plain SGD, no
    // state, came out 413 MB (one logits block) over on real PyTorch. When
    // nothing is freed its free blocks are requests too (`nothing_freed`).
    let untouched = |s: &SegmentLayout| !s.expandable && end.iter().any(|e| e == s);
    let mut displaced: Vec<(u64, u64)> = Vec::new();
    let mut left_alone: Vec<(u64, u64)> = Vec::new();
    let mut self_served_bytes = 0;
    for s in begin.iter().filter(ordinary) {
        let free = s.blocks.iter().filter(|b| !b.allocated).map(|b| b.size);
        if s.blocks.iter().all(|b| b.allocated) {
            continue;
        }
        if untouched(s) && nothing_freed {
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
    let requests = if nothing_freed {
        forward_order(displaced, left_alone)
    } else {
        // Largest first (left_alone is empty); a stable order for equal
        // sizes.
        displaced.sort_by(|a, b| b.cmp(a));
        displaced
    };
    let reserved_at_end = CachingAllocator::from_layout(end)?.0.reserved();
    let serving: Vec<SegmentLayout> = end
        .iter()
        .filter(|e| nothing_freed || !begin.iter().any(|s| s == *e && untouched(s)))
        .cloned()
        .collect();
    let (alloc, _) = CachingAllocator::from_layout(&serving)?;
    let requests: Vec<Request> = requests
        .into_iter()
        .map(|(size, stream)| Request { size, stream })
        .collect();
    Ok(estimate(
        alloc,
        &requests,
        None,
        context.reserved_limit,
        reserved_at_end,
        self_served_bytes,
    ))
}

/// One request step 2 is taken to make again: bytes, and the stream whose
/// pool serves it.
#[derive(Debug, Clone, Copy)]
struct Request {
    size: u64,
    stream: u64,
}

/// Serves `requests` in order from `alloc` (the serving layout) and sums up:
/// the new segments, cut to `reserved_limit` (all pools; `alloc` holds all
/// but what was left out of it, reserved at the end beside it), and
/// `self_served_bytes` of requests the serving layout does not see.
fn estimate(
    alloc: CachingAllocator,
    requests: &[Request],
    live_limit: Option<u64>,
    reserved_limit: Option<u64>,
    reserved_at_end: u64,
    self_served_bytes: u64,
) -> LayoutEstimate {
    let reserved_before = alloc.reserved();
    // No reserved limit: the figure is what step 2 would reserve without one.
    let (peak, blocks_needing_new_segments) = serve(alloc, requests, live_limit);
    // The segments left out of the serving layout stay reserved beside it.
    let serving_limit = reserved_limit.map(|l| {
        l.saturating_sub(reserved_at_end - reserved_before)
            .max(reserved_before)
    });
    let capped = serving_limit.filter(|&l| peak > l);
    LayoutEstimate {
        new_segment_bytes: capped.unwrap_or(peak).saturating_sub(reserved_before),
        capped_at_reserved_limit: capped.is_some(),
        cached_at_begin_bytes: self_served_bytes + requests.iter().map(|r| r.size).sum::<u64>(),
        blocks_needing_new_segments,
        reserved_at_end_bytes: reserved_at_end,
    }
}

/// The rule where the client flagged the gradients' blocks and step 2 frees
/// them before its forward (see the module documentation): served from the
/// whole end layout less the gradients, every segment's request in the order
/// step 1 made the segments, within [`LayoutContext::live_limit`].
fn with_gradients_freed(
    begin: &[SegmentLayout],
    end: &[SegmentLayout],
    context: &LayoutContext,
) -> Result<LayoutEstimate, LayoutError> {
    let untouched = |s: &SegmentLayout| !s.expandable && end.iter().any(|e| e == s);
    // (segment's address, request): a segment's request stands at its
    // address, its free blocks' in the segment's place.
    let mut requests: Vec<(u64, Request)> = Vec::new();
    for s in begin
        .iter()
        .filter(|s| s.pool == Pool::Large && s.pool_id == 0)
    {
        let stream = s.stream;
        let free = s.blocks.iter().filter(|b| !b.allocated);
        if s.expandable || s.size() == LARGE_BUFFER || untouched(s) {
            // A left-alone segment's free blocks are its requests; with the
            // gradients gone, a request older than them may take them first.
            requests.extend(free.map(|b| {
                let request = Request {
                    size: b.size,
                    stream,
                };
                (s.address, request)
            }));
        } else if free.count() > 0 {
            requests.push((
                s.address,
                Request {
                    size: s.size(),
                    stream,
                },
            ));
        }
    }
    // CUDA hands out each new segment below the older ones: the highest
    // address is step 1's first, and its forward asks in that order again.
    // A stable sort keeps a segment's blocks in address order.
    requests.sort_by_key(|&(address, _)| std::cmp::Reverse(address));
    let requests: Vec<Request> = requests.into_iter().map(|(_, r)| r).collect();
    let reserved_at_end = CachingAllocator::from_layout(end)?.0.reserved();
    // Step 2 sets the gradients to None before its forward.
    let serving: Vec<SegmentLayout> = end.iter().map(|s| s.freeing(|_, b| b.gradient)).collect();
    let (alloc, _) = CachingAllocator::from_layout(&serving)?;
    Ok(estimate(
        alloc,
        &requests,
        context.live_limit,
        context.reserved_limit,
        reserved_at_end,
        0,
    ))
}

/// The requests in the order step 2's forward makes them when nothing
/// frees room before it: smallest first. A transformer's forward makes its
/// layers' activations before the head's logits, its largest requests, so
/// the small ones take, best fit, the large free blocks step 1 left (a
/// logits segment the optimizer left alone, the rest of one the state
/// split) and the logits find them split. Largest first would hand those
/// blocks to the logits and the small requests to new segments of their
/// own: Lightning's step 2 on real PyTorch 2.15 (fake CUDA) reserved six
/// large segments (2 × 394, 2 × 198, 74 and 32 MiB), which this order
/// finds; largest first found one 394 and one 198 and 34 small ones.
fn forward_order(displaced: Vec<(u64, u64)>, left_alone: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    let mut requests: Vec<(u64, u64)> = displaced.into_iter().chain(left_alone).collect();
    requests.sort();
    requests
}

/// Serves `requests` in order from `alloc`, with no reserved limit: the
/// reserved peak and the requests that took a new segment. With a
/// `live_limit` (bytes allocated at once, the serving layout's included), a
/// request that would pass it first frees the oldest requests still held:
/// step 2 cannot hold more than step 1 did plus its state, so they were
/// gone by then (a workspace the forward frees after each use), and a
/// forward frees its earliest temporaries first.
fn serve(mut alloc: CachingAllocator, requests: &[Request], live_limit: Option<u64>) -> (u64, u32) {
    alloc.reset_step_peak();
    let mut new_segments = 0;
    let mut held = std::collections::VecDeque::new();
    for r in requests {
        if let Some(limit) = live_limit {
            while alloc.allocated() + r.size > limit {
                let Some(oldest) = held.pop_front() else {
                    break;
                };
                alloc.free(oldest);
            }
        }
        let before = alloc.reserved();
        // Without a reserved limit a request always fits.
        if let Ok(id) = alloc.malloc_on(r.size, r.stream, u64::MAX) {
            held.push_back(id);
            if alloc.reserved() > before {
                new_segments += 1;
            }
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
                .map(|&(size, allocated)| BlockLayout {
                    size,
                    allocated,
                    gradient: false,
                })
                .collect(),
        )
    }

    /// (new segment bytes, blocks needing new segments, cached bytes at
    /// begin): the estimate's figures, asserted together.
    fn figures(e: &LayoutEstimate) -> (u64, u32, u64) {
        (
            e.new_segment_bytes,
            e.blocks_needing_new_segments,
            e.cached_at_begin_bytes,
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
        assert_eq!(figures(&e), (400 * M, 1, 400 * M));
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
        assert_eq!(figures(&e), (200 * M, 1, 600 * M));
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
        assert_eq!(figures(&e), (300 * M, 1, 694 * M));
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
        assert_eq!(figures(&e), (394 * M, 1, 405 * M));
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
                ..LayoutContext::default()
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
            ..LayoutContext::default()
        };
        let e = step2_new_segments_with(&begin, &end, &context).unwrap();
        assert_eq!(figures(&e), (400 * M, 1, 436 * M));
        assert_eq!(e.reserved_at_end_bytes, 500 * M);
        assert!(!e.capped_at_reserved_limit);
    }

    #[test]
    fn gradients_alive_in_the_forward_free_no_room_as_on_another_stream() {
        // The FSDP2 layouts in small with the gradients on the default
        // stream, alive through step 2's forward (Lightning's closure, or
        // kept): as when they live elsewhere, the 16 MiB request takes the
        // 20 MiB block, the 20 MiB one the 400 MiB block, and the 400 MiB
        // request finds no block: 400 MiB new, not the 16 MiB of a segment
        // of its own with the left-alone segments serving themselves.
        let (mut begin, mut end) = gradients_on_a_side_stream();
        // No side stream: leave its segment out.
        begin.pop();
        end.pop();
        let gradients_freed = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(gradients_freed.new_segment_bytes, 16 * M);
        let context = LayoutContext {
            gradients_alive_in_forward: true,
            ..LayoutContext::default()
        };
        let e = step2_new_segments_with(&begin, &end, &context).unwrap();
        assert_eq!(figures(&e), (400 * M, 1, 436 * M));
    }

    #[test]
    fn with_nothing_freed_small_requests_come_first_and_split_the_large_blocks() {
        // A 400 MiB logits segment the optimizer left alone, free; another
        // the state took all but 10 MiB of; a 20 MiB segment the state took
        // whole. Step 2's forward makes the 20 MiB request first: it takes
        // the left-alone 400 MiB block (the 10 MiB rest is too small), and
        // both 400 MiB requests need new segments: 800 MiB. Largest first
        // would give the first 400 MiB request that block and the 20 MiB one
        // a segment of its own: 420 MiB.
        let begin = [
            seg(0, &[(400 * M, false)]),
            seg(1 << 32, &[(400 * M, false)]),
            seg(2 << 32, &[(20 * M, false)]),
        ];
        let end = [
            seg(0, &[(400 * M, false)]),
            seg(1 << 32, &[(390 * M, true), (10 * M, false)]),
            seg(2 << 32, &[(10 * M, true), (10 * M, true)]),
        ];
        let alive = LayoutContext {
            gradients_alive_in_forward: true,
            ..LayoutContext::default()
        };
        let e = step2_new_segments_with(&begin, &end, &alive).unwrap();
        assert_eq!(figures(&e), (800 * M, 2, 820 * M));
        // The same with the gradients (64 MiB) on a side stream instead.
        let mut grads = seg(3 << 32, &[(64 * M, true)]);
        grads.stream = 7;
        let with_grads = |layout: &[SegmentLayout]| [layout, &[grads.clone()]].concat();
        let elsewhere = LayoutContext {
            gradient_bytes: Some(64 * M),
            ..LayoutContext::default()
        };
        let e = step2_new_segments_with(&with_grads(&begin), &with_grads(&end), &elsewhere);
        assert_eq!(e.unwrap().new_segment_bytes, 800 * M);
        // Gradients freed before the forward: the left-alone segment serves
        // its own request; 400 and 20 MiB new.
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(e.new_segment_bytes, 420 * M);
    }

    #[test]
    fn new_segments_stop_at_the_reserved_limit() {
        // 500 MiB reserved at the end, and 400 MiB new without a limit.
        let (begin, end) = state_carved_from_a_cached_block();
        let with_limit = |limit: u64| {
            let context = LayoutContext {
                reserved_limit: Some(limit),
                ..LayoutContext::default()
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

    /// A segment whose one block holds a gradient the client flagged.
    fn gradient_segment(address: u64, size: u64) -> SegmentLayout {
        let mut s = seg(address, &[(size, true)]);
        s.blocks[0].gradient = true;
        s
    }

    /// GPT's step 1 in small, oldest segment (highest address) first: a 24
    /// MiB activation segment the state took whole, a 400 MiB logits
    /// segment the optimizer left alone, free, and a gradient's segment of
    /// `gradient` MiB, flagged; the gradients are set to None between steps.
    fn flagged_gradient_layouts(gradient: u64) -> (Vec<SegmentLayout>, Vec<SegmentLayout>) {
        let begin = vec![
            seg(3 << 32, &[(24 * M, false)]),
            seg(2 << 32, &[(400 * M, false)]),
            gradient_segment(1 << 32, gradient * M),
        ];
        let mut end = begin.clone();
        end[0] = seg(3 << 32, &[(24 * M, true)]);
        (begin, end)
    }

    #[test]
    fn a_flagged_gradient_freed_before_the_forward_serves_its_requests() {
        // Step 2 frees the 128 MiB gradient before its forward. The 24 MiB
        // request, first (oldest segment), takes its block, best fit (104
        // left); the logits' 400 MiB request then its own block: nothing new.
        let (begin, end) = flagged_gradient_layouts(128);
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(figures(&e), (0, 0, 424 * M));
        assert_eq!(e.reserved_at_end_bytes, 552 * M);
        // Without the flag (kept records, older clients) the rule before
        // them: the gradient stays, the left-alone segments serve only
        // their own requests, and the 24 MiB request needs a segment.
        let mut unflagged = (begin, end);
        unflagged.0[2].blocks[0].gradient = false;
        unflagged.1[2].blocks[0].gradient = false;
        let e = step2_new_segments(&unflagged.0, &unflagged.1).unwrap();
        assert_eq!(e.new_segment_bytes, 24 * M);
    }

    #[test]
    fn with_flagged_gradients_an_older_request_takes_a_left_alone_block() {
        // A 16 MiB gradient frees too little for the 24 MiB request, which
        // comes first and takes the left-alone logits block (376 left): the
        // logits' request finds no block, one new 400 MiB segment, as step
        // 2 on real PyTorch reserved for GPT's logits. (The rule without
        // flags: 24 MiB.)
        let (begin, end) = flagged_gradient_layouts(16);
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(figures(&e), (400 * M, 1, 424 * M));
        // Gradients alive through the forward: the flags change nothing,
        // the chain as before (smallest first, the same outcome here).
        let alive = LayoutContext {
            gradients_alive_in_forward: true,
            ..LayoutContext::default()
        };
        let e = step2_new_segments_with(&begin, &end, &alive).unwrap();
        assert_eq!(e.new_segment_bytes, 400 * M);
    }

    #[test]
    fn requests_past_what_step_1_held_at_once_free_the_oldest_first() {
        // A CNN's workspace in small: two 32 MiB segments, the older one
        // taken whole by the state (32 MiB), the other left alone, and a 16
        // MiB flagged gradient. The older request takes the left-alone
        // block (the gradient's is too small), and the other's own request
        // finds none: 32 MiB new, were both alive at once.
        let begin = [
            seg(3 << 32, &[(32 * M, false)]),
            seg(2 << 32, &[(32 * M, false)]),
            gradient_segment(1 << 32, 16 * M),
        ];
        let mut end = begin.clone();
        end[0] = seg(3 << 32, &[(32 * M, true)]);
        let e = step2_new_segments(&begin, &end).unwrap();
        assert_eq!(e.new_segment_bytes, 32 * M);
        // Step 1 never held both: its peak was the gradient and one
        // workspace, 48 MiB; with the 32 MiB state, step 2 holds at most
        // 80. The state (32) and the first request (32) make 64; the second
        // would make 96, so the first is gone by then, and its block, the
        // left-alone one, serves the second: nothing new.
        let within = |limit: u64| {
            let context = LayoutContext {
                live_limit: Some(limit),
                ..LayoutContext::default()
            };
            step2_new_segments_with(&begin, &end, &context).unwrap()
        };
        let e = within(80 * M);
        assert_eq!(figures(&e), (0, 0, 64 * M));
        // Room for both at once: as without a limit.
        assert_eq!(within(96 * M).new_segment_bytes, 32 * M);
    }

    #[test]
    fn small_pool_blocks_are_not_requested() {
        let small = SegmentLayout::new(
            0,
            Pool::Small,
            vec![BlockLayout {
                size: 2 * M,
                allocated: false,
                gradient: false,
            }],
        );
        let mut small_end = small.clone();
        small_end.blocks = vec![
            BlockLayout {
                size: M,
                allocated: true,
                gradient: false,
            },
            BlockLayout {
                size: M,
                allocated: false,
                gradient: false,
            },
        ];
        let e = step2_new_segments(&[small], &[small_end]).unwrap();
        assert_eq!(e.new_segment_bytes, 0);
        assert_eq!(e.cached_at_begin_bytes, 0);
    }
}
