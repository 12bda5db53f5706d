//! Preflight's verdict per rank, and the report as text and as JSON.

use serde_json::{json, Value};

use super::gpus::{gib, GpuModel};
use super::verify::{Advice, Applied};

/// Below this share of the usable memory to spare, a fit is not good enough:
/// the agent's `low_observed_headroom` advisory and the accuracy bench's false-alarm
/// line use the same 5%.
pub const MIN_HEADROOM: f64 = 0.05;

/// What the fake cannot see: said in every report.
pub const BLIND_SPOTS: &[&str] = &[
    "cuDNN workspaces (cuDNN is off on fake CUDA; a real H100/H200 runs cuDNN attention and convolutions)",
    "NCCL's buffers beyond --nccl-bytes (each communicator takes that much; real NCCL takes what its settings say)",
    "data-dependent shapes: device reads are zeros (nonzero, MoE routing, masks read back, GradScaler's inf check)",
    "torch.compile, Triton, CUDA graphs and the cudaMallocAsync backend (not available: a script using them fails here)",
    "memory other processes on the real GPU hold",
];

/// How one rank's run ended on the fake GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Ran every step with at least 5% of the usable memory to spare.
    Fits,
    /// Ran every step with under 5% to spare.
    Tight,
    /// Ran out of memory in this step (0: before step 1's first marker).
    Oom(u64),
    /// Stopped before its last step because another rank ran out of memory.
    Aborted,
}

impl Verdict {
    pub fn text(self) -> String {
        match self {
            Verdict::Fits => "fits".into(),
            Verdict::Tight => "fits with under 5% to spare".into(),
            Verdict::Oom(2) => "step-2 OOM: step 1 fits, step 2 runs out of memory".into(),
            Verdict::Oom(0) => "OOM before step 1 ended (model or data set-up)".into(),
            Verdict::Oom(1) => "OOM in step 1".into(),
            Verdict::Oom(n) => format!("OOM in step {n}"),
            Verdict::Aborted => "stopped when another rank ran out of memory".into(),
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            Verdict::Fits => "fits",
            Verdict::Tight => "under_5_percent",
            Verdict::Oom(2) => "step2_oom",
            Verdict::Oom(_) => "oom",
            Verdict::Aborted => "aborted",
        }
    }

    pub fn ok(self) -> bool {
        self == Verdict::Fits
    }
}

/// One rank, measured.
#[derive(Debug, Clone, Default)]
pub struct RankResult {
    pub rank: u32,
    pub gpu_uuid: String,
    /// Steps the rank completed.
    pub steps_completed: u64,
    /// The step it ran out of memory in (agent's OOM marker or the process's output).
    pub oom_step: Option<u64>,
    /// Stopped early because another rank ran out of memory.
    pub aborted: bool,
    /// The GPU's peak during step 1 (fake CUDA's usage log).
    pub step1_peak_bytes: Option<u64>,
    /// The GPU's peak from step 2's begin to the last step's end (fake CUDA's usage log).
    pub steady_peak_bytes: Option<u64>,
    /// The agent's prediction, frozen before step 2 began, as the rank's
    /// report gave it (null: none); read through the accessors below.
    pub prediction: Value,
    /// (kind, message) of every advisory the agent sent the rank.
    pub advisories: Vec<(String, String)>,
}

impl RankResult {
    /// The predicted device peak, bytes.
    pub fn predicted_peak_bytes(&self) -> Option<u64> {
        self.prediction["predicted_peak_bytes"].as_u64()
    }

    /// The prediction's basis (`allocator`, `nvml_only`, …).
    pub fn prediction_basis(&self) -> Option<&str> {
        self.prediction["inputs"]["basis"].as_str()
    }

    /// Whether the prediction said step 2 runs out of memory.
    pub fn predicted_oom(&self) -> bool {
        self.prediction["oom_risk"].as_bool().unwrap_or(false)
    }

