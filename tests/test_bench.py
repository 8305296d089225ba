"""Smoke tests of the benchmark scripts: quick runs on the tiny checkpoint, their JSON checked (not their speed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gpt2_scripts import bench

from model import kernels

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str) -> str:
    """The script's standard output, once it ran without an error."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_defaults() -> None:
    args = bench.parse_args([])
    assert (args.batches, args.prefill_lens) == ([1, 8, 32], [128, 1024])
    assert bench.parse_args(["--quick"]).prefill_lens == [64, 128]
    with pytest.raises(SystemExit):
        bench.parse_args(["--prefill-lens", "0"])


def test_bench_quick(tiny, tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    # 500 is past the tiny context (128): measured at 128; the batches come back sorted
    quick = ["--quick", "--batches", "3", "1", "--prefill-lens", "16", "500", "--new-tokens", "4"]
    run_script("bench.py", *quick, "--model", str(tiny.path), "--json", str(out), "--plot", str(png))
    report = json.loads(out.read_text())
    assert report["batches"] == [1, 3]
    assert report["prefill_lens"] == [16, 128]
    names = (bench.OURS, bench.OURS_INT8, bench.REF, *(bench.CT2.values() if report["versions"]["ctranslate2"] else ()))
    labels = {f"{name} {t}t" for name in names for t in report["threads"]["tried"]}
    assert set(report["labels"]) == labels
    keys = [f"decode_b{b}" for b in (1, 3)] + [f"prefill_{n}" for n in (16, 128)]
    assert {k for k in report if k.startswith(("decode_b", "prefill_"))} == {*keys, "prefill_lens"}
    for key in keys:
        entry = report[key]
        assert set(entry["speeds"]) == labels, key
        assert all(positive(v) for v in entry["speeds"].values()), entry["speeds"]
        assert positive(entry["ratio"]) and positive(entry["ratio_best"]), key
        assert entry["ratio"] == entry["speeds"][report["ours_label"]] / entry["speeds"][entry["reference"]]
        pairs = [f"{a}/{b}" for a, b in bench.PAIRS if b in names]
        assert sorted(entry["vs"]) == sorted(pairs), key  # ours and ours-int8 against each reference
        for v in entry["vs"].values():
            assert v["ratio"] == entry["speeds"][v["ours"]] / entry["speeds"][v["reference"]]
    for n in (16, 128):
        p = report[f"prefill_{n}"]
        assert p["tokens"] == n
        assert all(positive(v) for v in p["ms"].values()), p["ms"]
        assert all(len(r["runs"]) == report["reps"] for r in p["runs_s"].values())
    assert all(positive(v) for v in report["decode_b3"]["ms_per_step"].values())
    assert positive(report["load_rss"][bench.OURS]["weights"]) and positive(report["load_rss"]["ratio_to_weights"])
    assert positive(report["limit"]["read_bytes_per_s"]) and positive(report["limit"]["decode_b1_bound_tok_s"])
    fidelity = report["int8_fidelity"]
    assert 0 <= fidelity["mean_abs_logit_error"] <= fidelity["max_abs_logit_error"] and fidelity["kl_mean"] >= 0
    assert 0 <= fidelity["greedy"]["same_token_share"] <= 1
    assert set(report["cpu_features"]) >= {"avx2", "avx512f", "amx_bf16"}
    assert png.read_bytes().startswith(b"\x89PNG")


def test_bench_server_quick(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "server.json"
    model = ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--device", "cpu", "--dtype", "float32"]
    run_script("bench_server.py", "--quick", *model, "--json", str(out))
    report = json.loads(out.read_text())
    levels = report["levels"]
    assert [lv["clients"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["tokens"] > 0 and positive(lv["tokens_per_s"]), lv
        assert positive(lv["throughput_ratio"]) and positive(lv["itl_p99_over_batch1"]), lv
        assert positive(lv["itl_p99_over_batch1_p99"]), lv
        assert positive(lv["ttft_p50_ms"]) and lv["ttft_p99_ms"] >= lv["ttft_p50_ms"], lv
        # the compute bound: no level beats its requests' FLOPs at the GEMM's rate
        assert positive(lv["tflop"]) and lv["tokens_per_s"] <= lv["bound_tokens_per_s"], lv
        assert positive(lv["bound_ratio"]), lv
        # the schedule bound: each pass no shorter than its FLOPs at the same rate, so never above the FLOPs'
        assert lv["schedule_passes"] > 0 and positive(lv["schedule_bound_ratio"]), lv
        assert lv["schedule_bound_tokens_per_s"] <= lv["bound_tokens_per_s"] * (1 + 1e-9), lv
    assert positive(report["matmul_flop_per_s"])
    # torch's GEMM and our kernels' (where they run), before and after the levels; the bound takes the fastest
    pairs = report["matmul_flop_per_s_torch_and_ours"]
    assert len(pairs) == 2 and all(positive(torch_rate) for torch_rate, _ in pairs)
    assert all((ours is not None) == kernels.available() for _, ours in pairs)
    assert report["matmul_flop_per_s"] == max(r for pair in pairs for r in pair if r is not None)
    assert positive(report["read_bytes_per_s"]) and positive(report["schedule_one_at_a_time_tokens_per_s"])
    baselines = report["baselines_one_at_a_time"]
    assert len(baselines) == len(levels) + 1  # one before the first level and one after each
    assert all(b["clients"] == 1 and positive(b["tokens_per_s"]) for b in baselines)
    # memory's read bandwidth just before and after every run over HTTP (one at a time moves with it)
    for run in baselines + levels:
        around = run["read_bytes_per_s_around"]
        assert len(around) == 2 and all(positive(b) for b in around), run
    # the same requests through the engine alone in the bench's process: every token, A B A B as the server's
    alone = report["engine_alone"]
    assert len(alone["baselines_one_at_a_time"]) == len(levels) + 1
    assert all(b["clients"] == 1 and positive(b["tokens_per_s"]) for b in alone["baselines_one_at_a_time"])
    for lv, own in zip(levels, alone["levels"], strict=True):
        assert own["clients"] == lv["clients"] and own["tokens"] == lv["tokens"], (lv, own)
        assert positive(own["throughput_ratio"]) and positive(lv["server_over_engine_alone"]), (lv, own)


def test_bench_prefix_quick(tiny, tmp_path: Path) -> None:
    """Both workloads, sharing on and off: the same results, the prefix copied as the batch's policy says (the
    samples' prompt but its last token, for each sample after the first; the context but its last token, for
    each choice after the first)."""
    out = tmp_path / "prefix.json"
    args = ["--n", "3", "--prompt-len", "40", "--new-tokens", "3", "--choices", "3", "--context-len", "30"]
    run_script(
        "bench_prefix.py", "--model", str(tiny.path), *args, "--prefill-chunk", "16", "--reps", "1", "--json", str(out)
    )
    report = json.loads(out.read_text())
    samples, choices = report["workloads"]["samples"], report["workloads"]["choices"]
    assert samples["copied_tokens"] == 2 * 39 and choices["copied_tokens"] == 2 * 29
    for w in (samples, choices):
        assert w["same_results"] is True and positive(w["seconds_shared"]) and positive(w["seconds_computed"])


def test_forward_flops_counts_what_each_token_needs() -> None:
    """The server bench's bound, against a count token by token: each token fed (a prompt's, then each new
    one but the last) through every block with attention over its positions so far, except that in the last
    block a prompt token whose logits choose nothing needs only its key and value; the LM head wherever a
    token is chosen."""
    from gpt2_scripts.bench_server import Request, forward_flops

    C, L, V = 8, 3, 50
    requests = [Request([1] * 5, 3), Request([2], 1), Request([3] * 4, 1)]
    want = 0
    for r in requests:
        P, n = len(r.input_ids), r.max_new_tokens
        for p in range(P + n - 1):  # the token fed at position p
            chooses = p >= P - 1
            for layer in range(L):
                if layer < L - 1 or chooses:
                    want += 2 * 12 * C * C + 2 * 2 * C * (p + 1)
                else:
                    want += 2 * 2 * C * C
            want += 2 * C * V if chooses else 0
    assert forward_flops({"n_embd": C, "n_layer": L, "vocab_size": V}, requests) == want


def test_schedule_follows_the_engines_policy() -> None:
    """The simulated schedule: every sequence past its prompt decodes a token a pass, prompt tokens go
    `chunk` a pass in the order the sequences joined (a prompt's last chunk takes its first token), a
    finished sequence's client sends its next request for the next pass; the passes' FLOPs add up to
    `forward_flops`, and a pass of few rows is bound by its reads, not its FLOPs."""
    from gpt2_scripts.bench_server import Request, forward_flops, pass_cost, schedule, schedule_seconds

    config = {"n_embd": 8, "n_layer": 3, "vocab_size": 50}
    a, b, c = Request([1] * 5, 3), Request([2] * 2, 1), Request([3] * 4, 2)
    passes = schedule([a, b, c], clients=2, chunk=4, max_batch=64)
    got = [(p.decode, p.chunks, p.outputs) for p in passes]
    assert got == [
        ([], [(0, 4, 5)], 0),  # a's first 4 prompt tokens fill the budget; b waits
        ([], [(4, 5, 5), (0, 2, 2)], 2),  # a's last one (its first token), then b whole (its only token)
        ([5], [(0, 4, 4)], 2),  # a decodes at position 5 (decode tokens take no budget); c, joined in b's
        ([6, 4], [], 2),  # place, prefills whole and takes its first token; then a's third and c's second
    ]
    assert sum(p.outputs for p in passes) == 3 + 1 + 2
    flops = sum(pass_cost(config, p, 0)[0] for p in passes)
    assert flops == forward_flops(config, [a, b, c])
    assert schedule([a, b, c], clients=1, chunk=64, max_batch=64)[0].chunks == [(0, 5, 5)]  # one at a time
    # memory-bound: 1 byte/s makes every pass as long as its reads, which include every weight
    slow = schedule_seconds(config, passes, 4, 1e30, 1.0)
    assert slow >= len(passes) * 4 * (3 * 12 * 8 * 8 + 50 * 8)
    assert schedule_seconds(config, passes, 4, 1.0, 1e30) == flops  # compute-bound: the FLOPs at 1 FLOP/s


def test_ctranslate2_worker(tiny, tmp_path: Path) -> None:
    """CTranslate2 runs in a process of its own (in the bench's it slowed torch's threads): each call returns
    the worker's CPU seconds; a failed call raises here and the worker goes on serving; a model it cannot
    load fails at start."""
    pytest.importorskip("ctranslate2")
    from gpt2_scripts import bench_ctranslate2

    model_dir = bench_ctranslate2.convert(str(tiny.path), 50257, tmp_path / "ct2")
    worker = bench_ctranslate2.Worker(model_dir, [("float32", 1), ("int8", 1)])
    try:
        first = worker.call(("float32", 1), [[1, 2, 3], [4, 5, 6]], 4)
        assert first >= 0 and worker.call(("int8", 1), [[7, 8]], 2) >= 0
        assert worker.cpu >= first
        with pytest.raises(RuntimeError, match="worker failed"):
            worker.call(("float32", 2), [[1]], 1)  # no such generator
        assert worker.call(("float32", 1), [[9]], 1) >= 0  # still serving
    finally:
        worker.close()
    assert not worker.process.is_alive()
    with pytest.raises(RuntimeError, match="worker failed"):
        bench_ctranslate2.Worker(tmp_path / "missing", [("float32", 1)])


def test_bench_sampling_quick(tmp_path: Path) -> None:
    """Every setting timed both ways, on logits whose nucleus the script reports."""
    out = tmp_path / "sampling.json"
    printed = run_script("bench_sampling.py", "--vocab", "2000", "--rows", "2", "--steps", "2", "--json", str(out))
    results = json.loads(out.read_text())["results"]
    assert set(results) == {
        "greedy",
        "temperature 0.8",
        "top_k 40",
        "top_p 0.95",
        "top_p 0.95, temperature 1.5",
        "min_p 0.05",
        "repetition 1.3, top_p 0.9",
    }
    assert all(positive(r["ours_ms"]) and positive(r["transformers_ms"]) for r in results.values())
    assert "the nucleus at top_p 0.95" in printed
