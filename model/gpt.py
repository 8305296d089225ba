"""GPT-2, written out by hand: Pre-LN transformer decoder with learned positions and a tied LM head.

References: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (OpenAI's GPT-2
release); Vaswani et al. 2017, "Attention Is All You Need"; He et al. 2016, "Deep Residual Learning".
Module and parameter names are those of the official checkpoint (`wte`, `h.0.attn.c_attn`, `ln_f`), so
loading is a table of names; hook points carry TransformerLens' names (see `model/hooks.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .hooks import HookPoint, Hooks, begin_pass, hook_names, uses_the_head, uses_the_logits
from .kv_cache import KVCache, PackedBatch

# Per-head inputs' changes for the queries, keys and values, [B, T, H, C] each (see Block._attn_input).
PerHeadInputs = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Rows = slice | torch.Tensor  # the positions whose logits are wanted (`GPT.unembed`)
LAST = slice(-1, None)  # the last position's
ALL = slice(None)  # every output of a layer (`Conv1D.einsum`)


class Conv1D(nn.Module):
    """A dense layer, y = x W + b, with W of shape [in, out] as OpenAI's checkpoint stores it (their code
    called it Conv1D); its layout in memory is the one its products read fastest (`loading._stored`)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))
        nn.init.normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)  # [rows, out]
        return y.view(*x.shape[:-1], -1)

    def einsum(self, equation: str, x: torch.Tensor, shape: tuple[int, ...], outputs: slice = ALL) -> torch.Tensor:
        """`torch.einsum(equation, x, W[:, outputs].view(shape))`, no bias: products with W by head."""
        return torch.einsum(equation, x, self.weight[:, outputs].view(shape))


class LayerNorm(nn.LayerNorm):
    """LayerNorm (Ba et al. 2016) with TransformerLens' hook points: `hook_scale`, sqrt(var + eps) [.., 1],
    and `hook_normalized`, (x - mean) / scale, before the gain and bias. The fused kernel runs unless one
    of them is asked for (same math)."""

    def __init__(self, n_embd: int, eps: float, name: str) -> None:
        super().__init__(n_embd, eps=eps)
        self.hook_scale = HookPoint(name + ".hook_scale")
        self.hook_normalized = HookPoint(name + ".hook_normalized")

    def forward(self, x: torch.Tensor, hooks: Hooks | None = None) -> torch.Tensor:
        if hooks is None or not (hooks.active(self.hook_scale.name) or hooks.active(self.hook_normalized.name)):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # statistics in at least float32, as the kernel
        x = x - x.mean(dim=-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt(), hooks)  # [..., 1]
        normalized = self.hook_normalized(x / scale, hooks)  # [..., C]: mean 0, variance 1
        return (normalized * self.weight + self.bias).to(dtype)


