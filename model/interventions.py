"""Editing activations during a run: interventions at hook points, and residual ablation.

Both are `Hooks` (see `model/hooks.py`) passed with the forward call, so the network itself stays the
plain Pre-LN math and nothing is left registered on it. They hold per-sequence state (how many positions
each hook has seen, a mean, the sub-layer output to keep), so each sequence gets its own instance, which
sees only that sequence's part of a batched pass (`RowHooks`), its prompt in chunks or, with a `mean` edit,
whole (`whole_prompt`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from .config import GPTConfig
from .hooks import (
    SPLIT_INPUTS,
    Hooks,
    as_vectors,
    describe_hook_names,
    is_attention_square,
    is_hook_z,
    is_per_head,
    layer_of,
    match_hooks,
    needs_whole_prompt,
    reads_as_one_vector,
)
from .hooks import site_shape as _site_shape
from .json_file import is_int
from .lab import steering
from .lab.sae import SAE
from .lab.steering import STEERING_OPS

Op = Literal["zero", "mean", "scale", "add", "set", "steer", "orthogonal", "projection_cap", "clamp"]
OPS = ("zero", "mean", "scale", "add", "set", *STEERING_OPS)
# the fields of `Edit` each op reads, of those that only some ops read (hook and the places every op takes)
OP_READS: dict[str, tuple[str, ...]] = {
    "zero": (),
    "mean": (),
    "scale": ("factor",),
    "add": ("value",),
    "set": ("value",),
    "steer": ("factor", "direction", "norm_match"),
    "orthogonal": ("direction",),
    "projection_cap": ("direction", "factor"),
    "clamp": ("sae", "feature", "factor"),
}
FLOAT32_MAX = torch.finfo(torch.float32).max


class InterventionError(ValueError):
    """An edit that cannot be applied: unknown hook, wrong shape, head or position out of range, a factor
    or value that is not finite. `param` names the request field it came in (the server's 400 says it)."""

    def __init__(self, message: str, param: str = "interventions") -> None:
        super().__init__(message)
        self.param = param


class NonFiniteActivations(InterventionError):
    """The edits drove the activations to inf or NaN (a huge factor, say), so there is nothing to measure."""


@dataclass(frozen=True)
class Edit:
    """One change to the values at matching hook points.

    `zero`: set to 0. `mean`: replace by the mean over the prompt's positions. `scale`: multiply by
    `factor`. `add`: add `value` (broadcast over the selected positions). `set`: replace by `value`, either
    one position's worth (broadcast) or a whole sequence's, [pos, ...] (for instance from a dump: patching).
    `layers`, `heads` (for per-head hooks) and `positions` (query positions for attention squares)
    restrict where; None means everywhere, an empty `heads` or `positions` nowhere (the edit does nothing).
    On attention scores and patterns only `zero` and `scale` apply, and only to the keys a query may see:
    the causal mask stays as it was. `factor` and `value` must be finite in float32.

    Steering (`model/lab/steering.py`), on hooks with one vector per position (the residual stream,
    attn_out, mlp_out, ..., and attn.hook_z, its heads read as one: `reads_as_one_vector`): `steer` adds
    `factor` * `direction` (with `norm_match`, each vector keeps its norm); `orthogonal` removes the component
    along `direction`; `projection_cap` caps it at `factor`; `clamp` sets feature `feature` of `sae` (at its own
    hook) to `factor`, keeping the SAE's error term.
    """

    hook: str
    op: Op
    factor: float | None = None
    value: torch.Tensor | None = None
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    positions: tuple[int, ...] | None = None
    direction: torch.Tensor | None = None  # steer, orthogonal, projection_cap: [d]
    norm_match: bool = False  # steer
    sae: SAE | None = None  # clamp
    feature: int | None = None  # clamp
    origin: str | None = None  # where `direction` was measured (a stored vector's hook, an SAE's), if known

    def __post_init__(self) -> None:
        """A direction, an SAE or `norm_match` on an op that does not read it is refused, not ignored (an
        `orthogonal` edit given `norm_match` kept no norm); `value` and `direction` may be given as lists of
        numbers, `direction` as a `SteeringVector`, the places as lists."""
        reads = OP_READS.get(self.op)
        if reads is not None:  # an unknown op: `EditPlan` names it, with its place in the request
            given = [f for f in ("direction", "sae", "feature") if getattr(self, f) is not None]
            extra = [f for f in [*given, *(["norm_match"] if self.norm_match else [])] if f not in reads]
            if extra:
                takes = ", ".join(reads) or "none of them"
                raise InterventionError(f"{self.op} does not read {', '.join(extra)} (of op fields it takes {takes})")
        if isinstance(self.factor, bool):
            raise InterventionError(f"factor must be a number, got {self.factor!r}")
        if self.value is not None and not isinstance(self.value, torch.Tensor):
            object.__setattr__(self, "value", torch.tensor(self.value, dtype=torch.float32))
        if self.direction is not None and not isinstance(self.direction, torch.Tensor):
            if self.origin is None and isinstance(getattr(self.direction, "hook", None), str):
                object.__setattr__(self, "origin", self.direction.hook)  # a SteeringVector: measured there
            vector = getattr(self.direction, "vector", self.direction)  # a SteeringVector: its vector
            object.__setattr__(self, "direction", torch.as_tensor(vector, dtype=torch.float32))
        for name in ("layers", "heads", "positions"):
            places = getattr(self, name)
            if isinstance(places, list):
                object.__setattr__(self, name, tuple(places))
            elif places is not None and not isinstance(places, tuple):
                raise InterventionError(f"{name} must be a tuple of ints, got {places!r}")


def site_shape(name: str, config: GPTConfig) -> tuple[int, ...]:
    """The shape of one position's value at hook `name` (without batch and position)."""
    return _site_shape(name, config.n_head, config.d_head, config.d_mlp, config.vocab_size)


_LN1 = ("ln1.hook_scale", "ln1.hook_normalized")


def split_input_clashes(name: str) -> list[str]:
    """The hook points of `name`'s layer whose edits cannot go with an edit at `name`: for a per-head input
    (`hook_q_input`, ...), ln1's hooks, and the other way round (an edited per-head input is normalised on its
    own path, apart from ln1's hooks, which act on the stream itself); none for any other hook."""
    if not name.startswith("blocks."):
        return []
    layer, _, site = name.removeprefix("blocks.").partition(".")  # "L", site
    others = _LN1 if site in SPLIT_INPUTS else SPLIT_INPUTS if site in _LN1 else ()
    return [f"blocks.{layer}.{other}" for other in others]


def edit_sites(edit: Edit, n_layer: int, where: str = "edit") -> list[str]:
    """The hook points `edit` applies to: its hook's matches (a name or a glob), in its `layers`."""
    names = list(match_hooks(edit.hook, n_layer)) if isinstance(edit.hook, str) else []
    if not names:
        raise InterventionError(f"{where} matches no hook point; valid names are {describe_hook_names(n_layer)}")
    if edit.layers is not None:  # an empty list selects nothing, like empty heads or positions
        _check_range(edit.layers, n_layer, f"{where}: layer")
        names = [n for n in names if layer_of(n) in edit.layers]
        if edit.layers and not names:
            raise InterventionError(f"{where} has no hook point in layers {list(edit.layers)}")
    return names


def _where(i: int, edit: Edit, names: Sequence[str]) -> str:
    """How an error names the i-th edit: `names[i]` (a request's `interventions[i]`, a command line's
    `--steer N`), else `edit i`, then its hook."""
    return f"{names[i] if i < len(names) else f'edit {i}'} ({edit.hook!r})"


@dataclass(frozen=True, eq=False)
class _Target:
    """An edit resolved to one hook point."""

    edit: Edit
    name: str
    per_head: bool
    square: bool
    rows: int | None = None  # a `set` of a whole sequence's values, [pos, ...]: the positions they cover


class EditPlan:
    """`edits` resolved to the hook points of a model of shape `config`, and checked in all that does not
    depend on a sequence's length. The same for every sequence of a request: made once, not once a sequence
    (a thousand globbed edits over 256 prompts once took seconds of the server's event loop)."""

    def __init__(
        self, edits: Sequence[Edit], config: GPTConfig, names: Sequence[str] = (), sources: Sequence[int] = ()
    ) -> None:
        self.edits = tuple(edits)
        self.config = config
        self.names = tuple(names)  # each edit's name in an error (`_where`)
        self.sources = tuple(sources) or tuple(range(len(self.edits)))  # each edit's request edit (`EditSpec`)
        self.targets: dict[str, list[_Target]] = {}
        self._by_edit: list[list[_Target]] = []  # each edit's targets, edit by edit
        for i, edit in enumerate(self.edits):
            where = self.where(i)
            names = edit_sites(edit, config.n_layer, where)
            self._check_edit(edit, where)
            own = [self._resolved(_Target(edit, n, is_per_head(n), is_attention_square(n)), where) for n in names]
            for target in own:
                self.targets.setdefault(target.name, []).append(target)
            self._by_edit.append(own)
        self._check_split_inputs()
        # the sequence lengths every edit fits without a closer look: past each position named, and within
        # each whole sequence's values (a bad position list, or one past those values, always looks closer)
        self._shortest: float = 0
        self._longest: float = math.inf
        for edit, own in zip(self.edits, self._by_edit, strict=True):
            if edit.positions is not None:
                p = edit.positions
                valid = all(type(q) is int and q >= 0 for q in p) and len(set(p)) == len(p)
                self._shortest = max(self._shortest, 1 + max(p, default=-1) if valid else math.inf)
            for t in own:
                if t.rows is not None and edit.positions is None:  # a whole sequence's values: exactly its length
                    self._longest = min(self._longest, t.rows)
                    self._shortest = max(self._shortest, t.rows)
                elif t.rows is not None and t.rows < 1 + max(edit.positions or (), default=-1):
                    self._shortest = math.inf

    def check_length(self, n_tokens: int) -> None:
        """Refuse edits that do not fit a sequence of `n_tokens` positions: a position out of range or named
        twice, a whole sequence's values that do not reach the last position they are set at, or, set at every
        position, values of a longer sequence (its first rows would be set, out of line with whatever follows)."""
        if self._shortest <= n_tokens <= self._longest:
            return
        for i, (edit, own) in enumerate(zip(self.edits, self._by_edit, strict=True)):
            where = self.where(i)
            if edit.positions is not None:
                _check_range(edit.positions, n_tokens, f"{where}: position")
            need = 1 + max(edit.positions, default=-1) if edit.positions is not None else n_tokens
            for t in own:
                if t.rows is not None and t.rows < need:
                    raise InterventionError(f"{where}: value covers {t.rows} positions, position {need - 1} needed")
                if t.rows is not None and edit.positions is None and t.rows > n_tokens:
                    raise InterventionError(
                        f"{where}: value covers {t.rows} positions, more than the sequence's {n_tokens}: a whole "
                        "sequence's values are set position by position (give the positions to set, or values of "
                        "a sequence as long)"
                    )

    def where(self, i: int) -> str:
        """The i-th edit, as an error names it."""
        return _where(i, self.edits[i], self.names)

    def only_at(self, names: Collection[str]) -> int | None:
        """The first edit all of whose hook points are among `names` (a glob's every match, and those of the
        edits from the same request edit, `sources`: a glob's from a dump, an edit a hook), or None."""
        groups: dict[int, list[int]] = {}
        for i, source in enumerate(self.sources):
            groups.setdefault(source, []).append(i)
        for members in groups.values():
            own = [t for i in members for t in self._by_edit[i]]
            if own and all(t.name in names for t in own):
                return members[0]
        return None

    def _check_split_inputs(self) -> None:
        """An edited per-head input (`hook_q_input`, ...) is normalised by ln_1 on its own path, so an edit
        of ln_1's own hooks in the same layer would have no single stream to act on: refused."""
        for name in self.targets:
            if name.endswith(SPLIT_INPUTS):
                clash = [n for n in split_input_clashes(name) if n in self.targets]
                if clash:
                    raise InterventionError(
                        f"edits of {name} and {clash[0]} cannot be combined: an edited per-head input is "
                        "normalised on its own path, so ln1's hooks no longer see the stream it reads"
                    )

    def _check_edit(self, e: Edit, where: str) -> None:
        """What holds for an edit wherever it applies: checked once, however many hooks a glob matches."""
        if e.op not in OPS:
            raise InterventionError(f"{where}: unknown op {e.op!r}; use one of {', '.join(OPS)}")
        if e.op == "scale" and e.factor is None:
            raise InterventionError(f"{where}: scale needs a factor")
        if e.factor is not None and not abs(e.factor) <= FLOAT32_MAX:  # also false for NaN
            field = {"steer": "scale", "projection_cap": "value", "clamp": "value"}.get(e.op, "factor")  # as given
            raise InterventionError(f"{where}: {field} {e.factor!r} is not a finite float32 number")
        # flattened: torch reduces tensors of at most 64 dimensions, and a wrongly shaped one is told so, later
        if e.value is not None and not bool(e.value.reshape(-1).to(torch.float32).isfinite().all()):
            raise InterventionError(f"{where}: value holds numbers that are not finite in float32 (inf, NaN, > 3.4e38)")
        d = e.direction.reshape(-1).to(torch.float32) if e.direction is not None else None
        if e.op in STEERING_OPS and e.op != "clamp" and d is not None and d.numel():  # empty: a shape error, later
            if not bool(d.isfinite().all()):
                raise InterventionError(f"{where}: direction holds numbers that are not finite in float32")
            if e.op != "steer" and not float(d.abs().max()) > 0:
                raise InterventionError(f"{where}: {e.op} needs a direction that is not zero")

    def _resolved(self, t: _Target, where: str) -> _Target:
        """`t` checked in what depends on its hook point (after `_check_edit`), with the rows of a whole
        sequence's values if it sets them."""
        e = t.edit
        if e.heads is not None:
            if not (t.per_head or t.square):
                raise InterventionError(
                    f"{where}: heads apply only to per-head hooks (q, k, v, z, scores, pattern, and the optional "
                    "hook_attn_in, hook_q_input, hook_k_input, hook_v_input, attn.hook_result)"
                )
            _check_range(e.heads, self.config.n_head, f"{where}: head")
        if e.op in STEERING_OPS:
            self._check_steering(t, where)
            return t
        if e.op == "mean" and t.square:  # each query sees its own set of keys: no common mean to take
            raise InterventionError(
                f"{where}: mean is not supported on attention scores or patterns; use zero or scale"
            )
        if e.op in ("add", "set"):
            if e.value is None:
                raise InterventionError(f"{where}: {e.op} needs a value")
            if t.square:
                raise InterventionError(f"{where}: {e.op} is not supported on attention scores or patterns")
            site = self.selected_site(t)
            v = e.value
            if _broadcasts(tuple(v.shape), site):
                return t
            full = site_shape(t.name, self.config)
            if e.op == "set" and tuple(v.shape[1:]) == full:  # a whole sequence's values, [pos, ...]
                return replace(t, rows=v.shape[0])  # enough of them for a sequence: `check_length`
            raise InterventionError(
                f"{where}: value of shape {list(v.shape)} does not fit {t.name}: give {list(site)} (one "
                "position's selected values, broadcast to every selected position)"
                + (
                    f" or [pos, {', '.join(map(str, full))}] (a whole sequence's; a dump's batch dimension of 1 is"
                    " taken off first)"
                    if e.op == "set"
                    else ""
                )
            )
        return t

    def _check_steering(self, t: _Target, where: str) -> None:
        e = t.edit
        if not reads_as_one_vector(t.name):
            raise InterventionError(f"{where}: {e.op} applies to hooks with one vector per position (the residual "
                                    f"stream, attn_out, mlp_out, mlp.hook_post, ..., and attn.hook_z, its heads "
                                    f"read as one vector), not {t.name}")  # fmt: skip
        site = site_shape(t.name, self.config)
        if e.heads is not None:
            raise InterventionError(f"{where}: heads do not apply to {e.op}")
        if e.op != "orthogonal" and e.factor is None:
            raise InterventionError(f"{where}: {e.op} needs a {'scale' if e.op == 'steer' else 'value'}")
        if e.op == "clamp":
            if e.sae is None or e.feature is None:
                raise InterventionError(f"{where}: clamp needs an SAE and a feature")
            if t.name != e.sae.cfg.hook_name:
                raise InterventionError(
                    f"{where}: the SAE reads {e.sae.cfg.hook_name}, so clamp its feature there, not at {t.name}"
                )
            width = math.prod(site_shape(t.name, self.config))
            if e.sae.cfg.d_in != width:  # the server checks this at start-up; a Python caller gets it here
                raise InterventionError(f"{where}: the SAE reads vectors of {e.sae.cfg.d_in}, {t.name} holds {width}")
            if not is_int(e.feature) or not 0 <= e.feature < e.sae.cfg.d_sae:
                raise InterventionError(
                    f"{where}: feature {e.feature!r} is not one of the SAE's 0..{e.sae.cfg.d_sae - 1}"
                )
            return
        d = e.direction
        if d is None:
            raise InterventionError(f"{where}: {e.op} needs a direction")
        if e.origin is not None and e.origin != t.name and (is_hook_z(e.origin) or is_hook_z(t.name)):
            raise InterventionError(
                f"{where}: the direction was measured at {e.origin}, so it does not apply at {t.name}: a vector of "
                "attn.hook_z holds its layer's heads' values before that layer's output projection, in coordinates "
                "of its own (the residual stream's are shared by every layer)"
            )
        flat = (math.prod(site),)  # attn.hook_z: its heads as one vector, or [head, d_head] as it holds them
        if tuple(d.shape) not in (flat, site):
            shapes = f"{list(flat)}" + (f" (in Python also {list(site)})" if site != flat else "")
            raise InterventionError(f"{where}: direction of shape {list(d.shape)} does not fit {t.name}: give {shapes}")

    def selected_site(self, t: _Target) -> tuple[int, ...]:
        site = site_shape(t.name, self.config)
        if t.per_head and t.edit.heads is not None:
            return (len(t.edit.heads), site[1])
        return site


def takes_whole_prompt(edits: Sequence[Edit]) -> bool:
    """Whether an edit takes in the whole prompt at once: a `mean`, over its positions (through it, a later
    position reaches the earlier ones)."""
    return any(e.op == "mean" for e in edits)


class Interventions:
    """Applies `edits` to one sequence of `n_tokens` positions at most (prompt plus new tokens). `plan`:
    the edits resolved already (`EditPlan(edits, config)`), shared by the sequences of a request."""

    def __init__(self, edits: Sequence[Edit], config: GPTConfig, n_tokens: int, plan: EditPlan | None = None) -> None:
        self.plan = plan if plan is not None else EditPlan(edits, config)
        self.plan.check_length(n_tokens)
        self.n_tokens = n_tokens
        self._seen: dict[str, int] = {}  # positions each hook has seen so far
        self._means: dict[_Target, torch.Tensor] = {}  # a `mean` edit's mean over the prompt
        # a `mean` edit takes its mean over the first pass, which must be the whole prompt; the others edit each
        # pass's positions as they come (`_seen` counts them)
        self.whole_prompt = takes_whole_prompt(self.plan.edits)

    def active(self, name: str) -> bool:
        return name in self.plan.targets

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        targets = self.plan.targets.get(name)
        if not targets:
            return x
        x = x.clone()
        start = self._seen.get(name, 0)
        if not targets[0].square:  # [B, pos, ...]: this pass's positions follow those seen before
            self._seen[name] = start + x.shape[1]
        end = x.shape[3] if targets[0].square else start + x.shape[1]  # positions up to this pass's last
        if end > self.n_tokens:  # reused for a second sequence, or made for a shorter one: its state is wrong
            raise InterventionError(
                f"these edits' hooks were made for one sequence of at most {self.n_tokens} positions "
                f"(EditSpec.hooks(config, n_tokens)), and {name} reaches {end}: make fresh hooks for each sequence, "
                "with its length (they keep state: the positions seen, a mean over the prompt)"
            )
        for t in targets:
            self._apply(t, x, start)
        return x

    def _apply(self, t: _Target, x: torch.Tensor, seen: int) -> None:
        """Edit `x` in place where `t` selects; `seen`: the positions its hook saw before this pass."""
        e = t.edit
        if t.square:  # [B, head, q, k]: the queries are the last q of the k positions
            start, n = x.shape[3] - x.shape[2], x.shape[2]
            pos_dim, head_dim = 2, 1
        else:  # [B, pos, ...]
            start, n = seen, x.shape[1]
            pos_dim, head_dim = 1, 2
        wanted = e.positions if e.positions is not None else range(start, start + n)
        here = [p - start for p in wanted if start <= p < start + n]  # this pass's share, relative
        if not here or (e.heads is not None and not e.heads):  # nothing selected in this pass
            return
        pos = torch.tensor(here, device=x.device)
        heads = torch.tensor(e.heads, device=x.device) if e.heads is not None else None

        def select(dim_pos: torch.Tensor) -> tuple[slice | torch.Tensor, ...]:
            index: list[slice | torch.Tensor] = [slice(None)] * x.dim()
            if heads is None:
                index[pos_dim] = dim_pos
            elif pos_dim < head_dim:  # positions [P, 1] and heads [1, H] broadcast to the block of both
                index[pos_dim], index[head_dim] = dim_pos[:, None], heads[None, :]
            else:
                index[head_dim], index[pos_dim] = heads[:, None], dim_pos[None, :]
            return tuple(index)

        index = select(pos)
        region = x[index]
        if e.op == "zero":
            new = torch.zeros_like(region)
        elif e.op == "scale":
            new = region * float(e.factor or 0.0)
        elif e.op in STEERING_OPS:
            new = _steered(e, t.name, region)
        elif e.op == "mean":
            if t not in self._means:  # the first pass is the prompt's: its mean over positions is kept
                self._means[t] = x.mean(dim=pos_dim, keepdim=True)
            new = self._means[t].expand_as(x)[index]
        else:
            assert e.value is not None
            value = e.value.to(device=x.device, dtype=x.dtype)
            if _broadcasts(tuple(value.shape), self.plan.selected_site(t)):
                value = value.expand_as(region)
            else:  # a whole sequence's values [pos, ...]: pick this pass's positions and the heads, as from x
                value = value[None][select(pos + start)]
            new = value if e.op == "set" else region + value
        if t.square:  # a query's future keys stay masked (-inf scores, 0 pattern): the edit stays causal
            allowed = torch.arange(x.shape[3], device=x.device) <= (pos + start)[:, None]  # [P, k]
            new = torch.where(allowed, new, region)
        x[index] = new


def _steered(e: Edit, name: str, x: torch.Tensor) -> torch.Tensor:
    """A steering op on the values x [..., *site] at hook `name`, each position's read as one vector."""
    if e.op == "clamp":  # the SAE reads the values at its hook as it was trained to
        assert e.sae is not None and e.feature is not None and e.factor is not None
        return steering.clamp(x, e.sae, e.feature, e.factor)
    assert e.direction is not None
    v = as_vectors(name, x)  # [..., d]: attn.hook_z's heads as one vector
    direction = e.direction.to(x.device).reshape(v.shape[-1])
    if e.op == "steer":
        new = steering.steer(v, direction, float(e.factor or 0.0), e.norm_match)
    elif e.op == "orthogonal":
        new = steering.orthogonal(v, direction)
    else:
        new = steering.projection_cap(v, direction, float(e.factor or 0.0))
    return new.reshape(x.shape)


class ResidualAblation:
    """Runs the chosen sub-layers without their skip connection: `x -> sublayer(ln(x))` in place of
    `x + sublayer(ln(x))`. It keeps each ablated sub-layer's output (`hook_attn_out`, `hook_mlp_out`)
    and hands it on as the residual stream (`hook_resid_mid`, `hook_resid_post`): exact, no subtraction.
    `edits` (interventions) run in between, so that they see and change the stream as ablated: an edit of
    `hook_attn_out` is carried on, an edit of `hook_resid_mid` applies to what replaced it."""

    def __init__(self, attn: Sequence[int], mlp: Sequence[int], n_layer: int, edits: Hooks | None = None) -> None:
        _check_range(attn, n_layer, "residual.attn: layer", "residual", distinct=False)  # a set: repeats are free
        _check_range(mlp, n_layer, "residual.mlp: layer", "residual", distinct=False)
        self._replace: dict[str, str] = {}  # resid hook -> the sub-layer output that replaces it
        for layer in attn:
            self._replace[f"blocks.{layer}.hook_resid_mid"] = f"blocks.{layer}.hook_attn_out"
        for layer in mlp:
            self._replace[f"blocks.{layer}.hook_resid_post"] = f"blocks.{layer}.hook_mlp_out"
        self._sources = set(self._replace.values())
        self._kept: dict[str, torch.Tensor] = {}
        self.edits = edits

    @property
    def inner(self) -> tuple[Hooks, ...]:  # `begin_pass` reaches a capture among the edits
        return (self.edits,) if self.edits is not None else ()

    @property
    def whole_prompt(self) -> bool:
        return self.edits is not None and needs_whole_prompt(self.edits)

    def active(self, name: str) -> bool:
        return name in self._replace or name in self._sources or (self.edits is not None and self.edits.active(name))

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self._replace:
            x = self._kept.pop(self._replace[name])
        if self.edits is not None:
            x = self.edits(name, x)
        if name in self._sources:
            self._kept[name] = x
        return x


class HookChain:
    """Several `Hooks` in order: each sees the value the previous one returned."""

    def __init__(self, *hooks: Hooks) -> None:
        self.hooks = hooks

    @property
    def inner(self) -> tuple[Hooks, ...]:  # `begin_pass` reaches a capture among them
        return self.hooks

    @property
    def whole_prompt(self) -> bool:
        return any(needs_whole_prompt(h) for h in self.hooks)

    def active(self, name: str) -> bool:
        return any(h.active(name) for h in self.hooks)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        for h in self.hooks:
            x = h(name, x)
        return x


def _check_range(values: Sequence[int], n: int, what: str, param: str = "interventions", distinct: bool = True) -> None:
    """Each of `values` an int in 0..n-1, and, if `distinct`, none twice: so an edit's list holds n of them
    at most (a position named 5,000 times would select, and copy, its values 5,000 times)."""
    seen: set[int] = set()
    for v in values:
        if not is_int(v):  # a numpy or torch integer too: said, not "out of range"
            raise InterventionError(f"{what} {v!r} is not an int (convert numpy or torch values with int())", param)
        if not 0 <= v < n:
            raise InterventionError(f"{what} {v!r} is out of range 0..{n - 1}", param)
        if distinct and v in seen:
            raise InterventionError(f"{what} {v} is named twice", param)
        seen.add(v)


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


@dataclass(frozen=True)
class EditSpec:
    """What to change in a run: interventions, and sub-layers to run without their skip connection.
    It makes fresh per-sequence `Hooks` with `hooks`, since those keep state."""

    edits: tuple[Edit, ...] = ()
    ablate_attn: tuple[int, ...] = ()  # layers whose attention runs without its residual add
    ablate_mlp: tuple[int, ...] = ()  # layers whose MLP runs without its residual add
    names: tuple[str, ...] = field(default=(), compare=False)  # each edit's name in an error (`_where`)
    # each edit's place among the edits a request asked for (a glob's from a dump are one, an edit a hook)
    sources: tuple[int, ...] = field(default=(), compare=False)
    _plans: dict[GPTConfig, EditPlan] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # a bare layer number, 0 above all, read as a tuple would ablate nothing (0 is false) without a word
        for name in ("ablate_attn", "ablate_mlp"):
            layers = getattr(self, name)
            numbers = isinstance(layers, (tuple, list)) and all(is_int(n) for n in layers)
            if not numbers:
                raise InterventionError(
                    f"{name} must be a tuple of layer numbers, e.g. (0, 3) (every layer: tuple(range(n_layer))), "
                    f"got {layers!r}"
                )
            object.__setattr__(self, name, tuple(layers))  # a list given: a tuple, as a frozen spec hashes
        if not isinstance(self.edits, (tuple, list)) or not all(isinstance(e, Edit) for e in self.edits):
            raise InterventionError(f"edits must be a tuple of Edit, got {self.edits!r}")
        object.__setattr__(self, "edits", tuple(self.edits))

    def sites(self, n_layer: int) -> list[str]:
        """The hook point of each (edit, hook point) pair, edit by edit (a glob gives one for each hook it
        matches). Each pair costs work on every forward pass, so a server bounds how many."""
        return [n for i, e in enumerate(self.edits) for n in edit_sites(e, n_layer, _where(i, e, self.names))]

    def plan(self, config: GPTConfig) -> EditPlan:
        """The edits resolved to the hook points of a model of shape `config` and checked: made on the first
        call, kept for the sequences after it (a server makes it on a worker thread, before any sequence)."""
        plan = self._plans.get(config)
        if plan is None:
            plan = self._plans.setdefault(config, EditPlan(self.edits, config, self.names, self.sources))
        return plan

    def hooks(self, config: GPTConfig, n_tokens: int, then: Hooks | None = None) -> Hooks | None:
        """Fresh `Hooks` for one sequence. `then` (a gradient capture, say) sees each value after the
        interventions and inside the ablation, so that what it sees is the value the run carries on."""
        interventions = Interventions(self.edits, config, n_tokens, self.plan(config)) if self.edits else None
        inner = HookChain(interventions, then) if interventions and then else interventions or then
        if self.ablate_attn or self.ablate_mlp:
            return ResidualAblation(self.ablate_attn, self.ablate_mlp, config.n_layer, inner)
        return inner
