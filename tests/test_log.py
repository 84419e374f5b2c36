"""What reaches the user: WARNING and above with no logging set up (once), nothing twice once
logging is set up, rank 0 only, and the user's own function named in messages."""

from __future__ import annotations

import doctest
import functools
import inspect
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import autobatch._log
from autobatch import retry_on_oom, search_batch_size
from autobatch._log import get_logger, named_after, shown, user_name
from autobatch.testing import SimulatedGPU

#: A recovered OOM, as the recovery engine logs it, and the other lines a run may show.
RECOVERED = "ran out of memory; micro-batch size"
NO_OPTIMIZER = "a training search without an optimizer"

#: A user's script, run three times in one fresh interpreter: with no logging set up, with
#: ``logging.basicConfig(level=INFO)`` and ``progress=True``, and with the ``autobatch`` logger
#: silenced. Each run: a step that runs out of memory and recovers, and a search without an
#: optimizer. A line on stderr starts each run.
SCRIPT = """
import json
import logging
import re
import sys
import torch
import autobatch
from autobatch import retry_on_oom, search_batch_size
from autobatch.testing import SimulatedGPU

def train_step(batch):
    opt.zero_grad()
    model(batch).square().mean().backward()
    opt.step()

def run(name, progress):
    global model, opt
    print(f"=== {name}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch, sample = torch.randn(12000, 64), torch.randn(2, 64)  # (activations of 12 MB)
    with SimulatedGPU("32MiB") as gpu:
        gpu.adopt(model)
        step = retry_on_oom(optimizer=opt)(train_step)
        step(batch)
        result = autobatch.search_batch_size(model, sample, max_batch=4096, progress=progress)
    print(json.dumps({"run": name, "ooms": step.stats.ooms, "changes": step.stats.changes,
                      "trials": len(result.trials),
                      "function": step.stats.history[0].function}), flush=True)

run("nothing set up", progress=False)
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
run("logging at INFO, progress", progress=True)
logging.getLogger("autobatch").setLevel(logging.ERROR)
run("silenced", progress=False)
"""


def _lines(lines: list[str], text: str) -> list[str]:
    return [line for line in lines if text in line]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def _printed(code: str) -> tuple[dict[str, str], list[str]]:
    """Run ``code``: its ``key value`` lines on stdout, and its stderr lines."""
    done = _run(code)
    printed = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    return printed, done.stderr.splitlines()


