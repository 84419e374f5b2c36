"""What a search must leave as it found it, beyond parameters and optimizer state: a module's
hidden state kept as a tuple (an LSTM's ``(h, c)``), tensors in a dict it updates in place,
containers of tensors a trial's forward set (and the device memory they hold), a step's own
random generators; a cache hit whose recommended size no longer trains; and ``fits`` below the
sizes the allocator's replay speaks for."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autobatch
from autobatch import SearchResult
from autobatch._search import Trial, Verdicts
from autobatch.testing import SimulatedGPU


class _Stateful(nn.Module):
    """Keeps an LSTM's hidden state as a tuple, running statistics in a dict, and caches of
    tensors its forward sets on names it did not have."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 4)
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None
        self.running = {"mean": torch.zeros(32), "count": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden if self.hidden is not None and self.hidden[0].shape[1] == len(x) \
            else None
        out, (h, c) = self.lstm(x, hidden)
        self.hidden = (h.detach(), c.detach())
        self.running["mean"].mul_(0.9).add_(0.1 * out.detach().mean((0, 1)))
        self.running["count"] += 1
        self.kv = (h.detach(), 2 * h.detach())  # (new names: let go after the search)
        self.maps = [h.detach()]
        return self.head(out[:, -1])


def test_tuple_dict_and_new_container_attributes_are_put_back_and_let_go() -> None:
    torch.manual_seed(0)
    with SimulatedGPU("16MiB") as gpu:
        model = _Stateful()
        opt = torch.optim.Adam(model.parameters())
        gpu.adopt(model, opt)
        x, y = torch.randn(4, 6, 16), torch.randint(0, 4, (4,))
        F.cross_entropy(model(x), y).backward()  # (one user step at 4 rows)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del model.kv, model.maps
        hidden = model.hidden
        assert hidden is not None
        h, c = hidden[0].clone(), hidden[1].clone()
        mean = model.running["mean"].clone()
        allocated = torch.cuda.memory_allocated()
        result = autobatch.search_batch_size(model, (x, y), opt, loss_fn=F.cross_entropy)
        assert result.max_batch_size > 4
        assert model.hidden is hidden
        assert torch.equal(hidden[0], h)
        assert torch.equal(hidden[1], c)
        assert torch.equal(model.running["mean"], mean)
        assert model.running["count"] == 1
        assert not hasattr(model, "kv")
        assert not hasattr(model, "maps")
        assert torch.cuda.memory_allocated() == allocated


def test_a_step_s_own_random_generators_are_as_before() -> None:
    generator, python, numpy = torch.Generator().manual_seed(1), random.Random(2), \
        np.random.default_rng(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model: nn.Module, batch: Any) -> None:
        x, y = batch
        noise = torch.randn(x.shape, generator=generator) * python.random() * numpy.random()
        opt.zero_grad()
        F.cross_entropy(model(x + noise), y).backward()
        opt.step()

    states = generator.get_state(), python.getstate(), numpy.bit_generator.state
    with SimulatedGPU("4MiB") as gpu:
        gpu.adopt(model, opt)
        autobatch.search_batch_size(model, (torch.randn(4, 8), torch.randint(0, 4, (4,))), opt,
                                    step_fn=step)
    assert torch.equal(generator.get_state(), states[0])
    assert python.getstate() == states[1]
    assert numpy.bit_generator.state == states[2]


_CONFIG = {"extra_below": 0}  # (a global the step reads: the cache's key cannot see it)


def _config_step(opt: torch.optim.Optimizer) -> Any:
    def step(model: nn.Module, batch: Any) -> None:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if len(x) < _CONFIG["extra_below"]:  # (memory only smaller batches pay)
            loss = loss + 0 * x.repeat(1, 8).square().mean()
        loss.backward()
        opt.step()
    return step


def test_a_cache_hit_whose_recommended_size_no_longer_trains_is_measured_again(
    tmp_path: Any,
) -> None:
    def search() -> SearchResult:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10))
        with SimulatedGPU("24MiB") as gpu:
            gpu.adopt(model)
            opt = torch.optim.AdamW(model.parameters())
            return autobatch.search_batch_size(
                model, (torch.randn(4, 128), torch.randint(0, 10, (4,))), opt,
                step_fn=_config_step(opt), cache=tmp_path)

    _CONFIG["extra_below"] = 0
    first = search()
    _CONFIG["extra_below"] = first.max_batch_size - 1  # (the largest unchanged, the rest more)
    try:
        again = search()
    finally:
        _CONFIG["extra_below"] = 0
    assert not any("from the cache" in note for note in again.notes)
    assert again.batch_size < first.batch_size


@pytest.mark.parametrize("padded", [False, True])
def test_fits_below_the_replay_s_trials_only_where_it_gives_the_smaller_trials(
    padded: bool,
) -> None:
    """A replay worked out from trials near the largest size speaks for smaller sizes only
    where it also gives the smaller trials' peaks (an MLP's line; not a model that pads its
    batch to 48 rows, whose small trials peak higher than the line)."""
    replay = Verdicts(lambda n: (n, 2 * n) if n <= 40 else None, floor=30)
    trials = (Trial(4, True, 48 if padded else 4, reserved_bytes=96 if padded else 8),
              Trial(30, True, 30, curve=replay, reserved_bytes=60),
              Trial(40, True, 40, reserved_bytes=80), Trial(41, False))
    result = SearchResult(40, 36, trials, None, 100, "cuda:0", 0.0, True, True)
    below = None if padded else True
    assert [result.fits(n) for n in (4, 20, 35, 41, 50)] == [True, below, True, False, False]


@pytest.mark.parametrize("dtype", [torch.float32])
def test_the_lstm_model_trains_at_the_size_found(dtype: torch.dtype) -> None:
    """(The state put back is the user's: the next step reads the hidden state it left.)"""
    torch.manual_seed(0)
    with SimulatedGPU("16MiB") as gpu:
        model = _Stateful().to(dtype)
        opt = torch.optim.Adam(model.parameters())
        gpu.adopt(model, opt)
        x, y = torch.randn(4, 6, 16), torch.randint(0, 4, (4,))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        autobatch.search_batch_size(model, (x, y), opt, loss_fn=F.cross_entropy)
        F.cross_entropy(model(x), y).backward()  # (the hidden state of 4 rows, as left)
