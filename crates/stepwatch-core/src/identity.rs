//! Who a rank is, and the optional model facts it reports.

use serde::{Deserialize, Serialize};

use crate::error::HelloError;
use crate::marker::{BatchFacts, MAX_PLAUSIBLE_BYTES};

/// Longest accepted identifier (job id, namespace, framework, …), in bytes.
pub const MAX_IDENTIFIER_BYTES: usize = 128;

/// Longest accepted pod or node name, in bytes: Kubernetes allows a DNS
/// subdomain (253) there, and a generated pod name (JobSet, Kubeflow) can
/// pass 128. The kubelet's name replaces the claimed one, so a shorter bound
/// would refuse such a pod for good.
pub const MAX_KUBERNETES_NAME_BYTES: usize = 253;

/// Largest accepted world size.
pub const MAX_WORLD_SIZE: u32 = 65_536;

/// Key of one rank of one job; the unit the agent tracks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RankKey {
    /// Kubernetes namespace of the rank's pod ("" outside Kubernetes): two
    /// tenants may pick the same job id, and must never share a rank. First,
    /// so a job's ranks sort together within their namespace. Absent in
    /// records written before it existed, hence the default.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    /// Job id shared by all ranks of one run.
    pub job: String,
    /// Global rank within the job.
    pub rank: u32,
}

/// The optimizer family, which decides how much state step 1 creates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// Not reported; state size then comes from `state_bytes_per_parameter` or
    /// the step-1 measurement.
    #[default]
    Unknown,
    /// Adam / AdamW: two fp32 tensors per parameter.
    Adam,
    /// SGD with momentum: one state tensor per parameter.
    SgdMomentum,
    /// Plain SGD keeps no state.
    Sgd,
    /// Anything else; `state_bytes_per_parameter` says how much it keeps.
    Other,
}

/// How the optimizer's step is computed, which decides the temporaries it
/// holds at its peak (measured on PyTorch 2.15's Adam/AdamW on fake CUDA:
/// foreach 1.0 × parameter bytes above the state, fused 0, the for-loop
/// about twice the largest parameter).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerImplementation {
    /// Not reported; read as PyTorch's default on CUDA, foreach.
    #[default]
    Unknown,
    /// Multi-tensor kernels over all parameters (`foreach=True`).
    Foreach,
    /// One fused kernel (`fused=True`).
    Fused,
    /// A loop over parameters (`foreach=False`).
    ForLoop,
}

/// Numeric precision of training.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Not reported; the predictor assumes 4-byte gradients.
    #[default]
    Unknown,
    /// Full fp32 training.
    Fp32,
    /// bf16 compute with fp32 master weights.
    MixedBf16,
    /// fp16 compute with fp32 master weights.
    MixedFp16,
    /// Pure bf16, no fp32 master copy; halves gradient size estimates.
    Bf16,
}

/// Optional facts about the model and optimizer; every field may be absent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFacts {
    /// Trainable parameters held by this rank; sizes state and gradients when
    /// they cannot be measured.
    pub parameter_count: Option<u64>,
    /// Bytes those parameters occupy on the GPU; sizes persistent gradients.
    pub parameter_bytes: Option<u64>,
    /// Optimizer family; gives the default state bytes per parameter.
    pub optimizer: OptimizerKind,
    /// Optimizer state bytes per parameter (Adam fp32: 8); overrides the
    /// family's default.
    pub state_bytes_per_parameter: Option<u32>,
    /// Training precision; picks the dtype size for gradient estimates.
    pub precision: Precision,
    /// ZeRO / FSDP factor optimizer state is sharded over (1 = none); divides
    /// the state estimate.
    pub sharding_factor: Option<u32>,
    /// Micro-batches per optimizer step; must be at least 1 when given.
    pub grad_accumulation_steps: Option<u32>,
    /// True when optimizer state exists before step 1, so step 2 adds none.
    pub state_precreated: Option<bool>,
    /// False when gradients persist between steps and must be added to step 2's
    /// forward peak; unknown is read as PyTorch's default (set to None).
    pub grads_set_to_none: Option<bool>,
    /// Samples per micro-batch (per forward pass on this rank); divides
    /// step 1's activation memory into a per-sample figure, to say which
    /// micro-batch would fit (see `fit`).
    #[serde(default)]
    pub micro_batch_size: Option<u32>,
    /// How the optimizer's step runs; sizes its temporaries in the estimate
    /// made before step 1's optimizer phase has been measured.
    #[serde(default)]
    pub optimizer_implementation: OptimizerImplementation,
    /// DDP's gradient buckets before and after the rebuild it makes at step
    /// 2's first forward, which step 1's allocator trace cannot show; the
    /// replay makes it (`replay`). None: no rebuild to come.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ddp_bucket_rebuild: Option<DdpBucketRebuild>,
    /// The largest batch the rank's data loader can produce, when the
    /// client was told it: what the step peaks' relation to their batches
    /// is extrapolated to (`batch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest_batch: Option<BatchFacts>,
}

