"""SimulatedGPU: overhead of its two allocator models on real training steps, agreement with
torch.profiler, and what the caching model reserves.

Run: python benchmarks/bench_simulator.py   (prints three markdown tables; exits with status 1
when the caching model's overhead per operator exceeds twice the exact model's in some case)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS, TinyTransformer, conv_net, mlp

CE = nn.functional.cross_entropy


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    CE(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # at the end: the profiler cannot see blocks freed that it
    # did not see allocated, so the step must not free gradients made before profiling


def _min_time(fn: Callable[[], None], repeats: int) -> float:
    """Least thread CPU time of ``repeats`` calls (one torch thread: steadier than wall time on
    a shared machine, and the simulator's cost is CPU time too)."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return min(times)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], int]] = {
    "mlp 1024x4, batch 512": (lambda: mlp(width=1024, depth=4), WORKLOADS["mlp"].sample, 512),
    "conv net (32 ch), batch 128": (lambda: conv_net(channels=32), WORKLOADS["conv"].sample, 128),
    "conv net (64 ch), batch 256": (lambda: conv_net(channels=64), WORKLOADS["conv"].sample, 256),
    "transformer d256 L4, batch 32x32": (
        lambda: TinyTransformer(d_model=256, layers=4), WORKLOADS["transformer"].sample, 32,
    ),
}


