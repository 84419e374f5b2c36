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

from autobatch import _search
from autobatch._records._result import SearchResult
from autobatch._search import *  # noqa: F403  # the engine is public here, as it is
from autobatch._sizing._finder import find_max_batch, search_batch_size

__all__ = ["SearchResult", "find_max_batch", "search_batch_size"]
__all__ += _search.__all__  # the engine, public here
