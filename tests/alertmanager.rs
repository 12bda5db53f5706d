//! The fast path to Alertmanager end to end: the real agent on fake NVML,
//! a simulated rank whose step 2 runs out of memory (thin-margin), and a
//! real Alertmanager (Debian's `prometheus-alertmanager`; scripts/test
//! installs it). The step-2 OOM alert must be in Alertmanager within a
//! second of the prediction, under the rule's name and label set, and
//! resolved once the rank is gone; an Alertmanager that never answers must
//! not slow ingest, and is counted; and with a real Prometheus (Debian's
//! `prometheus`) evaluating the shipped rules, the rule's alert and the
//! agent's must be one alert in Alertmanager.
//!
//! `bench/alert-latency.sh` runs `alert_latency_bench` (ignored here) for
//! the figures in BENCHMARKS.md.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use fake_nvml::{GpuSpec, MigSpec};
use serde_json::Value;

/// A real Alertmanager on a temp storage dir, clustering off; killed on drop.
struct Alertmanager {
    dir: TempDir,
    addr: SocketAddr,
    child: Child,
}

const ALERTMANAGER: &str = "prometheus-alertmanager";

impl Alertmanager {
    fn start(tag: &str) -> Self {
        require_binary(
            ALERTMANAGER,
            "a real Alertmanager",
            "prometheus-alertmanager",
        );
        let dir = TempDir::new(tag);
        let config = dir.0.join("alertmanager.yml");
        // Notifications go nowhere; the test reads the API. The receiver's
        // name is this instance's own, so a ready answer on our port can be
        // told apart from another test's Alertmanager that took the port.
        let receiver = dir.0.file_name().unwrap().to_string_lossy().into_owned();
        std::fs::write(
            &config,
            format!("route:\n  receiver: {receiver}\nreceivers:\n  - name: {receiver}\n"),
        )
        .unwrap();
        // Alertmanager cannot report a port it chose: try free ones.
        let log_path = dir.0.join("alertmanager.log");
        let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        for _attempt in 0..5 {
            let addr = free_port();
            let log = std::fs::File::create(&log_path).unwrap();
            let mut child = Command::new(ALERTMANAGER)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.path={}", dir.0.join("data").display()))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--cluster.listen-address=")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start alertmanager");
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if let Ok((200, _)) = http_get(addr, "/-/ready") {
                    let status = http_get(addr, "/api/v2/status").unwrap_or_default().1;
                    if status.contains(&receiver) {
                        return Self { dir, addr, child };
                    }
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                if let Some(status) = child.try_wait().unwrap() {
                    let log = read_log();
                    assert!(
                        log.contains("address already in use"),
                        "alertmanager exited ({status}); log:\n{log}"
                    );
                    break;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("alertmanager not ready within 30 s; log:\n{}", read_log());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        panic!("alertmanager found no free port in 5 attempts");
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("alertmanager.log")).unwrap_or_default()
    }

    /// The alerts Alertmanager holds (resolved ones are not listed).
    fn alerts(&self) -> Vec<Value> {
        let (code, body) = http_get(self.addr, "/api/v2/alerts").expect("GET /api/v2/alerts");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str::<Value>(&body)
            .unwrap()
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The alert named `name` of training job `job`, if Alertmanager holds it.
    fn alert(&self, name: &str, job: &str) -> Option<Value> {
        self.alerts()
            .into_iter()
            .find(|a| a["labels"]["alertname"] == name && a["labels"]["training_job"] == job)
    }
}

impl Drop for Alertmanager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Seconds since the Unix epoch of an RFC 3339 time ("…Z" or "…+hh:mm").
fn unix_seconds(t: &str) -> f64 {
    let (date, time) = t.split_once('T').expect("RFC 3339");
    let mut d = date.split('-').map(|x| x.parse::<i64>().unwrap());
    let (y, m, day) = (d.next().unwrap(), d.next().unwrap(), d.next().unwrap());
    let (clock, offset) = match time.find(['Z', '+', '-']) {
        Some(i) => time.split_at(i),
        None => (time, "Z"),
    };
    let offset_s = match offset {
        "Z" | "" => 0.0,
        o => {
            let sign = if o.starts_with('-') { -1.0 } else { 1.0 };
            let (h, mi) = o[1..].split_once(':').unwrap();
            sign * (h.parse::<f64>().unwrap() * 3600.0 + mi.parse::<f64>().unwrap() * 60.0)
        }
    };
    let mut c = clock.split(':');
    let (h, mi, s): (f64, f64, f64) = (
        c.next().unwrap().parse().unwrap(),
        c.next().unwrap().parse().unwrap(),
        c.next().unwrap().parse().unwrap(),
    );
    // Howard Hinnant's days_from_civil.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    days as f64 * 86_400.0 + h * 3600.0 + mi * 60.0 + s - offset_s
}

/// A doomed rank: thin-margin's step 1 fits an 80 GB GPU with <1% to spare,
/// step 2 does not. The driver reserves nothing on the fake GPU.
fn start_agent(tag: &str, urls: &[String], extra: &[&str]) -> Agent {
    let mut args: Vec<&str> = extra.to_vec();
    for url in urls {
        args.extend(["--alertmanager-url", url.as_str()]);
    }
    args.extend(["--alertmanager-label", "cluster=test-cluster"]);
    let agent = Agent::start_with(tag, 1, &args, |f| f.set_reserved_bytes(0, 0));
    agent.wait_ready_with_nvml();
    agent
}

/// The alert as Alertmanager first listed it, and when the test saw it.
struct Observed {
    alert: Value,
    seen_s: f64,
}

/// Starts one doomed rank of job `job`.
fn doomed_rank(agent: &Agent, job: &str, speed: f64) -> SimRank {
    agent.sim("thin-margin", job, 0, 0, 4, speed, &[])
}

/// Waits for the step-2 OOM alert of `job`'s rank `sim`.
fn wait_alert(agent: &Agent, am: &Alertmanager, job: &str, sim: &mut Child) -> Observed {
    let start = Instant::now();
    loop {
        if let Some(alert) = am.alert("StepwatchStep2OOMPredicted", job) {
            return Observed {
                alert,
                seen_s: now_s(),
            };
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = sim.kill();
        }
        assert!(
            start.elapsed() <= Duration::from_secs(60),
            "no StepwatchStep2OOMPredicted alert for {job} in Alertmanager within 60 s; alerts: {:?}\nagent log:\n{}\nalertmanager log:\n{}",
            am.alerts(),
            agent.log(),
            am.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The labels the shipped rule `alert` aggregates to (its `max by (...)`).
fn rule_labels<'a>(rules: &'a str, alert: &str) -> impl Iterator<Item = &'a str> {
    let rule = rules
        .split_once(&format!("- alert: {alert}\n"))
        .map(|(_, rule)| rule)
        .unwrap_or_else(|| panic!("no rule {alert} in the shipped rules"));
    let by = rule
        .split_once("max by (")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(by, _)| by)
        .unwrap_or_else(|| panic!("{alert}'s rule aggregates with `max by (...)`"));
    by.split(',').map(str::trim)
}

#[test]
fn a_predicted_step2_oom_reaches_alertmanager_at_once_and_resolves_when_the_rank_ends() {
    let am = Alertmanager::start("am-e2e");
    let agent = start_agent("am-e2e", &[am.url()], &[]);
    let mut sim = doomed_rank(&agent, "doomed", 0.5);
    let seen = wait_alert(&agent, &am, "doomed", &mut sim);

    // The rule's name, severity and label set: nothing of the scrape (job,
    // instance), so the rule's alert and this one are one in Alertmanager.
    let labels = seen.alert["labels"].as_object().unwrap();
    let names: BTreeSet<&str> = labels.keys().map(String::as_str).collect();
    let rules = std::fs::read_to_string(repo().join("deploy/prometheus/stepwatch-rules.yml"))
        .expect("the shipped rules");
    let allowed: BTreeSet<&str> = ["alertname", "severity"]
        .into_iter()
        .chain(rule_labels(&rules, "StepwatchStep2OOMPredicted"))
        .collect();
    assert!(allowed.contains("rank"), "{allowed:?}");
    assert!(names.is_subset(&allowed), "{labels:?} beside {allowed:?}");
    for (k, v) in [
        ("severity", "warning"),
        ("cluster", "test-cluster"),
        ("training_job", "doomed"),
        ("rank", "0"),
        ("node", "test-node"),
    ] {
        assert_eq!(labels[k], v, "{labels:?}");
    }
    assert!(
        seen.alert["annotations"]["description"]
            .as_str()
            .unwrap()
            .contains("GB"),
        "the advisory's sentence: {}",
        seen.alert["annotations"]
    );
    // Within a second of the prediction (startsAt is the advisory's time).
    let starts = unix_seconds(seen.alert["startsAt"].as_str().unwrap());
    let received = unix_seconds(seen.alert["updatedAt"].as_str().unwrap());
    assert!(
        received - starts < 1.0 && seen.seen_s - starts < 2.0,
        "startsAt {starts}, received {received}, seen {}",
        seen.seen_s
    );
    // Firing, with an end a few resend intervals ahead.
    assert!(unix_seconds(seen.alert["endsAt"].as_str().unwrap()) > now_s() + 60.0);

    sim.wait_oom("the rank dies of its step-2 OOM");
    // The rank is gone: the agent resolves its alert (endsAt now), which
    // Alertmanager then no longer lists.
    wait_until("the alert resolved", Duration::from_secs(30), || {
        am.alert("StepwatchStep2OOMPredicted", "doomed").is_none()
    });
    let m = agent.wait_metrics("posts counted", Duration::from_secs(5), |m| {
        m.get(
            "stepwatch_alertmanager_posts_total",
            &[("result", "ok"), ("url", &am.url())],
        ) >= Some(2.0)
            && m.get("stepwatch_alertmanager_alerts_active", &[]) == Some(0.0)
    });
    assert_eq!(
        m.get("stepwatch_alertmanager_posts_total", &[("result", "error")]),
        Some(0.0)
    );
}

#[test]
fn a_job_that_fits_its_gpu_but_not_its_mig_slice_is_warned_before_step_2_and_alerted() {
    // GPU 0 whole; GPU 1 cut into seven 1g.10gb slices (GPU instances 7..13).
    // The same job runs on GPU 0 and on slice 2 (GPU instance 9): it fits
    // the whole GPU, and on the slice its step 2 does not fit.
    let am = Alertmanager::start("am-mig");
    let migs: Vec<MigSpec> = (0..7).map(|i| MigSpec::h100_1g_10gb(1, 7 + i)).collect();
    let url = am.url();
    let agent = Agent::start_mig(
        "am-mig",
        &[GpuSpec::h100_80gb(0), GpuSpec::h100_80gb(1)],
        &migs,
        &["--alertmanager-url", &url],
        |f| f.set_reserved_bytes(0, 0),
    );
    agent.wait_ready_with_nvml();
    let slice = agent.fake.mig_device(1, 2).unwrap();
    let slice_uuid = migs[2].uuid.as_str();
    let slice_bytes = (9984u64 << 20) as f64;
    let mut sliced = agent.sim("mig-slice-oom", "sliced", 0, slice, 4, 0.5, &[]);
    let whole = agent.sim("mig-slice-oom", "whole", 0, 0, 4, 0.5, &[]);

    // NVML -> prediction -> alert: judged against the slice's memory.
    let seen = wait_alert(&agent, &am, "sliced", &mut sliced);
    let description = seen.alert["annotations"]["description"].as_str().unwrap();
    assert!(description.contains("capacity 10.47 GB"), "{description}");
    let log = sliced.wait_oom("the slice runs out in step 2");
    assert!(
        !log.contains("advisories: 0"),
        "its client was warned:\n{log}"
    );
    wait_ok(whole, "the same job on the whole GPU");

    let report = rank_report(&agent, "sliced", 0).expect("the sliced rank's report");
    let advisory = report["advisories"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["kind"] == "step2_oom_predicted")
        .unwrap_or_else(|| panic!("no step-2 OOM advisory: {}", report["advisories"]));
    assert_eq!(advisory["step"], 1);
    assert_eq!(
        advisory["capacity_bytes"].as_f64(),
        Some(slice_bytes),
        "{advisory}"
    );
    let issued = advisory["issued_monotonic_ns"].as_u64().unwrap();
    let step2 = &report["steps"][1];
    assert_eq!(step2["outcome"], "oom");
    assert!(
        issued < step2["begin_monotonic_ns"].as_u64().unwrap(),
        "step 2 began later"
    );
    let report = rank_report(&agent, "whole", 0).expect("the whole-GPU rank's report");
    // Only the info that step 1's prediction is final, no warning.
    let kinds: Vec<&str> = report["advisories"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["kind"].as_str())
        .collect();
    assert_eq!(kinds, ["prediction_final"], "{report}");

    // The page's data: the slice is a device of its own, with its profile.
    let (_, body) = agent.get("/api/v1/gpus");
    let gpus: Value = serde_json::from_str(&body).unwrap();
    let gpus = gpus["gpus"].as_array().unwrap().clone();
    assert_eq!(gpus.len(), 2 + 7, "{body}");
    let g = gpus.iter().find(|g| g["uuid"] == slice_uuid).unwrap();
    assert_eq!(g["index"], 1);
    assert_eq!(g["mig"]["profile"], "1g.10gb");
    assert_eq!(g["mig"]["gpu_instance_id"], 9);
    assert_eq!(g["mig"]["parent_uuid"], GpuSpec::h100_80gb(1).uuid);
    assert_eq!(g["capacity_bytes"].as_f64(), Some(slice_bytes));

    // The series carry the GPU instance and profile.
    let m = Metrics(agent.metrics());
    let slice_labels = [
        ("gpu", "1"),
        ("gpu_uuid", slice_uuid),
        ("gpu_instance_id", "9"),
        ("mig_profile", "1g.10gb"),
    ];
    assert_eq!(
        m.get("stepwatch_gpu_memory_total_bytes", &slice_labels),
        Some(slice_bytes)
    );
    assert_eq!(
        m.get(
            "stepwatch_rank_info",
            &[
                ("training_job", "sliced"),
                ("gpu_instance_id", "9"),
                ("mig_profile", "1g.10gb")
            ]
        ),
        Some(1.0)
    );
    assert_eq!(
        m.get("stepwatch_rank_oom_risk", &[("training_job", "whole")]),
        Some(0.0)
    );
}

#[test]
fn an_alertmanager_that_never_answers_or_refuses_slows_no_ingest_and_is_counted() {
    // Accepts connections (the kernel's backlog) and never answers a byte.
    let blackhole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = format!("http://{}", blackhole.local_addr().unwrap());
    // Nothing listens there.
    let refused = format!("http://{}", free_port());
    let agent = start_agent("am-down", &[silent.clone(), refused.clone()], &[]);
    let started = Instant::now();
    let sim = agent.sim("thin-margin", "doomed", 0, 0, 4, 1.0, &[]);
    let log = sim.wait_oom("the rank dies of its step-2 OOM");
    assert!(
        log.contains("advisories: ") && !log.contains("advisories: 0"),
        "the client got its advisories:\n{log}"
    );
    // Both are counted as errors; the silent one once its POST times out (5 s).
    let m = agent.wait_metrics("errors counted", Duration::from_secs(30), |m| {
        m.get(
            "stepwatch_alertmanager_posts_total",
            &[("url", &silent), ("result", "error")],
        ) >= Some(1.0)
            && m.get(
                "stepwatch_alertmanager_posts_total",
                &[("url", &refused), ("result", "error")],
            ) >= Some(1.0)
    });
    assert_eq!(
        m.get(
            "stepwatch_alertmanager_alerts_dropped_total",
            &[("reason", "queue_full")]
        ),
        Some(0.0)
    );
    assert!(
        agent.log().contains("cannot post alerts to Alertmanager"),
        "logged:\n{}",
        agent.log()
    );
    eprintln!(
        "doomed rank ran in {:?} with Alertmanager down",
        started.elapsed()
    );
    drop(blackhole);
}

/// The benches' agent, posting to `urls`, that records its inputs
/// (`--record`) into `record.jsonl` of the dir it returns with it.
fn start_recording_agent(tag: &str, urls: &[String]) -> (Agent, TempDir) {
    let records = TempDir::new(&format!("{tag}-record"));
    let record = records.0.join("record.jsonl");
    let agent = start_agent(tag, urls, &["--record", record.to_str().unwrap()]);
    (agent, records)
}

/// Wall time (s) of the newest marker in the batch that made the rank's
/// first step-2 OOM advisory: the batch the agent's record (in `records`,
/// see [`start_recording_agent`]) holds at the advisory's monotonic time.
fn marker_wall_s(agent: &Agent, records: &TempDir, job: &str) -> f64 {
    let record = records.0.join("record.jsonl");
    let (_, body) = agent.get(&format!("/api/v1/jobs/{job}/ranks/0"));
    let report: Value = serde_json::from_str(&body).unwrap();
    let issued = report["advisories"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["kind"] == "step2_oom_predicted")
        .unwrap_or_else(|| panic!("a step-2 OOM advisory: {body}"))["issued_monotonic_ns"]
        .as_u64()
        .unwrap();
    let mut wall = None;
    // The record is flushed every second.
    wait_until(
        "the advisory's batch in the record",
        Duration::from_secs(10),
        || {
            let text = std::fs::read_to_string(&record).unwrap_or_default();
            wall = text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .map(|e| e["markers"].clone())
                .find(|m| m["at_ns"].as_u64() == Some(issued) && m["key"]["job"] == job)
                .and_then(|m| {
                    m["markers"]
                        .as_array()?
                        .iter()
                        .filter_map(|m| m["wall_ns"].as_u64())
                        .max()
                });
            wall.is_some()
        },
    );
    wall.unwrap() as f64 / 1e9
}

/// Runs of a bench: the variable `name`, else `default`.
fn bench_runs(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Time from the marker (and from the advisory) to the alert in
/// Alertmanager, over many doomed ranks (STEPWATCH_ALERT_BENCH_RUNS,
/// default 20). Run by bench/alert-latency.sh.
#[test]
#[ignore]
fn alert_latency_bench() {
    let runs = bench_runs("STEPWATCH_ALERT_BENCH_RUNS", 20);
    let am = Alertmanager::start("am-bench");
    let (agent, records) = start_recording_agent("am-bench", &[am.url()]);
    let (mut from_marker, mut from_advisory, mut listed) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        let job = format!("bench-{i}");
        let mut sim = doomed_rank(&agent, &job, 1.0);
        let obs = wait_alert(&agent, &am, &job, &mut sim);
        let starts = unix_seconds(obs.alert["startsAt"].as_str().unwrap());
        let received = unix_seconds(obs.alert["updatedAt"].as_str().unwrap());
        let _ = sim.wait_with_output();
        from_marker.push(received - marker_wall_s(&agent, &records, &job));
        from_advisory.push(received - starts);
        listed.push(obs.seen_s - starts);
    }
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize] * 1000.0;
        format!(
            "median {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            q(0.5),
            q(0.99),
            q(1.0)
        )
    };
    println!("alert latency over {runs} doomed ranks (thin-margin, one agent, one Alertmanager):");
    println!(
        "  marker -> received by Alertmanager (its updatedAt): {}",
        stats(&mut from_marker)
    );
    println!(
        "  advisory -> received by Alertmanager: {}",
        stats(&mut from_advisory)
    );
    println!(
        "  advisory -> listed by GET /api/v2/alerts (5 ms polls): {}",
        stats(&mut listed)
    );
}

