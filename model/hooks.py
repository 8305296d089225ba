"""Named hook points and per-call activation capture.

Hook points are identity modules placed where a value is born, named as in TransformerLens
(`blocks.3.attn.hook_pattern`), so dumps line up with the interpretability ecosystem. The model keeps no
capture state of its own: whoever wants activations passes a `Hooks` object with the forward call, so
requests served concurrently by one model never see each other's captures, and nothing is left behind.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from .config import GPTConfig
    from .gpt import GPT


class Hooks(Protocol):
    """What a forward pass hands each hook point's value to."""

    def active(self, name: str) -> bool:
        """Whether `name` is of interest: the model computes what only a hook reads where one is (the explicit
        attention's scores and pattern, the per-head inputs and `hook_result`, the LayerNorm's scale, the LM
        head's rows)."""
        ...

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Receive the value at hook point `name`; return the value the forward pass continues with."""
        ...


class HookPoint(nn.Module):
    """Identity at a named site of the network."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor, hooks: Hooks | None) -> torch.Tensor:
        return x if hooks is None else hooks(self.name, x)

    def extra_repr(self) -> str:
        return repr(self.name)


class UnknownHookError(ValueError):
    """A requested hook name or pattern matches no hook point of the model."""


# The hooks of one block, in the order the forward pass reaches them. Those marked optional are what
# TransformerLens' config switches on (`use_attn_in`, `use_split_qkv_input`, `use_attn_result`,
# `use_hook_mlp_in`): they cost a per-head copy of the stream (or of each head's output), so they are
# computed only when asked for by name, and globs match them only when they spell the site out.
_BLOCK_SITES: list[tuple[str, bool]] = [  # (site, optional)
    ("hook_resid_pre", False),
    ("hook_attn_in", True),
    ("hook_q_input", True),
    ("hook_k_input", True),
    ("hook_v_input", True),
    ("ln1.hook_scale", False),
    ("ln1.hook_normalized", False),
    ("attn.hook_q", False),
    ("attn.hook_k", False),
    ("attn.hook_v", False),
    ("attn.hook_attn_scores", False),
    ("attn.hook_pattern", False),
    ("attn.hook_z", False),
    ("attn.hook_result", True),
    ("hook_attn_out", False),
    ("hook_resid_mid", False),
    ("hook_mlp_in", True),
    ("ln2.hook_scale", False),
    ("ln2.hook_normalized", False),
    ("mlp.hook_pre", False),
    ("mlp.hook_post", False),
    ("hook_mlp_out", False),
    ("hook_resid_post", False),
]
_FIRST = ["hook_embed", "hook_pos_embed"]
_LAST = ["ln_final.hook_scale", "ln_final.hook_normalized", "unembed.hook_in", "unembed.hook_out", "logits"]
OPTIONAL_SITES = tuple(site for site, optional in _BLOCK_SITES if optional)
HEAD_HOOKS = tuple(_LAST)  # after the last block: the final LayerNorm runs over every position they cover
LOGIT_HOOKS = ("unembed.hook_out", "logits")  # the LM head's output


@functools.lru_cache(maxsize=4096)  # asked for every hook a glob of a thousand edits matches
def layer_of(name: str) -> int | None:
    """The block a hook point is in (`blocks.5.attn.hook_z`: 5); None for those before or after the blocks."""
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def uses_the_head(hooks: Hooks | None) -> bool:
    """Whether `hooks` ask for or edit a hook point after the last block: then the final LayerNorm runs over
    every position, not only those whose logits are needed (and the LM head's product too, if
    `uses_the_logits`)."""
    return hooks is not None and any(hooks.active(name) for name in HEAD_HOOKS)


def uses_the_logits(hooks: Hooks | None) -> bool:
    """Whether `hooks` ask for or edit the LM head's output (`unembed.hook_out`, `logits`): then it runs over
    every position, not only those whose logits are needed (for `ln_final.*` and `unembed.hook_in`, the
    final LayerNorm does; the head's product, the costly part, need not)."""
    return hooks is not None and any(hooks.active(name) for name in LOGIT_HOOKS)


HEAD_POSITIONS = 256  # positions of the LM head a step: about a block's time over 1,024 positions of gpt2-small


