"""Recover from out-of-memory errors during training: one engine, two ways in.

:func:`retry_on_oom` decorates a step function; :class:`oom_guard` wraps the loop's iterable. Both
are thin front-ends over the engine (:mod:`._engine`), which runs a step on pieces of its batch.
The package is cut by concern: size decisions (:mod:`._sizes`, no torch), what an attempt
changed and how to undo it (:mod:`._attempt`), gradient accumulation (:mod:`._accumulate`),
joining results (:mod:`._results`), agreement between ranks (:mod:`._ranks`), the engine, and
the two front-ends (:mod:`._decorator`, :mod:`._guard`), which the engine never imports: it
reports to whoever listens (:class:`._engine._Observer`, the guard).

1. A step runs unchanged and unmeasured until its first out-of-memory error. The fast path
   (:class:`_Attempt`) costs a ``try``, the parameters' version counters, one fused copy of the
   module buffers known to change (BatchNorm statistics), and a context variable that the
   process-wide optimizer pre-step hook reads; the first call also watches which modules run.
2. On an OOM (:func:`autobatch.is_oom_error`) the engine keeps only the exception without its
   traceback, leaves the ``except`` block, calls :func:`autobatch.free_memory`, decides a smaller
   piece size (:meth:`_Sizes.after_oom`; under torch.distributed every rank takes the smallest
   any rank chose, see :class:`_Coordination`) and runs the batch again in pieces. It never
   retries inside the ``except`` block.
3. Piece sizes are remembered per decorated function and per :func:`~autobatch._batch.shape_key`
   (an eval step has its own sizes). A batch whose rows have another shape starts from the size
   predicted for its elements per sample, so a longer sequence costs at most one retry and a
   shorter one gets a larger piece.
4. Where the device keeps statistics (CUDA, ROCm, XPU, the simulated GPU), each piece's cost (its
   peak above what was allocated when it started, optimizer step excluded) is measured and
   :func:`autobatch.search.fit_linear` fits ``cost = fixed + per_element * elements``. After an
   OOM the next size is the largest whose predicted cost fits in the device's free bytes (so
   optimizer state created since, and other processes, count) less ``headroom``. Without a model
   yet, one small measuring piece (an eighth of the failed size) runs first and the rest of the
   batch uses the model it gives. Once a line is fitted, every piece is also capped by what fits
   in the memory free at that moment, so memory taken away later shrinks the pieces before it
   causes an OOM. Without statistics the size halves.

Policies (``policy=``):

* ``"accumulate"`` (default with ``optimizer=``): the pieces of one batch make exactly one step
  of each optimizer given (:class:`_Accumulation`). Each piece's gradients are weighted by its
  share of the batch (of its rows, of its items with ``items=``; ``reduction="sum"`` adds them),
  in place, and moved into private buffers at the end of each backward; at the end of the last
  piece's backward the buffers are added into ``.grad``. Code between ``backward()`` and
  ``optimizer.step()`` (clipping, logging) therefore sees no gradient in early pieces and the
  whole batch's gradient in the last one, for every parameter. ``optimizer.step()`` and the
  ``scaler=``'s ``unscale_``/``step``/``update`` do nothing in early pieces and run once in the
  last one, so GradScaler's inf check covers the whole batch once. The LR scheduler is not
  touched: call ``scheduler.step()`` outside the decorated step. Step functions must take one
  step per call and zero the gradients themselves; once memory has run short, autobatch sets the
  optimizers' gradients to ``None`` before each batch (and before it re-runs one), so that every
  piece is measured alike. Refused, with an :class:`~autobatch.AutobatchError`: closure-taking
  optimizers (LBFGS), an optimizer not given that steps in a piece, optimizers that interleave
  (a parameter gets a gradient after its optimizer stepped in the same piece), a parameter
  changed in place in an early piece (an EMA update), and steps that accumulate across calls.
* ``"shrink"`` (default without an optimizer, e.g. eval steps): each piece is its own call of the
  step, so a training step takes more, smaller optimizer steps: the effective batch size shrinks.

Returned values: when the batch ran whole, the step's own value. When it was split, pieces are
joined: ``None`` stays ``None``; floating scalars (0-d tensors, floats) are weighted by their share
of the batch (``"mean"``) or added (``"sum"``), integers are added, and 0-d tensors come back
detached; tensors whose dim 0 is the piece size are concatenated, lists as long as their piece are
joined; dicts, tuples and named tuples are joined item by item; equal values pass through. If the
pieces' results cannot be joined, the list of them is returned.

A failed attempt is undone where it can be and refused where it cannot (:meth:`_Engine.
_check_attempt`): module buffers are put back as they were (:meth:`_Attempt.rollback`); an OOM
before any optimizer step began and before any parameter changed is retried; one inside an
optimizer's first step, while it creates its state and before any parameter changed (Adam's
``exp_avg``, ``exp_avg_sq``), is retried after the half-made state is dropped. Any other failure
after a step began (seen by the step hook, since fused optimizers leave the version counters
alone) or after a parameter changed in place raises :class:`~autobatch.AutobatchError`: the
update may be partly applied, and autobatch neither retries it twice nor restores it (a copy of
every parameter and state per step would cost too much).
"""

from __future__ import annotations

from autobatch._recovery._decorator import RetryingStep, retry_on_oom
from autobatch._recovery._guard import oom_guard
from autobatch._recovery._options import RecoveryOptions
from autobatch._recovery._records import RecoveryStats, SizeChange

__all__ = [
    "RecoveryOptions",
    "RecoveryStats",
    "RetryingStep",
    "SizeChange",
    "oom_guard",
    "retry_on_oom",
]
