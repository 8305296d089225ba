"""The harvest job as a Ray Data pipeline, on a local Ray instance this test starts (2 CPUs, a small object
store): its shards equal the in-process run's, byte for byte, and its manifest lists the same shards; its
driver holds the folder's lock (a second job is refused) while its actors write there."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from model.harvest import MANIFEST, HarvestError, harvest
from model.harvest.job import HarvestSpec
from model.harvest.lock import LOCK

ray = pytest.importorskip("ray", reason="Ray is not installed (the [ray] extra)")
pytest.importorskip("ray.data", reason="Ray Data is not installed (ray[data])")


def small_job(
    tmp_path: Path, model: str, tokenizer_dir: Path, hook: str, context_size: int, **options: Any
) -> HarvestSpec:
    """A job of a few contexts at `hook`, on a short text written into `tmp_path` (docs.txt)."""
    source = tmp_path / "docs.txt"
    source.write_text("the cat sat on the mat . " * 40)
    return HarvestSpec(
        model=model, source=str(source), hooks=(hook,), context_size=context_size, tokenizer=str(tokenizer_dir),
        device="cpu", **options,
    )  # fmt: skip


class SecondJob:
    """A progress that, as the Ray job's first shard is recorded, tries a second job into its folder."""

    def __init__(self, *args: Any, **options: Any) -> None:
        self.args, self.options, self.refused = args, options, ""

    def start(self, total_tokens: int | None, done_tokens: int) -> None:
        pass

    def advance(self, tokens: int) -> None:
        if not self.refused:
            try:
                harvest(*self.args, **self.options)
                self.refused = "not refused"
            except HarvestError as e:
                self.refused = str(e)

    def close(self) -> None:
        pass


def test_ray_equals_in_process(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    from model.harvest.ray_data import run_on_ray

    rnd = random.Random(3)
    words = ["a", "cat", "sat", "on", "the", "mat", "and", "ran", "away", "."]
    source = tmp_path / "docs.jsonl"
    source.write_text(
        "".join(json.dumps({"text": " ".join(rnd.choices(words, k=rnd.randint(1, 90)))}) + "\n" for _ in range(150))
    )
    hooks = ("blocks.1.hook_resid_pre", "blocks.0.attn.hook_pattern")
    options = {
        "context_size": 32,
        "batch_size": 4,
        "shard_size": 10,
        "tokenizer": str(tokenizer_dir),
        "device": "cpu",
        "dtype": "float32",
    }
    local = harvest(tiny.path, source, tmp_path / "local", hooks, **options)
    assert len(local.shards) >= 5

    on_ray = tmp_path / "ray"
    spec = HarvestSpec(model=str(tiny.path), source=str(source), hooks=hooks, **options)
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    ray.init(
        num_cpus=2,
        object_store_memory=100 * 1024 * 1024,
        include_dashboard=False,
        _temp_dir=ray_tmp,
        log_to_driver=False,
    )
    second = SecondJob(tiny.path, source, on_ray, hooks, **options)
    try:
        manifest = run_on_ray(spec, on_ray, actors=2, cpus_per_actor=1, progress=second)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    holder = f"another harvest job (pid {os.getpid()}) is writing to {on_ray}"  # this process: Ray's driver
    assert second.refused == f"{holder}; wait for it or pick another --out"
    assert manifest.complete and manifest.n_contexts == local.n_contexts
    assert not (on_ray / LOCK).exists()
    ours = json.loads((tmp_path / "local" / MANIFEST).read_text())
    theirs = json.loads((on_ray / MANIFEST).read_text())
    assert theirs == ours  # the same job, shards, rows and sha256
    for shard in ours["shards"]:
        data = (on_ray / shard["file"]).read_bytes()
        assert data == (tmp_path / "local" / shard["file"]).read_bytes(), shard["file"]
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]


