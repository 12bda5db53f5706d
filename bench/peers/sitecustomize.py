"""The peer estimators of bench/torch_accuracy.py, run inside an unmodified training job.

The accuracy suite runs each job once more on a roomy fake GPU with this folder
first on ``PYTHONPATH`` and ``STEPWATCH_PEER_OUT`` set; Python then imports this
file at start-up (``sitecustomize``). Without ``STEPWATCH_PEER_OUT`` it does
nothing. Every job hands its model and optimizer(s) to stepwatch, at
``stepwatch.watch()`` or in the Lightning / HF Trainer callback; both go
through ``_Runtime.attach``, which this wraps (the job's stepwatch client still
runs, with no agent to talk to). There it starts two estimators people use
today, as they are documented:

- **accelerate's** ``accelerate estimate-memory``: its own functions
  (``calculate_maximum_sizes`` on the model, ``estimate_training_usage``), the
  row a user would read: ``float32`` (the model's own parameter bytes x 4:
  weights, gradients, two Adam moments), or the mixed-precision row
  (``bfloat16``) when a training forward of step 1 runs under autocast. FSDP v1's
  flat parameters are counted at their unsharded size (the CLI sees the whole
  model); FSDP2's DTensors count their global size already.
- **PyTorch's** ``torch.distributed._tools.mem_tracker.MemTracker``: entered at
  ``attach`` with ``track_external(model, *optimizers)``, as its docstring
  shows, then the peak it tracked (the ``Total`` of its CUDA device) at the end
  of step 1 and at the end of step 2. Step 2's is the estimate reported: a
  user runs a couple of iterations under it and reads the peak. MemTracker
  refuses a top-level module called a second time ("use ``reset_mod_stats``
  ... for the previous iteration"): before such a call (the next step, a
  gradient-accumulation micro-batch, a GAN's discriminator run again) this
  drops that module's per-module statistics, which its peak does not use.

Each rank writes ``$STEPWATCH_PEER_OUT/peer-<RANK>.json`` after step 2, or
with an ``error`` when an estimator failed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Optional

OUT = os.environ.get("STEPWATCH_PEER_OUT")


class _Peers:
    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.result: dict[str, Any] = {"rank": self.rank, "errors": []}
        self.tracker: Any = None
        self.steps: dict[int, int] = {}
        self.opts: list[Any] = []
        self.done = False
        self.autocast_seen: Optional[bool] = None
        self.total_bytes: Optional[int] = None

    # ---------------------------------------------------------------- accelerate
    def accelerate_total(self, model: Any) -> int:
        from accelerate.utils import calculate_maximum_sizes

        flat = [p for p in model.parameters() if hasattr(p, "_unpadded_unsharded_size")]
        if flat:  # FSDP v1 flat parameters: the whole model, as the CLI would see it
            total = sum(p._unpadded_unsharded_size.numel() * p.element_size() for p in flat)
            total += sum(b.numel() * b.element_size() for b in model.buffers())
            return int(total)
        total, _largest = calculate_maximum_sizes(model)
        return int(total)

    def accelerate_rows(self) -> None:
        from accelerate.commands.estimate import estimate_training_usage

        assert self.total_bytes is not None
        rows = {
            dtype: int(max(estimate_training_usage(self.total_bytes, dtype).values()))
            for dtype in ("float32", "bfloat16")
        }
        row = "bfloat16" if self.autocast_seen else "float32"
        self.result["accelerate"] = {
            "model_bytes": self.total_bytes,
            "row": row,
            "rows": rows,
            "predicted_peak_bytes": rows[row],
        }

    # ---------------------------------------------------------------- MemTracker
    def start(self, model: Any, optimizer: Any) -> None:
        import torch
        from stepwatch import _torch as swt

        try:
            self.total_bytes = self.accelerate_total(model)
        except Exception:
            self.result["errors"].append("accelerate: " + traceback.format_exc(limit=3))

        def any_forward(module: Any, args: Any) -> None:
            # Autocast may begin inside the model's own forward (accelerate wraps it).
            if not self.steps and module.training and torch.is_grad_enabled():
                if torch.is_autocast_enabled("cuda"):
                    self.autocast_seen = True

        torch.nn.modules.module.register_module_forward_pre_hook(any_forward)

        self.opts = [swt.hookable_optimizer(o) for o in swt._optimizers(optimizer)]
        self.opts = [o for o in self.opts if o is not None]
        try:
            from torch.distributed._tools.mem_tracker import MemTracker

            mt = MemTracker()
            mt.track_external(model, *self.opts)

            def again(module: Any, args: Any) -> None:
                # Registered before MemTracker's own global hooks, so it runs first.
                mod = mt._mod_tracker
                if (
                    module in mt.memory_tracking
                    and not mod.is_bw
                    and set(mod.parents) <= {"Global"}
                ):
                    for sub in module.modules():
                        mt.memory_tracking.pop(sub, None)

            torch.nn.modules.module.register_module_forward_pre_hook(again)
            # An exception inside MemTracker's module hooks would end the job: keep the
            # first as this estimator's failure and stop tracking from there on.
            for name in ("_pre_fw_hook", "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook"):
                setattr(mt, name, self._guard(getattr(mt, name)))
            mt.__enter__()
            self.tracker = mt
        except Exception:
            self.result["errors"].append("memtracker: " + traceback.format_exc(limit=3))
        for i, o in enumerate(self.opts):
            o.register_step_post_hook(self._stepped(i))
        if not self.opts:
            self.result["errors"].append("no optimizer with step hooks: no step boundaries")
            self.write()

    def _guard(self, fn: Any) -> Any:
        def guarded(*args: Any) -> None:
            if self.tracker is None:
                return
            try:
                fn(*args)
            except Exception as e:
                self.result["memtracker_failed"] = f"{type(e).__name__}: {e}"
                self.result.pop("memtracker", None)
                self.tracker = None

        return guarded

    def _stepped(self, i: int) -> Any:
        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            self.steps[i] = self.steps.get(i, 0) + 1
            done = min(self.steps.get(k, 0) for k in range(len(self.opts)))
            if done >= 1 and "step1_peak_bytes" not in self.result.get("memtracker", {}):
                self.peak("step1_peak_bytes")
            if done >= 2 and not self.done:
                self.peak("step2_peak_bytes")
                self.done = True
                self.write()

        return hook

    def peak(self, key: str) -> None:
        if self.tracker is None:
            return
        try:
            snap = self.tracker.get_tracker_snapshot("peak")
            cuda = [s for dev, s in snap.items() if getattr(dev, "type", None) == "cuda"]
            mt = self.result.setdefault("memtracker", {})
            mt[key] = int(max((s.get("Total", 0) for s in cuda), default=0))
            if key == "step2_peak_bytes":
                mt["predicted_peak_bytes"] = mt[key]
        except Exception:
            self.result["errors"].append("memtracker: " + traceback.format_exc(limit=3))

    def write(self) -> None:
        if self.total_bytes is not None:
            try:
                self.accelerate_rows()
            except Exception:
                self.result["errors"].append("accelerate: " + traceback.format_exc(limit=3))
        assert OUT is not None
        path = os.path.join(OUT, f"peer-{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.result, f)
        os.replace(path + ".tmp", path)


def _install() -> None:
    from stepwatch import _runtime

    original = _runtime._Runtime.attach
    peers = _Peers()

    def attach(self: Any, model: Any, optimizer: Any = None, *args: Any, **kw: Any) -> Any:
        client = original(self, model, optimizer, *args, **kw)
        try:
            peers.start(model, optimizer)
        except Exception:
            peers.result["errors"].append("start: " + traceback.format_exc(limit=3))
            peers.write()
        return client

    _runtime._Runtime.attach = attach  # type: ignore[method-assign]


if OUT:
    try:
        _install()
    except Exception as e:  # no stepwatch on the path (the launcher): nothing to do
        print(f"peers: not installed: {e!r}", file=sys.stderr)
