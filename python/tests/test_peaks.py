"""Exact step peaks (stepwatch/_peaks.py) against a stand-in for the caching
allocator's counters: what stepwatch's resets keep for the script's reads, and
what a script's own reset takes from the step. Real torch on fake CUDA:
test_on_fake_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest

from stepwatch._peaks import PeakKeeper

torch = pytest.importorskip("torch")


class Counters:
    """One device's allocated bytes: current and peak, as torch._C keeps them."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.resets = 0

    def use(self, n: int) -> None:
        self.current = n
        self.peak = max(self.peak, n)

    def stats(self, device: Any) -> dict[str, Any]:
        assert device == 0
        return {
            "allocated_bytes": {"all": {"current": self.current, "peak": self.peak}},
            "num_alloc_retries": 0,
        }

    def reset(self, device: Any) -> None:
        self.resets += 1
        self.peak = self.current


@pytest.fixture
def counters(monkeypatch):
    c = Counters()
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", c.stats, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", c.reset, raising=False)
    keeper = PeakKeeper()
    assert keeper.install()
    yield c, keeper
    keeper.uninstall()


def read_peak() -> int:
    return int(torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"])


def test_the_scripts_peak_survives_stepwatchs_resets_and_its_own_reset_clears_it(counters):
    c, keeper = counters
    c.use(900)
    c.use(100)
    keeper.reset_for_step(0)  # step 2 begins
    assert (c.resets, keeper.raw_stats(0)["allocated_bytes"]["all"]["peak"]) == (1, 100)
    c.use(300)
    assert read_peak() == 900  # what the script reads, as without stepwatch
    torch._C._cuda_resetPeakMemoryStats(0)  # the script's own reset
    assert read_peak() == 300
    c.use(50)
    keeper.reset_for_step(0)  # step 3
    assert read_peak() == 300


def test_a_scripts_reset_inside_a_step_is_folded_back_into_the_steps_peaks(counters):
    c, keeper = counters
    assert keeper.step_peaks(0) is None  # before stepwatch's first reset: raw figures
    keeper.reset_for_step(0)
    c.use(700)
    c.use(200)
    torch._C._cuda_resetPeakMemoryStats(0)
    c.use(400)
    assert keeper.step_peaks(0) == {("allocated_bytes", "all"): 700}
    keeper.reset_for_step(0)
    assert keeper.step_peaks(0) == {}


def test_uninstall_puts_torchs_functions_back(counters):
    c, keeper = counters
    assert torch._C._cuda_memoryStats.__wrapped__ == c.stats
    keeper.uninstall()
    assert torch._C._cuda_memoryStats == c.stats
    assert torch._C._cuda_resetPeakMemoryStats == c.reset
