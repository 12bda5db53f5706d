//! The GPU↔job mapping directory of dcgm-exporter's `--hpc-job-mapping-dir`.
//!
//! A Slurm prolog writes it and the epilog clears it (`deploy/slurm/`): one
//! file per GPU, named by its index (`0`, `1`, …) or, for a MIG instance,
//! `<gpu index>.<gpu instance id>` (`2.1`); each line of a file names a job
//! on that GPU. dcgm-exporter labels GPU series `hpc_job` from it; stepwatch
//! does too, and checks clients' Slurm job claims against it.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// Most files read from the directory (a node has at most a few dozen GPUs
/// and MIG instances; a directory pointed at the wrong place is not read whole).
const MAX_FILES: usize = 1024;
/// Most bytes read from one file (a GPU shared by a few hundred jobs).
const MAX_FILE_BYTES: u64 = 16 * 1024;

/// GPU (file name) → the jobs on it, in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobMapping(BTreeMap<String, Vec<String>>);

impl JobMapping {
    /// A mapping from `(file name, file text)` pairs; names that are not a
    /// GPU index or `<index>.<instance>` are skipped, as dcgm-exporter does.
    pub fn from_files<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut map = BTreeMap::new();
        for (name, text) in files {
            if is_gpu_file_name(name) {
                map.insert(name.to_owned(), parse_jobs(text));
            }
        }
        Self(map)
    }

    /// Reads the directory; a file that vanishes meanwhile (an epilog) is
    /// left out. Err only when the directory itself cannot be read.
    pub fn read(dir: &Path) -> std::io::Result<Self> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir)?.take(MAX_FILES) {
            let Ok(entry) = entry else { continue };
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if !is_gpu_file_name(&name) || !entry.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let mut text = String::new();
            let read = std::fs::File::open(entry.path())
                .and_then(|f| f.take(MAX_FILE_BYTES).read_to_string(&mut text));
            if read.is_ok() {
                files.push((name, text));
            }
        }
        Ok(Self::from_files(
            files.iter().map(|(n, t)| (n.as_str(), t.as_str())),
        ))
    }

    /// Whether any GPU (or MIG instance) of the node is mapped to `job`.
    pub fn has_job(&self, job: &str) -> bool {
        self.0.values().any(|jobs| jobs.iter().any(|j| j == job))
    }

    /// The jobs on the whole GPU with NVML index `index`; None when the
    /// directory has no file for it (nothing is known).
    pub fn jobs_on_gpu(&self, index: u32) -> Option<&[String]> {
        self.0.get(&index.to_string()).map(Vec::as_slice)
    }

    /// The one job on GPU `index`, for its series' `hpc_job` label; None
    /// when none is, or when several share it (no label rather than one of
    /// them, as for pods sharing a GPU by time-slicing).
    pub fn sole_job(&self, index: u32) -> Option<&str> {
        sole(self.jobs_on_gpu(index)?)
    }

    /// [`JobMapping::sole_job`] of the MIG instance `gpu_instance_id` of GPU
    /// `index` (the file `<index>.<gpu instance id>`).
    pub fn sole_job_on_instance(&self, index: u32, gpu_instance_id: u32) -> Option<&str> {
        sole(self.0.get(&format!("{index}.{gpu_instance_id}"))?)
    }
}

/// The one job of a GPU's file, or None when several jobs share it.
fn sole(jobs: &[String]) -> Option<&str> {
    match jobs {
        [one] => Some(one),
        [first, rest @ ..] if rest.iter().all(|j| j == first) => Some(first),
        _ => None,
    }
}

/// `0`, `12`, or `2.1` (a MIG instance): digits, optionally `.` digits.
pub fn is_gpu_file_name(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match name.split_once('.') {
        Some((gpu, instance)) => digits(gpu) && digits(instance),
        None => digits(name),
    }
}

/// The job ids of one file: the first word of each non-empty line (some
/// sites' prologs add the user's UID after it, `<job> <uid>`).
pub fn parse_jobs(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_are_gpu_indices_or_mig_instances() {
        for ok in ["0", "7", "12", "2.0", "3.10"] {
            assert!(is_gpu_file_name(ok), "{ok}");
        }
        for bad in [
            "", ".", "0.", ".1", "a", "0.a", "1.2.3", "GPU-abc", ".lock", "0~",
        ] {
            assert!(!is_gpu_file_name(bad), "{bad}");
        }
    }

    #[test]
    fn each_line_names_a_job() {
        assert_eq!(parse_jobs("42\n"), vec!["42"]);
        assert_eq!(parse_jobs("42\n43\n\n  \n44"), vec!["42", "43", "44"]);
        // jobstats' prolog writes "<job> <uid>".
        assert_eq!(parse_jobs("45916256 262563\n"), vec!["45916256"]);
        assert!(parse_jobs("").is_empty());
    }

    #[test]
    fn jobs_per_gpu() {
        let m = JobMapping::from_files([
            ("0", "42\n"),
            ("1", "43\n44\n"),
            ("2", ""),
            ("3.1", "45\n"),
            ("README", "99\n"),
        ]);
        assert!(m.has_job("42") && m.has_job("44") && m.has_job("45"));
        assert!(!m.has_job("99") && !m.has_job("4"));
        assert_eq!(m.jobs_on_gpu(0), Some(&["42".to_string()][..]));
        assert_eq!(m.jobs_on_gpu(2), Some(&[][..]));
        assert_eq!(m.jobs_on_gpu(3), None);
        assert_eq!(m.sole_job(0), Some("42"));
        assert_eq!(m.sole_job(1), None);
        assert_eq!(m.sole_job(2), None);
        assert_eq!(m.sole_job(9), None);
        // A MIG instance's file is its own: GPU 3's slice 1, not GPU 3.
        assert_eq!(m.sole_job_on_instance(3, 1), Some("45"));
        assert_eq!(m.sole_job_on_instance(3, 2), None);
        assert_eq!(m.sole_job(3), None);
        // A job written twice (a prolog run again) is still one job.
        let twice = JobMapping::from_files([("0", "42\n42\n")]);
        assert_eq!(twice.sole_job(0), Some("42"));
    }

    #[test]
    fn a_directory_is_read_file_by_file() {
        let dir = std::env::temp_dir().join(format!("stepwatch-map-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("5")).unwrap();
        std::fs::write(dir.join("0"), "42\n").unwrap();
        std::fs::write(dir.join("1.2"), "43\n").unwrap();
        std::fs::write(dir.join("notes"), "44\n").unwrap();
        let m = JobMapping::read(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(m, JobMapping::from_files([("0", "42\n"), ("1.2", "43\n")]));
        assert!(JobMapping::read(&dir).is_err());
    }
}
