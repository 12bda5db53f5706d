//! The exported NVML C functions.
//!
//! Per-call cost is one atomic pointer load (is NVML initialised, and on which mapping),
//! the fault switches (three relaxed loads), a range check on the handle, and the work
//! itself. Nothing here touches the environment or the file system except `nvmlInit*`.
//!
//! Mappings made by init are never unmapped: a thread still inside a call while another
//! thread shuts NVML down must not fault. Init reuses the mapping when the state file is
//! the same inode, so an agent cycling init/shutdown in a recovery loop does not grow; only
//! a switch to a *new* state file (one 20 KiB mapping) is kept for the process's lifetime.
//!
//! No function may panic: unwinding out of `extern "C"` aborts the host process.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::Path;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::codes::*;
use crate::layout::{cstr_bytes, Gpu, State, MAX_PROCS, NO_PARENT};
use crate::{Call, Mapping, STATE_DIR_ENV, STATE_FILE};

type NvmlReturn = c_uint;
type NvmlDevice = *mut c_void;

/// `nvmlMemory_t`: v1, whose `used` includes driver-reserved memory.
#[repr(C)]
pub struct NvmlMemoryV1 {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct NvmlMemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// `NVML_STRUCT_VERSION(Memory, 2)`.
const MEMORY_V2_VERSION: c_uint = (std::mem::size_of::<NvmlMemoryV2>() as c_uint) | (2 << 24);

/// `nvmlUtilization_t`.
#[repr(C)]
pub struct NvmlUtilization {
    gpu: c_uint,
    memory: c_uint,
}

/// `nvmlProcessInfo_v1_t`, used by the unversioned process-list functions.
#[repr(C)]
pub struct NvmlProcessInfoV1 {
    pid: c_uint,
    used_gpu_memory: u64,
}

/// `nvmlProcessInfo_t` / `nvmlProcessInfo_v2_t`, used by the `_v2` and `_v3` functions.
#[repr(C)]
pub struct NvmlProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// "Not a MIG instance", as NVML reports it.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

/// The mapping calls read, or null when NVML is not initialised.
static CURRENT: AtomicPtr<State> = AtomicPtr::new(ptr::null_mut());

struct InitState {
    refcount: u32,
    /// Every mapping ever made, leaked on purpose (see the module docs).
    mappings: Vec<&'static Mapping>,
}

static INIT: Mutex<InitState> = Mutex::new(InitState {
    refcount: 0,
    mappings: Vec::new(),
});

static WARNED: AtomicBool = AtomicBool::new(false);

/// Writes `value` through `out`, or `INVALID_ARGUMENT` when `out` is NULL.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), NvmlReturn> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    out.write(value);
    Ok(())
}

/// Applies the delay, unavailable and injected-failure switches for one call class.
#[inline]
fn faults(st: &State, call: Call) -> Result<(), NvmlReturn> {
    let h = &st.header;
    let delay = h.call_delay_ns[call as usize].load(Ordering::Relaxed);
    if delay != 0 {
        std::thread::sleep(Duration::from_nanos(delay));
    }
    if h.unavailable.load(Ordering::Relaxed) != 0 {
        return Err(if call == Call::Init {
            DRIVER_NOT_LOADED
        } else {
            UNINITIALIZED
        });
    }
    match h.call_failure[call as usize].load(Ordering::Relaxed) {
        0 => Ok(()),
        code => Err(code),
    }
}

/// The current state after the switches for `call`, or why the call fails.
#[inline]
fn enter(call: Call) -> Result<&'static State, NvmlReturn> {
    let p = CURRENT.load(Ordering::Acquire);
    if p.is_null() {
        return Err(UNINITIALIZED);
    }
    // SAFETY: non-null CURRENT always points into a leaked, never-unmapped mapping.
    let st = unsafe { &*p };
    faults(st, call)?;
    Ok(st)
}

/// The device behind `dev`, if it is a handle into `st` that is in range and not lost (a
/// MIG device is lost with its GPU).
#[inline]
fn gpu_of(st: &'static State, dev: NvmlDevice) -> Result<&'static Gpu, NvmlReturn> {
    let base = st.gpus.as_ptr() as usize;
    let size = std::mem::size_of::<Gpu>();
    let off = (dev as usize).wrapping_sub(base);
    let devices = st.devices();
    if off % size != 0 || off / size >= devices.len() {
        return Err(INVALID_ARGUMENT);
    }
    let g = &devices[off / size];
    let parent_lost = devices
        .get(g.parent as usize)
        .is_some_and(|p| p.lost.load(Ordering::Relaxed) != 0);
    if g.lost.load(Ordering::Relaxed) != 0 || parent_lost {
        return Err(GPU_IS_LOST);
    }
    Ok(g)
}

#[inline]
fn device(call: Call, dev: NvmlDevice) -> Result<&'static Gpu, NvmlReturn> {
    gpu_of(enter(call)?, dev)
}

