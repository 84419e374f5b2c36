"""What a recovered training step guarantees: the whole batch's math and no trace of a failure.

Every test compares a step that ran out of memory and was split with the same step run whole
(float64, tight tolerances), on real models. The fake device raises a real OOM when a call gets
more rows than it allows; without a simulated GPU the CPU backend keeps no statistics, so sizes
halve and the pieces are known.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autobatch import AutobatchError, BatchSizeError, retry_on_oom
from autobatch._memory._accounting import call_keeping_versions
from autobatch._recovery import oom_guard
from autobatch._recovery._sizes import _KeyState, _Sizes
from autobatch.testing import SimulatedGPU, inject_oom
from autobatch.testing.models import conv_net


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


class Device:
    """A call with more than ``limit`` rows runs out of memory; records the sizes it got."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sizes: list[int] = []

    def check(self, n: int) -> None:
        self.sizes.append(n)
        if n > self.limit:
            raise _oom()


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _same(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-9) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=rtol, atol=1e-12), (x - y).abs().max()


def _params(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


# --------------------------------------------------------------------------------------------
# 1. Code between backward() and optimizer.step() sees the whole batch's gradient


class TwoHeads(nn.Module):
    """Rows flagged 1 go through head ``b``, the others through head ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 16)
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.a(h)
        rows = flag > 0
        if rows.any():  # head b runs only where it has rows, like a mixture-of-experts router
            out = out.index_put((rows,), self.b(h[rows]))
        return out


def _two_head_batch(n: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 6, generator=g)
    flag = (torch.arange(n) < n // 2).long()  # head b only in the first half: not in the last piece
    y = torch.randint(0, 3, (n,), generator=g)
    return x, flag, y


def _clipping_run(
    device: Device | None,
) -> tuple[TwoHeads, torch.optim.Optimizer, list[float], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    norms: list[float] = []

    def step(batch: Any) -> torch.Tensor:
        x, flag, y = batch
        if device is not None:
            device.check(len(x))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x, flag), y)
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
        opt.step()
        return loss

    return model, opt, norms, step


def test_clipping_and_logging_after_backward_see_the_whole_batch_gradient() -> None:
    batch = _two_head_batch()
    reference, _, ref_norms, ref_step = _clipping_run(None)
    ref_step(batch)
    device = Device(limit=8)
    model, opt, norms, step = _clipping_run(device)
    retry_on_oom(optimizer=opt)(step)(batch)
    assert device.sizes == [32, 16, 8, 8, 8, 8]
    assert norms[-1] == pytest.approx(ref_norms[0], rel=1e-12)  # the last piece sees the batch
    _same(_params(model), _params(reference))


def test_parameters_unused_by_the_last_piece_get_their_gradient_before_step() -> None:
    batch = _two_head_batch()
    torch.manual_seed(0)
    reference = TwoHeads()
    torch.manual_seed(0)
    model = TwoHeads()
    seen: list[torch.Tensor | None] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = Device(limit=16)

    @retry_on_oom(optimizer=opt)
    def step(b: Any) -> None:
        device.check(len(b[0]))
        opt.zero_grad()
        nn.functional.cross_entropy(model(b[0], b[1]), b[2]).backward()
        seen.append(None if model.b.weight.grad is None else model.b.weight.grad.clone())
        opt.step()

    step(batch)
    nn.functional.cross_entropy(reference(batch[0], batch[1]), batch[2]).backward()
    assert device.sizes == [32, 16, 16]
    assert seen[-1] is not None
    assert reference.b.weight.grad is not None
    assert torch.allclose(seen[-1], reference.b.weight.grad, rtol=1e-12, atol=0)


def test_two_backward_calls_in_one_step_are_weighted_each() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(4, 2)
    model = nn.Linear(4, 2)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(12, 4)

    def run(m: nn.Module, opt: torch.optim.Optimizer, b: torch.Tensor) -> None:
        opt.zero_grad()
        m(b).square().mean().backward()
        m(b).abs().mean().backward()  # a second loss, backward on its own
        opt.step()

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    run(reference, ref_opt, x)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    device = Device(limit=4)

    @retry_on_oom(optimizer=opt)
    def step(b: torch.Tensor) -> None:
        device.check(len(b))
        run(model, opt, b)

    step(x)
    assert device.sizes == [12, 6, 3, 3, 3, 3]
    _same(_params(model), _params(reference))


# --------------------------------------------------------------------------------------------
# 2. Losses averaged over items (tokens), not rows


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        logits: torch.Tensor = self.head(out)
        return logits


def _ragged_tokens(n: int = 24, length: int = 9, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 11, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    lengths[: n // 2] = 1  # short rows first: pieces have very different token counts
    labels = ids.clone()
    labels[torch.arange(length)[None, :] >= lengths[:, None]] = -100
    return {"ids": ids, "labels": labels}


def _lm_loss(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def ignore_index(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def masked(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = (labels != -100).to(logits.dtype)
        nll = nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none"
        )
        return (nll * mask.flatten()).sum() / mask.sum()

    def summed(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    return {"ignore_index": ignore_index, "masked": masked, "sum": summed}[kind]


def _lm_run(
    loss_kind: str, limit: int | None, **options: Any
) -> tuple[nn.Module, list[float], Any]:
    torch.manual_seed(1)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = _lm_loss(loss_kind)
    device = Device(limit if limit is not None else 10**9)
    losses: list[float] = []

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        device.check(len(batch["ids"]))
        opt.zero_grad()
        loss = loss_fn(model(batch["ids"]), batch["labels"])
        loss.backward()
        opt.step()
        return loss.detach()

    wrapped = retry_on_oom(optimizer=opt, **options)(step) if limit is not None else step
    return model, losses, wrapped


def _tokens_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


@pytest.mark.parametrize("loss_kind", ["ignore_index", "masked"])
def test_token_averaged_loss_is_exact_with_items(loss_kind: str) -> None:
    batches = [_ragged_tokens(seed=s) for s in range(3)]
    reference, _, ref_step = _lm_run(loss_kind, None)
    ref_losses = [float(ref_step(b)) for b in batches]
    model, _, step = _lm_run(loss_kind, 5, items=_tokens_of)
    losses = [float(step(b)) for b in batches]
    assert step.stats.ooms >= 1
    _same(_params(model), _params(reference))
    assert losses == pytest.approx(ref_losses, rel=1e-12)  # the batch's token average


@pytest.mark.parametrize("loss_kind", ["ignore_index", "masked"])
def test_token_averaged_loss_without_items_is_refused_with_the_state_unchanged(
    loss_kind: str,
) -> None:
    """The reason for ``items=``: weighted by rows, a token mean split is not the batch's
    (params off by 2.8e-3 when it was split silently); refused at the first split."""
    batch = _ragged_tokens()
    model, _, step = _lm_run(loss_kind, 5)
    before = [p.detach().clone() for p in _params(model)]
    with pytest.raises(AutobatchError, match=r"items=") as refused:
        step(batch)
    assert "test_accumulate.py" in str(refused.value)  # (the user's line that divides)
    _same(_params(model), before)


def test_summed_token_loss_stays_exact_with_reduction_sum() -> None:
    batch = _ragged_tokens()
    reference, _, ref_step = _lm_run("sum", None)
    ref_loss = float(ref_step(batch))
    model, _, step = _lm_run("sum", 5, reduction="sum")
    assert float(step(batch)) == pytest.approx(ref_loss, rel=1e-12)
    _same(_params(model), _params(reference))


def test_a_piece_without_items_adds_nothing_and_no_nan() -> None:
    batch = _ragged_tokens(n=8)
    batch["labels"][4:] = -100  # the second half has no token at all
    reference, _, ref_step = _lm_run("ignore_index", None)
    ref_loss = float(ref_step(batch))
    model, _, step = _lm_run("ignore_index", 4, items=_tokens_of)
    loss = float(step(batch))
    assert math.isfinite(loss)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    _same(_params(model), _params(reference))


def test_items_is_validated() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match="items"):
        retry_on_oom(optimizer=opt, items=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="items"):
        retry_on_oom(optimizer=opt, items=len, reduction="sum")

    device = Device(limit=2)
    for bad in (-1, float("nan"), "3", True):

        @retry_on_oom(optimizer=opt, items=lambda b, bad=bad: bad)
        def step(b: torch.Tensor) -> None:
            device.check(len(b))

        with pytest.raises((TypeError, ValueError), match="items"):
            step(torch.ones(4))


@settings(max_examples=30, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=14),
    schedule=st.lists(st.integers(1, 14), min_size=1, max_size=6),
)
def test_random_item_counts_and_oom_schedules_match_the_unsplit_run(
    counts: list[int], schedule: list[int]
) -> None:
    """Rows carry 0..6 items each; the loss averages over items; OOMs come at random sizes."""
    if sum(counts) == 0:
        counts = [*counts[:-1], 1]
    n = len(counts)
    g = torch.Generator().manual_seed(len(counts) * 7 + sum(counts))
    x = torch.randn(n, 6, 3, generator=g)
    mask = (torch.arange(6)[None, :] < torch.tensor(counts)[:, None]).to(torch.float64)
    w0 = torch.randn(3, generator=g)

    def loss_of(w: torch.Tensor, xb: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        per_item = torch.tanh(xb @ w) ** 2
        return (per_item * mb).sum() / mb.sum()

    ref = nn.Parameter(w0.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.3, momentum=0.5)
    loss_of(ref, x, mask).backward()
    ref_opt.step()

    w = nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=0.3, momentum=0.5)
    attempts = [0]

    @retry_on_oom(optimizer=opt, items=lambda b: int(b[1].sum()))
    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        allowed = schedule[attempts[0] % len(schedule)]
        attempts[0] += 1
        if len(batch[0]) > allowed and len(batch[0]) > 1:
            raise _oom()
        opt.zero_grad()
        loss_of(w, *batch).backward()
        opt.step()

    step((x, mask))
    assert torch.allclose(w.detach(), ref.detach(), rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------
# 4. A second optimizer inside the step is never stepped twice, silently


class GanParts:
    def __init__(self) -> None:
        torch.manual_seed(2)
        self.g = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.d = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.opt_g = torch.optim.Adam(self.g.parameters(), lr=1e-2)
        self.opt_d = torch.optim.Adam(self.d.parameters(), lr=1e-2)
        self.d_steps = 0
        self.opt_d.register_step_post_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.d_steps += 1

    def step(self, real: torch.Tensor, fail_in_g: Callable[[int], None]) -> None:
        z = torch.randn_like(real)
        self.opt_d.zero_grad()
        fake = self.g(z)
        d_loss = nn.functional.softplus(-self.d(real)).mean() + nn.functional.softplus(
            self.d(fake.detach())
        ).mean()
        d_loss.backward()
        self.opt_d.step()
        self.opt_g.zero_grad()
        fail_in_g(len(real))  # e.g. the generator's backward runs out of memory
        g_loss = nn.functional.softplus(-self.d(fake)).mean()
        g_loss.backward()
        self.opt_g.step()


def test_an_oom_after_a_second_optimizer_stepped_is_refused_not_retried() -> None:
    gan = GanParts()
    device = Device(limit=8)
    step = retry_on_oom(optimizer=gan.opt_g)(lambda real: gan.step(real, device.check))
    d_before = _params(gan.d)
    with pytest.raises(AutobatchError, match=r"Adam\.step\(\).*twice") as caught:
        step(torch.randn(16, 4))
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert gan.d_steps == 1  # once, as in the step that ran out; never again
    assert any(not torch.equal(a, b) for a, b in zip(d_before, _params(gan.d), strict=True))


def test_a_second_optimizer_is_refused_before_it_steps_on_a_piece() -> None:
    gan = GanParts()
    device = Device(limit=8)

    def step_fn(real: torch.Tensor) -> None:
        device.check(len(real))  # the whole batch runs out before anything ran
        gan.step(real, lambda n: None)

    step = retry_on_oom(optimizer=gan.opt_g)(step_fn)
    d_before = _params(gan.d)
    with pytest.raises(AutobatchError, match=r"Adam\.step\(\)") as caught:
        step(torch.randn(16, 4))
    assert "optimizer=[" in str(caught.value)
    assert gan.d_steps == 0
    _same(_params(gan.d), d_before, rtol=0)


def test_interleaved_optimizers_are_refused_even_when_both_are_given() -> None:
    gan = GanParts()
    device = Device(limit=8)

    def step_fn(real: torch.Tensor) -> None:
        device.check(len(real))
        gan.step(real, lambda n: None)

    step = retry_on_oom(optimizer=[gan.opt_g, gan.opt_d])(step_fn)
    g_before, d_before = _params(gan.g), _params(gan.d)
    with pytest.raises(AutobatchError, match="after"):
        step(torch.randn(16, 4))
    assert gan.d_steps == 0
    _same(_params(gan.g), g_before, rtol=0)
    _same(_params(gan.d), d_before, rtol=0)


def test_two_optimizers_stepped_after_one_backward_are_exact() -> None:
    """An encoder on AdamW and a head on SGD, stepped together: both deferred, both exact."""

    def build() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        torch.manual_seed(4)
        model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
        opts: list[torch.optim.Optimizer] = [
            torch.optim.AdamW(model[0].parameters(), lr=1e-2, weight_decay=0.1),
            torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9),
        ]
        return model, opts

    def run(model: nn.Module, opts: list[torch.optim.Optimizer], b: Any) -> None:
        for o in opts:
            o.zero_grad()
        nn.functional.cross_entropy(model(b[0]), b[1]).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for o in opts:
            o.step()

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(20, 5, generator=g), torch.randint(0, 3, (20,), generator=g))
               for _ in range(3)]
    reference, ref_opts = build()
    for b in batches:
        run(reference, ref_opts, b)
    model, opts = build()
    device = Device(limit=7)

    @retry_on_oom(optimizer=opts)
    def step(b: Any) -> None:
        device.check(len(b[0]))
        run(model, opts, b)

    for b in batches:
        step(b)
    assert step.stats.ooms >= 1
    _same(_params(model), _params(reference))
    assert ref_opts[1].state_dict()["state"][0]["momentum_buffer"] is not None
    for mine, theirs in zip(opts, ref_opts, strict=True):
        for a, b in zip(mine.state.values(), theirs.state.values(), strict=True):
            for key in a:
                _same([torch.as_tensor(a[key])], [torch.as_tensor(b[key])])


def test_an_in_place_update_of_another_model_in_a_piece_is_refused() -> None:
    """An EMA teacher updated inside the step would be updated once per micro-batch."""
    torch.manual_seed(0)
    student = nn.Linear(4, 4)
    teacher = nn.Linear(4, 4)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    device = Device(limit=4)

    @retry_on_oom(optimizer=opt)
    def step(x: torch.Tensor) -> None:
        device.check(len(x))
        opt.zero_grad()
        with torch.no_grad():
            target = teacher(x)
        nn.functional.mse_loss(student(x), target).backward()
        opt.step()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters(), strict=True):
                t.mul_(0.9).add_(s, alpha=0.1)

    with pytest.raises(AutobatchError, match=r"teacher\.weight") as caught:
        step(torch.randn(8, 4))
    assert "in place" in str(caught.value)


# --------------------------------------------------------------------------------------------
# 5. A failed attempt leaves no trace in buffers


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def test_failed_attempts_do_not_update_batchnorm_statistics() -> None:
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = Device(limit=6)
    x = torch.randn(24, 5)

    @retry_on_oom(optimizer=opt)
    def step(b: torch.Tensor) -> None:
        opt.zero_grad()
        out = model(b)  # the running statistics are updated here, before the OOM
        device.check(len(b))
        out.square().mean().backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(x)
    ran = [n for n in device.sizes if n <= device.limit]
    assert device.sizes == [24, 12, 6, 6, 6, 6]
    reference = _bn_model()
    start = 0
    for n in ran:
        reference(x[start : start + n])
        start += n
    for name, buffer in reference.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    assert int(dict(model.named_buffers())["1.num_batches_tracked"]) == 4


def test_batchnorm_warning_through_a_helper_and_a_loss_module() -> None:
    model = conv_net(channels=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Criterion(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).logsumexp(dim=1).mean()

    parts = {"criterion": Criterion(model)}  # out of sight of the step's code

    def forward_through(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(x)

    for call in ("helper", "loss module"):
        @retry_on_oom(optimizer=opt)
        def step(x: torch.Tensor, call: str = call) -> None:
            if len(x) > 4:
                raise _oom()
            opt.zero_grad()
            if call == "helper":
                loss = forward_through(lambda t: _helper_forward(t), x)
            else:
                loss = forward_through(parts["criterion"], x)
            loss.backward()
            opt.step()

        _HELPER_MODEL[:] = [model]
        with pytest.warns(UserWarning, match="BatchNorm"):
            step(torch.randn(8, 3, 32, 32))


_HELPER_MODEL: list[nn.Module] = []


def _helper_forward(x: torch.Tensor) -> torch.Tensor:
    return _HELPER_MODEL[0](x).logsumexp(dim=1).mean()


# --------------------------------------------------------------------------------------------
# 6. min_batch holds for every piece


def test_min_batch_holds_for_the_last_piece_too() -> None:
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = Device(limit=3)

    @retry_on_oom(optimizer=opt, min_batch=2)
    def step(b: torch.Tensor) -> None:
        device.check(len(b))
        opt.zero_grad()
        model(b).square().mean().backward()  # BatchNorm raises on a piece of one row
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(torch.randn(5, 5))
    assert device.sizes == [5, 3, 2]  # balanced: never [2, 2, 1]


def test_min_batch_that_cannot_be_met_is_a_clear_error() -> None:
    device = Device(limit=2)

    @retry_on_oom(min_batch=2)
    def step(b: torch.Tensor) -> None:
        device.check(len(b))

    with pytest.raises(BatchSizeError, match="min_batch=2"):
        step(torch.ones(5))
    assert min(device.sizes) >= 2


# --------------------------------------------------------------------------------------------
# 7. Empty and odd batches


def test_an_empty_batch_after_an_oom_runs_the_step() -> None:
    device = Device(limit=2)
    calls: list[int] = []

    @retry_on_oom
    def step(b: torch.Tensor) -> torch.Tensor:
        device.check(len(b))
        calls.append(len(b))
        return b.sum()

    step(torch.ones(4))
    assert float(step(torch.ones(0))) == 0.0
    assert calls[-1] == 0


def test_per_batch_values_are_copied_into_every_piece() -> None:
    from autobatch import per_batch

    device = Device(limit=1)
    seen: list[Any] = []

    @retry_on_oom
    def step(b: dict[str, Any]) -> None:
        device.check(len(b["x"]))
        seen.append((b["size"], b["crop"], list(b["names"])))

    step({"x": torch.randn(2, 3), "size": per_batch((224, 448)), "crop": (7, 8, 9),
          "names": ["a", "b"]})
    assert seen[-2:] == [((224, 448), (7, 8, 9), ["a"]), ((224, 448), (7, 8, 9), ["b"])]


def test_a_tuple_as_long_as_the_batch_is_split_with_a_warning() -> None:
    device = Device(limit=1)
    seen: list[Any] = []

    @retry_on_oom
    def step(b: dict[str, Any]) -> None:
        device.check(len(b["x"]))
        seen.append(b["ids"])

    with pytest.warns(UserWarning, match="per_batch"):
        step({"x": torch.randn(2, 3), "ids": (5, 9)})
    assert seen[-2:] == [(5,), (9,)]


# --------------------------------------------------------------------------------------------
# 8. The refusal after a first step that already changed parameters says what happened


class _FailAfterParameterWrite(TorchDispatchMode):
    """Raises CUDA's OOM at the first operator after one that wrote into a parameter."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.written = False
        self.fired = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.written and not self.fired:
            self.fired += 1
            raise _oom()
        out = call_keeping_versions(func, args, kwargs or {})
        for i, argument in enumerate(func._schema.arguments):
            info = argument.alias_info
            if info is None or not info.is_write or i >= len(args):
                continue
            values = args[i] if isinstance(args[i], (list, tuple)) else [args[i]]
            if {v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)} & (
                self.storages
            ):
                self.written = True
        return out


