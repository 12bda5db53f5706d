//! The fast path to Alertmanager (`--alertmanager-url`).
//!
//! The Prometheus path pages a step-2 OOM 30–90 s after the prediction
//! (scrape, rule evaluation, `group_wait`); the OOM itself can come seconds
//! later. So the agent posts the alerts its advisories stand for straight to
//! Alertmanager's v2 API, under the same alert name and label set as the
//! rule in deploy/prometheus/stepwatch-rules.yml: Alertmanager then holds
//! one alert whichever path delivered it first.
//!
//! Flow: a stream's [`RankAlerts`] turns advisories into firing alerts and
//! the end of the rank (or step 2 passing) into resolutions, and hands them
//! to one task through a bounded queue (`try_send`: ingest never waits; a
//! full queue is counted). The task keeps the active alerts, resends them
//! every `--alertmanager-resend-interval` with an `endsAt` a few intervals
//! ahead (so they resolve by themselves if the agent dies), and gives each
//! URL the latest state of every changed alert. One sender per URL posts,
//! retrying with bounded exponential backoff; alerts that change while it
//! waits are merged, so a retry never sends a stale state.

use crate::metrics;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::{IntCounterVec, IntGauge, Registry};
use stepwatch_core::{
    Advisory, AdvisoryKind, DivergenceFigure, Marker, MarkerKind, RankInfo, RankKey,
};
use stepwatch_proto::clock::monotonic_ns;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch, Notify};

/// Alert names, as the rules in deploy/prometheus/stepwatch-rules.yml name
/// them (a test reads the file): one place for the fast path's names.
pub const STEP2_OOM_ALERT: &str = "StepwatchStep2OOMPredicted";
/// See [`STEP2_OOM_ALERT`].
pub const LOW_HEADROOM_ALERT: &str = "StepwatchLowPredictedHeadroom";
/// See [`STEP2_OOM_ALERT`].
pub const PEAK_DIVERGENCE_ALERT: &str = "StepwatchFirstStepDivergence";
/// See [`STEP2_OOM_ALERT`].
pub const ACTIVATION_DIVERGENCE_ALERT: &str = "StepwatchFirstStepActivationDivergence";

/// Where the agent's alerts' `runbook_url` points by default: nowhere. The
/// runbooks (one page per alert) ship with the chart, the .deb and the
/// repository, but there is no public address to link; without a base URL
/// (`--alertmanager-runbook-base-url`) an alert names its page in a
/// `runbook` annotation instead of carrying a dead link.
pub const DEFAULT_RUNBOOK_BASE_URL: &str = "";

/// Labels of a per-rank alert besides `alertname` and `severity`: the rule
/// aggregates to exactly these (plus `cluster`, from `--alertmanager-label`), so
/// Alertmanager sees one label set from both paths. Empty values are left
/// out, as Prometheus does.
pub const RANK_ALERT_LABELS: [&str; 6] = [
    "namespace",
    "training_job",
    "rank",
    "pod",
    "container",
    "node",
];

/// Labels of a per-job alert (divergence) besides `alertname` and `severity`.
pub const JOB_ALERT_LABELS: [&str; 2] = ["namespace", "training_job"];

/// The rule an advisory stands for: its alert name and severity, and
/// whether it is about the rank or the whole job. None: no rule alerts on it.
pub fn alert_for(advisory: &Advisory) -> Option<(&'static str, &'static str, bool)> {
    match advisory.kind {
        AdvisoryKind::Step2OomPredicted => Some((STEP2_OOM_ALERT, "warning", true)),
        AdvisoryKind::LowHeadroom => Some((LOW_HEADROOM_ALERT, "warning", true)),
        AdvisoryKind::RankDivergence => match advisory.divergence.as_ref()?.figure {
            DivergenceFigure::Step1Peak => Some((PEAK_DIVERGENCE_ALERT, "warning", false)),
            DivergenceFigure::ActivationPeak => {
                Some((ACTIVATION_DIVERGENCE_ALERT, "warning", false))
            }
            _ => None,
        },
        // The Prometheus rule StepwatchAllocatorRetries covers it: it ends
        // when the retries stop, which a once-per-run advisory cannot say.
        AdvisoryKind::AllocatorRetries => None,
        // StepwatchLowObservedHeadroom covers it: it holds while the steady
        // peak stays high, and it ends, which a once-per-run advisory cannot.
        AdvisoryKind::LowObservedHeadroom => None,
        // StepwatchMemoryGrowthOOMForecast covers it: it fires inside its
        // horizon and ends when the growth stops, which the once-per-run
        // advisory, told as soon as growth is measured, cannot.
        AdvisoryKind::MemoryGrowth => None,
        // About the client's clock, not the job's memory.
        AdvisoryKind::ClientClock => None,
        // Information for the client (step 1's prediction is in), no alert.
        AdvisoryKind::PredictionFinal => None,
    }
}

