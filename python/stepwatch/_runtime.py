"""The process-wide stepwatch state: one client and one step tracker per process (rank)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

from . import _batch, _peaks, _torch
from ._alloctrace import LayoutSnapshots, Recorder
from ._client import (
    CHECKPOINT_BEGIN,
    COUNTER_NAMES,
    EVAL_BEGIN,
    FORWARD_BEGIN,
    OOM,
    OPTIMIZER_BEGIN,
    OPTIMIZER_END,
    STEP_BEGIN,
    STEP_END,
    Client,
    PredictedOutOfMemoryError,
    Prediction,
    StepwatchError,
    _env_float,
    load_wire,
    set_model_facts,
    stopped_before_start,
)
from ._identity import Identity, endpoint_target, resolve_identity, sanitize_id
from ._tls import TlsSettings, load_tls, resolve_tls
from ._tracker import StepTracker
from ._version import __version__

log = logging.getLogger("stepwatch")

PHASES = ("forward", "backward", "optimizer")
# Markers of step 1 that come after its last backward: the first of them sends
# what DDP's bucket watch learnt.
STEP1_BACKWARD_DONE = (OPTIMIZER_BEGIN, OPTIMIZER_END, STEP_END)
OPTIMIZER_MARKERS = (OPTIMIZER_BEGIN, OPTIMIZER_END)
# Advisory kinds (stepwatch.v1.AdvisoryKind names, as Prediction.kind has them).
STEP2_OOM_PREDICTED = "ADVISORY_KIND_STEP2_OOM_PREDICTED"
# Step 1 has ended and the agent's prediction for step 2 is in (sent after any
# STEP2_OOM_PREDICTED it calls for).
PREDICTION_FINAL = "ADVISORY_KIND_PREDICTION_FINAL"


class _Runtime:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.client: Optional[Client] = None
        self.excepthook_installed = False
        self._prev_excepthook: Any = None
        self._set_defaults()

    def _set_defaults(self) -> None:
        """Every setting and piece of per-run state at its default: what a new
        process starts with and what :func:`reset` returns to. One list, so a
        new field cannot be left out of the reset."""
        self.tracker = self._new_tracker()
        # watch(hold_step2_for_prediction=): at most this many seconds before
        # step 2's first marker, waiting for step 1's prediction (0: off).
        self.hold_step2_s = 0.0
        # watch(raise_on_predicted_oom=True).
        self.raise_on_predicted_oom = False
        # watch() calls that failed in part (stats()["watch_errors"]).
        self.watch_errors = 0
        self._reset_run_predictions()
        self.identity_overrides: dict[str, Any] = {}
        self.identity: Optional[Identity] = None
        self.endpoint: Optional[str] = None
        # tls_ca= / tls_cert= / tls_key= given to watch() or configure().
        self.tls_paths: dict[str, str] = {}
        self.on_advisory: Optional[Callable[[Prediction], None]] = None
        self.strict = False
        self.queue_size: Optional[int] = None
        self.framework = "pytorch"
        self.framework_version = ""
        self.facts: dict[str, Any] = {}
        self.gpu_uuid = ""
        self.allocator_stats = True
        # cudaMemGetInfo at step 1's markers and OOM markers; off for the
        # process after the first failure (one warning).
        self.device_memory = True
        # Step 1's allocator trace: None = STEPWATCH_ALLOCATOR_TRACE (default on).
        self.allocator_trace: Optional[bool] = None
        # Reset PyTorch's peak counters at each step's begin from step 2 on
        # (see _peaks): None = STEPWATCH_EXACT_STEP_PEAKS (default on).
        self.exact_step_peaks: Optional[bool] = None
        self.recorder = Recorder()
        # Step 1's segment layouts at its optimizer markers, when no trace is recorded.
        self.layouts = LayoutSnapshots()
        # The watched model, weakly (stepwatch must not keep it alive): the
        # layouts flag its parameters' gradients. None: no model given.
        self.model_ref: Optional[Callable[[], Any]] = None
        # CUDA device whose allocator figures go with each marker; None = none.
        self.cuda_device: Optional[int] = None
        self.cuda_checked = False
        # A DDP model's bucket rebuild, learnt in step 1 (_torch.DdpBucketWatch).
        self.ddp_watch: Optional[_torch.DdpBucketWatch] = None
        # This process's current training run (see begin_run); every hello
        # carries it, so the agent tells a second fit from a reconnect.
        self.run_id = _new_run_id()
        # The batch of the training forward being marked, read from its
        # inputs, for its FORWARD_BEGIN.
        self.forward_batch: Optional[_batch.Batch] = None
        # stepwatch.batch(): for the next marker of a step. Once it has been
        # called, batches are no longer read from forward inputs.
        self.stated_batch: Optional[_batch.Batch] = None
        self.batch_stated = False

    def _new_tracker(self) -> StepTracker:
        tracker = StepTracker(self._emit)
        tracker.gate = self._step_gate
        return tracker

    def _reset_run_predictions(self) -> None:
        """Per run: what the agent predicted for its step 2, as the gate reads it."""
        # Set (on the sender thread) when the agent's step-2 OOM advisory arrives.
        self.oom_predicted = threading.Event()
        self.predicted_oom: Optional[Prediction] = None
        # Set when step 1's prediction is in: a step-2 OOM advisory, or the
        # agent's word that the prediction is final (step 2 fits).
        self.prediction_in = threading.Event()
        # Marker kinds of the run's step 1: whether the agent can predict step 2.
        self.step1_kinds: set[int] = set()
        self.held = False  # step 2 was held once already (or needed no hold)
        # (elements, shapes) of the inputs of the run's first forward
        self.step1_inputs: Optional[tuple[int, list[tuple[int, ...]]]] = None
        # step 2's first forward took more input elements than step 1's
        self.step2_inputs_larger = False
        self.raised = False  # PredictedOutOfMemoryError was raised once already

    # ------------------------------------------------------------ configure

    def resolve_tls(self, endpoint: Optional[str]) -> Optional[TlsSettings]:
        """The TLS settings for ``endpoint`` with the paths given to watch()/configure()."""
        return resolve_tls(
            endpoint,
            tls_ca=self.tls_paths.get("tls_ca"),
            tls_cert=self.tls_paths.get("tls_cert"),
            tls_key=self.tls_paths.get("tls_key"),
        )

    def configure(
        self,
        *,
        endpoint: Optional[str] = None,
        job_id: Optional[str] = None,
        rank: Optional[int] = None,
        local_rank: Optional[int] = None,
        world_size: Optional[int] = None,
        node_name: Optional[str] = None,
        pod: Optional[str] = None,
        namespace: Optional[str] = None,
        on_advisory: Optional[Callable[[Prediction], None]] = None,
        strict: Optional[bool] = None,
        queue_size: Optional[int] = None,
        framework: Optional[str] = None,
        framework_version: Optional[str] = None,
        allocator_stats: Optional[bool] = None,
        allocator_trace: Optional[bool] = None,
        exact_step_peaks: Optional[bool] = None,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
    ) -> Client:
        with self.lock:
            overrides = dict(
                job_id=job_id,
                rank=rank,
                local_rank=local_rank,
                world_size=world_size,
                node_name=node_name,
                pod=pod,
                namespace=namespace,
            )
            self.identity_overrides.update({k: v for k, v in overrides.items() if v is not None})
            self.identity = None
            settings = {
                "on_advisory": on_advisory,
                "strict": strict,
                "queue_size": queue_size,
                "framework": framework,
                "framework_version": framework_version,
                "allocator_stats": allocator_stats,
                "allocator_trace": allocator_trace,
                "exact_step_peaks": exact_step_peaks,
            }
            for name, value in settings.items():
                if value is not None:
                    setattr(self, name, value)
            paths = dict(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
            self.tls_paths.update({k: str(v) for k, v in paths.items() if v is not None})
            target = endpoint_target(endpoint or self.endpoint)
            tls_settings = self.resolve_tls(endpoint or self.endpoint)
            if endpoint is not None:
                self.endpoint = endpoint
            c = self.client
            if c is not None and (
                c.target != target
                or (c.tls.settings if c.tls is not None else None) != tls_settings
            ):
                c.close(timeout=0.2)
                c = None
            if c is None:
                # The certificate files are read here, once per client.
                c = Client(
                    target,
                    self.hello,
                    run_id=self.run_id,
                    queue_size=self.queue_size,
                    on_advisory=self._advisory,
                    strict=self.strict,
                    tls=load_tls(tls_settings) if tls_settings is not None else None,
                )
                self.client = c
            else:
                c.strict = self.strict
            c.rank_for_logs = self.get_identity().rank
            if self.strict and c.tls is not None and c.tls.error is not None:
                raise StepwatchError(f"TLS for {target} is unusable: {c.tls.error}")
            if self.strict:
                load_wire()  # an unusable grpcio/protobuf: raised here, at setup
            return c

    def attach(
        self,
        model: Any,
        optimizer: Any = None,
        stated: Optional[dict[str, Any]] = None,
        **configure: Any,
    ) -> Client:
        """What watch() and the integrations share: the model's device and facts
        (when ``model`` is not None), then :meth:`configure`; one lock held.
        ``stated``: what the caller was told about the training, the keyword
        arguments of :func:`_torch.model_facts`."""
        stated = stated or {}
        with self.lock:
            self.begin_run()
            if model is not None:
                self.model_ref = _weak(model)
                self.gpu_uuid = _torch.gpu_uuid_for(model)
                self.cuda_device = _torch.model_cuda_device(model)
                self.cuda_checked = self.cuda_device is not None
                try:
                    self.facts = _torch.model_facts(model, optimizer, **stated)
                except Exception as e:
                    # Raised once the client is configured: the markers still go out.
                    self.facts = {}
                    facts_error: Optional[Exception] = e
                else:
                    facts_error = None
            else:
                facts_error = None
            self.tracker.grad_accumulation_steps = stated.get("grad_accumulation_steps")
            client = self.configure(**configure)
            if facts_error is not None:
                raise facts_error
            return client

    def begin_run(self) -> None:
        """A ``watch()`` or a trainer's fit is a new training run when the current
        one has marked a step: fresh step numbers (the next step is 1), a fresh
        step-1 allocator trace, and a new run id, which the client's next hello
        carries (after the old run's queued markers) so the agent starts the
        rank afresh instead of continuing the old run's steps. A ``watch()``
        before any step keeps the run (and its stream)."""
        tr = self.tracker
        if tr.step == 0 and not tr.in_step:
            return
        self.run_id = _new_run_id()
        optimizers = tr.optimizer_count
        self.tracker = self._new_tracker()
        self.tracker.optimizer_count = optimizers
        self._reset_run_predictions()
        self.recorder.abandon()
        self.recorder = Recorder()
        self.layouts = LayoutSnapshots()
        c = self.client
        if c is not None:
            c.new_run(self.run_id)

    def get_client(self) -> Client:
        c = self.client
        if c is None:
            c = self.configure()
        return c

    def get_identity(self) -> Identity:
        ident = self.identity
        if ident is None:
            ident = resolve_identity(**self.identity_overrides)
            self.identity = ident
        return ident

    def _advisory(self, p: Prediction) -> None:
        """An advisory from the agent (on the sender thread)."""
        if p.kind == STEP2_OOM_PREDICTED and self.predicted_oom is None:
            self.predicted_oom = p
            self.oom_predicted.set()
        if p.kind in (STEP2_OOM_PREDICTED, PREDICTION_FINAL):
            self.prediction_in.set()
        cb = self.on_advisory
        if cb is not None:
            cb(p)

    def _say_if_no_prediction(self) -> None:
        """At step 1's end: one warning when its markers leave the agent nothing
        to predict step 2 from (it needs a forward and a closed optimizer phase)."""
        missing = []
        if FORWARD_BEGIN not in self.step1_kinds:
            missing.append(
                "no forward of the watched model (pass watch() the module whose forward "
                "the loop calls, or mark it with stepwatch.phase('forward'))"
            )
        if OPTIMIZER_END not in self.step1_kinds:
            missing.append(
                "no optimizer step (pass watch() the optimizer, or mark it with "
                "stepwatch.phase('optimizer'))"
            )
        if missing:
            log.warning(
                "stepwatch: step 1 ended with %s; the agent cannot predict step 2's memory "
                "for this run (no step-2 out-of-memory warning will come)",
                " and ".join(missing),
            )

    def note_forward_inputs(self, args: Any, kwargs: Any) -> None:
        """Before a training forward of the watched model (its pre hook): keep
        the size of the run's first forward's inputs, and at the forward that
        opens step 2, before step 2 allocates or is held, warn once when its
        inputs are larger (step 1 was a smaller warm-up batch): the agent
        predicts step 2 from step 1, so its prediction does not cover them
        until it revises it from this forward's batch (during step 2)."""
        tr = self.tracker
        if tr.step == 0:
            self.step1_inputs = _torch.input_sizes(args, kwargs)
            return
        opens_step2 = tr.step == 1 and (not tr.in_step or tr.last == OPTIMIZER_END)
        first = self.step1_inputs
        if not opens_step2 or first is None or self.step2_inputs_larger:
            return
        now = _torch.input_sizes(args, kwargs)
        if now[0] <= first[0]:
            return
        self.step2_inputs_larger = True
        log.warning(
            "stepwatch: step 2's first forward takes larger inputs than step 1's (%d elements, "
            "shapes %s; step 1: %d, shapes %s): the agent predicted step 2 from step 1, so its "
            "prediction does not cover this batch and step 2 may need more GPU memory than "
            "predicted (a smaller warm-up step 1?); the agent revises it from this forward's "
            "batch and warns during step 2 if it does not fit. For a prediction during step 1 "
            "that covers the run, make step 1 as large as the steps after it",
            now[0],
            now[1],
            first[0],
            first[1],
        )

    def training_forward(self, args: Any, kwargs: Any) -> None:
        """A training forward (or a framework's training batch) begins: its
        FORWARD_BEGIN carries the batch read from its inputs' shapes, unless
        the script states its batches (:func:`batch`)."""
        if not self.batch_stated:
            try:
                self.forward_batch = _torch.batch_of(args, kwargs)
            except Exception as e:  # an input torch cannot describe: no batch
                log.debug("stepwatch: could not read the forward's batch: %r", e)
        try:
            self.guarded(self.tracker.forward)
        finally:
            self.forward_batch = None

    def state_batch(self, b: _batch.Batch) -> None:
        self.batch_stated = True
        self.stated_batch = b

    # ----------------------------------------------------------- step gate
    def _step_gate(self, number: int) -> None:
        """Before a step begins (``StepTracker.gate``): hold the run's second
        step for step 1's prediction (``hold_step2_for_prediction``), then,
        with ``raise_on_predicted_oom``, raise :class:`PredictedOutOfMemoryError`
        once the agent has predicted a step-2 OOM. First of all, with
        ``STEPWATCH_STOP_AFTER_STEP=N``, step N+1 does not begin: the process
        ends here (see :meth:`_stop_after_step`)."""
        stop = _stop_after_step()
        if stop is not None and number > stop:
            self._stop_process(number - 1)
        if self.tracker.step < 1:
            return  # the run's first step
        if not self.held:
            self.held = True
            if self.hold_step2_s > 0:
                self._hold_for_prediction(self.hold_step2_s)
        p = self.predicted_oom
        if p is not None and self.raise_on_predicted_oom and not self.raised:
            self.raised = True
            c = self.client
            rank = c.rank_for_logs if c is not None else None
            raise PredictedOutOfMemoryError(p, rank)

    def _stop_process(self, done: int) -> None:
        """``STEPWATCH_STOP_AFTER_STEP``: step ``done`` has ended and the next
        would begin. Send what is queued (bounded by ``STEPWATCH_EXIT_FLUSH_S``),
        flush the standard streams and end the process with status 0 at once
        (``os._exit``): no exception travels through the training loop, where a
        framework or an ``except BaseException`` could catch it, and no
        interpreter teardown runs (a torchrun rank would tear down NCCL)."""
        log.warning(
            "stepwatch: STEPWATCH_STOP_AFTER_STEP=%d: step %d ended; ending the process "
            "(exit status 0) before the next step",
            done,
            done,
        )
        c = self.client
        if c is not None:
            try:
                c.close(timeout=_exit_flush_timeout())
            except Exception:
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        _exit(0)

    def _hold_for_prediction(self, bound: float) -> None:
        """Wait, at most ``bound`` seconds, until step 1's prediction is in: the
        agent's step-2 OOM advisory, or its word that the prediction is final
        (PREDICTION_FINAL, sent once step 1's end reached it, also when step 2
        fits). Never waits for an agent that cannot answer (its socket
        missing, a connect attempt that found none, a client that stopped, or
        an agent gone during the wait); an agent older than that message
        sends none when step 2 fits, and the wait then runs to its bound."""
        c = self.client
        if c is None or not c.agent_may_answer():
            log.info("stepwatch: step 2 not held for step 1's prediction: no agent to answer")
            return
        t0 = time.monotonic()
        deadline = t0 + bound
        event = self.prediction_in
        while not event.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or not c.agent_may_answer():
                break
            event.wait(min(left, 0.01))
        waited = time.monotonic() - t0
        if event.is_set():
            log.info("stepwatch: step 2 held %.2f s until step 1's prediction arrived", waited)
        else:
            log.info(
                "stepwatch: step 2 held %.2f s (at most %.2f s); step 1's prediction did not "
                "arrive",
                waited,
                bound,
            )

    def hello(self) -> Any:
        from ._proto.stepwatch.v1 import ingest_pb2 as pb

        ident = self.get_identity()
        fw_version = self.framework_version
        if not fw_version and self.framework == "pytorch":
            fw_version = _torch.torch_version()
        h = pb.Hello(
            identity=pb.Identity(
                job_id=ident.job_id,
                rank=ident.rank,
                local_rank=ident.local_rank,
                world_size=ident.world_size,
                node_name=ident.node_name,
                pod=ident.pod,
                namespace=ident.namespace,
            ),
            gpu_uuid=self.gpu_uuid,
            pid=os.getpid(),
            framework=self.framework,
            framework_version=sanitize_id(str(fw_version)),
            # Whatever the framework: the agent's replay follows this
            # version's allocator rules.
            torch_version=sanitize_id(_torch.torch_version()),
            client_version=__version__,
            run_id=self.run_id,
        )
        if self.facts:
            set_model_facts(h.model, self.facts)
        return h

    # -------------------------------------------------------------- markers
    def allocator_trace_enabled(self) -> bool:
        """watch(allocator_trace=) / configure(), else $STEPWATCH_ALLOCATOR_TRACE (default on);
        needs the allocator figures (allocator_stats)."""
        if not self.allocator_stats:
            return False
        if self.allocator_trace is not None:
            return self.allocator_trace
        return _env_flag("STEPWATCH_ALLOCATOR_TRACE", True)

    def exact_step_peaks_enabled(self) -> bool:
        """watch(exact_step_peaks=) / configure(), else $STEPWATCH_EXACT_STEP_PEAKS
        (default on); needs the allocator figures (allocator_stats)."""
        if not self.allocator_stats:
            return False
        if self.exact_step_peaks is not None:
            return self.exact_step_peaks
        return _env_flag("STEPWATCH_EXACT_STEP_PEAKS", True)

    def _reset_peaks(self, kind: int, step: int, dev: int) -> None:
        """At a step's begin from step 2 on, and a pass's begin after step 1:
        reset the device's peak counters, so that this step's (pass's) markers
        bound its peak exactly (see _peaks). Step 1's counters are left as they
        are. A failure turns it off for the process, with one warning."""
        begins = (kind == STEP_BEGIN and step > 1) or (
            kind in (EVAL_BEGIN, CHECKPOINT_BEGIN) and step >= 1
        )
        if not begins or not self.exact_step_peaks_enabled():
            return
        try:
            if _peaks.KEEPER.install():
                _peaks.KEEPER.reset_for_step(dev)
            else:
                self.exact_step_peaks = False
                log.info(
                    "stepwatch: this PyTorch cannot reset its peak memory counters; the "
                    "agent's step peaks after step 1 are lower bounds"
                )
        except Exception as e:
            self.exact_step_peaks = False
            log.warning(
                "stepwatch: could not reset PyTorch's peak memory counters (%r); the agent's "
                "step peaks after step 1 are lower bounds",
                e,
            )

    def layout_snapshots_enabled(self) -> bool:
        """$STEPWATCH_LAYOUT_SNAPSHOTS (default on); needs the allocator figures."""
        return self.allocator_stats and _env_flag("STEPWATCH_LAYOUT_SNAPSHOTS", True)

    def _emit(self, kind: int, step: int, micro: int) -> None:
        batch = None
        if kind == FORWARD_BEGIN:
            batch = self.forward_batch
        if self.stated_batch is not None and kind <= STEP_END:
            batch, self.stated_batch = self.stated_batch, None
        if step == 1:
            self.step1_kinds.add(kind)
            if kind == STEP_END:
                self._say_if_no_prediction()
        if self.ddp_watch is not None and (step > 1 or kind in STEP1_BACKWARD_DONE):
            # Past step 1 (no optimizer marker came) DDP has rebuilt by now.
            self._send_ddp_bucket_rebuild(send=step == 1)
        dev = None
        if self.allocator_stats:
            if not self.cuda_checked and kind == STEP_BEGIN:  # look for CUDA once
                self.cuda_checked = True
                if self.cuda_device is None:
                    self.cuda_device = _torch.active_cuda_device()
            dev = self.cuda_device
        c = self.client
        if c is None:
            c = self.get_client()
        rec = self.recorder
        # Step 1 only: its allocator trace (see _alloctrace). on_marker may start
        # recording (at STEP_BEGIN), so the stats are read after it.
        recording = not rec.done and rec.on_marker(c, kind, step, dev, self.allocator_trace_enabled)
        alloc = None
        device = None
        finish = False
        layout = None
        if dev is not None:
            self._reset_peaks(kind, step, dev)
            stats = _torch.allocator_stats(dev)  # one read: figures and step 1's counters
            if stats is not None:
                alloc = _torch.allocator_figures(stats, _peaks.KEEPER.step_peaks(dev))
            if recording:
                finish = rec.note(c, kind, stats)
            elif (
                step == 1
                and kind in OPTIMIZER_MARKERS
                and not self.layouts.done
                and self.layout_snapshots_enabled()
            ):
                # No trace: the layout the agent would read from it, at the two
                # moments that show where the optimizer state went.
                layout = self.layouts.take(c, kind, dev, self.watched_parameters)
            if self.device_memory and (step == 1 or kind == OOM):
                device = self._device_memory(dev)
        c.mark(kind, step, micro, alloc, device, layout, batch)
        if finish:
            rec.finish(c)

    def watched_parameters(self) -> Iterable[Any]:
        """The watched model's parameters; none when no model was given or it is gone."""
        model = self.model_ref() if self.model_ref is not None else None
        params = getattr(model, "parameters", None)
        return params() if callable(params) else ()

    def _device_memory(self, dev: int) -> Optional[tuple[int, int]]:
        """(free, total) from cudaMemGetInfo for step 1's markers and OOM markers
        only: a driver call each, which later steps do without. The agent measures
        the memory outside the allocator from it exactly (its NVML samples only
        bound it). Any failure turns it off for the process, with one warning."""
        try:
            return _torch.device_memory(dev)
        except Exception as e:
            self.device_memory = False
            log.warning(
                "stepwatch: could not read the device's free memory (torch.cuda.mem_get_info): "
                "%r; the agent falls back to NVML samples for the memory outside the allocator",
                e,
            )
            return None

    def _send_ddp_bucket_rebuild(self, send: bool = True) -> None:
        """Once step 1's backward is done: tell the agent of DDP's bucket rebuild
        to come (when one is and ``send``), ahead of this marker and of step 1's
        allocator trace, and take the watch's hooks out."""
        w, self.ddp_watch = self.ddp_watch, None
        if w is None:
            return
        try:
            rebuild = w.facts() if send else None
        except Exception as e:  # a torch whose DDP differs: no facts, training goes on
            log.debug("stepwatch: could not size DDP's rebuilt buckets: %r", e)
            rebuild = None
        finally:
            w.remove()
        if rebuild is not None:
            self.get_client().send_model_update({"ddp_bucket_rebuild": rebuild})

    def guarded(self, fn: Callable[[], Any]) -> None:
        """Run a marking action from a hook: never raise into training unless strict
        (or asked to: ``raise_on_predicted_oom``)."""
        try:
            fn()
        except PredictedOutOfMemoryError:
            raise
        except StepwatchError:
            if self.strict:
                raise
        except Exception as e:
            c = self.client
            if c is not None:
                c.counters["hook_errors"] += 1
            if self.strict:
                raise
            log.debug("stepwatch: marking failed: %r", e)

    def note_grads_set_to_none(self, set_to_none: bool) -> None:
        """What a ``zero_grad`` call says of the gradients. When it differs from
        what the agent assumes (the hello's fact, else PyTorch's default: set to
        None), the facts change and the agent is told at once, in order with the
        markers, so step 2's prediction counts kept gradients."""
        facts = self.facts if self.facts is not None else {}
        said = facts.get("grads_set_to_none")
        if set_to_none == (True if said is None else said):
            return
        with self.lock:
            facts["grads_set_to_none"] = set_to_none
            self.facts = facts  # a reconnect's hello carries it too
        c = self.client
        if c is None:
            c = self.get_client()
        c.send_model_update({"grads_set_to_none": set_to_none})

    def report_oom(self, exc: BaseException) -> None:
        """Send the OOM marker for ``exc`` once, and give it a short chance to go out."""
        if getattr(exc, "_stepwatch_oom_reported", False):
            return
        try:
            exc._stepwatch_oom_reported = True  # type: ignore[attr-defined]
        except Exception:
            pass
        try:
            self.tracker.oom()
            self._send_oom_report(exc)
            c = self.client
            if c is not None:
                c.flush(timeout=_oom_flush_timeout())
        except Exception as e:  # the OOM is what matters; never mask it
            log.debug("stepwatch: could not report OOM: %r", e)

    def _send_oom_report(self, exc: BaseException) -> None:
        """After the OOM marker: what the allocator knew (see _torch.oom_report)."""
        dev = self.cuda_device if self.allocator_stats else None
        c = self.client
        if dev is None or c is None:
            return
        try:
            # The OOM marker's step: 0 only for a pass before the first step.
            report = _torch.oom_report(dev, exc, self.tracker.step)
        except Exception as e:  # the OOM is what matters
            log.debug("stepwatch: could not read the allocator at the OOM: %r", e)
            return
        c.send_oom_report(report)

    # ------------------------------------------------------------ excepthook
    def install_excepthook(self) -> None:
        with self.lock:
            if self.excepthook_installed:
                return
            self._prev_excepthook = sys.excepthook
            sys.excepthook = self._excepthook
            self.excepthook_installed = True

    def remove_excepthook(self) -> None:
        with self.lock:
            if not self.excepthook_installed:
                return
            if sys.excepthook == self._excepthook:
                sys.excepthook = self._prev_excepthook
            self.excepthook_installed = False

    def _excepthook(self, etype: Any, value: Any, tb: Any) -> None:
        try:
            if value is not None and _torch.is_oom(value):
                self.report_oom(value)
        finally:
            prev = self._prev_excepthook or sys.__excepthook__
            prev(etype, value, tb)

    # --------------------------------------------------------------- atexit
    def shutdown(self) -> None:
        c = self.client
        if c is not None:
            try:
                c.close(timeout=_exit_flush_timeout())
            except Exception:
                pass


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``, or a strong one where it takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _new_run_id() -> str:
    """A run id unique on this host: the PID and 64 random bits, in the charset
    the agent accepts for identifiers."""
    return f"{os.getpid():x}-{uuid.uuid4().hex[:16]}"


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


# How the process ends at STEPWATCH_STOP_AFTER_STEP (tests replace it).
_exit: Callable[[int], Any] = os._exit


def _stop_after_step() -> Optional[int]:
    """``$STEPWATCH_STOP_AFTER_STEP``: end the process once this many steps have
    ended (``stepwatch preflight`` sets it); None when unset. A value that is no
    whole number >= 1 is ignored, with one warning."""
    v = os.environ.get("STEPWATCH_STOP_AFTER_STEP")
    if v is None or not v.strip():
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n >= 1:
        return n
    if v not in _WARNED_STOP_VALUES:
        _WARNED_STOP_VALUES.add(v)
        log.warning(
            "stepwatch: STEPWATCH_STOP_AFTER_STEP=%r is not a step number (a whole number "
            ">= 1); ignored",
            v,
        )
    return None


_WARNED_STOP_VALUES: set[str] = set()


def _oom_flush_timeout() -> float:
    return _env_float("STEPWATCH_OOM_FLUSH_S", 0.5)


def _exit_flush_timeout() -> float:
    return _env_float("STEPWATCH_EXIT_FLUSH_S", 1.0)


RT = _Runtime()
atexit.register(RT.shutdown)


def _after_fork_in_child() -> None:
    # The child keeps the tracker's step numbers (it is the same program) and
    # gets a fresh lock; its Client resets itself (see _client).
    RT.lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------- API
class WatchHandle:
    """What ``watch()`` returns. ``remove()`` takes every hook out again."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._excepthook = False

    def remove(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:
                pass
        self._handles.clear()
        if self._excepthook:
            RT.remove_excepthook()
            self._excepthook = False

    def __enter__(self) -> WatchHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def watch(
    model: Any,
    optimizer: Any = None,
    *,
    job_id: Optional[str] = None,
    rank: Optional[int] = None,
    local_rank: Optional[int] = None,
    world_size: Optional[int] = None,
    endpoint: Optional[str] = None,
    on_advisory: Optional[Callable[[Prediction], None]] = None,
    strict: bool = False,
    grad_accumulation_steps: Optional[int] = None,
    precision: Optional[str] = None,
    sharding_factor: Optional[int] = None,
    grads_set_to_none: Optional[bool] = None,
    micro_batch_size: Optional[int] = None,
    queue_size: Optional[int] = None,
    allocator_stats: bool = True,
    allocator_trace: Optional[bool] = None,
    exact_step_peaks: Optional[bool] = None,
    oom_excepthook: bool = True,
    framework: str = "pytorch",
    framework_version: Optional[str] = None,
    connect_timeout: Optional[float] = None,
    tls_ca: Optional[str] = None,
    tls_cert: Optional[str] = None,
    tls_key: Optional[str] = None,
    hold_step2_for_prediction: Optional[float] = None,
    raise_on_predicted_oom: bool = False,
    largest_batch: Optional[dict[str, Any]] = None,
) -> WatchHandle:
    """Hook a PyTorch model (and its optimizer) so every training step is reported.

    One line in a training script::

        handle = stepwatch.watch(model, optimizer)

    Markers: the first forward of a step opens it (STEP_BEGIN, FORWARD_BEGIN);
    the gradient reaching the model's output marks BACKWARD_BEGIN; the
    optimizer's step pre/post hooks mark OPTIMIZER_BEGIN/END and close the step
    (STEP_END). Further forward/backward pairs before the optimizer step are
    micro-batches (gradient accumulation). Forwards in eval mode or under
    ``torch.no_grad()`` are ignored.

    With ``strict=True`` the agent must answer within ``connect_timeout``
    seconds (else :class:`StepwatchError`), and marking errors and agent
    rejections are raised into training instead of being counted.

    TLS (TCP endpoints): ``endpoint="https://host:port"``, or a ``host:port``
    endpoint with a CA. ``tls_ca`` is the PEM CA bundle that signed the agent's
    certificate (default ``$STEPWATCH_TLS_CA``; without one, the system roots);
    ``tls_cert``/``tls_key`` are this client's PEM certificate chain and key
    for mutual TLS (default ``$STEPWATCH_TLS_CERT``/``$STEPWATCH_TLS_KEY``).
    The files are read once, here; one that cannot be read is logged and the
    client then behaves as with an unreachable agent (``strict=True``: raised).

    ``micro_batch_size``: samples per forward on this rank. With it the agent
    sizes step 1's activation memory per sample and, when step 2 will not fit,
    names the largest micro-batch that would.

    Batches: each training forward's FORWARD_BEGIN carries the size of its
    batch, read from the shape of its main input (``input_ids``-like keyword
    arguments, else the first tensor): dimension 0 as samples, and for an
    integer (token id) tensor its elements as tokens. :func:`batch` states
    them instead. ``largest_batch`` (a dict of ``samples``, ``tokens``,
    ``shape``): the largest batch the data loader can produce; the agent then
    says what it would need and whether it fits.

    Evaluation: forwards in eval mode or without gradients outside a training
    step are an evaluation pass (EVAL_BEGIN, and EVAL_END before the next
    step or :func:`checkpoint`); the agent keeps its memory apart from the
    steps'.

    ``allocator_trace`` (default ``$STEPWATCH_ALLOCATOR_TRACE``, on): on CUDA,
    record the caching allocator's history during step 1 (no stacks) and send
    it once, after step 1's optimizer phase, so the agent can predict step 2's
    fragmentation. ``False`` (or ``STEPWATCH_ALLOCATOR_TRACE=0``) turns it off.

    ``exact_step_peaks`` (default ``$STEPWATCH_EXACT_STEP_PEAKS``, on): on CUDA,
    from step 2 on, reset PyTorch's peak memory counters at each step's (and
    pass's) begin, so that the agent has each step's exact allocator peak;
    ``torch.cuda.max_memory_allocated()`` and the other peak readers still
    return peaks since the script's own last reset (stepwatch wraps
    ``torch._C._cuda_memoryStats`` and ``_cuda_resetPeakMemoryStats`` for
    that). ``False`` leaves torch unwrapped; the agent's step peaks after
    step 1 are then lower bounds.

    ``optimizer``: a ``torch.optim.Optimizer``, a wrapper of one (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``,
    ``ZeroRedundancyOptimizer``, anything keeping it in ``.optimizer``,
    ``._optimizer`` or ``.optim``), or a list of them: one step then runs
    until each has stepped. An object that is none of these has its
    ``step()`` watched instead (one warning).

    ``hold_step2_for_prediction`` (seconds, default 0: off): the run's second
    step waits before its first marker, at most this long, until the agent's
    step-2 prediction is in (its out-of-memory advisory, or its word that the
    prediction is final, which comes as soon as step 1's end reached the
    agent, also when step 2 fits); it never waits for an agent that cannot
    answer (socket missing, connect failed). Once per run. Default
    ``$STEPWATCH_HOLD_STEP2_FOR_PREDICTION`` (seconds), else 0.

    ``raise_on_predicted_oom``: once the agent has predicted that step 2 will
    run out of GPU memory, raise :class:`PredictedOutOfMemoryError` (its
    figures and advice) into training at the next step boundary, before that
    step allocates, instead of letting step 2 die. Combine with
    ``hold_step2_for_prediction`` so that the advisory is in before step 2.

    ``watch()`` never raises into training (unless ``strict=True``): a part it
    cannot set up is left out with one warning naming it, the rest watches,
    and ``stats()["watch_errors"]`` counts such calls.
    """
    handle = WatchHandle()
    failed: list[str] = []

    def part(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            if strict:
                raise
            failed.append(f"{what} ({type(e).__name__}: {e})")
            log.debug("stepwatch: watch() could not %s", what, exc_info=True)
            return None

    part("import torch", _torch.require_torch)

    def options() -> None:
        RT.raise_on_predicted_oom = bool(raise_on_predicted_oom)
        RT.hold_step2_s = 0.0
        hold = hold_step2_for_prediction
        if hold is None:
            hold = _env_float("STEPWATCH_HOLD_STEP2_FOR_PREDICTION", 0.0)
        RT.hold_step2_s = _hold_bound(hold)

    part("read its options", options)

    def attach() -> Client:
        return RT.attach(
            model,
            optimizer,
            dict(
                grad_accumulation_steps=grad_accumulation_steps,
                precision=precision,
                sharding_factor=sharding_factor,
                grads_set_to_none=grads_set_to_none,
                micro_batch_size=micro_batch_size,
                largest_batch=largest_batch,
            ),
            endpoint=endpoint,
            job_id=job_id,
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            on_advisory=on_advisory,
            strict=strict,
            queue_size=queue_size,
            framework=framework,
            # "": hello() sends torch's version for framework "pytorch".
            framework_version=framework_version or "",
            allocator_stats=allocator_stats,
            allocator_trace=allocator_trace,
            exact_step_peaks=exact_step_peaks,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )

    client: Optional[Client] = part("read the model facts or set up the client", attach)
    if client is None and not strict:
        client = RT.client  # configured all the same when only the facts failed

    def add(hooks: Optional[list[Any]]) -> None:
        if hooks:
            handle._handles += hooks

    add(part("hook the model", lambda: _torch.install_module_hooks(RT, model)))
    if optimizer is not None:
        add(part("hook the optimizer", lambda: _torch.install_optimizer_hooks(RT, optimizer)))
    else:
        log.warning(
            "stepwatch: watch() got no optimizer: steps are not closed and the agent cannot "
            "predict step 2's memory, unless the loop marks the optimizer step with "
            "stepwatch.phase('optimizer')"
        )
    add(part("watch zero_grad", lambda: _torch.install_zero_grad_watch(RT, model, optimizer)))
    add(part("watch DDP's buckets", lambda: _torch.install_ddp_bucket_watch(RT, model)))

    def excepthook() -> bool:
        RT.install_excepthook()
        return True

    if oom_excepthook and part("install the OOM excepthook", excepthook):
        handle._excepthook = True
    if failed:
        RT.watch_errors += 1
        log.warning(
            "stepwatch: watch() could not %s; training goes on, watched without it",
            "; ".join(failed),
        )
    if client is None:
        return handle
    if strict:
        timeout = connect_timeout if connect_timeout is not None else client.connect_timeout
        if not client.wait_connected(timeout + 0.5):
            handle.remove()
            raise StepwatchError(f"no stepwatch agent answered at {client.target}")
    else:
        part("start the sender", client.start)  # connect while the first batch loads
    return handle


def _hold_bound(value: Any) -> float:
    """``hold_step2_for_prediction`` in seconds: a number ≥ 0 (True: 5 s)."""
    if value is True:
        return 5.0
    if not value:
        return 0.0
    bound = float(value)
    if not bound >= 0:
        raise ValueError(f"hold_step2_for_prediction must be seconds >= 0, not {value!r}")
    return bound


@contextlib.contextmanager
def step(number: Optional[int] = None) -> Iterator[int]:
    """Mark one training step by hand: ``with stepwatch.step(i): ...``.

    ``number`` is the 1-based optimizer step (default: the next one). A CUDA
    out-of-memory error escaping the block is reported (OOM marker) before it
    propagates; no error is ever swallowed.
    """
    tr = RT.tracker
    n: list[int] = [number or 0]

    def begin() -> None:
        n[0] = tr.begin_step(number, manual=True)

    RT.guarded(begin)
    try:
        yield n[0]
    except BaseException as e:
        if _torch.is_oom(e):
            RT.report_oom(e)
        else:
            RT.guarded(tr.abandon_step)
        raise
    else:
        RT.guarded(tr.end_step)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase by hand: ``with stepwatch.phase("forward"): ...``.

    ``name`` is "forward", "backward" or "optimizer". Outside a ``step()`` block
    the first phase of a step opens it and the end of "optimizer" closes it.
    """
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; use one of {', '.join(PHASES)}")
    tr = RT.tracker
    begin = {"forward": tr.forward, "backward": tr.backward, "optimizer": tr.optimizer_begin}[name]
    RT.guarded(begin)
    try:
        yield
    except BaseException as e:
        if _torch.is_oom(e):
            RT.report_oom(e)
        raise
    else:
        if name == "optimizer":
            RT.guarded(tr.optimizer_end)


def batch(samples: Any = None, tokens: Any = None, shape: Any = None) -> None:
    """Say what the current step's batch is: ``stepwatch.batch(samples=8,
    tokens=8 * 2048)``, before or during the step (a step keeps the largest it
    was told). ``shape`` is its main input's shape. From the first call on,
    batches are no longer read from forward inputs. A figure that cannot be
    right (not a whole number >= 1, more than 8 dimensions) is left out with
    one warning (``strict=True``: ValueError)."""
    try:
        b = _batch.stated(samples, tokens, shape)
    except ValueError as e:
        if RT.strict:
            raise
        c = RT.client
        if c is not None:
            c.counters["hook_errors"] += 1
        if str(e) not in _WARNED_BATCHES:
            _WARNED_BATCHES.add(str(e))
            log.warning("stepwatch: stepwatch.batch() ignored: %s", e)
        return
    RT.state_batch(b)


_WARNED_BATCHES: set[str] = set()


@contextlib.contextmanager
def _pass(kind: int) -> Iterator[None]:
    """An evaluation pass or checkpoint save between steps (see the tracker);
    an OOM escaping it ends it (reported first), any other error too."""
    tr = RT.tracker
    RT.guarded(lambda: tr.begin_pass(kind))
    try:
        with oom_guard():
            yield
    finally:
        RT.guarded(lambda: tr.end_pass(kind))


def checkpoint() -> contextlib.AbstractContextManager[None]:
    """Mark a checkpoint save: ``with stepwatch.checkpoint(): torch.save(...)``.

    Between training steps only (inside a step it marks nothing): the agent
    keeps the save's memory (a gathered state dict, serialisation buffers)
    apart from the steps' and reports its headroom. An OOM escaping the block
    is reported, then propagates."""
    return _pass(CHECKPOINT_BEGIN)


def evaluation() -> contextlib.AbstractContextManager[None]:
    """Mark an evaluation pass by hand: ``with stepwatch.evaluation(): ...``
    (``watch()`` marks forwards in eval mode or without gradients outside a
    step by itself; this is for a model it does not watch)."""
    return _pass(EVAL_BEGIN)


@contextlib.contextmanager
def oom_guard() -> Iterator[None]:
    """Report a CUDA OOM escaping the block (then let it propagate)."""
    try:
        yield
    except BaseException as e:
        if _torch.is_oom(e):
            RT.report_oom(e)
        raise


def configure(**kwargs: Any) -> None:
    """Set identity/endpoint/callback without hooking a model (for manual marking)."""
    RT.configure(**kwargs)


def stats() -> dict[str, Any]:
    """Counters of this process's client: sent, dropped, reconnects, … (see README)."""
    c = RT.client
    if c is None:
        s: dict[str, Any] = dict.fromkeys(COUNTER_NAMES, 0)
        s["queued"] = 0
        s["connected"] = False
        s["endpoint"] = endpoint_target(RT.endpoint)
        s["tls"] = RT.resolve_tls(RT.endpoint) is not None
        s["stopped"] = stopped_before_start()
    else:
        s = c.stats()
    s["watch_errors"] = RT.watch_errors
    s["step2_inputs_larger"] = RT.step2_inputs_larger
    return s


def last_prediction() -> Optional[Prediction]:
    """The latest advisory from the agent, or None."""
    c = RT.client
    return None if c is None else c.last_prediction()


def flush(timeout: float = 1.0) -> bool:
    """Wait at most ``timeout`` s for queued markers to be written to the agent."""
    c = RT.client
    return True if c is None else c.flush(timeout)


def shutdown(timeout: float = 1.0) -> None:
    """Flush (bounded), end the stream and forget the client; the next marker starts anew."""
    with RT.lock:
        c, RT.client = RT.client, None
    if c is not None:
        c.close(timeout=timeout)


def reset() -> None:
    """Forget all state (client, step numbers, identity). Meant for tests."""
    shutdown(timeout=0.2)
    RT.remove_excepthook()
    with RT.lock:
        RT.recorder.abandon()
        RT._set_defaults()
    _peaks.KEEPER.uninstall()
