"""Soak: the agent's limits driven at once, by hostile and unlucky clients.

These loads run together against one agent on fake NVML (loopback only) for
--seconds, under the chart's memory limit (a memory cgroup of 192 MiB when
one can be made; --no-cgroup or no permission: RSS is measured against it),
while a well-behaved rank trains beside them:

1. memory: ranks that send steps with many phases as fast as they can;
2. silent streams: streams that never say hello, reopened as they are ended;
3. short jobs: one-step jobs with wide steps, each a new rank that
   disconnects (91 of them once exhausted the step-history budget);
4. connection flood: raw Unix connections opened and held;
5. traces: allocator traces with many segments, half left unfinished by a
   stream that then stays silent;
6. idle channels: gRPC connections that open no stream;
7. one process, one rank, many streams that each say hello;
8. HTTP held: keep-alive connections that send one byte a minute;
9. reports: concurrent GETs of the largest rank's full report;
10. clock jumps: a rank whose one marker jumps an hour ahead, then goes on.

The attacks come as other pods' would: each attack is a process of its
own, on the Unix socket as another uid (nobody's, when the soak runs as
root; --same-identity to share the polite rank's), over HTTP from 127.0.0.2
and 127.0.0.3; the polite rank is a process of its own, and the soak's
probes and scrapes come from 127.0.0.1.

It records the agent's peak RSS (and the cgroup's peak usage), the success
rate of /healthz and /readyz probes (1 s timeout), how long the polite
rank's steps waited to be counted in /metrics (longest_wait_s, from the time
the rank sent each; and longest_stall_s, the longest time its count stood
still, from its first step), what the polite rank itself saw (streams ended
and why), and every refusal counted by reason. Prints a JSON summary (and
writes it to --out). Run it through bench/soak.sh.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Callable, Optional

import grpc
from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb
from stepwatch._proto.stepwatch.v1 import ingest_pb2_grpc as pb_grpc

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"


def hello(job: str, pid: int) -> pb.ClientMessage:
    ident = pb.Identity(job_id=job, rank=0, world_size=1, node_name="soak")
    return pb.ClientMessage(
        hello=pb.Hello(identity=ident, gpu_uuid=GPU0, pid=pid, framework="soak")
    )


def step_markers(step: int, micro_batches: int, t: list[int]) -> list[pb.Marker]:
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


def drain(
    stub: pb_grpc.IngestStub, messages: Iterator[pb.ClientMessage], timeout: Optional[float] = None
) -> Optional[str]:
    """Streams ``messages`` and reads the agent's answers until the stream ends:
    None when it ends well, else the name of the gRPC code it ended with."""
    try:
        for _ in stub.Stream(messages, timeout=timeout):
            pass
    except grpc.RpcError as e:
        return e.code().name
    return None


def memory_load(sock: str, stop: Stop, rank: int, counts: dict[str, int]) -> None:
    """Steps of 510 micro-batches (1024 phases) as fast as one stream goes."""
    pid = 100_000 + rank
    while not stop.done():

        def messages() -> Iterator[pb.ClientMessage]:
            yield hello(f"soak-mem-{rank}", pid)
            t = [0]
            step = 1
            while not stop.done():
                ms = step_markers(step, 510, t)
                for i in range(0, len(ms), 1024):
                    yield pb.ClientMessage(markers=pb.MarkerBatch(markers=ms[i : i + 1024]))
                count(counts, "memory_steps")
                step += 1

        with channel(sock) as ch:
            ended = drain(pb_grpc.IngestStub(ch), messages())
        if ended is not None:
            count(counts, f"memory_ended_{ended}")
            time.sleep(0.05)


def count(counts: dict[str, int], key: str) -> None:
    """One more ``key`` in ``counts``."""
    counts[key] = counts.get(key, 0) + 1


def start_threads(targets: list[Callable[[], None]]) -> list[threading.Thread]:
    """A started daemon thread for each target."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for th in threads:
        th.start()
    return threads


