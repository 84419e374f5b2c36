"""The ``autobatch`` command (also ``python -m autobatch``).

Subcommands: ``find`` (search with real steps), ``plan`` (predict without running a step),
``best`` (time real steps, pick the fastest size) and ``demo`` (``find`` on a built-in model).
Progress is printed one line per trial as it runs, then the result; with ``--json`` stdout
carries only the result, as one JSON object, and the progress goes to stderr. Warnings and
errors always go to stderr.

Exit codes: 0 success, 1 an error while running the model, 2 a usage error (bad argument,
model or sample), 3 nothing fits (even the smallest batch runs out of memory), 130 interrupted.
Errors are one line; ``--verbose`` adds the traceback and the search's debug log.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

import torch
from torch import nn

from autobatch._backends import memory_for, resolve_device
from autobatch._cache import ResultCache, cached_search, open_cache, search_key
from autobatch._errors import BatchSizeError
from autobatch._finder import search_batch_size
from autobatch._oom import oom_kind
from autobatch._result import SearchResult, result_to_dict
from autobatch._search import Trial
from autobatch._throughput import ThroughputPoint, ThroughputResult, _check, find_best_batch
from autobatch._units import format_bytes, parse_bytes
from autobatch._validate import check_search_options
from autobatch._workload import LossFn, language_model_loss
from autobatch.testing import SimulatedGPU
from autobatch.testing.models import WORKLOADS

PROG = "autobatch"

#: The simulated GPU's size for ``find`` and ``best`` when the device is the CPU.
DEFAULT_SIMULATED = "4GiB"
#: The demo's simulated GPU: small enough that the whole demo takes seconds on a laptop.
DEMO_SIMULATED = "64MiB"
DEMO_WORKLOADS = ("conv", "mlp", "transformer")
_DEMO_TEXT = {
    "conv": "a small conv net with BatchNorm",
    "mlp": "a 3-layer MLP",
    "transformer": "a 2-layer transformer encoder",
}

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOTHING_FITS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer] | None] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
    "none": None,
}
_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": nn.functional.cross_entropy,
    "mse": nn.functional.mse_loss,
}


class UsageError(Exception):
    """A bad command line: reported as one line, exit code 2."""


class _ArgumentError(UsageError):
    """argparse refused the command line; ``prog`` is the (sub)command that did."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, with errors as one line (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(message, self.prog)


# --------------------------------------------------------------------------- the parser


def _common(parser: argparse.ArgumentParser, *, cache: bool, plot: bool) -> None:
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print the result as one JSON object on stdout (progress on stderr)")
    if plot:
        out.add_argument("--plot", metavar="FILE.png",
                         help="save a plot of the result (needs matplotlib: the [plot] extra)")
    if cache:
        out.add_argument("--no-cache", action="store_true",
                         help="measure even when a cached result for this exact setup exists")
        out.add_argument("--cache-dir", metavar="DIR",
                         help="the result cache (default: $AUTOBATCH_CACHE_DIR, else "
                              "$XDG_CACHE_HOME/autobatch, else ~/.cache/autobatch)")
    out.add_argument("--verbose", "-v", action="store_true",
                     help="show the search's debug log, and tracebacks on errors")


def _workload(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and sample")
    group.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY",
                       help="a callable returning the nn.Module (called with no arguments)")
    sample = group.add_mutually_exclusive_group(required=True)
    sample.add_argument("--sample", metavar="PKG.MODULE:FACTORY",
                        help="a callable returning an example batch; or taking n and "
                             "returning a batch of n rows")
    sample.add_argument("--sample-shape", metavar="D1,D2,...",
                        help="the shape of one input row, e.g. 3,224,224")
    group.add_argument("--dtype", default="float32",
                       help="dtype of the --sample-shape input (default float32; integer "
                            "inputs are zeros, valid token ids)")
    group.add_argument("--labels", default="none", metavar="classes:N|tokens|none",
                       help="with --sample-shape: classes:N, an int class label per row (the "
                            "sample is (input, label) and the loss cross-entropy); tokens, a "
                            "language model's labels, the input tokens themselves (the model's "
                            "own loss when forward takes labels=, else next-token "
                            "cross-entropy); or none (default)")
    group.add_argument("--loss", default="auto", metavar="auto|cross_entropy|mse|PKG.MODULE:FN",
                       help="loss_fn(output, target): default cross-entropy with class labels, "
                            "else a scalar output, output.loss, or a stand-in that costs as "
                            "much as a training loss (cross-entropy over each output's last "
                            "dimension)")
    group.add_argument("--optimizer", default="adamw", choices=sorted(_OPTIMIZERS),
                       help="optimizer whose state is counted (default adamw; sgd has "
                            "momentum 0.9; none: forward and backward only)")
    group.add_argument("--inference", action="store_true",
                       help="the inference batch: forward only, under torch.inference_mode()")


