"""Server benchmark: concurrent streaming clients against a real `gpt2-serve` process.

For each level of concurrency (default 1, 4, 16, 32, 64 clients) it sends the same kind of requests
(mixed prompt and output lengths, greedy, streamed from /v1/generate) and measures throughput
(generated tokens per second), time to first token and inter-token latency (p50 and p99). The baseline
is the same kind of requests served one at a time, measured before and after each level (A B A B, so a
change in the machine's speed between runs does not skew a ratio); throughput is reported as a ratio to
the two baselines around it, and p99 inter-token latency as a ratio to their batch-1 latency, both its
p50 and its p99 (on a shared machine even identical steps vary: the p99 of a batch-1 step is often over
twice its p50). On a CPU (float32 or int8 weights) it also prints each level's compute bound: the FLOPs
its requests need (every token's products, attention, the LM head where a token is chosen), however well
they are batched, at the float32 GEMM rate measured before and after the levels (the better of the two; the
faster of torch's GEMM and our kernels'). It is approximate: a server beats it only by running its products
faster than that GEMM. It counts FLOPs alone, so it overstates what a CPU can do with the passes of few rows
(a decode step, a level's tail), which wait on the weights streaming in; the schedule bound counts them
too: the passes the engine takes for the level's requests (`schedule`: DecodeBatch's policy, simulated),
each as long as the longer of its FLOPs at that GEMM rate and its reads (every weight once, each token's
keys and values) at the read bandwidth measured before and after, perfectly overlapped. Last, with the server
stopped, the same requests go through the engine alone (`EngineAlone`: the server's batch in this process, no
HTTP, A B A B again), and each level says what share of that the server made: on a host of few cores, which the
server's HTTP side and the clients share with the engine's threads, the rest is what serving costs there.

    python scripts/bench_server.py                       # a random gpt2-small-shaped checkpoint
    python scripts/bench_server.py --model ./gpt2 --levels 1 4 16 --json server.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_TOKENIZER = ROOT.parent / "shared" / "gpt2-tokenizer"


@dataclass
class Request:
    input_ids: list[int]
    max_new_tokens: int


@dataclass
class Outcome:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Concurrent streaming clients against a real gpt2-serve process.")
    p.add_argument("--model", help="checkpoint directory (default: a random gpt2-small-shaped one, made here)")
    p.add_argument("--tokenizer", default=str(SHARED_TOKENIZER), help="tokenizer directory")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32, 64], help="concurrent clients")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(2 x clients, 16))")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--baseline-requests", type=int, default=8, help="requests served one at a time for the baseline")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per engine step (default: the server's)")
    p.add_argument("--quick", action="store_true", help="small levels and short requests (a smoke run)")
    p.add_argument(
        "--ray",
        type=int,
        default=0,
        metavar="REPLICAS",
        help="serve through Ray Serve, as REPLICAS replicas (ray extra)",
    )
    p.add_argument("--ray-threads", type=int, default=1, help="torch threads (Ray CPUs) per replica with --ray")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument(
        "--server-log", metavar="FILE", help="keep the server's log (stderr) here (default: a temporary file)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.levels, args.prompt_len, args.new_tokens, args.baseline_requests = [1, 4], [8, 32], [4, 12], 4
    return args


def make_requests(n: int, args: argparse.Namespace, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(50000) for _ in range(rng.randint(*args.prompt_len))],
            rng.randint(*args.new_tokens),
        )
        for _ in range(n)
    ]


def measure_gemm() -> tuple[float, float | None]:
    """float32 GEMM FLOP/s on the CPU at torch's thread count (what the server uses), 2048 x 2048 x 2048: torch's
    (MKL), and our kernels' (model/kernels, which the server's products run on; None where they are not
    available). The bound takes the faster: on a Zen 5 host ours ran at about twice MKL's rate."""
    from gpt2_scripts.bench_common import matmul_flops

    from model import kernels

    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    torch_rate = matmul_flops(cpu, torch.float32, threads)
    if not kernels.available():
        return torch_rate, None
    return torch_rate, matmul_flops(cpu, torch.float32, threads, product=kernels.matmul)


