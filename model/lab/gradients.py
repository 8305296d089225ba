"""Gradients at hook points, and the gradient highway the residual connection opens.

A scalar `metric` of the logits (a token's log-probability, a logit difference, the language-model loss)
is differentiated with respect to the values at chosen hook points: ∂metric/∂(value at the hook), what
TransformerLens' backward hooks see (`run_with_cache(incl_bwd=True)` names them `<hook>_grad`). The
network's parameters take no part: gradients are taken with `torch.autograd.grad` with respect to the
hooked values only, and the graph starts at the first of them.

The highway: a block computes x + f(x), so ∂(x + f(x))/∂x = I + f'(x), and the gradient reaches the first
layers through the identity whatever f' does (He et al. 2016, "Deep Residual Learning" and "Identity
Mappings in Deep Residual Networks"); without the skips it is a product of f' alone. `highway` measures
both the loss's gradient at every layer's stream and each block's Jacobian against the identity.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from ..config import GPTConfig
from ..gpt import GPT
from ..hooks import Hooks, select_hooks
from ..interventions import EditSpec, HookChain, InterventionError, split_input_clashes
from ..overflow import layer_norm_inputs, layer_norm_overflow, variance_overflows


class MetricError(InterventionError):
    """A metric that cannot be computed on this prompt: a token outside the vocabulary, a position or span
    outside the prompt. `param` names the field (`metric.token`, `metric.position`, `metric.span`)."""


@dataclass(frozen=True)
class LogProb:
    """log p(token | the prompt up to `position`): the log-softmax of the logits at `position`."""

    token: int
    position: int = -1  # negative counts from the end, as in Python


@dataclass(frozen=True)
class LogitDiff:
    """logit[a] - logit[b] at `position` (the IOI-style metric: correct minus incorrect answer)."""

    tokens: tuple[int, int]
    position: int = -1


@dataclass(frozen=True)
class Loss:
    """The next-token cross-entropy (nats, mean) over the tokens `span` = [start, end) of the prompt, each
    predicted from the position before it; None: every token but the first, the language-model loss."""

    span: tuple[int, int] | None = None


Metric = LogProb | LogitDiff | Loss


def check_metric(metric: Metric, n_tokens: int, vocab_size: int) -> None:
    """Refuse (`MetricError`, naming the field) what cannot be computed on a prompt of `n_tokens`."""
    if isinstance(metric, Loss):
        start, end = metric.span if metric.span is not None else (1, n_tokens)
        if not 1 <= start < end <= n_tokens:
            raise MetricError(
                f"loss span [{start}, {end}) must be tokens 1 <= start < end <= {n_tokens} (the prompt's length): "
                "each token is predicted from the one before, so the first cannot be, and the loss needs at "
                "least one",
                "metric.span",
            )
        return
    tokens = metric.tokens if isinstance(metric, LogitDiff) else (metric.token,)
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            field = "metric.tokens" if isinstance(metric, LogitDiff) else "metric.token"
            raise MetricError(f"token id {t!r} is outside the vocabulary (0..{vocab_size - 1})", field)
    if not -n_tokens <= metric.position < n_tokens:
        raise MetricError(
            f"position {metric.position} is outside the prompt of {n_tokens} tokens "
            f"(0..{n_tokens - 1}, or -{n_tokens}..-1 from the end)",
            "metric.position",
        )


def metric_value(metric: Metric, logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The metric of logits [T, vocab] over the prompt `ids` (the loss's targets), a scalar tensor in at
    least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if isinstance(metric, LogProb):
        return torch.log_softmax(logits[metric.position], dim=-1)[metric.token]
    if isinstance(metric, LogitDiff):
        a, b = metric.tokens
        return logits[metric.position, a] - logits[metric.position, b]
    start, end = metric.span if metric.span is not None else (1, len(ids))
    targets = torch.tensor(ids[start:end], device=logits.device)
    return torch.nn.functional.cross_entropy(logits[start - 1 : end - 1], targets)  # mean over the span


class GradientHooks:
    """Hooks that make the value at each wanted hook point a node of its own in the autograd graph (a leaf
    that requires grad where no graph exists yet, else a view), so that ∂metric/∂value is the gradient
    through that value alone, as at a TransformerLens hook point; the forward pass goes on from it."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self._wanted = frozenset(self.names)
        self.values: dict[str, torch.Tensor] = {}

    def active(self, name: str) -> bool:
        return name in self._wanted

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name not in self._wanted:
            return x
        x = x.view_as(x) if x.requires_grad else x.detach().requires_grad_(True)
        self.values[name] = x
        return x

    def grads(self, metric: torch.Tensor, retain_graph: bool = False) -> dict[str, torch.Tensor]:
        """∂metric/∂value at each hook the forward pass reached (zeros where the metric does not depend on
        it: a later position, say)."""
        names = [n for n in self.names if n in self.values]
        values = [self.values[n] for n in names]
        grads = torch.autograd.grad(metric, values, retain_graph=retain_graph, allow_unused=True)
        return {n: torch.zeros_like(v) if g is None else g for n, v, g in zip(names, values, grads, strict=True)}


