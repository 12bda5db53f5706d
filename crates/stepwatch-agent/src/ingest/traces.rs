//! Step 1's allocator trace on the wire: gathered chunk by chunk within a
//! budget shared by every stream, then replayed off the tokio threads.

use super::*;

/// What allocator traces may hold across all streams: unfinished traces
/// cost memory until their last chunk (a trace never finished once held
/// 36 MB per stream for the stream's life), and each replay a core.
pub struct TraceBudget {
    /// Encoded bytes of traces still being assembled, all streams together.
    pub(super) partial_bytes: std::sync::atomic::AtomicU64,
    /// Most bytes of unfinished traces (`--max-partial-trace-mib`).
    pub(super) max_partial_bytes: u64,
    /// How long a trace may take from its first chunk to its last
    /// (`--partial-trace-timeout`).
    pub(super) timeout: Duration,
    /// Replays running at once (one per core is all they can use).
    pub(super) replays: Semaphore,
}

impl TraceBudget {
    pub fn new(max_partial_bytes: u64, timeout: Duration, concurrent_replays: usize) -> Self {
        Self {
            partial_bytes: std::sync::atomic::AtomicU64::new(0),
            max_partial_bytes,
            timeout,
            replays: Semaphore::new(concurrent_replays.max(1)),
        }
    }
}

/// What a chunk holds once gathered into the core trace, bytes.
pub(super) fn held_bytes(chunk: &pb::AllocatorTraceChunk) -> u64 {
    let blocks: usize = chunk.segments.iter().map(|s| s.blocks.len()).sum();
    let bytes = chunk.events.len() * std::mem::size_of::<AllocatorEvent>()
        + chunk.segments.len() * std::mem::size_of::<SegmentLayout>()
        + blocks * std::mem::size_of::<BlockLayout>();
    bytes as u64
}

/// One stream's share of [`TraceBudget::partial_bytes`], given back when
/// the trace completes, is dropped, or the stream ends.
pub(super) struct HeldTraceBytes<'a> {
    pub(super) budget: &'a TraceBudget,
    pub(super) held: u64,
}

