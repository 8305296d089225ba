"""The residual-stream measures against numpy on matrices whose answer is known, `analyze` against the
activations it measures, and the rank collapse without skip connections (Dong et al. 2021) on a random
gpt2-small-shaped checkpoint."""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest
import torch
from conftest import Checkpoint, load_ours

from model import analysis
from model.analysis import (
    LayerMeasure,
    LayerStats,
    NextTokenPass,
    ResidualPass,
    Stream,
    analyze,
    attention_entropy,
    collapse,
    effective_rank,
    logit_lens,
    mean_cosine,
    residual_norms,
)
from model.config import GPTConfig
from model.gpt import GPT
from model.hooks import Capture, Hooks
from model.interventions import Edit, EditSpec, HookChain, NonFiniteActivations

RNG = np.random.default_rng(0)
PROMPT = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"


def np_effective_rank(x: np.ndarray) -> float:
    s = np.linalg.svd(x, compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def np_collapse(x: np.ndarray) -> float:
    return float(np.linalg.norm(x - x.mean(axis=0, keepdims=True)) / np.linalg.norm(x))


def np_mean_cosine(x: np.ndarray) -> float:
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    sim = u @ u.T
    n = len(x)
    return float(sim[~np.eye(n, dtype=bool)].mean())


def t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x)


# --- the measures on known matrices -------------------------------------------------------------------


def test_identical_rows_have_collapse_0_and_effective_rank_1() -> None:
    x = np.tile(RNG.normal(size=16), (5, 1))  # 1 vᵀ: the mean token repeated
    assert collapse(t(x)) == pytest.approx(0, abs=1e-12)
    assert effective_rank(t(x)) == pytest.approx(1, abs=1e-6)
    assert mean_cosine(t(x)) == pytest.approx(1)


def test_a_rank_1_matrix_has_effective_rank_1_and_collapse_of_its_row_scales() -> None:
    """u vᵀ is rank 1 but its rows differ in length: collapse measures the distance from *identical* rows,
    ‖u - ū‖/‖u‖, which is 0 only when u is constant."""
    u, v = RNG.normal(size=6), RNG.normal(size=16)
    x = np.outer(u, v)
    assert effective_rank(t(x)) == pytest.approx(1, abs=1e-6)
    assert collapse(t(x)) == pytest.approx(np.linalg.norm(u - u.mean()) / np.linalg.norm(u))
    assert collapse(t(x)) == pytest.approx(np_collapse(x))


@pytest.mark.parametrize("n", [1, 2, 7, 32])
def test_an_identity_has_effective_rank_n(n: int) -> None:
    x = np.eye(n)
    assert effective_rank(t(x)) == pytest.approx(n)
    assert collapse(t(x)) == pytest.approx(math.sqrt((n - 1) / n))  # ‖I − J/n‖ / ‖I‖
    assert mean_cosine(t(x)) == pytest.approx(1.0 if n == 1 else 0.0)  # orthogonal tokens


@pytest.mark.parametrize("shape", [(8, 64), (64, 8), (5, 5)])
def test_measures_match_numpy_on_random_matrices(shape: tuple[int, int]) -> None:
    x = RNG.normal(size=shape) * RNG.uniform(0.1, 10, size=(shape[0], 1)) + RNG.normal(size=shape[1])
    assert effective_rank(t(x)) == pytest.approx(np_effective_rank(x), rel=1e-9)
    assert collapse(t(x)) == pytest.approx(np_collapse(x), rel=1e-9)
    assert mean_cosine(t(x)) == pytest.approx(np_mean_cosine(x), rel=1e-9, abs=1e-12)
    np.testing.assert_allclose(residual_norms(t(x)).numpy(), np.linalg.norm(x, axis=1))
    # float32 input (what the model gives) is measured in float64
    assert effective_rank(t(x).float()) == pytest.approx(np_effective_rank(x), rel=1e-5)


def test_orthogonal_and_opposite_tokens() -> None:
    q, _ = np.linalg.qr(RNG.normal(size=(16, 16)))
    assert mean_cosine(t(q[:5] * np.arange(1, 6)[:, None])) == pytest.approx(0, abs=1e-12)  # lengths don't matter
    v = RNG.normal(size=16)
    assert mean_cosine(t(np.stack([v, -v]))) == pytest.approx(-1)
    assert mean_cosine(t(v[None])) == 1.0  # one token: nothing to compare


