"""The per-rank step state machine: turns hook events into well-ordered markers.

The agent accepts, within one step, markers in the order of ``MarkerKind``
(STEP_BEGIN, FORWARD_BEGIN, BACKWARD_BEGIN, OPTIMIZER_BEGIN, OPTIMIZER_END,
STEP_END) with FORWARD_BEGIN/BACKWARD_BEGIN repeated for gradient accumulation,
and step numbers that never go backwards. Hooks from several sources (module
hooks, optimizer hooks, framework callbacks, manual ``step()``/``phase()``) may
report the same event twice or in an order the agent would refuse; the tracker
drops duplicates and never emits an out-of-order marker.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ._client import (
    BACKWARD_BEGIN,
    FORWARD_BEGIN,
    OOM,
    OPTIMIZER_BEGIN,
    OPTIMIZER_END,
    STEP_BEGIN,
    STEP_END,
)

log = logging.getLogger("stepwatch")

Emit = Callable[[int, int, int], None]  # (kind, step, micro_batch)


class StepTracker:
    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.step = 0  # number of the current (or last) step; the first is 1
        self.in_step = False
        self.micro = 0
        self.last: Optional[int] = None  # last marker kind emitted in this step
        self.manual = False  # inside ``with stepwatch.step()``: only it ends the step
        self.grad_accumulation_steps: Optional[int] = None

    # ---------------------------------------------------------------- steps
    def begin_step(self, number: Optional[int] = None, manual: bool = False) -> int:
        if self.in_step:
            self.end_step()
        if number is None or number <= self.step:
            if number is not None:
                log.warning(
                    "stepwatch: step %d does not follow step %d; using %d (step numbers start "
                    "at 1 and never go backwards)",
                    number,
                    self.step,
                    self.step + 1,
                )
            number = self.step + 1
        self.step = number
        self.in_step = True
        self.manual = manual
        self.micro = 0
        self.last = STEP_BEGIN
        self.emit(STEP_BEGIN, number, 0)
        return number

    def end_step(self) -> None:
        if not self.in_step:
            return
        self.emit(STEP_END, self.step, self.micro)
        self.in_step = False
        self.manual = False
        self.last = STEP_END

    def abandon_step(self) -> None:
        """The step died (exception): no STEP_END, the next marker opens a new step."""
        self.in_step = False
        self.manual = False
        self.last = None

    # --------------------------------------------------------------- phases
    def forward(self) -> None:
        if not self.in_step:
            self.begin_step()
        last = self.last
        if last == FORWARD_BEGIN:
            return  # already inside a forward (nested or duplicate report)
        if last == BACKWARD_BEGIN:
            gas = self.grad_accumulation_steps
            if gas and self.micro + 1 >= gas and not self.manual:
                # All micro-batches done but no optimizer step was seen (e.g. AMP
                # skipped it after inf/nan grads): close this step, open the next.
                self.end_step()
                self.begin_step()
            else:
                self.micro += 1
        elif last in (OPTIMIZER_BEGIN, OPTIMIZER_END):
            if self.manual:
                return  # a forward after the optimizer inside one manual step: not representable
            self.end_step()
            self.begin_step()
        self.last = FORWARD_BEGIN
        self.emit(FORWARD_BEGIN, self.step, self.micro)

    def backward(self) -> None:
        if not self.in_step:
            self.begin_step()
        if self.last not in (STEP_BEGIN, FORWARD_BEGIN):
            return  # duplicate, or after the optimizer (not representable)
        self.last = BACKWARD_BEGIN
        self.emit(BACKWARD_BEGIN, self.step, self.micro)

    def optimizer_begin(self) -> None:
        if not self.in_step:
            self.begin_step()
        if self.last in (OPTIMIZER_BEGIN, OPTIMIZER_END):
            return
        self.last = OPTIMIZER_BEGIN
        self.emit(OPTIMIZER_BEGIN, self.step, self.micro)

    def optimizer_end(self, end_step: bool = True) -> None:
        if not self.in_step or self.last != OPTIMIZER_BEGIN:
            return
        self.last = OPTIMIZER_END
        self.emit(OPTIMIZER_END, self.step, self.micro)
        if end_step and not self.manual:
            self.end_step()

    def oom(self) -> None:
        """The current step died with CUDA OOM. OOM is last in the order, so always valid."""
        step = self.step if self.step > 0 else 1
        if self.step == 0:
            self.step = 1
        self.emit(OOM, step, self.micro)
        self.abandon_step()
