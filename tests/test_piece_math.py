"""The math of a split step beyond its writes: every micro-batch of a batch takes the same path
(a Python counter or a branch on a micro-batch's values refused before any optimizer step), a
bare decorator never steps an optimizer once per micro-batch in silence, and modules whose
statistics depend on how the batch is cut (BatchNorm, spectral norm) are named in the warning
and make ``check_split`` false."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from autobatch import AutobatchError, retry_on_oom
from autobatch.testing import check_split, inject_oom

pytestmark = pytest.mark.usefixtures("float64")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(call: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + call)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _sgd_step(model: nn.Module) -> tuple[torch.optim.Optimizer, Callable[[Any], None]]:
    """An SGD optimizer for ``model`` and a plain step that zeroes, backpropagates and steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()

    return opt, step


def _state(model: nn.Module) -> list[torch.Tensor | None]:
    return [t.detach().clone() for t in model.parameters()] + [
        None if p.grad is None else p.grad.clone() for p in model.parameters()
    ]


def _same(before: list[torch.Tensor | None], after: list[torch.Tensor | None]) -> bool:
    """Every value as before; a gradient may be ``None`` where the step's own
    ``zero_grad()`` dropped it (it would have been dropped unguarded, too)."""
    return all(
        (x is None and y is None) or (x is not None and y is None and i >= len(before) // 2)
        or (x is not None and y is not None and torch.equal(x, y))
        for i, (x, y) in enumerate(zip(before, after, strict=True))
    )


class _Counting:
    """Accumulates over two calls with a Python counter the step itself keeps (params off by
    4.4e-2 and 5.4e-1 when split: the micro-batches disagreed on whether to step)."""

    def __init__(self, calls: int) -> None:
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.3, momentum=0.9)
        self.calls = calls

    def step(self, batch: Any) -> None:
        self.calls += 1
        (_loss(self.model, batch) / 2).backward()
        if self.calls % 2 == 0:
            self.opt.step()
            self.opt.zero_grad()


@pytest.mark.parametrize("at_call", [0, 2])  # the first call split, or a later one
@pytest.mark.parametrize("start", [0, 1])  # which call the counter makes step
def test_a_step_counting_its_calls_on_self_is_split_exactly(at_call: int, start: int) -> None:
    """The counter is put back before each micro-batch (and after the failed attempt), so
    every micro-batch decides as the batch does: the batch's one step, exact. (It used to be
    refused: the micro-batches disagreed on whether to step.)"""
    truth, trainer = _Counting(start), _Counting(start)
    step = retry_on_oom(optimizer=trainer.opt)(trainer.step)
    for call in range(at_call + 3):
        truth.step(_data(call))
        if call == at_call:
            with inject_oom(batch_over=4):
                step(_data(call))
        else:
            step(_data(call))
    assert trainer.calls == truth.calls
    for a, b in zip(_state(truth.model), _state(trainer.model), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # (float32 sums' order)


def test_micro_batches_taking_different_branches_are_refused() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        opt.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        if bool(batch[1][0] == 0):  # (a branch on the micro-batch's own values)
            model(batch[0]).square().mean().backward()
        opt.step()

    x, y = _data(0)
    y[:4], y[4:] = 1, 0  # the first half takes one branch, the second the other
    before = _state(model)
    with inject_oom(batch_over=4), pytest.raises(AutobatchError, match="another path"):
        step((x, y))
    assert _same(before, _state(model))


def test_a_step_that_agrees_with_itself_is_split_as_before() -> None:
    """The check costs nothing where the pieces agree: an accumulation window decided by the
    call's arguments splits exactly."""
    truth_model, model = _model(), _model()
    for m, guarded in ((truth_model, False), (model, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9)

        def step(batch: Any, stepping: bool, m: nn.Module = m, opt: Any = opt) -> None:
            (_loss(m, batch) / 2).backward()
            if stepping:
                opt.step()
                opt.zero_grad()

        run = retry_on_oom(optimizer=opt)(step) if guarded else step
        for call in range(4):
            if guarded and call in (1, 2):
                with inject_oom(batch_over=4):
                    run(_data(call), call % 2 == 1)
            else:
                run(_data(call), call % 2 == 1)
    for p, q in zip(model.parameters(), truth_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


# A bare decorator ------------------------------------------------------------------------------


def test_a_bare_decorator_on_a_step_seen_stepping_is_refused_before_it_splits() -> None:
    """@retry_on_oom without optimizer= took one optimizer step per micro-batch (params off by
    0.45 after one batch), with nothing said."""
    model = _model()
    step = retry_on_oom(_sgd_step(model)[1])
    step(_data(0))
    before = _state(model)
    with inject_oom(batch_over=4), pytest.raises(
        AutobatchError, match=r"SGD\.step\(\).*retry_on_oom\(optimizer=opt\).*policy='shrink'"
    ):
        step(_data(1))
    assert _same(before, _state(model))


def test_a_bare_decorator_stepping_first_in_a_micro_batch_is_warned_by_name() -> None:
    step = retry_on_oom(_sgd_step(_model())[1])
    with inject_oom(batch_over=4), pytest.warns(UserWarning, match=r"SGD\.step\(\) once per"):
        step(_data(0))


def test_an_explicit_shrink_policy_steps_once_per_micro_batch_without_a_word() -> None:
    step = retry_on_oom(_sgd_step(_model())[1], policy="shrink")
    step(_data(0))
    with warnings.catch_warnings(), inject_oom(batch_over=4):
        warnings.simplefilter("error")
        step(_data(1))
    assert step.stats.micro_batch_size == 4


# Statistics that depend on how the batch is cut --------------------------------------------------


def _normed(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "batchnorm":
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    wrap = (nn.utils.spectral_norm if kind == "spectral_norm"
            else nn.utils.parametrizations.spectral_norm)
    return nn.Sequential(wrap(nn.Linear(4, 8)), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("kind", ["batchnorm", "spectral_norm", "parametrized spectral_norm"])
def test_check_split_is_false_for_statistics_that_depend_on_the_cut_and_names_why(
    kind: str
) -> None:
    model = _normed(kind)
    opt, step = _sgd_step(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warning is the next test's)
        report = check_split(step, _data(0), optimizer=opt, model=model,
                             schedules=["forward"])
    assert not report
    assert report.caveats, str(report)
    assert ("BatchNorm1d model.1" if kind == "batchnorm" else "spectral norm of model.0.weight"
            ) in report.caveats[0]
    assert f"caveat: {report.caveats[0]}" in str(report)


@pytest.mark.parametrize("kind", ["batchnorm", "spectral_norm", "parametrized spectral_norm"])
def test_a_split_warns_of_each_module_whose_statistics_depend_on_the_cut_by_name(
    kind: str
) -> None:
    model = _normed(kind)
    opt, plain = _sgd_step(model)
    step = retry_on_oom(plain, optimizer=opt, model=model)
    name = "BatchNorm1d model.1" if kind == "batchnorm" else r"spectral norm of model\.0\.weight"
    with inject_oom(batch_over=4), pytest.warns(UserWarning, match=name):
        step(_data(0))
