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
//! ([`Cow`](std::borrow::Cow)): the agent applies each batch from the stream's own buffer and
//! copies it ([`RecordEntry::into_owned`]) only when recording.

use serde::Serialize;

use crate::advisory::{Advisory, AdvisoryKind};
use crate::feed::{self, RecordEntry, RecordError};
use crate::identity::RankKey;
use crate::predict::PredictionBasis;
use crate::tracker::{Tracker, TrackerConfig};

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
    use crate::identity::RankInfo;
    use crate::marker::Marker;
    use crate::replay::TraceError;
    use std::borrow::Cow;

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