class LayerNormWatch:
    """Hooks that note, for each LayerNorm the pass reaches, whether its variance overflows
    (`variance_overflows`: then it normalises the stream to 0, and the gradient through it is 0 with a finite
    metric). Reads only, and keeps the answers on the device: `check` looks at them once, after the pass."""

    def __init__(self, n_layer: int, edited: bool) -> None:
        self._inputs = layer_norm_inputs(n_layer)
        self.edited = edited  # whether edits ran (they are what the message blames)
        self._seen: list[tuple[str, torch.dtype, torch.Tensor]] = []  # (LayerNorm, input dtype, overflowed)

    def active(self, name: str) -> bool:
        return False  # watching takes no hook point off its fused path

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        ln = self._inputs.get(name)
        if ln is not None:
            self._seen.append((ln, x.dtype, variance_overflows(x)))
        return x

    def check(self, param: str, then: str = "") -> None:
        """Refuse (`MetricError`, naming `param`) a pass in which a LayerNorm overflowed, naming the first;
        `then` ends the message."""
        if not self._seen:
            return
        flags = torch.stack([f for _, _, f in self._seen]).tolist()  # one sync for the whole pass
        for (ln, dtype, _), overflowed in zip(self._seen, flags, strict=True):
            if overflowed:
                raise MetricError(layer_norm_overflow(ln, dtype, self.edited) + then, param)


def watched(hooks: Hooks, edits: EditSpec | None, config: GPTConfig, n_tokens: int) -> tuple[Hooks, LayerNormWatch]:
    """The hooks of a run with `edits` whose hook points `hooks` (a gradient capture) see after the edits,
    with a `LayerNormWatch` behind them."""
    watch = LayerNormWatch(config.n_layer, edited=edits is not None)
    chain = HookChain(hooks, watch)
    edited = edits.hooks(config, n_tokens, then=chain) if edits is not None else None
    return edited or chain, watch


def check_split_inputs(names: list[str], edited: Collection[str]) -> None:
    """Refuse (`InterventionError`, naming `hooks`) a gradient at a per-head input (`hook_q_input`, ...) where
    an edit changes ln1's hooks in the same layer (`edited`: the hook points edits apply at), or at ln1's hooks
    where one changes a per-head input. The gradient at a hook is the first-order effect of an edit there,
    and edits of both in one layer have no single meaning: an edited per-head input is normalised on its own
    path, apart from ln1's hooks, which act on the stream itself."""
    for name in names:
        clash = [n for n in split_input_clashes(name) if n in edited]
        if clash:
            raise InterventionError(
                f"a gradient at {name} and an edit of {clash[0]} cannot be combined: an edited per-head input "
                "is normalised on its own path, apart from ln1's hooks (edits of both in one layer are refused "
                "too); ask for the gradient in another layer, or at hook_resid_pre",
                "hooks",
            )


@dataclass(frozen=True)
class Gradients:
    metric: float  # the metric's value on the run
    grads: dict[str, torch.Tensor]  # hook name -> ∂metric/∂value, [1, pos, ...] ([1, head, pos, pos] for squares)


def gradients(model: GPT, ids: list[int], metric: Metric, names: list[str], edits: EditSpec | None = None) -> Gradients:
    """One forward pass over `ids` (with `edits`: interventions, residual ablation) and one backward pass:
    the metric and its gradient at each hook point of `names` (exact names or globs, in model order; one
    that matches nothing is an `UnknownHookError`; `check_split_inputs` says what else is refused).
    Builds a graph even where the caller runs under `torch.inference_mode` (the engine's thread); the
    parameters' `.grad` are left untouched. A run in which a LayerNorm's variance overflows is refused
    (`LayerNormWatch`): it would give 0 for every gradient through that LayerNorm, with a finite metric."""
    names = select_hooks(names, model.config.n_layer)
    check_metric(metric, len(ids), model.config.vocab_size)
    check_split_inputs(names, set(edits.sites(model.config.n_layer)) if edits is not None else set())
    with torch.inference_mode(False), torch.enable_grad():
        capture = GradientHooks(names)
        hooks, watch = watched(capture, edits, model.config, len(ids))
        idx = torch.tensor([ids], device=model.wte.weight.device)
        value = metric_value(metric, model(idx, hooks=hooks)[0], ids)
        watch.check("interventions" if edits is not None else "metric", ": every gradient through it is 0")
        if not value.isfinite():
            raise MetricError(f"the metric is not finite ({value.detach().item()}): nothing to differentiate", "metric")
        if not value.requires_grad:  # none of the hooks lies on a path to the metric
            return Gradients(float(value), {n: torch.zeros_like(v.detach()) for n, v in capture.values.items()})
        grads = capture.grads(value)
    return Gradients(float(value.detach()), {n: g.detach() for n, g in grads.items()})


