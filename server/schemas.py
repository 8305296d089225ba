"""Request bodies. Each schema checks types strictly (a string is not a number) and converts itself into
the engine's plain parameter objects; the values themselves are checked by `SamplingParams`."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any, Literal

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from model.generate import SEED_RANGE, ContextLengthError, GenerationError, SamplingParams, logit_bias_by_id
from model.hooks import UnknownHookError, is_glob, select_hooks
from model.interventions import OP_READS, Edit, EditSpec, InterventionError, edit_sites
from model.json_file import clip
from model.lab.attribution import MAX_VERIFY
from model.lab.gradients import LogitDiff, LogProb, Loss, Metric
from model.lab.steering import STEERING_OPS, DirectionError, Directions
from model.tokenizer import EOT_ID, InvalidTextError, Tokenizer, check_unicode

PromptText = str | list[str]
PromptIds = list[int] | list[list[int]]
# OpenAI's `prompt`: a string, a list of strings, a list of token ids, or a list of lists of token ids.
OpenAIPrompt = str | list[str] | list[int] | list[list[int]]

# Lists the server expands before any model work: bounded, so that none holds the event loop long.
MAX_HOOKS = 2048  # hook names or globs in one list: more than gpt2-xl's 1111 hook points, each named
MAX_INTERVENTIONS = 1024  # edits in one request
MAX_EDIT_SITES = 4096  # (edit, hook point) pairs, a glob counted once per hook it matches: work on every pass
MAX_N = 128  # choices per prompt in /v1/completions, as OpenAI bounds `n` (prompts x n: also Engine.most_sequences)
# clamps of topk SAEs in one request: each encodes every position with its whole SAE (whether a feature is
# among the k largest depends on all of them), at d_sae 32768 on gpt2-small a fifth of a forward pass more
MAX_TOPK_CLAMPS = 8


def _short_hook(name: str) -> str:
    if len(name) > 256:  # (a length constraint in the type would refuse lone surrogates less clearly)
        raise ValueError(f"a hook name or glob of {len(name)} characters: at most 256")
    return name


HookName = Annotated[str, AfterValidator(_short_hook)]  # a name or glob (the longest real name has 31 characters)


class Strict(BaseModel):
    """A request's object: its types as sent (a string is not a number), no field it does not have, and null
    for a field with a default taken as that default (as OpenAI's API takes it; a client that writes None
    for "not set" works)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, body: Any) -> Any:
        if not isinstance(body, dict) or None not in body.values():
            return body
        fields = cls.model_fields
        return {k: v for k, v in body.items() if v is not None or k not in fields or fields[k].is_required()}


class ActivationSpec(Strict):
    hooks: list[HookName] = Field(
        min_length=1, max_length=MAX_HOOKS, description="hook names or glob patterns, e.g. blocks.*.hook_resid_post"
    )
    format: Literal["json", "safetensors_base64"] = "json"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class DumpValue(Strict):
    """A tensor taken from an activation dump the client sends (what /v1/activations returned)."""

    safetensors_base64: str
    name: str | None = Field(default=None, description="tensor name in the dump (default: the edit's hook)")


class FeatureDirection(Strict):
    """An SAE feature's decoder row: the direction the feature writes."""

    sae: str = Field(description="an SAE id the server loaded (GET /v1/model lists them)")
    feature: int


class NamedVector(Strict):
    """A steering vector the server computed and stored (POST /v1/steering-vectors with a name)."""

    vector: str


# The fields each op reads, of the op-specific ones (besides hook, layers, heads and positions, which every op
# takes); any other given is a 400, not ignored. `Edit`'s own table (`OP_READS`), as this API names the fields:
# its `factor` is a steer's `scale` and a projection cap's or clamp's `value`.
_OP_SPECIFIC = ("factor", "value", "scale", "direction", "norm_match", "sae", "feature")
_NAMED_HERE = {("steer", "factor"): "scale", ("projection_cap", "factor"): "value", ("clamp", "factor"): "value"}
_OP_FIELDS: dict[str, tuple[str, ...]] = {
    op: tuple(_NAMED_HERE.get((op, f), f) for f in reads) for op, reads in OP_READS.items()
}


