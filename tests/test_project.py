"""The project's own checks: lint, types, and the README's promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands() -> None:
    commands = re.findall(r"```(?:bash|sh)\n(.+?)\n```", README)
    assert commands[0] == 'python -m pip install "torch==2.13.0" -e . && python -m autobatch demo'
    assert commands[1] == (
        'python -m pip install "torch==2.13.0" -e ".[test]" && python -m pytest -q -n 2'
    )
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci
    assert "README.md" in ci


def test_ruff_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow  # from a fresh checkout mypy reads torch's stubs: 25 s of CPU
def test_mypy_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
