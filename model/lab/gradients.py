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
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

import torch

from ..config import GPTConfig
from ..gpt import GPT
from ..hooks import (
    LOGIT_HOOKS,
    SPLIT_INPUTS,
    Hooks,
    check_ids,
    layer_of,
    needs_whole_prompt,
    select_hooks,
    uses_the_head,
    uses_the_logits,
)
from ..interventions import EditSpec, HookChain, InterventionError, split_input_clashes, takes_whole_prompt
from ..json_file import clip, is_int
from ..overflow import dtype_range, layer_norm_inputs, layer_norm_overflow, variance_overflows


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


def _loss_span(metric: Loss, n_tokens: int) -> tuple[int, int]:
    """The tokens [start, end) the loss predicts: its span, or every token but the first (a prompt of one
    token has none: a `MetricError` that says so, not one about a span the caller never gave)."""
    if metric.span is not None:
        return metric.span
    if n_tokens < 2:
        raise MetricError(
            f"the loss needs a prompt of at least 2 tokens, got {n_tokens}: each token is predicted from the "
            "one before, so the first cannot be",
            "metric",
        )
    return 1, n_tokens


def check_metric(metric: Metric, n_tokens: int, vocab_size: int) -> None:
    """Refuse (`MetricError`, naming the field) what cannot be computed on a prompt of `n_tokens`, and fields of
    another type (a numpy id, a float position: errors from deep in the pass, or a wrong one, otherwise)."""
    if not isinstance(metric, (LogProb, LogitDiff, Loss)):
        raise MetricError(f"a metric is a LogProb, a LogitDiff or a Loss, got {type(metric).__name__}", "metric")
    if isinstance(metric, Loss):
        if metric.span is not None and not _ints(metric.span, 2):
            raise MetricError(f"a loss span is two ints (start, end), got {clip(metric.span)}", "metric.span")
        start, end = _loss_span(metric, n_tokens)
        if not 1 <= start < end <= n_tokens:
            raise MetricError(
                f"loss span [{start}, {end}) must be tokens 1 <= start < end <= {n_tokens} (the prompt's length): "
                "each token is predicted from the one before, so the first cannot be, and the loss needs at "
                "least one",
                "metric.span",
            )
        return
    convert = "convert numpy or torch values with int()"
    tokens: tuple[int, ...]
    if isinstance(metric, LogitDiff):
        field, tokens = "metric.tokens", metric.tokens
        if not _ints(tokens, 2):
            raise MetricError(f"a logit difference's tokens are two ints ({convert}), got {clip(tokens)}", field)
    else:
        field, tokens = "metric.token", (metric.token,)
        if not is_int(metric.token):
            raise MetricError(f"a token is an int ({convert}), got {clip(metric.token)}", field)
    for t in tokens:
        if not 0 <= t < vocab_size:
            raise MetricError(f"token id {t!r} is outside the vocabulary (0..{vocab_size - 1})", field)
    if not is_int(metric.position):
        raise MetricError(f"a position is an int, got {clip(metric.position)}", "metric.position")
    if not -n_tokens <= metric.position < n_tokens:
        raise MetricError(
            f"position {metric.position} is outside the prompt of {n_tokens} tokens "
            f"(0..{n_tokens - 1}, or -{n_tokens}..-1 from the end)",
            "metric.position",
        )


def _ints(values: object, n: int) -> bool:
    """Whether `values` is a tuple or list of `n` ints (not bools)."""
    return isinstance(values, (tuple, list)) and len(values) == n and all(is_int(v) for v in values)


def metric_rows(metric: Metric, n_tokens: int) -> range:
    """The positions whose logits `metric` reads, on a prompt of `n_tokens`."""
    if isinstance(metric, Loss):
        start, end = _loss_span(metric, n_tokens)
        return range(start - 1, end - 1)  # each predicts the token after it
    p = metric.position % n_tokens
    return range(p, p + 1)


