//! The one path for the step model's inputs.
//!
//! Three callers feed a [`Tracker`]: the agent (what arrives on the wire and
//! from the sampler), the record replayer (`stepwatch replay-record`, what
//! an agent recorded) and the accuracy harness (what a simulated job does).
//! They all describe each input as a [`RecordEntry`] and hand it to
//! [`apply`], so a hello, a marker batch, a trace, a facts update, samples,
//! a process list, an eviction or a close is applied by the same code
//! wherever it comes from, and what the agent records is what it applied.
//!
//! The one input that is split is the step-1 allocator trace: its replay is
//! heavy, so the agent runs it outside the tracker's lock. [`ReplayPlan`]
//! says how a rank's trace is replayed (what becomes of its gradients, the
//! reserved limit), [`ReplayPlan::replay`] runs it with no tracker, and
//! [`apply_replay`] hands the result over; [`apply`] does the three in a row.
//!
//! What stays with each caller is where its inputs come from and when: the
//! agent drains the sampler before a step-1 batch, the harness samples its
//! simulated GPU at 100 Hz, the replayer reads lines.

mod entry;

pub use entry::{RecordEntry, RecordError};

use std::borrow::Cow;

use crate::advisory::Advisory;
use crate::error::MarkerError;
use crate::identity::{DdpBucketRebuild, RankKey};
use crate::replay::{replay_step2_with, AllocatorTrace, Gradients, Step2Replay, TraceError};
use crate::tracker::{Opened, Tracker};

/// What applying one input did, for the caller to act on (send advisories,
/// count evictions, log a late trace).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Applied {
    /// Advisories that became due, in order.
    pub advisories: Vec<Advisory>,
    /// A trace's replay or a facts update that came after the rank's step 2
    /// began (or for a rank no longer tracked): the prediction made before
    /// step 2 stands, so nothing was due.
    pub late: bool,
    /// A hello's rank, with what made room for it or was superseded by it.
    pub opened: Option<Opened>,
    /// Ranks an eviction dropped.
    pub evicted: usize,
}

impl Applied {
    fn advisories(advisories: Vec<Advisory>) -> Self {
        Self {
            advisories,
            ..Self::default()
        }
    }

    /// Advisories, or `late` when there were none to have (None).
    fn unless_late(due: Option<Vec<Advisory>>) -> Self {
        match due {
            Some(advisories) => Self::advisories(advisories),
            None => Self {
                late: true,
                ..Self::default()
            },
        }
    }
}

/// Applies one input to the tracker, as the agent does. Refused inputs
/// change nothing.
pub fn apply(tracker: &mut Tracker, input: &RecordEntry<'_>) -> Result<Applied, RecordError> {
    Ok(match input {
        RecordEntry::Open { at_ns, info } => Applied {
            opened: Some(tracker.open_evicting(info.clone(), *at_ns)?),
            ..Applied::default()
        },
        RecordEntry::Markers {
            at_ns,
            key,
            markers,
            run_id,
        } => Applied::advisories(tracker.run_markers(key, run_id, markers, *at_ns)?),
        RecordEntry::AllocatorTrace {
            at_ns,
            key,
            trace,
            run_id,
            ..
        } => {
            tracker.check_run(key, run_id)?;
            let plan = ReplayPlan::of_entry(input).expect("an allocator trace entry");
            apply_replay(tracker, key, run_id, plan.replay(trace)?, *at_ns)?
        }
        RecordEntry::ModelFacts {
            at_ns,
            key,
            update,
            run_id,
        } => {
            tracker.check_run(key, run_id)?;
            Applied::unless_late(tracker.update_model_facts(key, update, *at_ns)?)
        }
        RecordEntry::OomReport {
            at_ns,
            key,
            report,
            run_id,
        } => {
            tracker.check_run(key, run_id)?;
            tracker.record_oom_report(key, report.clone(), *at_ns)?;
            Applied::default()
        }
        RecordEntry::GpuSamples { gpu, samples } => {
            tracker.gpu_samples(gpu, samples);
            Applied::default()
        }
        RecordEntry::GpuProcesses { gpu, processes } => {
            tracker.set_gpu_processes(gpu, processes);
            Applied::default()
        }
        RecordEntry::Evict {
            at_ns,
            retention_ns,
        } => Applied {
            evicted: tracker.evict_idle(*at_ns, *retention_ns),
            ..Applied::default()
        },
        RecordEntry::Close { at_ns, key, broken } => {
            if *broken {
                tracker.disconnect(key, *at_ns);
            } else {
                tracker.close(key, *at_ns);
            }
            Applied::default()
        }
    })
}