/// The state the handles of this session point into; `UNINITIALIZED` when a shutdown
/// on another thread ended the session.
fn current() -> Result<&'static State, NvmlReturn> {
    let p = CURRENT.load(Ordering::Acquire);
    // SAFETY: non-null CURRENT always points into a leaked, never-unmapped mapping.
    (!p.is_null()).then(|| unsafe { &*p }).ok_or(UNINITIALIZED)
}

fn handle_of(g: &Gpu) -> NvmlDevice {
    g as *const Gpu as NvmlDevice
}

/// Collapses `Result<(), code>` into an NVML return code.
#[inline]
fn ret(r: Result<(), NvmlReturn>) -> NvmlReturn {
    match r {
        Ok(()) => SUCCESS,
        Err(c) => c,
    }
}

/// Copies a NUL-terminated string into a caller buffer of `len` bytes, as NVML does:
/// `INSUFFICIENT_SIZE` if it (with its NUL) does not fit.
unsafe fn copy_cstr(src: &[u8], dst: *mut c_char, len: c_uint) -> Result<(), NvmlReturn> {
    if dst.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let s = cstr_bytes(src);
    if s.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    ptr::copy_nonoverlapping(s.as_ptr(), dst.cast::<u8>(), s.len());
    *dst.add(s.len()) = 0;
    Ok(())
}

fn open_from_env() -> Result<&'static Mapping, String> {
    let dir = std::env::var_os(STATE_DIR_ENV).ok_or_else(|| format!("{STATE_DIR_ENV} is unset"))?;
    let path = Path::new(&dir).join(STATE_FILE);
    let meta = std::fs::metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut init = INIT.lock().unwrap_or_else(|e| e.into_inner());
    use std::os::unix::fs::MetadataExt;
    if let Some(m) = init
        .mappings
        .iter()
        .find(|m| m.identity() == (meta.dev(), meta.ino()))
    {
        return Ok(m);
    }
    let m: &'static Mapping = Box::leak(Box::new(
        Mapping::open(&path).map_err(|e| format!("{}: {e}", path.display()))?,
    ));
    init.mappings.push(m);
    Ok(m)
}

fn init() -> NvmlReturn {
    // Held across the whole init so concurrent inits and shutdowns serialise, as in NVML.
    let mut guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let st: &'static State = if guard.refcount > 0 {
        // SAFETY: refcount > 0 implies CURRENT is set and points into a leaked mapping.
        unsafe { &*CURRENT.load(Ordering::Acquire) }
    } else {
        drop(guard);
        let m = match open_from_env() {
            Ok(m) => m,
            Err(e) => {
                if !WARNED.swap(true, Ordering::Relaxed) {
                    eprintln!("fake-nvml: nvmlInit fails with NVML_ERROR_LIBRARY_NOT_FOUND: {e}");
                }
                return LIBRARY_NOT_FOUND;
            }
        };
        guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
        if guard.refcount > 0 {
            // Another thread initialised meanwhile; join its session.
            // SAFETY: as above.
            unsafe { &*CURRENT.load(Ordering::Acquire) }
        } else {
            m.state()
        }
    };
    if let Err(code) = faults(st, Call::Init) {
        return code;
    }
    if guard.refcount == 0 {
        CURRENT.store(st as *const State as *mut State, Ordering::Release);
    }
    guard.refcount += 1;
    SUCCESS
}

/// `nvmlInit_v2`: ref-counted; the first successful init maps `$STEPWATCH_FAKE_NVML_DIR/state.bin`.
#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    init()
}

/// `nvmlInit` (v1): same as `nvmlInit_v2`.
#[no_mangle]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    init()
}

/// `nvmlInitWithFlags`: flags are accepted and ignored (a zero-GPU state already inits).
#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    init()
}

/// `nvmlShutdown`: drops one reference; `UNINITIALIZED` if there was none. Never faulted,
/// so cleanup always works (nvml-wrapper calls it from `Drop`).
#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    let mut guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if guard.refcount == 0 {
        return UNINITIALIZED;
    }
    guard.refcount -= 1;
    if guard.refcount == 0 {
        CURRENT.store(ptr::null_mut(), Ordering::Release);
    }
    SUCCESS
}

/// `nvmlErrorString`: NVML's descriptions for the codes, a generic one otherwise.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let s: &'static CStr = match result {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        11 => c"Interrupt request issue",
        12 => c"NVML Shared Library Not Found",
        13 => c"Function Not Found",
        14 => c"Corrupted infoROM",
        15 => c"GPU is lost",
        16 => c"GPU requires restart",
        17 => c"The operating system has blocked the request.",
        18 => c"RM has detected an NVML/RM version mismatch.",
        19 => c"In use by another client",
        20 => c"Insufficient Memory",
        21 => c"No data",
        25 => c"Argument version mismatch",
        999 => c"Unknown Error",
        _ => c"Unknown Error (fake-nvml: unrecognised code)",
    };
    s.as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(out: *mut c_char, len: c_uint) -> NvmlReturn {
    ret(enter(Call::DriverVersion).and_then(|st| copy_cstr(&st.header.driver_version, out, len)))
}

