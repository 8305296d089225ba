"""Official GPT-2 checkpoints (Hugging Face format) in and out of our modules.

All knowledge of the official format lives here: where the files come from (hub, directory, single
file), the tensor names and shapes, the buffers to skip and the tied LM head.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from itertools import islice
from pathlib import Path
from typing import Protocol

import torch

from . import huge_pages, kernels
from .config import PRESETS, ConfigError, GPTConfig, preset
from .gpt import GPT
from .hub import download, hub_errors
from .json_file import clip, read_json
from .kernels.layers import use_kernels
from .quantize import Int8Conv1D, quantize_
from .safetensors_file import SafetensorsError, SafetensorsFile
from .tokenizer import Tokenizer, TokenizerError, tokenizer_files

log = logging.getLogger(__name__)


class LoadError(RuntimeError):
    """A checkpoint that cannot be loaded; the message says why and what to do."""


# Short names of the official checkpoints on the Hugging Face hub.
HUB_REPOS: dict[str, str] = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}

# --- the table: official tensor names and shapes --------------------------------------------

# The projections (c_attn, c_proj, c_fc) are OpenAI's "Conv1D" weights, [in, out]; our `Conv1D` keeps
# that shape, so they load as they are. Their memory layout, and that of the token embedding (which the
# LM head reads as x @ wte.T), is chosen for the matrix kernels that will read them (see `_stored`).
# The causal-mask buffers older checkpoints carry; the mask is rebuilt at run time.
MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
PREFIX = "transformer."  # what transformers' save_pretrained puts before every name
LM_HEAD = "lm_head.weight"  # tied to wte.weight; present in some checkpoints


def official_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an official checkpoint must hold (names without prefix), with its shape in the file."""
    return dict(_official_items(config))


def _block_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of one block (names after `h.N.`)."""
    C = config.n_embd
    return {
        "ln_1.weight": (C,),
        "ln_1.bias": (C,),
        "attn.c_attn.weight": (C, 3 * C),
        "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C),
        "attn.c_proj.bias": (C,),
        "ln_2.weight": (C,),
        "ln_2.bias": (C,),
        "mlp.c_fc.weight": (C, 4 * C),
        "mlp.c_fc.bias": (4 * C,),
        "mlp.c_proj.weight": (4 * C, C),
        "mlp.c_proj.bias": (C,),
    }


def _outer_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The tensors outside the blocks."""
    C = config.n_embd
    return {
        "wte.weight": (config.vocab_size, C),
        "wpe.weight": (config.n_positions, C),
        "ln_f.weight": (C,),
        "ln_f.bias": (C,),
    }


