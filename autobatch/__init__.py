"""autobatch: the largest batch that fits, and training that survives running out of memory.

:func:`find_max_batch` and :func:`search_batch_size` find the batch for one input shape;
:func:`search_batch_sizes` one for every sequence length (a :class:`LengthTable`, for
:class:`autobatch.data.MemoryAwareBatchSampler`); :func:`plan_max_batch` predicts without the
device; :func:`retry_on_oom` and :func:`oom_guard` keep training alive when memory runs out;
:func:`find_best_batch` times sizes, and :func:`plot` draws what a search or a timing found.
"""

from __future__ import annotations

from autobatch._batch import per_batch
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._memory._backends import free_memory
from autobatch._oom import is_oom_error, is_size_limit_error
from autobatch._records._plot import plot
from autobatch._records._result import LengthTable, SearchResult, ThroughputResult
from autobatch._recovery import RecoveryStats, embed_in_pieces, oom_guard, retry_on_oom
from autobatch._sizing._finder import find_max_batch, search_batch_size
from autobatch._sizing._per_length import search_batch_sizes
from autobatch._sizing._planner import Plan, PlanBreakdown, plan_max_batch
from autobatch._sizing._throughput import find_best_batch
from autobatch._version import __version__ as __version__

__all__ = [
    "AutobatchError",
    "BatchSizeError",
    "LengthTable",
    "Plan",
    "PlanBreakdown",
    "RecoveryStats",
    "SearchResult",
    "ThroughputResult",
    "embed_in_pieces",
    "find_best_batch",
    "find_max_batch",
    "free_memory",
    "is_oom_error",
    "is_size_limit_error",
    "oom_guard",
    "per_batch",
    "plan_max_batch",
    "plot",
    "retry_on_oom",
    "search_batch_size",
    "search_batch_sizes",
]
