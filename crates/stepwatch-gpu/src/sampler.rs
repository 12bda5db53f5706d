//! The NVML sampler thread and its shared, bounded state.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use stepwatch_clock::monotonic_ns;

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
    /// Cap of the doubling backoff, so a missing driver is not hammered.
    pub retry_max: Duration,
    /// Samples per GPU held for the step tracker between drains; older ones
    /// are dropped (and counted) if the tracker stalls.
    pub pending_capacity: usize,
    /// A GPU whose last good memory read is older than this is reported down
    /// and stale: a hung NVML call freezes the figures without any error, so
    /// only the age of the last sample shows it (default 2 s; see
    /// [`SamplerConfig::stale_after_for`]).
    pub stale_after: Duration,
}

impl SamplerConfig {
    /// The staleness bound for a memory interval: five missed reads, and at
    /// least 2 s so a busy machine's scheduling hiccups do not flap `gpu_up`.
    pub fn stale_after_for(memory_interval: Duration) -> Duration {
        (memory_interval * 5).max(Duration::from_secs(2))
    }
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
            stale_after: SamplerConfig::stale_after_for(Duration::from_millis(10)),
        }
    }
}

/// NVML call classes, for per-call error counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvmlCall {
    /// `nvmlInit`: loading the library and starting NVML.
    Init,
    /// Counting the devices.
    DeviceCount,
    /// Getting a device handle by index.
    DeviceHandle,
    /// Reading a device's product name.
    Name,
    /// Reading a device's UUID, the key ranks name their GPU by.
    Uuid,
    /// The fast device-memory read; errors here cost samples.
    MemoryInfo,
    /// The slow compute-process list (takes the driver's global lock).
    Processes,
    /// Reading utilisation rates.
    Utilization,
    /// Finding a GPU's MIG devices (MIG mode, handles, instance ids).
    Mig,
}

impl NvmlCall {
    /// Every call class, so exporters can emit a zero counter for each.
    pub const ALL: [NvmlCall; 9] = [
        NvmlCall::Init,
        NvmlCall::DeviceCount,
        NvmlCall::DeviceHandle,
        NvmlCall::Name,
        NvmlCall::Uuid,
        NvmlCall::MemoryInfo,
        NvmlCall::Processes,
        NvmlCall::Utilization,
        NvmlCall::Mig,
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
            NvmlCall::Mig => "mig",
        }
    }
}

/// One device-memory reading (NVML memory info v2: `used` excludes
/// driver-reserved memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// CLOCK_MONOTONIC ns of the read; the clock markers use, so samples can be
    /// attributed to phases.
    pub monotonic_ns: u64,
    /// Device memory in use, bytes; the figure peaks and predictions use.
    pub used_bytes: u64,
    /// Device memory free, bytes.
    pub free_bytes: u64,
    /// Device capacity, bytes (NVML `total`).
    pub total_bytes: u64,
    /// Memory the driver keeps for itself (NVML v2 `reserved`), bytes: part
    /// of `total` that no process can allocate.
    pub reserved_bytes: u64,
}

impl Sample {
    /// What processes can use: `total` minus driver-reserved memory; the
    /// limit headroom is measured against.
    pub fn usable_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.reserved_bytes)
    }
}

/// A compute process on a GPU, from the slow process list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUsage {
    /// PID as NVML reports it (the host PID namespace); matched against ranks'
    /// PIDs to tell other processes' memory apart.
    pub pid: u32,
    /// Device memory the process holds, bytes; 0 when NVML cannot tell.
    pub used_bytes: u64,
}

/// What makes a device a MIG slice of a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigSlice {
    /// The parent GPU's UUID.
    pub parent_uuid: String,
    /// GPU instance id (dcgm-exporter's `GPU_I_ID`).
    pub gpu_instance_id: u32,
    /// GPU instance profile, e.g. "1g.10gb" (dcgm-exporter's `GPU_I_PROFILE`);
    /// "" when the device's name does not say.
    pub profile: String,
}

/// The profile in a MIG device's NVML name, which drivers write as
/// `"<GPU name> MIG <profile>"` (e.g. "NVIDIA H100 80GB HBM3 MIG 1g.10gb").
pub fn mig_profile_of_name(name: &str) -> &str {
    name.rsplit_once(" MIG ").map_or("", |(_, p)| p.trim())
}