    /// The prediction's explanation.
    pub fn explanation(&self) -> Option<&str> {
        self.prediction["explanation"].as_str()
    }

    /// `what_would_fit` of the prediction (null without one).
    pub fn what_would_fit(&self) -> &Value {
        &self.prediction["what_would_fit"]
    }

    pub fn verdict(&self, usable: u64) -> Verdict {
        if let Some(step) = self.oom_step {
            return Verdict::Oom(step);
        }
        if self.aborted {
            return Verdict::Aborted;
        }
        match self.headroom(usable) {
            Some(h) if h < MIN_HEADROOM => Verdict::Tight,
            _ => Verdict::Fits,
        }
    }

    /// Share of the usable memory the steady peak leaves free.
    pub fn headroom(&self, usable: u64) -> Option<f64> {
        self.steady_peak_bytes
            .map(|p| (usable as f64 - p as f64) / usable.max(1) as f64)
    }

    /// The prediction's error against the steady peak.
    pub fn prediction_error(&self) -> Option<f64> {
        match (self.predicted_peak_bytes(), self.steady_peak_bytes) {
            (Some(p), Some(a)) if a > 0 => Some((p as f64 - a as f64) / a as f64),
            _ => None,
        }
    }
}

/// What `--verify-advice` found.
#[derive(Debug, Clone)]
pub enum Verification {
    /// The command ran again at the advised micro-batch.
    Ran {
        advice: Advice,
        /// How it was set, e.g. `--batch 2`.
        setting: String,
        applied: Applied,
        ranks: Vec<RankResult>,
        seconds: f64,
    },
    /// Why it did not run.
    NotRun(String),
}

/// Every rank's worst verdict: the job's.
fn job_fits(ranks: &[RankResult], usable: u64) -> bool {
    !ranks.is_empty() && ranks.iter().all(|r| r.verdict(usable).ok())
}

/// Everything the report says.
pub struct Report<'a> {
    pub command: &'a [String],
    pub gpu: &'a GpuModel,
    pub gpus: u32,
    pub steps: u64,
    pub seconds: f64,
    pub ranks: &'a [RankResult],
    /// With `--verify-advice`.
    pub verification: Option<&'a Verification>,
}

