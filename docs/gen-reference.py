#!/usr/bin/env python3
"""Generate the alerts reference and the runbooks page from the Prometheus rules.

Reads every alerting rule of deploy/prometheus/*.yml (name, severity, `for`,
summary, description, expression, runbook) and writes the region between
`<!-- BEGIN GENERATED: alerts -->` and `<!-- END GENERATED: alerts -->` in
docs/src/reference/alerts.md, and the region `runbooks` of
docs/src/reference/runbooks.md: one `{{#include}}` of deploy/runbooks/<alert>.md
per alert, so that the book carries the runbooks its alerts link to. The prose
around the regions is hand-written.

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
RUNBOOKS_PAGE = ROOT / "docs" / "src" / "reference" / "runbooks.md"
RUNBOOKS_DIR = ROOT / "deploy" / "runbooks"


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


def runbook_link(name: str) -> str:
    """The alert's runbook in the book (runbooks.md includes each one)."""
    return f"[{name}](runbooks.md#{name.lower()})"


def render_runbooks() -> str:
    """One include per alert, in the rules' order; every alert must have its page."""
    lines = []
    for _, rule in alerting_rules():
        page = RUNBOOKS_DIR / f"{rule['alert']}.md"
        if not page.is_file():
            sys.exit(f"alert {rule['alert']}: no runbook {page.relative_to(ROOT)}")
        rel = Path("..", "..", "..", page.relative_to(ROOT)).as_posix()
        lines += ["", "{{#include " + rel + "}}"]
    return "\n".join(lines[1:]) + "\n"


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
                runbook=runbook_link(rule["alert"]) if "runbook" in ann else "",
            )
        )
    for path, rule in rules:
        ann = rule.get("annotations", {})
        source = path.relative_to(ROOT).as_posix()
        lines += [
            "",
            f"### {rule['alert']}",
            "",
            "Severity **{}**, `for` {}. Defined in `{}`.".format(
                rule.get("labels", {}).get("severity", ""),
                for_text(rule.get("for")),
                source,
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
        if "runbook" in ann:
            lines += ["", f"Runbook: {runbook_link(rule['alert'])}."]
    return "\n".join(lines) + "\n"


def replace_region(path: Path, page: str, name: str, body: str) -> str:
    begin = f"<!-- BEGIN GENERATED: {name} -->\n"
    end = f"<!-- END GENERATED: {name} -->"
    start = page.find(begin)
    stop = page.find(end)
    if start < 0 or stop < start:
        sys.exit(f"{path}: no region {begin.strip()} … {end}")
    return page[: start + len(begin)] + body + page[stop:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed page differs")
    args = parser.parse_args()

    stale = 0
    for path, name, body in (
        (ALERTS_PAGE, "alerts", render()),
        (RUNBOOKS_PAGE, "runbooks", render_runbooks()),
    ):
        current = path.read_text(encoding="utf-8")
        wanted = replace_region(path, current, name, body)
        rel = path.relative_to(ROOT)
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
                stale += 1
            else:
                print(f"{rel}: up to date")
        elif current != wanted:
            path.write_text(wanted, encoding="utf-8")
            print(f"{rel}: rewritten")
        else:
            print(f"{rel}: unchanged")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
