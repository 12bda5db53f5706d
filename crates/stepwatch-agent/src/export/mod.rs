//! `/metrics`: the Prometheus text exposition.
//!
//! Static counters of the ingest path live in the agent's registry. GPU and
//! rank series are built per scrape from snapshots, so evicted ranks and
//! lost GPUs disappear without bookkeeping, and no NVML call happens here.
//! Every series carries the `node` label.
//!
//! Label names are chosen so that a scrape with `honor_labels: false` (the
//! chart's ServiceMonitor) overwrites nothing of ours but the pod labels it
//! is told to move back: the training job is `training_job`, never `job`
//! (Prometheus's scrape job); a GPU is `gpu` (index) and `gpu_uuid` on
//! every series that names one; `namespace`, `pod` and `container` name the
//! tenant's workload, on rank series and on the series of a GPU a pod holds.

use prometheus::proto::MetricType;
use prometheus::TextEncoder;
use stepwatch_core::{BasisLimit, GrowthSource, PhaseKind, RankInfo, RankKey, WarningRevision};
use stepwatch_proto::clock::monotonic_ns;

use crate::config::RankPhaseSeries;
use crate::metrics::{self, MetricDef, MetricKind};
use crate::state::AgentState;
mod views;

pub(crate) use views::RankViews;
use views::TrackerSnapshot;

/// One rendered family: its name (the exposition is sorted by it) and its
/// text, `# HELP` and `# TYPE` lines included.
pub(crate) struct TextFamily {
    name: String,
    text: String,
}

/// One metric family under construction, written straight into the text
/// format: building the client library's protobuf families for thousands
/// of rank series and encoding them again cost most of a large scrape.
struct Family<'a> {
    node: &'a str,
    name: &'a str,
    kind: MetricType,
    text: String,
    series: usize,
}

impl<'a> Family<'a> {
    fn new(node: &'a str, name: &'a str, help: &str, kind: MetricType) -> Self {
        let type_name = match kind {
            MetricType::COUNTER => "counter",
            MetricType::HISTOGRAM => "histogram",
            _ => "gauge",
        };
        let mut text = String::with_capacity(256);
        text.push_str("# HELP ");
        text.push_str(name);
        text.push(' ');
        escape_into(&mut text, help, false);
        text.push_str("\n# TYPE ");
        text.push_str(name);
        text.push(' ');
        text.push_str(type_name);
        text.push('\n');
        Self {
            node,
            name,
            kind,
            text,
            series: 0,
        }
    }

    /// The family declared as `def` (see [`crate::metrics`]).
    fn of(node: &'a str, def: &'a MetricDef) -> Self {
        let kind = match def.kind {
            MetricKind::Gauge => MetricType::GAUGE,
            MetricKind::Counter => MetricType::COUNTER,
            MetricKind::Histogram => MetricType::HISTOGRAM,
        };
        Self::new(node, def.name, def.help, kind)
    }

    /// Families of one unlabelled series each: (declaration, value).
    fn singles(node: &'a str, families: &[(&'a MetricDef, f64)], out: &mut Vec<TextFamily>) {
        for &(def, value) in families {
            let mut family = Self::of(node, def);
            family.add(&[], value);
            family.done(out);
        }
    }

    /// One series. A label with an empty value is left out, which is what
    /// Prometheus makes of it anyway: ranks outside Kubernetes have no
    /// `namespace`, and their series read as before.
    fn add(&mut self, labels: &[(&str, &str)], value: f64) {
        self.sample("", labels, None, value);
    }

    /// One line: `name{node="…",labels…,extra} value`.
    fn sample(
        &mut self,
        suffix: &str,
        labels: &[(&str, &str)],
        extra: Option<(&str, &str)>,
        value: f64,
    ) {
        use std::fmt::Write;
        let text = &mut self.text;
        text.push_str(self.name);
        text.push_str(suffix);
        let mut separator = '{';
        for (name, value) in std::iter::once(&("node", self.node))
            .chain(labels)
            .chain(extra.as_ref())
            .filter(|(_, v)| !v.is_empty())
        {
            text.push(separator);
            text.push_str(name);
            text.push_str("=\"");
            escape_into(text, value, true);
            text.push('"');
            separator = ',';
        }
        if separator == ',' {
            text.push('}');
        }
        let _ = writeln!(text, " {value}");
        self.series += 1;
    }

    /// One histogram series from cumulative (upper bound, count) buckets.
    fn add_histogram(&mut self, buckets: &[(f64, u64)], count: u64, sum: f64) {
        debug_assert_eq!(self.kind, MetricType::HISTOGRAM);
        for &(upper, cumulative) in buckets {
            let le = upper.to_string();
            self.sample("_bucket", &[], Some(("le", &le)), cumulative as f64);
        }
        if buckets
            .last()
            .is_none_or(|&(upper, _)| upper != f64::INFINITY)
        {
            self.sample("_bucket", &[], Some(("le", "+Inf")), count as f64);
        }
        self.sample("_sum", &[], None, sum);
        self.sample("_count", &[], None, count as f64);
    }

    fn done(self, out: &mut Vec<TextFamily>) {
        if self.series > 0 {
            out.push(TextFamily {
                name: self.name.to_owned(),
                text: self.text,
            });
        }
    }
}