def _official_items(config: GPTConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """`official_shapes` one by one, in file order (a config.json can ask for 10**12 blocks)."""
    outer, block = _outer_shapes(config), _block_shapes(config)
    yield from ((name, outer[name]) for name in ("wte.weight", "wpe.weight"))
    for i in range(config.n_layer):
        for name, shape in block.items():
            yield f"h.{i}.{name}", shape
    yield from ((name, outer[name]) for name in ("ln_f.weight", "ln_f.bias"))


BLOCK_TENSOR = re.compile(r"h\.(0|[1-9][0-9]{0,17})\.(.+)")  # longer indices are beyond any n_layer anyway


def _official_shape(name: str, config: GPTConfig) -> tuple[int, ...] | None:
    """The shape of `name` (without prefix) in an official checkpoint of `config`; None if it has none."""
    if m := BLOCK_TENSOR.fullmatch(name):
        return _block_shapes(config).get(m.group(2)) if int(m.group(1)) < config.n_layer else None
    return _outer_shapes(config).get(name)


# --- where the files are ----------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointFiles:
    name: str  # what the user asked for
    weights: list[Path]  # one .safetensors file, or the shards of one
    config: GPTConfig
    tokenizer_dir: Path | None
    revision: str | None = None
    config_file: Path | None = None  # the config.json `config` was read from (None: a preset)


def hub_repo(name: str) -> str | None:
    """The hub repository a model name stands for where no file or directory has that name: a short name's
    (`gpt2`: openai-community/gpt2), or the name itself in a repo id's form (`org/name`); None otherwise."""
    if name in HUB_REPOS:
        return HUB_REPOS[name]
    return name if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")) else None


def locate(
    source: str | Path, *, revision: str | None = None, preset_name: str | None = None, tokenizer: bool = True
) -> CheckpointFiles:
    """Find config, weights and tokenizer for a hub name or repo id, a directory, or a .safetensors file.
    A `revision` names a commit of a hub repository: with a local source it is a LoadError (ignoring it
    would hand back other weights than the ones asked for), and so is an empty one. `tokenizer` False: a hub
    repository's tokenizer is not downloaded (one is given from elsewhere, or none is needed)."""
    if revision == "":  # names nothing: the hub would be asked for a file at an empty ref
        raise LoadError("the revision is empty: name a branch, tag or commit of the hub repository, or leave it out")
    if str(source) == "":  # Path("") is the current directory
        raise LoadError("the model is empty: give a hub name (gpt2), a checkpoint directory or a .safetensors file")
    path = Path(source).expanduser()
    if revision is not None and (path.is_dir() or path.is_file()):
        raise LoadError(
            f"revision {clip(revision)} given for {clip(str(source))}, which is a local "
            f"{'directory' if path.is_dir() else 'file'}: a revision applies only to a hub repository "
            "(leave it out)"
        )
    if path.is_dir():
        return _locate_dir(path, str(source), preset_name)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise LoadError(f"{path} is not a .safetensors file; give a checkpoint directory or a .safetensors file")
        config_file = path.parent / "config.json" if (path.parent / "config.json").is_file() else None
        if config_file is not None:
            config = _config_and_preset(config_file, preset_name)
        elif preset_name is not None:
            config = preset(preset_name)
        else:
            raise LoadError(
                f"{path} is a bare weights file: its head count cannot be read from tensor shapes, "
                "so name its shape with a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2)"
            )
        tok_dir = path.parent if tokenizer_files(path.parent) else None
        return CheckpointFiles(str(source), [path], config, tok_dir, config_file=config_file)
    text = str(source)
    if (repo := hub_repo(text)) is not None:
        return _download(text, repo, revision, preset_name, tokenizer)
    raise LoadError(
        f"no checkpoint at {text!r}: it is neither an existing file or directory nor a hub name "
        f"({', '.join(HUB_REPOS)}, or a repo id such as openai-community/gpt2)"
    )


def _locate_dir(path: Path, name: str, preset_name: str | None) -> CheckpointFiles:
    config_file = path / "config.json" if (path / "config.json").is_file() else None
    if config_file is not None:
        config = _config_and_preset(config_file, preset_name)
    elif preset_name is not None:
        config = preset(preset_name)
    else:
        raise LoadError(f"no config.json in {path}: a checkpoint directory needs one (or name a preset)")
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        weights = [path / "model.safetensors"]
    elif index.is_file():
        weights = [path / s for s in _index_shards(index)]
        for w in weights:
            if not w.is_file():
                raise LoadError(f"{index} names the shard {w.name}, which is missing")
    elif (path / "pytorch_model.bin").is_file():
        raise LoadError(
            f"{path} holds only pytorch_model.bin (a pickle, which can run code when loaded); "
            "this loader reads safetensors: convert it with transformers' save_pretrained(safe_serialization=True)"
        )
    else:
        raise LoadError(f"no model.safetensors in {path}")
    return CheckpointFiles(name, weights, config, path if tokenizer_files(path) else None, config_file=config_file)


def _config_and_preset(config_file: Path, preset_name: str | None) -> GPTConfig:
    """The config in `config_file`; a preset, which names the shape of weights without a config.json, must
    agree with it."""
    config = GPTConfig.from_json_file(config_file)
    if preset_name is not None and (named := preset(preset_name)) != config:
        differences = ", ".join(
            f"{f.name} {getattr(named, f.name)} against {getattr(config, f.name)}"
            for f in fields(config)
            if getattr(named, f.name) != getattr(config, f.name)
        )
        raise LoadError(
            f"the preset {preset_name!r} disagrees with {config_file} ({differences}); a preset names the shape "
            "of weights without a config.json: leave it out"
        )
    return config


def _index_shards(index: Path) -> list[str]:
    """The shard files a `model.safetensors.index.json` names: its "weight_map" maps each tensor name to
    the name of a file beside it."""
    content = read_json(index, LoadError, "a valid safetensors index")
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoadError(
            f'{index} is not a valid safetensors index: it needs a non-empty "weight_map" object mapping '
            "each tensor name to the file of its shard"
        )
    for tensor, shard in weight_map.items():
        if not (isinstance(shard, str) and shard not in ("", ".", "..") and Path(shard).name == shard):
            raise LoadError(
                f"{index} is not a valid safetensors index: the shard of tensor {clip(tensor)} must be the name "
                f"of a file in {index.parent}, got {clip(shard)}"
            )
    return sorted(set(weight_map.values()))


def _download(
    name: str, repo_id: str, revision: str | None, preset_name: str | None, tokenizer: bool
) -> CheckpointFiles:
    """Fetch config, weights (`model.safetensors`, or the shards a `model.safetensors.index.json` names) and,
    if `tokenizer`, the tokenizer (a repository may ship none: then None) from the hub (cached; honours
    HF_HOME and HF_HUB_OFFLINE). A preset given must agree with the repository's config.json."""
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def fetch(filename: str) -> Path:
        return download(repo_id, filename, revision)

    def fetch_if_there(filename: str, uncached: bool = True) -> Path | None:
        """The file, or None where the repository lacks it, or (`uncached`) where there is no hub to ask
        and the cache lacks it: the next file asked for says which it is."""
        try:
            return fetch(filename)
        except LocalEntryNotFoundError:  # (it subclasses the next)
            if uncached:
                return None
            raise
        except EntryNotFoundError:
            return None

    errors = functools.partial(
        hub_errors,
        LoadError,
        repo_id,
        revision,
        missing=lambda e: f"repository {repo_id!r} lacks a file this loader needs: {e}",
    )
    local = "pass a local checkpoint directory instead (for example --model ./gpt2)"
    with errors(offline=local):
        config_file = fetch("config.json")
        config = _config_and_preset(config_file, preset_name)
        single = fetch_if_there("model.safetensors")
        if single is not None:
            weights = [single]
        else:  # sharded, as save_pretrained writes a large model; else the error names model.safetensors
            index = fetch_if_there("model.safetensors.index.json") or fetch("model.safetensors")
            weights = [fetch(shard) for shard in _index_shards(index)]
    tok: Path | None = None
    if tokenizer:  # offline, its weights cached but no tokenizer: whether the repository ships one cannot be known
        none_cached = (
            "the repository may ship none (its weights are cached): give a tokenizer directory (--tokenizer DIR), "
            "or load it once with the hub reachable"
        )
        with errors(offline=none_cached, what=f"the tokenizer of {repo_id!r}"):
            tok = fetch_if_there("tokenizer.json") or fetch_if_there("vocab.json", uncached=False)  # the last: offline
        if tok is not None and tok.name == "vocab.json":  # without merges.txt: the error names it
            with errors(offline=local, what=f"the tokenizer of {repo_id!r}"):
                tok = fetch("merges.txt")
    return CheckpointFiles(name, weights, config, None if tok is None else tok.parent, revision, config_file)


# --- reading the weights -----------------------------------------------------------------------


def device_problem(name: str) -> str | None:
    """Why `name` is not a device this project runs on (None when it is one), without asking the hardware."""
    try:
        if name == "auto" or torch.device(name).type in ("cpu", "cuda", "mps"):  # not meta, xpu, ...: torch knows more
            return None
    except RuntimeError:
        pass
    return f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) != "auto":
        if problem := device_problem(str(device)):
            raise LoadError(problem)
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise LoadError(f"device {device!r}: CUDA is not available here (no GPU, or torch built without CUDA)")
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            raise LoadError(f"device {device!r}: there are only {torch.cuda.device_count()} CUDA devices")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise LoadError(f"device {device!r}: MPS is not available here")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


