"""The OOM-recovery engine and its front-ends, retry_on_oom and oom_guard.

Without a simulated GPU the CPU backend keeps no statistics, so sizes halve: those tests pin the
exact sequence of sizes. Under SimulatedGPU the memory model chooses sizes, and the tests check the
outcome (math, memory, number of retries) rather than the sizes.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import runpy
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from torch import nn

from autobatch import AutobatchError, BatchSizeError
from autobatch._recovery import (
    RecoveryStats,
    RetryingStep,
    SizeChange,
    oom_guard,
    retry_on_oom,
)
from autobatch._recovery._sizes import _Sizes
from autobatch.testing import SimulatedGPU, inject_oom
from autobatch.testing.models import TinyTransformer, conv_net

ROOT = Path(__file__).resolve().parent.parent


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


class Device:
    """A fake device: a call with more than ``limit`` rows raises a real OOM; records sizes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sizes: list[int] = []

    def check(self, n: int) -> None:
        self.sizes.append(n)
        if n > self.limit:
            raise _oom()


# --------------------------------------------------------------------------------------------
# The decorator's forms and options


def test_bare_and_called_forms_keep_metadata_and_options() -> None:
    device = Device(limit=5)

    @retry_on_oom
    def bare(batch: torch.Tensor) -> torch.Tensor:
        """Bare doc."""
        device.check(len(batch))
        return batch.mean()

    @retry_on_oom(min_batch=4, grow_after=3, reduction="sum", policy="shrink")
    def called(batch: torch.Tensor) -> torch.Tensor:
        """Called doc."""
        device.check(len(batch))
        return batch.sum()

    assert isinstance(bare, RetryingStep)
    assert isinstance(called, RetryingStep)
    assert (bare.__name__, bare.__doc__) == ("bare", "Bare doc.")
    assert (called.__name__, called.__doc__) == ("called", "Called doc.")
    assert called.__wrapped__.__name__ == "called"  # type: ignore[attr-defined]
    assert (called.options.min_batch, called.options.grow_after) == (4, 3)
    assert (called.options.reduction, called.options.policy) == ("sum", "shrink")
    assert bare.options.policy == "shrink"
    assert bare.options.min_batch == 1

    assert float(bare(torch.arange(16.0))) == 7.5  # halving: 16, 8, 4 then pieces of 4
    assert device.sizes == [16, 8, 4, 4, 4, 4]
    device.sizes.clear()
    device.limit = 2  # the option survives: min_batch=4 stops the halving at 4
    with pytest.raises(BatchSizeError) as caught:
        called(torch.ones(16))
    assert device.sizes == [16, 8, 4]
    assert caught.value.batch_size == 4
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


def test_options_are_validated() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="by name"):
        retry_on_oom(opt)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="needs the optimizer"):
        retry_on_oom(policy="accumulate")
    with pytest.raises(ValueError, match="policy"):
        retry_on_oom(policy="halve")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_batch"):
        retry_on_oom(min_batch=0)
    with pytest.raises(ValueError, match="headroom"):
        retry_on_oom(headroom=1.5)
    with pytest.raises(ValueError, match="batch_arg='data'"):
        retry_on_oom(batch_arg="data")(lambda batch: batch)
    assert retry_on_oom(optimizer=opt)(lambda b: b).options.policy == "accumulate"


def test_batch_arg_by_name_positional_and_keyword() -> None:
    device = Device(limit=3)

    @retry_on_oom(batch_arg="batch")
    def step(scale: float, batch: torch.Tensor, *, tag: str = "") -> torch.Tensor:
        device.check(len(batch))
        return batch * scale

    assert step(2.0, torch.arange(6.0)).tolist() == [0, 2, 4, 6, 8, 10]
    assert step(1.0, batch=torch.arange(6.0), tag="x").tolist() == [0, 1, 2, 3, 4, 5]
    assert device.sizes == [6, 3, 3, 3, 3]  # the learned size is reused by the second call
    with pytest.raises(TypeError, match="without its batch"):
        step(1.0)  # type: ignore[call-arg]


def test_methods_skip_self() -> None:
    device = Device(limit=2)

    class Trainer:
        @retry_on_oom
        def step(self, batch: list[int]) -> list[int]:
            device.check(len(batch))
            return [v * 10 for v in batch]

    assert Trainer().step([1, 2, 3, 4]) == [10, 20, 30, 40]
    assert device.sizes == [4, 2, 2]


# --------------------------------------------------------------------------------------------
# Splitting, results, errors


def test_results_of_pieces_are_joined() -> None:
    device = Device(limit=2)

    @retry_on_oom
    def step(batch: dict[str, Any]) -> dict[str, Any]:
        device.check(len(batch["ids"]))
        x = batch["x"]
        return {
            "loss": x.mean(),
            "logits": x * 2,
            "count": len(batch["ids"]),
            "names": [f"n{i}" for i in batch["ids"]],
            "tag": "same",
            "nothing": None,
        }

    out = step({"x": torch.arange(5.0), "ids": [0, 1, 2, 3, 4], "epoch": 7})
    assert device.sizes == [5, 2, 2, 1]  # halved to 2, then balanced pieces
    assert torch.allclose(out["loss"], torch.tensor(2.0))  # the whole batch's mean
    assert out["logits"].tolist() == [0, 2, 4, 6, 8]
    assert out["count"] == 5
    assert out["names"] == ["n0", "n1", "n2", "n3", "n4"]
    assert (out["tag"], out["nothing"]) == ("same", None)

    @retry_on_oom(reduction="sum")
    def summed(batch: torch.Tensor) -> torch.Tensor:
        device.check(len(batch))
        return batch.sum()

    assert float(summed(torch.ones(6))) == 6.0

    @retry_on_oom
    def odd(batch: torch.Tensor) -> object:
        device.check(len(batch))
        return object()

    assert isinstance(odd(torch.ones(4)), list)  # results that cannot be joined: the list


