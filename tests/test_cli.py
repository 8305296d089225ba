"""`gpt2-generate` end to end, as a user runs it: a separate process on a local checkpoint.

Each process pays for importing torch, so the runs of one fixture are started together and awaited together.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import SHARED_TOKENIZER, Checkpoint, load_ours, write_byte_tokenizer
from gpt2_scripts.generate import main, parse_args
from safetensors import safe_open
from safetensors.torch import load_file

from model.generate import SamplingParams, generate
from model.hooks import Capture
from model.loading import load
from model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello world"


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


def run_all(commands: dict[str, list[str]]) -> dict[str, Run]:
    """Run `python -m gpt2_scripts.generate ARGS` for each entry, all at once."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "gpt2_scripts.generate", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    runs = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        runs[name] = Run(proc.returncode, stdout, stderr)
    return runs


@pytest.fixture(scope="module")
def runs(tiny: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Run], Path]:
    """Every subprocess run of this file, started together: end to end with the real tokenizer (when its
    files are there), and bad inputs on a copy of the tiny checkpoint that ships a byte-level tokenizer."""
    tmp = tmp_path_factory.mktemp("cli")
    dump = tmp / "acts.safetensors"
    ckpt = Path(shutil.copytree(tiny.path, tmp / "ckpt"))
    write_byte_tokenizer(ckpt)
    model = ["--model", str(ckpt)]
    commands = {
        "bad model path": ["hi", "--model", str(tmp / "no-such-checkpoint")],
        "unknown hook": ["hi", *model, "--dump-activations", str(tmp / "x.safetensors"), "--hooks", "blocks.*.nope"],
        "context overflow": ["hi", *model, "--max-new-tokens", "500"],
        "empty prompt": ["", *model],
    }
    if (SHARED_TOKENIZER / "tokenizer.json").is_file():
        base = [PROMPT, "--model", str(tiny.path), "--tokenizer", str(SHARED_TOKENIZER), "--max-new-tokens", "8"]
        hooks = ["--hooks", "blocks.*.hook_resid_post", "--hooks", "blocks.0.attn.hook_pattern"]
        commands["dump"] = [*base, "--greedy", "--dump-activations", str(dump), *hooks]
        commands["greedy"] = [*base, "--greedy", "--device", "cpu", "--dtype", "float32"]
    return run_all(commands), dump


@pytest.fixture
def e2e(runs: tuple[dict[str, Run], Path], tokenizer_dir: Path) -> tuple[dict[str, Run], Path]:
    """The end-to-end runs (skipped without the real tokenizer files)."""
    return runs


