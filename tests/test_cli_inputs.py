"""The command-line tools with inputs a user gets wrong or a checkpoint that overflows: one line on stderr and
exit status 1, never a traceback (in process: each `main` returns the status)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import Checkpoint
from gpt2_scripts import analyze, generate, harvest
from safetensors.torch import load_file, save_file

PROMPT = "The cat sat on the mat because it"


@pytest.fixture(scope="module")
def loud(tiny: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with its MLPs' output weights 1e5 times larger: finite in float32, past float16's
    range (65504) in float16, as a real checkpoint's activations can be."""
    out = tmp_path_factory.mktemp("loud")
    shutil.copy(tiny.path / "config.json", out / "config.json")
    weights = load_file(tiny.path / "model.safetensors")
    for name in weights:
        if name.endswith("mlp.c_proj.weight"):
            weights[name] = weights[name] * 1e5
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def args(model: Path, tokenizer_dir: Path, *rest: str) -> list[str]:
    return ["--model", str(model), "--tokenizer", str(tokenizer_dir), "--device", "cpu", *rest]


def one_error(capsys: pytest.CaptureFixture[str], tool: str, says: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith(f"gpt2-{tool}: error: ") and says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_logits_that_overflow_float16_are_one_line(
    loud: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpt2-generate's loop and gpt2-analyze's runs raised these as tracebacks."""
    f16 = args(loud, tokenizer_dir, "--dtype", "float16")
    assert generate.main([PROMPT, *f16, "--greedy", "--max-new-tokens", "3"]) == 1
    one_error(capsys, "generate", "the logits became non-finite (inf or NaN) at generated token 1")
    assert analyze.main([PROMPT, *f16, "--no-ablated"]) == 1
    one_error(capsys, "analyze", "the activations became non-finite")  # no edit to blame
    assert analyze.main([PROMPT, *f16, "--no-ablated", "--gradients"]) == 1
    one_error(capsys, "analyze", "non-finite")
    assert analyze.main([*f16, "--attribution", PROMPT, "The dog sat on the mat because it", "--verify", "2"]) == 1
    one_error(capsys, "analyze", "run's metric is not finite (nan): no attribution to compute")
    assert generate.main([PROMPT, *args(loud, tokenizer_dir), "--greedy", "--max-new-tokens", "2"]) == 0  # float32


@pytest.mark.parametrize(
    ("tool", "argv", "says"),
    [
        ("generate", [PROMPT, "--model", ""], "--model is empty"),
        ("generate", [PROMPT, "{model}", "--dump-activations", ""], "--dump-activations is empty"),
        ("analyze", [PROMPT, "--model", ""], "--model is empty"),
        ("analyze", [PROMPT, "{model}", "--plot", ""], "--plot is empty"),
        ("analyze", [PROMPT, "{model}", "--plot", "{dir}/a.png"], "a.png: it is a directory"),
        ("analyze", [PROMPT, "{model}", "--plot", "{dir}/p.png/"], "p.png/: a file's name does not end in /"),
        ("analyze", [PROMPT, "{model}", "--plot", "{dir}/gone.png"], "gone.png: it links to"),  # dangling
        ("generate", [PROMPT, "{model}", "--dump-activations", "{dir}/d.st/"], "d.st/: a file's name does not end"),
        ("harvest", ["{dir}/docs.txt", "{model}", "--hooks", "hook_embed", "--out", ""], "--out is empty"),
        ("harvest", ["", "{model}", "--hooks", "hook_embed", "--out", "{dir}/o"], "the source is empty"),
    ],
)
def test_empty_arguments_are_refused_before_the_work(
    tiny: Checkpoint,
    tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    tool: str,
    argv: list[str],
    says: str,
) -> None:
    """An empty name was read as the current directory (--model, --out) or as no option at all, silently; a
    file name ending in / was written as a file, a plot through a dangling link refused after the work."""
    (tmp_path / "a.png").mkdir()  # a directory with a plot's name: refused before the work, not after
    (tmp_path / "gone.png").symlink_to(tmp_path / "no-such-dir" / "p.png")
    (tmp_path / "docs.txt").write_text("some text " * 100)
    main = {"generate": generate.main, "analyze": analyze.main, "harvest": harvest.main}[tool]
    full: list[str] = []
    for a in argv:
        full += args(tiny.path, tokenizer_dir) if a == "{model}" else [a.replace("{dir}", str(tmp_path))]
    assert main(full) == 1
    one_error(capsys, tool, says)
    assert capsys.readouterr().out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "docs.txt", "gone.png"]
