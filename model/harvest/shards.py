"""Shards on disk: atomic writes, the manifest, and resuming an interrupted job.

A job's output folder holds numbered shards (`acts-00000.safetensors`, or `.arrow` in SAELens' format)
and `manifest.json`, which says what the shards hold (model, hooks, shapes, dtype, how the text was
packed) and lists each finished shard with its row count and sha256. Every file is written to a temporary
name, fsynced and renamed. Each finished shard is recorded at once: appended, as one line, to
`manifest-journal.jsonl` (fsynced), and the manifest is rewritten whole (the same atomic way, taking in the
journal, which is then removed) each time the journal would grow past an eighth of the shards listed, so
that recording costs O(1) a shard however long the job (rewriting it after every shard cost O(shards)
each: at 6,605 shards, 260 s in all). So a job killed at any instant leaves finished shards, a manifest and
a journal that list only finished shards, and at most a stray temporary file or a journal's torn last line.
A finished job's manifest lists every shard, and its journal is gone (or, killed just before removing it,
adds nothing). Started again with the same arguments, the job takes in the journal, checks the arguments
against the manifest, checks each listed shard against its sha256, and computes only the shards that are
missing: packing is deterministic, so they get exactly the contexts an uninterrupted run gives them. An
open manifest holds the folder's lock (`lock.py`) until `close`, so that a second job cannot write there
meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..json_file import clip, is_int
from .errors import HarvestError
from .lock import LOCK, FolderLock

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
JOURNAL = "manifest-journal.jsonl"  # the shards added (or dropped) since the manifest was last written
_JOURNAL_SHARE = 8  # the manifest is rewritten before the journal outgrows 1/8 of the shards it lists
# 2: the job names the text's and the weights' sha256 and the device kind resolved; 3: the tokenizer files' too
MANIFEST_VERSION = 3
_TOKENIZER = "tokenizer_files"  # the job's key that version 3 added: version 2's jobs resume, and get it recorded
_IDENTITIES = ("source", "weights", _TOKENIZER)  # the job's keys that identify files by name, size and sha256
_TMP = ".tmp-"
_SHARD = re.compile(r"acts-\d{5,}\.(safetensors|arrow)")  # `shard_name`'s
_OURS = re.compile(rf"(manifest|dataset_info|state)\.json|{_SHARD.pattern}")  # `write_atomic`'s names


def _leftover(path: Path) -> bool:
    """A temporary file a harvest's `write_atomic` left (killed before its rename): `.tmp-` and a name
    a harvest writes. Anything else is the user's, even with a name starting `.tmp-`."""
    return path.name.startswith(_TMP) and bool(_OURS.fullmatch(path.name[len(_TMP) :])) and path.is_file()


def shard_name(index: int, suffix: str) -> str:
    return f"acts-{index:05d}{suffix}"


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard: its file (in the output folder), rows (contexts), first context's number in the
    job, and the file's sha256 and size."""

    index: int
    file: str
    rows: int
    first_context: int
    sha256: str
    bytes: int

    @classmethod
    def read(cls, saved: Any) -> ShardRecord:
        """A record as a manifest holds it, checked: a TypeError (or KeyError) where a field is missing or of
        another type, or the file is not a plain name in the folder."""
        record = cls(**saved)
        for field in fields(record):  # each an int or a str, as annotated
            value = getattr(record, field.name)
            if not isinstance(value, {"int": int, "str": str}[str(field.type)]) or isinstance(value, bool):
                raise TypeError(f"a shard's {field.name} is {value!r}")
        if not _SHARD.fullmatch(record.file):
            raise TypeError(f"a shard's file is {record.file!r}, not a shard's name")
        return record


