//! Whether a hello's Slurm job claim stands: pure, from what the node says.

use super::cgroup::SlurmStep;
use super::mapping::JobMapping;

/// What the node says of the process on the other end of the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerView<'a> {
    /// No peer PID (TCP ingest): nothing to check against.
    NoPid,
    /// Its cgroup file could not be read (it exited, or `/proc` hides it).
    Unreadable,
    /// It runs in no Slurm job.
    Outside,
    /// It runs in this job and step.
    In(&'a SlurmStep),
}

/// The outcome for one hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The process runs in this Slurm job, and the hello claims no other:
    /// the rank counts as attested.
    Verified(SlurmStep),
    /// Nothing contradicts the hello, and nothing verifies it; the reason
    /// is a value of `stepwatch_slurm_attestations_total{result}`.
    Unverified(&'static str),
    /// The hello names a job its process does not run in, or a GPU its job
    /// was not given; `reason` is the refusal's (`stepwatch_markers_rejected_total`).
    Refused {
        reason: &'static str,
        message: String,
    },
}

/// The Slurm job id a hello's job names: `<id>` or `<id>.<step>` (what the
/// Python client sends under Slurm: `SLURM_JOB_ID`, and `.SLURM_STEP_ID`
/// under srun). None for any other name (`STEPWATCH_JOB_ID=my-run`).
pub fn claimed_job(job: &str) -> Option<&str> {
    let (id, step) = match job.split_once('.') {
        Some((id, step)) => (id, Some(step)),
        None => (job, None),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let step_ok = step.is_none_or(|s| digits(s) || matches!(s, "batch" | "extern" | "interactive"));
    (digits(id) && step_ok).then_some(id)
}

/// Decides a hello claiming job `claim` on the GPU with NVML index
/// `gpu_index` (None: CPU-only, or a GPU the agent does not see):
///
/// - a process in job J may not claim another Slurm job id (a name that is
///   not a Slurm id is its own choice and stays), nor a GPU that the
///   mapping gives to other jobs while it lists J on this node;
/// - a process in no job may not claim a job the mapping says runs here;
/// - without a PID or a readable cgroup, nothing is checked.
pub fn decide(
    claim: &str,
    peer: PeerView<'_>,
    mapping: &JobMapping,
    gpu_index: Option<u32>,
) -> Verdict {
    let claimed = claimed_job(claim);
    match peer {
        PeerView::NoPid => Verdict::Unverified("no_peer_pid"),
        PeerView::Unreadable => Verdict::Unverified("proc_unreadable"),
        PeerView::Outside => match claimed {
            Some(job) if mapping.has_job(job) => Verdict::Refused {
                reason: "slurm_job_not_yours",
                message: format!(
                    "the hello names Slurm job {job}, which runs on this node, but the process \
                     is in no Slurm job (its cgroup says so); run it inside the job (srun, sbatch)"
                ),
            },
            _ => Verdict::Unverified("not_in_job"),
        },
        PeerView::In(step) => {
            if let Some(job) = claimed.filter(|job| *job != step.job) {
                return Verdict::Refused {
                    reason: "slurm_job_not_yours",
                    message: format!(
                        "the hello names Slurm job {job}, but the process runs in job {} \
                         (its cgroup says so)",
                        step.job
                    ),
                };
            }
            if let Some(index) = gpu_index {
                let here = mapping.has_job(&step.job);
                let on_gpu = mapping
                    .jobs_on_gpu(index)
                    .is_some_and(|jobs| jobs.contains(&step.job));
                if here && !on_gpu {
                    return Verdict::Refused {
                        reason: "gpu_not_allocated",
                        message: format!(
                            "GPU {index} is not allocated to Slurm job {} (the job mapping \
                             directory lists the job on other GPUs of this node)",
                            step.job
                        ),
                    };
                }
            }
            Verdict::Verified(step.clone())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_job(job: &str) -> SlurmStep {
        SlurmStep {
            job: job.into(),
            step: "0".into(),
        }
    }

    fn refused(v: &Verdict) -> Option<&'static str> {
        match v {
            Verdict::Refused { reason, .. } => Some(reason),
            _ => None,
        }
    }

    #[test]
    fn slurm_job_names() {
        assert_eq!(claimed_job("4242"), Some("4242"));
        assert_eq!(claimed_job("4242.0"), Some("4242"));
        assert_eq!(claimed_job("4242.batch"), Some("4242"));
        for other in [
            "",
            "my-run",
            "4242a",
            "4242.",
            "4242.x",
            ".0",
            "42.0.1",
            "torchrun-a-1",
        ] {
            assert_eq!(claimed_job(other), None, "{other}");
        }
    }

    #[test]
    fn a_process_in_its_job_is_verified() {
        let map = JobMapping::from_files([("0", "42\n"), ("1", "43\n")]);
        let step = in_job("42");
        for claim in ["42", "42.0", "42.batch", "my-run"] {
            assert_eq!(
                decide(claim, PeerView::In(&step), &map, Some(0)),
                Verdict::Verified(step.clone()),
                "{claim}"
            );
        }
        // A job the prolog did not map (no GPUs, or no prolog): no GPU check.
        let other = in_job("50");
        assert_eq!(
            decide("50", PeerView::In(&other), &map, Some(1)),
            Verdict::Verified(other.clone())
        );
        // CPU-only ranks name no GPU.
        assert!(matches!(
            decide("42", PeerView::In(&step), &map, None),
            Verdict::Verified(_)
        ));
    }

    #[test]
    fn another_jobs_id_is_refused() {
        let map = JobMapping::from_files([("0", "42\n"), ("1", "43\n")]);
        let step = in_job("43");
        let v = decide("42", PeerView::In(&step), &map, Some(1));
        assert_eq!(refused(&v), Some("slurm_job_not_yours"));
        // Even a job not on this node: the process is in 43.
        let v = decide("77.0", PeerView::In(&step), &map, Some(1));
        assert_eq!(refused(&v), Some("slurm_job_not_yours"));
    }

    #[test]
    fn a_gpu_of_another_job_is_refused() {
        let map = JobMapping::from_files([("0", "42\n"), ("1", "43\n")]);
        let v = decide("42", PeerView::In(&in_job("42")), &map, Some(1));
        assert_eq!(refused(&v), Some("gpu_not_allocated"));
        // A GPU without a file is no job's either.
        let v = decide("42", PeerView::In(&in_job("42")), &map, Some(5));
        assert_eq!(refused(&v), Some("gpu_not_allocated"));
        // A GPU shared by two jobs is each one's.
        let shared = JobMapping::from_files([("0", "42\n43\n")]);
        assert!(matches!(
            decide("43", PeerView::In(&in_job("43")), &shared, Some(0)),
            Verdict::Verified(_)
        ));
    }

    #[test]
    fn outside_any_job_a_running_jobs_id_is_refused() {
        let map = JobMapping::from_files([("0", "42\n")]);
        let v = decide("42", PeerView::Outside, &map, Some(0));
        assert_eq!(refused(&v), Some("slurm_job_not_yours"));
        let v = decide("42.0", PeerView::Outside, &map, None);
        assert_eq!(refused(&v), Some("slurm_job_not_yours"));
        // A job that is not here, or a name that is no Slurm id, stands unverified.
        for job in ["41", "my-run"] {
            let v = decide(job, PeerView::Outside, &map, Some(0));
            assert_eq!(v, Verdict::Unverified("not_in_job"), "{job}");
        }
    }

    #[test]
    fn without_a_readable_peer_nothing_is_checked() {
        let map = JobMapping::from_files([("0", "42\n")]);
        for (peer, why) in [
            (PeerView::NoPid, "no_peer_pid"),
            (PeerView::Unreadable, "proc_unreadable"),
        ] {
            assert_eq!(decide("42", peer, &map, Some(0)), Verdict::Unverified(why));
        }
    }
}