/// `nvmlSystemGetNVMLVersion`.
#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(out: *mut c_char, len: c_uint) -> NvmlReturn {
    ret(enter(Call::DriverVersion).and_then(|st| copy_cstr(&st.header.nvml_version, out, len)))
}

unsafe fn get_count(count: *mut c_uint) -> NvmlReturn {
    ret(enter(Call::Count).and_then(|st| put(count, st.header.gpu_count)))
}

/// `nvmlDeviceGetCount_v2`: every GPU in the state, lost ones included.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    get_count(count)
}

/// `nvmlDeviceGetCount`: same as `_v2`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> NvmlReturn {
    get_count(count)
}

unsafe fn handle_by_index(index: c_uint, dev: *mut NvmlDevice) -> NvmlReturn {
    ret(enter(Call::Handle).and_then(|st| {
        if dev.is_null() || index >= st.header.gpu_count {
            return Err(INVALID_ARGUMENT);
        }
        let g = gpu_of(st, handle_of(&st.gpus[index as usize]))?;
        *dev = handle_of(g);
        Ok(())
    }))
}

/// `nvmlDeviceGetHandleByIndex_v2`: a pointer to the GPU's entry in the mapping;
/// `GPU_IS_LOST` for a lost GPU, as real NVML does.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    dev: *mut NvmlDevice,
) -> NvmlReturn {
    handle_by_index(index, dev)
}

/// `nvmlDeviceGetHandleByIndex`: same as `_v2`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    dev: *mut NvmlDevice,
) -> NvmlReturn {
    handle_by_index(index, dev)
}

/// A handle looked up by a C string: `INVALID_ARGUMENT` for a NULL, `NOT_FOUND` when
/// `find` finds no device, `GPU_IS_LOST` for a lost one.
unsafe fn handle_by_key(
    key: *const c_char,
    dev: *mut NvmlDevice,
    find: impl FnOnce(&'static State, &CStr) -> Option<&'static Gpu>,
) -> NvmlReturn {
    ret(enter(Call::Handle).and_then(|st| {
        if key.is_null() || dev.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let g = find(st, CStr::from_ptr(key)).ok_or(NOT_FOUND)?;
        put(dev, handle_of(gpu_of(st, handle_of(g))?))
    }))
}

/// `nvmlDeviceGetHandleByUUID`: `NOT_FOUND` if no GPU or MIG device has that UUID.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    dev: *mut NvmlDevice,
) -> NvmlReturn {
    handle_by_key(uuid, dev, |st, want| {
        st.devices()
            .iter()
            .find(|g| cstr_bytes(&g.uuid) == want.to_bytes())
    })
}

/// The PCI bus id of GPU `index`: bus `index + 1`, as fake-cuda's
/// `cudaDeviceGetPCIBusId` reports it, so PyTorch can map CUDA devices to NVML.
pub fn pci_bus_id(index: u32) -> String {
    format!("00000000:{:02X}:00.0", index + 1)
}

/// `nvmlDeviceGetHandleByPciBusId_v2`: `NOT_FOUND` if no GPU has that bus id
/// (compared case-insensitively; a 4-digit domain is accepted too).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    dev: *mut NvmlDevice,
) -> NvmlReturn {
    handle_by_key(bus_id, dev, |st, want| {
        let want = want.to_string_lossy().to_ascii_uppercase();
        // The domain may be written with 4 or 8 digits.
        let want = want.trim_start_matches('0');
        st.gpus[..st.header.gpu_count as usize]
            .iter()
            .find(|g| pci_bus_id(g.index).trim_start_matches('0') == want)
    })
}

