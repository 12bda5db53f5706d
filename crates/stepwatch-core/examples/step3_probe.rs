//! Diagnostic: can step 2's own optimizer-begin/end layouts, put through the
//! markers-only layout rule ([`stepwatch_core::step2_new_segments_with`]),
//! predict what the cache grows by after step 2, as step 1's predict step
//! 2's growth?
//!
//! Input: kept `--record` files of the trace variant (real PyTorch 2.15 on
//! fake CUDA, `bench/torch-accuracy.sh --variants trace --keep`). For each
//! rank's step-1 allocator trace, the exact replay plays steps 2..=6 with
//! no reserved limit ([`stepwatch_core::replay_optimizer_layouts`]); the
//! layouts it passes through at each step's optimizer begin and end are
//! what a markers-only client would snapshot there. Step 1's pair is
//! rebuilt from the trace (the optimizer's events undone from the end
//! layout, `common::layout_at_optimizer_begin`). Both pairs go through the
//! rule with the context the tracker builds (the hello's parameter
//! bytes, the gradients' fate; no reserved limit), large pool only, as the
//! client sends them.
//!
//! Per rank it prints, in MiB:
//! - `s1begin-vs-s2end`: the rule on step 1's optimizer-begin layout (its
//!   requests: what each step's forward and backward ask for) served from
//!   step 2's end layout; `flagged`: the same with step 2's gradients freed
//!   first where step 3 frees them before its forward (what per-block
//!   gradient flags from the client would allow);
//! - `end-vs-end`: the rule on step 2's end layout as both begin and end
//!   (what it gives when the optimizer changed nothing), and per replayed
//!   step how many large segments it shares with the step before changed
//!   their blocks;
//! - the replay's growth in step 2 (peak over reserved at step 1's end) and
//!   the rule on step 1's pair (`rule(s1)`); the replay's growth after step
//!   2 (the highest peak of steps 3..=6 over reserved at step 2's end) and
//!   the rule on step 2's pair (`rule(s2)`) and step 3's; each replayed
//!   step's growth over the step before's end.
//!
//! `V=1` lists the large segments at each pair's begin (MiB, free blocks in
//! brackets, `*`: changed by the end) on stderr.
//!
//! ```text
//! cargo build -p stepwatch-core --example step3_probe
//! target/debug/examples/step3_probe /tmp/tacc.*/rNNN/record.jsonl ...
//! ```
//!
//! What it found is in BENCHMARKS.md, under "Step 3".
mod common;
use common::layout_at_optimizer_begin;

use std::collections::HashMap;

use stepwatch_core::allocator::{BlockLayout, Pool, SegmentLayout};
use stepwatch_core::{
    replay_optimizer_layouts, step2_new_segments_with, AllocatorTrace, Gradients, LayoutContext,
    RecordEntry,
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
                        // Unflagged snapshots (the probe's finding): no live limit.
                        live_limit: None,
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
    if std::env::var_os("V").is_some() {
        let pairs = [
            (1, layout_at_optimizer_begin(trace), trace.segments.clone()),
            (
                2,
                step2.optimizer_begin.clone(),
                step2.optimizer_end.clone(),
            ),
        ];
        for (step, begin, end) in pairs.iter().chain(
            steps
                .get(1)
                .map(|s| (3, s.optimizer_begin.clone(), s.optimizer_end.clone()))
                .iter(),
        ) {
            eprintln!("  step {step} optimizer begin (large pool; * = changed by end):");
            for s in large(begin) {
                let changed = if end.contains(&s) { ' ' } else { '*' };
                eprintln!("   {changed} {}", show(&s));
            }
            for s in large(end).iter().filter(|e| !begin.contains(e)) {
                eprintln!("   end {}", show(s));
            }
        }
    }
    let step3_rule = steps
        .get(1)
        .map_or(f64::NAN, |s| rule(&s.optimizer_begin, &s.optimizer_end));
    // The same point one step apart: of the segments a step's end layout
    // shares with the step before's (by address), those whose blocks differ.
    let ends: Vec<&[SegmentLayout]> = std::iter::once(trace.segments.as_slice())
        .chain(steps.iter().map(|s| s.optimizer_end.as_slice()))
        .collect();
    let moved: Vec<usize> = ends
        .windows(2)
        .map(|w| {
            let (a, b) = (large(w[0]), large(w[1]));
            b.iter()
                .filter(|s| a.iter().any(|p| p.address == s.address && p != *s))
                .count()
        })
        .collect();
    let end_end = rule(&step2.optimizer_end, &step2.optimizer_end);
    // Step 1's requests (its optimizer-begin layout) served from step 2's
    // end; then from it with step 2's gradients freed where step 3 frees
    // them before its forward (as a client's per-block gradient flags
    // would let the agent do).
    let step1_begin = layout_at_optimizer_begin(trace);
    let cross = rule(&step1_begin, &step2.optimizer_end);
    let cross_flagged = if gradients == Gradients::FreedBeforeStep {
        rule(
            &step1_begin,
            &freed_at(&step2.optimizer_end, &step2.gradients_at_end),
        )
    } else {
        cross
    };
    println!(
        "{job:58} {rank} {gradients:?}: s1begin-vs-s2end {cross:7.1} flagged {cross_flagged:7.1} end-vs-end rule {end_end:5.1} changed-old-segments \
         {moved:?} | step2 real {:7.1} rule(s1) {step1_rule:7.1} | \
         after-step2 real {after_step2:7.1} rule(s2) {step2_rule:7.1} rule(s3) {step3_rule:7.1} \
         | per step {:?}",
        growth.first().copied().unwrap_or(0.0),
        growth
            .iter()
            .map(|g| (g * 10.0).round() / 10.0)
            .collect::<Vec<_>>()
    );
}

/// A segment as `address size: [blocks]` in MiB, free blocks in brackets.
fn show(s: &SegmentLayout) -> String {
    let blocks: Vec<String> = s
        .blocks
        .iter()
        .map(|b| {
            let m = b.size as f64 / MIB;
            if b.allocated {
                format!("{m:.2}")
            } else {
                format!("[{m:.2}]")
            }
        })
        .collect();
    format!(
        "{:x}{} {:.2}: {}",
        s.address,
        if s.expandable { " exp" } else { "" },
        s.size() as f64 / MIB,
        blocks.join(" ")
    )
}

/// `layout` with the blocks that start at `addresses` (ascending) freed.
fn freed_at(layout: &[SegmentLayout], addresses: &[u64]) -> Vec<SegmentLayout> {
    layout
        .iter()
        .map(|s| {
            let mut blocks: Vec<BlockLayout> = Vec::new();
            let mut at = s.address;
            for b in &s.blocks {
                let free = !b.allocated || addresses.binary_search(&at).is_ok();
                at += b.size;
                match blocks.last_mut() {
                    Some(last) if free && !last.allocated => last.size += b.size,
                    _ => blocks.push(BlockLayout {
                        size: b.size,
                        allocated: !free,
                        gradient: false,
                    }),
                }
            }
            SegmentLayout {
                blocks,
                ..s.clone()
            }
        })
        .collect()
}

/// The large pool's segments: what the client's snapshots hold.
fn large(layout: &[SegmentLayout]) -> Vec<SegmentLayout> {
    layout
        .iter()
        .filter(|s| s.pool == Pool::Large)
        .cloned()
        .collect()
}
