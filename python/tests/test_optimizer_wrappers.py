"""watch() with the optimizers training scripts really pass it: wrappers
(accelerate, ZeroRedundancyOptimizer, Lightning), objects that are no
torch optimizer, several optimizers (a GAN), and internal failures, which
must never raise into training."""

from __future__ import annotations

import logging
import math

import pytest
from conftest import STEP, summary

import stepwatch

torch = pytest.importorskip("torch")


def mlp(width: int = 8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


class PlainSGD:
    """An optimizer written by hand: no torch.optim.Optimizer, no step hooks."""

    def __init__(self, params, lr: float = 0.1) -> None:
        self.params = list(params)
        self.lr = lr

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p -= self.lr * p.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


class _StepThrough:
    """Stands in for Lightning's strategy: LightningOptimizer.step() hands the
    wrapped optimizer to ``strategy.optimizer_step`` (the precision plugin
    then calls its ``step``), which needs a Trainer; this calls it directly."""

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        return optimizer.step(closure)


def _accelerate(model):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    accelerator = accelerate.Accelerator(cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    return model, opt


def _zero(model):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return model, ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
    )


def _lightning(model):
    pytest.importorskip("lightning", reason="lightning is not installed")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = LightningOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    opt._strategy = _StepThrough()
    return model, opt


def _plain(model):
    return model, PlainSGD(model.parameters())


WRAPPERS = {
    "accelerate": _accelerate,
    "zero_redundancy": _zero,
    "lightning": _lightning,
    "plain_object": _plain,
}


@pytest.fixture
def reset_accelerate():
    yield
    try:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    except Exception:
        pass


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_watch_sees_through_every_optimizer_wrapper(
    agent, gloo_group, reset_accelerate, wrapper, caplog
):
    """Each wrapper the corpus's loops use: watch() raises nothing (before,
    accelerate's and Lightning's raised AttributeError from
    register_step_pre_hook) and every step's six markers reach the agent."""
    model, opt = WRAPPERS[wrapper](mlp())
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        handle = stepwatch.watch(model, opt, job_id=f"wrap-{wrapper}")
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ms = agent.wait_markers(18)
    assert summary(ms) == [(k, s, 0) for s in (1, 2, 3) for k in STEP]
    st = stepwatch.stats()
    assert st["watch_errors"] == 0 and st["hook_errors"] == 0, st
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if wrapper == "plain_object":
        # Degraded: its step() is watched, with one warning saying so.
        assert len(warnings) == 1 and "PlainSGD is not a torch.optim.Optimizer" in warnings[0]
    else:
        assert warnings == []
        # The facts are the wrapped AdamW's: 8 bytes of state per fp32 parameter.
        facts = agent.streams[0].hello.model
        assert (facts.optimizer, facts.state_bytes_per_parameter) == (1, 8), facts
    handle.remove()
    assert "step" not in getattr(opt, "__dict__", {})


def test_an_object_that_is_no_optimizer_and_has_no_step_still_watches(agent, caplog):
    model = mlp()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch.watch(model, object())
    model(torch.randn(4, 8)).sum().backward()
    with stepwatch.phase("optimizer"):  # as the warning says
        pass
    ms = agent.wait_markers(6)
    assert summary(ms) == [(k, 1, 0) for k in STEP]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no step() to watch" in warnings[0], warnings


def test_an_internal_error_in_watch_is_logged_counted_and_the_rest_watches(
    agent, monkeypatch, caplog
):
    """watch() never raises into training: a part that fails is left out with
    one warning and counted; what could be set up still marks steps."""

    def broken(rt, model):
        raise RuntimeError("a bug in stepwatch")

    monkeypatch.setattr(stepwatch._torch, "install_module_hooks", broken)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        handle = stepwatch.watch(model, opt)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    ms = agent.wait_markers(8)
    # No forward/backward hooks: the optimizer's hooks still open and close steps.
    assert [k for k, _, _ in summary(ms)] == [
        "STEP_BEGIN",
        "OPTIMIZER_BEGIN",
        "OPTIMIZER_END",
        "STEP_END",
    ] * 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "could not hook the model (RuntimeError: a bug in stepwatch)" in warnings[0]
    # And, at step 1's end, the word that no prediction can come.
    assert "step 1 ended with no forward of the watched model" in warnings[1]
    assert "cannot predict step 2" in warnings[1]
    assert stepwatch.stats()["watch_errors"] == 1
    handle.remove()
    # strict=True: the error is raised, as strict asks.
    with pytest.raises(RuntimeError, match="a bug in stepwatch"):
        stepwatch.watch(model, opt, strict=True)


def test_a_bad_option_is_a_warning_not_an_exception(agent, caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch.watch(model, opt, precision="fp8-ish")
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    agent.wait_markers(6)
    assert any("unknown precision" in r.getMessage() for r in caplog.records)
    assert stepwatch.stats()["watch_errors"] == 1


# ---------------------------------------------------------------- GANs
class Gan(torch.nn.Module):
    """A generator and a discriminator; the loop calls each, never gan(...)."""

    def __init__(self, z: int = 8, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = torch.nn.Sequential(
            torch.nn.Linear(z, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
        )
        self.discriminator = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
        )


def gan_step(gan, opt_d, opt_g, z: int = 8, width: int = 16) -> None:
    """One GAN step as tutorials write it: the discriminator's pass and step,
    then the generator's; two backward passes."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    real = torch.randn(4, width)
    fake = gan.generator(torch.randn(4, z))
    opt_d.zero_grad()
    d_real = gan.discriminator(real)
    d_fake = gan.discriminator(fake.detach())
    loss_d = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    d_fake = gan.discriminator(fake)
    bce(d_fake, torch.ones_like(d_fake)).backward()
    opt_g.step()


def test_a_gan_step_is_one_step_with_one_optimizer_phase(agent):
    """watch(gan, [opt_d, opt_g]): each training step is one step for the
    agent: its first forward opens it (gan itself has no forward: its
    children are hooked), OPTIMIZER_BEGIN at the discriminator's step, the
    generator's pass inside the optimizer phase, OPTIMIZER_END and STEP_END
    after the generator's step. Before, the generator's forward split every
    step in two, the first with no OPTIMIZER_END, and the agent could
    predict nothing."""
    gan = Gan()
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-4)
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=2e-4)
    stepwatch.watch(gan, [opt_d, opt_g])
    for _ in range(3):
        gan_step(gan, opt_d, opt_g)
    ms = agent.wait_markers(18)
    assert summary(ms) == [(k, s, 0) for s in (1, 2, 3) for k in STEP]


def test_the_step_closes_when_each_optimizer_stepped_whatever_the_order(agent):
    gan = Gan()
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-4)
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=2e-4)
    stepwatch.watch(gan, [opt_g, opt_d])  # listed in the other order
    for _ in range(2):
        gan_step(gan, opt_d, opt_g)
    ms = agent.wait_markers(12)
    assert summary(ms) == [(k, s, 0) for s in (1, 2) for k in STEP]


def test_several_optimizers_send_the_sum_of_their_state(agent):
    """Model facts: the state both optimizers will hold (Adam 8 bytes per fp32
    parameter of the discriminator, SGD momentum 4 per generator parameter),
    per trained parameter, rounded up; the kind is OTHER for mixed kinds."""
    gan = Gan()
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-4)
    opt_g = torch.optim.SGD(gan.generator.parameters(), lr=0.1, momentum=0.9)
    stepwatch.watch(gan, [opt_d, opt_g])
    gan_step(gan, opt_d, opt_g)
    agent.wait_markers(6)
    facts = agent.streams[0].hello.model
    n_d = sum(p.numel() for p in gan.discriminator.parameters())
    n_g = sum(p.numel() for p in gan.generator.parameters())
    assert facts.parameter_count == n_d + n_g
    assert facts.state_bytes_per_parameter == math.ceil((8 * n_d + 4 * n_g) / (n_d + n_g))
    assert facts.optimizer == 4  # OTHER
    # One kind for both: that kind.
    from stepwatch._torch import model_facts

    both_adam = [torch.optim.Adam(m.parameters()) for m in (gan.discriminator, gan.generator)]
    f = model_facts(gan, both_adam)
    assert (f["optimizer"], f["state_bytes_per_parameter"]) == (1, 8)


def test_an_optimizer_that_never_steps_does_not_swallow_the_run(agent, caplog):
    """One of the watched optimizers never steps: after 64 optimizer steps in
    one step, one warning, and every optimizer step ends a step again."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idle = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    stepwatch.watch(model, [opt, idle])
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for _ in range(66):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    ms = agent.wait_markers(18)
    # Step 1 ran 64 iterations (their later forwards inside its optimizer phase).
    assert summary(ms)[:18] == [(k, s, 0) for s in (1, 2, 3) for k in STEP]
    assert sum("only 1 of the 2 watched optimizers" in r.getMessage() for r in caplog.records) == 1


def test_step_1_without_an_optimizer_step_says_no_prediction_can_come(agent, caplog):
    """A model-only watch() and a step closed by hand without an optimizer
    phase: the agent has nothing to predict step 2 from, and the log says so."""
    model = mlp()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch.watch(model)
        with stepwatch.step():
            model(torch.randn(4, 8)).sum().backward()
    agent.wait_markers(4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "watch() got no optimizer" in warnings[0]
    assert "step 1 ended with no optimizer step" in warnings[1]
    assert "cannot predict step 2's memory" in warnings[1]
