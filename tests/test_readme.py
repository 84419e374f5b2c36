"""Every Python example in the README and in docs/ runs, and every relative link resolves.

A ```python block runs; a block that needs a GPU or torchrun is fenced ```py (or ```text) and is
shown, not run. Where the text after a block says "It prints `...`", that is checked. A block preceded by the line ``<!-- slow -->`` runs in the slow tier only.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = re.compile(
    r"^(<!-- slow -->\n)?```python\n(.+?)^```\n(?:\nIt prints `([^`]+)`)?",
    flags=re.DOTALL | re.MULTILINE,
)
FENCED = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Pages of tables and design notes, with no example to run.
NO_EXAMPLES = {"docs/architecture.md", "docs/exactness_matrix.md"}


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _examples() -> Iterator[Any]:
    for page in PAGES:
        for index, match in enumerate(EXAMPLE.finditer(page.read_text())):
            marks = [pytest.mark.slow] if match.group(1) else []
            name = f"{_name(page)} example {index}"
            yield pytest.param(name, match.group(2), match.group(3), marks=marks,
                               id=f"{_name(page)}-{index}")


@pytest.fixture
def restored() -> Iterator[None]:
    """What an example may change for the rest of the process: logger levels and handlers, and
    a process group it started."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    ours = {name: logging.getLogger(name).level for name in logging.root.manager.loggerDict
            if name == "autobatch" or name.startswith("autobatch.")}
    yield
    root.handlers[:], root.level = handlers, level
    logging.getLogger("autobatch").setLevel(logging.NOTSET)
    for name, old in ours.items():
        logging.getLogger(name).setLevel(old)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def test_the_readme_and_every_docs_page_have_examples() -> None:
    names = {param.values[0].split(" example ")[0] for param in _examples()}
    assert names == {_name(page) for page in PAGES} - NO_EXAMPLES


@pytest.mark.parametrize(("name", "code", "prints"), list(_examples()))
@pytest.mark.usefixtures("restored")
def test_example_runs(
    name: str, code: str, prints: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each example runs, prints no ``False`` and sets off no warning pointing at its own lines
    (autobatch's warnings name the user's line); where the page says what it prints ("It
    prints `...`" after the block), that is its last line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, name, "exec"), {"__name__": "docs"})
    assert [str(w.message) for w in caught if w.filename == name] == []
    out = capsys.readouterr().out
    assert "False" not in out
    if prints is not None:
        assert out.strip().splitlines()[-1] == prints


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings."""
    text = FENCED.sub("", page.read_text())
    headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_point_to_files_and_headings(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCED.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{_name(page)}: {broken}"


def test_every_docstring_example_runs_and_sets_off_no_warning() -> None:
    """The examples in the package's docstrings pass, and none sets off a warning pointing at
    its own lines (a model the simulator does not count, a size too large, ...)."""
    import doctest
    import importlib
    import pkgutil

    import autobatch

    attempted, failed, warned = 0, [], []
    for info in pkgutil.walk_packages(autobatch.__path__, "autobatch."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        attempted += result.attempted
        if result.failed:
            failed.append(info.name)
        warned += [  # (pointing at an example's line, or at doctest's, which runs it)
            f"{info.name}: {w.message}" for w in caught
            if w.filename.startswith("<doctest") or w.filename.endswith("doctest.py")
        ]
    assert attempted > 100
    assert failed == []
    assert warned == []
