"""Tests for autobatch._oom: which exceptions mean "out of memory" or "batch too large".

Every message in the tables is a real one: copied from the torch (or library) source that
raises it, or from a public issue, cited in the row's id comment. Exception types are the
ones torch raises: torch.OutOfMemoryError, torch.AcceleratorError (when this torch has it),
torch.distributed.DistBackendError, RuntimeError.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed
from hypothesis import given
from hypothesis import strategies as st

from autobatch._oom import (
    MAX_CHAIN_DEPTH,
    OOM_PATTERNS,
    SIZE_LIMIT_PATTERNS,
    ErrorPattern,
    is_oom_error,
    is_size_limit_error,
    oom_kind,
    size_limit_kind,
)

# torch.AcceleratorError exists in recent torch (CUDA/HIP runtime errors); older torch raised
# RuntimeError with the same text.
AcceleratorError: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)
DistBackendError: type[RuntimeError] = torch.distributed.DistBackendError

_CUDA_TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing "
    "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
_HIP_TAIL = (
    "\nHIP kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing "
    "AMD_SERIALIZE_KERNEL=3\nCompile with `TORCH_USE_HIP_DSA` to enable device-side assertions.\n"
)


def _cuda_runtime(text: str, enum: str) -> str:
    """The shape of c10_cuda_check_implementation's message (c10/cuda/CUDAException.cpp)."""
    return (
        f"CUDA error: {text}\nSearch for `{enum}' in "
        "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more "
        "information." + _CUDA_TAIL
    )


