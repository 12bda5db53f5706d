//! Diagnostic (issue #10): can step 2's own optimizer-begin/end layouts,
//! put through the markers-only layout rule
//! ([`stepwatch_core::step2_new_segments_with`]), predict what the cache
//! grows by after step 2, as step 1's predict step 2's growth?
//!
//! Input: kept `--record` files of the trace variant (real PyTorch 2.15 on
//! fake CUDA, `bench/torch-accuracy.sh --variants trace --keep`). For each
//! rank's step-1 allocator trace, the exact replay plays steps 2..=6 with
//! no reserved limit ([`stepwatch_core::replay_optimizer_layouts`]); the
//! layouts it passes through at each step's optimizer begin and end are
//! what a markers-only client would snapshot there. Step 1's pair is
//! rebuilt from the trace (the optimizer's events undone from the end
//! layout, as `layout_probe` on branch h7-over does). Both pairs go through
//! the rule with the context the tracker builds (the hello's parameter
//! bytes, the gradients' fate; no reserved limit), large pool only, as the
//! client sends them.
//!
//! Per rank it prints, in MiB: the replay's growth in step 2 (peak over
//! reserved at step 1's end) and the rule on step 1's pair; the replay's
//! growth after step 2 (the highest peak of steps 3..=6 over reserved at
//! step 2's end) and the rule on step 2's pair; the rule on step 3's pair
//! (what a revision at step 3 would add); and each replayed step's growth
//! over the step before's end.
//!
//! ```text
//! cargo build -p stepwatch-core --example step3_probe
//! target/debug/examples/step3_probe /tmp/tacc.*/rNNN/record.jsonl ...
//! ```
use std::collections::HashMap;

use stepwatch_core::allocator::{self, BlockLayout, Pool, SegmentLayout};
use stepwatch_core::{
    replay_optimizer_layouts, step2_new_segments_with, AllocatorAction, AllocatorTrace, Gradients,
    LayoutContext, PhaseKind, RecordEntry,
};

const MIB: f64 = 1048576.0;
/// Steps replayed after step 1: 2..=6.
const STEPS: usize = 5;

fn main() {
    for path in std::env::args().skip(1) {
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // (job, rank) → parameter bytes, from the hello and later facts.
        let mut parameter_bytes: HashMap<(String, u32), Option<u64>> = HashMap::new();
        for line in text.lines() {
            let Ok(entry) = serde_json::from_str::<RecordEntry>(line) else {
                continue;
            };
            match entry {
                RecordEntry::Open { info, .. } => {
                    parameter_bytes.insert((info.job, info.rank), info.model.parameter_bytes);
                }
                RecordEntry::ModelFacts { key, update, .. } => {
                    if let Some(p) = update.parameter_bytes {
                        parameter_bytes.insert((key.job, key.rank), Some(p));
                    }
                }
                RecordEntry::AllocatorTrace {
                    key,
                    trace,
                    gradients,
                    grads_persistent,
                    ddp_bucket_rebuild,
                    ..
                } => {
                    let gradients =
                        gradients.unwrap_or(Gradients::from_persistent(grads_persistent));
                    let context = LayoutContext {
                        gradient_bytes: parameter_bytes
                            .get(&(key.job.clone(), key.rank))
                            .copied()
                            .flatten(),
                        reserved_limit: None,
                        gradients_alive_in_forward: gradients != Gradients::FreedBeforeStep,
                    };
                    probe(
                        &key.job,
                        key.rank,
                        &trace,
                        gradients,
                        ddp_bucket_rebuild.as_ref(),
                        &context,
                    );
                }
                _ => {}
            }
        }
    }
}