def head_parts(n_pos: int, hooks: Hooks | None) -> list[range]:
    """The positions the LM head runs over after a pass's last block, a part a step (a job on the server):
    where the hooks use its output at every position (`uses_the_logits`), `HEAD_POSITIONS` a part, in order,
    as they see a prompt's chunks, or in one part where they need the whole prompt at once (a `mean`); else
    one part (the product at the positions whose logits are wanted only: `GPT.unembed`'s `rows`)."""
    if hooks is None or not uses_the_logits(hooks) or needs_whole_prompt(hooks):
        return [range(n_pos)]
    return [range(i, min(i + HEAD_POSITIONS, n_pos)) for i in range(0, n_pos, HEAD_POSITIONS)]


def needs_whole_prompt(hooks: Hooks) -> bool:
    """Whether `hooks` must see a prompt in one pass: they say so as `whole_prompt` (an edit such as `mean`,
    which takes its mean over the prompt's positions, does); hooks that do not say are taken to. Others see a
    long prompt in chunks, a pass each, as they see the tokens generated after it."""
    return bool(getattr(hooks, "whole_prompt", True))


def hook_names(n_layer: int, optional: bool = True) -> list[str]:
    """Every hook point of a GPT-2 with `n_layer` blocks, in the order the forward pass reaches them
    (without the optional ones if not `optional`)."""
    sites = [site for site, opt in _BLOCK_SITES if optional or not opt]
    return [*_FIRST, *(f"blocks.{layer}.{site}" for layer in range(n_layer) for site in sites), *_LAST]


def is_optional(name: str) -> bool:
    return name.endswith(OPTIONAL_SITES)


def describe_hook_names(n_layer: int | None) -> str:
    """The valid names in a compact form, for error messages (`n_layer` None: of any depth, L for a block)."""
    layers = "L" if n_layer is None else f"{{0..{n_layer - 1}}}"
    return ", ".join([*_FIRST, *(f"blocks.{layers}.{site}" for site, _ in _BLOCK_SITES), *_LAST])


@functools.lru_cache(maxsize=4096)  # a request may repeat a pattern a thousand times: each is matched once
def match_hooks(pattern: str, n_layer: int) -> tuple[str, ...]:
    """The hook names an exact name or a glob (`blocks.*.hook_resid_post`, `*`) stands for, in model order.
    A glob matches an optional hook only if it spells its site out (`blocks.*.attn.hook_result`)."""
    if not is_glob(pattern):
        return (pattern,) if pattern in _hook_name_set(n_layer) else ()
    return tuple(
        n
        for n in hook_names(n_layer)
        if fnmatch.fnmatchcase(n, pattern) and (not is_optional(n) or n.rsplit(".", 1)[-1] in pattern)
    )


@functools.lru_cache(maxsize=64)
def _hook_name_set(n_layer: int) -> frozenset[str]:
    return frozenset(hook_names(n_layer))


