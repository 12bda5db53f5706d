//! One input to the step model ([`RecordEntry`]) and why one is refused
//! ([`RecordError`]): what [`super::apply`] takes and what a record holds.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::allocator::SegmentLayout;
use crate::error::{HelloError, MarkerError};
use crate::identity::{DdpBucketRebuild, ModelFacts, RankInfo, RankKey};
use crate::marker::Marker;
use crate::postmortem::{OomReport, OomReportError};
use crate::replay::{AllocatorEvent, AllocatorTrace, Gradients, TraceError, TraceSettings};
use crate::sample::GpuSample;
use crate::tracker::OpenError;

/// One input to the tracker; `'a` is what a marker batch borrows (read from
/// a record, nothing is borrowed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordEntry<'a> {
    /// A stream's hello ([`crate::Tracker::open`]).
    Open {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank, as validated.
        info: RankInfo,
    },
    /// A marker batch the tracker accepted ([`crate::Tracker::markers`]).
    Markers {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank.
        key: Cow<'a, RankKey>,
        /// The batch.
        markers: Cow<'a, [Marker]>,
        /// The run its stream's hello named ([`RankInfo::run_id`]): the
        /// tracker refuses a batch of a run the rank has left
        /// ([`crate::Tracker::run_markers`]). Empty for older clients, and in
        /// records of older agents.
        #[serde(default, skip_serializing_if = "str::is_empty")]
        run_id: Cow<'a, str>,
    },
    /// A step-1 allocator trace, replayed and handed to the tracker
    /// ([`crate::Tracker::allocator_replay`]).
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
    /// Facts a rank sent after its hello ([`crate::Tracker::update_model_facts`]).
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
    /// What a rank's client sent with its OOM marker
    /// ([`crate::Tracker::record_oom_report`]).
    OomReport {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank.
        key: RankKey,
        /// The report as received.
        report: OomReport,
        /// The run its stream's hello named, as for [`RecordEntry::Markers`].
        #[serde(default, skip_serializing_if = "String::is_empty")]
        run_id: String,
    },
    /// GPU samples ([`crate::Tracker::gpu_samples`]).
    GpuSamples {
        /// GPU UUID.
        gpu: String,
        /// The samples.
        samples: Vec<GpuSample>,
    },
    /// A GPU's process list ([`crate::Tracker::set_gpu_processes`]).
    GpuProcesses {
        /// GPU UUID.
        gpu: String,
        /// (pid, used bytes) of each process.
        processes: Vec<(u32, u64)>,
    },
    /// Ranks idle for the retention window were evicted ([`crate::Tracker::evict_idle`]).
    Evict {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The retention window, ns.
        retention_ns: u64,
    },
    /// A stream closed ([`crate::Tracker::close`]).
    Close {
        /// Monotonic ns passed to the tracker.
        at_ns: u64,
        /// The rank.
        key: RankKey,
        /// The stream broke rather than ended ([`crate::Tracker::disconnect`]).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        broken: bool,
    },
}

impl RecordEntry<'_> {
    /// The entry with nothing borrowed, to keep (the agent's record): the
    /// one place a borrowed marker batch is copied.
    pub fn into_owned(self) -> RecordEntry<'static> {
        // Every other variant owns its fields: each is moved across as it is.
        macro_rules! moved {
            ($entry:expr, $($variant:ident { $($field:ident),* }),* $(,)?) => {
                match $entry {
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
                    $(RecordEntry::$variant { $($field),* } => RecordEntry::$variant { $($field),* },)*
                }
            };
        }
        moved!(
            self,
            Open { at_ns, info },
            AllocatorTrace {
                at_ns,
                key,
                grads_persistent,
                gradients,
                reserved_limit,
                ddp_bucket_rebuild,
                trace,
                run_id
            },
            ModelFacts {
                at_ns,
                key,
                update,
                run_id
            },
            OomReport {
                at_ns,
                key,
                report,
                run_id
            },
            GpuSamples { gpu, samples },
            GpuProcesses { gpu, processes },
            Evict {
                at_ns,
                retention_ns
            },
            Close { at_ns, key, broken },
        )
    }

    /// The rank an entry is about, for its advisories; None for a hello
    /// (its rank is its info's), a GPU's samples or processes and an
    /// eviction.
    pub fn key(&self) -> Option<&RankKey> {
        match self {
            RecordEntry::Markers { key, .. } => Some(key),
            RecordEntry::AllocatorTrace { key, .. }
            | RecordEntry::ModelFacts { key, .. }
            | RecordEntry::OomReport { key, .. }
            | RecordEntry::Close { key, .. } => Some(key),
            RecordEntry::Open { .. }
            | RecordEntry::GpuSamples { .. }
            | RecordEntry::GpuProcesses { .. }
            | RecordEntry::Evict { .. } => None,
        }
    }
}

/// An entry's trace as records hold it. Records of older agents
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
        forward_returns: Vec<u64>,
        #[serde(default)]
        torch_version: String,
        #[serde(default)]
        ddp_bucket_rebuild: Option<serde::de::IgnoredAny>,
    }
    let r = Recorded::deserialize(d)?;
    if r.ddp_bucket_rebuild.is_some() {
        return Err(serde::de::Error::custom(
            "the trace holds ddp_bucket_rebuild: an older agent wrote this \
             record with the DDP bucket rebuild inside the trace; move it out of \
             `trace` into its allocator_trace entry to replay the record",
        ));
    }
    Ok(AllocatorTrace {
        step: r.step,
        segments: r.segments,
        events: r.events,
        settings: r.settings,
        forward_returns: r.forward_returns,
        torch_version: r.torch_version,
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
    /// An OOM report the tracker refused.
    #[error("OOM report refused: {0}")]
    OomReport(#[from] OomReportError),
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
            RecordError::OomReport(_) => "invalid_oom_report",
            RecordError::Trace(TraceError::UnmodelledSetting(_)) => {
                "allocator_trace_unmodelled_setting"
            }
            RecordError::Trace(_) => "allocator_trace_invalid",
        }
    }

    /// Whether the refusal ends the stream the input came on, so that
    /// nothing it sends after is applied. A clock jump refuses its batch
    /// alone (the later batches are taken), and an OOM report the tracker
    /// cannot use refuses itself alone (a process that caught its OOM
    /// trains on); every other refusal breaks the rank's contract, or
    /// ends the stream's run, and what follows it would be refused too.
    pub fn ends_stream(&self) -> bool {
        !matches!(
            self,
            RecordError::Markers(MarkerError::ClockJumped { .. }) | RecordError::OomReport(_)
        )
    }

    /// What the tracker said, without naming the kind of input: for a
    /// message that names the input itself (the agent's gRPC statuses).
    pub fn refusal(&self) -> &(dyn std::error::Error + 'static) {
        match self {
            RecordError::Open(e) => e,
            RecordError::Markers(e) => e,
            RecordError::ModelFacts(e) => e,
            RecordError::OomReport(e) => e,
            RecordError::Trace(e) => e,
        }
    }
}