/// What `/metrics` and the API need about one GPU or MIG slice.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSnapshot {
    /// NVML device index on this node (a MIG slice: its GPU's).
    pub index: u32,
    /// NVML UUID ("GPU-…", "MIG-…" for a slice); ranks report it in their
    /// hello to be matched here.
    pub uuid: String,
    /// Set for a MIG slice: its memory is its own, and a rank on it is
    /// judged against that, not the whole GPU's.
    pub mig: Option<MigSlice>,
    /// Product name, e.g. "NVIDIA H100 80GB HBM3"; for labels and display.
    pub name: String,
    /// Device capacity, bytes.
    pub total_bytes: u64,
    /// The latest memory reading; None before the first one succeeds.
    pub last: Option<Sample>,
    /// Maximum `used` over the trailing window.
    pub used_max_bytes: Option<u64>,
    /// Memory readings taken since the agent first found the GPU (kept
    /// across NVML re-initialisations, so it is a true counter).
    pub samples_total: u64,
    /// False while NVML reports the GPU lost, or while its samples are stale.
    pub up: bool,
    /// Seconds since the last good memory read (since the GPU was found, if
    /// none yet), at the snapshot's time.
    pub sample_age_seconds: f64,
    /// The last good read is older than [`SamplerConfig::stale_after`]: an
    /// NVML call hangs, and the figures above are frozen.
    pub stale: bool,
    /// Compute processes from the latest process-list read.
    pub processes: Vec<ProcessUsage>,
    /// (gpu %, memory %) from the last utilisation read.
    pub utilization_percent: Option<(u32, u32)>,
}

/// The sampler's state at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerSnapshot {
    /// Whether NVML is initialised; false means no GPU figures at all.
    pub nvml_up: bool,
    /// Why NVML is not up, in words for logs and `/readyz`.
    pub status: String,
    /// One entry per GPU found, in NVML index order.
    pub gpus: Vec<GpuSnapshot>,
    /// Worst tick lateness over the trailing window, seconds.
    pub lag_max_seconds: f64,
    /// Tick lateness since start, as a cumulative histogram:
    /// `(upper bound in seconds, ticks at most that late)`, bounds ascending
    /// ([`LAG_BUCKETS_SECONDS`]). The `+Inf` bucket is `lag_count`.
    pub lag_histogram: Vec<(f64, u64)>,
    /// Sum of all tick lateness since start, seconds (histogram `_sum`).
    pub lag_sum_seconds: f64,
    /// Ticks observed by the histogram (histogram `_count`).
    pub lag_count: u64,
    /// Sampler ticks since start.
    pub ticks_total: u64,
    /// Ticks that started more than one period late.
    pub late_ticks_total: u64,
    /// Attempts to initialise NVML; rising means the driver keeps failing.
    pub init_attempts_total: u64,
    /// Samples dropped because the tracker did not drain them in time.
    pub pending_dropped_total: u64,
    /// Errors per NVML call class, for `stepwatch_nvml_errors_total{call}`.
    pub errors: Vec<(NvmlCall, u64)>,
}

/// Finite upper bounds of the tick-lateness histogram, seconds.
pub const LAG_BUCKETS_SECONDS: [f64; 15] = [
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 1.0,
];

/// The same bounds in ns, which is what the sampler measures.
const LAG_BUCKETS_NS: [u64; 15] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
];

/// Fixed-bucket histogram of tick lateness: O(1) memory, no allocation.
#[derive(Debug, Clone, Default)]
struct LagHistogram {
    /// Non-cumulative counts; the last slot is above every finite bound.
    counts: [u64; LAG_BUCKETS_NS.len() + 1],
    sum_ns: u64,
    count: u64,
}

impl LagHistogram {
    fn observe(&mut self, lateness_ns: u64) {
        // Bucket `le` bounds are inclusive, as in Prometheus.
        let i = LAG_BUCKETS_NS.partition_point(|&b| b < lateness_ns);
        self.counts[i] += 1;
        self.sum_ns = self.sum_ns.saturating_add(lateness_ns);
        self.count += 1;
    }

    fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut total = 0;
        LAG_BUCKETS_SECONDS
            .iter()
            .zip(&self.counts)
            .map(|(&bound, &n)| {
                total += n;
                (bound, total)
            })
            .collect()
    }
}

