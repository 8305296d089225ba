"""/v1/analyze as many engine jobs: one for each block of a run's forward pass, and one for each part of a
layer's measures (its norms, effective rank, collapse and cosine, and its logit lens 256 positions a part) as
soon as the pass hands its stream over, with decode steps between them. One job once held every stream for a
whole run (24 s at 1,000 tokens on gpt2-small's shape on a CPU), and later one job held them for the whole
pass (4 s there). The answers are `analyze`'s, to the bit; an error is its error, and no job follows it; a
client that leaves stops the jobs. In process, on an 8-layer random checkpoint with the real tokenizer."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import make_checkpoint
from contract import GEN
from fastapi.testclient import TestClient
from inprocess import RawRequest, assert_still_serving, engine_held, nth_job_held, post_ok, serve, wait_until

from model.analysis import LayerMeasure, LayerStats, analyze
from model.interventions import Edit, EditSpec, NonFiniteActivations
from model.loading import LoadedModel, load
from server.engine import Engine
from server.routes.lab import layer_json

ANALYZE = "/v1/analyze"
L = 8
IDS = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
EVERY = tuple(range(L))


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LoadedModel:
    """8 layers, 2 heads, d_model 32, context 128: many layers, each cheap."""
    checkpoint = make_checkpoint(
        tmp_path_factory.mktemp("deep"), n_layer=L, n_head=2, n_embd=32, n_positions=128, seed=5
    )
    return load(checkpoint.path, tokenizer_dir=tokenizer_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def client(deep: LoadedModel) -> Iterator[TestClient]:
    with serve(deep) as c:
        yield c


def engine_of(client: TestClient) -> Engine:
    return client.app.state.engine  # type: ignore[attr-defined]


def count_jobs(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The engine's jobs from now on, as they start to run."""
    jobs: list[object] = []
    run_job = engine._run_job

    def counted(job: Any) -> None:
        jobs.append(job.fn)
        run_job(job)

    monkeypatch.setattr(engine, "_run_job", counted)
    return jobs


def as_json(stats: list[LayerStats], text: Any) -> list[dict[str, Any]]:
    """`analyze`'s layers as the route writes them."""
    return [layer_json(s, text) for s in stats]


# --- the same numbers, from a job a block and a job a part of a layer ------------------------------------


@pytest.mark.parametrize("edited", [False, True], ids=["plain", "edited"])
def test_the_jobs_give_analyze_s_numbers_to_the_bit(
    client: TestClient, deep: LoadedModel, monkeypatch: pytest.MonkeyPatch, edited: bool
) -> None:
    jobs = count_jobs(engine_of(client), monkeypatch)
    edit = {"hook": "blocks.2.hook_attn_out", "op": "scale", "factor": 3.0}
    body = post_ok(client, ANALYZE, {"input_ids": IDS, "top_k": 4} | ({"interventions": [edit]} if edited else {}))
    assert len(jobs) == 2 * (L + L + 1)  # each run: a job a block, and a job a layer's measures

    edits = (Edit("blocks.2.hook_attn_out", "scale", factor=3.0),) if edited else ()
    text = deep.tokenizer.token_text
    for side, spec in (("layers", EditSpec(edits) if edited else None), ("ablated", EditSpec(edits, EVERY, EVERY))):
        want = analyze(deep.model, IDS, 4, spec.hooks(deep.model.config, len(IDS)) if spec else None)
        assert body[side] == json.loads(json.dumps(as_json(want, text))), side  # JSON's floats round-trip


