//! The NVML sampler thread and its shared, bounded state.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use stepwatch_proto::clock::monotonic_ns;

use crate::ring::TimedRing;

/// How the sampler runs. Every bound that sizes memory is here.
#[derive(Debug, Clone)]
pub struct SamplerConfig {
    /// Path of libnvidia-ml; None opens `libnvidia-ml.so.1` from the loader path.
    pub lib_path: Option<PathBuf>,
    /// Period of device-memory reads (default 10 ms = 100 Hz).
    pub memory_interval: Duration,
    /// Period of process-list and utilisation reads (default 1 s).
    pub process_interval: Duration,
    /// Trailing window of the `_max` figures (default 15 s, the scrape interval).
    pub max_window: Duration,
    /// First and longest wait between attempts to (re)initialise NVML.
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// Samples per GPU held for the step tracker between drains; older ones
    /// are dropped (and counted) if the tracker stalls.
    pub pending_capacity: usize,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            lib_path: None,
            memory_interval: Duration::from_millis(10),
            process_interval: Duration::from_secs(1),
            max_window: Duration::from_secs(15),
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
            pending_capacity: 4096,
        }
    }
}

/// NVML call classes, for per-call error counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvmlCall {
    Init,
    DeviceCount,
    DeviceHandle,
    Name,
    Uuid,
    MemoryInfo,
    Processes,
    Utilization,
}

impl NvmlCall {
    pub const ALL: [NvmlCall; 8] = [
        NvmlCall::Init,
        NvmlCall::DeviceCount,
        NvmlCall::DeviceHandle,
        NvmlCall::Name,
        NvmlCall::Uuid,
        NvmlCall::MemoryInfo,
        NvmlCall::Processes,
        NvmlCall::Utilization,
    ];

    /// Label value of `stepwatch_nvml_errors_total{call}`.
    pub fn as_str(self) -> &'static str {
        match self {
            NvmlCall::Init => "init",
            NvmlCall::DeviceCount => "device_count",
            NvmlCall::DeviceHandle => "device_handle",
            NvmlCall::Name => "name",
            NvmlCall::Uuid => "uuid",
            NvmlCall::MemoryInfo => "memory_info",
            NvmlCall::Processes => "processes",
            NvmlCall::Utilization => "utilization",
        }
    }
}

/// One device-memory reading (NVML memory info v2: `used` excludes
/// driver-reserved memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub monotonic_ns: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// A compute process on a GPU, from the slow process list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    pub pid: u32,
    pub used_bytes: u64,
}

/// What `/metrics` and the API need about one GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSnapshot {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_bytes: u64,
    pub last: Option<Sample>,
    /// Maximum `used` over the trailing window.
    pub used_max_bytes: Option<u64>,
    pub samples_total: u64,
    /// False while NVML reports the GPU lost.
    pub up: bool,
    pub processes: Vec<ProcessUsage>,
    /// (gpu %, memory %) from the last utilisation read.
    pub utilization_percent: Option<(u32, u32)>,
}

/// The sampler's state at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerSnapshot {
    pub nvml_up: bool,
    /// Why NVML is not up, in words for logs and `/readyz`.
    pub status: String,
    pub gpus: Vec<GpuSnapshot>,
    /// Worst tick lateness over the trailing window, seconds.
    pub lag_max_seconds: f64,
    pub ticks_total: u64,
    /// Ticks that started more than one period late.
    pub late_ticks_total: u64,
    pub init_attempts_total: u64,
    /// Samples dropped because the tracker did not drain them in time.
    pub pending_dropped_total: u64,
    pub errors: Vec<(NvmlCall, u64)>,
}

struct GpuEntry {
    snapshot: GpuSnapshot,
    ring: TimedRing<u64>,
    pending: Vec<Sample>,
}

struct State {
    nvml_up: bool,
    status: String,
    gpus: Vec<GpuEntry>,
    lag_ring: TimedRing<u64>,
    ticks_total: u64,
    late_ticks_total: u64,
    init_attempts_total: u64,
    pending_dropped_total: u64,
}

