"""One batch on the slow path: the loop over its pieces, as a small state object.

The engine (:mod:`._engine`) hands a batch here when it runs out of memory, on a step's first
call, and while memory is short. :class:`_BatchRun` runs it in pieces: each piece is one
attempt, watched by the ledger where it must be; a failed attempt is judged
(:func:`._rules.judge`), undone, and the next size chosen (:meth:`_BatchRun.recover`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from autobatch import _distributed
from autobatch._batch import Batch, elements_per_sample, shape_key, tensors
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._memory._backends import DeviceLike, DeviceMemory, free_memory, memory_for
from autobatch._memory._measure import PeakKeeping, _PhasePeaks
from autobatch._recovery._accumulate import _Accumulation, reset_scalers
from autobatch._recovery._arguments import (
    _count_items,
    bare_steps,
    batch_items,
    check_rows_elsewhere,
    describe_params,
    foreign_steps,
    piece_too_small,
    refuse_bare_steps,
    slice_rows,
    warn_batch_statistics,
    warn_tuples,
)
from autobatch._recovery._attempt import _Attempt, _Failure, _Known, kept_by
from autobatch._recovery._backups import ScalarsBegan, Slot, read_scalars
from autobatch._recovery._embed import chunked
from autobatch._recovery._inspect import engine_work
from autobatch._recovery._ledger import Ledger
from autobatch._recovery._options import Policy, RecoveryOptions
from autobatch._recovery._ranks import (
    _Coordination,
    _peer_error,
    _PeerFailed,
    _refuse_independent_shards,
)
from autobatch._recovery._records import _Tally
from autobatch._recovery._results import _combine, result_rows
from autobatch._recovery._rows import RowWatch
from autobatch._recovery._rules import Refusal, judge
from autobatch._recovery._sizes import _Sizes, _TooSmall
from autobatch._recovery._thrash import hint_fragmentation
from autobatch._units import format_bytes


class _Applied(AutobatchError):
    """An OOM after part of the step's update was applied: not retried, and not undone."""


class _Host(Protocol):
    """What a batch run needs of the engine that runs the step."""

    fn: Callable[..., Any]
    name: str
    options: RecoveryOptions
    policy: Policy
    optimizers: tuple[torch.optim.Optimizer, ...]
    optimized_ids: set[int]
    named: dict[str, nn.Module]
    known: _Known
    ledger: Ledger
    sizes: _Sizes
    scalars: list[Slot]
    embeds: bool
    tally: _Tally
    warned: set[str]
    steps_seen: list[str]

    def coordinated(self) -> _Coordination | None: ...

    def capture(self, exc: BaseException) -> _Failure | None: ...

    def size_changed(self, old: int | None, new: int, reason: str) -> None: ...

    def next_piece(
        self, key: Hashable, eps: int, remaining: int, memory: DeviceMemory,
        coord: _Coordination | None,
    ) -> int: ...

    def with_batch(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], piece: Batch
    ) -> tuple[tuple[Any, ...], dict[str, Any]]: ...

    def accumulation(self) -> _Accumulation: ...

    def named_modules_known(self) -> list[tuple[str, nn.Module]]: ...

    def lost(self, samples: int) -> None: ...

    def finished(self, batch: Batch, samples: int, stepped: bool) -> None: ...


def room(memory: DeviceMemory) -> int | None:
    """Bytes a piece may add: what is free on the device now (``None`` without statistics)."""
    if not memory.has_statistics:
        return None
    return memory.free_bytes()


def _segmented_room(memory: DeviceMemory, phases: _PhasePeaks) -> int | None:
    """Bytes a piece may add, as the piece that just ran measured them: under a caching
    allocator its live tensors run out where the segments do, at the capacity divided by the
    reserved bytes per allocated byte at its peak (as the finder's ``allocated_capacity``);
    the free bytes where the backend caches nothing (``None`` without statistics).

    A refinement from the free bytes alone overshot after the first OOM (the next piece ran
    out again in 4 of 17 and 7 of 13 first recoveries of ``bench_guard``'s MLP and transformer).
    """
    free = room(memory)
    if free is None or phases.reserved is None or not phases.peak:
        return free
    share = max(phases.reserved / phases.peak, 1.0)
    return max(min(free, int(memory.capacity_bytes() / share) - memory.allocated_bytes()), 0)


