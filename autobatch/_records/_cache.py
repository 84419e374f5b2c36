"""A persistent cache of search results, keyed by everything that decides the answer.

A search is worth repeating only when something that changes its answer changed: the model's
architecture (module types and settings: ``extra_repr``, every attribute that is not a parameter,
buffer or child, hooks, train/eval, the code of ``forward`` for modules outside torch; parameter
and buffer shapes, dtypes, which parameters train), the
sample's per-row shapes and dtypes, the device (name and total memory), the torch and autobatch
versions, the optimizer (its class and the hyper-parameters that change its state), the autocast
dtype, training or inference, and the search options. :func:`fingerprint` hashes all of them;
:class:`ResultCache` keeps one JSON file per key.

A model that holds something whose description would change with the process is never cached.
The cache never breaks a run: a file that cannot be read, parsed or validated (every field's
type and range) is ignored with a warning (and treated as a miss), a file that cannot be written is skipped with a warning. Each file is
written to a temporary file in the same directory and moved into place with ``os.replace``, so
readers see either the old file or the new one, and concurrent writers never leave a torn file.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import inspect
import json
import math
import os
import re
import tempfile
import time
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from autobatch import _batch
from autobatch._log import get_logger, user_stacklevel
from autobatch._memory._backends import DeviceMemory, restore_rng_states, save_rng_states
from autobatch._records._result import LengthTable, result_from_dict, result_to_dict
from autobatch._validate import is_sample_factory

if TYPE_CHECKING:
    from autobatch._records._result import SearchResult

logger = get_logger("cache")

#: Environment variable naming the cache directory (overrides the XDG default).
CACHE_ENV = "AUTOBATCH_CACHE_DIR"

#: Version of the stored layout; a change makes every older file a miss.
FORMAT = 1

CacheOption = bool | str | os.PathLike[str]


def default_cache_dir() -> Path:
    """The cache directory: ``$AUTOBATCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/autobatch``, else
    ``~/.cache/autobatch``.

    >>> default_cache_dir().name != ""
    True
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "autobatch"


def _qualname(obj: Any) -> str | None:
    """``module.qualname`` of a class or function (or of a ``functools.partial``'s function)."""
    if obj is None:
        return None
    target = getattr(obj, "func", obj)  # functools.partial
    if not isinstance(target, type) and not callable(target):
        target = type(target)
    module = getattr(target, "__module__", None) or "?"
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}.{name}"


class UnstableKeyError(ValueError):
    """The model holds something whose description would differ in another process (an object
    known only by its address, a nesting too deep to follow): it cannot be keyed reliably."""


#: ``nn.Module``'s own bookkeeping: parameters, buffers and children enter on their own, hooks
#: separately; ``training`` stays (dropout and batch norm use memory only while training).
_MODULE_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}
_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
)
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+")
_MAX_DEPTH = 8