/// How the fast path is set up (from the flags).
#[derive(Debug, Clone)]
pub struct AlertmanagerConfig {
    /// Alertmanager base URLs (`http://host:port[/prefix]`); all get every alert.
    pub urls: Vec<String>,
    /// Labels added to every alert (Prometheus's external labels, e.g. `cluster`).
    pub extra_labels: Vec<(String, String)>,
    /// Active alerts are posted again this often.
    pub resend_interval: Duration,
    /// `runbook_url` of an alert is `<this>/<alert>.md`, as the rule's.
    pub runbook_base_url: String,
    /// Node name, the `node` label.
    pub node: String,
}

/// One change of an alert, from ingest to the alert task.
#[derive(Debug)]
enum Change {
    /// The holder (a rank) says the alert holds.
    Fire {
        labels: Labels,
        annotations: Labels,
        holder: String,
        /// When the advisory was made: the alert's `startsAt`, so that
        /// Alertmanager's `updatedAt` minus it is the fast path's latency.
        since: SystemTime,
    },
    /// The holder no longer holds it; resolved when no holder is left.
    Release { labels: Labels, holder: String },
}

type Labels = BTreeMap<String, String>;

/// The metrics of the fast path.
#[derive(Clone)]
struct AlertMetrics {
    posts: IntCounterVec,
    dropped: IntCounterVec,
    active: IntGauge,
}

impl AlertMetrics {
    fn register(registry: &Registry, urls: &[String]) -> prometheus::Result<Self> {
        let posts =
            IntCounterVec::new(metrics::ALERTMANAGER_POSTS_TOTAL.opts(), &["url", "result"])?;
        let dropped = IntCounterVec::new(
            metrics::ALERTMANAGER_ALERTS_DROPPED_TOTAL.opts(),
            &["reason"],
        )?;
        let active = IntGauge::new(
            metrics::ALERTMANAGER_ALERTS_ACTIVE.name,
            metrics::ALERTMANAGER_ALERTS_ACTIVE.help,
        )?;
        registry.register(Box::new(posts.clone()))?;
        registry.register(Box::new(dropped.clone()))?;
        registry.register(Box::new(active.clone()))?;
        // Known label values exist from the start, at 0.
        for url in urls {
            for result in ["ok", "error"] {
                posts.with_label_values(&[url.as_str(), result]);
            }
        }
        for reason in ["queue_full", "pending_full"] {
            dropped.with_label_values(&[reason]);
        }
        Ok(Self {
            posts,
            dropped,
            active,
        })
    }
}

/// Changes waiting in ingest's queue to the alert task.
const QUEUE: usize = 1024;
/// Alerts an unreachable Alertmanager's sender keeps waiting (one per label set).
const MAX_PENDING: usize = 4096;
/// `endsAt` of a firing alert is this many resend intervals ahead.
const ENDS_AFTER_INTERVALS: u32 = 4;
/// Backoff of a failed POST: from the first to the last, doubling.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(10));
/// One POST's deadline (connect, send, status line).
const POST_TIMEOUT: Duration = Duration::from_secs(5);

/// Ingest's handle on the alert task; does nothing without `--alertmanager-url`.
#[derive(Clone)]
pub struct Alerter {
    inner: Option<Arc<AlerterInner>>,
}

struct AlerterInner {
    tx: mpsc::Sender<Change>,
    node: String,
    runbook_base_url: String,
    extra_labels: Vec<(String, String)>,
    metrics: AlertMetrics,
}

impl Alerter {
    /// The handle of an agent without `--alertmanager-url`.
    pub fn disabled() -> Self {
        Self { inner: None }
    }

    /// Registers the metrics and starts the alert task and one sender per
    /// URL; they stop when `stop` turns true. A URL that is not
    /// `http://host:port[/prefix]` is refused.
    pub fn start(
        config: AlertmanagerConfig,
        registry: &Registry,
        stop: watch::Receiver<bool>,
    ) -> anyhow::Result<Self> {
        if config.urls.is_empty() {
            return Ok(Self::disabled());
        }
        let targets = config
            .urls
            .iter()
            .map(|u| Target::parse(u))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let metrics = AlertMetrics::register(registry, &config.urls)?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let senders: Vec<Arc<Sender>> = targets
            .into_iter()
            .map(|target| {
                let sender = Arc::new(Sender {
                    target,
                    pending: Mutex::new(BTreeMap::new()),
                    wake: Notify::new(),
                });
                tokio::spawn(sender.clone().run(metrics.clone(), stop.clone()));
                sender
            })
            .collect();
        tokio::spawn(run_alerts(
            rx,
            senders,
            config.resend_interval,
            metrics.clone(),
            stop,
        ));
        Ok(Self {
            inner: Some(Arc::new(AlerterInner {
                tx,
                node: config.node,
                runbook_base_url: config.runbook_base_url,
                extra_labels: config.extra_labels,
                metrics,
            })),
        })
    }

