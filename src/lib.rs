//! What the `stepwatch` binary shares with its end-to-end tests: reading the
//! agent's HTTP endpoints and its metrics exposition.

pub mod http_get;
