"""Every check that needs a real GPU, in one run, printed as tables.

    python benchmarks/gpu_check.py            # on a CUDA/ROCm machine
    python benchmarks/gpu_check.py --dry-run  # the same checks on a SimulatedGPU (CPU), to test it

1. find_max_batch under ``torch.cuda.set_per_process_memory_fraction`` caps: the answer fits for
   two real steps, the next size does not, and allocated memory after the search equals before.
2. plan_max_batch against ``torch.cuda.max_memory_allocated`` of the same real step (goal: 5%).
3. The simulator's peak (CPU) against the GPU's peak for the same step.
The process's memory fraction is a setting of this process's allocator, not of the card.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import autobatch
from autobatch._backends import memory_for
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import TinyTransformer, conv_net, mlp

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


def _two_steps_fit(
    model: nn.Module, sample: Any, n: int, device: torch.device, state: dict[str, torch.Tensor]
) -> bool:
    """Two real AdamW steps at ``n`` from a fresh optimizer; ``state`` (kept in host memory,
    taken before the cap) puts the weights back."""
    opt = torch.optim.AdamW(model.parameters())
    failed = False
    try:
        x, y = (t.to(device) for t in sample(n))
        _step(model, opt, x, y)
        _step(model, opt, x, y)
    except Exception as error:
        if not autobatch.is_oom_error(error):
            raise
        failed = True
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for key, value in model.state_dict().items():
            value.copy_(state[key])
    del opt
    autobatch.free_memory()
    return not failed


def check_finder(device: torch.device, dry_run: bool, workloads: Workloads) -> list[str]:
    rows = [
        "| model | cap | found | trials (OOM) | n fits | n+1 fails | memory after == before | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
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
                fits = _two_steps_fit(model, sample, n, device, state)
                over = _two_steps_fit(model, sample, n + 1, device, state)
            rows.append(
                f"| {name} | {cap / 2**30:.2f} GiB | {n} | {len(result.trials)} "
                f"({result.oom_trials}) | {fits} | {not over} | {after == before} | {seconds:.1f} |"
            )
        del model
        autobatch.free_memory()
    return rows


def check_planner(device: torch.device, dry_run: bool, workloads: Workloads) -> list[str]:
    rows = ["| model | batch | planned peak | measured peak | error |", "|---|---|---|---|---|"]
    for name, (make, sample) in workloads.items():
        model = make().to(device)
        opt = torch.optim.AdamW(model.parameters())
        for n in (8, 64):
            plan = autobatch.plan_max_batch(
                model, sample(1), opt, capacity="1TiB", loss_fn=CE,
                min_batch=n, max_batch=n, device_type=device.type,
            )
            planned = max(peak for size, peak in plan.points if size == n)
            x, y = (t.to(device) for t in sample(n))
            _step(model, opt, x, y)  # the optimizer state exists: steady state, as planned
            with _capped(device, 2**40, dry_run) if dry_run else contextlib.nullcontext() as gpu:
                if gpu is not None:
                    gpu.adopt(model, opt, x, y)
                memory = memory_for(device)
                memory.reset_peak()
                _step(model, opt, x, y)
                memory.synchronize()
                measured = memory.peak_bytes()
            rows.append(
                f"| {name} | {n} | {planned / 2**20:.1f} MiB | {measured / 2**20:.1f} MiB | "
                f"{(planned - measured) / measured * 100:+.1f}% |"
            )
            del x, y
        model.zero_grad(set_to_none=True)
        del model, opt
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
    print(f"# GPU checks on {where}, torch {torch.__version__}\n")
    print("## find_max_batch under memory caps\n")
    workloads = DRY_WORKLOADS if args.dry_run else GPU_WORKLOADS
    print("\n".join(check_finder(device, args.dry_run, workloads)))
    print("\n## plan_max_batch vs measured peak\n")
    print("\n".join(check_planner(device, args.dry_run, workloads)))


if __name__ == "__main__":
    main()
