"""A batch size for every sequence length: how many trials, how exact, and what it buys in
training (not run in CI).

For a small transformer and a GRU, each trained with Adam on token sequences, the simulated
GPU's capacity is fixed and five lengths are measured. The true largest batch B*(L) at each
length is checked with two real training steps in a fresh ``SimulatedGPU(capacity)``: B*
fits, B*+1 does not. Then, from the same model and optimizer:

- ours: ``search_batch_sizes(model, sample_for, lengths, Adam, headroom=0)``, the longest
  length searched first and every other one started from the prediction of the lengths
  measured before it; and the same with the default headroom (one more trial per length,
  measuring the recommended size's own peak);
- per length: ``search_batch_size(..., headroom=0)`` at each length on its own;
- doubling, then bisection, per length, as NeMo's OOMptimizer does for each bucket: 1, 2, 4,
  ... until a size fails, then bisection between the last fit and the first failure; each
  size one trial of two real steps in a fresh simulator.

Then a training run over a long-tailed dataset (lengths exponential with mean 24 plus 8,
capped at the longest measured length), one epoch, padded to each batch's longest sample:
the ``MemoryAwareBatchSampler`` with ours' table, next to a fixed batch sized for the longest
length (what fits the worst case) and a fixed batch sized for the median length (what fits
most batches). OOMs are counted and skipped (the step is lost), as a training loop that
catches them would.

    python benchmarks/bench_lengths.py               # both models, a few minutes on 2 cores
    python benchmarks/bench_lengths.py --models gru  # one
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import autobatch
from autobatch.data import MemoryAwareBatchSampler
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import gru, tokens, transformer

RESULTS = Path(__file__).resolve().parent / "results" / "bench_lengths.md"
CE = nn.functional.cross_entropy
SAMPLE_ROWS = 2


@dataclass(frozen=True)
class Setup:
    """A model, the capacity it is measured in, and the lengths."""

    name: str
    model: Callable[[], nn.Module]
    capacity: str
    lengths: tuple[int, ...]


SETUPS = {
    "transformer": Setup("transformer (d_model 64, 2 layers)", lambda: transformer(), "24MiB",
                         (16, 32, 64, 96, 128)),
    "gru": Setup("GRU (embed 32, hidden 64)", gru, "8MiB", (16, 32, 48, 64, 96)),
}


def sample_for(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(SAMPLE_ROWS, length)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    CE(model(x), y).backward()
    opt.step()


@dataclass
class Oracle:
    """Two real training steps at a size, in a fresh simulator: the truth, and the OOMptimizer
    style search's trial (each call counted)."""

    model: nn.Module
    capacity: int
    calls: list[tuple[int, int, bool]] = field(default_factory=list)

    def fits(self, length: int, n: int, count: bool = True) -> bool:
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        opt = torch.optim.Adam(self.model.parameters())
        rows = torch.arange(n) % SAMPLE_ROWS
        ok = True
        try:
            with SimulatedGPU(self.capacity) as gpu:
                gpu.adopt(self.model)
                x, y = sample_for(length)
                xb, yb = x[rows], y[rows]
                _step(self.model, opt, xb, yb)
                _step(self.model, opt, xb, yb)
        except torch.OutOfMemoryError:
            ok = False
        finally:
            self.model.zero_grad(set_to_none=True)
            self.model.load_state_dict(state)
        if count:
            self.calls.append((length, n, ok))
        return ok


def doubling_then_bisection(oracle: Oracle, length: int) -> int:
    """NeMo OOMptimizer's search for one bucket: double from 1 until a failure, then bisect."""
    low, high = 0, None
    n = 1
    while high is None:
        if oracle.fits(length, n):
            low, n = n, n * 2
        else:
            high = n
    while high - low > 1:
        middle = (low + high) // 2
        if oracle.fits(length, middle):
            low = middle
        else:
            high = middle
    return low


@dataclass
class Row:
    method: str
    answers: dict[int, int]
    trials: dict[int, list[tuple[int, bool]]]

    def total(self) -> int:
        return sum(len(t) for t in self.trials.values())

    def ooms(self) -> int:
        return sum(not fits for t in self.trials.values() for _, fits in t)

    def samples(self) -> int:
        return sum(n for t in self.trials.values() for n, _ in t)


