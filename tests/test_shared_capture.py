"""Capture and edits in shared batches: sequences that capture activations or apply edits decode and
prefill together with each other and with plain ones, each seeing only its own values, and each gets what
it would get alone: the same tokens, and activations equal to float64 rounding (1e-12; measured up to 6e-15)
or float32's (1e-4). Not bit for bit: MKL's matrix product sums in an order that depends on the number of
rows (a [1, 64] x [64, 192] product and row 0 of a [9, 64] one differ by 5e-15 in float64), so a row
computed beside others can differ in its last bits from the same row alone. Prompt-only captures run in one
pass that stops after the last hook wanted; over HTTP, the engine's passes share up to a prompt chunk's
tokens (tests/test_engine.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
import safetensors.torch
import torch
from conftest import Checkpoint, load_ours
from contract import safetensors_metadata
from inprocess import assert_still_serving, serve
from test_engine import held, run, running

from model.generate import DecodeBatch, SamplingParams, generate, new_sequence, prefill_prompts
from model.gpt import GPT
from model.hooks import Capture, hook_names, select_hooks
from model.interventions import Edit, EditSpec, HookChain
from model.loading import LoadedModel

PROMPTS = [
    [464, 3797, 3332, 319, 262, 2603],
    [15496, 11, 314, 1101, 257, 3303, 2746, 11, 290],
    [40, 588],
    [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 198],
]
CAPTURE = ["blocks.*.hook_resid_post", "blocks.0.attn.hook_pattern", "blocks.1.ln1.hook_normalized", "logits"]
EDITS = EditSpec(
    (Edit("blocks.0.hook_attn_out", "mean"), Edit("blocks.1.attn.hook_z", "scale", factor=0.5, heads=(1,)))
)
ABLATE = EditSpec(ablate_attn=(1,))


def mixed(model: GPT) -> list[tuple[list[int], SamplingParams, list[str] | None, EditSpec | None]]:
    """Plain, capturing, editing, ablating and capturing-while-editing sequences, sampled and greedy."""
    sample = SamplingParams(max_new_tokens=7, temperature=0.9, seed=5, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    return [
        (PROMPTS[0], greedy, None, None),
        (PROMPTS[1], sample, CAPTURE, None),
        (PROMPTS[2], greedy, None, EDITS),
        (PROMPTS[3], sample, CAPTURE, EDITS),
        (PROMPTS[1], greedy, ["blocks.*.attn.hook_attn_scores"], ABLATE),
        (PROMPTS[0], SamplingParams(max_new_tokens=3, temperature=0.0, prompt_logprobs=2), CAPTURE, None),
    ]


def together(model: GPT, prefill_chunk: int | None) -> list:
    """All of `mixed` in one DecodeBatch, the later ones joining while the first decode."""
    runs = mixed(model)
    n = model.config.n_layer
    seqs = [
        new_sequence(model, i, p, params, None, select_hooks(h, n) if h else None, e)
        for i, (p, params, h, e) in enumerate(runs)
    ]
    batch = DecodeBatch(model, len(seqs), model.config.n_positions, prefill_chunk)
    with torch.inference_mode():
        batch.add(seqs[0])
        batch.step()  # the first prefills alone, then decodes while the others join
        for s in seqs[1:]:
            batch.add(s)
        while batch:
            for seq, _ in batch.step():
                assert seq.error is None
    return [s.result() for s in seqs]


def alone(model: GPT) -> list:
    return [generate(model, [p], params, hooks=h, edits=e)[0] for p, params, h, e in mixed(model)]


def assert_same(got: list, want: list, float64: bool) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert (g.activations is None) == (w.activations is None)
        if g.prompt_logprobs is not None:
            assert [lp and lp.id for lp in g.prompt_logprobs] == [lp and lp.id for lp in w.prompt_logprobs]
        for name, t in (w.activations or {}).items():
            assert g.activations[name].shape == t.shape, name
            tol = 1e-12 if float64 else 1e-4
            torch.testing.assert_close(g.activations[name], t, rtol=0 if float64 else tol, atol=tol, msg=name)


@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_mixed_sequences_in_one_batch_equal_their_solo_runs_in_float64(
    tiny: Checkpoint, prefill_chunk: int | None
) -> None:
    model = load_ours(tiny, torch.float64)
    assert_same(together(model, prefill_chunk), alone(model), float64=True)


def test_mixed_sequences_in_one_batch_equal_their_solo_runs_in_float32(tiny_model: GPT) -> None:
    assert_same(together(tiny_model, 4), alone(tiny_model), float64=False)


def test_prompt_only_captures_run_in_one_pass_that_stops_after_the_last_hook(tiny_model: GPT) -> None:
    """Prompts of different lengths, one with edits, in one padded pass: each equals a full forward pass
    over its own prompt, and nothing after the last captured hook runs (block 1 and the head)."""
    names = select_hooks(["blocks.0.*", "hook_embed"], 2)  # default hooks of block 0
    runs = [(PROMPTS[0], None), (PROMPTS[3], EDITS), (PROMPTS[2], None)]
    params = SamplingParams(max_new_tokens=0)
    seqs = [new_sequence(tiny_model, i, p, params, None, names, e) for i, (p, e) in enumerate(runs)]
    calls: list[int] = []
    block1 = tiny_model.h[1].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with torch.inference_mode():
            prefill_prompts(tiny_model, seqs)
    finally:
        block1.remove()
    assert calls == []
    for seq, (prompt, edits) in zip(seqs, runs, strict=True):
        assert seq.finish_reason == "length" and seq.error is None
        capture = Capture(names)
        hooks = capture if edits is None else HookChain(edits.hooks(tiny_model.config, len(prompt)), capture)
        with torch.inference_mode():
            tiny_model(torch.tensor([prompt]), hooks=hooks)
        got = seq.result().activations
        for name, want in capture.tensors().items():
            assert got[name].shape == want.shape, name
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_the_engine_batches_capturing_requests_with_plain_ones(loaded: LoadedModel) -> None:
    """Queued together, capturing and editing requests share the decode steps with a plain one (the
    batch holds them all at once) and each equals its solo run."""
    model = loaded.model

    async def main() -> None:
        with running(loaded, max_batch_size=8) as engine:
            sizes: list[int] = []
            step = engine._batch.step

            def spy() -> list:
                sizes.append(len(engine._batch))
                return step()

            engine._batch.step = spy  # type: ignore[method-assign]
            async with held(engine):
                streams = [
                    engine.submit([p], [params], h, e)[0]
                    for p, params, h, e in mixed(model)
                    if not params.prompt_logprobs
                ]
            results = [await s.result() for s in streams]
            assert max(sizes) == len(streams)
            want = [
                c for c, (_, params, _, _) in zip(alone(model), mixed(model), strict=True) if not params.prompt_logprobs
            ]
            assert_same(results, want, float64=False)

    run(main())


def test_batched_activations_request_is_one_file_with_a_batch_dimension(loaded: LoadedModel) -> None:
    batch = [PROMPTS[0], PROMPTS[1][:6], PROMPTS[3][:6]]
    names = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_pattern"]
    with serve(loaded) as client:
        r = client.post("/v1/activations", json={"input_ids": batch, "activations": {"hooks": names}})
        assert r.status_code == 200, r.text
        tensors = safetensors.torch.load(r.content)
        assert tensors["blocks.0.hook_resid_pre"].shape == (3, 6, 64)
        assert tensors["blocks.1.attn.hook_pattern"].shape == (3, 4, 6, 6)
        for b, ids in enumerate(batch):
            one = client.post("/v1/activations", json={"input_ids": ids, "activations": {"hooks": names}})
            single = safetensors.torch.load(one.content)
            for name in names:
                torch.testing.assert_close(tensors[name][b : b + 1], single[name], rtol=1e-5, atol=1e-5)
        # bad batches: a 400 naming the field, then the server still serves
        for body, param in [
            ({"input_ids": [PROMPTS[0], PROMPTS[2]]}, "input_ids"),
            ({"input_ids": [PROMPTS[0], PROMPTS[0]], "max_new_tokens": 2}, "max_new_tokens"),
        ]:
            r = client.post("/v1/activations", json={**body, "activations": {"hooks": names}})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
        assert_still_serving(client)


def test_a_list_of_one_prompt_is_a_batch_of_one(loaded: LoadedModel) -> None:
    """A prompt sent in a list, text or ids, is a batch of one: the metadata's `token_ids` and `text` are lists,
    as for several, so a client reads the file by the shape of its own request; being one, it may generate."""
    names = ["blocks.0.hook_resid_pre"]
    with serve(loaded) as client:
        for body in ({"input_ids": [PROMPTS[1]]}, {"prompt": ["Hello world"]}):
            r = client.post("/v1/activations", json={**body, "activations": {"hooks": names}})
            assert r.status_code == 200, r.text
            meta = safetensors_metadata(r.content)
            ids = json.loads(meta["token_ids"])
            assert len(ids) == 1 and isinstance(ids[0], list), ids
            assert json.loads(meta["text"]) == [loaded.tokenizer.decode(ids[0])]
            assert safetensors.torch.load(r.content)[names[0]].shape == (1, len(ids[0]), 64)
            generating = {**body, "max_new_tokens": 2, "ignore_eos": True, "activations": {"hooks": names}}
            r = client.post("/v1/activations", json=generating)
            assert r.status_code == 200, r.text
            (generated,) = json.loads(safetensors_metadata(r.content)["token_ids"])
            assert generated[: len(ids[0])] == ids[0] and len(generated) == len(ids[0]) + 2
            assert safetensors.torch.load(r.content)[names[0]].shape == (1, len(ids[0]) + 2, 64)
        r = client.post("/v1/activations", json={"input_ids": PROMPTS[1], "activations": None})  # null: the default
        assert r.status_code == 200, r.text
        assert sorted(safetensors.torch.load(r.content)) == sorted(hook_names(2, optional=False))
        assert json.loads(safetensors_metadata(r.content)["token_ids"]) == PROMPTS[1]  # one prompt: not a list
        assert_still_serving(client)


def test_concurrent_single_context_clients_get_their_own_values(loaded: LoadedModel) -> None:
    """Eight prompt-only requests at once (what a harvest through the server sends): each file equals a
    forward pass over its own context."""
    contexts = [[(7 * i + j) % 50000 for j in range(16)] for i in range(8)]
    name = "blocks.1.hook_resid_pre"

    async def main() -> None:
        with running(loaded, max_batch_size=8) as engine:
            async with held(engine):
                streams = [engine.submit([c], [SamplingParams(max_new_tokens=0)], [name])[0] for c in contexts]
            return await asyncio.gather(*(s.result() for s in streams))

    results = run(main())
    for ctx, result in zip(contexts, results, strict=True):
        capture = Capture([name])
        with torch.inference_mode():
            loaded.model(torch.tensor([ctx]), hooks=capture)
        torch.testing.assert_close(result.activations[name], capture.tensors()[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "names, edits",
    [
        (["ln_final.hook_normalized"], None),
        (["unembed.hook_in"], EditSpec((Edit("unembed.hook_in", "scale", factor=0.7, positions=(2, 9, 10)),))),
        (["unembed.hook_in"], EditSpec((Edit("ln_final.hook_scale", "scale", factor=1.5),))),
    ],
    ids=["capture", "edit", "both"],
)
def test_a_prompt_chunk_hooked_before_the_head_s_product_runs_the_product_at_its_last_position_only(
    tiny_model: GPT, monkeypatch: pytest.MonkeyPatch, names: list[str], edits: EditSpec | None
) -> None:
    """A prompt chunk packed beside decoding rows, whose hooks capture or edit the final LayerNorm or the
    head's input (`ln_final.*`, `unembed.hook_in`), runs ln_f over its every position for them and the LM
    head's product (a vocabulary-wide row a position) only where a token is wanted: its prompt's last
    position. Its tokens and values are still what it gets alone."""
    products: list[int] = []  # the rows of each pass's head product
    head = tiny_model.lm_head.forward
    monkeypatch.setattr(tiny_model.lm_head, "forward", lambda x, w: products.append(x.shape[-2]) or head(x, w))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    n = tiny_model.config.n_layer
    plain = new_sequence(tiny_model, 0, PROMPTS[0], greedy, None)
    hooked = new_sequence(tiny_model, 1, PROMPTS[3], greedy, None, select_hooks(names, n), edits)
    batch = DecodeBatch(tiny_model, 2, tiny_model.config.n_positions, 4)
    with torch.inference_mode():
        batch.add(plain)
        batch.step()  # the plain prompt alone
        batch.add(hooked)
        del products[:]
        while hooked.prefilled < len(hooked.prompt):  # 11 prompt tokens in chunks, beside a decode token
            batch.step()
        assert len(products) > 1 and products == [1] * (len(products) - 1) + [2]  # were the chunks' lengths + 1
        while batch:
            batch.step()
    [want] = generate(tiny_model, [PROMPTS[3]], greedy, hooks=names, edits=edits)
    got = hooked.result()
    assert got.token_ids == want.token_ids
    for name in names:
        torch.testing.assert_close(got.activations[name], want.activations[name], rtol=1e-4, atol=1e-4, msg=name)
