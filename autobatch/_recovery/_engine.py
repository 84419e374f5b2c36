"""The recovery engine: runs a step on pieces of its batch, recovering from OOM."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Hashable
from typing import Any, Protocol, cast

import torch
from torch import nn

from autobatch import _distributed
from autobatch._batch import (
    Batch,
    batch_size,
    describe,
    elements_per_sample,
    quick_rows,
    shape_key,
    tensors,
    uncollated,
)
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._log import get_logger, user_name
from autobatch._memory._backends import DeviceLike, DeviceMemory, memory_for
from autobatch._oom import is_oom_error, oom_kind
from autobatch._recovery._accumulate import _Accumulation
from autobatch._recovery._arguments import (
    _batch_parameter,
    _modules_of,
    bare_steps,
    check_rows_elsewhere,
    no_batch,
    warn_tuples,
)
from autobatch._recovery._attempt import _ATTEMPT as _CURRENT_ATTEMPT
from autobatch._recovery._attempt import (
    _EPOCH,
    _Attempt,
    _Failure,
    _Known,
    _optimizer_in_traceback,
    _strip_tracebacks,
    structure_epoch,
    watch_structure,
)
from autobatch._recovery._backups import read_scalars, step_scalars
from autobatch._recovery._ledger import Ledger, see_optimizer_steps
from autobatch._recovery._options import Policy, RecoveryOptions
from autobatch._recovery._pieces import _BatchRun, room
from autobatch._recovery._ranks import _Coordination, _PeerFailed
from autobatch._recovery._records import SizeChange, _Tally
from autobatch._recovery._sizes import _Sizes, _TooSmall
from autobatch._recovery._thrash import _Watch

logger = get_logger("recovery")


class _Observer(Protocol):
    """Who hears of an engine's events (the guard around the loop)."""

    def noticed(self, engine: _Engine, batch: object) -> None: ...

    def oom(self, lost: int) -> None: ...

    def size_changed(self, engine: _Engine, change: SizeChange) -> None: ...