def _device(parser: argparse.ArgumentParser, default_simulated: str) -> None:
    group = parser.add_argument_group("device")
    group.add_argument("--device", metavar="DEV",
                       help="e.g. cuda, cuda:1, xpu, mps (default: the best available)")
    group.add_argument("--simulate", metavar="SIZE|off",
                       help="run on a GPU of SIZE simulated on the CPU, e.g. 16GiB (default "
                            f"when the device is the CPU: {default_simulated}; off: the real "
                            "CPU)")


def _search_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("search")
    group.add_argument("--headroom", type=float, default=0.05, metavar="FRACTION",
                       help="fraction of the memory to leave free at the peak (default 0.05)")
    group.add_argument("--min-batch", type=int, default=1, metavar="N",
                       help="never try less than N (default 1)")
    group.add_argument("--max-batch", type=int, metavar="N", help="never try more than N")
    group.add_argument("--multiple-of", type=int, default=1, metavar="N",
                       help="only sizes that are multiples of N (e.g. 8 for tensor cores)")


def build_parser() -> argparse.ArgumentParser:
    """The ``autobatch`` argument parser."""
    from autobatch._version import __version__

    parser = _Parser(
        prog=PROG,
        description="Find the largest batch that fits in GPU memory, or the fastest one.",
        epilog="Exit codes: 0 success, 1 error while running, 2 usage error, 3 nothing fits.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_Parser)

    find = commands.add_parser(
        "find", help="search for the largest batch with real training steps",
        description="Search for the largest batch that fits, with real forward, backward and "
                    "optimizer steps. Results are cached per model, sample, device and options.",
    )
    _workload(find)
    _device(find, DEFAULT_SIMULATED)
    _search_options(find)
    _common(find, cache=True, plot=True)
    find.set_defaults(handler=_find)

    plan = commands.add_parser(
        "plan", help="predict the largest batch without running a training step",
        description="Predict the largest batch from the model and sample alone, for a device "
                    "of a given size (no GPU needed).",
    )
    _workload(plan)
    group = plan.add_argument_group("target")
    group.add_argument("--capacity", metavar="SIZE",
                       help="the target device's memory, e.g. 80GiB (default: the GPU's here)")
    group.add_argument("--device", metavar="DEV", help="read the capacity of this device")
    group.add_argument("--overhead", metavar="SIZE",
                       help="memory the plan cannot see (CUDA context, library workspaces; "
                            "default 0)")
    _search_options(plan)
    _common(plan, cache=False, plot=False)
    plan.set_defaults(handler=_plan)

    best = commands.add_parser(
        "best", help="time real steps and pick the fastest batch size",
        description="Time real steps at sizes up to the largest that fits and pick the "
                    "smallest size within a tolerance of the best samples/second.",
    )
    _workload(best)
    _device(best, DEFAULT_SIMULATED)
    _search_options(best)
    group = best.add_argument_group("timing")
    group.add_argument("--tolerance", type=float, default=0.02, metavar="FRACTION",
                       help="pick the smallest size within this fraction of the best "
                            "throughput (default 0.02)")
    group.add_argument("--repeats", type=int, default=5, metavar="N",
                       help="timed steps per size; their median counts (default 5)")
    group.add_argument("--warmup", type=int, default=2, metavar="N",
                       help="untimed steps per size before the timed ones (default 2)")
    group.add_argument("--candidates", metavar="N1,N2,...",
                       help="sizes to time (default: powers of two up to the largest that "
                            "fits, and that size); skips the search")
    _common(best, cache=True, plot=True)
    best.set_defaults(handler=_best)

    demo = commands.add_parser(
        "demo", help="find the largest batch of a built-in model (simulated GPU if none)",
        description="Run find on a built-in model: on the GPU when there is one, otherwise on "
                    f"a simulated {DEMO_SIMULATED} GPU, printing each trial and the result.",
    )
    demo.add_argument("--workload", default="conv", choices=DEMO_WORKLOADS,
                      help="the built-in model (default conv: a conv net on 3x32x32 images)")
    _device(demo, DEMO_SIMULATED)
    demo.add_argument("--headroom", type=float, default=0.05, metavar="FRACTION",
                      help="fraction of the memory to leave free (default 0.05)")
    _common(demo, cache=False, plot=True)
    demo.set_defaults(handler=_demo)
    return parser


# --------------------------------------------------------------------------- reading arguments


def _load(spec: str, option: str) -> Any:
    """The object ``package.module:attribute`` names (the current directory is importable)."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"{option} {spec!r}: write package.module:callable, e.g. mypkg.models:resnet")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"{option} {spec!r}: cannot import {module_name!r} ({error})") from error
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"{option} {spec!r}: {module_name} has no {attribute!r}") from None
    return target


def _make_model(spec: str) -> nn.Module:
    factory = _load(spec, "--model")
    model = factory if isinstance(factory, nn.Module) else None
    if model is None:
        if not callable(factory):
            raise UsageError(f"--model {spec!r} is a {type(factory).__name__}, not a callable")
        model = factory()
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _takes_size(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` has a required positional parameter (it is ``n -> batch``)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in parameters
    )


def _parse_shape(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    shape = tuple(int(part) for part in parts if part.isdigit())
    if len(shape) != len(parts) or any(d < 1 for d in shape):
        raise UsageError(
            f"--sample-shape {text!r}: give the shape of one row as positive ints, e.g. 3,224,224"
        )
    return shape


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype {name!r} is not a torch dtype; e.g. float32, bfloat16, int64")
    return dtype


def _parse_labels(text: str) -> int | str | None:
    """``classes:N`` gives N, ``tokens`` gives "tokens", ``none`` None."""
    if text in ("none", "tokens"):
        return None if text == "none" else text
    kind, _, count = text.partition(":")
    if kind == "classes" and count.isdigit() and int(count) >= 1:
        return int(count)
    raise UsageError(
        f"--labels {text!r}: write classes:N (e.g. classes:1000), tokens (a language model: the "
        "labels are the input tokens) or none"
    )


@dataclass(frozen=True)
class _Sample:
    value: Any
    classes: int | None
    text: str
    tokens: bool = False


def _make_sample(args: argparse.Namespace) -> _Sample:
    if args.sample is not None:
        if args.labels != "none":
            raise UsageError("--labels goes with --sample-shape; a --sample makes its own labels")
        factory = _load(args.sample, "--sample")
        if not callable(factory):
            return _Sample(factory, None, args.sample)
        if _takes_size(factory):
            return _Sample(factory, None, f"{args.sample}(n)")
        return _Sample(factory(), None, f"{args.sample}()")
    shape = _parse_shape(args.sample_shape)
    dtype = _parse_dtype(args.dtype)
    labels = _parse_labels(args.labels)
    generator = torch.Generator().manual_seed(0)  # never touches the global RNG
    if dtype.is_floating_point or dtype.is_complex:
        inputs = torch.randn((1, *shape), generator=generator).to(dtype)
    else:
        inputs = torch.zeros((1, *shape), dtype=dtype)
    text = f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
    if labels is None:
        return _Sample(inputs, None, text)
    if labels == "tokens":
        if dtype.is_floating_point or dtype.is_complex or len(shape) != 1:
            raise UsageError(
                f"--labels tokens needs token ids: --sample-shape LENGTH --dtype int64, not "
                f"{text}"
            )
        return _Sample(inputs, None, f"{text} tokens, labels the tokens", tokens=True)
    assert isinstance(labels, int)
    target = torch.randint(0, labels, (1,), generator=generator)
    return _Sample((inputs, target), labels, f"{text} with a label of {labels} classes")


def _language_model_sample(sample: _Sample, model: nn.Module) -> tuple[Any, LossFn | None]:
    """``--labels tokens``: the model's own loss when its forward takes ``labels=`` (a Hugging
    Face model: ``{input name: tokens, "labels": tokens}``), else ``(tokens, tokens)`` and a
    next-token cross-entropy over the logits."""
    tokens = sample.value
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = [p.name for p in parameters]
    if "labels" in names and parameters and parameters[0].name != "labels":
        return {parameters[0].name: tokens, "labels": tokens}, None
    return (tokens, tokens), language_model_loss


def _make_loss(spec: str, classes: int | None) -> Callable[..., torch.Tensor] | None:
    if spec == "auto":
        return nn.functional.cross_entropy if classes is not None else None
    if spec in _LOSSES:
        return _LOSSES[spec]
    loss = _load(spec, "--loss")
    if not callable(loss):
        raise UsageError(f"--loss {spec!r} is not callable")
    return loss  # type: ignore[no-any-return]


def _parse_sizes(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    sizes = [int(part) for part in parts if part.isdigit()]
    if len(sizes) != len(parts) or any(s < 1 for s in sizes):
        raise UsageError(f"--candidates {text!r}: give positive batch sizes, e.g. 16,32,64")
    return sizes


@dataclass(frozen=True)
class _Target:
    """Where to run: a real device, or the CPU under a simulated GPU of ``simulate`` bytes."""

    device: torch.device
    simulate: int | None
    defaulted: bool


def _target(args: argparse.Namespace, default_simulated: str) -> _Target:
    simulate: str | None = args.simulate
    try:
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"--device {args.device}: {error}") from None
    if simulate is not None and simulate.lower() != "off":
        if device.type != "cpu":
            raise UsageError(
                f"--simulate runs on the CPU, but --device {args.device} was given; drop one"
            )
        try:
            size = parse_bytes(simulate, name="--simulate")
        except (TypeError, ValueError) as error:
            raise UsageError(str(error)) from None
        return _Target(torch.device("cpu"), size, defaulted=False)
    try:
        memory_for(device)  # fails clearly for a device this machine does not have
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"--device {args.device}: {error}") from None
    if device.type == "cpu" and simulate is None:
        return _Target(device, parse_bytes(default_simulated), defaulted=True)
    if device.type == "cpu" and getattr(args, "max_batch", None) is None:
        raise UsageError(
            "--simulate off on the CPU searches host memory, where running out can bring in the "
            "operating system's out-of-memory killer instead of an error; give --max-batch N"
        )
    return _Target(device, None, defaulted=False)


@contextlib.contextmanager
def _running_on(target: _Target, model: nn.Module) -> Iterator[None]:
    """Moves the model to the device, or runs under the simulated GPU with the model counted.

    A model that does not fit at all is a :class:`~autobatch.BatchSizeError` (nothing fits).
    """
    failed: str | None = None
    if target.simulate is None:
        try:
            model.to(target.device)
        except Exception as error:
            failed = oom_kind(error)
            if failed is None:
                raise
        if failed is not None:  # out of the except block: the partial copy is gone
            _model_does_not_fit(model, target, failed)
        yield
        return
    with SimulatedGPU(target.simulate) as gpu:
        try:
            gpu.adopt(model)
        except torch.OutOfMemoryError:
            failed = "cuda_allocator"
        if failed is not None:
            _model_does_not_fit(model, target, failed)
        yield


def _model_does_not_fit(model: nn.Module, target: _Target, kind: str) -> NoReturn:
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    capacity = target.simulate or memory_for(target.device).capacity_bytes()
    raise BatchSizeError(
        f"the model alone ({format_bytes(size)} of parameters and buffers) does not fit in "
        f"{format_bytes(capacity)} ({kind}), so no batch can run; use a device with more memory"
        + (" (--simulate a larger size)" if target.simulate else ""),
        batch_size=1,
        needed_bytes=size,
        capacity_bytes=capacity,
    )


def _describe_target(target: _Target) -> str:
    if target.simulate is None:
        memory = memory_for(target.device)
        name = f"{memory.name} with {format_bytes(memory.capacity_bytes())}"
    else:
        name = f"a simulated GPU with {format_bytes(target.simulate)} on the CPU"
    if target.defaulted:
        return f"running on {name} (no GPU in use; --simulate SIZE picks another size)"
    return f"running on {name}"


# --------------------------------------------------------------------------- output


_PROGRESS_LOGGERS = ("autobatch.trial", "autobatch.throughput")


class _Progress(logging.Handler):
    """Prints the trial runner's and the timer's lines as they happen, numbered."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.INFO)
        self.stream = stream
        self.trials = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            item = record.args[0] if isinstance(record.args, tuple) and record.args else None
            if isinstance(item, Trial):
                self.trials += 1
                print(f"  trial {self.trials:>2}  {item}", file=self.stream, flush=True)
            elif isinstance(item, ThroughputPoint):
                print(f"  timing    {item}", file=self.stream, flush=True)
            # other lines (the summaries) are left to the command, which prints its own
        except Exception:  # a broken stream must not stop the search
            self.handleError(record)


