"""The HTTP server in process: every endpoint and every error of issue 3, through `create_app` around an
already-loaded `tiny` model, checked against the same model run directly (generation, log-probabilities,
activations)."""

from __future__ import annotations

import base64
import json
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import torch
from contract import (
    ACTS,
    CASES,
    CMPL,
    GEN,
    HARMLESS_OPENAI_FIELDS,
    NEXT,
    Bad,
    assert_error,
    assert_same,
    full_capture,
    full_logprobs,
    greedy,
    safetensors_metadata,
    sse_events,
)
from fastapi.testclient import TestClient
from inprocess import assert_still_serving, engine_held, post_ok, serve, settings, wait_until, wrap_forward_passes
from prometheus_client.parser import text_string_to_metric_families

import server.app as app_module
from model.hooks import OPTIONAL_SITES, hook_names
from model.loading import LoadedModel
from model.tokenizer import EOT_ID
from server import encoding
from server.app import create_app
from server.schemas import CompletionRequest

PROMPTS = ["Hello world", "The quick brown fox jumps over", "In 1905, Einstein", "Ünïcödé ✓ text"]


@pytest.fixture(scope="module")
def client(loaded: LoadedModel) -> Iterator[TestClient]:
    with serve(loaded) as c:
        yield c


def ids_of(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text)


def metric(client: TestClient, name: str, **labels: str) -> float:
    value = client.app.state.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# --- operations and model information ---------------------------------------------------------


def test_health(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_health_answers_head_and_the_schema_names_each_operation_once(client: TestClient) -> None:
    """Health checkers often send HEAD; one route for GET and HEAD gave both methods one operation id, which
    FastAPI warned about each time the schema was built (and which a client generator would trip on)."""
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = client.app.openapi()  # type: ignore[attr-defined]
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)) and "head" not in schema["paths"]["/health"]


def test_model_info(client: TestClient, loaded: LoadedModel) -> None:
    info = client.get("/v1/model").json()
    assert info["name"] == loaded.name
    assert info["revision"] is None
    assert (info["dtype"], info["device"]) == ("float32", "cpu")
    assert (info["n_layer"], info["n_head"], info["d_model"], info["n_ctx"]) == (2, 4, 64, 128)
    assert info["vocab_size"] == 50257
    assert info["hook_names"] == hook_names(2)
    assert len(info["hook_names"]) == 2 + 23 * 2 + 5
    assert info["optional_hook_names"] == [n for n in hook_names(2) if n.endswith(OPTIONAL_SITES)]
    assert {"hook_embed", "blocks.1.attn.hook_pattern", "blocks.0.mlp.hook_post", "logits"} <= set(info["hook_names"])


def test_models_list(client: TestClient, loaded: LoadedModel) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (entry,) = body["data"]
    assert entry["id"] == loaded.name
    assert entry["object"] == "model"
    assert isinstance(entry["created"], int) and isinstance(entry["owned_by"], str)


def test_tokenize_detokenize(client: TestClient, loaded: LoadedModel) -> None:
    text = "Hello world, ünïcödé ✓ <|endoftext|>"
    body = post_ok(client, "/tokenize", {"prompt": text, "add_special_tokens": True, "model": loaded.name})
    assert body["tokens"] == loaded.tokenizer.encode(text)
    assert body["tokens"][-1] == 50256
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128
    assert body["token_strs"] is None
    assert post_ok(client, "/detokenize", {"tokens": body["tokens"]}) == {"prompt": text}
    assert post_ok(client, "/detokenize", {"tokens": body["tokens"], "model": None}) == {"prompt": text}
    huge_id = f'{{"tokens": [1, 1{"0" * 400}]}}'
    huge = client.post("/detokenize", content=huge_id, headers={"content-type": "application/json"})
    assert "token id 1000" in assert_error(huge, 400, "tokens")["message"] and len(huge.text) < 400  # clipped


def test_tokenize_can_read_the_end_of_text_marker_as_text(client: TestClient, tokenizer_dir: Path) -> None:
    """transformers' `split_special_tokens`: `<|endoftext|>` written in the text is then its characters'
    tokens, as transformers gives them, and not id 50256; detokenized, the same text either way."""
    from transformers import GPT2TokenizerFast

    reference = GPT2TokenizerFast.from_pretrained(str(tokenizer_dir))
    text = "a<|endoftext|>b <|endoftext|>"
    split = post_ok(client, "/tokenize", {"prompt": text, "split_special_tokens": True})["tokens"]
    assert split == reference(text, split_special_tokens=True)["input_ids"]
    assert 50256 not in split and len(split) > 4
    whole = post_ok(client, "/tokenize", {"prompt": text, "split_special_tokens": False})["tokens"]
    assert whole == reference(text)["input_ids"] and whole.count(50256) == 2
    for ids in (split, whole):
        assert post_ok(client, "/detokenize", {"tokens": ids}) == {"prompt": text}
    bad = client.post("/tokenize", json={"prompt": text, "split_special_tokens": "yes"})
    assert bad.status_code == 400 and "split_special_tokens" in bad.text


