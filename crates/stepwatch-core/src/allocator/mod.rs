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
//! Segments have device addresses, and best fit breaks ties as the traced
//! PyTorch version's block comparator does ([`FreeBlockOrder`]: the oldest
//! segment from 2.13 on, the lowest address before), so a layout taken from a real process
//! ([`CachingAllocator::from_layout`]) is reused in PyTorch's order. Where a
//! new segment lands therefore matters; the model places it as CUDA's
//! allocator was seen to (see [`CachingAllocator::malloc_on`]): in the
//! highest hole that a released segment left and that fits, else just below
//! the lowest address used so far. The simulator runs its jobs on this
//! model, and the predictor replays step 1's allocator trace through it
//! (`crate::replay`).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

mod history;
mod layouts;
mod sizes;

pub use history::*;
pub use layouts::*;
pub use sizes::*;

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
    /// Backed by memory; false only for the unmapped address space of an
    /// expandable segment (never used, never in the free set).
    mapped: bool,
}

impl Block {
    fn new(offset: u64, size: u64, used: bool) -> Self {
        Block {
            offset,
            size,
            used,
            mapped: true,
        }
    }

    /// Free and backed: may serve a request, and merges with its like.
    fn is_free(&self) -> bool {
        !self.used && self.mapped
    }
}

/// Address space an expandable segment may still map after its last block;
/// PyTorch reserves 1.125 × the GPU's memory, which no replay outgrows.
const EXPANDABLE_TAIL: u64 = 1 << 50;

#[derive(Debug, Clone)]
struct Segment {
    pool: Pool,
    /// Bytes of address space its blocks tile.
    size: u64,
    /// Bytes mapped (reserved): `size`, except in an expandable segment.
    reserved: u64,
    /// An expandable segment: its blocks end with unmapped address space.
    expandable: bool,
    /// The stream whose requests it serves.
    stream: u64,
    /// Private pool id; 0: the default pool.
    pool_id: u64,
    /// When it was made, counted from 0: among free blocks of one size the
    /// oldest segment's serves first ([`FreeBlockOrder::SegmentAge`]); 0 for
    /// every segment under [`FreeBlockOrder::Address`].
    created: u64,
    /// Sorted by offset, covering the segment without gaps.
    blocks: Vec<Block>,
}

/// A free block's place in the best-fit order: PyTorch keeps one ordered set
/// per pool (private pools apart) and orders it by stream, size, then
/// ([`FreeBlockOrder`]) the age of the block's segment (2.13 and later), then
/// address. Checked on fake CUDA with PyTorch 2.15: of three free 394 MiB
/// segments a 12 MiB request takes the oldest, whatever their addresses or
/// the order they were freed in (`tests/replay_torch.rs`); checked on
/// real-GPU snapshots of earlier versions: the lowest address
/// (`bench/alloc-snapshots.sh`). Fields: pool id, stream, pool, size,
/// segment age (0 under the address rule), segment address, offset.
type FreeKey = (u64, u64, Pool, u64, u64, u64, u64);

impl Segment {
    /// Index of the block at `offset` (blocks are sorted by offset).
    fn index_of(&self, offset: u64) -> usize {
        self.blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .expect("a block at this offset")
    }