impl SamplerSnapshot {
    /// Estimated `q`-quantile (0..=1) of tick lateness since start, seconds,
    /// interpolated linearly within a histogram bucket as Prometheus'
    /// `histogram_quantile` does. None before the first tick; `q` past the
    /// last finite bound gives that bound.
    pub fn lag_quantile_seconds(&self, q: f64) -> Option<f64> {
        if self.lag_count == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.lag_count as f64;
        let mut lower = (0.0, 0u64);
        for &(bound, cumulative) in &self.lag_histogram {
            if cumulative as f64 >= rank {
                let in_bucket = (cumulative - lower.1) as f64;
                if in_bucket == 0.0 {
                    return Some(bound);
                }
                let frac = (rank - lower.1 as f64) / in_bucket;
                return Some(lower.0 + (bound - lower.0) * frac);
            }
            lower = (bound, cumulative);
        }
        Some(lower.0)
    }
}

struct GpuEntry {
    snapshot: GpuSnapshot,
    /// CLOCK_MONOTONIC ns of the last good read, or of the GPU's discovery.
    fresh_ns: u64,
    ring: TimedRing<u64>,
    /// Bounded by `pending_capacity`; the oldest is dropped when full.
    pending: VecDeque<Sample>,
}

struct State {
    nvml_up: bool,
    status: String,
    gpus: Vec<GpuEntry>,
    lag_ring: TimedRing<u64>,
    lag_hist: LagHistogram,
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
    // Set when the thread has ended, so a stop can wait with a bound.
    finished: (Mutex<bool>, Condvar),
}

impl Shared {
    /// Before the first init, with room for `lag_capacity` tick lags.
    fn new(lag_capacity: usize) -> Self {
        Shared {
            state: Mutex::new(State {
                nvml_up: false,
                status: "NVML not initialised yet".into(),
                gpus: Vec::new(),
                lag_ring: TimedRing::new(lag_capacity),
                lag_hist: LagHistogram::default(),
                ticks_total: 0,
                late_ticks_total: 0,
                init_attempts_total: 0,
                pending_dropped_total: 0,
            }),
            errors: Default::default(),
            stop: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
            finished: (Mutex::new(false), Condvar::new()),
        }
    }

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
        let shared = Arc::new(Shared::new(lag_capacity));
        let config = Arc::new(config);
        let thread = {
            let shared = shared.clone();
            let config = config.clone();
            std::thread::Builder::new()
                .name("stepwatch-sampler".into())
                .spawn(move || {
                    let _finished = FinishedOnDrop(shared.clone());
                    run(&shared, &config);
                })
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
        let stale_ns = duration_ns(self.config.stale_after);
        let state = self.shared.lock();
        SamplerSnapshot {
            nvml_up: state.nvml_up,
            status: state.status.clone(),
            gpus: state
                .gpus
                .iter()
                .map(|g| {
                    let age_ns = now_ns.saturating_sub(g.fresh_ns);
                    let stale = age_ns > stale_ns;
                    GpuSnapshot {
                        used_max_bytes: g.ring.max_since(since),
                        up: g.snapshot.up && !stale,
                        sample_age_seconds: age_ns as f64 / 1e9,
                        stale,
                        ..g.snapshot.clone()
                    }
                })
                .collect(),
            lag_max_seconds: state.lag_ring.max_since(since).unwrap_or(0) as f64 / 1e9,
            lag_histogram: state.lag_hist.cumulative(),
            lag_sum_seconds: state.lag_hist.sum_ns as f64 / 1e9,
            lag_count: state.lag_hist.count,
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
        let capacity = self.config.pending_capacity;
        let mut state = self.shared.lock();
        state
            .gpus
            .iter_mut()
            .filter(|g| !g.pending.is_empty())
            .map(|g| {
                // Give the sampler a buffer as large as this drain took, so
                // it does not grow (allocate) on its own thread between drains.
                let room = pending_room(g.pending.len(), capacity);
                let taken = std::mem::replace(&mut g.pending, VecDeque::with_capacity(room));
                (g.snapshot.uuid.clone(), Vec::from(taken))
            })
            .collect()
    }

    /// The UUID under which the sampler knows the device a client names:
    /// `claimed` itself, or a device whose UUID differs only in its `GPU-` /
    /// `MIG-` prefix. PyTorch prints a device's UUID without a prefix, so a
    /// client on a MIG slice may send `GPU-` and the slice's UUID. None when
    /// no device matches (yet).
    pub fn device_uuid(&self, claimed: &str) -> Option<String> {
        let state = self.shared.lock();
        let uuids = || state.gpus.iter().map(|g| g.snapshot.uuid.as_str());
        if let Some(exact) = uuids().find(|u| *u == claimed) {
            return Some(exact.to_owned());
        }
        let bare = |u: &'_ str| -> String {
            u.strip_prefix("GPU-")
                .or_else(|| u.strip_prefix("MIG-"))
                .unwrap_or(u)
                .to_ascii_lowercase()
        };
        let want = bare(claimed);
        uuids().find(|u| bare(u) == want).map(str::to_owned)
    }

