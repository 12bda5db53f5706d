//! Command-line flags of `stepwatch agent`, each with a `STEPWATCH_*`
//! environment equivalent.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Default path of the marker socket; training pods mount its directory.
pub const DEFAULT_SOCKET: &str = "/run/stepwatch/stepwatch.sock";

/// How the agent runs.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct AgentConfig {
    /// Unix socket for marker ingest (gRPC). Its directory is created if missing.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_SOCKET", default_value = DEFAULT_SOCKET))]
    pub socket: PathBuf,

    /// How long to wait for the agent that holds the socket's lock
    /// (`<socket>.lock`: one agent per socket path) to exit, as during a
    /// restart, before refusing to start. `0s`: refuse at once.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_LOCK_WAIT", default_value = "10s", value_parser = parse_wait))]
    pub lock_wait: Duration,

    /// File mode of the marker socket, octal. Only processes that can write
    /// the socket can send markers; use 0666 when training runs as other users.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_SOCKET_MODE", default_value = "0660", value_parser = parse_mode))]
    pub socket_mode: u32,

    /// Also accept marker ingest over TCP at this address (off unless given).
    /// Use TLS (--grpc-tls-cert/--grpc-tls-key) unless the interface is private.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_GRPC_LISTEN"))]
    pub grpc_listen: Option<SocketAddr>,

    /// PEM certificate (chain) for TLS on the TCP ingest.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_GRPC_TLS_CERT", requires = "grpc_tls_key")
    )]
    pub grpc_tls_cert: Option<PathBuf>,

    /// PEM private key for TLS on the TCP ingest.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_GRPC_TLS_KEY", requires = "grpc_tls_cert")
    )]
    pub grpc_tls_key: Option<PathBuf>,

    /// PEM CA bundle: when given, TCP clients must present a certificate it signed (mutual TLS).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_GRPC_TLS_CLIENT_CA", requires = "grpc_tls_cert")
    )]
    pub grpc_tls_client_ca: Option<PathBuf>,

    /// Address of the HTTP server: /metrics, /healthz, /readyz, /api/v1.
    /// Port 19447: outside Prometheus's exporter range 9100-9999, which is
    /// fully allocated (9447 belongs to another exporter), and away from
    /// dcgm-exporter's 9400 on the same GPU nodes.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_HTTP_LISTEN", default_value = "0.0.0.0:19447")
    )]
    pub http_listen: SocketAddr,

    /// Serve the JSON API (`/api/v1`, which names tenants' jobs and pods) on
    /// this address instead, apart from `/metrics` and the probes, so that it
    /// can be exposed or firewalled on its own. Unset: on --http-listen.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_API_LISTEN"))]
    pub api_listen: Option<std::net::SocketAddr>,

    /// Also serve `/healthz` and `/readyz` on this address, on a listener of
    /// their own with its own connections, so that the liveness and
    /// readiness probes answer even while clients hold every connection of
    /// --http-listen. Unset: the probes are on --http-listen only.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_PROBE_LISTEN"))]
    pub probe_listen: Option<std::net::SocketAddr>,

    /// Node name put on every series as the `node` label (defaults to the hostname).
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_NODE_NAME"))]
    pub node_name: Option<String>,

    /// Path of libnvidia-ml to load (default: libnvidia-ml.so.1 from the loader path).
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_NVML_LIB"))]
    pub nvml_lib: Option<PathBuf>,

    /// Device-memory sampling rate per GPU, in Hz.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_SAMPLE_HZ", default_value_t = 100.0, value_parser = parse_hz))]
    pub sample_hz: f64,

    /// Period of process-list and utilisation reads. Process lists take the
    /// driver's global lock, so keep this slow.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_PROCESS_INTERVAL", default_value = "1s", value_parser = parse_duration))]
    pub process_interval: Duration,

    /// Trailing window of stepwatch_gpu_memory_used_max_bytes; set it to the scrape interval.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_MAX_WINDOW", default_value = "15s", value_parser = parse_duration))]
    pub max_window: Duration,

    /// How long a finished rank's figures stay exported after its last stream closed.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_RETENTION", default_value = "1h", value_parser = parse_duration))]
    pub retention: Duration,

    /// Steps kept per rank (step 1 is always kept as well).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_MAX_STEPS", default_value_t = 1000)
    )]
    pub max_steps: usize,

    /// The memory the agent may use, MiB: every budget below is drawn from
    /// it (step history an eighth, allocator traces in flight a sixteenth,
    /// rank reports in flight a twelfth; the rest is the agent's base).
    /// Default: the container's limit (cgroup v2 `memory.max` of the
    /// agent's cgroup or an ancestor), else 192 (the chart's limit).
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_MEMORY_LIMIT_MIB"))]
    pub memory_limit_mib: Option<u64>,

    /// Memory budget of the ranks' retained step history, MiB (default: an
    /// eighth of the memory limit, 24 at 192). Past it, finished ranks give
    /// way first (stepwatch_ranks_evicted_for_memory_total), then the
    /// namespace holding the most gives up its oldest steps (never step 1 or
    /// the current step; stepwatch_steps_trimmed_total); when nothing is
    /// left to give, markers that add phases are refused (memory_budget)
    /// for ranks whose namespace holds its share of the budget.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_MEMORY_BUDGET_MIB"))]
    pub memory_budget_mib: Option<u64>,

    /// Ranks tracked at once. When full, the rank that finished longest ago
    /// gives way; a hello gets RESOURCE_EXHAUSTED only when every rank is
    /// connected.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_MAX_RANKS", default_value_t = 256)
    )]
    pub max_ranks: usize,

    /// Concurrent ingest streams that said Hello; further hellos get
    /// RESOURCE_EXHAUSTED.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_MAX_STREAMS", default_value_t = 512)
    )]
    pub max_streams: usize,

    /// Streams that said Hello one peer holds at once (on the Unix socket
    /// its pod, from the cgroup of its PID, else its uid; on TCP its
    /// address); further hellos get RESOURCE_EXHAUSTED (`peer_stream_limit`).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_MAX_STREAMS_PER_PEER", default_value_t = 256)
    )]
    pub max_streams_per_peer: usize,

    /// Streams that said Hello one process holds at once (its PID from
    /// SO_PEERCRED, on the Unix socket); further hellos get
    /// RESOURCE_EXHAUSTED (`process_stream_limit`). A process needs one per
    /// rank it runs.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_MAX_STREAMS_PER_PROCESS", default_value_t = 64)
    )]
    pub max_streams_per_process: usize,

    /// Connections each ingest listener (the Unix socket, the TCP port)
    /// holds at once; further ones wait until one closes. Keeps the agent
    /// below its file-descriptor limit whatever clients do.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_MAX_CONNECTIONS", default_value_t = 256)
    )]
    pub max_connections: usize,

    /// Connections the HTTP listener (/metrics, /healthz, the API) holds at
    /// once; further ones wait until one closes.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_MAX_HTTP_CONNECTIONS", default_value_t = 64)
    )]
    pub max_http_connections: usize,

    /// Connections one HTTP client address holds at once; its further ones
    /// are closed at accept (counted as `peer_limit`), so that no one client
    /// takes every slot from the probes and Prometheus.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "STEPWATCH_MAX_HTTP_CONNECTIONS_PER_PEER",
            default_value_t = 16
        )
    )]
    pub max_http_connections_per_peer: usize,

    /// How long an HTTP request's headers may take to arrive; also how long
    /// a keep-alive connection may wait for its next request.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_HTTP_HEADER_TIMEOUT", default_value = "5s", value_parser = parse_duration))]
    pub http_header_timeout: Duration,

    /// Ingest connections one peer holds at once on a listener (on the Unix
    /// socket its pod, from the cgroup of its PID, else its uid; on TCP its
    /// address); further ones are closed at accept (`peer_limit`).
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "STEPWATCH_MAX_CONNECTIONS_PER_PEER",
            default_value_t = 128
        )
    )]
    pub max_connections_per_peer: usize,

    /// Ingest connections one process holds at once on the Unix socket
    /// (its PID from SO_PEERCRED); further ones are closed at accept
    /// (`process_limit`). A client needs one.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "STEPWATCH_MAX_CONNECTIONS_PER_PROCESS",
            default_value_t = 16
        )
    )]
    pub max_connections_per_process: usize,

    /// An ingest connection that holds no open stream for this long is
    /// closed (`no_stream`): connections that never open one cannot hold
    /// the listener's slots. A client reconnects when it next streams.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_CONNECTION_GRACE", default_value = "10s", value_parser = parse_duration))]
    pub connection_grace: Duration,

    /// A connection (HTTP or ingest) that neither sends nor receives a byte
    /// for this long is closed. Live ingest connections never idle this long:
    /// the agent pings them every 30 s (HTTP/2 keepalive).
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_IDLE_TIMEOUT", default_value = "2m", value_parser = parse_duration))]
    pub idle_timeout: Duration,

    /// Streams one connection may hold open at once (HTTP/2
    /// max_concurrent_streams); a client process needs one per rank it runs.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "STEPWATCH_MAX_STREAMS_PER_CONNECTION",
            default_value_t = 64
        )
    )]
    pub max_streams_per_connection: usize,

    /// How long a rank whose stream broke (rather than ended) stays its
    /// process's: another process's hello for it is refused (`rank_held`)
    /// while its own reconnects, so that no one takes it, and resets its
    /// history, meanwhile. A stream the client closed holds nothing.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_RECONNECT_WINDOW", default_value = "30s", value_parser = parse_duration))]
    pub reconnect_window: Duration,

    /// How long a new stream may take to send its Hello before it is ended
    /// with DEADLINE_EXCEEDED (counted as `hello_timeout`). A stream takes
    /// one of --max-streams only once its Hello arrives.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_HELLO_TIMEOUT", default_value = "10s", value_parser = parse_duration))]
    pub hello_timeout: Duration,

    /// Bytes that allocator traces still being sent may hold, all streams
    /// together, MiB (default: a sixteenth of the memory limit, at least the
    /// largest trace the contract allows, 26);
    /// a trace that would go past it is dropped (counted as
    /// allocator_trace_over_budget) and that rank's prediction keeps to its
    /// markers.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_MAX_PARTIAL_TRACE_MIB"))]
    pub max_partial_trace_mib: Option<u64>,

    /// How long an allocator trace may take from its first chunk to its
    /// last; past it the partial trace is dropped (allocator_trace_timeout).
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_PARTIAL_TRACE_TIMEOUT", default_value = "60s", value_parser = parse_duration))]
    pub partial_trace_timeout: Duration,

    /// Markers per second one stream may send (burst: one second's worth);
    /// beyond it the stream gets RESOURCE_EXHAUSTED.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_MAX_MARKER_RATE", default_value_t = 200_000.0)
    )]
    pub max_marker_rate: f64,

    /// Journal file: ranks' step history is written here periodically and at
    /// shutdown, and restored at start, so an agent restart loses no history.
    /// Off unless given.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_JOURNAL"))]
    pub journal: Option<PathBuf>,

    /// How often the journal is written.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_JOURNAL_INTERVAL", default_value = "30s", value_parser = parse_duration))]
    pub journal_interval: Duration,

    /// Steps per rank kept in the journal besides step 1 (bounds its size).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_JOURNAL_STEPS", default_value_t = 100)
    )]
    pub journal_steps: usize,

    /// Record every input of the step model (hellos, marker batches,
    /// allocator traces, GPU samples, process lists) to this file as JSON
    /// lines, for `stepwatch replay-record` and the predictor's fixtures.
    /// Off unless given; the file is truncated at start. A record covers what
    /// this agent saw since it started (ranks restored from the journal are
    /// not in it).
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_RECORD"))]
    pub record: Option<PathBuf>,

    /// Size bound of the record, bytes (about 84 bytes per GPU sample: 8 GPUs
    /// at 100 Hz write about 240 MB an hour); recording stops there.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_RECORD_MAX_BYTES", default_value_t = 1 << 30))]
    pub record_max_bytes: u64,

    /// Once every listener is bound, write a JSON object with their
    /// addresses here (`{"http": "127.0.0.1:9464", "grpc": null, "socket": …}`),
    /// so a supervisor or a test can start the agent on port 0 and learn the
    /// port without racing for a free one. Written atomically.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_READY_FILE"))]
    pub ready_file: Option<PathBuf>,

    /// The host's /proc, where a client's cgroup is read from its peer PID
    /// (the agent runs with hostPID); like node_exporter's --path.procfs.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_PROC_ROOT", default_value = "/proc")
    )]
    pub proc_root: PathBuf,

    /// Slurm: the GPU↔job mapping directory a Slurm prolog keeps
    /// (dcgm-exporter's --hpc-job-mapping-dir; deploy/slurm/). When given, a
    /// client's Slurm job claim is checked against its cgroup and this
    /// directory, and GPU series get an `hpc_job` label. Off unless given.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_SLURM_JOB_MAPPING_DIR"))]
    pub slurm_job_mapping_dir: Option<PathBuf>,

    /// The kubelet's pod-resources API (v1 PodResourcesLister), which says
    /// which pod holds which GPU (root's socket). Without it pods are still
    /// found through --pod-logs-dir, their GPUs unchecked; without both
    /// (outside Kubernetes) clients' pods and namespaces are taken as they
    /// claim them, logged once.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            env = "STEPWATCH_POD_RESOURCES_SOCKET",
            default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
        )
    )]
    pub pod_resources_socket: PathBuf,

    /// The kubelet's pod log directories (`<namespace>_<pod>_<uid>`): the
    /// node's map from a pod UID (in a client's cgroup) to its name.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_POD_LOGS_DIR", default_value = "/var/log/pods")
    )]
    pub pod_logs_dir: PathBuf,

    /// Deadline of one call to the pod-resources API.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_POD_RESOURCES_TIMEOUT", default_value = "2s", value_parser = parse_duration))]
    pub pod_resources_timeout: Duration,

    /// Serve the CSI Identity and Node services on this Unix socket (off
    /// unless given), so pods that may not mount hostPath (Pod Security
    /// baseline/restricted) get their own ingest socket through a CSI
    /// ephemeral inline volume, bound to the pod the kubelet names. Published
    /// volumes are recorded in `volumes.jsonl` beside it and reopened at start.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_CSI_SOCKET"))]
    pub csi_socket: Option<PathBuf>,

    /// The CSI driver's name: the CSIDriver object's and the pods' `csi.driver`.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_CSI_DRIVER_NAME", default_value = "csi.stepwatch.dev", value_parser = parse_driver_name))]
    pub csi_driver_name: String,

    /// CSI volumes published at once (one per pod using it); more are
    /// refused with RESOURCE_EXHAUSTED, counted, and retried by the kubelet.
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "STEPWATCH_CSI_MAX_VOLUMES", default_value_t = 128)
    )]
    pub csi_max_volumes: usize,

    /// How often the kubelet is asked which pod holds which GPU, for the
    /// `namespace`, `pod` and `container` labels of GPU series; one `List`
    /// call each time (a hello's lookup also refreshes it).
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_POD_RESOURCES_REFRESH", default_value = "15s", value_parser = parse_duration))]
    pub pod_resources_refresh: Duration,

    /// Alertmanager to post the step-2 OOM, low-headroom and divergence
    /// alerts to within a second of the prediction (`http://host:port`,
    /// v2 API), under the rules' alert names and labels so that Alertmanager
    /// merges them with the rules' alerts. Repeat it for each replica of an
    /// HA Alertmanager (each gets every alert). Off unless given.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "alertmanager-url",
            env = "STEPWATCH_ALERTMANAGER_URL",
            value_delimiter = ','
        )
    )]
    pub alertmanager_urls: Vec<String>,

    /// A label `NAME=VALUE` put on every alert the agent posts: Prometheus's
    /// external labels (e.g. `cluster=prod-eu`), which the rules' alerts
    /// carry too. Repeatable.
    #[cfg_attr(feature = "cli", arg(long = "alertmanager-label", env = "STEPWATCH_ALERTMANAGER_LABELS", value_delimiter = ',', value_parser = parse_label))]
    pub alertmanager_labels: Vec<(String, String)>,

    /// Where the agent's alerts' `runbook_url` annotations point: `<this>/<alert>.md`
    /// (the chart passes its prometheusRule.runbookBaseURL). Empty (the
    /// default): no link; a `runbook` annotation names the page that ships
    /// with the chart and the package.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_ALERTMANAGER_RUNBOOK_BASE_URL", default_value = crate::alerts::DEFAULT_RUNBOOK_BASE_URL))]
    pub alertmanager_runbook_base_url: String,

    /// Active alerts are posted again this often; each says it ends 4 of
    /// these later, so Alertmanager resolves them if the agent dies.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_ALERTMANAGER_RESEND_INTERVAL", default_value = "1m", value_parser = parse_duration))]
    pub alertmanager_resend_interval: Duration,

    /// Which per-phase rank series `/metrics` carries
    /// (`stepwatch_rank_phase_peak_bytes` and
    /// `stepwatch_rank_phase_duration_seconds`: 23 of a rank's 56 series;
    /// BENCHMARKS.md).
    /// `all`: both, for step 1 and the steady state. `first-step`: step 1's
    /// phase peaks only (the first-step anomaly dashboard's panel), no steady
    /// phase peaks and no phase durations. `none`: neither; the step-anatomy
    /// dashboard's phase panels go empty. The JSON API keeps every figure.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_RANK_PHASE_SERIES", value_enum, default_value_t = RankPhaseSeries::All))]
    pub rank_phase_series: RankPhaseSeries,

    /// Log format.
    #[cfg_attr(feature = "cli", arg(long, env = "STEPWATCH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text))]
    pub log_format: LogFormat,
}

