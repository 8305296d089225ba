"""Our CPU matrix kernels (model/kernels) against torch on every projection shape of gpt2-small, medium,
large and xl, the LM head and odd shapes, at every row count they take; the layers that use them; and the
fallback to stock torch where the kernels cannot be built."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import Checkpoint, load_ours

from model import kernels
from model.gpt import Conv1D, TiedLMHead
from model.kernels.layers import KernelConv1D, KernelLMHead
from model.loading import load_weights

ROOT = Path(__file__).resolve().parents[1]

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="our CPU kernels cannot be built here")

# (K, N) of each projection: c_attn, attn c_proj, c_fc, mlp c_proj, for d_model 768 / 1024 / 1280 / 1600
GPT2_SHAPES = [(c, n) for c in (768, 1024, 1280, 1600) for n in (3 * c, c, 4 * c)] + [
    (4 * c, c) for c in (768, 1024, 1280, 1600)
]
ODD_SHAPES = [(1, 1), (7, 5), (9, 3), (13, 17), (64, 1), (100, 6), (15, 33), (777, 50)]
# Beyond 96: more than one pass over W. With AVX-512, float32 blocks of 32-96 rows at least 7/8 full take outer
# products (matmul.h): 32, 42, 47, 61, 64, 75, 80, 90 and 96 (every tile height, full and partial), 128 (96 + 32)
# and 143 (96 + 47), and blocks of 10-16 rows (16 here) in one padded vector; 33 and 41 fall on the dot-product
# tiles (padding rule), as do 8 and 17 and the 1- and 8-row ends of 97 and 200 (where the core has one 512-bit
# FMA pipe: the test with both rules below covers the other). With AVX2, blocks of 16-96 rows at least 7/8 full
# (in vectors of 8), float32 or int8, take them: float32 in tiles of 2 vectors, or 3 where the vectors are odd
# (16, 21 and 24 in one tile; 40, 56, 72 and 88 3 at a time, the last 2, 1 or none left over; 32, 42, 47, 61 ...
# 2 at a time), int8 in tiles of 2 (21, 24, 40, ... with one left over); 17, 33 and 41 do not.
ROWS = [1, 2, 3, 4, 5, 7, 8, 16, 17, 21, 24, 32, 33, 40, 41, 42, 47, 56, 61, 64, 72, 75, 80, 88, 90, 96, 97, 128, 143]
ROWS += [200]


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y if bias is None else y + bias.double()).float()


def tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    """float32 rounding of a K-term dot product, relative to the size of its terms."""
    return 1e-5 * float((x.abs() @ w.abs().T).max()) + 1e-6


@needs_kernels
@pytest.mark.parametrize(("k", "n"), GPT2_SHAPES + ODD_SHAPES)
def test_float32_matches_torch(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k * 7919 + n)
    w, bias = torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g)
    for m in ROWS if n * k < 2**22 else (1, 2, 3, 8, 24, 33, 64):
        x = torch.randn(m, k, generator=g)
        y = kernels.matmul(x, w, bias)
        assert y.shape == (m, n)
        torch.testing.assert_close(y, reference(x, w, bias), rtol=0, atol=tolerance(x, w))
    torch.testing.assert_close(kernels.matmul(x, w), reference(x, w, None), rtol=0, atol=tolerance(x, w))


@pytest.fixture(params=[1, 2], ids=["one 512-bit FMA pipe", "two"])
def fma_ports(request: pytest.FixtureRequest) -> Iterator[int]:
    """The AVX-512 builds' tile rules for one and for two 512-bit FMA pipes (matmul.h's `outer_pays`), whatever
    this host has; then as measured again."""
    if not kernels.cpu_isa().startswith("avx512"):
        pytest.skip("only the AVX-512 builds choose their tiles by the FMA pipes")
    kernels.set_fma_ports(request.param)
    assert kernels.fma_ports() == request.param
    yield request.param
    kernels.set_fma_ports(None)


@needs_kernels
@pytest.mark.parametrize(("k", "n"), [(768, 2304), (3072, 768), (1600, 4800), *ODD_SHAPES])
def test_float32_matches_torch_with_either_fma_rule(fma_ports: int, k: int, n: int) -> None:
    """With two pipes every block of 8-96 rows takes outer products, padded to whole vectors (8, 16, 17, 21,
    24, 33, 40, 41 ... and the 1- and 8-row ends of 97 and 200 too); with one, as in the test above, and blocks
    of 10-16 rows in one padded vector (10, 11, 12, 15, 16; 8 and 9 on the dot-product tiles)."""
    g = torch.Generator().manual_seed(k * 7919 + n + fma_ports)
    w, bias = torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g)
    for m in [*ROWS, 9, 10, 11, 12, 15, 31, 49, 65, 81, 95]:
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(kernels.matmul(x, w, bias), reference(x, w, bias), rtol=0, atol=tolerance(x, w))


@needs_kernels
def test_lm_head_with_either_fma_rule(fma_ports: int) -> None:
    g = torch.Generator().manual_seed(fma_ports)
    wte = torch.randn(50257, 768, generator=g) * 0.15
    for m in (8, 16, 17, 24, 40):  # two pipes: outer products at every one of these; one: at 8 and 16
        x = torch.randn(m, 768, generator=g)
        torch.testing.assert_close(kernels.matmul(x, wte), reference(x, wte, None), rtol=0, atol=tolerance(x, wte))


def test_fma_ports_is_measured_or_set() -> None:
    """The AVX-512 builds measure 1 or 2; GPT2_KERNEL_FMA_PORTS sets it in a fresh process; set_fma_ports
    refuses anything else."""
    if not kernels.available() or not kernels.cpu_isa().startswith("avx512"):
        assert kernels.fma_ports() is None
        return
    assert kernels.fma_ports() in (1, 2)
    with pytest.raises(ValueError, match="ports must be 1, 2 or None"):
        kernels.set_fma_ports(3)
    code = "from model import kernels; print(kernels.fma_ports())"
    for value, expect in (("1", "1"), ("2", "2")):
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=os.environ | {"GPT2_KERNEL_FMA_PORTS": value},
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        assert done.stdout.strip() == expect


@needs_kernels
@pytest.mark.parametrize(("k", "n"), GPT2_SHAPES + ODD_SHAPES)
def test_int8_matches_dequantized(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k * 31 + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale, bias = torch.rand(n, generator=g) * 1e-3, torch.randn(n, generator=g)
    w = q.float() * scale[:, None]
    for m in ROWS if n * k < 2**22 else (1, 2, 3, 8, 33, 40):
        x = torch.randn(m, k, generator=g)
        y = kernels.matmul_int8(x, q, scale, bias)
        assert ((y - reference(x, w, bias)).abs() <= int8_tolerance(x, w)).all()


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 12, 16, 17, 32])  # AVX2: outer products (int16 pairs) at 16 and 32
def test_int8_largest_sums_do_not_overflow(m: int) -> None:
    """Every product at its largest (each x at its row's max, so 32767 in int16, against weights of +-127, all
    of one sign per output) over gpt2-xl's longest K, 6400: the int32 sums become float32 before they could
    overflow (with AVX2's 8 lanes they passed 2^31 after 4128 of K; an outer-product tile's lanes, one row
    and one output each, would after 516: they turn every 64)."""
    k = 6400
    q = torch.full((4, k), 127, dtype=torch.int8)
    q[1::2] = -127
    scale = torch.full((4,), 1e-3)
    x = torch.full((m, k), 0.5)
    y = kernels.matmul_int8(x, q, scale, None)
    torch.testing.assert_close(y, reference(x, q.float() * scale[:, None], None), rtol=1e-5, atol=0)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 96])  # dot-product tiles and, with AVX2, outer products
def test_int8_products_keep_nan_and_inf(m: int) -> None:
    """A row of x with a NaN or an infinity gives non-finite outputs, as float32 does (rounded to int16 a NaN
    would become a plain number, and an overflowed activation would give finite, made-up logits); the other
    rows are untouched."""
    g = torch.Generator().manual_seed(m)
    k, n = 768, 64
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 1e-3
    x = torch.randn(m, k, generator=g)
    x[0, 5] = float("nan")
    x[-1, k - 1] = float("inf")
    y = kernels.matmul_int8(x, q, scale, None)
    assert y[0].isnan().all() and y[-1].isnan().all()
    if m > 2:
        assert y[1:-1].isfinite().all()
        w, rest = q.float() * scale[:, None], x[1:-1]
        assert ((y[1:-1] - reference(rest, w, None)).abs() <= int8_tolerance(rest, w)).all()


@needs_kernels
def test_int8_rows_of_tiny_values_are_tiny() -> None:
    """A row whose largest |x| is near float32's smallest (its int16 scale's inverse would overflow) gives
    outputs of about that size, not numbers of flipped signs."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (8, 64), dtype=torch.int8, generator=g)
    x = torch.randn(2, 64, generator=g) * torch.tensor([[1e-36], [1e-20]])
    w = q.double() * 1e-2
    y = kernels.matmul_int8(x, q, torch.full((8,), 1e-2), None).double()
    want = x.double() @ w.T
    assert (y[0] - want[0]).abs().max() <= want[0].abs().max()  # read as zero: off by at most the outputs' size
    torch.testing.assert_close(y[1], want[1], rtol=1e-3, atol=0)


