"""Hugging Face ``Trainer`` integration::

    from stepwatch.transformers import StepwatchCallback
    trainer = Trainer(..., callbacks=[StepwatchCallback()])

Step and optimizer boundaries come from the Trainer's callback events
(on_step_begin, on_pre_optimizer_step, on_optimizer_step, on_step_end);
forward and backward from hooks on the model (as in ``stepwatch.watch``),
with each micro-batch's size read from its inputs. The evaluation's forwards
(no gradients, eval mode) are an evaluation pass that ``on_evaluate`` ends;
a checkpoint save runs from the decision to save (``on_step_end``, or after
the evaluation) to ``on_save``.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError("stepwatch.transformers needs transformers (pip install transformers)") from e

from . import _torch
from ._client import CHECKPOINT_BEGIN, EVAL_BEGIN
from ._integration import TrainerCallbackBase
from ._runtime import RT


class StepwatchCallback(TrainerCallbackBase, TrainerCallback):
    """Reports each optimizer step of a ``transformers.Trainer`` to the stepwatch
    agent, with its evaluations (evaluation passes) and checkpoint saves.

    Options as :func:`stepwatch.watch`'s; ``micro_batch_size`` defaults to
    ``per_device_train_batch_size``."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import transformers

        model = kwargs.get("model")
        precision = None
        if getattr(args, "bf16", False):
            precision = "bf16-mixed"
        elif getattr(args, "fp16", False):
            precision = "fp16-mixed"
        attached = self._attach(
            model,
            kwargs.get("optimizer"),
            grad_accumulation_steps=int(getattr(args, "gradient_accumulation_steps", 1) or 1),
            precision=precision,
            micro_batch_size=getattr(args, "per_device_train_batch_size", None),
            world_size=int(getattr(args, "world_size", 1) or 1),
            rank=int(getattr(args, "process_index", 0)),
            local_rank=int(getattr(args, "local_process_index", 0)),
            framework="transformers",
            framework_version=getattr(transformers, "__version__", ""),
        )
        if attached and model is not None and not self._handle._handles:

            def hooks() -> None:
                self._handle._handles = _torch.install_module_hooks(RT, model)

            RT.guarded(hooks)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_training()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = RT.tracker

        def begin() -> None:
            if not tr.in_step:
                tr.begin_step()

        RT.guarded(begin)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        RT.guarded(RT.tracker.optimizer_begin)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        RT.guarded(lambda: RT.tracker.optimizer_end(end_step=False))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        RT.guarded(RT.tracker.end_step)
        self._save_without_evaluation(args, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_without_evaluation(args, control)

    def _save_without_evaluation(self, args: Any, control: Any) -> None:
        # After this callback the Trainer evaluates (the model's hooks see its
        # forwards without gradients: an evaluation pass), then saves.
        if getattr(control, "should_save", False) and not getattr(
            control, "should_evaluate", False
        ):
            self._begin_save(args)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_pass(EVAL_BEGIN)
        if getattr(control, "should_save", False):
            self._begin_save(args)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_pass(CHECKPOINT_BEGIN)

    def _begin_save(self, args: Any) -> None:
        # With save_strategy "best" the Trainer decides after the evaluation
        # whether it saves; the save is then not marked.
        strategy = getattr(args, "save_strategy", None)
        if getattr(strategy, "value", strategy) != "best":
            self._begin_pass(CHECKPOINT_BEGIN)
