"""``check_split``: is a step exact when autobatch splits its batch? One line in a test suite.

The step runs unsplit, as the truth, and then once per OOM schedule (:data:`SCHEDULES`)
decorated with :func:`~autobatch.retry_on_oom`, with out-of-memory errors injected where the
schedule says, so that its batch is split, fails in a piece and is replayed. Every run starts
from the same state, in float64 (or a given dtype); afterwards every difference from the
truth is reported: parameters, gradients, buffers, optimizer and scheduler state, the
objects named, the step's result. A refused step is reported with its refusal, and with
whether the state was left as it was before the call. Everything is put back as it was
(values, dtypes, RNG) when the check ends.

BatchNorm layers in training mode normalise each micro-batch by its own statistics: the
truth for them is the unsplit step with each BatchNorm layer run on the same pieces the
split run used, in order ("ghost" batch norm), so that what is compared is the replay, not
batch norm's definition. Dropout is switched off during the check (its masks are drawn per
micro-batch), and the report says so.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._accounting import DispatchMode, call_keeping_versions
from autobatch._backends import restore_rng_states, save_rng_states
from autobatch._batch import Batch, batch_size, tensors
from autobatch._errors import AutobatchError
from autobatch._recovery import _accumulate
from autobatch._recovery._arguments import _modules_of
from autobatch._recovery._decorator import retry_on_oom
from autobatch._recovery._options import RecoveryOptions

#: The OOM schedules, by name: what fails where. Every schedule but the ``fast_`` ones fails
#: the step's first call on its whole batch in forward, so that it splits; the ``fast_`` ones
#: run a clean call first, so that the OOM comes on the fast path.
SCHEDULES: dict[str, str] = {
    "forward": "the whole batch runs out of memory in forward, then runs in micro-batches",
    "backward": "then the first micro-batch runs out in backward, after a gradient was folded",
    "backward_last": "then the last micro-batch runs out in backward, after a gradient was folded",
    "optimizer": "then the optimizer's first step runs out of memory as it begins",
    "fast_forward": "after a clean call, the whole batch runs out of memory in forward",
    "fast_backward": "after a clean call, the whole batch runs out of memory in backward",
}


@dataclass(frozen=True)
class Difference:
    """One value that differs from the truth (or from the state before a refused call)."""

    what: str
    detail: str

    def __str__(self) -> str:
        return f"{self.what}: {self.detail}"


@dataclass(frozen=True)
class ScheduleResult:
    """What one OOM schedule gave: ``fired``, whether its OOMs happened at all; ``refusal``,
    the :class:`~autobatch.AutobatchError` message if the step was refused; ``differences``
    from the truth (from the state before the call, for a refusal)."""

    name: str
    fired: bool
    refusal: str | None
    differences: tuple[Difference, ...]

    @property
    def exact(self) -> bool:
        return self.refusal is None and not self.differences


@dataclass(frozen=True)
class SplitReport:
    """The result of :func:`check_split`: true when every schedule ran and matched the truth.

    >>> import torch
    >>> from autobatch.testing import check_split
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> def step(x):
    ...     opt.zero_grad()
    ...     model(x).square().mean().backward()
    ...     opt.step()
    >>> report = check_split(step, torch.randn(8, 4), optimizer=opt, model=model)
    >>> bool(report), report.refusal
    (True, None)
    """

    schedules: tuple[ScheduleResult, ...]
    notes: tuple[str, ...]

    @property
    def exact(self) -> bool:
        return all(s.exact for s in self.schedules if s.fired) and any(
            s.fired for s in self.schedules
        )

    @property
    def refusal(self) -> str | None:
        """The refusal autobatch gives this step, if any."""
        return next((s.refusal for s in self.schedules if s.refusal is not None), None)

    @property
    def differences(self) -> list[str]:
        return [f"[{s.name}] {d}" for s in self.schedules for d in s.differences]

    def __bool__(self) -> bool:
        return self.exact

    def __str__(self) -> str:
        lines = ["exact when split" if self.exact else "NOT exact when split"]
        for s in self.schedules:
            if not s.fired:
                state = "not exercised (the step never reached that point)"
            elif s.refusal is not None:
                kept = "state unchanged" if not s.differences else "STATE CHANGED"
                state = f"refused ({kept}): {s.refusal}"
            else:
                state = "exact" if not s.differences else f"{len(s.differences)} difference(s)"
            lines.append(f"  {s.name}: {state}")
            lines += [f"    {d}" for d in s.differences[:12]]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__

    def assert_exact(self) -> None:
        """Raise ``AssertionError`` with the report unless the step is exact when split."""
        if not self.exact:
            raise AssertionError(str(self))


def check_split(
    step: Callable[..., Any],
    batch: Batch,
    *,
    optimizer: Any = None,
    model: nn.Module | None = None,
    scheduler: Any = None,
    objects: tuple[Any, ...] | list[Any] = (),
    before: tuple[Batch, ...] | list[Batch] = (),
    dtype: torch.dtype | None = torch.float64,
    schedules: tuple[str, ...] | list[str] | None = None,
    rtol: float = 1e-9,
    **options: Any,
) -> SplitReport:
    """Run ``step`` on ``batch`` unsplit and split by injected OOMs, and report every difference.

    ``step`` is the undecorated step function (it calls the optimizer itself); the options
    (``optimizer=``, ``scheduler=``, ``items=``, ...) are those of
    :func:`~autobatch.retry_on_oom`. See :class:`SplitReport` for an example.

    Args:
        step: the step function, as it would be decorated.
        batch: a batch of at least two rows.
        optimizer: the optimizer(s) the step calls.
        model: the model the step trains (its modules' state is compared).
        scheduler: the LR scheduler(s) the step steps.
        objects: anything else whose state the step changes and that should be compared: an
            EMA model, a dict of tensors, a metric, an object with tensors or counters.
        before: batches the step runs (whole) before the checked call in every run, to reach
            the state to check from: the earlier calls of an accumulation window, say.
        dtype: the floating dtype the check runs in (``None``: as they are).
        schedules: which of :data:`SCHEDULES` to run (default: all).
        rtol: the relative tolerance of a match (the absolute one is ``rtol`` times the
            largest magnitude of the value).
        options: further options of :func:`~autobatch.retry_on_oom`.
    """
    chosen = tuple(SCHEDULES if schedules is None else schedules)
    unknown = [s for s in chosen if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"schedules {unknown} are not among {sorted(SCHEDULES)}")
    total = batch_size(batch)
    if total < 2:
        raise ValueError(f"check_split needs a batch of at least 2 rows to split, got {total}")
    decorate = functools.partial(
        retry_on_oom, optimizer=optimizer, model=model, scheduler=scheduler, **options
    )
    given = RecoveryOptions(optimizer=optimizer, model=model, scheduler=scheduler,
                            **{k: v for k, v in options.items() if k != "policy"},
                            policy=options.get("policy", "accumulate"))
    world = _World(step, given, objects)
    notes: list[str] = []
    results: list[ScheduleResult] = []
    with world.converted(dtype), _no_dropout(notes):
        data = _cast(batch, dtype)
        earlier = [_cast(b, dtype) for b in before]
        start = world.save()
        stateful = any(o.state for o in given.optimizers)
        for name in chosen:
            if name == "optimizer" and stateful:
                notes.append("optimizer: skipped, the optimizer has state already (an OOM "
                             "inside a later step is refused by design)")
                continue
            results.append(_run_schedule(
                name, step, data, earlier, total, world, start, decorate, rtol
            ))
        world.load(start)
    if world.norms:
        notes.append(f"{len(world.norms)} BatchNorm layer(s) in training mode: compared with "
                     "the unsplit step normalising the same micro-batches")
    return SplitReport(tuple(results), tuple(notes))


def _run_schedule(
    name: str, step: Callable[..., Any], batch: Batch, earlier: list[Batch], total: int,
    world: _World,
    start: dict[str, Any], decorate: Callable[..., Any], rtol: float,
) -> ScheduleResult:
    fast = name.startswith("fast_")
    # The split run, its micro-batches recorded.
    world.load(start)
    pieces: list[tuple[int, bool]] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        rows = batch_size(args[0]) if args else 0
        try:
            out = step(*args, **kwargs)
        except BaseException:
            pieces.append((rows, False))
            raise
        pieces.append((rows, True))
        return out

    functools.update_wrapper(recorded, step)
    decorated = decorate(recorded)
    refusal: str | None = None
    fault = _Faults(name, total, world.params(), world.buffers())
    result: Any = None
    for done in earlier or ([batch] if fast else []):
        decorated(done)  # clean calls first (one, at least, for the OOM on the fast path)
    pieces.clear()
    before = world.capture(None)
    try:
        with fault:
            result = decorated(batch)
    except AutobatchError as error:
        refusal = str(error)
    after = world.capture(result)
    if not fault.fired:
        return ScheduleResult(name, False, refusal, ())
    if refusal is not None:  # (a gradient the step set to None itself, by zero_grad, stays so)
        dropped = [k for k, v in after.items() if k.startswith("gradient ") and v is None]
        for key in dropped:
            after[key] = before.get(key)
        return ScheduleResult(name, True, refusal, tuple(_compare(before, after, 0.0)))
    # The truth: the unsplit step (each BatchNorm layer on the same pieces, in order).
    world.load(start)
    for done in earlier or ([batch] if fast else []):
        step(done)
    with world.ghost_batchnorm(_final_pieces(pieces, total)):
        truth_result = step(batch)
    truth = world.capture(truth_result)
    return ScheduleResult(name, True, None, tuple(_compare(truth, after, rtol)))


def _final_pieces(pieces: list[tuple[int, bool]], total: int) -> list[int]:
    """The sizes of the micro-batches that made the batch: the last run of successful calls
    that covers it (a restart makes the calls before it not count)."""
    sizes: list[int] = []
    for rows, ok in reversed(pieces):
        if not ok:
            continue
        sizes.append(rows)
        if sum(sizes) >= total:
            break
    return list(reversed(sizes)) if sum(sizes) == total else [total]


class _Faults(DispatchMode):
    """Raises CUDA's out-of-memory error where an OOM schedule says (see :data:`SCHEDULES`)."""

    def __init__(
        self, schedule: str, total: int, params: list[torch.Tensor], buffers: list[torch.Tensor]
    ) -> None:
        super().__init__()
        self.schedule = schedule
        self.total = total
        self.params = params
        self.fired = 0
        self.state = {_storage(t) for t in (*params, *buffers)}  # (never the batch's)
        self.whole_done = False  # the whole batch failed (or, fast, ran): now in pieces
        self.armed = False
        self.handles: list[Any] = []
        self.in_step = 0

    def __enter__(self) -> _Faults:
        for p in self.params:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        self.handles.append(register_optimizer_step_pre_hook(self._step))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for handle in self.handles:
            handle.remove()

    def _accumulated(self, _: torch.Tensor) -> None:
        if self.schedule in ("backward", "backward_last", "fast_backward"):
            session = _accumulate._session()
            if self.schedule == "fast_backward":
                self.armed = session is None and not self.fired
            elif session is not None and session.last == (self.schedule == "backward_last"):
                self.armed = not self.fired and self.whole_done

    def _step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.schedule == "optimizer" and not optimizer.state and self.whole_done:
            self.armed = not self.fired

    def _raise(self) -> None:
        self.fired += 1
        self.armed = False
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 MiB (injected by check_split)"
        )

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.armed:
            self._raise()
        if not self.whole_done and torch._C._current_autograd_node() is None and any(
            t.dim() > 0 and t.shape[0] == self.total and _storage(t) not in self.state
            for t in tensors((args, kwargs)) if isinstance(t, torch.Tensor)
        ):
            self.whole_done = True
            if self.schedule != "fast_backward":
                self._raise()
        return call_keeping_versions(func, args, kwargs)


