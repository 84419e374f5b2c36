from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from autobatch import search_batch_size
from autobatch._memory._backends import memory_for
from autobatch._records._cache import (
    CACHE_ENV,
    ResultCache,
    autocast_dtype,
    cached_search,
    default_cache_dir,
    fingerprint,
    open_cache,
    result_from_dict,
    result_to_dict,
    search_key,
)
from autobatch.testing import SimulatedGPU

ROOT = Path(__file__).resolve().parent.parent
KEY = "ab" * 32


def _model(width: int = 16, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), act(), nn.Linear(width, 3))


def _key(**changes: Any) -> str:
    arguments: dict[str, Any] = {
        "model": _model(),
        "sample": torch.zeros(2, 8),
        "device_name": "NVIDIA H100 80GB HBM3 (CUDA, cuda:0)",
        "capacity_bytes": 80 * 2**30,
        "optimizer": torch.optim.AdamW,
        "autocast_dtype": None,
        "train": True,
        "extra": {"headroom": 0.05, "multiple_of": 1},
    }
    arguments.update(changes)
    model, sample = arguments.pop("model"), arguments.pop("sample")
    return fingerprint(model, sample, **arguments)


# --------------------------------------------------------------------------- the key


def test_same_setup_same_key_and_weights_or_rows_do_not_matter() -> None:
    trained = _model()
    with torch.no_grad():
        next(trained.parameters()).add_(1.0)
    assert _key() == _key()
    assert _key(model=trained) == _key()
    assert _key(sample=torch.ones(7, 8)) == _key()  # rows are cycled: their number is no key
    assert len(_key()) == 64


def _frozen() -> nn.Sequential:
    model = _model()
    next(model.parameters()).requires_grad_(False)
    return model


def _sgd(momentum: float, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(_model().parameters(), lr=lr, momentum=momentum)


@pytest.mark.parametrize(
    ("component", "changes"),
    [
        ("parameter shapes", {"model": _model(width=32)}),
        ("module types", {"model": _model(act=nn.GELU)}),
        ("parameter dtypes", {"model": _model().half()}),
        ("trainable parameters", {"model": _frozen()}),
        ("sample shape", {"sample": torch.zeros(2, 9)}),
        ("sample dtype", {"sample": torch.zeros(2, 8, dtype=torch.float16)}),
        ("sample structure", {"sample": (torch.zeros(2, 8), torch.zeros(2, dtype=torch.long))}),
        ("device name", {"device_name": "NVIDIA A100-SXM4-80GB (CUDA, cuda:0)"}),
        ("total memory", {"capacity_bytes": 40 * 2**30}),
        ("optimizer class", {"optimizer": torch.optim.Adam}),
        ("no optimizer", {"optimizer": None}),
        ("optimizer options", {"optimizer": functools.partial(torch.optim.AdamW, amsgrad=True)}),
        ("autocast dtype", {"autocast_dtype": torch.bfloat16}),
        ("inference", {"train": False}),
        ("search options", {"extra": {"headroom": 0.1, "multiple_of": 1}}),
    ],
)
def test_every_component_invalidates(component: str, changes: dict[str, Any]) -> None:
    assert _key(**changes) != _key(), component


def test_torch_version_invalidates(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _key()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert _key() != before


def test_optimizer_instances_count_memory_options_not_learning_rates() -> None:
    assert _key(optimizer=_sgd(0.9)) == _key(optimizer=_sgd(0.9, lr=0.5))  # lr: same memory
    assert _key(optimizer=_sgd(0.9)) != _key(optimizer=_sgd(0.0))  # momentum buffer or none
    assert _key(optimizer=_sgd(0.9)) != _key(optimizer=torch.optim.SGD)


def test_callable_sample_keys_by_its_batches_and_leaves_the_rng_alone() -> None:
    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, 100, (n, 64))

    def longer(n: int) -> torch.Tensor:
        return torch.randint(0, 100, (n, 128))

    model = _model()
    state = torch.get_rng_state()
    key = _key(model=model, sample=tokens)
    assert torch.equal(torch.get_rng_state(), state)
    assert key == _key(sample=tokens)
    assert key != _key(sample=longer)


def test_autocast_dtype_is_read_from_the_context() -> None:
    assert autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype("cpu") == torch.bfloat16
    assert autocast_dtype("no-such-device") is None


# --------------------------------------------------------------------------- the store


def test_default_directory_honours_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "autobatch"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    cache = open_cache(True)
    assert cache is not None
    assert cache.path == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "autobatch"


def test_open_cache_options(tmp_path: Path) -> None:
    assert open_cache(False) is None
    cache = open_cache(tmp_path / "here")
    assert cache is not None
    assert cache.path == tmp_path / "here"
    with pytest.raises(TypeError, match="cache must be"):
        open_cache(3)  # type: ignore[arg-type]


def test_miss_then_hit(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path / "new")  # created on the first write
    assert cache.get(KEY) is None
    cache.put(KEY, {"batch_size": 96, "nested": [1, None, "x"]})
    assert cache.get(KEY) == {"batch_size": 96, "nested": [1, None, "x"]}
    cache.put(KEY, {"batch_size": 97})
    assert cache.get(KEY) == {"batch_size": 97}
    assert [p.name for p in (tmp_path / "new").iterdir()] == [f"{KEY}.json"]  # no temp files


def test_keys_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hex digest"):
        ResultCache(tmp_path).get("../escape")


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"format": 1, "key": "',  # a torn write
        "[]",
        json.dumps({"format": 1, "key": "cd" * 32, "value": {}}),  # another key's entry
        json.dumps({"format": 1, "key": KEY, "value": [1, 2]}),
        json.dumps({"format": 1, "key": KEY}),
        "",
    ],
)
def test_corrupt_file_is_a_miss_with_a_warning(tmp_path: Path, content: str) -> None:
    (tmp_path / f"{KEY}.json").write_text(content)
    with pytest.warns(UserWarning, match="corrupt"):
        assert ResultCache(tmp_path).get(KEY) is None
    ResultCache(tmp_path).put(KEY, {"ok": True})  # and it is repaired by the next write
    assert ResultCache(tmp_path).get(KEY) == {"ok": True}