    /// The alerts of one rank's stream.
    pub fn rank(&self, key: &RankKey, info: &RankInfo) -> RankAlerts {
        let Some(inner) = &self.inner else {
            return RankAlerts {
                alerter: self.clone(),
                rank_labels: Labels::new(),
                job_labels: Labels::new(),
                holder: String::new(),
                held: BTreeSet::new(),
            };
        };
        let rank = key.rank.to_string();
        let values = [
            key.namespace.as_str(),
            key.job.as_str(),
            rank.as_str(),
            info.pod.as_str(),
            info.container.as_str(),
            inner.node.as_str(),
        ];
        let labels = |names: &[&str]| -> Labels {
            let mut labels: Labels = inner.extra_labels.iter().cloned().collect();
            for (name, value) in RANK_ALERT_LABELS.iter().zip(values) {
                if names.contains(name) && !value.is_empty() {
                    labels.insert((*name).to_owned(), value.to_owned());
                }
            }
            labels
        };
        RankAlerts {
            alerter: self.clone(),
            rank_labels: labels(&RANK_ALERT_LABELS),
            job_labels: labels(&JOB_ALERT_LABELS),
            // Unique per rank on this node: a job's ranks share job alerts.
            holder: format!("{}/{}/{}", key.namespace, key.job, key.rank),
            held: BTreeSet::new(),
        }
    }

    fn send(&self, change: Change) {
        let Some(inner) = &self.inner else { return };
        // Never wait: ingest must not slow down for Alertmanager. A closed
        // queue is the agent stopping: the streams it cuts do not resolve
        // their alerts (the ranks may live on; the alerts lapse at endsAt).
        if let Err(mpsc::error::TrySendError::Full(_)) = inner.tx.try_send(change) {
            inner
                .metrics
                .dropped
                .with_label_values(&["queue_full"])
                .inc();
        }
    }
}

/// The alerts one rank's stream holds, so that they resolve when the rank
/// ends or step 2 passes.
pub struct RankAlerts {
    alerter: Alerter,
    rank_labels: Labels,
    job_labels: Labels,
    holder: String,
    /// Label sets this rank fired, with the alert's name.
    held: BTreeSet<(&'static str, Labels)>,
}

impl RankAlerts {
    /// Fires the alerts the advisories stand for (again, with fresh
    /// annotations, when an advisory is repeated).
    pub fn advise(&mut self, advisories: &[Advisory]) {
        if self.alerter.inner.is_none() {
            return;
        }
        for advisory in advisories {
            let Some((name, severity, per_rank)) = alert_for(advisory) else {
                continue;
            };
            let mut labels = if per_rank {
                self.rank_labels.clone()
            } else {
                self.job_labels.clone()
            };
            labels.insert("alertname".into(), name.into());
            labels.insert("severity".into(), severity.into());
            let runbooks = self
                .alerter
                .inner
                .as_ref()
                .map_or(DEFAULT_RUNBOOK_BASE_URL, |i| i.runbook_base_url.as_str());
            let annotations = annotations(name, &labels, advisory, runbooks);
            self.held.insert((name, labels.clone()));
            let age = monotonic_ns().saturating_sub(advisory.issued_monotonic_ns);
            self.alerter.send(Change::Fire {
                labels,
                annotations,
                holder: self.holder.clone(),
                since: SystemTime::now()
                    .checked_sub(Duration::from_nanos(age))
                    .unwrap_or_else(SystemTime::now),
            });
        }
    }

    /// Resolves the step-2 prediction's alerts (OOM predicted, low headroom)
    /// once a step ≥ 2 ended normally: step 2 fit, and the prediction is
    /// settled. The rules end them at the same point
    /// (`stepwatch_rank_steps_completed_total < 2`).
    pub fn markers(&mut self, markers: &[Marker]) {
        let step2_passed = || {
            markers
                .iter()
                .any(|m| m.step >= 2 && m.kind == MarkerKind::StepEnd)
        };
        if self.held.iter().any(|(n, _)| is_step2_prediction(n)) && step2_passed() {
            self.release(is_step2_prediction);
        }
    }

    /// Releases every alert of the rank: its stream ended.
    pub fn close(mut self) {
        self.release(|_| true);
    }

    fn release(&mut self, which: impl Fn(&str) -> bool) {
        let (gone, kept) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|(name, _)| which(name));
        self.held = kept;
        for (_, labels) in gone {
            self.alerter.send(Change::Release {
                labels,
                holder: self.holder.clone(),
            });
        }
    }
}

