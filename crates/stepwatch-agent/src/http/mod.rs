//! The HTTP adapter: /metrics, /healthz, /readyz and the JSON API.
//! Handlers read snapshots only; none calls NVML.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use stepwatch_core::{GpuSample, RankKey, RankState, StepRecord, Tracker};
use stepwatch_proto::clock::monotonic_ns;

use crate::export;
use crate::listen::{Closes, Limited, PeerQuota};
use crate::state::AgentState;

/// The HTTP listener's bounds (flags of the same names).
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections at once (`--max-http-connections`).
    pub max_connections: usize,
    /// Connections one address holds at once
    /// (`--max-http-connections-per-peer`): a peer cannot take every slot.
    pub max_connections_per_peer: usize,
    /// How long a request's headers may take to arrive, and a keep-alive
    /// connection may wait for its next request (`--http-header-timeout`).
    pub header_timeout: std::time::Duration,
    /// A connection silent this long is closed (`--idle-timeout`).
    pub idle_timeout: Option<std::time::Duration>,
}

/// Serves HTTP on a thread and runtime of its own until `stop` completes.
/// Ingest runs on the agent's two async workers and waits there for the
/// tracker lock; were HTTP served by the same workers, `/healthz` could wait
/// behind ingest that waits for the lock (the soak saw 30 s). Here the
/// runtime's one thread never takes the tracker lock: handlers that read the
/// tracker do it on the blocking pool ([`off_runtime`]). The returned
/// receiver answers when the server has stopped.
pub fn serve_on_own_thread(
    listener: std::net::TcpListener,
    routes: Routes,
    state: Arc<AgentState>,
    limits: HttpLimits,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::sync::oneshot::Receiver<std::io::Result<()>>> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let closes = Closes {
        counter: state.ingest.connections_closed.clone(),
        listener: routes.listener(),
    };
    std::thread::Builder::new()
        .name(format!("stepwatch-{}", routes.listener()))
        .spawn(move || {
            let served = runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let listener = Limited::new(listener, limits.max_connections, limits.idle_timeout)
                    .per_peer(PeerQuota::new(limits.max_connections_per_peer, usize::MAX))
                    .counted(closes.clone());
                serve(listener, router(state, routes), limits, closes, stop).await;
                Ok(())
            });
            let _ = done_tx.send(served);
        })?;
    Ok(done_rx)
}

/// Serves HTTP/1.1 connections until `stop`, then lets them finish.
/// hyper's own connection settings, which axum's `serve` does not expose:
/// without a header-read timeout, a client sending a byte a minute, or a
/// keep-alive connection left open, held its slot for minutes.
async fn serve(
    mut listener: Limited<tokio::net::TcpListener>,
    router: Router,
    limits: HttpLimits,
    closes: Closes,
    stop: impl std::future::Future<Output = ()>,
) {
    use axum::serve::Listener as _;
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(());
    let mut stop = std::pin::pin!(stop);
    loop {
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stop => break,
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let mut closing = closing_rx.clone();
        let closes = closes.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
            let mut conn = std::pin::pin!(conn);
            let served = tokio::select! {
                served = conn.as_mut() => served,
                _ = closing.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = served {
                if e.is_timeout() {
                    closes.count("header_timeout");
                }
                tracing::debug!(error = %e, "an HTTP connection ended with an error");
            }
        });
    }
    drop(closing_rx);
    // Connections finish their requests; each holds a receiver until then.
    let _ = closing_tx.send(());
    closing_tx.closed().await;
}

/// What one listener serves. With `--api-listen` the JSON API (which names
/// tenants' jobs and pods) and the page at `/` that reads it get a listener
/// of their own, so that they can be exposed, authorised or firewalled apart
/// from `/metrics` and the probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routes {
    /// `/metrics`, `/healthz`, `/readyz`, `/api/v1` and the page (no `--api-listen`).
    All,
    /// `/metrics`, `/healthz`, `/readyz` only.
    Monitoring,
    /// `/api/v1` and the page only (`--api-listen`).
    Api,
    /// `/healthz` and `/readyz` only (`--probe-listen`).
    Probes,
}

impl Routes {
    /// The listener's name in logs, thread names and the
    /// `listener` label of `stepwatch_connections_closed_total`.
    pub fn listener(self) -> &'static str {
        match self {
            Routes::All | Routes::Monitoring => "http",
            Routes::Api => "api",
            Routes::Probes => "probe",
        }
    }
}

pub fn router(state: Arc<AgentState>, routes: Routes) -> Router {
    let mut router = Router::new();
    if routes != Routes::Api {
        router = router
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz));
    }
    if matches!(routes, Routes::All | Routes::Monitoring) {
        router = router.route("/metrics", get(metrics));
    }
    if matches!(routes, Routes::All | Routes::Api) {
        router = router
            .route("/api/v1/jobs", get(jobs))
            .route("/api/v1/jobs/{job}", get(job))
            .route("/api/v1/jobs/{job}/ranks/{rank}", get(rank))
            .route("/api/v1/gpus", get(gpus))
            .route("/api/v1/gpus/{gpu}/samples", get(gpu_samples))
            .merge(crate::ui::routes());
    }
    router.with_state(state)
}

