"""Jobs of the accuracy corpus run for many steps on a roomy fake GPU: does the agent
report memory growth where none is? (issue 30's target: no growth advisory on the
corpus jobs run for 50 steps). bench/steady-growth.sh runs it; `--help` for the flags.

Each job runs once, unmodified PyTorch on fake CUDA against its own `stepwatch agent`
on fresh fake NVML GPUs (the accuracy harness's Agent, commands and environment:
bench/torch_accuracy.py), with `--steps N`. While it runs, every rank's report is read
about twice a second; per rank it records

- `growth_advisory`: whether a MEMORY_GROWTH advisory was given (advisory kind
  `memory_growth`), at which step, and its text;
- `forecast`: whether the report ever had a growth forecast (`memory_growth`), the
  first one seen;
- `largest_slope`: the largest Theil-Sen slope the report showed over the run, of
  the three figures (allocated and reserved at step end, the NVML step peak), with
  its confidence interval's lower end and the steps it was over. A slope whose lower
  end is above 0 is growth the agent finds significant; it becomes a forecast only
  when it adds 1% of the GPU's capacity over the window (growth.rs), so the row also
  gives `counts_below_gib`: the GPU size under which that slope would have been
  reported.

Without a GPU: the figures show the agent's reading of PyTorch's allocator on fake
CUDA (its kernels do nothing), not a real GPU's NVML noise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_accuracy as ta  # noqa: E402

# The order of MemoryTrend.slopes (GrowthSource::ALL).
SOURCES = ("allocated", "reserved", "nvml")
# GrowthConfig::min_window_growth_fraction: a slope counts when it adds this much of
# the capacity over its span.
MIN_WINDOW_GROWTH_FRACTION = 0.01
GROWTH_ADVISORY = "memory_growth"


class RankWatch:
    """What one rank's reports said over a run."""

    def __init__(self) -> None:
        self.steps_completed = 0
        self.advisory: Optional[dict[str, Any]] = None
        self.advisory_step: Optional[int] = None
        self.forecast: Optional[dict[str, Any]] = None
        self.largest: Optional[dict[str, Any]] = None  # slope, with its source
        self.post_mortem = False
        self.final_slopes: dict[str, Any] = {}  # the last report's, by figure

    def see(self, rep: dict[str, Any]) -> None:
        steps = int(rep.get("steps_completed") or 0)
        self.steps_completed = max(self.steps_completed, steps)
        adv = next(
            (a for a in rep.get("advisories") or [] if a.get("kind") == GROWTH_ADVISORY), None
        )
        if adv is not None and self.advisory is None:
            self.advisory, self.advisory_step = adv, adv.get("step")
        if rep.get("memory_growth") and self.forecast is None:
            self.forecast = dict(rep["memory_growth"], seen_at_step=steps)
        self.post_mortem = self.post_mortem or rep.get("post_mortem") is not None
        slopes = (rep.get("memory_trend") or {}).get("slopes") or []
        self.final_slopes = dict(zip(SOURCES, slopes))
        for source, s in zip(SOURCES, slopes):
            if s and (
                self.largest is None or s["bytes_per_step"] >= self.largest["bytes_per_step"]
            ):
                self.largest = dict(s, source=source)

    def row(self, job: ta.Job, rank: int, usable: int) -> dict[str, Any]:
        s = self.largest
        counts_below = None
        if s is not None and s["low_bytes_per_step"] > 0:
            span = s["last_step"] - s["first_step"]
            counts_below = s["bytes_per_step"] * span / MIN_WINDOW_GROWTH_FRACTION / ta.GIB
        return {
            "job": job.name,
            "set": job.set,
            "rank": rank,
            "usable_bytes": usable,
            "steps_completed": self.steps_completed,
            "growth_advisory": self.advisory is not None,
            "growth_advisory_step": self.advisory_step,
            "growth_advisory_text": (self.advisory or {}).get("message"),
            "forecast": self.forecast,
            "largest_slope": s,
            "final_slopes": self.final_slopes,
            "significant": s is not None and s["low_bytes_per_step"] > 0,
            "counts_below_gib": counts_below,
            "post_mortem": self.post_mortem,
        }


