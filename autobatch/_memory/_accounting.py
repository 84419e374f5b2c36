"""Byte accounting of live tensor storages, shared by the simulated GPU and the planner.

A :class:`StorageCount` counts every storage it is told about exactly once (views and shared
storages are one allocation) and forgets it when the storage dies. :class:`CountingMode` is the
``TorchDispatchMode`` that tells the count about the outputs of every operator, autograd's backward
operators and optimizer updates included. Sizes are rounded the way the CUDA caching allocator
rounds them (512-byte blocks), so the count's numbers are comparable with
``torch.cuda.memory_allocated``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from autobatch._memory._blocks import AllocatorOutOfMemory, Block

#: The CUDA caching allocator hands out blocks in multiples of 512 bytes (``kMinBlockSize`` in
#: c10/cuda/CUDACachingAllocator.cpp); ``memory_allocated`` reports the rounded sizes.
CUDA_BLOCK_BYTES = 512


def round_allocation(nbytes: int, block_bytes: int = CUDA_BLOCK_BYTES) -> int:
    """The bytes an allocator that rounds to ``block_bytes`` reserves for a request of ``nbytes``.

    >>> round_allocation(1), round_allocation(512), round_allocation(513), round_allocation(0)
    (512, 512, 1024, 0)
    """
    if nbytes <= 0:
        return 0
    return -(-nbytes // block_bytes) * block_bytes


def _storage_key(storage: torch.UntypedStorage) -> int:
    # The address of the C++ StorageImpl: the same for every view and every Python wrapper of it.
    return int(storage._cdata)


class StorageCount:
    """Live bytes, counted once per storage, with a running peak.

    ``block_bytes`` is the allocator's rounding (1 counts raw bytes).
    """

    def __init__(self, block_bytes: int = CUDA_BLOCK_BYTES) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes!r}")
        self.block_bytes = block_bytes
        self._live: dict[int, int] = {}
        self.allocated_bytes = 0
        self.peak_bytes = 0

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return _storage_key(storage) in self._live

    def size_of(self, storage: torch.UntypedStorage) -> int:
        """Bytes this count charges for ``storage`` (rounded)."""
        return round_allocation(storage.nbytes(), self.block_bytes)

    def add(self, storage: torch.UntypedStorage) -> int:
        """Start counting ``storage``; returns the bytes added (0 if it was already counted).

        A storage that grew in place (``resize_``) is charged for its new size.
        """
        key = _storage_key(storage)
        size = self.size_of(storage)
        old = self._live.get(key)
        if old is None:
            weakref.finalize(storage, self._release, key)
            old = 0
        added = size - old
        if added:
            self._live[key] = size
            self.allocated_bytes += added
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        elif key not in self._live:
            self._live[key] = size
        return added

    def _release(self, key: int) -> None:
        self.allocated_bytes -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        """Make the current live bytes the peak."""
        self.peak_bytes = self.allocated_bytes


class BlockAllocator(Protocol):
    """What :class:`AllocatorCount` needs of an allocator: the caching allocator's model."""

    def malloc(self, nbytes: int) -> Block: ...

    def free(self, block: Block) -> None: ...

    def reset_peak(self) -> None: ...


