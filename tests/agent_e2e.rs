//! End to end: the agent binary on fake NVML, simulated ranks as processes,
//! and what a user reads from /metrics, /readyz and the JSON API.

mod common;

use std::time::Duration;

use common::*;

const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-00000000-0000-0000-0000-000000000001";
/// One MiB, the unit of the tests' byte figures.
const MIB: u64 = 1 << 20;

#[test]
fn two_ranks_three_steps_show_in_metrics_and_pass_promtool() {
    let agent = Agent::start("steps", 2);
    // Ranks 1 and 2 of a 4-rank GPT 1.3B job, one per GPU (rank N runs on GPU N-1).
    let ranks: Vec<_> = (0..2)
        .map(|r| agent.sim("rank0-skew", "train-a", r + 1, r, 3, 2.0, &[]))
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
                    &[("training_job", "train-a"), ("rank", &(r + 1).to_string())],
                ) == Some(3.0)
            })
        },
    );

    // Per-GPU memory: capacity, a current reading, and a window max that
    // caught the simulated peak although the ranks have finished.
    for gpu in [GPU0, GPU1] {
        let labels = [("gpu_uuid", gpu), ("node", "test-node")];
        let total = m.value("stepwatch_gpu_memory_total_bytes", &labels);
        assert!(total > 80e9, "H100-like capacity, got {total}");
        assert!(m.get("stepwatch_gpu_memory_used_bytes", &labels).is_some());
        let max = m.value("stepwatch_gpu_memory_used_max_bytes", &labels);
        // The simulated rank peaks near 45 GB in steady state.
        assert!(max >= 40e9, "peak was {max}");
        assert!(m.value("stepwatch_gpu_samples_total", &labels) > 10.0);
    }
    assert_eq!(m.get("stepwatch_nvml_up", &[]), Some(1.0));

    // Per-rank step and phase series, and the step-model figures.
    for r in ["1", "2"] {
        let rank = [("training_job", "train-a"), ("rank", r)];
        assert_eq!(m.get("stepwatch_rank_last_step", &rank), Some(3.0));
        // A rank's capacity is what processes can use: NVML's total less
        // the memory the driver reserves (memory info v2 `reserved`).
        let total = m.get("stepwatch_gpu_memory_total_bytes", &[("gpu_uuid", GPU0)]);
        assert_eq!(
            m.get("stepwatch_rank_gpu_capacity_bytes", &rank),
            total.map(|t| t - fake_nvml::DEFAULT_RESERVED_BYTES as f64)
        );
        let step = m.value("stepwatch_rank_step_duration_seconds", &rank);
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
        let first = m.value("stepwatch_rank_first_step_peak_bytes", &rank);
        let steady = m.value("stepwatch_rank_steady_step_peak_bytes", &rank);
        assert!(
            steady > first,
            "the first-step anomaly: steady {steady} > first {first}"
        );
        let predicted = m.value("stepwatch_rank_predicted_peak_bytes", &rank);
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
    let phases = phase_names(&steps[1]);
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
        let phases = phase_names(profile);
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
    let (code, body) = agent.get("/api/v1/jobs/train-a/ranks/2?steps=5000");
    assert_eq!(code, 400, "a report is bounded: {body}");
    assert!(
        body.contains("at most") || body.contains("more than 1000"),
        "{body}"
    );
}

#[test]
fn nvml_unavailable_at_start_then_recovers_without_restart() {
    let agent = Agent::start_with("nvml-down", 2, &[], |fake| fake.set_unavailable(true));
    assert_eq!(agent.get("/healthz").0, 200);
    // Ready without NVML (a sick GPU must not stall a DaemonSet rollout);
    // the body says how NVML is.
    let body = agent.wait_for("/readyz", 200, Duration::from_secs(20));
    assert!(
        body.contains("nvml: down"),
        "readyz should say NVML is down: {body}"
    );
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
    agent.wait_ready_with_nvml();
    let m = agent.wait_metrics("GPU series after recovery", Duration::from_secs(5), |m| {
        m.get("stepwatch_nvml_up", &[]) == Some(1.0)
            && m.count("stepwatch_gpu_memory_used_bytes") == 2
    });
    assert!(m.value("stepwatch_nvml_init_attempts_total", &[]) >= 2.0);
}

/// `--api-listen` moves the JSON API (tenants' job and pod names) to a
/// listener of its own: it answers there, and no longer beside `/metrics`.
#[test]
fn the_api_can_have_a_listener_of_its_own() {
    let agent = Agent::start_args("api-listen", &["--api-listen", "127.0.0.1:0"]);
    agent.wait_ready_with_nvml();
    let ready: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(agent.dir.0.join("ready.json")).unwrap())
            .unwrap();
    let api: std::net::SocketAddr = ready["api"]
        .as_str()
        .expect("the ready file names the API address")
        .parse()
        .unwrap();
    assert_ne!(api, agent.http);
    let (code, body) = http_get(api, "/api/v1/jobs").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"jobs\""), "{body}");
    assert_eq!(
        http_get(api, "/metrics").unwrap().0,
        404,
        "metrics stay on --http-listen"
    );
    assert_eq!(
        agent.get("/api/v1/jobs").0,
        404,
        "the API left --http-listen"
    );
    assert_eq!(agent.get("/metrics").0, 200);
    assert_eq!(agent.get("/readyz").0, 200);
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
    let (code, body) = agent.get("/readyz");
    assert_eq!(code, 200, "ready without NVML: {body}");
    assert!(body.contains("nvml: down"), "{body}");
    assert_eq!(agent.get("/healthz").0, 200);
    agent.fake.set_unavailable(false);
    agent.wait_ready_with_nvml();
}

#[test]
fn a_lost_gpu_is_reported_while_the_others_keep_sampling() {
    let agent = Agent::start("gpu-lost", 2);
    agent.fake.set_gpu_lost(1, true);
    let m = agent.wait_metrics("gpu 1 down", Duration::from_secs(10), |m| {
        m.get("stepwatch_gpu_up", &[("gpu_uuid", GPU1)]) == Some(0.0)
    });
    assert_eq!(m.get("stepwatch_gpu_up", &[("gpu_uuid", GPU0)]), Some(1.0));
    assert_eq!(m.get("stepwatch_nvml_up", &[]), Some(1.0));
    assert!(
        m.get("stepwatch_nvml_errors_total", &[("call", "memory_info")])
            .unwrap()
            > 0.0
    );
    let before = m.value("stepwatch_gpu_samples_total", &[("gpu_uuid", GPU0)]);
    agent.wait_metrics("gpu 0 still sampled", Duration::from_secs(5), |m| {
        m.get("stepwatch_gpu_samples_total", &[("gpu_uuid", GPU0)])
            .unwrap()
            > before + 5.0
    });
    agent.fake.set_gpu_lost(1, false);
    agent.wait_metrics("gpu 1 back", Duration::from_secs(10), |m| {
        m.get("stepwatch_gpu_up", &[("gpu_uuid", GPU1)]) == Some(1.0)
    });
}

#[test]
fn a_hung_nvml_read_is_reported_and_sigterm_still_ends_the_agent() {
    let mut agent = Agent::start("nvml-hang", 1);
    agent.wait_metrics("sampling", Duration::from_secs(10), |m| {
        m.get("stepwatch_gpu_samples_total", &[("gpu_uuid", GPU0)])
            .is_some_and(|n| n > 0.0)
    });
    // The read hangs: no error is returned, the figures just stop changing.
    agent
        .fake
        .set_call_delay(fake_nvml::Call::MemoryInfo, Duration::from_secs(3600));
    let m = agent.wait_metrics("gpu 0 stale", Duration::from_secs(20), |m| {
        m.get("stepwatch_gpu_up", &[("gpu_uuid", GPU0)]) == Some(0.0)
    });
    assert!(
        m.get("stepwatch_gpu_sample_age_seconds", &[("gpu_uuid", GPU0)])
            .unwrap()
            > 2.0
    );
    assert_eq!(m.get("stepwatch_nvml_up", &[]), Some(1.0));
    wait_until("the log names the hang", Duration::from_secs(10), || {
        agent.log().contains("an NVML call hangs")
    });
    // terminate() fails the test unless the agent exits within 10 s.
    let status = agent.terminate();
    assert!(
        status.success(),
        "exit status {status}; log:\n{}",
        agent.log()
    );
    assert!(agent.log().contains("exiting without nvmlShutdown"));
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
fn sigterm_releases_nvml_at_once_while_a_rank_is_still_connected() {
    // A driver upgrade (the GPU Operator's) waits for NVML's clients to let go;
    // a connected trainer keeps the agent draining for up to 3 s, so NVML goes first.
    let mut agent = Agent::start("nvml-release", 1);
    agent.wait_ready_with_nvml();
    let mut rank = agent.sim("demo-small", "held", 0, 0, 30, 0.2, &[]);
    agent.wait_metrics("the rank connected", Duration::from_secs(30), |m| {
        m.get("stepwatch_rank_connected", &[("training_job", "held")]) == Some(1.0)
    });
    let status = agent.terminate();
    let _ = rank.kill();
    let _ = rank.wait();
    let log = agent.log();
    assert!(status.success(), "exit status {status}; log:\n{log}");
    let line = log
        .lines()
        .find(|l| l.contains("NVML released"))
        .unwrap_or_else(|| panic!("no 'NVML released' line; log:\n{log}"));
    let ms: f64 = line
        .split("after_ms=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no after_ms in {line:?}"));
    // 9 ms measured on a 2-core machine (debug build); 3 s before, behind the drain.
    assert!(ms < 1000.0, "NVML released {ms} ms after SIGTERM");
    let released = log.find("NVML released").unwrap();
    if let Some(drained) = log.find("open streams did not close") {
        assert!(
            released < drained,
            "NVML released only after the drain:\n{log}"
        );
    }
}