async fn metrics(State(state): State<Arc<AgentState>>) -> Response {
    let body = off_runtime(state, export::render).await;
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// Ready once ingest listens: what a training pod on the node needs, and
/// what a DaemonSet rollout waits for. NVML is not a condition: a node with a
/// sick GPU must not stall a rollout across the fleet; its NVML health is
/// `stepwatch_nvml_up` and the StepwatchNVMLDown alert. The body's second
/// line says how NVML is (`nvml: up`, or `nvml: down: <why>`), for a
/// caller that needs GPU samples before it starts.
async fn readyz(State(state): State<Arc<AgentState>>) -> Response {
    let (nvml_up, nvml_status) = state.sampler.nvml_status();
    let nvml = if nvml_up {
        "nvml: up".to_string()
    } else {
        format!("nvml: down: {nvml_status}")
    };
    if state.ingest_listening.load(Ordering::Relaxed) {
        (StatusCode::OK, format!("ready\n{nvml}\n")).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: ingest: not listening\n{nvml}\n"),
        )
            .into_response()
    }
}

/// Runs `f` (which reads the tracker) on the blocking pool: the tracker's
/// lock is never waited for on the thread that answers `/healthz`.
async fn off_runtime<R: Send + 'static>(
    state: Arc<AgentState>,
    f: impl FnOnce(&AgentState) -> R + Send + 'static,
) -> R {
    match tokio::task::spawn_blocking(move || f(&state)).await {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

async fn jobs(State(state): State<Arc<AgentState>>) -> Json<Value> {
    let keys = off_runtime(state.clone(), |s| s.read_tracker(Tracker::rank_keys)).await;
    let mut jobs: Vec<(String, String, Vec<u32>)> = Vec::new();
    for key in &keys {
        match jobs.last_mut() {
            Some((ns, job, ranks)) if *job == key.job && *ns == key.namespace => {
                ranks.push(key.rank)
            }
            _ => jobs.push((key.namespace.clone(), key.job.clone(), vec![key.rank])),
        }
    }
    Json(json!({
        "node": state.node,
        "jobs": jobs
            .into_iter()
            .map(|(namespace, job, ranks)| json!({"namespace": namespace, "job": job, "ranks": ranks}))
            .collect::<Vec<_>>(),
    }))
}

/// `?namespace=`: jobs are told apart by namespace as well as id; without
/// it, the job outside any namespace (ranks not in Kubernetes).
#[derive(Deserialize)]
struct JobQuery {
    #[serde(default)]
    namespace: String,
}

async fn job(
    State(state): State<Arc<AgentState>>,
    Path(job): Path<String>,
    Query(query): Query<JobQuery>,
) -> Response {
    let ns = query.namespace;
    let (ranks, divergence, ns, job) = off_runtime(state.clone(), move |s| {
        let keys: Vec<RankKey> =
            s.read_tracker(|t| t.job_ranks(&ns, &job).map(|(k, _)| k.clone()).collect());
        // One rank's analysis per lock hold (see `AgentState::read_tracker`).
        let ranks: Vec<Value> = keys
            .iter()
            .filter_map(|key| {
                s.read_tracker(|t| {
                    let r = t.rank(key)?;
                    let mut summary = rank_summary(key, r);
                    summary["figures"] = rank_figures(t, key, r);
                    Some(summary)
                })
            })
            .collect();
        let divergence = s.read_tracker(|t| t.job_divergence(&ns, &job));
        (ranks, divergence, ns, job)
    })
    .await;
    if ranks.is_empty() {
        return not_found(format!("no job {job:?} in namespace {ns:?} on this node"));
    }
    Json(json!({"node": state.node, "namespace": ns, "job": job, "ranks": ranks, "divergence": divergence}))
        .into_response()
}

#[derive(Deserialize)]
struct RankQuery {
    /// The job's namespace; see [`JobQuery`].
    #[serde(default)]
    namespace: String,
    /// Only the latest N steps (step 1 is always included); default
    /// [`DEFAULT_REPORT_STEPS`], at most [`MAX_REPORT_STEPS`].
    steps: Option<usize>,
}

/// Steps a rank report holds unless `?steps=` says otherwise.
const DEFAULT_REPORT_STEPS: usize = 100;
/// Most steps one rank report may hold: the report's steps are copied out
/// of the tracker whole (its JSON is streamed).
const MAX_REPORT_STEPS: usize = 1000;

async fn rank(
    State(state): State<Arc<AgentState>>,
    Path((job, rank)): Path<(String, String)>,
    Query(query): Query<RankQuery>,
) -> Response {
    let Ok(rank) = rank.parse::<u32>() else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": format!("rank {rank:?} is not a number")})),
        )
            .into_response();
    };
    let steps = query.steps.unwrap_or(DEFAULT_REPORT_STEPS);
    if steps > MAX_REPORT_STEPS {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": format!("steps={steps} is more than {MAX_REPORT_STEPS}; ask for fewer")})),
        )
            .into_response();
    }
    let key = RankKey {
        namespace: query.namespace,
        job,
        rank,
    };
    // Room in the reports budget first (a long job's report is megabytes,
    // built in memory): many at once wait, then are refused.
    let estimate = off_runtime(state.clone(), {
        let key = key.clone();
        move |state| {
            state.read_tracker(|tracker| {
                let r = tracker.rank(&key)?;
                let start = r.timeline.steps().len().saturating_sub(steps);
                let held: u64 = r
                    .timeline
                    .steps()
                    .enumerate()
                    .filter(|(i, _)| *i == 0 || *i >= start)
                    .map(|(_, s)| s.approx_bytes())
                    .sum();
                Some(report_cost(held))
            })
        }
    })
    .await;
    let permit = match (estimate, state.reports.get()) {
        (Some(bytes), Some(budget)) => match budget.reserve(bytes).await {
            Ok(permit) => Some(permit),
            Err(refusal) => return report_refused(refusal, bytes, budget.bytes(), steps),
        },
        _ => None,
    };
    // Copy out one rank under the tracker lock; serialise after it is
    // released. Samples the sampler took so far go in first, so that a
    // reader who saw a step end sees that step's last samples rather than
    // the ones of 100 ms ago.
    off_runtime(state, move |state| {
        state.attribute_samples();
        let body = state.read_tracker(|tracker| {
            let r = tracker.rank(&key)?;
            let retained = r.timeline.steps().len();
            let start = retained.saturating_sub(steps);
            Some(RankBody {
                summary: rank_summary(&key, r),
                node: state.node.clone(),
                analysis: tracker.rank_analysis(&key),
                advisories: r.advisories.clone(),
                prediction_before_step2: r.prediction_before_step2.clone(),
                memory_trend: tracker.memory_trend(&key).cloned(),
                memory_growth: tracker.memory_growth(&key),
                post_mortem: tracker.post_mortem(&key),
                passes: tracker.pass_peaks(&key),
                batches: tracker.step_batches(&key),
                steps: r
                    .timeline
                    .steps()
                    .enumerate()
                    .filter(|(i, _)| *i == 0 || *i >= start)
                    .map(|(_, s)| StepReport::from(s))
                    .collect(),
            })
        });
        match body {
            Some(body) => json_streamed(body, permit),
            None => not_found(format!(
                "no rank {} of job {:?} in namespace {:?} on this node",
                key.rank, key.job, key.namespace
            )),
        }
    })
    .await
}

