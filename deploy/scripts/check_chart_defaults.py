#!/usr/bin/env python3
"""Checks of the chart's defaults that no Helm command makes on its own.

  check_chart_defaults.py schema CHART
      values.schema.json names every top-level key of values.yaml and admits no other
      (additionalProperties: false), so a misspelt key fails `helm lint` and every render;
      proved with the real Helm engine on a typo of each top-level key that holds an object.

  check_chart_defaults.py links CHART_OR_TGZ FILE...
      No default points at an address that does not exist: every http(s) URL in the chart's
      values.yaml, Chart.yaml and templates, and in the given rendered manifests (the default
      render, deploy/kubernetes/*.yaml), is checked against DEAD (the project has no public
      repository or site yet). With runbookBaseURL "" each alert's `runbook` annotation must
      name a page the chart ships (files/runbooks/<alert>.md).

Needs helm-python-sdk and PyYAML (deploy/test.sh's venv).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tarfile

import yaml

# Addresses a fresh install must not link to: the project's would-be public home, which does
# not exist. Extend when an address goes away.
DEAD = [
    re.compile(r"https?://(www\.)?github\.com/stepwatch(/|\b)", re.IGNORECASE),
    re.compile(r"https?://(www\.)?stepwatch\.(io|dev|org)(/|\b)", re.IGNORECASE),
]
URL = re.compile(r"https?://[^\s\"'<>)`]+")


def chart_files(chart: str) -> dict[str, str]:
    """Relative path -> text of every file of a chart directory or packaged .tgz."""
    out = {}
    if os.path.isdir(chart):
        for root, _dirs, files in os.walk(chart):
            for name in files:
                path = os.path.join(root, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    out[os.path.relpath(path, chart)] = f.read()
    else:
        with tarfile.open(chart) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    rel = m.name.split("/", 1)[1]
                    out[rel] = tar.extractfile(m).read().decode("utf-8", "replace")
    return out


def cmd_schema(chart: str) -> int:
    import helm_python as helm

    values = yaml.safe_load(open(os.path.join(chart, "values.yaml")))
    schema = json.load(open(os.path.join(chart, "values.schema.json")))
    errors = []
    props = schema.get("properties", {})
    missing = [k for k in values if k not in props]
    extra = [k for k in props if k not in values]
    if missing:
        errors.append(f"values.yaml keys without a schema: {', '.join(missing)}")
    if extra:
        errors.append(f"schema keys without a default in values.yaml: {', '.join(extra)}")
    if schema.get("additionalProperties") is not False:
        errors.append("the schema's top level must set additionalProperties: false")
    # A typo of each top-level key: the render must refuse it, naming the key.
    typos = 0
    for key, default in values.items():
        typo = key[:-1] if len(key) > 3 else key + "x"
        try:
            with helm.Chart.load(chart) as c:
                c.render({typo: default}, name="stepwatch", namespace="stepwatch", is_install=True)
            errors.append(f"a misspelt {key} ({typo}) rendered")
        except helm.HelmError as e:
            if typo not in str(e):
                errors.append(f"{typo}: refused, but the error does not name it: {e}")
        typos += 1
    report = helm.lint(chart, {"podAtribution": {"enabled": True}}, strict=True)
    if not any("podAtribution" in e for e in report.get("errors", [])):
        errors.append(f"helm lint passed values with podAtribution: {report}")
    for e in errors:
        print("FAIL", e)
    print(
        f"  schema: {len(props)} of {len(values)} top-level keys, additionalProperties: false; "
        f"{typos} misspelt keys refused by the render, podAtribution by helm lint"
    )
    return 1 if errors else 0


def dead_urls(name: str, text: str) -> list[str]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for url in URL.findall(line):
            if any(d.match(url) for d in DEAD):
                out.append(f"{name}:{n}: {url}")
    return out


def cmd_links(chart: str, rendered: list[str]) -> int:
    files = chart_files(chart)
    errors = []
    for rel in sorted(files):
        if rel in ("values.yaml", "Chart.yaml", "values.schema.json") or rel.startswith(
            "templates/"
        ):
            errors += dead_urls(f"chart {rel}", files[rel])
    runbooks = {rel for rel in files if rel.startswith("files/runbooks/")}
    alerts = 0
    for path in rendered:
        text = open(path).read()
        errors += dead_urls(path, text)
        for doc in yaml.safe_load_all(text):
            if not doc or doc.get("kind") != "PrometheusRule":
                continue
            for g in doc["spec"]["groups"]:
                for r in g["rules"]:
                    if "alert" not in r:
                        continue
                    alerts += 1
                    ann = r.get("annotations", {})
                    if "runbook_url" in ann:
                        continue
                    page = f"files/runbooks/{r['alert']}.md"
                    if not ann.get("runbook", "").startswith(page + " "):
                        errors.append(
                            f"{path}: {r['alert']}: no runbook_url, and no runbook annotation naming {page}"
                        )
                    elif page not in runbooks:
                        errors.append(f"{path}: {r['alert']}: the chart does not ship {page}")
    for e in errors:
        print("FAIL dead default:", e)
    print(
        f"  links: {len(errors)} dead default(s) (URLs under {', '.join(d.pattern for d in DEAD)}); "
        f"{alerts} alerts' runbooks resolve ({len(runbooks)} pages in the chart)"
    )
    return 1 if errors else 0


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "schema":
        return cmd_schema(sys.argv[2])
    if len(sys.argv) >= 3 and sys.argv[1] == "links":
        return cmd_links(sys.argv[2], sys.argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