class TiedLMHead(nn.Module):
    """The LM head, tied to the token embedding: logits = x @ wte.T. No weights of its own; a module so that
    loading can swap in a faster kernel for it (`model/kernels/`, `model/quantize.py`)."""

    def forward(self, x: torch.Tensor, wte: torch.Tensor) -> torch.Tensor:
        return x @ wte.T  # [..., vocab]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: for each head h, z_h = softmax(Q_h K_hᵀ / √d_head + causal mask) V_h;
    out = concat_h(z_h) W_O + b_O. `_explicit_attention` spells it out (where hooks ask for the scores or the
    pattern); torch's fused SDPA computes the same otherwise."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head, self.d_head = config.n_head, config.d_head
        self.c_attn = Conv1D(config.n_embd, 3 * config.n_embd)  # Q, K, V from one projection
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        p = f"blocks.{layer}.attn."
        self.hook_q, self.hook_k, self.hook_v = (
            HookPoint(p + "hook_q"),
            HookPoint(p + "hook_k"),
            HookPoint(p + "hook_v"),
        )
        self.hook_attn_scores = HookPoint(p + "hook_attn_scores")
        self.hook_pattern = HookPoint(p + "hook_pattern")
        self.hook_z = HookPoint(p + "hook_z")
        self.hook_result = HookPoint(p + "hook_result")

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | PackedBatch | None,
        hooks: Hooks | None,
        dx: PerHeadInputs | None = None,
    ) -> torch.Tensor:
        """`x`: the normalised stream [B, T, C]. `dx`: with TransformerLens' per-head inputs, how much each
        head's normalised input for its queries, keys and values differs from `x` ([B, T, H, C] each; None
        where it does not)."""
        B, T, C = x.shape
        H, D = self.n_head, self.d_head
        q, k, v = (t.view(B, T, H, D) for t in self.c_attn(x).split(C, dim=2))
        if dx is not None:  # the projection is linear: q[h] = (x + dx_q[h]) W_Q[:, h] + b_Q[h], and so on
            dq, dk, dv = (  # W_Q, W_K or W_V by head: [C, H, D]
                None if d is None else self.c_attn.einsum("bthc,chd->bthd", d, (C, H, D), slice(i * C, (i + 1) * C))
                for i, d in enumerate(dx)
            )
            q, k, v = (t if d is None else t + d for t, d in ((q, dq), (k, dk), (v, dv)))  # [B, T, H, D]
        q = self.hook_q(q, hooks)  # [B, T, H, D]
        k = self.hook_k(k, hooks)
        v = self.hook_v(v, hooks)
        if isinstance(cache, PackedBatch):  # several sequences side by side along T: attend piece by piece
            pieces = []
            for (s, n, piece), piece_hooks in zip(cache.pieces, cache.piece_hooks, strict=True):
                qs, ks, vs = (t[:, s].view(n, -1, H, D) for t in (q, k, v))  # the tokens of n rows, [n, t, H, D]
                pieces.append(self._attend(qs, ks, vs, piece, piece_hooks).reshape(1, -1, H, D))
            z = torch.cat(pieces, dim=1)
        else:
            z = self._attend(q, k, v, cache, hooks)
        z = self.hook_z(z, hooks)  # [B, T, H, D]
        if hooks is not None and hooks.active(self.hook_result.name):  # each head's write into the stream
            result = self.c_proj.einsum("bthd,hdc->bthc", z, (H, D, C))  # [B, T, H, C]
            return self.hook_result(result, hooks).sum(dim=2) + self.c_proj.bias
        return self.c_proj(z.reshape(B, T, C))

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, hooks: Hooks | None
    ) -> torch.Tensor:
        """Each query's weighted mix of the values it may see: q, k, v [B, T, H, D] -> z [B, T, H, D]."""
        T = q.shape[1]
        if cache is None:
            k, v, allowed = k.transpose(1, 2), v.transpose(1, 2), None  # [B, H, T, D]
        else:
            k, v, allowed = cache.update(self.layer, k, v)  # [B, H, S, D]: every key of the row so far
        q = q.transpose(1, 2)  # [B, H, T, D]
        if hooks is not None and (hooks.active(self.hook_attn_scores.name) or hooks.active(self.hook_pattern.name)):
            z = self._explicit_attention(q, k, v, allowed, hooks)
        else:  # fused kernel, same math
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None and T > 1)
        return z.transpose(1, 2)

    def _explicit_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, hooks: Hooks
    ) -> torch.Tensor:
        T, S = q.shape[2], k.shape[2]
        if allowed is None:  # causal, the queries being the last T of the S positions
            allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)  # [B, H, T, S]
        scores = self.hook_attn_scores(scores.masked_fill(~allowed, float("-inf")), hooks)
        # softmax in at least float32 (float16/bfloat16 are upcast; float64 stays float64)
        pattern = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
        pattern = self.hook_pattern(pattern, hooks)  # [B, H, T, S], rows sum to 1
        return pattern @ v  # [B, H, T, D]


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, config.d_mlp)  # expand x4
        self.c_proj = Conv1D(config.d_mlp, config.n_embd)  # project back
        self.hook_pre = HookPoint(f"blocks.{layer}.mlp.hook_pre")
        self.hook_post = HookPoint(f"blocks.{layer}.mlp.hook_post")

    def forward(self, x: torch.Tensor, hooks: Hooks | None) -> torch.Tensor:
        pre = self.hook_pre(self.c_fc(x), hooks)  # [B, T, 4C]
        post = self.hook_post(F.gelu(pre, approximate="tanh"), hooks)  # GPT-2's "gelu_new"
        return self.c_proj(post)  # [B, T, C]


