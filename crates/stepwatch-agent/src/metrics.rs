//! Every metric family the agent exports, declared once: the exporter
//! and the registry build their families from these entries, and the
//! metrics reference (`docs/src/reference/metrics.md`) is generated from
//! them (a test fails when the page differs; `STEPWATCH_UPDATE_DOCS=1`
//! rewrites it).

/// How a family is exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MetricKind {
    Gauge,
    Counter,
    Histogram,
}

/// One metric family.
#[derive(Debug)]
pub(crate) struct MetricDef {
    /// The family's name, `stepwatch_…`.
    pub name: &'static str,
    pub kind: MetricKind,
    /// The labels besides `node`, as the reference lists them.
    pub labels: &'static str,
    /// What the reference says it means, in a line.
    pub meaning: &'static str,
    /// The `# HELP` text.
    pub help: &'static str,
}

impl MetricDef {
    /// The client library's options for a registry family.
    pub(crate) fn opts(&self) -> prometheus::Opts {
        prometheus::Opts::new(self.name, self.help)
    }
}

/// `stepwatch_build_info`
pub(crate) const BUILD_INFO: MetricDef = MetricDef {
    name: "stepwatch_build_info",
    kind: MetricKind::Gauge,
    labels: "`version`",
    meaning: "always 1",
    help: "Agent version; always 1.",
};

/// `stepwatch_nvml_up`
pub(crate) const NVML_UP: MetricDef = MetricDef {
    name: "stepwatch_nvml_up",
    kind: MetricKind::Gauge,
    labels: "",
    meaning: "1 when NVML answered the last attempt",
    help: "1 when NVML answered the last attempt, 0 while it is missing or lost (the agent retries with backoff).",
};

/// `stepwatch_gpu_info`
pub(crate) const GPU_INFO: MetricDef = MetricDef {
    name: "stepwatch_gpu_info",
    kind: MetricKind::Gauge,
    labels: "GPU labels, `name`",
    meaning: "always 1",
    help: "GPU identity; always 1.",
};

/// `stepwatch_gpu_up`
pub(crate) const GPU_UP: MetricDef = MetricDef {
    name: "stepwatch_gpu_up",
    kind: MetricKind::Gauge,
    labels: "GPU labels",
    meaning: "0 while NVML reports the GPU lost, NVML itself is down, or the GPU's samples are stale",
    help: "1 while NVML reads the GPU, 0 when it reports it lost or its samples are stale (stepwatch_gpu_sample_age_seconds above the bound: an NVML call hangs).",
};

/// `stepwatch_gpu_sample_age_seconds`
pub(crate) const GPU_SAMPLE_AGE_SECONDS: MetricDef = MetricDef {
    name: "stepwatch_gpu_sample_age_seconds",
    kind: MetricKind::Gauge,
    labels: "GPU labels",
    meaning: "seconds since the last good memory read; above max(2 s, 5 sampling periods) an NVML call hangs and the figures are frozen",
    help: "Seconds since the GPU's last good memory read; above max(2 s, 5 sampling periods) the figures are frozen and stepwatch_gpu_up is 0.",
};

/// `stepwatch_gpu_memory_used_bytes`
pub(crate) const GPU_MEMORY_USED_BYTES: MetricDef = MetricDef {
    name: "stepwatch_gpu_memory_used_bytes",
    kind: MetricKind::Gauge,
    labels: "GPU labels",
    meaning: "used at the last sample",
    help: "Device memory in use at the last sample (NVML memory info v2 'used', which excludes driver-reserved memory).",
};

/// `stepwatch_gpu_memory_used_max_bytes`
pub(crate) const GPU_MEMORY_USED_MAX_BYTES: MetricDef = MetricDef {
    name: "stepwatch_gpu_memory_used_max_bytes",
    kind: MetricKind::Gauge,
    labels: "GPU labels",
    meaning: "max over the trailing `--max-window`, not reset by scrapes",
    help: "Maximum of stepwatch_gpu_memory_used_bytes over the trailing window (--max-window); never reset by scrapes.",
};

/// `stepwatch_gpu_memory_total_bytes`
pub(crate) const GPU_MEMORY_TOTAL_BYTES: MetricDef = MetricDef {
    name: "stepwatch_gpu_memory_total_bytes",
    kind: MetricKind::Gauge,
    labels: "GPU labels",
    meaning: "capacity",
    help: "Device memory capacity (NVML v2 'total').",
};

/// `stepwatch_gpu_memory_free_bytes`
pub(crate) const GPU_MEMORY_FREE_BYTES: MetricDef = MetricDef {
    name: "stepwatch_gpu_memory_free_bytes",
    kind: MetricKind::Gauge,
    labels: "GPU labels",
    meaning: "free at the last sample",
    help: "Device memory free at the last sample (NVML v2 'free').",
};

/// `stepwatch_gpu_samples_total`
pub(crate) const GPU_SAMPLES_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_gpu_samples_total",
    kind: MetricKind::Counter,
    labels: "GPU labels",
    meaning: "device-memory samples taken (kept across NVML re-initialisations)",
    help: "Device-memory samples taken.",
};

/// `stepwatch_gpu_processes`
pub(crate) const GPU_PROCESSES: MetricDef = MetricDef {
    name: "stepwatch_gpu_processes",
    kind: MetricKind::Gauge,
    labels: "GPU labels",
    meaning: "compute processes at the last process-list read",
    help: "Compute processes on the GPU at the last process-list read.",
};

/// `stepwatch_gpu_utilization_ratio`
pub(crate) const GPU_UTILIZATION_RATIO: MetricDef = MetricDef {
    name: "stepwatch_gpu_utilization_ratio",
    kind: MetricKind::Gauge,
    labels: "GPU labels",
    meaning: "busy ratio over NVML's averaging window",
    help: "GPU busy ratio over NVML's own averaging window (1/6 s to 1 s).",
};

/// `stepwatch_sampler_lag_seconds`
pub(crate) const SAMPLER_LAG_SECONDS: MetricDef = MetricDef {
    name: "stepwatch_sampler_lag_seconds",
    kind: MetricKind::Gauge,
    labels: "",
    meaning: "worst sampler tick lateness over the trailing window",
    help: "Worst lateness of a sampler tick over the trailing window.",
};

