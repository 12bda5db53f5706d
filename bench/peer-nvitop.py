"""Runs nvitop-exporter's own CLI with two small benchmark hooks.

Used by bench/peer-nvitop.sh; run it with the bench venv's python and the same
arguments as `nvitop-exporter`.

Hooks (nothing else in nvitop-exporter is changed):

* Counting. `PrometheusExporter.collect()` loops forever: `update_host()` once,
  then `update_device(d)` for every GPU, then sleeps the rest of `interval`.
  One completed `update_device` call is one GPU sample (it reads that GPU's
  memory, utilisation, clocks, power, ... and its process list). The counts,
  and the main thread's CPU time inside each method, are exported on the
  exporter's own /metrics as
      stepwatch_bench_peer_gpu_samples_total
      stepwatch_bench_peer_loops_total
      stepwatch_bench_peer_update_device_cpu_ns_total
      stepwatch_bench_peer_update_host_cpu_ns_total
  The hook costs two clock_gettime(CLOCK_THREAD_CPUTIME_ID) calls and a few
  Python operations per sample (about 1 us, under 1% of one sample).

* Interval. The CLI refuses `--interval` below 0.25 s. When
  STEPWATCH_BENCH_PEER_INTERVAL is set, the exporter is built with the CLI's
  value (pass 0.25) and its `interval` is then replaced by this one, so the
  exporter loop runs at the rate the benchmark asks for.
"""

from __future__ import annotations

import os
import sys
import time

from nvitop_exporter import cli
from nvitop_exporter.exporter import PrometheusExporter
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily

_counts = {"gpu_samples": 0, "loops": 0, "update_device_cpu_ns": 0, "update_host_cpu_ns": 0}
_tcpu = time.thread_time_ns

_orig_init = PrometheusExporter.__init__
_orig_update_device = PrometheusExporter.update_device
_orig_update_host = PrometheusExporter.update_host


def _init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    _orig_init(self, *args, **kwargs)
    override = os.environ.get("STEPWATCH_BENCH_PEER_INTERVAL")
    if override:
        self.interval = float(override)
        print(f"INFO: bench hook: interval set to {self.interval} s", file=sys.stderr)


def _update_device(self, device):  # type: ignore[no-untyped-def]
    t0 = _tcpu()
    _orig_update_device(self, device)
    _counts["update_device_cpu_ns"] += _tcpu() - t0
    _counts["gpu_samples"] += 1


def _update_host(self):  # type: ignore[no-untyped-def]
    t0 = _tcpu()
    _orig_update_host(self)
    _counts["update_host_cpu_ns"] += _tcpu() - t0
    _counts["loops"] += 1


class _BenchCollector:
    def collect(self):  # type: ignore[no-untyped-def]
        for key, value in list(_counts.items()):
            yield CounterMetricFamily(
                f"stepwatch_bench_peer_{key}", f"bench hook: {key}", value=value
            )


PrometheusExporter.__init__ = _init  # type: ignore[method-assign]
PrometheusExporter.update_device = _update_device  # type: ignore[method-assign]
PrometheusExporter.update_host = _update_host  # type: ignore[method-assign]
REGISTRY.register(_BenchCollector())

if __name__ == "__main__":
    sys.argv[0] = "nvitop-exporter"
    sys.exit(cli.main())
