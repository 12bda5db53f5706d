//! What replaying step 1's allocator trace costs the agent, once per rank.
//!
//! Builds a transformer-like step 1 on the allocator model (per layer and
//! micro-batch 8 activations and a temporary in forward; gradients, a
//! temporary and the frees in backward; Adam's two states per parameter
//! tensor in the optimizer phase), records it as a client would, and times
//! the replay as the agent runs it (`replay_step2_within`, with the GPU's
//! limit: here 95% of what the unlimited replay needs, so the limited replay
//! releases the cache and both runs are made). Prints events, blocks and the
//! median of 9 runs.
//!
//! ```text
//! cargo run --release -p stepwatch-core --example replay_cost [-- LAYERS MICRO_BATCHES]
//! cargo run --release -p stepwatch-core --example replay_cost -- --segments N
//! ```
//!
//! `--segments N`: a step 1 whose forward makes N temporaries of 20 MiB,
//! each freed and its segment released (`empty_cache()`), and whose
//! optimizer keeps N states of 12 MiB (N segments in use). Step 2 releases
//! the cache N times with N segments in use: the release path's cost
//! against the number of segments.

use std::time::Instant;

use stepwatch_core::allocator::CachingAllocator;
use stepwatch_core::{
    replay_step2, replay_step2_within, AllocatorAction, AllocatorEvent, AllocatorTrace, PhaseKind,
};

const MIB: u64 = 1 << 20;

fn main() {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.first().map(String::as_str) == Some("--segments") {
        let n = raw.get(1).and_then(|a| a.parse().ok()).unwrap_or(8192);
        report(&format!("{n} segments"), &segments_trace(n));
        return;
    }
    let args: Vec<u64> = raw.iter().filter_map(|a| a.parse().ok()).collect();
    let layers = args.first().copied().unwrap_or(96);
    let micro_batches = args.get(1).copied().unwrap_or(8);
    report(
        &format!("{layers} layers × {micro_batches} micro-batches"),
        &transformer_trace(layers, micro_batches),
    );
}

/// N released temporaries, then N states (see the module documentation).
fn segments_trace(n: u64) -> AllocatorTrace {
    let mut a = CachingAllocator::new();
    let mut events = Vec::new();
    use AllocatorAction::*;
    for _ in 0..n {
        let t = a.malloc(20 * MIB, u64::MAX).unwrap();
        let at = a.address_of(t).unwrap();
        a.free(t);
        a.release_free_segments();
        for action in [Alloc, Free, SegmentFree] {
            events.push(event(action, at, 20 * MIB, PhaseKind::Forward));
        }
    }
    for _ in 0..n {
        let s = a.malloc(12 * MIB, u64::MAX).unwrap();
        let at = a.address_of(s).unwrap();
        events.push(event(Alloc, at, 12 * MIB, PhaseKind::Optimizer));
    }
    step1_trace(&a, events)
}

/// A transformer-like step 1 (see the module documentation).
fn transformer_trace(layers: u64, micro_batches: u64) -> AllocatorTrace {
    let mut a = CachingAllocator::new();
    let mut events = Vec::new();
    let mut record = |a: &CachingAllocator, action, id, size, phase| {
        events.push(event(action, a.address_of(id).unwrap(), size, phase));
    };
    // Weights: 6 tensors per layer.
    let params: Vec<u64> = (0..layers * 6).map(|i| (4 + i % 5) * 3 * MIB).collect();
    for &p in &params {
        a.malloc(p, u64::MAX).unwrap();
    }
    let acts = [
        24 * MIB,
        24 * MIB,
        72 * MIB,
        96 * MIB,
        96 * MIB,
        96 * MIB,
        3 * MIB,
        1000,
    ];
    let mut grads_exist = false;
    for _ in 0..micro_batches {
        let mut live = Vec::new();
        for _ in 0..layers {
            for &s in &acts {
                let id = a.malloc(s, u64::MAX).unwrap();
                record(&a, AllocatorAction::Alloc, id, s, PhaseKind::Forward);
                live.push((id, s));
            }
            let t = a.malloc(96 * MIB, u64::MAX).unwrap();
            record(&a, AllocatorAction::Alloc, t, 96 * MIB, PhaseKind::Forward);
            record(&a, AllocatorAction::Free, t, 96 * MIB, PhaseKind::Forward);
            a.free(t);
        }
        for layer in (0..layers as usize).rev() {
            for &p in &params[layer * 6..layer * 6 + 6] {
                let g = a.malloc(p, u64::MAX).unwrap();
                record(&a, AllocatorAction::Alloc, g, p, PhaseKind::Backward);
                if grads_exist {
                    record(&a, AllocatorAction::Free, g, p, PhaseKind::Backward);
                    a.free(g);
                }
            }
            for (id, s) in live.drain(layer * acts.len()..) {
                record(&a, AllocatorAction::Free, id, s, PhaseKind::Backward);
                a.free(id);
            }
        }
        grads_exist = true;
    }
    for &p in &params {
        for _ in 0..2 {
            let s = a.malloc(p * 2, u64::MAX).unwrap();
            record(&a, AllocatorAction::Alloc, s, p * 2, PhaseKind::Optimizer);
        }
    }
    step1_trace(&a, events)
}

/// An event on the default stream.
fn event(action: AllocatorAction, address: u64, size: u64, phase: PhaseKind) -> AllocatorEvent {
    AllocatorEvent {
        action,
        address,
        size,
        phase,
        stream: 0,
    }
}

/// The step-1 trace of `events`, ending with `a`'s layout.
fn step1_trace(a: &CachingAllocator, events: Vec<AllocatorEvent>) -> AllocatorTrace {
    AllocatorTrace {
        step: 1,
        segments: a.layout(),
        events,
        settings: None,
        forward_returns: Vec::new(),
        torch_version: String::new(),
    }
}

/// Times the replay of `trace` as the agent runs it and prints the figures.
fn report(label: &str, trace: &AllocatorTrace) {
    let blocks: usize = trace.segments.iter().map(|s| s.blocks.len()).sum();
    let need = replay_step2(trace, false)
        .expect("a valid trace")
        .steady_reserved_peak_bytes;
    let limit = Some(need / 20 * 19);
    let mut times = Vec::new();
    let mut result = None;
    for _ in 0..9 {
        let t = Instant::now();
        result = Some(replay_step2_within(trace, false, limit).expect("a valid trace"));
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let r = result.unwrap();
    println!(
        "{label}: {} events, {} segments, {blocks} blocks; replay median {:.1} ms (min {:.1}, \
         max {:.1}); step 2 adds {:.2} GB of segments; {} cache releases within the limit",
        trace.events.len(),
        trace.segments.len(),
        times[4],
        times[0],
        times[8],
        r.new_segment_bytes as f64 / 1e9,
        r.within_limit.map_or(0, |w| w.alloc_retries)
    );
}
