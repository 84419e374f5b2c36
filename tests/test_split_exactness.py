"""A split step is exact or refused: each pattern two audits found, as a named test.

The truth is the unsplit step in float64 (rtol 1e-9). "Refused" means an
:class:`~autobatch.AutobatchError` raised before any optimizer stepped, with every parameter,
buffer, optimizer and scheduler state as it was before the call. Most tests ask
:func:`autobatch.testing.check_split`, which runs the step split by injected OOMs in forward,
in backward after a gradient was folded (in an early piece and in the last), in the
optimizer's first step, and on the fast path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from autobatch import AutobatchError, oom_guard, retry_on_oom
from autobatch.testing import check_split, inject_oom

pytestmark = pytest.mark.usefixtures("float64")


def _model(seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))


def _data(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _refused(report: Any, match: str) -> None:
    """Refused under every schedule that ran, with the state as it was before the call."""
    ran = [s for s in report.schedules if s.fired]
    assert ran, report
    for schedule in ran:
        assert schedule.refusal is not None, report
        assert match in schedule.refusal, schedule.refusal
        assert not schedule.differences, report  # the state unchanged


# 1 -------------------------------------------------------------------------------------------


def test_1_gradients_accumulated_across_calls_are_kept_when_the_first_call_is_split() -> None:
    """The optimizer steps on every second call; the first call is split. Every later call
    used to drop what was accumulated (params off by 0.14)."""

    def train(model: nn.Module, split_at: set[int]) -> nn.Module:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

        def step(batch: Any, call: int) -> torch.Tensor:
            loss = _loss(model, batch) / 2
            loss.backward()
            if call % 2 == 1:
                opt.step()
                opt.zero_grad()
            return loss.detach()

        guarded = retry_on_oom(optimizer=opt)(step)
        for call in range(6):
            batch = _data(8, seed=call)
            if call in split_at:
                with inject_oom(batch_over=4):
                    guarded(batch, call)
            else:
                guarded(batch, call)
        return model

    truth = train(_model(), set())
    for split_at in ({0}, {1}, {0, 3}, {2, 4, 5}):
        got = train(_model(), split_at)
        for a, b in zip(truth.parameters(), got.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


# 2 -------------------------------------------------------------------------------------------


def test_2_gradients_assigned_after_autograd_grad_are_refused() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        opt.zero_grad()
        grads = torch.autograd.grad(_loss(model, batch), list(model.parameters()))
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g  # gradient surgery would go here
        opt.step()

    _refused(check_split(step, _data(), optimizer=opt, model=model), "set the gradient")


# 3 -------------------------------------------------------------------------------------------


def test_3_an_optimizer_fused_into_backward_is_exact_when_every_optimizer_is_given() -> None:
    """The PyTorch tutorial pattern: one optimizer per parameter, stepped and zeroed in a
    post-accumulate hook. Only the last micro-batch used to be applied."""
    model = _model()
    optimizers = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

    def hook(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    try:
        def step(batch: Any) -> None:
            _loss(model, batch).backward()

        report = check_split(step, _data(), optimizer=list(optimizers.values()), model=model)
        for schedule in report.schedules:
            if schedule.name == "fast_backward":
                # A whole batch that runs out of memory in backward after some parameters
                # stepped: refused (their update cannot be taken back), as documented.
                assert schedule.refusal is not None, report
                assert "updated the parameters" in schedule.refusal
            else:
                assert schedule.exact, report
        # and given only some of them, it is refused before any of them steps (on the fast
        # path, a whole batch that runs out in backward has stepped some already: refused too)
        report = check_split(step, _data(), optimizer=list(optimizers.values())[:2], model=model,
                             schedules=["forward", "backward", "backward_last", "fast_forward"])
        _refused(report, "not given")
    finally:
        for handle in handles:
            handle.remove()


# 4 -------------------------------------------------------------------------------------------


class _Trainer:
    """A step written as a method, its EMA reached through ``self``."""

    def __init__(self) -> None:
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.ema = torch.optim.swa_utils.AveragedModel(
            self.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        )

    def step(self, batch: Any) -> None:
        self.opt.zero_grad()
        _loss(self.model, batch).backward()
        self.opt.step()
        self.ema.update_parameters(self.model)


def test_4_an_ema_through_self_is_refused() -> None:
    trainer = _Trainer()
    report = check_split(trainer.step, _data(), optimizer=trainer.opt, model=trainer.model,
                         objects=[trainer.ema])
    _refused(report, "self.ema")


def test_4_a_dict_of_shadow_tensors_is_refused() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        with torch.no_grad():
            for name, p in model.named_parameters():
                shadow[name].mul_(0.9).add_(p, alpha=0.1)

    _refused(check_split(step, _data(), optimizer=opt, model=model, objects=[shadow]),
             "shadow[")


# 5 -------------------------------------------------------------------------------------------


def _scheduled(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "onecycle":
        sched: Any = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=6)
    else:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


@pytest.mark.parametrize("kind", ["steplr", "onecycle"])
def test_5_a_scheduler_given_steps_once_per_batch(kind: str) -> None:
    def train(split: bool) -> tuple[list[torch.Tensor], int]:
        model, opt, sched = _scheduled(kind)

        @retry_on_oom(optimizer=opt, scheduler=sched)
        def step(batch: Any) -> None:
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
            sched.step()

        for call in range(5):  # OneCycleLR raises past its total_steps
            with inject_oom(batch_over=3, times=None) if split else _nothing():
                step(_data(8, seed=call))
        return [p.detach().clone() for p in model.parameters()], sched.last_epoch

    (truth, epochs), (got, got_epochs) = train(False), train(True)
    assert got_epochs == epochs == 5
    for a, b in zip(truth, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
    model, opt, sched = _scheduled(kind)

    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        sched.step()

    assert check_split(step, _data(), optimizer=opt, model=model, scheduler=sched)


def test_5_a_scheduler_not_given_is_refused_before_it_steps() -> None:
    model, opt, sched = _scheduled("steplr")

    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        sched.step()

    report = check_split(step, _data(), optimizer=opt, model=model, objects=[sched])
    _refused(report, "scheduler=sched")
    assert sched.last_epoch == 0


def test_5_an_lr_changed_by_hand_is_refused() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        opt.param_groups[0]["lr"] *= 0.99

    _refused(check_split(step, _data(), optimizer=opt, model=model), "param_groups[0]['lr']")


# 6 -------------------------------------------------------------------------------------------


def test_6_batchnorm_statistics_keep_only_the_micro_batches_that_counted() -> None:
    """After a restart (an OOM in backward after a fold) the discarded micro-batches used to
    stay in the statistics (num_batches_tracked 5 vs 4)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (reported as a caveat, not also as a warning)
        report = check_split(step, _data(16), optimizer=opt, model=model)
    assert report.replayed, report  # (the replay; BatchNorm itself depends on the cut)
    assert not report
    assert "BatchNorm" in " ".join(report.notes)
    assert "BatchNorm" in " ".join(report.caveats)


