"""Gradients at hook points (model/lab/gradients.py) against the reference: transformers' GPT2LMHeadModel
with `torch.autograd` and its values taken at the same sites by module hooks (float64 to 1e-8, float32
within a stated bound); TransformerLens' backward hooks as a second oracle for the sites transformers has
no module for (attention scores and patterns, the layer norms' scale and normalized values); the residual
identities (∂ at resid_pre = ∂ at resid_mid + the attention branch's share, and so on) by hand; the
Jacobian's norm against a dense Jacobian; and the highway on the random gpt2-small-shaped checkpoint."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any

import pytest
import torch
from conftest import Checkpoint, load_ours

from model.gpt import GPT
from model.hooks import UnknownHookError, hook_names, is_optional, select_hooks
from model.interventions import Edit, EditSpec
from model.lab.gradients import (
    FrobeniusEstimate,
    GradientHooks,
    LogitDiff,
    LogProb,
    Loss,
    Metric,
    MetricError,
    MetricPass,
    gradient_pass,
    gradients,
    graph_bytes,
    highway,
    metric_value,
    rademacher,
)

PROMPT = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
T = len(PROMPT)
METRICS: list[Metric] = [LogProb(2068, 5), LogitDiff((318, 373)), Loss(), Loss((3, 7))]
EXACT = 1e-8

# The sites transformers has a module for (the value is a module's input or output).
HF_SITES = [
    "hook_embed",
    "hook_pos_embed",
    *(
        f"blocks.{layer}.{site}"
        for layer in range(2)
        for site in (
            "hook_resid_pre",
            "attn.hook_q",
            "attn.hook_k",
            "attn.hook_v",
            "attn.hook_z",
            "hook_attn_out",
            "hook_resid_mid",
            "mlp.hook_pre",
            "mlp.hook_post",
            "hook_mlp_out",
            "hook_resid_post",
        )
    ),
    "unembed.hook_in",
    "logits",
]


@pytest.fixture(scope="module")
def ours64(tiny: Checkpoint) -> GPT:
    return load_ours(tiny, torch.float64)


@pytest.fixture(scope="module")
def hf64(tiny: Checkpoint) -> Any:
    return copy.deepcopy(tiny.hf).double()


def hf_gradients(
    hf: Any, ids: list[int], metric: Metric, edit: tuple[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """∂metric/∂value at HF_SITES, from transformers: each value taken where it is a module's input or
    output, then `torch.autograd.grad`. `edit` = (site, fn) replaces a module output by fn(output)."""
    tr, values, handles = hf.transformer, {}, []
    H = hf.config.n_head

    def output(name: str, module: torch.nn.Module) -> None:
        def hook(_m: Any, _a: Any, out: Any) -> Any:
            t = out[0] if isinstance(out, tuple) else out
            if edit is not None and edit[0] == name:
                t = edit[1](t)
                out = (t, *out[1:]) if isinstance(out, tuple) else t
            values[name] = t
            return out

        handles.append(module.register_forward_hook(hook))

    def input_of(name: str, module: torch.nn.Module) -> None:
        handles.append(module.register_forward_pre_hook(lambda _m, args: values.__setitem__(name, args[0])))

    output("hook_embed", tr.wte)
    output("hook_pos_embed", tr.wpe)
    for i, block in enumerate(tr.h):
        p = f"blocks.{i}."
        input_of(p + "hook_resid_pre", block)
        output(p + "qkv", block.attn.c_attn)
        input_of(p + "z", block.attn.c_proj)
        output(p + "hook_attn_out", block.attn)
        input_of(p + "hook_resid_mid", block.ln_2)
        output(p + "mlp.hook_pre", block.mlp.c_fc)
        output(p + "mlp.hook_post", block.mlp.act)
        output(p + "hook_mlp_out", block.mlp)
        output(p + "hook_resid_post", block)
    output("unembed.hook_in", tr.ln_f)
    output("logits", hf.lm_head)
    try:
        logits = hf(torch.tensor([ids])).logits
    finally:
        for h in handles:
            h.remove()
    names = list(values)
    metric_grads = torch.autograd.grad(metric_value(metric, logits[0], ids), [values[n] for n in names])
    grads = dict(zip(names, metric_grads, strict=True))
    out = {}
    for name, g in grads.items():
        B, S, C = g.shape[0], g.shape[1], g.shape[-1]
        if name.endswith("qkv"):  # [B, T, 3C] -> q, k, v as [B, T, H, D]
            for site, part in zip("qkv", g.split(C // 3, dim=-1), strict=True):
                out[name.replace("qkv", f"attn.hook_{site}")] = part.reshape(B, S, H, -1)
        elif name.endswith(".z"):
            out[name.replace(".z", ".attn.hook_z")] = g.reshape(B, S, H, -1)
        else:
            out[name] = g
    return out


# --- against transformers ------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS, ids=lambda m: type(m).__name__ + repr(getattr(m, "span", "")))
def test_gradients_equal_transformers_in_float64(ours64: GPT, hf64: Any, metric: Metric) -> None:
    want = hf_gradients(hf64, PROMPT, metric)
    with torch.inference_mode():  # as on the engine's thread: the job leaves it
        got = gradients(ours64, PROMPT, metric, HF_SITES)
    with torch.no_grad():
        assert got.metric == pytest.approx(float(metric_value(metric, hf64(torch.tensor([PROMPT])).logits[0], PROMPT)))
    assert set(got.grads) == set(HF_SITES) == set(want)
    for name in HF_SITES:
        assert got.grads[name].shape == want[name].shape, name
        torch.testing.assert_close(got.grads[name], want[name], rtol=0, atol=EXACT, msg=name)
    assert float(got.grads["blocks.0.hook_resid_pre"].abs().max()) > 1e-3  # something flowed back


def test_gradients_in_float32_are_within_their_bound(tiny: Checkpoint, hf64: Any) -> None:
    """float32 against the float64 reference: within 1e-4 of the largest gradient at each site."""
    ours = load_ours(tiny)
    for metric in (LogProb(2068, 5), Loss()):
        want = hf_gradients(hf64, PROMPT, metric)
        got = gradients(ours, PROMPT, metric, HF_SITES)
        for name in HF_SITES:
            scale = float(want[name].abs().max())
            err = float((got.grads[name].double() - want[name]).abs().max())
            assert err <= 1e-4 * scale + 1e-7, (name, err, scale)


def test_an_edit_is_honoured_as_the_same_edit_in_transformers(ours64: GPT, hf64: Any) -> None:
    spec = EditSpec((Edit("blocks.0.hook_mlp_out", "scale", factor=0.5),))
    got = gradients(ours64, PROMPT, Loss(), HF_SITES, spec)
    want = hf_gradients(hf64, PROMPT, Loss(), ("blocks.0.hook_mlp_out", lambda t: t * 0.5))
    for name in HF_SITES:
        torch.testing.assert_close(got.grads[name], want[name], rtol=0, atol=EXACT, msg=name)
    plain = gradients(ours64, PROMPT, Loss(), ["blocks.0.hook_resid_pre"])
    assert not torch.allclose(plain.grads["blocks.0.hook_resid_pre"], got.grads["blocks.0.hook_resid_pre"])


def test_ids_outside_the_vocabulary_are_a_clear_error(ours64: GPT) -> None:
    """As `run_with_cache` says it: not an IndexError from the embedding."""
    from model.lab.attribution import attribution

    vocab = ours64.config.vocab_size
    says = r"outside the vocabulary|non-empty list of ints"
    for ids in ([vocab, 3], [-1, 3], [True, 3]):
        with pytest.raises(ValueError, match=says):
            gradients(ours64, ids, Loss(), ["blocks.0.hook_resid_pre"])
        with pytest.raises(ValueError, match=says):
            highway(ours64, ids)
        with pytest.raises(ValueError, match=says):
            attribution(ours64, [1, 2], ids, Loss())


@pytest.mark.parametrize(
    ("metric", "param", "says"),
    [
        (LogProb(torch.tensor(5)), "metric.token", "a token is an int (convert numpy"),  # it said "outside"
        (LogitDiff((1, 2, 3)), "metric.tokens", "a logit difference's tokens are two ints"),  # a ValueError
        (LogitDiff(1), "metric.tokens", "a logit difference's tokens are two ints"),  # a TypeError
        (LogProb(5, position=-1.0), "metric.position", "a position is an int, got -1.0"),
        (LogProb(5, position=True), "metric.position", "a position is an int, got True"),  # taken as 1
        (Loss(span=(1.0, 3)), "metric.span", "a loss span is two ints (start, end), got (1.0, 3)"),
        ("loss", "metric", "a metric is a LogProb, a LogitDiff or a Loss, got str"),  # an AttributeError
    ],
)
def test_a_metric_of_other_types_is_refused_in_words(ours64: GPT, metric: Any, param: str, says: str) -> None:
    with pytest.raises(MetricError, match=re.escape(says)) as e:
        gradients(ours64, [1, 2, 3], metric, ["blocks.0.hook_resid_pre"])
    assert e.value.param == param
    with pytest.raises(ValueError, match=r"probes must be an int >= 1"):  # an IndexError
        highway(ours64, [1, 2, 3], probes=0)


def test_parameters_get_no_grad_and_inference_stays_inference(ours64: GPT) -> None:
    with torch.inference_mode():
        gradients(ours64, PROMPT, Loss(), ["blocks.0.hook_resid_pre"])
        assert torch.is_inference_mode_enabled()
    assert all(p.grad is None and not p.requires_grad for p in ours64.parameters())


# --- TransformerLens' backward hooks, for the sites transformers has no module for ------------------


def test_every_default_hook_gradient_equals_transformer_lens(tiny: Checkpoint, ours64: GPT) -> None:
    tl = pytest.importorskip("transformer_lens", reason="TransformerLens (test-only oracle) is not installed")
    from tl_oracle import hooked

    model = hooked(tiny, torch.float64)
    names = [n for n in hook_names(2) if not is_optional(n) and n != "logits"]
    grads: dict[str, torch.Tensor] = {}

    def keep(g: torch.Tensor, hook: Any) -> None:  # ln1 runs once per path (q, k, v) there: their sum
        grads[hook.name] = grads[hook.name] + g.detach() if hook.name in grads else g.detach()

    ids = torch.tensor([PROMPT])
    metric = LogitDiff((318, 373), 6)
    with model.hooks(bwd_hooks=[(n, keep) for n in names]):
        metric_value(metric, model(ids)[0], PROMPT).backward()
    got = gradients(ours64, PROMPT, metric, names).grads
    assert isinstance(model, tl.HookedTransformer) and set(grads) == set(names)
    for name in names:
        want = grads[name]
        g = got[name]
        if name.endswith("hook_attn_scores"):  # masked scores (-inf): TransformerLens' grad is 0 there too
            torch.testing.assert_close(g.nan_to_num(), want.nan_to_num(), rtol=0, atol=EXACT, msg=name)
        else:
            torch.testing.assert_close(g, want, rtol=0, atol=EXACT, msg=name)


# --- the residual identities ------------------------------------------------------------------------


def _branch_vjp(fn: Any, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(∂fn/∂x)ᵀ g, for a sub-layer `fn` at the value x."""
    with torch.inference_mode(False), torch.enable_grad():
        x = x.detach().clone().requires_grad_(True)
        (v,) = torch.autograd.grad(fn(x), x, g)
    return v


