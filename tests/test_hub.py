"""SAEs and checkpoints from the Hugging Face hub, through huggingface-hub's own download, cache and
revision code: `HF_ENDPOINT` points at a local server that speaks the hub's file protocol
(`tests/hub_server.py`), files served from a temporary folder. huggingface-hub reads `HF_ENDPOINT` and
`HF_HOME` when imported, so each load runs in a fresh process; its standard error is a terminal (a pty),
where huggingface-hub shows its progress bars."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import Checkpoint, load_ours, write_byte_tokenizer
from hub_server import serve_hub
from sae_files import write_sae

from model.lab.sae import load_sae
from model.tokenizer import Tokenizer

SAE_REPO, MODEL_REPO, RES_JB = "someone/saes", "someone/tiny-gpt2", "jbloom/GPT2-Small-SAEs-Reformatted"
MLP_TM, MLP_TM_1 = "tommmcgrath/gpt2-small-mlp-out-saes", "sae_group_gpt2_blocks.1.hook_mlp_out_24576:v0"
HOOK = "blocks.1.hook_resid_pre"

SCRIPT = r"""
import json, os, sys, torch
from model.lab.sae import SAEError, load_sae
from model.loading import LoadError, load

out = {}
lm = load("someone/tiny-gpt2", revision="v1", device="cpu", dtype="float32")
out["model"] = [lm.name, lm.revision]
out["logits"] = lm.model(torch.tensor([[1, 2, 3]]))[0, -1, :8].tolist()
out["tokens"] = lm.tokenizer.encode("hi")
sae = load_sae("someone/saes/blocks.1.hook_resid_pre@v1")
x = torch.linspace(-1, 1, 64)
out["features"] = sae.encode(x).tolist()
out["source_centred"] = load_sae("jbloom/GPT2-Small-SAEs-Reformatted/blocks.0.hook_resid_pre").centred
mlp_tm = load_sae("tommmcgrath/gpt2-small-mlp-out-saes/sae_group_gpt2_blocks.1.hook_mlp_out_24576:v0")
out["scaled"] = [mlp_tm.cfg.normalize_activations, mlp_tm.encode(x).tolist(), mlp_tm.reconstruct(x)[1].tolist()]
for name, source in [("revision", "someone/saes/blocks.1.hook_resid_pre@v9"), ("repo", "nobody/none/x"),
                     ("file", "someone/saes/blocks.7.hook_resid_pre")]:
    try:
        load_sae(source)
        out[name] = None
    except SAEError as e:
        out[name] = str(e)
try:
    load("someone/tiny-gpt2", revision="v9", device="cpu")
except LoadError as e:
    out["model_revision"] = str(e)
tok = os.environ["TOK_DIR"]  # a repo that ships no tokenizer, one sharded as save_pretrained shards
for repo in ("someone/no-tokenizer", "someone/sharded"):
    lm = load(repo, device="cpu", dtype="float32", tokenizer_dir=tok)
    out[repo] = lm.model(torch.tensor([[1, 2, 3]]))[0, -1, :8].tolist()
for name, kwargs in [("no_tokenizer", {}), ("preset", {"preset_name": "gpt2"})]:
    try:
        load("someone/sharded" if name == "no_tokenizer" else "someone/no-tokenizer", device="cpu", **kwargs)
    except LoadError as e:
        out[name] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory, tiny: Checkpoint) -> Path:
    root = tmp_path_factory.mktemp("hub")
    repo = root / MODEL_REPO
    repo.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny.path / name, repo / name)
    write_byte_tokenizer(repo)  # vocab.json and merges.txt: the loader's fallback when there is no tokenizer.json
    bare = root / "someone" / "no-tokenizer"  # config and weights only: the tokenizer comes from elsewhere
    bare.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny.path / name, bare / name)
    sharded = root / "someone" / "sharded"  # model.safetensors.index.json and two shards, as save_pretrained writes
    sharded.mkdir(parents=True)
    shutil.copy(tiny.path / "config.json", sharded / "config.json")
    tensors = safetensors.torch.load_file(tiny.path / "model.safetensors")
    names, weight_map = sorted(tensors), {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        safetensors.torch.save_file({n: tensors[n] for n in part}, sharded / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_sae(root / SAE_REPO / HOOK, hook=HOOK, d_in=64, d_sae=96, seed=7)
    write_sae(root / RES_JB / "blocks.0.hook_resid_pre", hook="blocks.0.hook_resid_pre", d_in=64, d_sae=32, legacy=True)
    hook = "blocks.1.hook_mlp_out"
    write_sae(root / MLP_TM / MLP_TM_1, hook=hook, d_in=64, d_sae=48, normalize_activations="expected_average_only_in")
    return root


def run(env: dict[str, str], tty: bool) -> tuple[dict, str]:
    """SCRIPT in a fresh process with `env`; its stderr a pty when `tty`. (result, what stderr showed)"""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))} | env
    full.pop("TQDM_DISABLE", None)
    if not tty:
        p = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.split("RESULT ", 1)[1]), p.stderr
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 columns wide
    with subprocess.Popen([sys.executable, "-c", SCRIPT], env=full, stdout=subprocess.PIPE, stderr=child) as p:
        os.close(child)
        shown = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        stdout = p.stdout.read().decode() if p.stdout else ""
        assert p.wait(300) == 0, shown.decode(errors="replace")
    os.close(main)
    return json.loads(stdout.split("RESULT ", 1)[1]), shown.decode(errors="replace")


