"""Attribution patching (model/lab/attribution.py): every score is (a_clean - a_corrupt) . grad computed by
hand from the two runs' values (a plain capture) and the corrupted run's gradients (`gradients`, checked
against transformers in test_gradients.py); `verify` patches for real, equal to a run with the `set` edit."""

from __future__ import annotations

import pytest
import torch

from model.gpt import GPT
from model.hooks import Capture
from model.interventions import Edit, EditSpec
from model.lab.attribution import Candidate, Site, attribution, score_sites, verify_site
from model.lab.gradients import LogitDiff, LogProb, Loss, Metric, MetricError, gradients, metric_value

CLEAN = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
CORRUPTED = [464, 3290, 3332, 319, 262, 2603, 780, 340]  # "The dog sat on the mat because it"
T = len(CLEAN)


def values(model: GPT, ids: list[int], names: list[str]) -> dict[str, torch.Tensor]:
    capture = Capture(names)
    with torch.inference_mode():
        model(torch.tensor([ids]), hooks=capture)
    return {n: v[0].double() for n, v in capture.tensors().items()}


@pytest.fixture(scope="module")
def ours64(tiny: object) -> GPT:
    from conftest import load_ours

    return load_ours(tiny, torch.float64)  # type: ignore[arg-type]


@pytest.mark.parametrize("metric", [LogitDiff((318, 373)), LogProb(2068, 3), Loss()], ids=lambda m: type(m).__name__)
def test_scores_are_the_clean_minus_corrupt_difference_dotted_with_the_gradient(ours64: GPT, metric: Metric) -> None:
    L, H = ours64.config.n_layer, ours64.config.n_head
    result = attribution(ours64, CLEAN, CORRUPTED, metric)
    names = [
        f"blocks.{i}.{s}" for i in range(L) for s in ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_mlp_out")
    ]
    clean, corrupt = values(ours64, CLEAN, names), values(ours64, CORRUPTED, names)
    targets = CLEAN  # the loss predicts the clean tokens in both runs
    grads = {n: g[0] for n, g in gradients(ours64, CORRUPTED, metric, names).grads.items()}
    assert result.resid_pre.shape == (L, T) and result.z.shape == (L, H)
    assert result.attn_out.shape == result.mlp_out.shape == (L,)
    for i in range(L):
        p = f"blocks.{i}."
        d = {
            s: clean[p + s] - corrupt[p + s] for s in ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_mlp_out")
        }
        for t in range(T):
            want = float(d["hook_resid_pre"][t] @ grads[p + "hook_resid_pre"][t])
            assert float(result.resid_pre[i, t]) == pytest.approx(want, rel=1e-9, abs=1e-12)
        for h in range(H):
            want = float((d["attn.hook_z"][:, h] * grads[p + "attn.hook_z"][:, h]).sum())
            assert float(result.z[i, h]) == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert float(result.attn_out[i]) == pytest.approx(
            float((d["hook_attn_out"] * grads[p + "hook_attn_out"]).sum())
        )
        assert float(result.mlp_out[i]) == pytest.approx(float((d["hook_mlp_out"] * grads[p + "hook_mlp_out"]).sum()))
    with torch.inference_mode():
        for ids, got in ((CLEAN, result.clean_metric), (CORRUPTED, result.corrupted_metric)):
            assert got == pytest.approx(float(metric_value(metric, ours64(torch.tensor([ids]))[0], targets)))
    # only position 1 differs ("cat"/"dog"): entering block 0, the other positions' streams are the same
    assert float(result.resid_pre[0, 0]) == 0 and torch.all(result.resid_pre[0, 2:] == 0)
    assert float(result.resid_pre[0, 1]) != 0


