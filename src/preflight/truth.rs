//! What really happened on the fake GPUs: fake CUDA's usage log
//! (`STEPWATCH_FAKE_CUDA_USAGE_LOG`), one `<pid>.tsv` per process with a line
//! `<CLOCK_MONOTONIC ns>\t<cuda device>\t<gpu uuid>\t<bytes>` at every change
//! of that process's device usage: the exact NVML-visible usage over time.

use std::collections::BTreeMap;
use std::path::Path;

/// Every GPU's usage changes: uuid → [(ns, pid, bytes)], sorted by time.
#[derive(Debug, Default)]
pub struct Usage {
    by_gpu: BTreeMap<String, Vec<(u64, u32, u64)>>,
}

impl Usage {
    /// Reads every `<pid>.tsv` in `dir`; lines it cannot read are skipped
    /// (a process killed mid-write leaves a short last line).
    pub fn read(dir: &Path) -> std::io::Result<Self> {
        let mut usage = Usage::default();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let Some(pid) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".tsv"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            usage.add(pid, &std::fs::read_to_string(&path)?);
        }
        for events in usage.by_gpu.values_mut() {
            events.sort_unstable();
        }
        Ok(usage)
    }

    fn add(&mut self, pid: u32, text: &str) {
        for line in text.lines() {
            let mut f = line.split('\t');
            let (Some(ns), Some(_dev), Some(uuid), Some(bytes), None) =
                (f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                continue;
            };
            let (Ok(ns), Ok(bytes)) = (ns.parse::<u64>(), bytes.parse::<u64>()) else {
                continue;
            };
            self.by_gpu
                .entry(uuid.to_string())
                .or_default()
                .push((ns, pid, bytes));
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_gpu.is_empty()
    }

    /// The most the processes on GPU `uuid` held together over `[t0, t1]`,
    /// counting what they held when the window opened; None when nothing was
    /// ever logged for that GPU before `t1`.
    pub fn peak(&self, uuid: &str, t0: u64, t1: u64) -> Option<u64> {
        let mut held: BTreeMap<u32, u64> = BTreeMap::new();
        let mut best: Option<u64> = None;
        for &(ns, pid, bytes) in self.by_gpu.get(uuid)? {
            if ns > t1 {
                break;
            }
            if ns >= t0 && best.is_none() {
                best = Some(held.values().sum());
            }
            held.insert(pid, bytes);
            if ns >= t0 {
                let total: u64 = held.values().sum();
                best = Some(best.map_or(total, |b| b.max(total)));
            }
        }
        best.or_else(|| (!held.is_empty()).then(|| held.values().sum()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_sums_processes_and_counts_what_was_held_at_the_window_start() {
        let mut u = Usage::default();
        u.add(
            10,
            "100\t0\tGPU-a\t5\n200\t0\tGPU-a\t50\n300\t0\tGPU-a\t20\nbad line\n",
        );
        u.add(11, "150\t0\tGPU-a\t7\n250\t0\tGPU-a\t9\n1\t0\tGPU-b\t3\n");
        for e in u.by_gpu.values_mut() {
            e.sort_unstable();
        }
        // At 250: 50 + 9.
        assert_eq!(u.peak("GPU-a", 0, 1000), Some(59));
        // At 200: 50 + 7.
        assert_eq!(u.peak("GPU-a", 0, 220), Some(57));
        // Nothing changed inside the window: what was held when it opened.
        assert_eq!(u.peak("GPU-a", 301, 1000), Some(29));
        assert_eq!(u.peak("GPU-a", 0, 50), None);
        assert_eq!(u.peak("GPU-b", 0, 10), Some(3));
        assert_eq!(u.peak("GPU-c", 0, 10), None);
    }

    #[test]
    fn reads_a_directory_of_pid_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("42.tsv"), "5\t0\tGPU-x\t1024\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "5\t0\tGPU-x\t9\n").unwrap();
        let u = Usage::read(dir.path()).unwrap();
        assert_eq!(u.peak("GPU-x", 0, 10), Some(1024));
    }
}
