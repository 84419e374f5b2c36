"""Long runs under CUDA's caching allocator (simulated): do the sizes found keep fitting? (not in CI)

A small transformer from ``autobatch.testing.models`` trains for 500 steps on batches whose
sequence length is drawn at random from a few lengths, inside
``SimulatedGPU(capacity, allocator="caching")``:

1. found: the batch size is what ``search_batch_size`` recommends for the longest length; no
   guard. With every batch padded to that length (the shape searched), the goal is no OOM in
   any step and the reserved memory bounded by the capacity. With each batch padded to its own
   length, the run is shown, with no goal: one shape was searched, and under a caching
   allocator other shapes cut its cached blocks (``search_batch_sizes`` is for that).
2. guarded: the batch size is 30% above the largest that fits at the longest length, lengths
   mixed; the step is decorated with ``retry_on_oom(optimizer=...)`` and the loop runs in
   ``oom_guard``. Goal: every sample trained exactly once (counted by the guard and by the
   step itself), the OOMs few, the reserved memory bounded.
3. per length: ``search_batch_sizes`` (default headroom) measures the lengths used, and
   ``MemoryAwareBatchSampler(lengths, table)`` packs a dataset whose samples have those lengths
   at random into batches as large as each batch's longest member allows, epoch after epoch;
   no guard. Goal: no OOM in any step, the reserved memory bounded by the capacity. Three
   times: on the 48 MiB device, on it with expandable segments, and on a 256 MiB one (a
   20 MiB segment is most of a 48 MiB device; on a real GPU it is a sliver).

The searches take their samples from host memory (made before the simulated GPU is entered),
as a user's sample is.

Reserved memory is read after every step; its per-step peak is plotted when matplotlib is
installed (``results/bench_longrun.png``, optional).

    python benchmarks/bench_longrun.py            # about 8 minutes on 2 CPU cores
    python benchmarks/bench_longrun.py --steps 100
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autobatch
from autobatch import oom_guard, retry_on_oom, search_batch_size, search_batch_sizes
from autobatch._sizing._trial import CACHING_STEPS
from autobatch.data import MemoryAwareBatchSampler
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import transformer

RESULTS = Path(__file__).resolve().parent / "results"
CAPACITY = 48 << 20
LARGER = 256 << 20  # where a 20 MiB segment is a twelfth of the device, not most of it
LENGTHS = (16, 32, 48, 64)
DATASET = 2000  # samples in the per-length run's dataset (it runs epoch after epoch)
VOCAB = 1000
MiB = 1 << 20


def _tokens(n: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (n, length), generator=generator)
    return x, torch.randint(0, 10, (n,), generator=generator)


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = transformer(vocab=VOCAB, d_model=32, layers=1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _sample(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's sample at ``length``: four rows, made in host memory (call it before entering
    the simulated GPU, which would count it)."""
    return _tokens(4, length, torch.Generator().manual_seed(1))


def _search(gpu: SimulatedGPU, sample: tuple[torch.Tensor, torch.Tensor]) -> Any:
    """The search at the longest length, in ``gpu`` (already entered)."""
    model, opt = _setup()
    gpu.adopt(model)
    result = search_batch_size(model, sample, opt, loss_fn=nn.functional.cross_entropy)
    return model, opt, result


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> bool:
    """One training step, unguarded; ``False`` when it ran out of memory (its memory freed)."""
    try:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    except torch.OutOfMemoryError:
        autobatch.free_memory()
        return False
    return True


def run_found(steps: int, *, mixed: bool) -> dict[str, Any]:
    """Part 1: the recommended size, no guard; every batch padded to the longest length (the
    shape searched), or (``mixed``) to its own."""
    lengths = random.Random(0).choices(LENGTHS, k=steps)
    if not mixed:
        lengths = [max(LENGTHS)] * steps
    generator = torch.Generator().manual_seed(2)
    sample = _sample(max(LENGTHS))
    with SimulatedGPU(CAPACITY, allocator="caching") as gpu:
        model, opt, result = _search(gpu, sample)
        size = result.batch_size
        reserved: list[int] = []
        shapes: Counter[tuple[int, int]] = Counter()  # (length, batch) of every step ...
        failed: Counter[tuple[int, int]] = Counter()  # ... and of those that ran out
        start = time.perf_counter()
        for length in lengths:
            x, y = _tokens(size, length, generator)
            gpu.reset_peak()
            shapes[length, size] += 1
            failed[length, size] += not _train(model, opt, x, y)
            reserved.append(gpu.peak_reserved_bytes)
        seconds = time.perf_counter() - start
    ooms = failed.total()
    return {
        "name": "found, lengths mixed" if mixed else "found, fixed shape", "batch": size,
        "max": result.max_batch_size, "trials": len(result.trials), "capacity": CAPACITY,
        "ooms": ooms, "reserved": reserved, "seconds": seconds, "samples": steps * size,
        "expected": steps * size, "trained": (steps - ooms) * size, "recomputed": 0,
        "retries": gpu.num_alloc_retries, "changes": 0, "shapes": shapes, "failed": failed,
    }


