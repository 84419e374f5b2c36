"""Losses that couple the batch's rows in the forms users write them, not only the textbook
ones: a mean over the rows a mask keeps, the hardest row picked by ``l[l.argmax()]``, a Gram
matrix summed over the rows through ``einsum`` or ``tensordot``, sorted rows weighted by rank.
Each is refused at the first split with the state unchanged; declared with ``items=`` (or as a
sum under ``reduction="sum"``), the masked mean splits exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autobatch import AutobatchError, retry_on_oom
from autobatch.testing import inject_oom

pytestmark = pytest.mark.usefixtures("float64")

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _per_row(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o, y, reduction="none")


DISGUISED: dict[str, tuple[Loss, str]] = {  # the loss, what the refusal names
    "a mean over the rows a mask keeps": (
        lambda o, y: _per_row(o, y)[y > 0].mean(), "a mask or an index"),
    "a cross-entropy over the rows a mask keeps": (
        lambda o, y: F.cross_entropy(o[y > 0], y[y > 0]), "mask"),
    "the hardest row, by argmax": (
        lambda o, y: (lambda per_row: per_row[per_row.argmax()])(_per_row(o, y)), "argmax"),
    "a Gram matrix through einsum": (
        lambda o, y: torch.einsum("bi,bj->ij", o, o).mean(), "sum over the batch's rows"),
    "a Gram matrix through tensordot": (
        lambda o, y: torch.tensordot(o, o, dims=([0], [0])).mean(), "sum over the batch's rows"),
    "sorted rows weighted by rank": (
        lambda o, y: (_per_row(o, y).sort().values * torch.linspace(0, 1, len(y))).mean(),
        "rank"),
}


def _make(loss: Loss, **options: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(batch: Any) -> None:
        opt.zero_grad()
        loss(model(batch[0]), batch[1]).backward()
        opt.step()

    return model, opt, step, retry_on_oom(optimizer=opt, **options)(step)


def _batch(call: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + call)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _split_matches_plain(loss: Loss, calls: int = 1, **options: Any) -> None:
    """The guarded step, its first calls split in two (a batch of 16 out of memory over 8
    rows), ends with the plain loop's parameters."""
    reference, _, plain, _ = _make(loss)
    model, _, _, step = _make(loss, **options)
    for call in range(calls):
        plain(_batch(call))
        with inject_oom(batch_over=8):
            step(_batch(call))
    assert step.stats.ooms == 1  # (later calls split from the start: the size is learned)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("at_call", [0, 2])
@pytest.mark.parametrize("name", list(DISGUISED))
def test_a_loss_coupling_rows_in_disguise_is_refused_with_the_state_unchanged(
    name: str, at_call: int
) -> None:
    loss, named = DISGUISED[name]
    model, opt, _, step = _make(loss)
    for call in range(at_call):
        step(_batch(call))
    before = _state(model, opt)
    with inject_oom(batch_over=8), pytest.raises(AutobatchError) as refused:
        step(_batch(at_call))
    assert named in str(refused.value)
    assert "test_coupling_in_disguise.py" in str(refused.value)  # the user's line
    after = _state(model, opt)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("form", ["items=", "reduction='sum'"])
def test_the_masked_mean_declared_splits_exactly(form: str) -> None:
    if form == "items=":
        loss: Loss = DISGUISED["a mean over the rows a mask keeps"][0]
        options: dict[str, Any] = {"items": lambda batch: (batch[1] > 0).sum()}
    else:
        def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return _per_row(o, y)[y > 0].sum()
        options = {"reduction": "sum"}
    _split_matches_plain(loss, calls=3, **options)


def test_sorted_rows_averaged_alike_still_split_exactly() -> None:
    """A sort alone is a permutation of the rows: their mean is the batch's."""
    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _per_row(o, y).sort().values.mean() * torch.ones(()).squeeze()

    _split_matches_plain(loss)


