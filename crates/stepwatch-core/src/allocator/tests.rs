use super::*;

const MIB: u64 = 1 << 20;

#[test]
fn rounds_requests_to_512() {
    assert_eq!(round_size(0), 512);
    assert_eq!(round_size(1), 512);
    assert_eq!(round_size(512), 512);
    assert_eq!(round_size(513), 1024);
    assert_eq!(round_size(1_000_000), 1_000_448);
}

#[test]
fn picks_segment_sizes_like_pytorch() {
    assert_eq!(segment_size(1), 2 * MIB);
    assert_eq!(segment_size(MIB), 2 * MIB);
    assert_eq!(segment_size(MIB + 1), 20 * MIB);
    assert_eq!(segment_size(10 * MIB - 512), 20 * MIB);
    assert_eq!(segment_size(10 * MIB), 10 * MIB);
    assert_eq!(segment_size(10 * MIB + 1), 12 * MIB);
    assert_eq!(segment_size(33 * MIB), 34 * MIB);
}

#[test]
fn small_requests_share_a_2mib_segment() {
    let mut a = CachingAllocator::new();
    let x = a.malloc(100, u64::MAX).unwrap();
    let y = a.malloc(1000, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 2 * MIB);
    assert_eq!(a.allocated(), 512 + 1024);
    assert_eq!(a.segment_count(), 1);
    a.free(x);
    a.free(y);
    assert_eq!(a.allocated(), 0);
    assert_eq!(a.reserved(), 2 * MIB, "reserved stays cached");
}

#[test]
fn medium_requests_share_a_20mib_segment() {
    let mut a = CachingAllocator::new();
    let _x = a.malloc(3 * MIB, u64::MAX).unwrap();
    let _y = a.malloc(5 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 20 * MIB);
    assert_eq!(a.allocated(), 8 * MIB);
    // 12 MiB remain, which a 9 MiB request may take.
    let _z = a.malloc(9 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 20 * MIB);
    // 3 MiB remain: a 4 MiB request needs a new segment.
    let _w = a.malloc(4 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 40 * MIB);
}

#[test]
fn unsplit_remainder_counts_as_allocated() {
    let mut a = CachingAllocator::new();
    let x = a.malloc(12 * MIB, u64::MAX).unwrap();
    a.free(x);
    // 11.5 MiB fits the cached 12 MiB block; the 0.5 MiB rest is not split off.
    let _y = a.malloc(11 * MIB + MIB / 2, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 12 * MIB);
    assert_eq!(a.allocated(), 12 * MIB);
}

#[test]
fn best_fit_reuses_the_smallest_block_and_merges_neighbours() {
    let mut a = CachingAllocator::new();
    let big = a.malloc(64 * MIB, u64::MAX).unwrap();
    let small = a.malloc(16 * MIB, u64::MAX).unwrap();
    a.free(big);
    a.free(small);
    let r = a.reserved();
    let _x = a.malloc(16 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), r);
    // The 64 MiB block is still whole, so a 60 MiB request fits without growth.
    let _y = a.malloc(60 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), r);
}

#[test]
fn merged_blocks_serve_larger_requests() {
    let mut a = CachingAllocator::new();
    let x = a.malloc(3 * MIB, u64::MAX).unwrap();
    let y = a.malloc(3 * MIB, u64::MAX).unwrap();
    let z = a.malloc(3 * MIB, u64::MAX).unwrap();
    a.free(x);
    a.free(z);
    a.free(y);
    let _w = a.malloc(9 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 20 * MIB);
}

#[test]
fn oom_retry_releases_cache_then_fails_cleanly() {
    let mut a = CachingAllocator::new();
    let x = a.malloc(40 * MIB, 100 * MIB).unwrap();
    let _keep = a.malloc(40 * MIB, 100 * MIB).unwrap();
    a.free(x);
    // 50 MiB does not fit the cached 40 MiB block; a new segment would
    // exceed the limit unless the cache is released first.
    let _y = a.malloc(50 * MIB, 100 * MIB).unwrap();
    assert_eq!(a.num_alloc_retries(), 1);
    assert_eq!(a.reserved(), 90 * MIB);
    let before = (a.allocated(), a.reserved());
    let err = a.malloc(20 * MIB, 100 * MIB).unwrap_err();
    assert_eq!(err.requested, 20 * MIB);
    assert_eq!((a.allocated(), a.reserved()), before);
    assert_eq!(a.num_alloc_retries(), 2);
}

