"""Our CPU kernels for the decode step: y = x @ W.T + b for rows x, W [N, K] contiguous, in float32 or in
int8 with a scale per output (`matmul.h`, `matmul.cpp`), and a whole decode step in one call (`decode.cpp`,
driven by `decode.py`). Built at first use with the system's C++ compiler into a cache directory (about
12 s on a 2-core host, once per source version and build), for the CPU's vector extensions (`cpu_isa()`:
AVX-512 with VNNI, or AVX-512, where it has them, else AVX2; a slower build where one cannot be compiled),
loaded with ctypes; where that cannot be done (no compiler, no AVX2/FMA, not x86-64) `available()` is False, one
warning says why, and callers use stock torch.

Why: for 1-32 rows, torch's float32 CPU GEMM (MKL) streams the weights from one thread (a second core
adds nothing at batch 1) and reaches a fraction of the FLOP rate at batch 8; here every thread streams
its own contiguous slab of W (the threads split the outputs) and tiles of accumulators (3 x 4 with AVX2,
4 x 4 of twice the width with AVX-512; with AVX-512, one row of x streams W's rows one after another) keep
the FMA units busy; blocks of many rows take outer products over x's rows, transposed (with AVX-512, float32
blocks of 8-96 rows where the core starts two 512-bit FMAs a cycle, `fma_ports()`, else blocks of 32-96 rows at
least 7/8 full, of 10-16 rows, and of 8-16 rows of a product as wide as the LM head; with AVX2, blocks of 16-96
rows at least 7/8 full, float32 or int8). They also beat MKL for prompt-sized products, up to `max_rows()`.
Thread count: torch's (`torch.get_num_threads()`), through torch's own OpenMP runtime.

Environment: `GPT2_KERNELS=0` turns them off (for A/B runs); `GPT2_KERNEL_ISA` (avx2, avx512, avx512_vnni)
loads that build instead of this CPU's; `GPT2_KERNEL_MAX_ROWS` caps the rows of x a product sends to them, and
so the tokens of a fused pass (`max_rows()`; 0 sends every pass and product to torch); `GPT2_KERNEL_FMA_PORTS`
(1 or 2) sets the 512-bit FMA pipes the AVX-512 builds choose their tiles by, instead of measuring them
(`fma_ports()`); `GPT2_KERNEL_CACHE` is where the library is built (default `$XDG_CACHE_HOME/gpt2-server` or
`~/.cache/gpt2-server`); `CXX` names the compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / "matmul.cpp", HERE / "decode.cpp"]  # compiled together into one library
HEADERS = [HERE / "matmul.h"]
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
AVX512_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw"]  # 16-lane float32, 32-lane int16 tiles
ISAS = {  # the vector extensions a library is built for -> the compiler's flags for them, fastest last
    "avx2": ["-mavx2", "-mfma"],
    "avx512": AVX512_FLAGS,
    "avx512_vnni": [*AVX512_FLAGS, "-mavx512vnni"],  # int8's int16 products summed in one instruction
}
AVX512_NEEDS = frozenset({"avx2", "fma", "avx512f", "avx512vl", "avx512bw"})
NEEDS = {  # what each build needs of the CPU (its /proc/cpuinfo flags)
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": AVX512_NEEDS,
    "avx512_vnni": AVX512_NEEDS | {"avx512_vnni"},
}
BUILD_TIMEOUT_S = 300
MAX_ROWS_AVX2 = 512  # products of more rows (long prefills) go to torch's GEMM (MKL): on an AVX2 host our tiles
# matched or beat it up to here (2 threads: 60 vs 48 GFLOP/s at 128 rows, 62 vs 62 at 512, 60 vs 60 at 1024,
# Zen 1 host; with the outer products, the AVX2 build on a Zen 4 host against MKL held to AVX2, a block's four
# products: 114 vs 97 at 128, 145 vs 137 at 512, then even: 137 vs 139 at 1024, 142 vs 144 at 2048)
MAX_ROWS_AVX512 = 2048  # with AVX-512, float32 blocks of up to 96 rows take outer products (matmul.h's first
# lines say which, by the core's FMA pipes), ahead of MKL's GEMM at every size measured (2 threads, Zen 4 host,
# a block's four products: 172 vs 149 GFLOP/s at 128 rows, 165 vs 135 at 1024, 172 vs 153 at 2048); the int8
# products of prompts too (int16 tiles)


def cache_dir() -> Path:
    """Where the builds are kept, as an absolute path: ctypes looks a library named without a folder up on the
    system's library path, so `GPT2_KERNEL_CACHE=.` would build a library that never loads."""
    given = os.environ.get("GPT2_KERNEL_CACHE")
    base = Path(given) if given else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2-server"
    return base.expanduser().absolute()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def library_path(isa: str | None = None) -> Path:
    """Where the library of this source, built for `isa` (default: this CPU's, `cpu_isa()`), lives in the cache
    (a container builds every build once and may drop the compiler afterwards)."""
    isa = isa or cpu_isa()
    digest = hashlib.sha256(" ".join(FLAGS + ISAS[isa]).encode())
    for f in SOURCES + HEADERS:
        digest.update(f.read_bytes())
    return cache_dir() / f"gpt2_kernels-{isa}-{digest.hexdigest()[:16]}.so"