def _storage(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return id(tensor)


# The state compared --------------------------------------------------------------------------


class _World:
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

    def save(self) -> dict[str, Any]:
        with torch.no_grad(), _disable_current_modes():
            return {
                "tensors": [(t, t.detach().clone(), None if t.grad is None else t.grad.clone(),
                             t.requires_grad) for _, t, _ in self._tensors()],
                "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
                "schedulers": [copy.deepcopy(s.state_dict()) for s in self.schedulers],
                "objects": [_save_object(o, self.shared) for o in self.objects],
                "rng": save_rng_states(),
            }

    def load(self, saved: dict[str, Any]) -> None:
        with torch.no_grad(), _disable_current_modes():
            for t, value, grad, _ in saved["tensors"]:
                t.copy_(value)
                t.grad = None if grad is None else grad.clone()
            for optimizer, state in zip(self.optimizers, saved["optimizers"], strict=True):
                optimizer.state.clear()
                optimizer.load_state_dict(copy.deepcopy(state))
            for scheduler, state in zip(self.schedulers, saved["schedulers"], strict=True):
                scheduler.load_state_dict(copy.deepcopy(state))
            for obj, state in zip(self.objects, saved["objects"], strict=True):
                _load_object(obj, state, self.shared)
        restore_rng_states(saved["rng"])

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


def _cast(batch: Batch, dtype: torch.dtype | None) -> Batch:
    if dtype is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return type(batch)({k: _cast(v, dtype) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_cast(v, dtype) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cast(v, dtype) for v in batch)
    return batch


@contextmanager
def _no_dropout(notes: list[str]) -> Iterator[None]:
    """Dropout off for the check (its masks are drawn per micro-batch)."""
    functional = torch.nn.functional
    names = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
             "feature_alpha_dropout")
    used = [False]
    saved = {name: getattr(functional, name) for name in names}

    def off(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        used[0] = True
        return x

    sdpa: Any = functional.scaled_dot_product_attention

    def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("dropout_p"):
            used[0] = True
            kwargs["dropout_p"] = 0.0
        return sdpa(*args, **kwargs)  # type: ignore[no-any-return]

    try:
        for name in names:
            setattr(functional, name, off)
        functional.scaled_dot_product_attention = attention
        yield
    finally:
        for name, fn in saved.items():
            setattr(functional, name, fn)
        functional.scaled_dot_product_attention = sdpa
        if used[0]:
            notes.append("dropout was switched off: its masks are drawn per micro-batch, so a "
                         "split step matches the unsplit one only in distribution")


def _compare(truth: dict[str, Any], got: dict[str, Any], rtol: float) -> Iterator[Difference]:
    for key in sorted(set(truth) | set(got)):
        if key not in got:
            yield Difference(key, "missing after the split run")
            continue
        if key not in truth:
            yield Difference(key, "not there in the unsplit run")
            continue
        a, b = truth[key], got[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                yield Difference(key, f"shape/dtype {tuple(b.shape)} {b.dtype} vs "
                                      f"{tuple(a.shape)} {a.dtype}")
                continue
            if not a.is_floating_point() and not a.is_complex():
                if not torch.equal(a, b):
                    yield Difference(key, f"{b.tolist() if b.numel() < 8 else '...'} vs "
                                          f"{a.tolist() if a.numel() < 8 else '...'}")
                continue
            if a.numel() == 0:
                continue
            scale = float(a.abs().max())
            diff = float((a - b).abs().max())
            # (a floor of a few units of rounding: a value that is 0 in exact arithmetic, such
            # as the gradient of a bias before a BatchNorm, is rounding noise in both runs)
            floor = 64 * torch.finfo(a.dtype).eps if rtol else 0.0
            if not torch.allclose(b, a, rtol=rtol, atol=rtol * scale + floor, equal_nan=True):
                yield Difference(key, f"max abs difference {diff:.3g} (largest value {scale:.3g})")
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            yield Difference(key, f"{_short(b)} vs {_short(a)}")
        elif isinstance(a, float) and isinstance(b, float):
            if abs(a - b) > rtol * max(abs(a), abs(b), 1e-300) and not (a != a and b != b):
                yield Difference(key, f"{b!r} vs {a!r}")
        elif a != b:
            yield Difference(key, f"{_short(b)} vs {_short(a)}")


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} tensor"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."