/// 3000 random frees and mallocs from `seed` (sizes from bytes to tens of
/// MiB, log-uniform-ish) on `streams` streams, the invariants checked after
/// each and `each(a, round)` called; then everything is freed and the cache
/// released, which leaves nothing.
fn random_workload(
    a: &mut CachingAllocator,
    seed: u64,
    streams: u64,
    mut each: impl FnMut(&mut CachingAllocator, usize),
) {
    let mut live = Vec::new();
    let mut x = seed;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..3000 {
        let r = next();
        if r % 3 == 0 && !live.is_empty() {
            let i = (next() % live.len() as u64) as usize;
            a.free(live.swap_remove(i));
        } else {
            let bytes = 1 + next() % (1u64 << (next() % 26));
            let stream = if streams > 1 { next() % streams } else { 0 };
            live.push(a.malloc_on(bytes, stream, u64::MAX).unwrap());
        }
        a.check_invariants();
        assert!(a.reserved() >= a.allocated());
        each(a, round);
    }
    for id in live.drain(..) {
        a.free(id);
    }
    a.check_invariants();
    assert_eq!(a.allocated(), 0);
    a.release_free_segments();
    a.check_invariants();
    assert_eq!(a.reserved(), 0);
}

#[test]
fn bookkeeping_holds_over_a_random_workload() {
    let mut last_reserved = 0;
    random_workload(
        &mut CachingAllocator::new(),
        0x9E37_79B9_7F4A_7C15,
        1,
        |a, _| {
            assert!(a.reserved() >= last_reserved, "reserved never shrinks");
            last_reserved = a.reserved();
        },
    );
}

#[test]
fn inactive_split_counts_free_blocks_of_split_segments() {
    let mut a = CachingAllocator::new();
    let x = a.malloc(64 * MIB, u64::MAX).unwrap();
    a.free(x);
    // A whole free segment is releasable: not inactive_split.
    assert_eq!(a.inactive_split(None), (0, 0));
    let y = a.malloc(16 * MIB, u64::MAX).unwrap();
    assert_eq!(a.inactive_split(None), (48 * MIB, 1));
    assert_eq!(a.inactive_split(Some(Pool::Large)), (48 * MIB, 1));
    assert_eq!(a.inactive_split(Some(Pool::Small)), (0, 0));
    let z = a.malloc(1000, u64::MAX).unwrap();
    assert_eq!(a.inactive_split(Some(Pool::Small)), (2 * MIB - 1024, 1));
    assert_eq!(a.segments_in(None), 2);
    assert_eq!(a.segments_in(Some(Pool::Small)), 1);
    a.free(y);
    a.free(z);
    // Freed blocks merge back into whole segments.
    assert_eq!(a.inactive_split(None), (0, 0));
}

#[test]
fn peaks_follow_usage_and_reset() {
    let mut a = CachingAllocator::new();
    let x = a.malloc(30 * MIB, u64::MAX).unwrap();
    a.free(x);
    assert_eq!(a.peaks().phase.allocated, 30 * MIB);
    a.reset_phase_peak();
    assert_eq!(a.peaks().phase.allocated, 0);
    assert_eq!(a.peaks().phase.reserved, 30 * MIB);
    assert_eq!(a.peaks().total.allocated, 30 * MIB);
}
fn whole(address: u64, size: u64, allocated: bool) -> SegmentLayout {
    SegmentLayout::new(
        address,
        Pool::Large,
        vec![BlockLayout {
            size,
            allocated,
            gradient: false,
        }],
    )
}

#[test]
fn new_segments_land_below_and_in_the_highest_hole_that_fits() {
    let x = 1u64 << 36;
    let (mut a, _) = CachingAllocator::from_layout(&[whole(x, 20 * MIB, true)]).unwrap();
    let p = a.malloc(30 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(p), Some(x - 30 * MIB));
    let q = a.malloc(12 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(q), Some(x - 42 * MIB));
    a.free(p);
    a.release_free_segments();
    // 40 MiB does not fit the 30 MiB hole: below the lowest.
    let r = a.malloc(40 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(r), Some(x - 82 * MIB));
    // 20 MiB does, at the hole's top; then 10 MiB fills the rest.
    let s = a.malloc(20 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(s), Some(x - 20 * MIB));
    let t = a.malloc(10 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(t), Some(x - 30 * MIB));
    assert!(a.holes.is_empty());
    a.check_invariants();
}