@pytest.mark.parametrize("foreach", [False, True])
def test_first_step_refusal_says_what_happened(foreach: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)

    @retry_on_oom(optimizer=opt)
    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    # the first step runs out of memory just after weight decay changed a parameter
    fault = _FailAfterParameterWrite(list(model.parameters()))
    with fault, pytest.raises(AutobatchError) as caught:
        step(torch.randn(3, 4))
    assert fault.fired == 1
    message = str(caught.value)
    assert "first step" in message
    assert "already changed" in message
    assert ("foreach=False" in message) is foreach


def test_an_optimizer_without_state_is_not_told_of_a_first_step_on_a_later_call() -> None:
    """Plain SGD keeps no state: on its third call it has none, as on its first, and an OOM
    after it changed a parameter was said to be "inside the first step of SGD (while it
    created its state)"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        model(x).mean().backward()
        opt.step()

    step(torch.randn(3, 4))
    step(torch.randn(3, 4))
    fault = _FailAfterParameterWrite(list(model.parameters()))
    with fault, pytest.raises(AutobatchError) as caught:
        step(torch.randn(3, 4))
    assert fault.fired == 1
    message = str(caught.value)
    assert "inside the first step" not in message
    assert "inside SGD.step()" in message


# --------------------------------------------------------------------------------------------
# 9. The guard's memory is bounded


@pytest.mark.slow
@pytest.mark.usefixtures("frozen_heap")  # (every OOM collects garbage: 160 of them)
def test_history_is_a_bounded_window_with_counters() -> None:
    limit = [6]

    @retry_on_oom(grow_after=1)
    def step(b: torch.Tensor) -> None:
        if len(b) > limit[0]:
            raise _oom()

    batches = [torch.ones(8) for _ in range(160)]  # far more changes than the window keeps
    with oom_guard(batches) as guard:
        for i, b in enumerate(guard):
            limit[0] = 6 if i % 3 else 3
            step(b)
    for stats in (guard.stats, step.stats):
        assert stats.shrinks + stats.grows > 64 + 32
        assert stats.changes >= stats.shrinks + stats.grows
        assert len(stats.history) == 64  # the most recent changes
        assert stats.history[-1].step >= 150


def _deep_mlp() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(128, 128), nn.Tanh())])


def test_a_split_step_holds_one_gradient_copy_not_two() -> None:
    """Each piece's gradient joins the sum parameter by parameter as backward produces it, so a
    device with room for the parameters, one gradient and a layer's worth more trains the batch
    (holding the earlier pieces' sum beside a whole new gradient would need a third copy)."""
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(1))
    reference = _deep_mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).square().mean().backward()
    ref_opt.step()

    model = _deep_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @retry_on_oom(optimizer=opt)
    def step(batch: torch.Tensor) -> None:
        opt.zero_grad()
        model(batch).square().mean().backward()
        opt.step()

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    capacity = int(2.5 * params)  # parameters, one gradient, half of one more
    # byte-exact: under the caching model 1.3 MiB is less than one 2 MiB segment
    with SimulatedGPU(capacity, allocator="exact", adopt=[model, opt]):
        step(x)
    assert step.stats.ooms >= 1
    assert step.stats.micro_batch_size is not None
    _same(_params(model), _params(reference))


