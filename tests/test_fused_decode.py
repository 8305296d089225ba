"""The fused CPU pass (model/kernels/decode.cpp, decode.py) against the eager forward pass it stands in for:
decode steps of ragged rows, prompt chunks packed with decode tokens, the KV cache it writes, float32 and
int8, the choice DecodeBatch makes, and clear errors for what it cannot take."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import Checkpoint, load_ours, make_checkpoint

from model import kernels
from model.generate import DecodeBatch, SamplingParams, generate, new_sequence
from model.kernels.decode import FusedDecode, unsupported
from model.kv_cache import KVCache
from model.loading import load_weights

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="our CPU kernels cannot be built here")
generate_module = sys.modules["model.generate"]
# int8: both paths round each row of x to int16 inside the product (model/kernels/matmul.h), so a float32
# difference of 1e-7 between them (LayerNorm's summation order) can move a rounding by one step of
# max|x| / 32767, which these random weights amplify through the layers (distil's shape: 2e-3 in logits of
# spread 4.3). Against int8's own distance from float32 (0.79 there) that is a few tenths of a percent.
INT8_SHARE = 0.01


def eager_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """DecodeBatch without the fused pass: every step through GPT.forward."""
    monkeypatch.setattr(generate_module.FusedDecode, "make", classmethod(lambda cls, model, cache: None))


def prefilled(model, prompts: list[list[int]], max_len: int = 64) -> KVCache:
    cache = KVCache.empty(model.config, len(prompts) + 1, max_len, dtype=torch.float32, device="cpu")
    for b, p in enumerate(prompts):
        cache.add_row()
        model(torch.tensor([p]), cache.row(b))
        cache.set_length(b, len(p))
    return cache


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50257, (n,), generator=g).tolist() for n in lengths]


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("shape", ["tiny", "distil"])
@pytest.mark.parametrize("lengths", [[5, 11, 1], [5, 11]], ids=["3 rows", "2 rows"])  # 2: matmul.h's own path
def test_decode_steps_match_the_eager_step(
    dtype: str, shape: str, lengths: list[int], request: pytest.FixtureRequest
) -> None:
    """Rows of different lengths, several steps: the same logits and the same keys and values in the cache,
    within 1e-4 in float32; in int8 within 1% of int8's own distance from float32 (see INT8_SHARE)."""
    ck: Checkpoint = request.getfixturevalue(shape)
    model = load_weights(ck.path, dtype=dtype, device="cpu")
    dense = load_weights(ck.path, dtype="float32", device="cpu")
    prompts = prompts_of(lengths)
    with torch.inference_mode():
        eager, fused_cache, dense_cache = (prefilled(m, prompts) for m in (model, model, dense))
        fused = FusedDecode.make(model, fused_cache)
        assert fused is not None
        tokens = [7, 8, 9][: len(prompts)]
        for _ in range(5):
            expected = model(torch.tensor(tokens)[:, None], eager, None, last_only=True)[:, -1]
            reference = dense(torch.tensor(tokens)[:, None], dense_cache, None, last_only=True)[:, -1]
            eager.advance(1)
            dense_cache.advance(1)
            got = fused(tokens, fused_cache.lengths)
            fused_cache.advance(1)
            bound = 1e-4 if dtype == "float32" else INT8_SHARE * float((expected - reference).abs().max())
            assert float((got - expected).abs().max()) <= bound
            tokens = expected.argmax(-1).tolist()
        n = max(eager.lengths)
        for ours, theirs, dense_kv in (
            (fused_cache.k, eager.k, dense_cache.k),
            (fused_cache.v, eager.v, dense_cache.v),
        ):
            ours, theirs, dense_kv = (t[:, : len(prompts), :, :n] for t in (ours, theirs, dense_kv))
            bound = 1e-5 if dtype == "float32" else INT8_SHARE * float((theirs - dense_kv).abs().max())
            assert float((ours - theirs).abs().max()) <= bound


