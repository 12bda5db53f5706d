//! A record of everything a [`Tracker`] was fed, to replay it elsewhere.
//!
//! The step model is deterministic, so the hellos, marker batches, allocator
//! traces, GPU samples and process lists an agent applied, in the order it
//! applied them and with the times it passed, rebuild the same timelines,
//! analyses and predictions. The agent writes one [`RecordEntry`] per JSON
//! line (`stepwatch agent --record`); [`Replayer`] applies them to a fresh
//! tracker (`stepwatch replay-record`). Records from real GPUs are the test
//! fixtures of the predictor (`tests/fixtures/`).
//!
//! A [`RecordEntry`] is also how every caller describes an input to
//! [`crate::feed::apply`], the step model's one input path: what the agent
//! records is the input it applied. A marker batch may be borrowed
//! ([`Cow`]): the agent applies each batch from the stream's own buffer and
//! copies it ([`RecordEntry::into_owned`]) only when recording.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::advisory::{Advisory, AdvisoryKind};
use crate::allocator::SegmentLayout;
use crate::error::{HelloError, MarkerError};
use crate::feed;
use crate::identity::{DdpBucketRebuild, ModelFacts, RankInfo, RankKey};
use crate::marker::Marker;
use crate::predict::PredictionBasis;
use crate::replay::{AllocatorEvent, AllocatorTrace, Gradients, TraceError, TraceSettings};
use crate::sample::GpuSample;
use crate::tracker::{OpenError, Tracker, TrackerConfig};

/// One input to the tracker; `'a` is what a marker batch borrows (read from
/// a record, nothing is borrowed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordEntry<'a> {
    /// A stream's hello ([`Tracker::open`]).
    Open {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank, as validated.
        info: RankInfo,
    },
    /// A marker batch the tracker accepted ([`Tracker::markers`]).
    Markers {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank.
        key: Cow<'a, RankKey>,
        /// The batch.
        markers: Cow<'a, [Marker]>,
        /// The run its stream's hello named ([`RankInfo::run_id`]): the
        /// tracker refuses a batch of a run the rank has left
        /// ([`Tracker::run_markers`]). Empty for older clients, and in
        /// records of agents before 2026-12-02's sixth session.
        #[serde(default, skip_serializing_if = "str::is_empty")]
        run_id: Cow<'a, str>,
    },
    /// A step-1 allocator trace, replayed and handed to the tracker
    /// ([`Tracker::allocator_replay`]).
    AllocatorTrace {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank.
        key: RankKey,
        /// Whether gradients persist into step 2 (from the hello's facts).
        grads_persistent: bool,
        /// What becomes of the gradients between steps (from the hello);
        /// absent in older records: [`Gradients::from_persistent`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gradients: Option<Gradients>,
        /// The reserved-bytes limit the agent replayed it within, if any.
        #[serde(default)]
        reserved_limit: Option<u64>,
        /// DDP's bucket rebuild the agent replayed it with, from the rank's
        /// facts ([`crate::feed::ReplayPlan::ddp_bucket_rebuild`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ddp_bucket_rebuild: Option<DdpBucketRebuild>,
        /// The trace as received.
        #[serde(deserialize_with = "trace_as_recorded")]
        trace: AllocatorTrace,
        /// The run its stream's hello named, as for [`RecordEntry::Markers`].
        #[serde(default, skip_serializing_if = "String::is_empty")]
        run_id: String,
    },
    /// Facts a rank sent after its hello ([`Tracker::update_model_facts`]).
    ModelFacts {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank.
        key: RankKey,
        /// The update as received (its set fields replace the hello's).
        update: ModelFacts,
        /// The run its stream's hello named, as for [`RecordEntry::Markers`].
        #[serde(default, skip_serializing_if = "String::is_empty")]
        run_id: String,
    },
    /// GPU samples ([`Tracker::gpu_samples`]).
    GpuSamples {
        /// GPU UUID.
        gpu: String,
        /// The samples.
        samples: Vec<GpuSample>,
    },
    /// A GPU's process list ([`Tracker::set_gpu_processes`]).
    GpuProcesses {
        /// GPU UUID.
        gpu: String,
        /// (pid, used bytes) of each process.
        processes: Vec<(u32, u64)>,
    },
    /// Ranks idle for the retention window were evicted ([`Tracker::evict_idle`]).
    Evict {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The retention window, ns.
        retention_ns: u64,
    },
    /// A stream closed ([`Tracker::close`]).
    Close {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank.
        key: RankKey,
    },
}