/// `nvmlSystemGetCudaDriverVersion_v2`: CUDA 13.2, the runtime fake-cuda stands in for.
#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> NvmlReturn {
    ret(enter(Call::DriverVersion).and_then(|_| put(version, 13020)))
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType`: fake GPUs have no NVLink.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    _dev: NvmlDevice,
    _link: c_uint,
    _kind: *mut c_void,
) -> NvmlReturn {
    NOT_SUPPORTED
}

/// `nvmlDeviceGetNvLinkRemotePciInfo_v2`: fake GPUs have no NVLink.
#[no_mangle]
pub extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    _dev: NvmlDevice,
    _link: c_uint,
    _pci: *mut c_void,
) -> NvmlReturn {
    NOT_SUPPORTED
}

/// `nvmlDeviceGetIndex`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(dev: NvmlDevice, index: *mut c_uint) -> NvmlReturn {
    ret(device(Call::Handle, dev).and_then(|g| put(index, g.index)))
}

/// `nvmlDeviceGetName`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    dev: NvmlDevice,
    name: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    ret(device(Call::Name, dev).and_then(|g| copy_cstr(&g.name, name, length)))
}

/// `nvmlDeviceGetUUID`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    dev: NvmlDevice,
    uuid: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    ret(device(Call::Uuid, dev).and_then(|g| copy_cstr(&g.uuid, uuid, length)))
}

/// `nvmlDeviceGetMemoryInfo` (v1): `used` includes the reserved figure, as the real v1 does.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    dev: NvmlDevice,
    memory: *mut NvmlMemoryV1,
) -> NvmlReturn {
    ret(device(Call::MemoryInfo, dev).and_then(|g| {
        let (total, reserved, free, used) = current()?.memory(g);
        put(
            memory,
            NvmlMemoryV1 {
                total,
                free,
                used: used.saturating_add(reserved),
            },
        )
    }))
}

/// `nvmlDeviceGetMemoryInfo_v2`: checks `version == sizeof | 2 << 24`, else
/// `ARGUMENT_VERSION_MISMATCH`; `used` excludes `reserved`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    dev: NvmlDevice,
    memory: *mut NvmlMemoryV2,
) -> NvmlReturn {
    ret(device(Call::MemoryInfo, dev).and_then(|g| {
        if memory.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        if (*memory).version != MEMORY_V2_VERSION {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let (total, reserved, free, used) = current()?.memory(g);
        *memory = NvmlMemoryV2 {
            version: MEMORY_V2_VERSION,
            total,
            reserved,
            free,
            used,
        };
        Ok(())
    }))
}

/// `nvmlDeviceGetUtilizationRates`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    dev: NvmlDevice,
    util: *mut NvmlUtilization,
) -> NvmlReturn {
    ret(device(Call::Utilization, dev).and_then(|g| {
        put(
            util,
            NvmlUtilization {
                gpu: g.util_gpu.load(Ordering::Relaxed),
                memory: g.util_mem.load(Ordering::Relaxed),
            },
        )
    }))
}

/// The NVML process-list protocol over one snapshot of the slots:
/// * `count` NULL: `INVALID_ARGUMENT`;
/// * no processes: `*count = 0`, `SUCCESS` (whatever the buffer);
/// * `*count` smaller than the number of processes (a NULL buffer with `*count == 0` is
///   the usual size query): `*count = n`, `INSUFFICIENT_SIZE`;
/// * otherwise the buffer (NULL is `INVALID_ARGUMENT`) gets the `n` entries, `*count = n`.
unsafe fn process_list<T>(
    g: &Gpu,
    count: *mut c_uint,
    infos: *mut T,
    make: impl Fn(&Gpu, u32, u64) -> T,
) -> Result<(), NvmlReturn> {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let mut snap = [(0u32, 0u64); MAX_PROCS];
    let mut n = 0usize;
    for s in &g.slots {
        let pid = s.pid.load(Ordering::Acquire);
        if pid != 0 {
            snap[n] = (pid, s.used_bytes.load(Ordering::Acquire));
            n += 1;
        }
    }
    if n == 0 {
        *count = 0;
        return Ok(());
    }
    if (*count as usize) < n {
        *count = n as c_uint;
        return Err(INSUFFICIENT_SIZE);
    }
    if infos.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    for (i, &(pid, used)) in snap[..n].iter().enumerate() {
        infos.add(i).write(make(g, pid, used));
    }
    *count = n as c_uint;
    Ok(())
}

fn info_v2(g: &Gpu, pid: u32, used: u64) -> NvmlProcessInfo {
    let mig = g.parent != NO_PARENT;
    NvmlProcessInfo {
        pid,
        used_gpu_memory: used,
        gpu_instance_id: if mig { g.gpu_instance_id } else { NO_INSTANCE },
        compute_instance_id: if mig {
            g.compute_instance_id
        } else {
            NO_INSTANCE
        },
    }
}

fn info_v1(_: &Gpu, pid: u32, used: u64) -> NvmlProcessInfoV1 {
    NvmlProcessInfoV1 {
        pid,
        used_gpu_memory: used,
    }
}

/// The process-list entry points: one signature, the list each answers.
macro_rules! process_list_fns {
    ($($(#[$doc:meta])* $name:ident($info:ty) = |$g:ident, $count:ident, $infos:ident| $body:expr;)*) => {$(
        $(#[$doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            dev: NvmlDevice,
            $count: *mut c_uint,
            $infos: *mut $info,
        ) -> NvmlReturn {
            ret(device(Call::Processes, dev).and_then(|$g| $body))
        }
    )*};
}

process_list_fns! {
    /// `nvmlDeviceGetComputeRunningProcesses_v3`: every claimed slot of the device; a MIG
    /// device's entries carry its instance ids, a GPU's `0xFFFFFFFF`.
    nvmlDeviceGetComputeRunningProcesses_v3(NvmlProcessInfo) = |g, count, infos| process_list(g, count, infos, info_v2);
    /// `nvmlDeviceGetComputeRunningProcesses_v2`: same entries as `_v3`.
    nvmlDeviceGetComputeRunningProcesses_v2(NvmlProcessInfo) = |g, count, infos| process_list(g, count, infos, info_v2);
    /// `nvmlDeviceGetComputeRunningProcesses` (v1 ABI): `{pid, usedGpuMemory}` entries.
    nvmlDeviceGetComputeRunningProcesses(NvmlProcessInfoV1) = |g, count, infos| process_list(g, count, infos, info_v1);
    /// `nvmlDeviceGetGraphicsRunningProcesses_v3`: a compute node, so always none.
    nvmlDeviceGetGraphicsRunningProcesses_v3(NvmlProcessInfo) = |_g, count, _infos| put(count, 0);
    /// `nvmlDeviceGetGraphicsRunningProcesses_v2`: always none.
    nvmlDeviceGetGraphicsRunningProcesses_v2(NvmlProcessInfo) = |_g, count, _infos| put(count, 0);
    /// `nvmlDeviceGetGraphicsRunningProcesses`: always none.
    nvmlDeviceGetGraphicsRunningProcesses(NvmlProcessInfoV1) = |_g, count, _infos| put(count, 0);
}

/// `nvmlDeviceGetGpuFabricInfoV`: succeeds and leaves the caller's struct as it was
/// (zeroed by callers: fabric state "not supported"). PyTorch asks it when
/// `expandable_segments` is on and warns in every OOM message when it fails.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfoV(
    dev: NvmlDevice,
    info: *mut c_void,
) -> NvmlReturn {
    let info_given = (!info.is_null()).then_some(()).ok_or(INVALID_ARGUMENT);
    ret(device(Call::Handle, dev).and(info_given))
}

/// Most MIG devices one GPU can hold (an A100's or H100's seven 1g slices).
const MAX_MIG_PER_GPU: c_uint = 7;

/// The physical GPU behind `dev`; `NOT_SUPPORTED` for a MIG device handle.
fn physical(dev: NvmlDevice) -> Result<&'static Gpu, NvmlReturn> {
    let g = device(Call::Mig, dev)?;
    if g.parent != NO_PARENT {
        return Err(NOT_SUPPORTED);
    }
    Ok(g)
}

/// The MIG device behind `dev`; `INVALID_ARGUMENT` for a physical GPU's handle.
fn mig(dev: NvmlDevice) -> Result<&'static Gpu, NvmlReturn> {
    let g = device(Call::Mig, dev)?;
    if g.parent == NO_PARENT {
        return Err(INVALID_ARGUMENT);
    }
    Ok(g)
}

/// `nvmlDeviceGetMigMode`: current and pending mode are the same, 1 on a GPU with MIG
/// devices; `NOT_SUPPORTED` on a MIG device.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    dev: NvmlDevice,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> NvmlReturn {
    ret(physical(dev).and_then(|g| {
        if pending.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        put(current, g.mig_mode)?;
        put(pending, g.mig_mode)
    }))
}

/// `nvmlDeviceGetMaxMigDeviceCount`: 7 on every GPU (what it could hold, not what it has).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    dev: NvmlDevice,
    count: *mut c_uint,
) -> NvmlReturn {
    ret(physical(dev).and_then(|_| put(count, MAX_MIG_PER_GPU)))
}

/// `nvmlDeviceGetMigDeviceHandleByIndex`: `NOT_FOUND` for an index with no MIG device,
/// `INVALID_ARGUMENT` past the maximum or on a GPU not in MIG mode.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    dev: NvmlDevice,
    index: c_uint,
    out: *mut NvmlDevice,
) -> NvmlReturn {
    ret(physical(dev).and_then(|g| {
        if out.is_null() || index >= MAX_MIG_PER_GPU || g.mig_mode == 0 {
            return Err(INVALID_ARGUMENT);
        }
        let m = current()?
            .migs_of(g.index)
            .find(|m| m.mig_index == index)
            .ok_or(NOT_FOUND)?;
        put(out, handle_of(m))
    }))
}

/// `nvmlDeviceIsMigDeviceHandle`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    dev: NvmlDevice,
    is_mig: *mut c_uint,
) -> NvmlReturn {
    ret(device(Call::Mig, dev).and_then(|g| put(is_mig, (g.parent != NO_PARENT) as c_uint)))
}

/// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`: the GPU a MIG device is carved from.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    dev: NvmlDevice,
    parent: *mut NvmlDevice,
) -> NvmlReturn {
    ret(mig(dev).and_then(|m| put(parent, handle_of(&current()?.gpus[m.parent as usize]))))
}

