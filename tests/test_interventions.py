"""Interventions and residual ablation, checked against the forward pass written out by hand from the
model's own modules, against the values seen at the hook point just before the edit, and (for causal
edits) generation with the KV cache against one forward pass over the final sequence."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from model.generate import SamplingParams, generate
from model.gpt import GPT
from model.hooks import Capture, Hooks, run_with_cache
from model.interventions import Edit, EditSpec, HookChain, InterventionError, Interventions, ResidualAblation

PROMPT = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
T = len(PROMPT)

Change = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, value [1, T, C]) -> new value


def by_hand(
    model: GPT,
    ids: list[int],
    *,
    attn: Change | None = None,
    mlp: Change | None = None,
    resid_mid: Change | None = None,
    resid_post: Change | None = None,
    no_skip_attn: tuple[int, ...] = (),
    no_skip_mlp: tuple[int, ...] = (),
) -> torch.Tensor:
    """The Pre-LN forward pass spelled out from the model's modules, with changes to sub-layer outputs and
    to the stream, and sub-layers run without their skip connection. Logits [1, T, vocab]."""
    idx = torch.tensor([ids])
    x = model.wte(idx) + model.wpe(torch.arange(len(ids)))  # [1, T, C]
    for i, block in enumerate(model.h):
        a = block.attn(block.ln_1(x), None, None)
        a = attn(i, a) if attn else a
        x = a if i in no_skip_attn else x + a
        x = resid_mid(i, x) if resid_mid else x
        m = block.mlp(block.ln_2(x), None)
        m = mlp(i, m) if mlp else m
        x = m if i in no_skip_mlp else x + m
        x = resid_post(i, x) if resid_post else x
    return model.lm_head(model.ln_f(x), model.wte.weight)


def run(model: GPT, spec: EditSpec | Hooks | None, ids: list[int] = PROMPT) -> torch.Tensor:
    hooks = spec.hooks(model.config, len(ids)) if isinstance(spec, EditSpec) else spec
    with torch.inference_mode():
        return model(torch.tensor([ids]), hooks=hooks)


def at(layer: int, change: Change) -> Change:
    """`change` at `layer` only."""
    return lambda i, x: change(i, x) if i == layer else x


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# --- against the forward pass by hand ----------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1])
def test_zeroing_attn_out_equals_removing_that_attention_by_hand(tiny_model: GPT, layer: int) -> None:
    with torch.inference_mode():
        expected = by_hand(tiny_model, PROMPT, attn=at(layer, lambda _, a: torch.zeros_like(a)))
        normal = by_hand(tiny_model, PROMPT)
    edited = run(tiny_model, EditSpec((Edit(f"blocks.{layer}.hook_attn_out", "zero"),)))
    exact(edited, expected)
    assert not torch.allclose(edited, normal), "the edit should change the logits"


def test_layers_restrict_a_glob(tiny_model: GPT) -> None:
    with torch.inference_mode():
        expected = by_hand(tiny_model, PROMPT, attn=at(1, lambda _, a: torch.zeros_like(a)))
    exact(run(tiny_model, EditSpec((Edit("blocks.*.hook_attn_out", "zero", layers=(1,)),))), expected)


def test_scale(tiny_model: GPT) -> None:
    with torch.inference_mode():
        expected = by_hand(tiny_model, PROMPT, mlp=at(1, lambda _, m: m * 0.25))
    edited = run(tiny_model, EditSpec((Edit("blocks.1.hook_mlp_out", "scale", factor=0.25),)))
    torch.testing.assert_close(edited, expected)


def test_add_at_positions(tiny_model: GPT) -> None:
    v = torch.randn(tiny_model.config.n_embd, generator=torch.Generator().manual_seed(0))

    def add(_: int, a: torch.Tensor) -> torch.Tensor:
        a = a.clone()
        a[:, [1, 5]] += v
        return a

    with torch.inference_mode():
        expected = by_hand(tiny_model, PROMPT, attn=at(0, add))
    edited = run(tiny_model, EditSpec((Edit("blocks.0.hook_attn_out", "add", value=v, positions=(1, 5)),)))
    exact(edited, expected)


def test_mean_over_positions(tiny_model: GPT) -> None:
    with torch.inference_mode():
        expected = by_hand(tiny_model, PROMPT, attn=at(0, lambda _, a: a.mean(dim=1, keepdim=True).expand_as(a)))
    torch.testing.assert_close(run(tiny_model, EditSpec((Edit("blocks.0.hook_attn_out", "mean"),))), expected)


def test_set_one_position_broadcast_and_a_whole_sequence(tiny_model: GPT) -> None:
    C = tiny_model.config.n_embd
    g = torch.Generator().manual_seed(1)
    v, seq = torch.randn(C, generator=g), torch.randn(T, C, generator=g)

    def set_v(_: int, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, [2, 3]] = v
        return x

    with torch.inference_mode():
        expected_one = by_hand(tiny_model, PROMPT, resid_post=at(1, set_v))
        expected_seq = by_hand(tiny_model, PROMPT, resid_mid=at(0, lambda _, x: seq[None].clone()))
    exact(
        run(tiny_model, EditSpec((Edit("blocks.1.hook_resid_post", "set", value=v, positions=(2, 3)),))), expected_one
    )
    exact(run(tiny_model, EditSpec((Edit("blocks.0.hook_resid_mid", "set", value=seq),))), expected_seq)


def test_edits_apply_in_order(tiny_model: GPT) -> None:
    v = torch.ones(tiny_model.config.n_embd)
    with torch.inference_mode():
        expected = by_hand(tiny_model, PROMPT, attn=at(0, lambda _, a: (a + v) * 3))
    edits = (Edit("blocks.0.hook_attn_out", "add", value=v), Edit("blocks.0.hook_attn_out", "scale", factor=3.0))
    torch.testing.assert_close(run(tiny_model, EditSpec(edits)), expected)


# --- heads and positions touch exactly the selected entries -------------------------------------


def before_and_after(model: GPT, edit: Edit) -> tuple[torch.Tensor, torch.Tensor]:
    """The value at the edited hook point as the model computed it, and as the edit left it."""
    before, after = Capture([edit.hook]), Capture([edit.hook])
    run(model, HookChain(before, Interventions([edit], model.config, T), after))
    return before.tensors()[edit.hook][0], after.tensors()[edit.hook][0]


HEADS, POSITIONS = (1, 3), (0, 2, 7)


@pytest.mark.parametrize("site", ["hook_q", "hook_k", "hook_v", "hook_z"])
@pytest.mark.parametrize("op", ["zero", "scale", "add", "set"])
def test_per_head_edits_touch_exactly_the_selected_heads_and_positions(tiny_model: GPT, site: str, op: str) -> None:
    D = tiny_model.config.d_head
    value = torch.arange(len(HEADS) * D, dtype=torch.float32).view(len(HEADS), D)  # one position's chosen heads
    hook = f"blocks.1.attn.{site}"
    edit = Edit(hook, op, factor=-2.0, value=value, heads=HEADS, positions=POSITIONS)
    before, after = before_and_after(tiny_model, edit)  # [T, H, D]
    chosen = torch.zeros(before.shape, dtype=torch.bool)
    for p in POSITIONS:
        for j, h in enumerate(HEADS):
            chosen[p, h] = True
            want = {"zero": 0 * before[p, h], "scale": -2.0 * before[p, h], "add": before[p, h] + value[j]}
            exact(after[p, h], want.get(op, value[j]))
    exact(after[~chosen], before[~chosen])


@pytest.mark.parametrize("site", ["hook_attn_scores", "hook_pattern"])
@pytest.mark.parametrize("op", ["zero", "scale"])
def test_attention_square_edits_touch_exactly_the_selected_heads_and_queries(
    tiny_model: GPT, site: str, op: str
) -> None:
    edit = Edit(f"blocks.0.attn.{site}", op, factor=-3.0, heads=HEADS, positions=POSITIONS)
    before, after = before_and_after(tiny_model, edit)  # [H, q, k]
    chosen = torch.zeros(before.shape, dtype=torch.bool)
    for h in HEADS:
        for q in POSITIONS:
            chosen[h, q, : q + 1] = True  # the keys query q may see: its future stays masked
    expected = torch.zeros_like(before) if op == "zero" else before * -3.0
    exact(after[chosen], expected[chosen])
    exact(after[~chosen], before[~chosen])  # the rest, the causal mask (-inf scores, 0 pattern) included


def test_attention_square_edits_stay_causal(tiny_model: GPT) -> None:
    """Zeroing or negating scores edits only the keys each query may see: later tokens still cannot
    change earlier positions, and no masked -inf turns into +inf or NaN."""
    later = [*PROMPT[:-1], 50]
    for edit in (
        Edit("blocks.*.attn.hook_attn_scores", "zero"),
        Edit("blocks.0.attn.hook_attn_scores", "scale", factor=-1.0),
        Edit("blocks.0.attn.hook_attn_scores", "scale", factor=0.0),
        Edit("blocks.1.attn.hook_pattern", "scale", factor=2.0),
    ):
        a, b = run(tiny_model, EditSpec((edit,))), run(tiny_model, EditSpec((edit,)), later)
        assert a.isfinite().all(), edit
        exact(a[0, :-1], b[0, :-1])


def test_zero_scores_is_uniform_attention(tiny_model: GPT) -> None:
    edit = Edit("blocks.0.attn.hook_attn_scores", "zero")
    pattern = Capture(["blocks.0.attn.hook_pattern"])
    run(tiny_model, HookChain(Interventions([edit], tiny_model.config, T), pattern))
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]  # row q: 1/(q+1) over keys 0..q
    torch.testing.assert_close(pattern.tensors()["blocks.0.attn.hook_pattern"][0], uniform.expand(4, T, T))


# --- patching -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1])
def test_patching_a_clean_activation_restores_the_clean_logits(tiny_model: GPT, layer: int) -> None:
    clean, corrupted = PROMPT, [*PROMPT[:3], 4452, *PROMPT[4:]]  # " dog" in place of " on"
    hook = f"blocks.{layer}.hook_resid_post"
    capture = Capture([hook, "logits"])
    run(tiny_model, capture, clean)
    acts = capture.tensors()
    clean_logits, clean_resid = acts["logits"], acts[hook][0]  # [1, T, vocab], [T, C]

    assert not torch.allclose(run(tiny_model, None, corrupted), clean_logits)
    patched = run(tiny_model, EditSpec((Edit(hook, "set", value=clean_resid),)), corrupted)
    exact(patched, clean_logits)  # the whole stream after that layer is the clean one
    last = EditSpec((Edit(hook, "set", value=clean_resid, positions=(T - 1,)),))
    patched_last = run(tiny_model, last, corrupted)
    if layer == tiny_model.config.n_layer - 1:  # nothing mixes positions after the last layer
        exact(patched_last[0, -1], clean_logits[0, -1])
    exact(patched_last[0, :-1], run(tiny_model, None, corrupted)[0, :-1])  # earlier positions untouched


# --- generation with the KV cache --------------------------------------------------------------------

NEW = 6  # tokens to generate; the prompt has T
C_, DMLP = 64, 256  # the tiny checkpoint's widths


def _seq(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7))


CAUSAL_EDITS = {
    "zero attn_out across the prompt's end": EditSpec((Edit("blocks.0.hook_attn_out", "zero", positions=(1, 9)),)),
    "scale z of two heads": EditSpec((Edit("blocks.*.attn.hook_z", "scale", factor=-1.5, heads=(0, 2)),)),
    "add to resid_mid": EditSpec((Edit("blocks.1.hook_resid_mid", "add", value=_seq(C_), positions=(3, 8, 11)),)),
    "set mlp post from a sequence": EditSpec((Edit("blocks.0.mlp.hook_post", "set", value=_seq(T + NEW, DMLP)),)),
    "zero a head's pattern": EditSpec((Edit("blocks.1.attn.hook_pattern", "zero", heads=(1,), positions=(2, 9, 12)),)),
    "scale scores to 0": EditSpec((Edit("blocks.0.attn.hook_attn_scores", "scale", factor=0.0),)),
    "no skips": EditSpec((), (0, 1), (0, 1)),
    "no attn skip, edited": EditSpec((Edit("blocks.0.hook_resid_mid", "scale", factor=2.0),), (0,), (1,)),
}


@pytest.mark.parametrize("spec", CAUSAL_EDITS.values(), ids=CAUSAL_EDITS.keys())
def test_generation_with_edits_equals_one_forward_pass_over_the_result(tiny_model: GPT, spec: EditSpec) -> None:
    assert tiny_model.config.n_embd == C_
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    (c,) = generate(tiny_model, [PROMPT], params, hooks=["logits"], edits=spec)
    ids = PROMPT + c.token_ids
    assert c.activations is not None
    forward = run(tiny_model, spec, ids)  # [1, T + NEW, vocab]
    torch.testing.assert_close(c.activations["logits"], forward, rtol=1e-4, atol=1e-4)
    assert c.token_ids == forward[0, T - 1 : -1].argmax(-1).tolist()
    plain = generate(tiny_model, [PROMPT], params)[0].token_ids
    assert c.token_ids != plain or not torch.allclose(forward, run(tiny_model, None, ids)), "the edit did nothing"


def test_an_edit_spec_makes_fresh_state_for_each_run(tiny_model: GPT) -> None:
    spec = EditSpec((Edit("blocks.0.hook_attn_out", "mean"), Edit("hook_embed", "zero", positions=(0,))), (1,))
    first = run(tiny_model, spec)
    run(tiny_model, spec, PROMPT[:4])  # another sequence, with its own mean and position count
    exact(run(tiny_model, spec), first)
    exact(run(tiny_model, None), run(tiny_model, EditSpec()))  # nothing asked, nothing changed


# --- residual ablation ------------------------------------------------------------------------------


def test_ablating_nothing_is_the_normal_model(tiny_model: GPT) -> None:
    assert EditSpec().hooks(tiny_model.config, T) is None
    exact(run(tiny_model, ResidualAblation([], [], tiny_model.config.n_layer)), run(tiny_model, None))


@pytest.mark.parametrize("layer", [0, 1])
def test_ablating_attention_makes_resid_mid_the_attention_output(tiny_model: GPT, layer: int) -> None:
    p = f"blocks.{layer}."
    capture = Capture([p + "hook_resid_pre", p + "hook_attn_out", p + "hook_resid_mid", p + "hook_mlp_out"])
    capture_post = Capture([p + "hook_resid_post"])
    run(tiny_model, HookChain(ResidualAblation([layer], [], tiny_model.config.n_layer), capture, capture_post))
    acts = capture.tensors() | capture_post.tensors()
    exact(acts[p + "hook_resid_mid"], acts[p + "hook_attn_out"])
    exact(acts[p + "hook_resid_post"], acts[p + "hook_resid_mid"] + acts[p + "hook_mlp_out"])  # the MLP keeps it
    with torch.inference_mode():
        exact(run(tiny_model, EditSpec((), (layer,))), by_hand(tiny_model, PROMPT, no_skip_attn=(layer,)))


def test_ablating_an_mlp_makes_resid_post_the_mlp_output(tiny_model: GPT) -> None:
    capture = Capture(["blocks.1.hook_mlp_out", "blocks.1.hook_resid_post"])
    run(tiny_model, HookChain(ResidualAblation([], [1], tiny_model.config.n_layer), capture))
    acts = capture.tensors()
    exact(acts["blocks.1.hook_resid_post"], acts["blocks.1.hook_mlp_out"])
    with torch.inference_mode():
        exact(run(tiny_model, EditSpec((), (), (1,))), by_hand(tiny_model, PROMPT, no_skip_mlp=(1,)))


def test_ablating_everything_equals_the_forward_pass_without_skip_connections(tiny_model: GPT) -> None:
    every = tuple(range(tiny_model.config.n_layer))
    with torch.inference_mode():
        expected = by_hand(tiny_model, PROMPT, no_skip_attn=every, no_skip_mlp=every)
    exact(run(tiny_model, EditSpec((), every, every)), expected)


def test_interventions_see_the_ablated_stream(tiny_model: GPT) -> None:
    """An edit of a sub-layer's output is carried into the stream it replaces; an edit of the stream
    applies to the ablated stream (it used to be overwritten by the ablation, silently)."""
    v = torch.ones(tiny_model.config.n_embd)
    with torch.inference_mode():
        on_attn_out = by_hand(tiny_model, PROMPT, attn=at(0, lambda _, a: a + v), no_skip_attn=(0,))
        on_resid_mid = by_hand(tiny_model, PROMPT, resid_mid=at(0, lambda _, x: x * 2), no_skip_attn=(0,))
        on_resid_post = by_hand(tiny_model, PROMPT, resid_post=at(1, lambda _, x: x * 0), no_skip_mlp=(1,))
    exact(run(tiny_model, EditSpec((Edit("blocks.0.hook_attn_out", "add", value=v),), (0,))), on_attn_out)
    exact(run(tiny_model, EditSpec((Edit("blocks.0.hook_resid_mid", "scale", factor=2.0),), (0,))), on_resid_mid)
    exact(run(tiny_model, EditSpec((Edit("blocks.1.hook_resid_post", "zero"),), (), (1,))), on_resid_post)


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (Edit("blocks.0.hook_nope", "zero"), "matches no hook point; valid names are"),
        (Edit("blocks.*.hook_attn_out", "zero", layers=(2,)), "layer 2 is out of range 0..1"),
        (Edit("blocks.0.attn.hook_z", "zero", heads=(4,)), "head 4 is out of range 0..3"),
        (Edit("blocks.0.hook_resid_pre", "zero", heads=(0,)), "heads apply only to per-head hooks"),
        (Edit("blocks.0.hook_resid_pre", "zero", positions=(T,)), f"position {T} is out of range 0..{T - 1}"),
        # a list names each at most once, so it is as long as the sequence, the heads or the layers at most (a
        # position named 5,000 times once selected and copied its values 5,000 times: gigabytes)
        (Edit("blocks.0.hook_resid_pre", "scale", factor=1.0, positions=(1,) * 5000), "position 1 is named twice"),
        (Edit("blocks.0.attn.hook_z", "zero", heads=(0, 1, 0)), "head 0 is named twice"),
        (Edit("blocks.*.hook_attn_out", "zero", layers=(1, 1)), "layer 1 is named twice"),
        (Edit("blocks.0.hook_resid_pre", "scale"), "scale needs a factor"),
        (Edit("blocks.0.hook_resid_pre", "add"), "add needs a value"),
        (Edit("blocks.0.hook_resid_pre", "add", value=torch.ones(3)), "does not fit blocks.0.hook_resid_pre"),
        (Edit("blocks.0.attn.hook_q", "set", value=torch.ones(4, 16), heads=(0,)), "give [1, 16]"),
        (Edit("blocks.0.hook_resid_pre", "set", value=torch.ones(T - 2, 64)), f"position {T - 1} needed"),
        (Edit("blocks.0.attn.hook_pattern", "set", value=torch.ones(1)), "not supported on attention scores"),
        (Edit("blocks.0.attn.hook_pattern", "mean"), "mean is not supported on attention scores or patterns"),
        (Edit("blocks.0.hook_resid_pre", "divide"), "unknown op 'divide'"),
        # more dimensions than torch's reductions take (64): a RuntimeError once, in the finiteness check
        (Edit("blocks.0.hook_resid_pre", "add", value=torch.ones([1] * 70)), "value of shape [1, 1,"),
        (Edit("blocks.0.hook_resid_pre", "steer", 1.0, direction=torch.ones([1] * 69 + [64])), "give [64]"),
        (Edit("blocks.0.hook_resid_pre", "orthogonal", direction=torch.ones([1] * 70)), "give [64]"),
    ],
)
def test_bad_edits_are_refused_with_the_reason(tiny_model: GPT, edit: Edit, says: str) -> None:
    with pytest.raises(InterventionError) as e:
        EditSpec((edit,)).hooks(tiny_model.config, T)
    assert says in str(e.value)


def test_bad_ablation_layers_are_refused(tiny_model: GPT) -> None:
    with pytest.raises(InterventionError, match=r"residual.mlp: layer 2 is out of range 0..1"):
        EditSpec((), (), (2,)).hooks(tiny_model.config, T)
    assert hash(EditSpec(ablate_attn=[0], ablate_mlp=[1])) == hash(EditSpec(ablate_attn=(0,), ablate_mlp=(1,)))
    zero = Edit("hook_embed", "zero")
    for given in ({"ablate_attn": 0}, {"ablate_mlp": "all"}, {"ablate_attn": (True,)}, {"edits": zero}):
        with pytest.raises(InterventionError, match=r"must be a tuple of"):
            EditSpec(**given)  # type: ignore[arg-type]  # 0 once ablated nothing (a false tuple), in silence


def test_hooks_made_for_one_sequence_refuse_a_second(tiny_model: GPT) -> None:
    """`EditSpec.hooks` makes hooks for one sequence of at most `n_tokens` positions: they keep state (the
    positions seen, a `mean` edit's prompt mean), so one reused for a second prompt (which got the first's mean)
    or a sequence longer than it was made for is refused, not applied with stale state."""
    spec = EditSpec((Edit("blocks.0.hook_resid_post", "mean"),))
    hooks = spec.hooks(tiny_model.config, 5)
    run_with_cache(tiny_model, [5, 6, 7, 8, 9], ["blocks.0.hook_resid_post"], edits=hooks)
    with pytest.raises(InterventionError, match="made for one sequence of at most 5 positions"):
        run_with_cache(tiny_model, [50, 60, 70, 80, 90], ["blocks.0.hook_resid_post"], edits=hooks)
    with pytest.raises(InterventionError, match="reaches 8"):
        run_with_cache(tiny_model, list(range(8)), ["logits"], edits=spec.hooks(tiny_model.config, 5))


def test_a_numpy_position_is_named_as_not_an_int(tiny_model: GPT) -> None:
    """`positions=np.nonzero(...)` is a common way to pick them: the error says the type, not "out of range"."""
    import numpy as np

    spec = EditSpec((Edit("blocks.0.hook_resid_post", "zero", positions=tuple(np.array([1, 2]))),))
    with pytest.raises(InterventionError, match=r"position np.int64\(1\) is not an int \(convert numpy"):
        spec.hooks(tiny_model.config, 5)


HOOK = "blocks.0.hook_resid_post"


def test_an_edit_refuses_what_its_op_does_not_read_and_takes_plain_lists(tiny_model: GPT) -> None:
    """`norm_match` on `orthogonal`, a direction on `zero`, an SAE on `steer`: refused, not ignored (the norms
    were not kept, in silence). Lists of numbers are read as tensors, a list of places as a tuple."""
    d = torch.ones(tiny_model.config.n_embd)
    for edit, says in (
        (lambda: Edit(HOOK, "orthogonal", direction=d, norm_match=True), "orthogonal does not read norm_match"),
        (lambda: Edit(HOOK, "zero", direction=d), "zero does not read direction"),
        (lambda: Edit(HOOK, "scale", factor=True), "factor must be a number"),
        (lambda: Edit(HOOK, "zero", heads=0), "heads must be a tuple of ints"),  # type: ignore[arg-type]
    ):
        with pytest.raises(InterventionError, match=says):
            edit()
    listed = Edit(HOOK, "add", value=[1.0] * tiny_model.config.n_embd, positions=[0, 2])  # type: ignore[arg-type]
    assert isinstance(listed.value, torch.Tensor) and listed.positions == (0, 2)
    assert torch.equal(Edit(HOOK, "steer", 2.0, direction=d.tolist()).direction, d)  # type: ignore[arg-type]


def test_a_whole_sequences_value_set_everywhere_must_be_its_length(tiny_model: GPT) -> None:
    """Patching a 10-token run's values into a 4-token one set its first four rows, out of line with the
    run, without a word: refused, naming both lengths. With positions, a longer value's rows are taken by
    position (the clean run's row 2 at position 2), as before."""
    C = tiny_model.config.n_embd
    longer = torch.randn(10, C)
    with pytest.raises(InterventionError, match="value covers 10 positions, more than the sequence's 4"):
        EditSpec((Edit(HOOK, "set", value=longer),)).hooks(tiny_model.config, 4)
    EditSpec((Edit(HOOK, "set", value=longer[:4]),)).hooks(tiny_model.config, 4)
    EditSpec((Edit(HOOK, "set", value=longer, positions=(2,)),)).hooks(tiny_model.config, 4)