def test_the_zero_matrix() -> None:
    x = torch.zeros(4, 8)
    assert effective_rank(x) == 0.0
    assert collapse(x) == 0.0


def test_attention_entropy_of_known_patterns() -> None:
    k = 6
    causal_uniform = np.tril(np.ones((k, k))) / np.arange(1, k + 1)[:, None]  # query q: 1/(q+1) over 0..q
    full_uniform = np.full((k, k), 1 / k)
    one_hot = np.eye(k)
    pattern = t(np.stack([causal_uniform, full_uniform, one_hot]))  # [H=3, T, T]
    want = [np.log(np.arange(1, k + 1)).mean(), np.log(k), 0.0]  # mean over queries of each row's entropy
    np.testing.assert_allclose(attention_entropy(pattern).numpy(), want, atol=1e-12)

    logits = RNG.normal(size=(2, k, k))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(attention_entropy(t(p)).numpy(), (-(p * np.log(p)).sum(-1)).mean(-1))


def test_logit_lens_is_ln_final_then_the_unembedding(tiny_model: GPT) -> None:
    x = torch.randn(3, tiny_model.config.n_embd, generator=torch.Generator().manual_seed(0))
    lens = logit_lens(tiny_model, x, 4)
    with torch.inference_mode():
        probs = torch.softmax(tiny_model.ln_f(x) @ tiny_model.wte.weight.T, dim=-1)
    for pos, top in enumerate(lens):
        assert len(top) == 4
        assert [i for i, _ in top] == probs[pos].topk(4).indices.tolist()
        np.testing.assert_allclose([p for _, p in top], probs[pos].topk(4).values.numpy(), rtol=1e-6)


# --- analyze on the model -------------------------------------------------------------------------


def test_analyze_measures_the_stream_after_every_block(tiny_model: GPT) -> None:
    L, H = tiny_model.config.n_layer, tiny_model.config.n_head
    stats = analyze(tiny_model, PROMPT, top_k=3)
    assert [s.layer for s in stats] == list(range(-1, L))

    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(L)]
    capture = Capture(names + [f"blocks.{i}.attn.hook_pattern" for i in range(L)] + ["logits"])
    with torch.inference_mode():
        tiny_model(torch.tensor([PROMPT]), hooks=capture)
    acts = {k: v[0] for k, v in capture.tensors().items()}
    for s, name in zip(stats, names, strict=True):
        x = acts[name].double().numpy()
        np.testing.assert_allclose(s.norms, np.linalg.norm(x, axis=1), rtol=1e-5)
        assert s.effective_rank == pytest.approx(np_effective_rank(x), rel=1e-5)
        assert s.collapse == pytest.approx(np_collapse(x), rel=1e-5)
        assert s.mean_cosine == pytest.approx(np_mean_cosine(x), rel=1e-4, abs=1e-6)
        assert len(s.logit_lens) == len(PROMPT) and all(len(top) == 3 for top in s.logit_lens)
        if s.layer == -1:
            assert s.attention_entropy is None
        else:
            assert s.attention_entropy is not None and len(s.attention_entropy) == H
            pattern = acts[f"blocks.{s.layer}.attn.hook_pattern"]
            np.testing.assert_allclose(s.attention_entropy, attention_entropy(pattern).numpy())
    # the lens on the last layer's stream is the model's own next-token distribution
    probs = torch.softmax(acts["logits"], dim=-1)
    for pos, top in enumerate(stats[-1].logit_lens):
        assert [i for i, _ in top] == probs[pos].topk(3).indices.tolist()


