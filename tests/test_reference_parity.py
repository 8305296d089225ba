"""The lab's claims against the reference libraries themselves, where the rest of the suite checks them against
our own code or by hand: steering edits and SAE clamps against TransformerLens' hooked runs (clamps through
SAELens' HookedSAETransformer with the error term), /v1/features' statistics against SAELens on TransformerLens'
values, the `add`, `set` and `mean` edits against TransformerLens hooks, /v1/gradients and /v1/attribution
against TransformerLens' autograd and patched runs, and harvested sites other than the residual stream as
SAELens' ActivationsStore reads them. All on the `tiny` checkpoint, in float32, to 1e-4 absolute.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Checkpoint
from contract import safetensors_metadata
from fastapi.testclient import TestClient
from inprocess import post_ok, serve
from sae_files import write_sae
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from test_harvest import activations_store

from model.gpt import GPT
from model.hooks import hook_names, is_optional
from model.interventions import Edit, EditSpec
from model.loading import LoadedModel

pytest.importorskip("transformer_lens", reason="TransformerLens (test-only oracle) is not installed")
from tl_oracle import SWITCHES, hooked, tl_config, tl_weights

TOL = 1e-4
IDS = [464, 3797, 3332, 319, 262, 2603, 780, 340, 373, 257]  # "The cat sat on the mat because it was a"
CLEAN = [464, 3797, 3332, 319, 262, 2603, 780, 340]  # "The cat sat on the mat because it"
CORRUPTED = [464, 3290, 3332, 319, 262, 2603, 780, 340]  # "The dog sat on the mat because it"
LATER = "blocks.1.hook_resid_post"  # a value downstream of every edit here, compared with the logits
SAES: dict[str, tuple[str, dict[str, Any]]] = {  # id: (hook, write_sae's options)
    "res": ("blocks.1.hook_resid_pre", {"d_sae": 256, "seed": 1}),
    "topk": (
        "blocks.0.hook_mlp_out",
        {"d_sae": 128, "architecture": "topk", "k": 8, "seed": 2, "normalize_activations": "constant_norm_rescale"},
    ),
    "jumprelu": (
        "blocks.1.hook_resid_mid",
        {"d_sae": 128, "architecture": "jumprelu", "seed": 3, "apply_b_dec_to_input": False},
    ),
    # an attention SAE: SAELens reads hook_z's heads [head, d_head] as one vector of 4 x 16
    "z": ("blocks.0.attn.hook_z", {"d_sae": 128, "seed": 5, "reshape_activations": "hook_z"}),
}
RES = SAES["res"][0]

Hook = Callable[[torch.Tensor, Any], torch.Tensor]


@pytest.fixture(scope="module")
def sae_lens() -> Any:
    return pytest.importorskip("sae_lens", reason="SAELens (test-only oracle) is not installed")


@pytest.fixture(scope="module")
def tl(tiny: Checkpoint) -> dict[str, Any]:
    """TransformerLens' model with `tiny`'s weights, plain and with the per-head switches on."""
    return {s: hooked(tiny, torch.float32, **SWITCHES[s]) for s in ("default", "split")}


@pytest.fixture(scope="module")
def sae_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The SAES, in SAELens' saved format."""
    root = tmp_path_factory.mktemp("saes")
    return {k: write_sae(root / k, hook=hook, d_in=64, **options) for k, (hook, options) in SAES.items()}


@pytest.fixture(scope="module")
def client(loaded: LoadedModel, sae_dirs: dict[str, Path]) -> Iterator[TestClient]:
    with serve(loaded, sae=tuple(f"{k}={v}" for k, v in sae_dirs.items())) as c:
        yield c


def served(client: TestClient, interventions: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and the value at LATER of /v1/activations over IDS with `interventions`."""
    body = {"input_ids": IDS, "interventions": interventions, "activations": {"hooks": ["unembed.hook_out", LATER]}}
    r = client.post("/v1/activations", json=body)
    assert r.status_code == 200, r.text
    dump = load_safetensors(r.content)
    return dump["unembed.hook_out"], dump[LATER]


def tl_run(model: Any, fwd_hooks: list[tuple[str, Hook]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and the value at LATER of TransformerLens' run over IDS with `fwd_hooks`."""
    kept: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, hook: Any) -> None:
        kept[hook.name] = x.detach().clone()

    with torch.no_grad():
        logits = model.run_with_hooks(torch.tensor([IDS]), fwd_hooks=[*fwd_hooks, (LATER, keep)])
    return logits, kept[LATER]