def metric_share(metric: Metric, logits: torch.Tensor, ids: list[int], rows: range) -> torch.Tensor:
    """The part of `metric` that the logits [len(rows), vocab] at positions `rows` (a run of `metric_rows`)
    give, over the prompt `ids` (the loss's targets): the loss's terms there over the span's length (the
    metric is the sum of its parts), or the whole metric where it reads one position. A scalar tensor in at
    least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if isinstance(metric, LogProb):
        return torch.log_softmax(logits[0], dim=-1)[metric.token]
    if isinstance(metric, LogitDiff):
        a, b = metric.tokens
        return logits[0, a] - logits[0, b]
    targets = torch.tensor(ids[rows.start + 1 : rows.stop + 1], device=logits.device)
    terms = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return terms / len(metric_rows(metric, len(ids)))


def metric_value(metric: Metric, logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The metric of logits [T, vocab] over the prompt `ids` (the loss's targets), a scalar tensor in at
    least float32."""
    rows = metric_rows(metric, len(ids))
    return metric_share(metric, logits[rows.start : rows.stop], ids, rows)


class GradientHooks:
    """Hooks that make the value at each wanted hook point a node of its own in the autograd graph (a leaf
    that requires grad where no graph exists yet, else a view), so that ∂metric/∂value is the gradient
    through that value alone, as at a TransformerLens hook point; the forward pass goes on from it
    (`MetricPass` takes the gradients)."""

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


class LayerNormWatch:
    """Hooks that note, for each LayerNorm the pass reaches, whether its variance overflows
    (`variance_overflows`: then it normalises the stream to 0, and the gradient through it is 0 with a finite
    metric) at one of the first `positions`, those the metric's logits can depend on (attention is causal:
    a later position's overflow changes nothing it reads, unless a `mean` edit carries it back). Reads only,
    and keeps the answers on the device: `check` looks at them once, after the pass."""

    def __init__(self, n_layer: int, edited: bool, positions: int) -> None:
        self._inputs = layer_norm_inputs(n_layer)
        self.edited = edited  # whether edits ran (they are what the message blames)
        self.positions = positions
        self._seen: list[tuple[str, torch.dtype, torch.Tensor]] = []  # (LayerNorm, input dtype, overflowed)

    def active(self, name: str) -> bool:
        return False  # watching takes no hook point off its fused path

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        ln = self._inputs.get(name)
        if ln is not None:
            self._seen.append((ln, x.dtype, variance_overflows(x[:, : self.positions])))  # [1, pos, ...]
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


def watched(
    hooks: Hooks, edits: EditSpec | None, config: GPTConfig, n_tokens: int, positions: int
) -> tuple[Hooks, LayerNormWatch]:
    """The hooks of a run over `n_tokens` with `edits` whose hook points `hooks` (a gradient capture) see after
    the edits, with a `LayerNormWatch` over the first `positions` behind them (over every position where an
    edit takes in the whole prompt, a `mean`: through it, a later position reaches the earlier ones)."""
    whole = edits is not None and takes_whole_prompt(edits.edits)
    watch = LayerNormWatch(config.n_layer, edited=edits is not None, positions=n_tokens if whole else positions)
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


@dataclass(frozen=True)
class Refusal:
    """How a `MetricPass` words a run it cannot differentiate: the field its errors name (`param`; where edits
    ran, the edits' field, `edits_param`: they drove the run past its range), how the overflow's message ends
    (`overflow`), and, for a metric that is not finite, what the metric is called (`subject`) and what follows
    (`consequence`)."""

    param: str
    overflow: str
    subject: str
    consequence: str
    edits_param: str = "interventions"


GRADIENTS = Refusal("metric", ": every gradient through it is 0", "the metric", "nothing to differentiate")


@dataclass
class _Stage:
    """A piece of a `MetricPass` with a graph of its own: from `inp` (a leaf; None, or one that does not
    require grad: no graph reaches back past it) to `out`; `names`: the wanted hook points it reached."""

    inp: torch.Tensor | None
    out: torch.Tensor
    names: list[str]
    piece: str  # what it runs, for errors: "block 3", "the LM head"