#[test]
fn of_equal_free_blocks_the_oldest_segments_serves_first() {
    // Two free 40 MiB blocks: the layout's segment (older) is reused, not
    // the new one below it, as PyTorch 2.15 does on fake CUDA.
    let x = 1u64 << 36;
    let (mut a, live) = CachingAllocator::from_layout(&[whole(x, 40 * MIB, true)]).unwrap();
    let b = a.malloc(40 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(b), Some(x - 40 * MIB));
    a.free(live[0].1);
    a.free(b);
    let c = a.malloc(24 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(c), Some(x));
    a.check_invariants();

    // A snapshot does not say how old its segments are: the higher, the
    // older, unless the trace says which were made last.
    let y = x + 100 * MIB;
    let layout = [whole(x, 40 * MIB, false), whole(y, 40 * MIB, false)];
    let (mut a, _) = CachingAllocator::from_layout(&layout).unwrap();
    let c = a.malloc(24 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(c), Some(y));
    let (mut a, _) =
        CachingAllocator::from_layout_aged(&layout, AllocatorSettings::default(), &[y]).unwrap();
    let c = a.malloc(24 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(c), Some(x), "y was made last");
    a.check_invariants();
}

#[test]
fn free_blocks_serve_only_their_own_stream() {
    let mut a = CachingAllocator::new();
    let x = a.malloc_on(4 * MIB, 0, u64::MAX).unwrap();
    a.free(x);
    let y = a.malloc_on(4 * MIB, 7, u64::MAX).unwrap();
    assert_eq!(
        a.reserved(),
        40 * MIB,
        "stream 7 cannot use stream 0's block"
    );
    a.free(y);
    let _z = a.malloc_on(8 * MIB, 0, u64::MAX).unwrap();
    let _w = a.malloc_on(8 * MIB, 7, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 40 * MIB, "each reuses its own");
    a.check_invariants();
}

#[test]
fn private_pool_segments_serve_no_ordinary_request() {
    let mut seg = whole(1 << 36, 20 * MIB, false);
    seg.pool_id = 5;
    let (mut a, _) = CachingAllocator::from_layout(&[seg]).unwrap();
    let _x = a.malloc(4 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 40 * MIB);
    a.check_invariants();
}