def measure_bandwidth() -> float:
    """Memory read bandwidth on the CPU, bytes/s, at torch's thread count (bench_common's measure)."""
    from gpt2_scripts.bench_common import read_bandwidth

    return read_bandwidth(torch.device("cpu"), torch.get_num_threads())


def forward_flops(config: dict[str, Any], requests: list[Request]) -> float:
    """FLOPs the model must spend on `requests`, however they are batched (2 FLOPs a multiply-add): every
    block's products for each token fed (the prompt, then each new token but the last) and attention over
    its earlier positions, except that in the last block a prompt token whose logits choose nothing (all
    but the prompt's last) needs only its key and value; and the LM head at each token that chooses one."""
    C, L, V = config["n_embd"], config["n_layer"], config["vocab_size"]
    block = 2 * 12 * C * C  # Q, K, V, output projection (4 C^2) and the MLP (8 C^2), per token and layer
    key_value = 2 * 2 * C * C  # K and V alone

    def attention(first: int, last: int) -> float:  # QK^T and AV of the tokens at positions first..last,
        keys = (last + 1) * (last + 2) // 2 - first * (first + 1) // 2  # each over p + 1 keys
        return 2 * 2 * C * keys

    total = 0.0
    for r in requests:
        P, n = len(r.input_ids), r.max_new_tokens
        fed = P + n - 1  # positions 0..fed-1; positions P-1.. choose the n new tokens
        total += (L - 1) * (fed * block + attention(0, fed - 1))
        total += n * block + attention(P - 1, fed - 1) + (P - 1) * key_value  # the last block
        total += n * 2 * C * V
    return total


@dataclass
class Pass:
    """One engine step of a simulated schedule: the positions of its decode tokens (one per sequence past
    its prompt), its prompt chunks (start, end, prompt length) and how many tokens it chooses."""

    decode: list[int]
    chunks: list[tuple[int, int, int]]
    outputs: int


def schedule(requests: list[Request], clients: int, chunk: int, max_batch: int) -> list[Pass]:
    """The passes the engine takes for `requests`, sent by `clients` clients that each send the next one
    when their last one ends, under DecodeBatch's policy: every sequence past its prompt decodes one token
    a pass, then up to `chunk` prompt tokens go to the sequences in the order they joined, and a sequence
    whose prompt ends in a pass takes its first token there; a finished sequence leaves and the next
    request joins for the next pass. (The real server's clients answer a pass or so later: approximate.)"""
    queue = list(requests)
    active: list[list[Any]] = []  # [request, prompt tokens fed, tokens chosen], in the order they joined

    def join() -> None:
        while queue and len(active) < min(clients, max_batch):
            active.append([queue.pop(0), 0, 0])

    join()
    passes = []
    while active:
        step = Pass([], [], 0)
        budget = chunk
        for seq in active:
            r, fed, chosen = seq
            P = len(r.input_ids)
            if fed == P:  # decoding: feeds its last token, at position P + chosen - 1
                step.decode.append(P + chosen - 1)
                seq[2] += 1
            elif budget > 0:
                end = min(P, fed + budget)
                step.chunks.append((fed, end, P))
                budget -= end - fed
                seq[1] = end
                seq[2] += end == P
        step.outputs = len(step.decode) + sum(end == P for _, end, P in step.chunks)
        passes.append(step)
        active = [seq for seq in active if seq[2] < seq[0].max_new_tokens]
        join()
    return passes


def pass_cost(config: dict[str, Any], step: Pass, weight_bytes: int) -> tuple[float, float]:
    """FLOPs (counted as `forward_flops` counts them) and bytes read (every weight once, and each token's
    keys and values of its row so far: a decode token's, and a prompt chunk's once) of one pass."""
    C, L, V = config["n_embd"], config["n_layer"], config["vocab_size"]
    block, key_value, kv_bytes = 2 * 12 * C * C, 2 * 2 * C * C, 2 * L * C * 4  # kv_bytes: one position
    flops = 0.0
    reads = float(weight_bytes)
    for q in step.decode:
        flops += L * (block + 4 * C * (q + 1))
        reads += kv_bytes * (q + 1)
    for start, end, P in step.chunks:
        for q in range(start, end):
            chooses = q == P - 1
            flops += (L if chooses else L - 1) * (block + 4 * C * (q + 1)) + (0 if chooses else key_value)
        reads += kv_bytes * end
    return flops + step.outputs * 2 * C * V, reads