class MetricPass:
    """A run over `ids` (with `edits`) to `metric`, and the metric's gradient at the hook points `wrt`, a piece
    at a time: each `step` is bounded work, which the server runs as an engine job of its own, decode steps
    going on between them (the README gives the times).

    Forward: the embeddings with block 0, then each block (the last with the final LayerNorm over the rows
    the metric reads, or over every row where a hook point after the last block is asked for or edited, as
    in one pass), then the head's product over the rows the metric reads, `head_rows` at a time (over every
    row, in order, where its output is edited, captured or differentiated at, `uses_the_logits`, each part's
    gradient there its rows of the whole's; the whole head over every row at once where a hook there needs
    them so: `also` hooks that need the whole prompt, or any `mean` edit). Each piece
    starts from a leaf of a graph of its own, and the graphs start at the first piece a wanted hook point is
    in (the pieces before it run without one, as in one pass). Backward: each part of the head as it runs
    (the last with the final LayerNorm; the whole head's way back, a job of its own), then each block, last
    first: ∂metric/∂(its output) in, `torch.autograd.grad` through its graph alone, ∂metric/∂(its input)
    out, with the gradient at each wanted hook point in it. That is the chain rule, as one backward pass
    applies it; a piece's graph is let go of once the gradient is through it (unless `retain_graph`, for
    `HighwayPass`, but for the head's). `also`: hooks that read the values after the gradient hooks (a
    `Capture`); `targets`: the loss's tokens, if not `ids`. A LayerNorm whose variance overflows at a position
    the metric depends on (up to the last it reads; at any with `watch_every_position`, for `HighwayPass`,
    whose Jacobians read them all) is refused (`MetricError`, worded by `refusal`) before the head runs, a
    metric that is not finite before any block goes back: every gradient through it would be 0, or not
    finite."""

    head_rows = 128  # rows of the LM head a part: as long as a block's piece, about, on gpt2-small's shape

    def __init__(
        self,
        config: GPTConfig,
        ids: list[int],
        metric: Metric,
        wrt: list[str],
        refusal: Refusal = GRADIENTS,
        edits: EditSpec | None = None,
        also: Hooks | None = None,
        targets: list[int] | None = None,
        retain_graph: bool = False,
        watch_every_position: bool = False,
    ) -> None:
        self.ids, self.metric, self.refusal, self.retain_graph = ids, metric, refusal, retain_graph
        self.targets = ids if targets is None else targets
        self.capture = GradientHooks(wrt)
        hooks = self.capture if also is None else HookChain(self.capture, also)
        self._read = metric_rows(metric, len(ids))
        watch = len(ids) if watch_every_position else self._read.stop
        self._hooks, self._watch = watched(hooks, edits, config, len(ids), watch)
        self.edited = edits is not None
        self._blamed = refusal.edits_param if self.edited else refusal.param  # what the errors name
        self._n_layer = config.n_layer
        # the final LayerNorm's rows: every row where a hook point after the last block is in use (its hooks
        # see them all, as in one pass), else the metric's. The head's parts: the metric's rows; where the
        # head's output is hooked, every row, in order (as a long prompt's chunks come), or in one part where
        # a hook there needs them at once (a `mean` edit, a capture of the whole prompt)
        at_logits = uses_the_logits(self._hooks)  # then `_normed` is every row too: the logits are head hooks
        self._whole_head = at_logits and (
            (also is not None and needs_whole_prompt(also)) or (edits is not None and takes_whole_prompt(edits.edits))
        )
        self._normed = range(len(ids)) if uses_the_head(self._hooks) else self._read
        rows = self._normed if at_logits else self._read
        step = len(rows) if self._whole_head else self.head_rows
        self._parts = [rows[i : i + step] for i in range(0, len(rows), step)]  # not run yet
        # [1, T, C]: the stream entering the next block, then leaving the last ([1, len(_normed), C] through
        # the final LayerNorm, but for the whole head)
        self._x: torch.Tensor | None = None
        # the head's piece that goes back on its own (the final LayerNorm's, with the head's last part; the whole
        # head's, a job of its own), where it has a graph: no one needs that graph after it
        self._head_stage: _Stage | None = None
        self._blocks = 0  # blocks run
        self._stages: list[_Stage] = []  # the pieces before the head with a graph, to go back through
        self._grad: torch.Tensor | None = None  # ∂metric/∂(the output of the next piece back); None: zero
        self._head_grads: dict[str, torch.Tensor] = {}  # the gradient at the head's output, filled a part at a time
        self._value = 0.0
        self.grads: dict[str, torch.Tensor] = {}

    @property
    def done(self) -> bool:
        return self._blocks == self._n_layer and not self._parts and not self._stages

    @property
    def values(self) -> dict[str, torch.Tensor]:
        """The values at the wanted hook points the run has reached, [1, T, ...]: nodes of its graph (at the
        head's output, run a part at a time, its last part's rows)."""
        return self.capture.values

    def step(self, model: GPT) -> None:
        """The next piece: a block forward (the first with the embeddings, the last with the final LayerNorm), a
        part of the head forward and back (the last with the final LayerNorm back; the whole head forward, then
        back), or a block back (the first with the embeddings)."""
        assert not self.done, "the pass is over"
        with torch.inference_mode(False), torch.enable_grad():
            if self._blocks < self._n_layer:
                self._forward_block(model)
            elif self._parts:
                self._head_part(model, self._parts.pop(0))
                if not (self._parts or self._whole_head) and self._stages and self._stages[-1] is self._head_stage:
                    self._back()  # the final LayerNorm's piece: too small for a job
            else:
                self._back()
                if self._stages and self._stages[-1].inp is None:  # the embeddings' piece: too small for a job
                    self._back()

    def result(self) -> Gradients:
        """The metric and its gradient at each wanted hook point, in the order asked."""
        assert self.done, "the pass is not over"
        return Gradients(self._value, {n: self.grads[n] for n in self.capture.names if n in self.grads})

    def _forward_block(self, model: GPT) -> None:
        if self._x is None:
            self._x = model.embed(torch.tensor([self.ids], device=model.wte.weight.device), hooks=self._hooks)
            self._keep(None, self._x, 0, "the embeddings")
        seen, inp = len(self.values), _leaf(self._x)
        self._x = model.h[self._blocks](inp, None, self._hooks)
        self._keep(inp, self._x, seen, f"block {self._blocks}")
        self._blocks += 1
        if self._blocks == self._n_layer:
            if not self._whole_head:
                seen, inp, normed = len(self.values), _leaf(self._x), self._normed
                self._x = model.final_norm(inp[:, normed.start : normed.stop], self._hooks)
                self._head_stage = self._keep(inp, self._x, seen, "the final LayerNorm")
            self._watch.check(self._blamed, self.refusal.overflow)  # ln_final's input is in too
            if self._x.requires_grad and not self._whole_head:
                self._grad = torch.zeros_like(self._x)  # the head's parts fill in their rows

    def _keep(self, inp: torch.Tensor | None, out: torch.Tensor, seen: int, piece: str) -> _Stage | None:
        """Keep a piece just run, to go back through, where it has a graph or reached a wanted hook point (and
        return it). `inp`: its input (None for the embeddings'); where that has no graph, nothing before it is
        wanted."""
        names = list(self.values)[seen:]
        if not (out.requires_grad or names):
            return None
        self._stages.append(_Stage(inp, out, names, piece))
        return self._stages[-1]

    def _head_part(self, model: GPT, rows: range) -> None:
        """The head's product over `rows` of the normalised stream (with the hooks of its output, where they
        take the rows a part at a time), the metric's share of the logits of those of them it reads, and, at
        once, the gradient back at those rows (and at the head's output, where it is wanted: those rows of it);
        or the whole head over every row, where a hook of its output needs them at once, whose way back (through
        the product at every row) is then a job of its own."""
        assert self._x is not None
        at = slice(rows.start - self._normed.start, rows.stop - self._normed.start)  # those rows of `_x`
        for name in LOGIT_HOOKS:  # each part's output is a value of its own
            self.capture.values.pop(name, None)
        seen, inp = len(self.values), _leaf(self._x[:, at])
        if self._whole_head:  # [rows the metric reads, vocab]: its hooks see every row's
            logits = model.unembed(inp, self._hooks, slice(self._read.start, self._read.stop))[0]
            share = metric_share(self.metric, logits, self.targets, self._read)
            self._value += float(share.detach())
            self._head_stage = self._keep(inp, share, seen, "the LM head")
            self._grad = None if self._head_stage is None else torch.ones_like(share)
        else:
            logits = model.head(inp, self._hooks)[0]  # [len(rows), vocab]
            names = list(self.values)[seen:]  # the head's output, where its gradient is wanted
            read = range(max(rows.start, self._read.start), min(rows.stop, self._read.stop))  # a part may read none
            if read:
                logits = logits[read.start - rows.start : read.stop - rows.start]
                share = metric_share(self.metric, logits, self.targets, read)
                self._value += float(share.detach())
                self._check_value()  # before its gradient goes back: a metric past its range is the error to give
                grad = self._through(_Stage(inp, share, names, "the LM head"), torch.ones_like(share), retain=False)
                if grad is not None and self._grad is not None:
                    self._grad[:, at] = grad
            for name in names:  # its rows of the whole's [1, T, vocab] (0 where the metric reads none)
                part = self.grads.pop(name, None)
                if name not in self._head_grads:
                    value = self.values[name]
                    self._head_grads[name] = value.new_zeros(1, len(self._normed), value.shape[-1])
                if part is not None:
                    self._head_grads[name][:, at] = part
            if not self._parts:
                self.grads |= self._head_grads
        if not self._parts:
            self._check_value()  # refused before any block goes back

    def _check_value(self) -> None:
        if not math.isfinite(self._value):
            raise MetricError(
                f"{self.refusal.subject} is not finite ({self._value}): {self.refusal.consequence}", self._blamed
            )

    def _back(self) -> None:
        """Back through the last piece not gone through yet (its graph kept if `retain_graph`, but the head's)."""
        stage = self._stages.pop()
        self._grad = self._through(stage, self._grad, self.retain_graph and stage is not self._head_stage)
        if self._grad is None:  # its input has no graph, or the gradient is 0 from here down
            for earlier in self._stages:
                self.grads |= {n: torch.zeros_like(self.values[n].detach()) for n in earlier.names}
            self._stages.clear()

    def _through(self, stage: _Stage, grad: torch.Tensor | None, retain: bool) -> torch.Tensor | None:
        """By the chain rule from `grad`, ∂metric/∂(the piece's output) (None: zero): the gradients at the
        piece's wanted hook points, into `grads`, and at its input, returned (None where its input has no
        graph, or the gradient is 0)."""
        values = [self.values[n] for n in stage.names]
        inputs = values + ([stage.inp] if stage.inp is not None and stage.inp.requires_grad else [])
        got: list[torch.Tensor | None] = [None] * len(inputs)
        if grad is not None and stage.out.requires_grad and inputs:
            got = list(torch.autograd.grad(stage.out, inputs, grad, retain_graph=retain, allow_unused=True))
        for n, v, g in zip(stage.names, values, got, strict=False):  # `got` may end with the input's
            self.grads[n] = torch.zeros_like(v.detach()) if g is None else g.detach()
        below = got[-1] if len(inputs) > len(values) else None
        checked = [(at, g) for at, g in [*zip(stage.names, got, strict=False), ("its input", below)] if g is not None]
        if checked and not bool(torch.stack([g.isfinite().all() for _, g in checked]).all()):  # one sync a piece
            at, g = next((at, g) for at, g in checked if not bool(g.isfinite().all()))  # the numbers would mean nothing
            cause = "the edits took it there" if self.edited else f"the weights, or it left {dtype_range(g.dtype)}"
            raise MetricError(
                f"the gradient of {self.refusal.subject} became inf or NaN going back through {stage.piece}, "
                f"at {at}: {cause}",
                self._blamed,
            )
        return below


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """A piece's input: a leaf of a graph of its own where x has a graph, else x."""
    return x.detach().requires_grad_(True) if x.requires_grad else x


