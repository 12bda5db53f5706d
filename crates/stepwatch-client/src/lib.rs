//! Streams step markers from a training process to the node's stepwatch
//! agent, without ever blocking or failing the training loop.
//!
//! [`Client::mark`] is a bounded, non-blocking enqueue. A background thread
//! with its own small runtime owns the gRPC stream: it sends the hello,
//! batches queued markers, reconnects with backoff when the agent is absent
//! or restarts, and hands advisories back. When the queue is full, markers
//! are dropped and counted; training goes on.

#![warn(missing_docs)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use stepwatch_proto::clock::{monotonic_ns, wall_ns};
use stepwatch_proto::v1::{
    agent_message, client_message, ingest_client::IngestClient, Advisory, AllocatorTraceChunk,
    ClientMessage, Hello, Marker, MarkerBatch, MarkerKind,
};
use stepwatch_proto::MAX_MARKERS_PER_BATCH;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Default endpoint: the agent's Unix socket.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/stepwatch/stepwatch.sock";

/// Called with every advisory the agent sends.
pub type AdvisoryCallback = Arc<dyn Fn(&Advisory) + Send + Sync>;

/// How the client connects and how much it buffers.
#[derive(Clone)]
pub struct ClientOptions {
    /// `unix:///path`, `http://host:port` or `host:port`.
    pub endpoint: String,
    /// Sent first on every (re)connection. An empty `run_id` is filled with
    /// a fresh one by [`Client::start`]: each client is one training run,
    /// and the agent gives a new run of a rank its own step 1.
    pub hello: Hello,
    /// Markers buffered while the agent is slow or away (queued, or taken
    /// by the sender thread and not yet sent); beyond this they are dropped.
    pub queue_capacity: usize,
    /// First wait before reconnecting; doubles on each failure.
    pub reconnect_min: Duration,
    /// Longest wait between reconnects, so a restarted agent is found quickly.
    pub reconnect_max: Duration,
    /// Called on the client thread for each advisory, so training code can react
    /// (log, shrink the batch) without polling; keep it quick.
    pub on_advisory: Option<AdvisoryCallback>,
    /// PEM CA bundle to verify an `https://` endpoint (the agent's TCP ingest with TLS).
    pub tls_ca_pem: Option<Vec<u8>>,
    /// PEM certificate and key this client presents when the agent requires
    /// mutual TLS (`--grpc-tls-client-ca`).
    pub tls_identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl ClientOptions {
    /// Options with defaults (64 Ki markers, 100 ms to 5 s backoff, no TLS).
    pub fn new(endpoint: impl Into<String>, hello: Hello) -> Self {
        Self {
            endpoint: endpoint.into(),
            hello,
            queue_capacity: 65_536,
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            on_advisory: None,
            tls_ca_pem: None,
            tls_identity_pem: None,
        }
    }
}

/// Counters a user can check (and tests assert).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Markers accepted into the queue.
    pub enqueued: u64,
    /// Markers handed to the gRPC stream.
    pub sent: u64,
    /// Markers dropped because the queue was full.
    pub dropped: u64,
    /// Connections opened after the first.
    pub reconnects: u64,
    /// Streams the agent ended with an error status (bad input, limits).
    pub rejected_streams: u64,
    /// Advisories received from the agent.
    pub advisories: u64,
    /// Allocator traces handed to the stream in full.
    pub traces_sent: u64,
    /// Allocator traces dropped: queue full, or the stream ended mid-trace
    /// (a trace is never resent on a new stream).
    pub traces_dropped: u64,
    /// The agent refused this client for good (`stepwatch-retry: never`:
    /// another client in the process began a newer run on the rank, or the
    /// hello breaks the contract, e.g. a rank beyond the world size, and
    /// would on every reconnect); nothing is sent any more and markers
    /// count as dropped.
    pub stopped: bool,
}

/// What the queue carries: a marker, or a whole allocator trace, which goes
/// out on one stream, in order with the markers around it.
enum Outgoing {
    Marker(Marker),
    Trace(Vec<AllocatorTraceChunk>),
}

