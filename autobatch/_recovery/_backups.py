"""The undo store: every saved thing as a keyed entry, put back in reverse order. Copies of
tensors taken before their first write (in host memory when large: device memory is short,
which is why a batch is split), and values each with what puts it back: the gradients as an
attempt began, the state the fast path copies in one fused copy, metric states, optimizer
hyperparameters, the RNG streams. The fast path's attempts and the ledger's pieces and
batches each hold one."""

from __future__ import annotations

import dis
import functools
import math
import sys
import types
from collections.abc import Callable, Hashable, Iterable
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
_COUNT = object()  # (the slot of a list's length: groups added to it are dropped)


def scalar_slots(fn: Any, holders: Iterable[Any] = ()) -> list[Slot]:
    """Where ``fn`` keeps Python scalars of its own: its closure's cells, the keys of dicts in
    them, the module globals its code assigns (``global step``), and the attributes of its
    instance (a method's ``self``), of modules and of the user's own objects it holds in its
    closure or names as globals (``model.global_step``, ``counter.n``), and of ``holders``
    (the step's modules, the ``self`` a method decorated in its class body is called with),
    that hold a number, a string, a flag or ``None`` (a call counter, a flag). A failed
    attempt puts them back, and every micro-batch starts from the batch's values, so that
    they change once per call: a counter counts the call once, and a loss it weights is the
    batch's. (A list appended to is a log: an append runs once per micro-batch.)"""
    slots: list[Slot] = []
    given, holders = list(holders), []
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
        else:
            holders.append(value)
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is not None and isinstance(names, dict):
        assigned = _assigned_globals(code)
        for name in code.co_names:
            value = names.get(name, _MISSING)
            if name in assigned and isinstance(value, _SCALARS):
                slots.append((names, name, True))
            elif value is not _MISSING and not isinstance(value, _SCALARS):
                holders.append(value)
    owner = getattr(fn, "__self__", None)
    seen: set[int] = set()
    for holder in (owner, *given, *holders):
        held = getattr(holder, "__dict__", None)
        if id(holder) in seen or not isinstance(held, dict) or isinstance(holder, type) or not (
            holder is owner or _users_own(holder)
        ):
            continue
        seen.add(id(holder))
        slots += [(holder, k, False) for k, v in held.items() if isinstance(v, _SCALARS)
                  and not ((k.startswith("_") and holder is not owner) or k == "training")]
    return slots


_GLOBAL_STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})


@functools.lru_cache(maxsize=1024)
def _assigned_globals(code: Any) -> frozenset[str]:
    """The globals a function's code assigns (``global step; step += 1``), read once."""
    return frozenset(i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_STORES)


def _users_own(holder: Any) -> bool:
    """An object whose numbers are the user's state: a module (``model.global_step``), or an
    instance of a class of the user's own (not of torch's, autobatch's, the standard
    library's, an ``argparse`` namespace's, or a library's in ``site-packages``: an optimizer
    or a scheduler keeps its own books)."""
    if isinstance(holder, torch.nn.Module):
        return True
    if isinstance(holder, (types.ModuleType, types.FunctionType, types.MethodType)) or getattr(
        getattr(type(holder), "__dataclass_params__", None), "frozen", False
    ):
        return False  # (a frozen dataclass, a config: read, never written)
    module = sys.modules.get(type(holder).__module__)
    path = getattr(module, "__file__", None) or ""
    return type(holder).__module__ not in sys.stdlib_module_names and not type(
        holder).__module__.startswith(("torch", "autobatch", "numpy")) and "-packages" not in path


def hyperparameter_slots(optimizers: Any) -> list[Slot]:
    """The optimizers' numeric hyperparameters (``lr``, ``momentum``, ``weight_decay``, ...)
    and their numbers of parameter groups: a step that sets them itself (``group["lr"] = ...``,
    ``add_param_group``) has them put back with its scalars."""
    return [(group, k, True) for o in optimizers for group in o.param_groups
            for k, v in group.items() if type(v) is float] + [
        (o.param_groups, _COUNT, True) for o in optimizers]


def step_scalars(fn: Any, optimizers: Any, holders: Iterable[Any] = ()) -> list[Slot]:
    """Where the step keeps Python numbers, its optimizers' hyperparameters included."""
    return scalar_slots(fn, holders) + hyperparameter_slots(optimizers)


