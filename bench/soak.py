"""Soak: the agent's limits driven at once, by hostile and unlucky clients.

Five loads run together against one agent on fake NVML (loopback only) for
--seconds, while a well-behaved rank trains beside them:

1. memory: ranks that send steps with many phases as fast as they can;
2. silent streams: streams that never say hello, reopened as they are ended;
3. short jobs: a new job every few milliseconds (the rank table fills);
4. connection flood: raw Unix connections opened and held;
5. traces: allocator traces with many segments, some never finished.

It records the agent's peak RSS, /healthz latency, the refusals counted by
reason, and whether the well-behaved rank's steps kept arriving. Prints a
JSON summary (and writes it to --out). Run it through bench/soak.sh.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import grpc
from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb
from stepwatch._proto.stepwatch.v1 import ingest_pb2_grpc as pb_grpc

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"


def hello(job: str, pid: int) -> pb.ClientMessage:
    ident = pb.Identity(job_id=job, rank=0, world_size=1, node_name="soak")
    return pb.ClientMessage(
        hello=pb.Hello(identity=ident, gpu_uuid=GPU0, pid=pid, framework="soak")
    )


def step_markers(step: int, micro_batches: int, t: List[int]) -> List[pb.Marker]:
    kinds = [pb.STEP_BEGIN]
    for _ in range(micro_batches):
        kinds += [pb.FORWARD_BEGIN, pb.BACKWARD_BEGIN]
    kinds += [pb.OPTIMIZER_BEGIN, pb.OPTIMIZER_END, pb.STEP_END]
    out = []
    for i, k in enumerate(kinds):
        t[0] = max(t[0] + 1000, time.monotonic_ns())
        out.append(
            pb.Marker(kind=k, step=step, monotonic_ns=t[0], wall_ns=t[0], micro_batch=i // 2)
        )
    return out


class Stop:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.event = threading.Event()

    def done(self) -> bool:
        return self.event.is_set() or time.monotonic() >= self.deadline


def channel(socket_path: str) -> grpc.Channel:
    # grpc-core sends the socket path as :authority, which hyper refuses
    # (PROTOCOL_ERROR); the client library sets the same option.
    # Each channel its own connection, as separate processes would have
    # (grpc-core otherwise shares one per target across channels).
    options = [("grpc.default_authority", "localhost"), ("grpc.use_local_subchannel_pool", 1)]
    return grpc.insecure_channel(f"unix://{socket_path}", options=options)


def memory_load(sock: str, stop: Stop, rank: int, counts: Dict[str, int]) -> None:
    """Steps of 510 micro-batches (1024 phases) as fast as one stream goes."""
    pid = 100_000 + rank
    while not stop.done():
        try:
            with channel(sock) as ch:
                stub = pb_grpc.IngestStub(ch)

                def messages() -> Iterator[pb.ClientMessage]:
                    yield hello(f"soak-mem-{rank}", pid)
                    t = [0]
                    step = 1
                    while not stop.done():
                        ms = step_markers(step, 510, t)
                        for i in range(0, len(ms), 1024):
                            yield pb.ClientMessage(markers=pb.MarkerBatch(markers=ms[i : i + 1024]))
                        counts["memory_steps"] = counts.get("memory_steps", 0) + 1
                        step += 1

                for _ in stub.Stream(messages()):
                    pass
        except grpc.RpcError as e:
            counts[f"memory_ended_{e.code().name}"] = (
                counts.get(f"memory_ended_{e.code().name}", 0) + 1
            )
            time.sleep(0.05)


def silent_streams(sock: str, stop: Stop, counts: Dict[str, int], n: int) -> None:
    """Streams that never send a message, reopened when the agent ends them;
    32 to a connection, below the agent's per-connection cap."""
    threads = []
    for first in range(0, n, 32):
        th = threading.Thread(
            target=_silent_connection, args=(sock, stop, counts, min(32, n - first)), daemon=True
        )
        th.start()
        threads.append(th)
    for th in threads:
        th.join()


def _silent_connection(sock: str, stop: Stop, counts: Dict[str, int], n: int) -> None:
    with channel(sock) as ch:
        stub = pb_grpc.IngestStub(ch)
        gate = threading.Event()

        def nothing() -> Iterator[pb.ClientMessage]:
            gate.wait()
            return
            yield  # pragma: no cover

        def one() -> None:
            while not stop.done():
                try:
                    for _ in stub.Stream(nothing(), timeout=60):
                        pass
                except grpc.RpcError as e:
                    key = f"silent_ended_{e.code().name}"
                    counts[key] = counts.get(key, 0) + 1

        threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
        for th in threads:
            th.start()
        while not stop.done():
            time.sleep(0.2)
        gate.set()