class InterventionSpec(Strict):
    hook: HookName = Field(description="hook name or glob, e.g. blocks.3.hook_attn_out or blocks.*.attn.hook_z")
    op: Literal["zero", "mean", "scale", "add", "set", "steer", "orthogonal", "projection_cap", "clamp"]
    factor: float | None = Field(default=None, description="for scale")
    value: float | list[Any] | DumpValue | None = Field(
        default=None, description="for add and set; projection_cap's cap; clamp's feature value"
    )
    layers: list[int] | None = None
    heads: list[int] | None = None
    positions: list[int] | None = None
    # steering (model/lab/steering.py): one `direction`, spelled as numbers, an SAE feature or a stored vector
    scale: float | None = Field(default=None, description="for steer: the multiple of direction added")
    direction: list[float] | FeatureDirection | NamedVector | None = Field(
        default=None, description="for steer, orthogonal, projection_cap"
    )
    norm_match: bool = Field(default=False, description="steer: keep each vector's norm")
    sae: str | None = Field(default=None, description="for clamp: the SAE id")
    feature: int | None = Field(default=None, description="for clamp: the feature of that SAE")

    def edits(
        self,
        n_layer: int,
        directions: Directions | None = None,
        where: str = "interventions",
        dumps: Dumps | None = None,
    ) -> list[Edit]:
        """The edits this spec asks for: one, but for an `add` or `set` whose hook is a glob and whose value is
        a dump with no tensor `name`, which is an edit for each hook the glob matches (in its `layers`), each
        taking the dump's tensor of that hook's name: a dump of several layers patches them all at once.
        `dumps`: the request's, whose tensors are counted across its edits."""
        dump, dumps = self.value, dumps or Dumps()
        if not (self.op in ("add", "set") and isinstance(dump, DumpValue) and not dump.name and is_glob(self.hook)):
            return [self.edit(directions, where, dumps)]
        self._check_fields(where)
        tensors = dumps.read(dump, self.hook, where)
        placed = Edit(self.hook, self.op, None, None, _tuple(self.layers), _tuple(self.heads), _tuple(self.positions))
        named = f"{where} ({self.hook!r})"
        sites = edit_sites(placed, n_layer, named)
        if not sites:  # `layers: []`: nowhere, but its positions and heads checked as any edit's
            return [placed]
        return [replace(placed, hook=s, value=_dump_tensor(tensors, s, s, named, per_hook=True)) for s in sites]

    def edit(
        self, directions: Directions | None = None, where: str = "interventions", dumps: Dumps | None = None
    ) -> Edit:
        self._check_fields(where)
        if self.op in STEERING_OPS:
            return self._steering_edit(directions or Directions(), where)
        value = None
        if isinstance(self.value, DumpValue):
            name = self.value.name or self.hook
            value = _dump_tensor((dumps or Dumps()).read(self.value, self.hook, where), name, self.hook, where)
        elif self.value is not None:
            try:
                value = torch.tensor(self.value, dtype=torch.float32)
            except OverflowError:  # an integer beyond float64 (one beyond float32 becomes inf, refused later)
                raise InterventionError(
                    f"{where}: value for {self.hook!r} holds a number not finite in float32"
                ) from None
            except (TypeError, ValueError) as e:
                raise InterventionError(
                    f"{where}: value for {self.hook!r} is not a rectangular array of numbers: {e}"
                ) from None
            if isinstance(self.value, list) and _holds_bool(self.value):  # torch reads true as 1.0
                raise InterventionError(f"{where}: value for {self.hook!r} holds true or false: give numbers")
        return Edit(
            self.hook,
            self.op,
            self.factor,
            value,
            _tuple(self.layers),
            _tuple(self.heads),
            _tuple(self.positions),
        )

    def _check_fields(self, where: str) -> None:
        """A field the op does not read is refused, not ignored."""
        given = [f for f in _OP_SPECIFIC if getattr(self, f) is not None and getattr(self, f) is not False]
        stray = [f for f in given if f not in _OP_FIELDS[self.op]]
        if stray:
            takes = ", ".join(_OP_FIELDS[self.op]) or "none of them"
            raise InterventionError(
                f"{where}.{stray[0]} does not apply to {self.op} (of {', '.join(_OP_SPECIFIC)} it takes {takes})",
                "interventions",
            )

    def _steering_edit(self, directions: Directions, where: str) -> Edit:
        """A steer, orthogonal, projection_cap or clamp edit, its direction resolved (`DirectionError`s
        become 400s naming the field)."""
        try:
            return self._resolved(directions, where)
        except DirectionError as e:  # named as the request names it: interventions[2].direction, --steer 3.direction
            message = str(e) if str(e).startswith(where) else f"{e.param}: {e}"
            raise InterventionError(message, "interventions") from None

    def _resolved(self, directions: Directions, where: str) -> Edit:
        number = None
        if self.op == "steer":
            if self.scale is None or not math.isfinite(self.scale):
                raise DirectionError(f"{where}.scale must be a finite number, got {self.scale!r}", "interventions")
            number = self.scale
        elif self.op in ("projection_cap", "clamp"):
            v = self.value
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise DirectionError(f"{where}.value must be a finite number for {self.op}, got {v!r}", "interventions")
            number = float(v)
        sae, feature, direction, origin = None, None, None, None
        if self.op == "clamp":
            if self.sae is None or self.feature is None:
                raise DirectionError(f"{where}: clamp needs sae and feature", "interventions")
            sae, feature = directions.feature(self.sae, self.feature, f"{where}.feature")
        elif isinstance(self.direction, FeatureDirection):
            found, n = directions.feature(self.direction.sae, self.direction.feature, f"{where}.direction")
            direction, origin = found.direction(n).cpu(), found.cfg.hook_name
        elif isinstance(self.direction, NamedVector):
            stored = directions.vector(self.direction.vector, f"{where}.direction")
            direction, origin = stored.vector, stored.hook
        elif self.direction is not None:
            if not all(math.isfinite(v) for v in self.direction):
                raise DirectionError(f"{where}.direction holds numbers that are not finite", "interventions")
            direction = torch.tensor(self.direction, dtype=torch.float32)
        else:
            raise DirectionError(f"{where}: {self.op} needs a direction", "interventions")
        where_ = (_tuple(self.layers), _tuple(self.heads), _tuple(self.positions))
        return Edit(self.hook, self.op, number, None, *where_, direction=direction, norm_match=self.norm_match,
                    sae=sae, feature=feature, origin=origin)  # fmt: skip


