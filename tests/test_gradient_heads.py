"""Gradients at TransformerLens' per-head inputs (`hook_attn_in`, `hook_q_input`, `hook_k_input`,
`hook_v_input`) beside ln1's hooks. Asking for a gradient leaves the forward pass as it is (the metric
and the logits are those of the run without it, to the bit), ln1's gradient is the same asked alone or
with the per-head inputs' (and equals TransformerLens' with the switches on, summed over its paths and
heads), and what has no single meaning is refused: edits of a per-head input and of ln1 in one layer,
and an edit of one with a gradient at the other."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Checkpoint, load_ours

from model.gpt import GPT
from model.interventions import Edit, EditSpec, HookChain, InterventionError, Interventions
from model.lab.gradients import GradientHooks, LogProb, Metric, gradients, metric_value

PROMPT = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
METRIC = LogProb(2068, 5)
EXACT = 1e-8
HEAD_INPUTS = ["blocks.0.hook_q_input", "blocks.0.hook_k_input", "blocks.0.hook_v_input", "blocks.0.hook_attn_in"]
LN1 = ["blocks.0.ln1.hook_normalized", "blocks.0.ln1.hook_scale"]
LN1_EDITS = [
    Edit("blocks.0.ln1.hook_normalized", "scale", factor=0.0),
    Edit("blocks.0.ln1.hook_scale", "scale", factor=2.0),
]


@pytest.fixture(scope="module")
def ours64(tiny: Checkpoint) -> GPT:
    return load_ours(tiny, torch.float64)


def plain_metric(model: GPT, edit: Edit, metric: Metric = METRIC) -> float:
    """The metric of a run with `edit` and nothing else: no graph, no gradient asked for."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]), hooks=Interventions((edit,), model.config, len(PROMPT)))
    return float(metric_value(metric, logits[0], PROMPT))


@pytest.mark.parametrize("edit", [None, *LN1_EDITS], ids=["no edit", *(e.hook for e in LN1_EDITS)])
@pytest.mark.parametrize(
    "names",
    [
        ["blocks.0.hook_q_input"],
        ["blocks.0.hook_attn_in"],
        ["blocks.0.ln1.hook_normalized", "blocks.0.hook_q_input"],
        ["blocks.0.ln1.hook_scale", *HEAD_INPUTS],
    ],
    ids=lambda names: "+".join(n.rsplit(".", 1)[-1] for n in names),
)
def test_a_gradient_at_a_per_head_input_leaves_the_forward_pass_as_it_is(
    ours64: GPT, edit: Edit | None, names: list[str]
) -> None:
    """The logits equal, to the bit, those of a run with a graph from the embeddings on and no per-head
    input asked for (ln1's hooks asked for alike: they choose the explicit layer norm), with or without an
    edit of ln1 in the same layer. (A graph itself may change the last bits: autograd picks the kernels.
    So does the lack of one: a float32 model's products without a graph run on our CPU kernels, those with
    one on torch's, which agree to about 1e-6, to the bit on some hosts and not on others; float64 runs on
    torch's alone.)"""
    ids = torch.tensor([PROMPT])
    without = ["hook_embed", *(n for n in names if ".ln1." in n)]

    def run(names: list[str]) -> torch.Tensor:  # a fresh Interventions each run: it counts the positions seen
        edits = [Interventions((edit,), ours64.config, len(PROMPT))] if edit else []
        with torch.enable_grad():
            return ours64(ids, hooks=HookChain(*edits, GradientHooks(names))).detach()

    assert torch.equal(run(names), run(without))


@pytest.mark.parametrize("edit", LN1_EDITS, ids=[e.hook for e in LN1_EDITS])
def test_an_ln1_edit_gives_one_metric_whichever_gradients_are_asked_for(ours64: GPT, edit: Edit) -> None:
    want = plain_metric(ours64, edit)
    spec = EditSpec((edit,))
    asked = [
        ["blocks.0.hook_resid_pre"],
        ["blocks.0.ln1.hook_normalized", "blocks.0.ln1.hook_scale"],
        ["blocks.0.attn.hook_q", "blocks.0.hook_resid_mid"],
        ["blocks.1.hook_q_input", "blocks.1.hook_attn_in"],  # another layer's per-head inputs
    ]
    metrics = [gradients(ours64, PROMPT, METRIC, names, spec).metric for names in asked]
    assert metrics == [metrics[0]] * len(asked), metrics  # to the bit
    assert metrics[0] == pytest.approx(want, rel=0, abs=1e-12)
    plain = plain_metric(ours64, Edit("blocks.0.hook_resid_pre", "scale", factor=1.0))
    assert abs(want - plain) > 1e-3, "the edit should change the metric"


@pytest.mark.parametrize("name", HEAD_INPUTS)
@pytest.mark.parametrize("edit", LN1_EDITS, ids=[e.hook for e in LN1_EDITS])
def test_a_gradient_at_a_per_head_input_with_an_ln1_edit_in_its_layer_is_refused(
    ours64: GPT, edit: Edit, name: str
) -> None:
    """It would be the gradient of a run with both edited, which is refused: never the unedited metric."""
    with pytest.raises(InterventionError, match=f"gradient at {name} and an edit of {edit.hook}") as e:
        gradients(ours64, PROMPT, METRIC, ["blocks.0.hook_resid_pre", name], EditSpec((edit,)))
    assert e.value.param == "hooks"