impl Report<'_> {
    /// The job's verdict: the worst rank's.
    pub fn exit_status(&self) -> i32 {
        if job_fits(self.ranks, self.gpu.usable_bytes()) {
            0
        } else {
            1
        }
    }

    pub fn text(&self) -> String {
        use std::fmt::Write as _;
        let usable = self.gpu.usable_bytes();
        let mut o = String::new();
        let _ = writeln!(
            o,
            "stepwatch preflight: {}\n  on {} x {} ({} usable of {} total), {} steps, {:.0} s",
            self.command.join(" "),
            self.gpus,
            self.gpu.name,
            gib(usable),
            gib(self.gpu.total_bytes),
            self.steps,
            self.seconds
        );
        let opt = |b: Option<u64>| b.map_or("-".to_string(), gib);
        for r in self.ranks {
            let v = r.verdict(usable);
            let _ = writeln!(o, "\nrank {}: {}", r.rank, v.text().to_uppercase());
            let _ = writeln!(o, "  step-1 peak          {}", opt(r.step1_peak_bytes));
            let pred = match (r.predicted_peak_bytes(), r.prediction_basis()) {
                (Some(p), Some(b)) => format!(
                    "{} ({b}{})",
                    gib(p),
                    if r.predicted_oom() {
                        ", step-2 OOM predicted"
                    } else {
                        ""
                    }
                ),
                (Some(p), None) => gib(p),
                _ => "none (the agent made no prediction during step 1)".into(),
            };
            let _ = writeln!(o, "  predicted in step 1  {pred}");
            match (r.steady_peak_bytes, r.oom_step) {
                (Some(p), None) if !r.aborted => {
                    let err = r
                        .prediction_error()
                        .map(|e| format!(", prediction {:+.2}%", e * 100.0))
                        .unwrap_or_default();
                    let _ = writeln!(
                        o,
                        "  steady peak          {} (steps 2-{}, fake CUDA{err})",
                        gib(p),
                        r.steps_completed
                    );
                    let _ = writeln!(o, "  headroom             {}", headroom(r, usable));
                }
                _ => {
                    let _ = writeln!(o, "  steady peak          - ({})", no_steady_peak(r));
                }
            }
            let fit = advice(r.what_would_fit());
            if !fit.is_empty() {
                let _ = writeln!(o, "  would fit            {}", fit.join("; "));
            }
            // The latest advisory of each kind (a revised prediction sends another).
            for (i, (kind, message)) in r.advisories.iter().enumerate() {
                if r.advisories[i + 1..].iter().all(|(k, _)| k != kind) {
                    let _ = writeln!(o, "  advisory {kind}: {message}");
                }
            }
        }
        if let Some(v) = self.verification {
            o.push_str(&verification_text(v, usable));
        }
        o.push_str("\nWhat the fake GPU cannot see (real runs need more than this):\n");
        for s in BLIND_SPOTS {
            let _ = writeln!(o, "  - {s}");
        }
        let _ = writeln!(
            o,
            "\nverdict: {} (exit status {})",
            if self.exit_status() == 0 {
                "fits"
            } else {
                "does not fit with 5% to spare"
            },
            self.exit_status()
        );
        o
    }

    pub fn json(&self) -> Value {
        let usable = self.gpu.usable_bytes();
        json!({
            "command": self.command,
            "gpu": {
                "model": self.gpu.key,
                "name": self.gpu.name,
                "total_bytes": self.gpu.total_bytes,
                "reserved_bytes": self.gpu.reserved_bytes,
                "usable_bytes": usable,
                "count": self.gpus,
            },
            "steps": self.steps,
            "seconds": (self.seconds * 100.0).round() / 100.0,
            "exit_status": self.exit_status(),
            "fits": self.exit_status() == 0,
            "ranks": ranks_json(self.ranks, usable),
            "verify_advice": self.verification.map(|v| verification_json(v, usable)),
            "cannot_see": BLIND_SPOTS,
        })
    }
}

/// The headroom the steady peak left, in GiB and percent.
fn headroom(r: &RankResult, usable: u64) -> String {
    let p = r.steady_peak_bytes.unwrap_or(0);
    format!(
        "{} ({:.1}%)",
        gib(usable.saturating_sub(p)),
        r.headroom(usable).unwrap_or(0.0) * 100.0
    )
}

/// Why a rank has no steady peak.
fn no_steady_peak(r: &RankResult) -> String {
    match r.oom_step {
        Some(step) => format!("ran out of memory in step {step}"),
        None if r.aborted => "stopped with the job".into(),
        None => "no step after step 1".into(),
    }
}

fn ranks_json(ranks: &[RankResult], usable: u64) -> Vec<Value> {
    ranks
        .iter()
        .map(|r| {
            let v = r.verdict(usable);
            json!({
                "rank": r.rank,
                "gpu_uuid": r.gpu_uuid,
                "verdict": v.key(),
                "verdict_text": v.text(),
                "oom_step": r.oom_step,
                "steps_completed": r.steps_completed,
                "step1_peak_bytes": r.step1_peak_bytes,
                "predicted_peak_bytes": r.predicted_peak_bytes(),
                "prediction_basis": r.prediction_basis(),
                "predicted_oom": r.predicted_oom(),
                "prediction_error": r.prediction_error(),
                "explanation": r.explanation(),
                "steady_peak_bytes": r.steady_peak_bytes,
                "headroom_bytes": r.steady_peak_bytes.map(|p| usable as i64 - p as i64),
                "headroom_fraction": r.headroom(usable),
                "what_would_fit": r.what_would_fit(),
                "advisories": r.advisories.iter().map(|(k, m)| json!({"kind": k, "message": m})).collect::<Vec<_>>(),
            })
        })
        .collect()
}

