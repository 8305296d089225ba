"""SAELens' cached-activations format: a Hugging Face `datasets` Arrow dataset with one
`Array2D(shape=(context, d_in))` column per hook and a `token_ids` column (`Sequence(Value("int32"),
length=context)`), the features `sae_lens.CacheActivationsRunner` gives its datasets, so that SAELens
trains from the folder through `cached_activations_path` (its `ActivationsStore` reads it with
`datasets.load_from_disk`).

Each shard is one Arrow file of the dataset; `state.json` and `dataset_info.json` (what `load_from_disk`
reads) list the shards written so far and are rewritten after each one. Arrow has no bfloat16, so a
bfloat16 harvest is stored as float32 (exactly: every bfloat16 value is a float32 value).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import HarvestError
from .shards import write_atomic

SUFFIX = ".arrow"
_ARROW_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "float32"}


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise HarvestError("SAELens' format needs datasets: pip install 'gpt2-server[harvest]'") from None
    return datasets


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the Arrow columns hold for activations computed in `dtype`."""
    if dtype not in _ARROW_DTYPES:
        raise HarvestError(
            f"SAELens' format cannot hold {dtype}; valid: float32, float16, bfloat16 (stored as float32)"
        )
    return torch.float32 if dtype == torch.bfloat16 else dtype


def check_hooks(shapes: dict[str, list[int]]) -> None:
    """SAELens' columns are [context, d_in]: refuse hooks of other shapes, naming them."""
    bad = {name: shape for name, shape in shapes.items() if len(shape) != 2}
    if bad:
        listed = ", ".join(f"{n} [{', '.join(map(str, s))}]" for n, s in bad.items())
        raise HarvestError(
            f"SAELens' cached format holds one [context, d_in] array per hook; {listed} "
            "is not of that shape (an attention square): harvest them with --format safetensors"
        )


def features(shapes: dict[str, list[int]], context_size: int, dtype: torch.dtype) -> Any:
    """The `datasets.Features` of `CacheActivationsRunner`: one Array2D per hook, then `token_ids`."""
    ds = _datasets()
    cols: dict[str, Any] = {
        name: ds.Array2D(shape=tuple(shape), dtype=_ARROW_DTYPES[dtype]) for name, shape in shapes.items()
    }
    cols["token_ids"] = ds.Sequence(ds.Value(dtype="int32"), length=context_size)
    return ds.Features(cols)


def shard_bytes(acts: dict[str, torch.Tensor], token_ids: torch.Tensor, feats: Any) -> bytes:
    """One shard as an Arrow stream file, as `Dataset.save_to_disk` writes its data files."""
    import pyarrow as pa

    columns: dict[str, Any] = {name: t.to(stored_dtype(t.dtype)).numpy() for name, t in acts.items()}
    columns["token_ids"] = token_ids.to(torch.int32).numpy()
    table = _datasets().Dataset.from_dict(columns, features=feats).data.table
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def shard_token_ids(path: Path) -> np.ndarray:
    """The token ids [rows, context] of one shard's Arrow file."""
    import pyarrow as pa

    with pa.memory_map(os.fsencode(path)) as source:  # as bytes: a str path must be UTF-8 to Arrow
        table = pa.ipc.open_stream(source).read_all()
    column = table.column("token_ids").combine_chunks()  # fixed-size lists of int32
    return np.asarray(column.flatten()).reshape(len(table), -1)


def write_dataset_files(out_dir: Path, files: list[str], feats: Any) -> None:
    """`state.json` and `dataset_info.json` for the shards `files` (in order), so that
    `datasets.load_from_disk(out_dir)` reads them as one dataset."""
    ds = _datasets()
    fingerprint = hashlib.sha256("\n".join(files).encode() + json.dumps(feats.to_dict()).encode()).hexdigest()[:16]
    state: dict[str, Any] = {
        "_data_files": [{"filename": f} for f in files],
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    with tempfile.TemporaryDirectory() as tmp:
        ds.DatasetInfo(features=feats).write_to_directory(tmp)
        info = (Path(tmp) / "dataset_info.json").read_bytes()
    state_json = (json.dumps(state, indent=2) + "\n").encode()
    for path, data in ((out_dir / "dataset_info.json", info), (out_dir / "state.json", state_json)):
        if not (path.is_file() and path.read_bytes() == data):  # as it is: left alone (a read-only folder too)
            write_atomic(path, data)
