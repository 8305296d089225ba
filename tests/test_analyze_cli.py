"""gpt2-analyze, run as a user runs it (a subprocess) on the tiny checkpoint with the real tokenizer:
the table, the plot, and one-line errors."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import Checkpoint

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The cat sat on the mat because it"


def gpt2_analyze(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """Run the CLI's main in a fresh interpreter (`prelude` runs first, e.g. to hide a package)."""
    code = f"{prelude}\nimport sys\nfrom gpt2_scripts.analyze import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def model_args(tiny: Checkpoint, tokenizer_dir: Path) -> list[str]:
    return ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--device", "cpu"]


def test_prints_the_table_and_writes_the_plot(model_args: list[str], tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    r = gpt2_analyze(PROMPT, *model_args, "--plot", str(png))
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    lines = r.stdout.splitlines()
    assert lines[0].endswith("8 tokens; layer -1 is the embeddings, layer L the stream after block L")
    assert "with residual connections" in lines[1] and "without residual connections" in lines[1]
    columns = ["norm", "eff_rank", "collapse", "mean_cos", "attn_ent", "lens@last"]
    assert lines[2].split() == ["layer", *columns, "|", *columns]
    bar = lines[2].index(" | ")  # fixed-width columns: each side of the bar is one run
    table = lines[3 : lines.index("")]
    rows = [(line[:5].strip(), line[5:bar].split()[:5], line[bar + 3 :].split()[:5]) for line in table]
    assert [layer for layer, _, _ in rows] == ["-1", "0", "1"]
    assert rows[0][1] == rows[0][2] and rows[0][1][4] == "-"  # the embeddings, before any attention
    (_, with_skips, without) = rows[-1]
    assert float(without[2]) < float(with_skips[2])  # the collapse measure falls without the skips
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000
    assert r.stderr.strip() == f"wrote {png}"


def test_no_ablated_top_k_and_the_prompt_from_stdin(model_args: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gpt2_scripts.analyze", *model_args, "--no-ablated", "--top-k", "1"],
        input=PROMPT,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "8 tokens" in r.stdout
    assert "without residual connections" not in r.stdout and "|" not in r.stdout
    # title, two header lines, layers -1..1; then the logit lens's top 1 at the last position, a layer a line
    assert len(r.stdout.splitlines()) == 3 + 3 + 1 + 1 + 3


def test_top_k_is_the_logit_lens_at_the_last_position(
    model_args: list[str], tiny: Checkpoint, tokenizer_dir: Path
) -> None:
    """Each layer's `--top-k` most likely next tokens at the last position, with their probabilities, as
    `model.analysis.analyze` gives them, with and without the skips (the flag changed nothing printed)."""
    from model.analysis import analyze
    from model.interventions import EditSpec
    from model.loading import load

    loaded = load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu")
    ids = loaded.tokenizer.encode(PROMPT)
    everything = tuple(range(loaded.model.config.n_layer))
    no_skips = EditSpec((), everything, everything).hooks(loaded.model.config, len(ids))
    r = gpt2_analyze(PROMPT, *model_args, "--top-k", "3")
    assert r.returncode == 0, r.stderr
    sections = r.stdout.split("\n\n")
    for section, hooks, which in ((sections[1], None, "with"), (sections[2], no_skips, "without")):
        title, *rows = section.strip("\n").splitlines()
        assert (
            title
            == f"logit lens at the last position, {which} residual connections (token probability, most likely first):"
        )
        for row, s in zip(rows, analyze(loaded.model, ids, 3, hooks), strict=True):
            assert row.split()[0] == str(s.layer)
            probabilities = [float(p) for p in re.findall(r" (\d\.\d{3})(?=  |$)", row)]  # each after its token
            expected = [p for _, p in s.logit_lens[-1]]
            assert len(expected) == 3 and probabilities == pytest.approx(expected, abs=5e-4), (row, expected)
            assert all(repr(loaded.tokenizer.token_name(t))[:13] in row for t, _ in s.logit_lens[-1])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["", "{model}"], "the prompt is empty"),
        ([PROMPT, "--model", "/nonexistent/checkpoint", "--device", "cpu"], "/nonexistent/checkpoint"),
        ([PROMPT, "{model}", "--plot", "/nonexistent/dir/out.png"], "cannot write /nonexistent/dir/out.png"),
        ([PROMPT, "{model}", "--plot", "/tmp"], "--plot /tmp: the name must end in a format matplotlib writes ("),
        ([PROMPT, "{model}", "--plot", "out.nope"], "--plot out.nope: the name must end in a format"),
        (["\udcff hi", "{model}"], "the prompt is not valid UTF-8: it holds the byte 0xFF at character 0"),
        (
            ["--attribution", "a", "b\udce9", "{model}"],
            "the corrupted prompt is not valid UTF-8: it holds the byte 0xE9",
        ),
    ],
    ids=[
        "empty prompt",
        "missing model",
        "unwritable plot",
        "plot without a format",
        "unknown format",
        "prompt not UTF-8",
        "attribution prompt not UTF-8",
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_1(model_args: list[str], args: list[str], says: str) -> None:
    argv: list[str] = []
    for a in args:
        argv += model_args if a == "{model}" else [a]
    r = gpt2_analyze(*argv)
    assert r.returncode == 1
    assert r.stderr.startswith("gpt2-analyze: error: ") and says in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_plot_without_matplotlib_says_so(model_args: list[str], tmp_path: Path) -> None:
    hide_matplotlib = "import sys; sys.modules['matplotlib'] = None"  # its import then raises ImportError
    r = gpt2_analyze(PROMPT, *model_args, "--plot", str(tmp_path / "out.png"), prelude=hide_matplotlib)
    assert r.returncode == 1
    assert r.stderr == (
        "gpt2-analyze: error: --plot needs matplotlib, which is not installed: "
        "pip install matplotlib (the project's plot extra)\n"
    )
    assert not (tmp_path / "out.png").exists()


# --- in process: refused before any model is loaded ---------------------------------------------------


def test_plot_into_a_missing_directory_is_refused_before_the_work(
    model_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpt2_scripts.analyze import main

    target = tmp_path / "no-such-dir" / "out.png"
    assert main([PROMPT, *model_args, "--plot", str(target)]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # no table printed, then an error
    assert err == f"gpt2-analyze: error: cannot write {target}: no directory {target.parent}\n"


def test_a_plot_never_replaces_what_loading_reads(
    tiny: Checkpoint, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The figure is written as a dump is, through a link to the file it names, and like a dump it is refused
    before the work where it would replace a file the run reads (a link named like a figure to the weights or
    a tokenizer file once wrote a PNG over them)."""
    from gpt2_scripts.analyze import main

    ckpt, tok = tmp_path / "ckpt", tmp_path / "tok"
    for source, copy in ((tiny.path, ckpt), (tokenizer_dir, tok)):
        copy.mkdir()
        for f in source.iterdir():
            if f.is_file():
                shutil.copyfile(f, copy / f.name)
    for name, target, what, loaded in (
        ("weights.png", ckpt / "model.safetensors", "checkpoint", ckpt),
        ("tokenizer.svg", tok / "tokenizer.json", "tokenizer", tok),
    ):
        link = tmp_path / name
        link.symlink_to(target)
        before = target.read_bytes()
        args = [PROMPT, "--model", str(ckpt), "--tokenizer", str(tok), "--device", "cpu", "--plot", str(link)]
        assert main(args) == 1
        out, err = capsys.readouterr()
        says = f"gpt2-analyze: error: --plot {link}: it would replace a file of the {what} being loaded ({loaded})\n"
        assert out == "" and err == says
        assert target.read_bytes() == before


def test_a_plot_format_whose_tool_is_missing_is_refused_before_the_work(
    model_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pgf, a format matplotlib lists, needs LaTeX to write: without it, refused before the analysis runs (it
    failed after the work, the tables printed)."""
    import shutil

    from gpt2_scripts.analyze import main

    monkeypatch.setattr(shutil, "which", lambda name: None)
    target = tmp_path / "out.pgf"
    assert main([PROMPT, *model_args, "--plot", str(target)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and not target.exists()
    assert (
        err
        == f"gpt2-analyze: error: --plot {target}: matplotlib writes pgf with xelatex, which is not installed (LaTeX)\n"
    )


def test_a_torch_device_this_project_does_not_run_on(model_args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from gpt2_scripts.analyze import main

    with pytest.raises(SystemExit) as exit_info:
        main([PROMPT, *model_args, "--device", "meta"])
    assert exit_info.value.code == 2  # a usage error, as gpt2-serve's
    assert capsys.readouterr().err.endswith(
        "gpt2-analyze: error: argument --device: unknown device 'meta'; use auto, cpu, cuda, cuda:N or mps\n"
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--attribution", "a b", "c d", PROMPT], "--attribution CLEAN CORRUPT does not take a prompt argument"),
        (["--attribution", "a b", "c d", "--sae", "s=x", "--gradients"], "does not take --sae, --gradients"),
        (["--attribution", "a b", "c d", "--no-ablated"], "does not take --no-ablated"),
        ([PROMPT, "--metric", "loss"], "--metric is for --attribution CLEAN CORRUPT"),
        ([PROMPT, "--verify", "3"], "--verify is for --attribution CLEAN CORRUPT"),
        (["--attribution", "a b", "c d", "--top-k", "7"], "does not take --top-k"),
        ([PROMPT, "--top-k", "0"], "--top-k must be in 1..100, got 0"),
        ([PROMPT, "--top-k", "101"], "--top-k must be in 1..100, got 101"),
        (["--attribution", "a b", "c d", "--verify", "65"], "--verify must be in 0..64, got 65"),
        (["--attribution", "a b", "c d", "--verify", "-1"], "--verify must be in 0..64, got -1"),
    ],
    ids=[
        "prompt",
        "sae and gradients",
        "no-ablated",
        "metric",
        "verify",
        "top-k",
        "top-k-0",
        "top-k-101",
        "verify-65",
        "verify-negative",
    ],
)
def test_flags_attribution_would_ignore_are_usage_errors(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpt2_scripts.analyze import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(args)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("attribution", [False, True], ids=["analysis", "attribution"])
@pytest.mark.parametrize(
    ("output", "says"),
    [
        ("closed", "standard output is closed: nowhere to write the tables"),
        ("full", "cannot write the tables: No space left on device"),
    ],
)
def test_a_closed_or_full_output_is_one_line(model_args: list[str], output: str, says: str, attribution: bool) -> None:
    """`>&-` (refused before the work: it wrote nothing, status 0) and `> /dev/full` (a traceback): one line
    on stderr, status 1, as gpt2-generate."""
    import os

    prompts = ["--attribution", "The cat sat", "The dog sat"] if attribution else [PROMPT, "--no-ablated"]
    command = [sys.executable, "-m", "gpt2_scripts.analyze", *prompts, *model_args]
    if output == "full":
        if not Path("/dev/full").exists():
            pytest.skip("no /dev/full on this system")
        with open("/dev/full", "w") as full:
            done = subprocess.run(command, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    else:
        done = subprocess.run(
            command, cwd=ROOT, stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: os.close(1)
        )
    assert done.returncode == 1 and done.stderr == f"gpt2-analyze: error: {says}\n", done.stderr


def test_a_plot_that_cannot_be_written_whole_leaves_the_old_file(
    model_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk while the figure is written: the old file stays as it was (it was cut short), and no
    temporary file is left beside it."""
    import errno

    import matplotlib.figure
    from gpt2_scripts.analyze import main

    png = tmp_path / "old.png"
    png.write_bytes(b"the old plot")

    def full(self: object, fname: str, **kwargs: object) -> None:
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    assert main([PROMPT, *model_args, "--no-ablated", "--plot", str(png)]) == 1
    assert capsys.readouterr().err == f"gpt2-analyze: error: cannot write {png}: No space left on device\n"
    assert png.read_bytes() == b"the old plot" and [p.name for p in tmp_path.iterdir()] == ["old.png"]


def test_no_prompt_with_standard_input_closed_is_one_line(
    model_args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpt2_scripts.analyze import main

    monkeypatch.setattr(sys, "stdin", None)  # `<&-`
    assert main(model_args) == 1
    assert capsys.readouterr().err == (
        "gpt2-analyze: error: no prompt: standard input is closed; give the prompt as an argument\n"
    )


def test_a_prompt_with_dollars_is_plotted_as_text(model_args: list[str], tmp_path: Path) -> None:
    """matplotlib reads $...$ as math: an unbalanced one in the title (the prompt) raised after the tables."""
    png = tmp_path / "p.png"
    r = gpt2_analyze("price $\\frac{1 $ here", *model_args, "--no-ablated", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.stat().st_size > 0 and r.stderr == f"wrote {png}\n"


def test_the_log_axis_of_the_highway_keeps_its_math_and_the_title_is_text(
    model_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt is drawn as text ($ included) while the log axis's labels stay mathtext: math was switched
    off for every text, and the axis printed `$\\mathdefault{10^{0}}$` as it is."""
    import gpt2_scripts.analyze as cli

    seen: list[Any] = []
    monkeypatch.setattr(cli, "save_figure", lambda plt, fig, path: seen.append(fig))
    assert (
        cli.main(["a $5 cat sat", *model_args, "--gradients", "--no-ablated", "--plot", str(tmp_path / "h.png")]) == 0
    )
    (fig,) = seen
    fig.canvas.draw()
    log_axis = next(ax for ax in fig.axes if ax.get_yscale() == "log")
    labels = [t for t in log_axis.get_yticklabels() if t.get_text()]
    assert labels and all("$" in t.get_text() and t.get_parse_math() for t in labels)
    assert fig._suptitle.get_text().endswith(": 'a $5 cat sat'") and not fig._suptitle.get_parse_math()


def test_a_plot_behind_a_link_takes_the_format_of_the_name_given(model_args: list[str], tmp_path: Path) -> None:
    """A link `out.png` to `data.txt`: the figure is a PNG written over the link's target (matplotlib took the
    format from the temporary file's name, `.part.txt`, and raised after the work)."""
    (tmp_path / "data.txt").write_text("old")
    (tmp_path / "out.png").symlink_to("data.txt")
    r = gpt2_analyze(PROMPT, *model_args, "--no-ablated", "--plot", str(tmp_path / "out.png"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "data.txt").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_negative_value_is_read_as_a_value(capsys: pytest.CaptureFixture[str]) -> None:
    """`--top-k -1e-3` is a value, refused as one, not argparse's "expected one argument"."""
    from gpt2_scripts.analyze import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["The cat", "--top-k", "-1e-3"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith("gpt2-analyze: error: argument --top-k: invalid int value: '-1e-3'\n")


@pytest.mark.parametrize(
    ("metric", "says"),
    [
        (
            "LOSS",
            "--metric ('LOSS'): not valid JSON: Expecting value: line 1 column 1 (char 0); give loss, or a metric",
        ),
        ('{"type": "kl"}', "--metric ("),
        # the flag's own path, not pydantic's `loss.span[1]`
        ('{"type": "loss", "span": [0, "x"]}', """--metric ('{"type": "loss", "span": [0, "x"]}'): span[1]: Input"""),
        ('{"type": "logprob", "token": 5, "position": 9}', "--metric: position 9 is outside the prompt"),
        ('{"type": "logprob", "token": 99999}', "--metric: token id 99999 is outside the vocabulary"),
    ],
    ids=["not-json", "unknown-type", "tagged-path", "position", "token"],
)
def test_metric_errors_name_the_flag(
    model_args: list[str], metric: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpt2_scripts.analyze import main

    assert main(["--attribution", "a b", "c d", *model_args, "--metric", metric]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gpt2-analyze: error: {says}"), err


def test_a_metric_that_is_not_json_is_refused_before_the_model_loads(
    model_args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpt2_scripts.analyze as cli

    monkeypatch.setattr(cli, "load_from", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["--attribution", "a b", "c d", *model_args, "--metric", "{"]) == 1


def test_a_last_gradient_norm_of_zero_is_a_ratio_not_a_crash() -> None:
    from gpt2_scripts.analyze import highway_table

    from model.lab.gradients import LayerGradient

    def run(*norms: float) -> list[LayerGradient]:
        return [LayerGradient(i - 1, n, None, None) for i, n in enumerate(norms)]

    assert highway_table(run(2.0, 1.0), None).endswith("first / last layer gradient norm: 2 with the skips")
    assert highway_table(run(2.0, 0.0), run(0.0, 0.0)).endswith("norm: inf with the skips, nan without")