def gradient_pass(
    config: GPTConfig, ids: list[int], metric: Metric, names: list[str], edits: EditSpec | None = None
) -> MetricPass:
    """`gradients`' pass, its request checked first (an unknown hook point, a metric the prompt cannot give, a
    per-head input beside an edit of ln1's hooks: `check_split_inputs`), not run yet: the server runs each
    `step` as an engine job."""
    names = select_hooks(names, config.n_layer)
    check_ids(ids, config.vocab_size)  # a clear error, not an indexing one from deep in the pass
    check_metric(metric, len(ids), config.vocab_size)
    check_split_inputs(names, set(edits.sites(config.n_layer)) if edits is not None else set())
    return MetricPass(config, ids, metric, names, GRADIENTS, edits)


def gradients(model: GPT, ids: list[int], metric: Metric, names: list[str], edits: EditSpec | None = None) -> Gradients:
    """The metric of a run over `ids` (with `edits`: interventions, residual ablation) and its gradient at
    each hook point of `names` (exact names or globs, in model order; one that matches nothing is an
    `UnknownHookError`; `check_split_inputs` says what else is refused): `gradient_pass`'s pieces one after
    another. Builds a graph even where the caller runs under `torch.inference_mode` (the engine's thread);
    the parameters' `.grad` are left untouched. A run in which a LayerNorm's variance overflows is refused:
    it would give 0 for every gradient through that LayerNorm, with a finite metric."""
    run = gradient_pass(model.config, ids, metric, names, edits)
    while not run.done:
        run.step(model)
    return run.result()


