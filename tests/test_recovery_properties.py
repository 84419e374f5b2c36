"""Properties of OOM recovery over random loaders and random OOM schedules.

The fake device raises a real ``torch.OutOfMemoryError`` when a call gets more rows than the
schedule allows at that moment; the CPU backend keeps no statistics, so sizes halve.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from autobatch._recovery import oom_guard, retry_on_oom

FAST = settings(max_examples=40, deadline=None)
#: every OOM collects garbage (free_memory): frozen, only what the tests made is walked
pytestmark = pytest.mark.usefixtures("frozen_heap")


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


def _make_batch(kind: str, ids: list[int]) -> Any:
    x = torch.tensor(ids, dtype=torch.float64)
    names = [f"s{i}" for i in ids]
    if kind == "tensor":
        return x
    if kind == "tuple":
        return (x, x.long() * 2)
    if kind == "dict":
        return {"x": x, "meta": {"names": names, "pair": (x[:, None], x.long())}, "epoch": 1}
    return [x, names]


def _ids_of(kind: str, batch: Any) -> list[int]:
    x = batch if kind == "tensor" else batch["x"] if kind == "dict" else batch[0]
    ids = [int(v) for v in x.tolist()]
    if kind == "dict":
        assert batch["meta"]["names"] == [f"s{i}" for i in ids]  # lists split with the tensors
        assert batch["meta"]["pair"][1].tolist() == ids
        assert batch["epoch"] == 1
    if kind == "list":
        assert batch[1] == [f"s{i}" for i in ids]
    if kind == "tuple":
        assert batch[1].tolist() == [2 * i for i in ids]
    return ids


def _loader(sizes: list[int], kind: str) -> list[Any]:
    batches, start = [], 0
    for n in sizes:
        batches.append(_make_batch(kind, list(range(start, start + n))))
        start += n
    return batches


loaders = st.tuples(
    st.lists(st.integers(1, 24), min_size=1, max_size=6),  # batch sizes, ragged ones included
    st.sampled_from(["tensor", "tuple", "dict", "list"]),
)
schedules = st.lists(st.integers(1, 30), min_size=1, max_size=12)  # rows allowed per attempt


@pytest.mark.slow
@FAST
@given(
    loader=loaders,
    schedule=schedules,
    grow_after=st.sampled_from([None, 1, 3]),
    guard=st.booleans(),
)
def test_shrink_processes_every_sample_once_in_order(
    loader: tuple[list[int], str], schedule: list[int], grow_after: int | None, guard: bool
) -> None:
    sizes, kind = loader
    attempts = [0]
    seen: list[int] = []

    @retry_on_oom(grow_after=grow_after)
    def step(batch: Any) -> None:
        allowed = schedule[attempts[0] % len(schedule)]
        attempts[0] += 1
        ids = _ids_of(kind, batch)
        if len(ids) > allowed:
            raise _oom()
        seen.extend(ids)

    batches = _loader(sizes, kind)
    if guard:
        with oom_guard(batches) as g:
            for batch in g:
                step(batch)
        assert g.stats.samples == sum(sizes)
        assert g.stats.batches == len(sizes)
    else:
        for batch in batches:
            step(batch)
    assert seen == list(range(sum(sizes)))


@pytest.mark.slow
@FAST
@given(
    loader=loaders,
    schedule=schedules,
    phases=st.lists(
        st.sampled_from(["forward", "backward", "accumulated"]), min_size=1, max_size=5
    ),
    reduction=st.sampled_from(["mean", "sum"]),
    guard=st.booleans(),
)
def test_accumulate_steps_every_batch_once_with_all_its_samples(
    loader: tuple[list[int], str],
    schedule: list[int],
    phases: list[str],
    reduction: str,
    guard: bool,
) -> None:
    """With ``loss = reduce(w * x)`` and SGD(lr=1), ``w`` moves by exactly ``-reduce(x)`` per batch:
    a lost, repeated or mis-weighted sample changes the result."""
    sizes, kind = loader
    w = nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = torch.optim.SGD([w], lr=1.0)
    steps = [0]
    opt.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    attempts = [0]
    fail_after_accumulation = [False]

    def late(_: torch.Tensor) -> None:  # runs after the piece's gradient reached w.grad
        if fail_after_accumulation[0]:
            fail_after_accumulation[0] = False
            raise _oom()

    w.register_post_accumulate_grad_hook(late)

    @retry_on_oom(optimizer=opt, reduction=reduction)  # type: ignore[arg-type]
    def step(batch: Any) -> torch.Tensor:
        allowed = schedule[attempts[0] % len(schedule)]
        phase = phases[attempts[0] % len(phases)]
        attempts[0] += 1
        x = torch.tensor(_ids_of(kind, batch), dtype=torch.float64)
        opt.zero_grad()
        terms = w * x
        loss = terms.mean() if reduction == "mean" else terms.sum()
        if len(x) > allowed:
            if phase == "forward":
                raise _oom()
            if phase == "backward":  # before anything reaches w.grad
                terms.register_hook(lambda g: (_ for _ in ()).throw(_oom()))
            else:
                fail_after_accumulation[0] = True
        loss.backward()
        opt.step()
        return loss.detach()

    batches = _loader(sizes, kind)
    expected = 0.0
    start = 0
    for n in sizes:
        ids = range(start, start + n)
        expected -= sum(ids) / (n if reduction == "mean" else 1)
        start += n
    if guard:
        with oom_guard(batches) as g:
            for batch in g:
                assert _ids_of(kind, batch)  # whole batches under "accumulate"
                step(batch)
        assert g.stats.batches == len(sizes)
    else:
        for batch in batches:
            step(batch)
    assert steps[0] == len(sizes)
    assert math.isclose(w.item(), expected, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.slow
@FAST
@given(
    batch=st.integers(2, 256),
    limit=st.integers(1, 256),
    grow_after=st.integers(1, 4),
    calls=st.integers(1, 80),
)
def test_ooms_are_bounded_and_grows_back_off(
    batch: int, limit: int, grow_after: int, calls: int
) -> None:
    """With a fixed limit: the first call needs at most log2(batch/limit) + 1 OOMs, later calls
    none except failed grows, which back off (at most log2(calls) + 1 of them)."""
    sizes: list[int] = []

    @retry_on_oom(grow_after=grow_after)
    def step(x: torch.Tensor) -> None:
        sizes.append(len(x))
        if len(x) > limit:
            raise _oom()

    x = torch.zeros(batch)
    step(x)
    first = step.stats.ooms
    assert first <= max(0, math.ceil(math.log2(batch / limit))) + 1
    for _ in range(calls):
        step(x)
    later = step.stats.ooms - first
    assert later == step.stats.failed_grows
    assert later <= math.log2(calls + 1) + 1
    assert all(c.new < c.old for c in step.stats.history if c.reason == "oom" and c.old)
