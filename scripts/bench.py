"""Benchmark: our GPT-2 against transformers' GPT2LMHeadModel, side by side (a benchmark, not a test).

    python scripts/bench.py                        # gpt2-small-shaped random checkpoint, full run, CPU
    python scripts/bench.py --quick --json out.json
    python scripts/bench.py --model ./gpt2 --dtype bfloat16 --profile
    python scripts/bench.py --device cuda --batches 1 8 32 64   # on a GPU, bfloat16 by default there
    python scripts/bench.py --prefill-lens 128 512 1024 --plot ratios.png

Measures, on the same checkpoint in the official format:
  1. greedy decode throughput at batch 1, 8 and 32 (--batches), prefill excluded (the time of N new tokens minus
     that of one new token, so only the N - 1 one-token steps are left), as aggregate tokens/s; on CUDA ours
     decodes through DecodeBatch(static=True), the decode step replayed as CUDA graphs captured once per
     batch size (untimed, as a server does at start-up);
  2. the time of one forward pass over 128 and over 1024 tokens (--prefill-lens) keeping only the last
     position's logits (prefill);
  3. the peak resident memory added by loading our model, in a fresh process, against the weights' size
     (loading to the CPU); on CUDA also each contender's peak GPU memory in each benchmark;
  4. the machine's limit in the same run: memory read bandwidth (best of passes of torch.sum and of a
     matrix-vector product over a tensor far larger than the caches) and matmul FLOP/s (a large GEMM in the
     benchmark's dtype), and from them the bound for batch-1 decode, bandwidth / the bytes of weights read
     per token (every parameter once, the tied LM head included); each side's batch-1 speed is printed as a
     fraction of it.
The machine may be shared and noisy: the runs alternate reference and ours (A B A B ...) and the best of each
is kept; on CPU both sides are timed at 1 and 2 torch threads (and --threads), and ours, at --threads and at
its best, is compared with the reference's fastest setting. A 1-minute load average above 0.5 at the start is
warned about, and so is a share of the CPUs taken by other processes (from /proc/stat, less this process's
own CPU time) during the timed runs. Ratios are speed ratios, ours / transformers: above 1 means we are faster;
--plot draws them as a bar chart (needs matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench.py`: this checkout's `model` first
    sys.path.insert(0, str(ROOT))

from gpt2_scripts import bench_ctranslate2  # noqa: E402
from gpt2_scripts.bench_common import (  # noqa: E402
    Timing,
    check_load,
    cpu_features,
    cpu_name,
    cpu_ticks,
    features_text,
    maxrss_bytes,
    measure_limit,
    memory_pages,
    others_share,
    vm_hwm_bytes,
)

from model.config import GPTConfig  # noqa: E402
from model.generate import DecodeBatch, SamplingParams, generate, new_sequence  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.loading import DTYPE_NAMES, load_weights  # noqa: E402
from model.quantize import weight_bytes  # noqa: E402
from model.tokenizer import EOT_ID  # noqa: E402

SMALL = GPTConfig(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257)  # gpt2-small's shape
BUSY_SHARE = 0.1  # share of all CPUs taken by other processes during the timed runs worth a warning
OURS = "ours"
OURS_INT8 = "ours-int8"  # --dtype float32 on CPU: our weight-only int8 beside our float32
REF = "transformers"
CT2 = {"float32": "ct2-float32", "int8": "ct2-int8"}  # CTranslate2 (scripts/bench_ctranslate2.py), by compute type
# each of ours against each reference it is compared with, in the report's "vs" and the ratio table
PAIRS = [(OURS, REF), (OURS, CT2["float32"]), (OURS_INT8, REF), (OURS_INT8, CT2["int8"])]
MAKE_CHECKPOINT = "make-checkpoint"
COL = 17  # width of a contender's column in the table
CHILD_TASKS = [MAKE_CHECKPOINT, f"load-rss-{OURS}", f"load-rss-{REF}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark our GPT-2 against transformers on CPU or CUDA.")
    p.add_argument(
        "--model",
        help="checkpoint directory (config.json, model.safetensors); default: a random "
        "gpt2-small-shaped one made in a temporary directory",
    )
    p.add_argument("--quick", action="store_true", help="fewer tokens and shorter prefills (a smoke run)")
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads of the headline figure for ours (default: %(default)s); both sides are timed at 1, "
        "2 and this many, and ours is compared with the reference's fastest setting",
    )
    p.add_argument("--new-tokens", type=int, help="new tokens per decode run (default 128, --quick 16)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens for the decode runs")
    p.add_argument(
        "--prefill-lens", type=int, nargs="+", help="tokens of each prefill pass (default 128 1024, --quick 64 128)"
    )
    p.add_argument("--reps", type=int, help="timed repetitions of each contender (default 3, --quick 2)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="auto: cuda if available")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on CUDA"
    )
    p.add_argument(
        "--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes (default: %(default)s)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw the ours / transformers ratios as a bar chart")
    p.add_argument("--profile", action="store_true", help="also profile some of our batch-1 decode steps")
    p.add_argument(
        "--no-ctranslate2", action="store_true", help="leave CTranslate2 out (timed by default when installed)"
    )
    p.add_argument("--child", choices=CHILD_TASKS, help=argparse.SUPPRESS)  # internal: see run_child
    args = p.parse_args(argv)
    args.new_tokens = args.new_tokens or (16 if args.quick else 128)
    args.prefill_lens = args.prefill_lens or ([64, 128] if args.quick else [128, 1024])
    args.reps = args.reps or (2 if args.quick else 3)
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be at least 2 (decode time is N tokens minus 1), got {args.new_tokens}")
    if args.reps < 2:
        p.error(f"--reps must be at least 2 (runs alternate A B A B), got {args.reps}")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if any(b < 1 for b in args.batches):
        p.error(f"--batches must all be at least 1, got {args.batches}")
    args.batches = sorted(set(args.batches))
    if any(n < 1 for n in args.prefill_lens):
        p.error(f"--prefill-lens must all be at least 1, got {args.prefill_lens}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


# --- timing ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    """One side of the comparison at one thread count (on CUDA, one setting: threads do not matter)."""

    name: str  # OURS or REF
    threads: int
    device: torch.device
    # generate n new tokens for each prompt; where another process does it, it returns that one's CPU seconds
    decode: Callable[[list[list[int]], int], float | None]
    prefill: Callable[[torch.Tensor], float | None]  # one forward pass over [1, T], last position's logits only
    release: Callable[[], None] = lambda: None  # drop state kept between runs (our captured CUDA graphs)

    @property
    def label(self) -> str:
        return f"{self.name} {self.threads}t" if self.device.type == "cpu" else f"{self.name} {self.device.type}"


def ours(model: GPT, threads: int, max_len: int, name: str = OURS) -> Contender:
    """On CPU, decode through `generate`; on CUDA, through a DecodeBatch whose decode step is replayed as CUDA
    graphs, captured once per batch size in the warm-up (`max_len`: prompt plus new tokens) and reused."""
    device = model.wte.weight.device
    batches: dict[int, DecodeBatch] = {}  # batch size -> its batch, graphs captured

    def decode(prompts: list[list[int]], n: int) -> None:
        out = generate(model, prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
        assert all(len(c.token_ids) == n for c in out), "ours generated the wrong number of tokens"

    def decode_graphed(prompts: list[list[int]], n: int) -> None:
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        with torch.inference_mode():
            batch = batches.get(len(prompts))
            if batch is None:
                batch = batches[len(prompts)] = DecodeBatch(model, len(prompts), max_len, static=True)
            seqs = [new_sequence(model, i, p, params, None) for i, p in enumerate(prompts)]
            for seq in seqs:
                batch.add(seq)
            while len(batch):
                batch.step()
        assert all(len(s.result().token_ids) == n for s in seqs), "ours generated the wrong number of tokens"

    def prefill(idx: torch.Tensor) -> None:
        with torch.inference_mode():
            model(idx, last_only=True)

    if device.type == "cuda":
        return Contender(name, threads, device, decode_graphed, prefill, batches.clear)
    return Contender(name, threads, device, decode, prefill)


def ctranslate2_contenders(
    path: str, vocab_size: int, tmp: Path, threads: list[int]
) -> tuple[list[Contender], bench_ctranslate2.Worker]:
    """CTranslate2 in float32 and int8 at each thread count, from one conversion of the checkpoint, run in a
    process of its own (`bench_ctranslate2.Worker`: in this one it slowed torch's threads); close the worker
    when done."""
    model_dir = bench_ctranslate2.convert(path, vocab_size, tmp / "ct2")
    worker = bench_ctranslate2.Worker(model_dir, [(c, t) for t in threads for c in CT2])
    out = []
    for t in threads:
        for compute_type, name in CT2.items():
            spec = (compute_type, t)

            def decode(prompts: list[list[int]], n: int, spec: tuple[str, int] = spec) -> float:
                return worker.call(spec, prompts, n)

            def prefill(idx: torch.Tensor, spec: tuple[str, int] = spec) -> float:
                return worker.call(spec, idx.tolist(), 1)  # the prompt in one pass, and one token

            out.append(Contender(name, t, torch.device("cpu"), decode, prefill))
    return out, worker


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two greedy continuations of the same prompts agree: the share of positions with the same
    token, and the mean length of the common prefix (after the first difference the contexts differ)."""
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(ra, rb, strict=True)) if x != y), len(ra))
        for ra, rb in zip(a, b, strict=True)
    ]
    return {"same_token_share": same / sum(map(len, a)), "mean_common_prefix": sum(prefix) / len(prefix)}


