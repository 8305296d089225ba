"""The lab over HTTP: interventions and residual ablation on /v1/next-token, /v1/generate and
/v1/activations (patching with a dump the client sends back), bad edits as 400s that say why, and the
shape of /v1/analyze. In process, on the tiny random checkpoint with the real tokenizer."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Checkpoint
from fastapi.testclient import TestClient
from inprocess import assert_interleaved, assert_still_serving, log_engine, post_ok, wait_until
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from model.analysis import analyze
from model.generate import SamplingParams, generate
from model.gpt import GPT
from model.interventions import Edit, EditSpec
from model.loading import load
from server.app import create_app
from server.settings import Settings

CLEAN = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
CORRUPTED = [464, 3290, 3332, 319, 262, 2603, 780, 340]  # "The dog sat on the mat because it"
T = len(CLEAN)


@pytest.fixture(scope="module")
def client(tiny: Checkpoint, tokenizer_dir: Path) -> Iterator[TestClient]:
    app = create_app(Settings(), loaded=load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu"))
    with TestClient(app) as c:
        yield c


def next_token(client: TestClient, ids: list[int], **edits: Any) -> dict[str, Any]:
    r = client.post("/v1/next-token", json={"input_ids": ids, "top_k": 5, **edits})
    assert r.status_code == 200, r.text
    return r.json()


def dump(client: TestClient, ids: list[int], hooks: list[str], **edits: Any) -> bytes:
    r = client.post("/v1/activations", json={"input_ids": ids, "activations": {"hooks": hooks}, **edits})
    assert r.status_code == 200, r.text
    return r.content


def logits(client: TestClient, ids: list[int], **edits: Any) -> torch.Tensor:
    return load_safetensors(dump(client, ids, ["logits"], **edits))["logits"][0]  # [T, vocab]


@pytest.mark.parametrize(
    "edits",
    [[], [{"hook": "ln_final.hook_normalized", "op": "scale", "factor": 2.0, "positions": [3]}]],
    ids=["plain", "edited-in-the-head"],
)
def test_next_token_runs_a_block_a_job_with_decode_steps_between(
    client: TestClient, tiny_model: GPT, monkeypatch: pytest.MonkeyPatch, edits: list[dict[str, Any]]
) -> None:
    """While a generation decodes, /v1/next-token runs as one engine job a block (the first with the
    embeddings) and one for the LM head, a decode step between every two; its answer is `GPT.forward`'s to
    the bit (an edit in the head: every position goes through it, as there)."""
    L = tiny_model.config.n_layer
    log = log_engine(client, monkeypatch, jobs=L + 1)
    generation = {"input_ids": CLEAN, "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(client.post, "/v1/generate", json=generation)
        wait_until(lambda: "step" in log)
        body = next_token(client, CLEAN, interventions=edits)
        assert streamed.result(60).status_code == 200
    jobs = [i for i, e in enumerate(log) if e != "step"]
    assert [log[i] for i in jobs] == ["NextTokenPass.step#0"] * (L + 1), log
    assert_interleaved(log, jobs)
    spec = EditSpec(tuple(Edit(e["hook"], "scale", factor=e["factor"], positions=tuple(e["positions"])) for e in edits))
    with torch.inference_mode():
        hooks = spec.hooks(tiny_model.config, T) if edits else None
        logprobs = torch.log_softmax(tiny_model(torch.tensor([CLEAN]), hooks=hooks, last_only=True)[0, -1].float(), -1)
    top = logprobs.topk(5)
    assert [t["id"] for t in body["top"]] == top.indices.tolist()
    assert [t["logprob"] for t in body["top"]] == top.values.tolist()


@pytest.mark.parametrize(
    "edit, head_jobs",
    [
        ({"hook": "logits", "op": "scale", "factor": 3.0, "positions": [3, 7]}, 3),  # 3 + 3 + 2 positions
        ({"hook": "unembed.hook_out", "op": "scale", "factor": 0.5}, 3),  # every position, in each part
        ({"hook": "logits", "op": "mean"}, 1),  # a mean over the prompt needs every position at once
        ({"hook": "ln_final.hook_normalized", "op": "scale", "factor": 3.0, "positions": [3, 7]}, 1),
        ({"hook": "unembed.hook_in", "op": "mean"}, 1),
    ],
    ids=["logits-positions", "logits-everywhere", "logits-mean", "ln_final", "unembed-in-mean"],
)
def test_an_edit_in_the_head_runs_it_a_part_a_job(
    client: TestClient, tiny_model: GPT, monkeypatch: pytest.MonkeyPatch, edit: dict[str, Any], head_jobs: int
) -> None:
    """An edit of the LM head's output runs the head over every position (1.0-1.7 s at 1,024 tokens of
    gpt2-small in one job, every stream held): `HEAD_POSITIONS` a job, in order, as the edit sees a prompt's
    chunks, all in one job for a `mean`; an edit before the head's product (ln_final, unembed.hook_in) runs
    ln_f over every position and the product at the last only, in one job. The answer is `GPT.forward`'s with
    the same edit."""
    import model.hooks

    monkeypatch.setattr(model.hooks, "HEAD_POSITIONS", 3)
    log = log_engine(client, monkeypatch)
    body = next_token(client, CLEAN, interventions=[edit])
    assert log == ["NextTokenPass.step#0"] * (tiny_model.config.n_layer + head_jobs), log
    spec = EditSpec((Edit(**{**edit, "positions": tuple(edit.get("positions", range(T)))}),))
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([CLEAN]), hooks=spec.hooks(tiny_model.config, T))  # every position
    top = torch.log_softmax(logits[0, -1].float(), -1).topk(5)
    assert [t["id"] for t in body["top"]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([t["logprob"] for t in body["top"]]), top.values, rtol=1e-6, atol=1e-6)


def test_an_edit_after_the_last_block_is_refused_by_analyze_unless_it_changes_the_highway(client: TestClient) -> None:
    """The logit lens reads every layer's stream through ln_f and the unembedding as trained (TransformerLens'
    logit lens), so an edit of ln_final, unembed or the logits changed nothing /v1/analyze gave back: a 400
    that says so; with gradients it changes the highway's loss, and is taken."""
    body = {"input_ids": CLEAN, "top_k": 2, "compare_ablated": False}
    for hook in ("logits", "ln_final.hook_normalized", "unembed.*"):
        edit = {"interventions": [{"hook": "hook_embed", "op": "scale", "factor": 1.0}, {"hook": hook, "op": "zero"}]}
        r = client.post("/v1/analyze", json=body | edit)
        assert r.status_code == 400 and r.json()["error"]["param"] == "interventions", r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"interventions[1] ({hook!r}) applies only after the last block, which changes")
    # a glob that also matches hook points in the blocks changes what it measures: taken
    glob = {"interventions": [{"hook": "*hook_normalized", "op": "scale", "factor": 0.5}]}
    assert client.post("/v1/analyze", json=body | glob).status_code == 200
    plain = client.post("/v1/analyze", json=body | {"gradients": True}).json()["layers"]
    edit = {"interventions": [{"hook": "logits", "op": "scale", "factor": 0.0}], "gradients": True}
    r = client.post("/v1/analyze", json=body | edit)
    assert r.status_code == 200, r.text
    edited = r.json()["layers"]
    assert [x["logit_lens"] for x in edited] == [x["logit_lens"] for x in plain]
    assert all(x["grad_norm"] == 0 for x in edited) and any(x["grad_norm"] > 0 for x in plain)


