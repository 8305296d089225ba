"""Benchmark: our GPT-2 against transformers' GPT2LMHeadModel on CPU, side by side (a benchmark, not a test).

    python scripts/bench.py                        # gpt2-small-shaped random checkpoint, full run
    python scripts/bench.py --quick --json out.json
    python scripts/bench.py --model ./gpt2 --dtype bfloat16 --profile

Measures, on the same checkpoint in the official format:
  1. greedy decode throughput at batch 1 and 8, prefill excluded (the time of N new tokens minus that of
     one new token, so only the N - 1 one-token steps are left), as aggregate tokens/s;
  2. the time of one forward pass over 1024 tokens keeping only the last position's logits (prefill);
  3. the peak resident memory added by loading our model, in a fresh process, against the weights' size.
The machine may be shared and noisy: the runs alternate reference and ours (A B A B ...) and the best of each
is kept; both sides are timed at 1 and 2 torch threads (and --threads), and ours, at --threads and at its
best, is compared with the reference's fastest setting. A 1-minute load average above 0.5 at the start is
warned about. Ratios are speed ratios, ours / transformers: above 1 means we are faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench.py` without the package installed
    sys.path.insert(0, str(ROOT))

from model.config import GPTConfig  # noqa: E402
from model.generate import SamplingParams, generate  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.loading import DTYPE_NAMES, load_weights  # noqa: E402
from model.tokenizer import EOT_ID  # noqa: E402

SMALL = GPTConfig(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257)  # gpt2-small's shape
BUSY_LOAD = 0.5  # 1-minute load average above which other processes are competing for the cores
OURS = "ours"
REF = "transformers"
MAKE_CHECKPOINT = "make-checkpoint"
CHILD_TASKS = [MAKE_CHECKPOINT, f"load-rss-{OURS}", f"load-rss-{REF}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark our GPT-2 against transformers on CPU.")
    p.add_argument(
        "--model",
        help="checkpoint directory (config.json, model.safetensors); default: a random "
        "gpt2-small-shaped one made in a temporary directory",
    )
    p.add_argument("--quick", action="store_true", help="fewer tokens and a shorter prefill (a smoke run)")
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads of the headline figure for ours (default: %(default)s); both sides are timed at 1, "
        "2 and this many, and ours is compared with the reference's fastest setting",
    )
    p.add_argument("--new-tokens", type=int, help="new tokens per decode run (default 128, --quick 16)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens for the decode runs")
    p.add_argument("--prefill-len", type=int, help="tokens of the prefill pass (default 1024, --quick 256)")
    p.add_argument("--reps", type=int, help="timed repetitions of each contender (default 3, --quick 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--profile", action="store_true", help="also profile some of our batch-1 decode steps")
    p.add_argument("--child", choices=CHILD_TASKS, help=argparse.SUPPRESS)  # internal: see run_child
    args = p.parse_args(argv)
    args.new_tokens = args.new_tokens or (16 if args.quick else 128)
    args.prefill_len = args.prefill_len or (256 if args.quick else 1024)
    args.reps = args.reps or (2 if args.quick else 3)
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be at least 2 (decode time is N tokens minus 1), got {args.new_tokens}")
    if args.reps < 2:
        p.error(f"--reps must be at least 2 (runs alternate A B A B), got {args.reps}")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    return args


# --- timing ------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """Seconds taken by repeated runs of one thing: wall clock, and CPU time of this process (which a busy
    machine inflates less: time spent waiting for a core is not counted, at one thread nothing is lost)."""

    runs: list[float] = field(default_factory=list)
    cpu_runs: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.runs)

    @property
    def best_cpu(self) -> float:
        return min(self.cpu_runs)

    def add(self, threads: int, fn: Callable[..., object], *args: Any) -> None:
        """Time `fn(*args)` with torch at `threads` threads."""
        torch.set_num_threads(threads)
        wall, cpu = time.perf_counter(), time.process_time()
        fn(*args)
        self.cpu_runs.append(time.process_time() - cpu)
        self.runs.append(time.perf_counter() - wall)


@dataclass(frozen=True)
class Contender:
    """One side of the comparison at one thread count."""

    name: str  # OURS or REF
    threads: int
    decode: Callable[[list[list[int]], int], None]  # generate n new tokens for each prompt
    prefill: Callable[[torch.Tensor], None]  # one forward pass over [1, T], last position's logits only

    @property
    def label(self) -> str:
        return f"{self.name} {self.threads}t"


def ours(model: GPT, threads: int) -> Contender:
    def decode(prompts: list[list[int]], n: int) -> None:
        out = generate(model, prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
        assert all(len(c.token_ids) == n for c in out), "ours generated the wrong number of tokens"

    def prefill(idx: torch.Tensor) -> None:
        with torch.inference_mode():
            model(idx, last_only=True)

    return Contender(OURS, threads, decode, prefill)


def reference(hf: Any, threads: int) -> Contender:
    import inspect

    keep_one = "logits_to_keep" in inspect.signature(hf.forward).parameters

    def decode(prompts: list[list[int]], n: int) -> None:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=EOT_ID,
            )
        assert out.shape[1] == ids.shape[1] + n, "transformers generated the wrong number of tokens"

    def prefill(idx: torch.Tensor) -> None:
        with torch.inference_mode():
            if keep_one:
                hf(input_ids=idx, use_cache=False, logits_to_keep=1)
            else:
                hf(input_ids=idx, use_cache=False)

    return Contender(REF, threads, decode, prefill)


@dataclass
class DecodeResult:
    batch: int
    new_tokens: int
    full: Timing  # prefill + new_tokens tokens
    one: Timing  # prefill + 1 token

    @property
    def decode_s(self) -> float:
        """The N - 1 one-token decode steps alone: best of the long runs minus best of the short ones."""
        return max(self.full.best - self.one.best, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * (self.new_tokens - 1) / self.decode_s

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.decode_s / (self.new_tokens - 1)

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000 * (self.full.best_cpu - self.one.best_cpu) / (self.new_tokens - 1)


def bench_decode(
    contenders: list[Contender], prompts: list[list[int]], new_tokens: int, reps: int
) -> dict[str, DecodeResult]:
    results = {c.label: DecodeResult(len(prompts), new_tokens, Timing(), Timing()) for c in contenders}
    for c in contenders:  # warm-up, untimed
        torch.set_num_threads(c.threads)
        c.decode(prompts, 2)
    for _ in range(reps):  # A B A B: each repetition runs every contender once
        for c in contenders:
            r = results[c.label]
            r.full.add(c.threads, c.decode, prompts, new_tokens)
            r.one.add(c.threads, c.decode, prompts, 1)
    return results


def bench_prefill(contenders: list[Contender], idx: torch.Tensor, reps: int) -> dict[str, Timing]:
    results = {c.label: Timing() for c in contenders}
    for c in contenders:  # warm-up, untimed
        torch.set_num_threads(c.threads)
        c.prefill(idx)
    for _ in range(reps):
        for c in contenders:
            results[c.label].add(c.threads, c.prefill, idx)
    return results


# --- peak memory of loading, in a fresh process ------------------------------------------------------


def maxrss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def vm_hwm_bytes() -> int | None:
    """Peak RSS of this process's current address space (Linux), which, unlike ru_maxrss, starts afresh at exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_rss_child(which: str, path: str, dtype: str) -> dict[str, Any]:
    """In a fresh process: load once and return the peak-RSS increase."""
    if which == REF:
        from transformers import GPT2LMHeadModel
    before, hwm_before = maxrss_bytes(), vm_hwm_bytes()  # after the imports, which are not the loader's doing
    if which == OURS:
        model: torch.nn.Module = load_weights(path, dtype=dtype, device="cpu")
    else:
        model = GPT2LMHeadModel.from_pretrained(path, dtype=DTYPE_NAMES[dtype])
    after, hwm_after = maxrss_bytes(), vm_hwm_bytes()
    weights = sum(p.nbytes for p in model.parameters())  # a tied LM head is one parameter, counted once
    hwm_increase = None if hwm_before is None or hwm_after is None else hwm_after - hwm_before
    return {
        "before": before,
        "after": after,
        "increase": after - before,
        "vm_hwm_increase": hwm_increase,
        "weights": weights,
    }