# 7 -------------------------------------------------------------------------------------------


def test_7_gradients_only_a_learnable_temperature_outside_the_model_is_exact() -> None:
    model = _model()
    temperature = nn.Parameter(torch.tensor(0.5))

    @retry_on_oom(policy="accumulate", model=model)
    def gradients(batch: Any) -> None:
        nn.functional.cross_entropy(model(batch[0]) / temperature, batch[1]).backward()

    reference, ref_t = _model(), nn.Parameter(torch.tensor(0.5))
    batch = _data(8)
    nn.functional.cross_entropy(reference(batch[0]) / ref_t, batch[1]).backward()
    with inject_oom(batch_over=4, times=None):
        gradients(batch)
    assert gradients.stats.ooms >= 1
    assert temperature.grad is not None
    assert ref_t.grad is not None
    torch.testing.assert_close(temperature.grad, ref_t.grad, rtol=1e-9, atol=1e-15)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-15)


# 8 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["clamp", "scale"])
def test_8_a_gradient_hook_on_a_parameter_is_refused(hook: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn: Callable[[torch.Tensor], torch.Tensor] = (
        (lambda g: g.clamp(-0.01, 0.01)) if hook == "clamp" else (lambda g: g * 0.5)
    )
    handle = model[0].weight.register_hook(fn)
    try:
        def step(batch: Any) -> None:
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()

        _refused(check_split(step, _data(), optimizer=opt, model=model), "gradient hook")
    finally:
        handle.remove()


# 9 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", ["value", "norm", "both"])
def test_9_torchs_gradient_clipping_runs_in_every_piece_and_is_exact(clip: str) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        if clip in ("value", "both"):
            nn.utils.clip_grad_value_(model.parameters(), 0.05)
        if clip in ("norm", "both"):
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()

    assert check_split(step, _data(), optimizer=opt, model=model)


# 10 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", [False, True])
def test_10_a_gradscaler_step_is_exact_with_or_without_scaler(given: bool) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)

    def step(batch: Any) -> None:
        opt.zero_grad()
        scaler.scale(_loss(model, batch)).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    report = check_split(step, _data(), optimizer=opt, model=model, objects=[scaler],
                         **({"scaler": scaler} if given else {}))
    assert report, report


