"""Shared fixtures: random-weight GPT-2 checkpoints in the official format, made locally (no download).

transformers' default initialisation leaves biases at 0 and LayerNorm at 1/0, which would hide a
dropped or misplaced bias, so every tensor is randomised here. The token embedding's scale (0.15) makes
logits peaked enough that greedy comparisons do not hinge on near-ties (median top-2 gap ~0.7 on
gpt2-small's shape) while keeping them small enough (|logit| up to ~23) for float32 to agree to 1e-4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "gpt2-tokenizer"

# The tests run many small tensor ops (one-token decode steps over a tiny model). On a small machine
# shared with other jobs, OpenMP's hand-offs between threads cost far more than they save for those
# (measured: 50 tiny decode steps in 3.9 s with 2 threads on a busy 2-core machine, 0.1 s with 1).
torch.set_num_threads(1)


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # directory with config.json and model.safetensors
    hf: torch.nn.Module  # transformers' GPT2LMHeadModel with the same weights (eager attention, eval mode)
    layout: str  # "save_pretrained" (transformer. prefix) or "hub" (no prefix, attn.bias buffers)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("wte.weight"):
                p.copy_(noise * 0.15)
            elif ".ln_" in name or "ln_f" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + noise * 0.2)
            else:
                p.copy_(noise * 0.08)


def make_checkpoint(
    directory: Path,
    *,
    n_layer: int,
    n_head: int,
    n_embd: int,
    n_positions: int = 1024,
    layout: str = "save_pretrained",
    seed: int = 0,
    vocab_size: int = 50257,
) -> Checkpoint:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions, vocab_size=vocab_size)
    hf = GPT2LMHeadModel(config)
    randomize_(hf, seed)
    hf.save_pretrained(directory)
    if layout == "hub":
        to_hub_layout(directory, n_layer, n_positions)
    hf = GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager").eval()
    return Checkpoint(directory, hf, layout)


def to_hub_layout(directory: Path, n_layer: int, n_positions: int) -> None:
    """Rewrite a save_pretrained checkpoint the way the hub's own gpt2 model.safetensors is laid out:
    no `transformer.` prefix, and a causal-mask buffer `h.N.attn.bias` per layer."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    state = {k.removeprefix("transformer."): v for k, v in load_file(path).items() if k != "lm_head.weight"}
    mask = torch.tril(torch.ones(n_positions, n_positions)).view(1, 1, n_positions, n_positions)
    for i in range(n_layer):
        state[f"h.{i}.attn.bias"] = mask.clone()  # safetensors refuses tensors that share memory
    save_file(state, path, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """2 layers, 4 heads, d_model 64, context 128; the real vocabulary size."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), n_layer=2, n_head=4, n_embd=64, n_positions=128)


@pytest.fixture(scope="session")
def tiny_hub(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The tiny shape in the hub's own layout."""
    return make_checkpoint(
        tmp_path_factory.mktemp("tiny_hub"), n_layer=2, n_head=4, n_embd=64, n_positions=128, layout="hub", seed=1
    )


@pytest.fixture(scope="session")
def tiny_past_float16(tiny: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with block 0's MLP weights scaled 300x: every weight within float16's range, the
    MLP's output past it (inf in float16, finite in float32)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny_past_float16")
    (out / "config.json").write_bytes((tiny.path / "config.json").read_bytes())
    state = load_file(tiny.path / "model.safetensors")
    for name in ("transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"):
        state[name] = state[name] * 300
    assert max(t.abs().max().item() for t in state.values()) < torch.finfo(torch.float16).max
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def distil(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """distilgpt2's shape (6 layers, 12 heads, d_model 768), hub layout."""
    return make_checkpoint(tmp_path_factory.mktemp("distil"), n_layer=6, n_head=12, n_embd=768, layout="hub", seed=2)


@pytest.fixture(scope="session")
def small(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """gpt2-small's full shape (12 layers, 12 heads, d_model 768, context 1024)."""
    return make_checkpoint(tmp_path_factory.mktemp("small"), n_layer=12, n_head=12, n_embd=768, seed=3)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The real GPT-2 tokenizer files beside the checkout (skips when they are not there)."""
    if not (SHARED_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"the real GPT-2 tokenizer files are not at {SHARED_TOKENIZER}")
    return SHARED_TOKENIZER


@pytest.fixture(scope="session")
def golden(tokenizer_dir: Path) -> list[dict]:
    return json.loads((tokenizer_dir / "golden.json").read_text(encoding="utf-8"))


def load_ours(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32):
    """Our GPT from a fixture checkpoint, on the CPU."""
    from model.loading import load_weights

    return load_weights(checkpoint.path, dtype=dtype, device="cpu")


def write_byte_tokenizer(directory: Path) -> None:
    """A minimal GPT-2-style tokenizer as vocab.json + merges.txt: the 256 byte symbols (ids 0..255, in
    code-point order of their symbols) and <|endoftext|> (id 256); for tests that need a tokenizer's
    files but not the real vocabulary."""
    from model.tokenizer import EOT, _bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(sorted(_bytes_to_unicode().values()))} | {EOT: 256}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")


@pytest.fixture(scope="session")
def tiny_model(tiny: Checkpoint):
    """Our model loaded from `tiny` (float32, CPU). Shared: tests must not change its weights."""
    return load_ours(tiny)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    """The real GPT-2 tokenizer (skips when its files are not there)."""
    from model.tokenizer import Tokenizer

    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def loaded(tiny: Checkpoint, tokenizer_dir: Path):
    """`tiny` with the real tokenizer, loaded as the server loads it (one per test module)."""
    from model.loading import load

    return load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu", dtype="float32")
