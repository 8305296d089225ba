"""gpt2-harvest: activations at chosen hooks for a whole text dataset, written as resumable shards.

    gpt2-harvest corpus.jsonl --out acts/ --model gpt2 --hooks blocks.8.hook_resid_pre --max-tokens 10000000
    gpt2-harvest ./wikitext/ --out acts/ --hooks 'blocks.*.hook_resid_post' --format saelens --dtype float32
    gpt2-harvest corpus.parquet --out acts/ --hooks blocks.8.hook_resid_pre --ray auto --actors 4 --gpus-per-actor 1

Interrupted (kill -9 included) and started again with the same arguments, it goes on from the first
shard missing and ends with the same shards an uninterrupted run writes.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python scripts/harvest.py`: started as `gpt2-harvest` is, which holds a Ctrl-C
    from gpt2_scripts.console import harvest  # during the imports below (this file is imported again there)

    harvest()

import argparse
import contextlib
import logging
import os
import sys
import time
from typing import Any

import torch
from gpt2_scripts.console import empty_flag, takes_negative_values

from model.cpus import available_cpus, size_threads
from model.harvest import FORMATS, HarvestError, HarvestSpec, run_harvest
from model.loading import add_checkpoint_arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpt2-harvest",
        description="Harvest activations at chosen hooks for a text dataset, as shards (safetensors or SAELens').",
    )
    takes_negative_values(p)
    p.add_argument(
        "source", help="a .txt, .jsonl or .parquet file, a folder of them, or a Hugging Face datasets directory"
    )
    p.add_argument("--out", "-o", required=True, help="output folder (new, empty, or a harvest's to resume)")
    add_checkpoint_arguments(p)
    p.add_argument(
        "--hooks", action="append", required=True, metavar="PATTERN", help="hook names or globs (repeatable)"
    )
    p.add_argument("--text-field", default="text", help="the text's field in .jsonl, parquet and datasets (text)")
    p.add_argument("--context-size", type=int, default=128, help="tokens per context (128)")
    p.add_argument(
        "--prepend-bos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open each context with <|endoftext|> as SAELens does (default: yes)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="contexts per forward pass (32)")
    p.add_argument("--max-tokens", type=int, help="stop after this many tokens (whole contexts); default: all the text")
    p.add_argument("--shard-size", type=int, help="contexts per shard (default: about 256 MiB of activations)")
    p.add_argument("--format", choices=FORMATS, default="safetensors", help="shard format (safetensors)")
    p.add_argument(
        "--threads", type=int, help="torch threads in this process (default: torch's, at most the CPUs it may use)"
    )
    ray = p.add_argument_group("Ray", "run the job as a Ray Data pipeline (needs the [ray] extra)")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help=(
            "a cluster's address (auto: one `ray start` made here; ray://host:10001); alone: RAY_ADDRESS, else a "
            "new local Ray instance"
        ),
    )
    ray.add_argument("--actors", type=int, help="model actors (2)")
    ray.add_argument("--cpus-per-actor", type=float, help="CPUs per actor (1)")
    ray.add_argument("--gpus-per-actor", type=float, help="GPUs per actor (0)")
    args = p.parse_args(argv)
    if args.ray is None and (given := [k for k, v in ray_options(args).items() if v is not None]):
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        p.error(f"{flags} {'needs' if len(given) == 1 else 'need'} --ray")  # else silently dropped
    return args


def ray_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Ray flags as `run_on_ray` takes them, None where not given."""
    return {"actors": args.actors, "cpus_per_actor": args.cpus_per_actor, "gpus_per_actor": args.gpus_per_actor}


class BarProgress:
    """tqdm's bar on a terminal: tokens, tokens/s, and the ETA when the total is known."""

    def __init__(self) -> None:
        self.bar = None

    def start(self, total_tokens: int | None, done_tokens: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_tokens, initial=done_tokens, unit="tok", unit_scale=True, desc="harvest")

    def advance(self, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(tokens)

    def retract(self, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(-tokens)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LineProgress:
    """Plain lines on stderr (not a terminal): at most one every `every` seconds, and one at the end."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self.total: int | None = None
        self.done = self.new = 0
        self.t0 = self.last = time.monotonic()

    def start(self, total_tokens: int | None, done_tokens: int) -> None:
        self.total, self.done = total_tokens, done_tokens
        self.t0 = self.last = time.monotonic()
        if done_tokens:
            note(f"harvest: resuming after {done_tokens:,} tokens")

    def advance(self, tokens: int) -> None:
        self.done += tokens
        self.new += tokens
        if time.monotonic() - self.last >= self.every:
            self.report()

    def retract(self, tokens: int) -> None:
        self.done -= tokens

    def report(self) -> None:
        self.last = time.monotonic()
        rate = self.new / max(self.last - self.t0, 1e-9)
        line = f"harvest: {self.done:,}"
        if self.total is not None:
            line += f" / {self.total:,} tokens ({100 * self.done / self.total:.1f}%)"
        else:
            line += " tokens"
        line += f", {rate:,.0f} tokens/s"
        if self.total is not None and rate > 0:
            line += f", ETA {_duration((self.total - self.done) / rate)}"
        note(line)

    def close(self) -> None:
        if self.new:
            self.report()


def note(line: str) -> None:
    """A line on stderr, a side channel: where it cannot go (its reader gone, `2>&1 | head` or a `tee` that
    died, or stderr closed), the job goes on without it (a harvest of hours stopped at the next line)."""
    if sys.stderr is None:
        return
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if problem := empty_flag((("--model", args.model), ("--out", args.out), ("the source", args.source))):
        return fail(problem)
    if args.threads is None:
        size_threads(os.environ)  # torch's default, cut to the CPUs a container allows (model/cpus.py)
    else:
        most = max_threads()
        if not 1 <= args.threads <= most:  # libgomp fails to start 20,000 threads, and 100,000 crashed torch
            return fail(f"--threads must be in 1..{most} ({THREADS_PER_CPU} per CPU here), got {args.threads}")
        torch.set_num_threads(args.threads)
    progress = BarProgress() if sys.stderr is not None and sys.stderr.isatty() else LineProgress()
    try:
        spec = HarvestSpec(
            model=args.model,
            source=args.source,
            hooks=tuple(args.hooks),
            text_field=args.text_field,
            context_size=args.context_size,
            prepend_bos=args.prepend_bos,
            batch_size=args.batch_size,
            max_tokens=args.max_tokens,
            dtype=args.dtype,
            device=args.device,
            shard_size=args.shard_size,
            format=args.format,
            revision=args.revision,
            preset=args.preset,
            tokenizer=args.tokenizer,
        )
        if args.ray is not None:
            from model.harvest.ray_data import run_on_ray

            manifest = run_on_ray(
                spec,
                args.out,
                address=args.ray or None,
                **{k: v for k, v in ray_options(args).items() if v is not None},  # the rest: run_on_ray's defaults
                progress=progress,
            )
        else:
            manifest = run_harvest(spec, args.out, progress=progress)
    except HarvestError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"{e.filename or args.out}: {e.strerror or e}")
    n = manifest.n_contexts or 0
    note(
        f"wrote {len(manifest.shards)} shards, {n:,} contexts of {spec.context_size} tokens "
        f"({n * spec.context_size:,} tokens) to {args.out}"
    )
    return 0


THREADS_PER_CPU = 4


def max_threads() -> int:
    """The most torch threads `--threads` takes: a few per CPU it may use (more only wait on each other)."""
    return THREADS_PER_CPU * available_cpus()


def fail(message: str) -> int:
    print(f"gpt2-harvest: error: {message}", file=sys.stderr)
    return 1
