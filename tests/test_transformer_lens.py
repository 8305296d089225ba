"""TransformerLens itself as the oracle for every hook name we serve.

A `HookedTransformer` is built from the same random checkpoints as ours (no download, no weight
processing: its own config with `gelu_new` and LayerNorm, weights through its GPT-2 converter), and every
hook name, default and optional, is compared with `run_with_cache`: float64 to 1e-9, float32 to 1e-4.
The optional hooks are compared against a second TransformerLens model with the switches that create
them (`use_attn_result`, `use_split_qkv_input`, `use_hook_mlp_in`; `use_attn_in` on a third, since
TransformerLens takes the per-head inputs from one or the other).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Checkpoint, load_ours, make_checkpoint

from model.generate import SamplingParams, generate
from model.gpt import GPT
from model.hooks import OPTIONAL_SITES, Capture, hook_names, is_optional
from model.interventions import Edit, EditSpec

pytest.importorskip("transformer_lens", reason="TransformerLens (test-only oracle) is not installed")
from tl_oracle import SWITCHES, hooked

EXACT = 1e-9
F32 = 1e-4


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """An odd shape: 3 layers, 3 heads of 20, a context of 40."""
    return make_checkpoint(Path(tmp_path_factory.mktemp("odd")), n_layer=3, n_head=3, n_embd=60, n_positions=40)


def ours_and_theirs(ck: Checkpoint, ids: torch.Tensor, dtype: torch.dtype, switches: str):
    ours = load_ours(ck, dtype)
    names = [n for n in hook_names(ours.config.n_layer) if n != "logits"]  # logits: ours only (= unembed.hook_out)
    if switches == "default":
        names = [n for n in names if not is_optional(n)]
    elif switches == "attn_in":
        names = [n for n in names if n.endswith("hook_attn_in")]
    else:
        names = [n for n in names if not n.endswith("hook_attn_in")]
    capture = Capture(names)
    with torch.inference_mode():
        ours(ids, hooks=capture)
        _, cache = hooked(ck, dtype, **SWITCHES[switches]).run_with_cache(ids)
    return capture.tensors(), cache, names


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("switches", list(SWITCHES))
@pytest.mark.parametrize("checkpoint", ["tiny", "tiny_hub", "odd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_hook_equals_transformer_lens(
    checkpoint: str, switches: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    ck: Checkpoint = request.getfixturevalue(checkpoint)
    ids = torch.randint(0, ck.hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    ours, theirs, names = ours_and_theirs(ck, ids, dtype, switches)
    tol = EXACT if dtype == torch.float64 else F32
    assert names and set(names) <= set(theirs.keys()), sorted(set(names) - set(theirs.keys()))
    for name in names:
        want = theirs[name]
        if switches != "default" and ".ln1." in name:
            # with per-head inputs TransformerLens normalises each head's copy ([batch, pos, head, d]); each
            # copy is the one stream ours serves
            want = want[:, :, 0]
        got = ours[name]
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} against TransformerLens' {tuple(want.shape)}"
        assert got.dtype == want.dtype, name
        if name.endswith("hook_attn_scores"):  # masked entries: TransformerLens writes -inf too
            assert torch.equal(got.isinf(), want.isinf()), name
            got, want = got.masked_fill(got.isinf(), 0), want.masked_fill(want.isinf(), 0)
        assert max_diff(got, want) <= tol, f"{name}: {max_diff(got, want):.3g}"


def test_optional_sites_are_all_served() -> None:
    """Every optional site TransformerLens' GPT-2 has is one of ours."""
    assert set(OPTIONAL_SITES) == {
        "hook_attn_in",
        "hook_q_input",
        "hook_k_input",
        "hook_v_input",
        "attn.hook_result",
        "hook_mlp_in",
    }


