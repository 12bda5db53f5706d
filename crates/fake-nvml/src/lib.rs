//! A test double for `libnvidia-ml.so.1`.
//!
//! The agent's only way to see GPU memory is NVML, and CI machines have no GPU. Rather
//! than mock the agent's sampler (which would leave its real NVML code path untested),
//! this crate builds a `cdylib` that exports the NVML C functions nvml-wrapper and pynvml
//! call, and answers them from a small shared-memory *state file*. Tests, the demo and
//! simulated trainers write that file through the Rust API in this crate ([`FakeNvml`]);
//! the agent reads it through the very same nvml-wrapper calls it makes on a real node.
//!
//! * State lives in `$STEPWATCH_FAKE_NVML_DIR/state.bin` (see [`STATE_DIR_ENV`]), a
//!   fixed-layout `#[repr(C)]` file ([`layout`]) mapped with `MAP_SHARED`. Every mutable
//!   field is an atomic, so any number of processes write and read it live without locks,
//!   and an NVML call costs about as much as a few cache-line reads.
//! * Faults are switches in the same file: the whole "driver" unavailable, one GPU lost,
//!   one class of call failing with a chosen NVML code, or one class of call made slow.
//!
//! The C entry points live in the private `capi` module; they read the environment and map
//! the file only in `nvmlInit*`, never per call.

#![warn(missing_docs)]

mod capi;
pub mod layout;

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::time::Duration;

use layout::{
    put_cstr, Gpu, State, LAYOUT_VERSION, MAGIC, MAX_GPUS, MAX_MIG_DEVICES, NO_PARENT, STATE_SIZE,
};

/// Environment variable naming the directory that holds `state.bin`.
///
/// The cdylib reads it once, in `nvmlInit*` when no mapping is held yet. It is an
/// environment variable (not a compile-time path) so that each test, demo or CI job can
/// give its agent a private world, and so pynvml users need nothing but `LD_LIBRARY_PATH`.
pub const STATE_DIR_ENV: &str = "STEPWATCH_FAKE_NVML_DIR";

/// File name of the state file inside the [`STATE_DIR_ENV`] directory.
pub const STATE_FILE: &str = "state.bin";

/// The soname NVML users `dlopen`; [`install_soname_link`] creates a symlink by this name.
pub const NVML_SONAME: &str = "libnvidia-ml.so.1";

/// Driver version reported by `nvmlSystemGetDriverVersion`.
///
/// A recent H100/H200 production branch, so nvml-wrapper picks its current field-ID scheme.
pub const DRIVER_VERSION: &str = "580.95.05";

/// NVML version reported by `nvmlSystemGetNVMLVersion` (CUDA major + driver version).
pub const NVML_VERSION: &str = "13.580.95.05";

/// Driver-reserved memory each GPU starts with, reported as v2 `reserved`.
///
/// Non-zero on purpose: real drivers reserve a few hundred MiB, and v1 `used` counts it
/// while v2 `used` does not (NVML-NOTES). A non-zero figure lets tests prove the agent
/// reads v2. Change it per GPU with [`FakeNvml::set_reserved_bytes`].
pub const DEFAULT_RESERVED_BYTES: u64 = 512 << 20;

/// One GPU to create in a fresh state file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSpec {
    /// Product name, as `nvmlDeviceGetName` reports it (at most 95 bytes are kept).
    pub name: String,
    /// `GPU-xxxxxxxx-...` identifier, as `nvmlDeviceGetUUID` reports it.
    pub uuid: String,
    /// Framebuffer size in bytes (`total` in both memory-info versions).
    pub total_bytes: u64,
}

impl GpuSpec {
    /// An H100 80GB HBM3 as a real one reports itself: 81559 MiB total.
    ///
    /// The UUID is derived from `index` (`GPU-00000000-0000-0000-0000-00000000000N`, last
    /// group in hex) so tests and fixtures can name GPUs without reading them back.
    pub fn h100_80gb(index: u32) -> Self {
        GpuSpec {
            name: "NVIDIA H100 80GB HBM3".to_string(),
            uuid: format!("GPU-00000000-0000-0000-0000-{index:012x}"),
            total_bytes: 81559 << 20,
        }
    }
}

/// One MIG device (a GPU instance with one compute instance) to create on a GPU, which
/// then reports MIG mode on. Its NVML name is the parent's name followed by
/// ` MIG <profile>`, as real drivers name MIG devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigSpec {
    /// The physical GPU it is carved from (its position in the `gpus` given to create).
    pub parent: u32,
    /// The GPU instance profile, e.g. `1g.10gb`.
    pub profile: String,
    /// `MIG-xxxxxxxx-...` identifier, as `nvmlDeviceGetUUID` reports it.
    pub uuid: String,
    /// GPU instance id (`GPU_I_ID` in dcgm-exporter's labels).
    pub gpu_instance_id: u32,
    /// Compute instance id.
    pub compute_instance_id: u32,
    /// The instance's own memory, bytes: `total` of its memory info.
    pub total_bytes: u64,
}

impl MigSpec {
    /// A `1g.10gb` slice of an H100 80GB, GPU instance `gpu_instance_id`: 9,984 MiB of its
    /// own (about what the profile gives; not read from a real GPU). UUID
    /// `MIG-00000000-0000-0000-PPPP-00000000GGGG` (parent, instance id in hex).
    pub fn h100_1g_10gb(parent: u32, gpu_instance_id: u32) -> Self {
        MigSpec {
            parent,
            profile: "1g.10gb".to_string(),
            uuid: format!("MIG-00000000-0000-0000-{parent:04x}-{gpu_instance_id:012x}"),
            gpu_instance_id,
            compute_instance_id: 0,
            total_bytes: 9984 << 20,
        }
    }
}

