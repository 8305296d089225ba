"""/v1/gradients, /v1/attribution and /v1/analyze's gradients over HTTP, in process on the tiny checkpoint
with the real tokenizer: answers equal the model-level functions (themselves checked against
transformers), edits are honoured, bad input is a 400/413 naming the field (and the server keeps serving),
and a gradient job runs between two decode steps of the continuous batch, never several in a row."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from contract import assert_error
from fastapi.testclient import TestClient
from inprocess import (
    RawRequest,
    assert_interleaved,
    assert_still_serving,
    engine_held,
    log_engine,
    nth_job_held,
    post_ok,
    serve,
    wait_until,
)
from safetensors.torch import load as load_safetensors

from model.interventions import Edit, EditSpec
from model.lab.attribution import attribution
from model.lab.gradients import LogitDiff, LogProb, Loss, gradients, highway
from model.loading import LoadedModel
from server.engine import QueueFull

CLEAN = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
CORRUPTED = [464, 3290, 3332, 319, 262, 2603, 780, 340]  # "The dog sat on the mat because it"
HOOKS = ["blocks.*.hook_resid_pre", "blocks.1.attn.hook_pattern", "unembed.hook_in"]
NAMES = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.1.attn.hook_pattern", "unembed.hook_in"]


@pytest.fixture(scope="module")
def client(loaded: LoadedModel) -> Iterator[TestClient]:
    with serve(loaded) as c:
        yield c


def tensor(entry: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(entry["data"], dtype=torch.float32).reshape(entry["shape"])


def test_gradients_in_json_equal_the_model(client: TestClient, loaded: LoadedModel) -> None:
    body = post_ok(client, "/v1/gradients", {"input_ids": CLEAN, "metric": {"type": "loss"}, "hooks": HOOKS})
    want = gradients(loaded.model, CLEAN, Loss(), NAMES)
    assert body["metric"] == {"type": "loss", "value": pytest.approx(want.metric), "span": None}
    assert body["input_ids"] == CLEAN and len(body["tokens"]) == len(CLEAN)
    assert sorted(body["gradients"]) == sorted(n + "_grad" for n in NAMES)
    for name in NAMES:
        got = tensor(body["gradients"][name + "_grad"])
        torch.testing.assert_close(got, want.grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradients_as_safetensors_with_edits_and_a_token_given_as_text(client: TestClient, loaded: LoadedModel) -> None:
    edits = {
        "interventions": [{"hook": "blocks.0.hook_attn_out", "op": "scale", "factor": 0.5}],
        "residual": {"mlp": [1]},
    }
    metric = {"type": "logprob", "token": " was", "position": -1}
    hooks = ["blocks.*.hook_resid_post"]
    body = {"prompt": "The cat sat on the mat because it", "metric": metric, "hooks": hooks, "format": "safetensors"}
    r = client.post("/v1/gradients", json=body | edits)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    got = load_safetensors(r.content)
    spec = EditSpec((Edit("blocks.0.hook_attn_out", "scale", factor=0.5),), (), (1,))
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    want = gradients(loaded.model, CLEAN, LogProb(373, -1), names, spec)  # " was" is token 373
    for name in names:
        torch.testing.assert_close(got[name + "_grad"], want.grads[name], rtol=1e-5, atol=1e-7)
    plain = gradients(loaded.model, CLEAN, LogProb(373, -1), names)
    assert not torch.allclose(plain.grads[names[0]], want.grads[names[0]])


def test_gradients_as_safetensors_where_hook_points_share_one_tensor(client: TestClient, loaded: LoadedModel) -> None:
    """Autograd hands one tensor to hook points that hold the same value (a block's resid_post and the next
    block's resid_pre, resid_mid and attn_out's gradients, logits and unembed.hook_out): the file still holds
    each under its own name (safetensors refuses tensors that share memory)."""
    hooks = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post", "blocks.0.hook_resid_mid", "blocks.0.hook_attn_out"]
    body = {"input_ids": CLEAN, "metric": {"type": "loss"}, "hooks": hooks, "format": "safetensors"}
    r = client.post("/v1/gradients", json=body)
    assert r.status_code == 200, r.text
    got = load_safetensors(r.content)
    names = [f"blocks.{i}.hook_resid_{s}" for i in range(2) for s in ("pre", "post")]
    names += ["blocks.0.hook_resid_mid", "blocks.0.hook_attn_out"]
    want = gradients(loaded.model, CLEAN, Loss(), names)
    assert sorted(got) == sorted(n + "_grad" for n in names)
    for name in names:
        torch.testing.assert_close(got[name + "_grad"], want.grads[name], rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(got["blocks.0.hook_resid_post_grad"], got["blocks.1.hook_resid_pre_grad"])


def test_attribution_equals_the_model_and_verifies(client: TestClient, loaded: LoadedModel) -> None:
    metric = {"type": "logit_diff", "tokens": [" was", 318]}
    body = post_ok(client, "/v1/attribution", {"clean": CLEAN, "corrupted": CORRUPTED, "metric": metric, "verify": 3})
    want = attribution(loaded.model, CLEAN, CORRUPTED, LogitDiff((373, 318)), 3)
    assert body["metric"] == {"type": "logit_diff", "tokens": [373, 318], "position": -1}
    assert body["clean"]["metric"] == pytest.approx(want.clean_metric)
    assert body["corrupted"]["metric"] == pytest.approx(want.corrupted_metric)
    for key, value in (
        ("resid_pre", want.resid_pre),
        ("z", want.z),
        ("attn_out", want.attn_out),
        ("mlp_out", want.mlp_out),
    ):
        torch.testing.assert_close(torch.tensor(body[key], dtype=torch.float64), value, rtol=1e-5, atol=1e-7, msg=key)
    assert [v["site"]["hook"] for v in body["verified"]] == [v.site.hook for v in want.verified]
    for got, v in zip(body["verified"], want.verified, strict=True):
        assert got["patched_metric"] == pytest.approx(v.patched_metric, rel=1e-5)
        assert got["attribution"] == pytest.approx(v.attribution, rel=1e-5)
    # text prompts: the same
    prompts = {"clean": "The cat sat on the mat because it", "corrupted": "The dog sat on the mat because it"}
    text = post_ok(client, "/v1/attribution", {**prompts, "metric": metric})
    assert text["clean"]["input_ids"] == CLEAN and text["verified"] == []
    torch.testing.assert_close(torch.tensor(text["resid_pre"]), torch.tensor(body["resid_pre"]))


def test_analyze_with_gradients_adds_the_highway_to_both_runs(client: TestClient, loaded: LoadedModel) -> None:
    body = post_ok(client, "/v1/analyze", {"input_ids": CLEAN, "gradients": True})
    every = tuple(range(loaded.model.config.n_layer))
    for run, spec in (("layers", None), ("ablated", EditSpec((), every, every))):
        want = highway(loaded.model, CLEAN, spec)
        assert [layer["layer"] for layer in body[run]] == [g.layer for g in want]
        for layer, g in zip(body[run], want, strict=True):
            assert layer["grad_norm"] == pytest.approx(g.grad_norm, rel=1e-5)
            if g.jacobian_norm is None:
                assert layer["jacobian_norm"] is None and layer["jacobian_identity_distance"] is None
            else:
                assert layer["jacobian_norm"] == pytest.approx(g.jacobian_norm, rel=1e-5)
                assert layer["jacobian_identity_distance"] == pytest.approx(g.jacobian_identity_distance, rel=1e-5)
    assert body["layers"][0]["grad_norm"] != body["ablated"][0]["grad_norm"]
    plain = post_ok(client, "/v1/analyze", {"input_ids": CLEAN})
    assert "grad_norm" not in plain["layers"][0]


# --- bad input ----------------------------------------------------------------------------------


def grad(**fields: Any) -> dict[str, Any]:
    return {"input_ids": CLEAN, "metric": {"type": "loss"}, "hooks": ["logits"], **fields}


def attr(**fields: Any) -> dict[str, Any]:
    return {"clean": CLEAN, "corrupted": CORRUPTED, "metric": {"type": "loss"}, **fields}


BAD = [
    ("metric-type", "/v1/gradients", grad(metric={"type": "kl"}), 400, "metric"),
    ("metric-no-type", "/v1/gradients", grad(metric={"token": 5}), 400, "metric"),
    ("metric-missing", "/v1/gradients", {"input_ids": CLEAN, "hooks": ["logits"]}, 400, "metric"),
    ("metric-extra-field", "/v1/gradients", grad(metric={"type": "loss", "token": 5}), 400, "metric"),
    ("token-over-vocab", "/v1/gradients", grad(metric={"type": "logprob", "token": 50257}), 400, "metric.token"),
    (
        "token-text-of-two",
        "/v1/gradients",
        grad(metric={"type": "logprob", "token": " Eiffel Tower"}),
        400,
        "metric.token",
    ),
    ("token-bool", "/v1/gradients", grad(metric={"type": "logprob", "token": True}), 400, "metric"),
    ("tokens-one", "/v1/gradients", grad(metric={"type": "logit_diff", "tokens": [5]}), 400, "metric"),
    (  # the one of the two that is no one token, by its place
        "tokens-text-of-two",
        "/v1/gradients",
        grad(metric={"type": "logit_diff", "tokens": [5, " Eiffel Tower"]}),
        400,
        "metric.tokens[1]",
    ),
    (
        "tokens-over-vocab",
        "/v1/gradients",
        grad(metric={"type": "logit_diff", "tokens": [5, -1]}),
        400,
        "metric.tokens",
    ),
    ("position", "/v1/gradients", grad(metric={"type": "logprob", "token": 5, "position": 8}), 400, "metric.position"),
    ("span", "/v1/gradients", grad(metric={"type": "loss", "span": [0, 3]}), 400, "metric.span"),
    ("one-token-loss", "/v1/gradients", grad(input_ids=[464]), 400, "metric"),
    ("unknown-hook", "/v1/gradients", grad(hooks=["blocks.7.hook_resid_pre"]), 400, "hooks"),
    ("no-hooks", "/v1/gradients", grad(hooks=[]), 400, "hooks"),
    ("format", "/v1/gradients", grad(format="npy"), 400, "format"),
    ("bad-edit", "/v1/gradients", grad(interventions=[{"hook": "nope", "op": "zero"}]), 400, "interventions"),
    (  # LayerNorm's variance overflows at position 3 (its square is past float32): the gradients through it were 0
        "layer-norm-overflow",
        "/v1/gradients",
        grad(
            hooks=["hook_embed"],
            interventions=[{"hook": "blocks.0.hook_resid_post", "op": "scale", "factor": 1e19, "positions": [3]}],
        ),
        400,
        "interventions",
    ),
    (  # logits times 3e38: a finite logit difference whose gradient back through the LM head is inf (it was NaN)
        "gradient-inf",
        "/v1/gradients",
        grad(
            metric={"type": "logit_diff", "tokens": [318, 373]},
            hooks=["hook_embed"],
            interventions=[{"hook": "logits", "op": "scale", "factor": 3e38}],
        ),
        400,
        "interventions",
    ),
    (  # the MLP's own copy of the stream: every measure of the stream stayed finite
        "analyze-layer-norm-overflow",
        "/v1/analyze",
        {"input_ids": CLEAN, "interventions": [{"hook": "blocks.0.hook_mlp_in", "op": "scale", "factor": 1e19}]},
        400,
        "interventions",
    ),
    ("answer-too-large", "/v1/gradients", grad(input_ids=[464] * 60, hooks=["logits", "*"]), 413, "hooks"),
    ("graph-too-large", "/v1/gradients", grad(input_ids=[464] * 100, hooks=["hook_embed"]), 413, "input_ids"),
    (
        "graph-too-large-text",
        "/v1/gradients",
        {**grad(hooks=["hook_embed"]), "input_ids": None, "prompt": "a b " * 60},
        413,
        "prompt",
    ),
    ("lengths", "/v1/attribution", attr(corrupted=CORRUPTED[:-1]), 400, "corrupted"),
    ("clean-empty", "/v1/attribution", attr(clean=""), 400, "clean"),
    ("corrupted-vocab", "/v1/attribution", attr(corrupted=[99999] * 8), 400, "corrupted"),
    ("verify-negative", "/v1/attribution", attr(verify=-1), 400, "verify"),
    ("verify-too-many", "/v1/attribution", attr(verify=65), 400, "verify"),
    (
        "attribution-token",
        "/v1/attribution",
        attr(metric={"type": "logprob", "token": "two tokens"}),
        400,
        "metric.token",
    ),
    ("attribution-graph", "/v1/attribution", attr(clean=[464] * 100, corrupted=[465] * 100), 413, "corrupted"),
    ("analyze-one-token", "/v1/analyze", {"input_ids": [464], "gradients": True}, 400, "gradients"),
    ("analyze-gradients-string", "/v1/analyze", {"input_ids": CLEAN, "gradients": "yes"}, 400, "gradients"),
]


@pytest.fixture(scope="module")
def small_limits(loaded: LoadedModel) -> Iterator[TestClient]:
    """A graph limit between a 60-token and a 100-token prompt's graph on the tiny model."""
    from model.lab.gradients import graph_bytes

    c = loaded.model.config
    limit = (graph_bytes(c, 60, torch.float32) + graph_bytes(c, 100, torch.float32)) // 2
    with serve(loaded, max_gradient_bytes=limit) as client:
        yield client