class ResidualSpec(Strict):
    """Sub-layers to run without their skip connection: layer lists, or "all"."""

    attn: list[int] | Literal["all"] = Field(default_factory=list)
    mlp: list[int] | Literal["all"] = Field(default_factory=list)


class Edits(Strict):
    """Interventions and residual ablation, accepted by /v1/generate, /v1/activations, /v1/next-token."""

    interventions: list[InterventionSpec] | None = Field(default=None, max_length=MAX_INTERVENTIONS)
    residual: ResidualSpec | None = None

    def names_a_vector(self) -> bool:
        """Whether an edit's direction names a stored steering vector (`{"vector": name}`)."""
        return any(isinstance(i.direction, NamedVector) for i in self.interventions or [])

    def edit_spec(self, n_layer: int, directions: Directions | None = None) -> EditSpec | None:
        """`directions`: the SAEs and stored vectors a steering edit's direction may name."""
        if not self.interventions and self.residual is None:
            return None
        return edit_spec(self.interventions or [], self.residual, n_layer, directions)


def edit_spec(
    interventions: list[InterventionSpec],
    residual: ResidualSpec | None,
    n_layer: int,
    directions: Directions | None = None,
    where: Callable[[int], str] = lambda i: f"interventions[{i}]",
) -> EditSpec:
    """The edits a request's `interventions` and `residual` ask for; `where(i)` names the i-th edit in an
    error (a command line's `--steer` names them as its own)."""

    def layers(spec: list[int] | Literal["all"]) -> tuple[int, ...]:
        # a set of layers: a repeat is dropped here, once, so the list the model checks on every sequence of
        # the request is n_layer long at most (a million repeats in a body once cost seconds of event loop)
        return tuple(range(n_layer)) if spec == "all" else tuple(dict.fromkeys(spec))

    dumps = Dumps()
    edits = [(e, i) for i, spec in enumerate(interventions) for e in spec.edits(n_layer, directions, where(i), dumps)]
    spec = EditSpec(
        tuple(e for e, _ in edits),
        layers(residual.attn) if residual else (),
        layers(residual.mlp) if residual else (),
        tuple(where(i) for _, i in edits),  # a glob's edits from a dump, one a hook, each named as the spec
        tuple(i for _, i in edits),
    )
    topk = sum(e.op == "clamp" and e.sae is not None and e.sae.cfg.architecture == "topk" for e in spec.edits)
    if topk > MAX_TOPK_CLAMPS:
        raise InterventionError(
            f"the interventions clamp {topk} features of topk SAEs; at most {MAX_TOPK_CLAMPS}: each encodes every "
            "position with its whole SAE (whether a feature is among the k largest depends on all of them)"
        )
    sites = len(spec.sites(n_layer))
    if sites > MAX_EDIT_SITES:
        raise InterventionError(
            f"the interventions apply at {sites} (edit, hook point) pairs, a glob counted once per hook it "
            f"matches; at most {MAX_EDIT_SITES} (each costs work on every forward pass): narrow the globs or "
            "their layers"
        )
    return spec