def select_hooks(patterns: str | Sequence[str], n_layer: int) -> list[str]:
    """Expand exact names and glob patterns into hook names, in model order (see `match_hooks`).

    A pattern that matches nothing is an error naming it and listing the valid names. One string is one
    pattern (not a list of its characters).
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise UnknownHookError("no hook names given: name at least one hook point or glob (`*`: every default one)")
    chosen: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise UnknownHookError(f"hook names must be non-empty strings, got {pattern!r}")
        matched = match_hooks(pattern, n_layer)
        if not matched:
            raise UnknownHookError(_no_match(pattern, n_layer))
        chosen.update(matched)
    return [n for n in hook_names(n_layer) if n in chosen]


def _no_match(pattern: str, n_layer: int) -> str:
    """Why `pattern` selects nothing, in words: a glob that matches only optional hook points, or no name."""
    optional = [n for n in hook_names(n_layer) if is_optional(n) and fnmatch.fnmatchcase(n, pattern)]
    if is_glob(pattern) and optional:
        site = optional[0].split(".", 2)[-1]  # blocks.0.attn.hook_result: attn.hook_result
        return (
            f"the glob {pattern!r} matches only optional hook points ({optional[0]}, ...), which a glob selects "
            f"only when it spells their site out (e.g. 'blocks.*.{site}')"
        )
    return f"unknown hook {pattern!r}: no hook point matches it; valid names are {describe_hook_names(n_layer)}"


_PER_HEAD_D_HEAD = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z")
# a block's per-head copies of the stream for its queries, keys and values (TransformerLens' split inputs;
# `hook_attn_in` is all three at once)
SPLIT_INPUTS = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")
_PER_HEAD_D_MODEL = (*SPLIT_INPUTS, "attn.hook_result")
_PER_HEAD = _PER_HEAD_D_HEAD + _PER_HEAD_D_MODEL


def site_shape(name: str, n_head: int, d_head: int, d_mlp: int, vocab_size: int) -> tuple[int, ...]:
    """The shape of one position's value at hook `name`, without batch and position (for attention
    squares, [batch, head, query, key], just the head: the rest depends on the sequence)."""
    d_model = n_head * d_head
    if is_attention_square(name):
        return (n_head,)
    if name.endswith(_PER_HEAD_D_HEAD):
        return (n_head, d_head)
    if name.endswith(_PER_HEAD_D_MODEL):
        return (n_head, d_model)
    if name.endswith("hook_scale"):
        return (1,)
    if name.endswith(("mlp.hook_pre", "mlp.hook_post")):
        return (d_mlp,)
    if name in ("logits", "unembed.hook_out"):
        return (vocab_size,)
    return (d_model,)


@functools.lru_cache(maxsize=4096)  # asked for every hook a glob of a thousand edits matches
def is_per_head(name: str) -> bool:
    """Hooks shaped [batch, pos, head, ...]."""
    return name.endswith(_PER_HEAD)


def is_hook_z(name: str) -> bool:
    """`blocks.L.attn.hook_z`: the heads' values [head, d_head] a position, before the output projection."""
    return name.endswith("attn.hook_z")


def reads_as_one_vector(name: str) -> bool:
    """Hooks that steering, SAEs and steering vectors read as one vector per position: those that hold one
    (the residual stream, attn_out, mlp_out, mlp.hook_post, ...; not other per-head values, attention squares
    or a LayerNorm's scale), and `attn.hook_z`, whose heads' values [head, d_head] they read as one vector of
    n_head x d_head numbers, head after head, as SAELens reads it for its attention SAEs (Kissane et al. 2024,
    "Interpreting Attention Layer Outputs with Sparse Autoencoders")."""
    if is_hook_z(name):
        return True
    return not (is_attention_square(name) or is_per_head(name) or name.endswith("hook_scale"))


def as_vectors(name: str, x: torch.Tensor) -> torch.Tensor:
    """Values x [..., *site] at hook `name` (`reads_as_one_vector`) as one vector each, [..., d]: at
    `attn.hook_z` the heads flattened, [..., head, d_head] -> [..., head x d_head] (a view where x allows)."""
    return x.flatten(-2) if is_hook_z(name) else x


_SITES = frozenset(site for site, _ in _BLOCK_SITES)


_LAYER = re.compile(r"0|[1-9][0-9]*")  # a layer as hook names spell it: ASCII digits, no leading zero


def check_hook_name(name: object) -> None:
    """Raise `UnknownHookError` unless `name` is a hook point of a GPT-2 of some depth: an exact name, not a
    glob (which would match no name as such)."""
    if not isinstance(name, str) or not name:
        raise UnknownHookError(f"hook names must be non-empty strings, got {name!r}")
    if is_glob(name):
        raise UnknownHookError(
            f"{name!r} is a pattern; Capture takes exact names: expand it with select_hooks(patterns, n_layer)"
        )
    layer, _, site = name.removeprefix("blocks.").partition(".")
    in_block = name.startswith("blocks.") and _LAYER.fullmatch(layer) is not None and site in _SITES
    if name not in (*_FIRST, *_LAST) and not in_block:
        raise UnknownHookError(
            f"unknown hook {name!r}: no hook point is named so; valid names are {describe_hook_names(None)}"
        )


def is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


@functools.lru_cache(maxsize=4096)
def is_attention_square(name: str) -> bool:
    """Hooks shaped [batch, head, query_pos, key_pos]: their masked future is filled in when assembled."""
    return name.endswith(("hook_attn_scores", "hook_pattern"))


