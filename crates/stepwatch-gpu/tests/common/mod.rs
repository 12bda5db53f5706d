//! What the sampler's test binaries share: a fast sampler over fake-nvml and
//! a wait on its snapshot.

use std::time::{Duration, Instant};

use stepwatch_clock::monotonic_ns;
use stepwatch_gpu::{SamplerConfig, SamplerHandle, SamplerSnapshot};

/// A sampler config over the fake's cdylib that samples every 5 ms.
pub fn config() -> SamplerConfig {
    SamplerConfig {
        lib_path: Some(fake_nvml::find_cdylib().expect("libfake_nvml.so near the test")),
        memory_interval: Duration::from_millis(5),
        process_interval: Duration::from_millis(200),
        retry_min: Duration::from_millis(50),
        retry_max: Duration::from_millis(200),
        ..SamplerConfig::default()
    }
}

/// [`wait_for_within`] 10 s, the bound most waits need on a busy machine.
pub fn wait_for(
    sampler: &SamplerHandle,
    what: &str,
    f: impl Fn(&SamplerSnapshot) -> bool,
) -> SamplerSnapshot {
    wait_for_within(sampler, what, Duration::from_secs(10), f)
}

/// The first snapshot `f` accepts; panics with the last one after `timeout`.
pub fn wait_for_within(
    sampler: &SamplerHandle,
    what: &str,
    timeout: Duration,
    f: impl Fn(&SamplerSnapshot) -> bool,
) -> SamplerSnapshot {
    let start = Instant::now();
    loop {
        let snap = sampler.snapshot(monotonic_ns());
        if f(&snap) {
            return snap;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out waiting for {what}: {snap:#?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
