"""PyTorch Lightning integration::

    from stepwatch.lightning import StepwatchCallback
    trainer = lightning.Trainer(callbacks=[StepwatchCallback()])

Markers come from Lightning's hooks, not from the optimizer's pre-step hook:
with automatic optimisation Lightning runs forward and backward *inside*
``optimizer.step(closure)``, so the optimizer phase starts at
``on_before_optimizer_step`` (after the closure) and ends with the optimizer's
post-step hook, which also closes the step (OPTIMIZER_END, STEP_END). For an
optimizer without step hooks, ``on_train_batch_end`` sends both instead.
``accumulate_grad_batches`` becomes micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

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
from ._client import OPTIMIZER_BEGIN, OPTIMIZER_END, Prediction
from ._runtime import RT, WatchHandle


def _version() -> str:
    for name in ("lightning", "pytorch_lightning"):
        try:
            mod = __import__(name)
            return getattr(mod, "__version__", "")
        except ImportError:
            continue
    return ""


class StepwatchCallback(Callback):
    """Reports each optimizer step of a Lightning ``Trainer`` to the stepwatch agent."""

    def __init__(
        self,
        *,
        job_id: Optional[str] = None,
        endpoint: Optional[str] = None,
        on_advisory: Optional[Callable[[Prediction], None]] = None,
        precision: Optional[str] = None,
        sharding_factor: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        strict: bool = False,
    ) -> None:
        super().__init__()
        self.job_id = job_id
        self.endpoint = endpoint
        self.on_advisory = on_advisory
        self.precision = precision
        self.sharding_factor = sharding_factor
        # None: taken from the trainer (its per-device batch size).
        self.micro_batch_size = micro_batch_size
        self.strict = strict
        self._handle = WatchHandle()

    # ------------------------------------------------------------- set-up
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        gas = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        world = int(getattr(trainer, "world_size", 1) or 1)
        precision = self.precision or _precision_name(getattr(trainer, "precision", None))
        mbs = self.micro_batch_size or _torch.loader_batch_size(
            getattr(trainer, "train_dataloader", None)
        )
        RT.attach(
            pl_module,
            optimizers,
            grad_accumulation_steps=gas,
            precision=precision,
            sharding_factor=self.sharding_factor,
            micro_batch_size=mbs,
            endpoint=self.endpoint,
            job_id=self.job_id,
            rank=int(getattr(trainer, "global_rank", 0)) if world > 1 else None,
            local_rank=int(getattr(trainer, "local_rank", 0)) if world > 1 else None,
            world_size=world if world > 1 else None,
            on_advisory=self.on_advisory,
            strict=self.strict,
            framework="lightning",
            framework_version=_version(),
        ).start()
        # OPTIMIZER_END from the optimizer itself (the update has finished).
        for opt in optimizers:
            self._handle._handles += _torch.install_optimizer_hooks(RT, opt, begin=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._handle.remove()
        RT.guarded(RT.tracker.end_step)

    # ------------------------------------------------------------ markers
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        RT.guarded(RT.tracker.forward)

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

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if _torch.is_oom(exception):
            RT.report_oom(exception)


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
