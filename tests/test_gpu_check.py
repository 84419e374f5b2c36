"""The GPU check script stays runnable: its dry run (a SimulatedGPU on the CPU) passes every check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _table(text: str, heading: str) -> list[dict[str, str]]:
    """The rows of the first markdown table under ``heading``, keyed by column."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows: list[list[str]] = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return [dict(zip(header, row, strict=True)) for row in body]


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_check() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    finder = _table(out, "## 1.")
    assert finder
    assert {(r["n fits"], r["n+1 fails"], r["memory after == before"]) for r in finder} == {
        ("True", "True", "True")
    }
    guard = _table(out, "## 4.")
    assert guard
    for row in guard:
        assert row["OOMs"] != "0", row
        assert row["memory after == before"] == "True", row
        assert row["is_oom_error"] == "True", row
        assert next(v for k, v in row.items() if k.startswith("params allclose")).startswith("True")
    for heading in ("## 2.", "## 3.", "## 5."):
        assert _table(out, heading), heading
    for row in _table(out, "## 2."):  # the plans and the simulator that measures them agree
        assert row["error"] == "+0.0%", row
        assert row["reserved beyond the plan"] == "+0.0 MiB", row
    reserved = _table(out, "## 6.")
    assert {row["expandable"] for row in reserved} == {"True", "False"}
    for row in reserved:  # both sides are the same simulator: no difference at all
        assert row["difference"] == "+0.0%", row
        for measure in ("reserved peak", "allocated peak", "segments", "retries"):
            assert row[f"{measure}: GPU"] == row[f"{measure}: simulator"], row
        assert row["reserved peak: GPU"] != "0.0 MiB", row
    (failed,) = _table(out, "## 7.")
    assert failed["in"] == "backward", failed
    assert failed["left allocated after the except block"] == "0 bytes", failed
    assert failed["the batch before runs again"] == "True", failed
    replay = {row["measure"].split(" (")[0]: row for row in _table(out, "## 9.")}
    assert replay["a copy of the allocator"]["replay"].endswith(" blocks")
    for measure in ("allocated", "reserved"):  # the same simulator on both sides
        assert replay[f"fixed requests: {measure} peak"]["difference"] == "+0 bytes"
    assert "(replay)" in replay["trials"]["device"]  # the search's replay took
