//! Each rank's view as `/metrics` renders it, kept between scrapes.
//!
//! Analysing a rank reads its whole retained history; at 256 ranks × 1,000
//! steps a scrape that analysed every rank took tens of milliseconds and
//! grew with retention. A rank's view is recomputed only when something it
//! is made of changed ([`ViewKey`]), and always during step 1, whose live
//! prediction follows every sample. A housekeeping task refreshes the views
//! as inputs arrive, and a scrape refreshes what is still stale before it
//! renders, so it shows every change and pays only for what changed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use stepwatch_core::{
    Divergence, GrowthForecast, LayoutCounts, MemoryTrend, PassPeaks, PhaseKind, RankAnalysis,
    RankInfo, RankKey, StepBatches, StepOutcome, Tracker,
};

use crate::state::AgentState;

/// What a scrape needs of the tracker, copied out a rank at a time.
pub(crate) struct TrackerSnapshot {
    pub(crate) rank_count: usize,
    pub(crate) retained_bytes: u64,
    pub(crate) steps_trimmed_total: u64,
    pub(crate) ranks_evicted_for_memory_total: u64,
    pub(crate) layout_counts: LayoutCounts,
    pub(crate) ranks: Vec<Arc<RankSnapshot>>,
    /// Per job (in rank order): its divergence, if any.
    pub(crate) divergence: Vec<(RankKey, Option<Divergence>)>,
}

/// What the scrape needs of one rank: small, owned figures.
pub(crate) struct RankSnapshot {
    pub(crate) key: RankKey,
    pub(crate) info: RankInfo,
    pub(crate) connected: bool,
    pub(crate) steps_completed: u64,
    pub(crate) ooms: u64,
    /// The client's `num_alloc_retries` at its latest marker.
    pub(crate) allocator_retries: Option<u64>,
    pub(crate) last_step: Option<u64>,
    pub(crate) last_completed: Option<LastCompleted>,
    pub(crate) median_duration_ns: Option<u64>,
    pub(crate) activation_peak_bytes: Option<u64>,
    /// Predicted peak of the prediction frozen before step 2.
    pub(crate) frozen_peak_bytes: Option<u64>,
    pub(crate) analysis: Option<RankAnalysis>,
    /// The trailing window after step 2 and its growth (kept by the core).
    pub(crate) trend: Option<MemoryTrend>,
    /// When growing memory reaches capacity; None when it does not grow.
    pub(crate) growth: Option<GrowthForecast>,
    /// Evaluation passes and checkpoint saves, per kind.
    pub(crate) passes: Vec<PassPeaks>,
    /// What the steps say of their batches.
    pub(crate) batches: Option<StepBatches>,
}

pub(crate) struct LastCompleted {
    pub(crate) duration_ns: u64,
    pub(crate) end_wall_ns: Option<u64>,
    pub(crate) phases: Vec<(PhaseKind, u64)>,
}

/// What a rank's view is made of, beyond step 1: equal keys, equal views.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ViewKey {
    /// Markers, credited samples, trimming.
    timeline_revision: u64,
    /// Hello, markers, model facts, allocator replay, disconnect.
    last_activity_ns: u64,
    connected_streams: u32,
    advisories: usize,
    capacity_bytes: u64,
    other_process_bytes: u64,
}

impl ViewKey {
    /// None while the rank is in step 1: its view is always recomputed.
    fn of(tracker: &Tracker, key: &RankKey) -> Option<Self> {
        let rank = tracker.rank(key)?;
        if rank.in_first_step() {
            return None;
        }
        Some(Self {
            timeline_revision: rank.timeline.revision(),
            last_activity_ns: rank.last_activity_ns,
            connected_streams: rank.connected_streams,
            advisories: rank.advisories.len(),
            capacity_bytes: tracker
                .latest_sample(&rank.info.gpu_uuid)
                .map_or(0, |s| s.capacity_bytes),
            other_process_bytes: tracker.other_process_bytes(key),
        })
    }
}

/// The kept views; see the module documentation.
#[derive(Default)]
pub(crate) struct RankViews {
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    ranks: BTreeMap<RankKey, (Option<ViewKey>, Arc<RankSnapshot>)>,
    /// Per job (namespace, job id): its divergence as of the last refresh.
    jobs: BTreeMap<(String, String), Option<Divergence>>,
    /// The tracker's generation the views were brought up to date with.
    generation: Option<u64>,
}

impl RankViews {
    /// Recomputes the views whose inputs changed (background refresh).
    /// Nothing at all when the tracker has not changed since the last
    /// refresh: the housekeeping tick then takes no lock.
    pub(crate) fn refresh(&self, state: &AgentState) {
        let unchanged = {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.generation == Some(state.generation())
        };
        if !unchanged {
            self.snapshot(state, &mut || {});
        }
    }

