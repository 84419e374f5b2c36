"""Benchmark the cached-embedding split (``embed_in_pieces``) of a CLIP-style step.

    python benchmarks/bench_contrastive.py            # about a minute on a laptop CPU
    python benchmarks/bench_contrastive.py --quick

One CLIP-style model (an image MLP, a text encoder over 32 tokens, a learned temperature), one
batch, one AdamW step, three ways:

- **unsplit**: ``loss(encode(batch)).backward()``, the truth;
- **cached-embedding split** (``embed_in_pieces(..., chunk=c)``) for several chunk sizes;
- **naive split**: gradient accumulation over chunks, each chunk's InfoNCE over its own
  negatives, weighted by its share (what a row split computes; ``retry_on_oom`` refuses it).

For each: CPU time per step relative to the unsplit step (median of interleaved repeats,
thread CPU time), the peak of device memory under ``SimulatedGPU`` (caching allocator), and
how far the parameters land from the unsplit step's after one step (float64).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from autobatch import embed_in_pieces
from autobatch._units import format_bytes
from autobatch.testing import SimulatedGPU

Batch = dict[str, torch.Tensor]


class Clip(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, 32))
        self.embed = nn.Embedding(1000, width)
        self.text = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.head = nn.Linear(width, 32)
        self.log_scale = nn.Parameter(torch.tensor(2.6))

    def encode(self, rows: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image(rows["image"]), self.head(self.text(self.embed(rows["text"])).mean(1))

    def loss(self, embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = (F.normalize(e, dim=1) for e in embeddings)
        logits = self.log_scale.exp() * a @ b.T
        labels = torch.arange(len(a))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _batch(n: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    return {"image": torch.randn(n, 64, generator=g),
            "text": torch.randint(0, 1000, (n, 32), generator=g)}


def _unsplit(model: Clip, batch: Batch) -> None:
    model.loss(model.encode(batch)).backward()


def _cached(chunk: int) -> Callable[[Clip, Batch], None]:
    def step(model: Clip, batch: Batch) -> None:
        embed_in_pieces(model.encode, model.loss, batch, chunk=chunk)
    return step


def _naive(chunk: int) -> Callable[[Clip, Batch], None]:
    def step(model: Clip, batch: Batch) -> None:
        n = len(batch["image"])
        for start in range(0, n, chunk):
            part = {k: v[start:start + chunk] for k, v in batch.items()}
            (model.loss(model.encode(part)) * len(part["image"]) / n).backward()
    return step


def _train(step: Callable[[Clip, Batch], None], batch: Batch, model: Clip) -> Clip:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.zero_grad()
    step(model, batch)
    opt.step()
    return model


def _error(model: Clip, reference: Clip) -> float:
    return max(float(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).detach())
               for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def _peak(step: Callable[[Clip, Batch], None], batch: Batch, base: Clip) -> int:
    model = copy.deepcopy(base)
    with SimulatedGPU("64GiB", adopt=[model]) as gpu:
        _train(step, batch, model)
    return gpu.peak_bytes


def _times(steps: dict[str, Callable[[Clip, Batch], None]], batch: Batch, base: Clip,
           repeats: int) -> dict[str, float]:
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):  # (interleaved: a busy moment of the machine hits all alike)
        for name, step in steps.items():
            model = copy.deepcopy(base)
            start = time.thread_time()
            _train(step, batch, model)
            seconds[name].append(time.thread_time() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    n = 128 if args.quick else 512
    repeats = 3 if args.quick else 7
    batch = _batch(n)
    base = Clip()
    steps: dict[str, Callable[[Clip, Batch], None]] = {"unsplit": _unsplit}
    for chunk in (n // 4, n // 16):
        steps[f"cached-embedding split, chunk {chunk}"] = _cached(chunk)
    for chunk in (n // 4, n // 16):
        steps[f"naive split, chunk {chunk} (wrong)"] = _naive(chunk)
    times = _times(steps, batch, base, repeats)
    torch.set_default_dtype(torch.float64)
    try:
        base64 = Clip()
        batch64 = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        reference = _train(_unsplit, batch64, copy.deepcopy(base64))
        errors = {name: _error(_train(step, batch64, copy.deepcopy(base64)), reference)
                  for name, step in steps.items()}
    finally:
        torch.set_default_dtype(torch.float32)
    peaks = {name: _peak(step, batch, base) for name, step in steps.items()}
    lines = [
        f"CLIP-style step, batch {n}, one AdamW step; CPU time relative to the unsplit step "
        f"(median of {repeats}, interleaved), peak device memory under SimulatedGPU (caching "
        "allocator), largest relative parameter error against the unsplit step (float64).",
        "",
        "| step | time / unsplit | peak memory | peak / unsplit | parameter error |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in steps:
        lines.append(
            f"| {name} | {times[name] / times['unsplit']:.2f}x | {format_bytes(peaks[name])} | "
            f"{peaks[name] / peaks['unsplit']:.2f}x | {errors[name]:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
