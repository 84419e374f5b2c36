from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import autobatch._records._plot
from autobatch import SearchResult, plot, search_batch_size
from autobatch._records._plot import DPI, FIGSIZE, plot_search, plot_throughput
from autobatch._records._result import ThroughputPoint, ThroughputResult
from autobatch._search import Trial
from autobatch.testing import SimulatedGPU

pytest.importorskip("matplotlib", reason="plots need the [plot] extra (matplotlib)")

WIDTH, HEIGHT = round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, checking the signature and the chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR"
    assert length == 13
    body = data[16 : 16 + length]
    (crc,) = struct.unpack(">I", data[16 + length : 20 + length])
    assert crc == zlib.crc32(kind + body), "IHDR checksum mismatch"
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82", "the PNG does not end with IEND"
    width, height = struct.unpack(">II", body[:8])
    return width, height


@pytest.fixture(scope="module")
def search() -> SearchResult:
    model = nn.Sequential(nn.Linear(512, 32), nn.ReLU(), nn.Linear(32, 10))
    with SimulatedGPU("2MiB", allocator="exact") as gpu:  # (no replay: the failing size runs)
        gpu.adopt(model)
        return search_batch_size(model, torch.randn(2, 512), torch.optim.SGD)


def test_search_plot_is_a_png_of_the_stated_size(search: SearchResult, tmp_path: Path) -> None:
    path = tmp_path / "search.png"
    figure = plot(search, str(path))
    assert png_size(path) == (WIDTH, HEIGHT) == (800, 500)
    axes = figure.axes[0]
    assert axes.get_xlabel() == "batch size"
    assert "peak memory" in axes.get_ylabel()
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert any(label.startswith("capacity") for label in labels)
    assert any(label.startswith("recommended batch") for label in labels)
    assert any(label.startswith("fit:") for label in labels)
    assert f"recommended batch {search.batch_size}" in labels
    assert "trial out of memory" in labels


def test_plot_function_accepts_paths_and_other_formats(search: SearchResult, tmp_path: Path) -> None:
    plot_search(search, tmp_path / "search.svg")
    assert (tmp_path / "search.svg").read_text().lstrip().startswith("<?xml")
    assert plot_search(search) is not None  # no path: only the figure


def test_search_without_memory_statistics_plots_trials_by_order(tmp_path: Path) -> None:
    result = SearchResult(
        batch_size=60, max_batch_size=64, capacity_bytes=2**34, device="mps", headroom=0.05,
        train=True, optimizer_counted=True, memory_model=None, smallest_failing=128,
        trials=(Trial(1, True, None, 0.1), Trial(128, False, None, 0.2, "mps"),
                Trial(64, True, None, 0.2)),
    )
    figure = plot_search(result, tmp_path / "blind.png")
    assert png_size(tmp_path / "blind.png") == (WIDTH, HEIGHT)
    assert figure.axes[0].get_ylabel() == "trial"


def test_throughput_plot(tmp_path: Path) -> None:
    points = (
        ThroughputPoint(8, 800.0, 0.01), ThroughputPoint(16, 1580.0, 0.0101),
        ThroughputPoint(32, 1600.0, 0.02), ThroughputPoint(64, None, None, "cuda_allocator"),
    )
    result = ThroughputResult(
        batch_size=16, samples_per_s=1580.0, fastest_batch_size=32, best_samples_per_s=1600.0,
        max_batch_size=64, tolerance=0.02, points=points, device="cuda:0", train=True,
        repeats=5, warmup=2,
    )
    figure = plot(result, str(tmp_path / "best.png"))
    assert png_size(tmp_path / "best.png") == (WIDTH, HEIGHT)
    axes = figure.axes[0]
    assert axes.get_xscale() == "log"
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert "chosen batch 16" in labels
    assert "fastest batch 32" in labels
    assert "out of memory" in labels
    plot_throughput(result, tmp_path / "again.png")


def test_plotting_leaves_the_matplotlib_backend_alone(search: SearchResult, tmp_path: Path) -> None:
    import matplotlib

    before = matplotlib.rcParams["backend"]
    plot(search, tmp_path / "x.png")
    assert matplotlib.rcParams["backend"] == before


def test_missing_matplotlib_is_a_clear_error(
    search: SearchResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'torch-autobatch\[plot\]'"):
        plot(search)


def test_plot_refuses_what_it_cannot_draw() -> None:
    with pytest.raises(TypeError, match=r"a SearchResult or a ThroughputResult\), got dict"):
        plot({"batch_size": 8})  # type: ignore[arg-type]


def test_docstring_examples_run() -> None:
    import doctest

    result = doctest.testmod(autobatch._records._plot)
    assert result.attempted > 0
    assert result.failed == 0


def test_a_records_own_plot_method_draws_through_the_plotter(tmp_path: Path) -> None:
    """``result.plot(path)``, as before ``autobatch.plot`` existed, gives the same figure."""
    pytest.importorskip("matplotlib")
    model = torch.nn.Linear(64, 64)
    with SimulatedGPU("4MiB", allocator="exact"):
        result = autobatch.search_batch_size(model, torch.randn(2, 64), max_batch=512)
    figure = result.plot(str(tmp_path / "search.png"))
    assert (tmp_path / "search.png").read_bytes()[:4] == b"\x89PNG"
    assert figure is not None