#[test]
fn roundup_power2_divisions_round_like_pytorch() {
    // Figures PyTorch 2.15 gave on fake CUDA with roundup_power2_divisions:4
    // (memory_allocated() around one torch.empty of uint8).
    let s = AllocatorSettings {
        roundup_power2_divisions: [4; ROUNDUP_INTERVALS],
        ..AllocatorSettings::default()
    };
    assert_eq!(s.round_size(1500), 1536);
    assert_eq!(s.round_size(2048), 2048);
    assert_eq!(s.round_size(3000), 3072);
    assert_eq!(s.round_size(1_100_000), 1_310_720);
    assert_eq!(s.round_size(5 * MIB + 1), 6 * MIB);
    // 30 MiB: a quarter of [16, 32) MiB is 4 MiB, so 32 MiB.
    assert_eq!(s.round_size(30 * MIB), 32 * MIB);
    let mut a = CachingAllocator::with_settings(s);
    let _x = a.malloc(30 * MIB, u64::MAX).unwrap();
    assert_eq!((a.allocated(), a.reserved()), (32 * MIB, 32 * MIB));
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole_and_releases_them_first() {
    let s = AllocatorSettings {
        max_split_size: Some(64 * MIB),
        ..AllocatorSettings::default()
    };
    let mut a = CachingAllocator::with_settings(s);
    let x = a.malloc(100 * MIB, u64::MAX).unwrap();
    a.free(x);
    // Under max_split_size: not from the oversize block.
    let y = a.malloc(30 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 130 * MIB);
    // Oversize, wasting 20 MiB or more: not from it either.
    let z = a.malloc(70 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 200 * MIB);
    a.free(z);
    // Oversize, wasting under 20 MiB: the 70 MiB block, whole.
    let w = a.malloc(66 * MIB, u64::MAX).unwrap();
    assert_eq!(a.block_size(w), Some(70 * MIB));
    a.free(w);
    a.free(y);
    a.check_invariants();

    // cudaMalloc would fail: the oversize 70 MiB block (the smallest at
    // least max_split_size) goes first, without a full cache release.
    let mut a = CachingAllocator::with_settings(s);
    let x = a.malloc(100 * MIB, u64::MAX).unwrap();
    let y = a.malloc(70 * MIB, u64::MAX).unwrap();
    a.free(x);
    a.free(y);
    let _v = a.malloc(30 * MIB, 180 * MIB).unwrap();
    assert_eq!(a.reserved(), 130 * MIB);
    assert_eq!(a.num_alloc_retries(), 0);
    a.check_invariants();
}
fn expandable() -> AllocatorSettings {
    AllocatorSettings {
        expandable_segments: true,
        ..AllocatorSettings::default()
    }
}

#[test]
fn expandable_segments_grow_by_pages_and_unmap_them_like_pytorch() {
    // PyTorch 2.15 on fake CUDA, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    // (memory_reserved() after each step; see the test's steps).
    let s = expandable();
    let mut a = CachingAllocator::with_settings(s);
    // 3 MiB maps one 20 MiB page of the large pool's segment.
    let x = a.malloc(3 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 20 * MIB);
    // 100 B maps one 2 MiB page of the small pool's.
    let _y = a.malloc(100, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 22 * MIB);
    // 25 MiB starts in the free 17 MiB after x and maps one more page.
    let c = a.malloc(25 * MIB, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 42 * MIB);
    assert_eq!(a.address_of(c), a.address_of(x).map(|p| p + 3 * MIB));
    // Another stream has a segment of its own.
    let _d = a.malloc_on(5 * MIB, 7, u64::MAX).unwrap();
    assert_eq!(a.reserved(), 62 * MIB);
    // x's 3 MiB serves 2 MiB + 512 B, split down to 512 B.
    let xa = a.address_of(x);
    a.free(x);
    let e = a.malloc(2 * MIB + 512, u64::MAX).unwrap();
    assert_eq!(a.address_of(e), xa);
    assert_eq!(a.allocated(), 32 * MIB + 1024);
    // empty_cache() unmaps the whole free pages: c's second page.
    a.free(c);
    a.release_free_segments();
    assert_eq!(a.reserved(), 42 * MIB);
    a.check_invariants();
    let large: Vec<SegmentLayout> = a
        .layout()
        .into_iter()
        .filter(|s| s.pool == Pool::Large && s.stream == 0)
        .collect();
    assert_eq!(large.len(), 1);
    assert!(large[0].expandable);
    assert_eq!(
        large[0].blocks,
        vec![
            BlockLayout {
                size: 2 * MIB + 512,
                allocated: true,
                gradient: false
            },
            BlockLayout {
                size: 18 * MIB - 512,
                allocated: false,
                gradient: false
            },
        ]
    );
    // The layout round-trips, and the unmapped page maps again.
    let (mut b, _) = CachingAllocator::from_layout_with(&a.layout(), s).unwrap();
    b.check_invariants();
    assert_eq!(b.reserved(), 42 * MIB);
    let _f = b.malloc(30 * MIB, u64::MAX).unwrap();
    assert_eq!(b.reserved(), 62 * MIB);
    b.check_invariants();
}

#[test]
fn a_failed_expandable_growth_holds_the_pages_that_fit_for_an_instant() {
    // PyTorch maps an expandable segment's pages one by one and gives
    // back those it made when one fails, then releases its cache and
    // retries (seen on fake CUDA: gpt-expandable-segments on a 4.769 GiB
    // GPU peaked, to the byte, 9 pages (180 MiB) above what its replay
    // had reserved when the growth failed).
    let s = expandable();
    let mut a = CachingAllocator::with_settings(s);
    let limit = 110 * MIB;
    // Pages [0, 40) for x, [40, 60) for y.
    let x = a.malloc(40 * MIB, limit).unwrap();
    let _y = a.malloc(20 * MIB, limit).unwrap();
    a.free(x);
    a.reset_step_peak();
    // 60 MiB fits no free block (x's 40 MiB ends at y): three pages
    // after y would make 120 MiB. Two fit (100 MiB) and are given back;
    // the release unmaps x's two pages (20 MiB left) and the three new
    // pages make 80 MiB.
    let _z = a.malloc(60 * MIB, limit).unwrap();
    assert_eq!(a.num_alloc_retries(), 1);
    assert_eq!(a.reserved(), 80 * MIB);
    let peak = a.peaks().step;
    assert_eq!(peak.reserved, 80 * MIB);
    assert_eq!(peak.device, 100 * MIB);
    assert_eq!(a.usage().device, 80 * MIB);
    a.check_invariants();
}

#[test]
fn expandable_bookkeeping_holds_over_a_random_workload() {
    let mut a = CachingAllocator::with_settings(expandable());
    random_workload(&mut a, 0x2545_F491_4F6C_DD1D, 2, |a, round| {
        if round % 500 == 499 {
            a.release_free_segments();
        }
    });
}

#[test]
fn a_hole_below_the_layout_is_not_overlapped_by_segments_placed_below() {
    // Step 1 released a 20 MiB segment 40 MiB below the layout's lowest.
    let x = 1u64 << 36;
    let (mut a, _) = CachingAllocator::from_layout(&[whole(x, 20 * MIB, true)]).unwrap();
    a.add_address_hole(x - 40 * MIB, 20 * MIB);
    // 30 MiB does not fit the hole: below it, not across it.
    let p = a.malloc(30 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(p), Some(x - 70 * MIB));
    let q = a.malloc(20 * MIB, u64::MAX).unwrap();
    assert_eq!(a.address_of(q), Some(x - 40 * MIB));
    a.check_invariants();
}
