"""What a step's batch was (stepwatch.v1.BatchFacts), as the client queues it.

A batch is ``(samples, tokens, shape)``: samples and tokens an int or None,
shape a tuple of ints (empty when unknown). The agent relates each step's
peak to the largest batch its markers carried, so a job whose long batch
comes late is seen coming; ``ModelFacts.largest_batch`` says what the
largest batch the loader can produce would be.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Optional

Batch = tuple[Optional[int], Optional[int], tuple[int, ...]]

# The agent's bounds (stepwatch-core: MAX_BATCH_DIMS, MAX_PLAUSIBLE_STEP for
# counts, MAX_PLAUSIBLE_BYTES for a shape's elements): a marker beyond them
# is refused with its whole batch, so the client never sends one.
MAX_DIMS = 8
MAX_COUNT = 1 << 48
MAX_ELEMENTS = 1 << 50


def _count(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)  # int, numpy's integers, a 0-d integer tensor
    except TypeError:
        raise ValueError(f"batch {name} must be a whole number, not {value!r}") from None
    if not 1 <= n <= MAX_COUNT:
        raise ValueError(f"batch {name} must be between 1 and 2**48, not {n}")
    return n


def stated(samples: Any = None, tokens: Any = None, shape: Any = None) -> Batch:
    """A batch from what a user or a framework says; ValueError when a figure
    cannot be right (not a whole number >= 1, more than 8 dimensions, more
    than 2**50 elements) or none is given."""
    dims: tuple[int, ...] = ()
    if shape is not None:
        try:
            dims = tuple(shape)
        except TypeError:
            raise ValueError(f"batch shape must be a sequence of sizes, not {shape!r}") from None
        dims = tuple(_count("shape dimension", d) or 0 for d in dims)
        if len(dims) > MAX_DIMS:
            raise ValueError(f"batch shape has {len(dims)} dimensions; at most {MAX_DIMS}")
        elements = 1
        for d in dims:
            elements *= d
        if elements > MAX_ELEMENTS:
            raise ValueError(f"batch shape {list(dims)} has more than 2**50 elements")
    b = (_count("samples", samples), _count("tokens", tokens), dims)
    if b[0] is None and b[1] is None and not dims:
        raise ValueError("a batch needs at least one of samples, tokens or shape")
    return b


def from_mapping(facts: Mapping[str, Any]) -> Batch:
    """:func:`stated` from ``{"samples": ..., "tokens": ..., "shape": [...]}``."""
    if not isinstance(facts, Mapping):
        raise ValueError(
            f"largest_batch must be a dict of samples, tokens and shape, not {facts!r}"
        )
    unknown = set(facts) - {"samples", "tokens", "shape"}
    if unknown:
        raise ValueError(f"unknown batch fields {sorted(unknown)}; use samples, tokens, shape")
    return stated(facts.get("samples"), facts.get("tokens"), facts.get("shape"))


def as_fields(b: Batch) -> dict[str, Any]:
    """BatchFacts fields by name (for ModelFacts.largest_batch)."""
    samples, tokens, shape = b
    return {"samples": samples, "tokens": tokens, "shape": list(shape)}


def of_shape(shape: tuple[int, ...], integer: bool) -> Optional[Batch]:
    """A batch read from the shape of a forward's main input (no data read,
    no device sync): dimension 0 is the samples of a tensor of two or more
    dimensions; an integer tensor of one or two dimensions holds token ids,
    so its elements are the tokens (samples times padded length). None for a
    scalar or a shape beyond the agent's bounds."""
    if not shape or len(shape) > MAX_DIMS:
        return None
    elements = 1
    for d in shape:
        elements *= d
    if elements > MAX_ELEMENTS or elements < 1:
        return None
    samples = shape[0] if len(shape) >= 2 and shape[0] <= MAX_COUNT else None
    tokens = elements if integer and len(shape) <= 2 and elements <= MAX_COUNT else None
    return samples, tokens, shape