def test_a_long_layer_is_measured_in_a_job_a_part(
    client: TestClient, deep: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's logit lens goes `LayerMeasure.lens_positions` positions a job (256; 3 here, over 8 tokens: 3 jobs a
    layer, the first with the stream's own measures), and the answer is `analyze`'s to the bit."""
    monkeypatch.setattr(LayerMeasure, "lens_positions", 3)
    jobs = count_jobs(engine_of(client), monkeypatch)
    body = post_ok(client, ANALYZE, {"input_ids": IDS, "top_k": 2, "compare_ablated": False})
    assert len(jobs) == L + 3 * (L + 1)
    assert body["layers"] == json.loads(json.dumps(as_json(analyze(deep.model, IDS, 2), deep.tokenizer.token_text)))


# --- decode steps between the jobs --------------------------------------------------------------------


def test_a_stream_decodes_between_an_analysis_s_jobs(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation and an analysis queue up together; the engine's log of jobs and decode steps must show a
    step between every two of the analysis's jobs. So that the generation cannot end first (a fast model
    decodes faster than the event loop hands over jobs), each decode step waits until a job is queued or
    the analysis has its answer: the log is then the same on every run."""
    engine = engine_of(client)
    log: list[str] = []
    answered = threading.Event()
    run_job, step = engine._run_job, engine._step

    def logged_job(job: Any) -> None:
        log.append("job")
        run_job(job)

    def gated_step() -> None:
        if len(engine._batch):  # a decode step: not before the analysis's next job is queued
            deadline = time.monotonic() + 30
            while not (engine._jobs or answered.is_set()) and time.monotonic() < deadline:
                time.sleep(0.001)
            log.append("step")
        step()

    generation = {"input_ids": IDS, "max_new_tokens": 2 * L + 1 + 5, "temperature": 0, "ignore_eos": True}  # > jobs
    with ThreadPoolExecutor(2) as pool:
        with engine_held(client):
            monkeypatch.setattr(engine, "_run_job", logged_job)
            monkeypatch.setattr(engine, "_step", gated_step)
            streamed = pool.submit(client.post, GEN, json=generation)
            analysed = pool.submit(client.post, ANALYZE, json={"input_ids": IDS, "compare_ablated": False})
            wait_until(lambda: len(engine._waiting) == 1 and len(engine._jobs) == 1)
        r = analysed.result(60)
        answered.set()
        g = streamed.result(60)
    assert r.status_code == 200, r.text
    assert len(r.json()["layers"]) == L + 1
    assert g.status_code == 200 and len(g.json()["choices"][0]["token_ids"]) == generation["max_new_tokens"]

    jobs = [i for i, e in enumerate(log) if e == "job"]
    assert len(jobs) == L + L + 1, log  # a job a block, and a job a layer's measures
    between = [log[a:b].count("step") for a, b in itertools.pairwise(jobs)]
    assert between == [1] * (len(jobs) - 1), log  # the stream's step between every two


# --- errors: analyze's, and no job after them ------------------------------------------------------------

HUGE = 1e19  # position 3 times this: finite in float32, its squares (norms, LayerNorm's variance) are not
FAILS = [
    # the stream after block 2: its norms are not finite; jobs: block 0 (after the embeddings), layers -1 and
    # 0, block 1, layer 1, block 2, layer 2
    pytest.param(Edit("blocks.2.hook_resid_post", "scale", factor=HUGE, positions=(3,)), 7, id="layer-2"),
    # the MLP's own copy in block 3: every stream finite, LayerNorm blocks.3.ln2 overflows, and the pass
    # stops there; jobs: those 7, then block 3, which ends in the error (layers -1 to 2 measured before it)
    pytest.param(Edit("blocks.3.hook_mlp_in", "scale", factor=HUGE, positions=(3,)), 8, id="ln2-of-block-3"),
]


@pytest.mark.parametrize(("edit", "n_jobs"), FAILS)
def test_an_error_is_analyze_s_and_no_job_follows_it(
    client: TestClient, deep: LoadedModel, monkeypatch: pytest.MonkeyPatch, edit: Edit, n_jobs: int
) -> None:
    with pytest.raises(NonFiniteActivations) as e:
        analyze(deep.model, IDS, 5, EditSpec((edit,)).hooks(deep.model.config, len(IDS)))
    jobs = count_jobs(engine_of(client), monkeypatch)
    intervention = {"hook": edit.hook, "op": "scale", "factor": HUGE, "positions": [3]}
    r = client.post(ANALYZE, json={"input_ids": IDS, "interventions": [intervention], "compare_ablated": False})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == str(e.value) and error["param"] == "interventions", error
    assert len(jobs) == n_jobs
    assert_still_serving(client)
    assert len(jobs) == n_jobs


# --- a client that leaves stops the jobs ---------------------------------------------------------------


def test_a_client_that_leaves_stops_the_jobs(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw ASGI, so that the disconnect is exact: the client leaves while the analysis's third job (layer 0's
    measures, after block 0 and layer -1's) runs; the answer is a 499 and no job of the analysis runs after
    that one. Meanwhile the analysis counts as a pass under way (at most `--max-queue` of them), and once it
    has left, no longer."""
    engine = engine_of(client)
    with nth_job_held(client, monkeypatch, 3) as (jobs, running):
        request = RawRequest(client, ANALYZE, {"input_ids": IDS, "top_k": 2})
        assert running.wait(20), f"the analysis ran {len(jobs)} jobs, not 3 or more"
        assert engine.passes == 1
        status = request.leave()  # the handler returned without waiting for the job
    assert status == 499
    assert_still_serving(client)  # engine steps: a job queued would have run before them
    assert len(jobs) == 3 and not engine._jobs and engine.passes == 0
    post_ok(client, ANALYZE, {"input_ids": IDS[:3], "compare_ablated": False})  # still analyses


# --- analyses side by side -----------------------------------------------------------------------------

SIDE_BY_SIDE = [
    {"input_ids": IDS, "top_k": 3},
    {
        "input_ids": IDS[:5],
        "top_k": 2,
        "interventions": [{"hook": "blocks.1.hook_attn_out", "op": "scale", "factor": 5.0}],
    },
    {"input_ids": IDS, "top_k": 1, "compare_ablated": False, "gradients": True},
    {"input_ids": IDS[:6], "top_k": 4, "residual": {"attn": [0, 3], "mlp": "all"}},
]


def test_analyses_whose_jobs_interleave_answer_as_each_alone(client: TestClient) -> None:
    """Four analyses with different prompts, edits, ablations and gradients queue up together, so that their
    jobs (blocks, parts of layers, gradients) take turns on the engine: each answer is the one it gets alone,
    and nothing is left in the dump budget."""
    alone = [post_ok(client, ANALYZE, body) for body in SIDE_BY_SIDE]
    engine = engine_of(client)
    with ThreadPoolExecutor(len(SIDE_BY_SIDE)) as pool:
        with engine_held(client):
            answers = [pool.submit(client.post, ANALYZE, json=body) for body in SIDE_BY_SIDE]
            wait_until(lambda: len(engine._jobs) == len(SIDE_BY_SIDE))  # each one's first block queued
        got = [a.result(60) for a in answers]
    assert [r.status_code for r in got] == [200] * len(SIDE_BY_SIDE), [r.text for r in got]
    assert [r.json() for r in got] == alone
    metrics = client.app.state.metrics.registry  # type: ignore[attr-defined]
    wait_until(lambda: metrics.get_sample_value("gpt2_dump_bytes_in_flight") == 0)