struct Shared {
    state: Mutex<State>,
    errors: [AtomicU64; NvmlCall::ALL.len()],
    stop: AtomicBool,
    // Wakes the thread from backoff sleeps on stop.
    wake: (Mutex<()>, Condvar),
}

impl Shared {
    fn count_error(&self, call: NvmlCall) {
        self.errors[call as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere must not take the exporter down with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sleeps up to `d`, returning early (true) when stop was requested.
    fn sleep(&self, d: Duration) -> bool {
        let (lock, cvar) = &self.wake;
        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        let _ = cvar
            .wait_timeout_while(guard, d, |_| !self.stop.load(Ordering::Relaxed))
            .unwrap_or_else(|e| e.into_inner());
        self.stop.load(Ordering::Relaxed)
    }
}

/// Owner of the sampler thread; cheap to clone readers from.
#[derive(Clone)]
pub struct SamplerHandle {
    shared: Arc<Shared>,
    config: Arc<SamplerConfig>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl SamplerHandle {
    /// Starts the sampler thread. It never fails: a missing NVML is a state
    /// the sampler reports and retries, not an error.
    pub fn start(config: SamplerConfig) -> Self {
        let window_ticks = config.max_window.as_nanos() / config.memory_interval.as_nanos().max(1);
        let lag_capacity = (window_ticks as usize + 16).min(1 << 20);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                nvml_up: false,
                status: "NVML not initialised yet".into(),
                gpus: Vec::new(),
                lag_ring: TimedRing::new(lag_capacity),
                ticks_total: 0,
                late_ticks_total: 0,
                init_attempts_total: 0,
                pending_dropped_total: 0,
            }),
            errors: Default::default(),
            stop: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
        });
        let config = Arc::new(config);
        let thread = {
            let shared = shared.clone();
            let config = config.clone();
            std::thread::Builder::new()
                .name("stepwatch-sampler".into())
                .spawn(move || run(&shared, &config))
                .expect("spawn sampler thread")
        };
        Self {
            shared,
            config,
            thread: Arc::new(Mutex::new(Some(thread))),
        }
    }

    /// The current state, with `_max` figures over the window ending `now_ns`.
    pub fn snapshot(&self, now_ns: u64) -> SamplerSnapshot {
        let since = now_ns.saturating_sub(self.config.max_window.as_nanos() as u64);
        let state = self.shared.lock();
        SamplerSnapshot {
            nvml_up: state.nvml_up,
            status: state.status.clone(),
            gpus: state
                .gpus
                .iter()
                .map(|g| GpuSnapshot {
                    used_max_bytes: g.ring.max_since(since),
                    ..g.snapshot.clone()
                })
                .collect(),
            lag_max_seconds: state.lag_ring.max_since(since).unwrap_or(0) as f64 / 1e9,
            ticks_total: state.ticks_total,
            late_ticks_total: state.late_ticks_total,
            init_attempts_total: state.init_attempts_total,
            pending_dropped_total: state.pending_dropped_total,
            errors: NvmlCall::ALL
                .iter()
                .map(|&c| (c, self.shared.errors[c as usize].load(Ordering::Relaxed)))
                .collect(),
        }
    }

    /// Takes the samples taken since the last drain, per GPU UUID.
    pub fn drain_samples(&self) -> Vec<(String, Vec<Sample>)> {
        let mut state = self.shared.lock();
        state
            .gpus
            .iter_mut()
            .filter(|g| !g.pending.is_empty())
            .map(|g| (g.snapshot.uuid.clone(), std::mem::take(&mut g.pending)))
            .collect()
    }

    /// Whether NVML answered the last attempt.
    pub fn nvml_up(&self) -> bool {
        self.shared.lock().nvml_up
    }

    /// Stops the thread and waits for it (NVML is shut down on its way out).
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.wake.1.notify_all();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

