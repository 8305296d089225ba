"""The server-wide budget of activation dump bytes (`--max-dump-bytes-in-flight`): a dump request reserves
its dump's estimated size before any model work and holds it until its answer is sent; beyond the budget it
waits its turn (at most `--max-queue` wait, then 429), a dump larger than the whole budget is a 413 at once,
and the bytes come back however a request ends (answered, failed, its client gone, the engine stopped),
after which the server serves as before. The heap is trimmed once no dump is in flight. SAE feature
readings, gradients at hook points, analyses and steering vectors' measures hold bytes of the same budget."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from contract import ACTS, GEN, assert_error, full_capture
from fastapi.testclient import TestClient
from inprocess import RawRequest, assert_still_serving, engine_held, serve, wait_until
from sae_files import write_sae

from model.hooks import select_hooks
from model.loading import LoadedModel
from server import encoding
from server.routes import deps, lab

IDS = [464, 3797, 3332, 319, 262, 2603, 13, 198, 464, 3797]
HOOKS = ["blocks.*.hook_resid_post"]
DUMP = {"input_ids": [IDS], "activations": {"hooks": HOOKS}}
IN_FLIGHT, WAITING = "gpt2_dump_bytes_in_flight", "gpt2_dumps_waiting"


def dump_size(loaded: LoadedModel, n_tokens: int = len(IDS), wire: encoding.Wire = "safetensors") -> int:
    """The size the server reserves for a dump of HOOKS over `n_tokens` (its 413's estimate)."""
    names = select_hooks(HOOKS, loaded.model.config.n_layer)
    return encoding.dump_bytes_on_wire(loaded.model.config, names, n_tokens, "float32", wire)


def gauge(client: TestClient, name: str) -> float | None:
    value: float | None = client.app.state.metrics.registry.get_sample_value(name)  # type: ignore[attr-defined]
    return value


def assert_dump(loaded: LoadedModel, blob: bytes) -> None:
    """`blob` is the /v1/activations file of DUMP: the activations of IDS."""
    got = safetensors.torch.load(blob)
    names = select_hooks(HOOKS, loaded.model.config.n_layer)
    for name, want in full_capture(loaded, IDS, names).items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5)


def post_ok_bytes(client: TestClient, body: dict[str, Any] = DUMP) -> bytes:
    """The /v1/activations file of `body`, answered with a 200."""
    r = client.post(ACTS, json=body)
    assert r.status_code == 200, r.text
    return r.content


def test_dumps_over_the_budget_wait_their_turn(loaded: LoadedModel) -> None:
    """With room for one dump, a second waits for the first's bytes before it reaches the engine; both are
    answered, and the budget is empty afterwards."""
    size = dump_size(loaded)
    with serve(loaded, max_dump_bytes_in_flight=size) as c, ThreadPoolExecutor(2) as pool:
        with engine_held(c) as engine:
            first = pool.submit(c.post, ACTS, json=DUMP)
            wait_until(lambda: len(engine._waiting) == 1)  # its bytes reserved, its prompt in the engine's queue
            second = pool.submit(c.post, ACTS, json=DUMP)
            wait_until(lambda: gauge(c, WAITING) == 1)
            assert len(engine._waiting) == 1  # the second is not in the engine's queue
            assert gauge(c, IN_FLIGHT) == size
        for r in (first.result(30), second.result(30)):
            assert r.status_code == 200, r.text
            assert_dump(loaded, r.content)
        wait_until(lambda: gauge(c, IN_FLIGHT) == 0)
        assert gauge(c, WAITING) == 0
        metrics = c.get("/metrics").text
        assert f"{IN_FLIGHT} 0.0" in metrics and f"{WAITING} 0.0" in metrics


def test_a_dump_larger_than_the_whole_budget_is_refused_at_once(loaded: LoadedModel) -> None:
    size = dump_size(loaded)
    with serve(loaded, max_dump_bytes_in_flight=size - 1) as c:
        error = assert_error(c.post(ACTS, json=DUMP), 413, "activations")
        assert error["message"] == (
            f"the activation dump would take up to {size} bytes, more than the server holds for all dumps at once "
            f"({size - 1}, its --max-dump-bytes-in-flight): ask for fewer hooks or fewer tokens"
        )
        assert gauge(c, IN_FLIGHT) == 0 and gauge(c, WAITING) == 0
        post_ok_bytes(c, {"input_ids": [IDS[:9]], "activations": {"hooks": HOOKS}})  # a smaller one fits
        assert_still_serving(c)