class Capture:
    """Records the values of chosen hook points, across one or several forward passes.

    Generation with a KV cache runs the prompt, then one token at a time; each pass adds a chunk of
    positions. `tensors()` glues the chunks together so that the result equals one forward pass over the
    whole sequence: [batch, pos, ...] chunks are concatenated along `pos`; attention scores and patterns
    [batch, head, q, k] are widened to the full key length (scores with -inf, patterns with 0, the values
    the causal mask gives) and concatenated along `q`. Chunks must come from one sequence in order.
    """

    def __init__(self, names: str | list[str] | tuple[str, ...], dtype: torch.dtype | None = None) -> None:
        """`names`: exact hook names (`select_hooks(patterns, n_layer)` expands globs and checks the layers
        against a model). A glob or a name no GPT-2 has is refused here: it would capture nothing. `dtype`:
        the values are kept in it, each cast as it is captured (a float16 dump of a float32 model is never
        held in float32 first); None keeps them as the model computes them."""
        if isinstance(names, str):  # one name, not its characters
            names = [names]
        for name in names:
            check_hook_name(name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"a capture's dtype is a floating torch dtype (torch.float16, ...), got {dtype!r}")
        self.names, self.dtype = list(names), dtype
        self._wanted = frozenset(self.names)
        self._chunks: dict[str, list[torch.Tensor]] = {n: [] for n in self.names}

    whole_prompt = False  # chunks are glued together (`tensors`)

    def begin_pass(self, from_start: bool) -> None:
        """Called by `GPT.forward` before a pass: one `from_start` (position 0, no cache or an empty one)
        begins a sequence, so a capture that holds values of an earlier one is refused (its chunks would be
        glued to the new pass's as if one sequence went on: a [1, 7, C] stream of two prompts of 3 and 4)."""
        if from_start and any(self._chunks.values()):
            raise ValueError(
                "this Capture holds the values of an earlier forward pass, and this pass starts a new sequence "
                "(position 0): use a new Capture for each sequence (a Capture glues the passes of one sequence, "
                "a prompt and its decode steps, into one tensor)"
            )

    def active(self, name: str) -> bool:
        return name in self._wanted

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self._wanted:
            chunk = x.detach()
            if self.dtype is not None and chunk.dtype != self.dtype:
                chunk = chunk.to(self.dtype)  # a tensor of its own, its size
            elif chunk.untyped_storage().nbytes() > chunk.numel() * chunk.element_size():
                chunk = chunk.clone()  # one sequence's part of a batch: keep it, not the whole batch's tensor
            self._chunks[name].append(chunk)
        return x

    def tensors(self) -> dict[str, torch.Tensor]:
        """The values so far, each a tensor over every position captured. Each hook's chunks are joined
        into one, which replaces them (a dump of hundreds of megabytes is held once, not twice): a second call
        gives the same tensors, and a value captured in one chunk is the tensor the hook saw (two hook points
        may hold one tensor, blocks.0.hook_resid_post and blocks.1.hook_resid_pre), not a copy, unless the
        pass ran in inference mode and this call does not: then a copy that autograd can use (a probe trained
        on it), as a joined value is."""
        out: dict[str, torch.Tensor] = {}
        copies: dict[tuple, torch.Tensor] = {}  # a value two hook points hold (one memory, one view): copied once
        for name, chunks in self._chunks.items():
            if not chunks:
                continue
            if len(chunks) > 1:
                chunks[:] = [_join(name, chunks)]
            elif chunks[0].is_inference() and not torch.is_inference_mode_enabled():
                t = chunks[0]  # a pass run in inference mode: a copy that autograd can use
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                if key not in copies:
                    copies[key] = t.clone()
                chunks[:] = [copies[key]]
            out[name] = chunks[0]
        return out


def _join(name: str, chunks: list[torch.Tensor]) -> torch.Tensor:
    """One hook's chunks as one tensor over their positions, each chunk let go of once it is copied in (so a
    dump is not held twice): [batch, pos, ...] along pos; attention squares [batch, head, q, k] along q,
    each chunk widened to the last one's keys first (scores with -inf, patterns with 0: what the causal mask
    gives)."""
    square = is_attention_square(name)
    dim = 2 if square else 1
    last = chunks[-1]
    shape = list(last.shape)
    shape[dim] = sum(c.shape[dim] for c in chunks)
    joined = last.new_empty(shape)
    fill = float("-inf") if name.endswith("hook_attn_scores") else 0.0
    start = 0
    while chunks:
        chunk = chunks.pop(0)
        if square:
            chunk = _widen(chunk, last.shape[-1], fill)
        joined.narrow(dim, start, chunk.shape[dim]).copy_(chunk)
        start += chunk.shape[dim]
    return joined