/// Escapes a label value (`quotes`) or help text as the text format asks:
/// backslash, newline and, in label values, the double quote.
fn escape_into(out: &mut String, value: &str, quotes: bool) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quotes => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

/// Renders the whole exposition.
pub fn render(state: &AgentState) -> String {
    render_with(state, &mut || {})
}

/// [`render`], calling `after_each_rank` after each rank's copy is taken
/// (with the tracker lock released), so a test can show that ingest goes on
/// in the middle of a scrape.
fn render_with(state: &AgentState, after_each_rank: &mut dyn FnMut()) -> String {
    let node = state.node.as_str();
    // The registry's own counters, through the client library's encoder.
    let mut families: Vec<TextFamily> = state
        .registry
        .gather()
        .into_iter()
        .map(|family| {
            let mut text = String::new();
            TextEncoder::new()
                .encode_utf8(std::slice::from_ref(&family), &mut text)
                .expect("text encoding of well-formed families");
            TextFamily {
                name: family.name().to_owned(),
                text,
            }
        })
        .collect();
    let slices = gpu_families(state, node, &mut families);
    let ranks = state.views.snapshot(state, after_each_rank);
    rank_families(
        &ranks,
        &slices,
        node,
        state.rank_phase_series(),
        &mut families,
    );
    families.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = String::with_capacity(families.iter().map(|f| f.text.len()).sum());
    for family in &families {
        out.push_str(&family.text);
    }
    out
}