def test_more_dumps_waiting_than_the_queue_takes_are_a_429(loaded: LoadedModel) -> None:
    """`--max-queue` bounds the requests waiting for room too: one more is told to retry."""
    size = dump_size(loaded)
    with serve(loaded, max_dump_bytes_in_flight=size, max_queue=2) as c, ThreadPoolExecutor(3) as pool:
        with engine_held(c) as engine:
            first = pool.submit(c.post, ACTS, json=DUMP)
            wait_until(lambda: len(engine._waiting) == 1)
            waiting = [pool.submit(c.post, ACTS, json=DUMP) for _ in range(2)]
            wait_until(lambda: gauge(c, WAITING) == 2)
            refused = c.post(ACTS, json=DUMP)
            error = assert_error(refused, 429)
            assert "2 requests are waiting for room in the server's dump budget (the limit is 2)" in error["message"]
            assert refused.headers["retry-after"] == "1"
        for r in (first.result(30), *(w.result(30) for w in waiting)):
            assert r.status_code == 200, r.text
        wait_until(lambda: gauge(c, IN_FLIGHT) == 0)


def test_the_bytes_come_back_when_the_request_fails(loaded: LoadedModel) -> None:
    """A dump that has its bytes and then fails (the engine's queue is full: 429) gives them back."""
    size = dump_size(loaded)
    budget = {"max_dump_bytes_in_flight": size, "max_queue": 1, "max_batch_size": 1}
    with serve(loaded, **budget) as c, ThreadPoolExecutor(2) as pool:
        with engine_held(c) as engine:  # the batch's free place and the queue's, taken
            plain = [pool.submit(c.post, GEN, json={"input_ids": IDS, "max_new_tokens": 2}) for _ in range(2)]
            wait_until(lambda: len(engine._waiting) == 2)
            assert_error(c.post(ACTS, json=DUMP), 429)
            wait_until(lambda: gauge(c, IN_FLIGHT) == 0)
        assert [p.result(30).status_code for p in plain] == [200, 200]
        assert_dump(loaded, post_ok_bytes(c))
        assert_still_serving(c)


def test_the_bytes_come_back_when_clients_leave(loaded: LoadedModel) -> None:
    """Raw ASGI, so that each disconnect is exact. With room for one dump: the first has it and waits in the
    engine's queue, two more wait for room. The last leaves while it waits (its turn is given up), the first
    leaves (its bytes go to the second, which reaches the engine), then the second leaves: all 499s, nothing in
    flight, and a dump of the whole budget is served afterwards."""
    size = dump_size(loaded)
    with serve(loaded, max_dump_bytes_in_flight=size) as c:
        with engine_held(c) as engine:
            first = RawRequest(c, ACTS, DUMP)
            wait_until(lambda: len(engine._waiting) == 1)
            second = RawRequest(c, ACTS, DUMP)
            wait_until(lambda: gauge(c, WAITING) == 1)
            third = RawRequest(c, ACTS, DUMP)
            wait_until(lambda: gauge(c, WAITING) == 2)
            assert third.leave() == 499
            wait_until(lambda: gauge(c, WAITING) == 1)
            assert first.leave() == 499
            wait_until(lambda: gauge(c, WAITING) == 0 and len(engine._waiting) == 1)  # the second's prompt
            assert gauge(c, IN_FLIGHT) == size
            assert second.leave() == 499
            wait_until(lambda: gauge(c, IN_FLIGHT) == 0 and not engine._waiting)
        assert_dump(loaded, post_ok_bytes(c))
        assert_still_serving(c)