# --- the highway -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerGradient:
    layer: int  # -1: the stream entering block 0 (embeddings); L: after block L (as `analyze` counts)
    grad_norm: float  # ‖∂loss/∂x_t‖ at this layer's stream, mean over the positions the loss reads
    jacobian_norm: float | None  # block L's ‖J‖_F / √(T·C), J = ∂resid_post/∂resid_pre; None for -1
    jacobian_identity_distance: float | None  # ‖J - I‖_F / √(T·C): 0 for a block that is the identity


class FrobeniusEstimate:
    """‖J‖_F / √n and ‖J - I‖_F / √n for J = ∂post/∂pre, n = pre.numel(), from vector-Jacobian products with
    probes u (`add`, one at a time): Hutchinson's estimator ‖J‖_F² = E‖Jᵀu‖² over probes with E[uuᵀ] = I
    (Rademacher signs: exact for the identity; or the n unit vectors times √n: exact for any J), and
    (J - I)ᵀu = Jᵀu - u from the same product. The root-mean-square gain of the map over directions: 1 for
    the identity."""

    def __init__(self) -> None:
        self.probes, self._jacobian, self._minus_identity = 0, 0.0, 0.0

    def add(self, post: torch.Tensor, pre: torch.Tensor, u: torch.Tensor, retain_graph: bool = True) -> None:
        (v,) = torch.autograd.grad(post, pre, u, retain_graph=retain_graph)
        self._jacobian += float(v.double().pow(2).sum())
        self._minus_identity += float((v - u).double().pow(2).sum())
        self.probes += 1

    def finite(self) -> bool:
        """Whether every product added so far was finite (a sum of squares past float64's is not, either)."""
        return math.isfinite(self._jacobian) and math.isfinite(self._minus_identity)

    def rms(self, n: int) -> tuple[float, float]:
        """(‖J‖_F / √n, ‖J - I‖_F / √n) over the probes added."""
        return math.sqrt(self._jacobian / self.probes / n), math.sqrt(self._minus_identity / self.probes / n)


