#!/usr/bin/env python3
"""Generate the alerts reference from the Prometheus rules.

Reads every alerting rule of deploy/prometheus/*.yml (name, severity, `for`,
summary, description, expression, runbook) and writes the region between
`<!-- BEGIN GENERATED: alerts -->` and `<!-- END GENERATED: alerts -->` in
docs/src/reference/alerts.md. The prose around the region is hand-written.

    python3 docs/gen-reference.py           # rewrite the page
    python3 docs/gen-reference.py --check   # exit 1 when the page is stale

Needs PyYAML (Debian's python3-yaml, or the venv of deploy/test.sh).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES_DIR = ROOT / "deploy" / "prometheus"
ALERTS_PAGE = ROOT / "docs" / "src" / "reference" / "alerts.md"
REPO_URL = "https://github.com/stepwatch/stepwatch/blob/main/"


def load_yaml(path: Path) -> object:
    try:
        import yaml
    except ImportError:
        sys.exit(
            "gen-reference.py needs PyYAML: apt-get install python3-yaml, "
            "or run it with the venv of deploy/test.sh"
        )
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def alerting_rules() -> list[tuple[Path, dict]]:
    """Every alerting rule of the rule files in deploy/prometheus/, in file order."""
    found = []
    for path in sorted(RULES_DIR.glob("*.yml")):
        doc = load_yaml(path)
        if not isinstance(doc, dict) or "groups" not in doc:
            continue  # a scrape config, not a rule file
        for group in doc["groups"]:
            for rule in group.get("rules", []):
                if "alert" in rule:
                    found.append((path, rule))
    if not found:
        sys.exit(f"no alerting rules found in {RULES_DIR}")
    return found


def readable(template: str) -> str:
    """An annotation's Go template as text: `{{ $labels.x }}` becomes *x*."""
    text = re.sub(
        r"\{\{\s*with \$labels\.(\w+)\s*\}\}(.*?)\{\{\s*\.\s*\}\}(.*?)\{\{\s*end\s*\}\}",
        r"\2*\1*\3",
        template,
    )
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", r"*\1*", text)
    text = re.sub(r"\{\{\s*\$value[^}]*\}\}", "*value*", text)
    if "{{" in text:
        raise ValueError(f"template not understood: {template!r}")
    return text


def runbook_link(url: str) -> str:
    """The runbook as a link; a page of this repository is named by its path."""
    name = url.rsplit("/", 1)[-1].removesuffix(".md")
    return f"[{name}]({url})"


def for_text(value: object) -> str:
    text = str(value or "0m")
    return "none" if text in ("0", "0s", "0m") else text


def render() -> str:
    rules = alerting_rules()
    lines = [
        "| alert | severity | `for` | summary | runbook |",
        "| --- | --- | --- | --- | --- |",
    ]
    for _, rule in rules:
        ann = rule.get("annotations", {})
        lines.append(
            "| [{name}](#{anchor}) | {sev} | {for_} | {summary} | {runbook} |".format(
                name=rule["alert"],
                anchor=rule["alert"].lower(),
                sev=rule.get("labels", {}).get("severity", ""),
                for_=for_text(rule.get("for")),
                summary=readable(ann.get("summary", "")).replace("|", "\\|"),
                runbook=runbook_link(ann["runbook_url"]) if "runbook_url" in ann else "",
            )
        )
    for path, rule in rules:
        ann = rule.get("annotations", {})
        source = path.relative_to(ROOT).as_posix()
        lines += [
            "",
            f"### {rule['alert']}",
            "",
            "Severity **{}**, `for` {}. Defined in [{}]({}).".format(
                rule.get("labels", {}).get("severity", ""),
                for_text(rule.get("for")),
                source,
                REPO_URL + source,
            ),
            "",
            f"> {readable(ann.get('summary', ''))}",
            "",
            readable(ann.get("description", "")),
            "",
            "```promql",
            str(rule["expr"]).rstrip("\n"),
            "```",
        ]
        if "runbook_url" in ann:
            lines += ["", f"Runbook: {runbook_link(ann['runbook_url'])}."]
    return "\n".join(lines) + "\n"


def replace_region(page: str, name: str, body: str) -> str:
    begin = f"<!-- BEGIN GENERATED: {name} -->\n"
    end = f"<!-- END GENERATED: {name} -->"
    start = page.find(begin)
    stop = page.find(end)
    if start < 0 or stop < start:
        sys.exit(f"{ALERTS_PAGE}: no region {begin.strip()} … {end}")
    return page[: start + len(begin)] + body + page[stop:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed page differs")
    args = parser.parse_args()

    current = ALERTS_PAGE.read_text(encoding="utf-8")
    wanted = replace_region(current, "alerts", render())
    rel = ALERTS_PAGE.relative_to(ROOT)
    if args.check:
        if current != wanted:
            sys.stdout.writelines(
                difflib.unified_diff(
                    current.splitlines(keepends=True),
                    wanted.splitlines(keepends=True),
                    f"{rel} (committed)",
                    f"{rel} (from the rules)",
                )
            )
            print(f"{rel} is stale: run python3 docs/gen-reference.py", file=sys.stderr)
            return 1
        print(f"{rel}: up to date")
        return 0
    if current != wanted:
        ALERTS_PAGE.write_text(wanted, encoding="utf-8")
        print(f"{rel}: rewritten")
    else:
        print(f"{rel}: unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
