"""Front-end 2: the guard around the loop, :class:`oom_guard`."""

from __future__ import annotations

import contextvars
import dataclasses
import types
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from autobatch._batch import (
    batch_size,
    quick_rows,
    slice_batch,
)
from autobatch._errors import AutobatchError
from autobatch._oom import is_oom_error, oom_kind
from autobatch._recovery._engine import _OBSERVER, _Engine, _Observer
from autobatch._recovery._records import RecoveryStats, SizeChange, _Tally

T = TypeVar("T")


class oom_guard(Generic[T]):  # used like a function: `with oom_guard(loader) as guard`
    """Iterate a loader so that a step decorated with :func:`retry_on_oom` adapts to memory.

    Any iterable of batches works (a DataLoader, a list, a generator). Inside
    ``with oom_guard(loader) as guard: for batch in guard:`` the decorated step finds the guard on
    its own (a context variable); the guard follows the step that receives the very object it
    handed out (a step called with a copy, e.g. the batch moved to the GPU, still recovers by
    itself, from its learned size). Under ``"shrink"`` the guard hands out pieces of the loader's
    batches at the step's learned size, in order (pieces never span two batches; the rest of a
    batch that was being processed keeps coming at the new size). Under ``"accumulate"`` it hands
    out whole batches and the step splits them at its learned size from the start.

    An OOM that escapes the loop body (an undecorated step) is not swallowed: the guard raises
    :class:`~autobatch.AutobatchError` from it, saying to decorate the step. A loop body cannot be
    replayed, so there is nothing else to do.

    >>> import torch
    >>> with oom_guard([torch.ones(4, 2), torch.ones(2, 2)]) as guard:
    ...     sizes = [len(batch) for batch in guard]
    >>> sizes, guard.stats.samples
    ([4, 2], 6)

    Args:
        loader: the batches.
    """

    def __init__(self, loader: Iterable[T]) -> None:
        self._loader = loader
        self._token: contextvars.Token[_Observer | None] | None = None
        self._current: object = None
        self._engine: _Engine | None = None
        self._reporter: _Engine | None = None
        self._index = 0
        self._piece: int | None = None  # the largest piece of the latest batch, when re-chunked
        self._tally = _Tally()

    def __enter__(self) -> oom_guard[T]:
        if self._token is not None:
            raise RuntimeError("this oom_guard is already active; create a new one")
        self._token = _OBSERVER.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if self._token is not None:
            _OBSERVER.reset(self._token)
            self._token = None
        self._current = None
        if isinstance(exc, Exception) and not isinstance(exc, AutobatchError) and is_oom_error(exc):
            raise AutobatchError(
                f"out of memory ({oom_kind(exc)}) in the body of `with oom_guard(...)` at batch "
                f"{self._index}, outside a step decorated with @retry_on_oom. The guard cannot "
                "replay a loop body: put the step in a function and decorate it, e.g. "
                "@retry_on_oom(optimizer=opt) def train_step(batch): ..., then call "
                "train_step(batch) in the loop"
            ) from exc

    def __iter__(self) -> Iterator[T]:
        if self._token is None:
            raise RuntimeError(
                "iterate an oom_guard inside its with block: "
                "`with oom_guard(loader) as guard: for batch in guard: ...`"
            )
        counts = self._tally.counts
        for batch in self._loader:
            engine = self._engine
            self._piece = None
            if engine is None or not engine.sizes.states or engine.policy != "shrink":
                self._current = batch  # whole batches: the fast path
                counts["samples"] += quick_rows(batch)  # (handed out: counted while it is fresh)
                yield batch
                self._index += 1  # (the batches handed out: see stats)
                continue
            try:
                total = batch_size(batch)
            except (TypeError, ValueError):
                self._current = batch
                yield batch  # the step reports why it cannot split, if it has to
                self._batch_done(0)
                continue
            if total == 0:  # an empty batch is handed out as it is, as before any OOM
                self._current = batch
                yield batch
                self._batch_done(0)
                continue
            done = 0
            while done < total:
                n = engine.guard_piece(batch, done, total)
                piece = batch if n == total else slice_batch(batch, done, done + n)
                if n < total:
                    self._piece = max(n, self._piece or 0)
                self._current = piece
                yield piece
                done += n
            self._batch_done(total)

    def _batch_done(self, samples: int) -> None:
        self._index += 1
        self._tally.counts["samples"] += samples

    # The engine's events (the guard is its observer while active) ----------------------------

    def noticed(self, engine: _Engine, batch: object) -> None:
        """A step was called with ``batch``: the step that takes the guard's batches is found."""
        if self._engine is None and batch is self._current:
            self._engine = engine

    def oom(self, lost: int) -> None:
        """A step ran out of memory and redoes ``lost`` samples."""
        self._tally.counts.update(ooms=1, samples_recomputed=lost)

    def size_changed(self, engine: _Engine, change: SizeChange) -> None:
        """A step changed its piece size (recorded at the guard's batch index)."""
        self._reporter = engine
        self._tally.change(dataclasses.replace(change, step=self._index))

    @property
    def stats(self) -> RecoveryStats:
        """OOMs and size changes of the decorated steps run in this guard, batches and samples
        handed out, and the current micro-batch size of the step that takes the guard's batches."""
        engine = self._engine or self._reporter
        micro = None if engine is None else engine.tally.micro_batch_size
        return self._tally.snapshot(batches=self._index, micro_batch_size=self._piece or micro)

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"<oom_guard batches={s.batches} samples={s.samples} ooms={s.ooms} "
            f"micro_batch_size={s.micro_batch_size}>"
        )