Index = tuple[int | slice, ...]


class RowHooks:
    """Several sequences' own `Hooks` over one batched forward pass: each is handed only its own part of a
    value, as it would see it running alone ([1, its positions, ...]), and what it returns goes back in
    that part (into a copy: the batch's tensor itself is never written). `parts` index values shaped
    [batch, pos, ...]; `square_parts`, attention squares [batch, head, query, key] (a row's own keys
    only: the others' lie past its length); `head_parts`, the values after the LM head's choice of
    outputs (`ln_final.*`, `unembed.*`, `logits`), where those differ from `parts`."""

    def __init__(
        self,
        parts: list[tuple[Hooks, Index]],
        square_parts: list[tuple[Hooks, Index]] | None = None,
        head_parts: list[tuple[Hooks, Index]] | None = None,
    ) -> None:
        self.parts = parts
        self.square_parts = square_parts if square_parts is not None else []
        self.head_parts = head_parts if head_parts is not None else parts
        self._active: dict[str, bool] = {}

    def active(self, name: str) -> bool:
        if name not in self._active:
            self._active[name] = any(h.active(name) for h, _ in self._parts_of(name))
        return self._active[name]

    def _parts_of(self, name: str) -> list[tuple[Hooks, Index]]:
        if is_attention_square(name):
            return self.square_parts
        return self.head_parts if name in HEAD_HOOKS else self.parts

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if not self.active(name):
            return x
        out = x
        for hooks, index in self._parts_of(name):
            if not hooks.active(name):
                continue
            part = x[index]
            new = hooks(name, part)
            if new is not part:
                if out is x:
                    out = x.clone()
                out[index] = new
        return out


class StopForward(Exception):
    """Ends a forward pass early: every value wanted from it has been taken."""


def begin_pass(hooks: object, from_start: bool) -> None:
    """Tell `hooks`, and the hooks they hand values on to (`inner`), that a forward pass begins
    (`Capture.begin_pass`): one from position 0 begins a sequence."""
    begin = getattr(hooks, "begin_pass", None)
    if begin is not None:
        begin(from_start)
    for inner in getattr(hooks, "inner", ()):
        begin_pass(inner, from_start)


class StopAfter:
    """Hands each value on to `hooks`, then ends the forward pass (`StopForward`) once hook `last` has had
    its value: what TransformerLens' `stop_at_layer` and nnsight's `.stop()` do. For a plain pass over a
    batch (a packed pass reaches the attention hooks once per piece)."""

    def __init__(self, hooks: Hooks, last: str) -> None:
        self.hooks, self.last = hooks, last

    @property
    def inner(self) -> tuple[Hooks, ...]:
        return (self.hooks,)

    def active(self, name: str) -> bool:
        return self.hooks.active(name)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        x = self.hooks(name, x)
        if name == self.last:
            raise StopForward
        return x


def run_with_cache(
    model: GPT, idx: torch.Tensor | list[int], names: list[str], edits: Hooks | None = None
) -> dict[str, torch.Tensor]:
    """The values at hook points `names` (exact names or globs, as `select_hooks` takes them: an unknown one
    is an error) for token ids `idx` [B, T] (or a list of ids: one sequence), each [B, T, ...] (attention
    squares [B, head, T, T]), from one forward pass that ends as soon as the last of them in model order is
    taken: the blocks after it and the LM head never run. `edits` (interventions) see and change the
    values first. `CapturePass`'s pieces one after another."""
    run = CapturePass(model.config, idx, names, edits)
    while not run.done:
        run.step(model)
    return run.tensors()


