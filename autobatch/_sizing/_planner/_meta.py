"""The training step on ``meta`` (or on the CPU, for steps ``meta`` cannot run): copies of the
model and optimizer, template batches of any size, and every storage the step creates counted.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
from torch.utils._pytree import tree_flatten

from autobatch import _batch
from autobatch._errors import AutobatchError
from autobatch._memory._accounting import (
    AllocatorCount,
    CountingMode,
    StorageCount,
    _storage_key,
    storages,
)
from autobatch._memory._allocator import CachingAllocator
from autobatch._memory._blocks import AllocatorOutOfMemory
from autobatch._search import Trial
from autobatch._sizing._planner._attention import FusedAttention
from autobatch._sizing._planner._plans import PlanBreakdown
from autobatch._sizing._state import SavedState
from autobatch._sizing._trial import CACHING_STEPS, MAX_STEADY_STEPS
from autobatch._sizing._workload import (
    Batch,
    LossFn,
    OptimizerLike,
    Sample,
    StepFn,
    TrainingStep,
    check_default_step,
    collated,
    is_compiled,
    make_optimizer,
    prime_optimizer,
    without_compiled,
)
from autobatch._validate import is_sample_factory

_ATTENTION_OPS = frozenset(
    {
        torch.ops.aten._safe_softmax.default,
        torch.ops.aten.scaled_dot_product_attention.default,
        torch.ops.aten._scaled_dot_product_attention_math.default,
    }
)
# Operators that may read a real tensor: they copy it (e.g. ``torch.tensor(...).to(x.device)``).
_COPIES_REAL = frozenset(
    {
        torch.ops.aten._to_copy.default,
        torch.ops.aten.lift_fresh.default,
        torch.ops.aten.lift_fresh_copy.default,
    }
)


class _PlanCount(StorageCount):
    """Counts the planned device's storages only (``meta`` stands for the device)
    and, when asked, remembers which storages were alive at its peak."""

    def __init__(self, block_bytes: int, device_types: frozenset[str]) -> None:
        super().__init__(block_bytes)
        self.device_types = device_types
        self.record_peak = False
        self.at_peak: dict[int, int] = {}  # storage key -> serial, for storages alive at the peak
        self._serials: dict[int, int] = {}
        self._next_serial = 0

    def charge(self, storage: torch.UntypedStorage) -> int:
        """The bytes charged for ``storage`` (0 for storages off the device)."""
        return self.size_of(storage) if storage.device.type in self.device_types else 0

    def add(self, storage: torch.UntypedStorage) -> int:
        if storage.device.type not in self.device_types:
            return 0
        key = _storage_key(storage)
        if key not in self._live:  # a new storage: serials tell it from an earlier one's address
            self._next_serial += 1
            self._serials[key] = self._next_serial
        peak = self.peak_bytes
        added = super().add(storage)
        if self.record_peak and self.peak_bytes > peak:
            self.snapshot()
        return added

    def _release(self, key: int) -> None:
        super()._release(key)
        self._serials.pop(key, None)

    def snapshot(self) -> None:
        """Remember the storages alive now as those alive at the peak."""
        self.at_peak = {key: self._serials[key] for key in self._live}

    def alive_at_peak(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` (alive now) was alive at the recorded peak."""
        key = _storage_key(storage)
        serial = self._serials.get(key)
        return serial is not None and self.at_peak.get(key) == serial


class _PlanBlocks(AllocatorCount):
    """The planned device's storages (as :class:`_PlanCount` tells them) as blocks of a model of
    its caching allocator."""

    def __init__(self, allocator: CachingAllocator, device_types: frozenset[str]) -> None:
        super().__init__(allocator, _refused)
        self.device_types = device_types
        #: Every storage's birth and death in order, as a trial records them
        #: (``(0, serial, bytes)``, ``-1`` bytes: died): to replay the loop at other sizes.
        self.events: list[tuple[int, int, int]] = []
        self._serials: dict[int, int] = {}

    def add(self, storage: torch.UntypedStorage) -> int:
        if storage.device.type not in self.device_types:
            return 0
        key, nbytes = _storage_key(storage), storage.nbytes()
        serial = self._serials.get(key)
        known = key in self._live
        added = super().add(storage)
        if not known or (serial is not None and self.events[serial][2] != nbytes):
            if nbytes:
                self._serials[key] = len(self.events)
                self.events.append((0, len(self.events), nbytes))
            if serial is not None:  # resized in place: a new block, then the old one freed
                self.events.append((0, serial, -1))
        return added

    def _release(self, key: int) -> None:
        serial = self._serials.pop(key, None)
        if serial is not None:
            self.events.append((0, serial, -1))
        super()._release(key)


