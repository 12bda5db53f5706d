//! State shared by the agent's servers and tasks.

use crate::metrics;
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, MutexGuard};

use prometheus::{IntCounter, IntCounterVec, IntGauge, Registry};
use std::path::Path;

use stepwatch_core::feed::{self, Applied, ReplayPlan};
use stepwatch_core::{
    AllocatorTrace, Journal, MarkerError, ModelFacts, RankInfo, RankKey, RecordEntry, RecordError,
    Step2Replay, Tracker,
};

use crate::record::Recorder;
use stepwatch_gpu::SamplerHandle;
use stepwatch_proto::clock::monotonic_ns;

/// Counters of the ingest path, registered once in the agent's registry.
pub struct IngestMetrics {
    pub markers_received: IntCounter,
    pub markers_rejected: IntCounterVec,
    pub streams_active: IntGauge,
    pub streams_opened: IntCounter,
    pub ranks_evicted: IntCounter,
    pub advisories_sent: IntCounterVec,
    pub journal_writes: IntCounterVec,
    pub journal_restored: IntCounter,
    pub allocator_traces: IntCounterVec,
    pub record_entries: IntCounterVec,
    /// `stepwatch_connections_closed_total{listener,reason}`, for every
    /// listener (see [`crate::listen::Closes`]).
    pub connections_closed: IntCounterVec,
}

/// Every reason `stepwatch_markers_rejected_total` counts, so that each
/// series exists at 0 from the start: an alert on `increase()` then sees
/// the first burst, which a series born at its first refusal hides.
pub const REJECT_REASONS: &[&str] = &[
    // The hello.
    "no_hello",
    "duplicate_hello",
    "hello_timeout",
    "bad_identity",
    "rank_out_of_range",
    "too_many_ranks",
    "too_many_streams",
    "peer_stream_limit",
    "process_stream_limit",
    "stream_memory",
    "rank_held",
    "gpu_not_allocated",
    "slurm_job_not_yours",
    "invalid_model_update",
    "invalid_oom_report",
    // The wire.
    "decode_error",
    "message_too_large",
    "empty_message",
    "rate_limited",
    "internal_error",
    // Markers.
    "batch_too_large",
    "unspecified_kind",
    "step_regressed",
    "no_open_step",
    "out_of_order",
    "clock_regressed",
    "clock_jumped",
    "too_many_phases",
    "memory_budget",
    "implausible_value",
    "run_ended",
    // Step 1's allocator trace (the stream goes on).
    "allocator_trace_not_step_one",
    "allocator_trace_bad_event",
    "allocator_trace_invalid",
    "allocator_trace_unmodelled_setting",
    "allocator_trace_too_large",
    "allocator_trace_over_budget",
    "allocator_trace_timeout",
    "allocator_trace_replay_failed",
    "duplicate_allocator_trace",
];

