"""Benchmark retry_on_oom and oom_guard: overhead, retries per OOM, and peers' strategies.

    python benchmarks/bench_guard.py            # about two minutes on a laptop CPU
    python benchmarks/bench_guard.py --quick

1. Overhead on steps that never run out of memory: a small CPU MLP step and a conv net with
   BatchNorm, plain loop versus the decorated step inside the guard, step by step in turn.
2. Retries per OOM with the memory model: training on a simulated GPU whose capacity is varied
   between what a sixteenth and what the whole batch needs; for every batch that ran out of memory,
   how many failed attempts it took ("retries per OOM").
3. Side by side with the strategies of peers, re-implemented here as small simulations on the same
   simulated GPU and model (no peer code is installed, imported or copied):
   - halving (Composer-style automatic micro-batching): on OOM, double the number of micro-batches
     and run the whole batch again; keep the count for later batches.
   - restart (Accelerate find_executable_batch_size / toma style): on OOM, restart the training
     function with half the batch size, from the first batch.
4. The smallest simulated GPU on which one guarded step trains the batch in micro-batches, next
   to the model state and one gradient it cannot do without.
5. What a split step costs: the guarded step split into micro-batches against the same
   micro-batches accumulated by a hand-written loop, with the write ledger watching (as always)
   and with it switched off (for this measurement only), and where the ledger's time goes: the
   operators it watched per call and its cost per operator.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autobatch import AutobatchError, BatchSizeError, free_memory, is_oom_error
from autobatch._recovery import oom_guard, retry_on_oom
from autobatch._units import format_bytes
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------------------------
# 1. Overhead


def _per_step(fn: Callable[[], None], steps: int) -> float:
    start = time.thread_time()  # CPU time of this thread: not the time it waited for the CPU
    fn()
    return (time.thread_time() - start) / steps


def _interleaved(
    plain: Callable[[Batch], Any], guarded: Callable[[Batch], Any], batches: list[Batch],
    rounds: int, steps: int, *, guard: bool = True,
) -> tuple[float, float, tuple[float, float]]:
    """``guarded``'s overhead over ``plain``, step by step: in each round a plain loop and a
    guarded loop (``guarded`` called on what ``oom_guard`` hands out, or, without ``guard``,
    on the batches themselves) advance together, one step
    of each in turn, in the order plain-guarded, guarded-plain, ... (so that neither always runs
    second on warm caches); each step's thread CPU time includes taking its batch from its
    loader. Returns the median over rounds of (relative, seconds per step), and the
    interquartile range of the relative one."""
    clock = time.thread_time_ns
    relative, absolute = [], []
    for _ in range(rounds + 1):  # (the first round warms up)
        loader = (batches[i % len(batches)] for i in range(steps))
        plain_total = guarded_total = 0
        with contextlib.ExitStack() as stack:
            handed = iter(stack.enter_context(oom_guard(
                batches[i % len(batches)] for i in range(steps)
            ))) if guard else (batches[i % len(batches)] for i in range(steps))
            for i in range(steps):
                for first in ((True, False) if i % 2 == 0 else (False, True)):
                    start = clock()
                    if first:
                        plain(next(loader))
                        plain_total += clock() - start
                    else:
                        guarded(next(handed))
                        guarded_total += clock() - start
        relative.append(guarded_total / plain_total - 1)
        absolute.append((guarded_total - plain_total) / steps * 1e-9)
    q = statistics.quantiles(relative[1:], n=4)
    return statistics.median(relative[1:]), statistics.median(absolute[1:]), (q[0], q[2])


def _overhead_rows(name: str, size: int, rounds: int, steps: int) -> list[str]:
    work = WORKLOADS[name]
    torch.manual_seed(0)
    model = work.model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [work.sample(size) for _ in range(8)]

    def step(batch: Batch) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss

    def noop(batch: Batch) -> None:
        return None

    guarded = retry_on_oom(optimizer=opt)(step)
    guarded_noop = retry_on_oom(optimizer=opt, model=model)(noop)  # same parameters and buffers

    def backward_only(batch: Batch) -> None:  # accumulates over calls; the caller steps
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()

    guarded_backward = retry_on_oom(optimizer=opt)(backward_only)

    step(batches[0])  # Adam's state exists
    guarded(batches[0])  # the first call watches which modules run
    opt.zero_grad()
    guarded_noop(batches[0])  # (a step that leaves no gradients behind)
    plain_time = min(
        _per_step(lambda: [step(batches[i % 8]) for i in range(steps)], steps)
        for _ in range(max(rounds // 4, 3))
    )
    opt.zero_grad()  # (gradients left behind would be carried by the no-op step: not bare)
    _, fixed, _ = _interleaved(noop, guarded_noop, batches, rounds, steps)
    relative, absolute, spread = _interleaved(step, guarded, batches, rounds, steps)
    alone, alone_absolute, alone_spread = _interleaved(
        step, guarded, batches, rounds, steps, guard=False)
    opt.zero_grad()
    guarded_backward(batches[0])  # gradients carried from now on
    backward_relative, backward_absolute, backward_spread = _interleaved(
        backward_only, guarded_backward, batches, rounds, steps
    )
    params = sum(1 for _ in model.parameters())
    opt.zero_grad()
    return [
        f"| {name}, batch {size} | plain step (min) | {plain_time * 1e6:.1f} | |",
        f"| {name}, batch {size} | the same step, @retry_on_oom(optimizer=opt) alone"
        f" | {alone_absolute * 1e6:+.1f} | {alone:+.2%} ({alone_spread[0]:+.2%} to "
        f"{alone_spread[1]:+.2%}) |",
        f"| {name}, batch {size} | the same step, @retry_on_oom(optimizer=opt) inside oom_guard"
        f" | {absolute * 1e6:+.1f} | {relative:+.2%} ({spread[0]:+.2%} to {spread[1]:+.2%}) |",
        f"| {name}, batch {size} | guard + decorator around a no-op step (the bare machinery) | "
        f"{fixed * 1e6:+.2f} | {fixed / plain_time:+.2%} |",
        f"| {name}, batch {size} | forward and backward without optimizer step (gradients "
        f"carried to the next call: {params} of them kept apart) | {backward_absolute * 1e6:+.1f}"
        f" | {backward_relative:+.2%} ({backward_spread[0]:+.2%} to {backward_spread[1]:+.2%}) |",
    ]


def bench_overhead(rounds: int, steps: int) -> None:
    torch.set_num_threads(1)
    rows = [
        *_overhead_rows("mlp", 64, rounds, steps),
        *_overhead_rows("mlp", 128, rounds, steps),  # about 2 ms a step
        *_overhead_rows("conv", 16, rounds, steps),
    ]
    print("\n## 1. Overhead on steps that never OOM (CPU, Adam)")
    print(
        "MLP 128-256-256-256-10; conv net with two BatchNorm layers (their running statistics "
        f"are copied before every step, so that a failed attempt can be undone). Thread CPU "
        f"time, 1 thread; {rounds} rounds of {steps} steps, in each a plain loop and the "
        "guarded loop taking steps in turn (plain-guarded, guarded-plain, ...), each step timed "
        "with its batch's hand-out; median over rounds\n"
    )
    print("| workload | measurement | µs per step | relative to the plain step: median "
          "(interquartile range) |")
    print("|---|---|---|---|")
    for row in rows:
        print(row)


# --------------------------------------------------------------------------------------------
# Shared: a training run on a simulated GPU


class Trainer:
    """A model, an AdamW optimizer and a plain step function, copied from one template."""

    def __init__(self, template: nn.Module) -> None:
        self.model = copy.deepcopy(template)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.steps = 0
        self.started = 0
        self.opt.register_step_post_hook(lambda *_: setattr(self, "steps", self.steps + 1))

    def step(self, batch: Batch) -> torch.Tensor:
        self.opt.zero_grad()
        loss = nn.functional.cross_entropy(self.model(batch[0]), batch[1])
        loss.backward()
        self.opt.step()
        return loss.detach()

    def accumulate(self, batch: Batch, pieces: int) -> None:
        """Composer-style: one step from ``pieces`` micro-batches (``started`` counts rows)."""
        self.opt.zero_grad()
        total = len(batch[0])
        size = -(-total // pieces)
        self.started = 0
        for start in range(0, total, size):
            x, y = batch[0][start : start + size], batch[1][start : start + size]
            self.started += len(x)
            loss = nn.functional.cross_entropy(self.model(x), y) * (len(x) / total)
            loss.backward()
        self.opt.step()


def peak_of(template: nn.Module, batch: Batch, allocator: str = "caching") -> int:
    """The peak of a steady training step on ``batch``: under the caching allocator the
    reserved one (what it holds from the device at the step's height, segments included),
    under the exact one the bytes of the live tensors."""
    trainer = Trainer(template)
    with SimulatedGPU("8GiB", allocator=allocator, adopt=[trainer.model, trainer.opt]) as gpu:  # type: ignore[arg-type]
        trainer.step(batch)
        gpu.reset_peak()
        trainer.step(batch)
    return gpu.peak_reserved_bytes if allocator == "caching" else gpu.peak_bytes


def make_loader(name: str, batches: int, size: int) -> list[Batch]:
    torch.manual_seed(1)
    return [WORKLOADS[name].sample(size) for _ in range(batches)]


# --------------------------------------------------------------------------------------------
# 2. Retries per OOM over varied capacities


def bench_retries(workloads: list[tuple[str, int]], capacities: int, batches: int) -> None:
    print("\n## 2. Retries per OOM with the memory model (SimulatedGPU, accumulate policy, AdamW)")
    print(
        f"capacity varied over {capacities} values between the reserved peaks (the caching "
        "allocator's segments) of a sixteenth of the batch and the whole batch; "
        f"{batches} batches each; retries = failed attempts of a batch\n"
    )
    print(
        "| workload | batch | OOM incidents | retries: 1 | 2 | 3+ | median | mean | samples recomputed "
        "| capacities where not even one row fit (BatchSizeError) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    everything: list[int] = []
    for name, size in workloads:
        torch.manual_seed(0)
        template = WORKLOADS[name].model()
        loader = make_loader(name, batches, size)
        low = peak_of(template, (loader[0][0][: size // 16], loader[0][1][: size // 16]))
        high = peak_of(template, loader[0])
        incidents: list[int] = []
        recomputed = 0
        refused: list[str] = []
        for i in range(capacities):
            capacity = low + (high - low) * (i + 0.5) / capacities
            trainer = Trainer(template)
            step = retry_on_oom(optimizer=trainer.opt, model=trainer.model)(trainer.step)
            with SimulatedGPU(int(capacity), adopt=[trainer.model, trainer.opt]):
                for batch in loader:
                    before = step.stats.ooms
                    try:
                        step(batch)
                    except BatchSizeError:  # not even one row fits: said, not hidden
                        refused.append(format_bytes(int(capacity)))
                        break
                    if step.stats.ooms > before:
                        incidents.append(step.stats.ooms - before)
            recomputed += step.stats.samples_recomputed
        everything += incidents
        counts = Counter(min(r, 3) for r in incidents)
        print(
            f"| {name} | {size} | {len(incidents)} | {counts[1]} | {counts[2]} | {counts[3]} | "
            f"{statistics.median(incidents) if incidents else '-'} | "
            f"{statistics.mean(incidents) if incidents else 0:.2f} | {recomputed} | "
            f"{len(refused)}{' (' + ', '.join(refused) + ')' if refused else ''} |"
        )
    print(f"\nall workloads: median retries per OOM = {statistics.median(everything)}")


def bench_three_times(workloads: list[tuple[str, int]], batches: int) -> None:
    print(f"\n## 2b. {batches} batches three times too big (SimulatedGPU, oom_guard + "
          "retry_on_oom, AdamW)")
    print(
        "The device holds the reserved peak (the caching allocator's segments) of a steady step "
        "on a third of the batch, so no batch runs whole once the optimizer's state exists; a "
        "recovered batch is one that ran out "
        "of memory at least once before it trained in pieces\n"
    )
    print("| workload | batch | batches | recovered | OOMs | mean OOMs per recovered batch "
          "| micro-batch learned | samples trained | optimizer steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, size in workloads:
        torch.manual_seed(0)
        template = WORKLOADS[name].model()
        loader = make_loader(name, 8, size)
        third = size // 3
        capacity = peak_of(template, (loader[0][0][:third], loader[0][1][:third]))
        trainer = Trainer(template)
        step = retry_on_oom(optimizer=trainer.opt, model=trainer.model)(trainer.step)
        per_batch = []
        with (
            SimulatedGPU(int(capacity), adopt=[trainer.model, trainer.opt]),
            oom_guard(loader[i % len(loader)] for i in range(batches)) as guard,
        ):
            for batch in guard:
                before = step.stats.ooms
                step(batch)
                per_batch.append(step.stats.ooms - before)
        recovered = [k for k in per_batch if k]
        print(
            f"| {name} | {size} | {batches} | {len(recovered)} | {sum(recovered)} | "
            f"{sum(recovered) / max(len(recovered), 1):.2f} | {step.stats.micro_batch_size} | "
            f"{guard.stats.samples} of {batches * size} | {trainer.steps} |"
        )


# --------------------------------------------------------------------------------------------
# 3. Peers' strategies, simulated


def _set_capacity(gpu: SimulatedGPU, capacity: int) -> None:
    """Another process takes (or gives back) memory: under the caching allocator what it
    takes is what the cache had given back (``empty_cache``), so a change empties the cache;
    segments in use stay."""
    if capacity != gpu.capacity_bytes:
        gpu.capacity_bytes = capacity
        gpu.empty_cache()


def run_ours(
    template: nn.Module, loader: list[Batch], capacity: Callable[[int], int]
) -> dict[str, Any]:
    trainer = Trainer(template)
    step = retry_on_oom(optimizer=trainer.opt, grow_after=2)(trainer.step)
    incidents = []
    with (
        SimulatedGPU(capacity(0), adopt=[trainer.model, trainer.opt]) as gpu,
        oom_guard(loader) as guard,
    ):
        for i, batch in enumerate(guard):
            _set_capacity(gpu, capacity(i))
            before = step.stats.ooms
            step(batch)
            if step.stats.ooms > before:
                incidents.append(step.stats.ooms - before)
    return {
        "ooms": guard.stats.ooms,
        "incidents": incidents,
        "recomputed": guard.stats.samples_recomputed,
        "steps": trainer.steps,
        "batch": len(loader[0][0]),
        "micro": guard.stats.micro_batch_size or len(loader[0][0]),
    }


def run_halving(
    template: nn.Module, loader: list[Batch], capacity: Callable[[int], int]
) -> dict[str, Any]:
    trainer = Trainer(template)
    pieces = 1
    ooms, recomputed, incidents = 0, 0, []
    with SimulatedGPU(capacity(0), adopt=[trainer.model, trainer.opt]) as gpu:
        for i, batch in enumerate(loader):
            _set_capacity(gpu, capacity(i))
            failures = 0
            while True:
                try:
                    trainer.accumulate(batch, pieces)
                except Exception as error:  # the strategy under test: any OOM doubles the pieces
                    if not is_oom_error(error):
                        raise
                    failed = True
                else:
                    failed = False
                if not failed:
                    break
                free_memory()  # both peers collect garbage and empty the cache after an OOM
                for p in trainer.model.parameters():
                    p.grad = None
                failures += 1
                ooms += 1
                recomputed += trainer.started  # rows whose forward ran in the failed attempt
                pieces = min(pieces * 2, len(batch[0]))
            if failures:
                incidents.append(failures)
    size = len(loader[0][0])
    return {
        "ooms": ooms,
        "incidents": incidents,
        "recomputed": recomputed,
        "steps": trainer.steps,
        "batch": size,
        "micro": -(-size // pieces),
    }


def run_restart(
    template: nn.Module, loader: list[Batch], capacity: Callable[[int], int]
) -> dict[str, Any]:
    trainer = Trainer(template)
    xs = torch.cat([b[0] for b in loader])
    ys = torch.cat([b[1] for b in loader])
    size = len(loader[0][0])
    ooms, recomputed, incidents = 0, 0, []
    failures = 0
    with SimulatedGPU(capacity(0), adopt=[trainer.model, trainer.opt]) as gpu:
        while True:
            done = 0
            failed = False
            try:
                for _i, start in enumerate(range(0, len(xs), size)):
                    # The pressure schedule follows the position in the data, not the step count.
                    _set_capacity(gpu, capacity(start // len(loader[0][0])))
                    trainer.step((xs[start : start + size], ys[start : start + size]))
                    done += min(size, len(xs) - start)
            except Exception as error:  # the strategy under test: restart the whole function
                if not is_oom_error(error):
                    raise
                failed = True
            if not failed:
                break
            free_memory()
            ooms += 1
            failures += 1
            recomputed += done + size  # everything so far, and the batch that failed
            size //= 2
            if size == 0:
                raise RuntimeError("restart strategy: nothing fits")
        if failures:
            incidents.append(failures)
    return {
        "ooms": ooms,
        "incidents": incidents,
        "recomputed": recomputed,
        "steps": trainer.steps,
        "batch": size,
        "micro": size,
    }


def bench_peers(name: str, batches: int, size: int) -> None:
    torch.manual_seed(0)
    template = WORKLOADS[name].model()
    loader = make_loader(name, batches, size)
    low = peak_of(template, (loader[0][0][: size // 8], loader[0][1][: size // 8]))
    high = peak_of(template, loader[0])
    tight = int(low + 0.3 * (high - low))
    roomy = int(high * 1.05)
    scenarios: dict[str, Callable[[int], int]] = {
        "too small from the start": lambda i: tight,
        "pressure mid-epoch (batches 4-6)": lambda i: tight if 4 <= i <= 6 else roomy,
    }
    print(f"\n## 3. Side by side ({name}, {batches} batches of {size}, AdamW, SimulatedGPU)")
    print(
        "Peers' strategies are re-implemented here as small simulations of their published "
        "behaviour; no peer code is installed, imported or copied.\n"
    )
    print(
        "| scenario | strategy | OOMs | retries per OOM (median) | samples recomputed | "
        "optimizer steps | rows per step at the end | micro-batch at the end |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for scenario, capacity in scenarios.items():
        for label, runner in (
            ("autobatch (accumulate, grow_after=2)", run_ours),
            ("halving, whole batch again (Composer-style)", run_halving),
            ("restart with half the batch (Accelerate/toma-style)", run_restart),
        ):
            r = runner(template, loader, capacity)
            median = statistics.median(r["incidents"]) if r["incidents"] else 0
            print(
                f"| {scenario} | {label} | {r['ooms']} | {median} | {r['recomputed']} | "
                f"{r['steps']} | {r['batch']} | {r['micro']} |"
            )


# --------------------------------------------------------------------------------------------
# 4. The smallest device a split step trains on


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "SGD, momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-2),
}


def _primed(template: nn.Module, optimizer: str, batch: Batch) -> Trainer:
    """A trainer whose optimizer state exists, as after a first step."""
    trainer = Trainer(template)
    trainer.opt = OPTIMIZERS[optimizer](trainer.model.parameters())
    trainer.step((batch[0][:1], batch[1][:1]))
    return trainer


def _trains(template: nn.Module, optimizer: str, batch: Batch, capacity: int) -> int | None:
    """The micro-batch size one guarded step ends with at ``capacity`` (the batch's size when it
    ran whole), or None when it cannot train there."""
    trainer = _primed(template, optimizer, batch)
    step = retry_on_oom(optimizer=trainer.opt, model=trainer.model)(trainer.step)
    with SimulatedGPU(capacity, allocator="exact") as gpu:
        try:
            gpu.adopt(trainer.model, trainer.opt)
        except torch.OutOfMemoryError:  # not even the model state fits
            return None
        try:
            step(batch)
        except BatchSizeError:  # not even one row fits
            return None
        except AutobatchError:  # out of memory inside the optimizer's step: refused, not retried
            return None
    return step.stats.micro_batch_size or len(batch[0])


def bench_smallest(workloads: list[tuple[str, int]]) -> None:
    print("\n## 4. The smallest device a split step trains on (SimulatedGPU, exact allocator)")
    print(
        "bisection over the capacity (to 1 KiB) for one guarded step of the batch; model state = "
        "parameters and the optimizer's state (created by a step before). Accumulating "
        "micro-batches needs the state, one gradient (the earlier pieces' sum, joined by each new "
        "gradient parameter by parameter), one piece's activations, and what the optimizer's "
        "step allocates for itself (AdamW's foreach temporaries). Byte accounting: the exact "
        "allocator (under the caching one, segment sizes set the smallest device)\n"
    )
    print(
        "| workload | batch | optimizer | whole batch's peak | model state | one gradient "
        "| smallest capacity | micro-batch there | smallest − state − gradient |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, size in workloads:
        torch.manual_seed(0)
        if name == "deep mlp":  # eight equal layers: no single layer holds much of the gradient
            layers = [(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)]
            template = nn.Sequential(*[m for layer in layers for m in layer])
            batch = (torch.randn(size, 256), torch.randint(0, 256, (size,)))
        else:
            template = WORKLOADS[name].model()
            batch = make_loader(name, 1, size)[0]
        grad = sum(p.numel() * p.element_size() for p in template.parameters())
        for optimizer in OPTIMIZERS:
            trainer = _primed(template, optimizer, batch)
            state = grad + sum(
                t.numel() * t.element_size()
                for s in trainer.opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)
            )
            low, high = state, peak_of(template, batch, "exact")
            while high - low > 1024:
                middle = (low + high) // 2
                if _trains(template, optimizer, batch, middle) is None:
                    low = middle
                else:
                    high = middle
            print(
                f"| {name} | {size} | {optimizer} | "
                f"{format_bytes(peak_of(template, batch, 'exact'))} | "
                f"{format_bytes(state)} | {format_bytes(grad)} | {format_bytes(high)} | "
                f"{_trains(template, optimizer, batch, high)} | "
                f"{format_bytes(high - state - grad)} |"
            )


# --------------------------------------------------------------------------------------------
# 5. What a split step costs


class _Nothing(TorchDispatchMode):
    """A dispatch mode that does nothing but run each operator: what any mode costs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _Unwatched:
    """Stands in for the ledger's dispatch mode: the same pieces, nothing watched."""

    def __init__(self, ledger: Any) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _spread(values: list[float]) -> str:
    """The median and the interquartile range of ``values``."""
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.2f} ({q[0]:.2f}–{q[2]:.2f})"


