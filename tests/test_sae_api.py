"""SAE features and steering over HTTP: /v1/features (JSON and safetensors) and /v1/steering-vectors,
steering edits on generation (plain, streamed, batched) and next-token, equal to the model-level runs;
bad input as 400s naming the field, the server serving on. In process, on the tiny random checkpoint
with the real tokenizer and two random SAEs in SAELens' format."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import Checkpoint
from fastapi.testclient import TestClient
from inprocess import log_engine
from sae_files import write_sae
from safetensors.torch import load as load_safetensors

import model.lab.sae as sae_module
from model.generate import SamplingParams, generate
from model.gpt import GPT
from model.hooks import run_with_cache
from model.interventions import Edit, EditSpec
from model.lab.sae import PART_WORK, FeatureReading, load_sae, part_positions, token_features
from model.lab.steering import contrastive_vector
from model.loading import load
from server.app import create_app
from server.settings import Settings

IDS = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
RES = "blocks.1.hook_resid_pre"
MLP = "blocks.0.hook_mlp_out"
Z = "blocks.0.attn.hook_z"


@pytest.fixture(scope="module")
def sae_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saes")
    return {
        "res1": write_sae(root / "res1", hook=RES, d_in=64, d_sae=256, seed=1),
        "mlp0": write_sae(root / "mlp0", hook=MLP, d_in=64, d_sae=128, architecture="topk", k=8, seed=2),
        "z0": write_sae(root / "z0", hook=Z, d_in=64, d_sae=64, seed=4, reshape_activations="hook_z"),
    }


@pytest.fixture(scope="module")
def client(tiny: Checkpoint, tokenizer_dir: Path, sae_dirs: dict[str, Path]) -> Iterator[TestClient]:
    settings = Settings(sae=tuple(f"{k}={v}" for k, v in sae_dirs.items()), max_steering_vectors=3)
    app = create_app(settings, loaded=load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu"))
    with TestClient(app) as c:
        yield c


def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def test_model_lists_the_saes(client: TestClient) -> None:
    info = client.get("/v1/model").json()
    saes = {s["id"]: s for s in info["saes"]}
    assert saes["res1"] | {"source": None} == {
        "id": "res1", "hook_name": RES, "architecture": "standard", "d_in": 64, "d_sae": 256, "k": None,
        "centred": False, "source": None,
    }  # fmt: skip
    assert saes["mlp0"]["architecture"] == "topk" and saes["mlp0"]["k"] == 8


def test_features_equal_the_sae_on_the_models_values(client: TestClient, tiny_model: GPT, sae_dirs) -> None:
    sae = load_sae(sae_dirs["res1"])
    x = run_with_cache(tiny_model, torch.tensor([IDS]), [RES])[RES][0]
    want = token_features(sae, x, 5, None)
    body = post(client, "/v1/features", {"input_ids": IDS, "sae": "res1", "top_k": 5})
    assert body["hook_name"] == RES and body["input_ids"] == IDS and len(body["features"]) == len(IDS)
    for got, ref in zip(body["features"], want, strict=True):
        assert [f["id"] for f in got["features"]] == [i for i, _ in ref.features]
        assert [f["value"] for f in got["features"]] == pytest.approx([v for _, v in ref.features], abs=1e-5)
        assert got["l0"] == ref.l0 and got["mse"] == pytest.approx(ref.mse, rel=1e-5)
        assert got["variance_explained"] == pytest.approx(ref.variance_explained, abs=1e-5)
    # the values of chosen features, and the same as a safetensors file
    asked = post(client, "/v1/features", {"input_ids": IDS, "sae": "res1", "features": [7, 3]})
    f = sae.encode(x)
    for t, row in enumerate(asked["features"]):
        assert [(e["id"], e["value"]) for e in row["features"]] == [
            (7, pytest.approx(float(f[t, 7]), abs=1e-5)),
            (3, pytest.approx(float(f[t, 3]), abs=1e-5)),
        ]
    r = client.post("/v1/features", json={"input_ids": IDS, "sae": "res1", "top_k": 5, "format": "safetensors"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    tensors = load_safetensors(r.content)
    for t, row in enumerate(body["features"]):
        n = len(row["features"])
        assert tensors["indices"][t, :n].tolist() == [e["id"] for e in row["features"]]
        assert tensors["values"][t, :n].tolist() == pytest.approx([e["value"] for e in row["features"]], abs=1e-6)
    assert tensors["l0"].tolist() == [row["l0"] for row in body["features"]]


def test_features_over_the_continuation_with_steering(client: TestClient, tiny_model: GPT, sae_dirs) -> None:
    """Features of prompt and generated tokens, the generation steered: as one forward pass over the final
    sequence with the same edit."""
    sae = load_sae(sae_dirs["mlp0"])
    steer = {"hook": RES, "op": "steer", "scale": 5.0, "direction": {"sae": "res1", "feature": 11}}
    body = post(
        client,
        "/v1/features",
        {"input_ids": IDS, "sae": "mlp0", "top_k": 4, "max_new_tokens": 4, "temperature": 0, "interventions": [steer]},
    )
    spec = EditSpec((Edit(RES, "steer", 5.0, direction=load_sae(sae_dirs["res1"]).direction(11)),))
    (out,) = generate(tiny_model, [IDS], greedy(4), edits=spec)
    full = IDS + out.token_ids
    assert body["input_ids"] == full[: len(body["input_ids"])] and len(body["input_ids"]) >= len(full) - 1
    n = len(body["input_ids"])
    idx = torch.tensor([full[:n]])
    x = run_with_cache(tiny_model, idx, [RES, MLP][1:], spec.hooks(tiny_model.config, n))[MLP][0]
    want = token_features(sae, x, 4, None)
    for got, ref in zip(body["features"], want, strict=True):
        assert [e["id"] for e in got["features"]] == [i for i, _ in ref.features]


def test_steered_generation_equals_the_model_level_run(client: TestClient, tiny_model: GPT, sae_dirs) -> None:
    res1 = load_sae(sae_dirs["res1"])
    steer = {"hook": RES, "op": "steer", "scale": 8.0, "direction": {"sae": "res1", "feature": 3}, "norm_match": True}
    clamp = {"hook": RES, "op": "clamp", "sae": "res1", "feature": 5, "value": 4.0, "positions": [1, 2, 9]}
    cap = {"hook": MLP, "op": "projection_cap", "value": 0.0, "direction": res1.direction(9).tolist()}
    interventions = [steer, clamp, cap]
    spec = EditSpec(
        (
            Edit(RES, "steer", 8.0, direction=res1.direction(3), norm_match=True),
            Edit(RES, "clamp", 4.0, positions=(1, 2, 9), sae=res1, feature=5),
            Edit(MLP, "projection_cap", 0.0, direction=res1.direction(9)),
        )
    )
    (want,) = generate(tiny_model, [IDS], greedy(8), edits=spec)
    (plain,) = generate(tiny_model, [IDS], greedy(8))
    assert want.token_ids != plain.token_ids
    body = {"input_ids": IDS, "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = post(client, "/v1/generate", body | {"interventions": interventions})
    assert got["choices"][0]["token_ids"] == want.token_ids
    # streamed
    with client.stream("POST", "/v1/generate", json=body | {"interventions": interventions, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["token_id"] for e in events if "token_id" in e] == want.token_ids
    # batched: two prompts in one request, and two requests at once, each equal to its solo run
    other = [464, 3290, 3332, 319]
    (want_other,) = generate(tiny_model, [other], greedy(8), edits=spec)
    both = post(client, "/v1/generate", body | {"input_ids": [IDS, other], "interventions": interventions})
    assert [c["token_ids"] for c in both["choices"]] == [want.token_ids, want_other.token_ids]
    answers: dict[int, Any] = {}

    def send(i: int, ids: list[int]) -> None:
        answers[i] = client.post("/v1/generate", json=body | {"input_ids": ids, "interventions": interventions})

    threads = [threading.Thread(target=send, args=(i, ids)) for i, ids in enumerate([IDS, other, IDS])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tokens = [answers[i].json()["choices"][0]["token_ids"] for i in range(3)]
    assert tokens == [want.token_ids, want_other.token_ids, want.token_ids]


def test_clamp_to_the_present_value_and_scale_zero_change_nothing(client: TestClient, sae_dirs) -> None:
    plain = post(client, "/v1/next-token", {"input_ids": IDS, "top_k": 5})
    zero = {"hook": RES, "op": "steer", "scale": 0.0, "direction": {"sae": "res1", "feature": 0}}
    assert post(client, "/v1/next-token", {"input_ids": IDS, "top_k": 5, "interventions": [zero]}) == plain
    last = len(IDS) - 1
    row = post(client, "/v1/features", {"input_ids": IDS, "sae": "res1", "top_k": 1})["features"][last]
    feature, value = row["features"][0]["id"], row["features"][0]["value"]
    clamp = {"hook": RES, "op": "clamp", "sae": "res1", "feature": feature, "value": value, "positions": [last]}
    same = post(client, "/v1/next-token", {"input_ids": IDS, "top_k": 5, "interventions": [clamp]})
    assert [t["id"] for t in same["top"]] == [t["id"] for t in plain["top"]]
    assert [t["logprob"] for t in same["top"]] == pytest.approx([t["logprob"] for t in plain["top"]], abs=1e-5)


def test_steering_vectors_are_measured_stored_and_used(client: TestClient, tiny_model: GPT) -> None:
    pos, neg = ["I love this", "What a joy"], ["I hate this", "What a pain", "Awful"]
    body = post(client, "/v1/steering-vectors", {"positive": pos, "negative": neg, "hook": RES, "name": "joy"})
    assert body["name"] == "joy" and "joy" in body["stored"] and len(body["vector"]) == 64
    tok = client.app.state.engine.tokenizer  # type: ignore[attr-defined]

    def mean(texts: list[str]) -> torch.Tensor:
        rows = [run_with_cache(tiny_model, torch.tensor([tok.encode(t)]), [RES])[RES][0, -1] for t in texts]
        return torch.stack(rows).mean(0)

    torch.testing.assert_close(torch.tensor(body["vector"]), mean(pos) - mean(neg), atol=1e-5, rtol=0)
    by_name = {"hook": RES, "op": "steer", "scale": 3.0, "direction": {"vector": "joy"}}
    spelled = by_name | {"direction": body["vector"]}
    a = post(client, "/v1/next-token", {"input_ids": IDS, "interventions": [by_name]})
    b = post(client, "/v1/next-token", {"input_ids": IDS, "interventions": [spelled]})
    assert a == b and a != post(client, "/v1/next-token", {"input_ids": IDS})
    assert "joy" in client.get("/v1/model").json()["steering_vectors"]
    mean_body = post(client, "/v1/steering-vectors", {"positive": pos, "negative": neg, "hook": RES, "reduce": "mean"})
    assert mean_body["name"] is None and mean_body["vector"] != body["vector"]


def test_a_steering_vector_s_norm_is_given_where_float32_s_squares_overflow(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vector of finite entries of 1e20 (an edited or very large model's stream) has a finite norm."""
    import dataclasses

    import server.routes.sae as routes

    real = routes.contrast
    monkeypatch.setattr(routes, "contrast", lambda *a: dataclasses.replace(real(*a), vector=torch.full((64,), 1e20)))
    body = post(client, "/v1/steering-vectors", {"positive": [[1, 2]], "negative": [[3]], "hook": RES})
    assert body["norm"] == pytest.approx(8e20)


