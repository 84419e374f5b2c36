"""``plan_max_batch``: the largest batch for a device you do not have, predicted without running.

The planner copies the model and the optimizer to the ``meta`` device (shapes and dtypes, no data;
the real parameters are never read or moved), runs there the same training step as
:func:`~autobatch.find_max_batch` on batches of any size, and counts every storage the step creates
with the simulated GPU's own byte accounting (:mod:`autobatch._memory._accounting`). A step on ``meta``
costs only the Python time of its operators, so the search engine (:func:`autobatch.search.search`)
can find the exact largest size whose planned peak fits the capacity in a handful of steps.
"""

from autobatch._sizing._planner._plan import plan_max_batch
from autobatch._sizing._planner._plans import Plan, PlanBreakdown

__all__ = ["Plan", "PlanBreakdown", "plan_max_batch"]
