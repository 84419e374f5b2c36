"""Taking a training setup's state before trials, and putting it back bit for bit afterwards."""

from __future__ import annotations

import copy
import functools
import inspect
import random
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass

from autobatch._batch import tensors
from autobatch._memory._backends import restore_rng_states, save_rng_states


def modules_referenced(*objects: Any) -> list[torch.nn.Module]:
    """Modules among ``objects`` and among the names their code refers to (globals and
    closure variables of functions): a loss module, or the modules a step function uses."""
    return _referenced(torch.nn.Module, objects)


def state_referenced(*objects: Any) -> list[Any]:
    """Optimizers, GradScalers and LR schedulers the code of ``objects`` refers to (globals and
    closure variables): those a ``step_fn`` steps, whose state a trial changes as it does the
    model's.

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    >>> state_referenced(lambda model, batch: opt.step()) == [opt]
    True
    """
    return _referenced(
        (torch.optim.Optimizer, torch.amp.GradScaler, torch.optim.lr_scheduler.LRScheduler,
         *_generator_types()),
        objects,
    )


def _generator_types() -> tuple[type, ...]:
    """Random-number generators of one's own (``torch.Generator``, ``random.Random``, NumPy's
    ``Generator`` and ``RandomState``, where NumPy is imported): a step that draws from one
    finds it as the search found it."""
    numpy = sys.modules.get("numpy")
    found: tuple[type, ...] = (torch.Generator, random.Random)
    return found if numpy is None else (*found, numpy.random.Generator, numpy.random.RandomState)


def _generator_state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, random.Random):
        return generator.getstate()
    if hasattr(generator, "bit_generator"):  # (NumPy's Generator)
        return copy.deepcopy(generator.bit_generator.state)
    return generator.get_state()


def _put_generator_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = copy.deepcopy(state)
    else:
        generator.set_state(state)


#: How far :func:`_referenced` follows references from the objects it is given, and the most
#: values it looks at (a trainer's attributes, their dicts and lists, not a dataset's items).
_DEPTH, _MOST_VALUES, _MOST_ITEMS = 3, 4096, 256


def _references(value: Any) -> list[Any]:
    """What ``value`` refers to that may hold a step's state: a function's closure variables
    and globals, a bound method's ``self``, a ``functools.partial``'s function and
    arguments, the items of a small dict, list or tuple, and an object's attributes."""
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()]
    if inspect.ismethod(value):
        return [value.__func__, value.__self__]
    if inspect.isfunction(value):
        try:
            names = inspect.getclosurevars(inspect.unwrap(value))
        except (TypeError, ValueError):
            return []
        return [*names.nonlocals.values(), *names.globals.values()]
    if isinstance(value, dict):
        return list(value.values()) if len(value) <= _MOST_ITEMS else []
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) <= _MOST_ITEMS else []
    if isinstance(value, (type, types.ModuleType, torch.Tensor, torch.nn.Module)) or not hasattr(
        value, "__dict__"
    ):
        return []
    try:
        return list(vars(value).values())
    except TypeError:
        return []