def test_non_oom_error_propagates_unchanged_and_is_not_retried() -> None:
    calls = []
    error = ValueError("shapes do not match")

    @retry_on_oom
    def step(batch: torch.Tensor) -> None:
        calls.append(len(batch))
        raise error

    with pytest.raises(ValueError, match="shapes do not match") as caught:
        step(torch.ones(8))
    assert caught.value is error
    assert calls == [8]

    lookalike = RuntimeError("CUDA error: an illegal memory access was encountered")

    @retry_on_oom
    def crash(batch: torch.Tensor) -> None:
        calls.append(len(batch))
        raise lookalike

    with pytest.raises(RuntimeError) as caught_rt:
        crash(torch.ones(8))
    assert caught_rt.value is lookalike
    assert calls == [8, 8]


def test_oom_at_batch_one_raises_batch_size_error() -> None:
    @retry_on_oom
    def step(batch: torch.Tensor) -> None:
        raise _oom()

    with pytest.raises(BatchSizeError, match="micro-batch of 1") as caught:
        step(torch.ones(1))
    assert caught.value.batch_size == 1
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert caught.value.__cause__.__traceback__ is None  # no frame (no tensor) is kept


def test_batch_size_error_reports_bytes_on_a_simulated_gpu() -> None:
    model = nn.Linear(64, 64)

    @retry_on_oom
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    x = torch.randn(64, 64)
    # byte-exact: room for the weights and not one row more (the caching model's smallest
    # segment is 2 MiB)
    with (
        SimulatedGPU(17_000, allocator="exact", adopt=[model]),
        pytest.raises(BatchSizeError) as caught,
    ):
        step(x)
    assert caught.value.capacity_bytes == 17_000
    assert "simulated GPU" in str(caught.value)
    assert "KiB" in str(caught.value)


def test_eval_step_oom_leaves_the_train_step_alone() -> None:
    device = Device(limit=100)

    @retry_on_oom
    def train_step(batch: torch.Tensor) -> None:
        device.check(len(batch))

    @retry_on_oom
    def eval_step(batch: torch.Tensor) -> None:
        if len(batch) > 4:
            raise _oom()

    train_step(torch.ones(32))
    eval_step(torch.ones(32))
    train_step(torch.ones(32))
    assert eval_step.stats.ooms == 3
    assert eval_step.stats.micro_batch_size == 4
    assert train_step.stats.ooms == 0
    assert train_step.stats.micro_batch_size is None
    assert device.sizes == [32, 32]


def test_exception_is_left_before_retrying() -> None:
    """The retry runs outside the except block: nothing of the failed attempt is alive."""
    alive: list[int] = []

    class Tracked:
        def __init__(self) -> None:
            alive.append(1)

        def __del__(self) -> None:
            alive.pop()

    @retry_on_oom
    def step(batch: torch.Tensor) -> None:
        held = Tracked()  # a local of the failed frame, like `out` or `loss`
        if len(alive) > 1:
            raise AssertionError("the failed attempt's locals are still alive")
        if len(batch) > 2:
            raise _oom()
        del held

    step(torch.ones(8))
    assert alive == []


def test_logging_one_info_line_per_size_change(caplog: pytest.LogCaptureFixture) -> None:
    device = Device(limit=3)

    @retry_on_oom
    def step(batch: torch.Tensor) -> None:
        device.check(len(batch))

    with caplog.at_level(logging.INFO, logger="autobatch.recovery"):
        step(torch.ones(16))
    lines = [r.getMessage() for r in caplog.records if r.name == "autobatch.recovery"]
    assert len(lines) == 3  # 16 -> 8 -> 4 -> 2
    assert "whole batch -> 8 (oom)" in lines[0]


def test_stats_are_frozen_records() -> None:
    stats = RecoveryStats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.ooms = 1  # type: ignore[misc]
    change = SizeChange(0, "f", None, 4, "oom")
    assert "reason='oom'" in repr(change)


# --------------------------------------------------------------------------------------------
# Batches with non-tensor leaves


def test_per_sample_lists_split_with_the_tensors() -> None:
    device = Device(limit=3)
    seen: list[tuple[list[str], list[float]]] = []

    @retry_on_oom
    def step(batch: dict[str, Any]) -> None:
        device.check(len(batch["x"]))
        seen.append((list(batch["ids"]), batch["x"].tolist()))
        assert batch["epoch"] == 3

    ids = [f"s{i}" for i in range(7)]
    step({"x": torch.arange(7.0), "ids": ids, "epoch": 3})
    for piece_ids, values in seen:
        assert piece_ids == [f"s{int(v)}" for v in values]
    assert [i for piece_ids, _ in seen for i in piece_ids] == ids


def test_unsplittable_batches_give_a_clear_error() -> None:
    @retry_on_oom
    def step(batch: Any) -> None:
        if not isinstance(batch, dict) or "names" in batch:
            raise _oom()

    with pytest.raises(AutobatchError, match="cannot split") as caught:  # (at the first call)
        step({"x": torch.zeros(8, 2), "names": ["a", "b", "c"]})  # 3 names for 8 rows
    assert "batch dimension 0 differs" in str(caught.value)
    with pytest.raises(AutobatchError, match="cannot split"):
        step(12)
    step({"x": torch.zeros(8, 2)})  # (runs whole)
    with pytest.raises(AutobatchError, match="cannot split") as caught:  # (at its OOM, later)
        step({"x": torch.zeros(8, 2), "names": ["a", "b", "c"]})
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


