"""TransformerLens as an oracle: its `HookedTransformer` built from one of our random checkpoints (no
download, no weight processing unless asked: its own config with `gelu_new` and LayerNorm, the weights
through its GPT-2 converter). Import it only after `pytest.importorskip("transformer_lens")`."""

from __future__ import annotations

import torch
import transformer_lens as tl
from conftest import Checkpoint
from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

# the config switches that create TransformerLens' optional hooks (use_attn_in apart: TransformerLens
# takes the per-head inputs from it or from use_split_qkv_input)
SWITCHES: dict[str, dict[str, bool]] = {
    "default": {},
    "split": {"use_attn_result": True, "use_split_qkv_input": True, "use_hook_mlp_in": True},
    "attn_in": {"use_attn_in": True},
}


def tl_config(ck: Checkpoint, dtype: torch.dtype, **switches: bool) -> tl.HookedTransformerConfig:
    c = ck.hf.config
    return tl.HookedTransformerConfig(
        n_layers=c.n_layer,
        d_model=c.n_embd,
        n_ctx=c.n_positions,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=4 * c.n_embd,
        d_vocab=c.vocab_size,
        act_fn="gelu_new",
        normalization_type="LN",
        eps=c.layer_norm_epsilon,
        original_architecture="GPT2LMHeadModel",
        dtype=dtype,
        device="cpu",
        **switches,
    )


def tl_weights(ck: Checkpoint, cfg: tl.HookedTransformerConfig) -> dict[str, torch.Tensor]:
    return {k: v.to(cfg.dtype) for k, v in convert_gpt2_weights(ck.hf, cfg).items()}


def hooked(ck: Checkpoint, dtype: torch.dtype, **switches: bool) -> tl.HookedTransformer:
    """TransformerLens' model with `ck`'s weights as they are (`from_pretrained_no_processing`)."""
    cfg = tl_config(ck, dtype, **switches)
    model = tl.HookedTransformer(cfg)
    model.load_state_dict(tl_weights(ck, cfg), strict=False)
    return model.eval()
