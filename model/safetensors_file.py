"""Reads tensors out of a `.safetensors` file one at a time, with plain file reads.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header length, a JSON
header mapping each name to its dtype, shape and byte range, then the raw little-endian bytes. Reading
each tensor straight into its own buffer keeps peak memory at the weights plus one tensor (a memory map
would count every touched page of the file as resident too), and a truncated or foreign file is caught
from the header, with a message, before any tensor is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path

import torch

from .json_file import clip

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


MAX_HEADER = 100_000_000  # bytes: the official library's limit (a hostile header would be read into memory)


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the file
    nbytes: int


class SafetensorsFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise SafetensorsError(f"{self.path} is not a safetensors file: it is only {size} bytes long")
                header_len = int.from_bytes(prefix, "little")
                if header_len > MAX_HEADER:
                    raise SafetensorsError(
                        f"{self.path} is not a safetensors file: its header claims {header_len} bytes, more than "
                        f"the {MAX_HEADER} the format allows"
                    )
                if header_len > size - 8:
                    raise SafetensorsError(
                        f"{self.path} is not a safetensors file (or is truncated): its header claims "
                        f"{header_len} bytes but the file has {size}"
                    )
                raw = f.read(header_len)
        except OSError as e:
            raise SafetensorsError(f"cannot read {self.path}: {e.strerror or e}") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except ValueError as e:  # not UTF-8, not JSON, or a number of more than 4300 digits
            raise SafetensorsError(f"{self.path} is not a safetensors file: its header is not JSON ({e})") from None
        except RecursionError:
            raise SafetensorsError(f"{self.path} is not a safetensors file: its header is nested too deeply") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path} is not a safetensors file: its header is not a JSON object")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (
            isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())  # JSON keys are strings
        ):
            raise SafetensorsError(
                f"{self.path}: the header's __metadata__ must be an object of strings, got {clip(meta, json.dumps)}"
            )
        self.metadata: dict[str, str] = meta or {}
        data_start = 8 + header_len
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            self.entries[name] = self._entry(name, info, data_start, size)
        self._check_layout(data_start, size)

    def _entry(self, name: str, info: object, data_start: int, size: int) -> TensorEntry:
        if not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= info.keys()):
            raise SafetensorsError(
                f"{self.path}: malformed header entry for tensor {clip(name)}: {clip(info, json.dumps)} "
                "(each tensor needs its dtype, shape and data_offsets)"
            )
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise SafetensorsError(
                f"{self.path}: tensor {clip(name)} has the unsupported dtype {clip(dtype_name, json.dumps)} "
                f"(this reader takes {', '.join(DTYPES)})"
            )
        if not (isinstance(shape, list) and all(_count(d) for d in shape)):
            raise SafetensorsError(
                f"{self.path}: malformed header entry for tensor {clip(name)}: its shape must be a list of "
                f"non-negative integers below 2**64, got {clip(shape, json.dumps)}"
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
            raise SafetensorsError(
                f"{self.path}: malformed header entry for tensor {clip(name)}: its data_offsets must be two "
                f"non-negative integers below 2**64, got {clip(offsets, json.dumps)}"
            )
        dtype, shape, (begin, end) = DTYPES[dtype_name], tuple(shape), offsets
        nbytes = _nbytes(shape, dtype)
        if nbytes is None:
            raise SafetensorsError(
                f"{self.path}: tensor {clip(name)} of shape {clip(list(shape))} is too large: its size overflows "
                "64 bits (as the official safetensors library counts it)"
            )
        if end - begin != nbytes:
            raise SafetensorsError(
                f"{self.path}: tensor {clip(name)} of shape {clip(list(shape))} needs {nbytes} bytes "
                f"but its header gives the range {begin}..{end}"
            )
        if data_start + end > size:
            raise SafetensorsError(
                f"{self.path} is truncated: tensor {clip(name)} ends at byte {data_start + end} "
                f"but the file has only {size} bytes"
            )
        return TensorEntry(name, dtype, shape, data_start + begin, nbytes)

    def _check_layout(self, data_start: int, size: int) -> None:
        """The tensors' byte ranges must tile the data from its start to the end of the file, without gaps,
        overlaps or bytes left over, as the official `safetensors` library requires ("invalid offset",
        "file not fully covered")."""
        end, before = data_start, "the data begins"
        for entry in sorted(self.entries.values(), key=lambda e: (e.begin, e.nbytes)):
            if entry.begin != end:
                raise SafetensorsError(
                    f"{self.path}: invalid offset for tensor {clip(entry.name)}: its bytes begin at "
                    f"{entry.begin - data_start} but {before} at {end - data_start} (the tensors' byte ranges "
                    "must follow each other without gaps or overlaps)"
                )
            end, before = entry.begin + entry.nbytes, f"tensor {clip(entry.name)} ends"
        if end != size:
            raise SafetensorsError(
                f"{self.path}: {size - end} bytes after the end of the tensors' data: it ends at byte {end}, the "
                f"file at byte {size} (every byte of the data must belong to a tensor)"
            )

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh CPU memory."""
        with self.path.open("rb") as f:
            return self._read(f, name)

    def read_all(self) -> dict[str, torch.Tensor]:
        """Read every tensor into fresh CPU memory (the file opened once), by name in the header's order."""
        with self.path.open("rb") as f:
            return {name: self._read(f, name) for name in self.entries}

    def _read(self, f: BufferedReader, name: str) -> torch.Tensor:
        entry = self.entries[name]
        buf = bytearray(entry.nbytes)
        f.seek(entry.begin)
        if f.readinto(buf) != entry.nbytes:
            raise SafetensorsError(f"{self.path} is truncated: could not read tensor {clip(name)}")
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(buf, dtype=entry.dtype).view(entry.shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
    """The bytes a tensor of `shape` and `dtype` takes, or None where the official library's count
    overflows 64 bits (elements, dimension by dimension, then bits): it refuses such a shape, and
    a product of a hostile one (a million dimensions of 2**62) would run for hours."""
    elements = 1
    for d in shape:
        elements *= d
        if elements >= 2**64:
            return None
    bits = elements * dtype.itemsize * 8
    return bits // 8 if bits < 2**64 else None


def _count(value: object) -> bool:
    """Whether a header's shape entry or offset is a non-negative JSON integer below 2**64 (not a float, bool
    or string), as the official library reads them (as 64-bit unsigned integers)."""
    return type(value) is int and 0 <= value < 2**64