impl IngestMetrics {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            markers_received: IntCounter::new(
                metrics::MARKERS_RECEIVED_TOTAL.name,
                metrics::MARKERS_RECEIVED_TOTAL.help,
            )?,
            markers_rejected: IntCounterVec::new(
                metrics::MARKERS_REJECTED_TOTAL.opts(),
                &["reason"],
            )?,
            streams_active: IntGauge::new(
                metrics::INGEST_STREAMS_ACTIVE.name,
                metrics::INGEST_STREAMS_ACTIVE.help,
            )?,
            streams_opened: IntCounter::new(
                metrics::INGEST_STREAMS_OPENED_TOTAL.name,
                metrics::INGEST_STREAMS_OPENED_TOTAL.help,
            )?,
            ranks_evicted: IntCounter::new(
                metrics::RANKS_EVICTED_TOTAL.name,
                metrics::RANKS_EVICTED_TOTAL.help,
            )?,
            journal_writes: IntCounterVec::new(metrics::JOURNAL_WRITES_TOTAL.opts(), &["result"])?,
            journal_restored: IntCounter::new(
                metrics::JOURNAL_RESTORED_RANKS_TOTAL.name,
                metrics::JOURNAL_RESTORED_RANKS_TOTAL.help,
            )?,
            allocator_traces: IntCounterVec::new(
                metrics::ALLOCATOR_TRACES_TOTAL.opts(),
                &["result"],
            )?,
            record_entries: IntCounterVec::new(metrics::RECORD_ENTRIES_TOTAL.opts(), &["result"])?,
            advisories_sent: IntCounterVec::new(metrics::ADVISORIES_SENT_TOTAL.opts(), &["kind"])?,
            connections_closed: IntCounterVec::new(
                metrics::CONNECTIONS_CLOSED_TOTAL.opts(),
                &["listener", "reason"],
            )?,
        };
        registry.register(Box::new(m.connections_closed.clone()))?;
        for listener in crate::listen::LISTENERS {
            for reason in crate::listen::CLOSE_REASONS {
                m.connections_closed.with_label_values(&[listener, reason]);
            }
        }
        registry.register(Box::new(m.advisories_sent.clone()))?;
        registry.register(Box::new(m.allocator_traces.clone()))?;
        registry.register(Box::new(m.record_entries.clone()))?;
        registry.register(Box::new(m.journal_writes.clone()))?;
        registry.register(Box::new(m.journal_restored.clone()))?;
        registry.register(Box::new(m.markers_received.clone()))?;
        registry.register(Box::new(m.markers_rejected.clone()))?;
        registry.register(Box::new(m.streams_active.clone()))?;
        registry.register(Box::new(m.streams_opened.clone()))?;
        registry.register(Box::new(m.ranks_evicted.clone()))?;
        // Known label values exist at 0 from the start (see REJECT_REASONS).
        for reason in REJECT_REASONS {
            m.markers_rejected.with_label_values(&[reason]);
        }
        for result in ["replayed", "late", "rejected"] {
            m.allocator_traces.with_label_values(&[result]);
        }
        for result in ["ok", "error"] {
            m.journal_writes.with_label_values(&[result]);
        }
        for kind in [
            stepwatch_proto::v1::AdvisoryKind::Step2OomPredicted,
            stepwatch_proto::v1::AdvisoryKind::LowHeadroom,
            stepwatch_proto::v1::AdvisoryKind::RankDivergence,
            stepwatch_proto::v1::AdvisoryKind::AllocatorRetries,
            stepwatch_proto::v1::AdvisoryKind::LowObservedHeadroom,
            stepwatch_proto::v1::AdvisoryKind::MemoryGrowth,
            stepwatch_proto::v1::AdvisoryKind::ClientClock,
            stepwatch_proto::v1::AdvisoryKind::PredictionFinal,
        ] {
            m.advisories_sent.with_label_values(&[kind.as_str_name()]);
        }
        Ok(m)
    }

    /// Counts a refusal under `reason`.
    pub fn reject(&self, reason: &str, markers: u64) {
        debug_assert!(
            REJECT_REASONS.contains(&reason),
            "reason {reason:?} is missing from REJECT_REASONS"
        );
        self.markers_rejected
            .with_label_values(&[reason])
            .inc_by(markers.max(1));
    }

    /// Counts an allocator trace under `result`: `replayed`, `late` or
    /// `rejected`.
    pub fn count_trace(&self, result: &str) {
        self.allocator_traces.with_label_values(&[result]).inc();
    }
}

/// Everything the servers share.
pub struct AgentState {
    /// Handed over fairly (see [`AgentState::update`]).
    tracker: Mutex<Tracker>,
    pub sampler: SamplerHandle,
    pub registry: Registry,
    pub ingest: IngestMetrics,
    pub node: String,
    pub ingest_listening: AtomicBool,
    /// `--record`, once started.
    recorder: OnceLock<Recorder>,
    /// Which pod holds which GPU (the kubelet's view), for GPU series.
    pub gpu_holders: crate::workload::GpuHolders,
    /// `--rank-phase-series`, once set; `all` until then.
    rank_phase_series: OnceLock<crate::config::RankPhaseSeries>,
    /// Slurm job attribution (`--slurm-job-mapping-dir`), once set.
    pub slurm: OnceLock<crate::slurm::Slurm>,
    /// Each rank's `/metrics` view, kept between scrapes.
    pub(crate) views: crate::export::RankViews,
    /// Moves on every change to the tracker ([`AgentState::generation`]).
    generation: AtomicU64,
    /// Rank reports in flight, once the memory budget is set.
    pub(crate) reports: OnceLock<crate::memory::ReportBudget>,
}