# --- interventions take effect, as at model level -----------------------------------------------------


def test_next_token_with_edits_equals_the_model_with_the_same_edits(client: TestClient, tiny_model: GPT) -> None:
    body = next_token(client, CLEAN, interventions=[{"hook": "blocks.0.hook_attn_out", "op": "zero"}])
    spec = EditSpec((Edit("blocks.0.hook_attn_out", "zero"),))
    with torch.inference_mode():
        expected = torch.log_softmax(
            tiny_model(torch.tensor([CLEAN]), hooks=spec.hooks(tiny_model.config, T))[0, -1], -1
        )
    top = expected.topk(5)
    assert [t["id"] for t in body["top"]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([t["logprob"] for t in body["top"]]), top.values, rtol=1e-5, atol=1e-5)
    assert body["top"] != next_token(client, CLEAN)["top"]


def test_activations_with_edits_and_ablation(client: TestClient) -> None:
    v = [0.5] * 64
    edits = {
        "interventions": [{"hook": "blocks.1.hook_mlp_out", "op": "add", "value": v, "positions": [2]}],
        "residual": {"attn": [0]},
    }
    names = ["blocks.0.hook_attn_out", "blocks.0.hook_resid_mid", "blocks.1.hook_mlp_out", "blocks.1.hook_resid_post"]
    acts = load_safetensors(dump(client, CLEAN, names, **edits))
    plain = load_safetensors(dump(client, CLEAN, names))
    assert torch.equal(acts["blocks.0.hook_resid_mid"], acts["blocks.0.hook_attn_out"])  # no skip at layer 0
    assert not torch.equal(plain["blocks.0.hook_resid_mid"], plain["blocks.0.hook_attn_out"])
    without_add = load_safetensors(dump(client, CLEAN, ["blocks.1.hook_mlp_out"], residual=edits["residual"]))
    added = acts["blocks.1.hook_mlp_out"][0] - without_add["blocks.1.hook_mlp_out"][0]  # [T, C]
    torch.testing.assert_close(added[2], torch.full((64,), 0.5))  # the add landed at position 2 only
    assert torch.equal(added[[0, 1, 3, 4, 5, 6, 7]], torch.zeros(T - 1, 64))


