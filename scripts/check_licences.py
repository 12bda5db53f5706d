#!/usr/bin/env python3
"""Licence check of the Rust dependency tree, offline (what `cargo deny check licenses` does).

    scripts/check_licences.py [--third-party OUT] [--target TRIPLE]...

Reads `cargo metadata --format-version 1 --locked` for the given targets (default: the host's
and aarch64-unknown-linux-gnu, the image's two architectures), evaluates every package's SPDX
`license` expression against ALLOWED (permissive licences only) and prints one line per
package. Fails when an expression cannot be satisfied with allowed licences, when a package has
no `license` field, or when a workspace member is not Apache-2.0.

With --third-party OUT, also writes the licence texts of the crates compiled into the shipped
agent (`stepwatch --no-default-features --features preflight,components`: normal dependencies
of the root, no dev or build dependencies) into OUT, as binary redistribution of MIT/BSD/ISC
code requires.
The texts are the LICENSE*/COPYING*/NOTICE* files of each crate's source in Cargo's registry.

Advisories (RustSec) need their database from the network and are not checked here.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import re
import subprocess
import sys

# SPDX identifiers accepted for a dependency: permissive, no copyleft, no field-of-use terms.
ALLOWED = {
    "0BSD",
    "Apache-2.0",
    "Apache-2.0 WITH LLVM-exception",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "BSL-1.0",
    "CC0-1.0",
    "CDLA-Permissive-2.0",
    "ISC",
    "MIT",
    "MIT-0",
    "Unicode-3.0",
    "Unicode-DFS-2016",
    "Unlicense",
    "Zlib",
}
OWN_LICENCE = "Apache-2.0"
DEFAULT_TARGETS = ["x86_64-unknown-linux-gnu", "aarch64-unknown-linux-gnu"]
LICENCE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE|COPYRIGHT)", re.IGNORECASE)


def tokens(expr: str) -> list[str]:
    # Old crates write "MIT/Apache-2.0": the slash is an OR.
    expr = expr.replace("/", " OR ")
    return re.findall(r"\(|\)|[A-Za-z0-9.+\-]+", expr)


def satisfiable(expr: str, allowed: set[str]) -> bool:
    """True when the SPDX expression can be met using only `allowed` licences."""
    toks = tokens(expr)
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(toks):
            raise ValueError(f"unexpected end of {expr!r}")
        pos += 1
        return toks[pos - 1]

    def primary() -> bool:
        t = take()
        if t == "(":
            v = chain()
            if take() != ")":
                raise ValueError(f"unbalanced parentheses in {expr!r}")
            return v
        if t in ("AND", "OR", "WITH", ")"):
            raise ValueError(f"unexpected {t!r} in {expr!r}")
        ident = t
        if peek() == "WITH":
            take()
            ident = f"{t} WITH {take()}"
            # A licence with an exception is acceptable when the licence alone is.
            return ident in allowed or t in allowed
        return ident in allowed

    # Binary operators, loosest first: OR joins AND-chains, AND joins primaries.
    operators = (("OR", operator.or_), ("AND", operator.and_))

    def chain(level: int = 0) -> bool:
        if level == len(operators):
            return primary()
        op, join = operators[level]
        v = chain(level + 1)
        while peek() == op:
            take()
            v = join(chain(level + 1), v)
        return v

    result = chain()
    if pos != len(toks):
        raise ValueError(f"trailing tokens in {expr!r}")
    return result


def metadata(targets: list[str]) -> dict:
    cmd = ["cargo", "metadata", "--format-version", "1", "--locked"]
    for t in targets:
        cmd += ["--filter-platform", t]
    return json.loads(subprocess.check_output(cmd))


def shipped(meta: dict, root_name: str) -> set[str]:
    """Ids of the packages compiled into `root_name`'s binary (normal dependencies only)."""
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    root = next(p["id"] for p in meta["packages"] if p["name"] == root_name)
    seen, todo = set(), [root]
    # Features of the root's default set that the release binary leaves out (dev-tools beyond
    # preflight, which ships: fake-nvml is in the binary).
    dev_tools = {"stepwatch-client", "stepwatch-sim", "stepwatch-proto"}
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        for dep in nodes[pid]["deps"]:
            kinds = {k["kind"] for k in dep["dep_kinds"]}
            if None not in kinds:
                continue  # dev or build only
            if pid == root and dep["name"].replace("_", "-") in dev_tools:
                continue
            todo.append(dep["pkg"])
    return seen


def third_party(meta: dict, ids: set[str], out: str) -> int:
    pkgs = sorted(
        (p for p in meta["packages"] if p["id"] in ids and p["source"]),
        key=lambda p: (p["name"], p["version"]),
    )
    missing = []
    with open(out, "w", encoding="utf-8") as f:
        f.write(
            "Third-party software compiled into the stepwatch agent binary\n"
            "(Rust crates; generated by scripts/check_licences.py from Cargo.lock).\n\n"
        )
        for p in pkgs:
            f.write(f"{p['name']} {p['version']}: {p['license']}\n")
        for p in pkgs:
            d = os.path.dirname(p["manifest_path"])
            files = sorted(n for n in os.listdir(d) if LICENCE_FILE.match(n))
            if p.get("license_file"):
                files.append(p["license_file"])
            if not files:
                missing.append(p["name"])
            for n in dict.fromkeys(files):
                path = os.path.join(d, n)
                if not os.path.isfile(path):
                    continue
                f.write(f"\n{'=' * 78}\n{p['name']} {p['version']}: {n}\n{'=' * 78}\n\n")
                with open(path, encoding="utf-8", errors="replace") as lf:
                    f.write(lf.read().rstrip() + "\n")
    for name in missing:
        # The SPDX identifier above is all the crate ships; say so rather than fail.
        print(f"note: {name} ships no licence file; its SPDX expression is listed")
    return len(pkgs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", help="target triple (repeatable)")
    ap.add_argument("--third-party", metavar="OUT", help="write the shipped crates' licence texts")
    ap.add_argument("--quiet", action="store_true", help="print only failures and the summary")
    args = ap.parse_args()

    meta = metadata(args.target or DEFAULT_TARGETS)
    members = set(meta["workspace_members"])
    failures = []
    by_licence: dict[str, list[str]] = {}
    for p in sorted(meta["packages"], key=lambda p: (p["name"], p["version"])):
        name = f"{p['name']} {p['version']}"
        lic = p.get("license")
        if p["id"] in members:
            if lic != OWN_LICENCE:
                failures.append(f"{name}: workspace member is {lic!r}, not {OWN_LICENCE}")
            continue
        if not lic:
            failures.append(f"{name}: no SPDX license field (license_file={p.get('license_file')})")
            continue
        try:
            ok = satisfiable(lic, ALLOWED)
        except ValueError as e:
            failures.append(f"{name}: {e}")
            continue
        if not ok:
            failures.append(f"{name}: {lic} is not satisfiable with permissive licences")
        by_licence.setdefault(lic, []).append(name)

    if not args.quiet:
        for lic, names in sorted(by_licence.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            print(f"{len(names):4d}  {lic}: {', '.join(names)}")
    for f in failures:
        print(f"FAIL {f}")
    deps = sum(len(v) for v in by_licence.values())
    print(
        f"licences: {deps} dependencies, {len(members)} workspace members; "
        f"{len(failures)} failure(s) (allowed: {', '.join(sorted(ALLOWED))})"
    )
    if args.third_party:
        n = third_party(meta, shipped(meta, "stepwatch"), args.third_party)
        print(f"licences: {n} crates' licence texts written to {args.third_party}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
