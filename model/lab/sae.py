"""Sparse autoencoders over the residual stream, in SAELens' saved format.

An SAE rewrites one hook point's value x [d_in] as a sparse, non-negative code f [d_sae] and back
(Bricken et al. 2023, "Towards Monosemanticity"; Cunningham et al. 2023):

    f     = act((x' - b_dec·[apply_b_dec_to_input]) W_enc + b_enc)      x' = x, normalised (below)
    x̂'    = f W_dec + b_dec,   x̂ = x̂' un-normalised

act is a ReLU (`standard`), a ReLU of the k largest pre-activations (`topk`, Gao et al. 2024) or a ReLU
that also zeroes what is at or below a per-feature `threshold` (`jumprelu`, Rajamanoharan et al. 2024).
This is SAELens' `encode`/`decode` for the architectures it saves, checked against SAELens itself in
`tests/test_sae.py`.

Weight processing. TransformerLens' `center_writing_weights` subtracts, from every matrix and bias
that writes into the residual stream (W_E, W_pos, W_O, b_O, W_out, b_out), its mean over d_model. Each
LayerNorm subtracts the mean first, so the network computes the same function, but its residual stream
(and attn_out, mlp_out, ...) is the raw one minus its own mean over d_model at every position. SAEs
trained on such a model (SAELens' `gpt2-small-res-jb`, trained with `center_writing_weights: true`) read
that centred stream: `SAE.read` takes the raw model's value to it, x - mean(x), exactly what SAELens
computes on its processed model (tested against TransformerLens). LayerNorm folding changes no residual
value, so it needs nothing.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

import torch

from ..config import GPTConfig
from ..hooks import as_vectors, hook_names, is_hook_z, reads_as_one_vector, site_shape
from ..hub import download, hub_errors
from ..json_file import clip, is_int, read_json
from ..safetensors_file import SafetensorsError, SafetensorsFile

Architecture = Literal["standard", "topk", "jumprelu"]
ARCHITECTURES = ("standard", "topk", "jumprelu")
Normalization = Literal["none", "expected_average_only_in", "constant_norm_rescale", "layer_norm"]
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
CFG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"

log = logging.getLogger(__name__)

# Releases whose cfg.json does not say how the model was processed, though SAELens' release table
# (`pretrained_saes.yaml`, `config_overrides`) does: repo id -> the model's `from_pretrained` arguments.
HUB_MODEL_KWARGS: dict[str, dict[str, Any]] = {
    "jbloom/GPT2-Small-SAEs-Reformatted": {"center_writing_weights": True},  # gpt2-small-res-jb
    "jbloom/GPT2-Small-Feature-Splitting-Experiment-Layer-8": {"center_writing_weights": True},
    "tommmcgrath/gpt2-small-mlp-out-saes": {"center_writing_weights": True},  # gpt2-small-mlp-tm
}
# Releases trained on inputs scaled to an average norm of √d_in (`expected_average_only_in`) by a factor their
# files do not hold, though SAELens' release table does (`norm_scaling_factor`, which its `from_pretrained`
# folds into the weights): repo id -> {folder: factor}.
HUB_INPUT_SCALING: dict[str, dict[str, float]] = {
    "tommmcgrath/gpt2-small-mlp-out-saes": {  # gpt2-small-mlp-tm
        "sae_group_gpt2_blocks.0.hook_mlp_out_24576:v1": 1.049317316132615,
        "sae_group_gpt2_blocks.1.hook_mlp_out_24576:v0": 2.3693984005104283,
        "sae_group_gpt2_blocks.2.hook_mlp_out_24576:v0": 1.6411934982190302,
        "sae_group_gpt2_blocks.3.hook_mlp_out_24576:v0": 1.8958522157897557,
        "sae_group_gpt2_blocks.4.hook_mlp_out_24576:v0": 1.81673478700627,
        "sae_group_gpt2_blocks.5.hook_mlp_out_24576:v0": 1.550234472245924,
        "sae_group_gpt2_blocks.6.hook_mlp_out_24576:v0": 1.3237742807210804,
        "sae_group_gpt2_blocks.7.hook_mlp_out_24576:v0": 1.1042905114723296,
        "sae_group_gpt2_blocks.8.hook_mlp_out_24576:v1": 0.9123762783479742,
        "sae_group_gpt2_blocks.9.hook_mlp_out_24576:v0": 0.6955335635232373,
        "sae_group_gpt2_blocks.10.hook_mlp_out_24576:v0": 0.3619728926727644,
        "sae_group_gpt2_blocks.11.hook_mlp_out_24576:v2": 0.2851548652550073,
    },
}
# The sites TransformerLens' centring changes: the residual stream (`hook_mlp_in` is a copy of resid_mid) and
# what writes into it.
CENTRED_SITES = ("hook_embed", "hook_pos_embed", "hook_resid_pre", "hook_resid_mid", "hook_resid_post",
                 "hook_mlp_in", "hook_attn_out", "hook_mlp_out", "attn.hook_result")  # fmt: skip


class Norm(NamedTuple):
    """A run-time normalisation of an SAE's input: in (x - shift) * scale_in, out x̂ * scale_out + shift."""

    shift: torch.Tensor  # [..., 1]
    scale_in: torch.Tensor
    scale_out: torch.Tensor