    /// Whether NVML answered the last attempt, and the status line that says
    /// why not (what `/readyz` needs, without a whole snapshot).
    pub fn nvml_status(&self) -> (bool, String) {
        let state = self.shared.lock();
        (state.nvml_up, state.status.clone())
    }

    /// Stops the thread and waits for it (NVML is shut down on its way out).
    pub fn stop(&self) {
        self.stop_within(Duration::MAX);
    }

    /// Stops the thread, waiting at most `limit` for it. Returns false when
    /// it did not finish: an NVML call hangs, and nothing can interrupt it.
    /// The thread is then left behind (detached) so that the caller can exit
    /// on time; process exit ends it without `nvmlShutdown`.
    pub fn stop_within(&self, limit: Duration) -> bool {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.wake.1.notify_all();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(thread) = thread else {
            return true;
        };
        let (lock, cvar) = &self.shared.finished;
        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = cvar
            .wait_timeout_while(guard, limit, |finished| !*finished)
            .unwrap_or_else(|e| e.into_inner());
        let finished = *guard;
        drop(guard);
        if finished {
            let _ = thread.join();
        }
        finished
    }
}

/// Sets [`Shared::finished`] when the sampler thread ends, panics included.
struct FinishedOnDrop(Arc<Shared>);

impl Drop for FinishedOnDrop {
    fn drop(&mut self) {
        let (lock, cvar) = &self.0.finished;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cvar.notify_all();
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
    // Counters survive a re-initialisation (NVML lost and back): a counter
    // that dropped to 0 would read as a reset to rate() and hide the outage.
    let counted: Vec<(String, u64)> = shared
        .lock()
        .gpus
        .iter()
        .map(|g| (g.snapshot.uuid.clone(), g.snapshot.samples_total))
        .collect();
    let mut found: Vec<(u32, Device<'_>, Option<MigSlice>)> = Vec::new();
    for index in 0..count {
        let device = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                shared.count_error(NvmlCall::DeviceHandle);
                tracing::warn!(gpu = index, error = %e, "skipping a GPU NVML cannot open");
                continue;
            }
        };
        let slices = mig_devices(shared, nvml, &device, index);
        found.push((index, device, None));
        found.extend(slices.into_iter().map(|(d, m)| (index, d, Some(m))));
    }
    for (index, device, mig) in found {
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
        let samples_total = counted
            .iter()
            .find(|(u, _)| *u == uuid)
            .map_or(0, |&(_, n)| n);
        entries.push(GpuEntry {
            fresh_ns: monotonic_ns(),
            snapshot: GpuSnapshot {
                index,
                uuid,
                mig,
                name,
                total_bytes,
                last: None,
                used_max_bytes: None,
                samples_total,
                up: true,
                sample_age_seconds: 0.0,
                stale: false,
                processes: Vec::new(),
                utilization_percent: None,
            },
            ring: TimedRing::new(ring_capacity),
            pending: VecDeque::with_capacity(pending_room(0, config.pending_capacity)),
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

    let interval_ns = duration_ns(config.memory_interval).max(1);
    let process_ns = duration_ns(config.process_interval);
    let pending_capacity = config.pending_capacity;
    let mut origin = monotonic_ns();
    let mut tick: u64 = 0;
    let mut next_slow = origin;
    // Per device: while NVML reports it lost, when to try it again. A lost
    // GPU is read once per process interval, not at the memory rate, so it
    // costs (and counts as an error) once a second rather than 100 times.
    let mut lost_retry_at: Vec<Option<u64>> = vec![None; devices.len()];
    // Reused every tick: None = a lost GPU not read this tick.
    let mut readings: Vec<Option<Result<Sample, NvmlError>>> = Vec::with_capacity(devices.len());
    let mut slow: Vec<Option<SlowReading>> = Vec::with_capacity(devices.len());
    loop {
        let deadline = origin.saturating_add(interval_ns.saturating_mul(tick));
        if sleep_until(shared, deadline, interval_ns) {
            return None;
        }
        // The first device's timestamp doubles as the tick's start.
        let started = monotonic_ns();
        let lateness = started.saturating_sub(deadline);
        let slow_due = started >= next_slow;

        readings.clear();
        let mut attempted = 0usize;
        for (device, retry_at) in devices.iter().zip(&lost_retry_at) {
            if retry_at.is_some_and(|at| started < at) {
                readings.push(None);
                continue;
            }
            let at = if attempted == 0 {
                started
            } else {
                monotonic_ns()
            };
            attempted += 1;
            readings.push(Some(device.memory_info().map(|m| Sample {
                monotonic_ns: at,
                used_bytes: m.used,
                free_bytes: m.free,
                total_bytes: m.total,
                reserved_bytes: m.reserved,
            })));
        }
        slow.clear();
        if slow_due {
            next_slow = started.saturating_add(process_ns);
            slow.extend(devices.iter().map(|d| read_slow(shared, d)));
        }

        let mut gone = None;
        let mut failures = 0usize;
        {
            let mut state = shared.lock();
            let state = &mut *state;
            state.ticks_total += 1;
            state.lag_ring.push(started, lateness);
            state.lag_hist.observe(lateness);
            if lateness > interval_ns {
                state.late_ticks_total += 1;
            }
            let mut dropped = 0;
            for (i, (entry, reading)) in state.gpus.iter_mut().zip(readings.drain(..)).enumerate() {
                match reading {
                    // A lost GPU not due for a retry: it stays down.
                    None => {}
                    Some(Ok(sample)) => {
                        lost_retry_at[i] = None;
                        entry.fresh_ns = sample.monotonic_ns;
                        entry.snapshot.up = true;
                        entry.snapshot.samples_total += 1;
                        entry.snapshot.last = Some(sample);
                        entry.snapshot.total_bytes = sample.total_bytes;
                        entry.ring.push(sample.monotonic_ns, sample.used_bytes);
                        if entry.pending.len() >= pending_capacity {
                            entry.pending.pop_front();
                            dropped += 1;
                        }
                        if pending_capacity > 0 {
                            entry.pending.push_back(sample);
                        }
                    }
                    Some(Err(e)) => {
                        failures += 1;
                        shared.count_error(NvmlCall::MemoryInfo);
                        if matches!(e, NvmlError::GpuLost) {
                            if entry.snapshot.up {
                                tracing::error!(gpu = entry.snapshot.index, uuid = %entry.snapshot.uuid, "GPU lost; other GPUs keep being sampled");
                            }
                            entry.snapshot.up = false;
                            lost_retry_at[i] = Some(started.saturating_add(process_ns));
                        } else {
                            lost_retry_at[i] = None;
                        }
                        if nvml_gone(&e) {
                            gone = Some(format!("NVML stopped answering: {e}"));
                        }
                    }
                }
                if let Some((procs, util)) = slow.get_mut(i).and_then(Option::take) {
                    entry.snapshot.processes = procs;
                    entry.snapshot.utilization_percent = util;
                }
            }
            state.pending_dropped_total += dropped;
        }
        // NVML is gone when every read made this tick failed that way (GPUs
        // skipped as lost were failing already).
        if let Some(why) = gone.filter(|_| failures == attempted) {
            return Some(why);
        }

        tick += 1;
        // Fallen far behind (a stalled driver call): start a new schedule
        // rather than firing a burst of catch-up reads.
        if lateness > interval_ns.saturating_mul(4) {
            origin = monotonic_ns();
            tick = 0;
        }
    }
}

/// The MIG devices of GPU `index`, with what makes each a slice; none when
/// MIG mode is off or NVML cannot say (a driver without MIG calls). Read once
/// per NVML session: a MIG layout changes only with no process on the GPU,
/// and the GPU Operator evicts the agent for it (paused-for-mig-change).
fn mig_devices<'n>(
    shared: &Shared,
    nvml: &'n Nvml,
    device: &Device<'n>,
    index: u32,
) -> Vec<(Device<'n>, MigSlice)> {
    // NVML_DEVICE_MIG_ENABLE.
    const MIG_ENABLED: u32 = 1;
    let failed = |what: &str, e: &NvmlError| {
        shared.count_error(NvmlCall::Mig);
        tracing::warn!(gpu = index, error = %e, "{what}; its MIG slices are not sampled");
    };
    match device.mig_mode() {
        Ok(mode) if mode.current == MIG_ENABLED => {}
        // No MIG on this GPU or driver: a whole GPU.
        Ok(_) | Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => {
            return Vec::new()
        }
        Err(e) => {
            failed("MIG mode unreadable", &e);
            return Vec::new();
        }
    }
    let max = match device.mig_device_count() {
        Ok(n) => n,
        Err(e) => {
            failed("MIG device count unreadable", &e);
            return Vec::new();
        }
    };
    let parent_uuid = device.uuid().unwrap_or_default();
    let mut slices = Vec::new();
    for i in 0..max {
        let mig = match device.mig_device_by_index(i) {
            Ok(d) => d,
            // An index with no instance on it.
            Err(NvmlError::NotFound) => continue,
            Err(e) => {
                failed("a MIG device handle failed", &e);
                continue;
            }
        };
        let gpu_instance_id = match gpu_instance_id(nvml, &mig) {
            Ok(id) => id,
            Err(e) => {
                failed("a MIG device's GPU instance id is unreadable", &e);
                continue;
            }
        };
        let profile = mig
            .name()
            .map(|n| mig_profile_of_name(&n).to_owned())
            .unwrap_or_default();
        slices.push((
            mig,
            MigSlice {
                parent_uuid: parent_uuid.clone(),
                gpu_instance_id,
                profile,
            },
        ));
    }
    slices
}

/// `nvmlDeviceGetGpuInstanceId`, which nvml-wrapper does not wrap.
fn gpu_instance_id(nvml: &Nvml, device: &Device<'_>) -> Result<u32, NvmlError> {
    let sym = nvml
        .lib()
        .nvmlDeviceGetGpuInstanceId
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let mut id = 0;
    // SAFETY: a live handle of this NVML session and a valid out pointer, as
    // the C signature `(nvmlDevice_t, unsigned int *)` asks.
    let rc = unsafe { sym(device.handle(), &mut id) };
    nvml_wrapper::error::nvml_try(rc)?;
    Ok(id)
}

/// A process list and utilisation reading; None when the list failed.
type SlowReading = (Vec<ProcessUsage>, Option<(u32, u32)>);

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Room for the next batch of pending samples, given the last drain's size.
fn pending_room(last_drain: usize, capacity: usize) -> usize {
    last_drain.max(16).min(capacity)
}

/// Longest single tick sleep; a stop request waits at most this long even
/// when the memory interval is longer.
const STOP_POLL_NS: u64 = 100_000_000;

/// Sleeps until CLOCK_MONOTONIC reaches `deadline_ns` (at once if it has
/// passed), returning true when stop was requested. With an interval of at
/// most [`STOP_POLL_NS`] this is one `clock_nanosleep(TIMER_ABSTIME)` call:
/// no lock, no clock read, no drift.
fn sleep_until(shared: &Shared, deadline_ns: u64, interval_ns: u64) -> bool {
    if interval_ns <= STOP_POLL_NS {
        sleep_until_abs(deadline_ns);
    } else {
        loop {
            if shared.stop.load(Ordering::Relaxed) {
                return true;
            }
            let now = monotonic_ns();
            if now >= deadline_ns {
                break;
            }
            sleep_until_abs(deadline_ns.min(now.saturating_add(STOP_POLL_NS)));
        }
    }
    shared.stop.load(Ordering::Relaxed)
}

#[cfg(target_os = "linux")]
fn sleep_until_abs(deadline_ns: u64) {
    let request = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000).min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as _,
    };
    // SAFETY: `request` is a valid timespec; with TIMER_ABSTIME `remain` is
    // unused and may be null. An absolute deadline makes EINTR retries exact.
    // clock_nanosleep returns the error number rather than setting errno.
    while unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &request,
            std::ptr::null_mut(),
        )
    } == libc::EINTR
    {}
}

