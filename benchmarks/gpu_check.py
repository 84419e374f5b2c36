"""Every check that needs a real GPU, in one run, printed as tables.

    python benchmarks/gpu_check.py            # on a CUDA/ROCm machine (a few minutes on an H200)
    python benchmarks/gpu_check.py --dry-run  # the same checks on a SimulatedGPU (CPU), to test it

1. find_max_batch under ``torch.cuda.set_per_process_memory_fraction`` caps: the answer fits in
   five steps of a user's own loop from a fresh AdamW (a new batch copied from host memory each
   step), the next size does not, and allocated memory after the search equals before.
2. plan_max_batch on exact accounting against ``torch.cuda.max_memory_allocated`` of the same
   real step (goal: 5%), and on the caching allocator's model (its default) against
   ``torch.cuda.max_memory_reserved`` of a user's fresh loop: what the GPU reserves beyond the
   plan (cuBLAS/cuDNN workspaces) is the per-device allowance a plan needs in ``overhead=``.
3. The simulator's peak (CPU) against the GPU's peak for the same steady-state AdamW step
   (``foreach=True`` on both sides, the GPU's default): the bytes resident before the step, the
   peak, and the step's own part (peak less resident). In the dry run both sides are simulated,
   so the difference must be 0: it checks the script's copying and adopting, not the simulator.
4. The guard on a real OOM: under a cap halfway between what a small piece needs (the model, its
   optimizer state (SGD with momentum), the batches, two sets of gradients) and what a whole
   batch needs, a few steps of ``@retry_on_oom(optimizer=opt)`` inside ``oom_guard``: the OOMs,
   the micro-batch size, the parameters against the same steps without a cap (allclose, and the
   difference relative to the update), allocated memory after the loop against before, and
   whether ``is_oom_error`` recognises the error the allocator raises for a step at twice the
   batch. Models run in eval mode (no dropout; BatchNorm's running statistics), so that a
   batch's pieces add up to it.
5. What the finder's recording costs: one steady-state step timed bare, inside
   ``_StepPeaks(per_operator=False)`` (the two phases) and inside ``_StepPeaks(per_operator=True)``
   (a peak per dispatched operator), and how many operators were recorded.
6. The caching-allocator model against CUDA's allocator: the same AdamW steps (``foreach=True``)
   from an empty cache, with the model, its state and the batch created in the same order, on
   the GPU and on ``SimulatedGPU(allocator="caching")``: ``torch.cuda.max_memory_reserved``
   against the simulated reserved peak, the allocated peaks, the segments (CUDA's count, which
   leaves expandable segments out) and allocation retries, with and without
   ``expandable_segments`` (set at run time on the GPU). Neither side
   is capped. Kernel workspaces (cuBLAS, cuDNN) and CUDA-only kernels are what the simulator
   cannot see; in the dry run both sides are simulated and every difference must be 0.
7. An OOM in the backward of a mixture of experts (its experts run side by side in backward):
   sizes grow under a cap until a step runs out of memory; the phase it ran out in, the bytes
   still allocated once its ``except`` block is left (nothing called in between) against
   before the step, and whether the last size that fit runs again. On the CPU, autograd keeps
   the work the failed backward left ready (with its activations) until the thread's next
   backward, and the simulator frees it as a GPU's autograd thread does; this is that GPU.
8. The write ledger on the device (split steps on pieces forced by injected OOMs): that it sees
   backward's operators, which CUDA runs on autograd's device threads (BatchNorm's statistics
   backed up, gradients folded by the hooks there); ``check_split`` in float64 on the device for
   a step with AdamW, clipping, a scheduler and BatchNorm (exact), an EMA (refused, state
   unchanged), an optimizer fused into backward (exact); a ``torch.compile``d model split (it
   stays compiled: no new frame skipped); and what the ledger costs a split step of the
   transformer, with and without it.
9. The allocator replay on the device: under a cap, a copy of the caching allocator
   (``allocation_model()``, on CUDA built from ``torch.cuda.memory_snapshot()``) taken with the
   model's parameters resident, from an empty cache; a fixed run of requests made on the device
   against the same requests replayed through the copy (allocated and reserved peaks); a
   search's trials and which of them the replay took (the trial's curve knows which sizes fit);
   and for three sizes the replay's peaks against a user's own loop's
   (``torch.cuda.max_memory_allocated``/``max_memory_reserved`` of five steps from an empty
   cache and a fresh AdamW). In the dry run the device is a simulator too, and the fixed
   requests must agree to the byte.
The process's memory fraction is a setting of this process's allocator, not of the card.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

import autobatch
from autobatch._memory._backends import DeviceMemory, memory_for
from autobatch._memory._measure import _StepPeaks
from autobatch._search import Verdicts
from autobatch._sizing._workload import prime_optimizer
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import MixtureOfExperts, TinyTransformer, conv_net, mlp

CE = nn.functional.cross_entropy

Workloads = dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]]

GPU_WORKLOADS: Workloads = {
    "mlp 2048x4": (
        lambda: mlp(width=2048, depth=4, inputs=1024),
        lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,))),
    ),
    "conv net": (lambda: conv_net(channels=64), lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))),
    "transformer d512 L6 s128": (
        lambda: TinyTransformer(vocab=8000, d_model=512, heads=8, layers=6),
        lambda n: (torch.randint(0, 8000, (n, 128)), torch.randint(0, 10, (n,))),
    ),
}
#: The dry run tests the script on the CPU: the small test models and a 256 MiB "device".
DRY_WORKLOADS: Workloads = {
    "mlp": (mlp, lambda n: (torch.randn(n, 128), torch.randint(0, 10, (n,)))),
    "conv net": (conv_net, lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))),
}


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    CE(model(x), y).backward()
    opt.step()


@contextlib.contextmanager
def _capped(device: torch.device, capacity: int, dry_run: bool) -> Iterator[Any]:
    """A device limited to ``capacity`` bytes: a memory fraction on CUDA, a simulator on CPU."""
    if dry_run:
        with SimulatedGPU(capacity) as gpu:
            yield gpu
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(capacity / total, device)
    try:
        yield None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        gc.collect()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _measured(device: torch.device, dry_run: bool) -> Iterator[Any]:
    """The device as it is, uncapped: the GPU itself, or a simulator too large to fill."""
    if dry_run:
        with SimulatedGPU(2**40) as gpu:
            yield gpu
    else:
        yield None


def _trainer(
    template: nn.Module,
    device: torch.device,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    **options: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A copy of ``template`` on ``device`` and an optimizer (AdamW unless told) for it."""
    model = copy.deepcopy(template).to(device)
    return model, optimizer(model.parameters(), **options)