def _referenced(kind: Any, objects: tuple[Any, ...]) -> list[Any]:
    """The objects of ``kind`` among ``objects`` and what they refer to (see
    :func:`_references`), :data:`_DEPTH` references deep: a step function's closure and
    globals, a trainer's ``self.optimizer``, a scheduler in a dict or passed through
    ``functools.partial``."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    level = [obj for obj in objects if obj is not None]
    for _ in range(_DEPTH + 1):
        following: list[Any] = []
        for value in level:
            if id(value) in seen or len(seen) >= _MOST_VALUES:
                continue
            seen.add(id(value))
            if isinstance(value, kind):
                found[id(value)] = value
            elif not isinstance(value, torch.nn.Module):  # (a module's own: saved with it)
                following += _references(value)
        level = following
    return list(found.values())


def _wraps(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a subclass that wraps others (a DTensor)."""
    return type(tensor) is not torch.Tensor and bool(is_traceable_wrapper_subclass(tensor))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``tensor``'s bytes on this process: a DTensor's local shard (a
    wrapper subclass's only inner tensor), else ``tensor`` itself. Saving and restoring that
    one is bit for bit and runs no collective."""
    if not _wraps(tensor):
        return tensor
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [t for t in (getattr(tensor, n) for n in names) if isinstance(t, torch.Tensor)]
    return inner[0] if len(inner) == 1 else tensor


def _inner_name(tensor: torch.Tensor) -> str:
    """The attribute that holds the only inner tensor of a wrapper subclass."""
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    found = [n for n in names if isinstance(getattr(tensor, n), torch.Tensor)]
    return str(found[0])


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (of its local shard) in host memory, made outside any dispatch mode
    (a simulated GPU must not count the copy: it stands for host memory)."""
    with _disable_current_modes():
        return _local(tensor).detach().to("cpu", copy=True)


def _restore_entries(entries: dict[str, tuple[Any, Any]], into: dict[str, Any]) -> None:
    """Put saved ``(original, copy)`` entries back into ``into``: tensors in place, in the
    objects they were, other values as copies."""
    for key, (original, copied) in entries.items():
        if isinstance(original, torch.Tensor):
            _put_back(original, copied)
            into[key] = original
        else:
            into[key] = copy.deepcopy(copied)


def _put_back(target: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        _local(target).copy_(saved)


@dataclass
class _Gradient:
    """One parameter's gradient, set aside for the trials as the same tensor object."""

    param: torch.Tensor
    grad: torch.Tensor  # the object restored (a DTensor for FSDP2's sharded gradients)
    local: torch.Tensor  # the tensor that holds its bytes (the DTensor's local shard)
    inner: str | None  # where a DTensor keeps ``local`` (None: ``grad`` is ``local``)
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _Storage:
    """The bytes of one storage that gradients view, kept in host memory."""

    saved: torch.Tensor
    members: list[_Gradient]
    freed: bool = False


class _Gradients:
    """Gradients kept as the same tensor objects across the trials.

    A storage that only gradients use (each its own, or one flat buffer that several view) is
    given up for the trials (a training step starts without gradients) and comes back as one
    new storage with the same bytes, each gradient a view of it as before; one that something
    else holds too (DDP's bucket views, a buffer of the caller's) keeps its memory, since it
    lives on through training anyway. A DTensor gradient keeps its object and gets a new local
    shard: FSDP2's sharded gradients view one reduce-scatter output per group, which nothing
    else keeps, so their shards are let go for the trials and come back as views of one
    storage again. Sparse gradients, and subclasses that hold several tensors, are set aside
    as they are."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.aside: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.storages: list[_Storage] = []
        groups: dict[int, tuple[torch.UntypedStorage, list[_Gradient]]] = {}
        for param in params:
            whole = param.grad
            if whole is None:
                continue
            param.grad = None
            local = _local(whole)
            if local.layout != torch.strided or _wraps(local):
                self.aside.append((param, whole))
                continue
            storage = local.untyped_storage()
            entry = _Gradient(
                param, whole, local, None if local is whole else _inner_name(whole),
                int(local.storage_offset()), tuple(local.shape), tuple(local.stride()),
            )
            groups.setdefault(storage._cdata, (storage, []))[1].append(entry)
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        for storage, members in groups.values():
            with _disable_current_modes():
                raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                kept = _Storage(raw.to("cpu", copy=True), members)
            del raw
            wrapped = all(m.inner is not None for m in members)
            # only these gradients use it (each holds it once, and so does `storage`)
            sole = use_count is not None and use_count(storage._cdata) <= len(members) + 1
            if wrapped or sole:
                with torch.no_grad(), _disable_current_modes():
                    for member in members:
                        empty = member.local.new_empty(0)
                        if member.inner is None:
                            member.local.set_(empty.untyped_storage())
                        else:  # (the DTensor lets its shard go; nothing reads it meanwhile)
                            setattr(member.grad, member.inner, empty)
                            member.local = empty
                kept.freed = True
            self.storages.append(kept)
            del storage

    def put_back(self) -> None:
        with torch.no_grad():
            for kept in self.storages:
                device = kept.members[0].local.device
                if kept.freed:
                    raw = torch.empty(kept.saved.numel(), dtype=torch.uint8, device=device)
                    raw.copy_(kept.saved)
                    for member in kept.members:
                        member.local.set_(raw.untyped_storage(), member.offset, member.size,
                                          member.stride)
                        if member.inner is not None:
                            setattr(member.grad, member.inner, member.local)
                    del raw
                    kept.freed = False
                else:
                    raw = torch.empty(0, dtype=torch.uint8, device=device).set_(
                        kept.members[0].local.untyped_storage()
                    )
                    raw.copy_(kept.saved)
                for member in kept.members:
                    member.param.grad = member.grad
        for param, grad in self.aside:
            param.grad = grad


@dataclass
class _ModuleState:
    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list
    )
    flags: list[tuple[torch.Tensor, bool]] = field(default_factory=list)
    training: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)
    attributes: list[tuple[torch.nn.Module, _Attributes]] = field(default_factory=list)


#: A module's own attributes as saved: the names it had, and each data attribute's value
#: with a copy (see :func:`_save_attributes`).
_Attributes = tuple[set[str], dict[str, tuple[Any, Any]]]

#: What every module keeps in its ``__dict__`` (parameters, buffers, submodules, hooks, the
#: ``training`` flag): saved by their own means.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _save_attributes(module: torch.nn.Module) -> _Attributes:
    """A module's own data attributes beside its parameters and buffers (a recurrent model's
    last hidden state kept as ``self.hidden``, or as an LSTM's ``(h, c)``, a call count, a dict
    of running tensors): a trial's forward may set them, and the next trial, or the user's next
    step, would read them. Tensors are copied to host memory, also inside dicts, lists and
    tuples (whose own contents are copied shallowly)."""
    kept: dict[str, tuple[Any, Any]] = {}
    for key, value in vars(module).items():
        if key in _MODULE_INTERNALS:
            continue
        if isinstance(value, torch.Tensor):
            if _plain(value):  # (not a parameter, nor a shard or a storage let go: FSDP's)
                kept[key] = (value, _host_copy(value))
        elif isinstance(value, (int, float, bool, str, type(None))):
            kept[key] = (value, value)
        elif isinstance(value, (dict, list, tuple)):
            inner = [(t, _host_copy(t)) for t in tensors(value) if _plain(t)]
            kept[key] = (value, (copy.copy(value), inner))
    return set(vars(module)), kept


def holds_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes are still in its storage (a storage resized to fewer bytes,
    as FSDP does to an unsharded parameter after use, no longer holds them)."""
    if tensor.numel() == 0:
        return True
    last = tensor.storage_offset() + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return (last + 1) * tensor.element_size() <= tensor.untyped_storage().nbytes()


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain dense tensor whose storage holds its bytes (not a
    parameter, a wrapper subclass such as a DTensor, or a tensor whose storage FSDP let go)."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided or tensor.is_meta:
        return False
    return holds_bytes(tensor)


def _put_attributes(module: torch.nn.Module, saved: _Attributes) -> None:
    """Put back what :func:`_save_attributes` saved; tensors a trial set on a name the module
    did not have (alone, or in a dict, list or tuple) are let go."""
    names, kept = saved
    state = vars(module)
    for key in [k for k, v in state.items() if k not in names and any(
            _plain(t) for t in tensors(v))]:
        del state[key]
    for key, (original, copied) in kept.items():
        if isinstance(original, torch.Tensor):
            _put_back(original, copied)
        elif isinstance(original, (dict, list, tuple)):
            contents, inner = copied
            for tensor, host in inner:
                _put_back(tensor, host)
            if isinstance(original, dict):
                original.clear()
                original.update(contents)
            elif isinstance(original, list):
                original[:] = contents
        state[key] = original


class SavedState:
    """Everything a trial may change: parameters (the model's, the optimizer's and those of
    ``modules``, e.g. a loss module), gradients, buffers, ``requires_grad`` and ``training``
    flags, optimizer state and hyper-parameters, GradScaler, RNG streams.

    Device tensors are copied to host memory; gradients leave their parameters for the trials
    (a training step starts without them), so trials measure what a real step needs.
    :meth:`restore` puts every value back bit for bit, into the same tensor objects where they
    still exist, gradients included (a gradient that was a view of a flat buffer is one again).
    """

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None = None,
        extras: tuple[Any, ...] = (),
        modules: tuple[torch.nn.Module, ...] = (),
        *,
        optimizers: tuple[torch.optim.Optimizer, ...] = (),
        params: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.model = model
        self.optimizers: list[torch.optim.Optimizer] = []
        for o in (optimizer, *optimizers):
            if o is not None and all(o is not k for k in self.optimizers):
                self.optimizers.append(o)
        self.module = _ModuleState()
        seen: set[int] = set()
        for owner in (*(() if model is None else (model,)), *modules):
            for module in owner.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                self.module.training.append((module, module.training))
                self.module.attributes.append((module, _save_attributes(module)))
                for name, buf in module._buffers.items():
                    self.module.buffers.append(
                        (module, name, buf, None if buf is None else _host_copy(buf))
                    )
        every: dict[int, torch.Tensor] = {}
        for owner in (*(() if model is None else (model,)), *modules):
            every.update((id(p), p) for p in owner.parameters())
        for o in self.optimizers:
            every.update((id(p), p) for g in o.param_groups for p in g["params"])
        every.update((id(p), p) for p in params)
        for param in every.values():
            self.module.tensors.append((param, _host_copy(param)))
            self.module.flags.append((param, param.requires_grad))
        self.params = list(every.values())
        self.grads = _Gradients(self.params)
        self.optimizer_states = [self._save_optimizer(o) for o in self.optimizers]
        generators = _generator_types()
        self.generators = [(g, _generator_state(g)) for g in extras if isinstance(g, generators)]
        self.extras = [(obj, self._save_object(obj)) for obj in extras
                       if not isinstance(obj, generators)]
        self.rng = save_rng_states(host=True)

    @staticmethod
    def _save_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state: dict[Any, dict[str, Any]] = {}
        for param, entries in optimizer.state.items():
            state[param] = {
                key: (value, _host_copy(value)) if isinstance(value, torch.Tensor)
                else (value, copy.deepcopy(value))
                for key, value in entries.items()
            }
        groups = [
            {k: (v, _host_copy(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
             for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups
        ]
        return {"state": state, "groups": groups, "count": len(optimizer.param_groups)}

    @staticmethod
    def _save_object(obj: Any) -> tuple[set[str], dict[str, tuple[Any, Any]]]:
        """Attributes of a small stateful object (a GradScaler, an LR scheduler): the names it
        had, and copies of its data attributes (tensors, numbers, strings and containers)."""
        data = (torch.Tensor, int, float, bool, str, type(None), dict, list, tuple)
        saved = {
            key: (value, _host_copy(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value))
            for key, value in vars(obj).items()
            if isinstance(value, data)
        }
        return set(vars(obj)), saved

    def restore(self) -> None:
        """Put everything back as it was when it was saved."""
        for module, training in self.module.training:
            module.training = training
        for param, flag in self.module.flags:
            param.requires_grad_(flag)
        self.rewind()
        for param in self.params:
            param.grad = None
        self.grads.put_back()
        for obj, attributes in self.extras:
            self._restore_object(obj, attributes)

    def rewind(self) -> None:
        """The values a training step changes as they were saved: parameters, buffers,
        optimizer state and the random streams (not the modes, flags and gradients the
        trials set): before each trial that replays a user's first steps, so that every
        trial starts where the user's loop does (where the weights decide shapes, as a
        router's choice of experts, a trial on weights trained by the one before would
        measure another step)."""
        for module, name, original, saved in self.module.buffers:
            if original is not None and saved is not None:
                _put_back(original, saved)
            module._buffers[name] = original
        for param, saved in self.module.tensors:
            _put_back(param, saved)
        self.put_back_attributes()
        for optimizer, entries in zip(self.optimizers, self.optimizer_states, strict=True):
            self._restore_optimizer(optimizer, entries)
        restore_rng_states(self.rng)
        for generator, state in self.generators:
            _put_generator_state(generator, state)

    def put_back_attributes(self) -> None:
        """The modules' own data attributes as saved (see :func:`_save_attributes`): before
        every trial, whose step must not read a hidden state another size left."""
        for module, attributes in self.module.attributes:
            _put_attributes(module, attributes)

    @staticmethod
    def _restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        optimizer.state.clear()
        for param, entries in saved["state"].items():
            restored: dict[str, Any] = {}
            _restore_entries(entries, restored)
            optimizer.state[param] = restored
        del optimizer.param_groups[saved["count"]:]
        for group, entries in zip(optimizer.param_groups, saved["groups"], strict=True):
            for key in [k for k in group if k != "params" and k not in entries]:
                del group[key]
            _restore_entries(entries, group)

    @staticmethod
    def _restore_object(obj: Any, saved: tuple[set[str], dict[str, tuple[Any, Any]]]) -> None:
        names, attributes = saved
        for key in [k for k in vars(obj) if k not in names]:
            delattr(obj, key)
        for key, (original, copied) in attributes.items():
            if isinstance(original, torch.Tensor):
                _put_back(original, copied)
                setattr(obj, key, original)
            else:
                setattr(obj, key, copy.deepcopy(copied))