def test_tokenize_returns_the_vocabulary_strings_when_asked(client: TestClient, tokenizer_dir: Path) -> None:
    """vLLM's `return_token_strs`: each token's string in the vocabulary, transformers' `convert_ids_to_tokens`
    (a space is `Ġ`; a piece of a character is its byte's character, so two ids never share one)."""
    from transformers import GPT2TokenizerFast

    reference = GPT2TokenizerFast.from_pretrained(str(tokenizer_dir))
    text = "Hello world, 😀 ü <|endoftext|>\n\n  x"
    body = post_ok(client, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert body["token_strs"] == reference.convert_ids_to_tokens(body["tokens"])
    assert body["token_strs"][:2] == ["Hello", "Ġworld"] and body["token_strs"][-1] == "Ġx"


def test_tokenizer_info(client: TestClient) -> None:
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>"
    assert info["eos_token_id"] == 50256
    assert info["model_max_length"] == 128


# --- native API ---------------------------------------------------------------------------------


def reference_bytes(tokenizer_dir: Path, token_id: int) -> bytes:
    """A token's bytes as transformers spells them: its vocabulary string, one character a byte."""
    from transformers import GPT2TokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    piece = GPT2TokenizerFast.from_pretrained(str(tokenizer_dir)).convert_ids_to_tokens(token_id)
    return piece.encode() if piece == "<|endoftext|>" else bytes(byte_of[c] for c in piece)


def test_next_token(client: TestClient, loaded: LoadedModel, tokenizer_dir: Path) -> None:
    ids = ids_of(loaded, "The quick brown fox")
    body = post_ok(client, NEXT, {"prompt": "The quick brown fox", "top_k": 7})
    assert body["input_ids"] == ids
    assert body["tokens"] == [loaded.tokenizer.token_text(t) for t in ids]
    logprobs = full_logprobs(loaded, ids)[-1]
    probs = logprobs.exp()
    top = torch.topk(probs, 7)
    assert [t["id"] for t in body["top"]] == top.indices.tolist()
    for entry, p, i in zip(body["top"], top.values.tolist(), top.indices.tolist(), strict=True):
        assert entry["token"] == loaded.tokenizer.token_text(i)
        assert bytes(entry["bytes"]) == reference_bytes(tokenizer_dir, i)
        assert entry["prob"] == pytest.approx(p, rel=1e-4, abs=1e-7)
        assert entry["logprob"] == pytest.approx(float(logprobs[i]), abs=1e-4)
    entropy = float(-(probs * logprobs).sum())
    assert body["entropy"] == pytest.approx(entropy, rel=1e-4)
    assert post_ok(client, NEXT, {"input_ids": ids, "top_k": 7})["top"] == body["top"]


def test_generate_greedy_equals_in_process(client: TestClient, loaded: LoadedModel) -> None:
    body = post_ok(client, GEN, {"prompt": PROMPTS, "max_new_tokens": 12, "temperature": 0})
    assert body["id"] and body["model"] == loaded.name
    assert [c["index"] for c in body["choices"]] == list(range(len(PROMPTS)))
    prompt_tokens = completion_tokens = 0
    for text, choice in zip(PROMPTS, body["choices"], strict=True):
        ids = ids_of(loaded, text)
        ref = greedy(loaded, ids, 12)
        assert choice["token_ids"] == ref.token_ids
        assert choice["text"] == ref.text
        assert choice["tokens"] == [loaded.tokenizer.token_text(t) for t in ref.token_ids]
        assert choice["finish_reason"] == ref.finish_reason
        prompt_tokens += len(ids)
        completion_tokens += len(ref.token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    # the same prompts as token ids
    ids_body = post_ok(
        client, GEN, {"input_ids": [ids_of(loaded, p) for p in PROMPTS], "max_new_tokens": 12, "temperature": 0}
    )
    assert [c["token_ids"] for c in ids_body["choices"]] == [c["token_ids"] for c in body["choices"]]
    single = post_ok(client, GEN, {"input_ids": ids_of(loaded, PROMPTS[1]), "max_new_tokens": 12, "temperature": 0})
    assert single["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]


def test_generate_stop_token_ids(client: TestClient, loaded: LoadedModel) -> None:
    ids = ids_of(loaded, "Hello world")
    ref = greedy(loaded, ids, 5, ignore_eos=True)
    stop_id = ref.token_ids[2]
    body = post_ok(client, GEN, {"input_ids": ids, "max_new_tokens": 5, "temperature": 0, "stop_token_ids": [stop_id]})
    choice = body["choices"][0]
    first = ref.token_ids.index(stop_id)
    assert choice["token_ids"] == ref.token_ids[: first + 1]
    assert choice["finish_reason"] == "stop"
    body = post_ok(client, GEN, {"input_ids": ids, "max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert body["choices"][0]["finish_reason"] == "length"


def test_generate_logprobs(client: TestClient, loaded: LoadedModel) -> None:
    ids = ids_of(loaded, PROMPTS[1])
    body = post_ok(client, GEN, {"input_ids": ids, "max_new_tokens": 6, "temperature": 0, "logprobs": 3})
    choice = body["choices"][0]
    generated = choice["token_ids"]
    ref = full_logprobs(loaded, ids + generated)
    assert len(choice["logprobs"]) == len(generated)
    for i, (token, lp) in enumerate(zip(generated, choice["logprobs"], strict=True)):
        row = ref[len(ids) - 1 + i]
        assert lp["id"] == token and lp["token"] == loaded.tokenizer.token_text(token)
        assert lp["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t["id"] for t in lp["top"]] == top.indices.tolist()
        assert [t["logprob"] for t in lp["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t["token"] for t in lp["top"]] == [loaded.tokenizer.token_text(t) for t in top.indices.tolist()]
    zero = post_ok(client, GEN, {"input_ids": ids, "max_new_tokens": 2, "temperature": 0, "logprobs": 0})
    assert [lp["top"] for lp in zero["choices"][0]["logprobs"]] == [[], []]
    assert "logprobs" not in post_ok(client, GEN, {"input_ids": ids, "max_new_tokens": 1})["choices"][0]


def test_generate_stop_strings(client: TestClient, loaded: LoadedModel) -> None:
    prompt = PROMPTS[2]
    ref = greedy(loaded, ids_of(loaded, prompt), 20, ignore_eos=True)
    full = ref.text
    # the first generated token whose text first appears after the start of the continuation
    texts = [loaded.tokenizer.token_text(t)[:3] for t in ref.token_ids[1:]]
    stop = next((t for t in texts if len(t.strip()) >= 2 and full.find(t) > 0), "")
    assert stop, f"no usable stop string in {full!r}"
    expected = full[: full.find(stop)]
    request = {"prompt": prompt, "max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    for stop_field in ([stop, "never appears here"], stop):
        choice = post_ok(client, GEN, {**request, "stop": stop_field})["choices"][0]
        assert choice["text"] == expected
        assert choice["finish_reason"] == "stop"
        assert choice["token_ids"] == ref.token_ids[: len(choice["token_ids"])]
    streamed = sse_events(client.post(GEN, json={**request, "stop": [stop], "stream": True}).text)
    assert "".join(e["text"] for e in streamed) == expected
    assert streamed[-1]["finish_reason"] == "stop"
    choice = post_ok(client, GEN, {**request, "stop": ["never appears here"]})["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (full, "length")


def test_generate_stream(client: TestClient, loaded: LoadedModel) -> None:
    request = {"prompt": PROMPTS[:2], "max_new_tokens": 10, "temperature": 0, "logprobs": 1}
    whole = post_ok(client, GEN, request)
    r = client.post(GEN, json={**request, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    for choice in whole["choices"]:
        mine = [e for e in events if e["index"] == choice["index"]]
        tokens, final = mine[:-1], mine[-1]
        assert [e["token_id"] for e in tokens] == choice["token_ids"]
        assert "".join(e["text"] for e in tokens) == choice["text"]
        assert [e["logprob"] for e in tokens] == pytest.approx([lp["logprob"] for lp in choice["logprobs"]])
        assert all(e["finish_reason"] is None for e in tokens)
        assert final["finish_reason"] == choice["finish_reason"]
        n_prompt = len(ids_of(loaded, PROMPTS[choice["index"]]))
        assert final["usage"] == {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(choice["token_ids"]),
            "total_tokens": n_prompt + len(choice["token_ids"]),
        }


ACTIVATION_HOOKS = ["blocks.0.hook_resid_post", "blocks.*.attn.hook_pattern", "blocks.1.attn.hook_attn_scores"]


def _generated_with_activations(client: TestClient, loaded: LoadedModel, fmt: str, dtype: str) -> tuple[Any, Any]:
    ids = ids_of(loaded, PROMPTS[0])
    request = {
        "input_ids": ids,
        "max_new_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "activations": {"hooks": ACTIVATION_HOOKS, "format": fmt, "dtype": dtype},
    }
    choice = post_ok(client, GEN, request)["choices"][0]
    assert choice["token_ids"] == greedy(loaded, ids, 5, ignore_eos=True).token_ids
    names = [
        "blocks.0.hook_resid_post",
        "blocks.0.attn.hook_pattern",
        "blocks.1.attn.hook_attn_scores",
        "blocks.1.attn.hook_pattern",
    ]
    ref = full_capture(loaded, ids + choice["token_ids"], names)
    return choice, ref


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_generate_activations_json(client: TestClient, loaded: LoadedModel, dtype: str) -> None:
    choice, ref = _generated_with_activations(client, loaded, "json", dtype)
    acts = choice["activations"]
    assert set(acts) == set(ref)
    n_positions = len(ids_of(loaded, PROMPTS[0])) + 5
    tolerance = 1e-4 if dtype == "float32" else 2e-3
    for name, expected in ref.items():
        entry = acts[name]
        assert entry["dtype"] == dtype
        assert entry["shape"] == list(expected.shape)
        assert n_positions in expected.shape
        if name.endswith("hook_attn_scores"):  # JSON has no -inf: masked scores come as null
            data = [
                [[[float("-inf") if x is None else x for x in row] for row in head] for head in b]
                for b in entry["data"]
            ]
        else:
            data = entry["data"]
        got = torch.tensor(data)
        want = expected.to(getattr(torch, dtype)).float()
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_generate_activations_safetensors(client: TestClient, loaded: LoadedModel, dtype: str) -> None:
    choice, ref = _generated_with_activations(client, loaded, "safetensors_base64", dtype)
    blob = base64.b64decode(choice["activations"])
    tensors = safetensors.torch.load(blob)
    assert set(tensors) == set(ref)
    torch_dtype = getattr(torch, dtype)
    tolerance = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
    for name, expected in ref.items():
        assert tensors[name].dtype == torch_dtype
        torch.testing.assert_close(
            tensors[name].float(), expected.to(torch_dtype).float(), atol=tolerance, rtol=tolerance
        )
    meta = safetensors_metadata(blob)  # what every dump's metadata holds (the README's "Loading a dump")
    assert json.loads(meta["token_ids"]) == ids_of(loaded, PROMPTS[0]) + choice["token_ids"]
    assert meta["text"] == PROMPTS[0] + choice["text"] and meta["model"] == loaded.name and meta["weights"] == "float32"


def test_generate_activations_stream(client: TestClient, loaded: LoadedModel) -> None:
    request = {
        "prompt": PROMPTS[0],
        "max_new_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "activations": {"hooks": ["blocks.1.hook_resid_post"]},
    }
    whole = post_ok(client, GEN, request)["choices"][0]
    events = sse_events(client.post(GEN, json={**request, "stream": True}).text)
    assert events[-1]["activations"] == whole["activations"]


def test_activations_endpoint(client: TestClient, loaded: LoadedModel) -> None:
    ids = ids_of(loaded, PROMPTS[1])
    r = client.post("/v1/activations", json={"input_ids": ids})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    tensors = safetensors.torch.load(r.content)
    assert sorted(tensors) == sorted(hook_names(2, optional=False))  # "*": TransformerLens' default hooks
    ref = full_capture(loaded, ids, hook_names(2, optional=False))
    for name, expected in ref.items():
        got = tensors[name]
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), name
        finite = torch.isfinite(expected)
        torch.testing.assert_close(got[finite], expected[finite], atol=1e-5, rtol=1e-5)
    meta = safetensors_metadata(r.content)
    assert json.loads(meta["token_ids"]) == ids
    result = json.loads(meta["result"])
    assert result["model"] == meta["model"] == loaded.name
    assert result["choices"][0]["token_ids"] == [] and result["choices"][0]["text"] == ""


def test_activations_endpoint_spec_without_hooks_or_with_a_format(client: TestClient, loaded: LoadedModel) -> None:
    """`activations` given for its dtype alone still dumps every default hook point; a `format` is refused
    (the answer is a safetensors file whatever it says), and the server serves on."""
    ids = ids_of(loaded, PROMPTS[1])
    r = client.post("/v1/activations", json={"input_ids": ids, "activations": {"dtype": "float16"}})
    assert r.status_code == 200, r.text
    tensors = safetensors.torch.load(r.content)
    assert sorted(tensors) == sorted(hook_names(2, optional=False))
    assert all(t.dtype == torch.float16 for t in tensors.values())
    for fmt in ("json", "safetensors_base64"):
        body = {"input_ids": ids, "activations": {"hooks": ["logits"], "format": fmt}}
        error = assert_error(client.post("/v1/activations", json=body), 400, "activations")
        assert "format is not taken here: /v1/activations answers with a safetensors file" in error["message"]
    assert_still_serving(client)


def test_activations_endpoint_with_generation(client: TestClient, loaded: LoadedModel) -> None:
    request = {
        "prompt": PROMPTS[0],
        "max_new_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "activations": {"hooks": ["blocks.*.hook_resid_post", "logits"], "dtype": "float16"},
    }
    r = client.post("/v1/activations", json=request)
    assert r.status_code == 200, r.text
    tensors = safetensors.torch.load(r.content)
    meta = safetensors_metadata(r.content)
    ids = ids_of(loaded, PROMPTS[0])
    ref = greedy(loaded, ids, 4, ignore_eos=True)
    result = json.loads(meta["result"])
    assert result["choices"][0]["token_ids"] == ref.token_ids
    assert result["choices"][0]["text"] == ref.text
    assert json.loads(meta["token_ids"]) == ids + ref.token_ids
    assert meta["text"] == PROMPTS[0] + ref.text
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "logits"]
    expected = full_capture(loaded, ids + ref.token_ids, names)
    assert sorted(tensors) == sorted(names)
    for name in names:
        assert tensors[name].dtype == torch.float16
        torch.testing.assert_close(tensors[name], expected[name].half(), atol=2e-2, rtol=2e-3)


def test_a_dump_is_captured_in_its_own_dtype(client: TestClient, loaded: LoadedModel, monkeypatch) -> None:
    """The engine keeps a dump's activations in the dtype it is sent in, cast as each is captured (a float16
    dump is never held in float32 first, twice its size): /v1/activations and /v1/generate hand it over."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    submit, asked = engine.submit, []

    def spy(*args: Any, **kwargs: Any) -> Any:
        streams = submit(*args, **kwargs)
        asked.append(args[5] if len(args) > 5 else kwargs.get("capture_dtype"))
        return streams

    monkeypatch.setattr(engine, "submit", spy)
    ids = ids_of(loaded, PROMPTS[1])
    for dtype in ("float16", "bfloat16", "float32"):
        spec = {"hooks": ["blocks.0.hook_resid_post"], "dtype": dtype}
        r = client.post("/v1/activations", json={"input_ids": ids, "activations": spec})
        assert r.status_code == 200, r.text
        assert safetensors.torch.load(r.content)["blocks.0.hook_resid_post"].dtype == encoding.DTYPES[dtype]
        post_ok(client, GEN, {"input_ids": ids, "max_new_tokens": 2, "activations": spec})
    assert asked == [torch.float16, torch.float16, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]


# --- OpenAI-compatible API ----------------------------------------------------------------------


def test_completions_shape_and_greedy(client: TestClient, loaded: LoadedModel) -> None:
    body = post_ok(client, CMPL, {"model": loaded.name, "prompt": PROMPTS[1], "max_tokens": 7, "temperature": 0})
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 600
    assert body["model"] == loaded.name
    (choice,) = body["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    ref = greedy(loaded, ids_of(loaded, PROMPTS[1]), 7)
    assert choice == {"text": ref.text, "index": 0, "logprobs": None, "finish_reason": "length"}
    n = len(ids_of(loaded, PROMPTS[1]))
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 7, "total_tokens": n + 7}
    default = post_ok(client, CMPL, {"prompt": PROMPTS[1], "temperature": 0})  # max_tokens defaults to 16
    assert default["choices"][0]["text"] == greedy(loaded, ids_of(loaded, PROMPTS[1]), 16).text
    assert default["model"] == loaded.name


def test_completions_prompt_forms(client: TestClient, loaded: LoadedModel) -> None:
    refs = [greedy(loaded, ids_of(loaded, p), 5).text for p in PROMPTS]
    base = {"max_tokens": 5, "temperature": 0}
    forms = [PROMPTS, [ids_of(loaded, p) for p in PROMPTS]]
    for prompt in forms:
        body = post_ok(client, CMPL, {**base, "prompt": prompt})
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in body["choices"]] == refs
    body = post_ok(client, CMPL, {**base, "prompt": ids_of(loaded, PROMPTS[2])})
    assert body["choices"][0]["text"] == refs[2]


def test_completions_n(client: TestClient, loaded: LoadedModel) -> None:
    body = post_ok(client, CMPL, {"prompt": PROMPTS[0], "n": 3, "max_tokens": 4, "temperature": 0})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    ref = greedy(loaded, ids_of(loaded, PROMPTS[0]), 4).text
    assert [c["text"] for c in body["choices"]] == [ref] * 3
    n = len(ids_of(loaded, PROMPTS[0]))
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 12, "total_tokens": n + 12}
    # n prompts x n samples, seeded: choices in prompt order, each sample with its own seed, reproducible
    sampled = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    first = post_ok(client, CMPL, sampled)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert post_ok(client, CMPL, sampled)["choices"] == first["choices"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_completions_echo_logprobs_equal_log_softmax(client: TestClient, loaded: LoadedModel, max_tokens: int) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, temperature 0, max_tokens 0 or 1."""
    context, continuation = "The capital of France is", " Paris, of course"
    prompt = context + continuation
    ids = ids_of(loaded, prompt)
    all_ids = ids + greedy(loaded, ids, max_tokens).token_ids
    ref = full_logprobs(loaded, all_ids)
    request = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
    (choice,) = post_ok(client, CMPL, request)["choices"]
    assert choice["text"] == loaded.tokenizer.decode(all_ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [loaded.tokenizer.token_text(t) for t in all_ids]
    assert lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    for i in range(1, len(all_ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[i - 1, all_ids[i]]), abs=1e-5), i
        top = lp["top_logprobs"][i]
        assert isinstance(top, dict) and 1 <= len(top) <= 2
        assert all(isinstance(k, str) and isinstance(v, float) for k, v in top.items())
        best = int(ref[i - 1].argmax())
        assert top[loaded.tokenizer.token_text(best)] == pytest.approx(float(ref[i - 1, best]), abs=1e-5)
        assert top[lp["tokens"][i]] == pytest.approx(lp["token_logprobs"][i])
    offsets = lp["text_offset"]
    assert offsets[0] == 0
    assert offsets[1:] == [offsets[i] + len(lp["tokens"][i]) for i in range(len(offsets) - 1)]
    # what the harness reads: the continuation's log-likelihood, token_logprobs[ctxlen:len(prompt)]
    n_ctx = len(ids_of(loaded, context))
    expected = float(sum(ref[i - 1, ids[i]] for i in range(n_ctx, len(ids))))
    assert sum(lp["token_logprobs"][n_ctx : len(ids)]) == pytest.approx(expected, abs=1e-4)


def test_completions_logprobs_without_echo(client: TestClient, loaded: LoadedModel) -> None:
    ids = ids_of(loaded, PROMPTS[1])
    request = {"prompt": PROMPTS[1], "max_tokens": 4, "logprobs": 2, "temperature": 0}
    (choice,) = post_ok(client, CMPL, request)["choices"]
    ref = greedy(loaded, ids, 4)
    lp = choice["logprobs"]
    assert lp["tokens"] == [loaded.tokenizer.token_text(t) for t in ref.token_ids]
    full = full_logprobs(loaded, ids + ref.token_ids)
    for i, token in enumerate(ref.token_ids):
        assert lp["token_logprobs"][i] == pytest.approx(float(full[len(ids) - 1 + i, token]), abs=1e-4)
        assert 2 <= len(lp["top_logprobs"][i]) <= 3
    assert lp["text_offset"][0] == len(PROMPTS[1])


def test_completions_harmless_fields_accepted(client: TestClient, loaded: LoadedModel) -> None:
    request = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, **HARMLESS_OPENAI_FIELDS}
    body = post_ok(client, CMPL, request)
    assert body["choices"][0]["text"] == greedy(loaded, ids_of(loaded, PROMPTS[0]), 3).text


def test_completions_stream(client: TestClient, loaded: LoadedModel) -> None:
    request = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0}
    whole = post_ok(client, CMPL, request)
    r = client.post(CMPL, json={**request, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r.text)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion"
        assert isinstance(c["created"], int) and c["model"] == loaded.name
    *token_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all("usage" in c and c["usage"] is None for c in token_chunks)  # OpenAI's: null until the last
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in token_chunks if c["choices"][0]["index"] == choice["index"]]
        assert all(len(c["choices"]) == 1 for c in token_chunks)
        assert all(set(c) == {"text", "index", "logprobs", "finish_reason"} for c in mine)
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        assert mine[-1]["finish_reason"] == "length"
    without_usage = sse_events(client.post(CMPL, json={**request, "stream": True}).text)
    assert all("usage" not in c or c["usage"] is None for c in without_usage)


def test_completions_stream_with_continuous_usage(client: TestClient, loaded: LoadedModel) -> None:
    """vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far (its prompt's tokens,
    and those it has generated), the last chunk the whole request's (it was accepted and ignored); alone,
    the same, as in vLLM, whose `include_usage` defaults to true."""
    request = {"prompt": PROMPTS[:2], "max_tokens": 4, "temperature": 0, "n": 2, "stream": True, "echo": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last = sse_events(client.post(CMPL, json=request | {"stream_options": options}).text)
    whole = post_ok(client, CMPL, request | {"stream": False})
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    finals = {}
    for i in range(4):
        mine = [c for c in chunks if c["choices"][0]["index"] == i]
        prompt = len(ids_of(loaded, PROMPTS[i // 2]))
        done = [c["usage"]["completion_tokens"] for c in mine]
        assert done == sorted(done) and done[0] == 0  # the echoed prompt first, then one more a token
        assert all(c["usage"]["prompt_tokens"] == prompt for c in mine)
        assert all(c["usage"]["total_tokens"] == prompt + d for c, d in zip(mine, done, strict=True))
        finals[i] = done[-1]
    assert sum(finals.values()) == whole["usage"]["completion_tokens"] == 16
    *alone, alone_last = sse_events(
        client.post(CMPL, json=request | {"stream_options": {"continuous_usage_stats": True}}).text
    )
    assert alone_last == last | {"id": alone_last["id"], "created": alone_last["created"]}

    def per_choice(events: list[dict[str, Any]]) -> list[list[dict[str, int]]]:  # the choices' usages, in order
        return [[c["usage"] for c in events if c["choices"][0]["index"] == i] for i in range(4)]

    assert per_choice(alone) == per_choice(chunks)
    off = {"include_usage": False, "continuous_usage_stats": True}  # vLLM: no usage at all, continuous or last
    events = sse_events(client.post(CMPL, json=request | {"stream_options": off}).text)
    plain = sse_events(client.post(CMPL, json=request).text)  # the choices' chunks interleave as they come

    def texts(events: list[dict[str, Any]]) -> list[str]:
        return ["".join(c["choices"][0]["text"] for c in events if c["choices"][0]["index"] == i) for i in range(4)]

    assert texts(events) == texts(plain) and all(e.get("usage") is None for e in events)


def test_stream_options_without_stream_is_a_400(client: TestClient) -> None:
    """As OpenAI answers it: stream_options is only allowed with stream true (it was silently dropped)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "stream_options": {"include_usage": True}}
    error = assert_error(client.post(CMPL, json=body), 400, "stream_options")
    assert "only allowed when stream is true" in error["message"]
    assert client.post(CMPL, json=body | {"stream_options": None}).status_code == 200  # null: not set


def test_completions_stream_echo_logprobs(client: TestClient) -> None:
    request = {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    (whole,) = post_ok(client, CMPL, request)["choices"]
    chunks = [c["choices"][0] for c in sse_events(client.post(CMPL, json={**request, "stream": True}).text)]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    token_logprobs = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert token_logprobs == pytest.approx(whole["logprobs"]["token_logprobs"])


@pytest.mark.parametrize("echo", [False, True])
def test_completions_text_offsets_streamed_equal_whole(client: TestClient, loaded: LoadedModel, echo: bool) -> None:
    """text_offset: where each token starts in the choice's text (the prompt's counted, echoed or not), the
    length of what the tokens before it decode to. The second prompt ends in half a character (the byte
    0xE2 of "€"), which the first generated token may complete."""
    tokenizer = loaded.tokenizer
    lead_byte = next(i for i in range(256) if tokenizer.token_bytes(i) == b"\xe2")
    prompts = [ids_of(loaded, PROMPTS[3]), [*ids_of(loaded, "Hi"), lead_byte]]
    request = {"prompt": prompts, "max_tokens": 4, "temperature": 0, "logprobs": 0, "echo": echo}
    whole = post_ok(client, CMPL, request)["choices"]
    for prompt, choice in zip(prompts, whole, strict=True):
        generated = greedy(loaded, prompt, 4).token_ids
        if echo:
            ids = prompt + generated
            expected = [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
        else:
            start = len(tokenizer.decode(prompt))
            expected = [start + len(tokenizer.decode(generated[:i])) for i in range(len(generated))]
        assert choice["logprobs"]["text_offset"] == expected
    chunks = [c["choices"][0] for c in sse_events(client.post(CMPL, json={**request, "stream": True}).text)]
    for choice in whole:
        mine = [c["logprobs"] for c in chunks if c["index"] == choice["index"] and c["logprobs"]]
        assert [x for lp in mine for x in lp["text_offset"]] == choice["logprobs"]["text_offset"]


def test_completions_null_is_the_default(client: TestClient) -> None:
    """OpenAI's default for these fields is null: sent, it means "not set"."""
    request = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    penalties = ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "use_beam_search"]
    others = ["logit_bias", "suffix", "best_of", "n", "echo", "stream", "logprobs", "stop", "seed", "stream_options"]
    vllm = ["top_k", "stop_token_ids", "ignore_eos", "min_p", "interventions", "residual", "activations", "features"]
    nulls = dict.fromkeys([*penalties, *others, *vllm])
    plain, with_nulls = post_ok(client, CMPL, request), post_ok(client, CMPL, request | nulls)
    assert with_nulls["choices"] == plain["choices"] and with_nulls["usage"] == plain["usage"]
    streamed = client.post(CMPL, json=request | {"stream": True, "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200 and '"usage"' not in streamed.text  # include_usage null: false


def test_completions_take_vllm_sampling_fields(client: TestClient, loaded: LoadedModel) -> None:
    """top_k, stop_token_ids and ignore_eos as /v1/generate takes them (they were ignored without a word)."""
    ids = ids_of(loaded, PROMPTS[0])
    top1 = post_ok(client, CMPL, {"prompt": PROMPTS[0], "max_tokens": 6, "seed": 7, "top_k": 1})
    assert top1["choices"][0]["text"] == greedy(loaded, ids, 6).text  # top_k 1 samples the argmax
    want = greedy(loaded, ids, 6).token_ids
    stop_at = want[2]
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 0, "stop_token_ids": [stop_at]}
    stopped = post_ok(client, CMPL, body)["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["logprobs"]["tokens"]) == want.index(stop_at) + 1
    params = CompletionRequest.model_validate({"prompt": "Hi", "ignore_eos": True, "top_k": 3}).sampling_params()
    assert params.ignore_eos and params.top_k == 3
    assert_error(client.post(CMPL, json={"prompt": "Hi", "max_tokens": 1, "ignore_eos": "yes"}), 400, "ignore_eos")
    # -1 is vLLM's "no limit", which its clients send: as 0 here; below it, an error
    for no_limit in (0, -1):
        sampled = {"prompt": PROMPTS[0], "max_tokens": 6, "seed": 7, "top_k": no_limit}
        assert post_ok(client, CMPL, sampled)["choices"] == post_ok(client, CMPL, sampled | {"top_k": None})["choices"]
    assert_error(client.post(CMPL, json={"prompt": "Hi", "max_tokens": 1, "top_k": -2}), 400, "top_k")
    too_big = {"prompt": "Hi", "max_tokens": 1, "stop_token_ids": [50257]}
    assert_error(client.post(CMPL, json=too_big), 400, "stop_token_ids")
    assert_still_serving(client)


def test_models_retrieve(client: TestClient, loaded: LoadedModel) -> None:
    """OpenAI's GET /v1/models/{id}: the model /v1/models lists, by its id (a path's slashes included)."""
    (entry,) = client.get("/v1/models").json()["data"]
    r = client.get(f"/v1/models/{entry['id']}")
    assert r.status_code == 200 and r.json() == entry
    assert entry["owned_by"] == "local"  # a checkpoint directory: no hub owner
    error = assert_error(client.get("/v1/models/gpt2-nope"), 404, "model", "model_not_found")
    assert "'gpt2-nope' does not exist" in error["message"]
    assert_error(client.get("/v1/models/"), 404, "model", "model_not_found")  # no default model here


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_tokens", 2),  # not implemented: any value but the neutral one (or null) is refused
        ("use_beam_search", True),
        ("presence_penalty", False),  # a bool is not a number
        ("best_of", 1.0),
        ("best_of", 2),
        ("n", "2"),  # null is accepted, other types are not
        ("echo", 1),
        ("stream", "yes"),
        # vLLM's fields that change the answer: refused, not ignored
        ("include_stop_str_in_output", True),
        ("bad_words", ["Hello"]),
        ("response_format", {"type": "json_object"}),
        ("allowed_token_ids", [11]),
        ("allowed_token_ids", []),
        ("logits_processors", ["x"]),
        ("truncate_prompt_tokens", 2),
        ("prompt_logprobs", 1),
        ("guided_choice", ["a", "b"]),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "[ab]+"),
        ("structured_outputs", {"choice": ["a"]}),
        # chat completions' fields, sent to the legacy API by mistake
        ("max_completion_tokens", 2),
        ("top_logprobs", 2),
        ("messages", [{"role": "user", "content": "Hi"}]),
        ("tools", []),
        ("return_tokens_as_token_ids", "yes"),
        # this server's own fields, which /v1/generate takes: they would change the answer
        ("interventions", [{"hook": "blocks.0.hook_resid_pre", "op": "zero"}]),
        ("residual", {"remove": "attn"}),
        ("activations", {"hooks": ["*"]}),
        ("features", {"sae": "res0"}),
    ],
)
def test_completions_refuse_other_values(client: TestClient, field: str, value: Any) -> None:
    error = assert_error(client.post(CMPL, json={"prompt": "Hi", "max_tokens": 1, field: value}), 400, field)
    assert field in error["message"]
    assert_still_serving(client)


def test_vllm_special_token_defaults_are_taken_where_they_change_nothing(client: TestClient) -> None:
    """vLLM's `skip_special_tokens` and `spaces_between_special_tokens` default to true, which clients send as
    they are: taken where <|endoftext|> cannot reach the text (not echoed; a generated one ends the choice),
    refused where it could (echo, or ignore_eos without it as a stop token id), since this server writes it."""
    base = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    plain = post_ok(client, CMPL, base)["choices"]
    for field in ("skip_special_tokens", "spaces_between_special_tokens"):
        assert post_ok(client, CMPL, base | {field: True})["choices"] == plain
        post_ok(client, CMPL, base | {field: True, "ignore_eos": True, "stop_token_ids": [EOT_ID]})
        for where in ({"echo": True}, {"ignore_eos": True}, {"ignore_eos": True, "stop_token_ids": [11]}):
            error = assert_error(client.post(CMPL, json=base | where | {field: True}), 400, field)
            assert f"{field}=True is not supported" in error["message"]
    assert_still_serving(client)


def test_completions_neutral_values_accepted(client: TestClient) -> None:
    """The neutral value (or null) of a field this server does not implement changes nothing."""
    base = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    plain = post_ok(client, CMPL, base)["choices"]
    neutral = {
        "include_stop_str_in_output": False,
        "bad_words": [],
        "response_format": {"type": "text"},
        "allowed_token_ids": None,
        "max_completion_tokens": None,
        "messages": None,
        "guided_json": None,
    }
    assert post_ok(client, CMPL, base | neutral)["choices"] == plain


def test_completions_model_names(loaded: LoadedModel) -> None:
    """`model` is a served name (the model as given, or each --served-model-name), else a 404 as OpenAI and
    vLLM answer it: never GPT-2's text under another model's name."""
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    with serve(loaded) as client:
        (card,) = client.get("/v1/models").json()["data"]
        assert card["id"] == loaded.name
        assert post_ok(client, CMPL, body | {"model": loaded.name})["model"] == loaded.name
        assert post_ok(client, CMPL, body)["model"] == loaded.name
        assert post_ok(client, CMPL, body | {"model": ""})["model"] == loaded.name  # as vLLM: the served model
        for wrong in ("gpt-3.5-turbo-instruct", "gpt2", " "):
            for stream in (False, True):
                r = client.post(CMPL, json=body | {"model": wrong, "stream": stream})
                error = assert_error(r, 404, "model", "model_not_found")
                assert f"{wrong!r} does not exist" in error["message"] and repr(loaded.name) in error["message"]
        assert_still_serving(client)
    with serve(loaded, served_model_name=("gpt2", "my-gpt2")) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["gpt2", "my-gpt2"]
        assert client.get("/v1/models/my-gpt2").json() == cards[1]
        assert_error(client.get(f"/v1/models/{loaded.name}"), 404, "model", "model_not_found")
        first = post_ok(client, CMPL, body | {"model": "gpt2"})
        assert first["model"] == "gpt2"
        second = post_ok(client, CMPL, body | {"model": "my-gpt2"})
        assert second["model"] == "my-gpt2" and second["choices"] == first["choices"]
        assert post_ok(client, CMPL, body)["model"] == "gpt2"  # left out: the first served name
        assert_error(client.post(CMPL, json=body | {"model": loaded.name}), 404, "model", "model_not_found")
        ids = post_ok(client, "/tokenize", {"prompt": "Hi", "model": "my-gpt2"})["tokens"]  # vLLM's clients name it
        assert post_ok(client, "/detokenize", {"tokens": ids, "model": "gpt2"}) == {"prompt": "Hi"}
        for path, request in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": ids})):
            assert_error(client.post(path, json=request | {"model": loaded.name}), 404, "model", "model_not_found")


def test_completions_empty_prompt_is_document_start(client: TestClient, loaded: LoadedModel) -> None:
    """A missing or empty prompt is <|endoftext|> (OpenAI: "as from the beginning of a new document")."""
    expected = greedy(loaded, [EOT_ID], 5)
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    for prompt in ({}, {"prompt": None}, {"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"prompt": [[]]}):
        out = post_ok(client, CMPL, body | prompt)
        assert [c["text"] for c in out["choices"]] == [expected.text], prompt
        assert out["usage"]["prompt_tokens"] == 1
    both = post_ok(client, CMPL, body | {"prompt": ["", PROMPTS[0]], "echo": True})
    assert both["choices"][0]["text"] == "<|endoftext|>" + expected.text
    assert both["choices"][1]["text"].startswith(PROMPTS[0])


def test_completions_tokens_as_ids(client: TestClient, loaded: LoadedModel) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs' tokens and top_logprobs' keys as `token_id:N`, N each
    token's id (the prompt's, echoed, then the completion's), with the same log-probabilities."""
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    named = post_ok(client, CMPL, body)["choices"][0]["logprobs"]
    choice = post_ok(client, CMPL, body | {"return_tokens_as_token_ids": True})["choices"][0]
    as_ids = choice["logprobs"]

    def ids(names: Iterable[str]) -> list[int]:
        assert all(re.fullmatch(r"token_id:\d+", n) for n in names), names
        return [int(n.removeprefix("token_id:")) for n in names]

    prompt = ids_of(loaded, PROMPTS[0])
    assert ids(as_ids["tokens"]) == prompt + greedy(loaded, prompt, 3).token_ids
    assert choice["text"] == PROMPTS[0] + greedy(loaded, prompt, 3).text
    assert as_ids["token_logprobs"] == named["token_logprobs"]
    text = loaded.tokenizer.token_text
    for by_id, by_name in zip(as_ids["top_logprobs"][1:], named["top_logprobs"][1:], strict=True):
        assert sorted(by_id.values()) == sorted(by_name.values())
        for i, logprob in zip(ids(by_id), by_id.values(), strict=True):
            if "\ufffd" not in text(i):  # a piece of a character is named by its bytes
                assert by_name[text(i)] == logprob


def test_chat_completions_is_not_served(client: TestClient) -> None:
    """GPT-2 has no chat format: OpenAI's answer for a completions model, not a bare "no such route"."""
    r = client.post("/v1/chat/completions", json={"model": "gpt2", "messages": [{"role": "user", "content": "Hi"}]})
    error = assert_error(r, 404, "model")
    assert "not a chat model" in error["message"] and "v1/completions" in error["message"]
    assert_still_serving(client)


# --- metrics and request ids ----------------------------------------------------------------------


def test_metrics(client: TestClient) -> None:
    before = {
        name: metric(client, name)
        for name in (
            "gpt2_tokens_generated_total",
            "gpt2_time_to_first_token_seconds_count",
            "gpt2_inter_token_latency_seconds_count",
            "gpt2_batch_size_count",
        )
    }
    generated_ok = metric(client, "gpt2_requests_total", route="/v1/generate", status="200")
    post_ok(client, GEN, {"prompt": "Hello", "max_new_tokens": 5, "ignore_eos": True})
    client.post(GEN, json={"prompt": ""})
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert {
        "gpt2_requests",
        "gpt2_tokens_generated",
        "gpt2_queue_depth",
        "gpt2_running_sequences",
        "gpt2_batch_size",
        "gpt2_time_to_first_token_seconds",
        "gpt2_inter_token_latency_seconds",
    } <= set(families)
    assert families["gpt2_time_to_first_token_seconds"].type == "histogram"
    assert families["gpt2_inter_token_latency_seconds"].type == "histogram"
    assert families["gpt2_requests"].type == "counter"
    assert metric(client, "gpt2_requests_total", route="/v1/generate", status="200") == generated_ok + 1
    assert metric(client, "gpt2_requests_total", route="/v1/generate", status="400") >= 1
    assert metric(client, "gpt2_tokens_generated_total") == before["gpt2_tokens_generated_total"] + 5
    ttft = metric(client, "gpt2_time_to_first_token_seconds_count")
    assert ttft == before["gpt2_time_to_first_token_seconds_count"] + 1
    itl = metric(client, "gpt2_inter_token_latency_seconds_count")
    assert itl == before["gpt2_inter_token_latency_seconds_count"] + 4
    assert metric(client, "gpt2_batch_size_count") >= before["gpt2_batch_size_count"] + 4
    assert metric(client, "gpt2_queue_depth") == 0
    assert metric(client, "gpt2_running_sequences") == 0


def test_request_id(client: TestClient) -> None:
    r = client.get("/health", headers={"X-Request-ID": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    generated = [client.get("/v1/models").headers["x-request-id"] for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", g) for g in generated) and generated[0] != generated[1]
    assert client.post(GEN, json={"prompt": ""}, headers={"X-Request-ID": "bad-1"}).headers["x-request-id"] == "bad-1"
    assert client.get("/nowhere", headers={"X-Request-ID": "lost-1"}).headers["x-request-id"] == "lost-1"
    streamed = client.post(
        GEN, json={"prompt": "Hi", "max_new_tokens": 2, "stream": True}, headers={"X-Request-ID": "s"}
    )
    assert streamed.headers["x-request-id"] == "s"


@pytest.mark.parametrize(
    "given",
    [b"x" * 129, b"a\x01\x7fb", "caf\u00e9".encode(), b"two words", b"\xff\xfe"],
    ids=["129-chars", "control-chars", "utf8", "space", "not-utf8"],
)
def test_an_unusable_request_id_is_replaced(client: TestClient, given: bytes) -> None:
    """An incoming X-Request-ID is echoed and logged only if it is 1..128 visible ASCII characters; any
    other (huge, control characters, non-ASCII) is replaced by a fresh id, and the request is served."""
    r = client.get("/health", headers=[(b"x-request-id", given)])
    assert r.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), r.headers["x-request-id"]
    longest = "x" * 128
    assert client.get("/health", headers={"X-Request-ID": longest}).headers["x-request-id"] == longest


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request(client: TestClient, case: Bad) -> None:
    assert_error(case.send(client), case.status, case.param)
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        (GEN, {"prompt": ["a", ""]}, "prompt", "prompt[1]: the prompt is empty"),
        (GEN, {"input_ids": [[1], [1, 50257]]}, "input_ids", "input_ids[1]: token id 50257 is outside"),
        (GEN, {"prompt": ["a", "b " * 200]}, "prompt", "prompt[1]: the prompt (201 tokens) is longer than"),
        (CMPL, {"prompt": [[1], [2], [1, -1]]}, "prompt", "prompt[2]: token id -1 is outside"),
        (CMPL, {"prompt": ["a", "b " * 200], "max_tokens": 1}, "prompt", "prompt[1]: the prompt (201 tokens)"),
        (GEN, {"input_ids": [[5], [1] * 120], "max_new_tokens": 10}, "max_new_tokens", "input_ids[1]: the prompt"),
        (CMPL, {"prompt": [[5], [1] * 120], "max_tokens": 10}, "max_tokens", "prompt[1]: the prompt (120 tokens) plus"),
        # the server's cap (64) first, as on /v1/generate: past it, whatever the prompts
        (CMPL, {"prompt": [[5], [1] * 100], "max_tokens": 65}, "max_tokens", "max_tokens must be at most 64"),
        (
            GEN,
            {"input_ids": [[5], [1] * 100], "max_new_tokens": 65},
            "max_new_tokens",
            "max_new_tokens must be at most 64",
        ),
    ],
)
def test_an_error_about_one_prompt_of_several_says_which(
    client: TestClient, path: str, body: dict[str, Any], param: str, says: str
) -> None:
    error = assert_error(client.post(path, json=body), 400, param)
    assert error["message"].startswith(says), error
    assert_still_serving(client)


def test_a_request_the_guard_refuses_is_counted_under_its_route(loaded: LoadedModel) -> None:
    """The metrics count requests by route and status: also those answered before any route ran (a missing
    key's 401, a body over the cap's 413, a compressed body's 415), under the route they were sent to; a path
    no route has stays "unmatched" whatever it is, so made-up paths do not grow the metrics."""
    with serve(loaded, api_key="k") as c:
        key = {"authorization": "Bearer k"}
        assert_error(c.post(GEN, json={"prompt": "hi"}), 401)
        assert_error(c.get("/v1/models/someone"), 401)
        big = {"prompt": "x" * (70 * 1024)}
        assert_error(c.post(GEN, json=big, headers=key), 413)
        assert_error(c.post(CMPL, content=b"{}", headers={**key, "content-encoding": "gzip"}), 415)
        assert_error(c.post("/v1/made-up", json={}, headers=key), 404)
        assert_error(c.post("/v1/also-made-up", json={}), 401)
        assert c.get("/static/app.js").status_code == 200 and c.get("/static/nope.js").status_code == 404
        # the page itself lives at /, where its relative addresses resolve: its copy under /static/ sends there
        moved = c.get("/static/index.html", follow_redirects=False)
        assert (moved.status_code, moved.headers["location"]) == (308, "../")
        metrics = c.get("/metrics", headers=key).text
    counts = {
        (s.labels["route"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "gpt2_requests_total"
    }
    assert counts[(GEN, "401")] == counts[(GEN, "413")] == counts[(CMPL, "415")] == 1, counts
    assert counts[("/static", "200")] == counts[("/static", "404")] == 1, counts  # the static files' mount
    assert counts[("/v1/models/{model_id:path}", "401")] == 1, counts  # its template, as the route counts it
    assert counts[("unmatched", "404")] == counts[("unmatched", "401")] == 1, counts


@pytest.mark.parametrize(
    ("path", "field", "says"),
    [
        (GEN, "temperature", "temperature: an integer of 401 digits is past a float's range"),
        (GEN, "top_p", "top_p: an integer of 401 digits is past a float's range"),
        (GEN, "max_new_tokens", "max_new_tokens (1000"),
        (CMPL, "logprobs", "logprobs must be in 0..5, got 1000"),
        (CMPL, "n", "n must be in 1..128, got 1000"),
        (GEN, "seed", "seed must be an integer in"),
        (GEN, "stop_token_ids", "stop token id 1000"),
        (GEN, "input_ids", "token id 1000"),
    ],
)
def test_an_integer_of_hundreds_of_digits_is_refused_in_a_short_message(
    client: TestClient, path: str, field: str, says: str
) -> None:
    """A valid JSON number too large for its field: a message that says why, not 'not a valid number', and
    that does not copy back all of its digits."""
    value = f"1{'0' * 400}"
    if field in ("stop_token_ids", "input_ids"):
        value = f"[{value}]"
    prompt = "" if field == "input_ids" else '"prompt": "hi", '
    body = f'{{{prompt}"{field}": {value}}}'.encode()
    error = assert_error(client.post(path, content=body, headers={"content-type": "application/json"}), 400, field)
    assert error["message"].startswith(says) and len(error["message"]) < 300, error
    assert_still_serving(client)


@pytest.mark.parametrize("coding", ["gzip", "br", "GZIP", "identity, gzip"])
def test_a_compressed_body_is_a_415_that_says_so(client: TestClient, coding: str) -> None:
    """Bodies are read as sent: one with a content coding (compressed, or labelled so) is refused, saying
    which coding it came with and, as RFC 9110 asks, which are taken (Accept-Encoding: identity)."""
    import gzip

    plain = json.dumps({"prompt": "hi", "max_new_tokens": 1}).encode()
    for body in (gzip.compress(plain), plain):
        headers = {"content-type": "application/json", "content-encoding": coding}
        r = client.post(GEN, content=body, headers=headers)
        error = assert_error(r, 415)
        assert r.headers["accept-encoding"] == "identity"
        named = coding.lower().removeprefix("identity, ")  # the codings that are not identity
        assert error["type"] == "unsupported_media_type" and f"Content-Encoding {named}:" in error["message"]
    r = client.post(GEN, content=plain, headers={"content-type": "application/json", "content-encoding": "identity"})
    assert r.status_code == 200, r.text
    assert_still_serving(client)


def test_content_codings_on_every_line_count_and_a_request_with_no_body_has_none(client: TestClient) -> None:
    """Content-Encoding split over two lines is one list (RFC 9110, section 5.3): a gzip on either refuses the
    body; a GET, with no body, is answered whatever it says; a long list is cut short in the message."""
    import gzip

    body = gzip.compress(json.dumps({"prompt": "hi", "max_new_tokens": 1}).encode())
    headers = [("content-type", "application/json"), ("content-encoding", "gzip"), ("content-encoding", "identity")]
    error = assert_error(client.post(GEN, content=body, headers=httpx.Headers(headers)), 415)
    assert "Content-Encoding gzip: send it uncompressed" in error["message"], error
    for path in ("/health", "/v1/models"):
        assert client.get(path, headers={"content-encoding": "gzip"}).status_code == 200
    error = assert_error(client.post(GEN, content=body, headers={"content-encoding": "x" * 8000}), 415)
    assert len(error["message"]) < 300, error


def test_body_over_limit_without_content_length(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 1000
        yield b'"}'

    assert_error(client.post(GEN, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert_still_serving(client)


def test_api_key(loaded: LoadedModel) -> None:
    with serve(loaded, api_key="s3cret") as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cre"}, {"X-API-Key": "wrong"}):
            r = c.get("/v1/models", headers=headers)
            error = assert_error(r, 401, None, "invalid_api_key" if "wrong" in str(headers) else None)  # OpenAI's codes
            if "Authorization" in headers and "wrong" not in str(headers):  # a key with no scheme: said so
                assert "holds no Bearer token" in error["message"], error
            assert r.headers["www-authenticate"] == "Bearer"
            assert_error(c.post(GEN, json={"prompt": "Hi", "max_new_tokens": 1}, headers=headers), 401)
        auth = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=auth).status_code == 200
        # either header may hold the key when both are sent (the other, a client's own, is then not the key)
        for both in ({"Authorization": "Bearer unused", "X-API-Key": "s3cret"}, auth | {"X-API-Key": "unused"}):
            assert c.get("/v1/models", headers=both).status_code == 200
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer a", "X-API-Key": "b"}), 401, None)
        for twice in (["Bearer s3cret", "Bearer x"], ["Bearer x", "Bearer s3cret"]):  # a proxy's copy added: any
            assert c.get("/v1/models", headers=[("Authorization", v) for v in twice]).status_code == 200
        assert c.get("/v1/models", headers=[("X-API-Key", "x"), ("X-API-Key", "s3cret")]).status_code == 200
        assert_error(c.get("/v1/models", headers=[("X-API-Key", "x"), ("X-API-Key", "y")]), 401, None)
        r = c.post(GEN, json={"prompt": "Hi", "max_new_tokens": 1}, headers=auth)
        assert r.status_code == 200, r.text


def test_open_paths_need_no_key_under_a_route_prefix(loaded: LoadedModel) -> None:
    """Mounted under a prefix (a Ray Serve route prefix, a proxy's root_path), /health and the viewer stay open
    with an API key set: the prefix was compared too, so /keyed/health asked for the key."""
    app = create_app(settings(api_key="s3cret"), loaded=loaded)
    with TestClient(app, root_path="/keyed", raise_server_exceptions=False) as c:  # paths as Serve's proxy gives them
        assert c.get("/keyed/health").status_code == 200
        assert c.get("/keyed/").status_code == 200
        assert_error(c.get("/keyed/v1/models"), 401)
        assert c.get("/keyed/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_health_is_503_once_the_engine_has_stopped(loaded: LoadedModel) -> None:
    """A health check (Kubernetes' probes) sees an engine whose thread has ended: every request would get a
    503, so the replica is not healthy (it answered 200)."""
    with serve(loaded) as c:
        assert c.get("/health").status_code == 200
        c.app.state.engine.stop()  # type: ignore[attr-defined]
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "stopped"})


def test_cors_preflight_needs_no_key_and_a_refusal_has_the_error_shape(loaded: LoadedModel) -> None:
    origin, preflight = "http://ok.example", {"Access-Control-Request-Method": "POST"}
    with serve(loaded, api_key="s3cret", cors_origins=(origin,)) as c:
        r = c.options(GEN, headers={"Origin": origin, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        for headers, says in (
            ({"Origin": "http://other.example", **preflight}, "origin"),
            ({"Origin": origin, "Access-Control-Request-Method": "DELETE"}, "method"),
        ):
            error = assert_error(c.options(GEN, headers=headers), 400, None)
            assert "CORS" in error["message"] and says in error["message"], error
        auth = {"Authorization": "Bearer s3cret", "Origin": origin}
        r = c.post(GEN, json={"prompt": "Hi", "max_new_tokens": 1}, headers=auth)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


def test_queue_full_is_429(loaded: LoadedModel) -> None:
    request = {"prompt": "Hello", "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    with serve(loaded, max_queue=1, max_batch_size=1) as c:
        with ThreadPoolExecutor(2) as pool, engine_held(c):  # the batch's free place, then the queue's
            waiting = [pool.submit(c.post, GEN, json=request) for _ in range(2)]
            wait_until(lambda: metric(c, "gpt2_queue_depth") == 2)
            for path, body in ((GEN, request), (CMPL, {"prompt": "Hi", "max_tokens": 1})):
                r = c.post(path, json=body)
                assert_error(r, 429, None, "rate_limit_exceeded")
                assert int(r.headers["retry-after"]) >= 1
            assert_error(c.post(GEN, json={**request, "stream": True}), 429)
        assert [w.result(20).status_code for w in waiting] == [200, 200]
        assert metric(c, "gpt2_queue_depth") == 0
        assert_still_serving(c)


def test_more_sequences_than_the_server_takes_at_once_is_a_400_naming_the_field(loaded: LoadedModel) -> None:
    """A request of more sequences (prompts x n) than the server could ever take at once (--max-batch-size
    and --max-queue, here 1 + 4) is a 400, not a 429 (a retry could not succeed), and `param` names what made
    them too many: n, or the prompts."""
    with serve(loaded, max_queue=4, max_batch_size=1) as c:
        error = assert_error(c.post(CMPL, json={"prompt": ["a"] * 6, "max_tokens": 1}), 400, "prompt")
        assert "asks for 6 sequences" in error["message"], error
        error = assert_error(c.post(CMPL, json={"prompt": ["a", "b"], "n": 3, "max_tokens": 1}), 400, "n")
        assert "asks for 6 sequences" in error["message"], error
        assert_error(c.post(CMPL, json={"prompt": ["a"] * 6, "n": 2, "max_tokens": 1}), 400, "prompt")  # n can't help
        assert_error(c.post(GEN, json={"prompt": ["a"] * 6, "max_new_tokens": 1}), 400, "prompt")
        assert_error(c.post(GEN, json={"input_ids": [[1]] * 6, "max_new_tokens": 1}), 400, "input_ids")
        assert len(post_ok(c, CMPL, {"prompt": ["a"] * 5, "max_tokens": 1})["choices"]) == 5
        dump = {"input_ids": [[1, 2]] * 6, "max_new_tokens": 0, "activations": {"hooks": ["*"]}}  # count before size
        assert "asks for 6 sequences" in assert_error(c.post(GEN, json=dump), 400, "input_ids")["message"]
        assert "asks for 6 sequences" in assert_error(c.post(ACTS, json=dump), 400, "input_ids")["message"]
        assert_still_serving(c)


def test_not_ready_is_503(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow_load(*args: Any, **kwargs: Any) -> LoadedModel:
        release.wait(30)
        return loaded

    monkeypatch.setattr(app_module, "load_from", slow_load)
    with TestClient(create_app(settings()), raise_server_exceptions=False) as c:
        try:
            r = c.get("/health")
            assert (r.status_code, r.json()) == (503, {"status": "loading"})
            for method, path, body in (
                ("POST", GEN, {"prompt": "Hi"}),
                ("POST", CMPL, {"prompt": "Hi"}),
                ("POST", NEXT, {"prompt": "Hi"}),
                ("GET", "/v1/model", None),
                ("GET", "/v1/models", None),
                ("POST", "/tokenize", {"prompt": "Hi"}),
            ):
                r = c.request(method, path, json=body)
                assert_error(r, 503)
                assert int(r.headers["retry-after"]) >= 1
        finally:
            release.set()
        wait_until(lambda: c.get("/health").status_code == 200)
        assert_still_serving(c)


def test_load_failure_reported(tmp_path: Path) -> None:
    errors: list[Exception] = []
    app = create_app(settings(model=str(tmp_path / "missing")), on_load_error=errors.append)
    with TestClient(app, raise_server_exceptions=False) as c:
        wait_until(lambda: bool(errors))
        assert "missing" in str(errors[0])
        assert c.get("/health").status_code == 503


def test_on_loaded_runs_once_loaded_before_the_first_request(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`on_loaded` (gpt2-serve's and a Ray replica's `freeze_long_lived`) runs once the engine has started and
    before it serves: while it runs, /health still says 503 (no engine is published yet), whether the app loads
    the model or is given it; a load that fails does not run it."""
    monkeypatch.setattr(app_module, "load_from", lambda *a, **k: loaded)
    seen: list[int] = []
    app = create_app(settings(), on_loaded=lambda: seen.append(TestClient(app).get("/health").status_code))
    with TestClient(app, raise_server_exceptions=False) as c:
        wait_until(lambda: c.get("/health").status_code == 200)
        assert seen == [503]
        assert_still_serving(c)

    def fail(*args: Any, **kwargs: Any) -> LoadedModel:
        raise OSError("no such checkpoint")

    engines: list[object] = []  # a model already loaded: the same, in the lifespan
    app = create_app(settings(), loaded=loaded, on_loaded=lambda: engines.append(app.state.engine))
    with TestClient(app, raise_server_exceptions=False) as c:
        assert engines == [None] and c.app.state.engine is not None  # type: ignore[attr-defined]
        assert_still_serving(c)

    monkeypatch.setattr(app_module, "load_from", fail)
    errors: list[Exception] = []
    app = create_app(settings(), on_load_error=errors.append, on_loaded=lambda: seen.append(0))
    with TestClient(app, raise_server_exceptions=False):
        wait_until(lambda: bool(errors))
    assert seen == [503]


def test_gpt2_serve_freezes_what_lives_as_long_as_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpt2-serve` hands `create_app` `freeze_long_lived` as `on_loaded`: the model, torch and the app out of the
    cyclic collector's way (a full collection walked them all, 0.2 s holding the GIL on a 2-core CPU). The
    tests' servers (`create_app(loaded=...)`) do not freeze: they come and go in one process."""
    import server.cli as cli

    got: dict[str, Any] = {}

    def fake_create_app(settings: Any, **kwargs: Any) -> Any:
        got.update(kwargs)
        return create_app(settings, **kwargs)

    monkeypatch.setattr(cli, "create_app", fake_create_app)
    monkeypatch.setattr(cli.uvicorn.Server, "run", lambda self, sockets=None: None)
    with socket.socket() as free:  # a port nobody listens on: main binds it before it builds the app
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert cli.main(["--model", "gpt2", "--host", "127.0.0.1", "--port", str(port)]) == 0
    assert got["on_loaded"] is app_module.freeze_long_lived


class Boom(RuntimeError):
    pass


SECRET = "secret detail at /srv/model/weights.py line 7"


def test_internal_error_leaks_nothing(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward pass that raises on the engine's thread: 500 (or an error event in a stream), no traceback
    or exception text, and the engine keeps serving."""

    def broken(original: Any) -> Any:
        def fail(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise Boom(SECRET)

        return fail

    with serve(loaded) as c, ThreadPoolExecutor(1) as pool, monkeypatch.context() as patch:

        def call(method: str, path: str, body: Any, **kwargs: Any) -> Any:
            return pool.submit(c.request, method, path, json=body, **kwargs).result(30)  # a hang fails the test

        wrap_forward_passes(patch, loaded.model, broken)
        patch.setattr(loaded.model, "embed", broken(loaded.model.embed))  # the lab's passes a piece at a time
        for path, body in (
            (GEN, {"prompt": "Hi", "max_new_tokens": 3}),
            (CMPL, {"prompt": "Hi", "max_tokens": 3}),
            (NEXT, {"prompt": "Hi"}),
            ("/v1/activations", {"prompt": "Hi"}),
        ):
            r = call("POST", path, body, headers={"X-Request-ID": "boom-1"})
            error = assert_error(r, 500, None)
            assert SECRET not in r.text and "Boom" not in r.text
            assert "boom-1" in error["message"]
            assert r.headers["x-request-id"] == "boom-1"
        for path, body in ((GEN, {"prompt": "Hi", "max_new_tokens": 3}), (CMPL, {"prompt": "Hi", "max_tokens": 3})):
            r = call("POST", path, {**body, "stream": True})
            assert r.status_code == 200
            events = sse_events(r.text)
            assert "error" in events[-1] and set(events[-1]["error"]) >= {"type", "message"}
            assert SECRET not in r.text and "Traceback" not in r.text
        patch.undo()  # the forward passes work again
        assert_still_serving(c)
        body = call("POST", GEN, {"prompt": PROMPTS, "max_new_tokens": 4, "temperature": 0}).json()
        for text, choice in zip(PROMPTS, body["choices"], strict=True):
            assert choice["token_ids"] == greedy(loaded, ids_of(loaded, text), 4).token_ids


# --- batching ---------------------------------------------------------------------------------------


def test_greedy_same_alone_and_batched(loaded: LoadedModel) -> None:
    """Requests queued while the engine is held are admitted together: ragged prompts in one batch (and
    one capturing request beside it) must give what they give alone."""
    requests: list[tuple[str, dict[str, Any]]] = [
        (GEN, {"prompt": p, "max_new_tokens": 4 + 3 * i, "temperature": 0}) for i, p in enumerate(PROMPTS)
    ]
    requests += [
        (GEN, {"input_ids": [464] * 40, "max_new_tokens": 9, "temperature": 0, "ignore_eos": True}),
        (CMPL, {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "echo": True, "logprobs": 2}),
        (GEN, {"prompt": PROMPTS[1], "max_new_tokens": 8, "temperature": 0.9, "top_k": 40, "seed": 5}),
        (
            GEN,
            {
                "prompt": PROMPTS[3],
                "max_new_tokens": 4,
                "temperature": 0,
                "activations": {"hooks": ["blocks.1.hook_resid_post"]},
            },
        ),
    ]
    with serve(loaded, max_batch_size=8) as c:
        alone = [post_ok(c, path, body) for path, body in requests]
        steps, rows = metric(c, "gpt2_batch_size_count"), metric(c, "gpt2_batch_size_sum")
        with ThreadPoolExecutor(len(requests)) as pool:
            with engine_held(c):
                futures = [pool.submit(c.post, path, json=body) for path, body in requests]
                wait_until(lambda: metric(c, "gpt2_queue_depth") == len(requests))
            batched = [f.result(30) for f in futures]
        assert (metric(c, "gpt2_batch_size_sum") - rows) / (metric(c, "gpt2_batch_size_count") - steps) > 2
    for (_, body), one, many in zip(requests, alone, batched, strict=True):
        assert many.status_code == 200, many.text
        assert_same(many.json()["choices"], one["choices"], where=str(body))
    for (_, body), one in zip(requests[:4], alone[:4], strict=True):
        assert (
            one["choices"][0]["token_ids"]
            == greedy(loaded, ids_of(loaded, body["prompt"]), body["max_new_tokens"]).token_ids
        )


def test_top_logprobs_name_ids_past_the_tokenizer_apart(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A model whose vocabulary is padded past the tokenizer's (nanoGPT's 50304) can choose an id the tokenizer
    does not know: OpenAI's logprobs show it as <|id:N|>, not as "", where several such ids once collapsed
    into one key of top_logprobs (2 entries for logprobs 5) and overwrote the chosen token's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from model.loading import load

    hf = GPT2LMHeadModel(GPT2Config(vocab_size=50304, n_layer=1, n_head=2, n_embd=32, n_positions=64))
    with torch.no_grad():
        wte = hf.transformer.wte.weight
        wte.normal_(0, 0.02)
        wte[50257:] = wte[50257:] * 50  # the padded ids' logits far larger: they fill the top
    hf.save_pretrained(tmp_path)
    with serve(load(tmp_path, tokenizer_dir=tokenizer_dir, device="cpu")) as c:
        body = {"prompt": [50300], "max_tokens": 1, "temperature": 0, "logprobs": 5}
        (choice,) = post_ok(c, CMPL, body)["choices"]
        (top,) = choice["logprobs"]["top_logprobs"]
        assert len(top) in (5, 6), top  # the 5 most likely, and the chosen token if it is not among them
        padded = [name for name in top if re.fullmatch(r"<\|id:\d+\|>", name)]
        assert len(padded) >= 2 and all(int(name[5:-2]) >= 50257 for name in padded), top
        (token,) = choice["logprobs"]["tokens"]
        assert top[token] == choice["logprobs"]["token_logprobs"][0]
        # /detokenize gives them by those names (it refused them), /v1/next-token names them so too, with no
        # bytes (the tokenizer has none for them)
        assert post_ok(c, "/detokenize", {"tokens": [15496, 50300]}) == {"prompt": "Hello<|id:50300|>"}
        assert_error(c.post("/detokenize", json={"tokens": [50304]}), 400, "tokens")
        entries = post_ok(c, NEXT, {"input_ids": [50300], "top_k": 5})["top"]
        past = [e for e in entries if e["id"] >= 50257]
        assert past and all(e["token"] == f"<|id:{e['id']}|>" and e["bytes"] is None for e in past), entries


def test_echo_of_a_prompt_that_ends_inside_a_character(tiny: Any, tokenizer_dir: Path) -> None:
    """A token-id prompt may end inside a multi-byte character (0xE1 here), which the completion then goes on
    (a model made to answer the byte 0xBB every time: 0xE1 0xBB 0xBB is one character): the choice's text is
    the prompt's decoding then the completion's, each on its own, and text_offset indexes that text (it was
    computed by decoding across the boundary, so it pointed one character off), streamed or whole."""
    from model.loading import load

    lm = load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu")
    tok = lm.tokenizer
    first, then = (next(i for i in range(256) if tok.token_bytes(i) == b) for b in (b"\xe1", b"\xbb"))
    with torch.no_grad():  # logits = ln_f(x) @ wte.T with ln_f's output fixed at wte[then]: `then` wins
        lm.model.wte.weight[then] *= 10
        lm.model.ln_f.weight.zero_()
        lm.model.ln_f.bias.copy_(lm.model.wte.weight[then])
    prompt = [464, first]
    request = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    with serve(lm) as c:
        (whole,) = post_ok(c, CMPL, request)["choices"]
        streamed = [ch["choices"][0] for ch in sse_events(c.post(CMPL, json=request | {"stream": True}).text)]
    prompt_text, completion_text = tok.decode(prompt), tok.decode([then] * 3)
    assert tok.decode([*prompt, then, then]) != prompt_text + tok.decode([then, then])  # they do join
    assert whole["logprobs"]["tokens"][2:] == ["bytes:\\xbb"] * 3
    assert whole["text"] == prompt_text + completion_text
    offsets = whole["logprobs"]["text_offset"]
    assert offsets == [0, 3, len(prompt_text), len(prompt_text) + 1, len(prompt_text) + 2]
    assert "".join(ch["text"] for ch in streamed) == whole["text"]
    assert [o for ch in streamed if ch["logprobs"] for o in ch["logprobs"]["text_offset"]] == offsets


def test_biases_and_penalties_on_both_apis_are_the_librarys(client: TestClient, loaded: LoadedModel) -> None:
    """logit_bias, presence/frequency/repetition penalties and min_p, as OpenAI and vLLM name them, on
    /v1/completions and /v1/generate: the tokens `generate` gives with the same settings; the log-probabilities
    the model's own, before them."""
    ids = ids_of(loaded, PROMPTS[1])
    plain = greedy(loaded, ids, 8, ignore_eos=True, logprobs=1)
    settings_ = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "min_p": 0.05}
    bias = {str(plain.token_ids[0]): -100, "11": 2.5}
    want = greedy(
        loaded, ids, 8, ignore_eos=True, logprobs=1, logit_bias={plain.token_ids[0]: -100, 11: 2.5}, **settings_
    )
    assert want.token_ids != plain.token_ids and want.token_ids[0] != plain.token_ids[0]
    common = {"temperature": 0, "ignore_eos": True, "logit_bias": bias, "logprobs": 1, **settings_}
    openai = post_ok(client, CMPL, {"prompt": ids, "max_tokens": 8, **common})["choices"][0]
    assert openai["text"] == want.text
    assert openai["logprobs"]["token_logprobs"] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    native = post_ok(client, GEN, {"input_ids": ids, "max_new_tokens": 8, **common})["choices"][0]
    assert native["token_ids"] == want.token_ids
    # the first token's log-probability is the model's (the plain run's runner-up, say), not the biased one's
    assert native["logprobs"][0]["top"] == [
        {"id": i, "token": loaded.tokenizer.token_text(i), "logprob": pytest.approx(v, abs=1e-5)}
        for i, v in plain.logprobs[0].top
    ]
    # sampled: a bias of 100 all but forces its token, at any seed
    forced = {"prompt": PROMPTS[0], "max_tokens": 5, "seed": 3, "ignore_eos": True, "logit_bias": {"1000": 100}}
    assert post_ok(client, CMPL, forced)["choices"][0]["text"] == loaded.tokenizer.decode([1000] * 5)
    assert_still_serving(client)


def test_native_stream_events_carry_the_alternatives(client: TestClient) -> None:
    """`logprobs: N` streamed gives each token's N alternatives (`top`), as the whole answer's `logprobs` do."""
    body = {"prompt": PROMPTS[2], "max_new_tokens": 5, "temperature": 0, "logprobs": 3}
    whole = post_ok(client, GEN, body)["choices"][0]["logprobs"]
    events = [e for e in sse_events(client.post(GEN, json={**body, "stream": True}).text) if "token_id" in e]
    assert [e["top"] for e in events] == [lp["top"] for lp in whole]
    assert all(len(e["top"]) == 3 for e in events)
    plain = sse_events(client.post(GEN, json={**body, "logprobs": None, "stream": True}).text)
    assert all(e["top"] is None and e["logprob"] is None for e in plain if "token_id" in e)


def test_native_null_is_the_default(client: TestClient) -> None:
    """A field sent as null is as if left out (as OpenAI's API takes it), in the native API too; a field
    without a default still needs a value."""
    body = {"prompt": PROMPTS[0], "max_new_tokens": 4, "temperature": 0}
    plain = post_ok(client, GEN, body)
    nulls = dict.fromkeys(["ignore_eos", "stream", "logprobs", "top_k", "min_p", "presence_penalty", "logit_bias"])
    assert post_ok(client, GEN, body | nulls)["choices"] == plain["choices"]
    default_length = post_ok(client, GEN, {"prompt": PROMPTS[0], "seed": 1, "max_new_tokens": None})
    assert default_length["choices"] == post_ok(client, GEN, {"prompt": PROMPTS[0], "seed": 1})["choices"]
    assert (
        post_ok(client, NEXT, {"prompt": PROMPTS[0], "top_k": None})["top"]
        == post_ok(client, NEXT, {"prompt": PROMPTS[0]})["top"]
    )
    edit = {"prompt": PROMPTS[0], "max_new_tokens": 1, "interventions": [{"hook": None, "op": "zero"}]}
    assert "interventions" in assert_error(client.post(GEN, json=edit), 400)["param"]
    assert_still_serving(client)


def test_activations_hooks_null_is_every_default_hook(client: TestClient) -> None:
    """`/v1/activations`' hooks default to `*` when the object is given for its dtype, null hooks too."""
    body = {"prompt": PROMPTS[0]}
    plain = client.post(ACTS, json=body)
    halves = client.post(ACTS, json=body | {"activations": {"hooks": None, "dtype": "float16"}})
    assert plain.status_code == halves.status_code == 200, halves.text
    assert safetensors.torch.load(plain.content).keys() == safetensors.torch.load(halves.content).keys()
    assert_error(client.post(ACTS, json=body | {"activations": {"hooks": []}}), 400, "activations")
