"""stepwatch.watch() on a real PyTorch model (CPU path runs every hook)."""

from __future__ import annotations

import contextlib

import pytest
from conftest import STEP, expected, small_model, summary, train

import stepwatch

torch = pytest.importorskip("torch")


def test_steps_and_phases(agent):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepwatch.watch(model, opt)
    train(model, opt, 3)
    ms = agent.wait_markers(18)
    assert summary(ms) == [(k, s, 0) for s in (1, 2, 3) for k in STEP]


def test_gradient_accumulation_micro_batches(agent):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stepwatch.watch(model, opt, grad_accumulation_steps=3)
    train(model, opt, 2, accumulate=3)
    ms = agent.wait_markers(2 * 10)
    assert summary(ms)[:10] == expected(1, micro=3)
    assert summary(ms)[10] == ("STEP_BEGIN", 2, 0)
    assert agent.streams[0].hello.model.grad_accumulation_steps == 3


def test_eval_and_no_grad_forwards_are_an_evaluation_pass_not_steps(agent):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    train(model, opt, 1)
    with torch.no_grad():
        model(torch.randn(2, 8))
    model.eval()
    model(torch.randn(2, 8))
    model.train()
    train(model, opt, 1)
    ms = agent.wait_markers(14)
    assert summary(ms) == (
        [(k, 1, 0) for k in STEP]
        + [("EVAL_BEGIN", 1, 0), ("EVAL_END", 1, 0)]
        + [(k, 2, 0) for k in STEP]
    )


def test_output_structures_dict_and_tuple(agent):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            out = self.lin(x)
            return {"logits": out, "loss": out.pow(2).mean(), "aux": (out, 3)}

    model = M()
    opt = torch.optim.Adam(model.parameters())
    stepwatch.watch(model, opt)
    for _ in range(2):
        model(torch.randn(3, 4))["loss"].backward()
        opt.step()
        opt.zero_grad()
    ms = agent.wait_markers(12)
    assert summary(ms) == [(k, s, 0) for s in (1, 2) for k in STEP]


def test_remove_takes_out_every_hook(agent):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = stepwatch.watch(model, opt)
    train(model, opt, 1)
    agent.wait_markers(6)
    h.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    train(model, opt, 2)
    stepwatch.flush(1)
    assert stepwatch.stats()["enqueued"] == 6


def test_hello_model_facts(agent):
    model = small_model()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(model, opt, job_id="facts", precision="bf16-mixed", sharding_factor=2)
    train(model, opt, 1)
    agent.wait_markers(6)
    h = agent.streams[0].hello
    assert h.framework == "pytorch" and h.framework_version.startswith(torch.__version__[:3])
    assert h.torch_version == torch.__version__
    assert h.gpu_uuid == ""  # CPU
    m = h.model
    assert (m.parameter_count, m.parameter_bytes) == (n, 4 * n)
    assert m.optimizer == 1 and m.state_bytes_per_parameter == 8  # ADAM, 2 x fp32
    assert m.precision == 2 and m.sharding_factor == 2
    assert m.HasField("state_precreated") and not m.state_precreated
    assert not m.HasField("micro_batch_size")


def test_hello_micro_batch_size(agent):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    stepwatch.watch(model, opt, job_id="mbs", micro_batch_size=8)
    train(model, opt, 1)
    agent.wait_markers(6)
    assert agent.streams[0].hello.model.micro_batch_size == 8


@pytest.mark.parametrize("bad", [0, -2, True])
def test_micro_batch_size_below_one_is_refused(bad):
    from stepwatch._torch import model_facts

    with pytest.raises(ValueError, match="micro_batch_size must be at least 1"):
        model_facts(small_model(), micro_batch_size=bad)


def test_loader_batch_size():
    from stepwatch._torch import loader_batch_size

    ds = torch.utils.data.TensorDataset(torch.randn(8, 2))
    loader = torch.utils.data.DataLoader(ds, batch_size=3)
    assert loader_batch_size(loader) == 3
    assert loader_batch_size([loader]) == 3
    assert loader_batch_size({"a": loader}) == 3
    sampler = torch.utils.data.BatchSampler(range(8), batch_size=2, drop_last=False)
    assert loader_batch_size(torch.utils.data.DataLoader(ds, batch_sampler=sampler)) is None
    assert loader_batch_size(None) is None


