"""How exact and how cheap is the batch-size search, next to the other tools? (not run in CI)

For an MLP, a conv net with BatchNorm and a small transformer, each trained with Adam, and a
tiny MLP 16-32-32-4 trained with AdamW (about 500 bytes per sample, less than one 512-byte
allocator block), under one of the simulated GPU's two allocator models (``--allocator``):

- ``exact`` (allocated bytes; ``results/bench_search.md``): the capacity is chosen so that the
  true largest batch B* lands on a target (37, 100, 1000, 4097, 20000 for the MLP; 32, 100,
  1000, 10000, 100000 for the tiny MLP; 37, 100, 1000 for the others by default). B* itself is
  not taken from any model: it is the largest n for which two real training steps fit in a
  fresh ``SimulatedGPU(capacity, allocator="exact")``, checked at B* (fits) and B*+1 (does
  not). Every tool starts from Adam warmed up, its state resident.
- ``caching`` (CUDA's caching allocator; ``results/bench_search_caching.md``): memory is
  reserved in whole segments (2 MiB for blocks up to 1 MiB, 20 MiB for 1-10 MiB requests), so
  a capacity cannot be tuned to a B*; each case is a fixed capacity (:data:`CAPACITIES`),
  picked so that B* spreads over about the same range. B* is the largest n at which a user's
  own plain loop trains: a fresh copy of the model and a fresh optimizer in a fresh
  ``SimulatedGPU(capacity, allocator="caching")``, a new batch copied to the device each step,
  the loss held until the next one, for ``CACHING_STEPS`` (5) steps; found by bisection and
  checked at B* (trains) and B*+1 (runs out of memory). Every tool starts from the model and
  a fresh optimizer, as that loop does.

Then, in the same process and the same simulator, each tool searches from the same model and
optimizer:

- ours: ``search_batch_size(..., headroom=0)`` under the simulated GPU (memory statistics);
- ours without statistics: the same on the plain CPU, where CUDA's OOM error is raised
  whenever the model gets more than B* rows, so the engine doubles and bisects;
- the peers in ``_peers.py`` (Lightning, Accelerate, the Hugging Face ``Trainer``'s
  ``auto_find_batch_size``, toma, batch-finder), when installed.

Every batch any tool runs is built by one function, which records its size and, as a loader
does, puts the rows together in host memory and copies them to the device; a step counts as
done when the optimizer's step returns. Consecutive steps at one size are one trial. Model
parameters, buffers, gradients and the optimizer's state_dict are compared bit for bit before
and after each tool.

    python benchmarks/bench_search.py                 # the full matrix, ~15 minutes on 2 cores
    python benchmarks/bench_search.py --quick         # MLP only, small B*
    python benchmarks/bench_search.py --no-peers --models conv --targets 37 100
    python benchmarks/bench_search.py --allocator caching  # ~18 minutes on 2 cores
    python benchmarks/bench_search.py --allocator caching --no-peers --capacities 6MiB
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import _disable_current_modes

import autobatch
from autobatch._sizing._trial import CACHING_STEPS
from autobatch._units import format_bytes, parse_bytes
from autobatch.testing import OOM_KINDS, SimulatedGPU
from autobatch.testing.models import WORKLOADS, mlp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import PEERS, Peer  # a sibling module of this script

RESULTS = {
    "exact": Path(__file__).resolve().parent / "results" / "bench_search.md",
    "caching": Path(__file__).resolve().parent / "results" / "bench_search_caching.md",
}

TARGETS: dict[str, tuple[int, ...]] = {
    "mlp": (37, 100, 1000, 4097, 20000),
    "conv": (37, 100, 1000),
    "transformer": (37, 100, 1000),
    "tiny-mlp": (32, 100, 1000, 10000, 100000),
}
QUICK_TARGETS: dict[str, tuple[int, ...]] = {"mlp": (37, 100, 1000)}

# Under the caching allocator, the capacity of each case (B* is measured, not chosen; the
# comments give what it was). Below a few MiB nothing but the model and its state fits, and a
# capacity between two segment sizes gives the B* of the smaller: the smallest B* are larger
# than the exact allocator's targets.
CAPACITIES: dict[str, tuple[str, ...]] = {
    "mlp": ("4MiB", "6MiB", "10MiB", "32MiB", "128MiB"),  # B* about 270, 580, 1000, 3400, 20000
    "conv": ("32MiB", "48MiB", "400MiB"),  # about 60, 120, 1150
    "transformer": ("24MiB", "64MiB", "600MiB"),  # about 30, 110, 1100
    "tiny-mlp": ("2MiB", "8MiB", "24MiB", "80MiB"),  # about 2900, 8000, 33000, 115000
}
QUICK_CAPACITIES: dict[str, tuple[str, ...]] = {"mlp": ("4MiB", "6MiB", "10MiB")}

SAMPLE_ROWS = 8  # distinct rows every batch cycles through
UNLIMITED = 2**50  # a simulated GPU that never runs out, for measuring peaks


@dataclass(frozen=True)
class Goals:
    """The goals for our engine, from the issues. Under the caching allocator every trial that
    fits runs ``CACHING_STEPS`` steps, so the samples allowed are that many times more."""

    median_trials: int
    max_trials: int
    median_oom: int
    samples_per_bstar: float


GOALS = {"exact": Goals(5, 8, 2, 3.0), "caching": Goals(5, 7, 2, 3.0 * CACHING_STEPS)}

#: ``max_batch`` for ours without statistics: the CPU's allocator keeps none, so the search
#: refuses host memory without a cap; this one is far above every B*.
NO_STATISTICS_CAP = 2**20


def no_statistics_bound(bstar: int) -> float:
    """Trials allowed without memory statistics: 2·log2(B*) + 2."""
    return 2 * math.log2(bstar) + 2


# The training setup --------------------------------------------------------------------------


@dataclass
class Setup:
    """A model and its optimizer as a user has them when they search, with no gradients: Adam
    already stepped once (its state resident) for the exact allocator; fresh (no state yet, as
    in the user's own loop, which the caching allocator's B* is) for the caching one. Each tool
    gets a deep copy."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    labels: torch.Tensor

    def copy(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = copy.deepcopy((self.model, self.optimizer))
        return model, optimizer

    def host_batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` rows, the sample's cycled, as a loader puts them together in host memory."""
        rows = torch.arange(n) % SAMPLE_ROWS
        return self.inputs.index_select(0, rows), self.labels.index_select(0, rows)


def make_setup(name: str, allocator: str) -> Setup:
    torch.manual_seed(0)
    if name == "tiny-mlp":  # ~500 bytes per sample: the peak is a staircase of 512-byte blocks
        model = mlp(width=32, depth=2, inputs=16, classes=4)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs, labels = torch.randn(SAMPLE_ROWS, 16), torch.randint(0, 4, (SAMPLE_ROWS,))
    else:
        workload = WORKLOADS[name]
        model = workload.model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        inputs, labels = workload.sample(SAMPLE_ROWS)
    setup = Setup(name, model, optimizer, inputs, labels)
    if allocator == "exact":
        Runner(setup, model, optimizer).step(8)
        optimizer.zero_grad(set_to_none=True)
    return setup


class Recorder:
    """Every step any tool starts (its size) and whether it finished."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []  # [size, finished]

    def begin(self, n: int) -> None:
        self.steps.append([n, False])

    def finish(self) -> None:
        if self.steps and not self.steps[-1][1]:
            self.steps[-1][1] = True

    def trials(self) -> list[tuple[int, bool]]:
        """``(size, fits)`` per trial: consecutive steps at one size are one trial, which fits
        when all of its steps finished."""
        out: list[tuple[int, bool]] = []
        previous = None
        for size, finished in self.steps:
            if size == previous:
                out[-1] = (size, out[-1][1] and finished)
            else:
                out.append((size, finished))
            previous = size
        return out

    @property
    def samples(self) -> int:
        return sum(size for size, _ in self.steps)


class Runner:
    """The training step every tool runs, with batches built (and recorded) in one place."""

    def __init__(
        self,
        setup: Setup,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        recorder: Recorder | None = None,
    ) -> None:
        self.setup = setup
        self.model = model
        self.optimizer = optimizer
        self.recorder = recorder
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` rows on the device: put together in host memory (which a simulated GPU does
        not count), then copied, as ``.to(device)`` does."""
        if self.recorder is not None:
            self.recorder.begin(n)
        with _disable_current_modes():
            inputs, labels = self.setup.host_batch(n)
        return inputs.clone(), labels.clone()

    def step(self, n: int) -> None:
        try:
            inputs, labels = self.batch(n)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model(inputs), labels)
            loss.backward()
            self.optimizer.step()
        except torch.OutOfMemoryError as error:
            # A real CUDA OOM comes from C++, and once the caller's except block ends nothing
            # holds the failed step's tensors. The simulator raises from a Python frame that
            # keeps the error in a local, a reference cycle that keeps those tensors alive
            # until the next gc.collect(); tools that collect before the next trial do not
            # notice, tools that do not (Accelerate, toma) would fail far below B*. Dropping
            # the traceback here gives every tool the real-GPU behaviour.
            raise error.with_traceback(None) from None


@contextlib.contextmanager
def recording(recorder: Recorder, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    def finished(opt: torch.optim.Optimizer, *_: Any) -> None:
        if opt is optimizer:
            recorder.finish()

    handle = register_optimizer_step_post_hook(finished)
    try:
        yield
    finally:
        handle.remove()


# Bit-exact state comparison ------------------------------------------------------------------


def _tensors_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _tensors_of(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors_of(v) for v in value)
    return copy.deepcopy(value)


def capture(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters, buffers, gradients and the optimizer's state_dict, copied (outside any
    simulator, so the copies are not counted)."""
    return {
        "parameters": [(n, p.detach().clone()) for n, p in model.named_parameters()],
        "buffers": [(n, b.detach().clone()) for n, b in model.named_buffers()],
        "grads": [(n, None if p.grad is None else p.grad.clone())
                  for n, p in model.named_parameters()],
        "optimizer": _tensors_of(optimizer.state_dict()),
    }


def changed_parts(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Which of parameters, buffers, gradients and optimizer state differ in any bit."""
    return [part for part in before if not bit_equal(before[part], after[part])]


def bit_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(bit_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# The true B* for a capacity -------------------------------------------------------------------


def peak_of_two_steps(setup: Setup, n: int) -> int:
    """The allocated peak of two training steps at ``n`` (exact allocator, no limit)."""
    model, optimizer = setup.copy()
    runner = Runner(setup, model, optimizer)
    with SimulatedGPU(UNLIMITED, allocator="exact") as gpu:
        gpu.adopt(model, optimizer)
        runner.step(n)
        runner.step(n)
    return int(gpu.peak_bytes)


def two_steps_fit(setup: Setup, capacity: int, n: int) -> bool:
    """The exact allocator's truth: do two training steps at ``n`` fit in a fresh simulator?"""
    model, optimizer = setup.copy()
    runner = Runner(setup, model, optimizer)
    fits = True
    with SimulatedGPU(capacity, allocator="exact") as gpu:
        gpu.adopt(model, optimizer)
        try:
            runner.step(n)
            runner.step(n)
        except torch.OutOfMemoryError:
            fits = False
    return fits


def fresh_loop_fits(setup: Setup, capacity: int, n: int) -> bool:
    """The caching allocator's truth: does a user's own plain loop train ``CACHING_STEPS``
    steps at ``n`` (as ``tests/_models.py::fresh_loop_fits``)? See :func:`fresh_loop_reserved`."""
    return fresh_loop_reserved(setup, capacity, n)[0]


def fresh_loop_reserved(
    setup: Setup, capacity: int, n: int, steps: int = CACHING_STEPS,
    after_step: Callable[[SimulatedGPU], None] | None = None,
) -> tuple[bool, list[int]]:
    """A user's own plain loop at ``n``: a fresh copy of the model and of its fresh optimizer
    in a fresh simulator, each step a new batch copied to the device (``.clone()`` of the host
    batch), ``loss`` held until the next step. Whether it trains ``steps`` steps, and the
    reserved peak after each step that ran (``after_step`` is called with the simulator
    after each)."""
    model, optimizer = setup.copy()
    host = setup.host_batch(n)  # the loader's batch, in host memory
    reserved: list[int] = []
    try:
        with SimulatedGPU(capacity, allocator="caching") as gpu:
            gpu.adopt(model, optimizer)
            for _ in range(steps):
                inputs, labels = (t.clone() for t in host)  # .to(device)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(inputs), labels)
                loss.backward()
                optimizer.step()
                reserved.append(gpu.peak_reserved_bytes)
                if after_step is not None:
                    after_step(gpu)
    except torch.OutOfMemoryError:
        return False, reserved
    return True, reserved


class Truth:
    """Whether batch ``n`` trains in ``capacity`` under ``allocator`` (two steps for the exact
    allocator, the fresh loop for the caching one), each size checked once."""

    def __init__(self, setup: Setup, capacity: int, allocator: str) -> None:
        self.setup, self.capacity = setup, capacity
        self.check = two_steps_fit if allocator == "exact" else fresh_loop_fits
        self.known: dict[int, bool] = {}

    def __call__(self, n: int) -> bool:
        if n not in self.known:
            self.known[n] = self.check(self.setup, self.capacity, n)
        return self.known[n]


def largest_fitting(truth: Truth, start: int) -> int:
    """B*: the largest n that ``truth`` says trains, galloping from ``start`` (up while it
    trains, down while it does not), then bisection; confirmed at B* and B*+1."""
    name, capacity = truth.setup.name, truth.capacity
    if truth(start):
        low, gap = start, 1
        while truth(low + gap):
            low, gap = low + gap, 2 * gap
        high = low + gap
    else:
        high, gap = start, 1
        while high - gap >= 1 and not truth(high - gap):
            high, gap = high - gap, 2 * gap
        low = max(high - gap, 1)
        if not truth(low):
            raise RuntimeError(f"{name}: even batch 1 does not fit in {capacity} bytes")
    while high - low > 1:
        middle = (low + high) // 2
        if truth(middle):
            low = middle
        else:
            high = middle
    if not truth(low) or truth(low + 1):  # B* and B*+1, checked directly
        raise RuntimeError(f"{name}: no clean boundary near {low} in {capacity} bytes")
    return low


def exact_truth(setup: Setup, target: int) -> Truth:
    """The exact allocator's truth in a capacity halfway between the peaks at ``target`` and
    ``target + 1``."""
    low_peak, high_peak = peak_of_two_steps(setup, target), peak_of_two_steps(setup, target + 1)
    return Truth(setup, (low_peak + high_peak) // 2, "exact")


# Running the tools -----------------------------------------------------------------------------


@dataclass
class Row:
    """One tool on one case; ``bstar`` and ``trains`` (does the size returned train in the
    truth's loop?) are set once the case's B* is final."""

    tool: str
    returned: int | None
    trials: list[tuple[int, bool]]
    samples: int
    changed: list[str]
    notes: list[str] = field(default_factory=list)
    bstar: int = 0
    trains: bool | None = None

    @property
    def unchanged(self) -> bool:
        return not self.changed

    @property
    def oom_trials(self) -> int:
        return sum(not fits for _, fits in self.trials)

    @property
    def exact(self) -> bool:
        return self.returned == self.bstar

    @property
    def above(self) -> bool:
        return self.returned is not None and self.returned > self.bstar

    @property
    def below(self) -> bool:
        return self.returned is not None and self.returned < self.bstar

    def sizes(self, limit: int = 24) -> str:
        shown = [f"{size}{'' if fits else '✗'}" for size, fits in self.trials]
        if len(shown) > limit:
            shown = [*shown[: limit - 4], f"… {len(shown) - limit + 4 - 3} more …", *shown[-3:]]
        return ", ".join(shown) or "none"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Peers print progress bars and log lines; keep the table readable."""
    loggers = [logging.getLogger(name) for name in ("lightning", "lightning.pytorch",
                                                    "lightning.fabric", "pytorch_lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
                contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def run_tool(
    tool: str,
    setup: Setup,
    search: Callable[[Runner], tuple[int | None, str]],
    memory: Callable[[nn.Module, torch.optim.Optimizer], contextlib.AbstractContextManager[Any]],
) -> Row:
    model, optimizer = setup.copy()
    before = capture(model, optimizer)
    recorder = Recorder()
    runner = Runner(setup, model, optimizer, recorder)
    note = ""
    returned: int | None = None
    with memory(model, optimizer), recording(recorder, optimizer):
        try:
            returned, note = search(runner)
        except Exception as error:  # a peer that crashes is a result, not the end of the run
            note = f"raised {type(error).__name__}: {str(error).splitlines()[0][:80]}"
    changed = changed_parts(before, capture(model, optimizer))
    notes = [note] if note else []
    return Row(tool, returned, recorder.trials(), recorder.samples, changed, notes)


def simulated(
    capacity: int, allocator: str
) -> Callable[..., contextlib.AbstractContextManager[Any]]:
    @contextlib.contextmanager
    def memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        with SimulatedGPU(capacity, allocator=allocator) as gpu:
            gpu.adopt(model, optimizer)
            yield

    return memory


def oom_above(bstar: int) -> Callable[..., contextlib.AbstractContextManager[Any]]:
    """The plain CPU (no memory statistics) with CUDA's OOM error raised by a forward pre-hook
    whenever the model gets more than B* rows: a step-threshold oracle. (``inject_oom``'s
    ``batch_over`` looks at dimension 0 of every operator's inputs, which a transformer fills
    with batch x sequence, so it would fire far below B* there.)"""

    @contextlib.contextmanager
    def memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if args[0].shape[0] > bstar:
                raise OOM_KINDS["cuda"]()

        handle = model.register_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    return memory


def ours(runner: Runner, **options: Any) -> tuple[int | None, str]:
    result = autobatch.search_batch_size(
        runner.model, runner.batch, runner.optimizer, loss_fn=F.cross_entropy, headroom=0,
        **options,
    )
    engine = [(t.size, t.fits) for t in result.trials]
    recorded = runner.recorder.trials() if runner.recorder is not None else engine
    note = "" if engine == recorded else f"engine's own record differs: {engine}"
    return result.batch_size, note


def ours_without_statistics(runner: Runner) -> tuple[int | None, str]:
    return ours(runner, max_batch=NO_STATISTICS_CAP)


def peer_search(peer: Peer) -> Callable[[Runner], tuple[int | None, str]]:
    def search(runner: Runner) -> tuple[int | None, str]:
        with quiet():
            found = peer.run(runner)
        return found if isinstance(found, tuple) else (found, "")

    return search


@dataclass
class Case:
    """One model in one capacity: a B* target (exact allocator) or a fixed capacity (caching)."""

    model: str
    target: int = 0
    capacity: int = 0
    bstar: int = 0
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_case(
    case: Case, setup: Setup, allocator: str, peers: list[Peer], peer_max_bstar: int | None,
    log: Callable[[str], None],
) -> None:
    if allocator == "exact":
        truth = exact_truth(setup, case.target)
        case.capacity, case.bstar = truth.capacity, largest_fitting(truth, case.target)
        log(f"{case.model} target {case.target}: capacity {case.capacity} bytes, "
            f"B* = {case.bstar}")
    else:
        truth = Truth(setup, case.capacity, "caching")
        case.bstar = largest_fitting(truth, 1)
        log(f"{case.model} in {format_bytes(case.capacity)}: B* = {case.bstar} "
            f"({len(truth.known)} fresh loops)")
    memory = simulated(case.capacity, allocator)
    case.rows.append(run_tool("ours", setup, ours, memory))
    if peer_max_bstar is not None and case.bstar > peer_max_bstar:
        peers = []
        case.notes.append(f"skipped the peers: B* above --peer-max-bstar={peer_max_bstar}")
    for peer in peers:
        started = time.perf_counter()
        case.rows.append(run_tool(peer.label, setup, peer_search(peer), memory))
        log(f"  {peer.label}: {time.perf_counter() - started:.1f} s")
    # Under the caching allocator whether a size trains is not monotone in the size near the
    # boundary (how the blocks pack into segments changes with it): an answer above B* that
    # trains raises B* to the boundary above that answer.
    for returned in sorted({row.returned for row in case.rows if row.returned is not None}):
        if returned > case.bstar and truth(returned):
            raised = largest_fitting(truth, returned)
            case.notes.append(
                f"B* raised from {case.bstar} to {raised}: the bisection's boundary was not the "
                f"largest size that trains ({returned}, an answer, does)"
            )
            case.bstar = raised
    case.rows.insert(1, run_tool(
        "ours, no statistics", setup, ours_without_statistics, oom_above(case.bstar)
    ))
    for row in case.rows:
        row.bstar = case.bstar
        if row.returned is not None:
            row.trains = truth(row.returned)
            if not row.trains:
                row.notes.append(f"returned {row.returned}, which the truth's loop cannot train")


# Output ---------------------------------------------------------------------------------------


def ratio(row: Row) -> str:
    """returned/B*, marked when the size returned does not train in the truth's loop (above
    B* it never does)."""
    if row.returned is None:
        return "—"
    mark = " ✗ does not train" if row.trains is False else ""
    return f"{row.returned / row.bstar:.3f}{mark}"


def table(case: Case, allocator: str) -> str:
    where = f", {format_bytes(case.capacity)}" if allocator == "caching" else ""
    lines = [
        f"### {case.model}{where}, B* = {case.bstar}",
        "",
        "| tool | B* | returned | returned/B* | trials | OOM trials | samples processed "
        "| state unchanged |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in case.rows:
        returned = "—" if row.returned is None else str(row.returned)
        samples = f"{row.samples} ({row.samples / row.bstar:.1f}×B*)"
        lines.append(
            f"| {row.tool} | {row.bstar} | {returned} | {ratio(row)} | {len(row.trials)} "
            f"| {row.oom_trials} | {samples} "
            f"| {'yes' if row.unchanged else 'no (' + ', '.join(row.changed) + ')'} |"
        )
    lines += ["", "Sizes tried (✗ = OOM):", ""]
    lines += [f"- {row.tool}: {row.sizes()}" for row in case.rows]
    lines += [f"- {row.tool}: {note}" for row in case.rows for note in row.notes]
    lines += [
        f"- {row.tool} returned {row.returned}, a size it never ran successfully"
        for row in case.rows
        if row.returned is not None and (row.returned, True) not in row.trials
    ]
    lines += [f"- {note}" for note in case.notes]
    return "\n".join(lines) + "\n"


def tools_summary(cases: list[Case]) -> str:
    """Every tool over the cases it ran: how often exact, above B*, below it, a size the
    truth's loop cannot train (every one above B*, and any below it that does not), and its
    median trials."""
    rows: dict[str, list[Row]] = {}
    for case in cases:
        for row in case.rows:
            rows.setdefault(row.tool, []).append(row)
    lines = [
        "## Summary per tool",
        "",
        "| tool | cases | exact | above B* | below B* | does not train | none returned "
        "| median returned/B* | median trials | median OOM trials |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tool, runs in rows.items():
        ratios = [row.returned / row.bstar for row in runs if row.returned is not None]
        median = f"{statistics.median(ratios):.3f}" if ratios else "—"
        lines.append(
            f"| {tool} | {len(runs)} | {sum(row.exact for row in runs)} "
            f"| {sum(row.above for row in runs)} | {sum(row.below for row in runs)} "
            f"| {sum(row.trains is False for row in runs)} "
            f"| {sum(row.returned is None for row in runs)} | {median} "
            f"| {statistics.median(len(row.trials) for row in runs):g} "
            f"| {statistics.median(row.oom_trials for row in runs):g} |"
        )
    return "\n".join(lines) + "\n"


def summary(cases: list[Case], goals: Goals) -> tuple[str, bool]:
    stats = [row for case in cases for row in case.rows if row.tool == "ours"]
    blind = [row for case in cases for row in case.rows if row.tool == "ours, no statistics"]
    trials = [len(row.trials) for row in stats]
    ooms = [row.oom_trials for row in stats]
    per_bstar = [row.samples / row.bstar for row in stats]
    exact = sum(row.exact for row in stats) / len(stats)
    blind_ratio = [len(row.trials) / no_statistics_bound(row.bstar) for row in blind]
    blind_exact = sum(row.exact for row in blind) / len(blind)
    unchanged = all(row.unchanged for row in stats + blind)
    checks = {
        f"exact in 100% of cases (got {exact:.0%})": exact == 1,
        f"median trials <= {goals.median_trials} (got {statistics.median(trials):g})":
            statistics.median(trials) <= goals.median_trials,
        f"max trials <= {goals.max_trials} (got {max(trials)})": max(trials) <= goals.max_trials,
        f"median OOM trials <= {goals.median_oom} (got {statistics.median(ooms):g})":
            statistics.median(ooms) <= goals.median_oom,
        f"samples <= {goals.samples_per_bstar:g}·B* (max {max(per_bstar):.2f}·B*)":
            max(per_bstar) <= goals.samples_per_bstar,
        f"no statistics: exact (got {blind_exact:.0%}) in <= 2·log2(B*)+2 trials "
        f"(max {max(blind_ratio):.2f} of the bound)":
            blind_exact == 1 and max(blind_ratio) <= 1,
        "state unchanged after every search": unchanged,
    }
    lines = [
        "## Summary for ours",
        "",
        f"{len(stats)} cases with statistics: median trials {statistics.median(trials):g}, "
        f"max {max(trials)}; median OOM trials {statistics.median(ooms):g}; max samples "
        f"{max(per_bstar):.2f}·B*; exact {exact:.0%}.",
        "",
    ]
    lines += [f"- [{'x' if ok else ' '}] {text}" for text, ok in checks.items()]
    misses = [
        f"- {case.model}, B* = {case.bstar}: {row.tool} tried {row.sizes(limit=10**9)} and "
        f"returned {row.returned}"
        for case in cases for row in case.rows
        if (row.tool == "ours" and (not row.exact or len(row.trials) > goals.max_trials
                                    or row.samples > goals.samples_per_bstar * row.bstar))
        or (row.tool == "ours, no statistics"
            and (not row.exact or len(row.trials) > no_statistics_bound(row.bstar)))
    ]
    if misses:
        lines += ["", "Cases that miss a goal:", *misses]
    return "\n".join(lines) + "\n", all(checks.values())


def header(peers: list[Peer], missing: list[str], allocator: str) -> str:
    packages = [
        ("torch", torch.__version__),
        ("autobatch", autobatch.__version__),
        *sorted({(p.distribution, p.version()) for p in peers}),
    ]
    versions = ", ".join(f"{name} {version}" for name, version in packages)
    if allocator == "exact":
        title = "# Batch-size search: ours and the peers on a simulated GPU"
        setting = (
            "Produced by `python benchmarks/bench_search.py`. Each tool starts from the same "
            "model and Adam optimizer (AdamW for the tiny MLP 16-32-32-4; state resident) inside "
            "`SimulatedGPU(capacity, allocator=\"exact\")`; B* is the largest batch whose two "
            "real training steps fit in that capacity, checked at B* and B*+1. "
        )
    else:
        title = ("# Batch-size search: ours and the peers on a simulated GPU with CUDA's caching "
                 "allocator")
        setting = (
            "Produced by `python benchmarks/bench_search.py --allocator caching`. Each tool "
            "starts from the same model and a fresh Adam optimizer (AdamW for the tiny MLP "
            "16-32-32-4; no state yet) inside `SimulatedGPU(capacity, allocator=\"caching\")`, "
            "each case a fixed capacity. B* is the largest batch at which a user's own plain "
            "loop trains: a fresh copy of the model and a fresh optimizer in a fresh simulator, "
            "a new batch copied to the device each step, the loss held until the next one, for "
            f"{CACHING_STEPS} steps; found by bisection, checked at B* (trains) and B*+1 (runs "
            "out of memory). Near the boundary whether a size trains is not monotone in the "
            "size (how the blocks pack into the segments changes with it): where a tool's "
            "answer above the bisection's B* trains, B* is raised to the boundary above that "
            "answer (noted under the case). Every size a tool returns is run in that loop; "
            "one it cannot train is marked ✗ (every answer above B* is one). "
        )
    lines = [
        title,
        "",
        setting
        + "Trials are the sizes a tool ran (consecutive steps at one size are one trial); "
        "samples are all rows it ran (Lightning runs 3 steps per trial, the Trainer 2 per "
        "training attempt"
        + (f", ours {CACHING_STEPS} or more per trial that fits" if allocator == "caching" else "")
        + "); \"state unchanged\" compares "
        "parameters, buffers, gradients and the optimizer's state_dict bit for bit. "
        "\"ours, no statistics\" is the same search on the plain CPU (`max_batch="
        f"{NO_STATISTICS_CAP}`, which host memory needs), with CUDA's OOM error "
        f"raised when the model gets more than B* rows. Versions: {versions}.",
        "",
    ]
    for peer in peers:
        if peer.note:
            lines.append(f"- {peer.label}: {peer.note}")
    lines.append(
        "- batch-finder runs forward+backward on a fresh model per attempt; here its model's "
        "forward runs the whole training step, so it sees the same boundary as the others "
        "(and so it changes the state)."
    )
    lines += [f"- not run: {reason}" for reason in missing]
    return "\n".join(lines) + "\n"


def load_peers() -> tuple[list[Peer], list[str]]:
    """The peers that can run here, and why the others cannot (not installed, or broken)."""
    peers: list[Peer] = []
    missing: list[str] = []
    for peer in PEERS:
        reason = peer.missing()
        if reason is None:
            try:
                peer.load()
            except Exception as error:  # installed but broken: say why, run the rest
                reason = f"{peer.label}: import failed ({type(error).__name__}: {error})"
        if reason is None:
            peers.append(peer)
        elif reason not in missing:
            missing.append(reason)
    return peers, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocator", choices=sorted(RESULTS), default="exact",
                        help="the simulated GPU's allocator model (default: exact)")
    parser.add_argument("--models", nargs="+", choices=sorted(TARGETS), default=None)
    parser.add_argument("--targets", nargs="+", type=int, default=None,
                        help="exact allocator: B* targets for every chosen model "
                        "(default: per model)")
    parser.add_argument("--capacities", nargs="+", default=None,
                        help="caching allocator: capacities for every chosen model, as 6MiB "
                        "(default: per model)")
    parser.add_argument("--quick", action="store_true", help="MLP only, B* up to about 1000")
    parser.add_argument("--no-peers", action="store_true", help="run ours only")
    parser.add_argument("--peer-max-bstar", type=int, default=None,
                        help="skip the peers where B* is above this (they are slow there)")
    parser.add_argument("--output", type=Path, default=None,
                        help="default: results/bench_search.md (exact), "
                        "results/bench_search_caching.md (caching)")
    args = parser.parse_args(argv)
    if args.allocator == "exact" and args.capacities:
        parser.error("--capacities applies to --allocator caching; use --targets")
    if args.allocator == "caching" and args.targets:
        parser.error("--targets applies to --allocator exact; use --capacities")

    if args.allocator == "exact":
        targets = QUICK_TARGETS if args.quick else TARGETS
        models = args.models or list(targets)
        cases = [
            Case(m, target=t)
            for m in models for t in (args.targets or targets.get(m, TARGETS[m]))
        ]
    else:
        capacities = QUICK_CAPACITIES if args.quick else CAPACITIES
        models = args.models or list(capacities)
        cases = [
            Case(m, capacity=parse_bytes(c))
            for m in models for c in (args.capacities or capacities.get(m, CAPACITIES[m]))
        ]
    peers, missing = ([], []) if args.no_peers else load_peers()
    # Several peers call gc.collect() on every trial; with torch and Lightning loaded each call
    # walks every object ever imported. Freezing those makes the calls cheap (time only: what
    # is collected, and so every result, is the same).
    gc.collect()
    gc.freeze()

    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", file=sys.stderr, flush=True)

    setups: dict[str, Setup] = {}
    for case in cases:
        if case.model not in setups:
            setups[case.model] = make_setup(case.model, args.allocator)
        run_case(case, setups[case.model], args.allocator, peers, args.peer_max_bstar, log)

    report = (header(peers, missing, args.allocator) + "\n"
              + "\n".join(table(case, args.allocator) for case in cases))
    text, ok = summary(cases, GOALS[args.allocator])
    report += "\n" + tools_summary(cases) + "\n" + text
    report += f"\nThe run took {time.perf_counter() - started:.0f} s.\n"
    print(report)
    output = args.output or RESULTS[args.allocator]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report, encoding="utf-8")
    log(f"wrote {output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
