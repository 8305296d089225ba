"""Steering edits on the model (`steer`, `orthogonal`, `projection_cap`, `clamp`) and contrastive vectors.

The identities: scale 0, a clamp to the present value and removing a direction orthogonal to the stream
leave the logits unchanged; a steered generation equals one forward pass over the final sequence with
the same edit; each method's arithmetic is checked on the values it edits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sae_files import write_sae

from model.generate import SamplingParams, generate
from model.gpt import GPT
from model.hooks import Capture, run_with_cache
from model.interventions import Edit, EditSpec, HookChain, InterventionError
from model.lab import steering
from model.lab.sae import SAE, load_sae
from model.lab.steering import DirectionError, Directions, SteeringVector, contrastive_vector

HOOK = "blocks.1.hook_resid_pre"
IDS = [5, 99, 1234, 7, 42, 300, 11]


def logits(model: GPT, ids: list[int], *edits: Edit) -> torch.Tensor:
    spec = EditSpec(tuple(edits))
    with torch.inference_mode():
        return model(torch.tensor([ids]), hooks=spec.hooks(model.config, len(ids)))[0]


@pytest.fixture(scope="module")
def sae(tmp_path_factory: pytest.TempPathFactory, tiny_model: GPT) -> SAE:
    d = tiny_model.config.n_embd
    return load_sae(write_sae(tmp_path_factory.mktemp("sae"), hook=HOOK, d_in=d, d_sae=4 * d, seed=3))


def stream(model: GPT, ids: list[int], hook: str = HOOK) -> torch.Tensor:
    with torch.inference_mode():
        return run_with_cache(model, torch.tensor([ids]), [hook])[hook][0]  # [T, d]


def test_identities_leave_logits_unchanged(tiny_model: GPT, sae: SAE) -> None:
    plain = logits(tiny_model, IDS)
    d = tiny_model.config.n_embd
    v = torch.randn(d, generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(tiny_model, IDS, Edit(HOOK, "steer", factor=0.0, direction=v)), plain)
    matched = Edit(HOOK, "steer", factor=0.0, direction=v, norm_match=True)  # no rescaling's rounding either
    assert torch.equal(logits(tiny_model, IDS, matched), plain)
    x = stream(tiny_model, IDS)  # [T, d]
    f = sae.encode(sae.read(x))
    active = int(f.sum(0).argmax())  # a feature that is on at some positions
    assert (f[:, active] > 0).any()
    for p in range(len(IDS)):  # each position's feature clamped to its own present value
        present = float(sae.feature(sae.read(x[None, [p]]), active)[0, 0])  # as the edit computes it, [1, 1, d]
        clamp = Edit(HOOK, "clamp", factor=present, sae=sae, feature=active, positions=(p,))
        assert torch.equal(logits(tiny_model, IDS, clamp), plain)
    # a direction orthogonal to every position's vector: the stream has no component to remove
    q, _ = torch.linalg.qr(x.T.double())  # [d, T]: a basis of the positions' span
    u = v.double() - q @ (q.T @ v.double())
    assert float((x.double() @ u).abs().max()) < 1e-6 * float(u.norm())
    torch.testing.assert_close(logits(tiny_model, IDS, Edit(HOOK, "orthogonal", direction=u.float())), plain)
    # and the edits do act when they should
    assert not torch.allclose(logits(tiny_model, IDS, Edit(HOOK, "steer", factor=4.0, direction=v)), plain)
    moved = Edit(HOOK, "clamp", factor=float(f[:, active].max()) + 5, sae=sae, feature=active)
    assert not torch.allclose(logits(tiny_model, IDS, moved), plain)


def test_each_method_on_the_values_it_edits(tiny_model: GPT, sae: SAE) -> None:
    x = stream(tiny_model, IDS)
    v = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(1))
    u = v / v.norm()

    def edited(edit: Edit) -> torch.Tensor:
        cap = Capture([HOOK, "blocks.1.hook_resid_mid"])
        spec = EditSpec((edit,))
        from model.interventions import HookChain

        with torch.inference_mode():
            tiny_model(torch.tensor([IDS]), hooks=HookChain(spec.hooks(tiny_model.config, len(IDS)), cap))
        return cap.tensors()[HOOK][0]

    torch.testing.assert_close(edited(Edit(HOOK, "steer", factor=2.5, direction=v)), x + 2.5 * v)
    steered = edited(Edit(HOOK, "steer", factor=2.5, direction=v, norm_match=True, positions=(1, 3)))
    torch.testing.assert_close(steered.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(steered[[0, 2, 4]], x[[0, 2, 4]]) and not torch.allclose(steered[1], x[1])
    removed = edited(Edit(HOOK, "orthogonal", direction=v * 7))
    torch.testing.assert_close(removed @ u, torch.zeros(len(IDS)), atol=1e-5, rtol=0)
    torch.testing.assert_close(removed, x - (x @ u)[:, None] * u)
    proj = x @ u
    cap = float(proj.median())
    capped = edited(Edit(HOOK, "projection_cap", factor=cap, direction=v))
    torch.testing.assert_close(capped @ u, proj.clamp(max=cap), atol=1e-5, rtol=0)
    under = proj <= cap
    assert torch.equal(capped[under], x[under])  # components below the cap untouched
    f = sae.encode(sae.read(x))
    clamped = edited(Edit(HOOK, "clamp", factor=3.0, sae=sae, feature=7))
    f_new = f.clone()
    f_new[:, 7] = 3.0
    torch.testing.assert_close(clamped, x + sae.decode(f_new) - sae.decode(f), atol=1e-5, rtol=0)
    # and the SAE now reads the clamped value at that feature (its error term carried along)
    _, x_hat = sae.reconstruct(sae.read(x))
    torch.testing.assert_close(clamped, sae.decode(f_new) + (x - x_hat), atol=1e-5, rtol=0)


def test_steered_generation_equals_one_forward_pass(tiny_model: GPT, sae: SAE) -> None:
    """Each new token was steered at its own position: the same edit on one pass over the final sequence
    gives the same next-token log-probabilities at every generated position."""
    edits = (
        Edit(HOOK, "steer", factor=6.0, direction=sae.direction(3)),
        Edit("blocks.0.hook_mlp_out", "projection_cap", factor=0.1, direction=sae.direction(5)),
        Edit(HOOK, "clamp", factor=2.0, sae=sae, feature=9, positions=(2, 8, 9)),
    )
    spec = EditSpec(edits)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    (out,) = generate(tiny_model, [IDS], params, edits=spec)
    (plain,) = generate(tiny_model, [IDS], params)
    assert out.token_ids != plain.token_ids  # the steering changed what was generated
    full = IDS + out.token_ids
    with torch.inference_mode():
        lp = torch.log_softmax(tiny_model(torch.tensor([full]), hooks=spec.hooks(tiny_model.config, len(full)))[0], -1)
    assert out.logprobs is not None
    for i, (tok, got) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        at = len(IDS) - 1 + i
        assert tok == int(lp[at].argmax())
        assert got.logprob == pytest.approx(float(lp[at, tok]), abs=1e-4)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (Edit(HOOK, "steer", factor=1.0, direction=torch.ones(3)), r"direction of shape \[3\] does not fit"),
        (Edit(HOOK, "steer", direction=torch.ones(64)), "steer needs a scale"),
        (
            Edit(HOOK, "steer", factor=float("inf"), direction=torch.ones(64)),
            "scale inf is not a finite",
        ),  # as a steer names it
        (Edit(HOOK, "steer", factor=1.0, direction=torch.full((64,), float("nan"))), "not finite in float32"),
        (Edit(HOOK, "orthogonal", direction=torch.zeros(64)), "not zero"),
        (Edit(HOOK, "orthogonal", direction=torch.ones(0)), r"direction of shape \[0\] does not fit"),
        (Edit(HOOK, "projection_cap", factor=1.0, direction=torch.ones(0)), r"direction of shape \[0\]"),
        (Edit("blocks.0.attn.hook_v", "steer", factor=1.0, direction=torch.ones(64)), "one vector per position"),
        (
            Edit("blocks.0.attn.hook_z", "steer", factor=1.0, direction=torch.ones(16)),
            r"give \[64\] \(in Python also \[4, 16\]\)",
        ),
        (Edit("blocks.0.attn.hook_pattern", "orthogonal", direction=torch.ones(64)), "one vector per position"),
        (Edit(HOOK, "projection_cap", direction=torch.ones(64)), "projection_cap needs a value"),
        (Edit(HOOK, "clamp", factor=1.0), "clamp needs an SAE and a feature"),
    ],
)
def test_bad_edits(tiny_model: GPT, edit: Edit, message: str) -> None:
    with pytest.raises(InterventionError, match=message):
        EditSpec((edit,)).hooks(tiny_model.config, 8)


@pytest.mark.parametrize("size", [1e20, 1e-25])
def test_orthogonal_along_a_direction_of_any_size(tiny_model: GPT, size: float) -> None:
    """A direction of huge or tiny entries (finite in float32) is the same direction: its norm, squared on
    the way, would overflow to inf (and the unit vector to 0, a no-op) or underflow to 0 (refused)."""
    d = torch.zeros(tiny_model.config.n_embd)
    d[3], d[7] = size, -2 * size
    idx = torch.tensor([IDS])

    def logits(direction: torch.Tensor | None) -> torch.Tensor:
        edits = None if direction is None else EditSpec((Edit(HOOK, "orthogonal", direction=direction),))
        return run_with_cache(tiny_model, idx, ["logits"], edits and edits.hooks(tiny_model.config, len(IDS)))["logits"]

    torch.testing.assert_close(logits(d), logits(d / size))
    assert not torch.allclose(logits(d), logits(None))


def test_clamp_only_at_the_saes_hook(tiny_model: GPT, sae: SAE) -> None:
    with pytest.raises(InterventionError, match=r"the SAE reads blocks\.1\.hook_resid_pre, so clamp its feature there"):
        EditSpec((Edit("blocks.0.hook_resid_pre", "clamp", factor=1.0, sae=sae, feature=0),)).hooks(
            tiny_model.config, 8
        )


@pytest.mark.parametrize("hook", ["blocks.0.attn.hook_pattern", "blocks.0.attn.hook_k", "blocks.0.ln1.hook_scale"])
def test_contrastive_vector_only_where_there_is_one_vector_per_position(tiny_model: GPT, hook: str) -> None:
    with pytest.raises(ValueError, match="not a hook with one vector per position"):
        contrastive_vector(tiny_model, [[1, 2]], [[3, 4]], hook, "last")


def test_contrastive_vector(tiny_model: GPT) -> None:
    pos, neg = [[1, 2, 3], [4, 5, 6, 7]], [[8, 9], [10, 11, 12], [13]]
    for reduce in ("last", "mean"):
        v = contrastive_vector(tiny_model, pos, neg, HOOK, reduce)

        def mean(prompts: list[list[int]], reduce: str = reduce) -> torch.Tensor:
            rows = [stream(tiny_model, p) for p in prompts]
            return torch.stack([r[-1] if reduce == "last" else r.mean(0) for r in rows]).mean(0)

        torch.testing.assert_close(v.vector, mean(pos) - mean(neg))
        assert (v.hook, v.n_positive, v.n_negative) == (HOOK, 2, 3)


def test_hook_z_is_read_as_one_vector_of_its_heads(tiny_model: GPT, tmp_path: Path) -> None:
    """At attn.hook_z a position's heads [head, d_head] are one vector, head after head (SAELens' attention
    SAEs' order): a direction given flat or as [head, d_head] steers alike, a steered z is the plain one
    plus the direction, a contrastive vector there is the flattened difference of means, and a clamp of an
    attention SAE's feature to its present value leaves the logits as they are."""
    z = "blocks.0.attn.hook_z"
    H, D = tiny_model.config.n_head, tiny_model.config.d_head
    d = torch.randn(H * D, generator=torch.Generator().manual_seed(5))
    plain = stream(tiny_model, IDS, z)  # [T, H, D]
    flat = Edit(z, "steer", factor=2.0, direction=d, positions=(1, 4))
    shaped = Edit(z, "steer", factor=2.0, direction=d.view(H, D), positions=(1, 4))
    assert torch.equal(logits(tiny_model, IDS, flat), logits(tiny_model, IDS, shaped))
    spec = EditSpec((flat,))
    with torch.inference_mode():
        capture = Capture([z])
        tiny_model(torch.tensor([IDS]), hooks=HookChain(spec.hooks(tiny_model.config, len(IDS)), capture))
    want = plain.clone()
    want[[1, 4]] += 2.0 * d.view(H, D)
    torch.testing.assert_close(capture.tensors()[z][0], want)
    v = contrastive_vector(tiny_model, [[1, 2, 3]], [[4, 5]], z, "last")
    torch.testing.assert_close(
        v.vector, stream(tiny_model, [1, 2, 3], z)[-1].flatten() - stream(tiny_model, [4, 5], z)[-1].flatten()
    )
    attn_sae = load_sae(write_sae(tmp_path, hook=z, d_in=H * D, d_sae=32, seed=2, reshape_activations="hook_z"))
    f = attn_sae.encode(attn_sae.read(plain))  # [T, 32]
    active = int(f.sum(0).argmax())
    p = int(f[:, active].argmax())
    present = float(attn_sae.feature(attn_sae.read(plain[None, [p]]), active)[0, 0])  # as the edit computes it
    clamp = Edit(z, "clamp", factor=present, sae=attn_sae, feature=active, positions=(p,))
    assert torch.equal(logits(tiny_model, IDS, clamp), logits(tiny_model, IDS))
    moved = Edit(z, "clamp", factor=present + 3.0, sae=attn_sae, feature=active, positions=(p,))
    assert float((logits(tiny_model, IDS, moved) - logits(tiny_model, IDS)).abs().max()) > 1e-3


