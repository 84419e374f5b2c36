"""The state ``check_split`` compares: everything a step may change (the modules, the
optimizers, the schedulers and the objects named), saved, loaded, captured by name, and
converted to a dtype for the check and back."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._batch import Batch
from autobatch._memory._backends import restore_rng_states, save_rng_states
from autobatch._recovery._arguments import _modules_of
from autobatch._recovery._options import RecoveryOptions
from autobatch._sizing._state import SavedState


class World:
    """Everything a step may change: modules (the model, those its code names, those among the
    objects), optimizers, schedulers, and the objects; saved, loaded, captured, converted."""

    def __init__(self, step: Callable[..., Any], options: RecoveryOptions, objects: Any) -> None:
        modules = dict(_modules_of(step))
        if options.model is not None:
            modules = {"model": options.model, **modules}
        owner = getattr(step, "__self__", None)
        if isinstance(owner, nn.Module):
            modules.setdefault("self", owner)
        elif owner is not None:
            for key, value in vars(owner).items():
                if isinstance(value, nn.Module):
                    modules.setdefault(f"self.{key}", value)
        self.objects = list(objects)
        for i, obj in enumerate(self.objects):
            if isinstance(obj, nn.Module):
                modules.setdefault(f"objects[{i}]", obj)
        seen: set[int] = set()
        self.modules = []
        for name, module in modules.items():
            if id(module) not in seen:
                seen.add(id(module))
                self.modules.append((name, module))
        self.optimizers = options.optimizers
        self.schedulers = options.schedulers
        in_modules = {id(p) for _, m in self.modules for p in m.parameters()}
        self.loose = [  # leaves that learn outside the modules (a temperature among objects)
            (name, t) for i, obj in enumerate(self.objects)
            for name, t in _flatten_leaves(obj, f"objects[{i}]")
            if id(t) not in in_modules
        ]
        shared: list[Any] = [m for _, top in self.modules for m in top.modules()]
        shared += [*self.optimizers, *self.schedulers, *self.params()]
        shared += [b for _, top in self.modules for b in top.buffers()]
        self.shared = {id(x): x for x in shared}  # kept by reference when objects are copied
        self.norms: list[nn.Module] = [
            m for _, top in self.modules for m in top.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
        ]

    def params(self) -> list[torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        for _, module in self.modules:
            found.update((id(p), p) for p in module.parameters())
        found.update((id(p), p) for _, p in self.loose)
        for optimizer in self.optimizers:
            found.update((id(p), p) for g in optimizer.param_groups for p in g["params"])
        return list(found.values())

    def buffers(self) -> list[torch.Tensor]:
        return [b for _, module in self.modules for b in module.buffers()]

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor, str]]:
        """(name, tensor, kind) of every parameter and buffer (kind "parameter"/"buffer")."""
        for name, p in self.loose:
            yield name, p, "parameter"
        for prefix, module in self.modules:
            for name, p in module.named_parameters():
                yield f"{prefix}.{name}", p, "parameter"
            for name, b in module.named_buffers():
                yield f"{prefix}.{name}", b, "buffer"

    @contextmanager
    def converted(self, dtype: torch.dtype | None) -> Iterator[torch.dtype | None]:
        """Everything in ``dtype`` for the check, and exactly as it was afterwards."""
        originals = [(t, t.data, None if t.grad is None else t.grad) for _, t, _ in self._tensors()]
        states = [copy.deepcopy(o.state_dict()) for o in self.optimizers]
        schedulers = [copy.deepcopy(s.state_dict()) for s in self.schedulers]
        objects = [_save_object(o, self.shared) for o in self.objects]
        rng = save_rng_states()
        swapped: list[Callable[[], None]] = []  # tensors the objects hold, put back at the end
        try:
            if dtype is not None:
                with torch.no_grad():
                    for t, data, grad in originals:
                        if data.is_floating_point():
                            t.data = data.to(dtype)
                            if grad is not None:
                                t.grad = grad.to(dtype)
                for optimizer, state in zip(self.optimizers, states, strict=True):
                    optimizer.load_state_dict(state)  # (state cast to the parameters' dtype)
                for obj in self.objects:
                    _cast_held(obj, dtype, self.shared, swapped)
            yield dtype
        finally:
            for undo in reversed(swapped):
                undo()
            with torch.no_grad():
                for t, data, grad in originals:
                    t.data = data
                    t.grad = grad
            for optimizer, state in zip(self.optimizers, states, strict=True):
                optimizer.load_state_dict(state)
            for scheduler, saved in zip(self.schedulers, schedulers, strict=True):
                scheduler.load_state_dict(saved)
            for obj, saved in zip(self.objects, objects, strict=True):
                _load_object(obj, saved, self.shared)
            restore_rng_states(rng)

    def save(self) -> tuple[SavedState, list[Any], list[Any]]:
        """Everything as it is now: the modules and optimizers in the finder's saved state
        (:class:`autobatch._sizing._state.SavedState`, which also holds the RNG streams), the
        schedulers' and the objects' states beside it."""
        modules = [m for _, m in self.modules]
        kept = SavedState(None, modules=tuple(modules), optimizers=self.optimizers,
                          params=tuple(t for _, t in self.loose))
        kept.restore()  # (it takes the gradients aside, for a trial: they stay here)
        with torch.no_grad(), _disable_current_modes():
            return (
                kept,
                [copy.deepcopy(s.state_dict()) for s in self.schedulers],
                [_save_object(o, self.shared) for o in self.objects],
            )

    def load(self, saved: tuple[SavedState, list[Any], list[Any]]) -> None:
        kept, schedulers, objects = saved
        kept.restore()
        with torch.no_grad(), _disable_current_modes():
            for scheduler, state in zip(self.schedulers, schedulers, strict=True):
                scheduler.load_state_dict(copy.deepcopy(state))
            for obj, state in zip(self.objects, objects, strict=True):
                _load_object(obj, state, self.shared)

    def capture(self, result: Any) -> dict[str, Any]:
        """Every value compared, by a readable name."""
        out: dict[str, Any] = {}
        with torch.no_grad(), _disable_current_modes():
            for name, t, kind in self._tensors():
                out[f"{kind} {name}"] = t.detach().clone()
                if kind == "parameter":
                    out[f"gradient {name}.grad"] = None if t.grad is None else t.grad.clone()
            for i, optimizer in enumerate(self.optimizers):
                label = f"optimizer {i} ({type(optimizer).__name__})"
                state = optimizer.state_dict()
                for pid, entries in state["state"].items():
                    for key, value in entries.items():
                        out[f"{label} state[{pid}][{key!r}]"] = _value(value)
                for g, group in enumerate(state["param_groups"]):
                    for key, value in group.items():
                        if key != "params":
                            out[f"{label} param_groups[{g}][{key!r}]"] = _value(value)
            for i, scheduler in enumerate(self.schedulers):
                for key, value in scheduler.state_dict().items():
                    out[f"scheduler {i} ({type(scheduler).__name__}) {key}"] = _value(value)
            for i, obj in enumerate(self.objects):
                for key, value in _flatten(obj, f"objects[{i}]"):
                    out[key] = value
            for key, value in _flatten(result, "result"):
                out[key] = value
        return out

    @contextmanager
    def ghost_batchnorm(self, sizes: list[int]) -> Iterator[None]:
        """Each BatchNorm layer in training mode normalises the micro-batches ``sizes`` apart."""
        if len(sizes) < 2 or not self.norms:
            yield
            return
        with ExitStack() as stack:
            for norm in self.norms:
                real = norm.forward

                def forward(x: torch.Tensor, real: Any = real) -> torch.Tensor:
                    if x.dim() == 0 or x.shape[0] != sum(sizes):
                        return real(x)  # type: ignore[no-any-return]
                    return torch.cat([real(part) for part in x.split(sizes)])

                norm.forward = forward
                stack.callback(norm.__dict__.pop, "forward", None)
            yield


def _flatten_leaves(obj: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors that learn (leaves requiring gradients) an object holds, by name."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and obj.grad_fn is None:
            yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flatten_leaves(value, f"{name}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flatten_leaves(value, f"{name}[{i}]")


def _value(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _flatten(obj: Any, name: str, depth: int = 4) -> Iterator[tuple[str, Any]]:
    """The values of an object, by name: tensors, numbers, and what containers and objects hold."""
    if isinstance(obj, torch.Tensor):
        yield name, obj.detach().clone()
    elif isinstance(obj, (int, float, bool, str)) or obj is None:
        yield name, obj
    elif depth <= 0:
        return
    elif isinstance(obj, nn.Module):
        for key, t in (*obj.named_parameters(), *obj.named_buffers()):
            yield f"{name}.{key}", t.detach().clone()
        for key in getattr(obj, "_defaults", {}):  # a torchmetrics metric's states
            yield from _flatten(getattr(obj, key), f"{name}.{key}", depth - 1)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flatten(value, f"{name}[{key!r}]", depth - 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flatten(value, f"{name}[{i}]", depth - 1)
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):
        yield from _flatten(obj.state_dict(), f"{name}.state_dict()", depth - 1)
    elif hasattr(obj, "__dict__"):
        for key, value in vars(obj).items():
            if not key.startswith("__") and not callable(value):
                yield from _flatten(value, f"{name}.{key}", depth - 1)


def _save_object(obj: Any, shared: dict[int, Any]) -> Any:
    """A copy of what ``obj`` holds; what the world shares (modules, optimizers, parameters)
    is kept by reference, not copied."""
    with torch.no_grad(), _disable_current_modes():
        if isinstance(obj, nn.Module):
            return copy.deepcopy(obj.state_dict()), [
                (key, copy.deepcopy(getattr(obj, key), dict(shared)))
                for key in getattr(obj, "_defaults", {})
            ]
        if isinstance(obj, torch.Tensor):
            return obj.detach().clone()
        if isinstance(obj, (dict, list)):
            return copy.deepcopy(obj, dict(shared))
        if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            return copy.deepcopy(obj.state_dict())
        return copy.deepcopy(vars(obj), dict(shared)) if hasattr(obj, "__dict__") else None


def _load_object(obj: Any, saved: Any, shared: dict[int, Any]) -> None:
    """Put back what :func:`_save_object` copied, into the same objects where they exist."""
    with torch.no_grad(), _disable_current_modes():
        if isinstance(obj, nn.Module):
            state, metric = saved
            obj.load_state_dict(state)
            for key, value in metric:
                setattr(obj, key, _refilled(getattr(obj, key, None), value, shared))
        elif isinstance(obj, torch.Tensor):
            obj.copy_(saved)
        elif isinstance(obj, (dict, list)):
            _refilled(obj, saved, shared)
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(copy.deepcopy(saved))
        elif saved is not None:
            _refilled(vars(obj), saved, shared)


def _refilled(current: Any, saved: Any, shared: dict[int, Any]) -> Any:
    """``saved`` put into ``current`` in place where they have the same shape (tensors copied
    into, dicts and lists refilled), else a copy of ``saved``; returns what now holds it."""
    if id(saved) in shared:
        return saved
    if isinstance(saved, torch.Tensor) and isinstance(current, torch.Tensor) and (
        current.shape == saved.shape and current.dtype == saved.dtype
    ):
        current.copy_(saved)
        return current
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in [k for k in current if k not in saved]:
            del current[key]
        for key, value in saved.items():
            current[key] = _refilled(current.get(key), value, shared)
        return current
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        current[:] = [_refilled(c, v, shared) for c, v in zip(current, saved, strict=True)]
        return current
    return copy.deepcopy(saved, dict(shared))


def _cast_held(
    obj: Any, dtype: torch.dtype, shared: dict[int, Any], swapped: list[Callable[[], None]],
    depth: int = 3,
) -> None:
    """The floating tensors an object holds (in dicts, lists and attributes; not those of the
    modules, which are converted with them) replaced by copies in ``dtype``; ``swapped`` gets
    what puts the originals back."""
    if depth <= 0 or id(obj) in shared or isinstance(obj, (nn.Module, torch.Tensor)):
        return
    if hasattr(obj, "state_dict") and not isinstance(obj, (dict, list)):
        return  # (a scaler, a scheduler: their own state, in their own dtype)
    entries: Any
    if isinstance(obj, dict):
        entries = obj
    elif isinstance(obj, list):
        entries = dict(enumerate(obj))
    elif hasattr(obj, "__dict__"):
        entries = vars(obj)
    else:
        return
    for key, value in list(entries.items()):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and (
            id(value) not in shared and value.dtype != dtype
        ):
            holder = obj if isinstance(obj, (dict, list)) else vars(obj)
            holder[key] = value.detach().to(dtype)
            swapped.append(functools.partial(holder.__setitem__, key, value))
        else:
            _cast_held(value, dtype, shared, swapped, depth - 1)


def cast_batch(batch: Batch, dtype: torch.dtype | None) -> Batch:
    if dtype is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return type(batch)({k: cast_batch(v, dtype) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(cast_batch(v, dtype) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(cast_batch(v, dtype) for v in batch)
    return batch


