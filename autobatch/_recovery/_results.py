"""Joining the results of a batch's pieces into the batch's result."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch


class _CannotJoin(Exception):
    pass


def _join(values: list[Any], sizes: list[int], weights: list[float]) -> Any:
    first = values[0]
    if all(v is None for v in values):
        return None
    if all(isinstance(v, torch.Tensor) for v in values):
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
        joined = {k: _join([v[k] for v in values], sizes, weights) for k in first}
        try:
            return cast(Any, type(first))(joined)
        except Exception:
            return joined
    if isinstance(first, (list, tuple)) and all(type(v) is type(first) for v in values):
        if isinstance(first, list) and all(len(v) == n for v, n in zip(values, sizes, strict=True)):
            return [item for v in values for item in v]
        if all(len(v) == len(first) for v in values):
            items = [_join([v[i] for v in values], sizes, weights) for i in range(len(first))]
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


def _combine(pieces: list[tuple[int, Any, float]]) -> Any:
    """The pieces' results ``(rows, value, weight)`` joined into the batch's result."""
    if len(pieces) == 1:
        return pieces[0][1]
    sizes = [n for n, _, _ in pieces]
    values = [v for _, v, _ in pieces]
    weights = [w for _, _, w in pieces]
    try:
        return _join(values, sizes, weights)
    except _CannotJoin:
        return values