def _holds_bool(values: list[Any]) -> bool:
    """Whether a nested list of numbers (one torch could read: a few dimensions deep) holds a boolean."""
    types = set(map(type, values))
    return bool in types or (list in types and any(_holds_bool(v) for v in values if type(v) is list))


def _tuple(values: list[int] | None) -> tuple[int, ...] | None:
    return tuple(values) if values is not None else None


SHOWN_TENSORS = 8  # of a dump's tensor names, in a message (a dump of every hook of gpt2-xl has 1,111)
MAX_DUMP_TENSORS = MAX_HOOKS  # in a dump sent as an edit's value


class Dumps:
    """The dumps a request's edits take their values from, each read once however many hooks take theirs from
    it, with at most `MAX_DUMP_TENSORS` tensors among them all, counted in each header before any is made
    (40,000 empty ones in a 3 MB body took 0.2-0.3 s of the GIL to make, every stream waiting)."""

    def __init__(self) -> None:
        self.left = MAX_DUMP_TENSORS

    def read(self, dump: DumpValue, hook: str, where: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        not_a_dump = InterventionError(f"{where}: value for {hook!r}: the dump is not base64 of a safetensors file")
        text = "".join(dump.safetensors_base64.split())  # base64 as `base64` writes it: lines of 76 characters
        try:
            data = base64.b64decode(text, validate=True)
            header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        except (ValueError, RecursionError):  # binascii.Error, a JSONDecodeError, not UTF-8, nested too deeply
            raise not_a_dump from None
        count = len(header) - ("__metadata__" in header) if isinstance(header, dict) else 0
        if count > self.left:
            before = MAX_DUMP_TENSORS - self.left
            also = f", and the interventions' dumps before it {before}" if before else ""
            raise InterventionError(
                f"{where}: value for {hook!r}: the dump holds {count} tensors{also}; at most {MAX_DUMP_TENSORS} in "
                "all (a dump of every hook point of gpt2-xl has 1,111)"
            )
        self.left -= count
        try:
            return load(data)
        except Exception:
            raise not_a_dump from None


def _dump_tensor(
    tensors: dict[str, torch.Tensor], name: str, hook: str, where: str, per_hook: bool = False
) -> torch.Tensor:
    """Tensor `name` of a dump as the value of an edit at `hook`, in float32, its batch dimension of 1 off
    (`per_hook`: one of the edits a glob's dump value makes, a hook each)."""
    if name not in tensors:
        have = sorted(tensors)
        more = f" and {len(have) - SHOWN_TENSORS} more" if len(have) > SHOWN_TENSORS else ""
        listed = ", ".join(have[:SHOWN_TENSORS]) + more
        why = f"the dump has no tensor {name!r} (it has {listed or 'none'})"
        if per_hook:
            why += (
                "; a glob's edit from a dump takes each hook's own tensor: narrow the glob or its layers, or give "
                "the dump's tensor for them all as name"
            )
        raise InterventionError(f"{where}: value for {hook!r}: {why}")
    t = tensors[name]
    if not t.is_floating_point():  # a dump holds activations: booleans or integers are no activation's values
        raise InterventionError(
            f"{where}: value for {hook!r}: tensor {name!r} of the dump is {str(t.dtype).removeprefix('torch.')}, "
            "not floating point (float32, float16 or bfloat16, as /v1/activations dumps them)"
        )
    t = t.float()
    return t[0] if t.dim() > 1 and t.shape[0] == 1 else t  # a dump's batch dimension of 1


class FeatureCapture(Strict):
    """An SAE's features at every position (prompt and generated), like a capture: per token the `top_k`
    largest, or the values of `features`."""

    sae: str = Field(description="an SAE id the server loaded (GET /v1/model lists them)")
    top_k: int | None = Field(
        default=None, description="features per token, the largest (active ones only); null: 10, at most the SAE's size"
    )
    features: list[int] | None = Field(default=None, description="these features' values instead of the top k")

    def selection(self, d_sae: int, where: str = "") -> tuple[int | None, list[int] | None]:
        """(top_k, feature ids): one of them, checked against the SAE's size (errors name `where` + field)."""
        if self.features is not None:
            if self.top_k is not None:  # one or the other, never one silently dropped
                raise GenerationError(
                    f"{where}top_k and {where}features exclude each other: features reads the ids it lists, "
                    "top_k the largest; give one",
                    f"{where}top_k",
                )
            if not 1 <= len(self.features) <= 1024:
                raise GenerationError(
                    f"{where}features must list 1..1024 ids, got {len(self.features)}", f"{where}features"
                )
            seen: set[int] = set()
            for f in self.features:
                if not 0 <= f < d_sae:
                    message = f"{where}features: {clip(f)} is out of range 0..{d_sae - 1} (SAE {self.sae!r})"
                    raise GenerationError(message, f"{where}features")
                if f in seen:  # each id is read once: a repeat would only repeat its value in every token's list
                    raise GenerationError(f"{where}features: {f} is named twice", f"{where}features")
                seen.add(f)
            return None, list(self.features)
        top_k = self.top_k if self.top_k is not None else min(10, d_sae)  # the default: 10 at most
        if not 1 <= top_k <= min(d_sae, 1024):
            raise GenerationError(f"{where}top_k must be in 1..{min(d_sae, 1024)}, got {clip(top_k)}", f"{where}top_k")
        return top_k, None


class LogitsProcessors(BaseModel):
    """What is done to the logits before a token is chosen, besides temperature, top-k and top-p, with OpenAI's
    and vLLM's names (null: off): a bias per token id, the presence, frequency and repetition penalties, and
    min-p (`model.sampling`)."""

    logit_bias: dict[str, float] | None = None  # token id (as JSON spells a key: a string) -> bias in [-100, 100]
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None

    def processors(self) -> dict[str, Any]:
        """`SamplingParams`' fields of those given (it keeps its defaults for the others, and checks the values)."""
        names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
        fields = {name: value for name in names if (value := getattr(self, name)) is not None}
        if self.logit_bias is not None:
            fields["logit_bias"] = logit_bias_by_id(self.logit_bias.items())
        return fields


class GenerateRequest(Edits, LogitsProcessors):
    prompt: PromptText | None = None
    input_ids: PromptIds | None = None
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    stream: bool = False
    activations: ActivationSpec | None = None
    features: FeatureCapture | None = Field(default=None, description="an SAE's features at every position")

    def sampling_params(self, max_new_tokens_cap: int, n_ctx: int) -> SamplingParams:
        check_cap(self.max_new_tokens, max_new_tokens_cap, "max_new_tokens", n_ctx)
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stop_tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            **self.processors(),
        )


