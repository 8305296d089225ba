"""CTranslate2 as a contender of `scripts/bench.py`: the same checkpoint converted once with its
TransformersConverter, timed in float32 and in int8 (the `bench` extra: `pip install -e ".[bench]"`).

CTranslate2 takes tokens as strings of its vocabulary, which the converter reads from the checkpoint's
tokenizer; a checkpoint without one (the bench's random checkpoint) gets a stand-in vocabulary, one
distinct string per id, so ids go in and come out unchanged.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from model.tokenizer import EOT, tokenizer_files

NAME = "ct2"
COMPUTE_TYPES = ("float32", "int8")  # CTranslate2's compute_type: int8 weights with int8 activations on CPU


def available() -> bool:
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str | None:
    try:
        import ctranslate2
    except ImportError:
        return None
    return str(ctranslate2.__version__)


def convert(checkpoint: str, vocab_size: int, out: Path) -> Path:
    """Convert the checkpoint directory into a CTranslate2 model directory `out` (float32 weights; int8 is
    quantized when loaded)."""
    import ctranslate2
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    source = Path(checkpoint)
    if not tokenizer_files(source):  # a stand-in vocabulary beside links to the weights
        staged = out.parent / (out.name + "-source")
        staged.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and not (staged / f.name).exists():
                os.symlink(f.resolve(), staged / f.name)
        vocab = {f"<{i}>": i for i in range(vocab_size - 1)} | {EOT: vocab_size - 1}
        (staged / "vocab.json").write_text(json.dumps(vocab))
        (staged / "merges.txt").write_text("#version: 0.2\n")
        source = staged
    ctranslate2.converters.TransformersConverter(str(source)).convert(str(out), force=True)
    if source != Path(checkpoint):
        shutil.rmtree(source)
    return out


def vocabulary(model_dir: Path) -> list[str]:
    if (model_dir / "vocabulary.json").is_file():
        words: list[str] = json.loads((model_dir / "vocabulary.json").read_text())
        return words
    return (model_dir / "vocabulary.txt").read_text().splitlines()


class Generator:
    """One CTranslate2 generator (compute type, thread count), in `Worker`'s process."""

    def __init__(self, model_dir: Path, compute_type: str, threads: int) -> None:
        import ctranslate2

        self.generator = ctranslate2.Generator(
            str(model_dir), device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1
        )
        self.words = vocabulary(model_dir)
        self.ids = {w: i for i, w in enumerate(self.words)}

    def _tokens(self, prompts: list[list[int]]) -> list[list[str]]:
        return [[self.words[i] for i in p] for p in prompts]

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Greedy: n new token ids for each prompt (the end token does not stop it before n)."""
        results: list[Any] = self.generator.generate_batch(
            self._tokens(prompts),
            max_length=n,
            min_length=n,
            sampling_topk=1,
            include_prompt_in_result=False,
            beam_size=1,
        )
        out = [list(r.sequences_ids[0]) for r in results]
        assert all(len(ids) == n for ids in out), "CTranslate2 generated the wrong number of tokens"
        return out


class Worker:
    """CTranslate2's generators in a process of their own, driven from the bench's, so that its runs still
    alternate with the others'. In the bench's own process CTranslate2 slowed torch's threads for the rest of
    the process: after its first generation, our decode at 2 threads took twice as long at batch 1 (int8
    3.0-3.3 -> 6.2-7.2 ms a token, gpt2-small, a 2-core Zen 5 host; transformers' at 2 threads too), which
    skewed every ratio. Each call returns the CPU seconds the worker spent on it, for the bench's CPU column."""

    def __init__(self, model_dir: Path, specs: list[tuple[str, int]]) -> None:
        """`specs`: the generators to make, as (compute type, threads)."""
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no thread pools inherited
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, str(model_dir), specs), daemon=True)
        self.process.start()
        child.close()
        self._answer()  # the generators are loaded
        self.cpu = 0.0  # CPU seconds of every call so far

    def _answer(self) -> Any:
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the CTranslate2 worker died (exit code {self.process.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"the CTranslate2 worker failed: {value}")
        return value

    def call(self, spec: tuple[str, int], prompts: list[list[int]], n: int) -> float:
        """Greedy generation of n new tokens for each prompt with that generator; the worker's CPU seconds."""
        self.conn.send((spec, prompts, n))
        cpu: float = self._answer()
        self.cpu += cpu
        return cpu

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def _serve(conn: Connection, model_dir: str, specs: list[tuple[str, int]]) -> None:
    """The worker's loop: (spec, prompts, n) -> ("ok", CPU seconds) or ("error", why); None ends it."""
    try:
        generators = {(c, t): Generator(Path(model_dir), c, t) for c, t in specs}
    except Exception as e:
        conn.send(("error", repr(e)))
        return
    conn.send(("ok", None))
    while (message := conn.recv()) is not None:
        spec, prompts, n = message
        try:
            cpu = time.process_time()
            generators[spec].generate(prompts, n)
            conn.send(("ok", time.process_time() - cpu))
        except Exception as e:
            conn.send(("error", repr(e)))