@needs_kernels
def test_logits_match_transformers(small: Checkpoint) -> None:
    """gpt2-small's shape: every fused decode step's logits within 1e-4 of transformers' on the same sequence."""
    model = load_ours(small)
    prompt = prompts_of([9])[0]
    with torch.inference_mode():
        cache = prefilled(model, [prompt], max_len=32)
        fused = FusedDecode.make(model, cache)
        assert fused is not None
        ids, token = list(prompt), 464
        for _ in range(4):
            got = fused([token], cache.lengths)[0]
            cache.advance(1)
            ids.append(token)
            expected = small.hf(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
            token = int(expected.argmax())


@needs_kernels
def test_a_packed_pass_matches_the_eager_one(tiny: Checkpoint) -> None:
    """Decode tokens of two rows and prompt chunks of two others in one pass, logits at chosen tokens (in
    the order asked for), and every layer's keys and values of every token in the cache, the last layer's
    too (only the output tokens go past it)."""
    model = load_ours(tiny)
    prompts = prompts_of([6, 3, 10, 4])
    with torch.inference_mode():
        cache = prefilled(model, [p[:2] for p in prompts] + [], max_len=40)
        fused = FusedDecode.make(model, cache)
        assert fused is not None
        # rows 0 and 1 decode one token at position 2; rows 2 and 3 add chunks of 5 and 2 prompt tokens
        tokens = [prompts[0][2], prompts[1][2], *prompts[2][2:7], *prompts[3][2:4]]
        rows = [0, 1, 2, 2, 2, 2, 2, 3, 3]
        positions = [2, 2, 2, 3, 4, 5, 6, 2, 3]
        outputs = [8, 0, 4, 1, 6]
        got = fused.forward(tokens, rows, positions, outputs)
        full = [prompts[0][:3], prompts[1][:3], prompts[2][:7], prompts[3][:4]]
        last = {0: model(torch.tensor([full[0]]))[0, -1], 1: model(torch.tensor([full[1]]))[0, -1]}
        last |= {4: model(torch.tensor([full[2][:5]]))[0, -1], 6: model(torch.tensor([full[2]]))[0, -1]}
        last[8] = model(torch.tensor([full[3]]))[0, -1]
        torch.testing.assert_close(got, torch.stack([last[o] for o in outputs]), rtol=0, atol=1e-4)
        eager = prefilled(model, full, max_len=40)
        for b, seq in enumerate(full):
            for got_kv, want_kv in ((cache.k, eager.k), (cache.v, eager.v)):
                torch.testing.assert_close(got_kv[:, b, :, : len(seq)], want_kv[:, b, :, : len(seq)], rtol=0, atol=1e-5)


@needs_kernels
def test_a_server_step_matches_the_eager_one(distil: Checkpoint) -> None:
    """The server's usual pass at its default prompt chunk: 16 rows decoding one token each and a 64-token
    chunk of another row's prompt, 80 tokens, whose block products (with AVX-512) take the outer-product
    tiles, residual adds included (the LM head, at 17 rows, does not): the logits of the decode rows and of the
    chunk's last token, and the chunk's keys and values in the cache, as the eager pass gives them (whose
    68-token forward takes the dot-product tiles: 68 of 80 padded rows is under the 7/8 rule)."""
    model = load_ours(distil)
    prompts = prompts_of([3 + b % 5 for b in range(16)] + [70], seed=5)
    with torch.inference_mode():
        cache = prefilled(model, [p[:-1] for p in prompts[:16]] + [prompts[16][:4]], max_len=80)
        fused = FusedDecode.make(model, cache)
        assert fused is not None
        tokens = [p[-1] for p in prompts[:16]] + prompts[16][4:68]
        rows = list(range(16)) + [16] * 64
        positions = [len(p) - 1 for p in prompts[:16]] + list(range(4, 68))
        got = fused.forward(tokens, rows, positions, [*range(16), 79])
        full = [*prompts[:16], prompts[16][:68]]  # each row's tokens up to the one whose logits are asked for
        want = [model(torch.tensor([p]))[0, -1] for p in full]
        torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-4)
        eager = prefilled(model, [prompts[16][:68]], max_len=80)
        for got_kv, want_kv in ((cache.k, eager.k), (cache.v, eager.v)):
            # values up to 12, six layers deep: 1e-4 as for the logits (the dot-product tiles: 2e-5 here)
            torch.testing.assert_close(got_kv[:, 16, :, :68], want_kv[:, 0, :, :68], rtol=0, atol=1e-4)