#[test]
fn a_second_agent_on_the_same_socket_refuses_to_start() {
    let agent = Agent::start("double", 1);
    let err = stderr_of_failure(
        std::process::Command::new(BIN)
            .arg("agent")
            .arg("--socket")
            .arg(&agent.socket)
            .args(["--http-listen", "127.0.0.1:0", "--lock-wait", "200ms"])
            .arg("--nvml-lib")
            .arg("/nonexistent/libnvidia-ml.so.1"),
    );
    let pid = agent.child.as_ref().unwrap().id();
    assert!(
        err.contains(&format!("another stepwatch agent (pid {pid}) holds")),
        "{err}"
    );
    // The first agent is untouched.
    assert_eq!(agent.get("/readyz").0, 200);
}

#[test]
fn streams_that_never_say_hello_are_ended_and_do_not_lock_ranks_out() {
    use common::wire::*;
    use stepwatch_proto::v1::{ingest_client::IngestClient, ClientMessage};

    let agent = Agent::start_args("no-hello", &["--max-streams", "2", "--hello-timeout", "2s"]);
    let endpoint = agent.endpoint();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let channel = connect(&endpoint).await;
        // Eight streams on one connection that never send anything.
        let mut silent = Vec::new();
        for _ in 0..8 {
            let (tx, rx) = tokio::sync::mpsc::channel::<ClientMessage>(1);
            let response = IngestClient::new(channel.clone())
                .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .expect("the stream opens");
            silent.push((tx, response.into_inner()));
        }
        // A well-behaved rank is served while they hang around: slots are
        // taken at the hello.
        exchange(
            &endpoint,
            vec![hello("polite", 0, 1), batch(step(1, 1_000_000))],
        )
        .await
        .expect("a rank with a hello is served");
        for (_tx, mut inbound) in silent {
            let ended = inbound.message().await.expect_err("ended by the agent");
            assert_eq!(ended.code(), tonic::Code::DeadlineExceeded, "{ended:?}");
            assert!(ended.message().contains("--hello-timeout"), "{ended:?}");
        }
    });
    agent.wait_metrics("silent streams counted", Duration::from_secs(5), |m| {
        m.rejected("hello_timeout") == Some(8.0)
    });
    assert_eq!(agent.get("/api/v1/jobs/polite").0, 200);
}

/// Refusals at the wire are counted like the others, so the
/// StepwatchMarkersRejected alert sees a client that sends garbage.
#[test]
fn undecodable_oversized_and_empty_floods_are_refused_and_counted() {
    use common::wire::*;
    use stepwatch_proto::v1::{AgentMessage, Marker};

    let agent = Agent::start_args("wire-refusals", &["--max-marker-rate", "100"]);
    let endpoint = agent.endpoint();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let channel = connect(&endpoint).await;
        // A Marker where a ClientMessage belongs: field 1 with the wrong
        // wire type, which no ClientMessage decoder accepts.
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        let codec = tonic_prost::ProstCodec::<Marker, AgentMessage>::default();
        let garbage = Marker {
            kind: 1,
            step: 1,
            ..Default::default()
        };
        let refused = match grpc
            .streaming(
                tonic::Request::new(tokio_stream::iter(vec![garbage])),
                tonic::codegen::http::uri::PathAndQuery::from_static("/stepwatch.v1.Ingest/Stream"),
                codec,
            )
            .await
        {
            Ok(response) => {
                let mut inbound = response.into_inner();
                inbound.message().await.expect_err("the agent refuses it")
            }
            Err(status) => status,
        };
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");

        // A hello over the 64 KiB message limit.
        let mut big = hello("big", 0, 1);
        if let Some(stepwatch_proto::v1::client_message::Kind::Hello(h)) = &mut big.kind {
            h.framework_version = "x".repeat(70_000);
        }
        let refused = exchange(&endpoint, vec![big]).await.expect_err("too large");
        assert_eq!(refused.code(), tonic::Code::OutOfRange, "{refused:?}");

        // A flood of empty batches, beyond 100 messages/s.
        let mut flood = vec![hello("empty", 0, 1)];
        flood.extend((0..500).map(|_| batch(Vec::new())));
        let refused = exchange(&endpoint, flood).await.expect_err("rate limited");
        assert_eq!(
            refused.code(),
            tonic::Code::ResourceExhausted,
            "{refused:?}"
        );
    });
    agent.wait_metrics("every refusal counted", Duration::from_secs(5), |m| {
        m.rejected("decode_error") == Some(1.0)
            && m.rejected("message_too_large") == Some(1.0)
            && m.rejected("rate_limited") == Some(1.0)
    });
}

/// A flood of connections once took the agent to its descriptor limit, and
/// `/healthz` stopped answering (Kubernetes would restart the agent).
#[test]
fn an_ingest_connection_flood_hits_the_cap_not_the_descriptor_limit() {
    let agent = Agent::start_with_nofile(
        "conn-flood",
        64,
        &["--max-connections", "16", "--idle-timeout", "60s"],
    );
    // 100 ingest connections that send nothing, held open: far past 64
    // descriptors, and well inside the idle timeout.
    let flood: Vec<_> = (0..100)
        .map(|_| std::os::unix::net::UnixStream::connect(&agent.socket).expect("connect"))
        .collect();
    agent.wait_for("/healthz", 200, Duration::from_secs(20));
    assert_eq!(agent.get("/metrics").0, 200);
    // With the flood still held, a rank gets in: a silent connection loses
    // its slot 5 s after it opened, not after the 60 s idle timeout.
    let rank = agent.sim("demo-small", "during-flood", 0, 0, 2, 50.0, &[]);
    wait_until(
        "the rank served during the flood",
        Duration::from_secs(50),
        || agent.get("/api/v1/jobs/during-flood").0 == 200,
    );
    wait_ok(rank, "rank");
    drop(flood);
}

/// The HTTP cap cannot lock `/healthz` out for good: silent clients that
/// take every slot are closed after the idle timeout.
#[test]
fn silent_http_clients_holding_every_slot_are_closed_after_the_idle_timeout() {
    let agent = Agent::start_args(
        "http-idle",
        &["--max-http-connections", "4", "--idle-timeout", "1s"],
    );
    let silent: Vec<_> = (0..4)
        .map(|_| std::net::TcpStream::connect(agent.http).expect("connect"))
        .collect();
    agent.wait_for("/healthz", 200, Duration::from_secs(20));
    drop(silent);
}

#[test]
fn finished_jobs_give_their_slots_to_new_ones_when_the_rank_table_is_full() {
    let agent = Agent::start_args("rank-room", &["--max-ranks", "2"]);
    // Two short jobs fill the table and finish.
    for job in ["short-a", "short-b"] {
        wait_ok(agent.sim("demo-small", job, 0, 0, 2, 50.0, &[]), job);
    }
    agent.wait_metrics("both finished", Duration::from_secs(10), |m| {
        ["short-a", "short-b"]
            .iter()
            .all(|job| m.get("stepwatch_rank_connected", &[("training_job", job)]) == Some(0.0))
    });
    // A third job is let in (the default retention is an hour).
    wait_ok(
        agent.sim("demo-small", "short-c", 0, 0, 2, 50.0, &[]),
        "short-c",
    );
    agent.wait_metrics("one rank evicted", Duration::from_secs(5), |m| {
        m.get("stepwatch_ranks_evicted_total", &[]) == Some(1.0)
    });
    assert!(agent.get("/api/v1/jobs/short-a").0 == 404);
    assert!(agent.get("/api/v1/jobs/short-c").0 == 200);
    assert!(agent
        .log()
        .contains("evicted the rank that finished longest ago"));
}

