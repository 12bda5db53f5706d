"""STEPWATCH_STOP_AFTER_STEP: the process ends, with status 0, once step N has ended.

``stepwatch preflight`` sets it to run a user's unmodified script for N optimizer steps.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, expected, small_model, summary

import stepwatch
from stepwatch import _runtime

torch = pytest.importorskip("torch")


class Stopped(BaseException):
    """Raised by the test's stand-in for ``os._exit``."""


def train(steps: int) -> int:
    """A plain loop with one ``watch()``; returns the last step it finished."""
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(model, opt)
    done = 0
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        done += 1
    return done


def test_the_process_ends_before_step_n_plus_1_with_every_marker_of_step_n_sent(agent, monkeypatch):
    monkeypatch.setenv("STEPWATCH_STOP_AFTER_STEP", "2")
    statuses = []

    def fake_exit(status: int) -> None:
        statuses.append(status)
        raise Stopped

    monkeypatch.setattr(_runtime, "_exit", fake_exit)
    finished = []
    with pytest.raises(Stopped):
        finished.append(train(5))
    assert statuses == [0]
    assert finished == []  # the loop did not go on
    # Steps 1 and 2 complete, step 3 never begun; the client was closed, so
    # everything was sent before the exit.
    assert summary(agent.wait_markers(12)) == expected(2)
    assert agent.wait_for(lambda: all(s.ended for s in agent.streams))
    assert summary(agent.all_markers()) == expected(2)


def test_a_script_with_fewer_steps_ends_as_it_would(agent, monkeypatch):
    monkeypatch.setenv("STEPWATCH_STOP_AFTER_STEP", "5")
    monkeypatch.setattr(_runtime, "_exit", lambda status: pytest.fail("exited"))
    assert train(3) == 3
    assert summary(agent.wait_markers(18)) == expected(3)


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_value_that_is_no_step_number_is_ignored_with_one_warning(
    agent, monkeypatch, caplog, value
):
    monkeypatch.setenv("STEPWATCH_STOP_AFTER_STEP", value)
    monkeypatch.setattr(_runtime, "_exit", lambda status: pytest.fail("exited"))
    _runtime._WARNED_STOP_VALUES.discard(value)
    assert train(3) == 3
    said = [r for r in caplog.records if "STEPWATCH_STOP_AFTER_STEP" in r.getMessage()]
    assert len(said) == 1, said
    assert "ignored" in said[0].getMessage()


SCRIPT = r"""
import torch, stepwatch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
stepwatch.watch(model, opt)
try:
    for step in range(1, 6):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} done", flush=False)
finally:
    print("finally ran", flush=True)
"""


def test_a_real_process_exits_0_after_step_n_with_its_output_flushed(agent):
    env = dict(os.environ, STEPWATCH_STOP_AFTER_STEP="3", PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    # stdout is a pipe (block-buffered) and the prints do not flush: the stop does.
    assert proc.stdout.splitlines() == ["step 1 done", "step 2 done", "step 3 done"]
    assert "STEPWATCH_STOP_AFTER_STEP=3: step 3 ended" in proc.stderr
    assert summary(agent.wait_markers(18)) == expected(3)