class _BatchRun:
    """One batch in pieces: how much is done, what each piece returned (and its weight),
    whether an optimizer of the step's own stepped, the accumulation session of a split
    step, and the attempt of a piece that runs whole."""

    def __init__(
        self, engine: _Host, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch,
        total: int, device: DeviceLike, *, learning: bool,
    ) -> None:
        self.engine = engine
        self.args, self.kwargs, self.batch, self.total = args, kwargs, batch, total
        self.key = shape_key(batch)
        self.eps = max(elements_per_sample(batch), 1)
        self.memory = PeakKeeping(memory_for(device))  # resets the user never sees
        self.coord = engine.coordinated()
        self.learning = learning  # the call is watched whole, to learn what it changes
        self.pieces: list[tuple[int, Any, float]] = []
        self.done = 0
        self.stepped = False  # an optimizer of the step's own stepped
        self.clean = True  # no OOM in this batch
        self.split = False
        self.opened = False  # the ledger holds this batch
        self.items: float | None = None  # the batch's items, where the loss averages them
        self.session: _Accumulation | None = None
        self.whole: _Attempt | None = None  # the attempt of a piece that runs whole
        self.rows: RowWatch | None = None  # the rows of the piece that runs, followed
        self.tags: WeakIdKeyDictionary | None = None  # the first piece's, where followed
        #: an early piece's loss divided by a count of the batch's content that it found the
        #: same for every row: every later piece (the last too) is followed to check its own
        self.counted = False
        self.counts: set[float] | None = None  # what a row counted there, in the first

    def run(self, failure: _Failure | None, attempt: _Attempt | None) -> Any:
        """All the pieces (``failure``: the whole batch ran out of memory on the fast path,
        in ``attempt``); what the step returned, combined."""
        engine = self.engine
        # the step's Python scalars as the call began: every piece starts from them
        began = attempt.scalars if attempt is not None and attempt.scalars is not None else (
            read_scalars(engine.scalars))
        self.scalars = ScalarsBegan(engine.fn, engine.scalars, began)
        try:
            if failure is not None:
                assert attempt is not None
                self.clean = False
                self.recover(failure, attempt, self.total, self.total)
            else:
                grown = engine.sizes.maybe_grow(self.key, self.eps, self.total, room(self.memory))
                if grown is not None:
                    engine.size_changed(*grown, "grow")
            while self.done < self.total:
                self._next(attempt)
            self.scalars.settle()
        except BaseException as error:
            # A refusal, an error of the step's own, a batch too large: nothing of the batch
            # is kept. (After an update that was partly applied, the state stays as it is.)
            if (self.split or isinstance(error, AutobatchError)) and not isinstance(
                error, _Applied
            ):
                self.scalars.put_back()  # (a refusal, or an error of a split: as before the call)
            if self.opened and not isinstance(error, _Applied):
                if self.session is not None:
                    self.session.restart()
                engine.ledger.undo_batch()
                engine.known.learn(engine.ledger.first_attempt_written())
            # (a scaler's unscale_ in the last piece, before the refusal, is forgotten too)
            reset_scalers(engine.fn, engine.optimizers, engine.options.scaler, self.session)
            if isinstance(error, Refusal):  # (it cannot run in pieces: the next runs whole)
                engine.sizes.forget(self.key)
            for tried in (attempt, self.whole):  # (the batch's whole attempt, unwatched or not)
                if tried is not None:
                    tried.explain(error)
            raise
        finally:
            if self.session is not None:
                self.session.close()
            if self.opened:
                engine.ledger.close()
            self.memory.restore_peak()
        engine.sizes.finish(self.key, self.clean)
        engine.finished(self.batch, self.total, self.stepped)
        engine.tally.micro_batch_size = (
            max(n for n, _, _ in self.pieces) if len(self.pieces) > 1 else None
        )
        return _combine(self.pieces, result_rows(engine, self.pieces[0][1], self.tags))

    def _may_vary(self, rows: RowWatch) -> bool:
        """Whether the count a micro-batch's mean divides by may differ from row to row in
        the batch's other micro-batches: a mask's sum may; a cross-entropy's may only where
        the batch holds its ``ignore_index`` somewhere (labels padded with -100), so that a
        batch of class labels is not followed piece by piece for nothing."""
        if rows.masked:
            return True
        with engine_work(), torch.no_grad():
            return any(
                bool((t == value).any())
                for t in tensors(self.batch) if not (t.is_floating_point() or t.is_complex())
                for value in rows.ignored
            )

    def _weight(self, piece: Batch, n: int) -> float:
        """A piece's share of the batch's loss: of its rows, or of its items (``items=``)."""
        options = self.engine.options
        if options.reduction == "sum":
            return 1.0
        if self.items is not None and self.items > 0:
            assert options.items is not None
            return _count_items(options.items(piece), self.engine.name) / self.items
        return n / self.total

    @contextlib.contextmanager
    def _watching(self, *, early: bool, last: bool, piece: Batch, n: int,
                  uneven: bool = False) -> Iterator[None]:
        """One watched attempt: the ledger's, kept in step with the other ranks. An early
        piece's rows are followed through its forward (:mod:`._rows`)."""
        engine, coord, session = self.engine, self.coord, self.session
        counted = self.counted and session is not None  # (the later pieces' counts, checked)
        records = early or self.learning
        tagging = not self.pieces and n < self.total and session is None  # (for the join)
        rows = RowWatch(tensors(piece), n, items=engine.options.items is not None,
                        reduction=engine.options.reduction, uneven=uneven) if (
            early or counted or tagging) else None
        if rows is not None:
            rows.expected = self.counts
        self.rows = rows
        known = engine.known
        shadow = [] if records else [
            *known.changing, *(tensors(piece) if known.writes_batch else ())
        ]
        split = session is not None
        if coord is None:
            with engine.ledger.attempt(
                early=early, split=split, records=records, shadow=shadow, rows=rows
            ):
                yield
            return
        with coord.attempt(last=last, session=session), engine.ledger.attempt(
            early=early, split=split, records=records, shadow=shadow, gate=coord.gate,
            on_forward=coord.forward, rows=rows,
        ):
            yield

    def _next(self, attempt: _Attempt | None) -> None:
        """Run the next piece; after an OOM, recover (a smaller size for the next)."""
        engine, coord, total, done = self.engine, self.coord, self.total, self.done
        self.scalars.put_back()  # (every piece starts from them: see ScalarsBegan)
        n = engine.next_piece(self.key, self.eps, total - done, self.memory, coord)
        chunk = None  # (a step that embeds in pieces: the whole batch, its encoder in chunks)
        if n < total and done == 0 and engine.embeds and engine.policy == "accumulate":
            chunk, n = n, total
        if n < total and not self.split:
            self.split = True
            refuse_bare_steps(engine)  # (one optimizer step per micro-batch, unasked)
            check_rows_elsewhere(engine, self.args, self.kwargs, total, first=False)
            warn_tuples(engine.name, self.batch, engine.warned)
            options = engine.options
            if options.items is not None and options.reduction == "mean":
                self.items = batch_items(options.items, self.batch, n, engine.name)
        last = done + n == total
        splits = n < total and engine.policy == "accumulate"  # pieces of one step
        watched = splits or self.learning or coord is not None or chunk is not None
        ledger = engine.ledger
        if watched and not self.opened:
            ledger.open(tensors(self.batch), split=splits, unwatched=kept_by(attempt))
            self.opened = True
        if n < total and self.session is None and engine.policy == "accumulate":
            self.session = engine.accumulation()
        session = self.session
        piece = self.batch if n == total else slice_rows(self.batch, done, done + n)
        weight = self._weight(piece, n)
        if session is not None:
            session.begin_piece(weight, last)
        args, kwargs = engine.with_batch(self.args, self.kwargs, piece)
        whole = self.whole = None if splits else _Attempt(engine, carry=coord is None)
        early = session is not None and not last
        memory = self.memory
        phases = _PhasePeaks(memory)  # peaks outside and inside optimizer.step
        baseline = 0
        if memory.has_statistics:
            memory.reset_peak()
            baseline = memory.allocated_bytes()
        failure = None
        try:
            with phases, whole if whole is not None else contextlib.nullcontext(), (
                self._watching(  # (a split batch's last piece writes once per batch: unwatched)
                    early=early, last=last or engine.policy == "shrink", piece=piece, n=n,
                    uneven=self.items is not None and abs(weight - n / total) > 1e-12,
                ) if watched else contextlib.nullcontext()
            ):
                with chunked(chunk) if chunk is not None else contextlib.nullcontext():
                    result = engine.fn(*args, **kwargs)
                if session is not None:  # (as part of the piece: other ranks hear of it)
                    session.agree()
        except BaseException as exc:
            failure = engine.capture(exc)
            if failure is None:
                if coord is not None:
                    coord.finish(_distributed.FAILED)
                piece_too_small(exc, engine, n, total)
                raise
        finally:
            if session is not None:
                session.end_piece()
        del args, kwargs, piece
        if n < total:
            warn_batch_statistics(engine.name, [
                *engine.named_modules_known(), *(("", m) for m in ledger.batchnorms)
            ], engine.warned)
        if coord is not None:
            codes = coord.finish(_distributed.OK if failure is None else _distributed.OOM)
            if max(codes) == _distributed.FAILED:
                raise _peer_error(codes, "in this step")
            if failure is None and max(codes) != _distributed.OK:
                failure = engine.capture(_PeerFailed(codes))
        if failure is None:
            if (whole is not None and whole.ours_stepped) or (watched and ledger.stepped):
                self.stepped = True
            if whole is not None and whole.stepped:
                bare_steps(engine, whole.stepped, in_piece=n < total)
                foreign_steps(engine, whole.stepped)
            if early:
                assert session is not None
                ledger.check_piece(session.params, session.unfolded)
            if self.rows is not None and self.rows.even_used and self._may_vary(self.rows):
                self.counted = True
                if self.counts is None:
                    self.counts = set(self.rows.counts)
            if watched:
                engine.known.learn(ledger.first_attempt_written())
                engine.known.host_rng = engine.known.host_rng or ledger.drew_host_rng()
                engine.known.add_params(ledger.adopted)
                ledger.adopted = []
            if memory.has_statistics and chunk is None:  # (its own memory: not the piece's)
                engine.sizes.record(self.key, self.eps, n, phases.outside - baseline)
            if not self.pieces and self.rows is not None:  # (how its results hold the rows)
                self.tags = self.rows.tags
                self.scalars.reads = self.rows.reads
            self.pieces.append((n, result, weight))
            self.scalars.piece_done(n, weight if self.engine.options.reduction == "mean" else (
                n / self.total))
            self.done += n
            refined = None if chunk is not None else engine.sizes.after_piece(
                self.key, self.eps, n, _segmented_room(memory, phases))
            if refined is not None:
                engine.size_changed(*refined, "refine")
            return
        self.clean = False
        lost = n
        dirty = session is not None and session.dirty
        if coord is not None:
            dirty = coord.any(dirty)  # one rank's sum is spoilt: every rank starts over
        if dirty:
            lost += self.done  # this piece's gradients reached the sum: the batch starts over
            self.pieces.clear()
            self.scalars.pieces.clear()  # (the pieces' numbers begin again too)
            self.done = 0
        self.recover(failure, whole, chunk or n, lost,
                     restart=dirty or (whole is not None and done == 0))

    def recover(
        self, failure: _Failure, whole: _Attempt | None, failed: int, lost: int, *,
        restart: bool = False,
    ) -> None:
        """After an OOM at ``failed`` rows: judge what the attempt did, undo it, clean up,
        free memory, and pick a smaller size. ``whole``: the record of a whole attempt; else
        a piece of the session; ``restart``: the batch starts over. ``lost`` samples are
        redone. Under a process group every rank takes the same size."""
        engine, coord, session, memory = self.engine, self.coord, self.session, self.memory
        ledger = engine.ledger
        engine.lost(lost)
        problem: AutobatchError | None = None
        try:
            if coord is None:  # (ranks that shard a model with FSDP2 are never independent)
                _refuse_independent_shards(engine.name, engine.known.modules, failure)
            seen = ledger.seen() if whole is None else whole.seen(functools.partial(
                describe_params, named=engine.named, modules=engine.known.modules))
            verdict = judge(engine.name, failure.kind, failure.inside, seen, engine.optimizers)
            if verdict is not None:
                if seen.carried and whole is not None:  # (no parameter changed: the rest,
                    whole.rollback()                    # a BatchNorm's statistics, goes back,
                    if ledger.is_open:                  # what a watched attempt wrote too)
                        ledger.undo_batch()
                elif whole is not None:
                    whole.rewind_rng()
                raise verdict from failure.exc
        except AutobatchError as error:
            applied = error if isinstance(error, _Applied) else _Applied(str(error))
            applied.__cause__ = error.__cause__
            if coord is None:
                raise applied from error.__cause__
            problem = applied  # raised once the other ranks know
        if problem is None:
            if whole is not None:  # a whole attempt: put back what it changed
                whole.rollback()
            if restart and ledger.is_open:  # (the batch starts over)
                if session is not None:
                    session.restart()
                ledger.undo_batch()
            elif ledger.is_open:  # (a piece: the earlier pieces' work stays)
                if session is not None and whole is None:
                    session.discard()
                ledger.undo_piece()
        reset_scalers(engine.fn, engine.optimizers, engine.options.scaler, session)
        hint_fragmentation(engine.name, failure.unallocated, failure.kind)
        free_memory(memory.device)  # the cache emptied too, before smaller pieces run
        self._smaller(failure, failed, problem)

    def _smaller(self, failure: _Failure, failed: int, problem: AutobatchError | None) -> None:
        """Choose the next size after an OOM at ``failed`` rows, agreed with the other ranks
        (``problem``: this rank cannot go on)."""
        engine, coord, memory = self.engine, self.coord, self.memory
        try:
            too_small = problem is not None
            if problem is None:
                try:
                    old, new, reason = engine.sizes.after_oom(
                        self.key, self.eps, failed, room(memory))
                except _TooSmall:
                    too_small = True
            if coord is not None:
                # One decision for every rank: -1 someone cannot go on, 0 too small, else the
                # smallest size any rank chose.
                agreed = coord.piece(-1 if problem else 0 if too_small else new, failed)
                if agreed < 0:
                    raise problem or AutobatchError(
                        f"{engine.name}: another rank cannot recover from this step's failure "
                        f"({failure.kind}); see that rank's error. Every rank stops here"
                    ) from failure.exc
                too_small = agreed == 0
                if not too_small and agreed != new:
                    engine.sizes.states[self.key].limit = new = agreed
            if too_small:
                raise _TooSmall
        except _TooSmall:
            needed: int | None = None
            found = engine.sizes.model(self.key)
            if found is not None:
                needed = memory.allocated_bytes() + int(found[0].predict(failed * self.eps))
            raise BatchSizeError(
                f"{engine.name} ran out of memory ({failure.kind}) at a micro-batch of {failed} "
                f"(min_batch={engine.options.min_batch}) on {memory.name}"
                + ("" if needed is None else f": it needs about {format_bytes(needed)}")
                + f" of {format_bytes(memory.capacity_bytes())}. Lower min_batch if allowed, "
                "free memory held elsewhere, or use a smaller model, a lower precision or "
                "activation checkpointing",
                batch_size=failed, needed_bytes=needed, capacity_bytes=memory.capacity_bytes(),
            ) from failure.exc
        engine.size_changed(old, new, reason)
