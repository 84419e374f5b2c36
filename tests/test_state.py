"""What a search leaves behind: every parameter it could touch, and the same gradient objects."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import autobatch
from autobatch._memory._accounting import round_allocation
from autobatch._sizing._state import SavedState
from autobatch.testing import SimulatedGPU


class ProxyLoss(nn.Module):
    """A loss with learnable parameters (class proxies and a temperature), trained with the model."""

    def __init__(self, classes: int = 10, dim: int = 10) -> None:
        super().__init__()
        self.proxies = nn.Parameter(torch.randn(classes, dim))
        self.temperature = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        logits = nn.functional.normalize(out, dim=1) @ self.proxies.T / self.temperature
        return nn.functional.cross_entropy(logits, target)


def _state(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def test_a_loss_module_in_the_optimizer_is_restored_bit_for_bit() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    loss = ProxyLoss()
    opt = torch.optim.AdamW([*model.parameters(), *loss.parameters()], lr=0.1)
    sample = (torch.randn(4, 32), torch.randint(0, 10, (4,)))
    before = _state(*model.parameters(), *loss.parameters(), *loss.buffers())
    with SimulatedGPU("4MiB", adopt=[model, loss, opt]) as gpu:  # two small-pool segments
        baseline = gpu.allocated_bytes
        n = autobatch.find_max_batch(model, sample, opt, loss_fn=loss, max_batch=4096)
        assert gpu.allocated_bytes == baseline
    assert n > 4
    after = _state(*model.parameters(), *loss.parameters(), *loss.buffers())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(p.grad is None for p in loss.parameters())
    assert not opt.state


def test_parameters_only_the_optimizer_holds_are_restored() -> None:
    model = nn.Linear(8, 8)
    scale = nn.Parameter(torch.ones(8))  # used by the step, held by the optimizer only
    opt = torch.optim.SGD([*model.parameters(), scale], lr=0.5, momentum=0.9)
    saved_state = SavedState(model, opt)
    model(torch.randn(4, 8)).mul(scale).sum().backward()
    opt.step()
    saved_state.restore()
    assert torch.equal(scale.detach(), torch.ones(8))
    assert scale.grad is None
    assert not opt.state


def test_gradients_stay_the_same_objects_and_views_of_their_flat_buffer() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    flat = torch.randn(sum(p.numel() for p in params))
    offset = 0
    for p in params:  # gradients as views of one flat buffer (as DDP's bucket views are)
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    own = nn.Linear(16, 4)
    own.weight.grad = torch.randn_like(own.weight)  # a gradient that owns its storage
    grads = [p.grad for p in params]
    own_grad = own.weight.grad
    values = _state(flat, own_grad)
    sample = (torch.randn(2, 16), torch.randint(0, 4, (2,)))
    with SimulatedGPU("4MiB", adopt=[model, opt, own, flat]):
        autobatch.find_max_batch(model, sample, opt, max_batch=512,
                                 loss_fn=nn.functional.cross_entropy)
        saved_state = SavedState(own)
        assert own.weight.grad is None
        assert own_grad.untyped_storage().nbytes() == 0  # its memory is free during trials
        saved_state.restore()
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert all(
        g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for g in grads
    )
    assert own.weight.grad is own_grad
    assert torch.equal(flat, values[0])
    assert torch.equal(own_grad, values[1])


def test_gradients_that_only_share_a_buffer_among_themselves_free_it_and_share_it_again() -> None:
    # As FSDP2's sharded gradients view one reduce-scatter output per group, which nothing
    # else keeps: the trials run without that memory, and the gradients come back as views of
    # one buffer with the same bytes.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    params = list(model.parameters())
    with SimulatedGPU("4MiB", adopt=[model]) as gpu:
        buffer = torch.randn(sum(p.numel() for p in params) + 7).untyped_storage()
        offset = 0
        for p in params:  # views of the storage that no other tensor holds
            p.grad = torch.empty(0).set_(buffer, offset, p.shape, p.stride())
            offset += p.numel()
        del buffer
        grads = [p.grad for p in params]
        values = _state(*grads)
        held = gpu.allocated_bytes
        saved_state = SavedState(model)
        assert gpu.allocated_bytes == held - round_allocation((offset + 7) * 4)
        saved_state.restore()
        assert gpu.allocated_bytes == held
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1  # one buffer again
    assert all(torch.equal(g, v) for g, v in zip(grads, values, strict=True))


class _Trainer:
    """A trainer-style step: the optimizer and its scheduler on ``self``."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=1e-2, total_steps=1000)
        self.held = {"sched": self.sched}

    def step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.opt.zero_grad()
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss


