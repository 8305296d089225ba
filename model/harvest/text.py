"""Reading text sources and packing them into fixed contexts, the way SAELens packs them.

A source is a `.txt` file (one document), a `.jsonl` file (one document per line, in `text_field`), a
`.parquet` file (one document per row of column `text_field`), a folder of such files (read recursively
in path order), or a directory written by Hugging Face `datasets`' `save_to_disk`. Documents are
tokenized without a BOS and packed as SAELens' `concat_and_batch_sequences` packs them
(`sae_lens/tokenization_and_batching.py`, called by its `ActivationsStore` with `begin_batch_token_id` =
BOS when `prepend_bos`, no per-sequence token, and the separator BOS): each context starts with
`<|endoftext|>` unless its first token already is one, documents follow each other with `<|endoftext|>`
between them, a document longer than the room left runs on into the next context, and the last,
incomplete context is dropped. The same source and arguments always give the same contexts in the same
order, which is what resuming an interrupted job relies on.

A long document is read (a `.txt` file) and tokenized in pieces, cut only where the tokenizer's ids do not
change (`Tokenizer.cut`), so memory follows the piece, not the document.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..json_file import read_json
from ..tokenizer import InvalidTextError, Tokenizer, check_unicode
from .errors import HarvestError
from .shards import sha256_file

FILE_KINDS = (".txt", ".jsonl", ".parquet")
TRAIN = "train"  # a DatasetDict's split that is read
_DOCS_PER_ENCODE = 256  # texts handed to the tokenizer at once (it encodes them on its own threads) ...
_CHARS_PER_ENCODE = 1 << 18  # ... up to about this many characters (its memory: 170-240 bytes a byte of UTF-8)
_PIECE_CHARS = 1 << 16  # a longer document is tokenized in pieces of about this many characters
_TXT_BLOCK = 1 << 20  # bytes of a .txt file read at once


@dataclass(frozen=True)
class Source:
    """Where the text is: `files` in reading order, or a `datasets` directory (`dataset_dir`)."""

    path: Path
    text_field: str
    files: tuple[Path, ...] = ()
    dataset_dir: Path | None = None

    def describe(self) -> dict[str, Any]:
        """What identifies the text for a manifest (so that a resumed job reads the same text)."""
        if self.dataset_dir is not None:
            state = self.dataset_dir / "state.json"
            if not state.is_file():  # a DatasetDict's: its split that is read (`_dataset_documents`)
                state = self.dataset_dir / TRAIN / "state.json"
            fingerprint = _fingerprint(state) if state.is_file() else None
            return {
                "path": str(self.path),
                "kind": "datasets",
                "text_field": self.text_field,
                "fingerprint": fingerprint,
            }
        return {
            "path": str(self.path),
            "kind": "files",
            "text_field": self.text_field,
            "files": [{"name": self._name(f), "bytes": f.stat().st_size, "sha256": _sha256(f)} for f in self.files],
        }

    def _name(self, f: Path) -> str:
        return f.name if f == self.path else f.relative_to(self.path).as_posix()

    def documents(self, began: dict[str, Any] | None = None) -> Iterator[Iterable[str]]:
        """Every document's text, in order, each as its text's parts in order (a `.txt` file's in blocks
        as it is read; read each document's to its end before the next). `began`: what `describe` said
        when the job began; a file added or gone since then, or whose bytes differ by the end of its
        reading, is then a HarvestError (the contexts would mix two texts)."""
        if self.dataset_dir is not None:
            yield from ((text,) for text in _dataset_documents(self.dataset_dir, self.text_field))
            return
        sha256 = {f["name"]: f["sha256"] for f in (began or {}).get("files", [])}
        if began is not None and list(sha256) != [self._name(f) for f in self.files]:
            raise HarvestError(
                f"the files in {self.path} changed since the job began: run the job again in a new --out"
            )
        for f in self.files:
            yield from _file_documents(f, self.text_field, sha256.get(self._name(f)))


def _fingerprint(state: Path) -> object:
    """The `_fingerprint` a datasets directory's `state.json` records (what `save_to_disk` saved)."""
    what = "a readable Hugging Face datasets directory"
    content = read_json(state, lambda message: HarvestError(f"{state.parent}: not {what} ({message})"), what)
    if not isinstance(content, dict):
        raise HarvestError(f"{state.parent}: not {what} ({state.name} holds a JSON {type(content).__name__})")
    return content.get("_fingerprint")


def open_source(path: str | Path, text_field: str = "text", leave_out: str | Path | None = None) -> Source:
    """The source at `path`, checked to exist and hold something readable (see the module docstring).
    `leave_out`: a folder whose files are never read (the job's own output folder, when it lies inside a
    source folder: its journal is a .jsonl)."""
    if str(path) == "":  # Path("") is the current directory: all of it would be read
        raise HarvestError("the text source is empty: give a .txt, .jsonl or .parquet file, or a folder")
    path = Path(path)
    if not path.exists():
        raise HarvestError(f"no text source at {path}: expected a .txt, .jsonl or .parquet file, or a folder")
    if path.is_file():
        if path.suffix not in FILE_KINDS:
            raise HarvestError(
                f"{path}: cannot read {path.suffix or 'a file without extension'}; valid: {', '.join(FILE_KINDS)}"
            )
        return Source(path, text_field, files=(path,))
    if not path.is_dir():  # a pipe, a device: neither a file to read from any place nor a folder to list
        raise HarvestError(f"{path} is neither a regular file nor a folder: give a .txt, .jsonl or .parquet file")
    if _is_datasets_dir(path):
        return Source(path, text_field, dataset_dir=path)
    root, skipped = path.resolve(), Path(leave_out).resolve() if leave_out is not None else None
    if skipped is not None and (skipped == root or not skipped.is_relative_to(root)):
        skipped = None  # only a folder strictly inside the source is left out (a source that is the output
        # folder, or inside it, is read, and the output folder refused as one that holds other files)
    files = tuple(
        sorted(
            (
                f
                for f in path.rglob("*")
                if f.is_file()
                and f.suffix in FILE_KINDS
                and not any(p.startswith(".") for p in f.relative_to(path).parts)
                and (skipped is None or not f.resolve().is_relative_to(skipped))
            ),
            key=lambda f: f.relative_to(path).parts,
        )
    )
    if not files:
        raise HarvestError(
            f"{path} holds no {', '.join(FILE_KINDS)} files and is not a Hugging Face datasets directory"
        )
    return Source(path, text_field, files=files)


def _is_datasets_dir(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _file_documents(path: Path, field: str, sha256: str | None) -> Iterator[Iterable[str]]:
    """The documents of one file; `sha256`: its bytes' when the job began (None: not checked)."""
    if path.suffix == ".txt":
        yield _txt_blocks(path, sha256)
    elif path.suffix == ".jsonl":
        yield from ((text,) for text in _jsonl_documents(path, field, sha256))
    else:
        yield from ((text,) for text in _parquet_documents(path, field))
        _unchanged(path, sha256, sha256_file(path) if sha256 is not None else None)


def _unchanged(path: Path, began: str | None, now: str | None) -> None:
    if began != now:
        raise HarvestError(
            f"{path} changed while the job read it, so its contexts could mix its old text and its new: "
            "run the job again in a new --out"
        )


def _sha256(path: Path) -> str:
    """A file's sha256; a .txt file's bytes are checked to be UTF-8 on the way (`_decoded`), so that a bad
    byte stops the job before its work, not after the shards of the text before it."""
    if path.suffix != ".txt":
        return sha256_file(path)
    digest = hashlib.sha256()
    for raw, _ in _decoded(path):
        digest.update(raw)
    return digest.hexdigest()


def _txt_blocks(path: Path, sha256: str | None) -> Iterator[str]:
    """A .txt file's text, a block at a time (`_decoded`), its bytes checked against `sha256` at the end."""
    digest = hashlib.sha256()
    for raw, text in _decoded(path):
        digest.update(raw)
        if text:
            yield text
    _unchanged(path, sha256, digest.hexdigest() if sha256 is not None else None)


def _decoded(path: Path) -> Iterator[tuple[bytes, str]]:
    """A .txt file's bytes a block at a time, each with its text as `Path.read_text` reads it (UTF-8,
    newlines made `\\n`; a character or a CRLF cut at a block's end comes with the next block's text)."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    read = 0  # bytes handed to the decoder so far
    with path.open("rb") as f:
        while True:
            raw = f.read(_TXT_BLOCK)
            held = len(decoder.getstate()[0])  # the bytes of a character cut at the last block's end
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise HarvestError(f"{path}: not UTF-8 text (byte {read - held + e.start}): {e.reason}") from None
            read += len(raw)
            yield raw, text
            if not raw:
                return


def _jsonl_documents(path: Path, field: str, sha256: str | None) -> Iterator[str]:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            digest.update(raw)
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError as e:  # not JSON, not UTF-8, or a number of more than 4300 digits
                raise HarvestError(f"{path} line {number}: not a JSON object ({e})") from None
            except RecursionError:
                raise HarvestError(f"{path} line {number}: not a JSON object (nested too deeply)") from None
            if not isinstance(row, dict):
                raise HarvestError(
                    f"{path} line {number}: a JSON {type(row).__name__}, expected an object with {field!r}"
                )
            if field not in row:
                raise HarvestError(
                    f"{path} line {number}: no text field {field!r}; its fields are {sorted(row)} "
                    "(choose one with --text-field)"
                )
            text = _text(row[field], f"{path} line {number}", field)
            try:  # JSON's \ud800 escapes can make a lone surrogate, which no tokenizer reads: named here, by line
                check_unicode(text)
            except InvalidTextError as e:
                raise HarvestError(f"{path} line {number}: {field!r} is {e}") from None
            yield text
    _unchanged(path, sha256, digest.hexdigest() if sha256 is not None else None)


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise HarvestError("reading parquet needs pyarrow: pip install 'gpt2-server[harvest]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise HarvestError(f"{path}: not a parquet file ({e})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise HarvestError(f"{path}: no text column {field!r}; its columns are {names} (choose one with --text-field)")
    row = 0
    batches = pf.iter_batches(columns=[field], batch_size=1024)
    while True:
        try:  # a damaged page shows only as its rows are read
            batch = next(batches, None)
        except Exception as e:  # pyarrow's OSError, ArrowInvalid, ...
            reason = " ".join(str(e).split())  # pyarrow's reasons run over lines
            raise HarvestError(
                f"{path}: a damaged parquet file, its rows from {row} on unreadable ({reason})"
            ) from None
        if batch is None:
            return
        for value in batch.column(0).to_pylist():
            yield _text(value, f"{path} row {row}", field)
            row += 1


def _dataset_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise HarvestError("reading a datasets directory needs datasets: pip install 'gpt2-server[harvest]'") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError, ArrowInvalid, ...
        raise HarvestError(f"{path}: not a readable Hugging Face datasets directory ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if TRAIN not in ds:
            raise HarvestError(f"{path}: a DatasetDict without a '{TRAIN}' split; its splits are {sorted(ds)}")
        ds = ds[TRAIN]
    if field not in ds.column_names:
        raise HarvestError(
            f"{path}: no text column {field!r}; its columns are {ds.column_names} (choose one with --text-field)"
        )
    row = 0
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        for value in batch[field]:
            yield _text(value, f"{path} row {row}", field)
            row += 1


def _text(value: object, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise HarvestError(f"{where}: {field!r} is a {type(value).__name__}, expected text")
    return value


def tokenize(documents: Iterable[Iterable[str]], tokenizer: Tokenizer) -> Iterator[tuple[list[int], bool]]:
    """The documents' token ids (no BOS; `<|endoftext|>` written in the text is the special token, as
    SAELens' `to_tokens` reads it) as (ids, whether they open a document): a document's ids in one piece,
    or in several where it is long (`_pieces`), the same ids as the whole. Encoded a few hundred texts or
    about `_CHARS_PER_ENCODE` characters at a time."""
    group: list[str] = []
    opens: list[bool] = []
    chars = 0
    for parts in documents:
        assert not isinstance(parts, str), "a document is given as its parts: (text,) for one in one part"
        for i, piece in enumerate(_pieces(parts, tokenizer)):
            group.append(piece)
            opens.append(i == 0)
            chars += len(piece)
            if len(group) == _DOCS_PER_ENCODE or chars >= _CHARS_PER_ENCODE:
                yield from zip(_encode(group, tokenizer), opens, strict=True)
                group, opens, chars = [], [], 0
    if group:
        yield from zip(_encode(group, tokenizer), opens, strict=True)


def _pieces(parts: Iterable[str], tokenizer: Tokenizer) -> Iterator[str]:
    """A document's text, given in `parts`, in pieces cut where the tokenizer gives each piece the ids the
    whole has there (`Tokenizer.cut`): each ends at the last cut within `_PIECE_CHARS` characters of its
    start, or where there is none (a run of text that cannot be cut), within `_PIECE_CHARS` after the run;
    a text that cannot be cut at all is one piece. Nothing for an empty document."""
    text, start, bare = "", 0, 0  # text[start:] is still to come; no cut at or before `bare`
    held: list[str] = []  # parts after `text` with no cut in them, joined only once one comes (or at the end)
    tail = ""  # the text's last two characters so far: a cut at a part's start needs them
    for part in parts:
        seam, tail = tail + part, (tail + part)[-2:]
        if not tokenizer.cut(seam, 0, len(seam)):
            held.append(part)
            continue
        text, bare, start = text[start:] + "".join(held) + part, max(bare - start, 0), 0
        held = []
        while len(text) - start > _PIECE_CHARS:
            lo, hi = max(start, bare), start + _PIECE_CHARS
            cut = tokenizer.cut(text, lo, hi)
            while not cut and hi < len(text):  # none: the first window after it that holds one
                lo, hi = max(lo, hi), min(hi + _PIECE_CHARS, len(text))
                cut = tokenizer.cut(text, lo, hi)
            if not cut:
                bare = max(len(text) - 2, 0)  # a cut needs the character after its space: look there again
                break
            yield text[start:cut]
            start = cut
    if rest := text[start:] + "".join(held):
        yield rest


def _encode(group: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    try:
        return tokenizer.encode_batch(group)
    except InvalidTextError as e:
        raise HarvestError(f"a document is {e}") from None


def pack(
    pieces: Iterable[tuple[list[int], bool]], context_size: int, bos_id: int | None, separator_id: int | None
) -> Iterator[list[int]]:
    """Contexts of exactly `context_size` tokens from documents' ids, given as (ids, whether they open a
    document) as `tokenize` gives them, the way SAELens'
    `concat_and_batch_sequences(begin_batch_token_id=bos_id, sequence_separator_token_id=separator_id)`
    makes them from whole documents: `bos_id` opens each context (unless its first token is that id
    already), `separator_id` goes between documents (unless the next one starts with it), the rest is
    dropped."""
    if context_size < 1 or (bos_id is not None and context_size < 2):
        raise HarvestError(f"context size {context_size} is too small: it must be at least 2 with a BOS, 1 without")
    context: list[int] | None = None
    for tokens, opens in pieces:
        offset = 0
        while offset < len(tokens):
            first = tokens[offset]
            if context is None:
                prefix = [bos_id] if bos_id is not None and first != bos_id else []
                take = context_size - len(prefix)
                context = prefix + tokens[offset : offset + take]
            else:
                prefix = [separator_id] if opens and separator_id is not None and first != separator_id else []
                room = context_size - len(context)
                take = max(room - len(prefix), 0)
                context = context + prefix[:room] + tokens[offset : offset + take]
            offset += take
            if len(context) == context_size:
                yield context
                context = None
