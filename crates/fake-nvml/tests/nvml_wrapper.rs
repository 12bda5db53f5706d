//! The fake through nvml-wrapper 0.13, exactly as the agent uses NVML.
//!
//! The cdylib is `dlopen`ed (via `Nvml::builder().lib_path(..)`), so its globals are shared
//! by every test in this process, and `nvmlInit` reads `STEPWATCH_FAKE_NVML_DIR`, a process
//! global too. Each test therefore holds a `LockedFake` for its whole life (the lock, and
//! the variable at its own state directory), and drops every `Nvml` before it returns
//! (bringing the init count back to 0 so the next test's init reads the variable afresh).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fake_nvml::{
    codes, Call, FakeNvml, GpuSpec, LockedFake, MigSpec, DEFAULT_RESERVED_BYTES, STATE_DIR_ENV,
};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

/// The cdylib cargo built alongside this test binary. A plain `cargo test` leaves it in
/// `target/<profile>/deps/` (next to the test binary); only `cargo build` copies it up to
/// `target/<profile>/`. `find_cdylib` looks in both.
fn lib_path() -> PathBuf {
    fake_nvml::find_cdylib().expect("libfake_nvml.so not found near the test binary")
}

/// nvml-wrapper over the cdylib, with the environment of the test's [`LockedFake`].
fn init() -> Result<Nvml, NvmlError> {
    Nvml::builder().lib_path(lib_path().as_os_str()).init()
}

fn used(m: &UsedGpuMemory) -> u64 {
    match m {
        UsedGpuMemory::Used(b) => *b,
        UsedGpuMemory::Unavailable => panic!("fake reported Unavailable"),
    }
}

#[test]
fn reads_match_the_state() {
    let w = LockedFake::new("reads", 2);
    let f = &w.fake;
    f.set_base_used(0, 300 << 20);
    f.set_process_memory(0, 4242, 10 << 30).unwrap();
    f.set_process_memory(0, 4343, 2 << 30).unwrap();
    f.set_process_memory(1, 4242, 1 << 30).unwrap();
    f.set_utilization(0, 87, 41);

    let nvml = init().unwrap();
    assert_eq!(nvml.device_count().unwrap(), 2);
    assert_eq!(
        nvml.sys_driver_version().unwrap(),
        fake_nvml::DRIVER_VERSION
    );
    let d0 = nvml.device_by_index(0).unwrap();
    let d1 = nvml.device_by_index(1).unwrap();
    assert_eq!(d0.name().unwrap(), "NVIDIA H100 80GB HBM3");
    assert_eq!(d0.uuid().unwrap(), f.gpu_uuid(0));
    assert_eq!(
        d1.uuid().unwrap(),
        "GPU-00000000-0000-0000-0000-000000000001"
    );
    assert_eq!(d1.index().unwrap(), 1);
    let by_uuid = nvml.device_by_uuid(f.gpu_uuid(1)).unwrap();
    assert_eq!(by_uuid.index().unwrap(), 1);
    assert!(matches!(
        nvml.device_by_uuid("GPU-missing"),
        Err(NvmlError::NotFound)
    ));

    let m = d0.memory_info().unwrap();
    let expect_used = (300 << 20) + (12u64 << 30);
    assert_eq!(m.total, f.total_bytes(0));
    assert_eq!(m.used, expect_used);
    assert_eq!(m.used, f.device_used_bytes(0));
    assert_eq!(m.reserved, DEFAULT_RESERVED_BYTES);
    assert_eq!(m.free, m.total - m.used - m.reserved);

    let mut procs: Vec<(u32, u64)> = d0
        .running_compute_processes()
        .unwrap()
        .iter()
        .map(|p| (p.pid, used(&p.used_gpu_memory)))
        .collect();
    procs.sort_unstable();
    assert_eq!(procs, vec![(4242, 10 << 30), (4343, 2 << 30)]);
    for p in d0.running_compute_processes().unwrap() {
        assert_eq!(p.gpu_instance_id, None);
        assert_eq!(p.compute_instance_id, None);
    }
    assert_eq!(d0.running_compute_processes_count().unwrap(), 2);
    assert_eq!(d1.running_compute_processes().unwrap().len(), 1);
    assert!(d0.running_graphics_processes().unwrap().is_empty());

    let u = d0.utilization_rates().unwrap();
    assert_eq!((u.gpu, u.memory), (87, 41));

    // Live: writes after init show up on the next read, without re-init.
    f.set_process_memory(0, 4343, 5 << 30).unwrap();
    f.remove_process(0, 4242);
    f.set_base_used(0, 0);
    assert_eq!(d0.memory_info().unwrap().used, 5 << 30);
    let procs = d0.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(
        (procs[0].pid, used(&procs[0].used_gpu_memory)),
        (4343, 5 << 30)
    );
    f.remove_process(0, 4343);
    assert!(d0.running_compute_processes().unwrap().is_empty());
    assert_eq!(d0.memory_info().unwrap().used, 0);
}