def short_jobs(sock: str, stop: Stop, counts: Dict[str, int]) -> None:
    """A new one-step job after another, each with its own job id."""
    n = 0
    with channel(sock) as ch:
        stub = pb_grpc.IngestStub(ch)
        while not stop.done():
            n += 1
            t = [0]
            msgs = [
                hello(f"soak-short-{n}", 200_000 + n),
                pb.ClientMessage(markers=pb.MarkerBatch(markers=step_markers(1, 1, t))),
            ]
            try:
                for _ in stub.Stream(iter(msgs), timeout=10):
                    pass
                counts["short_jobs_served"] = counts.get("short_jobs_served", 0) + 1
            except grpc.RpcError as e:
                key = f"short_jobs_{e.code().name}"
                counts[key] = counts.get(key, 0) + 1
            time.sleep(0.005)


def connection_flood(sock: str, stop: Stop, counts: Dict[str, int], n: int) -> None:
    """Raw connections that send nothing, held and replaced as they close."""
    held: List[socket.socket] = []
    while not stop.done():
        held = [s for s in held if _alive(s)]
        while len(held) < n and not stop.done():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(sock)
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                counts["flood_connect_failed"] = counts.get("flood_connect_failed", 0) + 1
                break
            held.append(s)
            counts["flood_opened"] = counts.get("flood_opened", 0) + 1
        time.sleep(0.5)
    for s in held:
        s.close()


def _alive(s: socket.socket) -> bool:
    try:
        if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
            s.close()
            return False
    except BlockingIOError:
        return True
    except OSError:
        s.close()
        return False
    return True


def traces(sock: str, stop: Stop, counts: Dict[str, int]) -> None:
    """Step-1 traces with many segments; every other one never finished."""
    n = 0
    seg_size = 2 << 20
    while not stop.done():
        n += 1
        finish = n % 2 == 0
        segments = [
            pb.AllocatorSegment(
                address=(1 << 40) + i * seg_size,
                blocks=[pb.AllocatorBlock(size=seg_size, allocated=i % 2 == 0)],
            )
            for i in range(4000)
        ]
        t = [0]
        first = step_markers(1, 1, t)

        def messages(
            n: int = n, first: List[pb.Marker] = first, segments=segments, finish: bool = finish
        ) -> Iterator[pb.ClientMessage]:
            yield hello(f"soak-trace-{n}", 300_000 + n)
            yield pb.ClientMessage(markers=pb.MarkerBatch(markers=first[:-1]))
            for i in range(0, len(segments), 1000):
                last = finish and i + 1000 >= len(segments)
                yield pb.ClientMessage(
                    allocator_trace=pb.AllocatorTraceChunk(
                        step=1, segments=segments[i : i + 1000], last=last
                    )
                )
            if not finish:
                # Hold the unfinished trace open for a while.
                end = time.monotonic() + 20
                while time.monotonic() < end and not stop.done():
                    time.sleep(0.2)

        try:
            with channel(sock) as ch:
                for _ in pb_grpc.IngestStub(ch).Stream(messages(), timeout=60):
                    pass
            counts["traces_sent"] = counts.get("traces_sent", 0) + 1
        except grpc.RpcError as e:
            key = f"traces_{e.code().name}"
            counts[key] = counts.get(key, 0) + 1
        time.sleep(0.2)


def polite_rank(sock: str, stop: Stop, progress: List[float]) -> None:
    """A normal rank: one small step every 100 ms, for the whole soak."""
    while not stop.done():
        try:
            with channel(sock) as ch:

                def messages() -> Iterator[pb.ClientMessage]:
                    yield hello("soak-polite", 4242)
                    t = [0]
                    step = 1
                    while not stop.done():
                        yield pb.ClientMessage(
                            markers=pb.MarkerBatch(markers=step_markers(step, 1, t))
                        )
                        step += 1
                        time.sleep(0.1)

                for _ in pb_grpc.IngestStub(ch).Stream(messages()):
                    pass
        except grpc.RpcError:
            progress.append(-time.monotonic())
            time.sleep(0.2)


def _polite_process(sock: str, seconds: float) -> None:
    errors: List[float] = []
    polite_rank(sock, Stop(seconds), errors)


