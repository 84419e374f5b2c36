"""Other libraries' batch-size finders, each run on the benchmark's training step.

Every adapter takes a :class:`Harness` (the model, its optimizer, ``batch(n)`` and ``step(n)``)
and returns the batch size the library settles on, or ``None`` when it gives up. The peers are
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
    run: Callable[[Harness], int | None]
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
        "batch-finder", "batch-finder", "batch_finder", _batch_finder,
        "find_max_minibatch with initial_value=512 (its CUDA default), memory_guided=False "
        "(its guidance reads torch.cuda or host RSS, not the simulator), in-process, no delay",
    ),
)