/// thin-margin as shipped, with a 4 s optimizer phase: memory is unchanged,
/// timings only space the allocations out.
fn slow_optimizer_thin_margin(dir: &std::path::Path) -> std::path::PathBuf {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("crates/stepwatch-sim/scenarios/thin-margin.json");
    let mut scenario: Value =
        serde_json::from_str(&std::fs::read_to_string(shipped).unwrap()).unwrap();
    scenario["timing"] = serde_json::json!({
        "init_ms": 50.0,
        "prologue_ms": 5.0,
        "forward_ms": 60.0,
        "backward_ms": 120.0,
        "optimizer_ms": 4000.0,
        "epilogue_ms": 5.0
    });
    let path = dir.join("thin-margin-slow-optimizer.json");
    std::fs::write(&path, serde_json::to_string_pretty(&scenario).unwrap()).unwrap();
    path
}

/// A Prometheus config with the shipped rules, posting to `am`, scraping
/// `agent`; `global` is the body of its `global:` section.
fn prometheus_config(global: &str, am: &Alertmanager, agent: &Agent) -> String {
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/prometheus/stepwatch-rules.yml");
    format!(
        "global:\n  {global}\n\
         rule_files:\n  - {}\n\
         alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: [\"{}\"]\n\
         scrape_configs:\n  - job_name: stepwatch\n    honor_labels: false\n    static_configs:\n      - targets: [\"{}\"]\n",
        rules.display(),
        am.addr,
        agent.http
    )
}

