"""Server settings: one typed object, from command-line flags, each also readable from `GPT2_<NAME>`."""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # what both logging and uvicorn accept


@dataclass(frozen=True)
class Settings:
    model: str = field(
        default="gpt2", metadata={"help": "hub name, repo id, checkpoint directory or .safetensors file"}
    )
    revision: str | None = field(default=None, metadata={"help": "hub revision (branch, tag or commit)"})
    preset: str | None = field(default=None, metadata={"help": "shape of a bare .safetensors file (e.g. gpt2)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory, for checkpoints without one"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, cuda:N or mps"})
    dtype: str = field(
        default="auto",
        metadata={"help": "auto, float32, float16, bfloat16 or int8 (int8 weights, float32 activations)"},
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback by default)"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    api_key: str | None = field(default=None, metadata={"help": "require this key (Authorization: Bearer KEY)"})
    max_batch_size: int = field(default=16, metadata={"help": "sequences decoded together"})
    max_queue: int = field(
        default=256,
        metadata={
            "help": "sequences allowed to wait, and model calls (next-token, analyze, features, gradients, "
            "attribution, steering vectors) likewise; beyond it, 429"
        },
    )
    prefill_chunk: int | None = field(
        default=None,
        metadata={"help": "prompt tokens per step, packed with decode tokens (default: 512 CUDA, 64 otherwise)"},
    )
    max_new_tokens: int = field(default=1024, metadata={"help": "server-wide cap on tokens per completion"})
    max_activation_bytes: int = field(default=256 * 2**20, metadata={"help": "largest activation dump (bytes)"})
    max_dump_bytes_in_flight: int | None = field(
        default=None,
        metadata={
            "help": "bytes of activation dumps, SAE feature readings, gradients and analyses being captured, "
            "encoded and sent at once, server-wide; one beyond them waits its turn (default: 4x --max-activation-bytes)"
        },
    )
    max_body_bytes: int = field(default=4 * 2**20, metadata={"help": "largest request body (bytes)"})
    max_gradient_bytes: int = field(
        default=4 * 2**30,
        metadata={"help": "largest autograd graph a gradient request may build (bytes, estimated from its shape)"},
    )
    cors_origins: tuple[str, ...] = field(default=(), metadata={"help": "comma-separated origins allowed by CORS"})
    sae: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "an SAE to serve, ID=PATH: a directory in SAELens' format or a hub repo/path[@revision]; "
            "repeatable (comma-separated in the variable)",
            "repeat": True,
        },
    )
    served_model_name: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "a name the OpenAI API answers to (default: --model as given); repeatable (comma-separated in "
            "the variable): /v1/models lists each, and a request for any other model is a 404",
            "repeat": True,
        },
    )
    max_steering_vectors: int = field(default=64, metadata={"help": "steering vectors kept by name, in memory"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error or critical"})
    # Slow and idle clients (see server/connections.py): each bound frees a connection a client holds.
    header_timeout: float = field(
        default=10.0, metadata={"help": "seconds for a request's headers to arrive; beyond it 408, connection closed"}
    )
    body_timeout: float = field(
        default=30.0, metadata={"help": "seconds for a request's whole body to arrive after its headers; beyond it 408"}
    )
    keep_alive_timeout: float = field(
        default=5.0, metadata={"help": "seconds an idle keep-alive connection stays open"}
    )
    write_timeout: float = field(
        default=30.0,
        metadata={"help": "seconds an answer may wait in the send buffer with none of it taken; beyond it, dropped"},
    )
    max_connections: int = field(
        default=1024,
        metadata={"help": "open connections at once; a request on one beyond them: 503 (/health excepted)"},
    )
    # On SIGTERM uvicorn stops accepting and waits for the requests in flight; unbounded, a long stream outlasts
    # any orchestrator's grace period (Kubernetes' default is 30 s) and is killed mid-body. 120 s: a thousand-token
    # stream on a CPU. Under Ray it is Serve's graceful_shutdown_timeout_s (server/ray_app.py).
    drain_timeout: float = field(
        default=120.0,
        metadata={"help": "seconds the requests in flight get to finish on shutdown (SIGTERM); then cancelled"},
    )

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_queue",
            "max_new_tokens",
            "max_activation_bytes",
            "max_body_bytes",
            "max_gradient_bytes",
            "max_connections",
            "max_steering_vectors",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "write_timeout", "drain_timeout"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a number of seconds above 0, got {getattr(self, name)}")
        for name in ("prefill_chunk", "max_dump_bytes_in_flight"):  # None: by the device, 4x max_activation_bytes
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        from model.config import PRESETS  # here: torch comes with the model package
        from model.loading import device_problem, dtype_problem

        if problem := device_problem(self.device):
            raise ValueError(f"device: {problem}")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset: unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if problem := dtype_problem(self.dtype):
            raise ValueError(f"dtype: {problem}")
        if self.host.startswith("[") and self.host.endswith("]"):  # an IPv6 address as a URL spells it: [::1]
            object.__setattr__(self, "host", self.host[1:-1])
        # an empty host would bind every interface, an empty key lock every request out, an empty tokenizer
        # mean the current directory, an empty revision name nothing
        for name in ("model", "host", "api_key", "tokenizer", "revision"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must not be empty")
        if self.api_key is not None and not _header_value(self.api_key):
            # no request could give it; a key file's or a Secret's trailing newline, most often (the key itself
            # is not echoed)
            raise ValueError(
                "api_key must not begin or end with a space or tab, nor hold a control character (a line break): "
                "an HTTP header cannot carry it"
            )
        for origin in self.cors_origins:  # a browser's Origin is scheme://host[:port] in lower case, or null
            if origin not in ("*", "null") and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/?#\sA-Z]+", origin):
                raise ValueError(
                    f"cors_origins: {origin!r} is not an origin (scheme://host[:port] in lower case, without a path "
                    "or a trailing /): a browser's Origin header would never match it"
                )
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def dump_bytes_in_flight(self) -> int:
        """The bytes of dumps (activations, SAE features, gradients) served at once: `max_dump_bytes_in_flight`,
        or 4 of the largest dump."""
        if self.max_dump_bytes_in_flight is not None:
            return self.max_dump_bytes_in_flight
        return 4 * self.max_activation_bytes


def _header_value(text: str) -> bool:
    """Whether an HTTP header can carry `text` as its value: no space or tab at either end (HTTP strips them),
    and no control character but a tab (a line break ends the header)."""
    return text == text.strip(" \t") and not any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in text)


def _env_name(name: str) -> str:
    return "GPT2_" + name.upper()


def _default(f: Field[Any]) -> str:
    """A setting's default for its help line, where it has one its help does not already give."""
    if f.default in (None, (), MISSING) or "default" in f.metadata["help"]:
        return ""
    return f" (default: {f.default})"


def parse_settings(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Flags override environment variables (`--max-queue` / `GPT2_MAX_QUEUE`), which override defaults."""
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(prog="gpt2-serve", description="Serve GPT-2 over HTTP.")
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        kind = int if f.type in ("int", "int | None") else float if f.type == "float" else str
        text = f"{f.metadata['help']}{_default(f)} [env {_env_name(f.name)}]"
        if f.metadata.get("repeat"):
            p.add_argument(flag, action="append", help=text)
        else:
            p.add_argument(flag, type=kind, help=text)
    args = p.parse_args(argv)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # each value's flag or variable, as the user gave it
    for f in fields(Settings):
        raw, source = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if raw is None:  # not given as a flag: the environment's value, checked below (errors name the variable)
            raw, source = env.get(_env_name(f.name)), _env_name(f.name)
        if raw is None:
            continue
        try:
            values[f.name], sources[f.name] = convert(f.name, raw), source
        except ValueError as e:
            p.error(f"{source} {e}")
    try:
        return Settings(**values)
    except ValueError as e:  # "max_queue must be at least 1", "device: unknown ...": named as it was given,
        name, _, rest = str(e).partition(" ")  # --max-queue or GPT2_MAX_QUEUE
        field = name.removesuffix(":")
        p.error(f"{sources[field]}{name[len(field) :]} {rest}" if field in sources else str(e))
        raise  # unreachable: p.error exits


def _texts(raw: Any) -> tuple[str, ...]:
    """A list setting's items: comma-separated text (a flag's, a variable's) or a list of texts (repeated flags,
    a Serve config's YAML), blank ones dropped."""
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)) or not all(isinstance(o, str) for o in items):
        raise ValueError(f"must be text or a list of texts, got {raw!r}")
    return tuple(o.strip() for o in items if o.strip())


def convert(name: str, raw: Any) -> Any:
    """The value of setting `name` from `raw` (text, as a flag or variable gives it, or a value of the right type
    already, as a Serve config's YAML does); a ValueError says what was wrong ("must be an integer, got 'abc'")."""
    kind = {f.name: f.type for f in fields(Settings)}[name]
    if kind == "tuple[str, ...]":  # a list setting: cors_origins, sae, served_model_name
        items = _texts(raw)
        bad = [spec for spec in items if not re.fullmatch(r"[^=]+=.+", spec)] if name == "sae" else []
        if bad:
            raise ValueError(f"must be ID=PATH (e.g. res8=./saes/blocks.8.hook_resid_pre), got {bad[0]!r}")
        return items
    if kind in ("int", "int | None"):
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError(f"must be an integer, got {raw!r}")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"must be an integer, got {raw!r}") from None
    if kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError(f"must be a number, got {raw!r}")
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"must be a number, got {raw!r}") from None
    return raw if raw is None else str(raw)