def run_child(task: str, path: str, dtype: str) -> dict[str, Any]:
    """Run `task` (see CHILD_TASKS) in a fresh Python process and return the JSON it prints.

    Linux carries a process's ru_maxrss across fork and exec, so a child inherits the parent's peak: the
    children are started while this process is still small (before it makes or loads any model).
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", task, "--model", path, "--dtype", dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {task} subprocess failed:\n{done.stderr}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def child_main(task: str, path: str, dtype: str) -> None:
    _quiet_transformers()
    if task == MAKE_CHECKPOINT:
        make_random_checkpoint(Path(path))
        print(json.dumps({"path": path}))
    else:
        print(json.dumps(load_rss_child(task.removeprefix("load-rss-"), path, dtype)))


# --- profile ----------------------------------------------------------------------------------------


def profile_decode(model: GPT, prompt: list[int], steps: int, threads: int) -> str:
    """torch.profiler over `steps` of our batch-1 decode steps (and one prefill), operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    params = SamplingParams(max_new_tokens=steps + 1, temperature=0, ignore_eos=True)
    generate(model, [prompt], params)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, [prompt], params)
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return table


# --- the checkpoint ---------------------------------------------------------------------------------


def make_random_checkpoint(directory: Path) -> None:
    """A gpt2-small-shaped GPT2LMHeadModel with transformers' own random initialisation, saved as on disk."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=SMALL.n_layer,
        n_head=SMALL.n_head,
        n_embd=SMALL.n_embd,
        n_positions=SMALL.n_positions,
        vocab_size=SMALL.vocab_size,
    )
    GPT2LMHeadModel(config).save_pretrained(directory)


def _quiet_transformers() -> None:
    """No progress bars or generation warnings on the benchmark's output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_reference(path: str, dtype: torch.dtype) -> Any:
    from transformers import GPT2LMHeadModel

    _quiet_transformers()
    return GPT2LMHeadModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


