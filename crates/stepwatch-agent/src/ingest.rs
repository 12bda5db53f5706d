//! The gRPC ingest adapter: proto messages in, tracker calls out.
//!
//! Validation of content lives in stepwatch-core; this file checks only what
//! is about the wire (message order, sizes, rates) and maps errors to gRPC
//! statuses that name the problem.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stepwatch_core::allocator::{BlockLayout, SegmentLayout};
use stepwatch_core::feed::ReplayPlan;
use stepwatch_core::{
    Advisory, AllocatorEvent, AllocatorTrace, MarkerError, MarkerKind, OpenError, RankInfo,
    RankKey, RecordError,
};
use stepwatch_core::{TraceError, MAX_TRACE_BLOCKS, MAX_TRACE_EVENTS};
use stepwatch_proto::convert;
use stepwatch_proto::v1::{self as pb, client_message::Kind, ingest_server::Ingest};
use stepwatch_proto::MAX_MARKERS_PER_BATCH;
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status, Streaming};

use crate::alerts::{Alerter, RankAlerts};
use crate::state::AgentState;
use crate::workload::{Attestation, VolumePod, WorkloadResolver};

/// The `Ingest` service.
#[derive(Clone)]
pub struct IngestService {
    state: Arc<AgentState>,
    workload: Arc<WorkloadResolver>,
    streams: Arc<Semaphore>,
    limits: IngestLimits,
    traces: Arc<TraceBudget>,
    /// Posts the advisories' alerts to Alertmanager (`--alertmanager-url`).
    alerter: Alerter,
    /// The pod whose CSI volume this service listens in (None: the shared
    /// socket or TCP, where the peer is looked up by PID).
    volume: Option<VolumeBinding>,
}

/// Ties a listener to the pod a CSI volume was published for: every stream
/// on it is that pod's, and ends when the volume is unpublished.
#[derive(Clone)]
pub struct VolumeBinding {
    /// The pod, as the kubelet named it.
    pub pod: Arc<VolumePod>,
    /// Turns true when the volume is unpublished.
    pub gone: tokio::sync::watch::Receiver<bool>,
}

/// What allocator traces may hold across all streams: unfinished traces
/// cost memory until their last chunk (a trace never finished once held
/// 36 MB per stream for the stream's life), and each replay a core.
pub struct TraceBudget {
    /// Encoded bytes of traces still being assembled, all streams together.
    partial_bytes: std::sync::atomic::AtomicU64,
    /// Most bytes of unfinished traces (`--max-partial-trace-mib`).
    max_partial_bytes: u64,
    /// How long a trace may take from its first chunk to its last
    /// (`--partial-trace-timeout`).
    timeout: Duration,
    /// Replays running at once (one per core is all they can use).
    replays: Semaphore,
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
fn held_bytes(chunk: &pb::AllocatorTraceChunk) -> u64 {
    let blocks: usize = chunk.segments.iter().map(|s| s.blocks.len()).sum();
    let bytes = chunk.events.len() * std::mem::size_of::<AllocatorEvent>()
        + chunk.segments.len() * std::mem::size_of::<SegmentLayout>()
        + blocks * std::mem::size_of::<BlockLayout>();
    bytes as u64
}

/// One stream's share of [`TraceBudget::partial_bytes`], given back when
/// the trace completes, is dropped, or the stream ends.
struct HeldTraceBytes<'a> {
    budget: &'a TraceBudget,
    held: u64,
}

