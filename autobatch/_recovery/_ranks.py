"""Agreement between ranks (torch.distributed) through a step's attempts."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from autobatch import _distributed
from autobatch._distributed import _fsdp
from autobatch._errors import AutobatchError
from autobatch._log import get_logger
from autobatch._memory._backends import free_memory
from autobatch._oom import is_oom_error
from autobatch._recovery._accumulate import _Accumulation
from autobatch._recovery._attempt import _VERSION, _Failure, _Known, _strip_tracebacks
from autobatch._recovery._patches import Patch
from autobatch._recovery._records import _Tally
from autobatch._recovery._rules import first_step_retryable

logger = get_logger("recovery")


class _Host(Protocol):
    """What the agreement needs of the engine whose attempts it keeps in step."""

    name: str
    optimizers: tuple[torch.optim.Optimizer, ...]
    tally: _Tally
    known: _Known


#: How often a first ``optimizer.step()`` that ran out of memory is tried under a process group.
STEP_TRIES = 3


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


def _refuse_independent_shards(name: str, modules: list[nn.Module], failure: _Failure) -> None:
    """An OOM recovered without agreement (``sync_ranks=False``, or a process group of one
    rank), in a step that runs an FSDP2 module: refused. Alone, a rank would leave the others
    waiting in its next collective; and FSDP's gradients and per-iteration state are kept
    exact only by the agreement (:class:`_Coordination`)."""
    if not _fsdp.sharded(modules):
        return
    if _distributed.active():
        raise AutobatchError(
            f"{name} ran out of memory ({failure.kind}) in a step that runs a model sharded "
            "with FSDP2, under retry_on_oom(sync_ranks=False): its forward and backward gather "
            "parameters from every rank, so this rank cannot recover alone while the others "
            "wait in its next collective. Use sync_ranks=True (the default), which recovers on "
            "every rank together"
        ) from failure.exc
    raise AutobatchError(
        f"{name} ran out of memory ({failure.kind}) in a step that runs a model sharded with "
        "FSDP2 on a single rank: autobatch recovers FSDP2 steps under a process group of two "
        "or more ranks, where every rank agrees on each micro-batch. On one device, train the "
        "model without fully_shard"
    ) from failure.exc


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

    FSDP2 (modules made by ``fully_shard``) runs its own collectives throughout forward and
    backward (all-gathers of parameters, reduce-scatters of gradients): every attempt that runs
    one runs under the collective gate, so each of them is preceded by a vote, taken at the
    collective itself (after its buffers were allocated, when nothing is left to fail before it
    starts). Pieces before a batch's last skip gradient reduction (``set_requires_gradient_sync
    (False)`` on each FSDP root for that piece), so FSDP sums the pieces' unsharded gradients
    itself, and the last piece reduces them once; the accumulation weights those gradients and
    leaves them in place (:meth:`_Accumulation.accumulate_in_place`). After an attempt raised
    (here, or because another rank failed), each FSDP root's per-iteration state is reset
    (``reset_iter_state``), and unreduced gradients of a whole-batch attempt are dropped.
    ``FullyShardedDataParallel`` (FSDP1) is refused.
    """

    def __init__(self, engine: _Host) -> None:
        self.engine = engine
        self.active = False
        self.last = True  # the attempt's piece ends the batch (its backward is averaged)
        self.session: _Accumulation | None = None
        self.settled: list[int] | None = None  # the vote of this attempt that saw a failure
        self.modules: dict[int, DistributedDataParallel] = {}  # DDP modules run this attempt
        # forwards under way: each DDP module with its two flags as the user had them (DDP sets
        # require_forward_param_sync from the backward flag in its forward, so both go back)
        self.flags: list[tuple[DistributedDataParallel, bool, bool]] = []
        self.armed = False  # a DDP forward ran: average at the end of the next backward
        self.queued = False
        self.hooked: set[int] = set()  # DDP modules whose parameters carry our gradient hook
        self.gradient_hooks: list[Any] = []  # on DDP parameters, for this attempt only
        self.allocated = True
        self.sharded: bool | None = None  # the step runs FSDP2 modules (None: not looked yet)
        self.roots: list[nn.Module] = []  # FSDP2 roots whose forward ran in this attempt
        self.known_roots: dict[int, nn.Module] = {}  # every FSDP2 root seen, checked once
        self.syncing: list[tuple[nn.Module, list[bool]]] = []  # gradient sync to put back
        self.depth = 0  # FSDP2 forwards under way
        self.hooked_session: _Accumulation | None = None
        self.held = 0  # pieces of this batch whose gradients FSDP holds unreduced
        self.ran_sharded = False  # an FSDP2 forward ran in this attempt
        self.reduce_each_piece = False  # FSDP2: every piece reduces (the held sums did not fit)

    # Votes ------------------------------------------------------------------------------------

    def _ask(self, code: int, flag: bool = False) -> tuple[list[int], bool]:
        """One vote; a vote that timed out settles the attempt as failed everywhere, so that
        its last vote does not wait a second time for a rank that stopped answering."""
        try:
            codes, flag = _distributed.vote(code, flag)
        except AutobatchError:
            self.settled = [_distributed.FAILED] * dist.get_world_size()
            raise
        if max(codes) != _distributed.OK:
            self.settled = codes
        return codes, flag

    def _vote(self, code: int) -> list[int]:
        return self._ask(code)[0]

    def checkpoint(self, missing: bool = False) -> bool:
        """An agreement point inside the step: go on only if no rank has failed. Returns whether
        ``missing`` holds on some rank."""
        if self.settled is not None:
            codes = self.settled
        else:
            codes, missing = self._ask(_distributed.OK, missing)
        if max(codes) == _distributed.FAILED:
            raise _peer_error(codes, "during this step")
        if max(codes) != _distributed.OK:
            raise _PeerFailed(codes)
        return missing

    def finish(self, code: int) -> list[int]:
        """The attempt's verdict: every rank's code (one vote, unless one already saw a failure)."""
        codes = self.settled if self.settled is not None else self._vote(code)
        if self.ran_sharded:
            self._sharded_verdict(ok=max(codes) == _distributed.OK)
        return codes

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
        """Run one attempt in lockstep with the other ranks; ``last``: its piece ends the batch.
        The engine's ledger watches it, and calls :meth:`gate` before every collective and
        :meth:`forward` at every module's forward."""
        patches = [  # (undone after the attempt, before the session's own)
            Patch(o, "step", functools.update_wrapper(
                functools.partial(self._step, o, o.step), o.step
            ))
            for o in self.engine.optimizers
        ]
        self.settled = None
        self.active, self.last, self.session = True, last, session
        self.armed = self.queued = False
        self.allocated = True
        if self.sharded is None:
            self.sharded = bool(_fsdp.sharded(self.engine.known.modules))
        if session is not None and session is not self.hooked_session:
            self.hooked_session = session  # FSDP's sums go when the batch starts over
            session.on_restart.append(self._forget_sharded_gradients)
            self.held = 0
        self.ran_sharded = False
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            for handle in self.gradient_hooks:
                handle.remove()
            self.gradient_hooks = []
            self.hooked.clear()
            for patch in reversed(patches):
                patch.undo()
            self.active = self.armed = self.queued = False
            self.session = None
            while self.flags:
                module, backward, forward = self.flags.pop()
                module.require_backward_grad_sync = backward
                module.require_forward_param_sync = forward
            self.modules.clear()
            self._end_sharded(failed, whole=session is None)

    def gate(self, func: Any, allocated: bool) -> None:
        """Before a collective of the step's own (an all-reduce, SyncBatchNorm's gathers, a
        DTensor operator that may redistribute): agree that no rank has failed. A collective
        inside a DDP forward was agreed before that forward; a run of in-place collectives
        (one per gradient) with nothing allocated between them is agreed once."""
        if self.flags or not allocated:
            return
        self.checkpoint()

    def forward(self, module: nn.Module, entering: bool) -> None:
        """A module's forward begins (``entering``) or ends."""
        if entering:
            self._before_forward(module, ())
        else:
            self._after_forward(module, (), None)

    # FSDP2 ------------------------------------------------------------------------------------

    def _sharded_forward(self, module: nn.Module) -> None:
        """An FSDP2 module's forward begins (before FSDP's own hook gathers its parameters)."""
        self.sharded = True
        if self.depth == 0 and torch._C._current_autograd_node() is None:  # a root (not a
            # recomputation inside backward under activation checkpointing)
            if id(module) not in self.known_roots:
                problem = _fsdp.unsupported(module)
                if problem is not None:
                    self._refuse(f"{self.engine.name}: {problem}")
                self.known_roots[id(module)] = module
            if all(module is not r for r in self.roots):
                self.roots.append(module)
            if not (self.last or self.reduce_each_piece):  # FSDP sums the pieces' gradients;
                self.syncing.append((module, _fsdp.gradient_sync(module)))  # the last reduces
                module.set_requires_gradient_sync(False)  # type: ignore[operator]
        self.ran_sharded = True
        self.depth += 1

    def _sharded_forward_done(self, module: nn.Module) -> None:
        """An FSDP2 module's forward ended (before FSDP's own hook frees the gathered
        parameters): its unsharded parameters accumulate in place across the pieces."""
        self.depth = max(self.depth - 1, 0)
        if self.session is not None:
            params = _fsdp.unsharded_parameters(module, recurse=False)
            if self.reduce_each_piece:  # (FSDP reduces them in its post-backward: none held)
                self.session.track(params, fold=False)
            else:
                self.session.accumulate_in_place(params)

    def _sharded_verdict(self, ok: bool) -> None:
        """After an attempt that ran FSDP2 (the same verdict on every rank). An attempt that
        failed while FSDP held the earlier pieces' unreduced gradients (as big as the unsharded
        model's) makes every later piece reduce its own: the pieces' sum then lives in the
        sharded gradients (autobatch's buffers), at the cost of a reduce-scatter per piece."""
        if self.hooked_session is None or self.reduce_each_piece:
            return
        if ok:
            self.held = 0 if self.last else self.held + 1
        elif self.held:
            self.reduce_each_piece = True
            logger.info(
                "%s: FSDP2 gradients are reduced after every micro-batch from now on (the "
                "unreduced sums of earlier micro-batches left too little memory)",
                self.engine.name,
            )

    def _end_sharded(self, failed: bool, whole: bool) -> None:
        """After an attempt: gradient sync as the user set it; after a failure, FSDP's
        per-iteration state reset on every root, and a whole batch's unreduced gradients
        (partial) dropped."""
        while self.syncing:
            module, flags = self.syncing.pop()
            _fsdp.set_gradient_sync(module, flags)
        self.depth = 0
        roots, self.roots = self.roots, []
        if failed:
            for root in roots:
                root.reset_iter_state()  # type: ignore[operator]
                if whole:
                    _fsdp.drop_gradients(root)

    def _forget_sharded_gradients(self) -> None:
        """The batch starts over: FSDP's sums of the earlier pieces go too."""
        self.held = 0
        for root in self.known_roots.values():
            _fsdp.drop_gradients(root)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        sharding = _fsdp.kind(module)
        if sharding == "fsdp2":
            self._sharded_forward(module)
            return
        if sharding == "fsdp1":
            self._refuse(
                f"{self.engine.name} runs an FSDP module (FullyShardedDataParallel): its "
                "forward and backward gather and scatter parameters with collectives that a "
                "rank which ran out of memory would never join, and autobatch cannot put a "
                "vote before them. Shard with FSDP2 instead (torch.distributed.fsdp."
                "fully_shard), which autobatch keeps in step on every rank"
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
        self.flags.append((module, wanted, module.require_forward_param_sync))
        if id(module) not in self.hooked:
            self.hooked.add(id(module))
            self.gradient_hooks += [
                p.register_post_accumulate_grad_hook(self._gradient_ready)
                for p in module.module.parameters() if p.requires_grad
            ]
        module.require_backward_grad_sync = False  # for this forward: autobatch averages later
        self.armed = self.armed or (self.last and wanted)  # where DDP would reduce, so do we
        if module.broadcast_buffers and any(True for _ in module.module.buffers()):
            self.checkpoint()  # DDP's forward begins with a collective (the buffers' broadcast)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if _fsdp.kind(module) == "fsdp2":
            self._sharded_forward_done(module)
        elif isinstance(module, DistributedDataParallel) and self.flags:
            owner, backward, _ = self.flags.pop()
            owner.require_backward_grad_sync = backward
            # (what DDP's forward would have set had autobatch not turned the reducer off)
            owner.require_forward_param_sync = backward and torch.is_grad_enabled()

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
                changed = versions != list(map(_VERSION, params))
                error = exc
                retry = is_oom_error(exc) and not isinstance(exc, AutobatchError)
                if not (retry and first_step_retryable(
                    optimizer, fresh=first, params_changed=changed
                )):
                    break
            # Out of the except block: the failed first step is gone. The other ranks learn
            # nothing of this retry: the averaged gradients are the same, so is the update.
            self.engine.tally.counts["ooms"] += 1
            error = None
            free_memory(params[0].device if params else None)
        raise AutobatchError(
            f"{self.engine.name}: {type(optimizer).__name__}.step() failed on this rank"
            + ("" if error is None else f" ({type(error).__name__})")
            + " after the gradients were averaged, and could not be retried; the other ranks' "
            "steps may have gone on, so the ranks' parameters may now differ and every rank "
            "stops. Restore from a checkpoint"
        ) from error
