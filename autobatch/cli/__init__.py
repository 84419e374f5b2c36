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

from autobatch.cli._commands import main
from autobatch.cli._parser import UsageError, build_parser

__all__ = ["UsageError", "build_parser", "main"]
