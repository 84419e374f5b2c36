"""The Lightning callback with the real ``lightning.pytorch.Trainer`` on the CPU, under a
simulated GPU: the size it finds, the state it leaves, and training that recovers from OOM."""

from __future__ import annotations

import copy
import doctest
import logging
import math
import random
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from _logs import logging_set_up, nothing_configured
from torch import nn
from torch.nn import functional as F

pl = pytest.importorskip("lightning.pytorch")  # in the test extra: installed with the tests
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torchmetrics import MeanMetric  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

import autobatch  # noqa: E402
from autobatch import AutobatchError, retry_on_oom  # noqa: E402
from autobatch.integrations.lightning import AutobatchCallback  # noqa: E402
from autobatch.testing import OOM_KINDS, SimulatedGPU  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
    pytest.mark.usefixtures("one_thread", "frozen_heap"),
]


ROWS, FEATURES, CLASSES, HIDDEN = 192, 16, 4, 2048
SMALL = "4MiB"  # a batch of 64 rows does not fit (in 2 MiB segments); a quarter of it does
HALF = "2MiB"  # the same under mixed precision, for a net twice as wide
LARGE = "1GiB"


@pytest.fixture(autouse=True)
def _quiet_lightning() -> Any:
    names = ("lightning", "lightning.pytorch", "lightning.fabric")
    levels = [logging.getLogger(n).level for n in names]
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    for n, level in zip(names, levels, strict=True):
        logging.getLogger(n).setLevel(level)


def _data(rows: int = ROWS) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (rows,), generator=g)
    return TensorDataset(x, y)


