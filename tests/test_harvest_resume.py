"""What a harvest's output folder holds it to: the tokenizer it started with (its files' sha256, recorded in
the manifest, so a tokenizer edited in place is refused on resume), and one job at a time (a lock a second
job is refused by, at once, and which a killed job leaves holding nothing)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model.harvest import MANIFEST, HarvestError, harvest
from model.harvest.lock import LOCK, FolderLock
from model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
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
    """Edit the tokenizer in place as someone might: its first merge ("Ġ t") removed (from merges.txt, moved
    last: a merges.txt that makes no "Ġt" is refused as cut short)."""
    if (tok_dir / "tokenizer.json").is_file():
        data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
        data["model"]["merges"] = data["model"]["merges"][1:]
        (tok_dir / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    else:
        lines = (tok_dir / "merges.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        (tok_dir / "merges.txt").write_text("".join([lines[0], *lines[2:], lines[1]]), encoding="utf-8")


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


# --- one job per folder ------------------------------------------------------------------------


def refusal(pid: int, out: Path) -> str:
    return f"another harvest job (pid {pid}) is writing to {out}; wait for it or pick another --out"


class SecondJob:
    """A progress that, at the first job's first batch, starts a second job into the same folder."""

    def __init__(self, start: Any) -> None:
        self.start_second, self.refused = start, None

    def start(self, total_tokens: int | None, done_tokens: int) -> None:
        pass

    def advance(self, tokens: int) -> None:
        if self.refused is None:
            with pytest.raises(HarvestError) as e:
                self.start_second()
            self.refused = str(e.value)

    def close(self) -> None:
        pass


def test_a_second_job_is_refused_while_the_first_runs(tiny, tokenizer_dir: Path, source: Path, tmp_path: Path) -> None:
    """Started while another job writes into its folder (here from this process: the lock is per open
    file, not per process), a job is refused at once, in one line naming the holder; the first job goes
    on to the same files as a job run alone, and leaves no lock file."""
    reference = tmp_path / "alone"
    harvest(tiny.path, source, reference, HOOKS, **options(tokenizer_dir))
    out = tmp_path / "acts"
    second = SecondJob(lambda: harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir)))
    assert harvest(tiny.path, source, out, HOOKS, progress=second, **options(tokenizer_dir)).complete
    assert second.refused == refusal(os.getpid(), out)
    assert tree_shas(out) == tree_shas(reference)


def hold_lock(out: Path) -> subprocess.Popen[str]:
    """Another process holding `out`'s lock, as a running job does, until it is killed."""
    code = "import sys; from pathlib import Path; from model.harvest.lock import FolderLock; "
    code += "lock = FolderLock.acquire(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


def test_a_killed_holder_leaves_a_lock_that_blocks_nothing(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path
) -> None:
    """Refused while another process holds the lock, a job changes nothing there (the holder's lock file
    included); once the holder is killed (kill -9), its lock file is left behind and the job resumes."""
    out = tmp_path / "acts"
    harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir))
    whole = tree_shas(out)
    (out / "acts-00001.safetensors").unlink()
    interrupted = tree_shas(out)
    holder = hold_lock(out)
    try:
        with pytest.raises(HarvestError) as e:
            harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir))
        assert str(e.value) == refusal(holder.pid, out)
        held = tree_shas(out)
        assert held.pop(LOCK) and held == interrupted  # the holder's lock file stays, and nothing else changed
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert (out / LOCK).is_file()  # stale: it names a dead process and holds no lock
    assert harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir)).complete
    assert tree_shas(out) == whole


def test_a_stale_lock_file_alone_is_an_empty_folder(tiny, tokenizer_dir: Path, source: Path, tmp_path: Path) -> None:
    """A folder holding only a killed job's lock file (killed before its manifest) takes a new job."""
    out = tmp_path / "acts"
    out.mkdir()
    (out / LOCK).write_text("999999 elsewhere\n")
    assert harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir)).complete
    assert LOCK not in tree_shas(out)


