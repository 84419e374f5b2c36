"""Every Python example in the README runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.+?)```", README, flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(EXAMPLES[index], f"README.md example {index}", "exec"), {"__name__": "readme"})
    assert "False" not in capsys.readouterr().out
