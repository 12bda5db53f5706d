"""stepwatch: tell the node-local stepwatch agent what each training step does.

One line in a PyTorch training script::

    import stepwatch
    stepwatch.watch(model, optimizer)

Markers (step begin, forward, backward, optimizer, step end, OOM, evaluation
passes, checkpoint saves) and each step's batch size go to the
agent over gRPC (``STEPWATCH_ENDPOINT``, default
``unix:///run/stepwatch/stepwatch.sock``) from a background thread. Marking
never blocks training; with no agent, markers are buffered up to a bound and
then dropped and counted (:func:`stats`).
"""

from ._client import PredictedOutOfMemoryError, Prediction, StepwatchError
from ._identity import DEFAULT_ENDPOINT, Identity, resolve_identity
from ._runtime import (
    WatchHandle,
    batch,
    checkpoint,
    configure,
    evaluation,
    flush,
    last_prediction,
    oom_guard,
    phase,
    reset,
    shutdown,
    stats,
    step,
    watch,
)
from ._version import __version__

__all__ = [
    "DEFAULT_ENDPOINT",
    "Identity",
    "PredictedOutOfMemoryError",
    "Prediction",
    "StepwatchError",
    "WatchHandle",
    "__version__",
    "batch",
    "checkpoint",
    "configure",
    "evaluation",
    "flush",
    "last_prediction",
    "oom_guard",
    "phase",
    "reset",
    "resolve_identity",
    "shutdown",
    "stats",
    "step",
    "watch",
]