class _Count(TorchDispatchMode):
    """Counts the operators a step dispatches (what the simulator's mode sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.operators = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.operators += 1
        return func(*args, **(kwargs or {}))


#: The simulators compared: the exact model, and the caching model without and with
#: expandable segments.
MODELS: dict[str, dict[str, Any]] = {
    "exact": {"allocator": "exact"},
    "caching": {"allocator": "caching", "expandable_segments": False},
    "caching, expandable": {"allocator": "caching", "expandable_segments": True},
}

#: The caching model's overhead per operator may be at most this multiple of the exact one's.
GOAL = 2.0


#: Steps of small tensors, where the simulator's own work is most of the time: the cost per
#: operator is measured there (on large steps it is a small difference of two noisy times).
SMALL_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], int]] = {
    "mlp 64x4, batch 8": (lambda: mlp(width=64, depth=4), WORKLOADS["mlp"].sample, 8),
    "conv net (8 ch), batch 4": (lambda: conv_net(channels=8), WORKLOADS["conv"].sample, 4),
    "transformer d64 L2, batch 4x32": (
        lambda: TinyTransformer(d_model=64, layers=2), WORKLOADS["transformer"].sample, 4,
    ),
}


def _timings(
    cases: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], int]],
    repeats: int,
    rounds: int,
) -> Iterator[tuple[str, int, dict[str, float]]]:
    """For each case: its name, the operators one step dispatches, and the least thread CPU
    time of a step bare ("plain") and under each simulator of :data:`MODELS`."""
    for name, (make, sample, n) in cases.items():
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.Adam(model.parameters())
        x, y = sample(n)
        _step(model, opt, x, y)  # Adam state exists

        def run(model: nn.Module = model, opt: torch.optim.Optimizer = opt,
                x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            _step(model, opt, x, y)

        with _Count() as count:
            run()
        best = {"plain": float("inf"), **{label: float("inf") for label in MODELS}}
        for round_ in range(rounds):  # alternate, and rotate the order, so that drifting load
            labels = list(best)  # hits every variant alike
            labels = labels[round_ % len(labels):] + labels[: round_ % len(labels)]
            for label in labels:
                if label == "plain":
                    best[label] = min(best[label], _min_time(run, repeats))
                    continue
                with SimulatedGPU("64GiB", **MODELS[label]) as gpu:
                    gpu.adopt(model, opt, x, y)
                    run()  # segments made: the steady state
                    best[label] = min(best[label], _min_time(run, repeats))
        yield name, count.operators, best


def cost_table(repeats: int = 5, rounds: int = 30) -> tuple[list[str], bool]:
    """The simulators' cost per operator, and whether the caching model's is within the goal."""
    rows = [
        "| step | operators | plain (min) | exact: per operator | caching: per operator "
        "| caching, expandable: per operator | caching / exact | expandable / exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    met = True
    for name, operators, best in _timings(SMALL_CASES, repeats, rounds):
        cost = {label: (best[label] - best["plain"]) / operators for label in MODELS}
        ratios = [cost[label] / cost["exact"] for label in ("caching", "caching, expandable")]
        met = met and max(ratios) <= GOAL
        rows.append(
            f"| {name} | {operators} | {best['plain'] * 1e3:.2f} ms | "
            + " | ".join(f"{cost[label] * 1e6:.1f} µs" for label in MODELS)
            + " | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |"
        )
    return rows, met


def overhead_table(repeats: int = 3, rounds: int = 8) -> list[str]:
    rows = [
        "| step | operators | plain (min) | exact | caching | caching, expandable |",
        "|---|---|---|---|---|---|",
    ]
    for name, operators, best in _timings(CASES, repeats, rounds):
        plain = best["plain"]
        cells = [
            f"{best[label] * 1e3:.1f} ms ({(best[label] / plain - 1) * 100:+.1f}%)"
            for label in MODELS
        ]
        rows.append(f"| {name} | {operators} | {plain * 1e3:.1f} ms | {' | '.join(cells)} |")
    return rows


def _walk(nodes: Any) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def agreement_table(n: int = 32) -> list[str]:
    rows = [
        "| model | simulator peak | profiler peak | difference |",
        "|---|---|---|---|",
    ]
    for name, work in WORKLOADS.items():
        torch.manual_seed(0)
        model = work.model()
        opt = torch.optim.Adam(model.parameters())
        x, y = work.sample(n)
        _step(model, opt, x, y)
        with SimulatedGPU("64GiB", block_bytes=1) as gpu:
            gpu.adopt(model, opt, x, y)
            baseline = gpu.allocated_bytes
            gpu.reset_peak()
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                _step(model, opt, x, y)
        events = sorted(
            (e for e in _walk(prof.profiler.kineto_results.experimental_event_tree())
             if e.tag == _EventType.Allocation),
            key=lambda e: e.start_time_ns,
        )
        total = peak = 0
        for event in events:
            total += event.extra_fields.alloc_size
            peak = max(peak, total)
        expected = baseline + peak
        rows.append(
            f"| {name} (batch {n}, Adam) | {gpu.peak_bytes:,} B | {expected:,} B | "
            f"{(gpu.peak_bytes - expected) / expected * 100:+.4f}% |"
        )
    return rows


def reserved_table(n: int = 64) -> list[str]:
    """One steady-state Adam step of each workload under each model: what it allocates at its
    peak, what the caching model reserves, and the segments left afterwards."""
    rows = [
        "| model | exact: peak allocated | caching: peak allocated | peak reserved | segments "
        "after | expandable: peak allocated | peak reserved |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, work in WORKLOADS.items():
        torch.manual_seed(0)
        model = work.model()
        opt = torch.optim.Adam(model.parameters())
        x, y = work.sample(n)
        _step(model, opt, x, y)
        seen: dict[str, tuple[int, int, int]] = {}
        for label, options in MODELS.items():
            with SimulatedGPU("64GiB", **options) as gpu:
                gpu.adopt(model, opt, x, y)
                _step(model, opt, x, y)
                gpu.reset_peak()
                _step(model, opt, x, y)
                seen[label] = (gpu.peak_bytes, gpu.peak_reserved_bytes, len(gpu.segments))
        exact, caching, expandable = (seen[label] for label in MODELS)
        mib = 2**20
        rows.append(
            f"| {name} (batch {n}, Adam) | {exact[0] / mib:.2f} MiB | {caching[0] / mib:.2f} MiB | "
            f"{caching[1] / mib:.2f} MiB | {caching[2]} | {expandable[0] / mib:.2f} MiB | "
            f"{expandable[1] / mib:.2f} MiB |"
        )
    return rows


def main() -> None:
    torch.set_num_threads(1)
    print("## SimulatedGPU cost per operator (small tensors; thread CPU time, 1 thread, min of "
          "N, rounds alternated)\n")
    rows, met = cost_table()
    print("\n".join(rows))
    print(f"\nGoal: the caching model's cost per operator at most {GOAL:g}x the exact "
          f"model's: {'met' if met else 'MISSED'}.")
    print("\n## SimulatedGPU overhead on a real step (same method)\n")
    print("\n".join(overhead_table()))
    print("\n## SimulatedGPU peak vs torch.profiler memory accounting (raw bytes)\n")
    print("\n".join(agreement_table()))
    print("\n## What the caching model reserves for a steady-state step\n")
    print("\n".join(reserved_table()))
    print(f"\n(torch {torch.__version__}, {torch.get_num_threads()} threads)")
    if not met:
        sys.exit(1)


if __name__ == "__main__":
    main()