@pytest.fixture(scope="module")
def script_runs() -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Each run of :data:`SCRIPT`: what it printed, and its stderr lines."""
    done = _run(SCRIPT)
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    runs = done.stderr.split("=== ")[1:]
    assert len(printed) == len(runs) == 3, done.stderr
    return {
        p["run"]: (p, text.splitlines()[1:])
        for p, text in zip(printed, runs, strict=True)
    }


def test_with_no_logging_set_up_warnings_reach_stderr_once_and_info_stays_quiet(
    script_runs: dict[str, tuple[dict[str, Any], list[str]]],
) -> None:
    printed, err = script_runs["nothing set up"]
    assert printed["ooms"] == 1
    assert printed["changes"] > 1  # the micro-batch size was refined too: INFO lines
    recovered = _lines(err, RECOVERED)
    assert len(recovered) == 1, err
    assert recovered[0].startswith("__main__.train_step: ")  # the user's function
    assert printed["function"] == "__main__.train_step"
    assert len(_lines(err, NO_OPTIMIZER)) == 1, err
    assert err == [*recovered, *_lines(err, NO_OPTIMIZER)], err  # nothing at INFO


def test_with_logging_set_up_and_progress_no_line_is_shown_twice(
    script_runs: dict[str, tuple[dict[str, Any], list[str]]],
) -> None:
    printed, err = script_runs["logging at INFO, progress"]
    assert len(_lines(err, RECOVERED)) == 1, err
    assert len(_lines(err, NO_OPTIMIZER)) == 1, err
    # every trial once, through the log; progress adds no line of its own
    trial_lines = [line for line in err if line.startswith("autobatch.trial INFO")]
    assert len(trial_lines) == printed["trials"], err
    assert not _lines(err, "autobatch: trial"), err
    # every change of the micro-batch size once: the recovered OOM and the refinements
    recovery = [line for line in err if line.startswith("autobatch.recovery ")]
    assert len(recovery) == printed["changes"], err
    assert len(_lines(recovery, "(refine)")) == printed["changes"] - 1, err


def test_silencing_the_autobatch_logger_silences_everything(
    script_runs: dict[str, tuple[dict[str, Any], list[str]]],
) -> None:
    printed, err = script_runs["silenced"]
    assert printed["ooms"] == 1
    assert err == [], err


def test_with_warnings_only_shown_progress_shows_each_trial_once(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    model = torch.nn.Linear(64, 10)
    with caplog.at_level(logging.WARNING, logger="autobatch"), SimulatedGPU("4MiB") as gpu:
        gpu.adopt(model)
        result = search_batch_size(model, torch.randn(2, 64), torch.optim.SGD, max_batch=4096,
                                   progress=True)
    err = capsys.readouterr().err.splitlines()
    assert len(_lines(err, "autobatch: trial")) == len(result.trials), err
    assert not [r for r in caplog.records if r.name == "autobatch.trial"]


def test_with_trials_logged_progress_adds_no_line(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    model = torch.nn.Linear(64, 10)
    with caplog.at_level(logging.INFO, logger="autobatch"), SimulatedGPU("4MiB") as gpu:
        gpu.adopt(model)
        result = search_batch_size(model, torch.randn(2, 64), torch.optim.SGD, max_batch=4096,
                                   progress=True)
    assert not _lines(capsys.readouterr().err.splitlines(), "autobatch: trial")
    logged = [r for r in caplog.records if r.name == "autobatch.trial"]
    assert [r.args[0] for r in logged] == list(result.trials)  # type: ignore[index]


# In one process ---------------------------------------------------------------------------


def test_module_doctests() -> None:
    result = doctest.testmod(autobatch._log)
    assert result.attempted > 0
    assert result.failed == 0


def test_no_handler_of_our_own() -> None:
    for name in ("autobatch", "autobatch.recovery", "autobatch.trial", "autobatch.finder"):
        assert logging.getLogger(name).handlers == [], name
    assert logging.getLogger("autobatch").propagate


class _Callable:
    def __call__(self, batch: torch.Tensor) -> None:
        pass


class _Model:
    def training_step(self, batch: torch.Tensor) -> None:
        pass


def _top_level(batch: torch.Tensor) -> None:
    pass


def test_user_name_is_module_and_qualified_name() -> None:
    def nested(batch: torch.Tensor) -> None:
        pass

    here = __name__
    assert user_name(_top_level) == f"{here}._top_level"
    assert user_name(nested) == f"{here}.{nested.__qualname__}"
    assert user_name(_Model().training_step) == f"{here}._Model.training_step"
    assert user_name(functools.partial(_top_level)) == f"{here}._top_level"
    assert user_name(_Callable()) == f"{here}._Callable"
    assert user_name(torch.nn.functional.relu) == "torch.nn.functional.relu"


def test_named_after_keeps_the_wrappers_signature() -> None:
    def wrapper(batch: Any, *args: Any, **kwargs: Any) -> None:
        pass

    named = named_after(wrapper, _Model().training_step)
    assert named is wrapper
    assert user_name(named) == f"{__name__}._Model.training_step"
    assert list(inspect.signature(named).parameters) == ["batch", "args", "kwargs"]
    assert not hasattr(named, "__wrapped__")


def test_recovery_history_and_messages_name_the_users_function(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = torch.nn.Linear(32, 32)

    def train_step(batch: torch.Tensor) -> None:
        model(batch).sum().backward()

    batch = torch.randn(262144, 32)  # its output (32 MiB) does not fit; an eighth of it does
    with caplog.at_level(logging.WARNING, logger="autobatch"), SimulatedGPU("24MiB") as gpu:
        gpu.adopt(model)
        step = retry_on_oom(train_step)
        step(batch)
    expected = f"{__name__}.{train_step.__qualname__}"
    assert step.stats.ooms == 1
    assert {change.function for change in step.stats.history} == {expected}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert warned[0].startswith(f"{expected}: ran out of memory")
    assert expected in repr(step)


@pytest.fixture
def handler() -> Iterator[logging.Handler]:
    handler = logging.Handler(logging.INFO)
    yield handler
    for name in ("", "autobatch", "autobatch.trial"):
        logging.getLogger(name).removeHandler(handler)
    logging.getLogger("autobatch").setLevel(logging.NOTSET)
    logging.getLogger("autobatch").propagate = True


def test_shown_counts_only_configured_handlers(
    handler: logging.Handler, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a script that configured nothing
    monkeypatch.setattr(root, "level", logging.WARNING)
    trial = get_logger("trial")
    assert not shown(trial, logging.WARNING)  # the last-resort handler does not count
    logging.getLogger("autobatch").setLevel(logging.INFO)
    assert not shown(trial, logging.INFO)
    root.addHandler(handler)
    assert shown(trial, logging.INFO)
    handler.setLevel(logging.WARNING)
    assert not shown(trial, logging.INFO)  # the handler would drop it
    assert shown(trial, logging.WARNING)
    logging.getLogger("autobatch").propagate = False
    assert not shown(trial, logging.WARNING)  # the root's handler is not reached


def test_only_rank_zero_logs(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = get_logger("recovery")
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        monkeypatch.setattr(autobatch._distributed, "rank", lambda: 1)
        logger.warning("on rank 1")
        monkeypatch.setattr(autobatch._distributed, "rank", lambda: 0)
        logger.warning("on rank 0")
    assert [r.getMessage() for r in caplog.records] == ["on rank 0"]


# Inside the frameworks (a fresh interpreter each: seconds) ---------------------------------

LIGHTNING = """
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from autobatch.integrations.lightning import AutobatchCallback
from autobatch.testing import SimulatedGPU

