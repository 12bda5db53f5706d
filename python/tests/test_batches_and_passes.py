"""Batch facts on the markers, evaluation passes and checkpoint saves: what the
client sends (in-process fake agent) and what the real agent makes of it."""

from __future__ import annotations

import logging
import uuid

import pytest
from conftest import FLUSH_S, STEP, small_model, summary
from test_agent_integration import real_agent  # noqa: F401 (a fixture)

import stepwatch
from stepwatch._proto.stepwatch.v1 import ingest_pb2 as pb

torch = pytest.importorskip("torch")


class TinyLm(torch.nn.Module):
    """Token ids [batch, length] in, a scalar loss out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def lm_steps(model, opt, lengths, samples=4):
    for length in lengths:
        model(torch.randint(0, 100, (samples, length))).backward()
        opt.step()
        opt.zero_grad()


def batches(markers):
    """(kind, step, samples, tokens, shape) of the markers that carry a batch."""
    return [
        (
            pb.MarkerKind.Name(m.kind),
            m.step,
            m.batch.samples if m.batch.HasField("samples") else None,
            m.batch.tokens if m.batch.HasField("tokens") else None,
            list(m.batch.shape),
        )
        for m in markers
        if m.HasField("batch")
    ]


# ----------------------------------------------------------------- batches
def test_each_forward_carries_its_batch_read_from_token_ids(agent):
    model = TinyLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    lm_steps(model, opt, [8, 32, 16])
    ms = agent.wait_markers(18)
    assert batches(ms) == [
        ("FORWARD_BEGIN", 1, 4, 32, [4, 8]),
        ("FORWARD_BEGIN", 2, 4, 128, [4, 32]),
        ("FORWARD_BEGIN", 3, 4, 64, [4, 16]),
    ]


def test_micro_batches_each_carry_theirs(agent):
    model = TinyLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt, grad_accumulation_steps=2)
    for length in (8, 24):
        model(torch.randint(0, 100, (2, length))).backward()
    opt.step()
    ms = agent.wait_markers(8)
    assert [(b[0], b[3]) for b in batches(ms)] == [("FORWARD_BEGIN", 16), ("FORWARD_BEGIN", 48)]


def test_images_and_features_give_samples_and_shape_no_tokens(agent):
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(1))
    conv(torch.randn(1, 3, 8, 8))  # materialise the lazy layer
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    stepwatch.watch(conv, opt)
    conv(torch.randn(5, 3, 8, 8)).sum().backward()
    opt.step()
    ms = agent.wait_markers(6)
    assert batches(ms) == [("FORWARD_BEGIN", 1, 5, None, [5, 3, 8, 8])]


def test_hugging_face_style_keyword_inputs_use_input_ids(agent):
    class KwModel(TinyLm):
        def forward(self, attention_mask=None, input_ids=None, labels=None):  # noqa: ARG002
            return super().forward(input_ids)

    model = KwModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    ids = torch.randint(0, 100, (3, 7))
    model(attention_mask=torch.ones(3, 9), input_ids=ids, labels=ids).backward()
    opt.step()
    ms = agent.wait_markers(6)
    assert batches(ms) == [("FORWARD_BEGIN", 1, 3, 21, [3, 7])]


def test_stated_batches_replace_what_inputs_say(agent):
    model = TinyLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    for tokens in (100, 300):
        stepwatch.batch(samples=2, tokens=tokens)
        model(torch.randint(0, 100, (4, 8))).backward()
        opt.step()
        opt.zero_grad()
    ms = agent.wait_markers(12)
    assert batches(ms) == [
        ("STEP_BEGIN", 1, 2, 100, []),
        ("STEP_BEGIN", 2, 2, 300, []),
    ]


@pytest.mark.parametrize(
    "bad",
    [dict(), dict(samples=0), dict(tokens=True), dict(shape=[1] * 9), dict(samples="8")],
)
def test_a_wrong_stated_batch_is_left_out_with_a_warning(agent, caplog, bad):
    model = TinyLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch.batch(**bad)
    assert "stepwatch.batch() ignored" in caplog.text
    lm_steps(model, opt, [8])  # still read from the inputs
    ms = agent.wait_markers(6)
    assert batches(ms) == [("FORWARD_BEGIN", 1, 4, 32, [4, 8])]


def test_a_wrong_stated_batch_raises_when_strict(agent):
    stepwatch.configure(strict=True)
    with pytest.raises(ValueError, match="samples"):
        stepwatch.batch(samples=-1)


def test_largest_batch_goes_in_the_hello(agent):
    model = TinyLm()
    stepwatch.watch(model, largest_batch=dict(samples=4, tokens=4 * 512, shape=[4, 512]))
    stepwatch.flush(FLUSH_S)
    assert agent.wait_for(lambda: agent.streams and agent.streams[0].hello is not None)
    lb = agent.streams[0].hello.model.largest_batch
    assert (lb.samples, lb.tokens, list(lb.shape)) == (4, 2048, [4, 512])


def test_a_wrong_largest_batch_is_a_watch_error_not_a_crash(agent, caplog):
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        stepwatch.watch(TinyLm(), largest_batch=dict(samples=4, length=512))
    assert "unknown batch fields ['length']" in caplog.text
    assert stepwatch.stats()["watch_errors"] == 1


# ------------------------------------------------------------------ passes
def test_checkpoint_between_steps_and_after_an_evaluation(agent):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)

    def step():
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    with stepwatch.checkpoint():
        torch.save(model.state_dict(), "/dev/null")
    step()
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 8))
    model.train()
    with stepwatch.checkpoint():  # ends the evaluation pass first
        pass
    step()
    ms = agent.wait_markers(3 * 6 + 6)
    assert summary(ms) == (
        [(k, 1, 0) for k in STEP]
        + [("CHECKPOINT_BEGIN", 1, 0), ("CHECKPOINT_END", 1, 0)]
        + [(k, 2, 0) for k in STEP]
        + [("EVAL_BEGIN", 2, 0), ("EVAL_END", 2, 0)]
        + [("CHECKPOINT_BEGIN", 2, 0), ("CHECKPOINT_END", 2, 0)]
        + [(k, 3, 0) for k in STEP]
    )


def test_no_pass_inside_a_step(agent):
    """A no-grad forward inside a step (a target computed with the model) and a
    checkpoint() inside a manual step are part of the step: the agent refuses
    a pass while a step is open."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    with stepwatch.step():
        out = model(torch.randn(4, 8))
        with torch.no_grad():
            model(torch.randn(4, 8))
        with stepwatch.checkpoint():
            pass
        out.sum().backward()
        opt.step()
    ms = agent.wait_markers(6)
    assert summary(ms) == [(k, 1, 0) for k in STEP]