/// What building and sending a report of steps holding `held` bytes (as
/// `StepRecord::approx_bytes` counts) costs at its peak: the copy taken
/// under the tracker lock, about twice that, and the chunks of its JSON on
/// their way (the JSON is never whole, see [`json_streamed`]).
fn report_cost(held: u64) -> u64 {
    held.saturating_mul(2) + (JSON_CHUNKS_IN_FLIGHT * JSON_CHUNK) as u64
}

/// The size of a streamed JSON response's chunks.
const JSON_CHUNK: usize = 64 << 10;

/// A streamed response's chunks that exist at once: the one being written,
/// those queued ([`json_streamed`]'s channel), the one being sent.
const JSON_CHUNKS_IN_FLIGHT: usize = 4;

/// A JSON response serialised as it is sent, a chunk at a time, on the
/// blocking pool: a large report is never held whole, and 16 readers of it
/// do not hold 16 copies of its JSON. The serialiser waits for the reader
/// (a slow one holds its chunks, not the document); `permit` is held until
/// the last chunk is queued, so slow readers keep counting against the
/// reports budget. A client that goes away stops the serialiser.
fn json_streamed(
    body: impl Serialize + Send + 'static,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel(JSON_CHUNKS_IN_FLIGHT - 2);
    tokio::task::spawn_blocking(move || {
        let mut out = ChunkSender {
            chunk: Vec::with_capacity(JSON_CHUNK),
            tx,
        };
        let written = serde_json::to_writer(&mut out, &body)
            .map_err(std::io::Error::from)
            .and_then(|()| out.send_chunk());
        if let Err(e) = written {
            // Gone, or (never seen) a value JSON cannot hold: the response
            // ends short, which its reader sees.
            tracing::debug!(error = %e, "a streamed JSON response ended early");
            let _ = out.tx.blocking_send(Err(e));
        }
        drop(permit);
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
        .into_response()
}

/// Where [`json_streamed`] writes: full chunks go to the response body.
struct ChunkSender {
    chunk: Vec<u8>,
    tx: tokio::sync::mpsc::Sender<std::io::Result<axum::body::Bytes>>,
}

impl ChunkSender {
    /// Hands the chunk written so far to the body, waiting for room.
    fn send_chunk(&mut self) -> std::io::Result<()> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        let full = std::mem::replace(&mut self.chunk, Vec::with_capacity(JSON_CHUNK));
        self.tx.blocking_send(Ok(full.into())).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the reader went away")
        })
    }
}