/// No rank ran out of memory: every one ran every step.
fn none_ran_out(ranks: &[RankResult]) -> bool {
    !ranks.is_empty() && ranks.iter().all(|r| r.oom_step.is_none() && !r.aborted)
}

fn verification_text(v: &Verification, usable: u64) -> String {
    use std::fmt::Write as _;
    let (advice, setting, ranks, seconds) = match v {
        Verification::NotRun(why) => return format!("\nadvice not checked: {why}\n"),
        Verification::Ran {
            advice,
            setting,
            ranks,
            seconds,
            ..
        } => (advice, setting, ranks, seconds),
    };
    let outcome = if job_fits(ranks, usable) {
        "FITS"
    } else if none_ran_out(ranks) {
        "FITS WITH UNDER 5% TO SPARE"
    } else {
        "STILL RUNS OUT OF MEMORY"
    };
    let mut o = format!(
        "\nadvice checked: micro-batch {} instead of {} ({setting}, run again, {seconds:.0} s): \
         {outcome}\n",
        advice.micro_batch_size, advice.from_micro_batch_size
    );
    for r in ranks {
        let _ = match r
            .steady_peak_bytes
            .filter(|_| r.oom_step.is_none() && !r.aborted)
        {
            Some(p) => writeln!(
                o,
                "  rank {}: {}, steady peak {}, headroom {}",
                r.rank,
                r.verdict(usable).text(),
                gib(p),
                headroom(r, usable)
            ),
            None => writeln!(
                o,
                "  rank {}: {} ({})",
                r.rank,
                r.verdict(usable).text(),
                no_steady_peak(r)
            ),
        };
    }
    o
}

fn verification_json(v: &Verification, usable: u64) -> Value {
    match v {
        Verification::NotRun(why) => json!({"ran": false, "reason": why}),
        Verification::Ran {
            advice,
            setting,
            applied,
            ranks,
            seconds,
        } => json!({
            "ran": true,
            "micro_batch_size": advice.micro_batch_size,
            "from_micro_batch_size": advice.from_micro_batch_size,
            "setting": setting,
            "command": applied.command,
            "env": applied.env.as_ref().map(|(k, v)| json!({k: v})),
            "fits": none_ran_out(ranks),
            "fits_with_5_percent_to_spare": job_fits(ranks, usable),
            "seconds": (seconds * 100.0).round() / 100.0,
            "ranks": ranks_json(ranks, usable),
        }),
    }
}