# (exception type, message, expected oom_kind); the id names the source.
OOM_ROWS = [
    pytest.param(
        torch.OutOfMemoryError,
        "CUDA out of memory. Tried to allocate 22.78 GiB. GPU 0 has a total capacity of 31.47 GiB "
        "of which 12.73 GiB is free. Including non-PyTorch memory, this process has 18.73 GiB "
        "memory in use. Of the allocated memory 9.08 GiB is allocated by PyTorch, and 9.35 GiB is "
        "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        "cuda_allocator",
        id="cuda-allocator-2.x:murong-xu/CADS#4",
    ),
    pytest.param(
        torch.OutOfMemoryError,
        "CUDA out of memory. Tried to allocate 55.57 GiB. GPU 0 has a total capacty of 12.00 GiB "
        "of which 9.02 GiB is free. Of the allocated memory 984.52 MiB is allocated by PyTorch, "
        "and 463.48 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
        "memory is large try setting max_split_size_mb to avoid fragmentation.  See "
        "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        "cuda_allocator",
        id="cuda-allocator-2.1:wxian3/NeuroLens#2",
    ),
    pytest.param(
        RuntimeError,
        "CUDA out of memory. Tried to allocate 2.87 GiB (GPU 0; 14.76 GiB total capacity; "
        "8.77 GiB already allocated; 19.75 MiB free; 13.71 GiB reserved in total by PyTorch)",
        "cuda_allocator",
        id="cuda-allocator-1.x-RuntimeError:rshaojimmy/MADDoG#11",
    ),
    pytest.param(
        RuntimeError,
        "CUDA out of memory. Tried to allocate 25.00 MiB (GPU 0; 3.94 GiB total capacity; "
        "3.14 GiB already allocated; 21.56 MiB free; 634.00 KiB cached)",
        "cuda_allocator",
        id="cuda-allocator-1.0:cherubicXN/afm_cvpr2019#8",
    ),
    pytest.param(
        torch.OutOfMemoryError,
        "HIP out of memory. Tried to allocate 3.31 GiB. GPU 0 has a total capacity of 128.00 GiB "
        "of which 780.24 MiB is free. Of the allocated memory 57.70 GiB is allocated by PyTorch, "
        "and 75.82 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
        "is large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        "hip",
        id="hip-allocator:kyuz0/amd-strix-halo-image-video-toolboxes#3",
    ),
    pytest.param(
        torch.OutOfMemoryError,
        "XPU out of memory. Tried to allocate 4.66 GiB. GPU 0 has a total capacity of 5.65 GiB of "
        "which 5.65 GiB is free. Of the allocated memory 195.50 KiB is allocated by PyTorch, and "
        "1.81 MiB is reserved by PyTorch but unallocated. Please use `empty_cache` to release all "
        "unoccupied cached memory.",
        "xpu",
        id="xpu-allocator:intel/torch-xpu-ops#3011",
    ),
    pytest.param(
        RuntimeError,
        "XPU out of memory. Tried to allocate 1.71 GiB (GPU 0; 15.56 GiB total capacity; 0 bytes "
        "already allocated; 0 bytes reserved in total by PyTorch)",
        "xpu",
        id="xpu-ipex-RuntimeError:intel/intel-extension-for-pytorch#629",
    ),
    pytest.param(
        RuntimeError,
        "MPS backend out of memory (MPS allocated: 5.50 GB, other allocations: 14.76 GB, max "
        "allowed: 20.40 GB). Tried to allocate 147.24 MB on private pool. Use "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
        "cause system failure).",
        "mps",
        id="mps-allocator:pytorch/pytorch#130112",
    ),
    pytest.param(
        AcceleratorError,
        _cuda_runtime("out of memory", "cudaErrorMemoryAllocation"),
        "cuda_runtime",
        id="cuda-runtime-AcceleratorError:c10/cuda/CUDAException.cpp",
    ),
    pytest.param(
        RuntimeError,
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
        "other API call,so the stacktrace below might be incorrect.\nFor debugging consider "
        "passing CUDA_LAUNCH_BLOCKING=1.",
        "cuda_runtime",
        id="cuda-runtime-RuntimeError:taohan10200/IIM#28",
    ),
    pytest.param(
        RuntimeError,
        "cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/generic/THCStorage.cu:58",
        "cuda_runtime",
        id="cuda-runtime-THC:yl-1993/Matrix-Capsules-EM-PyTorch#1",
    ),
    pytest.param(
        RuntimeError,
        "CUDA driver error: out of memory",
        "cuda_runtime",
        id="cuda-driver:AT_CUDA_DRIVER_CHECK(ATen/cuda/Exceptions.h)",
    ),
    pytest.param(
        AcceleratorError,
        "HIP error: out of memory\nSearch for `hipErrorOutOfMemory' in "
        "https://rocm.docs.amd.com/projects/HIP/en/latest/index.html for more information."
        + _HIP_TAIL,
        "hip",
        id="hip-runtime-AcceleratorError:vladmandic/sdnext#4801",
    ),
    pytest.param(
        RuntimeError,
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cublas",
        id="cublas:QwenLM/Qwen3#873",
    ),
    pytest.param(
        RuntimeError,
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "cudnn",
        id="cudnn-alloc:KupynOrest/DeblurGAN#128",
    ),
    pytest.param(
        RuntimeError,
        "Unable to find a valid cuDNN algorithm to run convolution (try_all at "
        "/opt/conda/conda-bld/pytorch_1591914855613/work/aten/src/ATen/native/cudnn/Conv.cpp:693)",
        "cudnn",
        id="cudnn-no-algorithm:FunctionLab/sei-framework#19",
    ),
    pytest.param(
        RuntimeError,
        "Unable to find a valid cuDNN algorithm to run convolution",
        "cudnn",
        id="cudnn-no-algorithm:marqo-ai/marqo#101",
    ),
    pytest.param(
        RuntimeError,
        "miopenStatusAllocFailed",
        "miopen",
        id="miopen:miopenGetErrorString(via MIOPEN_CHECK)",
    ),
    pytest.param(
        RuntimeError,
        "cuFFT error: CUFFT_ALLOC_FAILED",
        "cufft",
        id="cufft:pytorch/pytorch#6511",
    ),
    pytest.param(
        RuntimeError,
        "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`. "
        "If you keep seeing this error, you may use "
        "`torch.backends.cuda.preferred_linalg_library()` to try linear algebra operators with "
        "other supported backends. See "
        "https://pytorch.org/docs/stable/backends.html#torch.backends.cuda.preferred_linalg_library",
        "cusolver",
        id="cusolver:TORCH_CUSOLVER_CHECK(ATen/cuda/Exceptions.h)",
    ),
    pytest.param(
        RuntimeError,
        "CUSPARSE_STATUS_ALLOC_FAILED",
        "cusparse",
        id="cusparse:NVIDIA-Genomics-Research/rapids-single-cell-examples#11",
    ),
    pytest.param(
        RuntimeError,
        "[enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 132426121216 bytes. Error code 12 (Cannot allocate memory)",
        "cpu_allocator",
        id="cpu-allocator-linux:mxfold/mxfold2#20",
    ),
    pytest.param(
        RuntimeError,
        "[enforce fail at ..\\c10\\core\\impl\\alloc_cpu.cpp:72] data. DefaultCPUAllocator: not "
        "enough memory: you tried to allocate 26214400 bytes.",
        "cpu_allocator",
        id="cpu-allocator-windows:lllyasviel/Fooocus#237",
    ),
    pytest.param(
        RuntimeError,
        "[enforce fail at CPUAllocator.cpp:64] . DefaultCPUAllocator: can't allocate memory: you "
        "tried to allocate 4611686018427387904 bytes. Error code 12 (Cannot allocate memory)",
        "cpu_allocator",
        id="cpu-allocator-1.x:pytorch/pytorch#20056",
    ),
    pytest.param(
        torch.OutOfMemoryError,
        "",
        "torch_oom",
        id="typed-OutOfMemoryError-without-message:torch.OutOfMemoryError",
    ),
    pytest.param(
        MemoryError,
        "Unable to allocate 1.00 TiB for an array with shape (137438953472,) and data type float64",
        "python_memory",
        id="typed-MemoryError:numpy._core._exceptions._ArrayMemoryError",
    ),
]