class _PlanMode(CountingMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """The plan's counting mode: it also remembers the operator running (and the backward node),
    and refuses operators on real data, so the step can never read or change a real tensor."""

    def __init__(self, counted: StorageCount, *, real: bool = False) -> None:
        super().__init__(counted)
        self.op: Any = None
        self.failed_op: Any = None
        self.node: str | None = None
        self.attention = False
        self.real = real  # real CPU copies: tensors of the copies and of the step only
        self.segments: list[int] | None = None  # per-operator peaks, while recorded
        self.foreign = False  # the step used a tensor from outside the planner's copies
        self.known: set[int] = set()  # storages of the copies left out of the count

    def _foreign(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` comes from outside the copies (the user's own model, say)."""
        if not self.real:
            return tensor.device.type != "meta"
        if tensor.layout is not torch.strided or tensor.is_nested:
            return False
        storage = tensor.untyped_storage()
        return storage not in self.counted and _storage_key(storage) not in self.known

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.op = func
        node = torch._C._current_autograd_node()
        self.node = None if node is None else node.name()
        if func in _ATTENTION_OPS:
            self.attention = True
        if self.segments is not None:  # a new operator: the segment before it ends
            self.segments.append(self.counted.peak_bytes)
            self.counted.reset_peak()
        if func not in _COPIES_REAL:
            for value in tree_flatten((args, kwargs))[0]:
                if (
                    isinstance(value, torch.Tensor)
                    and (value.numel() > 1 or value.requires_grad)
                    and self._foreign(value)
                ):
                    self.failed_op = func
                    self.foreign = True
                    grad = ", requires grad" if value.requires_grad else ""
                    raise RuntimeError(
                        f"it was given a real tensor ({value.device}, shape "
                        f"{tuple(value.shape)}{grad}) from outside the planned copies of the "
                        "model, optimizer and batch; a step_fn or loss_fn must use the model it "
                        "is given (register other tensors as buffers of the model)"
                    )
        try:
            return super().dispatch(func, args, kwargs)
        except BaseException:
            self.failed_op = func
            raise


class _StepError(AutobatchError):
    """The planned step cannot run on the planner's copies."""


def _refused(error: AllocatorOutOfMemory) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"the planned device runs out of memory: {error}")


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta.requires_grad_(tensor.requires_grad)


def _tensors_of(objects: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Every value of the modules (parameters, buffers, plain tensor attributes) and optimizers
    (parameters, state) that may be a tensor, with whether it is optimizer state."""
    for obj in objects:
        if isinstance(obj, nn.Module):
            for module in obj.modules():
                for value in tree_flatten(list(vars(module).values()))[0]:
                    yield value, False
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for param in group["params"]:
                    yield param, False
            for state in obj.state.values():
                for value in tree_flatten(state)[0]:
                    yield value, True


def _meta_memo(objects: Iterable[Any]) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that turns every tensor of the modules and optimizers into a meta
    tensor of the same shape, dtype, strides and ``requires_grad``, without reading its data.

    Optimizer state that lives on the host as a zero-dimensional tensor (Adam's ``step`` when not
    capturable) is copied as it is: the optimizer reads its value.
    """
    memo: dict[int, Any] = {}
    for value, state in _tensors_of(objects):
        if isinstance(value, torch.Tensor) and id(value) not in memo:
            host_scalar = state and value.dim() == 0 and value.device.type == "cpu"
            memo[id(value)] = value.clone() if host_scalar else _meta_like(value)
    return memo


def _real_memo(objects: Iterable[Any]) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that copies every tensor of the modules and optimizers to the
    CPU (same values, dtype and ``requires_grad``): the planner's real copies, for steps that
    cannot run on ``meta``."""
    memo: dict[int, Any] = {}
    for value, _ in _tensors_of(objects):
        if isinstance(value, torch.Tensor) and id(value) not in memo:
            if value.device.type == "meta":
                raise AutobatchError(
                    "the model is on the meta device: it has no values for the real steps the "
                    "planner needs here"
                )
            copied = value.detach().to("cpu", copy=True)
            if isinstance(value, nn.Parameter):
                memo[id(value)] = nn.Parameter(copied, requires_grad=value.requires_grad)
            else:
                memo[id(value)] = copied.requires_grad_(value.requires_grad)
    return memo


def _optimizer_as_on(optimizer: torch.optim.Optimizer, device_type: str) -> list[str]:
    """Make the meta optimizer use the implementation torch picks on ``device_type``; notes."""
    notes = []
    foreach = device_type in _get_foreach_kernels_supported_devices()
    for group in optimizer.param_groups:
        if group.get("fused"):
            group["fused"] = False
            group["foreach"] = False
            notes.append(
                "fused optimizer planned with its single-tensor implementation: its temporaries "
                "(about two of the largest parameter) are counted, the fused kernel has none"
            )
        elif "foreach" in group and group["foreach"] is None:
            group["foreach"] = foreach
    return notes[:1]


def _template(sample: Sample) -> tuple[Batch, str | None]:
    """The sample as meta tensors (no data read); a callable sample is called for one row."""
    note = None
    if is_sample_factory(sample):
        sample = collated(sample(1))
        got = _batch.batch_size(sample)
        if got != 1:
            raise ValueError(f"sample(1) returned a batch of {got} rows, expected 1")
        note = "sample is callable: planned with the row of sample(1), repeated"
    if _batch.batch_size(sample) < 1:
        raise ValueError("sample has no rows; give at least one example along dimension 0")
    return _batch.map_tensors(lambda t: torch.empty_like(t, device="meta"), sample), note


def _grow(template: Batch, n: int) -> Batch:
    """A meta batch of ``n`` rows shaped like ``resize_batch(sample, n)``."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return torch.empty_like(t)
        fresh = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device="meta")
        return _batch._like_layout(t, fresh)

    batch = _batch.map_tensors(rows, template)
    try:
        same = _batch.batch_size(batch) == n
    except ValueError:  # per-sample lists keep the sample's length
        same = False
    return batch if same else _batch.resize_batch(template, n)


class _MetaSetup:
    """Meta copies of the model, optimizer and loss module, and the planned step at any size."""

    def __init__(
        self,
        model: nn.Module,
        sample: Sample,
        optimizer: OptimizerLike,
        *,
        loss_fn: LossFn | None,
        step_fn: StepFn | None,
        train: bool,
        device_type: str,
        block_bytes: int,
        real: bool = False,
    ) -> None:
        self.notes: list[str] = []
        self.real = real
        self.sample = sample
        originals = [model, loss_fn, optimizer if train else None]
        memo = (_real_memo if real else _meta_memo)(x for x in originals if x is not None)
        try:
            self.model: nn.Module = copy.deepcopy(model, memo)
            if isinstance(loss_fn, nn.Module):
                loss_fn = copy.deepcopy(loss_fn, memo)
            if train and isinstance(optimizer, torch.optim.Optimizer):
                optimizer = copy.deepcopy(optimizer, memo)
        except Exception as error:
            raise AutobatchError(
                f"plan_max_batch cannot copy the model to the meta device "
                f"({type(error).__name__}: {error}); use autobatch.find_max_batch, which runs "
                "real steps, instead"
            ) from error
        if is_compiled(self.model):  # the copy's compiled code must never meet the counting
            self.model = without_compiled(self.model)[0]  # mode (it would stay eager for good)
            self.notes.append("compiled model planned eagerly (the compiled graph's memory "
                              "may differ)")
        self.optimizer = make_optimizer(optimizer if train else None, self.model)
        if self.optimizer is not None:
            self.notes += _optimizer_as_on(self.optimizer, device_type)
            self.optimizer.register_step_pre_hook(self._optimizer_starts)
            self.optimizer.register_step_post_hook(self._optimizer_ends)
        if real:
            self.template = None
        else:
            self.template, note = _template(sample)
            if note is not None:
                self.notes.append(note)
        self.modules: list[str] = []  # the modules whose forward is running, innermost last
        self.in_optimizer = False
        for name, module in self.model.named_modules():
            label = f"module {name!r}" if name else "the model"
            label += f" ({type(module).__name__})"
            module.register_forward_pre_hook(functools.partial(self._enter, label))
            module.register_forward_hook(functools.partial(self._leave, label))
        if not train:
            self.model.eval()
        check_default_step(self.optimizer, step_fn, train)
        self.step = TrainingStep(
            self.model, self.optimizer, loss_fn=loss_fn, step_fn=step_fn, train=train
        )
        # real copies: their values as copied, put back before each step planned (where the
        # weights decide shapes, a router's choice of experts, a step on weights the step
        # before trained would plan another step)
        self.saved = SavedState(self.model) if real else None
        self.counted = _PlanCount(block_bytes, frozenset({"cpu"} if real else {"meta", device_type}))
        self.mode = _PlanMode(self.counted, real=real)
        self.attention: contextlib.AbstractContextManager[Any] = (  # (on meta tensors only)
            FusedAttention() if device_type == "cpu" else contextlib.nullcontext()
        )
        self.mode.known = {
            _storage_key(copied.untyped_storage()) for copied in memo.values()
            if isinstance(copied, torch.Tensor) and copied.layout is torch.strided
        }
        self._prime()

    def _prime(self) -> None:
        """The steady state of the exact accounting: the copies counted, the optimizer's state
        created and resident."""
        with self._running("while creating the optimizer state"):
            held = [self.model] if self.optimizer is None else [self.model, self.optimizer]
            for storage in storages(held):
                self.counted.add(storage)
            if self.optimizer is not None:
                prime_optimizer(self.optimizer)

    def _enter(self, label: str, module: nn.Module, args: Any) -> None:
        self.modules.append(label)

    def _leave(self, label: str, module: nn.Module, args: Any, output: Any) -> None:
        while self.modules and self.modules.pop() != label:
            pass

    def _optimizer_starts(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.in_optimizer = True

    def _optimizer_ends(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.in_optimizer = False

    @contextlib.contextmanager
    def _running(self, doing: str) -> Iterator[None]:
        """Run a block under the counting mode; an error becomes one that says where it was."""
        self.modules.clear()
        self.in_optimizer = False
        self.mode.op = self.mode.failed_op = self.mode.node = None
        self.mode.foreign = False
        try:
            with self.mode, self.attention:
                yield
        except torch.OutOfMemoryError:
            raise  # (the caching allocator's model refused: the size does not fit)
        except Exception as error:
            if self.mode.foreign:  # not the planner's limit: the step would touch real data
                raise AutobatchError(self._explain(error, doing)) from error
            raise _StepError(self._explain(error, doing)) from error

    def _explain(self, error: Exception, doing: str) -> str:
        if self.modules:
            where = f"in the forward of {self.modules[-1]}"
        elif self.mode.node is not None:
            where = f"in backward ({self.mode.node})"
        elif self.in_optimizer:
            where = f"in the optimizer step ({type(self.optimizer).__name__})"
        else:
            where = "outside the model's forward (in the loss or the step function)"
        if self.mode.failed_op is not None:
            op = f"operator {self.mode.failed_op} failed"
        elif self.mode.op is not None:
            op = f"Python code failed after operator {self.mode.op}"
        else:
            op = "Python code failed before any operator"
        text = str(error).strip().splitlines()
        message = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
        if self.real and not self.mode.foreign:
            return (
                f"plan_max_batch cannot run the step on a CPU copy of the model {doing}: "
                f"{where}, {op} ({message})"
            )
        return (
            f"plan_max_batch cannot run the step on the meta device {doing}: {where}, {op} "
            f"({message}). The planner runs shapes without data, so it cannot plan operators "
            "that need tensor values (.item(), bool(tensor), data-dependent shapes such as "
            "nonzero or boolean masks), operators without a meta kernel (custom CPU-only ops) or "
            "steps that use real tensors; use autobatch.find_max_batch, which runs real steps, "
            "instead"
        )

    def _rewind(self) -> None:
        """The real copies' values as they were copied (see ``saved``)."""
        if self.saved is not None:
            self.saved.rewind()

    def _run(self, batch: Batch, n: int, *, record: bool = False) -> int:
        counted = self.counted
        self._rewind()
        with self._running(f"at batch size {n}"):
            counted.reset_peak()
            counted.record_peak = record
            if record:
                counted.snapshot()
            for tensor in _batch.tensors(batch):
                counted.add(tensor.untyped_storage())
            try:
                self.step(batch)
            finally:
                self.step.forget()  # (one step at a time is planned)
                counted.record_peak = False
        return counted.peak_bytes

    def _drop_gradients(self) -> None:
        self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _batch(self, n: int) -> Batch:
        """A batch of ``n`` rows: meta tensors shaped like the sample's, or, on the real copies,
        the sample's rows cycled (``sample(n)`` for a callable), on the CPU."""
        if not self.real:
            return _grow(self.template, n)
        sample = self.sample
        if is_sample_factory(sample):
            made = collated(sample(n))
            if _batch.batch_size(made) != n:
                raise ValueError(f"sample({n}) returned a batch of another size")
            return _batch.move_batch(made, "cpu")
        return _batch.move_batch(_batch.resize_batch(sample, n), "cpu")

    def parts(self, n: int) -> Trial:
        """One step at ``n`` with the peak of every operator's segment (see
        the ``parts`` of a :class:`~autobatch._search.Trial`)."""
        batch = self._batch(n)
        self.mode.segments = segments = []
        try:
            peak = self._run(batch, n)
            segments.append(self.counted.peak_bytes)
        finally:
            self.mode.segments = None
            del batch
            self._drop_gradients()
        return Trial(n, True, max(peak, *segments), parts=tuple(segments))

    def peak(self, n: int) -> int:
        """The planned peak bytes of one step at batch size ``n``."""
        batch = self._batch(n)
        try:
            return self._run(batch, n)
        finally:
            del batch
            self._drop_gradients()

    def fresh_loop(
        self, n: int, allocator: CachingAllocator
    ) -> tuple[Trial, list[tuple[int, int, int]]]:
        """A user's own loop at ``n`` on ``allocator`` (empty, with the target's settings),
        whose blocks stand for the storages: the copies placed first (``model.to(device)``,
        a fresh optimizer), then :data:`CACHING_STEPS` steps, and up to
        :data:`MAX_STEADY_STEPS` more while each still reserves more, as a trial of the
        finder runs. Each step's batch is copied in while the last one and its loss are still
        held; the optimizer's state is made in the first step. The trial fits when the
        allocator refused nothing. Returns it with its storages' events (see
        :class:`_PlanBlocks`)."""
        count = _PlanBlocks(allocator, self.counted.device_types)
        self.mode.counted = count
        if self.optimizer is not None:
            self.optimizer.state.clear()
        self._rewind()
        held: Batch | None = None
        try:
            with self._running(f"at batch size {n}"):
                for storage in storages([self.model, self.optimizer]):
                    count.add(storage)
            reserved = 0
            for index in range(CACHING_STEPS + MAX_STEADY_STEPS):
                batch = self._batch(n)
                with self._running(f"at batch size {n}"):
                    for tensor in _batch.tensors(batch):
                        count.add(tensor.untyped_storage())
                    held = batch
                    del batch
                    self.step(held)
                grew = allocator.peak_reserved_bytes > reserved
                reserved = allocator.peak_reserved_bytes
                if index + 1 >= CACHING_STEPS and not grew:
                    break
            return Trial(
                n, True, allocator.peak_allocated_bytes, reserved_bytes=allocator.peak_reserved_bytes
            ), count.events
        except torch.OutOfMemoryError:
            return Trial(n, False, None), count.events
        finally:
            self.step.forget()
            del held
            self._drop_gradients()
            self.mode.counted = self.counted
            if self.optimizer is not None:
                self.optimizer.state.clear()
                self._prime()

    def breakdown(self, n: int) -> PlanBreakdown:
        """One step at batch size ``n``, its peak split by what holds the bytes."""
        batch = self._batch(n)
        try:
            peak = self._run(batch, n, record=True)
            seen: set[int] = set()

            def total(tensors: Iterable[Any], *, at_peak: bool = False) -> int:
                bytes_ = 0
                for tensor in tensors:
                    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
                        continue
                    storage = tensor.untyped_storage()
                    key = _storage_key(storage)
                    if key in seen or (at_peak and not self.counted.alive_at_peak(storage)):
                        continue
                    seen.add(key)
                    bytes_ += self.counted.charge(storage)
                return bytes_

            params = list(self.model.parameters())
            state: list[Any] = []
            if self.optimizer is not None:
                params += [p for group in self.optimizer.param_groups for p in group["params"]]
                state = tree_flatten(list(self.optimizer.state.values()))[0]
            parameters = total(params)
            buffers = total(self.model.buffers())
            optimizer_state = total(state)
            batch_bytes = total(_batch.tensors(batch))
            gradients = total((p.grad for p in params), at_peak=True)
        finally:
            del batch
            self._drop_gradients()
        rest = parameters + buffers + optimizer_state + batch_bytes + gradients
        return PlanBreakdown(
            parameters=parameters,
            buffers=buffers,
            gradients=gradients,
            optimizer_state=optimizer_state,
            batch=batch_bytes,
            activations=peak - rest,
        )


