"""Evaluation harnesses get the model's exact log-likelihoods from `/v1/completions`.

lm-evaluation-harness scores a continuation with its `local-completions` model: it posts the token ids of
context + continuation with echo=True, logprobs=1 and max_tokens=1, sums the echoed `token_logprobs` of the
continuation, and calls it greedy when each of them equals the top one. This test runs that model against a
real `gpt2-serve` process and lm-eval's own `hf` model (transformers) on the same random-weight checkpoint,
over a local task file (a JSON-lines dataset, nothing downloaded), and compares every request's
(log-likelihood, is_greedy).

lm-eval runs in a subprocess (this file run as a script) so that HF_HUB_OFFLINE and HF_DATASETS_OFFLINE hold
from its first import: in the pytest process, huggingface_hub is imported already and has read them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from serving import free_port, launch, shut_down

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")
N_CTX = 128  # the `tiny` fixture's context; every request here stays well inside it (no truncation)
TOLERANCE = 1e-4  # absolute, per request: float32 on the CPU, two implementations summing in different orders
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# lm-eval[api,hf]: the harness, the API models' HTTP client, and the hf model's loader.
MISSING = [m for m in ("lm_eval", "aiohttp", "tenacity", "requests", "accelerate") if find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"lm-eval[api,hf] is not installed (missing {', '.join(MISSING)}): pip install -e '.[test]'"
)

MC_DOCS = [
    {"context": "The capital of France is", "choices": [" Paris", " London", " a city on the Seine"], "label": 0},
    {"context": "She poured the milk into the", "choices": [" glass", " sky", " café au lait"], "label": 0},
    {"context": "Question: 2 + 2 =\nAnswer:", "choices": [" 4", " five", " 22"], "label": 0},
    {"context": "The emoji for happy is", "choices": [" 🙂", " :-)", " ☺︎ (U+263A)"], "label": 0},
]
LL_DOCS = [  # more are added: the model's own greedy continuations, so that is_greedy is true for some
    {"context": "In 1905, Einstein published", "continuation": " four papers that changed physics."},
    {"context": "def add(a, b):\n   ", "continuation": " return a + b\n"},
    # characters split over tokens: each lone piece shows as U+FFFD, so top_logprobs keys can collide
    {"context": "日本", "continuation": "語"},
    {"context": "中文", "continuation": "字"},
    {"context": "I like 🙂", "continuation": "😀"},
]
GREEDY_CONTEXTS = ["Hello", "The", "Once upon a time", "import", "1, 2, 3,", "A", "In the", "I am", "It"]


def greedy_continuation(hf: torch.nn.Module, tokenizer: Tokenizer, context: str, max_tokens: int = 4) -> str:
    """The model's greedy continuation of `context`, as long as lm-eval will tokenize it back to the same ids
    (it encodes context + continuation as one string); "" when not even the first token survives that."""
    import torch

    context_ids = tokenizer.encode(context).ids
    chosen: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([context_ids + chosen])).logits[0, -1]
        candidate = [*chosen, int(logits.argmax())]
        text = tokenizer.decode(candidate)
        if tokenizer.encode(context + text).ids != context_ids + candidate:
            break
        chosen = candidate
    return tokenizer.decode(chosen) if chosen else ""


# A task file as lm-eval reads it; the dataset is the `datasets` library's JSON-lines loader on a local file.
TASK_YAML = """\
task: NAME
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA
test_split: test
target_delimiter: ""  # the continuations carry their own leading space
metric_list:
  - metric: acc
"""
MC_YAML = (
    'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
    'doc_to_target: "{{label}}"\n'
)
LL_YAML = 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'


def write_tasks(directory: Path, ll_docs: list[dict[str, str]]) -> list[str]:
    """A multiple-choice task and a loglikelihood task over local JSON-lines files; returns their names."""
    tasks: dict[str, tuple[list[dict[str, Any]], str]] = {
        "gpt2_server_mc": (MC_DOCS, MC_YAML),
        "gpt2_server_ll": (list(ll_docs), LL_YAML),
    }
    for name, (docs, output_type) in tasks.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        task = TASK_YAML.replace("NAME", name).replace("DATA", json.dumps(str(data))) + output_type
        (directory / f"{name}.yaml").write_text(task, encoding="utf-8")
    return list(tasks)


@pytest.fixture(scope="module")
def checkpoint_dir(tiny, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` with the tokenizer files beside it, as lm-eval's hf model and tokenizer loader want."""
    directory = tmp_path_factory.mktemp("tiny_with_tokenizer")
    shutil.copytree(tiny.path, directory, dirs_exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@dataclass
class Server:
    url: str  # e.g. http://127.0.0.1:PORT
    log: Path

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-8000:]


