"""The HTTP contract of issue 3 as test data and oracles, shared by the in-process tests (test_server.py)
and the end-to-end tests (test_e2e.py), which both serve the `tiny` checkpoint (context 128) with `LIMITS`:
the bad-input table with the status and `param` each request must get, the error shape, Server-Sent
Events parsing, and the in-process results (generation, log-probabilities, activations) answers must equal.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from model.generate import Completion, SamplingParams, generate
from model.hooks import Capture
from model.loading import LoadedModel

LIMITS = {"max_new_tokens": 64, "max_body_bytes": 64 * 1024, "max_activation_bytes": 8 * 2**20}
ANY = object()  # `param` not checked

GEN, CMPL, NEXT, ACTS = "/v1/generate", "/v1/completions", "/v1/next-token", "/v1/activations"


@dataclass(frozen=True)
class Bad:
    id: str
    path: str
    body: Any = None  # sent as JSON
    status: int = 400
    param: Any = ANY
    method: str = "POST"
    code: str | None = None  # OpenAI's `code`: null but for the errors it has one for
    content: bytes | None = None  # sent as is, instead of `body`

    def send(self, client: httpx.Client, **kwargs: Any) -> httpx.Response:
        if self.content is not None:
            headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
            return client.request(self.method, self.path, content=self.content, headers=headers, **kwargs)
        if self.body is None:
            return client.request(self.method, self.path, **kwargs)
        return client.request(self.method, self.path, json=self.body, **kwargs)


TOO_LONG = "context_length_exceeded"  # OpenAI's code for a prompt (with the tokens asked for) past the context


def hi(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hi", **fields}


CASES = [
    # empty or missing prompts
    Bad("empty-prompt", GEN, {"prompt": ""}, param="prompt"),
    Bad("empty-input-ids", GEN, {"input_ids": []}, param="input_ids"),
    Bad("empty-prompt-list", GEN, {"prompt": []}, param="prompt"),
    Bad("no-prompt", GEN, {}, param="prompt"),
    Bad("prompt-and-input-ids", GEN, {"prompt": "Hi", "input_ids": [1]}, param="prompt"),
    # lengths against the context (128) and the server's cap (64)
    Bad("beyond-context", GEN, {"input_ids": [464] * 100, "max_new_tokens": 60}, param="max_new_tokens", code=TOO_LONG),
    Bad("prompt-over-context", GEN, {"input_ids": [464] * 129, "max_new_tokens": 0}, param="input_ids", code=TOO_LONG),
    # past the context with a dump asked for: the context's error, not the dump's size (which it would make 413)
    Bad(
        "long-prompt-with-a-dump",
        GEN,
        {"prompt": "hello " * 500, "activations": {"hooks": ["*"]}},
        param="prompt",
        code=TOO_LONG,
    ),
    Bad(
        "beyond-context-with-a-dump",
        GEN,
        {"input_ids": [[464] * 100] * 3, "max_new_tokens": 60, "activations": {"hooks": ["*"]}},
        param="max_new_tokens",
        code=TOO_LONG,
    ),
    Bad("long-prompt-activations", ACTS, {"prompt": "hello " * 3000}, param="prompt", code=TOO_LONG),
    Bad("max-new-tokens-negative", GEN, hi(max_new_tokens=-1), param="max_new_tokens"),
    Bad("max-new-tokens-over-cap", GEN, hi(max_new_tokens=65), param="max_new_tokens"),
    # over the cap and past the whole context: said as the context's (OpenAI's code, on which clients shrink it)
    Bad("max-new-tokens-past-context", GEN, hi(max_new_tokens=128), param="max_new_tokens", code=TOO_LONG),
    # sampling values
    Bad("temperature-negative", GEN, hi(temperature=-0.1), param="temperature"),
    Bad("top-p-negative", GEN, hi(top_p=-0.01), param="top_p"),
    Bad("top-p-over-one", GEN, hi(top_p=1.5), param="top_p"),
    Bad("top-k-negative", GEN, hi(top_k=-2), param="top_k"),
    Bad("logprobs-over-20", GEN, hi(logprobs=21), param="logprobs"),
    Bad("logprobs-negative", GEN, hi(logprobs=-1), param="logprobs"),
    Bad("stop-empty-string", GEN, hi(stop=["x" * 64, ""]), param="stop"),
    # hooks and token ids
    Bad("unknown-hook", GEN, hi(activations={"hooks": ["blocks.9.hook_resid_post"]}), param="activations.hooks"),
    Bad("unknown-hook-glob", GEN, hi(activations={"hooks": ["nothing.*"]}), param="activations.hooks"),
    Bad("activation-format", GEN, hi(activations={"hooks": ["logits"], "format": "npy"}), param="activations"),
    Bad("token-id-over-vocab", GEN, {"input_ids": [50257]}, param="input_ids"),
    Bad("token-id-negative", GEN, {"input_ids": [[5], [-1]]}, param="input_ids"),
    # wrong types (a string is not a number, a number is not a boolean)
    Bad("temperature-string", GEN, hi(temperature="1"), param="temperature"),
    Bad("max-new-tokens-string", GEN, hi(max_new_tokens="5"), param="max_new_tokens"),
    Bad("max-new-tokens-float", GEN, hi(max_new_tokens=2.5), param="max_new_tokens"),
    Bad("prompt-number", GEN, {"prompt": 42}, param="prompt"),
    Bad("input-ids-strings", GEN, {"input_ids": ["1"]}, param="input_ids"),
    Bad("stream-string", GEN, hi(stream="yes"), param="stream"),
    Bad("ignore-eos-int", GEN, hi(ignore_eos=1), param="ignore_eos"),
    Bad("body-not-object", GEN, [1, 2]),
    # bodies that are not JSON, or not UTF-8
    Bad("malformed-json", GEN, content=b'{"prompt": "Hi",', param=None),
    Bad("not-utf8", GEN, content=b'{"prompt": "\xff\xfe caf\xe9"}', param=None),
    Bad("unknown-field", GEN, hi(temprature=0), param="temprature"),
    # next-token, activations, tokenizer
    Bad("next-token-empty", NEXT, {"prompt": ""}, param="prompt"),
    Bad("next-token-top-k-zero", NEXT, hi(top_k=0), param="top_k"),
    Bad("next-token-vocab", NEXT, {"input_ids": [99999]}, param="input_ids"),
    Bad("next-token-unknown-field", NEXT, hi(temperature=0), param="temperature"),
    Bad("activations-stream", ACTS, hi(stream=True), param="stream"),
    Bad("activations-unknown-hook", ACTS, hi(activations={"hooks": ["blocks.0.nope"]}), param="activations.hooks"),
    Bad("tokenize-number", "/tokenize", {"prompt": 5}, param="prompt"),
    Bad("detokenize-vocab", "/detokenize", {"tokens": [50257]}, param="tokens"),
    Bad("detokenize-string", "/detokenize", {"tokens": "abc"}, param="tokens"),
    Bad("tokenize-unknown-model", "/tokenize", hi(model="gpt-4"), status=404, param="model", code="model_not_found"),
    Bad("detokenize-unknown-model", "/detokenize", {"tokens": [1], "model": "x"}, 404, "model", code="model_not_found"),
    # OpenAI completions
    Bad("openai-prompt-number", CMPL, {"prompt": 5}, param="prompt"),  # (an empty prompt is <|endoftext|>)
    Bad("openai-unknown-model", CMPL, hi(model="davinci-002"), status=404, param="model", code="model_not_found"),
    Bad("openai-chat-fields", CMPL, hi(messages=[{"role": "user", "content": "Hi"}]), param="messages"),
    Bad("openai-max-tokens-over-cap", CMPL, hi(max_tokens=65), param="max_tokens"),
    Bad("openai-max-tokens-past-context", CMPL, hi(max_tokens=5000), param="max_tokens", code=TOO_LONG),
    Bad("openai-max-tokens-negative", CMPL, hi(max_tokens=-1), param="max_tokens"),
    Bad("openai-beyond-context", CMPL, {"prompt": [464] * 100, "max_tokens": 60}, param="max_tokens", code=TOO_LONG),
    Bad("openai-prompt-over-context", CMPL, {"prompt": [464] * 129, "max_tokens": 0}, param="prompt", code=TOO_LONG),
    Bad("stop-token-ids-over-256", GEN, hi(stop_token_ids=list(range(257))), param="stop_token_ids"),
    Bad("openai-temperature-negative", CMPL, hi(temperature=-1.0), param="temperature"),
    Bad("openai-temperature-string", CMPL, hi(temperature="1"), param="temperature"),
    Bad("openai-top-p", CMPL, hi(top_p=2.0), param="top_p"),
    Bad("openai-logprobs-over-5", CMPL, hi(logprobs=6), param="logprobs"),
    Bad("openai-n-zero", CMPL, hi(n=0), param="n"),
    Bad("openai-token-id-over-vocab", CMPL, {"prompt": [50257]}, param="prompt"),
    Bad("openai-mixed-prompt", CMPL, {"prompt": [1, "a"]}, param="prompt"),
    Bad("openai-presence-penalty", CMPL, hi(presence_penalty=2.5), param="presence_penalty"),
    Bad("openai-frequency-penalty", CMPL, hi(frequency_penalty=-3.0), param="frequency_penalty"),
    Bad("openai-repetition-penalty", CMPL, hi(repetition_penalty=0.0), param="repetition_penalty"),
    Bad("openai-min-p", CMPL, hi(min_p=1.5), param="min_p"),
    Bad("openai-logit-bias-key", CMPL, hi(logit_bias={"abc": 0}), param="logit_bias"),
    Bad("openai-logit-bias-two-minus", CMPL, hi(logit_bias={"--5": 1}), param="logit_bias"),
    Bad("openai-logit-bias-past-vocab", CMPL, hi(logit_bias={"50257": -100}), param="logit_bias"),
    Bad("openai-logit-bias-range", CMPL, hi(logit_bias={"11": 101}), param="logit_bias"),
    Bad("openai-logit-bias-string", CMPL, hi(logit_bias={"11": "5"}), param="logit_bias"),
    Bad("generate-logit-bias-twice", GEN, hi(logit_bias={"11": 1, "011": 2}), param="logit_bias"),
    Bad("generate-repetition-penalty", GEN, hi(repetition_penalty=-1), param="repetition_penalty"),
    Bad("openai-best-of", CMPL, hi(best_of=3), param="best_of"),
    Bad("openai-best-of-bool", CMPL, hi(best_of=True), param="best_of"),
    Bad(
        "openai-include-usage-string",
        CMPL,
        hi(stream=True, stream_options={"include_usage": "yes"}),
        param="stream_options",
    ),
    Bad("openai-suffix", CMPL, hi(suffix="!"), param="suffix"),
    Bad("openai-malformed-json", CMPL, content=b"{", param=None),
    # routes and methods
    Bad("unknown-route", "/v1/nothing", method="GET", status=404, param=None),
    Bad("chat-completions", "/v1/chat/completions", {"messages": []}, status=404, param="model"),  # not a chat model
    Bad("get-generate", GEN, method="GET", status=405, param=None),
    Bad("post-health", "/health", {}, status=405, param=None),
    Bad("delete-models", "/v1/models", method="DELETE", status=405, param=None),
    # sizes
    Bad("body-over-limit", GEN, {"prompt": "a" * 70_000}, status=413, param=None),
    Bad(
        "activation-dump-over-limit",
        GEN,
        {"input_ids": [464] * 60, "max_new_tokens": 60, "activations": {"hooks": ["logits"]}},
        status=413,
        param="activations",
    ),
    Bad("activations-route-over-limit", ACTS, {"input_ids": [464] * 60}, status=413, param="activations"),
]

# Fields OpenAI clients send that change nothing here: accepted.
HARMLESS_OPENAI_FIELDS = {
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "logit_bias": {"50256": 0, "11": 0.0},  # biases of 0 change nothing
    "min_p": 0,
    "repetition_penalty": 1,
    "best_of": 1,
    "user": "someone",
    "suffix": None,
}


def assert_error(response: httpx.Response, status: int, param: Any = ANY, code: Any = ANY) -> dict[str, Any]:
    """`response` is the JSON error the contract asks for: `{"error": {"type", "message", "param", "code"}}`
    (`code` null but for the errors OpenAI gives one)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"type", "message", "param", "code"}, body
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] is None or isinstance(error["code"], str), body
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text and 'File "' not in response.text
    if param is not ANY:
        assert error["param"] == param, body
    if code is not ANY:
        assert error["code"] == code, body
    return error