    /// Brings the views up to date and copies them out for a scrape, taking
    /// the tracker lock once for the totals and once per rank (and per job
    /// whose ranks changed), so ingest never waits for a whole refresh.
    /// `after_each_rank` runs between ranks with the lock released.
    pub(crate) fn snapshot(
        &self,
        state: &AgentState,
        after_each_rank: &mut dyn FnMut(),
    ) -> TrackerSnapshot {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        // Read before the walk: a change during it moves the number again.
        cache.generation = Some(state.generation());
        let (rank_count, retained_bytes, trimmed_evicted, layout_counts, keys) = state
            .read_tracker(|t| {
                (
                    t.rank_count(),
                    t.retained_bytes(),
                    (t.steps_trimmed_total(), t.ranks_evicted_for_memory_total()),
                    t.layout_counts(),
                    t.rank_keys(),
                )
            });
        let mut ranks = Vec::with_capacity(keys.len());
        let mut changed_jobs: Vec<(String, String)> = Vec::new();
        let mut kept = BTreeMap::new();
        for key in keys {
            let cached = cache.ranks.remove(&key);
            let view = state.read_tracker(|t| {
                let view_key = ViewKey::of(t, &key);
                match cached {
                    Some((Some(old), view)) if Some(old) == view_key => {
                        Some((view_key, view, false))
                    }
                    _ => rank_snapshot(t, key.clone()).map(|v| (view_key, Arc::new(v), true)),
                }
            });
            if let Some((view_key, view, changed)) = view {
                let job = (key.namespace.clone(), key.job.clone());
                if changed && changed_jobs.last() != Some(&job) {
                    changed_jobs.push(job);
                }
                ranks.push(view.clone());
                kept.insert(key, (view_key, view));
            }
            after_each_rank();
        }
        // Ranks that left take their job's divergence with them.
        for gone in cache.ranks.keys() {
            let job = (gone.namespace.clone(), gone.job.clone());
            if !changed_jobs.contains(&job) {
                changed_jobs.push(job);
            }
        }
        cache.ranks = kept;
        for job in changed_jobs {
            let div = state.read_tracker(|t| t.job_divergence(&job.0, &job.1));
            cache.jobs.insert(job, div);
        }
        let Cache {
            ranks: live, jobs, ..
        } = &mut *cache;
        jobs.retain(|(ns, job), _| {
            live.range(RankKey::new(ns, job, 0)..=RankKey::new(ns, job, u32::MAX))
                .next()
                .is_some()
        });
        let mut divergence = Vec::new();
        for view in &ranks {
            let key = &view.key;
            let new_job = divergence.last().is_none_or(|(k, _): &(RankKey, _)| {
                k.namespace != key.namespace || k.job != key.job
            });
            if new_job {
                let div = jobs
                    .get(&(key.namespace.clone(), key.job.clone()))
                    .cloned()
                    .flatten();
                divergence.push((key.clone(), div));
            }
        }
        TrackerSnapshot {
            rank_count,
            retained_bytes,
            steps_trimmed_total: trimmed_evicted.0,
            ranks_evicted_for_memory_total: trimmed_evicted.1,
            layout_counts,
            ranks,
            divergence,
        }
    }
}

