"""Other libraries' batch-size finders, each run on the benchmark's training step.

Every adapter takes a :class:`Harness` (the model, its optimizer, ``batch(n)`` and ``step(n)``)
and returns the batch size the library settles on, or ``None`` when it gives up (or that size
and a note, ``(size, note)``). The peers are
imported lazily: install them with ``pip install -e ".[bench]"`` (torch stays as installed).
Nothing here decides whether a size fits: that is the simulated GPU's out-of-memory error,
which every peer recognises by its message.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

#: The "large" starting size given to the shrink-only tools (Accelerate, toma): a round number
#: a user might type, far above most of the answers.
LARGE_START = 65536


class Harness(Protocol):
    """What a peer needs to run the benchmark's training step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A labelled batch of ``n`` rows (recorded as the start of one step)."""
        ...

    def step(self, n: int) -> None:
        """One training step at ``n`` rows: zero_grad, forward, loss, backward, optimizer step."""
        ...


@dataclass(frozen=True)
class Peer:
    """One way of calling one library."""

    label: str
    distribution: str  # the pip name, for the version and the "not installed" reason
    module: str  # what it imports
    run: Callable[[Harness], int | tuple[int | None, str] | None]
    note: str = ""

    def missing(self) -> str | None:
        """Why this peer cannot run here, or ``None`` when it can."""
        try:
            importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return f"{self.distribution} is not installed (pip install -e '.[bench]')"
        return None

    def load(self) -> None:
        """Import the library now (before the timed part and before ``gc.freeze``)."""
        importlib.import_module(self.module)

    def version(self) -> str:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"


# Lightning ---------------------------------------------------------------------------------


def _lightning(mode: str) -> Callable[[Harness], int | None]:
    def run(harness: Harness) -> int | None:
        import lightning.pytorch as pl
        from lightning.pytorch.tuner.tuning import Tuner
        from torch.utils.data import DataLoader, Dataset

        class Indices(Dataset[int]):
            """A dataset far longer than any batch: Lightning stops growing at its length."""

            def __len__(self) -> int:
                return 2**40

            def __getitem__(self, index: int) -> int:
                return index

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = harness.model
                self.batch_size = 2  # the attribute the tuner scales

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                inputs, target = batch
                return harness.loss_fn(self.model(inputs), target)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return harness.optimizer

            def train_dataloader(self) -> DataLoader[Any]:
                # The collate function builds the batch the same way every other tool gets it.
                return DataLoader(
                    Indices(),
                    batch_size=self.batch_size,
                    collate_fn=lambda rows: harness.batch(len(rows)),
                )

        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_epochs=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=root,
            )
            found = Tuner(trainer).scale_batch_size(Module(), mode=mode)
        return None if found is None else int(found)

    return run


# Accelerate and toma: shrink-only retry loops around the user's function ------------------


def _accelerate(start: int) -> Callable[[Harness], int | None]:
    def run(harness: Harness) -> int | None:
        from accelerate.utils import find_executable_batch_size

        @find_executable_batch_size(starting_batch_size=start)
        def train(batch_size: int) -> int:
            harness.step(batch_size)
            return batch_size

        return int(train())

    return run


def _toma(start: int) -> Callable[[Harness], int | None]:
    def run(harness: Harness) -> int | None:
        from toma import simple

        def train(batch_size: int) -> int:
            harness.step(batch_size)
            return batch_size

        return int(simple.batch(train, start))

    return run


# Hugging Face Trainer: auto_find_batch_size ---------------------------------------------------

#: The ``Trainer``'s default ``per_device_train_batch_size``: where ``auto_find_batch_size``
#: starts unless told otherwise.
TRAINER_DEFAULT = 8

#: Optimizer steps each training attempt runs (the benchmark's B* is the largest batch whose
#: two steps fit).
TRAINER_STEPS = 2


class _TrainerStep(nn.Module):
    """The benchmark's model and loss as a model the ``Trainer`` trains: forward returns the
    loss; the ``Trainer`` runs backward and the optimizer step."""

    def __init__(self, harness: Harness) -> None:
        super().__init__()
        self.model = harness.model
        self.harness = harness

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.harness.loss_fn(self.model(inputs), target)}