def fidelity(model: GPT, quantized: GPT, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """int8 against float32 on the bench's prompts: logit errors and the KL divergence of the next-token
    distributions KL(float32 || int8) over every prompt position, and greedy agreement over `new_tokens`."""
    idx = torch.tensor(prompts)
    with torch.inference_mode():
        ref, q = model(idx).double(), quantized(idx).double()  # [B, T, vocab]
    err = (ref - q).abs()
    logp, logq = ref.log_softmax(-1), q.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [B, T]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    a = [c.token_ids for c in generate(model, prompts, params)]
    b = [c.token_ids for c in generate(quantized, prompts, params)]
    return {
        "prompts": len(prompts),
        "positions": int(kl.numel()),
        "max_abs_logit_error": float(err.max()),
        "mean_abs_logit_error": float(err.mean()),
        "logit_std": float(ref.std()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement_prompt_positions": float((ref.argmax(-1) == q.argmax(-1)).double().mean()),
        "greedy": greedy_agreement(a, b) | {"new_tokens": new_tokens},
    }


def reference(hf: Any, threads: int) -> Contender:
    import inspect

    keep_one = "logits_to_keep" in inspect.signature(hf.forward).parameters
    device = hf.device

    def decode(prompts: list[list[int]], n: int) -> None:
        ids = torch.tensor(prompts, device=device)
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

    return Contender(REF, threads, device, decode, prefill)


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


def peak_gpu_extra(c: Contender, fn: Callable[..., object], *args: Any) -> int:
    """Bytes of GPU memory `fn(*args)` needs at its peak beyond what is allocated before it (both models'
    weights): measured alone, after the timed runs, from a clean start (our graphs recaptured inside)."""
    c.release()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    c.release()
    return peak


# --- the machine's limit ----------------------------------------------------------------------------


# --- peak memory of loading, in a fresh process ------------------------------------------------------


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
    vs = {}  # each of ours (at --threads) against each reference at its fastest setting
    for mine, theirs in PAIRS:
        label = ours_label.replace(OURS, mine, 1)
        if label in figures and any(k.startswith(theirs + " ") for k in figures):
            other = best_label(figures, theirs)
            vs[f"{mine}/{theirs}"] = {"ours": label, "reference": other, "ratio": figures[label] / figures[other]}
    return {
        "speeds": figures,
        "reference": ref,
        "ratio": figures[ours_label] / figures[ref],
        "best_ours": best,
        "ratio_best": figures[best] / figures[ref],
        "vs": vs,
    }


def run(args: argparse.Namespace, path: str, load_start: tuple[float, float, float], tmp: Path) -> dict[str, Any]:
    print("measuring load memory (fresh subprocesses) ...")
    rss = {which: run_child(f"load-rss-{which}", path, args.dtype) for which in (OURS, REF)}

    device, dtype = torch.device(args.device), DTYPE_NAMES[args.dtype]
    model = load_weights(path, dtype=args.dtype, device=device)
    hf = load_reference(path, dtype).to(device)
    cfg = model.config
    thread_counts = sorted({1, min(2, os.cpu_count() or 1), args.threads})
    if device.type == "cuda":
        thread_counts = [args.threads]  # the GPU does the work: one setting, no 1-vs-2-thread timing
    max_len = args.prompt_len + args.new_tokens
    contenders = [c for t in thread_counts for c in (reference(hf, t), ours(model, t, max_len))]  # A B A B
    ours_label = ours(model, args.threads, max_len).label
    extra_refs: list[Contender] = []
    quantized, notes = None, []
    ct2_worker: bench_ctranslate2.Worker | None = None
    if device.type == "cpu" and args.dtype == "float32":  # int8 and CTranslate2 beside float32
        quantized = load_weights(path, dtype="int8", device=device)
        if bench_ctranslate2.available() and not args.no_ctranslate2:
            print("converting the checkpoint for CTranslate2 ...")
            extra_refs, ct2_worker = ctranslate2_contenders(path, cfg.vocab_size, tmp, thread_counts)
        else:
            notes.append(
                "CTranslate2 not timed: "
                + ("--no-ctranslate2" if args.no_ctranslate2 else "not installed (pip install -e '.[bench]')")
            )
        by_threads = {t: [c for c in extra_refs if c.threads == t] for t in thread_counts}
        contenders = [
            c
            for t in thread_counts
            for c in (reference(hf, t), *by_threads[t], ours(model, t, max_len), ours(quantized, t, max_len, OURS_INT8))
        ]
    print(f"machine limit: read bandwidth and {args.dtype} matmul FLOP/s at {thread_counts} threads ...")
    limit_start = measure_limit(device, dtype, thread_counts)

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (max(args.batches), args.prompt_len), generator=g).tolist()
    busy_start = (time.perf_counter(), time.process_time(), cpu_ticks())
    helpers_start = ct2_worker.cpu if ct2_worker is not None else 0.0
    decode: dict[int, dict[str, DecodeResult]] = {}
    gpu_peak: dict[str, dict[str, int]] = {}
    for batch in args.batches:
        print(f"decode, batch {batch}: {args.prompt_len} prompt + {args.new_tokens} new tokens, {args.reps} reps ...")
        decode[batch] = bench_decode(contenders, prompts[:batch], args.new_tokens, args.reps)
        if device.type == "cuda":
            gpu_peak[f"decode_b{batch}"] = {
                c.label: peak_gpu_extra(c, c.decode, prompts[:batch], args.new_tokens) for c in contenders
            }
    prefill_lens = sorted({min(n, cfg.n_positions) for n in args.prefill_lens})  # at most the context
    prefill: dict[int, dict[str, Timing]] = {}
    for n in prefill_lens:
        print(f"prefill: {n} tokens, {args.reps} reps ...")
        idx = torch.randint(0, cfg.vocab_size, (1, n), generator=g).to(device)
        prefill[n] = bench_prefill(contenders, idx, args.reps)
        if device.type == "cuda":
            gpu_peak[f"prefill_{n}"] = {c.label: peak_gpu_extra(c, c.prefill, idx) for c in contenders}
    share = others_share(busy_start, ct2_worker.cpu - helpers_start if ct2_worker is not None else 0.0)
    if ct2_worker is not None:
        ct2_worker.close()
    load_end = os.getloadavg()
    limit_end = measure_limit(device, dtype, thread_counts)  # again: the bandwidth swings from minute to minute
    limit = {t: {k: max(limit_start[t][k], limit_end[t][k]) for k in limit_start[t]} for t in thread_counts}

    report: dict[str, Any] = {
        "checkpoint": path if args.model else "random gpt2-small-shaped (temporary)",
        "shape": {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")},
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "dtype": args.dtype,
        "threads": {"ours": args.threads, "tried": thread_counts},
        "ours_label": ours_label,
        "labels": [c.label for c in contenders],
        "cpu_features": cpu_features() if device.type == "cpu" else None,
        "memory_pages": memory_pages() if device.type == "cpu" else None,
        "notes": notes,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "cpu_count": os.cpu_count(),
        "versions": {
            "torch": torch.__version__,
            "transformers": _transformers_version(),
            "ctranslate2": bench_ctranslate2.version(),
            "python": platform.python_version(),
        },
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batches": args.batches,
        "prefill_lens": prefill_lens,
        "reps": args.reps,
    }
    for batch, results in decode.items():
        report[f"decode_b{batch}"] = compare({k: r.tokens_per_s for k, r in results.items()}, ours_label) | {
            "unit": "tokens/s (aggregate, prefill excluded)",
            "ms_per_step": {k: r.ms_per_step for k, r in results.items()},
            "cpu_ms_per_step": {k: r.cpu_ms_per_step for k, r in results.items()},
            "runs_s": {k: {"new_tokens": asdict(r.full), "one_token": asdict(r.one)} for k, r in results.items()},
        }
    for n, timings in prefill.items():
        report[f"prefill_{n}"] = compare({k: 1 / t.best for k, t in timings.items()}, ours_label) | {
            "unit": "passes/s",
            "tokens": n,
            "ms": {k: 1000 * t.best for k, t in timings.items()},
            "cpu_ms": {k: 1000 * t.best_cpu for k, t in timings.items()},
            "runs_s": {k: asdict(t) for k, t in timings.items()},
        }
    report["load_rss"] = rss | {"ratio_to_weights": rss[OURS]["increase"] / rss[OURS]["weights"]}
    if quantized is not None:
        print("int8 fidelity against float32 on the bench prompts ...")
        report["int8_fidelity"] = fidelity(model, quantized, prompts[:8], min(32, args.new_tokens))
        report["int8_weight_bytes"] = weight_bytes(quantized)
    if device.type == "cuda":
        weights = {OURS: _nbytes(model), REF: _nbytes(hf)}
        report["gpu_memory"] = {
            "unit": "bytes; peak_extra: torch.cuda.max_memory_allocated over what was allocated before the run",
            "weights": weights,
            "peak_extra": gpu_peak,
            "peak": {k: {c.label: weights[c.name] + v[c.label] for c in contenders} for k, v in gpu_peak.items()},
        }
    report["limit"] = limit_report(limit, limit_start, limit_end, _nbytes(model), contenders, decode, ours_label)
    report["busy"] = busy_report(share, contenders, decode, prefill, device)

    print_table(report, [c.label for c in contenders], ours_label)
    if args.profile:
        print(f"\nprofile of ours, batch 1, {args.new_tokens} decode steps, {args.threads} threads:")
        print(profile_decode(model, prompts[0], args.new_tokens, args.threads))
    return report


def _nbytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters, each once (a tied LM head is the embedding's parameter, counted once)."""
    return sum(p.nbytes for p in model.parameters())


def limit_report(
    limit: dict[int, dict[str, float]],
    start: dict[int, dict[str, float]],
    end: dict[int, dict[str, float]],
    weight_bytes: int,
    contenders: list[Contender],
    decode: dict[int, dict[str, DecodeResult]],
    ours_label: str,
) -> dict[str, Any]:
    """The batch-1 decode bound, bandwidth / bytes of weights per token, at each thread count and at the
    best one (the machine's), with each side's batch-1 speed as a fraction of it."""
    bound = {t: v["read_bytes_per_s"] / weight_bytes for t, v in limit.items()}
    best = max(limit, key=lambda t: limit[t]["read_bytes_per_s"])
    out: dict[str, Any] = {
        "method": "read: best pass of torch.sum and of a matrix-vector product over a float32 tensor far larger "
        "than the caches, at the start and the end of the run; matmul: square GEMM in the benchmark's dtype; "
        "bound: read bytes/s / weight bytes",
        "weight_bytes_per_token": weight_bytes,
        "read_bytes_per_s": limit[best]["read_bytes_per_s"],
        "matmul_flop_per_s": max(v["matmul_flop_per_s"] for v in limit.values()),
        "decode_b1_bound_tok_s": bound[best],
        "best_threads": best,
        "by_threads": {str(t): v | {"decode_b1_bound_tok_s": bound[t]} for t, v in limit.items()},
        "start": {str(t): v for t, v in start.items()},
        "end": {str(t): v for t, v in end.items()},
        "by_label": {c.label: limit[c.threads] | {"decode_b1_bound_tok_s": bound[c.threads]} for c in contenders},
    }
    if 1 in decode:
        speeds = {label: r.tokens_per_s for label, r in decode[1].items()}
        for c in contenders:
            out["by_label"][c.label]["fraction_of_own_bound"] = speeds[c.label] / bound[c.threads]
        ref = best_label(speeds, REF)
        out["fraction_of_bound"] = {label: v / bound[best] for label, v in speeds.items()}
        out["ours"] = {"label": ours_label, "fraction": speeds[ours_label] / bound[best]}
        best_ours = best_label(speeds, OURS)
        out["best_ours"] = {"label": best_ours, "fraction": speeds[best_ours] / bound[best]}
        out["reference"] = {"label": ref, "fraction": speeds[ref] / bound[best]}
    return out


def busy_report(
    share: dict[str, float] | None,
    contenders: list[Contender],
    decode: dict[int, dict[str, DecodeResult]],
    prefill: dict[int, dict[str, Timing]],
    device: torch.device,
) -> dict[str, Any]:
    """Whether other processes competed for the CPUs during the timed runs: their share of all CPUs, and (on
    CPU) this process's CPU time per wall second in its 1-thread runs, which is below 1 when it waited."""
    timings = [t for r in decode.values() for k, d in r.items() for t in (d.full, d.one) if k.endswith(" 1t")]
    timings += [t for r in prefill.values() for k, t in r.items() if k.endswith(" 1t")]
    one_thread = None
    if device.type == "cpu" and timings:
        one_thread = sum(sum(t.cpu_runs) for t in timings) / sum(sum(t.runs) for t in timings)
    flagged = (share is not None and share["others"] + share["steal"] > BUSY_SHARE) or (
        one_thread is not None and one_thread < 1 - BUSY_SHARE
    )
    return {"others_share": share, "one_thread_cpu_per_wall": one_thread, "flagged": flagged}


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def print_table(report: dict[str, Any], labels: list[str], ours_label: str) -> None:
    s = report["shape"]
    print(
        f"\nGPT-2 {s['n_layer']} layers, {s['n_head']} heads, d_model {s['n_embd']}, vocab {s['vocab_size']}, "
        f"context {s['n_positions']}; {report['dtype']} on {report['device']} ({report['device_name']}); decode: "
        f"{report['prompt_len']}-token prompts, {report['new_tokens']} new tokens, greedy; best of "
        f"{report['reps']} alternating runs"
    )
    la, lb = report["load_average_start"], report["load_average_end"]
    print(
        f"load average (1 min) at start {la[0]:.2f}, at end {lb[0]:.2f} (which counts this benchmark's own "
        f"threads); {report['cpu_count']} CPUs\n"
    )
    ratio_head = f"{ours_label}/best ref"
    head = f"{'':<24}" + "".join(f"{label:>{COL}}" for label in labels) + f"{ratio_head:>22}{'best/best':>11}"
    print(head)
    print("-" * len(head))

    def row(name: str, values: dict[str, float], fmt: str, ratios: dict[str, Any] | None = None) -> None:
        cells = "".join(format(values[label], fmt).rjust(COL) for label in labels)
        tail = f"{ratios['ratio']:>21.2f}x{ratios['ratio_best']:>10.2f}x" if ratios else ""
        print(f"{name:<24}{cells}{tail}")

    gpu = report.get("gpu_memory")
    for batch in report["batches"]:
        d = report[f"decode_b{batch}"]
        row(f"decode b={batch}, tok/s", d["speeds"], ".1f", d)
        row(f"  ms per step (b={batch})", d["ms_per_step"], ".2f")
        row("  CPU ms per step", d["cpu_ms_per_step"], ".2f")
        if gpu:
            row("  peak GPU MiB", {k: v / 2**20 for k, v in gpu["peak"][f"decode_b{batch}"].items()}, ".0f")
    for n in report["prefill_lens"]:
        p = report[f"prefill_{n}"]
        row(f"prefill {n} tok, ms", p["ms"], ".1f", p)
        row("  CPU ms", p["cpu_ms"], ".1f")
        if gpu:
            row("  peak GPU MiB", {k: v / 2**20 for k, v in gpu["peak"][f"prefill_{n}"].items()}, ".0f")
    lim = report["limit"]
    by_label = lim["by_label"]
    row("read bandwidth, GB/s", {k: v["read_bytes_per_s"] / 1e9 for k, v in by_label.items()}, ".1f")
    row("matmul, GFLOP/s", {k: v["matmul_flop_per_s"] / 1e9 for k, v in by_label.items()}, ".0f")
    row("b=1 bound, tok/s", {k: v["decode_b1_bound_tok_s"] for k, v in by_label.items()}, ".1f")
    if "fraction_of_bound" in lim:
        row("  b=1 / bound, %", {k: 100 * v["fraction_of_own_bound"] for k, v in by_label.items()}, ".1f")
    print("-" * len(head))
    print_versus(report)
    r_ours, r_ref = report["load_rss"][OURS], report["load_rss"][REF]
    print(
        f"load, peak RSS increase (ru_maxrss, loading to the CPU): ours {_mib(r_ours['increase'])} = "
        f"{report['load_rss']['ratio_to_weights']:.2f}x the weights ({_mib(r_ours['weights'])}); "
        f"transformers from_pretrained {_mib(r_ref['increase'])}"
    )
    if gpu:
        print(
            f"peak GPU MiB: the contender's weights (ours {_mib(gpu['weights'][OURS])}, transformers "
            f"{_mib(gpu['weights'][REF])}) + torch.cuda.max_memory_allocated over the allocation before the run"
        )
    print(
        f"machine limit: read bandwidth {lim['read_bytes_per_s'] / 1e9:.1f} GB/s (best, at "
        f"{lim['best_threads']} threads), {report['dtype']} matmul {lim['matmul_flop_per_s'] / 1e9:.0f} GFLOP/s; "
        f"batch-1 decode bound {lim['decode_b1_bound_tok_s']:.1f} tok/s "
        f"({_mib(lim['weight_bytes_per_token'])} of weights read per token)"
    )
    if "fraction_of_bound" in lim:
        print(
            f"batch-1 decode as a fraction of that bound: {lim['ours']['label']} {100 * lim['ours']['fraction']:.1f}% "
            f"(ours at its best, {lim['best_ours']['label']}, {100 * lim['best_ours']['fraction']:.1f}%), "
            f"{lim['reference']['label']} {100 * lim['reference']['fraction']:.1f}% (the table's row: each column "
            "against the bound at its own thread count)"
        )
    fastest = ", ".join(f"b={b} {report[f'decode_b{b}']['reference']}" for b in report["batches"])
    fastest_prefill = ", ".join(f"{n} {report[f'prefill_{n}']['reference']}" for n in report["prefill_lens"])
    print(
        "ratios: speed of ours / speed of the fastest transformers thread setting (>1: we are faster); "
        f"fastest reference: decode {fastest}, prefill {fastest_prefill}"
    )
    print(
        "CPU ms: process CPU time, which waiting for a busy core does not inflate (at 2 threads it counts both "
        "threads, spin-waits included)"
    )
    busy = report["busy"]
    share, one = busy["others_share"], busy["one_thread_cpu_per_wall"]
    if share is not None:
        print(
            f"other processes during the timed runs: {100 * share['others']:.0f}% of all CPUs, plus "
            f"{100 * share['steal']:.0f}% stolen by the hypervisor"
            + (f"; this process's 1-thread runs got {100 * one:.0f}% of a core" if one is not None else "")
        )
    if busy["flagged"]:
        print(
            f"WARNING: other processes took a noticeable share of the CPUs (> {100 * BUSY_SHARE:.0f}%) during "
            "the timed runs: timings are noisy and ratios against the reference may be inflated or deflated."
        )


def print_versus(report: dict[str, Any]) -> None:
    """Each of ours (at --threads) against each reference at its fastest thread setting, row by row; the
    host's CPU extensions; int8's fidelity against float32."""
    keys = [f"decode_b{b}" for b in report["batches"]] + [f"prefill_{n}" for n in report["prefill_lens"]]
    names = [f"decode b={b}" for b in report["batches"]] + [f"prefill {n} tok" for n in report["prefill_lens"]]
    pairs = [f"{a}/{b}" for a, b in PAIRS if f"{a}/{b}" in report[keys[0]]["vs"]]
    print(f"\nspeed ratios, ours at {report['threads']['ours']} threads / each reference at its fastest setting:")
    print(f"{'':<24}" + "".join(f"{p:>24}" for p in pairs))
    for key, name in zip(keys, names, strict=True):
        vs = report[key]["vs"]
        print(f"{name:<24}" + "".join(f"{vs[p]['ratio']:>23.2f}x" for p in pairs))
    for note in report["notes"]:
        print(note)
    if report["cpu_features"] is not None:
        f = report["cpu_features"]
        print(f"host CPU extensions: {features_text(f)}")
    if report.get("memory_pages"):
        print(f"host memory: {report['memory_pages']}")
    fid = report.get("int8_fidelity")
    if fid:
        g = fid["greedy"]
        print(
            f"int8 against float32 ({fid['prompts']} bench prompts, {fid['positions']} positions): logit error max "
            f"{fid['max_abs_logit_error']:.4f}, mean {fid['mean_abs_logit_error']:.5f} (logit std "
            f"{fid['logit_std']:.3f}); KL(float32 || int8) mean {fid['kl_mean']:.2e}, max {fid['kl_max']:.2e}; "
            f"same top-1 at {100 * fid['top1_agreement_prompt_positions']:.1f}% of prompt positions; greedy "
            f"{g['new_tokens']} tokens: {100 * g['same_token_share']:.1f}% the same token, common prefix "
            f"{g['mean_common_prefix']:.1f} tokens on average"
        )


def plot(report: dict[str, Any], path: str) -> None:
    """A bar chart of the speed ratios: ours at --threads (on CPU also ours at its best) against the fastest
    reference setting, one group of bars per decode batch size and per prefill length."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    keys = [f"decode_b{b}" for b in report["batches"]] + [f"prefill_{n}" for n in report["prefill_lens"]]
    names = [f"decode b={b}" for b in report["batches"]] + [f"prefill {n}" for n in report["prefill_lens"]]
    bars = {report["ours_label"]: "ratio"} | ({"ours at its best": "ratio_best"} if report["device"] == "cpu" else {})
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(1.2 * len(keys) + 2, 4))
    for j, (label, ratio) in enumerate(bars.items()):
        offset = (j - (len(bars) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(keys))], [report[k][ratio] for k in keys], width, label=label)
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set_xticks(range(len(keys)), names)
    ax.set_ylabel("speed, ours / fastest transformers")
    ax.set_title(f"{report['dtype']} on {report['device']}: above 1, ours is faster")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        report = run(args, path, load_start, Path(tmp))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
