//! `/metrics`: the Prometheus text exposition.
//!
//! Static counters of the ingest path live in the agent's registry. GPU and
//! rank series are built per scrape from snapshots, so evicted ranks and
//! lost GPUs disappear without bookkeeping, and no NVML call happens here.
//! Every series carries the `node` label.

use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Encoder, TextEncoder};
use stepwatch_core::{PhaseKind, StepOutcome};
use stepwatch_proto::clock::monotonic_ns;

use crate::state::AgentState;

/// One metric family under construction.
struct Family<'a> {
    node: &'a str,
    family: MetricFamily,
}

impl<'a> Family<'a> {
    fn new(node: &'a str, name: &str, help: &str, kind: MetricType) -> Self {
        let mut family = MetricFamily::default();
        family.set_name(name.to_owned());
        family.set_help(help.to_owned());
        family.set_field_type(kind);
        Self { node, family }
    }

    fn gauge(node: &'a str, name: &str, help: &str) -> Self {
        Self::new(node, name, help, MetricType::GAUGE)
    }

    fn counter(node: &'a str, name: &str, help: &str) -> Self {
        Self::new(node, name, help, MetricType::COUNTER)
    }

    fn add(&mut self, labels: &[(&str, &str)], value: f64) {
        let mut pairs = Vec::with_capacity(labels.len() + 1);
        for (name, value) in std::iter::once(&("node", self.node)).chain(labels) {
            let mut pair = LabelPair::default();
            pair.set_name((*name).to_owned());
            pair.set_value((*value).to_owned());
            pairs.push(pair);
        }
        let mut metric = Metric::from_label(pairs);
        if self.family.get_field_type() == MetricType::COUNTER {
            let mut c = Counter::default();
            c.set_value(value);
            metric.set_counter(c);
        } else {
            let mut g = Gauge::default();
            g.set_value(value);
            metric.set_gauge(g);
        }
        self.family.mut_metric().push(metric);
    }

    fn done(self, out: &mut Vec<MetricFamily>) {
        if !self.family.get_metric().is_empty() {
            out.push(self.family);
        }
    }
}

/// Renders the whole exposition.
pub fn render(state: &AgentState) -> String {
    let node = state.node.as_str();
    let mut families = state.registry.gather();
    gpu_families(state, node, &mut families);
    rank_families(state, node, &mut families);
    families.sort_by(|a, b| a.name().cmp(b.name()));
    let mut buf = Vec::with_capacity(16 * 1024);
    TextEncoder::new()
        .encode(&families, &mut buf)
        .expect("text encoding of well-formed families");
    String::from_utf8(buf).expect("text format is UTF-8")
}

fn gpu_families(state: &AgentState, node: &str, out: &mut Vec<MetricFamily>) {
    let snap = state.sampler.snapshot(monotonic_ns());

    let mut f = Family::gauge(node, "stepwatch_build_info", "Agent version; always 1.");
    f.add(&[("version", env!("CARGO_PKG_VERSION"))], 1.0);
    f.done(out);

    let mut f = Family::gauge(
        node,
        "stepwatch_nvml_up",
        "1 when NVML answered the last attempt, 0 while it is missing or lost (the agent retries with backoff).",
    );
    f.add(&[], if snap.nvml_up { 1.0 } else { 0.0 });
    f.done(out);

    let mut info = Family::gauge(node, "stepwatch_gpu_info", "GPU identity; always 1.");
    let mut up = Family::gauge(
        node,
        "stepwatch_gpu_up",
        "1 while NVML reads the GPU, 0 when it reports it lost.",
    );
    let mut used = Family::gauge(
        node,
        "stepwatch_gpu_memory_used_bytes",
        "Device memory in use at the last sample (NVML memory info v2 'used', which excludes driver-reserved memory).",
    );
    let mut used_max = Family::gauge(
        node,
        "stepwatch_gpu_memory_used_max_bytes",
        "Maximum of stepwatch_gpu_memory_used_bytes over the trailing window (--max-window); never reset by scrapes.",
    );
    let mut total = Family::gauge(
        node,
        "stepwatch_gpu_memory_total_bytes",
        "Device memory capacity (NVML v2 'total').",
    );
    let mut free = Family::gauge(
        node,
        "stepwatch_gpu_memory_free_bytes",
        "Device memory free at the last sample (NVML v2 'free').",
    );
    let mut samples = Family::counter(
        node,
        "stepwatch_gpu_samples_total",
        "Device-memory samples taken.",
    );
    let mut procs = Family::gauge(
        node,
        "stepwatch_gpu_processes",
        "Compute processes on the GPU at the last process-list read.",
    );
    let mut util = Family::gauge(
        node,
        "stepwatch_gpu_utilization_ratio",
        "GPU busy ratio over NVML's own averaging window (1/6 s to 1 s).",
    );
    for g in &snap.gpus {
        let index = g.index.to_string();
        let labels = [("gpu", index.as_str()), ("uuid", g.uuid.as_str())];
        info.add(
            &[("gpu", &index), ("uuid", &g.uuid), ("name", &g.name)],
            1.0,
        );
        up.add(&labels, if g.up && snap.nvml_up { 1.0 } else { 0.0 });
        total.add(&labels, g.total_bytes as f64);
        samples.add(&labels, g.samples_total as f64);
        procs.add(&labels, g.processes.len() as f64);
        if let Some(last) = g.last {
            used.add(&labels, last.used_bytes as f64);
            free.add(&labels, last.free_bytes as f64);
        }
        if let Some(max) = g.used_max_bytes {
            used_max.add(&labels, max as f64);
        }
        if let Some((busy, _)) = g.utilization_percent {
            util.add(&labels, f64::from(busy) / 100.0);
        }
    }
    for f in [info, up, used, used_max, total, free, samples, procs, util] {
        f.done(out);
    }

    let mut f = Family::gauge(
        node,
        "stepwatch_sampler_lag_seconds",
        "Worst lateness of a sampler tick over the trailing window.",
    );
    f.add(&[], snap.lag_max_seconds);
    f.done(out);
    let mut f = Family::counter(node, "stepwatch_sampler_ticks_total", "Sampler ticks run.");
    f.add(&[], snap.ticks_total as f64);
    f.done(out);
    let mut f = Family::counter(
        node,
        "stepwatch_sampler_late_ticks_total",
        "Sampler ticks that started more than one period late.",
    );
    f.add(&[], snap.late_ticks_total as f64);
    f.done(out);
    let mut f = Family::counter(
        node,
        "stepwatch_sampler_samples_dropped_total",
        "Samples dropped because the step tracker did not take them in time.",
    );
    f.add(&[], snap.pending_dropped_total as f64);
    f.done(out);
    let mut f = Family::counter(
        node,
        "stepwatch_nvml_init_attempts_total",
        "Attempts to initialise NVML.",
    );
    f.add(&[], snap.init_attempts_total as f64);
    f.done(out);
    let mut f = Family::counter(
        node,
        "stepwatch_nvml_errors_total",
        "NVML calls that returned an error, by call.",
    );
    for (call, n) in &snap.errors {
        f.add(&[("call", call.as_str())], *n as f64);
    }
    f.done(out);
}

