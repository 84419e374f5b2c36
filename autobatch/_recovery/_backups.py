"""The undo store: every saved thing as a keyed entry, put back in reverse order. Copies of
tensors taken before their first write (in host memory when large: device memory is short,
which is why a batch is split), and values each with what puts it back: the gradients as an
attempt began, the state the fast path copies in one fused copy, metric states, optimizer
hyperparameters, the RNG streams. The fast path's attempts and the ledger's pieces and
batches each hold one."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._recovery._inspect import _key, engine_work, host_copy
from autobatch._sizing._state import holds_bytes

_View = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def _view(tensor: torch.Tensor) -> _View:
    """Which bytes of which storage a tensor is."""
    return (
        _key(tensor), int(tensor.storage_offset()), tuple(map(int, tensor.shape)),
        tuple(map(int, tensor.stride())),
    )


#: Backups larger than this are kept in host memory, not on the device.
HOST_BACKUP_BYTES = 2**20


class _Kept:
    """A value saved with the function that puts it back."""

    __slots__ = ("put", "value")

    def __init__(self, put: Callable[[Any], None], value: Any) -> None:
        self.put, self.value = put, value


class Backups:
    """Keyed entries, put back in reverse order: ``(tensor, copy)`` under the tensor's view,
    or a :class:`_Kept` under a key of the saver's. (Made on every step of the fast path:
    a plain class.)"""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[Hashable, tuple[torch.Tensor, torch.Tensor] | _Kept] = {}

    def take(self, tensor: torch.Tensor, copy: torch.Tensor | None = None) -> torch.Tensor:
        view = _view(tensor)
        found = self.entries.get(view)
        if isinstance(found, tuple):
            return found[1]
        if copy is None:
            if tensor.numel() * tensor.element_size() > HOST_BACKUP_BYTES:
                copy = host_copy(tensor)  # (device memory is short: that is why we are here)
            else:
                with engine_work(), torch.no_grad():
                    copy = tensor.detach().clone()
        self.entries[view] = (tensor, copy)
        return copy

    def keep(self, key: Hashable, value: Any, put: Callable[[Any], None]) -> None:
        """Save ``value`` under ``key``, to be put back by ``put(value)`` (the first value
        saved under a key stays)."""
        if key not in self.entries:
            self.entries[key] = _Kept(put, value)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return _view(tensor) in self.entries

    def tensors(self) -> list[torch.Tensor]:
        """The tensors copied."""
        return [e[0] for e in self.entries.values() if isinstance(e, tuple)]

    def put_back(self) -> None:
        """Put every entry back, the last saved first. The tensors' copies are then forgotten
        (each is unwritten again: its next write is a first write, copied anew); the values
        kept stay, so a batch that starts over twice is put back to its beginning twice."""
        with engine_work(), torch.no_grad():
            for entry in reversed(list(self.entries.values())):
                if isinstance(entry, _Kept):
                    entry.put(entry.value)
                    continue
                tensor, copy = entry
                if not holds_bytes(tensor):
                    continue  # its storage was freed since (FSDP2 frees an unsharded parameter
                    # after use): nothing can read it before it is filled afresh
                if copy.device != tensor.device:
                    with _disable_current_modes():  # (from host memory, uncounted)
                        tensor.copy_(copy)
                else:
                    tensor.copy_(copy)
        self.entries = {k: e for k, e in self.entries.items() if isinstance(e, _Kept)}


# Python scalars the step keeps ---------------------------------------------------------------

#: Where a Python scalar lies: ``(holder, name, item)``: a closure cell's ``cell_contents``
#: or an attribute of the step's ``self`` (``item`` False), or a key of a dict or the item of
#: a one-item list in a closure cell (``state = {"step": 0}``, ``n = [0]``; ``item`` True). A
#: list that no longer holds one item was appended to: a log, left as it is.
Slot = tuple[Any, Any, bool]
_SCALARS = (int, float, str, bool, type(None))
_MISSING = object()


def scalar_slots(fn: Any) -> list[Slot]:
    """Where ``fn`` keeps Python scalars of its own: its closure's cells, the keys of dicts in
    them, and, for a method, its instance's attributes, that hold a number, a string, a flag
    or ``None`` (a call counter, a flag). A failed attempt puts them back, and every
    micro-batch starts from the batch's values, so that they change once per call: a counter
    counts the call once, and a loss it weights is the batch's. (A list appended to is a log:
    an append runs once per micro-batch; a count of rows kept in the step counts the last
    micro-batch's.)"""
    slots: list[Slot] = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # (an empty cell: a name bound later)
            continue
        if isinstance(value, _SCALARS):
            slots.append((cell, "cell_contents", False))
        elif type(value) is dict:
            slots += [(value, k, True) for k, v in value.items() if isinstance(v, _SCALARS)]
        elif type(value) is list and len(value) == 1 and isinstance(value[0], _SCALARS):
            slots.append((value, 0, True))
    owner = getattr(fn, "__self__", None)
    held = getattr(owner, "__dict__", None)
    if isinstance(held, dict) and not isinstance(owner, type):
        slots += [(owner, k, False) for k, v in held.items() if isinstance(v, _SCALARS)]
    return slots


