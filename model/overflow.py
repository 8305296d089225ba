"""Where a LayerNorm leaves its dtype's range: a stream whose values are finite but so large (in float32,
from about 1e18 at GPT-2's widths) that the variance LayerNorm computes, the mean of (x - mean)², is inf.
Then sqrt(var + eps) is inf and LayerNorm normalises the row to 0 (or NaN) while x itself looks fine, and
every gradient through it is 0 with a finite metric. The lab's measures (`analysis.analyze`) and gradients
(`lab.gradients`, `lab.attribution`) watch each LayerNorm's input for it and refuse such a run, naming the
LayerNorm.
"""

from __future__ import annotations

import torch


def dtype_range(dtype: torch.dtype) -> str:
    """How an error names the range a value left: "float16's range (it ends at 65504)"."""
    return f"{str(dtype).removeprefix('torch.')}'s range (it ends at {torch.finfo(dtype).max:.6g})"


def layer_norm_inputs(n_layer: int) -> dict[str, str]:
    """Each hook point whose value a LayerNorm normalises, and that LayerNorm (TransformerLens' name): ln1
    reads hook_resid_pre (and, when asked for, each head's own copy, hook_q_input ...), ln2 hook_mlp_in,
    ln_final the last block's hook_resid_post."""
    out: dict[str, str] = {}
    for i in range(n_layer):
        for site in ("hook_resid_pre", "hook_q_input", "hook_k_input", "hook_v_input"):
            out[f"blocks.{i}.{site}"] = f"blocks.{i}.ln1"
        out[f"blocks.{i}.hook_mlp_in"] = f"blocks.{i}.ln2"
    out[f"blocks.{n_layer - 1}.hook_resid_post"] = "ln_final"
    return out


def variance_overflows(x: torch.Tensor) -> torch.Tensor:
    """Whether LayerNorm's variance of some finite row of x [..., C] is out of the range of the dtype it is
    computed in (x's, at least float32): the sum of (x - mean)² overflows (in float32, |x| from about 1e18 at
    GPT-2's widths), so sqrt(var + eps) is inf and the row is normalised to 0 (or NaN) while x itself is
    finite. A bool tensor (no sync)."""
    x = x.detach().to(torch.promote_types(x.dtype, torch.float32))
    var = (x - x.mean(dim=-1, keepdim=True)).square_().mean(dim=-1)  # as LayerNorm computes it
    return (x.isfinite().all(dim=-1) & ~var.isfinite()).any()


def layer_norm_overflow(ln: str, dtype: torch.dtype, edited: bool) -> str:
    """The start of a one-line error for LayerNorm `ln` whose variance overflowed (`variance_overflows`) on
    an input of `dtype`."""
    stats = str(torch.promote_types(dtype, torch.float32)).removeprefix("torch.")
    cause = "the edits pushed the residual stream" if edited else "the residual stream grew"
    return (
        f"LayerNorm {ln} overflowed: {cause} past {stats}'s range for its variance ((x - mean)² is inf), "
        "so it normalised the stream to 0 instead of to unit variance"
    )
