//! End to end: the agent binary on fake NVML, simulated ranks as processes,
//! and what a user reads from /metrics, /readyz and the JSON API.

mod common;

use std::time::Duration;

use common::*;

const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-00000000-0000-0000-0000-000000000001";

#[test]
fn two_ranks_three_steps_show_in_metrics_and_pass_promtool() {
    let agent = Agent::start("steps", 2);
    // Ranks 1 and 2 of a 4-rank GPT 1.3B job, one per GPU (rank N runs on GPU N-1).
    let ranks: Vec<_> = (0..2)
        .map(|r| agent.sim("rank0-skew", "train-a", r + 1, r, 3, 2.0))
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        wait_ok(child, &format!("sim rank {r}"));
    }
    let m = agent.wait_metrics(
        "3 completed steps on both ranks",
        Duration::from_secs(10),
        |m| {
            (0..2).all(|r| {
                m.get(
                    "stepwatch_rank_steps_completed_total",
                    &[("job", "train-a"), ("rank", &(r + 1).to_string())],
                ) == Some(3.0)
            })
        },
    );

    // Per-GPU memory: capacity, a current reading, and a window max that
    // caught the simulated peak although the ranks have finished.
    for gpu in [GPU0, GPU1] {
        let labels = [("uuid", gpu), ("node", "test-node")];
        let total = m.get("stepwatch_gpu_memory_total_bytes", &labels).unwrap();
        assert!(total > 80e9, "H100-like capacity, got {total}");
        assert!(m.get("stepwatch_gpu_memory_used_bytes", &labels).is_some());
        let max = m
            .get("stepwatch_gpu_memory_used_max_bytes", &labels)
            .unwrap();
        // The simulated rank peaks near 45 GB in steady state.
        assert!(max >= 40e9, "peak was {max}");
        assert!(m.get("stepwatch_gpu_samples_total", &labels).unwrap() > 10.0);
    }
    assert_eq!(m.get("stepwatch_nvml_up", &[]), Some(1.0));

    // Per-rank step and phase series, and the step-model figures.
    for r in ["1", "2"] {
        let rank = [("job", "train-a"), ("rank", r)];
        assert_eq!(m.get("stepwatch_rank_last_step", &rank), Some(3.0));
        // A rank's capacity is what processes can use: NVML's total less
        // the memory the driver reserves (memory info v2 `reserved`).
        let total = m.get("stepwatch_gpu_memory_total_bytes", &[("uuid", GPU0)]);
        assert_eq!(
            m.get("stepwatch_rank_gpu_capacity_bytes", &rank),
            total.map(|t| t - fake_nvml::DEFAULT_RESERVED_BYTES as f64)
        );
        let step = m
            .get("stepwatch_rank_step_duration_seconds", &rank)
            .unwrap();
        assert!((0.05..2.0).contains(&step), "step took {step} s");
        for phase in ["forward", "backward", "optimizer"] {
            let d = m
                .get(
                    "stepwatch_rank_phase_duration_seconds",
                    &[rank[0], rank[1], ("phase", phase)],
                )
                .unwrap_or_else(|| panic!("no {phase} duration for rank {r}"));
            assert!(
                d > 0.005 && d < step,
                "{phase} took {d} s of a {step} s step"
            );
        }
        let first = m
            .get("stepwatch_rank_first_step_peak_bytes", &rank)
            .unwrap();
        let steady = m
            .get("stepwatch_rank_steady_step_peak_bytes", &rank)
            .unwrap();
        assert!(
            steady > first,
            "the first-step anomaly: steady {steady} > first {first}"
        );
        let predicted = m.get("stepwatch_rank_predicted_peak_bytes", &rank).unwrap();
        let error = (predicted - steady).abs() / steady;
        assert!(
            error < 0.05,
            "predicted {predicted} vs steady {steady}: {:.1}% off",
            error * 100.0
        );
        assert_eq!(m.get("stepwatch_rank_oom_risk", &rank), Some(0.0));
        // Allocator figures see what the cache hands out.
        assert_eq!(
            m.get(
                "stepwatch_rank_prediction_basis_limited",
                &[
                    rank[0],
                    rank[1],
                    ("limit", "nvml_only_cannot_see_cache_reuse")
                ]
            ),
            Some(0.0)
        );
        assert_eq!(
            m.get("stepwatch_rank_prediction_warning_upheld", &rank),
            Some(0.0)
        );
        assert!(
            m.get("stepwatch_rank_predicted_headroom_bytes", &rank)
                .unwrap()
                > 0.2 * 80e9
        );
    }
    assert_eq!(m.get("stepwatch_markers_received_total", &[]), Some(36.0));
    promtool_check_metrics(&m.0);

    // The JSON timeline lists the steps and their phases in order, with
    // NVML samples attributed to them, and the prediction with its inputs.
    let (code, body) = agent.get("/api/v1/jobs/train-a/ranks/2");
    assert_eq!(code, 200, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    let steps = report["steps"].as_array().unwrap();
    let numbers: Vec<u64> = steps.iter().map(|s| s["step"].as_u64().unwrap()).collect();
    assert_eq!(numbers, [1, 2, 3]);
    let phases: Vec<&str> = steps[1]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        ["prologue", "forward", "backward", "optimizer", "epilogue"]
    );
    let sampled: u64 = steps[1]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["nvml_samples"].as_u64().unwrap())
        .sum();
    assert!(sampled >= 3, "a step at 100 Hz has samples, got {sampled}");
    // The step-1 and steady-state profiles a user compares (the first-step
    // anomaly), per phase, from NVML and the allocator.
    let analysis = &report["analysis"];
    let first = &analysis["first_step"];
    let steady = &analysis["steady"];
    assert_eq!(first["step"], 1, "{analysis}");
    assert_eq!(steady["steps"], serde_json::json!([2, 3]), "{analysis}");
    let peak = |p: &serde_json::Value, key: &str| p[key].as_u64().unwrap_or(0);
    assert!(
        peak(steady, "nvml_peak_bytes") > peak(first, "nvml_peak_bytes")
            && peak(steady, "allocated_peak_bytes") > peak(first, "allocated_peak_bytes"),
        "{analysis}"
    );
    for profile in [first, steady] {
        let phases: Vec<&str> = profile["phases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["phase"].as_str().unwrap())
            .collect();
        for phase in ["forward", "backward", "optimizer"] {
            assert!(phases.contains(&phase), "{phase} missing: {profile}");
        }
    }
    let prediction = &analysis["prediction"];
    // The simulated ranks send step 1's allocator trace, as the Python client does.
    assert_eq!(
        prediction["inputs"]["basis"], "allocator_replay",
        "{prediction}"
    );
    assert_eq!(
        prediction["inputs"]["state_source"], "measured_jump",
        "{prediction}"
    );
    assert!(prediction["explanation"]
        .as_str()
        .unwrap()
        .contains("headroom"));
    let (code, body) = agent.get("/api/v1/jobs");
    assert_eq!(code, 200);
    assert!(body.contains("\"train-a\""), "{body}");
    assert_eq!(agent.get("/api/v1/jobs/nope").0, 404);
}