def test_the_refusal_is_one_line_from_the_command_line(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpt2_scripts import harvest as harvest_cli

    out = tmp_path / "acts"
    out.mkdir()
    held = FolderLock.acquire(out)
    assert held is not None
    try:
        argv = [str(source), "--out", str(out), "--model", str(tiny.path), "--tokenizer", str(tokenizer_dir)]
        assert harvest_cli.main([*argv, "--device", "cpu", "--hooks", HOOKS[0]]) == 1
    finally:
        held.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpt2-harvest: error: {refusal(os.getpid(), out)}"]
    assert list(out.iterdir()) == []


def test_a_lock_file_removed_as_its_holder_finishes_is_not_held_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that opened the lock file just before its holder removed it and finished must not take the
    lock of that removed file (a third job would then lock a new file at the same path: two holders)."""
    first = FolderLock.acquire(tmp_path)
    assert first is not None
    real_flock = fcntl.flock

    def flock_after_the_holder_finishes(fd: int, operation: int) -> None:
        monkeypatch.setattr(fcntl, "flock", real_flock)
        first.release()  # between the second job's open and its flock
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_holder_finishes)
    second = FolderLock.acquire(tmp_path)
    assert second is not None
    try:
        with pytest.raises(HarvestError, match=r"another harvest job \(pid \d+\) is writing to"):
            FolderLock.acquire(tmp_path)
    finally:
        second.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("error", "warned"), [(errno.EROFS, False), (errno.EACCES, True)])
def test_a_folder_that_cannot_be_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: int, warned: bool
) -> None:
    """A folder whose lock file cannot be made is used unlocked, with a warning that nothing keeps a second
    job out; not on a read-only filesystem, where no job can write (a complete job's folder is read there,
    and a job that would write fails in one line, which the warning stood before)."""
    real_open = os.open

    def open_but_the_lock(path: str | Path, *args: Any) -> int:
        if str(path).endswith(LOCK):
            raise OSError(error, os.strerror(error))
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", open_but_the_lock)
    with caplog.at_level(logging.WARNING, logger="model.harvest.lock"):
        assert FolderLock.acquire(tmp_path) is None
    assert ("nothing keeps a second harvest job" in caplog.text) == warned


def test_a_lock_whose_file_was_removed_leaves_the_next_holder_s_file(tmp_path: Path) -> None:
    """A job that fails before its first shard removes its folder's files, the lock file included, before it
    lets go of the lock: a job locking a new file there meanwhile keeps it, and a third job is refused."""
    first = FolderLock.acquire(tmp_path)
    assert first is not None
    (tmp_path / LOCK).unlink()  # as `Manifest.discard_if_empty` removes the folder's files
    second = FolderLock.acquire(tmp_path)
    assert second is not None
    first.release()
    try:
        assert (tmp_path / LOCK).is_file()
        with pytest.raises(HarvestError, match=f"^{re.escape(refusal(os.getpid(), tmp_path))}$"):
            FolderLock.acquire(tmp_path)
    finally:
        second.release()
    assert list(tmp_path.iterdir()) == []


# --- the paths a job is given by ---------------------------------------------------------------


def test_a_job_resumes_with_its_paths_spelled_otherwise(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The text named by an absolute path or a relative one, the model's folder with a trailing slash or from
    another working directory: one job, resumed (it was refused, its text said to be "other files"); text that
    did change is still refused, naming the file."""
    out = tmp_path / "acts"
    monkeypatch.chdir(source.parent)
    harvest(str(tiny.path), source.name, out, HOOKS, **options(tokenizer_dir))
    shards = {k: v for k, v in tree_shas(out).items() if k.startswith("acts-")}
    (out / "acts-00002.safetensors").unlink()  # a shard the resume computes again
    monkeypatch.chdir(tmp_path)
    manifest = harvest(str(tiny.path) + "/", str(source.resolve()), out, HOOKS, **options(tokenizer_dir))
    assert manifest.complete and {k: v for k, v in tree_shas(out).items() if k.startswith("acts-")} == shards
    moved = tmp_path / "elsewhere.jsonl"
    moved.write_text(source.read_text(encoding="utf-8").replace('"the ', '"a ', 1), encoding="utf-8")
    with pytest.raises(HarvestError, match=r"other arguments \(source: docs.jsonl gone, elsewhere.jsonl new\)"):
        harvest(str(tiny.path), moved, out, HOOKS, **options(tokenizer_dir))


@pytest.mark.parametrize(("fmt", "suffix"), [("safetensors", "safetensors"), ("saelens", "arrow")])
def test_a_job_in_a_folder_whose_name_is_not_utf8_resumes(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, fmt: str, suffix: str
) -> None:
    """Linux names a folder with any bytes: a job there is written, and resumed over its listed shards (their
    token ids read back: safetensors shards by our own reader, as dumps and SAEs are, Arrow ones through a
    path given to Arrow as bytes; a str path that is not UTF-8 was an error)."""
    out = tmp_path / os.fsdecode(b"acts-\xe9")
    harvest(str(tiny.path), source, out, HOOKS, **options(tokenizer_dir), format=fmt)
    shards = {k: v for k, v in tree_shas(out).items() if k.startswith("acts-")}
    (out / f"acts-00001.{suffix}").unlink()  # a shard the resume computes again, beside those it reads
    manifest = harvest(str(tiny.path), source, out, HOOKS, **options(tokenizer_dir), format=fmt)
    assert manifest.complete and {k: v for k, v in tree_shas(out).items() if k.startswith("acts-")} == shards


def test_a_job_resumes_with_its_model_named_from_elsewhere_or_copied(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weight files are identified by content: a model folder named by a relative path from another
    working directory, or a copy of it at another path, resumes the job (the first was refused, its saved
    relative path resolved against the new directory); other weights are still refused."""
    (tmp_path / "a").mkdir()
    shutil.copytree(tiny.path, tmp_path / "a" / "ckpt")
    out = tmp_path / "acts"
    monkeypatch.chdir(tmp_path / "a")
    harvest("ckpt", source, out, HOOKS, **options(tokenizer_dir))
    whole = tree_shas(out)
    for model, cwd in (("a/ckpt", tmp_path), (str(tmp_path / "copy"), tmp_path / "a")):
        if model.endswith("copy"):
            shutil.copytree(tiny.path, model)
        (out / "acts-00001.safetensors").unlink()
        monkeypatch.chdir(cwd)
        assert harvest(model, source, out, HOOKS, **options(tokenizer_dir)).complete
        assert {k: v for k, v in tree_shas(out).items() if k != MANIFEST} == {
            k: v for k, v in whole.items() if k != MANIFEST
        }
    other = tmp_path / "other"
    shutil.copytree(tiny.path, other)
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    with pytest.raises(HarvestError, match=r"weights: model.safetensors changed"):
        harvest(str(other), source, out, HOOKS, **options(tokenizer_dir))


# --- what the shards hold ----------------------------------------------------------------------


class Counted:
    """A progress that adds up what it is told until it is closed, as a bar shows it (tqdm ignores what
    comes after `close`): at the end, the finished job's tokens."""

    def __init__(self) -> None:
        self.done, self.closed = 0, False

    def start(self, total_tokens: int | None, done_tokens: int) -> None:
        self.done = done_tokens

    def advance(self, tokens: int) -> None:
        assert not self.closed, "advanced after close"
        self.done += tokens

    def retract(self, tokens: int) -> None:
        assert not self.closed, "retracted after close"
        self.done -= tokens

    def close(self) -> None:
        self.closed = True


def test_a_listed_shard_of_other_text_is_computed_again(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A listed shard whose token ids are not the contexts the source gives now (a file that changed while a
    job read it, stopping it, and was put back: the shards made from the edited text stay listed) is computed
    again on resume, so the folder ends as an uninterrupted run's. Before, the resume kept it."""
    ref = tmp_path / "ref"
    harvest(tiny.path, source, ref, HOOKS, **options(tokenizer_dir))
    edited = tmp_path / "edited" / source.name  # the same documents but the third
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    edited.parent.mkdir()
    edited.write_text("".join([*lines[:2], json.dumps({"text": "an edit"}) + "\n", *lines[3:]]), encoding="utf-8")
    other = tmp_path / "other"
    harvest(tiny.path, edited, other, HOOKS, **options(tokenizer_dir))
    out = tmp_path / "acts"
    shutil.copytree(ref, out)
    saved = json.loads((out / MANIFEST).read_text())
    theirs = json.loads((other / MANIFEST).read_text())["shards"]
    changed = [r["file"] for r, o in zip(saved["shards"], theirs, strict=True) if r["sha256"] != o["sha256"]]
    assert changed and len(changed) < len(saved["shards"])
    for record in saved["shards"]:  # as the stopped job left them: listed, from the edited text
        if record["file"] in changed:
            shutil.copy(other / record["file"], out / record["file"])
            record |= {"sha256": hashlib.sha256((out / record["file"]).read_bytes()).hexdigest()}
    saved |= {"complete": False, "n_contexts": None, "n_tokens": None}
    (out / MANIFEST).write_text(json.dumps(saved))
    counted = Counted()
    with caplog.at_level(logging.WARNING, logger="model.harvest.job"):
        manifest = harvest(tiny.path, source, out, HOOKS, progress=counted, **options(tokenizer_dir))
    assert manifest.complete
    assert f"shard {changed[0]} holds other text" in caplog.text
    assert tree_shas(out) == tree_shas(ref)
    assert counted.done == manifest.n_contexts * 16  # a shard computed again is counted once


def test_a_job_of_a_loaded_model_resumes_only_with_its_weights(
    tiny, tiny_hub, tokenizer_dir: Path, source: Path, tmp_path: Path
) -> None:
    """`harvest(..., loaded=...)` has no weight files to identify: the model's tensors' sha256 stands for them,
    so a job resumed with another model (same shape, other weights) is refused, and the same checkpoint loaded
    again resumes it. Before, it mixed the two models' shards."""
    from model.loading import load

    def loaded(checkpoint: Any) -> Any:
        return load(checkpoint.path, tokenizer_dir=tokenizer_dir, device="cpu", dtype="float32")

    out = tmp_path / "acts"
    given = {k: v for k, v in options(tokenizer_dir).items() if k not in ("tokenizer", "device")}  # loaded's own
    harvest("tiny", source, out, HOOKS, loaded=loaded(tiny), **given)
    whole = tree_shas(out)
    saved = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps(saved | {"complete": False, "shards": saved["shards"][:2]}))
    with pytest.raises(HarvestError, match=r"weights: \(the loaded model's tensors\) changed"):
        harvest("tiny", source, out, HOOKS, loaded=loaded(tiny_hub), **given)
    assert harvest("tiny", source, out, HOOKS, loaded=loaded(tiny), **given).complete
    assert tree_shas(out) == whole
    # what would load a model is refused beside one loaded already (a dtype was ignored: float32 shards)
    for option in ({"dtype": "float16"}, {"tokenizer": str(tokenizer_dir)}, {"device": "cpu"}):
        with pytest.raises(HarvestError, match=f"harvest: {next(iter(option))} choose how to load the model"):
            harvest("tiny", source, tmp_path / "other", HOOKS, loaded=loaded(tiny), **given, **option)


def test_a_finished_saelens_folder_gets_its_dataset_files_back(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path
) -> None:
    """A finished job in SAELens' format run again writes `state.json` and `dataset_info.json` anew: a folder
    whose copies were lost or damaged loads again. Before, it said the job was complete and the folder did
    not load."""
    datasets = pytest.importorskip("datasets", reason="datasets (the harvest extra) is not installed")
    out = tmp_path / "cache"
    n = harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir), format="saelens").n_contexts
    whole = tree_shas(out)
    (out / "state.json").unlink()
    (out / "dataset_info.json").write_text("{", encoding="utf-8")
    assert harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir), format="saelens").complete
    assert tree_shas(out) == whole
    assert len(datasets.load_from_disk(str(out))) == n


