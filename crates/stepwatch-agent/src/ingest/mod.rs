//! The gRPC ingest adapter: proto messages in, tracker calls out.
//!
//! Validation of content lives in stepwatch-core; this file checks only what
//! is about the wire (message order, sizes, rates) and maps errors to gRPC
//! statuses that name the problem.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use stepwatch_core::allocator::{BlockLayout, SegmentLayout};
use stepwatch_core::feed::ReplayPlan;
use stepwatch_core::{
    Advisory, AdvisoryKind, AllocatorEvent, AllocatorTrace, MarkerError, MarkerKind, OpenError,
    RankInfo, RankKey, RecordError,
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

mod identity;
mod limits;
mod refusal;
mod traces;

use identity::*;
use limits::*;
use refusal::*;
pub use traces::TraceBudget;
use traces::*;

use crate::alerts::{Alerter, RankAlerts};
use crate::listen::{ConnInfo, ConnStreams, ConnectionMemory, PeerKey, PeerQuota};
use crate::state::AgentState;
use crate::workload::{Attestation, VolumePod, WorkloadResolver};

/// HTTP/2's window of one ingest stream: the most its peer may send on it
/// that the agent has not read (within the connection's window).
pub const STREAM_WINDOW: u32 = 64 << 10;

/// What one open stream can make the agent hold beyond its connection's
/// window: the decoder's buffer, which grows to the largest message (the
/// contract's limit) and keeps that size, and the advisories queued for a
/// client that does not read them. A batch being decoded and applied
/// (up to 1,024 markers, about 400 KiB) is not held between messages and
/// is not counted.
pub const STREAM_BYTES: u64 =
    (stepwatch_proto::MAX_MESSAGE_BYTES + ADVISORY_QUEUE * (1 << 10)) as u64;

/// Advisories queued for a stream's client before more are dropped (each
/// well under 1 KiB).
const ADVISORY_QUEUE: usize = 16;

/// The `Ingest` service.
#[derive(Clone)]
pub struct IngestService {
    state: Arc<AgentState>,
    workload: Arc<WorkloadResolver>,
    streams: Arc<Semaphore>,
    /// Each peer's and each process's share of `streams`.
    stream_quota: Arc<PeerQuota>,
    limits: IngestLimits,
    traces: Arc<TraceBudget>,
    /// What each stream's buffers ([`STREAM_BYTES`]) are drawn from, with
    /// the connections'.
    memory: Arc<ConnectionMemory>,
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

/// Per-stream bounds of the ingest service (flags of the same names).
#[derive(Debug, Clone, Copy)]
pub struct IngestLimits {
    /// Streams that said hello, at once (`--max-streams`).
    pub max_streams: usize,
    /// Of those, held by one peer: a pod, else a uid, or an address
    /// (`--max-streams-per-peer`).
    pub max_streams_per_peer: usize,
    /// Of those, held by one process (`--max-streams-per-process`).
    pub max_streams_per_process: usize,
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
        memory: Arc<ConnectionMemory>,
    ) -> Self {
        Self {
            state,
            workload,
            alerter,
            streams: Arc::new(Semaphore::new(limits.max_streams)),
            stream_quota: PeerQuota::new(
                limits.max_streams_per_peer,
                limits.max_streams_per_process,
            ),
            limits,
            traces,
            memory,
            volume: None,
        }
    }

    /// The same service (sharing its stream budget) for the socket in one
    /// pod's CSI volume: the pod is taken from `volume`, not from the peer.
    #[cfg_attr(not(feature = "csi"), allow(dead_code))]
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
        let transport = Transport::of(&request);
        if self.volume.as_ref().is_some_and(|v| *v.gone.borrow()) {
            return Err(Status::unavailable(
                "this pod's stepwatch volume has been unpublished",
            ));
        }
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(ADVISORY_QUEUE);
        let state = self.state.clone();
        let workload = self.workload.clone();
        let streams = self.streams.clone();
        let stream_quota = self.stream_quota.clone();
        let memory = self.memory.clone();
        let limits = self.limits;
        let traces = self.traces.clone();
        let volume = self.volume.clone();
        let alerter = self.alerter.clone();
        tokio::spawn(async move {
            // Counted on its connection from now: a connection holding
            // streams is not closed for holding none.
            let _on_connection = transport.streams.as_ref().map(ConnStreams::opened);
            state.ingest.streams_opened.inc();
            let served = tokio::spawn({
                let (state, tx) = (state.clone(), tx.clone());
                async move {
                    let peer = Peer {
                        pid: transport.pid,
                        keys: transport.keys,
                        tcp_identity: transport.tcp_identity,
                        workload: &workload,
                        volume,
                        alerter: &alerter,
                    };
                    let slots = Slots {
                        streams: &streams,
                        quota: &stream_quota,
                        memory: &memory,
                    };
                    serve_stream(&state, slots, &traces, inbound, peer, limits, &tx).await
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

/// What the connection a stream came on says of its sender.
struct Transport {
    /// SO_PEERCRED's PID, on a Unix socket.
    pid: Option<u32>,
    /// Its keys in the per-peer stream quota.
    keys: Vec<PeerKey>,
    /// Over TCP, who the hello is from: the client certificate's digest
    /// with mutual TLS, else the empty string (nobody the agent can tell).
    tcp_identity: Option<String>,
    /// The connection's stream count (None: not a [`crate::listen::LimitedIo`]).
    streams: Option<ConnStreams>,
}

impl Transport {
    fn of<T>(request: &Request<T>) -> Self {
        use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo, UdsConnectInfo};
        let ext = request.extensions();
        // The stream quota counts a peer as its connection's did.
        if let Some(info) = ext.get::<ConnInfo<UdsConnectInfo>>() {
            let cred = info.inner.peer_cred;
            return Self {
                pid: cred.and_then(|c| c.pid()).and_then(usable_peer_pid),
                keys: info.keys.clone(),
                tcp_identity: None,
                streams: Some(info.streams.clone()),
            };
        }
        if let Some(info) = ext.get::<TlsConnectInfo<ConnInfo<TcpConnectInfo>>>() {
            let identity = info
                .peer_certs()
                .and_then(|certs| certs.first().map(|c| certificate_identity(c.as_ref())))
                .unwrap_or_default();
            return Self {
                pid: None,
                keys: info.get_ref().keys.clone(),
                tcp_identity: Some(identity),
                streams: Some(info.get_ref().streams.clone()),
            };
        }
        if let Some(info) = ext.get::<ConnInfo<TcpConnectInfo>>() {
            return Self {
                pid: None,
                keys: info.keys.clone(),
                tcp_identity: Some(String::new()),
                streams: Some(info.streams.clone()),
            };
        }
        Self {
            pid: None,
            keys: Vec::new(),
            tcp_identity: None,
            streams: None,
        }
    }
}

/// A TCP client's identity: the SHA-256 of its certificate (DER), which
/// the TLS handshake proved it holds the key of.
fn certificate_identity(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("tls:{hex}")
}

/// The stream budget a hello takes a slot of.
#[derive(Clone, Copy)]
struct Slots<'a> {
    /// All streams (`--max-streams`).
    streams: &'a Arc<Semaphore>,
    /// Each peer's and process's share.
    quota: &'a Arc<PeerQuota>,
    /// The memory its buffers are drawn from.
    memory: &'a Arc<ConnectionMemory>,
}

/// Who is on the other end of a stream, as far as the agent can tell.
struct Peer<'a> {
    /// SO_PEERCRED's PID, on the Unix socket.
    pid: Option<u32>,
    /// Its keys in the per-peer stream quota.
    keys: Vec<PeerKey>,
    /// See [`Transport::tcp_identity`].
    tcp_identity: Option<String>,
    workload: &'a WorkloadResolver,
    /// The pod's CSI volume the stream came in through, if any.
    volume: Option<VolumeBinding>,
    /// Where the rank's alerts go.
    alerter: &'a Alerter,
}

async fn serve_stream(
    state: &AgentState,
    slots: Slots<'_>,
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
    let Ok(_slot) = slots.streams.clone().try_acquire_owned() else {
        return Err(refuse(
            state,
            "too_many_streams",
            1,
            Status::resource_exhausted(
                "the agent has reached its limit of concurrent streams (--max-streams)",
            ),
        ));
    };
    // One peer or process holds only its share: the rest stay for others.
    let _share = match slots.quota.try_take(peer.keys.clone()) {
        Ok(share) => share,
        Err(full) => {
            let (reason, flag, who) = match full {
                PeerKey::Pid(_) => (
                    "process_stream_limit",
                    "--max-streams-per-process",
                    "process",
                ),
                _ => ("peer_stream_limit", "--max-streams-per-peer", "peer"),
            };
            tracing::debug!(peer = ?full, "refused a stream: its {who} holds its share of the streams");
            return Err(refuse(
                state,
                reason,
                1,
                Status::resource_exhausted(format!(
                    "this {who} holds its limit of concurrent streams ({flag})"
                )),
            ));
        }
    };
    // Its buffers from the agent's memory budget, beside its connection's.
    let Some(_memory) = slots.memory.try_take(&peer.keys, STREAM_BYTES) else {
        tracing::debug!(peer = ?peer.keys.first(), "refused a stream: the memory budget for connections and streams cannot cover it");
        return Err(refuse(
            state,
            "stream_memory",
            1,
            Status::resource_exhausted(
                "the agent's memory budget for connections and streams (an eighth of --memory-limit-mib), or this peer's half of it, cannot cover another stream",
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
    // The device as the sampler names it (a MIG slice sent with `GPU-`).
    if let Some(uuid) = state.sampler.device_uuid(&info.gpu_uuid) {
        info.gpu_uuid = uuid;
    }
    if let Some(identity) = &peer.tcp_identity {
        tcp_claimant(&mut info, identity);
    }
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
    release_if_holder_gone(state, peer.workload.proc_root(), &info);
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
    // A stream that did not end cleanly (the connection lost, or ended by a
    // refusal) leaves the rank to its process for the reconnect window.
    state.close_rank(&key, result.is_err());
    alerts.close();
    tracing::info!(job = %key.job, rank = key.rank, "rank disconnected");
    result
}

/// Sleeps until `deadline`; never without one.
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
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
    // A message read ahead while gathering marker batches, handled next.
    let mut read_ahead = None;
    let mut trace = TraceAssembly::default();
    let mut held = HeldTraceBytes {
        budget: traces,
        held: 0,
    };
    loop {
        // A trace begun too long ago gives its memory back, on the agent's
        // clock: a stream that goes silent must not hold the budget shared
        // by every rank. The prediction keeps to the markers.
        let trace_deadline = trace
            .started
            .map(|t| tokio::time::Instant::from_std(t + traces.timeout));
        let next = match read_ahead.take() {
            Some(message) => Ok(message),
            None => Err(next_message(state, inbound, Retry::Later)),
        };
        let message = tokio::select! {
            message = async move {
                match next {
                    Ok(message) => message,
                    Err(reading) => reading.await,
                }
            } => match message? {
                Some(message) => message,
                None => break,
            },
            _ = sleep_until_some(trace_deadline) => {
                let why = format!(
                    "the allocator trace was not finished within {:?} of its first chunk (--partial-trace-timeout)",
                    traces.timeout
                );
                abandon_trace(state, key, &mut trace, &mut held, "allocator_trace_timeout", &why);
                continue;
            }
        };
        let batch = match message.kind {
            Some(Kind::Markers(batch)) => batch,
            Some(Kind::AllocatorTrace(chunk)) => {
                take_one_message(state, &mut bucket, max_rate)?;
                if !trace.skipping && !trace.complete && !held.take(held_bytes(&chunk)) {
                    let why = format!(
                        "unfinished allocator traces of all streams would hold more than {} bytes (--max-partial-trace-mib)",
                        traces.max_partial_bytes
                    );
                    abandon_trace(
                        state,
                        key,
                        &mut trace,
                        &mut held,
                        "allocator_trace_over_budget",
                        &why,
                    );
                    trace.complete = chunk.last;
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
                take_one_message(state, &mut bucket, max_rate)?;
                let update = convert::model_facts_from_wire(update);
                let (due, plan) = match state.update_model_facts(key, stream.run_id, &update) {
                    Ok(applied) => applied,
                    Err(e) if e.ends_stream() => {
                        return Err(stream_ended(
                            state,
                            key,
                            &e,
                            1,
                            "model facts update refused",
                        ));
                    }
                    Err(e) => {
                        refused_alone(state, key, &e, 1, tx, alerts);
                        continue;
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
            Some(Kind::OomReport(report)) => {
                take_one_message(state, &mut bucket, max_rate)?;
                let report = convert::oom_report_from_wire(report);
                match state.apply_oom_report(key, stream.run_id, report) {
                    Ok(Some(pm)) => tracing::warn!(
                        namespace = %key.namespace,
                        job = %key.job,
                        rank = key.rank,
                        step = pm.step,
                        cause = pm.cause.as_str(),
                        "post-mortem: rank {}",
                        pm.message
                    ),
                    Ok(None) => {}
                    Err(e) if e.ends_stream() => {
                        return Err(stream_ended(state, key, &e, 1, "OOM report refused"));
                    }
                    Err(e) => refused_alone(state, key, &e, 1, tx, alerts),
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
        // The batches already waiting on this stream go in under one
        // tracker lock, up to a batch's worth of markers: a rank that fell
        // behind (its batches waited while others held the lock) catches up
        // in one turn, and no turn holds the lock longer than one full batch.
        let mut batches = vec![checked_batch(state, &mut bucket, max_rate, batch)?];
        let mut markers_taken = batches[0].len();
        let mut refused = None;
        while markers_taken < MAX_MARKERS_PER_BATCH && refused.is_none() {
            let Some(next) = next_message(state, inbound, Retry::Later).now_or_never() else {
                break;
            };
            match next {
                Ok(Some(pb::ClientMessage {
                    kind: Some(Kind::Markers(batch)),
                })) if markers_taken + batch.markers.len() <= MAX_MARKERS_PER_BATCH => {
                    match checked_batch(state, &mut bucket, max_rate, batch) {
                        Ok(markers) => {
                            markers_taken += markers.len();
                            batches.push(markers);
                        }
                        // After the batches before it, as if read in turn.
                        Err(status) => refused = Some(status),
                    }
                }
                other => {
                    read_ahead = Some(other);
                    break;
                }
            }
        }
        if batches.iter().flatten().any(|m| m.step > 1) {
            step1_trace = None;
        }
        for (markers, applied) in
            batches
                .iter()
                .zip(state.apply_marker_batches(key, stream.run_id, &batches))
        {
            let n = markers.len() as u64;
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
                    alerts.markers(markers);
                }
                Err(e) if e.ends_stream() => {
                    return Err(stream_ended(state, key, &e, n, "marker rejected"));
                }
                Err(e) => refused_alone(state, key, &e, n, tx, alerts),
            }
        }
        if let Some(status) = refused {
            return Err(status);
        }
        // A turn at a time: a stream whose client floods batches would
        // otherwise keep its worker, and the streams queued behind it on
        // that worker waited for as long as the flood lasted.
        tokio::task::yield_now().await;
    }
    Ok(())
}

/// The status, counted, that ends a stream on a refusal of `n` markers (or
/// a message) that ends it ([`RecordError::ends_stream`], the one rule the
/// tracker's batch loop stops on too): `what` and why.
fn stream_ended(state: &AgentState, key: &RankKey, e: &RecordError, n: u64, what: &str) -> Status {
    match e {
        RecordError::Markers(e @ MarkerError::RunEnded { .. }) => run_ended(state, key, e, n),
        e => not_taken(state, key, e, n, what),
    }
}

/// Counts a refusal of `n` markers (or a message) that leaves the stream
/// open, and says why: a jumped clock to the client on its advisory
/// channel, anything else to the log.
fn refused_alone(
    state: &AgentState,
    key: &RankKey,
    e: &RecordError,
    n: u64,
    tx: &mpsc::Sender<Result<pb::AgentMessage, Status>>,
    alerts: &mut RankAlerts,
) {
    state.ingest.reject(e.reason(), n);
    match e {
        RecordError::Markers(MarkerError::ClockJumped { ahead_ns, step }) => {
            let now = stepwatch_proto::clock::monotonic_ns();
            let advisory = stepwatch_core::clock::jump_advisory(*step, now, *ahead_ns);
            send_advisories(state, key, vec![advisory], tx, alerts);
        }
        // A process that caught its OOM keeps training.
        RecordError::OomReport(_) => tracing::warn!(
            job = %key.job,
            rank = key.rank,
            reason = e.reason(),
            "OOM report not used ({}); the post-mortem keeps to the OOM marker",
            e.refusal()
        ),
        e => tracing::warn!(
            job = %key.job,
            rank = key.rank,
            reason = e.reason(),
            "input refused ({}); the stream goes on",
            e.refusal()
        ),
    }
}

/// The refusal, counted, of `n` markers (or a message) of the rank the
/// tracker would not take: `what` and why.
fn not_taken(state: &AgentState, key: &RankKey, e: &RecordError, n: u64, what: &str) -> Status {
    let why = format!(
        "{what} for job {} rank {}: {}",
        key.job,
        key.rank,
        e.refusal()
    );
    refuse(state, e.reason(), n, Status::invalid_argument(why))
}

/// A marker batch's markers, once its size, the stream's rate and every
/// marker's fields are checked; a refusal ends the stream.
fn checked_batch(
    state: &AgentState,
    bucket: &mut TokenBucket,
    max_rate: f64,
    batch: pb::MarkerBatch,
) -> Result<Vec<stepwatch_core::Marker>, Status> {
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
    batch
        .markers
        .into_iter()
        .map(|m| {
            convert::marker_from_wire(m).map_err(|e| {
                let status = Status::invalid_argument(e.to_string());
                refuse(state, e.reason(), n, status)
            })
        })
        .collect()
}

/// A message other than a marker batch costs like one marker, so a flood
/// of them is bounded too.
fn take_one_message(
    state: &AgentState,
    bucket: &mut TokenBucket,
    max_rate: f64,
) -> Result<(), Status> {
    if bucket.take(1.0) {
        return Ok(());
    }
    Err(refuse(
        state,
        "rate_limited",
        1,
        Status::resource_exhausted(format!(
            "more than {max_rate} messages/s on one stream (--max-marker-rate)"
        )),
    ))
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
        // Every rank gets PREDICTION_FINAL: counted, not logged.
        if advisory.kind != AdvisoryKind::PredictionFinal {
            tracing::warn!(
                job = %key.job,
                rank = key.rank,
                step = advisory.step,
                kind,
                "{}",
                advisory.message
            );
        }
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
mod fuzz;
