"""torch.distributed (gloo, 2 spawned processes): every rank agrees, nothing hangs."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _faults import PHASES, oom_over
from _ranks import run_ranks
from torch import nn

import autobatch
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS

pytestmark = pytest.mark.slow  # processes that talk to each other: seconds each

CAPACITIES = ["6MiB", "5MiB"]  # heterogeneous ranks


def _find_on_rank(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = WORKLOADS["mlp"].model()
    sample = WORKLOADS["mlp"].sample(4)
    out: dict[str, Any] = {}
    for sync in (False, True):
        with SimulatedGPU(CAPACITIES[rank], allocator="exact") as gpu:
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
    assert results[0]["error"].startswith("AutobatchError: rank 1 failed with an error that is not")


def test_single_process_without_group_is_unaffected() -> None:
    assert not autobatch._distributed.active()
    assert autobatch._distributed.all_max([3, 4]) == [3, 4]
    assert autobatch._distributed.failed_ranks(True) == [0]


def _torchrun(example: str) -> str:
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(root / "examples" / example)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_torchrun_guard_example_ends_with_the_same_parameters_on_every_rank() -> None:
    stdout = _torchrun("train_ddp_torchrun.py")
    found = dict(re.findall(r"rank (\d): (6 steps, [1-9]\d* OOM, micro-batch \d+, parameter checksum -?\d+\.\d{10})",
                            stdout))
    assert sorted(found) == ["0", "1"], stdout
    assert found["0"] == found["1"]


def test_torchrun_example_agrees_on_every_rank() -> None:
    stdout = _torchrun("find_batch_torchrun.py")
    # (two processes share the pipe: their lines may run together, so match, don't split)
    found = dict(re.findall(r"rank (\d): (batch size \d+ \(largest that fits on every rank: \d+\))",
                            stdout))
    assert sorted(found) == ["0", "1"], stdout
    assert found["0"] == found["1"]


# The guard and the decorator under DistributedDataParallel ------------------------------------

STEPS = 4


def _train_ddp(rank: int, fault: str | None, at_call: int = 0, policy: str = "accumulate") -> dict[str, Any]:
    """Train a DDP MLP for a few steps; ``fault``: an OOM injected on rank 1 only at call
    ``at_call`` (``"forward"``, ``"backward"``, ``"optimizer"``; ``"plain"``: no autobatch)."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel

    from autobatch.testing import inject_oom

    torch.manual_seed(0)
    model = DistributedDataParallel(WORKLOADS["mlp"].model())
    # SGD with momentum: state made by the first step, and linear in the gradients, so that
    # micro-batches change the result only by rounding
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [
        (torch.randn(16, 128, generator=generator), torch.randint(0, 10, (16,), generator=generator))
        for _ in range(STEPS)
    ]

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, labels = batch
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        # Clipping between backward and step sees the averaged gradients, as under DDP alone
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        opt.step()
        return loss.detach()

    calls = 0
    ooms = 0
    error = None
    if fault == "plain":
        for batch in batches:
            step(batch)
    else:
        guarded = autobatch.retry_on_oom(step, optimizer=opt, policy=policy)  # type: ignore[call-overload]

        def one(batch: Any) -> None:
            nonlocal calls
            inject = fault is not None and rank == 1 and calls == at_call
            with inject_oom(phase=fault) if inject else nullcontext():
                guarded(batch)
            calls += 1

        try:
            with autobatch.oom_guard(batches) as guard:
                for batch in guard:
                    one(batch)
        except autobatch.AutobatchError as exc:
            error = str(exc)
        ooms = guarded.stats.ooms
    return {
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "ooms": ooms,
        "error": error,
    }


def _ddp_runs(rank: int) -> dict[str, Any]:
    out = {name: _train_ddp(rank, None if name == "none" else name)
           for name in ("plain", "none", "forward", "backward", "optimizer")}
    out["shrink"] = _train_ddp(rank, "forward", policy="shrink")
    out["late step"] = _train_ddp(rank, "optimizer", at_call=1)
    return out


