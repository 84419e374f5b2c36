"""Tests for autobatch._sizing._trial: the peaks a trial reports, per operator and per phase."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from _models import Branchy
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autobatch._batch import resize_batch
from autobatch._memory._backends import memory_for
from autobatch._memory._measure import per_operator_possible
from autobatch._search import Trial, Verdicts
from autobatch._sizing._trial import TrialRunner
from autobatch._sizing._workload import TrainingStep, prime_optimizer
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS, mlp

CE = nn.functional.cross_entropy


def _runner(
    model: nn.Module, per_operator: bool = True, name: str = "mlp"
) -> tuple[Callable[[int], Trial], torch.optim.Optimizer]:
    """A trial runner on the current memory backend, with Adam's state already resident."""
    sample = WORKLOADS[name].sample(8)
    opt = torch.optim.Adam(model.parameters())
    prime_optimizer(opt)
    step = TrainingStep(model, opt, loss_fn=CE)

    def cleanup() -> None:
        step.forget()  # (the last loss, held as a loop holds it)
        model.zero_grad(set_to_none=True)

    runner = TrialRunner(
        lambda n: resize_batch(sample, n), step, memory_for("cpu"), cleanup=cleanup,
        per_operator=per_operator,
    )
    return runner, opt


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_operators_peaks_make_up_the_trials_peak(name: str) -> None:
    torch.manual_seed(0)
    model = WORKLOADS[name].model()
    with SimulatedGPU(2**40) as gpu:
        gpu.adopt(model)
        parted, opt = _runner(model, name=name)
        gpu.adopt(opt)
        whole, _ = _runner(model, per_operator=False, name=name)
        by_operator, by_phase = parted(8), whole(8)
    assert by_operator.peak_bytes is not None
    assert len(by_operator.parts) > 50  # one per operator dispatched, and a few more
    assert max(by_operator.parts) == by_operator.peak_bytes == by_phase.peak_bytes
    assert by_operator.phases == by_phase.phases
    assert max(by_operator.phases) == by_operator.peak_bytes
    assert by_phase.parts == ()


def test_two_small_trials_give_the_whole_bent_curve() -> None:
    """The MLP's peak grows faster at larger sizes (other operators take over): a line through
    the peaks at 2 and 8 misses by half at 1000. The maximum of the operators' own lines
    through the same two trials lands within a few samples."""
    torch.manual_seed(0)
    model = mlp()
    with SimulatedGPU(2**40) as gpu:
        gpu.adopt(model)
        runner, opt = _runner(model)
        gpu.adopt(opt)
        small, larger, large = runner(2), runner(8), runner(1000)
    assert large.peak_bytes is not None
    assert small.peak_bytes is not None
    assert larger.peak_bytes is not None
    assert len(small.parts) == len(larger.parts) == len(large.parts)

    def at_1000(a: int, b: int) -> float:
        return a + (b - a) * (1000 - 2) / (8 - 2)

    lines = max(at_1000(a, b) for a, b in zip(small.parts, larger.parts, strict=True))
    whole = at_1000(small.peak_bytes, larger.peak_bytes)
    assert whole < 0.6 * large.peak_bytes
    assert abs(lines - large.peak_bytes) <= 4 * 5632  # a few samples of its ~5.5 KiB each


def test_no_parts_without_statistics() -> None:
    runner, _ = _runner(mlp())  # the plain CPU: no statistics, no peaks
    outcome = runner(4)
    assert (outcome.peak_bytes, outcome.parts, outcome.phases) == (None, (), ())


def test_a_failing_trial_leaves_no_mode_or_hook_behind() -> None:
    modes = len(_get_current_dispatch_mode_stack())
    hooks = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    model = mlp()
    with SimulatedGPU("4MiB") as gpu:
        gpu.adopt(model)
        runner, opt = _runner(model)
        gpu.adopt(opt)
        assert runner(4).fits
        inside = len(_get_current_dispatch_mode_stack())
        failed = runner(100_000)
        assert len(_get_current_dispatch_mode_stack()) == inside
    assert not failed.fits
    assert failed.parts == ()
    assert len(_get_current_dispatch_mode_stack()) == modes
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == hooks


def test_operators_that_change_with_the_size_change_the_parts() -> None:
    """Another operator past 16 rows: the parts no longer line up (the search then fits the
    phases, which do)."""

    model = Branchy()
    with SimulatedGPU(2**40) as gpu:
        gpu.adopt(model)
        runner, opt = _runner(model)
        gpu.adopt(opt)
        small, large = runner(8), runner(32)
    assert len(small.parts) != len(large.parts)
    assert len(small.phases) == len(large.phases) == 2


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports
def test_compiled_models_get_no_operator_parts() -> None:
    """Compiled code runs eagerly under a dispatch mode: its memory would not be the compiled
    step's, so a compiled model (or submodule) is measured by phases only."""
    assert per_operator_possible(mlp())
    compiled = torch.compile(mlp())
    assert not per_operator_possible(compiled)
    assert not per_operator_possible(nn.Sequential(compiled))
    in_place = mlp()
    in_place.compile()
    assert not per_operator_possible(in_place)


