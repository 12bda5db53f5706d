//! The cluster view on sharded Prometheus: four agents on fake
//! NVML, two Prometheus servers in agent mode each scraping half of them
//! (`hashmod` relabelling), remote-writing to a central Prometheus that
//! evaluates the shipped rules. One 4-rank job (rank0-skew: rank 0 runs out
//! of memory at step 2, the others fit) has two ranks on each shard's
//! agents, so every job-level figure needs series that arrived through both.
//! The central server's figures are checked against the agents' own
//! `/metrics`, by hand: max, min, median, divergence, the outlier rank,
//! the OOM-risk count and the worst headroom; the per-rank step-2 alert
//! fires for rank 0 alone and the job-level divergence alert is pending for
//! the job, once (the shards' `shard` external label does not split it).
//! The ranks are held before step 2 (`stepwatch sim --hold-before-step`)
//! until then: the step-2 alert holds only while its rank is connected and
//! short of step 2.
//!
//! Depends on these names of deploy/prometheus/stepwatch-rules.yml: the
//! recording rules `stepwatch_job:*` and `stepwatch_job_rank:*` used below
//! and the alerts `StepwatchStep2OOMPredicted` and `StepwatchFirstStepDivergence`.
//!
//! The rule groups' intervals are shortened to 1 s in a copy of the rule
//! file (the expressions are the shipped ones), so the test takes seconds
//! rather than the recording group's 30 s.
//!
//! Needs `prometheus` on PATH (Debian package `prometheus`; scripts/test
//! installs it).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use fake_nvml::GpuSpec;

/// Capacity of the scenario's GPU (a 48 GB card).
const CAPACITY: u64 = 48_305_799_168;
const JOB: &str = "gpt-skew-sharded";
const SHARDS: usize = 2;
/// Node names and the shard `hashmod` (md5 of the name, modulo 2) gives each:
/// node-a and node-c land on shard 0, node-b and node-d on shard 1. The test
/// checks the split from each shard's target list rather than trusting it.
const NODES: [(&str, usize); 4] = [("node-a", 0), ("node-b", 1), ("node-c", 0), ("node-d", 1)];

/// The shipped rule file with every group evaluated each second.
fn fast_rules(dir: &std::path::Path) -> PathBuf {
    let shipped = std::fs::read_to_string(repo().join("deploy/prometheus/stepwatch-rules.yml"))
        .expect("the shipped rule file");
    let mut changed = 0;
    let text: Vec<String> = shipped
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("interval:") {
                changed += 1;
                let indent = &l[..l.len() - l.trim_start().len()];
                format!("{indent}interval: 1s")
            } else {
                l.to_owned()
            }
        })
        .collect();
    assert!(changed >= 1, "no group interval in the rule file");
    let path = dir.join("stepwatch-rules-1s.yml");
    std::fs::write(&path, text.join("\n") + "\n").unwrap();
    path
}

/// Agent-mode config of shard `shard`: every agent listed, each target with
/// its node name in `__tmp_node`, kept when md5(node) mod SHARDS is `shard`.
fn shard_config(shard: usize, central: std::net::SocketAddr, targets: &[(String, &str)]) -> String {
    let mut config = format!(
        "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n  external_labels: {{shard: \"{shard}\"}}\n\
         scrape_configs:\n  - job_name: stepwatch\n    honor_labels: false\n    static_configs:\n"
    );
    for (addr, node) in targets {
        config +=
            &format!("      - targets: [\"{addr}\"]\n        labels: {{__tmp_node: {node}}}\n");
    }
    config += &format!(
        "    relabel_configs:\n\
         \x20     - {{source_labels: [__tmp_node], modulus: {SHARDS}, target_label: __tmp_hash, action: hashmod}}\n\
         \x20     - {{source_labels: [__tmp_hash], regex: \"{shard}\", action: keep}}\n\
         remote_write:\n  - url: http://{central}/api/v1/write\n    queue_config: {{batch_send_deadline: 200ms}}\n"
    );
    config
}

/// One figure of one rank from its agent's /metrics.
fn agent_figure(agent: &Agent, name: &str, rank: u32) -> f64 {
    let m = Metrics(agent.metrics());
    m.get(name, &[("training_job", JOB), ("rank", &rank.to_string())])
        .unwrap_or_else(|| panic!("{name} of rank {rank} missing on its agent:\n{}", m.0))
}

/// Prometheus's quantile(0.5): linear interpolation between the middle values.
fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let rank = 0.5 * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

/// The alerts named `name` in `state`, as their label maps, once there is
/// one (within 20 s).
fn wait_alerts(prom: &Prometheus, name: &str, state: &str) -> Vec<BTreeMap<String, String>> {
    let what = format!("{name} {state}");
    poll(&what, Duration::from_secs(20), || {
        let data = prom.api("/api/v1/alerts").expect("GET /api/v1/alerts");
        let alerts: Vec<BTreeMap<String, String>> = data["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["labels"]["alertname"] == name && a["state"] == state)
            .map(|a| {
                a["labels"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned()))
                    .collect()
            })
            .collect();
        (!alerts.is_empty()).then_some(alerts)
    })
}

