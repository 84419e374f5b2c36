"""Every replacement of a torch entry point, in one place.

torch offers no hook for a few things the recovery engine must do while a step runs, so it
stands in for these entry points, and nowhere else in the package is torch replaced:

=================================================  =============================================
entry point                                        why (checked against torch 2.1 to 2.13)
=================================================  =============================================
``torch.autograd.backward`` (``Tensor.backward``   weight a micro-batch's loss at its root; keep
calls it)                                          gradients carried from earlier calls apart
                                                   from a backward that may fail; find leaves
                                                   outside the known modules
``torch.amp.GradScaler.unscale_/step/update``      once per batch, in the last micro-batch
``step`` of each ``LRScheduler`` class that        once per batch; a scheduler not given is
defines one                                        refused before it steps
``torch.nn.utils.clip_grad.                        no gradient in an early micro-batch:
_group_tensors_by_device_and_dtype``               nothing to clip (torch fails on none)
``torch.Tensor.grad``                              an assignment by the step seen before it
                                                   happens
``torch.autograd.grad``                            a gradient differentiated again
                                                   (``create_graph=True``) in a micro-batch:
                                                   refused before anything is kept
=================================================  =============================================

Two groups, each installed by its first user and removed by its last, under one lock, in the
fixed order of the table (removed in the reverse order): :func:`backward_handler` (an attempt
that needs to see backward) and :func:`split_standins` (a batch that runs in micro-batches).
Nothing stays replaced once no step of the process needs it. Each stand-in routes a call to
the handlers of the **thread that makes it** and passes calls from every other thread to the
original, so that two decorated steps in two threads never see each other's work.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.utils.clip_grad as _clip_grad
import torch.optim.lr_scheduler as _lr_scheduler

#: ``handler(real, tensors, *args, **kwargs)``: runs a backward, calling ``real`` (the next
#: handler out, or torch's own) for the real work.
BackwardHandler = Callable[..., Any]


class Patch:
    """Replace an attribute of an object for a while (:meth:`undo` restores it exactly, once;
    the integrations replace their frameworks' methods with it too)."""

    def __init__(self, obj: object, name: str, replacement: Any) -> None:
        self.obj, self.name = obj, name
        self.had = name in vars(obj)
        self.previous = vars(obj).get(name)
        setattr(obj, name, replacement)
        self.active = True

    def undo(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.had:
            setattr(self.obj, self.name, self.previous)
        elif self.name in vars(self.obj):
            delattr(self.obj, self.name)


class _Routes(threading.local):
    """What the stand-ins call on this thread (class defaults: a new thread has none)."""

    backward: tuple[BackwardHandler, ...] = ()
    split: tuple[Any, ...] = ()  # the routes of the split batches running here, innermost last


_ROUTES = _Routes()
_LOCK = threading.Lock()


class _Group:
    """Stand-ins installed while at least one user (on any thread) needs them."""

    def __init__(self, install: Callable[[], list[Patch]]) -> None:
        self.install = install
        self.users = 0
        self.patches: list[Patch] = []

    def acquire(self) -> None:
        with _LOCK:
            self.users += 1
            if self.users == 1:
                self.patches = self.install()

    def release(self) -> None:
        with _LOCK:
            self.users -= 1
            if self.users == 0:
                for patch in reversed(self.patches):
                    patch.undo()
                self.patches = []


# torch.autograd.backward ----------------------------------------------------------------------


def _ours(standin: Any) -> Any:
    """Mark a stand-in as autobatch's (see :func:`replaced`)."""
    standin.autobatch_standin = True
    return standin


def _install_backward() -> list[Patch]:
    real = torch.autograd.backward
    return [Patch(torch.autograd, "backward", _ours(functools.partial(_backward, real)))]


def _backward(real: Callable[..., Any], tensors: Any, *args: Any, **kwargs: Any) -> Any:
    handlers = _ROUTES.backward
    if not handlers:  # (another thread's backward, or none of ours is running here)
        return real(tensors, *args, **kwargs)
    return _chain(real, handlers, len(handlers) - 1, tensors, *args, **kwargs)


def _chain(
    real: Callable[..., Any], handlers: tuple[BackwardHandler, ...], i: int, tensors: Any,
    *args: Any, **kwargs: Any,
) -> Any:
    if i < 0:
        return real(tensors, *args, **kwargs)
    return handlers[i](functools.partial(_chain, real, handlers, i - 1), tensors, *args, **kwargs)


_BACKWARD = _Group(_install_backward)


@contextlib.contextmanager
def backward_handler(handler: BackwardHandler) -> Iterator[None]:
    """Route this thread's calls of ``torch.autograd.backward`` through ``handler`` while the
    block runs (handlers nest: the innermost runs first)."""
    _BACKWARD.acquire()
    outer = _ROUTES.backward
    _ROUTES.backward = (*outer, handler)
    try:
        yield
    finally:
        _ROUTES.backward = outer
        _BACKWARD.release()


# A split batch's stand-ins -------------------------------------------------------------------


def _subclasses(cls: type) -> list[type]:
    found, stack = [], [cls]
    while stack:
        klass = stack.pop()
        found.append(klass)
        stack.extend(klass.__subclasses__())
    return found


def _install_split() -> list[Patch]:
    scaler = torch.amp.GradScaler
    patches = [
        Patch(scaler, name, _ours(_scaler_method(name, getattr(scaler, name))))
        for name in ("unscale_", "step", "update")
    ]
    for klass in _subclasses(_lr_scheduler.LRScheduler):
        if "step" in vars(klass):
            patches.append(Patch(klass, "step", _ours(_scheduler_step(vars(klass)["step"]))))
    grouping = getattr(_clip_grad, "_group_tensors_by_device_and_dtype")  # noqa: B009
    patches.append(Patch(_clip_grad, "_group_tensors_by_device_and_dtype",
                         _ours(functools.partial(_group_gradients, grouping))))
    patches.append(Patch(torch.Tensor, "grad", _GRAD))
    patches.append(Patch(torch.autograd, "grad", _ours(_autograd_grad(torch.autograd.grad))))
    return patches


_SPLIT = _Group(_install_split)


def running_split() -> Any:
    """The route of the split batch whose piece runs on this thread now, if any."""
    routes = _ROUTES.split
    if not routes:
        return None
    route = routes[-1]
    return route if route.running else None


def split_routes() -> tuple[Any, ...]:
    """The routes of the split batches open on this thread, innermost last."""
    return _ROUTES.split


@contextlib.contextmanager
def split_standins(route: Any) -> Iterator[None]:
    """Install the stand-ins of a split batch (once per process) and route this thread's
    calls to ``route`` while it runs a piece (``route.running``); ``route`` answers
    ``scaler_call``, ``scheduler_call``, ``stepping_scheduler``, ``grad_assigned`` and
    ``grad_cleared``."""
    _SPLIT.acquire()
    _ROUTES.split = (*_ROUTES.split, route)
    try:
        yield
    finally:
        _ROUTES.split = tuple(r for r in _ROUTES.split if r is not route)
        _SPLIT.release()


def _scaler_method(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def deferred(scaler: Any, *args: Any, **kwargs: Any) -> Any:
        route = running_split()
        if route is None:
            return real(scaler, *args, **kwargs)
        return route.scaler_call(name, real, scaler, args, kwargs)

    return deferred


def _scheduler_step(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        route = running_split()
        if route is None or route.stepping_scheduler:
            return real(scheduler, *args, **kwargs)
        return route.scheduler_call(real, scheduler, args, kwargs)

    return step


def _autograd_grad(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def grad(*args: Any, **kwargs: Any) -> Any:
        route = running_split()
        # (grad(outputs, inputs, grad_outputs, retain_graph, create_graph, ...))
        if route is not None and (kwargs.get("create_graph") or (len(args) > 4 and args[4])):
            route.differentiates_gradients("torch.autograd.grad(..., create_graph=True)")
        return real(*args, **kwargs)

    return grad


def _group_gradients(real: Callable[..., Any], tensorlistlist: Any, *args: Any, **kwargs: Any) -> Any:
    if running_split() is not None and all(not lst for lst in tensorlistlist):
        return {}  # no gradient in an early piece: nothing to clip (torch fails on empty lists)
    return real(tensorlistlist, *args, **kwargs)


_TENSOR_GRAD: Any = torch._C.TensorBase.__dict__["grad"]


def _get_grad(tensor: torch.Tensor) -> torch.Tensor | None:
    return _TENSOR_GRAD.__get__(tensor)  # type: ignore[no-any-return]


def _set_grad(tensor: torch.Tensor, value: torch.Tensor | None) -> None:
    route = running_split()
    if route is not None:
        if value is None:
            route.grad_cleared(tensor)
        else:
            route.grad_assigned(tensor)
    _TENSOR_GRAD.__set__(tensor, value)


def _del_grad(tensor: torch.Tensor) -> None:
    _TENSOR_GRAD.__delete__(tensor)


#: ``Tensor.grad`` while a split batch runs: an assignment by the step is seen before it happens.
_GRAD = property(_get_grad, _set_grad, _del_grad, _TENSOR_GRAD.__doc__)


def replaced() -> list[str]:
    """The entry points replaced by autobatch now (for tests: none once no step needs them)."""
    found: dict[str, Any] = {
        "torch.autograd.backward": torch.autograd.backward,
        "torch.Tensor.grad": vars(torch.Tensor).get("grad"),
        "clip_grad._group_tensors_by_device_and_dtype": vars(_clip_grad).get(
            "_group_tensors_by_device_and_dtype"),
    }
    for name in ("unscale_", "step", "update"):
        found[f"GradScaler.{name}"] = vars(torch.amp.GradScaler).get(name)
    for klass in _subclasses(_lr_scheduler.LRScheduler):
        found[f"{klass.__qualname__}.step"] = vars(klass).get("step")
    return [
        name for name, value in found.items()
        if value is _GRAD or getattr(value, "autobatch_standin", False)
    ]