_OBSERVER: contextvars.ContextVar[_Observer | None] = contextvars.ContextVar(
    "autobatch_recovery_observer", default=None
)


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
        self.owners: dict[int, Any] = {}  # a method's ``self`` among the arguments (its numbers)
        if options.model is not None:
            self.named = {"model": options.model, **self.named}
        self.known = _Known(self.named.values(), self.optimizers)
        self.scalars = self._scalars()  # (again on watched calls)
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
        #: optimizers a bare decorator's step was seen stepping (refused in micro-batches)
        self.steps_seen: list[str] = []
        self.embeds = False  # the step calls embed_in_pieces: OOMs chunk its encoder instead
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
        """On the first call: modules among the arguments, and those a method's ``self`` holds."""
        for value in args:
            if isinstance(value, nn.Module):
                self.known.add_module(value)
                self.owners[id(value)] = value
            elif isinstance(attributes := getattr(value, "__dict__", None), dict) and not (
                isinstance(value, torch.Tensor)
            ):
                for name, held in list(attributes.items())[:256]:
                    if isinstance(held, nn.Module):
                        self.named.setdefault(f"self.{name}", held)
                        self.known.add_module(held)
                        self.owners[id(value)] = value

    def _scalars(self) -> list[Any]:
        """Where the step keeps Python numbers (its modules' and its ``self``'s too)."""
        return step_scalars(self.fn, self.optimizers, [*self.named.values(), *self.owners.values()])

    # Bookkeeping ------------------------------------------------------------------------------

    def size_changed(self, old: int | None, new: int, reason: str) -> None:
        change = SizeChange(self.calls, self.name, old, new, reason)
        self.tally.change(change)
        observer = _OBSERVER.get()
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

    def with_batch(
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

    def capture(self, exc: BaseException) -> _Failure | None:
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
        if self.learned != _EPOCH[0] or self.sizes.states or (
            self.options.sync_ranks and self.coordinated() is not None
        ):
            # the first call (learned is -1), or the first since something was registered into
            # the step's modules (watched, to learn what it changes), memory ran short before
            # (pieces, measured), or every step is agreed by all ranks
            return self.call(args, kwargs)
        # The fast path, paid by every step that does not run out of memory, written out (its
        # cost is mostly Python's on cold caches, after the step's own work: every line counts):
        # an attempt (optimizer steps that begin, known changes copied), a try, the retries.
        known = self.known
        attempt = self._spare
        if attempt is not None and known.plain:  # (reset in place: nothing else to copy)
            self._spare = None
            attempt.again(known.params)
        else:
            attempt = _Attempt(
                self, self._batch_tensors(args, kwargs) if known.writes_batch else None
            )
        attempt.scalars = read_scalars(self.scalars) if self.scalars else None
        token = _CURRENT_ATTEMPT.set(attempt)
        if attempt.apart:
            attempt.keep_carried()
        failure = None
        try:
            result = self.fn(*args, **kwargs)
        except BaseException as exc:
            attempt.end(token)
            failure = self.capture(exc)
            if failure is None:
                raise
        if failure is not None:  # (out of the except block: the recovery holds no traceback)
            return self.call(args, kwargs, failure, attempt)
        _CURRENT_ATTEMPT.reset(token)
        if attempt.patch is not None:
            attempt.end(None)
        elif attempt.carried:
            attempt.ended_well()
        if attempt.light:  # (one that copied state, or failed, is not reused)
            self._spare = attempt
        self.calls += 1
        try:  # noqa: SIM105 (suppress() is a context manager: slower, on every step)
            self.tally.rows += quick_rows(self._locate(args, kwargs))
        except TypeError:  # (called without its batch: found on the first split)
            pass
        if not attempt.ours_stepped and (self.optimizers or self.keeps_gradients) and (
            not known.carries
        ):
            self._note_carried()
        if attempt.stepped and not self.optimizers:
            bare_steps(self, attempt.stepped, in_piece=False)
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
            self.size_changed(*changed, "thrashing")

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
        return self._run(args, kwargs, batch, failure, attempt)

    def finished(self, batch: Batch, samples: int, stepped: bool) -> None:
        """A call on the slow path is done (``stepped``: an optimizer of the step's own)."""
        self.scalars = self._scalars()  # (`self.calls = 1`, say)
        if not stepped and (self.optimizers or self.keeps_gradients):
            self._note_carried()
        self.calls += 1
        self.tally.counts["samples"] += samples
        if self.watch.step_done(self._watched()):
            self._thrashing(batch)

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
                failure = self.capture(exc)
                if failure is None:
                    raise
            if failure is None:
                self.calls += 1
                return result
        self.tally.counts["ooms"] += 1
        raise self._unsplittable(batch, failure, reason) from failure.exc

    def next_piece(
        self, key: Hashable, eps: int, remaining: int, memory: DeviceMemory,
        coord: _Coordination | None,
    ) -> int:
        """The size of the next piece, agreed with the other ranks."""
        try:
            n = self.sizes.piece(key, eps, remaining, room(memory))
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

    def _run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch: Batch,
        failure: _Failure | None,
        attempt: _Attempt | None,
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
            if self.calls == 0:  # (said now, not hours later at the first OOM)
                raise no_batch(self, args, kwargs, batch, error) from None
            return self._whole(args, kwargs, batch, str(error), failure)
        if total == 0:
            return self._whole(args, kwargs, batch, "it has no rows", failure)
        if self.calls == 0 and failure is None:  # (said now, not at the first OOM)
            check_rows_elsewhere(self, args, kwargs, total, first=True)
        for name, module in _modules_of(self.fn).items():  # (a metric made anew each epoch)
            if id(module) not in self.known.module_ids:
                self.named[name] = module
                self.known.add_module(module)
        learning = self.calls == 0 or self.learned != structure_epoch()
        if learning:
            self._discover(args)
            self.scalars = self._scalars()
            self.known.refresh()
            watch_structure(self.known.modules)
            self.learned = structure_epoch()
        self._current = batch  # for the log of a recovery; dropped when the call ends
        try:
            run = _BatchRun(self, args, kwargs, batch, total, self._device(batch),
                            learning=learning)
            return run.run(failure, attempt)
        finally:
            self._current = None

    def accumulation(self) -> _Accumulation:
        scalers = () if self.options.scaler is None else (self.options.scaler,)
        return _Accumulation(self.name, self.known.params, self.optimizers, scalers,
                             self.schedulers, show_sums=self.coordinated() is None)

    def lost(self, samples: int) -> None:
        """An OOM: ``samples`` are run again."""
        self.tally.counts.update(ooms=1, samples_recomputed=samples)
        observer = _OBSERVER.get()
        if observer is not None:
            observer.oom(samples)

    # For the guard (a front-end asks) ---------------------------------------------------------

    def guard_piece(self, batch: Batch, done: int, total: int) -> int:
        """The size of the next piece the guard should yield (``"shrink"`` only)."""
        if not self.sizes.pressure:
            return total - done
        key = shape_key(batch)
        eps = max(elements_per_sample(batch), 1)
        memory = memory_for(self._device(batch))
        if done == 0:
            grown = self.sizes.maybe_grow(key, eps, total, room(memory))
            if grown is not None:
                self.size_changed(*grown, "grow")
        n = self.next_piece(key, eps, total - done, memory, self.coordinated())
        if n < total:
            warn_tuples(self.name, batch, self.warned)
        return n


