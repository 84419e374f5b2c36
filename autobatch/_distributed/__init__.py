"""Agreement between ranks under torch.distributed: every decision about sizes is collective.

The finder's helpers (:func:`all_max`, :func:`all_min`, :func:`failed_ranks`) are no-ops without
an initialised process group of more than one rank; they use the default group's own backend
(gloo on CPU tensors, nccl on the current CUDA device) before and after the search, never while
the model's own collectives may be in flight. The guard's (:func:`vote`, :func:`agree_min`,
:func:`agree_max`) run inside a training step, on a side gloo group of their own, and so do the
votes inside the finder's trials of a DDP or FSDP2 model (:func:`trials_in_lockstep`) and the
gather that agrees on each trial (:func:`gather`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._distributed import _fsdp
from autobatch._errors import AutobatchError
from autobatch._memory._accounting import DispatchMode

_AVAILABLE = dist.is_available()
#: The type of the object where torch keeps the default process group (read directly:
#: ``dist.is_initialized()`` is three calls deep, and the recovery engine asks on every step).
_PLAIN_WORLD = getattr(distributed_c10d, "_World", None) if _AVAILABLE else None
if _PLAIN_WORLD is not None and not (
    type(getattr(distributed_c10d, "_world", None)) is _PLAIN_WORLD
    and hasattr(distributed_c10d._world, "_default_pg")
):
    _PLAIN_WORLD = None  # (another layout: ask torch)


def active() -> bool:
    """Whether a process group of more than one rank is initialised (cheap when none is: the
    recovery engine asks on every step)."""
    if not _AVAILABLE:
        return False
    if _PLAIN_WORLD is not None:  # (a test harness may swap the world for another type)
        world = distributed_c10d._world
        if type(world) is _PLAIN_WORLD and world._default_pg is None:
            return False
    return dist.is_initialized() and dist.get_world_size() > 1


def lone_replica(modules: Sequence[nn.Module]) -> bool:
    """Whether a process group of one rank is initialised and one of ``modules`` is (or holds)
    a ``DistributedDataParallel`` module: its reducer runs in every backward all the same, so
    the trials and attempts go through the same agreement as under several ranks (every vote
    then has one voter)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != 1:
        return False
    return any(isinstance(m, DistributedDataParallel) for top in modules for m in top.modules())


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(
    values: list[int], op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None = None
) -> list[int]:
    """``values`` reduced element-wise over the ranks of ``group`` (default: the default group,
    on its backend's device; a side group is gloo, on the CPU)."""
    # Outside any dispatch mode: a simulated GPU must not count (or fail on) the message.
    with _disable_current_modes():
        device = _device() if group is None else torch.device("cpu")
        tensor = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=op, group=group)
        return [int(v) for v in tensor.tolist()]


def all_max(values: list[int]) -> list[int]:
    """Element-wise maximum over ranks (the values themselves without a process group)."""
    return _reduce(values, dist.ReduceOp.MAX) if active() else list(values)


def all_min(values: list[int]) -> list[int]:
    """Element-wise minimum over ranks (the values themselves without a process group)."""
    return _reduce(values, dist.ReduceOp.MIN) if active() else list(values)


def failed_ranks(failed: bool) -> list[int]:
    """The ranks on which something failed (every rank learns the same list)."""
    if not active():
        return [0] if failed else []
    flags = [0] * dist.get_world_size()
    flags[rank()] = int(failed)
    return [r for r, flag in enumerate(all_max(flags)) if flag]


# Agreement inside a training step (the OOM guard) ---------------------------------------------

#: What a rank reports at an agreement point, in increasing severity (the maximum wins).
OK, OOM, FAILED = 0, 1, 2

_SIDE_GROUP: list[tuple[int, dist.ProcessGroup]] = []  # (id of the default group, side group)


def _default_timeout() -> datetime.timedelta:
    """The default process group's own timeout (gloo or nccl), so that agreement waits exactly
    as long as the model's collectives would."""
    group = dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except Exception:
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return distributed_c10d.default_pg_timeout


