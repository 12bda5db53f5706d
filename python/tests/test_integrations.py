"""Lightning and Hugging Face Trainer callbacks, against the fake agent."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import FLUSH_S, expected, fit_tiny_lightning, summary, tiny_lightning_module

import stepwatch


def test_base_package_needs_no_frameworks():
    code = (
        "import sys, stepwatch; "
        "assert not {'torch','lightning','transformers'} & set(sys.modules), sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def passes(markers):
    """(kind, step) of the evaluation and checkpoint markers."""
    return [(k, s) for k, s, _ in summary(markers) if k.startswith(("EVAL", "CHECKPOINT"))]


def each_of(kinds, after):
    """Passes of ``kinds`` in this order after each of the steps ``after``."""
    return [(f"{k}_{edge}", s) for s in after for k in kinds for edge in ("BEGIN", "END")]


def forward_batches(markers):
    """(samples, shape) of each FORWARD_BEGIN's batch."""
    return [(m.batch.samples, list(m.batch.shape)) for m in markers if m.kind == 2]


@pytest.mark.parametrize("step_hooks", [True, False], ids=["step-hooks", "no-step-hooks"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback(agent, tmp_path, monkeypatch, accumulate, step_hooks):
    """With the optimizer's step hooks, its post-step hook sends OPTIMIZER_END and
    STEP_END; without them (an optimizer that has none), on_train_batch_end does."""
    pytest.importorskip("lightning")
    import torch

    from stepwatch import _torch
    from stepwatch.lightning import StepwatchCallback

    installed = []
    real_install = _torch.install_optimizer_hooks

    def install(rt, opt, **kw):
        handles = real_install(rt, opt, **kw) if step_hooks else []
        installed.extend(handles)
        return handles

    monkeypatch.setattr(_torch, "install_optimizer_hooks", install)
    sources = []
    real_end_step = stepwatch._runtime.RT.tracker.end_step

    def end_step():
        import traceback

        sources.append(traceback.extract_stack(limit=2)[0].name)  # the caller
        real_end_step()

    monkeypatch.setattr(stepwatch._runtime.RT.tracker, "end_step", end_step)

    steps = 3
    fit_tiny_lightning(
        tmp_path, StepwatchCallback(), max_steps=steps, accumulate_grad_batches=accumulate
    )
    ms = agent.wait_markers(len(expected(steps, accumulate)))
    assert summary(ms) == expected(steps, accumulate)
    h = agent.streams[0].hello
    assert h.framework == "lightning" and h.model.optimizer == 1
    # PyTorch's version, not Lightning's: the agent's replay follows its allocator rules.
    assert h.torch_version == torch.__version__
    assert h.model.grad_accumulation_steps == accumulate
    assert h.model.micro_batch_size == 4  # the DataLoader's batch_size
    assert len(installed) == (1 if step_hooks else 0)
    # who closed each step (the last call is on_train_end's, a no-op then)
    assert sources[:steps] == ["optimizer_end" if step_hooks else "_end_of_batch"] * steps


def hf_trainer(tmp_path, steps, accumulate=1, **arguments):
    """A tiny HF Trainer on the CPU with stepwatch's callback: ``steps``
    optimizer steps of 4 samples times ``accumulate`` micro-batches, and
    ``arguments`` for its TrainingArguments (with an evaluation strategy, the
    training set is its evaluation set too). Returns ``make_trainer``; each
    call makes a fresh model."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    from transformers import Trainer, TrainingArguments

    from stepwatch.transformers import StepwatchCallback

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.lin(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 4 * steps * accumulate

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(4, generator=g), "labels": torch.randn(1, generator=g)}

    options = dict(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    args = TrainingArguments(**{**options, **arguments})
    callback = StepwatchCallback()

    def make_trainer():
        evaluated = DS() if "eval_strategy" in arguments else None
        return Trainer(
            model=Tiny(),
            args=args,
            train_dataset=DS(),
            eval_dataset=evaluated,
            callbacks=[callback],
        )

    return make_trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_transformers_callback(agent, tmp_path, accumulate):
    steps = 3
    hf_trainer(tmp_path, steps, accumulate)().train()
    ms = agent.wait_markers(len(expected(steps, accumulate)))
    assert summary(ms) == expected(steps, accumulate)
    h = agent.streams[0].hello
    assert h.framework == "transformers" and h.model.grad_accumulation_steps == accumulate
    assert h.torch_version == sys.modules["torch"].__version__
    assert h.model.micro_batch_size == 4  # per_device_train_batch_size
    assert stepwatch.flush(FLUSH_S)


def test_a_second_transformers_train_is_a_new_run_on_a_new_stream(agent, tmp_path):
    """``trainer.train()`` twice in one process (one callback): the first run's
    markers all go out on its stream, which the client ends; the second run
    says hello on a new stream with a new run id and its steps start at 1."""
    make_trainer = hf_trainer(tmp_path, 2)
    for _ in range(2):
        make_trainer().train()
    agent.wait_markers(2 * len(expected(2)))
    assert stepwatch.flush(FLUSH_S)
    with agent.lock:
        streams = list(agent.streams)
    assert len(streams) == 2, [summary(s.markers) for s in streams]
    first, second = streams
    assert first.ended, "the first run's stream was ended before the second's hello"
    assert first.hello.run_id and second.hello.run_id
    assert first.hello.run_id != second.hello.run_id
    assert summary(first.markers) == expected(2)
    assert summary(second.markers) == expected(2)
    assert stepwatch.stats()["runs"] == 1


def test_lightning_validation_and_checkpoints_are_passes(agent, tmp_path):
    """Validation loops during fit are evaluation passes (the sanity check
    before training is not marked), ModelCheckpoint's saves checkpoint saves,
    and each training batch's size goes with its forward."""
    pytest.importorskip("lightning")
    import lightning as L
    import torch

    from stepwatch.lightning import StepwatchCallback

    Tiny = tiny_lightning_module()

    def loader(n):
        ds = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.randn(n, 1))
        return torch.utils.data.DataLoader(ds, batch_size=4)

    trainer = L.Trainer(
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        callbacks=[
            StepwatchCallback(),
            L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), loader(16), loader(4))
    assert stepwatch.flush(FLUSH_S)
    ms = agent.wait_markers(4 * 6 + 2 * 4)
    # ModelCheckpoint(every_n_train_steps) saves at the end of the training
    # batch, before that step's validation.
    assert passes(ms) == each_of(["CHECKPOINT", "EVAL"], after=[2, 4]), summary(ms)
    assert forward_batches(ms) == [(4, [4, 4])] * 4


def test_transformers_evaluation_and_save_are_passes(agent, tmp_path):
    """The Trainer's evaluation every 2 steps is an evaluation pass (its
    forwards under no_grad seen by the model's hooks, ended by on_evaluate),
    and the save after it a checkpoint save (ended by on_save)."""
    hf_trainer(
        tmp_path,
        4,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
    )().train()
    assert stepwatch.flush(FLUSH_S)
    ms = agent.wait_markers(4 * 6 + 2 * 4)
    assert passes(ms) == each_of(["EVAL", "CHECKPOINT"], after=[2, 4]), summary(ms)
    assert forward_batches(ms) == [(4, [4, 4])] * 4