def test_a_metric_of_no_kind_or_another_says_which_kinds_there_are(small_limits: TestClient) -> None:
    """A metric is told apart by its `type`: missing, or none of the kinds, the message says so in its own words
    (pydantic's were "Unable to extract tag using discriminator 'type'"); the command line's `--metric` too."""
    for metric, says in (
        ({"token": 5}, "metric: no 'type', which says what kind it is"),
        ({"type": "kl"}, "metric: type 'kl' is none of the kinds: 'logprob', 'logit_diff', 'loss'"),
        (["loss"], "metric: must be an object ({...}), got a list"),  # not pydantic's "a valid dictionary"
    ):
        error = assert_error(small_limits.post("/v1/gradients", json=grad(metric=metric)), 400, "metric")
        assert error["message"] == says


@pytest.mark.parametrize(("path", "body", "status", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_field(small_limits: TestClient, path: str, body: Any, status: int, param: str) -> None:
    body = {k: v for k, v in body.items() if v is not None}
    assert_error(small_limits.post(path, json=body), status, param)
    assert_still_serving(small_limits)


def test_the_graph_limit_counts_the_per_head_inputs_asked_for_or_edited(loaded: LoadedModel) -> None:
    """A block's per-head copies of the stream (`hook_attn_in`, `hook_q_input`, ...) save n_head d_model-wide
    values a position each, beyond the graph a request of the same length builds otherwise: a limit that
    fits the plain graph refuses them, captured or edited, and the server serves on."""
    from model.lab.gradients import graph_bytes

    c, n = loaded.model.config, 40
    with serve(loaded, max_gradient_bytes=graph_bytes(c, n, torch.float32)) as client:
        ok = client.post("/v1/gradients", json=grad(input_ids=[464] * n, hooks=["hook_embed"]))
        assert ok.status_code == 200, ok.text
        split = grad(input_ids=[464] * n, hooks=["blocks.*.hook_attn_in"])
        refused = client.post("/v1/gradients", json=split)
        assert_error(refused, 413, "input_ids")
        assert "or capture or edit fewer per-head inputs" in refused.json()["error"]["message"]
        edit = {"hook": "blocks.0.hook_q_input", "op": "scale", "factor": 2}
        edited = grad(input_ids=[464] * n, hooks=["hook_embed"], interventions=[edit])
        assert_error(client.post("/v1/gradients", json=edited), 413, "input_ids")
        highway = {"input_ids": [464] * n, "gradients": True, "interventions": [edit]}
        assert_error(client.post("/v1/analyze", json=highway), 413, "gradients")
        assert_still_serving(client)


def test_the_graph_limit_counts_an_int8_model_s_dequantized_weights(tiny: Any, tokenizer_dir: Any) -> None:
    """With int8 weights each product dequantizes its weight for a moment: a limit that fits a float32 model's
    graph refuses the same request on the int8 model, naming the prompt, and the server serves on."""
    from model.lab.gradients import graph_bytes
    from model.loading import load

    int8 = load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu", dtype="int8")
    c, n = int8.model.config, 40
    with serve(int8, max_gradient_bytes=graph_bytes(c, n, torch.float32)) as client:
        body = grad(input_ids=[464] * n, hooks=["hook_embed"])
        assert_error(client.post("/v1/gradients", json=body), 413, "input_ids")
        assert_still_serving(client)
    with serve(int8, max_gradient_bytes=graph_bytes(c, 0, torch.float32, quantized=True) - 1) as client:
        error = assert_error(client.post("/v1/gradients", json=grad(input_ids=[464] * 2, hooks=["hook_embed"])), 413)
        assert "with int8 weights a graph takes about" in error["message"] and "no prompt fits" in error["message"]
    with serve(int8, max_gradient_bytes=graph_bytes(c, n, torch.float32, quantized=True)) as client:
        ok = client.post("/v1/gradients", json=body)
        assert ok.status_code == 200, ok.text


# --- the engine: a pass's pieces as jobs, decode steps between them, one graph at a time -----------------


GENERATION = {"input_ids": CLEAN, "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}


def test_a_gradient_runs_a_piece_a_job_and_decode_steps_go_on_between(
    client: TestClient, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a generation decodes, a gradient's pass runs as one engine job a piece: each block forward, the
    LM head, each block back (the embeddings' gradient with block 0's), a decode step between every two. A
    burst of six gradient requests takes turns: one pass's jobs all run before the next's first (one graph
    alive at a time), and each answer is the one the model gives alone."""
    L = loaded.model.config.n_layer
    log = log_engine(client, monkeypatch, jobs=6 * (L + 1 + L))
    names = ["hook_embed", "blocks.*.hook_resid_post"]
    with ThreadPoolExecutor(7) as pool:
        generation = pool.submit(_post, client, "/v1/generate", GENERATION)
        wait_until(lambda: "step" in log)
        requests = [
            pool.submit(client.post, "/v1/gradients", json=grad(hooks=names, metric={"type": "logprob", "token": t}))
            for t in range(6)
        ]
        answers = [r.result(60) for r in requests]
        assert generation.result(60) == 200
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    jobs = [i for i, e in enumerate(log) if e != "step"]
    each = L + 1 + L  # the blocks forward, the head, the blocks back
    assert [log[i] for i in jobs] == [f"MetricPass.step#{n}" for n in range(6) for _ in range(each)], log
    assert_interleaved(log, jobs)
    every = ["hook_embed"] + [f"blocks.{i}.hook_resid_post" for i in range(L)]
    for t, r in enumerate(answers):
        want = gradients(loaded.model, CLEAN, LogProb(t), every)
        for name in every:
            got = tensor(r.json()["gradients"][name + "_grad"])
            torch.testing.assert_close(got, want.grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_attribution_runs_its_passes_and_each_verified_site_a_piece_a_job(
    client: TestClient, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attribution's two runs go a piece a job (the clean run forward, the corrupted run forward and back),
    then each of its `verify` patched runs, a piece a job too, with decode steps between them: a long
    attribution does not stall the running streams."""
    L = loaded.model.config.n_layer
    log = log_engine(client, monkeypatch, jobs=(L + 1 + L + 1 + L) + 4 * (L + 1))
    with ThreadPoolExecutor(2) as pool:
        generation = pool.submit(_post, client, "/v1/generate", GENERATION)
        wait_until(lambda: "step" in log)
        r = client.post("/v1/attribution", json=attr(verify=4))
        assert r.status_code == 200, r.text
        assert generation.result(60) == 200
    assert len(r.json()["verified"]) == 4
    calls = [i for i, e in enumerate(log) if e != "step"]
    verifying = [f"MetricPass.step#{n}" for n in range(1, 5) for _ in range(L + 1)]  # each block, the head
    assert [log[i] for i in calls] == ["ScoringPass.step#0"] * (L + 1 + L + 1 + L) + verifying, log
    assert_interleaved(log, calls)


def test_gradient_requests_wait_their_turn_and_beyond_the_limit_get_a_429(
    client: TestClient, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One graph alive at a time: while a gradient's pass has the turn (its first job held up on the engine),
    the next waits for it, queueing no job; one more than `--max-queue` waiting (1 here) is a 429 saying why;
    a client that leaves while it waits gets a 499 and gives its place up. Then both passes answer as alone,
    and the turn is free."""
    turn = client.app.state.graph_turn  # type: ignore[attr-defined]
    monkeypatch.setattr(turn, "max_waiting", 1)
    body = grad(hooks=["blocks.0.hook_resid_pre"])
    with ThreadPoolExecutor(2) as pool:
        with engine_held(client) as engine:
            first = pool.submit(client.post, "/v1/gradients", json=body)
            wait_until(lambda: len(engine._jobs) == 1)  # the first pass's first piece, queued
            leaving = RawRequest(client, "/v1/gradients", body)
            wait_until(lambda: turn.waiting == 1)
            assert leaving.leave() == 499
            assert turn.waiting == 0 and len(engine._jobs) == 1
            second = pool.submit(client.post, "/v1/gradients", json=body)
            wait_until(lambda: turn.waiting == 1)
            r = client.post("/v1/gradients", json=body)
            assert r.status_code == 429, r.text
            assert "1 request is waiting to build an autograd graph, one at a time" in r.json()["error"]["message"]
            assert len(engine._jobs) == 1  # none of the waiting ones queued a job
        answers = [first.result(60), second.result(60)]
    want = gradients(loaded.model, CLEAN, Loss(), ["blocks.0.hook_resid_pre"]).grads["blocks.0.hook_resid_pre"]
    for a in answers:
        assert a.status_code == 200, a.text
        got = tensor(a.json()["gradients"]["blocks.0.hook_resid_pre_grad"])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert turn.waiting == 0 and not turn._lock.locked()
    assert_still_serving(client)


def test_a_client_that_leaves_mid_pass_gives_the_turn_back(
    client: TestClient, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client leaves while its gradient's third piece (the LM head, after both blocks) runs: the answer is a
    499, the turn goes back at once (the next gradient need not wait for that piece), no piece of the pass
    runs after it, and the next request's gradients are the model's."""
    engine, turn = client.app.state.engine, client.app.state.graph_turn  # type: ignore[attr-defined]
    with nth_job_held(client, monkeypatch, 3) as (jobs, running):
        request = RawRequest(client, "/v1/gradients", grad(hooks=["blocks.0.hook_resid_pre"]))
        assert running.wait(20), f"the pass ran {len(jobs)} jobs, not 3 or more"
        assert turn._lock.locked()
        assert request.leave() == 499
        assert not turn._lock.locked() and turn.waiting == 0
    assert_still_serving(client)
    assert len(jobs) == 3 and not engine._jobs
    monkeypatch.undo()
    r = post_ok(client, "/v1/gradients", grad(hooks=["blocks.0.hook_resid_pre"]))
    want = gradients(loaded.model, CLEAN, Loss(), ["blocks.0.hook_resid_pre"]).grads["blocks.0.hook_resid_pre"]
    torch.testing.assert_close(tensor(r["gradients"]["blocks.0.hook_resid_pre_grad"]), want, rtol=1e-5, atol=1e-7)


def test_work_under_way_is_not_refused_for_a_full_queue(loaded: LoadedModel) -> None:
    """A full queue (`--max-queue` 2 here) refuses a request's first job with a 429, not a later one: a pass
    under way (a gradient's next piece, an attribution's verified sites, an analysis's highway) would lose its
    work. And at most `--max-queue` passes are under way at once; one more is a 429 before it runs anything."""
    with serve(loaded, max_queue=2) as c:
        engine = c.app.state.engine  # type: ignore[attr-defined]
        assert c.portal is not None
        with engine_held(c):
            waiting = [c.portal.start_task_soon(engine.call, lambda _: None) for _ in range(2)]
            wait_until(lambda: len(engine._jobs) == 2)
            with pytest.raises(QueueFull):
                c.portal.call(engine.call, lambda _: None)
            later = c.portal.start_task_soon(functools.partial(engine.call, lambda _: 7, continuing=True))
            wait_until(lambda: len(engine._jobs) == 3)
            r = c.post("/v1/gradients", json=grad(hooks=["blocks.0.hook_resid_pre"]))
            assert r.status_code == 429 and "model calls are waiting" in r.json()["error"]["message"], r.text
        assert later.result(10) == 7 and [w.result(10) for w in waiting] == [None, None]
        engine.passes = 2  # two passes under way
        try:
            for path in ("/v1/next-token", "/v1/analyze"):
                r = c.post(path, json={"input_ids": CLEAN})
                assert r.status_code == 429, (path, r.text)
                said = r.json()["error"]["message"]
                assert "2 model calls of many steps are under way: a new one is taken once fewer than 2" in said
        finally:
            engine.passes = 0
        post_ok(c, "/v1/gradients", grad(hooks=["blocks.0.hook_resid_pre"]))
        assert engine.passes == 0


def _post(client: TestClient, path: str, body: dict[str, Any]) -> int:
    return client.post(path, json=body).status_code