def test_the_bytes_come_back_when_the_engine_stops(loaded: LoadedModel) -> None:
    """The engine stops while one dump waits in its queue and another for room: both end with a 503, and
    nothing is left in flight or waiting."""
    size = dump_size(loaded)
    with serve(loaded, max_dump_bytes_in_flight=size) as c, ThreadPoolExecutor(3) as pool:
        with engine_held(c) as engine:
            queued = pool.submit(c.post, ACTS, json=DUMP)
            wait_until(lambda: len(engine._waiting) == 1)
            waiting = pool.submit(c.post, ACTS, json=DUMP)
            wait_until(lambda: gauge(c, WAITING) == 1)
            stopping = pool.submit(engine.stop)  # the engine's thread ends once the held job returns
            wait_until(lambda: engine._stopping)
        stopping.result(30)
        for r in (queued.result(30), waiting.result(30)):
            assert_error(r, 503)
        wait_until(lambda: gauge(c, IN_FLIGHT) == 0)
        assert gauge(c, WAITING) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_holds_its_dump_until_its_answer_is_sent(loaded: LoadedModel, stream: bool) -> None:
    """/v1/generate reserves its dump's size in its format (JSON here), streamed or not, and gives it back
    once the answer is sent."""
    body = {"input_ids": IDS, "max_new_tokens": 3, "activations": {"hooks": HOOKS}, "stream": stream}
    size = dump_size(loaded, len(IDS) + 3, "json")
    with serve(loaded) as c, ThreadPoolExecutor(1) as pool:
        with engine_held(c):
            answer = pool.submit(c.post, GEN, json=body)
            wait_until(lambda: gauge(c, IN_FLIGHT) == size)
        assert answer.result(30).status_code == 200
        wait_until(lambda: gauge(c, IN_FLIGHT) == 0)


