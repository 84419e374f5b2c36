"""The Python state a split step keeps, wherever it keeps it, ends as the unsplit step leaves it:
counters in module globals (``global step``), on a module (``model.global_step``), on an object
of the user's own, on the ``self`` of a method decorated in its class body; running totals of a
mean (``total += loss.item()``), of a mean times the rows, of a sum; a moving average of the
loss that weights the next call's loss. Python's and NumPy's random streams are put back with
torch's. A buffer assigned, or a parameter group added, in a micro-batch before the last is
refused with the state as before the call."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autobatch import AutobatchError, retry_on_oom
from autobatch.testing import inject_oom

pytestmark = pytest.mark.usefixtures("float64")

global_step = 0  # (a module global the step below assigns)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(call: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(90 + call)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)


def _close(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def _run(make: Any, calls: int = 4, split_at: tuple[int, ...] = (1, 2)) -> tuple[Any, Any]:
    """``make()`` -> (model, step, state reader): the plain loop, then the guarded one, whose
    calls in ``split_at`` run out of memory whole (and run in two micro-batches)."""
    plain_model, plain, read_plain = make()
    for call in range(calls):
        plain(_batch(call))
    plain_state = read_plain()
    model, step, read = make()
    guarded = retry_on_oom(optimizer=_OPTS[id(model)])(step)
    for call in range(calls):
        with inject_oom(batch_over=8) if call in split_at else contextlib.nullcontext():
            guarded(_batch(call))
    assert guarded.stats.ooms == 1  # (then split from the start: the size is learned)
    _close(model, plain_model)
    return plain_state, read()


_OPTS: dict[int, torch.optim.Optimizer] = {}


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    opt = _OPTS[id(model)] = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return opt


class _Counter:
    def __init__(self) -> None:
        self.n = 0


def _counting(where: str) -> Any:
    def make() -> tuple[nn.Module, Any, Any]:
        global global_step
        global_step = 0
        model, counter = _model(), _Counter()
        model.global_step = 0  # type: ignore[assignment]
        opt = _opt(model)

        def step(batch: Any) -> None:
            global global_step
            if where == "global":
                global_step += 1
                n = global_step
            elif where == "module":
                model.global_step += 1  # type: ignore[operator,assignment]
                n = model.global_step  # type: ignore[assignment]
            else:
                counter.n += 1
                n = counter.n
            warm = min(1.0, n / 4)  # (a warm-up weight: micro-batches must weigh alike)
            opt.zero_grad()
            (warm * F.cross_entropy(model(batch[0]), batch[1])).backward()
            opt.step()

        def read() -> int:
            return {"global": global_step, "module": model.global_step,
                    "object": counter.n}[where]  # type: ignore[return-value]

        return model, step, read
    return make


@pytest.mark.parametrize("where", ["global", "module", "object"])
def test_a_counter_kept_outside_the_closure_counts_each_call_once(where: str) -> None:
    plain, split = _run(_counting(where))
    assert plain == split == 4


def _totals(kind: str) -> Any:
    def make() -> tuple[nn.Module, Any, Any]:
        model = _model()
        opt = _opt(model)
        state = {"total": 0.0, "ema": 1.0}

        def step(batch: Any) -> None:
            x, y = batch
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            (loss / state["ema"]).backward()  # (the average weights the next call's loss)
            opt.step()
            if kind == "mean":
                state["total"] += loss.item()
            elif kind == "mean times rows":
                state["total"] += loss.item() * len(x)
            else:  # a count of the rows right: even where every piece counts the same
                state["total"] += int((out.argmax(1) == y).sum().item())
            state["ema"] = 0.9 * state["ema"] + 0.1 * loss.item()

        return model, step, lambda: dict(state)
    return make


@pytest.mark.parametrize("kind", ["mean", "mean times rows", "correct"])
def test_running_totals_and_a_moving_average_end_as_unsplit(kind: str) -> None:
    plain, split = _run(_totals(kind))
    assert split["total"] == pytest.approx(plain["total"], rel=1e-12)
    assert split["ema"] == pytest.approx(plain["ema"], rel=1e-12)


_OWN_OPT = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


class _Trainer:
    """A step decorated in its class body, with a counter on ``self``."""

    def __init__(self) -> None:
        self.net = _model()
        self.opt = _OWN_OPT
        self.opt.param_groups[0]["params"] = list(self.net.parameters())
        self.steps = 0

    def plain(self, batch: Any) -> None:
        warm = min(1.0, 0.25 + 0.25 * self.steps)
        self.steps += 1
        self.opt.zero_grad()
        (warm * F.cross_entropy(self.net(batch[0]), batch[1])).backward()
        self.opt.step()

    @retry_on_oom(optimizer=_OWN_OPT)
    def step(self, batch: Any) -> None:
        self.plain(batch)


def test_a_counter_on_the_self_of_a_method_decorated_in_its_class_body() -> None:
    reference = _Trainer()
    reference.opt = torch.optim.SGD(reference.net.parameters(), lr=0.1)
    guarded = _Trainer()
    for call in range(3):
        reference.plain(_batch(call))
        with inject_oom(batch_over=8):
            guarded.step(_batch(call))
    assert guarded.steps == reference.steps == 3
    _close(guarded.net, reference.net)


def test_python_and_numpy_random_streams_are_put_back_after_a_refusal() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shadow = torch.zeros(4)

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        opt.zero_grad()
        out = model(batch[0] * scale)
        shadow.mul_(0.9).add_(out.detach().mean(0))  # (refused in a micro-batch)
        F.cross_entropy(out, batch[1]).backward()
        opt.step()

    for call in range(2):  # (the first call learns that the step draws from them)
        step(_batch(call))
    states = random.getstate(), np.random.get_state()
    with inject_oom(batch_over=8), pytest.raises(AutobatchError, match="shadow"):
        step(_batch(2))
    assert random.getstate() == states[0]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), states[1],
                                                     strict=True))


def test_a_failed_whole_attempt_draws_again_from_python_s_stream() -> None:
    """The retry of a batch whose whole attempt ran out of memory after drawing starts from
    the stream as the call began (as torch's dropout does): its first micro-batch draws what
    the whole attempt drew."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    drawn: list[float] = []

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        drawn.append(random.random())
        opt.zero_grad()
        F.cross_entropy(model(batch[0] * (1 + 0.1 * drawn[-1])), batch[1]).backward()
        opt.step()

    step(_batch(0))  # (watched: the step draws from Python's stream)
    step(_batch(1))  # (the fast path)
    with inject_oom(phase="backward", batch_over=8):
        step(_batch(2))  # (whole, after drawing: out of memory; then two micro-batches)
    assert step.stats.ooms == 1
    assert len(drawn) == 5
    assert drawn[3] == drawn[2]


class _Tracked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.register_buffer("loss_ema", torch.ones(()))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + len(x)  # (assigned in its own forward: per micro-batch, allowed)
        return self.body(x)


@pytest.mark.parametrize("at_call", [0, 2])
def test_a_buffer_assigned_outside_its_forward_is_refused_with_the_state_unchanged(
    at_call: int,
) -> None:
    model = _Tracked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        (loss / model.loss_ema).backward()
        opt.step()
        model.loss_ema = 0.9 * model.loss_ema + 0.1 * loss.detach()

    for call in range(at_call):
        step(_batch(call))
    before = copy.deepcopy(model.state_dict())
    ema = model.loss_ema
    with inject_oom(batch_over=8), pytest.raises(AutobatchError, match="loss_ema"):
        step(_batch(at_call))
    assert model.loss_ema is ema
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_parameter_group_added_in_a_micro_batch_is_refused_with_the_state_unchanged() -> None:
    model = _model()
    head = nn.Linear(4, 4)
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    calls = [0]

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            opt.add_param_group({"params": [*model[2].parameters(), *head.parameters()]})
        opt.zero_grad()
        F.cross_entropy(head(model(batch[0])), batch[1]).backward()
        opt.step()

    step(_batch(0))
    with inject_oom(batch_over=8), pytest.raises(AutobatchError, match="parameter group"):
        step(_batch(1))
    assert len(opt.param_groups) == 1
    assert calls[0] == 1


def _read_and_count(kind: str) -> Any:
    def make() -> tuple[nn.Module, Any, Any]:
        model = _model()
        opt = _opt(model)
        state: dict[str, Any] = {"running": 0.0, "epoch": 0.0, "steps": 0, "positives": 0}

        def step(batch: Any) -> None:
            x, y = batch
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            state["running"] += loss.item()  # (a mean read: the rule must not spread)
            if kind == "epoch":
                state["epoch"] += len(x) / 64  # (a float that counts rows)
            else:  # a counter, beside a sum read that may be 1 in a micro-batch
                state["steps"] += 1
                state["positives"] += int((y == 3).sum().item() > 0)

        return model, step, lambda: dict(state)
    return make


@pytest.mark.parametrize("kind", ["epoch", "steps"])
def test_counters_beside_reads_of_the_loss_end_as_unsplit(kind: str) -> None:
    plain, split = _run(_read_and_count(kind))
    assert split["epoch"] == pytest.approx(plain["epoch"], rel=1e-12)
    assert split["steps"] == plain["steps"]
    assert split["running"] == pytest.approx(plain["running"], rel=1e-12)


def test_a_scheduler_given_ends_at_the_unsplit_learning_rate_beside_a_loss_read() -> None:
    def make() -> tuple[nn.Module, Any, Any]:
        model = _model()
        opt = _opt(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        _SCHEDULERS[id(model)] = sched
        total = [0.0]

        def step(batch: Any) -> None:
            opt.zero_grad()
            loss = F.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
            sched.step()
            total[0] += loss.item()

        return model, step, lambda: (opt.param_groups[0]["lr"], total[0])

    plain_model, plain, read_plain = make()
    for call in range(4):
        plain(_batch(call))
    model, step, read = make()
    guarded = retry_on_oom(optimizer=_OPTS[id(model)], scheduler=_SCHEDULERS[id(model)])(step)
    for call in range(4):
        with inject_oom(batch_over=8) if call == 1 else contextlib.nullcontext():
            guarded(_batch(call))
    assert read()[0] == pytest.approx(read_plain()[0], rel=1e-12)
    assert read()[1] == pytest.approx(read_plain()[1], rel=1e-12)
    _close(model, plain_model)


_SCHEDULERS: dict[int, Any] = {}


def test_a_frozen_config_the_step_reads_is_left_alone() -> None:
    @dataclasses.dataclass(frozen=True)
    class Config:
        smoothing: float = 0.1
        steps: int = 1000

    config = Config()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1], label_smoothing=config.smoothing)
        loss.backward()
        opt.step()
        return loss.item()

    step(_batch(0))
    with inject_oom(batch_over=8):
        step(_batch(1))
    assert step.stats.ooms == 1
    assert config == Config()


