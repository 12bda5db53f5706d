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
use stepwatch_core::{RankKey, RankState, StepRecord, Tracker};

use crate::exporter;
use crate::listen::Limited;
use crate::state::AgentState;

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
    max_connections: usize,
    idle_timeout: Option<std::time::Duration>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::sync::oneshot::Receiver<std::io::Result<()>>> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(match routes {
            Routes::Api => "stepwatch-api".into(),
            _ => "stepwatch-http".into(),
        })
        .spawn(move || {
            let served = runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let listener = Limited::new(listener, max_connections, idle_timeout);
                axum::serve(listener, router(state, routes))
                    .with_graceful_shutdown(stop)
                    .await
            });
            let _ = done_tx.send(served);
        })?;
    Ok(done_rx)
}

/// What one listener serves. With `--api-listen` the JSON API (which names
/// tenants' jobs and pods) gets a listener of its own, so that it can be
/// exposed, authorised or firewalled apart from `/metrics` and the probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routes {
    /// `/metrics`, `/healthz`, `/readyz` and `/api/v1` (no `--api-listen`).
    All,
    /// `/metrics`, `/healthz`, `/readyz` only.
    Monitoring,
    /// `/api/v1` only (`--api-listen`).
    Api,
}

pub fn router(state: Arc<AgentState>, routes: Routes) -> Router {
    let mut router = Router::new();
    if routes != Routes::Api {
        router = router
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz));
    }
    if routes != Routes::Monitoring {
        router = router
            .route("/api/v1/jobs", get(jobs))
            .route("/api/v1/jobs/{job}", get(job))
            .route("/api/v1/jobs/{job}/ranks/{rank}", get(rank));
    }
    router.with_state(state)
}

async fn metrics(State(state): State<Arc<AgentState>>) -> Response {
    let body = off_runtime(state, exporter::render).await;
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
        s.read_tracker(|tracker| {
            let ranks: Vec<Value> = tracker
                .job_ranks(&ns, &job)
                .map(|(k, r)| rank_summary(k, r))
                .collect();
            let divergence = tracker.job_divergence(&ns, &job);
            (ranks, divergence, ns, job)
        })
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
/// Most steps one rank report may hold: the report is built in memory, and
/// many concurrent large ones once took the agent past a gigabyte.
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
    // Copy out one rank under the tracker lock; serialise after it is
    // released (the timeline of a long job is megabytes of JSON).
    off_runtime(state, move |state| {
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
            Some(body) => Json(body).into_response(),
            None => not_found(format!(
                "no rank {} of job {:?} in namespace {:?} on this node",
                key.rank, key.job, key.namespace
            )),
        }
    })
    .await
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
        "last_step": r.timeline.current().map(|s| s.step),
    })
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
                    state.apply_markers(&key, &batch).is_ok()
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
            serve_on_own_thread(listener, Routes::All, state.clone(), 16, None, async {
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
