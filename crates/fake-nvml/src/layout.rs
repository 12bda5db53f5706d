//! The binary layout of `state.bin`.
//!
//! Everything here is `#[repr(C)]` with explicit padding so that the file means the same
//! thing to every process that maps it: the test (writer), simulated trainers (writers)
//! and the agent, which reads it through the C API in the cdylib. Fields that change after
//! creation are atomics: several processes mutate and read them at once without locks.
//! Fixed-size text (names, UUIDs, version strings) is written once, before the file is
//! renamed into place, and never changes afterwards, so plain reads of it are race-free.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// `"FNVM"` as a little-endian `u32`: the first four bytes of every state file.
pub const MAGIC: u32 = u32::from_le_bytes(*b"FNVM");
/// Bumped whenever [`State`]'s layout changes, so an old mapping is refused, not misread.
pub const LAYOUT_VERSION: u32 = 2;
/// The most GPUs one state file can describe (an 8-GPU node with room to spare).
pub const MAX_GPUS: usize = 16;
/// The most MIG devices one state file can describe: an 8-GPU node with 7 slices each.
pub const MAX_MIG_DEVICES: usize = 56;
/// Device entries in the file: physical GPUs first, then MIG devices.
pub const MAX_DEVICES: usize = MAX_GPUS + MAX_MIG_DEVICES;
/// `parent` of a physical GPU: it has none.
pub const NO_PARENT: u32 = u32::MAX;
/// Process slots per GPU. Real nodes run a handful of processes per GPU; 64 leaves room
/// for tests that churn through many short-lived simulated trainers.
pub const MAX_PROCS: usize = 64;
/// Room for call classes in the fault tables; [`crate::Call`] uses the first few.
pub const MAX_CALLS: usize = 16;
/// Matches `NVML_DEVICE_NAME_V2_BUFFER_SIZE`.
pub const NAME_LEN: usize = 96;
/// Matches `NVML_DEVICE_UUID_V2_BUFFER_SIZE`.
pub const UUID_LEN: usize = 96;
/// Matches `NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE`.
pub const VERSION_LEN: usize = 80;

/// The file header: identity, the GPU count and the process-wide fault switches.
#[repr(C)]
pub struct Header {
    /// [`MAGIC`], written last at creation: a file with it is complete.
    pub magic: u32,
    /// [`LAYOUT_VERSION`] of the writer.
    pub layout_version: u32,
    /// Physical GPUs in use, at most [`MAX_GPUS`]; they are the first entries.
    pub gpu_count: u32,
    /// MIG devices, at most [`MAX_MIG_DEVICES`]; the entries after the GPUs.
    pub mig_count: u32,
    /// Explicit padding so the layout has no implicit holes.
    pub _pad: u32,
    /// Non-zero: the "driver" is gone. See [`crate::FakeNvml::set_unavailable`].
    pub unavailable: AtomicU32,
    /// NUL-terminated `nvmlSystemGetDriverVersion` answer.
    pub driver_version: [u8; VERSION_LEN],
    /// NUL-terminated `nvmlSystemGetNVMLVersion` answer.
    pub nvml_version: [u8; VERSION_LEN],
    /// Per [`crate::Call`]: 0 = behave normally, otherwise the NVML return code to fail with.
    pub call_failure: [AtomicU32; MAX_CALLS],
    /// Per [`crate::Call`]: nanoseconds to sleep inside the call before answering.
    pub call_delay_ns: [AtomicU64; MAX_CALLS],
}

/// One process's claim on a GPU. `pid == 0` means the slot is free.
#[repr(C)]
pub struct Slot {
    /// Owner, claimed by compare-and-swap from 0; released last on removal.
    pub pid: AtomicU32,
    /// Explicit padding so the layout has no implicit holes.
    pub _pad: u32,
    /// Bytes the owner uses; zeroed before the slot is released.
    pub used_bytes: AtomicU64,
}

/// One GPU.
#[repr(C)]
pub struct Gpu {
    /// NUL-terminated product name.
    pub name: [u8; NAME_LEN],
    /// NUL-terminated UUID.
    pub uuid: [u8; UUID_LEN],
    /// Framebuffer size.
    pub total_bytes: AtomicU64,
    /// Driver and non-process usage, counted in v2 `used`.
    pub base_used_bytes: AtomicU64,
    /// Running sum of every slot's `used_bytes` (wrapping), kept by the writers so that a
    /// memory read is O(1) rather than a scan of all slots: ~35 ns instead of ~850 ns per
    /// `memory_info()` in the unoptimised builds tests use.
    pub proc_used_bytes: AtomicU64,
    /// Driver-reserved memory: v2 reports it apart, v1 folds it into `used`.
    pub reserved_bytes: AtomicU64,
    /// `nvmlUtilization_t.gpu`, percent.
    pub util_gpu: AtomicU32,
    /// `nvmlUtilization_t.memory`, percent.
    pub util_mem: AtomicU32,
    /// Non-zero: the GPU "fell off the bus"; calls on it return `NVML_ERROR_GPU_IS_LOST`.
    pub lost: AtomicU32,
    /// Position in the file, what `nvmlDeviceGetIndex` reports (a MIG device: its entry).
    pub index: u32,
    /// A MIG device's GPU entry, or [`NO_PARENT`] for a physical GPU.
    pub parent: u32,
    /// A MIG device's index on its parent (`nvmlDeviceGetMigDeviceHandleByIndex`).
    pub mig_index: u32,
    /// A MIG device's GPU instance id (`nvmlDeviceGetGpuInstanceId`).
    pub gpu_instance_id: u32,
    /// A MIG device's compute instance id (`nvmlDeviceGetComputeInstanceId`).
    pub compute_instance_id: u32,
    /// A physical GPU: non-zero when MIG mode is on (`nvmlDeviceGetMigMode`).
    pub mig_mode: u32,
    /// Explicit padding so the layout has no implicit holes.
    pub _pad: u32,
    /// Process slots; the device's `used` sums them.
    pub slots: [Slot; MAX_PROCS],
}

