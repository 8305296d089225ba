"""Attribution patching: activation patching approximated to first order, for every site at once.

Patching the clean run's value a_clean into the corrupted run at a site changes the metric by about
(a_clean - a_corrupt) · ∂metric/∂a, the gradient taken on the corrupted run (Nanda 2023, "Attribution
Patching: Activation Patching At Industrial Scale"; Syed, Rager & Conmy 2023, "Attribution Patching
Outperforms Automated Circuit Discovery"). Two forward passes and one backward pass score every site;
`verify` patches the top sites for real (the `set` edit) to show how good the linear approximation is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import GPTConfig
from ..gpt import GPT
from ..hooks import Capture, check_ids
from ..interventions import Edit, EditSpec
from ..json_file import is_int
from .gradients import Metric, MetricError, MetricPass, Refusal, check_metric

SITES = ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_mlp_out")
MAX_VERIFY = 64  # sites patched for real in one run: each is a forward pass of its own (the API's and CLI's bound)


@dataclass(frozen=True)
class Site:
    """One patchable unit: a hook of one layer, at one position (`resid_pre`), one head (`z`, every
    position) or whole (`attn_out`, `mlp_out`: every position)."""

    hook: str
    layer: int
    position: int | None = None
    head: int | None = None

    def patch(self, clean: torch.Tensor) -> torch.Tensor:
        """What this site's edit needs of the clean run's value `clean` [T, ...] at its hook: one position's
        [C] (a copy, so that the rest can be freed), or all of it (a head's edit selects its head itself)."""
        return clean[self.position].clone() if self.position is not None else clean

    def edit(self, value: torch.Tensor) -> Edit:
        """The `set` edit that patches `value` (this site's `patch` of the clean run) in at this site."""
        positions = (self.position,) if self.position is not None else None
        heads = (self.head,) if self.head is not None else None
        return Edit(self.hook, "set", value=value, positions=positions, heads=heads)


@dataclass(frozen=True)
class Verified:
    site: Site
    attribution: float  # the linear estimate of the metric's change
    patched_metric: float  # the corrupted run's metric with the clean value patched in at the site
    patched_change: float  # patched_metric - the corrupted run's metric: what the estimate estimates


@dataclass(frozen=True)
class Attribution:
    clean_metric: float
    corrupted_metric: float
    resid_pre: torch.Tensor  # [layer, pos]
    z: torch.Tensor  # [layer, head]: each head's output, every position
    attn_out: torch.Tensor  # [layer]
    mlp_out: torch.Tensor  # [layer]
    verified: list[Verified]


@dataclass(frozen=True)
class Candidate:
    """A site to patch for real: its score and the clean run's value its edit sets (`Site.patch`)."""

    site: Site
    estimate: float
    value: torch.Tensor


@dataclass(frozen=True)
class Scores:
    """The two runs' part of an attribution (`score_sites`): every site's score, and the sites to verify
    with what their edits need (only that of the clean run is kept)."""

    clean_metric: float
    corrupted_metric: float
    resid_pre: torch.Tensor  # [layer, pos]
    z: torch.Tensor  # [layer, head]
    attn_out: torch.Tensor  # [layer]
    mlp_out: torch.Tensor  # [layer]
    candidates: list[Candidate]  # the sites of largest |score|, largest first

    def verified(self, candidate: Candidate, patched: float) -> Verified:
        """`candidate`'s estimate beside the metric `patched` that patching its site for real gave."""
        return Verified(candidate.site, candidate.estimate, patched, patched - self.corrupted_metric)

    def with_verified(self, verified: list[Verified]) -> Attribution:
        return Attribution(
            self.clean_metric, self.corrupted_metric, self.resid_pre, self.z, self.attn_out, self.mlp_out, verified
        )


def attribution(model: GPT, clean: list[int], corrupted: list[int], metric: Metric, verify: int = 0) -> Attribution:
    """Attribution scores of every site in `SITES` for patching `clean`'s values into `corrupted` (same
    length), and, for the `verify` sites of largest |score|, the metric with each really patched in. The
    loss's targets are the clean prompt's tokens in both runs (a metric is one function of the logits).
    The server runs the same: `ScoringPass`, then each site's `patched_pass`, a piece an engine job."""
    scores = score_sites(model, clean, corrupted, metric, verify)
    return scores.with_verified([verify_site(model, scores, clean, corrupted, metric, c) for c in scores.candidates])


def score_sites(model: GPT, clean: list[int], corrupted: list[int], metric: Metric, verify: int = 0) -> Scores:
    """Every site's score (the clean run, then the corrupted run's forward and backward pass), and the
    `verify` sites of largest |score| to patch for real: `ScoringPass`'s pieces one after another."""
    run = ScoringPass(model.config, clean, corrupted, metric, verify)
    while not run.done:
        run.step(model)
    return run.result()


def _refusal(run: str) -> Refusal:
    """How a run of an attribution that cannot be differentiated is refused, naming it (`clean`, `corrupted`)."""
    why = "no attribution to compute"
    return Refusal(run, f", in the {run} run: {why}", f"the {run} run's metric", why)


# the edit is the patch itself, which the request asked for with `verify`
PATCHED = Refusal(
    "verify",
    ", in a run patched to verify a site: ask for verify 0",
    "a patched run's metric",
    "ask for verify 0",
    "verify",
)


class ScoringPass:
    """`score_sites` a piece at a time, each `step` an engine job on the server: the clean run's pieces, its
    values at every site kept (a `MetricPass` without a gradient), then the corrupted run's, forward and
    back, and the scores with its last piece. The loss's targets are the clean prompt's tokens in both runs."""

    def __init__(
        self, config: GPTConfig, clean: list[int], corrupted: list[int], metric: Metric, verify: int = 0
    ) -> None:
        check_attribution(clean, corrupted, metric, config.vocab_size)
        if not is_int(verify) or verify < 0:
            raise ValueError(f"verify is how many sites to patch for real, an int of 0 or more; got {verify!r}")
        self._n_layer, self._verify = config.n_layer, verify
        names = [f"blocks.{i}.{site}" for i in range(config.n_layer) for site in SITES]
        self._cache = Capture(names)
        self._clean = MetricPass(config, clean, metric, [], _refusal("clean"), also=self._cache)
        self._corrupted = MetricPass(config, corrupted, metric, names, _refusal("corrupted"), targets=clean)
        self._scores: Scores | None = None

    @property
    def done(self) -> bool:
        return self._scores is not None

    def step(self, model: GPT) -> None:
        assert not self.done, "the pass is over"
        if not self._clean.done:
            self._clean.step(model)
            return
        self._corrupted.step(model)
        if self._corrupted.done:
            self._scores = self._score()

    def result(self) -> Scores:
        assert self._scores is not None, "the pass is not over"
        return self._scores

    def _score(self) -> Scores:
        L = self._n_layer
        cache = {n: v[0] for n, v in self._cache.tensors().items()}  # [T, ...]
        corrupt = self._corrupted.result()
        grads = {n: g[0] for n, g in corrupt.grads.items()}
        values = {n: v.detach()[0] for n, v in self._corrupted.values.items()}

        def score(name: str, over: tuple[int, ...]) -> torch.Tensor:
            return ((cache[name] - values[name]) * grads[name]).double().sum(dim=over)

        resid = torch.stack([score(f"blocks.{i}.hook_resid_pre", (1,)) for i in range(L)])  # [L, T]
        z = torch.stack([score(f"blocks.{i}.attn.hook_z", (0, 2)) for i in range(L)])  # [L, H]
        attn = torch.stack([score(f"blocks.{i}.hook_attn_out", (0, 1)) for i in range(L)])  # [L]
        mlp = torch.stack([score(f"blocks.{i}.hook_mlp_out", (0, 1)) for i in range(L)])  # [L]
        top = _top_sites(resid, z, attn, mlp, self._verify)
        candidates = [Candidate(site, estimate, site.patch(cache[site.hook])) for estimate, site in top]
        return Scores(self._clean.result().metric, corrupt.metric, resid, z, attn, mlp, candidates)


def _top_sites(
    resid: torch.Tensor, z: torch.Tensor, attn: torch.Tensor, mlp: torch.Tensor, k: int
) -> list[tuple[float, Site]]:
    """The `k` sites of largest |score|, each with its score, largest first (ties in model order)."""
    if k <= 0:
        return []
    sites: list[tuple[float, Site]] = []
    for i, (r, h, a, m) in enumerate(zip(resid.tolist(), z.tolist(), attn.tolist(), mlp.tolist(), strict=True)):
        sites += [(s, Site(f"blocks.{i}.hook_resid_pre", i, position=t)) for t, s in enumerate(r)]
        sites += [(s, Site(f"blocks.{i}.attn.hook_z", i, head=j)) for j, s in enumerate(h)]
        sites += [(a, Site(f"blocks.{i}.hook_attn_out", i)), (m, Site(f"blocks.{i}.hook_mlp_out", i))]
    return sorted(sites, key=lambda pair: -abs(pair[0]))[:k]


def verify_site(
    model: GPT, scores: Scores, clean: list[int], corrupted: list[int], metric: Metric, candidate: Candidate
) -> Verified:
    """`candidate`'s site patched for real: the corrupted run with the clean run's value set in there
    (`patched_pass`, its pieces one after another)."""
    run = patched_pass(model.config, clean, corrupted, metric, candidate)
    while not run.done:
        run.step(model)
    return scores.verified(candidate, run.result().metric)


def patched_pass(
    config: GPTConfig, clean: list[int], corrupted: list[int], metric: Metric, candidate: Candidate
) -> MetricPass:
    """The corrupted run with `candidate`'s clean value set in at its site, to the metric (the loss predicting
    the clean prompt's tokens): activation patching for real, a piece at a time, without a graph. The server
    runs each piece as an engine job."""
    edits = EditSpec((candidate.site.edit(candidate.value),))
    return MetricPass(config, corrupted, metric, [], PATCHED, edits, targets=clean)


def check_attribution(clean: list[int], corrupted: list[int], metric: Metric, vocab_size: int) -> None:
    """Refuse (`MetricError`, naming the field) prompts of different lengths and a metric they cannot give (and,
    in a `ValueError`, ids outside the vocabulary)."""
    check_ids(clean, vocab_size)
    check_ids(corrupted, vocab_size)
    if len(clean) != len(corrupted):
        raise MetricError(
            f"the clean prompt has {len(clean)} tokens and the corrupted one {len(corrupted)}: patching needs "
            "the same length",
            "corrupted",
        )
    check_metric(metric, len(clean), vocab_size)
