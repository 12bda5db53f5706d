//! Diagnostic: the markers-only layout rule (`stepwatch_core::layout`) and
//! candidate rules against the exact step-2 replay, on kept `--record` files
//! of the trace variant (real PyTorch 2.15 on fake CUDA,
//! `bench/torch-accuracy.sh --variants trace --keep`).
//!
//! From each record's step-1 allocator trace it builds what a client without
//! a trace would snapshot (the layouts at OPTIMIZER_BEGIN and OPTIMIZER_END),
//! and what each allocated block is, by the phase that made it: optimizer
//! state, gradient (backward), a training-loop variable step 2 replaces
//! (forward: the logits), or older (parameters). It prints, per rank, the new
//! segment bytes of step 2 by the exact replay ("truth", MiB), by the current
//! rule ("base") and by a candidate ("cand"), with each one's error on the
//! steady reserved peak.
//!
//! ```text
//! cargo build -p stepwatch-core --example layout_probe
//! VAR=v3 target/debug/examples/layout_probe /tmp/tacc.*/rNNN/record.jsonl ...
//! V=1 ...           # each request of the candidate and where it went
//! MARKERS=1 VAR=v3,check,exact ... markers-record.jsonl   # snapshots with the
//!                   # client's `"gradient": true` block flags instead of a trace
//! ```
//!
//! Candidates (`VAR`, comma-separated flags):
//! - (no `v2`/`v3`): the current rule, changed by: gradients set to None
//!   freed in the serving layout (unless `keepgrads`) and asked for again;
//!   the previous logits asked for again (unless `norepl`); `nountouched`:
//!   segments the optimizer left alone serve too; `smallfirst`: smallest
//!   request first; `fsdporder`: the FSDP chain (displaced requests, then
//!   the left-alone segments' free blocks smallest first, from the whole
//!   layout); `split20`: a 20 MiB segment's free block as pieces of 10 MiB.
//! - `v2`: smallest first, gradients freed, the previous logits freed once
//!   their new copy is made.
//! - `v3`: the FSDP chain for every job, requests in segment age order
//!   (highest address first: CUDA hands out new segments below the old
//!   ones, so this is the order step 1 made them in), gradients set to None
//!   freed (`keepgrads`: not); `check`: refused (printed EXCEEDS) when the
//!   requests all alive at once hold more than step 1's allocated peak plus
//!   the state (`exact`: less the small pool); `cap`: instead free the newest
//!   requests to stay under it; `capold`: the oldest (the rule the crate
//!   took, `VAR=v3,capold,exact`); `bwlive`: a request whose range held no
//!   allocated block at step 1's backward begin is freed once served
//!   (`fwtrans`: only in segments that existed then); both fail on GPT,
//!   whose loss temporaries (logits-sized) are freed before backward begins
//!   yet alive together with the forward's activations. `RANK=n`: the
//!   allocator figures (peak, state) of rank n's markers.
mod common;
use common::{layout_at_optimizer_begin, layout_before};

use std::collections::HashMap;

use stepwatch_core::allocator::{BlockLayout, CachingAllocator, Pool, SegmentLayout, LARGE_BUFFER};
use stepwatch_core::{
    replay_step2_with, step2_new_segments, AllocatorAction, AllocatorTrace, Gradients, PhaseKind,
    RecordEntry,
};

const M: f64 = 1048576.0;
thread_local! { static END_ALLOC: std::cell::Cell<u64> = const { std::cell::Cell::new(0) }; }
thread_local! { static BW: std::cell::RefCell<Vec<SegmentLayout>> = const { std::cell::RefCell::new(Vec::new()) }; }
thread_local! { static PEAK: std::cell::Cell<u64> = const { std::cell::Cell::new(0) }; }