@pytest.mark.parametrize("name", LN1)
def test_a_gradient_at_ln1_with_a_per_head_input_edited_in_its_layer_is_refused(ours64: GPT, name: str) -> None:
    spec = EditSpec((Edit("blocks.0.hook_v_input", "zero", heads=(1,)),))
    with pytest.raises(InterventionError, match=f"gradient at {name} and an edit of blocks.0.hook_v_input") as e:
        gradients(ours64, PROMPT, METRIC, [name], spec)
    assert e.value.param == "hooks"
    gradients(ours64, PROMPT, METRIC, [name.replace("blocks.0", "blocks.1")], spec)  # another layer: fine


def test_edits_of_a_per_head_input_and_of_ln1_in_one_layer_are_refused(ours64: GPT) -> None:
    spec = EditSpec((Edit("blocks.0.hook_q_input", "zero"), Edit("blocks.0.ln1.hook_normalized", "scale", factor=0.0)))
    with pytest.raises(InterventionError, match="cannot be combined") as e:
        gradients(ours64, PROMPT, METRIC, ["blocks.0.hook_resid_pre"], spec)
    assert e.value.param == "interventions"


@pytest.mark.parametrize("ln1", LN1)
@pytest.mark.parametrize("name", HEAD_INPUTS)
def test_ln1_gradient_with_a_per_head_input_equals_it_asked_alone(ours64: GPT, ln1: str, name: str) -> None:
    resid = "blocks.0.hook_resid_pre"
    together = gradients(ours64, PROMPT, METRIC, [resid, name, ln1]).grads
    for n in (resid, name, ln1):
        alone = gradients(ours64, PROMPT, METRIC, [n]).grads[n]
        assert float(alone.norm()) > 1e-3, n
        torch.testing.assert_close(together[n], alone, rtol=0, atol=1e-12, msg=n)


def _tl_gradients(model: Any, names: list[str], fwd_hooks: list[Any] | None = None) -> dict[str, torch.Tensor]:
    """TransformerLens' gradients at `names`; ln1's hooks carry a head axis there and run once per path
    (q, k, v): summed over both, as our ln1 (the stream's own, [batch, pos, d_model]) sees them."""
    grads: dict[str, torch.Tensor] = {}

    def keep(g: torch.Tensor, hook: Any) -> None:
        if ".ln1." in hook.name:
            g = g.sum(dim=2)
        grads[hook.name] = grads[hook.name] + g.detach() if hook.name in grads else g.detach()

    with model.hooks(fwd_hooks=fwd_hooks or [], bwd_hooks=[(n, keep) for n in names]):
        metric_value(METRIC, model(torch.tensor([PROMPT]))[0], PROMPT).backward()
    return grads


@pytest.mark.parametrize("switches", ["split", "attn_in"])
def test_per_head_input_and_ln1_gradients_together_equal_transformer_lens(
    tiny: Checkpoint, ours64: GPT, switches: str
) -> None:
    pytest.importorskip("transformer_lens", reason="TransformerLens (test-only oracle) is not installed")
    from tl_oracle import SWITCHES, hooked

    sites = ["hook_attn_in"] if switches == "attn_in" else ["hook_q_input", "hook_k_input", "hook_v_input"]
    sites += ["hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q"]
    names = [f"blocks.{i}.{s}" for i in range(2) for s in sites]
    want = _tl_gradients(hooked(tiny, torch.float64, **SWITCHES[switches]), names)
    got = gradients(ours64, PROMPT, METRIC, names).grads
    for name in names:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=EXACT, msg=name)


def test_gradients_with_a_per_head_input_edited_equal_transformer_lens(tiny: Checkpoint, ours64: GPT) -> None:
    """Head 1's queries read a zeroed copy of the stream: the gradient at each per-head input is through
    its own path, after the edit, as TransformerLens' backward hooks see it beside the forward hook."""
    pytest.importorskip("transformer_lens", reason="TransformerLens (test-only oracle) is not installed")
    from tl_oracle import SWITCHES, hooked

    def zero_head_1(x: torch.Tensor, hook: Any) -> torch.Tensor:
        x = x.clone()
        x[:, :, 1] = 0
        return x

    sites = ["hook_resid_pre", "hook_q_input", "hook_k_input", "hook_v_input", "attn.hook_q", "hook_resid_mid"]
    names = [f"blocks.{i}.{s}" for i in range(2) for s in sites] + ["blocks.1.ln1.hook_normalized"]
    model = hooked(tiny, torch.float64, **SWITCHES["split"])
    want = _tl_gradients(model, names, [("blocks.0.hook_q_input", zero_head_1)])
    spec = EditSpec((Edit("blocks.0.hook_q_input", "zero", heads=(1,)),))
    got = gradients(ours64, PROMPT, METRIC, names, spec).grads
    for name in names:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=EXACT, msg=name)