impl std::io::Write for ChunkSender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.chunk.extend_from_slice(buf);
        if self.chunk.len() >= JSON_CHUNK {
            self.send_chunk()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The 503 of a report the reports budget has no room for.
fn report_refused(
    refusal: crate::memory::ReportRefusal,
    bytes: u64,
    budget: u64,
    steps: usize,
) -> Response {
    let error = match refusal {
        crate::memory::ReportRefusal::TooLarge => format!(
            "a report of {steps} steps needs about {bytes} bytes, more than the agent's reports budget ({budget} bytes, a twelfth of --memory-limit-mib); ask for fewer (?steps=)"
        ),
        crate::memory::ReportRefusal::Busy => format!(
            "other reports hold the agent's reports budget ({budget} bytes); retry shortly"
        ),
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "1")],
        Json(json!({ "error": error })),
    )
        .into_response()
}

/// `/api/v1/jobs/{job}/ranks/{rank}`: the rank's summary fields, then the rest.
#[derive(Serialize)]
struct RankBody {
    #[serde(flatten)]
    summary: Value,
    node: String,
    analysis: Option<stepwatch_core::RankAnalysis>,
    advisories: Vec<stepwatch_core::Advisory>,
    prediction_before_step2: Option<stepwatch_core::Prediction>,
    /// The trailing window after step 2 and each figure's slope.
    memory_trend: Option<stepwatch_core::MemoryTrend>,
    /// When growing memory reaches capacity (after step 2).
    memory_growth: Option<stepwatch_core::GrowthForecast>,
    /// Why the rank died, when its latest step died of OOM.
    post_mortem: Option<stepwatch_core::PostMortem>,
    /// Evaluation passes and checkpoint saves per kind: peaks and their
    /// own headroom, apart from the steps.
    passes: Vec<stepwatch_core::PassPeaks>,
    /// The steps' batches: relation, largest seen, the loader's outlook.
    batches: Option<stepwatch_core::StepBatches>,
    steps: Vec<StepReport>,
}

fn rank_summary(key: &RankKey, r: &RankState) -> Value {
    json!({
        "namespace": key.namespace,
        "job": key.job,
        "rank": key.rank,
        "info": r.info,
        "connected": r.connected_streams > 0,
        "steps_completed": r.timeline.steps_completed(),
        "ooms": r.timeline.ooms(),
        "allocator_retries": r.allocator_retries,
        "last_step": r.timeline.current().map(|s| s.step),
    })
}

/// The figures a job's page compares across ranks (`figures` of each rank
/// in `/api/v1/jobs/{job}`): step-1, steady and predicted peaks, capacity,
/// headroom, and the advisories, so that a job's view is one request, not
/// one full rank report per rank.
fn rank_figures(tracker: &Tracker, key: &RankKey, r: &RankState) -> Value {
    let analysis = tracker.rank_analysis(key);
    let a = analysis.as_ref();
    let prediction = a.and_then(|a| a.prediction.as_ref());
    json!({
        "first_step_peak_bytes": a.and_then(|a| a.first_step.as_ref()).and_then(|f| f.device_peak_bytes),
        "steady_peak_bytes": a.and_then(|a| a.steady.as_ref()).and_then(|s| s.nvml_peak_bytes),
        "steady_reached": a.is_some_and(|a| a.steady_state.reached),
        "predicted_peak_bytes": prediction.map(|p| p.predicted_peak_bytes),
        "headroom_bytes": prediction.and_then(|p| p.headroom_bytes),
        "oom_risk": prediction.is_some_and(|p| p.oom_risk),
        "low_headroom": prediction.is_some_and(|p| p.low_headroom),
        "provisional": prediction.is_some_and(|p| p.provisional),
        "capacity_bytes": a.map(|a| a.capacity_bytes),
        "advisories": r.advisories,
    })
}

/// `/api/v1/gpus`: every GPU the sampler found, with its latest reading,
/// the processes NVML lists on it (matched to ranks by PID) and the ranks
/// whose hello named it. Reads the sampler's snapshot, never NVML.
async fn gpus(State(state): State<Arc<AgentState>>) -> Json<Value> {
    let (snapshot, ranks) = off_runtime(state.clone(), |s| {
        let now = monotonic_ns();
        let ranks: Vec<(String, u32, RankKey)> = s.read_tracker(|t| {
            t.ranks()
                .map(|(k, r)| (r.info.gpu_uuid.clone(), r.info.pid, k.clone()))
                .collect()
        });
        (s.sampler.snapshot(now), ranks)
    })
    .await;
    let key_json = |k: &RankKey| json!({"namespace": k.namespace, "job": k.job, "rank": k.rank});
    let gpus: Vec<Value> = snapshot
        .gpus
        .iter()
        .map(|g| {
            let on_gpu = || ranks.iter().filter(|(uuid, _, _)| *uuid == g.uuid);
            json!({
                "index": g.index,
                "uuid": g.uuid,
                "mig": g.mig.as_ref().map(|m| json!({
                    "parent_uuid": m.parent_uuid,
                    "gpu_instance_id": m.gpu_instance_id,
                    "profile": m.profile,
                })),
                "name": g.name,
                "total_bytes": g.total_bytes,
                "capacity_bytes": g.last.map(|l| l.usable_bytes()),
                "used_bytes": g.last.map(|l| l.used_bytes),
                "used_max_bytes": g.used_max_bytes,
                "up": g.up,
                "stale": g.stale,
                "utilization_percent": g.utilization_percent.map(|(gpu, mem)| json!({"gpu": gpu, "memory": mem})),
                "processes": g.processes.iter().map(|p| json!({
                    "pid": p.pid,
                    "used_bytes": p.used_bytes,
                    "rank": on_gpu().find(|(_, pid, _)| *pid == p.pid).map(|(_, _, k)| key_json(k)),
                })).collect::<Vec<_>>(),
                "ranks": on_gpu().map(|(_, _, k)| key_json(k)).collect::<Vec<_>>(),
            })
        })
        .collect();
    Json(json!({
        "node": state.node,
        "nvml_up": snapshot.nvml_up,
        "nvml_status": snapshot.status,
        "gpus": gpus,
    }))
}

