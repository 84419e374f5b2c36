"""Watching a search: ``on_trial`` gets every trial as it ends, ``progress=True`` shows them."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

from autobatch import find_max_batch, search_batch_size
from autobatch._records._progress import TrialProgress
from autobatch.search import Trial
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import mlp

CE = nn.functional.cross_entropy


def _setup() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return mlp(), (torch.randn(4, 128), torch.randint(0, 10, (4,)))


def test_on_trial_receives_every_trial_as_it_ends() -> None:
    model, sample = _setup()
    seen: list[Trial] = []
    sizes_then: list[int] = []

    def watch(trial: Trial) -> None:
        seen.append(trial)
        sizes_then.append(len(seen))

    with SimulatedGPU("6MiB", allocator="exact") as gpu:  # (no replay: the failing size runs)
        gpu.adopt(model)
        result = search_batch_size(model, sample, torch.optim.Adam, loss_fn=CE, on_trial=watch)
    assert seen == list(result.trials)
    assert sizes_then == list(range(1, len(seen) + 1))
    assert any(not t.fits for t in seen)
    assert any(t.fits for t in seen)


def test_progress_prints_one_plain_line_per_trial_without_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, sample = _setup()
    with SimulatedGPU("6MiB") as gpu:
        gpu.adopt(model)
        result = search_batch_size(model, sample, torch.optim.Adam, loss_fn=CE, progress=True)
    lines = capsys.readouterr().err.splitlines()
    trial_lines = [line for line in lines if line.startswith("autobatch: trial")]
    assert len(trial_lines) == len(result.trials)
    for line, trial in zip(trial_lines, result.trials, strict=True):
        assert f"batch {trial.size:>6}" in line
        assert ("fits" in line) == trial.fits
        assert ("OOM" in line) == (not trial.fits)


def test_progress_bar_on_a_terminal_counts_trials() -> None:
    pytest.importorskip("tqdm")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    shown = TrialProgress(stream)
    shown(Trial(8, True, 1024, 0.01))
    shown(Trial(16, False, None, 0.02, "OOM"))
    shown.close()
    text = stream.getvalue()
    last = text.rsplit("\r", 1)[-1]
    assert last.startswith("autobatch search: 2trial")
    assert "batch     16: OOM" in last
    assert "autobatch: trial" not in text  # the bar, not plain lines


def test_find_max_batch_takes_the_same_watchers(capsys: pytest.CaptureFixture[str]) -> None:
    model, sample = _setup()
    seen: list[Trial] = []
    with SimulatedGPU("6MiB") as gpu:
        gpu.adopt(model)
        size = find_max_batch(model, sample, torch.optim.Adam, loss_fn=CE, on_trial=seen.append,
                              progress=True)
    assert seen
    assert size <= max(t.size for t in seen if t.fits)
    assert capsys.readouterr().err.count("autobatch: trial") == len(seen)


def test_a_cached_answer_runs_one_trial_at_its_largest_and_recommended_sizes(
    tmp_path: Path,
) -> None:
    model, sample = _setup()
    first: list[Trial] = []
    again: list[Trial] = []
    with SimulatedGPU("6MiB") as gpu:
        gpu.adopt(model)
        search_batch_size(model, sample, torch.optim.Adam, loss_fn=CE, cache=tmp_path,
                          on_trial=first.append)
        search_batch_size(model, sample, torch.optim.Adam, loss_fn=CE, cache=tmp_path,
                          on_trial=again.append)
    assert first
    largest = max(t.size for t in first if t.fits)
    recommended = first[-1].size
    assert [(t.size, t.fits) for t in again] == [(largest, True), (recommended, True)]


def test_a_failing_watcher_stops_the_search_and_leaves_the_state() -> None:
    model, sample = _setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def broken(trial: Trial) -> None:
        raise RuntimeError("watcher broke")

    with SimulatedGPU("6MiB") as gpu:
        gpu.adopt(model)
        baseline = gpu.allocated_bytes
        with pytest.raises(RuntimeError, match="watcher broke"):
            search_batch_size(model, sample, torch.optim.Adam, loss_fn=CE, on_trial=broken)
        assert gpu.allocated_bytes == baseline
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("option", "value"), [("on_trial", 3), ("progress", "yes")])
def test_bad_watchers_are_refused(option: str, value: object) -> None:
    model, sample = _setup()
    with SimulatedGPU("6MiB") as gpu:
        gpu.adopt(model)
        with pytest.raises(TypeError, match=option):
            search_batch_size(model, sample, torch.optim.Adam, loss_fn=CE, **{option: value})


def test_search_batch_sizes_shows_every_lengths_trials() -> None:
    from autobatch import search_batch_sizes
    from autobatch.testing.models import transformer

    torch.manual_seed(0)
    model = transformer(d_model=16, layers=1)
    seen: list[Trial] = []

    def sample_for(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 100, (2, length)), torch.randint(0, 10, (2,))

    with SimulatedGPU("8MiB") as gpu:
        gpu.adopt(model)
        table = search_batch_sizes(model, sample_for, [16, 32], torch.optim.Adam, loss_fn=CE,
                                   on_trial=seen.append)
    assert [t.size for t in seen] == [t.size for t in table.trials]
