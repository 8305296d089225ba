"""Choosing a token: the time a sequence's next token takes to choose from its logits, ours
(`SequenceState.accept` through `model.sampling`) against transformers' logits processors and
`torch.multinomial` (what `generate(do_sample=True)` runs each step), side by side on the same logits.

    python scripts/bench_sampling.py                     # GPT-2's 50,257 ids, 1 thread
    python scripts/bench_sampling.py --rows 16 --json sampling.json

Each setting is timed per row: ours chooses row by row (every sequence keeps its own settings and random
generator, as the server's batch needs), transformers' processes the `--rows` rows at once, so its time is
divided by them. The logits are drawn like a language model's: a Zipf-like ranking (exponent `--zipf`) with
noise, so the nucleus holds what it holds on real text (see the printed sizes), not a flat random vector's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

SETTINGS: dict[str, dict[str, Any]] = {  # name -> SamplingParams' fields
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "top_k 40": {"temperature": 0.8, "top_k": 40},
    "top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top_p 0.95, temperature 1.5": {"temperature": 1.5, "top_p": 0.95},  # a wide nucleus: thousands of tokens
    "min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "repetition 1.3, top_p 0.9": {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.3},
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--rows", type=int, default=16, help="sequences choosing at once (default 16)")
    p.add_argument("--steps", type=int, default=30, help="tokens chosen per row and setting (default 30)")
    p.add_argument("--zipf", type=float, default=1.1, help="the logits' Zipf exponent (default 1.1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    return p.parse_args(argv)


def lm_like_logits(rows: int, vocab: int, zipf: float, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] logits whose probabilities fall off as rank^-zipf (with noise), each row its own ranking."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    out = torch.empty(rows, vocab)
    for r in range(rows):
        out[r, torch.randperm(vocab, generator=g)] = -zipf * ranks.log() + 0.3 * torch.randn(vocab, generator=g)
    return out


def per_row_ms(run: Callable[[], None], rows: int, steps: int) -> float:
    """The best of 3 timings of `steps` calls of `run`, in ms per row and step."""
    run()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            run()
        best = min(best, time.perf_counter() - start)
    return best / steps / rows * 1e3


def ours(logits: torch.Tensor, fields: dict[str, Any], steps: int) -> Callable[[], None]:
    from model.generate import SamplingParams, SequenceState, _generator

    rows = []
    for r in range(logits.shape[0]):
        params = SamplingParams(max_new_tokens=1 + 3 * steps, ignore_eos=True, seed=r, **fields)  # `per_row_ms`' calls
        prompt = torch.randint(0, logits.shape[1], (64,), generator=torch.Generator().manual_seed(r)).tolist()
        rows.append(SequenceState(r, prompt, params, None, 50256, _generator(r, torch.device("cpu"))))

    def run() -> None:  # the batch's argmax as the server's step takes it, once for every row
        argmax = logits.max(dim=-1).indices.tolist()
        for seq, row, best in zip(rows, logits, argmax, strict=True):
            seq.accept(row, best)

    return run


def transformers_way(logits: torch.Tensor, fields: dict[str, Any]) -> Callable[[], None]:
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors: list[Any] = []
    if fields.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"]))
    greedy = fields["temperature"] == 0
    if not greedy:
        processors.append(TemperatureLogitsWarper(fields["temperature"]))
        if fields.get("top_k"):
            processors.append(TopKLogitsWarper(fields["top_k"]))
        if fields.get("top_p", 1.0) < 1.0:
            processors.append(TopPLogitsWarper(fields["top_p"]))
        if fields.get("min_p"):
            processors.append(MinPLogitsWarper(fields["min_p"]))
    g = torch.Generator().manual_seed(0)
    seen = torch.randint(0, logits.shape[1], (logits.shape[0], 64), generator=g)

    def run() -> None:
        scores = logits  # (each processor makes a new tensor)
        for processor in processors:
            scores = processor(seen, scores)
        if greedy:
            scores.argmax(dim=-1).tolist()
        else:
            torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=g).tolist()

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    from gpt2_scripts.bench_common import cpu_features, cpu_name, features_text

    from model.sampling import nucleus

    print(f"host: {cpu_name()}, {args.threads} thread(s); extensions: {features_text(cpu_features())}")
    logits = lm_like_logits(args.rows, args.vocab, args.zipf)
    held = []
    for temperature in (0.8, 1.5):
        sizes = [int(nucleus(row, 0.95, temperature).isfinite().sum()) for row in logits]
        held.append(f"{min(sizes)}-{max(sizes)} tokens at temperature {temperature}")
    print(
        f"{args.rows} rows of {args.vocab} logits, Zipf {args.zipf}: the nucleus at top_p 0.95 holds "
        f"{' and '.join(held)}; ms per row and token, best of 3"
    )
    print(f"{'setting':28}{'ours':>10}{'transformers':>14}{'ratio':>8}")
    results = {}
    for name, fields in SETTINGS.items():
        mine = per_row_ms(ours(logits, fields, args.steps), args.rows, args.steps)
        theirs = per_row_ms(transformers_way(logits, fields), args.rows, args.steps)
        results[name] = {"ours_ms": mine, "transformers_ms": theirs}
        print(f"{name:28}{mine:10.3f}{theirs:14.3f}{theirs / mine:7.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
