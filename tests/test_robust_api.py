"""Robustness of the HTTP API, in process on the `tiny` checkpoint: inputs that once gave a 500 or a wrong
`param` (lone surrogates, empty head lists, NaN in edits, edits that overflow the activations, engine
parameter names on the OpenAI route), unclear messages, the API key's scheme and HEAD requests, slow work
kept off the event loop (tokenizing, encoding dumps) and a client that leaves while it waits. Each bad
request is followed by a good one that must still succeed. Bad edits are in test_lab_api.BAD_EDITS."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from contract import ACTS, CMPL, GEN, NEXT, Bad, assert_error, sse_events
from fastapi.testclient import TestClient
from inprocess import RawRequest, assert_still_serving, on_event_loop, post_ok, serve, wrap_forward_passes

from model.hooks import hook_names, match_hooks
from model.loading import LoadedModel
from server.schemas import MAX_EDIT_SITES, MAX_HOOKS, MAX_INTERVENTIONS

ANALYZE, TOKENIZE = "/v1/analyze", "/tokenize"
SURROGATE = "a\udc80b"  # a lone low surrogate: valid JSON ("\udc80"), not valid Unicode
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(loaded: LoadedModel) -> Iterator[TestClient]:
    with serve(loaded) as c:
        yield c


def as_json(body: dict[str, Any]) -> bytes:
    """JSON text with non-ASCII escaped: how a client sends a lone surrogate (`\\udc80`), which a JSON
    library would refuse to encode as UTF-8."""
    return json.dumps(body).encode()


def z_edit(**fields: Any) -> dict[str, Any]:
    return {"hook": "blocks.0.attn.hook_z", "op": "zero", **fields}


def resid(**fields: Any) -> dict[str, Any]:
    return {"hook": "blocks.0.hook_resid_post", "op": "scale", "factor": 1e38, **fields}  # 1e38: float32 overflows


def case(id: str, path: str, body: dict[str, Any] | bytes, param: str, says: str) -> Any:
    """A bad request, the `param` its 400 must name and what its message must say."""
    content = body if isinstance(body, bytes) else as_json(body)
    return pytest.param(Bad(id, path, content=content), param, says, id=id)


CASES = [
    # lone surrogates in text, on every route that tokenizes, and in other text fields
    *(
        case(f"surrogate-prompt-{path}", path, {"prompt": SURROGATE}, "prompt", "prompt is not valid Unicode: it holds")
        for path in (GEN, CMPL, TOKENIZE, NEXT, ANALYZE, ACTS)
    ),
    case("surrogate-prompt-list", GEN, {"prompt": ["ok", SURROGATE]}, "prompt", "prompt[1] is not valid Unicode"),
    case(
        "surrogate-openai-prompt-list",
        CMPL,
        {"prompt": ["ok", "fine", "ab" + SURROGATE]},
        "prompt",
        "prompt[2] is not valid Unicode: it holds a lone surrogate (U+DC80) at character 3",
    ),
    case("surrogate-stop-list", GEN, {"prompt": "Hi", "stop": ["\n", SURROGATE]}, "stop", "stop[1] is not valid"),
    case("surrogate-openai-stop", CMPL, {"prompt": "Hi", "stop": SURROGATE}, "stop", "stop is not valid Unicode"),
    # the model name is echoed back: it must be text that can be sent
    case("surrogate-model", CMPL, {"prompt": "Hi", "model": SURROGATE}, "model", "model is not valid Unicode"),
    case("surrogate-model-stream", CMPL, {"prompt": "Hi", "model": SURROGATE, "stream": True}, "model", "model is"),
    case("surrogate-model-tokenize", TOKENIZE, {"prompt": "Hi", "model": SURROGATE}, "model", "model is not valid"),
    case("surrogate-model-detokenize", "/detokenize", {"tokens": [1], "model": SURROGATE}, "model", "model is not"),
    # the tokenizer endpoints refuse a field they do not have, where it would have been ignored
    case("tokenize-chat", TOKENIZE, {"prompt": "Hi", "messages": []}, "messages", "not permitted"),
    case("detokenize-skip", "/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens", ""),
    # numbers beyond float32 in an edit (more in test_lab_api.BAD_EDITS): also NaN, which Python's JSON reads
    case(
        "factor-nan",
        NEXT,
        b'{"prompt": "Hi", "interventions": [{"hook": "hook_embed", "op": "scale", "factor": NaN}]}',
        "interventions",
        "factor nan is not a finite float32 number",
    ),
    case(
        "value-infinity",
        NEXT,
        b'{"prompt": "Hi", "interventions": [{"hook": "hook_embed", "op": "add", "value": [Infinity]}]}',
        "interventions",
        "value holds numbers that are not finite in float32",
    ),
    # edits that drive the activations to inf or NaN: nothing to measure
    case(
        "analyze-overflow", ANALYZE, {"prompt": "Hi there", "interventions": [resid()]}, "interventions", "non-finite"
    ),
    case(
        "next-token-overflow",
        NEXT,
        {"prompt": "Hi there", "interventions": [resid()]},
        "interventions",
        "logits non-finite",
    ),
    # a value that fits none of a field's forms: the message lists the forms, not pydantic's branch names
    case("prompt-of-bools", CMPL, {"prompt": [True, False]}, "prompt", "prompt: fits none of the forms it takes (str,"),
    case("ids-of-floats", GEN, {"input_ids": [1.0]}, "input_ids", "(list[int], list[list[int]])"),
    case(
        "edit-value-too-big",
        NEXT,
        {"prompt": "Hi", "interventions": [{"hook": "hook_embed", "op": "add", "value": 10**400}]},
        "interventions",
        "interventions[0].value: an integer of 401 digits is past a float's range (about 1.8e308)",
    ),
    case(
        "steer-direction-number-too-big",
        NEXT,
        {
            "prompt": "Hi",
            "interventions": [{"hook": "hook_embed", "op": "steer", "scale": 1, "direction": [1, 10**400]}],
        },
        "interventions",
        "interventions[0].direction[1]: an integer of 401 digits is past a float's range",
    ),
    case(
        "edit-value-of-no-form",
        NEXT,
        {"prompt": "Hi", "interventions": [{"hook": "hook_embed", "op": "add", "value": "high"}]},
        "interventions",
        "interventions[0].value: fits none of the forms it takes (float, list[any], DumpValue)",
    ),
    case(
        "object-form-missing-a-field",
        NEXT,
        {
            "prompt": "Hi",
            "interventions": [{"hook": "hook_embed", "op": "steer", "scale": 1, "direction": {"sae": "a"}}],
        },
        "interventions",
        "interventions[0].direction.feature: Field required",
    ),
    case(
        "hook-name-too-long",
        GEN,
        {"prompt": "Hi", "activations": {"hooks": ["blocks.*" + "x" * 300]}},
        "activations",
        "characters: at most 256",
    ),
    case(
        "edit-field-zero-its-op-ignores",
        NEXT,
        {"prompt": "Hi", "interventions": [{"hook": "hook_embed", "op": "zero", "factor": 0}]},
        "interventions",
        "interventions[0].factor does not apply to zero",
    ),
    # a tagged union's tag is no key of the body: the path is the client's (pydantic's had metric.logit_diff.tokens)
    case(
        "metric-tag-not-in-the-path",
        "/v1/gradients",
        {"prompt": "Hi", "hooks": ["hook_embed"], "metric": {"type": "logit_diff", "tokens": [1, {"a": 1}]}},
        "metric",
        "metric.tokens[1]: fits none of the forms it takes",
    ),
    case(
        "metric-field-missing",
        "/v1/gradients",
        {"prompt": "Hi", "hooks": ["hook_embed"], "metric": {"type": "logprob"}},
        "metric",
        "metric.token: Field required",
    ),
    case("an-empty-key", GEN, {"prompt": "Hi", "": 5}, '""', '"": Extra inputs are not permitted'),
    case("a-key-named-body", GEN, {"prompt": "Hi", "body": 5}, "body", "body: Extra inputs are not permitted"),
    # a missing field named like another field's value is still named (it is no tag: it ends the path)
    case(
        "missing-field-named-like-a-value",
        NEXT,
        {"prompt": "Hi", "interventions": [{"op": "zero", "sae": "hook"}]},
        "interventions",
        "interventions[0].hook: Field required",
    ),
    case("two-bad-fields", GEN, {"prompt": "Hi", "interventions": [{"hook": 1, "op": 2}]}, "interventions", "hook:"),
    case(
        "edit-field-its-op-ignores",
        NEXT,
        {"prompt": "Hi", "interventions": [z_edit(), {"hook": "hook_embed", "op": "zero", "factor": 2.0}]},
        "interventions",
        "interventions[1].factor does not apply to zero",
    ),
    case(
        "clamp-with-a-direction",
        NEXT,
        {"prompt": "Hi", "interventions": [{"hook": "hook_embed", "op": "clamp", "direction": [1.0], "value": 1.0}]},
        "interventions",
        "interventions[0].direction does not apply to clamp (of factor, value, scale, direction, norm_match, sae,",
    ),
    case("activations-features", ACTS, {"prompt": "Hi", "features": {"sae": "x"}}, "features", "features: not taken"),
    # the OpenAI route names its own fields
    case(
        "openai-beyond-context", CMPL, {"prompt": [464] * 100, "max_tokens": 60}, "max_tokens", "plus max_tokens (60)"
    ),
]


@pytest.mark.parametrize(("bad", "param", "says"), CASES)
def test_bad_input_is_a_400_naming_the_param(client: TestClient, bad: Bad, param: str, says: str) -> None:
    error = assert_error(bad.send(client), 400, param)
    assert says in error["message"], error
    assert_still_serving(client)


def test_a_stream_with_a_lone_surrogate_in_the_prompt_is_refused_before_it_starts(client: TestClient) -> None:
    for path in (GEN, CMPL):
        r = client.post(path, content=as_json({"prompt": SURROGATE, "stream": True}), headers=JSON)
        assert_error(r, 400, "prompt")
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": "Hi", SURROGATE: 1}, "a field name that is not valid Unicode"),
        ({"prompt": "Hi", "activations": {"hooks": [SURROGATE]}}, "unknown hook 'a\\udc80b'"),
        ({"prompt": "Hi", "interventions": [{"hook": SURROGATE, "op": "zero"}]}, "interventions[0] ('a\\udc80b')"),
        ({"prompt": "Hi", "interventions": [z_edit(op="set", value={"safetensors_base64": SURROGATE})]}, "not base64"),
        ({"prompt": "Hi", "interventions": [z_edit(op=SURROGATE)]}, "interventions[0].op"),
    ],
)
def test_lone_surrogates_anywhere_are_400s(client: TestClient, body: dict[str, Any], says: str) -> None:
    """Messages that quote the client's text escape the surrogate: the answer stays sendable."""
    error = assert_error(client.post(GEN, content=as_json(body), headers=JSON), 400)
    assert says in error["message"], error
    assert_still_serving(client)