# (exception type, message): must NOT count as OOM. The id names the source and the rule.
LOOKALIKE_ROWS = [
    pytest.param(
        AcceleratorError,
        _cuda_runtime("an illegal memory access was encountered", "cudaErrorIllegalAddress"),
        id="illegal-memory-access:c10/cuda/CUDAException.cpp",
    ),
    pytest.param(
        AcceleratorError,
        _cuda_runtime("device-side assert triggered", "cudaErrorAssert"),
        id="device-side-assert:c10/cuda/CUDAException.cpp",
    ),
    pytest.param(
        RuntimeError,
        "CUDA error: misaligned address" + _CUDA_TAIL,
        id="misaligned-address:cudaErrorMisalignedAddress",
    ),
    pytest.param(
        AcceleratorError,
        _cuda_runtime("an illegal instruction was encountered", "cudaErrorIllegalInstruction"),
        id="illegal-instruction:cudaErrorIllegalInstruction",
    ),
    pytest.param(
        RuntimeError,
        "CUDA error: unspecified launch failure" + _CUDA_TAIL,
        id="launch-failure:cudaErrorLaunchFailure",
    ),
    pytest.param(
        DistBackendError,
        "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\nncclUnhandledCudaError: Call "
        "to CUDA function failed.\nLast error:\nCuda failure 1 'invalid argument'",
        id="nccl-DistBackendError:NVIDIA/nccl#1410",
    ),
    pytest.param(
        DistBackendError,
        "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\nncclUnhandledCudaError: Call "
        "to CUDA function failed.\nLast error:\nCuda failure 'out of memory'",
        # NCCL reports the CUDA failure it hit ("NCCL WARN Cuda failure 'out of memory'",
        # PKU-YuanGroup/Open-Sora-Plan#386); still vetoed: the communicator is broken.
        id="nccl-out-of-memory-vetoed:PKU-YuanGroup/Open-Sora-Plan#386",
    ),
    pytest.param(
        RuntimeError,
        "NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        id="nccl-RuntimeError:vllm-project/vllm#21661",
    ),
    pytest.param(
        RuntimeError,
        "NCCL Error 1: unhandled cuda error",
        id="nccl-old:TheAtticusProject/cuad#9",
    ),
    pytest.param(
        RuntimeError,
        "mat1 and mat2 shapes cannot be multiplied (64x100 and 200x10)",
        id="shape-mismatch:aten/src/ATen/native/LinearAlgebra.cpp(addmm)",
    ),
    pytest.param(
        RuntimeError,
        "Error(s) in loading state_dict for Net:\n\tsize mismatch for fc.weight: copying a param "
        "with shape torch.Size([10, 512]) from checkpoint, the shape in current model is "
        "torch.Size([10, 256]).",
        id="size-mismatch:torch/nn/modules/module.py(load_state_dict)",
    ),
    pytest.param(
        RuntimeError,
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
        "and cpu!",
        id="device-mismatch:aten/src/ATen/native/TensorCompare.cpp",
    ),
    pytest.param(
        RuntimeError,
        "could not create a primitive",
        id="onednn-size-limit-not-oom:pytorch/pytorch#55884",
    ),
    pytest.param(
        RuntimeError,
        "cuDNN error: CUDNN_STATUS_MAPPING_ERROR",
        id="cudnn-mapping:AT_CUDNN_CHECK",
    ),
    pytest.param(
        RuntimeError,
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
        "non-contiguous input.",
        id="cudnn-not-supported-not-oom:pytorch/pytorch#22496",
    ),
    pytest.param(
        RuntimeError,
        "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
        id="cudnn-execution:MCG-NKU/E2FGVI#45",
    ),
    pytest.param(
        RuntimeError,
        # Also reported with full memory, but as often a CUDA/driver mismatch: a retry at
        # batch 1 would turn it into a misleading "nothing fits".
        "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
        id="cublas-not-initialized:TORCH_CUDABLAS_CHECK",
    ),
    pytest.param(
        RuntimeError,
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, "
        "m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`",
        id="cublas-execution:TORCH_CUDABLAS_CHECK",
    ),
    pytest.param(
        RuntimeError,
        # Sometimes low memory (pytorch/pytorch#119420), often a toolkit/GPU mismatch.
        "cuFFT error: CUFFT_INTERNAL_ERROR",
        id="cufft-internal:pytorch/pytorch#89556",
    ),
    pytest.param(
        RuntimeError,
        # cuDNN v8 API; also seen with CUDA version mismatches (HKUDS/VideoRAG#10).
        "GET was unable to find an engine to execute this computation",
        id="cudnn-v8-no-engine:facebookresearch/dinov2#158",
    ),
    pytest.param(
        RuntimeError,
        "cusolver error: CUSOLVER_STATUS_EXECUTION_FAILED, when calling `cusolverDnSgetrf( "
        "handle, m, n, dA, ldda, static_cast<float*>(dataPtr.get()), ipiv, info)`",
        id="cusolver-execution:JingwenWang95/KinectFusion#4",
    ),
    pytest.param(
        RuntimeError,
        # Triton's OutOfResources (triton/runtime/errors.py): a kernel config limit.
        "out of resource: shared memory, Required: 131072, Hardware limit: 101376. Reducing "
        "block sizes or `num_stages` may help.",
        id="triton-shared-memory:triton.runtime.errors.OutOfResources",
    ),
    pytest.param(
        KeyError,
        "CUDA out of memory. Tried to allocate 2.00 MiB",
        id="keyerror-quoting-oom-text:rule-3",
    ),
    pytest.param(
        ValueError,
        "CUDA error: out of memory",
        id="valueerror-quoting-oom-text:rule-3",
    ),
    pytest.param(
        RuntimeError,
        "failed to parse config key 'on_out_of_memory'",
        id="bare-words-out-of-memory:no-backend-prefix",
    ),
]


