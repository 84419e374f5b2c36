"""Classify an exception: out of memory, a batch-size limit that is not memory, or neither.

Two questions matter when a trial at batch size ``n`` fails:

* Did the device (or the host) run out of memory? Then a smaller batch may fit:
  :func:`is_oom_error` / :func:`oom_kind`.
* Did an operator refuse the size although memory was left (32-bit index math, a launch
  grid too large, a library that caps one buffer)? Then a smaller batch may also work, but
  the reason must be reported as such: :func:`is_size_limit_error` / :func:`size_limit_kind`.

An out-of-memory error takes precedence: when a chain matches both, it is an OOM and not a
size limit.

Rules (each one is pinned by ``tests/test_oom.py``):

1. Only :class:`Exception` counts. ``KeyboardInterrupt``, ``SystemExit`` and other bare
   :class:`BaseException` are never an OOM, and a chain that holds one anywhere is vetoed, so
   a retry loop can never swallow the user's Ctrl-C.
2. Typed first: :class:`torch.OutOfMemoryError` (the same class as
   ``torch.cuda.OutOfMemoryError``; the CUDA, HIP, XPU and MPS caching allocators raise it) and
   Python's :class:`MemoryError` (host allocations by Python or NumPy) are OOM.
3. Then a message table, matched on ``str(exc)`` and on each string in ``exc.args``. The
   table applies to :class:`RuntimeError` and its subclasses only: every message below is
   raised by torch (or a CUDA library it calls) as a ``RuntimeError`` or a subclass
   (``torch.AcceleratorError``, ``torch.OutOfMemoryError``). A ``KeyError('CUDA out of
   memory')`` or a ``ValueError`` that merely quotes the words is not an OOM.
4. The chain is walked: ``__cause__`` (``raise X from oom``) and ``__context__`` (raised while
   handling ``oom``), with cycle protection and a depth limit of :data:`MAX_CHAIN_DEPTH`.
   ``__context__`` is skipped when ``__suppress_context__`` is set (``raise X from None``),
   which is how Python itself decides what to show. If any link is an OOM, the whole chain
   is: a wrapper such as ``raise StepFailed(...) from oom`` (or even a look-alike such as an
   illegal-memory-access error raised while handling an OOM) still counts.
5. Distributed errors veto: if any link is a :class:`torch.distributed.DistError` (for example
   ``DistBackendError``) or its message says ``NCCL error``, the chain is neither an OOM nor a
   size limit, even when NCCL reports ``Cuda failure 'out of memory'``. A failed collective
   leaves the communicator broken, and retrying it on one rank hangs the others.

Groups of exceptions (``ExceptionGroup``) are not descended into.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

__all__ = [
    "MAX_CHAIN_DEPTH",
    "OOM_PATTERNS",
    "SIZE_LIMIT_PATTERNS",
    "ErrorPattern",
    "is_oom_error",
    "is_size_limit_error",
    "oom_kind",
    "size_limit_kind",
]

MAX_CHAIN_DEPTH = 32
"""How many links of a ``__cause__``/``__context__`` chain are examined at most."""


@dataclass(frozen=True)
class ErrorPattern:
    """One row of a message table: a regular expression and the kind it reports.

    Example:
        >>> row = ErrorPattern("cufft", r"CUFFT_ALLOC_FAILED")
        >>> row.matches("cuFFT error: CUFFT_ALLOC_FAILED")
        True

    Args:
        kind: Short name reported by :func:`oom_kind` / :func:`size_limit_kind`.
        pattern: Regular expression searched (``re.search``) in the message.
    """

    kind: str
    pattern: str

    def matches(self, message: str) -> bool:
        """Say whether ``pattern`` occurs in ``message``.

        Example:
            >>> ErrorPattern("x", r"abc").matches("xxabcxx")
            True

        Args:
            message: The text of an exception.
        """
        return re.search(self.pattern, message) is not None  # re caches compiled patterns


# Out-of-memory messages. The first matching row names the kind, so specific rows come first.
OOM_PATTERNS: tuple[ErrorPattern, ...] = (
    # CUDA caching allocator, c10/cuda/CUDACachingAllocator.cpp (malloc): raised as
    # torch.OutOfMemoryError, "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a
    # total capacity of ...". Older torch: "CUDA out of memory. Tried to allocate 2.00 MiB
    # (GPU 0; 7.79 GiB total capacity; ...)".
    ErrorPattern("cuda_allocator", r"\bCUDA out of memory\b"),
    # The same allocator hipified for ROCm: "HIP out of memory. Tried to allocate 3.31 GiB.
    # GPU 0 has a total capacity of 128.00 GiB ..." (pytorch/pytorch#138002).
    ErrorPattern("hip", r"\bHIP out of memory\b"),
    # XPU caching allocator, c10/xpu/XPUCachingAllocator.cpp: "XPU out of memory. Tried to
    # allocate 4.66 GiB. GPU 0 has a total capacity of 5.65 GiB ..." (intel/torch-xpu-ops#3011).
    ErrorPattern("xpu", r"\bXPU out of memory\b"),
    # MPS allocator, aten/src/ATen/mps/MPSAllocator.mm: "MPS backend out of memory (MPS
    # allocated: 18.05 GB, other allocations: 94.88 MB, max allowed: 18.13 GB). Tried to
    # allocate 10.00 MB on private pool. ..." (pytorch/pytorch#130112).
    ErrorPattern("mps", r"\bMPS backend out of memory\b"),
    # A direct CUDA runtime call returned cudaErrorMemoryAllocation,
    # c10/cuda/CUDAException.cpp (c10_cuda_check_implementation): torch.AcceleratorError in
    # recent torch, RuntimeError before: "CUDA error: out of memory\nSearch for
    # `cudaErrorMemoryAllocation' in https://docs.nvidia.com/cuda/..." (taohan10200/IIM#28).
    # Torch <= 1.0 (THCudaCheck): "cuda runtime error (2) : out of memory at
    # /pytorch/aten/src/THC/generic/THCStorage.cu:58" (yl-1993/Matrix-Capsules-EM-PyTorch#1).
    # Driver API calls, AT_CUDA_DRIVER_CHECK in ATen/cuda/Exceptions.h: "CUDA driver error:
    # out of memory" (cuGetErrorString of CUDA_ERROR_OUT_OF_MEMORY).
    ErrorPattern(
        "cuda_runtime",
        r"CUDA error: ?out of memory|\bcudaErrorMemoryAllocation\b"
        r"|cuda runtime error ?\(2\) ?: ?out of memory|CUDA driver error: out of memory",
    ),
    # The same check hipified: "HIP error: out of memory\nSearch for `hipErrorOutOfMemory'
    # in ..." (vladmandic/sdnext#4801, raised as torch.AcceleratorError).
    ErrorPattern("hip", r"HIP error: out of memory|\bhipErrorOutOfMemory\b"),
    # cuBLAS handle or workspace allocation, TORCH_CUDABLAS_CHECK in ATen/cuda/Exceptions.h:
    # "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    # (QwenLM/Qwen3#873: fixed by freeing GPU memory). HIPBLAS_ is the ROCm spelling.
    ErrorPattern("cublas", r"\b(?:CU|HIP)BLAS_STATUS_ALLOC_FAILED\b"),
    # cuDNN, AT_CUDNN_CHECK in ATen/cuda/Exceptions.h: "cuDNN error:
    # CUDNN_STATUS_ALLOC_FAILED" (pytorch/pytorch#20123). And
    # aten/src/ATen/native/cudnn/Conv_v7.cpp (try_all): "Unable to find a valid cuDNN
    # algorithm to run convolution", raised when every algorithm's workspace allocation
    # failed; in practice it means out of memory (marqo-ai/marqo#101,
    # ultralytics/yolov5#11250: fixed by a smaller batch).
    ErrorPattern(
        "cudnn",
        r"\bCUDNN_STATUS_ALLOC_FAILED\b|Unable to find a valid cuDNN algorithm to run convolution",
    ),
    # MIOpen (ROCm's cuDNN), miopenGetErrorString: "miopenStatusAllocFailed".
    ErrorPattern("miopen", r"\bmiopenStatusAllocFailed\b"),
    # cuFFT plan workspace, CUFFT_CHECK in ATen/native/cuda/CuFFTUtils.h: "cuFFT error:
    # CUFFT_ALLOC_FAILED" (pytorch/pytorch#6511). HIPFFT_ is the ROCm spelling.
    ErrorPattern("cufft", r"\b(?:CU|HIP)FFT_ALLOC_FAILED\b"),
    # cuSOLVER, TORCH_CUSOLVER_CHECK in ATen/cuda/Exceptions.h: "cusolver error:
    # CUSOLVER_STATUS_ALLOC_FAILED, when calling `...`" (cusolverGetErrorMessage returns the
    # status name).
    ErrorPattern("cusolver", r"\bCUSOLVER_STATUS_ALLOC_FAILED\b"),
    # cuSPARSE allocation failure as printed by its status name, e.g. "CuSparseError:
    # CUSPARSE_STATUS_ALLOC_FAILED" (NVIDIA-Genomics-Research/rapids-single-cell-examples#11).
    ErrorPattern("cusparse", r"\bCUSPARSE_STATUS_ALLOC_FAILED\b"),
    # Torch's CPU allocator, c10/core/impl/alloc_cpu.cpp (alloc_cpu): on Linux
    # "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate
    # memory: you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate
    # memory)"; on Windows "... DefaultCPUAllocator: not enough memory: you tried to allocate
    # 26214400 bytes." (lllyasviel/Fooocus#237).
    ErrorPattern(
        "cpu_allocator", r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"
    ),
)

# Errors that depend on the batch size but are not memory: the size overflows an index type,
# a launch grid, or a per-buffer cap. Smaller batches may work; "out of memory" would be a lie.
SIZE_LIMIT_PATTERNS: tuple[ErrorPattern, ...] = (
    # CUDA kernels that index with int32: "input tensor must fit into 32-bit index math"
    # (aten/src/ATen/native/cuda/ReplicationPadding.cu, reflection padding; BoxTeacher#11),
    # "output gradient tensor must fit into 32-bit index math", and the generic
    # "Expected canUse32BitIndexMath(input) && canUse32BitIndexMath(output) to be true, but
    # got false." (aten/src/ATen/native/cuda/DepthwiseConv2d.cu; pytorch/pytorch#80020).
    # Torch <= 1.2 (THC): "THCudaTensor sizes too large for THCDeviceTensor conversion"
    # (pytorch/pytorch#24401, batch 700).
    ErrorPattern(
        "index_32bit",
        r"must fit into 32-bit index math|\bcanUse32BitIndexMath\b"
        r"|sizes too large for THCDeviceTensor conversion",
    ),
    # Packed accessors with int32 indices, TensorBase::packed_accessor32 in
    # aten/src/ATen/core/TensorBase.h: "numel needs to be smaller than int32_t max;
    # otherwise, please use packed_accessor64". Checks written as
    # "Expected output.numel() <= std::numeric_limits<int32_t>::max() to be true, but got
    # false." (intel/torch-xpu-ops#2510), and messages that compare against INT_MAX.
    ErrorPattern(
        "int32_numel",
        r"smaller than int32_t max|numeric_limits<int(?:32_t)?>::max\(\)"
        r"|(?:less than|smaller than|greater than|exceeds?|[<>]=?)\s*(?:INT_MAX|INT32_MAX)\b",
    ),
    # safe_downcast<int, int64_t> in aten/src/ATen/native/Pool.h and friends: "integer out of
    # range" (pytorch/pytorch#167253: max_pool2d on a (74, 32, 30090, 81) CUDA tensor).
    # c10::checked_convert (c10/util/TypeCast.h): "value cannot be converted to type int32_t
    # without overflow" (NVIDIA/recsys-examples#72).
    ErrorPattern(
        "int32_downcast",
        r"\binteger out of range\b|cannot be converted to type int(?:32_t|32)? without overflow",
    ),
    # A launch grid too large for the batch (gridDim.y/z <= 65535): cudaErrorInvalidConfiguration,
    # "CUDA error: invalid configuration argument" (pytorch/pytorch#16998: BatchNorm1d at
    # batch 2**17; swc-17/SparseDrive#62: only when the batch grows). HIP spells it the same.
    ErrorPattern(
        "launch_config",
        r"(?:CUDA|HIP) error: invalid configuration argument"
        r"|\b(?:cuda|hip)ErrorInvalidConfiguration\b",
    ),
    # cuDNN refuses tensors with more than 2**31 elements, AT_CUDNN_CHECK in
    # ATen/cuda/Exceptions.h: "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear
    # if you passed in a non-contiguous input." (pytorch/pytorch#22496: Conv3d fails from
    # batch 42 on; "a documented restriction"). A non-contiguous input fails at every batch
    # size, so the smallest batch surfaces it as the error it is.
    ErrorPattern("cudnn_not_supported", r"\bCUDNN_STATUS_NOT_SUPPORTED\b"),
    # oneDNN (mkldnn) on the CPU fails to create the kernel for huge shapes:
    # "could not create a primitive" (pytorch/pytorch#55884: conv2d only above some image
    # size; uxlfoundation/oneDNN#1500). "could not create a primitive descriptor for ..." is
    # an unsupported configuration, not a size, and is not matched.
    ErrorPattern("onednn_primitive", r"could not create a primitive(?! descriptor)"),
    # MPS caps a single buffer at the device's maxBufferLength, MPSAllocator.mm:
    # "Invalid buffer size: 19.45 GB" (pytorch/pytorch#141909), and matmul outputs at 2**32
    # elements: "Output size of the matrix multiplication is larger than currently supported
    # by the MPS backend: 72250,72250, needs to be less than 2**32 elements".
    ErrorPattern(
        "mps_buffer_limit",
        r"\bInvalid buffer size: [0-9.]+ [KMGT]i?B\b|needs to be less than 2\*\*32 elements",
    ),
    # Intel Extension for PyTorch caps one XPU allocation at 4 GB on some platforms: "Current
    # platform can NOT allocate memory block with size larger than 4GB! Tried to allocate
    # 6.85 GiB ..." (intel/intel-extension-for-pytorch#629).
    ErrorPattern("xpu_buffer_limit", r"can NOT allocate memory block with size larger than"),
)

# NCCL/RCCL failures, ProcessGroupNCCL and torch/csrc/distributed/c10d/NCCLUtils.hpp:
# "NCCL error in: .../NCCLUtils.hpp:275, unhandled cuda error (run with NCCL_DEBUG=INFO for
# details), NCCL version 2.20.5\nncclUnhandledCudaError: Call to CUDA function failed.\nLast
# error:\nCuda failure 1 'invalid argument'" (NVIDIA/nccl#1410). The same text with "Cuda
# failure 'out of memory'" is deliberately not an OOM (see rule 5 in the module docstring).
# Older torch and NCCL wrappers spell it "NCCL Error 1: unhandled cuda error"
# (TheAtticusProject/cuad#9) or "NCCL error: ..." (vllm-project/vllm#21661).
_NCCL_MESSAGE = re.compile(r"\b(?i:NCCL error)\b|\bnccl[A-Z][A-Za-z]*Error\b")


def _torch_class(*paths: str) -> tuple[type[BaseException], ...]:
    """Resolve dotted names under ``torch`` to exception classes, skipping absent ones."""
    found: list[type[BaseException]] = []
    for path in paths:
        obj: object = torch
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj not in found:
            found.append(obj)
    return tuple(found)


# torch.OutOfMemoryError exists since torch 2.1; torch.cuda.OutOfMemoryError since 1.13.
_TYPED_OOM: tuple[type[BaseException], ...] = _torch_class(
    "OutOfMemoryError", "cuda.OutOfMemoryError"
)
# torch.distributed.DistError (base of DistBackendError, DistNetworkError, DistStoreError).
_DIST_ERRORS: tuple[type[BaseException], ...] = _torch_class(
    "distributed.DistError", "distributed.DistBackendError"
)


def _messages(exc: BaseException) -> list[str]:
    """The texts to match: ``str(exc)`` and every string argument."""
    texts: list[str] = []
    with contextlib.suppress(Exception):  # a broken __str__ must not break classification
        texts.append(str(exc))
    texts.extend(arg for arg in getattr(exc, "args", ()) if isinstance(arg, str))
    return texts


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts, outermost first, each once, at most MAX_CHAIN_DEPTH."""
    seen: set[int] = set()
    links: list[BaseException] = []
    pending: list[BaseException] = [exc]
    while pending and len(links) < MAX_CHAIN_DEPTH:
        link = pending.pop(0)
        if id(link) in seen:
            continue
        seen.add(id(link))
        links.append(link)
        if link.__cause__ is not None:
            pending.append(link.__cause__)
        if link.__context__ is not None and not link.__suppress_context__:
            pending.append(link.__context__)
    return links