def test_analyze_without_skip_connections_measures_the_stream_without_them(tiny_model: GPT) -> None:
    every = tuple(range(tiny_model.config.n_layer))
    stats = analyze(tiny_model, PROMPT, 1, EditSpec((), every, every).hooks(tiny_model.config, len(PROMPT)))
    with torch.inference_mode():  # the last stream, by hand: x -> sublayer(ln(x)), no addition
        x = tiny_model.wte(torch.tensor(PROMPT)) + tiny_model.wpe(torch.arange(len(PROMPT)))
        for block in tiny_model.h:
            x = block.attn(block.ln_1(x[None]), None, None)[0]
            x = block.mlp(block.ln_2(x[None]), None)[0]
    np.testing.assert_allclose(stats[-1].norms, x.norm(dim=-1).numpy(), rtol=1e-6)
    assert stats[-1].collapse == pytest.approx(collapse(x))
    normal = analyze(tiny_model, PROMPT, 1)
    assert stats[0].norms == normal[0].norms  # the embeddings are the same
    assert stats[-1].norms != normal[-1].norms


def analyze_all_at_once(model: GPT, ids: list[int], top_k: int, edits: Hooks | None = None) -> list[LayerStats]:
    """`analyze` as it was before it measured layer by layer (the oracle for its numbers): every layer's
    pattern and stream captured in one pass, then measured; the logit lens's softmax over all positions."""
    L = model.config.n_layer
    names = ["blocks.0.hook_resid_pre"]
    names += [f"blocks.{i}.{site}" for i in range(L) for site in ("attn.hook_pattern", "hook_resid_post")]
    capture = Capture(names)
    with torch.inference_mode():
        model(torch.tensor([ids]), hooks=HookChain(edits, capture) if edits is not None else capture)
        acts = {k: v[0].float() for k, v in capture.tensors().items()}
        streams = [acts["blocks.0.hook_resid_pre"]] + [acts[f"blocks.{i}.hook_resid_post"] for i in range(L)]
        out = []
        for i, x in enumerate(streams):
            pattern = acts.get(f"blocks.{i - 1}.attn.hook_pattern")
            w = model.wte.weight
            probs = torch.softmax((model.ln_f(x.to(w.dtype)) @ w.T).float(), dim=-1)  # [T, vocab]
            top = torch.topk(probs, top_k, dim=-1)
            lens = [
                list(zip(i.tolist(), p.tolist(), strict=True)) for i, p in zip(top.indices, top.values, strict=True)
            ]
            entropy = attention_entropy(pattern).tolist() if pattern is not None else None
            out.append(
                LayerStats(
                    i - 1, residual_norms(x).tolist(), effective_rank(x), collapse(x), mean_cosine(x), entropy, lens
                )
            )
    return out


LONG = torch.randint(0, 50257, (100,), generator=torch.Generator().manual_seed(0)).tolist()  # past one lens chunk


@pytest.mark.parametrize("ids", [PROMPT, LONG], ids=["8 tokens", "100 tokens"])
@pytest.mark.parametrize("edits", ["none", "interventions", "no skips"])
def test_analyze_layer_by_layer_gives_the_numbers_of_all_at_once(tiny_model: GPT, ids: list[int], edits: str) -> None:
    every = tuple(range(tiny_model.config.n_layer))
    spec = {
        "none": None,
        "interventions": EditSpec(
            (Edit("blocks.0.hook_attn_out", "scale", factor=0.5), Edit("blocks.1.hook_mlp_out", "mean"))
        ),
        "no skips": EditSpec((), every, every),
    }[edits]

    def hooks() -> Hooks | None:
        return spec.hooks(tiny_model.config, len(ids)) if spec is not None else None

    assert analyze(tiny_model, ids, 3, hooks()) == analyze_all_at_once(tiny_model, ids, 3, hooks())


