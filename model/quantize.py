"""Weight-only int8: every projection and the LM head hold int8 weights with one float32 scale per output
channel (symmetric: w ~= q * scale, q in -127..127, scale = max |w| of the channel / 127); activations,
LayerNorms, biases, embeddings and the KV cache stay float32.

`quantize_(model)` swaps the layers of a loaded float32 model in place. On a CPU the products of up to
`kernels.max_rows()` rows (decode steps, prompt chunks and most prefills) run on our int8 kernel
(`model/kernels/matmul.h`: inside each product the row of x is rounded to int16 with a scale of its own, 15
bits, finer than bfloat16; int32 sums, float32 accumulation and output); longer products, other devices
(CUDA) and autograd dequantize the weight and use torch's float32 matmul. Hooks, edits and dumps work as on
float32: they see the float32 activations of the quantized model.
`state_dict` (and so `save_checkpoint`) gives the dequantized weights, q * scale, in the float32 layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import huge_pages, kernels
from .gpt import ALL, GPT, Conv1D, TiedLMHead
from .kernels.layers import KernelConv1D, KernelLMHead, replace_modules

QMAX = 127  # symmetric: -127..127 (-128 unused, so that -q is always representable)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8, scale [N] float32) with w ~= q * scale[:, None], row by row (each row
    is one output channel). An all-zero row gets scale 1 (q = 0). For a float32 w (a row-major view or not),
    one float32 copy is made, row-major, and rounded in place (the LM head's is 147 MiB on gpt2-small)."""
    w = w.float()
    lo, hi = torch.aminmax(w, dim=1)  # [N] each: max |w| without a copy of |w|
    amax = torch.maximum(-lo, hi)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    steps = torch.div(w, scale[:, None], out=torch.empty(w.shape, device=w.device))  # [N, K] row-major
    return steps.round_().clamp_(-QMAX, QMAX).to(torch.int8), scale.contiguous()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] int8, scale [N] -> [N, K] in `dtype`: one copy of the weight in `dtype` (scaled in place)."""
    return q.to(dtype, copy=True).mul_(scale.to(dtype)[:, None])  # (a copy even where dtype is q's)


def _int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ (q * scale).T + bias -> [..., N]: our CPU kernel for a few rows, else dequantize + matmul
    (`_DequantizedProduct` where x needs a gradient)."""
    if kernels.usable(x, bias) and x.device == q.device:
        return kernels.matmul_int8(x, q, scale, bias)
    if torch.is_grad_enabled() and x.requires_grad:
        y = _DequantizedProduct.apply(x, q, scale)
    else:
        y = x @ dequantize_rows(q, scale, x.dtype).T  # [N, K], transient
    return y if bias is None else y + bias


class _DequantizedProduct(torch.autograd.Function):
    """x [..., K] @ (q * scale).T for an x that needs a gradient: the weight is dequantized for the product and
    again for the gradient, never kept. (Autograd would keep each product's float32 copy for the backward
    pass, every layer's for as long as a gradient's graph lives: 475 MB for gpt2-small, uncounted by the
    gradient limits.) The gradient goes to x alone: the int8 weights are no parameters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, scale)  # the model's own buffers: nothing new is held
        return x @ dequantize_rows(q, scale, x.dtype).T

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        q, scale = ctx.saved_tensors
        return grad @ dequantize_rows(q, scale, grad.dtype), None, None


class _DequantizedEinsum(torch.autograd.Function):
    """`Conv1D.einsum` for W = (q * scale).T and an x that needs a gradient (the per-head products: TransformerLens'
    per-head inputs, `hook_result`), as `_DequantizedProduct`: the outputs' rows dequantized for the product and
    again for the gradient, never kept. The gradient of "A,B->C" is einsum("C,B->A", grad, B), which holds
    where each index of A is in B or C (as in every product here)."""

    @staticmethod
    def forward(
        ctx: Any, equation: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]
    ) -> torch.Tensor:
        inputs, out = equation.replace(" ", "").split("->")
        a, b = inputs.split(",")
        assert set(a) <= set(b) | set(out), equation
        ctx.save_for_backward(q, scale)  # views of the model's own buffers: nothing new is held
        ctx.backward_equation, ctx.shape = f"{out},{b}->{a}", shape
        return torch.einsum(equation, x, dequantize_rows(q, scale, x.dtype).t().reshape(shape))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None, None]:
        q, scale = ctx.saved_tensors
        w = dequantize_rows(q, scale, grad.dtype).t().reshape(ctx.shape)
        return None, torch.einsum(ctx.backward_equation, grad, w), None, None, None


class Int8Conv1D(nn.Module):
    """`Conv1D` (y = x W + b) with W held as int8 rows of W.T ([out, in]) and a scale per output."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] float32

    def __init__(self, dense: Conv1D) -> None:
        super().__init__()
        q, scale = quantize_rows(dense.weight.detach().t())  # W.T: [out, in], one row per output channel
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = dense.bias

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized W [in, out] (float32; a fresh tensor), for code that reads the dense weight."""
        return dequantize_rows(self.q, self.scale).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _int8_matmul(x, self.q, self.scale, self.bias)

    def einsum(self, equation: str, x: torch.Tensor, shape: tuple[int, ...], outputs: slice = ALL) -> torch.Tensor:
        """`Conv1D.einsum`, dequantizing only the outputs' rows; a gradient's graph keeps no copy of them
        (`_DequantizedEinsum`, which without a gradient is the plain product)."""
        return _DequantizedEinsum.apply(equation, x, self.q[outputs], self.scale[outputs], shape)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight.contiguous()  # as Conv1D's: [in, out]
        destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()


class Int8LMHead(TiedLMHead):
    """The tied LM head on an int8 copy of wte (one scale per vocabulary row); the embedding lookup keeps
    the float32 wte."""

    q: torch.Tensor  # [vocab, C] int8
    scale: torch.Tensor  # [vocab] float32

    def __init__(self, wte: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_rows(wte.detach())  # [vocab, C]
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, x: torch.Tensor, wte: torch.Tensor) -> torch.Tensor:
        return _int8_matmul(x, self.q, self.scale, None)


def quantize_(model: GPT) -> GPT:
    """Replace `model`'s projections and LM head by int8 ones, in place (float32 model in, same device): the
    stock layers or, in a model `load` gave to a CPU, our kernels' (`use_kernels`)."""
    if model.wte.weight.dtype != torch.float32:  # rounding float16's or bfloat16's rounding again
        raise ValueError(f"quantize_ takes a float32 model, got {str(model.wte.weight.dtype).removeprefix('torch.')}")
    for name, p in model.named_parameters():  # a NaN in a row would quantize it to zeros, an inf make its scale inf
        if not torch.isfinite(p).all():
            raise ValueError(f"quantize_ takes finite weights: {name} holds inf or NaN (the model is left as it was)")
    replace_modules(model, (Conv1D, KernelConv1D), Int8Conv1D)
    replace_modules(model, (TiedLMHead, KernelLMHead), lambda _: Int8LMHead(model.wte.weight))
    if model.wte.weight.device.type == "cpu":  # into huge pages, a new mapping: `load` may have moved the float32
        huge_pages.move_or_stay(model, again=True)  # weights into one, which would live on as long as wte does
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a forward pass reads: parameters and buffers, each once (a quantized model's
    int8 weights and scales are buffers)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.nbytes for t in tensors.values())