/// How a rank's step-1 allocator trace is replayed: decided from the
/// tracker (its facts and its current prediction) when the trace arrives,
/// and recorded with the trace so a replay of the record does the same.
/// The agent replays the trace again when a facts update changes the plan
/// ([`ReplayPlan::replays_like`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReplayPlan {
    /// What becomes of step 1's gradients between steps, from the rank's
    /// facts ([`Gradients::of`]).
    pub gradients: Gradients,
    /// The most the rank's allocator may reserve ([`Tracker::reserved_limit`]);
    /// None while unknown.
    pub reserved_limit: Option<u64>,
    /// DDP's bucket rebuild at step 2's first forward, from the rank's facts
    /// ([`crate::ModelFacts::ddp_bucket_rebuild`]): the trace's chunks do
    /// not carry it, and it may come after them.
    pub ddp_bucket_rebuild: Option<DdpBucketRebuild>,
    /// The rank's PyTorch version, from its hello ([`crate::RankInfo::pytorch_version`]):
    /// the allocator rules the
    /// replay follows ([`crate::allocator::FreeBlockOrder`]) when the trace
    /// does not say ([`AllocatorTrace::torch_version`]).
    pub torch_version: String,
}

impl ReplayPlan {
    /// The plan for the rank's trace as the tracker stands (defaults for a
    /// rank it does not know; its replay will be late anyway).
    pub fn for_rank(tracker: &Tracker, key: &RankKey) -> Self {
        let info = tracker.rank(key).map(|r| &r.info);
        Self {
            gradients: info.map_or_else(Gradients::default, Gradients::of),
            reserved_limit: tracker.reserved_limit(key),
            ddp_bucket_rebuild: info.and_then(|i| i.model.ddp_bucket_rebuild.clone()),
            torch_version: info
                .map(|i| i.pytorch_version().to_owned())
                .unwrap_or_default(),
        }
    }

    /// `trace` with the plan's PyTorch version where it names none.
    fn versioned<'t>(&self, trace: &'t AllocatorTrace) -> Cow<'t, AllocatorTrace> {
        if trace.torch_version.is_empty() && !self.torch_version.is_empty() {
            Cow::Owned(AllocatorTrace {
                torch_version: self.torch_version.clone(),
                ..trace.clone()
            })
        } else {
            Cow::Borrowed(trace)
        }
    }

    /// Whether a trace replayed under `other` would replay the same under
    /// this plan as far as the rank's facts decide it (the gradients, DDP's
    /// rebuild). The reserved limit is left out: it follows the GPU samples
    /// all through step 1, and a facts update is not a reason to measure it
    /// again (a replay that is due anyway takes the current one).
    pub fn replays_like(&self, other: &Self) -> bool {
        self.gradients == other.gradients
            && self.ddp_bucket_rebuild == other.ddp_bucket_rebuild
            && self.torch_version == other.torch_version
    }

    /// The plan an [`RecordEntry::AllocatorTrace`] was replayed with (older
    /// records say only whether gradients persist); None for other entries.
    pub fn of_entry(entry: &RecordEntry<'_>) -> Option<Self> {
        match entry {
            RecordEntry::AllocatorTrace {
                grads_persistent,
                gradients,
                reserved_limit,
                ddp_bucket_rebuild,
                ..
            } => Some(Self {
                gradients: gradients
                    .unwrap_or_else(|| Gradients::from_persistent(*grads_persistent)),
                reserved_limit: *reserved_limit,
                ddp_bucket_rebuild: ddp_bucket_rebuild.clone(),
                // The recorded trace carries it ([`ReplayPlan::entry`]).
                torch_version: String::new(),
            }),
            _ => None,
        }
    }

    /// Replays step 2 from `trace` under this plan. Pure and heavy (up to a
    /// few hundred ms for the largest traces): run it outside any lock.
    pub fn replay(&self, trace: &AllocatorTrace) -> Result<Step2Replay, TraceError> {
        replay_step2_with(
            &self.versioned(trace),
            self.gradients,
            self.reserved_limit,
            self.ddp_bucket_rebuild.as_ref(),
        )
    }

    /// The record entry of `trace`, sent on a stream of run `run_id`,
    /// replayed under this plan (the trace recorded with the plan's PyTorch
    /// version, so that a replay of the record follows the same rules).
    pub fn entry(
        self,
        at_ns: u64,
        key: RankKey,
        run_id: String,
        mut trace: AllocatorTrace,
    ) -> RecordEntry<'static> {
        if trace.torch_version.is_empty() {
            trace.torch_version = self.torch_version;
        }
        RecordEntry::AllocatorTrace {
            at_ns,
            key,
            grads_persistent: self.gradients == Gradients::Kept,
            gradients: Some(self.gradients),
            reserved_limit: self.reserved_limit,
            ddp_bucket_rebuild: self.ddp_bucket_rebuild,
            trace,
            run_id,
        }
    }
}