def _code_digest(code: types.CodeType) -> str:
    """A digest of what a function does: its bytecode, constants (nested code too) and names."""
    parts: list[Any] = [code.co_code.hex(), list(code.co_names), list(code.co_varnames)]
    for const in code.co_consts:
        parts.append(_code_digest(const) if isinstance(const, types.CodeType) else repr(const))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class _Describer:
    """Canonical, JSON-ready descriptions of module settings, the same in every process."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self.keep: list[Any] = []  # described objects stay alive, so ids are not reused

    def __call__(self, value: Any, depth: int = 0) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return repr(value)
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(value)
        if isinstance(value, enum.Enum):
            return f"{_qualname(type(value))}.{value.name}"
        if isinstance(value, torch.Tensor):  # plain tensor attributes: their shape and dtype
            return ["tensor", list(value.shape), str(value.dtype), value.device.type]
        if isinstance(value, nn.Module):  # children enter on their own; a reference by type
            return ["module", _qualname(type(value))]
        if isinstance(value, type):
            return ["class", _qualname(value)]
        if depth > _MAX_DEPTH:
            raise UnstableKeyError(f"settings nested deeper than {_MAX_DEPTH} levels")
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = ["cycle"]  # a reference back to an object being described
        self.keep.append(value)
        self.memo[key] = described = self._compound(value, depth + 1)
        return described

    def _compound(self, value: Any, depth: int) -> Any:
        if isinstance(value, (list, tuple)):
            return [self(v, depth) for v in value]
        if isinstance(value, (set, frozenset)):
            return sorted((self(v, depth) for v in value), key=repr)
        if isinstance(value, Mapping):
            return sorted(([repr(k), self(v, depth)] for k, v in value.items()), key=repr)
        if isinstance(value, functools.partial):
            return ["partial", self(value.func, depth), self(value.args, depth),
                    self(value.keywords, depth)]
        if isinstance(value, types.MethodType):
            return ["method", _qualname(type(value.__self__)), value.__func__.__name__]
        if isinstance(value, types.FunctionType):
            return ["function", _qualname(value), _code_digest(value.__code__)]
        if callable(value) and hasattr(value, "__qualname__"):  # builtins, torch functions
            return ["callable", _qualname(value)]
        if isinstance(value, weakref.ReferenceType):
            return ["weakref", self(value(), depth)]
        if hasattr(value, "__dict__"):  # a configuration object (e.g. a Hugging Face config)
            settings = {
                name: setting for name, setting in vars(value).items()
                if "hash" not in name  # Python's hashes of objects change with the process
            }
            return [_qualname(type(value)), self(settings, depth)]
        text = repr(value)
        if _ADDRESS.search(text):
            raise UnstableKeyError(f"a {type(value).__name__} known only by its address")
        return [_qualname(type(value)), text]


def _module_settings(module: nn.Module, describe: _Describer) -> list[Any]:
    """A module's configuration: its ``extra_repr``, every attribute that is not a parameter,
    buffer or child (stride, heads, scale factors, flags such as gradient checkpointing), its
    hooks, whether it is compiled, and, for classes outside torch, a digest of ``forward``'s
    code."""
    attributes = {
        name: value for name, value in vars(module).items()
        if name not in _MODULE_BOOKKEEPING
    }
    hooks = [
        [name, [describe(hook) for hook in getattr(module, name, {}).values()]]
        for name in _HOOK_DICTS
        if getattr(module, name, None)
    ]
    own_code = (
        None if type(module).__module__.startswith("torch.") else _methods_digest(type(module))
    )
    return [
        module.extra_repr(),
        describe(attributes),
        hooks,
        getattr(module, "_compiled_call_impl", None) is not None,
        own_code,
    ]


def _methods_digest(cls: type) -> str | None:
    """A digest of ``forward``'s code and of the class's own methods it reaches by name
    (``self._attend(x)``, and what those call): a helper changed changes the key."""
    forward = getattr(cls, "forward", None)
    if not isinstance(getattr(forward, "__code__", None), types.CodeType):
        return None
    digests: list[list[str]] = []
    todo, seen = ["forward"], set[str]()
    while todo and len(seen) < 64:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        method = inspect.getattr_static(cls, name, None)
        method = getattr(method, "__func__", method)  # (static and class methods)
        code = getattr(method, "__code__", None)
        if not isinstance(code, types.CodeType) or getattr(method, "__module__", "").startswith(
            "torch."
        ):
            continue
        digests.append([name, _code_digest(code)])
        todo += [n for n in code.co_names if n not in seen]
    return hashlib.sha256(repr(sorted(digests)).encode()).hexdigest()[:16]


def _callable_key(fn: Any) -> Any:
    """A ``loss_fn``'s or ``step_fn``'s part of a key: its name, its code, and the values it
    captured (closure cells, defaults, a partial's arguments), so that two steps made by one
    factory with other settings (a sequence length, a scale) never share an entry."""
    if fn is None:
        return None
    describe = _Describer()
    target = getattr(fn, "__func__", fn)
    captured: list[Any] = []
    if isinstance(target, functools.partial):
        captured += [describe(target.args), describe(target.keywords)]
        target = target.func
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType):
        cells = [c.cell_contents for c in (getattr(target, "__closure__", None) or ())
                 if _filled(c)]
        captured += [
            _code_digest(code),
            [_captured(v, describe) for v in cells],
            describe(getattr(target, "__defaults__", None)),
            describe(getattr(target, "__kwdefaults__", None)),
        ]
    elif not isinstance(target, type) and hasattr(target, "__dict__"):  # a callable object
        captured.append(describe(vars(target)))
    return [_qualname(fn), captured]


def _captured(value: Any, describe: _Describer) -> Any:
    """A value a function captured: a module by its architecture, an optimizer by its memory
    options (neither by its values, which training changes), anything else as settings."""
    if isinstance(value, nn.Module):
        return _architecture(value)
    if isinstance(value, torch.optim.Optimizer):
        return _optimizer(value)
    return describe(value)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # (a cell not yet assigned)
        return False
    return True


def _architecture(model: nn.Module) -> list[Any]:
    """Module types and settings in order, then each parameter and buffer: name, shape, dtype
    (and for parameters, whether it trains). Values are not part of it: training does not
    change it.

    Raises :class:`UnstableKeyError` when a module holds something that cannot be described
    the same way in another process."""
    describe = _Describer()
    modules = [
        [name, _qualname(type(module)), _module_settings(module, describe)]
        for name, module in model.named_modules()
    ]
    params = [
        [name, list(p.shape), str(p.dtype), bool(p.requires_grad)]
        for name, p in model.named_parameters()
    ]
    buffers = [[name, list(b.shape), str(b.dtype)] for name, b in model.named_buffers()]
    return [modules, params, buffers]


def _hyperparameter(value: Any) -> Any:
    """A hyper-parameter as it matters to memory: floats only as zero or non-zero (SGD's
    momentum buffer exists only for momentum != 0; the learning rate never matters), so tuning
    a learning rate keeps the cache while switching Adam's ``amsgrad`` invalidates it."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return "nonzero" if value != 0 and not math.isnan(value) else "zero"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (tuple, list)):
        return [_hyperparameter(v) for v in value]
    return type(value).__name__


def _optimizer(optimizer: Any) -> Any:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [
            {key: _hyperparameter(value) for key, value in sorted(group.items()) if key != "params"}
            for group in optimizer.param_groups
        ]
        return {"class": _qualname(type(optimizer)), "groups": groups}
    keywords = getattr(optimizer, "keywords", None)  # functools.partial(SGD, momentum=0.9)
    if isinstance(keywords, dict) and keywords:
        return {
            "factory": _qualname(optimizer),
            "keywords": {key: _hyperparameter(value) for key, value in sorted(keywords.items())},
        }
    return {"factory": _qualname(optimizer)}


def _sample(sample: Any) -> Any:
    """Per-row shapes and dtypes of the sample (its number of rows does not matter). For a
    callable ``n -> batch`` sample, the structure of ``sample(1)``, made with the random number
    generators saved and put back."""
    if is_sample_factory(sample):
        rng = save_rng_states(host=True)
        try:
            made = sample(1)
        finally:
            restore_rng_states(rng)
        return {"factory": _qualname(sample), "structure": _sample(made)}
    return [[path, shape, str(dtype)] for path, shape, dtype in _batch.shape_key(sample)]


def fingerprint(
    model: nn.Module,
    sample: Any,
    *,
    device_name: str,
    capacity_bytes: int,
    optimizer: Any = None,
    autocast_dtype: torch.dtype | None = None,
    train: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """The cache key of a search: the sha256 of a canonical JSON of everything that decides it.

    >>> import torch
    >>> key = fingerprint(torch.nn.Linear(4, 2), torch.zeros(3, 4), device_name="cuda:0",
    ...                   capacity_bytes=2**30)
    >>> len(key), key == fingerprint(torch.nn.Linear(4, 2), torch.ones(5, 4),
    ...                              device_name="cuda:0", capacity_bytes=2**30)
    (64, True)

    Args:
        model: The module; its architecture enters, not its weights.
        sample: A batch (per-row shapes and dtypes enter) or a callable ``n -> batch``.
        device_name, capacity_bytes: The device, as the memory backend names it, and its total
            memory.
        optimizer: An optimizer (class and memory-relevant hyper-parameters), a class or factory
            (its qualified name), or None.
        autocast_dtype: The autocast dtype in effect, or None.
        train: Training or inference.
        extra: Anything else that decides the result (search options, loss and step functions);
            JSON-serialisable values, others enter by their type name.
    """
    from autobatch._version import __version__

    document = {
        "format": FORMAT,
        "autobatch": __version__,
        "torch": torch.__version__,
        "model": _architecture(model),
        "sample": _sample(sample),
        "device": device_name,
        "capacity_bytes": int(capacity_bytes),
        "optimizer": _optimizer(optimizer),
        "autocast": None if autocast_dtype is None else str(autocast_dtype),
        "train": bool(train),
        "extra": dict(sorted((extra or {}).items())),
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), default=_qualname)
    return hashlib.sha256(text.encode()).hexdigest()


def _no_constant(name: str) -> Any:
    """``json.loads``' hook for ``NaN``/``Infinity``: no stored value may hold one."""
    raise ValueError(f"{name} is not a value autobatch stores")


class ResultCache:
    """Search results on disk: one JSON file per key, written atomically.

    >>> import tempfile
    >>> cache = ResultCache(tempfile.mkdtemp())
    >>> cache.get("0" * 64) is None
    True
    >>> cache.put("0" * 64, {"batch_size": 96})
    >>> cache.get("0" * 64)
    {'batch_size': 96}

    Args:
        path: The directory (created on the first write); default :func:`default_cache_dir`.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_cache_dir()

    def file_for(self, key: str) -> Path:
        """The file that holds ``key``'s entry."""
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"cache key must be a lowercase hex digest, got {key!r}")
        return self.path / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored value, or None on a miss (missing, unreadable, corrupt or stale file)."""
        file = self.file_for(key)
        try:
            data = file.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            warnings.warn(
                f"autobatch cache: cannot read {file} ({error}); measuring again",
                stacklevel=2,
            )
            return None
        try:
            entry = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
            if not isinstance(entry, dict) or entry.get("key") != key:
                raise ValueError("not an autobatch cache entry for this key")
            if entry.get("format") != FORMAT:
                return None  # written by another version of autobatch: a plain miss
            value = entry["value"]
            if not isinstance(value, dict):
                raise ValueError("the stored value is not an object")
        except (ValueError, KeyError, RecursionError) as error:  # RecursionError: nested
            warnings.warn(
                f"autobatch cache: ignoring corrupt file {file} "
                f"({type(error).__name__}: {str(error)[:200]}); measuring again",
                stacklevel=2,
            )
            return None
        return value

    def put(self, key: str, value: Mapping[str, Any]) -> None:
        """Store ``value`` (JSON-serialisable) under ``key``, replacing any older entry."""
        file = self.file_for(key)
        entry = {"format": FORMAT, "key": key, "created": time.time(), "value": dict(value)}
        try:
            text = json.dumps(entry, indent=1, sort_keys=True, allow_nan=False)
        except ValueError as error:  # a NaN or infinity would be read back as damage
            warnings.warn(
                f"autobatch cache: cannot store the result for {key[:16]}... ({error}); "
                "it is not cached",
                stacklevel=2,
            )
            return
        temporary: str | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", encoding="utf-8", dir=self.path, prefix=f".{key[:16]}.", suffix=".tmp",
                delete=False,
            ) as handle:
                temporary = handle.name
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, file)
            temporary = None
        except OSError as error:
            warnings.warn(
                f"autobatch cache: cannot write {file} ({error}); the result is not cached",
                stacklevel=2,
            )
        finally:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)

    def __repr__(self) -> str:
        return f"ResultCache({str(self.path)!r})"


def open_cache(cache: CacheOption) -> ResultCache | None:
    """The cache a ``cache=`` option asks for: None for False, the default directory for True,
    that directory for a path.

    >>> open_cache(False) is None, open_cache("somewhere").path.name
    (True, 'somewhere')
    """
    if cache is False:
        return None
    if cache is True:
        return ResultCache()
    if isinstance(cache, (str, os.PathLike)):
        return ResultCache(cache)
    raise TypeError(f"cache must be True, False or a directory path, got {cache!r}")


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in effect for ``device_type`` at the call, or None when autocast is off.

    >>> autocast_dtype("cpu") is None
    True
    """
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None


