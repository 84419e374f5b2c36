"""Small real models for tests, benchmarks and the demo: an MLP, a conv net with BatchNorm and a
transformer, each with a matching ``sample(n)`` that makes a labelled batch of ``n`` rows; a
GRU, which like the transformer reads token sequences of any length (:func:`tokens`); and a
mixture of experts, whose shapes inside a step depend on how its router sends the rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def mlp(width: int = 256, depth: int = 3, inputs: int = 128, classes: int = 10) -> nn.Module:
    """A ReLU multi-layer perceptron."""
    layers: list[nn.Module] = []
    size = inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, classes))
    return nn.Sequential(*layers)


def conv_net(channels: int = 16, classes: int = 10) -> nn.Module:
    """A small conv net with BatchNorm for 3x32x32 images."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.BatchNorm2d(2 * channels),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, classes),
    )


class TinyTransformer(nn.Module):
    """A token classifier: embedding, a ``nn.TransformerEncoder`` and a linear head."""

    def __init__(
        self,
        vocab: int = 1000,
        d_model: int = 64,
        heads: int = 4,
        layers: int = 2,
        classes: int = 10,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=dropout, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(tokens)).mean(dim=1))
        return out


def transformer(vocab: int = 1000, d_model: int = 64, layers: int = 2) -> nn.Module:
    """A small transformer encoder classifier for token sequences."""
    return TinyTransformer(vocab=vocab, d_model=d_model, layers=layers)


class TinyGRU(nn.Module):
    """A token classifier: embedding, a one-layer ``nn.GRU`` and a linear head on its last
    step."""

    def __init__(
        self, vocab: int = 1000, embed: int = 32, hidden: int = 64, classes: int = 10
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states, _ = self.gru(self.embed(tokens))
        out: torch.Tensor = self.head(states[:, -1])
        return out


class RecurrentClassifier(nn.Module):
    """A classifier of vector sequences: ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` (``kind``), then a
    linear head on the last step; ``batch_first`` as the recurrent layer's (its input is always
    ``(batch, steps, inputs)``)."""

    def __init__(
        self, kind: str, layers: int = 1, batch_first: bool = True, inputs: int = 16,
        hidden: int = 64, classes: int = 10,
    ) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = getattr(nn, kind)(inputs, hidden, num_layers=layers, batch_first=batch_first)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch_first:
            x = x.transpose(0, 1)
        out = self.rnn(x)[0]
        last = out[:, -1] if self.batch_first else out[-1]
        result: torch.Tensor = self.head(last)
        return result


def gru(vocab: int = 1000, embed: int = 32, hidden: int = 64) -> nn.Module:
    """A small GRU classifier for token sequences."""
    return TinyGRU(vocab=vocab, embed=embed, hidden=hidden)


class MixtureOfExperts(nn.Module):
    """A classifier of vectors through a mixture-of-experts MLP: a router sends each row to its
    ``top_k`` best experts (small MLPs), whose outputs, weighted by the router, are summed back
    in place (``index_add_``), as Mixtral's sparse MLP does. How many rows each expert gets, and
    so the shapes of its tensors, depend on the router and the batch."""

    def __init__(
        self, inputs: int = 128, width: int = 64, hidden: int = 256, experts: int = 8,
        top_k: int = 2, classes: int = 10,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be between 1 and experts={experts}, got {top_k!r}")
        self.top_k = top_k
        self.embed = nn.Linear(inputs, width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, width))
            for _ in range(experts)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        weights, chosen = self.router(h).softmax(dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        mixed = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            mixed.index_add_(0, rows, expert(h[rows]) * weights[rows, slot, None])
        out: torch.Tensor = self.head(mixed)
        return out


def mixture_of_experts(width: int = 64, experts: int = 8, top_k: int = 2) -> nn.Module:
    """A small mixture-of-experts classifier for vectors of 128 features."""
    return MixtureOfExperts(width=width, hidden=4 * width, experts=experts, top_k=top_k)


def tokens(
    n: int, length: int, vocab: int = 1000, classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random token sequences of ``length`` and their labels."""
    return torch.randint(0, vocab, (n, length)), torch.randint(0, classes, (n,))


@dataclass(frozen=True)
class Workload:
    """A model factory with a sample factory: ``sample(n)`` -> ``(inputs, labels)``."""

    name: str
    model: Callable[[], nn.Module]
    sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))


def _vectors(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 128), torch.randint(0, 10, (n,))


def _tokens(n: int, length: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (n, length)), torch.randint(0, 10, (n,))


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", mlp, _vectors),
    "conv": Workload("conv", conv_net, _images),
    "transformer": Workload("transformer", transformer, _tokens),
}
