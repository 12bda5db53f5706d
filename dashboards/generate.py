#!/usr/bin/env python3
"""Generates the stepwatch Grafana dashboards (dashboards/*.json) from one description.

The JSON files are committed and importable as they are (Grafana 10+; schemaVersion 39).
They use a `datasource` template variable instead of __inputs, so they work both through
Dashboards > Import and through file provisioning.

  python3 dashboards/generate.py           rewrite dashboards/*.json
  python3 dashboards/generate.py --check   exit 1 if a committed file differs

Standard library only.
"""

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
import generated_files  # noqa: E402 (found through the path above)

DS = {"type": "prometheus", "uid": "${datasource}"}
C = 'cluster=~"$cluster"'
# A device in legends: a MIG slice shares its GPU's index and adds its profile and GPU instance
# (labels a whole GPU does not have, which Grafana leaves empty).
DEVICE = "{{node}} GPU {{gpu}} {{mig_profile}} {{gpu_instance_id}}"
# The selected training jobs: a job is named by its namespace and its training_job label.
J = C + ', namespace=~"$namespace", training_job=~"$training_job"'


def rule_alerts():
    """The alerts of deploy/prometheus/stepwatch-rules.yml, in its order: the cluster
    dashboard's alerts table lists exactly these, so a new alert shows there (and
    `--check` fails until the dashboards are regenerated). A hand-kept list had
    missed StepwatchAllocatorRetries."""
    path = os.path.join(HERE, "..", "deploy", "prometheus", "stepwatch-rules.yml")
    with open(path) as f:
        return re.findall(r"^\s*- alert: (Stepwatch\w+)\s*$", f.read(), re.M)


AGENT_ALERTS = "|".join(rule_alerts())


def thresholds(base, *steps):
    """Grafana's absolute thresholds: ``base`` below the first step, then each step's
    colour from its value up."""
    return {
        "mode": "absolute",
        "steps": [{"color": base, "value": None}]
        + [{"color": color, "value": value} for value, color in steps],
    }


RED_BELOW_ZERO = thresholds("red", (0, "green"))
HEADROOM_RATIO = thresholds("red", (0, "orange"), (0.05, "green"))
DIVERGENCE = thresholds("green", (0.1, "orange"), (0.25, "red"))
GOOD_IS_ONE = thresholds("red", (1, "green"))
ZERO_IS_GOOD = thresholds("green", (1, "red"))
PLAIN = thresholds("green")


# ------------------------------------------------------------------------------------ variables


def v_datasource():
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }


def v_query(name, label, query, multi=True, include_all=True, hide=0):
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
            "qryType": 1,
        },
        "refresh": 2,
        "regex": "",
        "sort": 3 if name == "rank" else 1,
        "multi": multi,
        "includeAll": include_all,
        "allValue": ".*" if include_all else None,
        "current": {},
        "options": [],
        "hide": hide,
        "skipUrlSync": False,
    }


def v_cluster():
    # The `cluster` label exists only where Prometheus adds it (external_labels, relabeling);
    # with no values the variable stays on All (.*), which also matches an absent label.
    return v_query("cluster", "Cluster", "label_values(stepwatch_build_info, cluster)")


def v_node():
    return v_query("node", "Node", f"label_values(stepwatch_build_info{{{C}}}, node)")


def v_namespace():
    # A job is (namespace, training_job): two tenants may name their jobs alike. Ranks outside
    # Kubernetes have no namespace; All (.*) also matches an absent label.
    return v_query("namespace", "Namespace", f"label_values(stepwatch_rank_info{{{C}}}, namespace)")


def v_job(multi=False):
    return v_query(
        "training_job",
        "Training job",
        f'label_values(stepwatch_rank_info{{{C}, namespace=~"$namespace"}}, training_job)',
        multi=multi,
        include_all=multi,
    )


def v_rank():
    return v_query("rank", "Rank", f'label_values(stepwatch_rank_info{{{J}, node=~"$node"}}, rank)')


def v_node_of_job():
    return v_query("node", "Node", f"label_values(stepwatch_rank_info{{{J}}}, node)")


def v_agent_job():
    return {
        "name": "agent_job",
        "label": "Agent scrape job (regex)",
        "type": "textbox",
        "query": ".*stepwatch.*",
        "current": {"text": ".*stepwatch.*", "value": ".*stepwatch.*"},
        "options": [{"selected": True, "text": ".*stepwatch.*", "value": ".*stepwatch.*"}],
        "hide": 2,
        "skipUrlSync": False,
    }