torch.set_num_threads(1)

class Net(pl.LightningModule):
    def __init__(self, batch_size):
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(16, 4096), nn.Tanh(), nn.Linear(4096, 4))
        g = torch.Generator().manual_seed(3)
        self.data = TensorDataset(torch.randn(192, 16, generator=g),
                                  torch.randint(0, 4, (192,), generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

def fit(module, callback):
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with SimulatedGPU("4MiB") as gpu:
        gpu.adopt(module)
        trainer.fit(module)

found = AutobatchCallback(guard=False)
fit(Net(64), found)
guard = AutobatchCallback(find=False)
fit(Net(192), guard)
print("size", found.batch_size)
print("ooms", guard.stats.ooms)
print("function", guard.stats.history[0].function)
"""

TRAINER = """
import tempfile
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from autobatch.integrations.transformers import autobatch_trainer, recovery_stats
from autobatch.testing import SimulatedGPU

torch.set_num_threads(1)

def model():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)

ids = torch.randint(0, 64, (96, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(96)]

def trainer(m, batch, root):
    args = TrainingArguments(output_dir=root, per_device_train_batch_size=batch,
                             num_train_epochs=1, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, use_cpu=True, optim="sgd")
    return Trainer(model=m, args=args, train_dataset=data)

with tempfile.TemporaryDirectory() as root:
    m = model()
    with SimulatedGPU("4MiB") as gpu:
        gpu.adopt(m)
        found = autobatch_trainer(trainer(m, 8, root), guard=False)
    m = model()
    with SimulatedGPU("4MiB") as gpu:
        gpu.adopt(m)
        guarded = autobatch_trainer(trainer(m, 96, root), find=False)
        guarded.train()
print("size", found.args.per_device_train_batch_size)
print("ooms", recovery_stats(guarded).ooms)
print("function", recovery_stats(guarded).history[0].function)
"""


@pytest.mark.slow
def test_lightning_size_and_recovered_oom_reach_stderr_once() -> None:
    pytest.importorskip("lightning.pytorch")
    printed, err = _printed(LIGHTNING)
    chosen = _lines(err, "AutobatchCallback set the batch size to")
    assert len(chosen) == 1, err
    assert f"batch size to {printed['size']} in 'batch_size'" in chosen[0]
    assert printed["ooms"] == "1"
    recovered = _lines(err, RECOVERED)
    assert len(recovered) == 1, err
    assert recovered[0].startswith("__main__.Net.training_step: "), recovered  # not our _Guard
    assert printed["function"] == "__main__.Net.training_step"


@pytest.mark.slow
def test_trainer_size_and_recovered_oom_reach_stderr_once() -> None:
    pytest.importorskip("transformers")
    printed, err = _printed(TRAINER)
    chosen = _lines(err, "autobatch_trainer set per_device_train_batch_size to")
    assert len(chosen) == 1, err
    assert f"per_device_train_batch_size to {printed['size']} " in chosen[0]
    assert printed["ooms"] == "1"
    recovered = _lines(err, RECOVERED)
    assert len(recovered) == 1, err
    name = "transformers.trainer.Trainer.training_step"  # the trainer's step, not our wrapper
    assert recovered[0].startswith(f"{name}: "), recovered
    assert printed["function"] == name


def test_the_logging_page_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "logging.md").read_text()
    examples = re.findall(r"```python\n(.+?)```", page, flags=re.DOTALL)
    assert examples
    top = logging.getLogger("autobatch")
    try:
        for index, code in enumerate(examples):
            exec(compile(code, f"docs/logging.md example {index}", "exec"), {"__name__": "docs"})
    finally:
        top.setLevel(logging.NOTSET)
    out = capsys.readouterr().out
    assert "True" in out
    assert "False" not in out