#[derive(Default)]
struct Shared {
    enqueued: AtomicU64,
    /// Markers enqueued and neither sent nor lost yet: in the queue, in the
    /// sender's next batch. `queue_capacity` bounds it.
    unsent: AtomicU64,
    sent: AtomicU64,
    dropped: AtomicU64,
    reconnects: AtomicU64,
    rejected_streams: AtomicU64,
    advisories: AtomicU64,
    traces_sent: AtomicU64,
    traces_dropped: AtomicU64,
    /// Traces queued and not yet sent or dropped, for `flush`.
    traces_in_queue: AtomicU64,
    connected: AtomicBool,
    /// See [`ClientStats::stopped`].
    stopped: AtomicBool,
    last_advisory: Mutex<Option<Advisory>>,
}

/// A connection to the agent for one rank.
pub struct Client {
    queue: Option<mpsc::Sender<Outgoing>>,
    /// `queue_capacity`: the bound on markers enqueued and not yet sent.
    capacity: u64,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The hello's run id (see [`ClientOptions::hello`]).
    run_id: String,
}

/// A run id unique on this host: the PID, the wall clock and a counter
/// (two clients started in one nanosecond still differ), in the identifier
/// charset the agent accepts.
fn new_run_id() -> String {
    static STARTED: AtomicU64 = AtomicU64::new(0);
    let n = STARTED.fetch_add(1, Ordering::Relaxed);
    format!("{:x}-{:x}-{n}", std::process::id(), wall_ns())
}

