"""Shared prompt prefixes: the server's batch with them copied (`DecodeBatch._take_prefixes`) and with every
prompt computed in full, side by side on the same requests.

    python scripts/bench_prefix.py                  # a random gpt2-small-shaped checkpoint
    python scripts/bench_prefix.py --model ./gpt2 --n 16 --prompt-len 1000 --json prefix.json

Two workloads, each run through `DecodeBatch` in this process (no HTTP) with the server's prefill chunk,
alternating sharing on and off, best of `--reps`:
  - samples: `--n` seeded samples of one prompt of `--prompt-len` tokens, `--new-tokens` each (what
    `/v1/completions` with `n` asks for: pass@k);
  - choices: `--choices` prompts of one `--context-len`-token context and an ending of 4-16 tokens each,
    scored with prompt logprobs and no new token (lm-evaluation-harness' multiple choice through `echo`).
Each prints its time both ways and the ratio, and checks that both ways give the same tokens and
log-probabilities (within 1e-4).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint (default: a random gpt2-small-shaped one, made here)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--n", type=int, default=16, help="samples of one prompt")
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--choices", type=int, default=4, help="endings after one context")
    p.add_argument("--context-len", type=int, default=500)
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens a pass (default: the server's)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the figures here")
    return p.parse_args(argv)


def workloads(args: argparse.Namespace, vocab: int) -> dict[str, tuple[list[list[int]], list[Any]]]:
    from model.generate import SamplingParams

    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    prompt, context = tokens(args.prompt_len), tokens(args.context_len)
    samples = [
        SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=j, logprobs=1, ignore_eos=True)
        for j in range(args.n)
    ]
    endings = [context + tokens(4 + 12 * j // max(1, args.choices - 1)) for j in range(args.choices)]
    scoring = [SamplingParams(max_new_tokens=0, prompt_logprobs=1) for _ in endings]
    return {"samples": ([prompt] * args.n, samples), "choices": (endings, scoring)}


def run(
    model: Any, chunk: int, prompts: list[list[int]], params: list[Any], share: bool
) -> tuple[float, list[Any], int]:
    """Seconds for the requests through one batch, all joining at once; their results; the tokens copied.
    Without `share`, each sequence is a group of its own (`SequenceState.group`), as separate requests are."""
    from model.generate import DecodeBatch, new_sequence

    with torch.inference_mode():
        batch = DecodeBatch(model, len(prompts), model.config.n_positions, chunk)
        seqs = [new_sequence(model, i, p, q, None) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
        for i, seq in enumerate(seqs):
            seq.group = None if share else i
        start = time.perf_counter()
        for seq in seqs:
            batch.add(seq)
        while batch:
            batch.step()
        seconds = time.perf_counter() - start
    return seconds, [s.result() for s in seqs], batch.shared_tokens


def same(a: list[Any], b: list[Any]) -> bool:
    def numbers(r: Any) -> list[float]:
        return [x.logprob for x in (r.logprobs or []) + [p for p in (r.prompt_logprobs or []) if p is not None]]

    return all(
        x.token_ids == y.token_ids and len(numbers(x)) == len(numbers(y))
        and all(abs(u - v) <= 1e-4 for u, v in zip(numbers(x), numbers(y), strict=True))
        for x, y in zip(a, b, strict=True)
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from gpt2_scripts.bench_common import cpu_features, cpu_name, features_text

    from model.loading import load_weights
    from server.engine import default_prefill_chunk

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from gpt2_scripts.bench import make_random_checkpoint

            print("making a random gpt2-small-shaped checkpoint ...", flush=True)
            path = str(Path(tmp) / "gpt2-small-random")
            make_random_checkpoint(Path(path))
        model = load_weights(path, dtype=args.dtype, device="cpu")  # token ids only: no tokenizer needed
    chunk = args.prefill_chunk or default_prefill_chunk(torch.device("cpu"))
    print(f"host: {cpu_name()}, {torch.get_num_threads()} threads; extensions: {features_text(cpu_features())}")
    print(f"{args.dtype}, prefill chunk {chunk}, best of {args.reps} alternating runs\n")
    report: dict[str, Any] = {"dtype": args.dtype, "prefill_chunk": chunk, "workloads": {}}
    for name, (prompts, params) in workloads(args, model.config.vocab_size).items():
        best = {"shared": float("inf"), "computed": float("inf")}
        results: dict[str, list[Any]] = {}
        copied = 0
        for _ in range(args.reps):
            for way in best:
                seconds, results[way], n = run(model, chunk, prompts, params, share=way == "shared")
                best[way] = min(best[way], seconds)
                copied = n if way == "shared" else copied
        prompt_tokens = sum(len(p) for p in prompts)
        ratio = best["computed"] / best["shared"]
        agree = same(results["shared"], results["computed"])
        print(
            f"{name}: {len(prompts)} prompts, {prompt_tokens} prompt tokens of which {copied} copied; "
            f"{best['computed']:.3f} s computing every prompt, {best['shared']:.3f} s sharing: {ratio:.2f}x; "
            f"the same tokens and log-probabilities both ways: {'yes' if agree else 'NO'}"
        )
        report["workloads"][name] = {
            "prompts": len(prompts),
            "prompt_tokens": prompt_tokens,
            "copied_tokens": copied,
            "seconds_computed": best["computed"],
            "seconds_shared": best["shared"],
            "speedup": ratio,
            "same_results": agree,
        }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