def http(port: int, path: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read()


def metric_lines(text: str, name: str) -> Dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bin", required=True, help="the stepwatch binary")
    ap.add_argument("--seconds", type=float, default=600, help="how long to soak (default 600)")
    ap.add_argument("--memory-ranks", type=int, default=8)
    ap.add_argument("--silent-streams", type=int, default=256)
    ap.add_argument("--flood", type=int, default=1000, help="raw connections held open")
    ap.add_argument("--out", type=Path, help="write the JSON summary here too")
    ap.add_argument("--dir", type=Path, required=True, help="a scratch directory")
    args = ap.parse_args()

    d = args.dir
    subprocess.run(
        [args.bin, "fake-gpu", "--dir", str(d), "init", "--gpus", "1"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    lib = subprocess.run(
        [args.bin, "fake-gpu", "--dir", str(d), "lib-path"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    sock = str(d / "agent.sock")
    ready = d / "ready.json"
    env = dict(os.environ, STEPWATCH_FAKE_NVML_DIR=str(d), RUST_LOG="warn")
    agent = subprocess.Popen(
        [
            args.bin,
            "agent",
            "--socket",
            sock,
            "--http-listen",
            "127.0.0.1:0",
            "--ready-file",
            str(ready),
            "--nvml-lib",
            lib,
        ],
        env=env,
        stderr=open(d / "agent.log", "w"),
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if agent.poll() is not None or time.monotonic() > deadline:
                print((d / "agent.log").read_text(), file=sys.stderr)
                return 2
            time.sleep(0.05)
        port = int(json.loads(ready.read_text())["http"].rsplit(":", 1)[1])
        print(
            f"soak: agent pid {agent.pid}, http port {port}, {args.seconds:.0f} s", file=sys.stderr
        )

        stop = Stop(args.seconds)
        counts: Dict[str, int] = {}
        loads = [
            threading.Thread(target=memory_load, args=(sock, stop, r, counts), daemon=True)
            for r in range(args.memory_ranks)
        ]
        loads += [
            threading.Thread(
                target=silent_streams, args=(sock, stop, counts, args.silent_streams), daemon=True
            ),
            threading.Thread(target=short_jobs, args=(sock, stop, counts), daemon=True),
            threading.Thread(
                target=connection_flood, args=(sock, stop, counts, args.flood), daemon=True
            ),
            threading.Thread(target=traces, args=(sock, stop, counts), daemon=True),
        ]
        # The polite rank is its own process, as a training job would be.
        polite = multiprocessing.get_context("spawn").Process(
            target=_polite_process, args=(sock, args.seconds), daemon=True
        )
        polite.start()
        for th in loads:
            th.start()

        healthz_ms: List[float] = []
        healthz_failures = 0
        rss_peak_kib = 0
        polite_steps: List[tuple] = []
        last_report = time.monotonic()
        while not stop.done():
            t0 = time.monotonic()
            try:
                http(port, "/healthz")
                healthz_ms.append((time.monotonic() - t0) * 1000)
            except Exception:
                healthz_failures += 1
            status = Path(f"/proc/{agent.pid}/status").read_text()
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    rss_peak_kib = max(rss_peak_kib, int(line.split()[1]))
            try:
                report = json.loads(http(port, "/api/v1/jobs/soak-polite/ranks/0?steps=1"))
                polite_steps.append((time.monotonic(), report.get("steps_completed", 0)))
            except Exception:
                polite_steps.append((time.monotonic(), None))
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                elapsed = int(time.monotonic() - (stop.deadline - args.seconds))
                p50 = sorted(healthz_ms)[len(healthz_ms) // 2] if healthz_ms else float("nan")
                print(
                    f"soak: {elapsed} s, RSS {rss_peak_kib // 1024} MiB peak, "
                    f"healthz p50 {p50:.1f} ms",
                    file=sys.stderr,
                )
            time.sleep(0.25)
        stop.event.set()
        metrics = http(port, "/metrics").decode()
        hwm_kib = 0
        for line in Path(f"/proc/{agent.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm_kib = int(line.split()[1])
        # The polite rank was served throughout when its completed steps never
        # stood still for more than 5 s.
        longest_stall = 0.0
        last_change = polite_steps[0][0] if polite_steps else 0.0
        last_value = None
        for at, value in polite_steps:
            if value is not None and value != last_value:
                last_change, last_value = at, value
            longest_stall = max(longest_stall, at - last_change)
        healthz_ms.sort()

        def pick(q: float) -> Optional[float]:
            if not healthz_ms:
                return None
            return healthz_ms[min(len(healthz_ms) - 1, int(q * len(healthz_ms)))]

        summary = {
            "seconds": args.seconds,
            "agent_peak_rss_mib": round(hwm_kib / 1024, 1),
            "healthz_ms": {
                "p50": pick(0.5),
                "p99": pick(0.99),
                "max": healthz_ms[-1] if healthz_ms else None,
                "failures": healthz_failures,
            },
            "polite_rank": {
                "steps_completed": last_value,
                "longest_stall_s": round(longest_stall, 2),
            },
            "refused": {
                k: v
                for k, v in metric_lines(metrics, "stepwatch_markers_rejected_total").items()
                if v > 0
            },
            "retained_bytes": metric_lines(metrics, "stepwatch_retained_bytes"),
            "steps_trimmed": metric_lines(metrics, "stepwatch_steps_trimmed_total"),
            "ranks_evicted": metric_lines(metrics, "stepwatch_ranks_evicted_total"),
            "load_counts": counts,
        }
        text = json.dumps(summary, indent=2, sort_keys=True)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()


if __name__ == "__main__":
    sys.exit(main())