def silent_streams(sock: str, stop: Stop, counts: dict[str, int], n: int) -> None:
    """Streams that never send a message, reopened when the agent ends them;
    32 to a connection, below the agent's per-connection cap."""
    connections = [
        functools.partial(_waiting_streams, sock, stop, counts, min(32, n - first), "silent")
        for first in range(0, n, 32)
    ]
    for th in start_threads(connections):
        th.join()


def short_jobs(sock: str, stop: Stop, counts: dict[str, int]) -> None:
    """A new one-step job after another, each with its own job id and a
    step of 1024 phases: ranks that finish and hold history."""
    n = 0
    with channel(sock) as ch:
        stub = pb_grpc.IngestStub(ch)
        while not stop.done():
            n += 1
            t = [0]
            wide = step_markers(1, 510, t)
            msgs = [hello(f"soak-short-{n}", 200_000 + n)] + [
                pb.ClientMessage(markers=pb.MarkerBatch(markers=wide[i : i + 1024]))
                for i in range(0, len(wide), 1024)
            ]
            ended = drain(stub, iter(msgs), timeout=10)
            count(counts, f"short_jobs_{ended or 'served'}")
            time.sleep(0.005)


def connection_flood(sock: str, stop: Stop, counts: dict[str, int], n: int) -> None:
    """Raw connections that send nothing, held and replaced as they close."""
    held: list[socket.socket] = []
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
                count(counts, "flood_connect_failed")
                break
            held.append(s)
            count(counts, "flood_opened")
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


def traces(sock: str, stop: Stop, counts: dict[str, int]) -> None:
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
            n: int = n, first: list[pb.Marker] = first, segments=segments, finish: bool = finish
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
                # Hold the unfinished trace open, silent, for a while.
                end = time.monotonic() + 60
                while time.monotonic() < end and not stop.done():
                    time.sleep(0.2)

        with channel(sock) as ch:
            ended = drain(pb_grpc.IngestStub(ch), messages(), timeout=90)
        count(counts, f"traces_{ended or 'sent'}")
        time.sleep(0.2)


def idle_channels(sock: str, stop: Stop, counts: dict[str, int], n: int) -> None:
    """gRPC connections that connect (HTTP/2 preface, settings) and open no
    stream, reconnected when the agent closes them."""
    chans: list[grpc.Channel] = []
    while not stop.done():
        while len(chans) < n and not stop.done():
            ch = channel(sock)
            try:
                grpc.channel_ready_future(ch).result(timeout=2)
                count(counts, "idle_channels_opened")
                chans.append(ch)
            except grpc.FutureTimeoutError:
                count(counts, "idle_channels_refused")
                ch.close()
                break
        # Channels the agent closed reconnect by themselves when used; drop
        # and replace them instead.
        alive = []
        for ch in chans:
            try:
                grpc.channel_ready_future(ch).result(timeout=0.01)
                alive.append(ch)
            except grpc.FutureTimeoutError:
                ch.close()
        chans = alive
        time.sleep(1)
    for ch in chans:
        ch.close()