fn probe(
    job: &str,
    rank: u32,
    trace: &AllocatorTrace,
    gradients: Gradients,
    ddp: Option<&stepwatch_core::DdpBucketRebuild>,
    context: &LayoutContext,
) {
    let steps = match replay_optimizer_layouts(trace, gradients, ddp, STEPS) {
        Ok(s) => s,
        Err(e) => {
            println!("{job} {rank}: replay failed: {e}");
            return;
        }
    };
    let rule = |begin: &[SegmentLayout], end: &[SegmentLayout]| {
        step2_new_segments_with(&large(begin), &large(end), context)
            .map(|e| e.new_segment_bytes as f64 / MIB)
            .unwrap_or(f64::NAN)
    };
    let reserved = |l: &[SegmentLayout]| l.iter().map(|s| s.size()).sum::<u64>();
    let step1_end = reserved(&trace.segments);
    let step1_rule = rule(&layout_at_optimizer_begin(trace), &trace.segments);
    // Growth of each replayed step over the reserved bytes the step before
    // ended with.
    let mut before = step1_end;
    let growth: Vec<f64> = steps
        .iter()
        .map(|s| {
            let g = s.reserved_peak_bytes.saturating_sub(before) as f64 / MIB;
            before = reserved(&s.optimizer_end);
            g
        })
        .collect();
    let Some(step2) = steps.first() else {
        println!("{job} {rank}: nothing replayed");
        return;
    };
    let step2_end = reserved(&step2.optimizer_end);
    let after_step2 = steps
        .iter()
        .skip(1)
        .map(|s| s.reserved_peak_bytes)
        .max()
        .unwrap_or(0)
        .saturating_sub(step2_end) as f64
        / MIB;
    let step2_rule = rule(&step2.optimizer_begin, &step2.optimizer_end);
    let step3_rule = steps
        .get(1)
        .map_or(f64::NAN, |s| rule(&s.optimizer_begin, &s.optimizer_end));
    println!(
        "{job:58} {rank} {gradients:?}: step2 real {:7.1} rule(s1) {step1_rule:7.1} | \
         after-step2 real {after_step2:7.1} rule(s2) {step2_rule:7.1} rule(s3) {step3_rule:7.1} \
         | per step {:?}",
        growth.first().copied().unwrap_or(0.0),
        growth
            .iter()
            .map(|g| (g * 10.0).round() / 10.0)
            .collect::<Vec<_>>()
    );
}

/// The large pool's segments: what the client's snapshots hold.
fn large(layout: &[SegmentLayout]) -> Vec<SegmentLayout> {
    layout
        .iter()
        .filter(|s| s.pool == Pool::Large)
        .cloned()
        .collect()
}

/// Step 1's layout at its optimizer begin: the trace's end layout with the
/// optimizer phase's events undone (latest first).
fn layout_at_optimizer_begin(trace: &AllocatorTrace) -> Vec<SegmentLayout> {
    let mut segments = trace.segments.clone();
    for e in trace
        .events
        .iter()
        .rev()
        .filter(|e| e.phase == PhaseKind::Optimizer)
    {
        match e.action {
            AllocatorAction::Alloc => mark(&mut segments, e.address, None),
            AllocatorAction::Free => mark(
                &mut segments,
                e.address,
                Some(allocator::round_size(e.size)),
            ),
            AllocatorAction::SegmentAlloc => segments.retain(|s| s.address != e.address),
            _ => {}
        }
    }
    segments
}

/// Undoes one event on the block at `address`: an allocation (`None`)
/// frees it, a free (`Some(size)`) allocates `size` bytes there again.
fn mark(segments: &mut [SegmentLayout], address: u64, size: Option<u64>) {
    let Some(s) = segments
        .iter_mut()
        .find(|s| s.address <= address && address < s.address + s.size())
    else {
        return;
    };
    let mut blocks = Vec::new();
    let mut start = s.address;
    for b in &s.blocks {
        let end = start + b.size;
        match size {
            None if start == address => blocks.push(BlockLayout {
                size: b.size,
                allocated: false,
            }),
            Some(n) if !b.allocated && start <= address && address < end => {
                let n = n.min(end - address);
                for (len, allocated) in [
                    (address - start, false),
                    (n, true),
                    (end - address - n, false),
                ] {
                    if len > 0 {
                        blocks.push(BlockLayout {
                            size: len,
                            allocated,
                        });
                    }
                }
            }
            _ => blocks.push(*b),
        }
        start = end;
    }
    let mut merged: Vec<BlockLayout> = Vec::new();
    for b in blocks {
        match merged.last_mut() {
            Some(last) if !last.allocated && !b.allocated => last.size += b.size,
            _ => merged.push(b),
        }
    }
    s.blocks = merged;
}