/// Most buckets either list of a [`DdpBucketRebuild`] may hold: far above
/// any model's (DDP's default 25 MiB buckets of a 1 TB gradient make 40,000).
pub const MAX_DDP_BUCKETS: usize = 1 << 16;

/// DistributedDataParallel's gradient buckets around its one rebuild. With
/// `find_unused_parameters=False` (the default), PyTorch first puts all gradients of a dtype into one bucket, and at step 2's
/// first forward frees those buffers and allocates buckets of about 25 MiB,
/// in the order gradients became ready in step 1. Step 1's trace holds
/// neither, so the client says what they are.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DdpBucketRebuild {
    /// Bytes of each bucket buffer alive in step 1 (made when DDP was
    /// constructed, before the trace began).
    pub old_bucket_bytes: Vec<u64>,
    /// Bytes of each bucket buffer the rebuild allocates, in that order.
    pub new_bucket_bytes: Vec<u64>,
}

impl DdpBucketRebuild {
    /// Checks the bounds: a bounded number of non-empty buckets, each and
    /// all of them together within any GPU.
    pub fn validate(&self) -> Result<(), HelloError> {
        for list in [&self.old_bucket_bytes, &self.new_bucket_bytes] {
            if list.len() > MAX_DDP_BUCKETS {
                return Err(HelloError::Model(
                    "ddp_bucket_rebuild lists more than 65536 buckets",
                ));
            }
            if list.contains(&0) {
                return Err(HelloError::Model(
                    "ddp_bucket_rebuild has a bucket of 0 bytes",
                ));
            }
            // Each at most 2^50 and at most 2^16 of them: the sum cannot overflow.
            if list.iter().any(|&b| b > MAX_PLAUSIBLE_BYTES)
                || list.iter().sum::<u64>() > MAX_PLAUSIBLE_BYTES
            {
                return Err(HelloError::Model(
                    "ddp_bucket_rebuild's buckets are beyond any GPU (at most 1 PiB)",
                ));
            }
        }
        if self.new_bucket_bytes.is_empty() {
            return Err(HelloError::Model("ddp_bucket_rebuild has no new buckets"));
        }
        Ok(())
    }
}

impl ModelFacts {
    /// Takes the facts `update` states over these: its set fields (`Some`,
    /// or an enum other than unknown) replace, its absent ones keep what
    /// was said before. Clients learn some facts only after their hello,
    /// e.g. that `zero_grad(set_to_none=False)` keeps the gradients.
    pub fn merge(&mut self, update: &ModelFacts) {
        fn take<T: Copy>(mine: &mut Option<T>, theirs: Option<T>) {
            if theirs.is_some() {
                *mine = theirs;
            }
        }
        take(&mut self.parameter_count, update.parameter_count);
        take(&mut self.parameter_bytes, update.parameter_bytes);
        take(
            &mut self.state_bytes_per_parameter,
            update.state_bytes_per_parameter,
        );
        take(&mut self.sharding_factor, update.sharding_factor);
        take(
            &mut self.grad_accumulation_steps,
            update.grad_accumulation_steps,
        );
        take(&mut self.state_precreated, update.state_precreated);
        take(&mut self.grads_set_to_none, update.grads_set_to_none);
        take(&mut self.micro_batch_size, update.micro_batch_size);
        if update.optimizer != OptimizerKind::Unknown {
            self.optimizer = update.optimizer;
        }
        if update.precision != Precision::Unknown {
            self.precision = update.precision;
        }
        if update.optimizer_implementation != OptimizerImplementation::Unknown {
            self.optimizer_implementation = update.optimizer_implementation;
        }
        if update.largest_batch.is_some() {
            self.largest_batch.clone_from(&update.largest_batch);
        }
        if update.ddp_bucket_rebuild.is_some() {
            self.ddp_bucket_rebuild
                .clone_from(&update.ddp_bucket_rebuild);
        }
    }
}