def test_sparse_embedding_gradients_are_summed_exactly() -> None:
    """``nn.Embedding(sparse=True)`` gives sparse gradients: they join the sum too (not in
    place), and the step equals the unsplit one."""
    torch.manual_seed(0)
    base = nn.ModuleDict({"emb": nn.Embedding(50, 8, sparse=True), "head": nn.Linear(8, 3)})
    x, y = torch.randint(0, 50, (16, 5)), torch.randint(0, 3, (16,))

    def run(device: Device | None) -> list[torch.Tensor]:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def step(batch: Any) -> None:
            if device is not None:
                device.check(len(batch[0]))
            opt.zero_grad()
            out = model["head"](model["emb"](batch[0]).mean(1))
            nn.functional.cross_entropy(out, batch[1]).backward()
            opt.step()

        (step if device is None else retry_on_oom(optimizer=opt)(step))((x, y))
        return _params(model)

    device = Device(4)
    _same(run(device), run(None))
    assert max(device.sizes) == 16
    assert device.sizes[-1] == 4


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward runs out of memory when ``plan`` says so (one entry per call):
    placed after the first layer, it fails once the later layers' gradients were summed."""

    plan: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailInBackward.plan and _FailInBackward.plan.pop(0):
            raise _oom()
        return grad