/// The agent's `what_would_fit`, in words (only what it named).
fn advice(fit: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(mb) = fit["fits_with_micro_batch_size"].as_u64() {
        // The size it was computed from is always there beside it.
        out.push(format!(
            "micro-batch {mb} (now {})",
            fit["micro_batch_size"]
        ));
    }
    if let Some(sf) = fit["fits_with_sharding_factor"].as_u64() {
        out.push(format!("optimizer state sharded {sf} ways"));
    }
    if let Some(over) = fit["over_capacity_bytes"].as_u64() {
        out.push(format!("{} over capacity", gib(over)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn rank(steady: Option<u64>, oom: Option<u64>) -> RankResult {
        RankResult {
            steady_peak_bytes: steady,
            oom_step: oom,
            steps_completed: 3,
            ..Default::default()
        }
    }

    #[test]
    fn verdicts() {
        let usable = 100 * GIB;
        assert_eq!(rank(Some(90 * GIB), None).verdict(usable), Verdict::Fits);
        assert_eq!(rank(Some(96 * GIB), None).verdict(usable), Verdict::Tight);
        assert_eq!(rank(None, Some(2)).verdict(usable), Verdict::Oom(2));
        assert_eq!(Verdict::Oom(2).key(), "step2_oom");
        assert_eq!(Verdict::Oom(0).key(), "oom");
    }

    #[test]
    fn the_job_fits_only_when_every_rank_does_and_blind_spots_are_always_said() {
        let gpu = super::super::gpus::with_capacity(100 * GIB);
        let command = vec!["python".to_string(), "train.py".to_string()];
        let ranks = [rank(Some(50 * GIB), None), rank(None, Some(2))];
        let report = Report {
            command: &command,
            gpu: &gpu,
            gpus: 2,
            steps: 3,
            seconds: 1.0,
            ranks: &ranks,
            verification: None,
        };
        assert_eq!(report.exit_status(), 1);
        let text = report.text();
        assert!(text.contains("STEP-2 OOM"), "{text}");
        assert!(text.contains("cuDNN workspaces"), "{text}");
        let j = report.json();
        assert_eq!(j["ranks"][1]["verdict"], "step2_oom");
        assert_eq!(j["cannot_see"].as_array().unwrap().len(), BLIND_SPOTS.len());
        let fits = Report {
            ranks: &ranks[..1],
            ..report
        };
        assert_eq!(fits.exit_status(), 0);
        assert!(fits.text().contains("cuDNN workspaces"));
    }

    #[test]
    fn the_verification_says_whether_the_advice_fits() {
        let gpu = super::super::gpus::with_capacity(100 * GIB);
        let command = vec![
            "python".to_string(),
            "t.py".into(),
            "--batch".into(),
            "4".into(),
        ];
        let checked = |ranks: Vec<RankResult>| Verification::Ran {
            advice: Advice {
                micro_batch_size: 2,
                from_micro_batch_size: 4,
            },
            setting: "--batch 2".into(),
            applied: Applied {
                command: vec!["python".into(), "t.py".into(), "--batch".into(), "2".into()],
                env: None,
            },
            ranks,
            seconds: 1.0,
        };
        let ranks = [rank(None, Some(2))];
        let report = |v: &Verification| {
            let r = Report {
                command: &command,
                gpu: &gpu,
                gpus: 1,
                steps: 3,
                seconds: 1.0,
                ranks: &ranks,
                verification: Some(v),
            };
            (r.exit_status(), r.text(), r.json())
        };
        let fits = checked(vec![rank(Some(60 * GIB), None)]);
        let (status, text, j) = report(&fits);
        // The command as given still does not fit.
        assert_eq!(status, 1);
        assert!(
            text.contains(
                "advice checked: micro-batch 2 instead of 4 (--batch 2, run again, 1 s): FITS"
            ),
            "{text}"
        );
        let v = &j["verify_advice"];
        assert_eq!(v["ran"], true);
        assert_eq!(v["micro_batch_size"], 2);
        assert_eq!(v["command"][3], "2");
        assert_eq!(
            (
                v["fits"].as_bool(),
                v["fits_with_5_percent_to_spare"].as_bool()
            ),
            (Some(true), Some(true))
        );
        assert_eq!(v["ranks"][0]["verdict"], "fits");
        let tight = checked(vec![rank(Some(98 * GIB), None)]);
        let (_, text, j) = report(&tight);
        assert!(text.contains("FITS WITH UNDER 5% TO SPARE"), "{text}");
        assert_eq!(j["verify_advice"]["fits_with_5_percent_to_spare"], false);
        let still = checked(vec![rank(None, Some(2))]);
        let (_, text, j) = report(&still);
        assert!(text.contains("STILL RUNS OUT OF MEMORY"), "{text}");
        assert!(text.contains("rank 0: step-2 OOM"), "{text}");
        assert_eq!(j["verify_advice"]["fits"], false);
        let not_run = Verification::NotRun("the agent's advice names no micro-batch size".into());
        let (_, text, j) = report(&not_run);
        assert!(
            text.contains("advice not checked: the agent's advice names no micro-batch size"),
            "{text}"
        );
        assert_eq!(
            j["verify_advice"],
            serde_json::json!({"ran": false, "reason": "the agent's advice names no micro-batch size"})
        );
    }
}