# --- an empty list of heads selects nothing, like an empty list of positions -------------------------


RESULT = {NEXT: "top", GEN: "choices", ANALYZE: "layers"}  # what an edit changes in each answer


@pytest.mark.parametrize("path", RESULT)
def test_empty_heads_or_positions_leave_the_run_unchanged(client: TestClient, path: str) -> None:
    request = {"prompt": "The cat sat", "max_new_tokens": 3, "temperature": 0} if path == GEN else {"prompt": "The cat"}
    plain = post_ok(client, path, request)[RESULT[path]]
    for edit in (z_edit(heads=[]), z_edit(positions=[]), z_edit(layers=[]), z_edit(op="add", value=[1.0], heads=[])):
        assert post_ok(client, path, request | {"interventions": [edit]})[RESULT[path]] == plain, edit
    assert post_ok(client, path, request | {"interventions": [z_edit(heads=[0, 1, 2, 3])]})[RESULT[path]] != plain
    error = assert_error(client.post(path, json=request | {"interventions": [z_edit(layers=[1])]}), 400)
    assert "no hook point in layers [1]" in error["message"]


# --- lists the server expands before any model work are bounded -----------------------------------

GRADIENTS = "/v1/gradients"


def capped_lists(n_hooks: int, n_edits: int) -> list[tuple[str, dict[str, Any], str, str]]:
    """Requests with `n_hooks` hook names and `n_edits` interventions: (path, body, param, field)."""
    hooks, edits = ["hook_embed"] * n_hooks, [{"hook": "hook_embed", "op": "zero"}] * n_edits
    gradients = {"input_ids": [464, 3797], "metric": {"type": "loss"}}
    return [
        (GEN, {"input_ids": [464], "max_new_tokens": 0, "activations": {"hooks": hooks}}, "activations", "hooks"),
        (ACTS, {"input_ids": [464], "activations": {"hooks": hooks}}, "activations", "hooks"),
        (GRADIENTS, gradients | {"hooks": hooks}, "hooks", "hooks"),
        (NEXT, {"input_ids": [464], "interventions": edits}, "interventions", "interventions"),
        (GRADIENTS, gradients | {"hooks": ["hook_embed"], "interventions": edits}, "interventions", "interventions"),
    ]