impl AgentState {
    pub fn new(
        tracker: Tracker,
        sampler: SamplerHandle,
        node: String,
        gpu_holders: crate::workload::GpuHolders,
    ) -> anyhow::Result<Arc<Self>> {
        let labels = [("node".to_string(), node.clone())].into_iter().collect();
        let registry = Registry::new_custom(None, Some(labels))?;
        let ingest = IngestMetrics::register(&registry)?;
        Ok(Arc::new(Self {
            tracker: Mutex::new(tracker),
            sampler,
            registry,
            ingest,
            node,
            ingest_listening: AtomicBool::new(false),
            recorder: OnceLock::new(),
            gpu_holders,
            rank_phase_series: OnceLock::new(),
            slurm: OnceLock::new(),
            views: Default::default(),
            generation: Default::default(),
            reports: OnceLock::new(),
        }))
    }

    /// Sets `--rank-phase-series` (once; later calls are ignored).
    pub fn set_rank_phase_series(&self, series: crate::config::RankPhaseSeries) {
        let _ = self.rank_phase_series.set(series);
    }

    /// Which per-phase rank series `/metrics` carries.
    pub fn rank_phase_series(&self) -> crate::config::RankPhaseSeries {
        self.rank_phase_series.get().copied().unwrap_or_default()
    }

    /// Starts `--record` into `path`.
    pub fn start_record(&self, path: &Path, max_bytes: u64) -> anyhow::Result<()> {
        use anyhow::Context;
        crate::create_parent_dir(path, "record")?;
        let recorder = Recorder::create(path, max_bytes, self.ingest.record_entries.clone())
            .with_context(|| format!("cannot create the record file {}", path.display()))?;
        let _ = self.recorder.set(recorder);
        Ok(())
    }

    /// Asks the record writer to push buffered entries to the file.
    pub fn flush_record(&self) {
        if let Some(r) = self.recorder.get() {
            r.flush();
        }
    }

    /// Waits (bounded) until every record entry queued so far is in the file.
    pub fn flush_record_and_wait(&self) {
        if let Some(r) = self.recorder.get() {
            if !r.flush_and_wait() {
                tracing::warn!("the record writer did not finish within its bound; the record may lack its last entries");
            }
        }
    }

    /// A number that moves whenever the tracker may have changed (every
    /// update takes it under the lock): equal numbers, nothing changed.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Reads the tracker under its lock. The one way to see the tracker:
    /// the guard never leaves this type, so no caller can hold it across
    /// I/O, an await or another lock. Keep `f` short (copy out what you
    /// need; analyse one rank, not every rank) and do not call back into
    /// this state from it (the lock is not reentrant).
    pub fn read_tracker<R>(&self, f: impl FnOnce(&Tracker) -> R) -> R {
        let tracker = self.tracker.lock();
        let read = f(&tracker);
        MutexGuard::unlock_fair(tracker);
        read
    }

