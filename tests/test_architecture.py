"""The package's shape: its layers (docs/architecture.md), no import loop, no import upwards,
no file over 700 lines, and a recovery engine that knows none of its front-ends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "autobatch"

#: Bottom to top; a module may import from its own layer and the ones below, never above. A
#: name is a top-level module or a whole package (its modules ordered by SUBLAYERS).
LAYERS: list[tuple[str, ...]] = [
    ("_errors", "_units", "_validate", "_oom", "_version"),
    ("_search",),
    ("_distributed", "_log", "_memory", "_batch"),
    ("testing",),
    ("_records",),
    ("_sizing", "_recovery", "data"),
    ("search", "integrations", "cli", "__main__", "__init__"),
]
#: Inside a package, bottom to top, as LAYERS (a module not named here is at the top).
SUBLAYERS: dict[str, list[tuple[str, ...]]] = {
    "_memory": [("_blocks", "_accounting"), ("_snapshot",), ("_allocator",), ("_backends",),
                ("_measure",)],
    "_records": [("_result", "_progress"), ("_plot", "_cache")],
    "_sizing": [("_workload", "_state"), ("_trial", "_planner"), ("_finder",),
                ("_per_length", "_throughput")],
}
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
    """The ``autobatch`` modules a file imports: at the top, inside functions (lazily) and
    under ``if TYPE_CHECKING:`` alike, since a reader sees each as a dependency."""
    tree = ast.parse(path.read_text())
    package = _module(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
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


def _private_names(path: Path) -> list[str]:
    """The private names (``_x``, not modules) a file imports from ``autobatch``, in full."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (
            (node.module or "").startswith("autobatch")
        ):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                where = ROOT.parent / Path(*full.split("."))
                if alias.name.startswith("_") and not (
                    where.with_suffix(".py").exists() or where.is_dir()
                ):
                    found.append(full)
    return found


PRIVATE_NAMES = {_module(f): _private_names(f) for f in FILES}


def _package(name: str) -> str:
    """``autobatch.x`` of ``autobatch.x.y...``: a folder, or a top-level module on its own."""
    return ".".join(name.split(".")[:2])


def test_every_module_has_a_layer() -> None:
    assert {_top(m) for m in GRAPH} <= set(LAYER)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_from_a_higher_layer(module: str) -> None:
    mine = LAYER[_top(module)]
    upward = sorted(m for m in GRAPH[module] if m != "autobatch" and LAYER[_top(m)] > mine)
    assert not upward, f"{module} (layer {mine}) imports {upward} from above"


def _sublayer(name: str) -> tuple[str, int] | None:
    """The package of ``autobatch.package.module...`` and the module's layer inside it
    (``None`` outside the packages SUBLAYERS orders, and for the package itself)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[1] not in SUBLAYERS:
        return None
    levels = SUBLAYERS[parts[1]]
    return parts[1], next((i for i, names in enumerate(levels) if parts[2] in names), len(levels))


def test_every_sublayer_names_a_module() -> None:
    for package, levels in SUBLAYERS.items():
        for name in (n for names in levels for n in names):
            assert (ROOT / package / f"{name}.py").exists() or (ROOT / package / name).is_dir()


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _sublayer(m) is not None))
def test_no_import_from_a_higher_layer_of_its_package(module: str) -> None:
    package, mine = _sublayer(module) or ("", 0)
    upward = sorted(
        m for m in GRAPH[module]
        if (found := _sublayer(m)) is not None and found[0] == package and found[1] > mine
    )
    assert not upward, f"{module} (layer {mine} of {package}) imports {upward} from above"


def test_no_two_modules_share_a_basename() -> None:
    names = [f.name for f in FILES if f.name != "__init__.py"]
    assert sorted(names) == sorted(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_underscore_names_cross_packages_at_most_52_times() -> None:
    """A private name (``_x``) imported from another package (a top-level module is its own) is
    a seam the packages' layout has not hidden; there were 104 across files before the move."""
    crossing = [
        (module, name) for module, names in PRIVATE_NAMES.items() for name in names
        if _package(name) != _package(module)
    ]
    assert len(crossing) <= 52, crossing


def _loops(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import loops of ``graph``: its strongly connected components of more than one
    module (Tarjan's algorithm), each a set of modules that import each other in a circle."""
    modules = {m: sorted(d for d in deps if d in graph) for m, deps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in modules[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(component)

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return loops


def test_loops_are_found_through_lazy_and_type_only_imports() -> None:
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _loops({"a": {"b"}, "b": set()}) == []
    lazy = ROOT / "_sizing" / "_finder.py"  # imports the planner inside a function
    assert "autobatch._sizing._planner" in _imports(lazy)
    typed = ROOT / "_records" / "_cache.py"  # names SearchResult under if TYPE_CHECKING:
    assert "autobatch._records._result" in _imports(typed)


def test_no_import_loop() -> None:
    loops = _loops(GRAPH)
    assert not loops, "import loops: " + "; ".join(" <-> ".join(sorted(m)) for m in loops)


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