def test_hook_and_intervention_lists_over_their_caps_are_400s(client: TestClient) -> None:
    """100,000 globs once held the event loop for 19 s: a list over its cap is refused before any is read."""
    for path, body, param, field in capped_lists(MAX_HOOKS + 1, MAX_INTERVENTIONS + 1):
        error = assert_error(client.post(path, json=body), 400, param)
        cap = MAX_HOOKS if field == "hooks" else MAX_INTERVENTIONS
        assert f"{field}: List should have at most {cap} items" in error["message"], error
        assert_still_serving(client)


def test_hook_and_intervention_lists_at_their_caps_are_served(client: TestClient) -> None:
    """The caps are above gpt2-xl's hook count, so that listing every hook by name works for every model."""
    assert len(hook_names(48)) < MAX_HOOKS
    for path, body, _, _ in capped_lists(MAX_HOOKS, MAX_INTERVENTIONS):
        assert client.post(path, json=body).status_code == 200, (path, body.keys())


def test_edits_over_the_site_cap_are_400s(client: TestClient) -> None:
    """A glob counts once per hook it matches: 1024 `"*"` edits were 216,064 (edit, hook) pairs on gpt2-small,
    0.4 s of the event loop to resolve and 4 s of every batched pass to apply. Over the cap: a 400 that
    counts them, on every route that takes edits."""
    n_hooks = len(match_hooks("*", 2))  # the test model's two layers
    over = MAX_EDIT_SITES // n_hooks + 1
    glob = {"hook": "*", "op": "scale", "factor": 1.0}
    for path, body in (
        (GEN, {"input_ids": [464], "max_new_tokens": 1, "interventions": [glob] * over}),
        (NEXT, {"input_ids": [464], "interventions": [glob] * over}),
        (GRADIENTS, {"input_ids": [464, 3797], "metric": {"type": "loss"}, "hooks": ["hook_embed"],
                     "interventions": [glob] * over}),
    ):  # fmt: skip
        error = assert_error(client.post(path, json=body), 400, "interventions")
        assert f"apply at {over * n_hooks} (edit, hook point) pairs" in error["message"], error
        assert f"at most {MAX_EDIT_SITES}" in error["message"]
        assert_still_serving(client)
    at_cap = [glob] * (MAX_EDIT_SITES // n_hooks)
    assert client.post(NEXT, json={"input_ids": [464], "interventions": at_cap}).status_code == 200
    in_layer_0 = [glob | {"layers": [0]}] * (over + 1)  # layers narrow the count
    assert client.post(NEXT, json={"input_ids": [464], "interventions": in_layer_0}).status_code == 200


# --- non-finite activations ------------------------------------------------------------------------


def test_analysis_names_the_layer_that_overflowed(client: TestClient) -> None:
    at_layer_1 = {"prompt": "Hi there", "interventions": [resid(hook="blocks.1.hook_resid_post")]}
    error = assert_error(client.post(ANALYZE, json=at_layer_1), 400, "interventions")
    assert "at layer 1" in error["message"]
    embeddings = {"prompt": "Hi there", "interventions": [resid(hook="hook_embed", factor=1e30)]}
    error = assert_error(client.post(ANALYZE, json=embeddings), 400, "interventions")
    assert "after the embeddings" in error["message"]
    post_ok(client, ANALYZE, {"prompt": "Hi there"})


# --- activation dumps: the limit counts the encoding; the encoding runs off the event loop ------------

LOGITS_7 = {"input_ids": [464] * 7, "max_new_tokens": 0, "activations": {"hooks": ["logits"]}}  # 1.4 MB raw


def test_a_json_dump_is_counted_as_json_text(client: TestClient) -> None:
    """7 positions of logits: 1.4 MB of float32, 1.9 MB in base64, up to 8.8 MB as JSON (limit: 8 MiB)."""
    error = assert_error(client.post(GEN, json=LOGITS_7), 413, "activations")
    assert "as json" in error["message"] and "safetensors_base64" in error["message"]
    as_base64 = LOGITS_7 | {"activations": {"hooks": ["logits"], "format": "safetensors_base64"}}
    assert isinstance(post_ok(client, GEN, as_base64)["choices"][0]["activations"], str)
    assert client.post(ACTS, json={"input_ids": [464] * 7}).status_code == 200  # the raw file: 1.4 MB
    assert_still_serving(client)


@pytest.fixture
def calls_on_loop(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], list[bool]]:
    """Wrap `owner.name` so that each call records whether it ran on the event loop."""

    def watch(owner: Any, name: str) -> list[bool]:
        calls: list[bool] = []
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(on_event_loop())
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)
        return calls

    return watch


