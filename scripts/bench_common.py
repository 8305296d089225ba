"""What the benchmark scripts share: timing that a busy machine can be caught out in, the machine's own
limit (read bandwidth, matmul FLOP/s), peak memory and the host's CPU (name, vector and matrix extensions)."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model import huge_pages

BUSY_LOAD = 0.5  # 1-minute load average above which other processes are competing for the cores
CPU_READ_BYTES = 256 * 2**20  # bandwidth tensors: far larger than any last-level cache
GPU_READ_BYTES = 2 * 2**30
CPU_GEMM_N = 2048  # square GEMM of the FLOP/s figure
GPU_GEMM_N = 8192


def synchronize() -> None:
    """Wait for queued GPU work, so that a timer read afterwards covers it (a no-op without CUDA in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


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
        """Time `fn(*args)` with torch at `threads` threads (a float it returns: CPU seconds another process
        spent on it, counted in)."""
        torch.set_num_threads(threads)
        synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        elsewhere = fn(*args)
        synchronize()
        self.cpu_runs.append(time.process_time() - cpu + (elsewhere if isinstance(elsewhere, float) else 0.0))
        self.runs.append(time.perf_counter() - wall)


def read_bandwidth(device: torch.device, threads: int, reps: int = 8) -> float:
    """Memory read bandwidth, bytes/s: the best of `reps` passes of each of two kernels that read a float32
    tensor much larger than the caches once, with no writes to speak of: torch.sum, and a matrix-vector
    product over it as a [4096, n / 4096] matrix (decode's own kind of kernel; on some CPUs one thread's
    torch.sum is compute-bound at well under the memory's speed)."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        x = torch.ones(GPU_READ_BYTES // 4, dtype=torch.float32, device=device)
    else:  # in huge pages where there are, as our weights are (model/huge_pages.py)
        x = huge_pages.zeros((CPU_READ_BYTES // 4,), torch.float32).fill_(1)  # written once: the pages exist
    m = x.view(4096, -1)
    v = torch.ones(m.shape[1], dtype=torch.float32, device=device)
    best = float("inf")
    for kernel in (x.sum, lambda: m @ v):
        kernel()  # warm-up
        for _ in range(reps):
            synchronize()
            start = time.perf_counter()
            kernel()
            synchronize()
            best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    threads: int,
    reps: int = 3,
    product: Callable[[torch.Tensor, torch.Tensor], Any] = torch.matmul,
) -> float:
    """FLOP/s of a square GEMM in `dtype` (2 n^3 per product), best of `reps` (on CUDA, each rep is 10
    products in a row, so launch latency does not count). `product(a, b)`: torch's by default (our CPU
    kernels' `kernels.matmul`, a @ b.T, does as many FLOPs)."""
    torch.set_num_threads(threads)
    n, inner = (GPU_GEMM_N, 10) if device.type == "cuda" else (CPU_GEMM_N, 1)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g, device=device, dtype=dtype)
    product(a, b)  # warm-up
    best = float("inf")
    for _ in range(reps):
        synchronize()
        start = time.perf_counter()
        for _ in range(inner):
            product(a, b)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 * inner / best


def measure_limit(device: torch.device, dtype: torch.dtype, thread_counts: list[int]) -> dict[int, dict[str, float]]:
    """Read bandwidth (bytes/s) and matmul FLOP/s at each thread count (on CUDA there is one entry)."""
    return {
        t: {"read_bytes_per_s": read_bandwidth(device, t), "matmul_flop_per_s": matmul_flops(device, dtype, t)}
        for t in thread_counts
    }


def cpu_ticks() -> tuple[float, float] | None:
    """Seconds all CPUs of the machine spent busy, and stolen by the hypervisor, since boot (Linux)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / hz, steal / hz


def others_share(
    start: tuple[float, float, tuple[float, float] | None], helpers: float = 0.0
) -> dict[str, float] | None:
    """The share of all CPUs that other processes took since `start` (wall, own CPU time, cpu_ticks()):
    the machine's busy time less this process's own CPU time and `helpers` (CPU seconds of processes of our
    own since then, such as the CTranslate2 worker), and the time the hypervisor stole."""
    wall0, own0, ticks0 = start
    ticks1 = cpu_ticks()
    if ticks0 is None or ticks1 is None:
        return None
    capacity = (time.perf_counter() - wall0) * (os.cpu_count() or 1)
    others = max(ticks1[0] - ticks0[0] - (time.process_time() - own0) - helpers, 0.0)
    return {"others": others / capacity, "steal": (ticks1[1] - ticks0[1]) / capacity}


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


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> dict[str, bool]:
    """Which of the extensions CPU matmuls depend on the host has (AVX2, FMA, AVX-512, its BF16 and VNNI
    parts, AMX), from /proc/cpuinfo."""
    from model.kernels import matrix_features

    return matrix_features()


def features_text(features: dict[str, bool]) -> str:
    """`cpu_features()` as the benchmarks print it: "avx2 yes, fma yes, avx512f no, ..."."""
    return ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in features.items())


def memory_pages() -> str:
    """The host's transparent-huge-page mode, and whether our weights go into memory advised for huge pages
    there (model/huge_pages.py; the kernel backs it with them where it has them free)."""
    return f"transparent huge pages {huge_pages.mode() or 'absent'}: our CPU weights " + (
        f"advised into {huge_pages.page_size() >> 20} MB pages" if huge_pages.available() else "in ordinary pages"
    )