def test_verify_patches_the_top_sites_with_the_set_edit(ours64: GPT) -> None:
    metric = LogitDiff((318, 373))
    result = attribution(ours64, CLEAN, CORRUPTED, metric, verify=5)
    assert len(result.verified) == 5
    every = _scores(result)
    ranked = sorted(every.values(), key=abs, reverse=True)
    assert [v.attribution for v in result.verified] == pytest.approx(ranked[:5])
    # every site, each patched with the whole clean value of its hook (the verification keeps only the part
    # its edit sets: one position's, one head's)
    full = attribution(ours64, CLEAN, CORRUPTED, metric, verify=len(every))
    assert full.verified[:5] == result.verified
    names = sorted({v.site.hook for v in full.verified})
    clean = values(ours64, CLEAN, names)
    for v in full.verified:
        s = v.site
        edit = Edit(
            s.hook,
            "set",
            value=clean[s.hook],
            positions=None if s.position is None else (s.position,),
            heads=None if s.head is None else (s.head,),
        )
        hooks = EditSpec((edit,)).hooks(ours64.config, T)
        with torch.inference_mode():
            want = float(metric_value(metric, ours64(torch.tensor([CORRUPTED]), hooks=hooks)[0], CLEAN))
        assert v.patched_metric == pytest.approx(want, rel=1e-9)
        assert v.patched_change == pytest.approx(want - result.corrupted_metric, rel=1e-9, abs=1e-12)
    # patching the whole residual stream of layer 0 at the differing position restores the clean metric
    (site,) = [v for v in full.verified if v.site == Site("blocks.0.hook_resid_pre", 0, position=1)]
    assert site.patched_metric == pytest.approx(full.clean_metric, rel=1e-9)


def _scores(result: object) -> dict[tuple[str, int, int | None, int | None], float]:
    from model.lab.attribution import Attribution

    assert isinstance(result, Attribution)
    L = result.resid_pre.shape[0]
    out: dict[tuple[str, int, int | None, int | None], float] = {}
    for i in range(L):
        for t, s in enumerate(result.resid_pre[i].tolist()):
            out[("resid_pre", i, t, None)] = s
        for h, s in enumerate(result.z[i].tolist()):
            out[("z", i, None, h)] = s
        out[("attn_out", i, None, None)] = float(result.attn_out[i])
        out[("mlp_out", i, None, None)] = float(result.mlp_out[i])
    return out


def test_prompts_of_different_lengths_are_refused(ours64: GPT) -> None:
    with pytest.raises(MetricError) as e:
        attribution(ours64, CLEAN, CORRUPTED[:-1], Loss())
    assert e.value.param == "corrupted" and "same length" in str(e.value)
    with pytest.raises(MetricError) as e:
        attribution(ours64, CLEAN, CORRUPTED, LogProb(99999))
    assert e.value.param == "metric.token"


def test_scores_keep_only_what_their_verification_needs(ours64: GPT) -> None:
    """Between the server's engine calls the scores hold the clean run's values only where a site to verify
    needs them: nothing without `verify`, one position's vector for a residual-stream site."""
    from model.lab.attribution import score_sites

    metric = LogitDiff((318, 373))
    assert score_sites(ours64, CLEAN, CORRUPTED, metric).candidates == []
    scores = score_sites(ours64, CLEAN, CORRUPTED, metric, verify=1000)
    C = ours64.config.n_embd
    for c in scores.candidates:
        want = (C,) if c.site.position is not None else (T, *c.value.shape[1:])
        assert tuple(c.value.shape) == want, c.site
    assert len(scores.candidates) == len(_scores(scores.with_verified([])))


def test_a_patched_run_that_overflows_is_refused_naming_verify(tiny: object) -> None:
    """A verified site whose patched run drives a LayerNorm past float32's range (a clean value of 1e30 set
    into the stream, as no real clean run gives) is refused naming `verify`, the field that asked for it,
    not a metric computed through a LayerNorm that normalised the stream to 0."""
    from conftest import load_ours

    model = load_ours(tiny)  # type: ignore[arg-type]
    scores = score_sites(model, CLEAN, CORRUPTED, Loss(), verify=1)
    site = Site("blocks.1.hook_resid_pre", 1, position=2)
    huge = Candidate(site, 0.0, torch.full((model.config.n_embd,), 1e30))
    with torch.inference_mode(), pytest.raises(MetricError) as e:
        verify_site(model, scores, CLEAN, CORRUPTED, Loss(), huge)
    assert e.value.param == "verify" and str(e.value).endswith("in a run patched to verify a site: ask for verify 0")


def test_verify_is_a_count(ours64: GPT) -> None:
    """How many sites to patch for real: an int of 0 or more (-1 was taken as 0, in silence)."""
    for verify in (-1, 1.5, True):
        with pytest.raises(ValueError, match="verify is how many sites to patch for real"):
            score_sites(ours64, CLEAN, CORRUPTED, LogitDiff((318, 373)), verify=verify)  # type: ignore[arg-type]
