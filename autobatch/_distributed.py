"""Agreement between ranks under torch.distributed: every decision about sizes is collective.

Each helper is a no-op without an initialised process group of more than one rank. The
collectives use the process group's own backend (gloo on CPU tensors, nccl on the current CUDA
device) and are issued between trials, never while the model's own collectives may be in
flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes


def active() -> bool:
    """Whether a process group of more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