/// `stepwatch_sampler_tick_lateness_seconds`
pub(crate) const SAMPLER_TICK_LATENESS_SECONDS: MetricDef = MetricDef {
    name: "stepwatch_sampler_tick_lateness_seconds",
    kind: MetricKind::Histogram,
    labels: "",
    meaning: "histogram of sampler tick lateness (jitter) since start",
    help: "How late each sampler tick started, since the agent started (jitter).",
};

/// `stepwatch_sampler_ticks_total`
pub(crate) const SAMPLER_TICKS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_sampler_ticks_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "sampler ticks",
    help: "Sampler ticks run.",
};

/// `stepwatch_sampler_late_ticks_total`
pub(crate) const SAMPLER_LATE_TICKS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_sampler_late_ticks_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "ticks more than one period late",
    help: "Sampler ticks that started more than one period late.",
};

/// `stepwatch_sampler_samples_dropped_total`
pub(crate) const SAMPLER_SAMPLES_DROPPED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_sampler_samples_dropped_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "samples the step tracker did not take in time",
    help: "Samples dropped because the step tracker did not take them in time.",
};

/// `stepwatch_nvml_init_attempts_total`
pub(crate) const NVML_INIT_ATTEMPTS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_nvml_init_attempts_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "attempts to initialise NVML",
    help: "Attempts to initialise NVML.",
};

/// `stepwatch_nvml_errors_total`
pub(crate) const NVML_ERRORS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_nvml_errors_total",
    kind: MetricKind::Counter,
    labels: "`call`",
    meaning: "NVML calls that failed, by call",
    help: "NVML calls that returned an error, by call.",
};

/// `stepwatch_ranks_tracked`
pub(crate) const RANKS_TRACKED: MetricDef = MetricDef {
    name: "stepwatch_ranks_tracked",
    kind: MetricKind::Gauge,
    labels: "",
    meaning: "ranks tracked",
    help: "Ranks the agent currently tracks.",
};

/// `stepwatch_retained_bytes`
pub(crate) const RETAINED_BYTES: MetricDef = MetricDef {
    name: "stepwatch_retained_bytes",
    kind: MetricKind::Gauge,
    labels: "",
    meaning: "bytes the ranks' retained step history holds (approximately), kept within `--memory-budget-mib`",
    help: "Bytes the ranks' retained step history holds (approximately); kept within --memory-budget-mib.",
};

/// `stepwatch_memory_limit_bytes`
pub(crate) const MEMORY_LIMIT_BYTES: MetricDef = MetricDef {
    name: "stepwatch_memory_limit_bytes",
    kind: MetricKind::Gauge,
    labels: "",
    meaning: "the memory the agent budgets for: `--memory-limit-mib`, else the container's cgroup `memory.max`, else 192 MiB",
    help: "The memory the agent budgets for: --memory-limit-mib, else the container's cgroup memory.max, else 192 MiB.",
};

/// `stepwatch_memory_budget_bytes`
pub(crate) const MEMORY_BUDGET_BYTES: MetricDef = MetricDef {
    name: "stepwatch_memory_budget_bytes",
    kind: MetricKind::Gauge,
    labels: "`budget`",
    meaning: "each budget drawn from the memory limit: `history` (retained steps), `traces` (allocator traces in flight, as accounted), `reports` (rank reports in flight), `connections` (ingest connections' and streams' buffers, as estimated)",
    help: "Budgets drawn from the memory limit: history (retained steps), traces (allocator traces in flight, as accounted), reports (rank reports in flight), connections (ingest connections' and streams' buffers, as estimated).",
};

/// `stepwatch_ranks_evicted_for_memory_total`
pub(crate) const RANKS_EVICTED_FOR_MEMORY_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_ranks_evicted_for_memory_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "finished ranks dropped before their retention window to keep the step history within its budget (finished ranks give way before any step is trimmed or marker refused)",
    help: "Finished ranks dropped before the retention window to keep the step history within its budget.",
};

/// `stepwatch_http_reports_refused_total`
pub(crate) const HTTP_REPORTS_REFUSED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_http_reports_refused_total",
    kind: MetricKind::Counter,
    labels: "`reason`",
    meaning: "rank reports answered 503 to stay within the reports budget: `busy` (other reports held it for 5 s), `too_large` (this report alone exceeds it; ask for fewer `?steps=`)",
    help: "Rank reports refused (503) to stay within the reports budget, by reason: busy, too_large.",
};

/// `stepwatch_steps_trimmed_total`
pub(crate) const STEPS_TRIMMED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_steps_trimmed_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "steps dropped before `--max-steps` to stay within the memory budget (the rank holding the most gives up its oldest)",
    help: "Steps dropped before --max-steps to stay within --memory-budget-mib (the rank holding the most gives up its oldest).",
};

/// `stepwatch_layout_snapshots_total`
pub(crate) const LAYOUT_SNAPSHOTS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_layout_snapshots_total",
    kind: MetricKind::Counter,
    labels: "`result`",
    meaning: "segment layouts that arrived on markers (clients without an allocator trace send them at step 1's optimizer begin and end): `kept` (the prediction uses them), `misplaced` (another marker or step, an end without a begin, a second pair), `too_many_blocks`, `unmodelled` (the allocator model cannot take the pair); a layout not kept leaves the prediction guessing the layout (`allocator_figures_cannot_see_layout`). All four are exported from the start",
    help: "Segment layouts received on markers (clients without an allocator trace send them on step 1's optimizer begin and end), by result: kept (the step-2 prediction uses them), misplaced (another marker or step, an end without a begin), too_many_blocks, unmodelled (the allocator model cannot take the pair). Not kept: the prediction guesses the layout.",
};

/// `stepwatch_rank_info`
pub(crate) const RANK_INFO: MetricDef = MetricDef {
    name: "stepwatch_rank_info",
    kind: MetricKind::Gauge,
    labels: "rank labels, `local_rank`, `world_size`, `gpu_uuid`, `gpu_instance_id`, `mig_profile`, `attested`",
    meaning: "always 1; `pod`/`container` from the kubelet when `attested=\"true\"`; `gpu_instance_id` and `mig_profile` when the rank's device is a MIG slice",
    help: "Rank identity; always 1.",
};

