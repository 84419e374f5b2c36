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
batch norm's definition. Such a step is still not exact when split: the report says why in
its ``caveats`` (BatchNorm, spectral norm's power iteration) and is false, while
``replayed`` says whether the replay itself matched. Dropout is switched off during the
check (its masks are drawn per micro-batch), and the report says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autobatch._batch import Batch, batch_size, tensors
from autobatch._errors import AutobatchError
from autobatch._memory._accounting import DispatchMode, call_keeping_versions
from autobatch._recovery import _patches
from autobatch._recovery._arguments import batch_statistics
from autobatch._recovery._decorator import retry_on_oom
from autobatch._recovery._options import RecoveryOptions
from autobatch._recovery._world import World, cast_batch

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
    #: why a split differs from the unsplit step by design, whatever the replay: modules in
    #: training mode whose statistics depend on how the batch is cut
    caveats: tuple[str, ...] = ()

    @property
    def replayed(self) -> bool:
        """Whether every schedule ran and matched the truth (with BatchNorm run on the same
        micro-batches: the replay, not the statistics)."""
        return all(s.exact for s in self.schedules if s.fired) and any(
            s.fired for s in self.schedules
        )

    @property
    def exact(self) -> bool:
        """Whether the split step equals the unsplit one: replayed, and nothing in it that
        depends on how the batch is cut (:attr:`caveats`)."""
        return self.replayed and not self.caveats

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
        lines = ["exact when split" if self.exact else "NOT exact when split" + (
            " (replayed exactly, but it depends on how the batch is cut)"
            if self.replayed else "")]
        lines += [f"  caveat: {c}" for c in self.caveats]
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
    before: tuple[Batch | Callable[[], Any], ...] | list[Batch | Callable[[], Any]] = (),
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
            the state to check from: the earlier calls of an accumulation window, say. A
            callable among them is called instead, in its place: what the training loop does
            between calls (an epoch start that replaces a buffer, adds a module or makes a
            new metric).
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

    def decorate(fn: Callable[..., Any]) -> Any:
        decorated = retry_on_oom(optimizer=optimizer, model=model, scheduler=scheduler,
                                 **options)(fn)
        decorated._engine.warned.add("statistics")  # (reported as a caveat instead)
        return decorated

    given = RecoveryOptions(optimizer=optimizer, model=model, scheduler=scheduler,
                            **{k: v for k, v in options.items() if k != "policy"},
                            policy=options.get("policy", "accumulate"))
    world = World(step, given, objects)
    notes: list[str] = []
    results: list[ScheduleResult] = []
    with world.converted(dtype), _no_dropout(notes):
        data = cast_batch(batch, dtype)
        earlier = [b if callable(b) else cast_batch(b, dtype) for b in before]
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
    return SplitReport(tuple(results), tuple(notes), tuple(batch_statistics(world.modules)))


def _run_schedule(
    name: str, step: Callable[..., Any], batch: Batch, earlier: list[Any], total: int,
    world: World,
    start: Any, decorate: Callable[..., Any], rtol: float,
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
        # clean calls first (one, at least, for the OOM on the fast path)
        if callable(done):
            done()
        else:
            decorated(done)
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
        if callable(done):
            done()
        else:
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
            session = _patches.running_split()
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
