"""The recovery engine: runs a step on pieces of its batch, recovering from OOM."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol, cast

import torch
from torch import nn

from autobatch import _distributed
from autobatch._backends import DeviceLike, DeviceMemory, free_memory, memory_for
from autobatch._batch import (
    Batch,
    batch_size,
    describe,
    elements_per_sample,
    shape_key,
    tensors,
    uncollated,
)
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._log import get_logger, user_name
from autobatch._measure import PeakKeeping, _PhasePeaks
from autobatch._oom import is_oom_error, oom_kind
from autobatch._recovery._accumulate import _Accumulation, reset_scalers
from autobatch._recovery._arguments import (
    _batch_parameter,
    _count_items,
    _modules_of,
    describe_params,
    piece_too_small,
    slice_rows,
    warn_batchnorm,
    warn_tuples,
)
from autobatch._recovery._attempt import _ATTEMPT as _CURRENT_ATTEMPT
from autobatch._recovery._attempt import (
    _Attempt,
    _Failure,
    _Known,
    _optimizer_in_traceback,
    _strip_tracebacks,
    kept_by,
    structure_epoch,
    watch_structure,
)
from autobatch._recovery._ledger import Ledger, see_optimizer_steps
from autobatch._recovery._options import Policy, RecoveryOptions
from autobatch._recovery._ranks import (
    _Coordination,
    _peer_error,
    _PeerFailed,
    _refuse_independent_shards,
)
from autobatch._recovery._records import SizeChange, _Tally
from autobatch._recovery._results import _combine
from autobatch._recovery._rules import judge
from autobatch._recovery._sizes import _Sizes, _TooSmall
from autobatch._recovery._thrash import _Watch, hint_fragmentation
from autobatch._units import format_bytes

logger = get_logger("recovery")


class _Observer(Protocol):
    """Who hears of an engine's events (the guard around the loop)."""

    def noticed(self, engine: _Engine, batch: object) -> None: ...

    def oom(self, lost: int) -> None: ...

    def size_changed(self, engine: _Engine, change: SizeChange) -> None: ...


_OBSERVER: contextvars.ContextVar[_Observer | None] = contextvars.ContextVar(
    "autobatch_recovery_observer", default=None
)


class _Applied(AutobatchError):
    """An OOM after part of the step's update was applied: not retried, and not undone."""