def test_undecodable_and_unreadable_files_are_misses(tmp_path: Path) -> None:
    (tmp_path / f"{KEY}.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.warns(UserWarning, match="corrupt"):
        assert ResultCache(tmp_path).get(KEY) is None
    (tmp_path / f"{KEY}.json").unlink()
    (tmp_path / f"{KEY}.json").mkdir()  # reading a directory fails with an OSError
    with pytest.warns(UserWarning, match="cannot read"):
        assert ResultCache(tmp_path).get(KEY) is None


def test_entry_of_another_format_is_a_silent_miss(tmp_path: Path) -> None:
    (tmp_path / f"{KEY}.json").write_text(json.dumps({"format": 0, "key": KEY, "value": {}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ResultCache(tmp_path).get(KEY) is None


def test_unwritable_cache_warns_and_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="cannot write"):
        ResultCache(blocker).put(KEY, {"batch_size": 1})
    with pytest.warns(UserWarning, match="cannot read"):
        assert ResultCache(blocker).get(KEY) is None


@settings(max_examples=30, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=10)
            | st.floats(allow_nan=False, allow_infinity=False),
            lambda children: st.lists(children, max_size=3)
            | st.dictionaries(st.text(max_size=5), children, max_size=3),
            max_leaves=8,
        ),
        max_size=5,
    )
)
def test_any_json_value_round_trips(value: dict[str, Any]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        cache = ResultCache(directory)
        cache.put(KEY, value)
        assert cache.get(KEY) == value


_WRITER = textwrap.dedent(
    """
    import sys
    import time
    from pathlib import Path

    from autobatch._records._cache import ResultCache

    cache = ResultCache(sys.argv[1])
    me, flags = sys.argv[2], Path(sys.argv[3])
    (flags / f"ready-{me}").touch()
    while not (flags / "go").exists():  # both writers start together
        time.sleep(0.001)
    for i in range(100):
        cache.put("ab" * 32, {"writer": me, "i": i, "pad": "x" * (i * 97 % 5000)})
        cache.put(f"{i % 10:x}" * 64, {"writer": me, "i": i})
    """
)


@pytest.mark.slow
def test_two_concurrent_writers_never_corrupt(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    directory = tmp_path / "cache"
    writers = [
        subprocess.Popen([sys.executable, str(script), str(directory), name, str(tmp_path)],
                         cwd=ROOT)
        for name in ("a", "b")
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{n}").exists() for n in "ab"):
        assert time.monotonic() < deadline
        assert all(w.poll() is None for w in writers)
        time.sleep(0.01)
    (tmp_path / "go").touch()
    cache = ResultCache(directory)
    reads = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn or corrupt file would warn: make it fail
        while any(w.poll() is None for w in writers):  # read while both write
            value = cache.get("ab" * 32)
            assert value is None or value["writer"] in ("a", "b")
            reads += value is not None
            time.sleep(0.001)
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    assert reads > 0
    files = sorted(directory.iterdir())
    assert len(files) == 11  # every temporary file was moved into place or removed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for file in files:
            value = cache.get(file.stem)
            assert value is not None
            assert value["writer"] in ("a", "b")
    assert cache.get("ab" * 32)["i"] == 99  # type: ignore[index]


# --------------------------------------------------------------------------- search results


def _small() -> tuple[nn.Module, torch.Tensor]:
    """A model and sample whose search takes a handful of quick trials in 2 MiB."""
    return nn.Sequential(nn.Linear(512, 32), nn.ReLU(), nn.Linear(32, 10)), torch.randn(2, 512)


@pytest.fixture(scope="module")
def searched() -> Any:
    model, sample = _small()
    with SimulatedGPU("2MiB") as gpu:
        gpu.adopt(model)
        return search_batch_size(model, sample, torch.optim.SGD)


def test_search_result_round_trips_through_json(searched: Any) -> None:
    result = searched
    data = json.loads(json.dumps(result_to_dict(result)))
    assert result_from_dict(data) == result
    assert data["batch_size"] == result.batch_size
    assert data["trials"][0]["size"] == result.trials[0].size


def test_reserved_peaks_round_trip_and_older_entries_without_them_still_read() -> None:
    model, sample = _small()
    with SimulatedGPU("64MiB", allocator="caching") as gpu:
        gpu.adopt(model)
        result = search_batch_size(model, sample, torch.optim.SGD, max_batch=64)
    assert all(t.reserved_bytes is not None for t in result.trials if t.fits)
    data = json.loads(json.dumps(result_to_dict(result)))
    again = result_from_dict(data)
    assert again == result
    assert [t.steps for t in again.trials] == [t.steps for t in result.trials]
    assert again.peak_reserved_bytes == result.peak_reserved_bytes is not None
    for trial in data["trials"]:  # as stored before trials measured reserved memory
        del trial["reserved_bytes"], trial["steps"]
    old = result_from_dict(data)
    assert all(t.reserved_bytes is None and t.steps == 1 for t in old.trials)
    assert old.peak_reserved_bytes is None
    assert old.fragmentation is None
    data["trials"][0]["reserved_bytes"] = -1
    with pytest.raises(ValueError, match="not a stored search result"):
        result_from_dict(data)


def test_damaged_result_is_refused(searched: Any) -> None:
    data = result_to_dict(searched)
    del data["trials"]
    with pytest.raises(ValueError, match="not a stored search result"):
        result_from_dict(data)


def test_cached_search_runs_once_then_hits(tmp_path: Path) -> None:
    model, sample = _small()
    runs: list[int] = []

    def run() -> Any:
        runs.append(1)
        return search_batch_size(model, sample, torch.optim.SGD)

    def key() -> str:
        return search_key(
            model, sample, torch.optim.SGD, memory_for("cpu"), train=True, min_batch=1,
            max_batch=None, multiple_of=1, headroom=0.05, steps_per_trial=1, loss_fn=None,
            step_fn=None, scaler=None,
        )

    store = ResultCache(tmp_path)
    with SimulatedGPU("2MiB") as gpu:
        gpu.adopt(model)
        first, hit_first = cached_search(store, key, run)
        second, hit_second = cached_search(store, key, run)
        _third, hit_third = cached_search(None, key, run)
    assert (hit_first, hit_third) == (None, None)
    assert hit_second is not None
    assert hit_second.parent == tmp_path
    assert len(runs) == 2
    assert second.batch_size == first.batch_size
    assert second.trials == first.trials
    assert "from the cache" in second.notes[-1]
    assert not any("from the cache" in note for note in first.notes)


def test_cached_search_ignores_a_stored_value_that_is_no_result(
    tmp_path: Path, searched: Any
) -> None:
    store = ResultCache(tmp_path)
    store.put(KEY, {"batch_size": "many"})
    result = searched
    with pytest.warns(UserWarning, match="measuring again"):
        got, hit = cached_search(store, lambda: KEY, lambda: result)
    assert hit is None
    assert got is result
    assert store.get(KEY) == result_to_dict(result)


def test_search_key_reads_the_device_and_the_options() -> None:
    model, sample = _small()
    options: dict[str, Any] = {
        "min_batch": 1, "max_batch": None, "multiple_of": 1, "headroom": 0.05,
        "steps_per_trial": 1, "loss_fn": None, "step_fn": None, "scaler": None,
    }

    def key(memory: Any, optimizer: Any = torch.optim.SGD, train: bool = True, **changes: Any) -> str:
        return search_key(model, sample, optimizer, memory, train=train, **{**options, **changes})

    with SimulatedGPU("2MiB"):
        small = memory_for("cpu")
        base = key(small)
        assert key(small) == base
        assert key(small, headroom=0) != base
        assert key(small, loss_fn=nn.functional.cross_entropy) != base
        assert key(small, scaler=torch.amp.GradScaler("cpu")) != base
        assert key(small, train=False) == key(small, optimizer=None, train=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert key(small) != base
    with SimulatedGPU("4MiB"):
        assert key(memory_for("cpu")) != base


def _step_factory(length: int, scale: float) -> Any:
    def step(model: nn.Module, batch: torch.Tensor) -> None:
        model(batch.repeat(1, length)).mul(scale).sum().backward()
    return step


def test_steps_and_losses_are_keyed_by_what_they_captured_not_by_their_name() -> None:
    """Two steps from one factory shared an entry (cached 4,645 where 2,209 was right)."""
    model, sample = _small()
    options: dict[str, Any] = {
        "min_batch": 1, "max_batch": None, "multiple_of": 1, "headroom": 0.05,
        "steps_per_trial": 1, "scaler": None,
    }

    def key(loss_fn: Any = None, step_fn: Any = None) -> str:
        return search_key(model, sample, torch.optim.SGD, memory_for("cpu"), train=True,
                          loss_fn=loss_fn, step_fn=step_fn, **options)

    def scaled(by: float) -> Any:
        return lambda output, target: nn.functional.mse_loss(output * by, target)

    with SimulatedGPU("2MiB"):
        assert key(step_fn=_step_factory(4, 1.0)) == key(step_fn=_step_factory(4, 1.0))
        assert key(step_fn=_step_factory(4, 1.0)) != key(step_fn=_step_factory(16, 1.0))
        assert key(step_fn=_step_factory(4, 1.0)) != key(step_fn=_step_factory(4, 2.0))
        assert key(loss_fn=scaled(1.0)) != key(loss_fn=scaled(2.0))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def trains(model_: nn.Module, batch: torch.Tensor) -> None:
            opt.zero_grad()
            model(batch).sum().backward()
            opt.step()

        before = key(step_fn=trains)
        trains(model, sample)  # (values and optimizer state change; the memory does not)
        assert key(step_fn=trains) == before


def _with_helper(doubled: bool) -> nn.Module:
    class Block(nn.Module):  # (the same name and forward both times; the helper differs)
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self._helper(x)

        if doubled:
            def _helper(self, x: torch.Tensor) -> torch.Tensor:
                return self.linear(torch.cat([x, x], 1)[:, :8])
        else:
            def _helper(self, x: torch.Tensor) -> torch.Tensor:
                return self.linear(x)

    return Block()


def test_a_helper_that_forward_calls_is_part_of_the_key() -> None:
    """A helper changed without forward changing kept the key (cached 5,002, right 1,329)."""
    assert _key(model=_with_helper(False)) == _key(model=_with_helper(False))
    assert _key(model=_with_helper(False)) != _key(model=_with_helper(True))


# --------------------------------------------------------------------------- module settings


def _conv(stride: int = 1, dilation: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=stride, dilation=dilation), nn.ReLU(), nn.Flatten(1)
    )


class _Attention(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.attention(x, x, x, need_weights=False)[0]
        return out


def _gpt2(checkpointing: bool = False) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                   bos_token_id=0, eos_token_id=0)
    )
    if checkpointing:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model


@pytest.mark.parametrize(
    ("setting", "one", "other"),
    [
        ("conv stride", lambda: _conv(stride=4), lambda: _conv(stride=1)),
        ("conv dilation", lambda: _conv(dilation=1), lambda: _conv(dilation=3)),
        ("attention heads", lambda: _Attention(1), lambda: _Attention(8)),
        ("pooling kernel", lambda: nn.MaxPool2d(2), lambda: nn.MaxPool2d(1)),
        ("upsampling", lambda: nn.Upsample(scale_factor=1), lambda: nn.Upsample(scale_factor=4)),
        ("dropout", lambda: nn.Dropout(0.0), lambda: nn.Dropout(0.5)),
        ("train or eval", lambda: nn.Dropout(0.5), lambda: nn.Dropout(0.5).eval()),
        ("gradient checkpointing", _gpt2, lambda: _gpt2(checkpointing=True)),
    ],
)
def test_module_settings_that_are_not_parameters_change_the_key(
    setting: str, one: Any, other: Any
) -> None:
    assert _key(model=one()) == _key(model=one()), setting
    assert _key(model=one()) != _key(model=other()), setting


_KEY_IN_A_PROCESS = textwrap.dedent(
    """
    import torch
    from torch import nn
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel
    from autobatch._records._cache import fingerprint

    models = [
        GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                   n_positions=32, bos_token_id=0, eos_token_id=0)),
        BertModel(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                             intermediate_size=64, vocab_size=100)),
        nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                              enable_nested_tensor=False),
    ]
    for model in models:
        print(fingerprint(model, torch.zeros(1, 8, dtype=torch.long), device_name="cuda:0",
                          capacity_bytes=2**30))
    """
)


@pytest.mark.slow
def test_keys_of_real_models_are_the_same_in_every_process() -> None:
    """Nothing that changes with the process (addresses, hashes of objects) enters the key."""
    processes = [  # two at once: each mostly waits for torch and transformers to import
        subprocess.Popen([sys.executable, "-c", _KEY_IN_A_PROCESS], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=180) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs[0][1]
    assert outputs[0][0] == outputs[1][0]
    assert len(set(outputs[0][0].split())) == 3


class _Opaque:
    """An object that describes itself only by its address."""

    __slots__ = ()


class _HoldsAnOpaqueObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)
        self.helper = _Opaque()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out


def test_a_model_that_cannot_be_fingerprinted_is_never_cached(tmp_path: Path) -> None:
    model, sample = _HoldsAnOpaqueObject(), torch.randn(2, 8)
    for _ in range(2):
        with SimulatedGPU("2MiB") as gpu:
            gpu.adopt(model)
            with pytest.warns(UserWarning, match="cannot be fingerprinted reliably"):
                result = search_batch_size(model, sample, torch.optim.SGD, cache=tmp_path)
        assert not any("from the cache" in note for note in result.notes)
        assert any("not cached" in note for note in result.notes)
    assert list(tmp_path.iterdir()) == []


def test_a_stride_change_is_measured_again_not_served_from_the_cache(tmp_path: Path) -> None:
    """The issue's case: the same conv net with stride 4, then stride 1, through the cache."""
    sample = torch.randn(1, 3, 32, 32)
    found = []
    for stride in (4, 1):
        model = _conv(stride=stride)
        with SimulatedGPU("64MiB") as gpu:  # room for 20 MiB large-pool segments
            gpu.adopt(model)
            result = search_batch_size(model, sample, torch.optim.SGD, cache=tmp_path)
        assert not any("from the cache" in note for note in result.notes)
        found.append(result.max_batch_size)
    assert found[0] > 4 * found[1]  # a quarter of the rows in each dimension: far more fit


@pytest.mark.parametrize(
    ("change", "value"),
    [
        ("batch_size", "Infinity"),
        ("batch_size", "-5"),
        ("max_batch_size", "1e400"),
        ("batch_size", "NaN"),
        ("batch_size", "true"),
        ("headroom", "-0.5"),
        ("capacity_bytes", "0"),
        ("trials", "[]"),
        ("memory_model", '{"fixed": 1, "per_sample": -3}'),
        ("notes", "[" * 100_000 + "]" * 100_000),
    ],
)
def test_damaged_stored_results_warn_and_miss_never_crash_or_return(
    tmp_path: Path, searched: Any, change: str, value: str
) -> None:
    data = result_to_dict(searched)
    data[change] = "@@"
    text = json.dumps({"format": 1, "key": KEY, "created": 0, "value": data})
    (tmp_path / f"{KEY}.json").write_text(text.replace('"@@"', value))
    with pytest.warns(UserWarning, match="autobatch cache"):
        got, hit = cached_search(ResultCache(tmp_path), lambda: KEY, lambda: searched)
    assert hit is None
    assert got is searched


_COPIES = [1]  # a global the step reads: how many copies of each row it trains on


def _step_reading_a_global(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    loss = nn.functional.cross_entropy(model(x.repeat(_COPIES[0], 1)), y.repeat(_COPIES[0]))
    loss.backward()
    return loss


class _Copies:
    def __init__(self, copies: int) -> None:
        self.copies = copies

    def step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(model(x.repeat(self.copies, 1)), y.repeat(self.copies))
        loss.backward()
        return loss


@pytest.mark.parametrize("reads", ["a global", "an attribute of self"])
def test_a_hit_whose_largest_size_no_longer_trains_is_measured_again(
    tmp_path: Path, reads: str
) -> None:
    """What the key cannot see (a global the step reads, an attribute of a bound method's
    ``self``) changed the step's memory fourfold: the hit's largest size is tried first, runs
    out of memory, and the search runs again (it returned a size that does not train)."""
    sample = (torch.randn(4, 200), torch.randint(0, 10, (4,)))
    found = []
    for copies in (1, 4):
        _COPIES[0] = copies
        step = _step_reading_a_global if reads == "a global" else _Copies(copies).step
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(200, 600), nn.GELU(), nn.Linear(600, 10))
        with SimulatedGPU("48MiB", adopt=[model]):
            cached = search_batch_size(model, sample, None, step_fn=step, cache=tmp_path)
            fresh = search_batch_size(model, sample, None, step_fn=step)
        assert not any("from the cache" in note for note in cached.notes)
        assert cached.max_batch_size == fresh.max_batch_size
        found.append(cached.max_batch_size)
    assert found[0] > 3 * found[1]
    with SimulatedGPU("48MiB", adopt=[model]):  # (the same step again: a hit, confirmed)
        again = search_batch_size(model, sample, None, step_fn=step, cache=tmp_path)
    assert any("from the cache" in note and "trained in trials" in note for note in again.notes)
    assert again.max_batch_size == found[1]
    _COPIES[0] = 1
