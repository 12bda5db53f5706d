//! Who a rank is, and the optional model facts it reports.

use serde::Serialize;

use crate::error::HelloError;

/// Longest accepted identifier (job id, node name, pod, …), in bytes.
pub const MAX_IDENTIFIER_BYTES: usize = 128;

/// Largest accepted world size.
pub const MAX_WORLD_SIZE: u32 = 65_536;

/// Key of one rank of one job; the unit the agent tracks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RankKey {
    pub job: String,
    pub rank: u32,
}

/// The optimizer family, which decides how much state step 1 creates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    #[default]
    Unknown,
    /// Adam / AdamW: two fp32 tensors per parameter.
    Adam,
    SgdMomentum,
    /// Plain SGD keeps no state.
    Sgd,
    Other,
}

/// Numeric precision of training.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    #[default]
    Unknown,
    Fp32,
    MixedBf16,
    MixedFp16,
    Bf16,
}

/// Optional facts about the model and optimizer; every field may be absent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ModelFacts {
    pub parameter_count: Option<u64>,
    pub parameter_bytes: Option<u64>,
    pub optimizer: OptimizerKind,
    pub state_bytes_per_parameter: Option<u32>,
    pub precision: Precision,
    pub sharding_factor: Option<u32>,
    pub grad_accumulation_steps: Option<u32>,
    pub state_precreated: Option<bool>,
    pub grads_set_to_none: Option<bool>,
}

/// Everything a rank says about itself in its hello.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RankInfo {
    pub job: String,
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
    pub node_name: String,
    pub pod: String,
    pub namespace: String,
    /// GPU the rank runs on; empty for CPU-only runs.
    pub gpu_uuid: String,
    /// PID in the agent's namespace when peer credentials gave it, else the
    /// PID the client reported.
    pub pid: u32,
    pub framework: String,
    pub framework_version: String,
    pub model: ModelFacts,
}

impl RankInfo {
    /// The key this rank is tracked under.
    pub fn key(&self) -> RankKey {
        RankKey {
            job: self.job.clone(),
            rank: self.rank,
        }
    }

    /// Checks the hello against the contract in `proto/stepwatch/v1`.
    /// Identifiers end up as Prometheus label values and in JSON, so their
    /// length and charset are bounded here, once, at the edge.
    pub fn validate(&self) -> Result<(), HelloError> {
        check_identifier("job_id", &self.job, false)?;
        check_identifier("node_name", &self.node_name, true)?;
        check_identifier("pod", &self.pod, true)?;
        check_identifier("namespace", &self.namespace, true)?;
        check_identifier("framework", &self.framework, true)?;
        check_identifier("framework_version", &self.framework_version, true)?;
        check_identifier("gpu_uuid", &self.gpu_uuid, true)?;
        if self.world_size == 0 || self.world_size > MAX_WORLD_SIZE {
            return Err(HelloError::WorldSize(self.world_size));
        }
        if self.rank >= self.world_size {
            return Err(HelloError::RankOutOfRange {
                field: "rank",
                value: self.rank,
                world_size: self.world_size,
            });
        }
        if self.local_rank >= self.world_size {
            return Err(HelloError::RankOutOfRange {
                field: "local_rank",
                value: self.local_rank,
                world_size: self.world_size,
            });
        }
        if self.model.sharding_factor == Some(0) {
            return Err(HelloError::Model("sharding_factor must be at least 1"));
        }
        if self.model.grad_accumulation_steps == Some(0) {
            return Err(HelloError::Model(
                "grad_accumulation_steps must be at least 1",
            ));
        }
        Ok(())
    }
}

fn check_identifier(
    field: &'static str,
    value: &str,
    may_be_empty: bool,
) -> Result<(), HelloError> {
    if value.is_empty() {
        return if may_be_empty {
            Ok(())
        } else {
            Err(HelloError::Empty(field))
        };
    }
    if value.len() > MAX_IDENTIFIER_BYTES {
        return Err(HelloError::TooLong {
            field,
            len: value.len(),
        });
    }
    if let Some(bad) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "._:/@+-".contains(*c)))
    {
        return Err(HelloError::Charset { field, bad });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> RankInfo {
        RankInfo {
            job: "llama-7b.run-3".into(),
            rank: 1,
            local_rank: 1,
            world_size: 2,
            ..Default::default()
        }
    }

    #[test]
    fn accepts_a_plain_hello() {
        assert_eq!(info().validate(), Ok(()));
    }

    #[test]
    fn rejects_rank_outside_world() {
        let mut i = info();
        i.rank = 2;
        assert!(matches!(
            i.validate(),
            Err(HelloError::RankOutOfRange { field: "rank", .. })
        ));
    }

    #[test]
    fn rejects_bad_identifiers() {
        let mut i = info();
        i.job = "a\"b".into();
        assert!(matches!(
            i.validate(),
            Err(HelloError::Charset { bad: '"', .. })
        ));
        i.job = "x".repeat(MAX_IDENTIFIER_BYTES + 1);
        assert!(matches!(i.validate(), Err(HelloError::TooLong { .. })));
        i.job = String::new();
        assert_eq!(i.validate(), Err(HelloError::Empty("job_id")));
    }
}