class _Engine:
    """Runs one decorated step function; holds its learned sizes and statistics."""

    def __init__(self, fn: Callable[..., Any], options: RecoveryOptions) -> None:
        self.fn = fn
        self.options = options
        self.name = user_name(fn)
        self.policy: Policy = cast(Policy, options.policy)
        self.optimizers = options.optimizers
        self.schedulers = options.schedulers
        self.additive = options.additive_tensors
        self.index, self.keyword = _batch_parameter(fn, options.batch_arg)
        self.sizes = _Sizes(
            min_batch=options.min_batch, grow_after=options.grow_after, headroom=options.headroom
        )
        self.tally = _Tally()
        self.calls = 0
        self.warned: set[str] = set()
        self.coordination: _Coordination | None = None
        self._lone: tuple[int, bool] | None = None  # (modules known, a DDP module under one rank)
        self.named = _modules_of(fn)
        if options.model is not None:
            self.named = {"model": options.model, **self.named}
        self.known = _Known(self.named.values(), self.optimizers)
        self.optimized_ids = {  # the parameters the step's own optimizers update
            id(p) for o in self.optimizers for g in o.param_groups for p in g["params"]
        }
        self.ledger = Ledger(self)
        self._spare: _Attempt | None = None  # the fast path's attempt, when not in use
        self._current: Batch | None = None  # the batch of the call in progress, for the log
        # Gradients only (no optimizer given): the caller steps, and may accumulate over calls.
        self.keeps_gradients = self.policy == "accumulate" and not self.optimizers
        self.watch = _Watch()  # the caching allocator's retries, step by step
        self.learned = -1  # the structure epoch of the last watched call
        see_optimizer_steps()

    def coordinated(self) -> _Coordination | None:
        """The agreement with the other ranks, under a process group (unless ``sync_ranks=False``)."""
        if not self.options.sync_ranks:
            return None
        if not _distributed.active():  # (a DDP module under one rank: the same agreement)
            known = len(self.known.modules)
            if self._lone is None or self._lone[0] != known:
                self._lone = (known, _distributed.lone_replica(self.known.modules))
            if not self._lone[1]:
                return None
        if self.coordination is None:
            self.coordination = _Coordination(self)
        return self.coordination

    # What the ledger asks ---------------------------------------------------------------------

    def modules_known(self) -> list[nn.Module]:
        return self.known.modules

    def params_known(self) -> list[torch.Tensor]:
        return self.known.params

    def named_modules_known(self) -> list[tuple[str, nn.Module]]:
        """The known modules, each by the name the step's code gives it (``model=`` is
        "model"), else by its type."""
        names = {id(m): name for name, m in self.named.items()}
        return [(names.get(id(m), type(m).__name__), m) for m in self.known.modules]

    def _discover(self, args: tuple[Any, ...]) -> None:
        """On the first call: modules among the arguments (a method's ``self``, and the modules
        it holds as attributes)."""
        for value in args:
            if isinstance(value, torch.Tensor):
                continue
            if isinstance(value, nn.Module):
                self.known.add_module(value)
                continue
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict):
                for name, held in list(attributes.items())[:256]:
                    if isinstance(held, nn.Module):
                        self.named.setdefault(f"self.{name}", held)
                        self.known.add_module(held)

    # Bookkeeping ------------------------------------------------------------------------------

    def _size_changed(
        self, old: int | None, new: int, reason: str, observer: _Observer | None
    ) -> None:
        change = SizeChange(self.calls, self.name, old, new, reason)
        self.tally.change(change)
        if observer is not None:
            observer.size_changed(self, change)
        recovered = reason in ("oom", "grow failed")  # a recovered OOM is never invisible
        logger.log(
            logging.WARNING if recovered else logging.INFO,
            "%s: %smicro-batch size %s -> %d (%s) at call %d%s",
            self.name,
            "ran out of memory; " if recovered else "",
            "whole batch" if old is None else old,
            new,
            reason,
            self.calls,
            f" on a batch of {describe(self._current)}"
            if recovered and self._current is not None else "",
        )

    def _locate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Batch:
        if self.keyword is not None and self.keyword in kwargs:
            return kwargs[self.keyword]
        if self.index is not None and self.index < len(args):
            return args[self.index]
        raise TypeError(
            f"{self.name}() was called without its batch (argument "
            f"{self.keyword or self.index!r}); autobatch splits that argument on OOM"
        )

    def _with_batch(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], piece: Batch
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.keyword is not None and self.keyword in kwargs:
            return args, {**kwargs, self.keyword: piece}
        assert self.index is not None  # _locate found it positionally
        return (*args[: self.index], piece, *args[self.index + 1 :]), kwargs

    def _device(self, batch: Batch) -> DeviceLike:
        if self.options.device is not None:
            return self.options.device
        for t in tensors(batch):
            return t.device
        for p in self.known.params:
            return p.device
        return None

    # Running ----------------------------------------------------------------------------------

    def _capture(self, exc: BaseException) -> _Failure | None:
        """Called inside ``except``: the failure to recover from, or ``None`` to re-raise."""
        if isinstance(exc, _PeerFailed):
            return _Failure(exc=exc, kind=str(exc), inside=None)
        if isinstance(exc, AutobatchError) or not is_oom_error(exc):
            return None
        failure = _Failure(
            exc=exc, kind=oom_kind(exc) or "oom", inside=_optimizer_in_traceback(exc),
            # read while the failed attempt's tensors are alive: what the OOM saw
            unallocated=self.watch.unallocated_share(self._watched()),
        )
        _strip_tracebacks(exc)
        return failure

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of the step: whole on the fast path until memory runs short."""
        if self.calls == 0 or self.sizes.states or self.learned != structure_epoch() or (
            self.options.sync_ranks and self.coordinated() is not None
        ):
            # the first call, or the first since something was registered into the step's
            # modules (watched, to learn what it changes), memory ran short before (pieces,
            # measured), or every step is agreed by all ranks
            return self.call(args, kwargs)
        # The fast path, paid by every step that does not run out of memory, written out: an
        # attempt (optimizer steps that begin, known changes copied), a try, the retries.
        known = self.known
        attempt = self._spare
        if attempt is not None and known.plain:  # (reset in place: nothing else to copy)
            self._spare = None
            if attempt.stepped:
                attempt.stepped = []
            attempt.ours_stepped = False
            attempt.firsts = None
            attempt.began_with(known.params)
        else:
            attempt = _Attempt(
                self, self._batch_tensors(args, kwargs) if known.writes_batch else None
            )
        token = _CURRENT_ATTEMPT.set(attempt)
        if attempt.carried:
            attempt.keep_carried()
        failure = None
        try:
            result = self.fn(*args, **kwargs)
        except BaseException as exc:
            attempt.end(token)
            failure = self._capture(exc)
            if failure is None:
                raise
        if failure is not None:  # (out of the except block: the recovery holds no traceback)
            return self.call(args, kwargs, failure, attempt)
        _CURRENT_ATTEMPT.reset(token)
        if attempt.patch is not None:
            attempt.end(None)
        if attempt.light:  # (one that copied state, or failed, is not reused)
            self._spare = attempt
        self.calls += 1
        if not (attempt.ours_stepped or known.carries) and (self.optimizers or self.keeps_gradients):
            self._note_carried()
        if self.watch.step_done(self._watched()):
            self._thrashing(self._locate(args, kwargs))
        return result

    def _note_carried(self) -> None:
        """A call without an optimizer step of its own left gradients: the next may add to them."""
        self.known.carries = self.known.carries or any(p.grad is not None for p in self.known.params)

    def _batch_tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The batch's tensors (for a step known to write its batch in place)."""
        return list(tensors(self._locate(args, kwargs)))

    def _watched(self) -> DeviceLike:
        """The device whose allocator the watch reads: the option, else the parameters'."""
        device, params = self.options.device, self.known.params
        return params[0].device if device is None and params else device

    def _thrashing(self, batch: Batch) -> None:
        """The allocator released its cache and retried in step after step: a smaller size
        before it runs out (the pieces add up as a whole batch does, so nothing changes)."""
        try:
            total = batch_size(batch)
        except (TypeError, ValueError):
            return
        key, eps = shape_key(batch), max(elements_per_sample(batch), 1)
        changed = self.sizes.after_thrashing(key, eps, total)
        if changed is not None:
            self._size_changed(*changed, "thrashing", _OBSERVER.get())

    def call(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        failure: _Failure | None = None,
        attempt: _Attempt | None = None,
    ) -> Any:
        """Run a call on the slow path (``failure``: the whole batch already ran out of memory,
        in ``attempt``)."""
        batch = self._locate(args, kwargs)
        observer = _OBSERVER.get()
        if observer is not None:
            observer.noticed(self, batch)
        return self._run(args, kwargs, batch, failure, attempt, observer)

    def _finished(self, samples: int) -> None:
        self.calls += 1
        self.tally.counts["samples"] += samples

    def _unsplittable(self, batch: Batch, failure: _Failure, reason: str) -> AutobatchError:
        return AutobatchError(
            f"{self.name} ran out of memory ({failure.kind}) on a batch it cannot split: {reason}. "
            f"The batch was {describe(batch)}; batches split along dimension 0 of their tensors "
            "and of per-sample lists (lists of str/int as long as the batch), and copy other "
            "values into every piece"
        )

    def _whole(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch, reason: str,
        failure: _Failure | None,
    ) -> Any:
        """A batch that cannot be split (nothing to split by, or no rows): run it whole, once
        (``failure``: it ran out of memory on the fast path already)."""
        if failure is None:
            try:
                with _Attempt(self, carry=self.coordinated() is None):
                    result = self.fn(*args, **kwargs)
            except BaseException as exc:
                failure = self._capture(exc)
                if failure is None:
                    raise
            if failure is None:
                self._finished(0)
                return result
        self.tally.counts["ooms"] += 1
        raise self._unsplittable(batch, failure, reason) from failure.exc

    def _piece(
        self, key: Hashable, eps: int, remaining: int, memory: DeviceMemory,
        coord: _Coordination | None,
    ) -> int:
        """The size of the next piece, agreed with the other ranks."""
        try:
            n = self.sizes.piece(key, eps, remaining, _room(memory))
        except _TooSmall as small:
            raise BatchSizeError(
                f"{self.name}: {remaining} rows cannot be cut into micro-batches of at least "
                f"min_batch={self.options.min_batch} rows that fit on {memory.name} (a piece of "
                f"{small.args[0]} rows ran out of memory already); lower min_batch, or give "
                "batches whose size is a multiple of a size that fits",
                batch_size=int(small.args[0]),
                capacity_bytes=memory.capacity_bytes(),
            ) from None
        if coord is not None and self.sizes.pressure:
            n = coord.piece(n, remaining)
        return n

    def _weight(self, batch: Batch, piece: Batch, n: int, total: int, items: float | None) -> float:
        """A piece's share of the batch's loss: of its rows, or of its items (``items=``)."""
        if self.options.reduction == "sum":
            return 1.0
        if items is not None and items > 0:
            assert self.options.items is not None
            return _count_items(self.options.items(piece), self.name) / items
        return n / total

    @contextlib.contextmanager
    def _watching(
        self, *, early: bool, records: bool, coord: _Coordination | None, last: bool,
        session: _Accumulation | None, piece: Batch,
    ) -> Iterator[None]:
        """One watched attempt: the ledger's, kept in step with the other ranks by ``coord``."""
        split = session is not None
        shadow = [] if records else [
            *self.known.changing, *(tensors(piece) if self.known.writes_batch else ())
        ]
        if coord is None:
            with self.ledger.attempt(early=early, split=split, records=records, shadow=shadow):
                yield
            return
        with coord.attempt(last=last, session=session), self.ledger.attempt(
            early=early, split=split, records=records, gate=coord.gate, on_forward=coord.forward,
            shadow=shadow,
        ):
            yield

    def _run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch: Batch,
        failure: _Failure | None,
        attempt: _Attempt | None,
        observer: _Observer | None,
    ) -> Any:
        """Run ``batch`` in pieces, recovering from OOM; ``failure`` is a first whole-batch OOM."""
        if uncollated(batch):  # (dimension 0 of its tensors is not its rows)
            return self._whole(args, kwargs, batch, (
                "it is a list of per-row dicts (samples not collated yet); collate them into "
                "a dict of tensors first, e.g. with torch.utils.data.default_collate"
            ), failure)
        try:
            total = batch_size(batch)
        except (TypeError, ValueError) as error:
            return self._whole(args, kwargs, batch, str(error), failure)
        if total == 0:
            return self._whole(args, kwargs, batch, "it has no rows", failure)
        key = shape_key(batch)
        eps = max(elements_per_sample(batch), 1)
        memory = PeakKeeping(memory_for(self._device(batch)))  # resets the user never sees
        statistics = memory.has_statistics
        self._current = batch  # for the log of a recovery; dropped when the call ends
        coord = self.coordinated()
        ledger = self.ledger
        learning = self.calls == 0 or self.learned != structure_epoch()
        if learning:
            self._discover(args)
            self.known.refresh()
            watch_structure(self.known.modules)
            self.learned = structure_epoch()
        pieces: list[tuple[int, Any, float]] = []
        done = 0
        stepped = False  # an optimizer of the step's own stepped
        clean = True
        split = False
        opened = False
        items: float | None = None
        session: _Accumulation | None = None
        whole: _Attempt | None = None
        try:
            if failure is not None:  # the whole batch failed on the fast path
                assert attempt is not None
                clean = False
                self._recover(failure, attempt, key, eps, total, total, memory, None, observer)
            else:
                grown = self.sizes.maybe_grow(key, eps, total, _room(memory))
                if grown is not None:
                    self._size_changed(*grown, "grow", observer)
            while done < total:
                n = self._piece(key, eps, total - done, memory, coord)
                if n < total and not split:
                    split = True
                    warn_tuples(self.name, batch, self.warned)
                    if self.options.items is not None and self.options.reduction == "mean":
                        items = _count_items(self.options.items(batch), self.name)
                last = done + n == total
                splits = n < total and self.policy == "accumulate"  # pieces of one step
                watched = splits or learning or coord is not None
                if watched and not opened:
                    ledger.open(tensors(batch), split=splits, unwatched=kept_by(attempt))
                    opened = True
                if n < total and session is None and self.policy == "accumulate":
                    session = self._accumulation()
                piece = batch if n == total else slice_rows(batch, done, done + n)
                weight = self._weight(batch, piece, n, total, items)
                if session is not None:
                    session.begin_piece(weight, last)
                piece_args, piece_kwargs = self._with_batch(args, kwargs, piece)
                whole = None if splits else _Attempt(self, carry=coord is None)  # (shrink: whole)
                early = session is not None and not last
                phases = _PhasePeaks(memory)  # peaks outside and inside optimizer.step
                baseline = 0
                if statistics:
                    memory.reset_peak()
                    baseline = memory.allocated_bytes()
                failure = None
                try:
                    with phases, whole if whole is not None else contextlib.nullcontext(), (
                        self._watching(
                            # (a split batch's last piece writes once per batch: unwatched)
                            early=early, records=early or learning, coord=coord,
                            last=last or self.policy == "shrink", session=session, piece=piece,
                        ) if watched else contextlib.nullcontext()
                    ):
                        result = self.fn(*piece_args, **piece_kwargs)
                except BaseException as exc:
                    failure = self._capture(exc)
                    if failure is None:
                        if coord is not None:
                            coord.finish(_distributed.FAILED)
                        piece_too_small(exc, self, n, total)
                        raise
                finally:
                    if session is not None:
                        session.end_piece()
                del piece_args, piece_kwargs, piece
                if n < total:
                    warn_batchnorm(self.name, [*self.known.modules, *self.ledger.batchnorms], self.warned)
                if coord is not None:
                    codes = coord.finish(_distributed.OK if failure is None else _distributed.OOM)
                    if max(codes) == _distributed.FAILED:
                        raise _peer_error(codes, "in this step")
                    if failure is None and max(codes) != _distributed.OK:
                        failure = self._capture(_PeerFailed(codes))
                if failure is None:
                    if (whole is not None and whole.ours_stepped) or (watched and ledger.stepped):
                        stepped = True
                    if early:
                        assert session is not None
                        ledger.check_piece(session.params, session.unfolded)
                    if watched:
                        self.known.learn(ledger.first_attempt_written())
                        self.known.add_params(ledger.adopted)
                        ledger.adopted = []
                    if statistics:  # the step's own memory does not grow with the piece
                        self.sizes.record(key, eps, n, phases.outside - baseline)
                    pieces.append((n, result, weight))
                    done += n
                    refined = self.sizes.after_piece(key, eps, n, _room(memory))
                    if refined is not None:
                        self._size_changed(*refined, "refine", observer)
                    continue
                clean = False
                lost = n
                dirty = session is not None and session.dirty
                if coord is not None:
                    dirty = coord.any(dirty)  # one rank's sum is spoilt: every rank starts over
                if dirty:
                    lost += done  # this piece's gradients reached the sum: the batch starts over
                    pieces.clear()
                    done = 0
                self._recover(
                    failure, whole, key, eps, n, lost, memory, session, observer,
                    restart=dirty or (whole is not None and done == 0),
                )
        except BaseException as error:
            # A refusal, an error of the step's own, a batch too large: nothing of the batch
            # is kept. (After an update that was partly applied, the state stays as it is.)
            if opened and not isinstance(error, _Applied):
                if session is not None:
                    session.restart()
                ledger.undo_batch()
                self.known.learn(ledger.first_attempt_written())
            for tried in (attempt, whole):  # (the batch's whole attempt, unwatched or not)
                if tried is not None:
                    tried.explain(error)
            raise
        finally:
            self._current = None
            if session is not None:
                session.close()
            if opened:
                ledger.close()
            memory.restore_peak()
        self.sizes.finish(key, clean)
        if not stepped and (self.optimizers or self.keeps_gradients):
            self._note_carried()
        self._finished(total)
        self.tally.micro_batch_size = max(n for n, _, _ in pieces) if len(pieces) > 1 else None
        if self.watch.step_done(self._watched()):
            self._thrashing(batch)
        return _combine(pieces)

    def _recover(
        self,
        failure: _Failure,
        whole: _Attempt | None,
        key: Hashable,
        eps: int,
        failed: int,
        lost: int,
        memory: DeviceMemory,
        session: _Accumulation | None,
        observer: _Observer | None,
        *,
        restart: bool = False,
    ) -> None:
        """After an OOM at ``failed`` rows: check what the attempt changed, undo it, clean up,
        free memory, and pick a smaller size. ``whole``: the record of a whole-batch attempt;
        else a piece of ``session``; ``restart``: its batch starts over. ``lost`` samples are
        redone. Under a process group every rank takes the same size."""
        self.tally.counts.update(ooms=1, samples_recomputed=lost)
        if observer is not None:
            observer.oom(lost)
        coord = self.coordinated()
        problem: AutobatchError | None = None
        try:
            if coord is None:  # (ranks that shard a model with FSDP2 are never independent)
                _refuse_independent_shards(self.name, self.known.modules, failure)
            seen = self.ledger.seen() if whole is None else whole.seen(functools.partial(
                describe_params, named=self.named, modules=self.known.modules))
            verdict = judge(self.name, failure.kind, failure.inside, seen, self.optimizers)
            if verdict is not None:
                raise verdict from failure.exc
        except AutobatchError as error:
            applied = error if isinstance(error, _Applied) else _Applied(str(error))
            applied.__cause__ = error.__cause__
            if coord is None:
                raise applied from error.__cause__
            problem = applied  # raised once the other ranks know
        if problem is None:
            if whole is not None:  # a whole call: put back what it changed
                whole.rollback()
                if self.ledger.is_open and restart:  # (the batch's first call)
                    if session is not None:
                        session.restart()
                    self.ledger.undo_batch()
                elif self.ledger.is_open:  # (a later piece of policy='shrink')
                    self.ledger.undo_piece()
            elif restart:
                assert session is not None
                session.restart()
                self.ledger.undo_batch()
            else:
                if session is not None:
                    session.discard()
                if self.ledger.is_open:
                    self.ledger.undo_piece()
        reset_scalers(self.fn, self.optimizers, self.options.scaler, session)
        hint_fragmentation(self.name, failure.unallocated, failure.kind)
        free_memory(memory.device)  # the cache emptied too, before smaller pieces run
        try:
            too_small = problem is not None
            if problem is None:
                try:
                    old, new, reason = self.sizes.after_oom(key, eps, failed, _room(memory))
                except _TooSmall:
                    too_small = True
            if coord is not None:
                # One decision for every rank: -1 someone cannot go on, 0 too small, else the
                # smallest size any rank chose.
                agreed = coord.piece(-1 if problem else 0 if too_small else new, failed)
                if agreed < 0:
                    raise problem or AutobatchError(
                        f"{self.name}: another rank cannot recover from this step's failure "
                        f"({failure.kind}); see that rank's error. Every rank stops here"
                    ) from failure.exc
                too_small = agreed == 0
                if not too_small and agreed != new:
                    self.sizes.states[key].limit = new = agreed
            if too_small:
                raise _TooSmall
        except _TooSmall:
            needed: int | None = None
            found = self.sizes.model(key)
            if found is not None:
                needed = memory.allocated_bytes() + int(found[0].predict(failed * eps))
            raise BatchSizeError(
                f"{self.name} ran out of memory ({failure.kind}) at a micro-batch of {failed} "
                f"(min_batch={self.options.min_batch}) on {memory.name}"
                + ("" if needed is None else f": it needs about {format_bytes(needed)}")
                + f" of {format_bytes(memory.capacity_bytes())}. Lower min_batch if allowed, "
                "free memory held elsewhere, or use a smaller model, a lower precision or "
                "activation checkpointing",
                batch_size=failed, needed_bytes=needed, capacity_bytes=memory.capacity_bytes(),
            ) from failure.exc
        self._size_changed(old, new, reason, observer)

    def _accumulation(self) -> _Accumulation:
        scalers = () if self.options.scaler is None else (self.options.scaler,)
        return _Accumulation(self.name, self.known.params, self.optimizers, scalers,
                             self.schedulers, show_sums=self.coordinated() is None)

    # For the guard (a front-end asks) ---------------------------------------------------------

    def guard_piece(self, batch: Batch, done: int, total: int) -> int:
        """The size of the next piece the guard should yield (``"shrink"`` only)."""
        if not self.sizes.pressure:
            return total - done
        key = shape_key(batch)
        eps = max(elements_per_sample(batch), 1)
        memory = memory_for(self._device(batch))
        if done == 0:
            grown = self.sizes.maybe_grow(key, eps, total, _room(memory))
            if grown is not None:
                self._size_changed(*grown, "grow", _OBSERVER.get())
        n = self._piece(key, eps, total - done, memory, self.coordinated())
        if n < total:
            warn_tuples(self.name, batch, self.warned)
        return n


def _room(memory: DeviceMemory) -> int | None:
    """Bytes a piece may add: what is free on the device now (``None`` without statistics)."""
    if not memory.has_statistics:
        return None
    return memory.free_bytes()
