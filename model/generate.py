"""Autoregressive generation with a KV cache: prefill, one-token decode steps, stop conditions.

Each prompt is prefilled into its row of a shared cache, then all unfinished rows decode together, one
token per step, in the same forward passes as the prompts of rows that joined later; a finished row
leaves the batch. Every sequence keeps its own sampling settings and random generator, so a row's tokens
do not depend on what else is in the batch, up to the last bits of float32's products, which sum in another
order for another number of rows (README, "Concurrency": a greedy token then changes only at a near tie, a
seeded sample where its draw falls within about 1e-6 of the edge between two tokens). Iterating a
`Generation` yields a `TokenEvent` per token as it is produced; `generate` runs one to the end.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import numbers
import operator
import re
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import GPTConfig
from .cuda_graph import StaticDecode
from .gpt import GPT
from .hooks import (
    HEAD_HOOKS,
    LOGIT_HOOKS,
    BlockwisePass,
    Capture,
    Hooks,
    Index,
    RowHooks,
    StopAfter,
    hook_names,
    layer_of,
    needs_whole_prompt,
    select_hooks,
    uses_the_head,
    uses_the_logits,
)
from .interventions import EditSpec, HookChain
from .json_file import clip, is_int
from .kernels.decode import FusedDecode
from .kv_cache import KVCache, PackedBatch
from .overflow import dtype_range
from .sampling import Penalties, sample, top_logprobs
from .tokenizer import EOT_ID, Detokenizer, Tokenizer

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20
SEED_RANGE = range(-(2**63), 2**63)  # an int64, as torch's generators take it (and vLLM accepts)
MAX_STOPS = 16  # stop strings per request: each is looked for after every token
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256  # stop token ids per request: each new token is looked up among them
MAX_BIAS = 100.0  # a logit bias' magnitude, as OpenAI bounds it (-100 all but bans a token, 100 all but forces it)
MAX_PENALTY = 2.0  # presence and frequency penalties' magnitude, as OpenAI bounds them
SHARED_PREFIX_MIN = 16  # prompt tokens in common with a sequence in the batch, from which a joining one copies them


class GenerationError(ValueError):
    """A request that cannot be generated; `param` names the offending argument."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(GenerationError):
    """A prompt, or a prompt with the tokens asked for after it, longer than the model's context."""