def run_job(h: ta.Harness, job: ta.Job, steps: int, n: int) -> list[dict[str, Any]]:
    """One job for `steps` steps on fresh roomy fake GPUs with its own agent."""
    rundir = h.work / f"r{n:03d}-{job.name}"
    rundir.mkdir()
    nvml_dir = rundir / "nvml"
    usable = int(h.opts.gib * ta.GIB)
    h.init_fake_gpus(nvml_dir, job.nproc, usable + ta.DRIVER_RESERVED_BYTES)
    job_id = re.sub(r"[^a-z0-9-]", "-", f"steady-{job.name}-{os.getpid()}-{n}".lower())
    agent = ta.Agent(h, rundir, nvml_dir)
    watches = {rank: RankWatch() for rank in range(job.nproc)}
    t0 = time.monotonic()
    try:
        agent.start()
        env = h.agent_env(job, job_id, agent, nvml_dir)
        cmd = h.on_fake_cuda(h.job_command(job, "--steps", str(steps)), job.nproc)
        (rundir / "cmd").write_text(" ".join(cmd) + "\n")
        with open(rundir / "job.out", "wb") as out, open(rundir / "job.err", "wb") as err:
            p = ta.start(cmd, group=True, stdout=out, stderr=err, env=env, cwd=str(h.repo))
            deadline = time.monotonic() + h.opts.run_timeout
            while p.poll() is None and time.monotonic() < deadline:
                for rank, w in watches.items():
                    rep = agent.get_json(f"/api/v1/jobs/{job_id}/ranks/{rank}")
                    if rep is not None:
                        w.see(rep)
                time.sleep(0.5)
            timed_out = p.poll() is None
            rc = ta.stop(p)
        if timed_out or rc != 0:
            raise ta.HarnessError(
                f"{job.name}: the job ended with status {rc}"
                + (f" (ran past --run-timeout {h.opts.run_timeout:.0f} s)" if timed_out else "")
                + f"; stderr:\n{ta.tail(rundir / 'job.err')}"
            )
        # The final reports, once every rank's stream has closed.
        for rank, rep in h._reports(agent, job, job_id).items():
            watches[rank].see(rep)
    finally:
        agent.stop()
    seconds = time.monotonic() - t0
    rows = [w.row(job, rank, usable) for rank, w in watches.items()]
    for r in rows:
        r["seconds"] = round(seconds, 1)
        ta.log(f"  {line(r)}")
    return rows


def kib(b: float) -> str:
    return f"{b / 1024:+.1f}"


def line(r: dict[str, Any]) -> str:
    s = r["largest_slope"]
    slope = (
        f"largest slope {kib(s['bytes_per_step'])} KiB/step ({s['source']},"
        f" low {kib(s['low_bytes_per_step'])}, steps {s['first_step']}-{s['last_step']})"
        if s
        else "no slope"
    )
    advisory = (
        f"GROWTH ADVISORY at step {r['growth_advisory_step']}"
        if r["growth_advisory"]
        else "no advisory"
    )
    forecast = "FORECAST" if r["forecast"] else "no forecast"
    return (
        f"{r['job']} rank {r['rank']}: {r['steps_completed']} steps, {advisory}, {forecast},"
        f" {slope} [{r['seconds']:.0f} s]"
    )


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| job | rank | steps | growth advisory | forecast | largest slope, KiB/step (figure;"
        " Sen's lower end) | significant | would count on a GPU under |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        s = r["largest_slope"]
        slope = (
            f"{kib(s['bytes_per_step'])} ({s['source']}; {kib(s['low_bytes_per_step'])})"
            if s
            else "—"
        )
        adv = f"yes, step {r['growth_advisory_step']}" if r["growth_advisory"] else "no"
        below = f"{r['counts_below_gib']:.2f} GiB" if r["counts_below_gib"] else "—"
        out.append(
            f"| `{r['job']}` | {r['rank']} | {r['steps_completed']} | {adv} |"
            f" {'yes' if r['forecast'] else 'no'} | {slope} |"
            f" {'yes' if r['significant'] else 'no'} | {below} |"
        )
    return "\n".join(out)


def parse_args(argv: Optional[list[str]], repo: Path) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/steady-growth.sh",
        description="Corpus jobs run for many steps on a roomy fake GPU, each with its own"
        " agent: per rank, whether a MEMORY_GROWTH advisory or a growth forecast came, and"
        " the largest growth slope the agent computed. Writes target/steady-growth.json.",
        epilog="Exit status: 0 when no rank got a growth advisory or forecast; 1 on a harness"
        " error; 2 on bad usage; 3 when some rank got one.",
    )
    ap.add_argument(
        "--jobs",
        help="comma-separated job names (default: the first 18 of the jobs file, the"
        " original corpus, and the evaluation and checkpoint jobs)",
    )
    ap.add_argument("--steps", type=int, default=50, help="steps per job (%(default)s)")
    ap.add_argument("--gib", type=float, default=80.0, help="usable GiB per GPU (%(default)s)")
    ta.add_harness_args(ap, repo, "steady-growth")
    ap.add_argument("--run-timeout", type=float, default=600.0, help="s per job (%(default)s)")
    ap.add_argument("--agent-timeout", type=float, default=30.0, help="s for /readyz")
    ap.add_argument("--report-timeout", type=float, default=15.0, help="s for the last reports")
    ap.add_argument(
        "--kernel-time", default="50us", help="fake-cuda run --kernel-time (%(default)s)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the work folder (kept on errors)")
    opts = ap.parse_args(argv)
    opts.launcher = "fake-cuda"
    return opts