# --- report -----------------------------------------------------------------------------------------


def best_label(figures: dict[str, float], name: str) -> str:
    """The label of `name`'s fastest thread setting (figures are speeds: higher is better)."""
    return max((label for label in figures if label.startswith(name + " ")), key=figures.__getitem__)


def compare(figures: dict[str, float], ours_label: str) -> dict[str, Any]:
    """Speeds by label, with ours / transformers ratios: ours at --threads and ours at its best, each against
    the reference at its best."""
    ref, best = best_label(figures, REF), best_label(figures, OURS)
    return {
        "speeds": figures,
        "reference": ref,
        "ratio": figures[ours_label] / figures[ref],
        "best_ours": best,
        "ratio_best": figures[best] / figures[ref],
    }


def check_load() -> tuple[float, float, float]:
    """The load average before the benchmark does any work of its own; warns when others are competing."""
    load = os.getloadavg()
    print(
        f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads default {torch.get_num_threads()}"
    )
    if load[0] > BUSY_LOAD:
        print(
            f"WARNING: 1-minute load average is {load[0]:.2f} (> {BUSY_LOAD}) on {os.cpu_count()} "
            "cores: other processes are competing, timings will be noisy and slow."
        )
    return load


def run(args: argparse.Namespace, path: str, load_start: tuple[float, float, float]) -> dict[str, Any]:
    print("measuring load memory (fresh subprocesses) ...")
    rss = {which: run_child(f"load-rss-{which}", path, args.dtype) for which in (OURS, REF)}

    model = load_weights(path, dtype=args.dtype, device="cpu")
    hf = load_reference(path, DTYPE_NAMES[args.dtype])
    cfg = model.config
    thread_counts = sorted({1, min(2, os.cpu_count() or 1), args.threads})
    contenders = [c for t in thread_counts for c in (reference(hf, t), ours(model, t))]  # A B A B
    ours_label = ours(model, args.threads).label

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (8, args.prompt_len), generator=g).tolist()
    decode: dict[int, dict[str, DecodeResult]] = {}
    for batch in (1, 8):
        print(f"decode, batch {batch}: {args.prompt_len} prompt + {args.new_tokens} new tokens, {args.reps} reps ...")
        decode[batch] = bench_decode(contenders, prompts[:batch], args.new_tokens, args.reps)
    prefill_len = min(args.prefill_len, cfg.n_positions)
    print(f"prefill: {prefill_len} tokens, {args.reps} reps ...")
    idx = torch.randint(0, cfg.vocab_size, (1, prefill_len), generator=g)
    prefill = bench_prefill(contenders, idx, args.reps)
    load_end = os.getloadavg()

    report: dict[str, Any] = {
        "checkpoint": path if args.model else "random gpt2-small-shaped (temporary)",
        "shape": {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")},
        "dtype": args.dtype,
        "threads": {"ours": args.threads, "tried": thread_counts},
        "load_average_start": load_start,
        "load_average_end": load_end,
        "cpu_count": os.cpu_count(),
        "versions": {
            "torch": torch.__version__,
            "transformers": _transformers_version(),
            "python": platform.python_version(),
        },
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
    }
    for batch, results in decode.items():
        report[f"decode_b{batch}"] = compare({k: r.tokens_per_s for k, r in results.items()}, ours_label) | {
            "unit": "tokens/s (aggregate, prefill excluded)",
            "ms_per_step": {k: r.ms_per_step for k, r in results.items()},
            "cpu_ms_per_step": {k: r.cpu_ms_per_step for k, r in results.items()},
            "runs_s": {k: {"new_tokens": asdict(r.full), "one_token": asdict(r.one)} for k, r in results.items()},
        }
    report["prefill"] = compare({k: 1 / t.best for k, t in prefill.items()}, ours_label) | {
        "unit": "passes/s",
        "tokens": prefill_len,
        "ms": {k: 1000 * t.best for k, t in prefill.items()},
        "cpu_ms": {k: 1000 * t.best_cpu for k, t in prefill.items()},
        "runs_s": {k: asdict(t) for k, t in prefill.items()},
    }
    report["load_rss"] = rss | {"ratio_to_weights": rss[OURS]["increase"] / rss[OURS]["weights"]}

    print_table(report, [c.label for c in contenders], ours_label)
    if args.profile:
        print(f"\nprofile of ours, batch 1, {args.new_tokens} decode steps, {args.threads} threads:")
        print(profile_decode(model, prompts[0], args.new_tokens, args.threads))
    return report


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def print_table(report: dict[str, Any], labels: list[str], ours_label: str) -> None:
    s = report["shape"]
    print(
        f"\nGPT-2 {s['n_layer']} layers, {s['n_head']} heads, d_model {s['n_embd']}, vocab {s['vocab_size']}, "
        f"context {s['n_positions']}; {report['dtype']}; decode: {report['prompt_len']}-token prompts, "
        f"{report['new_tokens']} new tokens, greedy; best of {report['reps']} alternating runs"
    )
    la, lb = report["load_average_start"], report["load_average_end"]
    print(
        f"load average (1 min) at start {la[0]:.2f}, at end {lb[0]:.2f} (which counts this benchmark's own "
        f"threads); {report['cpu_count']} CPUs\n"
    )
    ratio_head = f"{ours_label}/best ref"
    head = f"{'':<24}" + "".join(f"{label:>17}" for label in labels) + f"{ratio_head:>22}{'best/best':>11}"
    print(head)
    print("-" * len(head))

    def row(name: str, values: dict[str, float], fmt: str, ratios: dict[str, Any] | None = None) -> None:
        cells = "".join(format(values[label], fmt).rjust(17) for label in labels)
        tail = f"{ratios['ratio']:>21.2f}x{ratios['ratio_best']:>10.2f}x" if ratios else ""
        print(f"{name:<24}{cells}{tail}")

    for batch in (1, 8):
        d = report[f"decode_b{batch}"]
        row(f"decode b={batch}, tok/s", d["speeds"], ".1f", d)
        row(f"  ms per step (b={batch})", d["ms_per_step"], ".2f")
        row("  CPU ms per step", d["cpu_ms_per_step"], ".2f")
    p = report["prefill"]
    row(f"prefill {p['tokens']} tok, ms", p["ms"], ".1f", p)
    row("  CPU ms", p["cpu_ms"], ".1f")
    print("-" * len(head))
    r_ours, r_ref = report["load_rss"][OURS], report["load_rss"][REF]
    print(
        f"load, peak RSS increase (ru_maxrss): ours {_mib(r_ours['increase'])} = "
        f"{report['load_rss']['ratio_to_weights']:.2f}x the weights ({_mib(r_ours['weights'])}); "
        f"transformers from_pretrained {_mib(r_ref['increase'])}"
    )
    print(
        "ratios: speed of ours / speed of the fastest transformers thread setting (>1: we are faster); "
        f"fastest reference: decode b=1 {report['decode_b1']['reference']}, "
        f"b=8 {report['decode_b8']['reference']}, prefill {p['reference']}"
    )
    print(
        "CPU ms: process CPU time, which waiting for a busy core does not inflate (at 2 threads it counts both "
        "threads, spin-waits included)"
    )


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.model, args.dtype)
        return 0
    load_start = check_load()
    with tempfile.TemporaryDirectory(prefix="gpt2-bench-") as tmp:
        if args.model:
            path = args.model
        else:
            print("making a random gpt2-small-shaped checkpoint ...")
            path = run_child(MAKE_CHECKPOINT, tmp, args.dtype)["path"]
        report = run(args, path, load_start)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
