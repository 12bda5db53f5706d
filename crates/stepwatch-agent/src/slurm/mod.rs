//! Slurm: which job a client's process runs in, as the node records it.
//!
//! Two records, neither written by the client. The cgroup slurmstepd puts
//! each task in (proctrack/cgroup: `…/job_<id>/step_<id>/…`, cgroup v1 or
//! v2), read from `/proc/<pid>/cgroup` of the peer PID that SO_PEERCRED
//! gives on the Unix socket ([`parse_cgroup`]); where the cgroup names no job
//! (proctrack/linuxproc, pgid), the root-owned `slurmstepd: [<job>.<step>]`
//! the process descends from. And the GPU↔job mapping
//! directory a prolog/epilog keeps in dcgm-exporter's `--hpc-job-mapping-dir`
//! format ([`JobMapping`]; `deploy/slurm/` ships the pair).
//!
//! With `--slurm-job-mapping-dir`, a hello that names a Slurm job
//! (`<SLURM_JOB_ID>[.<step>]`, what the Python client sends under Slurm) is
//! checked the way pod attribution checks a pod on Kubernetes
//! ([`decide`]): a process may claim only the job it runs in, and only a
//! GPU that job holds; a process in no job may not claim one running on the
//! node. A verified rank counts as attested. GPU series get the
//! `hpc_job` label of dcgm-exporter while one job holds the GPU.

mod ancestry;
mod cgroup;
mod mapping;
mod verdict;

pub use cgroup::{parse_cgroup, SlurmStep};
pub use mapping::JobMapping;
pub use verdict::{decide, PeerView, Verdict};

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Mutex;

use prometheus::{IntCounterVec, Registry};
use stepwatch_core::RankInfo;
use stepwatch_gpu::SamplerHandle;
use stepwatch_proto::clock::monotonic_ns;

/// Every value of `stepwatch_slurm_attestations_total{result}`.
const RESULTS: [&str; 5] = [
    "verified",
    "refused",
    "not_in_job",
    "no_peer_pid",
    "proc_unreadable",
];

/// A hello the node's records contradict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `slurm_job_not_yours` or `gpu_not_allocated`.
    pub reason: &'static str,
    /// What to tell the client and the log.
    pub message: String,
    /// No reconnect of this process can pass (it stays in its cgroup); a
    /// GPU refusal rests on the mapping directory, which a prolog may
    /// still be writing.
    pub for_good: bool,
}

/// The Slurm view of one agent (`--slurm-job-mapping-dir`).
pub struct Slurm {
    dir: PathBuf,
    proc_root: PathBuf,
    results: IntCounterVec,
    /// Problems already logged (once each).
    told: Mutex<HashSet<&'static str>>,
}

impl Slurm {
    /// Slurm attribution from the mapping directory `dir`, and the peers'
    /// cgroups under `proc_root` (`--proc-root`).
    pub fn new(dir: PathBuf, proc_root: PathBuf, registry: &Registry) -> prometheus::Result<Self> {
        let results =
            IntCounterVec::new(crate::metrics::SLURM_ATTESTATIONS_TOTAL.opts(), &["result"])?;
        for result in RESULTS {
            results.with_label_values(&[result]);
        }
        registry.register(Box::new(results.clone()))?;
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {
                tracing::info!(dir = %dir.display(), "Slurm attribution on: Slurm job claims are checked against the peer's cgroup and the job mapping directory")
            }
            _ => {
                tracing::warn!(dir = %dir.display(), "Slurm attribution on, but the job mapping directory is not there yet (the prolog of deploy/slurm/ creates it); claims are checked against the peer's cgroup alone until it is")
            }
        }
        Ok(Self {
            dir,
            proc_root,
            results,
            told: Mutex::new(HashSet::new()),
        })
    }

    /// The mapping directory as it is now; empty when it cannot be read
    /// (logged once).
    pub fn mapping(&self) -> JobMapping {
        self.mapping_or_empty(JobMapping::read(&self.dir))
    }

    /// A read mapping, or an empty one when the directory could not be read
    /// (logged once; a directory that is not there is no fault).
    fn mapping_or_empty(&self, read: std::io::Result<JobMapping>) -> JobMapping {
        read.unwrap_or_else(|e| {
            if e.kind() != std::io::ErrorKind::NotFound {
                self.tell_once(
                    "mapping_unreadable",
                    &format!(
                        "cannot read the Slurm job mapping directory {}: {e}",
                        self.dir.display()
                    ),
                );
            }
            JobMapping::default()
        })
    }

    /// Checks a hello's Slurm job claim from the process `pid` (SO_PEERCRED;
    /// None over TCP); a verified rank is marked attested. The GPU is found
    /// by the hello's UUID among the sampler's GPUs.
    pub async fn attest(
        &self,
        info: &mut RankInfo,
        sampler: &SamplerHandle,
        pid: Option<u32>,
    ) -> Result<(), Refusal> {
        let gpu_index = (!info.gpu_uuid.is_empty())
            .then(|| {
                sampler
                    .snapshot(monotonic_ns())
                    .gpus
                    .iter()
                    .find(|g| g.uuid == info.gpu_uuid)
                    .map(|g| g.index)
            })
            .flatten();
        let (proc_root, dir) = (self.proc_root.clone(), self.dir.clone());
        let read = tokio::task::spawn_blocking(move || {
            let step = pid.map(|pid| peer_step(&proc_root, pid));
            (step, JobMapping::read(&dir))
        })
        .await;
        let Ok((step, mapping)) = read else {
            self.results.with_label_values(&["proc_unreadable"]).inc();
            return Ok(());
        };
        let mapping = self.mapping_or_empty(mapping);
        let peer = match &step {
            None => PeerView::NoPid,
            Some(Err(e)) => {
                self.tell_once("proc_unreadable", &format!("cannot read a client's cgroup under {} ({e}); its Slurm job claim goes unchecked", self.proc_root.display()));
                PeerView::Unreadable
            }
            Some(Ok(None)) => PeerView::Outside,
            Some(Ok(Some(step))) => PeerView::In(step),
        };
        match decide(&info.job, peer, &mapping, gpu_index) {
            Verdict::Verified(step) => {
                self.results.with_label_values(&["verified"]).inc();
                tracing::debug!(job = %info.job, slurm_job = %step.job, slurm_step = %step.step, pid = info.pid, "a rank's Slurm job is verified from its cgroup");
                info.attested = true;
                Ok(())
            }
            Verdict::Unverified(why) => {
                self.results.with_label_values(&[why]).inc();
                Ok(())
            }
            Verdict::Refused { reason, message } => {
                self.results.with_label_values(&["refused"]).inc();
                tracing::warn!(job = %info.job, rank = info.rank, pid = info.pid, gpu = %info.gpu_uuid, reason, "refused a hello: {message}");
                let for_good = reason == "slurm_job_not_yours";
                Err(Refusal {
                    reason,
                    message,
                    for_good,
                })
            }
        }
    }

    fn tell_once(&self, what: &'static str, message: &str) {
        if self.told.lock().expect("not poisoned").insert(what) {
            tracing::warn!("{message} (logged once)");
        }
    }
}

/// The Slurm step of process `pid`: from its cgroup (proctrack/cgroup), else
/// from its nearest root-owned slurmstepd ancestor (other proctrack
/// plugins). Err when its cgroup cannot be read.
fn peer_step(proc_root: &std::path::Path, pid: u32) -> std::io::Result<Option<SlurmStep>> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup"))?;
    Ok(parse_cgroup(&text)
        .or_else(|| ancestry::step_of_ancestors(pid, |p| ancestry::read_proc(proc_root, p))))
}