def _vetoed(links: list[BaseException]) -> bool:
    """A bare BaseException or a distributed failure anywhere makes the chain non-retryable."""
    for link in links:
        if not isinstance(link, Exception):
            return True
        if _DIST_ERRORS and isinstance(link, _DIST_ERRORS):
            return True
        if isinstance(link, RuntimeError) and any(
            _NCCL_MESSAGE.search(text) for text in _messages(link)
        ):
            return True
    return False


def _match(link: BaseException, table: tuple[ErrorPattern, ...]) -> str | None:
    if not isinstance(link, RuntimeError):
        return None
    texts = _messages(link)
    for row in table:
        if any(row.matches(text) for text in texts):
            return row.kind
    return None


def _link_oom_kind(link: BaseException) -> str | None:
    if _TYPED_OOM and isinstance(link, _TYPED_OOM):
        # Name the device from the message when it says; the type alone says "allocator".
        return _match(link, OOM_PATTERNS) or "torch_oom"
    if isinstance(link, MemoryError):
        return "python_memory"
    return _match(link, OOM_PATTERNS)


def oom_kind(exc: BaseException) -> str | None:
    """The kind of out-of-memory error ``exc`` is (first matching link), or ``None``.

    Kinds: ``"cuda_allocator"``, ``"hip"``, ``"xpu"``, ``"mps"``, ``"cuda_runtime"``,
    ``"cublas"``, ``"cudnn"``, ``"miopen"``, ``"cufft"``, ``"cusolver"``, ``"cusparse"``,
    ``"cpu_allocator"``, ``"torch_oom"`` (a ``torch.OutOfMemoryError`` whose message names no
    device) and ``"python_memory"`` (:class:`MemoryError`).

    Example:
        >>> oom_kind(RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"))
        'cufft'
        >>> oom_kind(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x5)")) is None
        True

    Args:
        exc: The exception to classify; its ``__cause__``/``__context__`` chain is walked.
    """
    links = _chain(exc)
    if _vetoed(links):
        return None
    for link in links:
        kind = _link_oom_kind(link)
        if kind is not None:
            return kind
    return None


