"""What keeping FSDP2 ranks in lockstep costs: sharded steps with and without autobatch (not in CI).

Two gloo ranks on this machine train the same transformer, sharded per block with
``fully_shard`` (then at the root), with AdamW. Rounds alternate between three ways of running
the step, and each way's time per step is the minimum over the rounds:

- FSDP2 alone: the plain step;
- autobatch, ranks agreed (``retry_on_oom(optimizer=...)``): every step runs under the
  collective gate (a dispatch mode that sees every operator) and votes on the side gloo group
  before each of FSDP's all-gathers and reduce-scatters, and once at its end;
- the gate alone: the same dispatch mode with no vote, which tells the per-operator cost of the
  gate from the votes'.

Then an OOM is injected in backward on rank 1 at the third step, and the note says how far both
ranks' parameters ended from the run without it (float64, SGD with momentum).

    python benchmarks/bench_fsdp.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
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
from torch.utils._python_dispatch import TorchDispatchMode

import autobatch
from autobatch._distributed import CollectiveGate
from autobatch.testing import inject_oom
from autobatch.testing.models import TinyTransformer

RESULTS = Path(__file__).resolve().parent / "results" / "bench_fsdp.md"
WAYS = ("FSDP2 alone", "autobatch, ranks agreed", "the gate alone (no vote)")


class _Count(TorchDispatchMode):
    """Operators and FSDP collectives of one step."""

    def __init__(self) -> None:
        super().__init__()
        self.operators = self.collectives = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.operators += 1
        self.collectives += func.namespace == "c10d"
        return func(*args, **(kwargs or {}))


def _setup(
    rank: int, width: int, layers: int, batch: int, steps: int, dtype: torch.dtype, adam: bool
) -> tuple[Any, ...]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyTransformer(vocab=1000, d_model=width, heads=4, layers=layers, dropout=0.0)
    model = model.to(dtype)
    for layer in model.encoder.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-3) if adam
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    generator = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randint(0, 1000, (batch, 32), generator=generator),
         torch.randint(0, 10, (batch,), generator=generator))
        for _ in range(steps)
    ]

    def step(data: tuple[torch.Tensor, torch.Tensor]) -> None:
        tokens, labels = data
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(tokens), labels).backward()
        optimizer.step()

    return model, optimizer, batches, step


def _worker(
    rank: int, port: int, out: str, width: int, layers: int, batch: int, steps: int, rounds: int
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    _, optimizer, batches, step = _setup(rank, width, layers, batch, steps, torch.float32, True)

    def gated(data: tuple[torch.Tensor, torch.Tensor]) -> None:
        with CollectiveGate(lambda: None, lambda: False):
            step(data)

    runners = {
        WAYS[0]: step,
        WAYS[1]: autobatch.retry_on_oom(step, optimizer=optimizer),
        WAYS[2]: gated,
    }
    best = dict.fromkeys(WAYS, float("inf"))
    for _ in range(rounds):
        for way, run in runners.items():
            dist.barrier()
            start = time.perf_counter()
            for data in batches:
                run(data)
            best[way] = min(best[way], (time.perf_counter() - start) / steps)
    with _Count() as count:
        step(batches[0])
    # The same training with an OOM on rank 1 in backward at the third step, against the one
    # without (float64 and SGD with momentum: linear in the gradients, so micro-batches change
    # it only by rounding)
    outcome: dict[str, Any] = {}
    for name, fault in (("clean", False), ("oom", True)):
        model, optimizer, batches, step = _setup(rank, width, layers, batch, 6, torch.float64, False)
        guarded = autobatch.retry_on_oom(step, optimizer=optimizer)
        for index, data in enumerate(batches):
            inject = fault and rank == 1 and index == 2
            with inject_oom(phase="backward") if inject else contextlib.nullcontext():
                guarded(data)
        outcome[name] = torch.cat([p.detach().full_tensor().flatten() for p in model.parameters()])
        outcome[name + " ooms"] = guarded.stats.ooms
    difference = (outcome["clean"] - outcome["oom"]).abs().max() / outcome["clean"].abs().max()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "best": best, "operators": count.operators, "collectives": count.collectives,
        "difference": float(difference), "checksum": float(outcome["oom"].sum()),
        "ooms": outcome["oom ooms"],
    }))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(port, out, args.width, args.layers, args.batch, args.steps, args.rounds),
            nprocs=2, start_method="spawn",
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    plain = max(r["best"][WAYS[0]] for r in ranks)
    lines = [
        "# FSDP2 with autobatch: the cost of agreement",
        "",
        f"Produced by `python benchmarks/bench_fsdp.py`: 2 gloo ranks on one CPU machine, a "
        f"transformer (d_model {args.width}, {args.layers} encoder layers, sequences of 32) "
        f"sharded per layer and at the root with fully_shard, AdamW, batch {args.batch} per "
        f"rank, {args.steps} steps per round, minimum of {args.rounds} alternated rounds "
        f"(slowest rank). torch {torch.__version__}.",
        "",
        "| step | ms per step | time per step / FSDP2 alone |",
        "|---|---:|---:|",
    ]
    for way in WAYS:
        seconds = max(r["best"][way] for r in ranks)
        lines.append(f"| {way} | {seconds * 1e3:.1f} | {seconds / plain:.3f} |")
    operators, collectives = ranks[0]["operators"], ranks[0]["collectives"]
    agreed = max(r["best"][WAYS[1]] for r in ranks)
    gate = max(r["best"][WAYS[2]] for r in ranks)
    lines += [
        "",
        f"One step dispatches {operators} operators, {collectives} of them FSDP collectives "
        f"(all-gathers and reduce-scatters); the guard votes before each of those and once "
        f"at the end ({collectives + 1} votes). On this machine the gate costs about "
        f"{(gate - plain) / operators * 1e6:.1f} µs per operator, and the rest of the guard "
        f"(the votes, gloo all-reduces of a few integers between two busy processes, and its "
        f"bookkeeping) {(agreed - gate) * 1e3:.1f} ms per step, "
        f"{(agreed - gate) / (collectives + 1) * 1e6:.0f} µs per vote.",
        "",
        "An OOM injected in backward on rank 1 at the third step (ranks agreed, float64, SGD "
        f"with momentum): OOMs counted {[r['ooms'] for r in ranks]}; largest parameter "
        f"difference from the run without it, relative to the largest parameter, "
        f"{max(r['difference'] for r in ranks):.1e}; the two ranks' parameter checksums "
        f"{'agree' if ranks[0]['checksum'] == ranks[1]['checksum'] else 'DIFFER'}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.output.write_text(text)


if __name__ == "__main__":
    main()