class _Messages(logging.Handler):
    """Every other autobatch log line: warnings (or everything with --verbose), one line each."""

    def __init__(self, stream: TextIO, level: int) -> None:
        super().__init__(level)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        if record.name in _PROGRESS_LOGGERS and record.levelno < logging.WARNING:
            return  # the progress handler's
        try:
            kind = "warning: " if record.levelno >= logging.WARNING else ""
            print(f"{PROG}: {kind}{record.getMessage()}", file=self.stream, flush=True)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _reporting(verbose: bool, progress_stream: TextIO, stream: TextIO) -> Iterator[None]:
    """Progress lines on ``progress_stream``, warnings (and with ``verbose`` the debug log) on
    ``stream``, for the duration of the command; logging and warnings are put back after."""
    root = logging.getLogger("autobatch")
    progress = _Progress(progress_stream)
    messages = _Messages(stream, logging.DEBUG if verbose else logging.WARNING)
    children = [logging.getLogger(name) for name in _PROGRESS_LOGGERS]
    saved_level = root.level
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.addHandler(messages)
    for child in children:
        child.addHandler(progress)

    def one_line_warning(message: Warning | str, category: type[Warning], filename: str,
                         lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
        print(f"{PROG}: warning: {message}", file=stream, flush=True)

    saved_warning = warnings.showwarning
    warnings.showwarning = one_line_warning
    try:
        yield
    finally:
        warnings.showwarning = saved_warning
        for child in children:
            child.removeHandler(progress)
        root.removeHandler(messages)
        root.setLevel(saved_level)


def _output(args: argparse.Namespace) -> TextIO:
    """Where text goes: stdout, or stderr when stdout carries the JSON result."""
    return sys.stderr if args.json else sys.stdout


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.dtype | torch.device | torch.Size):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "_asdict"):
        return value._asdict()
    return repr(value)