def test_directions_store_is_bounded(sae: SAE) -> None:
    lib = Directions({"s": sae}, max_vectors=2)
    vec = SteeringVector(HOOK, torch.ones(64), 1, 1)
    lib.store("a", vec)
    lib.store("b", vec)
    lib.store("a", vec)  # replacing a name is always allowed
    with pytest.raises(DirectionError, match="2 steering vectors are stored already") as e:
        lib.store("c", vec)
    assert e.value.param == "name"
    assert lib.names() == ["a", "b"]
    with pytest.raises(DirectionError, match="no stored steering vector 'c'; stored: a, b"):
        lib.vector("c", "direction")
    with pytest.raises(DirectionError, match="unknown SAE 'x'; loaded SAEs: s"):
        lib.sae("x", "sae")
    with pytest.raises(DirectionError, match=r"feature 256 of SAE 's' is out of range 0\.\.255"):
        lib.feature("s", 256, "direction")
    assert steering.STEERING_OPS == ("steer", "orthogonal", "projection_cap", "clamp")


def test_none_loaded_or_stored_says_how_the_front_end_gets_one() -> None:
    from server.routes.sae import server_directions
    from server.settings import Settings

    with pytest.raises(DirectionError, match=r"loaded SAEs: none$"):
        Directions().sae("x", "sae")
    with pytest.raises(DirectionError, match=r"loaded SAEs: none \(load one\)$"):
        Directions(load_hint="load one").sae("x", "sae")
    with pytest.raises(DirectionError, match=r"stored: none \(store one\)$"):
        Directions(store_hint="store one").vector("v", "direction")
    server = server_directions(Settings(model="gpt2"))
    with pytest.raises(DirectionError, match=r"none \(start the server with --sae ID=PATH\)$"):
        server.sae("x", "sae")
    with pytest.raises(DirectionError, match=r"none \(POST /v1/steering-vectors with a name stores one\)$"):
        server.vector("v", "direction")


