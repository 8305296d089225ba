"""The harvest pipeline in process: packing as SAELens packs, the text sources, shard values against
transformers, SAELens' cached format read back by SAELens, resuming (kill -9 included), and the errors."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from model.harvest import MANIFEST, HarvestError, harvest, open_source, pack
from model.harvest.job import HarvestSpec, open_job
from model.harvest.text import Source, tokenize
from model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
EOT_ID = 50256
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "from", "home", ",", ".", "and"]


def write_jsonl(path: Path, n_docs: int, seed: int = 0, max_words: int = 60) -> list[str]:
    rnd = random.Random(seed)
    docs = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, max_words))) for _ in range(n_docs)]
    docs[3] = "<|endoftext|> a document that opens with the separator"
    docs[5] = ""  # an empty document adds nothing
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return docs


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_shas(directory: Path) -> dict[str, str]:
    return {p.name: file_sha(p) for p in sorted(directory.iterdir())}


# --- packing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prepend_bos", [True, False])
def test_pack_is_saelens_packing(prepend_bos: bool) -> None:
    from sae_lens.tokenization_and_batching import concat_and_batch_sequences

    rnd = random.Random(1)
    for trial in range(60):
        docs = []
        for _ in range(rnd.randint(0, 12)):
            doc = [rnd.randint(0, 20) for _ in range(rnd.choice([0, 1, 2, 3, 7, 30]))]
            if doc and rnd.random() < 0.3:
                doc[0] = EOT_ID  # a document that opens with the separator gets none added
            docs.append(doc)
        context = rnd.randint(2, 9)
        bos = EOT_ID if prepend_bos else None
        ours = list(pack([(d, True) for d in docs], context, bos, EOT_ID))
        # the same documents in pieces (as `tokenize` gives a long one) pack the same
        pieces = []
        for d in docs:
            cuts = sorted(rnd.sample(range(1, len(d)), rnd.randint(0, len(d) - 1))) if len(d) > 1 else []
            pieces += [(d[a:b], a == 0) for a, b in zip([0, *cuts], [*cuts, len(d)], strict=True)]
        assert list(pack(pieces, context, bos, EOT_ID)) == ours, (trial, pieces, context)
        theirs = concat_and_batch_sequences(
            iter(torch.tensor(d, dtype=torch.long) for d in docs),
            context,
            begin_batch_token_id=bos,
            sequence_separator_token_id=EOT_ID,
        )
        assert ours == [t.tolist() for t in theirs], (trial, docs, context)


def test_pack_refuses_a_context_the_bos_fills() -> None:
    with pytest.raises(HarvestError, match="context size 1"):
        list(pack([([1, 2, 3], True)], 1, EOT_ID, EOT_ID))


# --- sources -----------------------------------------------------------------------------------


def texts(source: Source) -> list[str]:
    return ["".join(parts) for parts in source.documents()]


def test_sources_read_in_order(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_text("first file, one document\nwith two lines", encoding="utf-8")
    (folder / "b" / "c.jsonl").write_text('{"body": "second"}\n\n{"body": "third"}\n', encoding="utf-8")
    pq.write_table(pa.table({"body": ["fourth", "fifth"]}), folder / "b" / "d.parquet")
    (folder / ".hidden.txt").write_text("skipped", encoding="utf-8")
    (folder / "notes.md").write_text("not a source", encoding="utf-8")
    expected = ["first file, one document\nwith two lines", "second", "third", "fourth", "fifth"]
    assert texts(open_source(folder, "body")) == expected  # path order, hidden and other files skipped

    ds_dir = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": ["x", "y"], "n": [1, 2]}).save_to_disk(str(ds_dir))
    assert texts(open_source(ds_dir)) == ["x", "y"]
    dict_dir = tmp_path / "hf_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t"]})}).save_to_disk(str(dict_dir))
    assert texts(open_source(dict_dir)) == ["t"]


@pytest.mark.parametrize(
    ("name", "content", "field", "message"),
    [
        ("x.jsonl", '{"text": "ok"}\nnot json\n', "text", r"x\.jsonl line 2: not a JSON object"),
        ("x.jsonl", '{"body": "ok"}\n', "text", r"x\.jsonl line 1: no text field 'text'; its fields are \['body'\]"),
        ("x.jsonl", '{"text": 3}\n', "text", r"line 1: 'text' is a int, expected text"),
        ("x.jsonl", "[1, 2]\n", "text", r"line 1: a JSON list"),
        ("x.jsonl", '{"text": "a\\ud800b"}\n', "text", r"x\.jsonl line 1: 'text' is not valid Unicode"),
        (
            "x.jsonl",
            '{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
            "text",
            "line 1: .*nested too deeply",
        ),
        ("x.jsonl", '{"text": "a", "n": ' + "1" * 5000 + "}\n", "text", r"line 1: not a JSON object \(Exceeds"),
        ("x.parquet", "PAR? no", "text", r"x\.parquet: not a parquet file"),
        ("x.txt", b"\xff\xfe bad", "text", r"x\.txt: not UTF-8 text"),
        ("x.csv", "a,b", "text", r"cannot read \.csv; valid: \.txt, \.jsonl, \.parquet"),
    ],
)
def test_source_errors_name_the_file(tmp_path: Path, name: str, content: str | bytes, field: str, message: str) -> None:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(HarvestError, match=message):
        texts(open_source(path, field))


def test_a_txt_file_reads_as_read_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .txt file is read in blocks (here of 7 bytes, so characters and CRLFs fall across them): the text
    is what `Path.read_text` gives (newlines made \\n), and a bad byte is named by its place in the file."""
    from model.harvest import text

    monkeypatch.setattr(text, "_TXT_BLOCK", 7)
    path = tmp_path / "doc.txt"
    raw = "\ufeffone\r\ntwo\rthree\n\u00e9t\u00e9 \u65e5\u672c\U0001f600 end\r".encode()
    for block_end in range(1, 8):  # a CRLF, and each multi-byte character, cut at every place
        path.write_bytes(b"x" * block_end + raw)
        assert texts(open_source(path)) == [path.read_text(encoding="utf-8")]
    path.write_bytes(raw)  # a byte order mark at the start is text, as read_text and datasets' text loader keep it
    assert texts(open_source(path)) == [raw.decode().replace("\r\n", "\n").replace("\r", "\n")]
    path.write_bytes(b"ab\xc3\xa9cd\xe6\x97\xa5\xe6\x97")  # a character cut short by the end of the file
    with pytest.raises(HarvestError, match=r"doc\.txt: not UTF-8 text \(byte 9\): unexpected end of data"):
        texts(open_source(path))
    path.write_bytes("\u00e9".encode() * 10 + b"\xff")
    with pytest.raises(HarvestError, match=r"not UTF-8 text \(byte 20\): invalid start byte"):
        texts(open_source(path))