def schedule_seconds(
    config: dict[str, Any], passes: list[Pass], dtype_bytes: int, flop_s: float, bytes_s: float
) -> float:
    """The passes' time if each took only the longer of its FLOPs at `flop_s` and its bytes at `bytes_s`,
    the two overlapped perfectly: a bound for this schedule, tighter than the FLOPs alone where passes are
    memory-bound (few rows: a decode step, the tail of a level)."""
    C, L, V = config["n_embd"], config["n_layer"], config["vocab_size"]
    weight_bytes = dtype_bytes * (L * 12 * C * C + V * C)  # the block matrices and the LM head
    total = 0.0
    for step in passes:
        flops, reads = pass_cost(config, step, weight_bytes)
        total += max(flops / flop_s, reads / bytes_s)
    return total


class EngineAlone:
    """The server's batch (DecodeBatch, with the server's settings) in this process, no HTTP and no event loop:
    what the engine alone makes of a level's requests, to set beside what the server made of them. On a host
    whose few cores the server's HTTP side and the clients share with the engine's threads, the difference is
    what serving costs there."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        from model.generate import DecodeBatch
        from model.loading import load
        from server.engine import default_prefill_chunk

        self.loaded = load(model, dtype=args.dtype, device=args.device, tokenizer_dir=args.tokenizer)
        chunk = args.prefill_chunk or default_prefill_chunk(self.loaded.device)
        config, cuda = self.loaded.model.config, self.loaded.device.type == "cuda"
        self.batch = DecodeBatch(self.loaded.model, args.max_batch_size, config.n_positions, chunk, static=cuda)
        self.batch.warm_up()

    def run(self, requests: list[Request], clients: int) -> dict[str, Any]:
        """Tokens/s of `requests` with `clients` of them in the batch at a time (the next joins for the pass
        after one ends, as a client sends its next request when its last one ends), greedy, to each one's
        max_new_tokens."""
        from model.generate import SamplingParams, new_sequence

        model, queue, tokens = self.loaded.model, list(requests), 0
        start = time.perf_counter()
        with torch.inference_mode():
            while queue or len(self.batch):
                while queue and len(self.batch) < min(clients, self.batch.cache.capacity):
                    r = queue.pop(0)
                    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True)
                    self.batch.add(new_sequence(model, 0, r.input_ids, params, None))
                tokens += sum(event is not None for _, event in self.batch.step())
        wall = time.perf_counter() - start
        assert tokens == sum(r.max_new_tokens for r in requests), "incomplete answers"
        return {"clients": clients, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


async def stream_one(client: httpx.AsyncClient, req: Request) -> Outcome:
    body = {
        "input_ids": req.input_ids,
        "max_new_tokens": req.max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = last = time.perf_counter()
    outcome: Outcome | None = None
    async with client.stream("POST", "/v1/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "token_id" not in event:
                continue
            now = time.perf_counter()
            if outcome is None:
                outcome = Outcome(ttft=now - start)
            else:
                outcome.gaps.append(now - last)
            outcome.tokens += 1
            last = now
    assert outcome is not None and outcome.tokens == req.max_new_tokens, "incomplete answer"
    return outcome


async def run_level(url: str, requests: list[Request], clients: int) -> dict[str, Any]:
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                outcomes.append(await stream_one(client, queue.get_nowait()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    tokens = sum(o.tokens for o in outcomes)
    gaps = sorted(g for o in outcomes for g in o.gaps)
    ttfts = sorted(o.ttft for o in outcomes)
    return {
        "clients": clients,
        "requests": len(requests),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
    }


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of the server's log, to show why it failed."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no server log)"
    return "\n".join(text[-lines:])


def start_server(args: argparse.Namespace, model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """Start `gpt2-serve` with its log (stderr) going to `log`, a file: a pipe nobody reads would fill and
    block the server's threads the moment it logs a burst of errors."""
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        model,
        "--tokenizer",
        args.tokenizer,
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-batch-size",
        str(args.max_batch_size),
        "--max-queue",
        "4096",
        "--log-level",
        "warning",
    ]
    if args.prefill_chunk is not None:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    with log.open("wb") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=stderr)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}; its log ends:\n{log_tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not become ready within 300 s; its log ends:\n{log_tail(log)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: 1-minute load average is {load_before:.2f}: other processes compete for the CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from gpt2_scripts.bench import make_random_checkpoint

            model = str(Path(tmp) / "gpt2-small-random")
            make_random_checkpoint(Path(model))
        config = json.loads((Path(model) / "config.json").read_text())
        # The bound a level could reach on this machine: its FLOPs at the CPU's GEMM rate, at the server's
        # thread count, measured before the server runs and again after it stops (the higher counts). Only
        # for float32 and int8 weights on a CPU (int8's prompt-sized products run float32 tiles).
        from model.loading import resolve_device

        bounded = (
            not args.ray and resolve_device(args.device).type == "cpu" and args.dtype in ("auto", "float32", "int8")
        )
        gemm_rates = [measure_gemm()] if bounded else []
        bandwidths = [measure_bandwidth()] if bounded else []
        port = free_port()
        log = Path(args.server_log) if args.server_log else Path(tmp) / "server.log"
        if args.ray:  # the same app behind Ray Serve's proxy (its log is Ray's, under its temp directory)
            from gpt2_scripts import bench_ray

            url, stop = bench_ray.start(args, model)
        else:
            server = start_server(args, model, port, log)
            url = f"http://127.0.0.1:{port}"

            def stop() -> None:
                server.terminate()
                server.wait(timeout=30)

        between: list[float] = []  # memory read bandwidth before the first run and after each one

        def run(requests: list[Request], clients: int) -> dict[str, Any]:
            """`run_level`, with the memory read bandwidth measured just before and just after it where the
            bounds are (a CPU; one sample between two runs serves both): one at a time waits on memory, which
            on a shared host moves from minute to minute (on a Zen 5 host, between about 49 and 77 GB/s within
            a few minutes), so each ratio is read beside the memory its two sides ran at."""
            if bounded and not between:
                between.append(measure_bandwidth())
            result = asyncio.run(run_level(url, requests, clients))
            if bounded:
                between.append(measure_bandwidth())
                result["read_bytes_per_s_around"] = between[-2:]
            return result

        try:
            asyncio.run(run_level(url, make_requests(2, args, seed=99), 2))  # warm-up
            one_at_a_time = make_requests(args.baseline_requests, args, seed=0)
            baselines = [run(one_at_a_time, 1)]
            levels, level_requests = [], []
            for clients in args.levels:  # A B A B: a baseline before and after each level
                n = args.requests or max(2 * clients, 16)
                requests = make_requests(n, args, seed=clients)
                level_requests.append(requests)
                levels.append(run(requests, clients))
                levels[-1]["tflop"] = forward_flops(config, requests) / 1e12
                baselines.append(run(one_at_a_time, 1))
        except BaseException:
            print(f"the benchmark failed; the server's log ends:\n{log_tail(log)}", file=sys.stderr)
            raise
        finally:
            stop()
        # the same requests through the engine alone, in this process (A B A B again), the server now stopped
        alone: dict[str, Any] | None = None
        if not args.ray:
            engine = EngineAlone(args, model)
            engine.run(make_requests(2, args, seed=99), 2)  # warm-up
            alone = {"baselines_one_at_a_time": [engine.run(one_at_a_time, 1)], "levels": []}
            for clients, requests in zip(args.levels, level_requests, strict=True):
                alone["levels"].append(engine.run(requests, clients))
                alone["baselines_one_at_a_time"].append(engine.run(one_at_a_time, 1))
            del engine
    if bounded:
        gemm_rates.append(measure_gemm())
        bandwidths.append(measure_bandwidth())
    from gpt2_scripts.bench_common import cpu_features, cpu_name, features_text, memory_pages

    peak = max(r for pair in gemm_rates for r in pair if r is not None) if gemm_rates else None
    report = {
        "ray_replicas": args.ray,
        "ray_threads": args.ray_threads if args.ray else None,
        "dtype": args.dtype,
        "prefill_chunk": args.prefill_chunk,
        "baselines_one_at_a_time": baselines,
        "levels": levels,
        "load_average_at_start": load_before,
        "load_average_at_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "matmul_flop_per_s": peak,
        "matmul_flop_per_s_torch_and_ours": gemm_rates,
        "read_bytes_per_s": max(bandwidths) if bandwidths else None,
        "host": {"cpu": cpu_name(), "cpu_features": cpu_features(), "memory_pages": memory_pages()},
    }
    host = report["host"]
    print(
        f"\nhost: {host['cpu']}, {os.cpu_count()} CPUs; extensions: {features_text(host['cpu_features'])}; "
        f"{host['memory_pages']}"
    )
    rates = [b["tokens_per_s"] for b in baselines]
    print(
        f"\nbaseline, the same kind of requests one at a time, measured before and after each level: "
        f"{min(rates):.1f}-{max(rates):.1f} tokens/s, inter-token p50 "
        f"{min(b['itl_p50_ms'] for b in baselines):.1f}-{max(b['itl_p50_ms'] for b in baselines):.1f} ms"
    )
    print(
        f"{'clients':>7} {'tok/s':>8} {'x 1-at-a-time':>14} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'ITL p99 / batch-1 p50':>22} {'/ batch-1 p99':>14}"
    )
    # one at a time's tokens/s next to each level: the mean of the baselines measured before and after it
    beside = [(baselines[i]["tokens_per_s"] + baselines[i + 1]["tokens_per_s"]) / 2 for i in range(len(levels))]
    for i, lv in enumerate(levels):
        before, after = baselines[i], baselines[i + 1]  # the baselines measured next to this level
        lv["throughput_ratio"] = lv["tokens_per_s"] / beside[i]
        lv["itl_p99_over_batch1"] = lv["itl_p99_ms"] / ((before["itl_p50_ms"] + after["itl_p50_ms"]) / 2)
        lv["itl_p99_over_batch1_p99"] = lv["itl_p99_ms"] / ((before["itl_p99_ms"] + after["itl_p99_ms"]) / 2)
        print(
            f"{lv['clients']:>7} {lv['tokens_per_s']:>8.1f} {lv['throughput_ratio']:>14.2f} "
            f"{lv['ttft_p50_ms']:>7.0f}ms {lv['ttft_p99_ms']:>7.0f}ms {lv['itl_p50_ms']:>6.1f}ms "
            f"{lv['itl_p99_ms']:>6.1f}ms {lv['itl_p99_over_batch1']:>22.2f} {lv['itl_p99_over_batch1_p99']:>14.2f}"
        )
    if all("read_bytes_per_s_around" in r for r in baselines + levels):

        def around(r: dict[str, Any]) -> str:
            return "-".join(f"{b / 1e9:.0f}" for b in r["read_bytes_per_s_around"])

        print(
            "memory read bandwidth just before and after each run, GB/s (one at a time waits on memory, the levels "
            "mostly on arithmetic): one at a time "
            + ", ".join(around(b) for b in baselines)
            + "; "
            + ", ".join(f"{lv['clients']} clients {around(lv)}" for lv in levels)
        )
    report["engine_alone"] = alone
    if alone is not None:
        base = alone["baselines_one_at_a_time"]
        print(
            "\nthe engine alone (the same requests through the server's batch in this process, no HTTP, no event "
            "loop, A B A B as above): one at a time "
            f"{min(b['tokens_per_s'] for b in base):.1f}-{max(b['tokens_per_s'] for b in base):.1f} tok/s"
        )
        for i, (lv, own) in enumerate(zip(levels, alone["levels"], strict=True)):
            own_beside = (base[i]["tokens_per_s"] + base[i + 1]["tokens_per_s"]) / 2
            own["throughput_ratio"] = own["tokens_per_s"] / own_beside
            lv["server_over_engine_alone"] = lv["tokens_per_s"] / own["tokens_per_s"]
            print(
                f"{own['clients']:>7} clients: {own['tokens_per_s']:.1f} tok/s = {own['throughput_ratio']:.2f}x one at "
                f"a time; the server made {100 * lv['server_over_engine_alone']:.0f}% of it"
            )
    if peak is not None:  # a level beats this only by running its products faster than the GEMM measured
        torch_rate = max(pair[0] for pair in gemm_rates)
        ours = [pair[1] for pair in gemm_rates if pair[1] is not None]
        measured = f"torch's {torch_rate / 1e9:.0f}" + (f", our kernels' {max(ours) / 1e9:.0f}" if ours else "")
        print(
            f"\ncompute bound (approximate): float32 GEMM at {peak / 1e9:.0f} GFLOP/s (2048^2, {measured}: the faster, "
            f"{torch.get_num_threads()} threads, the better of before and after the levels); a level's requests need "
            "their FLOPs (every token's products, attention, the LM head where a token is chosen) however they are "
            "batched:"
        )
        for i, lv in enumerate(levels):
            lv["bound_tokens_per_s"] = lv["tokens"] / (lv["tflop"] * 1e12 / peak)
            lv["bound_ratio"] = lv["bound_tokens_per_s"] / beside[i]
            print(
                f"{lv['clients']:>7} clients: {lv['tflop']:.2f} TFLOP -> at most {lv['bound_tokens_per_s']:.1f} tok/s "
                f"= {lv['bound_ratio']:.2f}x one at a time; measured {lv['tokens_per_s']:.1f} tok/s "
                f"({100 * lv['tokens_per_s'] / lv['bound_tokens_per_s']:.0f}% of the bound)"
            )
        bandwidth = max(bandwidths)
        chunk = args.prefill_chunk or 64  # the server's default on a CPU
        weight = 1 if args.dtype == "int8" else 4
        base_passes = schedule(one_at_a_time, 1, chunk, args.max_batch_size)
        base_seconds = schedule_seconds(config, base_passes, weight, peak, bandwidth)
        report["schedule_one_at_a_time_tokens_per_s"] = sum(r.max_new_tokens for r in one_at_a_time) / base_seconds
        print(
            f"\nschedule bound (approximate): the passes the engine takes ({chunk} prompt tokens a pass beside every "
            "decode token), each as long as the longer of its FLOPs at that GEMM rate and its reads (every weight, "
            f"each token's keys and values) at {bandwidth / 1e9:.1f} GB/s (read bandwidth, the better of before and "
            "after), the two perfectly overlapped. One at a time so modeled: "
            f"{report['schedule_one_at_a_time_tokens_per_s']:.1f} tok/s ({len(base_passes)} passes; measured "
            f"{min(rates):.1f}-{max(rates):.1f}, slower where memory streamed slower than the bandwidth measured)"
        )
        for i, lv in enumerate(levels):
            passes = schedule(level_requests[i], lv["clients"], chunk, args.max_batch_size)
            lv["schedule_passes"] = len(passes)
            lv["schedule_bound_tokens_per_s"] = lv["tokens"] / schedule_seconds(config, passes, weight, peak, bandwidth)
            lv["schedule_bound_ratio"] = lv["schedule_bound_tokens_per_s"] / beside[i]
            print(
                f"{lv['clients']:>7} clients: {len(passes)} passes -> at most {lv['schedule_bound_tokens_per_s']:.1f} "
                f"tok/s = {lv['schedule_bound_ratio']:.2f}x one at a time (as measured); measured "
                f"{lv['tokens_per_s']:.1f} tok/s ({100 * lv['tokens_per_s'] / lv['schedule_bound_tokens_per_s']:.0f}% "
                "of the bound)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