# Issue 30 names them: the evaluation and checkpoint jobs of the corpus.
PASS_JOBS = ("gpt-eval-every", "gpt-checkpoint", "hf-bert-cls-frozen-emb")
ORIGINAL_JOBS = 18  # the corpus before issue 28 (bench/torch-jobs/README.md)


def main(argv: Optional[list[str]] = None) -> int:
    repo = Path(__file__).resolve().parent.parent
    opts = parse_args(argv, repo)
    try:
        jobs = ta.Job.load(Path(opts.jobs_file), repo)
    except ta.HarnessError as e:
        print(f"steady-growth: {e}", file=sys.stderr)
        return 1
    names = {j.name for j in jobs}
    if opts.jobs:
        want = [n for n in opts.jobs.split(",") if n]
    else:
        want = [j.name for j in jobs[:ORIGINAL_JOBS]] + [n for n in PASS_JOBS if n in names]
    unknown = [n for n in want if n not in names]
    if unknown:
        print(f"steady-growth: unknown job(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    jobs = [next(j for j in jobs if j.name == n) for n in want]
    signal.signal(signal.SIGTERM, ta.on_signal)
    signal.signal(signal.SIGINT, ta.on_signal)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    h: Optional[ta.Harness] = None
    out = Path(opts.out)
    try:
        h = ta.Harness(opts, repo)
        ta.log(f"steady-growth: {len(jobs)} job(s), {opts.steps} steps, {opts.gib:g} GiB usable")
        for n, job in enumerate(jobs, 1):
            ta.log(f"=== {n}/{len(jobs)} {job.name} (nproc {job.nproc})")
            try:
                rows += run_job(h, job, opts.steps, n)
            except ta.HarnessError as e:
                errors.append(str(e))
                ta.log(f"  HARNESS ERROR: {e}")
            ta.write_json(out, rows)
    except ta.Interrupted as e:
        errors.append(f"interrupted ({e})")
    except ta.HarnessError as e:
        errors.append(str(e))
    finally:
        ta.stop_all()
    ta.write_json(out, rows)
    print()
    print(table(rows))
    grew = sorted({r["job"] for r in rows if r["growth_advisory"] or r["forecast"]})
    print()
    print(
        f"{len({r['job'] for r in rows})} job(s) ran; growth reported on: "
        + (", ".join(grew) if grew else "none")
    )
    if errors:
        print(f"HARNESS ERRORS ({len(errors)}):")
        for e in errors:
            print(f"  - {e.splitlines()[0]}")
    if h is not None:
        if errors or opts.keep:
            print(f"work folder kept: {h.work}")
        else:
            shutil.rmtree(h.work, ignore_errors=True)
    if errors:
        return 1
    return 3 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