# --------------------------------------------------------------------------------------------
# Exact math under "accumulate"


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
    )


def _transformer() -> nn.Module:
    return TinyTransformer(vocab=50, d_model=16, heads=2, layers=1, classes=5, dropout=0.0)


def _batches(kind: str, count: int = 3, size: int = 96) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        xs = [torch.randn(size, 16, generator=g) for _ in range(count)]
    else:
        xs = [torch.randint(0, 50, (size, 12), generator=g) for _ in range(count)]
    return [(x, torch.randint(0, 5, (size,), generator=g)) for x in xs]


class Run:
    """A training run: a model, an optimizer, optionally a scaler, and a step function."""

    def __init__(
        self,
        factory: Callable[[], nn.Module],
        optimizer: str,
        *,
        scaler: bool = False,
        clip: float | None = None,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.model = factory()
        if optimizer == "adamw":
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=1e-2, weight_decay=0.1
            )
        else:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
        self.clip = clip
        self.steps = 0
        self.opt.register_step_post_hook(lambda *_: setattr(self, "steps", self.steps + 1))

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.opt.zero_grad()
        loss = nn.functional.cross_entropy(self.model(batch[0]), batch[1])
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
        else:
            loss.backward()
        if self.clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        return loss

    def state(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.model.parameters()]
        for entry in self.opt.state.values():
            out += [v for v in entry.values() if isinstance(v, torch.Tensor)]
        return out


Allocator = Literal["exact", "caching"]

#: Rows per batch, under both allocator models. The MLP's whole batch must outgrow the caching
#: model's 2 MiB small-pool segment for its peak to exceed a quarter batch's (at 96 rows both
#: reserve that one segment, and no capacity between them splits the batch).
ROWS = {"mlp": 4096, "transformer": 96}


def _peak(
    factory: Callable[[], nn.Module], optimizer: str, batch: Any, allocator: Allocator
) -> int:
    """The memory a steady step takes from the device at its highest: its segments under the
    caching model, its allocated bytes under the exact one (which reserves what it allocates)."""
    run = Run(factory, optimizer)
    with SimulatedGPU("1GiB", allocator=allocator, adopt=[run.model, run.opt]) as gpu:
        run.step(batch)
        run.step(batch)  # steady state: the optimizer state exists
        gpu.reset_peak()
        run.step(batch)
    return gpu.peak_reserved_bytes


