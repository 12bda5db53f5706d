//! The README's first command: `stepwatch demo` shows the doomed job's
//! predicted headroom going negative during step 1, before it dies in step 2,
//! while the healthy job keeps stepping.

mod common;

use std::io::BufRead;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_demo_predicts_the_doomed_job_before_it_dies() {
    // Port 0: the demo learns the agent's port from its ready file.
    let mut demo = Command::new(common::BIN)
        .args(["demo", "--every", "1", "--http-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, to be stopped as a terminal's Ctrl-C does.
        .process_group(0)
        .spawn()
        .expect("run stepwatch demo");
    // Read until the story has been told (however slow the machine), then stop it.
    let stdout = demo.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let start = Instant::now();
    let told = |seen: &[String]| {
        seen.iter().any(|l| l.starts_with(">> doomed-llm-1 died"))
            && seen.iter().any(|l| l.contains("healthy-llm-1  step 2"))
    };
    while !told(&seen) {
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "the demo did not tell its story within 180 s:\n{}",
            seen.join("\n")
        );
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(line) => seen.push(line),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("the demo's output ended ({e}):\n{}", seen.join("\n")),
        }
    }
    // The rank URL the demo printed answers after the rank died.
    let url = seen
        .iter()
        .find_map(|l| l.trim().strip_prefix("a rank:    curl '"))
        .and_then(|u| u.strip_suffix('\''))
        .unwrap_or_else(|| panic!("no rank URL printed:\n{}", seen.join("\n")));
    let (addr, path) = url
        .strip_prefix("http://")
        .and_then(|u| u.split_once('/'))
        .expect("an http:// URL");
    let (code, body) = common::http_get(addr.parse().unwrap(), &format!("/{path}")).unwrap();
    assert_eq!(code, 200, "{url}: {body}");
    assert!(body.contains("\"outcome\":\"oom\""), "{url}: {body}");
    // Ctrl-C: SIGINT to the whole foreground process group. The demo stops
    // its agent and jobs itself; it must not take their exit for a failure.
    // SAFETY: kill(2) on our own child's process group.
    unsafe { libc::kill(-(demo.id() as i32), libc::SIGINT) };
    let out = demo.wait_with_output().expect("the demo stops");
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(5)) {
        seen.push(line);
    }
    let text = seen.join("\n");
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The agent log it pointed to is kept, and says which rank died of what.
    let log = text
        .lines()
        .find_map(|l| l.strip_prefix("demo stopped; the agent log is kept at "))
        .unwrap_or_else(|| panic!("the demo did not say where its log is:\n{text}"));
    let log_text = std::fs::read_to_string(log).unwrap_or_else(|e| panic!("{log}: {e}"));
    let _ = std::fs::remove_file(log);
    assert!(
        log_text.lines().any(
            |l| l.contains("rank died of a CUDA out-of-memory error in step 2")
                && l.contains("job=doomed-llm-1")
        ),
        "{log_text}"
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
