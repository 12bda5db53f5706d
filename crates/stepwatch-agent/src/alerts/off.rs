//! The alerts of a build without the `alerts` feature: no fast path to
//! Alertmanager. Such a build refuses `--alertmanager-url`
//! (`crate::refuse_unbuilt_components`); the Prometheus rules still alert.

use stepwatch_core::{Advisory, Marker, RankInfo, RankKey};

/// `--alertmanager-runbook-base-url`'s default, as in the full build.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub const DEFAULT_RUNBOOK_BASE_URL: &str = "";

/// Ingest's handle on the alert task: there is none.
#[derive(Clone)]
pub struct Alerter;

impl Alerter {
    /// The only handle this build has.
    pub fn disabled() -> Self {
        Self
    }

    /// The alerts of one rank's stream: none.
    pub fn rank(&self, _key: &RankKey, _info: &RankInfo) -> RankAlerts {
        RankAlerts
    }
}

/// One rank's alerts: none are fired.
pub struct RankAlerts;

impl RankAlerts {
    /// Fires nothing.
    pub fn advise(&mut self, _advisories: &[Advisory]) {}

    /// Resolves nothing.
    pub fn markers(&mut self, _markers: &[Marker]) {}

    /// Releases nothing.
    pub fn close(self) {}
}