impl HeldTraceBytes<'_> {
    /// Takes `bytes` more; false (nothing taken) past the budget.
    fn take(&mut self, bytes: u64) -> bool {
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

    fn release(&mut self) {
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

/// Per-stream bounds of the ingest service (flags of the same names).
#[derive(Debug, Clone, Copy)]
pub struct IngestLimits {
    /// Streams that said hello, at once (`--max-streams`).
    pub max_streams: usize,
    /// Markers per second per stream (`--max-marker-rate`).
    pub max_marker_rate: f64,
    /// How long a new stream may take to send its hello (`--hello-timeout`):
    /// a stream that never says hello must not hold anything for long.
    pub hello_timeout: Duration,
}

impl IngestService {
    pub fn new(
        state: Arc<AgentState>,
        workload: Arc<WorkloadResolver>,
        alerter: Alerter,
        limits: IngestLimits,
        traces: Arc<TraceBudget>,
    ) -> Self {
        Self {
            state,
            workload,
            alerter,
            streams: Arc::new(Semaphore::new(limits.max_streams)),
            limits,
            traces,
            volume: None,
        }
    }

    /// The same service (sharing its stream budget) for the socket in one
    /// pod's CSI volume: the pod is taken from `volume`, not from the peer.
    pub fn bound_to(&self, volume: VolumeBinding) -> Self {
        Self {
            volume: Some(volume),
            ..self.clone()
        }
    }
}

type AgentStream = Pin<Box<dyn Stream<Item = Result<pb::AgentMessage, Status>> + Send>>;

#[tonic::async_trait]
impl Ingest for IngestService {
    type StreamStream = AgentStream;

    async fn stream(
        &self,
        request: Request<Streaming<pb::ClientMessage>>,
    ) -> Result<Response<AgentStream>, Status> {
        // SO_PEERCRED: the sender's PID in our namespace, when on the Unix socket.
        let peer_pid = request
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|info| info.peer_cred)
            .and_then(|cred| cred.pid())
            .and_then(usable_peer_pid);
        if self.volume.as_ref().is_some_and(|v| *v.gone.borrow()) {
            return Err(Status::unavailable(
                "this pod's stepwatch volume has been unpublished",
            ));
        }
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let state = self.state.clone();
        let workload = self.workload.clone();
        let streams = self.streams.clone();
        let limits = self.limits;
        let traces = self.traces.clone();
        let volume = self.volume.clone();
        let alerter = self.alerter.clone();
        tokio::spawn(async move {
            state.ingest.streams_opened.inc();
            let served = tokio::spawn({
                let (state, tx) = (state.clone(), tx.clone());
                async move {
                    let peer = Peer {
                        pid: peer_pid,
                        workload: &workload,
                        volume,
                        alerter: &alerter,
                    };
                    serve_stream(&state, &streams, &traces, inbound, peer, limits, &tx).await
                }
            })
            .await;
            let result = match served {
                Ok(result) => result,
                // A bug must not pass unseen: counted, logged, and the client told.
                Err(e) => {
                    tracing::error!(error = %e, "a stream's handler failed; the stream is ended");
                    Err(refuse(
                        &state,
                        "internal_error",
                        1,
                        Status::internal("the agent failed to handle this stream; see its log"),
                    ))
                }
            };
            if let Err(status) = result {
                tracing::debug!(code = ?status.code(), message = status.message(), "stream ended with an error");
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Who is on the other end of a stream, as far as the agent can tell.
struct Peer<'a> {
    /// SO_PEERCRED's PID, on the Unix socket.
    pid: Option<u32>,
    workload: &'a WorkloadResolver,
    /// The pod's CSI volume the stream came in through, if any.
    volume: Option<VolumeBinding>,
    /// Where the rank's alerts go.
    alerter: &'a Alerter,
}

async fn serve_stream(
    state: &AgentState,
    streams: &Arc<Semaphore>,
    traces: &TraceBudget,
    mut inbound: Streaming<pb::ClientMessage>,
    peer: Peer<'_>,
    limits: IngestLimits,
    tx: &mpsc::Sender<Result<pb::AgentMessage, Status>>,
) -> Result<(), Status> {
    // The first message is the hello: one too large or that does not decode
    // is refused for good, since the process opens every stream with it.
    let Ok(first) = tokio::time::timeout(
        limits.hello_timeout,
        next_message(state, &mut inbound, Retry::Never),
    )
    .await
    else {
        return Err(refuse(
            state,
            "hello_timeout",
            1,
            Status::deadline_exceeded(format!(
                "no Hello within {:?} of opening the stream (--hello-timeout)",
                limits.hello_timeout
            )),
        ));
    };
    // The stream's slot is taken at the hello: streams that never say one
    // cannot lock well-behaved ranks out.
    let Ok(_slot) = streams.clone().try_acquire_owned() else {
        return Err(refuse(
            state,
            "too_many_streams",
            1,
            Status::resource_exhausted(
                "the agent has reached its limit of concurrent streams (--max-streams)",
            ),
        ));
    };
    state.ingest.streams_active.inc();
    let _active = scopeguard_dec(&state.ingest.streams_active);
    let max_rate = limits.max_marker_rate;
    let hello = match first? {
        Some(pb::ClientMessage {
            kind: Some(Kind::Hello(hello)),
        }) => hello,
        // A client that opens a stream without a hello does so every time.
        Some(_) => {
            return Err(refuse_as(
                state,
                "no_hello",
                1,
                Retry::Never,
                Status::failed_precondition("the first message on a stream must be a Hello"),
            ));
        }
        None => return Ok(()),
    };
    let mut info = rank_info(hello, peer.pid);
    let attestation = match &peer.volume {
        Some(v) => peer.workload.attest_volume(&v.pod, peer.pid).await,
        None => peer.workload.attest(peer.pid).await,
    };
    apply_attestation(state, peer.workload, &mut info, attestation)?;
    // Slurm (--slurm-job-mapping-dir): the job a hello names must be the peer's.
    if let (Some(slurm), None) = (state.slurm.get(), &peer.volume) {
        if let Err(r) = slurm.attest(&mut info, &state.sampler, peer.pid).await {
            let retry = [Retry::Later, Retry::Never][usize::from(r.for_good)];
            let status = Status::permission_denied(r.message);
            return Err(refuse_as(state, r.reason, 1, retry, status));
        }
    }
    // A hello that arrives after its pod's volume went opens no rank.
    if peer.volume.as_ref().is_some_and(|v| *v.gone.borrow()) {
        return Err(Status::unavailable(
            "this pod's stepwatch volume was unpublished",
        ));
    }
    let key = match state.open_rank(info.clone()) {
        Ok(key) => key,
        Err(e) => {
            let reason = e.reason();
            // A hello that breaks the contract is this process's on every
            // stream; one naming a left run is refused for that run.
            let retry = match &e {
                RecordError::Open(OpenError::Invalid(_)) => Retry::Never,
                RecordError::Open(e) if e.refuses_the_run() => Retry::Never,
                _ => Retry::Later,
            };
            return Err(refuse_as(
                state,
                reason,
                1,
                retry,
                match e {
                    RecordError::Open(OpenError::Invalid(e)) => {
                        Status::invalid_argument(format!("invalid hello: {e}"))
                    }
                    RecordError::Open(e @ OpenError::TooManyRanks(_)) => {
                        Status::resource_exhausted(e.to_string())
                    }
                    RecordError::Open(e @ OpenError::RankHeld { .. }) => {
                        tracing::warn!(namespace = %info.namespace, job = %info.job, rank = info.rank, pid = info.pid, pod = %info.pod, "refused a hello for a rank another process (or a newer run of this one) holds: {e}");
                        Status::already_exists(e.to_string())
                    }
                    e => Status::internal(format!("the hello could not be applied: {e}")),
                },
            ));
        }
    };
    tracing::info!(namespace = %key.namespace, job = %key.job, rank = key.rank, pid = info.pid, pod = %info.pod, attested = info.attested, gpu = %info.gpu_uuid, "rank connected");
    let mut alerts = peer.alerter.rank(&key, &info);
    let stream = StreamOf {
        key: &key,
        run_id: &info.run_id,
    };
    let receive = receive_markers(
        state,
        traces,
        stream,
        &mut inbound,
        max_rate,
        tx,
        &mut alerts,
    );
    let result = match peer.volume {
        // The pod's volume going away ends its streams; the rank closes as
        // for any other end of stream.
        Some(VolumeBinding { mut gone, .. }) => tokio::select! {
            result = receive => result,
            _ = volume_unpublished(&mut gone) => Err(Status::unavailable(
                "this pod's stepwatch volume was unpublished",
            )),
        },
        None => receive.await,
    };
    state.close_rank(&key);
    alerts.close();
    tracing::info!(job = %key.job, rank = key.rank, "rank disconnected");
    result
}

/// Resolves once the volume is unpublished; never when its sender is just
/// dropped (the agent stopping, not the pod's volume going).
async fn volume_unpublished(gone: &mut tokio::sync::watch::Receiver<bool>) {
    if gone.wait_for(|g| *g).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Whose markers a stream carries: the rank, and the run its hello named.
#[derive(Clone, Copy)]
struct StreamOf<'a> {
    key: &'a RankKey,
    run_id: &'a str,
}

async fn receive_markers(
    state: &AgentState,
    traces: &TraceBudget,
    stream: StreamOf<'_>,
    inbound: &mut Streaming<pb::ClientMessage>,
    max_rate: f64,
    tx: &mpsc::Sender<Result<pb::AgentMessage, Status>>,
    alerts: &mut RankAlerts,
) -> Result<(), Status> {
    let key = stream.key;
    let mut bucket = TokenBucket::new(max_rate);
    // Step 1's trace and the plan it was last replayed under, kept until
    // step 2 begins: facts that arrive after it (gradients kept, DDP's
    // bucket rebuild) change how it replays.
    let mut step1_trace: Option<(Arc<AllocatorTrace>, ReplayPlan)> = None;
    let mut markers = Vec::new();
    let mut trace = TraceAssembly::default();
    let mut held = HeldTraceBytes {
        budget: traces,
        held: 0,
    };
    while let Some(message) = next_message(state, inbound, Retry::Later).await? {
        // A trace begun too long ago gives its memory back; the prediction
        // keeps to the markers.
        if trace.started.is_some_and(|t| t.elapsed() > traces.timeout) {
            trace.abandon();
            held.release();
            let why = format!(
                "the allocator trace was not finished within {:?} of its first chunk (--partial-trace-timeout)",
                traces.timeout
            );
            reject_trace(state, key, "allocator_trace_timeout", &why);
        }
        let batch = match message.kind {
            Some(Kind::Markers(batch)) => batch,
            Some(Kind::AllocatorTrace(chunk)) => {
                // A chunk costs like a marker, so a flood of them is bounded too.
                if !bucket.take(1.0) {
                    return Err(refuse(
                        state,
                        "rate_limited",
                        1,
                        Status::resource_exhausted(format!(
                            "more than {max_rate} messages/s on one stream (--max-marker-rate)"
                        )),
                    ));
                }
                if !trace.skipping && !trace.complete && !held.take(held_bytes(&chunk)) {
                    let last = chunk.last;
                    trace.abandon();
                    trace.complete = last;
                    held.release();
                    let why = format!(
                        "unfinished allocator traces of all streams would hold more than {} bytes (--max-partial-trace-mib)",
                        traces.max_partial_bytes
                    );
                    reject_trace(state, key, "allocator_trace_over_budget", &why);
                    continue;
                }
                match trace.add(chunk) {
                    Ok(Some(complete)) => {
                        held.release();
                        let complete = Arc::new(complete);
                        let plan = state.replay_plan(key);
                        step1_trace = Some((Arc::clone(&complete), plan.clone()));
                        replay_trace(state, traces, stream, complete, plan, tx, alerts).await?;
                    }
                    Ok(None) => {}
                    Err(Refusal::Unusable(reason, why)) => {
                        held.release();
                        reject_trace(state, key, reason, &why);
                    }
                    Err(Refusal::Fatal(reason, status)) => {
                        return Err(refuse(state, reason, 1, status));
                    }
                }
                continue;
            }
            Some(Kind::ModelUpdate(update)) => {
                if !bucket.take(1.0) {
                    return Err(refuse(
                        state,
                        "rate_limited",
                        1,
                        Status::resource_exhausted(format!(
                            "more than {max_rate} messages/s on one stream (--max-marker-rate)"
                        )),
                    ));
                }
                let update = convert::model_facts_from_wire(update);
                let (due, plan) = match state.update_model_facts(key, stream.run_id, &update) {
                    Ok(applied) => applied,
                    Err(RecordError::Markers(e @ MarkerError::RunEnded { .. })) => {
                        return Err(run_ended(state, key, &e, 1));
                    }
                    Err(e) => {
                        return Err(refuse(
                            state,
                            e.reason(),
                            1,
                            Status::invalid_argument(format!(
                                "model facts update refused for job {} rank {}: {}",
                                key.job,
                                key.rank,
                                e.refusal()
                            )),
                        ));
                    }
                };
                tracing::info!(job = %key.job, rank = key.rank, update = ?update, "model facts updated after the hello");
                match due {
                    Some(advisories) => send_advisories(state, key, advisories, tx, alerts),
                    None => step1_trace = None,
                }
                // The trace replays again when the facts change its plan.
                if let Some((trace, replayed)) = &mut step1_trace {
                    if !plan.replays_like(replayed) {
                        *replayed = plan.clone();
                        let trace = Arc::clone(trace);
                        replay_trace(state, traces, stream, trace, plan, tx, alerts).await?;
                    }
                }
                continue;
            }
            Some(Kind::Hello(_)) => {
                return Err(refuse(
                    state,
                    "duplicate_hello",
                    1,
                    Status::failed_precondition("Hello may only be the first message of a stream"),
                ));
            }
            None => {
                return Err(refuse(
                    state,
                    "empty_message",
                    1,
                    Status::invalid_argument("ClientMessage has no content"),
                ));
            }
        };
        let n = batch.markers.len() as u64;
        if batch.markers.len() > MAX_MARKERS_PER_BATCH {
            return Err(refuse(
                state,
                "batch_too_large",
                n,
                Status::invalid_argument(format!(
                    "a MarkerBatch holds {} markers; at most {MAX_MARKERS_PER_BATCH} are allowed",
                    batch.markers.len()
                )),
            ));
        }
        // An empty batch costs one, so a flood of them is bounded too.
        if !bucket.take(n.max(1) as f64) {
            return Err(refuse(
                state,
                "rate_limited",
                n,
                Status::resource_exhausted(format!(
                    "more than {max_rate} markers/s on one stream (--max-marker-rate)"
                )),
            ));
        }
        markers.clear();
        for m in batch.markers {
            match convert::marker_from_wire(m) {
                Ok(m) => markers.push(m),
                Err(e) => {
                    let status = Status::invalid_argument(e.to_string());
                    return Err(refuse(state, e.reason(), n, status));
                }
            }
        }
        if markers.iter().any(|m| m.step > 1) {
            step1_trace = None;
        }
        let applied = state.apply_markers(key, stream.run_id, &markers);
        match applied {
            Ok(advisories) => {
                state.ingest.markers_received.inc_by(n);
                // The one thing about a rank an operator reads the log for.
                for m in markers.iter().filter(|m| m.kind == MarkerKind::Oom) {
                    tracing::warn!(
                        namespace = %key.namespace,
                        job = %key.job,
                        rank = key.rank,
                        step = m.step,
                        "rank died of a CUDA out-of-memory error in step {}",
                        m.step
                    );
                }
                send_advisories(state, key, advisories, tx, alerts);
                alerts.markers(&markers);
            }
            Err(RecordError::Markers(e @ MarkerError::RunEnded { .. })) => {
                return Err(run_ended(state, key, &e, n));
            }
            Err(e) => {
                return Err(refuse(
                    state,
                    e.reason(),
                    n,
                    Status::invalid_argument(format!(
                        "marker rejected for job {} rank {}: {}",
                        key.job,
                        key.rank,
                        e.refusal()
                    )),
                ));
            }
        }
    }
    Ok(())
}

fn send_advisories(
    state: &AgentState,
    key: &RankKey,
    advisories: Vec<Advisory>,
    tx: &mpsc::Sender<Result<pb::AgentMessage, Status>>,
    alerts: &mut RankAlerts,
) {
    // To Alertmanager first: the page is what the prediction is for.
    alerts.advise(&advisories);
    for advisory in advisories {
        // The message carries the figures in GB and, for a step-2 OOM, what
        // would fit; the kind names the advisory for log queries.
        let kind = convert::advisory_kind_to_wire(advisory.kind).as_str_name();
        tracing::warn!(
            job = %key.job,
            rank = key.rank,
            step = advisory.step,
            kind,
            "{}",
            advisory.message
        );
        state
            .ingest
            .advisories_sent
            .with_label_values(&[kind])
            .inc();
        let message = pb::AgentMessage {
            kind: Some(pb::agent_message::Kind::Advisory(
                convert::advisory_to_wire(&advisory),
            )),
        };
        // Never wait on a slow client; the metric carries the news too.
        let _ = tx.try_send(Ok(message));
    }
}

/// The next client message. Refusals at the wire (a message over the size
/// limit, bytes that are not a ClientMessage) are counted like every other
/// refusal, named with `retry`, and a message that does not decode is the
/// client's error (INVALID_ARGUMENT), not the agent's (tonic says INTERNAL).
async fn next_message(
    state: &AgentState,
    inbound: &mut Streaming<pb::ClientMessage>,
    retry: Retry,
) -> Result<Option<pb::ClientMessage>, Status> {
    inbound
        .message()
        .await
        .map_err(|status| match wire_refusal(&status) {
            Some(reason) => {
                let status = match reason {
                    "decode_error" => Status::invalid_argument(status.message().to_string()),
                    _ => status,
                };
                refuse_as(state, reason, 1, retry, status)
            }
            None => status,
        })
}

/// The `stepwatch_markers_rejected_total` reason of a status tonic raised
/// while reading a message; None for the client going away.
fn wire_refusal(status: &Status) -> Option<&'static str> {
    match status.code() {
        tonic::Code::OutOfRange if status.message().contains("message length too large") => {
            Some("message_too_large")
        }
        tonic::Code::Internal
            if status
                .message()
                .starts_with("failed to decode Protobuf message") =>
        {
            Some("decode_error")
        }
        _ => None,
    }
}

/// Decrements the gauge when dropped, however the stream ends.
fn scopeguard_dec(gauge: &prometheus::IntGauge) -> impl Drop + '_ {
    struct Dec<'a>(&'a prometheus::IntGauge);
    impl Drop for Dec<'_> {
        fn drop(&mut self) {
            self.0.dec();
        }
    }
    Dec(gauge)
}

/// A trace chunk refused, with its `stepwatch_markers_rejected_total` reason.
enum Refusal {
    /// Beyond the bounds, or a second trace: the stream ends with the status.
    Fatal(&'static str, Status),
    /// Content the replay cannot use. The trace is optional, so the stream
    /// goes on (ending it would lose the markers sent behind the trace) and
    /// the prediction keeps to the markers; counted and logged.
    Unusable(&'static str, String),
}

/// Chunks of one stream's allocator trace, gathered until the last.
#[derive(Default)]
struct TraceAssembly {
    trace: AllocatorTrace,
    /// When its first chunk arrived; None once it is done or dropped.
    started: Option<Instant>,
    blocks: usize,
    /// The rest of an unusable trace is skipped up to its last chunk.
    skipping: bool,
    complete: bool,
}

impl TraceAssembly {
    /// Drops what was gathered; the rest of the trace is skipped up to its
    /// last chunk.
    fn abandon(&mut self) {
        self.trace = AllocatorTrace::default();
        self.started = None;
        self.skipping = true;
    }

    /// Adds a chunk; returns the trace once its last chunk is in.
    fn add(&mut self, chunk: pb::AllocatorTraceChunk) -> Result<Option<AllocatorTrace>, Refusal> {
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

    fn append(&mut self, chunk: pb::AllocatorTraceChunk) -> Result<(), (&'static str, String)> {
        convert::allocator_trace_chunk_from_wire(&mut self.trace, chunk)
            .map_err(|e| (e.reason(), e.to_string()))
    }
}

/// Counts and logs `n` markers (or a facts update or trace) refused on a
/// stream of a run its process has left for a newer one
/// ([`MarkerError::RunEnded`]), and the status that ends the stream: logged
/// once per stream, since the stream ends. FAILED_PRECONDITION, not
/// INVALID_ARGUMENT: nothing in the message is wrong, its run is over.
fn run_ended(state: &AgentState, key: &RankKey, e: &MarkerError, n: u64) -> Status {
    state.ingest.reject(e.reason(), n);
    if let MarkerError::RunEnded {
        stream_run,
        rank_run,
    } = e
    {
        tracing::warn!(namespace = %key.namespace, job = %key.job, rank = key.rank, stream_run = %stream_run, rank_run = %rank_run, refused = n, "refused a stream's input for a run the process has left for a newer one; the stream is ended");
    }
    let status = Status::failed_precondition(format!(
        "refused for job {} rank {}: {e}",
        key.job, key.rank
    ));
    let retry = if e.refuses_the_run() {
        Retry::Never
    } else {
        Retry::Later
    };
    named(status, e.reason(), retry)
}

/// Trailing metadata of a stream the agent ended with a refusal: its
/// `stepwatch_markers_rejected_total` reason, so that a client can act on
/// the refusal without parsing the message (see ingest.proto).
pub const REFUSAL_METADATA: &str = "stepwatch-refusal";

/// Trailing metadata set to `never` on a refusal no reconnect of the same
/// process can pass ([`Retry::Never`]), so that its client stops instead of
/// being refused at every try for the rest of training.
pub const RETRY_METADATA: &str = "stepwatch-retry";

/// Whether a reconnect of the same process could pass where a refusal did
/// not (the classification ingest.proto documents).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// It may: the refusal is of one message after the hello (a new stream
    /// does not resend it), or of something that changes without the
    /// process: a limit (streams, ranks, rate), a rank another process
    /// holds, the kubelet's answer, a slow hello, the agent's own failure.
    Later,
    /// It cannot: the stream's opening breaks the contract (an invalid,
    /// oversized or undecodable hello, or none), which the process sends
    /// the same way on every stream, or the hello's run is over on the rank.
    Never,
}

/// Counts a refusal of `n` markers (at least one input) under `reason` and
/// names it in the status that ends the stream; a later try may pass.
fn refuse(state: &AgentState, reason: &'static str, n: u64, status: Status) -> Status {
    refuse_as(state, reason, n, Retry::Later, status)
}

/// [`refuse`], saying whether a reconnect of the process may pass.
fn refuse_as(
    state: &AgentState,
    reason: &'static str,
    n: u64,
    retry: Retry,
    status: Status,
) -> Status {
    state.ingest.reject(reason, n);
    named(status, reason, retry)
}

/// `status` with the refusal's reason in its trailing metadata, and
/// `stepwatch-retry: never` for a refusal no reconnect can pass.
fn named(mut status: Status, reason: &'static str, retry: Retry) -> Status {
    let metadata = status.metadata_mut();
    metadata.insert(REFUSAL_METADATA, MetadataValue::from_static(reason));
    if retry == Retry::Never {
        metadata.insert(RETRY_METADATA, MetadataValue::from_static("never"));
    }
    status
}

/// Counts and logs a trace the prediction cannot use; the stream goes on.
fn reject_trace(state: &AgentState, key: &RankKey, reason: &'static str, why: &str) {
    state.ingest.reject(reason, 1);
    state
        .ingest
        .allocator_traces
        .with_label_values(&["rejected"])
        .inc();
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
async fn replay_trace(
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
        state
            .ingest
            .allocator_traces
            .with_label_values(&["rejected"])
            .inc();
        run_ended(state, key, &e, 1)
    })?;
    match applied {
        Some(advisories) => {
            state
                .ingest
                .allocator_traces
                .with_label_values(&["replayed"])
                .inc();
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
            state
                .ingest
                .allocator_traces
                .with_label_values(&["late"])
                .inc();
            tracing::info!(job = %key.job, rank = key.rank, "allocator trace arrived after step 2 began; ignored");
        }
    }
    Ok(())
}

/// Token bucket holding up to one second of markers.
struct TokenBucket {
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    fn new(rate: f64) -> Self {
        Self {
            rate,
            tokens: rate,
            last: Instant::now(),
        }
    }

    fn take(&mut self, n: f64) -> bool {
        let now = Instant::now();
        self.tokens =
            (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(self.rate);
        self.last = now;
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }
}

/// Puts the kubelet's view of the peer into the hello: its pod and
/// namespace replace the claimed ones (a difference is logged and counted),
/// and a GPU the pod does not hold is refused (PERMISSION_DENIED).
fn apply_attestation(
    state: &AgentState,
    workload: &WorkloadResolver,
    info: &mut RankInfo,
    attestation: Attestation,
) -> Result<(), Status> {
    let Attestation::Pod(w) = attestation else {
        info.attested = false;
        return Ok(());
    };
    if !info.gpu_uuid.is_empty() && w.holds_gpu(&info.gpu_uuid) == Some(false) {
        tracing::warn!(namespace = %w.namespace, pod = %w.pod, pid = info.pid, gpu = %info.gpu_uuid, "refused a hello naming a GPU its pod does not hold");
        // Not for good: the answer rests on the kubelet's view and on which
        // container the agent could place the peer in, not on the hello alone.
        return Err(refuse(
            state,
            "gpu_not_allocated",
            1,
            Status::permission_denied(format!(
                "GPU {} is not allocated to pod {}/{} (the kubelet's pod-resources API says so)",
                info.gpu_uuid, w.namespace, w.pod
            )),
        ));
    }
    for (field, claimed, actual) in [
        ("namespace", &info.namespace, &w.namespace),
        ("pod", &info.pod, &w.pod),
    ] {
        if !claimed.is_empty() && claimed != actual {
            workload.count_mismatch(field);
            tracing::warn!(field, claimed = %claimed, kubelet = %actual, pid = info.pid, "a hello's {field} differs from the kubelet's; the kubelet's is used");
        }
    }
    info.container = w.container_for(&info.gpu_uuid).to_owned();
    info.namespace = w.namespace;
    info.pod = w.pod;
    info.attested = true;
    Ok(())
}

/// The peer's PID from SO_PEERCRED, when it means something here. The kernel
/// reports 0 for a peer outside the agent's PID namespace (an agent without
/// `hostPID`); that must not override the PID the hello claims, and the
/// operator is told once.
fn usable_peer_pid(pid: i32) -> Option<u32> {
    static TOLD: std::sync::Once = std::sync::Once::new();
    match u32::try_from(pid) {
        Ok(0) => {
            TOLD.call_once(|| {
                tracing::warn!(
                    "a client's peer credentials carry PID 0: the agent runs outside the clients' PID \
                     namespace, so it uses the PID each hello claims; run the agent with hostPID \
                     (the chart does) to tell ranks' memory from other processes' reliably"
                )
            });
            None
        }
        Ok(pid) => Some(pid),
        Err(_) => None,
    }
}

/// The rank a hello claims to be, with the socket's peer PID in place of
/// the claimed one where the agent has it.
fn rank_info(hello: pb::Hello, peer_pid: Option<u32>) -> RankInfo {
    let mut info = convert::hello_from_wire(hello);
    info.pid = peer_pid.unwrap_or(info.pid);
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_pid_of_zero_does_not_override_the_hello() {
        // PID 0: the peer is outside our PID namespace.
        assert_eq!(usable_peer_pid(0), None);
        assert_eq!(usable_peer_pid(-1), None);
        assert_eq!(usable_peer_pid(4242), Some(4242));
        let hello = pb::Hello {
            pid: 77,
            ..Default::default()
        };
        assert_eq!(rank_info(hello.clone(), usable_peer_pid(0)).pid, 77);
        assert_eq!(rank_info(hello, usable_peer_pid(4242)).pid, 4242);
    }
}

#[cfg(test)]
#[path = "ingest_fuzz.rs"]
mod fuzz;
