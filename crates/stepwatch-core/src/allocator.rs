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
//! Free blocks are kept per stream and per pool id, as PyTorch keeps them:
//! a block serves only requests of the stream its segment was made for, and
//! the segments of a private pool (CUDA graphs, `torch.cuda.MemPool`) serve
//! none of the ordinary requests. A block used on a second stream
//! (`record_stream`) is not modelled, so active bytes equal allocated bytes.
//!
//! The settings PyTorch reads from `PYTORCH_CUDA_ALLOC_CONF` that change these
//! rules and that the model follows are in [`AllocatorSettings`]
//! (`max_split_size_mb`, `roundup_power2_divisions`).
//!
//! Segments have device addresses, and best fit breaks ties by address as
//! PyTorch's block comparator does, so a layout taken from a real process
//! ([`CachingAllocator::from_layout`]) is reused in PyTorch's order. Where a
//! new segment lands therefore matters; the model places it as CUDA's
//! allocator was seen to (see [`CachingAllocator::malloc_on`]): in the
//! highest hole that a released segment left and that fits, else just below
//! the lowest address used so far. The simulator runs its jobs on this
//! model, and the predictor replays step 1's allocator trace through it
//! (`crate::replay`).

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

/// Power-of-two intervals `roundup_power2_divisions` sets divisions for:
/// [1 MiB, 2 MiB) (and below), [2 MiB, 4 MiB), …, [32 GiB, ∞).
pub const ROUNDUP_INTERVALS: usize = 16;

/// The allocator settings (`PYTORCH_CUDA_ALLOC_CONF`) the model follows;
/// the default is PyTorch's. Others are refused before a replay
/// (`crate::replay::TraceSettings`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorSettings {
    /// `max_split_size_mb`, in bytes: blocks at least this large are never
    /// split, serve only requests at least this large that leave under
    /// 20 MiB unused, and are the first released when `cudaMalloc` fails.
    /// None: unlimited (PyTorch's default).
    #[serde(default)]
    pub max_split_size: Option<u64>,
    /// `roundup_power2_divisions`: requests in interval `i`
    /// ([`ROUNDUP_INTERVALS`]) are rounded up to the next of that many equal
    /// steps between two powers of two; 0 or 1: only to 512 B.
    #[serde(default)]
    pub roundup_power2_divisions: [u32; ROUNDUP_INTERVALS],
}

impl AllocatorSettings {
    /// The divisions for a request of `bytes` (PyTorch's
    /// `roundup_power2_divisions(size)`).
    fn divisions(&self, bytes: u64) -> u64 {
        let log = 63 - u64::from(bytes.max(1).leading_zeros());
        let index = log.saturating_sub(20).min(ROUNDUP_INTERVALS as u64 - 1) as usize;
        u64::from(self.roundup_power2_divisions[index])
    }

    /// The size a request of `bytes` occupies under these settings
    /// (PyTorch's `round_size`).
    pub fn round_size(&self, bytes: u64) -> u64 {
        if bytes < MIN_BLOCK_SIZE {
            return MIN_BLOCK_SIZE;
        }
        let divisions = self.divisions(bytes);
        if divisions > 1 && bytes > MIN_BLOCK_SIZE.saturating_mul(divisions) {
            return roundup_power2_next_division(bytes, divisions);
        }
        bytes.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
    }

    fn max_split(&self) -> u64 {
        self.max_split_size.unwrap_or(u64::MAX)
    }
}

/// PyTorch's `roundup_power2_next_division`: `size` rounded up to the next of
/// `divisions` equal steps between the powers of two around it.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor.saturating_mul(2);
    }
    let rounded_down = size & !(step - 1);
    if rounded_down == size {
        size
    } else {
        rounded_down.saturating_add(step)
    }
}

/// The size a request of `bytes` occupies: rounded up to 512 B (at least 512).
pub fn round_size(bytes: u64) -> u64 {
    AllocatorSettings::default().round_size(bytes)
}

