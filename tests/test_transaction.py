"""One call of a decorated step is one transaction, whichever path it takes: a failed attempt
is undone the same way on the fast path (the whole batch, unwatched) and on the split path,
and nothing of torch stays replaced after a call.

The truth is the same loop unguarded, in float64. OOMs are injected in forward, in backward
after some gradients landed in ``.grad``, and in the optimizer's first step.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autobatch import AutobatchError, retry_on_oom
from autobatch._recovery import _patches
from autobatch.testing import inject_oom

pytestmark = pytest.mark.usefixtures("float64")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(call: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + call)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.backward = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch._C._current_autograd_node() is not None:
            self.backward += 1
        return func(*args, **(kwargs or {}))


def _late_backward_op() -> int:
    """The last operator of the model's backward: by then most gradients are in ``.grad``."""
    model = _model()
    with _Count() as count:
        _loss(model, _data(0)).backward()
    landed = []
    for at in (count.backward - 1, count.backward - 2):
        model.zero_grad()
        try:
            with inject_oom(phase="backward", at_op=at):
                _loss(model, _data(0)).backward()
        except RuntimeError:
            pass
        landed.append(sum(p.grad is not None for p in model.parameters()))
    assert 0 < landed[0] < len(list(model.parameters())), landed  # partial: the case under test
    return count.backward - 1


def _faults() -> dict[str, Callable[[], inject_oom]]:
    late = _late_backward_op()
    return {
        "forward": lambda: inject_oom(phase="forward", at_op=2),
        "backward after gradients landed": lambda: inject_oom(phase="backward", at_op=late),
        "first optimizer step": lambda: inject_oom(phase="optimizer", at_op=1),
    }


FAULTS = ["forward", "backward after gradients landed", "first optimizer step"]