/// `nvmlDeviceGetGpuInstanceId`: a MIG device's GPU instance id.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    dev: NvmlDevice,
    id: *mut c_uint,
) -> NvmlReturn {
    ret(mig(dev).and_then(|m| put(id, m.gpu_instance_id)))
}

/// `nvmlDeviceGetComputeInstanceId`: a MIG device's compute instance id.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    dev: NvmlDevice,
    id: *mut c_uint,
) -> NvmlReturn {
    ret(mig(dev).and_then(|m| put(id, m.compute_instance_id)))
}

// ----------------------------------------------------------------- extensions
//
// Not NVML: the fake CUDA runtime (crates/fake-cuda) charges what a process
// allocates on a fake GPU through these, so that one implementation of the
// slot protocol (`Gpu::set_process_bytes`) serves the Rust API and C writers.
// Their presence is how fake-cuda tells this library from a real NVML.

/// Sets how many bytes `pid` uses on the GPU of `dev` (claiming a slot).
/// `INVALID_ARGUMENT` for pid 0, `INSUFFICIENT_SIZE` when all slots are taken.
#[no_mangle]
pub extern "C" fn stepwatchFakeNvmlSetProcessMemory(
    dev: NvmlDevice,
    pid: c_uint,
    bytes: u64,
) -> NvmlReturn {
    ret(gpu_of_unfaulted(dev).and_then(|g| {
        if pid == 0 {
            Err(INVALID_ARGUMENT)
        } else if g.set_process_bytes(pid, bytes) {
            Ok(())
        } else {
            Err(INSUFFICIENT_SIZE)
        }
    }))
}

