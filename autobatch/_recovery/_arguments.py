"""Where a decorated step's batch is among its arguments, and what else its call refers to."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._batch import Batch, ambiguous_paths, batch_size, slice_batch, tensors
from autobatch._errors import AutobatchError
from autobatch._log import user_stacklevel
from autobatch._oom import failure_kind


def _batch_parameter(
    fn: Callable[..., Any], batch_arg: str | None
) -> tuple[int | None, str | None]:
    """Where the batch is in a call of ``fn``: (positional index, keyword name)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if batch_arg is not None:
        for index, param in enumerate(params):
            if param.name == batch_arg and param.kind in (
                *positional,
                inspect.Parameter.KEYWORD_ONLY,
            ):
                return (index if param.kind in positional else None), param.name
        names = ", ".join(p.name for p in params) or "none"
        raise ValueError(
            f"batch_arg={batch_arg!r} is not a parameter of {getattr(fn, '__qualname__', fn)!r} "
            f"(parameters: {names}); pass the name of the argument that holds the batch"
        )
    for index, param in enumerate(params):
        if param.kind in positional and param.name not in ("self", "cls"):
            return index, (None if param.kind == inspect.Parameter.POSITIONAL_ONLY else param.name)
        if param.kind == inspect.Parameter.VAR_POSITIONAL:
            return index, None
    if not params:
        return 0, None
    raise ValueError(
        f"{getattr(fn, '__qualname__', fn)!r} takes no positional argument to split; pass "
        "batch_arg= with the name of the argument that holds the batch"
    )


def _modules_of(fn: Callable[..., Any]) -> dict[str, nn.Module]:
    """Modules the step function refers to by name (globals and closure, and a method's
    ``self`` and what it holds as attributes), by that name."""
    try:
        names = inspect.getclosurevars(inspect.unwrap(fn))
    except (TypeError, ValueError):
        return {}
    values = {**names.globals, **names.nonlocals}
    found = {name: v for name, v in values.items() if isinstance(v, nn.Module)}
    owner = getattr(inspect.unwrap(fn), "__self__", None)
    if isinstance(owner, nn.Module):
        found.setdefault("self", owner)
    elif isinstance(getattr(owner, "__dict__", None), dict):
        for name, held in list(vars(owner).items())[:256]:
            if isinstance(held, nn.Module):
                found.setdefault(f"self.{name}", held)
    return found