def test_activations_of_a_generation_equal_transformer_lens_on_the_final_sequence(tiny: Checkpoint) -> None:
    ours = load_ours(tiny)
    names = [n for n in hook_names(2) if n != "logits" and not n.endswith("hook_attn_in")]
    params = SamplingParams(max_new_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    [completion] = generate(ours, [[464, 2068, 7586, 21831]], params, hooks=names)
    assert completion.activations is not None
    sequence = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.inference_mode():
        _, cache = hooked(tiny, torch.float32, **SWITCHES["split"]).run_with_cache(sequence)
    for name in names:
        want = cache[name][:, :, 0] if ".ln1." in name else cache[name]
        got = completion.activations[name]
        assert got.shape == want.shape, name
        if name.endswith("hook_attn_scores"):
            got, want = got.masked_fill(got.isinf(), 0), want.masked_fill(want.isinf(), 0)
        assert max_diff(got, want) <= F32, f"{name}: {max_diff(got, want):.3g}"


EDITS = [
    # (our edit, the same change as a TransformerLens hook, the switches it needs)
    (Edit("blocks.0.ln1.hook_normalized", "scale", factor=1.5), lambda x, hook: x * 1.5, "default"),
    (Edit("blocks.1.ln2.hook_scale", "scale", factor=2.0), lambda x, hook: x * 2.0, "default"),
    (Edit("ln_final.hook_normalized", "zero", positions=(3,)), None, "default"),
    (Edit("blocks.1.attn.hook_result", "zero", heads=(2,)), None, "split"),
    # (ln_1 follows the per-head inputs, so scaling one by a positive factor would change next to nothing)
    (Edit("blocks.0.hook_q_input", "scale", factor=0.0, heads=(1,)), None, "split"),
    (Edit("blocks.1.hook_v_input", "scale", factor=-3.0), lambda x, hook: x * -3.0, "split"),
    (Edit("blocks.0.hook_mlp_in", "scale", factor=0.0), lambda x, hook: x * 0.0, "split"),
    (Edit("blocks.1.hook_attn_in", "scale", factor=-1.0), lambda x, hook: -x, "attn_in"),
]


def _tl_hook(edit: Edit):
    def hook(x: torch.Tensor, hook: object) -> torch.Tensor:
        x = x.clone()
        if edit.heads is not None:
            x[:, :, list(edit.heads)] *= edit.factor or 0.0
        elif edit.positions is not None:
            x[:, list(edit.positions)] = 0
        else:
            x *= edit.factor or 0.0
        return x

    return hook


@pytest.mark.parametrize(("edit", "fn", "switches"), EDITS, ids=[e.hook for e, _, _ in EDITS])
def test_an_edit_at_a_hook_acts_as_the_same_hook_in_transformer_lens(
    tiny: Checkpoint, tiny_model: GPT, edit: Edit, fn, switches: str
) -> None:
    """An edit at `hook_normalized` acts before the gain and bias, one at `hook_q_input` on the queries'
    input only, and so on: as the same change made by a TransformerLens hook."""
    ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        ours = tiny_model(ids, hooks=EditSpec((edit,)).hooks(tiny_model.config, 12))
        plain = tiny_model(ids)
        theirs = hooked(tiny, torch.float32, **SWITCHES[switches]).run_with_hooks(
            ids, fwd_hooks=[(edit.hook, fn or _tl_hook(edit))]
        )
    assert max_diff(ours, theirs) <= F32
    assert max_diff(ours, plain) > 1e-3, "the edit should change the logits"


def test_edits_of_a_per_head_input_and_of_ln1_in_one_layer_are_refused(tiny_model: GPT) -> None:
    from model.interventions import InterventionError

    spec = EditSpec((Edit("blocks.0.hook_k_input", "zero"), Edit("blocks.0.ln1.hook_scale", "scale", factor=2.0)))
    with pytest.raises(InterventionError, match="cannot be combined"):
        spec.hooks(tiny_model.config, 8)
    # in different layers they are fine
    EditSpec((Edit("blocks.0.hook_k_input", "zero"), Edit("blocks.1.ln1.hook_scale", "scale", factor=2.0))).hooks(
        tiny_model.config, 8
    )


def test_capturing_the_optional_hooks_leaves_the_logits_as_they_are(tiny_model: GPT) -> None:
    """Asking for per-head inputs, head results and mlp_in computes them without changing the output."""
    ids = torch.randint(0, 50257, (1, 10), generator=torch.Generator().manual_seed(2))
    optional = [n for n in hook_names(2) if is_optional(n)]
    with torch.inference_mode():
        plain = tiny_model(ids)
        captured = tiny_model(ids, hooks=Capture(optional))
    assert max_diff(plain, captured) <= 1e-5


def test_the_servers_dump_of_every_hook_equals_transformer_lens(tiny: Checkpoint, loaded) -> None:
    """`/v1/activations` with `"hooks": ["*"]` (every default hook) and the optional ones by name, against
    `run_with_cache` of TransformerLens' model with the switches on."""
    import safetensors.torch
    from inprocess import serve

    ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(9))
    optional = ["blocks.*.attn.hook_result", "blocks.*.hook_q_input", "blocks.*.hook_mlp_in"]
    with serve(loaded) as client:
        r = client.post(
            "/v1/activations", json={"input_ids": ids[0].tolist(), "activations": {"hooks": ["*", *optional]}}
        )
        assert r.status_code == 200, r.text
        dump = safetensors.torch.load(r.content)
    with torch.inference_mode():
        _, default = hooked(tiny, torch.float32).run_with_cache(ids)
        _, switched = hooked(tiny, torch.float32, **SWITCHES["split"]).run_with_cache(ids)
    served = [n for n in dump if n != "logits"]
    assert len(served) == len(hook_names(2, optional=False)) - 1 + 3 * 2
    for name in served:
        want = switched[name] if is_optional(name) else default[name]
        got = dump[name]
        if name.endswith("hook_attn_scores"):
            got, want = got.masked_fill(got.isinf(), 0), want.masked_fill(want.isinf(), 0)
        assert got.shape == want.shape, name
        assert max_diff(got, want) <= F32, f"{name}: {max_diff(got, want):.3g}"
