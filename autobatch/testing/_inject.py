"""Deterministic out-of-memory fault injection."""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_flatten

from autobatch._memory._accounting import DispatchMode, call_keeping_versions

_CUDA_TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
    "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
_ALLOCATOR = (
    "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
    "free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the "
    "allocated memory 76.90 GiB is allocated by PyTorch, and 612.15 MiB is reserved by PyTorch "
    "but unallocated."
)


def _accelerator_error(message: str) -> RuntimeError:
    cls: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)
    try:
        return cls(message)
    except TypeError:  # an AcceleratorError that wants an error code too
        return RuntimeError(message)


#: What each backend really raises when memory runs out (kind -> factory of the exception).
OOM_KINDS: dict[str, Callable[[], BaseException]] = {
    # c10/cuda/CUDACachingAllocator.cpp, malloc(): TORCH_CHECK_WITH(OutOfMemoryError, ...)
    "cuda": lambda: torch.OutOfMemoryError(f"CUDA out of memory. {_ALLOCATOR}"),
    # C10_CUDA_CHECK on cudaErrorMemoryAllocation outside the allocator (c10/cuda/CUDAException)
    "cuda_runtime": lambda: _accelerator_error("CUDA error: out of memory" + _CUDA_TAIL),
    # The same allocator built for ROCm prints HIP instead of CUDA (hipify)
    "hip": lambda: torch.OutOfMemoryError(f"HIP out of memory. {_ALLOCATOR}"),
    # aten/src/ATen/cuda/CublasHandlePool.cpp: cublasCreate fails when memory is exhausted
    "cublas": lambda: RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    ),
    # aten/src/ATen/native/cudnn/Conv_v7.cpp: no algorithm whose workspace fits
    "cudnn": lambda: RuntimeError(
        "Unable to find a valid cuDNN algorithm to run convolution"
    ),
    # aten/src/ATen/native/cuda/CuFFTUtils.h: CUFFT_ALLOC_FAILED
    "cufft": lambda: RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),
    # aten/src/ATen/mps/MPSAllocator.mm, MPSHeapAllocatorImpl::malloc
    "mps": lambda: torch.OutOfMemoryError(
        "MPS backend out of memory (MPS allocated: 17.77 GB, other allocations: 88.23 MB, max "
        "allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool. Use "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations "
        "(may cause system failure)."
    ),
    # c10/xpu/XPUCachingAllocator.cpp, malloc()
    "xpu": lambda: torch.OutOfMemoryError(
        "XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 64.00 GiB. "
        "Of the allocated memory 61.50 GiB is allocated by PyTorch, and 1.20 GiB is reserved by "
        "PyTorch but unallocated."
    ),
    # c10/core/impl/alloc_cpu.cpp, alloc_cpu(): CAFFE_ENFORCE on a failed posix_memalign
    "cpu": lambda: RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"
    ),
}

_PHASES = ("forward", "backward", "optimizer")


class inject_oom(DispatchMode):  # used like a function: `with inject_oom(...)`
    """Raise a realistic out-of-memory error at a chosen operator, deterministically.

    The error is raised before the chosen operator runs, so nothing of it is allocated. All
    conditions given must hold at once; ``times`` says how often to fire (``None``: always).

    >>> import torch
    >>> from autobatch import is_oom_error
    >>> model = torch.nn.Linear(4, 2)
    >>> with inject_oom("cublas", phase="backward") as fault:
    ...     try:
    ...         model(torch.randn(8, 4)).sum().backward()
    ...     except RuntimeError as error:
    ...         caught = is_oom_error(error)
    >>> caught, fault.fired
    (True, 1)

    Args:
        kind: Which backend's error to raise: one of :data:`OOM_KINDS` (``"cuda"``,
            ``"cuda_runtime"``, ``"hip"``, ``"cublas"``, ``"cudnn"``, ``"cufft"``, ``"mps"``,
            ``"xpu"``, ``"cpu"``).
        at_op: Fire at the n-th operator (from 1) among those that meet the other conditions.
        batch_over: Fire at an operator that takes a tensor (or a view of one) whose dimension 0 is
            larger than this. Model state never triggers it: parameters and their views, tensors
            shaped like a parameter or its transpose (gradients), and everything inside
            ``optimizer.step``.
        phase: ``"forward"`` (outside backward and the optimizer), ``"backward"`` (inside autograd's
            backward) or ``"optimizer"`` (inside any ``optimizer.step``).
        times: How many times to fire; then operators pass untouched.
    """

    def __init__(
        self,
        kind: str = "cuda",
        *,
        at_op: int | None = None,
        batch_over: int | None = None,
        phase: str | None = None,
        times: int | None = 1,
    ) -> None:
        super().__init__()
        if kind not in OOM_KINDS:
            raise ValueError(f"kind={kind!r} is not one of {sorted(OOM_KINDS)}")
        if phase is not None and phase not in _PHASES:
            raise ValueError(f"phase={phase!r} is not one of {_PHASES} or None")
        for name, value in (("at_op", at_op), ("batch_over", batch_over), ("times", times)):
            if value is not None and (not isinstance(value, int) or value < 1 - (name == "batch_over")):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.kind = kind
        self.at_op = at_op
        self.batch_over = batch_over
        self.phase = phase
        self.times = times
        self.fired = 0
        self._matched = 0
        self._optimizer_depth = 0
        self._params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._hooks: list[Any] = []

    def __enter__(self) -> inject_oom:
        self._hooks = [
            register_optimizer_step_pre_hook(self._enter_optimizer),
            register_optimizer_step_post_hook(self._leave_optimizer),
        ]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _enter_optimizer(self, *_: Any) -> None:
        self._optimizer_depth += 1

    def _leave_optimizer(self, *_: Any) -> None:
        self._optimizer_depth = max(self._optimizer_depth - 1, 0)

    def _current_phase(self) -> str:
        if self._optimizer_depth:
            return "optimizer"
        if torch._C._current_autograd_node() is not None:
            return "backward"
        return "forward"

    def _is_model_state(self, tensor: torch.Tensor) -> bool:
        """Parameters, their views and gradients: anything stored or shaped like a parameter."""
        param = tensor if isinstance(tensor, torch.nn.Parameter) else tensor._base
        if isinstance(param, torch.nn.Parameter):
            self._params[id(param)] = param
            return True
        shape = tuple(tensor.shape)
        return any(
            shape in (tuple(p.shape), tuple(reversed(p.shape))) for p in self._params.values()
        )

    def _should_fire(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        large = False
        if self.batch_over is not None:  # look at every operator: parameters are learnt here
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            roots = [t if t._base is None else t._base for t in tensors]  # views count as their base
            batch = [t for t in roots if t.dim() and not self._is_model_state(t)]
            large = any(t.shape[0] > self.batch_over for t in batch)
        phase = self._current_phase()
        if self.phase is not None and phase != self.phase:
            return False
        if self.batch_over is not None and (phase == "optimizer" or not large):
            return False
        if _in_data_loading():
            return False  # (a loader's collation is not the model's work)
        self._matched += 1
        return self.at_op is None or self._matched == self.at_op

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._should_fire(args, kwargs):
            self.fired += 1
            if self._optimizer_depth:
                self._optimizer_depth -= 1  # the step is abandoned; its post-hook will not run
            raise OOM_KINDS[self.kind]()
        return call_keeping_versions(func, args, kwargs)


_DATA = os.path.join("torch", "utils", "data") + os.sep


def _in_data_loading() -> bool:
    """Whether this operator runs inside ``torch.utils.data`` (a DataLoader's iterator or
    collation), where a GPU does no model work."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if _DATA in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False