/// `?seconds=` (the latest S seconds) or `?from_ns=&to_ns=` (a range of
/// CLOCK_MONOTONIC ns, e.g. one step), and `?points=` (buckets).
#[derive(Deserialize)]
struct SamplesQuery {
    seconds: Option<f64>,
    from_ns: Option<u64>,
    to_ns: Option<u64>,
    points: Option<usize>,
}

/// Buckets of a series unless `?points=` says otherwise: about one per
/// pixel of a laptop-wide chart's plot area.
const DEFAULT_SERIES_POINTS: usize = 300;
/// Most buckets one series may hold: the answer is bounded whatever is asked.
const MAX_SERIES_POINTS: usize = 2000;
/// Longest range one series may cover; the agent holds less than this
/// anyway (`max_samples_per_gpu`, 60 s at 100 Hz).
const MAX_SERIES_SECONDS: f64 = 3600.0;

/// `/api/v1/gpus/{gpu}/samples`: a GPU's memory series (by UUID or NVML
/// index) from the tracker's sample window, downsampled to min/max buckets
/// (peaks kept). The window's samples in range are copied out under the
/// lock; bucketing and serialising happen after it is released.
async fn gpu_samples(
    State(state): State<Arc<AgentState>>,
    Path(gpu): Path<String>,
    Query(query): Query<SamplesQuery>,
) -> Response {
    let bad = |m: String| (StatusCode::BAD_REQUEST, Json(json!({"error": m}))).into_response();
    let points = query.points.unwrap_or(DEFAULT_SERIES_POINTS);
    if points == 0 || points > MAX_SERIES_POINTS {
        return bad(format!(
            "points={points} is out of range; ask for 1 to {MAX_SERIES_POINTS}"
        ));
    }
    let now = monotonic_ns();
    let (from_ns, to_ns) = match (query.seconds, query.from_ns, query.to_ns) {
        (Some(secs), None, None) => {
            if !(secs > 0.0 && secs <= MAX_SERIES_SECONDS) {
                return bad(format!(
                    "seconds={secs} is out of range; ask for more than 0 and at most {MAX_SERIES_SECONDS}"
                ));
            }
            // One bucket past now, so the newest sample has a bucket.
            let to = now.saturating_add(1);
            (to.saturating_sub((secs * 1e9) as u64), to)
        }
        (None, Some(from), Some(to)) => {
            if from >= to || (to - from) as f64 > MAX_SERIES_SECONDS * 1e9 {
                return bad(format!(
                    "from_ns={from} to_ns={to}: from_ns must be before to_ns, at most {MAX_SERIES_SECONDS} s apart"
                ));
            }
            (from, to)
        }
        (None, None, None) => (now.saturating_sub(60_000_000_000), now.saturating_add(1)),
        _ => return bad("give either seconds= or both from_ns= and to_ns=, not a mix".to_string()),
    };
    off_runtime(state, move |s| {
        let snapshot = s.sampler.snapshot(now);
        let found = snapshot
            .gpus
            .iter()
            .find(|g| g.uuid == gpu || g.index.to_string() == gpu);
        // A GPU the sampler no longer lists (lost) keeps its samples here.
        let uuid = found.map_or(gpu.as_str(), |g| g.uuid.as_str());
        let (window, held_from_ns): (Vec<GpuSample>, Option<u64>) = s.read_tracker(|t| {
            let held_from = t.samples_since(uuid, 0).next().map(|x| x.monotonic_ns);
            let window = t
                .samples_since(uuid, from_ns)
                .take_while(|x| x.monotonic_ns < to_ns)
                .copied()
                .collect();
            (window, held_from)
        });
        if found.is_none() && held_from_ns.is_none() {
            let known: Vec<&str> = snapshot.gpus.iter().map(|g| g.uuid.as_str()).collect();
            return not_found(format!(
                "no GPU {gpu:?} on this node (GPUs, by UUID or index: {})",
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            ));
        }
        let buckets = stepwatch_core::downsample_min_max(&window, from_ns, to_ns, points);
        Json(json!({
            "node": s.node,
            "gpu": {"index": found.map(|g| g.index), "uuid": uuid, "name": found.map(|g| g.name.as_str())},
            "now_ns": now,
            "from_ns": from_ns,
            "to_ns": to_ns,
            "held_from_ns": held_from_ns,
            "bucket_ns": stepwatch_core::bucket_width_ns(from_ns, to_ns, points),
            "samples": window.len(),
            "capacity_bytes": window.last().map(|x| x.capacity_bytes).or(found.and_then(|g| g.last).map(|l| l.usable_bytes())),
            "total_bytes": found.map(|g| g.total_bytes),
            "points": buckets.iter().map(|b| [b.start_ns, b.min_bytes, b.max_bytes]).collect::<Vec<_>>(),
        }))
        .into_response()
    })
    .await
}

