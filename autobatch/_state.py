"""Taking a training setup's state before trials, and putting it back bit for bit afterwards."""

from __future__ import annotations

import copy
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._backends import restore_rng_states, save_rng_states


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, made outside any dispatch mode (a simulated GPU
    must not count the copy: it stands for host memory)."""
    with _disable_current_modes():
        return tensor.detach().to("cpu", copy=True)


def _put_back(target: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(saved)


@dataclass
class _ModuleState:
    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list
    )
    grads: list[tuple[torch.Tensor, torch.Tensor | None, torch.device | None]] = field(
        default_factory=list
    )
    flags: list[tuple[torch.Tensor, bool]] = field(default_factory=list)
    training: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)


class Snapshot:
    """Everything a trial may change: parameters, gradients, buffers, ``requires_grad`` and
    ``training`` flags, optimizer state and hyper-parameters, GradScaler, RNG streams.

    Device tensors are copied to host memory; gradients are moved off the device for the
    duration (a training step starts without them), so trials measure what a real step needs.
    :meth:`restore` puts every value back bit for bit, into the same tensor objects where they
    still exist.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extras: tuple[Any, ...] = (),
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.module = _ModuleState()
        for module in model.modules():
            self.module.training.append((module, module.training))
            for name, buf in module._buffers.items():
                self.module.buffers.append(
                    (module, name, buf, None if buf is None else _host_copy(buf))
                )
        for param in model.parameters():
            self.module.tensors.append((param, _host_copy(param)))
            self.module.flags.append((param, param.requires_grad))
            grad = param.grad
            self.module.grads.append(
                (param, None if grad is None else _host_copy(grad), None if grad is None else grad.device)
            )
            param.grad = None
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
        for param, grad, device in state.grads:
            param.grad = None if grad is None or device is None else grad.to(device, copy=True)
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