def test_saes_and_checkpoints_through_the_hub(hub_root: Path, tmp_path: Path, tiny: Checkpoint) -> None:
    with serve_hub(hub_root, revisions=("main", "v1")) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        env["TOK_DIR"] = str(hub_root / MODEL_REPO)
        out, shown = run(env, tty=True)
        commit = hub.commit(SAE_REPO)
        assert ("HEAD", f"/{SAE_REPO}/resolve/v1/{HOOK}/cfg.json") in hub.requests
        assert ("GET", f"/{SAE_REPO}/resolve/v1/{HOOK}/sae_weights.safetensors") in hub.requests
        assert ("GET", f"/{MODEL_REPO}/resolve/v1/model.safetensors") in hub.requests
        served = len(hub.requests)
        # the same files again, offline: from the cache, not one request
        again, _ = run(env | {"HF_HUB_OFFLINE": "1"}, tty=False)
        assert len(hub.requests) == served
    # offline, a repository whose weights are cached and that shipped no tokenizer: said so, with what to give
    assert again["no_tokenizer"].startswith(
        "cannot reach the Hugging Face hub to download the tokenizer of 'someone/sharded', and it is not in the local "
        "cache; the repository may ship none (its weights are cached): give a tokenizer directory (--tokenizer DIR)"
    ), again["no_tokenizer"]
    # and with a hub whose host has no address (no network, HF_HUB_OFFLINE unset): from the cache at once, where
    # the client would retry for about 25 s, a warning each try
    cut_off, said = run(env | {"HF_ENDPOINT": "http://hub.invalid", "no_proxy": "*"}, tty=False)  # no proxy either
    assert cut_off["features"] == out["features"] and cut_off["logits"] == out["logits"]
    assert "Retrying" not in said, said
    assert "cannot reach the Hugging Face hub" in cut_off["repo"]  # what is not in the cache: the offline error
    # what came over the wire is what the folder holds
    want_sae = load_sae(hub_root / SAE_REPO / HOOK)
    assert out["features"] == pytest.approx(want_sae.encode(torch.linspace(-1, 1, 64)).tolist(), abs=1e-6)
    with torch.inference_mode():
        want_logits = load_ours(tiny)(torch.tensor([[1, 2, 3]]))[0, -1, :8].tolist()
    assert out["logits"] == pytest.approx(want_logits, abs=1e-5)
    assert out["model"] == [MODEL_REPO, "v1"]
    assert out["tokens"] == Tokenizer.from_dir(hub_root / MODEL_REPO).encode("hi")
    assert again["features"] == out["features"] and again["logits"] == out["logits"]
    # cached as huggingface-hub caches: snapshots/<commit>/ under the repo's folder, the revision a ref
    cache = tmp_path / "hf" / "hub" / "models--someone--saes"
    assert (cache / "snapshots" / commit / HOOK / "sae_weights.safetensors").is_file()
    assert (cache / "refs" / "v1").read_text() == commit
    # res-jb's repo: centred, as SAELens' release table says (its cfg.json does not)
    assert out["source_centred"] is True
    # mlp-tm's repo: its input scale folded in, as SAELens' release table gives it (its files do not)
    # the same files in a folder of no release's name, as SAELens' load_from_disk reads them: unscaled
    local = load_sae(shutil.copytree(hub_root / MLP_TM / MLP_TM_1, tmp_path / "plain"))
    x, factor = torch.linspace(-1, 1, 64), 2.3693984005104283
    assert out["scaled"][0] == "none" and local.cfg.normalize_activations == "expected_average_only_in"
    assert out["scaled"][1] == pytest.approx(local.encode(factor * x).tolist(), abs=1e-5)
    assert out["scaled"][2] == pytest.approx((local.reconstruct(factor * x)[1] / factor).tolist(), abs=1e-5)
    assert out["scaled"][1] != pytest.approx(local.encode(x).tolist(), abs=1e-3)
    # errors name what was asked for
    assert "has no revision 'v9'" in out["revision"]
    assert "no repository 'nobody/none'" in out["repo"]
    assert "has no blocks.7.hook_resid_pre/cfg.json" in out["file"]
    assert "has no revision 'v9'" in out["model_revision"]
    # a repository that ships no tokenizer loads with one given (none fetched), sharded weights through the index
    assert out["someone/no-tokenizer"] == pytest.approx(want_logits, abs=1e-5)
    assert out["someone/sharded"] == pytest.approx(want_logits, abs=1e-5)
    assert ("GET", "/someone/sharded/resolve/main/model-00002-of-00002.safetensors") in hub.requests
    asked = [path for _, path in hub.requests if path.startswith("/someone/no-tokenizer/")]
    assert not [path for path in asked if path.endswith(("/tokenizer.json", "/vocab.json"))], asked  # none fetched
    assert "someone/sharded ships no tokenizer" in out["no_tokenizer"]
    assert "the preset 'gpt2' disagrees with" in out["preset"]
    # on a terminal, huggingface-hub's progress bar
    assert "sae_weights.safetensors" in shown and "100%" in shown, shown[-2000:]