def test_a_finished_saelens_folder_whole_is_only_read(tiny, tokenizer_dir: Path, source: Path, tmp_path: Path) -> None:
    """Run again, a finished job in SAELens' format leaves `state.json` and `dataset_info.json` as they are
    (the same files, not rewritten): a finished folder on a read-only disk runs again."""
    pytest.importorskip("datasets", reason="datasets (the harvest extra) is not installed")
    out = tmp_path / "cache"
    harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir), format="saelens")
    before = {name: (out / name).stat().st_ino for name in ("state.json", "dataset_info.json")}
    assert harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir), format="saelens").complete
    assert {name: (out / name).stat().st_ino for name in before} == before


def test_saelens_state_lists_the_shards_in_their_contexts_order(tmp_path: Path) -> None:
    """Past shard 99,999 the names' own order is not the contexts': acts-100000 sorts before acts-99999."""
    from types import SimpleNamespace

    import torch

    from model.harvest.job import write_dataset_files
    from model.harvest.shards import ShardRecord, shard_name

    pytest.importorskip("datasets", reason="datasets (the harvest extra) is not installed")
    records = [ShardRecord(i, shard_name(i, ".arrow"), 1, i, "0" * 64, 1) for i in (99_998, 100_000, 99_999)]
    manifest = SimpleNamespace(out_dir=tmp_path, shards={r.index: r for r in records})
    plan = SimpleNamespace(shapes={"blocks.0.hook_resid_pre": [16, 8]}, spec=SimpleNamespace(context_size=16))
    plan.dtype = torch.float32
    write_dataset_files(manifest, plan)  # type: ignore[arg-type]
    files = [f["filename"] for f in json.loads((tmp_path / "state.json").read_text())["_data_files"]]
    assert files == ["acts-99998.arrow", "acts-99999.arrow", "acts-100000.arrow"]


