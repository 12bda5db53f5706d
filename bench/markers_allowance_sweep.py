"""Re-score the markers-only predictions of a kept accuracy run under other layout allowances.

    bench/torch-accuracy.sh --variants markers --cases roomy --keep  # "work folder kept: DIR"
    python3 bench/markers_allowance_sweep.py DIR

The markers basis predicts step 2's allocated peak and then adds a *layout
allowance*: a fixed share (`PredictConfig::layout_allowance_fraction`, 1/16) of the
optimizer state that was carved out of step 1's cache. This script takes each
rank's prediction before step 2 from the run's reports, swaps the allowance for
each fraction in FRACTIONS (keeping the prediction's floors: step 1's reserved and
NVML peaks) and scores it against the NVML peak the rank reached from step 2 on,
as the accuracy harness does. It also prints, per rank, the fraction that would
have been exact. It answers one question: can any fixed fraction meet the
markers targets (median |error| <= 2%, max <= 5%)?
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

FRACTIONS = [0.0, 0.0625, 0.1, 0.15, 0.21, 0.3, 0.5, 1.0]


def load(folder: str) -> list[tuple[str, int, int, int, int, int, int]]:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "r*", "report-*.json"))):
        with open(path) as f:
            report = json.load(f)
        prediction = report.get("prediction_before_step2")
        later = report["steps"][1:]
        if not prediction or prediction["inputs"]["basis"] != "allocator" or not later:
            continue
        inputs = prediction["inputs"]
        reserved_peak = max(
            ph["allocator_at_end"]["reserved_peak_bytes"]
            for s in later
            for ph in s["phases"]
            if ph.get("allocator_at_end")
        )
        nvml_peak = max(s["nvml_peak_bytes"] or 0 for s in later)
        overhead = prediction["predicted_peak_bytes"] - inputs["predicted_reserved_bytes"]
        without_allowance = inputs["predicted_reserved_bytes"] - inputs["layout_allowance_bytes"]
        rows.append(
            (
                f"{report['job']} rank {report['rank']}",
                without_allowance,
                inputs["state_from_cache_bytes"],
                overhead,
                nvml_peak,
                inputs["step1_reserved_peak_bytes"] or 0,
                inputs["step1_nvml_peak_bytes"] or 0,
            )
        )
        exact = (
            (reserved_peak - without_allowance) / inputs["state_from_cache_bytes"]
            if inputs["state_from_cache_bytes"]
            else None
        )
        print(
            f"{report['job']} rank {report['rank']}: exact fraction "
            f"{'-' if exact is None else round(exact, 2)}"
        )
    return rows


def errors(rows: list[tuple[str, int, int, int, int, int, int]], fraction: float) -> list[float]:
    out = []
    for _, without, from_cache, overhead, nvml_peak, step1_reserved, step1_nvml in rows:
        reserved = max(without + round(fraction * from_cache), step1_reserved)
        device = max(reserved + overhead, step1_nvml)
        out.append((device - nvml_peak) / nvml_peak)
    return out


def main() -> int:
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    rows = load(sys.argv[1])
    if not rows:
        print(f"no markers-basis predictions in {sys.argv[1]}", file=sys.stderr)
        return 1
    for fraction in FRACTIONS:
        e = [abs(x) for x in errors(rows, fraction)]
        print(
            f"fraction {fraction:.4f}: median |error| {100 * statistics.median(e):.2f}%, "
            f"max {100 * max(e):.2f}% over {len(e)} ranks"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