/// `stepwatch_rank_connected`
pub(crate) const RANK_CONNECTED: MetricDef = MetricDef {
    name: "stepwatch_rank_connected",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "1 while the rank's stream is open",
    help: "1 while the rank has an open marker stream.",
};

/// `stepwatch_rank_steps_completed_total`
pub(crate) const RANK_STEPS_COMPLETED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_rank_steps_completed_total",
    kind: MetricKind::Counter,
    labels: "rank labels",
    meaning: "steps that reached their end",
    help: "Steps that reached their step end.",
};

/// `stepwatch_rank_last_step`
pub(crate) const RANK_LAST_STEP: MetricDef = MetricDef {
    name: "stepwatch_rank_last_step",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "latest step number seen",
    help: "Number of the latest step seen (open or not).",
};

/// `stepwatch_rank_step_duration_seconds`
pub(crate) const RANK_STEP_DURATION_SECONDS: MetricDef = MetricDef {
    name: "stepwatch_rank_step_duration_seconds",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "latest completed step",
    help: "Duration of the latest completed step.",
};

/// `stepwatch_rank_step_duration_median_seconds`
pub(crate) const RANK_STEP_DURATION_MEDIAN_SECONDS: MetricDef = MetricDef {
    name: "stepwatch_rank_step_duration_median_seconds",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "median over the retained completed steps (for an even count the mean of the two middle ones, as every median in stepwatch)",
    help: "Median duration of the retained completed steps (the mean of the two middle ones for an even count).",
};

/// `stepwatch_rank_last_step_end_timestamp_seconds`
pub(crate) const RANK_LAST_STEP_END_TIMESTAMP_SECONDS: MetricDef = MetricDef {
    name: "stepwatch_rank_last_step_end_timestamp_seconds",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "wall time of the latest step end",
    help: "Wall-clock time of the latest step end (for stall alerts).",
};

/// `stepwatch_rank_phase_duration_seconds`
pub(crate) const RANK_PHASE_DURATION_SECONDS: MetricDef = MetricDef {
    name: "stepwatch_rank_phase_duration_seconds",
    kind: MetricKind::Gauge,
    labels: "rank labels, `phase`",
    meaning: "phases of the latest completed step",
    help: "Duration of each phase in the latest completed step (micro-batches summed).",
};

/// `stepwatch_rank_ooms_total`
pub(crate) const RANK_OOMS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_rank_ooms_total",
    kind: MetricKind::Counter,
    labels: "rank labels",
    meaning: "steps that ended in an OOM",
    help: "Steps that ended with an out-of-memory marker.",
};

/// `stepwatch_rank_allocator_retries_total`
pub(crate) const RANK_ALLOCATOR_RETRIES_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_rank_allocator_retries_total",
    kind: MetricKind::Counter,
    labels: "rank labels",
    meaning: "PyTorch's `num_alloc_retries` as the rank's latest marker reported it: allocations for which the caching allocator freed its cache and retried `cudaMalloc`. Growth after step 1: the job runs at the GPU's limit (`StepwatchAllocatorRetries`; the step-anatomy dashboard's \"Allocator retries per rank\" panel). Absent until a marker carries allocator figures; a new run of the same process starts from its first figure",
    help: "PyTorch's num_alloc_retries as the rank's latest marker reported it: allocations for which the caching allocator had to free its cache and retry cudaMalloc. Growth after step 1 means the job runs at the GPU's memory limit (each retry is a slow cache flush; a larger request may fail next). Absent until a marker carries allocator figures.",
};

/// `stepwatch_rank_first_step_peak_bytes`
pub(crate) const RANK_FIRST_STEP_PEAK_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_first_step_peak_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "device memory peak of step 1: the highest NVML sample, or when higher the allocator's reserved peak plus what NVML shows beside the allocator (samples miss short peaks; the allocator's peak counters do not)",
    help: "Peak device memory during the rank's first step: the highest NVML sample, or when higher the allocator's reserved peak plus the non-allocator memory NVML shows.",
};

/// `stepwatch_rank_steady_step_peak_bytes`
pub(crate) const RANK_STEADY_STEP_PEAK_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_steady_step_peak_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "median NVML peak of steps 2..k",
    help: "Median peak device memory (NVML) of the steps after the first (steady state).",
};

/// `stepwatch_rank_first_step_anomaly_ratio`
pub(crate) const RANK_FIRST_STEP_ANOMALY_RATIO: MetricDef = MetricDef {
    name: "stepwatch_rank_first_step_anomaly_ratio",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "steady peak / first-step peak",
    help:
        "Steady-state peak divided by first-step peak (above 1: later steps need more than step 1).",
};

/// `stepwatch_rank_steady_state_reached`
pub(crate) const RANK_STEADY_STATE_REACHED: MetricDef = MetricDef {
    name: "stepwatch_rank_steady_state_reached",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "1 once step peaks agree",
    help: "1 once consecutive step peaks agree within the tolerance.",
};

/// `stepwatch_rank_phase_peak_bytes`
pub(crate) const RANK_PHASE_PEAK_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_phase_peak_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels, `phase`, `source`, `step_class`",
    meaning: "per-phase peak, `source` nvml or allocator, `step_class` first or steady",
    help: "Peak memory per phase, from NVML (device) or the allocator (allocated), for the first step and the steady state.",
};

/// `stepwatch_rank_predicted_peak_bytes`
pub(crate) const RANK_PREDICTED_PEAK_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_predicted_peak_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "predicted steady-state peak as NVML will see it, made during step 1",
    help: "Predicted steady-state peak device memory (as NVML will see it, other processes included), made during step 1.",
};

/// `stepwatch_rank_predicted_headroom_bytes`
pub(crate) const RANK_PREDICTED_HEADROOM_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_predicted_headroom_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "capacity − predicted peak (other processes included); negative: step 2 will not fit",
    help: "GPU capacity minus the predicted steady-state peak (rank plus other processes); negative means step 2 will not fit.",
};

/// `stepwatch_rank_gpu_capacity_bytes`
pub(crate) const RANK_GPU_CAPACITY_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_gpu_capacity_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "what processes can use on the rank's GPU: NVML's total minus the memory the driver reserves (memory info v2 `reserved`); headroom is measured against it",
    help: "What processes can use on the rank's GPU: NVML total minus driver-reserved memory.",
};

