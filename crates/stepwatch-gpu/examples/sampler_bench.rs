//! The sampler alone on fake NVML: its thread's CPU per GPU sample and its
//! tick lateness (p50/p99 from the lag histogram, max from the trailing max).
//!
//!   cargo run --release -p stepwatch-gpu --example sampler_bench -- [GPUS=8] [HZ=100] [SECONDS=60]
//!
//! bench/sampler-jitter.sh runs it with the other cores busy.

use std::time::Duration;

use fake_nvml::{FakeNvml, GpuSpec, STATE_DIR_ENV};
use stepwatch_clock::monotonic_ns;
use stepwatch_gpu::{SamplerConfig, SamplerHandle, SamplerSnapshot};

fn sampler_cpu_ns() -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.starts_with("stepwatch-sampl") {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
            total += stat
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    total
}

fn samples(s: &SamplerSnapshot) -> u64 {
    s.gpus.iter().map(|g| g.samples_total).sum()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: f64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let (gpus, hz, secs) = (arg(0, 8.0) as u32, arg(1, 100.0), arg(2, 60.0));

    let dir = std::env::temp_dir().join(format!("sampler-bench-{}", std::process::id()));
    let specs: Vec<_> = (0..gpus).map(GpuSpec::h100_80gb).collect();
    let _fake = FakeNvml::create(&dir, &specs).expect("create fake GPUs");
    std::env::set_var(STATE_DIR_ENV, &dir);
    let sampler = SamplerHandle::start(SamplerConfig {
        lib_path: Some(fake_nvml::find_cdylib().expect("libfake_nvml.so next to the example")),
        memory_interval: Duration::from_secs_f64(1.0 / hz),
        ..SamplerConfig::default()
    });

    std::thread::sleep(Duration::from_secs(3));
    let (c0, s0) = (sampler_cpu_ns(), sampler.snapshot(monotonic_ns()));
    let mut lag_max: f64 = 0.0;
    let mut left = secs;
    while left > 0.0 {
        let step = left.min(1.0);
        std::thread::sleep(Duration::from_secs_f64(step));
        left -= step;
        lag_max = lag_max.max(sampler.snapshot(monotonic_ns()).lag_max_seconds);
    }
    let (c1, s1) = (sampler_cpu_ns(), sampler.snapshot(monotonic_ns()));
    sampler.stop();
    let _ = std::fs::remove_dir_all(&dir);

    // The histogram over the measured window only.
    let mut window = s1.clone();
    window.lag_count -= s0.lag_count;
    window.lag_sum_seconds -= s0.lag_sum_seconds;
    for (w, b) in window.lag_histogram.iter_mut().zip(&s0.lag_histogram) {
        w.1 -= b.1;
    }
    let n = samples(&s1) - samples(&s0);
    let q = |p| window.lag_quantile_seconds(p).unwrap_or(f64::NAN) * 1e3;
    println!(
        "gpus={gpus} hz={hz} window={secs:.0}s samples={n} (expected {:.0}) ticks={}",
        gpus as f64 * hz * secs,
        window.lag_count
    );
    println!(
        "sampler CPU per GPU sample: {:8.0} ns  ({:.0} ns per tick)",
        (c1 - c0) as f64 / n.max(1) as f64,
        (c1 - c0) as f64 / window.lag_count.max(1) as f64
    );
    println!(
        "tick lateness: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms, mean {:.3} ms; late ticks {}",
        q(0.5),
        q(0.99),
        lag_max * 1e3,
        window.lag_sum_seconds / window.lag_count.max(1) as f64 * 1e3,
        s1.late_ticks_total - s0.late_ticks_total
    );
}
