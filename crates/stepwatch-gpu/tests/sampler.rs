//! The sampler thread against fake-nvml (the real nvml-wrapper path).
//!
//! The fake reads `STEPWATCH_FAKE_NVML_DIR` on its first init and its
//! globals are shared by the whole process, so each test holds a `LockedFake` and
//! stops its sampler (shutting NVML down) before it returns.

use std::time::{Duration, Instant};

use fake_nvml::{codes, Call, LockedFake, MigSpec};
use stepwatch_clock::monotonic_ns;
use stepwatch_gpu::{MigSlice, NvmlCall, SamplerConfig, SamplerHandle, SamplerSnapshot};

mod common;
use common::{config, wait_for, wait_for_within};

fn errors(snap: &SamplerSnapshot, call: NvmlCall) -> u64 {
    snap.errors.iter().find(|(c, _)| *c == call).unwrap().1
}

#[test]
fn samples_every_gpu_each_tick_with_monotonic_timestamps_and_a_lag_histogram() {
    let world = LockedFake::new("rate", 2);
    world.fake.set_base_used(1, 3 << 30);
    let sampler = SamplerHandle::start(config());
    let snap = wait_for(&sampler, "20 ticks", |s| s.ticks_total >= 20);
    assert!(snap.nvml_up);
    assert_eq!(snap.gpus.len(), 2);
    assert_eq!(snap.gpus[1].last.unwrap().used_bytes, 3 << 30);
    assert!(snap.gpus[1].used_max_bytes.unwrap() >= 3 << 30);

    let drained = sampler.drain_samples();
    assert_eq!(drained.len(), 2);
    for (uuid, samples) in &drained {
        assert!(uuid.starts_with("GPU-"));
        assert!(samples.len() >= 20, "{}", samples.len());
        assert!(samples
            .windows(2)
            .all(|w| w[0].monotonic_ns < w[1].monotonic_ns));
        assert!(samples.last().unwrap().monotonic_ns <= monotonic_ns());
    }
    // Drained means gone: the next drain holds only samples taken after the
    // last one drained, and new ones keep coming.
    let last_drained: Vec<u64> = drained
        .iter()
        .map(|(_, s)| s.last().unwrap().monotonic_ns)
        .collect();
    let mut fresh = vec![0usize; drained.len()];
    let deadline = Instant::now() + Duration::from_secs(10);
    while fresh.contains(&0) {
        assert!(Instant::now() < deadline, "no new samples: {fresh:?}");
        for (i, (_, samples)) in sampler.drain_samples().iter().enumerate() {
            assert!(
                samples.iter().all(|s| s.monotonic_ns > last_drained[i]),
                "a drained sample came back"
            );
            fresh[i] += samples.len();
        }
        std::thread::sleep(Duration::from_millis(5));
    }

    let snap = sampler.snapshot(monotonic_ns());
    assert_eq!(
        snap.lag_histogram.len(),
        stepwatch_gpu::LAG_BUCKETS_SECONDS.len()
    );
    assert!(snap.lag_count >= 20);
    assert!(snap.lag_histogram.last().unwrap().1 <= snap.lag_count);
    assert!(snap.lag_histogram.windows(2).all(|w| w[0].1 <= w[1].1));
    assert!(snap.lag_sum_seconds >= 0.0);
    let p50 = snap.lag_quantile_seconds(0.5).unwrap();
    assert!((0.0..=1.0).contains(&p50));
    sampler.stop();
}