fn run(shared: &Shared, config: &SamplerConfig) {
    let mut backoff = config.retry_min;
    let mut last_logged = String::new();
    while !shared.stop.load(Ordering::Relaxed) {
        shared.lock().init_attempts_total += 1;
        let init = match &config.lib_path {
            Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
            None => Nvml::init(),
        };
        let reason = match init {
            Ok(nvml) => {
                backoff = config.retry_min;
                last_logged.clear();
                let why = session(shared, config, &nvml);
                // Dropping `nvml` calls nvmlShutdown before the next attempt.
                drop(nvml);
                match why {
                    None => return,
                    Some(why) => why,
                }
            }
            Err(e) => {
                shared.count_error(NvmlCall::Init);
                format!("NVML could not be initialised: {e}")
            }
        };
        {
            let mut state = shared.lock();
            state.nvml_up = false;
            state.status = reason.clone();
            for g in &mut state.gpus {
                g.snapshot.up = false;
            }
        }
        if reason != last_logged {
            let lib = config
                .lib_path
                .as_ref()
                .map_or("libnvidia-ml.so.1".into(), |p| p.display().to_string());
            tracing::warn!(
                error = %reason,
                library = %lib,
                retry_in_s = backoff.as_secs_f64(),
                "NVML unavailable; serving metrics with stepwatch_nvml_up 0 and retrying. \
                 Check that the NVIDIA driver is loaded and its libnvidia-ml is visible \
                 (in Kubernetes: the nvidia runtime class or NVIDIA_DRIVER_CAPABILITIES=utility), \
                 or pass --nvml-lib"
            );
            last_logged = reason;
        }
        if shared.sleep(backoff) {
            return;
        }
        backoff = (backoff * 2).min(config.retry_max);
    }
}

/// Errors that mean NVML itself is gone, not one GPU or one call.
fn nvml_gone(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::Uninitialized
            | NvmlError::DriverNotLoaded
            | NvmlError::LibraryNotFound
            | NvmlError::LibRmVersionMismatch
    )
}

