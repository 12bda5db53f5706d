//! A model of PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`),
//! reduced to what shapes the memory figures stepwatch sees:
//!
//! - every request is rounded up to a multiple of 512 B;
//! - requests of 1 MiB or less are served from the small pool, whose segments
//!   are 2 MiB;
//! - larger requests under 10 MiB get a 20 MiB segment; requests of 10 MiB or
//!   more get a segment of their own size rounded up to 2 MiB;
//! - a free block is reused best-fit (smallest block that holds the request,
//!   within the request's pool) and split when the rest is worth keeping
//!   (≥ 512 B in the small pool, > 1 MiB in the large pool);
//! - freed blocks merge with free neighbours in the same segment;
//! - reserved memory (the sum of segments) never shrinks, except in the OOM
//!   retry: when a new segment would not fit, fully free segments are
//!   released (`num_alloc_retries` grows) and the request is tried once more.
//!
//! There are no streams, so active bytes equal allocated bytes.
//!
//! Segments have device addresses (made up, from 1 TiB up, for segments the
//! model creates), and best fit breaks ties by address as PyTorch's block
//! comparator does, so a layout taken from a real process
//! ([`CachingAllocator::from_layout`]) is reused in PyTorch's order. The
//! simulator runs its jobs on this model, and the predictor replays step 1's
//! allocator trace through it (`crate::replay`).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

/// Every request is rounded up to a multiple of this.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Largest request served from the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for large-pool requests under [`MIN_LARGE_ALLOC`].
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Requests at least this large get a segment of their own.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Granularity of dedicated large segments.
pub const ROUND_LARGE: u64 = 2 << 20;

/// The size a request of `bytes` occupies: rounded up to 512 B (at least 512).
pub fn round_size(bytes: u64) -> u64 {
    if bytes < MIN_BLOCK_SIZE {
        MIN_BLOCK_SIZE
    } else {
        bytes.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
    }
}

/// Size of the segment `cudaMalloc`ed when no cached block fits a request of
/// `bytes` (rounded or not).
pub fn segment_size(bytes: u64) -> u64 {
    let rounded = round_size(bytes);
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// The pool a request is served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    /// Requests up to 1 MiB, carved from 2 MiB segments.
    Small,
    /// Larger requests, from their own larger segments.
    Large,
}

impl Pool {
    /// The pool PyTorch would serve a request of `bytes` from.
    pub fn of(bytes: u64) -> Pool {
        if round_size(bytes) <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        }
    }
}

/// Handle of one live allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocId(u64);

/// The request did not fit: like `torch.OutOfMemoryError`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("CUDA out of memory: tried to allocate {requested} bytes with {reserved} reserved of a {limit}-byte limit")]
pub struct OutOfMemory {
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes already reserved from the driver when it failed.
    pub reserved: u64,
    /// Most the allocator could reserve (what the device had left for it), bytes.
    pub limit: u64,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    offset: u64,
    size: u64,
    used: bool,
}

#[derive(Debug, Clone)]
struct Segment {
    pool: Pool,
    size: u64,
    /// Sorted by offset, covering the segment without gaps.
    blocks: Vec<Block>,
}

/// Allocator figures, as `torch.cuda.memory_stats()` reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes in live blocks (`allocated_bytes.all.current`).
    pub allocated: u64,
    /// Bytes in segments from the driver (`reserved_bytes.all.current`); what
    /// NVML sees of the allocator.
    pub reserved: u64,
}

/// Peak registers; the caller resets each at its own boundaries
/// (per phase, per step), and `total` is never reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peaks {
    /// Peak since the last phase reset; becomes a marker's peak figures.
    pub phase: Usage,
    /// Peak since the last step reset; feeds per-step stats.
    pub step: Usage,
    /// Peak since the process started.
    pub total: Usage,
}

/// One block of a [`SegmentLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockLayout {
    /// Bytes.
    pub size: u64,
    /// Holds a live allocation (false: free, cached).
    pub allocated: bool,
}

/// One segment as `torch.cuda.memory_snapshot()` shows it: its address, pool
/// and blocks in address order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentLayout {
    /// Device address of the segment's first byte.
    pub address: u64,
    /// The pool it serves.
    pub pool: Pool,
    /// Blocks in address order, tiling the segment.
    pub blocks: Vec<BlockLayout>,
}

impl SegmentLayout {
    /// The segment's size: the sum of its blocks.
    pub fn size(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }
}