@pytest.mark.parametrize("ablated", [False, True], ids=["with-residual", "without-residual"])
def test_the_gradient_splits_at_each_residual_add(ours64: GPT, ablated: bool) -> None:
    """resid_mid = resid_pre + attn(ln_1(resid_pre)): ∂/∂resid_pre = ∂/∂resid_mid + (the attention
    branch's Jacobian)ᵀ ∂/∂resid_mid, and ∂/∂attn_out = ∂/∂resid_mid; likewise for the MLP. Without the
    skips the identity term is gone: only the branch carries the gradient."""
    L = ours64.config.n_layer
    sites = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
    names = [f"blocks.{i}.{s}" for i in range(L) for s in sites]
    every = tuple(range(L))
    spec = EditSpec((), every, every) if ablated else None
    capture = GradientHooks(names)
    with torch.inference_mode(False), torch.enable_grad():
        hooks = spec.hooks(ours64.config, T, then=capture) if spec else capture
        metric = metric_value(Loss(), ours64(torch.tensor([PROMPT]), hooks=hooks)[0], PROMPT)
        g = dict(zip(names, torch.autograd.grad(metric, [capture.values[n] for n in names]), strict=True))
    v = {n: x.detach() for n, x in capture.values.items()}
    for i, block in enumerate(ours64.h):
        p = f"blocks.{i}."
        attn_branch = lambda x, b=block: b.attn(b.ln_1(x), None, None)  # noqa: E731
        mlp_branch = lambda x, b=block: b.mlp(b.ln_2(x), None)  # noqa: E731
        attn = _branch_vjp(attn_branch, v[p + "hook_resid_pre"], g[p + "hook_resid_mid"])
        mlp = _branch_vjp(mlp_branch, v[p + "hook_resid_mid"], g[p + "hook_resid_post"])
        skip = 0.0 if ablated else 1.0
        torch.testing.assert_close(g[p + "hook_attn_out"], g[p + "hook_resid_mid"], rtol=0, atol=EXACT)
        torch.testing.assert_close(g[p + "hook_mlp_out"], g[p + "hook_resid_post"], rtol=0, atol=EXACT)
        torch.testing.assert_close(g[p + "hook_resid_pre"], skip * g[p + "hook_resid_mid"] + attn, rtol=0, atol=EXACT)
        torch.testing.assert_close(g[p + "hook_resid_mid"], skip * g[p + "hook_resid_post"] + mlp, rtol=0, atol=EXACT)
        if i + 1 < L:
            torch.testing.assert_close(g[p + "hook_resid_post"], g[f"blocks.{i + 1}.hook_resid_pre"], rtol=0, atol=0)


