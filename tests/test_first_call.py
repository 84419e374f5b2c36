"""Mistakes a later split would trip over are caught at the first call, with the fix named;
the statistics count every row a plain loop trains."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from autobatch import AutobatchError, oom_guard, retry_on_oom
from autobatch.testing import inject_oom


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_a_step_taking_the_model_first_is_told_batch_arg_at_the_first_call() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(model: nn.Module, batch: Any) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(AutobatchError, match=r"batch_arg='batch'") as told:
        step(model, _batch())
    assert "'model' is Sequential" in str(told.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    fixed = retry_on_oom(optimizer=opt, batch_arg="batch")(step.__wrapped__)
    fixed(model, _batch())  # (the fix the message names works)


def test_a_batch_that_cannot_be_cut_is_told_at_the_first_call() -> None:
    @retry_on_oom
    def evaluate(settings: dict[str, Any], inputs: torch.Tensor) -> torch.Tensor:
        return inputs * settings["scale"]

    with pytest.raises(AutobatchError, match=r"batch_arg='inputs'"):
        evaluate({"scale": 2.0}, torch.ones(8, 2))


def test_an_optimizer_given_but_not_the_one_stepped_is_warned_at_the_first_call() -> None:
    model = _model()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1)
    given = torch.optim.Adam(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=given)
    def step(batch: Any) -> None:
        stepped.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        stepped.step()

    with pytest.warns(UserWarning, match=r"stepped SGD.*given another optimizer \(Adam\)"):
        step(_batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(_batch())  # (said once)


def test_statistics_count_every_row_a_plain_loop_trains() -> None:
    """Ten 32-row calls are 320 rows (it said 32); after an OOM and three more calls, every
    row of every call (it said 160), for the decorator and the guard alike."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    rows = 0
    for call in range(10):
        step(_batch(32, call))
        rows += 32
    assert (step.stats.batches, step.stats.samples) == (10, rows)
    loader = [_batch(32, 100), _batch(32, 101), _batch(20, 102), _batch(32, 103)]
    with inject_oom(batch_over=16), oom_guard(loader) as guard:
        for batch in guard:
            step(batch)
            rows += len(batch[0])
    assert step.stats.ooms >= 1
    assert step.stats.samples == rows
    assert guard.stats.samples == 32 + 32 + 20 + 32


def test_inject_oom_fires_in_the_step_never_in_the_data_loader() -> None:
    """``phase="forward"`` fired in the loader's collation; the guard then said the step was
    not decorated. Now the OOM lands in the decorated step, which recovers."""
    from torch.utils.data import DataLoader, TensorDataset

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        opt.zero_grad()
        model(batch[0]).mean().backward()
        opt.step()

    loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8)
    with inject_oom(phase="forward") as injected, oom_guard(loader) as guard:
        for batch in guard:
            step(batch)
    assert injected.fired == 1
    assert (guard.stats.ooms, guard.stats.samples) == (1, 32)