@pytest.mark.parametrize(
    "make,kind,state_bytes,precreated",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), 3, 0, False),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 2, 4, False),
        (lambda p: torch.optim.Adam(p, amsgrad=True), 1, 12, False),
        (lambda p: torch.optim.RMSprop(p), 4, None, False),
    ],
)
def test_optimizer_kinds(make, kind, state_bytes, precreated):
    from stepwatch._torch import model_facts

    model = small_model()
    f = model_facts(model, make(model.parameters()))
    assert f["optimizer"] == kind
    assert f.get("state_bytes_per_parameter") == state_bytes
    assert f["state_precreated"] is precreated


@pytest.mark.parametrize(
    "make,implementation",
    [
        (lambda p: torch.optim.AdamW(p, foreach=True), 1),
        (lambda p: torch.optim.AdamW(p, fused=True), 2),
        (lambda p: torch.optim.AdamW(p, foreach=False), 3),
        # Unset on CPU parameters: torch picks the for-loop (foreach needs CUDA).
        (lambda p: torch.optim.AdamW(p), 3),
        (lambda p: torch.optim.SGD(p, lr=0.1, foreach=True), 1),
    ],
)
def test_optimizer_implementation(make, implementation):
    from stepwatch._torch import model_facts

    model = small_model()
    assert (
        model_facts(model, make(model.parameters()))["optimizer_implementation"] == implementation
    )


def test_state_precreated_detected():
    from stepwatch._torch import model_facts

    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, 1)
    assert model_facts(model, opt)["state_precreated"] is True


def test_wrapped_optimizers_are_seen_through():
    """accelerate's AcceleratedOptimizer (the HF Trainer's) is itself a
    torch.optim.Optimizer that keeps the real one in ``.optimizer``."""
    from stepwatch._torch import model_facts

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups

    model = small_model()
    inner = torch.optim.AdamW(model.parameters())
    f = model_facts(model, Wrapper(Wrapper(inner)))
    assert (f["optimizer"], f["state_bytes_per_parameter"]) == (1, 8)
    train(model, inner, 1)
    assert model_facts(model, Wrapper(inner))["state_precreated"] is True


def test_sharded_parameters_count_what_this_rank_holds():
    """An FSDP2 parameter is a DTensor whose numel() is the whole parameter's."""
    from stepwatch._torch import model_facts

    class Shard:
        requires_grad = True
        dtype = torch.float32

        def __init__(self, whole, local):
            self.whole, self.local = whole, local

        def numel(self):
            return self.whole

        def element_size(self):
            return 4

        def to_local(self):
            return torch.empty(self.local)

    class Sharded:
        def parameters(self):
            return iter([Shard(1000, 250), Shard(40, 10)])

    f = model_facts(Sharded())
    assert (f["parameter_count"], f["parameter_bytes"]) == (260, 1040)


def fake_oom():
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_oom_in_forward_is_reported_before_it_propagates(agent):
    class Boom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.fail = False

        def forward(self, x):
            if self.fail:
                raise fake_oom()
            return self.lin(x)

    model = Boom()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    train_one = lambda: (model(torch.randn(1, 2)).sum().backward(), opt.step())  # noqa: E731
    train_one()
    model.fail = True
    with pytest.raises(torch.cuda.OutOfMemoryError):
        train_one()
    # The OOM marker was queued (and flushed, bounded) before the error left forward().
    assert stepwatch.stats()["enqueued"] == 9
    ms = agent.wait_markers(9)
    assert summary(ms)[-3:] == [("STEP_BEGIN", 2, 0), ("FORWARD_BEGIN", 2, 0), ("OOM", 2, 0)]


def test_oom_in_manual_step(agent):
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with stepwatch.step(1):
            with stepwatch.phase("forward"):
                pass
            with stepwatch.phase("backward"):
                raise fake_oom()
    ms = agent.wait_markers(4)
    assert summary(ms) == [
        ("STEP_BEGIN", 1, 0),
        ("FORWARD_BEGIN", 1, 0),
        ("BACKWARD_BEGIN", 1, 0),
        ("OOM", 1, 0),
    ]
    # Training may catch the OOM and go on: the next step is a new one.
    with stepwatch.step():
        pass
    assert summary(agent.wait_markers(6))[-2:] == [("STEP_BEGIN", 2, 0), ("STEP_END", 2, 0)]


