"""Cases 13 and 14 of the split-step audit, on 2 gloo ranks: a collective inside a step is
never entered by one rank while another has run out of memory, whenever in training it first
appears, so no rank waits for the process group's timeout."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks
from test_fsdp import _sharded, _tokens
from torch import nn

import autobatch
from autobatch.testing._inject import OOM_KINDS

pytestmark = pytest.mark.slow  # processes that talk to each other: seconds each


def _ddp_periodic_all_reduce(rank: int, guarded: bool) -> dict[str, Any]:
    """A DDP step that all-reduces its loss for logging from its 5th call on; rank 1 runs out
    of memory in forward at that call, before the all-reduce."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 8, generator=generator) for _ in range(7)]
    logged: list[float] = []
    calls = [0]  # (a counter the step keeps: put back after a failed attempt, so it counts calls)
    fired: list[int] = []  # (a log: the fault fires once)

    def step(batch: torch.Tensor) -> None:
        calls[0] += 1
        opt.zero_grad()
        if guarded and rank == 1 and calls[0] == 5 and not fired:
            fired.append(1)
            raise OOM_KINDS["cuda"]()  # (its forward ran out before the all-reduce)
        loss = model(batch).square().mean()
        if calls[0] >= 5:  # logging, after four calls without a collective of the step's own
            total = loss.detach().clone()
            dist.all_reduce(total)  # the other rank must not be waiting here
            logged.append(float(total))
        loss.backward()
        opt.step()

    run = autobatch.retry_on_oom(step, optimizer=opt) if guarded else step
    start = time.monotonic()
    for batch in batches:
        run(batch)
    return {
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "seconds": time.monotonic() - start,
        "ooms": run.stats.ooms if guarded else 0,  # type: ignore[attr-defined]
    }


def test_13_a_collective_first_made_late_in_training_is_agreed_before_it_runs(
    tmp_path: Path,
) -> None:
    plain = run_ranks(_ddp_periodic_all_reduce, 2, tmp_path, False, timeout=120, pg_timeout=30)
    zero, one = run_ranks(_ddp_periodic_all_reduce, 2, tmp_path, True, timeout=120, pg_timeout=30)
    assert one["ooms"] == zero["ooms"] == 1  # (the other rank stopped at the vote too)
    assert zero["params"] == one["params"]
    for got, want in zip(zero["params"], plain[0]["params"], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert max(zero["seconds"], one["seconds"]) < 25  # no rank waited for the timeout


def _fsdp_oom_before_clipping(rank: int) -> dict[str, Any]:
    """FSDP2, clipping by norm (a DTensor all-reduce) after backward; on rank 1 the second
    batch runs out of memory just before the clipping, in its last micro-batch."""
    model = _sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [_tokens(8, 10 * rank + i) for i in range(3)]
    calls = [0]
    fired: list[int] = []  # (a log: the fault fires once)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        calls[0] += 1
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        if rank == 1 and calls[0] == 2 and not fired:
            fired.append(1)
            raise OOM_KINDS["cuda"]()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

    run = autobatch.retry_on_oom(step, optimizer=opt)
    start = time.monotonic()
    error = None
    try:
        for batch in batches:
            run(batch)
    except autobatch.AutobatchError as exc:
        error = str(exc)
    return {
        "error": error, "seconds": time.monotonic() - start, "ooms": run.stats.ooms,
        "full": [p.full_tensor().flatten().tolist() for p in model.parameters()] if error is None
        else None,
    }


def test_14_an_oom_just_before_an_fsdp2_clip_grad_norm_does_not_stall_the_other_rank(
    tmp_path: Path,
) -> None:
    zero, one = run_ranks(_fsdp_oom_before_clipping, 2, tmp_path, timeout=200, pg_timeout=30)
    assert zero["error"] is None, zero["error"]
    assert one["error"] is None, one["error"]
    assert zero["ooms"] == one["ooms"] == 1
    assert zero["full"] == one["full"]
    assert max(zero["seconds"], one["seconds"]) < 25  # no rank waited for the timeout


def _ddp_disagreeing_pieces(rank: int) -> dict[str, Any]:
    """A DDP step whose micro-batches take different paths on rank 1 only (a branch on the
    micro-batch's values): that rank refuses, and the other must hear of it, not wait."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        batch[4:, 0] = 100.0  # its second micro-batch takes the other branch

    def step(batch: torch.Tensor) -> None:
        if len(batch) > 4:
            raise OOM_KINDS["cuda"]()  # (every rank: the batch runs in two micro-batches)
        opt.zero_grad()
        model(batch).square().mean().backward()
        if not bool(batch[0, 0] > 50):  # (the last micro-batch skips the step: seen only at
            opt.step()                  # its end, after the ranks' vote on the piece)

    run = autobatch.retry_on_oom(step, optimizer=opt)
    start = time.monotonic()
    error = None
    try:
        run(batch)
    except autobatch.AutobatchError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - start}


def test_micro_batches_disagreeing_on_one_rank_stop_every_rank_promptly(tmp_path: Path) -> None:
    zero, one = run_ranks(_ddp_disagreeing_pieces, 2, tmp_path, timeout=120, pg_timeout=30)
    assert one["error"] is not None, one
    assert "another path" in one["error"], one
    assert zero["error"] is not None, zero  # (told by rank 1, not left waiting)
    assert max(zero["seconds"], one["seconds"]) < 25  # no rank waited for the timeout