def _count_items(value: object, name: str) -> float:
    """The number ``items=`` returned for a batch, checked."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name}: items= must return a number of items (an int, a float or a one-element "
            f"tensor), got {value!r} ({type(value).__name__})"
        )
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}: items= returned {value!r}; a count must be finite and >= 0")
    return float(value)


def batch_items(items: Callable[[Batch], Any], batch: Batch, piece: int, name: str) -> float:
    """What ``items=`` counts in the whole batch: at once, or where that runs out of memory
    too (a mask built over the whole batch), as the sum of its pieces' counts (a count of
    items adds up over the rows)."""
    try:
        return _count_items(items(batch), name)
    except Exception as error:  # (out of the except block below: its tensors are gone)
        if failure_kind(error) is None:
            raise
    total = batch_size(batch)
    return sum(_count_items(items(slice_batch(batch, start, min(start + piece, total))), name)
               for start in range(0, total, piece))


def batch_statistics(named: list[tuple[str, nn.Module]]) -> list[str]:
    """The modules in training mode whose state or output depends on how the batch is cut,
    by name and why: BatchNorm (statistics per micro-batch) and spectral norm (its power
    iteration runs once per micro-batch), both APIs."""
    found: dict[int, str] = {}
    for prefix, top in named:
        for name, module in top.named_modules(prefix=prefix):
            if not module.training or id(module) in found:
                continue
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                found[id(module)] = (
                    f"{type(module).__name__} {name} normalises each micro-batch by its own "
                    "statistics")
            elif type(module).__name__ == "_SpectralNorm" or any(
                type(hook).__name__ == "SpectralNorm" for hook in module._forward_pre_hooks.values()
            ):
                owner, _, held = name.partition(".parametrizations.")
                of = f"{owner}.{held.split('.')[0]}" if held else f"{name}.weight"
                found[id(module)] = (
                    f"the spectral norm of {of} runs its power iteration once per micro-batch")
    return list(found.values())


def warn_batch_statistics(name: str, named: list[tuple[str, nn.Module]], warned: set[str]) -> None:
    """Once per step: modules whose statistics differ per micro-batch run in micro-batches."""
    if "statistics" in warned:
        return
    found = batch_statistics(named)
    if found:
        warned.add("statistics")
        warnings.warn(
            f"{name} is running in micro-batches, and {len(found)} module(s) in training mode "
            f"depend on how its batch is cut: {'; '.join(found[:3])}"
            f"{'; ...' if len(found) > 3 else ''}. Results differ slightly from whole batches "
            "(GroupNorm or LayerNorm do not depend on the batch; eval() mode does not either)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def bare_steps(engine: Any, stepped: list[torch.optim.Optimizer], *, in_piece: bool) -> None:
    """A step decorated without ``optimizer=`` and without ``policy=`` was seen stepping an
    optimizer (``stepped``): remember it, and warn (once, by name) where a micro-batch of
    the default ``policy="shrink"`` just took its own step before autobatch knew."""
    options = engine.options
    if options.policy_given or engine.optimizers or not stepped:
        return
    new = [type(o).__name__ for o in stepped if type(o).__name__ not in engine.steps_seen]
    engine.steps_seen += new
    if in_piece and new and "bare" not in engine.warned:
        engine.warned.add("bare")
        warnings.warn(
            f"{engine.name} calls {new[0]}.step(), but retry_on_oom was given no optimizer: "
            f"running in micro-batches, it takes {new[0]}.step() once per micro-batch (the "
            "default without an optimizer is policy='shrink'). Pass it, retry_on_oom("
            "optimizer=opt), for one step per batch from its micro-batches, or policy='shrink' "
            "to say one step per micro-batch is meant",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def foreign_steps(engine: Any, stepped: list[torch.optim.Optimizer]) -> None:
    """The step stepped optimizers, none of them one it was given: said at once (a later
    split would refuse the step), by name, once."""
    ours = {id(o) for o in engine.optimizers}
    if not ours or not stepped or any(id(o) in ours for o in stepped) or "foreign" in engine.warned:
        return
    engine.warned.add("foreign")
    given = ", ".join(sorted({type(o).__name__ for o in engine.optimizers}))
    warnings.warn(
        f"{engine.name} stepped {type(stepped[0]).__name__}, but retry_on_oom was given another "
        f"optimizer ({given}), which it did not step: once memory runs short, its micro-batches "
        "would be refused. Pass the optimizer the step calls, retry_on_oom(optimizer=opt)",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def no_batch(engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any], found: Any,
             error: Exception) -> AutobatchError:
    """The first call's argument that autobatch would split is not a batch (``step(model,
    batch)`` without ``batch_arg=``): the error, naming the argument that looks like one."""
    try:
        names = list(inspect.signature(engine.fn).parameters)
    except (TypeError, ValueError):
        names = []
    where = engine.keyword or (
        names[engine.index] if engine.index is not None and engine.index < len(names)
        else f"position {engine.index}")
    candidates = [*zip(names, args, strict=False), *kwargs.items()]
    better = next((name for name, value in candidates if value is not found and _batch_like(value)),
                  None)
    if better is None:
        return AutobatchError(
            f"{engine.name}'s batch (argument {where!r}) is one autobatch cannot split into "
            f"micro-batches when memory runs short: {error}. Batches split along dimension 0 "
            "of their tensors and of per-sample lists (as long as the batch); if the batch is "
            "another argument, pass retry_on_oom(batch_arg='its name')"
        )
    return AutobatchError(
        f"{engine.name}'s argument {where!r} is {type(found).__name__}, not a batch: autobatch "
        f"cannot split it into micro-batches when memory runs short ({error}). It splits the "
        f"first positional argument unless told otherwise: pass "
        f"retry_on_oom(batch_arg={better!r})"
    )


def rows_elsewhere(
    engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any], total: int
) -> str | None:
    """What is wrong with an argument besides the batch that holds a tensor with as many rows
    as the batch (``step(x, y)``, where only ``x`` is the batch; ``step(x, x)``): a
    micro-batch would pair part of the batch with all of it, which fails or, where it
    broadcasts, is silently wrong. ``None`` where there is none (or the batch has one row)."""
    if total < 2:
        return None
    try:
        names = list(inspect.signature(engine.fn).parameters)
    except (TypeError, ValueError):
        names = []
    positional = engine.keyword is None or engine.keyword not in kwargs
    others = [(names[i] if i < len(names) else f"#{i}", value) for i, value in enumerate(args)
              if not (positional and i == engine.index)]
    others += [(name, value) for name, value in kwargs.items()
               if positional or name != engine.keyword]
    where = engine.keyword if not positional else (
        names[engine.index] if engine.index is not None and engine.index < len(names)
        else f"#{engine.index}")
    for name, value in others:
        for t in tensors(value):
            if t.dim() and t.shape[0] == total:
                return (
                    f"{engine.name}'s argument {name!r} holds a tensor of shape "
                    f"{tuple(t.shape)}, as many rows as its batch (argument {where!r}, {total} "
                    "rows), but is not part of it: when memory runs short autobatch cuts only "
                    f"the batch into micro-batches, and each would meet all {total} rows of "
                    f"{name!r}. Pass them as one batch (the step taking one argument that "
                    "holds both, a tuple or a dict), or name the batch with "
                    f"retry_on_oom(batch_arg=...); if {name!r} is not per-row data (class "
                    "weights, a mask over positions), pass it another way, a closure or an "
                    "attribute"
                )
    return None


def check_rows_elsewhere(
    engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any], total: int, *, first: bool
) -> None:
    """See :func:`rows_elsewhere`: at the first call a warning (such an argument may be no
    per-row data that is as long as the batch by chance: class weights, a mask over
    positions); where the batch is about to be cut, a refusal, since the cut would be wrong."""
    problem = rows_elsewhere(engine, args, kwargs, total)
    if problem is None:
        return
    if first:
        warnings.warn(f"{problem}. If memory runs short, the call is refused rather than cut",
                      stacklevel=user_stacklevel())
        return
    raise AutobatchError(problem)


def _batch_like(value: Any) -> bool:
    try:
        return batch_size(value) > 0
    except (TypeError, ValueError):
        return False


def refuse_bare_steps(engine: Any) -> None:
    """A batch is about to run in micro-batches under a bare decorator on a step known to
    step an optimizer: refused (each micro-batch would take its own optimizer step)."""
    options = engine.options
    if options.policy_given or engine.optimizers or not engine.steps_seen:
        return
    label = engine.steps_seen[0]
    raise AutobatchError(
        f"{engine.name} ran out of memory and would now run in micro-batches, but it calls "
        f"{label}.step() and retry_on_oom was given no optimizer: each micro-batch would take "
        f"its own {label}.step() (the default without an optimizer is policy='shrink'). Pass "
        "it, retry_on_oom(optimizer=opt), for one step per batch from its micro-batches "
        "(exact gradient accumulation), or say policy='shrink' if one step per micro-batch "
        "is meant. Nothing of the batch was kept"
    )


def piece_too_small(exc: BaseException, engine: Any, n: int, total: int) -> None:
    """Raise the error for a piece autobatch cut smaller than a module of the step accepts
    (BatchNorm in training needs more than one value per channel), if ``exc`` says so."""
    if n >= total or not (
        isinstance(exc, ValueError) and "more than 1 value per channel" in str(exc)
    ):
        return
    name, modules, min_batch = engine.name, engine.known.modules, engine.options.min_batch
    norms = [
        (f"{type(top).__name__}.{path}" if path else type(top).__name__, m)
        for top in modules for path, m in top.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]
    what = f"{norms[0][0]} ({type(norms[0][1]).__name__})" if norms else "a BatchNorm layer"
    raise AutobatchError(
        f"{name} ran out of memory and autobatch cut its batch into micro-batches of {n} "
        f"row(s), which {what} in training mode cannot take (it needs more than one value "
        f"per channel). Pass min_batch=2 (or more): retry_on_oom(..., min_batch=2); with "
        f"min_batch={min_batch} the pieces may be this small"
    ) from exc


def warn_tuples(name: str, batch: Batch, warned: set[str]) -> None:
    """Once per step: a tuple as long as the batch is split as one value per sample."""
    if "tuples" in warned:
        return
    paths = ambiguous_paths(batch)
    if paths:
        warned.add("tuples")
        warnings.warn(
            f"{name} splits {', '.join(paths)} (a tuple as long as the batch) as one value per "
            "sample. If it is one value for the whole batch (an image size, say), wrap it in "
            "autobatch.per_batch(...) where the batch is made; use a list for per-sample values "
            "to silence this",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def describe_params(
    params: list[torch.Tensor], named: dict[str, nn.Module], modules: list[nn.Module]
) -> str:
    """Up to four of ``params`` by readable names (a module's name in the step, else its
    type), for messages."""
    names: dict[int, str] = {}
    for prefix, module in named.items():
        for name, p in module.named_parameters():
            names.setdefault(id(p), f"{prefix}.{name}")
    for module in modules:
        for name, p in module.named_parameters(recurse=False):
            names.setdefault(id(p), f"{type(module).__name__}.{name}")
    shown = [names.get(id(p), f"a {tuple(p.shape)} parameter") for p in params[:4]]
    more = "" if len(params) <= 4 else f" and {len(params) - 4} more"
    return ", ".join(shown) + more


def slice_rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``[start, stop)`` of a batch (views), made outside every dispatch mode: no
    simulated GPU or fault injection mistakes the engine's own slicing for the step's."""
    with _disable_current_modes():
        return slice_batch(batch, start, stop)