/// Hands a rank's step-2 replay, of a trace sent on a stream of run
/// `run_id`, to the tracker: advisories due with it, or `late` (nothing
/// changes) once the rank's step 2 has begun; refused (nothing changes)
/// when the rank has started another run since ([`Tracker::check_run`]).
pub fn apply_replay(
    tracker: &mut Tracker,
    key: &RankKey,
    run_id: &str,
    replay: Step2Replay,
    at_ns: u64,
) -> Result<Applied, MarkerError> {
    tracker.check_run(key, run_id)?;
    Ok(Applied::unless_late(
        tracker.allocator_replay(key, replay, at_ns),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::{ModelFacts, RankInfo};
    use crate::marker::Marker;
    use crate::tracker::TrackerConfig;

    fn info(rank: u32) -> RankInfo {
        RankInfo {
            job: "j".into(),
            rank,
            world_size: 2,
            gpu_uuid: "GPU-0".into(),
            pid: 10 + rank,
            ..RankInfo::default()
        }
    }

    #[test]
    fn only_a_jumped_clock_and_an_unusable_oom_report_leave_the_stream_open() {
        let alone = [
            RecordError::Markers(MarkerError::ClockJumped {
                ahead_ns: 1,
                step: 2,
            }),
            RecordError::OomReport(crate::postmortem::OomReportError::TooLarge {
                field: "segments",
                len: 2,
                max: 1,
            }),
        ];
        let ending = [
            RecordError::Markers(MarkerError::StepZero),
            RecordError::Markers(MarkerError::RunEnded {
                stream_run: "a".into(),
                rank_run: "b".into(),
            }),
            RecordError::ModelFacts(crate::error::HelloError::Empty("job")),
        ];
        assert!(alone.iter().all(|e| !e.ends_stream()));
        assert!(ending.iter().all(RecordError::ends_stream));
    }

    /// A batch of one step-begin marker at `t`, as a record holds it.
    fn step_begins(key: &RankKey, step: u64, t: u64) -> RecordEntry<'static> {
        let marker: Marker = serde_json::from_str(&format!(
            r#"{{"kind":"step_begin","step":{step},"monotonic_ns":{t},"wall_ns":{t},"micro_batch":0,"allocator":null}}"#
        ))
        .unwrap();
        RecordEntry::Markers {
            at_ns: t,
            key: std::borrow::Cow::Owned(key.clone()),
            markers: vec![marker].into(),
            run_id: "".into(),
        }
    }

    #[test]
    fn a_hello_says_what_made_room_for_it() {
        let mut t = Tracker::new(TrackerConfig {
            max_ranks: 1,
            ..TrackerConfig::default()
        });
        let first = info(0).key();
        for entry in [
            RecordEntry::Open {
                at_ns: 1,
                info: info(0),
            },
            RecordEntry::Close {
                at_ns: 2,
                key: first.clone(),
                broken: false,
            },
        ] {
            apply(&mut t, &entry).unwrap();
        }
        let open = RecordEntry::Open {
            at_ns: 3,
            info: info(1),
        };
        let opened = apply(&mut t, &open).unwrap().opened.unwrap();
        assert_eq!(opened.key, info(1).key());
        assert_eq!(opened.evicted, Some(first));
    }

    #[test]
    fn a_batch_entry_names_its_streams_run_and_replays_the_agents_refusal() {
        let mut t = Tracker::new(TrackerConfig::default());
        let run = |id: &str| RankInfo {
            run_id: id.into(),
            ..info(0)
        };
        let key = info(0).key();
        let of_run = |entry: RecordEntry<'static>, id: &'static str| match entry {
            RecordEntry::Markers {
                at_ns,
                key,
                markers,
                ..
            } => RecordEntry::Markers {
                at_ns,
                key,
                markers,
                run_id: id.into(),
            },
            _ => unreachable!(),
        };
        for (at_ns, id) in [(1, "fit-1"), (2, "fit-2")] {
            apply(
                &mut t,
                &RecordEntry::Open {
                    at_ns,
                    info: run(id),
                },
            )
            .unwrap();
        }
        // fit-1's stream is still open; its batch is refused as the agent
        // refused it, and fit-2's is applied.
        let stale = of_run(step_begins(&key, 1, 10), "fit-1");
        let e = apply(&mut t, &stale).unwrap_err();
        assert_eq!(e.reason(), "run_ended");
        assert!(t.rank(&key).unwrap().timeline.current().is_none());
        let own = of_run(step_begins(&key, 1, 11), "fit-2");
        apply(&mut t, &own).unwrap();
        assert_eq!(t.rank(&key).unwrap().timeline.current().unwrap().step, 1);
        // So are fit-1's facts and step-1 trace: they would change fit-2's
        // facts and its step-2 replay.
        let facts = |run_id: &str| RecordEntry::ModelFacts {
            at_ns: 12,
            key: key.clone(),
            update: ModelFacts {
                grads_set_to_none: Some(false),
                ..ModelFacts::default()
            },
            run_id: run_id.into(),
        };
        let e = apply(&mut t, &facts("fit-1")).unwrap_err();
        assert_eq!(e.reason(), "run_ended");
        let plan = ReplayPlan::for_rank(&t, &key);
        assert_eq!(plan.gradients, Gradients::default(), "fit-2's facts stand");
        let trace = plan.entry(13, key.clone(), "fit-1".into(), AllocatorTrace::default());
        assert_eq!(apply(&mut t, &trace).unwrap_err().reason(), "run_ended");
        let replay = Step2Replay {
            reserved_at_step1_end_bytes: 1,
            reserved_peak_bytes: 1,
            allocated_peak_bytes: 1,
            new_segment_bytes: 0,
            state_bytes: 0,
            grad_bytes: 0,
            grads_persistent: false,
            grads_freed_before_backward: false,
            events_replayed: 0,
            steady_reserved_peak_bytes: 1,
            reserved_limit_bytes: None,
            within_limit: None,
            ddp_bucket_rebuild: None,
            loop_variable_bytes: 0,
            forward_returns_known: false,
        };
        let e = apply_replay(&mut t, &key, "fit-1", replay, 13).unwrap_err();
        assert_eq!(e.reason(), "run_ended");
        assert!(t.rank(&key).unwrap().allocator_replay.is_none());
        apply(&mut t, &facts("fit-2")).unwrap();
        assert_eq!(ReplayPlan::for_rank(&t, &key).gradients, Gradients::Kept);
        // The run id is kept on the record's line; lines without one (older
        // agents and clients) read as before.
        let line = serde_json::to_string(&own).unwrap();
        assert!(line.contains(r#""run_id":"fit-2""#), "{line}");
        assert_eq!(serde_json::from_str::<RecordEntry>(&line).unwrap(), own);
        let old = serde_json::to_string(&step_begins(&key, 1, 10)).unwrap();
        assert!(!old.contains("run_id"), "{old}");
    }

    #[test]
    fn facts_after_step_two_began_are_late() {
        let mut t = Tracker::new(TrackerConfig::default());
        let key = info(0).key();
        apply(
            &mut t,
            &RecordEntry::Open {
                at_ns: 1,
                info: info(0),
            },
        )
        .unwrap();
        let facts = |at_ns| RecordEntry::ModelFacts {
            at_ns,
            key: key.clone(),
            update: ModelFacts {
                grads_set_to_none: Some(false),
                ..ModelFacts::default()
            },
            run_id: String::new(),
        };
        apply(&mut t, &step_begins(&key, 1, 10)).unwrap();
        assert!(!apply(&mut t, &facts(11)).unwrap().late);
        assert_eq!(
            ReplayPlan::for_rank(&t, &key).gradients,
            Gradients::Kept,
            "the plan follows the merged facts"
        );
        apply(&mut t, &step_begins(&key, 2, 20)).unwrap();
        assert!(apply(&mut t, &facts(21)).unwrap().late);
    }

    fn rebuild() -> DdpBucketRebuild {
        DdpBucketRebuild {
            old_bucket_bytes: vec![32 << 20],
            new_bucket_bytes: vec![8 << 20, 24 << 20],
        }
    }

    #[test]
    fn a_ddp_rebuild_in_facts_after_the_trace_changes_the_plan() {
        let mut t = Tracker::new(TrackerConfig::default());
        let key = info(0).key();
        let open = RecordEntry::Open {
            at_ns: 1,
            info: info(0),
        };
        apply(&mut t, &open).unwrap();
        apply(&mut t, &step_begins(&key, 1, 10)).unwrap();
        // The trace came now: replayed without a rebuild.
        let replayed = ReplayPlan::for_rank(&t, &key);
        assert_eq!(replayed.ddp_bucket_rebuild, None);
        let facts = |at_ns| RecordEntry::ModelFacts {
            at_ns,
            key: key.clone(),
            update: ModelFacts {
                ddp_bucket_rebuild: Some(rebuild()),
                ..ModelFacts::default()
            },
            run_id: String::new(),
        };
        apply(&mut t, &facts(11)).unwrap();
        let plan = ReplayPlan::for_rank(&t, &key);
        assert_eq!(plan.ddp_bucket_rebuild, Some(rebuild()));
        assert!(!plan.replays_like(&replayed), "the trace replays again");
        // The same facts again change nothing.
        apply(&mut t, &facts(12)).unwrap();
        assert!(ReplayPlan::for_rank(&t, &key).replays_like(&plan));
        // Nor does another reserved limit alone (it follows the samples).
        let measured = ReplayPlan {
            reserved_limit: Some(1 << 30),
            ..plan.clone()
        };
        assert!(measured.replays_like(&plan));
    }

    #[test]
    fn the_hellos_pytorch_version_decides_the_replays_allocator_rules() {
        use crate::allocator::FreeBlockOrder;
        let order = |framework: &str, version: &str, torch_version: &str| {
            let mut t = Tracker::new(TrackerConfig::default());
            let info = RankInfo {
                framework: framework.into(),
                framework_version: version.into(),
                torch_version: torch_version.into(),
                ..info(0)
            };
            let key = info.key();
            apply(&mut t, &RecordEntry::Open { at_ns: 1, info }).unwrap();
            let plan = ReplayPlan::for_rank(&t, &key);
            let entry = plan.entry(2, key, String::new(), AllocatorTrace::default());
            let RecordEntry::AllocatorTrace { trace, .. } = entry else {
                unreachable!()
            };
            // The record carries it, so its replay follows the same rules.
            let line = serde_json::to_string(&trace).unwrap();
            let back: AllocatorTrace = serde_json::from_str(&line).unwrap();
            assert_eq!(back.torch_version, trace.torch_version);
            back.model_settings().unwrap().free_block_order
        };
        use FreeBlockOrder::{Address, SegmentAge};
        for (framework, version, torch_version, rule) in [
            // The hello's torch_version, whatever the framework.
            ("lightning", "2.4.0", "2.11.0+cu128", Address),
            ("transformers", "4.46.0", "2.11.0", Address),
            ("lightning", "2.4.0", "2.15.0", SegmentAge),
            ("pytorch", "2.15.0", "2.11.0", Address),
            // Clients that predate the field: PyTorch's hello names its
            // version as the framework's; Lightning's names Lightning's,
            // which says nothing of PyTorch's (the newest rules).
            ("pytorch", "2.11.0+cu128", "", Address),
            ("pytorch", "2.15.0+cu132", "", SegmentAge),
            ("lightning", "2.4.0", "", FreeBlockOrder::default()),
        ] {
            assert_eq!(
                order(framework, version, torch_version),
                rule,
                "{framework} {version}, torch {torch_version:?}"
            );
        }
        // A trace that names its version keeps it.
        let plan = ReplayPlan {
            torch_version: "2.11.0".into(),
            ..ReplayPlan::default()
        };
        let named = AllocatorTrace {
            torch_version: "2.15.0".into(),
            ..AllocatorTrace::default()
        };
        assert_eq!(plan.versioned(&named).torch_version, "2.15.0");
        assert_eq!(
            plan.versioned(&AllocatorTrace::default()).torch_version,
            "2.11.0"
        );
    }

    #[test]
    fn a_trace_entry_replays_under_the_plan_it_was_recorded_with() {
        let plan = ReplayPlan {
            gradients: Gradients::FreedBeforeBackward,
            reserved_limit: Some(1 << 30),
            ddp_bucket_rebuild: Some(rebuild()),
            torch_version: String::new(),
        };
        let key = info(0).key();
        let entry = plan
            .clone()
            .entry(5, key, String::new(), AllocatorTrace::default());
        assert_eq!(ReplayPlan::of_entry(&entry), Some(plan.clone()));
        // As a record line: the rebuild next to the trace, not in it.
        let line = serde_json::to_value(&entry).unwrap();
        let fields = &line["allocator_trace"];
        assert_eq!(
            fields["ddp_bucket_rebuild"]["new_bucket_bytes"][1],
            24 << 20
        );
        assert!(
            fields["trace"].get("ddp_bucket_rebuild").is_none(),
            "{fields}"
        );
        let read: RecordEntry = serde_json::from_value(line).unwrap();
        assert_eq!(ReplayPlan::of_entry(&read), Some(plan));
        // Older records carry only `grads_persistent`.
        let old = RecordEntry::AllocatorTrace {
            at_ns: 5,
            key: info(0).key(),
            grads_persistent: true,
            gradients: None,
            reserved_limit: None,
            ddp_bucket_rebuild: None,
            trace: AllocatorTrace::default(),
            run_id: String::new(),
        };
        assert_eq!(
            ReplayPlan::of_entry(&old),
            Some(ReplayPlan {
                gradients: Gradients::Kept,
                ..ReplayPlan::default()
            })
        );
    }

    #[test]
    fn a_record_with_the_rebuild_inside_its_trace_is_refused_by_name() {
        // As older agents wrote it, before the rebuild joined the plan.
        let line = r#"{"allocator_trace":{"at_ns":5,"key":{"job":"j","rank":0},"grads_persistent":false,"reserved_limit":null,"trace":{"step":1,"segments":[],"events":[],"ddp_bucket_rebuild":{"old_bucket_bytes":[1],"new_bucket_bytes":[1]}}}}"#;
        let e = serde_json::from_str::<RecordEntry>(line).unwrap_err();
        assert!(e.to_string().contains("move it out of `trace`"), "{e}");
        // Without it, the same line reads.
        let plain = line.replace(
            r#","ddp_bucket_rebuild":{"old_bucket_bytes":[1],"new_bucket_bytes":[1]}"#,
            "",
        );
        let entry: RecordEntry = serde_json::from_str(&plain).unwrap();
        assert_eq!(
            ReplayPlan::of_entry(&entry).unwrap().ddp_bucket_rebuild,
            None
        );
    }
}
