"""Smoke test of scripts/bench_harvest.py: a quick run on the tiny checkpoint, its JSON checked (the three ways
ran, their values agree with transformers'), not its speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_harvest_quick(tiny, tokenizer_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = [
        "--model",
        str(tiny.path),
        "--tokenizer",
        str(tokenizer_dir),
        "--contexts",
        "6",
        "--context-size",
        "32",
        "--hook",
        "blocks.1.hook_resid_pre",
        "--batch-size",
        "4",
        "--clients",
        "2",
        "--reps",
        "1",
        "--threads",
        "1",
        "--hidden-states",
        "--json",
        str(out),
    ]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_harvest.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    ways = {"transformers_stop", "transformers_hidden_states", "harvest", "server"}
    assert set(report["tokens_per_s"]) == {*ways, "transformers_stop_after_server"}
    assert set(report["ratio_to_transformers_stop"]) == ways
    assert all(math.isfinite(v) and v > 0 for v in report["tokens_per_s"].values())
    assert report["ratio_to_transformers_stop"]["transformers_stop"] == 1.0
    assert set(report["max_abs_diff_to_transformers"]) == {"harvest", "server"}
    assert all(d < 1e-4 for d in report["max_abs_diff_to_transformers"].values()), report
    assert "CPU flags:" in done.stdout and "gpt2-harvest in process" in done.stdout