def _exc(cls: type[BaseException], message: str) -> BaseException:
    return cls(message) if message else cls()


@pytest.mark.parametrize(("cls", "message", "kind"), OOM_ROWS)
def test_real_oom_messages_count(cls: type[BaseException], message: str, kind: str) -> None:
    exc = _exc(cls, message)
    assert is_oom_error(exc)
    assert oom_kind(exc) == kind
    assert not is_size_limit_error(exc)  # OOM takes precedence


@pytest.mark.parametrize(("cls", "message"), LOOKALIKE_ROWS)
def test_lookalikes_do_not_count(cls: type[BaseException], message: str) -> None:
    exc = _exc(cls, message)
    assert not is_oom_error(exc)
    assert oom_kind(exc) is None


def test_tables_are_large_enough_and_every_oom_row_is_exercised() -> None:
    assert len(OOM_ROWS) >= 18
    assert len(LOOKALIKE_ROWS) >= 10
    tested = {row.values[2] for row in OOM_ROWS}
    assert {p.kind for p in OOM_PATTERNS} <= tested
    tested_limits = {row.values[1] for row in SIZE_LIMIT_ROWS}
    assert {p.kind for p in SIZE_LIMIT_PATTERNS} <= tested_limits


def test_cuda_out_of_memory_error_is_the_same_class() -> None:
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    assert is_oom_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 B"))


