"""Long runs under CUDA's caching allocator (simulated): does the size found keep fitting? (not in CI)

A small transformer from ``autobatch.testing.models`` trains for 500 steps on batches whose
sequence length is drawn at random from a few lengths, inside
``SimulatedGPU(capacity, allocator="caching")``:

1. found: the batch size is what ``search_batch_size`` recommends for the longest length; no
   guard. Goal: no OOM in any step, and the reserved memory bounded by the capacity (it settles
   once each length has been seen).
2. guarded: the batch size is 30% above the largest that fits at the longest length; the step is
   decorated with ``retry_on_oom(optimizer=...)`` and the loop runs in ``oom_guard``. Goal: every
   sample trained exactly once (counted by the guard and by the step itself), the OOMs few,
   the reserved memory bounded.

Reserved memory is read after every step; its per-step peak is plotted when matplotlib is
installed (``results/bench_longrun.png``, optional).

    python benchmarks/bench_longrun.py            # about two minutes on 2 CPU cores
    python benchmarks/bench_longrun.py --steps 100
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autobatch
from autobatch import oom_guard, retry_on_oom, search_batch_size
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import transformer

RESULTS = Path(__file__).resolve().parent / "results"
CAPACITY = 48 << 20
LENGTHS = (16, 32, 48, 64)
VOCAB = 1000
MiB = 1 << 20


def _tokens(n: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (n, length), generator=generator)
    return x, torch.randint(0, 10, (n,), generator=generator)


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = transformer(vocab=VOCAB, d_model=32, layers=1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _search(gpu: SimulatedGPU) -> Any:
    """The search at the longest length, in ``gpu`` (already entered)."""
    model, opt = _setup()
    gpu.adopt(model)
    generator = torch.Generator().manual_seed(1)
    sample = _tokens(4, max(LENGTHS), generator)
    result = search_batch_size(model, sample, opt, loss_fn=nn.functional.cross_entropy)
    return model, opt, result


def run_found(steps: int) -> dict[str, Any]:
    """Part 1: the recommended size, no guard."""
    lengths = random.Random(0).choices(LENGTHS, k=steps)
    generator = torch.Generator().manual_seed(2)
    with SimulatedGPU(CAPACITY, allocator="caching") as gpu:
        model, opt, result = _search(gpu)
        size = result.batch_size
        reserved: list[int] = []
        ooms = 0
        start = time.perf_counter()
        for length in lengths:
            x, y = _tokens(size, length, generator)
            gpu.reset_peak()
            try:
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            except torch.OutOfMemoryError:
                ooms += 1
                autobatch.free_memory()
            reserved.append(gpu.peak_reserved_bytes)
        seconds = time.perf_counter() - start
    return {
        "name": "found", "batch": size, "max": result.max_batch_size, "trials": len(result.trials),
        "ooms": ooms, "reserved": reserved, "seconds": seconds, "samples": steps * size,
        "trained": (steps - ooms) * size, "recomputed": 0, "retries": gpu.num_alloc_retries,
        "changes": 0,
    }


def run_guarded(steps: int) -> dict[str, Any]:
    """Part 2: 30% above the largest size that fits, under the guard."""
    lengths = random.Random(0).choices(LENGTHS, k=steps)
    generator = torch.Generator().manual_seed(2)
    with SimulatedGPU(CAPACITY, allocator="caching") as gpu:
        model, opt, result = _search(gpu)
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
        "name": "guarded", "batch": size, "max": result.max_batch_size,
        "trials": len(result.trials), "ooms": stats.ooms, "reserved": reserved,
        "seconds": seconds, "samples": stats.samples,
        "trained": trained[0], "recomputed": stats.samples_recomputed,
        "retries": gpu.num_alloc_retries, "changes": stats.changes,
    }


def _table(runs: list[dict[str, Any]], steps: int) -> str:
    lines = [
        "# Long runs under the simulated caching allocator",
        "",
        f"Produced by `python benchmarks/bench_longrun.py`: {steps} steps of a transformer "
        f"(d_model 32, 1 layer, AdamW) on `SimulatedGPU({CAPACITY // MiB} MiB, "
        f"allocator=\"caching\")`, sequence lengths drawn at random from {LENGTHS}. "
        "*found*: the size `search_batch_size` recommends at the longest length, no guard; "
        "*guarded*: 30% above the largest size that fits there, under `oom_guard` and "
        "`retry_on_oom(optimizer=...)`. Reserved memory is each step's peak. "
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
        axes.plot([b / MiB for b in r["reserved"]], label=f"{r['name']} (batch {r['batch']})",
                  linewidth=0.8)
    axes.axhline(CAPACITY / MiB, color="black", linestyle="--", linewidth=0.8, label="capacity")
    axes.set_xlabel("step")
    axes.set_ylabel("reserved peak (MiB)")
    axes.set_ylim(0, CAPACITY / MiB * 1.1)
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
    runs = [run_found(args.steps), run_guarded(args.steps)]
    table = _table(runs, args.steps)
    print(table)
    failed = []
    for r in runs:
        if max(r["reserved"]) > CAPACITY:
            failed.append(f"{r['name']}: reserved above the capacity")
        if r["trained"] != r["samples"] or r["samples"] != args.steps * r["batch"]:
            failed.append(f"{r['name']}: {r['trained']} samples trained of {r['samples']}")
    if runs[0]["ooms"]:
        failed.append("found: the recommended size ran out of memory")
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "bench_longrun.md").write_text(table)
        if _plot(runs, RESULTS / "bench_longrun.png"):
            print(f"plot: {RESULTS / 'bench_longrun.png'}")
        else:
            print("matplotlib is not installed: no plot")
    for line in failed:
        print("FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