def _flat(params: list[list[float]]) -> torch.Tensor:
    return torch.cat([torch.tensor(p) for p in params])


def test_ddp_guard_recovers_from_an_oom_on_one_rank_in_every_phase(tmp_path: Path) -> None:
    ranks = run_ranks(_ddp_runs, 2, tmp_path, timeout=90)
    reference = _flat(ranks[0]["plain"]["params"])
    assert ranks[0]["plain"]["params"] == ranks[1]["plain"]["params"]
    for name in ("none", "forward", "backward", "optimizer", "shrink"):
        zero, one = ranks[0][name], ranks[1][name]
        assert zero["error"] is None, name
        assert one["error"] is None, name
        assert zero["params"] == one["params"], f"{name}: the ranks' parameters differ"
        assert one["ooms"] == (0 if name == "none" else 1), name
        if name != "shrink":  # the same math as the uninterrupted DDP run
            got = _flat(zero["params"])
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6, msg=name)
    # An OOM inside a later optimizer.step may have half-updated rank 1: both ranks stop, clearly.
    zero, one = (ranks[r]["late step"]["error"] for r in (0, 1))
    assert "SGD.step() failed on this rank" in one, one
    assert zero.startswith("rank 1 failed in this step"), zero


def _guarded_failures(rank: int, case: str) -> dict[str, Any]:
    import time

    from torch.nn.parallel import DistributedDataParallel

    from autobatch.testing import inject_oom

    model: nn.Module = nn.Linear(8, 2)
    if case == "static graph":
        model = DistributedDataParallel(model, static_graph=True)
    if case == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @autobatch.retry_on_oom(optimizer=opt, sync_ranks=case != "independent")
    def step(batch: torch.Tensor) -> None:
        if case == "crash" and rank == 1:
            raise ValueError("bug on rank 1")
        opt.zero_grad()
        model(batch).square().mean().backward()
        opt.step()

    if case == "straggler" and rank == 1:
        # never takes the step: rank 0 must give up after the group's timeout (4 s), then
        # waits for this rank at the closing barrier (under the same timeout: not much longer)
        time.sleep(5)
        return {"error": None, "seconds": 0.0}
    start = time.monotonic()
    batch = torch.randn(8 - 2 * rank if case == "unequal" else 8, 8)
    try:
        with inject_oom(phase="forward") if rank == 1 and case not in ("static graph", "fsdp") else contextlib.nullcontext():
            step(batch)
        step(batch)
    except (ValueError, autobatch.AutobatchError) as error:
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "ooms": step.stats.ooms, "micro": step.stats.micro_batch_size}


def test_guarded_step_error_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    zero, one = run_ranks(_guarded_failures, 2, tmp_path, "crash", timeout=60)
    assert one["error"] == "ValueError: bug on rank 1"
    assert zero["error"].startswith("AutobatchError: rank 1 failed"), zero


def test_ddp_options_autobatch_would_bypass_are_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_guarded_failures, 2, tmp_path, "static graph", timeout=60)
    for result in results:
        assert "static_graph=True" in result["error"], result
        assert "sync_ranks=False" in result["error"], result


def test_fsdp_is_refused_on_every_rank_rather_than_left_to_hang(tmp_path: Path) -> None:
    results = run_ranks(_guarded_failures, 2, tmp_path, "fsdp", timeout=60)
    for result in results:
        assert "runs an FSDP module" in result["error"], result


def test_unequal_batches_under_memory_pressure_stop_every_rank_clearly(tmp_path: Path) -> None:
    results = run_ranks(_guarded_failures, 2, tmp_path, "unequal", timeout=60)
    for result in results:
        assert "the ranks' batches differ in size (6 to 8 rows)" in result["error"], result