@pytest.mark.parametrize("failing", [2, 4])  # an early piece, the last piece
def test_an_oom_after_gradients_joined_the_sum_starts_the_batch_over_exactly(failing: int) -> None:
    g = torch.Generator().manual_seed(13)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)

    def run(device: Device | None) -> tuple[list[torch.Tensor], Any]:
        torch.manual_seed(12)
        model = nn.ModuleList([
            nn.Linear(6, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        ])
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

        def step(batch: Any) -> None:
            if device is not None:
                device.check(len(batch[0]))
            opt.zero_grad()
            h = _FailInBackward.apply(model[0](batch[0]))
            nn.functional.cross_entropy(model[1](h), batch[1]).backward()
            opt.step()

        fn = step if device is None else retry_on_oom(optimizer=opt)(step)
        fn((x, y))
        return _params(model), fn

    _FailInBackward.plan = []
    reference, _ = run(None)
    # the whole batch fails in forward (more than 8 rows), then pieces of 8: piece ``failing``
    # fails in backward after the last layers' gradients were added to the sum
    _FailInBackward.plan = [False] * (failing - 1) + [True]
    got, fn = run(Device(8))
    assert _FailInBackward.plan == []
    _same(got, reference)
    assert fn.stats.ooms >= 2
    assert fn.stats.samples_recomputed >= 32 + 8 * failing  # the earlier pieces ran again


# --------------------------------------------------------------------------------------------
# Real third-party models and compiled ones


def test_hugging_face_causal_lm_with_padding_is_exact_with_items() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).double()
        # SGD: the update is the gradient itself (Adam would magnify rounding noise in
        # gradients that are zero in exact arithmetic)
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (12, 16), generator=g)
    lengths = torch.tensor([2, 3, 16, 4, 16, 5, 2, 9, 16, 3, 7, 12])
    mask = (torch.arange(16)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
        # the model's own loss (out.loss) runs in float32; this is its float64 twin
        logits = out.logits[:, :-1].flatten(0, 1)
        return nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)

    reference, ref_opt = build()
    own = float(reference(**batch).loss)
    ref_opt.zero_grad()
    ref_out = reference(input_ids=ids, attention_mask=mask)
    ref_loss = lm_loss(ref_out, labels)
    assert float(ref_loss) == pytest.approx(own, rel=1e-5)
    ref_loss.backward()
    ref_opt.step()

    model, opt = build()
    device = Device(limit=5)

    @retry_on_oom(optimizer=opt, items=lambda b: (b["labels"][:, 1:] != -100).sum())
    def step(b: dict[str, torch.Tensor]) -> torch.Tensor:
        device.check(len(b["input_ids"]))
        opt.zero_grad()
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])  # ModelOutput
        loss = lm_loss(out, b["labels"])
        loss.backward()
        opt.step()
        return loss.detach()

    loss = step(batch)
    assert device.sizes == [12, 6, 3, 3, 3, 3]
    assert float(loss) == pytest.approx(float(ref_loss.detach()), rel=1e-12)
    _same(_params(model), _params(reference))