# ------------------------------------------------------------------------------------ panels


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping rows."""

    def __init__(self):
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1
        self.panels = []

    def add(self, panel, w, h):
        if self.x + w > 24:
            self.newline()
        panel["id"] = self.next_id
        self.next_id += 1
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        self.panels.append(panel)

    def add_all(self, w, h, *panels):
        """Places `panels`, all of one size, one after another."""
        for panel in panels:
            self.add(panel, w, h)

    def newline(self):
        if self.x:
            self.y += self.row_h
        self.x, self.row_h = 0, 0

    def row(self, title):
        self.newline()
        self.panels.append(
            {
                "id": self.next_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        self.next_id += 1
        self.y += 1


def target(expr, legend="", ref="A", instant=False, table=False, interval=""):
    t = {
        "datasource": DS,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "editorMode": "code",
        "format": "table" if table else "time_series",
    }
    if interval:
        t["interval"] = interval
    return t


def targets(*specs, **kw):
    out = []
    for i, spec in enumerate(specs):
        expr, legend = spec if isinstance(spec, tuple) else (spec, "")
        out.append(target(expr, legend, ref=chr(ord("A") + i), **kw))
    return out


def field_config(
    unit,
    thresholds=None,
    decimals=None,
    mn=None,
    mx=None,
    custom=None,
    overrides=None,
    mappings=None,
):
    defaults = {
        "unit": unit,
        "thresholds": thresholds or PLAIN,
        "color": {"mode": "palette-classic"},
        "mappings": mappings or [],
    }
    if thresholds:
        defaults["color"] = {"mode": "thresholds"}
    if decimals is not None:
        defaults["decimals"] = decimals
    if mn is not None:
        defaults["min"] = mn
    if mx is not None:
        defaults["max"] = mx
    if custom:
        defaults["custom"] = custom
    return {"defaults": defaults, "overrides": overrides or []}


def timeseries(
    title,
    tgts,
    unit,
    description="",
    stack=False,
    bars=False,
    interval=None,
    thresholds=None,
    overrides=None,
    mn=None,
    max_points=None,
):
    custom = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 60 if (stack or bars) else 10,
        "showPoints": "never",
        "spanNulls": False,
        "lineInterpolation": "linear",
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "axisPlacement": "auto",
        "gradientMode": "none",
    }
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "line"}
    fc = field_config(unit, custom=custom, overrides=overrides, mn=mn)
    if thresholds:
        fc["defaults"]["thresholds"] = thresholds
    p = {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": fc,
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
                "calcs": ["lastNotNull", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }
    if interval:
        p["interval"] = interval
    if max_points:
        p["maxDataPoints"] = max_points
    return p


def stat(
    title, expr, unit, description="", thresholds=None, legend="", decimals=None, mappings=None
):
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": [target(expr, legend, instant=True)],
        "fieldConfig": field_config(
            unit, thresholds=thresholds or PLAIN, decimals=decimals, mappings=mappings
        ),
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "none",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
        },
    }


def bargauge(title, tgts, unit, description="", thresholds=None, mn=None, mx=None):
    return {
        "type": "bargauge",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": field_config(unit, thresholds=thresholds or PLAIN, mn=mn, mx=mx),
        "options": {
            "orientation": "horizontal",
            "displayMode": "gradient",
            "showUnfilled": True,
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        },
    }


def table(
    title, tgts, unit="none", description="", transformations=None, overrides=None, sort_by=None
):
    opts = {
        "showHeader": True,
        "cellHeight": "sm",
        "footer": {"show": False, "reducer": ["sum"], "fields": ""},
    }
    if sort_by:
        opts["sortBy"] = [{"displayName": sort_by[0], "desc": sort_by[1]}]
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": tgts,
        "fieldConfig": field_config(unit, overrides=overrides),
        "options": opts,
        "transformations": transformations or [],
    }


def unit_override(field, unit, thresholds=None):
    props = [{"id": "unit", "value": unit}]
    if thresholds:
        props += [
            {"id": "thresholds", "value": thresholds},
            {"id": "custom.cellOptions", "value": {"type": "color-background"}},
        ]
    return {"matcher": {"id": "byName", "options": field}, "properties": props}


def regex_override(pattern, props):
    return {"matcher": {"id": "byRegexp", "options": pattern}, "properties": props}


def label_table(title, query, hide=("Time", "Value", "__name__", "instance"), **kw):
    """A table of the series one instant ``query`` returns, a row each, its labels the
    columns but those in ``hide``."""
    return table(
        title,
        targets((query, ""), instant=True, table=True),
        transformations=[organize(exclude=hide)],
        **kw,
    )


def organize(exclude=(), rename=None):
    return {
        "id": "organize",
        "options": {
            "excludeByName": {k: True for k in exclude},
            "renameByName": rename or {},
            "indexByName": {},
        },
    }


def matrix(row, column, value="Value"):
    return {
        "id": "groupingToMatrix",
        "options": {"rowField": row, "columnField": column, "valueField": value},
    }


# ------------------------------------------------------------------------------------ dashboards


def dashboard(uid, title, description, variables, layout, time_from="now-1h", refresh="30s"):
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [
            {
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "tags": ["stepwatch"],
                "title": "stepwatch",
                "type": "dashboards",
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "panels": layout.panels,
        "refresh": refresh,
        "schemaVersion": 39,
        "tags": ["stepwatch", "gpu"],
        "templating": {"list": variables},
        "time": {"from": time_from, "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def node_gpu_memory():
    sel = f'{C}, node=~"$node"'
    gsel = f'{sel}, gpu=~"$gpu"'
    L = Layout()
    L.row("Agents")
    L.add_all(
        4,
        4,
        stat(
            "NVML up (nodes)",
            f"sum(stepwatch_nvml_up{{{sel}}})",
            "none",
            "Nodes whose agent reads GPU memory through NVML.",
            thresholds=GOOD_IS_ONE,
        ),
        stat(
            "NVML down (nodes)",
            f"count(stepwatch_nvml_up{{{sel}}} == 0) or vector(0)",
            "none",
            "Agents that cannot reach NVML (alert StepwatchNVMLDown).",
            thresholds=ZERO_IS_GOOD,
        ),
        stat("GPUs", f"count(stepwatch_gpu_info{{{sel}}})", "none"),
        stat("Ranks tracked", f"sum(stepwatch_ranks_tracked{{{sel}}})", "none"),
        stat(
            "Client streams",
            f"sum(stepwatch_ingest_streams_active{{{sel}}})",
            "none",
            "Open marker streams from training processes.",
        ),
        stat(
            "Worst sampler lag",
            f"max(stepwatch_sampler_lag_seconds{{{sel}}})",
            "s",
            "Worst tick lateness of the GPU sampler over its trailing window.",
            thresholds={
                "mode": "absolute",
                "steps": [
                    {"color": "green", "value": None},
                    {"color": "orange", "value": 0.02},
                    {"color": "red", "value": 0.1},
                ],
            },
        ),
    )
    L.row("GPU memory")
    L.add(
        timeseries(
            "GPU memory: high-water, last sample, capacity",
            targets(
                (
                    f"max_over_time(stepwatch_gpu_memory_used_max_bytes{{{gsel}}}[$__interval])",
                    DEVICE + " high-water",
                ),
                (f"stepwatch_gpu_memory_used_bytes{{{gsel}}}", DEVICE + " used"),
                (f"stepwatch_gpu_memory_total_bytes{{{gsel}}}", DEVICE + " total"),
            ),
            "bytes",
            "High-water is the agent's trailing-window maximum (15 s, sampled at up to 100 Hz) taken as a "
            "max_over_time over each plotted interval, so a 40 ms peak shows at any zoom. 'used' is the last sample at "
            "scrape time. Min interval 15 s = one scrape (full resolution).",
            interval="15s",
            max_points=5000,
            mn=0,
            overrides=[
                regex_override(
                    ".* total$",
                    [
                        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                        {"id": "custom.fillOpacity", "value": 0},
                    ],
                ),
                regex_override(".* used$", [{"id": "custom.fillOpacity", "value": 0}]),
            ],
        ),
        24,
        10,
    )
    L.add(
        timeseries(
            "GPU memory high-water / capacity",
            targets(
                (
                    f"max_over_time(stepwatch_gpu_memory_used_max_bytes{{{gsel}}}[$__interval]) "
                    f"/ on (node, gpu, gpu_uuid) group_left () stepwatch_gpu_memory_total_bytes{{{gsel}}}",
                    DEVICE,
                )
            ),
            "percentunit",
            interval="15s",
            max_points=5000,
            mn=0,
            thresholds={
                "mode": "absolute",
                "steps": [
                    {"color": "green", "value": None},
                    {"color": "orange", "value": 0.9},
                    {"color": "red", "value": 0.95},
                ],
            },
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "GPU memory free (last sample)",
            targets((f"stepwatch_gpu_memory_free_bytes{{{gsel}}}", DEVICE)),
            "bytes",
            interval="15s",
            mn=0,
        ),
        12,
        8,
    )
    L.add(
        table(
            "GPUs now",
            targets(
                (
                    f"stepwatch_gpu_memory_total_bytes{{{gsel}}} * on (node, gpu, gpu_uuid) group_left (name) "
                    f"stepwatch_gpu_info{{{gsel}}}",
                    "",
                ),
                (
                    f"stepwatch_gpu_memory_used_max_bytes{{{gsel}}} * on (node, gpu, gpu_uuid) group_left (name) "
                    f"stepwatch_gpu_info{{{gsel}}}",
                    "",
                ),
                (
                    f"stepwatch_gpu_memory_used_bytes{{{gsel}}} * on (node, gpu, gpu_uuid) group_left (name) "
                    f"stepwatch_gpu_info{{{gsel}}}",
                    "",
                ),
                instant=True,
                table=True,
            ),
            transformations=[
                {"id": "merge", "options": {}},
                organize(
                    exclude=("Time", "__name__", "instance", "job", "cluster"),
                    rename={
                        "Value #A": "total",
                        "Value #B": "high-water (15 s)",
                        "Value #C": "used",
                    },
                ),
            ],
            overrides=[
                unit_override("total", "bytes"),
                unit_override("high-water (15 s)", "bytes"),
                unit_override("used", "bytes"),
            ],
        ),
        24,
        7,
    )
    L.row("Agent health")
    L.add(
        timeseries(
            "GPU samples per second",
            targets(
                (
                    f"rate(stepwatch_gpu_samples_total{{{gsel}}}[$__rate_interval])",
                    DEVICE,
                )
            ),
            "ops",
        ),
        8,
        7,
    )
    L.add(
        timeseries(
            "Sampler lag",
            targets((f"stepwatch_sampler_lag_seconds{{{sel}}}", "{{node}}")),
            "s",
            thresholds={
                "mode": "absolute",
                "steps": [{"color": "green", "value": None}, {"color": "red", "value": 0.1}],
            },
        ),
        8,
        7,
    )
    L.add(
        timeseries(
            "NVML errors per second by call",
            targets(
                (
                    f"sum by (node, call) (rate(stepwatch_nvml_errors_total{{{sel}}}[$__rate_interval]))",
                    "{{node}} {{call}}",
                )
            ),
            "ops",
        ),
        8,
        7,
    )
    L.add(
        timeseries(
            "Markers received / rejected, allocator traces, per second",
            targets(
                (
                    f"sum by (node) (rate(stepwatch_markers_received_total{{{sel}}}[$__rate_interval]))",
                    "{{node}} received",
                ),
                (
                    f"sum by (node, reason) (rate(stepwatch_markers_rejected_total{{{sel}}}[$__rate_interval]))",
                    "{{node}} rejected ({{reason}})",
                ),
                (
                    f"sum by (node, result) (rate(stepwatch_allocator_traces_total{{{sel}}}[$__rate_interval]))",
                    "{{node}} allocator traces ({{result}})",
                ),
            ),
            "ops",
        ),
        12,
        7,
    )
    L.add(
        label_table(
            "Agent versions",
            f"stepwatch_build_info{{{sel}}}",
            hide=("Time", "Value", "__name__", "instance", "job"),
        ),
        12,
        7,
    )
    return dashboard(
        "stepwatch-node-gpu-memory",
        "stepwatch / node GPU memory",
        "GPU memory per node and GPU from the stepwatch agent: trailing-window high-water, last sample, capacity; "
        "agent and sampler health.",
        [
            v_datasource(),
            v_cluster(),
            v_node(),
            v_query("gpu", "GPU", f'label_values(stepwatch_gpu_info{{{C}, node=~"$node"}}, gpu)'),
        ],
        L,
        time_from="now-30m",
        refresh="15s",
    )


def step_anatomy():
    sel = f'{J}, node=~"$node", rank=~"$rank"'
    jsel = J
    L = Layout()
    L.row("Job")
    L.add_all(
        3,
        4,
        stat("Ranks", f"count(stepwatch_rank_info{{{sel}}})", "none"),
        stat("Last step", f"max(stepwatch_rank_last_step{{{sel}}})", "none"),
        stat(
            "Median step time",
            f"quantile(0.5, stepwatch_rank_step_duration_median_seconds{{{sel}}})",
            "s",
        ),
        stat(
            "Steps per second",
            f"avg(rate(stepwatch_rank_steps_completed_total{{{sel}}}[$__rate_interval]))",
            "none",
            decimals=3,
        ),
        stat(
            "Steady state reached",
            f"min(stepwatch_rank_steady_state_reached{{{sel}}})",
            "none",
            "1 when every selected rank reached steady state (consecutive step peaks agree).",
            thresholds=GOOD_IS_ONE,
            mappings=[
                {"type": "value", "options": {"0": {"text": "not yet"}, "1": {"text": "yes"}}}
            ],
        ),
        stat(
            "Steady / first step peak (worst)",
            f"max(stepwatch_rank_first_step_anomaly_ratio{{{sel}}})",
            "percentunit",
            "Steady-state peak over first-step peak; above 100% the first step under-stated memory.",
        ),
        stat(
            "Worst predicted headroom",
            f"min(stepwatch_rank_predicted_headroom_bytes{{{sel}}})",
            "bytes",
            thresholds=RED_BELOW_ZERO,
        ),
        stat(
            "OOMs in range",
            f"sum(increase(stepwatch_rank_ooms_total{{{sel}}}[$__range]))",
            "none",
            thresholds=ZERO_IS_GOOD,
            decimals=0,
        ),
    )
    L.row("Phase durations")
    L.add(
        timeseries(
            "Phase durations of the last completed step (mean over selected ranks)",
            targets(
                (f"avg by (phase) (stepwatch_rank_phase_duration_seconds{{{sel}}})", "{{phase}}")
            ),
            "s",
            "Stacked: prologue, forward, backward, optimizer, epilogue add up to the step.",
            stack=True,
        ),
        14,
        9,
    )
    L.add(
        bargauge(
            "Phase durations now, per rank",
            targets(
                (f"stepwatch_rank_phase_duration_seconds{{{sel}}}", "rank {{rank}} · {{phase}}"),
                instant=True,
            ),
            "s",
        ),
        10,
        9,
    )
    L.add(
        timeseries(
            "Step duration per rank (last step and median)",
            targets(
                (f"stepwatch_rank_step_duration_seconds{{{sel}}}", "rank {{rank}} last"),
                (f"stepwatch_rank_step_duration_median_seconds{{{sel}}}", "rank {{rank}} median"),
            ),
            "s",
            overrides=[
                regex_override(
                    ".* median$",
                    [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}],
                )
            ],
        ),
        24,
        8,
    )
    L.row("Phase peaks: first step vs steady state")
    phase_peaks = (
        f"label_join(max by (phase, step_class, source) (stepwatch_rank_phase_peak_bytes{{{sel}}}), "
        f'"class", " ", "source", "step_class")'
    )
    L.add(
        table(
            "Peak bytes per phase (max over selected ranks)",
            targets((phase_peaks, ""), instant=True, table=True),
            "bytes",
            "Rows: phases. Columns: source (nvml = what the driver sees, allocator = torch.cuda.memory_stats) "
            "and step class (first step, steady state).",
            transformations=[matrix("phase", "class")],
        ),
        12,
        8,
    )
    L.add(
        bargauge(
            "Peak bytes per phase and step class (NVML)",
            targets(
                (
                    f'max by (phase, step_class) (stepwatch_rank_phase_peak_bytes{{{sel}, source="nvml"}})',
                    "{{step_class}} · {{phase}}",
                ),
                instant=True,
            ),
            "bytes",
            mn=0,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Step peak per rank: first, steady, predicted, capacity",
            targets(
                (f"stepwatch_rank_first_step_peak_bytes{{{sel}}}", "rank {{rank}} first step"),
                (f"stepwatch_rank_steady_step_peak_bytes{{{sel}}}", "rank {{rank}} steady"),
                (f"stepwatch_rank_predicted_peak_bytes{{{sel}}}", "rank {{rank}} predicted"),
                (f"stepwatch_rank_gpu_capacity_bytes{{{sel}}}", "rank {{rank}} capacity"),
            ),
            "bytes",
            mn=0,
            overrides=[
                regex_override(
                    ".* capacity$",
                    [
                        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                        {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                    ],
                )
            ],
        ),
        12,
        9,
    )
    L.add(
        timeseries(
            "Predicted headroom per rank",
            targets((f"stepwatch_rank_predicted_headroom_bytes{{{sel}}}", "rank {{rank}}")),
            "bytes",
            "Capacity minus predicted steady-state peak minus other processes. Below 0: step 2 "
            "will likely OOM (alert StepwatchStep2OOMPredicted).",
            thresholds=RED_BELOW_ZERO,
        ),
        12,
        9,
    )
    # Beside the prediction: retries are what a job at the limit shows after step 2 began,
    # when the prediction is frozen. increase() absorbs a new run's counter starting over.
    L.add(
        timeseries(
            "Allocator retries per rank",
            targets(
                (
                    f"increase(stepwatch_rank_allocator_retries_total{{{sel}}}[$__rate_interval])",
                    "rank {{rank}}",
                )
            ),
            "none",
            "Allocations for which PyTorch's caching allocator found no free block, freed its "
            "whole cache of unused segments and retried cudaMalloc (num_alloc_retries), per "
            "interval. Any retry after step 1: the job lives at its GPU's memory limit; each "
            "retry is a cache flush that slows the step, and the next larger allocation may OOM "
            "(alert StepwatchAllocatorRetries; its runbook says what to do). No series until "
            "the client sends allocator figures.",
            bars=True,
            mn=0,
        ),
        24,
        7,
    )
    L.row("GPUs of this job")
    L.add(
        timeseries(
            "GPU memory high-water of the job's GPUs",
            targets(
                (
                    f"max_over_time(stepwatch_gpu_memory_used_max_bytes{{{C}}}[$__interval]) "
                    f"* on (node, gpu_uuid) group_left (training_job) "
                    f"max by (node, gpu_uuid, training_job) (stepwatch_rank_info{{{sel}}})",
                    DEVICE,
                )
            ),
            "bytes",
            interval="15s",
            mn=0,
        ),
        14,
        8,
    )
    L.add(
        label_table("Ranks", f"stepwatch_rank_info{{{jsel}}}", sort_by=("rank", False)),
        10,
        8,
    )
    return dashboard(
        "stepwatch-step-anatomy",
        "stepwatch / step anatomy",
        "One training job: phase durations and phase peaks per step class (first step vs steady state), "
        "step peaks, predictions and headroom per rank.",
        [v_datasource(), v_cluster(), v_namespace(), v_job(), v_node_of_job(), v_rank()],
        L,
        time_from="now-3h",
    )


def first_step_anomaly():
    jsel = J
    sel = f'{J}, node=~"$node", rank=~"$rank"'
    L = Layout()
    L.row("Across all ranks of the job (recording rules, every node)")
    L.add_all(
        4,
        4,
        stat(
            "Step-1 peak divergence",
            f"max(stepwatch_job:first_step_peak_divergence_ratio{{{jsel}}})",
            "percentunit",
            "(max - min) / median of the ranks' step-1 peaks. Alert StepwatchFirstStepDivergence above 10%.",
            thresholds=DIVERGENCE,
        ),
        stat(
            "Outlier ranks",
            f"count(stepwatch_job_rank:first_step_peak_outlier{{{jsel}}} == 1) or vector(0)",
            "none",
            "Ranks whose step-1 peak is more than 10% from the job median.",
            thresholds=ZERO_IS_GOOD,
        ),
        stat("Step-1 peak max", f"max(stepwatch_job:first_step_peak_bytes:max{{{jsel}}})", "bytes"),
        stat(
            "Step-1 peak median",
            f"max(stepwatch_job:first_step_peak_bytes:median{{{jsel}}})",
            "bytes",
        ),
        stat("Step-1 peak min", f"max(stepwatch_job:first_step_peak_bytes:min{{{jsel}}})", "bytes"),
        stat("Ranks reporting", f"max(stepwatch_job:ranks_reporting:count{{{jsel}}})", "none"),
    )
    L.add(
        bargauge(
            "Step-1 peak per rank",
            targets(
                (f"stepwatch_rank_first_step_peak_bytes{{{sel}}}", "rank {{rank}} ({{node}})"),
                instant=True,
            ),
            "bytes",
            mn=0,
        ),
        12,
        10,
    )
    L.add(
        bargauge(
            "Deviation from the job median per rank",
            targets(
                (
                    f"stepwatch_job_rank:first_step_peak_deviation_ratio{{{sel}}}",
                    "rank {{rank}} ({{node}})",
                ),
                instant=True,
            ),
            "percentunit",
            thresholds={
                "mode": "absolute",
                "steps": [{"color": "green", "value": None}, {"color": "red", "value": 0.1}],
            },
            mn=0,
        ),
        12,
        10,
    )
    L.add(
        table(
            "Outlier ranks",
            targets(
                (
                    f"stepwatch_job_rank:first_step_peak_deviation_ratio{{{jsel}}} "
                    f"and (stepwatch_job_rank:first_step_peak_outlier{{{jsel}}} == 1)",
                    "",
                ),
                instant=True,
                table=True,
            ),
            "percentunit",
            "Expected causes: rank 0 logging/evaluation, pipeline stages, uneven shards. "
            "Unexpected: a shared GPU, a different batch shape, a straggler node.",
            transformations=[
                organize(
                    exclude=("Time", "__name__", "instance"),
                    rename={"Value": "deviation from median"},
                )
            ],
            sort_by=("deviation from median", True),
        ),
        12,
        8,
    )
    L.add(
        table(
            "Step-1 peak per phase and rank (NVML)",
            targets(
                (
                    f'max by (rank, phase) (stepwatch_rank_phase_peak_bytes{{{sel}, step_class="first", '
                    f'source="nvml"}})',
                    "",
                ),
                instant=True,
                table=True,
            ),
            "bytes",
            "Where in step 1 each rank peaks: a jump in the optimizer phase is optimizer state being created.",
            transformations=[matrix("rank", "phase")],
        ),
        12,
        8,
    )
    L.row("First step vs steady state per rank")
    L.add(
        timeseries(
            "Steady / first-step peak per rank",
            targets((f"stepwatch_rank_first_step_anomaly_ratio{{{sel}}}", "rank {{rank}}")),
            "percentunit",
            "Above 100%: later steps need more memory than step 1 (lazy optimizer state, "
            "allocator warm-up); this is what turns a working step 1 into a step-2 OOM.",
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Step-1 and steady peak per rank",
            targets(
                (f"stepwatch_rank_first_step_peak_bytes{{{sel}}}", "rank {{rank}} first"),
                (f"stepwatch_rank_steady_step_peak_bytes{{{sel}}}", "rank {{rank}} steady"),
            ),
            "bytes",
            mn=0,
        ),
        12,
        8,
    )
    L.row("Per node (computed by each agent over its local ranks)")
    L.add(
        timeseries(
            "Local divergence of step-1 figures",
            targets(
                (f"stepwatch_job_first_step_peak_divergence_ratio{{{jsel}}}", "{{node}} peak"),
                (
                    f"stepwatch_job_first_step_duration_divergence_ratio{{{jsel}}}",
                    "{{node}} duration",
                ),
            ),
            "percentunit",
        ),
        12,
        8,
    )
    L.add(
        label_table("Outliers named by the agents", f"stepwatch_job_rank_outlier{{{jsel}}} == 1"),
        12,
        8,
    )
    L.add(
        timeseries(
            "Step-time spread across ranks (max / median of median step times)",
            targets(
                (
                    f"stepwatch_job:step_duration_median_seconds:max{{{jsel}}} "
                    f"/ stepwatch_job:step_duration_median_seconds:median{{{jsel}}}",
                    "{{namespace}} {{training_job}}",
                )
            ),
            "percentunit",
            "Above 100%: the slowest rank is slower than the typical one (a straggler).",
        ),
        24,
        7,
    )
    return dashboard(
        "stepwatch-first-step-anomaly",
        "stepwatch / first-step anomaly",
        "Step-1 memory peaks across the ranks of a job: spread, outlier ranks, first step vs steady state.",
        [v_datasource(), v_cluster(), v_namespace(), v_job(), v_node_of_job(), v_rank()],
        L,
        time_from="now-6h",
    )


def cluster_oom_risk():
    jsel = J
    L = Layout()
    L.row("Now")
    L.add_all(
        4,
        4,
        stat(
            "Jobs predicted to OOM",
            f"count(stepwatch_job:predicted_headroom_bytes:min{{{jsel}}} < 0) or vector(0)",
            "none",
            thresholds=ZERO_IS_GOOD,
        ),
        stat(
            "Ranks at risk",
            f"sum(stepwatch_job:oom_risk_ranks:sum{{{jsel}}}) or vector(0)",
            "none",
            thresholds=ZERO_IS_GOOD,
        ),
        stat(
            "Jobs under 5% headroom",
            f"count(stepwatch_job:predicted_headroom_ratio:min{{{jsel}}} < 0.05) or vector(0)",
            "none",
            thresholds=ZERO_IS_GOOD,
        ),
        stat(
            "OOMs observed in range",
            f"sum(increase(stepwatch_rank_ooms_total{{{jsel}}}[$__range])) or vector(0)",
            "none",
            thresholds=ZERO_IS_GOOD,
            decimals=0,
        ),
        stat(
            "Agents up",
            f'sum(up{{job=~"$agent_job", {C}}})',
            "none",
            "Targets of the scrape job matching the agent_job variable.",
        ),
        stat(
            "Nodes with NVML down",
            f"count(stepwatch_nvml_up{{{C}}} == 0) or vector(0)",
            "none",
            thresholds=ZERO_IS_GOOD,
        ),
    )
    L.add(
        table(
            "Jobs ranked by worst predicted headroom",
            targets(
                (f"stepwatch_job:predicted_headroom_bytes:min{{{jsel}}}", ""),
                (f"stepwatch_job:predicted_headroom_ratio:min{{{jsel}}}", ""),
                (f"stepwatch_job:predicted_peak_bytes:max{{{jsel}}}", ""),
                (f"stepwatch_job:oom_risk_ranks:sum{{{jsel}}}", ""),
                (f"stepwatch_job:ranks_reporting:count{{{jsel}}}", ""),
                instant=True,
                table=True,
            ),
            description="Worst rank of each job. Negative headroom: step 2 will likely run out of memory.",
            transformations=[
                {"id": "merge", "options": {}},
                organize(
                    exclude=("Time",),
                    rename={
                        "Value #A": "worst headroom",
                        "Value #B": "worst headroom %",
                        "Value #C": "largest predicted peak",
                        "Value #D": "ranks at risk",
                        "Value #E": "ranks",
                    },
                ),
            ],
            overrides=[
                unit_override("worst headroom", "bytes", RED_BELOW_ZERO),
                unit_override("worst headroom %", "percentunit", HEADROOM_RATIO),
                unit_override("largest predicted peak", "bytes"),
            ],
            sort_by=("worst headroom", False),
        ),
        24,
        9,
    )
    L.add(
        label_table(
            "stepwatch alerts (firing and pending)",
            f'ALERTS{{alertname=~"{AGENT_ALERTS}", {C}}}',
            hide=("Time", "Value", "__name__"),
            sort_by=("alertstate", False),
        ),
        24,
        8,
    )
    L.add(
        bargauge(
            "Worst predicted headroom per job (share of GPU capacity)",
            targets(
                (
                    f"sort(stepwatch_job:predicted_headroom_ratio:min{{{jsel}}})",
                    "{{namespace}} {{training_job}}",
                ),
                instant=True,
            ),
            "percentunit",
            thresholds=HEADROOM_RATIO,
            mn=-0.25,
            mx=1,
        ),
        12,
        9,
    )
    L.add(
        table(
            "Ranks predicted to OOM",
            targets(
                (f"stepwatch_rank_predicted_headroom_bytes{{{jsel}}} < 0", ""),
                instant=True,
                table=True,
            ),
            "bytes",
            transformations=[
                organize(
                    exclude=("Time", "__name__", "instance"), rename={"Value": "predicted headroom"}
                )
            ],
            sort_by=("predicted headroom", False),
        ),
        12,
        9,
    )
    L.add(
        timeseries(
            "Worst predicted headroom per job",
            targets(
                (
                    f"stepwatch_job:predicted_headroom_bytes:min{{{jsel}}}",
                    "{{namespace}} {{training_job}}",
                )
            ),
            "bytes",
            thresholds=RED_BELOW_ZERO,
        ),
        12,
        8,
    )
    L.add(
        timeseries(
            "Observed OOMs per job",
            targets(
                (
                    f"sum by (namespace, training_job) (increase(stepwatch_rank_ooms_total{{{jsel}}}[$__rate_interval]))",
                    "{{namespace}} {{training_job}}",
                )
            ),
            "none",
            bars=True,
        ),
        12,
        8,
    )
    return dashboard(
        "stepwatch-cluster-oom-risk",
        "stepwatch / cluster OOM risk",
        "Every job in the cluster ranked by predicted GPU memory headroom, with stepwatch alerts and observed OOMs.",
        [v_datasource(), v_cluster(), v_namespace(), v_job(multi=True), v_agent_job()],
        L,
        time_from="now-6h",
    )


DASHBOARDS = {
    "node-gpu-memory.json": node_gpu_memory,
    "step-anatomy.json": step_anatomy,
    "first-step-anomaly.json": first_step_anomaly,
    "cluster-oom-risk.json": cluster_oom_risk,
}


def render(fn):
    return json.dumps(fn(), indent=2, sort_keys=False) + "\n"


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    want = {name: render(fn) for name, fn in DASHBOARDS.items()}
    stale = generated_files.sync(HERE, want, args.check, "dashboards/")
    return generated_files.report(
        args.check, "dashboards", len(want), stale, "python3 dashboards/generate.py"
    )


if __name__ == "__main__":
    sys.exit(main())
