"""The harvest job: text in, activations at chosen hooks out, as resumable shards.

`harvest(...)` runs it in this process; `model.harvest.ray_data` runs the same job on a Ray cluster. Both
share what is here: the job's arguments (`HarvestSpec`), their resolution against the model (`Plan`: hook
names, shapes, shard size), the contexts each shard gets (`shard_tokens`), one shard's forward passes
(`compute_shard`, through `run_with_cache`, which stops after the last hook wanted and never runs the LM
head unless asked for it) and its bytes (`encode_shard`). A shard's batches are always its own (a shard of
S contexts runs as ceil(S / batch_size) batches), so whichever process computes it, it holds the same bytes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..config import ConfigError, GPTConfig
from ..gpt import GPT
from ..hooks import UnknownHookError, is_attention_square, run_with_cache, select_hooks, site_shape
from ..loading import (
    DTYPE_NAMES,
    INT8,
    LoadedModel,
    LoadError,
    check_tokenizer_fits,
    load_from,
    locate,
    resolve_device,
    resolve_dtype,
)
from ..overflow import dtype_range
from ..safetensors_file import SafetensorsFile
from ..tokenizer import EOT, Tokenizer, TokenizerError, tokenizer_files
from . import saelens
from .errors import HarvestError
from .shards import Manifest, ShardRecord, sha256_file, shard_name, write_atomic
from .text import open_source, pack, tokenize

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "saelens")
SHARD_TARGET_BYTES = 256 << 20  # the default shard size aims at this much activation data per shard


@dataclass(frozen=True)
class HarvestSpec:
    """Everything a harvest job is asked: `model` and `source` as `load` and `open_source` take them,
    `hooks` as names or globs. A restart with equal arguments resumes the job."""

    model: str
    source: str
    hooks: tuple[str, ...]
    text_field: str = "text"
    context_size: int = 128
    prepend_bos: bool = True
    batch_size: int = 32
    max_tokens: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    shard_size: int | None = None  # contexts per shard; None: about SHARD_TARGET_BYTES of activations
    format: str = "safetensors"
    revision: str | None = None
    preset: str | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        for name in ("context_size", "batch_size", "max_tokens", "shard_size"):
            value = getattr(self, name)
            if value is None and name in ("max_tokens", "shard_size"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HarvestError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
            if value > sys.maxsize:
                raise HarvestError(f"{name.replace('_', '-')} must be at most {sys.maxsize}, got {value}")
        if not isinstance(self.prepend_bos, bool):  # "no" read as true, and recorded as given
            raise HarvestError(f"prepend-bos must be True or False, got {self.prepend_bos!r}")
        if self.format not in FORMATS:
            raise HarvestError(f"unknown format {self.format!r}; valid: {', '.join(FORMATS)}")
        if not self.hooks:
            raise HarvestError("no hooks asked for: name at least one hook or glob (e.g. blocks.8.hook_resid_pre)")
        if self.max_tokens is not None and self.max_tokens < self.context_size:
            raise HarvestError(
                f"max-tokens {self.max_tokens} is less than one context of {self.context_size} tokens: "
                "nothing to harvest"
            )
        if self.dtype not in ("auto", INT8, *DTYPE_NAMES):
            raise HarvestError(f"unknown dtype {self.dtype!r}; use auto, float32, float16, bfloat16 or int8")


@dataclass(frozen=True)
class Plan:
    """A spec resolved against the model: what the driver and every worker agree on."""

    spec: HarvestSpec
    names: tuple[str, ...]  # hook names, in model order
    shapes: dict[str, list[int]]  # one context's shape at each hook
    dtype: torch.dtype  # of the activations computed
    shard_size: int
    max_contexts: int | None
    bos_id: int | None
    separator_id: int
    source: dict[str, Any] = field(default_factory=dict)  # what identifies the text
    weights: list[dict[str, Any]] | None = None  # what identifies the weight files (None: a model given loaded)
    device: str = "cpu"  # the kind of device the shards are computed on: their rounding depends on it
    tokenizer_files: list[dict[str, Any]] | None = None  # what identifies the tokenizer's files (None: loaded)

    @property
    def suffix(self) -> str:
        return saelens.SUFFIX if self.spec.format == "saelens" else ".safetensors"

    @property
    def stored_dtype(self) -> torch.dtype:
        return saelens.stored_dtype(self.dtype) if self.spec.format == "saelens" else self.dtype

    def job(self) -> dict[str, Any]:
        """The arguments that decide every shard's bytes: a restart must give the same."""
        s = self.spec
        return {
            "model": s.model,
            "revision": s.revision,
            "preset": s.preset,
            "tokenizer": s.tokenizer,
            "device": self.device,  # resolved: "auto" could mean a GPU's rounding before a restart and a CPU's after
            "dtype": _dtype_name(self.dtype) if s.dtype != INT8 else INT8,
            "hooks": list(self.names),
            "text_field": s.text_field,
            "context_size": s.context_size,
            "prepend_bos": s.prepend_bos,
            "batch_size": s.batch_size,
            "max_contexts": self.max_contexts,
            "shard_size": self.shard_size,
            "format": s.format,
            "source": self.source,
            "weights": self.weights,
            "tokenizer_files": self.tokenizer_files,
        }

    def header(self, model_name: str, revision: str | None) -> dict[str, Any]:
        """What the shards hold, for their readers."""
        s = self.spec
        return {
            "model": model_name,
            "revision": revision,
            "format": s.format,
            "file_suffix": self.suffix,
            "hooks": list(self.names),
            "shapes": self.shapes,
            "dtype": _dtype_name(self.stored_dtype),
            "token_ids": {"dtype": "int32", "shape": [s.context_size]},
            "packing": {
                "context_size": s.context_size,
                "prepend_bos": s.prepend_bos,
                "bos_token_id": self.bos_id,
                "separator": EOT,
                "separator_token_id": self.separator_id,
                "text_field": s.text_field,
                "source": str(s.source),
                "method": "SAELens concat_and_batch_sequences: a BOS opens each context, <|endoftext|> "
                "between documents, documents run on into the next context, the last partial context dropped",
            },
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_plan(
    spec: HarvestSpec,
    config: GPTConfig,
    tokenizer: Tokenizer,
    dtype: torch.dtype,
    weights: list[dict[str, Any]] | None = None,
    device: str = "cpu",
    tokenizer_files: list[dict[str, Any]] | None = None,
    out_dir: str | Path | None = None,
) -> Plan:
    """Resolve `spec` against the model's shape: hooks, shapes, shard size; bad values are `HarvestError`s.
    `weights` and `tokenizer_files` identify the weight files and the tokenizer's (`files_identity`), so
    that a resume refuses others at the same paths; `device` is the kind of device that computes the shards
    (cpu, cuda, mps); `out_dir`, the job's output folder, is never read as text."""
    if spec.context_size > config.n_positions:
        raise HarvestError(f"context size {spec.context_size} is more than the model's {config.n_positions} positions")
    try:
        names = select_hooks(spec.hooks, config.n_layer)
    except UnknownHookError as e:
        raise HarvestError(str(e)) from None
    T = spec.context_size
    shapes: dict[str, list[int]] = {}
    for name in names:
        site = site_shape(name, config.n_head, config.d_head, config.d_mlp, config.vocab_size)
        if is_attention_square(name):
            shapes[name] = [site[0], T, T]
        elif spec.format == "saelens":  # a per-head site's heads as one vector, as SAELens' ActivationsStore has them
            shapes[name] = [T, math.prod(site)]
        else:
            shapes[name] = [T, *site]
    if spec.format == "saelens":
        saelens.check_hooks(shapes)
        saelens.stored_dtype(dtype)
    bytes_per_context = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize + 4 * T
    if spec.shard_size is not None:
        shard_size = spec.shard_size
    else:  # a whole number of batches, about SHARD_TARGET_BYTES
        batches = max(1, SHARD_TARGET_BYTES // (bytes_per_context * spec.batch_size))
        shard_size = batches * spec.batch_size
    max_contexts = None if spec.max_tokens is None else spec.max_tokens // T
    source = open_source(spec.source, spec.text_field, out_dir)
    eot = tokenizer.eot_id
    return Plan(
        spec,
        tuple(names),
        shapes,
        dtype,
        shard_size,
        max_contexts,
        eot if spec.prepend_bos else None,
        eot,
        source.describe(),
        weights,
        device,
        tokenizer_files,
    )


def shard_tokens(plan: Plan, tokenizer: Tokenizer, out_dir: Path) -> Iterator[tuple[int, int, np.ndarray]]:
    """(shard index, first context's number, token ids [rows, context] int32) for every shard of the job
    writing into `out_dir`, in order; every shard but the last has `plan.shard_size` rows."""
    spec = plan.spec
    source = open_source(spec.source, spec.text_field, out_dir)
    documents = source.documents(plan.source)  # checked against the files the job began with
    contexts = pack(tokenize(documents, tokenizer), spec.context_size, plan.bos_id, plan.separator_id)
    if plan.max_contexts is not None:
        contexts = islice(contexts, plan.max_contexts)
    index = first = 0
    while chunk := list(islice(contexts, plan.shard_size)):
        yield index, first, np.asarray(chunk, dtype=np.int32)
        index, first = index + 1, first + len(chunk)


def compute_shard(
    model: GPT, tokens: np.ndarray, names: tuple[str, ...], batch_size: int, on_batch: Any = None
) -> dict[str, torch.Tensor]:
    """The activations at `names` for token ids [rows, context], on the CPU, in batches of `batch_size`;
    `on_batch(tokens)` is told after each batch."""
    device = next(model.parameters()).device
    ids = torch.from_numpy(tokens).to(torch.long)
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for start in range(0, len(ids), batch_size):
            idx = ids[start : start + batch_size].to(device)
            got = run_with_cache(model, idx, list(names))
            for name in names:
                value = got[name]
                # else the shards hold inf, found only when an SAE trains on them; attention scores hold the
                # causal mask's -inf above the diagonal (keys after the query), which is no overflow
                ok = value.isfinite()
                if is_attention_square(name):
                    ok |= torch.ones(ok.shape[-2:], dtype=torch.bool, device=ok.device).triu(1)
                if not ok.all():
                    raise HarvestError(not_finite(name, value.dtype))
                if name not in out:
                    out[name] = torch.empty((len(ids), *value.shape[1:]), dtype=value.dtype)
                out[name][start : start + len(idx)].copy_(value)
            if on_batch is not None:
                on_batch(idx.numel())
    return out


def not_finite(name: str, dtype: torch.dtype) -> str:
    """The error of a harvest whose activations at hook `name` left `dtype`'s range."""
    wider = "; bfloat16 or float32 reaches further" if dtype == torch.float16 else ""
    return (
        f"the activations at {name} became non-finite (inf or NaN): the model's values overflowed "
        f"{dtype_range(dtype)}{wider}"
    )


def encode_shard(plan: Plan, acts: dict[str, torch.Tensor], tokens: np.ndarray) -> bytes:
    """One shard's file: safetensors (a tensor per hook, [rows, ...], and `token_ids` [rows, context]),
    or SAELens' Arrow."""
    token_ids = torch.from_numpy(tokens)
    if plan.spec.format == "saelens":
        feats = saelens.features(plan.shapes, plan.spec.context_size, plan.dtype)
        flat = {name: t.reshape(len(t), *plan.shapes[name]) for name, t in acts.items()}  # per-head: heads as one
        return saelens.shard_bytes(flat, token_ids, feats)
    from safetensors.torch import save

    tensors = {name: t.contiguous() for name, t in acts.items()} | {"token_ids": token_ids}
    # one metadata key: safetensors writes its metadata map in no fixed order, and shards must be
    # byte-identical from process to process (the shard's place is in the manifest)
    return save(tensors, metadata={"format": "pt"})


def write_shard_file(out_dir: Path, plan: Plan, index: int, first: int, rows: int, data: bytes) -> ShardRecord:
    """Write one shard's bytes atomically into `out_dir`; what the manifest records of it."""
    name = shard_name(index, plan.suffix)
    digest = write_atomic(out_dir / name, data)
    return ShardRecord(index, name, rows, first, digest, len(data))


def record_shard(manifest: Manifest, plan: Plan, record: ShardRecord) -> None:
    """Add a written shard to the manifest (in SAELens' format, to the dataset's own `state.json` too, each
    time the manifest is rewritten whole: rewriting them after every shard would cost O(shards) a shard)."""
    if manifest.add(record) and plan.spec.format == "saelens":
        write_dataset_files(manifest, plan)


def write_dataset_files(manifest: Manifest, plan: Plan) -> None:
    """SAELens' `state.json` and `dataset_info.json` for the shards listed, in the order of their contexts (by
    index: the names' own order puts acts-100000 before acts-99999), which `datasets.load_from_disk` reads:
    as the manifest is rewritten, when the job finishes, and again when a finished job runs once more (a
    folder whose copies were lost or damaged loads again; one whose are whole is only read)."""
    shards = manifest.shards
    feats = saelens.features(plan.shapes, plan.spec.context_size, plan.dtype)
    saelens.write_dataset_files(manifest.out_dir, [shards[i].file for i in sorted(shards)], feats)


def already_written(
    manifest: Manifest, plan: Plan, index: int, first: int, tokens: np.ndarray, progress: Progress | None = None
) -> bool:
    """Whether shard `index` is listed, as the shard of these contexts (its name, first context and rows),
    and holds their token ids [rows, context]: one made from other text (a file that changed while a job
    read it and was put back; a datasets folder whose files were replaced under the same fingerprint), or
    listed otherwise (a record edited by hand), is unlisted, to be computed again from the text there now
    (and taken back from `progress`, which counted it as done)."""
    record = manifest.shards.get(index)
    if record is None:
        return False
    if (record.file, record.first_context, record.rows) != (shard_name(index, plan.suffix), first, len(tokens)):
        log.warning("shard %d's record (%s) is not that of its contexts: computing it again", index, record)
        unlist(manifest, plan, [index], progress)
        return False
    path = manifest.out_dir / record.file
    if plan.spec.format == "saelens":
        written = saelens.shard_token_ids(path)
    else:
        written = SafetensorsFile(path).read("token_ids").numpy()
    if np.array_equal(written, tokens):
        return True
    log.warning("shard %s holds other text than the source gives now: computing it again", record.file)
    unlist(manifest, plan, [index], progress)
    return False


def unlist(manifest: Manifest, plan: Plan, indices: list[int], progress: Progress | None) -> None:
    """Unlist shards `indices` (of other text), in SAELens' format from its dataset files too; `progress`,
    which started counting them as done, takes their tokens back."""
    retract = getattr(progress, "retract", None)  # a progress of a caller's own may not have it
    for index in indices:
        if retract is not None:
            retract(manifest.shards[index].rows * plan.spec.context_size)
        manifest.drop(index)
    if plan.spec.format == "saelens":
        write_dataset_files(manifest, plan)


def finish_job(
    manifest: Manifest, plan: Plan, n_shards: int, n_contexts: int, progress: Progress | None = None
) -> None:
    """Mark the job complete, its text having given `n_shards` shards: listed shards past them (made from a
    longer text, say a file edited while a job read it and then put back) are unlisted first."""
    past = sorted(i for i in manifest.shards if i >= n_shards)
    if past:
        log.warning("%d listed shards lie past the text's end now: unlisted", len(past))
        unlist(manifest, plan, past, progress)
    if plan.spec.format == "saelens":
        write_dataset_files(manifest, plan)  # before the manifest says complete: a finished job's are whole
    manifest.finish(n_contexts)


class Progress(Protocol):
    """What a job tells whoever shows its progress (the command line's bar, or its log lines)."""

    def start(self, total_tokens: int | None, done_tokens: int) -> None: ...

    def advance(self, tokens: int) -> None: ...

    def retract(self, tokens: int) -> None:
        """Tokens `start` counted as done that are not: a listed shard found to hold other text, or to lie
        past the text's end, unlisted (to be computed again). Before `close`; optional (a progress without it
        keeps counting them)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class Located:
    """What a driver knows of the model without reading its weights: its shape, tokenizer, activation
    dtype, and the identities of its weight files and of the tokenizer files."""

    config: GPTConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    weights: list[dict[str, Any]]
    tokenizer_files: list[dict[str, Any]]


def locate_model(spec: HarvestSpec, device: torch.device) -> Located:
    """The model as `Located` (activations' dtype on `device`), without reading its weights (for a driver
    that plans a job its workers run)."""
    if spec.tokenizer == "":  # Path("") is the current directory
        raise HarvestError("the tokenizer directory is empty: give a directory, or leave it out")
    try:
        files = locate(spec.model, revision=spec.revision, preset_name=spec.preset, tokenizer=spec.tokenizer is None)
        tok_dir = files.tokenizer_dir if spec.tokenizer is None else spec.tokenizer
        if tok_dir is None:
            raise HarvestError(f"{files.name} ships no tokenizer: give a tokenizer directory (--tokenizer DIR)")
        tokenizer = Tokenizer.from_dir(tok_dir)
        check_tokenizer_fits(tokenizer, files.config)  # here, before any worker loads the model
        dtype = resolve_dtype(spec.dtype, device)
    except (LoadError, ConfigError, TokenizerError) as e:
        raise HarvestError(str(e)) from None
    tok_files = [Path(tok_dir) / name for name in tokenizer_files(Path(tok_dir)) or []]  # the ones from_dir read
    config_file = [files.config_file] if files.config_file is not None else []  # its epsilon, its GELU
    weights = files_identity(files.weights + config_file)
    return Located(files.config, tokenizer, dtype, weights, files_identity(tok_files))


def files_identity(paths: list[Path]) -> list[dict[str, Any]]:
    """Each file's name, size and sha256: other files at the same path (a checkpoint overwritten, another hub
    revision, a tokenizer's vocab.json edited) give another identity; the same files copied or touched do
    not. Read once a job starts, at about 1 GB/s (gpt2-small's weights 0.5 s, gpt2-xl's 6 s), beside a
    harvest of minutes to hours."""
    return [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths]


def tensors_identity(model: GPT) -> list[dict[str, Any]]:
    """A model given loaded, which has no files to identify: the sha256 of its tensors (each one's name,
    dtype, shape and bytes, in order), so that a job resumed with other weights is refused (as a job from
    files is by theirs). The same checkpoint loaded with the same options gives the same identity."""
    digest = hashlib.sha256()
    size = 0
    for prefix, module in model.named_modules():  # a module's own tensors at a time (int8's as float32)
        own: dict[str, Any] = {}
        module._save_to_state_dict(own, prefix + ".", keep_vars=False)
        for name, tensor in own.items():
            raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
            digest.update(raw.data)
            size += raw.nbytes
    return [{"name": "(the loaded model's tensors)", "bytes": size, "sha256": digest.hexdigest()}]


def load_model(spec: HarvestSpec) -> LoadedModel:
    try:
        return load_from(spec, decode_kernels=False)  # a harvest only prefills: W laid out for many rows
    except (LoadError, ConfigError) as e:
        raise HarvestError(str(e)) from None


def open_job(
    spec: HarvestSpec, out_dir: str | Path, loaded: LoadedModel | None = None, device: str | None = None
) -> tuple[Plan, Manifest, Tokenizer]:
    """Plan the job and open (or resume) its output folder. `device`: the kind of device the workers compute
    on, where it is not this process's (None: `loaded`'s, or `spec.device` resolved here), which also sets
    what `auto` dtype means. The manifest
    holds the folder's lock: `close` it (or use it as a context manager) when the job ends."""
    if out_dir == "":  # a str: read as a path, the current directory (Path("") is ".", and stays allowed)
        raise HarvestError("the output folder is empty: give a new or empty folder, or one a harvest wrote")
    tok_files: list[dict[str, Any]] | None = None  # a tokenizer given loaded has no files to identify
    if loaded is not None:
        config, tokenizer, dtype = loaded.model.config, loaded.tokenizer, loaded.dtype
        name, revision, here = loaded.name, loaded.revision, loaded.device
        weights = tensors_identity(loaded.model)
    else:
        try:  # where the workers are elsewhere (Ray's), their kind of device: this process may have none of it
            here = torch.device(device) if device is not None else resolve_device(spec.device)
        except LoadError as e:
            raise HarvestError(str(e)) from None
        located = locate_model(spec, here)
        config, tokenizer, dtype = located.config, located.tokenizer, located.dtype
        weights, tok_files = located.weights, located.tokenizer_files
        name, revision = spec.model, spec.revision
    plan = make_plan(spec, config, tokenizer, dtype, weights, device or here.type, tok_files, out_dir)
    manifest = Manifest.open(out_dir, plan.job(), plan.header(name, revision))
    return plan, manifest, tokenizer


def run_harvest(
    spec: HarvestSpec, out_dir: str | Path, *, loaded: LoadedModel | None = None, progress: Progress | None = None
) -> Manifest:
    """Run (or resume) the job `spec` in this process, writing its shards to `out_dir`."""
    plan, manifest, tokenizer = open_job(spec, out_dir, loaded)
    with manifest:  # the folder stays locked against other jobs until this one ends
        try:
            _run_here(plan, manifest, tokenizer, loaded, progress)
        except BaseException:  # Ctrl-C or SIGTERM too
            manifest.discard_if_empty()  # failed before its first shard: leave no folder to refuse a fix
            raise
    return manifest


def _run_here(
    plan: Plan, manifest: Manifest, tokenizer: Tokenizer, loaded: LoadedModel | None, progress: Progress | None
) -> None:
    spec, T = plan.spec, plan.spec.context_size
    if progress is not None:
        total = None if plan.max_contexts is None else plan.max_contexts * T
        progress.start(total, sum(r.rows for r in manifest.shards.values()) * T)
    if manifest.complete:
        log.info("%s: the harvest is complete already (%d shards)", manifest.out_dir, len(manifest.shards))
        if spec.format == "saelens":
            write_dataset_files(manifest, plan)
        if progress is not None:
            progress.close()
        return
    n_shards = n_contexts = 0
    try:
        lm = loaded if loaded is not None else load_model(spec)
        on_batch = progress.advance if progress is not None else None
        for index, first, tokens in _prefetched(shard_tokens(plan, tokenizer, manifest.out_dir)):
            n_shards, n_contexts = index + 1, first + len(tokens)
            if already_written(manifest, plan, index, first, tokens, progress):
                continue
            acts = compute_shard(lm.model, tokens, plan.names, spec.batch_size, on_batch)
            data = encode_shard(plan, acts, tokens)
            record_shard(manifest, plan, write_shard_file(manifest.out_dir, plan, index, first, len(tokens), data))
            log.info("wrote shard %d (%d contexts) to %s", index, len(tokens), manifest.out_dir)
        if n_contexts == 0:
            raise HarvestError(f"{spec.source} holds fewer than {T} tokens: not one whole context of {T}")
        finish_job(manifest, plan, n_shards, n_contexts, progress)  # before the bar closes: it may take shards back
    finally:
        if progress is not None:
            progress.close()


def _prefetched(shards: Iterator[tuple[int, int, np.ndarray]]) -> Iterator[tuple[int, int, np.ndarray]]:
    """`shards`, read and tokenized one shard ahead on a thread of its own (the tokenizer lets go of the
    GIL), so that packing the next shard overlaps the forward passes of this one."""
    q: queue.Queue[Any] = queue.Queue(maxsize=1)
    done = object()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in shards:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # handed to the consumer, which raises it
            q.put(e)

    thread = threading.Thread(target=work, name="harvest-text", daemon=True)
    thread.start()
    interrupted = False
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    except KeyboardInterrupt:  # the user wants out now: not after the text in the tokenizer's hands
        interrupted = True
        raise
    finally:
        stop.set()
        if not interrupted:
            thread.join(timeout=5)


LOADING_OPTIONS = ("dtype", "device", "revision", "preset", "tokenizer")  # `harvest`'s options that load a model


def harvest(
    model: str | Path,
    source: str | Path,
    out_dir: str | Path,
    hooks: list[str] | tuple[str, ...],
    *,
    loaded: LoadedModel | None = None,
    progress: Progress | None = None,
    **options: Any,
) -> Manifest:
    """Harvest activations at `hooks` (names or globs) for the text at `source` into shards in `out_dir`.

    `options` are `HarvestSpec`'s fields: `text_field`, `context_size`, `prepend_bos`, `batch_size`,
    `max_tokens`, `dtype`, `device`, `shard_size`, `format` ("safetensors" or "saelens"), `revision`,
    `preset`, `tokenizer`. `loaded` is the model already loaded: then the manifest names it (`model` is not
    read) and the options that choose how to load one (`dtype`, `device`, `revision`, `preset`, `tokenizer`)
    are refused, its own being what the shards hold. Interrupted and started again with the same arguments,
    it resumes; the result is the output folder's manifest.
    """
    if loaded is not None and (chosen := [o for o in LOADING_OPTIONS if o in options]):
        raise HarvestError(
            f"harvest: {', '.join(chosen)} choose how to load the model, and loaded= is loaded already "
            f"(as {loaded.dtype} on {loaded.device}): leave them out, or load it so"
        )
    if isinstance(hooks, str):  # one name or glob, not its characters
        hooks = (hooks,)
    if not isinstance(out_dir, (str, Path)):
        raise HarvestError(f"harvest: out_dir must be a folder's path (a str or a Path), got {out_dir!r}")
    try:
        spec = HarvestSpec(model=str(model), source=str(source), hooks=tuple(hooks), **options)
    except TypeError as e:
        raise HarvestError(f"harvest: {e}") from None
    return run_harvest(spec, out_dir, loaded=loaded, progress=progress)
