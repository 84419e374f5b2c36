"""The command line: its subcommands, options, and usage errors."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import NoReturn

import torch
from torch import nn

from autobatch._sizing._workload import DEFAULT_HEADROOM

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
                            "else a scalar output, output.loss, or a stand-in that keeps what "
                            "the usual training losses keep (cross-entropy over each output's "
                            "last dimension plus a squared error)")
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


def _search_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The search's options; returns their group, for options only one subcommand has."""
    group = parser.add_argument_group("search")
    group.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, metavar="FRACTION",
                       help="share of the largest batch the recommended one leaves unused "
                            f"(default {DEFAULT_HEADROOM:g})")
    group.add_argument("--min-batch", type=int, default=1, metavar="N",
                       help="never try less than N (default 1)")
    group.add_argument("--max-batch", type=int, metavar="N", help="never try more than N")
    group.add_argument("--multiple-of", type=int, default=1, metavar="N",
                       help="only sizes that are multiples of N (e.g. 8 for tensor cores)")
    return group


def _find(parser: argparse.ArgumentParser) -> None:
    _workload(parser)
    _device(parser, DEFAULT_SIMULATED)
    _search_options(parser).add_argument(
        "--lengths", metavar="L1,L2,...",
        help="sequence lengths: print a table of batch sizes, one per length (the first "
             "dimension of --sample-shape takes each length; a --sample factory is called "
             "with length=L)")
    _common(parser, cache=True, plot=True)


def _plan(parser: argparse.ArgumentParser) -> None:
    _workload(parser)
    target = parser.add_argument_group("target")
    target.add_argument("--capacity", metavar="SIZE",
                        help="the target device's memory, e.g. 80GiB (default: the GPU's here)")
    target.add_argument("--device", metavar="DEV", help="read the capacity of this device")
    target.add_argument("--overhead", metavar="SIZE",
                        help="memory the plan cannot see (CUDA context, library workspaces; "
                             "default 0)")
    _search_options(parser)
    _common(parser, cache=False, plot=False)


def _best(parser: argparse.ArgumentParser) -> None:
    _workload(parser)
    _device(parser, DEFAULT_SIMULATED)
    _search_options(parser)
    timing = parser.add_argument_group("timing")
    timing.add_argument("--tolerance", type=float, default=0.02, metavar="FRACTION",
                        help="pick the smallest size within this fraction of the best "
                             "throughput (default 0.02)")
    timing.add_argument("--repeats", type=int, default=5, metavar="N",
                        help="timed steps per size; their median counts (default 5)")
    timing.add_argument("--warmup", type=int, default=2, metavar="N",
                        help="untimed steps per size before the timed ones (default 2)")
    timing.add_argument("--candidates", metavar="N1,N2,...",
                        help="sizes to time (default: powers of two up to the largest that "
                             "fits, and that size); skips the search")
    _common(parser, cache=True, plot=True)


def _demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="conv", choices=DEMO_WORKLOADS,
                        help="the built-in model (default conv: a conv net on 3x32x32 images)")
    _device(parser, DEMO_SIMULATED)
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, metavar="FRACTION",
                        help="share of the largest batch the recommended one leaves unused "
                             f"(default {DEFAULT_HEADROOM:g})")
    _common(parser, cache=False, plot=True)


#: Each subcommand: its one-line help, its description, and what adds its options.
_SUBCOMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "find": (
        "search for the largest batch with real training steps",
        "Search for the largest batch that fits, with real forward, backward and optimizer "
        "steps. Results are cached per model, sample, device and options.",
        _find,
    ),
    "plan": (
        "predict the largest batch without running a training step",
        "Predict the largest batch from the model and sample alone, for a device of a given "
        "size (no GPU needed).",
        _plan,
    ),
    "best": (
        "time real steps and pick the fastest batch size",
        "Time real steps at sizes up to the largest that fits and pick the smallest size "
        "within a tolerance of the best samples/second.",
        _best,
    ),
    "demo": (
        "find the largest batch of a built-in model (simulated GPU if none)",
        "Run find on a built-in model: on the GPU when there is one, otherwise on a simulated "
        f"{DEMO_SIMULATED} GPU, printing each trial and the result.",
        _demo,
    ),
}


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
    for name, (summary, description, add_options) in _SUBCOMMANDS.items():
        add_options(commands.add_parser(name, help=summary, description=description))
    return parser