def _emit_json(document: dict[str, Any]) -> None:
    print(json.dumps(document, indent=2, default=_json_default))


def _search_lines(result: SearchResult, seconds: float, cached: str | None) -> list[str]:
    lines = []
    if cached is not None:
        lines.append(f"cached result from {cached} (--no-cache measures again):")
        lines += [f"  trial {i:>2}  {t}" for i, t in enumerate(result.trials, start=1)]
    lines.append(f"largest batch that fits: {result.max_batch_size}")
    measured = any(t.peak_bytes is not None for t in result.trials)
    if result.headroom and not measured:
        lines.append(
            f"recommended batch size:  {result.batch_size} ({1 - result.headroom:.0%} of the "
            "largest: this device keeps no memory statistics)"
        )
    elif result.headroom:
        lines.append(
            f"recommended batch size:  {result.batch_size} (leaves {result.headroom:.0%} of "
            f"{format_bytes(result.capacity_bytes)} free at the peak)"
        )
    else:
        lines.append(f"recommended batch size:  {result.batch_size}")
    if result.memory_model is not None:
        model = result.memory_model
        lines.append(
            f"memory model: {format_bytes(model.fixed)} + {format_bytes(model.per_sample)} "
            "per sample"
        )
    when = "measured earlier" if cached is not None else f"in {seconds:.1f} s"
    lines.append(f"{len(result.trials)} trials ({result.oom_trials} out of memory) {when}")
    lines += [
        f"note: {note}" for note in result.notes
        if not note.startswith("from the cache") and "keeps no memory statistics" not in note
    ]
    return lines