@pytest.mark.parametrize(
    ("scale", "d", "x_size", "dtype"),
    [
        (1e3, 1.0, 1.0, torch.float32),
        (1e20, 1.0, 1.0, torch.float32),
        (1e30, 1.0, 1.0, torch.float32),
        (-1e30, 1.0, 1.0, torch.float32),
        (1.0, 3e38, 1.0, torch.float32),
        (10.0, 3e38, 1.0, torch.float32),
        (1e300, 1.0, 1.0, torch.float32),
        (1e-30, 1e-30, 1.0, torch.float32),
        (0.0, 1.0, 1.0, torch.float32),
        (1e300, 0.0, 1.0, torch.float32),
        (1.0, 1e38, 1e38, torch.float32),
        (2.0, 1e3, 2e4, torch.float16),
        (1.0, 1e5, 1.0, torch.float16),
    ],
    ids=[
        "1e3", "1e20", "1e30", "-1e30", "a direction of 3e38", "x+s.d past float32", "a scale past float32", "tiny",
        "scale 0", "a zero direction", "x near float32's end", "float16, |x| past 65504", "float16, d past 65504",
    ],
)  # fmt: skip
def test_a_norm_matched_steer_keeps_each_vector_s_norm_at_any_scale(
    scale: float, d: float, x_size: float, dtype: torch.dtype
) -> None:
    """`steer` with norm_match: ‖x‖ (x + s·d)/‖x + s·d‖, as float64 gives it, in float32 and float16 at any
    magnitude: a steered vector of norm 1e20 once came out 0 (its square past float32's range: the answer a
    uniform distribution), a float16 ‖x‖ past 65504 made every entry inf, a direction past float16's range
    NaN, and an x + s·d past float32's range lost x."""
    x64 = torch.randn(3, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64).clamp(-2, 2) * x_size
    direction = torch.zeros(16)
    direction[2], direction[5] = d, -d / 2
    got = steering.steer(x64.to(dtype), direction, scale, norm_match=True)
    x = x64.to(dtype).double()
    v = x + scale * direction.double()
    v = v / v.abs().amax(dim=-1, keepdim=True).clamp_min(1e-300)  # no square past float64's range either
    want = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300) * x.norm(dim=-1, keepdim=True)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert got.dtype == dtype and got.isfinite().all()
    torch.testing.assert_close(got.double() / x_size, want / x_size, rtol=tol, atol=tol)


