"""``plan_max_batch``: the largest batch for a device you do not have, predicted without running.

The planner copies the model and the optimizer to the ``meta`` device (shapes and dtypes, no data;
the real parameters are never read or moved), runs there the same training step as
:func:`~autobatch.find_max_batch` on batches of any size, and counts every storage the step creates
with the simulated GPU's own byte accounting (:mod:`autobatch._accounting`). A step on ``meta``
costs only the Python time of its operators, so the search engine (:func:`autobatch.search.search`)
can find the exact largest size whose planned peak fits the capacity in a handful of steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import random
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from autobatch import _batch
from autobatch._accounting import (
    CUDA_BLOCK_BYTES,
    CountingMode,
    StorageLedger,
    _storage_key,
    storages,
)
from autobatch._backends import CpuMemory, restore_rng_states, save_rng_states
from autobatch._errors import AutobatchError, BatchSizeError
from autobatch._log import get_logger, user_stacklevel
from autobatch._search import (
    UNBOUNDED_MAX_SIZE,
    LinearModel,
    SearchOutcome,
    Trial,
    extrapolate,
    fit_linear,
    recommend,
    search,
)
from autobatch._units import format_bytes, parse_bytes
from autobatch._validate import check_module, check_search_options, is_sample_factory
from autobatch._workload import (
    DEFAULT_HEADROOM,
    Batch,
    LossFn,
    OptimizerLike,
    Sample,
    StepFn,
    is_compiled,
    make_optimizer,
    make_step,
    prime_optimizer,
    without_compiled,
)

logger = get_logger("planner")

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


@dataclass(frozen=True)
class PlanBreakdown:
    """Where the planned peak goes, at the planned largest batch; the parts add up to ``peak``.

    >>> PlanBreakdown(parameters=4096, buffers=0, gradients=4096, optimizer_state=8192,
    ...               batch=512, activations=1024).peak
    17920

    Args:
        parameters: the parameters.
        buffers: the buffers (e.g. BatchNorm running statistics).
        gradients: the gradients alive at the peak (all of them only when the peak is in the
            optimizer step).
        optimizer_state: the optimizer's state (e.g. Adam's two moments).
        batch: the input batch.
        activations: everything else alive at the peak: activations saved for backward,
            autograd's buffers and temporaries.
    """

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    batch: int
    activations: int

    @property
    def peak(self) -> int:
        """The planned peak bytes, the sum of the parts."""
        return (
            self.parameters + self.buffers + self.gradients + self.optimizer_state + self.batch
            + self.activations
        )

    def __str__(self) -> str:
        parts = ", ".join(
            f"{name.replace('_', ' ')} {format_bytes(getattr(self, name))}"
            for name in ("parameters", "buffers", "gradients", "optimizer_state", "batch",
                         "activations")
        )
        return f"peak {format_bytes(self.peak)} = {parts}"


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_max_batch` predicts for a device of ``capacity_bytes``.

    ``max_batch_size`` is the largest size whose planned peak plus ``overhead_bytes`` fits the
    capacity (exact for the planner's accounting: that size was planned and fit, the next one was
    planned and did not); ``batch_size`` leaves ``headroom`` of the capacity free. ``points`` are
    every ``(size, planned peak bytes)`` computed; ``memory_model`` is the line through the points
    at about half the largest size and at the largest size (``None`` when memory does not grow).
    ``breakdown`` splits the peak at ``max_batch_size``; ``seconds`` is the planning time.
    ``method`` is ``"meta"`` (the step run on the meta device at the sizes planned) or
    ``"steps"`` (small real steps on a CPU copy, extrapolated per operator: for steps that
    cannot run on ``meta``, such as attention masks read with ``.item()``, and recurrent layers).
    """

    batch_size: int
    max_batch_size: int
    memory_model: LinearModel | None
    points: tuple[tuple[int, int], ...]
    capacity_bytes: int
    overhead_bytes: int
    breakdown: PlanBreakdown
    seconds: float
    headroom: float
    device_type: str
    notes: tuple[str, ...] = field(default=())
    method: str = "meta"

    def __repr__(self) -> str:
        lines = [
            f"Plan(batch_size={self.batch_size}, max_batch_size={self.max_batch_size}, "
            f"capacity={format_bytes(self.capacity_bytes)}, "
            f"overhead={format_bytes(self.overhead_bytes)}, headroom={self.headroom:g}, "
            f"device_type={self.device_type!r}, seconds={self.seconds:.2f})"
        ]
        if self.memory_model is not None:
            lines.append(
                f"  memory model: {format_bytes(self.memory_model.fixed)} + "
                f"{format_bytes(self.memory_model.per_sample)} per sample"
            )
        lines.append(f"  at batch {self.max_batch_size}: {self.breakdown}")
        lines += [f"  planned batch {n:>6}: peak {format_bytes(peak)}" for n, peak in self.points]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = __repr__