/// `stepwatch_rank_oom_risk`
pub(crate) const RANK_OOM_RISK: MetricDef = MetricDef {
    name: "stepwatch_rank_oom_risk",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "1 when predicted headroom < 0, or a step-2 OOM warning stands until a measurement withdraws it",
    help: "1 when the predicted headroom is negative (step 2 will likely run out of memory), or a step-2 OOM warning stands until a measurement withdraws it.",
};

/// `stepwatch_rank_prediction_provisional`
pub(crate) const RANK_PREDICTION_PROVISIONAL: MetricDef = MetricDef {
    name: "stepwatch_rank_prediction_provisional",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "1 while step 1 still runs",
    help: "1 while step 1 is still running and the prediction may still be refined.",
};

/// `stepwatch_rank_prediction_basis`
pub(crate) const RANK_PREDICTION_BASIS: MetricDef = MetricDef {
    name: "stepwatch_rank_prediction_basis",
    kind: MetricKind::Gauge,
    labels: "rank labels, `basis`",
    meaning: "1 for what the prediction was computed from: `allocator_replay`, `allocator` or `nvml_only`",
    help: "1 for what the prediction was computed from (basis: allocator_replay, allocator or nvml_only, least to most blind).",
};

/// `stepwatch_rank_prediction_basis_limited`
pub(crate) const RANK_PREDICTION_BASIS_LIMITED: MetricDef = MetricDef {
    name: "stepwatch_rank_prediction_basis_limited",
    kind: MetricKind::Gauge,
    labels: "rank labels, `limit`",
    meaning: "1 for each thing the basis cannot see, 0 for the others: `nvml_only_cannot_see_cache_reuse`, `optimizer_state_unsized`, `allocator_figures_cannot_see_layout` (markers without a trace or segment snapshots)",
    help: "1 for each thing the prediction's basis cannot see, 0 for the others (limit: nvml_only_cannot_see_cache_reuse, optimizer_state_unsized, allocator_figures_cannot_see_layout).",
};

/// `stepwatch_rank_prediction_warning_upheld`
pub(crate) const RANK_PREDICTION_WARNING_UPHELD: MetricDef = MetricDef {
    name: "stepwatch_rank_prediction_warning_upheld",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "1 while a step-2 OOM warning stands although the latest estimate fits",
    help: "1 while a step-2 OOM warning stands although the latest estimate fits: only a measurement of step 1's optimizer phase withdraws it.",
};

/// `stepwatch_rank_prediction_error_ratio`
pub(crate) const RANK_PREDICTION_ERROR_RATIO: MetricDef = MetricDef {
    name: "stepwatch_rank_prediction_error_ratio",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "(prediction frozen when step 2 began − measured steady peak) / steady peak: how good the warning was",
    help: "(prediction made before step 2 began - steady-state peak) / steady-state peak, once steady state is measured.",
};

/// `stepwatch_rank_trailing_step_peak_max_bytes`
pub(crate) const RANK_TRAILING_STEP_PEAK_MAX_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_trailing_step_peak_max_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels, `source`",
    meaning: "highest step peak of the trailing window (the latest 64 completed steps from step 3 on), `source` `nvml` (device), `allocated` or `reserved` (allocator; exact from a client that resets the peak counters at each step, its default, else lower bounds): the job's whole life, where the steady peak stops at step 11",
    help: "Highest step peak of the trailing window (the latest 64 completed steps from step 3 on), by source: nvml (device memory), allocated or reserved (allocator).",
};

/// `stepwatch_rank_trailing_headroom_bytes`
pub(crate) const RANK_TRAILING_HEADROOM_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_trailing_headroom_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "capacity − the trailing window's highest NVML step peak",
    help: "GPU capacity minus the highest NVML step peak of the trailing window.",
};

/// `stepwatch_rank_memory_growth_bytes_per_step`
pub(crate) const RANK_MEMORY_GROWTH_BYTES_PER_STEP: MetricDef = MetricDef {
    name: "stepwatch_rank_memory_growth_bytes_per_step",
    kind: MetricKind::Gauge,
    labels: "rank labels, `source`",
    meaning: "robust slope (Theil–Sen: median of the pair slopes) over the trailing window of a figure taken at the same point of every step: `allocated` and `reserved` at step end, `nvml` the step's peak; there from 16 steps with the figure, noise included (the forecast says whether it counts)",
    help: "Per-step growth of memory over the trailing window (Theil-Sen slope), by source: allocated or reserved at step end, nvml the step's device peak. Noise included; stepwatch_rank_memory_forecast_oom_seconds is there only when it counts.",
};

/// `stepwatch_rank_memory_forecast_oom_seconds`
pub(crate) const RANK_MEMORY_FORECAST_OOM_SECONDS: MetricDef = MetricDef {
    name: "stepwatch_rank_memory_forecast_oom_seconds",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "seconds from the rank's latest step end until its growing step peak reaches the GPU's capacity, at the fastest growth that counts (Sen's 99.9% interval above 0, and at least 1% of capacity over the window); absent for a flat or noisy job",
    help: "Seconds from the rank's latest completed step until its growing step peak reaches the GPU's capacity, at the measured growth; absent when memory does not grow.",
};

/// `stepwatch_rank_memory_forecast_oom_step`
pub(crate) const RANK_MEMORY_FORECAST_OOM_STEP: MetricDef = MetricDef {
    name: "stepwatch_rank_memory_forecast_oom_step",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "the step at which the growing step peak reaches the GPU's capacity; absent like the seconds",
    help: "The step at which the rank's growing step peak reaches the GPU's capacity, at the measured growth; absent when memory does not grow.",
};

/// `stepwatch_rank_trailing_step_peak_min_bytes`
pub(crate) const RANK_TRAILING_STEP_PEAK_MIN_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_trailing_step_peak_min_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels, `source`",
    meaning: "lowest step peak of the trailing window, by `source` as the max: with it, the spread of the step peaks (batches that vary)",
    help: "Lowest step peak of the trailing window, by source as stepwatch_rank_trailing_step_peak_max_bytes; the two give the spread of the step peaks.",
};

