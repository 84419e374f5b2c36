"""A batch size for every sequence length: how many trials, how exact, and what it buys in
training (not run in CI).

For a small transformer and a GRU, each trained with Adam on token sequences, the simulated
GPU's capacity is fixed and five lengths are measured, under one of its two allocator models
(``--allocator``). A trial runs a size at a length; the truth for a size is:

- ``exact`` (allocated bytes; ``results/bench_lengths.md``): two real training steps in a fresh
  ``SimulatedGPU(capacity, allocator="exact")``;
- ``caching`` (CUDA's caching allocator; ``results/bench_lengths_caching.md``): a user's own
  plain loop in a fresh ``SimulatedGPU(capacity, allocator="caching")``: a fresh copy of the
  model, a fresh Adam, a new batch copied to the device each step, the loss held until the next
  one, for ``CACHING_STEPS`` (5) steps.

The true largest batch B*(L) at each length is what doubling then bisection (below) finds with
the truth as its trial, confirmed by the truth at B*+1; where another method's answer above it
trains (under the caching allocator whether a size trains is not monotone in the size near
the boundary), B* is raised to the boundary above that answer. Samples are made in host memory
and copied to the device, as a loader does. Then, from the same model and optimizer:

- ours: ``search_batch_sizes(model, sample_for, lengths, Adam, headroom=0)``, the longest
  length searched first and every other one started from the prediction of the lengths
  measured before it; and the same with the default headroom (one more trial per length,
  measuring the recommended size's own peak);
- per length: ``search_batch_size(..., headroom=0)`` at each length on its own;
- doubling, then bisection, per length, as NeMo's OOMptimizer does for each bucket: 1, 2, 4,
  ... until a size fails, then bisection between the last fit and the first failure; each
  size one trial of the truth's steps in a fresh simulator.

Then a training run over a long-tailed dataset (lengths exponential with mean 24 plus 8,
capped at the longest measured length), one epoch, padded to each batch's longest sample:
the ``MemoryAwareBatchSampler`` with ours' table, next to a fixed batch sized for the longest
length (what fits the worst case) and a fixed batch sized for the median length (what fits
most batches). OOMs are counted and skipped (the step is lost), as a training loop that
catches them would.

    python benchmarks/bench_lengths.py                      # both models, a few minutes
    python benchmarks/bench_lengths.py --models gru         # one
    python benchmarks/bench_lengths.py --allocator caching  # the caching allocator's truth
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.data import DataLoader

import autobatch
from autobatch._sizing._trial import CACHING_STEPS
from autobatch.data import MemoryAwareBatchSampler
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import gru, tokens, transformer

RESULTS = {
    "exact": Path(__file__).resolve().parent / "results" / "bench_lengths.md",
    "caching": Path(__file__).resolve().parent / "results" / "bench_lengths_caching.md",
}
CE = nn.functional.cross_entropy
SAMPLE_ROWS = 2


@dataclass(frozen=True)
class Setup:
    """A model, the capacity it is measured in (under either allocator model: B* spans about
    the same range under both), and the lengths."""

    name: str
    model: Callable[[], nn.Module]
    capacity: str
    lengths: tuple[int, ...]


SETUPS = {
    "transformer": Setup("transformer (d_model 64, 2 layers)", lambda: transformer(), "24MiB",
                         (16, 32, 64, 96, 128)),
    "gru": Setup("GRU (embed 32, hidden 64)", gru, "8MiB", (16, 32, 48, 64, 96)),
}

Samples = dict[int, tuple[torch.Tensor, torch.Tensor]]


def host_samples(lengths: tuple[int, ...]) -> Samples:
    """A few rows at each length, made in host memory (outside any simulated GPU), as a user's
    sample is: what the searches and the truth take their rows from."""
    return {length: tokens(SAMPLE_ROWS, length) for length in lengths}


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    CE(model(x), y).backward()
    opt.step()


@dataclass
class Oracle:
    """Whether a batch of ``n`` rows at a length trains, in a fresh simulator: two real training
    steps (exact allocator), or a user's own loop for ``CACHING_STEPS`` steps (caching). The
    truth, and the OOMptimizer-style search's trial (each counted call recorded); each size at
    each length is run once."""

    model: nn.Module
    capacity: int
    allocator: str
    samples: Samples
    calls: list[tuple[int, int, bool]] = field(default_factory=list)
    known: dict[tuple[int, int], bool] = field(default_factory=dict)

    def fits(self, length: int, n: int, count: bool = True) -> bool:
        if (length, n) not in self.known:
            run = self._two_steps if self.allocator == "exact" else self._fresh_loop
            self.known[length, n] = run(length, n)
        if count:
            self.calls.append((length, n, self.known[length, n]))
        return self.known[length, n]

    def _host_batch(self, length: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(n) % SAMPLE_ROWS
        x, y = self.samples[length]
        return x[rows], y[rows]

    def _two_steps(self, length: int, n: int) -> bool:
        model = copy.deepcopy(self.model)
        opt = torch.optim.Adam(model.parameters())
        x, y = self._host_batch(length, n)
        try:
            with SimulatedGPU(self.capacity, allocator="exact") as gpu:
                gpu.adopt(model)
                xb, yb = x.clone(), y.clone()
                _step(model, opt, xb, yb)
                _step(model, opt, xb, yb)
        except torch.OutOfMemoryError:
            return False
        return True

    def _fresh_loop(self, length: int, n: int) -> bool:
        """As ``tests/_models.py::fresh_loop_fits``: a fresh copy of the model and a fresh
        optimizer, each step a new batch copied to the device, ``loss`` held until the next."""
        model = copy.deepcopy(self.model)
        opt = torch.optim.Adam(model.parameters())
        host = self._host_batch(length, n)
        try:
            with SimulatedGPU(self.capacity, allocator="caching") as gpu:
                gpu.adopt(model)
                for _ in range(CACHING_STEPS):
                    x, y = (t.clone() for t in host)  # .to(device)
                    opt.zero_grad()
                    loss = CE(model(x), y)
                    loss.backward()
                    opt.step()
        except torch.OutOfMemoryError:
            return False
        return True


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


def boundary_above(oracle: Oracle, length: int, n: int) -> int:
    """From ``n``, which trains: the largest size above it before the first that does not
    (galloping, then bisection), as the truth runs it (not counted as trials)."""
    low, gap = n, 1
    while oracle.fits(length, low + gap, count=False):
        low, gap = low + gap, 2 * gap
    high = low + gap
    while high - low > 1:
        middle = (low + high) // 2
        if oracle.fits(length, middle, count=False):
            low = middle
        else:
            high = middle
    return low


@dataclass
class Row:
    """One method: its largest size at each length, its trials, and whether each answer trains
    as the truth runs it (set once B* is known)."""

    method: str
    answers: dict[int, int]
    trials: dict[int, list[tuple[int, bool]]]
    trains: dict[int, bool] = field(default_factory=dict)

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


@dataclass
class Measured:
    """One setup's searches under one allocator model, and the truth at each length."""

    setup: Setup
    allocator: str
    capacity: int
    rows: list[Row]
    bstar: dict[int, int]
    notes: list[str]
    table: autobatch.LengthTable