def test_guarded_step_gives_up_after_the_group_timeout_instead_of_hanging(tmp_path: Path) -> None:
    zero, _ = run_ranks(_guarded_failures, 2, tmp_path, "straggler", timeout=60, pg_timeout=4)
    assert zero["error"].startswith("AutobatchError: rank 0: the other ranks did not reach"), zero
    assert zero["seconds"] < 10


def test_independent_ranks_recover_alone(tmp_path: Path) -> None:
    zero, one = run_ranks(_guarded_failures, 2, tmp_path, "independent", timeout=60)
    assert (zero["ooms"], zero["micro"]) == (0, None)  # rank 0 never split its batches
    assert one["ooms"] == 1
    assert one["micro"] is not None


def _scaler_with_inf_on_one_rank(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in model.parameters()]

    @autobatch.retry_on_oom(optimizer=opt, scaler=scaler)
    def step(batch: torch.Tensor) -> None:
        opt.zero_grad()
        loss = model(batch).sum() * (float("inf") if rank == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    step(torch.randn(4, 8))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return {"unchanged": unchanged, "scale": float(scaler.get_scale())}


def test_gradscaler_skips_the_step_on_every_rank_when_one_rank_overflows(tmp_path: Path) -> None:
    # Under DDP alone the all-reduced gradients carry the inf to every rank; so must ours.
    results = run_ranks(_scaler_with_inf_on_one_rank, 2, tmp_path, timeout=60)
    assert results == [{"unchanged": True, "scale": 2.0}] * 2


def _own_accumulation(rank: int) -> dict[str, Any]:
    """The user's own gradient accumulation with DDP's no_sync(): autobatch reduces when DDP
    would, once per optimizer step."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for guarded in (False, True):
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        generator = torch.Generator().manual_seed(rank)
        batches = [torch.randn(4, 8, generator=generator) for _ in range(6)]

        def step(
            batch: torch.Tensor, last: bool,
            model: DistributedDataParallel = model, opt: torch.optim.Optimizer = opt,
        ) -> None:
            with contextlib.nullcontext() if last else model.no_sync():
                model(batch).square().mean().backward()
            if last:
                opt.step()
                opt.zero_grad()

        run = autobatch.retry_on_oom(step) if guarded else step
        for index, batch in enumerate(batches):
            run(batch, index % 3 == 2)
        out["guarded" if guarded else "plain"] = [
            p.detach().flatten().tolist() for p in model.parameters()
        ]
    return out


def test_users_own_no_sync_accumulation_is_respected(tmp_path: Path) -> None:
    zero, one = run_ranks(_own_accumulation, 2, tmp_path, timeout=60)
    assert zero["plain"] == one["plain"]
    assert zero["guarded"] == one["guarded"]
    torch.testing.assert_close(_flat(zero["guarded"]), _flat(zero["plain"]), rtol=1e-6, atol=1e-7)


def _ddp_batchnorm(rank: int) -> dict[str, Any]:
    """A conv net with BatchNorm: DDP broadcasts its buffers at the start of every forward, a
    collective the ranks must reach together even after an OOM on one of them."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    from autobatch.testing import inject_oom

    torch.manual_seed(0)
    model = DistributedDataParallel(WORKLOADS["conv"].model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(3)
    ]

    @autobatch.retry_on_oom(optimizer=opt)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BatchNorm in micro-batches
        for index, batch in enumerate(batches):
            phase = {0: "forward", 1: "backward"}.get(index) if rank == 1 else None
            with inject_oom(phase=phase) if phase else contextlib.nullcontext():
                step(batch)
    # (buffers are compared after one more forward: each rank's last forward updates its own
    # running statistics, which DDP replaces by rank 0's at the start of the next forward)
    syncing = model.require_forward_param_sync
    model.eval()  # (DDP broadcasts rank 0's buffers first; in eval BatchNorm keeps them)
    with torch.no_grad():
        model(batches[0][0][:2])
    params = [p.detach().double().flatten().tolist() for p in model.parameters()]
    buffers = [b.detach().double().flatten().tolist() for b in model.module.buffers()]
    return {"params": params, "ooms": step.stats.ooms, "syncing": syncing, "buffers": buffers}


def test_ddp_with_buffers_recovers_and_keeps_ranks_identical(tmp_path: Path) -> None:
    zero, one = run_ranks(_ddp_batchnorm, 2, tmp_path, timeout=60)
    assert zero["params"] == one["params"]
    assert one["ooms"] >= 1
    # DDP still broadcasts the buffers at its next forward (the guard used to leave
    # require_forward_param_sync off after its first step, and the statistics drifted apart)
    assert zero["syncing"] is one["syncing"] is True
    assert zero["buffers"]
    assert zero["buffers"] == one["buffers"]


def _manual_all_reduce(rank: int, phase: str) -> dict[str, Any]:
    """No DDP: the step averages the gradients itself with dist.all_reduce. An OOM on rank 1
    must not leave rank 0 waiting in that all-reduce."""
    import torch.distributed as dist

    from autobatch.testing import inject_oom

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 8, generator=generator) for _ in range(3)]

    def step(batch: torch.Tensor) -> None:
        opt.zero_grad()
        model(batch).square().mean().backward()
        for p in model.parameters():
            if p.grad is not None:  # (none in the early micro-batches of an accumulated batch)
                dist.all_reduce(p.grad)
                p.grad.div_(2)
        opt.step()

    out: dict[str, Any] = {}
    for name in ("plain", "guarded"):
        torch.manual_seed(0)
        model.load_state_dict(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).state_dict()
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        run = autobatch.retry_on_oom(step, optimizer=opt) if name == "guarded" else step
        for index, batch in enumerate(batches):
            inject = name == "guarded" and rank == 1 and index == 1
            with inject_oom(phase=phase) if inject else contextlib.nullcontext():
                run(batch)
        out[name] = [p.detach().flatten().tolist() for p in model.parameters()]
    return out