class _Net(pl.LightningModule):
    """A float64 classifier whose batch size lives where ``where`` says."""

    def __init__(
        self,
        batch_size: int = 64,
        *,
        where: str = "module",
        dropout: float = 0.0,
        optimizer: str = "sgd",
        dicts: bool = False,
        shuffle: bool = False,
        dtype: torch.dtype = torch.float64,
        metric: bool = False,
        hidden: int = HIDDEN,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        if where == "hparams":
            self.save_hyperparameters({"batch_size": batch_size})
        elif where == "module":
            self.batch_size = batch_size
        self.net = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, CLASSES)
        ).to(dtype)
        self.data = _data()
        self.optimizer_name = optimizer
        self.dicts = dicts
        self.shuffle = shuffle
        self.sizes: list[int] = []  # rows of each training batch (trials excluded)
        self.accuracy = MulticlassAccuracy(num_classes=CLASSES) if metric else None
        self.counted: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = (batch["x"], batch["y"]) if self.dicts else batch
        logits = self.net(x.to(self.net[0].weight.dtype))
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        if self.accuracy is not None:  # updated before backward, where the OOM comes
            self.accuracy(logits, y)
            self.log("train_accuracy", self.accuracy, on_step=False, on_epoch=True)
        if self.dicts:
            self.log("rows", float(len(x)), reduce_fx="sum")
            return {"loss": loss, "preds": logits.argmax(dim=1)}
        return loss

    def on_train_epoch_end(self) -> None:
        if self.accuracy is not None:  # rows the metric counted (before Lightning resets it)
            self.counted.append(int((self.accuracy.tp + self.accuracy.fn).sum()))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.sizes.append(len(batch["x"] if self.dicts else batch[0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def _loader(self, batch_size: int) -> DataLoader[Any]:
        collate = _dict_collate if self.dicts else None
        return DataLoader(self.data, batch_size=batch_size, shuffle=self.shuffle,
                          collate_fn=collate)

    def train_dataloader(self) -> DataLoader[Any]:
        if "batch_size" in self.hparams:
            return self._loader(self.hparams.batch_size)
        return self._loader(self.batch_size)


def _dict_collate(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([r[0] for r in rows]), "y": torch.stack([r[1] for r in rows])}


class _Data(pl.LightningDataModule):
    def __init__(self, module: _Net, batch_size: int) -> None:
        super().__init__()
        self.module = module
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        return self.module._loader(self.batch_size)


class _Memory(Logger):
    """Every metric logged, with its step."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step, {k: float(v) for k, v in metrics.items()}))

    def series(self, name: str) -> list[float]:
        return [m[name] for _, m in self.metrics if name in m]


def _trainer(root: Any, callbacks: list[Any], **options: Any) -> Any:
    memory = _Memory()
    options = {"enable_checkpointing": False, **options}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=memory, log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        callbacks=callbacks, **options,
    )
    return trainer, memory


def _fit(root: Any, module: _Net, capacity: str, callbacks: list[Any], datamodule: Any = None,
         **options: Any) -> tuple[Any, _Memory]:
    trainer, memory = _trainer(root, callbacks, **options)
    with SimulatedGPU(capacity) as gpu:
        gpu.adopt(module)
        trainer.fit(module, datamodule=datamodule)
    return trainer, memory


def _close(a: nn.Module, b: nn.Module, rtol: float = 1e-9, atol: float = 1e-12) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# Finding ------------------------------------------------------------------------------------


class _Reference(pl.Callback):
    """``find_max_batch`` with a hand-written step equal to the module's, on the same sample
    (the first rows of the dataset), run right after the callback (which left everything as it
    was), in the same memory."""

    def on_fit_start(self, trainer: Any, pl_module: _Net) -> None:
        optimizer = trainer.optimizers[0]
        x, y = pl_module.data.tensors

        def step(model: _Net, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model.net(batch[0]), batch[1])
            (loss / trainer.accumulate_grad_batches).backward()
            optimizer.step()

        sample = (x[:64].clone(), y[:64].clone())  # on the device, as the callback's is
        self.found = autobatch.find_max_batch(
            pl_module, sample, optimizer, step_fn=step, max_batch=ROWS
        )


@pytest.mark.parametrize("where", ["module", "hparams", "datamodule"])
def test_find_sets_the_size_find_max_batch_finds_on_the_same_step(tmp_path: Any, where: str) -> None:
    module = _Net(where=where)
    data = _Data(module, 64) if where == "datamodule" else None
    ours, reference = AutobatchCallback(guard=False), _Reference()
    trainer, memory = _fit(tmp_path, module, SMALL, [ours, reference], datamodule=data)
    assert ours.result is not None
    # exact: the size above ran out of memory, in a trial or in the allocator's replay
    assert ours.result.smallest_failing == ours.result.max_batch_size + 1
    assert 1 < ours.batch_size == reference.found < 64
    held = {"module": lambda: module.batch_size, "hparams": lambda: module.hparams.batch_size,
            "datamodule": lambda: data.batch_size}[where]()
    assert held == ours.batch_size
    assert set(module.sizes[:-1]) == {ours.batch_size}  # the loader was built with it
    assert sum(module.sizes) == ROWS
    assert trainer.global_step == math.ceil(ROWS / ours.batch_size)
    assert memory.series("autobatch/batch_size") == [ours.batch_size]
    assert memory.series("autobatch/max_batch_size") == [ours.result.max_batch_size]


class _Probe(pl.Callback):
    """Everything a search could move, copied at ``on_fit_start``."""

    def on_fit_start(self, trainer: Any, pl_module: _Net) -> None:
        self.state = {
            "parameters": [p.detach().clone() for p in pl_module.parameters()],
            "grads": [p.grad for p in pl_module.parameters()],
            "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "global_step": trainer.global_step,
            "loop": copy.deepcopy(trainer.fit_loop.state_dict()),
            "training": pl_module.training,
            "scaler": (trainer.precision_plugin.scaler.get_scale()
                       if getattr(trainer.precision_plugin, "scaler", None) else None),
        }


def test_find_leaves_weights_optimizer_rng_and_counters_as_they_were(tmp_path: Any) -> None:
    module = _Net(dropout=0.2, optimizer="adam", shuffle=True)
    before, after = _Probe(), _Probe()
    ours = AutobatchCallback(guard=False)
    # (no training after: the probes' copies are on the simulated device, unplanned for)
    _fit(tmp_path, module, SMALL, [before, ours, after], limit_train_batches=0)
    assert ours.result is not None
    assert len(ours.result.trials) >= 3
    a, b = before.state, after.state
    assert all(torch.equal(p, q) for p, q in zip(a["parameters"], b["parameters"], strict=True))
    assert a["grads"] == b["grads"] == [None] * 4
    assert a["optimizer"]["state"] == b["optimizer"]["state"] == {}  # Adam's state not created
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["python_rng"] == b["python_rng"]
    assert (a["global_step"], a["loop"], a["training"]) == (b["global_step"], b["loop"], b["training"])


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_find_runs_the_step_in_the_precision_plugins_context(tmp_path: Any, precision: str) -> None:
    module = _Net(dtype=torch.float32, hidden=2 * HIDDEN)
    autocast: list[bool] = []
    module.net[0].register_forward_hook(
        lambda m, a, out: autocast.append(torch.is_autocast_enabled("cpu")))
    seen: list[int] = []  # the forwards run when each trial ended (a trial runs several steps)
    ours = AutobatchCallback(guard=False, on_trial=lambda trial: seen.append(len(autocast)))
    probe = _Probe()
    options: dict[str, Any] = (
        {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed"
        else {"precision": precision}
    )
    trainer, _ = _trainer(tmp_path, [ours, probe], limit_train_batches=1, **options)
    scaler = trainer.precision_plugin.scaler
    scale = None if scaler is None else scaler.get_scale()
    with SimulatedGPU(HALF) as gpu:
        gpu.adopt(module)
        trainer.fit(module)
    assert ours.result is not None
    assert len(seen) == len(ours.result.trials)
    assert seen == sorted(set(seen))  # every trial ran forwards
    assert seen[0] > 0
    assert len(autocast) == seen[-1] + 1  # then the batch
    assert set(autocast) == {True}
    if scaler is not None:  # the trials' GradScaler steps were undone: one step of its own
        assert probe.state["scaler"] == scale


def test_find_then_training_is_the_run_with_that_size_set_by_hand(tmp_path: Any) -> None:
    """Dropout, shuffling and Adam: a fit that found size n ends where a fit started at n ends."""
    found = AutobatchCallback(guard=False)
    searched = _Net(dropout=0.2, optimizer="adam", shuffle=True)
    _fit(tmp_path, searched, SMALL, [found])
    assert found.batch_size is not None
    by_hand = _Net(found.batch_size, dropout=0.2, optimizer="adam", shuffle=True)
    _fit(tmp_path, by_hand, SMALL, [])
    assert all(torch.equal(p, q) for p, q in zip(
        searched.parameters(), by_hand.parameters(), strict=True))


# The guard ----------------------------------------------------------------------------------


CASES = {
    "plain": ({}, {}),
    "clipping, accumulate 2": ({}, {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}),
    "dict batches and outputs": ({"dicts": True}, {}),
    "a torchmetrics metric": ({"metric": True}, {}),
    "adam, clip by value": ({"optimizer": "adam"}, {"gradient_clip_val": 0.01,
                                                    "gradient_clip_algorithm": "value"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_guard_recovers_and_ends_as_an_uninterrupted_run(tmp_path: Any, case: str) -> None:
    module_options, trainer_options = CASES[case]
    reference = _Net(**module_options)
    ref_trainer, ref_memory = _fit(tmp_path, reference, LARGE, [], **trainer_options)
    module = _Net(**module_options)
    ours = AutobatchCallback(find=False)
    trainer, memory = _fit(tmp_path, module, SMALL, [ours], **trainer_options)

    assert ours.stats.ooms >= 1
    assert ours.stats.micro_batch_size is not None
    assert module.sizes == reference.sizes == [64, 64, 64]  # no batch lost or cut
    steps = math.ceil(3 / trainer_options.get("accumulate_grad_batches", 1))
    assert trainer.global_step == ref_trainer.global_step == steps
    _close(module, reference)
    torch.testing.assert_close(memory.series("train_loss"), ref_memory.series("train_loss"),
                               rtol=1e-9, atol=0)
    if module_options.get("dicts"):
        assert memory.series("rows") == ref_memory.series("rows") == [64.0] * 3
    if module_options.get("metric"):  # failed attempts' updates undone: every row once
        assert module.counted == [ROWS]  # every row once
        assert memory.series("train_accuracy") == ref_memory.series("train_accuracy")
    assert memory.series("autobatch/ooms")[-1] == ours.stats.ooms
    assert "training_step" not in vars(module)  # the guard is gone after fit


def test_guard_without_an_oom_changes_nothing(tmp_path: Any) -> None:
    reference, module = _Net(), _Net()
    ref_trainer, ref_memory = _fit(tmp_path, reference, LARGE, [], accumulate_grad_batches=2)
    ours = AutobatchCallback(find=False)
    trainer, memory = _fit(tmp_path, module, LARGE, [ours], accumulate_grad_batches=2)
    assert ours.stats.ooms == 0
    assert all(torch.equal(p, q) for p, q in zip(
        module.parameters(), reference.parameters(), strict=True))
    assert memory.series("train_loss") == ref_memory.series("train_loss")
    assert trainer.global_step == ref_trainer.global_step


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_guard_under_mixed_precision(tmp_path: Any, precision: str) -> None:
    """Autocast in the micro-batches, GradScaler's scale per micro-batch and one unscale and
    inf check per batch (16-mixed through a CPU GradScaler)."""

    def options() -> dict[str, Any]:
        if precision == "16-mixed":
            return {"plugins": [MixedPrecision("16-mixed", "cpu")]}
        return {"precision": precision}

    reference = _Net(dtype=torch.float32, hidden=2 * HIDDEN)
    ref_trainer, _ = _fit(tmp_path, reference, LARGE, [], **options())
    module = _Net(dtype=torch.float32, hidden=2 * HIDDEN)
    ours = AutobatchCallback(find=False)
    trainer, _ = _fit(tmp_path, module, HALF, [ours], **options())
    assert ours.stats.ooms >= 1
    assert trainer.global_step == ref_trainer.global_step == 3
    if precision == "16-mixed":
        scale = trainer.precision_plugin.scaler.get_scale()
        assert scale == ref_trainer.precision_plugin.scaler.get_scale()
    _close(module, reference, rtol=1e-2, atol=5e-4)  # half-precision sums in another order


def test_find_and_guard_together(tmp_path: Any) -> None:
    module = _Net(batch_size=96)
    ours = AutobatchCallback()
    trainer, _ = _fit(tmp_path, module, SMALL, [ours])
    assert ours.batch_size is not None
    assert ours.batch_size < 96
    assert ours.stats.ooms == 0  # the size found fits: nothing to recover
    assert trainer.global_step == math.ceil(ROWS / ours.batch_size)


# What is refused, and manual optimization -----------------------------------------------------


class _Manual(_Net):
    """Manual optimization: the recipe of docs/integrations.md, a decorated gradient function."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.grads = (
            retry_on_oom(policy="accumulate", model=self.net)(self._grads) if guarded
            else self._grads
        )

    def _grads(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.manual_backward(loss)
        return loss.detach()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.grads(batch)
        optimizer.step()
        self.log("train_loss", loss)


def test_manual_optimization_is_refused_and_its_recipe_recovers(tmp_path: Any) -> None:
    with pytest.raises(AutobatchError, match="manual optimization"):
        _fit(tmp_path, _Manual(guarded=False), LARGE, [AutobatchCallback()])
    reference, module = _Manual(guarded=False), _Manual(guarded=True)
    ref_trainer, ref_memory = _fit(tmp_path, reference, LARGE, [])
    trainer, memory = _fit(tmp_path, module, SMALL, [])
    assert module.grads.stats.ooms >= 1
    assert trainer.global_step == ref_trainer.global_step == 3
    _close(module, reference)
    torch.testing.assert_close(memory.series("train_loss"), ref_memory.series("train_loss"),
                               rtol=1e-9, atol=0)


def test_find_refuses_what_it_cannot_set(tmp_path: Any) -> None:
    module = _Net(where="nowhere")
    module.train_dataloader = lambda: module._loader(64)  # type: ignore[method-assign]
    with pytest.raises(AutobatchError, match="batch_size"):
        _fit(tmp_path, module, LARGE, [AutobatchCallback()])
    trainer, _ = _trainer(tmp_path, [AutobatchCallback()])
    with pytest.raises(AutobatchError, match="passed to fit"):
        trainer.fit(_Net(), train_dataloaders=_Net()._loader(64))
    guard_only = AutobatchCallback(find=False)  # the guard needs no size to set
    trainer, _ = _trainer(tmp_path, [guard_only])
    module = _Net()
    with SimulatedGPU(SMALL) as gpu:
        gpu.adopt(module)
        trainer.fit(module, train_dataloaders=module._loader(64))
    assert guard_only.stats.ooms >= 1
    assert trainer.global_step == 3


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="headroom"):
        AutobatchCallback(headroom=1.5)
    with pytest.raises(TypeError, match="step_fn"):
        AutobatchCallback(step_fn=lambda model, batch: None)
    with pytest.raises(ValueError, match="reduction"):
        AutobatchCallback(reduction="max")


def test_importing_autobatch_imports_no_framework() -> None:
    code = ("import sys, autobatch; "
            "print(sorted(m for m in ('lightning', 'transformers', 'pytorch_lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_module_examples_run() -> None:
    import autobatch.integrations.lightning as module

    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0


def test_the_callbacks_search_can_be_watched(tmp_path: Any) -> None:
    module = _Net(where="module")
    seen: list[Any] = []
    ours = AutobatchCallback(guard=False, on_trial=seen.append)
    _fit(tmp_path, module, SMALL, [ours], limit_train_batches=0)
    assert ours.result is not None
    assert seen == list(ours.result.trials)


# The feature matrix ---------------------------------------------------------------------------
#
# Each feature a LightningModule trains with, guarded, against the same fit unguarded: every
# batch over half its rows runs out of memory before the first layer's forward ("forward"),
# and in "restart" the second micro-batch of the first split batch also runs out of memory in
# backward, after the last layer's gradients were added to the batch's sum, so that the batch
# starts over (its first micro-batch already updated the metrics once).


class _Oom:
    """CUDA's OOM error in the first layer: in its forward for more than ``limit`` rows, and
    (``restart``) once in backward, in the second micro-batch that ran."""

    def __init__(self, module: _Net, limit: int, restart: bool) -> None:
        self.limit, self.restart, self.pieces, self.fired = limit, restart, 0, []
        module.net[0].register_forward_hook(self._forward)

    def _forward(self, layer: nn.Module, args: Any, out: torch.Tensor) -> None:
        if args[0].shape[0] > self.limit:
            self._fire("forward")
        self.pieces += 1
        if self.restart and self.pieces == 2:
            out.register_hook(lambda grad: self._fire("backward"))

    def _fire(self, where: str) -> None:
        self.fired.append(where)
        raise OOM_KINDS["cuda"]()


class _Featured(_Net):
    """The float64 classifier with torchmetrics metrics (updated before backward, where an
    OOM comes), values logged per step and per epoch, and an LR scheduler stepped per step."""

    def __init__(self, scheduler: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.accuracy = MulticlassAccuracy(num_classes=CLASSES)
        self.mean_loss = MeanMetric()  # fed each row's loss: a mean over rows, not over calls
        self.scheduler = scheduler

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        losses = F.cross_entropy(logits, y, reduction="none")
        loss = losses.mean()
        self.accuracy(logits, y)
        self.mean_loss(losses)
        self.log("accuracy", self.accuracy, on_step=False, on_epoch=True)
        self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
        self.log("loss", loss, on_step=True, on_epoch=True)
        self.log("rows", float(len(x)), on_step=True, on_epoch=True, reduce_fx="sum")
        self.log("top", logits.max(), on_step=True, on_epoch=True, reduce_fx="max")
        return loss

    def on_train_epoch_end(self) -> None:
        self.counted.append(int((self.accuracy.tp + self.accuracy.fn).sum()))
        self.counted.append(int(self.mean_loss.weight))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if not self.scheduler:
            return optimizer
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


LIGHTNING_FEATURES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "torchmetrics metrics, self.log on_step and on_epoch": ({}, {}),
    "accumulate_grad_batches (3 batches in windows of 2)": ({}, {"accumulate_grad_batches": 2}),
    "clipping by norm": ({}, {"gradient_clip_val": 0.05}),
    "clipping by value": ({}, {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "LR scheduler, interval='step'": ({"scheduler": True}, {}),
    "checkpoints every step": ({}, {"checkpoints": True}),
}


def _featured_fit(root: Any, feature: str, fault: str | None) -> tuple[_Featured, Any, Any,
                                                                      _Oom | None, list[Any]]:
    module_options, trainer_options = LIGHTNING_FEATURES[feature]
    options = dict(trainer_options)
    callbacks: list[Any] = [] if fault is None else [AutobatchCallback(find=False)]
    directory = root / (fault or "reference")
    if options.pop("checkpoints", False):
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=directory, every_n_train_steps=1, save_top_k=-1))
        options["enable_checkpointing"] = True
    module = _Featured(**module_options)
    oom = None if fault is None else _Oom(module, 32, restart=fault == "restart")
    trainer, memory = _fit(root, module, LARGE, callbacks, **options)
    saved = [torch.load(path, weights_only=False) for path in sorted(directory.glob("*.ckpt"))]
    return module, trainer, memory, oom, saved


_REFERENCE_FITS: dict[str, tuple[_Featured, Any, Any, _Oom | None, list[Any]]] = {}


def _feature_case(feature: str, fault: str) -> Any:
    """Every case runs in the full suite; the fast tier keeps the first feature's two and every
    other feature's restart."""
    index = list(LIGHTNING_FEATURES).index(feature)
    fast = index == 0 or (fault == "restart" and index % 2 == 0)
    return pytest.param(feature, fault, marks=[] if fast else [pytest.mark.slow],
                        id=f"{feature}-{fault}")


@pytest.mark.parametrize(("feature", "fault"), [
    _feature_case(feature, fault) for feature in LIGHTNING_FEATURES
    for fault in ("forward", "restart")
])
def test_22_2_every_feature_recovers_to_the_unguarded_fit(
    tmp_path: Any, feature: str, fault: str
) -> None:
    """After a restart (an OOM in backward once the batch's sum was begun), torchmetrics
    metrics count each row once: the recovery engine's ledger puts their states back."""
    if feature not in _REFERENCE_FITS:  # (one unguarded fit per feature)
        _REFERENCE_FITS[feature] = _featured_fit(tmp_path, feature, None)
    reference, ref_trainer, ref_memory, _, ref_saved = _REFERENCE_FITS[feature]
    module, trainer, memory, oom, saved = _featured_fit(tmp_path, feature, fault)
    assert oom is not None
    assert oom.fired[0] == "forward"
    assert ("backward" in oom.fired) == (fault == "restart")
    assert trainer.callbacks[0].stats.ooms == len(oom.fired)
    assert module.sizes == reference.sizes == [64, 64, 64]
    assert trainer.global_step == ref_trainer.global_step
    _close(module, reference)
    assert module.counted == reference.counted == [ROWS, ROWS]  # every row once, in each metric
    names = {k for _, m in ref_memory.metrics for k in m}
    assert names >= {"accuracy", "mean_loss", "loss_step", "loss_epoch", "rows_step", "top_step"}
    for name in names:  # (MeanMetric casts to float32 once moved: it sums in float32)
        rtol = 1e-6 if name == "mean_loss" else 1e-9
        torch.testing.assert_close(memory.series(name), ref_memory.series(name), rtol=rtol,
                                   atol=0, msg=name)
    if "checkpoints" in feature:
        assert len(saved) == trainer.global_step == 3
    assert [s["global_step"] for s in saved] == [s["global_step"] for s in ref_saved]
    for ours, theirs in zip(saved, ref_saved, strict=True):
        torch.testing.assert_close(ours["state_dict"], theirs["state_dict"], rtol=1e-9, atol=1e-12)
        for key in ("optimizer_states", "lr_schedulers", "loops", "epoch"):
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-9, atol=1e-12, msg=key)


# What a user sees -----------------------------------------------------------------------------


def test_22_4_the_size_and_each_recovered_oom_reach_a_user_who_configured_nothing_once(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    found, guard = AutobatchCallback(guard=False, progress=True), AutobatchCallback(find=False)
    with nothing_configured() as stream:
        _fit(tmp_path, _Net(), SMALL, [found], limit_train_batches=0)
        _fit(tmp_path, _Net(), LARGE, [guard])  # (no OOM: nothing said)
        module = _Net()
        _Oom(module, 32, restart=False)
        ours = AutobatchCallback(find=False)
        _fit(tmp_path, module, LARGE, [ours])
        assert logging.getLogger().handlers == []  # the library configured nothing
    lines = stream.getvalue().splitlines()
    assert len([line for line in lines if "AutobatchCallback set the batch size" in line]) == 1
    assert f"batch size to {found.batch_size} in 'batch_size'" in lines[0]
    recovered = [line for line in lines if "ran out of memory" in line]
    assert len(recovered) == ours.stats.ooms >= 1
    name = "test_integration_lightning._Net.training_step: "  # the module's, not the guard's
    assert all(line.startswith(name) for line in recovered), recovered
    assert len(lines) == 1 + len(recovered), lines
    assert found.result is not None
    shown = [line for line in capsys.readouterr().err.splitlines() if "autobatch: trial" in line]
    assert len(shown) == len(found.result.trials)  # progress=True: each trial once
    assert logging.getLogger("autobatch").handlers == []


def test_22_4_with_logging_set_up_no_line_is_shown_twice(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    found = AutobatchCallback(guard=False, progress=True)
    with logging_set_up() as records:
        _fit(tmp_path, _Net(), SMALL, [found], limit_train_batches=0)
    assert found.result is not None
    trials = [r for r in records if r.name == "autobatch.trial"]
    assert len(trials) == len(found.result.trials)
    assert "autobatch: trial" not in capsys.readouterr().err  # progress adds no second line
    assert len([r for r in records if "AutobatchCallback set" in r.getMessage()]) == 1


class _Counting(pl.LightningModule):
    """A warm-up weight from a counter on ``self``: micro-batches must weigh alike."""

    def __init__(self, oom_over: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.steps, self.oom_over = 0, oom_over

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        if self.oom_over and len(x) > self.oom_over:
            raise OOM_KINDS["cuda"]()
        warm = min(1.0, 0.25 + 0.25 * self.steps)
        self.steps += 1
        return warm * F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=g),
                             torch.randint(0, 3, (64,), generator=g))
        return DataLoader(data, batch_size=32, shuffle=False)


def test_a_counter_on_the_module_s_self_counts_each_batch_once() -> None:
    quiet: dict[str, Any] = {
        "accelerator": "cpu", "max_epochs": 1, "logger": False, "enable_progress_bar": False,
        "enable_checkpointing": False, "enable_model_summary": False, "precision": "64-true"}
    plain = _Counting()
    pl.Trainer(**quiet).fit(plain)
    guarded = _Counting(oom_over=16)
    callback = AutobatchCallback(find=False)
    pl.Trainer(callbacks=[callback], **quiet).fit(guarded)
    assert callback.stats.ooms == 1
    assert guarded.steps == plain.steps == 2
    for a, b in zip(guarded.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
