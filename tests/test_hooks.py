"""Hook points and capture: names, shapes, the residual-stream identities, causal patterns, activations
captured during generation, glob selection, and that a capture leaves nothing behind on the model."""

from __future__ import annotations

import pytest
import torch

from model.generate import SamplingParams, generate, new_sequence
from model.gpt import GPT, CausalSelfAttention
from model.hooks import Capture, HookPoint, UnknownHookError, describe_hook_names, hook_names, select_hooks
from model.interventions import HookChain, Interventions

BATCH, POS = 2, 13


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 50257, (BATCH, POS), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def acts(tiny_model: GPT, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every hook of one forward pass of the tiny model."""
    capture = Capture(tiny_model.hook_names)
    with torch.no_grad():
        logits = tiny_model(ids, hooks=capture)
    tensors = capture.tensors()
    assert torch.equal(tensors["logits"], logits)
    return tensors


def test_hook_names_are_the_modules_hook_points(tiny_model: GPT) -> None:
    """Every HookPoint in the model is listed, once, in forward order, and a name is where the point is."""
    points = [m.name for m in tiny_model.modules() if isinstance(m, HookPoint)]
    assert sorted(points) == sorted(tiny_model.hook_names)
    assert len(set(points)) == len(points) == 2 + 23 * 2 + 5
    names = hook_names(2)
    assert names[:3] == ["hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre"]
    assert names[-6:] == [
        "blocks.1.hook_resid_post",
        "ln_final.hook_scale",
        "ln_final.hook_normalized",
        "unembed.hook_in",
        "unembed.hook_out",
        "logits",
    ]
    assert tiny_model.h[1].attn.hook_pattern.name == "blocks.1.attn.hook_pattern"
    assert tiny_model.h[0].ln_2.hook_normalized.name == "blocks.0.ln2.hook_normalized"


def test_every_hook_is_captured_with_transformer_lens_shapes(tiny_model: GPT, acts: dict[str, torch.Tensor]) -> None:
    cfg = tiny_model.config
    C, H, D, M = cfg.n_embd, cfg.n_head, cfg.d_head, cfg.d_mlp
    assert list(acts) == tiny_model.hook_names
    expected = {
        "hook_embed": (BATCH, POS, C),
        "hook_pos_embed": (BATCH, POS, C),
        "ln_final.hook_scale": (BATCH, POS, 1),
        "ln_final.hook_normalized": (BATCH, POS, C),
        "unembed.hook_in": (BATCH, POS, C),
        "unembed.hook_out": (BATCH, POS, cfg.vocab_size),
        "logits": (BATCH, POS, cfg.vocab_size),
    }
    for layer in range(cfg.n_layer):
        b = f"blocks.{layer}."
        for site in ("hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid", "hook_mlp_in"):
            expected[b + site] = (BATCH, POS, C)
        for site in ("ln1.hook_scale", "ln2.hook_scale"):
            expected[b + site] = (BATCH, POS, 1)
        for site in ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", "attn.hook_result"):
            expected[b + site] = (BATCH, POS, H, C)
        for site in ("ln2.hook_normalized", "hook_mlp_out", "hook_resid_post"):
            expected[b + site] = (BATCH, POS, C)
        for site in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z"):
            expected[b + site] = (BATCH, POS, H, D)
        for site in ("attn.hook_attn_scores", "attn.hook_pattern"):
            expected[b + site] = (BATCH, H, POS, POS)
        for site in ("mlp.hook_pre", "mlp.hook_post"):
            expected[b + site] = (BATCH, POS, M)
    assert {name: tuple(t.shape) for name, t in acts.items()} == expected


def test_residual_stream_identities(tiny_model: GPT, acts: dict[str, torch.Tensor]) -> None:
    assert torch.equal(acts["blocks.0.hook_resid_pre"], acts["hook_embed"] + acts["hook_pos_embed"])
    for layer in range(tiny_model.config.n_layer):
        b = f"blocks.{layer}."
        assert torch.equal(acts[b + "hook_resid_mid"], acts[b + "hook_resid_pre"] + acts[b + "hook_attn_out"])
        assert torch.equal(acts[b + "hook_resid_post"], acts[b + "hook_resid_mid"] + acts[b + "hook_mlp_out"])
        if layer + 1 < tiny_model.config.n_layer:
            assert torch.equal(acts[f"blocks.{layer + 1}.hook_resid_pre"], acts[b + "hook_resid_post"])
    # the MLP's activation is GELU (tanh form) of its pre-activation
    post = torch.nn.functional.gelu(acts["blocks.0.mlp.hook_pre"], approximate="tanh")
    assert torch.equal(acts["blocks.0.mlp.hook_post"], post)


def test_patterns_are_causal_distributions(tiny_model: GPT, acts: dict[str, torch.Tensor]) -> None:
    future = torch.ones(POS, POS, dtype=torch.bool).triu(diagonal=1)
    for layer in range(tiny_model.config.n_layer):
        pattern = acts[f"blocks.{layer}.attn.hook_pattern"]
        scores = acts[f"blocks.{layer}.attn.hook_attn_scores"]
        assert (pattern[..., future] == 0).all()
        assert (pattern[..., ~future] > 0).all()
        assert torch.isneginf(scores[..., future]).all()
        assert torch.isfinite(scores[..., ~future]).all()
        torch.testing.assert_close(pattern.sum(-1), torch.ones(BATCH, tiny_model.config.n_head, POS))
        torch.testing.assert_close(pattern, torch.softmax(scores, dim=-1))


def test_scores_are_scaled_dot_products_of_q_and_k(acts: dict[str, torch.Tensor]) -> None:
    q, k = acts["blocks.1.attn.hook_q"], acts["blocks.1.attn.hook_k"]  # [batch, pos, head, d_head]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    visible = torch.ones(POS, POS, dtype=torch.bool).tril()
    got = acts["blocks.1.attn.hook_attn_scores"]
    torch.testing.assert_close(got[..., visible], scores[..., visible])
    # z is the pattern-weighted sum of v
    z = torch.einsum("bhqk,bkhd->bqhd", acts["blocks.1.attn.hook_pattern"], acts["blocks.1.attn.hook_v"])
    torch.testing.assert_close(acts["blocks.1.attn.hook_z"], z)


def test_activations_of_a_generation_equal_one_forward_pass_over_the_result(tiny_model: GPT) -> None:
    """Prefill plus one-token decode steps, glued together, give what one pass over the final sequence gives."""
    prompt = [464, 2068, 7586, 21831, 18045, 625]
    params = SamplingParams(max_new_tokens=9, temperature=0.8, seed=4, ignore_eos=True)
    [completion] = generate(tiny_model, [prompt], params, hooks=tiny_model.hook_names)  # the optional ones too
    assert completion.activations is not None and len(completion.token_ids) == 9
    sequence = completion.prompt_ids + completion.token_ids
    capture = Capture(tiny_model.hook_names)
    with torch.no_grad():
        tiny_model(torch.tensor([sequence]), hooks=capture)
    expected = capture.tensors()
    assert list(completion.activations) == list(expected) == tiny_model.hook_names
    for name, want in expected.items():
        got = completion.activations[name]
        assert got.shape == want.shape, name
        assert got.shape[2 if "attn_scores" in name or "pattern" in name else 1] == len(sequence), name
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=name)


def test_a_capture_in_another_dtype_keeps_each_chunk_cast(tiny_model: GPT) -> None:
    """`Capture(names, dtype)` casts each value as it is captured (a float16 dump of a float32 model is never
    held in float32): a generation's chunks, joined, equal the float32 capture cast afterwards, bit for bit."""
    names = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_attn_scores", "blocks.1.attn.hook_pattern", "logits"]
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    [wide] = generate(tiny_model, [[464, 2068, 7586]], params, hooks=names)
    capture = Capture(names, torch.float16)
    state = new_sequence(tiny_model, 0, [464, 2068, 7586], params, None, names, capture_dtype=torch.float16)
    assert state.capture is not None and state.capture.dtype == torch.float16
    x = torch.randn(1, 3, 64)
    assert capture("logits", x) is x  # the pass goes on with its own value
    assert capture._chunks["logits"][0].dtype == torch.float16
    [narrow] = generate(tiny_model, [[464, 2068, 7586]], params, hooks=names, capture_dtype=torch.float16)
    assert narrow.token_ids == wide.token_ids
    assert wide.activations is not None and narrow.activations is not None
    for name in names:
        got, want = narrow.activations[name], wide.activations[name]
        assert got.dtype == torch.float16 and torch.equal(got, want.half()), name  # -inf scores included


def test_a_capture_holds_one_sequence(tiny_model: GPT) -> None:
    """A Capture glues one sequence's passes (a prompt, then its decode steps): a second pass from position 0
    is refused, where its values were glued to the first's ([1, 7, C] of prompts of 3 and 4). A capture's
    dtype is a floating torch dtype."""
    cap = Capture(["blocks.0.hook_resid_pre"])
    with torch.no_grad():
        tiny_model(torch.tensor([[1, 2, 3]]), hooks=cap)
        with pytest.raises(ValueError, match="holds the values of an earlier forward pass"):
            tiny_model(torch.tensor([[4, 5, 6, 7]]), hooks=cap)
    assert cap.tensors()["blocks.0.hook_resid_pre"].shape == (1, 3, 64)  # the first pass's, untouched
    chained = Capture(["blocks.0.hook_resid_pre"])  # behind edits, as `EditSpec.hooks(..., then=capture)` puts it
    with torch.no_grad():
        tiny_model(torch.tensor([[1, 2, 3]]), hooks=HookChain(Interventions((), tiny_model.config, 3), chained))
        with pytest.raises(ValueError, match="holds the values of an earlier forward pass"):
            tiny_model(torch.tensor([[4, 5, 6, 7]]), hooks=HookChain(Interventions((), tiny_model.config, 4), chained))
    for dtype in (torch.int8, torch.bool, "float16"):
        with pytest.raises(ValueError, match="a floating torch dtype"):
            Capture(["logits"], dtype)  # type: ignore[arg-type]


def test_generation_captures_only_the_selected_hooks_per_prompt(tiny_model: GPT) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    results = generate(tiny_model, prompts, params, hooks=["blocks.*.hook_resid_post", "blocks.1.attn.hook_pattern"])
    for prompt, c in zip(prompts, results, strict=True):
        assert c.activations is not None
        assert list(c.activations) == [
            "blocks.0.hook_resid_post",
            "blocks.1.attn.hook_pattern",
            "blocks.1.hook_resid_post",
        ]
        n = len(prompt) + 4
        assert c.activations["blocks.1.hook_resid_post"].shape == (1, n, 64)
        assert c.activations["blocks.1.attn.hook_pattern"].shape == (1, 4, n, n)
    # and the tokens are those of a generation without hooks
    plain = generate(tiny_model, prompts, params)
    assert [c.token_ids for c in plain] == [c.token_ids for c in results]


def test_no_hooks_means_no_activations_and_the_same_output(tiny_model: GPT, ids: torch.Tensor) -> None:
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    assert generate(tiny_model, [[1, 2, 3]], params)[0].activations is None
    assert generate(tiny_model, [[1, 2, 3]], params, hooks=[])[0].activations is None
    empty = Capture([])
    with torch.no_grad():
        plain = tiny_model(ids)
        with_empty = tiny_model(ids, hooks=empty)
    assert torch.equal(plain, with_empty)
    assert empty.tensors() == {}
    assert not any(empty.active(n) for n in tiny_model.hook_names)


def test_explicit_attention_only_when_scores_or_patterns_are_asked_for(
    tiny_model: GPT, ids: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    explicit = CausalSelfAttention._explicit_attention

    def spy(self: CausalSelfAttention, *args: object) -> torch.Tensor:
        calls.append(self.layer)
        return explicit(self, *args)

    monkeypatch.setattr(CausalSelfAttention, "_explicit_attention", spy)
    with torch.no_grad():
        tiny_model(ids)
        tiny_model(ids, hooks=Capture(["blocks.0.attn.hook_z", "blocks.1.hook_resid_post", "logits"]))
        assert calls == []  # the fused kernel: capture of other hooks costs no slower path
        tiny_model(ids, hooks=Capture(["blocks.1.attn.hook_pattern"]))
        assert calls == [1]
        tiny_model(ids, hooks=Capture(["blocks.0.attn.hook_attn_scores"]))
        assert calls == [1, 0]


def test_a_hook_can_edit_the_forward_pass(tiny_model: GPT, ids: torch.Tensor) -> None:
    """What a Hooks object returns is what the forward pass continues with."""

    class ZeroAttention:
        def active(self, name: str) -> bool:
            return name == "blocks.0.hook_attn_out"

        def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(x) if self.active(name) else x

    capture = Capture(["blocks.0.hook_resid_pre", "blocks.0.hook_resid_mid"])

    class Both:
        def active(self, name: str) -> bool:
            return capture.active(name) or ZeroAttention().active(name)

        def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
            return capture(name, ZeroAttention()(name, x))

    with torch.no_grad():
        edited = tiny_model(ids, hooks=Both())
        plain = tiny_model(ids)
    t = capture.tensors()
    assert torch.equal(t["blocks.0.hook_resid_mid"], t["blocks.0.hook_resid_pre"])
    assert not torch.allclose(edited, plain)


def test_glob_selection_in_model_order() -> None:
    assert select_hooks(["blocks.*.hook_resid_post"], 3) == [f"blocks.{i}.hook_resid_post" for i in range(3)]
    assert select_hooks(["blocks.1.attn.*"], 2) == [
        "blocks.1.attn.hook_q",
        "blocks.1.attn.hook_k",
        "blocks.1.attn.hook_v",
        "blocks.1.attn.hook_attn_scores",
        "blocks.1.attn.hook_pattern",
        "blocks.1.attn.hook_z",
    ]
    # exact names and patterns together, duplicates once, in the order of the forward pass
    assert select_hooks(["logits", "hook_embed", "blocks.0.hook_resid_pre", "*embed"], 2) == [
        "hook_embed",
        "hook_pos_embed",
        "blocks.0.hook_resid_pre",
        "logits",
    ]
    # globs reach the optional hooks only when they spell the site out
    assert select_hooks(["*"], 2) == hook_names(2, optional=False)
    assert select_hooks(["blocks.*.attn.hook_result", "*hook_mlp_in"], 2) == [
        "blocks.0.attn.hook_result",
        "blocks.0.hook_mlp_in",
        "blocks.1.attn.hook_result",
        "blocks.1.hook_mlp_in",
    ]
    assert select_hooks(["blocks.[01].mlp.hook_p?st"], 4) == ["blocks.0.mlp.hook_post", "blocks.1.mlp.hook_post"]


@pytest.mark.parametrize(
    "pattern", ["blocks.0.hook_resid", "blocks.2.hook_resid_post", "blocks.*.attn.hook_nope", "resid_post", ""]
)
def test_unknown_hook_names_are_refused_with_the_valid_names(pattern: str) -> None:
    with pytest.raises(UnknownHookError) as info:
        select_hooks([pattern], 2)
    message = str(info.value)
    assert repr(pattern) in message
    if pattern:
        assert "valid names are" in message
        assert describe_hook_names(2) in message
        assert "blocks.{0..1}.hook_resid_post" in message and "attn.hook_pattern" in message


def test_generation_refuses_unknown_hooks(tiny_model: GPT) -> None:
    with pytest.raises(UnknownHookError, match=r"blocks\.9\.hook_resid_post"):
        generate(tiny_model, [[1, 2]], SamplingParams(max_new_tokens=1), hooks=["blocks.9.hook_resid_post"])


def test_a_capture_leaves_nothing_on_the_model(tiny_model: GPT, ids: torch.Tensor) -> None:
    def attributes() -> dict[str, list[str]]:
        return {name: sorted(vars(m)) for name, m in tiny_model.named_modules()}

    with torch.no_grad():
        before = tiny_model(ids)
        state_before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
        attributes_before = attributes()
        capture = Capture(tiny_model.hook_names)
        tiny_model(ids, hooks=capture)
        for module in tiny_model.modules():  # no module kept a reference to the capture
            assert not any(v is capture for v in vars(module).values())
        n_chunks = {n: len(c) for n, c in capture._chunks.items()}
        after = tiny_model(ids)
    for module in tiny_model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
        assert not getattr(module, "_forward_hooks_with_kwargs", None)
    from torch.nn.modules import module as nn_module

    assert not nn_module._global_forward_hooks and not nn_module._global_forward_pre_hooks
    assert torch.equal(before, after)
    assert {n: len(c) for n, c in capture._chunks.items()} == n_chunks  # it saw nothing of the later pass
    assert all(torch.equal(v, state_before[k]) for k, v in tiny_model.state_dict().items())
    assert sorted(vars(tiny_model.h[0].hook_resid_pre)) == sorted(vars(HookPoint("x")))
    assert attributes() == attributes_before


def test_two_captures_do_not_see_each_other(tiny_model: GPT, ids: torch.Tensor) -> None:
    a, b = Capture(["blocks.0.hook_resid_post"]), Capture(["blocks.1.hook_resid_post"])
    with torch.no_grad():
        tiny_model(ids[:1], hooks=a)
        tiny_model(ids, hooks=b)
    assert list(a.tensors()) == ["blocks.0.hook_resid_post"] and a.tensors()["blocks.0.hook_resid_post"].shape[0] == 1
    assert list(b.tensors()) == ["blocks.1.hook_resid_post"] and b.tensors()["blocks.1.hook_resid_post"].shape[0] == 2


def test_capture_glues_chunks_into_one_sequence() -> None:
    """[batch, pos, ...] chunks join along pos; attention squares are widened with the masked values."""
    capture = Capture(["blocks.0.hook_resid_pre", "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_attn_scores"])
    capture("blocks.0.hook_resid_pre", torch.ones(1, 3, 4))
    capture("blocks.0.hook_resid_pre", torch.zeros(1, 1, 4))
    capture("blocks.0.attn.hook_pattern", torch.full((1, 2, 3, 3), 0.5))
    capture("blocks.0.attn.hook_pattern", torch.full((1, 2, 1, 4), 0.25))
    capture("blocks.0.attn.hook_attn_scores", torch.zeros(1, 2, 3, 3))
    capture("blocks.0.attn.hook_attn_scores", torch.ones(1, 2, 1, 4))
    capture("logits", torch.ones(1))  # not asked for: ignored
    t = capture.tensors()
    assert list(t) == ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_pattern", "blocks.0.attn.hook_attn_scores"]
    assert t["blocks.0.hook_resid_pre"].shape == (1, 4, 4)
    pattern, scores = t["blocks.0.attn.hook_pattern"], t["blocks.0.attn.hook_attn_scores"]
    assert pattern.shape == scores.shape == (1, 2, 4, 4)
    assert (pattern[..., :3, 3] == 0).all() and (pattern[..., 3, :] == 0.25).all()
    assert torch.isneginf(scores[..., :3, 3]).all() and (scores[..., 3, :] == 1).all()


def test_hooks_fire_in_the_order_hook_names_lists_them(tiny_model: GPT) -> None:
    """`hook_names` is the firing order (what `StopAfter` relies on to end a pass after the last wanted)."""

    class Recorder:
        def __init__(self) -> None:
            self.seen: list[str] = []

        def active(self, name: str) -> bool:
            return True

        def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(name)
            return x

    recorder = Recorder()
    with torch.inference_mode():
        tiny_model(torch.tensor([[1, 2, 3]]), hooks=recorder)
    assert recorder.seen == tiny_model.hook_names


def test_run_with_cache_stops_after_the_last_wanted_hook(tiny_model: GPT) -> None:
    from model.hooks import run_with_cache

    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    names = select_hooks(["blocks.0.hook_resid_post", "blocks.0.attn.hook_pattern", "blocks.0.hook_q_input"], 2)
    full = Capture([*names, "logits"])
    seen: list[str] = []

    class Spy(Capture):
        def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
            seen.append(name)
            return super().__call__(name, x)

    with torch.inference_mode():
        tiny_model(ids, hooks=full)
        got = run_with_cache(tiny_model, ids, names, edits=Spy([]))
    assert list(got) == names
    for name in names:
        assert torch.equal(got[name], full.tensors()[name]), name
    assert seen[-1] == "blocks.0.hook_resid_post" and "blocks.1.hook_resid_pre" not in seen  # block 1 never ran


@pytest.mark.parametrize(
    ("names", "says"),
    [
        (["blocks.*.hook_resid_post"], "is a pattern; Capture takes exact names: expand it with select_hooks"),
        (["blocks.0.hook_resid_psot"], "unknown hook 'blocks.0.hook_resid_psot'"),
        (["bogus"], "valid names are hook_embed, hook_pos_embed, blocks.L.hook_resid_pre"),
        (["blocks.01.hook_resid_post"], "unknown hook 'blocks.01.hook_resid_post'"),  # no GPT-2 spells it so
        (["blocks.\u00b2.hook_resid_post"], "unknown hook"),  # str.isdigit() took a superscript two
        (["blocks.\u0663.hook_resid_post"], "unknown hook"),  # and an Arabic-Indic three
        ("bogus", "unknown hook 'bogus'"),  # one string: one name (it was read letter by letter)
    ],
)
def test_a_capture_refuses_names_that_would_capture_nothing(names: list[str], says: str) -> None:
    """A glob or a misspelt name once captured nothing and said nothing (tensors() then lacked the key)."""
    with pytest.raises(UnknownHookError) as e:
        Capture(names)
    assert says in str(e.value)


def test_run_with_cache_takes_globs_and_any_order_and_refuses_unknown_names(tiny_model: GPT) -> None:
    """Names as `select_hooks` takes them: globs expanded, put in model order (the pass ends at the last in
    model order, so a later name listed first was once never reached), unknown ones refused; a list of ids
    is one sequence."""
    from model.hooks import run_with_cache

    ids = [5, 6, 7, 8]
    with torch.inference_mode():
        full = Capture(["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"])
        tiny_model(torch.tensor([ids]), hooks=full)
        got = run_with_cache(tiny_model, ids, ["blocks.1.hook_resid_post", "blocks.*.hook_resid_pre"])
    assert list(got) == ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    for name, value in got.items():
        assert torch.equal(value, full.tensors()[name]), name
    for bad in (["blocks.2.hook_resid_post"], ["blocks.0.hook_nope"]):
        with pytest.raises(UnknownHookError, match="no hook point matches it"):
            run_with_cache(tiny_model, ids, bad)


def test_a_capture_after_the_lm_head_runs_it_a_part_a_step(tiny_model: GPT, monkeypatch: pytest.MonkeyPatch) -> None:
    """`CapturePass` (a steering vector's prompts on the server, a job a step) runs the head over a prompt in
    parts of `HEAD_POSITIONS` where the logits are asked for, one part for a capture before the head's product
    (ln_final, unembed.hook_in); the values glued together are one forward pass's."""
    import model.hooks
    from model.hooks import CapturePass

    monkeypatch.setattr(model.hooks, "HEAD_POSITIONS", 3)
    ids = [464, 3797, 3332, 319, 262, 2603, 780, 340]
    L = tiny_model.config.n_layer
    for names, head_steps in ((["unembed.hook_in", "logits"], 3), (["ln_final.hook_normalized"], 1)):
        run, steps = CapturePass(tiny_model.config, ids, names), 0
        while not run.done:
            run.step(tiny_model)
            steps += 1
        assert steps == L + head_steps, names
        capture = Capture(names)
        with torch.inference_mode():
            tiny_model(torch.tensor([ids]), hooks=capture)
        want, got = capture.tensors(), run.tensors()
        assert list(got) == names
        for name in names:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_selection_errors_say_why(tiny_model: GPT) -> None:
    """A glob that would match only optional hook points says so, with the spelling that selects them; no
    names at all, or token ids that are not a batch of the vocabulary's, are errors in words."""
    from model.hooks import run_with_cache

    with pytest.raises(UnknownHookError, match=r"matches only optional hook points .*'blocks\.\*\.hook_q_input'"):
        select_hooks(["*q_input"], 2)
    with pytest.raises(UnknownHookError, match=r"'blocks\.\*\.attn\.hook_result'"):
        select_hooks(["blocks.0.attn.hook_res*"], 2)
    with pytest.raises(UnknownHookError, match="no hook names given"):
        run_with_cache(tiny_model, [1, 2], [])
    vocab = tiny_model.config.vocab_size
    for ids, says in [
        (torch.tensor([1, 2, 3]), "shaped \\[batch, pos\\]"),
        (torch.zeros(1, 0, dtype=torch.long), "not empty"),
        (torch.ones(1, 3), "integers"),
        (torch.ones(1, 3, dtype=torch.bool), "int64 or int32: convert others with .long\\(\\)"),  # not torch's error
        (torch.ones(1, 3, dtype=torch.uint8), "got torch.uint8 \\[1, 3\\]"),
        (torch.ones(1, 3, dtype=torch.int16), "got torch.int16"),
        ([], "non-empty list of ints"),
        ([1, vocab], f"token id {vocab} is outside the vocabulary"),
        (torch.tensor([[0, -1]]), "token id -1 is outside the vocabulary"),
    ]:
        with pytest.raises(ValueError, match=says):
            run_with_cache(tiny_model, ids, ["hook_embed"])


def test_a_generations_activations_are_tensors_autograd_can_use(tiny_model: GPT) -> None:
    """Prompt-only or generated, a `generate`'s activations are ordinary tensors: a probe can train on them
    (a prompt-only one was an inference-mode tensor, which autograd refuses to save)."""
    w = torch.zeros(64, requires_grad=True)
    for n in (0, 2):
        (c,) = generate(tiny_model, [[5, 6, 7]], SamplingParams(max_new_tokens=n), hooks=["blocks.0.hook_resid_post"])
        assert c.activations is not None
        x = c.activations["blocks.0.hook_resid_post"]
        assert not x.is_inference()
        (x @ w).pow(2).sum().backward()  # inference tensors cannot be saved for backward