def write_atomic(path: Path, data: bytes) -> str:
    """Write `data` to `path` so that `path` never holds a partial file; return its sha256."""
    tmp = path.with_name(_TMP + path.name)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: leave no partial temporary file behind
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _difference(key: str, there: Any, now: Any) -> str:
    """One argument a restart changed, for the error: both values when short, the files that changed for
    the files' identities (or the source's other fields that did, its text field say), else that the values
    differ. The job's own names are the flags' where they differ (`max_contexts`: `--max-tokens`)."""
    if key in _IDENTITIES and (changed := _files_changed(there, now)):
        return f"{key}: {changed}"
    if isinstance(there, dict) and isinstance(now, dict) and there.get("files") == now.get("files"):
        fields = [k for k in sorted(set(there) | set(now)) if k != "files" and there.get(k) != now.get(k)]
        if fields:
            return "; ".join(_difference(f"{key} {k}", there.get(k), now.get(k)) for k in fields)
    if key == "max_contexts":
        key = "max_contexts (--max-tokens // --context-size)"
    if len(repr(there)) + len(repr(now)) <= 120:
        return f"{key}: {there!r} there, {now!r} now"
    return f"{key}: other {'files (names, sizes or sha256)' if key in _IDENTITIES else 'values'} now"


def _identities_added(saved: dict[str, Any], now: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """`saved` with the identities that gpt2-harvest records since 2026-12-05 and did not before, taken from
    `now` where the rest agrees, and said: the model's `config.json` beside its weight files, a DatasetDict's
    fingerprint. (What they were as the job started cannot be known: a job started before resumes.)"""
    out = dict(saved)
    weights: list[dict[str, Any]] = now.get("weights") or []  # `now` is this version's job: its types are known
    source: dict[str, Any] = now["source"]
    if weights and weights[-1]["name"] == "config.json" and saved.get("weights") == weights[:-1]:
        out["weights"] = weights
    if source["kind"] == "datasets" and saved.get("source") == source | {"fingerprint": None}:
        out["source"] = source
    if out != saved:
        log.warning(
            "%s was started by a gpt2-harvest that did not record %s: resuming with what is there now, recorded "
            "from now on",
            out_dir,
            " or ".join(
                what
                for key, what in (("weights", "the model's config.json"), ("source", "the dataset's fingerprint"))
                if out.get(key) != saved.get(key)
            ),
        )
    return out


def _comparable(job: dict[str, Any]) -> dict[str, Any]:
    """`job` as a resume compares it: the path the text was given by does not count where the text is identified
    by content (its files' sha256, its dataset's fingerprint), nor the model's name or path (and revision) where
    its weight files are, nor the tokenizer's where its files are; else the model's and the tokenizer's count
    resolved where they name a local folder or file. `corpus.jsonl` and `/data/corpus.jsonl`, `./gpt2` and
    `gpt2/`, a relative path from another working directory, a copy of the model's folder: one job (a resume
    named the text otherwise was refused as "other files", the model from elsewhere as another model)."""
    out = dict(job)
    source = out.get("source")
    if isinstance(source, dict) and (source.get("kind") == "files" or source.get("fingerprint") is not None):
        out["source"] = {k: v for k, v in source.items() if k != "path"}
    for key, files in (("model", "weights"), ("revision", "weights"), ("tokenizer", "tokenizer_files")):
        if out.get(files):  # the files identified by content: where they lie does not count
            out.pop(key, None)
    for key in ("model", "tokenizer"):
        value = out.get(key)
        if isinstance(value, str) and value and Path(value).exists():
            out[key] = str(Path(value).resolve())
    return out


def _files_changed(there: Any, now: Any) -> str | None:
    """The files that differ ("vocab.json changed", "b.txt new", "a.txt gone") between two lists of files'
    identities ({name, bytes, sha256}) or two sources that differ only in their files; None for the rest."""
    if isinstance(there, dict) and isinstance(now, dict) and "files" in there and "files" in now:
        if {k: v for k, v in there.items() if k != "files"} != {k: v for k, v in now.items() if k != "files"}:
            return None
        there, now = there["files"], now["files"]
    try:
        before, after = {f["name"]: f for f in there}, {f["name"]: f for f in now}
    except (TypeError, KeyError):
        return None
    changed = []
    for name in [*before, *(n for n in after if n not in before)]:
        if name not in after:
            changed.append(f"{name} gone")
        elif name not in before:
            changed.append(f"{name} new")
        elif before[name] != after[name]:
            changed.append(f"{name} changed")
    return ", ".join(changed) or None


class Manifest:
    """`manifest.json` of one output folder: `job` (the arguments that decide every shard's bytes, which a
    restart must repeat), `header` (what the shards hold), and the finished shards."""

    def __init__(self, out_dir: Path, job: dict[str, Any], header: dict[str, Any]) -> None:
        self.out_dir, self.job, self.header = out_dir, job, header
        self.shards: dict[int, ShardRecord] = {}
        self.complete = False
        self.n_contexts: int | None = None
        self.new = False  # this run wrote the manifest into a new or empty folder
        self.made: Path | None = None  # the outermost folder this run made (out_dir or one above it)
        self.lock: FolderLock | None = None  # held from `open` to `close`
        self._journal: int | None = None  # the journal's descriptor, appending, from its first line to the next save
        self._journaled = 0  # its lines

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the folder's lock, for the next job (the manifest and any journal stay readable)."""
        try:
            self._close_journal()
        finally:
            if self.lock is not None:
                self.lock.release()

    def _close_journal(self) -> None:
        if self._journal is not None:
            fd, self._journal = self._journal, None
            os.close(fd)

    @classmethod
    def open(cls, out_dir: str | Path, job: dict[str, Any], header: dict[str, Any]) -> Manifest:
        """The manifest of `out_dir` for this job: a new one for a new or empty folder, the folder's own
        when it holds this job's shards (its arguments must match `job`; shards whose bytes no longer match
        their sha256 are dropped, to be computed again). It holds the folder's lock until `close` (use it as
        a context manager); another job holding it is a `HarvestError`, at once."""
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise HarvestError(f"output {out} is a file, not a folder")
        missing = [p for p in (out, *out.parents) if not p.exists()]
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only disk, a folder that takes none (/proc)
            raise HarvestError(f"cannot make the output folder {out}: {e.strerror or e}") from None
        manifest = cls(out, job, header)
        manifest.made = missing[-1] if missing else None
        manifest.lock = FolderLock.acquire(out)  # before reading anything: another job may be writing there
        try:
            path = out / MANIFEST
            if not path.is_file():
                others = sorted(p.name for p in out.iterdir() if not _leftover(p) and p.name != LOCK)
                if others:
                    raise HarvestError(
                        f"output folder {out} is not empty and holds no {MANIFEST} ({', '.join(others[:5])}"
                        f"{', ...' if len(others) > 5 else ''}): give an empty or new folder, or one a harvest wrote"
                    )
                manifest.new = True
                manifest.save()  # first, so that a folder with shards always says whose they are
            else:
                manifest._resume(path)
            for stray in out.iterdir():
                if _leftover(stray):
                    stray.unlink()
        except BaseException:
            if manifest.new:  # its first write failed (a full disk, say), or a signal came just after it
                manifest.discard_if_empty()
            manifest.close()
            raise
        return manifest

    def _resume(self, path: Path) -> None:
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            saved_job = saved["job"]
            if not isinstance(saved_job, dict):
                raise TypeError(f"its job is {clip(saved_job)}, not an object")
            records = {r.index: r for r in map(ShardRecord.read, saved["shards"])}
            if len(records) != len(saved["shards"]):
                raise TypeError("it lists a shard twice")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nested too deep
            raise HarvestError(f"{path} is not a harvest manifest this version can read ({e})") from None
        journal = self.out_dir / JOURNAL
        journaled, listed = journal.is_file(), dict(records)
        if journaled:
            for change in _journal_changes(journal):
                if isinstance(change, ShardRecord):
                    records[change.index] = change
                else:
                    records.pop(change, None)  # a drop the manifest took in already, killed before the journal went
        # version 2 recorded everything but the tokenizer's identity: its job resumes with the tokenizer
        # named now, whose identity is recorded from now on (what tokenized the shards before, it cannot say)
        upgrade = saved.get("version") == 2 and isinstance(saved_job, dict) and _TOKENIZER not in saved_job
        if saved.get("version") != MANIFEST_VERSION and not upgrade:
            raise HarvestError(
                f"{path} was written by another version of gpt2-harvest (manifest version {saved.get('version')}, "
                f"this one writes {MANIFEST_VERSION}), which recorded its job otherwise: it cannot be resumed "
                "here; give another output folder (its finished shards stay readable)"
            )
        if not records and not saved.get("complete") and self.lock is not None:
            # a job killed before its first shard (by SIGKILL: nothing cleaned up after it) protects nothing:
            # this job starts in its place, whatever its arguments, as in the empty folder it left (the lock
            # held: no job is starting there)
            log.info("%s holds a harvest stopped before its first shard: this job starts in its place", path)
            journal.unlink(missing_ok=True)
            self.new = True
            self.save()
            return
        if upgrade:
            saved_job = saved_job | {_TOKENIZER: self.job.get(_TOKENIZER)}
        saved_job = _identities_added(saved_job, self.job, self.out_dir)
        saved_job, job = _comparable(saved_job), _comparable(self.job)
        if saved_job != job:
            diffs = [_difference(k, saved_job.get(k), job.get(k)) for k in sorted(set(saved_job) | set(job))
                     if saved_job.get(k) != job.get(k)]  # fmt: skip
            raise HarvestError(
                f"{self.out_dir} holds a harvest with other arguments ({'; '.join(diffs)}): "
                "start it again with the same arguments to resume it, or give another output folder"
            )
        for r in records.values():
            file = self.out_dir / r.file
            if file.is_file() and file.stat().st_size == r.bytes and sha256_file(file) == r.sha256:
                self.shards[r.index] = r
            else:
                log.warning("shard %s is missing or does not match its sha256: computing it again", r.file)
        self.complete = bool(saved.get("complete")) and len(self.shards) == len(records)
        self.n_contexts = saved.get("n_contexts") if self.complete else None
        if self.complete and not (is_int(self.n_contexts) and self.n_contexts > 0):
            raise HarvestError(
                f"{path} is not a harvest manifest this version can read (its n_contexts is "
                f"{clip(self.n_contexts)}, not a count of contexts)"
            )
        log.info("resuming %s: %d shards already there", self.out_dir, len(self.shards))
        if upgrade and not self.complete:
            log.warning(
                "%s was started by a gpt2-harvest that did not record its tokenizer: resuming with the tokenizer "
                "given now, whose files are recorded from now on (if they changed since the job started, its "
                "new shards are tokenized otherwise: start it in another folder)",
                self.out_dir,
            )
            self.save()  # the tokenizer's identity, from now on
        elif journaled and (records != listed or not self.complete):
            self.save()  # the journal taken in: the manifest lists every finished shard again, and it is gone
        elif journaled:  # a finished job killed before its last save removed the journal, which adds nothing
            with contextlib.suppress(OSError):  # a finished folder on a read-only disk is only read
                journal.unlink()

    def discard_if_empty(self) -> None:
        """Undo `open` for a job that failed before writing anything: remove the manifest it wrote into a new
        or empty folder (and the folder, if it made it), so that the corrected job can start there."""
        if not self.new or self.shards:
            return
        try:
            names = [p.name for p in self.out_dir.iterdir() if not _leftover(p) and p.name != LOCK]
            if set(names) - {JOURNAL} not in ({MANIFEST}, set()):  # a shard written: keep the manifest naming its job
                return
            for p in self.out_dir.iterdir():
                p.unlink()
            if self.made is not None:  # the folders it made, from the inside out
                for folder in (self.out_dir, *self.out_dir.parents):
                    folder.rmdir()
                    if folder == self.made:
                        break
        except OSError as e:
            log.warning("could not remove the empty harvest in %s: %s", self.out_dir, e)

    def add(self, record: ShardRecord) -> bool:
        """List a finished shard (durably, before returning). Whether the manifest was rewritten (else the
        shard went to the journal)."""
        before = self.shards.get(record.index)
        self.shards[record.index] = record
        return self._record({"add": asdict(record)}, record.index, before)

    def drop(self, index: int) -> bool:
        """Unlist a shard that is to be computed again (as `add`)."""
        before = self.shards.pop(index)
        return self._record({"drop": index}, index, before)

    def _record(self, change: dict[str, Any], index: int, before: ShardRecord | None) -> bool:
        """Make one change to the shards listed durable: a line appended to the journal, and the manifest
        rewritten whole (which takes in the journal) where the journal outgrows its share of the shards listed:
        so each rewrite follows at least len(shards) / 8 appends, and a job's rewrites cost O(1) a shard in
        all (a job of fewer than 8 shards rewrites it after every one, with no journal). The change goes to a
        journal that has lines even when the manifest is rewritten next: killed before that journal is removed,
        the resumed job takes it in again over the new manifest, which then gets every change of it again,
        each the last word on its shard (without the change, an older line of its shard would be)."""
        rewrite = (self._journaled + 1) * _JOURNAL_SHARE > len(self.shards)
        appended = False
        try:
            if not rewrite or self._journaled:
                self._append(json.dumps(change).encode() + b"\n")
                appended = True
            if rewrite:
                self.save()
        except BaseException:
            if not appended:  # not recorded (a full disk): nor listed here, so that no later save lists it
                if before is None:
                    self.shards.pop(index, None)
                else:
                    self.shards[index] = before
            raise
        return rewrite

    def _append(self, line: bytes) -> None:
        """Append one whole line to the journal, durably; where that fails (a full disk), the journal is cut
        back to its lines before, so that no partial line is followed by another."""
        if self._journal is None:
            self._journal = os.open(self.out_dir / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _fsync_dir(self.out_dir)  # its name, before any line counts on it
        size = os.fstat(self._journal).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._journal, view) :]
            os.fsync(self._journal)
        except BaseException:
            with contextlib.suppress(OSError):  # else a torn last line, which a resume leaves out
                os.ftruncate(self._journal, size)
            self._close_journal()
            raise
        self._journaled += 1

    def finish(self, n_contexts: int) -> None:
        """Mark the job complete, having removed the files of shards it does not list (unlisted past the
        text's end, or written and never recorded): the folder ends with an uninterrupted run's files. Only
        files named as this job names its shards (`shard_name`, its format's suffix) are touched."""
        suffix, keep = self.header.get("file_suffix"), {r.file for r in self.shards.values()}
        for path in self.out_dir.iterdir():
            name = path.name
            if suffix is None or not _SHARD.fullmatch(name) or not name.endswith(suffix) or name in keep:
                continue
            if name == shard_name(int(name[len("acts-") : -len(suffix)]), suffix) and path.is_file():
                log.warning("removing %s, a shard the finished job does not list", path.name)
                try:
                    path.unlink()
                except OSError as e:
                    raise HarvestError(f"cannot remove {path}, a shard the finished job does not list: {e}") from None
        self.complete, self.n_contexts = True, n_contexts
        self.save()

    def to_dict(self) -> dict[str, Any]:
        shards = [asdict(self.shards[i]) for i in sorted(self.shards)]
        return {
            "version": MANIFEST_VERSION,
            **self.header,
            "job": self.job,
            "complete": self.complete,
            "n_contexts": self.n_contexts,
            "n_tokens": None if self.n_contexts is None else self.n_contexts * self.job["context_size"],
            "shards": shards,
        }

    def save(self) -> None:
        """Rewrite the manifest whole, then remove the journal it took in (killed between the two, the
        journal is taken in again on resuming: its changes are each the last word on their shard, so taking
        them in twice changes nothing)."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        write_atomic(self.out_dir / MANIFEST, text.encode("utf-8"))
        journal = self.out_dir / JOURNAL
        if self._journal is not None or journal.is_file():
            self._close_journal()
            journal.unlink(missing_ok=True)
            _fsync_dir(self.out_dir)
        self._journaled = 0


def _journal_changes(path: Path) -> Iterator[ShardRecord | int]:
    """The changes a journal holds, in order: a shard added (its record) or dropped (its index). A last line
    with no newline may be torn (a job killed while appending it, before the shard counted as recorded): it
    is left out. Any other line that cannot be read is a `HarvestError`."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise HarvestError(f"cannot read {path}: {e}") from None
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" after a whole last line
    for number, line in enumerate([*lines, torn] if torn else lines, 1):
        try:
            change = json.loads(line)
            if not isinstance(change, dict) or len(change) != 1:
                raise TypeError(f"it is {clip(change)}, not one change")
            if "add" in change:
                yield ShardRecord.read(change["add"])
            elif isinstance(change.get("drop"), int) and not isinstance(change["drop"], bool):
                yield change["drop"]
            else:
                raise TypeError(f"it is {clip(change)}, neither an add nor a drop")
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: JSON nested too deep
            if torn and number == len(lines) + 1:
                log.warning("%s: its last line is torn (a job killed while writing it): left out", path)
                return
            raise HarvestError(f"{path} is not a harvest journal this version can read (line {number}: {e})") from None