def test_dumps_are_encoded_off_the_event_loop(client: TestClient, calls_on_loop: Callable[..., list[bool]]) -> None:
    import server.encoding

    to_json = calls_on_loop(server.encoding, "to_json")
    to_safetensors = calls_on_loop(server.encoding, "to_safetensors")
    request = {"input_ids": [464] * 3, "max_new_tokens": 1, "activations": {"hooks": ["blocks.0.hook_resid_post"]}}
    post_ok(client, GEN, request)
    r = client.post(GEN, json=request | {"stream": True})
    assert r.status_code == 200 and '"activations"' in r.text
    post_ok(client, GEN, request | {"activations": {"hooks": ["logits"], "format": "safetensors_base64"}})
    assert client.post(ACTS, json=request).status_code == 200
    assert to_json == [False, False]
    assert to_safetensors == [False, False]


# --- prompts are tokenized off the event loop ----------------------------------------------------------


def test_prompts_are_tokenized_off_the_event_loop(
    client: TestClient, loaded: LoadedModel, calls_on_loop: Callable[..., list[bool]]
) -> None:
    encode, encode_batch = calls_on_loop(loaded.tokenizer, "encode"), calls_on_loop(loaded.tokenizer, "encode_batch")
    post_ok(client, GEN, {"prompt": "Hi", "max_new_tokens": 1})
    post_ok(client, GEN, {"prompt": ["Hi", "there"], "max_new_tokens": 1})
    post_ok(client, CMPL, {"prompt": "Hi", "max_tokens": 1})
    post_ok(client, NEXT, {"prompt": "Hi"})
    post_ok(client, ANALYZE, {"prompt": "Hi", "compare_ablated": False})
    post_ok(client, TOKENIZE, {"prompt": "Hi"})
    assert len(encode) + len(encode_batch) >= 6
    assert not any(encode + encode_batch), "a prompt was tokenized on the event loop"