#[test]
fn nvml_unavailable_at_start_then_recovers_without_restart() {
    let agent = Agent::start_with("nvml-down", 2, &[], |fake| fake.set_unavailable(true));
    assert_eq!(agent.get("/healthz").0, 200);
    let (code, why) = agent.get("/readyz");
    assert_eq!(code, 503);
    assert!(why.contains("nvml"), "readyz should say why: {why}");
    let m = agent.wait_metrics("nvml_up 0", Duration::from_secs(5), |m| {
        m.get("stepwatch_nvml_up", &[]) == Some(0.0)
    });
    assert!(
        m.get("stepwatch_nvml_errors_total", &[("call", "init")])
            .unwrap()
            >= 1.0
    );
    assert_eq!(m.count("stepwatch_gpu_memory_used_bytes"), 0);
    assert!(
        agent.log().contains("NVML unavailable"),
        "log says what happened:\n{}",
        agent.log()
    );

    agent.fake.set_unavailable(false);
    agent.wait_for("/readyz", 200, Duration::from_secs(20));
    let m = agent.wait_metrics("GPU series after recovery", Duration::from_secs(5), |m| {
        m.get("stepwatch_nvml_up", &[]) == Some(1.0)
            && m.count("stepwatch_gpu_memory_used_bytes") == 2
    });
    assert!(m.get("stepwatch_nvml_init_attempts_total", &[]).unwrap() >= 2.0);
}

