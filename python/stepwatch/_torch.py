"""Everything that touches PyTorch. torch is imported lazily, only when used."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable, Iterator
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Optional,
)

from . import _batch, _peaks

if TYPE_CHECKING:  # pragma: no cover
    from ._runtime import _Runtime

log = logging.getLogger("stepwatch")

# stepwatch.v1 enum values
OPT_ADAM, OPT_SGD_MOMENTUM, OPT_SGD, OPT_OTHER = 1, 2, 3, 4
IMPL_FOREACH, IMPL_FUSED, IMPL_FOR_LOOP = 1, 2, 3
PRECISIONS = {
    "fp32": 1,
    "32": 1,
    "32-true": 1,
    "bf16-mixed": 2,
    "mixed-bf16": 2,
    "fp16-mixed": 3,
    "16-mixed": 3,
    "mixed-fp16": 3,
    "bf16": 4,
    "bf16-true": 4,
}


def require_torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("stepwatch.watch() needs PyTorch (pip install torch)") from e
    return torch


def torch_version() -> str:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", "") if torch is not None else ""


# ------------------------------------------------------------------ OOM
def is_oom(exc: BaseException) -> bool:
    """True for torch.cuda.OutOfMemoryError (and the older RuntimeError form)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        cls = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
        if cls is not None and isinstance(exc, cls):
            return True
    return isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)


# ------------------------------------------------------------- OOM report
MAX_OOM_SEGMENTS = 8  # the agent's bound (OomReport.largest_segments)
MAX_OOM_MESSAGE_BYTES = 1024
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_REQUEST = re.compile(r"Tried to allocate ([0-9]+(?:\.[0-9]+)?) ?(B|KiB|MiB|GiB|TiB)")