class NoBuilds(RuntimeError):
    """No build can be made here, whatever its ISA: no compiler, or a cache that cannot hold one."""


def build(compiler: str | None = None, isa: str | None = None) -> Path:
    """Compile the sources for `isa` (default: this CPU's) into the cache (if it is not there yet, or with
    `compiler` given) and return the library's path; raises RuntimeError saying why it cannot (`NoBuilds`
    where no other ISA could be built either). Building needs no CPU that runs the result: an image builds
    every one of ISAS."""
    isa = isa or cpu_isa()
    path = library_path(isa)
    if compiler is None and path.is_file():
        if whole_elf(path):
            return path
        log.warning("the kernel library %s is cut short, damaged or unreadable: building it again", path)
    compiler = compiler or _compiler()
    if compiler is None:
        raise NoBuilds("no C++ compiler found (tried $CXX, c++, g++, clang++)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        workdir = tempfile.TemporaryDirectory(dir=path.parent)
    except OSError as e:
        raise NoBuilds(f"the kernel cache {path.parent} cannot hold a build: {e}") from None
    with workdir as tmp:  # built aside, then moved in one step
        out = Path(tmp) / path.name
        log.info("compiling our CPU kernels (%s build) into %s: once, in 10-30 s", isa, path.parent)
        try:
            done = subprocess.run(
                [compiler, *FLAGS, *ISAS[isa], *map(str, SOURCES), "-o", str(out)],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{compiler} failed to run: {e}") from None
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(out, path)
    return path


def whole_elf(path: Path) -> bool:
    """Whether `path` holds a whole 64-bit little-endian ELF file: its header, its program and section header
    tables and every loadable segment's bytes inside the file. A library cut short (a disk that filled while a
    cache was copied, a damaged image) would load through ctypes and then kill the process with SIGBUS at
    the first page of it that is not there."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4:6] != b"\x02\x01":  # ELFCLASS64, little-endian
                return False
            phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
            if phentsize < 56 or phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
                return False
            f.seek(phoff)
            table = f.read(phnum * phentsize)
    except OSError:
        return False
    if len(table) < phnum * phentsize:  # cut while it was read
        return False
    for i in range(phnum):  # Elf64_Phdr: p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, ...
        p_type, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if p_type == 1 and offset + filesz > size:  # PT_LOAD
            return False
    return True


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def cpu_isa() -> str:
    """The ISAS entry to build and load for this CPU: the fastest whose NEEDS it has (avx512_vnni, then avx512
    with AVX-512 F, VL and BW), else avx2. `GPT2_KERNEL_ISA` chooses another (avx2 on an AVX-512 host, say:
    for A/B runs and tests)."""
    forced = os.environ.get("GPT2_KERNEL_ISA")
    if forced:
        if forced in ISAS:
            return forced
        log.warning("GPT2_KERNEL_ISA=%r is not one of %s: ignored", forced, ", ".join(ISAS))
    return next((isa for isa in reversed(ISAS) if NEEDS[isa] <= cpu_flags()), "avx2")


def fallbacks() -> list[str]:
    """The builds to try loading, in order: this CPU's (`cpu_isa()`), then each slower one, down to avx2
    (where a compiler knows AVX-512 BW but not VNNI, say)."""
    order = list(ISAS)
    return order[: order.index(cpu_isa()) + 1][::-1]


def runnable_isas() -> list[str]:
    """The builds this CPU can run (from AVX2 on), slowest first."""
    return [isa for isa in ISAS if NEEDS[isa] <= cpu_flags()]


def matrix_features() -> dict[str, bool]:
    """Which of the CPU's vector and matrix extensions that CPU matmuls depend on it has."""
    flags = cpu_flags()
    return {
        "avx2": "avx2" in flags,
        "fma": "fma" in flags,
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }


def slow_half_precision(dtype: str) -> str:
    """Why `dtype` ("bfloat16" or "float16") matmuls on this CPU are slower than float32: they run on oneDNN,
    not on this project's kernels, and on every host measured ran slower than our float32; where the CPU also
    lacks the instructions that multiply that format, oneDNN converts every weight to float32 first."""
    native = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}[dtype]
    why = "it runs on oneDNN, not on this project's kernels (on a Zen 5 with AVX-512 BF16 the server served "
    why += "0.60-0.63x float32's tokens/s in bfloat16)"
    flags = cpu_flags()
    if flags and not flags & set(native):
        why += f", and this CPU has neither {native[0]} nor {native[1]}, so each weight is converted on every product"
    return why + "; float32 (the default) is faster and exact" + (", int8 faster still" if available() else "")


def _cpu_supported() -> str | None:
    """Why this CPU cannot run the kernels, or None if it can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512" (both have AVX2 and FMA), ...
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2/FMA (torch reports {capability})"
    if cpu_isa() != "avx2" and not NEEDS[cpu_isa()] <= cpu_flags():
        return f"GPT2_KERNEL_ISA={cpu_isa()}, but the CPU lacks {', '.join(sorted(NEEDS[cpu_isa()] - cpu_flags()))}"
    return None


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("GPT2_KERNELS", "1") == "0":
        log.info("our CPU matrix kernels are off (GPT2_KERNELS=0): stock torch kernels are used")
        return None
    reason = _cpu_supported()
    if reason is None:
        unmade, cannot = [], ""  # the builds that cannot be made here, and why (`NoBuilds`): said once, below
        for isa in fallbacks():
            try:
                lib = ctypes.CDLL(str(build(isa=isa)))
                reason = None
                break
            except NoBuilds as e:  # only a build already in the cache can load
                reason = cannot = str(e)
                unmade.append(isa)
            except (RuntimeError, OSError) as e:
                reason = str(e)
                if isa != "avx2":
                    log.warning("the %s build of our CPU kernels failed (%s): trying the next one", isa, reason)
        if reason is None and unmade:
            log.warning(
                "the %s build of our CPU kernels cannot be made (%s): the %s build in the cache is used",
                " and ".join(unmade),
                cannot,
                isa,
            )
    if reason is not None:
        log.warning("our CPU matrix kernels are not available (%s): using stock torch kernels, slower decoding", reason)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gpt2_matmul_f32.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]
    lib.gpt2_matmul_f32.restype = None
    lib.gpt2_matmul_i8.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.gpt2_matmul_i8.restype = None
    lib.gpt2_forward.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    lib.gpt2_forward.restype = None
    lib.gpt2_fma_ports.argtypes = [ctypes.c_int]
    lib.gpt2_fma_ports.restype = ctypes.c_int
    forced = os.environ.get("GPT2_KERNEL_FMA_PORTS")
    if forced is not None:
        if forced in ("1", "2"):
            lib.gpt2_fma_ports(int(forced))
        else:
            log.warning("GPT2_KERNEL_FMA_PORTS=%r is not 1 or 2: the measured count is used", forced)
    return lib


@cache
def max_rows() -> int:
    """The most rows of x a product sends to our kernels on this CPU (more go to torch's GEMM): 512 for the
    AVX2 build and 2048 for the AVX-512 builds (measured on a 2-core AVX2 host and a 2-core Zen 4 host);
    `GPT2_KERNEL_MAX_ROWS` sets it (0 or more)."""
    if os.environ.get("GPT2_KERNEL_MAX_ROWS"):
        try:
            return max(0, int(os.environ["GPT2_KERNEL_MAX_ROWS"]))
        except ValueError:
            log.warning("GPT2_KERNEL_MAX_ROWS=%r is not a whole number: ignored", os.environ["GPT2_KERNEL_MAX_ROWS"])
    return MAX_ROWS_AVX2 if cpu_isa() == "avx2" else MAX_ROWS_AVX512


def fma_ports() -> int | None:
    """How many 512-bit FMAs a core of this CPU starts each cycle, as the AVX-512 builds measure it once (2 on
    Zen 5 and most AVX-512 Xeons, 1 on Zen 4): with 2, float32 products of 8 rows or more take outer products
    (matmul.h's `outer_pays`). None for the AVX2 build, which does not ask, or without the kernels."""
    lib = _library()
    if lib is None or not cpu_isa().startswith("avx512"):
        return None
    return int(lib.gpt2_fma_ports(-1))


def set_fma_ports(ports: int | None) -> None:
    """Make the AVX-512 builds choose their tiles as for `ports` (1 or 2) 512-bit FMA pipes, or as measured
    (None): for A/B runs and for tests of both rules on any host."""
    lib = _library()
    if ports not in (1, 2, None):
        raise ValueError(f"ports must be 1, 2 or None, got {ports!r}")
    if lib is not None:
        lib.gpt2_fma_ports(ports or 0)


def available() -> bool:
    """Whether the kernels are built and loaded (building them on the first call)."""
    return _library() is not None


def usable(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether a product with input `x` [..., K] and `params` (its weight and bias) can go to the kernels:
    float32 on the CPU, few rows, and no autograd (they have no backward): neither x nor a parameter needs a
    gradient where one would be recorded (a bias trained alone, as BitFit trains them, needs one)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.numel() <= max_rows() * x.shape[-1]
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params)))
        and available()
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T + bias: w [N, K] float32 with contiguous rows, bias [N] or None -> [..., N]."""
    lib = _library()
    assert lib is not None and w.dtype == torch.float32 and w.stride(1) == 1
    x2 = _rows(x)
    (M, K), N = x2.shape, w.shape[0]
    assert w.shape[1] == K and (bias is None or bias.is_contiguous())
    y = torch.empty(M, N, dtype=torch.float32)
    lib.gpt2_matmul_f32(
        x2.data_ptr(), M, K, w.data_ptr(), w.stride(0), None if bias is None else bias.data_ptr(),
        y.data_ptr(), N, torch.get_num_threads(),
    )  # fmt: skip
    return y.view(*x.shape[:-1], N)


def matmul_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(x [..., K] @ q.T) * scale + bias: q [N, K] int8 with contiguous rows, scale [N] float32 -> [..., N].
    Each row of x is rounded to int16 with its own scale inside the product (matmul.h)."""
    lib = _library()
    assert lib is not None and q.dtype == torch.int8 and q.stride(1) == 1 and scale.is_contiguous()
    x2 = _rows(x)
    (M, K), N = x2.shape, q.shape[0]
    assert q.shape[1] == K and (bias is None or bias.is_contiguous())
    y = torch.empty(M, N, dtype=torch.float32)
    lib.gpt2_matmul_i8(
        x2.data_ptr(), M, K, q.data_ptr(), q.stride(0), scale.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), N, torch.get_num_threads(),
    )  # fmt: skip
    return y.view(*x.shape[:-1], N)
