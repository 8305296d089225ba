"""The harvest job as a Ray Data pipeline: the one module that imports Ray.

The driver plans the job and packs the text exactly as `run_harvest` does (`shard_tokens`), making one row
per missing shard (its number, first context and token ids); `map_batches` hands the rows to a pool of
`ShardActor`s (`ActorPoolStrategy`), each of which loads the model once and computes, encodes and writes
whole shards with the functions the in-process job uses, so every shard holds the bytes a single process
writes. The driver records each finished shard in the manifest as it arrives, so an interrupted Ray job
resumes like any other, on Ray or not. The driver alone holds the output folder's lock (`lock.py`): the
workers write their shards into it under that lock. The output folder must be one every worker can write
(one machine, or a filesystem the cluster shares); the model and tokenizer paths, likewise, must be there
for every worker (or be hub names).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..loading import LoadedModel, device_problem
from .errors import HarvestError
from .job import (
    HarvestSpec,
    Plan,
    Progress,
    already_written,
    compute_shard,
    encode_shard,
    finish_job,
    load_model,
    open_job,
    record_shard,
    shard_tokens,
    write_dataset_files,
    write_shard_file,
)
from .shards import Manifest, ShardRecord

log = logging.getLogger(__name__)
RAY_PRECISION = 0.0001  # the smallest fraction of a CPU or GPU Ray takes


def _ray() -> Any:
    try:
        import ray
        import ray.data  # the subpackage, for ray.data.from_items
    except ImportError:  # the [ray] extra
        raise HarvestError("--ray needs Ray Data: pip install 'gpt2-server[ray]'") from None
    return ray


class ShardActor:
    """A Ray Data actor: loads the model once, then turns batches of shard rows into written shards."""

    def __init__(self, plan: Plan, out_dir: str, threads: int) -> None:
        torch.set_num_threads(threads)
        self.plan, self.out_dir = plan, Path(out_dir)
        # the dtype the driver planned (and the manifest names), not `auto` resolved again on this worker
        spec = plan.spec
        if spec.dtype == "auto":
            spec = replace(spec, dtype=str(plan.dtype).removeprefix("torch."))
        self.failed: str | None = None  # why the model did not load here, for the driver to raise
        try:  # raised here, Ray would retry the actor for ever, then print its own traceback
            self.lm: LoadedModel | None = load_model(spec)
        except HarvestError as e:  # (a path this worker cannot see, say)
            self.lm, self.failed = None, str(e)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        plan, T = self.plan, self.plan.spec.context_size
        records: list[ShardRecord] = []
        errors: list[str] = []  # a shard's HarvestError, for the driver to raise: Ray would keep only its text
        for index, first, rows, raw in zip(batch["index"], batch["first"], batch["rows"], batch["tokens"], strict=True):
            tokens = np.frombuffer(raw, dtype=np.int32).reshape(int(rows), T).copy()  # writable, as torch wants
            try:
                if self.lm is None:
                    raise HarvestError(f"a Ray worker could not load the model: {self.failed}")
                acts = compute_shard(self.lm.model, tokens, plan.names, plan.spec.batch_size)
            except HarvestError as e:  # that, or activations past their dtype's range
                records.append(ShardRecord(int(index), "", 0, int(first), "", 0))
                errors.append(str(e))
                continue
            data = encode_shard(plan, acts, tokens)
            records.append(write_shard_file(self.out_dir, plan, int(index), int(first), int(rows), data))
            errors.append("")
        fields = ("index", "file", "rows", "first_context", "sha256", "bytes")
        return {f: [getattr(r, f) for r in records] for f in fields} | {"error": errors}


def run_on_ray(
    spec: HarvestSpec,
    out_dir: str | Path,
    *,
    address: str | None = None,
    actors: int = 2,
    cpus_per_actor: float = 1.0,
    gpus_per_actor: float = 0.0,
    progress: Progress | None = None,
) -> Manifest:
    """Run (or resume) the job `spec` on Ray: `actors` model actors with `cpus_per_actor` and
    `gpus_per_actor` each. Uses the Ray instance this process is connected to, else connects to
    `address` (`auto`, `ray://host:10001`; None: `RAY_ADDRESS`, or a new local instance) and disconnects
    at the end."""
    _ray()
    if actors < 1:
        raise HarvestError(f"actors must be a positive integer, got {actors}")
    if not (0 < cpus_per_actor < math.inf and 0 <= gpus_per_actor < math.inf):  # NaN too
        raise HarvestError(f"CPUs per actor must be > 0 and GPUs >= 0, got {cpus_per_actor} and {gpus_per_actor}")
    for what, amount in (("CPUs", cpus_per_actor), ("GPUs", gpus_per_actor)):
        if 0 < amount < RAY_PRECISION:  # Ray refuses it with a traceback of its own
            raise HarvestError(f"{what} per actor must be 0 or at least {RAY_PRECISION} (Ray's step), got {amount}")
    if spec.device.startswith("cuda") and gpus_per_actor == 0:
        raise HarvestError(
            f"device {spec.device!r} needs GPUs per actor above 0: Ray hides the GPUs from an actor that asks for none"
        )
    if problem := device_problem(spec.device):
        raise HarvestError(problem)
    # Ray hides the GPUs from an actor that asks for none, so "auto" computes on GPUs exactly when it asks for some;
    # the actors' device, not this driver's: a driver without a GPU plans a job for actors with one
    device = ("cuda" if gpus_per_actor > 0 else "cpu") if spec.device == "auto" else torch.device(spec.device).type
    plan, manifest, tokenizer = open_job(spec, out_dir, device=device)
    T = spec.context_size
    with manifest:  # this driver holds the folder's lock; the actors write their shards under it
        if progress is not None:
            total = None if plan.max_contexts is None else plan.max_contexts * T
            progress.start(total, sum(r.rows for r in manifest.shards.values()) * T)
        try:
            if not manifest.complete:
                _run(plan, manifest, tokenizer, address, actors, cpus_per_actor, gpus_per_actor, progress)
            elif spec.format == "saelens":
                write_dataset_files(manifest, plan)
        except BaseException:
            manifest.discard_if_empty()  # failed before its first shard: leave no folder to refuse a fix
            raise
        finally:
            if progress is not None:
                progress.close()
    return manifest


def _run(
    plan: Plan,
    manifest: Manifest,
    tokenizer: Any,
    address: str | None,
    actors: int,
    cpus_per_actor: float,
    gpus_per_actor: float,
    progress: Progress | None,
) -> None:
    ray = _ray()
    rows: list[dict[str, Any]] = []
    n_shards = n_contexts = 0
    for index, first, tokens in shard_tokens(plan, tokenizer, manifest.out_dir):
        n_shards, n_contexts = index + 1, first + len(tokens)
        if not already_written(manifest, plan, index, first, tokens, progress):
            rows.append({"index": index, "first": first, "rows": len(tokens), "tokens": tokens.tobytes()})
    T = plan.spec.context_size
    if n_contexts == 0:
        raise HarvestError(f"{plan.spec.source} holds fewer than {T} tokens: not one whole context of {T}")
    connected = ray.is_initialized()
    target = address or os.environ.get("RAY_ADDRESS")
    if rows:
        if connected and address is not None:
            log.warning("this process is connected to Ray already: the job runs there, not at %r", address)
        if not connected:
            try:
                # None: RAY_ADDRESS, as Ray reads it; "local": a new instance of our own, not one `ray start` left
                with _own_sigterm():
                    ray.init(address=address or (None if target else "local"))
            except Exception as e:  # Ray's own types differ by cause (ConnectionError, ValueError, ...)
                if ray.is_initialized():  # started in part: leave nothing running
                    ray.shutdown()
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                where = f"at {target!r}" if target else "(a local instance)"
                raise HarvestError(f"could not start or reach Ray {where}: {reason}") from e
        try:
            _check_room(ray.cluster_resources(), cpus_per_actor, gpus_per_actor, local=not connected and not target)
            shards = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
                ShardActor,
                fn_constructor_args=(plan, str(manifest.out_dir), max(1, int(cpus_per_actor))),
                batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=min(actors, len(rows))),
                num_cpus=cpus_per_actor,
                num_gpus=gpus_per_actor,
            )
            rows_written = iter(shards.iter_rows())
            try:
                for row in rows_written:
                    if row["error"]:
                        raise HarvestError(row["error"])
                    record = ShardRecord(
                        **{k: v.item() if isinstance(v, np.generic) else v for k, v in row.items() if k != "error"}
                    )
                    record_shard(manifest, plan, record)
                    log.info("shard %d written on Ray (%d contexts)", record.index, record.rows)
                    if progress is not None:
                        progress.advance(record.rows * T)
            finally:  # Ray Data's streaming stopped before Ray is (an error's traceback keeps the rows alive): the
                # shutdown below could end this process otherwise, the error unsaid, its folder and lock left behind
                close = getattr(rows_written, "close", None)
                if close is not None:
                    close()
        finally:
            if not connected:
                ray.shutdown()
    finish_job(manifest, plan, n_shards, n_contexts, progress)


@contextlib.contextmanager
def _own_sigterm() -> Iterator[None]:
    """Keep this process's own SIGTERM handler (the command line's, which stops the job as Ctrl-C does) over
    the one `ray.init` installs first thing, which exits with status 15 without a word, also for a SIGTERM that
    comes while Ray starts; where the process has none of its own, Ray's stays."""
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    restore = True
    try:
        yield
    except SystemExit as e:  # Ray's handler: the signal came as Ray started
        if e.code != signal.SIGTERM:
            raise
        restore = False  # what this process's handler does decides what is installed next
        signal.signal(signal.SIGTERM, handler)
        handler(signal.SIGTERM, None)  # the command line's raises `Terminated`
        raise
    finally:
        if restore:
            signal.signal(signal.SIGTERM, handler)


def _check_room(total: dict[str, float], cpus: float, gpus: float, local: bool) -> None:
    """Whether the cluster (`ray.cluster_resources()`) can place one actor of `cpus` CPUs and `gpus` GPUs: a local
    instance this process started that cannot is a `HarvestError` (Ray would wait for the resources for ever,
    logging that no node can fulfil the request); a cluster reached at an address gets a warning (an autoscaler
    may add the nodes)."""
    short = [f"{need:g} {kind}s" for kind, need in (("CPU", cpus), ("GPU", gpus)) if need > total.get(kind, 0.0)]
    if not short:
        return
    has = f"{total.get('CPU', 0.0):g} CPUs and {total.get('GPU', 0.0):g} GPUs"
    message = f"an actor asks for {' and '.join(short)}, and the Ray cluster has {has}"
    if local:
        raise HarvestError(f"{message} (a local instance): lower --cpus-per-actor or --gpus-per-actor")
    log.warning("%s: the job waits until the cluster has them (an autoscaler may add them)", message)