impl RecordEntry<'_> {
    /// The entry with nothing borrowed, to keep (the agent's record): the
    /// one place a borrowed marker batch is copied.
    pub fn into_owned(self) -> RecordEntry<'static> {
        match self {
            RecordEntry::Markers {
                at_ns,
                key,
                markers,
                run_id,
            } => RecordEntry::Markers {
                at_ns,
                key: Cow::Owned(key.into_owned()),
                markers: Cow::Owned(markers.into_owned()),
                run_id: Cow::Owned(run_id.into_owned()),
            },
            RecordEntry::Open { at_ns, info } => RecordEntry::Open { at_ns, info },
            RecordEntry::AllocatorTrace {
                at_ns,
                key,
                grads_persistent,
                gradients,
                reserved_limit,
                ddp_bucket_rebuild,
                trace,
                run_id,
            } => RecordEntry::AllocatorTrace {
                at_ns,
                key,
                grads_persistent,
                gradients,
                reserved_limit,
                ddp_bucket_rebuild,
                trace,
                run_id,
            },
            RecordEntry::ModelFacts {
                at_ns,
                key,
                update,
                run_id,
            } => RecordEntry::ModelFacts {
                at_ns,
                key,
                update,
                run_id,
            },
            RecordEntry::GpuSamples { gpu, samples } => RecordEntry::GpuSamples { gpu, samples },
            RecordEntry::GpuProcesses { gpu, processes } => {
                RecordEntry::GpuProcesses { gpu, processes }
            }
            RecordEntry::Evict {
                at_ns,
                retention_ns,
            } => RecordEntry::Evict {
                at_ns,
                retention_ns,
            },
            RecordEntry::Close { at_ns, key } => RecordEntry::Close { at_ns, key },
        }
    }

    /// The rank an entry is about, for its advisories; None for a hello
    /// (its rank is its info's), a GPU's samples or processes and an
    /// eviction.
    pub fn key(&self) -> Option<&RankKey> {
        match self {
            RecordEntry::Markers { key, .. } => Some(key),
            RecordEntry::AllocatorTrace { key, .. }
            | RecordEntry::ModelFacts { key, .. }
            | RecordEntry::Close { key, .. } => Some(key),
            RecordEntry::Open { .. }
            | RecordEntry::GpuSamples { .. }
            | RecordEntry::GpuProcesses { .. }
            | RecordEntry::Evict { .. } => None,
        }
    }
}

/// An entry's trace as records hold it. Records of agents from 2026-12-02
/// before the rebuild moved into the plan held DDP's bucket rebuild inside
/// the trace: such a trace is refused by name rather than replayed without
/// it, which would silently give other figures.
fn trace_as_recorded<'de, D: serde::Deserializer<'de>>(d: D) -> Result<AllocatorTrace, D::Error> {
    /// [`AllocatorTrace`]'s fields (the literal below lists them all, so a
    /// new one does not compile until it is here) and the old rebuild.
    #[derive(Deserialize)]
    struct Recorded {
        step: u64,
        segments: Vec<SegmentLayout>,
        events: Vec<AllocatorEvent>,
        #[serde(default)]
        settings: Option<TraceSettings>,
        #[serde(default)]
        ddp_bucket_rebuild: Option<serde::de::IgnoredAny>,
    }
    let r = Recorded::deserialize(d)?;
    if r.ddp_bucket_rebuild.is_some() {
        return Err(serde::de::Error::custom(
            "the trace holds ddp_bucket_rebuild: an agent of 2026-12-02 wrote this \
             record with the DDP bucket rebuild inside the trace; move it out of \
             `trace` into its allocator_trace entry to replay the record",
        ));
    }
    Ok(AllocatorTrace {
        step: r.step,
        segments: r.segments,
        events: r.events,
        settings: r.settings,
    })
}