    /// Changes the tracker under its lock: the only place that does. With
    /// `drain` the sampler's fresh samples go in first; that is the only
    /// time a second lock (the sampler's) is taken while the tracker's is
    /// held, so the order is fixed here, not by convention. What `f` hands
    /// to [`Inputs::record`] is queued for `--record` before the lock is
    /// released (so the record keeps the tracker's order) and written by the
    /// recorder's thread after.
    ///
    /// The lock is handed over fairly, to the thread that waited longest:
    /// released plainly, the thread that just let go (a stream looping over
    /// a flood of large batches) took it again before a woken waiter ran,
    /// and a polite rank's small batch waited seconds behind it.
    fn update<R>(&self, drain: Drain<'_>, f: impl FnOnce(&mut Tracker, &mut Inputs<'_>) -> R) -> R {
        let mut tracker = self.tracker.lock();
        // Under the lock: a reader that sees the new number sees the change.
        self.generation.fetch_add(1, Ordering::Relaxed);
        let mut inputs = Inputs {
            recorder: self.recorder.get(),
        };
        let feed = match drain {
            Drain::Never => false,
            Drain::Always => true,
            Drain::IfInFirstStep(key) => tracker.rank(key).is_some_and(|r| r.in_first_step()),
        };
        if feed {
            feed_samples(&mut tracker, &mut inputs, self.sampler.drain_samples());
        }
        let updated = f(&mut tracker, &mut inputs);
        MutexGuard::unlock_fair(tracker);
        updated
    }

    /// Applies one input through the step model's input path
    /// ([`feed::apply`], as the record replayer and the accuracy harness do)
    /// and, when the tracker took it, queues that same input for `--record`
    /// (a copy of what it borrows, made only while recording).
    /// `input` is given the time under the lock, so times follow the
    /// tracker's order; `flush`: see [`Recorder::write`].
    fn apply<'a>(
        &self,
        drain: Drain<'_>,
        input: impl FnOnce(u64) -> RecordEntry<'a>,
        flush: bool,
    ) -> Result<Applied, RecordError> {
        self.update(drain, |tracker, inputs| {
            let input = input(monotonic_ns());
            let applied = feed::apply(tracker, &input)?;
            inputs.record_with(|| input.into_owned(), flush);
            Ok(applied)
        })
    }

    /// Exports the memory limit and its budgets, and sets the reports'.
    pub fn set_memory_budget(&self, budget: &crate::memory::MemoryBudget) -> anyhow::Result<()> {
        crate::memory::register(budget, &self.registry)?;
        let reports = crate::memory::ReportBudget::new(budget.reports_bytes, &self.registry)?;
        let _ = self.reports.set(reports);
        Ok(())
    }

    /// Registers a stream's hello with the tracker.
    pub fn open_rank(&self, info: RankInfo) -> Result<RankKey, RecordError> {
        let key = info.key();
        let applied = self.apply(
            Drain::Never,
            |at_ns| RecordEntry::Open { at_ns, info },
            true,
        )?;
        let Some(opened) = applied.opened else {
            return Ok(key);
        };
        if let Some(gone) = opened.evicted {
            self.ingest.ranks_evicted.inc();
            tracing::info!(namespace = %gone.namespace, job = %gone.job, rank = gone.rank, "rank table full: evicted the rank that finished longest ago to make room");
        }
        if !opened.superseded.is_empty() {
            let key = &opened.key;
            tracing::info!(namespace = %key.namespace, job = %key.job, dropped = opened.superseded.len(), "a new run of the job started: the earlier run's finished ranks are dropped");
        }
        Ok(opened.key)
    }

    /// Evicts ranks idle for `retention_ns`; returns how many. Recorded
    /// only when it evicted some.
    pub fn evict_idle(&self, retention_ns: u64) -> usize {
        self.update(Drain::Never, |tracker, inputs| {
            let input = RecordEntry::Evict {
                at_ns: monotonic_ns(),
                retention_ns,
            };
            let evicted = feed::apply(tracker, &input).map_or(0, |a| a.evicted);
            if evicted > 0 {
                inputs.record(input, true);
            }
            evicted
        })
    }

    /// Marks one of the rank's streams closed.
    pub fn close_rank(&self, key: &RankKey, broken: bool) {
        let close = |at_ns| RecordEntry::Close {
            at_ns,
            key: key.clone(),
            broken,
        };
        // A close is never refused.
        let _ = self.apply(Drain::Never, close, true);
    }

    /// Moves fresh GPU samples from the sampler into the tracker. Draining
    /// under the tracker lock: drained first, samples could wait for the
    /// lock while a step-1 batch freezes the prediction without them.
    pub fn attribute_samples(&self) {
        self.update(Drain::Always, |_, _| {})
    }

    /// Applies marker batches of one stream's rank, in order, under one
    /// tracker lock, and returns each batch's advisories: one result per
    /// batch applied, up to the first that ends the stream (a clock jump
    /// refuses its batch alone). During step 1 the freshest samples go in
    /// first, because the step-2 prediction is decided on these batches.
    /// The batches are borrowed: copied only for `--record`. `run_id` is
    /// the run the stream's hello named: a batch of a run the rank has
    /// since left is refused ([`stepwatch_core::Tracker::run_markers`]).
    pub fn apply_marker_batches(
        &self,
        key: &RankKey,
        run_id: &str,
        batches: &[Vec<stepwatch_core::Marker>],
    ) -> Vec<Result<Vec<stepwatch_core::Advisory>, RecordError>> {
        self.update(Drain::IfInFirstStep(key), |tracker, inputs| {
            let mut results = Vec::with_capacity(batches.len());
            for markers in batches {
                let input = RecordEntry::Markers {
                    at_ns: monotonic_ns(),
                    key: Cow::Borrowed(key),
                    markers: Cow::Borrowed(markers),
                    run_id: Cow::Borrowed(run_id),
                };
                let applied = feed::apply(tracker, &input);
                let ends = applied.as_ref().is_err_and(RecordError::ends_stream);
                if applied.is_ok() {
                    // Ordered, not flushed: housekeeping flushes every second.
                    inputs.record_with(|| input.into_owned(), false);
                }
                results.push(applied.map(|a| a.advisories));
                if ends {
                    break;
                }
            }
            results
        })
    }

    /// Merges facts a rank sent after its hello (recorded) and returns the
    /// advisories that became due (None once step 2 began) and how the
    /// rank's allocator trace replays under the merged facts. Refused when
    /// the rank has left the stream's run `run_id` (see [`Self::apply_marker_batches`]).
    pub fn update_model_facts(
        &self,
        key: &RankKey,
        run_id: &str,
        update: &ModelFacts,
    ) -> Result<(Option<Vec<stepwatch_core::Advisory>>, ReplayPlan), RecordError> {
        self.update(Drain::Never, |tracker, inputs| {
            let input = RecordEntry::ModelFacts {
                at_ns: monotonic_ns(),
                key: key.clone(),
                update: update.clone(),
                run_id: run_id.to_string(),
            };
            let applied = feed::apply(tracker, &input)?;
            inputs.record(input, true);
            let due = (!applied.late).then_some(applied.advisories);
            Ok((due, ReplayPlan::for_rank(tracker, key)))
        })
    }

    /// Keeps what the client sent with its OOM marker (recorded) and
    /// returns the rank's post-mortem with it.
    pub fn apply_oom_report(
        &self,
        key: &RankKey,
        run_id: &str,
        report: stepwatch_core::OomReport,
    ) -> Result<Option<stepwatch_core::PostMortem>, RecordError> {
        self.update(Drain::Never, |tracker, inputs| {
            let input = RecordEntry::OomReport {
                at_ns: monotonic_ns(),
                key: key.clone(),
                report,
                run_id: run_id.to_string(),
            };
            feed::apply(tracker, &input)?;
            inputs.record(input, true);
            Ok(tracker.post_mortem(key))
        })
    }

    /// How the rank's allocator trace replays, as the tracker stands.
    pub fn replay_plan(&self, key: &RankKey) -> ReplayPlan {
        self.read_tracker(|t| ReplayPlan::for_rank(t, key))
    }

    /// Hands a rank's step-2 replay (of `trace` under `plan`, recorded with
    /// them) to the tracker and returns the advisories it made due; None
    /// when step 2 had already begun. Refused when the rank has left the
    /// stream's run `run_id` (see [`Self::apply_marker_batches`]).
    pub fn apply_allocator_replay(
        &self,
        key: &RankKey,
        run_id: &str,
        trace: Arc<AllocatorTrace>,
        plan: ReplayPlan,
        replay: Step2Replay,
    ) -> Result<Option<Vec<stepwatch_core::Advisory>>, MarkerError> {
        self.update(Drain::Always, |tracker, inputs| {
            let at_ns = monotonic_ns();
            let applied = feed::apply_replay(tracker, key, run_id, replay, at_ns)?;
            // The replay ran outside the lock, so the entry is built only
            // for the record; the trace is copied only while the stream
            // still keeps it for a facts update.
            inputs.record_with(
                || {
                    let trace = Arc::unwrap_or_clone(trace);
                    plan.entry(at_ns, key.clone(), run_id.to_string(), trace)
                },
                true,
            );
            Ok((!applied.late).then_some(applied.advisories))
        })
    }

    /// Feeds the sampler's latest process lists to the tracker, for the
    /// "other processes" term of headroom.
    pub fn update_processes(&self) {
        let snapshot = self.sampler.snapshot(monotonic_ns());
        self.update(Drain::Never, |tracker, inputs| {
            for gpu in &snapshot.gpus {
                let input = RecordEntry::GpuProcesses {
                    gpu: gpu.uuid.clone(),
                    processes: gpu
                        .processes
                        .iter()
                        .map(|p| (p.pid, p.used_bytes))
                        .collect(),
                };
                // Process lists are never refused.
                if feed::apply(tracker, &input).is_ok() {
                    inputs.record(input, false);
                }
            }
        })
    }

    /// Restores ranks from the journal file, if there is one. A journal that
    /// cannot be used (not JSON, not UTF-8, another format version) is moved
    /// aside (`.corrupt`, or `.v<N>` for another version; a name already
    /// taken gets `.1`, `.2` …) and logged, so the
    /// next write does not destroy what an operator may want back; the agent
    /// starts empty rather than not at all.
    pub fn restore_journal(&self, path: &Path) {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the journal; starting without it");
                return;
            }
        };
        let move_aside = |extension: &str, why: &str| match crate::lifecycle::move_aside(
            path, extension,
        ) {
            Ok(aside) => {
                tracing::warn!(path = %path.display(), moved_to = %aside.display(), error = why, "the journal is unreadable; starting without it")
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = why, rename_error = %e, "the journal is unreadable and could not be moved aside; starting without it")
            }
        };
        match serde_json::from_slice::<Journal>(&bytes) {
            Ok(journal) if journal.version != Journal::VERSION => {
                let why = format!(
                    "format version {} (this agent reads version {})",
                    journal.version,
                    Journal::VERSION
                );
                move_aside(&format!("v{}", journal.version), &why);
            }
            Ok(journal) => {
                let listed = journal.ranks.len();
                let n = self.update(Drain::Never, |tracker, _| {
                    tracker.restore(journal, monotonic_ns())
                });
                self.ingest.journal_restored.inc_by(n as u64);
                tracing::info!(path = %path.display(), ranks = n, skipped = listed - n, "restored step history from the journal");
            }
            Err(e) => move_aside("corrupt", &e.to_string()),
        }
    }

    /// Writes the journal whole or not at all (a failed write, on a full
    /// disk, leaves the previous journal and no temporary file).
    pub fn write_journal(&self, path: &Path, keep_steps: usize) {
        // A rank at a time under the lock, so ingest waits for one rank's
        // copy at most; the file is written after the lock is released.
        let keys = self.read_tracker(Tracker::rank_keys);
        let journal = Journal {
            version: Journal::VERSION,
            ranks: keys
                .iter()
                .filter_map(|key| self.read_tracker(|t| t.journal_rank(key, keep_steps)))
                .collect(),
        };
        let result = crate::lifecycle::write_atomically_with(path, |w| {
            serde_json::to_writer(w, &journal).map_err(std::io::Error::from)
        });
        match result {
            Ok(()) => self.ingest.journal_writes.with_label_values(&["ok"]).inc(),
            Err(e) => {
                self.ingest
                    .journal_writes
                    .with_label_values(&["error"])
                    .inc();
                tracing::warn!(path = %path.display(), error = %e, "cannot write the journal");
            }
        }
    }
}