def run_guarded(steps: int) -> dict[str, Any]:
    """Part 2: 30% above the largest size that fits, under the guard."""
    lengths = random.Random(0).choices(LENGTHS, k=steps)
    generator = torch.Generator().manual_seed(2)
    sample = _sample(max(LENGTHS))
    with SimulatedGPU(CAPACITY, allocator="caching") as gpu:
        model, opt, result = _search(gpu, sample)
        size = int(result.max_batch_size * 1.3)
        trained = [0]

        @retry_on_oom(optimizer=opt)
        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
            opt.step()
            trained[0] += len(batch[0])  # (a piece that ran out never gets here)

        batches = (_tokens(size, length, generator) for length in lengths)
        reserved: list[int] = []
        start = time.perf_counter()
        with oom_guard(batches) as guard:
            for batch in guard:
                gpu.reset_peak()
                step(batch)
                reserved.append(gpu.peak_reserved_bytes)
        seconds = time.perf_counter() - start
        stats = guard.stats
    return {
        "name": "guarded", "batch": size, "max": result.max_batch_size, "capacity": CAPACITY,
        "trials": len(result.trials), "ooms": stats.ooms, "reserved": reserved,
        "seconds": seconds, "samples": stats.samples, "expected": steps * size,
        "trained": trained[0], "recomputed": stats.samples_recomputed,
        "retries": gpu.num_alloc_retries, "changes": stats.changes,
    }


def fresh_loop_fits(length: int, size: int, capacity: int, expandable: bool) -> bool:
    """Does a batch of this shape train alone, in a user's own loop: a fresh model and AdamW in
    a fresh simulator, a new batch copied to the device each step, the loss held until the
    next, for ``CACHING_STEPS`` steps (as ``tests/_models.py::fresh_loop_fits``)?"""
    model, opt = _setup()
    host = _tokens(size, length, torch.Generator().manual_seed(3))
    try:
        with SimulatedGPU(capacity, expandable_segments=expandable) as gpu:
            gpu.adopt(model)
            for _ in range(CACHING_STEPS):
                x, y = (t.clone() for t in host)  # .to(device)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
    except torch.OutOfMemoryError:
        return False
    return True


