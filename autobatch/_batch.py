"""The structure of a batch: its size, its pieces, and how to put the pieces back together.

A batch is a tensor, or a nest of mappings (``dict``, its subclasses, ``UserDict`` subclasses such
as Hugging Face's ``BatchEncoding``), named tuples, dataclass instances, tuples and lists. Its
leaves are of three kinds:

* **batched tensors**: tensors with at least one dimension; dimension 0 is the batch dimension.
* **per-sample lists**: a non-empty list none of whose items is a tensor or a container (file
  names, ids, ...). Its length is the batch size and it is split along with the tensors. A tuple
  of such items is per-sample too when its length is the batch size that the batch's tensors and
  lists set (ids collated with ``zip(*samples)``); a tuple of another length (an image size, a
  crop box) is a broadcast leaf. A tuple that merely happens to be as long as the batch is
  ambiguous (:func:`ambiguous_paths`): mark a per-batch one with :func:`per_batch`.
* **broadcast leaves**: everything else (an ``int`` epoch, a ``str`` flag, ``None``, a
  ``torch.Size``, a value marked with :func:`per_batch`), and zero-dimensional tensors, which have
  no batch dimension. They are copied unchanged into every piece.

A list or tuple holding a tensor or a container is a structure, not a per-sample list, and so is
an empty one (a slice with no rows turns a per-sample list into one).
Containers are rebuilt with their own type: named tuples with ``_make``, dataclasses with
``dataclasses.replace`` (fields with ``init=False`` are recomputed, not traversed), mappings and
sequences with ``type(b)(items)``, falling back to ``dict``/``list``/``tuple`` when that constructor
refuses. This module knows nothing about memory.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from autobatch._validate import check_int

__all__ = [
    "Batch",
    "PerBatchList",
    "PerBatchTuple",
    "ambiguous_paths",
    "batch_size",
    "concat_batches",
    "describe",
    "elements_per_sample",
    "map_tensors",
    "move_batch",
    "per_batch",
    "resize_batch",
    "shape_key",
    "slice_batch",
    "split_batch",
    "tensors",
    "uncollated",
]

Batch = Any
"""A tensor or a nest of mappings, named tuples, dataclasses, tuples and lists (see the module doc)."""

_Kind = Literal["tensor", "samples", "broadcast", "mapping", "namedtuple", "dataclass", "sequence"]
_CONTAINERS = frozenset({"mapping", "namedtuple", "dataclass", "sequence"})
_KIND_TEXT = {
    "tensor": "a batched tensor",
    "samples": "a per-sample list",
    "broadcast": "a value without batch dimension",
    "mapping": "a mapping",
    "namedtuple": "a named tuple",
    "dataclass": "a dataclass",
    "sequence": "a list or tuple of tensors or containers",
}
_ROOT = "batch"


class PerBatchTuple(tuple):  # type: ignore[type-arg]
    """A tuple marked as one value for the whole batch (see :func:`per_batch`)."""

    __slots__ = ()


class PerBatchList(list):  # type: ignore[type-arg]
    """A list marked as one value for the whole batch (see :func:`per_batch`)."""


def per_batch(value: Sequence[Any]) -> Sequence[Any]:
    """Mark a list or tuple as one value for the whole batch, copied whole into every piece.

    The result is a ``tuple`` (or ``list``) subclass equal to ``value``, so the model sees the
    same value; only the splitting treats it differently.

    >>> import torch
    >>> batch = {"x": torch.zeros(2, 3), "size": per_batch((224, 448))}
    >>> [piece["size"] for piece in split_batch(batch, 1)]
    [(224, 448), (224, 448)]

    Args:
        value: a tuple or list, e.g. an image size that may be as long as the batch.
    """
    if isinstance(value, tuple) and not hasattr(type(value), "_fields"):
        return value if isinstance(value, PerBatchTuple) else PerBatchTuple(value)
    if isinstance(value, list):
        return value if isinstance(value, PerBatchList) else PerBatchList(value)
    raise TypeError(
        f"per_batch marks a list or a tuple, got {type(value).__name__}; other values without a "
        "batch dimension (numbers, strings, zero-dimensional tensors) are per-batch already"
    )


def _kind(x: object) -> _Kind:
    if isinstance(x, torch.Tensor):
        return "tensor" if x.dim() > 0 else "broadcast"
    if isinstance(x, Mapping):
        return "mapping"
    if isinstance(x, str | bytes | torch.Size | PerBatchTuple | PerBatchList):
        return "broadcast"
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return "namedtuple"
    if isinstance(x, list | tuple):
        plain = all(not isinstance(e, torch.Tensor) and _kind(e) == "broadcast" for e in x)
        return "samples" if x and plain else "sequence"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return "dataclass"
    return "broadcast"


def uncollated(batch: Batch) -> bool:
    """Whether ``batch`` is a list or tuple of two or more per-row mappings with the same keys
    (samples not collated yet): its rows are the items, not dimension 0 of their tensors.

    >>> uncollated([{"x": torch.zeros(3)}, {"x": torch.ones(3)}]), uncollated({"x": [1, 2]})
    (True, False)
    """
    return (
        isinstance(batch, list | tuple) and len(batch) > 1
        and all(isinstance(row, Mapping) for row in batch)
        and all(row.keys() == batch[0].keys() for row in batch)
    )


def _children(x: Any, kind: _Kind) -> list[tuple[Any, str, Any]]:
    """``(key, path segment, child)`` for each child of the container ``x``."""
    if kind == "mapping":
        return [(k, f"[{k!r}]", v) for k, v in x.items()]
    if kind == "namedtuple":
        return [(name, f".{name}", v) for name, v in zip(x._fields, x, strict=True)]
    if kind == "dataclass":
        names = [f.name for f in dataclasses.fields(x) if f.init]
        return [(name, f".{name}", getattr(x, name)) for name in names]
    return [(i, f"[{i}]", v) for i, v in enumerate(x)]


def _rebuild_sequence(template: Any, items: list[Any]) -> Any:
    try:
        return type(template)(items)
    except Exception:
        return list(items) if isinstance(template, list) else tuple(items)


def _rebuild(template: Any, kind: _Kind, items: list[tuple[Any, Any]]) -> Any:
    if kind == "mapping":
        values = dict(items)
        if type(template) is dict:
            return values
        if isinstance(template, defaultdict):
            return type(template)(template.default_factory, values)
        try:
            return type(template)(values)
        except Exception:
            return values
    if kind == "namedtuple":
        return type(template)._make(v for _, v in items)
    if kind == "dataclass":
        return dataclasses.replace(template, **dict(items))
    return _rebuild_sequence(template, [v for _, v in items])


def _leaves(batch: Batch, path: str = _ROOT) -> Iterator[tuple[str, Any]]:
    kind = _kind(batch)
    if kind not in _CONTAINERS:
        yield path, batch
        return
    for _, segment, child in _children(batch, kind):
        yield from _leaves(child, path + segment)


def _walk(fn: Callable[[str, list[Any]], Any], batches: list[Any], path: str = _ROOT) -> Any:
    """Apply ``fn(path, leaves)`` to matching leaves of ``batches`` and rebuild the first's structure."""
    first = batches[0]
    kinds = [_kind(b) for b in batches]
    if "samples" in kinds and all(
        k == "samples" or (k == "sequence" and not b) for k, b in zip(kinds, batches, strict=True)
    ):
        return fn(path, batches)  # a per-sample list sliced to no rows is an empty sequence
    kind = kinds[0]
    for i, (other, other_kind) in enumerate(zip(batches, kinds, strict=True)):
        if other_kind != kind or (
            kind in ("namedtuple", "dataclass") and type(other) is not type(first)
        ):
            raise ValueError(
                f"batches differ in structure: {path} is {_KIND_TEXT[kind]} ({type(first).__name__}) "
                f"in batch 0 but {_KIND_TEXT[other_kind]} ({type(other).__name__}) in batch {i}"
            )
    if kind not in _CONTAINERS:
        return fn(path, batches)
    children = _children(first, kind)
    keys = [key for key, _, _ in children]
    others: list[dict[Any, Any]] = []
    for i, other in enumerate(batches[1:], start=1):
        other_children = {key: child for key, _, child in _children(other, kind)}
        if kind == "sequence" and len(other_children) != len(keys):
            raise ValueError(
                f"batches differ in structure: {path} has {len(keys)} items in batch 0 "
                f"but {len(other_children)} in batch {i}"
            )
        if len(other_children) != len(keys) or any(key not in other_children for key in keys):
            raise ValueError(
                f"batches differ in structure: {path} has keys {keys!r} in batch 0 "
                f"but {list(other_children)!r} in batch {i}"
            )
        others.append(other_children)
    items = [
        (key, _walk(fn, [child, *(o[key] for o in others)], path + segment))
        for key, segment, child in children
    ]
    return _rebuild(first, kind, items)


