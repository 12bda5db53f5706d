//! End to end across "nodes": three agents on fake NVML, one simulated
//! 4-rank job spread over them (rank0-skew: rank 0 runs out of memory at step
//! 2, the others fit), and a real Prometheus scraping the agents with the
//! shipped rule file. What an operator sees: the step-2 OOM alert firing for
//! rank 0 during step 1, the cross-node recording rules naming rank 0 as the
//! step-1 outlier, and every rule and dashboard expression answering.
//!
//! The ranks are held before step 2 (`stepwatch sim --hold-before-step`)
//! until the test has seen the alert fire, so that "before step 2" does not
//! depend on how fast a loaded machine scrapes and evaluates: the alert
//! must come from step 1's data alone. The recording rules' group interval
//! (30 s, as shipped) dominates the run time: 25-45 s.
//!
//! Needs `prometheus` on PATH (Debian package `prometheus`; scripts/test
//! installs it).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use fake_nvml::GpuSpec;
use serde_json::Value;

/// Capacity of the scenario's GPU (a 48 GB card).
const CAPACITY: u64 = 48_305_799_168;
const JOB: &str = "gpt-skew-multinode";
const ALERT: &str = "StepwatchStep2OOMPredicted";
/// Run ten times slower than the scenario's timings.
const SPEED: f64 = 0.1;
const STEPS: u64 = 4;
/// Resolution of the dashboards' range queries.
const RANGE_STEP_S: f64 = 1.0;

/// The `metric_relabel_configs` of the Kubernetes scrape job in
/// deploy/prometheus/prometheus-example.yml, as its YAML lines (indented
/// for a scrape job's keys). deploy/test.sh checks that the chart's
/// ServiceMonitor carries the same rules.
fn shipped_metric_relabel_configs() -> String {
    let example =
        std::fs::read_to_string(repo().join("deploy/prometheus/prometheus-example.yml")).unwrap();
    let mut lines = example
        .lines()
        .skip_while(|l| l.trim_end() != "    metric_relabel_configs:");
    let mut block = vec![lines
        .next()
        .expect("the example has metric_relabel_configs")];
    block.extend(lines.take_while(|l| l.starts_with("      ") || l.trim().is_empty()));
    let block = block.join("\n");
    assert!(block.contains("exported_namespace"), "{block}");
    block + "\n"
}

/// A scrape config like the one the Prometheus Operator makes of the
/// chart's ServiceMonitor: each agent a target with its pod's labels
/// (namespace `stepwatch`, pod `stepwatch-<node>`, container `agent`),
/// `honor_labels: false`, and the shipped metric relabelling.
fn kubernetes_scrape_config(rules: &std::path::Path, targets: &[(String, &str)]) -> String {
    let mut config = format!(
        "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n  evaluation_interval: 500ms\n\
         rule_files:\n  - {}\n\
         scrape_configs:\n  - job_name: stepwatch\n    honor_labels: false\n    static_configs:\n",
        rules.display()
    );
    for (addr, node) in targets {
        config += &format!(
            "      - targets: [\"{addr}\"]\n        labels: {{namespace: stepwatch, pod: stepwatch-{node}, container: agent}}\n"
        );
    }
    config + &shipped_metric_relabel_configs()
}

/// Wall-clock begin and (once complete) end of `step` in a rank report, in seconds.
fn step_wall_s(report: &Value, step: u64) -> Option<(f64, Option<f64>)> {
    let s = report["steps"]
        .as_array()?
        .iter()
        .find(|s| s["step"].as_u64() == Some(step))?;
    let begin = s["begin_wall_ns"].as_u64()? as f64 / 1e9;
    Some((begin, s["duration_seconds"].as_f64().map(|d| begin + d)))
}

/// Parses Prometheus's RFC 3339 timestamps ("2024-05-01T10:00:00.123456789Z").
fn rfc3339_s(t: &str) -> f64 {
    let (date, time) = t.split_once('T').expect("RFC 3339 time");
    let ymd: Vec<i64> = date.split('-').map(|x| x.parse().unwrap()).collect();
    let time = time.trim_end_matches('Z');
    assert!(
        !time.contains('+') && !time.contains('-'),
        "expected UTC time, got {t}"
    );
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let hms: Vec<i64> = hms.split(':').map(|x| x.parse().unwrap()).collect();
    // Days from civil (H. Hinnant).
    let (y, m, d) = (ymd[0], ymd[1], ymd[2]);
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hms[0] * 3600 + hms[1] * 60 + hms[2];
    secs as f64 + format!("0.{frac}").parse::<f64>().unwrap()
}