# --- the highway -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerGradient:
    layer: int  # -1: the stream entering block 0 (embeddings); L: after block L (as `analyze` counts)
    grad_norm: float  # ‖∂loss/∂x_t‖ at this layer's stream, mean over the positions the loss reads
    jacobian_norm: float | None  # block L's ‖J‖_F / √(T·C), J = ∂resid_post/∂resid_pre; None for -1
    jacobian_identity_distance: float | None  # ‖J - I‖_F / √(T·C): 0 for a block that is the identity


def frobenius_rms(post: torch.Tensor, pre: torch.Tensor, probes: torch.Tensor, minus_identity: bool = False) -> float:
    """‖J‖_F / √n for J = ∂post/∂pre (or J - I), n = pre.numel(), from vector-Jacobian products with
    `probes` [k, *pre.shape]: Hutchinson's estimator ‖J‖_F² = E‖Jᵀu‖² over probes with E[uuᵀ] = I
    (Rademacher signs: exact for the identity; or the n unit vectors times √n: exact for any J). The root-mean-
    square gain of the map over directions: 1 for the identity."""
    total = 0.0
    for u in probes:
        (v,) = torch.autograd.grad(post, pre, u, retain_graph=True)
        if minus_identity:
            v = v - u
        total += float(v.double().pow(2).sum())
    return math.sqrt(total / len(probes) / pre.numel())


def rademacher(k: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    """k random sign tensors of `shape` (seeded: the same probes every run)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (k, *shape), generator=g) * 2 - 1).to(dtype=dtype, device=device)


def highway(
    model: GPT, ids: list[int], edits: EditSpec | None = None, probes: int = 8, seed: int = 0
) -> list[LayerGradient]:
    """The language-model loss's gradient at every layer's residual stream (one backward pass), and each
    block's Jacobian ∂resid_post/∂resid_pre over the whole sequence (positions mix in attention) as its RMS
    gain against the identity, from `probes` vector-Jacobian products. With `edits` removing the residual
    connections, the same measures show the backward pass without the highway."""
    L = model.config.n_layer
    if len(ids) < 2:
        raise MetricError(
            "the gradient highway needs a prompt of at least 2 tokens (the loss predicts the second)", "gradients"
        )
    pre = [f"blocks.{i}.hook_resid_pre" for i in range(L)]
    post = [f"blocks.{i}.hook_resid_post" for i in range(L)]
    with torch.inference_mode(False), torch.enable_grad():
        capture = GradientHooks([n for pair in zip(pre, post, strict=True) for n in pair])
        hooks, watch = watched(capture, edits, model.config, len(ids))
        idx = torch.tensor([ids], device=model.wte.weight.device)
        loss = metric_value(Loss(), model(idx, hooks=hooks)[0], ids)
        watch.check("interventions" if edits is not None else "gradients", ": no gradient to measure")
        if not loss.isfinite():
            raise MetricError(f"the loss is not finite ({loss.detach().item()}): no gradient to measure", "gradients")
        grads = capture.grads(loss, retain_graph=True)
        streams = [pre[0], *post]

        def grad_norm(name: str) -> float:
            g = grads[name][0, :-1]  # [T-1, C]: the last position's stream predicts no token of the loss
            return float(g.double().norm(dim=-1).mean())

        out = [LayerGradient(-1, grad_norm(streams[0]), None, None)]
        x = capture.values[pre[0]]
        u = rademacher(probes, tuple(x.shape), x.dtype, x.device, seed)
        for i in range(L):
            a, b = capture.values[pre[i]], capture.values[post[i]]
            out.append(
                LayerGradient(
                    i, grad_norm(post[i]), frobenius_rms(b, a, u), frobenius_rms(b, a, u, minus_identity=True)
                )
            )
    return out


# --- memory ------------------------------------------------------------------------------------


def graph_bytes(config: GPTConfig, n_tokens: int, dtype: torch.dtype) -> int:
    """An upper estimate of the memory a forward pass with a graph and its backward pass take, from the
    shapes: per block and position about 17 d_model-wide values saved for the backward pass (inputs of the
    four projections, q, k, v, the layer norms' inputs, GELU's input and output at 4 d_model) and two
    attention rows per head (scores and pattern), then the final layer norm and two vocabulary-wide rows
    (the logits and their log-softmax); a quarter more for the backward pass's own buffers."""
    C, H, T = config.n_embd, config.n_head, n_tokens
    per_position = config.n_layer * (17 * C + 2 * H * T) + 3 * C + 2 * config.vocab_size
    return int(1.25 * T * per_position * torch.empty((), dtype=dtype).element_size())


def grad_name(name: str) -> str:
    """TransformerLens' cache key for the gradient at hook `name`."""
    return name + "_grad"