/// Removes `pid` from the GPU of `dev`, as the driver does when a process exits.
#[no_mangle]
pub extern "C" fn stepwatchFakeNvmlReleaseProcess(dev: NvmlDevice, pid: c_uint) -> NvmlReturn {
    ret(gpu_of_unfaulted(dev).map(|g| g.release_process(pid)))
}

/// The GPU of a handle, ignoring the fault switches: memory accounting is the
/// device's, and goes on while NVML "fails" for its readers.
fn gpu_of_unfaulted(dev: NvmlDevice) -> Result<&'static Gpu, NvmlReturn> {
    let p = CURRENT.load(Ordering::Acquire);
    if p.is_null() {
        return Err(UNINITIALIZED);
    }
    // SAFETY: mappings are never unmapped (module docs).
    gpu_of(unsafe { &*p }, dev)
}

#[cfg(test)]
mod tests {
    //! The C protocol details nvml-wrapper does not reach (v1 structs, short buffers, bad
    //! handles, ref-counting), called in-process. This is the only test in the unit-test
    //! binary that touches the environment variable or the C API's globals, so it is one
    //! function.
    use super::*;
    use crate::tests::TempDir;
    use crate::{FakeNvml, GpuSpec, DEFAULT_RESERVED_BYTES};
    use std::mem::MaybeUninit;

    unsafe fn handle(i: u32) -> NvmlDevice {
        let mut d = ptr::null_mut();
        assert_eq!(nvmlDeviceGetHandleByIndex_v2(i, &mut d), SUCCESS);
        d
    }

    #[test]
    fn c_protocol() {
        unsafe {
            // Before any init, and with nowhere to look: uninitialised / library not found.
            let mut n: c_uint = 0;
            assert_eq!(nvmlDeviceGetCount_v2(&mut n), UNINITIALIZED);
            assert_eq!(nvmlShutdown(), UNINITIALIZED);
            std::env::remove_var(STATE_DIR_ENV);
            assert_eq!(nvmlInit_v2(), LIBRARY_NOT_FOUND);
            let d = TempDir::new("capi");
            std::env::set_var(STATE_DIR_ENV, &d.0);
            assert_eq!(nvmlInit_v2(), LIBRARY_NOT_FOUND, "no state.bin yet");

            let f =
                FakeNvml::create(&d.0, &[GpuSpec::h100_80gb(0), GpuSpec::h100_80gb(1)]).unwrap();
            assert_eq!(nvmlInit_v2(), SUCCESS);
            assert_eq!(nvmlDeviceGetCount(&mut n), SUCCESS);
            assert_eq!(n, 2);
            assert_eq!(nvmlDeviceGetCount_v2(ptr::null_mut()), INVALID_ARGUMENT);

            // Handles: by index and by UUID agree; bad ones are refused.
            let h0 = handle(0);
            let h1 = handle(1);
            let mut hu = ptr::null_mut();
            let uuid = std::ffi::CString::new(f.gpu_uuid(1)).unwrap();
            assert_eq!(nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut hu), SUCCESS);
            assert_eq!(hu, h1);
            assert_eq!(
                nvmlDeviceGetHandleByUUID(c"GPU-nope".as_ptr(), &mut hu),
                NOT_FOUND
            );
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(2, &mut hu), INVALID_ARGUMENT);
            // By PCI bus id, as fake-cuda's cudaDeviceGetPCIBusId names them.
            let bus = std::ffi::CString::new(pci_bus_id(1)).unwrap();
            assert_eq!(
                nvmlDeviceGetHandleByPciBusId_v2(bus.as_ptr(), &mut hu),
                SUCCESS
            );
            assert_eq!(hu, h1);
            assert_eq!(
                nvmlDeviceGetHandleByPciBusId_v2(c"0000:01:00.0".as_ptr(), &mut hu),
                SUCCESS,
                "a short domain and lower case are the same bus"
            );
            assert_eq!(hu, h0);
            assert_eq!(
                nvmlDeviceGetHandleByPciBusId_v2(c"00000000:09:00.0".as_ptr(), &mut hu),
                NOT_FOUND
            );
            // The extensions fake-cuda charges through: the same slots as the Rust API.
            assert_eq!(
                stepwatchFakeNvmlSetProcessMemory(h1, 4242, 3 << 20),
                SUCCESS
            );
            assert_eq!(f.processes(1), vec![(4242, 3 << 20)]);
            assert_eq!(
                stepwatchFakeNvmlSetProcessMemory(h1, 4242, 5 << 20),
                SUCCESS
            );
            assert_eq!(f.device_used_bytes(1), 5 << 20);
            assert_eq!(
                stepwatchFakeNvmlSetProcessMemory(h1, 0, 1),
                INVALID_ARGUMENT
            );
            assert_eq!(
                stepwatchFakeNvmlSetProcessMemory(ptr::null_mut(), 1, 1),
                INVALID_ARGUMENT
            );
            assert_eq!(stepwatchFakeNvmlReleaseProcess(h1, 4242), SUCCESS);
            assert_eq!(f.processes(1), vec![]);
            assert_eq!(f.device_used_bytes(1), 0);
            let mut cuda_version = 0;
            assert_eq!(
                nvmlSystemGetCudaDriverVersion_v2(&mut cuda_version),
                SUCCESS
            );
            assert_eq!(cuda_version, 13020);
            let mut idx = 9;
            assert_eq!(nvmlDeviceGetIndex(h1, &mut idx), SUCCESS);
            assert_eq!(idx, 1);
            assert_eq!(
                nvmlDeviceGetIndex(ptr::null_mut(), &mut idx),
                INVALID_ARGUMENT
            );
            assert_eq!(
                nvmlDeviceGetIndex((h0 as usize + 8) as NvmlDevice, &mut idx),
                INVALID_ARGUMENT
            );