class _PlanLedger(StorageLedger):
    """A ledger that counts only the planned device's storages (``meta`` stands for the device)
    and, when asked, remembers which storages were alive at its peak."""

    def __init__(self, block_bytes: int, device_types: frozenset[str]) -> None:
        super().__init__(block_bytes)
        self.device_types = device_types
        self.record_peak = False
        self.at_peak: dict[int, int] = {}  # storage key -> serial, for storages alive at the peak
        self._serials: dict[int, int] = {}
        self._next_serial = 0

    def charge(self, storage: torch.UntypedStorage) -> int:
        """The bytes this ledger counts for ``storage`` (0 for storages off the device)."""
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


class _PlanMode(CountingMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """The plan's counting mode: it also remembers the operator running (and the backward node),
    and refuses operators on real data, so the step can never read or change a real tensor."""

    def __init__(self, ledger: StorageLedger, *, real: bool = False) -> None:
        super().__init__(ledger)
        self.op: Any = None
        self.failed_op: Any = None
        self.node: str | None = None
        self.attention = False
        self.real = real  # real CPU copies: tensors of the copies and of the step only
        self.segments: list[int] | None = None  # per-operator peaks, while recorded
        self.foreign = False  # the step used a tensor from outside the planner's copies
        self.known: set[int] = set()  # storages of the copies the ledger does not count

    def _foreign(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` comes from outside the copies (the user's own model, say)."""
        if not self.real:
            return tensor.device.type != "meta"
        if tensor.layout is not torch.strided or tensor.is_nested:
            return False
        storage = tensor.untyped_storage()
        return storage not in self.ledger and _storage_key(storage) not in self.known

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.op = func
        node = torch._C._current_autograd_node()
        self.node = None if node is None else node.name()
        if func in _ATTENTION_OPS:
            self.attention = True
        if self.segments is not None:  # a new operator: the segment before it ends
            self.segments.append(self.ledger.peak_bytes)
            self.ledger.reset_peak()
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


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta.requires_grad_(tensor.requires_grad)


def _meta_memo(objects: Iterable[Any]) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that turns every tensor of the modules and optimizers into a meta
    tensor of the same shape, dtype, strides and ``requires_grad``, without reading its data.

    Optimizer state that lives on the host as a zero-dimensional tensor (Adam's ``step`` when not
    capturable) is copied as it is: the optimizer reads its value.
    """
    memo: dict[int, Any] = {}

    def put(tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in memo:
            memo[id(tensor)] = _meta_like(tensor)

    for obj in objects:
        if isinstance(obj, nn.Module):
            for module in obj.modules():  # parameters, buffers and plain tensor attributes
                for value in tree_flatten(list(vars(module).values()))[0]:
                    put(value)
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for param in group["params"]:
                    put(param)
            for state in obj.state.values():
                for value in tree_flatten(state)[0]:
                    if isinstance(value, torch.Tensor) and id(value) not in memo:
                        host_scalar = value.dim() == 0 and value.device.type == "cpu"
                        memo[id(value)] = value.clone() if host_scalar else _meta_like(value)
    return memo


def _real_memo(objects: Iterable[Any]) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that copies every tensor of the modules and optimizers to the
    CPU (same values, dtype and ``requires_grad``): the planner's real copies, for steps that
    cannot run on ``meta``."""
    memo: dict[int, Any] = {}

    def put(tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in memo:
            if tensor.device.type == "meta":
                raise AutobatchError(
                    "the model is on the meta device: it has no values for the real steps the "
                    "planner needs here"
                )
            copied = tensor.detach().to("cpu", copy=True)
            if isinstance(tensor, nn.Parameter):
                memo[id(tensor)] = nn.Parameter(copied, requires_grad=tensor.requires_grad)
            else:
                memo[id(tensor)] = copied.requires_grad_(tensor.requires_grad)

    for obj in objects:
        if isinstance(obj, nn.Module):
            for module in obj.modules():
                for value in tree_flatten(list(vars(module).values()))[0]:
                    put(value)
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for param in group["params"]:
                    put(param)
            for state in obj.state.values():
                for value in tree_flatten(state)[0]:
                    put(value)
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
        sample = sample(1)
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
        self.step = make_step(
            self.model, self.optimizer, loss_fn=loss_fn, step_fn=step_fn, train=train
        )
        self.ledger = _PlanLedger(block_bytes, frozenset({"cpu"} if real else {"meta", device_type}))
        self.mode = _PlanMode(self.ledger, real=real)
        self.mode.known = {
            _storage_key(copied.untyped_storage()) for copied in memo.values()
            if isinstance(copied, torch.Tensor) and copied.layout is torch.strided
        }
        with self._running("while creating the optimizer state"):
            held = [self.model] if self.optimizer is None else [self.model, self.optimizer]
            for storage in storages(held):
                self.ledger.add(storage)
            if self.optimizer is not None:
                prime_optimizer(self.optimizer)  # the steady state: optimizer state resident

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
            with self.mode:
                yield
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

    def _run(self, batch: Batch, n: int, *, record: bool = False) -> int:
        ledger = self.ledger
        with self._running(f"at batch size {n}"):
            ledger.reset_peak()
            ledger.record_peak = record
            if record:
                ledger.snapshot()
            for tensor in _batch.tensors(batch):
                ledger.add(tensor.untyped_storage())
            try:
                self.step(batch)
            finally:
                ledger.record_peak = False
        return ledger.peak_bytes

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
            made = sample(n)
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
            segments.append(self.ledger.peak_bytes)
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
                    if key in seen or (at_peak and not self.ledger.alive_at_peak(storage)):
                        continue
                    seen.add(key)
                    bytes_ += self.ledger.charge(storage)
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


def _byte_option(value: int | float | str, name: str) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0
    return parse_bytes(value, name=name)


def plan_max_batch(
    model: nn.Module,
    sample: Sample,
    optimizer: OptimizerLike = None,
    capacity: int | float | str = "80GiB",
    *,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    train: bool = True,
    min_batch: int = 1,
    max_batch: int | None = None,
    multiple_of: int = 1,
    headroom: float = DEFAULT_HEADROOM,
    overhead: int | float | str = 0,
    block_bytes: int = CUDA_BLOCK_BYTES,
    device_type: str = "cuda",
) -> Plan:
    """Predict the largest batch that fits a device of ``capacity`` bytes, without that device.

    Runs the training step of :func:`~autobatch.find_max_batch` (same ``sample``, ``loss_fn``,
    ``step_fn`` and ``train`` conventions, optimizer state resident) on a ``meta`` copy of the
    model and optimizer, counting bytes exactly as :class:`~autobatch.testing.SimulatedGPU`
    does: no real compute, no real memory, and the model is not touched. The step is planned at
    the sizes the search engine asks for, so ``max_batch_size`` is exact for this accounting.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
    ...                             torch.nn.Linear(2048, 10))
    >>> plan = plan_max_batch(model, torch.randn(1, 512), torch.optim.Adam, capacity="24GiB")
    >>> plan.max_batch_size > 100_000, plan.batch_size < plan.max_batch_size
    (True, True)
    >>> next(model.parameters()).device.type  # the real model stays where it was
    'cpu'

    What the plan cannot see: kernels that choose their memory on the device. On a GPU, attention
    may run fused kernels (flash or memory-efficient SDPA) that need much less than the math
    path planned here, and cuDNN/cuBLAS may take workspaces: with attention the plan is an upper
    bound, the workspaces belong in ``overhead``. Fragmentation of the caching allocator is not
    modelled (as in the simulator). A ``step_fn`` or ``loss_fn`` must only use the model it is
    given (and module losses, which are copied); a GradScaler is not planned.

    Args:
        model: The module to plan for, on any device (``meta`` too); it is copied to ``meta``
            without reading its data.
        sample: One or a few examples, as for :func:`~autobatch.find_max_batch`; a callable ``n ->
            batch`` is called once, as ``sample(1)``, and its row repeated (its rows' shapes must
            not depend on ``n``).
        optimizer: An optimizer (copied with its state), an optimizer class or factory, or None.
        capacity: The device's memory, as bytes or a string with a unit (``"24GiB"``, ``"80GB"``).
        loss_fn, step_fn, train: As for :func:`~autobatch.find_max_batch`.
        min_batch, max_batch, multiple_of: The sizes allowed.
        headroom: Fraction of the capacity the recommended ``batch_size`` leaves free at its peak.
        overhead: Bytes the device holds besides the step's tensors (CUDA context, often 300-600 MiB
            and not in ``torch.cuda.memory_allocated``; cuBLAS/cuDNN workspaces; other processes):
            the peak may use ``capacity - overhead``.
        block_bytes: The allocator's rounding: 512 as the CUDA caching allocator, 1 for raw bytes.
        device_type: The kind of device planned for. Tensors the step keeps on the host (Adam's
            ``step`` counters) count only when it is ``"cpu"``, and optimizers left to choose run
            the implementation torch picks there (``foreach`` on ``"cuda"``); ``"cpu"`` plans what
            :class:`~autobatch.testing.SimulatedGPU` measures.

    Raises:
        BatchSizeError: Even ``min_batch`` does not fit (with the planned bytes and the capacity).
        AutobatchError: The step uses a tensor from outside the copies (a ``step_fn`` or ``loss_fn``
            that reaches for the real model), or fails on the CPU copy too.

    Warns:
        UserWarning: The step cannot run on ``meta`` (``.item()``, e.g. on a Hugging Face
            attention mask, data-dependent shapes, ops without a meta kernel): the message names
            the module and the operator, and the plan comes from small real steps on a CPU copy
            (``method="steps"``), as it always does for recurrent layers.
    """
    check_search_options(min_batch, max_batch, multiple_of, headroom, 1)
    check_module("model", model)
    if not isinstance(device_type, str) or not device_type:
        raise ValueError(f"device_type must be a device type such as 'cuda', got {device_type!r}")
    capacity_bytes = parse_bytes(capacity)
    overhead_bytes = _byte_option(overhead, "overhead")
    budget = capacity_bytes - overhead_bytes
    if budget <= 0:
        raise ValueError(
            f"overhead={overhead!r} ({format_bytes(overhead_bytes)}) leaves nothing of "
            f"capacity={capacity!r} ({format_bytes(capacity_bytes)}); lower the overhead"
        )
    started = time.perf_counter()
    steps: dict[str, Any] = {
        "loss_fn": loss_fn, "step_fn": step_fn, "train": train, "device_type": device_type,
        "block_bytes": block_bytes,
    }
    grid: dict[str, Any] = {
        "min_batch": min_batch, "max_batch": max_batch, "multiple_of": multiple_of,
    }
    sizes: dict[str, Any] = {
        "capacity_bytes": capacity_bytes, "overhead_bytes": overhead_bytes, "headroom": headroom,
    }
    recurrent = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if recurrent:  # their kernels on the CPU or GPU keep workspaces a meta run does not see
        why = (
            f"recurrent layers ({', '.join(recurrent)}) keep workspaces that their meta kernels "
            "do not allocate"
        )
    else:
        try:
            return _plan_on_meta(model, sample, optimizer, started=started, **steps, **grid,
                                 **sizes)
        except _StepError as error:
            why = str(error).split(". The planner runs shapes")[0]
            warnings.warn(
                f"{why}. Planning from two or three small real steps on a CPU copy instead, "
                "extrapolated per operator (seconds, and as exact as the simulator where the "
                "step's operators do not change with the size)",
                stacklevel=user_stacklevel(),
            )
    return _plan_from_steps(model, sample, optimizer, why=why, started=started, **steps, **grid,
                            **sizes)


def _plan_on_meta(
    model: nn.Module,
    sample: Sample,
    optimizer: OptimizerLike,
    *,
    started: float,
    loss_fn: LossFn | None,
    step_fn: StepFn | None,
    train: bool,
    device_type: str,
    block_bytes: int,
    min_batch: int,
    max_batch: int | None,
    multiple_of: int,
    capacity_bytes: int,
    overhead_bytes: int,
    headroom: float,
) -> Plan:
    """The plan from steps on the meta device, at the sizes the search engine asks for."""
    budget = capacity_bytes - overhead_bytes
    started = time.perf_counter()
    with _disable_current_modes():  # a simulator or fake mode around us must not see the copies
        setup = _MetaSetup(
            model,
            sample,
            optimizer,
            loss_fn=loss_fn,
            step_fn=step_fn,
            train=train,
            device_type=device_type,
            block_bytes=block_bytes,
        )
        peaks: dict[int, int] = {}

        def probe(n: int) -> Trial:
            peaks[n] = peak = setup.peak(n)
            logger.info(
                "planned batch %d: peak %s, %s", n, format_bytes(peak),
                "fits" if peak <= budget else "does not fit",
            )
            return Trial(n, peak <= budget, peak)

        outcome = search(
            probe,
            min_size=min_batch,
            max_size=max_batch,
            multiple_of=multiple_of,
            capacity_bytes=budget,
        )
        first = -(-min_batch // multiple_of) * multiple_of
        largest = outcome.largest_fit
        if largest is None:
            raise BatchSizeError(
                f"even the smallest batch ({min_batch}) does not fit: the plan needs "
                f"{format_bytes(peaks[first] + overhead_bytes)} at batch {first} "
                f"(overhead {format_bytes(overhead_bytes)} included) of "
                f"{format_bytes(capacity_bytes)}. Reduce the model or the input size, use mixed "
                "precision, gradient checkpointing or a sharded optimizer, or a larger device",
                batch_size=min_batch,
                needed_bytes=peaks[first] + overhead_bytes,
                capacity_bytes=capacity_bytes,
            )
        half = max(first, largest // 2 // multiple_of * multiple_of)
        top = largest if largest > half else outcome.smallest_fail
        if top is not None and half not in peaks:
            probe(half)
        memory_model = None if top is None else fit_linear([(half, peaks[half]), (top, peaks[top])])
        breakdown = setup.breakdown(largest)
        # Planned like a search's trials: every part of the curve within (1 - headroom) of the
        # capacity, the size's own planned peak checked.
        batch_size = recommend(
            outcome,
            capacity_bytes=capacity_bytes,
            headroom=headroom,
            multiple_of=multiple_of,
            min_size=min_batch,
            probe=probe,
            reserved_bytes=overhead_bytes,
        )
    notes = list(setup.notes)
    if train and setup.optimizer is None and step_fn is None:
        notes.append("no optimizer given: forward and backward only, optimizer state not counted")
    if not train:
        notes.append("inference: forward only under torch.inference_mode(), model in eval mode")
    if setup.mode.attention:
        notes.append(
            "attention planned with the math path; fused attention kernels (flash, "
            "memory-efficient) on the device need less, so the plan is an upper bound there"
        )
    plan = Plan(
        batch_size=batch_size,
        max_batch_size=largest,
        memory_model=memory_model,
        points=tuple(sorted(peaks.items())),
        capacity_bytes=capacity_bytes,
        overhead_bytes=overhead_bytes,
        breakdown=breakdown,
        seconds=time.perf_counter() - started,
        headroom=float(headroom),
        device_type=device_type,
        notes=tuple(notes),
    )
    logger.info(
        "planned largest batch %d, recommended %d, in %.2f s",
        plan.max_batch_size, plan.batch_size, plan.seconds,
    )
    return plan



#: The real steps of a plan from steps stay below this much host memory each.
_HOST_STEP_BYTES = 256 * 2**20


def _extrapolated(
    measure: Any, trials: list[Trial], budget: int, first: int, last: int | None, step: int,
    block_bytes: int,
) -> tuple[int, LinearModel | None]:
    """The largest size within ``budget`` from steps too large to run here: two small real
    steps, then up to two more halfway to the answer while a step stays cheap on this host,
    every operator's peak extrapolated on its own line (the more cautious of the lines through
    all the points and through the last two)."""
    small = max(first, -(-2 // step) * step)
    for n in (small, 4 * small):
        if last is None or n <= last:
            measure(n)
    if len(trials) < 2:
        measure(first)
        return (first if trials[0].fits else 0), None
    largest, line = extrapolate(trials, budget, granularity_bytes=block_bytes)
    for _ in range(2):
        if line is None:
            break
        affordable = line.largest_within(line.predict(0) + _HOST_STEP_BYTES)
        farther = min(largest // 2, affordable, UNBOUNDED_MAX_SIZE) // step * step
        if last is not None:
            farther = min(farther, last)
        if farther < 2 * max(t.size for t in trials):
            break
        measure(farther)
        largest, line = extrapolate(trials, budget, granularity_bytes=block_bytes)
    if len(trials) > 2:
        recent, _ = extrapolate(trials[-2:], budget, granularity_bytes=block_bytes)
        largest = min(largest, recent)
    return largest, line


def _plan_from_steps(
    model: nn.Module,
    sample: Sample,
    optimizer: OptimizerLike,
    *,
    why: str,
    started: float,
    loss_fn: LossFn | None,
    step_fn: StepFn | None,
    train: bool,
    device_type: str,
    block_bytes: int,
    min_batch: int,
    max_batch: int | None,
    multiple_of: int,
    capacity_bytes: int,
    overhead_bytes: int,
    headroom: float,
) -> Plan:
    """The plan from two or three small real steps on CPU copies of the model and optimizer,
    counted with the same accounting, each operator's peak extrapolated on its own line."""
    budget = capacity_bytes - overhead_bytes
    step = multiple_of
    first = -(-min_batch // step) * step
    last = None if max_batch is None else max_batch // step * step
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    host = CpuMemory(torch.device("cpu")).free_bytes()
    if 4 * weights > host // 2:  # the copy, its gradients and an optimizer's two moments
        raise AutobatchError(
            f"plan_max_batch cannot plan this step from real steps on a CPU copy ({why}): the "
            f"copy with its gradients and optimizer state needs about "
            f"{format_bytes(4 * weights)}, more than half of the {format_bytes(host)} of host "
            "memory free; use autobatch.find_max_batch on the device instead"
        )
    with _disable_current_modes():
        torch_rng, python_rng = save_rng_states(), random.getstate()
        try:
            setup = _MetaSetup(
                model, sample, optimizer, loss_fn=loss_fn, step_fn=step_fn, train=train,
                device_type=device_type, block_bytes=block_bytes, real=True,
            )
            trials: list[Trial] = []

            def measure(n: int) -> Trial:
                began = time.perf_counter()
                outcome = setup.parts(n)
                peak = outcome.peak_bytes or 0
                trial = Trial(n, peak <= budget, peak, parts=outcome.parts)
                trials.append(trial)
                logger.info(
                    "measured batch %d on a CPU copy: peak %s, %.2f s", n, format_bytes(peak),
                    time.perf_counter() - began,
                )
                return trial

            if budget <= _HOST_STEP_BYTES:  # every step fits on this host: measure them all
                exact = search(measure, min_size=min_batch, max_size=max_batch,
                               multiple_of=step, capacity_bytes=budget)
                largest = 0 if exact.largest_fit is None else exact.largest_fit
                line = exact.model
                reach = "sizes measured up to the answer and the one above it"
            else:
                largest, line = _extrapolated(measure, trials, budget, first, last, step,
                                              block_bytes)
                reach = (
                    f"sizes above {max(t.size for t in trials)} extrapolated, each operator's "
                    "peak on its own line (a kernel whose memory changes in steps may make it "
                    "a little optimistic)"
                )
            fitting = [t for t in trials if t.fits] or trials
            biggest = max(t.size for t in fitting)
            breakdown_at = setup.breakdown(biggest)
        finally:
            restore_rng_states(torch_rng)
            random.setstate(python_rng)
    peaks = {t.size: t.peak_bytes or 0 for t in trials}
    largest = max(largest, 0) // step * step
    if last is not None:
        largest = min(largest, last)
    if largest < first:
        needed = peaks.get(first, min(peaks.values())) + overhead_bytes
        raise BatchSizeError(
            f"even the smallest batch ({min_batch}) does not fit: measured on a CPU copy, the "
            f"step needs about {format_bytes(needed)} (overhead "
            f"{format_bytes(overhead_bytes)} included) of {format_bytes(capacity_bytes)}. Reduce "
            "the model or the input size, use mixed precision, gradient checkpointing or a "
            "sharded optimizer, or a larger device",
            batch_size=min_batch,
            needed_bytes=needed,
            capacity_bytes=capacity_bytes,
        )
    predicted = peaks.get(largest, int(line.predict(largest)) if line is not None else peaks[biggest])
    outcome = SearchOutcome(largest, largest + step, tuple(t for t in trials if t.fits), line)
    batch_size = recommend(
        outcome, capacity_bytes=capacity_bytes, headroom=headroom, multiple_of=step,
        min_size=min_batch, reserved_bytes=overhead_bytes,
    )
    scale = largest / biggest
    fixed = (
        breakdown_at.parameters + breakdown_at.buffers + breakdown_at.gradients
        + breakdown_at.optimizer_state
    )
    batch_bytes = round(breakdown_at.batch * scale)
    breakdown = dataclasses.replace(
        breakdown_at, batch=batch_bytes, activations=max(predicted - fixed - batch_bytes, 0)
    )
    notes = [
        f"planned from {len(trials)} real steps on a CPU copy (batches "
        f"{', '.join(str(t.size) for t in trials)}; {reach}): {why}",
        *setup.notes,
    ]
    if train and setup.optimizer is None and step_fn is None:
        notes.append("no optimizer given: forward and backward only, optimizer state not counted")
    if not train:
        notes.append("inference: forward only under torch.inference_mode(), model in eval mode")
    if device_type != "cpu":
        notes.append(
            f"measured with the CPU's kernels: on {device_type} some kernels (cuDNN recurrent "
            "layers, fused attention) keep other workspaces; check with find_max_batch there"
        )
    plan = Plan(
        batch_size=batch_size,
        max_batch_size=largest,
        memory_model=line,
        points=tuple(sorted(peaks.items())),
        capacity_bytes=capacity_bytes,
        overhead_bytes=overhead_bytes,
        breakdown=breakdown,
        seconds=time.perf_counter() - started,
        headroom=float(headroom),
        device_type=device_type,
        notes=tuple(notes),
        method="steps",
    )
    logger.info(
        "planned largest batch %d from real steps, recommended %d, in %.2f s",
        plan.max_batch_size, plan.batch_size, plan.seconds,
    )
    return plan