def hyperparameter_slots(optimizers: Any) -> list[Slot]:
    """The optimizers' numeric hyperparameters (``lr``, ``momentum``, ``weight_decay``, ...):
    a step that sets them itself (``group["lr"] = ...``) has them put back with its scalars."""
    return [(group, k, True) for o in optimizers for group in o.param_groups
            for k, v in group.items() if type(v) is float]


def step_scalars(fn: Any, optimizers: Any) -> list[Slot]:
    """Where the step keeps Python numbers, its optimizers' hyperparameters included."""
    return scalar_slots(fn) + hyperparameter_slots(optimizers)


class ScalarsBegan:
    """The step's Python scalars as a batch began: put back after a failed attempt, before
    each micro-batch (so that each sees the batch's values: a counter that weights the loss
    weights every micro-batch alike), and after a refusal; and settled after the last piece.

    How a number ends after a split depends on what it counts, which the pieces show: each
    added the same whole number that is not a multiple of its rows (``calls += 1``): one
    call's worth, as unsplit; otherwise (``rows += len(x)``, a float running total) the sum
    of what every piece added. A flag or a string ends as the last piece left it. Attributes its
    ``self`` got during the batch (``self.calls = 1`` first written by this call) are dropped
    before each piece."""

    def __init__(self, fn: Any, slots: list[Slot], values: list[Any]) -> None:
        self.slots, self.values = slots, values
        owner = getattr(fn, "__self__", None)
        held = getattr(owner, "__dict__", None)
        self.attributes: dict[str, Any] = held if isinstance(held, dict) and not isinstance(
            owner, type) else {}
        self.names = set(self.attributes)
        self.pieces: list[tuple[int, list[Any]]] = []  # (rows, values after it)

    def put_back(self) -> None:
        put_scalars(self.slots, self.values)
        if len(self.attributes) != len(self.names):
            for name in [k for k, v in self.attributes.items()
                         if k not in self.names and isinstance(v, _SCALARS)]:
                del self.attributes[name]

    def piece_done(self, rows: int) -> None:
        if self.slots:
            self.pieces.append((rows, read_scalars(self.slots)))

    def settle(self) -> None:
        """After the last piece: each number as the rule above says."""
        if len(self.pieces) < 2:
            return
        settled = list(self.pieces[-1][1])
        for i, start in enumerate(self.values):
            ends = [values[i] for _, values in self.pieces]
            if not all(_number(v) for v in (start, *ends)):
                continue
            added = [end - start for end in ends]
            rows = [n for n, _ in self.pieces]
            per_call = len(set(added)) == 1 and isinstance(added[0], int) and not all(
                a != 0 and a % n == 0 for a, n in zip(added, rows, strict=True))
            settled[i] = start + (added[0] if per_call else sum(added))
        put_scalars(self.slots, settled)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _get(holder: Any, name: Any) -> Any:
    if type(holder) is list:
        return holder[0] if len(holder) == 1 else _MISSING
    return holder.get(name, _MISSING)


def read_scalars(slots: list[Slot]) -> list[Any]:
    return [_get(holder, name) if item else getattr(holder, name)
            for holder, name, item in slots]


def put_scalars(slots: list[Slot], values: list[Any]) -> None:
    for (holder, name, item), value in zip(slots, values, strict=True):
        if not item:
            if getattr(holder, name) is not value:
                setattr(holder, name, value)
        elif type(holder) is list:
            if len(holder) == 1 and value is not _MISSING and holder[0] is not value:
                holder[0] = value
        elif value is _MISSING:
            holder.pop(name, None)
        elif holder.get(name, _MISSING) is not value:
            holder[name] = value
