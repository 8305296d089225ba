"""Activation tensors to wire formats: JSON (nested lists) or a safetensors file (raw, or base64 in JSON).

A dump can be hundreds of megabytes. The routes refuse it (413) when its size on the wire, known before
running, is over the server's limit, and encode it on a worker thread, a piece of a few megabytes at a
time: the event loop's thread gets the GIL back between pieces, so other requests keep being served, and
an encoding whose client has left stops at its next piece.
"""

from __future__ import annotations

import base64
import math
import secrets
from typing import Any, Literal

import pydantic_core
import torch

from model.config import GPTConfig
from model.dump import dump_pieces
from model.hooks import is_attention_square, site_shape

from .errors import ClientLeft
from .middleware import client_left

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
Wire = Literal["json", "safetensors_base64", "safetensors"]
# The longest JSON text of a float32, float16 or bfloat16 number (-0.000027556148779694922) and its comma;
# ~20 on average for activations, so JSON is about 5x the raw float32 bytes.
JSON_BYTES_PER_VALUE = 25
ENCODE_VALUES = 2**16  # numbers written to JSON at a time (about 2 ms), the GIL let go in between


def dump_bytes_on_wire(config: GPTConfig, names: list[str], n_tokens: int, dtype: str, wire: Wire) -> int:
    """Bytes a dump of `names` over `n_tokens` positions takes in the response, known before running (at
    most that, for JSON): a safetensors file of `dtype` tensors, that file in base64, or JSON text."""
    values = activation_values(config, names, n_tokens)
    if wire == "json":
        return values * JSON_BYTES_PER_VALUE
    raw = values * DTYPES[dtype].itemsize
    return raw if wire == "safetensors" else 4 * math.ceil(raw / 3)


# SAE features in JSON: per feature {"id": i, "value": v}, per token its four statistics and the keys.
FEATURE_JSON_BYTES = 2 * JSON_BYTES_PER_VALUE + len('{"id":,"value":},')
TOKEN_FEATURES_JSON_BYTES = 4 * JSON_BYTES_PER_VALUE + len(
    '{"features":[],"l0":,"mse":,"error_norm":,"variance_explained":},'
)


def features_bytes_on_wire(n_tokens: int, k: int, wire: Literal["json", "safetensors"]) -> int:
    """Bytes an SAE reading of `k` features per token over `n_tokens` positions takes in the response, at
    most: JSON text, or the safetensors file's arrays (indices int64 and values float32 [T, k]; l0 int64,
    mse and variance_explained float32 [T])."""
    if wire == "json":
        return n_tokens * (k * FEATURE_JSON_BYTES + TOKEN_FEATURES_JSON_BYTES)
    return n_tokens * (k * (8 + 4) + 8 + 4 + 4)


# /v1/analyze: every layer's logit lens holds top_k {"id", "token", "prob"} a position, the bulk of the answer.
# The least such an entry can take in JSON: a one-digit id, an empty token text, a three-character number.
LENS_ENTRY_MIN_JSON_BYTES = len('{"id":0,"token":"","prob":0.0},')


def analysis_min_bytes(config: GPTConfig, n_tokens: int, top_k: int, runs: int) -> int:
    """Bytes /v1/analyze's answer takes in JSON at least, known before running: the logit lens of `runs`
    measured runs (2 with the run without residual connections), the embeddings' and every block's. A lower
    bound: over a limit it is certainly over; the answer itself is measured once built."""
    return runs * (config.n_layer + 1) * n_tokens * top_k * LENS_ENTRY_MIN_JSON_BYTES


# About what an entry takes with GPT-2's tokens (its id, token text and probability: 50-65 bytes), and the
# rest of the answer: per layer and position of a run, the stream's norm (about 20 bytes); per layer, its keys
# and numbers and each head's attention entropy; per token of the prompt, its id and text.
LENS_ENTRY_JSON_BYTES, POSITION_JSON_BYTES, LAYER_JSON_BYTES, HEAD_JSON_BYTES, TOKEN_JSON_BYTES = 64, 24, 256, 24, 32


def analysis_bytes(config: GPTConfig, n_tokens: int, top_k: int, runs: int) -> int:
    """Bytes /v1/analyze's answer takes in JSON, about, known before running (1.07-1.2x the answers measured
    on gpt2-small's shape at top_k 1-50): an estimate, not a bound, as `analysis_min_bytes` is a lower one."""
    per_layer = LAYER_JSON_BYTES + config.n_head * HEAD_JSON_BYTES
    per_layer += n_tokens * (POSITION_JSON_BYTES + top_k * LENS_ENTRY_JSON_BYTES)
    return n_tokens * TOKEN_JSON_BYTES + runs * (config.n_layer + 1) * per_layer


def activation_values(config: GPTConfig, names: list[str], n_tokens: int) -> int:
    """How many numbers a dump of `names` over `n_tokens` positions holds."""
    per_name = 0
    for name in names:
        site = math.prod(site_shape(name, config.n_head, config.d_head, config.d_mlp, config.vocab_size))
        per_name += site * n_tokens * (n_tokens if is_attention_square(name) else 1)  # squares: [H, T, T]
    return per_name


def cast(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    return {name: t.to(device="cpu", dtype=DTYPES[dtype]) for name, t in tensors.items()}


class RawJSON:
    """JSON text written already, in pieces (a dump's numbers, a block of rows at a time), which
    `json_bytes` puts in place as it is. (Not a dataclass: pydantic would write those itself.)"""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces


def json_bytes(content: Any) -> bytes:
    """JSON text of a response, by pydantic's compiled encoder (about 10x `json.dumps`), with `RawJSON`
    values spliced in. JSON has no infinities or NaN: they become null."""
    raw: list[RawJSON] = []
    mark = secrets.token_hex(16)  # stands for each RawJSON: random, so no text in `content` holds it

    def placeholder(value: Any) -> str:  # pydantic asks it about values of types it does not know
        if not isinstance(value, RawJSON):
            raise TypeError(f"{type(value).__name__} cannot be written as JSON")
        raw.append(value)
        return mark

    text = pydantic_core.to_json(content, inf_nan_mode="null", fallback=placeholder)
    pieces: list[bytes] = []
    for between, r in zip(text.split(f'"{mark}"'.encode()), [*raw, RawJSON([])], strict=True):
        pieces += [between, *r.pieces]
    return b"".join(pieces)  # the one copy of the whole text


def to_json(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, Any]:
    """`{name: {"shape", "dtype", "data"}}` for `json_bytes`; masked scores (-inf) become null."""
    out = {}
    for name, t in cast(tensors, dtype).items():
        pieces: list[bytes] = []
        _nested_lists(t.float(), pieces)
        out[name] = {"shape": list(t.shape), "dtype": dtype, "data": RawJSON(pieces)}
    return out


def unless_client_left() -> None:
    """A long encoding asks between its pieces: where the client has left, it stops (`ClientLeft`), rather
    than write the rest of an answer for no one (seconds of a core, for a dump)."""
    if client_left():
        raise ClientLeft()


def _nested_lists(t: torch.Tensor, out: list[bytes]) -> None:
    """Append `t` as JSON nested lists to `out`, written a block of rows (at most `ENCODE_VALUES` numbers,
    or one row) at a time."""
    if t.dim() <= 1 or t.numel() <= ENCODE_VALUES:
        unless_client_left()
        out.append(pydantic_core.to_json(t.tolist(), inf_nan_mode="null"))
        return
    out.append(b"[")
    for i, row in enumerate(t):
        if i:
            out.append(b",")
        _nested_lists(row, out)
    out.append(b"]")


def to_safetensors(tensors: dict[str, torch.Tensor], dtype: str, metadata: dict[str, Any]) -> list[bytes | memoryview]:
    """The safetensors file of `tensors` cast to `dtype`, in pieces (`model.dump.dump_pieces`: its header, then
    each tensor's own memory), to send one after another without joining them."""
    return dump_pieces(cast(tensors, dtype), metadata)


def to_safetensors_base64(tensors: dict[str, torch.Tensor], dtype: str, metadata: dict[str, Any]) -> RawJSON:
    """The safetensors file as a JSON string of base64, encoded 3 MiB at a time (a multiple of 3 bytes,
    so the pieces join into the base64 of the whole), across the file's pieces."""
    step, out, carry = 3 * 2**20, [b'"'], b""
    for piece in to_safetensors(tensors, dtype, metadata):
        view = memoryview(piece).cast("B")
        if carry:  # the bytes of the pieces before that did not make a multiple of 3: topped up from this one
            top = (-len(carry)) % 3
            carry, view = carry + bytes(view[:top]), view[top:]
            if len(carry) % 3:
                continue
            out.append(base64.b64encode(carry))
            carry = b""
        whole = len(view) - len(view) % 3
        for i in range(0, whole, step):
            unless_client_left()
            out.append(base64.b64encode(view[i : min(i + step, whole)]))
        carry = bytes(view[whole:])
    return RawJSON([*out, base64.b64encode(carry), b'"'])
