//! One memory budget for the whole agent: the container's memory limit
//! (cgroup `memory.max` of the agent's own cgroup and its ancestors),
//! or `--memory-limit-mib`, split into the budgets of what clients make
//! grow: the ranks' step history, allocator traces in flight, rank
//! reports in flight, and ingest connections and streams. The rest of the
//! limit is the agent's base: runtime, sampler rings, a `/metrics` render.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Registry};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics;

/// The limit assumed when there is no container limit and no flag: the
/// chart's.
pub const DEFAULT_LIMIT_BYTES: u64 = 192 << 20;

/// Where the limit came from, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitSource {
    /// `--memory-limit-mib`.
    Flag,
    /// The cgroup file that set it.
    Cgroup(String),
    /// No limit found: [`DEFAULT_LIMIT_BYTES`].
    Default,
}

/// The agent's memory limit and the budgets drawn from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryBudget {
    pub limit_bytes: u64,
    pub source: LimitSource,
    /// The ranks' retained step history (as `RankTimeline::approx_bytes`
    /// counts it): an eighth of the limit.
    pub history_bytes: u64,
    /// Allocator traces being received, as the trace budget accounts them:
    /// a sixteenth of the limit, since the accounted bytes undercount the
    /// real ones about twice, and never less than the largest trace the
    /// contract allows, so that one legitimate trace always fits.
    pub traces_bytes: u64,
    /// Rank reports being built and sent at once (their estimated size): a
    /// twelfth of the limit.
    pub reports_bytes: u64,
    /// Ingest connections' and streams' buffers, as
    /// `crate::listen::ConnectionMemory` estimates them: an eighth of the
    /// limit.
    pub connections_bytes: u64,
}

impl MemoryBudget {
    /// The budgets for `limit_bytes`; `history` and `traces` (bytes), when
    /// given by their own flags, replace their derived share.
    pub fn split(
        limit_bytes: u64,
        source: LimitSource,
        history: Option<u64>,
        traces: Option<u64>,
    ) -> Self {
        Self {
            limit_bytes,
            source,
            history_bytes: history.unwrap_or(limit_bytes / 8),
            traces_bytes: traces.unwrap_or((limit_bytes / 16).max(largest_trace_bytes())),
            reports_bytes: limit_bytes / 12,
            connections_bytes: limit_bytes / 8,
        }
    }

    /// The limit: the flag's, else the container's, else the default.
    pub fn limit(flag_bytes: Option<u64>) -> (u64, LimitSource) {
        if let Some(bytes) = flag_bytes {
            return (bytes, LimitSource::Flag);
        }
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        match cgroup_memory_limit(&own, Path::new("/sys/fs/cgroup")) {
            Some((bytes, file)) => (bytes, LimitSource::Cgroup(file)),
            None => (DEFAULT_LIMIT_BYTES, LimitSource::Default),
        }
    }
}

/// What the largest allocator trace the contract allows holds, as the
/// trace budget accounts it: every event and block at its bound, each
/// block in a segment of its own.
pub fn largest_trace_bytes() -> u64 {
    use stepwatch_core::allocator::{BlockLayout, SegmentLayout};
    use stepwatch_core::{AllocatorEvent, MAX_TRACE_BLOCKS, MAX_TRACE_EVENTS};
    let bytes = MAX_TRACE_EVENTS * std::mem::size_of::<AllocatorEvent>()
        + MAX_TRACE_BLOCKS
            * (std::mem::size_of::<BlockLayout>() + std::mem::size_of::<SegmentLayout>());
    bytes as u64
}

/// The tightest memory limit over the agent's cgroup, as `proc_self_cgroup`
/// (the text of `/proc/self/cgroup`) names it, and its ancestors under
/// `root`, with the file that set it: cgroup v2 `memory.max`, else v1's
/// `memory/…/memory.limit_in_bytes`. None with no limit anywhere. In a
/// container with its own cgroup namespace (or mount) the path may not
/// exist below `root`; the walk up still reaches the container's root.
pub fn cgroup_memory_limit(proc_self_cgroup: &str, root: &Path) -> Option<(u64, String)> {
    let v2 = proc_self_cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .and_then(|path| tightest(root, path, "memory.max"));
    v2.or_else(|| {
        let path = proc_self_cgroup.lines().find_map(|line| {
            let mut fields = line.splitn(3, ':');
            let controllers = fields.nth(1)?;
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then(|| fields.next())
                .flatten()
        })?;
        tightest(&root.join("memory"), path, "memory.limit_in_bytes")
    })
}