def one_rank_many_streams(sock: str, stop: Stop, counts: dict[str, int], n: int) -> None:
    """One process, one rank: n streams that each say hello and then wait,
    spread over 8 connections."""
    per = max(1, n // 8)

    def conn() -> None:
        while not stop.done():
            _waiting_streams(
                sock, stop, counts, per, "greedy", hello("soak-greedy", 777), 30, reopen=False
            )

    for th in start_threads([conn] * 8):
        th.join()


def _waiting_streams(
    sock: str,
    stop: Stop,
    counts: dict[str, int],
    n: int,
    label: str,
    first: Optional[pb.ClientMessage] = None,
    timeout: float = 60,
    reopen: bool = True,
) -> None:
    """``n`` streams on one connection that send ``first`` (if any), then nothing until
    the agent ends them: reopened until the soak ends (``reopen``), else opened once.
    Each end is counted as ``<label>_ended_<gRPC code>``."""
    with channel(sock) as ch:
        stub = pb_grpc.IngestStub(ch)
        gate = threading.Event()

        def messages() -> Iterator[pb.ClientMessage]:
            if first is not None:
                yield first
            gate.wait()

        def one() -> None:
            while not stop.done():
                ended = drain(stub, messages(), timeout=timeout)
                if ended is not None:
                    count(counts, f"{label}_ended_{ended}")
                if not reopen:
                    return

        threads = start_threads([one] * n)
        while not stop.done() and any(th.is_alive() for th in threads):
            time.sleep(0.2)
        gate.set()


def http_held(port: int, stop: Stop, counts: dict[str, int], n: int) -> None:
    """Keep-alive HTTP connections that send one byte of a request a minute."""
    held: list[socket.socket] = []
    last_byte = 0.0
    while not stop.done():
        held = [s for s in held if _alive(s)]
        while len(held) < n and not stop.done():
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.bind((HTTP_HELD_ADDR, 0))
                s.connect(("127.0.0.1", port))
                s.setblocking(False)
                held.append(s)
                count(counts, "http_held_opened")
            except OSError:
                s.close()
                count(counts, "http_held_failed")
                break
        if time.monotonic() - last_byte > 60:
            last_byte = time.monotonic()
            for s in held:
                try:
                    s.send(b"G")
                except OSError:
                    pass
        time.sleep(0.5)
    for s in held:
        s.close()


def report_readers(port: int, stop: Stop, counts: dict[str, int], n: int, steps: list[int]) -> None:
    """n readers at once of a memory rank's report, reader i asking for
    steps[i % len(steps)] of its 1024-phase steps; by default half ask for
    all of it (far past the reports budget), half for 3 (a few fit in the
    budget at once)."""

    def one(steps: int) -> None:
        while not stop.done():
            try:
                path = f"/api/v1/jobs/soak-mem-0/ranks/0?steps={steps}"
                body = http(port, path, timeout=30, source=REPORTS_ADDR)
                count(counts, "reports_read")
                counts["report_bytes_max"] = max(counts.get("report_bytes_max", 0), len(body))
            except urllib.error.HTTPError as e:
                count(counts, f"reports_http_{e.code}")
                time.sleep(0.2)
            except Exception as e:
                count(counts, f"reports_failed_{type(e).__name__}")
                time.sleep(0.2)

    threads = [
        threading.Thread(target=one, args=(steps[i % len(steps)],), daemon=True) for i in range(n)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def clock_jumper(sock: str, stop: Stop, counts: dict[str, int]) -> None:
    """A rank that steps every 100 ms; one marker in 50 steps is an hour
    ahead. The steps after it must still be taken."""
    while not stop.done():

        def messages() -> Iterator[pb.ClientMessage]:
            yield hello("soak-clock", 5151)
            t = [0]
            step = 1
            while not stop.done():
                ms = step_markers(step, 1, t)
                if step % 50 == 25:
                    # The batch's last marker: the next batch would be
                    # "older" than it.
                    ms[-1].monotonic_ns += 3600 * 10**9
                    count(counts, "clock_jumps_sent")
                yield pb.ClientMessage(markers=pb.MarkerBatch(markers=ms))
                step += 1
                time.sleep(0.1)

        with channel(sock) as ch:
            ended = drain(pb_grpc.IngestStub(ch), messages())
        if ended is not None:
            count(counts, f"clock_ended_{ended}")
            time.sleep(0.2)


def polite_rank(sock: str, stop: Stop, events) -> None:
    """A normal rank: one small step every 100 ms, for the whole soak. Puts
    ("sent", step, time) once a step's batch was taken by gRPC, and
    ("ended", code, time) when a stream ends with an error, on `events`."""
    step = 1
    while not stop.done():

        def messages() -> Iterator[pb.ClientMessage]:
            nonlocal step
            yield hello("soak-polite", 4242)
            t = [0]
            while not stop.done():
                yield pb.ClientMessage(markers=pb.MarkerBatch(markers=step_markers(step, 1, t)))
                events.put(("sent", step, time.monotonic()))
                step += 1
                time.sleep(0.1)

        with channel(sock) as ch:
            ended = drain(pb_grpc.IngestStub(ch), messages())
        if ended is not None:
            events.put(("ended", ended, time.monotonic()))
            time.sleep(0.2)


def _polite_process(sock: str, seconds: float, events) -> None:
    polite_rank(sock, Stop(seconds), events)


def http(port: int, path: str, timeout: float = 10.0, source: Optional[str] = None) -> bytes:
    """GET path from the agent; from the address `source` when given."""
    if source is None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.read()
    conn = HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise urllib.error.HTTPError(path, r.status, r.reason, r.headers, None)
        return body
    finally:
        conn.close()


def metric_lines(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


# Attackers are other pods: another uid on the socket (when the soak runs
# as root; nobody's), other addresses over HTTP; the soak's own probes and
# scrapes come from 127.0.0.1.
ATTACKER_UID = 65534
HTTP_HELD_ADDR = "127.0.0.2"
REPORTS_ADDR = "127.0.0.3"


def _attack_loads(name: str, args: dict, sock: str, port: int, stop: Stop, counts: dict) -> list:
    """The threads of one attack."""
    if name == "memory":
        return [
            threading.Thread(target=memory_load, args=(sock, stop, r, counts))
            for r in range(args["memory_ranks"])
        ]
    one = {
        "silent_streams": (silent_streams, (sock, stop, counts, args["silent_streams"])),
        "short_jobs": (short_jobs, (sock, stop, counts)),
        "flood": (connection_flood, (sock, stop, counts, args["flood"])),
        "traces": (traces, (sock, stop, counts)),
        "idle_channels": (idle_channels, (sock, stop, counts, args["idle_channels"])),
        "greedy": (one_rank_many_streams, (sock, stop, counts, args["greedy_streams"])),
        "http_held": (http_held, (port, stop, counts, args["http_held"])),
        "reports": (
            report_readers,
            (port, stop, counts, args["report_readers"], args["report_steps"]),
        ),
        "clock": (clock_jumper, (sock, stop, counts)),
    }[name]
    return [threading.Thread(target=one[0], args=one[1])]


ATTACKS = (
    "memory",
    "silent_streams",
    "short_jobs",
    "flood",
    "traces",
    "idle_channels",
    "greedy",
    "http_held",
    "reports",
    "clock",
)


def _attack_process(
    name: str, args: dict, sock: str, port: int, counts_out, uid: Optional[int]
) -> None:
    """One attack for args["seconds"], in a process of its own (as the
    processes of another pod), as `uid` when given; puts its counts on
    `counts_out` at the end."""
    if uid is not None:
        # What grpc imports lazily must be loaded while the venv is readable.
        import encodings.idna  # noqa: F401

        from grpc import _channel, _interceptor, _utilities  # noqa: F401

        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    stop = Stop(args["seconds"])
    counts: dict[str, int] = {}
    for th in _attack_loads(name, args, sock, port, stop, counts):
        th.daemon = True
        th.start()
    while not stop.done():
        time.sleep(0.2)
    while True:
        try:
            # The attack's threads may still be counting.
            counts_out.put(dict(counts))
            return
        except RuntimeError:
            time.sleep(0.01)


def polite_progress(port: int) -> tuple:
    """(time, the polite rank's completed steps in /metrics or None when the
    scrape failed, the scrape's seconds)."""
    t0 = time.monotonic()
    try:
        text = http(port, "/metrics", timeout=5).decode()
    except Exception:
        return (time.monotonic(), None, time.monotonic() - t0)
    done = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("stepwatch_rank_steps_completed_total{")
        and 'training_job="soak-polite"' in line
    ]
    return (time.monotonic(), done[0] if done else None, time.monotonic() - t0)


STALL_BUCKETS_S = (0.5, 1, 2, 5, 10, 30)


def polite_stalls(observed: list[tuple]) -> dict:
    """The polite rank steps every 100 ms: a stall is a time its completed
    steps in /metrics stood still. Failed scrapes count as no progress, and
    are counted apart so that a blind observer is not read as a stall."""
    longest, stalls = 0.0, []
    # From its first step in /metrics: the process takes seconds to start.
    seen = [i for i, (_, value, _) in enumerate(observed) if value is not None]
    observed = observed[seen[0] :] if seen else []
    last_change, last_value = (observed[0][0] if observed else 0.0), None
    for at, value, _ in observed:
        # Taken before a change resets the clock: a gap that ends in
        # progress (a slow scrape) counts as long as one that does not.
        longest = max(longest, at - last_change)
        if value is not None and value != last_value:
            if last_value is not None:
                stalls.append(at - last_change)
            last_change, last_value = at, value
    scrape_s = sorted(s for _, v, s in observed if v is not None)
    histogram = {f"le_{b}s": sum(1 for x in stalls if x <= b) for b in STALL_BUCKETS_S}
    histogram["over"] = sum(1 for x in stalls if x > STALL_BUCKETS_S[-1])
    return {
        "steps_completed": last_value,
        "longest_stall_s": round(longest, 2),
        "stalls_over_1s": sum(1 for x in stalls if x > 1),
        "gap_histogram": histogram,
        "scrapes_failed": sum(1 for _, v, _ in observed if v is None),
        "scrape_p50_s": round(scrape_s[len(scrape_s) // 2], 3) if scrape_s else None,
        "scrape_max_s": round(scrape_s[-1], 3) if scrape_s else None,
    }


def polite_client(events: list[tuple], observed: list[tuple]) -> dict:
    """What the polite rank itself saw (its streams' errors), and how long
    its steps waited to show in /metrics: at each scrape, the oldest step
    sent and not yet counted has waited since it was sent. Steps are
    numbered on from 1 across reconnects, so completed steps n means step
    n + 1 is the next one due (while no stream broke)."""
    ended: dict[str, int] = {}
    sent_at = {e[1]: e[2] for e in events if e[0] == "sent"}
    for e in events:
        if e[0] == "ended":
            ended[e[1]] = ended.get(e[1], 0) + 1
    waits = []
    for at, value, _ in observed:
        due = int(value) + 1 if value is not None else None
        if due is not None and due in sent_at and sent_at[due] < at:
            waits.append(at - sent_at[due])
    waits.sort()
    return {
        "steps_sent": len(sent_at),
        "streams_ended": ended,
        "longest_wait_s": round(waits[-1], 2) if waits else None,
        "wait_p50_s": round(waits[len(waits) // 2], 2) if waits else None,
        "scrapes_seeing_a_wait_over_1s": sum(1 for w in waits if w > 1),
    }


CHART_LIMIT_MIB = 192


def memory_cgroup(tag: str, limit_mib: int) -> Optional[Path]:
    """A memory cgroup limited to limit_mib (v2, else v1), or None when
    none can be made here."""
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists():
        group, limit_file = v2 / tag, "memory.max"
    else:
        group, limit_file = v2 / "memory" / tag, "memory.limit_in_bytes"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit_mib << 20))
        return group
    except OSError:
        return None


def cgroup_peak_bytes(group: Path) -> Optional[int]:
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        try:
            return int((group / name).read_text().split()[0])
        except (OSError, ValueError):
            continue
    return None


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bin", required=True, help="the stepwatch binary")
    ap.add_argument("--seconds", type=float, default=600, help="how long to soak (default 600)")
    ap.add_argument("--memory-ranks", type=int, default=8)
    ap.add_argument("--silent-streams", type=int, default=256)
    ap.add_argument("--flood", type=int, default=1000, help="raw connections held open")
    ap.add_argument("--idle-channels", type=int, default=256)
    ap.add_argument("--greedy-streams", type=int, default=512)
    ap.add_argument("--http-held", type=int, default=70)
    ap.add_argument("--report-readers", type=int, default=16)
    ap.add_argument(
        "--report-steps",
        type=int,
        nargs="+",
        default=[3, 1000],
        help="the steps= each report reader asks for, in turn (default 3 1000)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        choices=ATTACKS,
        default=list(ATTACKS),
        help="run only these attacks (default: all)",
    )
    ap.add_argument(
        "--memory-limit-mib",
        type=int,
        default=CHART_LIMIT_MIB,
        help=f"the agent's memory limit (default the chart's, {CHART_LIMIT_MIB})",
    )
    ap.add_argument(
        "--same-identity",
        action="store_true",
        help="attack as the soak's own uid even when root (another uid by default)",
    )
    ap.add_argument(
        "--no-cgroup",
        action="store_true",
        help="run without the memory cgroup (RSS still measured)",
    )
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
    group = (
        None
        if args.no_cgroup
        else memory_cgroup(f"stepwatch-soak-{os.getpid()}", args.memory_limit_mib)
    )
    # In the cgroup before it starts, so the agent reads its limit from it.
    enter = (
        ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "soak-agent"]
        if group
        else []
    )
    limit_flag = [] if group else ["--memory-limit-mib", str(args.memory_limit_mib)]
    attack_uid = ATTACKER_UID if os.geteuid() == 0 and not args.same_identity else None
    if attack_uid is not None:
        # The attackers' uid must reach the socket: through the scratch
        # dir, and the socket's mode (as a pod's group would).
        os.chmod(d, 0o755)
        limit_flag += ["--socket-mode", "0666"]
    agent = subprocess.Popen(
        enter
        + [
            args.bin,
            "agent",
            "--socket",
            sock,
            "--http-listen",
            "127.0.0.1:0",
            # The chart's probes go to a listener of their own.
            "--probe-listen",
            "127.0.0.1:0",
            "--ready-file",
            str(ready),
            "--nvml-lib",
            lib,
        ]
        + limit_flag,
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
        listening = json.loads(ready.read_text())
        port = int(listening["http"].rsplit(":", 1)[1])
        probe_port = int(listening["probe"].rsplit(":", 1)[1])
        print(
            f"soak: agent pid {agent.pid}, http port {port}, {args.seconds:.0f} s", file=sys.stderr
        )

        stop = Stop(args.seconds)
        ctx = multiprocessing.get_context("spawn")
        # The polite rank is its own process, as a training job would be;
        # the attacks are another, on an identity of their own (see
        # _attack_process), as another pod's would be.
        events = ctx.Queue()
        polite = ctx.Process(target=_polite_process, args=(sock, args.seconds, events), daemon=True)
        counts_out = ctx.Queue()
        attacks = [
            ctx.Process(
                target=_attack_process,
                args=(name, vars(args), sock, port, counts_out, attack_uid),
                daemon=True,
            )
            for name in args.only
        ]
        polite.start()
        for a in attacks:
            a.start()

        probe_ms: list[float] = []
        probes = {"ok": 0, "failed": 0}
        rss_peak_kib = 0
        # (time, the polite rank's completed steps or None, the scrape's seconds)
        polite_steps: list[tuple] = []
        polite_events: list[tuple] = []
        last_report = time.monotonic()
        while not stop.done():
            for path in ("/healthz", "/readyz"):
                t0 = time.monotonic()
                try:
                    http(probe_port, path, timeout=1.0)
                    probe_ms.append((time.monotonic() - t0) * 1000)
                    probes["ok"] += 1
                except Exception:
                    probes["failed"] += 1
            status = Path(f"/proc/{agent.pid}/status").read_text()
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    rss_peak_kib = max(rss_peak_kib, int(line.split()[1]))
            polite_steps.append(polite_progress(port))
            while not events.empty():
                polite_events.append(events.get())
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                elapsed = int(time.monotonic() - (stop.deadline - args.seconds))
                p50 = sorted(probe_ms)[len(probe_ms) // 2] if probe_ms else float("nan")
                print(
                    f"soak: {elapsed} s, RSS {rss_peak_kib // 1024} MiB peak, "
                    f"probes {probes}, p50 {p50:.1f} ms, polite rank's longest stall "
                    f"{polite_stalls(polite_steps)['longest_stall_s']} s",
                    file=sys.stderr,
                )
            time.sleep(0.1)
        stop.event.set()
        metrics = http(port, "/metrics").decode()
        hwm_kib = 0
        for line in Path(f"/proc/{agent.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm_kib = int(line.split()[1])
        counts: dict[str, int] = {}
        until = time.monotonic() + 30
        for _ in attacks:
            try:
                counts.update(counts_out.get(timeout=max(0.1, until - time.monotonic())))
            except Exception:
                count(counts, "attacks_without_counts")
        polite.join(timeout=10)
        while not events.empty():
            polite_events.append(events.get())
        probe_ms.sort()

        def pick(q: float) -> Optional[float]:
            if not probe_ms:
                return None
            return round(probe_ms[min(len(probe_ms) - 1, int(q * len(probe_ms)))], 1)

        refusals = {}
        for line in metrics.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if line.startswith("#") or not ("refus" in name or "reject" in name):
                continue
            key, _, value = line.rpartition(" ")
            if float(value) > 0:
                refusals[key.replace(',node="soak"', "").replace('node="soak",', "")] = float(value)
        total = probes["ok"] + probes["failed"]
        summary = {
            "seconds": args.seconds,
            "memory_limit_mib": args.memory_limit_mib,
            "attacks": args.only,
            "limit_enforced_by": f"memory cgroup {group}"
            if group
            else "none (RSS measured against it)",
            "agent_peak_rss_mib": round(hwm_kib / 1024, 1),
            "cgroup_peak_usage_mib": (
                round(cgroup_peak_bytes(group) / 2**20, 1)
                if group and cgroup_peak_bytes(group)
                else None
            ),
            "agent_alive_at_end": agent.poll() is None,
            "probes": {
                "success_rate": round(probes["ok"] / total, 4) if total else None,
                "ok": probes["ok"],
                "failed": probes["failed"],
                "p50_ms": pick(0.5),
                "p99_ms": pick(0.99),
                "max_ms": round(probe_ms[-1], 1) if probe_ms else None,
            },
            "attackers": (
                f"uid {attack_uid if attack_uid is not None else os.geteuid()} on the socket "
                f"(the polite rank's: {os.geteuid()}), {HTTP_HELD_ADDR} and {REPORTS_ADDR} "
                "over HTTP, a process per attack"
            ),
            "polite_rank": dict(
                polite_stalls(polite_steps), **polite_client(polite_events, polite_steps)
            ),
            "refused": refusals,
            "retained_bytes": metric_lines(metrics, "stepwatch_retained_bytes"),
            "memory_budget_bytes": metric_lines(metrics, "stepwatch_memory_budget_bytes"),
            "steps_trimmed": metric_lines(metrics, "stepwatch_steps_trimmed_total"),
            "ranks_evicted": metric_lines(metrics, "stepwatch_ranks_evicted_total"),
            "ranks_evicted_for_memory": metric_lines(
                metrics, "stepwatch_ranks_evicted_for_memory_total"
            ),
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
            agent.wait()
        if group:
            try:
                group.rmdir()
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
