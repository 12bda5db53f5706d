//! What the `stepwatch` binary shares with its end-to-end tests: reading the
//! agent's HTTP endpoints and its metrics exposition.

// Needs ureq, a development-tools and preflight dependency (the agent does not use it).
#[cfg(feature = "preflight")]
pub mod http_get;