#[test]
fn a_socket_path_that_is_a_regular_file_is_refused_and_kept() {
    let dir = TempDir::new("socket-file");
    let path = dir.0.join("not-a-socket");
    std::fs::write(&path, "precious").unwrap();
    let err = stderr_of_failure(
        std::process::Command::new(BIN)
            .arg("agent")
            .arg("--socket")
            .arg(&path)
            .args(["--http-listen", "127.0.0.1:0"])
            .arg("--nvml-lib")
            .arg("/nonexistent/libnvidia-ml.so.1"),
    );
    assert!(err.contains("is not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "precious");
}

/// The metrics reference (docs/src/reference/metrics.md, generated from the
/// agent's table) is what users read: every metric family the agent
/// exports has a row, and every row is a family it exports.
/// The run makes every family appear: three ranks, one an outlier,
/// rank 0 warned of and dying of a step-2 OOM, a hello refused, the journal
/// and the record written.
#[test]
fn the_metrics_reference_matches_what_the_agent_exports() {
    let files = TempDir::new("readme-files");
    let journal = files.0.join("journal.json");
    let record = files.0.join("record.jsonl");
    // The CSI service's families exist only when it is served.
    let slurm_jobs = files.0.join("slurm-jobs");
    std::fs::create_dir(&slurm_jobs).unwrap();
    let csi = files.0.join("csi.sock");
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
            "--csi-socket",
            csi.to_str().unwrap(),
            // Slurm attribution's counter exists only when it is on.
            "--slurm-job-mapping-dir",
            slurm_jobs.to_str().unwrap(),
            // The fast path's families exist only with an Alertmanager;
            // nothing listens on port 9 (discard), which is fine here.
            "--alertmanager-url",
            "http://127.0.0.1:9",
        ],
        |_| {},
    );
    agent.wait_ready_with_nvml();
    let ranks: Vec<_> = (0..3)
        .map(|r| agent.sim("rank0-skew", "doc", r, r, 3, 4.0, &[]))
        .collect();
    // A job id the agent refuses: the client is turned away, the run goes on.
    let refused = agent.sim("demo-small", "bad job!", 0, 2, 1, 50.0, &[]);
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
    let page = reference_page("metrics.md");
    let section = page
        .split("<!-- BEGIN GENERATED: metrics -->")
        .nth(1)
        .and_then(|s| s.split("<!-- END GENERATED: metrics -->").next())
        .expect("the metrics reference has its generated table");
    let documented: std::collections::BTreeSet<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    // Families that exist only once memory grows after step 2 (the growth
    // test below makes the first three appear), once the trailing window
    // holds NVML peaks of steps 3 on (the exporter's unit test
    // the_trailing_window_and_its_headroom_are_exported), or with evaluation
    // passes and a loader's largest batch
    // (passes_and_batches_are_reported_apart_from_the_steps); this run has
    // none of them.
    let only_with_growth = [
        "stepwatch_rank_memory_forecast_oom_seconds",
        "stepwatch_rank_memory_forecast_oom_step",
        "stepwatch_rank_memory_growth_bytes_per_step",
        "stepwatch_rank_trailing_headroom_bytes",
        "stepwatch_rank_batch_largest_peak_bytes",
        "stepwatch_rank_batch_outlook_peak_bytes",
        "stepwatch_rank_batch_outlook_headroom_bytes",
        "stepwatch_rank_pass_peak_bytes",
        "stepwatch_rank_pass_headroom_bytes",
    ];
    let undocumented: Vec<_> = exported.difference(&documented).collect();
    let not_exported: Vec<_> = documented
        .difference(&exported)
        .filter(|name| !only_with_growth.contains(name))
        .collect();
    assert!(
        undocumented.is_empty() && not_exported.is_empty(),
        "exported without a reference row: {undocumented:?}; reference rows not exported: {not_exported:?}"
    );
    assert!(only_with_growth
        .iter()
        .all(|name| documented.contains(name)));
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
    agent.wait_ready_with_nvml();
    let doomed = agent.sim("thin-margin", "doomed", 0, 0, 4, 1.0, &[]);
    let healthy = agent.sim("precreated-state", "healthy", 0, 1, 4, 1.0, &[]);
    let doomed_log = doomed.wait_oom("the doomed rank dies of a simulated OOM");
    wait_ok(healthy, "healthy sim");
    // The agent's log says it too, for whoever reads only that.
    wait_until(
        "the OOM in the agent's log",
        Duration::from_secs(10),
        || {
            agent.log().lines().any(|l| {
                l.contains("rank died of a CUDA out-of-memory error in step 2")
                    && l.contains("job=doomed")
            })
        },
    );

    let (_, body) = agent.get("/api/v1/jobs/doomed/ranks/0");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    // The provisional prediction grows as step 1 goes on: an advisory goes
    // out again each time it has worsened by 1% of capacity, so the last one
    // the client got is within that of the prediction frozen at step 2.
    let all = report["advisories"].as_array().unwrap();
    assert!(
        doomed_log.contains(&format!("advisories: {}", all.len())),
        "its client got every advisory:\n{doomed_log}"
    );
    // The warnings, then word that step 1's prediction is final.
    assert_eq!(all.last().unwrap()["kind"], "prediction_final", "{body}");
    let sent = &all[..all.len() - 1];
    assert!(!sent.is_empty(), "{body}");
    let capacity = sent[0]["capacity_bytes"].as_f64().unwrap();
    let peaks: Vec<f64> = sent
        .iter()
        .map(|a| a["predicted_peak_bytes"].as_f64().unwrap())
        .collect();
    for w in peaks.windows(2) {
        assert!(w[1] - w[0] >= 0.01 * capacity, "{peaks:?}");
    }
    let frozen = report["prediction_before_step2"]["predicted_peak_bytes"]
        .as_f64()
        .unwrap();
    assert!(frozen - peaks[peaks.len() - 1] < 0.01 * capacity, "{body}");
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

    // Every JSON path the HTTP API reference names is in the answers: the
    // doomed rank's, or for what comes after step 2, the healthy rank's.
    let (_, job_body) = agent.get("/api/v1/jobs/doomed");
    let job: serde_json::Value = serde_json::from_str(&job_body).unwrap();
    let (_, healthy_body) = agent.get("/api/v1/jobs/healthy/ranks/0");
    let healthy_report: serde_json::Value = serde_json::from_str(&healthy_body).unwrap();
    let paths = documented_json_paths();
    assert!(paths.len() >= 10, "{paths:?}");
    for (answer, path) in &paths {
        let found = if answer == "job" {
            json_path_exists(&job, path)
        } else if path.starts_with("passes") || path.starts_with("batches") {
            continue; // passes_and_batches_are_reported_apart_from_the_steps
        } else {
            json_path_exists(&report, path) || json_path_exists(&healthy_report, path)
        };
        assert!(
            found,
            "the documented {answer} path {path} is not in the answers:\n{}",
            if answer == "job" {
                job_body.clone()
            } else {
                format!("{body}\n{healthy_body}")
            }
        );
    }
    // The thin-margin job's message is in GB and its explanation has no
    // Rust enum names.
    let message = advisory["message"].as_str().unwrap();
    assert!(message.contains(" GB exceeds capacity "), "{message}");
    let explanation = report["prediction_before_step2"]["explanation"]
        .as_str()
        .unwrap();
    assert!(
        !explanation.contains("MeasuredJump") && explanation.contains(" GB"),
        "{explanation}"
    );

    let (_, body) = agent.get("/api/v1/jobs/healthy/ranks/0");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    let kinds = advisory_kinds(&report);
    assert_eq!(kinds, ["prediction_final"], "no warning: {body}");

    let m = Metrics(agent.metrics());
    assert_eq!(
        m.get(
            "stepwatch_advisories_sent_total",
            &[("kind", "ADVISORY_KIND_STEP2_OOM_PREDICTED")]
        ),
        Some(peaks.len() as f64)
    );
    assert_eq!(
        m.get("stepwatch_rank_ooms_total", &[("training_job", "doomed")]),
        Some(1.0)
    );
    assert_eq!(
        m.get("stepwatch_rank_oom_risk", &[("training_job", "doomed")]),
        Some(1.0)
    );
    assert_eq!(
        m.get("stepwatch_rank_oom_risk", &[("training_job", "healthy")]),
        Some(0.0)
    );
}