# 11 ------------------------------------------------------------------------------------------


def test_11_an_empty_batch_is_handed_to_the_loop_after_an_oom_too() -> None:
    seen: list[int] = []

    @retry_on_oom(policy="shrink")
    def step(x: torch.Tensor) -> None:
        if len(x) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        seen.append(len(x))

    batches = [torch.ones(0, 2), torch.ones(4, 2), torch.ones(0, 2), torch.ones(2, 2)]
    with oom_guard(batches) as guard:
        handed = []
        for batch in guard:
            handed.append(len(batch))
            step(batch)
    assert handed == [0, 4, 0, 2]  # the empty batch after the OOM is handed out too
    assert seen == [0, 2, 2, 0, 2]  # (the 4 rows ran as two pieces of the step)
    assert guard.stats.batches == 4


# 12 ------------------------------------------------------------------------------------------


def test_12_python_side_effects_run_once_per_piece_and_attempt_as_documented() -> None:
    """What the ledger cannot see: Python values and dropout masks. The README says so."""
    from pathlib import Path

    calls: list[int] = []
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        calls.append(len(batch[0]))
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()

    with inject_oom(batch_over=4):
        step(_data(8))
    assert calls == [8, 4, 4]  # the failed whole batch, then two pieces
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("What a split step cannot see", 1)[1].split("**Threads.**", 1)[0]
    assert "Python side effects" in section
    assert "Dropout" in section


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_refusals_leave_no_optimizer_step_behind() -> None:
    """Every refusal above comes before any optimizer step: the step count is 0."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = [0]
    opt.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    ema = {"w": torch.zeros(3)}

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        ema["w"].add_(1.0)

    before = [p.detach().clone() for p in model.parameters()]
    with inject_oom(batch_over=4), pytest.raises(AutobatchError, match=r"ema\['w'\]"):
        step(_data(8))
    assert steps[0] == 0
    assert torch.equal(ema["w"], torch.zeros(3))
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)


# check_split itself ----------------------------------------------------------------------------


def test_check_split_reports_nothing_on_an_exact_step_and_puts_everything_back() -> None:
    torch.set_default_dtype(torch.float32)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    def step(batch: Any) -> None:
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        sched.step()

    step(_data(8, seed=5))  # some optimizer state, a gradient left, a scheduler that moved
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    rng = torch.random.get_rng_state()
    report = check_split(step, _data(8), optimizer=opt, model=model, scheduler=sched)
    assert report, report
    assert all(s.fired and s.exact for s in report.schedules)
    assert report.refusal is None
    assert report.differences == []
    for a, b in zip(params, model.parameters(), strict=True):
        assert b.dtype == torch.float32
        assert torch.equal(a, b)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))
    assert all(torch.equal(v, opt.state[model[0].weight][k]) for k, v in state.items())
    assert sched.last_epoch == 1
    assert torch.equal(rng, torch.random.get_rng_state())


def test_check_split_reports_a_step_that_is_not_exact() -> None:
    """A mean scaled by the rows counted in Python (a number the rows cannot be followed
    into): every schedule reports the parameters and the optimizer state that differ."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        opt.zero_grad()
        (_loss(model, batch) * len(batch[0])).backward()
        opt.step()

    report = check_split(step, _data(), optimizer=opt, model=model)
    assert not report
    assert report.refusal is None
    assert any("parameter model.0.weight" in d for d in report.differences)
    with pytest.raises(AssertionError, match="NOT exact when split"):
        report.assert_exact()


