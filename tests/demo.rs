//! The README's first command: `stepwatch demo` shows the doomed job's
//! predicted headroom going negative during step 1, before it dies in step 2,
//! while the healthy job keeps stepping.

mod common;

use std::process::Command;

#[test]
fn the_demo_predicts_the_doomed_job_before_it_dies() {
    let addr = common::free_port();
    let out = Command::new(common::BIN)
        .args(["demo", "--seconds", "14", "--every", "1"])
        .arg("--http-listen")
        .arg(addr.to_string())
        .output()
        .expect("run stepwatch demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    let warned = lines
        .iter()
        .position(|l| l.contains("doomed-llm-1   step 1 ") && l.contains("<< STEP-2 OOM PREDICTED"))
        .unwrap_or_else(|| panic!("no step-1 prediction for the doomed job:\n{text}"));
    let died = lines
        .iter()
        .position(|l| l.starts_with(">> doomed-llm-1 died: CUDA out of memory in step 2"))
        .unwrap_or_else(|| panic!("the doomed job did not die in step 2:\n{text}"));
    assert!(warned < died, "warned after it died:\n{text}");
    // The figure itself, read from /metrics by the demo, is negative.
    let headroom: f64 = lines[warned]
        .split("headroom")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no headroom figure: {}", lines[warned]));
    assert!(headroom < 0.0, "{}", lines[warned]);
    // The healthy job is still running and was never warned.
    assert!(
        lines.iter().any(|l| l.contains("healthy-llm-1  step 2")),
        "{text}"
    );
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("healthy-llm") && l.contains("OOM")),
        "{text}"
    );
}
