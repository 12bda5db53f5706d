#!/usr/bin/env python3
"""Runs every PromQL expression of stepwatch's rules and dashboards through a real Prometheus.

  promql_check.py --prometheus /usr/bin/prometheus --rules RULES.yml --dashboards DIR [--dump FILE]

Starts the given Prometheus on 127.0.0.1 (a free port) with an empty TSDB in a temporary
directory and the rules file loaded, then sends each expression to /api/v1/query and fails
on any error the server reports (parse errors, type errors, unknown functions). Grafana
variables are replaced first: $__interval/$__rate_interval -> 1m, $__range -> 1h, any
other $var or ${var} -> .* (all of them are used as regex matchers), after checking that
the dashboard defines the variable. Grafana's label_values(SELECTOR, label) variable
queries are checked as SELECTOR. Also checks that Prometheus loaded every rule of the file.
Stops Prometheus before it exits, whatever happens.
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml
from report import report_errors

GRAFANA_DURATIONS = {
    "__interval": "1m",
    "__rate_interval": "1m",
    "__range": "1h",
    "__range_s": "3600",
    "__interval_ms": "60000",
}
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
LABEL_VALUES_RE = re.compile(r"^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", re.S)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url, data=None, timeout=10):
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    req = urllib.request.Request(url, data=body)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        try:
            return json.load(e)
        except Exception:
            return {"status": "error", "error": f"HTTP {e.code}"}


def rule_exprs(path):
    with open(path) as f:
        doc = yaml.safe_load(f)
    out = []
    for g in doc["groups"]:
        for r in g["rules"]:
            out.append((f"{os.path.basename(path)} {r.get('record') or r.get('alert')}", r["expr"]))
    return out


def walk_panels(panels):
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


def dashboard_exprs(path, errors):
    with open(path) as f:
        dash = json.load(f)
    name = os.path.basename(path)
    variables = {v["name"] for v in dash.get("templating", {}).get("list", [])}
    out = []
    raw = []
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = LABEL_VALUES_RE.match(q)
        raw.append((f"{name} variable {v['name']}", m.group(1) if m else q))
    for p in walk_panels(dash.get("panels", [])):
        for t in p.get("targets", []):
            if "expr" not in t:
                errors.append(f"{name} panel {p.get('title')!r} target {t.get('refId')}: no expr")
                continue
            raw.append((f"{name} panel {p.get('title')!r} {t.get('refId')}", t["expr"]))
    for where, expr in raw:
        used = {a or b for a, b in VAR_RE.findall(expr)}
        for var in sorted(used - variables - set(GRAFANA_DURATIONS)):
            errors.append(f"{where}: uses ${var}, which the dashboard does not define")
        out.append(
            (
                where,
                VAR_RE.sub(lambda m: GRAFANA_DURATIONS.get(m.group(1) or m.group(2), ".*"), expr),
            )
        )
    return out


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prometheus", default="prometheus")
    p.add_argument("--rules", required=True)
    p.add_argument("--dashboards", required=True)
    p.add_argument("--dump", help="write the substituted expressions here (one JSON list)")
    args = p.parse_args()

    errors = []
    exprs = rule_exprs(args.rules)
    n_rules = len(exprs)
    for path in sorted(glob.glob(os.path.join(args.dashboards, "*.json"))):
        exprs += dashboard_exprs(path, errors)
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(exprs, f, indent=1)

    rejected = 0
    build = "?"
    tmp = tempfile.mkdtemp(prefix="stepwatch-promql-")
    port = free_port()
    shutil.copy(args.rules, os.path.join(tmp, "rules.yml"))
    with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
        yaml.safe_dump({"global": {"evaluation_interval": "1s"}, "rule_files": ["rules.yml"]}, f)
    log = open(os.path.join(tmp, "prometheus.log"), "w")
    proc = subprocess.Popen(
        [
            args.prometheus,
            f"--config.file={tmp}/prometheus.yml",
            f"--storage.tsdb.path={tmp}/data",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {proc.returncode}:\n" + open(log.name).read()[-3000:]
                )
            try:
                with urllib.request.urlopen(base + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                raise RuntimeError("prometheus did not become ready in 60 s")
            time.sleep(0.3)
        build = http_json(base + "/api/v1/status/buildinfo").get("data", {}).get("version", "?")
        time.sleep(1.5)  # let the rule groups evaluate once on the empty TSDB
        loaded = http_json(base + "/api/v1/rules")
        rules = [r for g in loaded.get("data", {}).get("groups", []) for r in g.get("rules", [])]
        if len(rules) != n_rules:
            errors.append(f"prometheus loaded {len(rules)} rules, the file has {n_rules}")
        for r in rules:
            if r.get("health") == "err":
                errors.append(f"rule {r.get('name')}: {r.get('lastError')}")
        now = time.time()
        for where, expr in exprs:
            res = http_json(base + "/api/v1/query", {"query": expr, "time": f"{now:.3f}"})
            if res.get("status") != "success":
                rejected += 1
                errors.append(
                    f"{where}: {res.get('errorType', '')}: {res.get('error')}\n      {expr}"
                )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)

    return report_errors(
        errors,
        f"Prometheus {build}: {len(exprs) - rejected} of {len(exprs)} expressions "
        f"accepted ({n_rules} from rules, {len(exprs) - n_rules} from dashboards); {len(errors)} error(s)",
    )


if __name__ == "__main__":
    sys.exit(main())