/// The alerts about the step-2 prediction, which end when step 2 passed.
fn is_step2_prediction(name: &str) -> bool {
    name == STEP2_OOM_ALERT || name == LOW_HEADROOM_ALERT
}

/// The rule's summary (same wording) and runbook, and the advisory's own
/// sentence.
fn annotations(name: &str, labels: &Labels, advisory: &Advisory, runbooks: &str) -> Labels {
    let get = |k: &str| labels.get(k).map_or("", String::as_str);
    let (job, rank) = (get("training_job"), get("rank"));
    let summary = match name {
        STEP2_OOM_ALERT => {
            format!("Job {job} rank {rank} will likely run out of GPU memory in step 2")
        }
        LOW_HEADROOM_ALERT => {
            let ratio = if advisory.capacity_bytes > 0 {
                advisory.predicted_headroom_bytes as f64 / advisory.capacity_bytes as f64
            } else {
                0.0
            };
            format!(
                "Job {job} rank {rank} has little predicted GPU memory headroom ({:.1}%)",
                ratio * 100.0
            )
        }
        _ => format!("Step-1 memory peaks of job {job} diverge across ranks"),
    };
    [
        ("summary".to_owned(), summary),
        ("description".to_owned(), advisory.message.clone()),
        if runbooks.is_empty() {
            (
                "runbook".to_owned(),
                format!(
                    "{name}.md in stepwatch's runbooks (deploy/runbooks; the chart's \
                     files/runbooks; /usr/share/doc/stepwatch/runbooks with the .deb); \
                     --alertmanager-runbook-base-url makes it a link"
                ),
            )
        } else {
            (
                "runbook_url".to_owned(),
                format!("{}/{name}.md", runbooks.trim_end_matches('/')),
            )
        },
        (
            "source".to_owned(),
            "stepwatch agent (fast path; the Prometheus rule sends the same alert)".to_owned(),
        ),
    ]
    .into_iter()
    .collect()
}

/// An active alert, as the task holds it.
struct Active {
    annotations: Labels,
    starts_at: SystemTime,
    holders: BTreeSet<String>,
}

/// The alert task: applies changes, hands them to the senders, resends.
async fn run_alerts(
    mut rx: mpsc::Receiver<Change>,
    senders: Vec<Arc<Sender>>,
    resend_interval: Duration,
    metrics: AlertMetrics,
    mut stop: watch::Receiver<bool>,
) {
    let mut active: BTreeMap<Labels, Active> = BTreeMap::new();
    let mut resend = tokio::time::interval(resend_interval);
    resend.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    resend.tick().await;
    let ends_after = resend_interval * ENDS_AFTER_INTERVALS;
    let post = |alert: Alert| {
        for s in &senders {
            s.push(&alert, &metrics);
        }
    };
    loop {
        tokio::select! {
            change = rx.recv() => {
                let Some(change) = change else { break };
                let now = SystemTime::now();
                match change {
                    Change::Fire { labels, annotations, holder, since } => {
                        let a = active.entry(labels.clone()).or_insert_with(|| Active {
                            annotations: Labels::new(),
                            starts_at: since,
                            holders: BTreeSet::new(),
                        });
                        a.annotations = annotations;
                        a.holders.insert(holder);
                        post(Alert::new(labels, a, now + ends_after));
                    }
                    Change::Release { labels, holder } => {
                        let Some(a) = active.get_mut(&labels) else { continue };
                        a.holders.remove(&holder);
                        if a.holders.is_empty() {
                            let a = active.remove(&labels).expect("present");
                            post(Alert::new(labels, &a, now));
                        }
                    }
                }
                metrics.active.set(active.len() as i64);
            }
            _ = resend.tick() => {
                let now = SystemTime::now();
                for (labels, a) in &active {
                    post(Alert::new(labels.clone(), a, now + ends_after));
                }
            }
            _ = stop.changed() => break,
        }
    }
}

/// One alert as Alertmanager's v2 API takes it (`postableAlert`); the
/// tests' fake Alertmanager reads it back.
#[derive(Debug, Clone, serde::Serialize)]
#[cfg_attr(test, derive(serde::Deserialize))]
struct Alert {
    labels: Labels,
    annotations: Labels,
    #[serde(rename = "startsAt")]
    starts_at: String,
    #[serde(rename = "endsAt")]
    ends_at: String,
}

impl Alert {
    fn new(labels: Labels, active: &Active, ends_at: SystemTime) -> Self {
        Self {
            labels,
            annotations: active.annotations.clone(),
            starts_at: rfc3339(active.starts_at),
            ends_at: rfc3339(ends_at),
        }
    }
}

/// An Alertmanager URL, split for a plain HTTP/1.1 POST.
#[derive(Debug, Clone, PartialEq)]
struct Target {
    url: String,
    /// `host:port` as written, for the Host header.
    authority: String,
    host: String,
    port: u16,
    path: String,
}