def test_a_steering_vector_is_measured_a_block_a_job(
    client: TestClient, tiny_model: GPT, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each prompt of /v1/steering-vectors is a pass of its own on the engine, a job a block up to the hook
    (`blocks.1.hook_resid_pre`: the embeddings with block 0, then block 1, which stops at the hook), so
    running streams take their decode steps between them (128 long prompts in one job once held every stream
    for all of them); the vector is exactly the model-level contrastive_vector's."""
    log = log_engine(client, monkeypatch)
    pos, neg = [[1, 2, 3], [4, 5]], [[6, 7], [8], [9, 10, 11]]
    body = post(client, "/v1/steering-vectors", {"positive": pos, "negative": neg, "hook": RES, "reduce": "mean"})
    assert [e for e in log if e != "step"] == [f"CapturePass.step#{n}" for n in range(5) for _ in range(2)], log
    want = contrastive_vector(tiny_model, pos, neg, RES, "mean")
    assert torch.equal(torch.tensor(body["vector"]), want.vector)


def test_a_reading_goes_a_part_of_its_positions_a_job(
    client: TestClient, tiny_model: GPT, sae_dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/v1/features reads the SAE `part_positions` positions a job (256 for res-jb's size; 3 here: 3 jobs over
    8 tokens, after the prompt's pass through the batch), decode steps going on between them, and answers what
    one reading of every position gives. The reading's jobs are a pass's later work: counted as one under way,
    never refused for a full queue (`stepped`, begun)."""
    monkeypatch.setattr(sae_module, "part_positions", lambda sae: 3)
    log = log_engine(client, monkeypatch)
    body = post(client, "/v1/features", {"input_ids": IDS, "sae": "res1", "top_k": 4})
    assert [e for e in log if e != "step"] == ["FeatureReading.step#0"] * 3, log
    x = run_with_cache(tiny_model, torch.tensor([IDS]), [RES])[RES][0]
    want = token_features(load_sae(sae_dirs["res1"]), x, 4, None)
    for got, ref in zip(body["features"], want, strict=True):
        assert [f["id"] for f in got["features"]] == [i for i, _ in ref.features]
        assert [f["value"] for f in got["features"]] == pytest.approx([v for _, v in ref.features], abs=1e-5)
        assert got["l0"] == ref.l0 and got["mse"] == pytest.approx(ref.mse, rel=1e-5)


def test_a_reading_in_parts_is_the_whole_reading(sae_dirs) -> None:
    """`FeatureReading`: each position's reading is its own, so parts of 1, 3 or all positions give one reading's
    features, counts and errors (to float32's rounding: only the products' row counts differ)."""
    sae = load_sae(sae_dirs["mlp0"])
    x = torch.randn(10, sae.cfg.d_in, generator=torch.Generator().manual_seed(3))
    whole = token_features(sae, x, 5, None)
    for positions in (1, 3, 10):
        reading = FeatureReading(sae, x, 5, None)
        reading.positions = positions
        steps = 0
        while not reading.done:
            reading.step(None)
            steps += 1
        assert steps == -(-10 // positions)
        for got, ref in zip(reading.rows, whole, strict=True):
            assert [i for i, _ in got.features] == [i for i, _ in ref.features] and got.l0 == ref.l0
            assert [v for _, v in got.features] == pytest.approx([v for _, v in ref.features], abs=1e-5)
            assert got.mse == pytest.approx(ref.mse, rel=1e-5)


def test_a_part_is_smaller_for_a_larger_sae_and_a_reading_takes_such_parts(
    sae_dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part holds as much work as 256 positions of res-jb (d_in 768, 24,576 features): 64 positions of a 4x
    larger SAE, one at the least. A `FeatureReading` takes such parts, and gives what one reading of every
    position gives, chosen features (a NaN reading, whose top features are none) too."""
    sae = load_sae(sae_dirs["mlp0"])
    assert part_positions(sae) == PART_WORK // (sae.cfg.d_in * sae.cfg.d_sae)

    def sized(d_in: int, d_sae: int) -> Any:
        return SimpleNamespace(cfg=SimpleNamespace(d_in=d_in, d_sae=d_sae))

    assert part_positions(sized(768, 24_576)) == 256 and part_positions(sized(768, 4 * 24_576)) == 64
    assert part_positions(sized(10**9, 10**6)) == 1
    x = torch.randn(10, sae.cfg.d_in, generator=torch.Generator().manual_seed(4))
    x[7] = float("nan")
    monkeypatch.setattr(sae_module, "part_positions", lambda sae: 3)
    for top_k, ids in ((5, None), (None, [0, 3, 2])):
        reading = FeatureReading(sae, x, top_k, ids)
        assert reading.positions == 3
        while not reading.done:
            reading.step(None)
        whole, parts = token_features(sae, x, top_k, ids), reading.rows
        assert len(parts) == 10 and parts[7].l0 is None and (ids is not None or parts[7].features == [])
        for got, ref in zip(parts, whole, strict=True):
            assert [i for i, _ in got.features] == [i for i, _ in ref.features] and got.l0 == ref.l0
            assert [v for _, v in got.features] == pytest.approx([v for _, v in ref.features], abs=1e-5, nan_ok=True)


def test_a_null_top_k_is_the_default(client: TestClient) -> None:
    """`top_k: null` reads the default 10 (it was a 400), and beside `features` counts as not given."""
    base = {"input_ids": IDS, "sae": "res1"}
    default, null = post(client, "/v1/features", base), post(client, "/v1/features", base | {"top_k": None})
    assert null["features"] == default["features"] and max(len(t["features"]) for t in default["features"]) <= 10
    chosen = post(client, "/v1/features", base | {"features": [1, 2], "top_k": None})
    assert all([f["id"] for f in t["features"]] == [1, 2] for t in chosen["features"])
    body = {"max_new_tokens": 1, "input_ids": IDS, "features": {"sae": "res1", "top_k": None}}
    assert post(client, "/v1/generate", body)["choices"][0]["features"]


def test_the_store_is_bounded(client: TestClient) -> None:
    body = {"positive": [[1, 2]], "negative": [[3, 4]], "hook": RES}
    stored = set(client.get("/v1/model").json()["steering_vectors"])
    for i in range(3 - len(stored)):
        post(client, "/v1/steering-vectors", body | {"name": f"v{i}"})
    r = client.post("/v1/steering-vectors", json=body | {"name": "one-too-many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    assert "3 steering vectors are stored already" in r.json()["error"]["message"]
    post(client, "/v1/steering-vectors", body | {"name": sorted(client.get("/v1/model").json()["steering_vectors"])[0]})


BAD = {
    "unknown SAE in features": ("/v1/features", {"sae": "nope"}, "sae", "unknown SAE 'nope'; loaded SAEs: mlp0, res1"),
    "feature out of range": ("/v1/features", {"sae": "res1", "features": [256]}, "features", "out of range 0..255"),
    "top_k zero": ("/v1/features", {"sae": "res1", "top_k": 0}, "top_k", "top_k must be in 1..256"),
    "top_k beside features": (
        "/v1/features",
        {"sae": "res1", "features": [1], "top_k": 3},
        "top_k",
        "top_k and features exclude each other",
    ),
    "top_k beside features in generate": (
        "/v1/generate",
        {"max_new_tokens": 1, "features": {"sae": "res1", "features": [1], "top_k": 3}},
        "features.top_k",
        "features.top_k and features.features exclude each other",
    ),
    "unknown SAE in a direction": (
        "/v1/next-token",
        {"interventions": [{"hook": RES, "op": "steer", "scale": 1.0, "direction": {"sae": "x", "feature": 0}}]},
        "interventions",
        "interventions[0].direction: unknown SAE 'x'",
    ),
    "unknown feature in a direction": (
        "/v1/generate",
        {"interventions": [{"hook": RES, "op": "steer", "scale": 1.0, "direction": {"sae": "res1", "feature": -1}}]},
        "interventions",
        "interventions[0].direction: feature -1 of SAE 'res1' is out of range 0..255",
    ),
    "unknown vector": (
        "/v1/next-token",
        {"interventions": [{"hook": RES, "op": "steer", "scale": 1.0, "direction": {"vector": "nothing"}}]},
        "interventions",
        "interventions[0].direction: no stored steering vector 'nothing'",
    ),
    "wrong vector length": (
        "/v1/analyze",
        {"interventions": [{"hook": RES, "op": "steer", "scale": 1.0, "direction": [1.0, 2.0]}]},
        "interventions",
        "direction of shape [2] does not fit blocks.1.hook_resid_pre: give [64]",
    ),
    "non-finite scale": (
        "/v1/generate",
        {"interventions": [{"hook": RES, "op": "steer", "scale": float("inf"), "direction": [1.0] * 64}]},
        "interventions",
        "interventions[0].scale must be a finite number, got inf",
    ),
    "scale beyond float32": (
        "/v1/next-token",
        {"interventions": [{"hook": RES, "op": "steer", "scale": 1e39, "direction": [1.0] * 64}]},
        "interventions",
        "not a finite float32 number",
    ),
    "steer without scale": (
        "/v1/next-token",
        {"interventions": [{"hook": RES, "op": "steer", "direction": [1.0] * 64}]},
        "interventions",
        "interventions[0].scale must be a finite number, got None",
    ),
    "clamp at another hook": (
        "/v1/next-token",
        {"interventions": [{"hook": MLP, "op": "clamp", "sae": "res1", "feature": 0, "value": 1.0}]},
        "interventions",
        "the SAE reads blocks.1.hook_resid_pre, so clamp its feature there",
    ),
    "too many clamps of a topk SAE": (
        "/v1/generate",
        {
            "interventions": [{"hook": MLP, "op": "clamp", "sae": "mlp0", "feature": i, "value": 1.0} for i in range(9)]
            + [{"hook": RES, "op": "clamp", "sae": "res1", "feature": i, "value": 1.0} for i in range(100)]
        },
        "interventions",
        "the interventions clamp 9 features of topk SAEs; at most 8: each encodes every position",
    ),
    "clamp value not a number": (
        "/v1/next-token",
        {"interventions": [{"hook": RES, "op": "clamp", "sae": "res1", "feature": 0, "value": [1.0]}]},
        "interventions",
        "interventions[0].value must be a finite number for clamp",
    ),
    "steer on a per-head hook": (
        "/v1/next-token",
        {"interventions": [{"hook": "blocks.0.attn.hook_q", "op": "steer", "scale": 1.0, "direction": [1.0] * 16}]},
        "interventions",
        "steer applies to hooks with one vector per position",
    ),
    "contrast at a per-head hook": (
        "/v1/steering-vectors",
        {"positive": ["a"], "negative": ["b"], "hook": "blocks.0.attn.hook_q"},
        "hook",
        "not a hook with one vector per position",
    ),
    "contrast at an attention pattern": (  # its site is [head]: one dimension, but not a vector per position
        "/v1/steering-vectors",
        {"positive": ["a b c"], "negative": ["a b"], "hook": "blocks.1.attn.hook_pattern"},
        "hook",
        "not a hook with one vector per position",
    ),
    "contrast at attention scores": (
        "/v1/steering-vectors",
        {"positive": ["a b"], "negative": ["a c"], "hook": "blocks.0.attn.hook_attn_scores"},
        "hook",
        "not a hook with one vector per position",
    ),
    "contrast at a LayerNorm's scale": (
        "/v1/steering-vectors",
        {"positive": ["a b"], "negative": ["a c"], "hook": "blocks.0.ln1.hook_scale"},
        "hook",
        "not a hook with one vector per position",
    ),
    "contrast past the model's blocks": (
        "/v1/steering-vectors",
        {"positive": ["a"], "negative": ["b"], "hook": "blocks.9.hook_resid_pre"},
        "hook",
        "hook 'blocks.9.hook_resid_pre' is past this model's blocks (0..1); give one with a vector per position",
    ),
    "contrast at a glob": (
        "/v1/steering-vectors",
        {"positive": ["a"], "negative": ["b"], "hook": "blocks.*.hook_resid_pre"},
        "hook",
        "hook 'blocks.*.hook_resid_pre' is a glob: a steering vector is read at one hook point; give one",
    ),
    "contrast at no hook point": (
        "/v1/steering-vectors",
        {"positive": ["a"], "negative": ["b"], "hook": "blocks.0.hook_nope"},
        "hook",
        "hook 'blocks.0.hook_nope' is no hook point of this model; give one",
    ),
    "contrast with an empty prompt among them": (
        "/v1/steering-vectors",
        {"positive": ["a", ""], "negative": ["b"], "hook": RES},
        "positive",
        "positive[1]: the prompt is empty",
    ),
    "contrast with a prompt past the context": (
        "/v1/steering-vectors",
        {"positive": ["a"], "negative": [[1], [2] * 129], "hook": RES},
        "negative",
        "negative[1]: the prompt (129 tokens) is longer than the context",
    ),
    "contrast with no prompts": (
        "/v1/steering-vectors",
        {"positive": [], "negative": ["b"], "hook": RES},
        "positive",
        "positive must hold 1..64 prompts",
    ),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input_is_a_400_naming_the_field(client: TestClient, case: tuple[str, dict, str, str]) -> None:
    path, body, param, says = case
    base = {} if path == "/v1/steering-vectors" else {"input_ids": IDS[:4]}
    headers = {"content-type": "application/json"}  # as Python's json writes it: inf is Infinity
    r = client.post(path, content=json.dumps(base | body), headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    ok = post(client, "/v1/features", {"input_ids": IDS[:3], "sae": "res1", "top_k": 2})  # still serving
    assert len(ok["features"]) == 3


def test_a_feature_id_of_4000_digits_is_clipped_in_the_message(client: TestClient) -> None:
    """An out-of-range id is named, not echoed whole (4,000 digits were)."""
    huge = 10**4000
    steer = {"hook": RES, "op": "steer", "scale": 1.0, "direction": {"sae": "res1", "feature": huge}}
    for path, body, param in [
        ("/v1/generate", {"input_ids": IDS[:4], "interventions": [steer]}, "interventions"),
        ("/v1/generate", {"input_ids": IDS[:4], "features": {"sae": "res1", "features": [huge]}}, "features.features"),
    ]:
        r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and "out of range 0..255" in error["message"], error
        assert "1000000000" in error["message"] and len(error["message"]) < 300, error


def test_clamps_within_the_bound_apply_as_on_the_model(client: TestClient, tiny_model: GPT, sae_dirs) -> None:
    """Eight clamps of a topk SAE (each a whole encode of every position) and a hundred of a standard one (each
    a dot product and a decoder row a position): served, and what the model gives with the same edits."""
    res1, mlp0 = load_sae(sae_dirs["res1"]), load_sae(sae_dirs["mlp0"])
    wire = [{"hook": MLP, "op": "clamp", "sae": "mlp0", "feature": 3 * i, "value": 0.5} for i in range(8)]
    wire += [{"hook": RES, "op": "clamp", "sae": "res1", "feature": i, "value": 0.1} for i in range(100)]
    body = post(client, "/v1/next-token", {"input_ids": IDS, "top_k": 5, "interventions": wire})
    edits = [Edit(MLP, "clamp", 0.5, sae=mlp0, feature=3 * i) for i in range(8)]
    edits += [Edit(RES, "clamp", 0.1, sae=res1, feature=i) for i in range(100)]
    with torch.inference_mode():
        hooks = EditSpec(tuple(edits)).hooks(tiny_model.config, len(IDS))
        top = torch.log_softmax(tiny_model(torch.tensor([IDS]), hooks=hooks)[0, -1], -1).topk(5)
    assert [t["id"] for t in body["top"]] == top.indices.tolist()
    assert [t["logprob"] for t in body["top"]] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_an_sae_that_does_not_fit_the_model_ends_start_up(tiny: Checkpoint, tokenizer_dir: Path, tmp_path) -> None:
    loaded = load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu")
    from model.lab.sae import SAEError
    from server.app import load_failure

    # gpt2-serve's last line names what failed: the model loaded (it said "cannot load the model" of an SAE)
    assert load_failure(SAEError("SAE 'w' (x) reads ...")) == "cannot load an SAE: SAE 'w' (x) reads ..."
    assert load_failure(OSError("no file")) == "cannot load the model: no file"

    wide = write_sae(tmp_path / "wide", hook=RES, d_in=32, d_sae=8)
    app = create_app(Settings(sae=(f"w={wide}",)), loaded=loaded)
    with (
        pytest.raises(SAEError, match=r"reads vectors of 32, but blocks\.1\.hook_resid_pre holds \[64\]"),
        TestClient(app),
    ):
        pass
    deep = write_sae(tmp_path / "deep", hook="blocks.7.hook_resid_pre", d_in=64, d_sae=8)
    app = create_app(Settings(sae=(f"d={deep}",)), loaded=loaded)
    with pytest.raises(SAEError, match="which this model does not have"), TestClient(app):
        pass
    n_head = loaded.model.config.n_head  # a pattern's [head] a query and key: its width, but no vector a position
    pattern = write_sae(tmp_path / "pattern", hook="blocks.0.attn.hook_pattern", d_in=n_head, d_sae=8)
    app = create_app(Settings(sae=(f"p={pattern}",)), loaded=loaded)
    with pytest.raises(SAEError, match=r"reads blocks\.0\.attn\.hook_pattern, which holds no vector"), TestClient(app):
        pass
    scale = write_sae(tmp_path / "scale", hook="blocks.0.ln1.hook_scale", d_in=1, d_sae=8)  # [1] a position
    app = create_app(Settings(sae=(f"s={scale}",)), loaded=loaded)
    with pytest.raises(SAEError, match=r"reads blocks\.0\.ln1\.hook_scale, which holds no vector"), TestClient(app):
        pass
    # SAELens' attention SAEs read hook_z's heads as one vector of n_head x d_head: one of d_head is not one
    config = loaded.model.config
    per_head = write_sae(tmp_path / "z", hook="blocks.0.attn.hook_z", d_in=config.d_head, d_sae=8)
    app = create_app(Settings(sae=(f"z={per_head}",)), loaded=loaded)
    message = r"reads vectors of 16, but blocks\.0\.attn\.hook_z holds \[4, 16\] \(its heads read as one vector\)"
    with pytest.raises(SAEError, match=message), TestClient(app):
        pass
    for hook in ("blocks.0.attn.hook_q", "blocks.0.attn.hook_result"):  # per-head sites SAELens' SAEs do not read
        other = write_sae(tmp_path / hook, hook=hook, d_in=config.n_head * config.d_head, d_sae=8)
        app = create_app(Settings(sae=(f"q={other}",)), loaded=loaded)
        with pytest.raises(SAEError, match=r"a per-head value other than attn\.hook_z"), TestClient(app):
            pass
    flat = write_sae(
        tmp_path / "flat", hook=RES, d_in=64, d_sae=8, reshape_activations="hook_z"
    )  # SAELens refuses it too
    app = create_app(Settings(sae=(f"f={flat}",)), loaded=loaded)
    with (
        pytest.raises(SAEError, match=r"reshape_activations hook_z is for SAEs of attn\.hook_z, not of "),
        TestClient(app),
    ):
        pass
    odd = write_sae(tmp_path / "odd", hook=RES, d_in=64, d_sae=8, reshape_activations="heads")
    app = create_app(Settings(sae=(f"o={odd}",)), loaded=loaded)
    with pytest.raises(SAEError, match=r"reshape_activations must be none or hook_z, got 'heads'"), TestClient(app):
        pass
    plain = write_sae(tmp_path / "plain", hook=RES, d_in=64, d_sae=8, reshape_activations="none")  # the default
    with TestClient(create_app(Settings(sae=(f"p={plain}",)), loaded=loaded)) as c:
        assert c.get("/v1/model").status_code == 200


EMBED = "hook_embed"


def test_features_as_a_capture_in_generate(client: TestClient) -> None:
    """/v1/generate's `features`: every position's, as /v1/features gives them for the same run; the SAE's
    hook stays out of the dump unless asked for; streamed, in each choice's final event."""
    body = {"input_ids": IDS, "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    steer = {"hook": RES, "op": "steer", "scale": 4.0, "direction": {"sae": "res1", "feature": 2}}
    want = post(
        client,
        "/v1/features",
        {"input_ids": IDS, "sae": "mlp0", "top_k": 3, "max_new_tokens": 5, "temperature": 0, "interventions": [steer]},
    )
    spec = {"sae": "mlp0", "top_k": 3}
    got = post(
        client,
        "/v1/generate",
        # a float16 dump beside: the SAE still reads the model's own float32 values (the features are equal)
        body | {"features": spec, "interventions": [steer], "activations": {"hooks": [EMBED], "dtype": "float16"}},
    )
    (choice,) = got["choices"]
    assert choice["features"] == want["features"]
    assert len(choice["features"]) == len(want["input_ids"])
    assert want["input_ids"] == (IDS + choice["token_ids"])[: len(want["input_ids"])]
    assert list(choice["activations"]) == ["hook_embed"]
    with client.stream(
        "POST", "/v1/generate", json=body | {"features": spec, "interventions": [steer], "stream": True}
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    (final,) = [e for e in events if e.get("finish_reason")]
    assert final["features"] == want["features"] and "activations" not in final
    r = client.post("/v1/generate", json=body | {"features": {"sae": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "features.sae", r.text
    r = client.post("/v1/generate", json=body | {"features": {"sae": "res1", "top_k": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "features.top_k", r.text
    r = client.post("/v1/activations", json={"input_ids": IDS, "features": spec})
    assert r.status_code == 400 and "features" in r.json()["error"]["param"], r.text


def test_generate_reads_its_features_a_part_a_job(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """/v1/generate's `features` are read as /v1/features reads them, `part_positions` positions an engine job
    after the generation (3 here: 5 jobs over its 13 tokens a choice), streamed or not, rather than inside the
    answer's building on a worker thread, which nothing stopped when the client left (15 s of a core after it,
    at 16 prompts of 1,000 tokens and res-jb's size)."""
    monkeypatch.setattr(sae_module, "part_positions", lambda sae: 3)
    body = {"input_ids": [IDS, IDS[:5]], "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    body |= {"features": {"sae": "mlp0", "top_k": 3}}
    log = log_engine(client, monkeypatch)
    got = post(client, "/v1/generate", body)
    readings = [e for e in log if e.startswith("FeatureReading")]
    assert readings == ["FeatureReading.step#0"] * 5 + ["FeatureReading.step#1"] * 4, log
    assert [len(c["features"]) for c in got["choices"]] == [13, 10]
    log.clear()
    with client.stream("POST", "/v1/generate", json=body | {"stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finals = sorted((e for e in events if e.get("finish_reason")), key=lambda e: e["index"])
    assert [f["features"] for f in finals] == [c["features"] for c in got["choices"]]
    streamed = Counter(e for e in log if e.startswith("FeatureReading"))  # passes numbered on from the first run's
    assert sorted(streamed.values()) == [4, 5], log


def test_sae_settings(capsys) -> None:
    from server.settings import parse_settings

    assert parse_settings(["--sae", "a=./x", "--sae", "b=o/r/f@v1"], {}).sae == ("a=./x", "b=o/r/f@v1")
    assert parse_settings([], {"GPT2_SAE": "a=./x, b=./y"}).sae == ("a=./x", "b=./y")
    assert parse_settings(["--sae", "c=./z"], {"GPT2_SAE": "a=./x"}).sae == ("c=./z",)  # the flag wins
    with pytest.raises(SystemExit) as e:
        parse_settings(["--sae", "no-equals-sign"], {})
    assert e.value.code == 2 and "must be ID=PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--max-steering-vectors", "0"], {})


ROUTES_WITH_EDITS = {
    "/v1/generate": {"max_new_tokens": 2, "temperature": 0},
    "/v1/activations": {"activations": {"hooks": [RES]}},
    "/v1/next-token": {},
    "/v1/analyze": {"compare_ablated": False},
    "/v1/gradients": {"metric": {"type": "loss"}, "hooks": [RES]},
    "/v1/features": {"sae": "res1"},
}


@pytest.mark.parametrize("path", list(ROUTES_WITH_EDITS))
def test_every_route_with_interventions_takes_an_sae_feature_direction(client: TestClient, path: str) -> None:
    """A steering edit's direction may name an SAE feature on every route that takes interventions."""
    steer = {"hook": RES, "op": "steer", "scale": 2.0, "direction": {"sae": "res1", "feature": 3}}
    body = {"input_ids": IDS, "interventions": [steer], **ROUTES_WITH_EDITS[path]}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    unknown = {**steer, "direction": {"sae": "nope", "feature": 3}}
    r = client.post(path, json={**body, "interventions": [unknown]})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"], r.text


def test_features_that_are_not_finite(tiny: Checkpoint, tokenizer_dir: Path, tmp_path: Path) -> None:
    """An SAE whose normalisation divides by the activation's norm reads a zeroed vector as NaN (as SAELens
    does): JSON gives null there, as everywhere, not a 500. Edits that drive the SAE's hook itself to inf or
    NaN are a 400 naming the interventions. The server keeps serving."""
    cnr = write_sae(tmp_path / "cnr", hook=RES, d_in=64, d_sae=32, normalize_activations="constant_norm_rescale")
    settings = Settings(sae=(f"cnr={cnr}",))
    with TestClient(create_app(settings, loaded=load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu"))) as c:
        zeroed = {"input_ids": IDS[:4], "sae": "cnr", "interventions": [{"hook": RES, "op": "zero"}]}
        rows = post(c, "/v1/features", zeroed)["features"]
        assert len(rows) == 4 and all(r["mse"] is None for r in rows)
        # no count and no top features where the reading is NaN (a NaN is not > 0: it once counted as l0 0)
        assert all(r["l0"] is None and r["features"] == [] for r in rows), rows
        chosen = post(c, "/v1/features", zeroed | {"features": [0, 5]})["features"]
        assert all([f["value"] for f in r["features"]] == [None, None] and r["l0"] is None for r in chosen)
        file = c.post("/v1/features", json=zeroed | {"format": "safetensors"})
        assert file.status_code == 200 and load_safetensors(file.content)["mse"].isnan().all()
        assert load_safetensors(file.content)["l0"].tolist() == [-1] * 4
        generated = {"input_ids": IDS[:4], "max_new_tokens": 0, "features": {"sae": "cnr"}}
        choice = post(c, "/v1/generate", generated | {"interventions": [{"hook": RES, "op": "zero"}]})["choices"][0]
        assert all(r["l0"] is None for r in choice["features"]), choice["features"]
        overflow = [{"hook": "blocks.0.hook_resid_post", "op": "scale", "factor": 3e38}]
        r = c.post("/v1/features", json={"input_ids": IDS[:4], "sae": "cnr", "interventions": overflow})
        assert r.status_code == 400 and r.json()["error"]["param"] == "interventions", r.text
        assert "inf or NaN" in r.json()["error"]["message"]
        assert len(post(c, "/v1/features", {"input_ids": IDS[:4], "sae": "cnr", "top_k": 2})["features"]) == 4


def test_the_default_top_k_fits_a_small_sae(tiny: Checkpoint, tokenizer_dir: Path, tmp_path: Path) -> None:
    """top_k defaults to 10, or to the SAE's size where it has fewer features; a top_k given beyond the size
    is still a 400."""
    small = write_sae(tmp_path / "small", hook=RES, d_in=64, d_sae=4, seed=3)
    with TestClient(
        create_app(Settings(sae=(f"small={small}",)), loaded=load(tiny.path, tokenizer_dir=tokenizer_dir))
    ) as c:
        rows = post(c, "/v1/features", {"input_ids": IDS[:3], "sae": "small"})["features"]
        assert len(rows) == 3 and all(len(r["features"]) <= 4 for r in rows)
        body = {"input_ids": IDS[:3], "max_new_tokens": 1, "temperature": 0, "features": {"sae": "small"}}
        assert len(post(c, "/v1/generate", body)["choices"][0]["features"]) == 4
        r = c.post("/v1/features", json={"input_ids": IDS[:3], "sae": "small", "top_k": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text


def test_feature_readings_are_bounded_like_dumps(tiny: Checkpoint, tokenizer_dir: Path, sae_dirs) -> None:
    """A reading's size on the wire is known before the model runs (an upper bound, checked here against
    the answers themselves), and over `--max-activation-bytes` it is a 413 naming the field to shrink, on
    /v1/features and on /v1/generate's `features`; the server serves on."""
    from server.encoding import features_bytes_on_wire

    ids = list(range(256))  # every feature of res1, each valued (a list, unlike top_k, gives inactive ones too)
    limit = features_bytes_on_wire(len(IDS), len(ids), "json")
    settings = Settings(sae=(f"res1={sae_dirs['res1']}",), max_activation_bytes=limit)
    with TestClient(create_app(settings, loaded=load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu"))) as c:
        body = {"input_ids": IDS, "sae": "res1", "features": ids}
        rows = post(c, "/v1/features", body)["features"]
        assert 0.25 * limit < len(json.dumps(rows, separators=(",", ":"))) <= limit  # zeros are short
        file = load_safetensors(c.post("/v1/features", json=body | {"format": "safetensors"}).content)
        arrays = sum(t.numel() * t.element_size() for t in file.values())
        assert arrays == features_bytes_on_wire(len(IDS), len(ids), "safetensors")
        r = c.post("/v1/features", json=body | {"input_ids": [*IDS, 11]})  # one token more
        assert r.status_code == 413 and r.json()["error"]["param"] == "features", r.text
        assert f"over the server's limit of {limit}" in r.json()["error"]["message"]
        assert "format safetensors" in r.json()["error"]["message"]
        r = c.post("/v1/features", json={"input_ids": IDS, "sae": "res1", "max_new_tokens": 1, "features": ids})
        assert r.status_code == 413, r.text  # the continuation counts
        assert c.post("/v1/features", json=body | {"input_ids": [*IDS, 11], "format": "safetensors"}).status_code == 200
        gen = {"input_ids": IDS, "max_new_tokens": 1, "features": {"sae": "res1", "top_k": 256}}
        r = c.post("/v1/generate", json=gen)
        assert r.status_code == 413 and r.json()["error"]["param"] == "features.top_k", r.text
        for path, long in (("/v1/features", {"sae": "res1"}), ("/v1/generate", {"features": {"sae": "res1"}})):
            r = c.post(path, json={"prompt": "hello " * 3000, **long})  # past the context: that, not the size
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert post(c, "/v1/generate", gen | {"max_new_tokens": 0})["choices"][0]["features"]


def test_a_direction_from_hook_z_applies_at_its_own_hook_alone(client: TestClient) -> None:
    """A vector at attn.hook_z holds its layer's heads' values before that layer's output projection: as long
    as a residual stream's (n_head x d_head = d_model) but in coordinates of its own. So an attention SAE's
    decoder row or a vector measured at hook_z is refused at the residual stream and at another layer's
    hook_z (a glob reaching one too), and a residual SAE's row at hook_z (a 400 naming interventions; the
    server serves on); at their own hook they apply, and numbers given as they are apply wherever they fit."""
    body = {"positive": [[1, 2, 3]], "negative": [[4, 5]], "hook": Z, "name": "joy"}  # "joy": replaced if stored
    assert len(post(client, "/v1/steering-vectors", body)["vector"]) == 64
    refused = [
        ({"sae": "z0", "feature": 3}, RES, Z),
        ({"vector": "joy"}, RES, Z),
        ({"vector": "joy"}, "blocks.1.attn.hook_z", Z),
        ({"sae": "z0", "feature": 3}, "blocks.*.attn.hook_z", Z),
        ({"sae": "res1", "feature": 3}, "blocks.1.attn.hook_z", RES),
    ]
    for direction, hook, origin in refused:
        edit = {"hook": hook, "op": "steer", "scale": 2.0, "direction": direction}
        r = client.post("/v1/next-token", json={"input_ids": IDS[:4], "interventions": [edit]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "interventions"
        at = "blocks.1.attn.hook_z" if "*" in hook else hook
        assert f"the direction was measured at {origin}, so it does not apply at {at}" in error["message"]
    plain = post(client, "/v1/next-token", {"input_ids": IDS[:4]})
    for direction, hook in (({"sae": "z0", "feature": 3}, Z), ({"vector": "joy"}, Z),
                            ([0.5] * 64, RES), ([0.5] * 64, Z)):  # fmt: skip
        edit = {"hook": hook, "op": "steer", "scale": 4.0, "direction": direction}
        steered = post(client, "/v1/next-token", {"input_ids": IDS[:4], "interventions": [edit]})
        assert steered["top"] != plain["top"], (direction, hook)