def test_a_compiled_model_compiles_once_and_failed_attempts_leave_its_buffers() -> None:
    compiles = [0]

    def backend(graph: Any, inputs: Any) -> Any:
        compiles[0] += 1
        return graph.forward

    model = _bn_model()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    limit = [100]

    @retry_on_oom(optimizer=opt)
    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        out = compiled(x)
        if len(x) > limit[0]:
            raise _oom()  # after the forward: the running statistics moved
        out.square().mean().backward()
        opt.step()

    for _ in range(3):
        step(torch.randn(32, 5))
    tracked = int(model[1].num_batches_tracked)
    limit[0] = 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(torch.randn(32, 5))
    assert step.stats.ooms == 2  # 32, then 16
    assert int(model[1].num_batches_tracked) == tracked + 4  # four pieces of 8, nothing else
    assert compiles[0] == 1


# --------------------------------------------------------------------------------------------
# Pieces, options, loss modules


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 300), limit=st.integers(1, 64), min_batch=st.integers(1, 16))
def test_pieces_are_balanced_and_never_below_min_batch(
    total: int, limit: int, min_batch: int
) -> None:
    sizes = _Sizes(min_batch=min_batch, grow_after=None, headroom=0.0)
    sizes.states["k"] = _KeyState(eps=1, limit=max(limit, min_batch))
    pieces = []
    while sum(pieces) < total:
        pieces.append(sizes.piece("k", 1, total - sum(pieces), None))
    assert sum(pieces) == total
    assert max(pieces) - min(pieces) <= 1
    if total >= min_batch:
        assert min(pieces) >= min_batch
    if max(limit, min_batch) >= 2 * min_batch - 1:  # room for balanced pieces within the limit
        assert max(pieces) <= max(limit, min_batch)


