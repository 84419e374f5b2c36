"""The search engine: the exact largest size that fits, asked of a probe in few trials.

Pure logic, no torch: every front-end (``find_max_batch``, the OOM guard, the planner-seeded search)
wraps its workload in a ``probe(size) -> Trial`` and lets :func:`search` choose the sizes.

The engine keeps one bracket (largest size known to fit, smallest size known to fail) and asks a
policy object for the next size; the engine snaps that size onto the grid strictly inside the
bracket, so no policy can probe outside the grid, probe a size twice, or stop before the answer is
exact. Three policies ship: :class:`ModelGuided` (the default; it fits ``peak(n) = a + b*n`` to
the measured peaks and jumps to the predicted largest size), :class:`Exponential` (double, then
bisect; used whenever there are no memory statistics) and :class:`Predicted` (a predicted size
and its neighbour, e.g. at a sequence length whose line :func:`predict_line` drew from the
lengths measured before).
"""

from __future__ import annotations

from autobatch._search._length_lines import predict_line
from autobatch._search._loop import recommend, search
from autobatch._search._model import (
    UNBOUNDED_MAX_SIZE,
    LinearModel,
    Trial,
    Verdicts,
    binding_points,
    fit_linear,
    trusted_curve,
)
from autobatch._search._policies import (
    Exponential,
    ModelGuided,
    Predicted,
    SearchOutcome,
    SearchPolicy,
    SearchState,
    extrapolate,
)

__all__ = [
    "UNBOUNDED_MAX_SIZE",
    "Exponential",
    "LinearModel",
    "ModelGuided",
    "Predicted",
    "SearchOutcome",
    "SearchPolicy",
    "SearchState",
    "Trial",
    "Verdicts",
    "binding_points",
    "extrapolate",
    "fit_linear",
    "predict_line",
    "recommend",
    "search",
    "trusted_curve",
]