impl Client {
    /// Starts the background sender. Never fails and never waits for the agent.
    pub fn start(mut options: ClientOptions) -> Self {
        if options.hello.run_id.is_empty() {
            options.hello.run_id = new_run_id();
        }
        let run_id = options.hello.run_id.clone();
        let (tx, rx) = mpsc::channel(options.queue_capacity.max(1));
        let capacity = options.queue_capacity.max(1) as u64;
        let shared = Arc::new(Shared::default());
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("stepwatch-client".into())
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("build the client runtime");
                    runtime.block_on(sender(options, rx, shared));
                })
                .expect("spawn the stepwatch client thread")
        };
        Self {
            queue: Some(tx),
            capacity,
            shared,
            thread: Some(thread),
            run_id,
        }
    }

    /// The run id every hello of this client carries.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Queues a marker. Never blocks; returns false when it was dropped.
    pub fn mark(&self, marker: Marker) -> bool {
        let Some(queue) = &self.queue else {
            return false;
        };
        if self.shared.stopped.load(Ordering::Relaxed) {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // The channel alone does not bound what is buffered: while the agent
        // is away the sender thread takes markers into its next batch (up to
        // MAX_MARKERS_PER_BATCH), freeing channel slots. Count those too.
        if self.shared.unsent.load(Ordering::Relaxed) >= self.capacity {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        match queue.try_send(Outgoing::Marker(marker)) {
            Ok(()) => {
                self.shared.enqueued.fetch_add(1, Ordering::Relaxed);
                self.shared.unsent.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(_) => {
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Queues step 1's allocator trace, as made by
    /// [`stepwatch_proto::chunk_allocator_trace`], to go out after the
    /// markers queued before it; call it after step 1's optimizer-end marker.
    /// Never blocks; returns false when it was dropped (queue full). A trace
    /// is sent whole on one stream or not at all.
    pub fn send_allocator_trace(&self, chunks: Vec<AllocatorTraceChunk>) -> bool {
        let queued = self
            .queue
            .as_ref()
            .is_some_and(|q| q.try_send(Outgoing::Trace(chunks)).is_ok());
        if queued {
            self.shared.traces_in_queue.fetch_add(1, Ordering::Relaxed);
        } else {
            self.shared.traces_dropped.fetch_add(1, Ordering::Relaxed);
        }
        queued
    }

    /// Queues a marker of `kind` for `step`, stamped now.
    pub fn mark_now(&self, kind: MarkerKind, step: u64, micro_batch: u32) -> bool {
        self.mark(Marker {
            kind: kind as i32,
            step,
            monotonic_ns: monotonic_ns(),
            wall_ns: wall_ns(),
            allocator: None,
            micro_batch,
            layout_segments: Vec::new(),
            device_memory: None,
            batch: None,
        })
    }

    /// A snapshot of the counters; cheap, so it can be logged every step.
    pub fn stats(&self) -> ClientStats {
        let s = &self.shared;
        ClientStats {
            enqueued: s.enqueued.load(Ordering::Relaxed),
            sent: s.sent.load(Ordering::Relaxed),
            dropped: s.dropped.load(Ordering::Relaxed),
            reconnects: s.reconnects.load(Ordering::Relaxed),
            rejected_streams: s.rejected_streams.load(Ordering::Relaxed),
            advisories: s.advisories.load(Ordering::Relaxed),
            traces_sent: s.traces_sent.load(Ordering::Relaxed),
            traces_dropped: s.traces_dropped.load(Ordering::Relaxed),
            stopped: s.stopped.load(Ordering::Relaxed),
        }
    }

    /// Whether a stream to the agent is open now.
    pub fn connected(&self) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
    }

    /// The latest advisory from the agent.
    pub fn last_advisory(&self) -> Option<Advisory> {
        self.shared
            .last_advisory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits up to `timeout` for every queued marker (and trace) to be
    /// handed to the stream; returns whether it got there (false at once
    /// once the client has stopped, see [`ClientStats::stopped`]).
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.shared.stopped.load(Ordering::Relaxed) {
                return false;
            }
            let s = self.stats();
            if s.sent >= s.enqueued && self.shared.traces_in_queue.load(Ordering::Relaxed) == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Flushes for up to `timeout`, ends the stream and stops the thread.
    pub fn close(mut self, timeout: Duration) -> ClientStats {
        self.flush(timeout);
        self.queue = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.stats()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Closing the queue ends the sender; don't wait for a dead agent here.
        self.queue = None;
    }
}

/// Normalises `host:port` to `http://host:port`; leaves `unix:` and `http(s):` alone.
pub fn normalize_endpoint(endpoint: &str) -> String {
    if endpoint.starts_with("unix:") || endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    }
}

async fn sender(options: ClientOptions, mut queue: mpsc::Receiver<Outgoing>, shared: Arc<Shared>) {
    let endpoint = normalize_endpoint(&options.endpoint);
    let mut backoff = options.reconnect_min;
    let mut attempts = 0u64;
    let mut pending = Pending::default();
    loop {
        attempts += 1;
        if attempts > 1 {
            shared.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        let outcome = session(&endpoint, &options, &mut queue, &mut pending, &shared).await;
        shared.connected.store(false, Ordering::Relaxed);
        match outcome {
            Session::QueueClosed => return,
            Session::RefusedForGood(status) => return stop(status, queue, pending, &shared).await,
            Session::Ended => backoff = options.reconnect_min,
            Session::Failed(e) => {
                tracing::debug!(error = %e, retry_in_ms = backoff.as_millis() as u64, "stepwatch agent unreachable");
            }
        }
        // Wait out the backoff, but leave at once if the user closed the client
        // and nothing is left to send. A trace stops the intake until it is
        // sent, so that it keeps its place among the markers.
        let sleep = tokio::time::sleep(backoff);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => break,
                m = queue.recv(), if pending.accepts() => match m {
                    Some(item) => pending.push(item),
                    // Closed while the agent is away: close() already waited
                    // its flush timeout, so what is left is dropped, counted.
                    None => {
                        shared.lost(pending.markers.len() as u64);
                        if pending.trace.take().is_some() {
                            shared.trace_done(false);
                        }
                        return;
                    }
                },
            }
        }
        backoff = (backoff * 2).min(options.reconnect_max);
    }
}

/// Taken off the queue, not yet handed to a stream.
#[derive(Default)]
struct Pending {
    markers: Vec<Marker>,
    /// Goes out after `markers`.
    trace: Option<Vec<AllocatorTraceChunk>>,
}

impl Pending {
    /// Whether to take more from the queue: not past a trace, nor a full batch.
    fn accepts(&self) -> bool {
        self.trace.is_none() && self.markers.len() < MAX_MARKERS_PER_BATCH
    }

    fn push(&mut self, item: Outgoing) {
        match item {
            Outgoing::Marker(m) => self.markers.push(m),
            Outgoing::Trace(t) => self.trace = Some(t),
        }
    }
}

impl Shared {
    /// `n` enqueued markers that will never be sent: counted as dropped.
    fn lost(&self, n: u64) {
        self.dropped.fetch_add(n, Ordering::Relaxed);
        self.unsent.fetch_sub(n, Ordering::Relaxed);
    }

    fn trace_done(&self, sent: bool) {
        self.traces_in_queue.fetch_sub(1, Ordering::Relaxed);
        if sent {
            self.traces_sent.fetch_add(1, Ordering::Relaxed);
        } else {
            self.traces_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

enum Session {
    QueueClosed,
    Ended,
    Failed(String),
    /// The agent refused the client for good: reconnecting is futile.
    RefusedForGood(tonic::Status),
}

/// Whether the agent marked a refusal as one no reconnect of this client
/// can pass (trailing metadata `stepwatch-retry: never`, see ingest.proto).
fn refused_for_good(status: &tonic::Status) -> bool {
    status
        .metadata()
        .get("stepwatch-retry")
        .is_some_and(|v| v.as_bytes() == b"never")
}

/// Stops the client for good after such a refusal: says so once, and drops
/// (counts) what is queued until the client is closed.
async fn stop(
    status: tonic::Status,
    mut queue: mpsc::Receiver<Outgoing>,
    mut pending: Pending,
    shared: &Shared,
) {
    let reason = status
        .metadata()
        .get("stepwatch-refusal")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    // The two refusals of a run that is over have one cause; every other
    // one is of the stream's opening, which each reconnect would repeat.
    if matches!(reason.as_str(), "run_ended" | "rank_held") {
        tracing::warn!(
            code = ?status.code(),
            reason,
            message = status.message(),
            "the stepwatch agent refused this client's run for good: another client in this process \
             began a newer run on the rank; this client stops sending (training goes on). Report \
             each rank from one stepwatch Client per process"
        );
    } else {
        tracing::warn!(
            code = ?status.code(),
            reason,
            message = status.message(),
            "the stepwatch agent refused this client's hello for good: every reconnect would send \
             the same one; this client stops sending (training goes on). Fix what the message \
             names (the client's identity or model facts)"
        );
    }
    shared.stopped.store(true, Ordering::Relaxed);
    shared.lost(pending.markers.len() as u64);
    pending.markers.clear();
    if pending.trace.take().is_some() {
        shared.trace_done(false);
    }
    while let Some(item) = queue.recv().await {
        match item {
            Outgoing::Marker(_) => shared.lost(1),
            Outgoing::Trace(_) => shared.trace_done(false),
        }
    }
}

async fn session(
    endpoint: &str,
    options: &ClientOptions,
    queue: &mut mpsc::Receiver<Outgoing>,
    pending: &mut Pending,
    shared: &Shared,
) -> Session {
    let endpoint_config =
        tonic::transport::Endpoint::from_shared(endpoint.to_string()).and_then(|e| {
            if options.tls_ca_pem.is_none() && options.tls_identity_pem.is_none() {
                return Ok(e);
            }
            let mut tls = tonic::transport::ClientTlsConfig::new();
            if let Some(pem) = &options.tls_ca_pem {
                tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(pem));
            }
            if let Some((cert, key)) = &options.tls_identity_pem {
                tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
            }
            e.tls_config(tls)
        });
    let channel = match endpoint_config {
        Ok(e) => match e.connect_timeout(Duration::from_secs(2)).connect().await {
            Ok(c) => c,
            Err(e) => return Session::Failed(e.to_string()),
        },
        Err(e) => return Session::Failed(format!("bad endpoint {endpoint:?}: {e}")),
    };
    let (out, out_rx) = mpsc::channel::<ClientMessage>(8);
    let hello = ClientMessage {
        kind: Some(client_message::Kind::Hello(options.hello.clone())),
    };
    let _ = out.send(hello).await;
    let mut client = IngestClient::new(channel);
    let mut inbound = match client.stream(ReceiverStream::new(out_rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) if refused_for_good(&status) => {
            shared.rejected_streams.fetch_add(1, Ordering::Relaxed);
            return Session::RefusedForGood(status);
        }
        Err(status) => return Session::Failed(status.to_string()),
    };
    shared.connected.store(true, Ordering::Relaxed);
    let mut out = Some(out);
    loop {
        if let (Some(sink), false) = (&out, pending.markers.is_empty()) {
            let n = pending.markers.len() as u64;
            let batch = ClientMessage {
                kind: Some(client_message::Kind::Markers(MarkerBatch {
                    markers: std::mem::take(&mut pending.markers),
                })),
            };
            if sink.send(batch).await.is_err() {
                // The stream ended under the batch; it is gone, and counted.
                shared.lost(n);
                return Session::Ended;
            }
            shared.sent.fetch_add(n, Ordering::Relaxed);
            shared.unsent.fetch_sub(n, Ordering::Relaxed);
        }
        if let Some(sink) = &out {
            if let Some(chunks) = pending.trace.take() {
                for chunk in chunks {
                    let message = ClientMessage {
                        kind: Some(client_message::Kind::AllocatorTrace(chunk)),
                    };
                    if sink.send(message).await.is_err() {
                        // Never resent: a new stream would get it without its start.
                        shared.trace_done(false);
                        return Session::Ended;
                    }
                }
                shared.trace_done(true);
            }
        }
        tokio::select! {
            m = queue.recv(), if out.is_some() => match m {
                Some(item) => {
                    pending.push(item);
                    while pending.accepts() {
                        match queue.try_recv() {
                            Ok(item) => pending.push(item),
                            Err(_) => break,
                        }
                    }
                }
                // The user closed the client: half-close and wait for the agent.
                None => out = None,
            },
            message = inbound.message() => match message {
                Ok(Some(message)) => {
                    if let Some(agent_message::Kind::Advisory(a)) = message.kind {
                        shared.advisories.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(message = %a.message, "stepwatch advisory");
                        if let Some(cb) = &options.on_advisory {
                            cb(&a);
                        }
                        *shared.last_advisory.lock().unwrap_or_else(|e| e.into_inner()) = Some(a);
                    }
                }
                Ok(None) => return if out.is_none() { Session::QueueClosed } else { Session::Ended },
                Err(status) => {
                    if out.is_none() {
                        return Session::QueueClosed;
                    }
                    use tonic::Code;
                    if refused_for_good(&status) {
                        shared.rejected_streams.fetch_add(1, Ordering::Relaxed);
                        return Session::RefusedForGood(status);
                    }
                    if matches!(status.code(), Code::InvalidArgument | Code::FailedPrecondition | Code::ResourceExhausted) {
                        shared.rejected_streams.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(code = ?status.code(), message = status.message(), "stepwatch agent refused our markers; reconnecting");
                    } else {
                        tracing::debug!(code = ?status.code(), message = status.message(), "stream to the stepwatch agent ended; reconnecting");
                    }
                    return Session::Failed(status.to_string());
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unreachable_client(capacity: usize) -> Client {
        // No agent at this socket: nothing is ever sent.
        let mut options =
            ClientOptions::new("unix:///nonexistent/stepwatch.sock", Hello::default());
        options.queue_capacity = capacity;
        Client::start(options)
    }

    #[test]
    fn each_client_is_a_run_of_its_own_unless_the_hello_names_one() {
        let (a, b) = (unreachable_client(1), unreachable_client(1));
        assert!(!a.run_id().is_empty());
        assert_ne!(a.run_id(), b.run_id());
        let hello = Hello {
            run_id: "fit-7".into(),
            ..Hello::default()
        };
        let named = Client::start(ClientOptions::new("unix:///nonexistent/s.sock", hello));
        assert_eq!(named.run_id(), "fit-7");
    }

    #[test]
    fn the_bound_counts_markers_the_sender_took_out_of_the_queue() {
        let client = unreachable_client(3);
        // As if the sender held 3 markers in its next batch: the queue has
        // room, the bound does not.
        client.shared.unsent.store(3, Ordering::Relaxed);
        assert!(!client.mark_now(MarkerKind::StepBegin, 1, 0));
        assert_eq!(client.stats().dropped, 1);
    }

    #[test]
    fn markers_lost_with_a_broken_stream_are_dropped_and_free_the_bound() {
        let client = unreachable_client(3);
        client.shared.unsent.store(3, Ordering::Relaxed);
        client.shared.lost(3);
        assert_eq!(client.stats().dropped, 3);
        assert!(client.mark_now(MarkerKind::StepBegin, 1, 0));
    }
}