#[test]
fn a_job_across_shards_gets_its_job_figures_and_alerts_centrally() {
    Prometheus::require();
    let t0 = Instant::now();
    let mut world = Cluster::default();
    for (node, _) in NODES {
        let spec = GpuSpec {
            total_bytes: CAPACITY,
            ..GpuSpec::h100_80gb(0)
        };
        let agent = Agent::start_node(&format!("shard-{node}"), node, &[spec], None, &[], |_| {});
        world.agents.push((node, agent));
    }
    for (_, agent) in &world.agents {
        agent.wait_for("/readyz", 200, Duration::from_secs(20));
    }

    // The central server: remote-write receiver, the shipped rules.
    let dir = TempDir::new("sharded-rules");
    let rules = fast_rules(&dir.0);
    let central_config = format!(
        "global:\n  evaluation_interval: 1s\nrule_files:\n  - {}\n",
        rules.display()
    );
    let central = Prometheus::start_as(
        "prom-central",
        &central_config,
        PrometheusRole::RemoteWriteReceiver,
    );
    let central_addr = central.addr;
    world.proms.push(("central".into(), central));
    let targets = world.targets();
    for shard in 0..SHARDS {
        let config = shard_config(shard, central_addr, &targets);
        let prom = Prometheus::start_as(
            &format!("prom-shard-{shard}"),
            &config,
            PrometheusRole::Agent,
        );
        world.proms.push((format!("shard {shard}"), prom));
    }

    // Each shard scrapes the agents hashmod gives it, and only those.
    let address_node: BTreeMap<String, &str> = targets.iter().cloned().collect();
    for shard in 0..SHARDS {
        let prom = world.prom(&format!("shard {shard}"));
        let scraped: BTreeSet<&str> = poll(
            "each shard's targets to be up",
            Duration::from_secs(20),
            || {
                let data = prom.api("/api/v1/targets?state=active").ok()?;
                let active = data["activeTargets"].as_array()?.clone();
                let nodes: BTreeSet<&str> = active
                    .iter()
                    .filter(|t| t["health"] == "up")
                    .map(|t| address_node[t["labels"]["instance"].as_str().unwrap()])
                    .collect();
                (nodes.len() == active.len() && !nodes.is_empty()).then_some(nodes)
            },
        );
        let expected: BTreeSet<&str> = NODES
            .iter()
            .filter(|(_, s)| *s == shard)
            .map(|(n, _)| *n)
            .collect();
        assert_eq!(scraped, expected, "shard {shard} scrapes {scraped:?}");
    }
    eprintln!("agents and shards up after {:?}", t0.elapsed());

    // One job, one rank per node: ranks 0 and 2 on shard 0, 1 and 3 on shard 1.
    // Each rank is held before step 2, so that it is still connected and
    // short of step 2 while the central server evaluates its alerts (the
    // step-2 alert ends when the rank is gone or its step 2 passed).
    let scenario = repo().join("crates/stepwatch-sim/scenarios/rank0-skew.json");
    let release = world.prom("central").dir.0.join("release-step-2");
    let hold = hold_before_step_2(&release);
    for (rank, (_, agent)) in world.agents.iter().enumerate() {
        let child = agent.sim(
            scenario.to_str().unwrap(),
            JOB,
            rank as u32,
            0,
            4,
            1.0,
            &hold,
        );
        world.sims.push((rank as u32, child));
    }
    // Step 1 has ended on every rank; a rank report drains the sampler's
    // pending samples first, so the figures read after it are final.
    for (rank, (_, agent)) in world.agents.iter().enumerate() {
        poll(
            &format!("rank {rank}'s step 1 to end"),
            Duration::from_secs(60),
            || {
                let report = rank_report(agent, JOB, rank as u32)?;
                let step1 = report["steps"]
                    .as_array()?
                    .iter()
                    .find(|s| s["step"].as_u64() == Some(1))?
                    .clone();
                (step1["outcome"] != "running").then_some(())
            },
        );
    }
    eprintln!("ranks held before step 2 after {:?}", t0.elapsed());

    // The agents' figures: what the central server must reproduce.
    let per_rank = |name: &str| -> Vec<f64> {
        world
            .agents
            .iter()
            .enumerate()
            .map(|(rank, (_, a))| agent_figure(a, name, rank as u32))
            .collect()
    };
    let peaks = per_rank("stepwatch_rank_first_step_peak_bytes");
    let headrooms = per_rank("stepwatch_rank_predicted_headroom_bytes");
    let risks = per_rank("stepwatch_rank_oom_risk");
    eprintln!("agents: step-1 peaks {peaks:?}, headroom {headrooms:?}, OOM risk {risks:?}");
    let max = peaks.iter().cloned().fold(f64::MIN, f64::max);
    let min = peaks.iter().cloned().fold(f64::MAX, f64::min);
    let med = median(&peaks);
    assert_eq!(peaks[0], max, "rank 0 holds the most memory: {peaks:?}");
    assert!(
        headrooms[0] < 0.0,
        "rank 0's step 2 does not fit: {headrooms:?}"
    );

    // Wait until the central server holds every rank's final figures, then
    // for a rule evaluation after that.
    let central = world.prom("central");
    poll(
        "the agents' step-1 peaks in the central server, through both shards",
        Duration::from_secs(30),
        || {
            let v = central.vector(&format!(
                r#"stepwatch_rank_first_step_peak_bytes{{training_job="{JOB}"}}"#
            ));
            let got: BTreeMap<u32, (f64, String)> = v
                .iter()
                .map(|s| {
                    let rank = label(s, "rank").parse().unwrap();
                    (rank, (sample(s), label(s, "shard").to_owned()))
                })
                .collect();
            let want: BTreeMap<u32, (f64, String)> = (0..4)
                .map(|r| (r, (peaks[r as usize], NODES[r as usize].1.to_string())))
                .collect();
            (got == want).then_some(())
        },
    );
    let arrived = now_s();
    let job_sel = format!(r#"{{training_job="{JOB}"}}"#);
    poll(
        "a recording-rule evaluation after the last figures arrived",
        Duration::from_secs(20),
        || {
            let v = central.vector(&format!(
                "timestamp(stepwatch_job:first_step_peak_bytes:max{job_sel})"
            ));
            (sample(v.first()?) > arrived).then_some(())
        },
    );
    // One series for the job, whatever the shard.
    let recorded = |name: &str| central.single(&format!("{name}{job_sel}"));
    assert_eq!(recorded("stepwatch_job:ranks_reporting:count"), 4.0);
    assert_eq!(recorded("stepwatch_job:first_step_peak_bytes:max"), max);
    assert_eq!(recorded("stepwatch_job:first_step_peak_bytes:min"), min);
    assert_eq!(recorded("stepwatch_job:first_step_peak_bytes:median"), med);
    let divergence = recorded("stepwatch_job:first_step_peak_divergence_ratio");
    let expected = (max - min) / med;
    assert!(
        (divergence - expected).abs() <= 1e-12 * expected,
        "divergence {divergence}, by hand {expected}"
    );
    assert!(divergence > 0.1, "rank0-skew diverges: {divergence}");
    assert_eq!(
        recorded("stepwatch_job:predicted_headroom_bytes:min"),
        headrooms.iter().cloned().fold(f64::MAX, f64::min)
    );
    assert_eq!(
        recorded("stepwatch_job:oom_risk_ranks:sum"),
        risks.iter().sum::<f64>()
    );
    let outliers = central.ranks_and_nodes(&format!(
        "stepwatch_job_rank:first_step_peak_outlier{job_sel} == 1"
    ));
    let expected_outliers: Vec<(String, String)> = peaks
        .iter()
        .enumerate()
        .filter(|(_, p)| ((*p - med) / med).abs() > 0.1)
        .map(|(r, _)| (r.to_string(), NODES[r].0.to_owned()))
        .collect();
    assert!(expected_outliers.contains(&("0".to_owned(), "node-a".to_owned())));
    assert_eq!(outliers, expected_outliers);

    // Alerts: step-2 OOM firing for rank 0 alone, on node-a; the job's
    // divergence alert pending (its `for` is 10 m) exactly once.
    let oom = wait_alerts(central, "StepwatchStep2OOMPredicted", "firing");
    let oom: Vec<(&str, &str)> = oom
        .iter()
        .filter(|l| l["training_job"] == JOB)
        .map(|l| (l["rank"].as_str(), l["node"].as_str()))
        .collect();
    assert_eq!(oom, [("0", "node-a")]);
    let divergence_alerts = wait_alerts(central, "StepwatchFirstStepDivergence", "pending");
    assert_eq!(divergence_alerts.len(), 1, "{divergence_alerts:?}");
    assert_eq!(divergence_alerts[0]["training_job"], JOB);
    assert!(
        !divergence_alerts[0].contains_key("shard"),
        "{divergence_alerts:?}"
    );
    std::fs::write(&release, b"").unwrap();
    for (rank, mut child) in std::mem::take(&mut world.sims) {
        let status = child.wait().unwrap();
        if rank == 0 {
            assert_eq!(status.code(), Some(3), "rank 0 should die of its OOM");
        } else {
            assert!(status.success(), "rank {rank} failed: {status}");
        }
    }
    eprintln!("test took {:?}", t0.elapsed());
}
