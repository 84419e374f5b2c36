"""Recover from out-of-memory errors during training: one engine, two ways in.

:func:`retry_on_oom` decorates a step function; :class:`oom_guard` wraps the loop's iterable. Both
are thin front-ends over the engine (:mod:`._engine`), which runs a step on pieces of its batch.
The package is cut by concern: size decisions (:mod:`._sizes`, no torch), the write ledger that
watches split steps (:mod:`._ledger`) and its rules (:mod:`._rules`), what an unwatched attempt
can tell cheaply (:mod:`._attempt`), gradient accumulation and the deferred steps
(:mod:`._accumulate`), joining results (:mod:`._results`), agreement between ranks
(:mod:`._ranks`), the engine, the two front-ends (:mod:`._decorator`, :mod:`._guard`), which
the engine never imports (it reports to whoever listens, :class:`._engine._Observer`), and
:func:`check_split <._check.check_split>`, which tells a user whether their step is exact
when split.

1. A step runs unchanged until its first out-of-memory error. Its first call runs under the
   ledger, to learn what it writes; after that the fast path (:class:`._attempt._Attempt`) costs a
   ``try``, a context variable the process-wide optimizer pre-hook reads, and a copy of the state
   the step is known to change before its optimizer step (BatchNorm statistics, metric states).
2. On an OOM (:func:`autobatch.is_oom_error`) the engine keeps only the exception without its
   traceback, leaves the ``except`` block, puts back what the attempt changed, calls
   :func:`autobatch.free_memory`, decides a smaller piece size (:meth:`._sizes._Sizes.after_oom`;
   under torch.distributed every rank takes the smallest any rank chose) and runs the batch
   again in pieces. It never retries inside the ``except`` block.
3. While a batch runs in pieces, every piece before the last runs under the ledger: every
   write to state that existed before the step is judged by the rule of its kind (allowed,
   backed up, or refused before it happens), and a failed piece, or a batch that starts over,
   is undone bit for bit (random streams included). What cannot be replayed exactly is refused
   with an :class:`~autobatch.AutobatchError` before any optimizer steps, and the state is left
   as it was before the call. The README lists what is kept exact, what is refused (the rule
   table) and what a split step cannot see.
4. Piece sizes are remembered per decorated function and per :func:`~autobatch._batch.shape_key`
   (an eval step has its own sizes). A batch whose rows have another shape starts from the size
   predicted for its elements per sample. Where the device keeps statistics, each piece's cost
   is measured and :func:`autobatch.search.fit_linear` fits ``cost = fixed + per_element *
   elements``; after an OOM the next size is the largest whose predicted cost fits in the free
   bytes less ``headroom``, and every piece is capped by what fits at that moment. Without
   statistics the size halves.

Policies (``policy=``): ``"accumulate"`` (default with ``optimizer=``): the pieces of one batch
make exactly one step of each optimizer given, with the whole batch's gradient
(:class:`._accumulate._Accumulation`); ``"shrink"`` (default without an optimizer, e.g. eval
steps): each piece is its own call of the step, so a training step takes more, smaller
optimizer steps.

Returned values: when the batch ran whole, the step's own value. When it was split, pieces are
joined: ``None`` stays ``None``; floating scalars (0-d tensors, floats) are weighted by their share
of the batch (``"mean"``) or added (``"sum"``), integers are added, and 0-d tensors come back
detached; tensors whose dim 0 is the piece size are concatenated, lists as long as their piece are
joined; dicts, tuples and named tuples are joined item by item; equal values pass through. If the
pieces' results cannot be joined, the list of them is returned.
"""

from __future__ import annotations

from autobatch._recovery._decorator import RetryingStep, retry_on_oom
from autobatch._recovery._embed import embed_in_pieces
from autobatch._recovery._guard import oom_guard
from autobatch._recovery._options import RecoveryOptions
from autobatch._recovery._records import RecoveryStats, SizeChange

__all__ = [
    "RecoveryOptions",
    "RecoveryStats",
    "RetryingStep",
    "SizeChange",
    "embed_in_pieces",
    "oom_guard",
    "retry_on_oom",
]
