"""What the Lightning and Hugging Face Trainer callbacks share: their options,
attaching the run to the trainer's model, passes, and the end of training."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ._client import Prediction
from ._runtime import RT, WatchHandle

log = logging.getLogger("stepwatch")


class TrainerCallbackBase:
    """Options and run state of a trainer callback (see the subclasses)."""

    def __init__(
        self,
        *,
        job_id: Optional[str] = None,
        endpoint: Optional[str] = None,
        on_advisory: Optional[Callable[[Prediction], None]] = None,
        precision: Optional[str] = None,
        sharding_factor: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        largest_batch: Optional[dict[str, Any]] = None,
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
        # The largest batch the loader can produce (samples, tokens, shape).
        self.largest_batch = largest_batch
        self.strict = strict
        self._handle = WatchHandle()
        # Between the start and the end of training: passes are marked.
        self._training = False

    def _attach(
        self,
        model: Any,
        optimizers: Any,
        *,
        grad_accumulation_steps: int,
        precision: Optional[str],
        micro_batch_size: Optional[int],
        world_size: int,
        rank: int,
        local_rank: int,
        framework: str,
        framework_version: str,
    ) -> bool:
        """The trainer's run begins: the model's facts, the client, its sender.
        Never raises into training (unless ``strict``): a failure is logged
        and counted (``stats()["watch_errors"]``), and False returned."""
        distributed = world_size > 1
        try:
            RT.attach(
                model,
                optimizers,
                dict(
                    grad_accumulation_steps=grad_accumulation_steps,
                    precision=self.precision or precision,
                    sharding_factor=self.sharding_factor,
                    micro_batch_size=self.micro_batch_size or micro_batch_size,
                    largest_batch=self.largest_batch,
                ),
                endpoint=self.endpoint,
                job_id=self.job_id,
                rank=rank if distributed else None,
                local_rank=local_rank if distributed else None,
                world_size=world_size if distributed else None,
                on_advisory=self.on_advisory,
                strict=self.strict,
                framework=framework,
                framework_version=framework_version,
            )
        except Exception as e:
            if self.strict:
                raise
            RT.watch_errors += 1
            log.warning(
                "stepwatch: the %s callback could not read the model facts or set up the "
                "client (%s: %s); training goes on, watched without them",
                framework,
                type(e).__name__,
                e,
            )
        c = RT.client
        if c is None:
            return False
        c.start()  # connect while the first batch loads
        self._training = True
        return True

    def _end_training(self) -> None:
        self._training = False
        self._handle.remove()
        RT.guarded(RT.tracker.end_step)
        RT.guarded(RT.tracker.end_pass)

    def _begin_pass(self, kind: int) -> None:
        if self._training:
            RT.guarded(lambda: RT.tracker.begin_pass(kind))

    def _end_pass(self, kind: int) -> None:
        if self._training:
            RT.guarded(lambda: RT.tracker.end_pass(kind))