/// See [`AgentConfig::rank_phase_series`]: a cheaper export for large clusters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum RankPhaseSeries {
    /// Phase peaks of step 1 and the steady state, and phase durations.
    #[default]
    All,
    /// Step 1's phase peaks only.
    FirstStep,
    /// No per-phase series.
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum LogFormat {
    Text,
    Json,
}

#[cfg(feature = "cli")]
fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal file mode like 0660"))
}

/// A CSI driver name: at most 63 characters, alphanumerics at both ends,
/// dashes, dots and alphanumerics between (the CSI spec's GetPluginInfo).
#[cfg(feature = "cli")]
fn parse_driver_name(s: &str) -> Result<String, String> {
    let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let ok = s.len() <= 63
        && ends(s.chars().next())
        && ends(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a CSI driver name (63 characters at most, like csi.example.com)"
        ))
    }
}

/// `NAME=VALUE`, NAME a Prometheus label name.
#[cfg(feature = "cli")]
fn parse_label(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))?;
    let valid = name
        .chars()
        .enumerate()
        .all(|(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()));
    if name.is_empty() || !valid || name.starts_with("__") {
        return Err(format!("{name:?} is not a label name"));
    }
    if ["alertname", "severity"].contains(&name) {
        return Err(format!("{name:?} is set by the rule; choose another label"));
    }
    Ok((name.to_owned(), value.to_owned()))
}

