"""An out-of-memory error on one rank in one phase of a step, for batches over a size: the
distributed finder tests give one rank this limit, as a tighter device would."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autobatch.testing import OOM_KINDS

PHASES = ("forward", "backward", "optimizer")


@contextlib.contextmanager
def oom_over(model: nn.Module, layer: nn.Module, phase: str, rows: int) -> Iterator[list[int]]:
    """While active, every step of ``model`` on a batch of more than ``rows`` rows raises CUDA's
    out-of-memory error: in ``layer``'s forward (``"forward"``), in backward once the layers
    after ``layer`` have their gradients (``"backward"``: the gradient reaching ``layer``'s
    output fails), or as the optimizer step begins (``"optimizer"``). Yields the list of
    phases it fired in."""
    if phase not in PHASES:
        raise ValueError(phase)
    seen = [0]  # the rows of the batch the model last ran on
    fired: list[str] = []

    def rows_of(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen[0] = args[0].shape[0]

    def fire(where: str) -> None:
        fired.append(where)
        raise OOM_KINDS["cuda"]()

    def forward(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        if seen[0] <= rows:
            return
        if phase == "forward":
            fire("forward")
        elif phase == "backward":
            out.register_hook(lambda grad: fire("backward"))

    def step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if phase == "optimizer" and seen[0] > rows:
            fire("optimizer")

    hooks = [
        model.register_forward_pre_hook(rows_of),
        layer.register_forward_hook(forward),
        register_optimizer_step_pre_hook(step),
    ]
    try:
        yield fired
    finally:
        for hook in hooks:
            hook.remove()