#[cfg(not(target_os = "linux"))]
fn sleep_until_abs(deadline_ns: u64) {
    let now = monotonic_ns();
    if deadline_ns > now {
        std::thread::sleep(Duration::from_nanos(deadline_ns - now));
    }
}

fn read_slow(shared: &Shared, device: &Device<'_>) -> Option<SlowReading> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot_with(hist: &LagHistogram) -> SamplerSnapshot {
        SamplerSnapshot {
            nvml_up: true,
            status: String::new(),
            gpus: Vec::new(),
            lag_max_seconds: 0.0,
            lag_histogram: hist.cumulative(),
            lag_sum_seconds: hist.sum_ns as f64 / 1e9,
            lag_count: hist.count,
            ticks_total: hist.count,
            late_ticks_total: 0,
            init_attempts_total: 0,
            pending_dropped_total: 0,
            errors: Vec::new(),
        }
    }

    #[test]
    fn the_profile_is_read_from_a_mig_device_name() {
        assert_eq!(
            mig_profile_of_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb"),
            "1g.10gb"
        );
        assert_eq!(
            mig_profile_of_name("NVIDIA A100-SXM4-40GB MIG 3g.20gb"),
            "3g.20gb"
        );
        assert_eq!(mig_profile_of_name("NVIDIA H100 80GB HBM3"), "");
    }

    #[test]
    fn bucket_bounds_agree_in_both_units() {
        for (s, ns) in LAG_BUCKETS_SECONDS.iter().zip(LAG_BUCKETS_NS) {
            assert_eq!((s * 1e9).round() as u64, ns);
        }
        assert!(LAG_BUCKETS_NS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn histogram_buckets_are_inclusive_cumulative_and_count_overflow() {
        let mut h = LagHistogram::default();
        h.observe(0);
        h.observe(10_000); // exactly on the first bound: in it
        h.observe(10_001);
        h.observe(1_000_000);
        h.observe(5_000_000_000); // above every finite bound
        let c = h.cumulative();
        assert_eq!(c.len(), LAG_BUCKETS_SECONDS.len());
        assert_eq!(c[0], (0.00001, 2));
        assert_eq!(c[1], (0.000025, 3));
        assert_eq!(c[6], (0.001, 4));
        assert_eq!(c.last().unwrap(), &(1.0, 4));
        assert_eq!(h.count, 5);
        assert_eq!(h.sum_ns, 5_001_020_001);
        assert!(c.windows(2).all(|w| w[0].1 <= w[1].1));
    }

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let mut h = LagHistogram::default();
        assert_eq!(snapshot_with(&h).lag_quantile_seconds(0.5), None);
        // 100 ticks, 99 of them in (50 us, 100 us], one in (1 ms, 2.5 ms].
        for _ in 0..99 {
            h.observe(80_000);
        }
        h.observe(2_000_000);
        let snap = snapshot_with(&h);
        let p50 = snap.lag_quantile_seconds(0.5).unwrap();
        assert!(
            (p50 - (0.00005 + 0.00005 * 50.0 / 99.0)).abs() < 1e-12,
            "{p50}"
        );
        let p99 = snap.lag_quantile_seconds(0.99).unwrap();
        assert!((p99 - 0.0001).abs() < 1e-12, "{p99}");
        let max = snap.lag_quantile_seconds(1.0).unwrap();
        assert!((max - 0.0025).abs() < 1e-12, "{max}");
        // Past the last finite bound: the bound.
        h.observe(10_000_000_000);
        assert_eq!(snapshot_with(&h).lag_quantile_seconds(1.0), Some(1.0));
    }

    #[test]
    fn pending_room_follows_the_last_drain_within_bounds() {
        assert_eq!(pending_room(0, 4096), 16);
        assert_eq!(pending_room(100, 4096), 100);
        assert_eq!(pending_room(10_000, 4096), 4096);
        assert_eq!(pending_room(5, 0), 0);
    }

    #[test]
    fn sleep_until_waits_for_an_absolute_deadline() {
        let shared = Shared::new(1);
        let start = monotonic_ns();
        assert!(!sleep_until(&shared, start + 20_000_000, 10_000_000));
        assert!(monotonic_ns() >= start + 20_000_000);
        // A deadline in the past returns at once.
        let t = monotonic_ns();
        assert!(!sleep_until(&shared, start, 10_000_000));
        assert!(monotonic_ns() - t < 5_000_000);
        // Long intervals sleep in slices and notice stop.
        shared.stop.store(true, Ordering::Relaxed);
        let t = monotonic_ns();
        assert!(sleep_until(&shared, t + 10_000_000_000, 10_000_000_000));
        assert!(monotonic_ns() - t < 1_000_000_000);
    }
}