#: Check 4's optimizer. Not AdamW: Adam turns the rounding noise of a gradient that is zero in
#: theory (an attention key bias: softmax ignores it) into a whole step of lr, so parameters
#: after Adam differ by about lr whether or not the pieces add up. SGD with momentum keeps state
#: and is linear in the gradients, so its parameters differ by rounding only.
GUARD_OPTIMIZER: dict[str, Any] = {"optimizer": torch.optim.SGD, "lr": 0.1, "momentum": 0.9}


def _loop_fits(
    model: nn.Module, sample: Any, n: int, device: torch.device, state: dict[str, torch.Tensor],
    steps: int = 5,
) -> bool:
    """A user's own loop at ``n``: a fresh AdamW, each step a new batch copied from host
    memory and the last loss held until the next one, ``steps`` steps; ``state`` (kept in host
    memory, taken before the cap) puts the weights back."""
    return _loop_peaks(model, sample, n, device, state, steps) is not None


def _loop_peaks(
    model: nn.Module, sample: Any, n: int, device: torch.device, state: dict[str, torch.Tensor],
    steps: int = 5,
) -> tuple[int, int] | None:
    """:func:`_loop_fits`'s loop from an empty cache: its allocated and reserved peaks, or
    ``None`` when it ran out of memory."""
    memory = memory_for(device)
    autobatch.free_memory(device)
    memory.reset_peak()
    opt = torch.optim.AdamW(model.parameters())
    failed = False
    with _disable_current_modes():  # host memory (which a simulated GPU must not count)
        host = [sample(n) for _ in range(2)]
    try:
        for i in range(steps):
            x, y = (t.to(device, copy=True) for t in host[i % 2])
            opt.zero_grad()
            loss = CE(model(x), y)
            loss.backward()
            opt.step()
    except Exception as error:
        if not autobatch.is_oom_error(error):
            raise
        failed = True
    memory.synchronize()
    peaks = (memory.peak_bytes(), memory.peak_reserved_bytes() or 0)
    x = y = loss = None
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for key, value in model.state_dict().items():
            value.copy_(state[key])
    del opt
    autobatch.free_memory()
    return None if failed else peaks


def check_finder(device: torch.device, dry_run: bool, workloads: Workloads) -> list[str]:
    rows = [
        "| model | cap | found | trials (OOM) | n fits | n+1 fails | memory after == before | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if not dry_run:  # cuBLAS keeps a workspace from its first product on: not a leak
        (torch.ones(64, 64, device=device) @ torch.ones(64, 64, device=device)).sum().item()
    for name, (make, sample) in workloads.items():
        model = make().to(device)
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        for fraction in (0.02, 0.05):  # of the card (of 1 GiB in the dry run)
            cap = int(fraction * (2**30 if dry_run else memory_for(device).capacity_bytes()))
            rows_of_sample = sample(4)  # in host memory, as a user's sample usually is
            with _capped(device, cap, dry_run) as gpu:
                if gpu is not None:
                    gpu.adopt(model)
                before = memory_for(device).allocated_bytes()
                start = time.perf_counter()
                result = autobatch.search_batch_size(
                    model, rows_of_sample, torch.optim.AdamW, loss_fn=CE, headroom=0
                )
                seconds = time.perf_counter() - start
                after = memory_for(device).allocated_bytes()
                n = result.max_batch_size
                fits = _loop_fits(model, sample, n, device, state)
                over = _loop_fits(model, sample, n + 1, device, state)
            rows.append(
                f"| {name} | {cap / 2**30:.2f} GiB | {n} | {len(result.trials)} "
                f"({result.oom_trials}) | {fits} | {not over} | {after == before} | {seconds:.1f} |"
            )
        del model
        autobatch.free_memory()
    return rows


def check_planner(device: torch.device, dry_run: bool, workloads: Workloads) -> list[str]:
    """The plan on exact accounting (``allocator="exact"``) against the allocated peak of the
    same steady-state step, and the plan on the caching allocator's model (the default)
    against the reserved peak of a user's fresh loop from an empty cache: the bytes the GPU
    reserves beyond the plan are what no storage shows (cuBLAS/cuDNN workspaces), the
    allowance a plan for this device needs in ``overhead=``. In the dry run both are 0."""
    rows = ["| model | batch | planned allocated | measured allocated | error | planned reserved "
            "(fresh loop) | measured reserved (fresh loop) | reserved beyond the plan |",
            "|---|---|---|---|---|---|---|---|"]
    for name, (make, sample) in workloads.items():
        model = make().to(device)
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters())
        for n in (8, 64):
            exact = autobatch.plan_max_batch(
                model, sample(1), opt, capacity="1TiB", loss_fn=CE,
                min_batch=n, max_batch=n, device=device, allocator="exact",
            )
            planned = max(peak for size, peak in exact.points if size == n)
            placed = autobatch.plan_max_batch(
                model, sample(1), torch.optim.AdamW, capacity="1TiB", loss_fn=CE,
                min_batch=n, max_batch=n, device=device,
            )
            planned_reserved = dict(placed.points)[n]
            x, y = (t.to(device) for t in sample(n))
            _step(model, opt, x, y)  # the optimizer state exists: steady state, as planned
            with _measured(device, dry_run) as gpu:
                if gpu is not None:
                    gpu.adopt(model, opt, x, y)
                memory = memory_for(device)
                memory.reset_peak()
                _step(model, opt, x, y)
                memory.synchronize()
                measured = memory.peak_bytes()
            del x, y
            model.zero_grad(set_to_none=True)
            opt.state.clear()
            with _measured(device, dry_run) as gpu:
                if gpu is not None:
                    gpu.adopt(model)
                loop = _loop_peaks(model, sample, n, device, state)
            reserved = 0 if loop is None else loop[1]
            rows.append(
                f"| {name} | {n} | {planned / 2**20:.1f} MiB | {measured / 2**20:.1f} MiB | "
                f"{(planned - measured) / measured * 100:+.1f}% | "
                f"{planned_reserved / 2**20:.1f} MiB | {reserved / 2**20:.1f} MiB | "
                f"{(reserved - planned_reserved) / 2**20:+.1f} MiB |"
            )
        model.zero_grad(set_to_none=True)
        del model, opt
        autobatch.free_memory()
    return rows


