"""Do the finder's answers hold in a user's own loop under CUDA's caching allocator? (not run in CI)

For bench_search's models under ``--allocator caching`` (an MLP, a conv net with BatchNorm, a
small transformer, each with Adam, and a tiny MLP 16-32-32-4 with AdamW), two of its capacities
each, and five models it does not have (an LSTM over vector sequences; an ``nn.EmbeddingBag``
recommender, a 50000-row table and a tiny cost per row; an MLP whose forward takes another
branch past 64 rows, so the finder's small trials run other operators than the large ones; a
BERT sequence classifier built by ``transformers`` from a small config; a mixture of experts,
top-2 of 8, whose experts' shapes depend on the router and so on the weights the steps train),
each with Adam, every
case runs in a ``SimulatedGPU(capacity, allocator="caching")`` without and with expandable
segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which the simulator reads as
torch does).

In each case ``search_batch_size`` runs with its defaults (``headroom=0.1``) from the model and
a fresh optimizer, with bench_search's training step and recorded batches. The truth is never
the finder's own trials: it is a user's own plain loop (bench_search's ``fresh_loop_fits``), a
fresh copy of the model and a fresh optimizer in a fresh simulator of the same capacity and
setting, a new batch copied to the device each step, the loss held until the next one, for
``CACHING_STEPS`` (5) steps. Per case:

1. the largest size n the finder reports: does n train in that loop, does n+1 fail ("exact":
   both); and whether a size above n trains, looked for cheaply at 1.25n, 1.5n and 2n and at
   every peer's answer above n (under the caching allocator whether a size trains is not
   monotone in the size, so n+1 failing does not prove that nothing larger trains);
2. the recommended size (``batch_size``): does it train in that loop, and its ratio to n
   (the requirement: at least 0.85 in every case); where it is below 0.9n, the largest size
   from 0.9n down to it that trains in that loop (each size run, at most 64);
3. the finder's trials (the recommended size's own included), each listed;
4. the search's CPU cost: its thread CPU time (``time.thread_time``) as a number of plain
   training steps at the recommended size in the same simulator (the median of five), and,
   where batch-finder is installed, as a ratio to batch-finder's CPU time on the same case.

The peers in ``_peers.py`` that are importable (Lightning, Accelerate, the Hugging Face
``Trainer``, toma, batch-finder; ``pip install -e ".[bench]"``) run in the same process through
bench_search's machinery, each answer run in the same loop (exact, trains, or does not train),
with their CPU time as a ratio to ours. torch runs one thread (``torch.set_num_threads(1)``),
so that a thread's CPU time is all the CPU a step takes; only ratios are printed, never seconds.
The process exits with status 1 when a goal is missed.

    python benchmarks/bench_caching.py                   # 36 cases, ~15 minutes on 2 cores
    python benchmarks/bench_caching.py --quick           # 3 models, 1 capacity each, ~1 minute
    python benchmarks/bench_caching.py --no-peers        # ours only
    python benchmarks/bench_caching.py --models lstm bert --no-peers
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import autobatch
from autobatch._sizing._trial import CACHING_STEPS
from autobatch._sizing._workload import DEFAULT_HEADROOM
from autobatch._units import format_bytes, parse_bytes
from autobatch.search import SearchResult
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import RecurrentClassifier, mixture_of_experts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import Peer  # sibling modules of this script
from bench_search import (
    CAPACITIES,
    SAMPLE_ROWS,
    UNLIMITED,
    Row,
    Runner,
    Setup,
    Truth,
    load_peers,
    make_setup,
    peer_search,
    run_tool,
    simulated,
)

# The cases ------------------------------------------------------------------------------------

#: Two capacities per model. bench_search's models take two of its CAPACITIES (the smaller B*:
#: the peers that start at 65536 rows, or double to far above B*, are slow at the large ones);
#: the comments give the finder's largest size, without and with expandable segments.
MODELS: dict[str, tuple[str, str]] = {
    "mlp": ("4MiB", "10MiB"),  # about 270, 1000
    "conv": ("32MiB", "48MiB"),  # about 60, 120
    "transformer": ("24MiB", "64MiB"),  # about 30, 110
    "tiny-mlp": ("2MiB", "8MiB"),  # about 2900, 8000
    "lstm": ("32MiB", "96MiB"),  # about 70, 300
    "embedding-bag": ("64MiB", "96MiB"),  # about 32000, 48000
    "branchy": ("6MiB", "24MiB"),  # about 480, 2900 (1100 with expandable segments)
    "bert": ("16MiB", "48MiB"),  # about 40, 130
    "moe": ("8MiB", "24MiB"),  # about 640, 2048
}
QUICK_MODELS: dict[str, tuple[str, ...]] = {
    "mlp": ("4MiB",), "branchy": ("6MiB",), "embedding-bag": ("64MiB",),
}
assert all(c in CAPACITIES[m] for m, cs in MODELS.items() if m in CAPACITIES for c in cs)

#: The two allocator settings every case runs under.
SETTINGS = {"no expandable segments": False, "expandable segments": True}

PROBES = (1.25, 1.5, 2.0)  # the sizes above the largest, as multiples of it, run in the loop
STEP_REPEATS = 5  # plain steps timed at the recommended size (their median is one step)
SCAN = 64  # sizes run below the headroom's share where the recommended size is below it


@dataclass(frozen=True)
class Goals:
    """The finder's goals under the caching allocator."""

    min_ratio: float = 0.85  # recommended / largest, in every case
    median_trials: int = 5
    max_trials: int = 7
    max_cost_steps: float = 10.0  # the search's CPU time, in plain steps at the recommended size