def test_a_gpu_device_needs_gpus_per_actor(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Ray hides the GPUs from an actor that asks for none: refused before any actor starts (they failed)."""
    from model.harvest import HarvestError
    from model.harvest.ray_data import run_on_ray

    spec = HarvestSpec(model=str(tiny.path), source=str(tmp_path), hooks=("hook_embed",), device="cuda")
    with pytest.raises(HarvestError, match=r"device 'cuda' needs GPUs per actor above 0"):
        run_on_ray(spec, tmp_path / "acts", gpus_per_actor=0)
    assert not (tmp_path / "acts").exists()


def test_a_driver_without_a_gpu_plans_a_job_for_actors_with_one(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    """The job's device is the actors' (`--device cuda --gpus-per-actor 1` from a laptop was refused: "CUDA is
    not available here"), and `auto` dtype means what it means there (bfloat16 on CUDA); a device no one runs
    on is still refused before anything starts."""
    from model.harvest.job import open_job
    from model.harvest.ray_data import run_on_ray

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the cat sat on the mat " * 40, encoding="utf-8")
    spec = HarvestSpec(
        model=str(tiny.path), source=str(tmp_path / "text"), hooks=("hook_embed",), device="cuda:0",
        tokenizer=str(tokenizer_dir), context_size=16,
    )  # fmt: skip
    plan, manifest, _ = open_job(spec, tmp_path / "acts", device="cuda")
    with manifest:
        assert plan.job()["device"] == "cuda" and plan.job()["dtype"] == "bfloat16"
    with pytest.raises(HarvestError, match="unknown device 'meta'"):
        run_on_ray(dataclasses.replace(spec, device="meta"), tmp_path / "other", gpus_per_actor=1)
    nan, inf = float("nan"), float("inf")
    for cpus, gpus in ((nan, 1), (1, nan), (inf, 1), (1, inf), (0, 1), (1, -1)):  # NaN passed both checks once
        with pytest.raises(HarvestError, match="CPUs per actor must be > 0 and GPUs >= 0"):
            run_on_ray(spec, tmp_path / "other", cpus_per_actor=cpus, gpus_per_actor=gpus)
    for cpus, gpus, what in ((1e-9, 1, "CPUs"), (1, 5e-5, "GPUs")):  # below Ray's step: its traceback, once
        with pytest.raises(HarvestError, match=f"{what} per actor must be 0 or at least 0.0001"):
            run_on_ray(spec, tmp_path / "other", cpus_per_actor=cpus, gpus_per_actor=gpus)
    assert not (tmp_path / "other").exists()


def test_an_actors_error_is_the_drivers_one_line(tiny_past_float16: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Activations past float16's range on an actor: the driver raises the actor's HarvestError in its words
    (Ray's own exception carried it only as the text of a traceback)."""
    from model.harvest.ray_data import run_on_ray

    spec = small_job(tmp_path, str(tiny_past_float16), tokenizer_dir, "blocks.0.hook_mlp_out", 16, dtype="float16")
    says = r"^the activations at blocks\.0\.hook_mlp_out became non-finite \(inf or NaN\): .* float16's range"
    with pytest.raises(HarvestError, match=says):
        run_on_ray(spec, tmp_path / "out", actors=1)
    assert not (tmp_path / "out").exists()


def test_a_model_an_actor_cannot_load_is_the_drivers_one_line(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Weights the driver identifies (it reads no tensor) but no actor can load: each actor reports why, the
    driver raises it in one line, and no folder is left (Ray retried the actor for ever, then printed a
    270-line traceback of its own)."""
    from model.harvest.ray_data import run_on_ray

    broken = tmp_path / "broken"
    shutil.copytree(tiny.path, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut short: its tensors run past the end
    spec = small_job(tmp_path, str(broken), tokenizer_dir, "blocks.0.hook_resid_pre", 16)
    with pytest.raises(HarvestError, match=r"^a Ray worker could not load the model: .*model\.safetensors") as e:
        run_on_ray(spec, tmp_path / "out", actors=1)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_a_tokenizer_past_the_models_vocabulary_is_refused_before_ray(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Found by the driver as it plans the job, as the in-process job finds it as it loads the model."""
    from conftest import make_checkpoint

    from model.harvest.ray_data import run_on_ray

    small = make_checkpoint(tmp_path / "small", n_layer=1, n_head=2, n_embd=32, n_positions=64, vocab_size=1000)
    spec = small_job(tmp_path, str(small.path), tokenizer_dir, "blocks.0.hook_resid_pre", 16)
    says = "^the tokenizer has 50257 tokens but the model only 1000$"
    with pytest.raises(HarvestError, match=says):
        run_on_ray(spec, tmp_path / "out", actors=1)
    with pytest.raises(HarvestError, match=says):
        harvest(small.path, spec.source, tmp_path / "out", ["blocks.0.hook_resid_pre"], tokenizer=str(tokenizer_dir))
    assert not (tmp_path / "out").exists()


def test_a_bad_ray_address_is_one_error_and_leaves_no_folder(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    """An address Ray refuses is a HarvestError in one line (it was Ray's traceback), and the job's new folder
    is removed as for any job failing before its first shard."""
    from model.harvest import HarvestError
    from model.harvest.ray_data import run_on_ray

    if ray.is_initialized():  # a job then runs on that instance, whatever the address
        pytest.skip("this process is connected to Ray already (another test's instance)")
    spec = small_job(tmp_path, str(tiny.path), tokenizer_dir, "blocks.0.hook_resid_pre", 32)
    out = tmp_path / "out"
    refused = r"^could not start or reach Ray at 'http://nope:1': Invalid Ray address"
    with pytest.raises(HarvestError, match=refused) as e:
        run_on_ray(spec, out, address="http://nope:1")
    assert "\n" not in str(e.value) and not out.exists()