def test_a_list_of_optimizers_is_validated() -> None:
    a = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    b = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    assert retry_on_oom(optimizer=[a, b])(lambda x: x).options.optimizers == (a, b)
    assert retry_on_oom(optimizer=(a,))(lambda x: x).options.policy == "accumulate"
    for bad in ([], [a, a], [a, "sgd"], "sgd", 3):
        with pytest.raises(TypeError, match="optimizer"):
            retry_on_oom(optimizer=bad)  # type: ignore[arg-type]


def test_a_loss_module_with_parameters_in_the_optimizer_is_exact() -> None:
    def build() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(6)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8))
        criterion = _ProxyLoss()
        opt = torch.optim.AdamW([*model.parameters(), *criterion.parameters()], lr=1e-2)
        return model, criterion, opt

    def run(model: nn.Module, criterion: nn.Module, opt: torch.optim.Optimizer, b: Any) -> None:
        opt.zero_grad()
        criterion(model(b[0]), b[1]).backward()
        nn.utils.clip_grad_norm_([*model.parameters(), *criterion.parameters()], 0.3)
        opt.step()

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(18, 6, generator=g), torch.randint(0, 4, (18,), generator=g))
               for _ in range(3)]
    reference = build()
    for b in batches:
        run(*reference, b)
    model, criterion, opt = build()
    device = Device(limit=5)

    @retry_on_oom(optimizer=opt)
    def step(b: Any) -> None:
        device.check(len(b[0]))
        run(model, criterion, opt, b)

    for b in batches:
        step(b)
    assert step.stats.ooms >= 1
    _same(_params(model, criterion), _params(reference[0], reference[1]))