#[test]
fn mig_devices_are_reached_through_nvml_mig_calls() {
    // GPU 0 whole; GPU 1 in MIG mode with two 1g.10gb slices (instances 9 and 13).
    let migs = [MigSpec::h100_1g_10gb(1, 9), MigSpec::h100_1g_10gb(1, 13)];
    let w = LockedFake::with_mig("mig", 2, &migs);
    let f = &w.fake;
    let slice = f.mig_device(1, 1).unwrap();
    assert_eq!(f.mig_device(1, 2), None);
    assert_eq!(f.mig_device(0, 0), None);
    f.set_process_memory(slice, 777, 3 << 30).unwrap();
    f.set_process_memory(1, 888, 1 << 30).unwrap();

    let nvml = init().unwrap();
    // MIG devices are not GPUs of their own in the count.
    assert_eq!(nvml.device_count().unwrap(), 2);
    let whole = nvml.device_by_index(0).unwrap();
    assert!(!whole.mig_mode().unwrap().current.eq(&1));
    assert!(whole.mig_device_by_index(0).is_err());
    let parent = nvml.device_by_index(1).unwrap();
    assert_eq!(parent.mig_mode().unwrap().current, 1);
    assert_eq!(parent.mig_device_count().unwrap(), 7);
    assert!(!parent.mig_is_mig_device_handle().unwrap());
    assert!(matches!(
        parent.mig_device_by_index(2),
        Err(NvmlError::NotFound)
    ));

    let m = parent.mig_device_by_index(1).unwrap();
    assert!(m.mig_is_mig_device_handle().unwrap());
    assert_eq!(m.uuid().unwrap(), migs[1].uuid);
    assert!(m.uuid().unwrap().starts_with("MIG-"));
    assert_eq!(m.name().unwrap(), "NVIDIA H100 80GB HBM3 MIG 1g.10gb");
    assert_eq!(
        m.mig_parent_device().unwrap().uuid().unwrap(),
        f.gpu_uuid(1)
    );
    let mut id = 0;
    // SAFETY: a live handle and a valid out pointer, as NVML's signature asks.
    let rc =
        unsafe { (nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref().unwrap())(m.handle(), &mut id) };
    assert_eq!((rc, id), (0, 13));
    let mem = m.memory_info().unwrap();
    assert_eq!(mem.total, 9984 << 20);
    assert_eq!(mem.used, 3 << 30);
    assert_eq!(mem.free, (9984 << 20) - (3 << 30));
    let procs = m.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, 777);
    assert_eq!(procs[0].gpu_instance_id, Some(13));
    // The parent's memory counts its slices; the slice is found by its UUID too.
    assert_eq!(parent.memory_info().unwrap().used, (3 << 30) + (1 << 30));
    assert_eq!(f.device_used_bytes(1), (3 << 30) + (1 << 30));
    assert_eq!(
        nvml.device_by_uuid(migs[0].uuid.as_str())
            .unwrap()
            .uuid()
            .unwrap(),
        migs[0].uuid
    );
    // A lost GPU takes its slices with it; MIG calls fail like the others.
    f.set_gpu_lost(1, true);
    assert!(matches!(m.memory_info(), Err(NvmlError::GpuLost)));
    f.set_gpu_lost(1, false);
    f.set_call_failure(Call::Mig, Some(codes::UNKNOWN));
    assert!(matches!(parent.mig_mode(), Err(NvmlError::Unknown)));
    assert!(m.memory_info().is_ok());
}