/// `stepwatch_rank_pass_peak_bytes`
pub(crate) const RANK_PASS_PEAK_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_pass_peak_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels, `kind` (`evaluation`, `checkpoint`)",
    meaning: "device peak of the highest retained evaluation pass or checkpoint save (its NVML peak, or its reserved peak plus what NVML shows beyond the allocator on the steps); kept apart from the steps' figures and the prediction",
    help: "Device-memory peak of the highest retained pass of the kind (evaluation, checkpoint), kept apart from training steps.",
};

/// `stepwatch_rank_pass_headroom_bytes`
pub(crate) const RANK_PASS_HEADROOM_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_pass_headroom_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels, `kind`",
    meaning: "capacity − `stepwatch_rank_pass_peak_bytes`",
    help: "GPU capacity minus the device peak of the highest retained pass of the kind.",
};

/// `stepwatch_rank_batch_largest_peak_bytes`
pub(crate) const RANK_BATCH_LARGEST_PEAK_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_batch_largest_peak_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "device peak of the step with the largest batch the client said (from step 3 on)",
    help:
        "Device-memory peak of the step with the largest batch seen (batch facts on the markers).",
};

/// `stepwatch_rank_batch_outlook_peak_bytes`
pub(crate) const RANK_BATCH_OUTLOOK_PEAK_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_batch_outlook_peak_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "device memory the loader's largest batch (`largest_batch=` of the client) would need: the largest batch seen's allocated peak plus the peaks' rise per unit of batch (a straight line; attention that materialises its scores grows faster), plus what the device holds beyond the allocator; the allocator's cache is not counted (PyTorch frees it before it fails)",
    help: "Device-memory peak the largest batch the loader can produce would need, from the peaks' rise per unit of batch; absent unless the client said that batch.",
};

/// `stepwatch_rank_batch_outlook_headroom_bytes`
pub(crate) const RANK_BATCH_OUTLOOK_HEADROOM_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_batch_outlook_headroom_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "capacity − `stepwatch_rank_batch_outlook_peak_bytes`: below 0 the loader's largest batch will not fit",
    help: "GPU capacity minus the peak the loader's largest batch would need; below 0 it will not fit.",
};

/// `stepwatch_job_first_step_peak_divergence_ratio`
pub(crate) const JOB_FIRST_STEP_PEAK_DIVERGENCE_RATIO: MetricDef = MetricDef {
    name: "stepwatch_job_first_step_peak_divergence_ratio",
    kind: MetricKind::Gauge,
    labels: "`namespace`, `training_job`",
    meaning: "(max − min) / median of step-1 peaks of the job's ranks on this node",
    help: "(max - min) / median of the first-step peaks of the job's ranks on this node.",
};

/// `stepwatch_job_first_step_duration_divergence_ratio`
pub(crate) const JOB_FIRST_STEP_DURATION_DIVERGENCE_RATIO: MetricDef = MetricDef {
    name: "stepwatch_job_first_step_duration_divergence_ratio",
    kind: MetricKind::Gauge,
    labels: "`namespace`, `training_job`",
    meaning: "the same for step-1 durations",
    help: "(max - min) / median of the first-step durations of the job's ranks on this node.",
};

/// `stepwatch_job_activation_peak_divergence_ratio`
pub(crate) const JOB_ACTIVATION_PEAK_DIVERGENCE_RATIO: MetricDef = MetricDef {
    name: "stepwatch_job_activation_peak_divergence_ratio",
    kind: MetricKind::Gauge,
    labels: "`namespace`, `training_job`",
    meaning: "the same for step-1 activation peaks (forward/backward peak above the memory at step begin)",
    help: "(max - min) / median of the step-1 activation peaks (forward/backward peak above the memory at step begin) of the job's ranks on this node.",
};

/// `stepwatch_job_steady_peak_divergence_ratio`
pub(crate) const JOB_STEADY_PEAK_DIVERGENCE_RATIO: MetricDef = MetricDef {
    name: "stepwatch_job_steady_peak_divergence_ratio",
    kind: MetricKind::Gauge,
    labels: "`namespace`, `training_job`",
    meaning: "the same for steady-state peaks",
    help: "(max - min) / median of the steady-state peaks of the job's ranks on this node.",
};

/// `stepwatch_job_rank_outlier`
pub(crate) const JOB_RANK_OUTLIER: MetricDef = MetricDef {
    name: "stepwatch_job_rank_outlier",
    kind: MetricKind::Gauge,
    labels: "rank labels, `figure`",
    meaning: "1 for a rank named as an outlier of `figure` (`step1_peak`, `activation_peak`, `steady_peak`): off the median by more than 10%, with at least 3 ranks here that all have the figure",
    help: "1 for a rank named as an outlier of a memory figure (figure: step1_peak, activation_peak, steady_peak): off the job's median on this node beyond the threshold, with at least 3 ranks that all have the figure.",
};

/// `stepwatch_rank_first_step_activation_peak_bytes`
pub(crate) const RANK_FIRST_STEP_ACTIVATION_PEAK_BYTES: MetricDef = MetricDef {
    name: "stepwatch_rank_first_step_activation_peak_bytes",
    kind: MetricKind::Gauge,
    labels: "rank labels",
    meaning: "step 1's forward/backward peak above the memory at step begin (allocated, else NVML): for cross-node divergence rules",
    help: "Step-1 forward/backward peak above the memory at step begin (allocated bytes, else NVML): what differs between ranks when the optimizer state is the same.",
};

/// `stepwatch_markers_received_total`
pub(crate) const MARKERS_RECEIVED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_markers_received_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "markers accepted",
    help: "Markers accepted from training processes.",
};

/// `stepwatch_ingest_streams_active`
pub(crate) const INGEST_STREAMS_ACTIVE: MetricDef = MetricDef {
    name: "stepwatch_ingest_streams_active",
    kind: MetricKind::Gauge,
    labels: "",
    meaning: "open marker streams that said hello",
    help: "Marker streams currently open that have said hello.",
};

/// `stepwatch_ingest_streams_opened_total`
pub(crate) const INGEST_STREAMS_OPENED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_ingest_streams_opened_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "streams opened",
    help: "Marker streams opened since start.",
};