def test_long_documents_tokenize_in_pieces(
    tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document longer than a piece is tokenized in pieces cut where `Tokenizer.cut` allows, read a block
    at a time from a .txt file: the pieces' ids are the whole document's, and only the first opens it."""
    from model.harvest import text
    from tests.test_tokenizer import CUT_POOL

    monkeypatch.setattr(text, "_TXT_BLOCK", 61)
    monkeypatch.setattr(text, "_PIECE_CHARS", 40)
    monkeypatch.setattr(text, "_CHARS_PER_ENCODE", 300)
    rnd = random.Random(3)
    long_doc = "".join(rnd.choice(CUT_POOL) for _ in range(3000))
    docs = [long_doc, "short one", "", "y" * 500 + " then words after a run with no cut", "z" * 700, " a" * 300]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(long_doc, encoding="utf-8", newline="")
    rows = "".join(json.dumps({"text": d}) + "\n" for d in docs[1:])
    (tmp_path / "corpus" / "b.jsonl").write_text(rows, encoding="utf-8")
    long_doc = long_doc.replace("\r\n", "\n").replace("\r", "\n")  # as read_text reads the file
    docs[0] = long_doc
    pieces = list(tokenize(open_source(tmp_path / "corpus").documents(), tokenizer))
    by_doc: list[list[list[int]]] = []
    for ids, opens in pieces:
        if opens:
            by_doc.append([])
        by_doc[-1].append(ids)
    nonempty = [d for d in docs if d]
    assert [[i for ids in p for i in ids] for p in by_doc] == [tokenizer.encode(d) for d in nonempty]
    assert len(by_doc[0]) > len(long_doc) // 100  # in pieces of about 40 characters ...
    assert [len(p) for p in by_doc[1:]] == [1, 2, 1, 15]  # ... where a cut can be found
    # a cut at the seam of two parts, one of them a single space
    assert list(text._pieces(iter(["x" * 100, " ", "y" * 100]), tokenizer)) == ["x" * 100, " " + "y" * 100]
    # a datasets directory's rows too
    import datasets

    datasets.Dataset.from_dict({"text": [" a" * 100, "b"]}).save_to_disk(str(tmp_path / "ds"))
    rows = list(tokenize(open_source(tmp_path / "ds").documents(), tokenizer))
    assert [opens for _, opens in rows] == [True, False, False, False, False, True]


def test_a_file_changed_while_it_is_read_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's manifest names each file by the sha256 it had when the job began; a file read a block at a
    time (a .txt), a line at a time (a .jsonl) or a row group at a time (a .parquet) that changed by the end
    of its reading would have given contexts of neither text: refused, as a resume would be."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from model.harvest import text

    monkeypatch.setattr(text, "_TXT_BLOCK", 8)
    doc = tmp_path / "doc.txt"
    doc.write_text("one two three four five six", encoding="utf-8")
    source = open_source(doc)
    began = source.describe()
    assert texts(source) == ["one two three four five six"]  # no `began`: not checked
    (parts,) = list(source.documents(began))
    blocks = iter(parts)
    assert next(blocks) == "one two "
    with doc.open("a", encoding="utf-8") as f:  # appended to after its first block was read
        f.write(" seven")
    with pytest.raises(HarvestError, match=r"doc\.txt changed while the job read it, so its contexts could mix"):
        list(blocks)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n{"text": "b"}\n', encoding="utf-8")
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), table)
    for path, change in [(rows, lambda: rows.write_text('{"text": "a"}\n{"text": "c"}\n')), (table, None)]:
        source = open_source(path)
        began = source.describe()
        assert ["".join(d) for d in source.documents(began)] == ["a", "b"]  # unchanged: read as it is
        if change is None:
            pq.write_table(pa.table({"text": ["a", "c"]}), table)
        else:
            change()
        with pytest.raises(HarvestError, match=f"{path.name} changed while the job read it"):
            [list(d) for d in source.documents(began)]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    began = open_source(folder).describe()
    (folder / "b.txt").write_text("b")  # a file added since: the manifest would not name it
    with pytest.raises(HarvestError, match=r"the files in .*folder changed since the job began"):
        [list(d) for d in open_source(folder).documents(began)]


def test_a_txt_file_that_is_not_utf8_is_refused_before_any_work(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Its bytes are checked as the job takes its sha256, before the first shard: a bad byte at the end of a
    long file once let the job write the shards of everything before it, then fail on every resume."""
    doc = tmp_path / "doc.txt"
    doc.write_bytes(b"the cat sat on the mat. " * 2000 + b"\xe4\xb8")
    with pytest.raises(HarvestError, match=r"doc\.txt: not UTF-8 text \(byte 48000\): unexpected end of data"):
        open_source(doc).describe()
    out = tmp_path / "acts"
    with pytest.raises(HarvestError, match=r"not UTF-8 text \(byte 48000\)"):
        harvest(tiny.path, doc, out, ["blocks.0.hook_resid_pre"], tokenizer=str(tokenizer_dir), device="cpu")
    assert not out.exists()


def test_parquet_missing_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "x.parquet")
    with pytest.raises(HarvestError, match=r"no text column 'text'; its columns are \['body'\]"):
        texts(open_source(tmp_path / "x.parquet"))