/// An agent whose GPU holds a process of 1536 MiB, seen by its sampler: a
/// CUDA context and 1 GiB of allocator cache, before the process's client
/// has said hello (clients connect in the background while training starts).
fn agent_with_a_process_of_1536_mib(tag: &str) -> Agent {
    let agent = Agent::start(tag, 1);
    agent.fake.set_process_memory(0, 4242, 1536 * MIB).unwrap();
    let used = (1536 * MIB) as f64;
    agent.wait_metrics(
        "the sampler sees the process",
        Duration::from_secs(20),
        |m| m.get("stepwatch_gpu_memory_used_bytes", &[("gpu", "0")]) == Some(used),
    );
    agent
}

/// That process's allocator at every marker: 900 MiB allocated, the
/// allocator's 1 GiB of cache reserved.
fn allocated_900_of_1024_mib() -> stepwatch_proto::v1::AllocatorStats {
    stepwatch_proto::v1::AllocatorStats {
        allocated_bytes: 900 * MIB,
        allocated_peak_bytes: 900 * MIB,
        reserved_bytes: 1024 * MIB,
        reserved_peak_bytes: 1024 * MIB,
        active_bytes: 900 * MIB,
        active_peak_bytes: 900 * MIB,
        num_alloc_retries: 0,
    }
}

/// Sends `markers` as the one rank of `job` on one stream; the rank's
/// report once the stream has ended, and its text.
fn report_after(
    agent: &Agent,
    job: &str,
    markers: Vec<stepwatch_proto::v1::Marker>,
) -> (serde_json::Value, String) {
    use common::wire::{batch, hello};
    agent.accepts(job, vec![hello(job, 0, 1), batch(markers)]);
    let (_, body) = agent.get(&format!("/api/v1/jobs/{job}/ranks/0"));
    (serde_json::from_str(&body).unwrap(), body)
}

#[test]
fn markers_that_reach_the_agent_after_their_samples_still_get_them() {
    use common::wire::*;

    let agent = agent_with_a_process_of_1536_mib("early-markers");
    // Step 1 begins now, so the samples just taken are the ones before it.
    let t0 = stepwatch_proto::clock::monotonic_ns();
    // The hello comes late: a quarter of a second of samples (and the agent's
    // drains of them, every 100 ms) go by first.
    let samples = |m: &Metrics| m.get("stepwatch_gpu_samples_total", &[("gpu", "0")]);
    let before = samples(&Metrics(agent.metrics())).unwrap();
    agent.wait_metrics("25 more samples", Duration::from_secs(20), |m| {
        samples(m).is_some_and(|n| n >= before + 25.0)
    });
    let markers: Vec<_> = step(1, t0)
        .into_iter()
        .chain(step(2, t0 + 10_000))
        .map(|mut m| {
            m.allocator = Some(allocated_900_of_1024_mib());
            m
        })
        .collect();
    let (report, body) = report_after(&agent, "early", markers);
    let inputs = &report["prediction_before_step2"]["inputs"];
    // The sample before step 1 began bounds NVML's view beyond the allocator:
    // the 512 MiB outside its 1 GiB of cache.
    assert_eq!(inputs["overhead_bytes"], 512 * MIB, "{body}");
}

/// Step 1's markers carry the device's memory (`cudaMemGetInfo`, marker
/// field 8): the prediction's overhead comes from them, and its JSON says
/// so (`overhead_source`). Wiring only: the figures are made up, the
/// device's showing 600 MiB outside the 1 GiB cache where NVML's process
/// (context + cache) shows 512 (whether NVML's estimate exists depends on
/// the sampler's timing, so it is not checked here).
#[test]
fn the_prediction_names_the_client_device_memory_as_the_overhead_source() {
    use common::wire::*;
    use stepwatch_proto::v1::DeviceMemory;

    let agent = agent_with_a_process_of_1536_mib("device-memory");
    let t0 = stepwatch_proto::clock::monotonic_ns();
    let total = 40 << 30;
    let device = DeviceMemory {
        free_bytes: total - 1024 * MIB - 600 * MIB,
        total_bytes: total,
    };
    let markers: Vec<_> = step(1, t0)
        .into_iter()
        .map(|mut m| {
            m.allocator = Some(allocated_900_of_1024_mib());
            m.device_memory = Some(device);
            m
        })
        .collect();
    let (report, body) = report_after(&agent, "devmem", markers);
    let prediction = &report["analysis"]["prediction"];
    let inputs = &prediction["inputs"];
    assert_eq!(inputs["overhead_source"], "client_device_memory", "{body}");
    assert_eq!(inputs["overhead_bytes"], 600 * MIB, "{body}");
    assert_eq!(inputs["process_overhead_bytes"], 600 * MIB, "{body}");
    assert_eq!(inputs["device_total_bytes"], total, "{body}");
    let explanation = prediction["explanation"].as_str().unwrap();
    assert!(
        explanation.contains("CUDA driver's free and total memory"),
        "{explanation}"
    );
}

/// A second `fit()` in one process is a new run: its hello carries a new
/// run id, and the rank starts again at step 1 with a prediction of its own
/// instead of continuing the first run's step numbers.
#[test]
fn a_second_run_in_the_same_process_gets_its_own_step_1_and_prediction() {
    use common::wire::*;
    use stepwatch_proto::v1::AllocatorStats;

    let agent = Agent::start("second-run", 1);
    let run = |run_id: &str, first_step: u64, steps: u64, allocated: u64| {
        let hello = hello_of_run("refit", run_id);
        let stats = AllocatorStats {
            allocated_bytes: allocated,
            allocated_peak_bytes: allocated,
            reserved_bytes: allocated + 100 * MIB,
            reserved_peak_bytes: allocated + 100 * MIB,
            active_bytes: allocated,
            active_peak_bytes: allocated,
            num_alloc_retries: 0,
        };
        let t0 = stepwatch_proto::clock::monotonic_ns();
        let markers: Vec<_> = (first_step..first_step + steps)
            .flat_map(|n| step(n, t0 + n * 10_000))
            .map(|mut m| {
                m.allocator = Some(stats);
                m
            })
            .collect();
        vec![hello, batch(markers)]
    };
    let report = || {
        let (_, body) = agent.get("/api/v1/jobs/refit/ranks/0");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        (v, body)
    };
    // The step-1 peak the run's prediction before step 2 started from.
    let step1_peak = |report: &serde_json::Value| {
        report["prediction_before_step2"]["inputs"]["step1_peak_bytes"].as_u64()
    };
    agent.accepts("the first run", run("fit-1", 1, 3, 900 * MIB));
    let (first, body) = report();
    assert_eq!(first["steps"].as_array().unwrap().len(), 3, "{body}");
    let first_peak =
        step1_peak(&first).unwrap_or_else(|| panic!("the first run's prediction: {body}"));

    // The same process (same PID), a new run: step 1 again, a third of the
    // memory. Without the run id the agent refuses step 1 after step 3.
    agent.accepts(
        "the second run starts at step 1",
        run("fit-2", 1, 2, 300 * MIB),
    );
    let (second, body) = report();
    assert_eq!(second["info"]["run_id"], "fit-2", "{body}");
    let steps: Vec<u64> = second["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2], "only the second run's steps: {body}");
    assert_eq!(
        second["prediction_before_step2"]["inputs"]["step"], 1,
        "{body}"
    );
    let second_peak = step1_peak(&second);
    assert!(
        second_peak.is_some_and(|peak| peak < first_peak),
        "the second run's own step 1 ({second_peak:?}), not the first's ({first_peak}): {body}"
    );
}

/// A first run's stream still open when the second run's opens (its last
/// batches in flight, or a second client in the process): its batches are
/// refused, counted and logged, and its stream is ended with a status that
/// names both runs, so they cannot rewrite the second run's step 1.
#[test]
fn a_still_open_stream_of_a_run_the_process_left_cannot_touch_the_new_runs_step_1() {
    use common::wire::*;

    let agent = Agent::start("stale-run", 1);
    let endpoint = agent.endpoint();
    let hello_of = |run_id: &str| hello_of_run("stale", run_id);
    let report = || {
        let (_, body) = agent.get("/api/v1/jobs/stale/ranks/0");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        (v, body)
    };
    // Both runs' clocks interleave, as two clients' do: fit-1's late
    // markers would pass every check of fit-2's timeline.
    let t0 = stepwatch_proto::clock::monotonic_ns();
    let fit1 = step(1, t0 + 10_000);
    let fit2 = step(1, t0);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (old, mut old_inbound) = open_stream(&endpoint).await;
        old.send(hello_of("fit-1")).await.unwrap();
        old.send(batch(fit1[..2].to_vec())).await.unwrap();
        common::wait_until("fit-1's step 1 began", Duration::from_secs(10), || {
            report().0["steps"].as_array().is_some_and(|s| s.len() == 1)
        });
        // fit-2 opens while fit-1's stream is still open.
        exchange(
            &endpoint,
            vec![hello_of("fit-2"), batch(fit2[..2].to_vec())],
        )
        .await
        .expect("the second run starts");
        // fit-1's last batch: the rest of its step 1 and step 2's begin.
        let mut late = fit1[2..].to_vec();
        late.push(step(2, t0 + 20_000)[0].clone());
        let n = late.len();
        old.send(batch(late)).await.unwrap();
        let ended = refusal(&mut old_inbound, "fit-1's stream (it was left open)").await;
        assert_eq!(ended.code(), tonic::Code::FailedPrecondition, "{ended:?}");
        assert!(
            ended.message().contains("\"fit-1\"") && ended.message().contains("\"fit-2\""),
            "{ended:?}"
        );
        // The refusal names itself, and tells the client that no retry of
        // fit-1 can pass (a client that retried would loop on rank_held).
        assert_refusal(&ended, "run_ended", Some("never"), "fit-1's stream");
        let reconnect = exchange(&endpoint, vec![hello_of("fit-1")])
            .await
            .expect_err("fit-1 cannot come back");
        assert_eq!(
            reconnect.code(),
            tonic::Code::AlreadyExists,
            "{reconnect:?}"
        );
        assert_refusal(&reconnect, "rank_held", Some("never"), "fit-1 again");
        agent.wait_metrics("the refused batch counted", Duration::from_secs(5), |m| {
            m.rejected("run_ended") == Some(n as f64)
        });
    });
    let (rank, body) = report();
    assert_eq!(rank["info"]["run_id"], "fit-2", "{body}");
    let steps = rank["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1, "fit-2's step 1 alone: {body}");
    assert_eq!(steps[0]["begin_monotonic_ns"], t0, "fit-2's step 1: {body}");
    let phases = phase_names(&steps[0]);
    assert_eq!(
        phases,
        ["prologue", "forward"],
        "still in its forward: {body}"
    );
    assert!(rank["prediction_before_step2"].is_null(), "{body}");
    let log = agent.log();
    let warned: Vec<_> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("a run the process has left"))
        .collect();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(
        warned[0].contains("stream_run=fit-1") && warned[0].contains("rank_run=fit-2"),
        "{log}"
    );
}

