"""Exact step peaks: PyTorch's peak counters reset at each step's begin, with what
users read of them kept as it would be without stepwatch.

PyTorch's peak counters (``allocated_bytes.all.peak``, ...) are high-water marks
since the process began or the last ``reset_peak_memory_stats()``. Read only at
markers, they pin a step's peak only when the step sets a new record, which after
step 1 few steps do: the agent's step peaks would be lower bounds. From step 2 on
the client resets them at each step's begin (and each pass's), just before that
marker's read, so that within a step they rise monotonically from the step's
start and its last marker holds its exact peak. Step 1 is left alone: its figures
feed the step-2 prediction.

Users read the same counters (``torch.cuda.max_memory_allocated()``, HF Trainer's
memory metrics, Lightning's DeviceStatsMonitor) and expect peaks since *their*
last reset. So what every ``torch.cuda.memory`` (and ``torch.accelerator``)
function calls, ``torch._C._cuda_memoryStats`` and ``_cuda_resetPeakMemoryStats``
(and ``_accelerator_getDeviceStats`` / ``_accelerator_resetPeakStats``), are
wrapped: a read is given each peak as the higher of the counter and what
stepwatch's resets discarded since the user's own last reset, and a user's reset
clears that. Wrapping the C entry points, not the Python functions, covers names
imported before ``watch()`` and every function built on them. stepwatch itself
reads the raw counters (:meth:`PeakKeeper.raw_stats`) with the peaks a user's
reset took from the current step folded back in (:meth:`PeakKeeper.step_peaks`).

``watch(exact_step_peaks=False)`` / ``STEPWATCH_EXACT_STEP_PEAKS=0`` leaves torch
unwrapped and the counters unreset; the agent's step peaks after step 1 are then
lower bounds.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable, Optional

log = logging.getLogger("stepwatch")

# (stat, pool) -> peak, e.g. ("allocated_bytes", "all") -> bytes.
Peaks = dict[tuple[str, str], int]

# The wrapped entry points: (stats reader, peak resetter) pairs of torch._C.
_ENTRY_POINTS = (
    ("_cuda_memoryStats", "_cuda_resetPeakMemoryStats"),
    ("_accelerator_getDeviceStats", "_accelerator_resetPeakStats"),
)


def _peaks_of(stats: dict[str, Any]) -> Peaks:
    """Every peak of a nested stats dict (``torch._C._cuda_memoryStats``)."""
    out: Peaks = {}
    for stat, pools in stats.items():
        if not isinstance(pools, dict):
            continue
        for pool, figures in pools.items():
            if isinstance(figures, dict) and "peak" in figures:
                out[(stat, pool)] = int(figures["peak"])
    return out


def _fold(into: Peaks, peaks: Peaks) -> None:
    for key, value in peaks.items():
        if value > into.get(key, -1):
            into[key] = value


def _device(device: Any) -> Optional[int]:
    try:
        return int(device)
    except (TypeError, ValueError):
        return None


class PeakKeeper:
    """The wrapped entry points and, per CUDA device, the peaks stepwatch's
    resets discarded: since the user's last reset (what users read), and since
    stepwatch's last reset (what a user's reset discarded of the current step)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.originals: dict[str, Callable[..., Any]] = {}
        self.for_users: dict[int, Peaks] = {}
        self.for_step: dict[int, Peaks] = {}

    # ------------------------------------------------------------- install
    def install(self) -> bool:
        """Wrap torch's entry points (once); False when this torch has no CUDA
        stats reader and peak resetter (nothing is wrapped then)."""
        with self.lock:
            if self.installed:
                return True
            torch = sys.modules.get("torch")
            c = getattr(torch, "_C", None)
            if c is None or not all(callable(getattr(c, n, None)) for n in _ENTRY_POINTS[0]):
                return False
            for read_name, reset_name in _ENTRY_POINTS:
                read, reset = getattr(c, read_name, None), getattr(c, reset_name, None)
                if not callable(read) or not callable(reset):
                    continue
                self.originals[read_name], self.originals[reset_name] = read, reset
                setattr(c, read_name, self._user_read(read))
                setattr(c, reset_name, self._user_reset(read, reset))
            self.installed = True
            return True

    def uninstall(self) -> None:
        """Put torch's entry points back (tests; :func:`stepwatch.reset`)."""
        with self.lock:
            torch = sys.modules.get("torch")
            c = getattr(torch, "_C", None)
            if c is not None:
                for name, fn in self.originals.items():
                    setattr(c, name, fn)
            self.originals.clear()
            self.for_users.clear()
            self.for_step.clear()
            self.installed = False

    def _user_read(self, read: Callable[..., Any]) -> Callable[..., Any]:
        def memory_stats(device: Any, *args: Any, **kwargs: Any) -> Any:
            stats = read(device, *args, **kwargs)
            dev = _device(device) if self.for_users else None
            kept = self.for_users.get(dev) if dev is not None else None
            if kept and isinstance(stats, dict):
                for (stat, pool), peak in list(kept.items()):
                    figures = stats.get(stat, {}).get(pool)
                    if isinstance(figures, dict) and figures.get("peak", peak) < peak:
                        figures["peak"] = peak
            return stats

        memory_stats.__wrapped__ = read  # type: ignore[attr-defined]
        return memory_stats

    def _user_reset(
        self, read: Callable[..., Any], reset: Callable[..., Any]
    ) -> Callable[..., Any]:
        def reset_peak_stats(device: Any, *args: Any, **kwargs: Any) -> Any:
            dev = _device(device)
            with self.lock:
                step = self.for_step.get(dev) if dev is not None else None
                if step is not None:
                    try:
                        _fold(step, _peaks_of(read(device)))
                    except Exception:
                        pass
                if dev is not None:
                    self.for_users.pop(dev, None)
                return reset(device, *args, **kwargs)

        reset_peak_stats.__wrapped__ = reset  # type: ignore[attr-defined]
        return reset_peak_stats

    # -------------------------------------------------------- stepwatch's
    def raw_stats(self, device: int) -> dict[str, Any]:
        """The allocator's stats as torch keeps them (raises on failure)."""
        read = self.originals.get("_cuda_memoryStats")
        if read is None:
            read = sys.modules["torch"]._C._cuda_memoryStats
        stats: dict[str, Any] = read(device)
        return stats

    def reset_for_step(self, device: int) -> None:
        """Reset the device's peak counters at a step's (or pass's) begin,
        keeping what users would have read. Only once installed."""
        if not self.installed:
            return
        reset = self.originals["_cuda_resetPeakMemoryStats"]
        with self.lock:
            _fold(self.for_users.setdefault(device, {}), _peaks_of(self.raw_stats(device)))
            self.for_step[device] = {}
            reset(device)

    def step_peaks(self, device: int) -> Optional[Peaks]:
        """What users' resets took from the current step's peaks (None before
        stepwatch's first reset of the device)."""
        return self.for_step.get(device)


KEEPER = PeakKeeper()