def _table_row(method: str, table: autobatch.LengthTable) -> Row:
    trials: dict[int, list[tuple[int, bool]]] = {}
    for trial in table.trials:
        trials.setdefault(trial.length, []).append((trial.size, trial.fits))
    return Row(method, {n: table.max_batch_size(n) for n in table.lengths}, trials)


def measure(setup: Setup, log: Callable[[str], None]) -> tuple[str, autobatch.LengthTable, int]:
    torch.manual_seed(0)
    model = setup.model()
    capacity = SimulatedGPU(setup.capacity).capacity_bytes
    rows: list[Row] = []
    with SimulatedGPU(capacity) as gpu:
        gpu.adopt(model)
        table = autobatch.search_batch_sizes(
            model, sample_for, setup.lengths, torch.optim.Adam, loss_fn=CE, headroom=0
        )
        log(f"{setup.name}: ours, {len(table.trials)} trials")
        rows.append(_table_row("ours, `search_batch_sizes`", table))
        with_headroom = autobatch.search_batch_sizes(
            model, sample_for, setup.lengths, torch.optim.Adam, loss_fn=CE
        )
        rows.append(_table_row("ours, default headroom (0.05)", with_headroom))
        per_length: dict[int, autobatch.SearchResult] = {}
        for length in setup.lengths:
            per_length[length] = autobatch.search_batch_size(
                model, sample_for(length), torch.optim.Adam, loss_fn=CE, headroom=0
            )
        log(f"{setup.name}: per-length searches done")
        rows.append(Row(
            "`search_batch_size` per length",
            {n: r.max_batch_size for n, r in per_length.items()},
            {n: [(t.size, t.fits) for t in r.trials] for n, r in per_length.items()},
        ))
    oracle = Oracle(model, capacity)
    doubling = {n: doubling_then_bisection(oracle, n) for n in setup.lengths}
    trials: dict[int, list[tuple[int, bool]]] = {}
    for length, n, ok in oracle.calls:
        trials.setdefault(length, []).append((n, ok))
    rows.append(Row("doubling then bisection per length (OOMptimizer)", doubling, trials))
    log(f"{setup.name}: doubling and bisection done")
    truth = {}
    for length in setup.lengths:
        best = table.max_batch_size(length)
        exact = oracle.fits(length, best, count=False) and not oracle.fits(length, best + 1, count=False)
        truth[length] = best if exact else None
    log(f"{setup.name}: B* checked")
    return report(setup, capacity, rows, truth), table, capacity


