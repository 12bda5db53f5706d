#!/usr/bin/env python3
"""Check the docs' links, and that the repository stands alone.

1. Every relative link and `#anchor` in the book (docs/src), README.md,
   BENCHMARKS.md, CHANGELOG.md, changelog.d/README.md, python/README.md and
   deploy/README.md resolves to a file of the repository (and to a heading of
   it). A page of the book links only within the book (docs/src): mdBook
   publishes nothing else, so a file outside it is named as a path, or brought
   in with `{{#include FILE}}`, which must name a file. The project has no
   public address yet: a link to one (the would-be GitHub repository or site)
   is dead and fails; other URLs are not fetched.
2. No file of the repository (tracked or not ignored; outside .git and
   target/) names the design notes kept beside the checkout: a user of the
   repository does not have them. Each offender is printed as path:line.
3. README.md, BENCHMARKS.md and CHANGELOG.md name no more than two
   commit-like hashes.

Exits 1 when any check fails. Standard library only.

    python3 docs/check-links.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "docs" / "src"
# The project's would-be public home, which does not exist.
DEAD = re.compile(r"^https?://(www\.)?(github\.com/stepwatch\b|stepwatch\.(io|dev|org)\b)", re.I)
# Built from parts, so that this file does not name it.
OUTSIDE = ".." + "/shared"
# Files that still name it and are not the docs' to change: reported, not failed.
# Remove a path once it is fixed (the check then keeps it fixed).
KNOWN_OUTSIDE: set[str] = set()
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")
MAX_HASHES = 2

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
INCLUDE = re.compile(r"\{\{#include\s+([^\s}]+)\s*\}\}")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def doc_files() -> list[Path]:
    files = sorted((ROOT / "docs" / "src").rglob("*.md"))
    for name in (
        "README.md",
        "BENCHMARKS.md",
        "CHANGELOG.md",
        "changelog.d/README.md",
        "python/README.md",
        "deploy/README.md",
    ):
        path = ROOT / name
        if path.exists():
            files.append(path)
    return files


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with inline code blanked out."""
    out = []
    fenced = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fenced is None:
                fenced = match.group(1)
            elif match.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            out.append((number, re.sub(r"`+[^`]*`+", "``", line)))
    return out


def expanded(path: Path, seen: frozenset[Path] = frozenset()) -> str:
    """The file's text with mdBook's `{{#include}}` directives replaced."""
    text = path.read_text(encoding="utf-8")
    if path in seen:
        return text

    def include(match: re.Match[str]) -> str:
        target = (path.parent / match.group(1).split(":")[0]).resolve()
        return expanded(target, seen | {path}) if target.is_file() else ""

    return INCLUDE.sub(include, text)


def slug(heading: str) -> str:
    """GitHub's (and mdBook's) id of a heading."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("`", "").strip().lower()
    return "".join(c if c.isalnum() or c in "-_" else "-" if c.isspace() else "" for c in text)


_anchors: dict[Path, set[str]] = {}


def anchors(path: Path) -> set[str]:
    if path not in _anchors:
        found: set[str] = set()
        counts: dict[str, int] = {}
        for _, line in prose_lines(expanded(path)):
            match = HEADING.match(line)
            if not match:
                continue
            base = slug(match.group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        html_ids = re.finditer(r"<a\s+(?:id|name)=\"([^\"]+)\"", path.read_text(encoding="utf-8"))
        found.update(match.group(1) for match in html_ids)
        _anchors[path] = found
    return _anchors[path]


def check_target(source: Path, target: str) -> str | None:
    """None when the link resolves, else why not."""
    if DEAD.match(target):
        return "the project's public address, which does not exist: link within the book or repo"
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
        return None  # another site, or mailto:
    raw, _, fragment = target.partition("#")
    if raw.startswith("/"):
        return "absolute path; use a path relative to the file"
    path = source.parent / unquote(raw) if raw else source
    try:
        path = path.resolve()
        path.relative_to(ROOT)
    except ValueError:
        return "points outside the repository"
    if source.resolve().is_relative_to(BOOK) and not path.is_relative_to(BOOK):
        return "leaves the book (mdBook publishes docs/src only): name the path or {{#include}} it"
    if not path.exists():
        return "no such file"
    if fragment and path.suffix == ".md" and fragment not in anchors(path):
        return f"no heading #{fragment} in {path.relative_to(ROOT)}"
    return None


def check_links() -> list[str]:
    problems = []
    for path in doc_files():
        rel = path.relative_to(ROOT)
        text = path.read_text(encoding="utf-8")
        for number, line in prose_lines(text):
            targets = [m.group(1) for m in LINK.finditer(line)]
            ref = REF_DEF.match(line)
            if ref:
                targets.append(ref.group(1))
            for target in targets:
                why = check_target(path, target)
                if why:
                    problems.append(f"{rel}:{number}: {target}: {why}")
        for number, line in enumerate(text.splitlines(), 1):
            for match in INCLUDE.finditer(line):
                included = (path.parent / match.group(1).split(":")[0]).resolve()
                if not included.is_file():
                    problems.append(f"{rel}:{number}: include {match.group(1)}: no such file")
    return problems


def repository_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout.split(b"\0")
        names = [n.decode() for n in listed if n]
    except (OSError, subprocess.CalledProcessError):
        names = [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if p.is_file() and not {".git", "target"} & set(p.relative_to(ROOT).parts)
        ]
    return [ROOT / n for n in sorted(set(names)) if not n.startswith(("target/", ".git/"))]


def check_outside() -> tuple[list[str], list[str]]:
    """Offenders that fail the check, and known ones to fix elsewhere."""
    failing, known = [], []
    needle = OUTSIDE.encode()
    for path in repository_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue  # deleted in the work tree, a dangling link
        if needle not in data:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(data.split(b"\n"), 1):
            if needle in line:
                (known if rel in KNOWN_OUTSIDE else failing).append(f"{rel}:{number}")
    return failing, known


def check_hashes() -> list[str]:
    problems = []
    for name in ("README.md", "BENCHMARKS.md", "CHANGELOG.md"):
        path = ROOT / name
        if not path.exists():
            continue
        found = HASH.findall(path.read_text(encoding="utf-8"))
        if len(found) > MAX_HASHES:
            problems.append(f"{name}: {len(found)} commit-like hashes ({', '.join(found)})")
    return problems


def main() -> int:
    failed = False
    links = check_links()
    for problem in links:
        print(f"broken link: {problem}")
    failed |= bool(links)

    outside, known = check_outside()
    for where in outside:
        print(f"points outside the repository ({OUTSIDE}): {where}")
    for where in known:
        print(f"known, to fix ({OUTSIDE}): {where}")
    fixed = sorted(KNOWN_OUTSIDE - {k.split(":")[0] for k in known})
    for rel in fixed:
        print(f"fixed: remove {rel} from KNOWN_OUTSIDE in docs/check-links.py")
    failed |= bool(outside)

    hashes = check_hashes()
    for problem in hashes:
        print(f"history in the docs: {problem}")
    failed |= bool(hashes)

    files = len(doc_files())
    if failed:
        print(f"docs check failed ({files} files)")
        return 1
    print(f"docs check passed: {files} files, every relative link resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
