"""Edits that push the residual stream past float32's range for LayerNorm's variance: at |x| near 1e19,
(x - mean)² is inf, so sqrt(var + eps) is inf and LayerNorm normalises the row to 0 while the stream itself
stays finite. The metric stays finite and every gradient through that LayerNorm is 0: gradients, the
highway, attribution and analyze gave those zeros as answers. They now refuse in one line naming the
LayerNorm; a float64 model, whose LayerNorm has the range for it, still answers."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import Checkpoint, load_ours

from model.analysis import analyze
from model.gpt import GPT
from model.hooks import Capture
from model.interventions import Edit, EditSpec, NonFiniteActivations
from model.lab.attribution import attribution
from model.lab.gradients import LogitDiff, LogProb, Loss, MetricError, gradients, highway
from model.overflow import variance_overflows

PROMPT = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
HUGE = 1e19  # O(1) values times this: finite in float32, the sum of their squares is not (nor NaN, as 1e20 can give)


def huge(hook: str, heads: tuple[int, ...] | None = None) -> Edit:
    """Position 3's values at `hook` times 1e19."""
    return Edit(hook, "scale", factor=HUGE, positions=(3,), heads=heads)


# (edit, the LayerNorm that overflows first): the stream (the next block's ln1), the MLP's own copy (ln2,
# the stream after it stays as it was), one head's own input (ln1 on that head's path), the last stream.
CASES = [
    pytest.param(huge("blocks.0.hook_resid_post"), "blocks.1.ln1", id="resid"),
    pytest.param(huge("blocks.0.hook_mlp_in"), "blocks.0.ln2", id="mlp_in"),
    pytest.param(huge("blocks.1.hook_q_input", heads=(2,)), "blocks.1.ln1", id="q_input"),
    pytest.param(huge("blocks.1.hook_resid_post"), "ln_final", id="last"),
]


def test_the_layer_norm_of_a_huge_stream_has_an_infinite_scale_and_normalises_it_to_0(tiny_model: GPT) -> None:
    """The failure itself, at LayerNorm's own hook points: a finite stream, an infinite scale, a 0 row."""
    spec = EditSpec((huge("blocks.0.hook_resid_post"),))
    capture = Capture(["blocks.1.hook_resid_pre", "blocks.1.ln1.hook_scale", "blocks.1.ln1.hook_normalized"])
    with torch.inference_mode():
        tiny_model(torch.tensor([PROMPT]), hooks=spec.hooks(tiny_model.config, len(PROMPT), then=capture))
    got = {k: v[0] for k, v in capture.tensors().items()}
    assert got["blocks.1.hook_resid_pre"].isfinite().all()
    assert got["blocks.1.ln1.hook_scale"][3].item() == float("inf")
    assert (got["blocks.1.ln1.hook_normalized"][3] == 0).all()
    assert got["blocks.1.ln1.hook_scale"][:3].isfinite().all()  # the other positions are untouched
    assert bool(variance_overflows(got["blocks.1.hook_resid_pre"]))
    assert not bool(variance_overflows(got["blocks.1.hook_resid_pre"][:3]))
    assert not bool(variance_overflows(got["blocks.1.hook_resid_pre"].double()))  # float64 has the range


@pytest.mark.parametrize(("edit", "ln"), CASES)
def test_gradients_refuse_a_layer_norm_that_overflowed(tiny_model: GPT, edit: Edit, ln: str) -> None:
    with pytest.raises(MetricError) as e:
        gradients(tiny_model, PROMPT, Loss(), ["blocks.0.hook_resid_pre", "hook_embed"], EditSpec((edit,)))
    message = str(e.value)
    assert message.startswith(f"LayerNorm {ln} overflowed: the edits pushed the residual stream past float32's range")
    assert "\n" not in message and e.value.param == "interventions"


@pytest.mark.parametrize(("edit", "ln"), CASES)
def test_analyze_refuses_a_layer_norm_that_overflowed(tiny_model: GPT, edit: Edit, ln: str) -> None:
    """A huge stream already made its norms inf; the MLP's copy and a head's input left every measure finite."""
    with pytest.raises(NonFiniteActivations) as e:
        analyze(tiny_model, PROMPT, 3, EditSpec((edit,)).hooks(tiny_model.config, len(PROMPT)))
    message = str(e.value)
    if edit.hook.endswith("hook_resid_post"):  # the stream itself: its norms tell first, as before
        assert "non-finite (inf or NaN, or too large to measure) at layer" in message
    else:
        assert message.startswith(f"LayerNorm {ln} overflowed: the edits pushed the residual stream past float32's")
    assert "\n" not in message


def test_the_highway_refuses_a_layer_norm_that_overflowed(tiny_model: GPT) -> None:
    with pytest.raises(MetricError, match=r"^LayerNorm blocks\.1\.ln1 overflowed: the edits") as e:
        highway(tiny_model, PROMPT, EditSpec((huge("blocks.0.hook_resid_post"),)), probes=1)
    assert e.value.param == "interventions"


@pytest.fixture(scope="module")
def loud_positions(tiny_model: GPT) -> GPT:
    """The tiny model with position embeddings 1e20 times larger: every stream past float32's range for
    LayerNorm's variance from the start, without any edit (the metric stayed finite, every score 0)."""
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        model.wpe.weight.mul_(1e20)
    return model