/// A stream's opening that no reconnect of its process can cure (a hello
/// that breaks the contract, one too large to read, or none: the process
/// opens every stream the same way) is refused with `stepwatch-retry:
/// never`, so that its client stops instead of being refused every 10 s
/// for the rest of training. A refusal a later try can pass (a rank
/// another live process holds, a batch refused after the hello) carries
/// no such mark, and the later try passes.
#[test]
fn an_opening_no_reconnect_can_cure_is_refused_for_good_and_one_a_retry_can_pass_is_not() {
    use common::wire::*;
    use stepwatch_proto::v1::{client_message::Kind, ClientMessage, Hello};

    // Over TCP the agent takes the PID from the hello: two "processes".
    let agent = Agent::start_args("retry-never", &["--grpc-listen", "127.0.0.1:0"]);
    let tcp = format!(
        "http://{}",
        agent.grpc.expect("the agent reports its gRPC address")
    );
    let hello_with = |job: &str, pid: u32, edit: &dyn Fn(&mut Hello)| {
        let mut hello = hello(job, 0, 1);
        if let Some(Kind::Hello(h)) = hello.kind.as_mut() {
            h.pid = pid;
            edit(h);
        }
        hello
    };
    let identity = |edit: fn(&mut stepwatch_proto::v1::Identity)| {
        move |h: &mut Hello| edit(h.identity.as_mut().unwrap())
    };
    let t0 = stepwatch_proto::clock::monotonic_ns();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let for_good: Vec<(&str, Vec<ClientMessage>, &str)> = vec![
            (
                "a rank beyond the world",
                vec![hello_with("bad", 1, &identity(|i| i.rank = 3))],
                "rank_out_of_range",
            ),
            (
                "a world beyond 65536 ranks",
                vec![hello_with("bad", 1, &identity(|i| i.world_size = 100_000))],
                "rank_out_of_range",
            ),
            (
                "no job id",
                vec![hello_with("", 1, &|_| {})],
                "bad_identity",
            ),
            (
                "a job id over 128 bytes",
                vec![hello_with(&"j".repeat(200), 1, &|_| {})],
                "bad_identity",
            ),
            (
                "a hello over 64 KiB",
                vec![hello_with(&"j".repeat(70_000), 1, &|_| {})],
                "message_too_large",
            ),
            (
                "markers before any hello",
                vec![batch(step(1, t0))],
                "no_hello",
            ),
        ];
        for (what, messages, reason) in for_good {
            let refused = exchange(&tcp, messages)
                .await
                .expect_err(&format!("{what} is refused"));
            // No reconnect of the process can pass.
            assert_refusal(&refused, reason, Some("never"), what);
        }

        // Process 1 holds rank 0 of "held" on an open stream.
        let (holder, mut holder_inbound) = open_stream(&tcp).await;
        holder.send(hello_with("held", 1, &|_| {})).await.unwrap();
        holder.send(batch(step(1, t0))).await.unwrap();
        common::wait_until("the holder's step 1", Duration::from_secs(10), || {
            common::rank_report(&agent, "held", 0).is_some_and(|r| r["info"]["pid"] == 1)
        });
        let held = exchange(&tcp, vec![hello_with("held", 2, &|_| {})])
            .await
            .expect_err("the rank is held");
        // The holder may go away: the client may retry.
        assert_refusal(&held, "rank_held", None, "a held rank");
        // A batch refused after an accepted hello: a new stream does not resend it.
        let regressed = exchange(
            &tcp,
            vec![hello_with("other", 1, &|_| {}), batch(step(0, t0))],
        )
        .await
        .expect_err("step 0 is refused");
        assert_refusal(&regressed, "step_regressed", None, "step 0 after a hello");

        // Once the holder's stream has closed, process 2's retry takes the rank.
        drop(holder);
        while holder_inbound
            .message()
            .await
            .expect("the holder ends cleanly")
            .is_some()
        {}
        exchange(&tcp, vec![hello_with("held", 2, &|_| {})])
            .await
            .expect("the retry passes once the holder is gone");
        exchange(
            &tcp,
            vec![hello_with("other", 1, &|_| {}), batch(step(1, t0))],
        )
        .await
        .expect("the refused batch's rank goes on");
    });
    assert_eq!(
        common::rank_report(&agent, "held", 0).unwrap()["info"]["pid"],
        2
    );
}