class ActivationsRequest(GenerateRequest):
    """`/v1/activations`: one prompt (by default just its forward pass), or a batch of prompts of one
    length (their forward passes: one file with a leading batch dimension)."""

    prompt: PromptText | None = None
    input_ids: PromptIds | None = None
    max_new_tokens: int = 0
    activations: ActivationSpec = Field(default_factory=lambda: ActivationSpec(hooks=["*"]))
    features: Any = Field(default=None, description="not here: /v1/generate or /v1/features give features")

    @field_validator("activations", mode="before")
    @classmethod
    def _file_spec(cls, value: Any) -> Any:
        """The answer is a safetensors file: no `format` to choose; `hooks` default to every default hook
        point here too when the object is given for its `dtype` (null: `Strict`'s default)."""
        if isinstance(value, dict):
            if "format" in value:
                raise ValueError("format is not taken here: /v1/activations answers with a safetensors file")
            if value.get("hooks") is None:  # left out, or null
                value = {**value, "hooks": ["*"]}
        return value

    @field_validator("features")
    @classmethod
    def _no_features(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("not taken here: /v1/generate (a capture) or /v1/features give an SAE's features")
        return None

    def batch(self) -> bool:
        """Whether the prompts came as a list (texts, or lists of ids): a batch, of one prompt too, whose file's
        token ids and texts are lists."""
        ids = self.input_ids
        return isinstance(self.prompt, list) or (ids is not None and len(ids) > 0 and isinstance(ids[0], list))


class NextTokenRequest(Edits):
    prompt: str | None = None
    input_ids: list[int] | None = None
    top_k: int = Field(default=10, description="how many of the most likely next tokens to return")


class AnalyzeRequest(Edits):
    prompt: str | None = None
    input_ids: list[int] | None = None
    top_k: int = Field(default=5, description="tokens per position in the logit lens")
    compare_ablated: bool = Field(default=True, description="also run with every residual connection removed")
    gradients: bool = Field(default=False, description="add the loss's gradient norm and each block's Jacobian")


# --- gradients and attribution: one metric shape for both ------------------------------------------

MAX_TOKEN_TEXT = 256  # characters of a token given as text


def _token(value: int | str, tokenizer: Tokenizer, param: str) -> int:
    """A token id, or text that encodes to exactly one token (its id)."""
    if isinstance(value, int):
        return value  # its range is checked against the model's vocabulary with the metric
    if len(value) > MAX_TOKEN_TEXT:
        raise GenerationError(f"{param} is {len(value)} characters long: one token is at most {MAX_TOKEN_TEXT}", param)
    ids = tokenizer.encode(valid_text(value, param))
    if len(ids) != 1:
        raise GenerationError(
            f"{param} {value!r} is {len(ids)} tokens ({ids}), not one: give a token id or the text of one token", param
        )
    return ids[0]


class LogProbMetric(Strict):
    """log p(token) at `position`: the log-softmax of the logits there."""

    type: Literal["logprob"]
    token: int | str = Field(description="token id, or text that is exactly one token (' Paris')")
    position: int = Field(default=-1, description="the position whose next-token distribution is read; -1: the last")

    def metric(self, tokenizer: Tokenizer) -> Metric:
        return LogProb(_token(self.token, tokenizer, "metric.token"), self.position)


class LogitDiffMetric(Strict):
    """logit[a] - logit[b] at `position`."""

    type: Literal["logit_diff"]
    tokens: list[int | str] = Field(min_length=2, max_length=2, description="[a, b]: ids, or texts of one token")
    position: int = -1

    def metric(self, tokenizer: Tokenizer) -> Metric:
        a, b = (_token(t, tokenizer, f"metric.tokens[{i}]") for i, t in enumerate(self.tokens))
        return LogitDiff((a, b), self.position)


class LossMetric(Strict):
    """The next-token cross-entropy over the prompt's tokens [start, end), each predicted from the one before."""

    type: Literal["loss"]
    span: list[int] | None = Field(default=None, min_length=2, max_length=2, description="[start, end); null: 1..T")

    def metric(self, tokenizer: Tokenizer) -> Metric:
        return Loss(None if self.span is None else (self.span[0], self.span[1]))


MetricSpec = Annotated[LogProbMetric | LogitDiffMetric | LossMetric, Field(discriminator="type")]


class GradientsRequest(Edits):
    """`/v1/gradients`: ∂metric/∂(value at each hook), with the request's edits applied."""

    prompt: str | None = None
    input_ids: list[int] | None = None
    metric: MetricSpec
    hooks: list[HookName] = Field(
        min_length=1, max_length=MAX_HOOKS, description="hook names or globs, e.g. blocks.*.hook_resid_pre"
    )
    format: Literal["json", "safetensors"] = Field(default="json", description="safetensors: the answer is a file")

    def hook_names(self, n_layer: int) -> list[str]:
        try:
            return select_hooks(self.hooks, n_layer)
        except UnknownHookError as e:
            raise GenerationError(str(e), "hooks") from None


class AttributionRequest(Strict):
    """`/v1/attribution`: attribution patching of `clean` into `corrupted` (prompts of one length)."""

    clean: str | list[int]
    corrupted: str | list[int]
    metric: MetricSpec
    verify: int = Field(default=0, description=f"also patch the top k sites for real (0..{MAX_VERIFY})")

    def check(self) -> None:
        if not 0 <= self.verify <= MAX_VERIFY:
            raise GenerationError(f"verify must be in 0..{MAX_VERIFY}, got {clip(self.verify)}", "verify")


class TokenizeRequest(Strict):
    """vLLM's /tokenize for a prompt; a field it does not have (its chat form's `messages`, say) is refused."""

    model: str | None = None  # vLLM's clients send it: checked against the served names, as completions do
    prompt: str
    add_special_tokens: bool = True  # GPT-2 adds none either way
    return_token_strs: bool = False  # also each token's string in the vocabulary (`Ġcat`)
    split_special_tokens: bool = False  # transformers': `<|endoftext|>` in the text is read as plain text


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: whether the stream ends with a usage chunk, and vLLM's: whether every chunk
    carries its choice's usage so far (and the stream ends with one, as vLLM's `include_usage` defaults to
    true; `include_usage` false turns both off, as in vLLM; other options are ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None  # null: the default, true with continuous_usage_stats, else false
    continuous_usage_stats: bool | None = False


class CompletionRequest(LogitsProcessors):
    """OpenAI's legacy completions, with vLLM's sampling extensions. Unknown fields are ignored; known ones
    (OpenAI's, chat's and vLLM's) that we do not implement are refused where their value would change the
    result (see `check`). `model` is checked against the served names by the route."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    prompt: OpenAIPrompt | None = None  # null, "" or []: <|endoftext|>, the start of a document
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    logprobs: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    stream_options: StreamOptions | None = None
    # vLLM's sampling extensions, as /v1/generate has them (null: the default)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:N"

    @model_validator(mode="before")
    @classmethod
    def _null_n_stream_echo(cls, body: Any) -> Any:
        """OpenAI allows null for `n`, `stream` and `echo`: their default. (Not `Strict`'s rule for every field:
        here a null `max_tokens` means as many as fit.)"""
        if not isinstance(body, dict):
            return body
        return {k: v for k, v in body.items() if v is not None or k not in ("n", "stream", "echo")}

    def check(self) -> None:
        """Refuse unimplemented fields whose value would change the result, `n` and `logprobs` out of
        range (`model` is the route's to check: `check_model`)."""
        extra = self.model_extra or {}
        # vLLM's defaults, true, change nothing where no special token (<|endoftext|>) can reach the text: it
        # is not echoed, and one generated ends the choice (EOS, or a stop token id) without entering it
        special_in_text = self.echo or (bool(self.ignore_eos) and EOT_ID not in (self.stop_token_ids or ()))
        if not special_in_text:
            extra = {k: v for k, v in extra.items() if not (k in _SPECIAL_TEXT and v is True)}
        for name, value in _NEUTRAL.items():
            given = extra.get(name)
            if given is not None and (given != value or isinstance(given, bool) != isinstance(value, bool)):
                raise GenerationError(f"{name}={given!r} is not supported by this server", name)
        for name, hint in _UNSUPPORTED.items():
            if extra.get(name) is not None:
                raise GenerationError(f"{name} is not supported by this server{hint}", name)
        best_of = extra.get("best_of")
        if best_of is not None:
            if not isinstance(best_of, int) or isinstance(best_of, bool):
                raise GenerationError(f"best_of must be an integer, got {best_of!r}", "best_of")
            if best_of != self.n:
                raise GenerationError(f"best_of={best_of} is not supported (only best_of == n, {self.n})", "best_of")
        if self.stream_options is not None and not self.stream:  # as OpenAI answers it, not silently dropped
            raise GenerationError("stream_options is only allowed when stream is true", "stream_options")
        if not 1 <= self.n <= MAX_N:
            raise GenerationError(f"n must be in 1..{MAX_N}, got {clip(self.n)}", "n")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise GenerationError(f"logprobs must be in 0..5, got {clip(self.logprobs)}", "logprobs")

    def sequences(self, prompts: list[list[int]], n_ctx: int, cap: int) -> tuple[list[list[int]], list[SamplingParams]]:
        """The engine's sequences: each prompt `n` times, the j-th sample seeded with seed + j (wrapping
        within int64), with `max_tokens` (null: as many as fit the context, up to the server's cap; a number is
        checked against the cap by the route, `check_cap`)."""
        seqs, params = [], []
        shared = self.sampling_params()  # checked once (a logit bias may name every id), varied below
        for prompt in prompts:
            max_tokens = max(0, min(cap, n_ctx - len(prompt))) if self.max_tokens is None else self.max_tokens
            for j in range(self.n):
                seqs.append(prompt)
                params.append(shared.varied(max_tokens, None if self.seed is None else nth_seed(self.seed, j)))
        return seqs, params

    def sampling_params(self) -> SamplingParams:
        """The settings every sample of the request shares: `sequences` gives each its length and seed."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=stop_tuple(self.stop),
            top_k=self.top_k or 0,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None,
            **self.processors(),
        )


# Fields of OpenAI's and vLLM's completions that this server does not implement, each at the value that
# changes nothing (null, their default, too): another value is refused, never silently ignored.
_NEUTRAL: dict[str, Any] = {
    "suffix": "",
    "min_tokens": 0,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": False,  # the text is every token's: <|endoftext|> too, where one is generated or echoed
    "spaces_between_special_tokens": False,
    "bad_words": [],
    "response_format": {"type": "text"},
}
_SPECIAL_TEXT = ("skip_special_tokens", "spaces_between_special_tokens")
_CHAT = ": GPT-2 is not a chat model (this is /v1/completions; send a prompt)"
# Fields that change the answer at any value but null, with what to do instead.
_UNSUPPORTED: dict[str, str] = {
    "allowed_token_ids": "",
    "logits_processors": "",
    "truncate_prompt_tokens": "",
    "prompt_embeds": "",
    "prompt_logprobs": " (echo with logprobs gives the prompt's)",
    "guided_json": "",
    "guided_regex": "",
    "guided_choice": "",
    "guided_grammar": "",
    "structured_outputs": "",
    "max_completion_tokens": " on /v1/completions (chat completions' name; this API's is max_tokens)",
    "top_logprobs": " on /v1/completions (chat completions' name; this API's is logprobs, an integer)",
    "messages": _CHAT,
    "tools": _CHAT,
    "tool_choice": _CHAT,
    "functions": _CHAT,
    "function_call": _CHAT,
    **dict.fromkeys(
        ("interventions", "residual", "activations", "features"), " on /v1/completions (/v1/generate takes it)"
    ),
}


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (valid_text(stop, "stop"),)
    return tuple(valid_text(s, f"stop[{i}]", "stop") for i, s in enumerate(stop))


def valid_text(text: str, where: str, param: str | None = None) -> str:
    """`text`, refused with a 400 naming `where` when it is not valid Unicode (a lone surrogate)."""
    try:
        check_unicode(text)
    except InvalidTextError as e:
        raise GenerationError(f"{where} is {e}", param or where) from None
    return text


def check_cap(value: int, cap: int, param: str, n_ctx: int) -> None:
    """`value` of the new tokens a request asks for (`param`) within the server's `cap`; one that leaves no
    room for a prompt in the context of `n_ctx` tokens is said to be that (OpenAI's `context_length_exceeded`,
    on which a client shrinks it), whatever the cap."""
    if value < 0:  # checked here too, so that the error names the field of this API (max_tokens)
        raise GenerationError(f"{param} must be an integer >= 0, got {clip(value)}", param)
    if value > cap:
        if value >= n_ctx:
            raise ContextLengthError(
                f"{param} ({clip(value)}) leaves no room for a prompt in the context of {n_ctx} tokens", param
            )
        raise GenerationError(f"{param} must be at most {cap} (the server's limit), got {clip(value)}", param)


def nth_seed(seed: int, j: int) -> int:
    """seed + j, wrapping around within int64, the seeds' range (a seed valid on its own stays valid for
    every sample)."""
    if seed not in SEED_RANGE:
        return seed  # left for SamplingParams to refuse, with its message
    return (seed + j - SEED_RANGE.start) % (SEED_RANGE.stop - SEED_RANGE.start) + SEED_RANGE.start


# --- SAE features and steering vectors (model/lab/sae.py, model/lab/steering.py) -------------------


class FeaturesRequest(Edits, FeatureCapture):
    """`/v1/features`: per token, an SAE's top features (or the asked-for ones), over the prompt and, with
    `max_new_tokens`, its continuation (sampled as in /v1/generate; the interventions apply throughout)."""

    prompt: str | None = None
    input_ids: list[int] | None = None
    format: Literal["json", "safetensors"] = "json"
    max_new_tokens: int = 0
    temperature: float = 1.0
    seed: int | None = None

    def sampling_params(self, max_new_tokens_cap: int, n_ctx: int) -> SamplingParams:
        check_cap(self.max_new_tokens, max_new_tokens_cap, "max_new_tokens", n_ctx)
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
            ignore_eos=True,
        )


MAX_CONTRAST_PROMPTS = 64


class SteeringVectorRequest(Strict):
    """`/v1/steering-vectors`: mean(positive) - mean(negative) of the values at `hook`, each prompt's at its
    last position or its mean over positions; stored under `name` if given (in memory, bounded)."""

    positive: list[str] | list[list[int]] = Field(description="prompts (texts or token id lists)")
    negative: list[str] | list[list[int]]
    hook: HookName = Field(description="a hook with one vector per position, e.g. blocks.6.hook_resid_pre")
    reduce: Literal["last", "mean"] = "last"
    name: str | None = Field(default=None, description="store the vector under this name, for later edits")

    def check(self) -> None:
        for param in ("positive", "negative"):
            n = len(getattr(self, param))
            if not 1 <= n <= MAX_CONTRAST_PROMPTS:
                raise GenerationError(f"{param} must hold 1..{MAX_CONTRAST_PROMPTS} prompts, got {n}", param)
        if self.name is not None:
            valid_text(self.name, "name")
