"""Drop-in layers that send products of up to `max_rows()` rows (decode steps, prompt chunks, most prefills)
to our kernels (`model.kernels`), and everything else (longer products, autograd, other dtypes and devices)
to the stock layers they replace.

`use_kernels(model)` swaps them in after loading; the parameters are the same tensors, so hooks, edits,
`state_dict` and export see no difference. The weights must lie as the kernels read them, one output's
weights contiguous ([out, in] in memory: `model.loading._stored` lays them out so when the kernels are on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..gpt import GPT, Conv1D, TiedLMHead
from . import available, matmul, usable


class KernelConv1D(Conv1D):
    """`Conv1D` (y = x W + b, W [in, out]) whose products of up to `max_rows()` rows run on our kernel, reading W
    as W.T [out, in]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_t = self.weight.t()  # [out, in], contiguous rows as _stored lays them out
        if usable(x, self.weight, self.bias) and w_t.stride(1) == 1:
            return matmul(x, w_t, self.bias)
        return super().forward(x)


class KernelLMHead(TiedLMHead):
    """The tied LM head, logits = x @ wte.T, on our kernel up to max_rows() rows (wte [vocab, C] row-major)."""

    def forward(self, x: torch.Tensor, wte: torch.Tensor) -> torch.Tensor:
        if usable(x, wte) and wte.stride(1) == 1:
            return matmul(x, wte)
        return super().forward(x, wte)


def replace_modules(
    model: nn.Module, kinds: type[nn.Module] | tuple[type[nn.Module], ...], make: Callable[[Any], nn.Module]
) -> None:
    """Replace every submodule of one of the types `kinds` (exactly: not their other subclasses) by `make(old)`."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    for name, module in list(model.named_modules()):
        if type(module) in kinds:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, make(module))


def _kernel_conv1d(old: Conv1D) -> KernelConv1D:
    new = KernelConv1D.__new__(KernelConv1D)
    nn.Module.__init__(new)
    new.weight, new.bias = old.weight, old.bias
    return new


def use_kernels(model: GPT) -> bool:
    """Swap our kernel layers into a float32 CPU model; returns whether it did (False: kernels unavailable,
    or the model is not float32 on a CPU)."""
    w = model.wte.weight
    if w.device.type != "cpu" or w.dtype != torch.float32 or not available():
        return False
    replace_modules(model, Conv1D, _kernel_conv1d)
    replace_modules(model, TiedLMHead, lambda old: KernelLMHead())
    return True
