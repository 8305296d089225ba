"""The decode step at fixed shapes, replayed as CUDA graphs (as gpt-fast and vLLM do).

At batch 1 a GPU spends most of a decode step waiting for Python to launch kernels one by one. A CUDA
graph records the whole step once and replays it with one launch. That needs fixed shapes and fixed
memory: the rows are padded up to a bucket size (1, 2, 4, 8, ...; the padding rows are free rows of the
cache, whose contents do not matter), every query attends over all `max_len` keys of the cache (masked),
and tokens and positions are copied into static input tensors before each replay. On a CPU the same
fixed-shape step runs eagerly, which is what the tests compare against the ordinary decode step.
"""

from __future__ import annotations

import torch

from .gpt import GPT
from .kv_cache import KVCache


def buckets(capacity: int) -> list[int]:
    """Batch sizes a graph is captured for: powers of two up to `capacity`, and `capacity` itself."""
    sizes = [1]
    while sizes[-1] * 2 < capacity:
        sizes.append(sizes[-1] * 2)
    return sorted({*sizes, capacity})


class StaticDecode:
    def __init__(self, model: GPT, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        device = cache.k.device
        self.tokens = torch.zeros(cache.capacity, 1, dtype=torch.long, device=device)  # static inputs
        self.positions = torch.zeros(cache.capacity, 1, dtype=torch.long, device=device)
        self.sizes = buckets(cache.capacity)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _step(self, n: int) -> torch.Tensor:
        logits = self.model(self.tokens[:n], self.cache, None, last_only=True, positions=self.positions[:n])
        return logits[:, -1]  # [n, vocab]

    def capture(self) -> None:
        """Record one graph per bucket (on CUDA; a no-op elsewhere). Writes keys and values at position 0
        of the rows: call it before any sequence is in the cache."""
        if self.cache.k.device.type != "cuda":
            return
        assert self.cache.batch_size == 0, "capture before any sequence joins"
        pool = None
        side = torch.cuda.Stream()
        for n in reversed(self.sizes):  # the largest first, so the smaller ones fit in its memory pool
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up outside the graph (kernels pick their algorithms)
                for _ in range(2):
                    self._step(n)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self._step(n)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def __call__(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] for one new token per row; row b writes at `positions[b]`."""
        n = len(tokens)
        size = next(s for s in self.sizes if s >= n)
        pad = size - n  # padding rows are free rows of the cache: write at their position 0
        host = torch.tensor([tokens + [0] * pad, positions + [0] * pad], dtype=torch.long)
        self.tokens[:size, 0].copy_(host[0], non_blocking=True)
        self.positions[:size, 0].copy_(host[1], non_blocking=True)
        graph = self.graphs.get(size)
        if graph is None:
            return self._step(size)[:n]
        graph.replay()
        return self.outputs[size][:n]