def test_accelerator_error_availability_is_what_this_suite_assumes() -> None:
    # Recorded so a torch upgrade that drops or adds it shows up here, not as silent skips.
    if hasattr(torch, "AcceleratorError"):
        assert issubclass(torch.AcceleratorError, RuntimeError)
        assert AcceleratorError is torch.AcceleratorError
    else:
        assert AcceleratorError is RuntimeError


def test_error_pattern_matches_by_search() -> None:
    row = ErrorPattern("cufft", r"CUFFT_ALLOC_FAILED")
    assert row.matches("cuFFT error: CUFFT_ALLOC_FAILED")
    assert not row.matches("cuFFT error: CUFFT_INTERNAL_ERROR")


# --- genuine errors from torch itself ---------------------------------------------------


def test_huge_cpu_allocation_is_a_runtime_error_classified_as_cpu_oom() -> None:
    # On torch 2.13 the CPU allocator raises a plain RuntimeError (c10::Error), not
    # torch.OutOfMemoryError: "[enforce fail at alloc_cpu.cpp:127] err == 0.
    # DefaultCPUAllocator: can't allocate memory: you tried to allocate 4611686018427387904
    # bytes. Error code 12 (Cannot allocate memory)". 2**62 bytes exceeds any address space.
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)
    exc = info.value
    assert type(exc) is RuntimeError
    assert not isinstance(exc, torch.OutOfMemoryError)
    assert "DefaultCPUAllocator" in str(exc)
    assert is_oom_error(exc)
    assert oom_kind(exc) == "cpu_allocator"
    assert not is_size_limit_error(exc)


def test_real_shape_error_from_torch_is_not_oom() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.nn.functional.linear(torch.ones(4, 3), torch.ones(5, 2))
    assert not is_oom_error(info.value)
    assert not is_size_limit_error(info.value)


# --- cause chains -----------------------------------------------------------------------


def _oom() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


class StepFailedError(Exception):
    """A user's wrapper exception."""


def _raised(outer: BaseException, *, cause: BaseException | None = None) -> BaseException:
    """``outer`` as it is after ``raise outer from cause`` (or a plain raise)."""
    try:
        if cause is None:
            raise outer
        raise outer from cause
    except BaseException as caught:  # the caught object carries the chain
        return caught


def test_oom_wrapped_with_raise_from_counts_and_keeps_its_kind() -> None:
    exc = _raised(StepFailedError("training step 7 failed"), cause=_oom())
    assert is_oom_error(exc)
    assert oom_kind(exc) == "cuda_allocator"


def _raise_while_handling(inner: BaseException, outer: BaseException, *, hide: bool) -> None:
    """Raise ``outer`` inside ``except inner`` (implicit ``__context__``), ``from None`` if hide."""
    try:
        raise inner
    except BaseException:
        if hide:
            raise outer from None
        raise outer  # noqa: B904


def test_oom_as_implicit_context_counts() -> None:
    with pytest.raises(StepFailedError) as info:
        _raise_while_handling(_oom(), StepFailedError("cleanup failed"), hide=False)
    exc = info.value
    assert exc.__cause__ is None
    assert isinstance(exc.__context__, torch.OutOfMemoryError)
    assert is_oom_error(exc)
    assert oom_kind(exc) == "cuda_allocator"


def test_raise_from_none_hides_the_context_as_python_does() -> None:
    # "from None" says the inner error adds nothing; the chain Python shows ends here.
    with pytest.raises(StepFailedError) as info:
        _raise_while_handling(_oom(), StepFailedError("gave up"), hide=True)
    assert info.value.__suppress_context__
    assert isinstance(info.value.__context__, torch.OutOfMemoryError)
    assert not is_oom_error(info.value)