def test_uncaught_oom_reported_by_excepthook(agent):
    import sys

    model = small_model()
    h = stepwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(1, 8)).sum().backward()
    called = []
    prev = stepwatch._runtime.RT._prev_excepthook
    stepwatch._runtime.RT._prev_excepthook = lambda *a: called.append(a)
    try:
        e = fake_oom()
        sys.excepthook(type(e), e, None)
    finally:
        stepwatch._runtime.RT._prev_excepthook = prev
    assert called  # the previous hook still runs
    assert summary(agent.wait_markers(4))[-1] == ("OOM", 1, 0)
    h.remove()
    assert sys.excepthook is not stepwatch._runtime.RT._excepthook


def test_strict_without_agent_raises(sock_dir, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ENDPOINT", f"unix://{sock_dir}/none.sock")
    model = small_model()
    with pytest.raises(stepwatch.StepwatchError, match="no stepwatch agent"):
        stepwatch.watch(model, None, strict=True, connect_timeout=0.3)
    assert not model._forward_pre_hooks


def test_training_result_unchanged_by_watch(sock_dir, monkeypatch):
    monkeypatch.setenv("STEPWATCH_ENDPOINT", f"unix://{sock_dir}/none.sock")

    def run(with_watch):
        model = small_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        h = stepwatch.watch(model, opt) if with_watch else None
        torch.manual_seed(1)
        train(model, opt, 3)
        if h:
            h.remove()
        return [p.detach().clone() for p in model.parameters()]

    a, b = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_step_begins_before_pre_hooks_registered_earlier(agent):
    """FSDP2 all-gathers the root's parameters in a forward pre hook registered
    (prepended) before watch(); the step must already have begun then, so that step
    1's allocator trace holds those allocations as step 2 will make them."""
    from stepwatch._runtime import RT

    model = small_model()
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(RT.tracker.step), prepend=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    train(model, opt, 2)
    assert seen == [1, 2], seen
    ms = agent.wait_markers(12)
    assert summary(ms) == [(k, s, 0) for s in (1, 2) for k in STEP]


def ddp_rebuilds(agent):
    """The ddp_bucket_rebuild updates the stream sent, once step 2 began."""
    agent.wait_markers(7)  # step 1 and step 2's STEP_BEGIN
    (stream,) = agent.streams
    return [u.ddp_bucket_rebuild for u in stream.model_updates if u.HasField("ddp_bucket_rebuild")]


def ddp_train(model, opt, steps, micro_batches=1, no_sync=False):
    for _ in range(steps):
        for i in range(micro_batches):
            last = i == micro_batches - 1
            ctx = model.no_sync() if no_sync and not last else contextlib.nullcontext()
            with ctx:
                model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def ddp_model(**kw):
    layers = [torch.nn.Linear(256, 256) for _ in range(4)]
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), **kw)


def test_ddp_sends_the_buckets_it_rebuilds_and_they_are_ddps(agent, gloo_group):
    # bucket_cap_mb=0.5 (the first bucket's cap too, not being the default):
    # a bucket closes at its second layer of 257 KiB, in the order gradients
    # became ready (last layer first).
    model = ddp_model(bucket_cap_mb=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    ddp_train(model, opt, 3)
    (rebuild,) = ddp_rebuilds(agent)
    layer = (256 * 256 + 256) * 4
    assert list(rebuild.old_bucket_bytes) == [4 * layer]
    assert list(rebuild.new_bucket_bytes) == [layer + layer, layer + layer]
    # DDP's own account, logged at step 3's forward.
    data = model._get_ddp_logging_data()
    assert [int(b) for b in data["rebuilt_bucket_sizes"].split(",")] == list(
        rebuild.new_bucket_bytes
    )


def test_ddp_rebuilt_in_step_1_or_never_sends_nothing(agent, gloo_group):
    # Two micro-batches both reducing (no no_sync): DDP rebuilds at the second's
    # forward, inside step 1, so step 2 has nothing to rebuild.
    model = ddp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt, grad_accumulation_steps=2)
    ddp_train(model, opt, 2, micro_batches=2)
    assert model._has_rebuilt_buckets
    assert ddp_rebuilds(agent) == []


