//! stepwatch-core's tests, one module per subject, in one binary: one link
//! instead of one per file. `cargo test -p stepwatch-core --test all growth::`
//! runs one module. Proptest keeps each module's regressions in
//! `tests/proptest-regressions/<module>.txt` (its rule for a file beside a
//! `main.rs`).

mod allocator_history;
mod allocator_retries;
mod analysis_props;
mod attribution;
mod client_clock;
mod divergence_sampling;
mod frozen_prediction;
mod growth;
mod journal;
mod larger_step2_batch;
mod low_observed_headroom;
mod memory_budget;
mod module_cycles;
mod passes;
mod postmortem;
mod prediction;
mod replay;
mod replay_torch;
mod tenancy;
mod what_the_agent_tells;