#[derive(Clone, Copy, PartialEq, Debug)]
enum Role {
    Persistent,
    Gradient,
    Replaced,
    State,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let verbose = std::env::var_os("V").is_some();
    for path in &args {
        let text = std::fs::read_to_string(path).unwrap();
        let mut peak = 0u64;
        let mut state = 0u64;
        let mut begin_alloc = 0u64;
        for line in text.lines() {
            if !line.contains("\"markers\"") {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let rank = v["markers"]["key"]["rank"].as_u64().unwrap_or(0);
            if rank
                != std::env::var("RANK")
                    .ok()
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(0)
            {
                continue;
            }
            for m in v["markers"]["markers"].as_array().into_iter().flatten() {
                if m["step"] != 1 {
                    continue;
                }
                if m["kind"] == "optimizer_begin" {
                    peak = m["allocator"]["allocated_peak_bytes"].as_u64().unwrap_or(0);
                    begin_alloc = m["allocator"]["allocated_bytes"].as_u64().unwrap_or(0);
                }
                if m["kind"] == "optimizer_end" {
                    state = m["allocator"]["allocated_bytes"]
                        .as_u64()
                        .unwrap_or(0)
                        .saturating_sub(begin_alloc);
                    END_ALLOC
                        .with(|p| p.set(m["allocator"]["allocated_bytes"].as_u64().unwrap_or(0)));
                }
            }
        }
        PEAK.with(|p| p.set(peak + state));
        if std::env::var_os("MARKERS").is_some() {
            markers_mode(&text, &std::env::var("VAR").unwrap_or_default(), verbose);
            continue;
        }
        for line in text.lines() {
            if !line.contains("\"allocator_trace\"") {
                continue;
            }
            let e: RecordEntry = serde_json::from_str(line).unwrap();
            let RecordEntry::AllocatorTrace {
                key,
                trace,
                gradients,
                grads_persistent,
                ddp_bucket_rebuild,
                ..
            } = e
            else {
                continue;
            };
            let g = gradients.unwrap_or(Gradients::from_persistent(grads_persistent));
            let truth = replay_step2_with(&trace, g, None, ddp_bucket_rebuild.as_ref()).unwrap();
            let end = trace.segments.clone();
            let begin = layout_at_optimizer_begin(&trace);
            let roles = roles(&trace);
            let base = step2_new_segments(&begin, &end).unwrap();
            let variant = std::env::var("VAR").unwrap_or_default();
            BW.with(|b| {
                *b.borrow_mut() =
                    layout_before(&trace, &[PhaseKind::Optimizer, PhaseKind::Backward])
            });
            let probe = Probe {
                begin: &begin,
                end: &end,
                roles: &roles,
                grads_freed: g == Gradients::FreedBeforeStep,
                var: &variant,
                verbose,
            };
            let cand = if variant.starts_with("v3") {
                v3(&probe)
            } else if variant.starts_with("v2") {
                v2(&probe)
            } else {
                candidate(&probe)
            };
            let r_end = truth.reserved_at_step1_end_bytes as f64;
            let t = truth.new_segment_bytes as f64;
            let steady = truth.steady_reserved_peak_bytes as f64;
            println!(
                "{:55} {} truth {:7.1} steady {:7.1} base {:7.1} ({:+.2}%) cand {:7.1} ({:+.2}%)",
                key.job,
                key.rank,
                t / M,
                (steady - r_end) / M,
                base.new_segment_bytes as f64 / M,
                100.0 * ((r_end + base.new_segment_bytes as f64) / steady - 1.0),
                cand as f64 / M,
                100.0 * ((r_end + cand as f64) / steady - 1.0)
            );
        }
    }
}

fn block_addresses(s: &SegmentLayout) -> Vec<u64> {
    let mut a = s.address;
    s.blocks
        .iter()
        .map(|b| {
            let r = a;
            a += b.size;
            r
        })
        .collect()
}

/// Address → role of what is alive at the trace's end.
fn roles(trace: &AllocatorTrace) -> HashMap<u64, Role> {
    let mut open: HashMap<u64, PhaseKind> = HashMap::new();
    for e in &trace.events {
        match e.action {
            AllocatorAction::Alloc => {
                open.insert(e.address, e.phase);
            }
            AllocatorAction::Free => {
                open.remove(&e.address);
            }
            _ => {}
        }
    }
    open.into_iter()
        .map(|(a, p)| {
            (
                a,
                match p {
                    PhaseKind::Optimizer => Role::State,
                    PhaseKind::Backward => Role::Gradient,
                    _ => Role::Replaced,
                },
            )
        })
        .collect()
}

fn role(roles: &HashMap<u64, Role>, a: u64, b: &BlockLayout) -> Role {
    if !b.allocated {
        return Role::Persistent;
    }
    roles.get(&a).copied().unwrap_or(Role::Persistent)
}

fn freed(
    s: &SegmentLayout,
    roles: &HashMap<u64, Role>,
    which: &dyn Fn(Role) -> bool,
) -> SegmentLayout {
    s.freeing(|a, b| b.allocated && which(role(roles, a, b)))
}

/// What a candidate rule runs on: the two snapshots, what each allocated
/// block is, and the `VAR` flags.
struct Probe<'a> {
    begin: &'a [SegmentLayout],
    end: &'a [SegmentLayout],
    roles: &'a HashMap<u64, Role>,
    grads_freed: bool,
    var: &'a str,
    verbose: bool,
}