def _steady_peak(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, gpu: Any
) -> tuple[int, int]:
    """Bytes allocated before one steady-state step (after a step that made the optimizer
    state), and that step's peak, as the backend of ``x``'s device reports them."""
    if gpu is not None:
        gpu.adopt(model, opt, x, y)
    memory = memory_for(x.device)
    _step(model, opt, x, y)
    memory.synchronize()
    resident = memory.allocated_bytes()
    memory.reset_peak()
    _step(model, opt, x, y)
    memory.synchronize()
    return resident, memory.peak_bytes()


def check_simulator(
    device: torch.device, dry_run: bool, workloads: Workloads, sizes: tuple[int, ...] = (8, 64)
) -> list[str]:
    rows = [
        "| model | batch | resident: GPU | simulator | peak: GPU | simulator | peak difference "
        "| step's own: GPU | simulator | difference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cpu = torch.device("cpu")
    for name, (make, sample) in workloads.items():
        torch.manual_seed(0)
        template = make()
        for n in sizes:
            x, y = sample(n)
            # the device: what it holds already (other checks' leftovers, a cuBLAS workspace) is
            # not this step's; the dry run's "device" is a simulator as well
            base = memory_for(device).allocated_bytes()
            model, opt = _trainer(template, device, foreach=True)
            with _measured(device, dry_run) as gpu:
                resident, peak = _steady_peak(model, opt, x.to(device), y.to(device), gpu)
            resident, peak = resident - base, peak - base
            del model, opt
            autobatch.free_memory()
            model, opt = _trainer(template, cpu, foreach=True)
            with SimulatedGPU(2**40) as gpu:
                sim_resident, sim_peak = _steady_peak(model, opt, x, y, gpu)
            del model, opt, x, y
            step, sim_step = peak - resident, sim_peak - sim_resident
            rows.append(
                f"| {name} | {n} | {resident / 2**20:.1f} MiB | {sim_resident / 2**20:.1f} MiB | "
                f"{peak / 2**20:.1f} MiB | {sim_peak / 2**20:.1f} MiB | "
                f"{(sim_peak - peak) / peak * 100:+.1f}% | {step / 2**20:.1f} MiB | "
                f"{sim_step / 2**20:.1f} MiB | {(sim_step - step) / max(step, 1) * 100:+.1f}% |"
            )
        autobatch.free_memory()
    return rows


def _phase_peaks(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
    memory: DeviceMemory,
) -> tuple[int, int, int]:
    """One plain step from no gradients: (allocated before it, its peak outside
    ``optimizer.step``, its peak inside)."""
    model.zero_grad(set_to_none=True)
    memory.synchronize()
    resident = memory.allocated_bytes()
    memory.reset_peak()
    peaks = _StepPeaks(memory, per_operator=False)
    with peaks:
        _step(model, opt, x, y)
        memory.synchronize()
    outside, inside = peaks.phases()
    return resident, outside, inside


def _guard_batch(
    template: nn.Module, sample: Callable[[int], Any], device: torch.device, dry_run: bool,
    target: int,
) -> tuple[int, int]:
    """What a step adds to the model and its optimizer state whatever the size (the gradients,
    mostly), and a power of two near the batch size whose rows add ``target`` bytes more, or
    four times that fixed part if more (a straight line through the steps at 16 and 64)."""
    model, opt = _trainer(template, device, **GUARD_OPTIMIZER)
    prime_optimizer(opt)
    costs = []
    with _measured(device, dry_run) as gpu:
        if gpu is not None:
            gpu.adopt(model, opt)
        for n in (16, 64):
            x, y = (t.to(device) for t in sample(n))
            resident, outside, _ = _phase_peaks(model, opt, x, y, memory_for(device))
            costs.append(outside - resident)
            del x, y
    del model, opt
    autobatch.free_memory()
    per_row = max((costs[1] - costs[0]) / 48, 1.0)
    fixed = max(costs[0] - 16 * per_row, 0.0)
    rows = max(target, 4 * fixed) / per_row
    return int(fixed), int(min(2 ** int(math.log2(max(rows, 16))), 2**14))


def _real_oom(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[str, bool]:
    """Forward and backward at twice ``batch``, which cannot fit: the type of the error raised,
    and whether :func:`autobatch.is_oom_error` recognises it."""
    kind, recognised = "no error", False
    try:
        x, y = (torch.cat([t, t]) for t in batch)
        CE(model(x), y).backward()
    except Exception as error:
        kind, recognised = type(error).__name__, autobatch.is_oom_error(error)
    model.zero_grad(set_to_none=True)
    return kind, recognised


def _flat(model: nn.Module) -> torch.Tensor:
    """Every parameter, in host memory, as one vector."""
    return torch.cat([p.detach().to("cpu", copy=True).flatten() for p in model.parameters()])


def _guarded_steps(
    model: nn.Module, opt: torch.optim.Optimizer, loader: list[tuple[torch.Tensor, ...]]
) -> tuple[autobatch.RecoveryStats, int | None]:
    """One pass over ``loader`` with a decorated step inside the guard: the step's statistics
    and the guard's micro-batch size."""

    @autobatch.retry_on_oom(optimizer=opt)
    def train_step(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = CE(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss.detach()

    with autobatch.oom_guard(loader) as guard:
        for batch in guard:
            train_step(batch)
    return train_step.stats, guard.stats.micro_batch_size


def check_guard(
    device: torch.device, dry_run: bool, workloads: Workloads, steps: int = 3
) -> list[str]:
    rows = [
        "| model | batch | cap | OOMs | micro-batch | params allclose to uncapped, rtol 1e-3 atol "
        "1e-5 (max abs diff) | update difference (rounding: < 1e-3) | memory after == before "
        "| error at 2x batch | is_oom_error | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    target = 2**24 if dry_run else 2**30  # what a whole batch's rows add
    for name, (make, sample) in workloads.items():
        torch.manual_seed(0)
        template = make().eval()  # no dropout, BatchNorm's running statistics: pieces add up
        fixed, n = _guard_batch(template, sample, device, dry_run, target)
        torch.manual_seed(1)
        batches = [sample(n) for _ in range(steps)]

        # the reference: whole batches, no cap; its peaks size the cap
        initial = _flat(template)
        model, opt = _trainer(template, device, **GUARD_OPTIMIZER)
        prime_optimizer(opt)
        loader = [tuple(t.to(device) for t in batch) for batch in batches]
        resident = outside = inside = 0
        with _measured(device, dry_run) as gpu:
            if gpu is not None:
                gpu.adopt(model, opt, loader)
            for x, y in loader:
                resident, o, i = _phase_peaks(model, opt, x, y, memory_for(device))
                outside, inside = max(outside, o), max(inside, i)
        expected = _flat(model)
        del model, opt, loader, x, y
        autobatch.free_memory()
        # halfway from what any piece needs (its gradients next to those accumulated so far)
        # to what the whole batch needs, and above the optimizer step's own peak
        cap = max((resident + 2 * fixed + outside) // 2, (inside + outside) // 2)
        if not inside < cap < outside:
            rows.append(f"| {name} | {n} | no cap holds a piece's step but not the batch's |")
            continue

        model, opt = _trainer(template, device, **GUARD_OPTIMIZER)
        prime_optimizer(opt)
        loader = [tuple(t.to(device) for t in batch) for batch in batches]
        autobatch.free_memory()  # an empty cache: the cap limits what the allocator reserves
        with _capped(device, cap, dry_run) as gpu:
            if gpu is not None:
                gpu.adopt(model, opt, loader)
            memory = memory_for(device)
            before = memory.allocated_bytes()
            start = time.perf_counter()
            stats, micro = _guarded_steps(model, opt, loader)
            memory.synchronize()
            seconds = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            gc.collect()
            after = memory.allocated_bytes()
            got = _flat(model)
            kind, recognised = _real_oom(model, loader[0])
            autobatch.free_memory()
        same = torch.allclose(got, expected, rtol=1e-3, atol=1e-5)
        # a piece lost or counted twice moves the update by a tenth or more; rounding, far less
        relative = float((got - expected).norm() / (expected - initial).norm())
        rows.append(
            f"| {name} | {n} | {cap / 2**20:.1f} MiB | {stats.ooms} | {micro} | "
            f"{same} ({float((got - expected).abs().max()):.1e}) | {relative:.1e} | "
            f"{after == before} | {kind} | {recognised} | {seconds:.1f} |"
        )
        del model, opt, loader
        autobatch.free_memory()
    return rows


def _workload(
    make: Callable[[], nn.Module], sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    n: int, device: torch.device,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A workload's model (seeded), its AdamW and a batch of ``n`` on ``device``."""
    torch.manual_seed(0)
    model = make().to(device)
    x, y = (t.to(device) for t in sample(n))
    return model, torch.optim.AdamW(model.parameters()), x, y


def check_recording_cost(
    device: torch.device, dry_run: bool, workloads: Workloads, n: int = 64, repeats: int = 5
) -> list[str]:
    rows = [
        "| model | batch | step | with phases | ratio | with per-operator peaks | ratio "
        "| operators |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, (make, sample) in workloads.items():
        model, opt, x, y = _workload(make, sample, n, device)
        _step(model, opt, x, y)  # the optimizer state exists: steady state, as in a trial
        best: dict[bool | None, float] = {None: math.inf, False: math.inf, True: math.inf}
        operators = 0
        with _measured(device, dry_run) as gpu:
            if gpu is not None:
                gpu.adopt(model, opt, x, y)
            memory = memory_for(device)
            for round_ in range(repeats + 1):  # round 0 warms up; the variants take turns
                for per_operator in best:
                    recorder: contextlib.AbstractContextManager[Any] = (
                        contextlib.nullcontext() if per_operator is None
                        else _StepPeaks(memory, per_operator=per_operator)
                    )
                    memory.synchronize()
                    start = time.perf_counter()
                    with recorder:
                        _step(model, opt, x, y)
                        memory.synchronize()
                    seconds = time.perf_counter() - start
                    if round_:
                        best[per_operator] = min(best[per_operator], seconds)
                    if isinstance(recorder, _StepPeaks) and recorder.per_operator:
                        operators = len(recorder.parts())
        plain, phases, each = (best[k] * 1e3 for k in (None, False, True))
        rows.append(
            f"| {name} | {n} | {plain:.2f} ms | {phases:.2f} ms | {phases / plain:.2f}x | "
            f"{each:.2f} ms | {each / plain:.2f}x | {operators} |"
        )
        model.zero_grad(set_to_none=True)
        del model, opt, x, y
        autobatch.free_memory()
    return rows


@contextlib.contextmanager
def _allocator(
    device: torch.device, expandable: bool, dry_run: bool
) -> Iterator[DeviceMemory | None]:
    """The device's allocator from an empty cache, with ``expandable_segments`` as asked (the
    backend, or ``None`` where torch cannot switch it at run time); a caching SimulatedGPU
    standing in for the device in the dry run."""
    if dry_run:
        with SimulatedGPU(2**40, allocator="caching", expandable_segments=expandable):
            yield memory_for(device)
        return
    switch = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if switch is None and expandable:
        yield None
        return
    autobatch.free_memory(device)
    if switch is not None:
        switch(f"expandable_segments:{expandable}")
    try:
        yield memory_for(device)
    finally:
        autobatch.free_memory(device)  # segments made expandable go before the switch back
        if switch is not None:
            switch("expandable_segments:False")


def _reserving_steps(
    template: nn.Module, batch: tuple[torch.Tensor, ...], device: torch.device,
    memory: DeviceMemory, steps: int = 3,
) -> tuple[int, int, int, int]:
    """``steps`` AdamW steps of a copy of ``template`` moved to ``device`` (module order, as
    ``.to(device)`` allocates), then the batch: (peak allocated, peak reserved, segments,
    allocation retries), less what the allocator held before."""
    stats = memory.memory_stats() or {}
    retries = stats.get("num_alloc_retries", 0)
    memory.synchronize()
    memory.reset_peak()
    allocated, reserved = memory.allocated_bytes(), memory.reserved_bytes() or 0
    model = copy.deepcopy(template)
    # Module._apply is what .to() runs: a copy of every parameter and buffer, children first.
    # On the CPU, .to("cpu") would keep the tensors; a copy makes the simulator see them.
    model._apply(lambda t: t.to(device, copy=True))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x, y = (t.to(device, copy=True) for t in batch)
    for _ in range(steps):
        _step(model, opt, x, y)
    memory.synchronize()
    stats = memory.memory_stats() or {}
    result = (
        memory.peak_bytes() - allocated,
        (memory.peak_reserved_bytes() or 0) - reserved,
        stats.get("segment.all.current", 0),
        stats.get("num_alloc_retries", 0) - retries,
    )
    model.zero_grad(set_to_none=True)
    del model, opt, x, y
    return result


def check_reserved(
    device: torch.device, dry_run: bool, workloads: Workloads, sizes: tuple[int, ...] = (16, 128)
) -> list[str]:
    rows = [
        "| model | batch | expandable | reserved peak: GPU | reserved peak: simulator "
        "| difference | allocated peak: GPU | allocated peak: simulator | segments: GPU "
        "| segments: simulator | retries: GPU | retries: simulator |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cpu = torch.device("cpu")
    for name, (make, sample) in workloads.items():
        torch.manual_seed(0)
        template = make()
        for n in sizes:
            batch = sample(n)
            for expandable in (False, True):
                with _allocator(device, expandable, dry_run) as memory:
                    if memory is None:
                        rows.append(f"| {name} | {n} | {expandable} | this torch cannot switch "
                                    "expandable segments at run time |")
                        continue
                    real = _reserving_steps(template, batch, device, memory)
                with SimulatedGPU(2**40, allocator="caching", expandable_segments=expandable):
                    simulated = _reserving_steps(template, batch, cpu, memory_for(cpu))
                mib = 2**20
                rows.append(
                    f"| {name} | {n} | {expandable} | {real[1] / mib:.1f} MiB | "
                    f"{simulated[1] / mib:.1f} MiB | "
                    f"{(simulated[1] - real[1]) / max(real[1], 1) * 100:+.1f}% | "
                    f"{real[0] / mib:.1f} MiB | {simulated[0] / mib:.1f} MiB | {real[2]} | "
                    f"{simulated[2]} | {real[3]} | {simulated[3]} |"
                )
        autobatch.free_memory()
    return rows


def _expert_step(
    model: nn.Module, opt: torch.optim.Optimizer, n: int, device: torch.device, phase: list[str]
) -> None:
    """A plain training step at ``n`` rows; ``phase`` says where it is."""
    x, y = torch.randn(n, 128, device=device), torch.randint(0, 10, (n,), device=device)
    opt.zero_grad(set_to_none=True)
    phase[0] = "forward"
    loss = CE(model(x), y)
    phase[0] = "backward"
    loss.backward()
    phase[0] = "optimizer step"
    opt.step()
    phase[0] = ""


def check_failed_backward(device: torch.device, dry_run: bool, workloads: Workloads) -> list[str]:
    rows = [
        "| model | capacity | ran out at batch | in | left allocated after the except block | "
        "the batch before runs again |",
        "|---|---:|---:|---|---:|:---:|",
    ]
    width, capacity, start = (32, 4 << 20, 200) if dry_run else (256, 256 << 20, 512)
    torch.manual_seed(0)
    template = MixtureOfExperts(width=width, hidden=4 * width, experts=8 if not dry_run else 4)
    with _capped(device, capacity, dry_run):
        memory = memory_for(device)
        model, opt = _trainer(template, device)
        phase = [""]
        _expert_step(model, opt, start, device, phase)  # AdamW's state
        opt.zero_grad(set_to_none=True)
        before = memory.allocated_bytes()
        fits, failed, n = start, None, start
        while failed is None and n < 100 * start:
            n = int(n * 1.02) + 1  # (fine steps: the first OOM is where the peak is, in backward)
            try:
                _expert_step(model, opt, n, device, phase)
            except torch.OutOfMemoryError:
                failed = n
            else:
                fits = n
        where = phase[0]
        opt.zero_grad(set_to_none=True)  # the gradients the half-done step made
        left = memory.allocated_bytes() - before  # nothing called since the except block
        try:
            _expert_step(model, opt, fits, device, phase)
            again = True
        except torch.OutOfMemoryError:
            again = False
        del model, opt
    rows.append(
        f"| mixture of experts (width {width}) | {capacity >> 20} MiB | {failed} | {where} | "
        f"{left:,} bytes | {again} |"
    )
    return rows


def check_ledger(device: torch.device, dry_run: bool, workloads: Workloads) -> list[str]:
    """Check 8: the write ledger on the device."""
    from autobatch._recovery import _ledger
    from autobatch.testing import check_split

    rows = ["| check | result |", "|---|---|"]
    torch.manual_seed(0)
    # (a) backward's operators are seen (on autograd's device thread on CUDA)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {"backward ops": 0, "threads": set()}
    real_dispatch = _ledger._Mode.__torch_dispatch__

    def counting(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch._C._current_autograd_node() is not None:
            seen["backward ops"] += 1
            seen["threads"].add(threading.get_ident())
        return real_dispatch(self, func, types, args, kwargs)

    cap = [32]

    @autobatch.retry_on_oom(optimizer=opt)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        if len(batch[0]) > cap[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        opt.zero_grad()
        CE(model(batch[0]), batch[1]).backward()
        opt.step()

    batch = (torch.randn(64, 64, device=device), torch.randint(0, 10, (64,), device=device))
    tracked = int(model[1].num_batches_tracked)
    _ledger._Mode.__torch_dispatch__ = counting  # type: ignore[method-assign]
    try:
        step(batch)
    finally:
        _ledger._Mode.__torch_dispatch__ = real_dispatch  # type: ignore[method-assign]
    rows.append(f"| split step: micro-batch, OOMs, BatchNorm updates | "
                f"{step.stats.micro_batch_size}, {step.stats.ooms}, "
                f"{int(model[1].num_batches_tracked) - tracked} |")
    caller = threading.get_ident() in seen["threads"]
    rows.append(f"| backward operators the ledger saw (on the caller's thread / another) | "
                f"{seen['backward ops']} ({'caller' if caller else 'autograd device thread'}) |")
    # (b) check_split on the device, float64
    net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    net = net.to(device)
    adam = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(adam, total_iters=10)
    shadow = {n: p.detach().clone() for n, p in net.named_parameters()}
    data = (torch.randn(16, 16, device=device), torch.randint(0, 4, (16,), device=device))

    def train(b: tuple[torch.Tensor, torch.Tensor]) -> None:
        adam.zero_grad()
        CE(net(b[0]), b[1]).backward()
        nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        adam.step()
        sched.step()

    def with_ema(b: tuple[torch.Tensor, torch.Tensor]) -> None:
        train(b)
        with torch.no_grad():
            for n, p in net.named_parameters():
                shadow[n].lerp_(p, 0.1)

    exact = check_split(train, data, optimizer=adam, scheduler=sched, model=net)
    refused = check_split(with_ema, data, optimizer=adam, scheduler=sched, model=net,
                          objects=[shadow])
    rows.append(f"| check_split, AdamW + clipping + scheduler + BatchNorm | "
                f"{'exact' if exact else 'NOT exact: ' + '; '.join(exact.differences[:3])} |")
    unchanged = refused.refusal is not None and not refused.differences
    rows.append(f"| check_split, an EMA in the step | "
                f"{'refused, state unchanged' if unchanged else str(refused)[:200]} |")
    per_param = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in net.parameters()}

    def fused_hook(p: torch.Tensor) -> None:
        per_param[p].step()
        per_param[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(fused_hook) for p in net.parameters()]
    try:
        fused = check_split(lambda b: CE(net(b[0]), b[1]).backward(), data,
                            optimizer=list(per_param.values()), model=net,
                            schedules=["forward", "backward", "backward_last"])
    finally:
        for handle in handles:
            handle.remove()
    rows.append(f"| check_split, an optimizer fused into backward (device thread) | "
                f"{'exact' if fused else '; '.join(fused.differences[:3]) or fused.refusal} |")
    # (c) a compiled model stays compiled after split steps
    compiles = [0]

    def backend(graph: Any, inputs: Any) -> Any:
        compiles[0] += 1
        return graph.forward

    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    compiled = torch.compile(plain, backend=backend, dynamic=False)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)

    rows_allowed = [10**9]

    @autobatch.retry_on_oom(optimizer=sgd)
    def compiled_step(b: tuple[torch.Tensor, torch.Tensor]) -> None:
        if len(b[0]) > rows_allowed[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        sgd.zero_grad()
        CE(compiled(b[0]), b[1]).backward()
        sgd.step()

    compiled_step(data)
    before = compiles[0]
    rows_allowed[0] = 8
    compiled_step(data)  # split under the ledger: 8-row pieces, a new shape
    rows_allowed[0] = 10**9
    compiled_step(data)
    compiled_step((data[0][:8], data[1][:8]))  # the piece's shape again, outside the ledger
    rows.append(f"| a compiled model: compiles before / after split steps | {before} / "
                f"{compiles[0]} (compiled again for a new shape, never left eager) |")
    # (d) what the ledger costs a split step of the transformer
    name = next(iter(workloads))
    factory, sample = workloads[name]
    torch.manual_seed(0)
    big = factory().to(device)
    big_opt = torch.optim.AdamW(big.parameters(), lr=1e-4)
    xb = [t.to(device) for t in sample(32)]
    limit = [16]

    @autobatch.retry_on_oom(optimizer=big_opt)
    def big_step(b: list[torch.Tensor]) -> None:
        if len(b[0]) > limit[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        big_opt.zero_grad()
        CE(big(b[0]), b[1]).backward()
        big_opt.step()

    big_step(xb)
    limit[0] = 10**9
    memory = memory_for(device)

    def timed(runs: int = 5) -> float:
        memory.synchronize()
        start = time.perf_counter()
        for _ in range(runs):
            big_step(xb)
        memory.synchronize()
        return (time.perf_counter() - start) / runs

    timed(2)
    watched = timed()
    real_mode = _ledger._Mode

    class Off:
        def __init__(self, ledger: Any) -> None:
            pass

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    _ledger._Mode = Off  # type: ignore[misc, assignment]
    try:
        timed(2)
        unwatched = timed()
    finally:
        _ledger._Mode = real_mode  # type: ignore[misc]
    rows.append(f"| {name}, 2 micro-batches of 16: ms per step with / without the ledger | "
                f"{watched * 1e3:.1f} / {unwatched * 1e3:.1f} (ratio {watched / unwatched:.2f}) |")
    autobatch.free_memory()
    return rows


#: Check 9's requests: ``(serial, bytes)``, ``-1`` bytes for a free; small and large blocks,
#: split, merged and reused, a segment of its own, and a large request in 2 MiB rounding.
REPLAYED_REQUESTS = [
    (0, 1000), (1, 3 << 20), (2, 700 << 10), (3, 12 << 20), (1, -1), (4, 2 << 20), (0, -1),
    (5, 21 << 20), (6, 5 << 20), (3, -1), (7, 11 << 20), (8, 300), (2, -1), (9, (1 << 20) + 1),
]


def _requested(memory: DeviceMemory, device: torch.device) -> tuple[int, int] | None:
    """:data:`REPLAYED_REQUESTS` made on the device from an empty cache: the allocated and
    reserved peaks, or ``None`` when one ran out of memory."""
    memory.reset_peak()
    live: dict[int, torch.Tensor] = {}
    try:
        for serial, nbytes in REPLAYED_REQUESTS:
            if nbytes < 0:
                del live[serial]
            else:
                live[serial] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return None
    finally:
        live.clear()
        memory.synchronize()
    return memory.peak_bytes(), memory.peak_reserved_bytes() or 0


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages ``name``'s logger logs meanwhile, debug ones included."""
    lines: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _compared(name: str, measure: str, real: int | None, replayed: int | None) -> str:
    def shown(value: int | None) -> str:
        return "OOM" if value is None else f"{value / 2**20:.2f} MiB"

    difference = "" if real is None or replayed is None else f"{replayed - real:+,} bytes"
    return f"| {name} | {measure} | {shown(real)} | {shown(replayed)} | {difference} |"


def check_replay(device: torch.device, dry_run: bool, workloads: Workloads) -> list[str]:
    """Check 9: the allocator replay on the device."""
    rows = ["| model | measure | device | replay | difference |", "|---|---|---|---|---|"]
    name, (make, sample) = next(iter(workloads.items()))
    torch.manual_seed(0)
    model = make().to(device)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    cap = int(0.1 * 2**30) if dry_run else int(0.02 * memory_for(device).capacity_bytes())
    with _capped(device, cap, dry_run) as gpu:
        if gpu is not None:
            gpu.adopt(model)
        memory = memory_for(device)
        autobatch.free_memory(device)
        with _logged("autobatch.backends") as why:  # (why there is no copy, if there is none)
            replica = memory.allocation_model()
        made = "none: " + "; ".join(why) if replica is None else f"{len(replica.blocks())} blocks"
        rows.append(f"| {name} | a copy of the allocator ({cap / 2**30:.2f} GiB cap) | | "
                    f"{made} | |")
        if replica is None:
            return rows
        real = _requested(memory, device)
        replayed = replica.replay(REPLAYED_REQUESTS)
        for i, measure in enumerate(("allocated", "reserved")):
            rows.append(_compared(name, f"fixed requests: {measure} peak",
                                  None if real is None else real[i],
                                  None if replayed is None else replayed[i]))
        result = autobatch.search_batch_size(
            model, sample(4), torch.optim.AdamW, loss_fn=CE, headroom=0
        )
        trials = ", ".join(
            f"{t.size}{'' if t.fits else ' OOM'}{' (replay)' if isinstance(t.curve, Verdicts) else ''}"
            for t in result.trials
        )
        rows.append(f"| {name} | trials (replay: the replay took) | {len(result.trials)}: "
                    f"{trials} | | |")
        curve = next(
            (t.curve for t in reversed(result.trials) if isinstance(t.curve, Verdicts)), None
        )
        if curve is not None:
            n = result.max_batch_size
            for size in sorted({max(n // 4, 1), max(n // 2, 1), n}):
                peaks = _loop_peaks(model, sample, size, device, state)
                for i, at in enumerate((curve.peak_at, curve.reserved_at)):
                    measure = ("allocated", "reserved")[i]
                    rows.append(_compared(name, f"batch {size}, five steps: {measure} peak",
                                          None if peaks is None else peaks[i], at(size)))
    del model
    autobatch.free_memory()
    return rows


class _BatchStep:
    """``_step`` on a batch: what a user decorates."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        _step(self.model, self.opt, *batch)


def check_fast_path(
    device: torch.device, dry_run: bool, workloads: Workloads, n: int = 64, rounds: int = 30,
    steps: int = 20,
) -> list[str]:
    """The guard's cost on steps that never run out of memory: a plain loop and the same step
    under ``retry_on_oom`` inside ``oom_guard``, interleaved step by step (synchronised), and
    the cost of one read of the allocator's retry count (read every few steps)."""
    if dry_run:  # (the script's own test: the check runs, its numbers mean nothing)
        rounds, steps = 3, 4
    rows = [
        "| model | batch | plain step | guarded: median relative (IQR) | retry-count read |",
        "|---|---|---|---|---|",
    ]
    for name, (make, sample) in workloads.items():
        model, opt, x, y = _workload(make, sample, n, device)
        guarded = autobatch.retry_on_oom(optimizer=opt)(_BatchStep(model, opt))
        with _measured(device, dry_run) as gpu:
            if gpu is not None:
                gpu.adopt(model, opt, x, y)
            memory = memory_for(device)
            _step(model, opt, x, y)
            guarded((x, y))
            relative, plain_times = [], []
            for round_ in range(rounds + 1):
                totals = [0.0, 0.0]
                with autobatch.oom_guard([(x, y)] * steps) as loader:
                    for i, batch in enumerate(loader):
                        for first in ((0, 1) if i % 2 == 0 else (1, 0)):
                            memory.synchronize()
                            start = time.perf_counter()
                            if first == 0:
                                _step(model, opt, x, y)
                            else:
                                guarded(batch)
                            memory.synchronize()
                            totals[first] += time.perf_counter() - start
                if round_:
                    relative.append(totals[1] / totals[0] - 1)
                    plain_times.append(totals[0] / steps)
            start = time.perf_counter()
            for _ in range(100):
                memory.alloc_retries()
            read = (time.perf_counter() - start) / 100
        q = statistics.quantiles(relative, n=4)
        rows.append(
            f"| {name} | {n} | {statistics.median(plain_times) * 1e3:.2f} ms | "
            f"{statistics.median(relative):+.2%} ({q[0]:+.2%} to {q[2]:+.2%}) | "
            f"{read * 1e6:.1f} µs |"
        )
        del model, opt, x, y, guarded
        autobatch.free_memory()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run on a SimulatedGPU (CPU)")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA/ROCm device: nothing to check (use --dry-run to test this script)")
        return
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    where = "SimulatedGPU (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    print(f"# GPU checks on {where}, torch {torch.__version__}")
    workloads = DRY_WORKLOADS if args.dry_run else GPU_WORKLOADS
    checks: list[tuple[str, Callable[[torch.device, bool, Workloads], list[str]]]] = [
        ("1. find_max_batch under memory caps", check_finder),
        ("2. plan_max_batch vs measured peak", check_planner),
        ("3. SimulatedGPU (CPU) vs the GPU, one steady-state AdamW step", check_simulator),
        ("4. retry_on_oom + oom_guard on a real OOM", check_guard),
        ("5. Cost of recording peaks during a trial (min of 5 steps)", check_recording_cost),
        ("6. Caching-allocator model vs CUDA's allocator: reserved peak of the same steps",
         check_reserved),
        ("7. What an OOM in backward leaves allocated (a mixture of experts)",
         check_failed_backward),
        ("8. The write ledger on the device", check_ledger),
        ("9. The allocator replay on the device", check_replay),
        ("10. The guard's fast path: steps that never run out of memory", check_fast_path),
    ]
    for title, check in checks:
        start = time.perf_counter()
        rows = check(device, args.dry_run, workloads)
        print(f"\n## {title}\n")
        print("\n".join(rows))
        print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