            // Strings: exact fit works, one byte short is INSUFFICIENT_SIZE.
            let name = f.gpu_name(0);
            let mut buf = [0 as c_char; 96];
            let fit = name.len() as c_uint + 1;
            assert_eq!(nvmlDeviceGetName(h0, buf.as_mut_ptr(), fit), SUCCESS);
            assert_eq!(CStr::from_ptr(buf.as_ptr()).to_str().unwrap(), name);
            assert_eq!(
                nvmlDeviceGetName(h0, buf.as_mut_ptr(), fit - 1),
                INSUFFICIENT_SIZE
            );
            assert_eq!(nvmlSystemGetDriverVersion(buf.as_mut_ptr(), 80), SUCCESS);
            assert_eq!(
                CStr::from_ptr(buf.as_ptr()).to_str().unwrap(),
                crate::DRIVER_VERSION
            );
            assert_eq!(nvmlSystemGetNVMLVersion(buf.as_mut_ptr(), 80), SUCCESS);
            assert_eq!(
                CStr::from_ptr(buf.as_ptr()).to_str().unwrap(),
                crate::NVML_VERSION
            );

            // Memory: v1 used includes reserved, v2 does not; v2 checks its version.
            f.set_base_used(0, 1 << 20);
            f.set_process_memory(0, 100, 3 << 30).unwrap();
            let used = (1 << 20) + (3 << 30);
            let total = f.total_bytes(0);
            let mut m1 = MaybeUninit::<NvmlMemoryV1>::zeroed().assume_init();
            assert_eq!(nvmlDeviceGetMemoryInfo(h0, &mut m1), SUCCESS);
            assert_eq!(m1.total, total);
            assert_eq!(m1.used, used + DEFAULT_RESERVED_BYTES);
            assert_eq!(m1.free, total - used - DEFAULT_RESERVED_BYTES);
            let mut m2 = MaybeUninit::<NvmlMemoryV2>::zeroed().assume_init();
            assert_eq!(
                nvmlDeviceGetMemoryInfo_v2(h0, &mut m2),
                ARGUMENT_VERSION_MISMATCH
            );
            m2.version = 40 | (2 << 24);
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(h0, &mut m2), SUCCESS);
            assert_eq!(
                (m2.total, m2.reserved, m2.used, m2.free),
                (total, DEFAULT_RESERVED_BYTES, used, m1.free)
            );
            assert_eq!(
                nvmlDeviceGetMemoryInfo_v2(h0, ptr::null_mut()),
                INVALID_ARGUMENT
            );

            // Process lists: the size-query protocol, exactly.
            let mut cnt: c_uint = 0;
            assert_eq!(
                nvmlDeviceGetComputeRunningProcesses_v3(h1, &mut cnt, ptr::null_mut()),
                SUCCESS,
                "no processes: success with a NULL buffer"
            );
            assert_eq!(cnt, 0);
            f.set_process_memory(0, 101, 5).unwrap();
            f.set_process_memory(0, 102, 6).unwrap();
            cnt = 0;
            assert_eq!(
                nvmlDeviceGetComputeRunningProcesses_v3(h0, &mut cnt, ptr::null_mut()),
                INSUFFICIENT_SIZE
            );
            assert_eq!(cnt, 3);
            let mut infos: Vec<NvmlProcessInfo> = (0..8)
                .map(|_| info_v2(&f.map.state().gpus[0], 0, 0))
                .collect();
            cnt = 2;
            assert_eq!(
                nvmlDeviceGetComputeRunningProcesses_v3(h0, &mut cnt, infos.as_mut_ptr()),
                INSUFFICIENT_SIZE
            );
            assert_eq!(cnt, 3);
            assert_eq!(infos[0].pid, 0, "nothing written on INSUFFICIENT_SIZE");
            cnt = 8;
            assert_eq!(
                nvmlDeviceGetComputeRunningProcesses_v2(h0, &mut cnt, infos.as_mut_ptr()),
                SUCCESS
            );
            assert_eq!(cnt, 3);
            let got: Vec<_> = infos[..3]
                .iter()
                .map(|i| {
                    (
                        i.pid,
                        i.used_gpu_memory,
                        i.gpu_instance_id,
                        i.compute_instance_id,
                    )
                })
                .collect();
            assert_eq!(
                got,
                vec![
                    (100, 3 << 30, NO_INSTANCE, NO_INSTANCE),
                    (101, 5, NO_INSTANCE, NO_INSTANCE),
                    (102, 6, NO_INSTANCE, NO_INSTANCE)
                ]
            );
            cnt = 5;
            assert_eq!(
                nvmlDeviceGetComputeRunningProcesses_v3(h0, &mut cnt, ptr::null_mut()),
                INVALID_ARGUMENT
            );
            assert_eq!(
                nvmlDeviceGetComputeRunningProcesses_v3(h0, ptr::null_mut(), infos.as_mut_ptr()),
                INVALID_ARGUMENT
            );
            let mut v1: Vec<NvmlProcessInfoV1> = (0..4)
                .map(|_| NvmlProcessInfoV1 {
                    pid: 0,
                    used_gpu_memory: 0,
                })
                .collect();
            cnt = 4;
            assert_eq!(
                nvmlDeviceGetComputeRunningProcesses(h0, &mut cnt, v1.as_mut_ptr()),
                SUCCESS
            );
            assert_eq!((cnt, v1[2].pid, v1[2].used_gpu_memory), (3, 102, 6));
            cnt = 7;
            assert_eq!(
                nvmlDeviceGetGraphicsRunningProcesses_v3(h0, &mut cnt, ptr::null_mut()),
                SUCCESS
            );
            assert_eq!(cnt, 0);

            // Utilisation.
            f.set_utilization(1, 55, 12);
            let mut u = NvmlUtilization { gpu: 0, memory: 0 };
            assert_eq!(nvmlDeviceGetUtilizationRates(h1, &mut u), SUCCESS);
            assert_eq!((u.gpu, u.memory), (55, 12));

            // Ref-counting: a second init, then one shutdown, leaves the session open.
            assert_eq!(nvmlInitWithFlags(0), SUCCESS);
            assert_eq!(nvmlShutdown(), SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&mut n), SUCCESS);
            // Init faults apply to nested inits too, without changing the count.
            f.set_call_failure(Call::Init, Some(UNKNOWN));
            assert_eq!(nvmlInit(), UNKNOWN);
            f.set_call_failure(Call::Init, None);
            // The unavailable switch: live calls say UNINITIALIZED, init DRIVER_NOT_LOADED.
            f.set_unavailable(true);
            assert_eq!(nvmlDeviceGetCount_v2(&mut n), UNINITIALIZED);
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(h0, &mut m2), UNINITIALIZED);
            assert_eq!(nvmlInit_v2(), DRIVER_NOT_LOADED);
            f.set_unavailable(false);
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(h0, &mut m2), SUCCESS);
            // GPU lost: its handle and its calls fail, the other GPU works.
            f.set_gpu_lost(0, true);
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(h0, &mut m2), GPU_IS_LOST);
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(0, &mut hu), GPU_IS_LOST);
            assert_eq!(nvmlDeviceGetMemoryInfo_v2(h1, &mut m2), SUCCESS);
            f.set_gpu_lost(0, false);

            assert_eq!(nvmlShutdown(), SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&mut n), UNINITIALIZED);
            assert_eq!(nvmlShutdown(), UNINITIALIZED);

            // Re-init on the same file reuses its mapping: old handles stay valid.
            let before = INIT.lock().unwrap().mappings.len();
            assert_eq!(nvmlInit_v2(), SUCCESS);
            assert_eq!(INIT.lock().unwrap().mappings.len(), before);
            assert_eq!(nvmlDeviceGetIndex(h1, &mut idx), SUCCESS);
            assert_eq!(nvmlShutdown(), SUCCESS);

            // Re-created state is a new world: the next first init maps it.
            let _g = FakeNvml::create(&d.0, &[GpuSpec::h100_80gb(7)]).unwrap();
            assert_eq!(nvmlInit_v2(), SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&mut n), SUCCESS);
            assert_eq!(n, 1);
            assert_eq!(nvmlDeviceGetIndex(h1, &mut idx), INVALID_ARGUMENT);
            assert_eq!(nvmlShutdown(), SUCCESS);

            assert_eq!(
                CStr::from_ptr(nvmlErrorString(GPU_IS_LOST))
                    .to_str()
                    .unwrap(),
                "GPU is lost"
            );
            assert!(!nvmlErrorString(123_456).is_null());
            // The Rust side finds the same state through the same variable.
            assert_eq!(FakeNvml::open_from_env().unwrap().gpu_count(), 1);
            std::env::remove_var(STATE_DIR_ENV);
            assert_eq!(
                FakeNvml::open_from_env().unwrap_err().kind(),
                std::io::ErrorKind::NotFound
            );
        }
    }
}
