"""PyTorch Lightning integration::

    from stepwatch.lightning import StepwatchCallback
    trainer = lightning.Trainer(callbacks=[StepwatchCallback()])

Markers come from Lightning's hooks, not from the optimizer's pre-step hook:
with automatic optimisation Lightning runs forward and backward *inside*
``optimizer.step(closure)``, so the optimizer phase starts at
``on_before_optimizer_step`` (after the closure) and ends with the optimizer's
post-step hook, which also closes the step (OPTIMIZER_END, STEP_END). For an
optimizer without step hooks, ``on_train_batch_end`` sends both instead.
``accumulate_grad_batches`` becomes micro-batches, and each training batch's
size (read from its first tensor's shape) goes with its FORWARD_BEGIN.
Validation loops (not the sanity check before training) are evaluation
passes; ``trainer.save_checkpoint`` (ModelCheckpoint's saves) checkpoint
saves.
"""

from __future__ import annotations

from typing import Any, Optional

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        # Older installs: the same class under its former package (mypy sees
        # two types when both are installed).
        from pytorch_lightning.callbacks import (  # type: ignore[no-redef,assignment,unused-ignore]
            Callback,
        )
    except ImportError as e:
        raise ImportError("stepwatch.lightning needs Lightning (pip install lightning)") from e

from . import _torch
from ._client import CHECKPOINT_BEGIN, EVAL_BEGIN, OPTIMIZER_BEGIN, OPTIMIZER_END
from ._integration import TrainerCallbackBase
from ._runtime import RT


def _version() -> str:
    for name in ("lightning", "pytorch_lightning"):
        try:
            mod = __import__(name)
            return getattr(mod, "__version__", "")
        except ImportError:
            continue
    return ""


class StepwatchCallback(TrainerCallbackBase, Callback):
    """Reports each optimizer step of a Lightning ``Trainer`` to the stepwatch agent,
    with its validation loops (evaluation passes) and checkpoint saves.

    Options as :func:`stepwatch.watch`'s; ``micro_batch_size`` defaults to the
    training loader's batch size."""

    # ------------------------------------------------------------- set-up
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        if not self._attach(
            pl_module,
            optimizers,
            grad_accumulation_steps=int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
            precision=_precision_name(getattr(trainer, "precision", None)),
            micro_batch_size=_torch.loader_batch_size(getattr(trainer, "train_dataloader", None)),
            world_size=int(getattr(trainer, "world_size", 1) or 1),
            rank=int(getattr(trainer, "global_rank", 0)),
            local_rank=int(getattr(trainer, "local_rank", 0)),
            framework="lightning",
            framework_version=_version(),
        ):
            return

        def hooks() -> None:
            # OPTIMIZER_END from the optimizer itself (the update has finished).
            for opt in optimizers:
                self._handle._handles += _torch.install_optimizer_hooks(RT, opt, begin=False)
            # Checkpoint saves (ModelCheckpoint's and the script's own) all
            # go through trainer.save_checkpoint.
            self._handle._handles.append(_SaveCheckpointWatch(trainer))

        RT.guarded(hooks)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_training()

    # ------------------------------------------------------------ markers
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        RT.training_forward((batch,), None)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        RT.guarded(RT.tracker.backward)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        RT.guarded(RT.tracker.optimizer_begin)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Normally the optimizer's post-step hook has already sent OPTIMIZER_END
        # and STEP_END (tracker.optimizer_end), and this does nothing. It is the
        # fallback for an optimizer without step hooks (torch < 2.0, a wrapper
        # that hides them): close the optimizer phase and the step here.
        RT.guarded(_end_of_batch)

    # -------------------------------------------------------------- passes
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # The sanity check runs before on_train_start: nothing is attached yet.
        self._begin_pass(EVAL_BEGIN)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_pass(EVAL_BEGIN)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if _torch.is_oom(exception):
            RT.report_oom(exception)


class _SaveCheckpointWatch:
    """Wraps ``trainer.save_checkpoint`` on the instance with CHECKPOINT_BEGIN
    and CHECKPOINT_END; ``remove()`` puts it back."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        original = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            tr = RT.tracker
            RT.guarded(lambda: tr.begin_pass(CHECKPOINT_BEGIN))
            try:
                return original(*args, **kwargs)
            finally:
                RT.guarded(lambda: tr.end_pass(CHECKPOINT_BEGIN))

        self.wrapper = save_checkpoint
        trainer.save_checkpoint = save_checkpoint

    def remove(self) -> None:
        if self.trainer.__dict__.get("save_checkpoint") is self.wrapper:
            del self.trainer.save_checkpoint


def _end_of_batch() -> None:
    tr = RT.tracker
    if tr.last == OPTIMIZER_BEGIN:  # no post-step hook fired
        tr.optimizer_end(end_step=False)
    if tr.last == OPTIMIZER_END:
        tr.end_step()


def _precision_name(p: Any) -> Optional[str]:
    if p is None:
        return None
    key = str(p).lower()
    return key if key in _torch.PRECISIONS else None