def test_listed_shards_past_the_text_s_end_are_unlisted(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shards listed past the contexts the text gives now (made from a longer text: a file that grew while a
    job read it and was put back) are unlisted before the job is marked complete, and their files removed:
    the folder ends as an uninterrupted run's. Before, they stayed listed in a finished job, and then their
    files stayed."""
    ref = tmp_path / "ref"
    opts = options(tokenizer_dir) | {"max_tokens": None}
    harvest(tiny.path, source, ref, HOOKS, **opts)
    longer = tmp_path / "longer" / source.name
    longer.parent.mkdir()
    longer.write_text(source.read_text(encoding="utf-8") * 2, encoding="utf-8")
    out = tmp_path / "acts"
    harvest(tiny.path, longer, out, HOOKS, **opts)
    saved = json.loads((out / MANIFEST).read_text())
    assert len(saved["shards"]) > len(json.loads((ref / MANIFEST).read_text())["shards"])
    saved["job"]["source"] = json.loads((ref / MANIFEST).read_text())["job"]["source"]  # as the stopped job began
    (out / MANIFEST).write_text(json.dumps(saved | {"complete": False, "n_contexts": None, "n_tokens": None}))
    counted = Counted()
    with caplog.at_level(logging.WARNING, logger="model.harvest.job"):
        manifest = harvest(tiny.path, source, out, HOOKS, progress=counted, **opts)
    assert manifest.complete
    assert "lie past the text's end now" in caplog.text
    assert counted.done == manifest.n_contexts * 16  # the shards unlisted are not counted
    assert json.loads((out / MANIFEST).read_text()) == json.loads((ref / MANIFEST).read_text())
    assert tree_shas(out) == tree_shas(ref)


def test_a_record_that_is_not_its_contexts_is_computed_again(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A listed shard whose record names other rows, another first context or another shard's file (edited
    by hand; its sha256 still right) is computed again, and the folder ends as an uninterrupted run's."""
    ref = tmp_path / "ref"
    harvest(tiny.path, source, ref, HOOKS, **options(tokenizer_dir))
    for field, value in (("rows", 7), ("first_context", 999), ("file", "acts-00000.safetensors")):
        out = tmp_path / f"edited-{field}"
        shutil.copytree(ref, out)
        saved = json.loads((out / MANIFEST).read_text())
        saved["shards"][1][field] = value
        if field == "file":
            saved["shards"][1] |= {k: saved["shards"][0][k] for k in ("sha256", "bytes")}
        (out / MANIFEST).write_text(json.dumps(saved | {"complete": False, "n_contexts": None, "n_tokens": None}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="model.harvest.job"):
            harvest(tiny.path, source, out, HOOKS, **options(tokenizer_dir))
        assert "shard 1's record" in caplog.text and "computing it again" in caplog.text
        assert tree_shas(out) == tree_shas(ref), field


@pytest.mark.parametrize("damaged", ["manifest", "journal"])
def test_json_nested_past_python_s_depth_is_refused_in_words(tmp_path: Path, damaged: str) -> None:
    """200,000 nested brackets (json.loads recurses): an error naming the file, not a RecursionError."""
    from model.harvest.shards import JOURNAL, Manifest

    out = tmp_path / "acts"
    with Manifest.open(out, JOB, {}) as manifest:
        for r in _records(out, 10):
            manifest.add(r)
    name = MANIFEST if damaged == "manifest" else JOURNAL
    (out / name).write_bytes(b"[" * 200_000 + b"\n")
    with pytest.raises(HarvestError, match=f"{re.escape(name)} is not a harvest {damaged} this version can read"):
        Manifest.open(out, JOB, {})


def test_a_refused_folder_keeps_its_files(tmp_path: Path) -> None:
    """A folder whose only entry is a `manifest.json` that is not a file (a dangling link) is refused, and
    keeps it: only a manifest this job began writing is taken back."""
    from model.harvest.shards import Manifest

    (tmp_path / MANIFEST).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(HarvestError, match=r"not empty and holds no manifest\.json"):
        Manifest.open(tmp_path, {"context_size": 4}, {})
    assert (tmp_path / MANIFEST).is_symlink()


def test_an_output_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    """A folder that cannot be made (under a file; under /proc, which takes none) is a HarvestError naming the
    folder, not the OS's bare "No such file or directory"."""
    from model.harvest.shards import Manifest

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(HarvestError, match=r"cannot make the output folder .*a-file/acts: Not a directory"):
        Manifest.open(tmp_path / "a-file" / "acts", {"context_size": 4}, {})


# --- the journal: each shard recorded at O(1) cost, the manifest rewritten now and then ---------


class StopAfter:
    """A progress that stops the job (as Ctrl-C would) once `batches` batches are done."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def start(self, total_tokens: int | None, done_tokens: int) -> None:
        pass

    def advance(self, tokens: int) -> None:
        self.batches -= 1
        if self.batches < 0:
            raise KeyboardInterrupt

    def close(self) -> None:
        pass


@pytest.mark.parametrize("fmt", ["safetensors", "saelens"])
def test_a_job_stopped_with_shards_in_its_journal_resumes_to_the_same_files(
    tiny, tokenizer_dir: Path, source: Path, tmp_path: Path, fmt: str
) -> None:
    """Forty one-context shards, stopped after thirty-three: the manifest lists fewer (it is rewritten when
    the journal would outgrow an eighth of the shards), the journal lists the rest, and the resumed job takes
    it in and ends byte for byte as an uninterrupted run, with no journal left."""
    from model.harvest.shards import JOURNAL

    if fmt == "saelens":
        pytest.importorskip("datasets", reason="datasets (the harvest extra) is not installed")
    kwargs = options(tokenizer_dir) | {"shard_size": 1, "batch_size": 1, "max_tokens": 16 * 40, "format": fmt}
    ref = tmp_path / "ref"
    harvest(tiny.path, source, ref, HOOKS, **kwargs)
    assert len(json.loads((ref / MANIFEST).read_text())["shards"]) == 40 and not (ref / JOURNAL).exists()
    out = tmp_path / "acts"
    with pytest.raises(KeyboardInterrupt):
        harvest(tiny.path, source, out, HOOKS, progress=StopAfter(33), **kwargs)
    listed = json.loads((out / MANIFEST).read_text())["shards"]
    journal = [json.loads(line) for line in (out / JOURNAL).read_text().splitlines()]
    assert [c["add"]["index"] for c in journal] == list(range(len(listed), 33))
    assert 2 <= len(journal) and len(journal) * 8 <= 33  # within its eighth of the shards
    manifest = harvest(tiny.path, source, out, HOOKS, **kwargs)
    assert manifest.complete and len(manifest.shards) == 40
    assert tree_shas(out) == tree_shas(ref)


def _records(out: Path, n: int, start: int = 0) -> list[Any]:
    """`n` shard files written into `out` (a few bytes each) and their records."""
    from model.harvest.shards import ShardRecord, shard_name, write_atomic

    records = []
    for i in range(start, start + n):
        name, data = shard_name(i, ".safetensors"), f"shard {i}".encode()
        records.append(ShardRecord(i, name, 1, i, write_atomic(out / name, data), len(data)))
    return records


JOB = {"context_size": 16, "model": "m", "source": {"kind": "files", "files": []}}


def test_recording_shards_costs_o1_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewriting the whole manifest after every shard wrote N^2 / 2 records for N shards (260 s at 6,605):
    with the journal, every rewrite follows at least an eighth of the shards' appends, so the records written
    in all stay within ten per shard."""
    from model.harvest.shards import JOURNAL, Manifest

    written = []
    to_dict = Manifest.to_dict
    monkeypatch.setattr(Manifest, "to_dict", lambda self: written.append(len(self.shards)) or to_dict(self))
    out = tmp_path / "acts"
    with Manifest.open(out, JOB, {}) as manifest:
        records = _records(out, 3000)
        rewrites = sum(manifest.add(r) for r in records)
        assert rewrites == len(written) - 1  # one when the manifest was made
        assert sum(written) <= 10 * len(records) and rewrites < 80
        assert (out / JOURNAL).is_file()
        manifest.finish(3000)
    saved = json.loads((out / MANIFEST).read_text())
    assert saved["complete"] and [r["index"] for r in saved["shards"]] == list(range(3000))
    assert not (out / JOURNAL).exists()


def test_the_journal_is_taken_in_on_resume(tmp_path: Path) -> None:
    """Killed with changes in the journal (adds, a drop, and a torn last line, as a kill while appending
    leaves it): the resumed manifest lists what was durably recorded, the torn line left out, and the
    journal is folded into the manifest and removed."""
    from model.harvest.shards import JOURNAL, Manifest

    out = tmp_path / "acts"
    manifest = Manifest.open(out, JOB, {})
    records = _records(out, 31)
    for r in records[:30]:
        manifest.add(r)
    manifest.drop(17)
    manifest.add(records[30])
    manifest.close()  # as a kill leaves it: the journal holds what the manifest does not
    journal = (out / JOURNAL).read_bytes()
    assert b'"drop": 17' in journal and len(json.loads((out / MANIFEST).read_text())["shards"]) == 29
    (out / JOURNAL).write_bytes(journal + b'{"add": {"index": 31, "file": "acts-00031.safe')  # torn
    with Manifest.open(out, JOB, {}) as resumed:
        assert sorted(resumed.shards) == [i for i in range(31) if i != 17]
    assert not (out / JOURNAL).exists()
    assert [r["index"] for r in json.loads((out / MANIFEST).read_text())["shards"]] == sorted(resumed.shards)


def test_a_journal_taken_in_twice_changes_nothing(tmp_path: Path) -> None:
    """Killed after the manifest was rewritten but before the journal it took in was removed: taking the
    journal in again (each change the last word on its shard) gives the same shards."""
    from model.harvest.shards import JOURNAL, Manifest

    out = tmp_path / "acts"
    manifest = Manifest.open(out, JOB, {})
    for r in _records(out, 40):
        manifest.add(r)
    manifest.drop(10)
    manifest.add(_records(out, 1, start=10)[0])  # shard 10 again
    manifest.drop(11)
    manifest.close()
    journal = (out / JOURNAL).read_bytes()
    assert journal.count(b"\n") == 4  # shard 39, and the three changes
    with Manifest.open(out, JOB, {}) as once:
        first = dict(once.shards)
    (out / JOURNAL).write_bytes(journal)  # as if the removal had not happened
    with Manifest.open(out, JOB, {}) as twice:
        assert twice.shards == first and sorted(first) == [i for i in range(40) if i != 11]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"not json", "is not a harvest journal this version can read"),
        (b'{"add": {"index": 3}}', "is not a harvest journal this version can read"),
        (b'{"drop": true}', "neither an add nor a drop"),
        (b'{"add": 1, "drop": 2}', "not one change"),
    ],
)
@pytest.mark.parametrize("last", [False, True])
def test_a_damaged_journal_line_is_refused_in_words(tmp_path: Path, line: bytes, message: str, last: bool) -> None:
    """A line that cannot be read, first or last (a whole last line, ending in its newline, is not torn):
    the resume is refused, naming the journal, and the journal is left as it was."""
    from model.harvest.shards import JOURNAL, Manifest

    out = tmp_path / "acts"
    with Manifest.open(out, JOB, {}) as manifest:
        for r in _records(out, 10):
            manifest.add(r)
    whole = (out / JOURNAL).read_bytes()
    damaged = whole + line + b"\n" if last else line + b"\n" + whole
    (out / JOURNAL).write_bytes(damaged)
    with pytest.raises(HarvestError, match=re.escape(message)) as e:
        Manifest.open(out, JOB, {})
    number = len(whole.splitlines()) + 1 if last else 1
    assert JOURNAL in str(e.value) and f"(line {number}: " in str(e.value)
    assert (out / JOURNAL).read_bytes() == damaged


