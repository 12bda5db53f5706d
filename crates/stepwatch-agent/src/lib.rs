//! The stepwatch per-node agent.
//!
//! Wiring only: the NVML sampler (stepwatch-gpu) and the step model
//! (stepwatch-core) do the work; this crate puts a gRPC ingest server on a
//! Unix socket (and optionally TCP), an HTTP server for `/metrics`, health
//! and the JSON API, and a task that moves GPU samples into the step model.

// The optional components (cargo features, all default): a build without
// one has a stand-in that does nothing, and refuses the flags that ask for it
// (`refuse_unbuilt_components`).
#[cfg(feature = "alerts")]
mod alerts;
#[cfg(not(feature = "alerts"))]
#[path = "alerts/off.rs"]
mod alerts;
pub mod config;
#[cfg(feature = "csi")]
mod csi;
mod export;
mod http;
mod ingest;
mod lifecycle;
mod listen;
mod memory;
mod metrics;
mod record;
mod slurm;
mod state;
mod ui;
mod workload;

pub use metrics::reference_table as metrics_reference;
pub use state::REJECT_REASONS;

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use stepwatch_core::{Tracker, TrackerConfig};
use stepwatch_gpu::{SamplerConfig, SamplerHandle};
use stepwatch_proto::clock::monotonic_ns;
use stepwatch_proto::v1::ingest_server::IngestServer;
use stepwatch_proto::MAX_MESSAGE_BYTES;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;

pub use config::{AgentConfig, LogFormat, DEFAULT_SOCKET};

/// Sets up logging on stderr; `RUST_LOG` overrides the default `info` level.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(config: AgentConfig) -> anyhow::Result<()> {
    // The handlers are installed before anything binds: a SIGTERM that comes
    // right after the ready file must end the agent cleanly (journal
    // written, socket unlinked), not by the signal's default action.
    let shutdown = shutdown_signal()?;
    run_until(config, shutdown).await
}

/// Runs the agent until `shutdown` completes.
pub async fn run_until(
    config: AgentConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    refuse_unbuilt_components(&config)?;
    // First of all: a restarted agent waits here for the old one to exit,
    // so it reads the old one's last journal and the old one's exit cannot
    // unlink the new socket.
    let lock = acquire_socket_lock(&config).await?;
    // SIGHUP's default action ends the process with no final journal; a
    // terminal closing or a supervisor's reload must not do that.
    let hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("cannot handle SIGHUP")?;
    let budget = memory_budget(&config);
    let node = config.node_name.clone().unwrap_or_else(hostname);
    let sampler = start_sampler(&config);
    let state = agent_state(&config, &budget, sampler.clone(), &node)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    raise_fd_limit();
    // HTTP first, so /healthz answers while everything else starts.
    let http = serve_http(&config, &state, &stop_rx)?;
    let components = Components::start(&config, &state, &node, &stop_rx)?;
    let ingest = serve_ingest(&config, &state, &budget, &components, &node, &stop_rx).await?;
    state.ingest_listening.store(true, Ordering::Relaxed);
    write_ready_file(&config, &http, &ingest)?;
    tracing::info!(
        node = %node,
        http = %http.addr,
        socket = %config.socket.display(),
        sample_hz = config.sample_hz,
        "stepwatch agent running; metrics at http://{}/metrics", http.addr
    );
    let housekeeping = spawn_housekeeping(&config, &state, hangup, stop_rx);

    shutdown.await;
    let running = Running {
        http,
        ingest,
        components,
        housekeeping,
    };
    shut_down(&config, &state, &sampler, stop_tx, running).await;
    tracing::debug!(lock = %lock.path().display(), "releasing the socket's lock");
    drop(lock);
    tracing::info!("stopped");
    Ok(())
}

/// Refuses to start when the flags ask for an optional component this build
/// was compiled without (`alerts`, `csi`, `workload` cargo features): the
/// flags stay in every build, so a missing component is a clear error at
/// start, never a flag that silently does nothing.
fn refuse_unbuilt_components(config: &AgentConfig) -> anyhow::Result<()> {
    match unbuilt_components(config).as_slice() {
        [] => Ok(()),
        missing => anyhow::bail!("{}", missing.join("; ")),
    }
}