def _ranked(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rank = torch.linspace(0, 1, len(y))
    return torch.einsum("b,b->", _per_row(o, y).sort().values, rank) / len(y)


MORE: dict[str, tuple[Loss, dict[str, Any], str]] = {  # loss, options, what the refusal names
    "the hardest row, by a sort": (
        lambda o, y: _per_row(o, y).sort(descending=True).values[0], {}, "some of the batch"),
    "the hardest row, by argsort": (
        lambda o, y: (lambda r: r[r.argsort()[-1]])(_per_row(o, y)), {}, "some of the batch"),
    "the first row": (lambda o, y: _per_row(o, y)[0], {}, "some of the batch"),
    "two rows added": (
        lambda o, y: (_per_row(o, y)[0] + _per_row(o, y)[1]) / 2, {}, "some of the batch"),
    "a mean and the worst row": (
        lambda o, y: _per_row(o, y).mean() + 0.1 * _per_row(o, y).sort().values[-1], {},
        "one row"),
    "rows weighted by position": (
        lambda o, y: (_per_row(o, y) * torch.linspace(0, 1, len(y))).mean(), {}, "place"),
    "rows discounted by position": (
        lambda o, y: (_per_row(o, y) * 0.9 ** torch.arange(len(y))).sum() / len(y), {},
        "place"),
    "rank weights through einsum": (_ranked, {}, "place"),
    "the first twelve rows": (
        lambda o, y: F.cross_entropy(o[:12], y[:12]), {}, "a slice"),
    "a masked mean squared, items=": (
        lambda o, y: _per_row(o, y)[y > 0].mean() ** 2,
        {"items": lambda b: (b[1] > 0).sum()}, "pow"),
    "two masked means, items=": (
        lambda o, y: _per_row(o, y)[y > 1].mean() + _per_row(o, y)[y <= 1].mean(),
        {"items": lambda b: (b[1] > 1).sum()}, "different picks"),
    "a capped loss, items=": (
        lambda o, y: F.cross_entropy(o, y).clamp(max=1.2), {"items": lambda b: len(b[1])},
        "clamp"),
}


@pytest.mark.parametrize("name", list(MORE))
def test_more_disguised_couplings_are_refused_with_the_state_unchanged(name: str) -> None:
    loss, options, named = MORE[name]
    model, opt, _, step = _make(loss, **options)
    before = _state(model, opt)
    with inject_oom(batch_over=8), pytest.raises(AutobatchError) as refused:
        step(_batch(0))
    assert named in str(refused.value)
    after = _state(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _tokens(o: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token logits (rows x 2 tokens x classes), labels, and a mask of two tokens per row
    on even rows and one on odd rows."""
    logits = torch.stack([o, o.flip(1)], 1)
    labels = torch.stack([y, (y + 1) % 4], 1)
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[1::2, 1] = False
    return logits, labels, mask


EXACT: dict[str, tuple[Loss, dict[str, Any]]] = {
    "flattened tokens picked by a mask (transformers' active_loss), items=": (
        lambda o, y: (lambda lg, lb, m: F.cross_entropy(lg.view(-1, 4)[m.view(-1)],
                                                        lb.view(-1)[m.view(-1)]))(*_tokens(o, y)),
        {"items": lambda b: 2 * len(b[1]) - len(b[1][1::2])}),
    "a masked mean, the same count on every row": (
        lambda o, y: (lambda lg, lb, m: F.cross_entropy(lg[m], lb[m]))(
            *_tokens(o, y)[:2], torch.ones(len(y), 2, dtype=torch.bool)), {}),
    "a sum by a float length": (lambda o, y: _per_row(o, y).sum() / float(len(y)), {}),
    "a sum by a tensor length": (lambda o, y: _per_row(o, y).sum() / torch.tensor(len(y)), {}),
    "a sum times the reciprocal length": (
        lambda o, y: _per_row(o, y).sum() * (1.0 / len(y)), {}),
    "a loop over every row": (
        lambda o, y: sum(_per_row(o, y)[i] for i in range(len(y))) / len(y), {}),  # type: ignore[misc]
}


@pytest.mark.parametrize("name", list(EXACT))
def test_per_row_forms_near_the_refused_ones_split_exactly(name: str) -> None:
    loss, options = EXACT[name]
    _split_matches_plain(loss, **options)


def _pretraining(o: torch.Tensor, y: torch.Tensor, padded: bool) -> torch.Tensor:
    """A token mean (masked-LM-like, padding ignored) plus a mean over rows (next-sentence-
    like), as BERT's pretraining head adds them."""
    logits, labels, _ = _tokens(o, y)
    if padded:
        labels = labels.clone()
        labels[1::2, 1] = -100
    return F.cross_entropy(logits.reshape(-1, 4), labels.reshape(-1)) + F.cross_entropy(o, y)


def _token_items(batch: Any) -> torch.Tensor:
    return torch.tensor(2 * len(batch[1]) - len(batch[1][1::2]))


def test_a_row_mean_beside_a_token_mean_is_refused_under_items() -> None:
    """``items=`` weighs every micro-batch by its share of the tokens: the row mean beside the
    token mean would be weighed so too."""
    model, opt, _, step = _make(lambda o, y: _pretraining(o, y, padded=True),
                                items=_token_items)
    before = _state(model, opt)
    with inject_oom(batch_over=7), pytest.raises(AutobatchError, match="over the batch's rows"):
        step((torch.randn(14, 8), torch.randint(0, 4, (14,))))
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt), strict=True))


def test_a_row_mean_beside_a_token_mean_splits_where_the_shares_agree() -> None:
    """Without padding every micro-batch's share of the tokens is its share of the rows."""
    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _pretraining(o, y, padded=False)

    _split_matches_plain(loss, items=lambda b: 2 * len(b[1]))