def _train(
    make_step: Callable[[nn.Module, torch.optim.Optimizer], Callable[..., Any]],
    kind: str, fault: str | None, at_calls: set[int], calls: int = 5,
    options: Callable[[Any], dict[str, Any]] = lambda step: {},
) -> nn.Module:
    """The loop over ``calls`` batches, guarded (``retry_on_oom(optimizer=opt,
    **options(step))``) with ``fault`` at ``at_calls``, or unguarded without one."""
    model = _model()
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9) if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    )
    step = make_step(model, opt)
    guarded = retry_on_oom(optimizer=opt, **options(step))(step) if fault is not None else step
    faults = _faults() if fault is not None else {}
    for call in range(calls):
        batch = _data(call)
        if fault is not None and call in at_calls and (fault != "first optimizer step" or call == 0):
            with faults[fault]():  # (only a first step is retried: on call 0)
                guarded(batch)
        else:
            guarded(batch)
    return model


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def _zero_at_end(set_to_none: bool) -> Callable[..., Callable[..., Any]]:
    def make(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
        def step(batch: Any) -> torch.Tensor:
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            return loss.detach()

        return step

    return make


def _zero_at_start(set_to_none: bool) -> Callable[..., Callable[..., Any]]:
    def make(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
        def step(batch: Any) -> torch.Tensor:
            opt.zero_grad(set_to_none=set_to_none)
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    return make


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("at_calls", [{0}, {2}, {1, 3}])
def test_zero_grad_at_the_end_of_the_step_is_exact_after_an_oom(
    set_to_none: bool, kind: str, fault: str, at_calls: set[int]
) -> None:
    """The most common loop shape. An OOM in backward on a call that ran whole, after some
    gradients reached ``.grad``, used to keep that partial gradient and add the split's whole
    one to it (params off by 1.2e-1 with SGD)."""
    truth = _train(_zero_at_end(set_to_none), kind, None, set())
    _assert_same(_train(_zero_at_end(set_to_none), kind, fault, at_calls), truth)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("at_calls", [{0}, {2}, {1, 3}])
def test_zero_grad_at_the_start_of_the_step_is_exact_after_an_oom(
    set_to_none: bool, fault: str, at_calls: set[int]
) -> None:
    """``zero_grad(set_to_none=False)`` at the start zeroes the gradients the last call left in
    place: the same as dropping them, so it is exact (it used to be refused on every split)."""
    truth = _train(_zero_at_start(set_to_none), "adamw", None, set())
    _assert_same(_train(_zero_at_start(set_to_none), "adamw", fault, at_calls), truth)


def test_gradients_that_were_none_are_none_after_a_failed_attempt() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[list[bool]] = []

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        seen.append([p.grad is None for p in model.parameters()])
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

    step(_data(0))
    batch = _data(1)
    with _faults()["backward after gradients landed"]() as fault:
        step(batch)
    assert fault.fired == 1
    # call 0, the whole batch, then its two pieces: each began with no gradient at all
    assert len(seen) == 4
    assert all(all(nones) for nones in seen), seen


# Threads and torch's entry points -------------------------------------------------------------


def _accumulating(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
    """Steps the optimizer on every second call: gradients are carried across calls."""

    def step(batch: Any, call: int) -> torch.Tensor:
        loss = _loss(model, batch) / 2
        loss.backward()
        if call % 2 == 1:
            opt.step()
            opt.zero_grad()
        return loss.detach()

    return step


def _thread_run(seed: int, model: nn.Module, guarded: bool, oom_at: int | None,
                out: dict[int, Any], barrier: threading.Barrier | None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    step = _accumulating(model, opt)
    run = retry_on_oom(optimizer=opt)(step) if guarded else step
    try:
        for call in range(8):
            if barrier is not None:
                barrier.wait(timeout=30)
            batch = _data(call + seed)
            if call == oom_at:
                with inject_oom(phase="backward", at_op=3):
                    run(batch, call)
            else:
                run(batch, call)
        out[seed] = model
    except BaseException as error:  # (reported by the test)
        out[seed] = error


@pytest.mark.parametrize("oom", [False, True])
def test_two_threads_with_their_own_steps_are_independent_and_exact(oom: bool) -> None:
    """Two training loops in two threads, each carrying gradients across calls: with one
    replacement of torch.autograd.backward shared by the process, each thread's backward went
    through the other's (params off by 1.8e-1 with no OOM at all)."""
    truth: dict[int, Any] = {}
    for seed in (1, 2):
        _thread_run(seed, _model(seed), False, None, truth, None)
    got: dict[int, Any] = {}
    barrier = threading.Barrier(2)
    threads = [  # (models made here: torch's default generator is the process's)
        threading.Thread(target=_thread_run, args=(
            seed, _model(seed), True, 3 if oom and seed == 1 else None, got, barrier))
        for seed in (1, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for seed in (1, 2):
        assert isinstance(got[seed], nn.Module), got[seed]
        _assert_same(got[seed], truth[seed])
    assert _patches.replaced() == []



def _drops_first_until(
    keeps: set[int], fault: str | None, at_calls: set[int], calls: int = 10
) -> tuple[nn.Module, list[str]]:
    """A step that drops the gradients first (``zero_grad()``) on every call but those in
    ``keeps``, where it adds to the ones the last call left; returns the model and the
    refusals met (the loop goes on after one, as a user's would)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    keep = [False]

    def step(batch: Any) -> torch.Tensor:
        if not keep[0]:
            opt.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        opt.step()
        return loss.detach()

    guarded = retry_on_oom(optimizer=opt)(step) if fault is not None else step
    faults = _faults() if fault is not None else {}
    refusals = []
    for call in range(calls):
        keep[0] = call in keeps
        batch = _data(call)
        try:
            if fault is not None and call in at_calls:
                with faults[fault]():
                    guarded(batch)
            else:
                guarded(batch)
        except AutobatchError as exc:
            refusals.append(str(exc))
    return model, refusals


@pytest.mark.parametrize("fault", FAULTS[:2])
def test_a_step_that_stops_dropping_its_gradients_first_is_refused_then_kept_apart(
    fault: str,
) -> None:
    """After calls that drop the gradients first, the fast path stops keeping the carried ones
    apart from backward (that costs more than the step's own Python). A call that adds to
    them all the same and runs out of memory in backward after some gradients landed left
    that partial sum in them and trained on (params off by 7e-3): now it is refused, saying
    so, and a call that adds to them without running out of memory makes later calls keep
    them apart again, exact."""
    truth, _ = _drops_first_until({7}, None, set())
    got, refusals = _drops_first_until({7}, fault, {7})
    if fault == "forward":  # (nothing reached the gradients: exact)
        assert refusals == []
        _assert_same(got, truth)
    else:
        assert len(refusals) == 1
        assert "not kept apart" in refusals[0], refusals
        assert "stay changed" in refusals[0], refusals
    truth, _ = _drops_first_until({6, 8}, None, set())
    got, refusals = _drops_first_until({6, 8}, fault, {8})
    assert refusals == []
    _assert_same(got, truth)


def _split_step(model: nn.Module, opt: torch.optim.Optimizer, fail: str) -> Callable[..., Any]:
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)

    def step(batch: Any) -> torch.Tensor:
        loss = _loss(model, batch)
        scaler.scale(loss).backward()
        if fail == "error":
            raise ValueError("the step's own error")
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if fail == "refusal":
            sched.step()  # a scheduler not given: refused in an early piece
        opt.zero_grad()
        return loss.detach()

    return step


@pytest.mark.parametrize("fail", ["none", "refusal", "error"])
@pytest.mark.parametrize("carried", [False, True])
def test_torch_entry_points_are_torch_s_own_after_every_call(fail: str, carried: bool) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = retry_on_oom(optimizer=opt)(_split_step(model, opt, fail))
    for call in range(3):
        if carried:  # (gradients left by the caller: the fast path keeps them apart)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        batch = _data(call)
        try:
            if call == 1:
                with inject_oom(batch_over=4):
                    step(batch)
            else:
                step(batch)
        except (AutobatchError, ValueError) as error:
            raised: BaseException | None = error
        else:
            raised = None
        # (split at call 1 only: after a refusal the next batch runs whole again)
        expected = fail == "error" or (fail == "refusal" and call == 1)
        assert (raised is not None) == expected, (call, raised)
        assert _patches.replaced() == [], call


def test_torch_entry_points_are_torch_s_own_while_another_thread_s_step_runs() -> None:
    """A plain step on the fast path replaces nothing: another thread sees torch's own."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inside, go_on = threading.Event(), threading.Event()
    seen: list[bool] = []

    @retry_on_oom(optimizer=opt)
    def step(batch: Any, wait: bool) -> None:
        loss = _loss(model, batch)
        if wait:
            inside.set()
            go_on.wait(timeout=30)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step(_data(0), False)  # (the first call, watched)
    thread = threading.Thread(target=step, args=(_data(1), True))
    thread.start()
    assert inside.wait(timeout=30)
    seen.append(_patches.replaced() == [])
    go_on.set()
    thread.join(timeout=30)
    assert seen == [True]


def test_a_plain_step_in_one_thread_never_meets_another_thread_s_watched_attempt() -> None:
    """A CPU backward runs on the thread that calls it: optimizer steps fused into the
    backward of a plain loop in the main thread, while another thread's step was watched,
    were taken for that step's and refused inside the plain loop (found by the property
    test's thread feature)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inside, go_on = threading.Event(), threading.Event()

    @retry_on_oom(optimizer=opt)
    def split(batch: Any) -> None:
        loss = _loss(model, batch)
        if len(batch[0]) < 8:  # (a micro-batch, watched)
            inside.set()
            go_on.wait(timeout=30)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def watched(batch: Any) -> None:
        with inject_oom(batch_over=4):
            split(batch)

    plain = _model(1)
    by_param = {q: torch.optim.SGD([q], lr=0.1) for q in plain.parameters()}

    def stepped(q: torch.Tensor) -> None:  # (an optimizer step fused into backward)
        by_param[q].step()
        by_param[q].zero_grad()

    for q in plain.parameters():
        q.register_post_accumulate_grad_hook(stepped)
    thread = threading.Thread(target=watched, args=(_data(0),))
    thread.start()
    try:
        assert inside.wait(timeout=30)
        _loss(plain, _data(1)).backward()  # (raised a refusal of the other thread's step)
    finally:
        go_on.set()
        thread.join(timeout=30)


@pytest.mark.filterwarnings("ignore:.*depend on how its batch is cut")  # (it runs in micro-batches)
def test_a_piece_smaller_than_batchnorm_accepts_names_the_module_and_min_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    @retry_on_oom(optimizer=opt, model=model)
    def step(batch: Any) -> None:
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

    batch = _data(0, n=3)
    with inject_oom(batch_over=2), \
            pytest.raises(AutobatchError, match=r"Sequential\.1 \(BatchNorm1d\).*min_batch=2"):
        step(batch)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


@pytest.mark.parametrize("where", ["clipping", "first optimizer step"])
@pytest.mark.parametrize("given", [False, True])
def test_a_grad_scaler_is_reset_after_a_failed_attempt_with_or_without_scaler(
    where: str, given: bool
) -> None:
    """An OOM after ``scaler.unscale_(opt)`` (in clipping, or in the optimizer's first step)
    used to crash the retry with "unscale_() has already been called" unless ``scaler=`` was
    given."""

    def train(guard: bool) -> nn.Module:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
        fail = {"call": 2 if where == "clipping" else 0}

        def step(batch: Any) -> torch.Tensor:
            loss = _loss(model, batch)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if guard and where == "clipping" and fail["call"] == calls[0] and len(batch[0]) == 8:
                fail["call"] = -1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss.detach()

        run = retry_on_oom(optimizer=opt, **({"scaler": scaler} if given else {}))(step) \
            if guard else step
        calls = [0]
        for call in range(4):
            calls[0] = call
            batch = _data(call)
            if guard and where == "first optimizer step" and call == 0:
                with inject_oom(phase="optimizer", at_op=1):
                    run(batch)
            else:
                run(batch)
        return model

    _assert_same(train(True), train(False))


@pytest.mark.parametrize("fault", FAULTS[:2])
@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("at_calls", [{0}, {3}, {3, 5}])
def test_the_plain_amp_step_without_unscale_is_exact_when_split(
    fault: str, given: bool, at_calls: set[int]
) -> None:
    """``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` with no
    ``unscale_`` of its own: ``scaler.step`` unscales inside the last micro-batch. That nested
    call used to end the step's own ``scaler.step`` early in the path check, so every split
    call was refused, and the refusal left the scaler's stage at "unscaled": the next call's
    step then applied gradients still multiplied by the scale (params off 5.8e-1, silently)."""

    def make(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2)

        def step(batch: Any) -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        step.scaler = scaler  # type: ignore[attr-defined]
        return step

    def options(step: Any) -> dict[str, Any]:
        return {"scaler": step.scaler} if given else {}

    truth = _train(make, "sgd", None, set(), calls=7)
    _assert_same(_train(make, "sgd", fault, at_calls, calls=7, options=options), truth)


@pytest.mark.parametrize("fault", FAULTS[:2])
@pytest.mark.parametrize("how", ["autograd.grad", "backward"])
def test_a_gradient_penalty_is_refused_when_split_with_the_state_unchanged(
    fault: str, how: str
) -> None:
    """A penalty on the input gradient of a mean loss (double backward) scales with the batch's
    size: split, it was 1.6e-4 off, silently. It is refused when the batch would run in
    micro-batches; the batch's call leaves everything as before it (the loop skips it)."""
    grad = torch.autograd.grad

    def train(guard: bool) -> tuple[nn.Module, list[str]]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)

        def step(batch: Any) -> None:
            opt.zero_grad()
            x = batch[0].clone().requires_grad_(True)
            loss = nn.functional.cross_entropy(model(x), batch[1])
            if how == "autograd.grad":
                (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            else:
                loss.backward(create_graph=True, inputs=[x])
                gx, x.grad = x.grad, None
            model.zero_grad()
            (loss + 0.1 * gx.square().sum(1).mean()).backward()
            opt.step()

        run = retry_on_oom(optimizer=opt)(step) if guard else step
        refusals = []
        faults = _faults() if guard else {}
        for call in range(6):
            batch = _data(call)
            if call != 3:
                run(batch)
            elif guard:
                with pytest.raises(AutobatchError) as info, faults[fault]():
                    run(batch)
                refusals.append(str(info.value))
        return model, refusals

    got, refusals = train(True)
    truth, _ = train(False)
    assert len(refusals) == 1
    assert "gradient penalty" in refusals[0]
    _assert_same(got, truth)
    assert torch.autograd.grad is grad
    assert _patches.replaced() == []


class _CallCounter:
    """A step written as a method that counts its calls on ``self``."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def step(self, batch: Any) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1  # (first written by the first call)
        self.opt.zero_grad()
        loss = _loss(self.model, batch) * (1 + self.calls % 3)
        loss.backward()
        self.opt.step()
        return loss.detach()


def _counting(where: str) -> Callable[..., Callable[..., Any]]:
    def make(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[..., Any]:
        n = 0
        state: dict[str, Any] = {"n": 0, "log": []}

        def nonlocal_step(batch: Any) -> torch.Tensor:
            nonlocal n
            n += 1
            opt.zero_grad()
            loss = _loss(model, batch) * (1 + n % 3)
            loss.backward()
            opt.step()
            return loss.detach()

        def dict_step(batch: Any) -> torch.Tensor:
            state["n"] += 1
            opt.zero_grad()
            loss = _loss(model, batch) * (1 + state["n"] % 3)
            state["log"].append(float(loss))
            loss.backward()
            opt.step()
            return loss.detach()

        calls = [0]

        def list_step(batch: Any) -> torch.Tensor:
            calls[0] += 1
            opt.zero_grad()
            loss = _loss(model, batch) * (1 + calls[0] % 3)
            loss.backward()
            opt.step()
            return loss.detach()

        return {"nonlocal": nonlocal_step, "dict": dict_step, "list": list_step,
                "self": _CallCounter(model, opt).step}[where]

    return make


@pytest.mark.parametrize("where", ["nonlocal", "dict", "list", "self"])
@pytest.mark.parametrize("fault", FAULTS[:2])
@pytest.mark.parametrize("at_calls", [{0}, {3}, {2, 4}])
def test_a_python_counter_that_weights_the_loss_counts_each_call_once(
    where: str, fault: str, at_calls: set[int]
) -> None:
    """``loss * (1 + n % 3)`` with ``n`` counted by the step (``nonlocal``, in a dict or a
    one-item list of its closure, on ``self``): the failed attempt and every micro-batch used to count, so the
    pieces' losses were weighted otherwise than the batch's (params off 2.2e-1, silently).
    The step's Python numbers are put back after a failed attempt and before each
    micro-batch."""
    truth = _train(_counting(where), "adamw", None, set(), calls=6)
    _assert_same(_train(_counting(where), "adamw", fault, at_calls, calls=6), truth)


def test_a_refusal_on_the_fast_path_puts_back_hyperparameters_and_names_dropped_gradients() -> None:
    """A step that sets its learning rate and edits a parameter in place (refused after an OOM
    on the fast path): the learning rate it set is put back (it was left at the failed
    attempt's value while the message said "nothing of it was kept"), and the message says
    the gradients its ``zero_grad()`` dropped stay dropped."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = 0

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        nonlocal calls
        calls += 1
        opt.param_groups[0]["lr"] = 0.1 / calls
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        with torch.no_grad():
            model[0].weight.mul_(0.999)  # (in place, outside the optimizer: refused)

    for call in range(3):
        step(_data(call))
    lr, params = opt.param_groups[0]["lr"], [p.detach().clone() for p in model.parameters()]
    batch = _data(3)
    with pytest.raises(AutobatchError) as info, inject_oom(phase="forward", at_op=2):
        step(batch)
    assert opt.param_groups[0]["lr"] == lr
    assert calls == 3
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    assert "dropped (zero_grad() at its start)" in str(info.value)


@pytest.mark.parametrize("batch_over", [4, 5])  # (equal pieces, or not)
def test_a_row_count_and_a_call_count_kept_in_the_step_end_as_unsplit(batch_over: int) -> None:
    """``rows += len(x)`` sums every piece's rows (a long run's own count lost a quarter of its
    samples when each piece started from the batch's value and the last one's stood);
    ``calls += 1`` counts the call once; a float running total sums the pieces'."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows, calls = [0], 0
    state = {"seen": 0.0}

    @retry_on_oom(optimizer=opt)
    def step(batch: Any) -> None:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        _loss(model, batch).backward()
        opt.step()
        rows[0] += len(batch[0])
        state["seen"] += 0.5 * len(batch[0])

    for call in range(4):
        if call == 2:
            with inject_oom(batch_over=batch_over):
                step(_data(call))
        else:
            step(_data(call))
    assert rows[0] == 32
    assert calls == 4
    assert state["seen"] == 16.0


def _assert_untouched(model: nn.Module, params: list[torch.Tensor]) -> None:
    """After a refused call: every parameter as before, and no gradient left behind."""
    for p, q in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, q)
        assert p.grad is None


# State first written on a later call ----------------------------------------------------------


class _Counting(nn.Module):
    """Counts the rows its forward sees in a buffer (replaced at every epoch start)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head: nn.Module = nn.Linear(8, 3)
        self.register_buffer("rows", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.shape[0]
        return self.head(self.body(x))


@pytest.mark.parametrize("change", ["buffer replaced", "new head with BatchNorm"])
@pytest.mark.parametrize("fault", ["forward", "backward", "optimizer"])
def test_state_first_written_on_a_later_call_is_put_back_after_a_fast_path_oom(
    change: str, fault: str
) -> None:
    """A buffer replaced at an epoch start (its rows counted 24 instead of 16), or a head with
    BatchNorm added after warm-up (``num_batches_tracked`` 3 instead of 2): the fast path
    copied only what the first call wrote. A registration into the step's modules now makes
    the next call watched again."""

    def train(guard: bool) -> _Counting:
        model = _Counting()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(batch: Any) -> None:
            _loss(model, batch).backward()
            opt.step()
            opt.zero_grad()

        run = retry_on_oom(optimizer=opt, model=model)(step) if guard else step
        for call in range(5):  # (the OOM on the last call)
            if call == 2:  # the epoch starts
                if change == "buffer replaced":
                    model.rows = torch.zeros(())
                else:
                    torch.manual_seed(1)
                    model.head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
                    opt.add_param_group({"params": list(model.head.parameters())})
            batch = _data(call)
            if guard and call == 4:
                with warnings.catch_warnings(), inject_oom(phase=fault, at_op=1 if fault == "optimizer" else 4):
                    warnings.simplefilter("ignore")  # (BatchNorm in micro-batches)
                    run(batch)
            else:
                run(batch)
        return model

    got, truth = train(True), train(False)
    if change == "buffer replaced":
        _assert_same(got, truth)
        torch.testing.assert_close(got.rows, truth.rows, rtol=0, atol=0)  # 16 rows since call 2
        return
    # BatchNorm counts each forward: the split batch's two pieces once each, the failed
    # whole batch not at all (its statistics differ per micro-batch, as the warning says)
    tracked = got.head[1].num_batches_tracked, truth.head[1].num_batches_tracked
    assert int(tracked[0]) == int(tracked[1]) + 1, tracked


class _Trainer:
    """A step written as a method, keeping a running loss it starts after warm-up in a plain
    attribute (no module registers it)."""

    def __init__(self) -> None:
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.running: torch.Tensor | None = None

    def step(self, batch: Any) -> None:
        loss = _loss(self.model, batch)
        if self.running is not None:
            self.running += loss.detach()  # (before backward: an OOM there follows it)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()


@pytest.mark.parametrize("fault", FAULTS)
def test_state_outside_the_modules_first_written_later_is_refused_saying_it_may_stay_changed(
    fault: str,
) -> None:
    """A running sum started after warm-up in a plain attribute: the fast path has no copy of
    it, so after a whole-batch OOM that followed its update the retry is refused, naming it
    and saying it may stay changed (it used to be refused with "nothing of it was kept"
    while the tensor stayed changed); everything else is as before the call."""
    trainer = _Trainer()
    step = retry_on_oom(optimizer=trainer.opt)(trainer.step)
    for call in range(2):  # warm-up
        step(_data(call))
    trainer.running = torch.zeros(())
    step(_data(2))
    params = [p.detach().clone() for p in trainer.model.parameters()]
    batch = _data(3)
    with _faults()[fault](), pytest.raises(
        AutobatchError, match=r"self\.running \(\(\) float64\).*may stay changed"
    ):
        step(batch)
    _assert_untouched(trainer.model, params)


class _Epochs:
    """A step written as a method that updates a torchmetrics metric the loop re-creates at
    every epoch start (a plain attribute: nothing is registered into the step's modules)."""

    def __init__(self) -> None:
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.metric = torchmetrics.MeanMetric()

    def step(self, batch: Any) -> None:
        losses = nn.functional.cross_entropy(self.model(batch[0]), batch[1], reduction="none")
        self.metric.update(losses.detach())
        losses.mean().backward()
        self.opt.step()
        self.opt.zero_grad()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_metric_the_loop_re_creates_is_refused_by_name_with_the_rest_unchanged(
    fault: str
) -> None:
    """The epoch value of a metric re-created each epoch was off by 8.8%: its state, first
    written by a whole batch that ran out of memory on the fast path, was updated again by
    the retry. The fast path has no copy of it, so the retry is refused, naming it and saying
    it may stay changed; the parameters and gradients are as before the call."""
    trainer = _Epochs()
    step = retry_on_oom(optimizer=trainer.opt)(trainer.step)
    for call in range(2):
        step(_data(call))
    trainer.metric = torchmetrics.MeanMetric()  # the epoch starts
    params = [p.detach().clone() for p in trainer.model.parameters()]
    batch = _data(2)
    with _faults()[fault](), pytest.raises(
        AutobatchError, match=r"self\.metric\.\w+ .*may stay changed"
    ):
        step(batch)
    _assert_untouched(trainer.model, params)
    step(_data(3))  # learned: copied on the fast path from now on
    batch = _data(4)
    with _faults()[fault]():
        step(batch)
    # calls 3 and 4, and call 2's whole batch where it updated the metric before its OOM
    assert int(trainer.metric.weight) == 16 + (0 if fault == "forward" else 8)


# requires_grad toggled inside the step ---------------------------------------------------------


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("unfreeze_at", [1, 2])
def test_a_backbone_unfrozen_inside_the_step_is_weighted_and_summed(
    reentrant: bool, carry: bool, unfreeze_at: int
) -> None:
    """The step makes a frozen backbone require gradients after warm-up, and runs it under
    ``torch.utils.checkpoint``. A reentrant checkpoint hides its parameters from the graph, so
    a split batch did not fold their gradients: only the last piece's counted (off by 1.4e-2
    with SGD, 0.29 with Adam)."""

    def train(guard: bool) -> nn.Module:
        torch.manual_seed(0)
        stem, backbone, head = nn.Linear(5, 5), nn.Sequential(
            nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh()), nn.Linear(7, 1)
        model = nn.Sequential(stem, backbone, head)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g))
                   for _ in range(5)]

        def step(batch: Any, call: int) -> None:
            x, y = batch
            for p in backbone.parameters():
                p.requires_grad_(call >= unfreeze_at)
            if not carry:
                opt.zero_grad()
            h = torch.utils.checkpoint.checkpoint(backbone, stem(x), use_reentrant=reentrant)
            ((head(h) - y).square().mean() / (2 if carry else 1)).backward()
            if not carry or call % 2 == 1:
                opt.step()
                if carry:
                    opt.zero_grad()

        run = retry_on_oom(optimizer=opt, model=model)(step) if guard else step
        for call, batch in enumerate(batches):
            if guard and call == 0:  # (split from the first call on: every later call too)
                with inject_oom(batch_over=4):
                    run(batch, call)
            else:
                run(batch, call)
        return model

    _assert_same(train(True), train(False))


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("at_call", [0, 2])
def test_plain_sgd_out_of_memory_at_its_first_operator_in_a_split_batch_is_retried(
    foreach: bool | None, at_call: int
) -> None:
    """Plain SGD keeps no state, so every step is a first step. An OOM at the first operator of
    its deferred step (in the last piece of a split batch) wrote nothing, yet was refused as
    "had already changed its parameters": the watched step counted a write before it ran."""

    def train(guard: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=foreach)

        def step(batch: Any) -> None:
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()

        run = retry_on_oom(optimizer=opt, model=model)(step) if guard else step
        for call in range(4):
            batch = _data(call)
            if guard and call == at_call:
                with inject_oom(batch_over=4), inject_oom(phase="optimizer", at_op=1) as fault:
                    run(batch)
                assert fault.fired == 1
            else:
                run(batch)
        return model

    _assert_same(train(True), train(False))


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8, max_norm=1.0)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("fault", ["forward", "backward", "optimizer"])
@pytest.mark.parametrize("call", [0, 2])
def test_embedding_max_norm_is_refused_with_the_right_cause(fault: str, call: int) -> None:
    """Embedding(max_norm=) renormalises its weight in place in forward. On a watched call the
    weight is copied first and put back; on the fast path it is not (the message says it stays
    changed). It used to be blamed on an optimizer.step() that never ran."""
    model = _Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    @retry_on_oom(optimizer=opt, model=model)
    def step(batch: Any) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 50, (8, 5), generator=g) * (i + 1) % 50,
                torch.randint(0, 3, (8,), generator=g)) for i in range(call + 1)]
    with torch.no_grad():
        model.emb.weight.mul_(3)  # (rows above max_norm: the renormalisation changes them)
    for batch in batches[:-1]:
        step(batch)
    before = model.emb.weight.detach().clone()
    inject = {"forward": lambda: inject_oom(phase="forward", at_op=8),
              "backward": lambda: inject_oom(phase="backward", at_op=2),
              "optimizer": lambda: inject_oom(phase="optimizer", at_op=1)}[fault]
    with inject(), pytest.raises(AutobatchError) as raised:
        step(batches[-1])
    message = str(raised.value)
    assert "optimizer.step() had updated" not in message
    assert "model.emb.weight" in message or "emb.weight" in message, message
    if call == 0:  # watched: put back
        assert torch.equal(model.emb.weight, before)
    elif not torch.equal(model.emb.weight, before):  # fast path: said so
        assert "the change stays" in message or "may stay changed" in message, message


def test_an_oom_in_a_later_optimizer_step_says_what_grad_holds() -> None:
    """An OOM inside a later (not first) Adam step is refused: the update may be partly
    applied. The message says what ``.grad`` holds, this batch's whole gradient as backward
    left it (checked against the same backward unguarded, float64), and that the gradients
    the step's zero_grad() dropped are not put back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).double()
    opt = torch.optim.Adam(model.parameters())

    @retry_on_oom(optimizer=opt)
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randint(0, 2, (16,))
    for _ in range(3):
        step((x, y))
    truth = [torch.autograd.grad(nn.functional.cross_entropy(model(x), y), p)[0]
             for p in model.parameters()]
    with inject_oom(phase="optimizer", at_op=3), pytest.raises(AutobatchError) as raised:
        step((x, y))
    message = str(raised.value)
    assert "inside Adam.step()" in message
    assert "The parameters' .grad hold this batch's gradients" in message
    assert "zero_grad() at its start) before the whole batch ran out of memory, are not put " \
        "back." in message
    assert "step The gradients" not in message  # (sentences end where they should)
    for p, g in zip(model.parameters(), truth, strict=True):
        assert p.grad is not None
        assert torch.equal(p.grad, g)


# Reading p.grad in every micro-batch ------------------------------------------------------------


@pytest.mark.parametrize("reader", ["norm logging", "post-accumulate hook", "in-place clamp"])
@pytest.mark.parametrize("at_call", [0, 2])
def test_code_between_backward_and_step_reads_the_gradient_in_every_micro_batch(
    reader: str, at_call: int
) -> None:
    """In a micro-batch before the last ``.grad`` shows the sum so far (weighted), so code that
    reads it (gradient-norm logging, a post-accumulate hook, which torch promises ``.grad`` in)
    runs; its writes there are dropped, and made once on the whole batch's gradient in the
    last micro-batch. It used to find ``None`` and crash the first time memory ran short."""

    def train(guard: bool) -> tuple[nn.Module, list[float]]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        norms: list[float] = []
        handles = [
            p.register_post_accumulate_grad_hook(lambda p: norms.append(float(p.grad.norm())))
            for p in model.parameters()
        ] if reader == "post-accumulate hook" else []

        def step(batch: Any) -> None:
            opt.zero_grad()
            _loss(model, batch).backward()
            if reader == "norm logging":
                norms.append(float(sum(p.grad.norm() ** 2 for p in model.parameters())))
            elif reader == "in-place clamp":
                for p in model.parameters():
                    p.grad.clamp_(-0.02, 0.02)
            opt.step()

        run = retry_on_oom(optimizer=opt, model=model)(step) if guard else step
        for call in range(4):
            batch = _data(call)
            if guard and call == at_call:
                with inject_oom(batch_over=4):
                    run(batch)
            else:
                run(batch)
        for handle in handles:
            handle.remove()
        return model, norms

    (got, got_norms), (truth, truth_norms) = train(True), train(False)
    _assert_same(got, truth)
    if reader == "norm logging":  # (the last micro-batch's is the whole batch's)
        assert got_norms[-1] == pytest.approx(truth_norms[-1], rel=1e-9)


@pytest.mark.parametrize("fault", ["forward", "backward"])
@pytest.mark.parametrize("at_call", [0, 2])
def test_dropout_drawn_before_an_oom_on_the_fast_path_is_drawn_again(
    fault: str, at_call: int
) -> None:
    """The random streams are part of the transaction: a dropout mask drawn by a whole batch
    that then ran out of memory is drawn again by its pieces (on the CPU two masks of 8 rows
    are the one of 16, drawn in order). On a later call, which runs on the fast path, the
    streams stayed where the failed attempt left them (params off by 2e-2)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g))
               for _ in range(4)]

    def run(guard: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(batch: Any) -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
            opt.step()

        run_step = retry_on_oom(optimizer=opt)(step) if guard else step
        torch.manual_seed(1)
        streams = []
        for call, batch in enumerate(batches):
            if guard and call == at_call:
                at_op = 5 if fault == "forward" else 3
                with warnings.catch_warnings(), inject_oom(phase=fault, at_op=at_op) as injected:
                    warnings.simplefilter("ignore")
                    run_step(batch)
                assert injected.fired == 1
            else:
                run_step(batch)
            streams.append(torch.get_rng_state())
        return list(model.parameters()), streams

    (guarded, streams), (truth, truth_streams) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(streams, truth_streams, strict=True))
    for p, q in zip(guarded, truth, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