def _trainer(start: int) -> Callable[[Harness], tuple[int | None, str]]:
    def run(harness: Harness) -> tuple[int | None, str]:
        import transformers
        from torch.utils.data import DataLoader, IterableDataset
        from transformers import Trainer, TrainingArguments

        class Rows(IterableDataset[int]):
            """Endless row indices, without a sampler (a random one would allocate its
            permutation on the simulated device)."""

            def __iter__(self) -> Any:
                index = 0
                while True:
                    yield index
                    index += 1

        def collate(rows: list[int]) -> dict[str, torch.Tensor]:
            inputs, target = harness.batch(len(rows))  # built as every tool's batch is
            return {"inputs": inputs, "target": target}

        class OneBatchAtATime(Trainer):  # type: ignore[misc]
            """Its own dataloader, not wrapped by Accelerate (which fetches one batch ahead,
            so a step would hold two batches and the next would be built before the step
            finished): each step holds its batch, as the other tools' loops do."""

            def get_train_dataloader(self) -> DataLoader[Any]:
                return DataLoader(self.train_dataset, batch_size=self._train_batch_size,
                                  collate_fn=collate)

        transformers.logging.set_verbosity_error()
        with tempfile.TemporaryDirectory() as root:
            args = TrainingArguments(
                output_dir=root, auto_find_batch_size=True, per_device_train_batch_size=start,
                max_steps=TRAINER_STEPS, learning_rate=harness.optimizer.param_groups[0]["lr"],
                max_grad_norm=0.0, report_to=[], save_strategy="no", logging_strategy="no",
                disable_tqdm=True, use_cpu=True, remove_unused_columns=False,
            )
            constant = torch.optim.lr_scheduler.LambdaLR(harness.optimizer, lambda step: 1.0)
            trainer = OneBatchAtATime(
                model=_TrainerStep(harness), args=args, train_dataset=Rows(),
                optimizers=(harness.optimizer, constant),
            )
            attempts = 0
            inner = trainer._inner_training_loop

            def counted(*args: Any, **kwargs: Any) -> Any:
                nonlocal attempts
                attempts += 1
                return inner(*args, **kwargs)

            # the loop Trainer.train wraps in find_executable_batch_size: one call per attempt
            trainer._inner_training_loop = counted
            trainer.train()
        found = int(trainer._train_batch_size)
        return found, f"training started {attempts} times ({attempts - 1} restarts after OOM)"

    return run


# batch-finder -----------------------------------------------------------------------------


class _StepAsForward(nn.Module):
    """batch-finder runs ``forward`` + ``backward`` on a fresh model from ``get_model()``;
    this module's forward runs the whole training step at the rows of its input instead, so
    batch-finder sees the same fit/fail boundary as every other tool. Its input is an empty
    ``(n, 0)`` tensor: it carries the size and takes no memory."""

    def __init__(self, harness: Harness) -> None:
        super().__init__()
        self.model = harness.model
        self.harness = harness

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.harness.step(x.shape[0])
        return torch.zeros((), requires_grad=True)


def _batch_finder(harness: Harness) -> int | None:
    from batch_finder import find_max_minibatch

    module = _StepAsForward(harness)
    found = find_max_minibatch(
        lambda: module,
        input_shapes=(-1, 0),
        device=torch.device("cpu"),
        delay=0.0,  # its default sleeps 0.75 s (CPU) or 3 s (CUDA) between attempts
        initial_value=512,  # its default on CUDA (the simulated GPU stands for one)
        memory_guided=False,  # its guidance reads torch.cuda or host RSS, not the simulator
        use_subprocess=False,  # the simulated GPU lives in this process
    )
    if found is None:
        return None
    return int(found[0]) if isinstance(found, tuple) else int(found)


PEERS: tuple[Peer, ...] = (
    Peer(
        "Lightning binsearch", "lightning", "lightning.pytorch.tuner", _lightning("binsearch"),
        "Tuner.scale_batch_size with its defaults: init_val=2, steps_per_trial=3, "
        "max_val=8192, margin=0.05",
    ),
    Peer("Lightning power", "lightning", "lightning.pytorch.tuner", _lightning("power"),
         "the same defaults"),
    Peer("Accelerate start=128", "accelerate", "accelerate.utils", _accelerate(128),
         "find_executable_batch_size: x0.9 per OOM, never grows"),
    Peer(f"Accelerate start={LARGE_START}", "accelerate", "accelerate.utils",
         _accelerate(LARGE_START)),
    Peer("toma start=128", "toma", "toma", _toma(128),
         "toma.simple.batch: halves per OOM, never grows"),
    Peer(f"toma start={LARGE_START}", "toma", "toma", _toma(LARGE_START)),
    Peer(
        f"HF Trainer auto_find start={TRAINER_DEFAULT}", "transformers", "transformers",
        _trainer(TRAINER_DEFAULT),
        "Trainer(args=TrainingArguments(auto_find_batch_size=True)).train(): the training "
        "loop restarts at 0.9x the size after each OOM and never grows; it starts at "
        f"per_device_train_batch_size (default {TRAINER_DEFAULT}); {TRAINER_STEPS} steps per "
        "attempt, the benchmark's model and optimizer, no clipping",
    ),
    Peer("HF Trainer auto_find start=128", "transformers", "transformers", _trainer(128)),
    Peer(f"HF Trainer auto_find start={LARGE_START}", "transformers", "transformers",
         _trainer(LARGE_START)),
    Peer(
        "batch-finder", "batch-finder", "batch_finder", _batch_finder,
        "find_max_minibatch with initial_value=512 (its CUDA default), memory_guided=False "
        "(its guidance reads torch.cuda or host RSS, not the simulator), in-process, no delay",
    ),
)
