//! Scenario files: one simulated training job, its GPU and its expected outcome.
//!
//! Scenarios are JSON (see `README.md` for the format and `scenarios/` for
//! examples). Unknown fields are rejected so that a typo cannot silently
//! change an outcome.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// A scenario file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The scenario file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid scenario JSON (including unknown fields).
    #[error("parsing scenario {path}: {source}")]
    Parse {
        /// The scenario file.
        path: String,
        /// The JSON error, with line and column.
        source: serde_json::Error,
    },
    /// The scenario parsed but contradicts itself; caught before it runs.
    #[error("scenario {name:?}: {reason}")]
    Invalid {
        /// The scenario's name.
        name: String,
        /// What is wrong, in words.
        reason: String,
    },
    /// A rank was asked for that the scenario does not have.
    #[error("scenario {name:?} has {count} ranks; rank {rank} does not exist")]
    NoSuchRank {
        /// The scenario's name.
        name: String,
        /// The rank asked for.
        rank: u32,
        /// Ranks the scenario has.
        count: u32,
    },
}

/// Numeric precision of the simulated job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimPrecision {
    /// fp32 weights, grads, state and activations.
    Fp32,
    /// bf16 weights, grads and activations; fp32 master weights and state.
    MixedBf16,
    /// bf16 everywhere, optimizer state included.
    Bf16,
}

/// The optimizer of the simulated job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimOptimizer {
    /// Adam/AdamW: `exp_avg` and `exp_avg_sq`, each like the master weights.
    Adam,
    /// SGD with momentum: one momentum buffer.
    SgdMomentum,
    /// Plain SGD: no state.
    Sgd,
}

/// Shape of the model and of one micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Total parameters. When absent it is derived from the shape as
    /// `layers·(12·hidden² + 2·hidden) + vocab·hidden`.
    #[serde(default)]
    pub parameter_count: Option<u64>,
    /// Transformer layers.
    pub layers: u32,
    /// Hidden size; with `layers` it sets parameter and activation sizes.
    pub hidden: u64,
    /// Attention heads; sizes the attention-score activations.
    pub heads: u64,
    /// Vocabulary size; 0 for no embedding and no logits.
    #[serde(default)]
    pub vocab: u64,
    /// Sequence length, tokens.
    pub seq_len: u64,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Flash attention: drops the `5·a·s²·b` attention-score term.
    #[serde(default)]
    pub flash_attention: bool,
}

/// How the job trains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Training {
    /// Precision; sets the bytes of weights, grads, state and activations.
    pub precision: SimPrecision,
    /// Optimizer; sets how much state step 1 creates.
    pub optimizer: SimOptimizer,
    /// State created before step 1 (torchtitan) instead of lazily inside
    /// the first `optimizer.step()`.
    #[serde(default)]
    pub state_precreated: bool,
    /// `zero_grad(set_to_none=True)` (PyTorch's default) frees grads at the
    /// start of each step; false zeroes them in place and keeps them.
    #[serde(default = "yes")]
    pub grads_set_to_none: bool,
    /// Micro-batches per optimizer step (default 1).
    #[serde(default = "one")]
    pub grad_accumulation_steps: u32,
    /// ZeRO-1 style: optimizer state and master weights are split over this
    /// many ranks; weights, grads and activations are not.
    #[serde(default = "one")]
    pub sharding_factor: u32,
    /// The `foreach` (multi-tensor) optimizer implementation, PyTorch's
    /// default on CUDA: its temporaries span all parameters at once.
    #[serde(default = "yes")]
    pub foreach: bool,
    /// Optimizer steps to run.
    pub steps: u64,
}