fn rank_families(state: &AgentState, node: &str, out: &mut Vec<MetricFamily>) {
    let tracker = state.tracker();

    let mut tracked = Family::gauge(
        node,
        "stepwatch_ranks_tracked",
        "Ranks the agent currently tracks.",
    );
    tracked.add(&[], tracker.rank_count() as f64);
    tracked.done(out);

    let mut info = Family::gauge(node, "stepwatch_rank_info", "Rank identity; always 1.");
    let mut connected = Family::gauge(
        node,
        "stepwatch_rank_connected",
        "1 while the rank has an open marker stream.",
    );
    let mut steps = Family::counter(
        node,
        "stepwatch_rank_steps_completed_total",
        "Steps that reached their step end.",
    );
    let mut last_step = Family::gauge(
        node,
        "stepwatch_rank_last_step",
        "Number of the latest step seen (open or not).",
    );
    let mut duration = Family::gauge(
        node,
        "stepwatch_rank_step_duration_seconds",
        "Duration of the latest completed step.",
    );
    let mut median = Family::gauge(
        node,
        "stepwatch_rank_step_duration_median_seconds",
        "Median duration of the retained completed steps.",
    );
    let mut last_end = Family::gauge(
        node,
        "stepwatch_rank_last_step_end_timestamp_seconds",
        "Wall-clock time of the latest step end (for stall alerts).",
    );
    let mut phase = Family::gauge(
        node,
        "stepwatch_rank_phase_duration_seconds",
        "Duration of each phase in the latest completed step (micro-batches summed).",
    );
    let mut ooms = Family::counter(
        node,
        "stepwatch_rank_ooms_total",
        "Steps that ended with an out-of-memory marker.",
    );
    for (key, rank) in tracker.ranks() {
        let rank_label = key.rank.to_string();
        let labels = [("job", key.job.as_str()), ("rank", rank_label.as_str())];
        let i = &rank.info;
        info.add(
            &[
                ("job", &key.job),
                ("rank", &rank_label),
                ("local_rank", &i.local_rank.to_string()),
                ("world_size", &i.world_size.to_string()),
                ("gpu_uuid", &i.gpu_uuid),
            ],
            1.0,
        );
        connected.add(&labels, if rank.connected_streams > 0 { 1.0 } else { 0.0 });
        let tl = &rank.timeline;
        steps.add(&labels, tl.steps_completed() as f64);
        ooms.add(&labels, tl.ooms() as f64);
        if let Some(current) = tl.current() {
            last_step.add(&labels, current.step as f64);
        }
        if let Some(last) = tl.last_completed() {
            duration.add(&labels, ns_to_s(last.duration_ns().unwrap_or(0)));
            if let Some(wall) = last.end_wall_ns {
                last_end.add(&labels, ns_to_s(wall));
            }
            for kind in PhaseKind::ALL {
                if let Some(ns) = last.phase_duration_ns(kind) {
                    phase.add(
                        &[labels[0], labels[1], ("phase", kind.as_str())],
                        ns_to_s(ns),
                    );
                }
            }
        }
        let mut durations: Vec<u64> = tl
            .steps()
            .filter(|s| s.outcome == StepOutcome::Completed)
            .filter_map(|s| s.duration_ns())
            .collect();
        if !durations.is_empty() {
            let mid = durations.len() / 2;
            let (_, m, _) = durations.select_nth_unstable(mid);
            median.add(&labels, ns_to_s(*m));
        }
    }
    for f in [
        info, connected, steps, last_step, duration, median, last_end, phase, ooms,
    ] {
        f.done(out);
    }
}

fn ns_to_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}