#[test]
fn the_rank_heavier_in_forward_gets_a_rank_divergence_advisory_on_its_stream() {
    use common::wire::*;
    use stepwatch_proto::v1::{AdvisoryKind, AllocatorStats, Severity};

    const MB: u64 = 1_000_000;
    // Four ranks with the same 10 GB at step begin, 2 GB of gradients and
    // 8 GB of optimizer state (step-1 peak 20 GB each); rank 3's forward
    // makes 6.2 GB of activations against the others' 5 GB (+24%).
    let step1 = |act: u64| -> Vec<_> {
        let fb = 10_000 + act;
        let figures = [
            (10_000, 10_000),
            (10_000, 10_000),
            (fb, fb),
            (12_000, fb),
            (20_000, 20_000),
            (20_000, 20_000),
        ];
        // Timestamps long before the agent started: no NVML sample falls in
        // them, so the allocator figures are compared.
        step(1, 1_000_000)
            .into_iter()
            .zip(figures)
            .map(|(mut m, (allocated, peak))| {
                m.allocator = Some(AllocatorStats {
                    allocated_bytes: allocated * MB,
                    allocated_peak_bytes: peak * MB,
                    reserved_bytes: peak * MB,
                    reserved_peak_bytes: peak * MB,
                    ..Default::default()
                });
                m
            })
            .collect()
    };
    let agent = Agent::start("divergence", 1);
    agent.wait_ready_with_nvml();
    for rank in 0..3 {
        let got = agent.accepts(
            "a well-formed stream",
            vec![hello("div", rank, 4), batch(step1(5_000))],
        );
        let kinds: Vec<i32> = wire::advisories(got).iter().map(|a| a.kind).collect();
        assert_eq!(
            kinds,
            [AdvisoryKind::PredictionFinal as i32],
            "rank {rank}: only step 1's prediction being final"
        );
    }
    let got = agent.accepts(
        "a well-formed stream",
        vec![hello("div", 3, 4), batch(step1(6_200))],
    );
    let advisories = wire::warnings(got);
    assert_eq!(advisories.len(), 1, "{advisories:?}");
    let a = &advisories[0];
    assert_eq!(a.kind, AdvisoryKind::RankDivergence as i32);
    assert_eq!(a.severity, Severity::Warning as i32);
    assert!(
        a.message
            .contains("6.20 GB is 24.0% above the median 5.00 GB"),
        "{}",
        a.message
    );

    let (_, body) = agent.get("/api/v1/jobs/div");
    let job: serde_json::Value = serde_json::from_str(&body).unwrap();
    let named = &job["divergence"]["named"];
    assert_eq!(named.as_array().map(Vec::len), Some(1), "{body}");
    assert_eq!(named[0]["rank"], 3);
    assert_eq!(named[0]["figure"], "activation_peak");
    assert_eq!(job["divergence"]["peak"]["spread"], 0.0, "{body}");
    let m = Metrics(agent.metrics());
    assert_eq!(
        m.get(
            "stepwatch_job_rank_outlier",
            &[
                ("training_job", "div"),
                ("rank", "3"),
                ("figure", "activation_peak")
            ]
        ),
        Some(1.0)
    );
    assert_eq!(
        m.get(
            "stepwatch_advisories_sent_total",
            &[("kind", "ADVISORY_KIND_RANK_DIVERGENCE")]
        ),
        Some(1.0)
    );
}

/// After step 1 nothing else watches a job that grows into the GPU's limit
/// (seen on real PyTorch on fake CUDA: `lightning-gpt` on a tight GPU died in
/// step 4, its `num_alloc_retries` grew in steps 2 and 3). The client's
/// retry count growing in step 3 reaches the training process as one
/// ALLOCATOR_RETRIES advisory on its stream, and moves the rank's counter.
#[test]
fn allocator_retries_after_step_1_are_advised_on_the_stream_and_counted() {
    use common::wire::*;
    use stepwatch_proto::v1::{AdvisoryKind, AllocatorStats, Severity};

    const MB: u64 = 1_000_000;
    // Every marker of step `n` reports `retries` (the last two markers of
    // a step may report `late` instead), with small allocator figures.
    let with_retries = |n: u64, t0: u64, retries: u64, late: u64| -> Vec<_> {
        let markers = step(n, t0);
        let last = markers.len() - 2;
        markers
            .into_iter()
            .enumerate()
            .map(|(i, mut m)| {
                m.allocator = Some(AllocatorStats {
                    allocated_bytes: 1_000 * MB,
                    allocated_peak_bytes: 1_000 * MB,
                    reserved_bytes: 1_200 * MB,
                    reserved_peak_bytes: 1_200 * MB,
                    num_alloc_retries: if i >= last { late } else { retries },
                    ..Default::default()
                });
                m
            })
            .collect()
    };
    let agent = Agent::start("retries", 1);
    // Two steps on one stream of the rank: the retries advisories it got.
    let two_steps = |first, second| -> Vec<_> {
        let messages = vec![hello("retries", 0, 1), batch(first), batch(second)];
        wire::warnings(agent.accepts("two steps", messages))
            .into_iter()
            .filter(|a| a.kind == AdvisoryKind::AllocatorRetries as i32)
            .collect()
    };
    let labels = [("training_job", "retries"), ("rank", "0")];
    // Steps 1 and 2 without retries: no advisory, the counter at 0.
    let advisories = two_steps(
        with_retries(1, 1_000_000, 0, 0),
        with_retries(2, 2_000_000, 0, 0),
    );
    assert!(advisories.is_empty(), "{advisories:?}");
    agent.wait_metrics("the counter at 0", Duration::from_secs(10), |m| {
        m.get("stepwatch_rank_allocator_retries_total", &labels) == Some(0.0)
    });
    // The same process resumes: step 3 retries twice (0 → 2), step 4 once
    // more; one advisory, in step 3.
    let advisories = two_steps(
        with_retries(3, 3_000_000, 0, 2),
        with_retries(4, 4_000_000, 3, 3),
    );
    assert_eq!(advisories.len(), 1, "{advisories:?}");
    let a = &advisories[0];
    assert_eq!((a.step, a.severity), (3, Severity::Warning as i32));
    for words in [
        "in step 3",
        "retry 2 times (2 since the process started)",
        "expandable_segments:True",
    ] {
        assert!(a.message.contains(words), "{words:?} not in {}", a.message);
    }
    let m = agent.wait_metrics("the counter at 3", Duration::from_secs(10), |m| {
        m.get("stepwatch_rank_allocator_retries_total", &labels) == Some(3.0)
    });
    assert_eq!(
        m.get(
            "stepwatch_advisories_sent_total",
            &[("kind", "ADVISORY_KIND_ALLOCATOR_RETRIES")]
        ),
        Some(1.0)
    );
    let (_, body) = agent.get("/api/v1/jobs/retries/ranks/0");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(report["allocator_retries"], 3, "{body}");
    let mut kinds = advisory_kinds(&report);
    // Its made-up clock is also told (see `wire::advisories`).
    kinds.retain(|k| *k != "client_clock");
    assert_eq!(kinds, ["prediction_final", "allocator_retries"], "{body}");
}

/// Step 1 can predict room to spare and later steps still run at the limit
/// (on real PyTorch, fake CUDA: markers-only `lightning-gpt` predicted at 11%
/// headroom ran at 1.5% from step 3 on). Once two steps after the first have
/// ended with the GPU nearly full, the training process is told on its
/// stream, once: the figure is the steady peak the exporter shows
/// (`StepwatchLowObservedHeadroom`'s), and the counter counts it.
#[test]
fn low_observed_headroom_after_step_1_is_advised_on_the_stream_and_counted() {
    use common::wire::*;
    use stepwatch_proto::v1::{AdvisoryKind, Severity};

    let agent = Agent::start("observed", 1);
    let labels = [("training_job", "observed"), ("rank", "0")];
    let kind = [("kind", "ADVISORY_KIND_LOW_OBSERVED_HEADROOM")];
    // Known from the start, at 0.
    assert_eq!(
        Metrics(agent.metrics()).get("stepwatch_advisories_sent_total", &kind),
        Some(0.0)
    );
    let samples = |m: &Metrics| m.get("stepwatch_gpu_samples_total", &[("gpu", "0")]);
    // The process holds `used` for a stretch of samples; returns its
    // CLOCK_MONOTONIC bounds, every sample between them at `used`.
    let hold = |used: u64| -> (u64, u64) {
        agent.fake.set_process_memory(0, 4242, used).unwrap();
        agent.wait_metrics("the sampler sees it", Duration::from_secs(20), |m| {
            m.get("stepwatch_gpu_memory_used_bytes", &[("gpu", "0")]) == Some(used as f64)
        });
        let from = stepwatch_proto::clock::monotonic_ns();
        let before = samples(&Metrics(agent.metrics())).unwrap();
        agent.wait_metrics("20 more samples", Duration::from_secs(20), |m| {
            samples(m).is_some_and(|n| n >= before + 20.0)
        });
        (from, stepwatch_proto::clock::monotonic_ns())
    };
    // A step's markers spread evenly over [from, to].
    let spread = |n: u64, from: u64, to: u64| -> Vec<_> {
        let mut markers = step(n, 0);
        let gap = (to - from) / markers.len() as u64;
        for (i, m) in markers.iter_mut().enumerate() {
            m.monotonic_ns = from + i as u64 * gap;
            m.wall_ns = m.monotonic_ns;
        }
        markers
    };
    // Step 1 at 40000 MiB of the H100's 81047 usable (81559 less the
    // driver's 512): predicted with half the GPU to spare, no advisory.
    // Steps 2 and 3 at 80000 MiB: 1047 MiB = 1.3% left.
    let (a, b) = hold(40_000 * MIB);
    let (c, d) = hold(80_000 * MIB);
    let mid = c + (d - c) / 2;
    let got = agent.accepts(
        "a well-formed stream",
        vec![
            hello("observed", 0, 1),
            batch(spread(1, a, b)),
            batch(spread(2, c, mid)),
            batch(spread(3, mid, d)),
        ],
    );
    let advisories = wire::warnings(got);
    assert_eq!(advisories.len(), 1, "{advisories:?}");
    let advisory = &advisories[0];
    assert_eq!(advisory.kind, AdvisoryKind::LowObservedHeadroom as i32);
    assert_eq!(
        (advisory.step, advisory.severity),
        (3, Severity::Warning as i32)
    );
    // 80000 MiB = 83.89 GB, 81047 MiB = 84.98 GB.
    for words in [
        "steps 2–3 peak at 83.89 GB of 84.98 GB usable on the GPU (1.3% to spare)",
        "the prediction made during step 1 was",
        "expandable_segments:True",
    ] {
        assert!(
            advisory.message.contains(words),
            "{words:?} not in {}",
            advisory.message
        );
    }
    // NVML figures only: the allocator trace was not what it lacked.
    assert!(
        !advisory.message.contains("allocator trace"),
        "{}",
        advisory.message
    );
    let m = agent.wait_metrics("the advisory counted", Duration::from_secs(10), |m| {
        m.get("stepwatch_advisories_sent_total", &kind) == Some(1.0)
    });
    // The figure the advisory rests on is the one the rule reads.
    assert_eq!(
        m.get("stepwatch_rank_steady_step_peak_bytes", &labels),
        Some((80_000 * MIB) as f64)
    );
    assert_eq!(
        m.get("stepwatch_rank_gpu_capacity_bytes", &labels),
        Some((81_047 * MIB) as f64)
    );
    let (_, body) = agent.get("/api/v1/jobs/observed/ranks/0");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    let kinds = advisory_kinds(&report);
    assert_eq!(
        kinds,
        ["prediction_final", "low_observed_headroom"],
        "{body}"
    );
}