class ScalarsBegan:
    """The step's Python scalars as a batch began: put back after a failed attempt, before
    each micro-batch (so that each sees the batch's values: a counter that weights the loss
    weights every micro-batch alike), and after a refusal; and settled after the last piece.

    How a number ends after a split depends on what it adds up, which the first piece shows
    (the ``.item()`` values its forward read, each of a mean or a sum over the rows; see
    :func:`_added_kind`; the optimizers' hyperparameters and group counts skip to the last
    rule):

    - a mean's value added, or a step toward it (``total += loss.item()``, ``ema = 0.9 * ema
      + 0.1 * loss.item()``, an accuracy): the pieces' changes weighted by their shares, which
      is the batch's change for any number affine in that mean;
    - a sum's value added, or a mean's times the rows (``correct += (pred == y).sum()
      .item()``, ``total += loss.item() * len(x)``): the sum of the pieces' changes;
    - otherwise, the same whole number added by every piece, not a multiple of its rows
      (``calls += 1``): one call's worth, as unsplit; any other change (``rows += len(x)``,
      ``epoch += len(x) / n``): the sum. A number that is not finite ends as the last piece
      left it.

    A flag or a string ends as the last piece left it. Attributes its ``self`` got during the
    batch (``self.calls = 1`` first written by this call) are dropped before each piece."""

    def __init__(self, fn: Any, slots: list[Slot], values: list[Any]) -> None:
        self.slots, self.values = slots, values
        owner = getattr(fn, "__self__", None)
        held = getattr(owner, "__dict__", None)
        self.attributes: dict[str, Any] = held if isinstance(held, dict) and not isinstance(
            owner, type) else {}
        self.names = set(self.attributes)
        self.pieces: list[tuple[int, float, list[Any]]] = []  # (rows, share, values after it)
        #: the first piece's ``.item()`` reads of sums and means over the rows: (value, a sum)
        self.reads: list[tuple[float, bool]] = []

    def put_back(self) -> None:
        put_scalars(self.slots, self.values)
        if len(self.attributes) != len(self.names):
            for name in [k for k, v in self.attributes.items()
                         if k not in self.names and isinstance(v, _SCALARS)]:
                del self.attributes[name]

    def piece_done(self, rows: int, share: float) -> None:
        if self.slots:
            self.pieces.append((rows, share, read_scalars(self.slots)))

    def settle(self) -> None:
        """After the last piece: each number as the rule above says."""
        if len(self.pieces) < 2:
            return
        settled = list(self.pieces[-1][2])
        rows = [n for n, _, _ in self.pieces]
        shares = [share for _, share, _ in self.pieces]
        for i, start in enumerate(self.values):
            ends = [values[i] for _, _, values in self.pieces]
            if not all(_number(v) for v in (start, *ends)) or not all(
                    math.isfinite(v) for v in (start, *ends)):
                continue  # (a flag, a string, ``best = min(inf, ...)``: as the last piece left it)
            added = [end - start for end in ends]
            slot = self.slots[i]
            kind = None if slot[1] is _COUNT or (isinstance(slot[0], dict) and "params" in slot[
                0]) else _added_kind(start, added, rows, self.reads)
            if kind == "mean":
                settled[i] = start + sum(a * w for a, w in zip(added, shares, strict=True))
                continue
            per_call = kind is None and len(set(added)) == 1 and isinstance(
                added[0], int) and not all(
                a != 0 and a % n == 0 for a, n in zip(added, rows, strict=True))
            settled[i] = start + (added[0] if per_call else sum(added))
        put_scalars(self.slots, settled)


def _added_kind(start: float, added: list[Any], rows: list[int],
                reads: list[tuple[float, bool]]) -> str | None:
    """What the pieces' changes of a number add up, from the first piece's ``.item()`` reads
    that explain its change: ``"mean"`` (a mean's value: ``total += loss.item()``; or a step
    toward it, ``ema = 0.9 * ema + 0.1 * loss.item()``, where the changes are not in
    proportion to the rows), ``"sum"`` (a sum's value, or a mean's times the rows, other than
    a whole 1: ``calls += 1`` counts calls), or ``None`` (the rules for counts decide)."""
    first = added[0]

    def near(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12 * max(1.0, abs(start), abs(b)))

    for value, total in reads:
        if not total and near(first, value):
            return "mean"
    for value, total in reads:
        if ((total and near(first, value)) or (not total and near(first, value * rows[0]))) and (
            not (isinstance(first, int) and first == 1)
        ):
            return "sum"
    by_rows = all(near(a * rows[0], first * n) for a, n in zip(added, rows, strict=True))
    for value, total in reads:  # (a moving average: a share of the way to the mean)
        gap = value - start
        if not total and not isinstance(first, int) and gap and 0 < first / gap <= 1 and (
            not by_rows
        ):
            return "mean"
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _get(holder: Any, name: Any) -> Any:
    if name is _COUNT:
        return len(holder)
    if type(holder) is list:
        return holder[0] if len(holder) == 1 else _MISSING
    return holder.get(name, _MISSING)


def read_scalars(slots: list[Slot]) -> list[Any]:
    return [_get(holder, name) if item else getattr(holder, name)
            for holder, name, item in slots]


def put_scalars(slots: list[Slot], values: list[Any]) -> None:
    for (holder, name, item), value in zip(slots, values, strict=True):
        if not item:
            current = getattr(holder, name, _MISSING)
            if current is not value and not (type(current) is type(value) and current == value):
                setattr(holder, name, value)
        elif name is _COUNT:
            del holder[value:]
        elif type(holder) is list:
            if len(holder) == 1 and value is not _MISSING and holder[0] is not value:
                holder[0] = value
        elif value is _MISSING:
            holder.pop(name, None)
        elif holder.get(name, _MISSING) is not value:
            holder[name] = value