def _gated(pre: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """Feature activations from pre-activations: ReLU, and with a `threshold` (JumpReLU) zero where the
    pre-activation does not exceed it."""
    f = pre.relu()
    return f if threshold is None else f * (pre > threshold).to(f.dtype)


class SAEError(ValueError):
    """An SAE that cannot be loaded or used: the message names the file, field or value, and what is valid."""


@dataclass(frozen=True)
class SAEConfig:
    """What `cfg.json` says, read from SAELens' current layout (`hook_name`, `model_name` under
    `metadata`) or its older one (both at the top level, `hook_point` before 6.0)."""

    architecture: Architecture
    d_in: int
    d_sae: int
    hook_name: str
    apply_b_dec_to_input: bool = True
    normalize_activations: Normalization = "none"
    k: int | None = None  # topk: features kept per position
    rescale_acts_by_decoder_norm: bool = False  # topk: rank pre-activations by f_i ‖W_dec[i]‖
    center_writing_weights: bool = False  # trained on TransformerLens' centred residual stream
    model_name: str | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str, model_kwargs: dict[str, Any] | None = None) -> SAEConfig:
        meta: dict[str, Any] = _object(cfg, "metadata", where)

        def field(*names: str) -> Any:
            for source in (meta, cfg):
                for name in names:
                    if source.get(name) is not None:
                        return source[name]
            return None

        architecture = cfg.get("architecture", "standard")
        if cfg.get("activation_fn") == "topk" or cfg.get("activation_fn_str") == "topk":  # before SAELens 6
            architecture = "topk"
        if architecture not in ARCHITECTURES:
            raise SAEError(
                f"{where}: architecture {clip(architecture)} is not supported; use one of {', '.join(ARCHITECTURES)}"
            )
        norm = cfg.get("normalize_activations")
        if norm is None:
            norm = "none"
        if isinstance(norm, bool):  # SAELens before 6 wrote a boolean
            norm = "expected_average_only_in" if norm else "none"
        if norm not in NORMALIZATIONS:
            raise SAEError(
                f"{where}: normalize_activations {clip(norm)} is not supported; use one of {', '.join(NORMALIZATIONS)}"
            )
        hook = field("hook_name", "hook_point")
        if hook is None:
            raise SAEError(f"{where}: no hook_name (under metadata, or at the top level as older releases keep it)")
        if not isinstance(hook, str):
            raise SAEError(f"{where}: {CFG_FILE} field hook_name must be a string, got {clip(hook)}")
        model_name = field("model_name")
        if model_name is not None and not isinstance(model_name, str):
            raise SAEError(f"{where}: {CFG_FILE} field model_name must be a string, got {clip(model_name)}")
        d_in, d_sae, factor = cfg.get("d_in"), cfg.get("d_sae"), cfg.get("expansion_factor")
        if d_sae is None and factor is not None:  # the oldest training configs give only the ratio
            if not (is_int(factor) and factor > 0):
                raise SAEError(
                    f"{where}: {CFG_FILE} field expansion_factor must be a positive integer, got {clip(factor)}"
                )
            if is_int(d_in):
                d_sae = d_in * factor
        if not (is_int(d_in) and is_int(d_sae) and d_in > 0 and d_sae > 0):
            raise SAEError(f"{where}: d_in and d_sae must be positive integers, got {clip(d_in)} and {clip(d_sae)}")
        if max(d_in, d_sae) >= 2**63:  # d_in times a factor can even have too many digits to print
            raise SAEError(
                f"{where}: d_in and d_sae must be below 2**63 (no tensor has a longer dimension), "
                f"got {clip(d_in)} and {clip(d_sae)}"
            )
        reshape = field("reshape_activations")
        if reshape not in (None, "none", "hook_z"):
            raise SAEError(f"{where}: reshape_activations must be none or hook_z, got {clip(reshape)}")
        if reshape == "hook_z" and not is_hook_z(hook):
            raise SAEError(f"{where}: reshape_activations hook_z is for SAEs of attn.hook_z, not of {clip(hook)}")
        k = cfg.get("k")
        if k is None:
            k = _object(cfg, "activation_fn_kwargs", where).get("k")
        if architecture == "topk" and not (is_int(k) and 0 < k <= d_sae):
            raise SAEError(f"{where}: a topk SAE needs k in 1..{d_sae}, got {clip(k)}")
        held = meta if meta.get("model_from_pretrained_kwargs") is not None else cfg
        kwargs = {**_object(held, "model_from_pretrained_kwargs", where), **(model_kwargs or {})}
        return cls(
            architecture=architecture,
            d_in=d_in,
            d_sae=d_sae,
            hook_name=hook,
            apply_b_dec_to_input=_flag(cfg, "apply_b_dec_to_input", True, where),
            normalize_activations=cast(Normalization, norm),
            k=k if architecture == "topk" else None,
            # topk's alone: SAELens' other configs have no such field, and drop it where a cfg.json has it
            rescale_acts_by_decoder_norm=architecture == "topk"
            and _flag(cfg, "rescale_acts_by_decoder_norm", False, where),
            center_writing_weights=_flag(kwargs, "center_writing_weights", False, where),
            model_name=model_name,
        )