def test_a_damaged_parquet_page_names_the_file_and_row(tmp_path: Path) -> None:
    """A page damaged inside the file (its footer whole: the file opens) is found only as its rows are read: named
    as the file's damage, not as the output folder's (pyarrow's OSError once reached the CLI without a name)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(300)]}), path, row_group_size=100)
    raw = bytearray(path.read_bytes())
    first = raw.index(b"document 100")  # the second row group's first page of text
    raw[first - 40 : first + 400] = bytes(440)
    path.write_bytes(bytes(raw))
    with pytest.raises(HarvestError, match=r"x\.parquet: a damaged parquet file, its rows from \d+ on unreadable") as e:
        texts(open_source(path))
    assert "\n" not in str(e.value)


def test_a_datasets_folder_with_a_bad_state_file(tmp_path: Path) -> None:
    (tmp_path / "dataset_info.json").write_text("{}")
    for content, says in [("garbage", "is not valid JSON"), ("[1]", "state.json holds a JSON list")]:
        (tmp_path / "state.json").write_text(content)
        with pytest.raises(HarvestError, match=f"not a readable Hugging Face datasets directory .*{says}"):
            open_source(tmp_path).describe()


def test_missing_and_empty_sources(tmp_path: Path) -> None:
    with pytest.raises(HarvestError, match="no text source at"):
        open_source(tmp_path / "nothing.jsonl")
    with pytest.raises(HarvestError, match=r"holds no \.txt, \.jsonl, \.parquet files"):
        open_source(tmp_path)
    with pytest.raises(HarvestError, match="the text source is empty"):  # not the current directory, all of it
        open_source("")
    os.mkfifo(tmp_path / "pipe.txt")  # neither a file nor a folder: not "holds no .txt files", as a folder would
    with pytest.raises(HarvestError, match=r"pipe\.txt is neither a regular file nor a folder: give a \.txt"):
        open_source(tmp_path / "pipe.txt")


def test_an_output_folder_inside_the_source_folder(tiny, tokenizer_dir: Path, corpus, tmp_path: Path) -> None:
    """The job's own folder is never read as text (its journal is a .jsonl): a job killed with shards in its
    journal resumes there, as the uninterrupted one runs."""
    source, _ = corpus
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "docs.jsonl").write_bytes(source.read_bytes())
    out = folder / "acts"
    opts = {"tokenizer": str(tokenizer_dir), "device": "cpu", "max_tokens": 512, "shard_size": 1}
    whole = harvest(tiny.path, folder, out, ["blocks.0.hook_resid_pre"], **opts)
    assert whole.complete and [f["name"] for f in whole.job["source"]["files"]] == ["docs.jsonl"]
    manifest = json.loads((out / MANIFEST).read_text())  # as if killed with its last shards in the journal
    journal = [json.dumps({"add": shard}) for shard in manifest["shards"][2:]]
    manifest |= {"complete": False, "n_contexts": None, "shards": manifest["shards"][:2]}
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / "manifest-journal.jsonl").write_text("".join(line + "\n" for line in journal))
    resumed = harvest(tiny.path, folder, out, ["blocks.0.hook_resid_pre"], **opts)
    assert resumed.complete and resumed.n_contexts == whole.n_contexts
    with pytest.raises(HarvestError, match=r"is not empty and holds no manifest\.json"):  # the source itself
        harvest(tiny.path, folder, folder, ["blocks.0.hook_resid_pre"], **opts)
    with pytest.raises(HarvestError, match="the output folder is empty"):
        harvest(tiny.path, folder, "", ["blocks.0.hook_resid_pre"], **opts)


# --- the job -----------------------------------------------------------------------------------


HOOKS = ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_pattern", "blocks.0.mlp.hook_post"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    return path, write_jsonl(path, 120)


def expected_contexts(docs: list[str], tokenizer: Tokenizer, context: int) -> torch.Tensor:
    """SAELens' own packing of our tokenizer's ids."""
    from sae_lens.tokenization_and_batching import concat_and_batch_sequences

    ids = [torch.tensor(tokenizer.encode(d), dtype=torch.long) for d in docs]
    return torch.stack(list(concat_and_batch_sequences(iter(ids), context, EOT_ID, None, EOT_ID)))


def test_harvest_values_against_transformers(tiny, tokenizer_dir: Path, corpus, tmp_path: Path) -> None:
    source, docs = corpus
    out = tmp_path / "acts"
    manifest = harvest(
        tiny.path,
        source,
        out,
        HOOKS,
        context_size=32,
        batch_size=8,
        shard_size=12,
        tokenizer=str(tokenizer_dir),
        dtype="float32",
        device="cpu",
    )
    contexts = expected_contexts(docs, Tokenizer.from_dir(tokenizer_dir), 32)
    n = len(contexts)
    assert manifest.complete and manifest.n_contexts == n
    saved = json.loads((out / MANIFEST).read_text())
    assert saved["hooks"] == ["blocks.0.attn.hook_pattern", "blocks.0.mlp.hook_post", "blocks.1.hook_resid_pre"]
    assert saved["shapes"] == {
        "blocks.0.attn.hook_pattern": [4, 32, 32],
        "blocks.0.mlp.hook_post": [32, 256],
        "blocks.1.hook_resid_pre": [32, 64],
    }
    assert saved["dtype"] == "float32" and saved["n_tokens"] == n * 32
    assert saved["packing"]["separator_token_id"] == EOT_ID and saved["packing"]["prepend_bos"] is True
    assert [s["rows"] for s in saved["shards"]] == [12] * (n // 12) + ([n % 12] if n % 12 else [])
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, *(s["file"] for s in saved["shards"])])
    for s in saved["shards"]:
        assert file_sha(out / s["file"]) == s["sha256"] and (out / s["file"]).stat().st_size == s["bytes"]

    shards = [load_file(out / s["file"]) for s in saved["shards"]]
    token_ids = torch.cat([s["token_ids"] for s in shards])
    assert token_ids.dtype == torch.int32 and torch.equal(token_ids.long(), contexts)
    with torch.no_grad():
        hf = tiny.hf(contexts, output_hidden_states=True, output_attentions=True)
    resid = torch.cat([s["blocks.1.hook_resid_pre"] for s in shards])
    pattern = torch.cat([s["blocks.0.attn.hook_pattern"] for s in shards])
    torch.testing.assert_close(resid, hf.hidden_states[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pattern, hf.attentions[0], atol=1e-5, rtol=1e-4)
    mlp = torch.cat([s["blocks.0.mlp.hook_post"] for s in shards])
    assert mlp.shape == (n, 32, 256)
    with safe_open(out / saved["shards"][0]["file"], "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_max_tokens_and_a_resume_that_repairs(tiny, tokenizer_dir: Path, corpus, tmp_path: Path) -> None:
    source, _ = corpus
    out = tmp_path / "acts"
    opts = {
        "context_size": 16,
        "batch_size": 4,
        "shard_size": 8,
        "tokenizer": str(tokenizer_dir),
        "max_tokens": 16 * 30 + 5,
        "device": "cpu",
    }
    first = harvest(tiny.path, source, out, ["blocks.1.hook_resid_post"], **opts)
    assert first.n_contexts == 30 and [r.rows for r in first.shards.values()] == [8, 8, 8, 6]
    before = tree_shas(out)
    (out / "acts-00001.safetensors").write_bytes(b"torn")  # a shard that no longer matches its sha256
    (out / "acts-00003.safetensors").unlink()
    (out / ".tmp-acts-00002.safetensors").write_bytes(b"left by a kill")
    again = harvest(tiny.path, source, out, ["blocks.1.hook_resid_post"], **opts)
    assert again.complete and tree_shas(out) == before
    harvest(tiny.path, source, out, ["blocks.1.hook_resid_post"], **opts)  # complete: nothing to do
    assert tree_shas(out) == before
    with pytest.raises(HarvestError, match=r"other arguments \(batch_size: 4 there, 5 now\)"):
        harvest(tiny.path, source, out, ["blocks.1.hook_resid_post"], **(opts | {"batch_size": 5}))


def test_the_device_is_recorded_resolved(tiny, tokenizer_dir: Path, corpus, tmp_path: Path) -> None:
    """A job records the kind of device its shards were computed on, not "auto" (which could mean a GPU
    before a restart and the CPU after, mixing their rounding): here "auto" is the CPU, so a restart naming
    the CPU is the same job, and one that would compute elsewhere is refused."""
    source, _ = corpus
    out = tmp_path / "acts"
    opts = {"context_size": 16, "shard_size": 8, "tokenizer": str(tokenizer_dir), "max_tokens": 16 * 20}
    harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **(opts | {"device": "auto"}))
    assert json.loads((out / MANIFEST).read_text())["job"]["device"] == "cpu"
    before = tree_shas(out)
    (out / "acts-00001.safetensors").unlink()
    harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **(opts | {"device": "cpu"}))
    assert tree_shas(out) == before
    spec = HarvestSpec(str(tiny.path), str(source), ("blocks.0.hook_resid_pre",), **(opts | {"device": "cpu"}))
    # as Ray's driver opens a job whose actors compute on GPUs (where dtype auto means bfloat16)
    with pytest.raises(HarvestError, match=r"other arguments \(device: 'cpu' there, 'cuda' now; dtype: 'float32'"):
        open_job(spec, out, device="cuda")


def test_job_errors(tiny, tokenizer_dir: Path, corpus, tmp_path: Path) -> None:
    source, _ = corpus
    tok = {"tokenizer": str(tokenizer_dir), "device": "cpu"}
    with pytest.raises(HarvestError, match=r"unknown hook 'blocks\.7\.hook_resid_pre'"):
        harvest(tiny.path, source, tmp_path / "a", ["blocks.7.hook_resid_pre"], **tok)
    with pytest.raises(HarvestError, match="context size 200 is more than the model's 128 positions"):
        harvest(tiny.path, source, tmp_path / "a", ["blocks.0.hook_resid_pre"], context_size=200, **tok)
    with pytest.raises(HarvestError, match="batch-size must be a positive integer, got 0"):
        harvest(tiny.path, source, tmp_path / "a", ["blocks.0.hook_resid_pre"], batch_size=0, **tok)
    with pytest.raises(HarvestError, match="unknown format 'hdf5'"):
        harvest(tiny.path, source, tmp_path / "a", ["blocks.0.hook_resid_pre"], format="hdf5", **tok)
    for not_bool in ("no", None, 0):  # "no" was read as true, and each recorded as given
        with pytest.raises(HarvestError, match=f"prepend-bos must be True or False, got {not_bool!r}"):
            harvest(tiny.path, source, tmp_path / "a", ["blocks.0.hook_resid_pre"], prepend_bos=not_bool, **tok)
    with pytest.raises(HarvestError, match="out_dir must be a folder's path"):  # a TypeError deep in the job
        harvest(tiny.path, source, None, ["blocks.0.hook_resid_pre"], **tok)  # type: ignore[arg-type]
    with pytest.raises(HarvestError, match="SAELens' cached format holds one \\[context, d_in\\] array per hook"):
        harvest(tiny.path, source, tmp_path / "a", ["blocks.0.attn.hook_pattern"], format="saelens", **tok)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep me")
    with pytest.raises(HarvestError, match=r"not empty and holds no manifest\.json"):
        harvest(tiny.path, source, busy, ["blocks.0.hook_resid_pre"], **tok)
    with pytest.raises(HarvestError, match=f"max-tokens must be at most {sys.maxsize}, got {10**22}"):
        harvest(tiny.path, source, tmp_path / "a", ["blocks.0.hook_resid_pre"], max_tokens=10**22, **tok)
    # the user's files named .tmp-*: not a harvest's leftovers, so the folder is not empty, and they stay
    mine = (".tmp-notes.txt", ".tmp-acts-00001.safetensors.bak", ".tmp-acts-00001.txt")
    for name, make in [*((n, lambda p: p.write_text("mine")) for n in mine), (".tmp-dir", Path.mkdir)]:
        folder = tmp_path / f"user{name}"
        folder.mkdir()
        make(folder / name)
        with pytest.raises(HarvestError, match=rf"not empty and holds no manifest\.json \({name}\)"):
            harvest(tiny.path, source, folder, ["blocks.0.hook_resid_pre"], **tok)
        assert [p.name for p in folder.iterdir()] == [name]
    with pytest.raises(HarvestError, match=r"^the tokenizer directory is empty"):  # not the current directory
        harvest(tiny.path, source, tmp_path / "a", ["blocks.0.hook_resid_pre"], tokenizer="", device="cpu")
    with pytest.raises(HarvestError, match=r"^the revision is empty"):
        harvest(tiny.path, source, tmp_path / "a", ["blocks.0.hook_resid_pre"], revision="", **tok)
    assert not (tmp_path / "a").exists()
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(HarvestError, match="fewer than 128 tokens"):
        harvest(tiny.path, short, tmp_path / "b", ["blocks.0.hook_resid_pre"], **tok)


def test_ctrl_c_does_not_wait_for_the_text_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The text is read and tokenized a shard ahead on a thread of its own; a job that fails waits for it to
    let go of its files (up to 5 s), but a Ctrl-C does not: a long text in the tokenizer's hands held the
    interrupted job for those 5 s."""
    import threading

    from model.harvest import job

    joined: list[threading.Thread] = []
    real_join = threading.Thread.join
    monkeypatch.setattr(threading.Thread, "join", lambda t, timeout=None: joined.append(t) or real_join(t, timeout))
    held = threading.Event()

    def shards():  # the next shard's text stays in the tokenizer's hands until the test lets go
        yield 0, 0, np.zeros((1, 2), dtype=np.int32)
        held.wait()
        yield 1, 1, np.zeros((1, 2), dtype=np.int32)

    for interrupt, waits in ((KeyboardInterrupt, False), (RuntimeError, True)):
        ahead = job._prefetched(shards())
        assert next(ahead)[0] == 0
        if waits:
            held.set()  # so that the wait is short
        with pytest.raises(interrupt):
            ahead.throw(interrupt)
        assert any(t.name == "harvest-text" for t in joined) == waits, interrupt
        held.set()  # the thread ends
        joined.clear()
        held.clear()


