"""What a harvest's output folder holds it to: the tokenizer it started with (its files' sha256, recorded in
the manifest, so a tokenizer edited in place is refused on resume)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from model.harvest import MANIFEST, HarvestError, harvest
from model.tokenizer import Tokenizer

HOOKS = ["blocks.0.hook_resid_pre"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "from", "home", "."]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rnd = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    docs = (" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, 60))) for _ in range(80))
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def options(tokenizer: Path) -> dict[str, Any]:
    return {"tokenizer": str(tokenizer), "device": "cpu", "context_size": 16, "shard_size": 4, "max_tokens": 16 * 14}


def tree_shas(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


# --- the tokenizer's identity ------------------------------------------------------------------


def drop_first_merge(tok_dir: Path) -> None:
    """Edit the tokenizer in place as someone might: its first merge ("Ġ t") removed."""
    if (tok_dir / "tokenizer.json").is_file():
        data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
        data["model"]["merges"] = data["model"]["merges"][1:]
        (tok_dir / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    else:
        lines = (tok_dir / "merges.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        (tok_dir / "merges.txt").write_text("".join([lines[0], *lines[2:]]), encoding="utf-8")


@pytest.mark.parametrize("files", [("tokenizer.json",), ("vocab.json", "merges.txt")])
def test_resume_refuses_a_tokenizer_edited_in_place(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, files: tuple[str, ...]
) -> None:
    """The same tokenizer folder with other files tokenizes otherwise: refused, naming the file, before any
    shard is written; the files touched (same bytes) are still the job's tokenizer."""
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for name in files:
        shutil.copy(tokenizer_dir / name, tok / name)
    out = tmp_path / "acts"
    harvest(tiny.path, source, out, HOOKS, **options(tok))
    recorded = json.loads((out / MANIFEST).read_text())["job"]["tokenizer_files"]
    assert [f["name"] for f in recorded] == list(files)
    (out / "acts-00002.safetensors").unlink()  # a shard the resume would compute
    before = tree_shas(out)

    text = " the cat sat on the mat"
    original = Tokenizer.from_dir(tok).encode(text)
    drop_first_merge(tok)
    assert Tokenizer.from_dir(tok).encode(text) != original  # the edit does change the shards' tokens
    with pytest.raises(HarvestError, match=rf"other arguments \(tokenizer_files: {files[-1]} changed\): "):
        harvest(tiny.path, source, out, HOOKS, **options(tok))
    assert tree_shas(out) == before

    for name in files:
        shutil.copy(tokenizer_dir / name, tok / name)
        os.utime(tok / name, ns=(1, 1))
    assert harvest(tiny.path, source, out, HOOKS, **options(tok)).complete
    assert "acts-00002.safetensors" in tree_shas(out)


def test_a_version_2_manifest_resumes_and_records_the_tokenizer(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job started by the previous gpt2-harvest (manifest version 2, no tokenizer recorded) is not lost:
    it resumes, with a warning, and the tokenizer's identity is recorded from then on."""
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    shutil.copy(tokenizer_dir / "tokenizer.json", tok)
    out = tmp_path / "acts"
    harvest(tiny.path, source, out, HOOKS, **options(tok))
    whole = tree_shas(out)
    saved = json.loads((out / MANIFEST).read_text())
    identity = saved["job"].pop("tokenizer_files")
    saved |= {"version": 2, "complete": False, "n_contexts": None, "n_tokens": None, "shards": saved["shards"][:2]}
    (out / MANIFEST).write_text(json.dumps(saved))
    for name in ("acts-00002.safetensors", "acts-00003.safetensors"):
        (out / name).unlink()

    with pytest.raises(HarvestError, match=r"other arguments \(batch_size: 32 there, 8 now\)"):
        harvest(tiny.path, source, out, HOOKS, **options(tok), batch_size=8)  # the rest is still checked
    with caplog.at_level(logging.WARNING, logger="model.harvest.shards"):
        assert harvest(tiny.path, source, out, HOOKS, **options(tok)).complete
    assert "did not record its tokenizer" in caplog.text
    assert tree_shas(out) == whole  # the same files as an uninterrupted run, manifest included
    assert json.loads((out / MANIFEST).read_text())["job"]["tokenizer_files"] == identity

    (out / "acts-00003.safetensors").unlink()
    drop_first_merge(tok)
    with pytest.raises(HarvestError, match=r"tokenizer_files: tokenizer\.json changed"):
        harvest(tiny.path, source, out, HOOKS, **options(tok))