def assert_same_run(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(ours[0], theirs[0], atol=TOL, rtol=0, msg="logits")
    torch.testing.assert_close(ours[1], theirs[1], atol=TOL, rtol=0, msg=LATER)


def tl_value(model: Any, hook: str) -> torch.Tensor:
    """TransformerLens' value at `hook` over IDS, [T, ...]."""
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([IDS]), names_filter=[hook])
    return cache[hook][0]


# --- steering and clamps --------------------------------------------------------------------------------

STEERING = ["steer-sae-feature-at-positions", "steer-norm-match", "orthogonal", "projection-cap"]


@pytest.mark.parametrize("case", STEERING)
def test_steering_equals_transformer_lens_hooks(
    client: TestClient, tl: dict[str, Any], sae_dirs: dict[str, Path], case: str
) -> None:
    """`steer` adds scale * the SAE feature's decoder row (W_dec's row, from the file) at the positions asked;
    with norm_match each vector keeps its norm; `orthogonal` removes the component along the direction;
    `projection_cap` caps it at the value: each as the same change made by a TransformerLens hook."""
    w_dec = load_file(sae_dirs["res"] / "sae_weights.safetensors")["W_dec"]
    v = torch.randn(64, generator=torch.Generator().manual_seed(4))
    u = v / v.norm()
    projections = tl_value(tl["default"], RES) @ u
    cap = float(projections.median())
    assert (projections > cap + 0.1).any()  # the cap binds at some positions

    def steered_at(x: torch.Tensor, hook: Any) -> torch.Tensor:
        x = x.clone()
        x[:, [1, 3]] += 7.0 * w_dec[5]
        return x

    def norm_matched(x: torch.Tensor, hook: Any) -> torch.Tensor:
        y = x - 4.0 * w_dec[11]
        return y * x.norm(dim=-1, keepdim=True) / y.norm(dim=-1, keepdim=True)

    cases: dict[str, tuple[dict[str, Any], Hook]] = {
        "steer-sae-feature-at-positions": (
            {"op": "steer", "scale": 7.0, "direction": {"sae": "res", "feature": 5}, "positions": [1, 3]},
            steered_at,
        ),
        "steer-norm-match": (
            {"op": "steer", "scale": -4.0, "direction": {"sae": "res", "feature": 11}, "norm_match": True},
            norm_matched,
        ),
        "orthogonal": (
            {"op": "orthogonal", "direction": (3 * v).tolist()},
            lambda x, hook: x - (x @ u)[..., None] * u,
        ),
        "projection-cap": (
            {"op": "projection_cap", "value": cap, "direction": v.tolist()},
            lambda x, hook: x - (x @ u - cap).clamp_min(0)[..., None] * u,
        ),
    }
    edit, fn = cases[case]
    ours = served(client, [{"hook": RES, **edit}])
    assert_same_run(ours, tl_run(tl["default"], [(RES, fn)]))
    assert float((ours[0] - served(client, [])[0]).abs().max()) > 1e-2, "the edit should change the logits"