# --- the Jacobian's norm against a dense Jacobian -----------------------------------------------------


def _dense_jacobian(block: Any, x: torch.Tensor, ablated: bool) -> torch.Tensor:
    def f(x: torch.Tensor) -> torch.Tensor:
        if not ablated:
            return block(x, None, None)
        return block.mlp(block.ln_2(block.attn(block.ln_1(x), None, None)), None)

    with torch.inference_mode(False), torch.enable_grad():
        J = torch.autograd.functional.jacobian(f, x.detach().clone())
    n = x.numel()
    return J.reshape(n, n)  # [out, in]


def frobenius_rms(post: torch.Tensor, pre: torch.Tensor, probes: torch.Tensor) -> tuple[float, float]:
    estimate = FrobeniusEstimate()
    for u in probes:
        estimate.add(post, pre, u)
    return estimate.rms(pre.numel())


def test_the_frobenius_estimate_is_exact_with_a_scaled_basis_and_for_the_identity() -> None:
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        A = torch.randn(15, 15, dtype=torch.float64)
        y = (A @ x.reshape(-1)).reshape(3, 5)
        basis = torch.eye(15, dtype=torch.float64).reshape(15, 3, 5) * math.sqrt(15)
        norm, minus_identity = frobenius_rms(y, x, basis)
        assert norm == pytest.approx(float(A.norm() / math.sqrt(15)), rel=1e-12)
        assert minus_identity == pytest.approx(
            float((A - torch.eye(15, dtype=torch.float64)).norm() / math.sqrt(15)), rel=1e-12
        )
        same = x * 1.0  # the identity map: Rademacher probes give 1 exactly, and J - I gives 0
        assert frobenius_rms(same, x, rademacher(3, (3, 5), torch.float64, x.device)) == (
            pytest.approx(1.0, rel=1e-15),
            0.0,
        )


