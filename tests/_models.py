"""Models only the tests need."""

from __future__ import annotations

import torch
from torch import nn

from autobatch.testing.models import mlp


class Branchy(nn.Module):
    """The test MLP, with one more operator past 16 rows: its operators change with the size."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out * 2 if x.shape[0] > 16 else out
