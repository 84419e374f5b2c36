"""The records of what recovery did: size changes and the statistics users read."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SizeChange:
    """One change of a step's micro-batch size.

    >>> SizeChange(step=3, function="train_step", old=None, new=8, reason="oom")
    SizeChange(step=3, function='train_step', old=None, new=8, reason='oom')

    Args:
        step: the index (from 0) of the call, or of the guard's batch, when it happened.
        function: the decorated step's qualified name.
        old: the size before; ``None`` when whole batches ran.
        new: the size after.
        reason: ``"oom"`` (shrunk after an OOM), ``"thrashing"`` (shrunk before one: the caching
            allocator released its cache and retried in several steps in a row), ``"refine"``
            (raised to what the memory model allows after a measuring piece), ``"grow"`` (a larger
            size tried after clean steps) or ``"grow failed"`` (back to the last good size).
    """

    step: int
    function: str
    old: int | None
    new: int
    reason: str


#: How many of the latest size changes the statistics keep (the counters count all of them).
HISTORY = 64


@dataclass(frozen=True)
class RecoveryStats:
    """What happened so far: OOMs, size changes, the current micro-batch size.

    >>> RecoveryStats().ooms
    0

    Args:
        ooms: out-of-memory errors caught (each one retried at a smaller size, or reported);
            under a process group, also attempts stopped because another rank ran out.
        shrinks: size decreases (after an OOM, a failed grow, or thrashing).
        grows: attempts to use a larger size (``grow_after``).
        failed_grows: grow attempts that ran out of memory and went back.
        batches: batches completed (calls of the step, or batches the guard handed out).
        samples: samples in those batches (the rows of every call of a step).
        samples_recomputed: samples whose work was lost and redone (failed attempts, discarded
            pieces).
        micro_batch_size: the largest piece of the latest batch; ``None`` when it ran whole.
        changes: size changes of every reason, all of them counted.
        history: the latest size changes (at most :data:`HISTORY`), oldest first.
    """

    ooms: int = 0
    shrinks: int = 0
    grows: int = 0
    failed_grows: int = 0
    batches: int = 0
    samples: int = 0
    samples_recomputed: int = 0
    micro_batch_size: int | None = None
    changes: int = 0
    history: tuple[SizeChange, ...] = ()


class _Tally:
    """The mutable counters behind :class:`RecoveryStats` (a snapshot is made when read):
    ``counts`` holds its integer fields by name."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.rows = 0  # the rows of the calls on the fast path (a plain int: every step adds)
        self.micro_batch_size: int | None = None
        self.history: collections.deque[SizeChange] = collections.deque(maxlen=HISTORY)

    def change(self, change: SizeChange) -> None:
        self.history.append(change)
        self.counts.update(
            changes=1,
            shrinks=change.reason in ("oom", "grow failed", "thrashing"),
            grows=change.reason == "grow",
            failed_grows=change.reason == "grow failed",
        )

    def snapshot(self, **override: Any) -> RecoveryStats:
        fields = {"micro_batch_size": self.micro_batch_size, "history": tuple(self.history)}
        counts = {**self.counts, "samples": self.counts["samples"] + self.rows}
        return RecoveryStats(**{**counts, **fields, **override})