/// One sentence per component the flags ask for and this build lacks.
fn unbuilt_components(config: &AgentConfig) -> Vec<String> {
    let mut missing = Vec::new();
    if !cfg!(feature = "alerts") && !config.alertmanager_urls.is_empty() {
        missing.push(
            "--alertmanager-url is given, but this build has no Alertmanager support; \
             rebuild with --features alerts"
                .to_owned(),
        );
    }
    if !cfg!(feature = "csi") && config.csi_socket.is_some() {
        missing.push(
            "--csi-socket is given, but this build has no CSI support; rebuild with --features csi"
                .to_owned(),
        );
    }
    // Attestation has no on/off flag: it is on wherever the kubelet's
    // sources exist. A build without it would take tenants' pods as they
    // claim them there, so it does not start.
    if !cfg!(feature = "workload") {
        let sources = [&config.pod_logs_dir, &config.pod_resources_socket];
        if let Some(found) = sources.into_iter().find(|p| p.exists()) {
            missing.push(format!(
                "{} exists (a Kubernetes node), but this build has no workload attestation, \
                 so clients' pods would be taken as they claim; rebuild with --features workload, \
                 or point --pod-logs-dir and --pod-resources-socket at paths that do not exist \
                 to run without attestation",
                found.display()
            ));
        }
    }
    missing
}

/// Takes the socket's lock (`--lock-wait`), off the runtime: it may wait.
async fn acquire_socket_lock(config: &AgentConfig) -> anyhow::Result<lifecycle::SocketLock> {
    let (socket, wait) = (config.socket.clone(), config.lock_wait);
    tokio::task::spawn_blocking(move || lifecycle::SocketLock::acquire(&socket, wait)).await?
}

/// The memory budget from `--memory-limit-mib` (or the cgroup's limit) and
/// the flags that carve it; logged.
fn memory_budget(config: &AgentConfig) -> memory::MemoryBudget {
    let mib = |m: u64| m.saturating_mul(1 << 20);
    let (limit, source) = memory::MemoryBudget::limit(config.memory_limit_mib.map(mib));
    let budget = memory::MemoryBudget::split(
        limit,
        source,
        config.memory_budget_mib.map(mib),
        config.max_partial_trace_mib.map(mib),
    );
    tracing::info!(
        limit_bytes = budget.limit_bytes,
        from = ?budget.source,
        history_bytes = budget.history_bytes,
        traces_bytes = budget.traces_bytes,
        reports_bytes = budget.reports_bytes,
        connections_bytes = budget.connections_bytes,
        "memory budget"
    );
    budget
}

/// The NVML sampler, on its own thread.
fn start_sampler(config: &AgentConfig) -> SamplerHandle {
    let memory_interval = Duration::from_secs_f64(1.0 / config.sample_hz);
    SamplerHandle::start(SamplerConfig {
        lib_path: config.nvml_lib.clone(),
        memory_interval,
        process_interval: config.process_interval,
        max_window: config.max_window,
        stale_after: SamplerConfig::stale_after_for(memory_interval),
        ..SamplerConfig::default()
    })
}

/// The step model and what feeds it besides ingest: Slurm's job checks,
/// the record, and the journal's history restored.
fn agent_state(
    config: &AgentConfig,
    budget: &memory::MemoryBudget,
    sampler: SamplerHandle,
    node: &str,
) -> anyhow::Result<Arc<state::AgentState>> {
    let tracker = Tracker::new(TrackerConfig {
        max_ranks: config.max_ranks,
        max_retained_steps: config.max_steps,
        memory_budget_bytes: budget.history_bytes,
        check_client_clock: true,
        reconnect_window_ns: config.reconnect_window.as_nanos() as u64,
        ..TrackerConfig::default()
    });
    let gpu_holders = workload::GpuHolders::new(config.pod_resources_refresh);
    let state = state::AgentState::new(tracker, sampler, node.to_owned(), gpu_holders)?;
    state.set_memory_budget(budget)?;
    state.set_rank_phase_series(config.rank_phase_series);
    if let Some(dir) = &config.slurm_job_mapping_dir {
        let slurm = slurm::Slurm::new(dir.clone(), config.proc_root.clone(), &state.registry)?;
        let _ = state.slurm.set(slurm);
    }
    if let Some(path) = &config.record {
        state.start_record(path, config.record_max_bytes)?;
        tracing::info!(path = %path.display(), max_bytes = config.record_max_bytes, "recording every tracker input");
    }
    if let Some(path) = &config.journal {
        create_parent_dir(path, "journal")?;
        state.restore_journal(path);
    }
    Ok(state)
}

