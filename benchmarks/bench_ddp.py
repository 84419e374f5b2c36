"""What keeping the ranks in lockstep costs: DDP steps with and without autobatch (not in CI).

Two gloo ranks on this machine train the same DDP MLP with Adam. Rounds alternate between three
ways of running the step, and each way's time per step is the minimum over the rounds:

- DDP alone: the plain step, DDP's reducer overlapping its all-reduce with backward;
- autobatch, ranks agreed (``retry_on_oom(optimizer=...)``, the default): a few votes per step on
  the side gloo group, and the gradients averaged once after backward;
- autobatch, independent ranks (``sync_ranks=False``): DDP untouched, the decorator's fast path.

Then an OOM is injected in backward on rank 1 in the middle of training, and the note says how
far both ranks' parameters ended from the run without it.

    python benchmarks/bench_ddp.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import autobatch
from autobatch.testing import inject_oom
from autobatch.testing.models import mlp

RESULTS = Path(__file__).resolve().parent / "results" / "bench_ddp.md"
WAYS = ("DDP alone", "autobatch, ranks agreed", "autobatch, sync_ranks=False")


def _setup(rank: int, width: int, batch: int, steps: int, adam: bool = True) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp(width=width, depth=4))
    optimizer: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=1e-3) if adam
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    generator = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(batch, 128, generator=generator),
         torch.randint(0, 10, (batch,), generator=generator))
        for _ in range(steps)
    ]

    def step(data: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, labels = data
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    return model, optimizer, batches, step


def _worker(rank: int, port: int, out: str, width: int, batch: int, steps: int, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    _, optimizer, batches, step = _setup(rank, width, batch, steps)
    runners = {
        WAYS[0]: step,
        WAYS[1]: autobatch.retry_on_oom(step, optimizer=optimizer),
        WAYS[2]: autobatch.retry_on_oom(step, optimizer=optimizer, sync_ranks=False),
    }
    best = dict.fromkeys(WAYS, float("inf"))
    for _ in range(rounds):
        for way, run in runners.items():
            dist.barrier()
            start = time.perf_counter()
            for data in batches:
                run(data)
            best[way] = min(best[way], (time.perf_counter() - start) / steps)
    # The same training with an OOM on rank 1 at the third step, against the one without (SGD
    # with momentum: linear in the gradients, so micro-batches change it only by rounding, where
    # Adam's first steps magnify rounding in near-zero gradients).
    outcome = {}
    for name, fault in (("clean", False), ("oom", True)):
        model, optimizer, batches, step = _setup(rank, width, batch, steps, adam=False)
        guarded = autobatch.retry_on_oom(step, optimizer=optimizer)
        for index, data in enumerate(batches):
            inject = fault and rank == 1 and index == 2
            with inject_oom(phase="backward") if inject else _null():
                guarded(data)
        outcome[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
        outcome[name + " ooms"] = guarded.stats.ooms
    same = float((outcome["clean"] - outcome["oom"]).abs().max())
    checksum = float(outcome["oom"].double().sum())
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "best": best, "same": same, "checksum": checksum, "ooms": outcome["oom ooms"],
    }))
    dist.barrier()
    dist.destroy_process_group()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(port, out, args.width, args.batch, args.steps, args.rounds),
                           nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    plain = max(r["best"][WAYS[0]] for r in ranks)
    lines = [
        "# DDP with autobatch: the cost of agreement",
        "",
        f"Produced by `python benchmarks/bench_ddp.py`: 2 gloo ranks on one CPU machine, "
        f"MLP width {args.width} depth 4 with Adam, batch {args.batch} per rank, "
        f"{args.steps} steps per round, minimum of {args.rounds} alternated rounds "
        f"(slowest rank). torch {torch.__version__}.",
        "",
        "| step | time per step / DDP alone |",
        "|---|---:|",
    ]
    for way in WAYS:
        lines.append(f"| {way} | {max(r['best'][way] for r in ranks) / plain:.3f} |")
    lines += [
        "",
        "An OOM injected in backward on rank 1 at the third step (ranks agreed): "
        f"OOMs counted {[r['ooms'] for r in ranks]}; largest parameter difference from the "
        f"run without it (SGD with momentum) {max(r['same'] for r in ranks):.1e}; the two ranks' "
        "parameter checksums "
        f"{'agree' if ranks[0]['checksum'] == ranks[1]['checksum'] else 'DIFFER'}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.output.write_text(text)


if __name__ == "__main__":
    main()