def requested_bytes(message: str) -> int:
    """The failed request's size from PyTorch's OOM message ("Tried to
    allocate 20.00 MiB"); 0 when the message has none. PyTorch prints two
    decimals, so the figure is exact to 1% of its unit."""
    m = _REQUEST.search(message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


def oom_report(device: int, exc: BaseException, step: int) -> dict[str, Any]:
    """What the caching allocator knows at an OOM, bounded: its statistics,
    the largest segments with their largest free block, the device's free
    memory and the request that failed. Figures that cannot be read are left
    out; the agent reads a missing one as unknown."""
    torch = sys.modules["torch"]
    text = str(exc)
    report: dict[str, Any] = {
        "step": step,
        "requested_bytes": requested_bytes(text),
        "message": text.encode()[:MAX_OOM_MESSAGE_BYTES].decode(errors="ignore"),
    }
    stats = allocator_stats(device)
    if stats is not None:
        report["allocator"] = allocator_figures(stats, _peaks.KEEPER.step_peaks(device))
        try:
            report["inactive_split_bytes"] = int(stats["inactive_split_bytes"]["all"]["current"])
            report["segment_count"] = int(stats["segment"]["all"]["current"])
        except Exception:
            pass
    try:
        segments = []
        largest_free = 0
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", device) != device:
                continue
            free = [b["size"] for b in seg.get("blocks", ()) if b.get("state") == "inactive"]
            biggest = max(free, default=0)
            largest_free = max(largest_free, biggest)
            segments.append(
                (
                    int(seg["total_size"]),
                    int(seg["allocated_size"]),
                    int(biggest),
                    seg.get("segment_type") == "small",
                )
            )
        segments.sort(key=lambda s: s[0], reverse=True)
        report["largest_segments"] = segments[:MAX_OOM_SEGMENTS]
        report["largest_free_block_bytes"] = largest_free
    except Exception as e:
        log.debug("stepwatch: no allocator snapshot at the OOM: %r", e)
    try:
        report["device_memory"] = device_memory(device)
    except Exception:
        pass
    return report


# ------------------------------------------------------------- devices
def _first_param(model: Any) -> Any:
    try:
        return next(iter(model.parameters()))
    except (StopIteration, AttributeError, TypeError):
        return None


def model_cuda_device(model: Any) -> Optional[int]:
    p = _first_param(model)
    if p is None or getattr(p.device, "type", None) != "cuda":
        return None
    idx = p.device.index
    if idx is None:
        import torch

        idx = torch.cuda.current_device()
    return int(idx)


def active_cuda_device() -> Optional[int]:
    """The current CUDA device if this process already initialised CUDA, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:
        pass
    return None


def gpu_uuid_for(model: Any) -> str:
    dev = model_cuda_device(model)
    if dev is None:
        return ""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(dev).uuid)
    except Exception:
        return ""
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    return uuid


def allocator_stats(device: int) -> Optional[dict[str, Any]]:
    """One read of the caching allocator's statistics, as the nested dict
    ``torch.cuda.memory_stats_as_nested_dict`` returns (``torch.cuda.memory_stats``
    flattens the same dict); None when it cannot be read.

    Read straight from ``torch._C._cuda_memoryStats`` (unwrapped: see
    _peaks): the public wrappers resolve the device and flatten ~200 keys on
    every call. Each marker on CUDA reads it once; its figures
    (:func:`allocator_figures`) and, during step 1, its event counters
    (:func:`allocator_event_counters`) come from that one read.
    """
    if sys.modules.get("torch") is None:
        return None
    try:
        return _peaks.KEEPER.raw_stats(device)
    except Exception as e:
        log.debug("stepwatch: could not read the allocator's stats: %r", e)
        return None


def device_memory(device: int) -> tuple[int, int]:
    """(free, total) bytes of ``device`` as the CUDA driver reports them
    (``torch.cuda.mem_get_info``, cudaMemGetInfo): total is what processes can
    use, free what none holds. Raises when they cannot be read."""
    torch = sys.modules["torch"]
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def allocator_figures(
    s: dict[str, Any], taken: Optional[_peaks.Peaks] = None
) -> Optional[tuple[int, ...]]:
    """(allocated, allocated peak, reserved, reserved peak, active, active peak, retries)
    from :func:`allocator_stats`; None when a figure is missing. ``taken``: the
    peaks a script's own reset took from the current step (_peaks), folded
    back in."""
    taken = taken or {}

    def peak(stat: str) -> int:
        return max(int(s[stat]["all"]["peak"]), taken.get((stat, "all"), 0))

    try:
        return (
            int(s["allocated_bytes"]["all"]["current"]),
            peak("allocated_bytes"),
            int(s["reserved_bytes"]["all"]["current"]),
            peak("reserved_bytes"),
            int(s["active_bytes"]["all"]["current"]),
            peak("active_bytes"),
            int(s.get("num_alloc_retries", 0)),
        )
    except Exception:
        return None


# ------------------------------------------------------ allocator history
# Used by _alloctrace (step 1's allocator trace). These raise on failure; the
# caller turns any exception into "feature off, one warning".


def cuda_available() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def memory_history_supported() -> bool:
    """Whether this torch has ``_record_memory_history`` (string API) and ``_snapshot``."""
    import torch

    mem = getattr(torch.cuda, "memory", None)
    return callable(getattr(mem, "_record_memory_history", None)) and callable(
        getattr(mem, "_snapshot", None)
    )


def memory_history_enabled() -> bool:
    """True when something (the user's own debugging) already records allocator history."""
    import torch

    fn = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if fn is None:
        return False
    try:
        return bool(fn())
    except Exception:
        return False


def _history_kwargs(fn: Any) -> tuple[bool, bool]:
    """(takes clear_history, takes skip_actions): both are newer than the string API."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False, False
    return "clear_history" in params, "skip_actions" in params


def start_memory_history(max_entries: int) -> None:
    """Record the allocator's alloc/free history: no stack capture, bounded ring buffer.

    ``enabled="all"`` keeps the event history (``"state"`` would keep only the
    live blocks); ``context=None`` records no tracebacks at all, and
    ``stacks="python"`` keeps torch from warming up its C++ unwinder (it does
    so for ``"all"`` even without context). The history starts empty, so the
    trace begins here: with ``clear_history`` where torch has it; older
    versions clear it on every enable, or on every disable (and the caller
    checks that nothing else records). Where torch has ``skip_actions``,
    ``free_requested`` entries are left out: the trace uses
    ``free_completed``, and they would take a third of the ring buffer.
    """
    import torch

    fn = torch.cuda.memory._record_memory_history
    clear, skip = _history_kwargs(fn)
    kwargs: dict[str, Any] = dict(
        enabled="all", context=None, stacks="python", max_entries=int(max_entries)
    )
    if clear:
        kwargs["clear_history"] = True
    if skip:
        kwargs["skip_actions"] = ["free_requested"]
    fn(**kwargs)


def stop_memory_history() -> None:
    import torch

    fn = torch.cuda.memory._record_memory_history
    clear, _ = _history_kwargs(fn)
    kwargs: dict[str, Any] = dict(enabled=None, context=None, stacks="python")
    if clear:
        kwargs["clear_history"] = True  # frees the ring buffer
    fn(**kwargs)


def memory_snapshot() -> Any:
    import torch

    return torch.cuda.memory._snapshot()


def memory_layout() -> Any:
    """The caching allocator's segments (``torch.cuda.memory_snapshot()``): no history is
    needed, nor recorded, nor (torch 2.10+, ``include_traces=False``) copied when the
    script records it."""
    import torch

    fn: Any = torch.cuda.memory.memory_snapshot
    try:
        return fn(include_traces=False)
    except TypeError:  # an older torch: no such argument
        return fn()


def gradient_addresses(parameters: Iterable[Any]) -> set[int]:
    """Where the parameters' gradients start (``.grad``'s storage), for the layouts'
    gradient flags (``AllocatorBlock.gradient``). Only a gradient that owns its
    storage whole counts: setting it to None frees that block. A view into a
    shared buffer (DDP's ``gradient_as_bucket_view``, a flat-parameter scheme)
    does not, nor then does the buffer. A DTensor's (FSDP2) local shard counts.
    A parameter whose gradient cannot be read is skipped."""
    out: set[int] = set()
    for p in parameters:
        g = getattr(p, "grad", None)
        if g is None:
            continue
        try:
            g = getattr(g, "_local_tensor", g)
            storage = g.untyped_storage()
            if g.storage_offset() == 0 and storage.nbytes() == g.numel() * g.element_size():
                out.add(int(storage.data_ptr()))
        except Exception:
            continue
    return out


def allocator_event_counters(s: dict[str, Any]) -> tuple[int, int]:
    """(blocks handed out, blocks returned to the cache) since the process began.

    In c10's CUDACachingAllocator, ``alloc_found_block`` records the trace's
    ``alloc`` entry and increases the ``active`` stat by one; ``free_block``
    records ``free_completed`` and decreases it by one. The stat's cumulative
    ``allocated``/``freed`` counters therefore count exactly those two kinds
    of trace entries. (``allocation.all.freed`` counts ``free_requested``
    instead: a block used on another stream is returned to the cache only
    later, when its events complete.)

    ``s`` is one :func:`allocator_stats` read (raises when it lacks them).
    """
    a = s["active"]["all"]
    return int(a["allocated"]), int(a["freed"])


# --------------------------------------------------------- model facts
def _optimizers(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return [o for o in optimizer if o is not None]
    return [optimizer]


# Where optimizer wrappers keep the optimizer they wrap: accelerate's
# AcceleratedOptimizer and Lightning Fabric's in ``.optimizer``, Lightning's
# LightningOptimizer in ``._optimizer``, torch's ZeroRedundancyOptimizer its
# local shard's optimizer in ``.optim``.
_WRAPPED_OPTIMIZER_ATTRS = ("optimizer", "_optimizer", "optim")
# How deep wrappers are followed.
_WRAP_DEPTH = 4


def _wrapped(optimizer: Any) -> Any:
    """The optimizer ``optimizer`` wraps (an object with ``param_groups``), or None."""
    for attr in _WRAPPED_OPTIMIZER_ATTRS:
        try:
            inner = getattr(optimizer, attr, None)
        except Exception:  # a property that raises
            continue
        if inner is not None and inner is not optimizer and hasattr(inner, "param_groups"):
            return inner
    return None


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer inside wrappers (what its state and kind are read
    from): accelerate's ``AcceleratedOptimizer`` (the HF Trainer's, itself a
    ``torch.optim.Optimizer``), Lightning's ``LightningOptimizer``, torch's
    ``ZeroRedundancyOptimizer`` (its local optimizer), anything that keeps one
    in ``.optimizer``, ``._optimizer`` or ``.optim``."""
    for _ in range(_WRAP_DEPTH):
        inner = _wrapped(optimizer)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def _optimizer_chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers inside it, outermost first."""
    chain = [optimizer]
    for _ in range(_WRAP_DEPTH):
        inner = _wrapped(chain[-1])
        if inner is None or any(inner is o for o in chain):
            break
        chain.append(inner)
    return chain


def _has_step_hooks(optimizer: Any) -> bool:
    """Whether ``register_step_pre_hook``/``post_hook`` work on ``optimizer``: a
    ``torch.optim.Optimizer`` whose ``__init__`` ran (a wrapper that subclasses
    Optimizer without calling it, such as accelerate's, lacks the hook dicts)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(optimizer, torch.optim.Optimizer):
        return False
    try:
        return isinstance(
            getattr(optimizer, "_optimizer_step_pre_hooks", None), dict
        ) and isinstance(getattr(optimizer, "_optimizer_step_post_hooks", None), dict)
    except Exception:
        return False


def hookable_optimizer(optimizer: Any) -> Optional[Any]:
    """The optimizer whose step hooks mark ``optimizer``'s step: itself when its
    hooks work (a ``torch.optim.Optimizer``, a ``ZeroRedundancyOptimizer``),
    else the first optimizer inside it whose hooks do (accelerate's and
    Lightning's wrappers call the wrapped one's ``step()``). None when there
    is none (an object that is not an optimizer and wraps none)."""
    for _ in range(_WRAP_DEPTH + 1):
        if optimizer is None:
            return None
        if _has_step_hooks(optimizer):
            return optimizer
        optimizer = _wrapped(optimizer)
    return None


def optimizer_kind(optimizer: Any) -> tuple[int, Optional[int]]:
    """(OptimizerKind, state tensors per parameter or None when unknown)."""
    opt = unwrap_optimizer(optimizer)
    import torch

    groups = getattr(opt, "param_groups", None) or [{}]
    g0 = groups[0]
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return OPT_ADAM, 3 if g0.get("amsgrad") else 2
    if isinstance(opt, torch.optim.SGD):
        if g0.get("momentum", 0):
            return OPT_SGD_MOMENTUM, 1
        return OPT_SGD, 0
    name = type(opt).__name__.lower()
    if name in ("adam", "adamw", "fusedadam", "deepspeedcpuadam", "adamw8bit"):
        return OPT_ADAM, None
    return OPT_OTHER, None


def optimizer_implementation(optimizer: Any) -> Optional[int]:
    """How a torch.optim optimizer's step runs (OptimizerImplementation), which
    sizes its temporaries: foreach Adam holds a parameter-sized list at its
    peak, fused Adam none. None when unknown (not a torch.optim optimizer)."""
    opt = unwrap_optimizer(optimizer)
    import torch

    if not isinstance(opt, torch.optim.Optimizer):
        return None
    groups = getattr(opt, "param_groups", None) or [{}]
    g0 = groups[0]
    if g0.get("fused"):
        return IMPL_FUSED
    if g0.get("differentiable"):
        return IMPL_FOR_LOOP
    foreach = g0.get("foreach")
    if foreach is None:
        # Unset: the optimizer decides at its first step, as this does.
        try:
            from torch.optim.optimizer import _default_to_fused_or_foreach

            params = [p for g in groups for p in g.get("params", [])]
            _, foreach = _default_to_fused_or_foreach(params, False, use_fused=False)
        except Exception:
            return None
    return IMPL_FOREACH if foreach else IMPL_FOR_LOOP


def _state_exists(optimizer: Any) -> bool:
    opt = unwrap_optimizer(optimizer)
    state = getattr(opt, "state", None)
    if not state:
        return False
    try:
        return any(bool(v) for v in state.values())
    except Exception:
        return False


def _state_bytes(opts: list[Any], tensors: list[Optional[int]]) -> Optional[int]:
    """Bytes of state the optimizers make for their parameters (each parameter's
    elements held on this rank, times its element size, times the optimizer's
    state tensors per parameter); None when one optimizer's is unknown or its
    parameters cannot be read."""
    total = 0
    for opt, n in zip(opts, tensors):
        if n is None:
            return None
        groups = getattr(unwrap_optimizer(opt), "param_groups", None)
        if not groups:
            return None
        seen: set[int] = set()
        try:
            for g in groups:
                for p in g.get("params", []):
                    if id(p) in seen or not getattr(p, "requires_grad", True):
                        continue
                    seen.add(id(p))
                    local = p.to_local() if hasattr(p, "to_local") else p
                    total += local.numel() * p.element_size() * n
        except Exception:
            return None
    return total


def model_facts(
    model: Any,
    optimizer: Any = None,
    *,
    grad_accumulation_steps: Optional[int] = None,
    precision: Optional[str] = None,
    sharding_factor: Optional[int] = None,
    grads_set_to_none: Optional[bool] = None,
    micro_batch_size: Optional[int] = None,
    largest_batch: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """ModelFacts fields (unknown ones left out) from a model and its optimizer.

    ``micro_batch_size`` (samples per forward on this rank) lets the agent size
    step 1's activations per sample and say which micro-batch would fit;
    ``largest_batch`` (samples, tokens, shape) the largest batch the loader can
    produce, whose need the agent then foresees."""
    facts: dict[str, Any] = {}
    count = 0
    nbytes = 0
    elem_size = None
    dtypes = set()
    try:
        for p in model.parameters():
            if not p.requires_grad:
                continue
            # What this rank holds: a sharded (DTensor, FSDP2) parameter's
            # numel() is the whole parameter's.
            n = p.to_local().numel() if hasattr(p, "to_local") else p.numel()
            count += n
            nbytes += n * p.element_size()
            if elem_size is None:
                elem_size = p.element_size()
            dtypes.add(str(p.dtype))
    except Exception:
        pass
    if count:
        facts["parameter_count"] = count
        facts["parameter_bytes"] = nbytes
    opts = _optimizers(optimizer)
    if opts:
        kinds = [optimizer_kind(o) for o in opts]
        # Several optimizers of one kind (a GAN's two Adams) are that kind.
        facts["optimizer"] = kinds[0][0] if len({k for k, _ in kinds}) == 1 else OPT_OTHER
        state = _state_bytes(opts, [t for _, t in kinds])
        if state is not None and count:
            # What the optimizers will hold, over the parameters the model
            # trains, rounded up: exact for one optimizer over all of them, and
            # the sum for several (or for a ZeroRedundancyOptimizer, this rank's
            # shard), which the agent multiplies back by parameter_count.
            facts["state_bytes_per_parameter"] = -(-state // count)
        elif kinds[0][1] is not None and len(opts) == 1:
            facts["state_bytes_per_parameter"] = kinds[0][1] * (elem_size or 4)
        facts["state_precreated"] = any(_state_exists(o) for o in opts)
        impl = optimizer_implementation(opts[0])
        if impl is not None:
            facts["optimizer_implementation"] = impl
    if precision:
        key = str(precision).lower()
        if key not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; use one of {sorted(PRECISIONS)}")
        facts["precision"] = PRECISIONS[key]
    elif dtypes == {"torch.bfloat16"}:
        facts["precision"] = PRECISIONS["bf16"]
    if sharding_factor:
        facts["sharding_factor"] = int(sharding_factor)
    if grad_accumulation_steps:
        facts["grad_accumulation_steps"] = int(grad_accumulation_steps)
    if grads_set_to_none is not None:
        facts["grads_set_to_none"] = bool(grads_set_to_none)
    if micro_batch_size is not None:
        if isinstance(micro_batch_size, bool) or int(micro_batch_size) < 1:
            raise ValueError(f"micro_batch_size must be at least 1, not {micro_batch_size!r}")
        facts["micro_batch_size"] = int(micro_batch_size)
    if largest_batch is not None:
        facts["largest_batch"] = _batch.as_fields(_batch.from_mapping(largest_batch))
    return facts


def loader_batch_size(loader: Any) -> Optional[int]:
    """The batch size of a training data loader, when it says: a torch
    ``DataLoader``'s ``batch_size``, or the first loader's of a Lightning
    ``CombinedLoader`` (``flattened``) or of a list/tuple/dict of loaders.
    None when unknown (a ``batch_sampler``, an iterable without one)."""
    try:
        for _ in range(4):  # nesting bound
            flattened = getattr(loader, "flattened", None)
            if isinstance(flattened, (list, tuple)) and flattened:
                loader = flattened[0]
            elif isinstance(loader, dict) and loader:
                loader = next(iter(loader.values()))
            elif isinstance(loader, (list, tuple)) and loader:
                loader = loader[0]
            else:
                break
        size = getattr(loader, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            return size
    except Exception:
        pass
    return None


# --------------------------------------------------------------- hooks
# Keyword arguments that hold a model's main input (Hugging Face's names),
# looked for before the first tensor.
_MAIN_INPUT_KEYS = ("input_ids", "pixel_values", "input_values", "input_features")


def batch_of(args: Any, kwargs: Any) -> Optional[_batch.Batch]:
    """The batch a forward (or a framework's training batch) takes, from the
    shape of its main input (:func:`_batch.of_shape`): a keyword argument
    named like a Hugging Face model's input, else the first tensor of its
    arguments. Shapes only: nothing is read from the device. None when it
    takes no tensor."""
    import torch

    tensor_type = torch.Tensor
    main = None
    for named in (kwargs or {}, args[0] if len(args) == 1 else None):
        if isinstance(named, dict):
            main = next(
                (named[k] for k in _MAIN_INPUT_KEYS if isinstance(named.get(k), tensor_type)),
                None,
            )
            if main is not None:
                break
    if main is None:
        main = next(
            (
                t
                for t in _tensors(list(args) + list((kwargs or {}).values()), tensor_type, set())
                if t.dim() > 0
            ),
            None,
        )
    if main is None:
        return None
    integer = not (main.is_floating_point() or main.is_complex() or main.dtype == torch.bool)
    return _batch.of_shape(tuple(int(d) for d in main.shape), integer)


def input_sizes(args: Any, kwargs: Any) -> tuple[int, list[tuple[int, ...]]]:
    """A forward's inputs: the elements of its tensors (positional and keyword,
    looked into as :func:`_tensors` does) and the first four shapes."""
    import torch

    seen: set[int] = set()
    tensors = list(_tensors(list(args) + list((kwargs or {}).values()), torch.Tensor, seen))
    return sum(t.numel() for t in tensors), [tuple(t.shape) for t in tensors[:4]]


def _tensors(obj: Any, tensor_type: Any, seen: set[int], depth: int = 0) -> Iterator[Any]:
    """Tensors in a module output: a tensor, tuple/list, dict/ModelOutput (bounded),
    each once (``seen`` holds the ids already yielded)."""
    if isinstance(obj, tensor_type):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield obj
    elif depth < 2:
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            items = list(obj)
        else:
            return
        for item in items[:16]:
            yield from _tensors(item, tensor_type, seen, depth + 1)


def install_module_hooks(rt: _Runtime, model: Any) -> list[Any]:
    """FORWARD_BEGIN (with the batch's size) on the top module's forward pre
    hook; BACKWARD_BEGIN when the gradient reaches the model's output; OOM when
    a CUDA OOM escapes forward. A forward in eval mode or without gradients
    outside a step begins an evaluation pass (EVAL_BEGIN)."""
    import torch

    tensor_type = torch.Tensor

    def is_training(module: Any) -> bool:
        return bool(getattr(module, "training", True)) and torch.is_grad_enabled()

    def pre_hook(module: Any, args: Any, kwargs: Any = None) -> None:
        if is_training(module):
            rt.guarded(lambda: rt.note_forward_inputs(args, kwargs))
            rt.training_forward(args, kwargs)
        else:
            rt.guarded(rt.tracker.evaluation_forward)

    def post_hook(module: Any, args: Any, output: Any) -> None:
        exc = sys.exc_info()[1]
        if exc is not None:  # forward raised; always_call hooks run inside `except`
            if is_oom(exc):
                rt.report_oom(exc)
            return
        if not is_training(module):
            return
        # Step 1's allocator trace notes where the forward returned (a no-op
        # once it is recorded).
        rt.guarded(rt.recorder.forward_returned)
        tracker = rt.tracker
        token = (tracker.step, tracker.micro)
        fired = [False]

        def grad_hook(grad: Any) -> None:
            if fired[0]:
                return None
            fired[0] = True
            tr = rt.tracker
            if (tr.step, tr.micro) == token:
                rt.guarded(tr.backward)
            return None

        def register() -> None:
            for t in _tensors(output, tensor_type, set()):
                if t.requires_grad:
                    t.register_hook(grad_hook)

        rt.guarded(register)

    handles: list[Any] = []
    for module in forward_modules(model):
        # First among the pre hooks: the step begins before FSDP's (registered
        # earlier, itself prepended) all-gathers the root's parameters, so step
        # 1's allocator trace holds what step 2 allocates there too.
        try:
            handles.append(
                module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True)
            )
        except TypeError:  # torch < 2.0: no prepend, no keyword arguments
            handles.append(module.register_forward_pre_hook(pre_hook))
        try:
            handles.append(module.register_forward_hook(post_hook, always_call=True))
        except TypeError:  # torch < 2.0: no always_call; forward OOM is then not seen here
            handles.append(module.register_forward_hook(post_hook))
    return handles


# Bounds on the modules forward_modules looks through.
_CONTAINER_DEPTH = 3
_CONTAINER_MODULES = 64


def forward_modules(model: Any) -> list[Any]:
    """The modules whose forward the training loop calls: the model itself,
    or, for a container that has no ``forward`` of its own (a module holding a
    GAN's generator and discriminator, an ``nn.ModuleDict``), its children,
    looked through the same way."""
    import torch

    unimplemented = torch.nn.Module.forward
    out: list[Any] = []

    def visit(module: Any, depth: int) -> None:
        if len(out) >= _CONTAINER_MODULES:
            return
        own = getattr(type(module), "forward", unimplemented) is not unimplemented
        children = list(module.children()) if depth < _CONTAINER_DEPTH and not own else []
        if not children:
            out.append(module)
            return
        for child in children:
            visit(child, depth + 1)

    visit(model, 0)
    return out


def install_optimizer_hooks(rt: _Runtime, optimizer: Any, *, begin: bool = True) -> list[Any]:
    """OPTIMIZER_BEGIN/END (and STEP_END) from Optimizer step pre/post hooks (torch >= 2.0).

    A wrapper (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``, …) is seen through to the optimizer it wraps
    (:func:`hookable_optimizer`). An object with no such optimizer inside has
    its ``step`` wrapped on the instance instead, with one warning; without a
    ``step`` either, the optimizer phase is not marked (one warning).

    With several optimizers one step runs until each of them has stepped:
    OPTIMIZER_BEGIN at the first optimizer's step, OPTIMIZER_END and STEP_END
    after the last one's (whatever their order); the forward and backward
    passes between them belong to the step's optimizer phase.
    """
    opts = _optimizers(optimizer)
    handles: list[Any] = []
    targets: list[Any] = []
    for opt in opts:
        target = hookable_optimizer(opt)
        if target is None:
            target = _StepWrapper.make(opt)
            if target is None:
                log.warning(
                    "stepwatch: %s is not a torch.optim.Optimizer and wraps none (and has "
                    "no step() to watch); the optimizer phase is not marked: mark it with "
                    "stepwatch.phase('optimizer')",
                    type(opt).__name__,
                )
                continue
            log.warning(
                "stepwatch: %s is not a torch.optim.Optimizer and wraps none; watching "
                "its step() instead (the model facts leave its state out)",
                type(opt).__name__,
            )
        if any(t is target for t in targets):
            continue  # listed twice (or two wrappers of one optimizer)
        targets.append(target)
    rt.tracker.optimizer_count = max(1, len(targets))
    if len(targets) > 1:
        log.info(
            "stepwatch: %d optimizers: a step runs until each has stepped (OPTIMIZER_BEGIN "
            "at the first one's step, OPTIMIZER_END after the last one's); the forward and "
            "backward passes between them count as the optimizer phase, so what they leave "
            "alive is predicted as optimizer state (on the safe side)",
            len(targets),
        )
    for index, target in enumerate(targets):

        def pre(o: Any, args: Any, kwargs: Any) -> None:
            rt.guarded(rt.tracker.optimizer_begin)

        def post(o: Any, args: Any, kwargs: Any, _index: int = index) -> None:
            rt.guarded(lambda: rt.tracker.optimizer_stepped(_index))

        if isinstance(target, _StepWrapper):
            target.pre, target.post = (pre if begin else None), post
            handles.append(target)
            continue
        if begin:
            handles.append(target.register_step_pre_hook(pre))
        handles.append(target.register_step_post_hook(post))
    return handles


class _StepWrapper:
    """For an optimizer-like object without torch's step hooks: its ``step`` is
    wrapped on the instance to call ``pre`` and ``post`` around it (as
    ``register_step_pre_hook``/``post_hook`` would); ``remove()`` puts it back."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.pre: Optional[Callable[[Any, Any, Any], None]] = None
        self.post: Optional[Callable[[Any, Any, Any], None]] = None
        original = obj.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.pre is not None:
                self.pre(obj, args, kwargs)
            out = original(*args, **kwargs)
            if self.post is not None:
                self.post(obj, args, kwargs)
            return out

        self.wrapper = step
        obj.step = step

    @classmethod
    def make(cls, obj: Any) -> Optional[_StepWrapper]:
        if not callable(getattr(obj, "step", None)):
            return None
        try:
            return cls(obj)
        except Exception as e:  # e.g. a class with __slots__
            log.debug("stepwatch: cannot wrap %s.step: %r", type(obj).__name__, e)
            return None

    def remove(self) -> None:
        if getattr(self.obj, "__dict__", {}).get("step") is self.wrapper:
            del self.obj.step


class _ZeroGradWatch:
    """Wraps ``obj.zero_grad`` on the instance; ``remove()`` puts it back."""

    def __init__(self, rt: _Runtime, obj: Any) -> None:
        self.obj = obj
        original = obj.zero_grad

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            set_to_none = kwargs.get("set_to_none", args[0] if args else True)
            rt.guarded(lambda: rt.note_grads_set_to_none(bool(set_to_none)))
            return original(*args, **kwargs)

        self.wrapper = zero_grad
        obj.zero_grad = zero_grad

    def remove(self) -> None:
        if self.obj.__dict__.get("zero_grad") is self.wrapper:
            del self.obj.zero_grad


def install_zero_grad_watch(rt: _Runtime, model: Any, optimizer: Any) -> list[Any]:
    """Learn from ``zero_grad(set_to_none=...)`` whether gradients outlive a step.

    The answer comes only when the training loop calls it (often right after
    step 1's optimizer phase, after the hello), and decides step 2's peak: kept
    gradients are alive through step 2's forward and backward. The model's and
    each optimizer's ``zero_grad`` are wrapped on the instance."""
    handles: list[Any] = []
    # The optimizer as given and each one it wraps: a wrapper's zero_grad may
    # call the wrapped one's (accelerate) or not (ZeroRedundancyOptimizer).
    objs = [model] + [o for opt in _optimizers(optimizer) for o in _optimizer_chain(opt)]
    seen: set[int] = set()
    for obj in objs:
        if obj is None or id(obj) in seen or not callable(getattr(obj, "zero_grad", None)):
            continue
        seen.add(id(obj))
        try:
            handles.append(_ZeroGradWatch(rt, obj))
        except Exception as e:  # e.g. a class with __slots__
            log.debug("stepwatch: cannot watch %s.zero_grad: %r", type(obj).__name__, e)
    return handles


# ------------------------------------------------------------------ DDP
class DdpBucketWatch:
    """Learns, during step 1, the gradient buckets DDP will rebuild at step 2.

    With ``find_unused_parameters=False`` (the default),
    DistributedDataParallel first puts all gradients of a dtype into one
    bucket, allocated when it is constructed, and at the first forward after
    a backward that reduced them (step 2's) frees it and allocates buckets of
    ``bucket_cap_mb`` (the first one ~1 MiB) in the order the gradients
    became ready (``Reducer::rebuild_buckets``). Step 1's allocator trace
    holds neither, so the agent is told both (``ModelFacts.ddp_bucket_rebuild``).

    The order is read with a post-accumulate-grad hook per parameter (where
    DDP's own hook sees it), kept from the last complete backward of a
    forward that reduced gradients (not under ``no_sync()``); the new sizes
    come from DDP's own ``_compute_bucket_assignment_by_size`` with the
    limits its reducer uses, the old ones from its logging data. Not sent
    when the rebuild is not certain to come as modelled (already done,
    ``find_unused_parameters=True``, ``gradient_as_bucket_view``, lazy
    buckets, DDP's mixed precision, sparse gradients), nor under
    ``static_graph=True``, whose step 2 on fake CUDA made no rebuild at its
    first forward (where it rebuilds was not looked into).
    """

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp
        params, sparse = ddp._build_params_for_reducer()
        self.params: list[Any] = list(params)
        self.sparse: list[bool] = [bool(s) for s in sparse]
        self.order: list[int] = []
        self.seen: set[int] = set()
        self.ready_order: Optional[list[int]] = None
        self.synced = True
        self.handles: list[Any] = []
        for i, p in enumerate(self.params):
            self.handles.append(p.register_post_accumulate_grad_hook(self._ready_hook(i)))
        self.handles.append(ddp.register_forward_pre_hook(self._forward))

    def _forward(self, module: Any, args: Any) -> None:
        import torch

        if torch.is_grad_enabled():
            self.synced = bool(getattr(module, "require_backward_grad_sync", True))
            self.order, self.seen = [], set()

    def _ready_hook(self, index: int) -> Any:
        def hook(param: Any) -> None:
            if index in self.seen:  # a second backward of one forward
                self.order, self.seen = [], set()
            self.order.append(index)
            self.seen.add(index)
            if self.synced and len(self.order) == len(self.params):
                self.ready_order = list(self.order)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _rebuild_to_come(self) -> bool:
        d = self.ddp
        if getattr(d, "_has_rebuilt_buckets", False):
            return False
        if d.find_unused_parameters or d.static_graph:
            return False
        unmodelled = (
            d.gradient_as_bucket_view,
            getattr(d, "lazy_bucket_allocation", False),
            getattr(d, "mixed_precision", None) is not None,
            getattr(d, "_use_python_reducer", False),
            getattr(d, "_delay_all_reduce_all_params", False),
            any(self.sparse),
        )
        return not any(unmodelled)

    def _bucket_size_limits(self) -> list[int]:
        """The limits DDP's reducer rebuilds with (``bucket_size_limits_for_rebuilding``,
        else the first bucket's cap and then ``bucket_cap_mb``)."""
        import torch.distributed as dist

        d = self.ddp
        config = getattr(d, "_bucket_config", None)
        if config is not None:
            _, for_rebuild = config.compute_bucket_size_limits(
                static_graph=d.static_graph, find_unused_parameters=d.find_unused_parameters
            )
            if for_rebuild:
                return [int(n) for n in for_rebuild]
            return [int(config.first_bucket_bytes_cap), int(config.bucket_bytes_cap)]
        # Private to torch.distributed (no type information): typed as Any.
        first = _private(dist)._DEFAULT_FIRST_BUCKET_BYTES
        return [int(first), int(d.bucket_bytes_cap)]

    def facts(self) -> Optional[dict[str, list[int]]]:
        """``{"old_bucket_bytes": [...], "new_bucket_bytes": [...]}`` (DdpBucketRebuild),
        or None when no rebuild as modelled is to come."""
        order = self.ready_order
        if order is None or not self._rebuild_to_come():
            return None
        import torch.distributed as dist

        # The sizes at construction; the logging data is not refreshed at the rebuild.
        data = self.ddp._get_ddp_logging_data()
        old = [int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s.strip()]
        buckets, _ = _private(dist)._compute_bucket_assignment_by_size(
            [self.params[i] for i in order],
            self._bucket_size_limits(),
            [self.sparse[i] for i in order],
            order,
        )
        new = [
            sum(self.params[i].numel() * self.params[i].element_size() for i in bucket)
            for bucket in buckets
        ]
        if not new or any(n <= 0 for n in new + old):
            return None
        return {"old_bucket_bytes": old, "new_bucket_bytes": new}


def install_ddp_bucket_watch(rt: _Runtime, model: Any) -> list[Any]:
    """Watch a DistributedDataParallel model's step 1 for its bucket rebuild
    (:class:`DdpBucketWatch`); the runtime sends what it learnt before step
    1's optimizer phase and removes the hooks. Nothing for other models."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    if not isinstance(model, DistributedDataParallel):
        return []
    try:
        w = DdpBucketWatch(model)
    except Exception as e:  # a torch whose DDP differs
        log.debug("stepwatch: cannot watch DDP's buckets: %r", e)
        return []
    rt.ddp_watch = w
    return [w]


def _private(module: Any) -> Any:
    """A module whose private helpers stepwatch calls (torch.distributed's bucket
    assignment), typed as Any: they are not exported, so mypy knows no types."""
    return module