@dataclass(frozen=True)
class SamplingParams:
    """How to continue a prompt: how many tokens, how to choose each (biases and penalties on the logits,
    then temperature, min-p, top-k, top-p, a seed: `model.sampling`), when to stop (a stop string, a stop
    token, end of text unless `ignore_eos`), and which log-probabilities to give (the model's own, before any
    of the choosing: vLLM's default). Checked when made: a bad value is a `GenerationError` naming the field."""

    max_new_tokens: int = 32
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit (-1 too, as vLLM's clients send it)
    top_p: float = 1.0  # 1 = no limit
    min_p: float = 0.0  # 0 = no limit
    seed: int | None = None  # None = a fresh random seed
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)  # token id -> added to its logit
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages the prompt's and the generated tokens
    presence_penalty: float = 0.0  # 0 = off; in [-2, 2]: subtracted once from each generated token's logit
    frequency_penalty: float = 0.0  # 0 = off; in [-2, 2]: subtracted per time a token was generated
    adjusts_logits: bool = field(init=False, repr=False, compare=False)  # a bias or a penalty is on
    bias_end: int = field(init=False, repr=False, compare=False)  # 1 + the largest id biased (0: none)
    stop: tuple[str, ...] = ()  # stop strings; the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # per generated token: its log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise GenerationError(f"{param} {message}, got {clip(getattr(self, param))}", param)

        numeric = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "prompt_logprobs")
        penalties = ("repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in numeric + penalties:
            object.__setattr__(self, name, _python_number(getattr(self, name)))  # numpy's numbers as Python's

        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens", "must be an integer >= 0")
        check(
            _is_num(self.temperature) and 0 <= self.temperature < math.inf,
            "temperature",
            "must be a finite number >= 0",
        )
        check(is_int(self.top_k) and self.top_k >= -1, "top_k", "must be an integer >= -1 (0 or -1: no limit)")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        check(_is_num(self.top_p) and 0 <= self.top_p <= 1, "top_p", "must be a number in [0, 1]")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be a number in [0, 1]")
        check(
            _is_num(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            "must be a finite number > 0 (1: off)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(
                _is_num(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                name,
                f"must be a number in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}]",
            )
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))
        off = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) == (1.0, 0.0, 0.0)
        object.__setattr__(self, "adjusts_logits", any(self.logit_bias.values()) or not off)
        object.__setattr__(self, "bias_end", max(self.logit_bias, default=-1) + 1)
        check(
            self.seed is None or (is_int(self.seed) and self.seed in SEED_RANGE),
            "seed",
            f"must be an integer in {SEED_RANGE.start}..{SEED_RANGE.stop - 1} (an int64)",
        )
        for name in ("stop", "stop_token_ids"):  # one string or id: one stop (a string is not its characters)
            value = getattr(self, name)
            if type(value).__name__ == "ndarray":  # numpy's ids, as a list
                value = value.tolist()
            value = _python_number(value)  # one numpy id: Python's
            if isinstance(value, (str, int)):
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            elif not isinstance(value, tuple):
                raise GenerationError(f"{name} must be a list or tuple, got {type(value).__name__}", name)
        # Stop strings are looked for after every token, so their number and length are bounded (checked
        # first, so that no message repeats a huge value).
        if len(self.stop) > MAX_STOPS:
            raise GenerationError(f"stop must hold at most {MAX_STOPS} strings, got {len(self.stop)}", "stop")
        longest = max((len(s) for s in self.stop if isinstance(s, str)), default=0)
        if longest > MAX_STOP_CHARS:
            raise GenerationError(
                f"stop strings must be at most {MAX_STOP_CHARS} characters each, got one of {longest}", "stop"
            )
        for i, s in enumerate(self.stop):  # which one, of up to MAX_STOPS
            if not (isinstance(s, str) and s):
                raise GenerationError(f"stop[{i}] must be a non-empty string, got {clip(s)}", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise GenerationError(
                f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
                "stop_token_ids",
            )
        object.__setattr__(self, "stop_token_ids", tuple(map(_python_number, self.stop_token_ids)))
        check(all(is_int(t) for t in self.stop_token_ids), "stop_token_ids", "must be integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name, f"must be in 0..{MAX_LOGPROBS}"
            )

    def varied(self, max_new_tokens: int, seed: int | None) -> SamplingParams:
        """These settings with another length and seed (checked), the others not checked again: a request's
        samples share them (a logit bias over the whole vocabulary took 60 ms a sample to parse and check)."""
        checked = SamplingParams(max_new_tokens=max_new_tokens, seed=seed)
        new = copy.copy(self)
        object.__setattr__(new, "max_new_tokens", checked.max_new_tokens)
        object.__setattr__(new, "seed", checked.seed)
        return new


def logit_bias_by_id(pairs: Iterable[tuple[str, float]]) -> dict[int, float]:
    """A logit bias written with its token ids as text, as JSON keys and `--logit-bias 50256=-100` write them,
    with the ids as integers: each a decimal integer (no `+`, no space, no other script's digits), none named
    twice (`"011"` and `"11"`). The values are `SamplingParams`' to check."""
    out: dict[int, float] = {}
    for text, value in pairs:
        if not re.fullmatch(r"-?[0-9]+", text):
            raise GenerationError(f"logit_bias: a token id must be a decimal integer, got {clip(text)}", "logit_bias")
        digits = text.lstrip("-").lstrip("0") or "0"  # (leading zeros are fine: "007" is 7)
        if len(digits) > 19:  # (and int() refuses more than 4,300 digits)
            raise GenerationError(f"logit_bias: token id {clip(text)} is past any vocabulary", "logit_bias")
        token = -int(digits) if text.startswith("-") else int(digits)
        if token in out:
            raise GenerationError(f"logit_bias: token {token} is given twice", "logit_bias")
        out[token] = value
    return out


def _checked_bias(bias: Any) -> dict[int, float]:
    """A logit bias {token id: bias} as a copy of its own, checked: each id an integer >= 0 (the vocabulary is
    the model's to check: `new_sequence`), each bias a number in [-100, 100]."""
    if not isinstance(bias, Mapping):
        raise GenerationError(f"logit_bias must map token ids to biases, got {type(bias).__name__}", "logit_bias")
    out: dict[int, float] = {}
    for token, value in bias.items():
        token, value = _python_number(token), _python_number(value)
        if not (is_int(token) and token >= 0):
            raise GenerationError(f"logit_bias: a token id must be an integer >= 0, got {clip(token)}", "logit_bias")
        if not (_is_num(value) and -MAX_BIAS <= value <= MAX_BIAS):
            raise GenerationError(
                f"logit_bias: the bias of token {token} must be a number in [{-MAX_BIAS:g}, {MAX_BIAS:g}], "
                f"got {clip(value)}",
                "logit_bias",
            )
        out[token] = float(value)
    return out


def _python_number(x: Any) -> Any:
    """A numpy (or other) integer or real as Python's int or float; anything else as it is, to be checked."""
    if isinstance(x, (bool, int)) or type(x) is float or not isinstance(x, numbers.Real):
        return x  # (numpy's bool is no number: refused as it is)
    return int(x) if isinstance(x, numbers.Integral) else float(x)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


@dataclass(frozen=True)
class TokenLogprob:
    id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, (id, logprob), most likely first


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of sequence `index`: its id, the text it adds (held back while it may still
    turn into a stop string or an unfinished character) and, if asked for, its log-probability."""

    index: int
    token_id: int
    text: str
    logprob: TokenLogprob | None
    finish_reason: str | None  # on the last token: "length", "stop" or "eos"


@dataclass
class Completion:
    """One prompt's result: its ids and the generated ones, their text (cut before a stop string), why it
    ended ("length", "stop" or "eos"), the log-probabilities asked for, and the activations captured (each
    [1, pos, ...] over prompt and continuation, as one forward pass over both gives them)."""

    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None for the first prompt token
    activations: dict[str, torch.Tensor] | None = None


@dataclass
class SequenceState:
    """One prompt being continued: its settings, random generator, tokens so far, text and stop state."""

    index: int
    prompt: list[int]
    params: SamplingParams
    tokenizer: Tokenizer | None
    eos_id: int
    generator: torch.Generator
    capture: Capture | None = None  # activations wanted for this sequence
    hooks: Hooks | None = None  # what the forward passes hand hook values to: edits, then the capture
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None for the first prompt token
    prefilled: int = 0  # prompt tokens in the KV cache
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    _text: Detokenizer | None = None  # makes `text`, a token at a time, once the first is decoded
    finish_reason: str | None = None  # "error" when it failed alone (`error`)
    error: Exception | None = None
    # sequences may copy each other's prompt prefixes only within one group (a server's request: its prompts and
    # their samples), so that no client's prompt is read, or timed, by another's; None: one group of all
    group: int | None = None
    _words: int | None = None  # `words`, once known
    _penalized: Penalties | None = None  # its bias and penalties, if any, once its first token is chosen

    @property
    def prompt_only(self) -> bool:
        """Nothing to generate and no logits wanted: only the prompt's activations (`prefill_prompts`, where its
        pass is cheap enough; else the batch, a chunk a step)."""
        return self.params.max_new_tokens == 0 and self.params.prompt_logprobs is None

    def accept(self, logits: torch.Tensor, argmax: int | None = None) -> TokenEvent:
        """Choose the next token from `logits` [vocab] (float32; `argmax`: its argmax, if already known) and
        update text and stop state. Where the model's vocabulary is padded past its tokenizer's, only the
        tokenizer's ids are chosen from (and their log-probabilities normalised over them), as vLLM does. The
        log-probabilities given are of `logits` as they come, before biases and penalties."""
        p = self.params
        words = self.words(len(logits))
        if words < len(logits):  # a vocabulary padded past the tokenizer's (nanoGPT's 50304): ids with no text
            logits = logits[:words]
            argmax = argmax if argmax is not None and argmax < words else None
        penalties = self._penalties(logits.device)
        if p.temperature == 0 and argmax is not None and penalties is None:
            token = argmax
        else:
            chosen_from = logits if penalties is None else penalties(logits)
            token = sample(chosen_from, p.temperature, p.top_k, p.top_p, self.generator, p.min_p)
        self.tokens.append(token)
        if penalties is not None:
            penalties.add(token)
        lp = None
        if p.logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1)
            lp = TokenLogprob(token, float(logprobs[token]), top_logprobs(logprobs, p.logprobs))
            self.logprobs.append(lp)

        special_stop = token in p.stop_token_ids or (token == self.eos_id and not p.ignore_eos)
        if special_stop:
            self.finish_reason = "stop" if token in p.stop_token_ids else "eos"
        else:
            self._extend_text()
        self._cut_at_stop(final=special_stop or len(self.tokens) >= p.max_new_tokens)
        if self.finish_reason is None and len(self.tokens) >= p.max_new_tokens:
            self.finish_reason = "length"
        return TokenEvent(self.index, token, self._release(), lp, self.finish_reason)

    def _penalties(self, device: torch.device) -> Penalties | None:
        """The sequence's logit bias and penalties (made at its first token), None where it has none."""
        p = self.params
        if self._penalized is None and p.adjusts_logits:
            self._penalized = Penalties(
                self.prompt,
                p.max_new_tokens,
                p.logit_bias,
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
                device,
            )
        return self._penalized

    def words(self, vocab: int) -> int:
        """How many of a `vocab`-wide distribution's ids are chosen from and scored over: the tokenizer's, where
        the model's vocabulary is padded past them (and the prompt holds none of the padding), else all."""
        if self._words is None:
            n = self.tokenizer.vocab_size if self.tokenizer is not None else vocab
            self._words = n if n < vocab and max(self.prompt) < n else vocab
        return self._words

    def _extend_text(self) -> None:
        """Decode the new token (`Detokenizer`), so a step costs the same at any length."""
        if self.tokenizer is None:
            return
        if self._text is None:
            self._text = Detokenizer(self.tokenizer)
        self._text.add(self.tokens[-1])
        self.text = self._text.text

    def _settled(self) -> str:
        """The text that no later token changes: all of it but a character not yet finished (its U+FFFD)."""
        return self._text.settled if self._text is not None else self.text

    def _cut_at_stop(self, final: bool) -> None:
        """End the text before the earliest match of any stop string, whatever their order (matches that
        overlap, "log" in "login" and "gin", must all be looked for in the text before it is cut). An
        unfinished character's placeholder (its U+FFFD at the end) is looked in only once no token follows
        (`final`, or a stop string found before it: the text ends with this token): until then it is not yet
        the character it becomes."""
        first = self._first_stop(self.text if final else self._settled())
        if first is not None and not final:  # found: no token follows, so a match in the placeholder counts too
            first = self._first_stop(self.text)
        if first is not None:
            self.text, self.finish_reason = self.text[:first], "stop"

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest match of any stop string begins in `text`, looked for past what was handed out."""
        found = [text.find(s, max(0, self.emitted - len(s) + 1)) for s in self.params.stop]
        return min((at for at in found if at != -1), default=None)

    def _release(self) -> str:
        """The text that can be handed out now: all of it once finished, else up to what is still unsure."""
        end = len(self.text)
        if self.finish_reason is None:
            settled = self._settled()
            end = len(settled) - _longest_stop_prefix(settled, self.params.stop)
        end = max(end, self.emitted)
        piece, self.emitted = self.text[self.emitted : end], end
        return piece

    def result(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(
            self.index,
            self.prompt,
            self.tokens,
            self.text,
            self.finish_reason,
            self.logprobs if self.params.logprobs is not None else None,
            self.prompt_logprobs,
            self.capture.tensors() if self.capture is not None else None,
        )


def _longest_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a stop string (it may still grow into one).
    Runs after every token: only the places in the tail where a stop string's first character occurs are
    tried, earliest (longest) first."""
    best = 0
    for s in stops:
        tail = text[max(0, len(text) - len(s) + 1) :]  # its last len(s) - 1 characters: a proper start at most
        at = tail.find(s[0])
        while at != -1 and len(tail) - at > best:
            if s.startswith(tail[at:]):
                best = len(tail) - at
                break
            at = tail.find(s[0], at + 1)
    return best


