"""What the recovery side reads off torch and the user's code: who is writing (the engine's
own work, the user's source line, the module whose forward runs, torch.distributed), a
tensor's identity, metrics' state, optimizer hyperparameters, what a step refers to, and a
graph's leaves. The rules (:mod:`._rules`) judge what these tell."""

from __future__ import annotations

import inspect
import linecache
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

# Who is writing ---------------------------------------------------------------------------------

class _Busy(threading.local):
    """How deep this thread is in autobatch's own work (folding gradients, the deferred
    step): its operators are not the step's (a class default, so a new thread reads 0)."""

    depth = 0


_BUSY = _Busy()


@contextmanager
def engine_work() -> Iterator[None]:
    """Run autobatch's own operators unrecorded (on this thread)."""
    _BUSY.depth += 1
    try:
        yield
    finally:
        _BUSY.depth -= 1


def _engine_busy() -> bool:
    return _BUSY.depth > 0


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DISTRIBUTED_DIR = os.path.join(_TORCH_DIR, "distributed")
#: Where the sharding frameworks keep their own buffers (not the c10d API a step may call).
_FRAMEWORK_DIRS = tuple(
    os.path.join(_DISTRIBUTED_DIR, sub) for sub in ("fsdp", "_composable", "tensor")
)
_LIBRARY_DIRS = (_TORCH_DIR, _OWN_DIR, os.path.dirname(os.__file__))


def user_frame() -> str:
    """``file:line in function: code`` of the innermost frame outside torch, autobatch and the
    standard library (where a write came from), or ``"(inside torch)"``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_LIBRARY_DIRS) and not path.startswith("<frozen"):
            code = linecache.getline(path, frame.f_lineno).strip()
            where = f"{os.path.relpath(path) if not path.startswith('..') else path}:{frame.f_lineno}"
            return f"{where} in {frame.f_code.co_name}" + (f": {code}" if code else "")
        frame = frame.f_back
    return "(inside torch)"


_CALL_IMPL = nn.Module._call_impl.__code__


def _forward_module() -> nn.Module | None:
    """The innermost module whose ``__call__`` is on this thread's stack, if any (a write in
    a forward, or in a forward hook, of that module)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                return module
        frame = frame.f_back
    return None


def _from_distributed() -> bool:
    """Whether the innermost Python frame below this one that is not autobatch's belongs to a
    sharding framework of torch.distributed (FSDP2 writing its all-gathered parameters or its
    sharded gradients, DTensor its redistributions), not to the step's own code."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_FRAMEWORK_DIRS):
            return True
        if not path.startswith(_OWN_DIR) and not path.startswith(_TORCH_DIR):
            return False
        frame = frame.f_back
    return False


# The index of what existed before ----------------------------------------------------------


def _key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (views and ``.data`` share it)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # sparse, nested: the tensor itself
        return id(tensor)


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` itself is ``torch.compile``d (its forward runs compiled code)."""
    return type(module).__name__ == "OptimizedModule" or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


def _is_metric(module: nn.Module) -> bool:
    """A torchmetrics ``Metric`` (recognised by type, without importing torchmetrics)."""
    return any(
        c.__name__ == "Metric" and c.__module__.startswith("torchmetrics")
        for c in type(module).__mro__
    )


_METRIC_PRIVATE = ("_update_count", "_computed", "_forward_cache")


def _metric_state(metric: nn.Module) -> tuple[nn.Module, dict[str, Any], tuple[Any, ...]]:
    """A copy of a metric's state (the engine's own: no dispatch mode sees it)."""
    with engine_work(), torch.no_grad(), _disable_current_modes():
        states = {}
        for name in getattr(metric, "_defaults", {}):
            value = getattr(metric, name)
            states[name] = value.clone() if isinstance(value, torch.Tensor) else (
                list(value) if isinstance(value, list) else value
            )
    return metric, states, tuple(getattr(metric, n, None) for n in _METRIC_PRIVATE)


def _put_metric(saved: tuple[nn.Module, dict[str, Any], tuple[Any, ...]]) -> None:
    metric, states, private = saved
    with engine_work(), torch.no_grad():
        for name, value in states.items():
            current = getattr(metric, name)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) and (
                current.shape == value.shape
            ):
                current.copy_(value)
            else:
                setattr(metric, name, value.clone() if isinstance(value, torch.Tensor) else (
                    list(value) if isinstance(value, list) else value))
        for name, value in zip(_METRIC_PRIVATE, private, strict=True):
            if value is not None or hasattr(metric, name):
                setattr(metric, name, value)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def reachable(fn: Any, depth: int = 3) -> Iterator[tuple[str, Any]]:
    """Every value ``fn`` refers to, with a name for it: its bound ``self``, closure variables
    and globals, and through attributes, dicts and lists what they hold (``depth`` levels)."""
    if fn is None:
        return
    fn = inspect.unwrap(fn)
    roots: list[tuple[str, Any]] = []
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        roots.append(("self", owner))
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None) or ()
    if code is not None:
        for name, cell in zip(code.co_freevars, closure, strict=False):
            try:
                roots.append((name, cell.cell_contents))
            except ValueError:
                continue
        globals_ = getattr(fn, "__globals__", {})
        roots += [(n, globals_[n]) for n in code.co_names if n in globals_]
    seen: set[int] = set()
    stack = [(name, value, depth) for name, value in roots]
    while stack:
        name, value, left = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield name, value
        if left <= 0 or isinstance(value, (str, bytes, int, float, type, torch.Tensor)) or (
            callable(value) and not isinstance(value, nn.Module)
        ):
            continue
        items: Iterable[tuple[str, Any]]
        if isinstance(value, dict):
            items = ((f"{name}[{k!r}]", v) for k, v in list(value.items())[:256])
        elif isinstance(value, (list, tuple)):
            items = ((f"{name}[{i}]", v) for i, v in enumerate(value[:256]))
        else:
            attributes = getattr(value, "__dict__", None)
            if not isinstance(attributes, dict):
                continue
            items = ((f"{name}.{k}", v) for k, v in list(attributes.items())[:256])
        stack.extend((n, v, left - 1) for n, v in items)


def _search(fn: Any, key: int, depth: int = 3) -> str | None:
    """A name for the tensor with storage ``key`` among what ``fn`` refers to."""
    for name, value in reachable(fn, depth):
        if isinstance(value, torch.Tensor):
            if _key(value) == key:
                return name
        elif isinstance(value, nn.Module):
            for sub, t in (*value.named_parameters(), *value.named_buffers()):
                if t is not None and _key(t) == key:
                    return f"{name}.{sub}"
    return None


# Tensors and graphs ---------------------------------------------------------------------------


def gradient_hooks(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that carry a gradient hook of the user's (``register_hook``)."""
    return [p for p in params if getattr(p, "_backward_hooks", None)]


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory made outside every dispatch mode."""
    with _disable_current_modes():
        return tensor.detach().to("cpu", copy=True)


def leaves(roots: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors whose gradients a backward from ``roots`` accumulates."""
    found: dict[int, torch.Tensor] = {}
    stack: list[Any] = [
        t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.setdefault(id(variable), variable)
            continue
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return list(found.values())


