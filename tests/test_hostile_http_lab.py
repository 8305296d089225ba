"""The lab's native routes under hostile input, in process on the `tiny` checkpoint with the real tokenizer
and a random SAE: each request that once gave a 500, a silent misreading or seconds of blocked event loop
is a clear answer now, and a good request is served after it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from contract import GEN, NEXT, assert_error
from fastapi.testclient import TestClient
from inprocess import assert_still_serving, on_event_loop, post_ok, serve
from sae_files import write_sae
from safetensors.torch import load as load_safetensors

import model.interventions
from model.loading import LoadedModel

ACTS, ANALYZE, FEATURES = "/v1/activations", "/v1/analyze", "/v1/features"
RES = "blocks.1.hook_resid_pre"  # d_model 64
IDS = [464, 3797, 3332, 319, 262]  # "The cat sat on the"


@pytest.fixture(scope="module")
def client(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    sae = write_sae(tmp_path_factory.mktemp("sae") / "res1", hook=RES, d_in=64, d_sae=128, seed=1)
    with serve(loaded, sae=(f"res1={sae}",)) as c:
        yield c


ROUTES: dict[str, dict[str, Any]] = {
    NEXT: {},
    GEN: {"max_new_tokens": 2, "temperature": 0},
    ACTS: {"activations": {"hooks": ["logits"]}},
    ANALYZE: {"compare_ablated": False},
}


# --- a whole sequence's values set at no position: nothing to do, not a 500 ----------------------------


@pytest.mark.parametrize("path", ROUTES)
def test_a_whole_sequence_set_at_no_positions_changes_nothing(client: TestClient, path: str) -> None:
    """`positions: []` selects nowhere (as empty heads do); with a [pos, d] value it was max() of nothing."""
    body = {"input_ids": IDS} | ROUTES[path]
    edit = {"hook": RES, "op": "set", "value": [[0.5] * 64] * len(IDS), "positions": []}
    plain = client.post(path, json=body)
    edited = client.post(path, json=body | {"interventions": [edit]})
    assert edited.status_code == 200, edited.text
    if path == ACTS:  # the file's metadata holds a fresh id and time: compare the tensors
        assert load_safetensors(edited.content)["logits"].equal(load_safetensors(plain.content)["logits"])
    else:
        assert _without_ids(edited.json()) == _without_ids(plain.json())
    assert_still_serving(client)


def _without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


# --- edits are resolved once a request, not once a sequence ------------------------------------------


def test_a_batch_resolves_its_edits_once(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolving an edit's glob and checking it took milliseconds a thousand edits, again for every
    sequence, on the event loop: 256 prompts with 1,024 globbed edits held it for seconds."""
    resolved: list[str] = []
    original = model.interventions.edit_sites

    def counted(edit: Any, n_layer: int, where: str = "edit") -> list[str]:
        resolved.append(edit.hook)
        return original(edit, n_layer, where)

    monkeypatch.setattr(model.interventions, "edit_sites", counted)
    edits = [{"hook": f"blocks.*.hook_resid_p{'o' if i % 2 else 'r'}*", "op": "scale", "factor": 1.0} for i in range(8)]
    body = post_ok(client, GEN, {"prompt": ["Hi"] * 32, "max_new_tokens": 1, "interventions": edits})
    assert len(body["choices"]) == 32
    assert len(resolved) <= 2 * len(edits)  # the request's check of its sites, and one plan for its sequences


def test_positions_are_still_checked_for_each_sequence(client: TestClient) -> None:
    """The plan is shared; a sequence's length is its own: a position past the shorter prompt is refused."""
    edit = {"hook": RES, "op": "zero", "positions": [3]}
    r = client.post(GEN, json={"input_ids": [IDS, IDS[:2]], "max_new_tokens": 0, "interventions": [edit]})
    error = assert_error(r, 400, "interventions")
    assert "position 3 is out of range 0..1" in error["message"], error
    whole = {"hook": RES, "op": "set", "value": [[0.5] * 64] * 3}  # covers 3 positions: the 2-token prompt only
    r = client.post(GEN, json={"input_ids": [IDS[:2], IDS], "max_new_tokens": 1, "interventions": [whole]})
    error = assert_error(r, 400, "interventions")
    assert "value covers 3 positions, position 5 needed" in error["message"], error
    assert_still_serving(client)