def _size_text(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"shape {tuple(leaf.shape)}"
    return f"{len(leaf)} items"


def _is_tuple_of_values(leaf: Any) -> bool:
    """A plain tuple of plain values: per-sample only when as long as the batch."""
    return isinstance(leaf, tuple) and _kind(leaf) == "samples"


def _per_sample(leaf: Any, size: int) -> bool:
    """Whether a ``"samples"`` leaf is split with the batch of ``size`` rows."""
    return not _is_tuple_of_values(leaf) or len(leaf) == size


def _sizes(batch: Batch) -> tuple[dict[int, str], dict[int, str]]:
    """Sizes of dimension 0 with the first leaf that has each: of the tensors and lists, and of
    the plain tuples (which set the batch size only where nothing else does)."""
    strong: dict[int, str] = {}
    weak: dict[int, str] = {}
    for path, leaf in _leaves(batch):
        kind = _kind(leaf)
        if kind == "broadcast":
            continue
        size = leaf.shape[0] if kind == "tensor" else len(leaf)
        target = weak if _is_tuple_of_values(leaf) else strong
        target.setdefault(size, f"{path} has {_size_text(leaf)}")
    return strong, weak


def batch_size(batch: Batch) -> int:
    """Return the size of dimension 0 shared by every batched tensor and per-sample list.

    >>> import torch
    >>> batch_size({"x": torch.zeros(8, 3), "names": [f"img{i}.png" for i in range(8)], "epoch": 2})
    8

    Args:
        batch: a tensor or a nest of containers (see the module documentation).

    Raises:
        ValueError: the sizes differ; the message names the leaves and their shapes.
        TypeError: the batch holds no batched tensor and no per-sample list.
    """
    strong, weak = _sizes(batch)
    first = strong or weak
    if not first:
        raise TypeError(
            "a batch must hold at least one tensor with a batch dimension (dim 0) or a non-empty "
            f"per-sample list, got {describe(batch)}; a batch is a tensor or a nest of mappings, "
            "named tuples, dataclasses, tuples and lists of them (zero-dimensional tensors and "
            "scalars are copied into every piece and do not set the batch size)"
        )
    if len(first) > 1:
        texts = list(first.values())
        raise ValueError(f"batch dimension 0 differs: {texts[0]} but {' and '.join(texts[1:])}")
    return next(iter(first))


def ambiguous_paths(batch: Batch) -> list[str]:
    """Return the paths of plain tuples that are split as per-sample only because their length
    happens to equal the batch size (an image size in a batch of two rows, say).

    >>> import torch
    >>> ambiguous_paths({"x": torch.zeros(2, 3), "size": (224, 448), "crop": (0, 0, 9)})
    ["batch['size']"]

    Args:
        batch: a tensor or a nest of containers (see the module documentation).
    """
    strong, _ = _sizes(batch)
    if len(strong) != 1:
        return []
    size = next(iter(strong))
    return [path for path, leaf in _leaves(batch) if _is_tuple_of_values(leaf) and len(leaf) == size]


def _slice(batch: Batch, start: int, stop: int, size: int) -> Batch:
    def piece(path: str, leaves: list[Any]) -> Any:
        leaf = leaves[0]
        kind = _kind(leaf)
        if kind == "tensor":
            return leaf[start:stop]
        if kind == "samples" and _per_sample(leaf, size):
            return _rebuild_sequence(leaf, list(leaf[start:stop]))
        return leaf

    return _walk(piece, [batch])


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Return rows ``[start, stop)`` of ``batch`` with the same structure (tensors are views).

    >>> import torch
    >>> slice_batch({"x": torch.arange(6), "ids": list("abcdef")}, 1, 3)
    {'x': tensor([1, 2]), 'ids': ['b', 'c']}

    Args:
        batch: a tensor or a nest of containers (see the module documentation).
        start: the first row, ``0 <= start <= stop``.
        stop: one past the last row, ``stop <= batch_size(batch)``.
    """
    start = check_int("start", start, minimum=None)
    stop = check_int("stop", stop, minimum=None)
    size = batch_size(batch)
    if not 0 <= start <= stop <= size:
        raise ValueError(
            f"slice_batch needs 0 <= start <= stop <= batch size ({size}), "
            f"got start={start}, stop={stop}"
        )
    return _slice(batch, start, stop, size)


def split_batch(batch: Batch, piece_size: int) -> list[Batch]:
    """Split ``batch`` in order into pieces of ``piece_size`` rows; the last one may be smaller.

    A batch of size 0 gives no pieces.

    >>> import torch
    >>> [batch_size(p) for p in split_batch(torch.zeros(10, 2), 4)]
    [4, 4, 2]

    Args:
        batch: a tensor or a nest of containers (see the module documentation).
        piece_size: rows per piece, at least 1.
    """
    piece_size = check_int("piece_size", piece_size)
    size = batch_size(batch)
    return [_slice(batch, s, min(s + piece_size, size), size) for s in range(0, size, piece_size)]


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
            and torch.equal(a, b)
        )
    try:
        return bool(a == b)
    except Exception:
        return False


def _concat(sizes: list[int]) -> Callable[[str, list[Any]], Any]:
    def join(path: str, leaves: list[Any]) -> Any:
        first = leaves[0]
        kind = _kind(first)
        if any(_kind(leaf) == "samples" for leaf in leaves) and all(
            _kind(leaf) != "samples" or _per_sample(leaf, n)
            for leaf, n in zip(leaves, sizes, strict=True)
        ):
            return _rebuild_sequence(first, [item for leaf in leaves for item in leaf])
        if kind == "tensor":
            try:
                return torch.cat(leaves)
            except RuntimeError as error:
                raise ValueError(f"cannot concatenate {path}: {error}") from error
        for i, leaf in enumerate(leaves[1:], start=1):
            if not _same(first, leaf):
                raise ValueError(
                    f"cannot concatenate {path}: it has no batch dimension, so it must be equal "
                    f"in every batch, but batch 0 has {reprlib.repr(first)} and batch {i} has "
                    f"{reprlib.repr(leaf)}"
                )
        return first

    return join


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Join batches of the same structure along dimension 0, the inverse of `split_batch`.

    Tensors are joined with ``torch.cat``, per-sample lists are concatenated, and broadcast leaves
    must be equal in every batch.

    >>> import torch
    >>> concat_batches([{"x": torch.tensor([1]), "id": ["a"]}, {"x": torch.tensor([2]), "id": ["b"]}])
    {'x': tensor([1, 2]), 'id': ['a', 'b']}

    Args:
        batches: one or more batches with the same structure.
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch, got an empty sequence")
    sizes = []
    for batch in batches:
        try:
            sizes.append(batch_size(batch))
        except TypeError:
            sizes.append(0)  # a per-sample list sliced to no rows
    return _walk(_concat(sizes), list(batches))


def _like_layout(source: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    for dim, memory_format in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if (
            source.dim() == dim
            and not source.is_contiguous()
            and source.is_contiguous(memory_format=memory_format)
        ):
            return result.contiguous(memory_format=memory_format)
    return result.contiguous()


def resize_batch(sample: Batch, n: int) -> Batch:
    """Return a batch of exactly ``n`` rows made by cycling the rows of ``sample``.

    Tensors are fresh, contiguous (channels-last kept) and own their storage, with the sample's
    dtype and device and ``requires_grad=False``; zero-dimensional tensors are cloned.

    >>> import torch
    >>> resize_batch({"x": torch.tensor([10, 11, 12]), "id": ["a", "b", "c"]}, 7)
    {'x': tensor([10, 11, 12, 10, 11, 12, 10]), 'id': ['a', 'b', 'c', 'a', 'b', 'c', 'a']}

    Args:
        sample: a batch with at least one row (see the module documentation).
        n: the number of rows wanted, at least 1.
    """
    n = check_int("n", n)
    size = batch_size(sample)
    if size == 0:
        raise ValueError(
            f"cannot build {n} rows from a sample with 0 rows; pass a non-empty sample"
        )
    rows = [i % size for i in range(n)]
    index: dict[torch.device, torch.Tensor] = {}

    def grow(path: str, leaves: list[Any]) -> Any:
        leaf = leaves[0]
        kind = _kind(leaf)
        if kind == "tensor":
            if leaf.device not in index:
                index[leaf.device] = torch.tensor(rows, dtype=torch.long, device=leaf.device)
            return _like_layout(leaf, leaf.detach().index_select(0, index[leaf.device]))
        if kind == "samples" and _per_sample(leaf, size):
            return _rebuild_sequence(leaf, [leaf[i] for i in rows])
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone()
        return leaf

    return _walk(grow, [sample])


def tensors(batch: Batch) -> Iterator[torch.Tensor]:
    """Yield every tensor leaf of ``batch`` in order, zero-dimensional ones included.

    >>> import torch
    >>> [tuple(t.shape) for t in tensors((torch.zeros(4, 2), {"y": torch.zeros(4)}, "tag"))]
    [(4, 2), (4,)]

    Args:
        batch: a tensor or a nest of containers (see the module documentation).
    """
    for _, leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> Batch:
    """Return ``batch`` with ``fn`` applied to every tensor leaf and everything else unchanged.

    >>> import torch
    >>> map_tensors(lambda t: t * 2, {"x": torch.tensor([1, 2]), "id": ["a", "b"]})
    {'x': tensor([2, 4]), 'id': ['a', 'b']}

    Args:
        fn: called once per tensor leaf, zero-dimensional ones included.
        batch: a tensor or a nest of containers (see the module documentation).
    """

    def apply(path: str, leaves: list[Any]) -> Any:
        leaf = leaves[0]
        return fn(leaf) if isinstance(leaf, torch.Tensor) else leaf

    return _walk(apply, [batch])


def move_batch(
    batch: Batch, device: torch.device | str | int, non_blocking: bool = False, copy: bool = False
) -> Batch:
    """Return ``batch`` with every tensor leaf moved to ``device``, like a training loop's ``.to``.

    >>> import torch
    >>> move_batch({"x": torch.zeros(2)}, "cpu")["x"].device
    device(type='cpu')

    Args:
        batch: a tensor or a nest of containers (see the module documentation).
        device: where the tensors go.
        non_blocking: passed to ``Tensor.to``.
        copy: copy tensors already on ``device`` too (passed to ``Tensor.to``).
    """
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking, copy=copy), batch)


def elements_per_sample(batch: Batch) -> int:
    """Return the number of tensor elements per row, summed over the batched tensors.

    Zero-dimensional tensors do not count; a batch without batched tensors gives 0.

    >>> import torch
    >>> elements_per_sample({"ids": torch.zeros(8, 128), "labels": torch.zeros(8)})
    129

    Args:
        batch: a tensor or a nest of containers (see the module documentation).
    """
    return sum(math.prod(t.shape[1:]) for t in tensors(batch) if t.dim() > 0)


def shape_key(batch: Batch) -> tuple[tuple[str, tuple[int, ...] | None, torch.dtype], ...]:
    """Return a hashable key of each tensor's path, per-row shape and dtype, for per-shape caches.

    The batch dimension is left out, so batches that differ only in size share a key;
    zero-dimensional tensors have ``None`` as their shape.

    >>> import torch
    >>> shape_key({"x": torch.zeros(8, 3)}) == shape_key({"x": torch.ones(2, 3)})
    True

    Args:
        batch: a tensor or a nest of containers (see the module documentation).
    """
    return tuple(
        (path, tuple(leaf.shape[1:]) if leaf.dim() > 0 else None, leaf.dtype)
        for path, leaf in _leaves(batch)
        if isinstance(leaf, torch.Tensor)
    )


def _describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        dtype = str(leaf.dtype).removeprefix("torch.")
        device = "" if leaf.device.type == "cpu" else f" {leaf.device}"
        return f"{tuple(leaf.shape)} {dtype}{device}"
    if _kind(leaf) == "samples":
        item_types = {type(item).__name__ for item in leaf}
        of = f" {item_types.pop()}" if len(item_types) == 1 else ""
        return f"{type(leaf).__name__} of {len(leaf)}{of}"
    return reprlib.repr(leaf)


def describe(batch: Batch) -> str:
    """Return a short text of the batch's structure, shapes and dtypes, for logs and errors.

    >>> import torch
    >>> describe({"input_ids": torch.zeros(8, 128, dtype=torch.int64), "names": ["a"] * 8})
    'dict(input_ids: (8, 128) int64, names: list of 8 str)'

    Args:
        batch: a tensor or a nest of containers (see the module documentation).
    """
    kind = _kind(batch)
    if kind not in _CONTAINERS:
        return _describe_leaf(batch)
    if kind == "sequence" and len(batch) > 2:  # many alike (rows of a dataset): one of them
        texts = {describe(child) for child in batch}
        if len(texts) == 1:
            return f"{type(batch).__name__}({len(batch)} × {texts.pop()})"
    parts = []
    for key, _, child in _children(batch, kind):
        text = describe(child)
        if kind == "sequence":
            parts.append(text)
        else:
            parts.append(f"{key if isinstance(key, str) else repr(key)}: {text}")
    return f"{type(batch).__name__}({', '.join(parts)})"


def quick_rows(batch: Batch) -> int:
    """Rows of a batch for statistics only: a fast look at the first tensor (on every batch of
    the fast path), else batch_size."""
    first = batch
    while (type(first) is tuple or type(first) is list) and first:  # (not a namedtuple)
        first = first[0]
    if type(first) is torch.Tensor and first.ndim:
        return first.shape[0]
    try:
        return batch_size(batch)
    except (TypeError, ValueError):
        return 0