def test_a_job_failing_before_its_first_shard_leaves_no_folder(
    tiny, tokenizer_dir: Path, corpus, tmp_path: Path
) -> None:
    """A bad input found after the folder was opened (too little text, a bad field) leaves the folder as it
    was, so that the corrected command can run there (a manifest left behind refused it)."""
    source, _ = corpus
    tok = {"tokenizer": str(tokenizer_dir), "device": "cpu", "max_tokens": 256}
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "new"
    with pytest.raises(HarvestError, match="fewer than 128 tokens"):
        harvest(tiny.path, empty, out, ["blocks.0.hook_resid_pre"], **tok)
    assert not out.exists()
    deep = tmp_path / "a" / "b" / "c"  # every folder it made goes, not only the last
    with pytest.raises(HarvestError, match="fewer than 128 tokens"):
        harvest(tiny.path, empty, deep, ["blocks.0.hook_resid_pre"], **tok)
    assert not (tmp_path / "a").exists()
    ready = tmp_path / "ready"
    ready.mkdir()
    with pytest.raises(HarvestError, match="no text field 'body'"):
        harvest(tiny.path, source, ready, ["blocks.0.hook_resid_pre"], text_field="body", **tok)
    assert ready.is_dir() and not list(ready.iterdir())
    fixed = harvest(tiny.path, source, ready, ["blocks.0.hook_resid_pre"], **tok)
    assert fixed.complete and fixed.n_contexts == 2
    # a finished manifest edited by hand: its count refused in words (the CLI's last line once crashed on it)
    manifest = json.loads((ready / MANIFEST).read_text())
    (ready / MANIFEST).write_text(json.dumps(manifest | {"n_contexts": "2"}))
    with pytest.raises(HarvestError, match="its n_contexts is '2', not a count of contexts"):
        harvest(tiny.path, source, ready, ["blocks.0.hook_resid_pre"], **tok)


