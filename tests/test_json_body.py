"""Request bodies that name a key twice are refused (server/json_body.py): on every route that reads JSON, at
any depth, with a 400 whose `param` is the key's path; the server serves on. Everything else reads as
`json.loads` reads it (NaN and Infinity, the errors for long integers and bodies that are not UTF-8), the
OpenAI client and streaming work through the routes. In process, on the `tiny` checkpoint."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from contract import CMPL, assert_error, sse_events
from fastapi.testclient import TestClient
from inprocess import assert_still_serving, serve

from model.loading import LoadedModel
from server import json_body
from server.json_body import DuplicateKeyError, loads

JSON = {"content-type": "application/json"}
CLEAN = [464, 3797, 3332, 319, 262, 2603, 780, 340]
IDS = json.dumps(CLEAN)
HOOKS = '"hooks": ["blocks.0.hook_resid_pre"]'
EDIT = '{"hook": "blocks.0.hook_resid_post", "op": "scale", "factor": 0.5, "factor": 2}'


@pytest.fixture(scope="module")
def client(loaded: LoadedModel) -> Iterator[TestClient]:
    with serve(loaded) as c:
        yield c


def post(client: TestClient, path: str, body: str | bytes) -> Any:
    content = body.encode() if isinstance(body, str) else body
    return client.post(path, content=content, headers=JSON)


# --- the parser ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ('{"a": 1, "a": 1}', "a"),  # even with equal values: the client meant something by each
        ('{"prompt": "hi", "residual": {"attn": [0], "attn": []}}', "residual.attn"),
        ('{"e": [{"h": 1}, {"h": 1, "h": 2}]}', "e[1].h"),
        ('[[{"x": [{"y": 1, "y": 2}]}]]', "[0][0].x[0].y"),  # under lists only, up to the top
        ('{"a": {"x": 1, "x": 2}, "a": 3}', "a.x"),  # in the value the object's own duplicate throws away
        ('{"b": {"c": {"d": 1, "d": 2}}, "z": {"q": 1, "q": 1}}', "b.c.d"),  # the first one read
        ('{"s\\u00e9": {"": 1, "": 2}}', 'sé.""'),
    ],
)
def test_a_key_named_twice_is_refused_with_its_path(body: str, path: str) -> None:
    with pytest.raises(DuplicateKeyError) as e:
        loads(body.encode())
    assert e.value.param == path
    assert str(e.value) == f"the body names the key {path!r} more than once: send each key once"


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": NaN, "b": [Infinity, -Infinity], "c": 1e400}',
        b'{"input_ids": [464, 50256], "n": 123456789012345678901234567890, "x": {"y": [{}, {"z": null}]}}',
        '{"prompt": "caf\u00e9 \\ud83d\\ude00 \\udc80"}'.encode(),  # a lone surrogate is valid JSON
        '{"prompt": "hi"}'.encode("utf-8-sig"),  # a byte order mark, which RFC 8259 lets a parser ignore
    ],
)
def test_everything_else_reads_as_json_loads_reads_it(body: bytes) -> None:
    assert repr(loads(body)) == repr(json.loads(body))  # repr: NaN is not equal to itself


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_body_in_another_unicode_encoding_is_not_utf8(encoding: str) -> None:
    """`json.loads` would guess UTF-16 and UTF-32 from the first bytes; the API takes UTF-8 only, as it says (the
    forms without a byte order mark are UTF-8 bytes, with NULs: not JSON)."""
    body = '{"prompt": "hi"}'.encode(encoding)
    assert json.loads(body) == {"prompt": "hi"}
    with pytest.raises(UnicodeDecodeError if encoding in ("utf-16", "utf-32") else json.JSONDecodeError):
        loads(body)


@pytest.mark.parametrize(
    "body",
    [b'{"n": ' + b"9" * 5000 + b"}", b'{"prompt": "\xff"}', b'{"a": 1,}', b"[" * 100_000 + b"]" * 100_000],
    ids=["5000-digits", "not-utf8", "not-json", "too-deep"],
)
def test_bad_bodies_raise_what_json_loads_raises(body: bytes) -> None:
    with pytest.raises(Exception) as ours:
        loads(body)
    with pytest.raises(Exception) as theirs:
        json.loads(body)
    assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


# --- over HTTP -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        pytest.param(CMPL, '{"prompt": "Hi", "max_tokens": 1, "max_tokens": 2}', "max_tokens", id="completions"),
        pytest.param(CMPL, '{"prompt": "Hi", "stream": true, "stream": false}', "stream", id="completions-stream"),
        pytest.param("/tokenize", '{"prompt": "a", "prompt": "b"}', "prompt", id="tokenize"),
        pytest.param("/detokenize", '{"tokens": [1], "tokens": []}', "tokens", id="detokenize"),
        pytest.param(
            "/v1/gradients",
            f'{{"input_ids": {IDS}, {HOOKS}, "metric": {{"type": "loss", "type": "logprob"}}}}',
            "metric.type",
            id="gradients-nested",
        ),
        pytest.param(
            "/v1/gradients",
            f'{{"input_ids": {IDS}, {HOOKS}, "metric": {{"type": "loss"}}, "interventions": [{EDIT}]}}',
            "interventions[0].factor",
            id="gradients-in-a-list",
        ),
        pytest.param(
            "/v1/gradients",
            f'{{"input_ids": {IDS}, {HOOKS}, "metric": {{"type": "loss"}}, "residual": {{"attn": [0], "attn": []}}}}',
            "residual.attn",
            id="gradients-residual",
        ),
        pytest.param(
            "/v1/attribution",
            f'{{"clean": {IDS}, "corrupted": {IDS}, "metric": {{"type": "loss"}}, "clean": [1]}}',
            "clean",
            id="attribution",
        ),
        pytest.param("/v1/features", f'{{"input_ids": {IDS}, "sae": "a", "sae": "b"}}', "sae", id="features"),
        pytest.param(
            "/v1/steering-vectors",
            '{"name": "v", "direction": {"feature": 1, "feature": 2}}',
            "direction.feature",
            id="steering-vectors",
        ),
    ],
)
def test_a_key_named_twice_is_a_400_naming_it(client: TestClient, path: str, body: str, param: str) -> None:
    error = assert_error(post(client, path, body), 400, param)
    assert error["message"] == f"the body names the key {param!r} more than once: send each key once", error
    assert_still_serving(client)


def test_without_the_duplicate_the_same_bodies_are_answered(client: TestClient) -> None:
    """The refusals above are for the duplicate, not for the rest of the body."""
    body = f'{{"input_ids": {IDS}, {HOOKS}, "metric": {{"type": "loss"}}, "residual": {{"attn": [0]}}}}'
    assert post(client, "/v1/gradients", body).status_code == 200
    r = post(client, CMPL, '{"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": true}')
    assert r.status_code == 200 and len(sse_events(r.text)) >= 2
    assert post(client, "/tokenize", '{"prompt": "a"}').json()["count"] == 1


def test_a_megabyte_key_named_twice_is_not_echoed_whole(client: TestClient) -> None:
    """The key's path goes back in the message and in `param`: both cut short, as a hostile file's names are
    (a key of megabytes named twice came back twice in full)."""
    key = "k" * 20_000  # the tests' body cap is 64 KiB
    r = post(client, "/tokenize", f'{{"prompt": "a", "{key}": 1, "{key}": 2}}')
    assert r.status_code == 400 and len(r.content) < 1000
    error = r.json()["error"]
    assert error["param"] == "k" * 100 + "..." and error["message"].startswith("the body names the key 'kkk")
    assert_still_serving(client)


def test_analyze_refuses_a_key_named_twice(client: TestClient) -> None:
    body = '{"prompt": "hi", "residual": {"attn": [0], "attn": []}}'
    assert_error(post(client, "/v1/analyze", body), 400, "residual.attn")


def test_every_route_that_reads_a_body_refuses_duplicates(client: TestClient) -> None:
    """Each operation with a request body in the OpenAPI schema, so that a route added later is covered."""
    operations = [
        (path, method)
        for path, item in client.app.openapi()["paths"].items()  # type: ignore[attr-defined]
        for method, operation in item.items()
        if "requestBody" in operation
    ]
    assert len(operations) >= 10, operations
    twice = b'{"a": 1, "a": 1}'
    accepted = [
        (path, method)
        for path, method in operations
        if "more than once" not in client.request(method, path, content=twice, headers=JSON).json()["error"]["message"]
    ]
    assert accepted == []


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"prompt": "Hi", "max_tokens": 1, "temperature": NaN}', "temperature"),
        (b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}", "an integer of more than 4300 digits"),
        (b'{"prompt": "\xff"}', "the body is not UTF-8: invalid start byte at byte 12"),
        ('{"prompt": "Hi"}'.encode("utf-16"), "the body is not UTF-8"),
        (b'\xef\xbb\xbf{"prompt": "\xff"}', "the body is not UTF-8: invalid start byte at byte 15"),  # after a BOM
        (b'{"prompt": "Hi",}', "the body is not valid JSON: Expecting property name enclosed in double quotes"),
    ],
    ids=["nan", "5000-digits", "not-utf8", "utf16", "bom-then-not-utf8", "not-json"],
)
def test_other_bad_bodies_are_answered_as_before(client: TestClient, content: bytes, says: str) -> None:
    error = assert_error(post(client, CMPL, content), 400)
    assert says in error["message"], error
    assert_still_serving(client)


def test_the_openai_client_completes_and_streams(client: TestClient) -> None:
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    model = oai.models.list().data[0].id
    out = oai.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    chunks = list(oai.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:  # the error shape, as the client reads it
        oai.completions.create(model=model, prompt="Hello", max_tokens=-1)
    assert e.value.param == "max_tokens"


# --- the parse's cost ------------------------------------------------------------------------------


@pytest.mark.parametrize("collecting", [True, False])
@pytest.mark.parametrize("body", [b'{"a": [[1], [2]]}', b'{"a": [[1], [2]'], ids=["good", "bad"])
def test_the_parse_leaves_the_collector_as_it_found_it(body: bytes, collecting: bool) -> None:
    """The cyclic garbage collector is paused while a body parses, and left as it was, whatever the body."""
    was = gc.isenabled()
    (gc.enable if collecting else gc.disable)()
    try:
        with contextlib.suppress(json.JSONDecodeError):
            loads(body)
        assert gc.isenabled() == collecting
    finally:
        (gc.enable if was else gc.disable)()


def test_no_collection_walks_a_body_while_it_parses() -> None:
    """Without the pause, a collection every 700 new lists would walk all those made so far (a second for a 4
    MiB body of small lists): here 40,000 lists parse with at most one collection, the one once it is over."""
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and threading.get_ident() == here:  # (a collection another thread asks for is not one)
            collections.append(info["generation"])

    here = threading.get_ident()

    body = b"[" + b",".join([b"[[1]]"] * 20_000) + b"]"
    gc.callbacks.append(count)
    try:
        value = loads(body)
    finally:
        gc.callbacks.remove(count)
    assert len(value) == 20_000 and len(collections) <= 1, collections


def containers(n: int, pad: int = 0) -> bytes:
    """A body of n arrays and objects (half of each, about), with `pad` bytes of string besides."""
    return b'{"s": "' + b"x" * pad + b'", "a": [' + b",".join([b"[{}]"] * ((n - 2) // 2)) + b"]}"


def test_a_body_of_more_arrays_and_objects_than_its_size_allows_is_refused() -> None:
    """At most MAX_CONTAINERS arrays and objects, or one per CONTAINER_BYTES of the body where that is more:
    what a body costs to parse is bounded by its size. Brackets inside strings are text, not containers."""
    cap = json_body.MAX_CONTAINERS
    assert len(loads(containers(cap))["a"]) == (cap - 2) // 2
    with pytest.raises(json_body.TooManyContainers) as e:
        loads(containers(cap + 2))
    assert str(e.value).startswith(f"the body holds {cap + 2:,} JSON arrays and objects, more than the {cap:,} a body")
    wide = containers(cap + 2, pad=(cap + 1) * json_body.CONTAINER_BYTES)  # more bytes: more containers allowed
    assert len(loads(wide)["a"]) == cap // 2
    text = json.dumps({"prompt": "[{" * cap, "ids": [[1]] * 10}).encode()  # 200,000 brackets, all but 11 in text
    assert loads(text)["prompt"] == "[{" * cap
    escaped = {"a": '\\"[{' * cap, "b": "\\", "c": '"', "d": [[1]] * 10}  # quotes and backslashes escaped in it
    assert loads(json.dumps(escaped).encode()) == escaped


def test_a_body_whose_string_never_closes_is_counted_in_one_pass() -> None:
    """Counted outside its strings in linear passes: a regular expression for strings, tried at every quote of
    one that never closes, took hours over 4 MiB of them."""
    body = b"[" * (json_body.MAX_CONTAINERS + 1) + b'"' + b'\\"' * 200_000  # 200,000 escaped quotes, unclosed
    for tail in (b"", b"\\"):
        with pytest.raises(json_body.TooManyContainers):
            loads(body + tail)


def test_a_body_of_too_many_arrays_and_objects_is_a_400(loaded: LoadedModel) -> None:
    body = b'{"prompt": "Hi", "max_tokens": 1, "x": [' + b",".join([b"[[[[1]]]]"] * 60_000) + b"]}"
    with serve(loaded, max_body_bytes=2**20) as client:
        error = assert_error(post(client, CMPL, body), 400)
        assert error["message"].startswith("the body holds 240,002 JSON arrays and objects, more than the 100,000")
        assert error["message"].endswith('longer lists, or as a safetensors file ({"safetensors_base64": ...})')
        assert_still_serving(client)


def test_a_large_body_is_parsed_off_the_event_loop(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop serves the other clients while a body of more than THREAD_BYTES parses (on a worker
    thread); a small one parses where it is, without a thread's hop."""
    threads: list[int] = []

    def recorded(body: bytes) -> Any:
        threads.append(threading.get_ident())
        return loads(body)

    monkeypatch.setattr(json_body, "loads", recorded)
    small = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    large = {**small, "user": "x" * json_body.THREAD_BYTES}
    with serve(loaded, max_body_bytes=4 * json_body.THREAD_BYTES) as client:
        answers = [post(client, CMPL, json.dumps(body)) for body in (small, large, small)]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert len({a.json()["choices"][0]["text"] for a in answers}) == 1  # the same request, read the same
    on_loop, off_loop, again = threads
    assert on_loop == again != off_loop
