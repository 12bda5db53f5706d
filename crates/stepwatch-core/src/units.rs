//! How figures are written for people: one formatter, used by every
//! message (advisories, explanations), so they all read alike.

/// Bytes as decimal GB with two decimals, e.g. "81.20 GB": the unit of every
/// message a person reads.
pub fn gb(bytes: f64) -> String {
    format!("{:.2} GB", bytes / 1e9)
}