INT8 = "int8"  # weight-only int8 (model/quantize.py): float32 activations


def dtype_problem(name: str) -> str | None:
    """Why `name` is not a dtype `load` takes (None when it is one)."""
    if not isinstance(name, str):
        return f"dtype must be a name (auto, float32, float16, bfloat16 or int8) or a torch dtype, got {name!r}"
    if name == "auto" or name == INT8 or name in DTYPE_NAMES:
        return None
    return f"unknown dtype {name!r}; use auto, float32, float16, bfloat16 or int8"


# the torch dtypes `load` also takes: float64 too, for exactness checks in Python (the tests' reference runs)
TORCH_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the activations (and of the weights, but for int8, whose activations are float32)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_DTYPES:
            raise LoadError(
                f"unsupported dtype {dtype}; use torch.float32, torch.float64, torch.float16 or torch.bfloat16 "
                "(or a name: auto, float32, float16, bfloat16 or int8)"
            )
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == INT8:
        return torch.float32
    if problem := dtype_problem(dtype):
        raise LoadError(problem)
    return DTYPE_NAMES[dtype]


def warn_if_slow(dtype: torch.dtype, device: torch.device) -> None:
    """Log why bfloat16 or float16 on a CPU will be slower than float32 (once, as a model loads)."""
    half = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)
    if device.type == "cpu" and half is not None:
        log.warning("%s on this CPU will be slower than float32: %s", half, kernels.slow_half_precision(half))