def test_the_logit_lens_in_chunks_of_positions_equals_it_whole(tiny_model: GPT) -> None:
    x = torch.randn(20, tiny_model.config.n_embd, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert logit_lens(tiny_model, x, 4, chunk=3) == logit_lens(tiny_model, x, 4, chunk=20)


def test_analyze_holds_one_layer_s_attention_pattern_at_a_time(tiny_model: GPT) -> None:
    """At each layer's pattern, how many earlier layers' patterns are still in memory (their storage, which
    a capture's detached copy would keep): none. Capturing them all held L of them by the end."""
    seen: list[weakref.ref[torch.UntypedStorage]] = []
    alive: list[int] = []

    class Count:
        def active(self, name: str) -> bool:
            return False

        def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
            if name.endswith("attn.hook_pattern"):
                alive.append(sum(ref() is not None for ref in seen))
                seen.append(weakref.ref(x.untyped_storage()))
            return x

    L = tiny_model.config.n_layer
    analyze(tiny_model, PROMPT, 3, Count())
    assert alive == [0] * L
    alive.clear()
    seen.clear()
    analyze_all_at_once(tiny_model, PROMPT, 3, Count())  # the count can tell: the old way keeps them all
    assert alive == list(range(L))


def test_a_stream_is_measured_as_the_pass_handed_it_over(tiny_model: GPT) -> None:
    """The pass keeps each layer's stream for a later job to measure: a copy, so a hook further on that
    changes its tensor in place (block 1's resid_pre is block 0's resid_post) changes nothing measured."""

    class ZeroInPlace:
        def active(self, name: str) -> bool:
            return name == "blocks.1.hook_resid_pre"

        def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
            return x.zero_() if name == "blocks.1.hook_resid_pre" else x

    stats, plain = analyze(tiny_model, PROMPT, 3, ZeroInPlace()), analyze(tiny_model, PROMPT, 3)
    assert stats[:2] == plain[:2]  # the embeddings and layer 0: as without the hook
    assert stats[2].norms != plain[2].norms  # layer 1: after a zero stream


def test_analyze_holds_no_stream_it_has_measured(tiny_model: GPT, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stream is measured as soon as the pass hands it over, before the next block runs, and let go of
    once measured: when a layer's measures begin, no stream measured before it is still in memory. All kept
    until the pass ended would be L + 1 at the end."""
    seen: list[weakref.ref[torch.UntypedStorage]] = []
    alive: list[int] = []

    class Counted(LayerMeasure):
        def __init__(self, stream: Stream, top_k: int, edited: bool) -> None:
            alive.append(sum(ref() is not None for ref in seen))
            seen.append(weakref.ref(stream.x.untyped_storage()))
            super().__init__(stream, top_k, edited)

    monkeypatch.setattr(analysis, "LayerMeasure", Counted)
    analyze(tiny_model, PROMPT, 3)
    assert alive == [0] * (tiny_model.config.n_layer + 1)


def test_a_layer_is_measured_in_parts_of_its_positions(tiny_model: GPT, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LayerMeasure`: the stream's own measures and the lens of the first `lens_positions` positions, then
    the lens of each next ones, one `step` each; the same numbers as in one part."""
    (stream,) = [s for s in ResidualPass(tiny_model.config, LONG).step(tiny_model) if s.layer == 0]
    whole = LayerMeasure(stream, 3, False)
    whole.step(tiny_model)
    assert whole.done
    monkeypatch.setattr(LayerMeasure, "lens_positions", 30)
    parts, steps = LayerMeasure(stream, 3, False), 0
    while not parts.done:
        parts.step(tiny_model)
        steps += 1
    assert steps == 4  # 100 positions, 30 a part
    got, want = parts.result(), whole.result()
    assert (got.layer, got.norms, got.effective_rank, got.collapse, got.mean_cosine) == (
        want.layer, want.norms, want.effective_rank, want.collapse, want.mean_cosine
    )  # fmt: skip
    assert [[i for i, _ in top] for top in got.logit_lens] == [[i for i, _ in top] for top in want.logit_lens]
    np.testing.assert_allclose(
        [[p for _, p in top] for top in got.logit_lens], [[p for _, p in top] for top in want.logit_lens], rtol=1e-6
    )


def test_the_pass_runs_a_block_a_step_and_keeps_its_error_for_after_the_streams_before_it(tiny_model: GPT) -> None:
    """`ResidualPass.step`: the embeddings' and block 0's streams first, then one a block; an error (a
    LayerNorm's variance overflowing in block 1's MLP input) ends the pass, kept until `raise_error`, after
    the streams before it were handed over; a prompt past the context is such an error too."""
    huge = EditSpec((Edit("blocks.1.hook_mlp_in", "scale", factor=1e19, positions=(2,)),))
    run = ResidualPass(tiny_model.config, PROMPT, huge.hooks(tiny_model.config, len(PROMPT)))
    assert [s.layer for s in run.step(tiny_model)] == [-1, 0] and not run.done
    assert run.step(tiny_model) == [] and run.done  # block 1 ends in the error, before its stream
    with pytest.raises(NonFiniteActivations, match=r"blocks\.1\.ln2"):
        run.raise_error()
    plain = ResidualPass(tiny_model.config, PROMPT)
    layers = [[s.layer for s in plain.step(tiny_model)] for _ in range(tiny_model.config.n_layer)]
    assert layers == [[-1, 0]] + [[i] for i in range(1, tiny_model.config.n_layer)] and plain.done
    plain.raise_error()  # none
    too_long = ResidualPass(tiny_model.config, [0] * (tiny_model.config.n_positions + 1))
    assert too_long.step(tiny_model) == [] and too_long.done
    with pytest.raises(ValueError, match="exceeds the context"):
        too_long.raise_error()


# --- rank collapse on the gpt2-small shape -----------------------------------------------------------


def test_without_skip_connections_the_stream_collapses_to_one_token(small: Checkpoint) -> None:
    """Pure attention (with its MLPs, but no skip connections) drives the token vectors together; with
    the skips they stay apart. Random weights, gpt2-small's shape, a 32-token prompt."""
    model = load_ours(small)
    L = model.config.n_layer
    ids = torch.randint(0, model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    every = tuple(range(L))
    normal = analyze(model, ids, 1)
    ablated = analyze(model, ids, 1, EditSpec((), every, every).hooks(model.config, len(ids)))

    print("\nlayer  collapse with / without skips   effective rank with / without   mean cosine with / without")
    for a, b in zip(normal, ablated, strict=True):
        print(
            f"{a.layer:>5}  {a.collapse:8.4f} / {b.collapse:8.4f}"
            f"   {a.effective_rank:7.2f} / {b.effective_rank:7.2f}   {a.mean_cosine:6.3f} / {b.mean_cosine:6.3f}"
        )
    last, last_ablated = normal[-1], ablated[-1]
    print(f"last layer: collapse {last.collapse:.4f} with skips, {last_ablated.collapse:.4f} without")
    assert last_ablated.collapse < 0.1 * last.collapse
    assert last_ablated.effective_rank < 1.5 < 0.5 * last.effective_rank
    assert last_ablated.mean_cosine > 0.99
    assert ablated[0].collapse > ablated[L // 2].collapse > last_ablated.collapse  # it falls with depth


def test_analyze_refuses_bad_input_in_words(tiny_model: GPT) -> None:
    """No prompt, an id past the vocabulary, a top_k outside 1..vocab, and an EditSpec where its hooks go:
    each a clear error, not an indexing or shape error from deep in the pass."""
    for ids, top_k, says in (
        ([], 3, "non-empty list of ints"),
        ([60000], 3, "token id 60000 is outside the vocabulary"),
        ([1, 2, 3], 0, "top_k must be an int in 1..50257"),
        ([1, 2, 3], 10**6, "top_k must be an int in 1..50257"),
    ):
        with pytest.raises(ValueError, match=says):
            analyze(tiny_model, ids, top_k)
    from model.hooks import run_with_cache  # as `run_with_cache` says it (it failed deep in the pass)

    with pytest.raises(TypeError, match=r"edits are hooks \(EditSpec.hooks"):
        run_with_cache(tiny_model, [1, 2], ["blocks.0.hook_resid_pre"], edits=EditSpec())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"edits are hooks \(EditSpec.hooks"):
        analyze(tiny_model, [1, 2, 3], 3, edits=EditSpec())  # type: ignore[arg-type]


def test_top_k_beyond_the_vocabulary_is_a_clear_error() -> None:
    """A toy model of 10 tokens asked for its 20 most likely next tokens: a ValueError that says so, from the
    analysis and from the next-token pass alike, not torch.topk's from the end of the pass."""
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=8, vocab_size=10)
    model = GPT(config).eval()
    for run in (lambda: analyze(model, [1, 2, 3], top_k=20), lambda: NextTokenPass(config, [1, 2, 3], top_k=20)):
        with pytest.raises(ValueError, match=r"top_k must be an int in 1\.\.10 \(the vocabulary\), got 20"):
            run()