/// Whether [`AgentState::update`] drains the sampler first.
enum Drain<'a> {
    Never,
    Always,
    /// Only while the rank is in its first step.
    IfInFirstStep(&'a RankKey),
}

/// What an update may do besides changing the tracker: queue its input for
/// `--record` (dropped when not recording).
struct Inputs<'a> {
    recorder: Option<&'a Recorder>,
}

impl Inputs<'_> {
    fn record(&mut self, entry: RecordEntry<'static>, flush: bool) {
        self.record_with(|| entry, flush)
    }

    /// [`Inputs::record`] for an entry worth building only when recording.
    fn record_with(&mut self, entry: impl FnOnce() -> RecordEntry<'static>, flush: bool) {
        if let Some(r) = self.recorder {
            r.write(entry(), flush);
        }
    }
}

/// Every GPU's samples go to the tracker's bounded window, also while no
/// rank runs there: a client connects in the background while training
/// starts, so step 1's first markers (timestamped by the client) often
/// reach the agent after samples taken during them, and the sample just
/// before step 1 began is what bounds the overhead beyond the allocator.
fn feed_samples(
    tracker: &mut Tracker,
    inputs: &mut Inputs<'_>,
    drained: Vec<(String, Vec<stepwatch_gpu::Sample>)>,
) {
    for (uuid, samples) in drained {
        let input = RecordEntry::GpuSamples {
            gpu: uuid,
            samples: samples
                .iter()
                .map(|s| stepwatch_core::GpuSample {
                    monotonic_ns: s.monotonic_ns,
                    used_bytes: s.used_bytes,
                    capacity_bytes: s.usable_bytes(),
                })
                .collect(),
        };
        // Samples are never refused.
        if feed::apply(tracker, &input).is_ok() {
            inputs.record(input, false);
        }
    }
}

