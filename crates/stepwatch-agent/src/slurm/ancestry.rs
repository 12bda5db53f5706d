//! The Slurm step a process descends from, where its cgroup does not say
//! (proctrack/linuxproc or proctrack/pgid: the tasks share slurmd's cgroup).
//!
//! slurmstepd, root's process, starts every task of a step and names itself
//! `slurmstepd: [<job>.<step>]`. A process whose parent chain reaches a
//! root-owned slurmstepd runs in that step: a user cannot start a process
//! under another job's slurmstepd, nor make a root process of that name.
//! A task that daemonizes leaves the chain, and counts as in no job.

use super::cgroup::SlurmStep;

/// Most parents followed (a chain is a handful: slurmstepd, a launcher, the
/// training process).
const MAX_DEPTH: usize = 64;

/// What is read of one process: its parent, the owner of `/proc/<pid>`,
/// and its command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub ppid: u32,
    pub uid: u32,
    pub cmdline: String,
}

/// The parent PID in `/proc/<pid>/stat`: the second field after the
/// command name, which may itself hold spaces and parentheses.
pub fn parse_stat_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The step in slurmstepd's title, `slurmstepd: [4242.0]` (NULs of the
/// rewritten argv after it are ignored).
pub fn parse_stepd_title(cmdline: &str) -> Option<SlurmStep> {
    let title = cmdline.split('\0').next()?.trim_end();
    let inner = title.strip_prefix("slurmstepd: [")?.strip_suffix(']')?;
    let (job, step) = inner.split_once('.')?;
    SlurmStep::parse(job, step)
}

/// The step of the nearest root-owned slurmstepd above `pid` (its
/// ancestors, not itself), reading each process with `read`; None when the
/// chain ends (PID 1, an unreadable process) without one.
pub fn step_of_ancestors(pid: u32, read: impl Fn(u32) -> Option<ProcInfo>) -> Option<SlurmStep> {
    let mut at = read(pid)?.ppid;
    for _ in 0..MAX_DEPTH {
        if at <= 1 {
            return None;
        }
        let p = read(at)?;
        if p.uid == 0 {
            if let Some(step) = parse_stepd_title(&p.cmdline) {
                return Some(step);
            }
        }
        at = p.ppid;
    }
    None
}

/// [`ProcInfo`] of `pid` under `proc_root`.
pub fn read_proc(proc_root: &std::path::Path, pid: u32) -> Option<ProcInfo> {
    use std::os::unix::fs::MetadataExt;
    let dir = proc_root.join(pid.to_string());
    let uid = std::fs::metadata(&dir).ok()?.uid();
    let ppid = parse_stat_ppid(&std::fs::read_to_string(dir.join("stat")).ok()?)?;
    let raw = std::fs::read(dir.join("cmdline")).ok()?;
    let cmdline = String::from_utf8_lossy(&raw[..raw.len().min(4096)]).into_owned();
    Some(ProcInfo { ppid, uid, cmdline })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn the_parent_follows_the_command_name() {
        assert_eq!(
            parse_stat_ppid("4242 (python) S 4200 4242 4242 0 -1"),
            Some(4200)
        );
        assert_eq!(parse_stat_ppid("7 (a) b) (c) R 1 7 7"), Some(1));
        assert_eq!(parse_stat_ppid("garbage"), None);
    }

    #[test]
    fn slurmstepd_names_its_step() {
        let s = |job: &str, step: &str| {
            Some(SlurmStep {
                job: job.into(),
                step: step.into(),
            })
        };
        assert_eq!(parse_stepd_title("slurmstepd: [4242.0]"), s("4242", "0"));
        assert_eq!(
            parse_stepd_title("slurmstepd: [7.batch]\0\0\0"),
            s("7", "batch")
        );
        assert_eq!(
            parse_stepd_title("slurmstepd: [7.extern]"),
            s("7", "extern")
        );
        for other in [
            "slurmstepd",
            "slurmstepd: [7]",
            "slurmstepd: [x.0]",
            "slurmstepd: [7.evil]",
            "python\0slurmstepd: [7.0]",
            "/usr/sbin/slurmd",
        ] {
            assert_eq!(parse_stepd_title(other), None, "{other:?}");
        }
    }

    fn tree(entries: &[(u32, u32, u32, &str)]) -> HashMap<u32, ProcInfo> {
        entries
            .iter()
            .map(|&(pid, ppid, uid, cmdline)| {
                let cmdline = cmdline.into();
                (pid, ProcInfo { ppid, uid, cmdline })
            })
            .collect()
    }

    #[test]
    fn a_task_descends_from_its_steps_slurmstepd() {
        let t = tree(&[
            (100, 1, 0, "slurmstepd: [42.0]"),
            (110, 100, 1000, "python fake-cuda run"),
            (120, 110, 1000, "python train.py"),
            // A user's own process named like slurmstepd is not one.
            (200, 1, 1001, "slurmstepd: [42.0]"),
            (210, 200, 1001, "python"),
            // Reparented to init: in no job.
            (300, 1, 1000, "python"),
        ]);
        let read = |pid| t.get(&pid).cloned();
        let got = step_of_ancestors(120, read).map(|s| (s.job, s.step));
        assert_eq!(got, Some(("42".into(), "0".into())));
        assert_eq!(step_of_ancestors(210, read), None);
        assert_eq!(step_of_ancestors(300, read), None);
        // The process itself is not its own ancestor; an unreadable chain ends.
        assert_eq!(step_of_ancestors(100, read), None);
        assert_eq!(step_of_ancestors(999, read), None);
    }

    #[test]
    fn a_cycle_ends() {
        let t = tree(&[(5, 6, 1000, "a"), (6, 5, 1000, "b")]);
        assert_eq!(step_of_ancestors(5, |pid| t.get(&pid).cloned()), None);
    }
}
