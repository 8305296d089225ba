"""SAEs in SAELens' format: SAELens itself is the oracle.

Random SAEs of each architecture are built and saved with SAELens' own classes, loaded with
`model.lab.sae.load_sae`, and their feature activations and reconstructions compared with SAELens'
`encode` and `decode` on the same vectors (float32, 1e-5). Without SAELens those tests skip, and a
written-out reference (the formulas, spelled out below) covers the same cases on files written by
`tests/sae_files.py`. The centring of `center_writing_weights` SAEs is checked against TransformerLens'
own weight processing.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import Checkpoint, load_ours
from sae_files import write_sae

from model.hooks import run_with_cache
from model.lab.sae import SAE, SAEError, load_sae, token_features
from model.lab.steering import clamp

TOL = 1e-5
D_IN, D_SAE = 16, 48
HOOK = "blocks.1.hook_resid_pre"
CASES = [  # (architecture, apply_b_dec_to_input, normalize_activations, extra config)
    ("standard", True, "none", {}),
    ("standard", False, "constant_norm_rescale", {}),
    ("standard", True, "expected_average_only_in", {}),
    ("topk", True, "none", {"k": 5}),
    ("topk", False, "constant_norm_rescale", {"k": 7, "rescale_acts_by_decoder_norm": True}),
    ("jumprelu", True, "none", {}),
    ("jumprelu", False, "constant_norm_rescale", {}),
    ("standard", True, "layer_norm", {}),  # OpenAI's v5 SAEs, as SAELens reformats them
    ("topk", True, "layer_norm", {"k": 6}),
]


def reference_encode(w: dict[str, torch.Tensor], arch: str, b_dec_in: bool, norm: str, extra: dict, x: torch.Tensor):
    """The formulas, written out: f = act((x - m) * c - b_dec [if applied]) W_enc + b_enc), with m = 0 and
    c = sqrt(d_in)/|x| for constant_norm_rescale, m = mean(x) and c = 1/(std(x) + 1e-5) (std unbiased) for
    layer_norm; act = ReLU, ReLU of the top k (pre-activations times |W_dec| if rescaled), or ReLU where
    pre > threshold. x_hat = (f [/ |W_dec|]) W_dec + b_dec, then / c + m (layer_norm: * std + m)."""
    one = torch.ones((*x.shape[:-1], 1))
    m, c, out = 0 * one, one, one
    if norm == "constant_norm_rescale":
        c = D_IN**0.5 / x.norm(dim=-1, keepdim=True)
        out = 1 / c
    elif norm == "layer_norm":
        m = x.mean(-1, keepdim=True)
        std = (x - m).std(-1, keepdim=True)
        c, out = 1 / (std + 1e-5), std
    pre = ((x - m) * c - (w["b_dec"] if b_dec_in else 0)) @ w["W_enc"] + w["b_enc"]
    if arch == "topk":
        if extra.get("rescale_acts_by_decoder_norm"):
            pre = pre * w["W_dec"].norm(dim=-1)
        keep = pre.topk(extra["k"], dim=-1).indices
        f = torch.zeros_like(pre).scatter(-1, keep, pre.gather(-1, keep).relu())
    elif arch == "jumprelu":
        f = pre.relu() * (pre > w["threshold"])
    else:
        f = pre.relu()
    g = f / w["W_dec"].norm(dim=-1) if extra.get("rescale_acts_by_decoder_norm") else f
    return f, (g @ w["W_dec"] + w["b_dec"]) * out + m


@pytest.mark.parametrize(("arch", "b_dec_in", "norm", "extra"), CASES)
def test_written_out_reference(tmp_path: Path, arch: str, b_dec_in: bool, norm: str, extra: dict) -> None:
    from safetensors.torch import load_file

    path = write_sae(
        tmp_path,
        hook=HOOK,
        d_in=D_IN,
        d_sae=D_SAE,
        architecture=arch,
        apply_b_dec_to_input=b_dec_in,
        normalize_activations=norm,
        **extra,
    )
    sae = load_sae(path)
    x = torch.randn(3, 5, D_IN, generator=torch.Generator().manual_seed(1)) * 2
    f_ref, x_hat_ref = reference_encode(load_file(path / "sae_weights.safetensors"), arch, b_dec_in, norm, extra, x)
    f, x_hat = sae.reconstruct(x)
    torch.testing.assert_close(f, f_ref, atol=TOL, rtol=0)
    torch.testing.assert_close(x_hat, x_hat_ref, atol=TOL, rtol=0)
    assert (f > 0).any() and (f == 0).any()  # a sparse code: neither everything nor nothing active


@pytest.mark.parametrize(("arch", "b_dec_in", "norm", "extra"), CASES)
def test_one_feature_and_a_clamp_of_it(tmp_path: Path, arch: str, b_dec_in: bool, norm: str, extra: dict) -> None:
    """`SAE.feature` is `encode`'s column (from W_enc's one column, but in a topk SAE), and `clamp`, which
    needs only that feature, is x + decode(f') - decode(f) with f' = f but the feature at its value."""
    path = write_sae(tmp_path, hook=HOOK, d_in=D_IN, d_sae=D_SAE, architecture=arch, apply_b_dec_to_input=b_dec_in,
                     normalize_activations=norm, **extra)  # fmt: skip
    sae = load_sae(path)
    x = torch.randn(3, 5, D_IN, generator=torch.Generator().manual_seed(4)) * 2
    f, norm_stats = sae.encode(x), sae.norm_stats(x)
    on, off = int((f > 0).sum((0, 1)).argmax()), int((f > 0).sum((0, 1)).argmin())
    for feature in (on, off, D_SAE - 1):
        torch.testing.assert_close(sae.feature(x, feature), f[..., feature], atol=TOL, rtol=0)
        for value in (0.0, 2.5):
            f_new = f.clone()
            f_new[..., feature] = value
            expected = x + sae.decode(f_new, norm_stats) - sae.decode(f, norm_stats)
            torch.testing.assert_close(clamp(x, sae, feature, value), expected, atol=TOL, rtol=0)
    assert (f[..., on] > 0).any() and (f[..., off] == 0).any()


@pytest.fixture(scope="module")
def sae_lens():
    return pytest.importorskip("sae_lens", reason="SAELens (test-only oracle) is not installed")


def saelens_sae(sae_lens, arch: str, b_dec_in: bool, norm: str, extra: dict, seed: int):
    from sae_lens.saes.sae import SAEMetadata

    configs = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
    }
    cls, cfg_cls = configs[arch]
    cfg = cfg_cls(
        d_in=D_IN,
        d_sae=D_SAE,
        apply_b_dec_to_input=b_dec_in,
        normalize_activations=norm,
        metadata=SAEMetadata(hook_name=HOOK, model_name="tiny"),
        **extra,
    )
    sae = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # SAELens starts b_enc, b_dec and threshold at 0, which would hide them
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 2 else 0.1))
            if name == "threshold":
                p.abs_()
    return sae.eval()


@pytest.mark.parametrize(("arch", "b_dec_in", "norm", "extra"), CASES)
def test_equals_saelens(sae_lens, tmp_path: Path, arch: str, b_dec_in: bool, norm: str, extra: dict) -> None:
    theirs = saelens_sae(sae_lens, arch, b_dec_in, norm, extra, seed=len(tmp_path.name))
    theirs.save_model(tmp_path)
    assert "hook_name" in json.loads((tmp_path / "cfg.json").read_text())["metadata"]  # SAELens' current layout
    ours = load_sae(tmp_path)
    assert ours.cfg.architecture == arch and ours.cfg.hook_name == HOOK
    x = torch.randn(4, 6, D_IN, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():
        f_theirs = theirs.encode(x)
        x_hat_theirs = theirs.decode(f_theirs)
        f_ours, x_hat_ours = ours.reconstruct(x)
    torch.testing.assert_close(f_ours, f_theirs, atol=TOL, rtol=0)
    torch.testing.assert_close(x_hat_ours, x_hat_theirs, atol=TOL, rtol=0)
    assert int((f_ours > 0).sum()) > 0
    if norm == "none":  # decode on its own (a run-time normalisation's decode needs the input it encoded)
        f = torch.rand(5, D_SAE, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            torch.testing.assert_close(ours.decode(f), theirs.decode(f), atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["standard", "jumprelu"])
def test_decoder_norm_flag_is_topk_only(sae_lens, tmp_path: Path, arch: str) -> None:
    """rescale_acts_by_decoder_norm is a field of SAELens' topk config alone: a standard or jumprelu cfg.json
    that carries it reads as SAELens reads it, without it (reconstructions were 2-20 apart)."""
    path = write_sae(tmp_path, hook=HOOK, d_in=D_IN, d_sae=D_SAE, architecture=arch, rescale_acts_by_decoder_norm=True)
    ours = load_sae(path)
    assert not ours.cfg.rescale_acts_by_decoder_norm
    theirs = sae_lens.SAE.load_from_disk(str(path))
    x = torch.randn(4, 6, D_IN, generator=torch.Generator().manual_seed(6)) * 3
    with torch.no_grad():
        f_theirs = theirs.encode(x)
        f_ours, x_hat_ours = ours.reconstruct(x)
        torch.testing.assert_close(f_ours, f_theirs, atol=TOL, rtol=0)
        torch.testing.assert_close(x_hat_ours, theirs.decode(f_theirs), atol=TOL, rtol=0)
    assert int((f_ours > 0).sum()) > 0


def test_legacy_layout_at_the_top_level(sae_lens, tmp_path: Path) -> None:
    """res-jb's files on the hub: hook_point at the top level, normalize_activations a boolean, no architecture."""
    path = write_sae(tmp_path / "legacy", hook="blocks.0.hook_resid_pre", d_in=D_IN, d_sae=D_SAE, legacy=True)
    ours = load_sae(path)
    assert ours.cfg.hook_name == "blocks.0.hook_resid_pre" and ours.cfg.architecture == "standard"
    theirs = sae_lens.SAE.load_from_disk(str(path))
    x = torch.randn(7, D_IN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(x), theirs.encode(x), atol=TOL, rtol=0)
    cfg = json.loads((path / "cfg.json").read_text())
    del cfg["d_sae"]  # the oldest configs give the expansion factor only
    (path / "cfg.json").write_text(json.dumps(cfg | {"expansion_factor": D_SAE // D_IN}))
    assert load_sae(path).cfg.d_sae == D_SAE


def test_centred_residual_stream_equals_transformer_lens(tiny: Checkpoint, tmp_path: Path, sae_lens) -> None:
    """An SAE trained with center_writing_weights reads TransformerLens' processed residual stream: ours
    centres the raw value over d_model, which equals that stream, and the features equal SAELens' on it."""
    tl = pytest.importorskip("transformer_lens", reason="TransformerLens (test-only oracle) is not installed")
    from tl_oracle import tl_config, tl_weights

    c = tiny.hf.config
    cfg = tl_config(tiny, torch.float32)
    processed = tl.HookedTransformer(cfg)
    processed.load_and_process_state_dict(
        tl_weights(tiny, cfg), fold_ln=False, center_writing_weights=True, center_unembed=False
    )
    processed.set_use_hook_mlp_in(True)  # TransformerLens' hook_mlp_in: a copy of resid_mid, centred as well
    ids = torch.tensor([[5, 99, 1234, 7, 42, 300]])
    hooks = ["blocks.0.hook_mlp_out", "blocks.1.hook_resid_pre", "blocks.1.hook_mlp_in"]  # in model order
    _, cache = processed.run_with_cache(ids, names_filter=hooks)
    model = load_ours(tiny)
    raw = run_with_cache(model, ids, hooks)
    d = c.n_embd
    for hook in hooks:
        path = write_sae(
            tmp_path / hook,
            hook=hook,
            d_in=d,
            d_sae=96,
            seed=5,
            metadata={"hook_name": hook, "model_from_pretrained_kwargs": {"center_writing_weights": True}},
        )
        ours = load_sae(path)
        assert ours.centred
        torch.testing.assert_close(ours.read(raw[hook]), cache[hook], atol=1e-5, rtol=0)
        assert not torch.allclose(raw[hook], cache[hook], atol=1e-3)  # centring does change the raw stream
        theirs = sae_lens.SAE.load_from_disk(str(path))
        with torch.no_grad():
            torch.testing.assert_close(ours.encode(ours.read(raw[hook])), theirs.encode(cache[hook]), atol=TOL, rtol=0)


def test_centred_releases_as_saelens_release_table_says() -> None:
    """res-jb's cfg.json does not say it; SAELens' pretrained_saes.yaml does (config_overrides): every
    gpt2-small release processed with center_writing_weights is marked so here, and no other."""
    from model.lab.sae import HUB_MODEL_KWARGS

    assert HUB_MODEL_KWARGS["jbloom/GPT2-Small-SAEs-Reformatted"] == {"center_writing_weights": True}
    yaml = pytest.importorskip("yaml")
    sae_lens_dir = Path(pytest.importorskip("sae_lens").__file__).parent
    releases = yaml.safe_load((sae_lens_dir / "pretrained_saes.yaml").read_text())
    theirs = {
        r["repo_id"]: r["config_overrides"]["model_from_pretrained_kwargs"]
        for r in releases.values()
        if r.get("model") == "gpt2-small" and "model_from_pretrained_kwargs" in (r.get("config_overrides") or {})
    }
    assert releases["gpt2-small-res-jb"]["repo_id"] in theirs
    assert theirs == HUB_MODEL_KWARGS


def test_a_copy_of_a_release_folder_is_read_as_the_hub_s(tmp_path: Path) -> None:
    """res-jb's folder copied under its repo's name (the hub name given as a local path) or found in a hub
    cache reads the centred stream, as the same folder from the hub does; mlp-tm's has its input scale folded
    in; a folder of the same files anywhere else is read as its cfg.json says."""
    from model.lab.sae import HUB_INPUT_SCALING

    res_jb = "jbloom/GPT2-Small-SAEs-Reformatted"
    for where in (f"{res_jb}/{HOOK}", f"models--{res_jb.replace('/', '--')}/snapshots/0123abc/{HOOK}", f"mine/{HOOK}"):
        folder = write_sae(tmp_path / where, hook=HOOK, d_in=D_IN, d_sae=D_SAE, legacy=True)
        assert load_sae(folder).centred == (not where.startswith("mine")), where
    mlp_tm = "tommmcgrath/gpt2-small-mlp-out-saes"
    name, scale = next(iter(HUB_INPUT_SCALING[mlp_tm].items()))
    cfg = {"normalize_activations": "expected_average_only_in"}
    plain = load_sae(write_sae(tmp_path / "plain", hook=HOOK, d_in=D_IN, d_sae=D_SAE, **cfg))
    copy = load_sae(write_sae(tmp_path / mlp_tm / name, hook=HOOK, d_in=D_IN, d_sae=D_SAE, **cfg))
    assert copy.cfg.normalize_activations == "none" and plain.cfg.normalize_activations == "expected_average_only_in"
    x = torch.randn(3, D_IN, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(copy.encode(x), plain.fold_input_scale(scale).encode(x))


def test_input_scales_as_saelens_release_table_says(sae_lens, tmp_path: Path) -> None:
    """gpt2-small-mlp-tm's SAEs were trained on inputs scaled by a factor only SAELens' release table holds
    (`norm_scaling_factor`): every gpt2-small SAE the table gives one has it here, by repo and folder, and
    folding it in does what SAELens' own folding does."""
    from model.lab.sae import HUB_INPUT_SCALING

    yaml = pytest.importorskip("yaml")
    releases = yaml.safe_load((Path(sae_lens.__file__).parent / "pretrained_saes.yaml").read_text())
    theirs: dict[str, dict[str, float]] = {}
    for r in releases.values():
        scaled = {s["path"]: s["norm_scaling_factor"] for s in r["saes"] if "norm_scaling_factor" in s}
        if r.get("model") == "gpt2-small" and scaled:
            theirs[r["repo_id"]] = scaled
    assert releases["gpt2-small-mlp-tm"]["repo_id"] in theirs
    assert theirs == HUB_INPUT_SCALING
    saved = saelens_sae(sae_lens, "standard", True, "expected_average_only_in", {}, seed=3)
    saved.save_model(tmp_path)
    folded = sae_lens.SAE.load_from_disk(str(tmp_path))
    folded.fold_activation_norm_scaling_factor(1.7)
    ours = load_sae(tmp_path).fold_input_scale(1.7)
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(x), folded.encode(x), atol=TOL, rtol=0)
        torch.testing.assert_close(ours.reconstruct(x)[1], folded.decode(folded.encode(x)), atol=TOL, rtol=0)
    assert ours.cfg.normalize_activations == folded.cfg.normalize_activations == "none"


def test_token_features(tmp_path: Path) -> None:
    sae = load_sae(write_sae(tmp_path, hook=HOOK, d_in=D_IN, d_sae=D_SAE))
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(6))
    f, x_hat = sae.reconstruct(x)
    rows = token_features(sae, x, 3, None)
    for t, row in enumerate(rows):
        top = f[t].topk(3)
        assert [i for i, _ in row.features] == [int(i) for i, v in zip(top.indices, top.values, strict=True) if v > 0]
        assert row.l0 == int((f[t] > 0).sum())
        err = (x[t] - x_hat[t]).pow(2).sum()
        assert row.mse == pytest.approx(float(err) / D_IN, rel=1e-5)
        centred = x[t] - x[t].mean()
        assert row.variance_explained == pytest.approx(1 - float(err / centred.pow(2).sum()), rel=1e-5)
    asked = token_features(sae, x, None, [3, 0, 3])
    assert [[i for i, _ in r.features] for r in asked] == [[3, 0, 3]] * 4
    assert asked[2].features[0][1] == pytest.approx(float(f[2, 3]))
    # a large finite stream (edits can drive one there): its error is finite, where the float32 sum of squares
    # overflowed to inf (null over HTTP)
    big = x * 1e25
    f, x_hat = sae.reconstruct(big)
    (row, *_) = token_features(sae, big, 3, None)
    err = (big[0] - x_hat[0]).double()
    assert row.error_norm == pytest.approx(float(err.norm()), rel=1e-5) and math.isfinite(row.error_norm)
    assert row.mse == pytest.approx(float(err.pow(2).mean()), rel=1e-5) and math.isfinite(row.mse)
    centred = (big[0] - big[0].mean()).double()
    assert row.variance_explained == pytest.approx(1 - float(err.pow(2).sum() / centred.pow(2).sum()), rel=1e-4)


def test_an_sae_in_a_folder_whose_name_is_not_utf8(tmp_path: Path) -> None:
    """Linux names a folder with any bytes: an SAE there loads (safetensors' reader refused the path, and the
    SAE was said to be "not a readable safetensors file")."""
    here = write_sae(tmp_path / "plain", hook=HOOK, d_in=D_IN, d_sae=D_SAE)
    there = write_sae(tmp_path / os.fsdecode(b"caf\xe9"), hook=HOOK, d_in=D_IN, d_sae=D_SAE)
    x = torch.randn(2, 3, D_IN, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(load_sae(there).encode(x), load_sae(here).encode(x), atol=0, rtol=0)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(SAEError, match="neither a directory"):
        load_sae(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SAEError, match=r"no cfg\.json"):
        load_sae(tmp_path / "empty")
    path = write_sae(tmp_path / "bad", hook=HOOK, d_in=D_IN, d_sae=D_SAE, architecture="gated")
    with pytest.raises(SAEError, match="architecture 'gated' is not supported"):
        load_sae(path)
    path = write_sae(tmp_path / "shape", hook=HOOK, d_in=D_IN, d_sae=D_SAE, d_sae_override=1)
    cfg = json.loads((path / "cfg.json").read_text()) | {"d_sae": D_SAE + 1}
    (path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEError, match=r"W_enc has shape \[16, 48\], cfg.json implies \[16, 49\]"):
        load_sae(path)
    path = write_sae(tmp_path / "k", hook=HOOK, d_in=D_IN, d_sae=D_SAE, architecture="topk")
    with pytest.raises(SAEError, match="topk SAE needs k"):
        load_sae(path)
    sae = load_sae(write_sae(tmp_path / "ok", hook=HOOK, d_in=D_IN, d_sae=D_SAE))
    assert isinstance(sae, SAE)
    with pytest.raises(SAEError, match=r"feature 48 is out of range 0\.\.47"):
        sae.direction(D_SAE)
    with pytest.raises(SAEError, match=r"feature must be an int \(convert numpy"):  # it said "out of range"
        sae.direction(torch.tensor(3))  # type: ignore[arg-type]


def test_an_sae_on_a_device_this_machine_lacks_is_said(tmp_path: Path) -> None:
    """As a model's: an unknown device, or CUDA without a GPU, is an SAEError in words (it was an assertion
    from inside torch)."""
    for device, says in (("tpu", "unknown device 'tpu'"), ("cuda:99", "cuda:99")):
        with pytest.raises(SAEError, match=says):
            load_sae(tmp_path, device=device)