/// The ranks of the job; each runs on its own GPU of the kind in [`Gpu`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ranks {
    /// Number of ranks (default 1).
    #[serde(default = "one")]
    pub count: u32,
    /// Factor on a rank's activation and temporary memory (default 1.0),
    /// e.g. `{"0": 1.15}` for rank 0 at +15%.
    #[serde(default)]
    pub memory_skew: BTreeMap<u32, f64>,
    /// Factor on a rank's phase durations (default 1.0).
    #[serde(default)]
    pub time_skew: BTreeMap<u32, f64>,
}

impl Default for Ranks {
    fn default() -> Self {
        Self {
            count: 1,
            memory_skew: BTreeMap::new(),
            time_skew: BTreeMap::new(),
        }
    }
}

/// The GPU each rank runs on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// Total memory as NVML reports it.
    pub capacity_bytes: u64,
    /// CUDA context: about 0.3 GB with lazy module loading, 0.6 GB without.
    pub cuda_context_bytes: u64,
    /// NCCL and cuBLAS workspaces outside the caching allocator.
    #[serde(default)]
    pub workspace_bytes: u64,
    /// Memory held by other processes on the same GPU.
    #[serde(default)]
    pub other_process_bytes: u64,
}

/// Phase durations in milliseconds. Forward and backward are per micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timing {
    /// Before step 1: loading weights (and pre-creating state).
    pub init_ms: f64,
    /// Step begin to the first forward.
    pub prologue_ms: f64,
    /// One forward pass.
    pub forward_ms: f64,
    /// One backward pass.
    pub backward_ms: f64,
    /// `optimizer.step()`.
    pub optimizer_ms: f64,
    /// Optimizer end to step end.
    pub epilogue_ms: f64,
}

/// The durations a scenario's `timing` leaves out.
impl Default for Timing {
    fn default() -> Self {
        Self {
            init_ms: 200.0,
            prologue_ms: 5.0,
            forward_ms: 60.0,
            backward_ms: 120.0,
            optimizer_ms: 30.0,
            epilogue_ms: 5.0,
        }
    }
}

/// Whether a rank finishes all its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKind {
    /// Completes every step.
    Fits,
    /// Runs out of GPU memory.
    Oom,
}

/// What a rank is expected to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expectation {
    /// Whether the rank completes or runs out of memory.
    pub outcome: OutcomeKind,
    /// The step that runs out of memory; required when `outcome` is `oom`.
    #[serde(default)]
    pub oom_step: Option<u64>,
    /// Bounds on the headroom of a fitting rank: `1 − peak/capacity`, where
    /// peak is the highest NVML-visible use of the GPU (this process plus
    /// other processes).
    #[serde(default)]
    pub headroom_min: Option<f64>,
    /// Upper bound on that headroom.
    #[serde(default)]
    pub headroom_max: Option<f64>,
}

/// Expected outcome of every rank, with per-rank exceptions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expected {
    /// What every rank is expected to do unless `ranks` names it: its
    /// fields stand at this object's top level.
    #[serde(flatten)]
    pub default: Expectation,
    /// Exceptions, keyed by rank.
    #[serde(default)]
    pub ranks: BTreeMap<u32, Expectation>,
}

impl Expected {
    /// What `rank` is expected to do.
    pub fn for_rank(&self, rank: u32) -> Expectation {
        self.ranks.get(&rank).unwrap_or(&self.default).clone()
    }
}

/// One simulated training job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Identifier; also used as the job id (`[A-Za-z0-9._-]`).
    pub name: String,
    /// What the scenario shows, for humans.
    #[serde(default)]
    pub description: String,
    /// Model and micro-batch shape; sets weights and activations.
    pub model: ModelShape,
    /// How the job trains.
    pub training: Training,
    /// Rank count and per-rank skews (default: one rank).
    #[serde(default)]
    pub ranks: Ranks,
    /// The GPU each rank runs on.
    pub gpu: Gpu,
    /// Phase durations (defaults apply).
    #[serde(default)]
    pub timing: Timing,
    /// Name of another scenario whose rank 0 shares this scenario's rank-0
    /// GPU. Both files name each other and both expectations hold when they
    /// run together (see [`crate::simulate_shared`]).
    #[serde(default)]
    pub colocated_with: Option<String>,
    /// Delay before this job starts, relative to the caller's start time.
    #[serde(default)]
    pub start_offset_ms: f64,
    /// The outcome the model must produce; tests check it.
    pub expected: Expected,
}

fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}

impl Scenario {
    /// Parses and validates a scenario; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ScenarioError> {
        let s: Scenario = serde_json::from_str(text).map_err(|source| ScenarioError::Parse {
            path: origin.to_owned(),
            source,
        })?;
        s.validate()?;
        Ok(s)
    }

    /// Loads and validates one scenario file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ScenarioError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// Loads every `*.json` file of a directory, sorted by file name.
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<Vec<Self>, ScenarioError> {
        let dir = dir.as_ref();
        let io = |source| ScenarioError::Io {
            path: dir.display().to_string(),
            source,
        };
        let mut paths = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|e| e == "json") {
                paths.push(path);
            }
        }
        paths.sort();
        paths.iter().map(Self::load).collect()
    }

    /// Total parameters, given or derived from the shape.
    pub fn parameter_count(&self) -> u64 {
        let m = &self.model;
        m.parameter_count.unwrap_or_else(|| {
            u64::from(m.layers) * (12 * m.hidden * m.hidden + 2 * m.hidden) + m.vocab * m.hidden
        })
    }

    /// Memory skew of `rank` (1.0 unless given).
    pub fn memory_skew(&self, rank: u32) -> f64 {
        self.ranks.memory_skew.get(&rank).copied().unwrap_or(1.0)
    }

    /// Time skew of `rank` (1.0 unless given).
    pub fn time_skew(&self, rank: u32) -> f64 {
        self.ranks.time_skew.get(&rank).copied().unwrap_or(1.0)
    }

    /// Checks the ranges the model relies on.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |reason: String| {
            Err(ScenarioError::Invalid {
                name: self.name.clone(),
                reason,
            })
        };
        if self.name.is_empty()
            || self.name.len() > 64
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return bad("name must be 1-64 characters of [A-Za-z0-9._-]".into());
        }
        let m = &self.model;
        for (field, v) in [
            ("model.layers", u64::from(m.layers)),
            ("model.hidden", m.hidden),
            ("model.heads", m.heads),
            ("model.seq_len", m.seq_len),
            ("model.micro_batch", m.micro_batch),
            ("training.steps", self.training.steps),
            (
                "training.grad_accumulation_steps",
                u64::from(self.training.grad_accumulation_steps),
            ),
            (
                "training.sharding_factor",
                u64::from(self.training.sharding_factor),
            ),
            ("ranks.count", u64::from(self.ranks.count)),
            ("gpu.capacity_bytes", self.gpu.capacity_bytes),
        ] {
            if v == 0 {
                return bad(format!("{field} must be at least 1"));
            }
        }
        // Keep every size comfortably inside u64 arithmetic.
        if m.layers > 10_000
            || m.hidden > 1 << 20
            || m.heads > 1 << 12
            || m.vocab > 1 << 24
            || m.seq_len > 1 << 22
            || m.micro_batch > 1 << 16
            || self.training.steps > 1_000_000
            || self.training.grad_accumulation_steps > 1024
            || self.training.sharding_factor > 65_536
            || self.ranks.count > 65_536
        {
            return bad("model or training figures are out of range".into());
        }
        let fixed = u64::from(m.layers) * 2 * m.hidden + m.vocab * m.hidden;
        if let Some(p) = m.parameter_count {
            if p <= fixed || p > 1 << 44 {
                return bad(format!(
                    "model.parameter_count {p} must exceed the norm and embedding parameters ({fixed}) and stay below 2^44"
                ));
            }
        }
        for (what, map) in [
            ("memory_skew", &self.ranks.memory_skew),
            ("time_skew", &self.ranks.time_skew),
        ] {
            for (&rank, &f) in map {
                if rank >= self.ranks.count {
                    return bad(format!(
                        "ranks.{what} names rank {rank} of {}",
                        self.ranks.count
                    ));
                }
                if !(f.is_finite() && f > 0.0 && f <= 100.0) {
                    return bad(format!("ranks.{what} for rank {rank} must be in (0, 100]"));
                }
            }
        }
        let t = &self.timing;
        for (field, v) in [
            ("timing.init_ms", t.init_ms),
            ("timing.prologue_ms", t.prologue_ms),
            ("timing.forward_ms", t.forward_ms),
            ("timing.backward_ms", t.backward_ms),
            ("timing.optimizer_ms", t.optimizer_ms),
            ("timing.epilogue_ms", t.epilogue_ms),
            ("start_offset_ms", self.start_offset_ms),
        ] {
            if !(v.is_finite() && (0.0..=3.6e6).contains(&v)) {
                return bad(format!("{field} must be between 0 and one hour"));
            }
        }
        let mut expectations = vec![("expected".to_string(), self.expected.default.clone())];
        for (&rank, e) in &self.expected.ranks {
            if rank >= self.ranks.count {
                return bad(format!(
                    "expected.ranks names rank {rank} of {}",
                    self.ranks.count
                ));
            }
            expectations.push((format!("expected.ranks.{rank}"), e.clone()));
        }
        for (field, e) in expectations {
            match (e.outcome, e.oom_step) {
                (OutcomeKind::Oom, None) => return bad(format!("{field}: oom needs oom_step")),
                (OutcomeKind::Oom, Some(s)) if s == 0 || s > self.training.steps => {
                    return bad(format!("{field}: oom_step {s} is not a step of this run"))
                }
                (OutcomeKind::Fits, Some(_)) => {
                    return bad(format!("{field}: a fitting run has no oom_step"))
                }
                _ => {}
            }
            for v in [e.headroom_min, e.headroom_max].into_iter().flatten() {
                if !(v.is_finite() && (-1.0..=1.0).contains(&v)) {
                    return bad(format!(
                        "{field}: headroom bounds are fractions of capacity"
                    ));
                }
            }
        }
        if self.colocated_with.as_deref() == Some(self.name.as_str()) {
            return bad("colocated_with names the scenario itself".into());
        }
        Ok(())
    }
}