#[test]
fn mig_layouts_that_do_not_fit_are_refused() {
    let dir = std::env::temp_dir().join(format!("fake-nvml-mig-bad-{}", std::process::id()));
    let gpus = [GpuSpec::h100_80gb(0)];
    let nine: Vec<_> = (0..9).map(|i| MigSpec::h100_1g_10gb(0, i)).collect();
    let err = FakeNvml::create_with_mig(&dir, &gpus, &nine).unwrap_err();
    assert!(err.to_string().contains("more than"), "{err}");
    let err = FakeNvml::create_with_mig(&dir, &gpus, &[MigSpec::h100_1g_10gb(3, 1)]).unwrap_err();
    assert!(err.to_string().contains("not there"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_full_gpu_lists_all_64_processes() {
    let w = LockedFake::new("full", 1);
    for pid in 1..=64 {
        w.fake
            .set_process_memory(0, 1000 + pid, pid as u64)
            .unwrap();
    }
    let nvml = init().unwrap();
    let d = nvml.device_by_index(0).unwrap();
    let procs = d.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 64);
    let sum: u64 = procs.iter().map(|p| used(&p.used_gpu_memory)).sum();
    assert_eq!(sum, (1..=64).sum::<u64>());
    assert_eq!(d.memory_info().unwrap().used, sum);
}

#[test]
fn writes_from_another_process_are_seen() {
    let w = LockedFake::new("xproc", 1);
    let nvml = init().unwrap();
    let d = nvml.device_by_index(0).unwrap();
    // A real second process writes the state: this test binary re-run as a helper.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "helper_writer", "--ignored"])
        .env("FAKE_NVML_HELPER_DIR", w.fake.dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helper failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
    let procs = d.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, 777);
    assert_eq!(d.memory_info().unwrap().used, 123_456_789);
}

/// Run only by `writes_from_another_process_are_seen`, in a child process.
#[test]
#[ignore = "helper for writes_from_another_process_are_seen"]
fn helper_writer() {
    let dir = std::env::var_os("FAKE_NVML_HELPER_DIR").expect("run by the cross-process test");
    let f = FakeNvml::open(Path::new(&dir)).unwrap();
    f.set_process_memory(0, 777, 123_456_789).unwrap();
}

#[test]
fn unavailable_fails_init_and_live_calls_then_recovers() {
    let w = LockedFake::new("unavail", 1);
    let nvml = init().unwrap();
    let d = nvml.device_by_index(0).unwrap();
    assert!(d.memory_info().is_ok());

    w.fake.set_unavailable(true);
    assert!(matches!(d.memory_info(), Err(NvmlError::Uninitialized)));
    assert!(matches!(
        d.running_compute_processes(),
        Err(NvmlError::Uninitialized)
    ));
    assert!(matches!(nvml.device_count(), Err(NvmlError::Uninitialized)));
    // A fresh init (what a recovering agent does) fails while the driver is "gone"...
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));
    drop(nvml); // shutdown still succeeds; the init count is back to 0
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));

    // ...and succeeds once it is back.
    w.fake.set_unavailable(false);
    let nvml = init().unwrap();
    let d = nvml.device_by_index(0).unwrap();
    w.fake.set_process_memory(0, 9, 99).unwrap();
    assert_eq!(d.memory_info().unwrap().used, 99);
}

#[test]
fn lost_gpu_reports_gpu_lost_and_others_work() {
    let w = LockedFake::new("lost", 2);
    let nvml = init().unwrap();
    let d1 = nvml.device_by_index(1).unwrap();
    w.fake.set_gpu_lost(1, true);
    assert!(matches!(d1.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(
        d1.running_compute_processes(),
        Err(NvmlError::GpuLost)
    ));
    assert!(matches!(d1.utilization_rates(), Err(NvmlError::GpuLost)));
    assert!(matches!(d1.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(nvml.device_by_index(1), Err(NvmlError::GpuLost)));
    assert_eq!(nvml.device_count().unwrap(), 2);
    let d0 = nvml.device_by_index(0).unwrap();
    assert!(d0.memory_info().is_ok());
    w.fake.set_gpu_lost(1, false);
    assert!(d1.memory_info().is_ok());
}

#[test]
fn injected_call_failures() {
    let w = LockedFake::new("fail", 1);
    let f = &w.fake;

    f.set_call_failure(Call::Init, Some(codes::DRIVER_NOT_LOADED));
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));
    f.set_call_failure(Call::Init, None);

    let nvml = init().unwrap();
    let d = nvml.device_by_index(0).unwrap();
    f.set_call_failure(Call::MemoryInfo, Some(codes::UNKNOWN));
    assert!(matches!(d.memory_info(), Err(NvmlError::Unknown)));
    // Only that class fails.
    assert!(d.running_compute_processes().is_ok());
    assert!(d.utilization_rates().is_ok());

    f.set_call_failure(Call::Processes, Some(codes::TIMEOUT));
    assert!(matches!(
        d.running_compute_processes(),
        Err(NvmlError::Timeout)
    ));
    f.set_call_failure(Call::Utilization, Some(codes::NOT_SUPPORTED));
    assert!(matches!(
        d.utilization_rates(),
        Err(NvmlError::NotSupported)
    ));
    f.set_call_failure(Call::Count, Some(codes::UNKNOWN));
    assert!(matches!(nvml.device_count(), Err(NvmlError::Unknown)));
    f.set_call_failure(Call::Handle, Some(codes::GPU_IS_LOST));
    assert!(matches!(nvml.device_by_index(0), Err(NvmlError::GpuLost)));
    f.set_call_failure(Call::Name, Some(codes::UNKNOWN));
    assert!(matches!(d.name(), Err(NvmlError::Unknown)));
    f.set_call_failure(Call::Uuid, Some(codes::UNKNOWN));
    assert!(matches!(d.uuid(), Err(NvmlError::Unknown)));
    f.set_call_failure(Call::DriverVersion, Some(codes::UNKNOWN));
    assert!(matches!(nvml.sys_driver_version(), Err(NvmlError::Unknown)));

    f.clear_faults();
    assert!(d.memory_info().is_ok());
    assert!(d.running_compute_processes().is_ok());
    assert!(nvml.device_count().is_ok());
    assert_eq!(d.name().unwrap(), "NVIDIA H100 80GB HBM3");
}