/// `stepwatch_connections_closed_total`
pub(crate) const CONNECTIONS_CLOSED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_connections_closed_total",
    kind: MetricKind::Counter,
    labels: "`listener`, `reason`",
    meaning: "connections the agent refused or closed, by listener (`http`, `api`, `ingest_socket`, `ingest_tcp`, `ingest_volume`) and reason: `peer_limit` (the peer, on a Unix socket its pod or else its uid, on TCP its address, holds `--max-connections-per-peer` or `--max-http-connections-per-peer`), `process_limit` (the process holds `--max-connections-per-process`), `first_byte_timeout` (nothing sent within 5 s), `idle_timeout` (`--idle-timeout`), `header_timeout` (HTTP request headers not complete within `--http-header-timeout`, which also ends idle keep-alive), `no_stream` (an ingest connection with no open stream for `--connection-grace`), `memory_budget` (the memory budget's share for ingest connections and streams, or the peer's half of it, cannot cover another connection). Every pair exists at 0 from the start",
    help: "Connections the agent refused at accept or closed, by listener and reason (peer_limit, process_limit, first_byte_timeout, idle_timeout, header_timeout, no_stream, memory_budget).",
};

/// `stepwatch_ranks_evicted_total`
pub(crate) const RANKS_EVICTED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_ranks_evicted_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "finished ranks evicted: after the retention window, or to make room for a new rank in a full table",
    help: "Finished ranks dropped: after the retention window with no open stream, or to make room in a full rank table.",
};

/// `stepwatch_journal_restored_ranks_total`
pub(crate) const JOURNAL_RESTORED_RANKS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_journal_restored_ranks_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "ranks restored from the journal at start",
    help: "Ranks restored from the journal at start.",
};

/// `stepwatch_markers_rejected_total`
pub(crate) const MARKERS_REJECTED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_markers_rejected_total",
    kind: MetricKind::Counter,
    labels: "`reason`",
    meaning: "markers or hellos refused (`rank_held`: another process holds the rank, or the hello names a run its process has left; `run_ended`: a batch on a still-open stream of a run its process has left for a newer one; `gpu_not_allocated`: the hello's GPU is not its pod's, or not its Slurm job's; `slurm_job_not_yours`: the hello names a Slurm job its process does not run in); every reason the agent knows is exported at 0 from the start, so an alert on `increase()` sees the first burst; so are the known values of `stepwatch_allocator_traces_total`, `stepwatch_advisories_sent_total` and `stepwatch_journal_writes_total`",
    help: "Markers (or hellos) refused, by reason; the client got a gRPC status naming the problem.",
};

/// `stepwatch_journal_writes_total`
pub(crate) const JOURNAL_WRITES_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_journal_writes_total",
    kind: MetricKind::Counter,
    labels: "`result`",
    meaning: "journal writes, `ok` or `error`",
    help: "Journal writes, by result (ok or error); errors are logged with the reason.",
};

/// `stepwatch_allocator_traces_total`
pub(crate) const ALLOCATOR_TRACES_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_allocator_traces_total",
    kind: MetricKind::Counter,
    labels: "`result`",
    meaning: "step-1 allocator traces: `replayed` (the prediction uses it), `late` (arrived after step 2 began, ignored) or `rejected` (unusable, logged with the reason, also in `stepwatch_markers_rejected_total` under `allocator_trace_*`; the stream goes on and the prediction keeps to the markers; or sent on a stream of a run its process has left, counted there as `run_ended`, which ends the stream)",
    help: "Step-1 allocator traces received, by result: replayed (the step-2 prediction uses it), late (step 2 had begun; ignored), rejected (unusable: logged, reason in stepwatch_markers_rejected_total; the stream goes on).",
};

/// `stepwatch_record_entries_total`
pub(crate) const RECORD_ENTRIES_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_record_entries_total",
    kind: MetricKind::Counter,
    labels: "`result`",
    meaning: "`--record` entries `written` or `dropped` (after the size bound, a write error, or the writer falling 4096 entries behind)",
    help: "Entries of the --record file, by result: written, or dropped (after the size bound, a write error, or the writer falling 4096 entries behind; logged).",
};

/// `stepwatch_advisories_sent_total`
pub(crate) const ADVISORIES_SENT_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_advisories_sent_total",
    kind: MetricKind::Counter,
    labels: "`kind`",
    meaning: "advisories sent to training processes; `kind` is the proto's name: `ADVISORY_KIND_STEP2_OOM_PREDICTED`, `ADVISORY_KIND_LOW_HEADROOM`, `ADVISORY_KIND_RANK_DIVERGENCE`, `ADVISORY_KIND_ALLOCATOR_RETRIES`, `ADVISORY_KIND_LOW_OBSERVED_HEADROOM`, `ADVISORY_KIND_MEMORY_GROWTH`, `ADVISORY_KIND_CLIENT_CLOCK`, `ADVISORY_KIND_PREDICTION_FINAL`",
    help: "Advisories sent to training processes, by kind (e.g. ADVISORY_KIND_STEP2_OOM_PREDICTED).",
};

/// `stepwatch_alertmanager_alerts_active`
pub(crate) const ALERTMANAGER_ALERTS_ACTIVE: MetricDef = MetricDef {
    name: "stepwatch_alertmanager_alerts_active",
    kind: MetricKind::Gauge,
    labels: "",
    meaning: "alerts the agent holds firing at Alertmanager",
    help: "Alerts the agent holds firing at Alertmanager (resent every --alertmanager-resend-interval)",
};

/// `stepwatch_alertmanager_posts_total`
pub(crate) const ALERTMANAGER_POSTS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_alertmanager_posts_total",
    kind: MetricKind::Counter,
    labels: "`url`, `result`",
    meaning: "POSTs of alerts to each `--alertmanager-url`, `ok` or `error` (an error is retried with backoff, 0.1 s doubling to 10 s)",
    help: "POSTs of alerts to Alertmanager, by --alertmanager-url and result (ok, error); an error is retried with backoff",
};

/// `stepwatch_alertmanager_alerts_dropped_total`
pub(crate) const ALERTMANAGER_ALERTS_DROPPED_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_alertmanager_alerts_dropped_total",
    kind: MetricKind::Counter,
    labels: "`reason`",
    meaning: "alert changes not sent: `queue_full` (ingest's queue to the alert task, 1024, is full: ingest never waits) or `pending_full` (an unreachable Alertmanager's backlog holds 4096 alerts)",
    help: "Alert changes not sent to Alertmanager: queue_full (ingest's queue to the alert task), pending_full (an unreachable Alertmanager's backlog)",
};