def test_the_heap_is_trimmed_once_no_dump_is_in_flight(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc keeps a freed dump's arenas: after the last dump in flight is given back the heap is trimmed
    (malloc_trim), and not after a request without a dump."""
    trims: list[None] = []
    monkeypatch.setattr(deps, "trim_heap", lambda: trims.append(None))
    with serve(loaded) as c:
        assert_still_serving(c)
        assert trims == []
        post_ok_bytes(c)
        wait_until(lambda: len(trims) == 1)


def two_in_turn(client: TestClient, path: str, body: dict[str, Any], queue: str, size: int) -> list[Any]:
    """With room for one: the first request reserves `size` and reaches the engine's queue (`queue`: `_waiting`
    for sequences, `_jobs` for jobs), the second waits for room meanwhile; both are answered with a 200 and
    the budget is empty afterwards. The answers."""
    with ThreadPoolExecutor(2) as pool:
        with engine_held(client) as engine:
            first = pool.submit(client.post, path, json=body)
            wait_until(lambda: len(getattr(engine, queue)) == 1)  # its bytes reserved, its work queued
            assert gauge(client, IN_FLIGHT) == size
            second = pool.submit(client.post, path, json=body)
            wait_until(lambda: gauge(client, WAITING) == 1)
            assert len(getattr(engine, queue)) == 1  # the second is not in the engine's queue
        answers = [r.result(30) for r in (first, second)]
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    wait_until(lambda: gauge(client, IN_FLIGHT) == 0)
    return answers


def over_the_budget(what: str, size: int, limit: int, smaller: str) -> str:
    """The 413 of a request that would hold `size` bytes, over the whole budget `limit`."""
    return (
        f"{what} would take up to {size} bytes, more than the server holds for all dumps at once ({limit}, its "
        f"--max-dump-bytes-in-flight): ask for {smaller}"
    )


def test_an_analysis_holds_what_it_keeps_against_the_budget(loaded: LoadedModel) -> None:
    """/v1/analyze holds residual streams between its jobs and builds an answer up to --max-activation-bytes,
    and the engine runs jobs first come first served: concurrent analyses would all hold theirs at once. They
    reserve them like a dump (`held_bytes`: the streams, and the answer's size, about, at most the limit): a
    second waits its turn, and one over the whole budget is a 413 naming top_k (at top_k 1, the prompt)."""
    config, limit = loaded.model.config, 256 * 2**20
    size = lab.held_bytes(config, len(IDS), 1, 2, torch.float32, limit)
    streams = 3 * len(IDS) * config.n_embd * 4  # float32
    per_layer = encoding.LAYER_JSON_BYTES + config.n_head * encoding.HEAD_JSON_BYTES
    per_layer += len(IDS) * (encoding.POSITION_JSON_BYTES + encoding.LENS_ENTRY_JSON_BYTES)
    assert size == streams + len(IDS) * encoding.TOKEN_JSON_BYTES + 2 * (config.n_layer + 1) * per_layer
    bf16 = lab.held_bytes(config, len(IDS), 1, 2, torch.bfloat16, limit)
    assert bf16 == size - streams // 2 + len(IDS) * config.n_embd * 4  # and a float32 copy of one stream
    assert lab.held_bytes(config, len(IDS), 1, 2, torch.float32, 1000) == streams + 1000  # the answer's limit
    body = {"input_ids": IDS, "top_k": 1}
    with serve(loaded, max_dump_bytes_in_flight=size) as c:
        answers = two_in_turn(c, "/v1/analyze", body, "_jobs", size)  # queued: its first block
        assert answers[0].json() == answers[1].json()
        assert len(answers[0].content) < size - streams  # the estimate is not below this answer (an estimate)
    with serve(loaded, max_dump_bytes_in_flight=size - 1) as c:
        error = assert_error(c.post("/v1/analyze", json=body), 413, "input_ids")
        smaller = "a shorter prompt, or compare_ablated false"  # which the last request below shows fits
        assert error["message"] == over_the_budget("the analysis", size, size - 1, smaller)
        wider = lab.held_bytes(config, len(IDS), 3, 1, torch.float32, limit)
        error = assert_error(c.post("/v1/analyze", json=body | {"top_k": 3, "compare_ablated": False}), 413, "top_k")
        assert f"would take up to {wider} bytes" in error["message"] and "a smaller top_k" in error["message"]
        assert c.post("/v1/analyze", json=body | {"compare_ablated": False}).status_code == 200  # one run fits
        assert_still_serving(c)


GRADIENTS = {"input_ids": IDS, "metric": {"type": "loss"}, "hooks": HOOKS, "format": "safetensors"}


def test_gradients_hold_their_answer_against_the_budget(loaded: LoadedModel) -> None:
    """/v1/gradients' answer holds activation-shaped values, as a dump does: it reserves its size (the same
    estimate as its 413's) before its job reaches the engine, a second waits its turn, and one over the whole
    budget is a 413 naming `hooks`."""
    size = dump_size(loaded)  # the same tensors' shapes and format as DUMP's
    with serve(loaded, max_dump_bytes_in_flight=size) as c:
        answers = two_in_turn(c, "/v1/gradients", GRADIENTS, "_jobs", size)
        got = [safetensors.torch.load(r.content) for r in answers]
        assert got[0].keys() == got[1].keys() and all(torch.equal(got[0][k], got[1][k]) for k in got[0])
    with serve(loaded, max_dump_bytes_in_flight=size - 1) as c:
        error = assert_error(c.post("/v1/gradients", json=GRADIENTS), 413, "hooks")
        assert error["message"] == over_the_budget("the gradients", size, size - 1, "fewer hooks or fewer tokens")
        assert gauge(c, IN_FLIGHT) == 0
        assert_still_serving(c)


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory: pytest.TempPathFactory, loaded: LoadedModel) -> Path:
    hook = "blocks.1.hook_resid_pre"
    return write_sae(tmp_path_factory.mktemp("sae"), hook=hook, d_in=loaded.model.config.n_embd, d_sae=128, seed=3)


def test_sae_features_hold_their_answer_against_the_budget(loaded: LoadedModel, sae_dir: Path) -> None:
    """/v1/features reserves its reading's size as sent (its 413's estimate) and its hook's capture (float32
    [T, d_in]) before the model runs, a second reading waits its turn, and one over the whole budget is a 413
    naming the field that chose the features."""
    body = {"input_ids": IDS, "sae": "s", "top_k": 5}
    size = encoding.features_bytes_on_wire(len(IDS), 5, "json") + len(IDS) * loaded.model.config.n_embd * 4
    with serve(loaded, sae=(f"s={sae_dir}",), max_dump_bytes_in_flight=size) as c:
        answers = two_in_turn(c, "/v1/features", body, "_waiting", size)
        assert answers[0].json() == answers[1].json()
    with serve(loaded, sae=(f"s={sae_dir}",), max_dump_bytes_in_flight=size - 1) as c:
        error = assert_error(c.post("/v1/features", json=body), 413, "top_k")
        assert error["message"] == over_the_budget("the SAE features", size, size - 1, "fewer features or fewer tokens")
        assert_still_serving(c)


def test_a_generation_holds_its_dump_and_its_features_together(loaded: LoadedModel, sae_dir: Path) -> None:
    """/v1/generate with both a dump and SAE features reserves the two sizes at once (two reservations could
    each fit and their sum not, and wait forever): the sum is held while it runs, and a sum over the whole
    budget is a 413 naming `activations`, though each part alone would fit; features alone name their field."""
    n_tokens = len(IDS) + 3
    dump = dump_size(loaded, n_tokens, "json")
    features = encoding.features_bytes_on_wire(n_tokens, 4, "json") + n_tokens * loaded.model.config.n_embd * 4
    base = {"input_ids": IDS, "max_new_tokens": 3, "features": {"sae": "s", "top_k": 4}}
    both = base | {"activations": {"hooks": HOOKS}}
    with serve(loaded, sae=(f"s={sae_dir}",), max_dump_bytes_in_flight=dump + features) as c:
        with ThreadPoolExecutor(1) as pool, engine_held(c):
            answer = pool.submit(c.post, GEN, json=both)
            wait_until(lambda: gauge(c, IN_FLIGHT) == dump + features)
        assert answer.result(30).status_code == 200
        wait_until(lambda: gauge(c, IN_FLIGHT) == 0)
    limit = max(dump, features)
    with serve(loaded, sae=(f"s={sae_dir}",), max_dump_bytes_in_flight=limit) as c:
        error = assert_error(c.post(GEN, json=both), 413, "activations")
        what, smaller = "the activation dump and the SAE features", "fewer hooks, features or tokens"
        assert error["message"] == over_the_budget(what, dump + features, limit, smaller)
        assert c.post(GEN, json=base).status_code == 200  # features alone fit
        assert gauge(c, IN_FLIGHT) == 0
    with serve(loaded, sae=(f"s={sae_dir}",), max_dump_bytes_in_flight=features - 1) as c:
        assert_error(c.post(GEN, json=base), 413, "features.top_k")
        assert_still_serving(c)


def test_the_413_advice_fits_the_request(loaded: LoadedModel) -> None:
    """Over `--max-activation-bytes`, the 413 suggests only what would make the dump smaller: float16 where it
    is float32, fewer prompts for a batch, safetensors_base64 for JSON."""
    size = dump_size(loaded, wire="safetensors")
    with serve(loaded, max_activation_bytes=size // 4) as c:
        error = assert_error(c.post(ACTS, json=DUMP), 413, "activations")
        assert error["message"].endswith("ask for fewer hooks, fewer tokens or dtype float16 (half the bytes)")
        batch = {"input_ids": [IDS, IDS], "activations": {"hooks": HOOKS, "dtype": "float16"}}
        error = assert_error(c.post(ACTS, json=batch), 413, "activations")
        assert error["message"].endswith("ask for fewer hooks, fewer tokens or fewer prompts")
        body = {"input_ids": IDS, "max_new_tokens": 0, "activations": {"hooks": HOOKS, "dtype": "bfloat16"}}
        error = assert_error(c.post("/v1/generate", json=body), 413, "activations")
        assert error["message"].endswith(
            "ask for fewer hooks, fewer tokens or format safetensors_base64 (about a quarter of JSON's size)"
        )
        assert_still_serving(c)


def test_a_steering_vector_holds_its_prompts_values_against_the_budget(loaded: LoadedModel) -> None:
    """/v1/steering-vectors holds a prompt's values at its hook from its pass to their reduction, other
    requests' jobs running between: it reserves the longest prompt's (float32 [T, width]) before its passes, a
    second waits its turn, and over --max-activation-bytes it is a 413 naming the hook where the hook is wide
    (logits: the vocabulary's width, 200 MB at 1,000 tokens of gpt2), else the side of the longest prompt."""
    config = loaded.model.config
    body = {"positive": [IDS], "negative": [IDS[:4]], "hook": "logits"}
    size = len(IDS) * config.vocab_size * 4
    with serve(loaded, max_dump_bytes_in_flight=size) as c:
        answers = two_in_turn(c, "/v1/steering-vectors", body, "_jobs", size)
        assert answers[0].json()["vector"] == answers[1].json()["vector"]
    narrow = {"positive": [IDS[:3]], "negative": [IDS], "hook": "blocks.0.hook_resid_post"}
    with serve(loaded, max_activation_bytes=size - 1) as c:
        error = assert_error(c.post("/v1/steering-vectors", json=body), 413, "hook")
        assert error["message"] == (
            f"the values at logits over the longest prompt would take {size} bytes while they are measured, over "
            f"the server's limit of {size - 1}: ask for shorter prompts or a hook of d_model values a position"
        )
        assert c.post("/v1/steering-vectors", json=narrow).status_code == 200
        assert gauge(c, IN_FLIGHT) == 0
    with serve(loaded, max_activation_bytes=len(IDS) * config.n_embd * 4 - 1) as c:
        error = assert_error(c.post("/v1/steering-vectors", json=narrow), 413, "negative")
        assert error["message"].endswith("ask for shorter prompts")
        assert_still_serving(c)
