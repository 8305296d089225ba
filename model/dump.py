"""Activation dumps: hook name -> tensor, in one safetensors file that loads in one line.

    tensors = safetensors.torch.load_file("dump.safetensors")          # torch
    arrays = safetensors.numpy.load_file("dump.safetensors")           # numpy (bfloat16 needs torch)

The header's metadata (strings only, as the format requires) carries what the dump is of: the model,
the token ids (as JSON) and the text.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .safetensors_file import SafetensorsFile

# safetensors' names of the dtypes a dump can hold
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _metadata(meta: dict[str, Any]) -> dict[str, str]:
    """The metadata as the format takes it, strings: values that are not are JSON, and text that is not valid
    Unicode (a path's bytes that are not UTF-8, read by Python as lone surrogates) has those characters
    replaced by U+FFFD, which no reader would parse otherwise."""
    out = {}
    for k, v in meta.items():
        text = v if isinstance(v, str) else json.dumps(v)
        try:  # a byte that is not UTF-8, as surrogateescape read it, back to that byte: one U+FFFD
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # another lone surrogate
            raw = text.encode("utf-8", "surrogatepass")
        out[k] = raw.decode("utf-8", "replace")
    return out


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor on the CPU and contiguous, as its bytes are written (two names may hold one tensor: a
    gradient at blocks.3.hook_resid_post is the one at blocks.4.hook_resid_pre; its bytes are written twice)."""
    return {name: t.detach().cpu().contiguous() for name, t in tensors.items()}


def dump_path_problem(path: str | Path) -> str | None:
    """Why a dump cannot be written to `path` (None: it looks writable), to ask before the work that makes
    the dump. The file is written to a temporary name and renamed over the target, which would replace a
    device or a pipe; a symlink is followed to the file it names."""
    if str(path).endswith("/"):  # Path() drops the slash: "out.safetensors/" would be written as a file
        return f"cannot write {path}: a file's name does not end in /"
    if not Path(path).parent.is_dir():
        return f"cannot write {path}: no directory {Path(path).parent}"
    try:
        target = Path(path).resolve()  # through symlinks: where the file will be
    except (OSError, RuntimeError) as e:  # a symlink loop
        return f"cannot write {path}: {e}"
    if not target.parent.is_dir():
        return f"cannot write {path}: it links to {target}, in no directory"
    if target.is_dir():
        return f"cannot write {path}: it is a directory"
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):
        return f"cannot write {path}: it is not a regular file"
    try:  # the file is made beside its target: that directory must take a new file (permissions, read-only disk)
        _new_file_beside(target).unlink()
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    return None


def save_dump(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write `tensors` with `metadata` (values that are not strings are stored as JSON) to `path`, through a
    symlink to the file it names, with the mode of the file it replaces or the one a new file gets from the
    umask: written whole to a temporary file beside it, then renamed over it, so that the path holds the old
    file or the new one, never a part (an error, Ctrl-C, a full disk). A path `dump_path_problem` refuses is
    a `ValueError`."""
    if problem := dump_path_problem(path):
        raise ValueError(problem)
    if not tensors:  # safetensors writes the file, then cannot read it back
        raise ValueError(f"cannot write {path}: a dump needs at least one tensor")
    pieces = dump_pieces(tensors, metadata)

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as f:
            for piece in pieces:
                f.write(piece)

    replace_whole(path, write)


def replace_whole(path: str | Path, write: Callable[[Path], None]) -> None:
    """Have `write` write a file to a temporary path beside `path` (through a symlink, beside the file it names),
    then rename it over `path`, with the mode of the file it replaces or the one a new file gets from the
    umask: `path` holds the old file or the new one, never a part. Any error removes the temporary file."""
    target = Path(path).resolve()
    temporary = _new_file_beside(target)
    try:
        mode = stat.S_IMODE((target if target.exists() else temporary).stat().st_mode)
        write(temporary)
        os.chmod(temporary, mode)  # a writer may have put a file of its own there (safetensors' does, 0600)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _new_file_beside(target: Path) -> Path:
    """A new empty file in `target`'s directory, under a name of its own (ending as `target`'s, for writers
    that read the format from it), with the mode any new file gets (the umask's)."""
    while True:
        temporary = target.with_name(f".{target.stem}.{secrets.token_hex(4)}.part{target.suffix}")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return temporary
        except FileExistsError:
            continue


def dump_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> bytes:
    """The same file as `save_dump` writes, in memory."""
    return b"".join(dump_pieces(tensors, metadata))


def dump_pieces(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> list[bytes | memoryview]:
    """The safetensors file of `tensors` and `metadata`, in the pieces it is made of, in order: the header
    (its length in 8 bytes, then JSON padded with spaces to a multiple of 8), then each tensor's bytes, a
    view of the tensor's own memory (little-endian, as the format's bytes are, on the hosts this runs on).
    Written or sent piece by piece, a dump of hundreds of megabytes is not copied whole (safetensors' `save`
    copies it twice)."""
    for name, t in tensors.items():
        if name == "__metadata__":  # the header's own key: the file would not parse
            raise ValueError("a dump cannot hold a tensor named __metadata__ (the format's key for its metadata)")
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: a dump cannot hold {t.dtype}")
    # as safetensors lays a file out: the widest elements first, then by name, so every tensor starts at a
    # multiple of its element's size (the header is padded to 8)
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    tensors = _on_cpu({name: tensors[name] for name in order})
    header: dict[str, Any] = {"__metadata__": _metadata(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > _MAX_HEADER:
        raise ValueError(f"the dump's header takes {len(text)} bytes, over the {_MAX_HEADER} safetensors reads")
    raw = [t.reshape(-1).view(torch.uint8).numpy().data for t in tensors.values()]
    return [struct.pack("<Q", len(text)) + text, *raw]


_MAX_HEADER = 100_000_000  # safetensors refuses to read a longer header


def load_dump(path: str | bytes | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a dump (read by our own reader, which takes any path the OS does, as
    text or bytes: safetensors' refuses one that is not UTF-8). A file that is missing, unreadable or not a
    dump is a `SafetensorsError` (a `ValueError`) that says which and why."""
    st = SafetensorsFile(os.fsdecode(path))
    return st.read_all(), dict(st.metadata)