def test_tokenize_builds_its_answer_off_the_event_loop(
    client: TestClient, loaded: LoadedModel, calls_on_loop: Callable[..., list[bool]]
) -> None:
    """/tokenize takes up to a body's worth of text (about 2 million tokens in 4 MiB): each token's string
    and the answer's JSON took up to 2 s on the event loop once, every stream held meanwhile."""
    import server.encoding

    piece, to_json = calls_on_loop(loaded.tokenizer, "piece"), calls_on_loop(server.encoding, "json_bytes")
    body = post_ok(client, TOKENIZE, {"prompt": "Hello world", "return_token_strs": True})
    assert body == {"tokens": [15496, 995], "count": 2, "max_model_len": 128, "token_strs": ["Hello", "Ġworld"]}
    assert post_ok(client, TOKENIZE, {"prompt": "Hi"})["token_strs"] is None
    assert piece == [False, False] and to_json == [False, False]


def test_echoed_prompts_and_detokenized_ids_are_decoded_off_the_event_loop(
    client: TestClient, loaded: LoadedModel, calls_on_loop: Callable[..., list[bool]]
) -> None:
    """A streamed echo with logprobs decodes every prefix of the prompt (for text_offset), and /detokenize
    takes up to a body's worth of ids: both on a worker thread."""
    decode, decode_batch = calls_on_loop(loaded.tokenizer, "decode"), calls_on_loop(loaded.tokenizer, "decode_batch")
    echo = {"prompt": "Hello there world", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}
    r = client.post(CMPL, json=echo)
    assert r.status_code == 200
    offsets = [e["choices"][0]["logprobs"]["text_offset"] for e in sse_events(r.text) if e["choices"][0]["logprobs"]]
    assert offsets == [[0, 5, 11]]
    assert post_ok(client, "/detokenize", {"tokens": [15496, 995]}) == {"prompt": "Hello world"}
    assert len(decode) + len(decode_batch) >= 2
    assert not any(decode + decode_batch), "token ids were decoded on the event loop"
    assert_still_serving(client)