/// `stepwatch_csi_volumes`
pub(crate) const CSI_VOLUMES: MetricDef = MetricDef {
    name: "stepwatch_csi_volumes",
    kind: MetricKind::Gauge,
    labels: "",
    meaning: "CSI ephemeral volumes published now (`--csi-socket`), each one pod's ingest socket",
    help: "CSI ephemeral volumes published now, each one pod's own ingest socket (--csi-socket).",
};

/// `stepwatch_csi_publish_refusals_total`
pub(crate) const CSI_PUBLISH_REFUSALS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_csi_publish_refusals_total",
    kind: MetricKind::Counter,
    labels: "`reason`",
    meaning: "NodePublishVolume calls refused: `invalid_argument` (not an ephemeral inline volume, no pod info), `too_many_volumes` (`--csi-max-volumes`), `conflict` (volume published at another path), `io_error`",
    help: "NodePublishVolume calls refused, by reason: invalid_argument (not an ephemeral inline volume, or no pod info), too_many_volumes (--csi-max-volumes), conflict (the volume ID is published at another path), io_error (the directory or socket could not be made).",
};

/// `stepwatch_workload_gpu_holders_refresh_errors_total`
pub(crate) const WORKLOAD_GPU_HOLDERS_REFRESH_ERRORS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_workload_gpu_holders_refresh_errors_total",
    kind: MetricKind::Counter,
    labels: "",
    meaning: "failed pod-resources `List` calls for the GPU series' pod labels (logged once); the last answer labels GPU series for up to a minute",
    help: "Failed refreshes of which pod holds which GPU (the pod-resources List; logged once); after a minute without an answer, GPU series lose their pod labels.",
};

/// `stepwatch_workload_lookup_failures_total`
pub(crate) const WORKLOAD_LOOKUP_FAILURES_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_workload_lookup_failures_total",
    kind: MetricKind::Counter,
    labels: "`reason`",
    meaning: "pod lookups that failed: `proc_unreadable`, `pod_logs_missing`, `pod_resources_error`, `pod_not_listed` (each logged once)",
    help: "Peers whose pod could not be looked up, by reason (the hello then counts as unattested; each reason is logged once).",
};

/// `stepwatch_workload_attestations_total`
pub(crate) const WORKLOAD_ATTESTATIONS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_workload_attestations_total",
    kind: MetricKind::Counter,
    labels: "`result`",
    meaning: "hellos by how their pod was found: `kubelet` (peer PID, with the pod-resources API checking its GPU), `pod_logs` (peer PID and the pod log directories; no pod-resources socket, GPU unchecked), `csi_volume` (the pod's own CSI volume socket), or why not: `off`, `no_peer_pid`, `not_in_pod`, `lookup_failed`",
    help: "Hellos by how their pod and namespace were found: kubelet (attested through the peer's PID, GPU checked with the pod-resources API), pod_logs (through the peer's PID and the pod log directories, GPU unchecked), csi_volume (the pod's own CSI volume socket), or why not (off, no_peer_pid, not_in_pod, lookup_failed).",
};

/// `stepwatch_workload_identity_mismatches_total`
pub(crate) const WORKLOAD_IDENTITY_MISMATCHES_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_workload_identity_mismatches_total",
    kind: MetricKind::Counter,
    labels: "`field`",
    meaning: "hellos whose claimed `namespace` or `pod` differs from the kubelet's (the kubelet's is used)",
    help: "Hellos whose claimed pod or namespace differs from the kubelet's, by field; the kubelet's is used.",
};

/// `stepwatch_slurm_attestations_total`
pub(crate) const SLURM_ATTESTATIONS_TOTAL: MetricDef = MetricDef {
    name: "stepwatch_slurm_attestations_total",
    kind: MetricKind::Counter,
    labels: "`result`",
    meaning: "hellos checked against Slurm (`--slurm-job-mapping-dir`): `verified` (the process runs in the job it names, or names none; the rank is attested), `refused`, or unchecked: `not_in_job`, `no_peer_pid`, `proc_unreadable` (logged once)",
    help: "Hellos checked against Slurm (--slurm-job-mapping-dir), by result: verified (the process runs in the Slurm job it names, or names none), refused (it names another job or a GPU its job does not hold), or unchecked: not_in_job, no_peer_pid, proc_unreadable.",
};

