//! The stepwatch per-node agent.
//!
//! Wiring only: the NVML sampler (stepwatch-gpu) and the step model
//! (stepwatch-core) do the work; this crate puts a gRPC ingest server on a
//! Unix socket (and optionally TCP), an HTTP server for `/metrics`, health
//! and the JSON API, and a task that moves GPU samples into the step model.

mod alerts;
pub mod config;
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
use stepwatch_proto::csi::v1::{identity_server::IdentityServer, node_server::NodeServer};
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
    // First of all: a restarted agent waits here for the old one to exit,
    // so it reads the old one's last journal and the old one's exit cannot
    // unlink the new socket.
    let lock = {
        let (socket, wait) = (config.socket.clone(), config.lock_wait);
        tokio::task::spawn_blocking(move || lifecycle::SocketLock::acquire(&socket, wait)).await??
    };
    // SIGHUP's default action ends the process with no final journal; a
    // terminal closing or a supervisor's reload must not do that.
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("cannot handle SIGHUP")?;
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
        "memory budget"
    );
    let node = config.node_name.clone().unwrap_or_else(hostname);
    let sampler = SamplerHandle::start(SamplerConfig {
        lib_path: config.nvml_lib.clone(),
        memory_interval: Duration::from_secs_f64(1.0 / config.sample_hz),
        process_interval: config.process_interval,
        max_window: config.max_window,
        stale_after: SamplerConfig::stale_after_for(Duration::from_secs_f64(
            1.0 / config.sample_hz,
        )),
        ..SamplerConfig::default()
    });
    let tracker = Tracker::new(TrackerConfig {
        max_ranks: config.max_ranks,
        max_retained_steps: config.max_steps,
        memory_budget_bytes: budget.history_bytes,
        check_client_clock: true,
        reconnect_window_ns: config.reconnect_window.as_nanos() as u64,
        ..TrackerConfig::default()
    });
    let gpu_holders = workload::GpuHolders::new(config.pod_resources_refresh);
    let state = state::AgentState::new(tracker, sampler.clone(), node.clone(), gpu_holders)?;
    state.set_memory_budget(&budget)?;
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

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.changed().await;
    };

    match listen::raise_fd_limit() {
        Ok((old, new)) if new > old => {
            tracing::info!(from = old, to = new, "raised the open-file limit")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
    let idle = Some(config.idle_timeout);

    // HTTP first, so /healthz answers while everything else starts.
    let http = std::net::TcpListener::bind(config.http_listen)
        .with_context(|| format!("cannot listen for HTTP on {}", config.http_listen))?;
    let http_addr = http.local_addr()?;
    let http_limits = http::HttpLimits {
        max_connections: config.max_http_connections,
        max_connections_per_peer: config.max_http_connections_per_peer,
        header_timeout: config.http_header_timeout,
        idle_timeout: idle,
    };
    let http_task = http::serve_on_own_thread(
        http,
        if config.api_listen.is_some() {
            http::Routes::Monitoring
        } else {
            http::Routes::All
        },
        state.clone(),
        http_limits,
        stopped(stop_rx.clone()),
    )?;
    let (api_addr, api_task) = match config.api_listen {
        Some(addr) => {
            let api = std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot listen for the API on {addr}"))?;
            let api_addr = api.local_addr()?;
            let task = http::serve_on_own_thread(
                api,
                http::Routes::Api,
                state.clone(),
                http_limits,
                stopped(stop_rx.clone()),
            )?;
            (Some(api_addr), Some(task))
        }
        None => (None, None),
    };
    let (probe_addr, probe_task) = match config.probe_listen {
        Some(addr) => {
            let probes = std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot listen for the probes on {addr}"))?;
            let probe_addr = probes.local_addr()?;
            let task = http::serve_on_own_thread(
                probes,
                http::Routes::Probes,
                state.clone(),
                http_limits,
                stopped(stop_rx.clone()),
            )?;
            (Some(probe_addr), Some(task))
        }
        None => (None, None),
    };
    let connections = listen::IngestConnections {
        idle_timeout: idle,
        grace: config.connection_grace,
        per_peer: config.max_connections_per_peer,
        per_process: config.max_connections_per_process,
        counter: state.ingest.connections_closed.clone(),
    };

    let uds = bind_socket(&config.socket, config.socket_mode)?;
    let owned_socket = lifecycle::OwnedSocket::new(&config.socket);
    // HTTP/2 streams per connection: one client process holds one per rank.
    let per_connection = u32::try_from(config.max_streams_per_connection).ok();
    let grpc_server = || grpc_server(per_connection);
    // One budget for traces across both ingest listeners.
    let traces = Arc::new(ingest::TraceBudget::new(
        budget.traces_bytes,
        config.partial_trace_timeout,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    ));

    let workload = std::sync::Arc::new(workload::WorkloadResolver::new(
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
    // Which pod holds which GPU, for the GPU series' pod labels: one List
    // call per --pod-resources-refresh, bounded by its timeout.
    let holders_task = workload.pod_resources().then(|| {
        let workload = workload.clone();
        let mut stop = stop_rx.clone();
        let period = config.pod_resources_refresh;
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
    });
    let alerter = alerts::Alerter::start(
        alerts::AlertmanagerConfig {
            urls: config.alertmanager_urls.clone(),
            extra_labels: config.alertmanager_labels.clone(),
            resend_interval: config.alertmanager_resend_interval,
            runbook_base_url: config.alertmanager_runbook_base_url.clone(),
            node: node.clone(),
        },
        &state.registry,
        stop_rx.clone(),
    )?;
    if !config.alertmanager_urls.is_empty() {
        tracing::info!(urls = ?config.alertmanager_urls, "posting step-2 OOM, low-headroom and divergence alerts to Alertmanager");
    }
    let ingest_service = || {
        ingest::IngestService::new(
            state.clone(),
            workload.clone(),
            alerter.clone(),
            ingest::IngestLimits {
                max_streams: config.max_streams,
                max_streams_per_peer: config.max_streams_per_peer,
                max_streams_per_process: config.max_streams_per_process,
                max_marker_rate: config.max_marker_rate,
                hello_timeout: config.hello_timeout,
            },
            traces.clone(),
        )
    };
    let ingest = || ingest_server(ingest_service());
    // The shared socket's service; the CSI volumes' listeners share its
    // stream budget.
    let uds_service = ingest_service();
    let mut owned_csi_socket = None;
    let csi_task = match &config.csi_socket {
        Some(path) => {
            let plugin = csi::CsiPlugin::new(
                csi::CsiConfig {
                    driver_name: config.csi_driver_name.clone(),
                    node_id: node.clone(),
                    max_volumes: config.csi_max_volumes,
                    state_file: path.with_file_name("volumes.jsonl"),
                    connections: connections.clone(),
                    streams_per_connection: per_connection,
                },
                uds_service.clone(),
                stop_rx.clone(),
                &state.registry,
            )?;
            plugin.restore();
            // Only the kubelet (root) and the registrar call it.
            let listener = bind_socket(path, 0o660)?;
            owned_csi_socket = Some(lifecycle::OwnedSocket::new(path));
            tracing::info!(socket = %path.display(), driver = %config.csi_driver_name, max_volumes = config.csi_max_volumes, "CSI node plugin on: pods get their own ingest socket through an ephemeral inline volume");
            Some(tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(IdentityServer::new(plugin.clone()))
                    .add_service(NodeServer::new(plugin))
                    .serve_with_incoming_shutdown(
                        listen::Limited::new(listener, 16, idle).into_incoming(),
                        stopped(stop_rx.clone()),
                    ),
            ))
        }
        None => None,
    };
    let uds_task = tokio::spawn(
        grpc_server()
            .add_service(ingest_server(uds_service))
            .serve_with_incoming_shutdown(
                connections
                    .limit(uds, config.max_connections, "ingest_socket")
                    .into_incoming(),
                stopped(stop_rx.clone()),
            ),
    );
    let mut grpc_addr = None;
    let tcp_task = match config.grpc_listen {
        Some(addr) => {
            let mut server = grpc_server();
            match tls_config(&config)? {
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
            grpc_addr = Some(tcp.local_addr()?);
            Some(tokio::spawn(
                server.add_service(ingest()).serve_with_incoming_shutdown(
                    connections
                        .limit(tcp, config.max_connections, "ingest_tcp")
                        .into_incoming(),
                    stopped(stop_rx.clone()),
                ),
            ))
        }
        None => None,
    };
    state.ingest_listening.store(true, Ordering::Relaxed);
    if let Some(path) = &config.ready_file {
        let ready = serde_json::json!({
            "http": http_addr.to_string(),
            "api": api_addr.map(|a| a.to_string()),
            "probe": probe_addr.map(|a| a.to_string()),
            "grpc": grpc_addr.map(|a| a.to_string()),
            "socket": config.socket,
            "csi_socket": config.csi_socket,
        });
        write_atomically(path, ready.to_string().as_bytes())
            .with_context(|| format!("cannot write the ready file {}", path.display()))?;
    }
    tracing::info!(
        node = %node,
        http = %http_addr,
        socket = %config.socket.display(),
        sample_hz = config.sample_hz,
        "stepwatch agent running; metrics at http://{http_addr}/metrics"
    );

    // Moves samples into the step model and evicts finished ranks.
    let housekeeping = tokio::spawn({
        let state = state.clone();
        let retention = config.retention;
        let journal = config.journal.clone();
        let journal_steps = config.journal_steps;
        let journal_interval = config.journal_interval;
        let mut stop = stop_rx.clone();
        async move {
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
        }
    });

    shutdown.await;
    tracing::info!("shutting down");
    // NVML first: a driver upgrade (the GPU Operator's) waits for the driver's
    // clients to let go, and the drain below may take seconds.
    let signalled = std::time::Instant::now();
    let nvml_released = tokio::task::spawn_blocking({
        let sampler = sampler.clone();
        move || {
            let stopped = sampler.stop_within(Duration::from_secs(2));
            if stopped {
                let ms = signalled.elapsed().as_secs_f64() * 1e3;
                tracing::info!(
                    after_ms = format_args!("{ms:.1}"),
                    "NVML released (nvmlShutdown)"
                );
            }
            stopped
        }
    });
    state.ingest_listening.store(false, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    // Streams from live trainers never end by themselves; don't wait forever.
    let drain = async {
        let _ = uds_task.await;
        if let Some(t) = tcp_task {
            let _ = t.await;
        }
        if let Some(t) = csi_task {
            let _ = t.await;
        }
        let _ = http_task.await;
        for task in [api_task, probe_task].into_iter().flatten() {
            let _ = task.await;
        }
        let _ = housekeeping.await;
        if let Some(t) = holders_task {
            let _ = t.await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(3), drain)
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
    // Both before the lock goes: the next agent binds them once it has it.
    // The volumes' sockets stay: their pods still mount them, and the next
    // agent reopens them from the state file.
    owned_socket.remove();
    if let Some(csi) = &owned_csi_socket {
        csi.remove();
    }
    tracing::debug!(lock = %lock.path().display(), "releasing the socket's lock");
    drop(lock);
    tracing::info!("stopped");
    Ok(())
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