def search_key(
    model: nn.Module,
    sample: Any,
    optimizer: Any,
    memory: DeviceMemory,
    *,
    train: bool,
    min_batch: int,
    max_batch: int | None,
    multiple_of: int,
    headroom: float,
    steps_per_trial: int,
    loss_fn: Any,
    step_fn: Any,
    scaler: Any,
) -> str:
    """The key of a :func:`~autobatch.search_batch_size` call on the device ``memory`` serves
    (see :func:`fingerprint`), from the call's own arguments, so that every front-end that
    searches (the library call, the CLI) shares entries.

    The options that only change the path to the answer (``start``, ``prior``) are not part of
    it; the optimizer is not part of an inference search's key (it is not used).
    """
    return fingerprint(
        model,
        sample,
        device_name=memory.name,
        capacity_bytes=memory.capacity_bytes(),
        optimizer=optimizer if train else None,
        autocast_dtype=autocast_dtype(memory.device.type),
        train=train,
        extra={
            "min_batch": min_batch,
            "max_batch": max_batch,
            "multiple_of": multiple_of,
            "headroom": float(headroom),
            "steps_per_trial": steps_per_trial,
            "loss_fn": _callable_key(loss_fn),
            "step_fn": _callable_key(step_fn),
            "scaler": _qualname(None if scaler is None else type(scaler)),
        },
    )