def test_check_split_finds_case_1_across_an_accumulation_window() -> None:
    """The window's first call accumulates, the checked one steps: exact (``before=``)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    def step(batch: Any) -> None:
        x, y, last = batch
        (_loss(model, (x, y)) / 2).backward()
        if last:
            opt.step()
            opt.zero_grad()

    first, checked = (*_data(8, seed=3), False), (*_data(8, seed=4), True)
    assert check_split(step, checked, optimizer=opt, model=model, before=[first])


def test_check_split_finds_case_7_a_temperature_outside_the_model() -> None:
    model = _model()
    temperature = nn.Parameter(torch.tensor(0.5))

    def gradients(batch: Any) -> None:
        nn.functional.cross_entropy(model(batch[0]) / temperature, batch[1]).backward()

    report = check_split(gradients, _data(), model=model, policy="accumulate",
                         objects=[{"temperature": temperature}])
    assert report, report


def test_check_split_finds_case_12_a_python_counter() -> None:
    """What the ledger cannot see, check_split still reports: a counter in the step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {"n": 0}

    def step(batch: Any) -> None:
        calls["n"] += 1
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()

    report = check_split(step, _data(), optimizer=opt, model=model, objects=[calls])
    assert not report
    assert all(d.startswith("[") and "objects[0]['n']" in d for d in report.differences)


@pytest.mark.parametrize(
    ("loss", "reduction", "named"),
    [
        ("sum", "mean", "a sum over the batch's rows"),
        ("sum / 16", "mean", "a sum over the batch's rows"),
        ("mean", "sum", "a mean over the batch's rows"),
        ("sum + penalty", "sum", "a term without rows"),
    ],
)
def test_a_loss_of_another_kind_than_the_reduction_weighs_is_refused(
    loss: str, reduction: str, named: str
) -> None:
    """A sum over the rows whose micro-batches are weighed by their share of them (the
    default, a mean's), a mean added whole (``reduction='sum'``), and a penalty on the
    weights added to a sum (counted once per micro-batch): each trained silently on a wrong
    gradient (off by the number of micro-batches), and is refused now, the state unchanged."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        opt.zero_grad()
        x, y = batch
        per_row = nn.functional.cross_entropy(model(x), y, reduction="none")
        value = {
            "sum": per_row.sum(), "sum / 16": per_row.sum() / 16, "mean": per_row.mean(),
            "sum + penalty": per_row.sum() + sum(p.pow(2).sum() for p in model.parameters()),
        }[loss]
        value.backward()
        opt.step()

    _refused(check_split(step, _data(), optimizer=opt, model=model, reduction=reduction), named)


@pytest.mark.parametrize("loss", ["sum / numel", "sum('sum') / numel", "sum over columns, mean",
                                  "sum / len", "mean / 4"])
def test_a_mean_written_as_a_sum_divided_by_its_count_is_exact(loss: str) -> None:
    """``l.sum() / l.numel()`` over a loss per row and column is a mean (refused as a sum
    when the count followed was the rows only), as are the other ways to write one."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        opt.zero_grad()
        x, y = batch
        out = model(x)
        target = nn.functional.one_hot(y, 3).to(out.dtype)
        per = (out - target).pow(2)
        value = {
            "sum / numel": per.sum() / per.numel(),
            "sum('sum') / numel": nn.functional.mse_loss(out, target, reduction="sum") / per.numel(),
            "sum over columns, mean": per.sum(1).mean(),
            "sum / len": per.sum() / len(x),
            "mean / 4": per.mean() / 4,
        }[loss]
        value.backward()
        opt.step()

    check_split(step, _data(), optimizer=opt, model=model).assert_exact()