def test_a_norm_matched_steer_to_zero_is_zero() -> None:
    """x + s·d = 0 (a direction taken from x itself, scale -1): the answer is 0, not 0 · inf (NaN)."""
    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(1)) * 50
    got = steering.steer(x, x[0].clone(), -1.0, norm_match=True)
    assert torch.equal(got[0], torch.zeros(768)) and got[1].isfinite().all()
    torch.testing.assert_close(got[1].norm(), x[1].norm())


def test_a_clamp_of_a_rescaling_sae_at_a_zero_vector_leaves_it(tmp_path: Path) -> None:
    """A `constant_norm_rescale` SAE scales each vector to norm √d_in (reads a zero one as NaN) and its
    reconstruction back: a clamp at a zero vector leaves it 0, the limit as the vector shrinks (its change
    scales with the norm), not NaN (which failed the request as "the activations overflowed"); the other
    positions are clamped as ever."""
    d = 16
    sae = load_sae(
        write_sae(tmp_path, hook=HOOK, d_in=d, d_sae=64, seed=5, normalize_activations="constant_norm_rescale")
    )
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(2))
    x[1] = 0
    got = steering.clamp(x, sae, 7, 3.0)
    assert torch.equal(got[1], torch.zeros(d))
    torch.testing.assert_close(got[[0, 2]], steering.clamp(x[[0, 2]], sae, 7, 3.0), rtol=1e-6, atol=1e-6)
    assert not torch.equal(got[0], x[0])
    small = steering.clamp(x[0] * 1e-6, sae, 7, 3.0) - x[0] * 1e-6  # the change, at a shrinking vector
    torch.testing.assert_close(small, (got[0] - x[0]) * 1e-6, rtol=1e-4, atol=1e-12)