class AllocatorCount(StorageCount):
    """A count whose storages are blocks of the caching-allocator model.

    A new storage is one ``malloc`` of its size; its death frees the block. It is charged its
    block's size. A storage that changed size in place is given a new block before the old one
    is freed (``resize_`` on CUDA allocates, copies, then frees). When the model refuses,
    ``add`` raises the simulator's ``torch.OutOfMemoryError`` and the storage is not counted.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        refuse: Callable[[AllocatorOutOfMemory], torch.OutOfMemoryError],
    ) -> None:
        super().__init__(CUDA_BLOCK_BYTES)
        self.allocator = allocator
        self._refuse = refuse
        self._blocks: dict[int, Block] = {}

    def add(self, storage: torch.UntypedStorage) -> int:
        key = _storage_key(storage)
        nbytes = storage.nbytes()
        previous = self._blocks.get(key)
        old: int | None = None
        if previous is not None:
            if previous.requested == nbytes:
                return 0  # counted already (a view, an in-place operator)
            old = previous.size
        elif key in self._live:  # an empty storage, counted already
            if not nbytes:
                return 0
            old = 0
        block = None
        if nbytes:  # torch asks no allocator for an empty storage
            refused = None
            try:
                block = self.allocator.malloc(nbytes)
            except AllocatorOutOfMemory as error:
                refused = error
            if refused is not None:  # raised outside the except block: no context chain
                oom = self._refuse(refused)
                del refused  # its traceback holds this frame, and this frame the operator's
                try:  # outputs (through the caller's): no local may keep that cycle alive
                    raise oom
                finally:
                    del oom
        size = 0 if block is None else block.size
        if old is None:
            weakref.finalize(storage, self._release, key)
            old = 0
        elif previous is not None:  # resized in place: both blocks existed for a moment
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes + size)
            del self._blocks[key]
            self.allocator.free(previous)
        if block is not None:
            self._blocks[key] = block
        self._live[key] = size
        self.allocated_bytes += size - old
        if self.allocated_bytes > self.peak_bytes:
            self.peak_bytes = self.allocated_bytes
        return size - old

    def _release(self, key: int) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.allocator.free(block)
        super()._release(key)

    def reset_peak(self) -> None:
        super().reset_peak()
        self.allocator.reset_peak()


def storages(objects: Iterable[Any]) -> Iterator[torch.UntypedStorage]:
    """Every tensor storage reachable from modules, optimizers, tensors and nested containers.

    Modules give parameters, their gradients and buffers; optimizers give their state tensors
    (and the parameters they hold); containers are walked. A tensor subclass that wraps others
    (a DTensor, whose own storage stands for the whole tensor across ranks) gives the storages
    of the tensors it holds (a DTensor's local shard).
    """
    seen: set[int] = set()
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if _wraps(obj):
                stack.extend(_inner(obj))
            elif obj.layout is torch.strided:
                yield obj.untyped_storage()
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters())
            stack.extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            stack.extend(obj.state.values())
            for group in obj.param_groups:
                stack.extend(group["params"])
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "state_dict") and hasattr(obj, "_scale"):  # GradScaler
            stack.extend(v for v in vars(obj).values() if isinstance(v, torch.Tensor))


class DispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` that hands every operator to :meth:`dispatch`, its keyword
    arguments always a dict: the one place that spells out torch's dispatch protocol.

    >>> class Counting(DispatchMode):
    ...     calls = 0
    ...     def dispatch(self, func, args, kwargs):
    ...         self.calls += 1
    ...         return super().dispatch(func, args, kwargs)
    >>> with Counting() as mode:
    ...     _ = torch.ones(2) + 1
    >>> mode.calls
    2
    """

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.dispatch(func, args, kwargs or {})

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one operator; by default as it is.

        Args:
            func: The operator (an ``OpOverload``).
            args: Its positional arguments.
            kwargs: Its keyword arguments.
        """
        return func(*args, **kwargs)


class CountingMode(DispatchMode):
    """Tells a count about every storage an operator creates or grows.

    ``check(added_bytes)`` runs after each operator that added bytes, with the count already
    updated. When it returns an exception, the operator's outputs are dropped (so the count is
    back where it was before the operator) and the exception is raised from a frame that holds
    none of them. A count that models an allocator may refuse a storage itself: its ``add``
    raises ``torch.OutOfMemoryError``, and the outputs are dropped and the error raised the
    same way.
    """

    def __init__(
        self,
        counted: StorageCount,
        check: Callable[[int], BaseException | None] | None = None,
    ) -> None:
        super().__init__()
        self.counted = counted
        self.check = check

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        peak_before = self.counted.peak_bytes
        out = call_keeping_versions(func, args, kwargs)
        error: BaseException | None = None
        try:
            added = self._count(func, out, args, kwargs)
        except torch.OutOfMemoryError as refused:
            # The count's allocator could not place one output. Its traceback holds the
            # frames that hold the outputs: drop it. The outputs placed before that one were
            # allocated (on a GPU too), so the peak keeps them.
            error = refused.with_traceback(None)
        else:
            if added > 0 and self.check is not None:
                error = self.check(added)
                if error is not None:  # the outputs were counted after the fact: on a GPU,
                    self.counted.peak_bytes = peak_before  # they were never all allocated
        if error is not None:
            del out  # the rejected outputs die here, before the error is raised
            try:
                raise error
            finally:  # no local may point at the error: error -> traceback -> this frame
                del error  # would be a cycle that keeps the failed step alive until gc
        return out

    def _count(self, func: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        inputs = _tensors(args)
        if kwargs:
            inputs += _tensors(tuple(kwargs.values()))
        # Only an operator whose schema lets a result alias an argument (views, in-place and
        # out= operators) can return a storage it did not create.
        input_keys = (
            {_storage_key(t.untyped_storage()) for t in inputs if _has_storage(t)}
            if _may_alias(func)
            else set()
        )
        added = 0
        for tensor in _tensors((out,)):
            if not _has_storage(tensor):
                continue
            storage = tensor.untyped_storage()
            if (
                _storage_key(storage) in input_keys
                and storage not in self.counted
                and func is not LIFT_FRESH
            ):
                continue  # a view of a tensor this count does not own
            added += self.counted.add(storage)
        if _is_mutable(func):  # in-place and out= operators may grow a storage
            for tensor in inputs:
                if _has_storage(tensor) and tensor.untyped_storage() in self.counted:
                    added += self.counted.add(tensor.untyped_storage())
        return added


# ``torch.tensor(data)`` builds its tensor below the dispatcher and hands it to ``lift_fresh``:
# the input of that operator is a new allocation, not a tensor that existed before.
LIFT_FRESH = torch.ops.aten.lift_fresh.default


#: Operators that write arguments their schema does not mark: name -> the written arguments
#: (by name), and the boolean argument that must be true for the write to happen (``None``:
#: always). The batch norm kernels update ``running_mean`` and ``running_var`` in training
#: with no alias annotation and no version bump (checked in torch 2.13;
#: ``tests/test_ledger.py`` checks that each entry still writes what it says).
HIDDEN_WRITES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "aten::native_batch_norm": (("running_mean", "running_var"), "training"),
    "aten::cudnn_batch_norm": (("running_mean", "running_var"), "training"),
    "aten::miopen_batch_norm": (("running_mean", "running_var"), "training"),
    "aten::_batch_norm_impl_index": (("running_mean", "running_var"), "training"),
    "aten::batch_norm_update_stats": (("running_mean", "running_var"), None),
    "aten::batch_norm_gather_stats": (("running_mean", "running_var"), None),
    "aten::batch_norm_gather_stats_with_counts": (("running_mean", "running_var"), None),
}

#: Operator namespaces that communicate with other ranks: c10d's own operators and the
#: functional collectives that DTensor and FSDP2 issue.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


@dataclass(frozen=True)
class OpFacts:
    """What one operator overload does to its arguments, read from its schema and
    :data:`HIDDEN_WRITES`: ``writes``, the positions and names of the arguments it writes;
    ``when``, the position of the flag a hidden write needs (``None``: unconditional);
    ``fresh``, its results are new storages (no return may alias an argument);
    ``collective``, it communicates with other ranks; ``foreach_write``, a ``_foreach_``
    operator that writes (see :func:`call_keeping_versions`)."""

    name: str
    writes: tuple[tuple[int, str], ...]
    when: int | None
    fresh: bool
    collective: bool
    foreach_write: bool = False


@functools.cache
def op_facts(func: Any) -> OpFacts:
    """The :class:`OpFacts` of an ``OpOverload`` (schemas do not change: cached)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return OpFacts(str(func), (), None, False, False)
    arguments = schema.arguments
    writes = [
        (i, a.name) for i, a in enumerate(arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    when = None
    hidden = HIDDEN_WRITES.get(schema.name)
    if hidden is not None:
        names, flag = hidden
        writes += [(i, a.name) for i, a in enumerate(arguments) if a.name in names]
        if flag is not None:
            when = next((i for i, a in enumerate(arguments) if a.name == flag), None)
    return OpFacts(
        name=str(schema.name),
        writes=tuple(writes),
        when=when,
        fresh=not any(r.alias_info is not None for r in schema.returns),
        collective=getattr(func, "namespace", "") in COLLECTIVE_NAMESPACES,
        foreach_write=_is_foreach_write(func),
    )


def written_tensors(
    facts: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors one call of an operator writes (a DTensor stands for its local shard)."""
    if facts.when is not None:
        flag = args[facts.when] if facts.when < len(args) else kwargs.get("training", True)
        if not flag:
            return []
    found: list[torch.Tensor] = []
    for index, name in facts.writes:
        value = args[index] if index < len(args) else kwargs.get(name)
        found += _tensors((value,))
    return found


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an operator writes to in place."""
    return written_tensors(op_facts(func), args, kwargs)


def call_keeping_versions(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` from inside a dispatch mode, with the version counters of the
    tensors it writes bumped as they are outside one.

    Below a Python dispatch mode, in-place ``_foreach_*`` operators (the optimizers' default
    path) write without counting a modification, where outside one they count it; code that
    tells from version counters whether an optimizer step began changing the parameters would
    then be misled by the mode itself. (Other in-place operators count it after the mode
    returns, and ``_fused_*`` ones never do: both are left as they are.)
    """
    written = _written(func, args, kwargs) if _is_foreach_write(func) else []
    if not written:
        return func(*args, **kwargs)
    versions = [t._version for t in written]
    out = func(*args, **kwargs)
    stale = [t for t, v in zip(written, versions, strict=True) if t._version == v]
    if stale:
        torch._C._increment_version(stale)
    return out


# Schemas do not change: each answer below is computed once per operator.


@functools.cache
def _is_foreach_write(func: Any) -> bool:
    """Whether an operator is a ``_foreach_`` operator that writes to its arguments."""
    schema = getattr(func, "_schema", None)
    return (
        schema is not None and schema.name.startswith("aten::_foreach_") and schema.is_mutable
    )


@functools.cache
def _is_mutable(func: Any) -> bool:
    """Whether an operator writes to any of its arguments."""
    schema = getattr(func, "_schema", None)
    return schema is None or bool(schema.is_mutable)


@functools.cache
def _may_alias(func: Any) -> bool:
    """Whether an operator's schema lets a result share storage with an argument."""
    schema = getattr(func, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _tensors(values: tuple[Any, ...] | list[Any]) -> list[torch.Tensor]:
    """The tensors among operator arguments or results (which nest only in lists and tuples);
    a tensor subclass that wraps others (a DTensor) stands for the tensors it holds."""
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            if _wraps(value):
                found += _tensors(_inner(value))
            else:
                found.append(value)
        elif isinstance(value, (list, tuple)):
            found += _tensors(value)
    return found


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _wraps(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a subclass that wraps others (plain tensors and parameters are
    told apart by their type alone: this runs for every argument of every operator)."""
    return type(tensor) not in _PLAIN and bool(is_traceable_wrapper_subclass(tensor))


def _inner(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass holds (``__tensor_flatten__``): a DTensor's local shard."""
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return [t for t in (getattr(tensor, name) for name in names) if isinstance(t, torch.Tensor)]


def _has_storage(tensor: torch.Tensor) -> bool:
    return tensor.layout is torch.strided and not tensor.is_nested
