//! How PyTorch sizes requests and segments: rounding, the pools'
//! thresholds and the `PYTORCH_CUDA_ALLOC_CONF` settings the model follows.

use super::*;

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
    /// `expandable_segments:True`: one segment per stream and pool that grows
    /// by mapping pages (2 MiB in the small pool, 20 MiB in the large one)
    /// instead of new `cudaMalloc`s, blocks split down to 512 B, and
    /// `empty_cache()` unmaps the whole pages of free blocks.
    #[serde(default)]
    pub expandable_segments: bool,
    /// Which of equal free blocks serves first: the traced PyTorch
    /// version's rule ([`FreeBlockOrder::of_torch_version`]).
    #[serde(default)]
    pub free_block_order: FreeBlockOrder,
}

/// How PyTorch's best fit breaks a tie between free blocks of one stream,
/// pool and size (the comparator of `BlockPool::blocks` in
/// `CUDACachingAllocator.cpp`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FreeBlockOrder {
    /// The block of the oldest segment, then the lowest address
    /// (`BlockComparatorSizeCounterAddress`: each `cudaMalloc` or new
    /// expandable segment takes the next count, and its blocks inherit it).
    /// PyTorch 2.13 and later; the default, for a version not known.
    #[default]
    SegmentAge,
    /// The lowest address (`BlockComparatorSize` comparing `ptr`): PyTorch
    /// up to 2.12.
    Address,
}

impl FreeBlockOrder {
    /// The rule of a PyTorch version string as `torch.__version__` writes
    /// it ("2.11.0+cu128", "2.13.0a0+git1234", "2.4.1"); None when it is
    /// not one.
    pub fn of_torch_version(version: &str) -> Option<Self> {
        let mut parts = version.trim().split(['.', '+']);
        let major: u64 = parts.next()?.parse().ok()?;
        let minor: u64 = parts
            .next()?
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .ok()?;
        Some(if (major, minor) >= (2, 13) {
            FreeBlockOrder::SegmentAge
        } else {
            FreeBlockOrder::Address
        })
    }
}

impl AllocatorSettings {
    /// The divisions for a request of `bytes` (PyTorch's
    /// `roundup_power2_divisions(size)`).
    pub(super) fn divisions(&self, bytes: u64) -> u64 {
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

    pub(super) fn max_split(&self) -> u64 {
        self.max_split_size.unwrap_or(u64::MAX)
    }
}

/// PyTorch's `roundup_power2_next_division`: `size` rounded up to the next of
/// `divisions` equal steps between the powers of two around it.
pub(super) fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
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

/// The page an expandable segment of `pool` grows and shrinks by: 2 MiB in
/// the small pool, 20 MiB in the large one (PyTorch's `segment_size_`).
pub(super) fn expandable_page(pool: Pool) -> u64 {
    match pool {
        Pool::Small => SMALL_BUFFER,
        Pool::Large => LARGE_BUFFER,
    }
}

/// Size of the segment `cudaMalloc`ed when no cached block fits a request of
/// `bytes` (rounded or not).
pub fn segment_size(bytes: u64) -> u64 {
    segment_size_of_rounded(round_size(bytes))
}

/// [`segment_size`] of a size already rounded (PyTorch's
/// `get_allocation_size`).
pub(super) fn segment_size_of_rounded(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}
