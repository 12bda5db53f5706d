"""Files generated from sources in this repository: write the ones that differ,
or, in check mode, change nothing and show how each differs.

Shared by dashboards/generate.py and deploy/scripts/sync_generated.py, which
import it by path (they are run as scripts). Standard library only.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterable, Mapping


def sync(root: str, want: Mapping[str, str], check: bool, shown_as: str = "") -> list[str]:
    """The paths of ``want`` (relative to ``root``; ``shown_as`` prefixes them in
    messages) whose file is missing or holds other text than their value. Without
    ``check`` they are rewritten; with it nothing changes and a unified diff of
    each is printed."""
    stale = []
    for rel, content in sorted(want.items()):
        path = os.path.join(root, rel)
        have = open(path).read() if os.path.exists(path) else None
        if have == content:
            continue
        stale.append(rel)
        if check:
            sys.stdout.writelines(
                difflib.unified_diff(
                    (have or "").splitlines(True),
                    content.splitlines(True),
                    f"{shown_as}{rel} (on disk)",
                    f"{shown_as}{rel} (generated)",
                )
            )
        else:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(content)
    return stale


def report(check: bool, what: str, total: int, changed: Iterable[str], command: str) -> int:
    """Says what :func:`sync` found or did for ``total`` files of kind ``what``;
    the exit code: 1 when a check found ``changed`` files (``command`` fixes them)."""
    changed = list(changed)
    if check:
        if changed:
            print(f"stale {what}: {', '.join(changed)}; run {command}")
            return 1
        print(f"  {total} {what} up to date")
    else:
        print(f"wrote {len(changed)} of {total} {what}")
    return 0
