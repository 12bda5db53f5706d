"""Lightning and Hugging Face Trainer callbacks, against the fake agent."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import summary

import stepwatch

STEP = [
    "STEP_BEGIN",
    "FORWARD_BEGIN",
    "BACKWARD_BEGIN",
    "OPTIMIZER_BEGIN",
    "OPTIMIZER_END",
    "STEP_END",
]


def expected(steps, micro=1):
    out = []
    for s in range(1, steps + 1):
        out.append(("STEP_BEGIN", s, 0))
        for m in range(micro):
            out += [("FORWARD_BEGIN", s, m), ("BACKWARD_BEGIN", s, m)]
        out += [
            ("OPTIMIZER_BEGIN", s, micro - 1),
            ("OPTIMIZER_END", s, micro - 1),
            ("STEP_END", s, micro - 1),
        ]
    return out


def test_base_package_needs_no_frameworks():
    code = (
        "import sys, stepwatch; "
        "assert not {'torch','lightning','transformers'} & set(sys.modules), sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_callback(agent, tmp_path, accumulate):
    pytest.importorskip("lightning")
    import lightning as L
    import torch

    from stepwatch.lightning import StepwatchCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ds = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    steps = 3
    trainer = L.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[StepwatchCallback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(ds, batch_size=4))
    ms = agent.wait_markers(len(expected(steps, accumulate)))
    assert summary(ms) == expected(steps, accumulate)
    h = agent.streams[0].hello
    assert h.framework == "lightning" and h.model.optimizer == 1
    assert h.model.grad_accumulation_steps == accumulate


@pytest.mark.parametrize("accumulate", [1, 2])
def test_transformers_callback(agent, tmp_path, accumulate):
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
            loss = torch.nn.functional.mse_loss(out, labels)
            return {"loss": loss, "logits": out}

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(4, generator=g), "labels": torch.randn(1, generator=g)}

    steps = 3
    args = TrainingArguments(
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
    trainer = Trainer(model=Tiny(), args=args, train_dataset=DS(), callbacks=[StepwatchCallback()])
    trainer.train()
    ms = agent.wait_markers(len(expected(steps, accumulate)))
    assert summary(ms) == expected(steps, accumulate)
    h = agent.streams[0].hello
    assert h.framework == "transformers" and h.model.grad_accumulation_steps == accumulate
    stepwatch.flush(1)
