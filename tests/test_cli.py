"""The ``autobatch`` command, run for real: ``python -m autobatch`` in a subprocess."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from autobatch.cli import build_parser, main

MODELS = textwrap.dedent(
    """
    import torch
    from torch import nn


    def mlp():
        return nn.Sequential(nn.Linear(512, 32), nn.ReLU(), nn.Linear(32, 10))


    def rows(n):
        return torch.randn(n, 512), torch.randint(0, 10, (n,))


    def one_row():
        return torch.randn(1, 512)


    def four_rows():
        return torch.randn(4, 512), torch.randint(0, 10, (4,))


    def row_list():  # [dataset[i] for i in range(4)] of a (features, label) dataset
        return [(torch.randn(512), i % 10) for i in range(4)]


    def conv():
        return nn.Conv2d(3, 8, 3)


    def huge():
        return nn.Linear(2048, 2048)


    def not_a_model():
        return 3


    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 2)

        def forward(self, x):
            raise ValueError("picky: this model refuses every input")


    def picky():
        return Picky()


    def gpt2():
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000,
                                          n_positions=128, bos_token_id=0, eos_token_id=0))


    class NextToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            self.head = nn.Linear(64, 1000)

        def forward(self, tokens):
            return self.head(torch.relu(self.embed(tokens)))


    def next_token():
        return NextToken()


    def tokens_at(length):
        return torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(0))


    def masked_tokens():
        ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    """
)
MLP = ["--model", "tinymodels:mlp", "--sample-shape", "512", "--labels", "classes:10"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli")
    (path / "tinymodels.py").write_text(MODELS)
    return path


def _env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir), env.get("PYTHONPATH")]))
    env["AUTOBATCH_CACHE_DIR"] = str(workdir / "cache")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m autobatch ARGS`` in ``workdir``."""
    return subprocess.run(
        [sys.executable, "-m", "autobatch", *args], cwd=workdir, env=_env(workdir),
        capture_output=True, text=True, timeout=120,
    )


def run_all(workdir: Path, *commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Several ``python -m autobatch`` runs at once (each mostly waits for torch to import)."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "autobatch", *args], cwd=workdir, env=_env(workdir),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for args in commands
    ]
    results = []
    for process, args in zip(processes, commands, strict=True):
        out, err = process.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(args, process.returncode, out, err))
    return results


def _one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line or "nothing" in line]
    assert len(errors) == 1, result.stderr
    return errors[0]


# --------------------------------------------------------------------------- demo