class BlockwisePass:
    """A forward pass without a cache over token ids `idx` [B, T] (or rows of ids, made a tensor on the
    model's device at the first step), a piece a `step`, so that a server runs other work between them: the
    embeddings with block 0, then each block, then the LM head, until `hooks` end it (`StopAfter`: the last
    hook point wanted has its value). The head runs over its positions a part a step where the hooks use its
    output at every position (`head_parts`), or in one part (`head_in_parts` False: hooks that index the
    positions of the whole pass, `RowHooks`)."""

    def __init__(self, idx: torch.Tensor | list[list[int]], hooks: StopAfter, head_in_parts: bool = True) -> None:
        self.idx, self.hooks, self.head_in_parts = idx, hooks, head_in_parts
        self._blocks: Iterator[torch.Tensor] | None = None  # `GPT.block_by_block`, from the first step on
        self._x: torch.Tensor | None = None  # [B, T, C]: the stream leaving the last block run
        self._parts: list[range] | None = None  # the head's positions, a step each, once the blocks are run
        self.done = False

    @torch.no_grad()
    def step(self, model: GPT) -> bool:
        """The next piece; whether it was the LM head's (a part of it). An error from the pass (an edit that
        cannot be applied, say) is raised."""
        assert not self.done, "the pass is over"
        head = False
        try:
            if self._blocks is None:
                idx = self.idx
                if not isinstance(idx, torch.Tensor):
                    idx = torch.tensor(idx, device=model.wte.weight.device)  # [B, T]
                self._blocks = model.block_by_block(idx, self.hooks)
            if self._parts is None:
                x = next(self._blocks, None)
                if x is not None:
                    self._x = x
                    return head
                assert self._x is not None
                T = self._x.shape[1]
                self._parts = head_parts(T, self.hooks.hooks) if self.head_in_parts else [range(T)]
            head, rows, x = True, self._parts.pop(0), self._x
            assert x is not None
            model.unembed(x[:, rows.start : rows.stop], self.hooks)
        except StopForward:  # the last value wanted is in (of a part of the head: then the next part's turn)
            pass
        if not self._parts:  # in the blocks, or after the head's last part: the end
            self.done, self._x, self._blocks = True, None, None
        return head


class CapturePass(BlockwisePass):
    """`run_with_cache` a piece at a time, each `step` an engine job on the server, decode steps going on
    between them (`BlockwisePass`), until the last hook point asked for has its value."""

    def __init__(
        self, config: GPTConfig, idx: torch.Tensor | list[int], names: list[str], edits: Hooks | None = None
    ) -> None:
        from .interventions import HookChain  # interventions imports this module

        names = select_hooks(names, config.n_layer)  # in model order: the pass ends at the last
        check_ids(idx, config.vocab_size)
        check_edit_hooks(edits)
        self._capture = Capture(names)
        wanted: Hooks = self._capture if edits is None else HookChain(edits, self._capture)
        super().__init__(idx if isinstance(idx, torch.Tensor) else [list(idx)], StopAfter(wanted, names[-1]))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The values captured, as `Capture.tensors` gives them."""
        assert self.done, "the pass is not over"
        return self._capture.tensors()


def check_ids(idx: torch.Tensor | list[int], vocab_size: int) -> None:
    """Token ids [B, T] (or one sequence's list) of at least one position, each in the vocabulary: else a
    `ValueError` that says which (not an indexing error from deep in the pass)."""
    if isinstance(idx, torch.Tensor):
        if idx.dim() != 2 or idx.numel() == 0 or idx.dtype not in (torch.int64, torch.int32):  # the embedding's
            raise ValueError(
                "token ids must be integers (int64 or int32: convert others with .long()) shaped [batch, pos], not "
                f"empty; got {idx.dtype} {list(idx.shape)}"
            )
        low, high = int(idx.min()), int(idx.max())
    else:
        ids = list(idx)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"token ids must be a non-empty list of ints; got {ids[:8]!r}")
        low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary (0..{vocab_size - 1})")


def check_edit_hooks(edits: object) -> None:
    """Hooks (`EditSpec.hooks(config, n_tokens)`, a `Capture`, ...) or None: else a `TypeError` that says how
    to get them (an `EditSpec` as it is failed deep in the pass: "'EditSpec' object is not callable")."""
    if edits is not None and not callable(getattr(edits, "active", None)):
        raise TypeError(f"edits are hooks (EditSpec.hooks(config, n_tokens)), got {type(edits).__name__}")


def _widen(chunk: torch.Tensor, n_keys: int, fill: float) -> torch.Tensor:
    missing = n_keys - chunk.shape[-1]
    if missing == 0:
        return chunk
    pad = chunk.new_full((*chunk.shape[:-1], missing), fill)
    return torch.cat([chunk, pad], dim=-1)