def measure(setup: Setup, allocator: str, log: Callable[[str], None]) -> Measured:
    torch.manual_seed(0)
    model = setup.model()
    capacity = SimulatedGPU(setup.capacity, allocator=allocator).capacity_bytes
    samples = host_samples(setup.lengths)
    sample_for = samples.__getitem__
    rows: list[Row] = []
    with SimulatedGPU(capacity, allocator=allocator) as gpu:
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
    oracle = Oracle(model, capacity, allocator, samples)
    doubling = {n: doubling_then_bisection(oracle, n) for n in setup.lengths}
    trials: dict[int, list[tuple[int, bool]]] = {}
    for length, n, ok in oracle.calls:
        trials.setdefault(length, []).append((n, ok))
    rows.append(Row("doubling then bisection per length (OOMptimizer)", doubling, trials))
    log(f"{setup.name}: doubling and bisection done")
    bstar = dict(doubling)  # the truth's own search: B* trains, B*+1 does not
    notes = []
    for length in setup.lengths:
        for answer in sorted({row.answers[length] for row in rows}):
            if answer > bstar[length] and oracle.fits(length, answer, count=False):
                raised = boundary_above(oracle, length, answer)
                notes.append(
                    f"length {length}: B* raised from {bstar[length]} to {raised}, the "
                    f"bisection's boundary was not the largest size that trains ({answer}, an "
                    "answer, does)"
                )
                bstar[length] = raised
        for row in rows:
            row.trains[length] = oracle.fits(length, row.answers[length], count=False)
    log(f"{setup.name}: B* checked")
    return Measured(setup, allocator, capacity, rows, bstar, notes, table)