def load_state(
    files: list[Path], config: GPTConfig, dtype: torch.dtype, device: torch.device, decode_kernels: bool = True
) -> dict[str, torch.Tensor]:
    """Read an official checkpoint into a state dict of our modules, one tensor at a time, checking names
    and shapes against `official_shapes` (every error names the tensor). `decode_kernels`: lay the weights
    out for our decode kernels where they will run (see `_stored`)."""
    sources: dict[str, tuple[SafetensorsFile, str]] = {}  # name without prefix -> (file, name in file)
    lm_head: tuple[SafetensorsFile, str] | None = None
    for path in files:
        try:
            st = SafetensorsFile(path)
        except SafetensorsError as e:
            raise LoadError(str(e)) from None
        for key in st.entries:
            name = key.removeprefix(PREFIX)
            if MASK_BUFFER.fullmatch(name):
                continue
            if name == LM_HEAD:
                if lm_head is not None:  # two heads, perhaps different: neither is the one
                    raise LoadError(f"tensor {key!r} appears twice (in {lm_head[0].path.name} and {path.name})")
                lm_head = (st, key)
            elif _official_shape(name, config) is None:
                raise LoadError(f"unexpected tensor {clip(key)} in {path.name}: not part of a GPT-2 checkpoint")
            elif name in sources:
                first, first_key = sources[name]
                raise LoadError(
                    f"tensor {name!r} appears twice (as {first_key!r} in {first.path.name} and {key!r} in {path.name})"
                )
            else:
                sources[name] = (st, key)
    # Every source is an expected name, so the count says how many are missing; the names are found by
    # walking the expected ones only until five are found (n_layer can be anything a config.json says).
    n_missing = len(_outer_shapes(config)) + len(_block_shapes(config)) * config.n_layer - len(sources)
    if n_missing:
        missing = list(islice((n for n, _ in _official_items(config) if n not in sources), 5))
        more = f" and {n_missing - 5} more" if n_missing > 5 else ""
        blocks = len({n.split(".", 2)[1] for n in sources if n.startswith("h.")})
        why = (
            f" (the files hold tensors of {blocks} of the {config.n_layer} blocks that n_layer asks for)"
            if blocks < config.n_layer
            else ""
        )
        raise LoadError(f"checkpoint is missing tensor {', '.join(map(repr, missing))}{more}{why}")

    state: dict[str, torch.Tensor] = {}
    for name, shape in _official_items(config):
        st, key = sources[name]
        entry = st.entries[key]
        if entry.shape != shape:
            raise LoadError(
                f"tensor {key!r} has shape {list(entry.shape)}, expected {list(shape)} for {_describe(config)}"
            )
        if not entry.dtype.is_floating_point:
            raise LoadError(f"tensor {key!r} has dtype {entry.dtype}, expected a floating-point type")
        read = _read(st, key)
        if name == "wte.weight" and lm_head is not None:  # as the files hold them: a cast could hide a difference
            _check_tied(*lm_head, read, config)
        t = _finite(key, read, read.to(device=device, dtype=dtype))
        del read
        state[name] = _stored(name, t, decode_kernels)
        del t
    return state