def test_steering_at_hook_z_reads_its_heads_as_one_vector(
    client: TestClient, tl: dict[str, Any], sae_dirs: dict[str, Path]
) -> None:
    """At attn.hook_z a position's heads [head, d_head] are one vector of n_head x d_head, head after head, as
    SAELens' attention SAEs read them: an attention SAE feature's decoder row added at positions, with
    norm_match, and the component along a direction removed or capped, each as the same change made by a
    TransformerLens hook on [batch, pos, head, d_head]."""
    hook = SAES["z"][0]
    w_dec = load_file(sae_dirs["z"] / "sae_weights.safetensors")["W_dec"]  # [d_sae, 4 x 16]
    v = torch.randn(64, generator=torch.Generator().manual_seed(7))
    u = v / v.norm()
    flat_projections = tl_value(tl["default"], hook).flatten(1) @ u
    cap = float(flat_projections.median())

    def on_vectors(fn: Callable[[torch.Tensor], torch.Tensor]) -> Hook:
        return lambda z, hook: fn(z.flatten(-2)).view_as(z)

    def steered_at(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()
        z[:, [2, 5]] += 3.0 * w_dec[9].view(4, 16)
        return z

    def norm_matched(x: torch.Tensor) -> torch.Tensor:
        y = x - 2.0 * w_dec[3]
        return y * x.norm(dim=-1, keepdim=True) / y.norm(dim=-1, keepdim=True)

    cases: list[tuple[dict[str, Any], Hook]] = [
        ({"op": "steer", "scale": 3.0, "direction": {"sae": "z", "feature": 9}, "positions": [2, 5]}, steered_at),
        ({"op": "steer", "scale": -2.0, "direction": {"sae": "z", "feature": 3}, "norm_match": True},
         on_vectors(norm_matched)),
        ({"op": "orthogonal", "direction": v.tolist()}, on_vectors(lambda x: x - (x @ u)[..., None] * u)),
        ({"op": "projection_cap", "value": cap, "direction": v.tolist()},
         on_vectors(lambda x: x - (x @ u - cap).clamp_min(0)[..., None] * u)),
    ]  # fmt: skip
    plain = served(client, [])[0]
    for edit, fn in cases:
        ours = served(client, [{"hook": hook, **edit}])
        assert_same_run(ours, tl_run(tl["default"], [(hook, fn)]))
        assert float((ours[0] - plain).abs().max()) > 1e-3, f"{edit['op']} should change the logits"


@pytest.fixture(scope="module")
def hooked_sae(tiny: Checkpoint, sae_lens: Any) -> Any:
    """SAELens' HookedSAETransformer with `tiny`'s weights."""
    cfg = tl_config(tiny, torch.float32)
    model = sae_lens.HookedSAETransformer(cfg)
    model.load_state_dict(tl_weights(tiny, cfg), strict=False)
    return model.eval()


@pytest.mark.parametrize("sae_id", list(SAES))
def test_clamps_equal_hooked_sae_transformer_with_the_error_term(
    client: TestClient, hooked_sae: Any, sae_lens: Any, sae_dirs: dict[str, Path], sae_id: str
) -> None:
    """A clamp sets one feature and keeps the SAE's error term: as SAELens' HookedSAETransformer with the SAE
    spliced in (use_error_term) and the feature set at its hook_sae_acts_post, everywhere or at positions."""
    hook = SAES[sae_id][0]
    theirs = sae_lens.SAE.load_from_disk(str(sae_dirs[sae_id])).eval()
    with torch.no_grad():
        active = int((theirs.encode(tl_value(hooked_sae, hook)) > 0).sum(0).argmax())
    plain = served(client, [])[0]
    for feature, value, positions in ((active, 0.0, None), (active, 5.0, [2, 7]), (3, 2.5, [0, 9])):
        edit = {"hook": hook, "op": "clamp", "sae": sae_id, "feature": feature, "value": value}
        ours = served(client, [edit if positions is None else edit | {"positions": positions}])

        def set_feature(acts: torch.Tensor, hook: Any, feature: int = feature, value: float = value, where=positions):
            acts = acts.clone()
            acts[:, slice(None) if where is None else where, feature] = value
            return acts

        with hooked_sae.saes(saes=[theirs], use_error_term=True):
            want = tl_run(hooked_sae, [(f"{hook}.hook_sae_acts_post", set_feature)])
        assert_same_run(ours, want)
        assert float((ours[0] - plain).abs().max()) > 1e-2, f"clamping {feature} to {value} should change the logits"


@pytest.mark.parametrize("sae_id", list(SAES))
def test_feature_statistics_equal_saelens_on_transformer_lens_values(
    client: TestClient, tl: dict[str, Any], sae_lens: Any, sae_dirs: dict[str, Path], sae_id: str
) -> None:
    """/v1/features at each position: every feature's value, l0 (features above 0), mse (the squared error's
    mean over d_in), error_norm and variance_explained (this server's, per position: 1 - |error|² / |x - mean(x)|²,
    the mean over d_in; SAELens' training logs subtract the batch's mean instead), with the error
    x - decode(encode(x)) from SAELens' SAE on TransformerLens' value at the SAE's hook."""
    hook, options = SAES[sae_id]
    theirs = sae_lens.SAE.load_from_disk(str(sae_dirs[sae_id])).eval()
    x = tl_value(tl["default"], hook)  # [T, d_in], or hook_z's [T, head, d_head]
    with torch.no_grad():
        f = theirs.encode(x)
        error = (x - theirs.decode(f)).flatten(1)  # decode gives hook_z's shape back
    x = x.flatten(1)
    body = post_ok(client, "/v1/features", {"input_ids": IDS, "sae": sae_id, "features": list(range(options["d_sae"]))})
    rows = body["features"]
    assert body["hook_name"] == hook and len(rows) == len(IDS)
    values = torch.tensor([[e["value"] for e in row["features"]] for row in rows])
    torch.testing.assert_close(values, f, atol=TOL, rtol=0)
    assert [row["l0"] for row in rows] == (f > 0).sum(-1).tolist()
    got = {k: torch.tensor([row[k] for row in rows]) for k in ("mse", "error_norm", "variance_explained")}
    torch.testing.assert_close(got["mse"], error.pow(2).mean(-1), atol=TOL, rtol=0)
    torch.testing.assert_close(got["error_norm"], error.norm(dim=-1), atol=TOL, rtol=0)
    explained = 1 - error.pow(2).sum(-1) / (x - x.mean(-1, keepdim=True)).pow(2).sum(-1)
    torch.testing.assert_close(got["variance_explained"], explained, atol=TOL, rtol=0)
    assert 0 < int((f > 0).sum()) < f.numel()


# --- add, set and mean ------------------------------------------------------------------------------------

_g = torch.Generator().manual_seed(6)
V, V_HEAD, V_MLP = torch.randn(64, generator=_g), torch.randn(16, generator=_g), torch.randn(256, generator=_g)
SEQ, SEQ_V = torch.randn(len(IDS), 64, generator=_g), torch.randn(len(IDS), 4, 16, generator=_g)


def at(index: Any, new: Callable[[torch.Tensor], torch.Tensor]) -> Hook:
    """A TransformerLens hook that sets x[index] to new(x) (computed from the value as it came)."""

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
        x = x.clone()
        x[index] = new(x)
        return x

    return hook


def patch_in(clean: torch.Tensor, index: Any) -> Hook:
    """A TransformerLens hook that puts clean[index] in place of x[index]."""
    return at(index, lambda x: clean[index])


EDITS = [
    # (our edit, the TransformerLens hook point and hook that make the same change, the switches they need)
    (
        Edit("blocks.0.hook_attn_out", "add", value=V, positions=(1, 5)),
        "blocks.0.hook_attn_out",
        at(np.s_[:, [1, 5]], lambda x: x[:, [1, 5]] + V),
        "default",
    ),
    (
        Edit("blocks.1.attn.hook_z", "add", value=V_HEAD, heads=(2,), positions=(0, 4)),
        "blocks.1.attn.hook_z",
        at(np.s_[:, [0, 4], 2], lambda x: x[:, [0, 4], 2] + V_HEAD),
        "default",
    ),
    (
        Edit("blocks.1.attn.hook_result", "add", value=V, heads=(1, 3)),
        "blocks.1.attn.hook_result",
        at(np.s_[:, :, [1, 3]], lambda x: x[:, :, [1, 3]] + V),
        "split",
    ),
    (
        Edit("blocks.*.mlp.hook_post", "add", value=V_MLP, layers=(1,)),
        "blocks.1.mlp.hook_post",
        lambda x, hook: x + V_MLP,
        "default",
    ),
    (
        Edit("blocks.1.hook_resid_mid", "set", value=V, positions=(2, 3)),
        "blocks.1.hook_resid_mid",
        at(np.s_[:, [2, 3]], lambda x: V),
        "default",
    ),
    (
        Edit("blocks.0.hook_resid_mid", "set", value=SEQ),
        "blocks.0.hook_resid_mid",
        lambda x, hook: SEQ[None],
        "default",
    ),
    (
        Edit("blocks.0.attn.hook_q", "set", value=V_HEAD, heads=(0, 3), positions=(2,)),
        "blocks.0.attn.hook_q",
        at(np.s_[:, 2, [0, 3]], lambda x: V_HEAD),
        "default",
    ),
    (
        Edit("blocks.1.attn.hook_v", "set", value=SEQ_V, heads=(1,)),
        "blocks.1.attn.hook_v",
        at(np.s_[:, :, 1], lambda x: SEQ_V[None, :, 1]),
        "default",
    ),
    (
        Edit("blocks.0.hook_mlp_out", "mean"),
        "blocks.0.hook_mlp_out",
        lambda x, hook: x.mean(1, keepdim=True).expand_as(x),
        "default",
    ),
    (
        Edit("blocks.1.hook_attn_out", "mean", positions=(1, 3, 4)),
        "blocks.1.hook_attn_out",
        at(np.s_[:, [1, 3, 4]], lambda x: x.mean(1, keepdim=True)),
        "default",
    ),
    (
        Edit("blocks.0.attn.hook_k", "mean", heads=(2,)),
        "blocks.0.attn.hook_k",
        at(np.s_[:, :, 2], lambda x: x[:, :, 2].mean(1, keepdim=True)),
        "default",
    ),
]


@pytest.mark.parametrize(
    ("edit", "tl_hook", "fn", "switches"),
    EDITS,
    ids=[f"{e.op}-{e.hook}-heads{e.heads}-positions{e.positions}" for e, *_ in EDITS],
)
def test_add_set_and_mean_act_as_the_same_transformer_lens_hook(
    tiny_model: GPT, tl: dict[str, Any], edit: Edit, tl_hook: str, fn: Hook, switches: str
) -> None:
    """`add` adds its value, `set` puts it in place (one position's worth broadcast, or a whole sequence's),
    `mean` puts the mean over the prompt's positions, each at the heads and positions selected only."""
    ids = torch.tensor([IDS])
    with torch.inference_mode():
        ours = tiny_model(ids, hooks=EditSpec((edit,)).hooks(tiny_model.config, len(IDS)))
        plain = tiny_model(ids)
        theirs = tl[switches].run_with_hooks(ids, fwd_hooks=[(tl_hook, fn)])
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    assert float((ours - plain).abs().max()) > 1e-2, "the edit should change the logits"


# --- gradients and attribution patching -------------------------------------------------------------------

DEFAULT_HOOKS = [n for n in hook_names(2) if not is_optional(n) and n != "logits"]


def tl_metric(logits: torch.Tensor, metric: dict[str, Any], targets: list[int]) -> torch.Tensor:
    """A metric of TransformerLens' logits [1, T, vocab], written out from the API's description (a loss over
    `targets`, the tokens each position predicts the next of)."""
    row = logits[0]
    if metric["type"] == "logprob":
        return torch.log_softmax(row[metric["position"]], -1)[metric["token"]]
    if metric["type"] == "logit_diff":
        a, b = metric["tokens"]
        return row[metric["position"], a] - row[metric["position"], b]
    start, end = metric.get("span") or (1, len(targets))
    return torch.nn.functional.cross_entropy(row[start - 1 : end - 1], torch.tensor(targets[start:end]))


def tl_gradients(
    model: Any, ids: list[int], metric: dict[str, Any], names: list[str], targets: list[int]
) -> tuple[float, dict[str, torch.Tensor]]:
    """The metric of TransformerLens' run over `ids` and its gradient at `names` (backward hooks)."""
    grads: dict[str, torch.Tensor] = {}

    def keep(g: torch.Tensor, hook: Any) -> None:  # a value read on several paths: the sum of their gradients
        grads[hook.name] = grads[hook.name] + g.detach() if hook.name in grads else g.detach().clone()

    with model.hooks(bwd_hooks=[(n, keep) for n in names]):
        value = tl_metric(model(torch.tensor([ids])), metric, targets)
        value.backward()
    return float(value.detach()), grads


METRICS = [
    {"type": "logprob", "token": 373, "position": -3},
    {"type": "logprob", "token": 2068, "position": -1},
    {"type": "logit_diff", "tokens": [318, 373], "position": 4},
    {"type": "loss"},
    {"type": "loss", "span": [3, 8]},
]


@pytest.mark.parametrize("metric", METRICS, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_gradients_equal_transformer_lens_autograd(client: TestClient, tl: dict[str, Any], metric: dict) -> None:
    """/v1/gradients at every default hook point, and the metric's value: TransformerLens' backward hooks on
    its own run, the metric written out independently (log_softmax, a logit difference, cross-entropy)."""
    r = client.post("/v1/gradients", json={"input_ids": IDS, "metric": metric, "hooks": ["*"], "format": "safetensors"})
    assert r.status_code == 200, r.text
    got = load_safetensors(r.content)
    value, want = tl_gradients(tl["default"], IDS, metric, DEFAULT_HOOKS, IDS)
    assert json.loads(safetensors_metadata(r.content)["metric"])["value"] == pytest.approx(value, abs=TOL)
    assert set(want) == set(DEFAULT_HOOKS)
    for name in DEFAULT_HOOKS:  # masked attention scores: 0 here, NaN or 0 in TransformerLens
        assert got[name + "_grad"].isfinite().all(), name
        torch.testing.assert_close(got[name + "_grad"], want[name].nan_to_num(), atol=TOL, rtol=0, msg=name)


SITES = ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_mlp_out")


@pytest.mark.parametrize("metric", METRICS[1:4], ids=lambda m: m["type"])
def test_attribution_equals_transformer_lens_autograd_and_patching(
    client: TestClient, tl: dict[str, Any], metric: dict
) -> None:
    """/v1/attribution's scores are (clean - corrupted value) · the corrupted run's gradient, summed per
    position (resid_pre), per head (z) or whole (attn_out, mlp_out), from TransformerLens' caches and autograd;
    each verified site's patched metric is TransformerLens' corrupted run with that site's clean value patched in
    by a hook (the loss predicting the clean tokens in both runs)."""
    every_site = 2 * (len(CLEAN) + 4 + 2)  # per layer: resid_pre at each position, z of each head, attn_out, mlp_out
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "metric": metric, "verify": every_site}
    got = post_ok(client, "/v1/attribution", body)
    model = tl["default"]
    names = [f"blocks.{i}.{s}" for i in range(2) for s in SITES]
    with torch.no_grad():
        clean_logits, clean = model.run_with_cache(torch.tensor([CLEAN]), names_filter=names)
        _, corrupt = model.run_with_cache(torch.tensor([CORRUPTED]), names_filter=names)
    corrupted_metric, grads = tl_gradients(model, CORRUPTED, metric, names, CLEAN)
    assert got["clean"]["metric"] == pytest.approx(float(tl_metric(clean_logits, metric, CLEAN)), abs=TOL)
    assert got["corrupted"]["metric"] == pytest.approx(corrupted_metric, abs=TOL)
    score = {n: ((clean[n] - corrupt[n]) * grads[n])[0] for n in names}
    want = {
        "resid_pre": torch.stack([score[f"blocks.{i}.hook_resid_pre"].sum(-1) for i in range(2)]),
        "z": torch.stack([score[f"blocks.{i}.attn.hook_z"].sum((0, 2)) for i in range(2)]),
        "attn_out": torch.stack([score[f"blocks.{i}.hook_attn_out"].sum() for i in range(2)]),
        "mlp_out": torch.stack([score[f"blocks.{i}.hook_mlp_out"].sum() for i in range(2)]),
    }
    for key, value in want.items():
        torch.testing.assert_close(torch.tensor(got[key]), value, atol=TOL, rtol=0, msg=key)
    assert len(got["verified"]) == every_site
    for v in got["verified"]:
        s = v["site"]
        index: Any
        if s["position"] is not None:
            index = np.s_[:, s["position"]]
        elif s["head"] is not None:
            index = np.s_[:, :, s["head"]]
        else:
            index = np.s_[:]
        patch = patch_in(clean[s["hook"]], index)
        with torch.no_grad():
            logits = model.run_with_hooks(torch.tensor([CORRUPTED]), fwd_hooks=[(s["hook"], patch)])
        patched = float(tl_metric(logits, metric, CLEAN))
        assert v["patched_metric"] == pytest.approx(patched, abs=TOL), s
        assert v["patched_change"] == pytest.approx(patched - corrupted_metric, abs=TOL), s


# --- harvest ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hook", "d_in"),
    [("blocks.0.mlp.hook_post", 256), ("ln_final.hook_normalized", 64), ("blocks.1.attn.hook_z", 4 * 16)],
)
def test_harvested_sites_read_by_saelens_activations_store(
    tiny: Checkpoint, tokenizer_dir: Path, tl: dict[str, Any], sae_lens: Any, tmp_path: Path, hook: str, d_in: int
) -> None:
    """A harvest in SAELens' format at a site other than the residual stream (the MLP's d_mlp-wide activation,
    the final LayerNorm's output, attention's hook_z with its heads as one vector, as SAELens' attention SAEs
    train on it): SAELens' ActivationsStore reads, batch by batch, TransformerLens' values at that hook on the
    token ids it reads with them."""
    from model.harvest import harvest

    words = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "from", "home"]
    docs = [" ".join(words[(i * 5) % 13 :] + words[: i % 7]) for i in range(24)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "cache"
    context = 16
    manifest = harvest(
        tiny.path,
        source,
        out,
        [hook],
        context_size=context,
        batch_size=4,
        shard_size=8,
        format="saelens",
        tokenizer=str(tokenizer_dir),
        device="cpu",
        dtype="float32",
    )
    n = manifest.n_contexts
    assert n is not None and n >= 8
    store = activations_store(out, hook, context, d_in, n)
    for _ in range(n // 4):
        acts, token_ids = store.get_raw_llm_batch()
        assert token_ids is not None
        with torch.no_grad():
            _, cache = tl["default"].run_with_cache(token_ids.long().reshape(4, context), names_filter=[hook])
        torch.testing.assert_close(acts, cache[hook].reshape(-1, d_in), atol=TOL, rtol=0)