/// A layout [`CachingAllocator::from_layout`] cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A segment without blocks, or a block of 0 bytes.
    #[error("segment at {address:#x} has no blocks or a block of 0 bytes")]
    EmptyBlock {
        /// The segment's address.
        address: u64,
    },
    /// Two segments share addresses.
    #[error("segments at {first:#x} and {second:#x} overlap")]
    Overlap {
        /// The lower segment.
        first: u64,
        /// The segment that starts inside it.
        second: u64,
    },
    /// A segment runs past the end of the address space.
    #[error("segment at {address:#x} runs past the end of the address space")]
    AddressOverflow {
        /// The segment's address.
        address: u64,
    },
}

/// Where the model puts the segments it creates itself.
const MODEL_ADDRESS_BASE: u64 = 1 << 40;

/// The caching allocator of one process.
#[derive(Debug, Clone, Default)]
pub struct CachingAllocator {
    /// By address.
    segments: BTreeMap<u64, Segment>,
    /// Address of the next segment the model creates (0: not yet chosen).
    next_address: u64,
    live: HashMap<AllocId, (u64, u64)>,
    /// Free blocks as (pool, size, segment, offset), for best-fit lookup.
    free_blocks: BTreeSet<(Pool, u64, u64, u64)>,
    next_id: u64,
    usage: Usage,
    peaks: Peaks,
    num_alloc_retries: u64,
}

impl CachingAllocator {
    /// An empty allocator: nothing reserved, nothing allocated.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes in live blocks (after rounding and unsplit remainders).
    pub fn allocated(&self) -> u64 {
        self.usage.allocated
    }

    /// Bytes in segments obtained from the driver.
    pub fn reserved(&self) -> u64 {
        self.usage.reserved
    }

    /// Current allocated and reserved bytes.
    pub fn usage(&self) -> Usage {
        self.usage
    }

    /// The peak registers, as markers and step stats read them.
    pub fn peaks(&self) -> Peaks {
        self.peaks
    }

    /// Times the allocator released its cache to retry a failed `cudaMalloc`.
    pub fn num_alloc_retries(&self) -> u64 {
        self.num_alloc_retries
    }

    /// Number of live allocations.
    pub fn live_allocations(&self) -> usize {
        self.live.len()
    }

    /// Device address of a live allocation.
    pub fn address_of(&self, id: AllocId) -> Option<u64> {
        self.live.get(&id).map(|&(seg, offset)| seg + offset)
    }

    /// Bytes of a live allocation's block (rounded, unsplit rest included).
    pub fn block_size(&self, id: AllocId) -> Option<u64> {
        let &(seg, offset) = self.live.get(&id)?;
        let seg = self.segments.get(&seg)?;
        seg.blocks
            .iter()
            .find(|b| b.offset == offset)
            .map(|b| b.size)
    }

    /// Segments as `torch.cuda.memory_snapshot()` would list them, by address.
    pub fn layout(&self) -> Vec<SegmentLayout> {
        self.segments
            .iter()
            .map(|(&address, seg)| SegmentLayout {
                address,
                pool: seg.pool,
                blocks: seg
                    .blocks
                    .iter()
                    .map(|b| BlockLayout {
                        size: b.size,
                        allocated: b.used,
                    })
                    .collect(),
            })
            .collect()
    }

    /// An allocator in the state `segments` describe (a snapshot of a real
    /// process, or [`CachingAllocator::layout`]), with each allocated block as
    /// a live allocation; returns them with their addresses. Adjacent free
    /// blocks are merged, as the real allocator keeps them. New segments go
    /// above the highest address.
    pub fn from_layout(
        segments: &[SegmentLayout],
    ) -> Result<(Self, Vec<(u64, AllocId)>), LayoutError> {
        let mut a = CachingAllocator::new();
        let mut live = Vec::new();
        let mut sorted: Vec<&SegmentLayout> = segments.iter().collect();
        sorted.sort_by_key(|s| s.address);
        let mut prev_end: Option<(u64, u64)> = None;
        for s in sorted {
            if s.blocks.is_empty() || s.blocks.iter().any(|b| b.size == 0) {
                return Err(LayoutError::EmptyBlock { address: s.address });
            }
            let size = s
                .blocks
                .iter()
                .try_fold(0u64, |acc, b| acc.checked_add(b.size))
                .filter(|&n| s.address.checked_add(n).is_some())
                .ok_or(LayoutError::AddressOverflow { address: s.address })?;
            if let Some((first, end)) = prev_end {
                if s.address < end {
                    return Err(LayoutError::Overlap {
                        first,
                        second: s.address,
                    });
                }
            }
            prev_end = Some((s.address, s.address + size));
            let mut blocks: Vec<Block> = Vec::with_capacity(s.blocks.len());
            let mut offset = 0;
            for b in &s.blocks {
                match blocks.last_mut() {
                    Some(last) if !last.used && !b.allocated => last.size += b.size,
                    _ => blocks.push(Block {
                        offset,
                        size: b.size,
                        used: b.allocated,
                    }),
                }
                offset += b.size;
            }
            for b in &blocks {
                if b.used {
                    a.usage.allocated += b.size;
                    let id = AllocId(a.next_id);
                    a.next_id += 1;
                    a.live.insert(id, (s.address, b.offset));
                    live.push((s.address + b.offset, id));
                } else {
                    a.free_blocks.insert((s.pool, b.size, s.address, b.offset));
                }
            }
            a.usage.reserved += size;
            a.segments.insert(
                s.address,
                Segment {
                    pool: s.pool,
                    size,
                    blocks,
                },
            );
        }
        a.next_address = prev_end
            .map_or(MODEL_ADDRESS_BASE, |(_, end)| {
                end.div_ceil(ROUND_LARGE) * ROUND_LARGE
            })
            .max(MODEL_ADDRESS_BASE);
        a.peaks = Peaks {
            phase: a.usage,
            step: a.usage,
            total: a.usage,
        };
        Ok((a, live))
    }