def report(measured: Measured) -> str:
    setup, rows, bstar = measured.setup, measured.rows, measured.bstar
    lengths = setup.lengths
    bound = 2 * len(lengths) + 3
    truth = ("two real steps fit at B*, not at B*+1" if measured.allocator == "exact" else
             f"the user's own loop trains {CACHING_STEPS} steps at B*, not at B*+1")
    lines = [
        f"### {setup.name}, capacity {setup.capacity}, lengths {', '.join(map(str, lengths))}",
        "",
        f"B* ({truth}): " + ", ".join(f"{n}: {bstar[n]}" for n in lengths),
        "",
        "| method | trials | OOM trials | samples processed | trials / ours | exact at every length |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    ours = rows[0].total()
    for row in rows:
        exact = all(row.answers[n] == bstar[n] for n in lengths)
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
        cells = [f"{answer(row, n, bstar[n])}, {len(row.trials[n])}" for row in rows]
        lines.append(f"| {n} | {bstar[n]} | " + " | ".join(cells) + " |")
    if any(row.answers[n] != bstar[n] for row in rows for n in lengths):
        lines += ["", "✗: not B*; ✗ OOM: a size the truth's steps cannot train."]
    lines += [
        *(f"- {note}" for note in measured.notes),
        "",
        "Sizes tried, longest length first (✗ = OOM):",
        "",
    ]
    for row in rows:
        parts = [
            f"{n}: " + ", ".join(f"{size}{'' if fits else '✗'}" for size, fits in row.trials[n])
            for n in sorted(lengths, reverse=True)
        ]
        lines.append(f"- {row.method}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def answer(row: Row, length: int, bstar: int) -> str:
    """A method's answer at a length, marked when it is not B* (and when it does not train)."""
    got = row.answers[length]
    if got == bstar:
        return str(got)
    return f"{got} ✗" + ("" if row.trains[length] else " OOM")


def on_device(loader: DataLoader[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, put together in host memory (which a simulated GPU does not
    count), then copied to the device, as ``.to(device)`` does."""
    batches = iter(loader)
    while True:
        with _disable_current_modes():
            batch = next(batches, None)
        if batch is None:
            return
        x, y = batch
        yield x.clone(), y.clone()


def training_run(measured: Measured, log: Callable[[str], None], samples: int) -> str:
    setup, table = measured.setup, measured.table
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
        with SimulatedGPU(measured.capacity, allocator=measured.allocator) as gpu:
            gpu.adopt(model)
            for x, y in on_device(loader):
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
                    with _disable_current_modes():  # bookkeeping, not part of the step
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


def header(allocator: str) -> list[str]:
    if allocator == "exact":
        setting = (
            "Produced by `python benchmarks/bench_lengths.py`. Everything runs on "
            "`SimulatedGPU(capacity, allocator=\"exact\")` with Adam; a trial is one size at "
            "one length (two real steps for doubling and bisection, one for ours). 'exact' "
            "compares each method's largest size with B*, the largest size whose two real "
            "training steps fit in a fresh simulator. "
        )
    else:
        setting = (
            "Produced by `python benchmarks/bench_lengths.py --allocator caching`. Everything "
            "runs on `SimulatedGPU(capacity, allocator=\"caching\")` (CUDA's caching "
            "allocator: segments, cached blocks, release and retry) with Adam; a trial is one "
            f"size at one length ({CACHING_STEPS} steps of the user's loop for doubling and "
            f"bisection, {CACHING_STEPS} or more for ours when it fits); samples processed "
            "add up the trials' sizes. 'exact' compares each method's largest size with B*, "
            "the largest size at which a user's own plain loop trains at that length: a fresh "
            "copy of the model and a fresh Adam in a fresh simulator, a new batch copied to "
            f"the device each step, the loss held until the next one, for {CACHING_STEPS} "
            "steps. "
        )
    return [
        "# Batch sizes per sequence length: ours, per-length searches, doubling and bisection",
        "",
        setting + "Samples are made in host memory and copied to the device. Ratios, not "
        f"seconds. torch {torch.__version__}, autobatch {autobatch.__version__}.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocator", choices=sorted(RESULTS), default="exact",
                        help="the simulated GPU's allocator model (default: exact)")
    parser.add_argument("--models", nargs="+", choices=sorted(SETUPS), default=sorted(SETUPS))
    parser.add_argument("--samples", type=int, default=1000, help="samples in the training run")
    parser.add_argument("--output", type=Path, default=None,
                        help="default: results/bench_lengths.md (exact), "
                        "results/bench_lengths_caching.md (caching)")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", file=sys.stderr, flush=True)

    random.seed(0)
    sections = header(args.allocator)
    ok = True
    for name in args.models:
        measured = measure(SETUPS[name], args.allocator, log)
        ours = measured.rows[0]
        ok &= ours.total() <= 2 * len(measured.setup.lengths) + 3 and ours.answers == measured.bstar
        sections += [report(measured), training_run(measured, log, args.samples)]
    sections.append(f"The run took {time.perf_counter() - started:.0f} s.\n")
    report_text = "\n".join(sections)
    print(report_text)
    output = args.output or RESULTS[args.allocator]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report_text, encoding="utf-8")
    log(f"wrote {output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