/// A state for unit tests: an empty tracker and a sampler without NVML.
#[cfg(test)]
pub(crate) fn test_state() -> Arc<AgentState> {
    let sampler = SamplerHandle::start(stepwatch_gpu::SamplerConfig {
        lib_path: Some("/nonexistent/libnvidia-ml.so.1".into()),
        ..stepwatch_gpu::SamplerConfig::default()
    });
    AgentState::new(
        Tracker::new(stepwatch_core::TrackerConfig::default()),
        sampler,
        "test-node".into(),
        crate::workload::GpuHolders::new(std::time::Duration::from_secs(15)),
    )
    .unwrap()
}

#[cfg(test)]
impl AgentState {
    /// Puts GPU samples in the tracker's window as the sampler would (test helper).
    pub(crate) fn test_gpu_samples(&self, gpu: &str, samples: &[stepwatch_core::GpuSample]) {
        let input = RecordEntry::GpuSamples {
            gpu: gpu.into(),
            samples: samples.to_vec(),
        };
        self.apply(Drain::Never, |_| input, false).unwrap();
    }
}

/// Opens rank `rank` of job `job` and begins step 1 (test helper).
#[cfg(test)]
pub(crate) fn test_rank(state: &AgentState, job: &str, rank: u32) -> RankKey {
    let key = state
        .open_rank(RankInfo {
            job: job.into(),
            rank,
            world_size: 64,
            ..RankInfo::default()
        })
        .unwrap();
    state
        .apply_markers(
            &key,
            "",
            &[test_marker(stepwatch_core::MarkerKind::StepBegin, 1, 1_000)],
        )
        .unwrap();
    key
}

#[cfg(test)]
impl AgentState {
    /// One batch through [`AgentState::apply_marker_batches`] (test helper).
    pub(crate) fn apply_markers(
        &self,
        key: &RankKey,
        run_id: &str,
        markers: &[stepwatch_core::Marker],
    ) -> Result<Vec<stepwatch_core::Advisory>, RecordError> {
        let mut results = self.apply_marker_batches(key, run_id, &[markers.to_vec()]);
        results.pop().expect("one result per batch")
    }
}

/// A marker without allocator figures (test helper).
#[cfg(test)]
pub(crate) fn test_marker(
    kind: stepwatch_core::MarkerKind,
    step: u64,
    monotonic_ns: u64,
) -> stepwatch_core::Marker {
    stepwatch_core::Marker::at(kind, step, monotonic_ns, monotonic_ns)
}