GOALS = Goals()


class Bag(nn.Module):
    """A recommender: the mean of each row's item embeddings from a large table
    (``nn.EmbeddingBag``, dense gradients), then a small MLP. The table, its gradient and
    Adam's two moments are most of the memory; a row costs a few hundred bytes."""

    def __init__(self, items: int = 50_000, dim: int = 32, hidden: int = 64,
                 classes: int = 10) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(items, dim, mode="mean")
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.bag(items))
        return out


class Branchy(nn.Module):
    """An MLP with a data-dependent branch: past ``threshold`` rows a gate (a 256x256 linear
    layer and a sigmoid) multiplies the hidden activations, three more of them per row and one
    more layer for Adam. The finder's first trials (a few rows) run the light branch."""

    def __init__(self, threshold: int = 64, width: int = 256) -> None:
        super().__init__()
        self.threshold = threshold
        self.body = nn.Sequential(
            nn.Linear(128, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()
        )
        self.gate = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x)
        if x.shape[0] > self.threshold:
            hidden = hidden * torch.sigmoid(self.gate(hidden))
        out: torch.Tensor = self.head(hidden)
        return out


class Logits(nn.Module):
    """A Hugging Face classifier as a module from token ids to logits, for the benchmark's
    ``cross_entropy(model(inputs), labels)`` step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids=tokens).logits
        return out


def bert() -> nn.Module:
    """BERT for sequence classification from a small config (2 layers, width 64, 2 heads,
    vocabulary 1000), random weights, in training mode."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
        vocab_size=1000, max_position_embeddings=128, num_labels=10,
    )
    return Logits(BertForSequenceClassification(config)).train()


def new_setup(name: str) -> Setup:
    """The models bench_search does not have, as its :class:`Setup` (fresh Adam, no state)."""
    torch.manual_seed(0)
    model: nn.Module
    if name == "lstm":  # 32 steps of 16 features
        model = RecurrentClassifier("LSTM", inputs=16, hidden=128)
        inputs = torch.randn(SAMPLE_ROWS, 32, 16)
    elif name == "embedding-bag":  # 16 items per row
        model = Bag()
        inputs = torch.randint(0, 50_000, (SAMPLE_ROWS, 16))
    elif name == "branchy":
        model = Branchy()
        inputs = torch.randn(SAMPLE_ROWS, 128)
    elif name == "bert":  # 32 tokens per row
        model = bert()
        inputs = torch.randint(0, 1000, (SAMPLE_ROWS, 32))
    elif name == "moe":  # top-2 of 8 experts: each expert's rows depend on the router
        model = mixture_of_experts()
        inputs = torch.randn(SAMPLE_ROWS, 128)
    else:
        raise ValueError(f"unknown model {name!r}")
    labels = torch.randint(0, 10, (SAMPLE_ROWS,))
    return Setup(name, model, torch.optim.Adam(model.parameters(), lr=1e-3), inputs, labels)