/// Everything a rank says about itself in its hello.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankInfo {
    /// Job id shared by all ranks of one run; half of the [`RankKey`].
    pub job: String,
    /// Global rank, below `world_size`.
    pub rank: u32,
    /// Rank within this node, below `world_size`.
    pub local_rank: u32,
    /// Number of ranks in the job, 1..=65536.
    pub world_size: u32,
    /// Host name as the client sees it; a label on exported metrics.
    pub node_name: String,
    /// Kubernetes pod, when known (may be empty).
    pub pod: String,
    /// Kubernetes namespace, when known (may be empty); part of the
    /// [`RankKey`]. From the kubelet when `attested`, else as the client said.
    pub namespace: String,
    /// Container of the pod the rank runs in, from the kubelet (empty when
    /// not attested or not known).
    #[serde(default)]
    pub container: String,
    /// True when `pod`, `namespace` and `container` were read from the
    /// kubelet for the process on the other end of the socket (peer
    /// credentials → cgroup → pod), false when they are the client's claim.
    /// An unattested hello never takes over an attested rank.
    #[serde(default)]
    pub attested: bool,
    /// GPU the rank runs on; empty for CPU-only runs.
    pub gpu_uuid: String,
    /// PID in the agent's namespace when peer credentials gave it, else the
    /// PID the client reported.
    pub pid: u32,
    /// Training framework, e.g. "pytorch"; for display and diagnostics, and
    /// for when gradients are zeroed ([`crate::replay::Gradients::of`]:
    /// "lightning").
    pub framework: String,
    /// Its version string, e.g. "2.5.1".
    pub framework_version: String,
    /// The process's PyTorch version whatever the framework (Lightning and
    /// Hugging Face name their own in `framework_version`): the allocator
    /// rules of its trace's replay ([`crate::feed::ReplayPlan::torch_version`]).
    /// Empty for clients that predate it.
    #[serde(default)]
    pub torch_version: String,
    /// Optional facts that sharpen the step-2 prediction.
    pub model: ModelFacts,
    /// The training run of the process the hello is from (a fresh id per
    /// `watch()` or trainer fit). A hello with another non-empty run id
    /// starts the rank afresh ([`crate::Tracker::open_evicting`]): a second
    /// fit in one process gets its own step 1 and prediction. Empty for
    /// clients that predate it.
    #[serde(default)]
    pub run_id: String,
    /// Over TCP, who the transport proved the hello is from: the client
    /// certificate's digest (`tls:<sha256 hex>`) with mutual TLS, empty
    /// without one (a PID such a hello claims proves nothing). None on a
    /// Unix socket, where the PID comes from the kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_identity: Option<String>,
}

impl RankKey {
    /// The key of `rank` of `job` in `namespace` ("" outside Kubernetes).
    pub fn new(namespace: &str, job: &str, rank: u32) -> Self {
        Self {
            namespace: namespace.to_owned(),
            job: job.to_owned(),
            rank,
        }
    }
}

impl RankInfo {
    /// The key this rank is tracked under.
    pub fn key(&self) -> RankKey {
        RankKey {
            namespace: self.namespace.clone(),
            job: self.job.clone(),
            rank: self.rank,
        }
    }

    /// The PyTorch version the rank runs: the hello's `torch_version`, else
    /// (clients that predate it) the framework's version when the framework
    /// is PyTorch itself; empty when neither says.
    pub fn pytorch_version(&self) -> &str {
        if !self.torch_version.is_empty() {
            &self.torch_version
        } else if self.framework.eq_ignore_ascii_case("pytorch") {
            &self.framework_version
        } else {
            ""
        }
    }

    /// Whether a later hello can be told to be from this one's process
    /// ([`RankInfo::same_claimant`]): false over TCP without a client
    /// certificate.
    pub fn identifiable(&self) -> bool {
        self.tcp_identity.as_deref() != Some("")
    }

    /// Whether `other` comes from the same process as `self`: the same PID
    /// and the same pod. An unknown PID (0) or pod ("") on either side
    /// cannot tell them apart, and counts as the same. Over TCP the
    /// transport's identity must match as well, and a hello without one
    /// (no client certificate) is nobody's: it is the same as no other,
    /// whatever PID it claims.
    pub fn same_claimant(&self, other: &RankInfo) -> bool {
        match (&self.tcp_identity, &other.tcp_identity) {
            (None, None) => {}
            (Some(a), Some(b)) if !a.is_empty() && a == b => {}
            _ => return false,
        }
        let differ = |a: &str, b: &str| !a.is_empty() && !b.is_empty() && a != b;
        let pid_differs = self.pid != 0 && other.pid != 0 && self.pid != other.pid;
        !(pid_differs || differ(&self.pod, &other.pod))
    }

