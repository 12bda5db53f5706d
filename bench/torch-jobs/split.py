"""The fixed tuning / held-out split of jobs.json: the rule, and a check that jobs.json follows it.

    python bench/torch-jobs/split.py            # check jobs.json (exit 1 on a difference)
    python bench/torch-jobs/split.py --show     # the split, family by family
    python bench/torch-jobs/split.py --write    # write the "set" of every job into jobs.json

The rule, fixed on 2026-12-07 before any predictor change of issue 28:

- Each job has a ``family`` (the kind of loop it is). Within a family, the jobs
  are ordered by ``sha256("stepwatch-28-split:" + name)`` (hex, as a number).
- They alternate, ``held_out`` first when ``sha256("stepwatch-28-split:" +
  family)`` is even, ``tuning`` first when it is odd. So every family of two or
  more jobs is in both sets, and the sets differ by at most one job per family.
- A job added to jobs.json later takes ``held_out`` when
  ``sha256("stepwatch-28-split:" + name)`` is even, ``tuning`` when odd, and
  no job already split ever moves: ``SPLIT_2026_12_07`` below lists the jobs
  the alternation applies to.

Predictor changes are judged on the tuning set; the held-out set is run and
reported when a change is done, and its figures go into BENCHMARKS.md as they
came out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = "stepwatch-28-split:"
SETS = ("tuning", "held_out")

# The jobs of jobs.json on 2026-12-07, split by the alternation rule.
SPLIT_2026_12_07 = frozenset(
    """
    gpt-adamw gpt-adamw-fused gpt-sgd gpt-sgd-momentum gpt-bf16-autocast gpt-fp32
    gpt-grad-accum gpt-zero-grad-keep gpt-precreated-state gpt-expandable-segments ddp-2
    ddp-uneven fsdp2-4 cnn-batchnorm lightning-gpt hf-trainer-llama gpt-bf16-weights
    gpt-activation-checkpointing gpt-adam-amsgrad gpt-adagrad gpt-rmsprop gpt-adafactor
    gpt-lion gpt-adamw-foreach-false gpt-groups-sched-clip gpt-eval-every gpt-checkpoint
    gpt-warmup-batch gpt-frozen-layers hf-gpt2-loop hf-llama-lora-bf16 hf-t5-adafactor
    hf-bert-mlm hf-bert-cls-frozen-emb hf-vit accelerate-gpt2 unet lstm-lm recsys-dlrm
    gan-dcgan ddp-zero ddp-no-sync fsdp1-2 fsdp2-2-no-reshard
    """.split()
)


def h(s: str) -> int:
    return int(hashlib.sha256((SEED + s).encode()).hexdigest(), 16)


def split(jobs: list[dict]) -> dict[str, str]:
    """name -> set, by the rule above."""
    out: dict[str, str] = {}
    families: dict[str, list[str]] = {}
    for j in jobs:
        if j["name"] in SPLIT_2026_12_07:
            families.setdefault(j["family"], []).append(j["name"])
        else:
            out[j["name"]] = "held_out" if h(j["name"]) % 2 == 0 else "tuning"
    for family, names in families.items():
        first = 1 if h(family) % 2 == 0 else 0  # index into SETS: held_out first when even
        for i, name in enumerate(sorted(names, key=h)):
            out[name] = SETS[(first + i) % 2]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", default=str(HERE / "jobs.json"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="write each job's set into the manifest")
    g.add_argument("--show", action="store_true", help="print the split by family")
    args = p.parse_args(argv)
    path = Path(args.manifest)
    jobs = json.loads(path.read_text())
    missing = [j["name"] for j in jobs if not j.get("family")]
    if missing:
        print(f"split: jobs without a family: {', '.join(missing)}", file=sys.stderr)
        return 1
    want = split(jobs)
    if args.write:
        for j in jobs:
            j["set"] = want[j["name"]]
        path.write_text(json.dumps(jobs, indent=2) + "\n")
        return 0
    if args.show:
        fams: dict[str, dict[str, list[str]]] = {}
        for j in jobs:
            fams.setdefault(j["family"], {s: [] for s in SETS})[want[j["name"]]].append(j["name"])
        for fam, by_set in fams.items():
            print(f"{fam}:")
            for s in SETS:
                print(f"  {s:9s}{', '.join(by_set[s]) or '-'}")
        counts = {s: sum(1 for v in want.values() if v == s) for s in SETS}
        print(f"tuning {counts['tuning']}, held_out {counts['held_out']}")
        return 0
    bad = [
        f"{j['name']}: {j.get('set')!r}, the rule says {want[j['name']]!r}"
        for j in jobs
        if j.get("set") != want[j["name"]]
    ]
    for b in bad:
        print(f"split: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
