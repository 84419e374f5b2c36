"""Agreement between ranks under torch.distributed: every decision about sizes is collective.

Each helper is a no-op without an initialised process group of more than one rank. The
collectives use the process group's own backend (gloo on CPU tensors, nccl on the current CUDA
device) and are issued between trials, never while the model's own collectives may be in
flight.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._errors import AutobatchError


def active() -> bool:
    """Whether a process group of more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(values: list[int], op: dist.ReduceOp.RedOpType) -> list[int]:
    # Outside any dispatch mode: a simulated GPU must not count (or fail on) the message.
    with _disable_current_modes():
        tensor = torch.tensor(values, dtype=torch.int64, device=_device())
        dist.all_reduce(tensor, op=op)
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

_SIDE_GROUPS: dict[int, dist.ProcessGroup] = {}


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
    world = dist.group.WORLD
    key = id(world)
    group = _SIDE_GROUPS.get(key)
    if group is None:
        with _disable_current_modes():
            made = dist.new_group(backend="gloo", timeout=_default_timeout())
        assert made is not None  # every rank is a member
        _SIDE_GROUPS.clear()  # a group of an earlier, destroyed default group is useless
        group = _SIDE_GROUPS[key] = made
    return group


def vote(code: int) -> list[int]:
    """Every rank's code (:data:`OK`, :data:`OOM`, :data:`FAILED`), by rank, agreed on the side
    group. Raises :class:`~autobatch.AutobatchError` when the ranks do not all answer within
    the process group's timeout (a rank stuck elsewhere) instead of waiting forever."""
    world = dist.get_world_size()
    codes = [0] * world
    codes[rank()] = code
    with _disable_current_modes():
        tensor = torch.tensor(codes, dtype=torch.int64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=side_group())
        except RuntimeError as error:
            raise AutobatchError(
                f"rank {rank()}: the other ranks did not reach the same point of the step within "
                f"the process group's timeout ({error}); a rank is stuck or has died"
            ) from error
        return [int(v) for v in tensor.tolist()]


def agree_min(values: list[int]) -> list[int]:
    """Element-wise minimum over ranks, on the side group (a decision every rank then shares)."""
    with _disable_current_modes():
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=side_group())
        return [int(v) for v in tensor.tolist()]


def average_gradients(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Average ``params``' gradients over the ranks of ``group``, in place, as DDP's default
    reduction does (divide by the group size, then sum). A parameter without a gradient counts
    as zeros; one without a gradient on every rank keeps ``None``.

    Every rank must pass the same parameters in the same order. No memory is allocated beyond a
    zero gradient for a parameter that has none here but has one on another rank.
    """
    with _disable_current_modes():
        present = torch.tensor([int(p.grad is not None) for p in params], dtype=torch.int64)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=side_group())
        size = dist.get_world_size(group)
        works = []
        for p, used in zip(params, present.tolist(), strict=True):
            if not used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
            grad.div_(size)
            works.append(dist.all_reduce(grad, group=group, async_op=True))
        for work in works:
            assert work is not None
            work.wait()