#[cfg(feature = "cli")]
fn parse_hz(s: &str) -> Result<f64, String> {
    let hz: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !(0.1..=10_000.0).contains(&hz) {
        return Err(format!("{hz} Hz is outside 0.1..=10000"));
    }
    Ok(hz)
}

/// Parses a flag's duration with humantime ("250ms", "15s", "5m", "1h 30m"):
/// a unit is required, zero is refused.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 250ms, 15s, 5m, 1h or 1h 30m ({e})"))?;
    if d.is_zero() {
        return Err(format!("{s:?} must be positive"));
    }
    Ok(d)
}

/// A wait: like [`parse_duration`], and zero (do not wait) is allowed.
#[cfg(feature = "cli")]
fn parse_wait(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 0s, 250ms or 10s ({e})"))
}

#[cfg(all(test, feature = "cli"))]
mod tests {
    use super::*;

    #[test]
    fn durations_and_modes_parse_or_explain() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("5 parsecs")
            .unwrap_err()
            .contains("not a duration like"));
        assert!(parse_duration("0s").is_err());
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2min"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("15").unwrap_err().contains("15s"));
        assert_eq!(parse_mode("0660"), Ok(0o660));
        assert!(parse_mode("999").is_err());
        assert!(parse_hz("0").is_err());
        assert_eq!(
            parse_driver_name("csi.stepwatch.dev").as_deref(),
            Ok("csi.stepwatch.dev")
        );
        assert!(parse_driver_name("-csi.example").is_err());
        assert!(parse_driver_name("csi_example").is_err());
        assert!(parse_driver_name(&"a".repeat(64)).is_err());
        assert_eq!(
            parse_label("cluster=prod-eu"),
            Ok(("cluster".into(), "prod-eu".into()))
        );
        assert!(parse_label("cluster").is_err());
        assert!(parse_label("1x=y").is_err());
        assert!(parse_label("severity=info").is_err());
    }

    /// The default port is one no registered exporter uses (Prometheus's
    /// "Default port allocations" list) and no GPU-node neighbour binds: not
    /// the fully allocated exporter range 9090-9999 (dcgm-exporter is 9400),
    /// not a port the list registers outside it, not the kubelet's 10248-10259,
    /// the NodePort range or the ephemeral range. The chart's `port` follows it.
    #[test]
    fn the_default_http_port_is_no_registered_exporters() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            agent: AgentConfig,
        }
        let cli = <Cli as clap::Parser>::try_parse_from(["stepwatch"]).unwrap();
        let port = cli.agent.http_listen.port();
        assert_eq!(port, 19447);
        // Registered outside the standard range on the list.
        const REGISTERED_OUTSIDE: [u16; 20] = [
            3903, 7300, 8080, 8082, 8088, 8089, 8292, 8404, 9042, 9087, 9095, 9097, 9099, 16995,
            19091, 19999, 24231, 42004, 44322, 61091,
        ];
        assert!(
            !(9090..=9999).contains(&port),
            "{port} is in the allocated exporter range"
        );
        assert!(
            !REGISTERED_OUTSIDE.contains(&port),
            "{port} is registered to an exporter"
        );
        assert!(!(10248..=10259).contains(&port), "{port} is the kubelet's");
        assert!(port < 30000, "{port} is in the NodePort or ephemeral range");
    }
}