#[test]
fn each_mig_slice_is_sampled_as_a_device_with_its_own_memory() {
    // GPU 0 whole; GPU 1 cut into two 1g.10gb slices (GPU instances 7 and 8).
    let migs = [MigSpec::h100_1g_10gb(1, 7), MigSpec::h100_1g_10gb(1, 8)];
    let w = LockedFake::with_mig("mig", 2, &migs);
    let slice = w.fake.mig_device(1, 1).unwrap();
    w.fake.set_process_memory(slice, 4242, 6 << 30).unwrap();
    let sampler = SamplerHandle::start(config());
    let snap = wait_for(&sampler, "samples of the slices", |s| {
        s.gpus
            .iter()
            .find(|g| g.uuid == migs[1].uuid)
            .is_some_and(|g| g.last.is_some() && !g.processes.is_empty())
    });
    let uuids: Vec<&str> = snap.gpus.iter().map(|g| g.uuid.as_str()).collect();
    let parent = w.fake.gpu_uuid(1);
    assert_eq!(
        uuids,
        [
            w.fake.gpu_uuid(0).as_str(),
            &parent,
            &migs[0].uuid,
            &migs[1].uuid
        ]
    );
    let s = &snap.gpus[3];
    // The slice's own capacity and usage, under its GPU's index.
    assert_eq!(s.index, 1);
    assert_eq!(s.total_bytes, 9984 << 20);
    let last = s.last.unwrap();
    assert_eq!(last.used_bytes, 6 << 30);
    assert_eq!(last.usable_bytes(), 9984 << 20);
    assert_eq!(s.processes[0].pid, 4242);
    assert_eq!(
        s.mig,
        Some(MigSlice {
            parent_uuid: parent.clone(),
            gpu_instance_id: 8,
            profile: "1g.10gb".into(),
        })
    );
    assert_eq!(snap.gpus[1].mig, None);
    assert_eq!(snap.gpus[1].total_bytes, 81559 << 20);
    // Samples drain under the slice's UUID, which a rank on it reports.
    let drained = sampler.drain_samples();
    let (_, samples) = drained.iter().find(|(u, _)| *u == migs[1].uuid).unwrap();
    assert!(samples.iter().all(|x| x.total_bytes == 9984 << 20));
    // A client that names the slice with PyTorch's bare UUID and `GPU-`.
    let as_gpu = migs[1].uuid.replacen("MIG-", "GPU-", 1);
    assert_eq!(
        sampler.device_uuid(&as_gpu).as_deref(),
        Some(migs[1].uuid.as_str())
    );
    assert_eq!(
        sampler.device_uuid(&parent).as_deref(),
        Some(parent.as_str())
    );
    assert_eq!(
        sampler.device_uuid("GPU-ffffffff-0000-0000-0000-000000000000"),
        None
    );
    assert_eq!(errors(&snap, NvmlCall::Mig), 0);
    sampler.stop();
}

#[test]
fn a_gpu_whose_mig_calls_fail_is_sampled_whole_and_the_failure_counted() {
    let w = LockedFake::with_mig("mig-fail", 1, &[MigSpec::h100_1g_10gb(0, 7)]);
    w.fake.set_call_failure(Call::Mig, Some(codes::UNKNOWN));
    let sampler = SamplerHandle::start(config());
    let snap = wait_for(&sampler, "a sample", |s| {
        s.gpus.first().is_some_and(|g| g.last.is_some())
    });
    assert_eq!(snap.gpus.len(), 1);
    assert!(errors(&snap, NvmlCall::Mig) >= 1);
    sampler.stop();
}

#[test]
fn pending_samples_are_bounded_and_drops_counted() {
    let _world = LockedFake::new("pending", 1);
    let sampler = SamplerHandle::start(SamplerConfig {
        pending_capacity: 4,
        ..config()
    });
    let snap = wait_for(&sampler, "drops", |s| s.pending_dropped_total >= 3);
    assert!(snap.gpus[0].samples_total >= 7);
    let drained = sampler.drain_samples();
    assert_eq!(drained[0].1.len(), 4);
    // The newest are kept, in order.
    let last = sampler.snapshot(monotonic_ns()).gpus[0].last.unwrap();
    assert!(drained[0]
        .1
        .windows(2)
        .all(|w| w[0].monotonic_ns < w[1].monotonic_ns));
    assert!(drained[0].1[3].monotonic_ns <= last.monotonic_ns);
    sampler.stop();
}