def int8_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: float32 rounding, plus the int8 kernel's rounding of each row of x to int16 (at most half a
    step of max|x| / 32767 per element, times |w|)."""
    step = x.abs().amax(dim=1, keepdim=True) / 32767  # [M, 1]
    return tolerance(x, w) + 0.5 * step * w.abs().sum(dim=1)[None, :] * (1 + 1e-5)


@needs_kernels
def test_lm_head_shape() -> None:
    """The tied head's product, [rows, 768] @ wte.T with wte [50257, 768]: an output count no tile divides."""
    g = torch.Generator().manual_seed(0)
    wte = torch.randn(50257, 768, generator=g) * 0.15
    for m in (1, 2, 5, 8, 12, 16, 32):  # with AVX-512: 1-2 rows stream W's rows, 8-16 take outer products
        x = torch.randn(m, 768, generator=g)
        torch.testing.assert_close(kernels.matmul(x, wte), reference(x, wte, None), rtol=0, atol=tolerance(x, wte))


@needs_kernels
def test_threads_do_not_change_the_result() -> None:
    """Each output is summed by one thread in one order: 1 and 2 threads give the same bits."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3072, 768, generator=g)
    # the dot-product tiles; with AVX-512 the outer products too, with pieces of whole tiles (80 x 3072) and
    # fewer pieces than threads, N no multiple of the tile (61 x 5)
    for m, n in ((5, 3072), (80, 3072), (61, 5), (61, 1001)):
        x = torch.randn(m, 768, generator=g)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = kernels.matmul(x, w[:n])
            torch.set_num_threads(2)
            two = kernels.matmul(x, w[:n])
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two)


@needs_kernels
@pytest.mark.parametrize(("m", "n"), [(5, 7), (47, 5), (80, 33), (143, 17)])
def test_writes_only_its_outputs(m: int, n: int) -> None:
    """Every path writes y's m x n values and nothing past them (the C ABI, y with room after it)."""
    g = torch.Generator().manual_seed(m * 131 + n)
    w, bias, x = torch.randn(n, 40, generator=g), torch.randn(n, generator=g), torch.randn(m, 40, generator=g)
    y = torch.full((m + 2, n), float("nan"))
    lib = kernels._library()
    assert lib is not None
    threads = torch.get_num_threads()
    lib.gpt2_matmul_f32(x.data_ptr(), m, 40, w.data_ptr(), 40, bias.data_ptr(), y.data_ptr(), n, threads)
    torch.testing.assert_close(y[:m], reference(x, w, bias), rtol=0, atol=tolerance(x, w))
    assert y[m:].isnan().all()


