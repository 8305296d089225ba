"""A model's weights in huge pages (2 MB) on the CPU, because a decode step streams every one of them.

At one row a decode step reads every weight once and does little else, so it runs as fast as memory
streams in. In 4 KB pages that stream misses the TLB every 4 KB (in a virtual machine each miss walks two
levels of page tables); in 2 MB pages, 512 times less often. Linux backs private anonymous memory with
huge pages where it is advised to (madvise MADV_HUGEPAGE) if transparent huge pages are `madvise` or
`always` (/sys/kernel/mm/transparent_hugepage/enabled); what torch allocates itself gets them only under
`always` (or with THP_MEM_ALLOC_ENABLE=1 set before torch starts). Measured on a 2-core AVX2 KVM guest
(THP `madvise`), gpt2-small: the float32 decode step at one row 25-27 -> 22.3-23.2 ms, int8 9.3 -> 7.4
ms, at 8 rows 3-6% faster. Where there are none (not Linux, THP `never`), the weights stay where they
are. The move costs, once, at load, a copy and the first touch of each page (about 0.9 s a GB on that
host), and for a moment the largest tensor twice (gpt2-small's wte, 147 MiB).

The KV cache stays as torch makes it. Attention alone reads it faster from huge pages (32 rows at 300
positions, 12 layers: 52 -> 39 ms), but a server replay (32 requests, 16 at a time, prompts up to 256
tokens) was no faster, and each 2 MB page's first touch costs about 1 ms there (0.9 s a GB against 0.3 s
in 4 KB pages): a server's cache would take seconds more to make, or its rows longer to first use.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

THP = Path("/sys/kernel/mm/transparent_hugepage")
THP_MODE = THP / "enabled"


@functools.cache
def mode() -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise` or `never`), or None where there is none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


@functools.cache
def page_size() -> int:
    """Bytes in a huge page: 2 MB on x86-64 (and arm64 with 4 KB base pages), as the kernel says."""
    try:
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


def available() -> bool:
    """Whether memory advised for huge pages can get them here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and mode() in ("always", "madvise")


_mappings: list[tuple[weakref.ref[mmap.mmap], int, int]] = []  # ours, alive or not: (mapping, first, end address)


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """Private anonymous memory of zeros advised for huge pages, with room for `nbytes` from a huge-page
    boundary: the mapping, and the byte offset of that boundary in it."""
    mapping = mmap.mmap(-1, nbytes + page_size(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    first = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()  # the mapping's address
    _mappings[:] = [m for m in _mappings if m[0]() is not None]
    _mappings.append((weakref.ref(mapping), first, first + len(mapping)))
    return mapping, -first % page_size()


def _bytes(mapping: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] at `offset` in `mapping`, a storage of its own (what pickle and torch.save see of it)
    that holds the mapping for as long as it lives: the mapping is unmapped after its last such storage."""
    return torch.frombuffer(memoryview(mapping)[offset : offset + nbytes], dtype=torch.uint8)


def _ours(address: int) -> bool:
    return any(m() is not None and first <= address < end for m, first, end in _mappings)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the CPU in huge pages where there are (the kind of memory the
    weights are in, for a benchmark that measures it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not available() or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping, start = _mapping(nbytes)
    return _bytes(mapping, start, nbytes).view(dtype).view(shape)


def _movable(t: torch.Tensor, again: bool) -> bool:
    """A plain strided CPU tensor with memory of its own to move (not already in huge pages of ours, unless
    `again`)."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not (t.is_quantized or t.is_conj() or t.is_neg())
        and t.untyped_storage().nbytes() > 0
        and (again or not _ours(t.untyped_storage().data_ptr()))
    )


def move_into(module: nn.Module, again: bool = False) -> bool:
    """Move the CPU parameters and buffers of `module` into one mapping advised for huge pages, each with its
    values, shape, strides and dtype, tensors that shared a storage still sharing one (tied weights, views),
    parameters the same objects (and requires_grad). Run it before anything takes the tensors' addresses
    (a `FusedDecode`); tensors outside the module that shared memory with it stop sharing it. One storage
    at a time, each freed once moved (if nothing else holds it): the move needs the module's memory and its
    largest storage. The mapping lives while any of the moved storages does. Returns whether it moved
    anything (not where there are no huge pages, for less than a page, nor a second time unless `again`: into
    a new mapping, so that the old one, holding weights the module no longer has, goes with its last tensor)."""
    if not available():
        return False
    by_storage: dict[int, list[torch.Tensor]] = {}  # the tensors on each storage, by its address
    for t in (*module.parameters(), *module.buffers()):
        if _movable(t, again):
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = {a: -(-ts[0].untyped_storage().nbytes() // 64) * 64 for a, ts in by_storage.items()}  # cache lines
    if sum(sizes.values()) < page_size():
        return False
    mapping, offset = _mapping(sum(sizes.values()))
    for address, group in by_storage.items():
        storage = group[0].untyped_storage()
        moved = _bytes(mapping, offset, storage.nbytes())
        moved.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        for t in group:
            with torch.inference_mode(t.is_inference()):  # an inference tensor stays one, a normal one normal
                t.data = torch.empty(0, dtype=t.dtype).set_(
                    moved.untyped_storage(), t.storage_offset(), t.size(), t.stride()
                )
        offset += sizes[address]
        del storage, moved, group[:]  # the old storage goes once nothing else holds it,
        trim_heap()  # and its pages back to the system now, not at the end: the peak stays near one copy
    return True


def move_or_stay(module: nn.Module, again: bool = False) -> None:
    """`move_into`, where a failure (no memory for the mapping, say) leaves the weights where they are, with a
    warning."""
    try:
        move_into(module, again)
    except (OSError, RuntimeError) as e:
        log.warning("the weights stay in ordinary pages (moving them into huge pages failed: %s)", e)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing): a checkpoint
    read in pieces of a few MB lands on the heap, and freed there it would stay in the process."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, looked up once (None where the C library has none)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)