def _epochs(sampler: MemoryAwareBatchSampler) -> Iterator[list[int]]:
    """The sampler's batches, epoch after epoch (``set_epoch`` at the start of each)."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from sampler


def run_per_length(steps: int, capacity: int = CAPACITY, expandable: bool = False) -> dict[str, Any]:
    """Part 3: the sizes ``search_batch_sizes`` recommends per length, batches packed by the
    ``MemoryAwareBatchSampler``, no guard."""
    lengths = random.Random(0).choices(LENGTHS, k=DATASET)  # each sample's length
    generator = torch.Generator().manual_seed(2)
    samples = {length: _sample(length) for length in LENGTHS}
    with SimulatedGPU(capacity, expandable_segments=expandable) as gpu:
        model, opt = _setup()
        gpu.adopt(model)
        table = search_batch_sizes(
            model, samples.__getitem__, LENGTHS, opt, loss_fn=nn.functional.cross_entropy
        )
        sampler = MemoryAwareBatchSampler(lengths, table, seed=0)
        reserved: list[int] = []
        shapes: Counter[tuple[int, int]] = Counter()  # (padded length, batch) of every step ...
        failed: Counter[tuple[int, int]] = Counter()  # ... and of those that ran out
        samples_run = trained = 0
        start = time.perf_counter()
        for batch in itertools.islice(_epochs(sampler), steps):
            shape = max(lengths[i] for i in batch), len(batch)
            x, y = _tokens(shape[1], shape[0], generator)
            gpu.reset_peak()
            fits = _train(model, opt, x, y)
            reserved.append(gpu.peak_reserved_bytes)
            shapes[shape] += 1
            failed[shape] += not fits
            samples_run += len(batch)
            trained += len(batch) if fits else 0
        seconds = time.perf_counter() - start
    lowered = sum(any("among batches of the other lengths" in n for n in r.notes)
                  for r in table.results)
    return {
        "name": f"per length, {capacity // MiB} MiB" + (", expandable" if expandable else "")
        + (f" ({lowered} lowered together)" if lowered else ""),
        "capacity": capacity, "expandable": expandable,
        "batch": "/".join(str(table.batch_size(n)) for n in LENGTHS),
        "max": "/".join(str(table.max_batch_size(n)) for n in LENGTHS),
        "trials": len(table.trials), "ooms": failed.total(), "reserved": reserved,
        "seconds": seconds, "samples": samples_run, "expected": samples_run, "trained": trained,
        "recomputed": 0, "retries": gpu.num_alloc_retries, "changes": 0, "shapes": shapes,
        "failed": failed,
    }


def _table(runs: list[dict[str, Any]], steps: int) -> str:
    lines = [
        "# Long runs under the simulated caching allocator",
        "",
        f"Produced by `python benchmarks/bench_longrun.py`: {steps} steps of a transformer "
        f"(d_model 32, 1 layer, AdamW) on `SimulatedGPU({CAPACITY // MiB} MiB)` (the caching "
        f"allocator) unless the run says otherwise, sequence lengths drawn at random from "
        f"{LENGTHS}. *found, fixed shape*: the size `search_batch_size` recommends at the "
        "longest length, every batch padded to it, no guard; *found, lengths mixed*: that size, "
        "each batch padded to its own length (no goal: one shape was searched); *guarded*: 30% "
        "above the largest size that fits at the longest length, lengths mixed, under "
        "`oom_guard` and `retry_on_oom(optimizer=...)`; *per length*: the sizes "
        f"`search_batch_sizes` recommends at each of {'/'.join(map(str, LENGTHS))} (default "
        "headroom, proven together where the allocator has no expandable segments; batch and "
        "largest that fits are given per length, in that order), batches of a dataset of "
        f"{DATASET} samples with those lengths at random packed by "
        "`MemoryAwareBatchSampler(lengths, table)`, epoch after epoch, each padded to its "
        "longest sample, no guard. Reserved memory is each step's peak. "
        f"torch {torch.__version__}, autobatch {autobatch.__version__}.",
        "",
        "| run | batch | largest that fits (trials) | OOMs | size changes | samples | "
        "trained once | recomputed | allocator retries | reserved peak max | reserved, last "
        "100 steps (min-max) | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        tail = r["reserved"][-100:]
        lines.append(
            f"| {r['name']} | {r['batch']} | {r['max']} ({r['trials']}) | {r['ooms']} | "
            f"{r['changes']} | {r['samples']} | {r['trained']} | {r['recomputed']} | "
            f"{r['retries']} | {max(r['reserved']) / MiB:.1f} MiB | "
            f"{min(tail) / MiB:.1f}-{max(tail) / MiB:.1f} MiB | {r['seconds']:.1f} |"
        )
    lines.append("")
    for r in runs:  # the unguarded runs' steps that ran out of memory, by shape
        failed = sorted(shape for shape, count in r.get("failed", {}).items() if count)
        if failed:
            lines += [f"*{r['name']}* ran out of memory at (padded length × batch):", ""]
            lines += [
                f"- {length} × {size}: {r['failed'][length, size]} of "
                f"{r['shapes'][length, size]} steps; alone, in a user's own fresh "
                f"{CACHING_STEPS}-step loop, it "
                + ("trains" if fresh_loop_fits(length, size, r["capacity"], r.get("expandable", False))
                   else "runs out of memory too")
                for length, size in failed
            ]
            lines.append("")
    return "\n".join(lines)


def _plot(runs: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(8, 3.5))
    for r in runs:
        axes.plot([b / r["capacity"] for b in r["reserved"]],
                  label=f"{r['name']} (batch {r['batch']})", linewidth=0.8)
    axes.axhline(1.0, color="black", linestyle="--", linewidth=0.8, label="capacity")
    axes.set_xlabel("step")
    axes.set_ylabel("reserved peak / capacity")
    axes.set_ylim(0, 1.1)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("autobatch").setLevel(logging.ERROR)
    started = time.perf_counter()
    mixed = run_found(args.steps, mixed=True)
    unguarded = [
        run_found(args.steps, mixed=False),
        run_per_length(args.steps),
        run_per_length(args.steps, expandable=True),
        run_per_length(args.steps, capacity=LARGER),
    ]
    runs = [unguarded[0], mixed, run_guarded(args.steps), *unguarded[1:]]
    failed = []
    for r in runs:
        if max(r["reserved"]) > r["capacity"]:
            failed.append(f"{r['name']}: reserved above the capacity")
        if r is not mixed and (r["trained"] != r["samples"] or r["samples"] != r["expected"]):
            failed.append(f"{r['name']}: {r['trained']} samples trained of {r['samples']}")
    for r in unguarded:
        if r["ooms"]:
            failed.append(f"{r['name']}: the recommended sizes ran out of memory")
    table = _table(runs, args.steps)
    table += "\n" + ("".join(f"- FAILED {line}\n" for line in failed) or "Every goal met.\n")
    table += f"\nThe run took {time.perf_counter() - started:.0f} s.\n"
    print(table)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "bench_longrun.md").write_text(table)
        if _plot(runs, RESULTS / "bench_longrun.png"):
            print(f"plot: {RESULTS / 'bench_longrun.png'}")
        else:
            print("matplotlib is not installed: no plot")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
