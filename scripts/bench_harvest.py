"""Harvest benchmark: activations for an SAE training set, three ways side by side on the same contexts.

    python scripts/bench_harvest.py                       # gpt2-small shape (random weights), 64 x 128 tokens
    python scripts/bench_harvest.py --device cuda --dtype bfloat16 --batch-size 32 --contexts 512

The workload is issue 11's: contexts of `--context-size` tokens (SAELens packs 128), one hook
(`blocks.8.hook_resid_pre`, SAELens' most used GPT-2 small site), float32. Timed, alternating, best of
`--reps`: transformers' loop over batches that stops the forward at the hook's block (a forward pre-hook
that raises, what nnsight's `.stop()` and TransformerLens' `stop_at_layer` do), `gpt2-harvest` in process
(the whole job: reading and tokenizing the text, packing, the forward passes, writing the shards), and, last,
a real `gpt2-serve` with `--clients` concurrent clients each sending one context to `/v1/activations`.
The contexts are the ones the harvest packs from a synthetic corpus (its shards' `token_ids`), so all three
see the same tokens; the values of the other two are compared with transformers'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_TOKENIZER = ROOT.parent / "shared" / "gpt2-tokenizer"
_COMMON = (
    "the of and to in a is that for it as was with be by on not he I this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no what up out who them some could "
    "model layer token residual stream attention sparse feature probe dataset activation harvest"
)
WORDS = _COMMON.split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Harvest benchmark: transformers' early-stopping loop, gpt2-harvest, the server."
    )
    p.add_argument("--model", help="checkpoint directory (default: a random gpt2-small-shaped one, made here)")
    p.add_argument("--tokenizer", default=str(SHARED_TOKENIZER), help="tokenizer directory")
    p.add_argument("--contexts", type=int, default=64, help="contexts harvested (64)")
    p.add_argument("--context-size", type=int, default=128, help="tokens per context (128)")
    p.add_argument("--hook", default="blocks.8.hook_resid_pre", help="the hook (blocks.8.hook_resid_pre)")
    p.add_argument("--batch-size", type=int, default=16, help="contexts per forward pass, ours and transformers' (16)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--clients", type=int, default=8, help="concurrent single-context clients of the server (8)")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each in-process way, alternating (3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (all cores)")
    p.add_argument("--no-server", action="store_true", help="skip the server")
    p.add_argument("--hidden-states", action="store_true", help="also time transformers with output_hidden_states")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    for name in ("contexts", "context_size", "batch_size", "clients", "reps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    return args


def cpu_flags() -> dict[str, bool]:
    """The CPU's vector and matrix extensions that decide float32 and bfloat16 speed (Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    flags = set(match.group(1).split()) if match else set()
    return {f: f in flags for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}


def write_corpus(path: Path, n_tokens: int, seed: int = 0) -> None:
    """Documents of 20-400 common words, enough for `n_tokens` tokens with room to spare."""
    import random

    rnd = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        written = 0
        while written < 1.5 * n_tokens + 1000:
            n = rnd.randint(20, 400)
            f.write(json.dumps({"text": " ".join(rnd.choices(WORDS, k=n))}) + "\n")
            written += n