@pytest.fixture(scope="module")
def server(checkpoint_dir: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A `gpt2-serve` process serving `checkpoint_dir` on a free loopback port, killed afterwards.

    It is only started here: the harness loads its own `hf` model meanwhile, and waits for /health before
    it sends the server anything (`wait_until_healthy`)."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model", str(checkpoint_dir), "--tokenizer", str(tokenizer_dir), "--port", str(port)]
    args += ["--served-model-name", "gpt2-tiny"]  # the name the harness asks for (any other would be a 404)
    process = launch([*args, "--device", "cpu", "--dtype", "float32", "--log-level", "warning"], log, OFFLINE)
    try:
        yield Server(f"http://127.0.0.1:{port}", log)
    finally:
        shut_down(process)


def wait_until_healthy(url: str, timeout: float = 120.0) -> None:
    """Poll `url`/health until it answers 200 (503 while the model loads, refused before the port is bound)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:  # URLError and HTTPError (503) included
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f} s")
        time.sleep(0.2)


def run_harness(spec: dict[str, Any], out: Path) -> subprocess.CompletedProcess[str]:
    """Run lm-eval offline (this file as a script, `main`), which writes {model: {task: [[ll, is_greedy]]}}."""
    work = out.parent
    env = os.environ | OFFLINE | {"HF_HOME": str(work / "hf_home"), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, __file__, json.dumps(spec), str(out)]
    return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)


def test_local_completions_matches_hf(tiny, checkpoint_dir: Path, server: Server, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json"))
    greedy = [{"context": c, "continuation": greedy_continuation(tiny.hf, tokenizer, c)} for c in GREEDY_CONTEXTS]
    greedy = [d for d in greedy if d["continuation"]]
    assert len(greedy) >= 3, f"too few greedy continuations survive re-tokenization: {greedy}"
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    tasks = write_tasks(task_dir, LL_DOCS + greedy)

    models: dict[str, dict[str, Any]] = {  # hf first: it needs no server, which finishes starting meanwhile
        "hf": {"pretrained": str(checkpoint_dir), "dtype": "float32", "device": "cpu", "batch_size": 1},
        "local-completions": {
            "model": "gpt2-tiny",
            "base_url": server.url + "/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(checkpoint_dir),  # local files, never the hub
            "max_length": N_CTX,
            "batch_size": 4,  # several prompts per request: rows decoded together in the engine
            "num_concurrent": 1,
            "max_retries": 1,
        },
    }
    spec = {"task_dir": str(task_dir), "tasks": tasks, "models": models, "server": server.url}
    out = tmp_path / "results.json"
    harness = run_harness(spec, out)
    assert harness.returncode == 0, (
        f"lm-eval failed:\n{harness.stderr[-8000:]}\n--- gpt2-serve's log ---\n{server.output()}"
    )
    results = json.loads(out.read_text(encoding="utf-8"))

    worst = 0.0
    for task in tasks:
        reference, served = results["hf"][task], results["local-completions"][task]
        assert len(served) == len(reference) > 0
        for i, ((ll_ref, greedy_ref), (ll, is_greedy)) in enumerate(zip(reference, served, strict=True)):
            worst = max(worst, abs(ll - ll_ref))
            assert ll == pytest.approx(ll_ref, abs=TOLERANCE, rel=0), f"{task} request {i}: {ll} vs hf {ll_ref}"
            assert is_greedy == greedy_ref, f"{task} request {i}: is_greedy {is_greedy} vs hf {greedy_ref}"
    n_greedy = sum(g for _, g in results["hf"]["gpt2_server_ll"])
    assert n_greedy >= len(greedy), "the model's own greedy continuations should be scored greedy"
    print(f"max |local-completions - hf| log-likelihood: {worst:.3g}")


def main() -> None:
    """Subprocess side: evaluate each model on the local tasks, write each request's (ll, is_greedy)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("spec", help="JSON: task_dir, tasks, models {name: model_args}, server (its URL)")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    spec = json.loads(args.spec)

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=spec["task_dir"], include_defaults=False)
    scores: dict[str, dict[str, list[tuple[float, bool]]]] = {}
    for model, model_args in spec["models"].items():
        if "base_url" in model_args:
            wait_until_healthy(spec["server"])
        batch_size = model_args.pop("batch_size")
        results = simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=spec["tasks"],
            task_manager=task_manager,
            batch_size=batch_size,
            log_samples=True,
            verbosity="WARNING",
        )
        assert results is not None
        scores[model] = {}
        for task in spec["tasks"]:
            samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
            # each sample's resps: one [(ll, is_greedy)] per request (one per choice for multiple choice)
            scores[model][task] = [(float(r[0][0]), bool(r[0][1])) for s in samples for r in s["resps"]]
    args.out.write_text(json.dumps(scores), encoding="utf-8")


if __name__ == "__main__":
    main()