impl Target {
    fn parse(url: &str) -> anyhow::Result<Self> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            anyhow::anyhow!(
                "--alertmanager-url {url:?}: only http:// URLs are supported (like http://alertmanager-operated.monitoring:9093)"
            )
        })?;
        let (authority, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let port = |p: &str| {
            p.parse::<u16>()
                .map_err(|_| anyhow::anyhow!("--alertmanager-url {url:?}: {p:?} is not a port"))
        };
        let (host, port) = match authority.strip_prefix('[') {
            // An IPv6 literal: [::1]:9093.
            Some(bracketed) => match bracketed.split_once(']') {
                Some((h, "")) => (h, 80),
                Some((h, p)) if p.starts_with(':') => (h, port(&p[1..])?),
                _ => anyhow::bail!("--alertmanager-url {url:?}: malformed IPv6 address"),
            },
            None => match authority.rsplit_once(':') {
                Some((h, p)) => (h, port(p)?),
                None => (authority, 80),
            },
        };
        if host.is_empty() {
            anyhow::bail!("--alertmanager-url {url:?} has no host");
        }
        let prefix = prefix.trim_end_matches('/');
        let path = if prefix.is_empty() {
            "/api/v2/alerts".to_owned()
        } else {
            format!("/{prefix}/api/v2/alerts")
        };
        Ok(Self {
            url: url.to_owned(),
            authority: authority.to_owned(),
            host: host.to_owned(),
            port,
            path,
        })
    }

    /// POSTs `body`; Ok on a 2xx answer.
    async fn post(&self, body: &[u8]) -> anyhow::Result<()> {
        let exchange = async {
            let mut conn = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await?;
            conn.set_nodelay(true)?;
            let head = format!(
                "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\nUser-Agent: stepwatch-agent\r\n\r\n",
                self.path, self.authority, body.len()
            );
            conn.write_all(head.as_bytes()).await?;
            conn.write_all(body).await?;
            let mut answer = Vec::new();
            // The status line is all we need; the rest is read to close cleanly.
            let mut buf = [0u8; 1024];
            loop {
                let n = conn.read(&mut buf).await?;
                if n == 0 || answer.len() > 64 * 1024 {
                    break;
                }
                answer.extend_from_slice(&buf[..n]);
            }
            anyhow::Ok(answer)
        };
        let answer = tokio::time::timeout(POST_TIMEOUT, exchange)
            .await
            .map_err(|_| anyhow::anyhow!("no answer within {POST_TIMEOUT:?}"))??;
        let text = String::from_utf8_lossy(&answer);
        let status: u16 = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if (200..300).contains(&status) {
            Ok(())
        } else {
            let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
            anyhow::bail!(
                "HTTP {status}: {}",
                body.chars().take(200).collect::<String>()
            )
        }
    }
}

/// One Alertmanager's sender: the latest state of each alert not yet
/// delivered, posted together, retried with backoff.
struct Sender {
    target: Target,
    pending: Mutex<BTreeMap<Labels, Alert>>,
    wake: Notify,
}

impl Sender {
    fn push(&self, alert: &Alert, metrics: &AlertMetrics) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.len() >= MAX_PENDING && !pending.contains_key(&alert.labels) {
            metrics.dropped.with_label_values(&["pending_full"]).inc();
            return;
        }
        pending.insert(alert.labels.clone(), alert.clone());
        drop(pending);
        self.wake.notify_one();
    }

    async fn run(self: Arc<Self>, metrics: AlertMetrics, mut stop: watch::Receiver<bool>) {
        let mut backoff = BACKOFF.0;
        loop {
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = stop.changed() => return,
            }
            loop {
                let batch: Vec<Alert> = {
                    let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                    std::mem::take(&mut *pending).into_values().collect()
                };
                if batch.is_empty() {
                    break;
                }
                let body = serde_json::to_vec(&batch).expect("alerts serialise");
                match self.target.post(&body).await {
                    Ok(()) => {
                        metrics
                            .posts
                            .with_label_values(&[&self.target.url, "ok"])
                            .inc();
                        backoff = BACKOFF.0;
                    }
                    Err(e) => {
                        metrics
                            .posts
                            .with_label_values(&[&self.target.url, "error"])
                            .inc();
                        tracing::warn!(url = %self.target.url, error = %e, alerts = batch.len(), retry_in = ?backoff, "cannot post alerts to Alertmanager; retrying");
                        // Put back what no newer state replaced.
                        {
                            let mut pending =
                                self.pending.lock().unwrap_or_else(|e| e.into_inner());
                            for alert in batch {
                                pending.entry(alert.labels.clone()).or_insert(alert);
                            }
                        }
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = stop.changed() => return,
                        }
                        backoff = (backoff * 2).min(BACKOFF.1);
                    }
                }
            }
        }
    }
}