def test_directions_sharing_a_store_see_each_other_s_vectors_and_its_limit() -> None:
    """Two servers' `Directions` on one `StoredVectors` (as a Ray deployment's replicas on its `VectorStore`
    actor): what one publishes, the other has after `refresh`, in the order stored; the store's limit holds
    across them, a refused name is stored nowhere, and a store made again (emptied) is taken in as such."""
    import asyncio

    from model.lab.steering import StoredVectors

    class Shared:  # `SharedVectors` on a StoredVectors in this process, as ReplicaVectors is on the actor's
        def __init__(self) -> None:
            self.store_ = StoredVectors()

        async def store(self, name: str, vector: SteeringVector, max_vectors: int) -> str | None:
            return self.store_.store(name, vector, max_vectors)

        async def since(self, version: str) -> tuple[str, dict[str, SteeringVector] | None]:
            return self.store_.since(version)

    def vector(x: float) -> SteeringVector:
        return SteeringVector("blocks.0.hook_resid_pre", torch.full((4,), x), 1, 1)

    async def scenario() -> None:
        shared = Shared()
        a, b = Directions(max_vectors=2, shared=shared), Directions(max_vectors=2, shared=shared)
        await a.publish("joy", vector(1.0))
        with pytest.raises(DirectionError, match="no stored steering vector 'joy'"):
            b.vector("joy", "direction")  # not taken in yet
        await b.refresh()
        assert b.names() == ["joy"] and torch.equal(b.vector("joy", "direction").vector, torch.full((4,), 1.0))
        await b.publish("calm", vector(2.0))
        await b.publish("joy", vector(3.0))  # replaces, in place
        with pytest.raises(DirectionError, match="2 steering vectors are stored already") as refused:
            await a.publish("anger", vector(4.0))  # a's own copy has room; the shared store has none
        assert refused.value.param == "name"
        await a.refresh()
        assert a.names() == b.names() == ["joy", "calm"] and "anger" not in shared.store_.vectors
        assert torch.equal(a.vector("joy", "direction").vector, torch.full((4,), 3.0))
        shared.store_ = StoredVectors()  # the store's process died and was made again: empty, a new epoch
        await a.refresh()
        assert a.names() == []

    asyncio.run(scenario())