class _ProxyLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proxies = nn.Parameter(torch.randn(4, 8))
        self.log_temperature = nn.Parameter(torch.tensor(-1.0))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.normalize(out, dim=1) @ self.proxies.T
        return nn.functional.cross_entropy(logits / self.log_temperature.exp(), target)


# --------------------------------------------------------------------------------------------
# A function that only computes gradients: the caller steps, and may accumulate over calls


def _grad_only_run(limit: int | None, accumulate: int) -> tuple[nn.Module, Any, Device]:
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    device = Device(10**9 if limit is None else limit)

    def forward_backward(b: Any) -> torch.Tensor:
        device.check(len(b[0]))
        loss = nn.functional.cross_entropy(model(b[0]), b[1]) / accumulate
        loss.backward()
        return loss.detach()

    fn = forward_backward if limit is None else retry_on_oom(policy="accumulate", model=model)(
        forward_backward
    )
    return model, fn, device


@pytest.mark.parametrize("accumulate", [1, 3])
def test_gradients_only_add_up_across_calls_like_the_unsplit_run(accumulate: int) -> None:
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
               for n in (12, 20, 12, 16, 20, 12)]

    def train(model: nn.Module, fn: Any) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        for i, b in enumerate(batches):
            fn(b)  # the caller accumulates over `accumulate` calls, then steps
            if (i + 1) % accumulate == 0:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

    reference, ref_fn, _ = _grad_only_run(None, accumulate)
    train(reference, ref_fn)
    model, fn, device = _grad_only_run(14, accumulate)
    train(model, fn)
    assert fn.stats.ooms >= 1
    assert any(n > 14 for n in device.sizes)
    assert max(device.sizes[-5:]) <= 14
    _same(_params(model), _params(reference))