def _capacity(
    factory: Callable[[], nn.Module], optimizer: str, batch: Any, allocator: Allocator
) -> int:
    """Between the peaks of a quarter batch and the whole batch: the whole batch does not fit."""
    n = len(batch[0])
    small = _peak(factory, optimizer, (batch[0][: n // 4], batch[1][: n // 4]), allocator)
    full = _peak(factory, optimizer, batch, allocator)
    assert full > small * 1.2
    return (small + full) // 2


def _assert_same(a: Run, b: Run) -> None:
    """Parameters and optimizer state agree to rtol 1e-10, and so do the step counts.

    The absolute tolerance is 1e-10 of each tensor's largest value: the key part of attention's
    ``in_proj_bias`` has a gradient that is zero in exact arithmetic (softmax ignores a constant
    per query), so both runs move it by rounding noise that Adam normalises (about 1e-12 here).
    """
    sa, sb = a.state(), b.state()
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb, strict=True):
        atol = 1e-10 * float(x.abs().max()) if x.numel() else 0.0
        assert torch.allclose(x, y, rtol=1e-10, atol=atol), (x - y).abs().max()
    assert a.steps == b.steps


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("allocator", ["exact", "caching"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("workload", ["mlp", "transformer"])
def test_accumulate_matches_an_uninterrupted_run(
    workload: str, optimizer: str, allocator: Allocator
) -> None:
    factory = _mlp if workload == "mlp" else _transformer
    batches = _batches(workload, size=ROWS[workload])
    capacity = _capacity(factory, optimizer, batches[0], allocator)

    reference = Run(factory, optimizer)
    ref_losses = [float(reference.step(b).detach()) for b in batches]

    run = Run(factory, optimizer)
    step = retry_on_oom(optimizer=run.opt)(run.step)
    with (
        SimulatedGPU(capacity, allocator=allocator, adopt=[run.model, run.opt]),
        oom_guard(batches) as guard,
    ):
        losses = [step(b).item() for b in guard]

    assert guard.stats.ooms >= 1
    assert guard.stats.micro_batch_size is not None
    assert guard.stats.batches == len(batches)
    assert guard.stats.samples == 3 * ROWS[workload]
    _assert_same(reference, run)
    assert losses == pytest.approx(ref_losses, rel=1e-12)  # the full-batch loss


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("allocator", ["exact", "caching"])
def test_accumulate_with_grad_scaler_and_clipping_matches(allocator: Allocator) -> None:
    batches = _batches("mlp", size=ROWS["mlp"])
    capacity = _capacity(_mlp, "adamw", batches[0], allocator)
    reference = Run(_mlp, "adamw", scaler=True, clip=0.5)
    for b in batches:
        reference.step(b)
    run = Run(_mlp, "adamw", scaler=True, clip=0.5)
    step = retry_on_oom(optimizer=run.opt, scaler=run.scaler)(run.step)
    with SimulatedGPU(capacity, allocator=allocator, adopt=[run.model, run.opt]):
        for b in batches:
            step(b)
    assert step.stats.ooms >= 1
    _assert_same(reference, run)
    assert run.scaler is not None
    assert reference.scaler is not None
    assert run.scaler.get_scale() == reference.scaler.get_scale()
    assert run.scaler._get_growth_tracker() == reference.scaler._get_growth_tracker()


@pytest.mark.usefixtures("float64")
def test_grad_scaler_inf_check_covers_the_whole_batch_once() -> None:
    """One bad sample in one piece skips the whole step and halves the scale once."""
    x, y = _batches("mlp", count=1, size=32)[0]
    x[29] = float("inf")  # lands in the last piece
    reference = Run(_mlp, "sgd", scaler=True)
    reference.step((x, y))
    run = Run(_mlp, "sgd", scaler=True)
    unscales: list[int] = []
    assert run.scaler is not None
    real_unscale = run.scaler._unscale_grads_
    run.scaler._unscale_grads_ = lambda *a: unscales.append(1) or real_unscale(*a)  # type: ignore[method-assign]
    device = Device(limit=10)

    @retry_on_oom(optimizer=run.opt, scaler=run.scaler)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        device.check(len(batch[0]))
        return run.step(batch)

    step((x, y))
    assert device.sizes == [32, 16, 8, 8, 8, 8]
    assert unscales == [1]  # the inf check ran once, on the summed gradient
    assert run.steps == reference.steps == 0  # skipped, as in the uninterrupted run
    assert run.scaler.get_scale() == reference.scaler.get_scale() == 2.0**9  # type: ignore[union-attr]
    _assert_same(reference, run)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_oom_in_forward_and_backward_is_recovered_exactly(phase: str) -> None:
    batches = _batches("mlp", count=3, size=32)
    reference = Run(_mlp, "adamw")
    for b in batches:
        reference.step(b)
    run = Run(_mlp, "adamw")
    step = retry_on_oom(optimizer=run.opt)(run.step)
    step(batches[0])
    with inject_oom("cuda", phase=phase, at_op=3) as fault:
        step(batches[1])
    step(batches[2])
    assert fault.fired == 1
    assert step.stats.ooms == 1
    _assert_same(reference, run)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("at_op", [1, 5, 11])
def test_oom_in_first_optimizer_step_while_state_is_created(at_op: int) -> None:
    batches = _batches("mlp", count=2, size=32)
    reference = Run(_mlp, "adamw")
    for b in batches:
        reference.step(b)
    run = Run(_mlp, "adamw")
    step = retry_on_oom(optimizer=run.opt)(run.step)
    with inject_oom("cuda", phase="optimizer", at_op=at_op) as fault:
        step(batches[0])  # Adam creates exp_avg/exp_avg_sq here; some entries are half made
    step(batches[1])
    assert fault.fired == 1
    assert step.stats.ooms == 1
    _assert_same(reference, run)


@pytest.mark.parametrize("at_op", [1, 5])
def test_oom_inside_a_later_optimizer_step_is_a_clear_error(at_op: int) -> None:
    """After the first step, torch's optimizers update state in place before the parameters:
    an OOM inside the step may leave it partly applied, so it is reported, never retried."""
    run = Run(_mlp, "adamw")
    batch = _batches("mlp", count=1, size=16)[0]
    step = retry_on_oom(optimizer=run.opt)(run.step)
    step(batch)
    with (
        inject_oom("cuda", phase="optimizer", at_op=at_op),
        pytest.raises(AutobatchError, match=r"inside AdamW\.step\(\).*partly applied") as caught,
    ):
        step(batch)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert run.steps == 1  # not retried


def test_oom_after_the_optimizer_step_is_a_clear_error() -> None:
    run = Run(_mlp, "adamw")
    batch = _batches("mlp", count=1, size=16)[0]

    @retry_on_oom(optimizer=run.opt)
    def step_then_oom(b: Any) -> None:
        run.step(b)
        raise _oom()  # e.g. an EMA update after the optimizer step

    with pytest.raises(AutobatchError, match=r"after AdamW\.step\(\) had updated"):
        step_then_oom(batch)
    assert run.steps == 1


def test_oom_in_an_optimizer_autobatch_was_not_given_is_an_error() -> None:
    run = Run(_mlp, "sgd")
    step = retry_on_oom(policy="shrink")(run.step)
    with (
        inject_oom("cuda", phase="optimizer"),
        pytest.raises(AutobatchError, match=r"retry_on_oom\(optimizer="),
    ):
        step(_batches("mlp", count=1, size=8)[0])


def test_closure_optimizers_are_refused_when_split() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(x: torch.Tensor) -> None:
        if len(x) > 4:
            raise _oom()

        def closure() -> torch.Tensor:
            loss = model(x).sum()
            loss.backward()
            return loss

        opt.step(closure)

    with pytest.raises(AutobatchError, match="closure"):
        step(torch.ones(8, 4))


def test_scheduler_is_untouched_and_optimizer_patches_are_undone() -> None:
    run = Run(_mlp, "sgd")
    reference = Run(_mlp, "sgd")
    schedulers = [
        torch.optim.lr_scheduler.StepLR(r.opt, step_size=1, gamma=0.5) for r in (run, reference)
    ]
    wrapped_step = run.opt.step  # the scheduler's instance-level wrapper
    device = Device(limit=10)

    @retry_on_oom(optimizer=run.opt)
    def step(batch: Any) -> torch.Tensor:
        device.check(len(batch[0]))
        return run.step(batch)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail
        for b in _batches("mlp", count=3, size=32):
            step(b)
            reference.step(b)
            for s in schedulers:
                s.step()
    assert schedulers[0].last_epoch == schedulers[1].last_epoch == 3
    assert run.opt.param_groups[0]["lr"] == reference.opt.param_groups[0]["lr"]
    assert run.opt.step is wrapped_step
    assert "step" in vars(run.opt)
    assert run.steps == 3
    assert device.sizes.count(32) == 1


def test_batchnorm_warning_once_pointing_at_the_caller() -> None:
    model = conv_net(channels=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(x: torch.Tensor) -> None:
        if len(x) > 4:
            raise _oom()
        opt.zero_grad()
        model(x).mean().backward()
        opt.step()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(torch.randn(8, 3, 32, 32))
        step(torch.randn(8, 3, 32, 32))
    messages = [w for w in caught if "BatchNorm" in str(w.message)]
    assert len(messages) == 1
    assert messages[0].filename == __file__

    model.eval()

    @retry_on_oom(optimizer=opt, model=model)
    def eval_mode_step(x: torch.Tensor) -> None:
        if len(x) > 4:
            raise _oom()
        model(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eval_mode_step(torch.randn(8, 3, 32, 32))
    assert eval_mode_step.stats.ooms == 1
    assert not [w for w in caught if "BatchNorm" in str(w.message)]


@pytest.mark.usefixtures("float64")
def test_one_retry_where_halving_needs_two() -> None:
    """With statistics, the first OOM runs a measuring piece and sizes the rest from it.

    Byte-exact: the sizes follow from a capacity a third of the way between two allocated
    peaks (under the caching model, both sit in one 2 MiB segment)."""
    batch = _batches("mlp", count=1, size=384)[0]  # activations outweigh the weights
    run = Run(_mlp, "sgd")
    quarter = _peak(_mlp, "sgd", (batch[0][:96], batch[1][:96]), "exact")
    half = _peak(_mlp, "sgd", (batch[0][:192], batch[1][:192]), "exact")
    capacity = quarter + (half - quarter) // 3  # a half batch does not fit, a quarter does
    step = retry_on_oom(optimizer=run.opt)(run.step)
    with SimulatedGPU(capacity, allocator="exact", adopt=[run.model, run.opt]):
        step(batch)
        step(batch)
    history = step.stats.history
    assert step.stats.ooms == 1
    assert (history[0].old, history[0].new, history[0].reason) == (None, 384 // 8, "oom")
    assert [c.reason for c in history[1:]] == ["refine"] * (len(history) - 1)
    assert step.stats.micro_batch_size is not None
    assert 96 <= step.stats.micro_batch_size < 192


@pytest.mark.usefixtures("float64")
def test_memory_taken_later_shrinks_pieces_without_an_oom() -> None:
    # The exact model: its limit is the capacity, which the test lowers mid-run (the caching
    # model's allocator keeps the limit it was made with)
    batch = _batches("mlp", count=1, size=96)[0]
    capacity = _capacity(_mlp, "sgd", batch, "exact")
    run = Run(_mlp, "sgd")
    step = retry_on_oom(optimizer=run.opt)(run.step)
    with SimulatedGPU(capacity, allocator="exact", adopt=[run.model, run.opt]) as gpu:
        for _ in range(3):
            step(batch)  # learns the size with one OOM, then fits a line to the pieces
        before = step.stats.micro_batch_size
        ooms = step.stats.ooms
        gpu.capacity_bytes = capacity - (capacity - gpu.allocated_bytes) // 4  # another process
        step(batch)
    assert ooms == 1
    assert step.stats.ooms == 1  # no new OOM: the pieces were sized to the free memory
    assert before is not None
    assert step.stats.micro_batch_size is not None
    assert step.stats.micro_batch_size < before


def test_tensors_of_a_failed_attempt_in_a_reference_cycle_are_freed() -> None:
    """free_memory collects garbage: tensors of the failed attempt that sit in a reference cycle
    are gone after the recovery, not whenever the collector happens to run."""

    @retry_on_oom
    def step(batch: torch.Tensor) -> None:
        buffer = torch.empty(len(batch), 1024)  # 4 KiB per row
        if len(batch) > 16:
            held: dict[str, Any] = {"buffer": buffer}
            held["self"] = held  # a cycle: only the garbage collector frees it
            raise _oom()

    gc.disable()
    try:
        with SimulatedGPU("4MiB") as gpu:
            step(torch.zeros(64))
            left = gpu.allocated_bytes
    finally:
        gc.enable()
    assert step.stats.ooms >= 1
    assert left == 0


# --------------------------------------------------------------------------------------------
# Shapes that vary: padded sequences


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("allocator", ["exact", "caching"])
def test_longer_sequences_cost_at_most_one_retry_and_shorter_ones_grow_again(
    allocator: Allocator,
) -> None:
    def tokens(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 50, (64, length)), torch.randint(0, 5, (64,))

    run = Run(_transformer, "sgd")
    step = retry_on_oom(optimizer=run.opt)(run.step)
    short_peak = _peak(_transformer, "sgd", tokens(8), allocator)
    long_peak = _peak(_transformer, "sgd", tokens(32), allocator)
    capacity = (short_peak + long_peak) // 2  # length 8 fits whole, length 32 does not

    oom_per_batch = []
    sizes = []
    with SimulatedGPU(capacity, allocator=allocator, adopt=[run.model, run.opt]):
        for length in [8, 8, 32, 32, 8, 48, 32]:
            before = step.stats.ooms
            step(tokens(length))
            oom_per_batch.append(step.stats.ooms - before)
            sizes.append(step.stats.micro_batch_size)
    assert oom_per_batch[:2] == [0, 0]
    assert oom_per_batch[2] == 1  # the first long batch: one retry
    assert oom_per_batch[3] == 0  # the next long batch starts at the learned size
    assert oom_per_batch[4] == 0
    assert sizes[4] is None
    assert oom_per_batch[5] <= 1  # a still longer one: at most one retry
    assert oom_per_batch[6] == 0
    assert sizes[5] is not None
    assert sizes[2] is not None
    assert sizes[5] < sizes[2]


# --------------------------------------------------------------------------------------------
# Growing back


def test_grow_back_after_transient_pressure() -> None:
    device = Device(limit=64)

    @retry_on_oom(grow_after=2)
    def step(batch: torch.Tensor) -> None:
        device.check(len(batch))

    for call in range(8):
        device.limit = 20 if 1 <= call <= 2 else 64
        step(torch.ones(64))
    assert device.sizes == [
        64,  # call 0
        64,
        32,
        16,
        16,
        16,
        16,  # call 1: pressure, 64 -> 32 -> 16
        16,
        16,
        16,
        16,  # call 2: clean call 1
        16,
        16,
        16,
        16,  # call 3: pressure gone; clean call 2
        32,
        32,  # call 4: grow to 32
        32,
        32,  # call 5: clean call 2 at 32
        64,  # call 6: grow to the whole batch
        64,  # call 7
    ]
    reasons = [c.reason for c in step.stats.history]
    assert reasons == ["oom", "oom", "grow", "grow"]
    assert step.stats.grows == 2
    assert step.stats.failed_grows == 0


def test_failed_grows_back_off_and_never_oscillate() -> None:
    device = Device(limit=20)

    @retry_on_oom(grow_after=1)
    def step(batch: torch.Tensor) -> None:
        device.check(len(batch))

    for _ in range(60):
        step(torch.ones(64))
    stats = step.stats
    assert stats.failed_grows == stats.grows  # 32 never fits
    assert stats.failed_grows == 5
    grow_calls = [c.step for c in stats.history if c.reason == "grow"]
    assert grow_calls == [2, 5, 10, 19, 36]  # clean calls waited between: 1, 2, 4, 8, 16
    assert {c.new for c in stats.history if c.reason == "grow failed"} == {16}


def test_sizes_after_oom_never_reach_the_failed_size() -> None:
    sizes = _Sizes(min_batch=1, grow_after=None, headroom=0.1)
    sizes.record("k", 10, 8, cost=8_000)
    sizes.record("k", 10, 16, cost=16_000)
    # The model says 89 rows fit in 100_000 free bytes; 64 failed anyway: its points are stale.
    old, new, reason = sizes.after_oom("k", 10, 64, room=100_000)
    assert (old, reason) == (None, "oom")
    assert new == 64 // 8
    assert sizes.states["k"].refine
    assert not [p for p in sizes.points if p[0] == "k"]
    old, new, _ = sizes.after_oom("k", 10, 8, room=None)
    assert (old, new) == (8, 4)  # no statistics: halve


def test_a_rough_refinement_reaches_at_most_four_times_the_measured_piece() -> None:
    """One measured piece gives a rough model (its bytes per row, its segments' share): the
    refinement after it stops at 4 times that piece, however much room the model sees; once
    three sizes fit a line, the model's size stands."""
    sizes = _Sizes(min_batch=1, grow_after=None, headroom=0.0)
    _, new, _ = sizes.after_oom("k", 1, 1024, room=10_000_000)  # (no model: a measuring piece)
    assert new == 128
    sizes.record("k", 1, 128, cost=128 * 1000)
    assert sizes.after_piece("k", 1, 128, room=900_000) == (128, 512)  # the model said 900
    for n in (256, 384):
        sizes.record("k", 1, n, cost=n * 1000)
    assert sizes.after_piece("k", 1, 512, room=900_000) == (512, 900)  # fitted: no reach


def test_many_equal_pieces_keep_the_fitted_model() -> None:
    """Points are kept per distinct size: a long run of equal pieces (balanced splits) must not
    push the other sizes out and turn a fitted model back into a rough one."""
    sizes = _Sizes(min_batch=1, grow_after=None, headroom=0.0)
    for n in (8, 16, 24):
        sizes.record("k", 1, n, cost=1000 + 100 * n)
    for _ in range(200):
        sizes.record("k", 1, 32, cost=1000 + 100 * 32)
    found = sizes.model("k")
    assert found is not None
    model, fitted = found
    assert fitted
    assert (model.fixed, model.per_sample) == pytest.approx((1000, 100))
    assert len(sizes.points) == 4


# --------------------------------------------------------------------------------------------
# The guard


def test_guard_shrink_rechunks_in_order_and_carries_the_rest_of_a_batch() -> None:
    device = Device(limit=5)
    seen: list[int] = []

    @retry_on_oom
    def step(batch: dict[str, Any]) -> None:
        device.check(len(batch["ids"]))
        seen.extend(batch["ids"])
        if 17 in batch["ids"]:
            device.limit = 1  # more pressure in the middle of batch 1

    loader = [
        {"x": torch.zeros(n), "ids": list(range(start, start + n))}
        for start, n in [(0, 12), (12, 12), (24, 7)]
    ]
    yielded = []
    with oom_guard(loader) as guard:
        for batch in guard:
            yielded.append(batch["ids"])
            step(batch)
    assert seen == list(range(31))
    assert [len(ids) for ids in yielded] == [12, 3, 3, 3, 1, 1, 1] + [1] * 7
    # Batch 0 went whole (the step split it 12 -> 6 -> 3); batch 1 came in pieces of 3 until a
    # piece failed (the step split it), and the rest of batch 1 came at the new size.
    assert yielded[3] == [18, 19, 20]
    assert yielded[4:7] == [[21], [22], [23]]
    assert device.sizes == [12, 6, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1] + [1] * 7
    assert guard.stats.samples == 31
    assert guard.stats.batches == 3
    assert guard.stats.micro_batch_size == 1
    assert guard.stats.ooms == 3
    assert [(c.step, c.old, c.new, c.reason) for c in guard.stats.history] == [
        (0, None, 6, "oom"),
        (0, 6, 3, "oom"),
        (1, 3, 1, "oom"),
    ]


def test_guard_accumulate_yields_whole_batches_and_splits_from_the_start() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = Device(limit=8)

    @retry_on_oom(optimizer=opt)
    def step(batch: torch.Tensor) -> None:
        device.check(len(batch))
        opt.zero_grad()
        model(batch).mean().backward()
        opt.step()

    def loader() -> Iterator[torch.Tensor]:
        for _ in range(5):
            yield torch.randn(32, 4)

    with oom_guard(loader()) as guard:
        lengths = []
        for batch in guard:
            lengths.append(len(batch))
            step(batch)
    assert lengths == [32] * 5
    assert guard.stats.ooms == step.stats.ooms == 2  # 32 and 16 once, then 8 from the start
    assert device.sizes[:3] == [32, 16, 8]
    assert set(device.sizes[3:]) == {8}
    assert guard.stats.micro_batch_size == 8


def test_guard_with_a_dataloader() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(20.0), torch.arange(20))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    device = Device(limit=3)
    seen: list[int] = []

    @retry_on_oom
    def step(batch: list[torch.Tensor]) -> None:
        device.check(len(batch[0]))
        seen.extend(batch[1].tolist())

    with oom_guard(loader) as guard:
        for batch in guard:
            step(batch)
    assert seen == list(range(20))
    assert guard.stats.samples == 20


def _undecorated_loop(loader: list[Any], error: BaseException) -> None:
    with oom_guard(loader) as guard:
        for _batch in guard:
            raise error


def test_oom_escaping_an_undecorated_body_is_a_clear_error() -> None:
    with pytest.raises(AutobatchError, match="retry_on_oom") as caught:
        _undecorated_loop([torch.ones(2)], _oom())
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


def test_guard_lets_other_errors_through_and_must_be_entered() -> None:
    error = KeyError("label")
    with pytest.raises(KeyError) as caught:
        _undecorated_loop([1, 2], error)
    assert caught.value is error
    with pytest.raises(RuntimeError, match="inside its with block"):
        list(oom_guard([1]))


# --------------------------------------------------------------------------------------------
# Memory


def _small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 5))


@pytest.mark.slow
@pytest.mark.usefixtures("float64")
def test_memory_returns_to_baseline_over_fifty_steps_with_ooms_and_grows() -> None:
    batch = _batches("mlp", count=1, size=64)[0]
    run = Run(_small_mlp, "sgd")
    pressure = [False]

    @retry_on_oom(optimizer=run.opt, grow_after=3)
    def step(b: Any) -> torch.Tensor:
        run.opt.zero_grad()
        loss = nn.functional.cross_entropy(run.model(b[0]), b[1])
        if pressure[0] and len(b[0]) > 40:
            # Pressure the memory model cannot see coming (fragmentation, another process
            # allocating mid-step), raised while the forward graph is alive.
            raise _oom()
        loss.backward()
        run.opt.step()
        return loss

    after: list[int] = []
    with SimulatedGPU("64MiB", adopt=[run.model, run.opt]) as gpu:
        for i in range(50):
            pressure[0] = i % 10 in (4, 5, 6)  # every 10 steps, 3 steps under pressure
            step(batch)
            after.append(gpu.allocated_bytes)  # no gc.collect(): nothing may wait for one
    assert step.stats.ooms >= 4  # (a failed grow keeps the smaller size that failed before)
    assert step.stats.grows >= 5
    assert len(set(after[1:])) == 1, after  # params + grads + momentum, nothing else
    assert run.steps == 50


# --------------------------------------------------------------------------------------------
# The example


def test_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "train_with_guard.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "ooms=" in out
    assert "shrinks=" in out


def test_recovery_keeps_the_users_peak_statistic() -> None:
    """Micro-batches reset the device's peak counter to learn their cost; afterwards it reads
    what the device really reached, the user's own earlier peak included.

    The exact model: under a caching allocator the peak is left as the last micro-batch's
    measurement (``PeakKeeping`` would otherwise reserve a segment to reach it again)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    with SimulatedGPU("4MiB", allocator="exact") as gpu:
        gpu.adopt(model, opt)
        with torch.no_grad():
            big = torch.empty(3 * 2**20, dtype=torch.uint8)  # the user's own high point
        del big
        theirs = gpu.peak_bytes
        step((torch.randn(4096, 64), torch.randint(0, 10, (4096,))))  # runs out, recovers
        assert step.stats.ooms >= 1  # type: ignore[attr-defined]
        assert gpu.peak_bytes >= theirs


def test_a_list_of_per_row_dicts_is_never_split_along_its_features() -> None:
    """Uncollated samples (a slice of a Hugging Face dataset): dimension 0 of their tensors is
    a feature, not a row. Run whole while they fit; refused clearly when they would be split."""
    rows = [{"x": torch.randn(8), "label": torch.tensor(i % 2)} for i in range(6)]
    seen: list[int] = []

    @retry_on_oom
    def step(batch: list[dict[str, torch.Tensor]]) -> None:
        seen.append(batch[0]["x"].shape[0])
        if len(seen) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    step(rows)
    with pytest.raises(AutobatchError, match="default_collate"):
        step(rows)
    assert seen == [8, 8]  # never a piece with fewer features


def test_where_bytes_do_not_tell_the_segments_the_pieces_bisect() -> None:
    """On a 16 MiB device under the caching allocator, a tensor over 1 MiB needs a 20 MiB
    segment: pieces of more than 256 rows fail however few bytes they add. The cost model in
    bytes (in the room the measuring piece's segments leave) says 504 rows fit; after it
    misleads, the piece size halves the gap between the largest piece that ran and the
    smallest that failed (3 OOMs in the first two batches, was 12), and later batches run
    without any."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    batches = [(torch.randn(1024, 64), torch.randint(0, 10, (1024,))) for _ in range(4)]
    with SimulatedGPU("16MiB", adopt=[model, opt]):
        for batch in batches[:2]:
            step(batch)
        first = step.stats.ooms
        for batch in batches[2:]:
            step(batch)
    assert first <= 3
    assert step.stats.ooms == first
    assert step.stats.micro_batch_size == 256


def test_a_tensor_argument_with_the_batchs_rows_is_never_cut_silently() -> None:
    """``step(x, y)`` cuts only ``x``: a micro-batch would pair half of ``x`` with all of
    ``y`` (here ``(pred - y)`` broadcasts to a square: silently wrong, no error). The first
    call warns (class weights or a mask over positions can be as long as a batch by chance);
    a call whose batch must be cut is refused, the state as before it, also where the
    argument first appears in a later call and where it is the batch itself (``step(x, x)``).
    Arguments of another length and a batch of one row say nothing."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        opt.zero_grad()
        (model(x) - (x[:, :1] if y is None else y)).pow(2).mean().backward()
        opt.step()

    def state() -> list[torch.Tensor]:
        return [p.detach().clone() for p in model.parameters()]

    step = retry_on_oom(optimizer=opt)(body)
    x, y = torch.randn(16, 4), torch.randn(16)
    with pytest.warns(UserWarning, match=r"argument 'y' holds a tensor of shape \(16,\), as "
                      r"many rows as its batch \(argument 'x', 16 rows\)"):
        step(x, y)
    before = state()
    with inject_oom(phase="backward", at_op=2), pytest.raises(
        AutobatchError, match="argument 'y' holds a tensor of shape"
    ):
        step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, state(), strict=True))

    later = retry_on_oom(optimizer=opt)(body)
    later(x)  # (nothing beside the batch at the first call)
    before = state()
    with inject_oom(phase="backward", at_op=2), pytest.raises(AutobatchError, match="'y'"):
        later(x, y=torch.randn(16, 1))
    assert all(torch.equal(a, b) for a, b in zip(before, state(), strict=True))
    with inject_oom(phase="backward", at_op=2), pytest.raises(AutobatchError, match="'y'"):
        later(x, x)  # (the batch itself, not cut)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        retry_on_oom(optimizer=opt)(body)(x, torch.randn(1))  # (broadcast: fine)
        retry_on_oom(optimizer=opt)(body)(torch.randn(1, 4), torch.randn(1))  # (one row)

        @retry_on_oom(optimizer=opt)
        def whole(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            body(*batch)

        whole((x, torch.randn(16, 1)))
        with inject_oom(phase="backward", at_op=2):
            whole((x, torch.randn(16, 1)))  # (cut, both parts alike)


def test_a_bare_decorator_joins_each_result_along_its_rows_or_returns_the_pieces() -> None:
    """The rows of each result are followed through the first split: ``enc(x).T`` (8
    features, pieces of 8 rows: as long in both dimensions) is joined along its columns, on
    the first split and on later calls; a sum over the rows is added, not averaged; a max over
    them comes back as the pieces' values (averaging maxes gave a wrong number silently, and
    the transposed output came back (16, 8), its rows stacked as columns)."""
    torch.manual_seed(0)
    enc = nn.Linear(4, 8)

    @retry_on_oom
    def embed(x: torch.Tensor) -> dict[str, Any]:
        with torch.no_grad():
            z = enc(x)
            return {"features": z.T, "total": z.sum(), "top": z.max()}

    for call in range(2):
        x = torch.randn(16, 4)
        truth = embed.__wrapped__(x)
        with inject_oom(batch_over=8):
            out = embed(x)
        assert embed.stats.micro_batch_size == 8 or call
        torch.testing.assert_close(out["features"], truth["features"], msg=f"call {call}")
        torch.testing.assert_close(out["total"], truth["total"])
        assert isinstance(out["top"], list)
        assert max(out["top"]) == truth["top"]


def test_items_that_run_out_of_memory_on_the_whole_batch_are_counted_piece_by_piece() -> None:
    """A call split from the start counts ``items=`` over the whole batch first; where that
    count runs out of memory itself (its first operator), it is the sum of the pieces' counts
    (torch's raw OutOfMemoryError escaped), and the step stays exact."""
    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
        y[:7] = -100

        def train(guard: bool) -> list[torch.Tensor]:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

            def step(batch: Any) -> None:
                opt.zero_grad()
                nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
                opt.step()

            run = retry_on_oom(optimizer=opt, items=lambda b: (b[1] != -100).sum())(step) if (
                guard) else step
            run((x, y))
            if guard:
                with inject_oom(phase="forward", at_op=2):  # (learns pieces of 8)
                    run((x, y))
                with inject_oom(phase="forward", at_op=1) as fault:  # (the count's operator)
                    run((x, y))
                assert fault.fired == 1
            else:
                run((x, y))
                run((x, y))
            return [p.detach().clone() for p in model.parameters()]

        for a, b in zip(train(True), train(False), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)