/// Raises the open-file limit to its hard limit; a failure is logged.
fn raise_fd_limit() {
    match listen::raise_fd_limit() {
        Ok((old, new)) if new > old => {
            tracing::info!(from = old, to = new, "raised the open-file limit")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.changed().await;
}

/// An HTTP listener's task: its server runs on a thread of its own.
type HttpTask = tokio::sync::oneshot::Receiver<std::io::Result<()>>;

/// The exporter's listeners: HTTP, and the API and probes where they have
/// their own.
struct HttpListeners {
    addr: std::net::SocketAddr,
    api_addr: Option<std::net::SocketAddr>,
    probe_addr: Option<std::net::SocketAddr>,
    tasks: Vec<HttpTask>,
}

/// Binds and serves `--http-listen`, `--api-listen` and `--probe-listen`.
fn serve_http(
    config: &AgentConfig,
    state: &Arc<state::AgentState>,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<HttpListeners> {
    let limits = http::HttpLimits {
        max_connections: config.max_http_connections,
        max_connections_per_peer: config.max_http_connections_per_peer,
        header_timeout: config.http_header_timeout,
        idle_timeout: Some(config.idle_timeout),
    };
    let serve = |addr: std::net::SocketAddr, routes: http::Routes, what: &str| {
        let listener = std::net::TcpListener::bind(addr)
            .with_context(|| format!("cannot listen for {what} on {addr}"))?;
        let bound = listener.local_addr()?;
        let task = http::serve_on_own_thread(
            listener,
            routes,
            state.clone(),
            limits,
            stopped(stop.clone()),
        )?;
        anyhow::Ok((bound, task))
    };
    let main_routes = if config.api_listen.is_some() {
        http::Routes::Monitoring
    } else {
        http::Routes::All
    };
    let (addr, task) = serve(config.http_listen, main_routes, "HTTP")?;
    let mut tasks = vec![task];
    let mut serve_apart = |addr: Option<std::net::SocketAddr>, routes, what| {
        addr.map(|addr| {
            let (bound, task) = serve(addr, routes, what)?;
            tasks.push(task);
            anyhow::Ok(bound)
        })
        .transpose()
    };
    let api_addr = serve_apart(config.api_listen, http::Routes::Api, "the API")?;
    let probe_addr = serve_apart(config.probe_listen, http::Routes::Probes, "the probes")?;
    Ok(HttpListeners {
        addr,
        api_addr,
        probe_addr,
        tasks,
    })
}

/// The optional components ingest hands hellos and advisories to: pod
/// attestation (with its GPU holders' refresh) and the Alertmanager sender.
struct Components {
    workload: Arc<workload::WorkloadResolver>,
    holders_task: Option<tokio::task::JoinHandle<()>>,
    alerter: alerts::Alerter,
}

impl Components {
    #[cfg_attr(not(feature = "alerts"), allow(unused_variables))]
    fn start(
        config: &AgentConfig,
        state: &Arc<state::AgentState>,
        node: &str,
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<Self> {
        let workload = Arc::new(workload::WorkloadResolver::new(
            workload::WorkloadConfig {
                proc_root: config.proc_root.clone(),
                pod_resources_socket: config.pod_resources_socket.clone(),
                pod_logs_dir: config.pod_logs_dir.clone(),
                timeout: config.pod_resources_timeout,
                cache_ttl: Duration::from_secs(5),
                holders_refresh: config.pod_resources_refresh,
            },
            &state.registry,
            state.gpu_holders.clone(),
        )?);
        let holders_task = spawn_holders_refresh(&workload, config.pod_resources_refresh, stop);
        #[cfg(feature = "alerts")]
        let alerter = start_alerter(config, state, node, stop)?;
        // No alert task in this build (`--alertmanager-url` was refused).
        #[cfg(not(feature = "alerts"))]
        let alerter = alerts::Alerter::disabled();
        Ok(Self {
            workload,
            holders_task,
            alerter,
        })
    }
}

/// The alert task when `--alertmanager-url` is given.
#[cfg(feature = "alerts")]
fn start_alerter(
    config: &AgentConfig,
    state: &state::AgentState,
    node: &str,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<alerts::Alerter> {
    let alerter = alerts::Alerter::start(
        alerts::AlertmanagerConfig {
            urls: config.alertmanager_urls.clone(),
            extra_labels: config.alertmanager_labels.clone(),
            resend_interval: config.alertmanager_resend_interval,
            runbook_base_url: config.alertmanager_runbook_base_url.clone(),
            node: node.to_owned(),
        },
        &state.registry,
        stop.clone(),
    )?;
    if !config.alertmanager_urls.is_empty() {
        tracing::info!(urls = ?config.alertmanager_urls, "posting step-2 OOM, low-headroom and divergence alerts to Alertmanager");
    }
    Ok(alerter)
}

/// Which pod holds which GPU, for the GPU series' pod labels: one List
/// call per --pod-resources-refresh, bounded by its timeout. None without
/// the pod-resources API.
fn spawn_holders_refresh(
    workload: &Arc<workload::WorkloadResolver>,
    period: Duration,
    stop: &watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    workload.pod_resources().then(|| {
        let workload = workload.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => workload.refresh_holders().await,
                    _ = stop.changed() => break,
                }
            }
        })
    })
}

/// A gRPC listener's task.
type GrpcTask = tokio::task::JoinHandle<Result<(), tonic::transport::Error>>;

/// The ingest listeners: the Unix socket, TCP, and the CSI plugin's socket.
struct IngestListeners {
    grpc_addr: Option<std::net::SocketAddr>,
    /// In the order they are drained: the socket's, TCP's, CSI's.
    tasks: Vec<GrpcTask>,
    /// Removed at exit, while they are still the files this agent bound.
    sockets: Vec<lifecycle::OwnedSocket>,
}

/// Binds the marker socket (and `--grpc-listen`, `--csi-socket`) and serves
/// the ingest service on each.
#[cfg_attr(not(feature = "csi"), allow(unused_variables))]
async fn serve_ingest(
    config: &AgentConfig,
    state: &Arc<state::AgentState>,
    budget: &memory::MemoryBudget,
    components: &Components,
    node: &str,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<IngestListeners> {
    let connections = listen::IngestConnections {
        idle_timeout: Some(config.idle_timeout),
        grace: config.connection_grace,
        per_peer: config.max_connections_per_peer,
        per_process: config.max_connections_per_process,
        proc_root: config.proc_root.clone(),
        memory: listen::ConnectionMemory::new(budget.connections_bytes),
        counter: state.ingest.connections_closed.clone(),
    };
    let uds = bind_socket(&config.socket, config.socket_mode)?;
    let mut sockets = vec![lifecycle::OwnedSocket::new(&config.socket)];
    // HTTP/2 streams per connection: one client process holds one per rank.
    let per_connection = u32::try_from(config.max_streams_per_connection).ok();
    // One budget for traces across both ingest listeners.
    let traces = Arc::new(ingest::TraceBudget::new(
        budget.traces_bytes,
        config.partial_trace_timeout,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    ));
    let ingest_service = || {
        ingest::IngestService::new(
            state.clone(),
            components.workload.clone(),
            components.alerter.clone(),
            ingest::IngestLimits {
                max_streams: config.max_streams,
                max_streams_per_peer: config.max_streams_per_peer,
                max_streams_per_process: config.max_streams_per_process,
                max_marker_rate: config.max_marker_rate,
                hello_timeout: config.hello_timeout,
            },
            traces.clone(),
            connections.memory.clone(),
        )
    };
    // The shared socket's service; the CSI volumes' listeners share its
    // stream budget.
    let uds_service = ingest_service();
    #[cfg(feature = "csi")]
    let csi = serve_csi(
        config,
        state,
        node,
        &connections,
        per_connection,
        &uds_service,
        stop,
    )?;
    // No CSI plugin in this build (`--csi-socket` was refused at start).
    #[cfg(not(feature = "csi"))]
    let csi: Option<(GrpcTask, lifecycle::OwnedSocket)> = None;
    let mut tasks = vec![tokio::spawn(
        grpc_server(per_connection)
            .add_service(ingest_server(uds_service))
            .serve_with_incoming_shutdown(
                connections
                    .limit(uds, config.max_connections, "ingest_socket")
                    .into_incoming(),
                stopped(stop.clone()),
            ),
    )];
    let mut grpc_addr = None;
    if let Some(addr) = config.grpc_listen {
        let (bound, task) = serve_tcp_ingest(
            config,
            addr,
            &connections,
            grpc_server(per_connection),
            ingest_server(ingest_service()),
            stop,
        )
        .await?;
        grpc_addr = Some(bound);
        tasks.push(task);
    }
    if let Some((task, socket)) = csi {
        tasks.push(task);
        sockets.push(socket);
    }
    Ok(IngestListeners {
        grpc_addr,
        tasks,
        sockets,
    })
}

/// The TCP ingest (`--grpc-listen`), with TLS where its flags are given.
async fn serve_tcp_ingest(
    config: &AgentConfig,
    addr: std::net::SocketAddr,
    connections: &listen::IngestConnections,
    mut server: tonic::transport::Server,
    service: IngestServer<ingest::IngestService>,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<(std::net::SocketAddr, GrpcTask)> {
    match tls_config(config)? {
        Some(tls) => {
            server = server
                .tls_config(tls)
                .context("invalid TLS configuration")?;
            tracing::info!(%addr, mutual = config.grpc_tls_client_ca.is_some(), "TCP ingest enabled with TLS");
        }
        None => tracing::warn!(
            %addr,
            "TCP ingest enabled WITHOUT TLS or authentication; keep it on a private interface \
             or pass --grpc-tls-cert and --grpc-tls-key"
        ),
    }
    let tcp = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for gRPC on {addr}"))?;
    let bound = tcp.local_addr()?;
    let task = tokio::spawn(
        server.add_service(service).serve_with_incoming_shutdown(
            connections
                .limit(tcp, config.max_connections, "ingest_tcp")
                .into_incoming(),
            stopped(stop.clone()),
        ),
    );
    Ok((bound, task))
}

/// The CSI node plugin on `--csi-socket`, if given: its task and its socket.
#[cfg(feature = "csi")]
fn serve_csi(
    config: &AgentConfig,
    state: &Arc<state::AgentState>,
    node: &str,
    connections: &listen::IngestConnections,
    streams_per_connection: Option<u32>,
    uds_service: &ingest::IngestService,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<Option<(GrpcTask, lifecycle::OwnedSocket)>> {
    let Some(path) = &config.csi_socket else {
        return Ok(None);
    };
    let plugin = csi::CsiPlugin::new(
        csi::CsiConfig {
            driver_name: config.csi_driver_name.clone(),
            node_id: node.to_owned(),
            max_volumes: config.csi_max_volumes,
            state_file: path.with_file_name("volumes.jsonl"),
            connections: connections.clone(),
            streams_per_connection,
        },
        uds_service.clone(),
        stop.clone(),
        &state.registry,
    )?;
    plugin.restore();
    // Only the kubelet (root) and the registrar call it.
    let listener = bind_socket(path, 0o660)?;
    let socket = lifecycle::OwnedSocket::new(path);
    tracing::info!(socket = %path.display(), driver = %config.csi_driver_name, max_volumes = config.csi_max_volumes, "CSI node plugin on: pods get their own ingest socket through an ephemeral inline volume");
    use stepwatch_proto::csi::v1::{identity_server::IdentityServer, node_server::NodeServer};
    let task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IdentityServer::new(plugin.clone()))
            .add_service(NodeServer::new(plugin))
            .serve_with_incoming_shutdown(
                listen::Limited::new(listener, 16, Some(config.idle_timeout)).into_incoming(),
                stopped(stop.clone()),
            ),
    );
    Ok(Some((task, socket)))
}

/// `--ready-file`: every listener's address, written once all are bound.
fn write_ready_file(
    config: &AgentConfig,
    http: &HttpListeners,
    ingest: &IngestListeners,
) -> anyhow::Result<()> {
    let Some(path) = &config.ready_file else {
        return Ok(());
    };
    let ready = serde_json::json!({
        "http": http.addr.to_string(),
        "api": http.api_addr.map(|a| a.to_string()),
        "probe": http.probe_addr.map(|a| a.to_string()),
        "grpc": ingest.grpc_addr.map(|a| a.to_string()),
        "socket": config.socket,
        "csi_socket": config.csi_socket,
    });
    write_atomically(path, ready.to_string().as_bytes())
        .with_context(|| format!("cannot write the ready file {}", path.display()))
}

/// Moves samples into the step model, refreshes the views, writes the
/// journal (on its interval and on SIGHUP) and evicts finished ranks.
fn spawn_housekeeping(
    config: &AgentConfig,
    state: &Arc<state::AgentState>,
    mut hangup: tokio::signal::unix::Signal,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let state = state.clone();
    let retention = config.retention;
    let journal = config.journal.clone();
    let journal_steps = config.journal_steps;
    let journal_interval = config.journal_interval;
    tokio::spawn(async move {
        // Samples wait in the sampler's bounded buffer between drains;
        // 100 ms keeps the live step-1 view fresh at little cost.
        let mut attribute = tokio::time::interval(Duration::from_millis(100));
        let mut processes = tokio::time::interval(Duration::from_secs(1));
        let mut evict = tokio::time::interval(Duration::from_secs(10));
        let mut journal_tick = tokio::time::interval(journal_interval);
        let mut stale = StaleGpus::default();
        journal_tick.tick().await;
        loop {
            tokio::select! {
                _ = attribute.tick() => {
                    state.attribute_samples();
                    // Off the runtime: a refresh after many changes analyses many ranks.
                    let state = state.clone();
                    let _ = tokio::task::spawn_blocking(move || state.views.refresh(&state)).await;
                }
                _ = processes.tick() => {
                    state.update_processes();
                    state.flush_record();
                    stale.log_changes(&state.sampler.snapshot(monotonic_ns()));
                }
                _ = journal_tick.tick(), if journal.is_some() => {
                    let state = state.clone();
                    let path = journal.clone().expect("checked by the guard");
                    let _ = tokio::task::spawn_blocking(move || state.write_journal(&path, journal_steps)).await;
                }
                _ = hangup.recv() => {
                    if let Some(path) = journal.clone() {
                        let state = state.clone();
                        let _ = tokio::task::spawn_blocking(move || state.write_journal(&path, journal_steps)).await;
                    }
                    tracing::info!(journal_written = journal.is_some(), "SIGHUP: flags are not reloaded (restart the agent to change them); still running");
                }
                _ = evict.tick() => {
                    let n = state.evict_idle(retention.as_nanos() as u64);
                    if n > 0 {
                        state.ingest.ranks_evicted.inc_by(n as u64);
                        tracing::info!(ranks = n, "evicted finished ranks after the retention window");
                    }
                }
                _ = stop.changed() => break,
            }
        }
    })
}

/// Everything that runs until shutdown.
struct Running {
    http: HttpListeners,
    ingest: IngestListeners,
    components: Components,
    housekeeping: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Waits for every task to end (they have been told to stop).
    async fn drain(self) {
        for task in self.ingest.tasks {
            let _ = task.await;
        }
        for task in self.http.tasks {
            let _ = task.await;
        }
        let _ = self.housekeeping.await;
        if let Some(t) = self.components.holders_task {
            let _ = t.await;
        }
    }
}

/// Stops everything in order: NVML first, then the listeners (drained for
/// at most 3 s), the final journal and record, and the sockets.
async fn shut_down(
    config: &AgentConfig,
    state: &state::AgentState,
    sampler: &SamplerHandle,
    stop: watch::Sender<bool>,
    mut running: Running,
) {
    tracing::info!("shutting down");
    // NVML first: a driver upgrade (the GPU Operator's) waits for the driver's
    // clients to let go, and the drain below may take seconds.
    let nvml_released = release_nvml(sampler.clone());
    state.ingest_listening.store(false, Ordering::Relaxed);
    let _ = stop.send(true);
    // Both before the lock goes: the next agent binds them once it has it.
    // The volumes' sockets stay: their pods still mount them, and the next
    // agent reopens them from the state file.
    let sockets = std::mem::take(&mut running.ingest.sockets);
    // Streams from live trainers never end by themselves; don't wait forever.
    if tokio::time::timeout(Duration::from_secs(3), running.drain())
        .await
        .is_err()
    {
        tracing::warn!("open streams did not close within 3 s; exiting anyway");
    }
    if let Some(path) = &config.journal {
        state.write_journal(path, config.journal_steps);
        tracing::info!(path = %path.display(), "journal written");
    }
    state.flush_record_and_wait();
    // A hung NVML call cannot be interrupted; exit without waiting for it
    // (a blocking task still running would hold the runtime's shutdown).
    if !nvml_released.await.unwrap_or(false) {
        tracing::warn!("the NVML sampler did not stop within 2 s (an NVML call hangs); exiting without nvmlShutdown");
    }
    for socket in &sockets {
        socket.remove();
    }
}

/// Stops the sampler (nvmlShutdown) off the runtime; true once it stopped
/// within 2 s.
fn release_nvml(sampler: SamplerHandle) -> tokio::task::JoinHandle<bool> {
    let signalled = std::time::Instant::now();
    tokio::task::spawn_blocking(move || {
        let stopped = sampler.stop_within(Duration::from_secs(2));
        if stopped {
            let ms = signalled.elapsed().as_secs_f64() * 1e3;
            tracing::info!(
                after_ms = format_args!("{ms:.1}"),
                "NVML released (nvmlShutdown)"
            );
        }
        stopped
    })
}

/// GPUs whose samples are stale, so the log says so once per change.
#[derive(Default)]
struct StaleGpus(std::collections::BTreeSet<u32>);

impl StaleGpus {
    fn log_changes(&mut self, snap: &stepwatch_gpu::SamplerSnapshot) {
        for g in &snap.gpus {
            if g.stale && self.0.insert(g.index) {
                tracing::error!(
                    gpu = g.index,
                    uuid = %g.uuid,
                    age_s = format_args!("{:.1}", g.sample_age_seconds),
                    "no GPU memory sample for this long: an NVML call hangs; reporting the GPU down (stepwatch_gpu_up 0) with its last figures frozen"
                );
            } else if !g.stale && self.0.remove(&g.index) {
                tracing::info!(gpu = g.index, uuid = %g.uuid, "GPU memory samples flow again");
            }
        }
    }
}

/// The TCP ingest's TLS settings, read from the PEM files the flags name.
fn tls_config(config: &AgentConfig) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let (Some(cert), Some(key)) = (&config.grpc_tls_cert, &config.grpc_tls_key) else {
        return Ok(None);
    };
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("cannot read {}", p.display()));
    // A handshake that never finishes must not hold a connection slot.
    let mut tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(read(cert)?, read(key)?))
        .timeout(Duration::from_secs(10));
    if let Some(ca) = &config.grpc_tls_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(Some(tls))
}