    /// Number of segments currently reserved.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// `inactive_split_bytes` and `inactive_split` of `torch.cuda.memory_stats()`
    /// for `pool` (None: `.all`): the bytes and count of free blocks that are
    /// part of a split segment (a block with a neighbour, PyTorch's
    /// `Block::is_split()`), which `empty_cache()` cannot release.
    pub fn inactive_split(&self, pool: Option<Pool>) -> (u64, u64) {
        let mut bytes = 0;
        let mut blocks = 0;
        for seg in self.segments.values() {
            if pool.is_some_and(|p| p != seg.pool) || seg.blocks.len() < 2 {
                continue;
            }
            for b in seg.blocks.iter().filter(|b| !b.used) {
                bytes += b.size;
                blocks += 1;
            }
        }
        (bytes, blocks)
    }

    /// `segment.{pool}.current`: segments reserved in `pool` (None: all).
    pub fn segments_in(&self, pool: Option<Pool>) -> u64 {
        self.segments
            .values()
            .filter(|s| pool.is_none_or(|p| p == s.pool))
            .count() as u64
    }

    /// Starts a new phase peak at the current usage.
    pub fn reset_phase_peak(&mut self) {
        self.peaks.phase = self.usage;
    }

    /// Starts a new step peak at the current usage.
    pub fn reset_step_peak(&mut self) {
        self.peaks.step = self.usage;
    }

    /// Allocates `bytes`, growing reserved memory only while it stays within
    /// `reserved_limit` (what the device has left for this process).
    pub fn malloc(&mut self, bytes: u64, reserved_limit: u64) -> Result<AllocId, OutOfMemory> {
        let size = round_size(bytes);
        let pool = Pool::of(size);
        let (seg_id, offset) = match self.best_fit(pool, size) {
            Some(found) => found,
            None => {
                let seg_size = segment_size(size);
                if self.usage.reserved + seg_size > reserved_limit {
                    // The first cudaMalloc failed: free the cache and retry once.
                    self.num_alloc_retries += 1;
                    self.release_free_segments();
                    if self.usage.reserved + seg_size > reserved_limit {
                        return Err(OutOfMemory {
                            requested: size,
                            reserved: self.usage.reserved,
                            limit: reserved_limit,
                        });
                    }
                }
                if self.next_address == 0 {
                    self.next_address = MODEL_ADDRESS_BASE;
                }
                let id = self.next_address;
                self.next_address = self.next_address.saturating_add(seg_size);
                self.segments.insert(
                    id,
                    Segment {
                        pool,
                        size: seg_size,
                        blocks: vec![Block {
                            offset: 0,
                            size: seg_size,
                            used: false,
                        }],
                    },
                );
                self.usage.reserved += seg_size;
                self.free_blocks.insert((pool, seg_size, id, 0));
                (id, 0)
            }
        };
        let used = self.take(seg_id, offset, size, pool);
        self.usage.allocated += used;
        self.bump_peaks();
        let id = AllocId(self.next_id);
        self.next_id += 1;
        self.live.insert(id, (seg_id, offset));
        Ok(id)
    }

