"""Joining the results of a batch's pieces into the batch's result."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from autobatch._recovery._row_ops import AGG, Tag

#: Where the first piece's rows went, as its rows' follower tagged its tensors (or ``None``).
Tags = Callable[[torch.Tensor], Tag | None]


class _CannotJoin(Exception):
    pass


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a step's result, in the order :func:`_join` meets them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaves(v)]
    return []


#: Where each tensor of a step's result held the rows, learned from a piece whose rows were
#: followed (a split's first, in the call that learns the step): for the later calls' joins.
_LEARNED: weakref.WeakKeyDictionary[Any, list[Tag | None]] = weakref.WeakKeyDictionary()


def result_rows(engine: Any, first: Any, tags: WeakIdKeyDictionary | None) -> Tags:
    """Where the rows of each tensor of the first piece's result ``first`` are: from
    ``tags``, the rows followed through that piece, else from what an earlier split of the
    same step learned (by position in the result)."""
    leaves = _leaves(first)
    if tags is not None:
        kinds = _LEARNED[engine] = [tags.get(t) for t in leaves]  # type: ignore[no-untyped-call]
    else:
        kinds = _LEARNED.get(engine, [])
        if len(kinds) != len(leaves):
            return lambda _: None
    table = {id(t): kind for t, kind in zip(leaves, kinds, strict=True)}
    return lambda t: table.get(id(t))


def _join(values: list[Any], sizes: list[int], weights: list[float], tags: Tags) -> Any:
    first = values[0]
    if all(v is None for v in values):
        return None
    if all(isinstance(v, torch.Tensor) for v in values):
        tag = tags(first)
        if tag is not None and tag.taint is not None:
            raise _CannotJoin  # (it mixes the rows, a max over them: each piece's, as it is)
        if tag is not None and tag.dim == AGG and tag.total:
            return sum((v.detach() for v in values[1:]), values[0].detach())  # (sums add up)
        if tag is not None and tag.dim > 0 and tag.inner == 1 and all(
            v.dim() > tag.dim and v.shape[tag.dim] == n for v, n in zip(values, sizes, strict=True)
        ):
            return torch.cat(values, tag.dim)  # (rows along another dimension: ``enc(x).T``)
        if all(v.dim() == 0 for v in values):
            if not first.is_floating_point():  # counts add up
                return sum((v.detach() for v in values[1:]), values[0].detach())
            terms = [v.detach() * w for v, w in zip(values, weights, strict=True) if w]
            if not terms:  # every piece weighs nothing (a batch without items): its mean
                terms = [v.detach() / len(values) for v in values]
            total = terms[0]
            for term in terms[1:]:
                total = total + term
            return total
        if all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, sizes, strict=True)):
            return torch.cat(values)
        raise _CannotJoin
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if all(isinstance(v, int) for v in values):
            return sum(values)
        return sum(w * v for v, w in zip(values, weights, strict=True) if w)
    if isinstance(first, Mapping) and all(
        isinstance(v, Mapping) and list(v) == list(first) for v in values
    ):
        joined = {k: _item([v[k] for v in values], sizes, weights, tags) for k in first}
        try:
            return cast(Any, type(first))(joined)
        except Exception:
            return joined
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) for v in values):
        if isinstance(first, list) and all(len(v) == n for v, n in zip(values, sizes, strict=True)):
            return [item for v in values for item in v]
        if all(len(v) == len(first) for v in values):
            items = [_item([v[i] for v in values], sizes, weights, tags)
                     for i in range(len(first))]
            if hasattr(first, "_make"):
                return first._make(items)
            return type(first)(items)
        raise _CannotJoin
    try:
        if all(bool(v == first) for v in values):
            return first
    except Exception:
        pass
    raise _CannotJoin


def _item(values: list[Any], sizes: list[int], weights: list[float], tags: Tags) -> Any:
    """One item of dicts or tuples joined, else the pieces' values of it."""
    try:
        return _join(values, sizes, weights, tags)
    except _CannotJoin:
        return values


def _combine(pieces: list[tuple[int, Any, float]], tags: Tags = lambda _: None) -> Any:
    """The pieces' results ``(rows, value, weight)`` joined into the batch's result: tensors
    with rows along their rows (where ``tags``, the first piece's rows followed, say where
    they are; else along dimension 0 where it is as long as the piece), a sum over the rows
    added, a mean weighed by each piece's share."""
    if len(pieces) == 1:
        return pieces[0][1]
    sizes = [n for n, _, _ in pieces]
    values = [v for _, v, _ in pieces]
    weights = [w for _, _, w in pieces]
    try:
        return _join(values, sizes, weights, tags)
    except _CannotJoin:
        return values