impl Probe<'_> {
    fn has(&self, flag: &str) -> bool {
        self.var.split(',').any(|v| v == flag)
    }

    /// The end layout with the blocks `which` picks freed: what the
    /// requests are served from.
    fn serving(&self, which: &dyn Fn(Role) -> bool) -> Vec<SegmentLayout> {
        self.end
            .iter()
            .map(|e| freed(e, self.roles, which))
            .collect()
    }
}

/// A segment of the default large pool: the ones the candidates re-request.
fn ordinary(s: &&SegmentLayout) -> bool {
    s.pool == Pool::Large && s.pool_id == 0
}

/// Where the last request went: "NEW" and the reserved bytes it added to
/// `before`, or "ok" when it was served from the cache.
fn served(alloc: &CachingAllocator, before: u64) -> String {
    if alloc.reserved() > before {
        format!("NEW {:.2}", (alloc.reserved() - before) as f64 / M)
    } else {
        "ok".into()
    }
}

fn candidate(probe: &Probe) -> u64 {
    let has = |f: &str| probe.has(f);
    let gr = |r: Role| probe.grads_freed && !has("keepgrads") && r == Role::Gradient;
    // untouched: compare with gradients freed on both sides
    let untouched = |s: &SegmentLayout| !s.expandable && probe.end.iter().any(|e| e == s);
    let mut requests: Vec<(u64, u64)> = Vec::new();
    let mut left: Vec<(u64, u64)> = Vec::new();
    for s in probe.begin.iter().filter(ordinary) {
        let addrs = block_addresses(s);
        let free: Vec<u64> = s
            .blocks
            .iter()
            .filter(|b| !b.allocated)
            .map(|b| b.size)
            .collect();
        let grads: Vec<u64> = s
            .blocks
            .iter()
            .zip(&addrs)
            .filter(|(b, a)| gr(role(probe.roles, **a, b)))
            .map(|(b, _)| b.size)
            .collect();
        let repl: Vec<u64> = s
            .blocks
            .iter()
            .zip(&addrs)
            .filter(|(b, a)| role(probe.roles, **a, b) == Role::Replaced)
            .map(|(b, _)| b.size)
            .collect();
        let whole = !s.expandable && s.size() != LARGE_BUFFER && !free.is_empty();
        let skip_untouched = !has("nountouched") && untouched(s);
        if has("fsdporder") && untouched(s) {
            left.extend(free.iter().map(|&f| (f, s.stream)));
            if has("leftgrads") {
                left.extend(grads.iter().map(|&g| (g, s.stream)));
            }
        } else if skip_untouched {
            // serves own request(s); gradients/replaced there too
        } else if whole {
            requests.push((s.size(), s.stream));
            if has("wholegrads") {
                requests.extend(grads.iter().map(|&g| (g, s.stream)));
            }
        } else if has("split20") && s.size() == LARGE_BUFFER {
            for &f in &free {
                let mut f = f;
                while f > 0 {
                    let p = f.min(10 << 20);
                    requests.push((p, s.stream));
                    f -= p;
                }
            }
            requests.extend(grads.iter().map(|&g| (g, s.stream)));
        } else {
            requests.extend(free.iter().map(|&f| (f, s.stream)));
            if !has("nograds") {
                requests.extend(grads.iter().map(|&g| (g, s.stream)));
            }
        }
        if !has("norepl") && (!whole || has("wholerepl")) {
            requests.extend(repl.iter().map(|&r| (r, s.stream)));
        }
    }
    requests.sort_by(|a, b| b.cmp(a));
    if has("smallfirst") {
        requests.reverse();
    }
    left.sort();
    requests.extend(left);
    let serving: Vec<SegmentLayout> = probe
        .end
        .iter()
        .filter(|e| {
            has("nountouched")
                || has("fsdporder")
                || !probe.begin.iter().any(|s| s == *e && untouched(s))
        })
        .map(|e| freed(e, probe.roles, &gr))
        .collect();
    if probe.verbose {
        let mut fr: Vec<u64> = serving
            .iter()
            .filter(|s| s.pool == Pool::Large)
            .flat_map(|s| s.blocks.iter().filter(|b| !b.allocated).map(|b| b.size))
            .collect();
        fr.sort();
        fr.reverse();
        eprintln!(
            "  serving free: {:?}",
            fr.iter()
                .map(|&f| (f as f64 / M * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        );
        eprintln!(
            "  requests: {:?}",
            requests
                .iter()
                .map(|&(f, _)| (f as f64 / M * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        );
    }
    let (mut alloc, _) = CachingAllocator::from_layout(&serving).unwrap();
    let before = alloc.reserved();
    alloc.reset_step_peak();
    for &(size, stream) in &requests {
        let b = alloc.reserved();
        alloc.malloc_on(size, stream, u64::MAX).unwrap();
        if probe.verbose {
            eprintln!("  req {:.2} {}", size as f64 / M, served(&alloc, b));
        }
    }
    alloc.peaks().step.reserved - before
}

/// Forward order (smallest first), gradients freed, replaced blocks freed once their new copy is made.
fn v2(probe: &Probe) -> u64 {
    let has = |f: &str| probe.has(f);
    let gr = |r: Role| probe.grads_freed && r == Role::Gradient;
    // (size, is_copy_of_replaced (0 first), stream, old address)
    let mut requests: Vec<(u64, u8, u64, u64)> = Vec::new();
    for s in probe.begin.iter().filter(ordinary) {
        let addrs = block_addresses(s);
        let mut any_free_or_grad = false;
        let mut small_reqs = Vec::new();
        for (b, &a) in s.blocks.iter().zip(&addrs) {
            let r = role(probe.roles, a, b);
            if !b.allocated {
                any_free_or_grad = true;
                small_reqs.push(b.size);
            } else if gr(r) {
                any_free_or_grad = true;
                if !has("nogradreq") {
                    small_reqs.push(b.size);
                }
            } else if r == Role::Replaced && !has("norepl") {
                requests.push((b.size, 0, s.stream, a));
            }
        }
        if !any_free_or_grad {
            continue;
        }
        let holds_persistent = s
            .blocks
            .iter()
            .zip(&addrs)
            .any(|(b, &a)| b.allocated && role(probe.roles, a, b) == Role::Persistent);
        if s.expandable || s.size() == LARGE_BUFFER || (has("persist") && holds_persistent) {
            requests.extend(small_reqs.into_iter().map(|z| (z, 1, s.stream, 0)));
        } else {
            requests.push((s.size(), 1, s.stream, 0));
        }
    }
    requests.sort();
    if has("largefirst") {
        requests.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    }
    let serving = probe.serving(&gr);
    let (mut alloc, live) = CachingAllocator::from_layout(&serving).unwrap();
    let live: HashMap<u64, _> = live.into_iter().collect();
    let before = alloc.reserved();
    alloc.reset_step_peak();
    for &(size, kind, stream, old) in &requests {
        let b = alloc.reserved();
        alloc.malloc_on(size, stream, u64::MAX).unwrap();
        if probe.verbose {
            eprintln!(
                "  req {:.2}{} {}",
                size as f64 / M,
                if kind == 0 { " (copy)" } else { "" },
                served(&alloc, b)
            );
        }
        if kind == 0 && !has("keepold") {
            if let Some(&id) = live.get(&old) {
                alloc.free(id);
            }
        }
    }
    alloc.peaks().step.reserved - before
}

/// The chain model with requests in segment age order (highest address first: CUDA hands out new segments below old ones).
fn v3(probe: &Probe) -> u64 {
    let has = |f: &str| probe.has(f);
    let gr = |r: Role| probe.grads_freed && !has("keepgrads") && r == Role::Gradient;
    let untouched = |s: &SegmentLayout| !s.expandable && probe.end.iter().any(|e| e == s);
    // (address, size, stream, left_alone)
    let mut requests: Vec<(u64, u64, u64, bool)> = Vec::new();
    for s in probe.begin.iter().filter(ordinary) {
        let addrs = block_addresses(s);
        if s.blocks.iter().all(|b| b.allocated) {
            continue;
        }
        let free = s.blocks.iter().zip(&addrs).filter(|(b, _)| !b.allocated);
        if untouched(s) {
            requests.extend(free.map(|(b, &a)| (a, b.size, s.stream, true)));
        } else if s.expandable || s.size() == LARGE_BUFFER {
            requests.extend(free.map(|(b, &a)| (a, b.size, s.stream, false)));
            if has("gradreq") {
                requests.extend(
                    s.blocks
                        .iter()
                        .zip(&addrs)
                        .filter(|(b, a)| gr(role(probe.roles, **a, b)))
                        .map(|(b, &a)| (a, b.size, s.stream, false)),
                );
            }
        } else {
            requests.push((s.address, s.size(), s.stream, false));
        }
    }
    if has("split") {
        // displaced first (by age), then left alone (by age)
        requests.sort_by(|a, b| a.3.cmp(&b.3).then(b.0.cmp(&a.0)));
    } else {
        requests.sort_by_key(|r| std::cmp::Reverse(r.0));
    }
    let serving = probe.serving(&gr);
    let (mut alloc, _) = CachingAllocator::from_layout(&serving).unwrap();
    let before = alloc.reserved();
    alloc.reset_step_peak();
    let large_end: u64 = probe
        .end
        .iter()
        .filter(|s| s.pool == Pool::Large)
        .flat_map(|s| s.blocks.iter().filter(|b| b.allocated))
        .map(|b| b.size)
        .sum();
    let small = END_ALLOC.with(|p| p.get()).saturating_sub(large_end);
    let bound = PEAK.with(|p| p.get()) - if has("exact") { small } else { 0 };
    let mut stack = Vec::new();
    for &(addr, size, stream, alone) in &requests {
        if has("cap") {
            while alloc.allocated() + size > bound {
                let Some(old) = stack.pop() else { break };
                alloc.free(old);
            }
        }
        if has("capold") {
            while alloc.allocated() + size > bound && !stack.is_empty() {
                let old = stack.remove(0);
                alloc.free(old);
            }
        }
        let b = alloc.reserved();
        let id = alloc.malloc_on(size, stream, u64::MAX).unwrap();
        let transient = (has("bwlive") && !BW.with(|bw| alive_in(&bw.borrow(), addr, size)))
            || (has("fwtrans")
                && BW.with(|bw| {
                    let bw = bw.borrow();
                    existed_in(&bw, addr) && !alive_in(&bw, addr, size)
                }));
        if transient {
            alloc.free(id);
        } else {
            stack.push(id);
        }
        if probe.verbose {
            eprintln!(
                "  req {:x} -> {:x} {:.2}{}{} {}",
                addr,
                alloc.address_of(id).unwrap_or(0),
                size as f64 / M,
                if alone { " (alone)" } else { "" },
                if transient { " (transient)" } else { "" },
                served(&alloc, b)
            );
        }
    }
    if has("check") && alloc.allocated() > bound {
        eprintln!(
            "EXCEEDS live {:.0} > bound {:.0}",
            alloc.allocated() as f64 / M,
            bound as f64 / M
        );
        return u64::MAX / 4;
    }
    if has("check") {
        eprintln!(
            "FITS live {:.0} <= bound {:.0}",
            alloc.allocated() as f64 / M,
            bound as f64 / M
        );
    }
    alloc.peaks().step.reserved - before
}

/// A markers record whose snapshots carry the client's gradient flags: v3 on them.
fn markers_mode(text: &str, var: &str, verbose: bool) {
    let mut layouts: HashMap<String, (Vec<SegmentLayout>, HashMap<u64, Role>)> = HashMap::new();
    let mut job = String::new();
    for line in text.lines() {
        if !line.contains("\"markers\"") {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        job = v["markers"]["key"]["job"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if v["markers"]["key"]["rank"] != 0 {
            continue;
        }
        for m in v["markers"]["markers"].as_array().into_iter().flatten() {
            let Some(segs) = m["layout_segments"].as_array() else {
                continue;
            };
            if segs.is_empty() {
                continue;
            }
            let mut roles = HashMap::new();
            let layout: Vec<SegmentLayout> = segs
                .iter()
                .map(|sv| {
                    let s: SegmentLayout = serde_json::from_value(sv.clone()).unwrap();
                    let mut a = s.address;
                    for b in sv["blocks"].as_array().unwrap() {
                        if b["gradient"] == true {
                            roles.insert(a, Role::Gradient);
                        }
                        a += b["size"].as_u64().unwrap();
                    }
                    s
                })
                .collect();
            layouts.insert(m["kind"].as_str().unwrap().to_string(), (layout, roles));
        }
    }
    let (Some((begin, _)), Some((end, roles))) =
        (layouts.get("optimizer_begin"), layouts.get("optimizer_end"))
    else {
        return;
    };
    let base = step2_new_segments(begin, end).unwrap();
    let cand = v3(&Probe {
        begin,
        end,
        roles,
        grads_freed: true,
        var,
        verbose,
    });
    println!(
        "{job:55} base {:7.1} cand {:7.1}",
        base.new_segment_bytes as f64 / M,
        cand as f64 / M
    );
}

/// Whether any block allocated in `layout` overlaps [addr, addr+size).
fn alive_in(layout: &[SegmentLayout], addr: u64, size: u64) -> bool {
    layout.iter().any(|s| {
        block_addresses(s)
            .into_iter()
            .zip(&s.blocks)
            .any(|(a, b)| b.allocated && a < addr + size && addr < a + b.size)
    })
}

/// Whether a segment of `layout` holds `addr`.
fn existed_in(layout: &[SegmentLayout], addr: u64) -> bool {
    layout
        .iter()
        .any(|s| s.address <= addr && addr < s.address + s.size())
}
