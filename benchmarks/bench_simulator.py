"""SimulatedGPU: overhead on real training steps, and agreement with torch.profiler.

Run: python benchmarks/bench_simulator.py   (prints two markdown tables)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

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


def overhead_table(repeats: int = 5, rounds: int = 12) -> list[str]:
    rows = ["| step | plain (min) | simulated (min) | overhead |", "|---|---|---|---|"]
    for name, (make, sample, n) in CASES.items():
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.Adam(model.parameters())
        x, y = sample(n)
        _step(model, opt, x, y)  # Adam state exists

        def run(model: nn.Module = model, opt: torch.optim.Optimizer = opt,
                x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            _step(model, opt, x, y)

        plain = simulated = float("inf")
        for _ in range(rounds):  # alternate, so that drifting load hits both alike
            plain = min(plain, _min_time(run, repeats))
            with SimulatedGPU("64GiB") as gpu:
                gpu.adopt(model, opt, x, y)
                simulated = min(simulated, _min_time(run, repeats))
        rows.append(
            f"| {name} | {plain * 1e3:.1f} ms | {simulated * 1e3:.1f} ms | "
            f"{(simulated / plain - 1) * 100:+.1f}% |"
        )
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


def main() -> None:
    torch.set_num_threads(1)
    print("## SimulatedGPU overhead on a real step (thread CPU time, 1 thread, min of N, rounds alternated)\n")
    print("\n".join(overhead_table()))
    print("\n## SimulatedGPU peak vs torch.profiler memory accounting (raw bytes)\n")
    print("\n".join(agreement_table()))
    print(f"\n(torch {torch.__version__}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