def test_demo_prints_each_trial_and_the_result_quickly(workdir: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    result = run(workdir, "demo", "--plot", str(tmp_path / "demo.png"))
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 60
    out = result.stdout
    assert "simulated GPU with 64.00 MiB" in out  # says what it runs on
    assert "trial  1  batch" in out
    # the size above the largest: a trial that ran out of memory, or one the replay decided
    assert "OOM (cuda_allocator)" in out or "was not run: the caching allocator's replay" in out
    largest = int(re.search(r"largest batch that fits: (\d+)", out).group(1))  # type: ignore[union-attr]
    recommended = int(re.search(r"recommended batch size: +(\d+)", out).group(1))  # type: ignore[union-attr]
    assert 100 <= recommended < largest < 400  # B* in the low hundreds: 160 and 144 today
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.stderr == ""
    # docs/cli.md shows this output: the same lines, the seconds aside
    page = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    shown = page.split("$ python -m autobatch demo\n", 1)[1].split("```", 1)[0]

    def timeless(text: str) -> list[str]:
        return [re.sub(r"\d+\.\d+ s\b", "_ s", line) for line in text.strip().splitlines()]

    assert timeless(out[out.index("autobatch demo:"):out.index("plot saved")]) == timeless(shown)


def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json", "--simulate", "16MiB"]) == 0
    out, err = capsys.readouterr()
    document = json.loads(out)  # exactly one JSON object on stdout
    assert document["command"] == "demo"
    assert document["device"] == "simulated GPU 0 (16.00 MiB)"
    assert document["batch_size"] <= document["max_batch_size"]
    assert document["trials"][0]["fits"] is True
    assert "trial  1  batch" in err  # progress went to stderr


# --------------------------------------------------------------------------- find


@pytest.mark.slow
def test_find_measures_then_uses_the_cache(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*MLP, "--simulate", "2MiB"]
    first = run(workdir, "find", *args)
    assert first.returncode == 0, first.stderr
    assert "trial  1  batch" in first.stdout
    assert "running on a simulated GPU with 2.00 MiB" in first.stdout
    second = run(workdir, "find", *args, "--json")
    assert second.returncode == 0, second.stderr
    cached = json.loads(second.stdout)
    assert cached["cached"] is True
    assert f"largest batch that fits: {cached['max_batch_size']}" in first.stdout
    assert "trial  1" not in second.stderr  # nothing was run again
    assert len(list((workdir / "cache").glob("*.json"))) == 1
    monkeypatch.syspath_prepend(str(workdir))
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(workdir / "cache"))
    assert main(["find", *args, "--json", "--no-cache"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["cached"] is False
    assert measured["max_batch_size"] == cached["max_batch_size"]
    assert main(["find", *args, "--json", "--cache-dir", str(workdir / "other")]) == 0
    assert json.loads(capsys.readouterr().out)["cached"] is False
    assert len(list((workdir / "other").glob("*.json"))) == 1


def test_find_with_a_sample_factory_and_options(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    assert main(
        ["find", "--model", "tinymodels:mlp", "--sample", "tinymodels:rows", "--simulate",
         "2MiB", "--optimizer", "sgd", "--multiple-of", "8", "--max-batch", "400", "--json",
         "--no-cache", "--plot", str(tmp_path / "find.png")]
    ) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["max_batch_size"] % 8 == 0
    assert document["max_batch_size"] <= 400
    assert all(t["size"] % 8 == 0 for t in document["trials"])
    assert (tmp_path / "find.png").exists()
    assert main(
        ["find", "--model", "tinymodels:mlp", "--sample", "tinymodels:one_row", "--simulate",
         "2MiB", "--inference", "--headroom", "0", "--json", "--no-cache"]
    ) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["train"] is False
    assert document["batch_size"] == document["max_batch_size"]


def test_find_with_a_list_of_rows_as_sample(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    found = []
    for sample in ("tinymodels:row_list", "tinymodels:four_rows"):
        assert main(
            ["find", "--model", "tinymodels:mlp", "--sample", sample, "--simulate", "2MiB",
             "--optimizer", "sgd", "--max-batch", "4096", "--json", "--no-cache"]
        ) == 0
        document = json.loads(capsys.readouterr().out)
        found.append((document["max_batch_size"], [t["size"] for t in document["trials"]]))
    assert found[0] == found[1]  # the rows collated: the same batch as the tensors'


# --------------------------------------------------------------------------- best and plan


@pytest.mark.slow
def test_best(workdir: Path, monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str]) -> None:
    searched = run(workdir, "best", *MLP, "--simulate", "2MiB", "--repeats", "1", "--warmup",
                   "0", "--no-cache")
    assert searched.returncode == 0, searched.stderr
    assert "trial  1  batch" in searched.stdout
    assert "timing    batch      1:" in searched.stdout
    assert "chosen:  batch" in searched.stdout
    assert "fastest: batch" in searched.stdout
    monkeypatch.syspath_prepend(str(workdir))
    assert main(["best", *MLP, "--simulate", "2MiB", "--candidates", "8,32,128", "--repeats",
                 "2", "--warmup", "1", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["command"] == "best"
    assert document["search"] is None
    assert [p["size"] for p in document["points"]] == [8, 32, 128]
    assert document["batch_size"] in (8, 32, 128)
    assert document["samples_per_s"] >= (1 - document["tolerance"]) * document["best_samples_per_s"]


def test_plan(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    assert main(["plan", *MLP, "--capacity", "2MiB", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["command"] == "plan"
    assert document["batch_size"] <= document["max_batch_size"]
    assert document["capacity_bytes"] == 2 * 2**20


# --------------------------------------------------------------------------- failures


@pytest.mark.slow
def test_nothing_fits_exits_3(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    batch_too_big = run(workdir, "find", "--model", "tinymodels:conv", "--sample-shape",
                        "3,512,512", "--simulate", "4MiB", "--no-cache")
    line = _one_line_error(batch_too_big, 3)
    assert "even the smallest batch (1) does not fit" in line
    assert "4.00 MiB" in line
    assert "OOM (cuda_allocator)" in batch_too_big.stdout  # the trials were shown
    monkeypatch.syspath_prepend(str(workdir))
    args = ["find", "--model", "tinymodels:huge", "--sample-shape", "2048", "--simulate", "4MiB"]
    assert main(args) == 3
    assert "nothing fits: the model alone (16.01 MiB" in capsys.readouterr().err


def test_bad_arguments_exit_2_with_one_line(workdir: Path) -> None:
    optimizer, module = run_all(
        workdir,
        ["find", *MLP, "--optimizer", "lamb"],
        ["find", "--model", "nosuchpackage.models:net", "--sample-shape", "8"],
    )
    assert "invalid choice: 'lamb'" in _one_line_error(optimizer, 2)
    assert "cannot import 'nosuchpackage.models'" in _one_line_error(module, 2)


@pytest.mark.slow
def test_errors_while_running_exit_1_and_verbose_shows_the_traceback(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["find", "--model", "tinymodels:mlp", "--sample-shape", "31", "--simulate", "2MiB"]
    verbose = run(workdir, *args, "--verbose")
    assert verbose.returncode == 1
    assert "Traceback (most recent call last)" in verbose.stderr
    monkeypatch.syspath_prepend(str(workdir))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error" in line]
    assert "shapes cannot be multiplied" in line
    assert "--verbose" in line


@pytest.mark.skipif(
    shutil.which("autobatch", path=str(Path(sys.executable).parent)) is None,
    reason="the autobatch console script is installed only by pip install",
)
def test_console_script(workdir: Path) -> None:
    script = shutil.which("autobatch", path=str(Path(sys.executable).parent))
    assert script is not None
    result = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.startswith("autobatch ")


# --------------------------------------------------------------------------- in process (fast)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["find", *MLP, "--simulate", "lots"], "--simulate='lots' is not a size"),
        (["find", "--model", "tinymodels:mlp", "--sample-shape", "3,x"], "--sample-shape '3,x'"),
        (["find", "--model", "tinymodels:nope", "--sample-shape", "8"], "tinymodels has no 'nope'"),
        (["find", "--sample-shape", "8"], "the following arguments are required: --model"),
        (["find", *MLP, "--labels", "classes:x"], "--labels 'classes:x'"),
        (["find", *MLP, "--dtype", "float33"], "--dtype 'float33'"),
        (["find", *MLP, "--loss", "nothing"], "--loss 'nothing'"),
        (["find", "--model", "tinymodels:not_a_model", "--sample-shape", "8"], "returned int"),
        (["find", "--model", "tinymodels", "--sample-shape", "8"], "package.module:callable"),
        (["find", *MLP, "--headroom", "2", "--simulate", "1MiB"], "headroom must be"),
        (["best", *MLP, "--candidates", "8,,x"], "--candidates '8,,x'"),
        (["find", *MLP, "--device", "cuda:0", "--simulate", "1GiB"], "--simulate runs on the CPU"),
        (["plan", *MLP], "give --capacity"),
        (["find", *MLP, "--simulate", "off"], "give --max-batch N"),
        ([], "required: COMMAND"),
    ],
)
def test_usage_errors_in_process(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    args: list[str], message: str,
) -> None:
    import torch

    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: --device cuda:0 is valid here")
    if ("give --capacity" in message or "--max-batch N" in message) and torch.cuda.is_available():
        pytest.skip("with a GPU, the command runs there")
    monkeypatch.syspath_prepend(str(workdir))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    from autobatch import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"autobatch {__version__}"
    assert main(["find", "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--model", "--sample-shape", "--sample", "--dtype", "--labels", "--optimizer",
                   "--device", "--simulate", "--headroom", "--max-batch", "--multiple-of",
                   "--json", "--plot", "--no-cache", "--cache-dir", "--verbose"):
        assert option in text


def test_parser_lists_the_four_commands() -> None:
    parser = build_parser()
    text = parser.format_help()
    for command in ("find", "plan", "best", "demo"):
        assert command in text


def test_logging_and_warnings_are_put_back(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging
    import warnings

    monkeypatch.syspath_prepend(str(workdir))
    handlers: Any = {name: list(logging.getLogger(name).handlers)
                     for name in ("autobatch", "autobatch.trial", "autobatch.throughput")}
    level = logging.getLogger("autobatch").level
    show = warnings.showwarning
    assert main(["find", *MLP, "--simulate", "2MiB", "--no-cache", "--max-batch", "64"]) == 0
    assert "largest batch that fits: 64" in capsys.readouterr().out
    assert {name: list(logging.getLogger(name).handlers) for name in handlers} == handlers
    assert logging.getLogger("autobatch").level == level
    assert warnings.showwarning is show


def test_real_cpu_search_needs_a_limit_and_says_no_statistics(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: --simulate off runs on the GPU here")
    monkeypatch.syspath_prepend(str(workdir))
    assert main(["find", *MLP, "--simulate", "off", "--max-batch", "16", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "largest batch that fits: 16" in out
    assert "this device keeps no memory statistics" in out


# --------------------------------------------------------------------------- exit codes, --json


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["find", *MLP, "--simulate", "1e999"], "--simulate='1e999' is not a size"),
        (["plan", *MLP, "--capacity", "1e999"], "--capacity='1e999' is not a size"),
        (["plan", *MLP, "--capacity", "nan"], "--capacity='nan' is not a size"),
        (["find", *MLP, "--max-batch", "0", "--simulate", "1MiB"], "--max-batch must be"),
        (["best", *MLP, "--tolerance", "3", "--simulate", "1MiB"], "--tolerance must be"),
        (["demo", "--headroom", "-1"], "--headroom must be"),
        (["plan", *MLP, "--capacity", "1MiB", "--overhead", "2MiB"], "--overhead 2MiB"),
    ],
)
def test_sizes_and_options_that_make_no_sense_are_usage_errors(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    args: list[str], message: str,
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_a_value_error_in_the_users_forward_is_a_run_error_not_a_usage_error(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    args = ["find", "--model", "tinymodels:picky", "--sample-shape", "8", "--simulate", "4MiB",
            "--no-cache"]
    assert main(args) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "picky: this model refuses every input" in line


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["find", *MLP, "--simulate", "1e999", "--json"], 2, "is not a size"),
        (["find", *MLP, "--optimizer", "lamb", "--json"], 2, "invalid choice"),
        (["find", "--model", "tinymodels:picky", "--sample-shape", "8", "--simulate", "4MiB",
          "--no-cache", "--json"], 1, "picky"),
        (["find", "--model", "tinymodels:huge", "--sample-shape", "2048", "--simulate", "4MiB",
          "--json"], 3, "does not fit"),
    ],
)
def test_json_errors_print_one_object_with_the_error(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    args: list[str], code: int, message: str,
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    assert main(args) == code
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # stdout holds exactly one JSON object
    assert message in document["error"]
    assert document["exit_code"] == code
    assert document["command"] == "find"
    assert message in captured.err  # and the one line on stderr, as without --json


def test_numpy_is_installed_with_the_package_and_the_cli_does_not_warn(workdir: Path) -> None:
    import configparser

    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parent.parent / "setup.cfg")
    requires = config["options"]["install_requires"].split()
    assert "numpy" in requires  # torch warns "Failed to initialize NumPy" on import without it
    result = run(workdir, "--version")
    assert result.returncode == 0
    assert "NumPy" not in result.stderr


# --------------------------------------------------------------------------- language models


def _largest(main_args: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main([*main_args, "--json", "--no-cache", "--headroom", "0"]) == 0
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return document


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "next_token"])
def test_a_language_model_without_labels_is_never_cheaper_than_its_real_loss(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    model: str,
) -> None:
    """The issue's case: token ids and no labels. The stand-in loss keeps what a cross-entropy
    over the vocabulary keeps, so the size is at most the one the real loss allows (the sum of
    means found a size whose real training step ran out of memory)."""
    monkeypatch.syspath_prepend(str(workdir))
    args = ["find", "--model", f"tinymodels:{model}", "--sample-shape", "128", "--dtype", "int64",
            "--simulate", "24MiB"]
    stand_in = _largest(args, capsys)["max_batch_size"]
    if model == "gpt2":  # training at that size with the model's own loss fits
        assert _gpt2_trains(stand_in, "24MiB")
    real = _largest([*args, "--labels", "tokens"], capsys)["max_batch_size"]
    assert 1 <= stand_in <= real


def _gpt2_trains(n: int, capacity: str) -> bool:
    """Do two AdamW steps of tinymodels.gpt2 on n rows of 128 tokens, with the model's own
    loss (labels = the tokens), fit in a fresh simulated GPU of ``capacity``?"""
    import tinymodels  # type: ignore[import-not-found]
    import torch

    from autobatch.testing import SimulatedGPU

    model = tinymodels.gpt2()
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.zeros(n, 128, dtype=torch.long)
    try:
        with SimulatedGPU(capacity) as gpu:
            gpu.adopt(model)
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                model(input_ids=tokens, labels=tokens).loss.backward()
                opt.step()
    except torch.OutOfMemoryError:
        return False
    return True


@pytest.mark.slow
def test_labels_tokens_trains_with_the_models_own_loss(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    args = ["find", "--model", "tinymodels:gpt2", "--sample-shape", "128", "--dtype", "int64",
            "--simulate", "24MiB", "--labels", "tokens"]
    found = _largest(args, capsys)["max_batch_size"]
    assert _gpt2_trains(found, "24MiB")
    assert not _gpt2_trains(found + 1, "24MiB")


def test_a_loss_that_cannot_take_a_model_output_says_what_came_back(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    args = ["find", "--model", "tinymodels:gpt2", "--sample-shape", "16", "--dtype", "int64",
            "--labels", "classes:10", "--simulate", "64MiB", "--no-cache"]
    assert main(args) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "the model returned CausalLMOutputWithCrossAttentions" in line
    assert "loss_fn=cross_entropy" in line
    assert "output.logits" in line  # what to pass instead


def test_labels_tokens_needs_token_ids(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    assert main(["find", *MLP[:2], "--sample-shape", "8", "--labels", "tokens"]) == 2
    assert "--labels tokens needs token ids" in capsys.readouterr().err


def test_plan_of_a_hugging_face_model_with_an_attention_mask_warns_and_plans(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(workdir))
    args = ["plan", "--model", "tinymodels:gpt2", "--sample", "tinymodels:masked_tokens",
            "--capacity", "32MiB", "--headroom", "0"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "warning: plan_max_batch cannot run the step on the meta device" in captured.err
    assert "Tensor.item()" in captured.err
    assert "predicted largest batch:" in captured.out
    assert "planned from" in captured.out  # the note says how


@pytest.mark.slow
def test_find_at_lengths_prints_a_table_then_uses_the_cache(workdir: Path) -> None:
    tokens = ["--model", "tinymodels:next_token", "--sample-shape", "32", "--dtype", "int64",
              "--labels", "tokens", "--simulate", "8MiB", "--cache-dir", str(workdir / "lengths")]
    factory = ["--model", "tinymodels:next_token", "--sample", "tinymodels:tokens_at",
               "--simulate", "8MiB", "--no-cache", "--json"]
    first, as_json, no_length, bad = run_all(
        workdir,
        ["find", *tokens, "--lengths", "32,8,16"],
        ["find", *factory, "--lengths", "8,16,32"],
        ["find", "--model", "tinymodels:mlp", "--sample", "tinymodels:rows", "--lengths", "8"],
        ["find", *tokens, "--lengths", "8,0"],
    )
    assert first.returncode == 0, first.stderr
    table = _length_table(first.stdout)
    assert sorted(table) == [8, 16, 32]
    sizes = [table[n][1] for n in (8, 16, 32)]
    assert sizes == sorted(sizes, reverse=True)  # longer sequences, smaller batches
    assert all(recommended <= largest for recommended, largest, _ in table.values())
    assert "trials (" in first.stdout

    document = json.loads(as_json.stdout)
    assert as_json.returncode == 0, as_json.stderr
    assert document["lengths"] == [8, 16, 32]
    assert [r["max_batch_size"] for r in document["results"]] == sorted(
        (r["max_batch_size"] for r in document["results"]), reverse=True)

    assert no_length.returncode == 2
    assert "must take length=" in no_length.stderr
    assert bad.returncode == 2
    assert "--lengths '8,0'" in bad.stderr

    again = run(workdir, "find", *tokens, "--lengths", "8,16,32")
    assert again.returncode == 0, again.stderr
    assert "measured earlier" in again.stdout
    assert _length_table(again.stdout) == table


def _length_table(text: str) -> dict[int, tuple[int, int, int]]:
    """``find --lengths``'s rows: length -> (batch size, largest that fits, trials)."""
    rows = [line.split() for line in text.splitlines()]
    return {int(r[0]): (int(r[1]), int(r[2]), int(r[3]))
            for r in rows if len(r) == 4 and all(part.isdigit() for part in r)}
