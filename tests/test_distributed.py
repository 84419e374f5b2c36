"""torch.distributed (gloo, 2 spawned processes): every rank agrees, nothing hangs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from _ranks import run_ranks
from torch import nn

import autobatch
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS

CAPACITIES = ["6MiB", "5MiB"]  # heterogeneous ranks


def _find_on_rank(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = WORKLOADS["mlp"].model()
    sample = WORKLOADS["mlp"].sample(4)
    out: dict[str, Any] = {}
    for sync in (False, True):
        with SimulatedGPU(CAPACITIES[rank]) as gpu:
            gpu.adopt(model)
            result = autobatch.search_batch_size(
                model, sample, torch.optim.Adam, loss_fn=nn.functional.cross_entropy,
                headroom=0, sync_ranks=sync,
            )
        out["synced" if sync else "alone"] = result.max_batch_size
        out["sizes_synced" if sync else "sizes_alone"] = [t.size for t in result.trials]
    return out


def test_find_max_batch_agrees_across_heterogeneous_ranks(tmp_path: Path) -> None:
    results = run_ranks(_find_on_rank, 2, tmp_path)
    alone = [r["alone"] for r in results]
    assert alone[0] > alone[1]  # the ranks really differ
    assert [r["synced"] for r in results] == [min(alone)] * 2
    assert results[0]["sizes_synced"] == results[1]["sizes_synced"]  # lockstep


def _crash_on_rank_one(rank: int) -> dict[str, Any]:
    model = nn.Linear(8, 2)

    def step(m: nn.Module, batch: torch.Tensor) -> None:
        if rank == 1 and batch.shape[0] > 4:
            raise ValueError("bug on rank 1")
        m(batch).sum().backward()

    try:
        autobatch.find_max_batch(model, torch.randn(2, 8), step_fn=step, max_batch=64)
    except ValueError as error:
        return {"error": f"ValueError: {error}"}
    except autobatch.AutobatchError as error:
        return {"error": f"AutobatchError: {error}"}
    return {"error": None}


def test_non_oom_error_on_one_rank_raises_everywhere_instead_of_hanging(tmp_path: Path) -> None:
    results = run_ranks(_crash_on_rank_one, 2, tmp_path, timeout=60)
    assert results[1]["error"] == "ValueError: bug on rank 1"
    assert results[0]["error"].startswith("AutobatchError: another rank failed")


def test_single_process_without_group_is_unaffected() -> None:
    assert not autobatch._distributed.active()
    assert autobatch._distributed.all_max([3, 4]) == [3, 4]
    assert autobatch._distributed.failed_ranks(True) == [0]


def test_torchrun_example_agrees_on_every_rank() -> None:
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         str(root / "examples" / "find_batch_torchrun.py")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    # (two processes share the pipe: their lines may run together, so match, don't split)
    found = dict(re.findall(r"rank (\d): (batch size \d+ \(largest that fits on every rank: \d+\))",
                            run.stdout))
    assert sorted(found) == ["0", "1"], run.stdout
    assert found["0"] == found["1"]
