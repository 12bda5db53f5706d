//! The GPU models preflight knows: NVML's total and the driver-reserved memory,
//! whose difference is what PyTorch can use (`torch.cuda.get_device_properties(0).total_memory`,
//! the "total capacity" of its out-of-memory message).

use std::fmt::Write as _;

const MIB: u64 = 1 << 20;

/// One GPU model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuModel {
    /// What `--gpu` takes.
    pub key: String,
    /// As `nvmlDeviceGetName` reports it.
    pub name: String,
    /// NVML's `total` (nvidia-smi's "MiB" total).
    pub total_bytes: u64,
    /// NVML v2 `reserved`: kept by the driver, usable by no process.
    pub reserved_bytes: u64,
    /// Where the figures come from.
    pub source: &'static str,
}

impl GpuModel {
    /// What the processes on the GPU can use: total less the driver's reserve.
    pub fn usable_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.reserved_bytes)
    }
}

/// Totals are nvidia-smi's figures. The reserve is the total less PyTorch's "total
/// capacity" in out-of-memory messages posted from such GPUs (given to 0.01 GiB, so
/// ±5 MiB; it varies a little with the driver); where no such pair was found, fake-nvml's
/// 512 MiB. None of it was measured on a GPU here.
const FROM_OOM: &str = "nvidia-smi total; reserve = total − PyTorch's \"total capacity\" in \
                        public OOM messages (±5 MiB, driver-dependent)";
const ASSUMED: &str = "nvidia-smi total; reserve assumed (512 MiB, fake-nvml's default)";

/// (key, NVML name, total MiB, reserved MiB, source)
const TABLE: &[(&str, &str, u64, u64, &str)] = &[
    ("h100-80gb", "NVIDIA H100 80GB HBM3", 81559, 469, FROM_OOM), // 79.19 GiB
    ("h200", "NVIDIA H200", 143771, 616, FROM_OOM),               // 139.80 GiB
    ("a100-80gb", "NVIDIA A100-SXM4-80GB", 81920, 870, FROM_OOM), // 79.15 GiB
    ("a100-40gb", "NVIDIA A100-SXM4-40GB", 40960, 512, ASSUMED),
    ("l40s", "NVIDIA L40S", 46068, 512, ASSUMED),
    ("a40", "NVIDIA A40", 46068, 512, ASSUMED),
    ("t4", "Tesla T4", 15360, 256, FROM_OOM), // 14.75 GiB
];

/// Every model of the table.
pub fn models() -> Vec<GpuModel> {
    TABLE
        .iter()
        .map(|&(key, name, total, reserved, source)| GpuModel {
            key: key.into(),
            name: name.into(),
            total_bytes: total * MIB,
            reserved_bytes: reserved * MIB,
            source,
        })
        .collect()
}

/// The model `--gpu` names (case and `-`/`_` do not matter), or an error listing the table.
pub fn lookup(key: &str) -> anyhow::Result<GpuModel> {
    let norm = |s: &str| s.to_ascii_lowercase().replace('_', "-");
    models()
        .into_iter()
        .find(|m| norm(&m.key) == norm(key))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "unknown GPU model {key:?}; known: {} (or give --gpu-capacity, e.g. 80GiB)",
                models()
                    .iter()
                    .map(|m| m.key.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// A GPU of `usable` bytes (`--gpu-capacity`): fake-nvml's 512 MiB reserve on top.
pub fn with_capacity(usable: u64) -> GpuModel {
    let reserved = fake_nvml::DEFAULT_RESERVED_BYTES;
    GpuModel {
        key: "custom".into(),
        name: format!("GPU of {}", gib(usable)),
        total_bytes: usable + reserved,
        reserved_bytes: reserved,
        source: "--gpu-capacity",
    }
}

/// `--list-gpus`.
pub fn table_text() -> String {
    let mut out = String::from("GPU models (--gpu):\n");
    for m in models() {
        let _ = writeln!(
            out,
            "  {:<10} {:<24} total {:>6} MiB, reserved {:>3} MiB, usable {}",
            m.key,
            m.name,
            m.total_bytes / MIB,
            m.reserved_bytes / MIB,
            gib(m.usable_bytes())
        );
    }
    out.push_str(
        "Totals are nvidia-smi's; the reserve is the total less PyTorch's \"total capacity\" in\n\
         out-of-memory messages from such GPUs, or an assumed 512 MiB (a40, a100-40gb, l40s).\n\
         None was measured here. --gpu-capacity gives the usable bytes directly.\n",
    );
    out
}

/// `80GiB`, `79.19 GiB`, `80GB`, `512MiB` or plain bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 80GiB, 79.19GiB, 512MiB, 80GB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown unit {other:?} in {text:?}")),
    };
    let bytes = (value * scale).round();
    if !(1.0..1e15).contains(&bytes) {
        return Err(format!("{text:?} is not a GPU's size"));
    }
    Ok(bytes as u64)
}

/// Bytes as GiB with two decimals, as PyTorch prints them.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usable_capacity_is_what_pytorch_reports() {
        // PyTorch's "total capacity" in OOM messages from these GPUs.
        assert_eq!(
            gib(lookup("h100-80gb").unwrap().usable_bytes()),
            "79.19 GiB"
        );
        assert_eq!(gib(lookup("H200").unwrap().usable_bytes()), "139.80 GiB");
        assert_eq!(
            gib(lookup("a100_80gb").unwrap().usable_bytes()),
            "79.15 GiB"
        );
        assert_eq!(gib(lookup("t4").unwrap().usable_bytes()), "14.75 GiB");
        let err = lookup("h300").unwrap_err().to_string();
        assert!(
            err.contains("h100-80gb") && err.contains("--gpu-capacity"),
            "{err}"
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("80GiB"), Ok(80 << 30));
        assert_eq!(parse_size(" 512 MiB"), Ok(512 << 20));
        assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("80 GiBs").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn a_custom_capacity_is_usable_bytes() {
        let m = with_capacity(80 << 30);
        assert_eq!(m.usable_bytes(), 80 << 30);
        assert_eq!(m.total_bytes - m.reserved_bytes, 80 << 30);
    }
}