#[test]
fn delays_slow_only_their_class() {
    let w = LockedFake::new("delay", 1);
    let nvml = init().unwrap();
    let d = nvml.device_by_index(0).unwrap();
    w.fake.set_process_memory(0, 5, 5).unwrap();
    w.fake
        .set_call_delay(Call::Processes, Duration::from_millis(60));

    let t = Instant::now();
    d.memory_info().unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(30),
        "memory_info was slowed"
    );

    // nvml-wrapper makes two process calls (size query, then fetch): two delays.
    let t = Instant::now();
    assert_eq!(d.running_compute_processes().unwrap().len(), 1);
    assert!(
        t.elapsed() >= Duration::from_millis(120),
        "{:?}",
        t.elapsed()
    );

    w.fake.set_call_delay(Call::Processes, Duration::ZERO);
    let t = Instant::now();
    d.running_compute_processes().unwrap();
    assert!(t.elapsed() < Duration::from_millis(30));
}

#[test]
fn init_without_state_is_library_not_found() {
    let w = LockedFake::new("nostate", 1);
    std::env::remove_var(STATE_DIR_ENV);
    assert!(matches!(init(), Err(NvmlError::LibraryNotFound)));
    std::env::set_var(STATE_DIR_ENV, w.fake.dir().join("does-not-exist"));
    assert!(matches!(init(), Err(NvmlError::LibraryNotFound)));
    std::env::set_var(STATE_DIR_ENV, w.fake.dir());
    assert!(init().is_ok());
}

#[test]
fn init_is_reference_counted() {
    let _world = LockedFake::new("refcount", 1);
    let a = init().unwrap();
    let b = init().unwrap();
    drop(a);
    let d = b.device_by_index(0).unwrap();
    assert!(
        d.memory_info().is_ok(),
        "one shutdown must not end both sessions"
    );
    drop(b);
}

/// Measures the cost of nvml-wrapper calls on the fake, for the README. Run by hand:
/// `cargo test --release -p fake-nvml --test nvml_wrapper -- --ignored --nocapture bench`
#[test]
#[ignore = "timing, run by hand"]
fn bench_call_costs() {
    let w = LockedFake::new("bench", 8);
    for g in 0..8 {
        for p in 0..4 {
            w.fake.set_process_memory(g, 100 + p, 1 << 30).unwrap();
        }
    }
    let nvml = init().unwrap();
    let d = nvml.device_by_index(3).unwrap();
    let time = |label: &str, iters: u32, f: &mut dyn FnMut()| {
        for _ in 0..iters / 10 {
            f();
        }
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        let ns = t.elapsed().as_nanos() as f64 / iters as f64;
        println!("{label}: {ns:.1} ns/call");
        ns
    };
    let mem = time("memory_info (v2)", 2_000_000, &mut || {
        std::hint::black_box(d.memory_info().unwrap());
    });
    time("running_compute_processes (4 procs)", 500_000, &mut || {
        std::hint::black_box(d.running_compute_processes().unwrap());
    });
    time("utilization_rates", 2_000_000, &mut || {
        std::hint::black_box(d.utilization_rates().unwrap());
    });
    time("set_process_memory (writer)", 2_000_000, &mut || {
        w.fake.set_process_memory(3, 101, 2 << 30).unwrap();
    });
    assert!(mem < 1000.0, "memory_info costs {mem} ns");
}