# --------------------------------------------------------------------------- commands


@dataclass
class _Setup:
    model: nn.Module
    sample: _Sample
    optimizer: Any
    loss_fn: Callable[..., torch.Tensor] | None
    train: bool


def _setup(args: argparse.Namespace) -> _Setup:
    sample = _make_sample(args)
    loss_fn = _make_loss(args.loss, sample.classes)
    model = _make_model(args.model)
    if sample.tokens:
        value, lm_loss = _language_model_sample(sample, model)
        sample = dataclasses.replace(sample, value=value)
        if args.loss == "auto":
            loss_fn = lm_loss
    return _Setup(model, sample, _OPTIMIZERS[args.optimizer], loss_fn, not args.inference)


def _search_options_of(args: argparse.Namespace) -> dict[str, Any]:
    """The search options, checked: a bad one is a usage error before anything runs (a
    ``ValueError`` raised later comes from the model or the sample, not from the command line)."""
    try:
        check_search_options(args.min_batch, args.max_batch, args.multiple_of, args.headroom, 1)
    except (TypeError, ValueError) as error:
        raise UsageError(f"--{str(error).replace('_', '-')}") from None
    return {
        "headroom": args.headroom,
        "min_batch": args.min_batch,
        "max_batch": args.max_batch,
        "multiple_of": args.multiple_of,
    }