def setup_for(name: str) -> Setup:
    return make_setup(name, "caching") if name in CAPACITIES else new_setup(name)


@contextlib.contextmanager
def allocator_setting(expandable: bool) -> Iterator[None]:
    """``PYTORCH_CUDA_ALLOC_CONF`` as the setting has it, for every simulator made inside
    (the finder's, the peers', the truth's loops and the timed steps alike)."""
    name = "PYTORCH_CUDA_ALLOC_CONF"
    before = os.environ.get(name)
    os.environ[name] = f"expandable_segments:{expandable}"
    try:
        with SimulatedGPU("64MiB", allocator="caching") as gpu:  # the setting is read
            model = gpu.allocator_copy()
            assert model is not None
            assert model.expandable_segments == expandable
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


# One case -------------------------------------------------------------------------------------


@dataclass
class PeerAnswer:
    """A peer's answer on one case, run in the user's loop."""

    label: str
    returned: int | None
    trains: bool | None  # None: no answer
    exact: bool  # it trains and one more does not
    cpu_vs_ours: float | None
    note: str = ""


@dataclass
class Case:
    """One model in one capacity under one allocator setting: the finder's answers, what the
    user's loop says of them, and the peers'."""

    model: str
    capacity: int
    setting: str
    largest: int = 0
    recommended: int = 0
    trials: list[tuple[int, bool]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # steps per trial
    largest_trains: bool = False
    next_fails: bool = False
    above: list[int] = field(default_factory=list)  # sizes above the largest that train
    recommended_trains: bool = False
    cost_steps: float = math.nan  # search CPU time / one plain step at the recommended size
    vs_batch_finder: float | None = None  # our search CPU time / batch-finder's
    unchanged: bool = True
    peers: list[PeerAnswer] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed: str = ""  # the search raised: why

    @property
    def exact(self) -> bool:
        return self.largest_trains and self.next_fails

    @property
    def ratio(self) -> float:
        return self.recommended / self.largest if self.largest else 0.0

    def sizes(self) -> str:
        return ", ".join(
            f"{size}{'' if fits else '✗'}{'' if s == CACHING_STEPS or not fits else f'({s})'}"
            for (size, fits), s in zip(self.trials, self.steps, strict=True)
        )


def plain_step_cpu(setup: Setup, capacity: int, n: int) -> tuple[float, str]:
    """The thread CPU time of one plain training step at ``n`` (bench_search's step: the
    batch built on the host and copied in, zero_grad, forward, loss, backward, Adam): the
    median of :data:`STEP_REPEATS` steps of a fresh copy in a fresh simulator of ``capacity``
    (the first step makes Adam's state). Where ``n`` does not train there, the simulator has
    no limit (noted)."""
    for limit, note in ((capacity, ""), (UNLIMITED, "plain step timed without a memory limit")):
        model, optimizer = setup.copy()
        runner = Runner(setup, model, optimizer)
        times: list[float] = []
        try:
            with SimulatedGPU(limit, allocator="caching") as gpu:
                gpu.adopt(model, optimizer)
                for _ in range(STEP_REPEATS):
                    started = time.thread_time()
                    runner.step(n)
                    times.append(time.thread_time() - started)
        except torch.OutOfMemoryError:
            continue
        return statistics.median(times), note
    raise AssertionError("unreachable: an unlimited simulator does not run out")


def timed(
    search: Callable[[Runner], tuple[int | None, str]], into: list[float]
) -> Callable[[Runner], tuple[int | None, str]]:
    """``search``, its thread CPU time appended to ``into``."""

    def run(runner: Runner) -> tuple[int | None, str]:
        started = time.thread_time()
        try:
            return search(runner)
        finally:
            into.append(time.thread_time() - started)

    return run


def ours(found: list[SearchResult]) -> Callable[[Runner], tuple[int | None, str]]:
    """``search_batch_size`` with its defaults, from the runner's model and fresh optimizer,
    every batch built (and recorded) by the runner; the result is appended to ``found``."""

    def search(runner: Runner) -> tuple[int | None, str]:
        result = autobatch.search_batch_size(
            runner.model, runner.batch, runner.optimizer, loss_fn=runner.loss_fn
        )
        found.append(result)
        engine = [(t.size, t.fits) for t in result.trials]
        recorded = runner.recorder.trials() if runner.recorder is not None else engine
        note = "" if engine == recorded else f"engine's own record differs: {engine}"
        return result.batch_size, note

    return search


def share_note(truth: Truth, share: int, recommended: int, largest: int) -> str:
    """Where the finder recommends less than the headroom's share of the largest size: the
    largest size from that share down to the recommended one that trains in the user's loop,
    each size run (the fit map has gaps, so no bisection), at most :data:`SCAN` of them."""
    sizes = range(share, max(recommended, share - SCAN), -1)
    best = next((n for n in sizes if truth(n)), None)
    if best is not None:
        found = f"the largest that trains from there down is {best} ({best / largest:.3f} n)"
    elif sizes[-1] == recommended + 1:
        found = f"nothing from there down to the recommended {recommended} trains"
    else:
        found = f"nothing from there down to {sizes[-1]} trains"
    return f"{share} ({1 - DEFAULT_HEADROOM:g} n) in the user's loop: {found}"


def run_case(case: Case, setup: Setup, peers: list[Peer], log: Callable[[str], None]) -> None:
    truth = Truth(setup, case.capacity, "caching")
    memory = simulated(case.capacity, "caching")
    found: list[SearchResult] = []
    cpu: list[float] = []
    row = run_tool("ours", setup, timed(ours(found), cpu), memory)
    case.unchanged = row.unchanged
    case.notes += row.notes
    if not found:
        case.failed = "; ".join(row.notes) or "no result"
        if truth(1):
            case.failed += " (batch 1 trains in the user's loop)"
        log(f"{case.model} {format_bytes(case.capacity)} {case.setting}: {case.failed}")
        return
    result = found[0]
    case.largest, case.recommended = result.max_batch_size, result.batch_size
    case.trials = [(t.size, t.fits) for t in result.trials]
    case.steps = [t.steps for t in result.trials]
    case.notes += list(result.notes)
    case.largest_trains = truth(case.largest)
    case.next_fails = not truth(case.largest + 1)
    probes = sorted({math.ceil(p * case.largest) for p in PROBES} - {case.largest + 1})
    case.above = [n for n in probes if n > case.largest and truth(n)]
    case.recommended_trains = truth(case.recommended)
    share = math.floor((1 - DEFAULT_HEADROOM) * case.largest)
    if case.recommended < share:  # below the headroom's share: could it have been more?
        case.notes.append(share_note(truth, share, case.recommended, case.largest))
    step, note = plain_step_cpu(setup, case.capacity, case.recommended)
    case.cost_steps = cpu[0] / step
    if note:
        case.notes.append(note)
    log(f"{case.model} {format_bytes(case.capacity)} {case.setting}: largest {case.largest} "
        f"({'exact' if case.exact else 'NOT exact'}), recommended {case.recommended}, "
        f"{len(case.trials)} trials, {case.cost_steps:.1f} steps")

    for peer in peers:
        peer_cpu: list[float] = []
        started = time.perf_counter()
        answer: Row = run_tool(peer.label, setup, timed(peer_search(peer), peer_cpu), memory)
        returned = answer.returned
        trains = None if returned is None else truth(returned)
        exact = bool(trains) and returned is not None and not truth(returned + 1)
        if returned is not None and returned > case.largest and trains:
            case.above.append(returned)
        ratio = peer_cpu[0] / cpu[0] if peer_cpu and cpu[0] > 0 else None
        case.peers.append(PeerAnswer(peer.label, returned, trains, exact, ratio,
                                     "; ".join(answer.notes)))
        if peer.label == "batch-finder" and peer_cpu and peer_cpu[0] > 0:
            case.vs_batch_finder = cpu[0] / peer_cpu[0]
        log(f"  {peer.label}: {returned} in {time.perf_counter() - started:.1f} s")
    case.above = sorted(set(case.above))


# Output ---------------------------------------------------------------------------------------


def yes(value: bool) -> str:
    return "yes" if value else "**no**"


def ours_table(cases: list[Case]) -> str:
    lines = [
        "| model | capacity | largest n | n trains | n+1 fails | trains above n "
        "| recommended | trains | recommended/n | trials | sizes tried (✗ = OOM) "
        "| search CPU in plain steps | CPU vs batch-finder | state unchanged |",
        "|---|---:|---:|:---:|:---:|---|---:|:---:|---:|---:|---|---:|---:|:---:|",
    ]
    for case in cases:
        if case.failed:
            lines.append(f"| {case.model} | {format_bytes(case.capacity)} | search raised: "
                         f"{case.failed} |" + " |" * 11)
            continue
        ratio = f"{case.ratio:.3f}" if case.ratio >= GOALS.min_ratio else f"**{case.ratio:.3f}**"
        trials = len(case.trials)
        shown = str(trials) if trials <= GOALS.max_trials else f"**{trials}**"
        vs = "—" if case.vs_batch_finder is None else f"{case.vs_batch_finder:.2f}"
        above = ", ".join(f"**{n}**" for n in case.above) or "none"
        lines.append(
            f"| {case.model} | {format_bytes(case.capacity)} | {case.largest} "
            f"| {yes(case.largest_trains)} | {yes(case.next_fails)} | {above} "
            f"| {case.recommended} | {yes(case.recommended_trains)} | {ratio} | {shown} "
            f"| {case.sizes()} | {case.cost_steps:.1f} | {vs} | {yes(case.unchanged)} |"
        )
    notes = [f"- {case.model}, {format_bytes(case.capacity)}: {note}"
             for case in cases for note in dict.fromkeys(case.notes)]
    return "\n".join(lines + (["", *notes] if notes else [])) + "\n"


def peer_cell(answer: PeerAnswer) -> str:
    if answer.returned is None:
        return "—"
    verdict = "exact" if answer.exact else "trains" if answer.trains else "✗"
    cpu = "" if answer.cpu_vs_ours is None else f", {answer.cpu_vs_ours:.2g}×"
    return f"{answer.returned} {verdict}{cpu}"


def peers_table(cases: list[Case]) -> str:
    labels = list(dict.fromkeys(a.label for case in cases for a in case.peers))
    if not labels:
        return ""
    lines = [
        "Peers: the size each returned, then \"exact\" (it trains in the user's loop and one "
        "more does not), \"trains\" (so does one more) or ✗ (it does not train), then its CPU "
        "time as a multiple of our search's.",
        "",
        "| model | capacity | ours (largest) | " + " | ".join(labels) + " |",
        "|---|---:|---:|" + "---:|" * len(labels),
    ]
    for case in cases:
        cells = {a.label: peer_cell(a) for a in case.peers}
        mark = "exact" if case.exact else "not exact"
        lines.append(
            f"| {case.model} | {format_bytes(case.capacity)} | {case.largest} {mark} | "
            + " | ".join(cells.get(label, "not run") for label in labels) + " |"
        )
    notes = [f"- {case.model}, {format_bytes(case.capacity)}, {a.label}: {a.note}"
             for case in cases for a in case.peers
             if a.note and "(0 restarts after OOM)" not in a.note]
    return "\n".join(lines + (["", *notes] if notes else [])) + "\n"


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "—"


def summary_row(label: str, cases: list[Case]) -> str:
    done = [case for case in cases if not case.failed]
    ratios = [case.ratio for case in done]
    trials = [len(case.trials) for case in done]
    costs = [case.cost_steps for case in done]
    vs = [case.vs_batch_finder for case in done if case.vs_batch_finder is not None]
    m = len(cases)
    return (
        f"| {label} | {sum(c.exact for c in done)} of {m} "
        f"| {sum(bool(c.above) for c in done)} of {m} "
        f"| {sum(c.recommended_trains for c in done)} of {m} "
        f"| {min(ratios, default=0):.3f} | {median(ratios)} "
        f"| {statistics.median(trials) if trials else 0:g} | {max(trials, default=0)} "
        f"| {median(costs)} | {max(costs, default=math.nan):.2f} "
        f"| {median(vs)} ({len(vs)} cases) |"
    )


def peers_summary(cases: list[Case]) -> str:
    labels = list(dict.fromkeys(a.label for case in cases for a in case.peers))
    if not labels:
        return ""
    lines = [
        "| tool | cases | exact | trains, not the largest | does not train | none returned "
        "| median CPU time vs ours |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| ours | {len(cases)} | {sum(c.exact for c in cases)} "
        f"| {sum(c.largest_trains and not c.next_fails for c in cases)} "
        f"| {sum(not c.largest_trains and not c.failed for c in cases)} "
        f"| {sum(bool(c.failed) for c in cases)} | 1 |",
    ]
    for label in labels:
        answers = [a for case in cases for a in case.peers if a.label == label]
        cpu = [a.cpu_vs_ours for a in answers if a.cpu_vs_ours is not None]
        lines.append(
            f"| {label} | {len(answers)} | {sum(a.exact for a in answers)} "
            f"| {sum(bool(a.trains) and not a.exact for a in answers)} "
            f"| {sum(a.trains is False for a in answers)} "
            f"| {sum(a.returned is None for a in answers)} | {median(cpu)} |"
        )
    return "\n".join(lines) + "\n"


def summary(by_setting: dict[str, list[Case]]) -> tuple[str, list[str]]:
    everything = [case for cases in by_setting.values() for case in cases]
    done = [case for case in everything if not case.failed]
    lines = [
        "## Summary",
        "",
        "| setting | exact largest | a size above n trains | recommended trains "
        "| recommended/n min | median | trials median | max | search CPU in plain steps "
        "median | max | CPU vs batch-finder median |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(summary_row(setting, cases) for setting, cases in by_setting.items()),
        summary_row("all", everything),
        "",
    ]
    trials = [len(case.trials) for case in done]
    costs = [case.cost_steps for case in done]
    m = len(everything)
    checks = {
        f"the largest is exact in every case ({sum(c.exact for c in done)} of {m})":
            all(c.exact for c in everything),
        f"no size above the largest trains ({sum(bool(c.above) for c in done)} of {m} "
        "cases have one)": not any(c.above for c in done),
        f"the recommended size trains in every case ({sum(c.recommended_trains for c in done)} "
        f"of {m})": len(done) == m and all(c.recommended_trains for c in done),
        f"recommended/largest >= {GOALS.min_ratio} in every case (min "
        f"{min((c.ratio for c in done), default=0):.3f})":
            len(done) == m and all(c.ratio >= GOALS.min_ratio for c in done),
        f"median trials <= {GOALS.median_trials} (got "
        f"{statistics.median(trials) if trials else 0:g})":
            bool(trials) and statistics.median(trials) <= GOALS.median_trials,
        f"max trials <= {GOALS.max_trials} (got {max(trials, default=0)})":
            bool(trials) and max(trials) <= GOALS.max_trials,
        f"search CPU <= {GOALS.max_cost_steps:g} plain steps at the recommended size in every "
        f"case (median {median(costs)}, max {max(costs, default=math.nan):.2f})":
            bool(costs) and max(costs) <= GOALS.max_cost_steps,
        "state unchanged after every search": all(c.unchanged for c in everything),
    }
    lines += [f"- [{'x' if ok else ' '}] {text}" for text, ok in checks.items()]
    misses = [
        f"- {case.model}, {format_bytes(case.capacity)}, {case.setting}: "
        + (f"search raised: {case.failed}" if case.failed else
           f"largest {case.largest} ({'exact' if case.exact else 'not exact'}"
           + (f"; {', '.join(map(str, case.above))} above it train" if case.above else "")
           + f"), recommended {case.recommended} "
           f"({'trains' if case.recommended_trains else 'does not train'}, "
           f"{case.ratio:.3f} of n), {len(case.trials)} trials: {case.sizes()}, search CPU "
           f"{case.cost_steps:.1f} plain steps")
        for case in everything
        if case.failed or not case.exact or case.above or not case.recommended_trains
        or case.ratio < GOALS.min_ratio or len(case.trials) > GOALS.max_trials
        or case.cost_steps > GOALS.max_cost_steps or not case.unchanged
    ]
    if misses:
        lines += ["", "Cases that miss a goal:", "", *misses]
    failed = [text for text, ok in checks.items() if not ok]
    return "\n".join(lines) + "\n", failed


def header(argv: list[str], peers: list[Peer], missing: list[str]) -> str:
    packages = [
        ("torch", torch.__version__),
        ("autobatch", autobatch.__version__),
        *sorted({(p.distribution, p.version()) for p in peers}),
    ]
    versions = ", ".join(f"{name} {version}" for name, version in packages)
    command = " ".join(["python", "benchmarks/bench_caching.py", *argv])
    lines = [
        f"`{command}`",
        "",
        "# The finder's answers under CUDA's caching allocator, against a user's own loop",
        "",
        "Each case: `search_batch_size` with its defaults (headroom "
        f"{DEFAULT_HEADROOM}) from the model and a fresh Adam optimizer (AdamW for the tiny MLP "
        "16-32-32-4) inside `SimulatedGPU(capacity, allocator=\"caching\")`, without and with "
        "expandable segments. The truth is a user's own plain loop: a fresh copy of the model "
        "and a fresh optimizer in a fresh simulator of the same capacity and setting, a new "
        f"batch copied to the device each step, the loss held until the next one, {CACHING_STEPS} "
        "steps. \"n trains\"/\"n+1 fails\": the finder's largest size n, and one more, in that "
        "loop; \"trains above n\": the sizes among 1.25n, 1.5n, 2n and the peers' answers above "
        "n that train in it. Trials are the finder's own (the recommended size's included): a "
        f"trial that fits runs {CACHING_STEPS} steps, or more (in parentheses) while the "
        "reserved memory still grows. \"search CPU in plain steps\": the search's thread CPU "
        "time over one plain training step's at the recommended size in the same simulator "
        "(median of 5); \"CPU vs batch-finder\": our search's CPU time over batch-finder's on "
        "the same case. torch runs one thread. \"state unchanged\" compares parameters, "
        "buffers, gradients and the optimizer's state_dict bit for bit. Versions: "
        f"{versions}.",
        "",
    ]
    for peer in peers:
        if peer.note:
            lines.append(f"- {peer.label}: {peer.note}")
    lines += [f"- not run: {reason}" for reason in missing]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
    parser.add_argument("--capacities", nargs="+", default=None,
                        help="capacities for every chosen model, as 6MiB (default: per model)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK_MODELS)}, one capacity each")
    parser.add_argument("--no-peers", action="store_true", help="run ours only")
    parser.add_argument("--peers", nargs="+", default=None, metavar="LABEL",
                        help="run only these peers (their labels, e.g. batch-finder)")
    args = parser.parse_args(argv)
    arguments = sys.argv[1:] if argv is None else argv

    chosen = QUICK_MODELS if args.quick else MODELS
    models = args.models or list(chosen)
    capacities = {m: tuple(args.capacities or chosen.get(m, MODELS[m])) for m in models}
    torch.set_num_threads(1)
    peers, missing = ([], []) if args.no_peers else load_peers()
    if args.peers is not None:
        peers = [peer for peer in peers if peer.label in args.peers]
    # As in bench_search: several peers call gc.collect() on every trial; freezing what is
    # loaded makes those calls cheap (what they collect, and so every result, is the same).
    gc.collect()
    gc.freeze()

    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", file=sys.stderr, flush=True)

    setups = {m: setup_for(m) for m in models}
    by_setting: dict[str, list[Case]] = {}
    for setting, expandable in SETTINGS.items():
        cases = by_setting.setdefault(setting, [])
        with allocator_setting(expandable):
            for m in models:
                for capacity in capacities[m]:
                    case = Case(m, parse_bytes(capacity), setting)
                    run_case(case, setups[m], peers, log)
                    cases.append(case)

    report = header(arguments, peers, missing)
    for setting, cases in by_setting.items():
        report += f"\n## {setting[0].upper()}{setting[1:]}\n\n" + ours_table(cases)
        table = peers_table(cases)
        if table:
            report += "\n" + table
    text, failed = summary(by_setting)
    report += "\n" + text
    everything = [case for cases in by_setting.values() for case in cases]
    if peers:
        report += "\n### Peers over all cases\n\n" + peers_summary(everything)
    report += f"\nThe run took {time.perf_counter() - started:.0f} s.\n"
    print(report)
    log("goals missed: " + "; ".join(failed) if failed else "every goal met")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