    /// Frees a live allocation; the memory stays reserved for reuse.
    /// Unknown handles are ignored.
    pub fn free(&mut self, id: AllocId) {
        let Some((seg_id, offset)) = self.live.remove(&id) else {
            return;
        };
        let seg = self
            .segments
            .get_mut(&seg_id)
            .expect("live block's segment");
        let i = seg
            .blocks
            .iter()
            .position(|b| b.offset == offset)
            .expect("live block");
        debug_assert!(seg.blocks[i].used);
        seg.blocks[i].used = false;
        self.usage.allocated -= seg.blocks[i].size;
        let pool = seg.pool;
        // Merge with the next, then the previous free neighbour.
        let mut i = i;
        if i + 1 < seg.blocks.len() && !seg.blocks[i + 1].used {
            let next = seg.blocks.remove(i + 1);
            self.free_blocks
                .remove(&(pool, next.size, seg_id, next.offset));
            seg.blocks[i].size += next.size;
        }
        if i > 0 && !seg.blocks[i - 1].used {
            let prev = seg.blocks[i - 1];
            self.free_blocks
                .remove(&(pool, prev.size, seg_id, prev.offset));
            seg.blocks[i - 1].size += seg.blocks[i].size;
            seg.blocks.remove(i);
            i -= 1;
        }
        let b = seg.blocks[i];
        self.free_blocks.insert((pool, b.size, seg_id, b.offset));
    }

    /// `torch.cuda.empty_cache()`: returns fully free segments to the driver.
    pub fn release_free_segments(&mut self) {
        let mut freed = 0;
        let free_blocks = &mut self.free_blocks;
        self.segments.retain(|&id, s| {
            let free = s.blocks.len() == 1 && !s.blocks[0].used;
            if free {
                freed += s.size;
                free_blocks.remove(&(s.pool, s.size, id, 0));
            }
            !free
        });
        self.usage.reserved -= freed;
    }

    /// The smallest free block of `pool` that holds `size` (ties: lowest
    /// address).
    fn best_fit(&self, pool: Pool, size: u64) -> Option<(u64, u64)> {
        self.free_blocks
            .range((pool, size, 0, 0)..)
            .next()
            .filter(|b| b.0 == pool)
            .map(|&(_, _, id, off)| (id, off))
    }

    /// Marks the free block at `offset` used, splitting off the remainder when
    /// PyTorch would; returns the bytes the allocation accounts for.
    fn take(&mut self, seg_id: u64, offset: u64, size: u64, pool: Pool) -> u64 {
        let seg = self.segments.get_mut(&seg_id).expect("segment");
        let i = seg
            .blocks
            .iter()
            .position(|b| b.offset == offset)
            .expect("block");
        self.free_blocks
            .remove(&(pool, seg.blocks[i].size, seg_id, offset));
        let remaining = seg.blocks[i].size - size;
        let split = match pool {
            Pool::Small => remaining >= MIN_BLOCK_SIZE,
            Pool::Large => remaining > SMALL_SIZE,
        };
        if split {
            seg.blocks[i].size = size;
            seg.blocks.insert(
                i + 1,
                Block {
                    offset: offset + size,
                    size: remaining,
                    used: false,
                },
            );
            self.free_blocks
                .insert((pool, remaining, seg_id, offset + size));
        }
        seg.blocks[i].used = true;
        seg.blocks[i].size
    }

    /// Checks the internal bookkeeping (tests).
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut free = BTreeSet::new();
        let (mut reserved, mut allocated) = (0, 0);
        for (&id, seg) in &self.segments {
            reserved += seg.size;
            let mut end = 0;
            for (k, b) in seg.blocks.iter().enumerate() {
                assert_eq!(b.offset, end, "blocks tile the segment");
                end += b.size;
                if b.used {
                    allocated += b.size;
                } else {
                    assert!(k == 0 || seg.blocks[k - 1].used, "free neighbours merged");
                    free.insert((seg.pool, b.size, id, b.offset));
                }
            }
            assert_eq!(end, seg.size);
        }
        assert_eq!(free, self.free_blocks);
        assert_eq!(reserved, self.usage.reserved);
        assert_eq!(allocated, self.usage.allocated);
    }

    fn bump_peaks(&mut self) {
        let u = self.usage;
        for p in [
            &mut self.peaks.phase,
            &mut self.peaks.step,
            &mut self.peaks.total,
        ] {
            p.allocated = p.allocated.max(u.allocated);
            p.reserved = p.reserved.max(u.reserved);
        }
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn bookkeeping_holds_over_a_random_workload() {
        let mut a = CachingAllocator::new();
        let mut live = Vec::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut last_reserved = 0;
        for _ in 0..3000 {
            let r = next();
            if r % 3 == 0 && !live.is_empty() {
                let i = (next() % live.len() as u64) as usize;
                a.free(live.swap_remove(i));
            } else {
                // Sizes from bytes to tens of MiB, log-uniform-ish.
                let bytes = 1 + next() % (1u64 << (next() % 26));
                live.push(a.malloc(bytes, u64::MAX).unwrap());
            }
            a.check_invariants();
            assert!(a.reserved() >= a.allocated());
            assert!(a.reserved() >= last_reserved, "reserved never shrinks");
            last_reserved = a.reserved();
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
}