def _cache_of(args: argparse.Namespace) -> ResultCache | None:
    if getattr(args, "no_cache", True):
        return None
    return open_cache(args.cache_dir if args.cache_dir else True)


def _search(
    setup: _Setup, target: _Target, options: dict[str, Any], store: ResultCache | None
) -> tuple[SearchResult, str | None]:
    """``search_batch_size`` through the result cache; ``(result, cache file or None)``."""
    def key() -> str:
        return search_key(
            setup.model, setup.sample.value, setup.optimizer, memory_for(target.device),
            train=setup.train, steps_per_trial=1, loss_fn=setup.loss_fn, step_fn=None,
            scaler=None, **options,
        )

    def run() -> SearchResult:
        return search_batch_size(
            setup.model, setup.sample.value, setup.optimizer,
            loss_fn=setup.loss_fn, train=setup.train, **options,
        )

    result, file = cached_search(store, key, run)
    return result, None if file is None else str(file)


def _header(setup: _Setup, target: _Target, what: str, stream: TextIO) -> None:
    params = sum(p.numel() for p in setup.model.parameters())
    optimizer = "no optimizer" if setup.optimizer is None else (
        getattr(setup.optimizer, "func", setup.optimizer).__name__
    )
    mode = "inference" if not setup.train else f"training with {optimizer}"
    print(f"{what}: {type(setup.model).__name__} ({params:,} parameters), {mode}, "
          f"sample {setup.sample.text}", file=stream)
    print(_describe_target(target), file=stream, flush=True)


def _plot(result: SearchResult | ThroughputResult, path: str | None, stream: TextIO) -> None:
    if path:
        result.plot(path)
        print(f"plot saved to {path}", file=stream)


def _find(args: argparse.Namespace) -> int:
    options = _search_options_of(args)
    setup = _setup(args)
    target = _target(args, DEFAULT_SIMULATED)
    out = _output(args)
    _header(setup, target, "find", out)
    start = time.perf_counter()
    with _running_on(target, setup.model):
        result, cached = _search(setup, target, options, _cache_of(args))
    seconds = time.perf_counter() - start
    if args.json:
        _emit_json({"command": "find", **result_to_dict(result), "cached": cached is not None,
                    "seconds": seconds})
    else:
        print("\n".join(_search_lines(result, seconds, cached)), file=out)
    _plot(result, args.plot, out)
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    try:
        check_search_options(1, None, 1, args.headroom, 1)
    except (TypeError, ValueError) as error:
        raise UsageError(f"--{error}") from None
    work = WORKLOADS[args.workload]
    torch.manual_seed(0)
    model = work.model()
    inputs, labels = work.sample(4)
    target = _target(args, DEMO_SIMULATED)
    stream = _output(args)
    params = sum(p.numel() for p in model.parameters())
    row = "x".join(map(str, inputs.shape[1:]))
    print(f"autobatch demo: the largest training batch of {_DEMO_TEXT[args.workload]}\n"
          f"  ({params:,} parameters; inputs {row} {str(inputs.dtype).removeprefix('torch.')}, "
          "10 classes; AdamW, cross-entropy)", file=stream)
    print(_describe_target(target), file=stream, flush=True)
    start = time.perf_counter()
    with _running_on(target, model):
        result = search_batch_size(
            model, (inputs, labels), torch.optim.AdamW,
            loss_fn=nn.functional.cross_entropy, headroom=args.headroom,
        )
    seconds = time.perf_counter() - start
    if args.json:
        _emit_json({"command": "demo", **result_to_dict(result), "seconds": seconds})
    else:
        print("\n".join(_search_lines(result, seconds, None)), file=stream)
    _plot(result, args.plot, stream)
    return EXIT_OK