/// Firing alerts named `name`, as (labels, activeAt seconds).
fn firing(prom: &Prometheus, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let data = prom.api("/api/v1/alerts").expect("GET /api/v1/alerts");
    data["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["labels"]["alertname"] == name && a["state"] == "firing")
        .map(|a| {
            let labels = a["labels"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned()))
                .collect();
            (labels, rfc3339_s(a["activeAt"].as_str().unwrap()))
        })
        .collect()
}

/// Replaces Grafana variables ($name, ${name}, ${name:fmt}) in a dashboard
/// expression; `$1` (label_replace) stays.
fn substitute(expr: &str) -> String {
    let value = |name: &str| -> Option<&str> {
        Some(match name {
            "training_job" => JOB,
            "cluster" | "namespace" | "node" | "rank" | "gpu" => ".*",
            "agent_job" => ".*stepwatch.*",
            "__rate_interval" => "1m",
            "__interval" => "15s",
            "__range" => "1h",
            _ => return None,
        })
    };
    let mut out = String::new();
    let mut rest = expr;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (name, len) = if let Some(braced) = after.strip_prefix('{') {
            let end = braced.find('}').expect("closing brace of a ${variable}");
            let name = braced[..end].split(':').next().unwrap();
            (name, end + 2)
        } else {
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            (&after[..end], end)
        };
        match value(name) {
            Some(v) => out.push_str(v),
            None => {
                assert!(
                    name.chars().all(|c| c.is_ascii_digit()),
                    "unknown Grafana variable ${name} in {expr}"
                );
                out.push('$');
                out.push_str(name);
            }
        }
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

/// `label_values(selector, label)` (a Grafana variable query) as PromQL.
fn label_values_as_promql(query: &str) -> String {
    let inner = query
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
        .unwrap_or_else(|| panic!("unsupported variable query {query}"));
    let (selector, label) = inner.rsplit_once(',').unwrap();
    format!("count by ({}) ({selector})", label.trim())
}

/// A dashboard query target: panel title, expression, range or instant.
struct Target {
    dashboard: String,
    panel: String,
    expr: String,
    range: bool,
}

fn collect_targets(dashboard: &str, panels: &[Value], out: &mut Vec<Target>) {
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or("").to_owned();
        for t in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = t["expr"].as_str() {
                out.push(Target {
                    dashboard: dashboard.to_owned(),
                    panel: title.clone(),
                    expr: expr.to_owned(),
                    range: t["range"].as_bool().unwrap_or(true) && t["instant"] != true,
                });
            }
        }
        if let Some(inner) = panel["panels"].as_array() {
            collect_targets(dashboard, inner, out);
        }
    }
}

fn result_len(data: &Value) -> usize {
    match &data["result"] {
        Value::Array(a) => a.len(),
        Value::Null => 0,
        _ => 1, // scalar or string
    }
}

