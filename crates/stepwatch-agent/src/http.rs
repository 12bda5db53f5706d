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
use stepwatch_core::{RankKey, RankState, StepRecord};

use crate::exporter;
use crate::state::AgentState;

pub fn router(state: Arc<AgentState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/api/v1/jobs", get(jobs))
        .route("/api/v1/jobs/{job}", get(job))
        .route("/api/v1/jobs/{job}/ranks/{rank}", get(rank))
        .with_state(state)
}

async fn metrics(State(state): State<Arc<AgentState>>) -> Response {
    // Rendering takes the tracker lock briefly; keep it off the async workers.
    let body = tokio::task::spawn_blocking(move || exporter::render(&state))
        .await
        .unwrap_or_default();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn readyz(State(state): State<Arc<AgentState>>) -> Response {
    let (nvml_up, nvml_status) = state.sampler.nvml_status();
    let ingest = state.ingest_listening.load(Ordering::Relaxed);
    if nvml_up && ingest {
        return (StatusCode::OK, "ready\n").into_response();
    }
    let mut why = Vec::new();
    if !nvml_up {
        why.push(format!("nvml: {nvml_status}"));
    }
    if !ingest {
        why.push("ingest: not listening".to_string());
    }
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("not ready: {}\n", why.join("; ")),
    )
        .into_response()
}

async fn jobs(State(state): State<Arc<AgentState>>) -> Json<Value> {
    let tracker = state.tracker();
    let mut jobs: Vec<(String, String, Vec<u32>)> = Vec::new();
    for (key, _) in tracker.ranks() {
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
    let tracker = state.tracker();
    let ns = query.namespace;
    let ranks: Vec<Value> = tracker
        .job_ranks(&ns, &job)
        .map(|(k, r)| rank_summary(k, r))
        .collect();
    if ranks.is_empty() {
        return not_found(format!("no job {job:?} in namespace {ns:?} on this node"));
    }
    let divergence = tracker.job_divergence(&ns, &job);
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
    // Copy out under the tracker lock; serialize after it is released (the
    // timeline of a long job is megabytes of JSON).
    let body = {
        let tracker = state.tracker();
        let Some(r) = tracker.rank(&key) else {
            return not_found(format!(
                "no rank {} of job {:?} in namespace {:?} on this node",
                key.rank, key.job, key.namespace
            ));
        };
        let retained = r.timeline.steps().len();
        let start = retained.saturating_sub(steps);
        RankBody {
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
        }
    };
    Json(body).into_response()
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