def table_key(keys: Mapping[int, str]) -> str:
    """The key of a search over lengths, from the :func:`search_key` of each length's search:
    another length, or another sample at one, is another table.

    >>> table_key({128: "a" * 64, 512: "b" * 64}) == table_key({512: "b" * 64, 128: "a" * 64})
    True
    """
    document = {"format": FORMAT, "lengths": [[n, keys[n]] for n in sorted(keys)]}
    text = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def cached_search(
    store: ResultCache | None,
    key: Callable[[], str],
    run: Callable[[], SearchResult],
    confirm: Callable[[SearchResult], bool] | None = None,
) -> tuple[SearchResult, Path | None]:
    """``(result, file)``: the result stored under ``key()`` and its file when there is a good
    one, else ``run()``'s result (stored) and None. ``key`` is called only when ``store`` is set.
    A stored entry that does not parse as a result is a miss, with a warning; so is one that
    ``confirm`` (a trial at its largest size, say) says no longer holds: what the key cannot
    see (a global the step reads) changed.
    """
    return _cached(store, key, run, result_to_dict, result_from_dict, confirm)


def cached_table(
    store: ResultCache | None,
    key: Callable[[], str],
    run: Callable[[], LengthTable],
) -> tuple[LengthTable, Path | None]:
    """:func:`cached_search` for the table of a search over lengths (see :func:`table_key`)."""
    return _cached(store, key, run, LengthTable.to_dict, LengthTable.from_dict)