def test_contrastive_vector_says_what_it_takes(tiny_model: GPT) -> None:
    """Each side a non-empty list of prompts (one prompt's flat ids once failed deep inside), `reduce` last or
    mean (another was taken as mean), an exact hook name; the vector it gives goes into an edit as it is."""
    hook = "blocks.0.hook_resid_post"
    for args, says in (
        (([5, 6, 7], [[8, 9]], hook, "last"), "positive is a non-empty list of prompts"),
        (([[5, 6]], [], hook, "last"), "negative is a non-empty list of prompts"),
        (([[5, 6]], [[7, 8]], hook, "max"), "reduce is 'last' or 'mean'"),
        (([[5, 6]], [[7, 8]], "blocks.*.hook_resid_post", "last"), "is a pattern"),
    ):
        with pytest.raises(ValueError, match=says):
            contrastive_vector(tiny_model, *args)  # type: ignore[arg-type]
    v = contrastive_vector(tiny_model, [[5, 6]], [[7, 8]], hook, "last")
    steer = Edit(hook, "steer", 2.0, direction=v)  # type: ignore[arg-type]
    assert torch.equal(steer.direction, v.vector) and steer.origin == hook  # where it was measured, kept
    assert torch.equal(contrastive_vector(tiny_model, torch.tensor([[5, 6]]), [[7, 8]], hook, "last").vector, v.vector)


def test_a_clamp_that_cannot_apply_is_refused_before_the_pass(tiny_model: GPT, sae: SAE, tmp_path: Path) -> None:
    """A feature past the SAE's, or true, and an SAE whose width is not its hook's: refused when the edits are
    planned (they failed inside the pass with an index or shape error from torch)."""
    d_sae = sae.cfg.d_sae
    for feature, says in ((d_sae, f"feature {d_sae} is not one of the SAE's 0..{d_sae - 1}"), (True, "True")):
        spec = EditSpec((Edit(HOOK, "clamp", factor=1.0, sae=sae, feature=feature),))
        with pytest.raises(InterventionError, match=says):
            spec.hooks(tiny_model.config, len(IDS))
    narrow = load_sae(write_sae(tmp_path, hook=HOOK, d_in=32, d_sae=8, seed=1))
    spec = EditSpec((Edit(HOOK, "clamp", factor=1.0, sae=narrow, feature=0),))
    with pytest.raises(InterventionError, match=f"the SAE reads vectors of 32, {HOOK} holds 64"):
        spec.hooks(tiny_model.config, len(IDS))