def test_the_steps_own_collectives_are_agreed_before_they_run(tmp_path: Path) -> None:
    for phase in ("forward", "backward"):
        zero, one = run_ranks(_manual_all_reduce, 2, tmp_path, phase, timeout=60, pg_timeout=20)
        assert zero["guarded"] == one["guarded"], phase
        torch.testing.assert_close(_flat(zero["guarded"]), _flat(zero["plain"]), rtol=1e-5, atol=1e-6)


# The finder under DistributedDataParallel ----------------------------------------------------

# (the exact allocator: what these tests check is the ranks' lockstep, not the caching model)
DDP_CASES = ("capacity", *PHASES)  # unequal devices; an OOM on rank 1 only, in each phase
ROWS = 96  # where a phase's OOM starts on rank 1


def _ddp_mlp() -> tuple[nn.Module, nn.Module]:
    """An MLP (a fresh one, the same on every rank) under DDP with small buckets: its backward
    all-reduces some gradients while later layers' are still being computed."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    inner = WORKLOADS["mlp"].model()
    return DistributedDataParallel(inner, bucket_cap_mb=0.1), inner


def _rank_limit(case: str, rank: int, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Rank ``rank``'s own limit in ``case`` besides its capacity: rank 1's OOM in a phase."""
    if case in PHASES and rank == 1:
        return oom_over(model, model[2], case, ROWS)  # (model[2]: the second linear layer)
    return contextlib.nullcontext()


def _ddp_capacity(case: str, rank: int) -> str:
    return CAPACITIES[rank] if case == "capacity" else CAPACITIES[0]


def _plain_ddp_loop(case: str, rank: int, n: int, steps: int = 3) -> str | None:
    """A user's own loop, fresh: DDP model and AdamW made on the simulated device of
    ``rank``'s capacity and limit, ``steps`` steps at batch ``n``; the error, if any."""
    with SimulatedGPU(_ddp_capacity(case, rank), allocator="exact"):
        model, inner = _ddp_mlp()
        opt = torch.optim.AdamW(model.parameters())
        done = 0
        try:
            with _rank_limit(case, rank, inner):
                while done < steps:
                    x, y = WORKLOADS["mlp"].sample(n)
                    opt.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    done += 1
        except torch.OutOfMemoryError as error:
            return f"step {done}: {str(error)[:18]}"
    return None