macro_rules! builtin {
    ($file:literal) => {
        (
            $file,
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios/", $file)),
        )
    };
}

/// The scenario files shipped in `scenarios/`, compiled in so that demos need
/// no path. Each is `(file name, JSON text)`.
pub const BUILTIN: &[(&str, &str)] = &[
    builtin!("accumulation-4.json"),
    builtin!("adam-fits.json"),
    builtin!("adam-step2-oom.json"),
    builtin!("bf16-adam.json"),
    builtin!("colocated-a.json"),
    builtin!("colocated-b.json"),
    builtin!("demo-small.json"),
    builtin!("fp32-adam.json"),
    builtin!("grads-kept.json"),
    builtin!("mig-slice-oom.json"),
    builtin!("precreated-state.json"),
    builtin!("rank0-skew.json"),
    builtin!("sgd-momentum.json"),
    builtin!("sgd-no-state.json"),
    builtin!("thin-margin.json"),
    builtin!("zero-sharded-8.json"),
    builtin!("zero-sharded-retry.json"),
];

/// Every built-in scenario, parsed.
pub fn builtin_scenarios() -> Result<Vec<Scenario>, ScenarioError> {
    BUILTIN
        .iter()
        .map(|(file, text)| Scenario::from_json(text, file))
        .collect()
}

/// One built-in scenario by its `name`.
pub fn builtin_scenario(name: &str) -> Option<Scenario> {
    builtin_scenarios()
        .ok()?
        .into_iter()
        .find(|s| s.name == name)
}