fn not_found(message: String) -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"error": message}))).into_response()
}

/// One step in the JSON timeline, with what a step-anatomy plot needs.
#[derive(Serialize)]
struct StepReport {
    step: u64,
    outcome: stepwatch_core::StepOutcome,
    complete: bool,
    begin_monotonic_ns: u64,
    begin_wall_ns: u64,
    duration_seconds: Option<f64>,
    nvml_peak_bytes: Option<u64>,
    /// The largest batch the step's markers carried, when the client said.
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<stepwatch_core::BatchFacts>,
    phases: Vec<PhaseReport>,
}

#[derive(Serialize)]
struct PhaseReport {
    phase: stepwatch_core::PhaseKind,
    micro_batch: u32,
    start_monotonic_ns: u64,
    duration_seconds: Option<f64>,
    nvml_samples: u64,
    nvml_peak_bytes: Option<u64>,
    nvml_mean_bytes: Option<u64>,
    allocator_at_start: Option<stepwatch_core::AllocatorStats>,
    allocator_at_end: Option<stepwatch_core::AllocatorStats>,
}

impl From<&StepRecord> for StepReport {
    fn from(s: &StepRecord) -> Self {
        Self {
            step: s.step,
            outcome: s.outcome,
            complete: s.outcome == stepwatch_core::StepOutcome::Completed,
            begin_monotonic_ns: s.begin_monotonic_ns,
            begin_wall_ns: s.begin_wall_ns,
            duration_seconds: s.duration_ns().map(|ns| ns as f64 / 1e9),
            nvml_peak_bytes: s.nvml_peak_bytes(),
            batch: s.batch.clone(),
            phases: s
                .phases
                .iter()
                .map(|p| PhaseReport {
                    phase: p.phase,
                    micro_batch: p.micro_batch,
                    start_monotonic_ns: p.start_monotonic_ns,
                    duration_seconds: p.duration_ns().map(|ns| ns as f64 / 1e9),
                    nvml_samples: p.nvml.samples,
                    nvml_peak_bytes: (p.nvml.samples > 0).then_some(p.nvml.peak_bytes),
                    nvml_mean_bytes: p.nvml.mean_bytes(),
                    allocator_at_start: p.allocator_at_start,
                    allocator_at_end: p.allocator_at_end,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST_LIMITS: HttpLimits = HttpLimits {
        max_connections: 16,
        max_connections_per_peer: 16,
        header_timeout: std::time::Duration::from_secs(5),
        idle_timeout: None,
    };
    use crate::state::{test_marker, test_rank, test_state};
    use std::io::{Read, Write};
    use std::sync::mpsc;
    use std::time::Duration;
    use stepwatch_core::MarkerKind;

    /// Long enough for a loaded 2-core machine; it only bounds a failure.
    const WAIT: Duration = Duration::from_secs(60);

    fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        conn.set_read_timeout(Some(WAIT)).unwrap();
        write!(
            conn,
            "GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut response = String::new();
        let _ = conn.read_to_string(&mut response);
        response
    }

    /// Serves `state` on a port of its own until the returned sender is dropped.
    fn serve(state: Arc<AgentState>) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        serve_on_own_thread(listener, Routes::All, state, TEST_LIMITS, async {
            let _ = stop_rx.await;
        })
        .unwrap();
        (addr, stop_tx)
    }

    /// The status code and JSON body of a GET.
    fn get_json(addr: std::net::SocketAddr, path: &str) -> (u16, Value) {
        let response = get(addr, path);
        let code = response[9..12].parse().unwrap();
        let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
        // The body is chunked or not; the JSON is the part between braces.
        let json = &body[body.find('{').unwrap()..=body.rfind('}').unwrap()];
        (code, serde_json::from_str(json).unwrap())
    }

    const GPU: &str = "GPU-test";

    /// A rank whose steps each hold 1022 phases with allocator figures on
    /// every marker: the largest report per step a client can cause.
    fn wide_rank(state: &AgentState, steps: u64) -> RankKey {
        let key = test_rank(state, "wide", 0);
        let stats = stepwatch_core::AllocatorStats {
            allocated_bytes: 1 << 49,
            allocated_peak_bytes: 1 << 49,
            reserved_bytes: 1 << 49,
            reserved_peak_bytes: 1 << 49,
            active_bytes: 1 << 49,
            active_peak_bytes: 1 << 49,
            num_alloc_retries: 1 << 40,
        };
        let mut t = 2_000;
        for step in 1..=steps {
            let mut markers = Vec::new();
            if step > 1 {
                markers.push(test_marker(MarkerKind::StepBegin, step, t));
            }
            for mb in 0..510 {
                for kind in [MarkerKind::ForwardBegin, MarkerKind::BackwardBegin] {
                    t += 1_000;
                    let mut m = test_marker(kind, step, t);
                    m.micro_batch = mb;
                    markers.push(m);
                }
            }
            for kind in [
                MarkerKind::OptimizerBegin,
                MarkerKind::OptimizerEnd,
                MarkerKind::StepEnd,
            ] {
                t += 1_000;
                markers.push(test_marker(kind, step, t));
            }
            for m in &mut markers {
                m.allocator = Some(stats);
            }
            state.apply_markers(&key, "", &markers).unwrap();
        }
        key
    }

    #[test]
    fn a_reports_estimated_cost_covers_its_copy_and_its_chunks_in_flight() {
        let state = test_state();
        let key = wide_rank(&state, 3);
        let held = state.read_tracker(|t| t.rank(&key).unwrap().timeline.approx_bytes());
        let (addr, _stop) = serve(state);
        let response = get(addr, "/api/v1/jobs/wide/ranks/0");
        assert!(response.starts_with("HTTP/1.1 200"), "{}", &response[..200]);
        let json = response.split("\r\n\r\n").nth(1).unwrap().len() as u64;
        let copy = held * std::mem::size_of::<PhaseReport>() as u64
            / std::mem::size_of::<stepwatch_core::PhaseRecord>() as u64;
        // The JSON is larger than one chunk, so it was never held whole.
        let chunks = (JSON_CHUNKS_IN_FLIGHT * JSON_CHUNK) as u64;
        assert!(json > chunks, "json {json}");
        assert!(
            copy + chunks <= report_cost(held),
            "json {json} copy {copy} estimate {}",
            report_cost(held)
        );
    }

    #[test]
    fn a_report_larger_than_the_reports_budget_is_refused_with_what_to_do() {
        let state = test_state();
        // A 16 MiB limit: 1.3 MiB for reports, room for the wide step 1
        // alone (0.8 MB estimated) but not for three steps (1.9 MB).
        let budget = crate::memory::MemoryBudget::split(
            16 << 20,
            crate::memory::LimitSource::Flag,
            None,
            None,
        );
        state.set_memory_budget(&budget).unwrap();
        wide_rank(&state, 3);
        let (addr, _stop) = serve(state.clone());
        let (code, body) = get_json(addr, "/api/v1/jobs/wide/ranks/0");
        assert_eq!(code, 503, "{body}");
        assert!(
            body["error"].as_str().unwrap().contains("?steps="),
            "{body}"
        );
        let response = get(addr, "/api/v1/jobs/wide/ranks/0?steps=0");
        assert!(response.starts_with("HTTP/1.1 200"), "{}", &response[..200]);
        let refused = crate::metrics::HTTP_REPORTS_REFUSED_TOTAL.name;
        let text = crate::export::render(&state);
        assert!(
            text.contains(&format!(
                "{refused}{{reason=\"too_large\",node=\"test-node\"}} 1"
            )),
            "{text}"
        );
    }

    #[test]
    fn a_gpu_series_is_bounded_and_keeps_the_peak_of_each_bucket() {
        let state = test_state();
        // 1000 samples 1 ms apart ending just before now, at 10 bytes, with
        // one 1 ms spike of 999 bytes in the middle.
        let end = monotonic_ns();
        let start = end - 1_000_000_000;
        let samples: Vec<GpuSample> = (0..1000u64)
            .map(|i| GpuSample {
                monotonic_ns: start + i * 1_000_000,
                used_bytes: if i == 500 { 999 } else { 10 },
                capacity_bytes: 5000,
            })
            .collect();
        state.test_gpu_samples(GPU, &samples);
        let (addr, _stop) = serve(state);

        // 10 buckets of 100 ms over the second: the spike is the 6th's max.
        let path = format!(
            "/api/v1/gpus/{GPU}/samples?from_ns={start}&to_ns={}&points=10",
            start + 1_000_000_000
        );
        let (code, body) = get_json(addr, &path);
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["samples"], 1000);
        assert_eq!(body["bucket_ns"], 100_000_000);
        assert_eq!(body["capacity_bytes"], 5000);
        let points = body["points"].as_array().unwrap();
        assert_eq!(points.len(), 10);
        let maxes: Vec<u64> = points.iter().map(|p| p[2].as_u64().unwrap()).collect();
        assert_eq!(maxes, [10, 10, 10, 10, 10, 999, 10, 10, 10, 10]);
        assert!(points.iter().all(|p| p[1] == 10), "{body}");
        assert_eq!(points[5][0], start + 500_000_000);

        // The latest 60 s in 1 bucket: still the spike.
        let (code, body) = get_json(
            addr,
            &format!("/api/v1/gpus/{GPU}/samples?seconds=60&points=1"),
        );
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["points"][0][2], 999, "{body}");
        assert_eq!(body["samples"], 1000);
    }

    #[test]
    fn a_gpu_series_refuses_unbounded_or_unclear_requests_and_unknown_gpus() {
        let state = test_state();
        state.test_gpu_samples(
            GPU,
            &[GpuSample {
                monotonic_ns: 1,
                used_bytes: 1,
                capacity_bytes: 2,
            }],
        );
        let (addr, _stop) = serve(state);
        for (query, says) in [
            ("points=0", "points=0 is out of range"),
            ("points=2001", "points=2001 is out of range"),
            ("seconds=0", "seconds=0 is out of range"),
            ("seconds=3601", "seconds=3601 is out of range"),
            ("from_ns=5&to_ns=5", "from_ns must be before to_ns"),
            ("from_ns=0&to_ns=3600000000001", "at most 3600 s apart"),
            ("seconds=5&from_ns=1&to_ns=2", "not a mix"),
            ("from_ns=1", "not a mix"),
        ] {
            let (code, body) = get_json(addr, &format!("/api/v1/gpus/{GPU}/samples?{query}"));
            assert_eq!(code, 400, "{query}: {body}");
            let error = body["error"].as_str().unwrap();
            assert!(error.contains(says), "{query}: {error}");
        }
        let (code, body) = get_json(addr, "/api/v1/gpus/GPU-nope/samples");
        assert_eq!(code, 404, "{body}");
        let error = body["error"].as_str().unwrap();
        assert!(
            error.contains(r#"no GPU "GPU-nope" on this node"#),
            "{error}"
        );
        // The largest range and bucket count allowed are answered.
        let (code, body) = get_json(
            addr,
            &format!("/api/v1/gpus/{GPU}/samples?from_ns=0&to_ns=3600000000000&points=2000"),
        );
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["points"], serde_json::json!([[0, 1, 1]]));
    }

    #[test]
    fn the_page_and_its_assets_are_served_from_the_binary() {
        let (addr, _stop) = serve(test_state());
        for (path, kind, has) in [
            ("/", "text/html", r#"<script src="/ui/app.js">"#),
            ("/ui/app.js", "text/javascript", "/api/v1/gpus"),
            ("/ui/style.css", "text/css", "svg.chart"),
        ] {
            let response = get(addr, path);
            assert!(response.starts_with("HTTP/1.1 200"), "{path}: {response}");
            assert!(
                response
                    .to_ascii_lowercase()
                    .contains(&format!("content-type: {kind}")),
                "{path}: {response}"
            );
            assert!(response.contains(has), "{path}");
        }
    }

    #[test]
    fn healthz_answers_while_ingest_waits_for_the_tracker_lock() {
        // The soak saw /healthz take 30 s: ingest on both async workers
        // waited for the tracker lock, and HTTP shared those workers. Here
        // the lock is held throughout and both workers are stuck in ingest.
        let state = test_state();
        // One rank per ingest task: which task gets the lock first is up to
        // the runtime, and one rank's markers must not go back in time.
        let keys = [test_rank(&state, "j", 0), test_rank(&state, "j", 1)];
        // The agent's runtime: two workers. Made first so that, should the
        // test fail, the lock is released before the runtime waits for them.
        let workers = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (held_tx, held_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let holder = {
            let state = state.clone();
            std::thread::spawn(move || {
                state.read_tracker(|_| {
                    held_tx.send(()).unwrap();
                    let _ = release_rx.recv();
                })
            })
        };
        held_rx.recv_timeout(WAIT).unwrap();
        let (entered_tx, entered_rx) = mpsc::channel();
        let ingest: Vec<_> = (0..2u64)
            .map(|i| {
                let (state, key, entered) =
                    (state.clone(), keys[i as usize].clone(), entered_tx.clone());
                workers.spawn(async move {
                    entered.send(()).unwrap();
                    let batch = [test_marker(MarkerKind::ForwardBegin, 1, 2_000)];
                    state.apply_markers(&key, "", &batch).is_ok()
                })
            })
            .collect();
        // Each task blocks its worker once started, so two started tasks
        // are on two workers: the runtime has none left.
        for _ in 0..2 {
            entered_rx.recv_timeout(WAIT).unwrap();
        }

        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let served = workers.block_on(async {
            serve_on_own_thread(listener, Routes::All, state.clone(), TEST_LIMITS, async {
                let _ = stop_rx.await;
            })
        });
        let served = served.unwrap();
        let response = get(addr, "/healthz");
        assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
        assert!(response.ends_with("ok\n"), "{response:?}");

        release_tx.send(()).unwrap();
        holder.join().unwrap();
        for task in ingest {
            assert!(workers.block_on(task).unwrap());
        }
        // Served again now that the lock is free: a tracker read.
        let jobs = get(addr, "/api/v1/jobs");
        assert!(jobs.contains(r#""ranks":[0,1]"#), "{jobs:?}");
        stop_tx.send(()).unwrap();
        assert!(served.blocking_recv().unwrap().is_ok());
    }
}