#[test]
fn a_lost_gpu_is_retried_once_per_process_interval_while_others_keep_sampling() {
    let world = LockedFake::new("lost", 2);
    let sampler = SamplerHandle::start(config());
    wait_for(&sampler, "sampling", |s| {
        s.nvml_up && s.gpus.iter().all(|g| g.samples_total > 0)
    });
    world.fake.set_gpu_lost(1, true);
    let snap = wait_for_within(&sampler, "gpu 1 down", Duration::from_secs(5), |s| {
        !s.gpus[1].up
    });
    let (errs0, ticks0, good0) = (
        errors(&snap, NvmlCall::MemoryInfo),
        snap.ticks_total,
        snap.gpus[0].samples_total,
    );
    // At least 1 s and 50 ticks, however slowly a loaded machine runs them.
    let since = Instant::now();
    let snap = wait_for_within(&sampler, "50 ticks and 1 s", Duration::from_secs(30), |s| {
        s.ticks_total - ticks0 >= 50 && since.elapsed() >= Duration::from_secs(1)
    });
    // Bounds the retries from above: read before the snapshot was taken.
    let elapsed = since.elapsed();
    assert!(snap.nvml_up);
    assert!(snap.gpus[0].up && !snap.gpus[1].up);
    let ticks = snap.ticks_total - ticks0;
    assert!(snap.gpus[0].samples_total - good0 >= 50);
    // Retried once per 200 ms process interval, not once a tick: at most
    // two more than the intervals that passed (a retry at each end),
    // and at least one in the second that passed.
    let errs = errors(&snap, NvmlCall::MemoryInfo) - errs0;
    let intervals = (elapsed.as_millis() / 200) as u64;
    assert!(
        (1..=intervals + 2).contains(&errs),
        "{errs} memory errors in {ticks} ticks and {elapsed:?}"
    );

    world.fake.set_gpu_lost(1, false);
    wait_for_within(&sampler, "gpu 1 back", Duration::from_secs(5), |s| {
        s.gpus[1].up
    });
    sampler.stop();
}

#[test]
fn nvml_gone_is_detected_and_reinitialised() {
    let world = LockedFake::new("gone", 2);
    let sampler = SamplerHandle::start(config());
    wait_for(&sampler, "up", |s| s.nvml_up);
    // One GPU lost first: its skipped reads must not hide NVML going away.
    world.fake.set_gpu_lost(1, true);
    wait_for_within(&sampler, "gpu 1 down", Duration::from_secs(5), |s| {
        !s.gpus[1].up
    });
    world.fake.set_unavailable(true);
    let snap = wait_for_within(&sampler, "down", Duration::from_secs(5), |s| !s.nvml_up);
    assert!(snap.status.contains("NVML"), "{}", snap.status);
    let counted: Vec<u64> = snap.gpus.iter().map(|g| g.samples_total).collect();
    world.fake.set_unavailable(false);
    world.fake.set_gpu_lost(1, false);
    // A counter: re-initialising NVML does not start it again from 0, so
    // new samples count on from where it stood.
    // new samples count on from where it stood: no snapshot, from the first
    // one after re-initialisation, shows less (a counter that restarted at 0
    // would, until it caught up).
    let snap = wait_for(&sampler, "up again", |s| {
        for (g, &before) in s.gpus.iter().zip(&counted) {
            assert!(
                g.samples_total >= before,
                "samples_total fell from {before} to {}",
                g.samples_total
            );
        }
        s.nvml_up
            && s.gpus.len() == counted.len()
            && s.gpus
                .iter()
                .zip(&counted)
                .all(|(g, &before)| g.up && g.samples_total > before)
    });
    assert!(snap.init_attempts_total >= 2);
    sampler.stop();
}

fn assert_stops_promptly(sampler: SamplerHandle) {
    let t = Instant::now();
    sampler.stop();
    let took = t.elapsed();
    assert!(took < Duration::from_millis(500), "{took:?}");
}

#[test]
fn stop_returns_promptly_while_sampling_and_during_backoff() {
    let world = LockedFake::new("stop", 1);
    let sampler = SamplerHandle::start(SamplerConfig {
        memory_interval: Duration::from_secs(5),
        ..config()
    });
    wait_for(&sampler, "first tick", |s| s.ticks_total >= 1);
    assert_stops_promptly(sampler);

    world.fake.set_unavailable(true);
    let sampler = SamplerHandle::start(SamplerConfig {
        retry_min: Duration::from_secs(30),
        retry_max: Duration::from_secs(30),
        ..config()
    });
    wait_for(&sampler, "init failed", |s| {
        s.init_attempts_total >= 1 && !s.nvml_up && s.status.contains("initialised:")
    });
    assert_stops_promptly(sampler);
}