class Block(nn.Module):
    """Pre-LN transformer block: each sub-layer reads a normalised copy of the residual stream and adds back."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        p = f"blocks.{layer}."
        self.ln_1 = LayerNorm(config.n_embd, config.layer_norm_epsilon, p + "ln1")
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = LayerNorm(config.n_embd, config.layer_norm_epsilon, p + "ln2")
        self.mlp = MLP(config, layer)
        self.hook_resid_pre = HookPoint(p + "hook_resid_pre")
        self.hook_attn_in = HookPoint(p + "hook_attn_in")
        self.hook_q_input = HookPoint(p + "hook_q_input")
        self.hook_k_input = HookPoint(p + "hook_k_input")
        self.hook_v_input = HookPoint(p + "hook_v_input")
        self.hook_attn_out = HookPoint(p + "hook_attn_out")
        self.hook_resid_mid = HookPoint(p + "hook_resid_mid")
        self.hook_mlp_in = HookPoint(p + "hook_mlp_in")
        self.hook_mlp_out = HookPoint(p + "hook_mlp_out")
        self.hook_resid_post = HookPoint(p + "hook_resid_post")

    def forward(self, x: torch.Tensor, cache: KVCache | PackedBatch | None, hooks: Hooks | None) -> torch.Tensor:
        resid_pre = self.hook_resid_pre(x, hooks)  # [B, T, C]
        normalized, dx = self._attn_input(resid_pre, hooks)  # ln_1(resid_pre) [B, T, C]; each head's own change
        attn_out = self.hook_attn_out(self.attn(normalized, cache, hooks, dx), hooks)
        resid_mid = self.hook_resid_mid(resid_pre + attn_out, hooks)
        mlp_in = self.hook_mlp_in(resid_mid, hooks)  # the MLP's copy of the stream (an edit reaches only it)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln_2(mlp_in, hooks), hooks), hooks)
        resid_post = self.hook_resid_post(resid_mid + mlp_out, hooks)
        return resid_post

    def _attn_input(self, resid_pre: torch.Tensor, hooks: Hooks | None) -> tuple[torch.Tensor, PerHeadInputs | None]:
        """What the attention reads: `ln_1(resid_pre)` [B, T, C], with ln1's hooks; and, when TransformerLens'
        per-head inputs are asked for (`hook_attn_in`, then `hook_q_input`, `hook_k_input`, `hook_v_input`,
        each [B, T, H, C]), what each head's copy for its queries, keys and values changes in it, normalised on
        its own: dx = ln_1(copy) - ln_1(resid_pre) [B, T, H, C], None for a copy handed back as it was. That is
        0 unless a hook edited the copy, so an edit there reaches only its path; ln1's hooks act on the stream
        whatever else is asked for; and a gradient reaches both."""
        per_path = (self.hook_q_input, self.hook_k_input, self.hook_v_input)
        if hooks is None or not any(hooks.active(h.name) for h in (self.hook_attn_in, *per_path)):
            return self.ln_1(resid_pre, hooks), None
        B, T, C = resid_pre.shape
        copies = resid_pre[:, :, None].expand(B, T, self.attn.n_head, C)  # [B, T, H, C]
        attn_in = self.hook_attn_in(copies, hooks)
        inputs = [h(attn_in, hooks) for h in per_path]
        normalized = self.ln_1(resid_pre, hooks)  # [B, T, C]
        if all(x is copies for x in inputs):  # handed back as they were (a capture): every dx is 0
            return normalized, None
        unedited = self.ln_1(copies)  # [B, T, H, C]: the same values as each input's, unless it was edited
        dq, dk, dv = (None if x is copies else self.ln_1(x) - unedited for x in inputs)
        return normalized, (dq, dk, dv)


class GPT(nn.Module):
    """GPT-2: token and position embeddings, `n_layer` Pre-LN blocks (attention, then the MLP, each added to
    the residual stream), a final LayerNorm and the LM head tied to the token embedding. `forward` gives the
    logits, with a KV cache (generation) or without, handing every hook point's value to `hooks`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding, also the LM head
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)  # learned position embedding
        self.h = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.layer_norm_epsilon, "ln_final")
        self.lm_head = TiedLMHead()  # reads wte.weight
        self.hook_embed = HookPoint("hook_embed")
        self.hook_pos_embed = HookPoint("hook_pos_embed")
        self.hook_unembed_in = HookPoint("unembed.hook_in")
        self.hook_unembed_out = HookPoint("unembed.hook_out")
        self.hook_logits = HookPoint("logits")  # the same values as unembed.hook_out, under the older name

    @property
    def hook_names(self) -> list[str]:
        return hook_names(self.config.n_layer)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None = None, hooks: Hooks | None = None) -> torch.Tensor:
        """The residual stream entering block 0 [B, T, C]: the embeddings of tokens `idx` [B, T] at positions
        `pos` [B, T] (by default 0 .. T - 1, checked against the context)."""
        B, T = idx.shape
        if pos is None:
            if T > self.config.n_positions:
                raise ValueError(f"sequence of {T} tokens exceeds the context of {self.config.n_positions}")
            pos = torch.arange(T, device=idx.device).expand(B, T)
        tok_emb = self.hook_embed(self.wte(idx), hooks)  # [B, T, C]
        pos_emb = self.hook_pos_embed(self.wpe(pos), hooks)  # [B, T, C]
        return tok_emb + pos_emb

    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | PackedBatch | None = None,
        hooks: Hooks | None = None,
        last_only: bool = False,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids `idx` [B, T] (only the last position's, [B, 1, vocab], if
        `last_only`). With a `cache`, `idx` continues each row's sequence and its keys and values are stored;
        `positions` [B, 1] (a device tensor) makes that a fixed-shape decode step, as CUDA graphs need. With a
        `PackedBatch`, `idx` [1, N] is its tokens side by side and the logits [1, len(outputs), vocab] are
        those at its `outputs` (its `hooks` are then a `RowHooks`: each sequence sees its own tokens)."""
        T = idx.shape[1]
        if hooks is not None:  # a pass from position 0 begins a sequence: a capture holds one sequence
            begin_pass(hooks, cache is None or (isinstance(cache, KVCache) and max(cache.lengths) == 0))
        if isinstance(cache, PackedBatch):
            assert not last_only, "a packed pass picks its own outputs"
        pos = None  # without a cache: 0 .. T - 1
        if cache is not None and positions is not None:
            assert isinstance(cache, KVCache)
            pos = cache.begin_static(positions)  # [B, 1]
        elif cache is not None:
            pos = cache.begin(T)  # [B, T]: each row goes on from its own length
        x = self.embed(idx, pos, hooks)
        for block in self.h:
            x = block(x, cache, hooks)
        rows: Rows | None = LAST if last_only else None
        if isinstance(cache, PackedBatch):
            x, rows = x[:, cache.outputs], cache.logit_rows
        return self.unembed(x, hooks, rows)

    def block_by_block(self, idx: torch.Tensor, hooks: Hooks | None = None) -> Iterator[torch.Tensor]:
        """The forward pass over `idx` [B, T] without a cache, a block at a time: the stream [B, T, C] leaving
        each block in turn (the first with the embeddings), for work cut into pieces that other work runs
        between (the lab's passes on the server's engine)."""
        if hooks is not None:  # a pass from position 0, as `forward`'s without a cache
            begin_pass(hooks, True)
        x = self.embed(idx, hooks=hooks)
        for block in self.h:
            x = block(x, None, hooks)
            yield x

    def final_norm(self, x: torch.Tensor, hooks: Hooks | None = None) -> torch.Tensor:
        """The streams leaving the last block x [B, T, C] through the final LayerNorm: what the LM head reads."""
        return self.hook_unembed_in(self.ln_f(x, hooks), hooks)

    def unembed(self, x: torch.Tensor, hooks: Hooks | None = None, rows: Rows | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of the streams leaving the last block x [B, T, C] (only those at positions
        `rows`, [B, len(rows), vocab], if given; `LAST`: the last position's): the final LayerNorm, then the
        LM head, tied to the token embedding. The other positions go only as far as the hook points in use
        need them: through the final LayerNorm for its hooks (`uses_the_head`), through the head's product
        too for its output's (`uses_the_logits`)."""
        if rows is not None and not uses_the_head(hooks):
            x, rows = x[:, rows], None
        x = self.final_norm(x, hooks)
        if rows is not None and not uses_the_logits(hooks):  # ln_f's hooks saw every position; the product not
            x, rows = x[:, rows], None
        logits = self.head(x, hooks)  # [B, T, vocab]
        return logits if rows is None else logits[:, rows]

    def head(self, x: torch.Tensor, hooks: Hooks | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of the streams through the final LayerNorm x [B, T, C]: the LM head's product,
        tied to the token embedding, with the hooks of its output."""
        logits = self.hook_unembed_out(self.lm_head(x, self.wte.weight), hooks)
        return self.hook_logits(logits, hooks)