def test_a_full_disk_at_the_first_write_leaves_no_folder(
    tiny, tokenizer_dir: Path, corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk full as the new folder's manifest is first written: the error, and the folders the job made
    gone, as for any job that fails before its first shard (they stayed behind)."""
    import errno

    from model.harvest import shards

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards.os, "fsync", full)
    source, _ = corpus
    deep = tmp_path / "a" / "b"
    with pytest.raises(OSError, match="No space left"):
        harvest(tiny.path, source, deep, ["blocks.0.hook_resid_pre"], tokenizer=str(tokenizer_dir), device="cpu")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("rows", "x", "a shard's rows is 'x'"),
        ("file", None, "a shard's file is None"),
        ("file", "../../etc/passwd", "a shard's file is '../../etc/passwd', not a shard's name"),
        ("bytes", True, "a shard's bytes is True"),
        ("first_context", 1.5, "a shard's first_context is 1.5"),
    ],
)
def test_a_damaged_shard_record_is_refused_in_words(
    tiny, tokenizer_dir: Path, corpus, tmp_path: Path, field: str, value: object, says: str
) -> None:
    """A manifest edited by hand (a field of another type, a file outside the folder): one line, not a
    TypeError from deep in the resume."""
    source, _ = corpus
    out = tmp_path / "acts"
    opts = {"tokenizer": str(tokenizer_dir), "device": "cpu", "context_size": 16, "max_tokens": 16 * 8}
    harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts)
    saved = json.loads((out / MANIFEST).read_text())
    saved["shards"][0][field] = value
    (out / MANIFEST).write_text(json.dumps(saved))
    with pytest.raises(HarvestError, match=rf"is not a harvest manifest this version can read \({re.escape(says)}\)"):
        harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts)
    for job in (None, "x"):  # its job of another type: a TypeError from deep in the resume, once
        (out / MANIFEST).write_text(json.dumps(saved | {"job": job}))
        with pytest.raises(HarvestError, match=rf"\(its job is {job!r}, not an object\)"):
            harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts)


def test_a_manifest_of_another_version_is_refused_in_words(tiny, tokenizer_dir: Path, corpus, tmp_path: Path) -> None:
    """A folder an older gpt2-harvest wrote recorded its job otherwise: the same arguments cannot match it,
    so the error says so instead of listing every argument as changed."""
    source, _ = corpus
    out = tmp_path / "acts"
    opts = {"tokenizer": str(tokenizer_dir), "device": "cpu", "context_size": 16, "max_tokens": 16 * 8}
    harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts)
    saved = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps(saved | {"version": 1}))
    with pytest.raises(HarvestError, match=r"written by another version of gpt2-harvest \(manifest version 1, "):
        harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts)


def test_resume_refuses_other_text_or_weights_at_the_same_path(
    tiny, tokenizer_dir: Path, corpus, tmp_path: Path
) -> None:
    """Text edited in place to the same size, other weights written over the checkpoint, or its config.json
    edited (another LayerNorm epsilon), are not the job the folder holds: refused, not mixed into its shards."""
    import shutil

    from safetensors.torch import save_file

    source = tmp_path / "docs.jsonl"
    source.write_bytes(corpus[0].read_bytes())
    model = tmp_path / "model"
    shutil.copytree(tiny.path, model)
    out = tmp_path / "acts"
    opts = {"tokenizer": str(tokenizer_dir), "device": "cpu", "context_size": 16, "max_tokens": 16 * 8}
    harvest(model, source, out, ["blocks.0.hook_resid_pre"], **opts)
    before = tree_shas(out)
    text = source.read_text()
    source.write_text(text.replace(" cat ", " dog "))  # the same size, other text
    assert source.stat().st_size == len(text)
    with pytest.raises(HarvestError, match=r"other arguments \(source: "):
        harvest(model, source, out, ["blocks.0.hook_resid_pre"], **opts)
    source.write_text(text)
    os.utime(model / "model.safetensors", ns=(1, 1))  # the same weights, touched: still this job
    harvest(model, source, out, ["blocks.0.hook_resid_pre"], **opts)
    assert tree_shas(out) == before
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(config.replace('"layer_norm_epsilon": 1e-05', '"layer_norm_epsilon": 0.5'))
    assert (model / "config.json").read_text() != config
    with pytest.raises(HarvestError, match=r"other arguments \(weights: config\.json changed\)"):
        harvest(model, source, out, ["blocks.0.hook_resid_pre"], **opts)
    (model / "config.json").write_text(config)
    state = load_file(model / "model.safetensors")
    save_file({k: v + 1 for k, v in state.items()}, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HarvestError, match=r"other arguments \(weights: model\.safetensors changed\)"):
        harvest(model, source, out, ["blocks.0.hook_resid_pre"], **opts)
    assert tree_shas(out) == before


def test_resume_refuses_another_dataset_dict_at_the_same_path(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    """A saved DatasetDict keeps its fingerprint in its split's folder: one saved over another at the same
    path is refused on resume (it had no identity, and the new text went on after the old)."""
    import shutil

    datasets = pytest.importorskip("datasets")

    def save(words: list[str]) -> None:
        shutil.rmtree(source, ignore_errors=True)
        docs = [" ".join(words[(i + j) % len(words)] for j in range(30)) for i in range(40)]
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(source))

    source, out = tmp_path / "hf_dict", tmp_path / "acts"
    opts = {"tokenizer": str(tokenizer_dir), "device": "cpu", "context_size": 16, "max_tokens": 16 * 8}
    save(["the", "cat", "sat", "on", "a", "mat"])
    harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts)
    assert json.loads((out / "manifest.json").read_text())["job"]["source"]["fingerprint"] is not None
    before = tree_shas(out)
    save(["other", "text", "entirely", "now"])
    with pytest.raises(HarvestError, match=r"other arguments \(source fingerprint: '\w+' there, '\w+' now\)"):
        harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts)
    assert tree_shas(out) == before


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from model.harvest import shards

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        shards.write_atomic(tmp_path / "acts-00000.safetensors", b"x" * 1000)
    assert list(tmp_path.iterdir()) == []


# --- SAELens' format ---------------------------------------------------------------------------


def test_saelens_format_read_by_saelens(tiny, tokenizer_dir: Path, corpus, tmp_path: Path) -> None:
    import datasets

    source, docs = corpus
    out = tmp_path / "cache"
    hooks = ["blocks.1.hook_resid_pre", "blocks.0.hook_mlp_out"]
    harvest(
        tiny.path,
        source,
        out,
        hooks,
        context_size=32,
        batch_size=8,
        shard_size=16,
        format="saelens",
        tokenizer=str(tokenizer_dir),
        device="cpu",
    )
    contexts = expected_contexts(docs, Tokenizer.from_dir(tokenizer_dir), 32)
    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == ["blocks.0.hook_mlp_out", "blocks.1.hook_resid_pre", "token_ids"]
    assert ds.features["blocks.1.hook_resid_pre"] == datasets.Array2D(shape=(32, 64), dtype="float32")
    assert ds.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=32)
    assert len(ds) == len(contexts)
    ds.set_format("torch")
    rows = ds[:]
    assert torch.equal(rows["token_ids"].long(), contexts)
    with torch.no_grad():
        hf = tiny.hf(contexts, output_hidden_states=True)
    torch.testing.assert_close(rows["blocks.1.hook_resid_pre"], hf.hidden_states[1], atol=1e-4, rtol=1e-4)

    store = activations_store(out, "blocks.1.hook_resid_pre", 32, 64, len(contexts))
    acts, token_ids = store.get_raw_llm_batch()
    assert acts.shape == (4 * 32, 64)
    torch.testing.assert_close(acts, hf.hidden_states[1][:4].reshape(-1, 64), atol=1e-4, rtol=1e-4)
    assert token_ids is not None and torch.equal(token_ids.long(), contexts[:4].reshape(-1))


def activations_store(path: Path, hook: str, context_size: int, d_in: int, n_contexts: int) -> Any:
    """SAELens' own reader of the cached activations at `path`, as its training runner builds it: batches of 4
    contexts (`get_raw_llm_batch`: [4 * context_size, d_in] and their token ids)."""
    from sae_lens.training.activations_store import ActivationsStore

    return ActivationsStore(
        model=None,  # type: ignore[arg-type]
        dataset=None,  # type: ignore[arg-type]
        streaming=False,
        hook_name=hook,
        hook_head_index=None,
        context_size=context_size,
        d_in=d_in,
        n_batches_in_buffer=2,
        total_training_tokens=n_contexts * context_size,
        store_batch_size_prompts=4,
        train_batch_size_tokens=64,
        prepend_bos=True,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=str(path),
    )


# --- the command line --------------------------------------------------------------------------


def cli(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "harvest.py"), *args]


def recorded_shards(out: Path) -> int:
    try:
        return len(json.loads((out / MANIFEST).read_text())["shards"])
    except (OSError, ValueError):  # not written yet
        return 0


def test_kill_9_and_resume(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Killed for real once its manifest lists a shard, then started again: the same files, byte for byte,
    as an uninterrupted run (in this process, one thread, as the CLI is told)."""
    source = tmp_path / "docs.jsonl"
    write_jsonl(source, 800, seed=2, max_words=120)
    args = [
        "--model",
        str(tiny.path),
        "--tokenizer",
        str(tokenizer_dir),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--hooks",
        "blocks.1.hook_resid_pre",
        "--hooks",
        "blocks.0.hook_attn_out",
        "--context-size",
        "64",
        "--batch-size",
        "4",
        "--shard-size",
        "4",
        "--threads",
        "1",
    ]
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        cli(str(source), "--out", str(out), *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    deadline = time.monotonic() + 120
    while not recorded_shards(out):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no shard after 120 s"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    manifest = json.loads((out / MANIFEST).read_text())
    assert not manifest["complete"], "the run ended before it was killed: nothing was interrupted"
    interrupted_at = len(manifest["shards"])
    done = subprocess.run(
        cli(str(source), "--out", str(out), *args), capture_output=True, text=True, cwd=ROOT, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "resuming after" in done.stderr and "tokens/s" in done.stderr  # plain lines: stderr is not a terminal

    reference = tmp_path / "whole"
    harvest(
        tiny.path,
        source,
        reference,
        ["blocks.1.hook_resid_pre", "blocks.0.hook_attn_out"],
        context_size=64,
        batch_size=4,
        shard_size=4,
        tokenizer=str(tokenizer_dir),
        device="cpu",
        dtype="float32",
    )
    shas = tree_shas(out)
    assert shas == tree_shas(reference)
    assert len(shas) - 1 > interrupted_at  # shards were computed after the restart


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_job_stopped_before_its_first_shard_blocks_no_other(
    tiny, tokenizer_dir: Path, tmp_path: Path, how: signal.Signals
) -> None:
    """Stopped while its first shard is computed: by SIGTERM (kill, timeout, docker stop) it stops as Ctrl-C
    does, its one line said, leaving no folder, then ends by SIGTERM (a shell's 143); by SIGKILL its manifest of
    no shard stays, and protects nothing: a corrected job, with other arguments, starts in its place (both were
    refused as "other arguments")."""
    source = tmp_path / "docs.jsonl"
    write_jsonl(source, 3000, seed=3, max_words=120)  # one shard of all its contexts at the default shard size
    model = ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--threads", "1"]
    job = ["--hooks", "blocks.1.hook_resid_post", "--context-size", "32", "--batch-size", "1"]
    out = tmp_path / "stopped"
    proc = subprocess.Popen(cli(str(source), "--out", str(out), *model, *job), stderr=subprocess.PIPE, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not (out / MANIFEST).is_file():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no manifest after 120 s"
        time.sleep(0.005)
    proc.send_signal(how)
    _, err = proc.communicate(timeout=60)
    if how == signal.SIGTERM:
        assert not recorded_shards(out), "a shard was written before the signal: nothing to test"
        assert proc.returncode == -signal.SIGTERM and not out.exists(), err
        said = "gpt2-harvest: interrupted; run it again with the same arguments to resume"
        assert err.decode().strip().endswith(said), err
        return
    assert recorded_shards(out) == 0, "a shard was written before the signal: nothing to test"
    assert json.loads((out / MANIFEST).read_text())["shards"] == []
    fixed = harvest(
        tiny.path, source, out, ["blocks.0.hook_resid_pre"], context_size=16, max_tokens=64,
        tokenizer=str(tokenizer_dir), device="cpu",
    )  # fmt: skip
    assert fixed.complete and fixed.n_contexts == 4 and fixed.job["hooks"] == ["blocks.0.hook_resid_pre"]


def test_a_sigterm_while_ray_starts_is_this_process_s() -> None:
    """`ray.init` installs a SIGTERM handler of its own first thing (sys.exit(15), without a word): the process's
    own is put back, and a SIGTERM that comes while Ray starts goes to it (the command line's: one line, then
    death by SIGTERM)."""
    from model.harvest.ray_data import _own_sigterm

    class Mine(Exception):
        pass

    def mine(signum: int, frame: Any) -> None:
        raise Mine

    def rays(signum: int, frame: Any) -> None:
        sys.exit(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with _own_sigterm():
            signal.signal(signal.SIGTERM, rays)  # as ray.init does
        assert signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(Mine), _own_sigterm():
            signal.signal(signal.SIGTERM, rays)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--hooks", "blocks.9.hook_resid_pre"], "unknown hook 'blocks.9.hook_resid_pre'"),
        (["--hooks", "blocks.0.hook_resid_pre", "--text-field", "body"], "no text field 'body'"),
        (["--hooks", "blocks.0.hook_resid_pre", "--context-size", "4096"], "context size 4096 is more than"),
        (["--hooks", "blocks.0.hook_resid_pre", "--threads", "0"], "--threads must be in 1.."),
    ],
)
def test_cli_errors_are_one_line(
    tiny, tokenizer_dir: Path, corpus, tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    from gpt2_scripts import harvest as harvest_cli

    source, _ = corpus
    model = ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--device", "cpu"]
    status = harvest_cli.main([str(source), "--out", str(tmp_path / "o"), *model, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert len(err) == 1 and err[0].startswith("gpt2-harvest: error: ") and message in err[0], err


def test_activations_past_their_dtype_are_refused(
    tiny_past_float16: Path, tokenizer_dir: Path, corpus, tmp_path: Path
) -> None:
    """A float16 harvest whose activations overflow stops in one line, naming the hook and the range (its shards
    were written full of inf, exit status 0); in float32 the same model harvests."""
    source, _ = corpus
    opts = {"tokenizer": str(tokenizer_dir), "device": "cpu", "context_size": 16, "max_tokens": 16 * 8}
    says = r"^the activations at blocks\.0\.hook_mlp_out became non-finite \(inf or NaN\): .* float16's range"
    with pytest.raises(HarvestError, match=says):
        harvest(tiny_past_float16, source, tmp_path / "f16", ["blocks.0.hook_mlp_out"], dtype="float16", **opts)
    assert not (tmp_path / "f16").exists()  # failed before its first shard: no folder to refuse a fix
    harvest(tiny_past_float16, source, tmp_path / "f32", ["blocks.0.hook_mlp_out"], dtype="float32", **opts)
    # the causal mask's -inf in attention scores is no overflow: harvested as it is
    harvest(tiny_past_float16, source, tmp_path / "scores", ["blocks.0.attn.hook_attn_scores"], **opts)
    scores = load_file(tmp_path / "scores" / "acts-00000.safetensors")["blocks.0.attn.hook_attn_scores"]
    assert scores.isneginf().any() and scores.tril().isfinite().all()


def test_cli_ray_flags_need_ray(capsys) -> None:
    """--actors, --cpus-per-actor and --gpus-per-actor without --ray were taken and silently dropped."""
    from gpt2_scripts import harvest as harvest_cli

    with pytest.raises(SystemExit) as exit_info:
        harvest_cli.parse_args(
            ["x.txt", "--out", "o", "--hooks", "hook_embed", "--actors", "0", "--gpus-per-actor", "1"]
        )
    assert exit_info.value.code == 2
    assert "--actors, --gpus-per-actor need --ray" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        harvest_cli.parse_args(["x.txt", "--out", "o", "--hooks", "hook_embed", "--cpus-per-actor", "2"])
    assert "--cpus-per-actor needs --ray" in capsys.readouterr().err
    args = harvest_cli.parse_args(["x.txt", "--out", "o", "--hooks", "hook_embed", "--ray", "--actors", "3"])
    assert (args.ray, args.actors, args.cpus_per_actor) == ("", 3, None)


def test_cli_bad_file(tiny, tokenizer_dir: Path, tmp_path: Path, capsys) -> None:
    from gpt2_scripts import harvest as harvest_cli

    bad = tmp_path / "data.parquet"
    bad.write_text("this is not parquet")
    argv = [
        str(bad),
        "--out",
        str(tmp_path / "o"),
        "--model",
        str(tiny.path),
        "--tokenizer",
        str(tokenizer_dir),
        "--device",
        "cpu",
        "--hooks",
        "blocks.0.hook_resid_pre",
    ]
    assert harvest_cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.parquet: not a parquet file" in err[0], err


def test_token_ids_numpy_roundtrip() -> None:
    tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert np.array_equal(np.frombuffer(tokens.tobytes(), dtype=np.int32).reshape(3, 4), tokens)


def test_saelens_trains_from_the_cache(tiny, tokenizer_dir: Path, corpus, tmp_path: Path) -> None:
    """SAELens' training runner, given the folder as `cached_activations_path`, trains an SAE from our
    activations (its model, a random TransformerLens one, is only there because the runner wants one)."""
    import datasets
    import transformer_lens as tl
    from sae_lens import LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, StandardTrainingSAEConfig
    from sae_lens.config import LoggingConfig

    source, _ = corpus
    cache = tmp_path / "cache"
    manifest = harvest(
        tiny.path,
        source,
        cache,
        ["blocks.1.hook_resid_pre"],
        context_size=32,
        batch_size=8,
        format="saelens",
        tokenizer=str(tokenizer_dir),
        device="cpu",
    )
    n = manifest.n_contexts or 0
    tokens = datasets.load_from_disk(str(cache)).with_format("numpy")[:]["token_ids"]
    cfg = LanguageModelSAERunnerConfig(
        model_name="gpt2",
        hook_name="blocks.1.hook_resid_pre",
        dataset_path="unused",
        use_cached_activations=True,
        cached_activations_path=str(cache),
        context_size=32,
        prepend_bos=True,
        training_tokens=n * 32,
        store_batch_size_prompts=8,
        train_batch_size_tokens=64,
        n_batches_in_buffer=2,
        sae=StandardTrainingSAEConfig(d_in=64, d_sae=128),
        logger=LoggingConfig(log_to_wandb=False),
        device="cpu",
        output_path=str(tmp_path / "sae"),
        n_checkpoints=0,
    )
    tl_cfg = tl.HookedTransformerConfig(
        n_layers=2,
        d_model=64,
        n_ctx=128,
        d_head=16,
        n_heads=4,
        d_vocab=50257,
        act_fn="gelu_new",
        normalization_type="LN",
    )
    runner = LanguageModelSAETrainingRunner(
        cfg,
        override_dataset=datasets.Dataset.from_dict({"tokens": tokens}),
        override_model=tl.HookedTransformer(tl_cfg),
    )
    store = runner.activations_store
    assert store.cached_activation_dataset is not None
    acts, _ = store.get_raw_llm_batch()
    first = cached_column(cache)[:8].reshape(-1, 64)
    assert torch.equal(acts, first)  # what it trains on is what we wrote
    store.current_row_idx = 0
    sae = runner.run()
    assert sae.cfg.d_in == 64 and (tmp_path / "sae" / "cfg.json").is_file()
    assert all(torch.isfinite(p).all() for p in sae.parameters())


def cached_column(cache: Path) -> torch.Tensor:
    import datasets

    return torch.from_numpy(datasets.load_from_disk(str(cache)).with_format("numpy")[:]["blocks.1.hook_resid_pre"])


# --- the command line's edges ------------------------------------------------------------------


def test_threads_beyond_a_few_per_cpu_are_refused_before_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A huge `--threads` crashed torch (100,000: a segfault; 20,000: libgomp failed to start them), leaving the
    job's folder behind: one line now, before anything is made."""
    from gpt2_scripts.harvest import main, max_threads

    source = tmp_path / "docs.txt"
    source.write_text("some text")
    out = tmp_path / "acts"
    for threads in (0, max_threads() + 1, 100_000):
        args = [str(source), "--out", str(out), "--model", "gpt2", "--hooks", "hook_embed", "--threads", str(threads)]
        assert main(args) == 1
        err = capsys.readouterr().err
        assert err == f"gpt2-harvest: error: --threads must be in 1..{max_threads()} (4 per CPU here), got {threads}\n"
    assert not out.exists()


def test_progress_whose_reader_went_away_does_not_stop_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress is a side channel: a `2>&1 | head -1` or a `tee` that died, or stderr closed, and the job goes
    on (a harvest stopped at its next progress line, 236 shards of 502 in)."""
    from gpt2_scripts.harvest import LineProgress, note

    class Gone:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    for stderr in (Gone(), None):
        monkeypatch.setattr(sys, "stderr", stderr)
        progress = LineProgress(every=0.0)
        progress.start(1000, 100)  # "resuming after ..."
        progress.advance(10)  # a line each time here
        progress.close()
        note("wrote 3 shards")


def test_a_local_ray_instance_without_room_for_an_actor_is_refused() -> None:
    """`--ray --gpus-per-actor 1` on a machine without GPUs: a local instance would wait for them for ever
    (Ray logs that no node can fulfil the request): an error naming what is missing; a cluster reached at an
    address may grow, so there it is a warning."""
    from model.harvest.ray_data import _check_room

    _check_room({"CPU": 2.0}, 1.0, 0.0, local=True)  # fits
    with pytest.raises(HarvestError, match=r"an actor asks for 1 GPUs, and the Ray cluster has 2 CPUs and 0 GPUs"):
        _check_room({"CPU": 2.0}, 1.0, 1.0, local=True)
    with pytest.raises(HarvestError, match=r"asks for 4 CPUs and 0.5 GPUs"):
        _check_room({"CPU": 2.0}, 4.0, 0.5, local=True)
    _check_room({"CPU": 2.0}, 1.0, 1.0, local=False)  # a warning, the job goes on


def test_a_resume_names_the_flags_that_changed(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Another --text-field said as such (it was "source: other files (names, sizes or sha256)", the files
    being the same), and another --max-tokens by its flag (it was `max_contexts` alone)."""
    source = tmp_path / "docs.jsonl"
    source.write_text(
        "".join(json.dumps({"text": f"a cat {i} " * 20, "body": f"a dog {i} " * 20}) + "\n" for i in range(40))
    )
    out = tmp_path / "acts"
    opts = {"tokenizer": str(tokenizer_dir), "device": "cpu", "context_size": 16, "max_tokens": 16 * 8}
    harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts)
    with pytest.raises(HarvestError) as refused:
        harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], text_field="body", **opts)
    assert "source text_field: 'text' there, 'body' now" in str(refused.value)
    assert "other files" not in str(refused.value)
    with pytest.raises(HarvestError, match=r"max_contexts \(--max-tokens // --context-size\): 8 there, 4 now"):
        harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], **opts | {"max_tokens": 16 * 4})


def test_a_job_started_before_config_json_counted_resumes_and_records_it(
    tiny, tokenizer_dir: Path, corpus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest written before the model's config.json was part of its identity (its `weights` without it)
    resumes with the same arguments, saying so, and records it from then on; an edit after that is refused."""
    source, _ = corpus
    out = tmp_path / "acts"
    opts = {"tokenizer": str(tokenizer_dir), "device": "cpu", "context_size": 16, "max_tokens": 16 * 8}
    harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], shard_size=4, **opts)
    saved = json.loads((out / MANIFEST).read_text())
    assert [f["name"] for f in saved["job"]["weights"]] == ["model.safetensors", "config.json"]
    saved["job"]["weights"] = saved["job"]["weights"][:-1]
    (out / MANIFEST).write_text(json.dumps(saved))
    (out / "acts-00001.safetensors").unlink()  # a shard the resume computes, and records the job with
    with caplog.at_level("WARNING", logger="model.harvest.shards"):
        assert harvest(tiny.path, source, out, ["blocks.0.hook_resid_pre"], shard_size=4, **opts).complete
    assert "did not record the model's config.json: resuming with what is there now" in caplog.text
    assert [f["name"] for f in json.loads((out / MANIFEST).read_text())["job"]["weights"]][-1] == "config.json"