/// Every family, in the order the reference lists them.
pub(crate) const ALL: &[&MetricDef] = &[
    &BUILD_INFO,
    &NVML_UP,
    &NVML_INIT_ATTEMPTS_TOTAL,
    &NVML_ERRORS_TOTAL,
    &GPU_INFO,
    &GPU_UP,
    &GPU_SAMPLE_AGE_SECONDS,
    &GPU_MEMORY_USED_BYTES,
    &GPU_MEMORY_USED_MAX_BYTES,
    &GPU_MEMORY_TOTAL_BYTES,
    &GPU_MEMORY_FREE_BYTES,
    &GPU_SAMPLES_TOTAL,
    &GPU_PROCESSES,
    &GPU_UTILIZATION_RATIO,
    &SAMPLER_LAG_SECONDS,
    &SAMPLER_TICK_LATENESS_SECONDS,
    &SAMPLER_TICKS_TOTAL,
    &SAMPLER_LATE_TICKS_TOTAL,
    &SAMPLER_SAMPLES_DROPPED_TOTAL,
    &MARKERS_RECEIVED_TOTAL,
    &MARKERS_REJECTED_TOTAL,
    &WORKLOAD_ATTESTATIONS_TOTAL,
    &SLURM_ATTESTATIONS_TOTAL,
    &WORKLOAD_LOOKUP_FAILURES_TOTAL,
    &WORKLOAD_GPU_HOLDERS_REFRESH_ERRORS_TOTAL,
    &WORKLOAD_IDENTITY_MISMATCHES_TOTAL,
    &CSI_VOLUMES,
    &CSI_PUBLISH_REFUSALS_TOTAL,
    &INGEST_STREAMS_ACTIVE,
    &INGEST_STREAMS_OPENED_TOTAL,
    &CONNECTIONS_CLOSED_TOTAL,
    &ADVISORIES_SENT_TOTAL,
    &ALERTMANAGER_POSTS_TOTAL,
    &ALERTMANAGER_ALERTS_DROPPED_TOTAL,
    &ALERTMANAGER_ALERTS_ACTIVE,
    &RECORD_ENTRIES_TOTAL,
    &ALLOCATOR_TRACES_TOTAL,
    &JOURNAL_WRITES_TOTAL,
    &JOURNAL_RESTORED_RANKS_TOTAL,
    &RANKS_TRACKED,
    &RETAINED_BYTES,
    &LAYOUT_SNAPSHOTS_TOTAL,
    &STEPS_TRIMMED_TOTAL,
    &RANKS_EVICTED_TOTAL,
    &RANKS_EVICTED_FOR_MEMORY_TOTAL,
    &MEMORY_LIMIT_BYTES,
    &MEMORY_BUDGET_BYTES,
    &HTTP_REPORTS_REFUSED_TOTAL,
    &RANK_INFO,
    &RANK_CONNECTED,
    &RANK_STEPS_COMPLETED_TOTAL,
    &RANK_LAST_STEP,
    &RANK_STEP_DURATION_SECONDS,
    &RANK_STEP_DURATION_MEDIAN_SECONDS,
    &RANK_LAST_STEP_END_TIMESTAMP_SECONDS,
    &RANK_PHASE_DURATION_SECONDS,
    &RANK_PHASE_PEAK_BYTES,
    &RANK_FIRST_STEP_PEAK_BYTES,
    &RANK_STEADY_STEP_PEAK_BYTES,
    &RANK_FIRST_STEP_ANOMALY_RATIO,
    &RANK_STEADY_STATE_REACHED,
    &RANK_PREDICTED_PEAK_BYTES,
    &RANK_PREDICTED_HEADROOM_BYTES,
    &RANK_PREDICTION_PROVISIONAL,
    &RANK_PREDICTION_ERROR_RATIO,
    &RANK_GPU_CAPACITY_BYTES,
    &RANK_OOM_RISK,
    &RANK_PREDICTION_BASIS,
    &RANK_PREDICTION_BASIS_LIMITED,
    &RANK_PREDICTION_WARNING_UPHELD,
    &RANK_TRAILING_STEP_PEAK_MAX_BYTES,
    &RANK_TRAILING_HEADROOM_BYTES,
    &RANK_MEMORY_GROWTH_BYTES_PER_STEP,
    &RANK_MEMORY_FORECAST_OOM_SECONDS,
    &RANK_MEMORY_FORECAST_OOM_STEP,
    &RANK_TRAILING_STEP_PEAK_MIN_BYTES,
    &RANK_PASS_PEAK_BYTES,
    &RANK_PASS_HEADROOM_BYTES,
    &RANK_BATCH_LARGEST_PEAK_BYTES,
    &RANK_BATCH_OUTLOOK_PEAK_BYTES,
    &RANK_BATCH_OUTLOOK_HEADROOM_BYTES,
    &RANK_OOMS_TOTAL,
    &RANK_ALLOCATOR_RETRIES_TOTAL,
    &JOB_FIRST_STEP_PEAK_DIVERGENCE_RATIO,
    &JOB_FIRST_STEP_DURATION_DIVERGENCE_RATIO,
    &JOB_ACTIVATION_PEAK_DIVERGENCE_RATIO,
    &JOB_STEADY_PEAK_DIVERGENCE_RATIO,
    &JOB_RANK_OUTLIER,
    &RANK_FIRST_STEP_ACTIVATION_PEAK_BYTES,
];

/// The metrics reference table (Markdown) that
/// `docs/src/reference/metrics.md` holds between its generated markers.
pub fn reference_table() -> String {
    let mut out = String::from("| name | type | labels | meaning |\n| --- | --- | --- | --- |\n");
    for def in ALL {
        let kind = match def.kind {
            MetricKind::Gauge => "gauge",
            MetricKind::Counter => "counter",
            MetricKind::Histogram => "histogram",
        };
        out.push_str(&format!(
            "| `{}` | {kind} | {} | {} |\n",
            def.name, def.labels, def.meaning
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const BEGIN: &str = "<!-- BEGIN GENERATED: metrics -->\n";
    const END: &str = "<!-- END GENERATED: metrics -->";

    #[test]
    fn the_metrics_reference_is_generated_from_the_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../docs/src/reference/metrics.md");
        let page = std::fs::read_to_string(&path).expect("the metrics reference page");
        let (Some(a), Some(b)) = (page.find(BEGIN), page.find(END)) else {
            panic!("{} lacks the generated markers", path.display());
        };
        let current = &page[a + BEGIN.len()..b];
        let generated = reference_table();
        if current == generated {
            return;
        }
        if std::env::var_os("STEPWATCH_UPDATE_DOCS").is_some() {
            let page = format!("{}{generated}{}", &page[..a + BEGIN.len()], &page[b..]);
            std::fs::write(&path, page).expect("rewrite the metrics reference");
            return;
        }
        panic!(
            "{} is stale: rerun with STEPWATCH_UPDATE_DOCS=1 \
             (cargo test -p stepwatch-agent metrics_reference)",
            path.display()
        );
    }

    #[test]
    fn every_family_is_declared_once_with_a_meaning() {
        let mut names = BTreeSet::new();
        for def in ALL {
            assert!(def.name.starts_with("stepwatch_"), "{}", def.name);
            assert!(names.insert(def.name), "{} declared twice", def.name);
            assert!(
                !def.meaning.is_empty() && !def.help.is_empty(),
                "{}",
                def.name
            );
            assert_eq!(
                def.name.ends_with("_total"),
                def.kind == MetricKind::Counter,
                "{}: counters, and only counters, end in _total",
                def.name
            );
        }
    }

    #[test]
    fn the_registrys_families_are_declared() {
        let state = crate::state::test_state();
        let declared: BTreeSet<&str> = ALL.iter().map(|d| d.name).collect();
        for family in state.registry.gather() {
            assert!(
                declared.contains(family.name()),
                "{} is registered but not in metrics::ALL",
                family.name()
            );
        }
    }
}
