//! The cost of waking a thread at a fixed rate and doing nothing else: the
//! floor under the sampler's CPU per tick on this machine.
//!
//!   cargo run --release -p stepwatch-gpu --example wakeup_floor -- [HZ=100] [SECONDS=30]
//!
//! Divide the per-tick figure by the GPU count to compare it with the
//! sampler's CPU per GPU sample (bench/agent-cpu.sh).

use std::time::{Duration, Instant};

fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<f64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let hz = args.first().copied().unwrap_or(100.0);
    let seconds = args.get(1).copied().unwrap_or(30.0);
    let period = Duration::from_secs_f64(1.0 / hz);
    let handle = std::thread::spawn(move || {
        let start = Instant::now();
        let cpu0 = thread_cpu_ns();
        let mut ticks = 0u64;
        while start.elapsed().as_secs_f64() < seconds {
            ticks += 1;
            let deadline = start + period * ticks as u32;
            if let Some(wait) = deadline.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        (ticks, thread_cpu_ns() - cpu0)
    });
    let (ticks, cpu) = handle.join().unwrap();
    println!(
        "{hz} Hz for {seconds} s: {ticks} wake-ups, {:.0} ns of thread CPU per wake-up ({:.0} ns per sample at 8 GPUs)",
        cpu as f64 / ticks as f64,
        cpu as f64 / ticks as f64 / 8.0
    );
}
