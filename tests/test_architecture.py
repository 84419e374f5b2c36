"""The package's shape: its layers (docs/architecture.md), no import loop, no import upwards,
no file over 700 lines, and a recovery engine that knows none of its front-ends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "autobatch"

#: Bottom to top; a module may import from its own layer and the ones below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("_errors", "_units", "_validate", "_oom", "_version"),
    ("_distributed", "_fsdp", "_log", "_backends", "_batch", "_accounting", "_state"),
    ("_search",),
    ("testing",),
    ("_workload", "_measure"),
    ("_trial",),
    ("_result", "_plot", "_progress"),
    ("_cache",),
    ("_finder", "_lengths", "_planner", "_throughput", "_recovery", "data"),
    ("search", "integrations", "cli", "__main__", "__init__"),
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: The public face of the testing package (its ``__init__``, which also offers the step
#: checker of the recovery side) sits with the surface; the simulator and fault injection sit
#: low.
PLACED = {"autobatch.testing": "__init__"}


def _top(name: str) -> str:
    """The layer name of ``autobatch.x.y``: ``x`` (the package itself is ``__init__``)."""
    if name in PLACED:
        return PLACED[name]
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """The ``autobatch`` modules a file imports, lazily too, outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for child in block.body
        for node in ast.walk(child)
    }
    package = _module(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("autobatch")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.startswith("autobatch"):
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    where = ROOT.parent / Path(*full.split("."))
                    is_module = where.with_suffix(".py").exists() or where.is_dir()
                    found.add(full if is_module else base)
    return found


FILES = sorted(ROOT.rglob("*.py"))
GRAPH = {_module(f): {m for m in _imports(f) if m != _module(f)} for f in FILES}


def test_every_module_has_a_layer() -> None:
    assert {_top(m) for m in GRAPH} <= set(LAYER)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_from_a_higher_layer(module: str) -> None:
    mine = LAYER[_top(module)]
    upward = sorted(m for m in GRAPH[module] if m != "autobatch" and LAYER[_top(m)] > mine)
    assert not upward, f"{module} (layer {mine}) imports {upward} from above"


def test_no_import_loop() -> None:
    modules = {m: {d for d in deps if d in GRAPH} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in modules[node]:
            if state.get(dep) == 1:
                raise AssertionError(f"import loop: {' -> '.join([*path, node, dep])}")
            if dep not in state:
                visit(dep, [*path, node])
        state[node] = 2

    for module in modules:
        if module not in state:
            visit(module, [])


def test_recovery_engine_imports_none_of_its_front_ends() -> None:
    engine = {m for m in GRAPH if m.startswith("autobatch._recovery.") and m.rsplit(".", 1)[1]
              not in ("_decorator", "_guard", "_check")}  # (check_split drives the decorator)
    for module in engine:
        front = {d for d in GRAPH[module] if d.endswith(("._decorator", "._guard"))}
        assert not front, f"{module} imports the front-ends {front}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_over_700_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= 700, f"{path.name} has {lines} lines"
