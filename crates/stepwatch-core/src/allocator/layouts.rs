//! Segment layouts: the allocator's segments and blocks as a snapshot
//! (`torch.cuda.memory_snapshot()`) shows them, taken from a real process
//! or from the model.

use super::*;

/// One block of a [`SegmentLayout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockLayout {
    /// Bytes.
    pub size: u64,
    /// Holds a live allocation (false: free, cached).
    pub allocated: bool,
    /// Holds a parameter's gradient (`.grad`), as the client found it when
    /// it took the snapshot (step 1's optimizer-marker layouts; traces do
    /// not set it). Gradients set to None between steps are gone before
    /// step 2's forward, whose requests their blocks then serve
    /// (`layout`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub gradient: bool,
}

pub(super) fn is_zero(n: &u64) -> bool {
    *n == 0
}

pub(super) fn is_false(b: &bool) -> bool {
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

    /// The segment with the blocks `free(address, block)` picks freed and
    /// merged with free neighbours, as the caching allocator coalesces a
    /// freed block: what a layout becomes once those tensors are gone.
    pub fn freeing(&self, free: impl Fn(u64, &BlockLayout) -> bool) -> SegmentLayout {
        let mut blocks: Vec<BlockLayout> = Vec::with_capacity(self.blocks.len());
        let mut address = self.address;
        for b in &self.blocks {
            let b = if free(address, b) {
                BlockLayout {
                    size: b.size,
                    allocated: false,
                    gradient: false,
                }
            } else {
                *b
            };
            address += b.size;
            match blocks.last_mut() {
                Some(last) if !last.allocated && !b.allocated => last.size += b.size,
                _ => blocks.push(b),
            }
        }
        SegmentLayout {
            blocks,
            ..self.clone()
        }
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
