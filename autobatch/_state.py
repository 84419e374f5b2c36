"""Taking a training setup's state before trials, and putting it back bit for bit afterwards."""

from __future__ import annotations

import copy
import inspect
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._backends import restore_rng_states, save_rng_states


def modules_referenced(*objects: Any) -> list[torch.nn.Module]:
    """Modules among ``objects`` and among the names their code refers to (globals and
    closure variables of functions): a loss module, or the modules a step function uses."""
    found: dict[int, torch.nn.Module] = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            found[id(obj)] = obj
            continue
        if not callable(obj):
            continue
        try:
            names = inspect.getclosurevars(inspect.unwrap(obj))
        except (TypeError, ValueError):
            continue
        for value in (*names.nonlocals.values(), *names.globals.values()):
            if isinstance(value, torch.nn.Module):
                found[id(value)] = value
    return list(found.values())


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, made outside any dispatch mode (a simulated GPU
    must not count the copy: it stands for host memory)."""
    with _disable_current_modes():
        return tensor.detach().to("cpu", copy=True)


def _put_back(target: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(saved)


@dataclass
class _Grad:
    """A gradient kept as the same tensor object across the trials.

    A gradient that is the only user of its storage gives that storage up for the trials (a
    training step starts without gradients) and gets a new one with the same bytes back; one
    that shares its storage (a view of a flat buffer, DDP's bucket views) keeps it, since the
    buffer lives on through training anyway."""

    param: torch.Tensor
    grad: torch.Tensor
    saved: torch.Tensor  # host copy of the storage's bytes
    freed: bool
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def take(cls, param: torch.Tensor) -> _Grad | None:
        grad = param.grad
        if grad is None:
            return None
        if grad.layout != torch.strided:  # a sparse gradient: set aside as it is
            param.grad = None
            return cls(param, grad, torch.empty(0), False, 0, (), ())
        storage = grad.untyped_storage()
        with _disable_current_modes():
            raw = torch.empty(0, dtype=torch.uint8, device=grad.device).set_(storage)
            saved = raw.to("cpu", copy=True)
        del raw
        kept = cls(param, grad, saved, False, int(grad.storage_offset()), tuple(grad.shape),
                   tuple(grad.stride()))
        param.grad = None
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        sole = use_count is not None and use_count(storage._cdata) <= 2  # grad and `storage`
        del storage
        if sole:
            with torch.no_grad():
                grad.set_(torch.empty(0, dtype=grad.dtype, device=grad.device).untyped_storage())
            kept.freed = True
        return kept

    def put_back(self) -> None:
        grad = self.grad
        with torch.no_grad():
            if self.freed:
                raw = torch.empty(self.saved.numel(), dtype=torch.uint8, device=grad.device)
                raw.copy_(self.saved)
                grad.set_(raw.untyped_storage(), self.offset, self.size, self.stride)
                del raw
                self.freed = False
            elif grad.layout == torch.strided:
                raw = torch.empty(0, dtype=torch.uint8, device=grad.device).set_(
                    grad.untyped_storage()
                )
                raw.copy_(self.saved)
        self.param.grad = grad


@dataclass
class _ModuleState:
    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list
    )
    grads: list[_Grad] = field(default_factory=list)
    flags: list[tuple[torch.Tensor, bool]] = field(default_factory=list)
    training: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)


class Snapshot:
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
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extras: tuple[Any, ...] = (),
        modules: tuple[torch.nn.Module, ...] = (),
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.module = _ModuleState()
        seen: set[int] = set()
        for owner in (model, *modules):
            for module in owner.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                self.module.training.append((module, module.training))
                for name, buf in module._buffers.items():
                    self.module.buffers.append(
                        (module, name, buf, None if buf is None else _host_copy(buf))
                    )
        params: dict[int, torch.Tensor] = {}
        for owner in (model, *modules):
            params.update((id(p), p) for p in owner.parameters())
        if optimizer is not None:
            params.update((id(p), p) for g in optimizer.param_groups for p in g["params"])
        for param in params.values():
            self.module.tensors.append((param, _host_copy(param)))
            self.module.flags.append((param, param.requires_grad))
            kept = _Grad.take(param)
            if kept is not None:
                self.module.grads.append(kept)
        self.params = list(params.values())
        self.optimizer_state = self._save_optimizer(optimizer) if optimizer is not None else None
        self.extras = [(obj, self._save_object(obj)) for obj in extras]
        self.rng = save_rng_states()
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None

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
        """Put everything back as it was when the snapshot was taken."""
        state = self.module
        for module, training in state.training:
            module.training = training
        for module, name, original, saved in state.buffers:
            if original is not None and saved is not None:
                _put_back(original, saved)
            module._buffers[name] = original
        for param, saved in state.tensors:
            _put_back(param, saved)
        for param, flag in state.flags:
            param.requires_grad_(flag)
        for param in self.params:
            param.grad = None
        for kept in state.grads:
            kept.put_back()
        if self.optimizer is not None and self.optimizer_state is not None:
            self._restore_optimizer(self.optimizer, self.optimizer_state)
        for obj, attributes in self.extras:
            self._restore_object(obj, attributes)
        restore_rng_states(self.rng)
        random.setstate(self.python_rng)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy_rng is not None:
            numpy.random.set_state(self.numpy_rng)

    @staticmethod
    def _restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        optimizer.state.clear()
        for param, entries in saved["state"].items():
            restored: dict[str, Any] = {}
            for key, (original, copied) in entries.items():
                if isinstance(original, torch.Tensor):
                    _put_back(original, copied)
                    restored[key] = original
                else:
                    restored[key] = copy.deepcopy(copied)
            optimizer.state[param] = restored
        del optimizer.param_groups[saved["count"]:]
        for group, entries in zip(optimizer.param_groups, saved["groups"], strict=True):
            for key in [k for k in group if k != "params" and k not in entries]:
                del group[key]
            for key, (original, copied) in entries.items():
                if isinstance(original, torch.Tensor):
                    _put_back(original, copied)
                    group[key] = original
                else:
                    group[key] = copy.deepcopy(copied)

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
