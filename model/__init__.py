"""A hand-written GPT-2 that loads OpenAI's official weights, generates, and exposes every activation.

Where things live: the network in `gpt.py` (attention, MLP, the residual adds in `Block.forward`),
hook points and capture in `hooks.py`, checkpoint loading and export in `loading.py`, the tokenizer in
`tokenizer.py`, the KV cache in `kv_cache.py`, sampling in `sampling.py`, the decode loop in `generate.py`;
edits in `interventions.py`, the residual-stream analysis in `analysis.py`, SAEs, steering, gradients and
attribution in `lab/`, the harvest in `harvest/`, the CPU kernels and int8 in `kernels/` and `quantize.py`.
The README's "Where things live" has the whole map.
"""

from .config import PRESETS, ConfigError, GPTConfig
from .dump import load_dump, save_dump
from .generate import Completion, Generation, GenerationError, SamplingParams, TokenEvent, generate
from .gpt import GPT
from .harvest import HarvestError, harvest
from .hooks import Capture, UnknownHookError, hook_names, run_with_cache, select_hooks
from .kv_cache import KVCache
from .loading import LoadedModel, LoadError, load, load_weights, save_checkpoint
from .tokenizer import Tokenizer

__all__ = [
    "GPT",
    "PRESETS",
    "Capture",
    "Completion",
    "ConfigError",
    "GPTConfig",
    "Generation",
    "GenerationError",
    "HarvestError",
    "KVCache",
    "LoadError",
    "LoadedModel",
    "SamplingParams",
    "TokenEvent",
    "Tokenizer",
    "UnknownHookError",
    "generate",
    "harvest",
    "hook_names",
    "load",
    "load_dump",
    "load_weights",
    "run_with_cache",
    "save_checkpoint",
    "save_dump",
    "select_hooks",
]