@needs_kernels
def test_a_long_packed_pass_matches_the_eager_one(distil: Checkpoint) -> None:
    """A pass of more tokens than one block of rows (96) takes: 40 rows decoding one token each beside a
    300-token chunk of another row's prompt, as a busy server's step or a long prompt is: the logits of every
    token (as prompt logprobs ask, so the last layer and the LM head run on all 340 rows too), and the chunk's
    keys and values in the cache, as the eager pass gives them."""
    model = load_ours(distil)
    prompts = prompts_of([2 + b % 7 for b in range(40)] + [310], seed=7)
    with torch.inference_mode():
        cache = prefilled(model, [p[:-1] for p in prompts[:40]] + [prompts[40][:10]], max_len=320)
        fused = FusedDecode.make(model, cache)
        assert fused is not None and fused.max_tokens >= 340
        tokens = [p[-1] for p in prompts[:40]] + prompts[40][10:310]
        rows = list(range(40)) + [40] * 300
        positions = [len(p) - 1 for p in prompts[:40]] + list(range(10, 310))
        got = fused.forward(tokens, rows, positions, list(range(340)))
        want = [model(torch.tensor([p]))[0, -1] for p in prompts[:40]]
        chunk = model(torch.tensor([prompts[40][:310]]))[0, 10:310]  # [300, vocab]
        torch.testing.assert_close(got, torch.cat([torch.stack(want), chunk]), rtol=0, atol=1e-4)
        eager = prefilled(model, [prompts[40][:310]], max_len=320)
        for got_kv, want_kv in ((cache.k, eager.k), (cache.v, eager.v)):
            torch.testing.assert_close(got_kv[:, 40, :, :310], want_kv[:, 0, :, :310], rtol=0, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("d_head", [12, 40, 64])
def test_every_query_of_a_chunk_attends_as_eager(d_head: int, tmp_path: Path) -> None:
    """Each query of a prompt chunk attends over its own row's keys up to its position (the causal diagonal
    inside the chunk: keys stored in this pass, later ones left out), at head sizes with a vector tail (12),
    without the 64-wide path (40) and GPT-2's own (64, where a chunk's queries go in blocks of a vector's
    lanes: 16 with AVX-512, 8 with AVX2, and the weighted sums 4 queries at a time with AVX-512); chunks of 1
    to 35 tokens (whole blocks and parts of one), one beside a decode token of another row, logits at every
    token."""
    model = load_ours(make_checkpoint(tmp_path, n_layer=2, n_head=3, n_embd=3 * d_head, n_positions=128))
    prompts = prompts_of([4, 110], seed=d_head)
    with torch.inference_mode():
        cache = prefilled(model, [prompts[0][:3], prompts[1][:2]], max_len=128)
        fused = FusedDecode.make(model, cache)
        assert fused is not None
        start = 2
        for size in (1, 2, 3, 4, 5, 7, 11, 16, 17, 35):  # row 1's prompt in chunks; row 0 decodes its 4th once
            chunk = prompts[1][start : start + size]
            tokens, rows, positions = list(chunk), [1] * size, list(range(start, start + size))
            if size == 5:
                tokens, rows, positions = [prompts[0][3], *tokens], [0, *rows], [3, *positions]
            got = fused.forward(tokens, rows, positions, list(range(len(tokens))))
            start += size
            want = model(torch.tensor([prompts[1][:start]]))[0, -size:]
            if size == 5:
                want = torch.cat([model(torch.tensor([prompts[0]]))[0, -1:], want])
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("case", ["NaN and inf", "all -inf"])
def test_scores_beyond_float32_give_nan_as_torchs_softmax(tmp_path: Path, case: str) -> None:
    """Query and key weights so large that the attention scores leave float32's range (NaN and inf): torch's
    softmax, and transformers' logits, are NaN, and so are the fused pass's, for a decode token (attend_one)
    and a chunk's queries (attend_block), so that generation stops with its error instead of going on with the
    plain average of the values that exp's clamp made of them. (torch's fused attention, the eager pass's
    without hooks, gives finite values there: 0 where every score is -inf.)"""
    ck = make_checkpoint(tmp_path, n_layer=1, n_head=2, n_embd=128, n_positions=64)  # d_head 64: the blocks
    model = load_ours(ck)
    prompts = prompts_of([7, 20])
    for attn in (model.h[0].attn.c_attn, ck.hf.transformer.h[0].attn.c_attn):
        with torch.no_grad():
            if case == "NaN and inf":
                attn.weight[:, : 2 * 128] *= 1e20  # [in, 3C]: the columns of Q and K
            else:  # every score -inf: queries of 1e20, keys of -1e20, whatever the input
                attn.weight[:, : 2 * 128] = 0
                attn.bias[:128], attn.bias[128 : 2 * 128] = 1e20, -1e20
    assert ck.hf(torch.tensor([prompts[0]])).logits.isnan().all()
    with torch.inference_mode():
        cache = prefilled(model, [prompts[0][:6], prompts[1][:2]], max_len=64)
        fused = FusedDecode.make(model, cache)
        assert fused is not None
        tokens, rows, positions = [prompts[0][6], *prompts[1][2:]], [0] + [1] * 18, [6, *range(2, 20)]
        got = fused.forward(tokens, rows, positions, list(range(19)))
    assert got.isnan().all(), got.isnan().all(dim=-1)


@needs_kernels
def test_a_chunk_without_outputs_fills_the_cache(tiny: Checkpoint) -> None:
    """A prompt chunk whose logits nobody wants (not the prompt's last): no logits, every layer's keys and
    values stored, and the next pass over the rest of the prompt gives the eager logits."""
    model = load_ours(tiny)
    (prompt,) = prompts_of([9])
    with torch.inference_mode():
        cache = prefilled(model, [prompt[:1]], max_len=16)
        fused = FusedDecode.make(model, cache)
        assert fused is not None
        assert fused.forward(prompt[1:6], [0] * 5, list(range(1, 6)), []).shape == (0, model.config.vocab_size)
        eager = prefilled(model, [prompt[:6]], max_len=16)
        torch.testing.assert_close(cache.k[:, 0, :, :6], eager.k[:, 0, :, :6], rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.v[:, 0, :, :6], eager.v[:, 0, :, :6], rtol=0, atol=1e-5)
        got = fused.forward(prompt[6:], [0] * 3, [6, 7, 8], [2])
        torch.testing.assert_close(got[0], model(torch.tensor([prompt]))[0, -1], rtol=0, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_generation_is_unchanged(tiny: Checkpoint, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generation of a ragged batch: the same tokens with the fused pass as without, and as transformers."""
    model = load_weights(tiny.path, dtype=dtype, device="cpu")
    prompts = prompts_of([5, 17, 1, 40], seed=1)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    fused = [c.token_ids for c in generate(model, prompts, params)]
    with monkeypatch.context() as m:
        eager_only(m)
        eager = [c.token_ids for c in generate(model, prompts, params)]
    assert fused == eager
    if dtype == "float32":
        for prompt, tokens in zip(prompts, fused, strict=True):
            out = tiny.hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert out[0, len(prompt) :].tolist() == tokens


@needs_kernels
@pytest.mark.parametrize("chunk", [3, 16, None])
def test_continuous_batch_with_chunked_prefill(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    """Sequences joining a running batch, prompts prefilled in chunks packed with decode tokens, one asking
    for prompt logprobs: tokens and log-probabilities equal the eager batch's."""
    model = load_ours(tiny)
    prompts = prompts_of([7, 30, 2, 19], seed=2)

    def run() -> list[tuple[list[int], list[tuple[int, float]]]]:
        with torch.inference_mode():
            batch = DecodeBatch(model, 4, 96, prefill_chunk=chunk)
            seqs = [
                new_sequence(
                    model,
                    i,
                    p,
                    SamplingParams(max_new_tokens=9, temperature=0, prompt_logprobs=3 if i == 1 else None),
                    None,
                )
                for i, p in enumerate(prompts)
            ]
            batch.add(seqs[0])
            batch.step()
            batch.step()
            for s in seqs[1:]:
                batch.add(s)
            while batch:
                batch.step()
        return [(s.tokens, [(lp.id, lp.logprob) for lp in (s.prompt_logprobs or [None])[1:]]) for s in seqs]

    fused = run()
    with monkeypatch.context() as m:
        eager_only(m)
        eager = run()
    for (t1, lp1), (t2, lp2) in zip(fused, eager, strict=True):
        assert t1 == t2
        assert [i for i, _ in lp1] == [i for i, _ in lp2]
        torch.testing.assert_close(
            torch.tensor([p for _, p in lp1]), torch.tensor([p for _, p in lp2]), rtol=0, atol=1e-4
        )


@needs_kernels
def test_decode_batch_chooses_the_fused_pass(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain steps run fused; a pass of more tokens than the fused pass takes (`FusedDecode.max_tokens`, the
    kernels' `max_rows()`, here held to 8) runs eager, and so does every step with a hooked sequence."""
    model = load_ours(tiny)
    calls: list[int] = []
    forward = FusedDecode.forward
    monkeypatch.setattr(
        FusedDecode, "forward", lambda self, tokens, *a: calls.append(len(tokens)) or forward(self, tokens, *a)
    )
    with torch.inference_mode():
        batch = DecodeBatch(model, 2, 128)
        assert batch.fused is not None and batch.fused.max_tokens == kernels.max_rows()
        monkeypatch.setattr(batch.fused, "max_tokens", 8)
        batch.add(new_sequence(model, 0, [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0), None))
        while batch:
            batch.step()
        assert calls == [3, 1, 1]  # the prompt, then two decode steps
        calls.clear()
        batch.add(new_sequence(model, 0, [1] * 9, SamplingParams(max_new_tokens=2, temperature=0), None))
        batch.step()
        assert calls == []  # a prompt of 9 tokens: eager
        batch.step()
        assert calls == [1] and not batch  # its decode step: fused
        calls.clear()
        batch.add(
            new_sequence(
                model, 1, [1, 2], SamplingParams(max_new_tokens=2, temperature=0), None, ["blocks.0.hook_resid_pre"]
            )
        )
        while batch:
            batch.step()
        assert calls == []  # every step has a hooked row


@needs_kernels
def test_a_packed_pass_counts_only_the_tokens_the_fused_pass_gets(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed step lays out a dummy decode token for each row still prefilling, which the fused pass never
    receives: a step of one decode token and a 7-token chunk, beside two rows that wait, fits a fused pass of 8."""
    model = load_ours(tiny)
    calls: list[int] = []
    forward = FusedDecode.forward
    monkeypatch.setattr(
        FusedDecode, "forward", lambda self, tokens, *a: calls.append(len(tokens)) or forward(self, tokens, *a)
    )
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    with torch.inference_mode():
        batch = DecodeBatch(model, 3, 128, prefill_chunk=7)
        assert batch.fused is not None
        monkeypatch.setattr(batch.fused, "max_tokens", 8)
        batch.add(new_sequence(model, 0, [1, 2, 3], greedy, None))
        batch.step()  # its prompt
        batch.add(new_sequence(model, 1, [5] * 7, greedy, None))
        batch.add(new_sequence(model, 2, [6] * 7, greedy, None))
        calls.clear()
        batch.step()  # row 0's decode token and row 1's prompt; row 2 waits for the next chunk
        assert calls == [8]


def test_what_it_cannot_run(tiny: Checkpoint) -> None:
    """bfloat16, a model laid out for prefill only, or a cache not float32: a reason, and no fused pass."""
    model16 = load_weights(tiny.path, dtype="bfloat16", device="cpu")
    cache16 = KVCache(model16.config, 1, 8, dtype=torch.bfloat16, device="cpu")
    assert unsupported(model16, cache16) is not None and FusedDecode.make(model16, cache16) is None
    prefill_only = load_weights(tiny.path, dtype="float32", device="cpu", decode_kernels=False)
    cache = KVCache(prefill_only.config, 1, 8, dtype=torch.float32, device="cpu")
    assert unsupported(prefill_only, cache) is not None
    if kernels.available():
        model = load_ours(tiny)
        assert unsupported(model, cache) is None
        cache64 = KVCache(model.config, 1, 8, dtype=torch.float64, device="cpu")
        assert unsupported(model, cache64) == "the KV cache is not float32 on the CPU"


@needs_kernels
def test_bad_passes_are_clear_errors(tiny: Checkpoint) -> None:
    model = load_ours(tiny)
    with torch.inference_mode():
        cache = prefilled(model, [[1, 2]], max_len=4)
        fused = FusedDecode.make(model, cache)
        assert fused is not None
        with pytest.raises(ValueError, match="outside the vocabulary"):
            fused([50257], [2])
        with pytest.raises(ValueError, match="overflow"):
            fused([1], [4])
        with pytest.raises(ValueError, match="rows in use"):
            fused.forward([1], [3], [2], [0])
        with pytest.raises(ValueError, match="one length"):
            fused.forward([1, 2], [0], [2], [0])
        with pytest.raises(ValueError, match="named twice"):
            fused.forward([1], [0], [2], [0, 0])
        torch.testing.assert_close(fused([5], [2]), model(torch.tensor([[1, 2, 5]]))[:, -1], rtol=0, atol=1e-4)