def side_group() -> dist.ProcessGroup:
    """A gloo group over every rank for the guard's agreement, made on first use (a collective
    call: every rank makes it at the same point) and kept for the process group's lifetime.

    Its messages are a few integers on the CPU: no device synchronisation, and never queued
    behind (or between) the model's own collectives on the default group.
    """
    key = id(dist.group.WORLD)
    if _SIDE_GROUP:
        made_for, group = _SIDE_GROUP[0]
        # (a default group destroyed since may have left its id to this one)
        if made_for == key and group in distributed_c10d._world.pg_map:
            return group
    with _disable_current_modes():
        made: dist.ProcessGroup | None = dist.new_group(backend="gloo", timeout=_default_timeout())
    assert made is not None  # every rank is a member
    _SIDE_GROUP[:] = [(key, made)]
    return made


def vote(code: int, flag: bool = False) -> tuple[list[int], bool]:
    """Every rank's code (:data:`OK`, :data:`OOM`, :data:`FAILED`), by rank, and whether
    ``flag`` holds on some rank, agreed on the side group (every vote has this one shape, so
    votes from different points of the step always match). Raises
    :class:`~autobatch.AutobatchError` when the ranks do not all answer within the process group's
    timeout (a rank stuck elsewhere) instead of waiting forever."""
    world = dist.get_world_size()
    values = [0] * (world + 1)
    values[rank()] = code
    values[world] = int(flag)
    try:
        agreed = _reduce(values, dist.ReduceOp.MAX, side_group())
    except RuntimeError as error:
        raise AutobatchError(
            f"rank {rank()}: the other ranks did not reach the same point of the step within "
            f"the process group's timeout ({error}); a rank is stuck or has died"
        ) from error
    return agreed[:world], bool(agreed[world])


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (any picklable object), by rank, on the side group."""
    gathered: list[Any] = [None] * dist.get_world_size()
    with _disable_current_modes():
        dist.all_gather_object(gathered, value, group=side_group())
    return gathered


def agree_max(values: list[int]) -> list[int]:
    """Element-wise maximum over ranks, on the side group."""
    return _reduce(values, dist.ReduceOp.MAX, side_group())


def agree_min(values: list[int]) -> list[int]:
    """Element-wise minimum over ranks, on the side group (a decision every rank then shares)."""
    return _reduce(values, dist.ReduceOp.MIN, side_group())


#: The largest staging buffer for averaging gradients (DDP's default bucket size).
BUCKET_BYTES = 25 * 2**20


class GradientAverage:
    """Average parameters' gradients over a process group in place, as DDP's default reduction
    does (divide by the group size, then sum), in few collectives.

    Made before the ranks agree to go on, so that the staging buffers (at most
    :data:`BUCKET_BYTES` per dtype and device) are allocated where an OOM can still be recovered;
    :meth:`run` then allocates nothing (except a zero gradient for a parameter that has none here
    but has one on another rank). Every rank must pass the same parameters in the same order.
    """

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.params = params
        self.group = group
        self.present = [int(p.grad is not None) for p in params]
        if any(p.grad is not None and p.grad.layout != torch.strided for p in params):
            raise AutobatchError(
                "sparse gradients (e.g. nn.Embedding(sparse=True)) cannot be averaged by "
                "autobatch across ranks; use retry_on_oom(sync_ranks=False) or dense gradients"
            )
        self.staging: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        with _disable_current_modes():
            needed: dict[tuple[torch.dtype, torch.device], int] = {}
            for p in params:
                key = (p.dtype, p.device)
                needed[key] = needed.get(key, 0) + p.numel()
        for (dtype, device), count in needed.items():
            limit = max(BUCKET_BYTES // torch.empty((), dtype=dtype).element_size(), 1)
            self.staging[(dtype, device)] = torch.empty(min(count, limit), dtype=dtype, device=device)

    def run(self, present: list[int]) -> None:
        """Average every gradient present on some rank (``present``: the agreed flags)."""
        size = dist.get_world_size(self.group)
        pending: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, int, int]]] = {}
        filled = dict.fromkeys(self.staging, 0)
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p, used in zip(self.params, present, strict=True):
            if not used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
            # (a gradient in another memory format is averaged through a contiguous copy, so that
            # every rank sends its elements in the same order)
            flat = grad.view(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
            if not grad.is_contiguous():
                copies.append((grad, flat))
            key = (p.dtype, p.device)
            buffer = self.staging[key]
            start = 0
            while start < flat.numel():
                if filled[key] == buffer.numel():
                    self._flush(buffer, filled[key], pending.pop(key), size)
                    filled[key] = 0
                length = min(flat.numel() - start, buffer.numel() - filled[key])
                at = filled[key]
                buffer[at : at + length].copy_(flat[start : start + length])
                pending.setdefault(key, []).append((flat[start : start + length], at, length))
                filled[key] += length
                start += length
        for key, segments in pending.items():
            self._flush(self.staging[key], filled[key], segments, size)
        for grad, flat in copies:
            grad.copy_(flat.view(grad.shape))
        self.staging.clear()

    def _flush(
        self, buffer: torch.Tensor, used: int, segments: list[tuple[torch.Tensor, int, int]], size: int
    ) -> None:
        chunk = buffer[:used]
        chunk.div_(size)
        with _disable_current_modes():
            dist.all_reduce(chunk, group=self.group)
        for target, at, length in segments:
            target.copy_(buffer[at : at + length])


class CollectiveGate(DispatchMode):
    """A dispatch mode that calls ``before()`` ahead of every collective dispatched while it is
    active (a ``c10d`` operator: an all-reduce in the user's step, SyncBatchNorm's gathers),
    unless ``skip()`` says the collective is accounted for elsewhere. ``before`` runs only if
    an operator that allocates (not in place) ran since it last ran: a run of in-place
    collectives (e.g. one all-reduce per gradient) is agreed once. ``seen`` says whether any
    collective went through.

    Collectives autobatch issues itself run outside every dispatch mode, so they never pass.
    """

    def __init__(self, before: Callable[[], object], skip: Callable[[], bool]) -> None:
        super().__init__()
        self.before = before
        self.skip = skip
        self.seen = False
        self.allocated = True

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func.namespace == "c10d":
            if not self.skip():
                self.seen = True
                if self.allocated:
                    self.allocated = False
                    self.before()
        elif not func.overloadpacket.__name__.endswith("_") and "out" not in func._overloadname:
            self.allocated = True
        return func(*args, **kwargs)


# The finder's trials under DDP and FSDP2 -------------------------------------------------------


class PeerOutOfMemory(AutobatchError, torch.OutOfMemoryError):
    """Another rank ran out of memory in this trial: this rank stopped at its next collective,
    which the other would never have joined. The trial failed for lack of memory (on that
    rank), so it is an out-of-memory error (``torch.OutOfMemoryError``) to whoever classifies
    it."""


#: The failure a rank records for a trial that another rank's OOM stopped.
PEER = "oom on another rank"


class _Verdict(Protocol):  # (a dataclass: Trial)
    @property
    def fits(self) -> bool: ...


V = TypeVar("V", bound=_Verdict)


def _replica_problem(module: DistributedDataParallel) -> str | None:
    """What in a ``DistributedDataParallel`` module's setup the finder's trials, whose
    backward leaves DDP's reducer out, would measure differently from a step that reduces, or
    ``None``."""
    name = type(module).__name__
    logged: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # (DDP's own record of its setup; absent on some torch)
        logged = dict(module._get_ddp_logging_data())
    hooks = getattr(module, "_comm_hooks", None) or logged.get("comm_hook")
    if hooks:
        return (
            f"this {name} module has a communication hook, whose buffers (e.g. compressed "
            "gradients) a trial cannot measure without running DDP's reduction; search the "
            "model before registering the hook, and leave headroom for the hook's buffers"
        )
    if getattr(module, "gradient_as_bucket_view", False):
        return (
            f"this {name} module has gradient_as_bucket_view=True, whose gradients DDP's "
            "reduction keeps in its buckets: a trial, which cannot run that reduction, would "
            "count every gradient twice and find a batch too small. Search a copy made with "
            "gradient_as_bucket_view=False: its batch also fits with True, which holds one "
            "copy of the gradients less"
        )
    if getattr(module, "static_graph", False):
        return (
            f"this {name} module has static_graph=True, under which DDP reduces some "
            "gradients in a callback after backward that a trial cannot leave out; search "
            "the model wrapped without static_graph (the memory is the same)"
        )
    if hasattr(module, "buffer_hook"):
        return (
            f"this {name} module has a buffer communication hook, which a trial cannot "
            "keep in step across ranks; search the model without it"
        )
    return None


class _Reducers:
    """The ``DistributedDataParallel`` modules of a trial, their reducer kept out of its
    backward (as ``no_sync()`` does) and their buffers broadcast at each forward as in a step
    that reduces; both flags put back afterwards.

    A rank that ran out of memory in backward would never join DDP's next bucket all-reduce,
    and DDP's reducer cannot be left part-way through one; leaving it out changes no memory:
    its buckets exist already, and a step that reduces copies the gradients into them and back
    without allocating (gradients as bucket views and communication hooks are refused, see
    :func:`_replica_problem`).
    """

    def __init__(self, modules: list[DistributedDataParallel]) -> None:
        self.modules = modules
        self.flags: list[tuple[bool, bool]] = []
        self.hooks: list[Any] = []

    def __enter__(self) -> None:
        self.flags = [(m.require_backward_grad_sync, m.require_forward_param_sync) for m in self.modules]
        for module, (_, forward) in zip(self.modules, self.flags, strict=True):
            self.hooks.append(module.register_forward_pre_hook(self._before(forward)))

    @staticmethod
    def _before(forward: bool) -> Callable[[DistributedDataParallel, Any], None]:
        def hook(module: DistributedDataParallel, args: Any) -> None:
            module.require_backward_grad_sync = False
            # (DDP turns this off after a forward that does not reduce: every forward of the
            # trial broadcasts the buffers, as a step that reduces would)
            module.require_forward_param_sync = forward

        return hook

    def __exit__(self, *exc: object) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for module, (backward, forward) in zip(self.modules, self.flags, strict=True):
            module.require_backward_grad_sync = backward
            module.require_forward_param_sync = forward


def trials_in_lockstep(
    runner: Callable[[int], V], model: nn.Module, *, sync: bool, modules: Sequence[nn.Module] = ()
) -> Callable[[int], V]:
    """The finder's trial runner, kept in step across ranks inside each trial when ``model``
    (or one of ``modules``, those the step refers to) is wrapped in ``DistributedDataParallel``
    or sharded with FSDP2 (``runner`` itself otherwise).

    Their collectives run inside the trial's step: DDP broadcasts buffers in forward, FSDP2
    all-gathers parameters and reduce-scatters gradients, and a rank that ran out of memory
    would never join the next one. Each trial therefore runs under a :class:`CollectiveGate`
    whose vote (on the side group) comes before every collective of the step, and ends with one
    vote of its own (fits, out of memory, or failed), unless a vote in it already saw a failure.
    DDP's reducer is kept out of the trial's backward (:class:`_Reducers`), so that its bucket
    all-reduces never start. A rank that learns of another's OOM at a vote raises
    :class:`PeerOutOfMemory` there, so its trial fails too; one that learns of another's
    non-OOM failure raises :class:`~autobatch.AutobatchError`. After a trial that did not fit,
    each FSDP root's per-iteration state is reset and unreduced gradients are dropped, so the
    next trial starts as the first did.

    Without agreement (a process group of one rank), trials run as they are (DDP's collectives
    then have one rank), and FSDP's state is cleaned up all the same after a trial that did not
    fit.

    Refused with :class:`~autobatch.AutobatchError`, on every rank before any trial: FSDP1
    (``FullyShardedDataParallel``), DDP or FSDP2 with ``sync=False`` under a process group
    (their collectives need every rank), CPU offload, tensor parallelism under FSDP2 (see
    :func:`autobatch._distributed._fsdp.unsupported`), and what DDP's reducer would measure differently (see
    :func:`_replica_problem`).
    """
    tops = [model, *(m for m in modules if m is not model)]
    if any(_fsdp.kind(m) == "fsdp1" for top in tops for m in top.modules()):
        raise AutobatchError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1), whose collectives a rank "
            "that ran out of memory in a trial would never join, and autobatch cannot put a "
            "vote before them. Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard): "
            "find_max_batch runs its trials in lockstep on every rank"
        )
    roots = list({id(r): r for top in tops for r in _fsdp.roots(top)}.values())
    replicas = list({
        id(m): m for top in tops for m in top.modules() if isinstance(m, DistributedDataParallel)
    }.values())
    if not roots and not replicas:
        return runner
    if not sync and active():
        wrapped = "sharded with FSDP2" if roots else "wrapped in DistributedDataParallel"
        why = "gathers parameters" if roots else "reduces gradients (and broadcasts buffers)"
        raise AutobatchError(
            f"sync_ranks=False cannot search a model {wrapped}: every step {why} with every "
            "rank, so the ranks' trials cannot be independent. Use sync_ranks=True (the "
            "default)"
        )
    for root in roots:
        problem = _fsdp.unsupported(root, finder=True)
        if problem is not None:
            raise AutobatchError(problem)
    if not sync:  # one rank: nothing to agree on, but FSDP's state to clean up all the same
        if not roots:
            return runner

        def alone(size: int) -> V:
            try:
                outcome = runner(size)
            except BaseException:
                _reset(roots)
                raise
            if not outcome.fits:
                _reset(roots)
            return outcome

        return alone
    for replica in replicas:
        problem = _replica_problem(replica)
        if problem is not None:
            raise AutobatchError(f"find_max_batch cannot search this model: {problem}")
    world = dist.get_world_size()
    reducers = _Reducers(replicas)

    def trial(size: int) -> V:
        settled: list[list[int]] = []  # the vote that saw a failure, once there is one

        def ask(code: int) -> list[int]:
            if settled:
                return settled[0]
            try:
                codes = vote(code)[0]
            except AutobatchError:  # timed out: no second wait for the trial's last vote
                settled.append([FAILED] * world)
                raise
            if max(codes) != OK:
                settled.append(codes)
            return codes

        def checkpoint() -> None:
            codes = ask(OK)
            if max(codes) == OK:
                return
            failed = [r for r, code in enumerate(codes) if code != OK]
            if max(codes) == FAILED:
                raise AutobatchError(
                    f"rank {', '.join(map(str, failed))} failed during the trial at batch "
                    f"{size} with an error that is not out-of-memory; see that rank's traceback"
                )
            raise PeerOutOfMemory(
                f"rank {', '.join(map(str, failed))} ran out of memory during the trial at "
                f"batch {size}"
            )

        gate = CollectiveGate(checkpoint, lambda: False)
        try:
            with reducers, gate:
                outcome = runner(size)
        except BaseException:
            _reset(roots)
            ask(FAILED)  # the others stop at their next vote
            raise
        codes = ask(OK if outcome.fits else OOM)
        if not outcome.fits:
            _reset(roots)
            if codes[rank()] == OK:  # stopped at a vote by another rank's OOM, not its own
                outcome = dataclasses.replace(outcome, error=PEER)  # type: ignore[type-var]
        if max(codes) == FAILED:
            failed = [r for r, code in enumerate(codes) if code == FAILED]
            raise AutobatchError(
                f"rank {', '.join(map(str, failed))} failed during the trial at batch {size} "
                "with an error that is not out-of-memory; see that rank's traceback"
            )
        return outcome

    return trial


def _reset(roots: list[nn.Module]) -> None:
    """FSDP2's state after a trial that stopped part-way: per-iteration state reset, no
    gradient left unreduced."""
    for root in roots:
        root.reset_iter_state()  # type: ignore[operator]
        _fsdp.drop_gradients(root)