def test_killed_after_any_rewrite_the_journal_taken_in_again_gives_that_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the manifest was rewritten and before the journal it took in was removed, at every rewrite
    of 400 random adds, drops and adds again: the resumed manifest lists exactly the shards listed then. (When
    the change that set off the rewrite was not in the journal, a shard dropped and then added again, or
    added and then dropped, came back as its older line said.)"""
    from model.harvest.shards import JOURNAL, Manifest

    out = tmp_path / "acts"
    snapshots: list[tuple[Path, dict[int, Any]]] = []
    save = Manifest.save

    def save_and_snapshot(self: Manifest) -> None:
        journal = (out / JOURNAL).read_bytes() if (out / JOURNAL).is_file() else None
        save(self)
        if journal is not None and self.out_dir == out:  # the kill: the rewrite done, the journal still there
            copy = tmp_path / f"killed-{len(snapshots)}"
            shutil.copytree(out, copy, ignore=shutil.ignore_patterns(LOCK))
            (copy / JOURNAL).write_bytes(journal)
            snapshots.append((copy, dict(self.shards)))

    monkeypatch.setattr(Manifest, "save", save_and_snapshot)
    rnd = random.Random(0)
    with Manifest.open(out, JOB, {}) as manifest:
        records = _records(out, 60)
        for _ in range(400):
            listed = sorted(manifest.shards)
            if listed and rnd.random() < 0.4:
                manifest.drop(rnd.choice(listed))
            else:
                manifest.add(rnd.choice(records))
    assert len(snapshots) >= 10
    for copy, shards in snapshots:
        with Manifest.open(copy, JOB, {}) as resumed:
            assert resumed.shards == shards, copy.name


def test_a_finished_job_s_leftover_journal_is_only_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished job killed between its last rewrite and the journal's removal: started again, nothing is
    written (its folder may be on a read-only disk); the journal, which adds nothing, is removed where it can
    be."""
    from model.harvest import shards as shards_module
    from model.harvest.shards import JOURNAL, Manifest

    out = tmp_path / "acts"
    with Manifest.open(out, JOB, {}) as manifest:
        for r in _records(out, 40):
            manifest.add(r)
        journal = (out / JOURNAL).read_bytes()
        manifest.finish(40)
    manifest_bytes = (out / MANIFEST).read_bytes()

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(shards_module, "write_atomic", read_only)
    for removable in (True, False):
        (out / JOURNAL).write_bytes(journal)
        if not removable:
            monkeypatch.setattr(Path, "unlink", read_only)
        with Manifest.open(out, JOB, {}) as resumed:
            assert resumed.complete and sorted(resumed.shards) == list(range(40))
        monkeypatch.undo() if not removable else None
        assert (out / JOURNAL).exists() != removable
        assert (out / MANIFEST).read_bytes() == manifest_bytes