_Record = TypeVar("_Record", "SearchResult", LengthTable)


def _cached(
    store: ResultCache | None,
    key: Callable[[], str],
    run: Callable[[], _Record],
    encode: Callable[[_Record], dict[str, Any]],
    decode: Callable[[Mapping[str, Any]], _Record],
    confirm: Callable[[_Record], bool] | None = None,
) -> tuple[_Record, Path | None]:
    result: _Record
    if store is None:
        return run(), None
    try:
        name = key()
    except UnstableKeyError as error:
        warnings.warn(
            f"autobatch cache: the model or its step cannot be fingerprinted reliably "
            f"({error}), so its result is neither read from nor written to the cache; measuring",
            stacklevel=user_stacklevel(),
        )
        result = run()
        note = f"not cached: the model or its step cannot be fingerprinted reliably ({error})"
        return replace(result, notes=(*result.notes, note)), None
    file = store.file_for(name)
    stored = store.get(name)
    if stored is not None:
        try:
            result = decode(stored)
        except ValueError as error:
            warnings.warn(
                f"autobatch cache: ignoring {file} ({error}); measuring again", stacklevel=2
            )
        else:
            if confirm is None or confirm(result):
                note = f"from the cache ({file}); cache=False measures again"
                if confirm is not None:
                    note += " (its largest and recommended sizes trained in trials just now)"
                return replace(result, notes=(*result.notes, note)), file
            logger.warning("the cached answer in %s ran out of memory in a trial at its largest "
                           "or recommended size: measuring again", file)
    result = run()
    store.put(name, encode(result))
    return result, None