/// A class of NVML calls, for [`FakeNvml::set_call_failure`] and [`FakeNvml::set_call_delay`].
///
/// Classes rather than single symbols, because a test cares that "the memory read fails",
/// not whether the agent happened to use `nvmlDeviceGetMemoryInfo` or `_v2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Call {
    /// `nvmlInit`, `nvmlInit_v2`, `nvmlInitWithFlags`.
    Init = 0,
    /// `nvmlDeviceGetCount`, `nvmlDeviceGetCount_v2`.
    Count = 1,
    /// `nvmlDeviceGetHandleByIndex(_v2)`, `nvmlDeviceGetHandleByUUID`, `nvmlDeviceGetIndex`.
    Handle = 2,
    /// `nvmlDeviceGetName`.
    Name = 3,
    /// `nvmlDeviceGetUUID`.
    Uuid = 4,
    /// `nvmlDeviceGetMemoryInfo`, `nvmlDeviceGetMemoryInfo_v2`.
    MemoryInfo = 5,
    /// `nvmlDeviceGetUtilizationRates`.
    Utilization = 6,
    /// `nvmlDeviceGet{Compute,Graphics}RunningProcesses{,_v2,_v3}`.
    Processes = 7,
    /// `nvmlSystemGetDriverVersion`, `nvmlSystemGetNVMLVersion`.
    DriverVersion = 8,
    /// `nvmlDeviceGetMigMode`, `nvmlDeviceGetMaxMigDeviceCount`,
    /// `nvmlDeviceGetMigDeviceHandleByIndex`, `nvmlDeviceIsMigDeviceHandle`,
    /// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`, `nvmlDeviceGet{Gpu,Compute}InstanceId`.
    Mig = 9,
}

impl Call {
    /// Every call class, for tests and for clearing all switches.
    pub const ALL: [Call; 10] = [
        Call::Init,
        Call::Count,
        Call::Handle,
        Call::Name,
        Call::Uuid,
        Call::MemoryInfo,
        Call::Utilization,
        Call::Processes,
        Call::DriverVersion,
        Call::Mig,
    ];
}

/// NVML return codes this crate produces; the values are NVML's own (`nvml.h`).
pub mod codes {
    /// `NVML_SUCCESS`.
    pub const SUCCESS: u32 = 0;
    /// `NVML_ERROR_UNINITIALIZED`: a call before init, or on a live handle while the
    /// `unavailable` switch is on.
    pub const UNINITIALIZED: u32 = 1;
    /// `NVML_ERROR_INVALID_ARGUMENT`.
    pub const INVALID_ARGUMENT: u32 = 2;
    /// `NVML_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: u32 = 3;
    /// `NVML_ERROR_NOT_FOUND`.
    pub const NOT_FOUND: u32 = 6;
    /// `NVML_ERROR_INSUFFICIENT_SIZE`.
    pub const INSUFFICIENT_SIZE: u32 = 7;
    /// `NVML_ERROR_DRIVER_NOT_LOADED`: init while the `unavailable` switch is on.
    pub const DRIVER_NOT_LOADED: u32 = 9;
    /// `NVML_ERROR_TIMEOUT`.
    pub const TIMEOUT: u32 = 10;
    /// `NVML_ERROR_LIBRARY_NOT_FOUND`: init with the env var unset or the state unreadable.
    pub const LIBRARY_NOT_FOUND: u32 = 12;
    /// `NVML_ERROR_GPU_IS_LOST`: any call on a GPU whose `lost` switch is on.
    pub const GPU_IS_LOST: u32 = 15;
    /// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`: a versioned struct with the wrong version.
    pub const ARGUMENT_VERSION_MISMATCH: u32 = 25;
    /// `NVML_ERROR_UNKNOWN`.
    pub const UNKNOWN: u32 = 999;
}

/// A shared, writable mapping of one state file. Unmapped on drop.
pub(crate) struct Mapping {
    ptr: NonNull<State>,
    dev: u64,
    ino: u64,
}