/// The rule's alert and the agent's are one alert in Alertmanager: a real
/// Prometheus scrapes the agent with the shipped rules (external label
/// `cluster`, as the agent's `--alertmanager-label`) and posts to the same
/// Alertmanager. The agent's alert arrives first (its `source`
/// annotation); the rule's later one (without it) has the
/// same fingerprint, so Alertmanager holds one alert, not two. Once the
/// rank is gone both paths end it: the rule does not fire it again,
/// although the agent keeps the dead rank's negative prediction.
#[test]
fn the_rules_alert_and_the_agents_are_one_alert_in_alertmanager() {
    let am = Alertmanager::start("am-dedup");
    let agent = start_agent("am-dedup", &[am.url()], &[]);
    let global =
        "scrape_interval: 500ms\n  scrape_timeout: 400ms\n  evaluation_interval: 500ms\n  \
                  external_labels: {cluster: test-cluster}";
    let prom = Prometheus::start("am-dedup", &prometheus_config(global, &am, &agent));
    // The rule holds only while the rank lives, so the rank's step-1
    // optimizer phase (between the prediction and the OOM) lasts 4 s: time
    // for a scrape and an evaluation (500 ms each) on a busy machine.
    wait_until(
        "Prometheus to scrape the agent",
        Duration::from_secs(30),
        || !prom.vector("stepwatch_nvml_up == 1").is_empty(),
    );
    let scenario = slow_optimizer_thin_margin(&agent.dir.0);
    let mut sim = agent.sim(scenario.to_str().unwrap(), "dedup", 0, 0, 4, 1.0, &[]);
    let agents = wait_alert(&agent, &am, "dedup", &mut sim);
    assert!(
        agents.alert["annotations"]["source"]
            .as_str()
            .is_some_and(|s| s.contains("stepwatch agent")),
        "the agent's post came first: {}",
        agents.alert
    );
    // Prometheus's post carries the rule's annotations (no `source`); until
    // it comes the alert keeps the agent's.
    let mut rules_alert = None;
    wait_until(
        "the rule's alert in Alertmanager",
        Duration::from_secs(60),
        || {
            let all: Vec<Value> = am
                .alerts()
                .into_iter()
                .filter(|a| {
                    a["labels"]["alertname"] == "StepwatchStep2OOMPredicted"
                        && a["labels"]["training_job"] == "dedup"
                })
                .collect();
            assert!(all.len() <= 1, "two alerts for one rank: {all:#?}");
            rules_alert = all
                .into_iter()
                .find(|a| a["annotations"]["source"].is_null());
            rules_alert.is_some()
        },
    );
    sim.wait_oom("the rank dies of its step-2 OOM");
    let rules_alert = rules_alert.unwrap();
    assert_eq!(
        rules_alert["fingerprint"],
        agents.alert["fingerprint"],
        "same label set, same alert:\nagent's {}\nrule's {}\nprometheus log:\n{}",
        agents.alert["labels"],
        rules_alert["labels"],
        prom.log()
    );
    assert_eq!(rules_alert["labels"], agents.alert["labels"]);

    // The rank is gone. Its prediction stays exported, yet the rule stops
    // firing and Alertmanager lists the alert no more.
    let m = agent.wait_metrics("the dead rank disconnected", Duration::from_secs(10), |m| {
        m.get("stepwatch_rank_connected", &[("training_job", "dedup")]) == Some(0.0)
    });
    assert!(
        m.get(
            "stepwatch_rank_predicted_headroom_bytes",
            &[("training_job", "dedup")]
        )
        .is_some_and(|h| h < 0.0),
        "the dead rank's prediction is kept"
    );
    wait_until(
        "the rule's alert inactive and the alert resolved",
        Duration::from_secs(30),
        || {
            let active = prom.api("/api/v1/alerts").expect("GET /api/v1/alerts")["alerts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| {
                    a["labels"]["alertname"] == "StepwatchStep2OOMPredicted"
                        && a["labels"]["training_job"] == "dedup"
                });
            !active && am.alert("StepwatchStep2OOMPredicted", "dedup").is_none()
        },
    );
    // Evaluations go on (the rule's group is evaluated every 500 ms): the
    // rule must not fire it again.
    let evaluated = |prom: &Prometheus| -> f64 {
        prom.api("/api/v1/rules").expect("GET /api/v1/rules")["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["name"] == "stepwatch-alerts")
            .and_then(|g| g["lastEvaluation"].as_str().map(unix_seconds))
            .unwrap_or(0.0)
    };
    let after = evaluated(&prom) + 2.0;
    wait_until(
        "four more rule evaluations",
        Duration::from_secs(30),
        || evaluated(&prom) > after,
    );
    assert!(
        am.alert("StepwatchStep2OOMPredicted", "dedup").is_none(),
        "the rule fired the dead rank's alert again:\n{}",
        prom.log()
    );
}

