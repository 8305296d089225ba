"""Reads tensors out of a `.safetensors` file one at a time, with plain file reads.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header length, a JSON
header mapping each name to its dtype, shape and byte range, then the raw little-endian bytes. Reading
each tensor straight into its own buffer keeps peak memory at the weights plus one tensor (a memory map
would count every touched page of the file as resident too), and a truncated or foreign file is caught
from the header, with a message, before any tensor is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

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
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise SafetensorsError(f"{self.path} is not a safetensors file: its header is not JSON") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path} is not a safetensors file: its header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
        data_start = 8 + header_len
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            self.entries[name] = self._entry(name, info, data_start, size)

    def _entry(self, name: str, info: object, data_start: int, size: int) -> TensorEntry:
        try:
            assert isinstance(info, dict)
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (AssertionError, KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{self.path}: malformed header entry for tensor {name!r}: {info!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise SafetensorsError(
                f"{self.path}: tensor {name!r} of shape {list(shape)} needs {nbytes} bytes "
                f"but its header gives the range {begin}..{end}"
            )
        if data_start + end > size:
            raise SafetensorsError(
                f"{self.path} is truncated: tensor {name!r} ends at byte {data_start + end} "
                f"but the file has only {size} bytes"
            )
        return TensorEntry(name, dtype, shape, data_start + begin, nbytes)

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh CPU memory."""
        entry = self.entries[name]
        buf = bytearray(entry.nbytes)
        with self.path.open("rb") as f:
            f.seek(entry.begin)
            if f.readinto(buf) != entry.nbytes:
                raise SafetensorsError(f"{self.path} is truncated: could not read tensor {name!r}")
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(buf, dtype=entry.dtype).view(entry.shape)