/// Writes the GPU families; returns the MIG slices found, by UUID, for the
/// ranks on them.
fn gpu_families(
    state: &AgentState,
    node: &str,
    out: &mut Vec<TextFamily>,
) -> Vec<(String, stepwatch_gpu::MigSlice)> {
    let snap = state.sampler.snapshot(monotonic_ns());

    let mut f = Family::of(node, &metrics::BUILD_INFO);
    f.add(&[("version", env!("CARGO_PKG_VERSION"))], 1.0);
    f.done(out);

    Family::singles(
        node,
        &[(&metrics::NVML_UP, if snap.nvml_up { 1.0 } else { 0.0 })],
        out,
    );

    let mut info = Family::of(node, &metrics::GPU_INFO);
    let mut up = Family::of(node, &metrics::GPU_UP);
    let mut age = Family::of(node, &metrics::GPU_SAMPLE_AGE_SECONDS);
    let mut used = Family::of(node, &metrics::GPU_MEMORY_USED_BYTES);
    let mut used_max = Family::of(node, &metrics::GPU_MEMORY_USED_MAX_BYTES);
    let mut total = Family::of(node, &metrics::GPU_MEMORY_TOTAL_BYTES);
    let mut free = Family::of(node, &metrics::GPU_MEMORY_FREE_BYTES);
    let mut samples = Family::of(node, &metrics::GPU_SAMPLES_TOTAL);
    let mut procs = Family::of(node, &metrics::GPU_PROCESSES);
    let mut util = Family::of(node, &metrics::GPU_UTILIZATION_RATIO);
    // Slurm's job on each GPU (--slurm-job-mapping-dir), as dcgm-exporter labels it.
    let slurm_jobs = state.slurm.get().map(|s| s.mapping()).unwrap_or_default();
    for g in &snap.gpus {
        let index = g.index.to_string();
        // The pod holding the GPU, from the kubelet (dcgm-exporter's
        // labels); changes only when that pod does.
        let holder = state.gpu_holders.holder(&g.uuid, g.index);
        let (namespace, pod, container) = holder
            .as_ref()
            .map_or(("", "", ""), |h| (&*h.namespace, &*h.pod, &*h.container));
        // A MIG slice: dcgm-exporter's GPU_I_ID and GPU_I_PROFILE.
        let instance = g
            .mig
            .as_ref()
            .map(|m| m.gpu_instance_id.to_string())
            .unwrap_or_default();
        let profile = g.mig.as_ref().map_or("", |m| m.profile.as_str());
        let labels = [
            ("gpu", index.as_str()),
            ("gpu_uuid", g.uuid.as_str()),
            ("gpu_instance_id", instance.as_str()),
            ("mig_profile", profile),
            ("namespace", namespace),
            ("pod", pod),
            ("container", container),
            // A MIG slice's job is in its own file, `<gpu>.<instance>`.
            (
                "hpc_job",
                match &g.mig {
                    Some(m) => slurm_jobs.sole_job_on_instance(g.index, m.gpu_instance_id),
                    None => slurm_jobs.sole_job(g.index),
                }
                .unwrap_or(""),
            ),
        ];
        let mut with_name = labels.to_vec();
        with_name.push(("name", &g.name));
        info.add(&with_name, 1.0);
        up.add(&labels, if g.up && snap.nvml_up { 1.0 } else { 0.0 });
        total.add(&labels, g.total_bytes as f64);
        samples.add(&labels, g.samples_total as f64);
        age.add(&labels, g.sample_age_seconds);
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
    for f in [
        info, up, age, used, used_max, total, free, samples, procs, util,
    ] {
        f.done(out);
    }

    Family::singles(
        node,
        &[(&metrics::SAMPLER_LAG_SECONDS, snap.lag_max_seconds)],
        out,
    );
    let mut f = Family::of(node, &metrics::SAMPLER_TICK_LATENESS_SECONDS);
    f.add_histogram(&snap.lag_histogram, snap.lag_count, snap.lag_sum_seconds);
    f.done(out);
    Family::singles(
        node,
        &[
            (&metrics::SAMPLER_TICKS_TOTAL, snap.ticks_total as f64),
            (
                &metrics::SAMPLER_LATE_TICKS_TOTAL,
                snap.late_ticks_total as f64,
            ),
            (
                &metrics::SAMPLER_SAMPLES_DROPPED_TOTAL,
                snap.pending_dropped_total as f64,
            ),
            (
                &metrics::NVML_INIT_ATTEMPTS_TOTAL,
                snap.init_attempts_total as f64,
            ),
        ],
        out,
    );
    let mut f = Family::of(node, &metrics::NVML_ERRORS_TOTAL);
    for (call, n) in &snap.errors {
        f.add(&[("call", call.as_str())], *n as f64);
    }
    f.done(out);
    snap.gpus
        .into_iter()
        .filter_map(|g| Some((g.uuid, g.mig?)))
        .collect()
}

fn rank_families(
    tracker: &TrackerSnapshot,
    slices: &[(String, stepwatch_gpu::MigSlice)],
    node: &str,
    phase_series: RankPhaseSeries,
    out: &mut Vec<TextFamily>,
) {
    Family::singles(
        node,
        &[
            (&metrics::RANKS_TRACKED, tracker.rank_count as f64),
            (&metrics::RETAINED_BYTES, tracker.retained_bytes as f64),
            (
                &metrics::STEPS_TRIMMED_TOTAL,
                tracker.steps_trimmed_total as f64,
            ),
            (
                &metrics::RANKS_EVICTED_FOR_MEMORY_TOTAL,
                tracker.ranks_evicted_for_memory_total as f64,
            ),
        ],
        out,
    );

    let mut f = Family::of(node, &metrics::LAYOUT_SNAPSHOTS_TOTAL);
    let c = tracker.layout_counts;
    for (result, n) in [
        ("kept", c.kept),
        ("misplaced", c.misplaced),
        ("too_many_blocks", c.too_many_blocks),
        ("unmodelled", c.unmodelled),
    ] {
        f.add(&[("result", result)], n as f64);
    }
    f.done(out);

    let mut info = Family::of(node, &metrics::RANK_INFO);
    let mut connected = Family::of(node, &metrics::RANK_CONNECTED);
    let mut steps = Family::of(node, &metrics::RANK_STEPS_COMPLETED_TOTAL);
    let mut last_step = Family::of(node, &metrics::RANK_LAST_STEP);
    let mut duration = Family::of(node, &metrics::RANK_STEP_DURATION_SECONDS);
    let mut median = Family::of(node, &metrics::RANK_STEP_DURATION_MEDIAN_SECONDS);
    let mut last_end = Family::of(node, &metrics::RANK_LAST_STEP_END_TIMESTAMP_SECONDS);
    let mut phase = Family::of(node, &metrics::RANK_PHASE_DURATION_SECONDS);
    let mut ooms = Family::of(node, &metrics::RANK_OOMS_TOTAL);
    let mut retries = Family::of(node, &metrics::RANK_ALLOCATOR_RETRIES_TOTAL);
    for rank in &tracker.ranks {
        let key = &rank.key;
        let rank_label = key.rank.to_string();
        let labels = rank_labels(key, &rank_label, &rank.info);
        let i = &rank.info;
        let slice = slices.iter().find(|(uuid, _)| *uuid == i.gpu_uuid);
        let instance = slice.map(|(_, m)| m.gpu_instance_id.to_string());
        info.add(
            &[
                labels[0],
                labels[1],
                labels[2],
                labels[3],
                labels[4],
                ("attested", if i.attested { "true" } else { "false" }),
                ("local_rank", &i.local_rank.to_string()),
                ("world_size", &i.world_size.to_string()),
                ("gpu_uuid", &i.gpu_uuid),
                ("gpu_instance_id", instance.as_deref().unwrap_or("")),
                ("mig_profile", slice.map_or("", |(_, m)| m.profile.as_str())),
            ],
            1.0,
        );
        connected.add(&labels, if rank.connected { 1.0 } else { 0.0 });
        steps.add(&labels, rank.steps_completed as f64);
        ooms.add(&labels, rank.ooms as f64);
        if let Some(n) = rank.allocator_retries {
            retries.add(&labels, n as f64);
        }
        if let Some(current) = rank.last_step {
            last_step.add(&labels, current as f64);
        }
        if let Some(last) = &rank.last_completed {
            duration.add(&labels, ns_to_s(last.duration_ns));
            if let Some(wall) = last.end_wall_ns {
                last_end.add(&labels, ns_to_s(wall));
            }
            if phase_series == RankPhaseSeries::All {
                for (kind, ns) in &last.phases {
                    phase.add(&with(&labels, ("phase", kind.as_str())), ns_to_s(*ns));
                }
            }
        }
        if let Some(m) = rank.median_duration_ns {
            median.add(&labels, ns_to_s(m));
        }
    }
    for f in [
        info, connected, steps, last_step, duration, median, last_end, phase, ooms, retries,
    ] {
        f.done(out);
    }
    analysis_families(tracker, node, phase_series, out);
}

fn ns_to_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// First-step, steady-state and prediction series, and per-job divergence.
fn analysis_families(
    tracker: &TrackerSnapshot,
    node: &str,
    phase_series: RankPhaseSeries,
    out: &mut Vec<TextFamily>,
) {
    let mut first_peak = Family::of(node, &metrics::RANK_FIRST_STEP_PEAK_BYTES);
    let mut steady_peak = Family::of(node, &metrics::RANK_STEADY_STEP_PEAK_BYTES);
    let mut anomaly = Family::of(node, &metrics::RANK_FIRST_STEP_ANOMALY_RATIO);
    let mut steady_reached = Family::of(node, &metrics::RANK_STEADY_STATE_REACHED);
    let mut phase_peak = Family::of(node, &metrics::RANK_PHASE_PEAK_BYTES);
    let mut predicted = Family::of(node, &metrics::RANK_PREDICTED_PEAK_BYTES);
    let mut headroom = Family::of(node, &metrics::RANK_PREDICTED_HEADROOM_BYTES);
    let mut capacity = Family::of(node, &metrics::RANK_GPU_CAPACITY_BYTES);
    let mut risk = Family::of(node, &metrics::RANK_OOM_RISK);
    let mut provisional = Family::of(node, &metrics::RANK_PREDICTION_PROVISIONAL);
    let mut basis = Family::of(node, &metrics::RANK_PREDICTION_BASIS);
    let mut limited = Family::of(node, &metrics::RANK_PREDICTION_BASIS_LIMITED);
    let mut upheld = Family::of(node, &metrics::RANK_PREDICTION_WARNING_UPHELD);
    let mut error = Family::of(node, &metrics::RANK_PREDICTION_ERROR_RATIO);
    let mut peak_div = Family::of(node, &metrics::JOB_FIRST_STEP_PEAK_DIVERGENCE_RATIO);
    let mut dur_div = Family::of(node, &metrics::JOB_FIRST_STEP_DURATION_DIVERGENCE_RATIO);
    let mut act_div = Family::of(node, &metrics::JOB_ACTIVATION_PEAK_DIVERGENCE_RATIO);
    let mut steady_div = Family::of(node, &metrics::JOB_STEADY_PEAK_DIVERGENCE_RATIO);
    let mut outlier = Family::of(node, &metrics::JOB_RANK_OUTLIER);
    let mut rank_activation = Family::of(node, &metrics::RANK_FIRST_STEP_ACTIVATION_PEAK_BYTES);
    let mut trailing_max = Family::of(node, &metrics::RANK_TRAILING_STEP_PEAK_MAX_BYTES);
    let mut trailing_headroom = Family::of(node, &metrics::RANK_TRAILING_HEADROOM_BYTES);
    let mut growth = Family::of(node, &metrics::RANK_MEMORY_GROWTH_BYTES_PER_STEP);
    let mut oom_seconds = Family::of(node, &metrics::RANK_MEMORY_FORECAST_OOM_SECONDS);
    let mut oom_step = Family::of(node, &metrics::RANK_MEMORY_FORECAST_OOM_STEP);
    let mut trailing_min = Family::of(node, &metrics::RANK_TRAILING_STEP_PEAK_MIN_BYTES);
    let mut pass_peak = Family::of(node, &metrics::RANK_PASS_PEAK_BYTES);
    let mut pass_headroom = Family::of(node, &metrics::RANK_PASS_HEADROOM_BYTES);
    let mut batch_largest = Family::of(node, &metrics::RANK_BATCH_LARGEST_PEAK_BYTES);
    let mut outlook_peak = Family::of(node, &metrics::RANK_BATCH_OUTLOOK_PEAK_BYTES);
    let mut outlook_headroom = Family::of(node, &metrics::RANK_BATCH_OUTLOOK_HEADROOM_BYTES);
    for (key, div) in &tracker.divergence {
        let job = [
            ("namespace", key.namespace.as_str()),
            ("training_job", key.job.as_str()),
        ];
        let Some(div) = div else {
            continue;
        };
        if let Some(peak) = &div.peak {
            peak_div.add(&job, peak.spread);
        }
        if let Some(a) = &div.activation {
            act_div.add(&job, a.spread);
        }
        if let Some(st) = &div.steady {
            steady_div.add(&job, st.spread);
        }
        for n in &div.named {
            outlier.add(
                &[
                    job[0],
                    job[1],
                    ("rank", &n.rank.to_string()),
                    ("figure", n.figure.as_str()),
                ],
                1.0,
            );
        }
        if let Some(d) = &div.duration {
            dur_div.add(&job, d.spread);
        }
    }
    for rank in &tracker.ranks {
        let key = &rank.key;
        let rank_label = key.rank.to_string();
        let labels = rank_labels(key, &rank_label, &rank.info);
        let Some(a) = &rank.analysis else {
            continue;
        };
        if let Some(trend) = &rank.trend {
            let t = &trend.trailing;
            for (source, max, min) in [
                ("nvml", t.nvml_max_bytes, t.nvml_min_bytes),
                ("allocated", t.allocated_max_bytes, t.allocated_min_bytes),
                ("reserved", t.reserved_max_bytes, t.reserved_min_bytes),
            ] {
                let labels = with(&labels, ("source", source));
                if let Some(b) = max {
                    trailing_max.add(&labels, b as f64);
                }
                if let Some(b) = min {
                    trailing_min.add(&labels, b as f64);
                }
            }
            if let (Some(max), true) = (t.nvml_max_bytes, a.capacity_bytes > 0) {
                trailing_headroom.add(&labels, a.capacity_bytes as f64 - max as f64);
            }
            for source in GrowthSource::ALL {
                if let Some(s) = trend.slope(source) {
                    growth.add(
                        &with(&labels, ("source", source.as_str())),
                        s.bytes_per_step,
                    );
                }
            }
        }
        for p in &rank.passes {
            let labels = with(&labels, ("kind", p.kind.as_str()));
            if let Some(b) = p.highest.device_peak_bytes {
                pass_peak.add(&labels, b as f64);
            }
            if let Some(h) = p.headroom_bytes {
                pass_headroom.add(&labels, h as f64);
            }
        }
        if let Some(b) = &rank.batches {
            if let Some(p) = b.largest_device_peak_bytes {
                batch_largest.add(&labels, p as f64);
            }
            if let Some(o) = &b.outlook {
                if let Some(p) = o.device_peak_bytes {
                    outlook_peak.add(&labels, p as f64);
                }
                if let Some(h) = o.headroom_bytes {
                    outlook_headroom.add(&labels, h as f64);
                }
            }
        }
        if let Some(f) = &rank.growth {
            if let Some(s) = f.seconds_to_oom {
                oom_seconds.add(&labels, s);
            }
            oom_step.add(&labels, f.oom_step as f64);
        }
        if a.capacity_bytes > 0 {
            capacity.add(&labels, a.capacity_bytes as f64);
        }
        steady_reached.add(&labels, if a.steady_state.reached { 1.0 } else { 0.0 });
        if let Some(ratio) = a.anomaly_ratio {
            anomaly.add(&labels, ratio);
        }
        if let Some(b) = rank.activation_peak_bytes {
            rank_activation.add(&labels, b as f64);
        }
        if let Some(first) = &a.first_step {
            if let Some(p) = first.device_peak_bytes {
                first_peak.add(&labels, p as f64);
            }
            let phases = match phase_series {
                RankPhaseSeries::None => &[][..],
                _ => &first.phases[..],
            };
            for ph in phases {
                add_phase_peaks(
                    &mut phase_peak,
                    &labels,
                    ph.phase,
                    "first",
                    ph.nvml_peak_bytes,
                    ph.peaks.allocated_peak_bytes,
                );
            }
        }
        if let Some(steady) = &a.steady {
            if let Some(p) = steady.nvml_peak_bytes {
                steady_peak.add(&labels, p as f64);
                if let (Some(frozen), true) = (rank.frozen_peak_bytes, p > 0) {
                    error.add(&labels, (frozen as f64 - p as f64) / p as f64);
                }
            }
            let phases = match phase_series {
                RankPhaseSeries::All => &steady.phases[..],
                _ => &[][..],
            };
            for ph in phases {
                add_phase_peaks(
                    &mut phase_peak,
                    &labels,
                    ph.phase,
                    "steady",
                    ph.nvml_peak_bytes,
                    ph.peaks.allocated_peak_bytes,
                );
            }
        }
        if let Some(p) = &a.prediction {
            predicted.add(&labels, p.predicted_peak_bytes as f64);
            if let Some(h) = p.headroom_bytes {
                headroom.add(&labels, h as f64);
            }
            risk.add(&labels, if p.oom_risk { 1.0 } else { 0.0 });
            provisional.add(&labels, if p.provisional { 1.0 } else { 0.0 });
            let b = p.inputs.basis.as_str();
            basis.add(&with(&labels, ("basis", b)), 1.0);
            for l in BasisLimit::ALL {
                let on = p.inputs.basis_limits.contains(&l);
                limited.add(
                    &with(&labels, ("limit", l.as_str())),
                    if on { 1.0 } else { 0.0 },
                );
            }
            let kept = p.warning_revision == Some(WarningRevision::UpheldUntilMeasured);
            upheld.add(&labels, if kept { 1.0 } else { 0.0 });
        }
    }
    for f in [
        first_peak,
        steady_peak,
        anomaly,
        steady_reached,
        phase_peak,
        predicted,
        headroom,
        capacity,
        risk,
        provisional,
        basis,
        limited,
        upheld,
        error,
        peak_div,
        dur_div,
        act_div,
        steady_div,
        outlier,
        rank_activation,
        trailing_max,
        trailing_headroom,
        growth,
        oom_seconds,
        oom_step,
        trailing_min,
        pass_peak,
        pass_headroom,
        batch_largest,
        outlook_peak,
        outlook_headroom,
    ] {
        f.done(out);
    }
}

/// The labels of a rank's series: `namespace`, `training_job`, `rank` name
/// it (ranks are keyed by all three), and `pod`, `container` say where it
/// runs (from the kubelet when attested). Empty ones are left out.
type RankLabels<'a> = [(&'static str, &'a str); 5];

fn rank_labels<'a>(key: &'a RankKey, rank: &'a str, info: &'a RankInfo) -> RankLabels<'a> {
    [
        ("namespace", key.namespace.as_str()),
        ("training_job", key.job.as_str()),
        ("rank", rank),
        ("pod", info.pod.as_str()),
        ("container", info.container.as_str()),
    ]
}

