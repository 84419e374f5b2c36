"""FSDP2 (``fully_shard``) on 2 gloo ranks: the finder and the guard keep every rank in step.

The model is a small transformer sharded per block (each encoder layer, then the root), as
FSDP2 is meant to be used; each rank simulates its own GPU where memory matters.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _faults import PHASES, oom_over
from _ranks import run_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autobatch
from autobatch._memory._accounting import round_allocation
from autobatch._records._result import result_to_dict
from autobatch.testing import SimulatedGPU
from autobatch.testing._inject import OOM_KINDS
from autobatch.testing.models import TinyTransformer

pytestmark = pytest.mark.slow  # processes that talk to each other: seconds each

VOCAB, CLASSES, LENGTH = 50, 5, 8


class Fault:
    """Something that goes wrong on chosen calls of the middle block's first linear layer: an
    out-of-memory error (CUDA's own) in its forward (``"forward"``) or in the middle of the
    block's backward (``"backward"``: a hook on that layer's output runs once the layers after
    it in the block have their gradients), a bug (``"crash"``), or a rank that stops answering
    for ``sleep`` seconds (``"sleep"``)."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.at: set[int] = set()
        self.calls = 0
        self.fired = 0
        self.sleep = 0.0

    def arm(self, phase: str, at: set[int]) -> None:
        self.phase, self.at, self.calls = phase, at, 0

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.phase is None:
            return
        self.calls += 1
        if self.calls not in self.at:
            return
        if self.phase == "sleep":
            self.fired += 1
            time.sleep(self.sleep)
        elif self.phase == "crash":
            self.fired += 1
            raise ValueError("a bug on this rank")
        elif self.phase == "forward":
            self.fired += 1
            raise OOM_KINDS["cuda"]()
        else:

            def fail(grad: torch.Tensor) -> None:
                self.fired += 1
                raise OOM_KINDS["cuda"]()

            out.register_hook(fail)


class Collectives(TorchDispatchMode):
    """Counts the all-gathers and reduce-scatters dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"gather": 0, "scatter": 0}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if func.namespace == "c10d" and ("allgather" in name or "reduce_scatter" in name):
            self.counts["gather" if "allgather" in name else "scatter"] += 1
        return func(*args, **(kwargs or {}))


def _sharded(
    dtype: torch.dtype = torch.float64, fault: Fault | None = None, d_model: int = 16,
    **policies: Any,
) -> nn.Module:
    """A transformer (no dropout: micro-batches then draw no other random numbers) sharded
    per block, then at the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyTransformer(
        vocab=VOCAB, d_model=d_model, heads=2, layers=3, classes=CLASSES, dropout=0.0
    ).to(dtype)
    if fault is not None:
        model.encoder.layers[1].linear1.register_forward_hook(fault)
    for layer in model.encoder.layers:
        fully_shard(layer, **policies)
    fully_shard(model, **policies)
    return model


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (n, LENGTH), generator=generator),
            torch.randint(0, CLASSES, (n,), generator=generator))


def _locals(tensors: Any) -> list[torch.Tensor]:
    """This rank's shards (copies) of DTensors; plain tensors as they are."""
    return [(t.to_local() if hasattr(t, "to_local") else t).detach().clone() for t in tensors]


# The finder ---------------------------------------------------------------------------------

CAPACITIES = ["1600KiB", "1300KiB"]  # rank 1 is the tighter


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    moments = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [*_locals([*model.parameters(), *grads, *moments]), torch.get_rng_state()]