def test_generate_with_edits_equals_model_level_generation(client: TestClient, tiny_model: GPT) -> None:
    interventions = [{"hook": "blocks.*.attn.hook_z", "op": "scale", "factor": -1.0, "heads": [0, 3]}]
    body = {"input_ids": CLEAN, "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/generate", json=body | {"interventions": interventions, "residual": {"mlp": "all"}})
    assert r.status_code == 200, r.text
    spec = EditSpec((Edit("blocks.*.attn.hook_z", "scale", factor=-1.0, heads=(0, 3)),), (), (0, 1))
    (c,) = generate(tiny_model, [CLEAN], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True), edits=spec)
    assert r.json()["choices"][0]["token_ids"] == c.token_ids


def test_generate_streams_with_edits(client: TestClient) -> None:
    body = {"input_ids": CLEAN, "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "residual": {"attn": "all"}}
    whole = client.post("/v1/generate", json=body).json()["choices"][0]["token_ids"]
    with client.stream("POST", "/v1/generate", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [e["token_id"] for e in events if "token_id" in e]
    assert streamed == whole


# --- patching a clean run's activation into a corrupted run --------------------------------------------


@pytest.mark.parametrize("layer", [0, 1])
def test_patching_a_clean_dump_restores_the_clean_logits(client: TestClient, layer: int) -> None:
    hook = f"blocks.{layer}.hook_resid_post"
    clean_dump = dump(client, CLEAN, [hook, "logits"])
    clean_logits = load_safetensors(clean_dump)["logits"][0]
    corrupted_logits = logits(client, CORRUPTED)
    assert not torch.allclose(corrupted_logits, clean_logits)

    value = {"safetensors_base64": base64.b64encode(clean_dump).decode()}
    patched = logits(client, CORRUPTED, interventions=[{"hook": hook, "op": "set", "value": value}])
    torch.testing.assert_close(patched, clean_logits, rtol=0, atol=0)  # float32 dumps: exact


def test_patching_the_last_position_at_the_last_layer_restores_the_prediction(client: TestClient) -> None:
    value = {"safetensors_base64": base64.b64encode(dump(client, CLEAN, ["blocks.1.hook_resid_post"])).decode()}
    patch = {"hook": "blocks.1.hook_resid_post", "op": "set", "positions": [T - 1], "value": value}
    assert next_token(client, CORRUPTED)["top"] != next_token(client, CLEAN)["top"]
    assert next_token(client, CORRUPTED, interventions=[patch])["top"] == next_token(client, CLEAN)["top"]


def test_a_dump_in_lines_of_base64_is_read(client: TestClient) -> None:
    """base64 as the `base64` tool writes it, in lines of 76 characters, is the same dump."""
    hook = "blocks.1.hook_resid_post"
    clean_dump = dump(client, CLEAN, [hook, "logits"])
    flat = base64.b64encode(clean_dump).decode()
    lines = "\n".join(flat[i : i + 76] for i in range(0, len(flat), 76)) + "\n"
    patched = logits(
        client, CORRUPTED, interventions=[{"hook": hook, "op": "set", "value": {"safetensors_base64": lines}}]
    )
    torch.testing.assert_close(patched, load_safetensors(clean_dump)["logits"][0], rtol=0, atol=0)


def test_a_dump_tensor_is_chosen_by_name(client: TestClient) -> None:
    """The stream entering block 1 is the one leaving block 0: patching it with the clean dump's
    `blocks.0.hook_resid_post`, named, restores the clean logits."""
    clean_dump = dump(client, CLEAN, ["blocks.0.hook_resid_post", "logits"])
    value = {"safetensors_base64": base64.b64encode(clean_dump).decode(), "name": "blocks.0.hook_resid_post"}
    patch = {"hook": "blocks.1.hook_resid_pre", "op": "set", "value": value}
    patched = logits(client, CORRUPTED, interventions=[patch])
    torch.testing.assert_close(patched, load_safetensors(clean_dump)["logits"][0], rtol=0, atol=0)


# --- bad edits: 400s that say why ---------------------------------------------------------------------

NOT_SAFETENSORS = base64.b64encode(b"hello, not a safetensors file").decode()
INT_DUMP = base64.b64encode(save_safetensors({"hook_embed": torch.ones(3, 64, dtype=torch.int64)})).decode()
BOOL_DUMP = base64.b64encode(save_safetensors({"hook_embed": torch.ones(3, 64, dtype=torch.bool)})).decode()
# more dimensions than torch reduces (64): a 500 once, where the value's finiteness was checked
DEEP_DUMP = base64.b64encode(save_safetensors({"hook_embed": torch.ones([1] * 99 + [2], dtype=torch.float16)})).decode()


def nested(depth: int, inner: Any = 1.0) -> Any:
    """`inner` inside `depth` lists."""
    for _ in range(depth):
        inner = [inner]
    return inner


BAD_EDITS: dict[str, tuple[dict[str, Any], str]] = {
    "unknown hook": (
        {"interventions": [{"hook": "blocks.0.hook_nope", "op": "zero"}]},
        "interventions[0] ('blocks.0.hook_nope') matches no hook point; valid names are",
    ),
    "unknown op": ({"interventions": [{"hook": "hook_embed", "op": "divide"}]}, "interventions[0].op"),
    "wrong shape": (
        {"interventions": [{"hook": "blocks.0.hook_resid_post", "op": "add", "value": [1.0, 2.0, 3.0]}]},
        "value of shape [3] does not fit blocks.0.hook_resid_post: give [64]",
    ),
    "a value 65 lists deep": (
        {"interventions": [{"hook": "blocks.0.hook_resid_post", "op": "add", "value": nested(65)}]},
        "value of shape [1, 1, 1,",
    ),
    "a value 128 lists deep, one number beyond float32": (
        {"interventions": [{"hook": "blocks.0.hook_resid_post", "op": "add", "value": nested(128, 1e39)}]},
        "value holds numbers that are not finite in float32",
    ),
    "a value 129 lists deep": (
        {"interventions": [{"hook": "blocks.0.hook_resid_post", "op": "add", "value": nested(129)}]},
        "not a rectangular array of numbers",
    ),
    "a dump of 100 dimensions": (
        {"interventions": [{"hook": "hook_embed", "op": "set", "value": {"safetensors_base64": DEEP_DUMP}}]},
        "value of shape [1, 1, 1,",
    ),
    "ragged value": (
        {"interventions": [{"hook": "blocks.0.hook_resid_post", "op": "set", "value": [[1.0, 2.0], [3.0]]}]},
        "not a rectangular array of numbers",
    ),
    "head out of range": (
        {"interventions": [{"hook": "blocks.0.attn.hook_z", "op": "zero", "heads": [4]}]},
        "head 4 is out of range 0..3",
    ),
    "position out of range": (
        {"interventions": [{"hook": "blocks.0.hook_attn_out", "op": "zero", "positions": [99]}]},
        "position 99 is out of range",
    ),
    "a position named twice": (
        {"interventions": [{"hook": "logits", "op": "scale", "factor": 1.0, "positions": [1] * 5000}]},
        "position 1 is named twice",
    ),
    "a head named twice": (
        {"interventions": [{"hook": "blocks.0.attn.hook_pattern", "op": "zero", "heads": [0] * 2000}]},
        "head 0 is named twice",
    ),
    "layer out of range": (
        {"interventions": [{"hook": "blocks.*.hook_attn_out", "op": "zero", "layers": [2]}]},
        "layer 2 is out of range 0..1",
    ),
    "scale without factor": (
        {"interventions": [{"hook": "blocks.0.hook_attn_out", "op": "scale"}]},
        "scale needs a factor",
    ),
    "set without value": ({"interventions": [{"hook": "blocks.0.hook_attn_out", "op": "set"}]}, "set needs a value"),
    "heads on a whole-stream hook": (
        {"interventions": [{"hook": "blocks.0.hook_resid_pre", "op": "zero", "heads": [0]}]},
        "heads apply only to per-head hooks",
    ),
    "mean of a pattern": (
        {"interventions": [{"hook": "blocks.0.attn.hook_pattern", "op": "mean"}]},
        "mean is not supported on attention scores or patterns",
    ),
    "non-base64 dump": (
        {"interventions": [{"hook": "hook_embed", "op": "set", "value": {"safetensors_base64": "not base64!"}}]},
        "interventions[0]: value for 'hook_embed': the dump is not base64 of a safetensors file",
    ),
    "base64 of something else": (
        {"interventions": [{"hook": "hook_embed", "op": "set", "value": {"safetensors_base64": NOT_SAFETENSORS}}]},
        "the dump is not base64 of a safetensors file",
    ),
    "a dump of integers": (
        {"interventions": [{"hook": "hook_embed", "op": "set", "value": {"safetensors_base64": INT_DUMP}}]},
        "interventions[0]: value for 'hook_embed': tensor 'hook_embed' of the dump is int64, not floating point",
    ),
    "a dump of booleans": (
        {"interventions": [{"hook": "hook_embed", "op": "set", "value": {"safetensors_base64": BOOL_DUMP}}]},
        "tensor 'hook_embed' of the dump is bool, not floating point",
    ),
    "factor beyond float32": (
        {"interventions": [{"hook": "blocks.0.hook_attn_out", "op": "scale", "factor": 1e39}]},
        "factor 1e+39 is not a finite float32 number",
    ),
    "value beyond float32": (
        {"interventions": [{"hook": "blocks.0.hook_attn_out", "op": "add", "value": [1e39] * 64}]},
        "value holds numbers that are not finite in float32",
    ),
    "value beyond float64": (
        {"interventions": [{"hook": "blocks.0.hook_attn_out", "op": "add", "value": [10**400]}]},
        "holds a number not finite in float32",
    ),
    "residual layer out of range": ({"residual": {"attn": [5]}}, "residual.attn: layer 5 is out of range 0..1"),
    "residual neither list nor all": ({"residual": {"mlp": "some"}}, "residual.mlp"),
}
ROUTES = {
    "/v1/next-token": {},
    "/v1/generate": {"max_new_tokens": 2},
    "/v1/activations": {"activations": {"hooks": ["logits"]}},
    "/v1/analyze": {},
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", BAD_EDITS.values(), ids=BAD_EDITS.keys())
def test_bad_edits_are_400s_that_say_why(client: TestClient, route: str, case: tuple[dict[str, Any], str]) -> None:
    edits, says = case
    r = client.post(route, json={"input_ids": CLEAN[:3]} | ROUTES[route] | edits)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert says in error["message"], error["message"]
    (field,) = edits  # the field the bad edit came in: interventions or residual
    assert error["param"] == field, error


def test_a_dump_without_the_tensor_names_what_it_has(client: TestClient) -> None:
    value = {"safetensors_base64": base64.b64encode(dump(client, CLEAN, ["hook_embed"])).decode()}
    r = client.post(
        "/v1/next-token",
        json={"input_ids": CLEAN, "interventions": [{"hook": "hook_pos_embed", "op": "set", "value": value}]},
    )
    assert r.status_code == 400
    assert "the dump has no tensor 'hook_pos_embed' (it has hook_embed)" in r.json()["error"]["message"]
    # a glob's edit from a dump takes each hook's own tensor: a dump of one layer does not cover the other
    hooks = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    value = {"safetensors_base64": base64.b64encode(dump(client, CLEAN, hooks[:1])).decode()}
    edit = {"hook": "blocks.*.hook_resid_post", "op": "set", "value": value}
    r = client.post("/v1/next-token", json={"input_ids": CLEAN, "interventions": [edit]})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "interventions[0] ('blocks.*.hook_resid_post'): value for 'blocks.1.hook_resid_post': the dump has no tensor "
        "'blocks.1.hook_resid_post' (it has blocks.0.hook_resid_post); a glob's edit from a dump takes each hook's "
        "own tensor: narrow the glob or its layers, or give the dump's tensor for them all as name"
    )
    # a dump of many tensors is named by its first few
    value = {"safetensors_base64": base64.b64encode(dump(client, CLEAN, ["blocks.*"])).decode()}
    edit = {"hook": "blocks.*.attn.hook_result", "op": "set", "value": value}  # optional: in no default dump
    r = client.post("/v1/next-token", json={"input_ids": CLEAN, "interventions": [edit]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "(it has blocks.0.attn.hook_attn_scores, blocks.0.attn.hook_k, " in message, message
    assert re.search(r", [a-z_.0-9]+ and \d+ more\); a glob's edit", message), message
    value = {"safetensors_base64": base64.b64encode(dump(client, CLEAN, hooks)).decode()}
    edits = [{"hook": h, "op": "set", "value": value} for h in hooks]  # each from its own tensor: the clean run
    # a tensor of one dimension too many: the message says that the dump's batch dimension was taken off
    extra = torch.zeros(1, 1, len(CLEAN), 64)
    value = {"safetensors_base64": base64.b64encode(save_safetensors({hooks[0]: extra})).decode()}
    r = client.post(
        "/v1/next-token", json={"input_ids": CLEAN, "interventions": [{"hook": hooks[0], "op": "set", "value": value}]}
    )
    assert r.status_code == 400 and r.json()["error"]["message"].endswith(
        f"value of shape [1, {len(CLEAN)}, 64] does not fit blocks.0.hook_resid_post: give [64] (one position's "
        "selected values, broadcast to every selected position) or [pos, 64] (a whole sequence's; a dump's batch "
        "dimension of 1 is taken off first)"
    )
    patched = post_ok(client, "/v1/next-token", {"input_ids": CLEAN, "interventions": edits})
    assert patched["top"] == post_ok(client, "/v1/next-token", {"input_ids": CLEAN})["top"]


def test_a_glob_patches_every_hook_it_matches_from_one_dump(client: TestClient) -> None:
    """Activation patching of several layers in one edit: a glob's `set` from a dump with no tensor name takes,
    at each hook it matches, the dump's tensor of that hook's name, as an edit a hook would."""
    hooks = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.0.hook_mlp_out"]
    value = {"safetensors_base64": base64.b64encode(dump(client, CLEAN, hooks)).decode()}
    clean, corrupted = logits(client, CLEAN), logits(client, CORRUPTED)
    glob = [{"hook": "blocks.*.hook_resid_post", "op": "set", "value": value}]
    each = [{"hook": h, "op": "set", "value": value} for h in hooks[:2]]
    patched = logits(client, CORRUPTED, interventions=glob)
    assert torch.equal(patched, logits(client, CORRUPTED, interventions=each))
    assert torch.allclose(patched, clean, atol=1e-5) and not torch.allclose(patched, corrupted, atol=1e-3)
    # in its layers only: layer 0's stream set, layer 1 recomputes from it, which is the clean run's too
    first = logits(client, CORRUPTED, interventions=[glob[0] | {"layers": [0]}])
    assert torch.equal(first, logits(client, CORRUPTED, interventions=each[:1]))
    assert torch.allclose(first, clean, atol=1e-5)
    # `add` reads a file of one vector a hook the same way; a named tensor is still one value for every hook
    vectors = {h: torch.randn(64, generator=torch.Generator().manual_seed(i)) for i, h in enumerate(hooks[:2])}
    file = {"safetensors_base64": base64.b64encode(save_safetensors(vectors)).decode()}
    add = {"hook": "blocks.*.hook_resid_post", "op": "add", "value": file, "positions": [2]}
    added = logits(client, CORRUPTED, interventions=[add])
    assert torch.equal(added, logits(client, CORRUPTED, interventions=[add | {"hook": h} for h in hooks[:2]]))
    assert not torch.allclose(added, corrupted, atol=1e-3)
    named = {"safetensors_base64": value["safetensors_base64"], "name": "blocks.1.hook_resid_post"}
    assert torch.equal(
        logits(client, CORRUPTED, interventions=[glob[0] | {"value": named}]),
        logits(client, CORRUPTED, interventions=[e | {"value": named} for e in each]),
    )
    # an empty name is no name; with `layers: []` the edit is nowhere, its positions checked as any edit's
    assert torch.equal(logits(client, CORRUPTED, interventions=[glob[0] | {"value": value | {"name": ""}}]), patched)
    r = client.post(
        "/v1/next-token", json={"input_ids": CLEAN[:3], "interventions": [glob[0] | {"layers": [], "positions": [7]}]}
    )
    assert r.status_code == 400, r.text
    assert "interventions[0] ('blocks.*.hook_resid_post'): position 7" in r.json()["error"]["message"], r.text
    # /v1/analyze refuses an edit only after its last block; a glob's edits from a dump count as the one edit
    scales = {"safetensors_base64": base64.b64encode(dump(client, CLEAN, ["*hook_scale"])).decode()}
    body = {"input_ids": CLEAN, "interventions": [{"hook": "*hook_scale", "op": "set", "value": scales}]}
    assert client.post("/v1/analyze", json=body).status_code == 200
    body["interventions"][0]["hook"] = "ln_final.hook_sc*"
    r = client.post("/v1/analyze", json=body)
    assert r.status_code == 400 and "applies only after the last block" in r.json()["error"]["message"], r.text
    # a bad edit among a glob's is named with the hook where it failed
    r = client.post("/v1/next-token", json={"input_ids": CLEAN[:3], "interventions": [glob[0] | {"positions": [7]}]})
    assert r.status_code == 400, r.text
    assert "interventions[0] ('blocks.0.hook_resid_post')" in r.json()["error"]["message"], r.text
    assert_still_serving(client)


def test_a_dump_of_too_many_tensors_or_none_is_refused_before_it_is_read(client: TestClient) -> None:
    """A dump's tensors are counted in its header before any is made, across the request's edits: 2,049 (empty
    ones: 40,000 in a 3 MB body took 0.2-0.3 s of the GIL to make, every stream waiting) are a 400, in one dump
    or split among several, as a header nested too deeply to parse is; a dump of no tensors says it has none."""
    from server.schemas import MAX_DUMP_TENSORS

    def edit_with(*data: bytes, name: str | None = None) -> dict[str, Any]:
        values = [{"safetensors_base64": base64.b64encode(d).decode(), "name": name} for d in data]
        edits = [{"hook": "blocks.*.hook_resid_post", "op": "set", "value": value} for value in values]
        return {"input_ids": CLEAN, "interventions": edits}

    many = save_safetensors({f"t{i}": torch.zeros(0) for i in range(MAX_DUMP_TENSORS + 1)})
    r = client.post("/v1/next-token", json=edit_with(many))
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "interventions[0]: value for 'blocks.*.hook_resid_post': the dump holds 2049 tensors; at most 2048 in all (a "
        "dump of every hook point of gpt2-xl has 1,111)"
    )
    half = save_safetensors({f"t{i}": torch.zeros(0) for i in range(MAX_DUMP_TENSORS // 2 + 1)})
    r = client.post("/v1/next-token", json=edit_with(half, half, name="t0"))  # the first read whole
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "interventions[1]: value for 'blocks.*.hook_resid_post': the dump holds 1025 tensors, and the interventions' "
        "dumps before it 1025; at most 2048 in all (a dump of every hook point of gpt2-xl has 1,111)"
    )
    deep = b"[" * 100_000 + b"]" * 100_000
    r = client.post("/v1/next-token", json=edit_with(len(deep).to_bytes(8, "little") + deep))
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("is not base64 of a safetensors file")
    r = client.post("/v1/next-token", json=edit_with(save_safetensors({})))
    assert r.status_code == 400 and "the dump has no tensor 'blocks.0.hook_resid_post' (it has none)" in r.text
    assert_still_serving(client)


def test_a_dump_of_a_shorter_prompt_is_refused(client: TestClient) -> None:
    value = {"safetensors_base64": base64.b64encode(dump(client, CLEAN[:3], ["hook_embed"])).decode()}
    r = client.post(
        "/v1/next-token",
        json={"input_ids": CLEAN, "interventions": [{"hook": "hook_embed", "op": "set", "value": value}]},
    )
    assert r.status_code == 400
    assert "value covers 3 positions, position 7 needed" in r.json()["error"]["message"]


def test_residual_lists_may_repeat_a_layer(client: TestClient) -> None:
    """Unlike an edit's positions, heads and layers, the residual lists name a set: a repeat is harmless."""
    once = next_token(client, CLEAN, residual={"attn": [0], "mlp": [1]})
    assert next_token(client, CLEAN, residual={"attn": [0, 0], "mlp": [1, 1, 1]}) == once


def test_residual_repeats_are_dropped_once_at_parsing() -> None:
    """A residual list's repeats are dropped where the request is read, so the layers the model checks for each
    of a request's sequences are n_layer at most (a million repeats in a 4 MiB body once held the event loop
    for seconds, once per prompt)."""
    from server.schemas import ResidualSpec, edit_spec

    spec = edit_spec([], ResidualSpec(attn=[1, 0] * 500_000, mlp=[1] * 1000), 2)
    assert (spec.ablate_attn, spec.ablate_mlp) == ((1, 0), (1,))


def test_the_server_still_serves_after_bad_edits_and_keeps_nothing(client: TestClient) -> None:
    before = next_token(client, CLEAN)
    for edits, _ in BAD_EDITS.values():
        assert client.post("/v1/next-token", json={"input_ids": CLEAN} | edits).status_code == 400
    next_token(client, CLEAN, interventions=[{"hook": "blocks.*.hook_resid_post", "op": "scale", "factor": 0.0}])
    assert client.get("/health").status_code == 200
    assert next_token(client, CLEAN) == before  # no edit left behind on the shared model
    r = client.post("/v1/generate", json={"input_ids": CLEAN, "max_new_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3


# --- /v1/analyze ----------------------------------------------------------------------------------------


def test_analyze_response_shape(client: TestClient) -> None:
    r = client.post("/v1/analyze", json={"prompt": "The cat sat on the mat", "top_k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    n = len(body["input_ids"])
    assert body["tokens"] == ["The", " cat", " sat", " on", " the", " mat"]
    for side in ("layers", "ablated"):
        layers = body[side]
        assert [layer["layer"] for layer in layers] == [-1, 0, 1]
        for layer in layers:
            assert len(layer["norms"]) == n
            assert isinstance(layer["effective_rank"], float) and 0 < layer["effective_rank"] <= n
            assert 0 <= layer["collapse"] <= 1 and -1 <= layer["mean_cosine"] <= 1
            entropy = layer["attention_entropy"]
            assert entropy is None if layer["layer"] == -1 else len(entropy) == 4
            assert len(layer["logit_lens"]) == n
            for top in layer["logit_lens"]:
                assert len(top) == 3 and set(top[0]) == {"id", "token", "prob"}
                assert [e["prob"] for e in top] == sorted((e["prob"] for e in top), reverse=True)
    assert body["layers"][0] == body["ablated"][0]  # the embeddings: before any skip connection
    assert body["layers"][-1]["collapse"] != body["ablated"][-1]["collapse"]


def test_analyze_matches_the_model_and_its_ablated_side(client: TestClient, tiny_model: GPT) -> None:
    body = client.post("/v1/analyze", json={"input_ids": CLEAN, "top_k": 2}).json()
    every = (0, 1)
    for side, spec in (("layers", None), ("ablated", EditSpec((), every, every))):
        stats = analyze(tiny_model, CLEAN, 2, spec.hooks(tiny_model.config, T) if spec else None)
        for got, want in zip(body[side], stats, strict=True):
            assert got["collapse"] == pytest.approx(want.collapse)
            assert got["effective_rank"] == pytest.approx(want.effective_rank)
            assert [[e["id"] for e in top] for top in got["logit_lens"]] == [
                [i for i, _ in top] for top in want.logit_lens
            ]
    no_skips = client.post(
        "/v1/analyze", json={"input_ids": CLEAN, "top_k": 2, "residual": {"attn": "all", "mlp": "all"}}
    )
    assert no_skips.json()["layers"] == body["ablated"]


def test_analyze_with_edits_and_without_the_ablated_side(client: TestClient) -> None:
    body = {"input_ids": CLEAN, "compare_ablated": False}
    plain = client.post("/v1/analyze", json=body).json()
    edited = client.post(
        "/v1/analyze", json=body | {"interventions": [{"hook": "blocks.0.hook_attn_out", "op": "zero"}]}
    )
    assert edited.status_code == 200
    assert plain["ablated"] is None and edited.json()["ablated"] is None
    assert edited.json()["layers"][0] == plain["layers"][0]
    assert edited.json()["layers"][1]["norms"] != plain["layers"][1]["norms"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": ""}, "the prompt is empty"),
        ({"input_ids": []}, "input_ids is empty"),
        ({"prompt": "Hi", "input_ids": [1]}, "give exactly one of prompt and input_ids"),
        ({"input_ids": [50257]}, "token id 50257 is outside the vocabulary"),
        ({"prompt": "Hi", "top_k": 0}, "top_k must be in 1..100, got 0"),
        ({"prompt": "Hi", "top_k": 101}, "top_k must be in 1..100, got 101"),
        ({"prompt": "Hi", "top_k": "5"}, "top_k"),
        ({"prompt": "Hi", "compare_ablated": "yes"}, "compare_ablated"),
    ],
)
def test_analyze_errors(client: TestClient, body: dict[str, Any], says: str) -> None:
    r = client.post("/v1/analyze", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_an_analysis_over_the_size_limit_is_a_413(
    tiny: Checkpoint, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/v1/analyze's answer (every layer's logit lens: top_k tokens a position) is bounded like a dump: over
    --max-activation-bytes it is a 413 naming top_k (or the prompt, at top_k 1), by its real size once built,
    before any model work where even its least possible size is over, and as soon as the layers written so
    far are over it (once 1024 tokens at top_k 100 made a 158 MB answer unchecked)."""
    from server import encoding

    loaded = load(tiny.path, tokenizer_dir=tokenizer_dir, device="cpu")
    body = {"input_ids": CLEAN, "top_k": 100, "gradients": True}
    with TestClient(create_app(Settings(), loaded=loaded)) as c:
        size = len(c.post("/v1/analyze", json=body).content)
    least = encoding.analysis_min_bytes(loaded.model.config, T, 100, 2)
    assert least <= size
    with TestClient(create_app(Settings(max_activation_bytes=size), loaded=loaded)) as c:
        assert c.post("/v1/analyze", json=body).status_code == 200  # at the limit: served
    with TestClient(create_app(Settings(max_activation_bytes=size - 1), loaded=loaded)) as c:
        error = c.post("/v1/analyze", json=body).json()["error"]  # measured once built
        assert error["param"] == "top_k" and f"takes {size} bytes" in error["message"], error
        engine = c.app.state.engine  # type: ignore[attr-defined]
        calls: list[object] = []
        monkeypatch.setattr(engine, "call", lambda fn: calls.append(fn))  # no model work may start
        r = c.post("/v1/analyze", json=body | {"input_ids": CLEAN * 15, "gradients": False})
        assert r.status_code == 413 and "takes at least" in r.json()["error"]["message"] and not calls, r.text
        monkeypatch.undo()
        assert c.post("/v1/analyze", json={"input_ids": CLEAN, "top_k": 2}).status_code == 200  # still serving
    with TestClient(create_app(Settings(max_activation_bytes=(least + size) // 2), loaded=loaded)) as c:
        error = c.post("/v1/analyze", json=body).json()["error"]  # over while being written: stopped there
        assert error["param"] == "top_k" and "takes more than the limit as JSON" in error["message"], error
    with TestClient(create_app(Settings(max_activation_bytes=2000), loaded=loaded)) as c:
        r = c.post("/v1/analyze", json={"input_ids": CLEAN, "top_k": 1, "compare_ablated": False})
        assert r.status_code == 413 and r.json()["error"]["param"] == "input_ids", r.text  # top_k 1: the prompt