def is_oom_error(exc: BaseException) -> bool:
    """Say whether ``exc`` (or an exception in its cause chain) means "out of memory".

    Example:
        >>> is_oom_error(RuntimeError("CUDA error: out of memory"))
        True
        >>> is_oom_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
        False

    Args:
        exc: The exception to classify; its ``__cause__``/``__context__`` chain is walked.
    """
    return oom_kind(exc) is not None


def size_limit_kind(exc: BaseException) -> str | None:
    """The kind of batch-size limit (not memory) ``exc`` reports, or ``None``.

    ``None`` as well when the chain is an out-of-memory error: OOM takes precedence.
    Kinds: ``"index_32bit"``, ``"int32_numel"``, ``"int32_downcast"``, ``"launch_config"``,
    ``"cudnn_not_supported"``, ``"onednn_primitive"``, ``"mps_buffer_limit"``,
    ``"xpu_buffer_limit"``.

    Example:
        >>> size_limit_kind(RuntimeError("input tensor must fit into 32-bit index math"))
        'index_32bit'

    Args:
        exc: The exception to classify; its ``__cause__``/``__context__`` chain is walked.
    """
    links = _chain(exc)
    if _vetoed(links) or any(_link_oom_kind(link) is not None for link in links):
        return None
    for link in links:
        kind = _match(link, SIZE_LIMIT_PATTERNS)
        if kind is not None:
            return kind
    return None


def is_size_limit_error(exc: BaseException) -> bool:
    """Say whether ``exc`` is a batch-size-dependent failure that is not out of memory.

    Such an error means "this batch does not fit" for a reason other than memory (32-bit
    index math, a launch grid or buffer cap); callers report it as such.

    Example:
        >>> is_size_limit_error(RuntimeError("could not create a primitive"))
        True
        >>> is_size_limit_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        False

    Args:
        exc: The exception to classify; its ``__cause__``/``__context__`` chain is walked.
    """
    return size_limit_kind(exc) is not None


def failure_kind(exc: BaseException) -> str | None:
    """What a trial that raised ``exc`` ran into, when it depends on the batch size: an OOM kind
    (``"cuda_allocator"``, ...), ``"size_limit:<kind>"``, or ``None`` for any other error.

    >>> failure_kind(RuntimeError("input tensor must fit into 32-bit index math"))
    'size_limit:index_32bit'
    >>> failure_kind(ValueError("a bug")) is None
    True
    """
    kind = oom_kind(exc)
    if kind is not None:
        return kind
    limit = size_limit_kind(exc)
    return None if limit is None else f"size_limit:{limit}"