#[test]
fn multinode_job_alerts_before_step2_and_rules_and_dashboards_answer() {
    Prometheus::require();
    let t0 = Instant::now();
    let mut world = Cluster::default();

    // Three nodes: node-a has two GPUs (ranks 0 and 1), node-b and node-c one each.
    for (node, gpus) in [("node-a", 2), ("node-b", 1), ("node-c", 1)] {
        let specs: Vec<GpuSpec> = (0..gpus)
            .map(|i| GpuSpec {
                total_bytes: CAPACITY,
                ..GpuSpec::h100_80gb(i)
            })
            .collect();
        let agent = Agent::start_node(
            &format!("prom-{node}"),
            node,
            &specs,
            None,
            &["--max-window", "2s"],
            |_| {},
        );
        world.agents.push((node, agent));
    }
    for (_, agent) in &world.agents {
        agent.wait_ready_with_nvml();
    }

    // A real Prometheus with the shipped rules, scraping the three agents
    // as the chart's ServiceMonitor does (target labels of the agent pods,
    // honor_labels: false, the shipped metric relabelling).
    let rules = repo().join("deploy/prometheus/stepwatch-rules.yml");
    let config = kubernetes_scrape_config(&rules, &world.targets());
    world.proms.push((
        "server".into(),
        Prometheus::start("prom-multinode", &config),
    ));
    let prom = world.prom("server");
    poll(
        "Prometheus to scrape all three agents",
        Duration::from_secs(15),
        || {
            let up = prom.vector(r#"stepwatch_nvml_up == 1"#);
            let nodes: BTreeSet<&str> = up.iter().map(|s| label(s, "node")).collect();
            (nodes == BTreeSet::from(["node-a", "node-b", "node-c"])).then_some(())
        },
    );
    let start_s = now_s();
    eprintln!("agents and prometheus up after {:?}", t0.elapsed());

    // One job across the nodes: ranks 0, 1 on node-a, 2 on node-b, 3 on node-c.
    let placement = [
        (0, "node-a", 0),
        (1, "node-a", 1),
        (2, "node-b", 0),
        (3, "node-c", 0),
    ];
    let release = world.prom("server").dir.0.join("release-step-2");
    let hold = hold_before_step_2(&release);
    for (rank, node, gpu) in placement {
        let child = world
            .agent(node)
            .sim("rank0-skew", JOB, rank, gpu, STEPS, SPEED, &hold);
        world.sims.push((rank, child));
    }
    let prom = world.prom("server");
    let node_a = world.agent("node-a");

    // (a) The step-2 OOM alert fires for rank 0 while every rank is held
    // before step 2, then the ranks go on.
    let mut others_firing = Vec::new();
    let mut collect_others = |firing: &[(BTreeMap<String, String>, f64)]| {
        for (labels, _) in firing {
            if labels.get("training_job").map(String::as_str) == Some(JOB) && labels["rank"] != "0"
            {
                others_firing.push(labels.clone());
            }
        }
    };
    let (active_at, seen_at) = poll(
        "the step-2 OOM alert for rank 0",
        Duration::from_secs(60),
        || {
            let now_firing = firing(prom, ALERT);
            collect_others(&now_firing);
            let (labels, active_at) = now_firing.into_iter().find(|(l, _)| {
                l.get("training_job").map(String::as_str) == Some(JOB) && l["rank"] == "0"
            })?;
            assert_eq!(labels["node"], "node-a", "{labels:?}");
            Some((active_at, now_s()))
        },
    );
    let held = rank_report(node_a, JOB, 0).expect("rank 0 reported");
    assert!(
        step_wall_s(&held, 2).is_none(),
        "rank 0 was held before step 2, yet reported it: {held}"
    );
    std::fs::write(&release, b"").unwrap();
    let step2_begin = poll("rank 0's step 2", Duration::from_secs(30), || {
        collect_others(&firing(prom, ALERT));
        step_wall_s(&rank_report(node_a, JOB, 0)?, 2).map(|(begin, _)| begin)
    });
    let r0 = rank_report(node_a, JOB, 0).unwrap();
    let (step1_begin, _) = step_wall_s(&r0, 1).unwrap();
    eprintln!(
        "rank 0: step 1 began at +{:.2} s, {ALERT} active at +{:.2} s (seen at +{:.2} s), step 2 began at +{:.2} s",
        step1_begin - start_s,
        active_at - start_s,
        seen_at - start_s,
        step2_begin - start_s
    );
    assert!(
        active_at < step2_begin,
        "{ALERT} for rank 0 became active at {active_at:.3}, not before step 2 began at {step2_begin:.3}"
    );
    assert!(
        active_at > step1_begin - 1.0,
        "{ALERT} active at {active_at:.3} before the job started ({step1_begin:.3})"
    );

    // The ranks end: rank 0 dies of its OOM in step 2, the others finish.
    let mut step1_ends = Vec::new();
    for (rank, child) in std::mem::take(&mut world.sims) {
        let mut child = child;
        let status = child.wait().unwrap();
        let stderr = {
            let mut s = String::new();
            if let Some(mut e) = child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut s);
            }
            s
        };
        if rank == 0 {
            assert_eq!(status.code(), Some(3), "rank 0 should OOM: {stderr}");
            assert!(stderr.contains("died in step 2"), "{stderr}");
        } else {
            assert!(status.success(), "rank {rank} failed ({status}): {stderr}");
        }
        let node = placement[rank as usize].1;
        let report = rank_report(world.agent(node), JOB, rank).expect("rank report");
        let (_, end) = step_wall_s(&report, 1).expect("step 1 reported");
        step1_ends.push(end.expect("step 1 complete"));
    }
    let step1_done = step1_ends.iter().cloned().fold(0.0, f64::max);
    eprintln!("all ranks done after {:?}", t0.elapsed());

    // (b) Cross-node recording rules: wait for an evaluation (group
    // interval 30 s) that saw every rank's final step-1 peak, then check that
    // they name rank 0 as the outlier.
    let prom = world.prom("server");
    let evaluated_at = poll(
        "a recording-rule evaluation after every rank's step 1",
        Duration::from_secs(45),
        || {
            // timestamp() of a bare selector is the sample's (the
            // evaluation's) time; of any other expression, the query's.
            let count = format!(r#"stepwatch_job:ranks_reporting:count{{training_job="{JOB}"}}"#);
            let v = prom.vector(&format!("timestamp({count}) and ({count} == 4)"));
            // One scrape interval (and some) after step 1's end.
            let at = sample(v.first()?);
            (at > step1_done + 1.0).then_some(at)
        },
    );
    eprintln!("recording rules evaluated after {:?}", t0.elapsed());
    let peaks: BTreeMap<String, f64> = prom
        .vector(&format!(
            r#"stepwatch_rank_first_step_peak_bytes{{training_job="{JOB}"}}"#
        ))
        .iter()
        .map(|s| (label(s, "rank").to_owned(), sample(s)))
        .collect();
    eprintln!("step-1 peaks per rank: {peaks:?}");
    assert_eq!(peaks.len(), 4, "{peaks:?}");
    let max = peaks.values().cloned().fold(f64::MIN, f64::max);
    let min = peaks.values().cloned().fold(f64::MAX, f64::min);
    let job_sel = format!(r#"{{training_job="{JOB}"}}"#);
    let recorded = |name: &str| prom.single(&format!("{name}{job_sel}"));
    assert_eq!(recorded("stepwatch_job:first_step_peak_bytes:max"), max);
    assert_eq!(recorded("stepwatch_job:first_step_peak_bytes:min"), min);
    assert_eq!(peaks["0"], max, "rank 0 holds the most memory: {peaks:?}");
    let divergence = recorded("stepwatch_job:first_step_peak_divergence_ratio");
    let deviations: BTreeMap<String, f64> = prom
        .vector(&format!(
            "stepwatch_job_rank:first_step_peak_deviation_ratio{job_sel}"
        ))
        .iter()
        .map(|s| (label(s, "rank").to_owned(), sample(s)))
        .collect();
    eprintln!("divergence {divergence:.4}, deviation per rank {deviations:?}");
    let outliers = prom.ranks_and_nodes(&format!(
        "stepwatch_job_rank:first_step_peak_outlier{job_sel} == 1"
    ));
    assert_eq!(
        outliers,
        [("0".to_owned(), "node-a".to_owned())],
        "the outlier is rank 0 on node-a; deviations {deviations:?}"
    );
    let top = prom.vector(&format!(
        "topk(1, stepwatch_job_rank:first_step_peak_deviation_ratio{job_sel})"
    ));
    assert_eq!(top.len(), 1);
    assert_eq!(label(&top[0], "rank"), "0", "{top:?}");
    assert!(divergence > 0.1, "divergence {divergence}");

    // (c) Every rule: loaded, evaluated without error, and its expression
    // answers a query.
    let rules_text = std::fs::read_to_string(&rules).unwrap();
    let in_file = rules_text
        .lines()
        .filter(|l| {
            let l = l.trim_start();
            l.starts_with("- record:") || l.starts_with("- alert:")
        })
        .count();
    let groups = prom.api("/api/v1/rules").expect("GET /api/v1/rules");
    let mut loaded = 0;
    let mut failures = Vec::new();
    for group in groups["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            loaded += 1;
            let name = rule["name"].as_str().unwrap();
            let query = rule["query"].as_str().unwrap();
            if rule["health"] != "ok" {
                failures.push(format!(
                    "rule {name}: health {} ({})",
                    rule["health"], rule["lastError"]
                ));
            }
            if let Err(e) = prom.query(query) {
                failures.push(format!("rule {name}: {e}\n  {query}"));
            }
        }
    }
    assert_eq!(loaded, in_file, "rules loaded vs in {}", rules.display());

    // Every dashboard expression (and variable query) answers, over the
    // run as Grafana would ask for it; the main panels have data. A range
    // query's last step may lie up to one step before now: let one pass
    // since the recording rules' evaluation.
    poll(
        "one range step after the evaluation",
        Duration::from_secs(3),
        || (now_s() > evaluated_at + RANGE_STEP_S + 0.1).then_some(()),
    );
    let mut dashboards: Vec<PathBuf> = std::fs::read_dir(repo().join("dashboards"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    dashboards.sort();
    assert_eq!(dashboards.len(), 4, "{dashboards:?}");
    let main_panels: [(&str, &str); 8] = [
        (
            "node-gpu-memory",
            "GPU memory: high-water, last sample, capacity",
        ),
        (
            "step-anatomy",
            "Phase durations of the last completed step (mean over selected ranks)",
        ),
        (
            "step-anatomy",
            "Step peak per rank: first, steady, predicted, capacity",
        ),
        ("step-anatomy", "Predicted headroom per rank"),
        ("first-step-anomaly", "Step-1 peak per rank"),
        ("first-step-anomaly", "Step-1 peak max"),
        ("cluster-oom-risk", "Worst predicted headroom per job"),
        (
            "cluster-oom-risk",
            "Jobs ranked by worst predicted headroom",
        ),
    ];
    let mut main_seen = BTreeSet::new();
    let mut queries = 0;
    let mut empty = Vec::new();
    for path in &dashboards {
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut targets = Vec::new();
        collect_targets(&name, dash["panels"].as_array().unwrap(), &mut targets);
        for var in dash["templating"]["list"].as_array().unwrap() {
            if var["type"] == "query" {
                targets.push(Target {
                    dashboard: name.clone(),
                    panel: format!("variable {}", var["name"]),
                    expr: label_values_as_promql(var["query"]["query"].as_str().unwrap()),
                    range: false,
                });
            }
        }
        for t in targets {
            let expr = substitute(&t.expr);
            queries += 1;
            let answer = if t.range {
                prom.query_range(&expr, start_s - 5.0, RANGE_STEP_S)
            } else {
                prom.query(&expr)
            };
            let data = match answer {
                Ok(data) => data,
                Err(e) => {
                    failures.push(format!("{} / {}: {e}\n  {expr}", t.dashboard, t.panel));
                    continue;
                }
            };
            let main = main_panels.contains(&(t.dashboard.as_str(), t.panel.as_str()));
            let variable = t.panel.starts_with("variable ");
            if (main || variable) && result_len(&data) == 0 {
                failures.push(format!(
                    "{} / {}: no data\n  {expr}\n  {data}",
                    t.dashboard, t.panel
                ));
            }
            if result_len(&data) == 0 {
                empty.push(format!("{} / {}", t.dashboard, t.panel));
            }
            if main {
                main_seen.insert((t.dashboard.clone(), t.panel.clone()));
            }
        }
    }
    eprintln!("dashboard queries without data (nothing to show in this run): {empty:#?}");
    assert_eq!(
        main_seen.len(),
        main_panels.len(),
        "main panels not found in the dashboards: {main_seen:?}"
    );
    assert!(
        failures.is_empty(),
        "{} of {queries} dashboard queries and {loaded} rules failed:\n{}",
        failures.len(),
        failures.join("\n")
    );

    // (d) No step-2 OOM alert for ranks 1-3 at any time (they fit); the one
    // for rank 0 fired, and ended when rank 0 died, although the agent still
    // exports its negative prediction (kept for --retention).
    assert!(
        others_firing.is_empty(),
        "{ALERT} fired for {others_firing:?}"
    );
    let history = prom.vector(&format!(
        r#"count_over_time(ALERTS{{alertname="{ALERT}", training_job="{JOB}"}}[10m])"#
    ));
    let ranks: BTreeSet<&str> = history.iter().map(|s| label(s, "rank")).collect();
    assert_eq!(
        ranks,
        BTreeSet::from(["0"]),
        "{ALERT} was pending or firing for ranks {ranks:?}"
    );
    let still_predicted = prom.vector(&format!(
        r#"stepwatch_rank_predicted_headroom_bytes{{training_job="{JOB}", rank="0"}} < 0"#
    ));
    assert_eq!(still_predicted.len(), 1, "{still_predicted:?}");
    let now_firing: Vec<String> = firing(prom, ALERT)
        .into_iter()
        .map(|(l, _)| format!("{}/{}", l["training_job"], l["rank"]))
        .collect();
    assert!(
        now_firing.is_empty(),
        "{ALERT} still fires for the dead rank: {now_firing:?}"
    );
    // The observed OOM is reported instead, by its own alert.
    let oom = prom.vector(&format!(
        r#"stepwatch_rank_ooms_total{{training_job="{JOB}"}} > 0"#
    ));
    assert_eq!(oom.len(), 1, "{oom:?}");
    assert_eq!(label(&oom[0], "rank"), "0");
    let oom_alerts: Vec<String> = firing(prom, "StepwatchGPUOOMObserved")
        .into_iter()
        .map(|(l, _)| format!("{}/{}", l["training_job"], l["rank"]))
        .collect();
    assert_eq!(oom_alerts, [format!("{JOB}/0")]);

    eprintln!(
        "{queries} dashboard queries, {loaded} rules checked; test took {:?}",
        t0.elapsed()
    );
}

/// Scraped like any exporter (`honor_labels: false`, the agent pod's target
/// labels), a tenant's rank series keep the tenant's namespace, pod and
/// container, and the training job its own label; the agent's own series
/// keep the target's; no `exported_*` label is left.
#[test]
fn a_kubernetes_scrape_keeps_the_tenants_labels_and_the_agents_own() {
    Prometheus::require();
    let agent = Agent::start_node(
        "prom-relabel",
        "node-a",
        &[GpuSpec::h100_80gb(0)],
        None,
        &[],
        |_| {},
    );
    agent.wait_ready_with_nvml();
    // Outside Kubernetes here (no kubelet), the agent takes the client's claim.
    let mut hello = wire::hello("tenant-job", 0, 1);
    if let Some(stepwatch_proto::v1::client_message::Kind::Hello(h)) = &mut hello.kind {
        let id = h.identity.as_mut().unwrap();
        id.namespace = "team-a".into();
        id.pod = "trainer-0".into();
    }
    // A rank outside any namespace: it keeps the target's labels.
    let bare = wire::hello("bare-job", 0, 1);
    let endpoint = agent.endpoint();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for h in [hello, bare] {
        let t0 = stepwatch_proto::clock::monotonic_ns();
        rt.block_on(wire::exchange(
            &endpoint,
            vec![h, wire::batch(wire::step(1, t0))],
        ))
        .unwrap();
    }
    let rules = repo().join("deploy/prometheus/stepwatch-rules.yml");
    let config = kubernetes_scrape_config(&rules, &[(agent.http.to_string(), "node-a")]);
    let prom = Prometheus::start("prom-relabel", &config);
    let series = |expr: &str| -> Vec<BTreeMap<String, String>> {
        prom.vector(expr)
            .iter()
            .map(|s| {
                s["metric"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                    .collect()
            })
            .collect()
    };
    let tenant = poll("the tenant's rank scraped", Duration::from_secs(20), || {
        let v = series(r#"stepwatch_rank_steps_completed_total{training_job="tenant-job"}"#);
        (!v.is_empty()).then_some(v)
    });
    assert_eq!(tenant.len(), 1, "{tenant:?}");
    let t = &tenant[0];
    assert_eq!(t["namespace"], "team-a", "{t:?}");
    assert_eq!(t["pod"], "trainer-0", "{t:?}");
    // The client claimed no container: none, rather than the agent's.
    assert_eq!(t.get("container"), None, "{t:?}");
    assert_eq!(t["job"], "stepwatch", "{t:?}");
    assert_eq!(t["node"], "node-a", "{t:?}");
    // The tenant's alerts route by namespace.
    let by_ns = series(r#"stepwatch_rank_info{namespace="team-a"}"#);
    assert_eq!(by_ns.len(), 1, "{by_ns:?}");
    assert_eq!(by_ns[0]["training_job"], "tenant-job");
    // The agent's own series, and a rank that names no namespace, keep the
    // agent pod's target labels.
    for expr in [
        "stepwatch_nvml_up",
        r#"stepwatch_gpu_up{gpu="0"}"#,
        r#"stepwatch_rank_info{training_job="bare-job"}"#,
    ] {
        let v = series(expr);
        assert_eq!(v.len(), 1, "{expr}: {v:?}");
        let own = &v[0];
        assert_eq!(own["namespace"], "stepwatch", "{expr}: {own:?}");
        assert_eq!(own["pod"], "stepwatch-node-a", "{expr}: {own:?}");
        assert_eq!(own["container"], "agent", "{expr}: {own:?}");
        assert_eq!(own["job"], "stepwatch", "{expr}: {own:?}");
    }
    let renamed = prom.vector(r#"count({__name__=~"stepwatch_.+"}) by (exported_namespace, exported_pod, exported_container, exported_node, exported_job)"#);
    assert_eq!(renamed.len(), 1, "{renamed:?}");
    assert_eq!(
        renamed[0]["metric"].as_object().map(|m| m.len()),
        Some(0),
        "{renamed:?}"
    );
}
