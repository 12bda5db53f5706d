"""Run the jobs of jobs.json and check each: exit status 0 and ``step 1 done`` .. ``step N done``.

    python bench/torch-jobs/run_jobs.py                 # every job on the CPU, tiny sizes
    python bench/torch-jobs/run_jobs.py gpt-sgd ddp-2   # some of them
    python bench/torch-jobs/run_jobs.py --device cuda \\
        --wrap 'crates/fake-cuda/fake-cuda run --gpus {nproc} --'   # on the fake GPU

On the CPU (the default) each job gets tiny size flags after its own (argparse
keeps the last), so all of them run in a couple of minutes on two cores;
distributed jobs use gloo. With ``--device cuda`` the jobs run as the manifest
says, each command prefixed by ``--wrap`` (``{nproc}`` becomes the job's rank
count). Jobs with ``nproc`` > 1 run under ``python -m torch.distributed.run
--standalone --nproc-per-node N``. The environment is this one plus the job's
``env``; ``STEPWATCH_ENDPOINT`` is left as it is (with no agent there, the
client only logs that and training goes on). Exits 1 if any job failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent

# Sizes small enough for a CPU run of a few seconds, per script.
GPT_TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--batch", "2"]
TINY: dict[str, list[str]] = {
    "gpt.py": [*GPT_TINY, "--vocab", "256"],
    "ddp.py": [*GPT_TINY, "--vocab", "256"],
    "fsdp2.py": [*GPT_TINY, "--vocab", "256"],
    "lightning_gpt.py": [*GPT_TINY, "--vocab", "256"],
    "hf_trainer.py": [*GPT_TINY, "--vocab", "256"],
    "cnn.py": ["--batch", "2", "--image-size", "32", "--classes", "10", "--width", "8"],
    "fsdp1.py": [*GPT_TINY, "--vocab", "256"],
    "hf_loop.py": [*GPT_TINY, "--vocab", "256", "--target-len", "16", "--image-size", "32"],
    "accelerate_loop.py": [*GPT_TINY, "--vocab", "256"],
    "unet.py": ["--batch", "2", "--image-size", "32", "--width", "4", "--depth", "2"],
    "lstm_lm.py": ["--batch", "2", "--hidden", "32", "--seq-len", "8", "--vocab", "100"],
    "recsys.py": ["--batch", "16", "--rows", "100", "--dim", "8"],
    "gan.py": ["--batch", "2", "--image-size", "16", "--width", "4", "--latent", "8"],
}


def command(job: dict[str, Any], args: argparse.Namespace) -> list[str]:
    nproc = job["nproc"] if args.max_nproc is None else min(job["nproc"], args.max_nproc)
    cmd = [args.python]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(HERE / job["script"]), *job["args"]]
    if args.device == "cpu":
        cmd += [*TINY.get(job["script"], []), "--device", "cpu"]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.wrap:
        cmd = [w.replace("{nproc}", str(nproc)) for w in shlex.split(args.wrap)] + cmd
    return cmd


def run(job: dict[str, Any], args: argparse.Namespace) -> bool:
    cmd = command(job, args)
    env = {**os.environ, **job["env"]}
    steps = args.steps if args.steps is not None else job["steps"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", _text(e.stdout), _text(e.stderr)
    took = time.monotonic() - t0
    lines = out.splitlines()
    missing = [k for k in range(1, steps + 1) if f"step {k} done" not in lines]
    ok = rc == 0 and not missing
    print(f"{'PASS' if ok else 'FAIL'} {job['name']:<30} {took:6.1f} s  rc={rc}", flush=True)
    if not ok or args.verbose:
        print("  $ " + shlex.join(cmd))
        if missing:
            print(f"  missing: {', '.join(f'step {k} done' for k in missing)}")
        for line in (out + err).splitlines()[-args.tail :]:
            print("  | " + line)
        sys.stdout.flush()
    return ok


def _text(b: Optional[bytes]) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jobs", nargs="*", help="job names (default: all)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--wrap", default="", help="command prefix; {nproc}: the job's rank count")
    p.add_argument("--max-nproc", type=int, default=None, help="cap on ranks per job")
    p.add_argument("--steps", type=int, default=None, help="override every job's --steps")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--timeout", type=float, default=300.0, help="s per job")
    p.add_argument("--tail", type=int, default=25, help="output lines shown for a failure")
    p.add_argument("-v", "--verbose", action="store_true", help="show every job's output")
    p.add_argument("--manifest", default=str(HERE / "jobs.json"))
    p.add_argument("--set", choices=["tuning", "held_out"], help="only the jobs of this set")
    args = p.parse_args(argv)

    jobs = json.loads(Path(args.manifest).read_text())
    names = {j["name"] for j in jobs}
    unknown = [n for n in args.jobs if n not in names]
    if unknown:
        p.error(f"unknown job(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    selected = [j for j in jobs if not args.jobs or j["name"] in args.jobs]
    if args.set:
        selected = [j for j in selected if j.get("set") == args.set]
    failed = [j["name"] for j in selected if not run(j, args)]
    print(
        f"{len(selected) - len(failed)}/{len(selected)} passed"
        + (f"; failed: {failed}" * bool(failed))
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