/// The whole file. Its size is fixed whatever the GPU count, so every mapping is the same.
#[repr(C)]
pub struct State {
    /// Identity and global switches.
    pub header: Header,
    /// All device entries: `header.gpu_count` GPUs, then `header.mig_count` MIG devices.
    pub gpus: [Gpu; MAX_DEVICES],
}

impl State {
    /// The entries in use: GPUs, then MIG devices.
    pub fn devices(&self) -> &[Gpu] {
        let n = (self.header.gpu_count + self.header.mig_count) as usize;
        &self.gpus[..n.min(MAX_DEVICES)]
    }

    /// The MIG devices of physical GPU `gpu`, in `mig_index` order.
    pub fn migs_of(&self, gpu: u32) -> impl Iterator<Item = &Gpu> {
        self.devices().iter().filter(move |d| d.parent == gpu)
    }

    /// `(total, reserved, free, used_v2)` of a device. A GPU in MIG mode counts what its
    /// MIG devices use, as the parent's memory info does on a real GPU.
    pub fn memory(&self, g: &Gpu) -> (u64, u64, u64, u64) {
        let (total, reserved, _, mut used) = g.memory();
        if g.parent == NO_PARENT && g.mig_mode != 0 {
            for m in self.migs_of(g.index) {
                used = used.saturating_add(m.used_v2());
            }
        }
        let free = total.saturating_sub(reserved).saturating_sub(used);
        (total, reserved, free, used)
    }
}

/// Size in bytes of `state.bin`.
pub const STATE_SIZE: usize = std::mem::size_of::<State>();

impl Gpu {
    /// v2 `used`: base usage plus the running sum of the process slots, saturating.
    #[inline]
    pub fn used_v2(&self) -> u64 {
        self.base_used_bytes
            .load(Ordering::Relaxed)
            .saturating_add(self.proc_used_bytes.load(Ordering::Relaxed))
    }

    /// Sets a slot's bytes and moves the running sum by the difference. Slot and sum are
    /// two atomics, so a reader may briefly see one updated and not the other; once writers
    /// pause, the sum is exact (wrapping deltas cancel).
    #[inline]
    pub fn store_slot_bytes(&self, slot: &Slot, bytes: u64) {
        let old = slot.used_bytes.swap(bytes, Ordering::AcqRel);
        self.proc_used_bytes
            .fetch_add(bytes.wrapping_sub(old), Ordering::AcqRel);
    }

    /// Sets `pid`'s slot to `bytes`, claiming a free slot (compare-and-swap of its pid
    /// from 0) when `pid` has none. `false` when every slot is taken. `pid` must not be 0.
    pub fn set_process_bytes(&self, pid: u32, bytes: u64) -> bool {
        if let Some(s) = self
            .slots
            .iter()
            .find(|s| s.pid.load(Ordering::Acquire) == pid)
        {
            self.store_slot_bytes(s, bytes);
            return true;
        }
        for s in &self.slots {
            if s.pid
                .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                self.store_slot_bytes(s, bytes);
                return true;
            }
        }
        false
    }

    /// Frees `pid`'s slot (a no-op if it has none). Bytes are zeroed before the pid is
    /// released, so a reader summing slots never counts a freed slot's bytes, and a writer
    /// reclaiming the slot starts from zero.
    pub fn release_process(&self, pid: u32) {
        for s in &self.slots {
            if s.pid.load(Ordering::Acquire) == pid {
                self.store_slot_bytes(s, 0);
                let _ = s
                    .pid
                    .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }

    /// `(total, reserved, free, used_v2)`, with `free = total - reserved - used`, saturating.
    #[inline]
    pub fn memory(&self) -> (u64, u64, u64, u64) {
        let total = self.total_bytes.load(Ordering::Relaxed);
        let reserved = self.reserved_bytes.load(Ordering::Relaxed);
        let used = self.used_v2();
        let free = total.saturating_sub(reserved).saturating_sub(used);
        (total, reserved, free, used)
    }
}

/// Copies `s` into a fixed NUL-terminated buffer, truncating to leave room for the NUL.
pub fn put_cstr(dst: &mut [u8], s: &str) {
    dst.fill(0);
    let n = s.len().min(dst.len() - 1);
    dst[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// The bytes of a fixed NUL-terminated buffer, up to (not including) the first NUL.
pub fn cstr_bytes(src: &[u8]) -> &[u8] {
    let n = src.iter().position(|&b| b == 0).unwrap_or(src.len());
    &src[..n]
}