#[test]
fn nvml_lost_while_running_is_reported_and_recovered() {
    let agent = Agent::start("nvml-lost", 1);
    agent.fake.set_unavailable(true);
    agent.wait_metrics(
        "nvml_up 0 after NVML vanished",
        Duration::from_secs(10),
        |m| m.get("stepwatch_nvml_up", &[]) == Some(0.0),
    );
    assert_eq!(agent.get("/readyz").0, 503);
    assert_eq!(agent.get("/healthz").0, 200);
    agent.fake.set_unavailable(false);
    agent.wait_for("/readyz", 200, Duration::from_secs(20));
}

#[test]
fn a_lost_gpu_is_reported_while_the_others_keep_sampling() {
    let agent = Agent::start("gpu-lost", 2);
    agent.fake.set_gpu_lost(1, true);
    let m = agent.wait_metrics("gpu 1 down", Duration::from_secs(10), |m| {
        m.get("stepwatch_gpu_up", &[("uuid", GPU1)]) == Some(0.0)
    });
    assert_eq!(m.get("stepwatch_gpu_up", &[("uuid", GPU0)]), Some(1.0));
    assert_eq!(m.get("stepwatch_nvml_up", &[]), Some(1.0));
    assert!(
        m.get("stepwatch_nvml_errors_total", &[("call", "memory_info")])
            .unwrap()
            > 0.0
    );
    let before = m
        .get("stepwatch_gpu_samples_total", &[("uuid", GPU0)])
        .unwrap();
    agent.wait_metrics("gpu 0 still sampled", Duration::from_secs(5), |m| {
        m.get("stepwatch_gpu_samples_total", &[("uuid", GPU0)])
            .unwrap()
            > before + 5.0
    });
    agent.fake.set_gpu_lost(1, false);
    agent.wait_metrics("gpu 1 back", Duration::from_secs(10), |m| {
        m.get("stepwatch_gpu_up", &[("uuid", GPU1)]) == Some(1.0)
    });
}

#[test]
fn sigterm_shuts_down_cleanly_and_removes_the_socket() {
    let mut agent = Agent::start("sigterm", 1);
    assert!(agent.socket.exists());
    let status = agent.terminate();
    assert!(
        status.success(),
        "exit status {status}; log:\n{}",
        agent.log()
    );
    assert!(!agent.socket.exists(), "socket file left behind");
    assert!(agent.log().contains("stopped"));
}

#[test]
fn a_second_agent_on_the_same_socket_refuses_to_start() {
    let agent = Agent::start("double", 1);
    let out = std::process::Command::new(BIN)
        .arg("agent")
        .arg("--socket")
        .arg(&agent.socket)
        .arg("--http-listen")
        .arg(free_port().to_string())
        .arg("--nvml-lib")
        .arg("/nonexistent/libnvidia-ml.so.1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already listening"), "{err}");
    // The first agent is untouched.
    assert_eq!(agent.get("/readyz").0, 200);
}