def test_attribution_refuses_a_layer_norm_that_overflowed(loud_positions: GPT) -> None:
    corrupted = [464, 3290, *PROMPT[2:]]
    with pytest.raises(MetricError) as e:
        attribution(loud_positions, PROMPT, corrupted, Loss())
    message = str(e.value)
    assert message.startswith("LayerNorm blocks.0.ln1 overflowed: the residual stream grew past float32's range")
    assert message.endswith("in the clean run: no attribution to compute") and e.value.param == "clean"


def test_gradients_without_edits_blame_the_stream_not_edits(loud_positions: GPT) -> None:
    with pytest.raises(MetricError, match=r"^LayerNorm blocks\.0\.ln1 overflowed: the residual stream grew") as e:
        gradients(loud_positions, PROMPT, Loss(), ["hook_embed"])
    assert e.value.param == "metric"


def test_float64_has_the_range_and_still_answers(tiny: Checkpoint) -> None:
    """The same edits on a float64 model: LayerNorm's variance fits, so the gradients are there, not 0."""
    model = load_ours(tiny, torch.float64)
    for case in CASES:
        edit = case.values[0]
        assert isinstance(edit, Edit)
        got = gradients(model, PROMPT, Loss(), ["hook_embed"], EditSpec((edit,))).grads["hook_embed"]
        assert got.isfinite().all() and got[0, 3].abs().sum() > 0  # position 3's too, through its LayerNorms


@pytest.mark.parametrize(("edit", "ln"), CASES)
def test_an_overflow_after_the_positions_the_metric_reads_is_not_refused(tiny_model: GPT, edit: Edit, ln: str) -> None:
    """Attention is causal: a LayerNorm that overflows at position 3 changes nothing the logits at position 2
    read. A metric there gets the run's own gradients (those of the run without the edit, 0 from position 3
    on); one that reads position 3 is still refused."""
    names = ["blocks.0.hook_resid_pre", "hook_embed"]
    got = gradients(tiny_model, PROMPT, LogProb(2068, 2), names, EditSpec((edit,)))
    plain = gradients(tiny_model, PROMPT, LogProb(2068, 2), names)
    assert got.metric == plain.metric
    for name in names:
        torch.testing.assert_close(got.grads[name], plain.grads[name], rtol=0, atol=0, msg=name)
        assert (got.grads[name][0, 3:] == 0).all()
    with pytest.raises(MetricError, match=rf"^LayerNorm {ln} overflowed"):
        gradients(tiny_model, PROMPT, LogProb(2068, 3), names, EditSpec((edit,)))


def test_an_overflow_a_mean_carries_back_to_the_metric_is_refused(tiny_model: GPT) -> None:
    """A `mean` over the positions carries a later position's overflowed LayerNorm into the earlier ones: the
    metric at position 2 then reads it, and the run is refused, as one that overflows where it reads."""
    spec = EditSpec((huge("blocks.0.hook_resid_post"), Edit("blocks.1.hook_attn_out", "mean")))
    with pytest.raises(MetricError, match=r"^LayerNorm blocks\.1\.ln1 overflowed: the edits"):
        gradients(tiny_model, PROMPT, LogProb(2068, 2), ["hook_embed"], spec)


def test_a_gradient_that_goes_inf_on_its_way_back_is_refused(tiny_model: GPT) -> None:
    """The logits times 3e38: the logit difference is finite, its gradient back through ln_final is not.
    The gradients came back inf and NaN; now the run is refused, naming the piece and the edits. At 1e30 the
    gradient is finite (each entry about 1e30) and is the answer."""
    metric, names = LogitDiff((318, 373)), ["blocks.1.hook_resid_post", "hook_embed"]
    times = lambda factor: EditSpec((Edit("logits", "scale", factor=factor),))  # noqa: E731
    with pytest.raises(
        MetricError,
        match=r"^the gradient of the metric became inf or NaN going back through the "
        r"final LayerNorm, at its input: the edits took it there",
    ) as e:
        gradients(tiny_model, PROMPT, metric, names, times(3e38))
    assert e.value.param == "interventions"
    answer = gradients(tiny_model, PROMPT, metric, names, times(1e30))
    assert all(bool(torch.isfinite(g).all()) for g in answer.grads.values())


def test_the_highway_refuses_a_jacobian_past_float16(tiny: Checkpoint) -> None:
    """Block 0's MLP output times 1e4 in float16: the forward pass and the loss's gradient stay finite, the
    block's vector-Jacobian products do not (its Jacobian's entries are about 1e4 times an O(1) probe's sum over
    the width). The highway printed nan; it is refused, saying where and why. Times 1e3 it answers."""
    for scale, fails in ((1e4, True), (1e3, False)):
        model = load_ours(tiny, torch.float16)
        with torch.no_grad():
            model.h[0].mlp.c_proj.weight.mul_(scale)
        if not fails:
            assert all(math.isfinite(g.grad_norm) for g in highway(model, PROMPT, probes=2))
            continue
        with pytest.raises(
            MetricError,
            match=r"^the gradient highway became inf or NaN at block 0's Jacobian: its "
            r"vector-Jacobian products left float16's range \(it ends at 65504\)$",
        ) as e:
            highway(model, PROMPT, probes=2)
        assert e.value.param == "gradients"


def test_the_highway_refuses_an_overflow_at_the_last_position(tiny_model: GPT) -> None:
    """The loss reads no logits at the last position, but the highway's Jacobians read every position."""
    last = Edit("blocks.0.hook_resid_post", "scale", factor=HUGE, positions=(len(PROMPT) - 1,))
    with pytest.raises(MetricError, match=r"^LayerNorm blocks\.1\.ln1 overflowed: the edits"):
        highway(tiny_model, PROMPT, EditSpec((last,)), probes=1)
