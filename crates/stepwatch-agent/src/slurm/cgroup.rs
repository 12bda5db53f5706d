//! The Slurm job and step a process runs in, from `/proc/<pid>/cgroup`.

/// A process's place in Slurm, as slurmstepd's cgroup names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmStep {
    /// The job id (`SLURM_JOB_ID`), digits.
    pub job: String,
    /// The step: a number, `batch`, `extern` or `interactive`.
    pub step: String,
}

impl SlurmStep {
    /// A job id of digits and a step that is a number, `batch`, `extern` or
    /// `interactive`; None for anything else.
    pub fn parse(job: &str, step: &str) -> Option<SlurmStep> {
        let job_ok = !job.is_empty() && job.bytes().all(|b| b.is_ascii_digit());
        let step_ok = !step.is_empty()
            && (step.bytes().all(|b| b.is_ascii_digit())
                || matches!(step, "batch" | "extern" | "interactive"));
        (job_ok && step_ok).then(|| SlurmStep {
            job: job.to_owned(),
            step: step.to_owned(),
        })
    }
}

/// The job and step of a process, or None for a process in no Slurm job.
///
/// proctrack/cgroup puts every task of a step under `job_<id>/step_<id>`:
/// on cgroup v2 `0::/system.slice/slurmstepd.scope/job_<id>/step_<id>/user/task_<n>`,
/// on v1 one line per controller, `<n>:freezer:/slurm[_<node>]/uid_<uid>/job_<id>/step_<id>`
/// (`/task_<n>` below it with some plugins). The kernel writes this file and
/// only root may move a process between these cgroups, so the job is the
/// node's word, not the client's. Paths with a `job_<id>` but no step
/// (slurmstepd's own `job_<id>/step_<id>/slurm` is still a step) are not a
/// task's, and are ignored.
pub fn parse_cgroup(text: &str) -> Option<SlurmStep> {
    text.lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .find_map(parse_path)
}

fn parse_path(path: &str) -> Option<SlurmStep> {
    let segments: Vec<&str> = path.split('/').collect();
    segments.windows(2).find_map(|pair| {
        let job = pair[0].strip_prefix("job_")?;
        let step = pair[1].strip_prefix("step_")?;
        SlurmStep::parse(job, step)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(job: &str, step: &str) -> Option<SlurmStep> {
        Some(SlurmStep {
            job: job.into(),
            step: step.into(),
        })
    }

    #[test]
    fn cgroup_v2_slurmstepd_scope() {
        let text = "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n";
        assert_eq!(parse_cgroup(text), step("4242", "0"));
        let batch = "0::/system.slice/slurmstepd.scope/job_7/step_batch/user/task_0\n";
        assert_eq!(parse_cgroup(batch), step("7", "batch"));
        // pam_slurm_adopt puts ssh sessions into the extern step.
        let ext = "0::/system.slice/slurmstepd.scope/job_7/step_extern/user/task_special\n";
        assert_eq!(parse_cgroup(ext), step("7", "extern"));
    }

    #[test]
    fn cgroup_v1_one_line_per_controller() {
        // What slurmd 22.05 with proctrack/cgroup writes on a hybrid host
        // (the test cluster of deploy/slurm/test.sh).
        let text = "9:name=systemd:/\n8:pids:/\n6:freezer:/slurm_vm/uid_0/job_1/step_0\n\
                    4:memory:/process_api/b807\n0::/\n";
        assert_eq!(parse_cgroup(text), step("1", "0"));
        let text = "5:devices:/slurm/uid_1000/job_88/step_3/task_1\n4:freezer:/slurm/uid_1000/job_88/step_3\n";
        assert_eq!(parse_cgroup(text), step("88", "3"));
    }

    #[test]
    fn processes_outside_slurm_have_no_job() {
        for text in [
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            "0::/\n",
            // slurmd itself, and a job's cgroup without a step.
            "0::/system.slice/slurmd.service\n",
            "0::/system.slice/slurmstepd.scope/job_5\n",
            "4:freezer:/slurm/uid_0/job_5\n",
            // Not digits, or an unknown step name.
            "0::/system.slice/slurmstepd.scope/job_x1/step_0\n",
            "0::/system.slice/slurmstepd.scope/job_1/step_\n",
            "0::/system.slice/slurmstepd.scope/job_1/step_evil\n",
            // A Kubernetes pod.
            "0::/kubepods.slice/kubepods-burstable.slice/cri-containerd-ab.scope\n",
            "",
            "garbage",
        ] {
            assert_eq!(parse_cgroup(text), None, "{text:?}");
        }
    }
}