def _object(cfg: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """The JSON object `cfg[name]` ({} where it is absent or null)."""
    value = cfg.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SAEError(f"{where}: {CFG_FILE} field {name} must be a JSON object, got {clip(value)}")
    return value


def _flag(cfg: dict[str, Any], name: str, default: bool, where: str) -> bool:
    """The JSON boolean `cfg[name]` (`default` where it is absent; null is false, as in SAELens)."""
    value = cfg.get(name, default)
    if value is not None and not isinstance(value, bool):
        raise SAEError(f"{where}: {CFG_FILE} field {name} must be true or false, got {clip(value)}")
    return bool(value)


class SAE:
    """One sparse autoencoder's weights and its encode and decode (float32, on one device)."""

    def __init__(self, cfg: SAEConfig, weights: dict[str, torch.Tensor], source: str = "") -> None:
        self.cfg, self.source = cfg, source
        need = {
            "W_enc": (cfg.d_in, cfg.d_sae),
            "b_enc": (cfg.d_sae,),
            "W_dec": (cfg.d_sae, cfg.d_in),
            "b_dec": (cfg.d_in,),
            **({"threshold": (cfg.d_sae,)} if cfg.architecture == "jumprelu" else {}),
        }
        for name, shape in need.items():
            if name not in weights:
                raise SAEError(f"{source}: {WEIGHTS_FILE} has no tensor {name!r} (it has {clip(list(weights))})")
            if tuple(weights[name].shape) != shape:
                raise SAEError(
                    f"{source}: {name} has shape {list(weights[name].shape)}, cfg.json implies {list(shape)}"
                )
            if not weights[name].is_floating_point():
                raise SAEError(
                    f"{source}: {WEIGHTS_FILE} holds {name} as {str(weights[name].dtype).removeprefix('torch.')}; "
                    "an SAE's weights are floating point"
                )
        w = {name: weights[name].to(torch.float32) for name in need}
        for name, t in w.items():  # float32: a float64 weight past its range would be infinite
            if not bool(torch.isfinite(t).all()):
                raise SAEError(f"{source}: {WEIGHTS_FILE} holds NaN or infinite values in {name}")
        self.W_enc, self.b_enc, self.W_dec, self.b_dec = w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"]
        self.threshold = w.get("threshold")

    def to(self, device: torch.device | str) -> SAE:
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """The SAE's input from our (unprocessed) model's value at its hook, float32 [..., d_in]: centred
        over d_model when the SAE was trained on TransformerLens' centred residual stream; at `attn.hook_z`,
        [..., head, d_head] with the heads flattened into one vector (`as_vectors`), as SAELens reads it.
        (Rows that are one vector already, as a harvest in SAELens' format stores them, go to `encode`.)"""
        x = as_vectors(self.cfg.hook_name, x).to(device=self.device, dtype=torch.float32)
        return x - x.mean(dim=-1, keepdim=True) if self.centred else x

    @property
    def centred(self) -> bool:
        return self.cfg.center_writing_weights and self.cfg.hook_name.endswith(CENTRED_SITES)

    def fold_input_scale(self, factor: float) -> SAE:
        """An `expected_average_only_in` SAE's training-time input scale folded into its weights, as SAELens'
        `fold_activation_norm_scaling_factor`: it encodes x as it encoded x * factor in training, and decodes
        back to x's scale (W_enc * factor, W_dec / factor, b_dec / factor); then it normalises nothing."""
        self.W_enc, self.W_dec, self.b_dec = self.W_enc * factor, self.W_dec / factor, self.b_dec / factor
        self.cfg = replace(self.cfg, normalize_activations="none")
        return self

    def norm_stats(self, x: torch.Tensor) -> Norm | None:
        """How each position's input is normalised before encoding, and the reconstruction un-normalised
        (SAELens' run-time normalisation), or None. `constant_norm_rescale`: x * c with c = √d_in/‖x‖, out
        x̂ / c. `layer_norm`: (x - mu)/(s + 1e-5) with s the unbiased std over d_in, out x̂ s + mu.
        (`expected_average_only_in` is a training-time scale: folded in at load where SAELens' release
        table gives it (`fold_input_scale`), else left out, as SAELens' `load_from_disk` leaves it.)"""
        norm = self.cfg.normalize_activations
        if norm == "constant_norm_rescale":
            c = math.sqrt(self.cfg.d_in) / x.norm(dim=-1, keepdim=True)  # [..., 1]
            return Norm(torch.zeros_like(c), c, 1 / c)
        if norm == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            std = (x - mu).std(dim=-1, keepdim=True)
            return Norm(mu, 1 / (std + 1e-5), std)
        return None

    def _encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        """What W_enc multiplies: x [..., d_in] normalised, less b_dec where the SAE says so."""
        norm = self.norm_stats(x)
        x_in = (x - norm.shift) * norm.scale_in if norm is not None else x
        return x_in - self.b_dec if self.cfg.apply_b_dec_to_input else x_in

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """SAELens' `encode`: [..., d_in] -> the feature activations [..., d_sae]."""
        pre = self._encoder_input(x) @ self.W_enc + self.b_enc  # [..., d_sae]
        if self.cfg.architecture == "topk":
            if self.cfg.rescale_acts_by_decoder_norm:
                pre = pre * self.W_dec.norm(dim=-1)
            assert self.cfg.k is not None
            top = pre.topk(self.cfg.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu())
        return _gated(pre, self.threshold)

    def feature(self, x: torch.Tensor, feature: int) -> torch.Tensor:
        """Feature `feature`'s activation [...] at inputs x [..., d_in], as `encode` gives it: from W_enc's one
        column, except in a topk SAE, which encodes in full (whether the feature is among the k largest
        pre-activations depends on all of them)."""
        if self.cfg.architecture == "topk":
            return self.encode(x)[..., feature]
        pre = self._encoder_input(x) @ self.W_enc[:, feature] + self.b_enc[feature]  # [...]
        return _gated(pre, None if self.threshold is None else self.threshold[feature])

    def decode(self, f: torch.Tensor, norm: Norm | None = None) -> torch.Tensor:
        """SAELens' `decode`: feature activations [..., d_sae] -> the reconstruction [..., d_in]. `norm`:
        the input's `norm_stats`, which the reconstruction is un-normalised with."""
        if self.cfg.rescale_acts_by_decoder_norm:
            f = f / self.W_dec.norm(dim=-1)
        x_hat = f @ self.W_dec + self.b_dec
        return x_hat * norm.scale_out + norm.shift if norm is not None else x_hat

    def reconstruct(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, reconstruction) of SAE inputs x [..., d_in] (what `read` gives)."""
        f = self.encode(x)
        return f, self.decode(f, self.norm_stats(x))

    def direction(self, feature: int) -> torch.Tensor:
        """Feature `feature`'s decoder row W_dec[feature] [d_in]: the direction it writes."""
        self.check_feature(feature, "feature")
        return self.W_dec[feature]

    def check_feature(self, feature: object, what: str) -> int:
        if not isinstance(feature, int) or isinstance(feature, bool):
            raise SAEError(f"{what} must be an int (convert numpy or torch values with int()), got {clip(feature)}")
        if not 0 <= feature < self.cfg.d_sae:
            raise SAEError(f"{what} {clip(feature)} is out of range 0..{self.cfg.d_sae - 1}")
        return feature


# --- where the files are --------------------------------------------------------------------------


def load_sae(source: str | Path, device: torch.device | str = "cpu") -> SAE:
    """An SAE from a directory holding `cfg.json` and `sae_weights.safetensors`, or from the Hugging Face
    hub as `owner/repo/path/in/repo[@revision]` (downloaded through huggingface-hub, cached)."""
    from ..loading import LoadError, resolve_device  # loading's import of the model package waits for its use

    try:
        device = resolve_device(device)  # a device this machine lacks: said, not an assertion inside torch
    except LoadError as e:
        raise SAEError(str(e)) from None
    path = Path(source).expanduser()
    if path.is_dir():
        repo, folder = _release_copy(path) or ("", "")  # a release's folder copied: read as the hub's is
        return _from_dir(path, str(source), repo, folder).to(device)
    if path.exists():  # a file here is not a hub name either
        raise SAEError(
            f"{str(source)!r} is a file: give the SAE's directory (the one holding {CFG_FILE} and {WEIGHTS_FILE})"
        )
    m = re.fullmatch(r"([\w.-]+/[\w.-]+)((?:/[^@]+)?)(?:@([\w./-]+))?", str(source))
    if m is None or str(source).startswith((".", "/", "~")):
        raise SAEError(
            f"no SAE at {str(source)!r}: it is neither a directory (with {CFG_FILE} and {WEIGHTS_FILE}) nor a hub "
            "repo and path such as jbloom/GPT2-Small-SAEs-Reformatted/blocks.8.hook_resid_pre"
        )
    repo, folder, revision = m.group(1), m.group(2).strip("/"), m.group(3)
    return _download(repo, folder, revision, str(source)).to(device)


def _release_copy(path: Path) -> tuple[str, str] | None:
    """(repo, folder) where `path` is a copy of a folder of a release in `HUB_MODEL_KWARGS` or
    `HUB_INPUT_SCALING`, under its repo's name (`.../jbloom/GPT2-Small-SAEs-Reformatted/blocks.8.hook_resid_pre`,
    the hub name given as a local path) or in a hub cache (`.../models--jbloom--GPT2-Small-SAEs-Reformatted/
    snapshots/<revision>/blocks.8.hook_resid_pre`); else None."""
    parts = path.absolute().parts
    for repo in HUB_MODEL_KWARGS.keys() | HUB_INPUT_SCALING.keys():
        owner, name = repo.split("/")
        for i in range(len(parts) - 1):
            if parts[i : i + 2] == (owner, name):
                return repo, "/".join(parts[i + 2 :])
            if parts[i] == f"models--{owner}--{name}" and parts[i + 1 : i + 2] == ("snapshots",):
                return repo, "/".join(parts[i + 3 :])
    return None


def _from_dir(path: Path, where: str, repo: str = "", folder: str = "") -> SAE:
    """The SAE in `path`; `repo` and `folder`, where it is (a copy of) a hub folder, name its release's
    processing that its files do not hold (`HUB_MODEL_KWARGS`, `HUB_INPUT_SCALING`)."""
    cfg_path, weights_path = path / CFG_FILE, path / WEIGHTS_FILE
    for f in (cfg_path, weights_path):
        if not f.is_file():
            raise SAEError(
                f"{where}: no {f.name} in {path} (an SAE in SAELens' format has {CFG_FILE} and {WEIGHTS_FILE})"
            )
    cfg = read_json(cfg_path, lambda message: SAEError(f"{where}: {message}"), f"an SAE's {CFG_FILE}")
    if not isinstance(cfg, dict):
        raise SAEError(f"{where}: {CFG_FILE} must hold a JSON object")
    try:  # our reader: safetensors' own refuses a path that is not UTF-8
        weights = SafetensorsFile(weights_path).read_all()
    except (SafetensorsError, OSError) as e:
        raise SAEError(f"{where}: {e}") from None  # the reader's message names the file
    sae = SAE(SAEConfig.from_dict(cfg, where, HUB_MODEL_KWARGS.get(repo)), weights, where)
    input_scale = HUB_INPUT_SCALING.get(repo, {}).get(folder)
    if sae.cfg.normalize_activations == "expected_average_only_in":
        if input_scale is not None:
            return sae.fold_input_scale(input_scale)
        log.warning(
            "%s: trained on inputs scaled by a factor (normalize_activations: expected_average_only_in) that its "
            "files do not hold; its features are read from unscaled inputs, as SAELens' load_from_disk reads them "
            "(SAELens' release table gives the factor for gpt2-small-mlp-tm, whose SAEs loaded from the hub have "
            "it folded in)",
            where,
        )
    return sae


def _download(repo: str, folder: str, revision: str | None, where: str) -> SAE:
    """Fetch both files from the hub (cached; honours HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE)."""
    prefix = f"{folder}/" if folder else ""
    with hub_errors(
        SAEError,
        repo,
        revision,
        missing=lambda e: f"repository {repo!r} has no {prefix}{CFG_FILE} and {prefix}{WEIGHTS_FILE}",
        offline="give a local directory instead",
        where=f"{where}: ",
    ):
        cfg = download(repo, prefix + CFG_FILE, revision)
        download(repo, prefix + WEIGHTS_FILE, revision)
    return _from_dir(cfg.parent, where, repo, folder)


def load_saes(specs: Sequence[str], config: GPTConfig, device: torch.device | str = "cpu") -> dict[str, SAE]:
    """The SAEs named `ID=PATH` (a directory, or a hub repo and path), each checked against the model: its
    hook must be one of the model's, with one vector of d_in numbers per position."""
    saes: dict[str, SAE] = {}
    for spec in specs:
        sae_id, sep, source = spec.partition("=")
        if not sep or not sae_id or not source:
            raise SAEError(f"an SAE is given as ID=PATH (e.g. res8=./saes/blocks.8.hook_resid_pre), got {spec!r}")
        if sae_id in saes:
            raise SAEError(f"SAE id {sae_id!r} is given twice")
        sae = load_sae(source, device)
        hook = sae.cfg.hook_name
        if hook not in hook_names(config.n_layer):
            raise SAEError(f"SAE {sae_id!r} ({source}) reads {clip(hook)}, which this model does not have")
        if not reads_as_one_vector(hook):  # an attention square's site shape reads as [head]
            raise SAEError(
                f"SAE {sae_id!r} ({source}) reads {hook}, which holds no vector a position (an attention square, "
                "a per-head value other than attn.hook_z, or a LayerNorm's scale)"
            )
        site = site_shape(hook, config.n_head, config.d_head, config.d_mlp, config.vocab_size)
        if math.prod(site) != sae.cfg.d_in:
            heads = " (its heads read as one vector)" if len(site) > 1 else ""
            raise SAEError(
                f"SAE {sae_id!r} ({source}) reads vectors of {sae.cfg.d_in}, but {hook} holds {list(site)}{heads}"
            )
        saes[sae_id] = sae
    return saes


# --- what the server and the command line report ----------------------------------------------------


@dataclass(frozen=True)
class TokenFeatures:
    """One position's SAE reading: the top features (id, activation), or the asked-for ones, and how well
    the SAE reconstructs the input there."""

    features: list[tuple[int, float]]
    l0: int | None  # features active (> 0); None where the reading is not finite (no count is meaningful)
    mse: float  # mean over d_in of (x - x̂)²
    error_norm: float  # ‖x - x̂‖
    variance_explained: float | None  # 1 - ‖x - x̂‖² / ‖x - mean(x)‖² (None for a constant x)


def token_features(sae: SAE, x: torch.Tensor, top_k: int | None, ids: list[int] | None) -> list[TokenFeatures]:
    """Per position of `x` [T, *site] (the model's values at the SAE's hook; what `SAE.read` takes), its
    features: the `top_k` largest (positive ones only) or the values of feature `ids`."""
    x_in = sae.read(x)  # [T, d_in]
    f, x_hat = sae.reconstruct(x_in)  # [T, d_sae], [T, d_in]
    err = _norm(x_in - x_hat).tolist()  # [T]: ‖x - x̂‖
    spread = _norm(x_in - x_in.mean(-1, keepdim=True)).tolist()  # [T]
    finite = f.isfinite().all(-1).tolist()  # [T]: a NaN compares false, so it would count as inactive
    l0 = (f > 0).sum(-1).tolist()  # [T]
    if ids is not None:
        values, indices = f[:, ids].tolist(), [ids] * len(finite)  # NaN where the reading is
    else:
        assert top_k is not None
        top = f.topk(min(top_k, sae.cfg.d_sae), dim=-1)  # [T, k], read as Python lists once
        values, indices = top.values.tolist(), top.indices.tolist()
    out = []
    for t, ok in enumerate(finite):
        if ids is not None:
            chosen = list(zip(ids, values[t], strict=True))
        elif not ok:  # no order among NaNs: no top features, rather than a misleading few
            chosen = []
        else:
            chosen = [(i, v) for i, v in zip(indices[t], values[t], strict=True) if v > 0]
        norm, spread_t = err[t], spread[t]
        e, s = norm * norm, spread_t * spread_t  # in Python's float64: the squares of float32 norms are finite
        out.append(TokenFeatures(chosen, l0[t] if ok else None, e / sae.cfg.d_in, norm, 1 - e / s if s > 0 else None))
    return out


PART_WORK = 256 * 768 * 24_576  # positions x d_in x d_sae of one part: 256 positions of a res-jb SAE


def part_positions(sae: SAE) -> int:
    """Positions of a part of a reading (`FeatureReading`): as much work as 256 positions of
    res-jb's 24,576 features over d_in 768 (19 GFLOP, a fraction of a second on a 2-core CPU, and a [256,
    24576] float32 of features), fewer for a larger SAE."""
    return max(1, PART_WORK // (sae.cfg.d_in * sae.cfg.d_sae))


def _norm(v: torch.Tensor) -> torch.Tensor:
    """‖v‖ over the last dimension, [...], with the largest |entry| taken out first: summing the squares
    themselves overflows float32 from entries of about 1e19 (edits can drive a stream there)."""
    top = v.abs().amax(-1, keepdim=True)
    return top.squeeze(-1) * (v / top.clamp_min(torch.finfo(v.dtype).tiny)).norm(dim=-1)


class FeatureReading:
    """`token_features` of x [T, *site] a part at a time, `positions` positions a `step` (`part_positions`; the
    server runs each as an engine job, decode steps going on between them: at 1,024 tokens, res-jb's 24,576
    features are 77 GFLOP of encoding and decoding, most of a second of a 2-core CPU in one job). Each position's
    reading is its own, so the parts give the whole's, to the rounding of the SAE's products over fewer rows."""

    def __init__(self, sae: SAE, x: torch.Tensor, top_k: int | None, ids: list[int] | None) -> None:
        self.sae, self.x, self.top_k, self.ids = sae, x, top_k, ids
        self.positions = part_positions(sae)
        self.rows: list[TokenFeatures] = []

    @property
    def done(self) -> bool:
        return len(self.rows) == self.x.shape[0]

    def step(self, model: object) -> None:
        """Read the next part (`model`: unused; a step's signature, as the engine calls it)."""
        assert not self.done, "the reading is over"
        start = len(self.rows)
        self.rows += token_features(self.sae, self.x[start : start + self.positions], self.top_k, self.ids)