def test_ddp_under_no_sync_sends_the_rebuild_of_its_synced_backward(agent, gloo_group):
    model = ddp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt, grad_accumulation_steps=2)
    ddp_train(model, opt, 2, micro_batches=2, no_sync=True)
    (rebuild,) = ddp_rebuilds(agent)
    assert sum(rebuild.new_bucket_bytes) == sum(rebuild.old_bucket_bytes)


def test_ddp_finding_unused_parameters_sends_nothing(agent, gloo_group):
    model = ddp_model(find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    ddp_train(model, opt, 2)
    assert ddp_rebuilds(agent) == []


def test_errors_inside_the_hooks_never_reach_training(sock_dir, monkeypatch):
    """After watch() returns, a failure in stepwatch's own code (here: every
    marker) is counted and logged at debug, and training runs as without it;
    only strict=True raises it."""
    monkeypatch.setenv("STEPWATCH_ENDPOINT", f"unix://{sock_dir}/none.sock")

    def run(with_watch, strict=False):
        model = small_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        h = stepwatch.watch(model, opt) if with_watch else None
        if h is not None:
            # strict=True as watch() would set it with an agent answering.
            monkeypatch.setattr(stepwatch._runtime.RT, "strict", strict)

            def broken(kind, step, micro):
                raise RuntimeError("a bug in stepwatch")

            monkeypatch.setattr(stepwatch._runtime.RT.tracker, "emit", broken)
        torch.manual_seed(1)
        try:
            train(model, opt, 3)
        finally:
            if h:
                h.remove()
        return [p.detach().clone() for p in model.parameters()]

    a, b = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert stepwatch.stats()["hook_errors"] >= 3
    stepwatch.reset()
    with pytest.raises(RuntimeError, match="a bug in stepwatch"):
        run(True, strict=True)


def _pretend_cuda(monkeypatch, device_memory):
    """Markers as on CUDA device 0, on this CPU-only torch: allocator figures and
    cudaMemGetInfo come from stubs (the real reads: test_on_fake_gpu.py)."""
    monkeypatch.setattr(stepwatch._torch, "model_cuda_device", lambda model: 0)
    monkeypatch.setattr(stepwatch._torch, "allocator_stats", lambda dev: None)
    monkeypatch.setattr(stepwatch._torch, "device_memory", device_memory)


def test_device_memory_goes_with_step_1s_markers_only(agent, monkeypatch):
    calls = []

    def device_memory(dev):
        calls.append(dev)
        return (1000 - len(calls), 1000)

    _pretend_cuda(monkeypatch, device_memory)
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepwatch.watch(model, opt)
    train(model, opt, 2)
    ms = agent.wait_markers(12)
    assert [m.HasField("device_memory") for m in ms] == [True] * 6 + [False] * 6
    assert [(m.device_memory.free_bytes, m.device_memory.total_bytes) for m in ms[:6]] == [
        (999 - i, 1000) for i in range(6)
    ]
    assert calls == [0] * 6  # no driver call after step 1


def test_a_failing_device_memory_read_warns_once_and_stops(agent, monkeypatch, caplog):
    calls = []

    def device_memory(dev):
        calls.append(dev)
        raise RuntimeError("no driver")

    _pretend_cuda(monkeypatch, device_memory)
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepwatch.watch(model, opt)
    with caplog.at_level("WARNING", logger="stepwatch"):
        train(model, opt, 1)
    ms = agent.wait_markers(6)
    assert not any(m.HasField("device_memory") for m in ms)
    assert calls == [0]
    warnings = [r for r in caplog.records if "mem_get_info" in r.getMessage()]
    assert len(warnings) == 1


def test_allocator_stats_off_sends_no_device_memory(agent, monkeypatch):
    _pretend_cuda(monkeypatch, lambda dev: pytest.fail("read with allocator_stats=False"))
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepwatch.watch(model, opt, allocator_stats=False)
    train(model, opt, 1)
    ms = agent.wait_markers(6)
    assert not any(m.HasField("device_memory") for m in ms)