/// The gRPC server settings of every ingest listener. Keepalive pings find
/// dead peers, and keep live quiet ones (a long step) inside the idle timeout.
pub(crate) fn grpc_server(streams_per_connection: Option<u32>) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(streams_per_connection)
        // What `listen::CONNECTION_BYTES` and `ingest::STREAM_BYTES` count.
        .initial_connection_window_size(listen::CONNECTION_WINDOW)
        .initial_stream_window_size(ingest::STREAM_WINDOW)
        .max_frame_size(listen::MAX_FRAME)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
}

/// The ingest service with the contract's message size limits.
pub(crate) fn ingest_server(service: ingest::IngestService) -> IngestServer<ingest::IngestService> {
    IngestServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// Writes `bytes` to `path` whole or not at all (see
/// [`lifecycle::write_atomically_with`]).
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    lifecycle::write_atomically_with(path, |w| std::io::Write::write_all(w, bytes))
}

/// Creates the directory `path` goes in; `what` names the file in the error.
pub(crate) fn create_parent_dir(path: &Path, what: &str) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the {what} directory {}", dir.display()))?;
    }
    Ok(())
}

/// Binds the marker socket: creates its directory, replaces a stale socket
/// file, and sets the file mode.
pub(crate) fn bind_socket(path: &Path, mode: u32) -> anyhow::Result<UnixListener> {
    create_parent_dir(path, "socket")?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        // Only a socket is ours to replace; anything else is someone's file.
        if !meta.file_type().is_socket() {
            anyhow::bail!(
                "{} exists and is not a socket; refusing to replace it (pass another --socket or remove the file)",
                path.display()
            );
        }
        // A live agent would still answer; a dead one leaves its file behind.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!(
                "another process is already listening on {}; stop it or pass --socket",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
    }
    let listener = UnixListener::bind(path)
        .with_context(|| format!("cannot listen on the Unix socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set mode {mode:o} on {}", path.display()))?;
    Ok(listener)
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its whole length.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = interrupt.recv() => {}
        }
    })
}