def _ddp_find(rank: int) -> dict[str, Any]:
    from autobatch._records._result import result_to_dict

    out: dict[str, Any] = {}
    sample = WORKLOADS["mlp"].sample(4)  # (host memory: the batches go to the device)
    for case in DDP_CASES:
        with SimulatedGPU(_ddp_capacity(case, rank), allocator="exact") as gpu:
            model, inner = _ddp_mlp()  # made on the device: DDP's buckets are counted
            opt = torch.optim.AdamW(model.parameters())
            x, y = WORKLOADS["mlp"].sample(4)  # a first step of training: AdamW's state,
            nn.functional.cross_entropy(model(x), y).backward()  # and DDP rebuilds its
            opt.step()  # buckets at the next forward (the first trial's)
            opt.zero_grad(set_to_none=True)
            del x, y
            before = gpu.allocated_bytes
            with _rank_limit(case, rank, inner) as fired:
                result = autobatch.search_batch_size(
                    model, sample, opt,
                    loss_fn=nn.functional.cross_entropy, headroom=0,
                )
            after = gpu.allocated_bytes
            flags = [model.require_backward_grad_sync, model.require_forward_param_sync]
            # DDP trains on after the search: its reducer averages a step's gradients
            x, y = WORKLOADS["mlp"].sample(8)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        n = result.max_batch_size
        out[case] = {
            "result": result_to_dict(result),
            "fired": sorted(set(fired or [])),
            "leak": after - before,
            "flags": flags,
            "trained": [p.detach().flatten().tolist()[:8] for p in model.parameters()],
            "n fits": _plain_ddp_loop(case, rank, n),
            # one more, with the tightest rank's capacity and limit on both ranks (so that
            # both run out at the same operator, and neither waits for the other)
            "n+1": _plain_ddp_loop(case, 1, n + 1),
        }
    return out


def test_finder_on_a_ddp_model_keeps_every_rank_in_step_whatever_runs_out_where(
    tmp_path: Path,
) -> None:
    zero, one = run_ranks(_ddp_find, 2, tmp_path, timeout=240, pg_timeout=60)
    for case in DDP_CASES:
        a, b = zero[case], one[case]
        a["result"].pop("device"), b["result"].pop("device")  # (each rank's own)
        assert a["result"] == b["result"], f"{case}: the ranks' results differ"
        n = a["result"]["max_batch_size"]
        edge = [t for t in a["result"]["trials"] if t["size"] == n + 1]
        assert edge, case  # one more was tried: it ran out on rank 1, the tightest
        assert edge[0]["error"] == "cuda_allocator (rank 1)", (case, edge)
        if case in PHASES:  # rank 1 ran out where asked, and nowhere else
            assert b["fired"] == [case], (case, b["fired"])
            assert n == ROWS, case
        assert a["n fits"] is None, (case, a["n fits"])
        assert b["n fits"] is None, (case, b["n fits"])
        assert a["n+1"] is not None, case
        assert "CUDA out of memory" in b["n+1"], (case, b["n+1"])
        assert a["leak"] == b["leak"] == 0, case
        assert a["flags"] == b["flags"] == [True, True], case
        assert a["trained"] == b["trained"], f"{case}: DDP no longer averages gradients"