def _split_rows(name: str, size: int, pieces: int, rounds: int, steps: int) -> str:
    """A guarded step that runs in ``pieces`` micro-batches, against the same micro-batches
    accumulated by a hand-written loop, interleaved call by call; and with the ledger's
    dispatch mode switched off, and the operators it watched."""
    from autobatch._recovery import _ledger

    work = WORKLOADS[name]
    torch.manual_seed(0)
    model = work.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [work.sample(size) for _ in range(4)]
    limit = [size // pieces]

    def body(batch: Batch, weight: float) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        (loss * weight).backward()
        return loss

    @retry_on_oom(optimizer=opt)
    def step(batch: Batch) -> torch.Tensor:
        if len(batch[0]) > limit[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        opt.zero_grad()
        loss = body(batch, 1.0)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    def by_hand(batch: Batch) -> None:  # what a user would write for the same micro-batches
        opt.zero_grad()
        n = size // pieces
        for start in range(0, size, n):
            body((batch[0][start : start + n], batch[1][start : start + n]), n / size)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step(batches[0])  # the sizes are learned: every later call runs in pieces
    limit[0] = size
    assert step.stats.micro_batch_size == size // pieces
    clock = time.thread_time_ns
    real = _ledger._Mode
    ratios, off = [], []
    for r in range(rounds + 1):  # (the first round warms up)
        times = {"hand": 0, "guarded": 0, "off": 0}
        for i in range(steps):
            order = ["hand", "guarded", "off"] if (r + i) % 2 else ["off", "guarded", "hand"]
            for which in order:
                batch = batches[i % len(batches)]
                start = clock()
                if which == "hand":
                    by_hand(batch)
                elif which == "guarded":
                    step(batch)
                else:
                    _ledger._Mode = _Unwatched  # type: ignore[misc, assignment]
                    try:
                        step(batch)
                    finally:
                        _ledger._Mode = real  # type: ignore[misc]
                times[which] += clock() - start
        if r:
            ratios.append(times["guarded"] / times["hand"])
            off.append(times["off"] / times["hand"])
    seen: Counter[str] = Counter()
    dispatch = real.__torch_dispatch__

    def counting(self: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        seen[str(func.name()).split("::")[-1].split(".")[0]] += 1
        return dispatch(self, func, *args, **kwargs)

    real.__torch_dispatch__ = counting  # type: ignore[method-assign]
    try:
        step(batches[0])
    finally:
        real.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
    ops = sum(seen.values())
    every: Counter[str] = Counter()  # (the hand-written loop, every operator under a mode)

    class _Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            every["all"] += 1
            return func(*args, **(kwargs or {}))

    with _Counting():
        by_hand(batches[0])
    base: list[float] = []
    moded: list[float] = []
    for i in range(max(rounds // 4, 5)):
        for under in ((False, True) if i % 2 else (True, False)):
            start = clock()
            with _Nothing() if under else contextlib.nullcontext():
                by_hand(batches[i % len(batches)])
            (moded if under else base).append((clock() - start) * 1e-9)
    hand = statistics.median(base)
    per_op = (statistics.median(ratios) - statistics.median(off)) * hand / max(ops, 1)
    nothing = (statistics.median(moded) - hand) / every["all"]
    top = ", ".join(f"{k} {v}" for k, v in seen.most_common(4))
    return (
        f"| {name} | {size} | {pieces} | {hand * 1e3:.2f} | {_spread(ratios)} | "
        f"{_spread(off)} | {ops} ({top}) | {per_op * 1e6:.1f} | {nothing * 1e6:.1f} |"
    )


def bench_split(rounds: int, steps: int) -> None:
    torch.set_num_threads(1)
    print("\n## 5. What a split step costs (CPU, AdamW, clipping)")
    print(
        "The guarded step, split into micro-batches after one OOM, against the same "
        "micro-batches accumulated by a hand-written loop (zero_grad, each piece's loss "
        "weighted and backward, clipping, step), and the guarded step with the write ledger's "
        f"dispatch mode switched off (for this measurement only). Thread CPU time; {rounds} "
        f"rounds of {steps} calls of each, interleaved call by call; ratio to the hand-written "
        "loop, median (interquartile range). The operators watched are those of the "
        "micro-batches before the last (the last runs unwatched): their count per call, the "
        "most common, and the ledger's cost per operator watched, next to what a dispatch mode "
        "that does nothing but run each operator costs per operator (the hand-written loop "
        "run under it): the price of seeing operators from Python at all\n"
    )
    print("| workload | batch | micro-batches | hand-written loop (ms) | guarded / hand-written "
          "| ledger off / hand-written | operators watched per call | the ledger, µs per "
          "operator watched | a do-nothing dispatch mode, µs per operator |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, size, pieces in (("mlp", 256, 2), ("mlp", 256, 4), ("conv", 64, 2),
                               ("conv", 64, 4), ("transformer", 64, 2)):
        print(_split_rows(name, size, pieces, rounds, steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and capacities")
    parser.add_argument("--sections", nargs="+", default=["1", "2", "2b", "3", "4", "5"],
                        help="the sections to run (default: all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    chosen = set(args.sections)
    if "1" in chosen:
        bench_overhead(rounds=20 if args.quick else 150, steps=20 if args.quick else 40)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    capacities = 4 if args.quick else 12
    if "2" in chosen:
        bench_retries([("mlp", 1024), ("transformer", 128)], capacities=capacities, batches=3)
    if "2b" in chosen:
        bench_three_times([("mlp", 1024), ("transformer", 128)], batches=40 if args.quick else 200)
    if "3" in chosen:
        bench_peers("mlp", batches=10, size=1024)
    if "4" in chosen:
        bench_smallest([("mlp", 1024), ("transformer", 128), ("deep mlp", 2048)])
    if "5" in chosen:
        bench_split(rounds=10 if args.quick else 100, steps=4 if args.quick else 5)


if __name__ == "__main__":
    main()