/// README.md's metrics table is the documentation users read: every metric
/// family the agent exports has a row, and every row is a family it exports.
/// The run makes every family appear: three ranks, one an outlier,
/// rank 0 warned of and dying of a step-2 OOM, a hello refused, the journal
/// and the record written.
#[test]
fn the_readme_metrics_table_matches_what_the_agent_exports() {
    let files = TempDir::new("readme-files");
    let journal = files.0.join("journal.json");
    let record = files.0.join("record.jsonl");
    // rank0-skew's L40S: rank 0 (+15% memory) dies of a step-2 OOM.
    let specs: Vec<_> = (0..3)
        .map(|i| fake_nvml::GpuSpec {
            total_bytes: 48_305_799_168,
            ..fake_nvml::GpuSpec::h100_80gb(i)
        })
        .collect();
    let agent = Agent::start_node(
        "readme",
        "test-node",
        &specs,
        None,
        &[
            "--journal",
            journal.to_str().unwrap(),
            "--journal-interval",
            "1s",
            "--record",
            record.to_str().unwrap(),
        ],
        |_| {},
    );
    agent.wait_for("/readyz", 200, Duration::from_secs(20));
    let ranks: Vec<_> = (0..3)
        .map(|r| agent.sim("rank0-skew", "doc", r, r, 3, 4.0))
        .collect();
    // A job id the agent refuses: the client is turned away, the run goes on.
    let refused = agent.sim("demo-small", "bad job!", 0, 2, 1, 50.0);
    for child in ranks {
        let _ = child.wait_with_output();
    }
    wait_ok(refused, "sim with a refused hello");
    let m = agent.wait_metrics("every family", Duration::from_secs(10), |m| {
        m.count("stepwatch_rank_steady_step_peak_bytes") > 0
            && m.count("stepwatch_journal_writes_total") > 0
            && m.count("stepwatch_markers_rejected_total") > 0
    });
    let exported: std::collections::BTreeSet<&str> =
        m.0.lines()
            .filter_map(|l| l.strip_prefix("# HELP "))
            .filter_map(|l| l.split(' ').next())
            .collect();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("\n## Metrics\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README.md has a ## Metrics section");
    let documented: std::collections::BTreeSet<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    let undocumented: Vec<_> = exported.difference(&documented).collect();
    let not_exported: Vec<_> = documented.difference(&exported).collect();
    assert!(
        undocumented.is_empty() && not_exported.is_empty(),
        "exported without a README row: {undocumented:?}; README rows not exported: {not_exported:?}"
    );
    assert!(documented.len() > 40, "{documented:?}");
}

