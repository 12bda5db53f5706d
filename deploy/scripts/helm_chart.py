#!/usr/bin/env python3
"""Lint and render the stepwatch Helm chart with the real Helm engine.

Uses helm-python-sdk (PyPI), which binds Helm's own Go SDK (v4) through a C ABI: the same
template engine, value merging, schema checks and linter as the `helm` CLI, without a
`helm` binary. Usage:

  helm_chart.py lint CHART_DIR [--values FILE]...
  helm_chart.py render CHART_DIR [--name N] [--namespace NS] [--values FILE]... [--set-json JSON]...

`render` prints every rendered manifest (NOTES.txt excluded) as one multi-document YAML
stream, in template order, the way `helm template` does.
"""

import argparse
import json
import sys

import helm_python as helm
import yaml


def deep_merge(base, extra):
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value
    return base


def load_values(args):
    values = {}
    for path in args.values or []:
        with open(path) as f:
            deep_merge(values, yaml.safe_load(f) or {})
    for text in args.set_json or []:
        deep_merge(values, json.loads(text))
    return values


def cmd_lint(args):
    report = helm.lint(
        args.chart,
        load_values(args) or None,
        strict=True,
        namespace=args.namespace,
        kube_version=args.kube_version,
    )
    failed = False
    for msg in report.get("messages", []):
        level = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}.get(msg["severity"], "?")
        print(f"  [{level}] {msg['path']}: {msg['error']}")
        if msg["severity"] >= 2:
            failed = True
    for err in report.get("errors", []):
        print(f"  [ERROR] {err}")
        failed = True
    print(
        f"  helm lint (Helm SDK {helm.helm_sdk_version()}): {report.get('total_charts_linted', 0)} chart(s), "
        + ("FAILED" if failed else "ok")
    )
    return 1 if failed else 0


def cmd_render(args):
    with helm.Chart.load(args.chart) as chart:
        manifests = chart.render(
            load_values(args), name=args.name, namespace=args.namespace, is_install=True
        )
    docs = []
    for path in sorted(manifests):
        if path.endswith("NOTES.txt") or not manifests[path].strip():
            continue
        for doc in yaml.safe_load_all(manifests[path]):
            if doc:
                docs.append(f"# Source: {path}\n" + yaml.safe_dump(doc, sort_keys=False))
    sys.stdout.write("---\n".join(docs))
    return 0


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("command", choices=["lint", "render"])
    p.add_argument("chart")
    p.add_argument("--name", default="stepwatch")
    p.add_argument("--namespace", default="stepwatch")
    p.add_argument("--kube-version", default=None)
    p.add_argument("--values", action="append")
    p.add_argument("--set-json", action="append")
    args = p.parse_args()
    try:
        return cmd_lint(args) if args.command == "lint" else cmd_render(args)
    except helm.HelmError as exc:
        print(f"helm {args.command} failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