def test_lookalike_wrapping_an_oom_still_counts() -> None:
    # Rule 4: any OOM link makes the chain an OOM, whatever wraps it.
    outer = AcceleratorError(
        _cuda_runtime("an illegal memory access was encountered", "cudaErrorIllegalAddress")
    )
    exc = _raised(outer, cause=_oom())
    assert is_oom_error(exc)
    assert oom_kind(exc) == "cuda_allocator"


def test_oom_wrapping_nothing_counts() -> None:
    exc = _raised(_oom())
    assert exc.__cause__ is None
    assert exc.__context__ is None
    assert is_oom_error(exc)


def test_oom_wrapping_a_lookalike_counts() -> None:
    exc = _raised(_oom(), cause=RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert is_oom_error(exc)


def test_first_oom_link_names_the_kind() -> None:
    inner = RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED")
    outer = _raised(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED"), cause=inner)
    assert oom_kind(outer) == "cublas"


def test_cycle_terminates() -> None:
    a = RuntimeError("first")
    b = RuntimeError("second")
    a.__cause__ = b
    b.__cause__ = a
    assert not is_oom_error(a)
    assert size_limit_kind(a) is None


def test_cycle_through_an_oom_counts() -> None:
    a = StepFailedError("wrapper")
    b = _oom()
    a.__cause__ = b
    b.__context__ = a
    assert is_oom_error(a)
    assert is_oom_error(b)


def test_self_cycle_terminates() -> None:
    a = RuntimeError("me again")
    a.__context__ = a
    assert not is_oom_error(a)


def _chain_of(depth: int, innermost: BaseException) -> BaseException:
    exc = innermost
    for i in range(depth):
        wrapper = StepFailedError(f"layer {i}")
        wrapper.__cause__ = exc
        exc = wrapper
    return exc


def test_deep_chain_within_the_limit_counts() -> None:
    assert is_oom_error(_chain_of(MAX_CHAIN_DEPTH - 1, _oom()))


def test_chain_beyond_the_limit_is_not_followed() -> None:
    assert not is_oom_error(_chain_of(MAX_CHAIN_DEPTH, _oom()))


def test_very_deep_chain_is_cheap() -> None:
    deep = _chain_of(50_000, _oom())
    assert not is_oom_error(deep)


def test_keyboard_interrupt_is_never_oom() -> None:
    assert not is_oom_error(KeyboardInterrupt())
    assert not is_oom_error(_raised(KeyboardInterrupt(), cause=_oom()))
    assert not is_oom_error(SystemExit(1))


def test_oom_raised_while_handling_ctrl_c_is_vetoed() -> None:
    # Retrying this would swallow the user's interrupt.
    with pytest.raises(torch.OutOfMemoryError) as info:
        _raise_while_handling(KeyboardInterrupt(), _oom(), hide=False)
    assert isinstance(info.value.__context__, KeyboardInterrupt)
    assert not is_oom_error(info.value)


def test_distributed_error_in_the_chain_vetoes() -> None:
    nccl = DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1275, unhandled cuda error")
    assert not is_oom_error(_raised(_oom(), cause=nccl))
    assert not is_oom_error(_raised(nccl, cause=_oom()))
    old_style = RuntimeError("NCCL Error 1: unhandled cuda error")  # TheAtticusProject/cuad#9
    assert not is_oom_error(_raised(old_style, cause=_oom()))
    assert not is_oom_error(_raised(_oom(), cause=old_style))


def test_string_args_are_matched_too() -> None:
    exc = RuntimeError("training step failed", "cuFFT error: CUFFT_ALLOC_FAILED")
    assert oom_kind(exc) == "cufft"


class _BrokenStrError(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no text for you")


def test_broken_str_does_not_break_classification() -> None:
    assert not is_oom_error(_BrokenStrError())
    assert is_oom_error(_BrokenStrError("CUDA error: out of memory"))  # found through args
    assert is_oom_error(_raised(_BrokenStrError(), cause=_oom()))


def test_runtime_error_subclasses_are_matched() -> None:
    class LibraryError(RuntimeError):
        pass

    assert is_oom_error(LibraryError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))


# --- size limits ------------------------------------------------------------------------

SIZE_LIMIT_ROWS = [
    pytest.param(
        "input tensor must fit into 32-bit index math",
        "index_32bit",
        id="32bit-input:hustvl/BoxTeacher#11",
    ),
    pytest.param(
        "output gradient tensor must fit into 32-bit index math",
        "index_32bit",
        id="32bit-grad:aten/src/ATen/native/cuda/ReplicationPadding.cu",
    ),
    pytest.param(
        "Expected canUse32BitIndexMath(input) && canUse32BitIndexMath(output) to be true, but got "
        "false.  (Could this error message be improved?  If so, please report an enhancement "
        "request to PyTorch.)",
        "index_32bit",
        id="canUse32BitIndexMath:pytorch/pytorch#80020",
    ),
    pytest.param(
        "THCudaTensor sizes too large for THCDeviceTensor conversion at "
        "/pytorch/aten/src/THC/THCDeviceTensorUtils.cuh:71",
        "index_32bit",
        id="thc-device-tensor:pytorch/pytorch#24401",
    ),
    pytest.param(
        "numel needs to be smaller than int32_t max; otherwise, please use packed_accessor64",
        "int32_numel",
        id="packed-accessor32:aten/src/ATen/core/TensorBase.h",
    ),
    pytest.param(
        "Expected output.numel() <= std::numeric_limits<int32_t>::max() to be true, but got false."
        "  (Could this error message be improved?  If so, please report an enhancement request "
        "to PyTorch.)",
        "int32_numel",
        id="numeric-limits:intel/torch-xpu-ops#2510",
    ),
    pytest.param(
        "integer out of range",
        "int32_downcast",
        id="safe-downcast:pytorch/pytorch#167253",
    ),
    pytest.param(
        "value cannot be converted to type int32_t without overflow",
        "int32_downcast",
        id="checked-convert:NVIDIA/recsys-examples#72",
    ),
    pytest.param(
        "CUDA error: invalid configuration argument\nCompile with `TORCH_USE_CUDA_DSA` to enable "
        "device-side assertions.\n",
        "launch_config",
        id="launch-config:swc-17/SparseDrive#62",
    ),
    pytest.param(
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
        "non-contiguous input.",
        "cudnn_not_supported",
        id="cudnn-2**31:pytorch/pytorch#22496",
    ),
    pytest.param(
        "could not create a primitive",
        "onednn_primitive",
        id="onednn:pytorch/pytorch#55884",
    ),
    pytest.param(
        "Invalid buffer size: 19.45 GB",
        "mps_buffer_limit",
        id="mps-buffer:pytorch/pytorch#141909",
    ),
    pytest.param(
        "Output size of the matrix multiplication is larger than currently supported by the MPS "
        "backend: 72250,72250, needs to be less than 2**32 elements",
        "mps_buffer_limit",
        id="mps-matmul:pytorch/pytorch#141909",
    ),
    pytest.param(
        "Current platform can NOT allocate memory block with size larger than 4GB! Tried to "
        "allocate 6.85 GiB (GPU  0; 15.56 GiB total capacity; 0 bytes already allocated; 0 bytes "
        "reserved in total by PyTorch)",
        "xpu_buffer_limit",
        id="ipex-4gb:intel/intel-extension-for-pytorch#629",
    ),
]

NOT_SIZE_LIMIT_ROWS = [
    pytest.param(
        "could not create a primitive descriptor for the convolution forward propagation "
        "primitive. Run workload with environment variable ONEDNN_VERBOSE=all to get additional "
        "diagnostic information.",
        id="onednn-descriptor-is-configuration:libtorch_cpu(oneDNN)",
    ),
    pytest.param(
        "value cannot be converted to type int64_t without overflow",
        id="int64-conversion-is-a-bad-scalar:c10/util/TypeCast.h",
    ),
    pytest.param(
        "mat1 and mat2 shapes cannot be multiplied (64x100 and 200x10)",
        id="shape-mismatch",
    ),
    pytest.param(
        "CUDA error: an illegal memory access was encountered",
        id="illegal-memory-access",
    ),
    pytest.param(
        "CUDA out of memory. Tried to allocate 8.00 GiB (GPU 0; 15.78 GiB total capacity)",
        id="oom-is-not-a-size-limit",
    ),
    pytest.param(
        "cuDNN error: CUDNN_STATUS_MAPPING_ERROR",
        id="cudnn-mapping",
    ),
]


@pytest.mark.parametrize(("message", "kind"), SIZE_LIMIT_ROWS)
def test_size_limit_messages(message: str, kind: str) -> None:
    exc = RuntimeError(message)
    assert is_size_limit_error(exc)
    assert size_limit_kind(exc) == kind
    assert not is_oom_error(exc)


@pytest.mark.parametrize("message", NOT_SIZE_LIMIT_ROWS)
def test_not_size_limit_messages(message: str) -> None:
    assert not is_size_limit_error(RuntimeError(message))


def test_size_limit_needs_a_runtime_error() -> None:
    assert not is_size_limit_error(ValueError("input tensor must fit into 32-bit index math"))


def test_size_limit_wrapped_counts() -> None:
    inner = RuntimeError("input tensor must fit into 32-bit index math")
    assert size_limit_kind(_raised(StepFailedError("step"), cause=inner)) == "index_32bit"


def test_oom_takes_precedence_over_size_limit_in_a_chain() -> None:
    size = RuntimeError("input tensor must fit into 32-bit index math")
    for exc in (_raised(size, cause=_oom()), _raised(_oom(), cause=size)):
        assert is_oom_error(exc)
        assert not is_size_limit_error(exc)
        assert size_limit_kind(exc) is None


def test_oom_takes_precedence_in_one_message() -> None:
    exc = RuntimeError(
        "CUDA out of memory. Tried to allocate 8.00 GiB; input tensor must fit into 32-bit index math"
    )
    assert oom_kind(exc) == "cuda_allocator"
    assert size_limit_kind(exc) is None


def test_distributed_error_vetoes_size_limit() -> None:
    nccl = DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1275, invalid usage")
    inner = RuntimeError("CUDA error: invalid configuration argument")
    assert not is_size_limit_error(_raised(nccl, cause=inner))


# --- properties -------------------------------------------------------------------------

_OOM_TEXTS: list[str] = [str(row.values[1]) for row in OOM_ROWS if row.values[0] is RuntimeError]


_NO_NCCL = st.text(max_size=40).filter(lambda t: "nccl" not in t.lower())


@given(
    prefix=_NO_NCCL,
    suffix=_NO_NCCL,
    before=st.sampled_from([" ", "\n", ": ", "RuntimeError: ", "\t"]),
    after=st.sampled_from([" ", "\n", ". ", "\t"]),
    index=st.integers(min_value=0, max_value=len(_OOM_TEXTS) - 1),
)
def test_surrounding_text_does_not_hide_an_oom(
    prefix: str, suffix: str, before: str, after: str, index: int
) -> None:
    # Traceback lines, logger prefixes and notes around the message do not matter.
    message = prefix + before + _OOM_TEXTS[index] + after + suffix
    assert is_oom_error(RuntimeError(message))


@given(text=st.text(max_size=200))
def test_classification_never_raises(text: str) -> None:
    for cls in (RuntimeError, ValueError, KeyError, MemoryError):
        exc = cls(text)
        assert isinstance(is_oom_error(exc), bool)
        assert isinstance(is_size_limit_error(exc), bool)
        assert not (is_oom_error(exc) and is_size_limit_error(exc))


@given(depth=st.integers(min_value=0, max_value=MAX_CHAIN_DEPTH - 1), implicit=st.booleans())
def test_any_wrapping_depth_within_the_limit_keeps_the_oom(depth: int, implicit: bool) -> None:
    exc: BaseException = _oom()
    for i in range(depth):
        wrapper = StepFailedError(f"layer {i}")
        if implicit:
            wrapper.__context__ = exc
        else:
            wrapper.__cause__ = exc
        exc = wrapper
    assert is_oom_error(exc)