@pytest.mark.parametrize("shape", [(8, 64, 1000), (64, 10), (4, 3, 16, 16)])
def test_the_stand_in_loss_keeps_at_least_what_a_cross_entropy_keeps(
    shape: tuple[int, ...],
) -> None:
    """Without a loss_fn or labels the stand-in must not be cheaper than a training loss: a
    language model's cross-entropy over its vocabulary keeps the log-probabilities."""
    from autobatch._sizing._workload import loss_of

    def peak(loss: Callable[[torch.Tensor], torch.Tensor]) -> int:
        with SimulatedGPU(2**40) as gpu:
            weight = torch.randn(shape[-1], shape[-1], requires_grad=True)
            logits = torch.randn(shape) @ weight
            gpu.reset_peak()
            loss(logits).backward()
        return gpu.peak_bytes

    def real(logits: torch.Tensor) -> torch.Tensor:
        flat = logits.flatten(0, -2)
        return CE(flat, torch.zeros(flat.shape[0], dtype=torch.long))

    assert peak(lambda out: loss_of(out, None, None)) >= peak(real)
    assert peak(lambda out: loss_of({"logits": out}, None, None)) >= peak(real)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_storage_curve_of_two_small_trials_gives_the_peak_at_any_size(name: str) -> None:
    """Each storage's bytes are a line in the batch size and each is rounded to 512 bytes:
    two small trials give the simulator's peak at any other size to the byte."""
    torch.manual_seed(0)
    model = WORKLOADS[name].model()
    with SimulatedGPU(2**40) as gpu:
        gpu.adopt(model)
        runner, _ = _runner(model, name=name)
        runner(2)
        curve = runner(8).curve
        assert curve is not None
        for size in (3, 77, 300):
            assert curve(size) == runner(size).peak_bytes


# Under a caching allocator: the steady state ------------------------------------------------

MiB = 1 << 20


def _growing_runner(steps_per_trial: int = 1) -> TrialRunner:
    """A trial whose k-th step at size n holds an n*k MiB tensor for a moment: every step
    needs a larger segment than the one before, so the reserved memory keeps growing."""
    steps = [0]  # of the current trial (the runner's cleanup starts every trial)

    def step(batch: torch.Tensor) -> None:
        steps[0] += 1
        torch.empty(len(batch) * steps[0] * MiB, dtype=torch.uint8).fill_(1)

    return TrialRunner(
        lambda n: torch.zeros(n, 1), step, memory_for("cpu"), steps_per_trial=steps_per_trial,
        per_operator=False, cleanup=lambda: steps.__setitem__(0, 0),
    )


def test_a_trial_steps_until_the_reserved_memory_stops_growing() -> None:
    from autobatch._sizing._trial import CACHING_STEPS, MAX_STEADY_STEPS

    with SimulatedGPU("1GiB", allocator="caching"):
        runner = _growing_runner()
        grows = runner(10)  # 10, 20, ..., 80 MiB: a new segment every step
        steady = TrialRunner(
            lambda n: torch.zeros(n, 1),
            lambda b: torch.empty(len(b) * MiB, dtype=torch.uint8).fill_(1),
            memory_for("cpu"), per_operator=False,
        )(10)
    assert grows.fits
    # the steps of a loop a size must survive, then three more while the reserved peak grew
    assert grows.steps == CACHING_STEPS + MAX_STEADY_STEPS == 8
    # every segment stays cached (the batches, 512-byte blocks, share a 2 MiB small segment)
    assert grows.reserved_bytes == (sum(range(10, 90, 10)) + 2) * MiB
    assert grows.peak_bytes == 80 * MiB + 512  # the last step's tensor, the largest
    assert steady.fits
    assert steady.steps == CACHING_STEPS  # every later step reused the first one's segment
    assert (steady.peak_bytes, steady.reserved_bytes) == (10 * MiB + 512, 12 * MiB)


def test_a_later_step_that_runs_out_fails_the_trial() -> None:
    with SimulatedGPU("64MiB", allocator="caching") as gpu:
        failed = _growing_runner()(25)  # 25, then 50 (25 released), then 75: no room
        assert gpu.num_alloc_retries >= 2
    with SimulatedGPU("64MiB", allocator="exact"):  # the exact model: one step, as asked
        exact = _growing_runner()(25)
    assert not failed.fits
    assert failed.error is not None
    assert exact.fits
    assert exact.steps == 1
    assert exact.reserved_bytes is None


def test_a_later_curve_that_replays_the_same_storages_replays_no_size_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trials at 2, 8 and 32 create and free the same storages (lines in the size) from the
    same layout: the curves of the last two are one function, so what the second worked out
    the third answers without a replay of its own, and alike."""
    from autobatch._memory._allocator import CachingAllocator

    torch.manual_seed(0)
    model = WORKLOADS["mlp"].model()
    replayed: list[int] = []
    replay = CachingAllocator.replay

    def counted(
        self: CachingAllocator, events: Iterable[tuple[int, int]]
    ) -> tuple[int, int] | None:
        replayed.append(1)
        return replay(self, events)

    monkeypatch.setattr(CachingAllocator, "replay", counted)
    with SimulatedGPU("64MiB", allocator="caching") as gpu:
        gpu.adopt(model)
        runner, _ = _runner(model)
        runner(2)
        second = runner(8).curve
        assert isinstance(second, Verdicts)
        sizes = range(10, 300, 7)
        verdicts = [second.peak_at(n) for n in sizes]
        assert any(v is not None for v in verdicts)
        third = runner(32).curve
        assert isinstance(third, Verdicts)
        assert third is not second
        replayed.clear()
        assert [third.peak_at(n) for n in sizes] == verdicts
    assert not replayed


def test_every_trial_starts_from_an_empty_cache() -> None:
    with SimulatedGPU("64MiB", allocator="caching") as gpu:
        runner = _growing_runner()
        first = runner(10)
        assert gpu.reserved_bytes > 0  # the first trial's segments stay cached...
        second = runner(10)
    assert (second.steps, second.reserved_bytes) == (first.steps, first.reserved_bytes)