def _default_step(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    """The finder's own trial step, by hand: zero_grad, forward, loss, backward, step."""
    opt.zero_grad(set_to_none=True)
    inputs, labels = _tokens(n, seed)
    nn.functional.cross_entropy(model(inputs), labels).backward()
    opt.step()


def _find(rank: int) -> dict[str, Any]:
    model = _sharded(torch.float32, d_model=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _default_step(model, opt, 4, 100 + rank)  # optimizer state exists,
    nn.functional.cross_entropy(model(_tokens(4, rank)[0]), _tokens(4, rank)[1]).backward()  # and gradients
    before = _state(model, opt)
    # what this rank holds: its shards of the parameters, gradients and optimizer state
    held, whole = {}, 0
    for t in [*model.parameters(), *(p.grad for p in model.parameters()),
              *(v for s in opt.state.values() for v in s.values())]:
        local = t.to_local() if hasattr(t, "to_local") else t
        held[local.untyped_storage()._cdata] = round_allocation(local.untyped_storage().nbytes())
        whole += t.numel() * t.element_size()  # (a DTensor's numel is the whole tensor's)
    with SimulatedGPU(CAPACITIES[rank], allocator="exact") as gpu:
        adopted = gpu.adopt(model, opt)
        allocated = gpu.allocated_bytes
        result = autobatch.search_batch_size(
            model, lambda n: _tokens(n, 7 + rank), opt, loss_fn=nn.functional.cross_entropy,
            headroom=0, max_batch=4096,
        )
        after = gpu.allocated_bytes
    exact = all(torch.equal(a, b) for a, b in zip(before, _state(model, opt), strict=True))
    same_objects = len(before) == len(_state(model, opt))
    n = result.max_batch_size
    # The answer checked by hand: n fits on both ranks, each with its own capacity ...
    for p in model.parameters():
        p.grad = None
    with SimulatedGPU(CAPACITIES[rank], allocator="exact") as gpu:
        gpu.adopt(model, opt)
        _default_step(model, opt, n, 1)
    # ... and n + 1 does not fit on the tighter rank (both ranks given its capacity: they run
    # out at the same operator, so neither waits in a collective for the other)
    failed = None
    with SimulatedGPU(CAPACITIES[1], allocator="exact") as gpu:
        gpu.adopt(model, opt)
        try:
            _default_step(model, opt, n + 1, 1)
        except torch.OutOfMemoryError as error:
            failed = str(error)[:40]
    if failed is not None:
        model.reset_iter_state()  # type: ignore[operator]
    return {
        "n": n, "recommended": result.batch_size, "sizes": [t.size for t in result.trials],
        "verdicts": [t.fits for t in result.trials], "exact": exact and same_objects,
        "allocated": [allocated, after], "n+1": failed,
        "adopted": [adopted, sum(held.values()), whole],
        "errors": [t.error for t in result.trials],
        "result": {k: v for k, v in result_to_dict(result).items() if k != "device"},
    }


def test_finder_agrees_on_the_tightest_ranks_exact_maximum_and_restores_everything(
    tmp_path: Path,
) -> None:
    zero, one = run_ranks(_find, 2, tmp_path, timeout=240, pg_timeout=60)
    assert zero["n"] == one["n"] == zero["recommended"] == one["recommended"]
    assert zero["sizes"] == one["sizes"]  # the same trials, in lockstep
    assert zero["verdicts"] == one["verdicts"]
    assert False in zero["verdicts"]  # some trial ran out of memory (on rank 1 only, by design)
    assert one["n+1"] is not None
    assert one["n+1"].startswith("CUDA out of memory"), one
    assert zero["n+1"] is not None  # (the same capacity: the same operator)
    # rank 0 learned of rank 1's OOM at a vote; both record the same trial, naming rank 1
    assert zero["errors"] == one["errors"]
    assert zero["errors"][zero["verdicts"].index(False)] == "cuda_allocator (rank 1)"
    assert zero["result"] == one["result"]  # the same record on every rank, trials included
    for rank in (zero, one):
        adopted, shards, whole = rank["adopted"]
        assert adopted == shards < 0.6 * whole  # a rank's memory holds its shards, about half
        assert rank["exact"], "parameters, gradients, optimizer state or RNG changed"
        assert rank["allocated"][0] == rank["allocated"][1], "the search leaked memory"


ROWS = 24  # where a phase's OOM starts on rank 1


def _fault(rank: int, phase: str, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Rank 1's OOM in ``phase`` for batches over :data:`ROWS` (in the middle block's first
    linear layer, or its optimizer step); nothing on rank 0."""
    if rank != 1:
        return contextlib.nullcontext()
    return oom_over(model, model.encoder.layers[1].linear1, phase, ROWS)  # type: ignore[index]


def _fresh(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh sharded model and AdamW after a first step of training (its state made)."""
    model = _sharded(torch.float32, d_model=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _default_step(model, opt, 4, 100 + rank)
    opt.zero_grad(set_to_none=True)
    return model, opt


def _plain_loop(rank: int, phase: str, n: int) -> str | None:
    """A user's own loop on ``rank``'s limits, fresh: 2 steps at batch ``n``; the error."""
    model, opt = _fresh(rank)
    with SimulatedGPU(CAPACITIES[0], allocator="exact") as gpu:
        gpu.adopt(model, opt)
        try:
            with _fault(rank, phase, model):
                for seed in range(2):
                    _default_step(model, opt, n, seed)
        except torch.OutOfMemoryError as error:
            model.reset_iter_state()  # type: ignore[operator]
            return str(error)[:18]
    return None


def _find_with_a_fault(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in PHASES:
        model, opt = _fresh(rank)
        with SimulatedGPU(CAPACITIES[0], allocator="exact") as gpu:
            gpu.adopt(model, opt)
            with _fault(rank, phase, model) as fired:
                result = autobatch.search_batch_size(
                    model, lambda n: _tokens(n, 7 + rank), opt,
                    loss_fn=nn.functional.cross_entropy, headroom=0, max_batch=4096,
                )
        n = result.max_batch_size
        out[phase] = {
            "result": {k: v for k, v in result_to_dict(result).items() if k != "device"},
            "fired": sorted(set(fired or [])),
            "n fits": _plain_loop(rank, phase, n),
            "n+1": _plain_loop(1, phase, n + 1),  # rank 1's limit on both: the same operator
        }
    return out


def test_finder_keeps_every_rank_in_step_when_one_runs_out_in_any_phase(tmp_path: Path) -> None:
    zero, one = run_ranks(_find_with_a_fault, 2, tmp_path, timeout=300, pg_timeout=60)
    for phase in PHASES:
        a, b = zero[phase], one[phase]
        assert a["result"] == b["result"], f"{phase}: the ranks' results differ"
        assert a["result"]["max_batch_size"] == ROWS, phase
        edge = [t for t in a["result"]["trials"] if t["size"] == ROWS + 1]
        assert edge, phase
        assert edge[0]["error"] == "cuda_allocator (rank 1)", (phase, edge)
        assert b["fired"] == [phase], (phase, b["fired"])
        assert a["n fits"] is None, (phase, a["n fits"])
        assert b["n fits"] is None, (phase, b["n fits"])
        assert a["n+1"] == b["n+1"] == "CUDA out of memory", phase


def _refusals(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, FullyShardedDataParallel

    out: dict[str, Any] = {}
    sample = _tokens(2, rank)
    # a trial that fails on rank 1 with an error that is not an OOM stops every rank
    fault = Fault()
    model = _sharded(torch.float32, fault=fault)
    if rank == 1:
        fault.arm("crash", {2})  # the second trial's forward
    with SimulatedGPU("64MiB"):
        try:
            autobatch.find_max_batch(model, sample, torch.optim.SGD,
                                     loss_fn=nn.functional.cross_entropy, max_batch=64)
        except (ValueError, autobatch.AutobatchError) as error:
            out["find crash"] = f"{type(error).__name__}: {error}"
    for name in ("fsdp1", "offload", "independent"):
        if name == "fsdp1":
            model: nn.Module = FullyShardedDataParallel(
                TinyTransformer(vocab=VOCAB, d_model=16, layers=1, classes=CLASSES),
                device_id=torch.device("cpu"),
            )
        elif name == "offload":
            model = _sharded(torch.float32, offload_policy=CPUOffloadPolicy(pin_memory=False))
        else:
            model = _sharded(torch.float32)
        with SimulatedGPU("64MiB"):
            try:
                autobatch.find_max_batch(
                    model, sample, torch.optim.SGD, loss_fn=nn.functional.cross_entropy,
                    max_batch=8, sync_ranks=name != "independent",
                )
            except autobatch.AutobatchError as error:
                out[f"find {name}"] = str(error)
        if name == "fsdp1":  # the guard too, on every rank
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            @autobatch.retry_on_oom(optimizer=opt)
            def step(
                batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module = model,
                opt: torch.optim.Optimizer = opt,
            ) -> None:
                opt.zero_grad()
                nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
                opt.step()

            try:
                step(sample)
            except autobatch.AutobatchError as error:
                out["guard fsdp1"] = str(error)
    return out


def test_finder_stops_every_rank_on_a_bug_and_refuses_what_it_cannot_keep_in_step(
    tmp_path: Path,
) -> None:
    zero, one = run_ranks(_refusals, 2, tmp_path, timeout=120)
    assert one["find crash"] == "ValueError: a bug on this rank"
    assert zero["find crash"].startswith("AutobatchError: rank 1 failed during the trial"), zero
    for result in (zero, one):
        assert "FullyShardedDataParallel (FSDP1)" in result["find fsdp1"], result
        assert "fully_shard" in result["find fsdp1"], result
        assert "FullyShardedDataParallel" in result["guard fsdp1"], result
        assert "fully_shard" in result["guard fsdp1"], result
        assert "CPUOffloadPolicy" in result["find offload"], result
        assert "sync_ranks=False cannot search" in result["find independent"], result


# The guard ----------------------------------------------------------------------------------

STEPS = 3


def _train(
    rank: int, phase: str | None = None, at: tuple[int, ...] = (), *, guarded: bool = True,
    policies: dict[str, Any] | None = None, sync_ranks: bool = True,
) -> dict[str, Any]:
    """Train for a few steps (float64, SGD with momentum and weight decay: linear in the
    gradients, so micro-batches change the result by rounding only); ``phase``/``at``: an OOM
    on rank 1 only, at the middle block's ``at``-th calls of the second batch."""
    fault = Fault()
    model = _sharded(fault=fault, **(policies or {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    batches = [_tokens(8, 10 * rank + i) for i in range(STEPS)]

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        return loss.detach()

    run = autobatch.retry_on_oom(step, optimizer=opt, sync_ranks=sync_ranks) if guarded else step
    error = None
    start = time.monotonic()
    counts = []
    stalled = start
    try:
        with autobatch.oom_guard(batches) if guarded else contextlib.nullcontext(batches) as loop:
            for index, batch in enumerate(loop):
                if index == 1:
                    stalled = time.monotonic()
                if phase is not None and index == 1 and rank == 1:
                    fault.arm(phase, set(at))
                    fault.sleep = 8.0
                with Collectives() as seen:
                    run(batch)
                counts.append(seen.counts)
                fault.phase = None
    except autobatch.AutobatchError as exc:
        error = str(exc)
    stats = run.stats if guarded else None  # type: ignore[attr-defined]
    return {
        "full": [p.full_tensor().flatten().tolist() for p in model.parameters()] if error is None else None,
        "local": [t.flatten().tolist() for t in _locals(model.parameters())],
        "fired": fault.fired, "error": error, "seconds": time.monotonic() - stalled,
        "collectives": counts,
        "ooms": None if stats is None else stats.ooms,
        "recomputed": None if stats is None else stats.samples_recomputed,
        "micro": None if stats is None else stats.micro_batch_size,
    }


# (phase, calls of the middle block that fail, what the recovery does)
FAULTS = [
    ("forward", (1,), "the whole batch fails; halves run, the second reduces"),
    ("backward", (1,), "the whole batch fails mid-backward"),
    ("forward", (1, 3), "the last piece fails in forward: the first piece's sum stays"),
    ("backward", (1, 3), "the last piece fails after its first reduce-scatter: start over"),
    ("backward", (1, 2), "the first piece fails in backward (smaller pieces, no-sync sums)"),
]


def _guard_runs(rank: int) -> dict[str, Any]:
    out = {"plain": _train(rank, guarded=False), "none": _train(rank)}
    for phase, at, _ in FAULTS:
        out[f"{phase} {at}"] = _train(rank, phase, at)
    return out


def _tensor(values: list[list[float]]) -> torch.Tensor:
    return torch.cat([torch.tensor(v, dtype=torch.float64) for v in values])


def test_guard_recovers_an_oom_on_one_rank_in_forward_and_backward_exactly(tmp_path: Path) -> None:
    zero, one = run_ranks(_guard_runs, 2, tmp_path, timeout=300)
    reference = _tensor(zero["plain"]["full"])
    assert zero["plain"]["full"] == one["plain"]["full"]
    for key, failures in [("none", 0), *((f"{phase} {at}", len(at)) for phase, at, _ in FAULTS)]:
        for rank, result in enumerate((zero, one)):
            assert result[key]["error"] is None, (key, rank, result[key]["error"])
            got = _tensor(result[key]["full"])
            # float64, relative 1e-9; the absolute 1e-15 covers elements that are 0 in exact
            # arithmetic, where the two summation orders leave different rounding noise
            torch.testing.assert_close(got, reference, rtol=1e-9, atol=1e-15, msg=f"{key} rank {rank}")
            mine = _tensor(result[key]["local"])
            theirs = _tensor((zero, one)[rank]["plain"]["local"])
            torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-15, msg=f"{key} shard {rank}")
        assert zero[key]["full"] == one[key]["full"], f"{key}: the ranks' parameters differ"
        assert zero[key]["ooms"] == one[key]["ooms"] == failures, key
        assert zero[key]["micro"] == one[key]["micro"]
        assert zero[key]["recomputed"] == one[key]["recomputed"]
        assert zero[key]["fired"] == 0
    assert one["forward (1,)"]["fired"] == one["backward (1,)"]["fired"] == 1
    # After the OOM the last batch runs in pieces from the start: each piece gathers the
    # parameters, and only the last reduces the gradients, once per group, as a whole batch does
    whole = zero["none"]["collectives"][2]
    for key in ("forward (1,)", "backward (1, 2)"):
        split = zero[key]["collectives"][2]
        assert split["scatter"] == whole["scatter"] == 4, (key, split, whole)  # 3 blocks + root
        assert split["gather"] >= 2 * whole["gather"], (key, split, whole)
    # An OOM while FSDP held the earlier pieces' unreduced gradients: from then on every piece
    # reduces its own (the sums then live in the sharded gradients), exactly all the same
    for key in ("forward (1, 3)", "backward (1, 3)"):
        split = zero[key]["collectives"][2]
        pieces = -(-8 // zero[key]["micro"])
        assert split["scatter"] == 4 * pieces > 4, (key, split, pieces)
    # the failed last piece's backward had reduced part of the batch: the batch started over
    assert one["backward (1, 3)"]["recomputed"] == 8 + 8
    assert one["forward (1, 3)"]["recomputed"] == 8 + 4  # its forward had added nothing


def _policies(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    mixed = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)}
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    out = {}
    for name, policies in (("mixed", mixed), ("offload", offload)):
        out[name] = _train(rank, guarded=False, policies=policies)
        out[name + " oom"] = _train(rank, "backward", (1, 3), policies=policies)
    return out


def test_guard_under_mixed_precision_and_cpu_offload(tmp_path: Path) -> None:
    zero, one = run_ranks(_policies, 2, tmp_path, timeout=240)
    for name, rtol, atol in (("mixed", 1e-5, 1e-7), ("offload", 1e-9, 1e-15)):
        assert zero[name + " oom"]["error"] is None, zero[name + " oom"]["error"]
        assert one[name + " oom"]["error"] is None, one[name + " oom"]["error"]
        assert zero[name + " oom"]["full"] == one[name + " oom"]["full"], name
        assert one[name + " oom"]["recomputed"] == 16, name  # the batch started over once
        # mixed: gradients in float32 (weighted per piece there), summed and reduced in float64
        # as FSDP does itself; a stale sum from the failed piece would be off by a gradient
        torch.testing.assert_close(
            _tensor(zero[name + " oom"]["full"]), _tensor(zero[name]["full"]),
            rtol=rtol, atol=atol, msg=name,
        )


def _straggler(rank: int) -> dict[str, Any]:
    result = _train(rank, "sleep", (1,))
    if rank == 0:
        time.sleep(4)  # (leave the stalled rank time to give up before the closing barrier)
    return result


def test_a_rank_that_stops_responding_makes_the_others_raise_within_the_group_timeout(
    tmp_path: Path,
) -> None:
    zero, one = run_ranks(_straggler, 2, tmp_path, timeout=90, pg_timeout=4)
    assert one["fired"] == 1
    assert zero["error"] is not None
    assert "did not reach the same point" in zero["error"], zero
    assert zero["seconds"] < 4 + 2.5, zero["seconds"]  # the group's timeout, once


def _independent(rank: int) -> dict[str, Any]:
    # an OOM on both ranks at the same point: each refuses alone, neither waits for the other
    fault = Fault()
    model = _sharded(fault=fault)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @autobatch.retry_on_oom(optimizer=opt, sync_ranks=False)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    fault.arm("forward", {1})
    try:
        step(_tokens(8, rank))
    except autobatch.AutobatchError as error:
        model.reset_iter_state()  # type: ignore[operator]
        return {"error": str(error)}
    return {"error": None}


def test_independent_ranks_are_refused_for_a_sharded_step(tmp_path: Path) -> None:
    for result in run_ranks(_independent, 2, tmp_path, timeout=90):
        assert "sync_ranks=False" in result["error"], result
        assert "FSDP2" in result["error"], result


def _one_rank(rank: int) -> dict[str, Any]:
    """FSDP2 under a process group of one rank: the finder cleans up after its failed trials;
    the guard, which keeps FSDP exact only through the ranks' agreement, refuses."""
    model = _sharded(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _default_step(model, opt, 4, 0)
    before = _state(model, opt)
    with SimulatedGPU("1MiB", allocator="exact") as gpu:
        gpu.adopt(model, opt)
        allocated = gpu.allocated_bytes
        result = autobatch.search_batch_size(
            model, lambda n: _tokens(n, 1), opt, loss_fn=nn.functional.cross_entropy,
            headroom=0, max_batch=4096,
        )
        after = gpu.allocated_bytes
    exact = all(torch.equal(a, b) for a, b in zip(before, _state(model, opt), strict=True))
    sharded = all(hasattr(p, "to_local") for p in model.parameters())  # (resharded)
    guard = _independent(1)
    return {"fits": [t.fits for t in result.trials], "allocated": [allocated, after],
            "exact": exact, "sharded": sharded, "guard": guard["error"]}


def test_one_rank_finder_cleans_up_and_guard_refuses(tmp_path: Path) -> None:
    (only,) = run_ranks(_one_rank, 1, tmp_path, timeout=90)
    assert False in only["fits"], only  # some trial ran out of memory part-way
    assert only["allocated"][0] == only["allocated"][1]
    assert only["exact"]
    assert only["sharded"]
    assert "FSDP2 on a single rank" in only["guard"], only


def test_torchrun_fsdp2_example_finds_and_trains_in_step_on_every_rank() -> None:
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         str(root / "examples" / "train_fsdp2_torchrun.py")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # (two processes share the pipe: their lines may run together, so match, don't split)
    found = dict(re.findall(
        r"rank (\d): (batch size \d+; 4 steps of \d+, [1-9]\d* OOM, micro-batch \d+; "
        r"parameter checksum -?\d+\.\d{10})", run.stdout,
    ))
    assert sorted(found) == ["0", "1"], run.stdout
    assert found["0"] == found["1"]


def test_a_backup_whose_storage_was_freed_since_is_not_written_back() -> None:
    """FSDP2 frees an unsharded parameter's storage after use (``resize_(0)``): putting back
    a copy taken before would write past the end of the storage (a crash, as a rank undoing
    its batch after another rank's OOM hit it). Such a tensor is skipped; the others are
    put back."""
    from autobatch._recovery._backups import Backups

    freed, kept = torch.arange(6.0), torch.arange(4.0)
    backups = Backups()
    backups.take(freed)
    backups.take(kept)
    freed.add_(1)
    kept.add_(1)
    freed.untyped_storage().resize_(0)
    backups.put_back()
    assert torch.equal(kept, torch.arange(4.0))
    assert freed.untyped_storage().nbytes() == 0