def report(setup: Setup, capacity: int, rows: list[Row], truth: dict[int, int | None]) -> str:
    lengths = setup.lengths
    bound = 2 * len(lengths) + 3
    lines = [
        f"### {setup.name}, capacity {setup.capacity}, lengths {', '.join(map(str, lengths))}",
        "",
        "B* (two real steps fit at B*, not at B*+1): "
        + ", ".join(f"{n}: {truth[n] if truth[n] is not None else 'NOT EXACT'}" for n in lengths),
        "",
        "| method | trials | OOM trials | samples processed | trials / ours | exact at every length |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    ours = rows[0].total()
    for row in rows:
        exact = all(row.answers[n] == truth[n] for n in lengths)
        lines.append(
            f"| {row.method} | {row.total()} | {row.ooms()} | {row.samples()} | "
            f"{row.total() / ours:.2f} | {'yes' if exact else 'no'} |"
        )
    lines += [
        "",
        f"Goal: ours at most 2·{len(lengths)}+3 = {bound} trials: "
        f"{'met' if ours <= bound else 'MISSED'} ({ours}).",
        "",
        "| length | B* | " + " | ".join(f"{row.method}: answer, trials" for row in rows) + " |",
        "|---:|---:|" + "---|" * len(rows),
    ]
    for n in sorted(lengths, reverse=True):
        cells = [
            f"{row.answers[n]}{'' if row.answers[n] == truth[n] else ' ✗'}, {len(row.trials[n])}"
            for row in rows
        ]
        lines.append(f"| {n} | {truth[n]} | " + " | ".join(cells) + " |")
    lines += ["", "Sizes tried, longest length first (✗ = OOM):", ""]
    for row in rows:
        parts = [
            f"{n}: " + ", ".join(f"{size}{'' if fits else '✗'}" for size, fits in row.trials[n])
            for n in sorted(lengths, reverse=True)
        ]
        lines.append(f"- {row.method}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def training_run(
    setup: Setup, table: autobatch.LengthTable, capacity: int, log: Callable[[str], None],
    samples: int,
) -> str:
    longest = max(setup.lengths)
    generator = torch.Generator().manual_seed(1)
    draws = torch.empty(samples).exponential_(1 / 24, generator=generator)
    lengths = [min(longest, 8 + int(x)) for x in draws]
    data = [(torch.randint(1, 1000, (n,), generator=generator), i % 10)
            for i, n in enumerate(lengths)]
    median = int(statistics.median(lengths))

    def pad(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = nn.utils.rnn.pad_sequence([row for row, _ in batch], batch_first=True)
        return rows, torch.tensor([label for _, label in batch])

    def run(loader: DataLoader[Any]) -> dict[str, float]:
        torch.manual_seed(0)
        model = setup.model()
        opt = torch.optim.Adam(model.parameters())
        steps = ooms = done = real = padded = 0
        with SimulatedGPU(capacity) as gpu:
            gpu.adopt(model)
            for x, y in loader:
                steps += 1
                failed = False
                try:
                    _step(model, opt, x, y)
                except torch.OutOfMemoryError:
                    failed = True
                if failed:  # recover outside the except block
                    ooms += 1
                    model.zero_grad(set_to_none=True)
                else:
                    done += x.shape[0]
                    real += int((x != 0).sum())  # token 0 is padding here
                    padded += x.numel()
                del x, y
        return {"steps": steps, "ooms": ooms, "samples": done, "real": real, "padded": padded}

    sampler = MemoryAwareBatchSampler(lengths, table, seed=0)
    runs = {
        "`MemoryAwareBatchSampler` with the table": run(
            DataLoader(data, batch_sampler=sampler, collate_fn=pad)
        ),
    }
    log(f"{setup.name}: sampler run done")
    for label, size in (
        (f"fixed batch {table.batch_size(longest)} (fits length {longest})",
         table.batch_size(longest)),
        (f"fixed batch {table.batch_size(median)} (fits the median length {median})",
         table.batch_size(median)),
    ):
        loader = DataLoader(data, batch_size=size, shuffle=True, collate_fn=pad,
                            generator=torch.Generator().manual_seed(0))
        runs[label] = run(loader)
        log(f"{setup.name}: {label} done")
    ours = runs["`MemoryAwareBatchSampler` with the table"]
    per_step = ours["real"] / ours["steps"]
    lines = [
        f"#### Training run: {setup.name}, one epoch of {samples} samples, lengths 8 + "
        f"exponential(mean 24), capped at {longest} (median {median}, "
        f"{sum(n == longest for n in lengths)} at the cap)",
        "",
        "| batches | steps | OOMs | samples trained | real tokens per step | padding | "
        "sampler's real tokens per step / this |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, got in runs.items():
        tokens_per_step = got["real"] / max(got["steps"] - got["ooms"], 1)  # steps that ran
        pad_share = 1 - got["real"] / got["padded"] if got["padded"] else 0.0
        lines.append(
            f"| {label} | {got['steps']} | {got['ooms']} | {got['samples']} of {samples} | "
            f"{tokens_per_step:.0f} | {pad_share:.0%} | "
            f"{per_step / tokens_per_step if tokens_per_step else math.inf:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SETUPS), default=sorted(SETUPS))
    parser.add_argument("--samples", type=int, default=1000, help="samples in the training run")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", file=sys.stderr, flush=True)

    random.seed(0)
    sections = [
        "# Batch sizes per sequence length: ours, per-length searches, doubling and bisection",
        "",
        "Produced by `python benchmarks/bench_lengths.py`. Everything runs on `SimulatedGPU` "
        "(exact allocator model) with Adam; a trial is one size at one length (two real steps "
        "for doubling and bisection, one for ours). 'exact' compares each method's largest "
        "size with B*, checked by two real training steps in a fresh simulator. Ratios, not "
        f"seconds. torch {torch.__version__}, autobatch {autobatch.__version__}.",
        "",
    ]
    ok = True
    for name in args.models:
        setup = SETUPS[name]
        text, table, capacity = measure(setup, log)
        ok &= len(table.trials) <= 2 * len(setup.lengths) + 3
        sections += [text, training_run(setup, table, capacity, log, args.samples)]
    report = "\n".join(sections)
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report, encoding="utf-8")
    log(f"wrote {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