fn rank_snapshot(tracker: &Tracker, key: RankKey) -> Option<RankSnapshot> {
    let rank = tracker.rank(&key)?;
    let tl = &rank.timeline;
    let last_completed = tl.last_completed().map(|last| LastCompleted {
        duration_ns: last.duration_ns().unwrap_or(0),
        end_wall_ns: last.end_wall_ns,
        phases: PhaseKind::ALL
            .into_iter()
            .filter_map(|kind| last.phase_duration_ns(kind).map(|ns| (kind, ns)))
            .collect(),
    });
    let mut durations: Vec<u64> = tl
        .steps()
        .filter(|s| s.outcome == StepOutcome::Completed)
        .filter_map(|s| s.duration_ns())
        .collect();
    let median_duration_ns = stepwatch_core::median_u64(&mut durations);
    let activation_peak_bytes = tl.steps().next().and_then(|step1| {
        let act = stepwatch_core::activation_peak_bytes(step1);
        act.allocated_bytes.or(act.nvml_bytes)
    });
    Some(RankSnapshot {
        info: rank.info.clone(),
        connected: rank.connected_streams > 0,
        steps_completed: tl.steps_completed(),
        ooms: tl.ooms(),
        allocator_retries: rank.allocator_retries,
        last_step: tl.current().map(|s| s.step),
        last_completed,
        median_duration_ns,
        activation_peak_bytes,
        frozen_peak_bytes: rank
            .prediction_before_step2
            .as_ref()
            .map(|p| p.predicted_peak_bytes),
        analysis: tracker.rank_analysis(&key),
        trend: tracker.memory_trend(&key).cloned(),
        growth: tracker.memory_growth(&key),
        passes: tracker.pass_peaks(&key),
        batches: tracker.step_batches(&key),
        key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{test_marker, test_rank, test_state};
    use stepwatch_core::{GpuSample, MarkerKind};

    /// Steps 1..=n of a rank, each with its four phases, from `t0` on.
    fn steps(state: &AgentState, key: &RankKey, from: u64, to: u64) {
        for step in from..=to {
            let t = step * 1_000_000;
            let batch: Vec<_> = MarkerKind::STEP_ORDER
                .into_iter()
                .enumerate()
                .filter(|(_, k)| step > 1 || *k != MarkerKind::StepBegin)
                .map(|(i, k)| test_marker(k, step, t + i as u64 * 100_000))
                .collect();
            state.apply_markers(key, "", &batch).unwrap();
        }
    }

    fn sample(monotonic_ns: u64, used_bytes: u64) -> GpuSample {
        GpuSample {
            monotonic_ns,
            used_bytes,
            capacity_bytes: 80_000_000_000,
        }
    }

    fn view(snapshot: &TrackerSnapshot, rank: u32) -> Arc<RankSnapshot> {
        snapshot
            .ranks
            .iter()
            .find(|v| v.key.rank == rank)
            .cloned()
            .expect("rank in the snapshot")
    }

    #[test]
    fn a_view_is_kept_until_its_rank_changes() {
        let state = test_state();
        let a = test_rank(&state, "j", 0);
        let b = test_rank(&state, "j", 1);
        // The GPU's capacity is known from the start.
        state.test_gpu_samples("", &[sample(500, 1_000_000_000)]);
        steps(&state, &a, 1, 4);
        steps(&state, &b, 1, 4);
        let first = state.views.snapshot(&state, &mut || {});
        let again = state.views.snapshot(&state, &mut || {});
        // Past step 1 and unchanged: the same view, not a recomputed copy.
        assert!(Arc::ptr_eq(&view(&first, 0), &view(&again, 0)));
        assert!(Arc::ptr_eq(&view(&first, 1), &view(&again, 1)));

        // A marker for rank 1 renews its view alone, and the new view shows it.
        steps(&state, &b, 5, 5);
        let after = state.views.snapshot(&state, &mut || {});
        assert!(Arc::ptr_eq(&view(&again, 0), &view(&after, 0)));
        assert!(!Arc::ptr_eq(&view(&again, 1), &view(&after, 1)));
        assert_eq!(view(&after, 1).steps_completed, 5);
        assert_eq!(view(&after, 0).steps_completed, 4);

        // A late sample credited to a closed phase renews the view too.
        state.test_gpu_samples("", &[sample(4_150_000, 7_000_000_000)]);
        let sampled = state.views.snapshot(&state, &mut || {});
        assert!(!Arc::ptr_eq(&view(&after, 0), &view(&sampled, 0)));
    }

    #[test]
    fn a_background_refresh_with_nothing_new_touches_nothing() {
        let state = test_state();
        let a = test_rank(&state, "j", 0);
        let view_of = |state: &AgentState| {
            let cache = state.views.cache.lock().unwrap();
            cache.ranks.values().next().map(|(_, v)| v.clone())
        };
        state.views.refresh(&state);
        let first = view_of(&state).expect("the refresh made the view");
        // The rank is in step 1, so a walk would compute its view again:
        // an unchanged tracker means no walk.
        state.views.refresh(&state);
        assert!(Arc::ptr_eq(&first, &view_of(&state).unwrap()));
        steps(&state, &a, 1, 1);
        state.views.refresh(&state);
        let after = view_of(&state).unwrap();
        assert!(!Arc::ptr_eq(&first, &after));
        assert_eq!(after.steps_completed, 1);
    }

    #[test]
    fn a_rank_in_step_1_is_recomputed_every_time_and_gone_ranks_leave() {
        let state = test_state();
        let a = test_rank(&state, "j", 0);
        let first = state.views.snapshot(&state, &mut || {});
        let again = state.views.snapshot(&state, &mut || {});
        assert!(!Arc::ptr_eq(&view(&first, 0), &view(&again, 0)));
        assert_eq!(again.divergence.len(), 1);

        state.close_rank(&a, false);
        assert_eq!(state.evict_idle(0), 1);
        let empty = state.views.snapshot(&state, &mut || {});
        assert!(empty.ranks.is_empty());
        assert!(empty.divergence.is_empty());
        let cache = state.views.cache.lock().unwrap();
        assert!(cache.ranks.is_empty() && cache.jobs.is_empty());
    }
}