# --- large answers are written off the event loop ----------------------------------------------------


def test_the_whole_next_token_distribution_is_written_off_the_event_loop(
    client: TestClient, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """top_k = the vocabulary: 50,257 entries, each a token's text (half a second of event loop, every
    stream stalled, on a 2-core machine)."""
    on_loop: list[bool] = []
    original = loaded.tokenizer.token_text

    def watched(token: int) -> str:
        on_loop.append(on_event_loop())
        return original(token)

    monkeypatch.setattr(loaded.tokenizer, "token_text", watched)
    body = post_ok(client, NEXT, {"input_ids": IDS, "top_k": 50257})
    assert len(body["top"]) == 50257 and body["tokens"][0] == "The"
    assert len(on_loop) == 50257 + len(IDS) and not any(on_loop)


def test_each_analysed_run_is_a_job_of_its_own(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """With compare_ablated, the run and the run without residual connections were one job: every stream
    waited for both (126 s on gpt2-small's shape at 1,000 tokens on a CPU). Now each block of a run's forward
    pass is a job and each layer's measures another, with decode steps between them."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    jobs: list[Callable[..., Any]] = []
    original = engine.call

    async def counted(fn: Callable[..., Any], continuing: bool = False) -> Any:
        jobs.append(fn)
        return await original(fn, continuing)

    monkeypatch.setattr(engine, "call", counted)
    body = post_ok(client, ANALYZE, {"input_ids": IDS, "top_k": 1})
    assert len(body["layers"]) == len(body["ablated"]) == 3
    assert len(jobs) == 2 * (2 + 3)  # per run: each of the 2 blocks, and the embeddings' and each block's layer
    jobs.clear()
    post_ok(client, ANALYZE, {"input_ids": IDS, "top_k": 1, "compare_ablated": False})
    assert len(jobs) == 2 + 3


# --- values that are not what they seem ------------------------------------------------------------


@pytest.mark.parametrize("value", [[True] * 64, [[1.0] * 63 + [False]], [[0.5] * 64, [True] * 64]])
def test_booleans_in_an_edit_value_are_refused(client: TestClient, value: list[Any]) -> None:
    """A scalar true is refused as a number (strict types); inside a list torch read it as 1.0."""
    edit = {"hook": RES, "op": "add" if len(value) != 2 else "set", "value": value}
    error = assert_error(client.post(NEXT, json={"input_ids": IDS, "interventions": [edit]}), 400, "interventions")
    assert f"value for {RES!r} holds true or false: give numbers" in error["message"], error
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (FEATURES, {"input_ids": IDS, "sae": "res1", "features": [7, 3, 7]}, "features"),
        (GEN, {"input_ids": IDS, "max_new_tokens": 1, "features": {"sae": "res1", "features": [5] * 1000}}, None),
    ],
)
def test_a_feature_id_named_twice_is_refused(client: TestClient, path: str, body: dict[str, Any], param: Any) -> None:
    """As a position or a head named twice is: the repeat would only repeat the value in every token's list."""
    param = param or "features.features"
    error = assert_error(client.post(path, json=body), 400, param)
    assert "features: " in error["message"] and "is named twice" in error["message"], error
    assert_still_serving(client)


def test_distinct_feature_ids_are_read(client: TestClient) -> None:
    body = post_ok(client, FEATURES, {"input_ids": IDS, "sae": "res1", "features": [7, 3]})
    assert [f["id"] for f in body["features"][0]["features"]] == [7, 3]


def test_a_one_prompt_dump_is_written_from_the_captured_tensors(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of one prompt was a copy of everything captured before it was encoded: hundreds of megabytes more
    at a time, for nothing (a batch's are stacked, which copies them)."""
    import server.encoding
    import server.routes.native

    captured: list[dict[str, Any]] = []
    written: list[dict[str, Any]] = []
    results, to_safetensors = server.routes.native.results, server.encoding.to_safetensors

    async def kept(*args: Any) -> Any:
        completions = await results(*args)
        captured.extend(dict(c.activations) for c in completions)  # the file takes them out of the completions
        return completions

    def watched(tensors: dict[str, Any], *args: Any) -> bytes:
        written.append(tensors)
        return to_safetensors(tensors, *args)

    monkeypatch.setattr(server.routes.native, "results", kept)
    monkeypatch.setattr(server.encoding, "to_safetensors", watched)
    hooks = ["blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]
    r = client.post(ACTS, json={"input_ids": IDS, "activations": {"hooks": hooks}})
    assert r.status_code == 200, r.text
    ((tensors,),) = [written]
    assert all(tensors[name] is captured[0][name] for name in hooks)
    assert load_safetensors(r.content)[hooks[1]].shape == (1, len(IDS), 256)
    batch = client.post(ACTS, json={"input_ids": [IDS, IDS], "activations": {"hooks": hooks}})
    assert load_safetensors(batch.content)[hooks[0]].shape == (2, len(IDS), 64)


def test_an_integer_too_long_to_read_is_named(client: TestClient) -> None:
    """Python reads at most 4,300 digits of an integer: the body is valid JSON in UTF-8, so the answer must not
    say it is not."""
    body = b'{"input_ids": [464], "max_new_tokens": ' + b"9" * 5000 + b"}"
    r = client.post(GEN, content=body, headers={"content-type": "application/json"})
    error = assert_error(r, 400)
    assert error["message"] == "the body holds an integer of more than 4300 digits, too long to read", error
    assert_still_serving(client)


def test_globs_are_matched_off_the_event_loop(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """2,048 distinct globs in a dump's hooks take 0.4 s to match on gpt2-small's hook points (1.2 s on
    gpt2-xl's), 1,024 globbed edits 0.2 s (0.6 s): every stream stalled that long, on each such request."""
    import server.routes.native
    import server.schemas

    on_loop: dict[str, list[bool]] = {"select_hooks": [], "edit_spec": []}
    watch = [(server.routes.native, "select_hooks"), (server.schemas, "select_hooks"), (server.schemas, "edit_spec")]
    for owner, name in watch:
        original = getattr(owner, name)

        def watched(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            on_loop[_name].append(on_event_loop())
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)
    edits = {"interventions": [{"hook": "blocks.*.hook_resid_p*", "op": "scale", "factor": 1.0}]}
    hooks = {"activations": {"hooks": ["blocks.*.hook_resid_post"]}}
    post_ok(client, GEN, {"input_ids": IDS, "max_new_tokens": 1} | edits | hooks)
    assert client.post(ACTS, json={"input_ids": IDS} | edits | hooks).status_code == 200
    for path, body in ((NEXT, {}), (ANALYZE, {"compare_ablated": False}), (FEATURES, {"sae": "res1"})):
        post_ok(client, path, {"input_ids": IDS} | edits | body)
    gradients = {"metric": {"type": "loss"}, "hooks": ["blocks.*.hook_resid_pre"]}
    post_ok(client, "/v1/gradients", {"input_ids": IDS} | edits | gradients)
    assert len(on_loop["select_hooks"]) >= 3 and len(on_loop["edit_spec"]) == 6, on_loop
    assert not any(on_loop["select_hooks"] + on_loop["edit_spec"]), on_loop


def test_edits_are_resolved_to_hook_points_off_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resolving and checking a request's edits at each hook point they reach (its `EditPlan`: 4,096 sites at
    most) took up to a tenth of a second on gpt2-xl's shape; it was made for the first sequence, inside
    `engine.submit`, on the event loop."""
    import model.interventions

    on_loop: list[bool] = []
    original = model.interventions.EditPlan

    class Watched(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any) -> None:
            on_loop.append(on_event_loop())
            super().__init__(*args)

    monkeypatch.setattr(model.interventions, "EditPlan", Watched)
    edits = {"interventions": [{"hook": "blocks.*.hook_resid_p*", "op": "scale", "factor": 1.0}]}
    post_ok(client, GEN, {"input_ids": [IDS, IDS], "max_new_tokens": 1} | edits)
    post_ok(client, GEN, {"input_ids": IDS, "max_new_tokens": 0, "activations": {"hooks": ["blocks.0.*"]}} | edits)
    post_ok(client, NEXT, {"input_ids": IDS} | edits)
    assert on_loop and not any(on_loop), on_loop