def _check_tied(st: SafetensorsFile, key: str, wte: torch.Tensor, config: GPTConfig) -> None:
    """The LM head `key` of `st` equals `wte` as its file holds it (tied, as GPT-2's is), or a LoadError."""
    if st.entries[key].shape != _outer_shapes(config)["wte.weight"]:
        raise LoadError(f"tensor {key!r} has shape {list(st.entries[key].shape)}, expected the shape of wte")
    head = _read(st, key)
    both = torch.promote_types(head.dtype, wte.dtype)
    if not torch.equal(head.to(both), wte.to(both)):
        raise LoadError(f"tensor {key!r} differs from wte.weight: untied LM heads are not supported")


def _stored(name: str, t: torch.Tensor, decode_kernels: bool = True) -> torch.Tensor:
    """`t` laid out in memory as the matrix kernels of its dtype and device read fastest (same shape and values).

    Every weight matrix is the right-hand side W of some x @ W. Our float32 CPU kernels (`model/kernels/`),
    oneDNN's bfloat16/float16 kernels and cuBLAS read W column-major (nn.Linear's [out, in] contiguous, one
    output's weights together): there the projections are stored column-major and wte as it is. Without our
    kernels, MKL's float32 GEMM streams W fastest row-major ([in, out] contiguous) for the few rows of a
    decode step, so there the projections stay as the file has them and wte ([vocab, C], used as wte.T) is
    stored column-major (also for work of many rows only, a harvest's prefill: without `decode_kernels`,
    MKL's GEMM at 2048 rows is about 8% faster on W row-major). An embedding lookup only gathers a few
    rows either way.
    """
    if t.ndim != 2 or name == "wpe.weight":
        return t.contiguous()
    on_kernels = decode_kernels and kernels.available()
    w_row_major = t.device.type == "cpu" and t.dtype == torch.float32 and not on_kernels
    is_w = name != "wte.weight"  # a projection is W; wte is W transposed (the LM head is x @ wte.T)
    return t.contiguous() if w_row_major == is_w else t.t().contiguous().t()