def sse_events(text: str) -> list[dict[str, Any]]:
    """The JSON events of a Server-Sent Events body, which must end with `data: [DONE]`."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert blocks and blocks[-1] == "data: [DONE]", text[-300:]
    events = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(json.loads(block.removeprefix("data: "), parse_constant=_not_json))
    return events


def _not_json(name: str) -> None:
    """Python's json reads NaN, Infinity and -Infinity; JSON has none of them, and other parsers refuse them."""
    raise AssertionError(f"{name} in a stream's event is not JSON")


def assert_same(a: Any, b: Any, tol: float = 1e-5, where: str = "") -> None:
    """Equal JSON values, floats to within `tol` (log-probabilities of a row decoded alone and in a batch
    differ in the last bits: batched matrix products sum in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= tol, f"{where}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, tol, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's header (8-byte little-endian length, then JSON)."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]).get("__metadata__", {})


# --- what the answers must equal: the model in this process -------------------------------------


def greedy(loaded: LoadedModel, ids: list[int], max_new_tokens: int, **params: Any) -> Completion:
    """`model.generate.generate` on one prompt, greedy."""
    p = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params)
    return generate(loaded.model, [ids], p, loaded.tokenizer)[0]


def full_logprobs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of one forward pass over `ids`, without a cache: [T, vocab]."""
    with torch.inference_mode():
        return torch.log_softmax(loaded.model(torch.tensor([ids]))[0].float(), dim=-1)


def full_capture(loaded: LoadedModel, ids: list[int], names: list[str]) -> dict[str, torch.Tensor]:
    """The hook values of one forward pass over `ids`, without a cache."""
    capture = Capture(names)
    with torch.inference_mode():
        loaded.model(torch.tensor([ids]), None, capture)
    return capture.tensors()