    fn free_key(&self, address: u64, b: &Block) -> FreeKey {
        (
            self.pool_id,
            self.stream,
            self.pool,
            b.size,
            self.created,
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
    /// What the driver holds for the allocator: `reserved`, and for an
    /// instant more in a peak, when an expandable segment's growth fails
    /// partway. PyTorch creates the pages one by one
    /// (`ExpandableSegment::map`) and gives back those it made when one
    /// fails, before it releases its cache and retries; NVML (and the
    /// GPU's capacity) sees them, `memory_stats()` does not.
    pub device: u64,
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
    /// Segments `empty_cache()` would release (default pool, not
    /// expandable, one free block), so that a release costs what it
    /// releases, not a pass over every segment.
    releasable: BTreeSet<u64>,
    /// The expandable segment of each (stream, pool) in the default pool.
    expandable: BTreeMap<(u64, Pool), u64>,
    next_id: u64,
    /// Segments made so far ([`Segment::created`] of the next one).
    segments_made: u64,
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
        Usage {
            device: self.usage.reserved,
            ..self.usage
        }
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
        let i = seg
            .blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .ok()?;
        Some(seg.blocks[i].size)
    }

    /// Segments as `torch.cuda.memory_snapshot()` would list them, by address.
    pub fn layout(&self) -> Vec<SegmentLayout> {
        self.segments
            .iter()
            .flat_map(|(&address, seg)| {
                // An expandable segment shows as its runs of mapped blocks, as
                // PyTorch's snapshot lists it.
                let mut runs: Vec<SegmentLayout> = Vec::new();
                let mut in_run = false;
                for b in &seg.blocks {
                    if !b.mapped {
                        in_run = false;
                        continue;
                    }
                    if !in_run {
                        runs.push(SegmentLayout {
                            address: address + b.offset,
                            pool: seg.pool,
                            blocks: Vec::new(),
                            stream: seg.stream,
                            pool_id: seg.pool_id,
                            expandable: seg.expandable,
                        });
                        in_run = true;
                    }
                    if let Some(run) = runs.last_mut() {
                        run.blocks.push(BlockLayout {
                            size: b.size,
                            allocated: b.used,
                            gradient: false,
                        });
                    }
                }
                runs
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
        Self::from_layout_aged(segments, settings, &[])
    }

    /// [`CachingAllocator::from_layout_with`], knowing which segments were
    /// made last: `made_last` lists addresses of the layout's segments in the
    /// order they were made (a trace's `segment_alloc` events), after all
    /// the others. A snapshot does not say how old the others are; CUDA
    /// hands out new segments below the old ones, so the higher, the older.
    pub fn from_layout_aged(
        segments: &[SegmentLayout],
        settings: AllocatorSettings,
        made_last: &[u64],
    ) -> Result<(Self, Vec<(u64, AllocId)>), LayoutError> {
        let mut a = CachingAllocator::with_settings(settings);
        let mut live = Vec::new();
        let mut sorted: Vec<&SegmentLayout> = segments.iter().collect();
        sorted.sort_by_key(|s| s.address);
        let count = sorted.len() as u64;
        let mut last_made: HashMap<u64, u64> = HashMap::new();
        for (i, &address) in made_last.iter().enumerate() {
            last_made.insert(address, i as u64);
        }
        let by_address = settings.free_block_order == FreeBlockOrder::Address;
        let age = |rank_by_address: usize, address: u64| match last_made.get(&address) {
            _ if by_address => 0,
            Some(&i) => count + i,
            None => count - 1 - rank_by_address as u64,
        };
        a.segments_made = count + made_last.len() as u64;
        let mut prev_end: Option<(u64, u64)> = None;
        for (rank_by_address, s) in sorted.into_iter().enumerate() {
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
                    _ => blocks.push(Block::new(offset, b.size, b.allocated)),
                }
                offset += b.size;
            }
            let seg = Segment {
                pool: s.pool,
                size,
                reserved: size,
                expandable: s.expandable,
                stream: s.stream,
                pool_id: s.pool_id,
                created: age(rank_by_address, s.address),
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
        a.join_expandable_runs();
        let ids: Vec<u64> = a.segments.keys().copied().collect();
        for id in ids {
            a.note_segment(id);
        }
        a.lowest_address = a.segments.keys().next().copied().unwrap_or(0);
        a.peaks = Peaks {
            phase: a.usage,
            step: a.usage,
            total: a.usage,
        };
        Ok((a, live))
    }

    /// The age the next new segment gets.
    fn next_segment_age(&mut self) -> u64 {
        self.segments_made += 1;
        match self.settings.free_block_order {
            FreeBlockOrder::SegmentAge => self.segments_made - 1,
            FreeBlockOrder::Address => 0,
        }
    }

    /// Files segment `id` (after any change to its blocks) where
    /// `empty_cache()` and expandable growth look it up.
    fn note_segment(&mut self, id: u64) {
        match self.segments.get(&id) {
            Some(s) if s.expandable => {
                self.releasable.remove(&id);
                if s.pool_id == 0 {
                    self.expandable.insert((s.stream, s.pool), id);
                }
            }
            Some(s) if s.pool_id == 0 && s.blocks.len() == 1 && s.blocks[0].is_free() => {
                self.releasable.insert(id);
            }
            _ => {
                self.releasable.remove(&id);
            }
        }
    }

    /// Makes the mapped runs of each expandable segment (one per stream, pool
    /// id and pool; a snapshot lists each run apart) one segment again: the
    /// runs in address order with unmapped space between them and after the
    /// last.
    fn join_expandable_runs(&mut self) {
        let mut groups: BTreeMap<(u64, u64, Pool), Vec<u64>> = BTreeMap::new();
        for (&address, seg) in &self.segments {
            if seg.expandable {
                groups
                    .entry((seg.stream, seg.pool_id, seg.pool))
                    .or_default()
                    .push(address);
            }
        }
        let mut rebase: HashMap<u64, u64> = HashMap::new();
        for runs in groups.into_values() {
            let base = runs[0];
            let mut joined: Option<Segment> = None;
            for address in runs {
                let Some(run) = self.segments.remove(&address) else {
                    continue;
                };
                for b in run.blocks.iter().filter(|b| b.is_free()) {
                    self.free_blocks.remove(&run.free_key(address, b));
                }
                rebase.insert(address, base);
                let seg = joined.get_or_insert_with(|| Segment {
                    blocks: Vec::new(),
                    size: 0,
                    reserved: 0,
                    ..run.clone()
                });
                let start = address - base;
                if start > seg.size {
                    seg.blocks.push(Block {
                        mapped: false,
                        ..Block::new(seg.size, start - seg.size, false)
                    });
                }
                for b in &run.blocks {
                    seg.blocks
                        .push(Block::new(start + b.offset, b.size, b.used));
                }
                seg.size = start + run.size;
                seg.reserved += run.reserved;
            }
            if let Some(mut seg) = joined {
                seg.blocks.push(Block {
                    mapped: false,
                    ..Block::new(seg.size, EXPANDABLE_TAIL, false)
                });
                seg.size = seg.size.saturating_add(EXPANDABLE_TAIL);
                for b in seg.blocks.iter().filter(|b| b.is_free()) {
                    self.free_blocks.insert(seg.free_key(base, b));
                }
                self.segments.insert(base, seg);
            }
        }
        for at in self.live.values_mut() {
            if let Some(&base) = rebase.get(&at.0) {
                *at = (base, at.0 - base + at.1);
            }
        }
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
        // The hole was handed out once: "below the lowest address so far"
        // starts below it too.
        if self.lowest_address == 0 || address < self.lowest_address {
            self.lowest_address = address;
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
        let at = self.place_segment_unchecked(size);
        // Never on top of a segment, whatever the holes said.
        let end = at.saturating_add(size);
        let clash = self
            .segments
            .range(at..end.max(at.saturating_add(1)))
            .next()
            .is_some()
            || self
                .segments
                .range(..at)
                .next_back()
                .is_some_and(|(&a, s)| !s.expandable && a.saturating_add(s.size) > at);
        if clash {
            self.above_all()
        } else {
            at
        }
    }

    fn place_segment_unchecked(&mut self, size: u64) -> u64 {
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
            .map(|(&a, s)| a.saturating_add(s.size))
            .max()
            .map_or(MODEL_ADDRESS_BASE, |end| {
                end.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
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
        self.peaks.phase = self.usage();
    }

    /// Starts a new step peak at the current usage.
    pub fn reset_step_peak(&mut self) {
        self.peaks.step = self.usage();
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
        if self.settings.expandable_segments {
            return self.malloc_expandable(size, stream, pool, reserved_limit);
        }
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
                    reserved: seg_size,
                    expandable: false,
                    stream,
                    pool_id: 0,
                    created: self.next_segment_age(),
                    blocks: vec![Block::new(0, seg_size, false)],
                };
                self.free_blocks.insert(seg.free_key(id, &seg.blocks[0]));
                self.segments.insert(id, seg);
                self.usage.reserved += seg_size;
                (id, 0)
            }
        };
        Ok(self.hand_out(seg_id, offset, size))
    }

    /// Where [`CachingAllocator::malloc_on`] would serve `bytes` on `stream`
    /// from the cache: the address of the free block it would take; None
    /// when it would make a new segment. Changes nothing.
    pub fn cached_fit(&self, bytes: u64, stream: u64) -> Option<u64> {
        let size = self.settings.round_size(bytes);
        let pool = Pool::of_rounded(size);
        let (seg, offset) = if self.settings.expandable_segments {
            self.best_fit_expandable(stream, pool, size)?
        } else {
            self.best_fit(stream, pool, size)?
        };
        Some(seg + offset)
    }

    /// Follows a recorded allocation of `bytes` at `address` (a trace's
    /// `alloc`): takes the free block that starts there, split as PyTorch
    /// splits it. None, and nothing changes, when no free block that holds
    /// it starts there.
    pub fn malloc_at(&mut self, bytes: u64, address: u64) -> Option<AllocId> {
        let size = self.settings.round_size(bytes);
        let (&seg_id, seg) = self.segments.range(..=address).next_back()?;
        let offset = address - seg_id;
        let i = seg
            .blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .ok()?;
        let b = seg.blocks[i];
        if !b.is_free() || b.size < size || Pool::of_rounded(size) != seg.pool {
            return None;
        }
        Some(self.hand_out(seg_id, offset, size))
    }

    /// Follows a recorded `cudaMalloc` (a trace's `segment_alloc`): a new,
    /// free segment of `size` bytes at `address` for `stream`'s `pool`,
    /// the newest. Refused, and nothing changes, when it would overlap one.
    pub fn add_segment_at(
        &mut self,
        address: u64,
        size: u64,
        pool: Pool,
        stream: u64,
    ) -> Result<(), LayoutError> {
        let end = address
            .checked_add(size)
            .filter(|_| size > 0)
            .ok_or(LayoutError::AddressOverflow { address })?;
        if let Some((&first, s)) = self.segments.range(..end).next_back() {
            if first.saturating_add(s.size) > address {
                return Err(LayoutError::Overlap {
                    first,
                    second: address,
                });
            }
        }
        let seg = Segment {
            pool,
            size,
            reserved: size,
            expandable: false,
            stream,
            pool_id: 0,
            created: self.next_segment_age(),
            blocks: vec![Block::new(0, size, false)],
        };
        self.free_blocks
            .insert(seg.free_key(address, &seg.blocks[0]));
        self.segments.insert(address, seg);
        self.usage.reserved += size;
        if self.lowest_address == 0 || address < self.lowest_address {
            self.lowest_address = address;
        }
        self.note_segment(address);
        self.bump_peaks();
        Ok(())
    }

    /// Follows a recorded segment release (a trace's `segment_free`): the
    /// segment at `address` goes back to the driver if it is whole and
    /// free; returns whether it did.
    pub fn release_segment_at(&mut self, address: u64) -> bool {
        let Some(seg) = self.segments.get(&address) else {
            return false;
        };
        let key = seg.free_key(address, &seg.blocks[0]);
        self.release_block(key);
        !self.segments.contains_key(&address)
    }

    /// Takes the free block at (`seg_id`, `offset`) for a request of `size`
    /// and makes it a live allocation.
    fn hand_out(&mut self, seg_id: u64, offset: u64, size: u64) -> AllocId {
        let used = self.take(seg_id, offset, size);
        self.usage.allocated += used;
        self.bump_peaks();
        let id = AllocId(self.next_id);
        self.next_id += 1;
        self.live.insert(id, (seg_id, offset));
        id
    }

    /// [`CachingAllocator::malloc_on`] under `expandable_segments:True`
    /// (PyTorch's `get_free_block`, then `try_allocate_expandable_block`).
    fn malloc_expandable(
        &mut self,
        size: u64,
        stream: u64,
        pool: Pool,
        reserved_limit: u64,
    ) -> Result<AllocId, OutOfMemory> {
        if let Some((seg_id, offset)) = self.best_fit_expandable(stream, pool, size) {
            return Ok(self.hand_out(seg_id, offset, size));
        }
        let found = match self.map_for(stream, pool, size, reserved_limit) {
            Some(found) => found,
            None => {
                // The pages that still fit were made, then given back.
                let page = expandable_page(pool);
                let room = reserved_limit.saturating_sub(self.usage.reserved);
                self.bump_device_peak(self.usage.reserved + room / page * page);
                self.num_alloc_retries += 1;
                self.release_free_segments();
                self.map_for(stream, pool, size, reserved_limit)
                    .ok_or(OutOfMemory {
                        requested: size,
                        reserved: self.usage.reserved,
                        limit: reserved_limit,
                    })?
            }
        };
        Ok(self.hand_out(found.0, found.1, size))
    }

    /// Best fit under expandable segments: a free block followed by unmapped
    /// space counts as the size it could grow to, so the smallest block that
    /// fits as it is wins over one that would have to grow.
    fn best_fit_expandable(&self, stream: u64, pool: Pool, size: u64) -> Option<(u64, u64)> {
        let hi = (0, stream, pool, u64::MAX, u64::MAX, u64::MAX, u64::MAX);
        let mut found: Option<(u64, u64, u64)> = None;
        for &(_, _, _, block, _, id, off) in self
            .free_blocks
            .range((0, stream, pool, size, 0, 0, 0)..=hi)
        {
            let reach = self.segments.get(&id).map_or(block, |seg| {
                let i = seg.index_of(off);
                match seg.blocks.get(i + 1) {
                    Some(next) if !next.mapped => block.saturating_add(next.size),
                    _ => block,
                }
            });
            match found {
                Some((best, _, _)) if reach >= best => break,
                _ => found = Some((reach, id, off)),
            }
        }
        let (_, id, off) = found?;
        let block = self.segments[&id].blocks[self.segments[&id].index_of(off)].size;
        let max_split = self.settings.max_split();
        if (size < max_split && block >= max_split)
            || (size >= max_split && block >= size.saturating_add(LARGE_BUFFER))
        {
            return None;
        }
        Some((id, off))
    }

    /// Maps pages of `stream`'s expandable segment of `pool` (made when it has
    /// none) so that a free block of at least `size` bytes starts where
    /// PyTorch's `find_expandable_block` looks first: at the lowest unmapped
    /// space, with the free block before it. None when the pages would take
    /// reserved memory past `reserved_limit`.
    fn map_for(
        &mut self,
        stream: u64,
        pool: Pool,
        size: u64,
        reserved_limit: u64,
    ) -> Option<(u64, u64)> {
        let page = expandable_page(pool);
        let existing = self.expandable.get(&(stream, pool)).copied();
        let seg_id = match existing {
            Some(a) => a,
            None => {
                let a = self.place_segment(page);
                let seg = Segment {
                    pool,
                    size: EXPANDABLE_TAIL,
                    reserved: 0,
                    expandable: true,
                    stream,
                    pool_id: 0,
                    created: self.next_segment_age(),
                    blocks: vec![Block {
                        mapped: false,
                        ..Block::new(0, EXPANDABLE_TAIL, false)
                    }],
                };
                self.segments.insert(a, seg);
                self.note_segment(a);
                a
            }
        };
        let seg = self.segments.get(&seg_id)?;
        let blocks = &seg.blocks;
        // The first unmapped space (lowest address) with room, counting the
        // free block before it and what follows it up to a used block.
        let start = (0..blocks.len())
            .filter(|&u| !blocks[u].mapped)
            .find_map(|u| {
                let c = if u > 0 && blocks[u - 1].is_free() {
                    u - 1
                } else {
                    u
                };
                let room = blocks[c..]
                    .iter()
                    .take_while(|b| !b.used)
                    .fold(0u64, |n, b| n.saturating_add(b.size));
                (room >= size).then_some(c)
            })?;
        // Which pages to map: each unmapped stretch up to what is still
        // missing, rounded up to whole pages.
        let (mut have, mut to_map) = (0u64, 0u64);
        let (mut last, mut partial) = (start, None);
        for (i, b) in blocks.iter().enumerate().skip(start) {
            last = i;
            if b.mapped {
                have = have.saturating_add(b.size);
            } else {
                let m = size
                    .saturating_sub(have)
                    .div_ceil(page)
                    .saturating_mul(page)
                    .min(b.size);
                have = have.saturating_add(m);
                to_map = to_map.saturating_add(m);
                if m < b.size {
                    partial = Some(m);
                    break;
                }
            }
            if have >= size {
                break;
            }
        }
        if self.usage.reserved.saturating_add(to_map) > reserved_limit {
            return None;
        }
        // A wholly mapped stretch merges with the free block after it.
        let mut through = last;
        if partial.is_none() && !blocks[last].mapped {
            if let Some(next) = blocks.get(last + 1).filter(|n| n.is_free()) {
                have = have.saturating_add(next.size);
                through = last + 1;
            }
        }
        let offset = blocks[start].offset;
        let rest = partial.map(|m| {
            let b = blocks[last];
            Block {
                mapped: false,
                ..Block::new(b.offset + m, b.size - m, false)
            }
        });
        let seg = self.segments.get_mut(&seg_id)?;
        let gone: Vec<Block> = seg.blocks.drain(start..=through).collect();
        for b in gone.iter().filter(|b| b.is_free()) {
            self.free_blocks.remove(&seg.free_key(seg_id, b));
        }
        let block = Block::new(offset, have, false);
        seg.blocks.insert(start, block);
        if let Some(rest) = rest {
            seg.blocks.insert(start + 1, rest);
        }
        self.free_blocks.insert(seg.free_key(seg_id, &block));
        seg.reserved += to_map;
        self.usage.reserved += to_map;
        Some((seg_id, offset))
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
        let i = seg.index_of(offset);
        debug_assert!(seg.blocks[i].used);
        seg.blocks[i].used = false;
        self.usage.allocated -= seg.blocks[i].size;
        // Merge with the next, then the previous free neighbour (unmapped
        // space does not merge with mapped blocks).
        let mut i = i;
        if i + 1 < seg.blocks.len() && seg.blocks[i + 1].is_free() {
            let next = seg.blocks.remove(i + 1);
            self.free_blocks.remove(&seg.free_key(seg_id, &next));
            seg.blocks[i].size += next.size;
        }
        if i > 0 && seg.blocks[i - 1].is_free() {
            let prev = seg.blocks[i - 1];
            self.free_blocks.remove(&seg.free_key(seg_id, &prev));
            seg.blocks[i - 1].size += seg.blocks[i].size;
            seg.blocks.remove(i);
            i -= 1;
        }
        self.free_blocks
            .insert(seg.free_key(seg_id, &seg.blocks[i]));
        self.note_segment(seg_id);
    }

    /// `torch.cuda.empty_cache()`: returns fully free segments to the
    /// driver; their address ranges become holes a new segment may take.
    pub fn release_free_segments(&mut self) {
        let expandable: Vec<u64> = self.expandable.values().copied().collect();
        for id in expandable {
            self.unmap_free_pages(id);
        }
        for id in std::mem::take(&mut self.releasable) {
            if let Some(s) = self.segments.remove(&id) {
                self.free_blocks.remove(&s.free_key(id, &s.blocks[0]));
                self.usage.reserved -= s.size;
                self.insert_hole(id, s.size);
            }
        }
    }

    /// `empty_cache()` on an expandable segment (PyTorch's `unmap_block`):
    /// the whole pages inside each free block are unmapped; the partial pages
    /// at its ends stay mapped as free blocks. A segment left with nothing
    /// mapped is released.
    fn unmap_free_pages(&mut self, id: u64) {
        let Some(seg) = self.segments.get_mut(&id) else {
            return;
        };
        let page = expandable_page(seg.pool);
        let mut blocks: Vec<Block> = Vec::with_capacity(seg.blocks.len());
        let mut unmapped = 0u64;
        for b in std::mem::take(&mut seg.blocks) {
            let first_page = b.offset.div_ceil(page).saturating_mul(page);
            let end = b.offset.saturating_add(b.size);
            let last_page = end / page * page;
            if !b.is_free() || first_page >= last_page {
                blocks.push(b);
                continue;
            }
            self.free_blocks.remove(&seg.free_key(id, &b));
            if first_page > b.offset {
                let before = Block::new(b.offset, first_page - b.offset, false);
                self.free_blocks.insert(seg.free_key(id, &before));
                blocks.push(before);
            }
            unmapped += last_page - first_page;
            blocks.push(Block {
                mapped: false,
                ..Block::new(first_page, last_page - first_page, false)
            });
            if end > last_page {
                let after = Block::new(last_page, end - last_page, false);
                self.free_blocks.insert(seg.free_key(id, &after));
                blocks.push(after);
            }
        }
        // Unmapped neighbours are one stretch.
        let mut joined: Vec<Block> = Vec::with_capacity(blocks.len());
        for b in blocks {
            match joined.last_mut() {
                Some(last) if !last.mapped && !b.mapped => {
                    last.size = last.size.saturating_add(b.size)
                }
                _ => joined.push(b),
            }
        }
        seg.blocks = joined;
        seg.reserved -= unmapped;
        self.usage.reserved -= unmapped;
        if seg.reserved == 0 && seg.blocks.iter().all(|b| !b.mapped) {
            let key = (seg.stream, seg.pool);
            self.segments.remove(&id);
            if self.expandable.get(&key) == Some(&id) {
                self.expandable.remove(&key);
            }
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
        let lo = (0, stream, pool, want, 0, 0, 0);
        let hi = (0, stream, pool, u64::MAX, u64::MAX, u64::MAX, u64::MAX);
        if let Some(&key) = self.free_blocks.range(lo..=hi).next() {
            self.release_block(key);
            return;
        }
        let lo = (0, stream, pool, max_split, 0, 0, 0);
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
        let (id, offset) = (key.5, key.6);
        let whole = self
            .segments
            .get(&id)
            .is_some_and(|s| offset == 0 && s.blocks.len() == 1 && !s.blocks[0].used);
        if !whole {
            return;
        }
        if let Some(s) = self.segments.remove(&id) {
            self.free_blocks.remove(&key);
            self.releasable.remove(&id);
            self.usage.reserved -= s.size;
            self.insert_hole(id, s.size);
        }
    }

    /// The smallest free block of `stream`'s `pool` (default pool id) that
    /// holds `size` (ties: [`FreeBlockOrder`]), as PyTorch's `get_free_block`
    /// takes it, `max_split_size` rules included.
    fn best_fit(&self, stream: u64, pool: Pool, size: u64) -> Option<(u64, u64)> {
        let &(_, _, _, block, _, id, off) = self
            .free_blocks
            .range((0, stream, pool, size, 0, 0, 0)..)
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
        let expandable = self.settings.expandable_segments;
        let seg = self.segments.get_mut(&seg_id).expect("segment");
        let i = seg.index_of(offset);
        self.free_blocks
            .remove(&seg.free_key(seg_id, &seg.blocks[i]));
        let remaining = seg.blocks[i].size - size;
        // Under expandable segments every pool splits down to 512 B.
        let split = match seg.pool {
            _ if expandable => remaining >= MIN_BLOCK_SIZE,
            Pool::Small => remaining >= MIN_BLOCK_SIZE,
            Pool::Large => size < max_split && remaining > SMALL_SIZE,
        };
        if split {
            seg.blocks[i].size = size;
            let rest = Block::new(offset + size, remaining, false);
            seg.blocks.insert(i + 1, rest);
            self.free_blocks.insert(seg.free_key(seg_id, &rest));
        }
        seg.blocks[i].used = true;
        let size = seg.blocks[i].size;
        self.note_segment(seg_id);
        size
    }

    /// Checks the internal bookkeeping (tests).
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut free = BTreeSet::new();
        let (mut reserved, mut allocated) = (0, 0);
        for (&id, seg) in &self.segments {
            let mut end = 0u64;
            let mut mapped = 0;
            for (k, b) in seg.blocks.iter().enumerate() {
                assert_eq!(b.offset, end, "blocks tile the segment");
                end = end.saturating_add(b.size);
                assert!(
                    b.mapped || (seg.expandable && !b.used),
                    "only expandable space is unmapped"
                );
                if b.mapped {
                    mapped += b.size;
                }
                if b.used {
                    allocated += b.size;
                } else if b.mapped {
                    assert!(
                        k == 0 || !seg.blocks[k - 1].is_free(),
                        "free neighbours merged"
                    );
                    free.insert(seg.free_key(id, b));
                } else {
                    assert!(
                        k == 0 || seg.blocks[k - 1].mapped,
                        "unmapped neighbours merged"
                    );
                }
            }
            assert_eq!(end, seg.size);
            assert_eq!(mapped, seg.reserved);
            reserved += seg.reserved;
        }
        assert_eq!(free, self.free_blocks);
        let releasable: BTreeSet<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| {
                !s.expandable && s.pool_id == 0 && s.blocks.len() == 1 && s.blocks[0].is_free()
            })
            .map(|(&a, _)| a)
            .collect();
        assert_eq!(releasable, self.releasable);
        assert_eq!(reserved, self.usage.reserved);
        assert_eq!(allocated, self.usage.allocated);
        let mut prev_end = 0;
        for (&a, s) in self.segments.iter().filter(|(_, s)| !s.expandable) {
            assert!(a >= prev_end, "segments do not overlap");
            prev_end = a + s.size;
        }
    }

    fn bump_peaks(&mut self) {
        let u = self.usage();
        for p in [
            &mut self.peaks.phase,
            &mut self.peaks.step,
            &mut self.peaks.total,
        ] {
            p.allocated = p.allocated.max(u.allocated);
            p.reserved = p.reserved.max(u.reserved);
            p.device = p.device.max(u.device);
        }
    }

    /// Raises the peaks' `device` figure to `bytes` the driver held for an
    /// instant ([`Usage::device`]).
    fn bump_device_peak(&mut self, bytes: u64) {
        for p in [
            &mut self.peaks.phase,
            &mut self.peaks.step,
            &mut self.peaks.total,
        ] {
            p.device = p.device.max(bytes);
        }
    }
}

#[cfg(test)]
mod tests;