/// `t` as RFC 3339 UTC with milliseconds, as Alertmanager reads it.
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Labels the rules keep that the agent does not know: Prometheus adds
    /// them (a series label from relabelling, or an external label); the
    /// agent gets them from `--alertmanager-label`.
    const EXTERNAL_ALERT_LABELS: [&str; 1] = ["cluster"];

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        // 2024-02-29T12:34:56.789Z, a leap day: 1709210096 s.
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_789);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56.789Z");
    }

    #[test]
    fn urls_are_parsed_or_refused() {
        let t = Target::parse("http://am.monitoring:9093").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.path.as_str()),
            ("am.monitoring", 9093, "/api/v2/alerts")
        );
        let t = Target::parse("http://127.0.0.1:9093/alertmanager/").unwrap();
        assert_eq!(t.path, "/alertmanager/api/v2/alerts");
        let t = Target::parse("http://am").unwrap();
        assert_eq!(t.port, 80);
        let t = Target::parse("http://[::1]:9093").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 9093));
        assert_eq!(t.authority, "[::1]:9093");
        assert_eq!(Target::parse("http://[::1]").unwrap().port, 80);
        assert!(Target::parse("http://[::1").is_err());
        assert!(Target::parse("https://am:9093")
            .unwrap_err()
            .to_string()
            .contains("only http://"));
        assert!(Target::parse("http://am:x").is_err());
    }

    /// The label set the agent sends for each alert is the one its rule
    /// aggregates to, and the severity is the rule's: otherwise
    /// Alertmanager would hold two alerts, and page twice.
    #[test]
    fn the_agents_alerts_have_the_rules_names_labels_and_severities() {
        let rules = include_str!("../../../../deploy/prometheus/stepwatch-rules.yml");
        let cases = [
            (STEP2_OOM_ALERT, "warning", &RANK_ALERT_LABELS[..]),
            (LOW_HEADROOM_ALERT, "warning", &RANK_ALERT_LABELS[..]),
            (PEAK_DIVERGENCE_ALERT, "warning", &JOB_ALERT_LABELS[..]),
            (
                ACTIVATION_DIVERGENCE_ALERT,
                "warning",
                &JOB_ALERT_LABELS[..],
            ),
        ];
        for (name, severity, labels) in cases {
            let rule = rule_block(rules, name);
            assert!(
                rule.contains(&format!("severity: {severity}")),
                "{name}: severity {severity} expected in\n{rule}"
            );
            // The rule and the agent's alert name the same runbook page.
            let runbook = format!("runbook: \"{name}.md in stepwatch's runbooks (deploy/runbooks;");
            assert!(
                rule.lines().any(|l| l.trim_start().starts_with(&runbook)),
                "{name}: a runbook annotation starting {runbook} expected in\n{rule}"
            );
            let by = rule
                .split_once("max by (")
                .and_then(|(_, rest)| rest.split_once(')'))
                .map(|(by, _)| by)
                .unwrap_or_else(|| {
                    panic!("{name}: the rule aggregates with `max by (...)`:\n{rule}")
                });
            let rule_labels: BTreeSet<&str> = by.split(',').map(str::trim).collect();
            let agent_labels: BTreeSet<&str> = labels
                .iter()
                .chain(&EXTERNAL_ALERT_LABELS)
                .copied()
                .collect();
            assert_eq!(rule_labels, agent_labels, "{name}");
        }
    }

    /// The text of one `- alert:` rule in the rules file.
    fn rule_block<'a>(rules: &'a str, name: &str) -> &'a str {
        let start = rules
            .find(&format!("- alert: {name}\n"))
            .unwrap_or_else(|| panic!("no alert {name} in the rules"));
        let rest = &rules[start + 2..];
        &rest[..rest.find("- alert:").unwrap_or(rest.len())]
    }

    fn advisory(kind: AdvisoryKind, figure: Option<DivergenceFigure>) -> Advisory {
        Advisory {
            kind,
            step: 1,
            issued_monotonic_ns: 0,
            predicted_peak_bytes: 90_000_000_000,
            capacity_bytes: 85_000_000_000,
            predicted_headroom_bytes: -5_000_000_000,
            message: "step 2 will not fit".into(),
            divergence: figure.map(|figure| stepwatch_core::NamedOutlier {
                rank: 0,
                figure,
                source: stepwatch_core::PeakSource::Nvml,
                value_bytes: 1,
                median_bytes: 1.0,
                deviation: 0.5,
                ranks: 3,
            }),
        }
    }

    fn rank_alerts(tx: mpsc::Sender<Change>) -> RankAlerts {
        let registry = Registry::new();
        let alerter = Alerter {
            inner: Some(Arc::new(AlerterInner {
                tx,
                node: "n1".into(),
                runbook_base_url: DEFAULT_RUNBOOK_BASE_URL.into(),
                extra_labels: vec![("cluster".into(), "c1".into())],
                metrics: AlertMetrics::register(&registry, &[]).unwrap(),
            })),
        };
        let key = RankKey {
            namespace: "team".into(),
            job: "llm".into(),
            rank: 3,
        };
        let info = RankInfo {
            pod: "llm-3".into(),
            ..RankInfo::default()
        };
        alerter.rank(&key, &info)
    }

    fn marker(kind: MarkerKind, step: u64) -> Marker {
        Marker::at(kind, step, 0, 0)
    }

    /// A fake Alertmanager: answers each POST with the next status of
    /// `statuses` (then 200) and hands the JSON bodies over.
    async fn fake_alertmanager(statuses: Vec<u16>) -> (String, mpsc::Receiver<Vec<Alert>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let mut statuses = statuses.into_iter();
            loop {
                let (mut conn, _) = listener.accept().await.unwrap();
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                // Read the head, then Content-Length bytes of body.
                let body = loop {
                    let n = conn.read(&mut buf).await.unwrap();
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request).into_owned();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        assert!(head.starts_with("POST /api/v2/alerts HTTP/1.1"), "{head}");
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("Content-Length: "))
                            .unwrap()
                            .parse()
                            .unwrap();
                        if body.len() >= len {
                            break body.to_owned();
                        }
                    }
                };
                let status = statuses.next().unwrap_or(200);
                let answer = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                conn.write_all(answer.as_bytes()).await.unwrap();
                drop(conn);
                if status == 200 {
                    tx.send(serde_json::from_str(&body).unwrap()).await.unwrap();
                }
            }
        });
        (url, rx)
    }

    /// The next POST's alerts, within 10 s.
    async fn next(received: &mut mpsc::Receiver<Vec<Alert>>) -> Vec<Alert> {
        tokio::time::timeout(Duration::from_secs(10), received.recv())
            .await
            .expect("a POST within 10 s")
            .unwrap()
    }

    /// An alerter posting to `url`, and rank 0 of job llm's alerts.
    fn alerter_for(url: &str, resend: Duration) -> (Alerter, RankAlerts, watch::Sender<bool>) {
        let (stop_tx, stop) = watch::channel(false);
        let config = AlertmanagerConfig {
            urls: vec![url.to_owned()],
            extra_labels: vec![],
            resend_interval: resend,
            runbook_base_url: "https://runbooks.example/".into(),
            node: "n1".into(),
        };
        let alerter = Alerter::start(config, &Registry::new(), stop).unwrap();
        let key = RankKey {
            namespace: String::new(),
            job: "llm".into(),
            rank: 0,
        };
        let alerts = alerter.rank(&key, &RankInfo::default());
        (alerter, alerts, stop_tx)
    }

    /// Waits until `url`'s POSTs with `result` reach `n` (they are counted
    /// once the answer is read, after the fake handed the body over).
    async fn wait_posts(alerter: &Alerter, url: &str, result: &str, n: u64) {
        let posts = &alerter.inner.as_ref().unwrap().metrics.posts;
        let counted = async {
            while posts.with_label_values(&[url, result]).get() < n {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), counted)
            .await
            .unwrap_or_else(|_| panic!("{n} POSTs {result} counted"));
    }

    #[tokio::test]
    async fn a_failed_post_is_retried_and_a_resolution_follows_the_rank() {
        // The first POST fails (503). No resend within the test (1 h), so
        // the alert that arrives is the retry.
        let (url, mut received) = fake_alertmanager(vec![503]).await;
        let (alerter, mut alerts, _stop) = alerter_for(&url, Duration::from_secs(3600));
        alerts.advise(&[advisory(AdvisoryKind::Step2OomPredicted, None)]);
        let first = next(&mut received).await;
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].labels["alertname"], STEP2_OOM_ALERT);
        assert_eq!(
            first[0].annotations["runbook_url"],
            "https://runbooks.example/StepwatchStep2OOMPredicted.md",
            "--alertmanager-runbook-base-url, its trailing slash dropped"
        );
        assert!(
            first[0].ends_at > rfc3339(SystemTime::now()),
            "firing: {first:?}"
        );
        alerts.close();
        let resolved = next(&mut received).await;
        assert_eq!(resolved[0].labels, first[0].labels);
        assert_eq!(resolved[0].starts_at, first[0].starts_at);
        assert!(
            resolved[0].ends_at <= rfc3339(SystemTime::now()),
            "resolved: {resolved:?}"
        );
        wait_posts(&alerter, &url, "ok", 2).await;
        wait_posts(&alerter, &url, "error", 1).await;
    }

    #[tokio::test]
    async fn an_alert_is_resent_while_it_holds() {
        let (url, mut received) = fake_alertmanager(vec![]).await;
        let (_alerter, mut alerts, _stop) = alerter_for(&url, Duration::from_millis(200));
        alerts.advise(&[advisory(AdvisoryKind::LowHeadroom, None)]);
        let first = next(&mut received).await;
        let again = next(&mut received).await;
        assert_eq!(again[0].labels, first[0].labels);
        assert_eq!(again[0].starts_at, first[0].starts_at);
        assert!(again[0].ends_at > first[0].ends_at, "{first:?} {again:?}");
    }

    /// Low headroom is about the step-2 prediction too: like the rule
    /// (`stepwatch_rank_steps_completed_total < 2`), it ends when step 2
    /// passed, not with the rank's stream hours later.
    #[test]
    fn low_headroom_is_released_when_step_2_passed() {
        let (tx, mut rx) = mpsc::channel(16);
        let mut alerts = rank_alerts(tx);
        let mut low = advisory(AdvisoryKind::LowHeadroom, None);
        low.predicted_headroom_bytes = 2_000_000_000;
        low.capacity_bytes = 80_000_000_000;
        alerts.advise(&[low]);
        let Change::Fire {
            labels,
            annotations,
            ..
        } = rx.try_recv().unwrap()
        else {
            panic!("a firing alert")
        };
        assert_eq!(labels["alertname"], LOW_HEADROOM_ALERT);
        assert_eq!(labels["severity"], "warning");
        assert_eq!(
            annotations["summary"],
            "Job llm rank 3 has little predicted GPU memory headroom (2.5%)"
        );
        alerts.markers(&[marker(MarkerKind::StepEnd, 1)]);
        assert!(rx.try_recv().is_err(), "step 1's end resolves nothing");
        alerts.markers(&[marker(MarkerKind::StepEnd, 2)]);
        let Change::Release { labels, .. } = rx.try_recv().unwrap() else {
            panic!("released at step 2's end")
        };
        assert_eq!(labels["alertname"], LOW_HEADROOM_ALERT);
    }

    #[test]
    fn a_rank_fires_its_alerts_and_releases_them_at_step_2_or_its_end() {
        let (tx, mut rx) = mpsc::channel(16);
        let mut alerts = rank_alerts(tx);
        alerts.advise(&[
            advisory(AdvisoryKind::Step2OomPredicted, None),
            advisory(
                AdvisoryKind::RankDivergence,
                Some(DivergenceFigure::ActivationPeak),
            ),
            // No rule alerts on step times: no alert.
            advisory(
                AdvisoryKind::RankDivergence,
                Some(DivergenceFigure::Step1Duration),
            ),
        ]);
        let Change::Fire {
            labels,
            annotations,
            holder,
            ..
        } = rx.try_recv().unwrap()
        else {
            panic!("a firing alert first")
        };
        let expected: Labels = [
            ("alertname", "StepwatchStep2OOMPredicted"),
            ("severity", "warning"),
            ("cluster", "c1"),
            ("namespace", "team"),
            ("training_job", "llm"),
            ("rank", "3"),
            ("pod", "llm-3"),
            ("node", "n1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(labels, expected, "the empty container is left out");
        assert_eq!(annotations["description"], "step 2 will not fit");
        // No base URL (the default): the page is named, no dead link is sent.
        assert!(!annotations.contains_key("runbook_url"), "{annotations:?}");
        assert!(
            annotations["runbook"]
                .starts_with("StepwatchStep2OOMPredicted.md in stepwatch's runbooks"),
            "{annotations:?}"
        );
        assert_eq!(holder, "team/llm/3");
        let Change::Fire { labels, .. } = rx.try_recv().unwrap() else {
            panic!()
        };
        assert_eq!(labels["alertname"], ACTIVATION_DIVERGENCE_ALERT);
        assert!(!labels.contains_key("rank"), "a job's alert: {labels:?}");
        assert!(rx.try_recv().is_err(), "no third alert");

        // Step 1's end and step 2's markers before its end resolve nothing.
        alerts.markers(&[
            marker(MarkerKind::StepEnd, 1),
            marker(MarkerKind::StepBegin, 2),
        ]);
        assert!(rx.try_recv().is_err());
        // Step 2 fit: its OOM alert resolves, the divergence holds.
        alerts.markers(&[marker(MarkerKind::StepEnd, 2)]);
        let Change::Release { labels, .. } = rx.try_recv().unwrap() else {
            panic!()
        };
        assert_eq!(labels["alertname"], STEP2_OOM_ALERT);
        assert!(rx.try_recv().is_err());
        // The rank's end releases the rest.
        alerts.close();
        let Change::Release { labels, .. } = rx.try_recv().unwrap() else {
            panic!()
        };
        assert_eq!(labels["alertname"], ACTIVATION_DIVERGENCE_ALERT);
        assert!(rx.try_recv().is_err());
    }
}
