"""Attention on ``meta`` run with the kernel the planned device runs, not the math path.

``torch.nn.functional.scaled_dot_product_attention`` chooses a kernel for the device of its
inputs. ``meta`` has none to choose from, so a planned step runs the math path there, which
keeps the attention weights (batch x heads x queries x keys) for backward. The CPU runs its
fused flash kernel whenever it can (no dropout, a supported dtype and shape), which keeps one
logsumexp per query instead: a plan of the math path counts weights the CPU never holds, and
its largest batch is too small (by 12% on a small ViT).

:class:`FusedAttention` asks torch which kernel the CPU would choose for the call (stand-ins
of the same shapes, dtypes and last strides, which hold no memory) and, for the flash kernel,
runs on ``meta`` what the CPU runs: a boolean mask turned into an additive one, then
``_scaled_dot_product_flash_attention_for_cpu``, whose meta kernel returns its output and
logsumexp. That sequence is checked once per kind of call against what torch really dispatches
on tiny CPU tensors; where it differs (another torch), the step cannot be planned on ``meta``
and the planner falls back to real CPU steps. Other devices keep the math path: their fused
kernels (flash, memory-efficient, cuDNN) are chosen by the GPU, which the planner does not
have, so the plan is an upper bound there.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from autobatch._memory._accounting import DispatchMode

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                             "scale": None, "enable_gqa": False}


class FusedAttention(TorchFunctionMode):
    """While active, ``scaled_dot_product_attention`` on ``meta`` tensors runs what the CPU
    runs for it (see the module's docstring). For planning the CPU only: other devices keep
    the math path."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = {**_DEFAULTS, **dict(zip(_NAMES, args, strict=False)), **kwargs}
        tensors = [call["query"], call["key"], call["value"], call["attn_mask"]]
        if not all(t is None or (isinstance(t, torch.Tensor) and t.is_meta) for t in tensors):
            return func(*args, **kwargs)
        if _cpu_choice(call) != SDPBackend.FLASH_ATTENTION.value:
            return func(*args, **kwargs)  # the math path, on the CPU as on meta
        mask = call["attn_mask"]
        kind = "none" if mask is None else "bool" if mask.dtype == torch.bool else "additive"
        problem = _checked(kind, call["query"].dtype, call["key"].shape[-3] != call["query"].shape[-3])
        if problem is not None:
            raise RuntimeError(
                f"on the CPU, torch {torch.__version__} runs fused attention with operators the "
                f"planner does not replay on meta ({problem})"
            )
        query = call["query"]
        if kind == "bool":  # the CPU's conversion of a boolean mask: 0 where kept, -inf elsewhere
            mask = torch.where(
                mask,
                torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device),
            )
        out, _ = _FLASH_CPU(
            query, call["key"], call["value"], call["dropout_p"], call["is_causal"],
            attn_mask=mask, scale=call["scale"],
        )
        return out


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``tensor``'s shape, dtype, last stride and ``requires_grad``, whose
    other strides are 0: what torch's choice of kernel looks at, in a few bytes."""
    if not tensor.dim():
        return torch.zeros((), dtype=tensor.dtype).requires_grad_(tensor.requires_grad)
    last = tensor.stride(-1)
    strides = [0] * (tensor.dim() - 1) + [last]
    span = (tensor.shape[-1] - 1) * last + 1 if tensor.shape[-1] else 1
    base = torch.zeros(span, dtype=tensor.dtype)
    return base.as_strided(tensor.shape, strides).requires_grad_(tensor.requires_grad)


def _cpu_choice(call: dict[str, Any]) -> int:
    """The kernel torch would choose on the CPU for this call (an ``SDPBackend`` value)."""
    mask = call["attn_mask"]
    with _disable_current_modes():
        return int(torch._fused_sdp_choice(
            _stand_in(call["query"]), _stand_in(call["key"]), _stand_in(call["value"]),
            None if mask is None else _stand_in(mask), call["dropout_p"], call["is_causal"],
            scale=call["scale"], enable_gqa=call["enable_gqa"],
        ))


class _Dispatched(DispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """Records the operators that allocate (views and ``detach`` left out)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[Any] = []

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (func.is_view or func is torch.ops.aten.detach.default):
            self.ops.append(func)
        return func(*args, **kwargs)


@functools.cache
def _checked(kind: str, dtype: torch.dtype, grouped: bool) -> str | None:
    """``None`` when torch on the CPU runs a fused attention with a ``kind`` mask (``"none"``,
    ``"bool"``, ``"additive"``), of ``dtype``, with fewer key than query heads (``grouped``)
    exactly as :class:`FusedAttention` replays it; else what it runs instead."""
    expected = [torch.ops.aten.scalar_tensor.default] * 2 + [torch.ops.aten.where.self]
    expected = (expected if kind == "bool" else []) + [_FLASH_CPU]
    heads = 2 if grouped else 4
    recorder = _Dispatched()
    with _disable_current_modes():  # (none of the planner's modes sees these real tensors)
        query = torch.zeros(1, 4, 4, 8, dtype=dtype, requires_grad=True)
        key = torch.zeros(1, heads, 4, 8, dtype=dtype, requires_grad=True)
        value = torch.zeros(1, heads, 4, 8, dtype=dtype, requires_grad=True)
        mask = None
        if kind == "bool":
            mask = torch.ones(4, 4, dtype=torch.bool).tril()
        elif kind == "additive":
            mask = torch.zeros(4, 4, dtype=dtype)
        with recorder:
            F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=grouped)
    if recorder.ops == expected:
        return None
    return "dispatched " + ", ".join(str(op) for op in recorder.ops)