#[cfg(all(test, feature = "cli"))]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> AgentConfig {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            agent: AgentConfig,
        }
        let argv = std::iter::once("stepwatch").chain(args.iter().copied());
        <Cli as clap::Parser>::try_parse_from(argv).unwrap().agent
    }

    /// A flag that asks for a component this build lacks names the cargo
    /// feature to rebuild with; a build with every component accepts them.
    #[test]
    fn a_component_this_build_lacks_is_refused_with_its_feature() {
        let kubelet = tempfile::tempdir().unwrap();
        let asks_for_all = config(&[
            "--alertmanager-url",
            "http://127.0.0.1:9093",
            "--csi-socket",
            "/run/stepwatch-csi/csi.sock",
            "--pod-logs-dir",
            kubelet.path().to_str().unwrap(),
            "--pod-resources-socket",
            "/nonexistent/kubelet.sock",
        ]);
        let missing = unbuilt_components(&asks_for_all);
        for (feature, flag) in [
            ("alerts", "--alertmanager-url"),
            ("csi", "--csi-socket"),
            ("workload", kubelet.path().to_str().unwrap()),
        ] {
            let refused = missing
                .iter()
                .find(|m| m.contains(&format!("rebuild with --features {feature}")));
            let built = match feature {
                "alerts" => cfg!(feature = "alerts"),
                "csi" => cfg!(feature = "csi"),
                _ => cfg!(feature = "workload"),
            };
            assert_eq!(refused.is_none(), built, "{feature}: {missing:?}");
            if let Some(m) = refused {
                assert!(m.starts_with(flag), "{m}");
            }
        }
        let err = refuse_unbuilt_components(&asks_for_all);
        assert_eq!(err.is_ok(), missing.is_empty());
        // Asking for none of them starts in any build.
        let asks_for_none = config(&[
            "--pod-logs-dir",
            "/nonexistent/pods",
            "--pod-resources-socket",
            "/nonexistent/kubelet.sock",
        ]);
        assert!(unbuilt_components(&asks_for_none).is_empty());
    }
}
