#!/usr/bin/env python3
"""Checks that the promtool unit tests cover every rule, and that every alert is complete.

  check_rule_tests.py RULES.yml TEST.yml...

* every alert has at least one alert_rule_test where it fires (exp_alerts not empty) and
  one where it must stay silent (exp_alerts empty);
* every recording rule is asserted by a promql_expr_test with expected samples;
* every alert is named Stepwatch*, has a severity label (warning or critical) and summary,
  description and runbook annotations, its runbook names deploy/runbooks/<alert>.md, which
  exists, and it carries no runbook_url (no address serves the runbooks by default, so a
  default link would be dead) (one runbook per alert, and no runbook without its alert);
* StepwatchStep2OOMPredicted fires without waiting (for: 0m), so it is raised during step 1;
* every alert can be configured through the Helm chart: the values schema
  (helm/stepwatch/values.schema.json, prometheusRule.alerts) names it and names no other, for
  it refuses keys it does not know.
"""

import json
import os
import re
import sys

import yaml
from report import report_errors

DEPLOY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNBOOKS = os.path.join(DEPLOY, "runbooks")
SCHEMA = os.path.join(DEPLOY, "helm", "stepwatch", "values.schema.json")


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    rules = yaml.safe_load(open(argv[1]))
    alerts, records = {}, []
    for g in rules["groups"]:
        for r in g["rules"]:
            if "alert" in r:
                alerts[r["alert"]] = r
            else:
                records.append(r["record"])
    fires, silent, asserted = set(), set(), set()
    for path in argv[2:]:
        doc = yaml.safe_load(open(path))
        for test in doc.get("tests", []):
            for at in test.get("alert_rule_test", []) or []:
                (fires if at.get("exp_alerts") else silent).add(at["alertname"])
            for et in test.get("promql_expr_test", []) or []:
                names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", et["expr"]))
                if et.get("exp_samples"):
                    asserted |= names
    errors = []
    for name, rule in sorted(alerts.items()):
        if name not in fires:
            errors.append(f"alert {name}: no test where it fires")
        if name not in silent:
            errors.append(f"alert {name}: no test where it stays silent")
        if not name.startswith("Stepwatch"):
            errors.append(f"alert {name}: not named Stepwatch*")
        if rule.get("labels", {}).get("severity") not in ("warning", "critical"):
            errors.append(f"alert {name}: severity label must be warning or critical")
        ann = rule.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            if not ann.get(key, "").strip():
                errors.append(f"alert {name}: no {key} annotation")
        # No address serves the runbooks until a user publishes them: any URL here would be
        # a dead link in every fresh install (the chart and the agent add one from a base
        # URL the user sets).
        if "runbook_url" in ann:
            errors.append(
                f"alert {name}: runbook_url {ann['runbook_url']!r} in the default rules "
                "(no address serves the runbooks by default: name the page in `runbook`)"
            )
        if not ann.get("runbook", "").startswith(
            f"{name}.md in stepwatch's runbooks (deploy/runbooks"
        ):
            errors.append(
                f"alert {name}: runbook {ann.get('runbook', '')!r} must name {name}.md "
                "in stepwatch's runbooks (deploy/runbooks; ...)"
            )
        if not os.path.isfile(os.path.join(RUNBOOKS, f"{name}.md")):
            errors.append(f"alert {name}: no runbook deploy/runbooks/{name}.md")
    for md in sorted(os.listdir(RUNBOOKS)):
        if md.endswith(".md") and md != "README.md" and md[:-3] not in alerts:
            errors.append(f"deploy/runbooks/{md}: no alert of that name")
    for name in records:
        if name not in asserted:
            errors.append(f"recording rule {name}: no promql_expr_test with expected samples")
    for name in sorted(set(fires | silent) - set(alerts)):
        errors.append(f"tests name alert {name}, which the rules do not define")
    oom = alerts.get("StepwatchStep2OOMPredicted")
    if oom is None or oom.get("for", "0m") not in ("0m", "0s", 0):
        errors.append("StepwatchStep2OOMPredicted must exist and have for: 0m (fire during step 1)")
    schema = json.load(open(SCHEMA))
    configurable = set(schema["properties"]["prometheusRule"]["properties"]["alerts"]["properties"])
    for name in sorted(set(alerts) - configurable):
        errors.append(f"alert {name}: not in the chart's values schema (prometheusRule.alerts)")
    for name in sorted(configurable - set(alerts)):
        errors.append(f"values schema: prometheusRule.alerts.{name} names no alert")
    return report_errors(
        errors,
        f"{len(alerts)} alerts (each fires and stays silent in a test), {len(records)} recording rules asserted: "
        + ("FAILED" if errors else "ok"),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv))