def _finite(key: str, read: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` (tensor `key` as `read` from the checkpoint, in the dtype and on the device it is loaded to),
    refused (a LoadError naming `key`) if any of its values is not finite: a model with one such weight
    computes NaN logits on some paths and plausible ones on others (torch's fused CPU attention hides a NaN
    query), so it is refused at the door. Checked once, on `t`; `read` only says why: damaged, or beyond the
    range of the dtype it is loaded in (float16's ±65504)."""
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return t
    damaged = int((~torch.isfinite(read)).sum())
    if damaged:
        raise LoadError(f"tensor {key!r} holds {damaged} values NaN or infinite: the checkpoint is damaged")
    name = str(t.dtype).removeprefix("torch.")
    limit = f"{torch.finfo(t.dtype).max:.6g}"
    wider = ": load it as float32" if t.dtype != torch.float32 else ""  # (a float64 checkpoint's, say)
    raise LoadError(f"tensor {key!r} holds {int((~finite).sum())} values beyond {name}'s range (±{limit}){wider}")


def _read(st: SafetensorsFile, key: str) -> torch.Tensor:
    try:
        return st.read(key)
    except (SafetensorsError, OSError) as e:
        raise LoadError(str(e)) from None


def _describe(config: GPTConfig) -> str:
    return f"n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, vocab_size={config.vocab_size}"


def build_model(config: GPTConfig, state: dict[str, torch.Tensor]) -> GPT:
    """Our GPT with `state` as its parameters, without first allocating random ones."""
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


# --- the public entry points -------------------------------------------------------------------


@dataclass
class LoadedModel:
    """What `load` gives: the model (on its device), its tokenizer, the name and revision it came
    from, its activations' dtype and device; `quantization` and `weights` say what its weights are."""

    model: GPT
    tokenizer: Tokenizer
    name: str
    revision: str | None
    dtype: torch.dtype  # of the activations
    device: torch.device

    @property
    def quantization(self) -> str | None:
        """How the weights are quantized: "int8" (by `load(dtype="int8")`, or by `quantize_` since), weight-only
        int8 (model/quantize.py) with float32 activations; None for float weights."""
        return INT8 if any(isinstance(m, Int8Conv1D) for m in self.model.modules()) else None

    @property
    def weights(self) -> str:
        """What the weights are stored as: "int8", or the activations' dtype ("float32", ...)."""
        return self.quantization or str(self.dtype).removeprefix("torch.")


def load_weights(
    source: str | Path,
    *,
    revision: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    preset_name: str | None = None,
    decode_kernels: bool = True,
) -> GPT:
    """Just the network: see `load`."""
    return _load(source, revision, dtype, device, preset_name, decode_kernels, tokenizer=False)[0]


def load(
    source: str | Path,
    *,
    revision: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    preset_name: str | None = None,
    tokenizer_dir: str | Path | None = None,
    decode_kernels: bool = True,
) -> LoadedModel:
    """Load GPT-2 and its tokenizer.

    `source`: a hub name (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`, `distilgpt2`) or repo id
    (`openai-community/gpt2`, with `revision`), a checkpoint directory (`config.json` and
    `model.safetensors`), or one `.safetensors` file (its shape from `preset_name`; a preset given with a
    `config.json` must agree with it, or it is a LoadError). A `revision` with a local source is a LoadError.
    `dtype`: auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16, or int8 (weight-only int8
    with a scale per output channel, float32 activations: `model/quantize.py`); or one of the torch dtypes
    torch.float32, torch.float64 (exactness checks), torch.float16 and torch.bfloat16 (any other is a LoadError).
    `device`: auto (cuda, then mps, then cpu) or a torch device name.
    `tokenizer_dir`: where the tokenizer is, for checkpoints that ship none.
    `decode_kernels`: float32 on a CPU, products of up to `max_rows()` rows (decode steps, prompt chunks, most
    prefills) run on our kernels (`model/kernels/`); False keeps stock torch and lays the weights out for
    torch's GEMM, for a job that only runs long prefills (a harvest).
    """
    if tokenizer_dir == "":  # Path("") is the current directory
        raise LoadError("the tokenizer directory is empty: give a directory, or leave it out")
    model, files, dev, dt = _load(source, revision, dtype, device, preset_name, decode_kernels, tokenizer_dir is None)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else files.tokenizer_dir
    if tok_dir is None:
        raise LoadError(
            f"{files.name} ships no tokenizer (tokenizer.json, or vocab.json and merges.txt); "
            "give a tokenizer directory (--tokenizer DIR)"
        )
    try:
        tokenizer = Tokenizer.from_dir(tok_dir)
    except TokenizerError as e:
        raise LoadError(str(e)) from None
    check_tokenizer_fits(tokenizer, model.config)
    return LoadedModel(model, tokenizer, files.name, files.revision, dt, dev)


def check_tokenizer_fits(tokenizer: Tokenizer, config: GPTConfig) -> None:
    """Refuse a tokenizer with more tokens than the model has rows of wte (its ids would index past them)."""
    if tokenizer.vocab_size > config.vocab_size:
        raise LoadError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}")


class Checkpoint(Protocol):
    """Where a command-line tool or the server's settings say the checkpoint is."""

    @property
    def model(self) -> str: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def preset(self) -> str | None: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> str: ...


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose a checkpoint, shared by the command-line tools (read back by `load_from`)."""
    parser.add_argument(
        "--model", default="gpt2", help="hub name or repo id, checkpoint directory, or .safetensors file"
    )
    parser.add_argument("--revision", help="hub revision (branch, tag or commit)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="shape of a bare .safetensors file")
    parser.add_argument("--tokenizer", help="directory with the tokenizer, for checkpoints that ship none")
    parser.add_argument(
        "--device", default="auto", type=_checked_name(device_problem), help="auto, cpu, cuda, cuda:N or mps"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        type=_checked_name(dtype_problem),
        help="auto, float32, float16, bfloat16 or int8 (int8 weights, float32 activations)",
    )


def _checked_name(problem: Callable[[str], str | None]) -> Callable[[str], str]:
    """A flag's type that refuses a name `problem` finds fault with: a usage error (status 2), as the server's
    settings make it, not a failure to load (a device the hardware lacks is one, found when loading)."""

    def check(name: str) -> str:
        if why := problem(name):
            raise argparse.ArgumentTypeError(why)
        return name

    return check


def load_from(where: Checkpoint, decode_kernels: bool = True) -> LoadedModel:
    """`load` with the options of a command line (`add_checkpoint_arguments`), of the server's settings or
    of a harvest job."""
    return load(
        where.model,
        revision=where.revision,
        dtype=where.dtype,
        device=where.device,
        preset_name=where.preset,
        tokenizer_dir=where.tokenizer,
        decode_kernels=decode_kernels,
    )


def _load(
    source: str | Path,
    revision: str | None,
    dtype: str | torch.dtype,
    device: str | torch.device,
    preset_name: str | None,
    decode_kernels: bool = True,
    tokenizer: bool = True,
) -> tuple[GPT, CheckpointFiles, torch.device, torch.dtype]:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    warn_if_slow(dt, dev)
    try:
        files = locate(source, revision=revision, preset_name=preset_name, tokenizer=tokenizer)
    except ConfigError as e:
        raise LoadError(str(e)) from None
    as_what = "int8 weights, float32 activations" if dtype == INT8 else dt
    log.info("loading %s (%s) to %s as %s", files.name, ", ".join(map(str, files.weights)), dev, as_what)
    state = load_state(files.weights, files.config, dt, dev, decode_kernels)
    model = build_model(files.config, state)
    del state  # the model holds the tensors now (moving them below frees each old copy as it goes)
    if dtype == INT8:
        quantize_(model)  # on a CPU, into huge pages too
        if dev.type == "cpu" and not kernels.available():  # each product dequantizes its weights in torch
            log.warning(
                "int8 without our CPU kernels (GPT2_KERNELS=0, or they could not be built: the log says which) "
                "dequantizes its weights in every product: slower than float32 on this CPU"
            )
        return model, files, dev, dt
    if decode_kernels:
        use_kernels(model)  # float32 on a CPU: the decode step's products on our kernels
    if dev.type == "cpu":  # a decode step streams every weight: in huge pages, faster
        huge_pages.move_or_stay(model)
    return model, files, dev, dt


# --- writing the official format -------------------------------------------------------------


def official_state(model: GPT) -> dict[str, torch.Tensor]:
    """Our parameters under their official names and shapes (no prefix, as on the hub)."""
    return {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}


def save_checkpoint(model: GPT, directory: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write `config.json` and `model.safetensors` (plus `tokenizer.json` if given) in the official format,
    so that `load` and transformers' `GPT2LMHeadModel.from_pretrained` both read it back. An int8 model is
    written dequantized, as float32 weights (the format has no int8 GPT-2): loaded back as int8, the same
    model; as float32, its LM head is the float32 wte the file ties to the embedding, not the int8 head's
    rounding of it (logits a few hundredths apart on a random gpt2-small-shaped model)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise LoadError(f"cannot save a checkpoint into {directory}: it is a file, not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf_dict() | {"torch_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(official_state(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory
