#!/usr/bin/env python3
"""Structural checks of the Grafana dashboards (dashboards/*.json).

  check_dashboards.py DIR

Each file must be valid JSON and importable as it is: schemaVersion >= 36, a unique uid
and title, a `datasource` variable (type datasource, prometheus) that every panel and
target uses, a `cluster` variable from label_values(stepwatch_build_info, cluster) that
allows All, panels with unique ids inside the 24-column grid, and an `expr` on every
target. Prints the number of expressions found; promql_check.py parses them.
"""

import glob
import json
import os
import sys

from report import report_errors

DS_REF = "${datasource}"


def walk(panels):
    for p in panels:
        yield p
        yield from walk(p.get("panels", []))


def check(path, seen_uids, errors):
    name = os.path.basename(path)
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        errors.append(f"{name}: invalid JSON: {e}")
        return 0
    err = lambda msg: errors.append(f"{name}: {msg}")  # noqa: E731
    if not isinstance(d.get("schemaVersion"), int) or d["schemaVersion"] < 36:
        err(f"schemaVersion {d.get('schemaVersion')} < 36")
    for key in ("uid", "title"):
        if not d.get(key):
            err(f"no {key}")
    if d.get("uid") in seen_uids:
        err(f"uid {d.get('uid')} used twice")
    seen_uids.add(d.get("uid"))
    if d.get("id") is not None:
        err("id must be null so that import creates the dashboard")
    variables = {v["name"]: v for v in d.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        err("needs a `datasource` variable of type datasource (prometheus)")
    cl = variables.get("cluster")
    if not cl:
        err("needs a `cluster` variable")
    else:
        q = cl["query"]["query"] if isinstance(cl["query"], dict) else cl["query"]
        if q.replace(" ", "") != "label_values(stepwatch_build_info,cluster)" or not cl.get(
            "includeAll"
        ):
            err(
                "cluster variable must be label_values(stepwatch_build_info, cluster) with includeAll"
            )
    for vname, v in variables.items():
        if v.get("type") == "query" and v.get("datasource", {}).get("uid") != DS_REF:
            err(f"variable {vname} does not use {DS_REF}")
    ids = set()
    n_expr = 0
    for p in walk(d.get("panels", [])):
        title = p.get("title", "?")
        if p.get("id") in ids:
            err(f"panel id {p.get('id')} used twice")
        ids.add(p.get("id"))
        g = p.get("gridPos", {})
        if not all(k in g for k in "xywh") or g["x"] + g["w"] > 24:
            err(f"panel {title!r}: bad gridPos {g}")
        if p.get("type") == "row":
            continue
        if p.get("datasource", {}).get("uid") != DS_REF:
            err(f"panel {title!r}: datasource must be {DS_REF}")
        if not p.get("targets"):
            err(f"panel {title!r}: no targets")
        for t in p.get("targets", []):
            if t.get("datasource", {}).get("uid") != DS_REF:
                err(f"panel {title!r} target {t.get('refId')}: datasource must be {DS_REF}")
            if not t.get("expr", "").strip():
                err(f"panel {title!r} target {t.get('refId')}: no expr")
            else:
                n_expr += 1
    return n_expr


def main(argv):
    files = sorted(glob.glob(os.path.join(argv[1], "*.json")))
    errors, uids = [], set()
    total = sum(check(f, uids, errors) for f in files)
    if not files:
        errors.append("no dashboards found")
    return report_errors(
        errors,
        f"{len(files)} dashboards, {total} panel expressions: " + ("FAILED" if errors else "ok"),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv))