def _stepped(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
             opt: torch.optim.Optimizer, held: dict[str, object]) -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    held["sched"].step()  # type: ignore[attr-defined]
    return loss


@pytest.mark.parametrize("reached", ["a bound method", "functools.partial, in a dict"])
@pytest.mark.parametrize("passed", [True, False])
def test_an_optimizer_and_scheduler_the_step_reaches_through_self_or_partial_are_put_back(
    reached: str, passed: bool
) -> None:
    """Not only a closure's or a module's globals: a trainer's ``self.opt`` and
    ``self.sched``, and a scheduler in a dict passed through ``functools.partial``, are
    stepped by every trial and put back (the scheduler's last_epoch went 0 -> 20, and the
    user's next learning rate with it)."""
    trainer = _Trainer()
    step_fn = trainer.step if reached == "a bound method" else functools.partial(
        _stepped, opt=trainer.opt, held=trainer.held)
    scheduler = copy.deepcopy(trainer.sched.state_dict())
    groups = copy.deepcopy(trainer.opt.state_dict()["param_groups"])
    sample = (torch.randn(4, 64), torch.randint(0, 10, (4,)))
    with SimulatedGPU("16MiB", adopt=[trainer.model, trainer.opt]):
        autobatch.search_batch_size(
            trainer.model, sample, trainer.opt if passed else None, step_fn=step_fn)
    assert trainer.sched.state_dict() == scheduler
    assert trainer.opt.state_dict()["param_groups"] == groups
    assert not trainer.opt.state


class _Stateful(nn.Module):
    """Truncated back-propagation through time: the last hidden state kept on ``self``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(32, 64, batch_first=True)
        self.head = nn.Linear(64, 10)
        self.hidden: torch.Tensor | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, h = self.rnn(x, self.hidden)
        self.hidden = h.detach()
        self.calls += 1
        return self.head(out[:, -1])


@pytest.mark.parametrize("allocator", ["caching", "exact"])
def test_a_hidden_state_kept_on_the_module_is_put_back_before_every_trial_and_after(
    allocator: str,
) -> None:
    """A trial left ``self.hidden`` at its own size: the next trial, at another size, raised
    torch's shape error, and the user's next step did too."""
    torch.manual_seed(0)
    model = _Stateful()
    opt = torch.optim.Adam(model.parameters())
    sample = (torch.randn(4, 20, 32), torch.randint(0, 10, (4,)))
    with SimulatedGPU("32MiB", allocator=allocator) as gpu:
        gpu.adopt(model, opt)
        before = gpu.allocated_bytes
        result = autobatch.search_batch_size(model, sample, opt,
                                             loss_fn=nn.functional.cross_entropy)
        assert gpu.allocated_bytes == before
    assert len(result.trials) >= 3
    assert model.hidden is None
    assert model.calls == 0


def test_a_search_inside_autocast_leaves_no_cast_weights_behind() -> None:
    """Inside ``torch.autocast`` every trial's forward cached bfloat16 copies of the weights,
    which stayed allocated after the search (274 KB here) until the block ended."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters())
    sample = (torch.randn(4, 256), torch.randint(0, 10, (4,)))
    with SimulatedGPU("32MiB") as gpu, torch.autocast("cpu", dtype=torch.bfloat16):
        gpu.adopt(model, opt)
        before = gpu.allocated_bytes
        autobatch.search_batch_size(model, sample, opt, loss_fn=nn.functional.cross_entropy)
        assert gpu.allocated_bytes == before
