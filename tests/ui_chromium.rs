//! The agent's web page in a real browser: Debian's headless Chromium loads
//! `/` against the real agent on fake GPUs running the demo's two jobs
//! (healthy-llm, doomed-llm) and a three-rank job with an outlier rank
//! (rank0-skew), and the GPU, job and rank views must render with the
//! figures the API gives, the doomed job's warning shown, and nothing
//! written to the browser's console. Screenshots are saved under
//! target/tmp/ui-screenshots (and to docs/ with STEPWATCH_UPDATE_SCREENSHOTS=1).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// What the page shows for a byte figure (the page's `gb()`).
fn gb(bytes: &Value) -> String {
    format!("{:.2} GB", bytes.as_f64().expect("a byte figure") / 1e9)
}

/// The text as it appears in Chromium's serialised DOM.
fn escaped(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A child process killed when dropped, so that a failing test leaves no
/// simulated rank training on.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Browser {
    profile: TempDir,
}

impl Browser {
    fn new() -> Self {
        require_binary(
            "chromium",
            "headless Chromium on the agent's page",
            "chromium",
        );
        Self {
            profile: TempDir::new("chromium-profile"),
        }
    }

    /// Runs headless Chromium on `url` with `mode` (`--dump-dom` or
    /// `--screenshot=…`), letting the page's fetches and first polls run
    /// (virtual time), and fails on any console message: the page writes
    /// none, so one is an error (an uncaught exception, a failed script).
    fn run(&self, url: &str, mode: &str) -> Output {
        // coreutils' timeout bounds a hung browser (exit 124: a failure below).
        let out = Command::new("timeout")
            .args(["120", "chromium"])
            // No sandbox (root in containers); /tmp, not a small /dev/shm.
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
            ])
            .args(["--enable-logging=stderr", "--v=0"])
            .args(["--window-size=1280,1000", "--hide-scrollbars"])
            .arg("--virtual-time-budget=5000")
            .arg(format!("--user-data-dir={}", self.profile.0.display()))
            .arg(mode)
            .arg(url)
            .output()
            .expect("run chromium");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let console: Vec<&str> = stderr.lines().filter(|l| l.contains(":CONSOLE")).collect();
        assert!(
            console.is_empty(),
            "the page wrote to the console at {url}:\n{}",
            console.join("\n")
        );
        assert!(out.status.success(), "chromium failed on {url}:\n{stderr}");
        out
    }

    /// The page's DOM once it has drawn `view` from the agent's data, and
    /// drawn it again from a later poll (the page is live).
    fn dom(&self, url: &str, view: &str) -> String {
        let dom = String::from_utf8(self.run(url, "--dump-dom").stdout).unwrap();
        assert!(
            dom.contains(&format!(r#"data-view="{view}""#))
                && dom.contains(r#"data-state="ready""#),
            "the {view} view at {url} did not render:\n{dom}"
        );
        let updates: u32 = dom
            .split(r#"data-updates=""#)
            .nth(1)
            .and_then(|t| t.split('"').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(
            updates >= 2,
            "the {view} view was drawn {updates} times in 5 s of virtual time, not polled again"
        );
        dom
    }

    fn screenshot(&self, url: &str, path: &Path) {
        self.run(url, &format!("--screenshot={}", path.display()));
        let png = std::fs::read(path).expect("chromium wrote the screenshot");
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 10_000,
            "{path:?}"
        );
    }
}

fn json(agent: &Agent, path: &str) -> Value {
    let (code, body) = agent.get(path);
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// Fails the test unless `html` has an element of each class in `classes`.
fn assert_classes(html: &str, classes: &[&str]) {
    for class in classes {
        assert!(
            html.contains(&format!(r#"class="{class}""#)),
            "no {class}:\n{html}"
        );
    }
}

#[test]
fn the_page_shows_the_node_a_job_and_a_rank_in_headless_chromium() {
    let browser = Browser::new();
    // The demo's GPUs (24 GB for healthy-llm, 48 GB for doomed-llm), and
    // three 48 GB L40S-like GPUs for rank0-skew.
    let capacities = [
        24_146_608_128u64,
        48_305_799_168,
        48_305_799_168,
        48_305_799_168,
        48_305_799_168,
    ];
    let specs: Vec<_> = capacities
        .iter()
        .enumerate()
        .map(|(i, &total_bytes)| fake_nvml::GpuSpec {
            total_bytes,
            ..fake_nvml::GpuSpec::h100_80gb(i as u32)
        })
        .collect();
    let agent = Agent::start_node("ui", "ui-node", &specs, None, &[], |_| {});
    agent.wait_for("/readyz", 200, Duration::from_secs(20));
    // healthy-llm trains on throughout, as in the demo; killed at the end
    // (or when the test fails).
    let healthy = KillOnDrop(
        Command::new(BIN)
            .args(["sim", "--scenario", "demo-small", "--job", "healthy-llm"])
            .args(["--gpu", "0", "--steps", "1000000"])
            .arg("--endpoint")
            .arg(agent.endpoint())
            .arg("--fake-nvml-dir")
            .arg(&agent.dir.0)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start healthy-llm"),
    );
    let mut sims = vec![agent.sim("adam-step2-oom", "doomed-llm", 0, 1, 3, 1.0, &[])];
    sims.extend((0..3).map(|r| agent.sim("rank0-skew", "skew", r, 2 + r, 3, 4.0, &[])));
    // doomed-llm and skew's rank 0 die of their step-2 OOM, as they should;
    // what the sims said is shown should the jobs not settle.
    let said: Vec<String> = sims
        .into_iter()
        .map(|sim| {
            let out = sim.wait_with_output().unwrap();
            format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (skew, doomed) = loop {
        let body = |path: &str| {
            let (_, body) = agent.get(path);
            serde_json::from_str::<Value>(&body).unwrap()
        };
        let skew = body("/api/v1/jobs/skew");
        let doomed = body("/api/v1/jobs/doomed-llm");
        let healthy_job = body("/api/v1/jobs/healthy-llm");
        // Its process listed on GPU 0 (the sampler reads process lists every 200 ms).
        let listed = body("/api/v1/gpus")["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["rank"]["job"] == "healthy-llm"));
        let ready = listed
            && healthy_job["ranks"][0]["figures"]["steady_reached"] == true
            && skew["ranks"].as_array().is_some_and(|r| {
                r.len() == 3
                    && r.iter()
                        .all(|r| r["figures"]["first_step_peak_bytes"].is_u64())
            })
            && skew["divergence"]["named"]
                .as_array()
                .is_some_and(|n| !n.is_empty())
            && doomed["ranks"][0]["ooms"] == 1;
        if ready {
            break (skew, doomed);
        }
        assert!(
            Instant::now() < deadline,
            "the jobs did not settle:\n{skew}\n{doomed}\nsims:\n{}\nagent log:\n{}",
            said.join("\n"),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let base = format!("http://{}/", agent.http);
    // The node's GPU list names the healthy job's process as its rank.
    let gpus = json(&agent, "/api/v1/gpus");
    let pid = healthy.0.id();
    let process = gpus["gpus"][0]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .unwrap_or_else(|| panic!("pid {pid} not on GPU 0: {gpus}"));
    assert_eq!(
        process["rank"],
        serde_json::json!({"namespace": "", "job": "healthy-llm", "rank": 0})
    );
    // The job API's per-rank figures are the exported ones.
    let m = Metrics(agent.metrics());
    for r in skew["ranks"].as_array().unwrap() {
        let labels = [("training_job", "skew"), ("rank", &r["rank"].to_string())];
        for (figure, metric) in [
            (
                "first_step_peak_bytes",
                "stepwatch_rank_first_step_peak_bytes",
            ),
            (
                "predicted_peak_bytes",
                "stepwatch_rank_predicted_peak_bytes",
            ),
        ] {
            assert_eq!(
                r["figures"][figure].as_f64(),
                m.get(metric, &labels),
                "rank {}: {figure}",
                r["rank"]
            );
        }
    }

    // The node: one card per GPU, each with its memory chart and usable
    // capacity; the jobs table says which job is doomed.
    let node = browser.dom(&base, "node");
    assert!(
        node.contains(r##"href="#/jobs/healthy-llm/ranks/0""##),
        "no link from GPU 0's process to its rank:\n{node}"
    );
    assert_eq!(node.matches(r#"class="card gpu""#).count(), 5, "{node}");
    for g in gpus["gpus"].as_array().unwrap() {
        let card = node
            .split(&format!(r#"data-gpu-index="{}""#, g["index"]))
            .nth(1)
            .and_then(|rest| rest.split("</section>").next())
            .unwrap_or_else(|| panic!("no card for GPU {}:\n{node}", g["index"]));
        assert!(card.contains(r#"<svg class="chart""#), "no chart: {card}");
        assert!(card.contains(r#"class="nvml""#), "no memory line: {card}");
        let capacity = format!(
            r#"<strong class="capacity">{}</strong>"#,
            gb(&g["capacity_bytes"])
        );
        assert!(card.contains(&capacity), "{capacity} not in {card}");
    }
    let row = |dom: &str, job: &str| -> String {
        dom.split(&format!(r#"data-job="{job}""#))
            .nth(1)
            .and_then(|r| r.split("</tr>").next())
            .unwrap_or_else(|| panic!("no row for {job}:\n{dom}"))
            .to_string()
    };
    assert!(
        row(&node, "doomed-llm").contains("step-2 OOM predicted"),
        "{node}"
    );
    assert!(row(&node, "healthy-llm").contains(">fits<"), "{node}");

    // A job: its ranks side by side with the API's figures, rank 0 marked
    // an outlier and warned of its step-2 OOM.
    let job_url = format!("{base}#/jobs/skew");
    let job = browser.dom(&job_url, "job");
    assert!(job.contains(r#"id="oom-warning""#), "{job}");
    for r in skew["ranks"].as_array().unwrap() {
        let rank = r["rank"].as_u64().unwrap();
        let row = job
            .split(&format!(r#"data-rank="{rank}""#))
            .nth(1)
            .and_then(|t| t.split("</tr>").next())
            .unwrap_or_else(|| panic!("no row for rank {rank}:\n{job}"));
        let first = format!(
            r#"class="num first-step-peak">{}<"#,
            gb(&r["figures"]["first_step_peak_bytes"])
        );
        assert!(row.contains(&first), "{first} not in {row}");
        let predicted = format!(
            r#"class="num predicted-peak">{}<"#,
            gb(&r["figures"]["predicted_peak_bytes"])
        );
        assert!(row.contains(&predicted), "{predicted} not in {row}");
        assert_eq!(row.contains("outlier:"), rank == 0, "rank {rank}: {row}");
    }
    assert!(job.contains(r#"class="rank outlier""#), "{job}");
    assert!(job.contains(r#"class="bar-predicted risk""#), "{job}");

    // The demo's doomed job: its rank's step anatomy, with the warning, the
    // phases as bands, NVML and allocator curves for step 1 and an allocator
    // curve for the step that died (its NVML figures, when it dies within a
    // sample interval, may not exist), the prediction and capacity lines and
    // the explanation in words.
    let report = json(&agent, "/api/v1/jobs/doomed-llm/ranks/0");
    let prediction = &report["prediction_before_step2"];
    let rank_url = format!("{base}#/jobs/doomed-llm/ranks/0");
    let rank = browser.dom(&rank_url, "rank");
    assert!(rank.contains(r#"id="oom-warning""#), "{rank}");
    assert!(rank.contains("Step-2 OOM predicted"), "{rank}");
    assert!(rank.contains("step 2 (oom)"), "{rank}");
    assert_classes(
        &rank,
        &[
            "band band-forward",
            "band band-backward",
            "band band-optimizer",
            "nvml step1",
            "allocated step1",
            "allocated steady",
            "capacity",
            "predicted",
        ],
    );
    let predicted = format!(
        r#"class="figure predicted-peak">{}<"#,
        gb(&prediction["predicted_peak_bytes"])
    );
    assert!(rank.contains(&predicted), "{predicted} not in {rank}");
    let explanation = escaped(prediction["explanation"].as_str().unwrap());
    assert!(
        rank.contains(&format!(r#"id="explanation">{explanation}<"#)),
        "the explanation is not shown:\n{explanation}\n{rank}"
    );
    assert!(doomed["ranks"][0]["figures"]["oom_risk"] == true);

    // The healthy job's rank, training: step 1 over a completed steady step,
    // both with NVML and allocator curves, and no warning.
    let healthy_rank = browser.dom(&format!("{base}#/jobs/healthy-llm/ranks/0"), "rank");
    assert_classes(
        &healthy_rank,
        &[
            "nvml step1",
            "nvml steady",
            "allocated step1",
            "allocated steady",
            "reserved",
        ],
    );
    assert!(!healthy_rank.contains("oom-warning"), "{healthy_rank}");

    // Current screenshots, for the README.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ui-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    let shots = [
        ("ui-node.png", base.clone()),
        ("ui-job.png", job_url),
        ("ui-rank.png", rank_url),
    ];
    for (name, url) in &shots {
        browser.screenshot(url, &dir.join(name));
    }
    drop(healthy);
    if std::env::var_os("STEPWATCH_UPDATE_SCREENSHOTS").is_some() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
        std::fs::create_dir_all(&docs).unwrap();
        for (name, _) in &shots {
            std::fs::copy(dir.join(name), docs.join(name)).unwrap();
        }
    }
}

#[test]
fn the_page_shows_each_mig_slice_as_a_card_with_its_profile_and_capacity() {
    let browser = Browser::new();
    // GPU 0 whole; GPU 1 cut into two 1g.10gb slices (GPU instances 7 and 8).
    let migs = [
        fake_nvml::MigSpec::h100_1g_10gb(1, 7),
        fake_nvml::MigSpec::h100_1g_10gb(1, 8),
    ];
    let specs = [
        fake_nvml::GpuSpec::h100_80gb(0),
        fake_nvml::GpuSpec::h100_80gb(1),
    ];
    let agent = Agent::start_mig("ui-mig", &specs, &migs, &[], |_| {});
    agent.wait_ready_with_nvml();
    let node = browser.dom(&format!("http://{}/", agent.http), "node");
    assert_eq!(node.matches(r#"class="card gpu""#).count(), 4, "{node}");
    for m in &migs {
        let card = node
            .split(&format!(r#"data-gpu-uuid="{}""#, m.uuid))
            .nth(1)
            .and_then(|rest| rest.split("</section>").next())
            .unwrap_or_else(|| panic!("no card for slice {}:\n{node}", m.uuid));
        let title = format!("GPU 1 MIG 1g.10gb (instance {})", m.gpu_instance_id);
        assert!(card.contains(&title), "{title} not in {card}");
        let capacity = format!(
            r#"<strong class="capacity">{}</strong>"#,
            gb(&serde_json::json!(9984u64 << 20))
        );
        assert!(card.contains(&capacity), "{capacity} not in {card}");
    }
}