impl HeldTraceBytes<'_> {
    /// Takes `bytes` more; false (nothing taken) past the budget.
    pub(super) fn take(&mut self, bytes: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let max = self.budget.max_partial_bytes;
        let taken = self
            .budget
            .partial_bytes
            .fetch_update(Relaxed, Relaxed, |now| {
                now.checked_add(bytes).filter(|&n| n <= max)
            })
            .is_ok();
        if taken {
            self.held += bytes;
        }
        taken
    }

    pub(super) fn release(&mut self) {
        self.budget.partial_bytes.fetch_sub(
            std::mem::take(&mut self.held),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}

impl Drop for HeldTraceBytes<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// A trace chunk refused, with its `stepwatch_markers_rejected_total` reason.
pub(super) enum Refusal {
    /// Beyond the bounds, or a second trace: the stream ends with the status.
    Fatal(&'static str, Status),
    /// Content the replay cannot use. The trace is optional, so the stream
    /// goes on (ending it would lose the markers sent behind the trace) and
    /// the prediction keeps to the markers; counted and logged.
    Unusable(&'static str, String),
}

/// Chunks of one stream's allocator trace, gathered until the last.
#[derive(Default)]
pub(super) struct TraceAssembly {
    pub(super) trace: AllocatorTrace,
    /// When its first chunk arrived; None once it is done or dropped.
    pub(super) started: Option<Instant>,
    pub(super) blocks: usize,
    /// The rest of an unusable trace is skipped up to its last chunk.
    pub(super) skipping: bool,
    pub(super) complete: bool,
}

impl TraceAssembly {
    /// Drops what was gathered; the rest of the trace is skipped up to its
    /// last chunk.
    pub(super) fn abandon(&mut self) {
        self.trace = AllocatorTrace::default();
        self.started = None;
        self.skipping = true;
    }

    /// Adds a chunk; returns the trace once its last chunk is in.
    pub(super) fn add(
        &mut self,
        chunk: pb::AllocatorTraceChunk,
    ) -> Result<Option<AllocatorTrace>, Refusal> {
        if self.complete {
            return Err(Refusal::Fatal(
                "duplicate_allocator_trace",
                Status::failed_precondition("an allocator trace may be sent once per stream"),
            ));
        }
        self.blocks += chunk.segments.iter().map(|s| s.blocks.len()).sum::<usize>();
        if self.blocks > MAX_TRACE_BLOCKS
            || self.trace.events.len() + chunk.events.len() > MAX_TRACE_EVENTS
        {
            return Err(Refusal::Fatal(
                "allocator_trace_too_large",
                Status::resource_exhausted(format!(
                    "an allocator trace may hold at most {MAX_TRACE_EVENTS} events and \
                     {MAX_TRACE_BLOCKS} blocks"
                )),
            ));
        }
        let last = chunk.last;
        let result = if self.skipping {
            Ok(())
        } else {
            self.append(chunk)
        };
        if let Err((reason, why)) = result {
            self.trace = AllocatorTrace::default();
            self.started = None;
            self.skipping = !last;
            self.complete = last;
            return Err(Refusal::Unusable(reason, why));
        }
        if !last {
            if !self.skipping {
                self.started.get_or_insert_with(Instant::now);
            }
            return Ok(None);
        }
        self.started = None;
        self.complete = true;
        if std::mem::take(&mut self.skipping) {
            return Ok(None);
        }
        Ok(Some(std::mem::take(&mut self.trace)))
    }

    pub(super) fn append(
        &mut self,
        chunk: pb::AllocatorTraceChunk,
    ) -> Result<(), (&'static str, String)> {
        convert::allocator_trace_chunk_from_wire(&mut self.trace, chunk)
            .map_err(|e| (e.reason(), e.to_string()))
    }
}

/// Drops a stream's unfinished trace, gives back the bytes it held, and
/// counts and logs why ([`reject_trace`]).
pub(super) fn abandon_trace(
    state: &AgentState,
    key: &RankKey,
    trace: &mut TraceAssembly,
    held: &mut HeldTraceBytes<'_>,
    reason: &'static str,
    why: &str,
) {
    trace.abandon();
    held.release();
    reject_trace(state, key, reason, why);
}

/// Counts and logs a trace the prediction cannot use; the stream goes on.
pub(super) fn reject_trace(state: &AgentState, key: &RankKey, reason: &'static str, why: &str) {
    state.ingest.reject(reason, 1);
    state.ingest.count_trace("rejected");
    tracing::warn!(
        job = %key.job,
        rank = key.rank,
        reason,
        "allocator trace not used ({why}); the step-2 prediction keeps to the markers"
    );
}

/// Replays a complete trace under `plan` off the async threads and hands
/// the result to the tracker. A trace that arrives after step 2 began is
/// counted, not refused.
pub(super) async fn replay_trace(
    state: &AgentState,
    traces: &TraceBudget,
    stream: StreamOf<'_>,
    trace: Arc<AllocatorTrace>,
    plan: ReplayPlan,
    tx: &mpsc::Sender<Result<pb::AgentMessage, Status>>,
    alerts: &mut RankAlerts,
) -> Result<(), Status> {
    let key = stream.key;
    let events = trace.events.len();
    let _replay_slot = traces.replays.acquire().await;
    let joined = tokio::task::spawn_blocking(move || {
        let replayed = plan.replay(&trace);
        (trace, plan, replayed)
    })
    .await;
    // A failure inside the replay is the agent's bug, not the client's: it
    // is counted and logged, and the rank keeps its stream and its markers
    // prediction.
    let (trace, plan, replayed) = match joined {
        Ok(done) => done,
        Err(e) => {
            tracing::error!(job = %key.job, rank = key.rank, error = %e, "the allocator trace replay failed");
            reject_trace(state, key, "allocator_trace_replay_failed", &e.to_string());
            return Ok(());
        }
    };
    let replay = match replayed {
        Ok(replay) => replay,
        Err(e) => {
            // A setting the model does not follow is no fault of the client's.
            let reason = match e {
                TraceError::UnmodelledSetting(_) => "allocator_trace_unmodelled_setting",
                _ => "allocator_trace_invalid",
            };
            reject_trace(state, key, reason, &e.to_string());
            return Ok(());
        }
    };
    let applied = state.apply_allocator_replay(key, stream.run_id, trace, plan, replay);
    // A trace of a run its process has left is refused like its markers,
    // and counted with the other traces the prediction did not use.
    let applied = applied.map_err(|e| {
        state.ingest.count_trace("rejected");
        run_ended(state, key, &e, 1)
    })?;
    match applied {
        Some(advisories) => {
            state.ingest.count_trace("replayed");
            tracing::info!(
                job = %key.job,
                rank = key.rank,
                events,
                new_segment_bytes = replay.new_segment_bytes,
                reserved_peak_bytes = replay.reserved_peak_bytes,
                "step 2 replayed from the step-1 allocator trace"
            );
            send_advisories(state, key, advisories, tx, alerts);
        }
        None => {
            state.ingest.count_trace("late");
            tracing::info!(job = %key.job, rank = key.rank, "allocator trace arrived after step 2 began; ignored");
        }
    }
    Ok(())
}