/// A page of the book's reference (docs/src/reference/).
fn reference_page(name: &str) -> String {
    let path = repo().join("docs/src/reference").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The names of the phases of a step or profile in a rank's report.
fn phase_names(step: &serde_json::Value) -> Vec<&str> {
    let phases = step["phases"].as_array().expect("a list of phases");
    phases
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect()
}

/// The kinds of the advisories in a rank's report, in order.
fn advisory_kinds(report: &serde_json::Value) -> Vec<&str> {
    let advisories = report["advisories"]
        .as_array()
        .expect("a list of advisories");
    advisories
        .iter()
        .map(|a| a["kind"].as_str().unwrap())
        .collect()
}

/// (answer, path) of each row of the HTTP API reference's "JSON paths" table.
fn documented_json_paths() -> Vec<(String, String)> {
    let page = reference_page("http-api.md");
    let section = page
        .split("\n## JSON paths")
        .nth(1)
        .expect("the HTTP API reference has a JSON paths section");
    let section = section.split("\n## ").next().unwrap();
    section
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let (answer, path) = (cells.get(1)?, cells.get(2)?);
            let path = path.strip_prefix('`')?.strip_suffix('`')?;
            matches!(*answer, "rank" | "job").then(|| (answer.to_string(), path.to_string()))
        })
        .collect()
}

/// Whether `path` (dot-separated keys; `key[]` steps into a list's first
/// element) names a key in `v`; the value may be null.
fn json_path_exists(v: &serde_json::Value, path: &str) -> bool {
    let mut cur = v;
    for part in path.split('.') {
        let (key, list) = match part.strip_suffix("[]") {
            Some(k) => (k, true),
            None => (part, false),
        };
        let Some(next) = cur.as_object().and_then(|o| o.get(key)) else {
            return false;
        };
        cur = next;
        if list {
            match cur.as_array().and_then(|a| a.first()) {
                Some(first) => cur = first,
                None => return false,
            }
        }
    }
    true
}

/// `fake-gpu lib-path` needs no state directory; the other actions say
/// clearly that they do.
#[test]
fn fake_gpu_lib_path_needs_no_dir_and_the_others_say_they_do() {
    let stdout = stdout_of(
        std::process::Command::new(BIN)
            .args(["fake-gpu", "lib-path"])
            .env_remove(fake_nvml::STATE_DIR_ENV),
        "fake-gpu lib-path",
    );
    assert!(
        std::path::Path::new(stdout.trim()).is_file(),
        "not a file: {stdout}"
    );
    let stderr = stderr_of_failure(
        std::process::Command::new(BIN)
            .args(["fake-gpu", "show"])
            .env_remove(fake_nvml::STATE_DIR_ENV),
    );
    assert!(
        stderr.contains("--dir (or STEPWATCH_FAKE_NVML_DIR) is required"),
        "{stderr}"
    );
}

/// A job that leaks after step 2 (`total_loss += loss`: 200 MiB more held
/// at every step end) is told on its stream once, when the 16th step from
/// step 3 on (step 18) has ended, with the rate and the step at which the
/// GPU will be full; `/metrics` shows the slope and the forecast that
/// `StepwatchMemoryGrowthOOMForecast` alerts on. A step a second; markers
/// only (their times are long before the sampler's, so no NVML peaks): the
/// level is the reserved peak, and the GPU's capacity the fake H100's
/// 81047 MiB usable.
#[test]
fn memory_growth_after_step_2_is_advised_on_the_stream_and_forecast_in_metrics() {
    use common::wire::*;
    use stepwatch_proto::v1::{AdvisoryKind, AllocatorStats, Severity};

    const STEPS: u64 = 40;
    let agent = Agent::start("leaky", 1);
    let labels = [("training_job", "leaky"), ("rank", "0")];
    let held = |n: u64| 20_480 * MIB + 200 * MIB * n;
    let leaking = |n: u64| -> Vec<_> {
        let t0 = n * 1_000_000_000;
        let mut markers = step(n, t0);
        for m in markers.iter_mut() {
            m.allocator = Some(AllocatorStats {
                allocated_bytes: held(n),
                allocated_peak_bytes: held(n) + 10_240 * MIB,
                reserved_bytes: held(n) + 2_048 * MIB,
                reserved_peak_bytes: held(n) + 2_048 * MIB,
                ..Default::default()
            });
        }
        markers
    };
    // The sampler has read the GPU's capacity before the first marker.
    agent.wait_metrics("the GPU sampled", Duration::from_secs(20), |m| {
        m.get("stepwatch_gpu_memory_total_bytes", &[("gpu", "0")])
            .is_some()
    });
    let mut messages = vec![hello("leaky", 0, 1)];
    messages.extend((1..=STEPS).map(|n| batch(leaking(n))));
    let got = agent.accepts("a well-formed stream", messages);
    let advisories = wire::warnings(got);
    assert_eq!(advisories.len(), 1, "{advisories:?}");
    let a = &advisories[0];
    assert_eq!(a.kind, AdvisoryKind::MemoryGrowth as i32);
    assert_eq!((a.step, a.severity), (18, Severity::Warning as i32));
    // 200 MiB = 209.7 MB; at step 18 the reserved peak is 26128 MiB, and
    // (81047 − 26128) / 200 = 274.6 steps to go: step 293.
    for words in [
        "memory grows by 209.7 MB per step",
        "steps 3–18",
        "at about step 293, in about 4 min",
        "total_loss += loss",
    ] {
        assert!(a.message.contains(words), "{words:?} not in {}", a.message);
    }
    // The true OOM step: the first whose reserved peak passes capacity.
    let capacity = 81_047 * MIB;
    let true_oom = (1..).find(|&n| held(n) + 2_048 * MIB > capacity).unwrap();
    let m = agent.wait_metrics("the forecast", Duration::from_secs(10), |m| {
        m.get("stepwatch_rank_memory_forecast_oom_step", &labels)
            .is_some()
    });
    let step = m.value("stepwatch_rank_memory_forecast_oom_step", &labels);
    let seconds = m.value("stepwatch_rank_memory_forecast_oom_seconds", &labels);
    let slope = m.value(
        "stepwatch_rank_memory_growth_bytes_per_step",
        &[
            ("training_job", "leaky"),
            ("rank", "0"),
            ("source", "allocated"),
        ],
    );
    println!(
        "slope {slope} B/step (true {}); forecast step {step}, true {true_oom}; {seconds} s",
        200 * MIB
    );
    assert_eq!(slope, (200 * MIB) as f64);
    assert_eq!(step, true_oom as f64);
    // From step 40's end, a step a second.
    assert_eq!(seconds, (true_oom - STEPS) as f64);
    assert_eq!(
        m.get(
            "stepwatch_rank_trailing_step_peak_max_bytes",
            &[
                ("training_job", "leaky"),
                ("rank", "0"),
                ("source", "reserved")
            ]
        ),
        Some((held(STEPS) + 2_048 * MIB) as f64)
    );
    assert_eq!(
        m.get(
            "stepwatch_advisories_sent_total",
            &[("kind", "ADVISORY_KIND_MEMORY_GROWTH")]
        ),
        Some(1.0)
    );
}