// SAFETY: every field of `State` that anyone mutates after creation is an atomic; the rest
// is written before the file is published (renamed into place) and only read afterwards.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len == STATE_SIZE` bytes of an open file, read-write and shared.
    fn map(file: &fs::File) -> io::Result<Mapping> {
        let meta = file.metadata()?;
        if meta.len() < STATE_SIZE as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "fake-nvml state is {} bytes, expected {STATE_SIZE}",
                    meta.len()
                ),
            ));
        }
        // SAFETY: a fresh mapping of a file we hold open; checked for MAP_FAILED below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                STATE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast::<State>()).expect("mmap returned NULL"),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// Opens and maps `path`, refusing files that are not a state of this layout version.
    pub(crate) fn open(path: &Path) -> io::Result<Mapping> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let m = Mapping::map(&file)?;
        let h = &m.state().header;
        if h.magic != MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: not a fake-nvml state file", path.display()),
            ));
        }
        if h.layout_version != LAYOUT_VERSION {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: layout version {}, this build reads {LAYOUT_VERSION}",
                    path.display(),
                    h.layout_version
                ),
            ));
        }
        if h.gpu_count as usize > MAX_GPUS || h.mig_count as usize > MAX_MIG_DEVICES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: {} GPUs and {} MIG devices, at most {MAX_GPUS} and {MAX_MIG_DEVICES}",
                    path.display(),
                    h.gpu_count,
                    h.mig_count
                ),
            ));
        }
        Ok(m)
    }

    pub(crate) fn state(&self) -> &State {
        // SAFETY: the mapping is STATE_SIZE bytes, page-aligned, and lives as long as self.
        unsafe { self.ptr.as_ref() }
    }

    pub(crate) fn identity(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped; no references outlive `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), STATE_SIZE);
        }
    }
}

/// A handle on one state file: create the fake node, then drive it while the agent reads.
///
/// Any number of `FakeNvml` values, in any number of processes, may map the same file; each
/// sees the others' writes at once (the mapping is `MAP_SHARED` and every field is atomic).
pub struct FakeNvml {
    map: Mapping,
    dir: PathBuf,
}

impl std::fmt::Debug for FakeNvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeNvml")
            .field("dir", &self.dir)
            .field("gpu_count", &self.gpu_count())
            .finish()
    }
}

impl FakeNvml {
    /// Creates `dir` (and parents) and a fresh `state.bin` describing `gpus`.
    ///
    /// The file is built under a temporary name and renamed into place, so a process that
    /// already maps an older `state.bin` keeps its (old) view intact instead of reading a
    /// half-written file or faulting on a truncated one; it sees the new world after its
    /// next first `nvmlInit`. Each GPU starts with no processes, 0 base usage, 0%
    /// utilisation, [`DEFAULT_RESERVED_BYTES`] reserved, and no faults.
    ///
    /// Errors: more than [`MAX_GPUS`] GPUs (`InvalidInput`), or any I/O failure.
    pub fn create(dir: &Path, gpus: &[GpuSpec]) -> io::Result<Self> {
        Self::create_with_mig(dir, gpus, &[])
    }

    /// [`FakeNvml::create`] with MIG devices: each GPU named as a parent reports MIG mode
    /// on, and its MIG devices are device numbers `gpus.len()..` of this API, in the order
    /// given ([`FakeNvml::mig_device`] finds them).
    ///
    /// Errors (`InvalidInput`): more than [`MAX_GPUS`] GPUs or [`MAX_MIG_DEVICES`] MIG
    /// devices, a parent out of range, or MIG devices on one GPU whose memory adds up to
    /// more than the GPU's.
    pub fn create_with_mig(dir: &Path, gpus: &[GpuSpec], migs: &[MigSpec]) -> io::Result<Self> {
        let invalid = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
        if gpus.len() > MAX_GPUS {
            return invalid(format!("{} GPUs requested, at most {MAX_GPUS}", gpus.len()));
        }
        if migs.len() > MAX_MIG_DEVICES {
            return invalid(format!(
                "{} MIG devices requested, at most {MAX_MIG_DEVICES}",
                migs.len()
            ));
        }
        for (i, spec) in gpus.iter().enumerate() {
            let carved: u64 = migs
                .iter()
                .filter(|m| m.parent as usize == i)
                .map(|m| m.total_bytes)
                .sum();
            if carved > spec.total_bytes {
                return invalid(format!(
                    "MIG devices on GPU {i} hold {carved} bytes, more than its {}",
                    spec.total_bytes
                ));
            }
        }
        if let Some(m) = migs.iter().find(|m| m.parent as usize >= gpus.len()) {
            return invalid(format!(
                "MIG device {} on GPU {}, which is not there",
                m.uuid, m.parent
            ));
        }
        fs::create_dir_all(dir)?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let tmp = dir.join(format!(".{STATE_FILE}.{}.{nanos}.tmp", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        let result = (|| {
            file.set_len(STATE_SIZE as u64)?;
            let map = Mapping::map(&file)?;
            // SAFETY: the file is brand new and not yet visible under its final name, so
            // nobody else maps it; the zero-filled bytes are a valid `State` (all fields
            // are integers or atomics), and we are the only writer.
            let st = unsafe { &mut *map.ptr.as_ptr() };
            st.header.layout_version = LAYOUT_VERSION;
            st.header.gpu_count = gpus.len() as u32;
            put_cstr(&mut st.header.driver_version, DRIVER_VERSION);
            put_cstr(&mut st.header.nvml_version, NVML_VERSION);
            st.header.mig_count = migs.len() as u32;
            for (i, (spec, g)) in gpus.iter().zip(st.gpus.iter_mut()).enumerate() {
                put_cstr(&mut g.name, &spec.name);
                put_cstr(&mut g.uuid, &spec.uuid);
                g.index = i as u32;
                g.parent = NO_PARENT;
                g.mig_mode = migs.iter().any(|m| m.parent as usize == i) as u32;
                g.total_bytes.store(spec.total_bytes, Ordering::Relaxed);
                g.reserved_bytes
                    .store(DEFAULT_RESERVED_BYTES, Ordering::Relaxed);
            }
            for (k, spec) in migs.iter().enumerate() {
                let index = gpus.len() + k;
                let mig_index = migs[..k].iter().filter(|m| m.parent == spec.parent).count();
                let name = format!("{} MIG {}", gpus[spec.parent as usize].name, spec.profile);
                let g = &mut st.gpus[index];
                put_cstr(&mut g.name, &name);
                put_cstr(&mut g.uuid, &spec.uuid);
                g.index = index as u32;
                g.parent = spec.parent;
                g.mig_index = mig_index as u32;
                g.gpu_instance_id = spec.gpu_instance_id;
                g.compute_instance_id = spec.compute_instance_id;
                g.total_bytes.store(spec.total_bytes, Ordering::Relaxed);
                // What a MIG device reports as driver-reserved is unknown here; none.
                g.reserved_bytes.store(0, Ordering::Relaxed);
            }
            // Magic last: a file with a valid magic is a complete file.
            st.header.magic = MAGIC;
            fs::rename(&tmp, dir.join(STATE_FILE))?;
            Ok(map)
        })();
        match result {
            Ok(map) => Ok(FakeNvml {
                map,
                dir: dir.to_path_buf(),
            }),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Maps the existing `dir/state.bin`, e.g. from a simulated trainer process.
    ///
    /// Errors: the file is missing or is not a state file of this layout version.
    pub fn open(dir: &Path) -> io::Result<Self> {
        let map = Mapping::open(&dir.join(STATE_FILE))?;
        Ok(FakeNvml {
            map,
            dir: dir.to_path_buf(),
        })
    }

    /// [`FakeNvml::open`] on the directory named by [`STATE_DIR_ENV`], the one the agent
    /// under test reads; `NotFound` if the variable is unset.
    pub fn open_from_env() -> io::Result<Self> {
        let dir = std::env::var_os(STATE_DIR_ENV).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{STATE_DIR_ENV} is not set"),
            )
        })?;
        Self::open(Path::new(&dir))
    }

    /// The state directory: what to put in [`STATE_DIR_ENV`] for the agent.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn state(&self) -> &State {
        self.map.state()
    }

    /// The GPU entry, or a panic naming the bad index: an out-of-range GPU in a test is a
    /// bug in the test, and a loud failure beats a silent no-op.
    fn gpu(&self, gpu: u32) -> &Gpu {
        self.try_gpu(gpu).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_gpu(&self, gpu: u32) -> io::Result<&Gpu> {
        let devices = self.state().devices();
        devices.get(gpu as usize).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "fake-nvml: GPU {gpu} out of range (state has {} devices)",
                    devices.len()
                ),
            )
        })
    }

    /// Number of GPUs in the state (what `nvmlDeviceGetCount` reports; MIG devices are
    /// not counted, as in NVML).
    pub fn gpu_count(&self) -> u32 {
        self.state().header.gpu_count
    }

    /// GPUs and MIG devices: the device numbers the per-GPU methods take are
    /// `0..device_count()`, the MIG devices after the GPUs.
    pub fn device_count(&self) -> u32 {
        self.state().devices().len() as u32
    }

    /// The device number of MIG device `mig_index` on GPU `gpu`, for the per-GPU methods
    /// (`set_process_memory`, `device_used_bytes`, ...); None when there is none.
    pub fn mig_device(&self, gpu: u32, mig_index: u32) -> Option<u32> {
        self.state()
            .migs_of(gpu)
            .find(|m| m.mig_index == mig_index)
            .map(|m| m.index)
    }

    /// The GPU's UUID string. Panics if `gpu` is out of range.
    pub fn gpu_uuid(&self, gpu: u32) -> String {
        String::from_utf8_lossy(layout::cstr_bytes(&self.gpu(gpu).uuid)).into_owned()
    }

    /// The GPU's product name. Panics if `gpu` is out of range.
    pub fn gpu_name(&self, gpu: u32) -> String {
        String::from_utf8_lossy(layout::cstr_bytes(&self.gpu(gpu).name)).into_owned()
    }

    /// The GPU's framebuffer size in bytes. Panics if `gpu` is out of range.
    pub fn total_bytes(&self, gpu: u32) -> u64 {
        self.gpu(gpu).total_bytes.load(Ordering::Relaxed)
    }

    /// Sets (claiming a slot if needed) how many bytes process `pid` uses on `gpu`.
    ///
    /// The process then appears in `nvmlDeviceGetComputeRunningProcesses*` and its bytes
    /// count in the device's `used`. A new pid claims a free slot by compare-and-swap on
    /// the slot's pid (0 = free), so writers in different processes never take the same
    /// slot. One writer per `(gpu, pid)` is assumed: two threads racing to add the *same*
    /// new pid could each claim a slot.
    ///
    /// Errors: `gpu` out of range or `pid == 0` (`InvalidInput`); all
    /// [`layout::MAX_PROCS`] slots taken by other pids (`StorageFull`).
    pub fn set_process_memory(&self, gpu: u32, pid: u32, bytes: u64) -> io::Result<()> {
        if pid == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "fake-nvml: pid 0 marks a free slot and cannot be used",
            ));
        }
        if self.try_gpu(gpu)?.set_process_bytes(pid, bytes) {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::StorageFull,
            format!(
                "fake-nvml: all {} process slots on GPU {gpu} are taken",
                layout::MAX_PROCS
            ),
        ))
    }

    /// Frees `pid`'s slot on `gpu` (a no-op if it has none; see [`Gpu::release_process`]).
    /// Panics if `gpu` is out of range.
    pub fn remove_process(&self, gpu: u32, pid: u32) {
        if pid == 0 {
            return;
        }
        self.gpu(gpu).release_process(pid);
    }

    /// Frees the slots of every process that no longer exists, on every GPU; returns how
    /// many slots were freed.
    ///
    /// A simulated trainer that dies (as a real one does on a CUDA OOM) cannot clean up
    /// after itself; this plays the driver's part of releasing a dead process's memory.
    /// "Dead" means `kill(pid, 0)` fails with `ESRCH`, so pids of other users' live
    /// processes (`EPERM`) are kept.
    pub fn remove_dead_processes(&self) -> usize {
        let mut freed = 0;
        for g in self.state().devices() {
            for s in &g.slots {
                let pid = s.pid.load(Ordering::Acquire);
                if pid == 0 || pid > i32::MAX as u32 {
                    continue;
                }
                // SAFETY: signal 0 only checks that the process exists.
                let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
                if rc == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
                    g.store_slot_bytes(s, 0);
                    if s.pid
                        .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                    {
                        freed += 1;
                    }
                }
            }
        }
        freed
    }

    /// The `(pid, used_bytes)` of every claimed slot on `gpu`, in slot order: what
    /// `nvmlDeviceGetComputeRunningProcesses*` would report. Panics if `gpu` is out of range.
    pub fn processes(&self, gpu: u32) -> Vec<(u32, u64)> {
        self.gpu(gpu)
            .slots
            .iter()
            .filter_map(|s| {
                let pid = s.pid.load(Ordering::Acquire);
                (pid != 0).then(|| (pid, s.used_bytes.load(Ordering::Acquire)))
            })
            .collect()
    }

    /// Sets the GPU's usage that belongs to no process (context overhead of other users,
    /// driver allocations); counted in v2 `used`. Panics if `gpu` is out of range.
    pub fn set_base_used(&self, gpu: u32, bytes: u64) {
        self.gpu(gpu)
            .base_used_bytes
            .store(bytes, Ordering::Relaxed);
    }

    /// Sets v2 `reserved` (default [`DEFAULT_RESERVED_BYTES`]); v1 `used` includes it, v2
    /// `used` does not, and `free` excludes it in both. Panics if `gpu` is out of range.
    pub fn set_reserved_bytes(&self, gpu: u32, bytes: u64) {
        self.gpu(gpu).reserved_bytes.store(bytes, Ordering::Relaxed);
    }

    /// The GPU's v2 `reserved` figure. Panics if `gpu` is out of range.
    pub fn reserved_bytes(&self, gpu: u32) -> u64 {
        self.gpu(gpu).reserved_bytes.load(Ordering::Relaxed)
    }

    /// Sets what `nvmlDeviceGetUtilizationRates` reports (percent, not clamped, so tests
    /// can feed nonsense on purpose). Panics if `gpu` is out of range.
    pub fn set_utilization(&self, gpu: u32, gpu_percent: u32, memory_percent: u32) {
        let g = self.gpu(gpu);
        g.util_gpu.store(gpu_percent, Ordering::Relaxed);
        g.util_mem.store(memory_percent, Ordering::Relaxed);
    }

    /// The device's v2 `used`: base usage plus every process slot (saturating), plus its
    /// MIG devices' for a GPU in MIG mode. `reserved` is not included, exactly as in
    /// `nvmlDeviceGetMemoryInfo_v2`. Panics if out of range.
    pub fn device_used_bytes(&self, gpu: u32) -> u64 {
        self.state().memory(self.gpu(gpu)).3
    }

    /// The device's v2 `free`: `total - reserved - used`, saturating at 0.
    /// Panics if `gpu` is out of range.
    pub fn device_free_bytes(&self, gpu: u32) -> u64 {
        self.state().memory(self.gpu(gpu)).2
    }

    /// Simulates the driver going away (module unloaded, node being drained).
    ///
    /// While on: `nvmlInit*` fails with `NVML_ERROR_DRIVER_NOT_LOADED` (9), the code a
    /// driverless machine gives; every other call, including on handles obtained before,
    /// fails with `NVML_ERROR_UNINITIALIZED` (1), telling the caller its session is dead and
    /// it must shut down and init again. `nvmlShutdown` still succeeds so cleanup works.
    /// Once cleared, a new `nvmlInit*` succeeds and calls work again.
    pub fn set_unavailable(&self, on: bool) {
        self.state()
            .header
            .unavailable
            .store(on as u32, Ordering::Release);
    }

    /// Marks `gpu` as fallen off the bus: every call on its handle, and fetching its handle,
    /// fails with `NVML_ERROR_GPU_IS_LOST` (15); other GPUs are unaffected. The GPU stays in
    /// the device count, as on a real node. Panics if `gpu` is out of range.
    pub fn set_gpu_lost(&self, gpu: u32, lost: bool) {
        self.gpu(gpu).lost.store(lost as u32, Ordering::Release);
    }

    /// Makes every call of class `call` fail with NVML return code `code` (e.g.
    /// [`codes::UNKNOWN`], [`codes::TIMEOUT`]); `None` (or `Some(0)`) restores it.
    ///
    /// Checked after the `unavailable` switch and before argument and handle checks, so the
    /// injected code is what the caller sees.
    pub fn set_call_failure(&self, call: Call, code: Option<u32>) {
        self.state().header.call_failure[call as usize].store(code.unwrap_or(0), Ordering::Release);
    }

    /// Makes every call of class `call` sleep `delay` before answering (`Duration::ZERO`
    /// restores it). The sleep comes first, so a slow call can also be a failing one: this
    /// models a driver stuck behind its global lock (NVML-NOTES: process lists can take
    /// milliseconds on real hardware). Delays above ~584 years saturate.
    pub fn set_call_delay(&self, call: Call, delay: Duration) {
        let ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.state().header.call_delay_ns[call as usize].store(ns, Ordering::Release);
    }

    /// Turns every fault switch off: available, no GPU lost, no failing or slow calls.
    pub fn clear_faults(&self) {
        self.set_unavailable(false);
        for g in &self.state().gpus {
            g.lost.store(0, Ordering::Release);
        }
        for c in Call::ALL {
            self.set_call_failure(c, None);
            self.set_call_delay(c, Duration::ZERO);
        }
    }
}

/// Creates `dir/libnvidia-ml.so.1` as a symlink to `lib` (replacing any existing entry by
/// that name) and returns the link's path.
///
/// pynvml and other C users `dlopen("libnvidia-ml.so.1")` by soname, so putting `dir` first
/// on `LD_LIBRARY_PATH` makes them load the fake. The target is made absolute, so the link
/// works from any working directory.
///
/// Errors: `lib` does not exist, or the directory or link cannot be created.
pub fn install_soname_link(lib: &Path, dir: &Path) -> io::Result<PathBuf> {
    let target = fs::canonicalize(lib)?;
    fs::create_dir_all(dir)?;
    let link = dir.join(NVML_SONAME);
    match fs::symlink_metadata(&link) {
        Ok(_) => fs::remove_file(&link)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::os::unix::fs::symlink(&target, &link)?;
    Ok(link)
}

/// File name of the built cdylib (`libfake_nvml.so` on Linux).
pub fn cdylib_file_name() -> String {
    format!(
        "{}fake_nvml{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// Finds the built cdylib next to the running executable, for tests in any crate.
///
/// A test binary lives in `target/<profile>/deps/`. Cargo always writes the cdylib to
/// `deps/`, and copies it up to `target/<profile>/` only when fake-nvml itself is a build
/// target (`cargo build`, not when it is merely a dependency of the crate under test), so
/// the copied-up file can be stale. Every ancestor of the executable (up to four levels)
/// and its `deps/` is searched, and the most recently modified candidate wins. Returns
/// `None` if none is built: a crate's tests need fake-nvml as a (dev-)dependency for cargo
/// to build it. Installed, it is beside the binary (the release tarball) or in
/// `lib/stepwatch/` of the binary's prefix (the .deb: /usr/lib/stepwatch).
pub fn find_cdylib() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let name = cdylib_file_name();
    exe.ancestors()
        .skip(1)
        .take(4)
        .flat_map(|dir| {
            [
                dir.join(&name),
                dir.join("deps").join(&name),
                dir.join("lib/stepwatch").join(&name),
            ]
        })
        .filter_map(|p| {
            let modified = fs::metadata(&p).ok()?.modified().ok()?;
            p.is_file().then_some((modified, p))
        })
        .max_by_key(|(modified, _)| *modified)
        .map(|(_, p)| p)
}

/// One test's private fake in a process that loads the cdylib: a fresh state
/// directory with `n` H100s (and MIG devices), [`STATE_DIR_ENV`] pointing at
/// it, and a process-wide lock held for its life, since the variable and the
/// library's globals are one per process. Drop it only after every NVML user
/// of the test has shut down; the directory goes with it.
pub struct LockedFake {
    /// The fake's state, to set figures and faults through.
    pub fake: FakeNvml,
    _guard: std::sync::MutexGuard<'static, ()>,
}

static LOCKED_FAKE: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl LockedFake {
    /// `n` H100 80GB GPUs; `tag` names the directory.
    pub fn new(tag: &str, n: u32) -> Self {
        Self::with_mig(tag, n, &[])
    }

    /// `n` H100 80GB GPUs and `migs` carved from them.
    pub fn with_mig(tag: &str, n: u32, migs: &[MigSpec]) -> Self {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let guard = LOCKED_FAKE.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::temp_dir().join(format!(
            "fake-nvml-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        let specs: Vec<_> = (0..n).map(GpuSpec::h100_80gb).collect();
        let fake = FakeNvml::create_with_mig(&dir, &specs, migs).expect("create the fake's state");
        std::env::set_var(STATE_DIR_ENV, &dir);
        LockedFake {
            fake,
            _guard: guard,
        }
    }
}

impl Drop for LockedFake {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(self.fake.dir());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh temp dir (tempfile's: a unique name, removed on drop), its
    /// path at `.0`; the second field is held only to remove it on drop.
    pub(crate) struct TempDir(pub PathBuf, #[allow(dead_code)] tempfile::TempDir);
    impl TempDir {
        pub(crate) fn new(tag: &str) -> Self {
            let dir = tempfile::Builder::new()
                .prefix(&format!("fake-nvml-unit-{tag}-"))
                .tempdir()
                .unwrap();
            TempDir(dir.path().to_owned(), dir)
        }
    }

    fn two_gpus(tag: &str) -> (TempDir, FakeNvml) {
        let d = TempDir::new(tag);
        let f = FakeNvml::create(&d.0, &[GpuSpec::h100_80gb(0), GpuSpec::h100_80gb(1)]).unwrap();
        (d, f)
    }

    #[test]
    fn layout_is_stable() {
        // The file format is shared across processes and builds: pin its size so an
        // accidental field change shows up here (and bumps LAYOUT_VERSION deliberately).
        assert_eq!(std::mem::size_of::<layout::Slot>(), 16);
        assert_eq!(
            std::mem::size_of::<layout::Gpu>(),
            96 + 96 + 32 + 16 + 24 + 64 * 16
        );
        assert_eq!(std::mem::size_of::<layout::Header>(), 24 + 160 + 64 + 128);
        assert_eq!(STATE_SIZE, 376 + 72 * 1288);
    }

    #[test]
    fn create_then_open_sees_specs() {
        let (d, f) = two_gpus("specs");
        assert!(d.0.join(STATE_FILE).is_file());
        let g = FakeNvml::open(&d.0).unwrap();
        assert_eq!(g.gpu_count(), 2);
        assert_eq!(g.gpu_uuid(1), "GPU-00000000-0000-0000-0000-000000000001");
        assert_eq!(g.gpu_name(0), "NVIDIA H100 80GB HBM3");
        assert_eq!(g.total_bytes(0), 81559 << 20);
        assert_eq!(g.reserved_bytes(0), DEFAULT_RESERVED_BYTES);
        assert_eq!(g.device_used_bytes(1), 0);
        assert_eq!(f.dir(), d.0.as_path());
        // No temporary file is left behind.
        assert_eq!(fs::read_dir(&d.0).unwrap().count(), 1);
    }

    #[test]
    fn uuids_are_distinct_and_deterministic() {
        assert_eq!(GpuSpec::h100_80gb(3), GpuSpec::h100_80gb(3));
        assert_ne!(GpuSpec::h100_80gb(3).uuid, GpuSpec::h100_80gb(4).uuid);
        assert_eq!(
            GpuSpec::h100_80gb(10).uuid,
            "GPU-00000000-0000-0000-0000-00000000000a"
        );
    }

    #[test]
    fn long_names_are_truncated_with_a_nul() {
        let d = TempDir::new("long");
        let spec = GpuSpec {
            name: "x".repeat(500),
            uuid: "GPU-x".into(),
            total_bytes: 1,
        };
        let f = FakeNvml::create(&d.0, &[spec]).unwrap();
        assert_eq!(f.gpu_name(0).len(), layout::NAME_LEN - 1);
    }

    #[test]
    fn too_many_gpus_is_refused() {
        let d = TempDir::new("many");
        let specs: Vec<_> = (0..17).map(GpuSpec::h100_80gb).collect();
        let e = FakeNvml::create(&d.0, &specs).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(FakeNvml::create(&d.0, &specs[..16]).is_ok());
        assert!(FakeNvml::create(&d.0, &[]).is_ok());
    }

    #[test]
    fn open_refuses_missing_and_foreign_files() {
        let d = TempDir::new("foreign");
        assert_eq!(
            FakeNvml::open(&d.0).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        fs::write(d.0.join(STATE_FILE), b"short").unwrap();
        assert_eq!(
            FakeNvml::open(&d.0).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        fs::write(d.0.join(STATE_FILE), vec![0u8; STATE_SIZE]).unwrap();
        assert_eq!(
            FakeNvml::open(&d.0).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[test]
    fn slots_sum_update_and_remove() {
        let (_d, f) = two_gpus("slots");
        f.set_base_used(0, 1000);
        f.set_process_memory(0, 11, 100).unwrap();
        f.set_process_memory(0, 12, 200).unwrap();
        f.set_process_memory(1, 11, 7).unwrap();
        assert_eq!(f.device_used_bytes(0), 1300);
        assert_eq!(f.device_used_bytes(1), 7);
        // Updating a pid reuses its slot rather than claiming a second one.
        f.set_process_memory(0, 11, 150).unwrap();
        assert_eq!(f.processes(0), vec![(11, 150), (12, 200)]);
        assert_eq!(f.device_used_bytes(0), 1350);
        let total = f.total_bytes(0);
        assert_eq!(
            f.device_free_bytes(0),
            total - DEFAULT_RESERVED_BYTES - 1350
        );
        f.remove_process(0, 11);
        f.remove_process(0, 999); // not present: no-op
        assert_eq!(f.processes(0), vec![(12, 200)]);
        assert_eq!(f.device_used_bytes(0), 1200);
        // GPU 1 untouched by GPU 0's removal.
        assert_eq!(f.processes(1), vec![(11, 7)]);
    }

    #[test]
    fn free_saturates_at_zero() {
        let (_d, f) = two_gpus("sat");
        f.set_process_memory(0, 5, u64::MAX).unwrap();
        f.set_base_used(0, 10);
        assert_eq!(f.device_used_bytes(0), u64::MAX);
        assert_eq!(f.device_free_bytes(0), 0);
    }

    #[test]
    fn slots_run_out_at_64_and_free_up() {
        let (_d, f) = two_gpus("full");
        for pid in 1..=64 {
            f.set_process_memory(0, pid, 1).unwrap();
        }
        let e = f.set_process_memory(0, 65, 1).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        // Existing pids can still be updated when full.
        f.set_process_memory(0, 64, 2).unwrap();
        assert_eq!(f.device_used_bytes(0), 65);
        f.remove_process(0, 3);
        f.set_process_memory(0, 65, 10).unwrap();
        assert_eq!(f.device_used_bytes(0), 74);
        assert_eq!(f.processes(0).len(), 64);
    }

    #[test]
    fn bad_arguments_are_errors() {
        let (_d, f) = two_gpus("args");
        assert_eq!(
            f.set_process_memory(2, 1, 1).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            f.set_process_memory(0, 0, 1).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    #[should_panic(expected = "GPU 5 out of range")]
    fn out_of_range_gpu_panics() {
        let (_d, f) = two_gpus("panic");
        f.set_base_used(5, 1);
    }

    #[test]
    fn two_instances_see_each_others_writes() {
        let (d, a) = two_gpus("multi");
        let b = FakeNvml::open(&d.0).unwrap();
        a.set_process_memory(1, 42, 4096).unwrap();
        assert_eq!(b.processes(1), vec![(42, 4096)]);
        assert_eq!(b.device_used_bytes(1), 4096);
        b.set_process_memory(1, 43, 1).unwrap();
        b.set_utilization(1, 77, 33);
        assert_eq!(a.device_used_bytes(1), 4097);
        let g = &a.state().gpus[1];
        assert_eq!(g.util_gpu.load(Ordering::Relaxed), 77);
        assert_eq!(g.util_mem.load(Ordering::Relaxed), 33);
        b.set_unavailable(true);
        assert_eq!(a.state().header.unavailable.load(Ordering::Relaxed), 1);
        drop(a);
        // The survivor still works after the other mapping is gone.
        b.remove_process(1, 42);
        assert_eq!(b.device_used_bytes(1), 1);
    }

    #[test]
    fn concurrent_writers_never_share_a_slot() {
        let (d, f) = two_gpus("race");
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let dir = d.0.clone();
                s.spawn(move || {
                    let g = FakeNvml::open(&dir).unwrap();
                    for i in 0..16u32 {
                        g.set_process_memory(0, 1 + t * 16 + i, 1 << t).unwrap();
                    }
                    // Churn: grow, shrink and remove/re-add, all moving the running sum.
                    for round in 0..500u64 {
                        let pid = 1 + t * 16 + (round % 16) as u32;
                        g.set_process_memory(0, pid, round * 1000).unwrap();
                        g.remove_process(0, pid);
                        g.set_process_memory(0, pid, 1 << t).unwrap();
                    }
                });
            }
        });
        // The running sum equals the slots' total once writers stop.
        let slot_sum: u64 = f.processes(0).iter().map(|p| p.1).sum();
        assert_eq!(f.device_used_bytes(0), slot_sum);
        let mut pids: Vec<u32> = f.processes(0).iter().map(|p| p.0).collect();
        pids.sort_unstable();
        assert_eq!(pids, (1..=64).collect::<Vec<_>>());
        assert_eq!(f.device_used_bytes(0), 16 * (1 + 2 + 4 + 8));
    }

    #[test]
    fn fault_switches_write_and_clear() {
        let (_d, f) = two_gpus("faults");
        let h = &f.state().header;
        f.set_unavailable(true);
        f.set_gpu_lost(1, true);
        f.set_call_failure(Call::Processes, Some(codes::UNKNOWN));
        f.set_call_delay(Call::MemoryInfo, Duration::from_millis(3));
        f.set_call_delay(Call::Init, Duration::MAX);
        assert_eq!(h.unavailable.load(Ordering::Relaxed), 1);
        assert_eq!(f.state().gpus[1].lost.load(Ordering::Relaxed), 1);
        assert_eq!(f.state().gpus[0].lost.load(Ordering::Relaxed), 0);
        assert_eq!(
            h.call_failure[Call::Processes as usize].load(Ordering::Relaxed),
            999
        );
        assert_eq!(
            h.call_delay_ns[Call::MemoryInfo as usize].load(Ordering::Relaxed),
            3_000_000
        );
        assert_eq!(
            h.call_delay_ns[Call::Init as usize].load(Ordering::Relaxed),
            u64::MAX
        );
        f.set_call_failure(Call::Processes, None);
        assert_eq!(
            h.call_failure[Call::Processes as usize].load(Ordering::Relaxed),
            0
        );
        f.set_call_failure(Call::Count, Some(3));
        f.clear_faults();
        assert_eq!(h.unavailable.load(Ordering::Relaxed), 0);
        assert_eq!(f.state().gpus[1].lost.load(Ordering::Relaxed), 0);
        for c in Call::ALL {
            assert_eq!(h.call_failure[c as usize].load(Ordering::Relaxed), 0);
            assert_eq!(h.call_delay_ns[c as usize].load(Ordering::Relaxed), 0);
        }
    }

    #[test]
    fn dead_processes_are_removed_live_ones_kept() {
        let (_d, f) = two_gpus("dead");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap(); // reaped: the pid no longer exists
        let me = std::process::id();
        f.set_process_memory(0, dead, 10).unwrap();
        f.set_process_memory(1, dead, 10).unwrap();
        f.set_process_memory(0, me, 20).unwrap();
        assert_eq!(f.remove_dead_processes(), 2);
        assert_eq!(f.processes(0), vec![(me, 20)]);
        assert_eq!(f.processes(1), vec![]);
        assert_eq!(f.remove_dead_processes(), 0);
    }

    #[test]
    fn recreate_leaves_old_mapping_readable() {
        let (d, old) = two_gpus("recreate");
        old.set_process_memory(0, 1, 5).unwrap();
        let new = FakeNvml::create(&d.0, &[GpuSpec::h100_80gb(9)]).unwrap();
        assert_eq!(old.gpu_count(), 2);
        assert_eq!(old.device_used_bytes(0), 5);
        assert_eq!(new.gpu_count(), 1);
        assert_eq!(new.device_used_bytes(0), 0);
        assert_eq!(FakeNvml::open(&d.0).unwrap().gpu_count(), 1);
    }

    #[test]
    fn soname_link_points_at_the_library() {
        let d = TempDir::new("link");
        let lib = d.0.join("libfake_nvml.so");
        fs::write(&lib, b"not really a library").unwrap();
        let dir = d.0.join("ld");
        let link = install_soname_link(&lib, &dir).unwrap();
        assert_eq!(link, dir.join(NVML_SONAME));
        assert_eq!(
            fs::read_link(&link).unwrap(),
            fs::canonicalize(&lib).unwrap()
        );
        // Idempotent: a second install replaces the first link.
        let lib2 = d.0.join("other.so");
        fs::write(&lib2, b"x").unwrap();
        install_soname_link(&lib2, &dir).unwrap();
        assert_eq!(
            fs::read_link(&link).unwrap(),
            fs::canonicalize(&lib2).unwrap()
        );
        assert!(install_soname_link(&d.0.join("missing.so"), &dir).is_err());
    }
}