/// Why an input (an entry of a record) could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// A hello the tracker refused.
    #[error("hello refused: {0}")]
    Open(#[from] OpenError),
    /// A marker batch the tracker refused.
    #[error("markers refused: {0}")]
    Markers(#[from] MarkerError),
    /// A facts update the tracker refused.
    #[error("model facts refused: {0}")]
    ModelFacts(#[from] HelloError),
    /// A trace that does not replay.
    #[error("allocator trace refused: {0}")]
    Trace(#[from] TraceError),
}

impl RecordError {
    /// The `stepwatch_markers_rejected_total` reason the agent counts this
    /// refusal under.
    pub fn reason(&self) -> &'static str {
        match self {
            RecordError::Open(e) => e.reason(),
            RecordError::Markers(e) => e.reason(),
            RecordError::ModelFacts(_) => "invalid_model_update",
            RecordError::Trace(TraceError::UnmodelledSetting(_)) => {
                "allocator_trace_unmodelled_setting"
            }
            RecordError::Trace(_) => "allocator_trace_invalid",
        }
    }

    /// What the tracker said, without naming the kind of input: for a
    /// message that names the input itself (the agent's gRPC statuses).
    pub fn refusal(&self) -> &(dyn std::error::Error + 'static) {
        match self {
            RecordError::Open(e) => e,
            RecordError::Markers(e) => e,
            RecordError::ModelFacts(e) => e,
            RecordError::Trace(e) => e,
        }
    }
}

/// Applies a record's entries, in order, to a tracker of its own.
#[derive(Debug, Default)]
pub struct Replayer {
    tracker: Tracker,
    advisories: Vec<(RankKey, Advisory)>,
}

impl Replayer {
    /// A replayer whose tracker has `config` (use the recording agent's
    /// bounds, or the defaults).
    pub fn new(config: TrackerConfig) -> Self {
        Self {
            tracker: Tracker::new(config),
            advisories: Vec::new(),
        }
    }

    /// Applies one entry, as the agent did ([`feed::apply`]).
    pub fn apply(&mut self, entry: RecordEntry<'_>) -> Result<(), RecordError> {
        let applied = feed::apply(&mut self.tracker, &entry)?;
        if let Some(key) = entry.key() {
            self.advisories
                .extend(applied.advisories.into_iter().map(|a| (key.clone(), a)));
        }
        Ok(())
    }

    /// The tracker as the entries so far left it.
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// Advisories that became due, in order, with their rank.
    pub fn advisories(&self) -> &[(RankKey, Advisory)] {
        &self.advisories
    }

    /// For every rank, the prediction frozen when its step 2 began against
    /// the steady-state peak measured after it.
    pub fn prediction_checks(&self) -> Vec<PredictionCheck> {
        self.tracker
            .ranks()
            .map(|(key, state)| {
                let analysis = self.tracker.rank_analysis(key);
                let steady = analysis.as_ref().and_then(|a| a.steady.as_ref());
                let steady_peak = steady.and_then(|s| s.nvml_peak_bytes);
                let frozen = state.prediction_before_step2.as_ref();
                let predicted = frozen.map(|p| p.predicted_peak_bytes);
                PredictionCheck {
                    key: key.clone(),
                    basis: frozen.map(|p| p.inputs.basis),
                    predicted_peak_bytes: predicted,
                    steady_peak_bytes: steady_peak,
                    steady_steps: steady.map_or(0, |s| s.steps.len()),
                    capacity_bytes: analysis.as_ref().map_or(0, |a| a.capacity_bytes),
                    error_ratio: predicted
                        .zip(steady_peak)
                        .filter(|(_, a)| *a > 0)
                        .map(|(p, a)| (p as f64 - a as f64) / a as f64),
                    advisories: state.advisories.iter().map(|a| a.kind).collect(),
                }
            })
            .collect()
    }
}

/// A rank's frozen prediction against what followed (see
/// [`Replayer::prediction_checks`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PredictionCheck {
    /// The rank.
    pub key: RankKey,
    /// What the frozen prediction was computed from; None without one.
    pub basis: Option<PredictionBasis>,
    /// The device peak predicted before step 2 began.
    pub predicted_peak_bytes: Option<u64>,
    /// Median NVML peak over steps 2..k, once steady state is measured.
    pub steady_peak_bytes: Option<u64>,
    /// Steps that median is over.
    pub steady_steps: usize,
    /// GPU capacity from the latest sample (0 when unknown).
    pub capacity_bytes: u64,
    /// (predicted − steady) / steady.
    pub error_ratio: Option<f64>,
    /// Advisories issued to the rank, in order.
    pub advisories: Vec<AdvisoryKind>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_said_with_and_without_the_kind_of_input() {
        let e = RecordError::from(TraceError::NotStepOne(2));
        let said = "an allocator trace must come from step 1, not step 2";
        assert_eq!(e.to_string(), format!("allocator trace refused: {said}"));
        assert_eq!(e.refusal().to_string(), said);
    }

    #[test]
    fn a_borrowed_batch_is_applied_as_it_is_and_copied_to_be_kept() {
        let info = RankInfo {
            job: "j".into(),
            world_size: 1,
            gpu_uuid: "GPU-0".into(),
            pid: 10,
            ..RankInfo::default()
        };
        let key = info.key();
        let markers: Vec<Marker> = serde_json::from_str(
            r#"[{"kind":"step_begin","step":1,"monotonic_ns":10,"wall_ns":10,"micro_batch":0,"allocator":null}]"#,
        )
        .unwrap();
        let mut replayer = Replayer::default();
        replayer
            .apply(RecordEntry::Open { at_ns: 1, info })
            .unwrap();
        let batch = RecordEntry::Markers {
            at_ns: 10,
            key: Cow::Borrowed(&key),
            markers: Cow::Borrowed(&markers),
            run_id: Cow::Borrowed(""),
        };
        replayer.apply(batch.clone()).unwrap();
        let rank = replayer.tracker().rank(&key).unwrap();
        assert_eq!(rank.timeline.current().map(|s| s.step), Some(1));
        let kept = batch.clone().into_owned();
        assert!(matches!(
            &kept,
            RecordEntry::Markers {
                key: Cow::Owned(_),
                markers: Cow::Owned(_),
                ..
            }
        ));
        assert_eq!(kept, batch);
        let line = serde_json::to_string(&kept).unwrap();
        assert_eq!(serde_json::from_str::<RecordEntry>(&line).unwrap(), batch);
    }
}