def read_contexts(out_dir: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    manifest = json.loads((out_dir / "manifest.json").read_text())
    return torch.cat([load_file(out_dir / s["file"])["token_ids"] for s in manifest["shards"]]).long()


def read_acts(out_dir: Path, hook: str) -> torch.Tensor:
    from safetensors.torch import load_file

    manifest = json.loads((out_dir / "manifest.json").read_text())
    return torch.cat([load_file(out_dir / s["file"])[hook] for s in manifest["shards"]])


class Stop(Exception):
    pass


def transformers_loop(
    hf: Any, contexts: torch.Tensor, layer: int, batch_size: int, device: torch.device
) -> torch.Tensor:
    """transformers' forward over batches, ended by a pre-hook on block `layer` that keeps its input."""
    taken: list[torch.Tensor] = []

    def grab(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        taken.append(hidden.to("cpu"))
        raise Stop

    handle = hf.transformer.h[layer].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            for start in range(0, len(contexts), batch_size):
                with contextlib.suppress(Stop):
                    hf(contexts[start : start + batch_size].to(device))
    finally:
        handle.remove()
    return torch.cat(taken)


def transformers_hidden_states(
    hf: Any, contexts: torch.Tensor, layer: int, batch_size: int, device: torch.device
) -> torch.Tensor:
    taken = []
    with torch.inference_mode():
        for start in range(0, len(contexts), batch_size):
            out = hf.transformer(contexts[start : start + batch_size].to(device), output_hidden_states=True)
            taken.append(out.hidden_states[layer].to("cpu"))
    return torch.cat(taken)


def timed(fn: Any, *args: Any, device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, result


async def server_clients(url: str, contexts: torch.Tensor, hook: str, clients: int, dtype: str) -> list[torch.Tensor]:
    """`clients` workers, each sending one context at a time to /v1/activations until all are done."""
    import httpx
    from safetensors.torch import load

    results: list[torch.Tensor | None] = [None] * len(contexts)
    queue = list(range(len(contexts)))

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            body = {"input_ids": contexts[i].tolist(), "activations": {"hooks": [hook], "dtype": dtype}}
            r = await client.post(f"{url}/v1/activations", json=body)
            r.raise_for_status()
            results[i] = load(r.content)[hook][0]

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return [r for r in results if r is not None]


def run_server(args: argparse.Namespace, model: str, contexts: torch.Tensor, tmp: Path) -> tuple[float, torch.Tensor]:
    from gpt2_scripts.bench_server import free_port, log_tail, start_server

    port = free_port()
    log = tmp / "server.log"
    server_args = argparse.Namespace(
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=max(16, args.clients),
        prefill_chunk=None,
    )
    server = start_server(server_args, model, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(server_clients(url, contexts[: args.clients], args.hook, args.clients, args.dtype))  # warm-up
        t0 = time.perf_counter()
        got = asyncio.run(server_clients(url, contexts, args.hook, args.clients, args.dtype))
        seconds = time.perf_counter() - t0
    except BaseException:
        print(f"the server run failed; its log ends:\n{log_tail(log)}", file=sys.stderr)
        raise
    finally:
        server.terminate()
        server.wait(timeout=30)
    return seconds, torch.stack(got)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from model.harvest import harvest
    from model.hooks import select_hooks
    from model.loading import load

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    match = re.fullmatch(r"blocks\.(\d+)\.hook_resid_pre", args.hook)
    if match is None:
        raise SystemExit(
            f"--hook must be blocks.L.hook_resid_pre (transformers' loop stops at block L), got {args.hook}"
        )
    layer = int(match.group(1))
    load_start = os.getloadavg()[0]
    flags = cpu_flags()
    print(
        f"CPU flags: {' '.join(f for f, on in flags.items() if on) or '(none of avx2/avx512/amx)'}; "
        f"torch {torch.__version__}, {args.threads} threads, {args.device}, {args.dtype}"
    )
    if load_start > 0.5:
        print(f"warning: 1-minute load average is {load_start:.2f}: other processes compete for the CPUs")

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model
        if model is None:
            from gpt2_scripts.bench import make_random_checkpoint

            model = str(tmp / "gpt2-small-random")
            make_random_checkpoint(Path(model))
        corpus = tmp / "corpus.jsonl"
        n_tokens = args.contexts * args.context_size
        write_corpus(corpus, n_tokens)
        # as gpt2-harvest loads it: weights laid out for products of many rows (no decode kernels)
        lm = load(model, dtype=args.dtype, device=args.device, tokenizer_dir=args.tokenizer, decode_kernels=False)
        if layer >= lm.model.config.n_layer:
            raise SystemExit(f"--hook {args.hook}: the model has {lm.model.config.n_layer} blocks")
        select_hooks([args.hook], lm.model.config.n_layer)
        hf: Any = GPT2LMHeadModel.from_pretrained(model)
        hf = hf.to(device=device, dtype=dtype).eval()

        def run_harvest(rep: int) -> Path:
            out = tmp / f"acts-{rep}"
            harvest(
                model,
                corpus,
                out,
                [args.hook],
                loaded=lm,
                context_size=args.context_size,
                batch_size=args.batch_size,
                max_tokens=n_tokens,
            )
            return out

        first = run_harvest(-1)  # warm-up, and the contexts everyone gets
        contexts = read_contexts(first)
        assert len(contexts) == args.contexts, (len(contexts), args.contexts)
        transformers_loop(hf, contexts[: args.batch_size], layer, args.batch_size, device)  # warm-up
        times: dict[str, list[float]] = {"transformers_stop": [], "harvest": []}
        if args.hidden_states:
            times["transformers_hidden_states"] = []
        for rep in range(args.reps):  # A B A B: a busy machine slows both alike
            seconds, reference = timed(transformers_loop, hf, contexts, layer, args.batch_size, device, device=device)
            times["transformers_stop"].append(seconds)
            seconds, out = timed(run_harvest, rep, device=device)
            times["harvest"].append(seconds)
            if args.hidden_states:
                seconds, _ = timed(
                    transformers_hidden_states, hf, contexts, layer, args.batch_size, device, device=device
                )
                times["transformers_hidden_states"].append(seconds)
        ours = read_acts(out, args.hook)
        diffs = {"harvest": (ours.double() - reference.double()).abs().max().item()}
        if not args.no_server:
            del lm  # the server has the cores to itself (transformers' model waits, idle)
            seconds, served = run_server(args, model, contexts, tmp)
            times["server"] = [seconds]
            diffs["server"] = (served.double() - reference.double()).abs().max().item()
            # the reference again, right after the server: the load of a shared machine drifts in minutes
            seconds, _ = timed(transformers_loop, hf, contexts, layer, args.batch_size, device, device=device)
            times["transformers_stop_after_server"] = [seconds]

    rates = {k: n_tokens / min(v) for k, v in times.items()}
    base = rates["transformers_stop"]
    ratios = {k: r / base for k, r in rates.items() if k != "transformers_stop_after_server"}
    if "server" in rates:  # against the reference timed next to it (the last in-process run, and the one after)
        beside = (n_tokens / times["transformers_stop"][-1] + rates["transformers_stop_after_server"]) / 2
        ratios["server"] = rates["server"] / beside
    report = {
        "contexts": args.contexts,
        "context_size": args.context_size,
        "hook": args.hook,
        "batch_size": args.batch_size,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "clients": args.clients,
        "cpu_flags": flags,
        "seconds": times,
        "tokens_per_s": rates,
        "ratio_to_transformers_stop": ratios,
        "max_abs_diff_to_transformers": diffs,
        "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    labels = {
        "transformers_stop": f"transformers, batches of {args.batch_size}, stopping at block {layer}",
        "transformers_hidden_states": f"transformers, batches of {args.batch_size}, output_hidden_states=True",
        "harvest": f"gpt2-harvest in process, batches of {args.batch_size} (the whole job)",
        "server": f"gpt2-serve, /v1/activations per context, {args.clients} clients at once",
    }
    print(f"\n{args.contexts} contexts of {args.context_size} tokens, {args.hook}, {args.dtype} on {args.device}")
    print(f"{'way':<66} {'tokens/s':>9} {'ratio':>7} {'max |diff|':>11}")
    for key, ratio in ratios.items():
        diff = diffs.get(key)
        print(f"{labels[key]:<66} {rates[key]:>9.0f} {ratio:>6.2f}x {'' if diff is None else f'{diff:.1e}':>11}")
    if "server" in rates:
        print(
            "(the server's ratio is to transformers' loop timed beside it: "
            f"{n_tokens / times['transformers_stop'][-1]:.0f} tokens/s just before, "
            f"{rates['transformers_stop_after_server']:.0f} just after)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