@pytest.mark.parametrize("at_op", [2, 6, 11])
def test_gradients_only_an_oom_in_backward_keeps_the_accumulated_gradients_exact(at_op: int) -> None:
    """Backward runs out of memory after autograd began adding into the gradients the caller
    accumulated over earlier calls: they are kept apart from the failed backward, so the
    batch is retried in micro-batches and the sum is exact (it used to be refused)."""
    reference, ref_fn, _ = _grad_only_run(None, 2)
    model, fn, _ = _grad_only_run(10**9, 2)
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(3)]
    for b in batches[:2]:
        ref_fn(b)
        fn(b)  # the gradients of the first calls, not stepped yet
    ref_fn(batches[2])
    with inject_oom(phase="backward", at_op=at_op) as fault:
        fn(batches[2])
    assert fault.fired == 1
    assert fn.stats.ooms == 1
    _same([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


def test_gradients_only_a_forward_oom_keeps_the_accumulated_gradients_exact() -> None:
    reference, ref_fn, _ = _grad_only_run(None, 2)
    model, fn, device = _grad_only_run(100, 2)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    ref_fn((x, y))
    fn((x, y))
    device.limit = 4
    ref_fn((x, y))
    fn((x, y))  # runs out before backward: split, added to the gradients of the first call
    assert fn.stats.ooms == 1
    _same([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


@pytest.mark.parametrize(("phase", "at_op"), [("forward", 1), ("backward", 2), ("backward", 6)])
def test_gradients_only_an_oom_in_a_first_micro_batch_keeps_the_accumulated_gradients(
    phase: str, at_op: int
) -> None:
    """A batch that already runs in micro-batches runs out of memory in its first one, before
    its backward or after the last layer's gradients joined the sum: the gradients the caller
    accumulated over earlier calls are kept (they were lost, before and after a restart)."""
    reference, ref_fn, _ = _grad_only_run(None, 2)
    model, fn, device = _grad_only_run(4, 2)
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(2)]
    ref_fn(batches[0])
    fn(batches[0])  # runs out whole: micro-batches of 4 from now on
    ref_fn(batches[1])
    with inject_oom(phase=phase, at_op=at_op) as fault:
        fn(batches[1])
    assert fault.fired == 1
    assert fn.stats.ooms == 2
    assert device.sizes[-5:] == [4, 2, 2, 2, 2]  # the first micro-batch failed: four of 2 ran
    _same([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


def test_gradients_only_needs_the_model_and_refuses_an_optimizer_step() -> None:
    with pytest.raises(ValueError, match="model="):
        retry_on_oom(policy="accumulate")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = Device(limit=2)

    @retry_on_oom(policy="accumulate", model=model)
    def step(x: torch.Tensor) -> None:
        device.check(len(x))
        model(x).mean().backward()
        opt.step()

    with pytest.raises(AutobatchError, match=r"SGD\.step\(\)"):
        step(torch.randn(4, 4))


def test_every_recovered_oom_is_one_warning_with_the_batch_shapes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    device = Device(limit=3)

    @retry_on_oom
    def step(b: dict[str, Any]) -> None:
        device.check(len(b["x"]))

    with caplog.at_level("WARNING", logger="autobatch"):
        step({"x": torch.zeros(8, 5), "ids": list(range(8))})
        step({"x": torch.zeros(8, 5), "ids": list(range(8))})  # no new OOM: nothing to say
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2  # 8 -> 4 -> 2
    assert all("(8, 5)" in r.getMessage() and "ran out of memory" in r.getMessage()
               for r in warned)