    /// Checks the hello against the contract in `proto/stepwatch/v1`.
    /// Identifiers end up as Prometheus label values and in JSON, so their
    /// length and charset are bounded here, once, at the edge.
    pub fn validate(&self) -> Result<(), HelloError> {
        let (id, k8s) = (MAX_IDENTIFIER_BYTES, MAX_KUBERNETES_NAME_BYTES);
        check_identifier("job_id", &self.job, false, id)?;
        check_identifier("node_name", &self.node_name, true, k8s)?;
        check_identifier("pod", &self.pod, true, k8s)?;
        check_identifier("namespace", &self.namespace, true, id)?;
        check_identifier("container", &self.container, true, id)?;
        check_identifier("framework", &self.framework, true, id)?;
        check_identifier("framework_version", &self.framework_version, true, id)?;
        check_identifier("torch_version", &self.torch_version, true, id)?;
        check_identifier("gpu_uuid", &self.gpu_uuid, true, id)?;
        check_identifier("run_id", &self.run_id, true, id)?;
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
        let m = &self.model;
        if m.parameter_count
            .is_some_and(|n| n > MAX_PLAUSIBLE_BYTES / 2)
        {
            return Err(HelloError::Model(
                "parameter_count is beyond any model (at most 2^49)",
            ));
        }
        if m.parameter_bytes.is_some_and(|n| n > MAX_PLAUSIBLE_BYTES) {
            return Err(HelloError::Model(
                "parameter_bytes is beyond any GPU (at most 1 PiB)",
            ));
        }
        if m.state_bytes_per_parameter.is_some_and(|n| n > 64) {
            return Err(HelloError::Model(
                "state_bytes_per_parameter is more than 64",
            ));
        }
        if m.sharding_factor.is_some_and(|n| n > MAX_WORLD_SIZE) {
            return Err(HelloError::Model(
                "sharding_factor is more than the largest world size (65536)",
            ));
        }
        if m.micro_batch_size.is_some_and(|n| n > 1 << 24) {
            return Err(HelloError::Model("micro_batch_size is more than 2^24"));
        }
        if m.grad_accumulation_steps.is_some_and(|n| n > 1 << 20) {
            return Err(HelloError::Model(
                "grad_accumulation_steps is more than 2^20",
            ));
        }
        if self.model.sharding_factor == Some(0) {
            return Err(HelloError::Model("sharding_factor must be at least 1"));
        }
        if self.model.grad_accumulation_steps == Some(0) {
            return Err(HelloError::Model(
                "grad_accumulation_steps must be at least 1",
            ));
        }
        if self.model.micro_batch_size == Some(0) {
            return Err(HelloError::Model("micro_batch_size must be at least 1"));
        }
        if let Some(r) = &self.model.ddp_bucket_rebuild {
            r.validate()?;
        }
        if let Some(b) = &self.model.largest_batch {
            if b.implausible().is_some() {
                return Err(HelloError::Model(
                    "largest_batch is beyond any loader's (counts at most 2^48, at most 8 \
                     dimensions, at most 2^50 elements)",
                ));
            }
        }
        Ok(())
    }
}

