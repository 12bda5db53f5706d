from conftest import KIND, STEP, expected

from stepwatch._tracker import StepTracker


def make(gas=None):
    out = []
    t = StepTracker(lambda k, s, m: out.append((KIND[k], s, m)))
    t.grad_accumulation_steps = gas
    return t, out


def test_plain_steps_numbered_from_one():
    t, out = make()
    for _ in range(2):
        t.forward(), t.backward(), t.optimizer_begin(), t.optimizer_end()
    assert out == expected(2)


def test_gradient_accumulation_counts_micro_batches():
    t, out = make()
    for _ in range(3):
        t.forward(), t.backward()
    t.optimizer_begin(), t.optimizer_end()
    assert [o for o in out if o[0] in ("FORWARD_BEGIN", "BACKWARD_BEGIN")] == [
        ("FORWARD_BEGIN", 1, 0),
        ("BACKWARD_BEGIN", 1, 0),
        ("FORWARD_BEGIN", 1, 1),
        ("BACKWARD_BEGIN", 1, 1),
        ("FORWARD_BEGIN", 1, 2),
        ("BACKWARD_BEGIN", 1, 2),
    ]


def test_duplicates_and_out_of_order_reports_are_dropped():
    t, out = make()
    t.forward(), t.forward(), t.backward(), t.backward(), t.optimizer_begin()
    t.backward()  # after the optimizer: would break the agent's order
    t.optimizer_begin(), t.optimizer_end(), t.optimizer_end()
    assert [o[0] for o in out] == STEP


def test_skipped_optimizer_step_closes_step_when_accumulation_is_known():
    t, out = make(gas=1)
    t.forward(), t.backward()  # AMP skipped optimizer.step()
    t.forward()
    assert [o[:2] for o in out[-4:]] == [
        ("BACKWARD_BEGIN", 1),
        ("STEP_END", 1),
        ("STEP_BEGIN", 2),
        ("FORWARD_BEGIN", 2),
    ]


def test_manual_step_owns_the_boundary():
    t, out = make()
    t.begin_step(5, manual=True)
    t.forward(), t.backward(), t.optimizer_begin(), t.optimizer_end()
    assert out[-1][0] == "OPTIMIZER_END"
    t.end_step()
    assert out[-1] == ("STEP_END", 5, 0)
    t.begin_step(3, manual=True)  # backwards: never sent as such
    assert out[-1] == ("STEP_BEGIN", 6, 0)


def test_oom_abandons_step_and_next_forward_opens_next():
    t, out = make()
    t.forward()
    t.oom()
    t.forward()
    assert out == [
        ("STEP_BEGIN", 1, 0),
        ("FORWARD_BEGIN", 1, 0),
        ("OOM", 1, 0),
        ("STEP_BEGIN", 2, 0),
        ("FORWARD_BEGIN", 2, 0),
    ]
    # Between steps, outside a pass, an OOM is the next step's: the agent
    # refuses a marker of a step that ended.
    t.backward(), t.optimizer_begin(), t.optimizer_end()
    t.oom()
    t.forward()
    assert out[-3:] == [("OOM", 3, 0), ("STEP_BEGIN", 4, 0), ("FORWARD_BEGIN", 4, 0)]
    fresh, first = make()
    fresh.oom()  # before the first step: step 1's
    assert first == [("OOM", 1, 0)]