def rademacher(
    k: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> Iterator[torch.Tensor]:
    """k random sign tensors of `shape`, one at a time (seeded: the same probes every run; a probe's memory
    at a time, however many are asked for)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(k):
        yield (torch.randint(0, 2, shape, generator=g) * 2 - 1).to(dtype=dtype, device=device)


HIGHWAY = Refusal("gradients", ": no gradient to measure", "the loss", "no gradient to measure")


class HighwayPass:
    """`highway` a piece at a time, each `step` an engine job on the server: the loss's `MetricPass` at every
    layer's stream (its graphs kept), then each block's probes, one vector-Jacobian product a step through
    that block's graph alone, which is let go of after its last."""

    def __init__(
        self, config: GPTConfig, ids: list[int], edits: EditSpec | None = None, probes: int = 8, seed: int = 0
    ) -> None:
        check_ids(ids, config.vocab_size)
        if not is_int(probes) or probes < 1:
            raise ValueError(f"probes must be an int >= 1 (vector-Jacobian products a block), got {clip(probes)}")
        if len(ids) < 2:
            raise MetricError(
                "the gradient highway needs a prompt of at least 2 tokens (the loss predicts the second)", "gradients"
            )
        L = config.n_layer
        self._pre = [f"blocks.{i}.hook_resid_pre" for i in range(L)]
        self._post = [f"blocks.{i}.hook_resid_post" for i in range(L)]
        wrt = [n for pair in zip(self._pre, self._post, strict=True) for n in pair]
        self._loss = MetricPass(config, ids, Loss(), wrt, HIGHWAY, edits, retain_graph=True, watch_every_position=True)
        self._probes, self._seed = probes, seed
        self._u: Iterator[torch.Tensor] | None = None  # the block's probes [1, T, C], the same for every block
        self._blocks = [FrobeniusEstimate() for _ in range(L)]
        self._block = 0  # the block whose probes run next

    @property
    def done(self) -> bool:
        return self._loss.done and self._block == len(self._blocks)

    def step(self, model: GPT) -> None:
        assert not self.done, "the pass is over"
        if not self._loss.done:
            self._loss.step(model)
            return
        pre, post = self._loss.values[self._pre[self._block]], self._loss.values[self._post[self._block]]
        estimate = self._blocks[self._block]
        last = estimate.probes == self._probes - 1
        with torch.inference_mode(False), torch.enable_grad():
            if estimate.probes == 0:
                self._u = rademacher(self._probes, tuple(pre.shape), pre.dtype, pre.device, self._seed)
            assert self._u is not None
            estimate.add(post, pre, next(self._u), retain_graph=not last)
        if not estimate.finite():
            edited = self._loss.edited
            reason = (
                "the edits took its vector-Jacobian products there"
                if edited
                else f"its vector-Jacobian products left {dtype_range(pre.dtype)}"
            )
            raise MetricError(
                f"the gradient highway became inf or NaN at block {self._block}'s Jacobian: {reason}",
                HIGHWAY.edits_param if edited else HIGHWAY.param,
            )
        if last:
            self._block += 1

    def result(self) -> list[LayerGradient]:
        assert self.done, "the pass is not over"
        grads = self._loss.grads

        def grad_norm(name: str) -> float:
            g = grads[name][0, :-1]  # [T-1, C]: the last position's stream predicts no token of the loss
            return float(g.double().norm(dim=-1).mean())

        n = self._loss.values[self._pre[0]].numel()
        out = [LayerGradient(-1, grad_norm(self._pre[0]), None, None)]
        for i, (name, estimate) in enumerate(zip(self._post, self._blocks, strict=True)):
            out.append(LayerGradient(i, grad_norm(name), *estimate.rms(n)))
        return out


def highway(
    model: GPT, ids: list[int], edits: EditSpec | None = None, probes: int = 8, seed: int = 0
) -> list[LayerGradient]:
    """The language-model loss's gradient at every layer's residual stream (one backward pass), and each
    block's Jacobian ∂resid_post/∂resid_pre over the whole sequence (positions mix in attention) as its RMS
    gain against the identity, from `probes` vector-Jacobian products (`HighwayPass`, its pieces one after
    another). With `edits` removing the residual connections, the same measures show the backward pass
    without the highway."""
    run = HighwayPass(model.config, ids, edits, probes, seed)
    while not run.done:
        run.step(model)
    return run.result()


# --- memory ------------------------------------------------------------------------------------


def graph_bytes(
    config: GPTConfig, n_tokens: int, dtype: torch.dtype, hooks: Iterable[str] = (), quantized: bool = False
) -> int:
    """An upper estimate of the memory a forward pass with a graph and its backward pass take, from the
    shapes: per block and position about 17 d_model-wide values saved for the backward pass (inputs of the
    four projections, q, k, v, the layer norms' inputs, GELU's input and output at 4 d_model) and two
    attention rows per head (scores and pattern), then the final layer norm and two vocabulary-wide rows
    (the logits and their log-softmax); a quarter more for the backward pass's own buffers. `hooks`, the
    hook points the run captures or edits: each per-head input they turn on (a block's queries', keys' or
    values' copy of the stream, TransformerLens' split inputs: `hook_attn_in` turns on all three) saves
    about n_head d_model-wide values a position more (its copy and the copy's LayerNorm), 1.5 counted.
    `quantized` (int8 weights): each product, forward and back, dequantizes its weight for a moment, one at a
    time; twice the widest's size in `dtype` is counted (the copy and the product's own buffers: the LM head's
    copy is 147 MiB on gpt2-small, and a 16-token pass peaked 253 MiB above its start)."""
    C, H, T = config.n_embd, config.n_head, n_tokens
    per_position = (
        config.n_layer * (17 * C + 2 * H * T) + 3 * C + 2 * config.vocab_size + 1.5 * H * C * _per_head_inputs(hooks)
    )
    widest_weight = max(config.vocab_size, config.d_mlp) * C if quantized else 0  # the LM head, or an MLP projection
    return int((1.25 * T * per_position + 2 * widest_weight) * torch.empty((), dtype=dtype).element_size())


def _per_head_inputs(hooks: Iterable[str]) -> int:
    """How many per-head input copies (a block's queries', keys' or values') the hook points `hooks` (exact
    names, not globs) turn on, over all the blocks."""
    paths: set[tuple[int | None, str]] = set()
    for name in hooks:
        site = name.rsplit(".", 1)[-1]
        if site in SPLIT_INPUTS:
            paths.update((layer_of(name), p) for p in "qkv" if site in ("hook_attn_in", f"hook_{p}_input"))
    return len(paths)


def grad_name(name: str) -> str:
    """TransformerLens' cache key for the gradient at hook `name`."""
    return name + "_grad"