/// Size of the segment `cudaMalloc`ed when no cached block fits a request of
/// `bytes` (rounded or not).
pub fn segment_size(bytes: u64) -> u64 {
    segment_size_of_rounded(round_size(bytes))
}

/// [`segment_size`] of a size already rounded (PyTorch's
/// `get_allocation_size`).
fn segment_size_of_rounded(rounded: u64) -> u64 {
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
        Pool::of_rounded(round_size(bytes))
    }

    /// The pool of a request whose size is already rounded.
    fn of_rounded(rounded: u64) -> Pool {
        if rounded <= SMALL_SIZE {
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
    /// The stream whose requests it serves.
    stream: u64,
    /// Private pool id; 0: the default pool.
    pool_id: u64,
    /// Sorted by offset, covering the segment without gaps.
    blocks: Vec<Block>,
}

/// A free block's place in the best-fit order: PyTorch keeps one ordered set
/// per pool (private pools apart) and orders it by stream, size, address.
type FreeKey = (u64, u64, Pool, u64, u64, u64);

impl Segment {
    fn free_key(&self, address: u64, b: &Block) -> FreeKey {
        (
            self.pool_id,
            self.stream,
            self.pool,
            b.size,
            address,
            b.offset,
        )
    }
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

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
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
    /// The stream whose requests it serves (the snapshot's `stream`; 0: the
    /// default stream). Its free blocks serve no other stream.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stream: u64,
    /// The private pool it belongs to (CUDA graphs, `torch.cuda.MemPool`;
    /// the snapshot's `segment_pool_id`, made one number); 0: the default
    /// pool. A private pool's blocks serve no ordinary request.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pool_id: u64,
    /// Part of an expandable segment (`expandable_segments:True`), which the
    /// model does not follow: such a layout is refused before a replay.
    #[serde(default, skip_serializing_if = "is_false")]
    pub expandable: bool,
}

impl SegmentLayout {
    /// A default-stream, default-pool segment: what clients that send no
    /// streams or pools describe.
    pub fn new(address: u64, pool: Pool, blocks: Vec<BlockLayout>) -> Self {
        SegmentLayout {
            address,
            pool,
            blocks,
            stream: 0,
            pool_id: 0,
            expandable: false,
        }
    }

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

/// Where the model puts its first segment when it starts empty: new segments
/// go down from here.
const MODEL_ADDRESS_BASE: u64 = 1 << 44;

/// The caching allocator of one process.
#[derive(Debug, Clone, Default)]
pub struct CachingAllocator {
    settings: AllocatorSettings,
    /// By address.
    segments: BTreeMap<u64, Segment>,
    /// Lowest address handed out so far; a new segment that fits no hole goes
    /// just below it (0: not yet chosen).
    lowest_address: u64,
    /// Address ranges released segments left, by address (merged).
    holes: BTreeMap<u64, u64>,
    live: HashMap<AllocId, (u64, u64)>,
    /// Free blocks in best-fit order.
    free_blocks: BTreeSet<FreeKey>,
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

    /// An empty allocator with `settings` in force.
    pub fn with_settings(settings: AllocatorSettings) -> Self {
        CachingAllocator {
            settings,
            ..Self::default()
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> AllocatorSettings {
        self.settings
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
                stream: seg.stream,
                pool_id: seg.pool_id,
                expandable: false,
            })
            .collect()
    }

    /// An allocator in the state `segments` describe (a snapshot of a real
    /// process, or [`CachingAllocator::layout`]), with PyTorch's default
    /// settings; see [`CachingAllocator::from_layout_with`].
    pub fn from_layout(
        segments: &[SegmentLayout],
    ) -> Result<(Self, Vec<(u64, AllocId)>), LayoutError> {
        Self::from_layout_with(segments, AllocatorSettings::default())
    }

    /// An allocator with `settings` in force in the state `segments`
    /// describe, with each allocated block as a live allocation; returns them
    /// with their addresses. Adjacent free blocks are merged, as the real
    /// allocator keeps them. New segments go below the lowest one.
    pub fn from_layout_with(
        segments: &[SegmentLayout],
        settings: AllocatorSettings,
    ) -> Result<(Self, Vec<(u64, AllocId)>), LayoutError> {
        let mut a = CachingAllocator::with_settings(settings);
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
            let seg = Segment {
                pool: s.pool,
                size,
                stream: s.stream,
                pool_id: s.pool_id,
                blocks,
            };
            for b in &seg.blocks {
                if b.used {
                    a.usage.allocated += b.size;
                    let id = AllocId(a.next_id);
                    a.next_id += 1;
                    a.live.insert(id, (s.address, b.offset));
                    live.push((s.address + b.offset, id));
                } else {
                    a.free_blocks.insert(seg.free_key(s.address, b));
                }
            }
            a.usage.reserved += size;
            a.segments.insert(s.address, seg);
        }
        a.lowest_address = a.segments.keys().next().copied().unwrap_or(0);
        a.peaks = Peaks {
            phase: a.usage,
            step: a.usage,
            total: a.usage,
        };
        Ok((a, live))
    }

    /// Marks `[address, address + size)` as free address space that a new
    /// segment may take (a segment the traced process released), unless a
    /// segment overlaps it.
    pub fn add_address_hole(&mut self, address: u64, size: u64) {
        let Some(end) = address.checked_add(size) else {
            return;
        };
        if size == 0
            || self
                .segments
                .range(..end)
                .next_back()
                .is_some_and(|(&a, s)| a.saturating_add(s.size) > address)
        {
            return;
        }
        self.insert_hole(address, size);
    }

    fn insert_hole(&mut self, mut address: u64, mut size: u64) {
        if let Some((&a, &s)) = self.holes.range(..=address).next_back() {
            if a.saturating_add(s) >= address {
                let end = address.saturating_add(size).max(a.saturating_add(s));
                self.holes.remove(&a);
                address = a;
                size = end - a;
            }
        }
        let end = address.saturating_add(size);
        while let Some((&a, &s)) = self.holes.range(address..=end).next() {
            self.holes.remove(&a);
            size = a.saturating_add(s).max(end) - address;
        }
        self.holes.insert(address, size);
    }

    /// Where a new segment of `size` bytes lands: at the top of the highest
    /// hole that holds it, else just below the lowest address used so far,
    /// else (no room below) above the highest segment.
    fn place_segment(&mut self, size: u64) -> u64 {
        let hole = self
            .holes
            .iter()
            .rev()
            .find(|&(_, &s)| s >= size)
            .map(|(&a, &s)| (a, s));
        if let Some((a, s)) = hole {
            self.holes.remove(&a);
            if s > size {
                self.holes.insert(a, s - size);
            }
            return a + (s - size);
        }
        if self.lowest_address == 0 {
            self.lowest_address = MODEL_ADDRESS_BASE;
        }
        match self.lowest_address.checked_sub(size) {
            Some(a) if a > 0 => {
                let a = a / ROUND_LARGE * ROUND_LARGE;
                if a > 0 {
                    self.lowest_address = a;
                    return a;
                }
                self.above_all()
            }
            _ => self.above_all(),
        }
    }

    fn above_all(&self) -> u64 {
        self.segments
            .iter()
            .next_back()
            .map_or(MODEL_ADDRESS_BASE, |(&a, s)| {
                a.saturating_add(s.size).div_ceil(ROUND_LARGE) * ROUND_LARGE
            })
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

    /// Allocates `bytes` on the default stream; see
    /// [`CachingAllocator::malloc_on`].
    pub fn malloc(&mut self, bytes: u64, reserved_limit: u64) -> Result<AllocId, OutOfMemory> {
        self.malloc_on(bytes, 0, reserved_limit)
    }

    /// Allocates `bytes` on `stream`, growing reserved memory only while it
    /// stays within `reserved_limit` (what the device has left for this
    /// process). When the new segment would not fit, PyTorch first releases
    /// free oversize blocks (with `max_split_size_mb`), then every free
    /// unsplit segment (`num_alloc_retries`), and tries again.
    pub fn malloc_on(
        &mut self,
        bytes: u64,
        stream: u64,
        reserved_limit: u64,
    ) -> Result<AllocId, OutOfMemory> {
        let size = self.settings.round_size(bytes);
        let pool = Pool::of_rounded(size);
        let (seg_id, offset) = match self.best_fit(stream, pool, size) {
            Some(found) => found,
            None => {
                let seg_size = segment_size_of_rounded(size);
                let fits = |a: &Self| a.usage.reserved.saturating_add(seg_size) <= reserved_limit;
                if !fits(self) {
                    self.release_oversize_blocks(stream, pool, size);
                }
                if !fits(self) {
                    // cudaMalloc failed: free the cache and retry once.
                    self.num_alloc_retries += 1;
                    self.release_free_segments();
                    if !fits(self) {
                        return Err(OutOfMemory {
                            requested: size,
                            reserved: self.usage.reserved,
                            limit: reserved_limit,
                        });
                    }
                }
                let id = self.place_segment(seg_size);
                let seg = Segment {
                    pool,
                    size: seg_size,
                    stream,
                    pool_id: 0,
                    blocks: vec![Block {
                        offset: 0,
                        size: seg_size,
                        used: false,
                    }],
                };
                self.free_blocks.insert(seg.free_key(id, &seg.blocks[0]));
                self.segments.insert(id, seg);
                self.usage.reserved += seg_size;
                (id, 0)
            }
        };
        let used = self.take(seg_id, offset, size);
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
        // Merge with the next, then the previous free neighbour.
        let mut i = i;
        if i + 1 < seg.blocks.len() && !seg.blocks[i + 1].used {
            let next = seg.blocks.remove(i + 1);
            self.free_blocks.remove(&seg.free_key(seg_id, &next));
            seg.blocks[i].size += next.size;
        }
        if i > 0 && !seg.blocks[i - 1].used {
            let prev = seg.blocks[i - 1];
            self.free_blocks.remove(&seg.free_key(seg_id, &prev));
            seg.blocks[i - 1].size += seg.blocks[i].size;
            seg.blocks.remove(i);
            i -= 1;
        }
        self.free_blocks
            .insert(seg.free_key(seg_id, &seg.blocks[i]));
    }

    /// `torch.cuda.empty_cache()`: returns fully free segments to the
    /// driver; their address ranges become holes a new segment may take.
    pub fn release_free_segments(&mut self) {
        let mut released = Vec::new();
        let free_blocks = &mut self.free_blocks;
        self.segments.retain(|&id, s| {
            let free = s.blocks.len() == 1 && !s.blocks[0].used;
            if free {
                released.push((id, s.size));
                free_blocks.remove(&s.free_key(id, &s.blocks[0]));
            }
            !free
        });
        for (id, size) in released {
            self.usage.reserved -= size;
            self.insert_hole(id, size);
        }
    }

    /// PyTorch's `release_available_cached_blocks`: with `max_split_size_mb`,
    /// before giving up on a new segment, release free oversize blocks of
    /// the request's stream and pool: the smallest one at least as large as
    /// the request (and as `max_split_size`), else the largest ones until
    /// they add up to that.
    fn release_oversize_blocks(&mut self, stream: u64, pool: Pool, size: u64) {
        let Some(max_split) = self.settings.max_split_size else {
            return;
        };
        let want = size.max(max_split);
        let lo = (0, stream, pool, want, 0, 0);
        let hi = (0, stream, pool, u64::MAX, u64::MAX, u64::MAX);
        if let Some(&key) = self.free_blocks.range(lo..=hi).next() {
            self.release_block(key);
            return;
        }
        let lo = (0, stream, pool, max_split, 0, 0);
        let mut chosen = Vec::new();
        let mut total = 0u64;
        for &key in self.free_blocks.range(lo..=hi).rev() {
            if total >= want {
                break;
            }
            total = total.saturating_add(key.3);
            chosen.push(key);
        }
        // PyTorch releases them as it goes, even when they fall short.
        for key in chosen {
            self.release_block(key);
        }
    }

    /// Releases the free, unsplit segment whose block `key` names.
    fn release_block(&mut self, key: FreeKey) {
        let (id, offset) = (key.4, key.5);
        let whole = self
            .segments
            .get(&id)
            .is_some_and(|s| offset == 0 && s.blocks.len() == 1 && !s.blocks[0].used);
        if !whole {
            return;
        }
        if let Some(s) = self.segments.remove(&id) {
            self.free_blocks.remove(&key);
            self.usage.reserved -= s.size;
            self.insert_hole(id, s.size);
        }
    }

    /// The smallest free block of `stream`'s `pool` (default pool id) that
    /// holds `size` (ties: lowest address), as PyTorch's `get_free_block`
    /// takes it, `max_split_size` rules included.
    fn best_fit(&self, stream: u64, pool: Pool, size: u64) -> Option<(u64, u64)> {
        let &(_, _, _, block, id, off) = self
            .free_blocks
            .range((0, stream, pool, size, 0, 0)..)
            .next()
            .filter(|b| b.0 == 0 && b.1 == stream && b.2 == pool)?;
        let max_split = self.settings.max_split();
        // No oversize block for a request that would split it; an oversize
        // request takes one only when it wastes under 20 MiB.
        if size < max_split && block >= max_split {
            return None;
        }
        if size >= max_split && block >= size.saturating_add(LARGE_BUFFER) {
            return None;
        }
        Some((id, off))
    }

    /// Marks the free block at `offset` used, splitting off the remainder when
    /// PyTorch would; returns the bytes the allocation accounts for.
    fn take(&mut self, seg_id: u64, offset: u64, size: u64) -> u64 {
        let max_split = self.settings.max_split();
        let seg = self.segments.get_mut(&seg_id).expect("segment");
        let i = seg
            .blocks
            .iter()
            .position(|b| b.offset == offset)
            .expect("block");
        self.free_blocks
            .remove(&seg.free_key(seg_id, &seg.blocks[i]));
        let remaining = seg.blocks[i].size - size;
        let split = match seg.pool {
            Pool::Small => remaining >= MIN_BLOCK_SIZE,
            Pool::Large => size < max_split && remaining > SMALL_SIZE,
        };
        if split {
            seg.blocks[i].size = size;
            let rest = Block {
                offset: offset + size,
                size: remaining,
                used: false,
            };
            seg.blocks.insert(i + 1, rest);
            self.free_blocks.insert(seg.free_key(seg_id, &rest));
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
                    free.insert(seg.free_key(id, b));
                }
            }
            assert_eq!(end, seg.size);
        }
        assert_eq!(free, self.free_blocks);
        assert_eq!(reserved, self.usage.reserved);
        assert_eq!(allocated, self.usage.allocated);
        let mut prev_end = 0;
        for (&a, s) in self.segments.iter() {
            assert!(a >= prev_end, "segments do not overlap");
            prev_end = a + s.size;
        }
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
    fn whole(address: u64, size: u64, allocated: bool) -> SegmentLayout {
        SegmentLayout::new(address, Pool::Large, vec![BlockLayout { size, allocated }])
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
    fn placement_below_decides_which_equal_block_best_fit_reuses() {
        // Two free 40 MiB blocks: the one at the lower address is reused. The
        // new segment lies below the layout's, so it is the one.
        let x = 1u64 << 36;
        let (mut a, live) = CachingAllocator::from_layout(&[whole(x, 40 * MIB, true)]).unwrap();
        let b = a.malloc(40 * MIB, u64::MAX).unwrap();
        a.free(live[0].1);
        a.free(b);
        let c = a.malloc(24 * MIB, u64::MAX).unwrap();
        assert_eq!(a.address_of(c), Some(x - 40 * MIB));
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
}
