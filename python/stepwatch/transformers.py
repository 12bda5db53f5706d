"""Hugging Face ``Trainer`` integration::

    from stepwatch.transformers import StepwatchCallback
    trainer = Trainer(..., callbacks=[StepwatchCallback()])

Step and optimizer boundaries come from the Trainer's callback events
(on_step_begin, on_pre_optimizer_step, on_optimizer_step, on_step_end);
forward and backward from hooks on the model (as in ``stepwatch.watch``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError("stepwatch.transformers needs transformers (pip install transformers)") from e

from . import _torch
from ._client import Prediction
from ._runtime import RT, WatchHandle


class StepwatchCallback(TrainerCallback):
    """Reports each optimizer step of a ``transformers.Trainer`` to the stepwatch agent."""

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
        self.job_id = job_id
        self.endpoint = endpoint
        self.on_advisory = on_advisory
        self.precision = precision
        self.sharding_factor = sharding_factor
        # None: taken from the trainer (its per-device batch size).
        self.micro_batch_size = micro_batch_size
        self.strict = strict
        self._handle = WatchHandle()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import transformers

        model = kwargs.get("model")
        optimizer = kwargs.get("optimizer")
        gas = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        world = int(getattr(args, "world_size", 1) or 1)
        mbs = self.micro_batch_size or getattr(args, "per_device_train_batch_size", None)
        precision = self.precision
        if precision is None:
            if getattr(args, "bf16", False):
                precision = "bf16-mixed"
            elif getattr(args, "fp16", False):
                precision = "fp16-mixed"
        RT.attach(
            model,
            optimizer,
            grad_accumulation_steps=gas,
            precision=precision,
            sharding_factor=self.sharding_factor,
            micro_batch_size=mbs,
            endpoint=self.endpoint,
            job_id=self.job_id,
            rank=int(getattr(args, "process_index", 0)) if world > 1 else None,
            local_rank=int(getattr(args, "local_process_index", 0)) if world > 1 else None,
            world_size=world if world > 1 else None,
            on_advisory=self.on_advisory,
            strict=self.strict,
            framework="transformers",
            framework_version=getattr(transformers, "__version__", ""),
        ).start()
        if model is not None and not self._handle._handles:
            self._handle._handles = _torch.install_module_hooks(RT, model)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._handle.remove()
        RT.guarded(RT.tracker.end_step)

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