def _prompt_logprobs(
    logits: torch.Tensor, prompt: list[int], start: int, n: int, words: int
) -> list[TokenLogprob | None]:
    """Log-probabilities of the prompt tokens that `logits` [T, vocab] of positions start.. predict, over the
    first `words` ids (`SequenceState.words`)."""
    logprobs = torch.log_softmax(logits[:, :words].float(), dim=-1)
    out: list[TokenLogprob | None] = []
    for t in range(logits.shape[0]):
        if start + t + 1 < len(prompt):
            token = prompt[start + t + 1]
            out.append(TokenLogprob(token, float(logprobs[t, token]), top_logprobs(logprobs[t], n)))
    return out


def prefill_prompts(model: GPT, seqs: Sequence[SequenceState]) -> None:
    """Run the prompts of `prompt_only` sequences in one forward pass: `PromptsPass`'s steps one after another."""
    run = PromptsPass(model, seqs)
    while not run.done:
        run.step()


class PromptsPass:
    """The prompts of `prompt_only` sequences in one forward pass, [B, longest] (shorter ones padded at the
    end, which causal attention keeps from every real position), each sequence's hooks seeing only its own
    positions (`RowHooks`), a block a `step`: the embeddings with block 0, then each block, then the LM head,
    so that a server runs decode steps between them. The pass ends after the last hook any of them captures
    (`StopAfter`): the blocks after it and the LM head never run. Each sequence is then finished ("length")
    or failed (`error`): where the pass fails (an edit that cannot be applied to these values, say) every
    sequence in it fails, so a caller that must not let one request's edits fail another's runs an edited
    prompt alone (`has_edits`). One prompt alone gives its own values bit for bit, as `GPT.forward` would;
    beside others, to float rounding (a product over more rows may sum in another order)."""

    def __init__(self, model: GPT, seqs: Sequence[SequenceState]) -> None:
        self.model, self.seqs = model, list(seqs)
        captured = {n for s in seqs if s.capture is not None for n in s.capture.names}
        last = [n for n in hook_names(model.config.n_layer) if n in captured][-1:]
        self._pass: BlockwisePass | None = None  # None once it is over
        self._head_work = 0.0
        if not last:  # nothing to capture, nothing to run
            self._end()
            return
        parts: list[tuple[Hooks, Index]] = []
        squares: list[tuple[Hooks, Index]] = []
        for b, s in enumerate(seqs):
            if s.hooks is not None:
                t = slice(0, len(s.prompt))
                parts.append((s.hooks, (slice(b, b + 1), t)))
                squares.append((s.hooks, (slice(b, b + 1), slice(None), t, t)))
        longest = max(len(s.prompt) for s in seqs)
        rows = [s.prompt + [0] * (longest - len(s.prompt)) for s in seqs]  # [B, longest]
        # the head in one part: `RowHooks` index the positions of the whole pass
        self._pass = BlockwisePass(rows, StopAfter(RowHooks(parts, squares), last[0]), head_in_parts=False)
        self._head_work = pass_blocks(model.config, last) - model.config.n_layer  # the final LayerNorm's: none

    @property
    def done(self) -> bool:
        return self._pass is None

    def step(self) -> float:
        """The next block (the first with the embeddings), or the LM head after the last; the work it took, in
        blocks' worth a token (the head's as `pass_blocks` counts it)."""
        assert self._pass is not None, "the pass is over"
        try:
            head = self._pass.step(self.model)
        except Exception as e:  # an edit that cannot be applied to these values, say: every row fails with it
            self._end(e)
            return 1.0
        if self._pass.done:
            self._end()
        return self._head_work if head else 1.0

    def _end(self, error: Exception | None = None) -> None:
        for s in self.seqs:
            if error is not None:
                s.finish_reason, s.error = "error", error
            else:
                s.prefilled = len(s.prompt)
                s.finish_reason = "length"
        self._pass = None


