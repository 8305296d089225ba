"""Steering: moving the residual stream along a direction, and the directions to move it along.

Activation addition adds `scale` * a direction at a hook point (Turner et al. 2023, "Activation Addition";
vllm-lens' `scale` and `norm_match`); the direction may be an SAE feature's decoder row (Templeton et al.
2024), or a contrastive mean difference of activations over two sets of prompts (Rimsky et al. 2024,
"Steering Llama 2 via Contrastive Activation Addition"; repeng). Neuronpedia's other two methods act on
the component along a unit direction û: `orthogonal` removes it, `projection_cap` caps it at a value.
`clamp` sets one SAE feature to a value and keeps the SAE's own error term, x + (decode(f') - decode(f)),
so that clamping a feature to its present value changes nothing.

Each function takes the selected values of one hook, [..., d], and returns their replacement; the
interventions (`model/interventions.py`) choose the layers and positions and call them.
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from ..hooks import CapturePass, as_vectors, check_hook_name, reads_as_one_vector
from ..json_file import clip
from .sae import SAE

if TYPE_CHECKING:
    from ..config import GPTConfig
    from ..gpt import GPT

STEERING_OPS = ("steer", "orthogonal", "projection_cap", "clamp")
Reduce = Literal["last", "mean"]


def steer(x: torch.Tensor, direction: torch.Tensor, scale: float, norm_match: bool) -> torch.Tensor:
    """x + scale · direction; with `norm_match`, each vector rescaled to its norm before the edit. Scale 0 is
    x itself, bit for bit (rescaled, x's norm over its norm would round its last bits)."""
    if scale == 0:
        return x
    if not norm_match:
        return x + scale * direction.to(x.dtype)
    return _norm_matched(x.float(), direction.float(), scale).to(x.dtype)


def _norm_matched(x: torch.Tensor, d: torch.Tensor, scale: float) -> torch.Tensor:
    """‖x‖ (x + s·d)/‖x + s·d‖ over the last dimension of x [..., C], in float32 at any magnitude: the sum is
    taken over k = max(|x|, |s|·|d|) (largest entries), k itself never formed where it is past float32's
    range, and each norm over a vector whose largest entry is 1 (a steered vector of norm 1e20 once came out
    0, its square past float32's range, and a float16 model's ‖x‖ can pass 65504)."""
    tiny = torch.finfo(torch.float32).tiny
    d_max = d.abs().amax()
    unit_d = d / d_max.clamp_min(tiny)  # largest entry 1 (or a zero direction)
    c = torch.where(d_max > 0, abs(scale) * d_max, 0.0)  # |s|·|d|, inf past float32: then it outweighs any x
    x_max = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    k = torch.maximum(x_max, c).clamp_min(tiny)
    past = c.isinf()
    x_part = torch.where(past, torch.zeros_like(x), x / k)
    d_part = torch.where(past, torch.ones_like(k), c / k)
    v = x_part + math.copysign(1.0, scale) * d_part * unit_d  # (x + s·d)/k, entries at most 2
    x_scaled = x / x_max.clamp_min(tiny)
    unit = v / v.norm(dim=-1, keepdim=True).clamp_min(tiny)  # x + s·d = 0 (d = -x/s): 0, and so the answer
    return unit * x_scaled.norm(dim=-1, keepdim=True) * x_max  # in this order: past float32 only if the answer is


def orthogonal(x: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """x - (x·û) û: the component along the direction removed."""
    u = _unit(direction, x.dtype)
    return x - (x @ u)[..., None] * u


def projection_cap(x: torch.Tensor, direction: torch.Tensor, cap: float) -> torch.Tensor:
    """x - max(0, x·û - cap) û: the component along the direction capped at `cap`."""
    u = _unit(direction, x.dtype)
    excess = ((x @ u) - cap).clamp_min(0)  # [...]
    return x - excess[..., None] * u


def clamp(x: torch.Tensor, sae: SAE, feature: int, value: float) -> torch.Tensor:
    """Feature `feature` of `sae` set to `value`: encode, set, decode, and add back the SAE's error term
    (x - x̂), which is x + decode(f') - decode(f). decode is linear in f (its bias and the un-normalisation's
    shift cancel), so that is x + (value - f_i) times the feature's decoder row, un-normalised: only the
    feature's own activation is needed (exactly x when it is `value` already). x: the values at the SAE's
    hook, [..., *site] (at `attn.hook_z`, [..., head, d_head], which the SAE reads as one vector). Where the
    un-normalisation scales by 0 (a `constant_norm_rescale` SAE at a vector of norm 0, whose reading is NaN),
    x as it is: the edit's limit as the vector shrinks (its change scales with the norm), not NaN."""
    x_in = sae.read(x)  # [..., d_in] float32
    norm = sae.norm_stats(x_in)
    change = value - sae.feature(x_in, feature)  # [...]
    row = sae.W_dec[feature]  # [d_in]
    if sae.cfg.rescale_acts_by_decoder_norm:  # decode divides f by each row's norm
        row = row / row.norm()
    delta = change[..., None] * row  # [..., d_in]
    if norm is not None:  # a 0 scale leaves x (the feature read NaN there: 0 x NaN is NaN, so chosen)
        delta = torch.where(norm.scale_out == 0, torch.zeros_like(delta), delta * norm.scale_out)
    return x + delta.reshape(x.shape).to(device=x.device, dtype=x.dtype)


def _unit(direction: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = direction.to(torch.float32)
    norm = d.norm()  # its squares overflow for entries of 1e20 and underflow for 1e-25: then a largest entry of 1
    d = torch.where((norm > 0) & norm.isfinite(), d, d / d.abs().max())  # (no sync with a GPU)
    return (d / d.norm()).to(dtype)


# --- directions the server keeps -------------------------------------------------------------------


class DirectionError(ValueError):
    """A direction that cannot be resolved: an unknown SAE, feature or vector name, or a bad vector.
    `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SteeringVector:
    hook: str  # where it was measured
    vector: torch.Tensor  # [d]
    n_positive: int
    n_negative: int


class SharedVectors(Protocol):
    """Where several servers keep their steering vectors together (the replicas of a Ray deployment:
    `server.ray_app`), so that a vector one of them stored is known to all."""

    async def store(self, name: str, vector: SteeringVector, max_vectors: int) -> str | None:
        """Keep `vector` under `name`; why not (the store is full), or None."""

    async def since(self, version: str) -> tuple[str, dict[str, SteeringVector] | None]:
        """The store's version (a token that names its contents: another store, or the same one restarted,
        never gives one it gave before), and its vectors in the order stored if that is not `version` (else
        None)."""


class StoredVectors:
    """The steering vectors several servers share, by name, in the order stored (`SharedVectors`' other side:
    a Ray deployment keeps one in a named actor, `server.ray_app.VectorStore`). Its versions are tokens of
    an epoch of its own and a count, so that a store made again (emptied) never gives a version a server
    holds for another content."""

    def __init__(self) -> None:
        self.vectors: dict[str, SteeringVector] = {}
        self.epoch, self.count = uuid.uuid4().hex, 0

    def store(self, name: str, vector: SteeringVector, max_vectors: int) -> str | None:
        """Keep `vector` under `name`; why not (the store is full), or None."""
        if name not in self.vectors and len(self.vectors) >= max_vectors:
            return full_store(list(self.vectors), max_vectors)
        self.vectors[name] = vector
        self.count += 1
        return None

    def since(self, version: str) -> tuple[str, dict[str, SteeringVector] | None]:
        now = f"{self.epoch}:{self.count}"
        return now, (None if version == now else dict(self.vectors))


def _none(hint: str) -> str:
    return f"none ({hint})" if hint else "none"


def full_store(names: list[str], max_vectors: int) -> str:
    """The refusal of a name beyond `max_vectors` stored ones."""
    return (
        f"{len(names)} steering vectors are stored already, the server's limit (--max-steering-vectors "
        f"{max_vectors}); reuse a name to replace one: {', '.join(names)}"
    )


class Directions:
    """The SAEs loaded at start-up (by id) and the steering vectors computed since (by name, at most
    `max_vectors`, in memory only): what a request's `{"sae", "feature"}` or `{"vector"}` names. With
    `shared`, the vectors are those of every server that shares it: `refresh` takes in what the others
    stored, `publish` stores for all. `load_hint` and `store_hint` say how the front end (the server, a
    command line) loads an SAE and stores a vector, in the error that finds none."""

    def __init__(
        self,
        saes: dict[str, SAE] | None = None,
        max_vectors: int = 64,
        shared: SharedVectors | None = None,
        *,
        load_hint: str = "",
        store_hint: str = "",
    ) -> None:
        self.saes = dict(saes or {})
        self.load_hint, self.store_hint = load_hint, store_hint
        self.max_vectors = max_vectors
        self.shared = shared
        self._vectors: OrderedDict[str, SteeringVector] = OrderedDict()
        self._version = ""  # of the shared store, when last taken in (none yet)

    def sae(self, sae_id: object, param: str) -> SAE:
        if not isinstance(sae_id, str) or sae_id not in self.saes:
            loaded = ", ".join(sorted(self.saes)) or _none(self.load_hint)
            raise DirectionError(f"unknown SAE {sae_id!r}; loaded SAEs: {loaded}", param)
        return self.saes[sae_id]

    def feature(self, sae_id: str, feature: object, param: str) -> tuple[SAE, int]:
        sae = self.sae(sae_id, param)
        if not isinstance(feature, int) or isinstance(feature, bool) or not 0 <= feature < sae.cfg.d_sae:
            last = sae.cfg.d_sae - 1
            raise DirectionError(f"feature {clip(feature)} of SAE {sae_id!r} is out of range 0..{last}", param)
        return sae, feature

    def vector(self, name: object, param: str) -> SteeringVector:
        if not isinstance(name, str) or name not in self._vectors:
            stored = ", ".join(self._vectors) or _none(self.store_hint)
            raise DirectionError(f"no stored steering vector {name!r}; stored: {stored}", param)
        return self._vectors[name]

    def store(self, name: str, vector: SteeringVector, param: str = "name") -> None:
        """Keep `vector` under `name` (replacing one of that name); refused beyond `max_vectors` names."""
        self.check_room(name, param)
        self._vectors[name] = vector

    def check_room(self, name: str, param: str = "name") -> None:
        """Raise the error `store` would raise for `name`, without storing anything."""
        if not name or len(name) > 128 or not name.isprintable():
            raise DirectionError(f"name must be 1..128 printable characters, got {name!r}", param)
        if name not in self._vectors and len(self._vectors) >= self.max_vectors:
            raise DirectionError(full_store(list(self._vectors), self.max_vectors), param)

    def names(self) -> list[str]:
        return list(self._vectors)

    async def refresh(self) -> None:
        """Take in the vectors the other servers sharing the store have stored (with no `shared`: none)."""
        if self.shared is not None:
            version, vectors = await self.shared.since(self._version)
            if vectors is not None:
                self._vectors, self._version = OrderedDict(vectors), version

    async def publish(self, name: str, vector: SteeringVector, param: str = "name") -> None:
        """`store`, for every server sharing the store; refused beyond `max_vectors` names there."""
        self.check_room(name, param)
        if self.shared is not None and (refusal := await self.shared.store(name, vector, self.max_vectors)):
            raise DirectionError(refusal, param)
        self.store(name, vector, param)


def contrastive_vector(
    model: GPT,
    positive: Sequence[Sequence[int]],
    negative: Sequence[Sequence[int]],
    hook: str,
    reduce: Reduce,
) -> SteeringVector:
    """mean over `positive` prompts - mean over `negative` prompts of the value at `hook` (a site of one vector
    a position, `reads_as_one_vector`), each prompt's taken at its last position or averaged over its
    positions (float32). Each side is a list of prompts, each a list of token ids."""
    if reduce not in ("last", "mean"):
        raise ValueError(f"reduce is 'last' or 'mean', got {reduce!r}")
    sides = []
    for name, side in (("positive", positive), ("negative", negative)):
        if isinstance(side, torch.Tensor) and side.dim() == 2:  # [prompts, pos] ids, as `generate` takes them
            side = side.tolist()
        if isinstance(side, (str, torch.Tensor)) or not side or not all(isinstance(p, (list, tuple)) for p in side):
            raise ValueError(f"{name} is a non-empty list of prompts, each a list of token ids; got {clip(side)}")
        sides.append(side)
    positive, negative = sides
    values = [[prompt_value(model, ids, hook, reduce) for ids in side] for side in (positive, negative)]
    return contrast(hook, values[0], values[1])


def prompt_value(model: GPT, ids: Sequence[int], hook: str, reduce: Reduce) -> torch.Tensor:
    """One prompt's value at `hook` (one vector a position) for a contrastive vector, [d] float32 on the CPU: at
    its last position, or averaged over its positions. A forward pass of its own, ended at the hook
    (`prompt_pass`, its pieces one after another; the server runs each piece as an engine job)."""
    run = prompt_pass(model.config, ids, hook)
    while not run.done:
        run.step(model)
    return prompt_reduced(run, hook, reduce)


def prompt_pass(config: GPTConfig, ids: Sequence[int], hook: str) -> CapturePass:
    """`prompt_value`'s pass over one prompt, ended at `hook`, not run yet."""
    check_hook_name(hook)  # one exact name: a glob names no one value to measure
    if not reads_as_one_vector(hook):
        raise ValueError(f"{hook} is not a hook with one vector per position: no steering vector to measure there")
    return CapturePass(config, list(ids), [hook])


def prompt_reduced(run: CapturePass, hook: str, reduce: Reduce) -> torch.Tensor:
    """The value `prompt_pass` took at `hook`, reduced as `prompt_value` gives it."""
    x = as_vectors(hook, run.tensors()[hook][0]).to(torch.float32)  # [T, d]: attn.hook_z's heads as one vector
    return (x[-1] if reduce == "last" else x.mean(0)).cpu()


def contrast(hook: str, positive: Sequence[torch.Tensor], negative: Sequence[torch.Tensor]) -> SteeringVector:
    """The steering vector of the prompts' values (`prompt_value`): mean of `positive` - mean of `negative`."""

    def mean_of(values: Sequence[torch.Tensor]) -> torch.Tensor:
        total = values[0]
        for v in values[1:]:  # in order, one at a time
            total = total + v
        return total / len(values)

    return SteeringVector(hook, mean_of(positive) - mean_of(negative), len(positive), len(negative))
