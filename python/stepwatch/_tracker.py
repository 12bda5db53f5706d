"""The per-rank step state machine: turns hook events into well-ordered markers.

The agent accepts, within one step, markers in the order of ``MarkerKind``
(STEP_BEGIN, FORWARD_BEGIN, BACKWARD_BEGIN, OPTIMIZER_BEGIN, OPTIMIZER_END,
STEP_END) with FORWARD_BEGIN/BACKWARD_BEGIN repeated for gradient accumulation,
and step numbers that never go backwards. Hooks from several sources (module
hooks, optimizer hooks, framework callbacks, manual ``step()``/``phase()``) may
report the same event twice or in an order the agent would refuse; the tracker
drops duplicates and never emits an out-of-order marker.

Evaluation passes and checkpoint saves (EVAL_BEGIN/END, CHECKPOINT_BEGIN/END)
run between steps: one at a time, named by the last step begun (0 before the
first), never while a step is open. Beginning one ends the one that runs, and
the next step's first marker is preceded by the end of the pass that runs.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ._client import (
    BACKWARD_BEGIN,
    CHECKPOINT_BEGIN,
    EVAL_BEGIN,
    FORWARD_BEGIN,
    OOM,
    OPTIMIZER_BEGIN,
    OPTIMIZER_END,
    STEP_BEGIN,
    STEP_END,
)

log = logging.getLogger("stepwatch")

Emit = Callable[[int, int, int], None]  # (kind, step, micro_batch)
# Called with the number of the step about to begin, before its STEP_BEGIN: it
# may wait (watch(hold_step2_for_prediction=)) or raise into training
# (watch(raise_on_predicted_oom=True)).
Gate = Callable[[int], None]

# With several optimizers, a step whose optimizers have stepped this many times
# without each of them having stepped once is closed at every optimizer step
# from then on (one of them never steps: its step must not swallow the run).
MAX_OPTIMIZER_STEPS_PER_STEP = 64


class StepTracker:
    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.step = 0  # number of the current (or last) step; the first is 1
        self.in_step = False
        self.micro = 0
        self.last: Optional[int] = None  # last marker kind emitted in this step
        self.manual = False  # inside ``with stepwatch.step()``: only it ends the step
        self.grad_accumulation_steps: Optional[int] = None
        # Optimizers watched (watch(model, [opt_a, opt_b])): one step runs from
        # its first forward until each of them has stepped (OPTIMIZER_BEGIN at
        # the first one's step, OPTIMIZER_END after the last one's).
        self.optimizer_count = 1
        self.stepped: set[int] = set()  # the optimizers that stepped in this step
        self.optimizer_steps = 0  # optimizer steps in this step
        self.gate: Optional[Gate] = None
        # The BEGIN kind of the evaluation pass or checkpoint save that runs.
        self.open_pass: Optional[int] = None
        # A step died without an end (an exception in ``stepwatch.step()``):
        # the agent holds it open, so no pass may begin until the next step.
        self.abandoned = False

    # ---------------------------------------------------------------- steps
    def begin_step(self, number: Optional[int] = None, manual: bool = False) -> int:
        if self.in_step:
            self.end_step()
        self.end_pass()
        gate = self.gate
        if gate is not None:
            gate(self.step + 1 if number is None or number <= self.step else number)
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
        self.abandoned = False
        self.manual = manual
        self.micro = 0
        self.stepped = set()
        self.optimizer_steps = 0
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
        self.abandoned = self.in_step
        self.in_step = False
        self.manual = False
        self.last = None

    # --------------------------------------------------------------- passes
    def begin_pass(self, kind: int) -> bool:
        """Begin an evaluation pass (EVAL_BEGIN) or checkpoint save
        (CHECKPOINT_BEGIN), ending the other one if it runs. False, and
        nothing sent, while a step is open: a pass runs between steps."""
        if self.in_step or self.abandoned:
            return False
        if self.open_pass == kind:
            return True
        self.end_pass()
        self.open_pass = kind
        self.emit(kind, self.step, 0)
        return True

    def end_pass(self, kind: Optional[int] = None) -> None:
        """End the pass that runs (only if it is of ``kind``, when given)."""
        running = self.open_pass
        if running is None or (kind is not None and kind != running):
            return
        self.open_pass = None
        self.emit(running + 1, self.step, 0)  # EVAL_END, CHECKPOINT_END

    def evaluation_forward(self) -> None:
        """A forward without gradients or in eval mode: outside a step, it
        runs in an evaluation pass (inside one, it is part of the step)."""
        if not self.in_step and self.open_pass != CHECKPOINT_BEGIN:
            self.begin_pass(EVAL_BEGIN)

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
            if self.manual or (last == OPTIMIZER_BEGIN and self.optimizers_pending()):
                # A forward after the optimizer inside one manual step, or between
                # the optimizers of one step (a GAN's generator pass after the
                # discriminator's step): part of the step, not representable.
                return
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

    def optimizers_pending(self) -> bool:
        """Several optimizers are watched and not each has stepped in this step."""
        return self.optimizer_count > 1 and len(self.stepped) < self.optimizer_count

    def optimizer_stepped(self, index: int, end_step: bool = True) -> None:
        """Optimizer ``index`` (of ``optimizer_count``) finished its step: the
        optimizer phase and the step end once each optimizer has stepped."""
        if not self.in_step:
            return
        self.stepped.add(index)
        self.optimizer_steps += 1
        if self.optimizer_steps >= MAX_OPTIMIZER_STEPS_PER_STEP and self.optimizers_pending():
            log.warning(
                "stepwatch: %d optimizer steps in step %d but only %d of the %d watched "
                "optimizers stepped; from now on every optimizer step ends a step (pass "
                "watch() only the optimizers that step in every training step)",
                self.optimizer_steps,
                self.step,
                len(self.stepped),
                self.optimizer_count,
            )
            self.optimizer_count = 1
        if self.optimizers_pending():
            return
        self.optimizer_end(end_step)

    def optimizer_end(self, end_step: bool = True) -> None:
        if not self.in_step or self.last != OPTIMIZER_BEGIN:
            return
        self.last = OPTIMIZER_END
        self.emit(OPTIMIZER_END, self.step, self.micro)
        if end_step and not self.manual:
            self.end_step()

    def oom(self) -> None:
        """The current step, or the pass that runs, died with CUDA OOM. OOM is
        last in a step's order, and ends a pass, so always valid. Between
        steps outside a pass (the next batch moved to the device, code before
        the next forward) it is the next step's only marker: the agent
        refuses a marker of a step that has ended."""
        if self.open_pass is not None and not self.in_step:
            self.open_pass = None
            self.emit(OOM, self.step, 0)
            return
        if not self.in_step and not self.abandoned:
            self.step += 1
            self.micro = 0
        self.emit(OOM, self.step, self.micro)
        self.abandon_step()
        self.abandoned = False  # the OOM marker ended the step