def test_the_numbers_of_a_batch_that_starts_over_count_its_last_pass_only() -> None:
    """An OOM in a later micro-batch's backward, after its gradient reached the sum, starts
    the batch over: what the abandoned pieces added is dropped with them."""
    def make() -> tuple[nn.Module, Any, Any]:
        model = _model()
        opt = _opt(model)
        state = {"running": 0.0, "calls": 0, "seen": 0}

        def step(batch: Any) -> None:
            x, y = batch
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            state["running"] += loss.item()
            state["calls"] += 1
            state["seen"] += len(x)

        return model, step, lambda: dict(state)

    plain_model, plain, read_plain = make()
    plain(_batch(0))
    model, step, read = make()
    guarded = retry_on_oom(optimizer=_OPTS[id(model)])(step)
    with inject_oom(batch_over=8), inject_oom(phase="backward", at_op=35) as late:
        guarded(_batch(0))
    assert late.fired == 1
    assert read()["seen"] == read_plain()["seen"] == 16
    assert read()["calls"] == 1
    assert read()["running"] == pytest.approx(read_plain()["running"], rel=1e-12)
    _close(model, plain_model)


@pytest.mark.slow
def test_a_compiled_forward_that_assigns_a_buffer_runs_decorated() -> None:
    """torch.compile traces the process-wide registration hook autobatch installs: it stands
    aside while compiling."""
    model = _Tracked()
    net = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        opt.zero_grad()
        F.cross_entropy(net(batch[0]), batch[1]).backward()
        opt.step()

    step(_batch(0))
    step(_batch(1))
    assert float(model.seen) == 32