/// After step 2 with batches that vary and passes between steps: 40 steps
/// of 50 ms on the real clock, each batch (512 to 2048 tokens) said on its
/// forward marker and needing 1 GiB of activations per 512 tokens, an
/// evaluation pass after steps 10 and 30 that reserves 3 GiB more than any
/// step, and a checkpoint after step 20; the client says its loader's
/// largest batch is 65536 tokens. The rank report (`passes`, `batches`)
/// and `/metrics` give the passes' peaks and headroom apart from the
/// steps, the largest batch seen with its peak, and the loader's largest
/// batch's outlook, which does not fit the 80 GB GPU. Wiring: the figures
/// are made up, NVML's is the fake GPU's constant use.
#[test]
fn passes_and_batches_are_reported_apart_from_the_steps() {
    use common::wire::*;
    use stepwatch_proto::v1::client_message::Kind;
    use stepwatch_proto::v1::{AllocatorStats, BatchFacts, MarkerKind, ModelFacts};

    const GIB: u64 = 1 << 30;
    const MS: u64 = 1_000_000;
    const STEPS: u64 = 40;
    let agent = Agent::start("passes", 1);
    let used = 40 * GIB;
    agent.fake.set_process_memory(0, 4242, used).unwrap();
    let t0 = stepwatch_proto::clock::monotonic_ns();
    let held = 20 * GIB;
    let tokens = |n: u64| [512, 1_024, 2_048, 1_024][n as usize % 4];
    let stats = |allocated: u64, reserved: u64| AllocatorStats {
        allocated_bytes: allocated,
        allocated_peak_bytes: allocated,
        reserved_bytes: reserved,
        reserved_peak_bytes: reserved,
        ..Default::default()
    };
    let step_at = |n: u64| t0 + (n - 1) * 50 * MS;
    let mut messages = vec![hello("passes", 0, 1)];
    if let Some(Kind::Hello(h)) = messages[0].kind.as_mut() {
        h.model = Some(ModelFacts {
            largest_batch: Some(BatchFacts {
                tokens: Some(65_536),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    for n in 1..=STEPS {
        let b = step_at(n);
        let activations = tokens(n) / 512 * GIB;
        let mut markers = step(n, b);
        for (i, m) in markers.iter_mut().enumerate() {
            m.monotonic_ns = b + i as u64 * 6 * MS;
            m.wall_ns = m.monotonic_ns;
            let kind = MarkerKind::try_from(m.kind).unwrap();
            let allocated = if kind == MarkerKind::BackwardBegin {
                held + activations
            } else {
                held
            };
            m.allocator = Some(stats(allocated, held + 5 * GIB));
            if kind == MarkerKind::ForwardBegin {
                m.batch = Some(BatchFacts {
                    tokens: Some(tokens(n)),
                    ..Default::default()
                });
            }
        }
        let end = b + 35 * MS;
        if n == 10 || n == 30 {
            let mut begin = marker(MarkerKind::EvalBegin, n, end);
            begin.allocator = Some(stats(held, held + 5 * GIB));
            let mut finish = marker(MarkerKind::EvalEnd, n, end + 10 * MS);
            finish.allocator = Some(AllocatorStats {
                allocated_peak_bytes: held + 7 * GIB,
                reserved_peak_bytes: held + 8 * GIB,
                ..stats(held, held + 8 * GIB)
            });
            markers.extend([begin, finish]);
        }
        if n == 20 {
            let mut begin = marker(MarkerKind::CheckpointBegin, n, end);
            begin.allocator = Some(stats(held, held + 5 * GIB));
            markers.push(begin);
        }
        messages.push(batch(markers));
    }
    // Send once the sampler has read the GPU through the steps' span, so
    // that their samples are in the agent's window when the markers come.
    let span_end = step_at(STEPS) + 50 * MS;
    agent.wait_metrics("samples past the steps", Duration::from_secs(30), |m| {
        m.get("stepwatch_gpu_memory_used_bytes", &[("gpu", "0")]) == Some(used as f64)
            && stepwatch_proto::clock::monotonic_ns() > span_end
    });
    agent.accepts("a well-formed stream", messages);

    let report = poll("the rank's batches", Duration::from_secs(10), || {
        common::rank_report(&agent, "passes", 0).filter(|r| r["batches"]["largest"].is_object())
    });
    let batches = &report["batches"];
    assert_eq!(batches["largest"]["batch"]["tokens"], 2_048, "{batches}");
    assert_eq!(batches["largest"]["allocated_peak_bytes"], held + 4 * GIB);
    assert_eq!(batches["relation"]["unit"], "tokens");
    assert_eq!(batches["relation"]["bytes_per_unit"], (GIB / 512) as f64);
    assert_eq!(batches["loader_largest"]["tokens"], 65_536);
    let outlook = &batches["outlook"];
    // 2048 → 65536 tokens: 124 GiB more allocated than the 24 GiB seen.
    assert_eq!(outlook["allocated_peak_bytes"], held + 128 * GIB);
    let outlook_peak = outlook["device_peak_bytes"]
        .as_u64()
        .expect("a device peak");
    assert!(outlook_peak >= held + 128 * GIB, "{outlook}");
    assert!(outlook["headroom_bytes"].as_i64().unwrap() < 0, "{outlook}");
    // The spread of the step peaks (allocated: 21 to 24 GiB).
    let trailing = &report["memory_trend"]["trailing"];
    assert_eq!(trailing["allocated_min_bytes"], held + GIB);
    assert_eq!(trailing["allocated_max_bytes"], held + 4 * GIB);

    let passes = report["passes"].as_array().unwrap();
    assert_eq!(passes.len(), 2, "{passes:?}");
    let eval = &passes[0];
    assert_eq!(eval["kind"], "evaluation");
    assert_eq!(eval["begun"], 2);
    assert_eq!(eval["highest"]["allocated_peak_bytes"], held + 7 * GIB);
    assert_eq!(eval["highest"]["reserved_peak_bytes"], held + 8 * GIB);
    let eval_peak = eval["highest"]["device_peak_bytes"].as_u64().unwrap();
    assert!(eval_peak >= held + 8 * GIB, "{eval}");
    assert_eq!(passes[1]["kind"], "checkpoint");
    assert_eq!(passes[1]["latest"]["after_step"], 20);
    // The steps' figures know nothing of the passes: the reserved max is a
    // step's.
    assert_eq!(trailing["reserved_max_bytes"], held + 5 * GIB);

    let labels = [("training_job", "passes"), ("rank", "0")];
    let m = agent.wait_metrics("the outlook", Duration::from_secs(10), |m| {
        m.get("stepwatch_rank_batch_outlook_headroom_bytes", &labels)
            .is_some()
    });
    let capacity = m
        .get("stepwatch_rank_gpu_capacity_bytes", &labels)
        .expect("capacity");
    let eval_labels = [
        ("training_job", "passes"),
        ("rank", "0"),
        ("kind", "evaluation"),
    ];
    let (outlook, eval) = (outlook_peak as f64, eval_peak as f64);
    for (name, labels, expected) in [
        (
            "stepwatch_rank_batch_outlook_peak_bytes",
            &labels[..],
            outlook,
        ),
        (
            "stepwatch_rank_batch_outlook_headroom_bytes",
            &labels[..],
            capacity - outlook,
        ),
        ("stepwatch_rank_pass_peak_bytes", &eval_labels[..], eval),
        (
            "stepwatch_rank_pass_headroom_bytes",
            &eval_labels[..],
            capacity - eval,
        ),
    ] {
        assert_eq!(m.get(name, labels), Some(expected), "{name}");
    }
    assert!(m
        .get("stepwatch_rank_batch_largest_peak_bytes", &labels)
        .is_some());
    // The reference's pass and batch paths, which the simulated job of
    // a_step2_oom_is_advised_during_step_1 cannot show, are in this answer.
    let pass_and_batch_paths: Vec<_> = documented_json_paths()
        .into_iter()
        .filter(|(answer, path)| {
            answer == "rank" && (path.starts_with("passes") || path.starts_with("batches"))
        })
        .collect();
    assert!(pass_and_batch_paths.len() >= 2, "{pass_and_batch_paths:?}");
    for (_, path) in &pass_and_batch_paths {
        assert!(json_path_exists(&report, path), "{path} not in {report}");
    }
}
