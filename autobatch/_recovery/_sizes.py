"""Piece sizes after out-of-memory errors: pure bookkeeping, no torch."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from autobatch._search import LinearModel, fit_linear

#: The measuring piece after an OOM without a memory model is this fraction of the failed size.
PROBE_DIVISOR = 8
#: How many distinct piece sizes (per shape) the memory model remembers.
MAX_POINTS = 32
#: Distinct piece sizes needed before a line is fitted (two cannot tell a bent start).
MIN_FIT_SIZES = 3
#: Where the memory model was misled (segments), the pieces stop bisecting up once the gap to
#: the smallest size that failed is at most this fraction of the largest that ran.
MISLED_GAP = 8
#: A size refined from a rough model (fewer than MIN_FIT_SIZES sizes measured) is at most this
#: many times the piece it was measured on.
ROUGH_REACH = 4
#: How many batch shapes keep their own piece size (the least recently used is forgotten).
MAX_SHAPES = 256


@dataclass
class _KeyState:
    """What is known about one shape key."""

    eps: int  # elements per sample
    limit: int  # the piece size in use
    ceiling: int | None = None  # the smallest size that failed
    clean: int = 0  # calls without OOM since the last change
    wait: int = 0  # clean calls before the next grow attempt
    refine: bool = False  # the limit came from a rough model; raise it once a better one exists
    grow_from: int | None = None  # the last good size while a grow attempt is in flight
    grown_from: int | None = None  # the size before the latest grow, until the next change
    good: int = 0  # the largest piece that ran since the last OOM
    misled: bool = False  # a size the model said fits ran out of memory (segments, say)


class _TooSmall(Exception):
    """The smallest allowed size failed, or no piece of at least ``min_batch`` rows can fit."""


class _Sizes:
    """Piece sizes per shape key, the memory model, and the grow/back-off rules.

    Decisions, each pinned by tests: the size after an OOM is always smaller than the size that
    failed and at least ``min_batch``; it comes from the memory model when one exists and predicts
    a smaller size, else from a measuring piece (statistics) or halving (none). A grow doubles the
    size after ``wait`` clean calls (never past the batch, never past what the model allows); a
    failed grow returns to the last good size and doubles ``wait``. ``room`` is always the free
    bytes on the device (``None`` without statistics).
    """

    def __init__(self, *, min_batch: int, grow_after: int | None, headroom: float) -> None:
        self.min_batch = min_batch
        self.grow_after = grow_after
        self.headroom = headroom
        self.states: dict[Hashable, _KeyState] = {}
        # (shape key, elements in the piece) -> the largest cost measured (bytes above what was
        # allocated when the piece started); the least recently measured size goes first.
        self.points: dict[tuple[Hashable, int], int] = {}

    # The memory model -------------------------------------------------------------------------

    def model(self, key: Hashable) -> tuple[LinearModel, bool] | None:
        """The cost model (bytes a piece adds, by elements) for ``key``, and whether it was
        fitted.

        The key's own points are used when it has some, else every key's (in elements). With three
        or more sizes :func:`fit_linear` fits a line (and drops a first piece that also paid for
        creating the gradients, if it does not sit on the line); with fewer, the cost of the
        largest piece is taken as proportional to its size, which overestimates the slope.
        """
        own = [(x, cost) for (k, x), cost in self.points.items() if k == key]
        points = own or [(x, cost) for (_, x), cost in self.points.items()]
        if not points:
            return None
        if len({x for x, _ in points}) >= MIN_FIT_SIZES:
            fitted = fit_linear(points)
            if fitted is not None:
                return fitted, True
        elements, cost = max(points)
        # The whole cost taken as proportional to the piece: an overestimate of the slope.
        return LinearModel(0.0, cost / elements), False

    def model_size(self, key: Hashable, eps: int, room: int | None) -> tuple[int, bool] | None:
        """The largest piece whose predicted cost fits in ``room`` less headroom, and whether the
        model was fitted."""
        if room is None:
            return None
        found = self.model(key)
        if found is None:
            return None
        model, fitted = found
        elements = model.largest_within(room)
        return math.floor(elements / eps * (1 - self.headroom)), fitted

    def record(self, key: Hashable, eps: int, n: int, cost: int) -> None:
        """Remember a measured piece (a cost of 0 or less says nothing and is dropped)."""
        if cost <= 0:
            return
        point = (key, n * eps)
        cost = max(cost, self.points.pop(point, cost))  # re-inserted: the most recent
        self.points[point] = cost
        if len(self.points) > MAX_POINTS:
            del self.points[next(iter(self.points))]

    # Choosing sizes ---------------------------------------------------------------------------

    @property
    def pressure(self) -> bool:
        """Whether any OOM was seen (until then every batch runs whole)."""
        return bool(self.states)

    def limit_for(self, key: Hashable, eps: int, room: int | None) -> int | None:
        """The piece size for ``key``; ``None`` for whole batches.

        A learned limit is capped by what a fitted model says fits in the room now, so that
        memory taken since (optimizer state, another process) is respected before it fails.
        """
        state = self.states.get(key)
        if state is not None:
            self.states[key] = self.states.pop(key)  # the most recently used shape goes last
            found = self.model_size(key, eps, room)
            if found is not None and found[1] and state.grow_from is None:
                return max(min(state.limit, found[0]), self.min_batch)
            return state.limit
        if not self.states:
            return None
        found = self.model_size(key, eps, room)
        if found is not None:
            return max(found[0], self.min_batch)
        # No statistics: scale the other shapes' sizes by their elements per sample.
        return max(min(s.limit * s.eps // eps for s in self.states.values()), self.min_batch)

    def piece(self, key: Hashable, eps: int, remaining: int, room: int | None) -> int:
        """The next piece of ``remaining`` rows: balanced pieces of at most the limit, none
        below ``min_batch``.

        Where the limit leaves no way to cut ``remaining`` rows into pieces of at least
        ``min_batch`` (5 rows, a limit of 2, ``min_batch=2``), the pieces are the fewest of at
        least ``min_batch`` rows (3 and 2), tried even though they pass the limit; raises
        :class:`_TooSmall` when a piece that large already ran out of memory.
        """
        limit = self.limit_for(key, eps, room)
        if limit is None or limit >= remaining:
            return remaining
        count = -(-remaining // limit)
        if remaining // count < self.min_batch:
            count = max(remaining // self.min_batch, 1)
            n = -(-remaining // count)
            state = self.states.get(key)
            ceiling = None if state is None else state.ceiling
            if ceiling is not None and n >= ceiling:
                raise _TooSmall(n)
            return n
        return -(-remaining // count)

    # Learning ---------------------------------------------------------------------------------

    def after_oom(
        self, key: Hashable, eps: int, failed: int, room: int | None
    ) -> tuple[int | None, int, str]:
        """Decide the size after an OOM at ``failed`` rows: ``(old, new, reason)``.

        The one place where the new size is decided; a distributed agreement belongs here.
        Raises :class:`_TooSmall` when ``failed <= min_batch``.
        """
        if failed <= self.min_batch:
            raise _TooSmall
        state = self.states.get(key)
        old = None if state is None else state.limit
        if state is not None and state.grow_from is not None and failed > state.grow_from:
            new = state.grow_from
            state.grow_from = state.grown_from = None
            state.wait *= 2
            # (a smaller size that failed before still bounds: the grow found no more room)
            state.ceiling = failed if state.ceiling is None else min(state.ceiling, failed)
            state.clean = 0
            state.limit = new
            return old, new, "grow failed"
        found = self.model_size(key, eps, room)
        refine = False
        misled = False
        if found is not None and found[0] < failed:
            new, fitted = found
            refine = not fitted
        elif room is not None:
            if found is not None:  # the model said it fits: its points for this key are stale
                self.points = {p: c for p, c in self.points.items() if p[0] != key}
                misled = True
            new, refine = failed // PROBE_DIVISOR, True
            if misled and state is not None and 0 < state.good < failed:
                new = state.good  # (known to run; the next refinement bisects above it)
        else:
            new = failed // 2
        new = max(min(new, failed - 1), self.min_batch)
        if state is None:
            state = self.states[key] = _KeyState(eps=eps, limit=new, wait=self.grow_after or 0)
            while len(self.states) > MAX_SHAPES:  # variable shapes: forget the least recent
                del self.states[next(iter(self.states))]
        state.limit = new
        state.ceiling = failed if state.ceiling is None else min(state.ceiling, failed)
        state.refine = refine
        state.misled = state.misled or misled
        state.grow_from = state.grown_from = None
        state.clean = 0
        return old, new, "oom"

    def after_piece(
        self, key: Hashable, eps: int, n: int, room: int | None
    ) -> tuple[int, int] | None:
        """A piece of ``n`` rows succeeded: raise a rough limit to the model's; ``(old, new)``."""
        state = self.states.get(key)
        if state is None:
            return None
        state.good = max(state.good, n)
        if state.grow_from is not None and n > state.grow_from:
            state.grow_from = None  # the grow worked
            if state.ceiling is not None and n >= state.ceiling:
                state.ceiling = None
        if not state.refine:
            return None
        found = self.model_size(key, eps, room)
        if found is None:
            return None
        size, fitted = found
        state.refine = not fitted
        cap = math.inf if state.ceiling is None else state.ceiling - 1
        if not fitted:  # (one piece's bytes per row, and its segments' share, said little further)
            cap = min(cap, ROUGH_REACH * n)
        if state.misled and state.ceiling is not None:
            # Bytes did not tell where memory runs out (the allocator's segments): halve the
            # gap between the largest piece that ran and the smallest that failed instead,
            # while the gap is worth an OOM (more than an eighth of the piece that ran).
            cap = (state.good + state.ceiling) // 2
            state.refine = state.ceiling - state.good > max(1, state.good // MISLED_GAP)
            if not state.refine:
                return None
        new = int(min(max(size, state.limit), cap))
        if new <= state.limit:
            return None
        old, state.limit = state.limit, new
        return old, new

    def forget(self, key: Hashable) -> None:
        """The batch of ``key`` was refused in pieces: its next one runs whole again."""
        self.states.pop(key, None)

    def finish(self, key: Hashable, clean: bool) -> None:
        """A call ended; count clean calls towards the next grow."""
        state = self.states.get(key)
        if state is not None:
            state.clean = state.clean + 1 if clean else 0

    def maybe_grow(
        self, key: Hashable, eps: int, total: int, room: int | None
    ) -> tuple[int, int] | None:
        """Before a batch of ``total`` rows: try a larger piece if it is time; ``(old, new)``."""
        state = self.states.get(key)
        if (
            self.grow_after is None
            or state is None
            or state.grow_from is not None
            or state.limit >= total
            or state.clean < state.wait
        ):
            return None
        target = min(2 * state.limit, total)
        found = self.model_size(key, eps, room)
        if found is not None and found[1]:  # a rough model would never let it grow
            target = min(target, found[0])
        if target <= state.limit:
            state.clean = 0  # the model says there is no room: wait again
            return None
        state.grow_from, state.limit = state.limit, target
        state.grown_from = state.grow_from
        state.clean = 0
        return state.grow_from, target

    def after_thrashing(self, key: Hashable, eps: int, size: int) -> tuple[int | None, int] | None:
        """The allocator kept releasing its cache while pieces of ``size`` rows ran: a smaller
        size before it runs out, ``(old, new)``; ``None`` when already at ``min_batch``.

        Half the size, or, after a grow, the size before it: the grow fragmented memory like a
        failed one, so the wait before the next grow doubles and the thrashing size becomes the
        ceiling (no oscillation between the two).
        """
        state = self.states.get(key)
        current = size if state is None else min(state.limit, size)
        if current <= self.min_batch:
            return None
        old = None if state is None else state.limit
        if state is None:
            new = max(current // 2, self.min_batch)
            state = self.states[key] = _KeyState(eps=eps, limit=new, wait=self.grow_after or 0)
            while len(self.states) > MAX_SHAPES:
                del self.states[next(iter(self.states))]
        elif state.grown_from is not None and state.grown_from < current:
            new = state.grown_from
            state.wait *= 2
        else:
            new = max(current // 2, self.min_batch)
        state.limit = new
        state.ceiling = current if state.ceiling is None else min(state.ceiling, current)
        state.grown_from = state.grow_from = None
        state.refine = False
        state.clean = 0
        return old, new
