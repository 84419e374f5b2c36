"""Agreement between ranks (torch.distributed) through a step's attempts."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.nn.parallel import DistributedDataParallel

from autobatch import _distributed
from autobatch._backends import free_memory
from autobatch._errors import AutobatchError
from autobatch._oom import is_oom_error
from autobatch._recovery._accumulate import _Accumulation, _Patch
from autobatch._recovery._attempt import _VERSION, _strip_tracebacks
from autobatch._recovery._records import _Tally


class _Host(Protocol):
    """What the agreement needs of the engine whose attempts it keeps in step."""

    name: str
    optimizers: tuple[torch.optim.Optimizer, ...]
    tally: _Tally


#: How often a first ``optimizer.step()`` that ran out of memory is tried under a process group.
STEP_TRIES = 3
#: Attempts watched for collectives of the step's own; where none was seen, no gate after them.
GATE_ATTEMPTS = 4


class _PeerFailed(AutobatchError):
    """Another rank ran out of memory in this attempt; every rank stops it and recovers alike."""

    def __init__(self, codes: list[int]) -> None:
        self.ranks = [r for r, code in enumerate(codes) if code != _distributed.OK]
        super().__init__(f"rank {', '.join(map(str, self.ranks))} ran out of memory")


def _peer_error(codes: list[int], where: str) -> AutobatchError:
    failed = [r for r, code in enumerate(codes) if code == _distributed.FAILED]
    return AutobatchError(
        f"rank {', '.join(map(str, failed))} failed {where} with an error autobatch cannot "
        "recover from (see that rank's traceback); every rank stops here instead of waiting"
    )


_SHARDED: dict[type, bool] = {}


def _is_sharded(cls: type) -> bool:
    """Whether a module class is FSDP (the wrapper, or a module made by ``fully_shard``)."""
    found = _SHARDED.get(cls)
    if found is None:
        names = ("FullyShardedDataParallel", "FSDPModule")
        found = _SHARDED[cls] = any(c.__name__ in names for c in cls.__mro__)
    return found


class _Coordination:
    """Keeps the ranks of a process group in lockstep through an engine's attempts.

    Every attempt (one piece of a batch) ends with one vote on a side gloo group (OK, OOM or
    FAILED per rank), or earlier, at the first agreement point where some rank reports a
    failure: at the end of the backward that follows a ``DistributedDataParallel`` forward (and
    before that forward where DDP broadcasts buffers in it). The model's own collectives
    therefore never run while another rank has already left the attempt.

    DDP's reducer is kept out of backward (``require_backward_grad_sync`` is off during attempts,
    as ``no_sync()`` does). At the end of the backward of a batch's last piece, once every rank
    has voted that its backward finished, the gradients are averaged over the ranks exactly as
    DDP's default reduction does, so that code between ``backward()`` and ``optimizer.step()``
    (unscaling, clipping, GradScaler's inf check) sees the same gradients as under DDP. An OOM
    inside a rank's first ``optimizer.step()`` (state being created, no parameter changed) is
    retried on that rank alone with the same averaged gradients, so the update is the same as
    the others'; any other failure stops every rank with :class:`~autobatch.AutobatchError` at
    the attempt's last vote.
    """

    def __init__(self, engine: _Host) -> None:
        self.engine = engine
        self.active = False
        self.last = True  # the attempt's piece ends the batch (its backward is averaged)
        self.session: _Accumulation | None = None
        self.settled: list[int] | None = None  # the vote of this attempt that saw a failure
        self.modules: dict[int, DistributedDataParallel] = {}  # DDP modules run this attempt
        self.flags: list[tuple[DistributedDataParallel, bool]] = []  # forwards under way
        self.armed = False  # a DDP forward ran: average at the end of the next backward
        self.queued = False
        self.hooked: set[int] = set()  # DDP modules whose parameters carry our gradient hook
        self.patched: list[_Patch] | None = None
        self.watched = 0  # attempts run with the collective gate
        self.collectives = False  # the step issues collectives of its own

    # Votes ------------------------------------------------------------------------------------

    def _vote(self, code: int) -> list[int]:
        codes, _ = _distributed.vote(code)
        if max(codes) != _distributed.OK:
            self.settled = codes
        return codes

    def checkpoint(self, missing: bool = False) -> bool:
        """An agreement point inside the step: go on only if no rank has failed. Returns whether
        ``missing`` holds on some rank."""
        if self.settled is not None:
            codes = self.settled
        else:
            codes, missing = _distributed.vote(_distributed.OK, missing)
            if max(codes) != _distributed.OK:
                self.settled = codes
        if max(codes) == _distributed.FAILED:
            raise _peer_error(codes, "during this step")
        if max(codes) != _distributed.OK:
            raise _PeerFailed(codes)
        return missing

    def finish(self, code: int) -> list[int]:
        """The attempt's verdict: every rank's code (one vote, unless one already saw a failure)."""
        return self.settled if self.settled is not None else self._vote(code)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank."""
        return _distributed.agree_max([int(flag)])[0] > 0

    def piece(self, n: int, total: int) -> int:
        """The piece size every rank takes: the smallest proposed (batches must be equal)."""
        n, low, negated_high = _distributed.agree_min([n, total, -total])
        if low != -negated_high:
            raise AutobatchError(
                f"{self.engine.name}: the ranks' batches differ in size ({low} to {-negated_high} "
                "rows), so they cannot be split into the same number of micro-batches; give "
                "every rank batches of one size (DistributedSampler, drop_last=True)"
            )
        return n

    # One attempt ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def attempt(self, *, last: bool, session: _Accumulation | None) -> Iterator[None]:
        """Run one attempt in lockstep with the other ranks; ``last``: its piece ends the batch."""
        if self.patched is None:
            self.patched = [
                _Patch(o, "step", functools.partial(self._step, o, o.step))
                for o in self.engine.optimizers
            ]
        self.settled = None
        self.active, self.last, self.session = True, last, session
        self.armed = self.queued = False
        hooks = [
            register_module_forward_pre_hook(self._before_forward),
            register_module_forward_hook(self._after_forward, always_call=True),
        ]
        gate = None
        if self.collectives or self.watched < GATE_ATTEMPTS:
            # (a DDP forward under way has its collectives agreed before it: see _before_forward)
            gate = _distributed.CollectiveGate(self.checkpoint, lambda: bool(self.flags))
            self.watched += 1
        try:
            with gate if gate is not None else contextlib.nullcontext():
                yield
        finally:
            if gate is not None and gate.seen:
                self.collectives = True
            for hook in hooks:
                hook.remove()
            self.active = self.armed = self.queued = False
            self.session = None
            while self.flags:
                module, flag = self.flags.pop()
                module.require_backward_grad_sync = flag
            self.modules.clear()

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if _is_sharded(type(module)):
            self._refuse(
                f"{self.engine.name} runs an FSDP module: its forward and backward gather and "
                "scatter parameters with collectives that a rank which ran out of memory would "
                "never join, so autobatch cannot keep the ranks in step. Use "
                "retry_on_oom(sync_ranks=False) only where ranks are independent"
            )
        if not isinstance(module, DistributedDataParallel):
            return
        unsupported = [
            what for what, present in (
                ("static_graph=True", getattr(module, "static_graph", False)),
                ("a communication hook", getattr(module, "_comm_hooks", None)),
            ) if present
        ]
        if unsupported:
            self._refuse(
                f"{self.engine.name}: this DistributedDataParallel module has "
                f"{' and '.join(unsupported)}, which autobatch's gradient averaging would "
                "bypass; use retry_on_oom(sync_ranks=False), or drop that option"
            )
        self.modules[id(module)] = module
        wanted = module.require_backward_grad_sync  # False inside the user's own no_sync()
        self.flags.append((module, wanted))
        if id(module) not in self.hooked:
            self.hooked.add(id(module))
            for p in module.module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._gradient_ready)
        module.require_backward_grad_sync = False  # for this forward: autobatch averages later
        self.armed = self.armed or (self.last and wanted)  # where DDP would reduce, so do we
        if module.broadcast_buffers and any(True for _ in module.module.buffers()):
            self.checkpoint()  # DDP's forward begins with a collective (the buffers' broadcast)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(module, DistributedDataParallel) and self.flags:
            owner, flag = self.flags.pop()
            owner.require_backward_grad_sync = flag

    def _refuse(self, problem: str) -> None:
        if self.settled is None:
            self._vote(_distributed.FAILED)  # the others stop at their next vote
        raise AutobatchError(problem)

    def _gradient_ready(self, _: torch.Tensor) -> None:
        """A DDP parameter got its gradient: average them all once this backward has ended."""
        if self.active and self.armed and not self.queued:
            self.queued = True
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        """End of the backward of a batch's last piece: agree, then average the gradients (after
        every such backward: averaging gradients that are already equal on every rank again
        changes nothing, and a second backward adds new ones)."""
        self.queued = False
        if self.session is not None:
            self.session.merge()  # the earlier pieces' sums, for parameters the last one missed
        averages = []  # staging buffers first: an OOM here is still an ordinary, agreed one
        for module in self.modules.values():
            ignored: set[str] = set(getattr(module, "parameters_to_ignore", ()))
            params = [
                p for name, p in module.module.named_parameters()
                if p.requires_grad and name not in ignored
            ]
            averages.append(_distributed.GradientAverage(params, module.process_group))
        present = [f for a in averages for f in a.present]
        if self.checkpoint(missing=not all(present)):  # every rank has finished its backward
            present = _distributed.agree_max(present)  # some gradient is None on some rank
        for average in averages:
            average.run(present[: len(average.params)])
            present = present[len(average.params) :]

    def _step(
        self,
        optimizer: torch.optim.Optimizer,
        real: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """An optimizer's step during attempts: a first step that ran out of memory is tried
        again on this rank (the gradients, averaged already, are the same on every rank)."""
        if not self.active:
            return real(*args, **kwargs)
        error: BaseException | None = None
        for _ in range(STEP_TRIES):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            versions = list(map(_VERSION, params))
            first = not optimizer.state
            try:
                return real(*args, **kwargs)
            except BaseException as exc:
                _strip_tracebacks(exc)
                unchanged = versions == list(map(_VERSION, params))
                error = exc
                retry = is_oom_error(exc) and not isinstance(exc, AutobatchError)
                if not (retry and first and unchanged):
                    break
            # Out of the except block: the failed first step is gone. The other ranks learn
            # nothing of this retry: the averaged gradients are the same, so is the update.
            self.engine.tally.ooms += 1
            optimizer.state.clear()  # every entry was made by the failed first step
            error = None
            free_memory(params[0].device if params else None)
        raise AutobatchError(
            f"{self.engine.name}: {type(optimizer).__name__}.step() failed on this rank"
            + ("" if error is None else f" ({type(error).__name__})")
            + " after the gradients were averaged, and could not be retried; the other ranks' "
            "steps may have gone on, so the ranks' parameters may now differ and every rank "
            "stops. Restore from a checkpoint"
        ) from error