fn check_identifier(
    field: &'static str,
    value: &str,
    may_be_empty: bool,
    max_bytes: usize,
) -> Result<(), HelloError> {
    if value.is_empty() {
        return if may_be_empty {
            Ok(())
        } else {
            Err(HelloError::Empty(field))
        };
    }
    if value.len() > max_bytes {
        return Err(HelloError::TooLong {
            field,
            len: value.len(),
            max: max_bytes,
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
    fn a_facts_update_replaces_only_what_it_states() {
        let mut facts = ModelFacts {
            parameter_count: Some(10),
            optimizer: OptimizerKind::Adam,
            grads_set_to_none: None,
            precision: Precision::Bf16,
            ..ModelFacts::default()
        };
        facts.merge(&ModelFacts {
            grads_set_to_none: Some(false),
            ..ModelFacts::default()
        });
        assert_eq!(facts.grads_set_to_none, Some(false));
        assert_eq!(facts.parameter_count, Some(10));
        assert_eq!(facts.optimizer, OptimizerKind::Adam);
        assert_eq!(facts.precision, Precision::Bf16);
        facts.merge(&ModelFacts {
            parameter_count: Some(20),
            optimizer: OptimizerKind::SgdMomentum,
            ..ModelFacts::default()
        });
        assert_eq!(facts.parameter_count, Some(20));
        assert_eq!(facts.optimizer, OptimizerKind::SgdMomentum);
        assert_eq!(facts.grads_set_to_none, Some(false));
        let rebuild = DdpBucketRebuild {
            old_bucket_bytes: vec![4096],
            new_bucket_bytes: vec![1024, 3072],
        };
        facts.merge(&ModelFacts {
            ddp_bucket_rebuild: Some(rebuild.clone()),
            ..ModelFacts::default()
        });
        facts.merge(&ModelFacts::default());
        assert_eq!(facts.ddp_bucket_rebuild, Some(rebuild));
    }

    #[test]
    fn rejects_a_ddp_bucket_rebuild_no_gpu_holds() {
        let with = |old: Vec<u64>, new: Vec<u64>| {
            let mut i = info();
            i.model.ddp_bucket_rebuild = Some(DdpBucketRebuild {
                old_bucket_bytes: old,
                new_bucket_bytes: new,
            });
            i.validate()
        };
        assert_eq!(with(vec![4096], vec![1024, 3072]), Ok(()));
        assert_eq!(with(vec![], vec![4096]), Ok(()));
        let refused = |r: Result<(), HelloError>| matches!(r, Err(HelloError::Model(_)));
        assert!(refused(with(vec![4096], vec![])));
        assert!(refused(with(vec![4096], vec![0, 4096])));
        assert!(refused(with(vec![MAX_PLAUSIBLE_BYTES + 1], vec![1])));
        assert!(refused(with(vec![1], vec![MAX_PLAUSIBLE_BYTES, 1])));
        assert!(refused(with(vec![1; MAX_DDP_BUCKETS + 1], vec![1])));
    }

    #[test]
    fn accepts_a_plain_hello() {
        assert_eq!(info().validate(), Ok(()));
    }

    #[test]
    fn rejects_model_facts_no_model_has() {
        let refused = |f: fn(&mut ModelFacts)| {
            let mut i = info();
            f(&mut i.model);
            matches!(i.validate(), Err(HelloError::Model(_)))
        };
        assert!(refused(|m| m.parameter_count = Some(u64::MAX)));
        assert!(refused(|m| m.parameter_bytes = Some(u64::MAX / 2)));
        assert!(refused(|m| m.state_bytes_per_parameter = Some(u32::MAX)));
        assert!(refused(|m| m.sharding_factor = Some(70_000)));
        assert!(refused(|m| m.grad_accumulation_steps = Some(u32::MAX)));
        assert!(refused(|m| m.micro_batch_size = Some(u32::MAX)));
        // The largest real ones pass.
        let mut i = info();
        i.model.parameter_count = Some(2_000_000_000_000);
        i.model.parameter_bytes = Some(4_000_000_000_000);
        i.model.state_bytes_per_parameter = Some(16);
        i.model.sharding_factor = Some(65_536);
        i.model.grad_accumulation_steps = Some(4096);
        assert_eq!(i.validate(), Ok(()));
    }

    #[test]
    fn rejects_a_zero_micro_batch_size() {
        let mut i = info();
        i.model.micro_batch_size = Some(0);
        assert_eq!(
            i.validate(),
            Err(HelloError::Model("micro_batch_size must be at least 1"))
        );
        i.model.micro_batch_size = Some(1);
        assert_eq!(i.validate(), Ok(()));
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
        let mut i = info();
        i.torch_version = "2.11.0 cu128".into();
        assert!(matches!(
            i.validate(),
            Err(HelloError::Charset {
                field: "torch_version",
                bad: ' ',
                ..
            })
        ));
    }

    #[test]
    fn a_pod_or_node_name_may_be_as_long_as_kubernetes_allows() {
        // A JobSet's generated pod name of 200 bytes: the kubelet's name
        // replaces the claimed one, so refusing it would refuse the pod for good.
        for field in ["pod", "node_name"] {
            let mut i = info();
            let name = "trainer-".to_string() + &"a".repeat(192);
            let set = |i: &mut RankInfo, v: String| match field {
                "pod" => i.pod = v,
                _ => i.node_name = v,
            };
            set(&mut i, name);
            assert_eq!(i.validate(), Ok(()), "{field}");
            set(&mut i, "a".repeat(MAX_KUBERNETES_NAME_BYTES + 1));
            assert_eq!(
                i.validate(),
                Err(HelloError::TooLong {
                    field,
                    len: 254,
                    max: 253
                })
            );
        }
        // Other identifiers keep the label-sized bound.
        let mut i = info();
        i.namespace = "a".repeat(129);
        assert!(matches!(
            i.validate(),
            Err(HelloError::TooLong { max: 128, .. })
        ));
    }
}