@pytest.mark.parametrize("ablated", [False, True], ids=["with-residual", "without-residual"])
def test_highway_jacobian_equals_the_estimator_on_the_dense_jacobian(ours64: GPT, ablated: bool) -> None:
    """Each block's ‖J‖_F/√n and ‖J - I‖_F/√n from `highway` equal the same seeded probes applied to the
    dense Jacobian (built with torch.autograd.functional.jacobian), and lie near the exact values."""
    L, ids = ours64.config.n_layer, PROMPT[:4]
    every = tuple(range(L))
    spec = EditSpec((), every, every) if ablated else None
    layers = highway(ours64, ids, spec, probes=64)
    capture = GradientHooks([f"blocks.{i}.hook_resid_pre" for i in range(L)])
    with torch.inference_mode():
        ours64(torch.tensor([ids]), hooks=spec.hooks(ours64.config, len(ids), then=capture) if spec else capture)
    x0 = capture.values["blocks.0.hook_resid_pre"]
    u = torch.stack(list(rademacher(64, tuple(x0.shape), torch.float64, x0.device))).reshape(64, -1)  # highway's
    n = x0.numel()
    for i, block in enumerate(ours64.h):
        J = _dense_jacobian(block, capture.values[f"blocks.{i}.hook_resid_pre"], ablated)
        eye = torch.eye(n, dtype=torch.float64)
        for got, M in ((layers[i + 1].jacobian_norm, J), (layers[i + 1].jacobian_identity_distance, J - eye)):
            estimate = math.sqrt(float((u @ M).pow(2).sum(dim=1).mean()) / n)  # ‖Mᵀu‖² = ‖uᵀM‖²
            assert got == pytest.approx(estimate, rel=1e-9)
            assert got == pytest.approx(float(M.norm()) / math.sqrt(n), rel=0.3)  # a 64-probe estimate
    assert layers[0].jacobian_norm is None and layers[0].layer == -1


# --- a piece at a time (MetricPass) against one graph ------------------------------------------------


def one_graph(model: GPT, ids: list[int], metric: Metric, names: list[str], spec: EditSpec | None = None) -> Any:
    """The metric and its gradient at `names` from one forward pass with one graph and one backward pass: what
    `gradients` computed before it went a piece at a time (zeros where the metric does not depend on a value)."""
    capture = GradientHooks(names)
    with torch.inference_mode(False), torch.enable_grad():
        hooks = spec.hooks(model.config, len(ids), then=capture) if spec else capture
        value = metric_value(metric, model(torch.tensor([ids]), hooks=hooks)[0], ids)
        values = [capture.values[n] for n in names]
        if not value.requires_grad:
            return float(value), {n: torch.zeros_like(v.detach()) for n, v in zip(names, values, strict=True)}
        got = torch.autograd.grad(value, values, allow_unused=True)
    grads = {n: torch.zeros_like(v.detach()) if g is None else g for n, v, g in zip(names, values, got, strict=True)}
    return float(value.detach()), grads


PIECES = [
    pytest.param(hook_names(2), None, id="every-hook-point"),
    pytest.param(["blocks.1.attn.hook_pattern", "blocks.1.hook_mlp_out"], None, id="from-block-1"),
    pytest.param(["logits", "ln_final.hook_scale"], None, id="the-head-alone"),
    pytest.param(
        ["hook_pos_embed", "blocks.*.hook_resid_pre", "blocks.0.attn.hook_z"],
        EditSpec((Edit("blocks.0.hook_attn_out", "scale", factor=0.5, positions=(2, 5)),), (), (1,)),
        id="edited-and-ablated",
    ),
    pytest.param(
        ["blocks.*.hook_resid_pre", "blocks.1.hook_resid_post"],
        EditSpec((Edit("blocks.1.hook_resid_post", "zero"),)),
        id="cut-off-by-an-edit",
    ),
    pytest.param(
        ["blocks.0.hook_resid_post", "unembed.hook_in"],
        EditSpec((Edit("ln_final.hook_normalized", "scale", factor=2.0, positions=(6,)),)),
        id="an-edit-in-the-head",
    ),
]


