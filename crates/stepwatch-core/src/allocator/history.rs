//! Checks the model against an allocator history a real process recorded
//! (`torch.cuda.memory._record_memory_history`, dumped with
//! `_dump_snapshot`): the segments when the history began and its events.
//! `bench/alloc_snapshots.py` extracts them from a snapshot pickle, and the
//! `snapshot_check` example runs [`History::check`] on them.

use super::*;

/// What a recorded event did (a snapshot's `device_traces` action;
/// `free_completed` is the free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordedAction {
    /// A block was handed out.
    Alloc,
    /// A block went back to the cache.
    Free,
    /// `cudaMalloc` made a segment.
    SegmentAlloc,
    /// A segment went back to the driver (`empty_cache()`).
    SegmentFree,
}

/// One event of a recorded history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedEvent {
    /// What it did.
    pub action: RecordedAction,
    /// The block's or segment's address.
    pub address: u64,
    /// Requested bytes (a block) or the segment's bytes.
    pub size: u64,
    /// The stream it was made on.
    #[serde(default)]
    pub stream: u64,
}

/// A recorded history: the segments when it began, then its events.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    /// The segments when the first event happened.
    pub start: Vec<SegmentLayout>,
    /// Oldest first.
    pub events: Vec<RecordedEvent>,
}

/// How the model compares with what the recorded allocator did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HistoryCheck {
    /// Allocations in the history.
    pub allocations: u64,
    /// Of those, how many the model places where the real allocator did,
    /// each from the real state just before it: in the same cached block,
    /// or in a new segment where the real one made one.
    pub placed_right: u64,
    /// Reserved bytes at the history's peak and end, as recorded.
    pub real_peak: u64,
    /// See `real_peak`.
    pub real_end: u64,
    /// The same, with the model placing every allocation itself (and
    /// releasing its free segments where the history released segments).
    pub model_peak: u64,
    /// See `model_peak`.
    pub model_end: u64,
}

impl HistoryCheck {
    /// Reserved bytes at the peak and the end as recorded.
    pub fn reserved_exact(&self) -> bool {
        self.model_peak == self.real_peak && self.model_end == self.real_end
    }
}

/// A history that does not lead from its start to its events (events lost
/// from a full ring buffer, or a history of another allocator).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HistoryError {
    /// The starting segments are inconsistent.
    #[error("the starting segments: {0}")]
    Layout(#[from] LayoutError),
    /// An allocation where the state holds no free block.
    #[error("event {index}: no free block starts at {address:#x}")]
    NoFreeBlock {
        /// Position in the history.
        index: usize,
        /// The allocation's address.
        address: u64,
    },
    /// A segment made on top of another.
    #[error("event {index}: segment at {address:#x} overlaps another")]
    SegmentOverlap {
        /// Position in the history.
        index: usize,
        /// The segment's address.
        address: u64,
    },
    /// A released segment that is not there whole and free.
    #[error("event {index}: segment at {address:#x} is not there whole and free")]
    SegmentNotFree {
        /// Position in the history.
        index: usize,
        /// The segment's address.
        address: u64,
    },
}

impl History {
    /// Checks the model under `settings` against the history.
    pub fn check(&self, settings: AllocatorSettings) -> Result<HistoryCheck, HistoryError> {
        let mut check = self.placement(settings)?;
        self.reserved(settings, &mut check)?;
        Ok(check)
    }

    /// Each allocation's place, from the real state before it.
    fn placement(&self, settings: AllocatorSettings) -> Result<HistoryCheck, HistoryError> {
        let (mut a, live) = CachingAllocator::from_layout_with(&self.start, settings)?;
        let mut live: HashMap<u64, AllocId> = live.into_iter().collect();
        let mut check = HistoryCheck::default();
        // A segment is made for the allocation that follows it: applied
        // after the model has chosen.
        let mut made: Option<&RecordedEvent> = None;
        for (index, e) in self.events.iter().enumerate() {
            match e.action {
                RecordedAction::SegmentAlloc => {
                    if let Some(s) = made.replace(e) {
                        add_recorded_segment(&mut a, index, s)?;
                    }
                }
                RecordedAction::Alloc => {
                    let chosen = a.cached_fit(e.size, e.stream);
                    let new_segment = made.is_some_and(|s| s.address == e.address);
                    check.allocations += 1;
                    check.placed_right += u64::from(if new_segment {
                        chosen.is_none()
                    } else {
                        chosen == Some(e.address)
                    });
                    if let Some(s) = made.take() {
                        add_recorded_segment(&mut a, index, s)?;
                    }
                    let id = a
                        .malloc_at(e.size, e.address)
                        .ok_or(HistoryError::NoFreeBlock {
                            index,
                            address: e.address,
                        })?;
                    live.insert(e.address, id);
                }
                RecordedAction::Free => {
                    if let Some(id) = live.remove(&e.address) {
                        a.free(id);
                    }
                }
                RecordedAction::SegmentFree => {
                    if !a.release_segment_at(e.address) {
                        return Err(HistoryError::SegmentNotFree {
                            index,
                            address: e.address,
                        });
                    }
                }
            }
        }
        Ok(check)
    }

    /// Reserved bytes with the model placing everything itself.
    fn reserved(
        &self,
        settings: AllocatorSettings,
        check: &mut HistoryCheck,
    ) -> Result<(), HistoryError> {
        let (mut a, live) = CachingAllocator::from_layout_with(&self.start, settings)?;
        let mut live: HashMap<u64, AllocId> = live.into_iter().collect();
        let mut real = a.reserved();
        check.real_peak = real;
        check.model_peak = real;
        let mut releasing = false;
        for e in &self.events {
            match e.action {
                RecordedAction::Alloc => {
                    // No limit: the model never has to release to fit.
                    if let Ok(id) = a.malloc_on(e.size, e.stream, u64::MAX) {
                        live.insert(e.address, id);
                    }
                }
                RecordedAction::Free => {
                    if let Some(id) = live.remove(&e.address) {
                        a.free(id);
                    }
                }
                RecordedAction::SegmentAlloc => real = real.saturating_add(e.size),
                RecordedAction::SegmentFree => {
                    real = real.saturating_sub(e.size);
                    // One `empty_cache()` releases a run of segments.
                    if !releasing {
                        a.release_free_segments();
                    }
                }
            }
            releasing = e.action == RecordedAction::SegmentFree;
            check.real_peak = check.real_peak.max(real);
            check.model_peak = check.model_peak.max(a.reserved());
        }
        check.real_end = real;
        check.model_end = a.reserved();
        Ok(())
    }
}

/// Applies a recorded `segment_alloc`: 2 MiB segments are the small pool's
/// (a large-pool segment is 20 MiB, or 10 MiB and more).
fn add_recorded_segment(
    a: &mut CachingAllocator,
    index: usize,
    s: &RecordedEvent,
) -> Result<(), HistoryError> {
    let pool = if s.size == SMALL_BUFFER {
        Pool::Small
    } else {
        Pool::Large
    };
    a.add_segment_at(s.address, s.size, pool, s.stream)
        .map_err(|_| HistoryError::SegmentOverlap {
            index,
            address: s.address,
        })
}