def pass_blocks(config: GPTConfig, names: Sequence[str]) -> float:
    """The work of a forward pass that ends at the last of hook points `names` (as `prefill_prompts` runs
    one), in blocks' worth a token: the blocks it runs, each 12·C² multiply-adds a token (attention's
    projections and the MLP), and the LM head's product, vocab·C, as vocab / (12·C) blocks where a hook of its
    output is asked for (the final LayerNorm's hooks, before it, cost nothing more); 0 for the embeddings'
    hooks alone."""
    cost = 0.0
    for name in names:
        layer = layer_of(name)
        if layer is not None:
            cost = max(cost, layer + 1)
        elif name in LOGIT_HOOKS:
            cost = max(cost, config.n_layer + head_blocks(config))
        elif name in HEAD_HOOKS:
            cost = max(cost, config.n_layer)
    return cost


def head_blocks(config: GPTConfig) -> float:
    """The LM head's work in blocks' worth a token: its vocab·C multiply-adds against a block's 12·C²."""
    return config.vocab_size / (12 * config.n_embd)


def has_edits(seq: SequenceState) -> bool:
    """Whether `seq`'s forward passes apply edits (its hooks are more than its capture)."""
    return seq.hooks is not None and seq.hooks is not seq.capture


def _holds_ids(t: torch.Tensor) -> bool:
    """Whether a tensor can be a prompt: 1-D, of integers."""
    return t.dim() == 1 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def validate_prompt(model: GPT, prompt: Sequence[int], max_new_tokens: int, param: str = "prompt") -> list[int]:
    n_ctx, vocab = model.config.n_positions, model.config.vocab_size
    if isinstance(prompt, torch.Tensor) and not _holds_ids(prompt):  # ids as a tokenizer may give them
        raise GenerationError(
            f"a prompt given as a tensor must be 1-D and of integers, got {prompt.dim()}-D {prompt.dtype}", param
        )
    if len(prompt) > n_ctx:  # first: the checks below take a second of Python over two million ids
        message = f"the prompt ({len(prompt)} tokens) is longer than the context of {n_ctx} tokens"
        raise ContextLengthError(message, param)
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    ids = [operator.index(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in prompt]
    if not ids:
        raise GenerationError(
            'the prompt is empty: give at least one token ("<|endoftext|>" starts a new document: unconditional '
            "samples)",
            param,
        )
    odd = [t for t in ids if not is_int(t)]
    if odd:
        raise GenerationError(f"token ids must be integers, got {odd[0]!r}", param)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise GenerationError(f"token id {clip(bad[0])} is outside the vocabulary (0..{vocab - 1})", param)
    if len(ids) + max_new_tokens > n_ctx:
        raise ContextLengthError(
            f"the prompt ({len(ids)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
            f"context of {n_ctx} tokens",
            "max_new_tokens",
        )
    return ids


def new_sequence(
    model: GPT,
    index: int,
    prompt: Sequence[int],
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    hook_names: list[str] | None = None,
    edits: EditSpec | None = None,
    capture_dtype: torch.dtype | None = None,
) -> SequenceState:
    """Check a prompt against the model and set up its state (`hook_names`: activations to capture, kept in
    `capture_dtype` if given; `edits`: interventions and residual ablation to apply)."""
    if tokenizer is None and params.stop:
        raise GenerationError("stop strings need a tokenizer", "stop")
    ids = validate_prompt(model, prompt, params.max_new_tokens)
    vocab = model.config.vocab_size
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise GenerationError(
            f"stop token id {clip(bad[0])} is outside the vocabulary (0..{vocab - 1})", "stop_token_ids"
        )
    capture = Capture(hook_names, capture_dtype) if hook_names else None
    edit_hooks = edits.hooks(model.config, len(ids) + params.max_new_tokens) if edits is not None else None
    parts = [h for h in (edit_hooks, capture) if h is not None]
    state = SequenceState(
        index,
        ids,
        params,
        tokenizer,
        tokenizer.eot_id if tokenizer is not None else EOT_ID,
        _generator(params.seed, model.wte.weight.device),
        capture,
        parts[0] if len(parts) == 1 else HookChain(*parts) if parts else None,
    )
    if params.bias_end:  # the ids it chooses from: a padded vocabulary's padding is never chosen, nor biased
        words = state.words(vocab)
        if params.bias_end > words:
            bad = [t for t in params.logit_bias if t >= words]
            raise GenerationError(
                f"logit_bias: token id {clip(bad[0])} is outside the vocabulary (0..{words - 1})", "logit_bias"
            )
    return state


class DecodeBatch:
    """Sequences generating together over one KV cache of `capacity` rows: continuous batching.

    A sequence joins with `add` and leaves as soon as it finishes or is `cancel`led, so a later one can
    take its row. Each `step` is one forward pass: a decode token for every sequence past its prompt, packed
    with the next prompt tokens of the sequences still prefilling (first come, first served; with
    `prefill_chunk`, at most that many prompt tokens a step, so long prompts do not stall the others), so
    the weights are read once for both (`PackedBatch`). Sequences that capture activations or apply edits
    share the batch with the others: each one's `hooks` sees only its own tokens (`RowHooks`), exactly the
    values it would see alone, and its prompt is prefilled in chunks as any other's (the hooks glue them, or edit
    each chunk's positions), but in one piece where its hooks need that (`needs_whole_prompt`: an edit such as
    `mean` takes its mean over the whole prompt). Such a piece takes as many prompt tokens as the steps of its
    chunks would have: while rows decode, the next whole prompt waits until the steps after one have made up
    the tokens it took beyond its own step's chunk (`owed`, to which a server's whole passes beside the batch
    add theirs: `charge`), so that whole prompts sent back to back slow the decoding rows as chunked prompts
    do, not to a token a pass of a second.

    A sequence without hooks whose prompt begins with at least `SHARED_PREFIX_MIN` tokens of the prompt of one
    already in the batch, of its `group` (the `n` samples of a prompt, the choices of a multiple-choice question
    after one context), copies those positions' keys and values from that row instead of computing them again
    (`_take_prefixes`): it waits while the other prefills them (unless the step's budget carries its whole
    prompt anyway: waiting would only cost it a pass), then prefills only the rest. Its prompt logprobs, where
    asked for, are copied with them. `shared_tokens` counts the prompt tokens so taken.
    """

    def __init__(
        self,
        model: GPT,
        capacity: int,
        max_len: int,
        prefill_chunk: int | None = None,
        static: bool = False,
    ) -> None:
        """`static`: decode at fixed shapes, replayed as CUDA graphs on a GPU (captured here, so make the
        batch before serving)."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.model = model
        w = model.wte.weight
        self.cache = KVCache.empty(model.config, capacity, max_len, dtype=w.dtype, device=w.device)
        self.seqs: list[SequenceState] = []  # seqs[b] owns cache row b
        self.joined: list[int] = []  # joined[b]: when seqs[b] joined (prompts are prefilled in that order)
        # a joining sequence that will copy its prompt's first n positions from another's row: id -> (other, n)
        self._prefixes: dict[int, tuple[SequenceState, int]] = {}
        self.shared_tokens = 0  # prompt tokens copied from another row rather than computed, since the start
        self._tickets = itertools.count()
        self.prefill_chunk = prefill_chunk
        self.owed = 0  # prompt tokens whole prompts took beyond their steps' chunks while rows decoded, made up
        # a chunk a step since (`_chunks`)
        self.static = StaticDecode(model, self.cache) if static else None
        if self.static is not None:
            self.static.capture()
        # on a CPU, passes without hooks (decode steps, prompt chunks, both packed) run as one C++ call
        # (model/kernels/decode.py) where they can
        self.fused = FusedDecode.make(model, self.cache) if self.static is None else None

    def __len__(self) -> int:
        return len(self.seqs)

    def warm_up(self) -> None:
        """Run one pass of every token count a step of this batch can carry, so that the matrix kernels for
        each shape exist before the first request: oneDNN, behind bfloat16 and float16 on a CPU, compiles
        one per shape the first time it sees it, which would cost that step tens of milliseconds. (float32
        and int8 on a CPU go to our kernels, or to MKL past `max_rows()`, which compile nothing per shape; on a
        GPU the decode step is captured as CUDA graphs.)"""
        w = self.model.wte.weight
        if w.device.type != "cpu" or w.dtype == torch.float32:
            return
        most = min(self.cache.capacity + (self.prefill_chunk or self.cache.max_len), self.model.config.n_positions)
        log.info(
            "one pass of each token count a step can carry (1..%d), so that oneDNN's %s kernels exist before the "
            "first request: seconds, more with a larger prefill chunk",
            most,
            str(w.dtype).removeprefix("torch."),
        )
        with torch.inference_mode():
            for n in range(1, most + 1):
                self.model(torch.zeros(1, n, dtype=torch.long, device=w.device))  # every logit: the head too

    @property
    def has_room(self) -> bool:
        return len(self.seqs) < self.cache.capacity

    def add(self, seq: SequenceState) -> None:
        """Give `seq` a row; the next steps prefill its prompt (or copy its start from another row's)."""
        self.cache.add_row()
        self.seqs.append(seq)
        self.joined.append(next(self._tickets))
        prefix = self._shared_prefix(seq)
        if prefix is not None:
            self._prefixes[id(seq)] = prefix

    def _shared_prefix(self, seq: SequenceState) -> tuple[SequenceState, int] | None:
        """The sequence in the batch whose prompt shares the most positions with `seq`'s that `seq` can copy,
        and how many (at least `SHARED_PREFIX_MIN`); None if none. Neither may have hooks (an edit changes
        the keys and values, and a capture must see every position). `seq` computes at least its last prompt
        position (whose logits choose its first token), and with prompt logprobs the last one in common too
        (its logits score `seq`'s next prompt token, which the other's do not), and then only from another
        that lists prompt logprobs of the same depth."""
        want, head = seq.params.prompt_logprobs, seq.prompt[:SHARED_PREFIX_MIN]
        if seq.hooks is not None or len(seq.prompt) <= SHARED_PREFIX_MIN:
            return None
        best, best_key = None, (0, False)
        for other in self.seqs[:-1]:
            if (
                other.group != seq.group
                or other.hooks is not None
                or (want is not None and other.params.prompt_logprobs != want)
                or other.prompt[:SHARED_PREFIX_MIN] != head  # most rows: no long slice or search
            ):
                continue
            n = min(_common_prefix(seq.prompt, other.prompt) - (want is not None), len(seq.prompt) - 1)
            key = (n, other.prefilled >= n)  # the most positions; of as many, from a row that holds them already
            if n >= SHARED_PREFIX_MIN and key > best_key:
                best, best_key = (other, n), key
        return best

    def _take_prefixes(self) -> None:
        """Copy their shared prefixes into the rows of the sequences waiting for them, where the other row
        holds them by now. One whose other has left the batch (finished, cancelled or failed) before then
        prefills its prompt itself."""
        rows = {id(s): b for b, s in enumerate(self.seqs)}
        for b, seq in enumerate(self.seqs):
            prefix = self._prefixes.get(id(seq))
            if prefix is None:
                continue
            other, n = prefix
            a = rows.get(id(other))
            if a is not None and other.prefilled < n:
                continue  # the other is still prefilling them: this one waits
            del self._prefixes[id(seq)]
            if a is None:
                continue
            self.cache.copy_prefix(a, b, n)
            seq.prefilled = n
            if seq.params.prompt_logprobs is not None:
                assert other.prompt_logprobs is not None
                seq.prompt_logprobs = other.prompt_logprobs[: n + 1]  # tokens 0..n, all in common
            self.shared_tokens += n

    def step(self) -> list[tuple[SequenceState, TokenEvent | None]]:
        """Advance the batch by one forward pass. Returns each sequence that got a token with it, and each
        that finished without one (it wanted none, or failed: its `error`) with None."""
        if self._prefixes:
            self._take_prefixes()
        decoding = [b for b, s in enumerate(self.seqs) if s.prefilled == len(s.prompt)]
        chunks = self._chunks()
        if not chunks and len(decoding) == len(self.seqs):
            out = self._decode() if decoding else []
        elif len(chunks) == 1 and not decoding:
            out = self._prefill(*chunks[0])  # one sequence alone: hooks see its own shapes
        else:
            out = self._packed(decoding, chunks)
        if self._prefixes:
            self._take_prefixes()  # before a row that finished leaves, with what others wait to copy
        for b in reversed(range(len(self.seqs))):  # from the end: leaving moves the last row into b
            if self.seqs[b].finish_reason is not None:
                self._leave(b)
        return out

    def owes(self) -> bool:
        """Whether a whole prompt's pass waits now: rows decode, and the passes before it are owed steps."""
        return self.owed > 0 and self._decoding()

    def charge(self, tokens: int) -> None:
        """A whole prompt's pass of `tokens` (as many through every block) ran beside this batch, before its
        step (whose chunk `_chunks` then makes up): while rows decode, they are owed."""
        if self.prefill_chunk is not None and self._decoding():
            self.owed += tokens

    def _decoding(self) -> bool:
        return any(s.prefilled == len(s.prompt) for s in self.seqs)

    def _chunks(self) -> list[tuple[int, int, int]]:
        """The prompt tokens to prefill this step, as (row, start, end), in the order the rows joined; a whole
        prompt (`needs_whole_prompt`) not while the passes before it are owed steps (`owes`)."""
        budget = self.prefill_chunk
        decoding = self._decoding()
        waits = self.owed > 0 and decoding  # `owes`
        if not decoding:
            self.owed = 0  # no row to make it up to
        elif budget is not None:
            self.owed = max(0, self.owed - budget)  # this step's chunk, made up
        chunks = []
        for b in sorted(range(len(self.seqs)), key=self.joined.__getitem__):
            seq = self.seqs[b]
            if id(seq) in self._prefixes:
                if budget is not None and budget < len(seq.prompt) - seq.prefilled:
                    continue  # waits for another row to prefill what it will copy
                del self._prefixes[id(seq)]  # this step carries its whole prompt: waiting would cost it a pass
            if seq.prefilled < len(seq.prompt) and (budget is None or budget > 0):
                whole = budget is not None and seq.hooks is not None and needs_whole_prompt(seq.hooks)
                if whole and waits:
                    continue  # the rows after it take the step's chunk meanwhile
                end = len(seq.prompt) if budget is None or whole else min(len(seq.prompt), seq.prefilled + budget)
                chunks.append((b, seq.prefilled, end))
                if budget is not None:
                    budget -= end - seq.prefilled
        if budget is not None and budget < 0 and decoding:  # a whole prompt took more than the chunk
            self.owed += -budget
        return chunks

    def _prefill(self, b: int, start: int, end: int) -> list[tuple[SequenceState, TokenEvent | None]]:
        """Prompt tokens start..end of row `b`, alone in the pass (with its hooks)."""
        seq = self.seqs[b]
        want_all = seq.params.prompt_logprobs is not None
        if self._fused_fits(seq.hooks, end - start):
            assert self.fused is not None
            T = end - start
            logits = self.fused.forward(
                seq.prompt[start:end], [b] * T, list(range(start, end)), list(range(0 if want_all else T - 1, T))
            )
        else:
            idx = torch.tensor([seq.prompt[start:end]], device=self.model.wte.weight.device)  # [1, T]
            logits = self.model(idx, self.cache.row(b), seq.hooks, last_only=not want_all)[0]  # [T or 1, vocab]
        self.cache.set_length(b, end)
        return self._prefilled(seq, start, end, logits)

    def _packed(
        self, decoding: list[int], chunks: list[tuple[int, int, int]]
    ) -> list[tuple[SequenceState, TokenEvent | None]]:
        """A decode token for every row (a dummy for the rows still prefilling) and the prompt chunks,
        in one pass; logits only where a token is wanted. The layout, as index lists:
            tokens     = [one token per row (none when no row decodes) | chunk 0's tokens | chunk 1's | ...]
            outputs    = the positions in `tokens` that leave the last block (decode rows', chunks' kept)
            logit_rows = the positions in `outputs` whose logits are computed
            spans, logit_spans = each chunk's slice of `outputs` and of the logits."""
        steps = [int(b in decoding) for b in range(len(self.seqs))]  # 1 for a decoding row, 0 for a dummy
        tokens = [s.tokens[-1] if n else 0 for s, n in zip(self.seqs, steps, strict=True)] if decoding else []
        outputs = list(decoding)  # the packed tokens that leave the last block
        logit_rows = list(range(len(decoding)))  # those of `outputs` whose logits are wanted
        spans = []  # each chunk's share of `outputs` (its hooks' after the last block)
        logit_spans = []  # and of the logits
        for b, start, end in chunks:
            seq, n = self.seqs[b], end - start
            last = end == len(seq.prompt)  # the prompt's last chunk: its last position predicts a new token
            every = seq.params.prompt_logprobs is not None or uses_the_logits(seq.hooks)
            kept = n if every or uses_the_head(seq.hooks) else int(last)  # ln_f's hooks see every position
            wanted = n if every else int(last)
            spans.append((len(outputs), len(outputs) + kept))
            logit_spans.append((len(logit_rows), len(logit_rows) + wanted))
            logit_rows += range(len(outputs) + kept - wanted, len(outputs) + kept)
            outputs += range(len(tokens) + n - kept, len(tokens) + n)
            tokens += seq.prompt[start:end]
        hooks, piece_hooks = self._packed_hooks(decoding, chunks, spans)
        fused_tokens = len(decoding) + sum(end - start for _, start, end in chunks)  # the fused pass has no dummies
        if self._fused_fits(hooks, fused_tokens):  # no hooks: every output's logits are wanted
            logits = self._packed_fused(decoding, chunks, outputs)
        else:
            packed = PackedBatch(
                self.cache,
                bool(decoding),
                [(b, end - start) for b, start, end in chunks],
                outputs,
                piece_hooks,
                logit_rows=None if len(logit_rows) == len(outputs) else logit_rows,
            )
            idx = torch.tensor([tokens], device=self.model.wte.weight.device)  # [1, N]
            logits = self.model(idx, packed, hooks)[0]  # [len(logit_rows), vocab]
        out: list[tuple[SequenceState, TokenEvent | None]] = []
        if decoding:
            self.cache.advance(steps)
            out += self._accept([self.seqs[b] for b in decoding], logits[: len(decoding)])
        for b, _, end in chunks:
            self.cache.set_length(b, end)
        for (b, start, end), (lo, hi) in zip(chunks, logit_spans, strict=True):
            out += self._prefilled(self.seqs[b], start, end, logits[lo:hi])
        return out

    def _fused_fits(self, hooks: Hooks | None, n_tokens: int) -> bool:
        """Whether a pass of `n_tokens` goes to the fused CPU pass: no hooks, no gradient, and no more tokens
        than its products take (`FusedDecode.max_tokens`)."""
        fused = self.fused
        return fused is not None and hooks is None and n_tokens <= fused.max_tokens and not torch.is_grad_enabled()

    def _packed_fused(
        self, decoding: list[int], chunks: list[tuple[int, int, int]], outputs: list[int]
    ) -> torch.Tensor:
        """`_packed`'s pass on the fused CPU pass: the decode tokens of the decoding rows (no dummies) and the
        prompt chunks, each token at its row and position; `outputs` index the packed tokens as `_packed`
        lays them out (a decode token for every row first), so they are mapped onto these."""
        assert self.fused is not None
        tokens = [self.seqs[b].tokens[-1] for b in decoding]
        rows, positions = list(decoding), [self.cache.lengths[b] for b in decoding]
        at = {b: j for j, b in enumerate(decoding)}  # packed index of a decode token -> its index here
        first = len(self.seqs) if decoding else 0  # where the chunks begin among the packed tokens
        for b, start, end in chunks:
            tokens += self.seqs[b].prompt[start:end]
            rows += [b] * (end - start)
            positions += range(start, end)
        shift = first - len(decoding)
        index = [at[o] if o < first else o - shift for o in outputs]
        return self.fused.forward(tokens, rows, positions, index)  # [len(outputs), vocab]

    def _packed_hooks(
        self, decoding: list[int], chunks: list[tuple[int, int, int]], spans: list[tuple[int, int]]
    ) -> tuple[RowHooks | None, list[Hooks | None] | None]:
        """Each hooked sequence's share of a packed pass [1, N]: its decode token (row b is token b of the
        decode piece, and output j if it is the j-th decoding row) or its prompt chunk; and per piece, its
        attention squares (a decoding row's against its own keys only)."""
        parts: list[tuple[Hooks, Index]] = []
        head: list[tuple[Hooks, Index]] = []
        squares: list[tuple[Hooks, Index]] = []
        one, every = slice(0, 1), slice(None)
        for j, b in enumerate(decoding):
            h = self.seqs[b].hooks
            if h is not None:
                parts.append((h, (one, slice(b, b + 1))))
                head.append((h, (one, slice(j, j + 1))))
                squares.append((h, (slice(b, b + 1), every, every, slice(0, self.cache.lengths[b] + 1))))
        piece_hooks: list[Hooks | None] = [RowHooks([], squares)] if decoding else []
        first = len(self.seqs) if decoding else 0
        for (b, start, end), (lo, hi) in zip(chunks, spans, strict=True):
            h = self.seqs[b].hooks
            if h is not None:
                parts.append((h, (one, slice(first, first + end - start))))
                head.append((h, (one, slice(lo, hi))))
            piece_hooks.append(h)  # a chunk's piece is its row alone: its squares are its own
            first += end - start
        if not parts:
            return None, None
        return RowHooks(parts, head_parts=head), piece_hooks

    def _prefilled(
        self, seq: SequenceState, start: int, end: int, logits: torch.Tensor
    ) -> list[tuple[SequenceState, TokenEvent | None]]:
        """Book prompt tokens start..end as prefilled, given their logits [T or 1 or 0, vocab]: prompt
        logprobs if asked for, and the first new token once the prompt is complete. Logits that are not finite
        where they give a prompt token's log-probability fail the sequence, as they do where they give a new
        token (`_accept`)."""
        if seq.params.prompt_logprobs is not None:
            used = logits[: max(0, min(end, len(seq.prompt) - 1) - start)]  # the rows that predict prompt tokens
            bad = (~used.isfinite().all(dim=-1)).nonzero()  # one device sync
            if len(bad):
                seq.finish_reason, seq.error = "error", self._overflowed(seq, f"prompt token {start + int(bad[0]) + 2}")
                return [(seq, None)]  # (not booked as prefilled: no row copies a prefix from it)
            seq.prompt_logprobs = (seq.prompt_logprobs or [None]) + _prompt_logprobs(
                logits, seq.prompt, start, seq.params.prompt_logprobs or 0, seq.words(logits.shape[-1])
            )
        seq.prefilled = end
        if end < len(seq.prompt):
            return []
        if seq.params.max_new_tokens == 0:
            seq.finish_reason = "length"
            return [(seq, None)]
        return self._accept([seq], logits[-1:])

    def _decode(self) -> list[tuple[SequenceState, TokenEvent | None]]:
        """One token for every row (a step with no prompt chunk: every row is past its prompt)."""
        hooks = self._decode_hooks()
        tokens = [s.tokens[-1] for s in self.seqs]
        if self.static is not None and hooks is None:
            logits = self.static(tokens, list(self.cache.lengths))  # [B, vocab]
        elif self._fused_fits(hooks, len(tokens)):
            assert self.fused is not None
            logits = self.fused(tokens, self.cache.lengths)  # [B, vocab], the same math in one C++ call
        else:
            idx = torch.tensor(tokens, device=self.model.wte.weight.device)[:, None]  # [B, 1]
            logits = self.model(idx, self.cache, hooks, last_only=True)[:, -1]  # [B, vocab]
        self.cache.advance(1)
        return self._accept(self.seqs, logits)

    def _decode_hooks(self) -> RowHooks | None:
        """Each hooked row's share of a decode pass [B, 1]: its token, and its squares against its own keys."""
        parts: list[tuple[Hooks, Index]] = []
        squares: list[tuple[Hooks, Index]] = []
        every = slice(None)
        for b, seq in enumerate(self.seqs):
            if seq.hooks is not None:
                parts.append((seq.hooks, (slice(b, b + 1), every)))
                squares.append((seq.hooks, (slice(b, b + 1), every, every, slice(0, self.cache.lengths[b] + 1))))
        return RowHooks(parts, squares) if parts else None

    def _accept(self, seqs: list[SequenceState], logits: torch.Tensor) -> list[tuple[SequenceState, TokenEvent | None]]:
        """Each of `seqs` takes its next token from its row of `logits` [len(seqs), vocab]. One that cannot
        (its logits are not finite, say because its edits blew up the activations) fails alone: it finishes
        with `error` set, and every other row gets the token it would get without it."""
        logits = logits.float()  # [len(seqs), vocab], converted once for the whole step
        # a row is finite where its max and min are (a NaN is its max): two passes over the logits, not the
        # three and a bool copy of argmax and isfinite().all() (at 32 rows on a 2-core CPU, 1.5 ms against 5.9)
        top, top_index = logits.max(dim=-1)  # the first of equal maxima, as argmax
        if logits.device.type in ("cpu", "cuda"):  # where max and min propagate NaN
            all_finite = top.isfinite() & logits.amin(dim=-1).isfinite()
        else:  # MPS reductions have skipped NaN
            all_finite = logits.isfinite().all(dim=-1)
        argmax, finite = torch.stack([top_index, all_finite.long()]).tolist()  # one device sync for every row
        out: list[tuple[SequenceState, TokenEvent | None]] = []
        for seq, row, best, ok in zip(seqs, logits, argmax, finite, strict=True):
            try:
                if not ok:
                    raise self._overflowed(seq, f"generated token {len(seq.tokens) + 1}")
                out.append((seq, seq.accept(row, best)))
            except Exception as e:  # this row's problem: the others go on
                seq.finish_reason, seq.error = "error", e
                out.append((seq, None))
        return out

    def _overflowed(self, seq: SequenceState, where: str) -> GenerationError:
        """The error of a sequence whose logits are not finite where they give `where`'s probabilities."""
        edited = has_edits(seq)
        why = (
            "interventions with large factors or values can do this"
            if edited
            else f"the weights, or {dtype_range(self.model.ln_f.weight.dtype)}"  # the activations'
        )
        return GenerationError(
            f"the logits became non-finite (inf or NaN) at {where}: the activations overflowed ({why})",
            "interventions" if edited else None,
        )

    def cancel(self, seq: SequenceState) -> None:
        """Take `seq` out of the batch now (its row is free for the next sequence)."""
        for b, s in enumerate(self.seqs):
            if s is seq:
                seq.finish_reason = seq.finish_reason or "cancelled"
                self._leave(b)
                return

    def _leave(self, b: int) -> None:
        seq = self.seqs[b]
        self._prefixes.pop(id(seq), None)
        if seq.capture is not None and seq.tokens and seq.finish_reason not in ("cancelled", "error"):
            # The last token was sampled, never fed: feed it, so activations cover every position.
            idx = torch.tensor([[seq.tokens[-1]]], device=self.model.wte.weight.device)
            try:
                self.model(idx, self.cache.row(b), seq.hooks, last_only=True)
            except Exception as e:  # this sequence's own pass: it fails alone
                seq.finish_reason, seq.error = "error", e
        self.cache.remove_row(b, _written(seq), _written(self.seqs[-1]))
        self.seqs[b], self.joined[b] = self.seqs[-1], self.joined[-1]
        self.seqs.pop()
        self.joined.pop()


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` have in common from the start (slice comparisons, a binary search)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo + 1 < hi:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _written(seq: SequenceState) -> int:
    """How many of its row's first positions a sequence may have written, failed passes included: its
    prompt's (and a prefilling row's placeholder, within them), and each token fed after it (the last one
    sampled is fed once at most, to capture it)."""
    return len(seq.prompt) + len(seq.tokens)


class Generation:
    """Continuations of several prompts. Iterate it for `TokenEvent`s as tokens are produced; once it is
    exhausted, `results` holds one `Completion` per prompt, in prompt order.

    With `hooks` (names or glob patterns), each `Completion.activations` holds the hook values ([1, ...],
    as TransformerLens shapes them) over every position of prompt and continuation: what one forward pass
    over the final sequence gives, cast to `capture_dtype` as they are captured if it is given (a float16
    dump of a float32 model takes half the memory). With `edits`, each prompt runs with those interventions and residual
    ablations applied. The prompts run as one batch either way, each seeing only its own values.
    """

    def __init__(
        self,
        model: GPT,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        tokenizer: Tokenizer | None = None,
        hooks: Sequence[str] | None = None,
        edits: EditSpec | None = None,
        capture_dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(prompts, torch.Tensor) or type(prompts).__name__ == "ndarray":  # [batch, pos] ids (numpy's too)
            array: Any = prompts
            prompts = array.tolist() if array.ndim == 2 else [array.tolist()]
        first = prompts[0] if len(prompts) else None  # an id where a prompt should be: one prompt's flat ids
        if isinstance(first, numbers.Integral) or (isinstance(first, torch.Tensor) and first.dim() == 0):
            raise GenerationError("prompts is a list of prompts, each a list of token ids (one: [ids])", "prompt")
        if not prompts:
            raise GenerationError("no prompts given", "prompt")
        if not isinstance(params, SamplingParams) and not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"params is a SamplingParams (or one per prompt), got {type(params).__name__}")
        if edits is not None and not isinstance(edits, EditSpec):
            raise TypeError(f"edits is an EditSpec(edits=(Edit(...), ...)), got {type(edits).__name__}")
        if hooks is not None and (hasattr(hooks, "active") or not all(isinstance(h, str) for h in hooks)):
            raise TypeError("hooks are hook names or globs (a str or a list of them), not a Capture or Hooks")
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise GenerationError(f"{len(per_prompt)} parameter sets for {len(prompts)} prompts")
        self.model = model
        names = select_hooks(hooks, model.config.n_layer) if hooks else None
        self._seqs = [
            new_sequence(model, i, prompt, p, tokenizer, names, edits, capture_dtype)
            for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True))
        ]
        self._events: Iterator[TokenEvent] | None = None
        self._done = False
        self._failed: Exception | None = None  # what ended the run, if it raised

    @property
    def results(self) -> list[Completion]:
        if self._failed is not None:  # iterating again gives nothing: no waiting for an end that will not come
            raise RuntimeError(f"the generation failed: {self._failed}") from self._failed
        if not self._done:
            raise RuntimeError("the generation has not finished: iterate it to the end first")
        return [s.result() for s in self._seqs]

    def __iter__(self) -> Iterator[TokenEvent]:
        """The generation's one run of events: iterated again after a `break`, it goes on where it stopped;
        after its end, or an error, it gives nothing more (a new `Generation` runs again)."""
        if self._events is None:
            self._events = self._failures_kept(self._run())
        return self._events

    def _failures_kept(self, events: Iterator[TokenEvent]) -> Iterator[TokenEvent]:
        try:
            yield from events
        except Exception as e:
            self._failed = e
            raise

    @torch.inference_mode()  # around each step of the generator: the caller's code between events runs as it is
    def _run(self) -> Iterator[TokenEvent]:
        prompt_only = [s for s in self._seqs if s.prompt_only]
        group = [s for s in self._seqs if not s.prompt_only]
        if prompt_only:
            prefill_prompts(self.model, prompt_only)
            for seq in prompt_only:
                if seq.error is not None:
                    raise seq.error
        if group:
            max_len = max(len(s.prompt) + s.params.max_new_tokens for s in group)
            # prompt tokens per pass: at most a context's worth (bounds the memory of its logits)
            batch = DecodeBatch(self.model, len(group), max_len, prefill_chunk=self.model.config.n_positions)
            for seq in group:
                batch.add(seq)
            while batch:
                for seq, event in batch.step():
                    if seq.error is not None:
                        raise seq.error
                    if event is not None:
                        yield event
        self._done = True


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    seed = seed if seed is not None else secrets.randbits(63)
    g.manual_seed(seed if device.type != "cpu" else fold_seed(seed))  # CUDA's Philox keeps all 64 bits
    return g


def fold_seed(seed: int) -> int:
    """An int64 seed as the 32 bits torch's CPU generator (mt19937) keeps: the low half as it is, xor the high
    half mixed (murmur3's finalizer, a bijection that leaves 0 alone). Seeds 0..2³²-1 stay themselves, and
    seeds that differ only above bit 31 (s and s + 2³², -1 and 2³²-1), which a plain cut would make equal,
    sample apart; 2⁶⁴ seeds in 2³² states still meet somewhere, but not along such lines."""
    seed &= 2**64 - 1  # two's complement: a negative seed as the uint64 torch reads it
    high = seed >> 32
    high ^= high >> 16
    high = (high * 0x85EBCA6B) & 0xFFFFFFFF
    high ^= high >> 13
    high = (high * 0xC2B2AE35) & 0xFFFFFFFF
    high ^= high >> 16
    return (seed & 0xFFFFFFFF) ^ high


def generate(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    tokenizer: Tokenizer | None = None,
    hooks: Sequence[str] | None = None,
    edits: EditSpec | None = None,
    capture_dtype: torch.dtype | None = None,
) -> list[Completion]:
    """Run a `Generation` to the end and return its completions."""
    generation = Generation(model, prompts, params, tokenizer, hooks, edits, capture_dtype)
    for _ in generation:
        pass
    return generation.results