/// The smallest limit in `file` from `top/path` up to `top`; v1's
/// "unlimited" (a page-rounded 2^63) and v2's `max` are no limit.
fn tightest(top: &Path, path: &str, file: &str) -> Option<(u64, String)> {
    let mut dir = top.join(path.trim_start_matches('/'));
    let mut best: Option<(u64, String)> = None;
    loop {
        let at = dir.join(file);
        if let Some(bytes) = std::fs::read_to_string(&at)
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .filter(|b| *b < 1 << 62)
        {
            if best.as_ref().is_none_or(|(b, _)| bytes < *b) {
                best = Some((bytes, at.display().to_string()));
            }
        }
        if dir == top || !dir.pop() || !dir.starts_with(top) {
            break;
        }
    }
    best
}

/// Rank reports being built and sent at once, by their estimated size
/// (their copy of the steps and their JSON chunks in flight): a report
/// waits for room up to [`ReportBudget::WAIT`], then is refused (503), and
/// one larger than the whole budget is refused at once.
pub struct ReportBudget {
    /// One permit per KiB.
    permits: Arc<Semaphore>,
    kib: u32,
    wait: Duration,
    refused: IntCounterVec,
}

/// Why a report was refused; the `reason` of
/// `stepwatch_http_reports_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportRefusal {
    /// Other reports held the budget for the whole wait.
    Busy,
    /// This report alone is larger than the budget.
    TooLarge,
}

impl ReportRefusal {
    pub fn reason(self) -> &'static str {
        match self {
            ReportRefusal::Busy => "busy",
            ReportRefusal::TooLarge => "too_large",
        }
    }
}

impl ReportBudget {
    /// How long a report waits for room.
    pub const WAIT: Duration = Duration::from_secs(5);

    pub fn new(bytes: u64, registry: &Registry) -> prometheus::Result<Self> {
        Self::with_wait(bytes, Self::WAIT, registry)
    }

    fn with_wait(bytes: u64, wait: Duration, registry: &Registry) -> prometheus::Result<Self> {
        let kib = u32::try_from(bytes >> 10).unwrap_or(u32::MAX).max(1);
        let refused = IntCounterVec::new(metrics::HTTP_REPORTS_REFUSED_TOTAL.opts(), &["reason"])?;
        registry.register(Box::new(refused.clone()))?;
        for r in [ReportRefusal::Busy, ReportRefusal::TooLarge] {
            refused.with_label_values(&[r.reason()]);
        }
        Ok(Self {
            permits: Arc::new(Semaphore::new(kib as usize)),
            kib,
            wait,
            refused,
        })
    }

    /// Room for a report of about `bytes`, held until the permit drops.
    pub async fn reserve(&self, bytes: u64) -> Result<OwnedSemaphorePermit, ReportRefusal> {
        let kib = u32::try_from(bytes.div_ceil(1 << 10))
            .unwrap_or(u32::MAX)
            .max(1);
        let result = if kib > self.kib {
            Err(ReportRefusal::TooLarge)
        } else {
            let acquire = self.permits.clone().acquire_many_owned(kib);
            match tokio::time::timeout(self.wait, acquire).await {
                Ok(permit) => Ok(permit.expect("the semaphore is never closed")),
                Err(_) => Err(ReportRefusal::Busy),
            }
        };
        if let Err(r) = result {
            self.refused.with_label_values(&[r.reason()]).inc();
        }
        result
    }

    /// The budget, bytes.
    pub fn bytes(&self) -> u64 {
        u64::from(self.kib) << 10
    }
}