def test_a_failed_append_leaves_whole_lines_and_lets_go_of_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk in the middle of a journal line: the error is the job's, the journal is cut back to its
    whole lines (so no torn line is followed by another), and the folder's lock is let go, so that the same
    process (a server, a notebook) can start the job there again."""
    from model.harvest import shards as shards_module
    from model.harvest.shards import JOURNAL, Manifest

    out = tmp_path / "acts"
    manifest = Manifest.open(out, JOB, {})
    records = _records(out, 40)
    for r in records[:30]:
        manifest.add(r)
    before = (out / JOURNAL).read_bytes()
    assert before
    write = os.write

    def half_then_full(fd: int, data: Any) -> int:
        if len(data) > 8:
            return write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards_module.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        manifest.add(records[30])
    monkeypatch.undo()
    assert (out / JOURNAL).read_bytes() == before
    assert 30 not in manifest.shards  # not recorded, so not listed: no later save could list it
    manifest.close()
    with Manifest.open(out, JOB, {}) as resumed:  # the lock let go; the line that failed is not listed
        assert sorted(resumed.shards) == list(range(30))


def test_a_change_whose_rewrite_fails_is_not_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk as the manifest is rewritten with no journal to take the change: the shard is not listed
    in memory either (a drop is undone likewise), and the manifest on disk is the one before."""
    from model.harvest import shards as shards_module
    from model.harvest.shards import Manifest

    def full(*args: Any, **kwargs: Any) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "acts"
    with Manifest.open(out, JOB, {}) as manifest:
        records = _records(out, 3)
        manifest.add(records[0])
        manifest.add(records[1])
        before = (out / MANIFEST).read_bytes()
        monkeypatch.setattr(shards_module, "write_atomic", full)
        with pytest.raises(OSError, match="No space left"):
            manifest.add(records[2])
        with pytest.raises(OSError, match="No space left"):
            manifest.drop(1)
        assert sorted(manifest.shards) == [0, 1] and (out / MANIFEST).read_bytes() == before