/// The product's promise: during step 1 the agent predicts that step 2 will
/// not fit, tells the training process before step 2 begins, and stays quiet
/// for a job that fits.
#[test]
fn a_step2_oom_is_advised_during_step_1_and_a_fitting_job_gets_no_warning() {
    // thin-margin: step 1 fits an 80 GB GPU with <1% to spare; step 2 does not.
    // So the driver here reserves nothing: all 80 GB are the processes'.
    let agent = Agent::start_with("advisory", 2, &[], |f| {
        f.set_reserved_bytes(0, 0);
        f.set_reserved_bytes(1, 0);
    });
    agent.wait_for("/readyz", 200, Duration::from_secs(20));
    let doomed = agent.sim("thin-margin", "doomed", 0, 0, 4, 1.0);
    let healthy = agent.sim("precreated-state", "healthy", 0, 1, 4, 1.0);
    let doomed = doomed.wait_with_output().unwrap();
    let doomed_log = String::from_utf8_lossy(&doomed.stderr);
    assert_eq!(
        doomed.status.code(),
        Some(3),
        "the doomed rank dies of a simulated OOM:\n{doomed_log}"
    );
    assert!(
        doomed_log.contains("advisories: 1"),
        "its client got the advisory:\n{doomed_log}"
    );
    wait_ok(healthy, "healthy sim");

    let (_, body) = agent.get("/api/v1/jobs/doomed/ranks/0");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    let advisory = &report["advisories"][0];
    assert_eq!(advisory["kind"], "step2_oom_predicted", "{body}");
    assert_eq!(advisory["step"], 1);
    let issued = advisory["issued_monotonic_ns"].as_u64().unwrap();
    let step2 = &report["steps"][1];
    assert_eq!(step2["step"], 2);
    assert_eq!(step2["outcome"], "oom");
    let step2_begin = step2["begin_monotonic_ns"].as_u64().unwrap();
    assert!(
        issued < step2_begin,
        "advised at {issued}, step 2 began at {step2_begin}"
    );
    assert!(advisory["predicted_headroom_bytes"].as_i64().unwrap() < 0);

    let (_, body) = agent.get("/api/v1/jobs/healthy/ranks/0");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(report["advisories"].as_array().unwrap().len(), 0, "{body}");

    let m = Metrics(agent.metrics());
    assert_eq!(
        m.get(
            "stepwatch_advisories_sent_total",
            &[("kind", "ADVISORY_KIND_STEP2_OOM_PREDICTED")]
        ),
        Some(1.0)
    );
    assert_eq!(
        m.get("stepwatch_rank_ooms_total", &[("job", "doomed")]),
        Some(1.0)
    );
    assert_eq!(
        m.get("stepwatch_rank_oom_risk", &[("job", "doomed")]),
        Some(1.0)
    );
    assert_eq!(
        m.get("stepwatch_rank_oom_risk", &[("job", "healthy")]),
        Some(0.0)
    );
}

#[test]
fn markers_that_reach_the_agent_after_their_samples_still_get_them() {
    use common::wire::*;
    use stepwatch_proto::v1::AllocatorStats;

    const MIB: u64 = 1 << 20;
    // A process that holds a CUDA context and 1 GiB of allocator cache,
    // before its client has said hello (clients connect in the background
    // while training starts).
    let agent = Agent::start("early-markers", 1);
    agent.fake.set_process_memory(0, 4242, 1536 * MIB).unwrap();
    let used = (1536 * MIB) as f64;
    agent.wait_metrics(
        "the sampler sees the process",
        Duration::from_secs(20),
        |m| m.get("stepwatch_gpu_memory_used_bytes", &[("gpu", "0")]) == Some(used),
    );
    // Step 1 begins now, so the samples just taken are the ones before it.
    let t0 = stepwatch_proto::clock::monotonic_ns();
    // The hello comes late: a quarter of a second of samples (and the agent's
    // drains of them, every 100 ms) go by first.
    let samples = |m: &Metrics| m.get("stepwatch_gpu_samples_total", &[("gpu", "0")]);
    let before = samples(&Metrics(agent.metrics())).unwrap();
    agent.wait_metrics("25 more samples", Duration::from_secs(20), |m| {
        samples(m).is_some_and(|n| n >= before + 25.0)
    });
    let stats = AllocatorStats {
        allocated_bytes: 900 * MIB,
        allocated_peak_bytes: 900 * MIB,
        reserved_bytes: 1024 * MIB,
        reserved_peak_bytes: 1024 * MIB,
        active_bytes: 900 * MIB,
        active_peak_bytes: 900 * MIB,
        num_alloc_retries: 0,
    };
    let markers: Vec<_> = step(1, t0)
        .into_iter()
        .chain(step(2, t0 + 10_000))
        .map(|mut m| {
            m.allocator = Some(stats);
            m
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(exchange(
        &agent.endpoint(),
        vec![hello("early", 0, 1), batch(markers)],
    ))
    .expect("a well-formed stream");

    let (_, body) = agent.get("/api/v1/jobs/early/ranks/0");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    let inputs = &report["prediction_before_step2"]["inputs"];
    // The sample before step 1 began bounds NVML's view beyond the allocator:
    // the 512 MiB outside its 1 GiB of cache.
    assert_eq!(inputs["overhead_bytes"], 512 * MIB, "{body}");
}