/// Samples until stop (returns None) or until NVML is lost (returns why).
fn session(shared: &Shared, config: &SamplerConfig, nvml: &Nvml) -> Option<String> {
    let count = match nvml.device_count() {
        Ok(c) => c,
        Err(e) => {
            shared.count_error(NvmlCall::DeviceCount);
            return Some(format!("NVML device count failed: {e}"));
        }
    };
    let window_ticks = config.max_window.as_nanos() / config.memory_interval.as_nanos().max(1);
    let ring_capacity = (window_ticks as usize + 16).min(1 << 20);
    let mut devices: Vec<Device<'_>> = Vec::new();
    let mut entries = Vec::new();
    for index in 0..count {
        let device = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                shared.count_error(NvmlCall::DeviceHandle);
                tracing::warn!(gpu = index, error = %e, "skipping a GPU NVML cannot open");
                continue;
            }
        };
        let uuid = device.uuid().unwrap_or_else(|e| {
            shared.count_error(NvmlCall::Uuid);
            tracing::warn!(gpu = index, error = %e, "GPU UUID unreadable");
            format!("unknown-{index}")
        });
        let name = device.name().unwrap_or_else(|_| {
            shared.count_error(NvmlCall::Name);
            "unknown".into()
        });
        let total_bytes = device.memory_info().map(|m| m.total).unwrap_or(0);
        entries.push(GpuEntry {
            snapshot: GpuSnapshot {
                index,
                uuid,
                name,
                total_bytes,
                last: None,
                used_max_bytes: None,
                samples_total: 0,
                up: true,
                processes: Vec::new(),
                utilization_percent: None,
            },
            ring: TimedRing::new(ring_capacity),
            pending: Vec::new(),
        });
        devices.push(device);
    }
    {
        let mut state = shared.lock();
        state.gpus = entries;
        state.nvml_up = true;
        state.status = format!("NVML up, {} GPU(s)", devices.len());
    }
    let gpus: Vec<(u32, String)> = {
        let state = shared.lock();
        state
            .gpus
            .iter()
            .map(|g| (g.snapshot.index, g.snapshot.uuid.clone()))
            .collect()
    };
    tracing::info!(?gpus, "NVML initialised; sampling");

    let interval = config.memory_interval;
    let mut origin = Instant::now();
    let mut tick: u32 = 0;
    let mut next_slow = origin;
    let mut readings: Vec<Result<Sample, NvmlError>> = Vec::with_capacity(devices.len());
    loop {
        let deadline = origin + interval * tick;
        let now = Instant::now();
        if deadline > now && shared.sleep(deadline - now) {
            return None;
        }
        if shared.stop.load(Ordering::Relaxed) {
            return None;
        }
        let started = Instant::now();
        let lateness = started.saturating_duration_since(deadline);
        let slow_due = started >= next_slow;

        readings.clear();
        for device in &devices {
            let at = monotonic_ns();
            readings.push(device.memory_info().map(|m| Sample {
                monotonic_ns: at,
                used_bytes: m.used,
                free_bytes: m.free,
                total_bytes: m.total,
            }));
        }
        let slow: Vec<Option<(Vec<ProcessUsage>, Option<(u32, u32)>)>> = if slow_due {
            next_slow = started + config.process_interval;
            devices.iter().map(|d| read_slow(shared, d)).collect()
        } else {
            Vec::new()
        };

        let mut gone = None;
        let mut failures = 0;
        {
            let mut state = shared.lock();
            let now_ns = monotonic_ns();
            state.ticks_total += 1;
            state.lag_ring.push(now_ns, lateness.as_nanos() as u64);
            if lateness > interval {
                state.late_ticks_total += 1;
            }
            let pending_capacity = config.pending_capacity;
            let mut dropped = 0;
            for (i, (entry, reading)) in state.gpus.iter_mut().zip(readings.drain(..)).enumerate() {
                match reading {
                    Ok(sample) => {
                        entry.snapshot.up = true;
                        entry.snapshot.samples_total += 1;
                        entry.snapshot.last = Some(sample);
                        entry.snapshot.total_bytes = sample.total_bytes;
                        entry.ring.push(sample.monotonic_ns, sample.used_bytes);
                        if entry.pending.len() >= pending_capacity {
                            entry.pending.remove(0);
                            dropped += 1;
                        }
                        entry.pending.push(sample);
                    }
                    Err(e) => {
                        failures += 1;
                        shared.count_error(NvmlCall::MemoryInfo);
                        if matches!(e, NvmlError::GpuLost) && entry.snapshot.up {
                            tracing::error!(gpu = entry.snapshot.index, uuid = %entry.snapshot.uuid, "GPU lost; other GPUs keep being sampled");
                        }
                        if matches!(e, NvmlError::GpuLost) {
                            entry.snapshot.up = false;
                        }
                        if nvml_gone(&e) {
                            gone = Some(format!("NVML stopped answering: {e}"));
                        }
                    }
                }
                if let Some(Some((procs, util))) = slow.get(i) {
                    entry.snapshot.processes = procs.clone();
                    entry.snapshot.utilization_percent = *util;
                }
            }
            state.pending_dropped_total += dropped;
        }
        if let Some(why) = gone.filter(|_| failures == devices.len()) {
            return Some(why);
        }

        tick += 1;
        // Fallen far behind (a stalled driver call): start a new schedule
        // rather than firing a burst of catch-up reads.
        if lateness > interval * 4 || tick == u32::MAX {
            origin = Instant::now();
            tick = 0;
        }
    }
}

fn read_slow(
    shared: &Shared,
    device: &Device<'_>,
) -> Option<(Vec<ProcessUsage>, Option<(u32, u32)>)> {
    let procs = match device.running_compute_processes() {
        Ok(list) => list
            .into_iter()
            .map(|p| ProcessUsage {
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => b,
                    UsedGpuMemory::Unavailable => 0,
                },
            })
            .collect(),
        Err(_) => {
            shared.count_error(NvmlCall::Processes);
            return None;
        }
    };
    let util = match device.utilization_rates() {
        Ok(u) => Some((u.gpu, u.memory)),
        Err(_) => {
            shared.count_error(NvmlCall::Utilization);
            None
        }
    };
    Some((procs, util))
}