def test_an_evaluation_before_the_first_step_names_step_0(agent):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    with torch.no_grad():
        model(torch.randn(4, 8))
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    ms = agent.wait_markers(8)
    assert summary(ms)[:3] == [("EVAL_BEGIN", 0, 0), ("EVAL_END", 0, 0), ("STEP_BEGIN", 1, 0)]


def test_an_oom_in_an_evaluation_pass_ends_it(agent):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepwatch.watch(model, opt)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with stepwatch.evaluation():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    ms = agent.wait_markers(8)
    assert summary(ms)[6:] == [("EVAL_BEGIN", 1, 0), ("OOM", 1, 0)]


# --------------------------------------------------------- the real agent
def test_the_agent_keeps_each_steps_batch_and_takes_passes(real_agent):  # noqa: F811
    """The real agent accepts batches on every forward and passes between
    steps (a misplaced pass marker would be refused with its whole batch), and
    reports each step's batch and the loader's largest."""
    job = f"pytest-{uuid.uuid4().hex[:8]}"
    model = TinyLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = stepwatch.watch(model, opt, job_id=job, largest_batch=dict(samples=4, tokens=4 * 64))
    try:
        for i, length in enumerate([8, 8, 8, 64, 8, 16]):
            lm_steps(model, opt, [length])
            if i % 2 == 1:
                model.eval()
                with torch.no_grad():
                    model(torch.randint(0, 100, (8, 8)))
                model.train()
            if i == 3:
                with stepwatch.checkpoint():
                    torch.save(model.state_dict(), "/dev/null")
    finally:
        handle.remove()
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = real_agent.rank_report(job, 0, 6)
    st = stepwatch.stats()
    assert st["rejections"] == 0 and st["dropped"] == 0, (st, real_agent.log.read_text()[-3000:])
    assert [s["batch"] for s in report["steps"]] == [
        {"samples": 4, "tokens": 4 * n, "shape": [4, n]} for n in (8, 8, 8, 64, 8, 16)
    ]
    assert report["info"]["model"]["largest_batch"] == {"samples": 4, "tokens": 256}


def test_an_oom_between_steps_is_recorded_as_the_next_steps(real_agent):  # noqa: F811
    """An OOM after a step ended and outside a pass (the next batch moved to
    the device) is sent as the next step's: the real agent records it (a
    marker of the step that ended would be refused) and post-mortems it."""
    from stepwatch._runtime import RT

    job = f"pytest-{uuid.uuid4().hex[:8]}"
    model = TinyLm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = stepwatch.watch(model, opt, job_id=job)
    try:
        lm_steps(model, opt, [8, 8, 8])
        RT.report_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    finally:
        handle.remove()
    assert stepwatch.flush(FLUSH_S), stepwatch.stats()
    report = real_agent.rank_report(job, 0, 3)
    st = stepwatch.stats()
    assert st["rejections"] == 0, (st, real_agent.log.read_text()[-3000:])
    pm = report["post_mortem"]
    assert pm is not None and (pm["step"], pm["phase"]) == (4, None), report
    assert "in step 4 (before its first forward, between steps)" in pm["message"], pm
