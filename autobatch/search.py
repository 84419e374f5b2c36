"""Searching for the batch size: the finder, its record, and the pure search engine under it.

:func:`search_batch_size` (and :func:`find_max_batch`) run real steps at the sizes the engine
chooses. The engine itself (:func:`search`, :func:`recommend`, the policies :class:`ModelGuided`,
:class:`Exponential` and :class:`Predicted`, the :class:`Trial` record, the
:class:`LinearModel` fitted to trials and :func:`predict_line` across sequence lengths) is pure
logic: it asks a ``probe(size) -> Trial`` and never touches torch, so it can search anything
whose cost grows with a size.

>>> from autobatch.search import Trial, search
>>> search(lambda n: Trial(n, fits=n <= 37)).largest_fit
37
"""

from __future__ import annotations

from autobatch._finder import find_max_batch, search_batch_size
from autobatch._result import SearchResult
from autobatch._search import (
    UNBOUNDED_MAX_SIZE,
    Exponential,
    LinearModel,
    ModelGuided,
    Predicted,
    SearchOutcome,
    SearchPolicy,
    SearchState,
    Trial,
    binding_points,
    extrapolate,
    fit_linear,
    predict_line,
    recommend,
    search,
    trusted_curve,
)

__all__ = [
    "UNBOUNDED_MAX_SIZE",
    "Exponential",
    "LinearModel",
    "ModelGuided",
    "Predicted",
    "SearchOutcome",
    "SearchPolicy",
    "SearchResult",
    "SearchState",
    "Trial",
    "binding_points",
    "extrapolate",
    "find_max_batch",
    "fit_linear",
    "predict_line",
    "recommend",
    "search",
    "search_batch_size",
    "trusted_curve",
]