def _best(args: argparse.Namespace) -> int:
    options = _search_options_of(args)
    try:
        _check(args.tolerance, args.repeats, args.warmup)
    except (TypeError, ValueError) as error:
        raise UsageError(f"--{error}") from None
    setup = _setup(args)
    target = _target(args, DEFAULT_SIMULATED)
    candidates = _parse_sizes(args.candidates) if args.candidates else None
    out = _output(args)
    _header(setup, target, "best", out)
    start = time.perf_counter()
    with _running_on(target, setup.model):
        max_batch: int | None = None
        search = None
        if candidates is None:
            search, cached = _search(setup, target, options, _cache_of(args))
            source = "" if cached is None else f" (cached in {cached})"
            print(f"  largest batch that fits: {search.max_batch_size}{source}; timing sizes up "
                  f"to the recommended {search.batch_size}", file=out, flush=True)
            max_batch = search.batch_size
        elif args.max_batch is not None:
            max_batch = args.max_batch
        result = find_best_batch(
            setup.model, setup.sample.value, setup.optimizer,
            max_batch=max_batch, candidates=candidates, tolerance=args.tolerance,
            repeats=args.repeats, warmup=args.warmup, loss_fn=setup.loss_fn, train=setup.train,
            min_batch=args.min_batch, multiple_of=args.multiple_of,
        )
    seconds = time.perf_counter() - start
    if args.json:
        document = _throughput_dict(result)
        document["search"] = None if search is None else result_to_dict(search)
        _emit_json({"command": "best", **document, "seconds": seconds})
    else:
        print(
            f"fastest: batch {result.fastest_batch_size} at "
            f"{result.best_samples_per_s:,.1f} samples/s\n"
            f"chosen:  batch {result.batch_size} at {result.samples_per_s:,.1f} samples/s "
            f"(the smallest within {result.tolerance:.0%} of the fastest)\n"
            f"timed {len(result.points)} sizes up to {result.max_batch_size} in {seconds:.1f} s"
        )
        for note in result.notes:
            print(f"note: {note}")
    _plot(result, args.plot, out)
    return EXIT_OK


def _throughput_dict(result: ThroughputResult) -> dict[str, Any]:
    return {
        "batch_size": result.batch_size,
        "samples_per_s": result.samples_per_s,
        "fastest_batch_size": result.fastest_batch_size,
        "best_samples_per_s": result.best_samples_per_s,
        "max_batch_size": result.max_batch_size,
        "tolerance": result.tolerance,
        "device": result.device,
        "train": result.train,
        "repeats": result.repeats,
        "warmup": result.warmup,
        "points": [
            {"size": p.size, "samples_per_s": p.samples_per_s, "seconds": p.seconds,
             "error": p.error}
            for p in result.points
        ],
        "notes": list(result.notes),
    }