@pytest.mark.parametrize(("names", "spec"), PIECES)
@pytest.mark.parametrize("metric", METRICS, ids=lambda m: type(m).__name__ + repr(getattr(m, "span", "")))
def test_a_piece_at_a_time_equals_one_graph(
    ours64: GPT, monkeypatch: pytest.MonkeyPatch, names: list[str], spec: EditSpec | None, metric: Metric
) -> None:
    """`gradients` goes a piece at a time (a block forward, a part of the LM head forward and back, a block
    back); here the head's parts are 3 rows, so that the loss's take several. The metric and every gradient
    equal one graph's, in float64, to 1e-12: at hook points in every piece, in the head (then every row runs
    at once), under edits, and where an edit cuts the gradient off (zeros below it)."""
    monkeypatch.setattr(MetricPass, "head_rows", 3)
    names = select_hooks(names, 2)
    value, want = one_graph(ours64, PROMPT, metric, names, spec)
    got = gradients(ours64, PROMPT, metric, names, spec)
    assert got.metric == pytest.approx(value, rel=1e-12, abs=1e-12)
    assert list(got.grads) == names
    for name in names:
        torch.testing.assert_close(got.grads[name], want[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    ("names", "metric", "normed_rows", "product_rows"),
    [
        (["ln_final.hook_normalized"], LogProb(2068, 5), T, [1]),  # the final LayerNorm over every row, the
        (["unembed.hook_in"], Loss((3, 7)), T, [3, 1]),  # head's product only where the metric reads, in parts
        (["ln_final.hook_scale"], Loss(), T, [3, 3, 1]),
        (["blocks.1.hook_resid_post"], Loss(), T - 1, [3, 3, 1]),  # no hook after the last block: only those
        (["blocks.1.hook_resid_post"], LogProb(2068, 5), 1, [1]),
        (["logits"], LogProb(2068, 5), T, [3, 3, 2]),  # its output asked for: every row, in parts, each part's
        (["unembed.hook_out", "logits"], Loss((3, 7)), T, [3, 3, 2]),  # gradient its rows of the whole's
        (["logits", "blocks.1.hook_resid_post"], Loss(), T, [3, 3, 2]),
    ],
)
def test_a_gradient_in_the_head_runs_its_product_only_where_it_must(
    ours64: GPT,
    monkeypatch: pytest.MonkeyPatch,
    names: list[str],
    metric: Metric,
    normed_rows: int,
    product_rows: list[int],
) -> None:
    """A gradient at a hook point after the last block runs the final LayerNorm over every row (its hooks see
    them all; without one, it runs over the metric's rows alone), but the LM head's product, the costly
    part, only at the rows the metric reads, in parts of `head_rows` (3 here), as for any other hook point:
    the loss over 1,024 tokens of gpt2-small ran as one job of 1.3 s on 2 cores. Every row, in parts and in
    order, where the head's output is asked for (a gradient there was one job forward, 0.5 s at 1,024 tokens,
    and one back)."""
    monkeypatch.setattr(MetricPass, "head_rows", 3)
    normed: list[int] = []
    rows: list[int] = []
    handles = [
        ours64.ln_f.register_forward_hook(lambda module, args, out: normed.append(args[0].shape[-2])),
        ours64.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[-2])),
    ]
    try:
        got = gradients(ours64, PROMPT, metric, names)
    finally:
        for handle in handles:
            handle.remove()
    assert normed == [normed_rows]
    assert rows == product_rows
    value, want = one_graph(ours64, PROMPT, metric, names, None)
    assert got.metric == pytest.approx(value, rel=1e-12, abs=1e-12)
    assert set(got.grads) == set(names)
    for name in names:
        torch.testing.assert_close(got.grads[name], want[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("edit", "product_rows"),
    [
        (Edit("logits", "scale", factor=0.5, positions=(2, 6)), [3, 3, 2]),  # a position at a time: every row, in
        (Edit("unembed.hook_out", "zero", positions=(4,)), [3, 3, 2]),  # parts, in order
        (Edit("logits", "mean"), [T]),  # over every position: at once
    ],
)
def test_an_edit_of_the_head_s_output_runs_it_in_parts_unless_it_takes_every_row(
    ours64: GPT, monkeypatch: pytest.MonkeyPatch, edit: Edit, product_rows: list[int]
) -> None:
    """An edit of the LM head's output sees every row, as in one pass, but a part at a time where it takes
    the rows as a long prompt's chunks come (a `scale`, a `zero`), as a capture does: the whole head in one
    job took 0.9-1.2 s at 1,024 tokens of gpt2-small. A `mean` needs them all at once."""
    monkeypatch.setattr(MetricPass, "head_rows", 3)
    spec = EditSpec((edit,))
    names = ["blocks.1.hook_resid_post", "ln_final.hook_normalized"]
    for metric in (Loss(), LogProb(2068, 5)):
        rows: list[int] = []
        handle = ours64.lm_head.register_forward_hook(
            lambda module, args, out, rows=rows: rows.append(args[0].shape[-2])
        )
        try:
            got = gradients(ours64, PROMPT, metric, names, spec)
        finally:
            handle.remove()
        assert rows == product_rows, metric
        value, want = one_graph(ours64, PROMPT, metric, names, spec)
        assert got.metric == pytest.approx(value, rel=1e-12, abs=1e-12)
        for name in names:
            torch.testing.assert_close(got.grads[name], want[name], rtol=0, atol=1e-12, msg=name)


def test_the_loss_in_parts_of_the_head_equals_transformers(
    ours64: GPT, hf64: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss over 7 positions, in parts of 2 rows of the LM head (4 parts), against transformers."""
    monkeypatch.setattr(MetricPass, "head_rows", 2)
    want = hf_gradients(hf64, PROMPT, Loss())
    got = gradients(ours64, PROMPT, Loss(), HF_SITES)
    for name in HF_SITES:
        torch.testing.assert_close(got.grads[name], want[name], rtol=0, atol=EXACT, msg=name)


@pytest.mark.parametrize(
    ("names", "back"),
    [
        (["hook_embed"], 2),
        (["blocks.0.hook_mlp_out"], 2),
        (["blocks.1.hook_resid_pre"], 1),
        (["ln_final.hook_normalized"], 0),  # the final LayerNorm goes back with the head's last part
        (["logits"], 0),  # hooked after its product: every row's, in parts, each back as it runs
    ],
)
def test_the_pieces_are_the_blocks_the_head_s_parts_and_the_blocks_back_to_the_first_wanted(
    ours64: GPT, monkeypatch: pytest.MonkeyPatch, names: list[str], back: int
) -> None:
    """Steps: each block forward (the first with the embeddings, the last with the final LayerNorm), each part
    of the head (3 rows: the loss's 7 positions in 3 parts, or the 8 of every row where the head's output is
    wanted), then each block back down to
    the first with a wanted hook point (the embeddings with block 0). The graphs start there: the blocks
    before it run without one."""
    monkeypatch.setattr(MetricPass, "head_rows", 3)
    run = gradient_pass(ours64.config, PROMPT, Loss(), names)
    steps = 0
    with torch.inference_mode():
        while not run.done:
            run.step(ours64)
            steps += 1
    assert steps == 2 + 3 + back
    assert run.result().grads.keys() == set(names)
    with pytest.raises(AssertionError, match="over"):
        run.step(ours64)


def test_a_metric_that_is_not_finite_is_refused_before_the_blocks_go_back(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A metric that is not finite (here float32 logits scaled past float32's range) is refused once the head
    is through: no block goes back. The error names the edits, which drove it there."""
    model = load_ours(tiny)
    spec = EditSpec((Edit("logits", "scale", factor=3e38, positions=(7,)),))
    run = gradient_pass(model.config, PROMPT, LogProb(5), ["blocks.0.hook_resid_pre"], spec)
    backs: list[int] = []
    monkeypatch.setattr(run, "_back", lambda: backs.append(1))
    with torch.inference_mode(), pytest.raises(MetricError, match=r"the metric is not finite \(nan\)") as e:
        while not run.done:
            run.step(model)
    assert e.value.param == "interventions" and backs == []


# --- bad metrics ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "param"),
    [
        (LogProb(50257), "metric.token"),
        (LogProb(-1), "metric.token"),
        (LogProb(5, 8), "metric.position"),
        (LogProb(5, -9), "metric.position"),
        (LogitDiff((1, 99999)), "metric.tokens"),
        (Loss((0, 4)), "metric.span"),
        (Loss((3, 3)), "metric.span"),
        (Loss((2, 9)), "metric.span"),
    ],
)
def test_a_metric_that_cannot_be_computed_names_its_field(ours64: GPT, metric: Metric, param: str) -> None:
    with pytest.raises(MetricError) as e:
        gradients(ours64, PROMPT, metric, ["blocks.0.hook_resid_pre"])
    assert e.value.param == param


def test_hook_names_are_checked_and_globs_expanded(ours64: GPT) -> None:
    """Python's `gradients` resolves names as the HTTP route does: a name that matches nothing is an error
    (it gave an empty answer), a glob takes every layer, in model order."""
    with pytest.raises(UnknownHookError, match=r"blocks\.0\.hook_resid_pre_typo"):
        gradients(ours64, PROMPT, Loss(), ["blocks.0.hook_resid_pre_typo"])
    L = ours64.config.n_layer
    got = gradients(ours64, PROMPT, Loss(), ["blocks.*.hook_resid_pre", "hook_embed"])
    assert list(got.grads) == ["hook_embed"] + [f"blocks.{i}.hook_resid_pre" for i in range(L)]
    want = gradients(ours64, PROMPT, Loss(), ["blocks.1.hook_resid_pre"])
    torch.testing.assert_close(got.grads["blocks.1.hook_resid_pre"], want.grads["blocks.1.hook_resid_pre"])


def test_a_one_token_prompt_has_no_loss(ours64: GPT) -> None:
    """The default span of a one-token prompt is empty: the message says the prompt is too short (not that a
    span the caller never gave is wrong)."""
    with pytest.raises(MetricError, match="the loss needs a prompt of at least 2 tokens, got 1") as e:
        gradients(ours64, [464], Loss(), ["logits"])
    assert e.value.param == "metric"
    with pytest.raises(MetricError, match="at least 2 tokens"):
        highway(ours64, [464])


def test_graph_bytes_grows_with_tokens_layers_and_width(ours64: GPT) -> None:
    c = ours64.config
    one, two = graph_bytes(c, 8, torch.float32), graph_bytes(c, 16, torch.float32)
    assert two > 2 * one - 1 and graph_bytes(c, 8, torch.float64) == pytest.approx(2 * one, rel=1e-6)
    # at least the logits and their log-softmax, per position
    assert one >= 8 * 2 * c.vocab_size * 4


# --- the highway on gpt2-small's shape ---------------------------------------------------------------


def test_the_highway_on_the_gpt2_small_shape(small: Checkpoint) -> None:
    """With residual connections the loss's gradient reaches the first layer at about the size it has at
    the last; without them it fades layer by layer. Random weights, gpt2-small's shape, 32 tokens."""
    model = load_ours(small)
    L = model.config.n_layer
    ids = torch.randint(0, model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    every = tuple(range(L))
    normal = highway(model, ids, probes=2)
    ablated = highway(model, ids, EditSpec((), every, every), probes=2)
    print("\nlayer  grad_norm with / without skips   jacobian rms gain with / without   ‖J - I‖ rms with / without")
    for a, b in zip(normal, ablated, strict=True):
        jac = f"{a.jacobian_norm:8.3f} / {b.jacobian_norm:8.3f}" if a.jacobian_norm is not None else " " * 19
        dist = (
            f"{a.jacobian_identity_distance:6.3f} / {b.jacobian_identity_distance:6.3f}"
            if b.jacobian_identity_distance is not None
            else ""
        )
        print(f"{a.layer:>5}  {a.grad_norm:10.3e} / {b.grad_norm:10.3e}   {jac}   {dist}")
    with_skips = normal[0].grad_norm / normal[-1].grad_norm
    without = ablated[0].grad_norm / ablated[-1].grad_norm
    print(f"first / last layer gradient norm: {with_skips:.3g} with residual connections, {without:.3g} without")
    assert without < 0.1 * with_skips


SPLIT_INPUTS = [  # per-head copies of the stream: n_head d_model-wide values a position each
    ["blocks.0.hook_attn_in", "blocks.1.hook_attn_in"],
    ["blocks.0.hook_q_input", "blocks.1.hook_k_input", "blocks.1.hook_v_input"],
    ["blocks.0.hook_v_input", "blocks.0.attn.hook_result"],
]


@pytest.mark.parametrize(
    "names", [["hook_embed"], [f"blocks.{i}.attn.hook_pattern" for i in range(2)] + ["hook_embed"], *SPLIT_INPUTS]
)
@pytest.mark.parametrize("n_tokens", [8, 64])
@pytest.mark.parametrize("n_head", [4, 16])
def test_graph_bytes_bounds_what_the_graph_saves(ours64: GPT, names: list[str], n_tokens: int, n_head: int) -> None:
    """Every tensor autograd saves for the backward pass (counted once per storage, the weights left out:
    they exist anyway) fits in the estimate, with the fused attention and with the explicit one, and with
    the per-head inputs, whose copies grow with the heads. They are measured on a small vocabulary, whose rows
    leave them most of a short prompt's graph: there 16 heads' copies of `hook_attn_in` saved more than the estimate
    without them."""
    if names in SPLIT_INPUTS or n_head != ours64.config.n_head:
        vocab = 512 if names in SPLIT_INPUTS else ours64.config.vocab_size
        ours64 = GPT(dataclasses.replace(ours64.config, n_head=n_head, vocab_size=vocab)).double().eval()
    weights = {p.untyped_storage().data_ptr() for p in ours64.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    vocab = ours64.config.vocab_size
    ids = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gradients(ours64, ids, Loss(), names)
    estimate = graph_bytes(ours64.config, n_tokens, torch.float64, names)
    assert 0 < sum(saved.values()) <= estimate, (sum(saved.values()), estimate)
    if names == SPLIT_INPUTS[0] and n_head == 16 and n_tokens == 8:  # left out, the copies would not fit
        assert sum(saved.values()) > graph_bytes(ours64.config, n_tokens, torch.float64)


@pytest.mark.parametrize(
    "names",
    [
        ["hook_embed", "blocks.1.hook_resid_mid"],
        ["blocks.0.hook_attn_in", "blocks.1.hook_q_input"],  # the per-head inputs' products with W_Q, W_K, W_V
        ["hook_embed", "blocks.0.attn.hook_result", "blocks.1.attn.hook_result"],  # each head's product with W_O
    ],
)
def test_an_int8_graph_keeps_no_float32_copy_of_the_weights(
    tiny: Checkpoint, tokenizer_dir: Any, monkeypatch: pytest.MonkeyPatch, names: list[str]
) -> None:
    """An int8 projection under autograd dequantizes its weight for the product and again for the gradient:
    autograd kept each float32 copy for the backward pass (the whole model's, 475 MB on gpt2-small, for as long
    as the graph lived, outside `graph_bytes`; the per-head products' copies of W_QKV and W_O too, until they
    took `_DequantizedEinsum`). What the graph saves fits the estimate, as in float32, and the gradients are
    those of the dequantized weights kept."""
    import model.quantize
    from model.loading import load

    ids = list(range(100, 116))

    def saved_bytes(ours: GPT) -> tuple[int, Any]:
        """Bytes of what the graph saves that is not the model's own (counted once a storage), the gradients."""
        own = {t.untyped_storage().data_ptr() for t in [*ours.parameters(), *ours.buffers()]}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in own:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = gradients(ours, ids, Loss(), names)
        return sum(saved.values()), result

    float32, _ = saved_bytes(load(tiny.path, dtype="float32", device="cpu", tokenizer_dir=tokenizer_dir).model)
    int8 = load(tiny.path, dtype="int8", device="cpu", tokenizer_dir=tokenizer_dir).model
    held, got = saved_bytes(int8)
    assert 0 < held <= float32 <= graph_bytes(int8.config, len(ids), torch.float32), (held, float32)

    def kept(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # autograd keeps the copy
        return x @ model.quantize.dequantize_rows(q, scale, x.dtype).T

    def kept_einsum(equation: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, shape: Any) -> torch.Tensor:
        return torch.einsum(equation, x, model.quantize.dequantize_rows(q, scale, x.dtype).t().reshape(shape))

    monkeypatch.setattr(model.quantize._DequantizedProduct, "apply", kept)
    monkeypatch.setattr(model.quantize._DequantizedEinsum, "apply", kept_einsum)
    want = gradients(int8, ids, Loss(), names)
    assert got.metric == pytest.approx(want.metric, abs=1e-6)
    for name in names:
        torch.testing.assert_close(got.grads[name], want.grads[name], rtol=1e-5, atol=1e-7)


def test_an_int8_graph_estimate_counts_the_weights_dequantized_for_a_moment(
    tiny: Checkpoint, tokenizer_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each int8 product under autograd dequantizes its weight for a moment, forward and back: a float32 copy
    of the LM head is 147 MiB on gpt2-small, far above a short prompt's graph (21 MB at 16 tokens), and a
    16-token pass peaked 253 MiB above its start. `graph_bytes` for int8 weights counts twice the widest copy
    made, and no two copies live at once (each is freed before the next product dequantizes)."""
    import weakref

    import model.quantize
    from model.loading import load

    int8 = load(tiny.path, dtype="int8", device="cpu", tokenizer_dir=tokenizer_dir).model
    real, copies, alive, most_alive = model.quantize.dequantize_rows, [], [0], [0]

    def freed() -> None:
        alive[0] -= 1

    def spy(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = real(q, scale, dtype)
        copies.append(w.nbytes)
        alive[0] += 1
        most_alive[0] = max(most_alive[0], alive[0])
        weakref.finalize(w, freed)
        return w

    monkeypatch.setattr(model.quantize, "dequantize_rows", spy)
    n = 16
    gradients(int8, list(range(100, 100 + n)), Loss(), ["blocks.0.hook_resid_pre"])
    widest = max(copies)
    assert len(copies) > 2 and most_alive[0] == 1, most_alive
    assert widest == int8.config.vocab_size * int8.config.n_embd * 4  # the LM head's, back and forth
    c = int8.config
    assert graph_bytes(c, n, torch.float32, quantized=True) - graph_bytes(c, n, torch.float32) >= 2 * widest


@pytest.mark.parametrize("switches", ["split", "attn_in"])
def test_optional_hook_gradients_equal_transformer_lens(tiny: Checkpoint, ours64: GPT, switches: str) -> None:
    """The optional hooks (each head's input copies and output, the MLP's copy of the stream) against a
    TransformerLens model with the switches that create them: the gradient through that path alone."""
    pytest.importorskip("transformer_lens", reason="TransformerLens (test-only oracle) is not installed")
    from tl_oracle import SWITCHES, hooked

    model = hooked(tiny, torch.float64, **SWITCHES[switches])
    sites = ["hook_attn_in"] if switches == "attn_in" else ["hook_q_input", "hook_k_input", "hook_v_input"]
    if switches == "split":
        sites += ["attn.hook_result", "hook_mlp_in"]
    names = [f"blocks.{i}.{s}" for i in range(2) for s in sites]
    grads: dict[str, torch.Tensor] = {}

    def keep(g: torch.Tensor, hook: Any) -> None:
        grads[hook.name] = g.detach()

    metric = LogProb(2068, 5)
    with model.hooks(bwd_hooks=[(n, keep) for n in names]):
        metric_value(metric, model(torch.tensor([PROMPT]))[0], PROMPT).backward()
    got = gradients(ours64, PROMPT, metric, names).grads
    assert set(grads) == set(names)
    for name in names:
        torch.testing.assert_close(got[name], grads[name], rtol=0, atol=EXACT, msg=name)
    if switches == "split":  # a path's own gradient: the MLP's copy is not the whole stream's
        whole = gradients(ours64, PROMPT, metric, ["blocks.0.hook_resid_mid"]).grads["blocks.0.hook_resid_mid"]
        assert not torch.allclose(got["blocks.0.hook_mlp_in"], whole)
