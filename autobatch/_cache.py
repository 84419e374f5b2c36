"""A persistent cache of search results, keyed by everything that decides the answer.

A search is worth repeating only when something that changes its answer changed: the model's
architecture (module types, parameter and buffer shapes, dtypes, which parameters train), the
sample's per-row shapes and dtypes, the device (name and total memory), the torch and autobatch
versions, the optimizer (its class and the hyper-parameters that change its state), the autocast
dtype, training or inference, and the search options. :func:`fingerprint` hashes all of them;
:class:`ResultCache` keeps one JSON file per key.

The cache never breaks a run: a file that cannot be read or parsed is ignored with a warning
(and treated as a miss), a file that cannot be written is skipped with a warning. Each file is
written to a temporary file in the same directory and moved into place with ``os.replace``, so
readers see either the old file or the new one, and concurrent writers never leave a torn file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autobatch import _batch
from autobatch._backends import DeviceMemory, restore_rng_states, save_rng_states

if TYPE_CHECKING:
    from autobatch._finder import SearchResult

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


def _architecture(model: nn.Module) -> list[Any]:
    """Module types in order, then each parameter and buffer: name, shape, dtype (and for
    parameters, whether it trains). Values are not part of it: training does not change it."""
    modules = [[name, _qualname(type(module))] for name, module in model.named_modules()]
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
    if callable(sample) and not isinstance(sample, (torch.Tensor, nn.Module)):
        torch_rng, python_rng = save_rng_states(), random.getstate()
        try:
            made = sample(1)
        finally:
            restore_rng_states(torch_rng)
            random.setstate(python_rng)
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

    Parameters
    ----------
    model:
        The module; its architecture enters, not its weights.
    sample:
        A batch (per-row shapes and dtypes enter) or a callable ``n -> batch``.
    device_name, capacity_bytes:
        The device, as the memory backend names it, and its total memory.
    optimizer:
        An optimizer (class and memory-relevant hyper-parameters), a class or factory (its
        qualified name), or None.
    autocast_dtype:
        The autocast dtype in effect, or None.
    train:
        Training or inference.
    extra:
        Anything else that decides the result (search options, loss and step functions);
        JSON-serialisable values, others enter by their type name.
    """
    from autobatch import __version__

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


class ResultCache:
    """Search results on disk: one JSON file per key, written atomically.

    >>> import tempfile
    >>> cache = ResultCache(tempfile.mkdtemp())
    >>> cache.get("0" * 64) is None
    True
    >>> cache.put("0" * 64, {"batch_size": 96})
    >>> cache.get("0" * 64)
    {'batch_size': 96}

    Parameters
    ----------
    path:
        The directory (created on the first write); default :func:`default_cache_dir`.
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
            entry = json.loads(data.decode("utf-8"))
            if not isinstance(entry, dict) or entry.get("key") != key:
                raise ValueError("not an autobatch cache entry for this key")
            if entry.get("format") != FORMAT:
                return None  # written by another version of autobatch: a plain miss
            value = entry["value"]
            if not isinstance(value, dict):
                raise ValueError("the stored value is not an object")
        except (ValueError, KeyError) as error:
            warnings.warn(
                f"autobatch cache: ignoring corrupt file {file} ({error}); measuring again",
                stacklevel=2,
            )
            return None
        return value

    def put(self, key: str, value: Mapping[str, Any]) -> None:
        """Store ``value`` (JSON-serialisable) under ``key``, replacing any older entry."""
        file = self.file_for(key)
        entry = {"format": FORMAT, "key": key, "created": time.time(), "value": dict(value)}
        text = json.dumps(entry, indent=1, sort_keys=True)
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
            "loss_fn": _qualname(loss_fn),
            "step_fn": _qualname(step_fn),
            "scaler": _qualname(None if scaler is None else type(scaler)),
        },
    )


def result_to_dict(result: SearchResult) -> dict[str, Any]:
    """A JSON-ready dict of a :class:`~autobatch.SearchResult` (see :func:`result_from_dict`)."""
    model = result.memory_model
    return {
        "batch_size": result.batch_size,
        "max_batch_size": result.max_batch_size,
        "smallest_failing": result.smallest_failing,
        "device": result.device,
        "capacity_bytes": result.capacity_bytes,
        "headroom": result.headroom,
        "train": result.train,
        "optimizer_counted": result.optimizer_counted,
        "memory_model": None if model is None else {
            "fixed": model.fixed, "per_sample": model.per_sample
        },
        "trials": [
            {
                "size": t.size,
                "fits": t.fits,
                "peak_bytes": t.peak_bytes,
                "seconds": t.seconds,
                "error": t.error,
            }
            for t in result.trials
        ],
        "notes": list(result.notes),
    }


def result_from_dict(data: Mapping[str, Any]) -> SearchResult:
    """The :class:`~autobatch.SearchResult` that :func:`result_to_dict` wrote.

    Raises ``ValueError`` when ``data`` is not such a dict (a damaged cache entry).
    """
    from autobatch._finder import SearchResult
    from autobatch._trial import TrialRecord
    from autobatch.search import LinearModel

    try:
        model = data["memory_model"]
        return SearchResult(
            batch_size=int(data["batch_size"]),
            max_batch_size=int(data["max_batch_size"]),
            trials=tuple(
                TrialRecord(
                    size=int(t["size"]),
                    fits=bool(t["fits"]),
                    peak_bytes=None if t["peak_bytes"] is None else int(t["peak_bytes"]),
                    seconds=float(t["seconds"]),
                    error=t["error"],
                )
                for t in data["trials"]
            ),
            memory_model=None if model is None else LinearModel(
                fixed=float(model["fixed"]), per_sample=float(model["per_sample"])
            ),
            capacity_bytes=int(data["capacity_bytes"]),
            device=str(data["device"]),
            headroom=float(data["headroom"]),
            train=bool(data["train"]),
            optimizer_counted=bool(data["optimizer_counted"]),
            smallest_failing=(
                None if data["smallest_failing"] is None else int(data["smallest_failing"])
            ),
            notes=tuple(str(n) for n in data["notes"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"not a stored search result: {error!r}") from None


def cached_search(
    store: ResultCache | None,
    key: Callable[[], str],
    run: Callable[[], SearchResult],
) -> tuple[SearchResult, Path | None]:
    """``(result, file)``: the result stored under ``key()`` and its file when there is a good
    one, else ``run()``'s result (stored) and None. ``key`` is called only when ``store`` is set.
    A stored entry that does not parse as a result is a miss, with a warning.
    """
    if store is None:
        return run(), None
    name = key()
    file = store.file_for(name)
    stored = store.get(name)
    if stored is not None:
        try:
            result = result_from_dict(stored)
        except ValueError as error:
            warnings.warn(
                f"autobatch cache: ignoring {file} ({error}); measuring again", stacklevel=2
            )
        else:
            note = f"from the cache ({file}); cache=False measures again"
            return replace(result, notes=(*result.notes, note)), file
    result = run()
    store.put(name, result_to_dict(result))
    return result, None
