//! A hung NVML call, against fake-nvml's call delay.
//!
//! Its own test binary: the hung read never returns, so this process's
//! fake NVML is never shut down and must not be shared with other tests.

use std::time::{Duration, Instant};

use fake_nvml::{Call, LockedFake};
use stepwatch_gpu::{SamplerConfig, SamplerHandle};

mod common;
use common::{config, wait_for};

#[test]
fn a_hung_memory_read_marks_the_gpu_stale_and_stop_does_not_wait_for_it() {
    let world = LockedFake::new("hang", 1);
    let sampler = SamplerHandle::start(SamplerConfig {
        stale_after: Duration::from_millis(300),
        ..config()
    });
    let snap = wait_for(&sampler, "sampling", |s| {
        s.gpus.first().is_some_and(|g| g.samples_total > 0)
    });
    assert!(snap.gpus[0].up && !snap.gpus[0].stale);

    // The read hangs: no error, no new sample, the last figures stay.
    world
        .fake
        .set_call_delay(Call::MemoryInfo, Duration::from_secs(3600));
    let snap = wait_for(&sampler, "stale", |s| s.gpus[0].stale);
    let gpu = &snap.gpus[0];
    assert!(!gpu.up, "a stale GPU is reported down");
    assert!(gpu.sample_age_seconds > 0.3, "{}", gpu.sample_age_seconds);
    assert!(gpu.last.is_some(), "the frozen figures are still shown");
    assert!(snap.nvml_up, "NVML itself never said it failed");

    // Stop cannot interrupt the call; it gives up after its bound.
    let t = Instant::now();
    assert!(!sampler.stop_within(Duration::from_millis(200)));
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}
