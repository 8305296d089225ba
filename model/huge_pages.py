"""A model's weights in 2 MB pages on the CPU, because a decode step streams every one of them.

At one row a decode step reads every weight once and does little else, so it runs as fast as memory
streams in. In 4 KB pages that stream misses the TLB every 4 KB (in a virtual machine each miss walks two
levels of page tables); in 2 MB pages, 512 times less often. Linux backs private anonymous memory with
2 MB pages where it is advised to (madvise MADV_HUGEPAGE) if transparent huge pages are `madvise` or
`always` (/sys/kernel/mm/transparent_hugepage/enabled); what torch allocates itself gets them only under
`always`. Measured on a 2-core AVX2 KVM guest (THP `madvise`), gpt2-small: the float32 decode step at one
row 25-27 -> 22.3-23.2 ms, int8 9.3 -> 7.4 ms, at 8 rows 3-6% faster. Where there are none (not Linux,
THP `never`), the weights stay where they are. The move costs a copy and the first touch of each page
(about 0.9 s a GB on that host), once, at load.

The KV cache stays as torch makes it: a server replay (32 requests, 16 at a time) was no faster with it in
2 MB pages, and there a page's first touch cost about 1 ms (0.9 s a GB, against 0.3 s in 4 KB pages).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from pathlib import Path

import torch
from torch import nn

PAGE = 2 << 20  # bytes in a huge page (x86-64 and arm64 with 4 KB base pages)
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def mode() -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise` or `never`), or None where there is none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def available() -> bool:
    """Whether memory advised for 2 MB pages can get them here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and mode() in ("always", "madvise")


def _region(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeros starting on a 2 MB boundary, in private anonymous memory advised for 2 MB pages;
    its mapping lives as long as any tensor on it (torch.frombuffer holds it) and is unmapped after."""
    mapping = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % PAGE
    return whole[start : start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the CPU in 2 MB pages where there are (the kind of memory the
    weights are in, for a benchmark that measures it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not available():
        return torch.zeros(shape, dtype=dtype)
    return _region(nbytes).view(dtype).view(shape)


def move_into(module: nn.Module) -> bool:
    """Move every CPU parameter and buffer of `module` into one region of 2 MB pages, each with its values,
    shape, strides and dtype, tensors that shared memory still sharing it (tied weights, views), parameters
    the same objects. One storage at a time, each freed once moved (if nothing else holds it), so the move
    needs little more memory than the module. Returns whether it moved them (not where there are no 2 MB
    pages, nor for less than a page of them)."""
    if not available():
        return False
    by_storage: dict[int, list[torch.Tensor]] = {}  # the tensors on each storage, by its address
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type == "cpu":
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = {a: -(-ts[0].untyped_storage().nbytes() // 64) * 64 for a, ts in by_storage.items()}  # cache lines
    if sum(sizes.values()) < PAGE:
        return False
    region = _region(sum(sizes.values()))
    whole, offset = region.untyped_storage(), region.storage_offset()  # bytes into `whole`
    whole_bytes = torch.empty(0, dtype=torch.uint8).set_(whole)
    for address, group in by_storage.items():
        storage = group[0].untyped_storage()
        whole_bytes[offset : offset + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        for t in group:
            first = offset + t.storage_offset() * t.element_size()
            t.data = torch.empty(0, dtype=t.dtype).set_(whole, first // t.element_size(), t.size(), t.stride())
        offset += sizes[address]
        del storage, group[:]  # the old storage goes once nothing else holds it,
        _trim_heap()  # and its pages back to the system now, not at the end: the peak stays near one copy
    return True


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing): a checkpoint
    read in pieces of a few MB lands on the heap, and freed there it would stay in the process."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
