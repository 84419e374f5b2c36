"""How exact and how cheap is the batch-size search, next to the other tools? (not run in CI)

For an MLP, a conv net with BatchNorm and a small transformer, each trained with Adam, and a
tiny MLP 16-32-32-4 trained with AdamW (about 500 bytes per sample, less than one 512-byte
allocator block), the simulated GPU's capacity is chosen so that the true largest batch B*
lands on a target (37, 100, 1000, 4097, 20000 for the MLP; 32, 100, 1000, 10000, 100000 for the
tiny MLP; 37, 100, 1000 for the others by default). B* itself is
not taken from any model: it is the largest n for which two real training steps fit in a
fresh ``SimulatedGPU(capacity)``, checked at B* (fits) and B*+1 (does not).

Then, in the same process and the same simulator, each tool searches from the same model and
optimizer (Adam, warmed up so its state is resident):

- ours: ``search_batch_size(..., headroom=0)`` under the simulated GPU (memory statistics);
- ours without statistics: the same on the plain CPU, where CUDA's OOM error is raised
  whenever the model gets more than B* rows, so the engine doubles and bisects;
- the peers in ``_peers.py`` (Lightning, Accelerate, the Hugging Face ``Trainer``'s
  ``auto_find_batch_size``, toma, batch-finder), when installed.

Every batch any tool runs is built by one function, which records its size; a step counts as
done when the optimizer's step returns. Consecutive steps at one size are one trial. Model
parameters, buffers, gradients and the optimizer's state_dict are compared bit for bit before
and after each tool.

    python benchmarks/bench_search.py                 # the full matrix, ~6 minutes on 2 cores
    python benchmarks/bench_search.py --quick         # MLP only, small B*
    python benchmarks/bench_search.py --no-peers --models conv --targets 37 100
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

import autobatch
from autobatch.testing import OOM_KINDS, SimulatedGPU
from autobatch.testing.models import WORKLOADS, mlp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import PEERS, Peer  # a sibling module of this script

RESULTS = Path(__file__).resolve().parent / "results" / "bench_search.md"

TARGETS: dict[str, tuple[int, ...]] = {
    "mlp": (37, 100, 1000, 4097, 20000),
    "conv": (37, 100, 1000),
    "transformer": (37, 100, 1000),
    "tiny-mlp": (32, 100, 1000, 10000, 100000),
}
QUICK_TARGETS: dict[str, tuple[int, ...]] = {"mlp": (37, 100, 1000)}

SAMPLE_ROWS = 8  # distinct rows every batch cycles through
UNLIMITED = 2**50  # a simulated GPU that never runs out, for measuring peaks

# The goals for our engine, from the issue.
MEDIAN_TRIALS, MAX_TRIALS, MEDIAN_OOM, MAX_SAMPLES_PER_BSTAR = 5, 8, 2, 3.0


def no_statistics_bound(bstar: int) -> float:
    """Trials allowed without memory statistics: 2·log2(B*) + 2."""
    return 2 * math.log2(bstar) + 2


# The training setup --------------------------------------------------------------------------


@dataclass
class Setup:
    """A model and its optimizer as a user has them when they search: Adam already stepped once
    (its state resident), no gradients. Each tool gets a deep copy."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    labels: torch.Tensor

    def copy(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = copy.deepcopy((self.model, self.optimizer))
        return model, optimizer


def make_setup(name: str) -> Setup:
    torch.manual_seed(0)
    if name == "tiny-mlp":  # ~500 bytes per sample: the peak is a staircase of 512-byte blocks
        model = mlp(width=32, depth=2, inputs=16, classes=4)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs, labels = torch.randn(SAMPLE_ROWS, 16), torch.randint(0, 4, (SAMPLE_ROWS,))
        setup = Setup(name, model, optimizer, inputs, labels)
        Runner(setup, model, optimizer).step(8)
        optimizer.zero_grad(set_to_none=True)
        return setup
    workload = WORKLOADS[name]
    model = workload.model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs, labels = workload.sample(SAMPLE_ROWS)
    setup = Setup(name, model, optimizer, inputs, labels)
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
        if self.recorder is not None:
            self.recorder.begin(n)
        rows = torch.arange(n) % SAMPLE_ROWS
        return self.setup.inputs.index_select(0, rows), self.setup.labels.index_select(0, rows)

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
    model, optimizer = setup.copy()
    runner = Runner(setup, model, optimizer)
    with SimulatedGPU(UNLIMITED) as gpu:
        gpu.adopt(model, optimizer)
        runner.step(n)
        runner.step(n)
    return int(gpu.peak_bytes)


def two_steps_fit(setup: Setup, capacity: int, n: int) -> bool:
    model, optimizer = setup.copy()
    runner = Runner(setup, model, optimizer)
    fits = True
    with SimulatedGPU(capacity) as gpu:
        gpu.adopt(model, optimizer)
        try:
            runner.step(n)
            runner.step(n)
        except torch.OutOfMemoryError:
            fits = False
    return fits


def capacity_for(setup: Setup, target: int) -> tuple[int, int]:
    """``(capacity, B*)``: a capacity halfway between the peaks at ``target`` and
    ``target + 1``, and the largest n whose two steps fit in it, found by direct checks
    (galloping from the target, then bisection) and confirmed at B* and B*+1."""
    low_peak, high_peak = peak_of_two_steps(setup, target), peak_of_two_steps(setup, target + 1)
    capacity = (low_peak + high_peak) // 2
    fits = {}

    def check(n: int) -> bool:
        if n not in fits:
            fits[n] = two_steps_fit(setup, capacity, n)
        return fits[n]

    if check(target):
        low, gap = target, 1
        while check(low + gap):
            low, gap = low + gap, 2 * gap
        high = low + gap
    else:
        high, gap = target, 1
        while high - gap >= 1 and not check(high - gap):
            high, gap = high - gap, 2 * gap
        low = max(high - gap, 1)
        if not check(low):
            raise RuntimeError(f"{setup.name}: even batch 1 does not fit in {capacity} bytes")
    while high - low > 1:
        middle = (low + high) // 2
        if check(middle):
            low = middle
        else:
            high = middle
    if not check(low) or check(low + 1):  # B* and B*+1, checked directly
        raise RuntimeError(f"{setup.name}: no clean boundary near {low} in {capacity} bytes")
    return capacity, low


# Running the tools -----------------------------------------------------------------------------


@dataclass
class Row:
    """One tool on one case."""

    tool: str
    bstar: int
    returned: int | None
    trials: list[tuple[int, bool]]
    samples: int
    changed: list[str]
    note: str = ""

    @property
    def unchanged(self) -> bool:
        return not self.changed

    @property
    def oom_trials(self) -> int:
        return sum(not fits for _, fits in self.trials)

    @property
    def exact(self) -> bool:
        return self.returned == self.bstar

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
    bstar: int,
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
    return Row(tool, bstar, returned, recorder.trials(), recorder.samples, changed, note)


def simulated(capacity: int) -> Callable[..., contextlib.AbstractContextManager[Any]]:
    @contextlib.contextmanager
    def memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        with SimulatedGPU(capacity) as gpu:
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


def ours(runner: Runner) -> tuple[int | None, str]:
    result = autobatch.search_batch_size(
        runner.model, runner.batch, runner.optimizer, loss_fn=F.cross_entropy, headroom=0
    )
    engine = [(t.size, t.fits) for t in result.trials]
    recorded = runner.recorder.trials() if runner.recorder is not None else engine
    note = "" if engine == recorded else f"engine's own record differs: {engine}"
    return result.batch_size, note


def peer_search(peer: Peer) -> Callable[[Runner], tuple[int | None, str]]:
    def search(runner: Runner) -> tuple[int | None, str]:
        with quiet():
            found = peer.run(runner)
        return found if isinstance(found, tuple) else (found, "")

    return search


@dataclass
class Case:
    model: str
    target: int
    capacity: int = 0
    bstar: int = 0
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def run_case(case: Case, setup: Setup, peers: list[Peer], log: Callable[[str], None]) -> None:
    case.capacity, case.bstar = capacity_for(setup, case.target)
    log(f"{case.model} target {case.target}: capacity {case.capacity} bytes, B* = {case.bstar}")
    case.rows.append(run_tool("ours", setup, case.bstar, ours, simulated(case.capacity)))
    case.rows.append(
        run_tool("ours, no statistics", setup, case.bstar, ours, oom_above(case.bstar))
    )
    for peer in peers:
        started = time.perf_counter()
        case.rows.append(
            run_tool(peer.label, setup, case.bstar, peer_search(peer), simulated(case.capacity))
        )
        log(f"  {peer.label}: {time.perf_counter() - started:.1f} s")


# Output ---------------------------------------------------------------------------------------


def table(case: Case) -> str:
    lines = [
        f"### {case.model}, B* = {case.bstar}",
        "",
        "| tool | B* | returned | returned/B* | trials | OOM trials | samples processed "
        "| state unchanged |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in case.rows:
        returned = "—" if row.returned is None else str(row.returned)
        ratio = "—" if row.returned is None else f"{row.returned / row.bstar:.3f}"
        samples = f"{row.samples} ({row.samples / row.bstar:.1f}×B*)"
        lines.append(
            f"| {row.tool} | {row.bstar} | {returned} | {ratio} | {len(row.trials)} "
            f"| {row.oom_trials} | {samples} "
            f"| {'yes' if row.unchanged else 'no (' + ', '.join(row.changed) + ')'} |"
        )
    lines += ["", "Sizes tried (✗ = OOM):", ""]
    lines += [f"- {row.tool}: {row.sizes()}" for row in case.rows]
    lines += [f"- {row.tool}: {row.note}" for row in case.rows if row.note]
    lines += [
        f"- {row.tool} returned {row.returned}, a size it never ran successfully"
        for row in case.rows
        if row.returned is not None and (row.returned, True) not in row.trials
    ]
    lines += [f"- skipped {reason}" for reason in case.skipped]
    return "\n".join(lines) + "\n"


def summary(cases: list[Case]) -> tuple[str, bool]:
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
        f"median trials <= {MEDIAN_TRIALS} (got {statistics.median(trials):g})":
            statistics.median(trials) <= MEDIAN_TRIALS,
        f"max trials <= {MAX_TRIALS} (got {max(trials)})": max(trials) <= MAX_TRIALS,
        f"median OOM trials <= {MEDIAN_OOM} (got {statistics.median(ooms):g})":
            statistics.median(ooms) <= MEDIAN_OOM,
        f"samples <= {MAX_SAMPLES_PER_BSTAR:g}·B* (max {max(per_bstar):.2f}·B*)":
            max(per_bstar) <= MAX_SAMPLES_PER_BSTAR,
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
        f"- {case.model}, B* = {case.bstar}: {row.tool} tried {row.sizes(limit=10**9)} and returned "
        f"{row.returned}"
        for case in cases for row in case.rows
        if (row.tool == "ours" and (not row.exact or len(row.trials) > MAX_TRIALS
                                    or row.samples > MAX_SAMPLES_PER_BSTAR * row.bstar))
        or (row.tool == "ours, no statistics"
            and (not row.exact or len(row.trials) > no_statistics_bound(row.bstar)))
    ]
    if misses:
        lines += ["", "Cases that miss a goal:", *misses]
    return "\n".join(lines) + "\n", all(checks.values())


def header(peers: list[Peer], missing: list[str]) -> str:
    packages = [
        ("torch", torch.__version__),
        ("autobatch", autobatch.__version__),
        *sorted({(p.distribution, p.version()) for p in peers}),
    ]
    versions = ", ".join(f"{name} {version}" for name, version in packages)
    lines = [
        "# Batch-size search: ours and the peers on a simulated GPU",
        "",
        "Produced by `python benchmarks/bench_search.py`. Each tool starts from the same model "
        "and Adam optimizer (AdamW for the tiny MLP 16-32-32-4; state resident) inside "
        "`SimulatedGPU(capacity)`; B* is the largest "
        "batch whose two real training steps fit in that capacity, checked at B* and B*+1. "
        "Trials are the sizes a tool ran (consecutive steps at one size are one trial); samples "
        "are all rows it ran (Lightning runs 3 steps per trial, the Trainer 2 per training "
        "attempt); \"state unchanged\" compares "
        "parameters, buffers, gradients and the optimizer's state_dict bit for bit. "
        "\"ours, no statistics\" is the same search on the plain CPU, with CUDA's OOM error "
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(TARGETS), default=None)
    parser.add_argument("--targets", nargs="+", type=int, default=None,
                        help="B* targets for every chosen model (default: per model)")
    parser.add_argument("--quick", action="store_true", help="MLP only, B* up to 1000")
    parser.add_argument("--no-peers", action="store_true", help="run ours only")
    parser.add_argument("--peer-max-bstar", type=int, default=None,
                        help="skip the peers where B* is above this (they are slow there)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    plan = QUICK_TARGETS if args.quick else TARGETS
    models = args.models or list(plan)
    cases = [Case(m, t) for m in models for t in (args.targets or plan.get(m, TARGETS[m]))]
    peers: list[Peer] = []
    missing: list[str] = []
    if not args.no_peers:
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
        setup = setups.setdefault(case.model, make_setup(case.model))
        chosen = peers
        if args.peer_max_bstar is not None and case.target > args.peer_max_bstar:
            chosen = []
            case.skipped.append(f"the peers: B* above --peer-max-bstar={args.peer_max_bstar}")
        run_case(case, setup, chosen, log)

    report = header(peers, missing) + "\n" + "\n".join(table(case) for case in cases)
    text, ok = summary(cases)
    report += "\n" + text
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report, encoding="utf-8")
    log(f"wrote {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