/// The Prometheus path for comparison, measured: no fast path; a real
/// Prometheus at kube-prometheus-stack's intervals (30 s scrape, 30 s
/// evaluation) evaluates the shipped rules and posts to Alertmanager.
/// STEPWATCH_PROM_BENCH_RUNS doomed ranks (default 10) start 6.3 s apart, so
/// their predictions fall at different points of the scrape and evaluation
/// cycles. Run by bench/alert-latency.sh.
#[test]
#[ignore]
fn prometheus_path_latency_bench() {
    let runs = bench_runs("STEPWATCH_PROM_BENCH_RUNS", 10);
    let am = Alertmanager::start("prom-bench");
    let (agent, records) = start_recording_agent("prom-bench", &[]);
    let global = "scrape_interval: 30s\n  scrape_timeout: 10s\n  evaluation_interval: 30s";
    let _prom = Prometheus::start("prom-bench", &prometheus_config(global, &am, &agent));
    let jobs: Vec<String> = (0..runs).map(|i| format!("prom-{i}")).collect();
    let mut received = std::collections::BTreeMap::new();
    let poll = |received: &mut std::collections::BTreeMap<String, f64>| {
        for a in am.alerts() {
            let job = a["labels"]["training_job"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            if a["labels"]["alertname"] == "StepwatchStep2OOMPredicted"
                && !received.contains_key(&job)
            {
                received.insert(job, unix_seconds(a["updatedAt"].as_str().unwrap()));
            }
        }
    };
    for job in &jobs {
        let sim = doomed_rank(&agent, job, 1.0);
        let _ = sim.wait_with_output();
        let next = Instant::now() + Duration::from_millis(6300);
        while Instant::now() < next {
            poll(&mut received);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    wait_until("every rule alert", Duration::from_secs(120), || {
        poll(&mut received);
        received.len() == runs
    });
    let mut latency: Vec<f64> = jobs
        .iter()
        .map(|job| received[job] - marker_wall_s(&agent, &records, job))
        .collect();
    latency.sort_by(f64::total_cmp);
    let q = |p: f64| latency[((latency.len() - 1) as f64 * p).round() as usize];
    println!(
        "prometheus path over {runs} doomed ranks (30 s scrape, 30 s evaluation): marker -> received by Alertmanager: median {:.1} s, min {:.1} s, max {:.1} s",
        q(0.5),
        q(0.0),
        q(1.0)
    );
}