# --- a client that disconnects while it waits frees its rows --------------------------------------------


def test_a_disconnected_client_frees_its_rows(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Raw ASGI, so that the disconnect is exact. Four rows (all the engine has) prefill and get their first
    token, then the engine stops inside its next forward pass; the client leaves; once the pass ends, the
    rows must be free at once: a new request's tokens are the only ones that follow. The waits given up
    leave nothing behind for asyncio to log as an error."""
    with serve(loaded, max_batch_size=4) as c:
        passes, paused, resume = [], threading.Event(), threading.Event()

        def gated(forward: Callable[..., Any]) -> Callable[..., Any]:
            def gate(*args: Any, **kwargs: Any) -> Any:
                passes.append(None)
                if len(passes) == 2:  # the first decode step
                    paused.set()
                    resume.wait(30)
                return forward(*args, **kwargs)

            return gate

        wrap_forward_passes(monkeypatch, loaded.model, gated)
        tokens = c.app.state.metrics.registry.get_sample_value
        before = tokens("gpt2_tokens_generated_total") or 0.0
        request = RawRequest(
            c, GEN, {"input_ids": [[464] * 8] * 4, "max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
        )
        try:
            assert paused.wait(20), "the engine did not start decoding"
            assert tokens("gpt2_tokens_generated_total") == before + 4  # one token each, from the prefill
            status = request.leave()  # the handler returned without waiting for the engine
        finally:
            resume.set()
        assert status == 499
        for _ in range(5):  # the cancelled waits settle
            c.portal.call(asyncio.sleep, 0)
        gc.collect()
        assert "never retrieved" not in caplog.text
        again = {"input_ids": [[464] * 8] * 4, "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
        post_ok(c, GEN, again)  # needs all four rows
        after = tokens("gpt2_tokens_generated_total") - before
        assert 4 + 8 <= after <= 4 + 4 + 8, f"{after} tokens: the rows of the client that left kept decoding"


# --- messages that say what is wrong ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "headers", "says"),
    [
        pytest.param(b"[" * 5000 + b"]" * 5000, JSON, "nested too deeply", id="nested-5000-deep"),
        pytest.param(b'{"prompt": "\xff"}', JSON, "not UTF-8", id="not-utf8"),
        pytest.param(b'{"prompt": "Hi"}', {"content-type": "text/plain"}, "(it is 'text/plain')", id="text-plain"),
        pytest.param(b'{"prompt": "Hi"}', {}, "Content-Type: application/json (there is none)", id="no-content-type"),
        pytest.param(b"", JSON, "the body is empty", id="empty"),
        pytest.param(b"[1, 2]", JSON, "the body must be a JSON object", id="not-an-object"),
    ],
)
def test_unreadable_bodies_say_why(client: TestClient, content: bytes, headers: dict[str, str], says: str) -> None:
    error = assert_error(client.post(GEN, content=content, headers=headers), 400, None)
    assert says in error["message"], error
    assert_still_serving(client)


# --- the API key and HEAD ---------------------------------------------------------------------------


def test_api_key_scheme_is_case_insensitive_and_the_key_is_utf8(loaded: LoadedModel) -> None:
    with serve(loaded, api_key="s3cret-ключ") as c:
        key = "s3cret-ключ".encode()
        for scheme in (b"Bearer", b"bearer", b"BEARER"):
            r = c.get("/v1/models", headers={"Authorization": scheme + b" " + key})
            assert r.status_code == 200, r.text
        assert c.get("/v1/models", headers={"X-API-Key": key}).status_code == 200
        for wrong in (b"bearer s3cret", b"Basic " + key, "Bearer s3cret-ключ".encode("latin-1", "replace")):
            assert_error(c.get("/v1/models", headers={"Authorization": wrong}), 401, None)
        r = c.post(GEN, json={"prompt": "Hi", "max_new_tokens": 1}, headers={"Authorization": b"bearer " + key})
        assert r.status_code == 200, r.text
        # only a Bearer Authorization carries the key: another scheme falls back to X-API-Key, and a bare key
        # without a scheme is not one
        both = {"Authorization": b"Basic dXNlcjpwdw==", "X-API-Key": key}
        assert c.get("/v1/models", headers=both).status_code == 200
        assert_error(c.get("/v1/models", headers={"Authorization": key}), 401, None)
    # a key ending in a character whose UTF-8 ends in 0xA0 (à) or 0x85 (Å): str.strip() took that byte as
    # whitespace, and the key never matched; HTTP's own space and tab around it still go
    for ending in ("à", "Å"):
        with serve(loaded, api_key="s3cret-" + ending) as c:
            key = ("s3cret-" + ending).encode()
            for header in (b"Bearer " + key, b"Bearer \t" + key + b" "):
                assert c.get("/v1/models", headers={"Authorization": header}).status_code == 200, (ending, header)


def test_head_on_the_health_check_and_the_viewer(loaded: LoadedModel) -> None:
    with serve(loaded, api_key="k") as c:  # both are open without the key
        for path in ("/health", "/"):
            r = c.head(path)
            assert r.status_code == 200 and r.content == b""
            assert c.get(path).status_code == 200
        assert c.head(GEN, headers={"Authorization": "Bearer k"}).status_code == 405  # HEAD only where GET is


class Gone(Exception):
    """Stands for what a host raises into a request whose client left (Ray's `TaskCancelledError`)."""


@pytest.mark.parametrize("when", ["while its body comes", "before the answer", "mid-stream"])
@pytest.mark.parametrize("how", ["cancelled", "client_gone"])
def test_a_request_its_host_gives_up_is_a_499_not_an_internal_error(
    caplog: pytest.LogCaptureFixture, when: str, how: str
) -> None:
    """Ray Serve cancels the handler of a request whose client left (asyncio's CancelledError), or raises its
    TaskCancelledError into it (`create_app(client_gone=...)`): the access log and the metrics say 499 (the
    stream's 200 where it had begun, counted as cut by its client leaving), not 500, and nothing is logged as
    an internal error."""
    from server.metrics import Metrics
    from server.middleware import RequestGuard

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if when == "mid-stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise asyncio.CancelledError() if how == "cancelled" else Gone()

    metrics, sent = Metrics(), []
    guard = RequestGuard(app, api_key=None, max_body_bytes=1024, metrics=metrics, client_gone=(Gone,))
    scope = {"type": "http", "method": "POST", "path": "/v1/generate", "headers": [], "query_string": b""}

    async def receive() -> dict[str, Any]:
        if when == "while its body comes":  # the guard reads the body before the app runs
            raise asyncio.CancelledError() if how == "cancelled" else Gone()
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        if how == "cancelled":
            with pytest.raises(asyncio.CancelledError):  # cancellation goes on up, as it must
                await guard(scope, receive, send)
        else:
            await guard(scope, receive, send)

    with caplog.at_level("INFO"):
        asyncio.run(run())
    status = 200 if when == "mid-stream" else 499
    assert metrics.registry.get_sample_value("gpt2_requests_total", {"route": "unmatched", "status": str(status)}) == 1
    cut = metrics.registry.get_sample_value("gpt2_answers_cut_total", {"route": "unmatched", "reason": "client_left"})
    assert cut == (1 if when == "mid-stream" else None)
    assert f'"status": {status}' in caplog.text and "internal error" not in caplog.text, caplog.text
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    starts = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert starts == ([200] if when == "mid-stream" else [] if how == "cancelled" else [499]), sent


def test_a_stream_the_drain_cuts_is_logged_and_counted_as_cut(caplog: pytest.LogCaptureFixture) -> None:
    """A stream under way when the shutdown's drain timeout runs out (uvicorn cancels its task, the request
    marked `DRAINING`): its 200 stands, and the log and gpt2_answers_cut_total say it was cut by the drain."""
    from server.metrics import Metrics
    from server.middleware import DRAINING, RequestGuard

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        scope[DRAINING] = True  # as the connection layer marks it when the shutdown begins
        raise asyncio.CancelledError()

    metrics = Metrics()
    guard = RequestGuard(app, api_key=None, max_body_bytes=1024, metrics=metrics)
    scope = {"type": "http", "method": "POST", "path": "/v1/generate", "headers": [], "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    with caplog.at_level("INFO"):
        asyncio.run(guard(scope, receive, send))  # the cancellation ends in the guard, as the drain's does
    assert metrics.registry.get_sample_value("gpt2_requests_total", {"route": "unmatched", "status": "200"}) == 1
    assert metrics.registry.get_sample_value("gpt2_answers_cut_total", {"route": "unmatched", "reason": "drain"}) == 1
    assert '"status": 200' in caplog.text and '"cut": "drain"' in caplog.text, caplog.text


@pytest.mark.parametrize("path", [GEN, TOKENIZE, NEXT])  # (/v1/completions ignores unknown fields, as OpenAI does)
def test_an_unknown_fields_name_is_clipped_in_its_error(client: TestClient, path: str) -> None:
    """A field the API does not take is named in the 400, cut to a message's length (a megabyte-long name was
    echoed whole, in the message and in `param`), at the top level and nested."""
    long = "k" * 60_000  # under the body cap the tests serve with (64 KiB)
    for body, field in (({"prompt": "hi", long: 1}, long), ({"prompt": "hi", "residual": {long: 1}}, "residual")):
        if path == TOKENIZE and field == "residual":
            continue  # no residual field on these routes
        answer = client.post(path, content=as_json(body), headers={"content-type": "application/json"})
        error = answer.json()["error"]
        assert answer.status_code == 400 and len(answer.content) < 2000, (answer.status_code, len(answer.content))
        assert "Extra inputs are not permitted" in error["message"] and "kkkk..." in error["message"], error
        assert error["param"] == (field if field == "residual" else "k" * 100 + "...")
    assert_still_serving(client)