@needs_kernels
def test_leading_dims_and_strided_input() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(2, 3, 48, generator=g)[..., ::2]  # [2, 3, 24], not contiguous
    y = kernels.matmul(x, w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, reference(x.reshape(-1, 24), w, None).view(2, 3, 40), rtol=0, atol=1e-4)


@needs_kernels
def test_model_uses_kernel_layers(tiny: Checkpoint) -> None:
    model = load_ours(tiny)
    assert type(model.h[0].attn.c_attn) is KernelConv1D and type(model.lm_head) is KernelLMHead
    assert model.h[0].mlp.c_fc.weight.t().is_contiguous()  # [out, in] rows, as the kernel reads them
    assert model.wte.weight.is_contiguous()


@needs_kernels
def test_kernel_layers_fall_back_for_prefill_and_autograd() -> None:
    """Many rows go to torch's GEMM, and so does a product that needs a gradient: same values either way."""
    g = torch.Generator().manual_seed(3)
    dense = Conv1D(32, 48)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(48, 32, generator=g).t())  # [in, out] with [out, in] rows
        dense.bias.copy_(torch.randn(48, generator=g))
    layer = KernelConv1D.__new__(KernelConv1D)
    torch.nn.Module.__init__(layer)
    layer.weight, layer.bias = dense.weight, dense.bias
    dense.requires_grad_(False)
    for rows in (1, kernels.max_rows(), kernels.max_rows() + 1, 600):
        x = torch.randn(rows, 32, generator=g)
        torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 32, generator=g, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    head = KernelLMHead()
    wte = torch.randn(100, 32, generator=g)
    torch.testing.assert_close(head(x.detach(), wte), TiedLMHead()(x.detach(), wte), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_max_rows_can_be_set(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """GPT2_KERNEL_MAX_ROWS caps the rows a product sends to the kernels; a value that is not a number is
    ignored with a warning, and the default depends on the CPU (512 without AVX-512, 2048 with it)."""
    default = kernels.MAX_ROWS_AVX2 if kernels.cpu_isa() == "avx2" else kernels.MAX_ROWS_AVX512
    try:
        monkeypatch.setenv("GPT2_KERNEL_MAX_ROWS", "7")
        kernels.max_rows.cache_clear()
        assert kernels.max_rows() == 7
        assert kernels.usable(torch.zeros(7, 4)) and not kernels.usable(torch.zeros(8, 4))
        monkeypatch.setenv("GPT2_KERNEL_MAX_ROWS", "lots")
        kernels.max_rows.cache_clear()
        with caplog.at_level("WARNING", logger="model.kernels"):
            assert kernels.max_rows() == default
        assert "GPT2_KERNEL_MAX_ROWS='lots' is not a whole number" in caplog.text
        monkeypatch.delenv("GPT2_KERNEL_MAX_ROWS")
        kernels.max_rows.cache_clear()
        assert kernels.max_rows() == default
    finally:
        monkeypatch.undo()
        kernels.max_rows.cache_clear()


def test_the_build_for_this_cpu(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """AVX-512 with VNNI, or AVX-512 where the CPU has F, VL and BW, else AVX2; GPT2_KERNEL_ISA chooses
    another (a value it does not know is ignored, saying so); each build has a library of its own."""
    flags = kernels.cpu_flags()
    default = "avx2"
    if {"avx512f", "avx512vl", "avx512bw"} <= flags:
        default = "avx512_vnni" if "avx512_vnni" in flags else "avx512"
    monkeypatch.delenv("GPT2_KERNEL_ISA", raising=False)  # the suite may run with the AVX2 build chosen
    try:
        kernels.cpu_isa.cache_clear()
        assert kernels.cpu_isa() == default
        for value, expected in (("avx2", "avx2"), ("sse9", default)):
            monkeypatch.setenv("GPT2_KERNEL_ISA", value)
            kernels.cpu_isa.cache_clear()
            assert kernels.cpu_isa() == expected
        assert "GPT2_KERNEL_ISA='sse9' is not one of avx2, avx512, avx512_vnni" in caplog.text
    finally:
        monkeypatch.undo()
        kernels.cpu_isa.cache_clear()
    paths = {kernels.library_path(isa) for isa in kernels.ISAS}
    assert len(paths) == 3 and kernels.library_path() == kernels.library_path(default)


@needs_kernels
@pytest.mark.parametrize("isa", [isa for isa in kernels.ISAS if isa != kernels.cpu_isa()])
def test_the_other_builds_match_too(isa: str) -> None:
    """The suite tests the build this CPU loads; each other build it can run (the AVX2 one on an AVX-512
    host: what an AVX2-only host loads) goes through the same products and fused passes here, in a process
    that loads it."""
    if isa not in kernels.runnable_isas():
        pytest.skip(f"this CPU cannot run the {isa} build (test_every_build_compiles compiles it)")
    tests = "(match or lm_head or threads or overflow or packed or chunk) and not other_builds"  # no recursion
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
         "tests/test_fused_decode.py", "-k", tests],
        cwd=ROOT,
        env=os.environ | {"GPT2_KERNEL_ISA": isa},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    loaded = subprocess.run(  # and it was that build that ran, not a slower one it fell back to
        [sys.executable, "-c", "from model import kernels; print(kernels._library()._name)"],
        cwd=ROOT, env=os.environ | {"GPT2_KERNEL_ISA": isa}, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert loaded.stdout.strip() == str(kernels.library_path(isa))


@pytest.mark.parametrize("isa", sorted(kernels.ISAS))
def test_every_build_compiles(isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each build compiles on any x86-64 host (compiling needs no CPU that runs it, as the image's build
    shows); the ones this CPU loads are tested for their results by the rest of the suite."""
    if kernels._compiler() is None or kernels._cpu_supported() is not None:
        pytest.skip("no C++ compiler, or not an x86-64 host with AVX2")
    if isa in kernels.runnable_isas():
        pytest.skip(f"the {isa} build is built and tested on this host by the rest of the suite")
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    assert kernels.build(isa=isa) == kernels.library_path(isa) and kernels.library_path(isa).is_file()


@needs_kernels
@pytest.mark.parametrize("fails", [["avx512_vnni"], ["avx512_vnni", "avx512"]])
def test_falls_back_to_a_slower_build(
    fails: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a build cannot be compiled (an old compiler that knows AVX-512 BW but not VNNI, say), the next
    slower one is loaded, saying so, down to AVX2."""
    real_build = kernels.build

    def build(compiler: str | None = None, isa: str | None = None) -> Path:
        if isa in fails:
            raise RuntimeError(f"c++ failed (exit 1): no {isa} here")
        if isa != "avx2":  # stands for a build that compiles, without needing this CPU to run it
            return real_build(compiler, "avx2")
        return real_build(compiler, isa)

    monkeypatch.setattr(kernels, "build", build)
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "avx512_vnni")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: kernels.NEEDS["avx512_vnni"])
    assert kernels.fallbacks() == ["avx512_vnni", "avx512", "avx2"]
    lib = kernels._library.__wrapped__()
    assert lib is not None and lib._name == str(kernels.library_path("avx2"))
    for isa in fails:
        assert f"the {isa} build of our CPU kernels failed (c++ failed (exit 1): no {isa} here)" in caplog.text
    assert ("avx512 build" in caplog.text) == ("avx512" in fails)


@needs_kernels
def test_a_cached_build_loads_where_none_can_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With no compiler, a slower build already in the cache is loaded, and the faster ones that cannot be
    made are named once, with why."""
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    kernels.build(isa="avx2")
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "avx512_vnni")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: kernels.NEEDS["avx512_vnni"])
    with caplog.at_level("WARNING", logger="model.kernels"):
        lib = kernels._library.__wrapped__()
    assert lib is not None and lib._name == str(kernels.library_path("avx2"))
    assert caplog.messages == [
        "the avx512_vnni and avx512 build of our CPU kernels cannot be made (no C++ compiler found (tried $CXX, "
        "c++, g++, clang++)): the avx2 build in the cache is used"
    ]


@needs_kernels
def test_a_cut_short_build_in_the_cache_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A library in the cache cut short (it would load, then end the process with SIGBUS) is not loaded: it
    is built again, with a warning; where nothing can be built, the build is refused as not there."""
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    path = kernels.build(isa="avx2")
    whole = path.read_bytes()
    assert kernels.whole_elf(path)
    for cut in (0, 3, 63, 64, len(whole) // 3, len(whole) - 1):
        path.write_bytes(whole[:cut])
        assert not kernels.whole_elf(path), cut
    path.write_bytes(b"not a library at all, but long enough to hold an ELF header of 64 bytes......")
    assert not kernels.whole_elf(path)
    path.write_bytes(whole[: len(whole) // 2])
    with caplog.at_level("WARNING", logger="model.kernels"):
        assert kernels.build(isa="avx2") == path
    assert "is cut short, damaged or unreadable: building it again" in caplog.text
    assert kernels.whole_elf(path) and path.stat().st_size >= len(whole) * 0.9
    path.write_bytes(whole[: len(whole) // 2])
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    with pytest.raises(kernels.NoBuilds, match="no C\\+\\+ compiler found"):
        kernels.build(isa="avx2")


def test_build_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        kernels.build(compiler="false")  # a "compiler" that always fails


FALLBACK = """
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
from model import kernels
from model.loading import load_weights
m = load_weights(sys.argv[1], dtype="float32", device="cpu")
m8 = load_weights(sys.argv[1], dtype="int8", device="cpu")
ids = torch.tensor([[1, 2, 3, 4, 5]])
with torch.inference_mode():
    out = [m(ids)[0, -1, :8].tolist(), m8(ids)[0, -1, :8].tolist()]
print(json.dumps({"available": kernels.available(), "layer": type(m.h[0].attn.c_attn).__name__,
                  "head": type(m.lm_head).__name__, "int8": type(m8.h[0].attn.c_attn).__name__, "logits": out}))
"""


def run_fallback(tiny: Checkpoint, env: dict[str, str]) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK, str(tiny.path)],
        cwd=ROOT,
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("how", ["no compiler", "unusable cache", "turned off"])
def test_fallback_without_kernels(tiny: Checkpoint, tmp_path: Path, how: str) -> None:
    """With no compiler, a cache folder that cannot hold a build (or GPT2_KERNELS=0) the model loads with the
    stock layers, says why once (not once for each ISA it would have tried), and computes the reference's
    logits; int8 works too, on the dequantizing path, and says that it will be slower than float32."""
    env = {"GPT2_KERNEL_CACHE": str(tmp_path / "empty-cache")}
    if how == "no compiler":
        env |= {"CXX": "/nonexistent/c++", "PATH": str(tmp_path)}
    elif how == "unusable cache":
        (tmp_path / "a-file").write_text("not a folder")
        env |= {"GPT2_KERNEL_CACHE": str(tmp_path / "a-file" / "cache")}
    else:
        env |= {"GPT2_KERNELS": "0"}
    report, stderr = run_fallback(tiny, env)
    assert report["available"] is False
    assert (report["layer"], report["head"], report["int8"]) == ("Conv1D", "TiedLMHead", "Int8Conv1D")
    assert stderr.count("int8 without our CPU kernels") == 1, stderr  # it will be slow: said
    if how != "turned off":
        assert stderr.count("kernels are not available") == 1, stderr
        assert "build of our CPU kernels" not in stderr, stderr
        why = r"no C\+\+ compiler found" if how == "no compiler" else "the kernel cache .* cannot hold a build"
        assert re.search(why, stderr), stderr
    with torch.inference_mode():
        expected = tiny.hf(torch.tensor([[1, 2, 3, 4, 5]])).logits[0, -1, :8]
    torch.testing.assert_close(torch.tensor(report["logits"][0]), expected, rtol=0, atol=1e-4)
    assert (torch.tensor(report["logits"][1]) - expected).abs().max() < 1.0  # int8: close, not equal


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_bias_that_needs_a_gradient_gets_it(tiny: Checkpoint, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bias trained alone (BitFit), the weights frozen and the input needing no gradient: its product goes to
    torch, not to the kernels (which record no gradient), and the gradient is the stock layers' own."""
    model = load_weights(tiny.path, dtype=dtype, device="cpu")
    bias = model.h[0].attn.c_attn.bias
    bias.requires_grad_(True)
    idx = torch.tensor([[5, 6, 7, 8]])
    model(idx).logsumexp(dim=-1).sum().backward()
    assert bias.grad is not None
    got, bias.grad = bias.grad, None
    monkeypatch.setattr(kernels, "max_rows", lambda: 0)  # every product on torch's stock kernels
    model(idx).logsumexp(dim=-1).sum().backward()
    torch.testing.assert_close(got, bias.grad, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    with torch.no_grad():  # no gradient recorded: the kernels again
        assert kernels.usable(torch.zeros(4, 64), bias)


@needs_kernels
def test_a_relative_cache_folder_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT2_KERNEL_CACHE=. names the working directory: the library's path is made absolute, since ctypes
    looks a bare file name up on the system's library path (where it would never be found)."""
    built = kernels.library_path()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPT2_KERNEL_CACHE", ".")
    assert kernels.library_path() == Path.cwd() / built.name
    shutil.copy(built, built.name)  # the build the suite made, as though made here
    lib = kernels._library.__wrapped__()
    assert lib is not None and lib._name == str(Path.cwd() / built.name)