def _plan(args: argparse.Namespace) -> int:
    options = _search_options_of(args)
    setup = _setup(args)
    if args.capacity is not None:
        try:
            capacity = parse_bytes(args.capacity, name="--capacity")
        except (TypeError, ValueError) as error:
            raise UsageError(str(error)) from None
        where = f"a device of {format_bytes(capacity)}"
    else:
        try:
            device = resolve_device(args.device)
            memory = memory_for(device)
        except (RuntimeError, ValueError) as error:
            raise UsageError(f"--device {args.device}: {error}") from None
        if device.type == "cpu":
            raise UsageError("no GPU here to read the capacity of; give --capacity, e.g. 80GiB")
        capacity = memory.capacity_bytes()
        where = memory.name
    try:
        overhead = 0 if args.overhead is None else parse_bytes(args.overhead, name="--overhead")
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    if overhead >= capacity:
        raise UsageError(
            f"--overhead {args.overhead} ({format_bytes(overhead)}) leaves nothing of the "
            f"{format_bytes(capacity)} device; lower it"
        )
    try:
        from autobatch._planner import plan_max_batch  # type: ignore[import-not-found,unused-ignore]
    except ImportError as error:
        raise RuntimeError(f"the planner is not available in this installation ({error})") from None
    print(f"plan: {type(setup.model).__name__} for {where}, sample {setup.sample.text}",
          file=_output(args), flush=True)
    start = time.perf_counter()
    plan = plan_max_batch(
        setup.model, setup.sample.value, setup.optimizer, capacity,
        loss_fn=setup.loss_fn, train=setup.train, overhead=overhead, **options,
    )
    seconds = time.perf_counter() - start
    if args.json:
        _emit_json({"command": "plan", **_plan_dict(plan), "seconds": seconds})
        return EXIT_OK
    print(f"predicted largest batch: {plan.max_batch_size}")
    print(f"recommended batch size:  {plan.batch_size} (leaves {plan.headroom:.0%} of "
          f"{format_bytes(plan.capacity_bytes)} free)")
    if plan.memory_model is not None:
        model = plan.memory_model
        print(f"memory model: {format_bytes(model.fixed)} + {format_bytes(model.per_sample)} "
              "per sample")
    print(f"at batch {plan.max_batch_size}: {plan.breakdown}")
    for note in plan.notes:
        print(f"note: {note}")
    print(f"planned in {seconds:.1f} s, without running a step on a device")
    return EXIT_OK


def _plan_dict(plan: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dataclasses.asdict(plan)
    fields["breakdown"]["peak"] = plan.breakdown.peak
    return fields


# --------------------------------------------------------------------------- entry point


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether the command line asks for JSON output (read before, or without, argparse)."""
    return "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv


def _failed(
    command: str, code: int, kind: str, error: BaseException, *, json_out: bool, hint: str = ""
) -> int:
    """Report a failure: one line on stderr and, with ``--json``, one JSON object on stdout."""
    message = _one_line(error)
    print(f"{command}: {kind}: {message}{hint}", file=sys.stderr, flush=True)
    if json_out:
        _emit_json({
            "command": command.removeprefix(f"{PROG} ") if command != PROG else None,
            "error": message,
            "kind": kind,
            "exit_code": code,
        })
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autobatch`` command; returns the exit code.

    >>> main(["--version"])  # doctest: +SKIP
    autobatch 0.1.0

    Exit codes: 0 success; 2 a usage error (a bad option, or a model, sample or loss that
    cannot be loaded), found before anything runs; 3 nothing fits; 1 any other error,
    including every error raised while the model runs (a ``ValueError`` in ``forward`` too);
    130 interrupted. With ``--json`` a failure also prints one JSON object on stdout, with an
    ``"error"`` field.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(words)
    except SystemExit as done:  # --help or --version
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    except _ArgumentError as error:
        hint = f" (see {error.prog} --help)"
        return _failed(error.prog, EXIT_USAGE, "error", error, json_out=_wants_json(words),
                       hint=hint)
    handler: Callable[[argparse.Namespace], int] = args.handler
    command = f"{PROG} {args.command}"
    json_out = bool(getattr(args, "json", False))
    try:
        with _reporting(args.verbose, _output(args), sys.stderr):
            return handler(args)
    except BrokenPipeError:  # the reader went away (``autobatch ... | head``): stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt):
            code, kind = EXIT_INTERRUPTED, "interrupted"
        elif isinstance(error, BatchSizeError):
            code, kind = EXIT_NOTHING_FITS, "nothing fits"
        elif isinstance(error, UsageError):
            code, kind = EXIT_USAGE, "error"
        elif isinstance(error, Exception):  # the model, the sample, the loss or autobatch
            code, kind = EXIT_ERROR, "error"
        else:
            raise
        if args.verbose:
            traceback.print_exc(file=sys.stderr)
        hint = "" if args.verbose or code == EXIT_INTERRUPTED else " (--verbose for details)"
        if isinstance(error, (UsageError, BatchSizeError)):
            hint = ""
        return _failed(command, code, kind, error, json_out=json_out, hint=hint)