/// A rank's labels and one more.
fn with<'a>(rank: &RankLabels<'a>, extra: (&'static str, &'a str)) -> Vec<(&'static str, &'a str)> {
    let mut labels = rank.to_vec();
    labels.push(extra);
    labels
}

fn add_phase_peaks(
    family: &mut Family<'_>,
    rank: &RankLabels<'_>,
    phase: PhaseKind,
    step_class: &str,
    nvml: Option<u64>,
    allocated: Option<u64>,
) {
    for (source, value) in [("nvml", nvml), ("allocator", allocated)] {
        if let Some(v) = value {
            family.add(
                &[
                    rank[0],
                    rank[1],
                    rank[2],
                    rank[3],
                    rank[4],
                    ("phase", phase.as_str()),
                    ("source", source),
                    ("step_class", step_class),
                ],
                v as f64,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{test_marker, test_rank, test_state};
    use std::sync::mpsc;
    use std::time::Duration;
    use stepwatch_core::MarkerKind;

    /// Long enough for a loaded 2-core machine; it only bounds a failure.
    const WAIT: Duration = Duration::from_secs(60);

    #[test]
    fn the_step_duration_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        // Steps of 1 µs and 3 µs: the median is 2 µs, as everywhere else in
        // stepwatch (stepwatch_core::median_u64), not the upper middle 3 µs.
        let state = test_state();
        let key = test_rank(&state, "j", 0); // step 1 begins at 1 000 ns
        let batch = [
            test_marker(MarkerKind::StepEnd, 1, 2_000),
            test_marker(MarkerKind::StepBegin, 2, 2_000),
            test_marker(MarkerKind::StepEnd, 2, 5_000),
            test_marker(MarkerKind::StepBegin, 3, 5_000),
        ];
        state.apply_markers(&key, "", &batch).unwrap();
        let body = render(&state);
        let line = body
            .lines()
            .find(|l| l.starts_with("stepwatch_rank_step_duration_median_seconds{"))
            .unwrap_or_else(|| panic!("no median in:\n{body}"));
        let value: f64 = line.rsplit_once(' ').unwrap().1.parse().unwrap();
        assert_eq!(value, 2e-6, "{line}");
    }

    /// A rank of five identical steps (forward, backward, optimizer), each
    /// marker with allocator figures: step 1 and a steady state have phase
    /// peaks, the last step phase durations.
    fn five_steps(state: &AgentState) {
        let key = test_rank(state, "j", 0);
        let mut batch = Vec::new();
        for step in 1..=5u64 {
            let t = step * 10_000;
            for (i, kind) in MarkerKind::STEP_ORDER.into_iter().enumerate() {
                if step == 1 && kind == MarkerKind::StepBegin {
                    continue; // test_rank began step 1
                }
                let mut m = test_marker(kind, step, t + i as u64 * 1_000);
                let allocated = 1_000 + 100 * i as u64;
                m.allocator = Some(stepwatch_core::AllocatorStats {
                    allocated_bytes: allocated,
                    allocated_peak_bytes: 2_000,
                    reserved_bytes: 4_000,
                    reserved_peak_bytes: 4_000,
                    active_bytes: allocated,
                    active_peak_bytes: 2_000,
                    num_alloc_retries: 0,
                });
                batch.push(m);
            }
        }
        state.apply_markers(&key, "", &batch).unwrap();
    }

    /// The trailing window (steps 3 on) is exported with the headroom of its
    /// highest NVML step peak against the GPU's capacity.
    #[test]
    fn the_trailing_window_and_its_headroom_are_exported() {
        let state = test_state();
        // The GPU's capacity, and samples in every phase of steps 1..=5
        // (test_rank's GPU has the empty uuid); step 4 peaks highest.
        let samples: Vec<stepwatch_core::GpuSample> = (1..=5u64)
            .flat_map(|step| {
                (0..6u64).map(move |i| stepwatch_core::GpuSample {
                    monotonic_ns: step * 10_000 + i * 1_000 + 500,
                    used_bytes: if step == 4 { 7_000 } else { 5_000 },
                    capacity_bytes: 10_000,
                })
            })
            .collect();
        state.test_gpu_samples("", &samples);
        five_steps(&state);
        let body = render(&state);
        let labels = "{node=\"test-node\",training_job=\"j\",rank=\"0\"";
        assert!(
            body.contains(&format!(
                "stepwatch_rank_trailing_step_peak_max_bytes{labels},source=\"nvml\"}} 7000"
            )),
            "{body}"
        );
        assert!(
            body.contains(&format!(
                "stepwatch_rank_trailing_headroom_bytes{labels}}} 3000"
            )),
            "{body}"
        );
    }

    fn series_of<'b>(body: &'b str, family: &str) -> Vec<&'b str> {
        body.lines()
            .filter(|l| l.starts_with(&format!("{family}{{")))
            .collect()
    }

    #[test]
    fn rank_phase_series_can_be_cut_to_step_one_or_to_none() {
        let all = test_state();
        five_steps(&all);
        let body = render(&all);
        let peaks = series_of(&body, "stepwatch_rank_phase_peak_bytes");
        assert!(
            peaks.iter().any(|l| l.contains("step_class=\"first\"")),
            "{body}"
        );
        assert!(
            peaks.iter().any(|l| l.contains("step_class=\"steady\"")),
            "{body}"
        );
        assert!(!series_of(&body, "stepwatch_rank_phase_duration_seconds").is_empty());

        let first_step = test_state();
        first_step.set_rank_phase_series(RankPhaseSeries::FirstStep);
        five_steps(&first_step);
        let body = render(&first_step);
        let first_peaks = series_of(&body, "stepwatch_rank_phase_peak_bytes");
        assert_eq!(
            first_peaks,
            peaks
                .iter()
                .copied()
                .filter(|l| l.contains("step_class=\"first\""))
                .collect::<Vec<_>>()
        );
        assert!(series_of(&body, "stepwatch_rank_phase_duration_seconds").is_empty());
        // The rest of the rank's series stay.
        assert_eq!(
            series_of(&body, "stepwatch_rank_steady_step_peak_bytes").len(),
            series_of(&render(&all), "stepwatch_rank_steady_step_peak_bytes").len()
        );

        let none = test_state();
        none.set_rank_phase_series(RankPhaseSeries::None);
        five_steps(&none);
        let body = render(&none);
        assert!(
            series_of(&body, "stepwatch_rank_phase_peak_bytes").is_empty(),
            "{body}"
        );
        assert!(series_of(&body, "stepwatch_rank_phase_duration_seconds").is_empty());
        assert!(!series_of(&body, "stepwatch_rank_last_step").is_empty());
    }

    /// The text written here is what the client library's encoder writes
    /// for the same families, escapes and the histogram's buckets included.
    #[test]
    fn families_are_written_as_the_client_library_encodes_them() {
        use prometheus::proto::{
            Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily,
        };
        let node = "n\"1\\";
        let labels = [("a", "x\ny\"z\\"), ("empty", ""), ("b", "1")];
        let mut written = Vec::new();
        let mut g = Family::new(node, "t_gauge", "help with \\ and \n", MetricType::GAUGE);
        g.add(&labels, 1.5);
        g.add(&[], f64::INFINITY);
        g.done(&mut written);
        let mut c = Family::new(node, "t_total", "counted", MetricType::COUNTER);
        c.add(&labels, 3.0);
        c.done(&mut written);
        let mut h = Family::new(node, "t_seconds", "lateness", MetricType::HISTOGRAM);
        h.add_histogram(&[(0.001, 2), (0.5, 7)], 9, 1.25);
        h.done(&mut written);
        let empty = Family::new(node, "t_empty", "no series", MetricType::GAUGE);
        empty.done(&mut written);
        let written: String = written.iter().map(|f| f.text.as_str()).collect();

        let pair = |name: &str, value: &str| {
            let mut p = LabelPair::default();
            p.set_name(name.into());
            p.set_value(value.into());
            p
        };
        let with_labels = |pairs: &[(&str, &str)]| {
            Metric::from_label(
                std::iter::once(pair("node", node))
                    .chain(
                        pairs
                            .iter()
                            .filter(|(_, v)| !v.is_empty())
                            .map(|(n, v)| pair(n, v)),
                    )
                    .collect(),
            )
        };
        let family = |name: &str, help: &str, kind, metrics: Vec<Metric>| {
            let mut f = MetricFamily::default();
            f.set_name(name.into());
            f.set_help(help.into());
            f.set_field_type(kind);
            f.set_metric(metrics);
            f
        };
        let gauge = |pairs: &[(&str, &str)], v| {
            let mut m = with_labels(pairs);
            let mut g = Gauge::default();
            g.set_value(v);
            m.set_gauge(g);
            m
        };
        let mut counter = with_labels(&labels);
        let mut cv = Counter::default();
        cv.set_value(3.0);
        counter.set_counter(cv);
        let mut hist = with_labels(&[]);
        let mut hv = Histogram::default();
        hv.set_bucket(
            [(0.001, 2), (0.5, 7)]
                .iter()
                .map(|&(u, n)| {
                    let mut b = Bucket::default();
                    b.set_upper_bound(u);
                    b.set_cumulative_count(n);
                    b
                })
                .collect(),
        );
        hv.set_sample_count(9);
        hv.set_sample_sum(1.25);
        hist.set_histogram(hv);
        let expected = [
            family(
                "t_gauge",
                "help with \\ and \n",
                MetricType::GAUGE,
                vec![gauge(&labels, 1.5), gauge(&[], f64::INFINITY)],
            ),
            family("t_total", "counted", MetricType::COUNTER, vec![counter]),
            family("t_seconds", "lateness", MetricType::HISTOGRAM, vec![hist]),
        ];
        let mut encoded = String::new();
        TextEncoder::new()
            .encode_utf8(&expected, &mut encoded)
            .unwrap();
        assert_eq!(written, encoded);
    }

    #[test]
    fn ingest_goes_on_in_the_middle_of_a_scrape() {
        // A scrape used to hold the tracker lock across every rank's
        // analysis. Here, after the first rank is copied, a marker batch for
        // another rank must be applied before the scrape goes on.
        let state = test_state();
        let keys: Vec<RankKey> = (0..3).map(|r| test_rank(&state, "j", r)).collect();
        let mut ingested_mid_scrape = 0;
        let body = render_with(&state, &mut || {
            if ingested_mid_scrape > 0 {
                return;
            }
            let (done_tx, done_rx) = mpsc::channel();
            let (state, key) = (state.clone(), keys[2].clone());
            std::thread::spawn(move || {
                let batch = [
                    test_marker(MarkerKind::StepEnd, 1, 2_000),
                    test_marker(MarkerKind::StepBegin, 2, 3_000),
                ];
                let _ = done_tx.send(state.apply_markers(&key, "", &batch).is_ok());
            });
            assert_eq!(
                done_rx.recv_timeout(WAIT),
                Ok(true),
                "the batch waited for the scrape"
            );
            ingested_mid_scrape += 1;
        });
        assert_eq!(ingested_mid_scrape, 1);
        assert!(
            body.contains("stepwatch_ranks_tracked{node=\"test-node\"} 3"),
            "{body}"
        );
        // The rank copied after the batch shows it: step 2 has begun.
        assert!(
            body.contains(
                "stepwatch_rank_last_step{node=\"test-node\",training_job=\"j\",rank=\"2\"} 2"
            ),
            "{body}"
        );
        assert!(body.contains(
            "stepwatch_rank_last_step{node=\"test-node\",training_job=\"j\",rank=\"1\"} 1"
        ));
    }
}