def test_finishing_removes_only_this_job_s_unlisted_shards(tmp_path: Path) -> None:
    """At the finish, a shard file of this job's names that the manifest does not list goes; the other
    format's shards, names this job would not write (more zeros), a folder of a shard's name and the user's
    own files stay, and the job finishes."""
    from model.harvest.shards import Manifest, write_atomic

    out = tmp_path / "acts"
    with Manifest.open(out, JOB, {"file_suffix": ".safetensors"}) as manifest:
        for r in _records(out, 3):
            manifest.add(r)
        for name in ("acts-00012.safetensors", "acts-00013.arrow", "acts-0000014.safetensors", "notes.txt"):
            write_atomic(out / name, b"x")
        (out / "acts-00015.safetensors").mkdir()
        manifest.finish(3)
    names = sorted(p.name for p in out.iterdir() if p.name != LOCK)
    assert names == sorted(
        [
            "acts-00000.safetensors",
            "acts-00001.safetensors",
            "acts-00002.safetensors",
            "acts-0000014.safetensors",
            "acts-00013.arrow",
            "acts-00015.safetensors",
            MANIFEST,
            "notes.txt",
        ]
    )
    assert json.loads((out / MANIFEST).read_text())["complete"]


def test_a_manifest_that_lists_a_shard_twice_is_refused(tmp_path: Path) -> None:
    from model.harvest.shards import Manifest

    out = tmp_path / "acts"
    with Manifest.open(out, JOB, {}) as manifest:
        for r in _records(out, 3):
            manifest.add(r)
    saved = json.loads((out / MANIFEST).read_text())
    saved["shards"].append(saved["shards"][1])
    (out / MANIFEST).write_text(json.dumps(saved))
    with pytest.raises(HarvestError, match=r"is not a harvest manifest this version can read \(it lists a shard twice"):
        Manifest.open(out, JOB, {})