def test_generates_text_after_the_prompt(
    e2e: tuple[dict[str, Run], Path], tiny: Checkpoint, tokenizer: Tokenizer
) -> None:
    runs, _ = e2e
    run = runs["greedy"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(PROMPT) and run.stdout.endswith("\n")
    assert run.stderr.splitlines()[-1] == "[8 tokens, finish reason: length]"
    # the same continuation as the library's greedy generation
    [expected] = generate(load_ours(tiny), [tokenizer.encode(PROMPT)], SamplingParams(max_new_tokens=8, temperature=0))
    assert run.stdout == PROMPT + tokenizer.decode(expected.token_ids) + "\n"


def test_greedy_is_reproducible(e2e: tuple[dict[str, Run], Path]) -> None:
    runs, _ = e2e
    assert runs["dump"].returncode == 0, runs["dump"].stderr
    assert runs["dump"].stdout == runs["greedy"].stdout


def test_dump_activations(e2e: tuple[dict[str, Run], Path], tiny: Checkpoint, tokenizer: Tokenizer) -> None:
    runs, dump = e2e
    run = runs["dump"]
    assert run.returncode == 0, run.stderr
    tensors = load_file(dump)
    with safe_open(str(dump), framework="pt") as f:
        metadata = f.metadata()
    token_ids = json.loads(metadata["token_ids"])
    assert token_ids[:2] == tokenizer.encode(PROMPT) and len(token_ids) == 2 + 8
    assert metadata["model"] == str(tiny.path)
    assert metadata["text"] + "\n" == run.stdout
    assert f"wrote 3 activations over 10 tokens to {dump}" in run.stderr
    assert sorted(tensors) == ["blocks.0.attn.hook_pattern", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    assert tensors["blocks.1.hook_resid_post"].shape == (1, 10, 64)
    assert tensors["blocks.0.attn.hook_pattern"].shape == (1, 4, 10, 10)
    # the activations are those of one forward pass over the tokens
    capture = Capture(list(tensors))
    with torch.no_grad():
        load_ours(tiny)(torch.tensor([token_ids]), hooks=capture)
    for name, t in capture.tensors().items():
        torch.testing.assert_close(tensors[name], t, atol=1e-4, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bad model path", "no checkpoint at"),
        ("unknown hook", "unknown hook 'blocks.*.nope'"),
        ("context overflow", "plus --max-new-tokens (500) exceeds the context of 128 tokens"),
        ("empty prompt", "the prompt is empty"),
    ],
)
def test_bad_input_exits_with_one_line(runs: tuple[dict[str, Run], Path], case: str, message: str) -> None:
    run = runs[0][case]
    assert run.returncode != 0
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("gpt2-generate: error: ") and message in lines[0]


# --- in-process, for the cheap cases ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_with_tokenizer(tiny: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = Path(shutil.copytree(tiny.path, tmp_path_factory.mktemp("cli_in") / "ckpt"))
    write_byte_tokenizer(ckpt)
    return ckpt


def test_hooks_need_a_dump_file(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hi", "--model", str(ckpt_with_tokenizer), "--hooks", "logits"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "gpt2-generate: error: --hooks needs --dump-activations FILE\n"


def test_the_dump_dtype(ckpt_with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dump is float32 whatever the model's dtype, as the server's are (a bfloat16 model's dump was bfloat16,
    which numpy cannot read), or the dtype `--dump-dtype` names; the flag needs a dump file."""
    from model.dump import load_dump

    for model_dtype, dump_dtype, want in [
        ("bfloat16", None, torch.float32),
        ("float32", "float16", torch.float16),
        ("float32", "bfloat16", torch.bfloat16),
    ]:
        dump = tmp_path / f"{model_dtype}-{dump_dtype}.safetensors"
        argv = ["hi", "--model", str(ckpt_with_tokenizer), "--dtype", model_dtype, "--greedy", "--max-new-tokens", "2"]
        argv += ["--dump-activations", str(dump), "--hooks", "blocks.0.hook_resid_post"]
        assert main(argv + (["--dump-dtype", dump_dtype] if dump_dtype else [])) == 0
        tensors, _ = load_dump(dump)
        assert tensors["blocks.0.hook_resid_post"].dtype == want, (model_dtype, dump_dtype)
    capsys.readouterr()
    assert main(["hi", "--model", str(ckpt_with_tokenizer), "--dump-dtype", "float16"]) == 1
    assert capsys.readouterr().err == "gpt2-generate: error: --dump-dtype needs --dump-activations FILE\n"


@pytest.mark.parametrize("renamed", [False, True])
def test_a_signal_as_the_dump_is_written_says_whether_it_was(
    ckpt_with_tokenizer: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    renamed: bool,
) -> None:
    """A Ctrl-C (or SIGTERM) that ends the dump's writing before its rename leaves the old file, and the tool
    says only that it was interrupted; one just after the rename leaves the new file, and the tool says it
    wrote it (it once said "interrupted" alone over a new file)."""
    import gpt2_scripts.generate as cli

    from model.dump import save_dump

    def interrupted(path: str, tensors: dict, metadata: dict) -> None:
        if renamed:
            save_dump(path, tensors, metadata)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "save_dump", interrupted)
    dump = tmp_path / "keep.safetensors"
    dump.write_bytes(b"old")
    argv = ["hi", "--model", str(ckpt_with_tokenizer), "--greedy", "--max-new-tokens", "2", "--ignore-eos"]
    with pytest.raises(KeyboardInterrupt):
        main([*argv, "--dump-activations", str(dump), "--hooks", "blocks.0.hook_resid_post"])
    err = capsys.readouterr().err
    assert (dump.read_bytes() != b"old") == renamed
    assert err == (f"wrote 1 activations over 4 tokens to {dump}\n" if renamed else "")


def test_prompt_from_stdin(
    ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    assert main(["-", "--model", str(ckpt_with_tokenizer), "--greedy", "--max-new-tokens", "3", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("from stdin")
    assert err.splitlines() == ["[3 tokens, finish reason: length]"]


def test_unwritable_dump_file(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["hi", "--model", str(ckpt_with_tokenizer), "--max-new-tokens", "1", "--dump-activations"]
    target = ckpt_with_tokenizer / "missing-dir" / "acts.safetensors"
    assert main([*base, str(target)]) == 1  # refused before loading and generating
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"gpt2-generate: error: cannot write {target}: no directory {target.parent}"]
    assert main([*base, str(ckpt_with_tokenizer)]) == 1  # a directory: found out when writing
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"gpt2-generate: error: cannot write {ckpt_with_tokenizer}: ")


def test_dump_problems_found_before_loading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dump that could not be written, or a hook no GPT-2 has, is found before the model loads (here there is
    no model at all: the error is the dump's or the hook's, not the checkpoint's)."""
    base = ["hi", "--model", str(tmp_path / "no-such-checkpoint"), "--dump-activations"]
    cases = [
        (["-"], "--dump-activations -: a dump is a file (the text goes to standard output); name one"),
        ([str(tmp_path / "x.safetensors"), "--hooks", "blocks.0.hook_resid_pots"], "--hooks: unknown hook 'blocks.0."),
    ]
    ckpt, blobs = tmp_path / "ckpt", tmp_path / "blobs"  # a hub cache's snapshot: links to its blobs
    ckpt.mkdir()
    blobs.mkdir()
    (blobs / "abc").write_bytes(b"weights")
    (ckpt / "model.safetensors").symlink_to(blobs / "abc")
    for where in ("ckpt/model.safetensors", "ckpt"):  # a file of the checkpoint being loaded, or the file loaded
        model = str(tmp_path / where)
        says = f"--dump-activations {ckpt / 'model.safetensors'}: it would replace a file of the checkpoint being"
        cases.append(([str(ckpt / "model.safetensors"), "--model", model], says))
    if Path("/proc/self").is_dir():  # a directory that takes no new file, even for root
        cases.append((["/proc/acts.safetensors"], "cannot write /proc/acts.safetensors: "))
    for args, says in cases:
        assert main([*base, *args]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"gpt2-generate: error: {says}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs", "ckpt"]  # no probe file left behind
    assert (ckpt / "model.safetensors").read_bytes() == b"weights" and not list(blobs.glob(".*"))


def test_a_dump_never_replaces_what_loading_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Beside a bare weights file, loading reads the config.json and tokenizer files of its folder; with
    `--tokenizer DIR`, that folder's tokenizer files (each of GPT-2's three, not only the one our loader
    prefers: another reads the others); with a hub name, files of the hub's cache (through its snapshot's
    links); with `--sae ID=DIR`, that SAE's folder, and with a hub SAE the hub's cache: a dump onto any of
    them is refused before the model loads (it once replaced them, and the same command failed from then on).
    A new file beside them, or another file of the tokenizer's folder, is a dump like any other."""
    from huggingface_hub import constants

    folder, tok, cache, sae = tmp_path / "f", tmp_path / "tok", tmp_path / "hub", tmp_path / "sae"
    for d in (folder, tok, cache / "blobs", cache / "snapshots", sae):
        d.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "vocab.json", "merges.txt", "notes.txt"):
        (folder / name).write_text(name)
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "old-dump.safetensors"):
        (tok / name).write_text(name)
    for name in ("cfg.json", "sae_weights.safetensors"):
        (sae / name).write_text(name)
    linked = tmp_path / "elsewhere.safetensors"
    os.link(sae / "sae_weights.safetensors", linked)
    (cache / "blobs" / "abc").write_text("weights")
    (cache / "snapshots" / "model.safetensors").symlink_to(cache / "blobs" / "abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    weights = str(folder / "model.safetensors")
    refused = [
        ([weights], folder / "config.json", "checkpoint"),
        ([weights], folder / "merges.txt", "checkpoint"),
        ([weights], folder / "vocab.json", "checkpoint"),  # beside the tokenizer.json loading prefers
        ([weights, "--tokenizer", str(tok)], tok / "tokenizer.json", "tokenizer"),
        ([weights, "--tokenizer", str(tok)], tok / "merges.txt", "tokenizer"),
        (["gpt2"], cache / "snapshots" / "model.safetensors", "checkpoint"),
        ([weights, "--sae", f"r={sae}"], sae / "sae_weights.safetensors", "SAE"),
        ([weights, "--sae", f"r={sae}"], sae / "cfg.json", "SAE"),
        ([weights, "--sae", f"r={sae}"], linked, "SAE"),  # a hard link elsewhere to one of its files
        (
            [weights, "--sae", "r=jbloom/GPT2-Small-SAEs-Reformatted/x"],
            cache / "snapshots" / "model.safetensors",
            "SAE",
        ),
    ]
    for model, target, what in refused:
        assert main(["hi", "--model", *model, "--dump-activations", str(target)]) == 1
        out, err = capsys.readouterr()
        loaded = model[0] if what == "checkpoint" else model[-1]
        says = f"gpt2-generate: error: --dump-activations {target}: it would replace a file of the {what} being "
        assert out == "" and err == says + f"loaded ({loaded})\n", err
    for d, names in (
        (folder, ("model.safetensors", "config.json", "tokenizer.json", "vocab.json", "merges.txt")),
        (tok, ("tokenizer.json", "vocab.json", "merges.txt")),
        (sae, ("cfg.json", "sae_weights.safetensors")),
    ):
        assert all((d / name).read_text() == name for name in names)
    assert (cache / "blobs" / "abc").read_text() == "weights"
    for model, target in (
        ([weights], folder / "notes.txt"),
        ([weights, "--tokenizer", str(tok)], tok / "old-dump.safetensors"),
    ):
        assert main(["hi", "--model", *model, "--dump-activations", str(target)]) == 1  # the file is no checkpoint
        err = capsys.readouterr().err
        assert "it would replace" not in err and err.startswith("gpt2-generate: error: "), err


def test_bad_dtype(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error (status 2), as gpt2-serve's: the name is wrong whatever the checkpoint."""
    with pytest.raises(SystemExit) as exit_info:
        main(["hi", "--model", str(ckpt_with_tokenizer), "--dtype", "int4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(
        "gpt2-generate: error: argument --dtype: unknown dtype 'int4'; use auto, float32, float16, bfloat16 or int8\n"
    )


def test_a_flag_takes_any_number(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """-1e-3 and -inf are numbers, as the API reads them: argparse took them for flags it did not know and said
    "expected one argument"."""
    args = parse_args(["hi", "--presence-penalty", "-1e-3", "--frequency-penalty", "-.5", "--temperature", "-2E1"])
    assert (args.presence_penalty, args.frequency_penalty, args.temperature) == (-0.001, -0.5, -20.0)
    assert parse_args(["-5e3", "--seed", "-1"]).prompt == "-5e3"  # a prompt too
    assert parse_args(["hi", "--logit-bias", "-5=1"]).logit_bias == [("-5", 1.0)]  # refused later, as the API's key
    assert main(["hi", "--model", str(ckpt_with_tokenizer), "--frequency-penalty", "-inf"]) == 1
    err = capsys.readouterr().err
    assert err == "gpt2-generate: error: --frequency-penalty must be a number in [-2, 2], got -inf\n"
    with pytest.raises(SystemExit) as exit_info:  # a word that is no number is still an unknown flag
        parse_args(["hi", "--presence-penalty", "-x"])
    assert exit_info.value.code == 2
    assert "argument --presence-penalty: expected one argument" in capsys.readouterr().err


def test_bad_top_p(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hi", "--model", str(ckpt_with_tokenizer), "--top-p", "1.5"]) == 1
    assert capsys.readouterr().err == "gpt2-generate: error: --top-p must be a number in [0, 1], got 1.5\n"


def test_show_logprobs(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["hi", "--model", str(ckpt_with_tokenizer), "--seed", "7", "--max-new-tokens", "4", "--ignore-eos"]
    assert main([*args, "--show-logprobs", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hi")
    table = out.split("\ntoken\tlogprob\talternatives\n")[1].splitlines()
    assert len(table) == 4
    for line in table:
        token, logprob, alternatives = line.split("\t")
        assert token.startswith(("'", '"')) and float(logprob) <= 0
        assert len(alternatives.split("  ")) == 3
    assert main([*args, "--show-logprobs", "0"]) == 0  # each token's own log-probability, no alternatives column
    table = capsys.readouterr().out.split("\ntoken\tlogprob\n")[1].splitlines()
    assert len(table) == 4 and all(len(line.split("\t")) == 2 and float(line.split("\t")[1]) <= 0 for line in table)
    # seeded sampling is reproducible
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_prompt_that_is_not_valid_utf8(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # bytes that are not UTF-8 on the command line reach Python as lone surrogates (surrogateescape)
    assert main([b"\xff hi".decode("utf-8", "surrogateescape"), "--model", str(ckpt_with_tokenizer)]) == 1
    err = capsys.readouterr().err
    assert err == "gpt2-generate: error: the prompt is not valid UTF-8: it holds the byte 0xFF at character 0\n"
    # nor a stop string, which could never match the text (it was taken silently)
    bad = b"x\xfe".decode("utf-8", "surrogateescape")
    assert main(["hi", "--model", str(ckpt_with_tokenizer), "--stop", "a", "--stop", bad]) == 1
    err = capsys.readouterr().err
    assert err == "gpt2-generate: error: --stop number 2 is not valid UTF-8: it holds the byte 0xFE at character 1\n"
    assert main(["hi", "--model", str(ckpt_with_tokenizer), "--stop", "a", "--stop", ""]) == 1  # named as the flag
    assert capsys.readouterr().err == "gpt2-generate: error: --stop number 2 must be a non-empty string, got ''\n"


def test_unavailable_device(
    ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for device, says in [("cuda", "CUDA is not available here"), ("mps", "MPS is not available here")]:
        assert main(["hi", "--model", str(ckpt_with_tokenizer), "--device", device]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"gpt2-generate: error: device '{device}': {says}") and err.count("\n") == 1


def test_prompt_from_stdin_that_is_not_utf8(
    ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    # a UTF-8 locale reads standard input strictly: the bytes must not reach Python's decoder as a traceback
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9"), encoding="utf-8", errors="strict"))
    assert main(["--model", str(ckpt_with_tokenizer)]) == 1
    err = capsys.readouterr().err
    assert err == "gpt2-generate: error: the prompt is not valid UTF-8: it holds the byte 0xE9 at character 3\n"


def test_a_torch_device_this_project_does_not_run_on(
    ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for device in ("meta", "xpu"):  # torch knows the names; loading or sampling there would crash
        with pytest.raises(SystemExit) as exit_info:
            main(["hi", "--model", str(ckpt_with_tokenizer), "--device", device])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.endswith(
            f"gpt2-generate: error: argument --device: unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps\n"
        )


def test_greedy_and_temperature_conflict(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["hi", "--model", str(ckpt_with_tokenizer), "--greedy", "--temperature", "0.8"])
    assert exit_info.value.code == 2
    assert "--greedy and --temperature conflict" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--greedy", "--top-k", "5"], "--top-k narrows sampling, and --greedy samples nothing"),
        (["--temperature", "0", "--top-p", "0.9"], "--top-p narrows sampling, and --temperature 0 samples nothing"),
        (["--greedy", "--top-k", "3", "--top-p", "0.5"], "--top-k and --top-p narrow sampling, and --greedy"),
        (["--greedy", "--min-p", "0.1"], "--min-p narrows sampling, and --greedy samples nothing"),
    ],
)
def test_greedy_with_top_k_or_top_p_is_refused(
    ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    """Greedy takes the most likely token, so a top-k or top-p beside it would be ignored: said, not ignored."""
    with pytest.raises(SystemExit) as exit_info:
        main(["hi", "--model", str(ckpt_with_tokenizer), *flags])
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err
    # the values that narrow nothing (as a script that always passes them would) are taken
    args = parse_args(["hi", "--greedy", "--top-k", "0", "--top-p", "1", "--seed", "3"])
    assert (args.top_k, args.top_p, args.seed) == (0, 1.0, 3)
    assert parse_args(["hi", "--greedy", "--top-k", "-1"]).top_k == -1  # vLLM's "no limit"
    assert parse_args(["hi", "--greedy", "--top-k", "1", "--min-p", "0"]).top_k == 1  # greedy's own top-k


def test_penalties_and_logit_bias(ckpt_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The biases and penalties of the API as flags: the text `generate` gives with the same settings."""
    loaded = load(ckpt_with_tokenizer)
    ids = loaded.tokenizer.encode("The quick brown fox")
    settings = {"repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    want = generate(
        loaded.model,
        [ids],
        SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logit_bias={11: 3.0, 13: -100}, **settings),
        loaded.tokenizer,
    )[0]
    flags = ["--repetition-penalty", "1.4", "--presence-penalty", "0.5", "--frequency-penalty", "0.25"]
    flags += ["--logit-bias", "11=3", "--logit-bias", "13=-100"]
    common = ["The quick brown fox", "--model", str(ckpt_with_tokenizer), "--greedy", "--max-new-tokens", "6"]
    assert main([*common, "--ignore-eos", *flags]) == 0
    assert capsys.readouterr().out == "The quick brown fox" + want.text + "\n"
    assert main([*common, "--presence-penalty", "3"]) == 1
    assert capsys.readouterr().err == "gpt2-generate: error: --presence-penalty must be a number in [-2, 2], got 3.0\n"
    assert main([*common, "--logit-bias", "50257=1"]) == 1
    err = capsys.readouterr().err
    assert (
        err == "gpt2-generate: error: --logit-bias: token id 50257 is outside the vocabulary (0..256)\n"
    )  # the tokenizer's
    for bad in ("11", "11=big", "5=1e", "5=.", "5=", "=1"):  # not ID=BIAS: a usage error
        with pytest.raises(SystemExit):
            parse_args(["hi", "--logit-bias", bad])
        assert "expected ID=BIAS" in capsys.readouterr().err, bad
    assert parse_args(["hi", "--logit-bias", "5=-1.5e1", "--logit-bias", "6=.5"]).logit_bias == [
        ("5", -15.0),
        ("6", 0.5),
    ]
    for bad, said in [  # an id the API's keys would not be, or a bias out of range: said as the API says it
        ("x=1", "a token id must be a decimal integer, got 'x'"),
        ("+5=1", "a token id must be a decimal integer, got '+5'"),
        ("\u0665=1", "a token id must be a decimal integer, got '\u0665'"),
        (" 5=1", "a token id must be a decimal integer, got ' 5'"),
        ("5=nan", "the bias of token 5 must be a number in [-100, 100], got nan"),
        ("00000000000000000000050257=1", "token id 50257 is outside the vocabulary (0..256)"),  # zeros are fine
        ("10000000000000000000=1", "token id '10000000000000000000' is past any vocabulary"),
        ("0" * 4300 + "50257=1", "token id 50257 is outside the vocabulary (0..256)"),  # past int()'s 4,300 digits
    ]:
        assert main([*common, "--logit-bias", bad]) == 1
        assert capsys.readouterr().err == f"gpt2-generate: error: --logit-bias: {said}\n", bad
    assert main([*common, "--logit-bias", "11=1", "--logit-bias", "011=2"]) == 1
    assert capsys.readouterr().err == "gpt2-generate: error: --logit-bias: token 11 is given twice\n"


def test_dump_onto_something_not_a_regular_file(
    ckpt_with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # safetensors writes a temporary file and renames it over the target: a device or a pipe would be replaced
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    args = ["hi", "--model", str(ckpt_with_tokenizer), "--max-new-tokens", "1", "--hooks", "logits"]
    assert main([*args, "--dump-activations", str(fifo)]) == 1
    assert capsys.readouterr().err == f"gpt2-generate: error: cannot write {fifo}: it is not a regular file\n"
    assert fifo.is_fifo()
    loop = tmp_path / "loop.safetensors"  # a symlink to itself: refused before the work, not a traceback after
    loop.symlink_to(loop)
    assert main([*args, "--dump-activations", str(loop)]) == 1
    assert f"cannot write {loop}: " in capsys.readouterr().err
    dangling = tmp_path / "dangling.safetensors"  # into a folder that is not there
    dangling.symlink_to(tmp_path / "missing" / "x.safetensors")
    assert main([*args, "--dump-activations", str(dangling)]) == 1
    assert "in no directory" in capsys.readouterr().err


def test_dump_through_a_symlink_with_the_umasks_mode(
    ckpt_with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real, link = tmp_path / "real.safetensors", tmp_path / "link.safetensors"
    link.symlink_to(real)
    args = ["hi", "--model", str(ckpt_with_tokenizer), "--max-new-tokens", "1", "--hooks", "logits"]
    old = os.umask(0o022)
    try:
        assert main([*args, "--dump-activations", str(link)]) == 0, capsys.readouterr().err
    finally:
        os.umask(old)
    assert link.is_symlink() and sorted(load_file(link)) == ["logits"]
    assert real.stat().st_mode & 0o777 == 0o644  # not the temporary file's 0600


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("tool", ["generate", "analyze", "harvest"])
def test_ctrl_c_or_sigterm_ends_the_tool_by_its_signal_without_a_traceback(
    tool: str, stop: signal.Signals, ckpt_with_tokenizer: Path, tmp_path
) -> None:
    """One line on stderr, then the process dies of SIGINT, as Python's own handling ends it (so that a shell
    loop running the tool stops: bash carries on after a child that exits 130). When the signal comes,
    generate and analyze wait on standard input for the prompt, harvest in its job (made to wait here).
    SIGTERM (kill, timeout, docker stop) the same, the process then dying of SIGTERM."""
    model = ["--model", str(ckpt_with_tokenizer)]
    args, wait = model, ""
    if tool == "harvest":
        (tmp_path / "docs.txt").write_text("some text")
        args = [str(tmp_path / "docs.txt"), *model, "--hooks", "hook_embed", "--out", str(tmp_path / "acts")]
        wait = "import time; cli.run_harvest = lambda *a, **k: time.sleep(60); "
    code = (
        f"import sys; sys.argv = ['gpt2-{tool}', *{args!r}]; import gpt2_scripts.{tool} as cli; {wait}"
        f"import gpt2_scripts.console as c; print('ready', flush=True); c.{tool}()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(1.0)  # into main(), waiting on standard input
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -stop, err
    assert f"gpt2-{tool}: interrupted" in err and "Traceback" not in err, err


def test_a_second_ctrl_c_during_the_clean_up_ends_the_tool_at_once(ckpt_with_tokenizer: Path, tmp_path) -> None:
    """The first Ctrl-C unwinds the job, closing a generator whose clean-up takes 30 s here (then notes that it
    finished); a second one then ends the process by SIGINT at once, where it broke into that clean-up
    ("Exception ignored in <generator ...>" and a traceback on stderr)."""
    (tmp_path / "docs.txt").write_text("some text")
    args = [str(tmp_path / "docs.txt"), "--model", str(ckpt_with_tokenizer), "--hooks", "hook_embed"]
    args += ["--out", str(tmp_path / "acts")]
    job = (
        "import time, pathlib\n"
        "def text():\n"
        "    try:\n"
        "        yield 1\n"
        "    finally:\n"
        "        time.sleep(30)\n"
        f"        pathlib.Path({str(tmp_path / 'cleaned')!r}).touch()\n"
        "def run(*a, **k):\n"
        "    for _ in text():  # unwound out of the loop, the generator is closed at once\n"
        "        time.sleep(60)\n"
    )
    code = (
        f"import sys; sys.argv = ['gpt2-harvest', *{args!r}]; import gpt2_scripts.harvest as cli\n{job}"
        "cli.run_harvest = run; import gpt2_scripts.console as c; print('ready', flush=True); c.harvest()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(1.0)  # in the job
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # in the generator's clean-up
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert not (tmp_path / "cleaned").exists()  # ended at the second signal, not after the clean-up


@pytest.mark.parametrize("start", ["command", "script"])
@pytest.mark.parametrize("tool", ["generate", "analyze", "harvest"])
def test_ctrl_c_while_the_tool_still_imports_is_one_line(tool: str, start: str) -> None:
    """The installed commands (`gpt2_scripts.console`) import their module inside `run_console`, so a Ctrl-C
    during the first second, while torch is being imported, is the same one line (it was a traceback), given
    once the import is over (an import cut midway could abort the process: a C++ terminate inside torch). The
    import is made to take 3 s here. `python scripts/<tool>.py` starts the same way (its own imports gave the
    traceback), and is the same program."""
    script = Path(__file__).resolve().parents[1] / "scripts" / f"{tool}.py"
    run = {
        "command": f"sys.argv = ['gpt2-{tool}']; import gpt2_scripts.console as c; run = c.{tool}",
        "script": f"sys.argv = [{str(script)!r}]; run = lambda: runpy.run_path({str(script)!r}, run_name='__main__')",
    }[start]
    code = (
        f"import sys, time, importlib, runpy; {run}; "
        "importlib.import_module = lambda name: [time.sleep(0.1) for _ in range(30)]; "
        "print('ready', flush=True); run()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(0.5)  # inside the (hanging) import
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, err
    # harvest's line says how to go on, as `python scripts/harvest.py`'s does (the installed command's did not)
    hint = "; run it again with the same arguments to resume" if tool == "harvest" else ""
    assert err.strip() == f"gpt2-{tool}: interrupted{hint}", err
    if start == "script":
        usage = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert usage.returncode == 0 and usage.stdout.startswith(f"usage: gpt2-{tool}"), usage


def test_an_interrupt_is_held_until_the_block_is_over() -> None:
    """`held_interrupt`: the block runs to its end through a SIGINT, which is raised after it."""
    import os

    from gpt2_scripts.console import held_interrupt

    finished, before = False, signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), held_interrupt():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # a signal handler runs here: it only takes note
        finished = True
    assert finished and signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # started with SIGINT ignored (nohup): it stays ignored
    try:
        with held_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_once_the_work_is_done_ends_the_tool_by_it_without_a_line(stop: signal.Signals) -> None:
    """A Ctrl-C (or SIGTERM) that comes after the work, the output whole, as the interpreter exits: the tool
    ends by its signal at once, saying nothing (a Ctrl-C raised a KeyboardInterrupt there, a traceback from
    an exit handler, "Exception ignored in atexit callback", and status 0)."""
    code = (
        "import atexit, os, time\n"
        "from gpt2_scripts.console import run_console\n"
        "def main():\n"
        f"    atexit.register(lambda: (os.kill(os.getpid(), {int(stop)}), time.sleep(1)))\n"
        "    print('the output', flush=True)\n"
        "    return 0\n"
        "run_console(main, 'tool: interrupted')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (-stop, "the output\n", "")


# --- where the output cannot go ---------------------------------------------------------------


def generate_command(ckpt: Path, *rest: str) -> list[str]:
    code = "import sys; from gpt2_scripts.console import generate; sys.argv[0] = 'gpt2-generate'; generate()"
    return [sys.executable, "-c", code, *rest, "--model", str(ckpt)]


def test_a_reader_that_goes_away_ends_the_tool_by_sigpipe(ckpt_with_tokenizer: Path) -> None:
    """`gpt2-generate ... | head -c 3`: the tool ends silently, by SIGPIPE, as `cat` does (it printed a
    BrokenPipeError traceback), whether the pipe broke before the text or during it (or its logprobs table)."""
    read, write = os.pipe()
    os.close(read)  # gone before the first byte: deterministic
    try:
        done = subprocess.run(
            generate_command(ckpt_with_tokenizer, "hello", "--max-new-tokens", "3"),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == -signal.SIGPIPE and done.stderr == "", done.stderr
    for extra in (["--max-new-tokens", "120"], ["--max-new-tokens", "60", "--show-logprobs", "3"]):
        command = generate_command(ckpt_with_tokenizer, "hello", "--greedy", "--ignore-eos", *extra)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.read(3)
        proc.stdout.close()  # the reader goes away, most likely while the tool still writes
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) in (-signal.SIGPIPE, 0), err  # 0: it had written everything already
        assert "Traceback" not in err and "Error" not in err, err


@pytest.mark.parametrize(
    ("closed", "says"),
    [
        ("stdout", "standard output is closed: nowhere to write the text"),
        ("stdin", "no prompt: standard input is closed; give the prompt as an argument"),
        ("full", "cannot write the text: No space left on device"),
    ],
)
def test_a_closed_or_full_output_or_input_is_one_line(ckpt_with_tokenizer: Path, closed: str, says: str) -> None:
    """`>&-`, `<&-` (no prompt given) and `> /dev/full`: one line on stderr, status 1 (tracebacks before)."""
    args = [] if closed == "stdin" else ["hello", "--max-new-tokens", "3"]
    command = generate_command(ckpt_with_tokenizer, *args)
    if closed == "full":
        if not Path("/dev/full").exists():
            pytest.skip("no /dev/full on this system")
        with open("/dev/full", "w") as full:
            done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    else:
        fd = 1 if closed == "stdout" else 0
        done = subprocess.run(command, stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(fd))
    assert done.returncode == 1 and done.stderr == f"gpt2-generate: error: {says}\n", done.stderr