def _ddp_refusals(rank: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for case in ("gradient_as_bucket_view", "static_graph", "comm hook", "sync_ranks=False"):
        torch.manual_seed(0)
        model = DistributedDataParallel(
            WORKLOADS["mlp"].model(), gradient_as_bucket_view=case == "gradient_as_bucket_view",
            static_graph=case == "static_graph",
        )
        if case == "comm hook":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        try:
            autobatch.find_max_batch(
                model, WORKLOADS["mlp"].sample(4), torch.optim.SGD, max_batch=64,
                loss_fn=nn.functional.cross_entropy, sync_ranks=case != "sync_ranks=False",
            )
        except autobatch.AutobatchError as error:
            out[case] = str(error)
        else:
            out[case] = None
    return out


def test_ddp_setups_a_trial_would_measure_wrongly_are_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    zero, one = run_ranks(_ddp_refusals, 2, tmp_path, timeout=90)
    assert zero == one
    assert "gradient_as_bucket_view=True" in zero["gradient_as_bucket_view"]
    assert "gradient_as_bucket_view=False" in zero["gradient_as_bucket_view"]  # the way out
    assert "static_graph=True" in zero["static_graph"]
    assert "communication hook" in zero["comm hook"]
    assert "sync_ranks=False cannot search a model wrapped in DistributedDataParallel" in (
        zero["sync_ranks=False"]
    )


def _ddp_alone(rank: int) -> dict[str, Any]:
    sample = WORKLOADS["mlp"].sample(4)
    with SimulatedGPU(CAPACITIES[1], allocator="exact"):
        model, _ = _ddp_mlp()  # DDP over a process group of one rank: its reducer runs
        result = autobatch.search_batch_size(
            model, sample, torch.optim.SGD, loss_fn=nn.functional.cross_entropy, headroom=0
        )
    n = result.max_batch_size
    return {"n": n, "fits": _fits_alone(n), "n+1": _fits_alone(n + 1)}


def _fits_alone(n: int) -> bool:
    with SimulatedGPU(CAPACITIES[1], allocator="exact"):
        model, _ = _ddp_mlp()
        opt = torch.optim.SGD(model.parameters())
        try:
            for _ in range(2):
                x, y = WORKLOADS["mlp"].sample(n)
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        except torch.OutOfMemoryError:
            return False
    return True


def test_finder_on_a_ddp_model_of_one_rank_runs_ddp_as_it_is(tmp_path: Path) -> None:
    (alone,) = run_ranks(_ddp_alone, 1, tmp_path, timeout=60)
    assert alone["fits"], alone
    assert not alone["n+1"], alone


def test_ddp_on_a_process_group_of_one_rank_is_searched_and_recovered_exactly(
    tmp_path: Path,
) -> None:
    """``torchrun --nproc_per_node 1``: DDP's reducer runs in every backward with one rank too.
    The finder used to fail on the trial after an OOM (the reducer left mid-reduction), and the
    guard refused DDP's own bucket writes; both now go through the ranks' agreement."""
    from autobatch.testing import SimulatedGPU, inject_oom

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1
    )
    try:
        def train(guarded: bool) -> list[torch.Tensor]:
            torch.manual_seed(0)
            model = nn.parallel.DistributedDataParallel(
                nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double()
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

            def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
                opt.zero_grad()
                nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
                opt.step()

            run = autobatch.retry_on_oom(step, optimizer=opt) if guarded else step
            generator = torch.Generator().manual_seed(1)
            for _ in range(3):
                batch = (torch.randn(8, 4, generator=generator, dtype=torch.float64),
                         torch.randint(0, 3, (8,), generator=generator))
                with inject_oom(batch_over=4) if guarded else contextlib.nullcontext():
                    run(batch)
            if guarded:
                assert run.stats.ooms >= 1  # type: ignore[attr-defined]
            return [p.detach().clone() for p in model.parameters()]

        for a, b in zip(train(False), train(True), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)

        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with SimulatedGPU("1MiB", allocator="exact", adopt=[model]):
            result = autobatch.search_batch_size(
                model, (torch.randn(4, 4), torch.randint(0, 3, (4,))), opt
            )  # (the default headroom: a trial after the one that ran out)
        assert result.max_batch_size > result.batch_size > 100
        assert any(not t.fits for t in result.trials)
    finally:
        dist.destroy_process_group()