/// Exports the limit and the budgets (gauges, set once).
pub fn register(budget: &MemoryBudget, registry: &Registry) -> prometheus::Result<()> {
    let limit = IntGauge::new(
        metrics::MEMORY_LIMIT_BYTES.name,
        metrics::MEMORY_LIMIT_BYTES.help,
    )?;
    limit.set(i64::try_from(budget.limit_bytes).unwrap_or(i64::MAX));
    registry.register(Box::new(limit))?;
    let budgets = IntGaugeVec::new(metrics::MEMORY_BUDGET_BYTES.opts(), &["budget"])?;
    for (name, bytes) in [
        ("history", budget.history_bytes),
        ("traces", budget.traces_bytes),
        ("reports", budget.reports_bytes),
        ("connections", budget.connections_bytes),
    ] {
        budgets
            .with_label_values(&[name])
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
    registry.register(Box::new(budgets))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tightest_limit_of_the_cgroup_and_its_ancestors_binds() {
        let root = tempfile::tempdir().unwrap();
        let pod = root.path().join("kubepods/pod1");
        let container = pod.join("agent");
        std::fs::create_dir_all(&container).unwrap();
        std::fs::write(container.join("memory.max"), "max\n").unwrap();
        std::fs::write(pod.join("memory.max"), "201326592\n").unwrap();
        std::fs::write(root.path().join("memory.max"), "max\n").unwrap();
        let (bytes, file) = cgroup_memory_limit("0::/kubepods/pod1/agent\n", root.path()).unwrap();
        assert_eq!(bytes, 192 << 20);
        assert!(file.ends_with("kubepods/pod1/memory.max"), "{file}");
        // A cgroup namespace: the container's own limit at the root.
        std::fs::write(root.path().join("memory.max"), "104857600\n").unwrap();
        assert_eq!(
            cgroup_memory_limit("0::/\n", root.path()).map(|(b, _)| b),
            Some(100 << 20)
        );
        // cgroup v1's memory controller, unlimited at its root.
        let v1 = root.path().join("memory/docker/abc");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "67108864\n").unwrap();
        std::fs::write(
            root.path().join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        assert_eq!(
            cgroup_memory_limit("4:memory:/docker/abc\n0::/\n", root.path()).map(|(b, _)| b),
            Some(100 << 20),
            "v2's limit first"
        );
        std::fs::write(root.path().join("memory.max"), "max\n").unwrap();
        assert_eq!(
            cgroup_memory_limit("5:cpu:/x\n4:memory:/docker/abc\n0::/\n", root.path())
                .map(|(b, _)| b),
            Some(64 << 20)
        );
        std::fs::remove_file(v1.join("memory.limit_in_bytes")).unwrap();
        std::fs::write(root.path().join("memory.max"), "max\n").unwrap();
        std::fs::write(pod.join("memory.max"), "max\n").unwrap();
        assert_eq!(
            cgroup_memory_limit("0::/kubepods/pod1/agent\n", root.path()),
            None
        );
    }

    #[tokio::test]
    async fn reports_wait_for_room_then_are_refused_and_counted() {
        let registry = Registry::new();
        let budget =
            ReportBudget::with_wait(10 << 20, Duration::from_millis(200), &registry).unwrap();
        let refused = |r: ReportRefusal| budget.refused.with_label_values(&[r.reason()]).get();
        assert_eq!(
            budget.reserve(11 << 20).await.unwrap_err(),
            ReportRefusal::TooLarge
        );
        let first = budget.reserve(6 << 20).await.unwrap();
        // A second one waits, and gets room when the first is sent.
        let second = budget.reserve(6 << 20);
        tokio::pin!(second);
        let waited = tokio::time::timeout(Duration::from_millis(20), second.as_mut()).await;
        assert!(waited.is_err(), "no room while the first is held");
        drop(first);
        let second = second.await.unwrap();
        // A third waits past the wait and is refused.
        assert_eq!(
            budget.reserve(6 << 20).await.unwrap_err(),
            ReportRefusal::Busy
        );
        drop(second);
        assert_eq!(refused(ReportRefusal::TooLarge), 1);
        assert_eq!(refused(ReportRefusal::Busy), 1);
    }

    #[test]
    fn the_budgets_fit_the_charts_limit_and_flags_replace_their_share() {
        let b = MemoryBudget::split(192 << 20, LimitSource::Default, None, None);
        assert_eq!(b.history_bytes, 24 << 20);
        assert_eq!(b.traces_bytes, (12 << 20).max(largest_trace_bytes()));
        assert_eq!(b.reports_bytes, 16 << 20);
        assert_eq!(b.connections_bytes, 24 << 20);
        // Traces count twice (their accounting undercounts): the budgets
        // take under five eighths of the limit, the rest (72 MiB at 192) is
        // the agent's base.
        let drawn = b.history_bytes + 2 * b.traces_bytes + b.reports_bytes + b.connections_bytes;
        assert!(drawn <= b.limit_bytes / 8 * 5, "{drawn}");
        // One largest trace fits whatever the limit.
        let small = MemoryBudget::split(64 << 20, LimitSource::Flag, None, None);
        assert_eq!(small.traces_bytes, largest_trace_bytes());
        let b = MemoryBudget::split(1 << 30, LimitSource::Flag, Some(5 << 20), None);
        assert_eq!(b.history_bytes, 5 << 20);
        assert_eq!(b.traces_bytes, 64 << 20);
    }
}
